//! mole worker: a candle engine with multi-LoRA batching, a router and an OpenAI-compatible
//! HTTP API, plus the merge/import/inspect tools that run in merge Jobs.
//!
//! Layers, from the ground up; each imports only those below it:
//! - `mole_formats` (crates/formats), below all of it: on-disk formats (safetensors, HF
//!   model directories, PEFT adapters, GGUF) with their validation rules.
//! - `mole_kernels` (crates/kernels): CPU host kernels read in place from tensor storage, and
//!   the device's BGMV LoRA kernels.
//! - `mole_model` (crates/model): the decoder, one struct per part, and how it applies
//!   adapters.
//! - `mole_engine` (crates/engine): adapters as served (`lora`: loading and validation, the
//!   registry of versions), the engine thread, continuous batching, sampling, text.
//! - [`router`]: which adapter serves a request that names none.
//! - [`config`], [`metrics`]: the worker's configuration and metrics (logs and traces are
//!   `mole_telemetry`'s, shared with the operator).
//! - [`progress`]: progress bars and lines of the long-running tools.
//! - [`merge`]: the merge Job's tool, which a local worker also runs for its merged adapters;
//!   [`quantize`] quantizes its output after it (`merge --quantize` in the Job).
//! - [`server`]: the HTTP API.
//!
//! Tools on top, which nothing in the serving path imports: [`import`], [`inspect`],
//! [`prune`], [`bench`], [`fetch`] (pulls models and adapters from `hf://` and `s3://`).
//! Cargo holds the crates below to this order; `tests/layers.rs` holds this crate's modules.

// clippy.toml keeps device→host copies and concatenation out of the decode path: mole-model
// and mole-engine's lora (crates of their own). The rest of the worker (tools, server) may
// use them.
#![allow(clippy::disallowed_methods)]

pub mod bench;
pub mod config;
pub mod fetch;
pub mod import;
pub mod inspect;
pub mod merge;
pub mod metrics;
pub mod progress;
pub mod prune;
pub mod quantize;
pub mod router;
pub mod server;
