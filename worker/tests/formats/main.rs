//! The on-disk formats (mole-formats): hostile and fuzzed files refused with their reasons, model
//! directories.
//!
//! One test binary for these files (each a module), so the stack below them links once.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test
#![allow(clippy::disallowed_methods)] // tests read results back from the device

#[path = "../common/mod.rs"]
mod common;

mod formats_fuzz;
mod hostile_formats;
mod model_dir;
