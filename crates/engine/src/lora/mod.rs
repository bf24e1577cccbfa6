//! LoRA adapters as served: PEFT directories loaded with the merge tool's validation (pickle
//! files, shapes, ranks, NaN/Inf, the base they were trained on), laid out for the decoder
//! ([`mole_model::LoraAdapter`]) with the scale folded into B, and the registry of the
//! versions a worker holds.

pub mod registry;

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};

use mole_formats::peft::weights::{MappedAdapter, WeightsError};
use mole_formats::safetensors::decode_slice;
use mole_formats::{hf, peft::AdapterConfig};
use mole_kernels as kernels;
use mole_model::{LoraAdapter, ModelConfig, Proj};

pub use self::registry::AdapterSpec;

/// Why an adapter cannot be served. Stable names via [`LoraError::code`].
#[derive(Debug, thiserror::Error)]
pub enum LoraError {
    /// The weights file cannot be read (same rules as `mole-worker merge`).
    #[error("{0}")]
    Weights(#[from] WeightsError),
    /// Pickle weights.
    #[error("{0}: pickle files (.bin/.pt) are refused; convert the weights to safetensors")]
    Pickle(String),
    /// A module does not fit the served model.
    #[error("{module}: {message}")]
    Shape {
        /// Module.
        module: String,
        /// What does not fit.
        message: String,
    },
    /// A weight is NaN or infinite.
    #[error("{module}: adapter weights contain NaN/Inf; the adapter is broken")]
    NonFinite {
        /// Module.
        module: String,
    },
    /// The adapter config is invalid.
    #[error("{0}")]
    Config(#[from] mole_formats::peft::PeftError),
    /// A feature that needs a merged deployment.
    #[error("{0}")]
    Unsupported(String),
    /// The rank is over the pool's limit.
    #[error("rank {rank} of {module} is over maxLoraRank {limit}")]
    RankOverLimit {
        /// Module.
        module: String,
        /// Rank.
        rank: usize,
        /// Limit.
        limit: usize,
    },
    /// The adapter was trained on another base model.
    #[error("adapter base model is {found:?}, this worker serves {expected:?}")]
    WrongBase {
        /// The adapter's base.
        found: Option<String>,
        /// The served base.
        expected: String,
    },
    /// A kernel failed.
    #[error("tensor: {0}")]
    Tensor(#[from] candle_core::Error),
}

impl LoraError {
    /// Stable name (metric label, JSON code).
    pub fn code(&self) -> &'static str {
        match self {
            LoraError::Weights(e) => e.code(),
            LoraError::Pickle(_) => "pickle_refused",
            LoraError::Shape { .. } => "shape_mismatch",
            LoraError::NonFinite { .. } => "non_finite_weights",
            LoraError::Config(e) => e.code(),
            LoraError::Unsupported(_) => "unsupported_adapter",
            LoraError::RankOverLimit { .. } => "rank_over_limit",
            LoraError::WrongBase { .. } => "wrong_base_model",
            LoraError::Tensor(_) => "tensor_error",
        }
    }
}

/// Limits and identity checks applied at load.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Highest rank accepted.
    pub max_rank: usize,
    /// The served base model: adapters naming another one are refused.
    pub expect_base: Option<String>,
}

/// Loads and validates a PEFT adapter directory for a model.
#[allow(clippy::disallowed_methods)] // an adapter's weights go up once, at load
pub fn load(
    dir: &Path,
    model: &ModelConfig,
    dtype: DType,
    device: &Device,
    opts: &LoadOptions,
) -> Result<LoraAdapter, LoraError> {
    if let Some(p) = hf::find_pickle(dir) {
        return Err(LoraError::Pickle(p.display().to_string()));
    }
    let cfg = AdapterConfig::from_dir(dir)?;
    if cfg.use_dora {
        return Err(LoraError::Unsupported(
            "DoRA adapters are not served by mole".into(),
        ));
    }
    // Compatibility is the architecture's shapes, checked per module below: a name that
    // differs (a local training path such as `/data/my-base`, a renamed copy) is a warning.
    let warning = opts
        .expect_base
        .as_deref()
        .and_then(|expected| base_name_warning(cfg.base_model_name_or_path.as_deref(), expected));
    let weights = MappedAdapter::open(&dir.join("adapter_model.safetensors"), &cfg)?;
    if let Some(name) = weights.replacements.keys().next() {
        return Err(LoraError::Unsupported(format!(
            "{name}: adapters that replace base tensors (modules_to_save, saved embeddings) need serving.mode merged"
        )));
    }
    // Modules are independent: check and lay them out in parallel, one pass over each
    // matrix from the mapped file (decode, transpose, scale and finiteness check fused).
    use rayon::prelude::*;
    // Per module: its key, (Aᵀ, s·B) and its rank.
    type Loaded = (Target, (Tensor, Tensor), usize);
    let loaded: Vec<Loaded> = weights
        .loras
        .par_iter()
        .map(|(module, lora)| -> Result<_, LoraError> {
            let (target, (fin, fout)) = target(module, model)?;
            let (a, b) = (
                lora.a.as_ref().expect("checked"),
                lora.b.as_ref().expect("checked"),
            );
            let r = a.shape[0];
            if r > opts.max_rank {
                return Err(LoraError::RankOverLimit {
                    module: module.clone(),
                    rank: r,
                    limit: opts.max_rank,
                });
            }
            if a.shape != [r, fin] || b.shape != [fout, r] || r != cfg.rank_for(module) as usize {
                return Err(LoraError::Shape {
                    module: module.clone(),
                    message: format!(
                        "lora_A {:?}, lora_B {:?}; the model needs [r, {fin}] and [{fout}, r]",
                        a.shape, b.shape
                    ),
                });
            }
            let non_finite = || LoraError::NonFinite {
                module: module.clone(),
            };
            let rp = r.div_ceil(kernels::RANK_ALIGN) * kernels::RANK_ALIGN;
            let at = laid_out(a.dtype, weights.raw_bytes(a), (r, fin), 1.0, true)
                .ok_or_else(non_finite)?;
            let b = laid_out(
                b.dtype,
                weights.raw_bytes(b),
                (fout, r),
                lora.scale as f32,
                false,
            )
            .ok_or_else(non_finite)?;
            let at = Tensor::from_vec(at, (fin, rp), device)?.to_dtype(dtype)?;
            let b = Tensor::from_vec(b, (fout, rp), device)?.to_dtype(dtype)?;
            Ok((target, (at, b), r))
        })
        .collect::<Result<_, _>>()?;
    let (mut modules, mut vision) = (HashMap::new(), HashMap::new());
    let (mut rank, mut bytes) = (0usize, 0u64);
    for (target, (at, b), r) in loaded {
        bytes += ((at.elem_count() + b.elem_count()) * dtype.size_in_bytes()) as u64;
        rank = rank.max(r);
        match target {
            Target::Decoder(layer, proj) => modules.insert((layer, proj), (at, b)),
            Target::Vision(path) => vision.insert(path, (at, b)),
        };
    }
    // On a GPU the weights were uploaded on this (loader) thread: wait for the copies, so the
    // engine thread, which reads them (into its LoRA slots) once the registry publishes the
    // adapter, never reads a buffer still being written.
    device.synchronize()?;
    let mut adapter = LoraAdapter::from_modules(modules, rank, bytes).with_vision(vision);
    if let Some(key) = files_key(dir) {
        adapter = adapter.with_weights_key(key);
    }
    adapter.warning = warning;
    Ok(adapter)
}

/// A digest of the identity of `dir`'s adapter files as they are now: their paths, sizes,
/// modification times and inodes. Reading the weights again from files where none of these
/// changed reads the same bytes; hashing the bytes themselves would cost more than the load
/// (a load reads 18 MB in about 2 ms). None when a file's metadata cannot be read (the
/// adapter is then known by its load alone).
fn files_key(dir: &Path) -> Option<u128> {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(b"mole/adapter-files\0");
    for name in ["adapter_model.safetensors", "adapter_config.json"] {
        let path = dir.join(name).canonicalize().ok()?;
        let meta = std::fs::metadata(&path).ok()?;
        let modified = meta
            .modified()
            .ok()?
            .duration_since(std::time::UNIX_EPOCH)
            .ok()?;
        h.update(path.as_os_str().as_encoded_bytes());
        h.update([0]);
        h.update(meta.len().to_le_bytes());
        h.update(modified.as_nanos().to_le_bytes());
        #[cfg(unix)]
        {
            use std::os::unix::fs::MetadataExt;
            h.update(meta.dev().to_le_bytes());
            h.update(meta.ino().to_le_bytes());
        }
    }
    let d = h.finalize();
    let mut key = [0u8; 16];
    key.copy_from_slice(&d[..16]);
    Some(u128::from_le_bytes(key))
}

/// The warning an adapter trained on `found` gets in a pool of `expected`, None when they
/// name the same model: equal, or the same last segment in any case (hub ids are
/// case-insensitive and pools name the model by its last segment).
pub fn base_name_warning(found: Option<&str>, expected: &str) -> Option<String> {
    let last = |s: &str| {
        s.trim_end_matches('/')
            .rsplit('/')
            .next()
            .unwrap_or("")
            .to_ascii_lowercase()
    };
    match found {
        Some(f) if f == expected || last(f) == last(expected) => None,
        Some(f) => Some(format!(
            "base_model_name_or_path {f:?} names another model than the pool's {expected:?}; its shapes fit, so it is served"
        )),
        None => Some(format!(
            "adapter_config.json has no base_model_name_or_path; its shapes fit {expected:?}, so it is served"
        )),
    }
}

/// Where an adapter module applies.
enum Target {
    /// A projection of a decoder layer.
    Decoder(usize, Proj),
    /// A linear layer of the vision tower, by its path under `model.visual.`.
    Vision(String),
}

/// Where `module` applies in `model`, and its (in, out) features; modules the engine does
/// not apply (embeddings, the output head, a patch embedding) are refused naming the way to
/// serve them.
fn target(module: &str, model: &ModelConfig) -> Result<(Target, (usize, usize)), LoraError> {
    if let Some((layer, proj)) = Proj::parse(module) {
        if layer >= model.num_hidden_layers {
            return Err(LoraError::Shape {
                module: module.into(),
                message: format!("layer {layer} does not exist"),
            });
        }
        return Ok((Target::Decoder(layer, proj), proj.dims(model)));
    }
    let vision = module.strip_prefix("model.visual.").and_then(|path| {
        let spec = model.vision.as_ref()?;
        let dims = mole_model::vision::linear_dims(&spec.config, path)?;
        Some((Target::Vision(path.to_string()), dims))
    });
    vision.ok_or_else(|| {
        LoraError::Unsupported(format!(
            "{module}: LoRA on this module needs serving.mode merged"
        ))
    })
}

/// Whether every value is finite, without short-circuit so the check vectorises.
fn all_finite(v: &[f32]) -> bool {
    v.iter().fold(true, |ok, x| ok & x.is_finite())
}

/// `scale ·` a `[rows, cols]` matrix stored as `dtype` little-endian bytes, laid out for the
/// kernels: row-major `[rows, p]`, or transposed `[cols, p]`, where `p` is the row length
/// (`cols`, or `rows` when transposed) padded with zeros to a multiple of
/// [`kernels::RANK_ALIGN`]. None when a value is not finite.
fn laid_out(
    dtype: safetensors::Dtype,
    src: &[u8],
    (rows, cols): (usize, usize),
    scale: f32,
    transpose: bool,
) -> Option<Vec<f32>> {
    let mut plain = vec![0f32; rows * cols];
    decode_slice(dtype, src, &mut plain);
    if !all_finite(&plain) {
        return None;
    }
    let pad = |n: usize| n.div_ceil(kernels::RANK_ALIGN) * kernels::RANK_ALIGN;
    if transpose {
        // `rows` is the rank (small): each output row gathers one column, a strided sweep of
        // the decoded matrix, which stays in cache.
        let p = pad(rows);
        let mut out = vec![0f32; cols * p];
        for (j, row) in out.chunks_exact_mut(p).enumerate() {
            for (o, i) in row.iter_mut().zip(0..rows) {
                *o = plain[i * cols + j] * scale;
            }
        }
        Some(out)
    } else if pad(cols) == cols {
        // The usual ranks: scaled in place, no copy.
        plain.iter_mut().for_each(|x| *x *= scale);
        Some(plain)
    } else {
        let p = pad(cols);
        let mut out = vec![0f32; rows * p];
        for (o, row) in out.chunks_exact_mut(p).zip(plain.chunks_exact(cols)) {
            for (o, x) in o.iter_mut().zip(row) {
                *o = x * scale;
            }
        }
        Some(out)
    }
}
