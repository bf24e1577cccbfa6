//! Where a base model comes from, and loading it for an engine: one path for every kind of
//! source (an HF directory, a GGUF file, a directory `mole-worker quantize` wrote), so the
//! checks before the weights are read and the KV cache's sizing after are written once.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};

use super::api::EngineError;
use super::images::ImageProcessor;
use super::text::TextModel;
use super::{device_name, tensor_path, EngineOptions};
use mole_model::{Decoder, DeviceMemory, KvBudget, ModelError, Proj};

/// A base model on disk, by kind.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelSource {
    /// An HF model directory (config, safetensors, tokenizer, chat template), its weights held
    /// in `dtype`.
    Hf {
        /// The directory.
        dir: PathBuf,
        /// The dtype the weights are held and computed in.
        dtype: DType,
    },
    /// A GGUF file, served quantized: projections stay in their blocks, the tokenizer and chat
    /// template come from its metadata; LoRA adapters apply on top in f32.
    Gguf(PathBuf),
    /// A directory written by `mole-worker quantize` (a merged model quantized after the
    /// merge): HF config and tokenizer files, the weights in one GGUF file under HF names,
    /// served quantized as a GGUF base.
    QuantizedDir(PathBuf),
}

/// What a source loads into: the model, its text side, and the image processor its own files
/// configure (None: the defaults, see `default_images`).
pub(super) struct Loaded {
    pub(super) model: Decoder,
    pub(super) text: TextModel,
    pub(super) images: Option<ImageProcessor>,
}

impl ModelSource {
    /// An HF directory in `dtype`.
    pub fn hf(dir: impl Into<PathBuf>, dtype: DType) -> Self {
        Self::Hf {
            dir: dir.into(),
            dtype,
        }
    }

    /// What `path` holds: a `.gguf` file, a directory `mole-worker quantize` wrote, else an
    /// HF directory served in `dtype`.
    pub fn at(path: &Path, dtype: DType) -> Self {
        if path.extension().is_some_and(|e| e == "gguf") {
            Self::Gguf(path.to_path_buf())
        } else if mole_formats::gguf::is_quantized_dir(path) {
            Self::QuantizedDir(path.to_path_buf())
        } else {
            Self::hf(path, dtype)
        }
    }

    /// The bytes the weights will hold on the device, from the files alone (headers or
    /// sizes), so a model too large for the device's share is refused before it is read. A
    /// quantized source's tensors stay in their blocks: the file's size is the weights'.
    fn weights_bytes(&self) -> Result<u64, EngineError> {
        let nr = |e: &dyn std::fmt::Display| self.not_ready(e);
        match self {
            Self::Hf { dir, dtype } => {
                // A quantized checkpoint is recognized (and refused, when mole does not serve
                // its variant) before its tensors are read or sized. Other configuration
                // errors are reported where they were (after the files' checks).
                if let Err(e @ ModelError::UnsupportedQuantization(_)) =
                    mole_model::ModelConfig::from_dir(dir)
                {
                    return Err(EngineError::UnsupportedQuantization(format!(
                        "model {}: {e}",
                        dir.display()
                    )));
                }
                let files = mole_formats::hf::safetensors_files(dir).map_err(|e| nr(&e))?;
                Ok(
                    mole_formats::hf::safetensors_elements(&files).map_err(|e| nr(&e))?
                        * dtype.size_in_bytes() as u64,
                )
            }
            Self::Gguf(path) => Ok(std::fs::metadata(path).map_err(|e| nr(&e))?.len()),
            Self::QuantizedDir(dir) => {
                let file = dir.join(mole_formats::gguf::QUANTIZED_FILE);
                Ok(std::fs::metadata(file).map_err(|e| nr(&e))?.len())
            }
        }
    }

    /// A load failure naming the source.
    fn not_ready(&self, e: &dyn std::fmt::Display) -> EngineError {
        match self {
            Self::Hf { dir, .. } => EngineError::NotReady(format!("model {}: {e}", dir.display())),
            Self::Gguf(p) | Self::QuantizedDir(p) => {
                EngineError::NotReady(format!("{}: {e}", p.display()))
            }
        }
    }

    /// Loads the model onto `device`: its size checked against the device's share
    /// (`gpuMemoryUtilization`) before anything is read, then the weights, tokenizer and
    /// template, then the KV cache sized into `opts` from the memory left.
    pub(super) fn load(
        &self,
        device: &Device,
        opts: &mut EngineOptions,
    ) -> Result<Loaded, EngineError> {
        let nr = |e: &dyn std::fmt::Display| self.not_ready(e);
        let weights_bytes = self.weights_bytes()?;
        let memory = DeviceMemory::of(device).map_err(model_error)?;
        KvBudget::check_weights(
            &device_name(device),
            memory,
            opts.gpu_memory_utilization,
            weights_bytes,
        )
        .map_err(model_error)?;
        let text_error = |e: super::text::TextError| EngineError::NotReady(e.to_string());
        let loaded = match self {
            Self::Hf { dir, dtype } => {
                let model = Decoder::load(dir, *dtype, device).map_err(|e| nr(&e))?;
                let images = match &model.config().vision {
                    Some(spec) => Some(ImageProcessor::load(dir, spec, opts.image_processor)?),
                    None => None,
                };
                Loaded {
                    model,
                    text: TextModel::load(dir).map_err(text_error)?,
                    images,
                }
            }
            Self::Gguf(path) => {
                let q = mole_formats::gguf::load_quantized(path, device).map_err(|e| nr(&e))?;
                let cfg =
                    mole_model::ModelConfig::from_json(q.config.clone()).map_err(|e| nr(&e))?;
                let model = Decoder::from_quantized(cfg, q.tensors, device).map_err(|e| nr(&e))?;
                let text = TextModel::from_json(&q.tokenizer_json, q.tokenizer_config, &[q.config])
                    .map_err(|e| nr(&e))?;
                Loaded {
                    model,
                    text,
                    images: None,
                }
            }
            Self::QuantizedDir(dir) => Loaded {
                model: Decoder::load_quantized_dir(dir, device).map_err(|e| nr(&e))?,
                text: TextModel::load(dir).map_err(text_error)?,
                images: None,
            },
        };
        size_kv_cache(&loaded.model, opts, loaded.model.weight_bytes())?;
        Ok(loaded)
    }
}

/// What sizes the KV cache of `model` under `opts` (see [`KvBudget`]), with the device's
/// memory as it is now (after the weights were loaded). The activation headroom is an
/// estimate, not a profile: a prefill chunk's hidden states and MLP activations in f32, the
/// batch's logits, and the attention scores of a chunk against the longest sequence (twice:
/// scores and softmax), plus 256 MiB for the CUDA context's and cuBLAS's workspaces.
fn kv_budget(
    model: &Decoder,
    opts: &EngineOptions,
    lora_dtype: DType,
    weights_bytes: u64,
) -> Result<KvBudget, ModelError> {
    let cfg = model.config();
    let tp = tensor_path(opts);
    let layers = cfg.num_hidden_layers as u64;
    let width = (cfg.kv_heads() * cfg.head_dim()) as u64;
    let kv_size = tp.kv_dtype.unwrap_or(model.kv_dtype()).size_in_bytes() as u64;
    let bytes_per_block = layers * 2 * tp.block_size as u64 * width * kv_size;
    // The slots compute in the wider of the activations' dtype and the adapters'.
    let slot_size = (model.dtype().size_in_bytes() as u64).max(lora_dtype.size_in_bytes() as u64);
    let rank = tp.lora_rank.div_ceil(mole_kernels::RANK_ALIGN) * mole_kernels::RANK_ALIGN;
    let per_slot: u64 = Proj::ALL
        .iter()
        .map(|p| {
            let (i, o) = p.dims(cfg);
            (i + o) as u64
        })
        .sum::<u64>()
        * rank as u64
        * layers
        * slot_size;
    let lora_bytes = (tp.lora_slots as u64 + 1) * per_slot;
    let tokens = opts.prefill_chunk.max(opts.max_batch_size).max(1) as u64;
    let (hidden, inter) = (cfg.hidden_size as u64, cfg.intermediate_size as u64);
    let heads = cfg.num_attention_heads as u64;
    let activation_bytes = tokens * (8 * hidden + 4 * inter) * 4
        + opts.max_batch_size as u64 * cfg.vocab_size as u64 * 4 * 2
        + 2 * heads * opts.prefill_chunk.max(1) as u64 * opts.max_seq_len as u64 * 4
        + (256 << 20);
    let seq_blocks = opts.max_seq_len.div_ceil(tp.block_size);
    Ok(KvBudget {
        device: device_name(model.device()),
        memory: DeviceMemory::of(model.device())?,
        fraction: opts.gpu_memory_utilization,
        weights_bytes,
        lora_bytes,
        activation_bytes,
        bytes_per_block,
        wanted_blocks: tensor_path(opts).kv_blocks,
        min_blocks: seq_blocks,
    })
}

/// Sizes the KV cache from the device's memory unless `opts` fixes it: refuses
/// (`model_does_not_fit`) when one sequence of the longest length does not fit, logs the size.
fn size_kv_cache(
    model: &Decoder,
    opts: &mut EngineOptions,
    weights_bytes: u64,
) -> Result<(), EngineError> {
    if opts.kv_blocks.is_some() {
        return Ok(());
    }
    let lora_dtype = opts.lora_dtype.unwrap_or(mole_model::adapter_dtype(
        model.weight_dtype(),
        model.device(),
    ));
    let mut o = opts.clone();
    o.max_seq_len = o.max_seq_len.min(model.config().max_positions()).max(2);
    let budget = kv_budget(model, &o, lora_dtype, weights_bytes).map_err(model_error)?;
    let blocks = budget.blocks().map_err(model_error)?;
    tracing::info!(
        device = %budget.device,
        blocks,
        block_tokens = tensor_path(&o).block_size,
        bytes = blocks as u64 * budget.bytes_per_block,
        budget_bytes = budget.budget_bytes(),
        weights_bytes,
        gpu_memory_utilization = o.gpu_memory_utilization,
        "KV cache sized"
    );
    opts.kv_blocks = Some(blocks);
    Ok(())
}

/// A model error at load: `model_does_not_fit` keeps its code, the rest are "not ready".
fn model_error(e: ModelError) -> EngineError {
    match e {
        ModelError::DoesNotFit { .. } => EngineError::ModelDoesNotFit(e.to_string()),
        ModelError::UnsupportedQuantization(_) => {
            EngineError::UnsupportedQuantization(e.to_string())
        }
        e => EngineError::NotReady(e.to_string()),
    }
}
