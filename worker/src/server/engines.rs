//! Building the engines the server serves from: the base model's, and in local mode one per
//! adapter configured `mode: merged`, merged in-process.

use std::sync::Arc;

use mole_crds::WorkerConfig;

use crate::engine::api::InferenceEngine;

/// Builds the engine for a config: the ONE place where the server meets the engine
/// implementation.
pub fn build_engine(cfg: &WorkerConfig) -> anyhow::Result<Arc<dyn InferenceEngine>> {
    use crate::engine::{candle_dtype, default_device, model_dir, Engine, EngineOptions};
    let dir = model_dir(cfg)?;
    let device = default_device();
    let dtype = candle_dtype(cfg.base_model.dtype);
    let l = &cfg.limits;
    let opts = EngineOptions {
        base_name: cfg.base_model.name.clone(),
        max_batch_size: l.max_batch_size as usize,
        max_seq_len: l.max_seq_len as usize,
        max_queue: l.max_queue as usize,
        max_loras: l.max_loras as usize,
        max_cpu_loras: l.max_cpu_loras as usize,
        max_lora_rank: l.max_lora_rank as usize,
        lora_dtype: l.lora_dtype.map(crate::engine::candle_dtype),
        prefill_chunk: std::env::var("MOLE_PREFILL_CHUNK")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(512),
        merged: cfg
            .merged
            .as_ref()
            .map(|m| (m.adapter.clone(), m.version.clone())),
    };
    let started = std::time::Instant::now();
    // A `.gguf` base is served quantized; an HF directory in the configured dtype.
    let engine = if dir.extension().is_some_and(|e| e == "gguf") {
        Engine::load_gguf(&dir, &device, opts)?
    } else {
        Engine::load(&dir, dtype, &device, opts)?
    };
    tracing::info!(model = %dir.display(), ?device, ?dtype, seconds = started.elapsed().as_secs_f64(), "model loaded");
    Ok(Arc::new(engine))
}

/// Local mode: merges every adapter configured `mode: merged` without a `mergedEndpoint` into
/// `<modelRoot>/.mole-merged/<adapter>/<version>/` (once; reused while its metadata matches)
/// and starts an engine on it, so one process serves merged and dynamic adapters side by side.
/// Each merged model holds a full copy of the weights. Adapters that fail are reported and
/// stay served dynamically.
pub fn build_local_merged(
    cfg: &WorkerConfig,
) -> (
    std::collections::HashMap<String, Arc<dyn InferenceEngine>>,
    Vec<String>,
) {
    use crate::engine::{candle_dtype, default_device, Engine, EngineOptions};
    let mut out = std::collections::HashMap::new();
    let mut errors = Vec::new();
    if cfg.mode != mole_crds::WorkerMode::Local {
        return (out, errors);
    }
    let wanted = cfg
        .adapters
        .iter()
        .filter(|a| a.mode == mole_crds::ServingMode::Merged && a.merged_endpoint.is_none());
    for a in wanted {
        let r = (|| -> anyhow::Result<Arc<dyn InferenceEngine>> {
            let root = crate::config::resolve_in_root(&cfg.model_root, ".")?;
            let base = crate::config::resolve_in_root(&cfg.model_root, &cfg.base_model.path)?;
            let adapter = crate::config::resolve_in_root(&cfg.model_root, &a.path)?;
            let dir = root.join(".mole-merged").join(&a.name).join(&a.version);
            let fresh = std::fs::read_to_string(dir.join("merge_metadata.json"))
                .ok()
                .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
                .is_some_and(|m| m["adapter_version"] == a.version.as_str());
            if !fresh {
                let report = crate::merge::merge(&crate::merge::MergeOptions {
                    base,
                    adapter,
                    out: dir.clone(),
                    safe_merge: true,
                    dtype: None,
                    root: Some(root),
                    expect_base: Some(cfg.base_model.name.clone()),
                    max_rank: cfg.limits.max_lora_rank as usize,
                    adapter_name: Some(a.name.clone()),
                    adapter_version: Some(a.version.clone()),
                })?;
                tracing::info!(adapter = %a.name, version = %a.version, ?report, "merged in-process");
            }
            let device = default_device();
            let l = &cfg.limits;
            let opts = EngineOptions {
                base_name: cfg.base_model.name.clone(),
                max_batch_size: l.max_batch_size as usize,
                max_seq_len: l.max_seq_len as usize,
                max_queue: l.max_queue as usize,
                merged: Some((a.name.clone(), a.version.clone())),
                ..Default::default()
            };
            let dtype = candle_dtype(cfg.base_model.dtype);
            Ok(Arc::new(Engine::load(&dir, dtype, &device, opts)?))
        })();
        match r {
            Ok(e) => {
                out.insert(a.name.clone(), e);
            }
            Err(e) => errors.push(format!("merge {}: {e:#}", a.name)),
        }
    }
    (out, errors)
}
