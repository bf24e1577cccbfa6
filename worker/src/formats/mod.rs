//! On-disk formats shared by the offline tools and the engine.

pub mod hf;
pub mod peft;
