//! mole worker: a candle engine with multi-LoRA batching, a router and an OpenAI-compatible
//! HTTP API, plus the merge/import/inspect tools that run in merge Jobs.
//!
//! Module map (each owns one concern):
//! - [`formats`]: on-disk formats shared by the tools and the engine (HF model dirs, PEFT
//!   adapters, GGUF), with their validation rules.
//! - [`merge`], [`import`], [`inspect`]: the offline tools.
//! - [`model`], [`lora`], [`engine`]: the inference engine.
//! - [`router`], [`server`], [`config`], [`metrics`]: the serving layer.

pub mod bench;
pub mod config;
pub mod engine;
pub mod formats;
pub mod import;
pub mod inspect;
pub mod lora;
pub mod merge;
pub mod metrics;
pub mod model;
pub mod prune;
pub mod router;
pub mod server;
pub mod telemetry;
