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
//! - `mole_server` (crates/server): the router, the worker's configuration and metrics (logs
//!   and traces are `mole_telemetry`'s, shared with the operator), the HTTP API.
//! - [`bench`], on top and here: benchmarks that print ratios measured side by side.
//!
//! Cargo holds the crates to this order; `tests/layers.rs` checks that their manifests do.

// clippy.toml keeps device→host copies and concatenation out of the decode path (mole-model,
// mole-engine's lora); a benchmark reads results back freely.
#![allow(clippy::disallowed_methods)]

pub mod bench;
