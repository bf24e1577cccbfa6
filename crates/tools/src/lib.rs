//! The tools `mole-worker` runs besides serving, each a subcommand: [`merge`] (the merge Job's
//! tool, which a local worker also runs in-process for its merged adapters; [`quantize`]
//! quantizes its output after it), [`import`] (GGUF into an HF directory), [`fetch`] (`hf://`
//! and `s3://` into a directory, resumed and checksummed), [`prune`] (old merged outputs),
//! [`inspect`], and what they share: [`fs`] (durable writes) and the [`progress`] lines. Above the engine (quantize measures its
//! drift with the engine's text model), below the server, which imports only the merge.

// The tools read tensors back to the host and concatenate them freely: clippy.toml's rules
// are the decode path's (mole-model, mole-engine's lora).
#![allow(clippy::disallowed_methods)]

pub mod fetch;
pub mod fs;
pub mod import;
pub mod inspect;
pub mod merge;
pub mod progress;
pub mod prune;
pub mod quantize;
