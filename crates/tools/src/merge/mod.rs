//! Streaming merge of a PEFT LoRA adapter into HF safetensors weights:
//! `W' = W + s·(B·A)` per targeted module, shard by shard.
//!
//! Memory stays bounded whatever the model size: unchanged tensors are copied file to file by
//! the kernel, changed ones are computed a block of rows at a time (in f32) from the
//! memory-mapped input and written as they are ready, and the adapter stays memory-mapped,
//! decoded one module at a time (see `writer`). The output goes to a temporary directory renamed into place
//! at the end, so a crash never leaves a partial output, and a re-run with identical inputs is
//! a no-op.

pub mod cli;
mod quantized_base;
pub mod tensors;
mod writer;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use serde::Serialize;
use sha2::{Digest, Sha256};

use mole_formats::hf;
use mole_formats::peft::weights::{MappedAdapter, WeightsError};
use mole_formats::peft::{self, AdapterConfig};

pub use mole_formats::safetensors::to_f32;
pub use tensors::{bf16_ulp_distance, OutDtype};

pub use crate::fs::{durable, set_durable};

/// Files of a base model directory that are weights (rewritten), not copied.
fn is_weight_file(name: &str) -> bool {
    name.ends_with(".safetensors") || name == "model.safetensors.index.json"
}

/// Why a merge failed. Stable names via [`MergeError::code`]; bad input exits 2, I/O exits 1.
#[derive(Debug, thiserror::Error)]
pub enum MergeError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// File or directory.
        path: String,
        /// Cause.
        source: std::io::Error,
    },
    /// The base model directory is unusable.
    #[error("base model: {0}")]
    Base(#[from] hf::HfError),
    /// The adapter config is unusable.
    #[error("adapter: {0}")]
    AdapterConfig(#[from] peft::PeftError),
    /// Pickle weights.
    #[error("{0}: pickle files (.bin/.pt) are refused; convert the weights to safetensors")]
    Pickle(String),
    /// A path resolves outside `--root`.
    #[error("{path} resolves outside the model root {root}")]
    OutsideRoot {
        /// Path as given.
        path: String,
        /// Root.
        root: String,
    },
    /// A safetensors file is malformed.
    #[error("{path}: invalid safetensors: {message}")]
    Safetensors {
        /// File.
        path: String,
        /// Parser message.
        message: String,
    },
    /// The adapter was trained on another base model.
    #[error("adapter base model is {found:?}, expected {expected:?}")]
    WrongBase {
        /// `base_model_name_or_path` of the adapter.
        found: Option<String>,
        /// `--expect-base`.
        expected: String,
    },
    /// An adapter tensor does not fit the base.
    #[error("{module}: {message}")]
    Shape {
        /// Module.
        module: String,
        /// What does not fit.
        message: String,
    },
    /// A module's rank is over the limit.
    #[error("{module}: rank {rank} is over the limit {limit}")]
    Rank {
        /// Module.
        module: String,
        /// Its rank.
        rank: usize,
        /// `--max-rank`.
        limit: usize,
    },
    /// An adapter feature mole does not merge.
    #[error("unsupported adapter: {0}")]
    Unsupported(String),
    /// Safe merge found NaN or Inf.
    #[error("{module}: merged weights contain NaN/Inf (safe merge); the adapter is broken")]
    NonFinite {
        /// Module.
        module: String,
    },
    /// The output directory exists and was made from other inputs.
    #[error("{0} exists and was merged from different inputs; refusing to overwrite it")]
    OutputExists(String),
    /// The base is a quantized checkpoint of a variant mole does not read (act-order GPTQ,
    /// 3 bits, ...): its weights cannot be dequantized, so nothing is merged onto them.
    #[error("base model is a quantized checkpoint mole cannot merge onto: {0}")]
    QuantizedBase(String),
}

impl MergeError {
    /// Stable name (Event reason suffix, metric label).
    pub fn code(&self) -> &'static str {
        match self {
            MergeError::Io { .. } => "io_error",
            MergeError::Base(hf::HfError::OutsideDir { .. }) => "path_outside_root",
            MergeError::Base(_) => "invalid_base",
            MergeError::AdapterConfig(_) => "invalid_adapter_config",
            MergeError::Pickle(_) => "pickle_refused",
            MergeError::OutsideRoot { .. } => "path_outside_root",
            MergeError::Safetensors { .. } => "invalid_safetensors",
            MergeError::WrongBase { .. } => "wrong_base_model",
            MergeError::Shape { .. } => "shape_mismatch",
            MergeError::Rank { .. } => "rank_over_limit",
            MergeError::Unsupported(_) => "unsupported_adapter",
            MergeError::NonFinite { .. } => "non_finite_weights",
            MergeError::OutputExists(_) => "output_exists",
            MergeError::QuantizedBase(_) => "quantized_base",
        }
    }

    /// Process exit code: 1 for I/O failures (retry may help), 2 for bad input (it will not).
    pub fn exit_code(&self) -> u8 {
        match self {
            MergeError::Io { .. } => 1,
            MergeError::Base(hf::HfError::Io { .. }) => 1,
            _ => 2,
        }
    }
}

/// The adapter file's errors keep their names and messages in the merge's own terms.
impl From<WeightsError> for MergeError {
    fn from(e: WeightsError) -> Self {
        match e {
            WeightsError::Io { path, source } => MergeError::Io { path, source },
            WeightsError::Safetensors { path, message } => {
                MergeError::Safetensors { path, message }
            }
            WeightsError::Shape { module, message } => MergeError::Shape { module, message },
            WeightsError::Unsupported(m) => MergeError::Unsupported(m),
            WeightsError::OutsideDir { path, dir } => MergeError::OutsideRoot { path, root: dir },
        }
    }
}

/// Maps an I/O error on `path` to [`MergeError::Io`] naming the file.
pub fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> MergeError + '_ {
    move |source| MergeError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// What to merge and how.
#[derive(Debug, Clone)]
pub struct MergeOptions {
    /// Base HF model directory.
    pub base: PathBuf,
    /// PEFT adapter directory.
    pub adapter: PathBuf,
    /// Output directory (created; must not be inside `base` or `adapter`).
    pub out: PathBuf,
    /// Check every merged tensor for NaN/Inf.
    pub safe_merge: bool,
    /// Output dtype (default: each tensor keeps its base dtype).
    pub dtype: Option<OutDtype>,
    /// Every path must resolve inside this directory.
    pub root: Option<PathBuf>,
    /// The adapter's `base_model_name_or_path` must name this model.
    pub expect_base: Option<String>,
    /// Highest LoRA rank accepted.
    pub max_rank: usize,
    /// Adapter name recorded in the metadata.
    pub adapter_name: Option<String>,
    /// Adapter version recorded in the metadata.
    pub adapter_version: Option<String>,
}

/// `merge_metadata.json`: provenance of a merged model.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct MergeMetadata {
    /// Adapter name.
    pub adapter_name: Option<String>,
    /// Adapter version.
    pub adapter_version: Option<String>,
    /// `base_model_name_or_path` of the adapter.
    pub base_model: Option<String>,
    /// sha256 of `adapter_model.safetensors`.
    pub adapter_sha256: String,
    /// sha256 of `adapter_config.json`.
    pub adapter_config_sha256: String,
    /// sha256 of the base's `model.safetensors.index.json` (or of the single file's header).
    pub base_index_sha256: String,
    /// Safe merge on.
    pub safe_merge: bool,
    /// Output dtype (`base` when each tensor kept its dtype).
    pub dtype: String,
    /// LoRA scale per module family (`q_proj`, ...), or the list when patterns differ.
    pub scales: BTreeMap<String, Vec<f64>>,
    /// Modules that received a LoRA delta.
    pub modules_merged: usize,
    /// Base tensors replaced by the adapter (`modules_to_save`, saved embeddings, biases).
    pub tensors_replaced: usize,
    /// Modules of a quantized (AWQ/GPTQ) base the adapter touched, dequantized exactly and
    /// written dense (`quantization_config.modules_to_not_convert` names them); 0 on a dense
    /// base.
    #[serde(default)]
    pub dequantized_modules: usize,
    /// Parameters in the output.
    pub total_params: u64,
    /// `mole-worker` version.
    pub tool_version: String,
    /// Identity of the inputs; a re-run with the same value is a no-op.
    pub inputs_sha256: String,
    /// When the merge finished (RFC 3339).
    pub created_at: String,
    /// Seconds the merge took, to the millisecond.
    pub seconds: f64,
}

/// Result of [`merge`].
#[derive(Debug, Clone)]
pub struct MergeReport {
    /// The metadata written (or found, when nothing had to be done).
    pub metadata: MergeMetadata,
    /// False when the output already held this merge.
    pub written: bool,
}

/// Resolves `p` (symlinks included) and checks it lies inside `root`.
pub fn confine(p: &Path, root: Option<&Path>) -> Result<PathBuf, MergeError> {
    use mole_formats::paths::{self, Unconfined};
    paths::confine(p, root).map_err(|e| match e {
        Unconfined::Outside(_) => outside_root(p, root),
        Unconfined::Path(source) => io_err(p)(source),
        Unconfined::Root(source) => io_err(root.unwrap_or(p))(source),
    })
}

/// `p` refused as outside `--root`.
fn outside_root(p: &Path, root: Option<&Path>) -> MergeError {
    MergeError::OutsideRoot {
        path: p.display().to_string(),
        root: root.map(|r| r.display().to_string()).unwrap_or_default(),
    }
}

/// The SHA-256 of a file's bytes, hex.
pub fn sha256_file(path: &Path) -> Result<String, MergeError> {
    let mut f = std::fs::File::open(path).map_err(io_err(path))?;
    let mut h = Sha256::new();
    std::io::copy(&mut f, &mut h).map_err(io_err(path))?;
    Ok(hex::encode(h.finalize()))
}

/// Hash that identifies the base weights cheaply: the index file, or a single file's header
/// (names, dtypes, shapes and offsets) plus its size.
pub fn base_identity(base: &Path, shards: &[PathBuf]) -> Result<String, MergeError> {
    let index = base.join("model.safetensors.index.json");
    if index.exists() {
        return sha256_file(&index);
    }
    let mut h = Sha256::new();
    for s in shards {
        let mut f = std::fs::File::open(s).map_err(io_err(s))?;
        let mut n = [0u8; 8];
        std::io::Read::read_exact(&mut f, &mut n).map_err(io_err(s))?;
        let len = u64::from_le_bytes(n).min(100 << 20) as usize;
        let mut header = vec![0u8; len];
        std::io::Read::read_exact(&mut f, &mut header).map_err(io_err(s))?;
        h.update(&header);
        h.update(f.metadata().map_err(io_err(s))?.len().to_le_bytes());
    }
    Ok(hex::encode(h.finalize()))
}

/// Refuses a directory holding a pickle-format file ([`hf::find_pickle`]): loading one runs
/// code.
pub fn check_no_pickle(dir: &Path) -> Result<(), MergeError> {
    match hf::find_pickle(dir) {
        Some(p) => Err(MergeError::Pickle(p.display().to_string())),
        None => Ok(()),
    }
}

/// Whether the adapter's recorded base names `expected` (same string, or same last path
/// component, so a local copy of `org/model` matches).
fn same_base(found: Option<&str>, expected: &str) -> bool {
    let Some(found) = found else { return false };
    let last = |s: &str| {
        s.trim_end_matches('/')
            .rsplit('/')
            .next()
            .unwrap_or("")
            .to_string()
    };
    found.trim_end_matches('/') == expected.trim_end_matches('/') || last(found) == last(expected)
}

/// The inputs of a merge, checked: every path confined to the root, no pickle files, a LoRA
/// config mole merges, trained on the expected base.
struct Inputs {
    base: PathBuf,
    quant: Option<mole_formats::quant::QuantScheme>,
    shards: Vec<PathBuf>,
    adapter_dir: PathBuf,
    config: AdapterConfig,
    weights: PathBuf,
}

fn check_inputs(opts: &MergeOptions, root: Option<&Path>) -> Result<Inputs, MergeError> {
    let base = confine(&opts.base, root)?;
    let adapter_dir = confine(&opts.adapter, root)?;
    check_no_pickle(&adapter_dir)?;

    let index = base.join("model.safetensors.index.json");
    if index.exists() {
        confine(&index, root)?;
    }
    let shards = hf::safetensors_files(&base)?;
    // A quantized base's touched projections are dequantized exactly and written dense (see
    // `quant`); a variant mole cannot read is refused here, naming why, before anything runs.
    let base_config = confine(&base.join("config.json"), root)?;
    let quant = if base_config.exists() {
        mole_formats::quant::scheme(&hf::read_config(&base)?).map_err(MergeError::QuantizedBase)?
    } else {
        None
    };
    let shards = shards
        .iter()
        .map(|s| confine(s, root))
        .collect::<Result<Vec<_>, _>>()?;

    confine(&adapter_dir.join("adapter_config.json"), root)?;
    let config = AdapterConfig::from_dir(&adapter_dir)?;
    if config.use_dora {
        return Err(MergeError::Unsupported(
            "DoRA (use_dora) adapters are not merged by mole; merge them with PEFT or train without DoRA".into(),
        ));
    }
    if let Some(expected) = &opts.expect_base {
        if !same_base(config.base_model_name_or_path.as_deref(), expected) {
            return Err(MergeError::WrongBase {
                found: config.base_model_name_or_path.clone(),
                expected: expected.clone(),
            });
        }
    }
    let weights = adapter_dir.join("adapter_model.safetensors");
    if !weights.exists() {
        return Err(MergeError::Io {
            path: weights.display().to_string(),
            source: std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "adapter_model.safetensors not found",
            ),
        });
    }
    let weights = confine(&weights, root)?;
    Ok(Inputs {
        base,
        quant,
        shards,
        adapter_dir,
        config,
        weights,
    })
}

/// What the output's provenance records of the inputs, and their hash together with the
/// options that change the output (a re-run with the same hash is a no-op).
struct Digests {
    adapter: String,
    config: String,
    base: String,
    dtype: String,
    inputs: String,
}

fn digests(opts: &MergeOptions, inputs: &Inputs) -> Result<Digests, MergeError> {
    let config = sha256_file(&inputs.adapter_dir.join("adapter_config.json"))?;
    let adapter = sha256_file(&inputs.weights)?;
    let base = base_identity(&inputs.base, &inputs.shards)?;
    let dtype = opts.dtype.map(|d| d.name()).unwrap_or("base").to_string();
    let mut h = Sha256::new();
    for part in [
        adapter.as_str(),
        config.as_str(),
        base.as_str(),
        dtype.as_str(),
        if opts.safe_merge { "safe" } else { "unsafe" },
        opts.adapter_name.as_deref().unwrap_or(""),
        opts.adapter_version.as_deref().unwrap_or(""),
    ] {
        h.update(part.as_bytes());
        h.update([0]);
    }
    Ok(Digests {
        adapter,
        config,
        base,
        dtype,
        inputs: hex::encode(h.finalize()),
    })
}

/// The identity of a merge's inputs and options (`inputs_sha256` of its metadata), computed
/// without merging: how a merge followed by a quantization recognizes an output it already
/// wrote.
pub fn inputs_digest(opts: &MergeOptions) -> Result<String, MergeError> {
    let root = match &opts.root {
        Some(r) => Some(r.canonicalize().map_err(io_err(r))?),
        None => None,
    };
    let inputs = check_inputs(opts, root.as_deref())?;
    Ok(digests(opts, &inputs)?.inputs)
}

/// The output's parent (created, confined to the root) and its name.
pub fn output_parent(
    out: &Path,
    root: Option<&Path>,
) -> Result<(PathBuf, std::ffi::OsString), MergeError> {
    let out_name = out
        .file_name()
        .ok_or_else(|| outside_root(out, root))?
        .to_owned();
    let parent = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    // Confined before anything is created: the deepest existing ancestor lies inside the root
    // and the directories still to create are plain names (no `..` that would climb out).
    if root.is_some() {
        let existing = parent
            .ancestors()
            .find(|a| a.as_os_str().is_empty() || a.exists())
            .unwrap_or(Path::new("."));
        let existing = if existing.as_os_str().is_empty() {
            Path::new(".")
        } else {
            existing
        };
        confine(existing, root)?;
        let rest = parent.strip_prefix(existing).unwrap_or(parent);
        if !mole_formats::paths::stays_below(rest) {
            return Err(outside_root(out, root));
        }
    }
    std::fs::create_dir_all(parent).map_err(io_err(parent))?;
    Ok((confine(parent, root)?, out_name))
}

/// Merges `opts.adapter` into `opts.base`, writing `opts.out`.
pub fn merge(opts: &MergeOptions) -> Result<MergeReport, MergeError> {
    let started = std::time::Instant::now();
    let root = match &opts.root {
        Some(r) => Some(r.canonicalize().map_err(io_err(r))?),
        None => None,
    };
    let root = root.as_deref();
    let inputs = check_inputs(opts, root)?;
    let digests = digests(opts, &inputs)?;

    // Output location: its parent must exist inside the root; the output itself must not,
    // unless it was merged from the same inputs.
    let (parent, out_name) = output_parent(&opts.out, root)?;
    let out = parent.join(&out_name);
    if out.exists() {
        let meta_path = out.join("merge_metadata.json");
        let existing: Option<MergeMetadata> = std::fs::read_to_string(&meta_path)
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok());
        return match existing {
            Some(m) if m.inputs_sha256 == digests.inputs => Ok(MergeReport {
                metadata: m,
                written: false,
            }),
            _ => Err(MergeError::OutputExists(out.display().to_string())),
        };
    }

    let adapter = MappedAdapter::open(&inputs.weights, &inputs.config)?;
    for (module, lora) in &adapter.loras {
        let rank = lora.rank();
        if rank > opts.max_rank {
            return Err(MergeError::Rank {
                module: module.clone(),
                rank,
                limit: opts.max_rank,
            });
        }
    }

    // Clean up what a crashed run may have left, then write into a fresh temporary directory.
    let tmp_prefix = format!(".{}.tmp-", out_name.to_string_lossy());
    if let Ok(entries) = std::fs::read_dir(&parent) {
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with(&tmp_prefix) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
    let tmp = parent.join(format!("{tmp_prefix}{}", std::process::id()));
    std::fs::create_dir_all(&tmp).map_err(io_err(&tmp))?;
    let config = &inputs.config;
    let result = write_merged(&inputs, &adapter, opts, &tmp, root).and_then(|stats| {
        let metadata = MergeMetadata {
            adapter_name: opts.adapter_name.clone(),
            adapter_version: opts.adapter_version.clone(),
            base_model: config.base_model_name_or_path.clone(),
            adapter_sha256: digests.adapter,
            adapter_config_sha256: digests.config,
            base_index_sha256: digests.base,
            safe_merge: opts.safe_merge,
            dtype: digests.dtype,
            scales: tensors::scales_by_family(&adapter),
            modules_merged: stats.modules_merged,
            tensors_replaced: stats.tensors_replaced,
            dequantized_modules: stats.dequantized_modules,
            total_params: stats.total_params,
            tool_version: env!("CARGO_PKG_VERSION").to_string(),
            inputs_sha256: digests.inputs,
            created_at: chrono::Utc::now().to_rfc3339(),
            // To the millisecond: a short decimal parses back to the same f64 (serde_json
            // does not round-trip every f64), so a re-run's read of the file equals it.
            seconds: (started.elapsed().as_secs_f64() * 1e3).round() / 1e3,
        };
        publish(&metadata, &tmp, &out, &parent)?;
        Ok(MergeReport {
            metadata,
            written: true,
        })
    });
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result
}

/// Writes the metadata into the finished temporary directory, makes it durable and renames it
/// into place.
fn publish(
    metadata: &MergeMetadata,
    tmp: &Path,
    out: &Path,
    parent: &Path,
) -> Result<(), MergeError> {
    let path = tmp.join("merge_metadata.json");
    let text = serde_json::to_string_pretty(metadata).expect("metadata serializes");
    std::fs::write(&path, text).map_err(io_err(&path))?;
    sync_file(&path)?;
    sync_dir(tmp)?;
    std::fs::rename(tmp, out).map_err(io_err(out))?;
    sync_dir(parent)
}

/// [`crate::fs::sync_dir`], the error naming `dir`.
pub fn sync_dir(dir: &Path) -> Result<(), MergeError> {
    crate::fs::sync_dir(dir).map_err(io_err(dir))
}

fn map_shard(shard: &Path) -> Result<memmap2::Mmap, MergeError> {
    mole_formats::safetensors::map(shard).map_err(io_err(shard))
}

fn read_header(
    shard: &Path,
    bytes: &[u8],
) -> Result<(usize, safetensors::tensor::Metadata), MergeError> {
    safetensors::SafeTensors::read_metadata(bytes).map_err(|e| MergeError::Safetensors {
        path: shard.display().to_string(),
        message: e.to_string(),
    })
}

struct WriteStats {
    modules_merged: usize,
    dequantized_modules: usize,
    tensors_replaced: usize,
    total_params: u64,
}

fn write_merged(
    inputs: &Inputs,
    adapter: &MappedAdapter,
    opts: &MergeOptions,
    tmp: &Path,
    root: Option<&Path>,
) -> Result<WriteStats, MergeError> {
    let (base, shards, config) = (&inputs.base, &inputs.shards, &inputs.config);
    // Every targeted module and every replacement must exist in the base with the right shape
    // before anything is written: collect the base's tensor infos from the shard headers.
    let mut infos: HashMap<String, (Vec<usize>, safetensors::Dtype)> = HashMap::new();
    for shard in shards {
        let mmap = map_shard(shard)?;
        let (_, meta) = read_header(shard, &mmap)?;
        for (name, info) in meta.tensors() {
            infos.insert(name, (info.shape.clone(), info.dtype));
        }
    }
    let dense = match inputs.quant {
        Some(scheme) => quantized_base::add_dense_infos(&mut infos, scheme),
        None => Default::default(),
    };
    let plan = tensors::plan(adapter, &infos, config)?;
    let mapped = quantized_base::Shards::open(if inputs.quant.is_some() { shards } else { &[] })?;
    let parsed = quantized_base::parse(&mapped)?;
    let quant = match inputs.quant {
        Some(scheme) => quantized_base::QuantBase::read(&mapped, &parsed, &plan, &dense, scheme)?,
        None => quantized_base::QuantBase::default(),
    };
    // What the output holds: not the touched modules' packed parts, not the dense names of
    // the packed modules left alone.
    infos.retain(|k, _| {
        !(quant.dropped.contains(k) || dense.contains(k) && !quant.touched.contains_key(k))
    });

    let mut stats = WriteStats {
        dequantized_modules: quant.touched.len(),
        modules_merged: plan
            .deltas
            .values()
            .filter(|d| matches!(d, tensors::Delta::LowRank { .. }))
            .count(),
        tensors_replaced: plan.replacements.len(),
        total_params: 0,
    };
    let mut total_size: u64 = 0;
    // The bytes to write: every base tensor in the output dtype.
    let to_write: u64 = infos
        .values()
        .map(|(shape, dtype)| {
            let size = match opts.dtype {
                Some(OutDtype::F32) => 4,
                Some(_) => 2,
                None => dtype.bitsize() / 8,
            };
            shape.iter().product::<usize>() as u64 * size as u64
        })
        .sum();
    let progress = crate::progress::Progress::new("merge", "bytes", to_write);
    // Each written shard is made durable (fdatasync) in the background while the next one is
    // computed; all of them before the directory is renamed into place.
    std::thread::scope(|sc| -> Result<(), MergeError> {
        let mut syncs = Vec::new();
        for shard in shards {
            let dest = tmp.join(shard.file_name().expect("shard files have names"));
            let (written, file) =
                writer::write_shard(shard, &dest, &plan, &quant, adapter, opts, &progress)?;
            stats.total_params += written.params;
            total_size += written.data_bytes;
            if durable() {
                syncs.push((dest, sc.spawn(move || file.sync_data())));
            }
        }
        for (dest, h) in syncs {
            h.join()
                .expect("fdatasync does not panic")
                .map_err(io_err(&dest))?;
        }
        Ok(())
    })?;
    progress.finish();

    // Index (same shard layout as the base) and every non-weight file, copied.
    let index = base.join("model.safetensors.index.json");
    if index.exists() {
        let mut json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&index).map_err(io_err(&index))?)
                .map_err(|e| {
                    MergeError::Base(hf::HfError::Json {
                        path: index.display().to_string(),
                        message: e.to_string(),
                    })
                })?;
        if let Some(meta) = json.get_mut("metadata").and_then(|m| m.as_object_mut()) {
            meta.insert("total_size".into(), total_size.into());
        }
        quantized_base::rewrite_index(&mut json, &quant);
        let dest = tmp.join("model.safetensors.index.json");
        std::fs::write(&dest, serde_json::to_string_pretty(&json).expect("json"))
            .map_err(io_err(&dest))?;
    }
    for entry in std::fs::read_dir(base).map_err(io_err(base))? {
        let entry = entry.map_err(io_err(base))?;
        let name = entry.file_name();
        let name_s = name.to_string_lossy();
        if is_weight_file(&name_s) || name_s == "merge_metadata.json" {
            continue;
        }
        let src = confine(&entry.path(), root)?;
        if src.is_file() {
            let dest = tmp.join(&name);
            std::fs::copy(&src, &dest).map_err(io_err(&dest))?;
        }
    }
    if let Some(d) = opts.dtype {
        rewrite_config_dtype(tmp, d)?;
    }
    if !quant.touched.is_empty() {
        quantized_base::rewrite_config(tmp, &quant)?;
    }
    for entry in std::fs::read_dir(tmp).map_err(io_err(tmp))? {
        let path = entry.map_err(io_err(tmp))?.path();
        if path.extension().is_none_or(|e| e != "safetensors") {
            sync_file(&path)?;
        }
    }
    Ok(stats)
}

/// [`crate::fs::sync_file`], the error naming `path`.
pub fn sync_file(path: &Path) -> Result<(), MergeError> {
    crate::fs::sync_file(path).map_err(io_err(path))
}

/// With `--dtype`, the copied config.json must say what the weights now are.
fn rewrite_config_dtype(dir: &Path, dtype: OutDtype) -> Result<(), MergeError> {
    let path = dir.join("config.json");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(());
    };
    let Ok(mut json) = serde_json::from_str::<serde_json::Value>(&text) else {
        return Ok(());
    };
    if let Some(obj) = json.as_object_mut() {
        let v = serde_json::Value::String(dtype.torch_name().into());
        for key in ["torch_dtype", "dtype"] {
            if obj.contains_key(key) {
                obj.insert(key.into(), v.clone());
            }
        }
    }
    std::fs::write(&path, serde_json::to_string_pretty(&json).expect("json")).map_err(io_err(&path))
}
