//! One decoder for the Llama (SmolLM2), Qwen2 (QKV bias) and Qwen3 (per-head q/k RMSNorm)
//! families, read from an HF directory.
//!
//! Unlike candle-transformers' models, the model owns no KV cache: each sequence brings its
//! own [`SeqCache`] and position, so one model instance serves many sequences at once. Rows of
//! a batch are concatenated for every projection (one matmul for the whole batch) and split for
//! attention, which is per sequence.
//!
//! One file per part, candle's shape (`new` from the checkpoint, `forward`): [`config`] reads
//! `config.json`, [`weights`] loads projections (dense or GGUF) and holds the dtype policy,
//! [`decoder`] runs the layers over a [`batch`] ([`layer`]: [`attention`] and the MLP) that its
//! step [`backend`] builds (the host backend on the CPU in f32, the paged one elsewhere: chosen
//! once, before the first step), [`cache`] holds a sequence's keys and values, [`lora`] applies
//! adapters and [`project`] runs the projections of a batch with their adapters' updates. Nothing here reads PEFT files or
//! knows of requests: that is the worker's `lora` and `engine`, above this crate.
//!
//! RoPE follows `config.json` (`rope_parameters` or `rope_scaling`): default, linear, dynamic
//! NTK, llama3 and YaRN, computed as transformers computes them (see [`rope`]).

mod attention;
mod backend;
mod batch;
mod cache;
mod config;
mod decoder;
mod kv;
mod kvbuf;
mod layer;
pub mod lora;
mod prefix;
mod project;
pub mod rope;
mod slots;
mod step;
mod transfer;
pub mod vision;
mod weights;

use candle_core::{Tensor, D};

pub use self::backend::BackendKind;
pub use self::batch::{Row, RowVision};
pub use self::cache::SeqCache;
pub use self::config::{Family, ModelConfig, VisionSpec};
pub use self::decoder::{Decoder, StepOutput};
pub use self::kv::{DeviceMemory, KvBudget, LoraKernel, TensorPathOptions, MAX_KV_SLOTS};
pub use self::lora::{HostUpdates, LoraAdapter, Proj, UpdateTask, HOST_LORA_MAX_TOKENS};
pub use self::prefix::BlockHash;
pub use self::rope::{Rope, RopeScaling};
pub use self::slots::bgmv_against_grouped_ops;
pub use self::transfer::upload;
pub use self::transfer::{download, download_rows, transfers_made, Transfers};
pub use self::weights::{adapter_dtype, compute_dtype, Lin};

use mole_formats::hf;

/// Errors loading or running a model. Stable names via [`ModelError::code`].
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The directory is unusable.
    #[error("model directory: {0}")]
    Dir(#[from] hf::HfError),
    /// `config.json` does not describe a supported model.
    #[error("config.json: {0}")]
    Config(String),
    /// A tensor is missing or has the wrong shape, or a kernel failed.
    #[error("tensor: {0}")]
    Tensor(#[from] candle_core::Error),
    /// The paged KV cache has too few free blocks for the step (the scheduler admits and
    /// preempts so that this does not happen).
    #[error("KV cache full: {needed} blocks needed, {free} free")]
    KvCacheFull {
        /// Blocks the step needed.
        needed: usize,
        /// Blocks free.
        free: usize,
    },
    /// The device's memory budget (`gpuMemoryUtilization` of its total) cannot hold the
    /// weights, or the weights and one sequence of the longest length.
    #[error(
        "model does not fit on {device}: weights {weights_bytes} bytes, budget {budget_bytes} \
         bytes; {why}"
    )]
    DoesNotFit {
        /// The device, as the worker names it.
        device: String,
        /// The weights' bytes as loaded.
        weights_bytes: u64,
        /// The bytes the worker may use there.
        budget_bytes: u64,
        /// What does not fit.
        why: String,
    },
    /// A pre-quantized checkpoint mole does not serve (named in the message).
    #[error("unsupported quantized checkpoint: {0}")]
    UnsupportedQuantization(String),
    /// A step mixes more adapters than the LoRA slot pool holds.
    #[error("a step mixes more adapters than the {slots} LoRA slots")]
    TooManyAdapters {
        /// Slots of the pool.
        slots: usize,
    },
}

impl ModelError {
    /// Stable name.
    pub fn code(&self) -> &'static str {
        match self {
            ModelError::Dir(_) => "model_dir",
            ModelError::Config(_) => "model_config",
            ModelError::Tensor(_) => "model_tensor",
            ModelError::KvCacheFull { .. } => "kv_cache_full",
            ModelError::TooManyAdapters { .. } => "too_many_adapters",
            ModelError::DoesNotFit { .. } => "model_does_not_fit",
            ModelError::UnsupportedQuantization(_) => "unsupported_quantization",
        }
    }
}

/// The tensors candle creates while `f` runs, process-wide: every candle op (views and
/// uploads included) makes one, so while nothing else runs this counts the ops `f` issues.
/// `bench decode` reports a step's ops with it, and `tests/op_count/op_count.rs` checks them.
pub fn tensors_made<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let before = next_tensor_id();
    let out = f();
    // The second probe takes an id of its own.
    (out, next_tensor_id() - before - 1)
}

/// The id candle gives the next tensor it creates (its counter is process-wide and not
/// exposed, but a tensor's id prints as `TensorId(n)`).
fn next_tensor_id() -> usize {
    let probe = candle_core::Tensor::zeros((), candle_core::DType::U8, &candle_core::Device::Cpu)
        .expect("a scalar on the CPU");
    format!("{:?}", probe.id())
        .trim_start_matches("TensorId(")
        .trim_end_matches(')')
        .parse::<usize>()
        .expect("candle prints a tensor id as TensorId(n)")
        + 1
}

/// Greedy argmax of a logits vector.
// For tests and tools: the engine samples from the one copy of a step's logits.
#[allow(clippy::disallowed_methods)]
pub fn argmax(logits: &Tensor) -> Result<u32, ModelError> {
    Ok(logits.argmax(D::Minus1)?.to_scalar::<u32>()?)
}

/// The largest absolute difference between two tensors of one shape (tests).
#[cfg(test)]
#[allow(clippy::disallowed_methods)]
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .and_then(|d| {
            d.abs()?
                .max_all()?
                .to_dtype(candle_core::DType::F32)?
                .to_scalar::<f32>()
        })
        .expect("tensors of one shape")
}
