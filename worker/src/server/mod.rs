//! The OpenAI-compatible HTTP API (axum). Handlers parse and check requests, route them
//! ([`crate::router`]), forward merged adapters to their pods or submit to the engine, and
//! stream the answer back. Every error is OpenAI-shaped (`{error:{message,type,code}}`) with a
//! stable `code`; every answer names the adapter, mode and route (`x-mole-*` headers and a
//! `mole` field).

pub mod cli;
mod openai;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

use axum::extract::DefaultBodyLimit;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Json;
use mole_crds::WorkerConfig;
use serde_json::json;

use crate::config::SharedConfig;
use crate::engine::api::{EngineError, InferenceEngine};
use crate::metrics::Metrics;

/// Why the server refused a request. Stable names via [`ApiError::code`].
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Stable code.
    pub code: &'static str,
    /// Human message.
    pub message: String,
    /// Seconds for Retry-After (429/503).
    pub retry_after: Option<u64>,
}

impl ApiError {
    /// A new error.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            retry_after: None,
        }
    }
    /// Stable name (metric label, JSON `code`).
    pub fn code(&self) -> &'static str {
        self.code
    }
    fn kind(&self) -> &'static str {
        match self.status.as_u16() {
            401 | 403 => "authentication_error",
            404 => "not_found_error",
            429 => "rate_limit_error",
            400..=499 => "invalid_request_error",
            _ => "server_error",
        }
    }
    /// The OpenAI error body.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.kind(), "code": self.code}})
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        let status = match &e {
            EngineError::Overloaded(_) => StatusCode::TOO_MANY_REQUESTS,
            EngineError::NotReady(_) => StatusCode::SERVICE_UNAVAILABLE,
            EngineError::AdapterNotFound(_) => StatusCode::NOT_FOUND,
            EngineError::InvalidAdapter { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            EngineError::InvalidRequest(_) => StatusCode::BAD_REQUEST,
            EngineError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        let mut a = ApiError::new(status, e.code(), e.to_string());
        if matches!(status.as_u16(), 429 | 503) {
            a.retry_after = Some(1);
        }
        a
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut().insert("retry-after", HeaderValue::from(s));
        }
        r
    }
}

/// Secrets read at start (files, so a Kubernetes Secret can be mounted).
#[derive(Debug, Clone, Default)]
pub struct Auth {
    /// Accepted API keys; empty means no key needed.
    pub api_keys: Vec<String>,
    /// Admin token; None disables the admin endpoints.
    pub admin_token: Option<String>,
}

impl Auth {
    /// Reads the files named by the config (paths as given, not confined: they are secrets,
    /// not models).
    pub fn from_config(cfg: &WorkerConfig) -> std::io::Result<Self> {
        let mut a = Auth::default();
        if let Some(auth) = &cfg.auth {
            if let Some(f) = &auth.api_keys_file {
                a.api_keys = std::fs::read_to_string(f)?
                    .lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty() && !l.starts_with('#'))
                    .map(String::from)
                    .collect();
            }
            if let Some(f) = &auth.admin_token_file {
                let t = std::fs::read_to_string(f)?.trim().to_string();
                if !t.is_empty() {
                    a.admin_token = Some(t);
                }
            }
        }
        Ok(a)
    }
}

/// Everything the handlers share.
pub struct AppState {
    /// The engine.
    pub engine: Arc<dyn InferenceEngine>,
    /// The current config (swapped by the watcher and `/admin/reload`).
    pub config: SharedConfig,
    /// File the config came from (for `/admin/reload`).
    pub config_path: Option<PathBuf>,
    /// Metrics.
    pub metrics: Metrics,
    /// Secrets.
    pub auth: Auth,
    /// False until adapters are loaded, and again while draining.
    pub ready: AtomicBool,
    /// Client for merged pods.
    pub http: reqwest::Client,
    /// Local mode: merged models this process holds, by adapter name.
    pub local_merged:
        std::sync::RwLock<std::collections::HashMap<String, Arc<dyn InferenceEngine>>>,
    /// Sentence-embedding model of the embedding router (set once at start when configured).
    pub embedder: std::sync::OnceLock<Arc<crate::router::embed::SentenceEmbedder>>,
    next_lora_id: AtomicU32,
}

impl AppState {
    /// Builds the state. Not ready until [`AppState::set_ready`].
    pub fn new(
        cfg: WorkerConfig,
        engine: Arc<dyn InferenceEngine>,
        config_path: Option<PathBuf>,
        auth: Auth,
    ) -> Arc<Self> {
        Arc::new(Self {
            engine,
            config: Arc::new(std::sync::RwLock::new(Arc::new(cfg))),
            config_path,
            metrics: Metrics::new(),
            auth,
            ready: AtomicBool::new(false),
            http: reqwest::Client::new(),
            embedder: std::sync::OnceLock::new(),
            local_merged: Default::default(),
            // Ids for adapters loaded through the API, far from the operator's ids.
            next_lora_id: AtomicU32::new(1 << 30),
        })
    }
    /// Marks the server ready (or not).
    pub fn set_ready(&self, r: bool) {
        self.ready.store(r, Ordering::SeqCst);
    }
    /// The current config.
    pub fn cfg(&self) -> Arc<WorkerConfig> {
        self.config.read().expect("config lock").clone()
    }
    fn check_api_key(&self, h: &HeaderMap) -> Result<(), ApiError> {
        if self.auth.api_keys.is_empty() {
            return Ok(());
        }
        match bearer(h) {
            Some(k) if self.auth.api_keys.iter().any(|x| x == k) => Ok(()),
            _ => Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "invalid_api_key",
                "missing or invalid API key (Authorization: Bearer <key>)",
            )),
        }
    }
    fn check_admin(&self, h: &HeaderMap) -> Result<(), ApiError> {
        let Some(t) = &self.auth.admin_token else {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "admin_disabled",
                "admin endpoints are disabled: no admin token configured",
            ));
        };
        match bearer(h) {
            Some(k) if k == t => Ok(()),
            _ => Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "invalid_admin_token",
                "missing or invalid admin token (Authorization: Bearer <token>)",
            )),
        }
    }
}

fn bearer(h: &HeaderMap) -> Option<&str> {
    h.get("authorization")?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
        .map(str::trim)
}

/// Builds the engine for a config: the ONE place where the server meets the engine
/// implementation.
pub fn build_engine(cfg: &WorkerConfig) -> anyhow::Result<Arc<dyn InferenceEngine>> {
    use crate::engine::{default_device, model_dir, serving_dtype, Engine, EngineOptions};
    let dir = model_dir(cfg)?;
    let device = default_device();
    let dtype = serving_dtype(cfg.base_model.dtype, &device);
    let l = &cfg.limits;
    let opts = EngineOptions {
        base_name: cfg.base_model.name.clone(),
        max_batch_size: l.max_batch_size as usize,
        max_seq_len: l.max_seq_len as usize,
        max_queue: l.max_queue as usize,
        max_loras: l.max_loras as usize,
        max_cpu_loras: l.max_cpu_loras as usize,
        max_lora_rank: l.max_lora_rank as usize,
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
    use crate::engine::{default_device, serving_dtype, Engine, EngineOptions};
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
            let dtype = serving_dtype(cfg.base_model.dtype, &device);
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

/// The HTTP routes.
pub fn app(state: Arc<AppState>) -> axum::Router {
    let limit = usize::try_from(state.cfg().limits.max_body_bytes).unwrap_or(usize::MAX);
    axum::Router::new()
        .route("/v1/chat/completions", post(openai::chat))
        .route("/v1/completions", post(openai::completions))
        .route("/infer", post(openai::infer))
        .route("/v1/route", post(openai::route))
        .route("/v1/models", get(openai::models))
        .route("/v1/lora_adapters", get(openai::lora_adapters))
        .route("/v1/load_lora_adapter", post(openai::load_lora))
        .route("/v1/unload_lora_adapter", post(openai::unload_lora))
        .route("/admin/reload", post(openai::admin_reload))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .fallback(|| async {
            ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such endpoint")
        })
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

async fn readyz(axum::extract::State(s): axum::extract::State<Arc<AppState>>) -> Response {
    if s.ready.load(Ordering::SeqCst) {
        "ready".into_response()
    } else {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "not_ready", "not ready").into_response()
    }
}

async fn metrics(axum::extract::State(s): axum::extract::State<Arc<AppState>>) -> Response {
    let body = s.metrics.render(&s.engine.stats(), &s.engine.adapters());
    (
        [("content-type", "text/plain; version=0.0.4; charset=utf-8")],
        body,
    )
        .into_response()
}
