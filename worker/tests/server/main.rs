//! The HTTP API (mole-server) end to end on a real listener: the OpenAI-compatible endpoints,
//! guards, hostile input, routing, canaries, vision serving and the schema corpus.
//!
//! One test binary for these files (each a module), so the stack below them links once.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test
#![allow(clippy::disallowed_methods)] // tests read results back from the device

#[path = "../common/mod.rs"]
mod common;

mod canary;
mod router_embed;
mod schema_coverage;
mod server_api;
mod server_guards;
mod server_hostile;
mod vision_serve;
