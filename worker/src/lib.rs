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
//! - `mole_tools` (crates/tools): merge, quantize, import, fetch, prune, inspect and their
//!   progress lines; a local worker runs the merge in-process for its merged adapters.
//! - [`router`]: which adapter serves a request that names none.
//! - [`config`], [`metrics`]: the worker's configuration and metrics (logs and traces are
//!   `mole_telemetry`'s, shared with the operator).
//! - [`server`]: the HTTP API.
//! - [`bench`], on top: benchmarks that print ratios measured side by side.
//!
//! Cargo holds the crates to this order; `tests/layers.rs` holds this crate's modules.

// clippy.toml keeps device→host copies and concatenation out of the decode path: mole-model
// and mole-engine's lora (crates of their own). The rest of the worker (tools, server) may
// use them.
#![allow(clippy::disallowed_methods)]

pub mod bench;
pub mod config;
pub mod metrics;
pub mod router;
pub mod server;
