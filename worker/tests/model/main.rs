//! The model (mole-model, mole-kernels) against its references: transformers' logits, PEFT, the
//! vision tower, the LoRA kernels, pre-quantized checkpoints. `numerics`, `vision` and
//! `lora_kernels` read `MOLE_TEST_DEVICE` (scripts/gpu-run.sh runs them on a GPU).
//!
//! One test binary for these files (each a module), so the stack below them links once.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test
#![allow(clippy::disallowed_methods)] // tests read results back from the device

#[path = "../common/mod.rs"]
mod common;

mod lora_kernels;
mod numerics;
mod quantized_checkpoints;
mod vision;
