//! Building the engines the server serves from: the base model's, and in local mode one per
//! adapter configured `mode: merged`, merged in-process.

use std::collections::HashMap;
use std::sync::Arc;

use mole_api::{ServingMode, WorkerAdapter, WorkerConfig, WorkerMode};

use crate::config::model_dir;
use crate::config::ConfigError;
use mole_engine::api::{Backend, EngineError, EngineHandles, PromptCodec};
use mole_engine::replicas::Replicas;
use mole_engine::{
    candle_dtype, compute_devices, default_device, Engine, EngineOptions, ModelSource,
};
use mole_formats::hf::{self, HfError};
use mole_model::LoraKernel;
use mole_tools::merge::MergeError;

/// Why an engine could not be built. Stable names via [`BuildError::code`].
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// A configured path is unusable (outside the model root, missing).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The model did not load.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// Merging an adapter in-process failed.
    #[error(transparent)]
    Merge(#[from] MergeError),
    /// The model directory is unusable: a file it names lies outside it.
    #[error(transparent)]
    Dir(#[from] HfError),
}

impl BuildError {
    /// Stable name (metric label, log field).
    pub fn code(&self) -> &'static str {
        match self {
            BuildError::Config(e) => e.code(),
            BuildError::Engine(e) => e.code(),
            BuildError::Merge(e) => e.code(),
            BuildError::Dir(e) => e.code(),
        }
    }
}

/// The engine settings every engine of a config shares: names, the engine limits, the
/// guide and template limits.
fn base_options(cfg: &WorkerConfig) -> EngineOptions {
    let l = &cfg.limits;
    EngineOptions {
        base_name: cfg.base_model.name.clone(),
        image_processor: cfg.base_model.image_processor,
        guide_limits: l.guide_parser.clone(),
        template_fuel: Some(l.max_template_fuel),
        ..Default::default()
    }
    .with_limits(&l.engine)
}

/// What the process sets for its engines beside the config (`serve` flags): settings of the
/// machine, not of the pool.
#[derive(Debug, Clone, Copy)]
pub struct EngineTuning {
    /// How the tensor path computes LoRA updates (`--lora-kernel`).
    pub lora_kernel: LoraKernel,
    /// Prompt tokens a step takes across new sequences (`--prefill-chunk`).
    pub prefill_chunk: usize,
}

impl Default for EngineTuning {
    fn default() -> Self {
        Self {
            lora_kernel: LoraKernel::default(),
            prefill_chunk: mole_engine::DEFAULT_PREFILL_CHUNK,
        }
    }
}

/// Builds the engine for a config, as the parts the server holds: the ONE place where the
/// server meets the engine implementation.
pub fn build_engine(cfg: &WorkerConfig) -> Result<EngineHandles, BuildError> {
    build_engine_with(cfg, EngineTuning::default())
}

/// As [`build_engine`], with the process's `tuning` (`serve --lora-kernel`, a process
/// setting while the kernels are unproven, and `--prefill-chunk`).
pub fn build_engine_with(
    cfg: &WorkerConfig,
    tuning: EngineTuning,
) -> Result<EngineHandles, BuildError> {
    let dir = model_dir(cfg)?;
    let dtype = candle_dtype(cfg.base_model.dtype);
    // A `.gguf` base is served quantized, as is a directory `mole-worker quantize` wrote; an
    // HF directory in the configured dtype.
    let source = ModelSource::at(&dir, dtype);
    // Every file the directory names (index shards, tokenizer, templates) inside it, refused
    // by name before the engine reads any.
    if !matches!(source, ModelSource::Gguf(_)) {
        hf::check_confined(&dir)?;
    }
    let opts = EngineOptions {
        lora_kernel: tuning.lora_kernel,
        prefill_chunk: tuning.prefill_chunk,
        merged: cfg
            .merged
            .as_ref()
            .map(|m| (m.adapter.clone(), m.version.clone())),
        ..base_options(cfg)
    };
    // One engine per device the pod was given (every visible GPU; the CPU is one).
    let mut engines: Vec<Arc<Engine>> = Vec::new();
    for device in compute_devices() {
        let started = std::time::Instant::now();
        let engine = Engine::load(&source, &device, opts.clone())?;
        tracing::info!(model = %dir.display(), ?device, ?dtype, seconds = started.elapsed().as_secs_f64(), "model loaded");
        engines.push(Arc::new(engine));
    }
    // Every engine holds the same tokenizer and template: the first one's is the pod's.
    let codec: Arc<dyn PromptCodec> = engines[0].clone();
    Ok(match engines.len() {
        1 => EngineHandles::of(engines.pop().expect("one engine")),
        _ => {
            let engines = engines.into_iter().map(|e| e as Arc<dyn Backend>);
            EngineHandles::with_codec(Arc::new(Replicas::new(engines.collect())), codec)
        }
    })
}

/// Local mode: merges every adapter configured `mode: merged` without a `mergedEndpoint` into
/// `<modelRoot>/.mole-merged/<adapter>/<version>/` (once; reused while its metadata matches)
/// and starts an engine on it, so one process serves merged and dynamic adapters side by side.
/// Each merged model holds a full copy of the weights. Adapters that fail are reported and
/// stay served dynamically.
pub fn build_local_merged(cfg: &WorkerConfig) -> (HashMap<String, Arc<dyn Backend>>, Vec<String>) {
    let mut out = HashMap::new();
    let mut errors = Vec::new();
    if cfg.mode != WorkerMode::Local {
        return (out, errors);
    }
    let wanted = cfg
        .adapters
        .iter()
        .filter(|a| a.mode == ServingMode::Merged && a.merged_endpoint.is_none());
    for a in wanted {
        match merged_engine(cfg, a) {
            Ok(e) => {
                out.insert(a.name.clone(), e);
            }
            Err(e) => errors.push(format!("merge {}: {e}", a.name)),
        }
    }
    (out, errors)
}

/// An engine on adapter `a` merged into the base, merging first unless a merge of this version
/// is already on disk.
fn merged_engine(cfg: &WorkerConfig, a: &WorkerAdapter) -> Result<Arc<dyn Backend>, BuildError> {
    let root = crate::config::resolve_in_root(&cfg.model_root, ".")?;
    let base = crate::config::resolve_in_root(&cfg.model_root, &cfg.base_model.path)?;
    let adapter = crate::config::resolve_in_root(&cfg.model_root, &a.path)?;
    let dir = root.join(".mole-merged").join(&a.name).join(&a.version);
    let fresh = std::fs::read_to_string(dir.join("merge_metadata.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .is_some_and(|m| m["adapter_version"] == a.version.as_str());
    if !fresh {
        let report = mole_tools::merge::merge(&mole_tools::merge::MergeOptions {
            base,
            adapter,
            out: dir.clone(),
            safe_merge: true,
            dtype: None,
            root: Some(root),
            expect_base: Some(cfg.base_model.name.clone()),
            max_rank: cfg.limits.engine.max_lora_rank as usize,
            adapter_name: Some(a.name.clone()),
            adapter_version: Some(a.version.clone()),
        })?;
        tracing::info!(adapter = %a.name, version = %a.version, ?report, "merged in-process");
    }
    let opts = EngineOptions {
        merged: Some((a.name.clone(), a.version.clone())),
        ..base_options(cfg)
    };
    let dtype = candle_dtype(cfg.base_model.dtype);
    hf::check_confined(&dir)?;
    Ok(Arc::new(Engine::load(
        &ModelSource::hf(dir, dtype),
        &default_device(),
        opts,
    )?))
}
