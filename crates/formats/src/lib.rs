//! On-disk formats shared by the offline tools and the engine: safetensors (one mapping helper
//! and the float decoders), HF model directories, PEFT adapters (config and weights), GGUF,
//! AWQ/GPTQ quantization configs, and the confinement of the paths their files name.
//! Nothing here knows of the engine or the tools: cargo holds it to that, as the worker's crates
//! sit above this one.

// clippy.toml keeps host↔device copies out of the decode path (the worker's model and lora);
// reading files into tensors on the host is what this crate is for.
#![allow(clippy::disallowed_methods)]

pub mod gguf;
pub mod hf;
pub mod paths;
pub mod peft;
pub mod quant;
pub mod safetensors;
