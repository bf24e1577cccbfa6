//! The engine (mole-engine): continuous batching, adapters, chat, classifiers, GGUF bases, images,
//! prefix caching, replicas and structured outputs, each against a reference run.
//!
//! One test binary for these files (each a module), so the stack below them links once.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test
#![allow(clippy::disallowed_methods)] // tests read results back from the device

#[path = "../common/mod.rs"]
mod common;

mod engine;
mod engine_adapters;
mod engine_batching;
mod engine_chat;
mod engine_classifier;
mod engine_gguf;
mod engine_images;
mod engine_prefix;
mod engine_replicas;
mod engine_structured;
