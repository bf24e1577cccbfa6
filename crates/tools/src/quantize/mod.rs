//! `mole-worker quantize`: a merged (dense) HF model quantized to GGUF blocks after the merge.
//!
//! The output is an HF directory whose weights are one GGUF file under their HF names
//! ([`mole_formats::gguf::QUANTIZED_FILE`]) next to the input's config.json, tokenizer files
//! and merge metadata: exactly what the worker's quantized path serves
//! ([`mole_model::Decoder::load_quantized_dir`]), with no tokenizer conversion to get wrong.
//!
//! Streaming: the file's header is written from the input's safetensors headers, then each
//! tensor is decoded, quantized (rows split across threads) and written before the next is
//! read, so memory holds one tensor in f32 and its blocks. The output goes to a temporary
//! sibling renamed into place at the end, so a failed run leaves nothing at `--out`.
//!
//! Which tensors are quantized follows llama.cpp's `llama_tensor_get_type`: 1-D tensors (norms,
//! biases) stay f32; the output head (or the embedding, when the head is tied to it) is Q6_K
//! unless the type is q8_0; every other 2-D weight, the embedding included, takes the type
//! asked for. A row whose width is not a multiple of the type's block falls back as llama.cpp
//! does (q4_k → q5_0, q5_k → q5_1, q6_k → q8_0), and to f16 when it is not a multiple of 32.
//!
//! Drift: the next-token distributions of the quantized model and of its input, teacher-forced
//! on a fixed prompt set, are compared by their KL divergence (nats); the mean goes in the
//! metadata, and `--max-drift` refuses an output above it.

pub mod cli;
mod drift;
mod packed;

pub use drift::{kl, measure_drift, Drift, DRIFT_PROMPTS};

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::merge::MergeError;
use mole_formats::gguf::writer::{GgufWriter, MetaValue, TensorEntry};
use mole_formats::gguf::QUANTIZED_FILE;
use mole_formats::hf;

/// Metadata file of a quantized output.
pub const METADATA_FILE: &str = "quantize_metadata.json";

/// The block types `quantize` writes: those of candle's quantizer that mole's quantized path
/// serves with a fast dot product or mole's own kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantType {
    /// 8-bit, blocks of 32 with an f16 scale (8.5 bits per weight).
    Q8_0,
    /// 4-bit, blocks of 32 with an f16 scale (4.5 bits per weight).
    Q4_0,
    /// 4-bit, blocks of 32 with an f16 scale and minimum (5 bits per weight).
    Q4_1,
    /// 4-bit k-quant, super-blocks of 256 (4.5 bits per weight).
    Q4K,
    /// 5-bit k-quant, super-blocks of 256 (5.5 bits per weight).
    Q5K,
    /// 6-bit k-quant, super-blocks of 256 (6.56 bits per weight).
    Q6K,
}

impl QuantType {
    /// Every type, by name.
    pub const ALL: [(&'static str, QuantType); 6] = [
        ("q8_0", QuantType::Q8_0),
        ("q4_0", QuantType::Q4_0),
        ("q4_1", QuantType::Q4_1),
        ("q4_k", QuantType::Q4K),
        ("q5_k", QuantType::Q5K),
        ("q6_k", QuantType::Q6K),
    ];

    /// The type named `s` (`q8_0`, `q4_0`, `q4_1`, `q4_k`, `q5_k`, `q6_k`; case-insensitive).
    pub fn parse(s: &str) -> Result<Self, QuantizeError> {
        let lower = s.to_ascii_lowercase();
        Self::ALL
            .iter()
            .find(|(n, _)| *n == lower)
            .map(|(_, t)| *t)
            .ok_or_else(|| QuantizeError::UnsupportedType(s.to_string()))
    }

    /// Its name.
    pub fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(_, t)| *t == self)
            .map(|(n, _)| *n)
            .expect("every type is named")
    }

    /// candle's block type.
    pub fn ggml(self) -> GgmlDType {
        match self {
            QuantType::Q8_0 => GgmlDType::Q8_0,
            QuantType::Q4_0 => GgmlDType::Q4_0,
            QuantType::Q4_1 => GgmlDType::Q4_1,
            QuantType::Q4K => GgmlDType::Q4K,
            QuantType::Q5K => GgmlDType::Q5K,
            QuantType::Q6K => GgmlDType::Q6K,
        }
    }
}

/// Why a quantization failed. Stable names via [`QuantizeError::code`]; bad input exits 2,
/// I/O exits 1.
#[derive(Debug, thiserror::Error)]
pub enum QuantizeError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// File or directory.
        path: String,
        /// Cause.
        source: std::io::Error,
    },
    /// The type asked for is not one `quantize` writes.
    #[error("quantization type {0:?} is not supported (q8_0, q4_0, q4_1, q4_k, q5_k, q6_k)")]
    UnsupportedType(String),
    /// The input directory is unusable (missing, no config.json or weights, bad paths).
    #[error("input: {0}")]
    Input(String),
    /// The input is already quantized in a way `quantize` does not read: a `quantize` output,
    /// or an AWQ/GPTQ variant mole does not serve (AWQ/GPTQ it serves is read, see
    /// [`packed`]).
    #[error("input is already quantized ({0}); quantize the dense merged model")]
    QuantizedInput(String),
    /// A model mole's quantized path does not serve (a vision tower).
    #[error("unsupported model: {0}")]
    Unsupported(String),
    /// A path resolves outside `--root`.
    #[error("{path} resolves outside the model root {root}")]
    OutsideRoot {
        /// Path as given.
        path: String,
        /// Root.
        root: String,
    },
    /// The output directory exists and was made from other inputs.
    #[error("{0} exists and was quantized from different inputs; refusing to overwrite it")]
    OutputExists(String),
    /// A tensor could not be decoded or quantized.
    #[error("{tensor}: {message}")]
    Tensor {
        /// Tensor name.
        tensor: String,
        /// What failed.
        message: String,
    },
    /// The drift could not be measured (a model did not load or run).
    #[error("drift evaluation: {0}")]
    Drift(String),
    /// The quantized model drifts more than `--max-drift` allows.
    #[error("mean next-token KL divergence {mean_kl:.6} is over the bound {bound} (--max-drift); the output was not kept")]
    DriftOverBound {
        /// Measured mean KL (nats).
        mean_kl: f64,
        /// The bound.
        bound: f64,
    },
    /// The merge before the quantization (`merge --quantize`) failed.
    #[error(transparent)]
    Merge(#[from] MergeError),
}

impl QuantizeError {
    /// Stable name (Event reason suffix, termination message).
    pub fn code(&self) -> &'static str {
        match self {
            QuantizeError::Io { .. } => "io_error",
            QuantizeError::UnsupportedType(_) => "unsupported_quant_type",
            QuantizeError::Input(_) => "invalid_input",
            QuantizeError::QuantizedInput(_) => "quantized_input",
            QuantizeError::Unsupported(_) => "unsupported_model",
            QuantizeError::OutsideRoot { .. } => "path_outside_root",
            QuantizeError::OutputExists(_) => "output_exists",
            QuantizeError::Tensor { .. } => "invalid_tensor",
            QuantizeError::Drift(_) => "drift_evaluation_failed",
            QuantizeError::DriftOverBound { .. } => "drift_over_bound",
            QuantizeError::Merge(e) => e.code(),
        }
    }

    /// Process exit code: 1 for I/O failures (retry may help), 2 for bad input (it will not).
    pub fn exit_code(&self) -> u8 {
        match self {
            QuantizeError::Io { .. } => 1,
            QuantizeError::Merge(e) => e.exit_code(),
            _ => 2,
        }
    }
}

impl QuantizeError {
    /// The merge helpers' errors in this tool's terms (paths, I/O).
    fn of_merge(e: MergeError) -> Self {
        match e {
            MergeError::Io { path, source } => QuantizeError::Io { path, source },
            MergeError::OutsideRoot { path, root } => QuantizeError::OutsideRoot { path, root },
            // A refused pickle among them: merge's own words.
            e => QuantizeError::Input(e.to_string()),
        }
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> QuantizeError + '_ {
    move |source| QuantizeError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// What to quantize and how.
#[derive(Debug, Clone)]
pub struct QuantizeOptions {
    /// The dense HF model directory (a merge's output).
    pub input: PathBuf,
    /// Output directory (written to a temporary sibling and renamed).
    pub out: PathBuf,
    /// Block type.
    pub qtype: QuantType,
    /// Every path must resolve inside this directory.
    pub root: Option<PathBuf>,
    /// Tokens of each drift prompt (0: no drift measured).
    pub drift_tokens: usize,
    /// Refuse the output when its mean KL drift is above this (nats).
    pub max_drift: Option<f64>,
}

/// `quantize_metadata.json`: provenance of a quantized model.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct QuantizeMetadata {
    /// The input directory as given.
    pub source: String,
    /// Identity of the input weights (their index, or each file's header and size).
    pub source_weights_sha256: String,
    /// `inputs_sha256` of the input's `merge_metadata.json`, when it is a merge's output.
    pub merge_inputs_sha256: Option<String>,
    /// The type asked for.
    pub quant_type: String,
    /// Tensors written per block type (`F32` for norms and biases, fallbacks included).
    pub tensor_types: BTreeMap<String, usize>,
    /// Bytes of the input's weight files.
    pub source_bytes: u64,
    /// Bytes of the GGUF file.
    pub output_bytes: u64,
    /// sha256 of the GGUF file.
    pub gguf_sha256: String,
    /// Drift against the input (absent when not measured).
    pub drift: Option<Drift>,
    /// The bound the drift was held to.
    pub max_drift: Option<f64>,
    /// Tokens of each drift prompt (0: drift not measured).
    #[serde(default)]
    pub drift_tokens: usize,
    /// `mole-worker` version.
    pub tool_version: String,
    /// Identity of the inputs and options; a re-run with the same value is a no-op.
    pub inputs_sha256: String,
    /// When it finished (RFC 3339).
    pub created_at: String,
    /// Seconds it took, to the millisecond.
    pub seconds: f64,
}

/// Result of [`quantize`].
#[derive(Debug, Clone)]
pub struct QuantizeReport {
    /// The metadata written (or found, when nothing had to be done).
    pub metadata: QuantizeMetadata,
    /// False when the output already held this quantization.
    pub written: bool,
}

/// The block type of tensor `name` of `shape` (see the module's documentation).
pub fn tensor_type(name: &str, shape: &[usize], qtype: QuantType, tied: bool) -> GgmlDType {
    if shape.len() != 2 || !name.ends_with(".weight") {
        return GgmlDType::F32;
    }
    let head = name == "lm_head.weight" || (tied && name.ends_with("embed_tokens.weight"));
    let want = if head && qtype != QuantType::Q8_0 {
        GgmlDType::Q6K
    } else {
        qtype.ggml()
    };
    let cols = shape[1];
    if cols.is_multiple_of(want.block_size()) {
        return want;
    }
    let fallback = match want {
        GgmlDType::Q4K => GgmlDType::Q5_0,
        GgmlDType::Q5K => GgmlDType::Q5_1,
        GgmlDType::Q6K => GgmlDType::Q8_0,
        other => other,
    };
    if cols.is_multiple_of(fallback.block_size()) {
        fallback
    } else {
        GgmlDType::F16
    }
}

/// One input tensor to write.
struct Planned {
    shard: usize,
    /// A packed projection (AWQ/GPTQ) written as its Q4_1 repack: the module's name.
    packed: Option<String>,
    name: String,
    shape: Vec<usize>,
    dtype: safetensors::Dtype,
    ggml: GgmlDType,
}

/// The checked input: its directory, weight files and config.
struct Input {
    dir: PathBuf,
    shards: Vec<PathBuf>,
    tied: bool,
    /// The scheme of an AWQ/GPTQ input's packed projections.
    packed: Option<mole_formats::quant::QuantScheme>,
}

fn check_input(opts: &QuantizeOptions, root: Option<&Path>) -> Result<Input, QuantizeError> {
    if !opts.input.exists() {
        return Err(QuantizeError::Input(format!(
            "{} does not exist",
            opts.input.display()
        )));
    }
    let dir = crate::merge::confine(&opts.input, root).map_err(QuantizeError::of_merge)?;
    if !dir.is_dir() {
        return Err(QuantizeError::Input(format!(
            "{} is not a directory",
            opts.input.display()
        )));
    }
    if mole_formats::gguf::is_quantized_dir(&dir) {
        return Err(QuantizeError::QuantizedInput(format!(
            "{} holds {QUANTIZED_FILE}",
            opts.input.display()
        )));
    }
    crate::merge::check_no_pickle(&dir).map_err(QuantizeError::of_merge)?;
    hf::check_confined(&dir).map_err(|e| QuantizeError::Input(e.to_string()))?;
    let raw = hf::read_config(&dir).map_err(|e| QuantizeError::Input(e.to_string()))?;
    let packed = mole_formats::quant::scheme(&raw).map_err(QuantizeError::QuantizedInput)?;
    let cfg =
        mole_model::ModelConfig::from_json(raw).map_err(|e| QuantizeError::Input(e.to_string()))?;
    if cfg.vision.is_some() {
        return Err(QuantizeError::Unsupported(
            "a vision-language model: mole's quantized path serves text decoders".into(),
        ));
    }
    let shards = hf::safetensors_files(&dir).map_err(|e| QuantizeError::Input(e.to_string()))?;
    let shards = shards
        .iter()
        .map(|s| crate::merge::confine(s, root).map_err(QuantizeError::of_merge))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Input {
        dir,
        shards,
        tied: cfg.tie_word_embeddings,
        packed,
    })
}

fn map(path: &Path) -> Result<memmap2::Mmap, QuantizeError> {
    mole_formats::safetensors::map(path).map_err(io_err(path))
}

fn parse<'a>(path: &Path, bytes: &'a [u8]) -> Result<safetensors::SafeTensors<'a>, QuantizeError> {
    safetensors::SafeTensors::deserialize(bytes)
        .map_err(|e| QuantizeError::Input(format!("{}: invalid safetensors: {e}", path.display())))
}

/// Every tensor of the input with its block type, in a fixed order (by file, then name).
fn plan(input: &Input, qtype: QuantType) -> Result<Vec<Planned>, QuantizeError> {
    let mut out = Vec::new();
    for (i, shard) in input.shards.iter().enumerate() {
        let mmap = map(shard)?;
        let st = parse(shard, &mmap)?;
        let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
        names.sort();
        for name in names {
            if let Some(scheme) = input.packed {
                match packed::plan(&st, &name, scheme) {
                    packed::Part::Skip => continue,
                    packed::Part::Projection { module, shape } => {
                        out.push(Planned {
                            shard: i,
                            name: format!("{module}.weight"),
                            packed: Some(module),
                            shape,
                            dtype: safetensors::Dtype::I32,
                            ggml: GgmlDType::Q4_1,
                        });
                        continue;
                    }
                    packed::Part::Dense => {}
                }
            }
            let view = st.tensor(&name).map_err(|e| QuantizeError::Tensor {
                tensor: name.clone(),
                message: e.to_string(),
            })?;
            if !mole_formats::safetensors::is_float(view.dtype()) {
                return Err(QuantizeError::Tensor {
                    tensor: name,
                    message: format!("dtype {:?} is not a float type", view.dtype()),
                });
            }
            let shape = view.shape().to_vec();
            let ggml = tensor_type(&name, &shape, qtype, input.tied);
            out.push(Planned {
                shard: i,
                packed: None,
                name,
                shape,
                dtype: view.dtype(),
                ggml,
            });
        }
    }
    Ok(out)
}

/// A writer that hashes what passes through it (the GGUF's sha256 without a second read).
struct Hashing<W> {
    inner: W,
    hash: Sha256,
    bytes: u64,
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Quantizes `values` (`rows × cols`, row-major) to `ggml` blocks, rows split across the
/// thread pool (blocks never span rows, so the pieces concatenate to the whole's blocks).
pub fn quantize_rows(
    values: &[f32],
    shape: &[usize],
    ggml: GgmlDType,
) -> candle_core::Result<Vec<u8>> {
    use rayon::prelude::*;
    let cols = *shape.last().unwrap_or(&1);
    let rows = values.len() / cols.max(1);
    let threads = rayon::current_num_threads().max(1);
    let per = rows.div_ceil(threads * 4).max(1);
    let parts: Vec<candle_core::Result<Vec<u8>>> = values
        .par_chunks(per * cols.max(1))
        .map(|chunk| {
            let t = if shape.len() == 1 {
                Tensor::from_slice(chunk, chunk.len(), &Device::Cpu)?
            } else {
                Tensor::from_slice(chunk, (chunk.len() / cols, cols), &Device::Cpu)?
            };
            Ok(QTensor::quantize(&t, ggml)?.data()?.into_owned())
        })
        .collect();
    let mut out = Vec::new();
    for p in parts {
        out.extend_from_slice(&p?);
    }
    Ok(out)
}

/// Writes the GGUF file of `planned` into `dest`; returns its sha256 and size.
fn write_gguf(
    input: &Input,
    planned: &[Planned],
    qtype: QuantType,
    dest: &Path,
    progress: &crate::progress::Progress,
) -> Result<(String, u64), QuantizeError> {
    let entries = planned
        .iter()
        .map(|p| TensorEntry {
            name: p.name.clone(),
            shape: p.shape.clone(),
            dtype: p.ggml,
        })
        .collect();
    let file = std::fs::File::create(dest).map_err(io_err(dest))?;
    let sink = Hashing {
        inner: std::io::BufWriter::with_capacity(8 << 20, file),
        hash: Sha256::new(),
        bytes: 0,
    };
    let meta = [
        ("general.name", MetaValue::Str("mole quantized".into())),
        // Tensors keep their HF names: this file is read with the directory's config.json,
        // not by llama.cpp's architecture loaders.
        ("mole.tensor_names", MetaValue::Str("hf".into())),
        ("mole.quantize.type", MetaValue::Str(qtype.name().into())),
        (
            "mole.tool_version",
            MetaValue::Str(env!("CARGO_PKG_VERSION").into()),
        ),
    ];
    let mut w = GgufWriter::new(sink, &meta, entries).map_err(io_err(dest))?;
    let mut current: Option<(usize, memmap2::Mmap)> = None;
    let mut values = Vec::new();
    for p in planned {
        if current.as_ref().map(|c| c.0) != Some(p.shard) {
            current = Some((p.shard, map(&input.shards[p.shard])?));
        }
        let (_, mmap) = current.as_ref().expect("mapped above");
        let path = &input.shards[p.shard];
        let st = parse(path, mmap)?;
        if let (Some(module), Some(scheme)) = (&p.packed, input.packed) {
            let bytes = packed::q4_1(&st, module, scheme, path)?;
            w.tensor(&bytes).map_err(io_err(dest))?;
            progress.inc(1);
            continue;
        }
        let view = st.tensor(&p.name).map_err(|e| QuantizeError::Tensor {
            tensor: p.name.clone(),
            message: e.to_string(),
        })?;
        mole_formats::safetensors::decode_into(p.dtype, view.data(), &mut values);
        let bytes =
            quantize_rows(&values, &p.shape, p.ggml).map_err(|e| QuantizeError::Tensor {
                tensor: p.name.clone(),
                message: e.to_string(),
            })?;
        w.tensor(&bytes).map_err(io_err(dest))?;
        progress.inc(1);
    }
    let sink = w.finish().map_err(io_err(dest))?;
    let file = sink.inner.into_inner().map_err(|e| QuantizeError::Io {
        path: dest.display().to_string(),
        source: e.into_error(),
    })?;
    if crate::merge::durable() {
        file.sync_data().map_err(io_err(dest))?;
    }
    Ok((hex::encode(sink.hash.finalize()), sink.bytes))
}

fn inputs_digest(
    source_weights: &str,
    merge_inputs: Option<&str>,
    opts: &QuantizeOptions,
) -> String {
    let mut h = Sha256::new();
    for part in [
        source_weights,
        merge_inputs.unwrap_or(""),
        opts.qtype.name(),
        &opts.drift_tokens.to_string(),
        &opts.max_drift.map(|d| d.to_string()).unwrap_or_default(),
    ] {
        h.update(part.as_bytes());
        h.update([0]);
    }
    hex::encode(h.finalize())
}

/// Reads the metadata of an existing quantized output.
pub fn read_metadata(dir: &Path) -> Option<QuantizeMetadata> {
    std::fs::read_to_string(dir.join(METADATA_FILE))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
}

/// Removes what a crashed run left next to `out` (its temporary siblings), sparing `keep`
/// (the input of a `merge --quantize`, which lies there too).
pub fn clean_temporaries(parent: &Path, out_name: &str, keep: Option<&Path>) {
    let prefix = format!(".{out_name}.tmp-");
    if let Ok(entries) = std::fs::read_dir(parent) {
        for e in entries.flatten() {
            let path = e.path();
            if keep.is_some_and(|k| k == path) {
                continue;
            }
            if e.file_name().to_string_lossy().starts_with(&prefix) {
                let _ = std::fs::remove_dir_all(path);
            }
        }
    }
}

/// Quantizes `opts.input` into `opts.out`.
pub fn quantize(opts: &QuantizeOptions) -> Result<QuantizeReport, QuantizeError> {
    let started = std::time::Instant::now();
    if opts.max_drift.is_some() && opts.drift_tokens == 0 {
        return Err(QuantizeError::Input(
            "--max-drift needs the drift measured (--drift-tokens above 0)".into(),
        ));
    }
    if let Some(b) = opts.max_drift {
        if !(b.is_finite() && b > 0.0) {
            return Err(QuantizeError::Input(format!(
                "--max-drift {b} must be a positive number"
            )));
        }
    }
    let root = match &opts.root {
        Some(r) => Some(r.canonicalize().map_err(io_err(r))?),
        None => None,
    };
    let root = root.as_deref();
    let input = check_input(opts, root)?;
    let source_weights =
        crate::merge::base_identity(&input.dir, &input.shards).map_err(QuantizeError::of_merge)?;
    let merge_meta: Option<crate::merge::MergeMetadata> =
        std::fs::read_to_string(input.dir.join("merge_metadata.json"))
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok());
    let merge_inputs = merge_meta.as_ref().map(|m| m.inputs_sha256.clone());
    let digest = inputs_digest(&source_weights, merge_inputs.as_deref(), opts);

    let (parent, out_name) =
        crate::merge::output_parent(&opts.out, root).map_err(QuantizeError::of_merge)?;
    let out = parent.join(&out_name);
    if out.exists() {
        return match read_metadata(&out) {
            Some(m) if m.inputs_sha256 == digest => Ok(QuantizeReport {
                metadata: m,
                written: false,
            }),
            _ => Err(QuantizeError::OutputExists(out.display().to_string())),
        };
    }
    let out_name = out_name.to_string_lossy().to_string();
    clean_temporaries(&parent, &out_name, Some(&input.dir));
    let tmp = parent.join(format!(".{out_name}.tmp-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).map_err(io_err(&tmp))?;
    let result = (|| {
        let planned = plan(&input, opts.qtype)?;
        let progress = crate::progress::Progress::new("quantize", "tensors", planned.len() as u64);
        let dest = tmp.join(QUANTIZED_FILE);
        let (gguf_sha256, output_bytes) =
            write_gguf(&input, &planned, opts.qtype, &dest, &progress)?;
        progress.finish();
        copy_side_files(&input.dir, &tmp, root)?;
        if input.packed.is_some() {
            packed::drop_quantization_config(&tmp)?;
        }
        let drift = if opts.drift_tokens > 0 {
            let d = measure_drift(&input.dir, &tmp, opts.drift_tokens)?;
            tracing::info!(
                mean_kl = d.mean_kl,
                max_kl = d.max_kl,
                top1_agreement = d.top1_agreement,
                positions = d.positions,
                "quantization drift"
            );
            if let Some(bound) = opts.max_drift {
                if d.mean_kl > bound {
                    return Err(QuantizeError::DriftOverBound {
                        mean_kl: d.mean_kl,
                        bound,
                    });
                }
            }
            Some(d)
        } else {
            None
        };
        let mut tensor_types = BTreeMap::new();
        for p in &planned {
            *tensor_types.entry(format!("{:?}", p.ggml)).or_insert(0) += 1;
        }
        let source_bytes = input
            .shards
            .iter()
            .map(|s| std::fs::metadata(s).map(|m| m.len()).map_err(io_err(s)))
            .sum::<Result<u64, _>>()?;
        let metadata = QuantizeMetadata {
            source: opts.input.display().to_string(),
            source_weights_sha256: source_weights.clone(),
            merge_inputs_sha256: merge_inputs.clone(),
            quant_type: opts.qtype.name().into(),
            tensor_types,
            source_bytes,
            output_bytes,
            gguf_sha256,
            drift,
            max_drift: opts.max_drift,
            drift_tokens: opts.drift_tokens,
            tool_version: env!("CARGO_PKG_VERSION").to_string(),
            inputs_sha256: digest.clone(),
            created_at: chrono::Utc::now().to_rfc3339(),
            seconds: (started.elapsed().as_secs_f64() * 1e3).round() / 1e3,
        };
        let path = tmp.join(METADATA_FILE);
        let text = serde_json::to_string_pretty(&metadata).expect("metadata serializes");
        std::fs::write(&path, text).map_err(io_err(&path))?;
        crate::merge::sync_file(&path).map_err(QuantizeError::of_merge)?;
        crate::merge::sync_dir(&tmp).map_err(QuantizeError::of_merge)?;
        std::fs::rename(&tmp, &out).map_err(io_err(&out))?;
        crate::merge::sync_dir(&parent).map_err(QuantizeError::of_merge)?;
        Ok(QuantizeReport {
            metadata,
            written: true,
        })
    })();
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result
}

/// Copies every file of the input that is not a weight file (config, tokenizer, templates,
/// the merge's metadata) into the output, each made durable.
fn copy_side_files(input: &Path, tmp: &Path, root: Option<&Path>) -> Result<(), QuantizeError> {
    for entry in std::fs::read_dir(input).map_err(io_err(input))? {
        let entry = entry.map_err(io_err(input))?;
        let name = entry.file_name();
        let s = name.to_string_lossy();
        if s.ends_with(".safetensors") || s == "model.safetensors.index.json" || s == METADATA_FILE
        {
            continue;
        }
        let src = crate::merge::confine(&entry.path(), root).map_err(QuantizeError::of_merge)?;
        if src.is_file() {
            let dest = tmp.join(&name);
            std::fs::copy(&src, &dest).map_err(io_err(&dest))?;
            crate::merge::sync_file(&dest).map_err(QuantizeError::of_merge)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn types_parse_by_name_and_refuse_others() {
        for (name, t) in QuantType::ALL {
            assert_eq!(QuantType::parse(name).unwrap(), t);
            assert_eq!(t.name(), name);
        }
        assert_eq!(QuantType::parse("Q4_K").unwrap(), QuantType::Q4K);
        let e = QuantType::parse("q3_k").unwrap_err();
        assert_eq!(e.code(), "unsupported_quant_type");
        assert!(e.to_string().contains("q3_k"), "{e}");
    }

    /// llama.cpp's choices: norms stay f32, the head is Q6_K (q8_0 keeps q8_0), narrow rows
    /// fall back to a 32-block type, and to f16 when even that does not divide them.
    #[test]
    fn tensor_types_follow_llama_cpp() {
        let t = |n: &str, s: &[usize], q, tied| tensor_type(n, s, q, tied);
        assert_eq!(
            t("model.norm.weight", &[256], QuantType::Q4K, false),
            GgmlDType::F32
        );
        assert_eq!(
            t(
                "model.layers.0.self_attn.q_proj.bias",
                &[256],
                QuantType::Q4_0,
                false
            ),
            GgmlDType::F32
        );
        assert_eq!(
            t(
                "model.layers.0.mlp.up_proj.weight",
                &[512, 256],
                QuantType::Q4K,
                false
            ),
            GgmlDType::Q4K
        );
        assert_eq!(
            t("lm_head.weight", &[1000, 256], QuantType::Q4_0, false),
            GgmlDType::Q6K
        );
        assert_eq!(
            t("lm_head.weight", &[1000, 256], QuantType::Q8_0, false),
            GgmlDType::Q8_0
        );
        assert_eq!(
            t(
                "model.embed_tokens.weight",
                &[1000, 256],
                QuantType::Q4_0,
                true
            ),
            GgmlDType::Q6K,
            "a tied embedding is the head"
        );
        assert_eq!(
            t(
                "model.embed_tokens.weight",
                &[1000, 256],
                QuantType::Q4_0,
                false
            ),
            GgmlDType::Q4_0
        );
        assert_eq!(
            t(
                "model.layers.0.mlp.up_proj.weight",
                &[128, 64],
                QuantType::Q4K,
                false
            ),
            GgmlDType::Q5_0
        );
        assert_eq!(
            t(
                "model.layers.0.mlp.up_proj.weight",
                &[128, 64],
                QuantType::Q5K,
                false
            ),
            GgmlDType::Q5_1
        );
        assert_eq!(
            t("lm_head.weight", &[128, 64], QuantType::Q4_1, false),
            GgmlDType::Q8_0
        );
        assert_eq!(
            t(
                "model.layers.0.mlp.up_proj.weight",
                &[128, 40],
                QuantType::Q4_0,
                false
            ),
            GgmlDType::F16
        );
    }
}
