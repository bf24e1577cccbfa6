//! On-disk formats shared by the offline tools and the engine: safetensors (one mapping helper
//! and the float decoders), HF model directories, PEFT adapters (config and weights), GGUF,
//! AWQ/GPTQ quantization configs, and the confinement of the paths their files name.
//! Nothing here knows of the engine or the tools.

pub mod gguf;
pub mod hf;
pub mod paths;
pub mod peft;
pub mod quant;
pub mod quant_blocks;
pub mod safetensors;
