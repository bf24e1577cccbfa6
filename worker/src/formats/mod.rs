//! On-disk formats shared by the offline tools and the engine: safetensors (one mapping helper
//! and the float decoders), HF model directories, PEFT adapters (config and weights) and GGUF.
//! Nothing here knows of the engine or the tools.

pub mod gguf;
pub mod hf;
pub mod peft;
pub mod safetensors;
