//! A PEFT adapter's weights (`adapter_model.safetensors`), memory-mapped and sorted into LoRA
//! modules and replacements of base tensors, for the merge tool and the engine's loader alike.

use std::collections::BTreeMap;
use std::path::Path;

use ::safetensors::Dtype;

use super::{split_adapter_key, AdapterConfig};
use crate::safetensors::{self, decode_into, is_float};

/// Why an adapter's weights file cannot be read. Stable names via [`WeightsError::code`].
#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// File.
        path: String,
        /// Cause.
        source: std::io::Error,
    },
    /// The file is not valid safetensors.
    #[error("{path}: invalid safetensors: {message}")]
    Safetensors {
        /// File.
        path: String,
        /// Parser message.
        message: String,
    },
    /// A tensor is not a float, or a module lacks a half or is not targeted.
    #[error("{module}: {message}")]
    Shape {
        /// Module (or tensor).
        module: String,
        /// What is wrong.
        message: String,
    },
    /// A tensor kind mole does not read (DoRA magnitudes, unknown LoRA parts).
    #[error("unsupported adapter: {0}")]
    Unsupported(String),
    /// The file resolves outside the adapter's directory (a symlink to elsewhere).
    #[error("{path} resolves outside the adapter directory {dir}")]
    OutsideDir {
        /// File.
        path: String,
        /// The adapter's directory.
        dir: String,
    },
}

impl WeightsError {
    /// Stable name (metric label, JSON code); the same names the merge tool reports.
    pub fn code(&self) -> &'static str {
        match self {
            WeightsError::Io { .. } => "io_error",
            WeightsError::Safetensors { .. } => "invalid_safetensors",
            WeightsError::Shape { .. } => "shape_mismatch",
            WeightsError::Unsupported(_) => "unsupported_adapter",
            WeightsError::OutsideDir { .. } => "path_outside_root",
        }
    }
}

/// An f32 matrix read from the adapter.
#[derive(Debug, Clone)]
pub struct Mat {
    /// Row-major values.
    pub data: Vec<f32>,
    /// Its shape.
    pub shape: Vec<usize>,
}

/// An adapter tensor left where it is in the adapter file: dtype, shape and byte range.
#[derive(Debug, Clone)]
pub struct Raw {
    /// The stored dtype.
    pub dtype: Dtype,
    /// Its shape.
    pub shape: Vec<usize>,
    /// First byte in the file's data section.
    pub start: usize,
    /// One past its last byte.
    pub end: usize,
}

/// What grouping and planning need to know of a tensor, however it is held.
pub trait Shaped {
    /// The tensor's shape.
    fn shape(&self) -> &[usize];
}
impl Shaped for Mat {
    fn shape(&self) -> &[usize] {
        &self.shape
    }
}
impl Shaped for Raw {
    fn shape(&self) -> &[usize] {
        &self.shape
    }
}

/// One LoRA module of the adapter.
#[derive(Debug)]
pub struct Lora<T = Mat> {
    /// `lora_A` (`lora_embedding_A` for an embedding).
    pub a: Option<T>,
    /// `lora_B`.
    pub b: Option<T>,
    /// `lora_B`'s bias (PEFT's `lora_bias`).
    pub b_bias: Option<T>,
    /// Whether the module is an embedding (`lora_embedding_A/B`, whose product B·A is the
    /// transpose of the embedding's delta).
    pub embedding: bool,
    /// `lora_alpha / r` (or `/ sqrt(r)` with rsLoRA), per the module's own rank and alpha.
    pub scale: f64,
}

impl<T> Default for Lora<T> {
    fn default() -> Self {
        Self {
            a: None,
            b: None,
            b_bias: None,
            embedding: false,
            scale: 0.0,
        }
    }
}

impl<T: Shaped> Lora<T> {
    /// Rank (rows of A).
    pub fn rank(&self) -> usize {
        self.a.as_ref().map(|a| a.shape()[0]).unwrap_or(0)
    }
}

/// A LoRA module as read from the adapter file (f32 tensors, or byte ranges of the file).
type Grouped<T> = (BTreeMap<String, Lora<T>>, BTreeMap<String, T>);

/// Sorts an adapter's tensors into LoRA modules and replacements of base tensors, checking
/// that every module has both halves and is one the config targets.
fn group<T: Shaped>(
    entries: Vec<(String, T)>,
    config: &AdapterConfig,
) -> Result<Grouped<T>, WeightsError> {
    let mut loras: BTreeMap<String, Lora<T>> = BTreeMap::new();
    let mut replacements = BTreeMap::new();
    for (key, t) in entries {
        if let Some((module, part)) = split_adapter_key(&key) {
            let lora = loras.entry(module.clone()).or_default();
            match part.as_str() {
                "lora_A.weight" => lora.a = Some(t),
                "lora_B.weight" => lora.b = Some(t),
                "lora_B.bias" => lora.b_bias = Some(t),
                "lora_embedding_A" => {
                    lora.a = Some(t);
                    lora.embedding = true;
                }
                "lora_embedding_B" => {
                    lora.b = Some(t);
                    lora.embedding = true;
                }
                p if p.starts_with("lora_magnitude_vector") => {
                    return Err(WeightsError::Unsupported(format!(
                        "{module}: DoRA (lora_magnitude_vector) adapters are not merged by mole; \
                         merge them with PEFT or train without use_dora"
                    )))
                }
                other => {
                    return Err(WeightsError::Unsupported(format!(
                        "{key}: unknown LoRA tensor {other}"
                    )))
                }
            }
            lora.scale = config.scale_for(&module);
        } else {
            let name = key.strip_prefix("base_model.model.").unwrap_or(&key);
            let name = name
                .replace(".modules_to_save.default", "")
                .replace(".original_module", "")
                .replace(".base_layer", "");
            replacements.insert(name, t);
        }
    }
    for (module, lora) in &loras {
        if lora.a.is_none() || lora.b.is_none() {
            return Err(WeightsError::Shape {
                module: module.clone(),
                message: "adapter has only one of lora_A / lora_B".into(),
            });
        }
        if !config.targets(module) {
            return Err(WeightsError::Shape {
                module: module.clone(),
                message: "adapter has LoRA weights for a module its target_modules do not name"
                    .into(),
            });
        }
    }
    Ok((loras, replacements))
}

/// The bytes of an adapter file.
enum AdapterBytes {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl std::ops::Deref for AdapterBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            AdapterBytes::Mapped(m) => m,
            AdapterBytes::Owned(v) => v,
        }
    }
}

/// A PEFT adapter file, memory-mapped, its tensors grouped by module but not decoded: the
/// merge decodes one module at a time, so the adapter costs its file size in memory at most
/// (an f32 copy of a bf16 adapter would double it).
pub struct MappedAdapter {
    bytes: AdapterBytes,
    /// Module name → its LoRA tensors.
    pub loras: BTreeMap<String, Lora<Raw>>,
    /// Base tensor name → full replacement (modules_to_save, saved embeddings, biases).
    pub replacements: BTreeMap<String, Raw>,
}

impl MappedAdapter {
    /// Maps `adapter_model.safetensors` and indexes its tensors.
    pub fn open(path: &Path, config: &AdapterConfig) -> Result<Self, WeightsError> {
        // Confined to the directory it was named in: a symlink out of it is refused, not read.
        let dir = path.parent().unwrap_or(Path::new("."));
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        crate::hf::confine(dir, &name).map_err(|_| WeightsError::OutsideDir {
            path: path.display().to_string(),
            dir: dir.display().to_string(),
        })?;
        let map = safetensors::map(path).map_err(|source| WeightsError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_bytes(AdapterBytes::Mapped(map), path, config)
    }

    fn from_bytes(
        bytes: AdapterBytes,
        path: &Path,
        config: &AdapterConfig,
    ) -> Result<Self, WeightsError> {
        let st = ::safetensors::SafeTensors::deserialize(&bytes).map_err(|e| {
            WeightsError::Safetensors {
                path: path.display().to_string(),
                message: e.to_string(),
            }
        })?;
        let base = bytes.as_ptr() as usize;
        let mut entries = Vec::new();
        for (key, view) in st.iter() {
            if !is_float(view.dtype()) {
                return Err(WeightsError::Shape {
                    module: key.to_string(),
                    message: format!("dtype {:?} is not a float type", view.dtype()),
                });
            }
            let start = view.data().as_ptr() as usize - base;
            entries.push((
                key.to_string(),
                Raw {
                    dtype: view.dtype(),
                    shape: view.shape().to_vec(),
                    start,
                    end: start + view.data().len(),
                },
            ));
        }
        drop(st);
        let (loras, replacements) = group(entries, config)?;
        Ok(Self {
            bytes,
            loras,
            replacements,
        })
    }

    /// The stored bytes of a tensor.
    pub fn raw_bytes(&self, t: &Raw) -> &[u8] {
        &self.bytes[t.start..t.end]
    }

    /// A tensor as f32.
    pub fn decode(&self, t: &Raw) -> Mat {
        let mut data = Vec::new();
        decode_into(t.dtype, self.raw_bytes(t), &mut data);
        Mat {
            data,
            shape: t.shape.clone(),
        }
    }
}

impl MappedAdapter {
    /// An adapter over bytes in memory with no modules yet: a caller that places tensors in
    /// `bytes` itself groups them (the merge kernels' tests do).
    pub fn from_owned(bytes: Vec<u8>) -> Self {
        Self {
            bytes: AdapterBytes::Owned(bytes),
            loras: BTreeMap::new(),
            replacements: BTreeMap::new(),
        }
    }
}
