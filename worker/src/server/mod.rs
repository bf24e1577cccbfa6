//! The OpenAI-compatible HTTP API (axum). Handlers parse and check requests, route them
//! ([`crate::router`]), forward merged adapters to their pods or submit to the engine, and
//! stream the answer back. Every error is OpenAI-shaped (`{error:{message,type,code}}`) with a
//! stable `code`; every answer names the adapter, mode and route (`x-mole-*` headers and a
//! `mole` field).

pub mod cli;
mod openai;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use axum::extract::DefaultBodyLimit;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Json;
use mole_api::WorkerConfig;
use serde_json::json;

use crate::config::{ApplyReport, LoadFailure, SharedConfig};
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

/// Identity of a secret file's current content (a rotated Kubernetes Secret is a symlink swap
/// to new files: inode, mtime or size moves).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileStamp {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: i64,
    mtime_nsec: i64,
}

fn stamp(path: &Path) -> Option<FileStamp> {
    use std::os::unix::fs::MetadataExt;
    // metadata() follows symlinks: the stamp is the target's, which changes on a swap.
    let m = std::fs::metadata(path).ok()?;
    Some(FileStamp {
        dev: m.dev(),
        ino: m.ino(),
        len: m.len(),
        mtime: m.mtime(),
        mtime_nsec: m.mtime_nsec(),
    })
}

/// Where the secrets come from: files named by the config's `auth` (mounted Secrets) and the
/// environment (`MOLE_API_KEYS`, comma-separated; `MOLE_API_KEYS_FILE`), captured at start.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AuthSource {
    /// `auth.apiKeysFile`: API keys, one per line, `#` comments.
    pub api_keys_file: Option<PathBuf>,
    /// `MOLE_API_KEYS_FILE`: the same format.
    pub env_keys_file: Option<PathBuf>,
    /// `MOLE_API_KEYS`: keys given inline.
    pub inline_keys: Vec<String>,
    /// Admin token file.
    pub admin_token_file: Option<PathBuf>,
    /// Operator token file.
    pub operator_token_file: Option<PathBuf>,
}

impl AuthSource {
    /// The sources of a config plus the environment (`env` looks a variable up).
    pub fn new(cfg: &WorkerConfig, env: &dyn Fn(&str) -> Option<String>) -> Self {
        let mut s = AuthSource::default();
        if let Some(a) = &cfg.auth {
            s.api_keys_file = a.api_keys_file.as_ref().map(PathBuf::from);
            s.admin_token_file = a.admin_token_file.as_ref().map(PathBuf::from);
            s.operator_token_file = a.operator_token_file.as_ref().map(PathBuf::from);
        }
        if let Some(f) = env("MOLE_API_KEYS_FILE").filter(|f| !f.trim().is_empty()) {
            s.env_keys_file = Some(PathBuf::from(f.trim()));
        }
        if let Some(k) = env("MOLE_API_KEYS") {
            s.inline_keys = k
                .split(',')
                .map(str::trim)
                .filter(|k| !k.is_empty())
                .map(String::from)
                .collect();
        }
        s
    }
    fn files(&self) -> Vec<&Path> {
        self.api_keys_file
            .iter()
            .chain(&self.env_keys_file)
            .chain(&self.admin_token_file)
            .chain(&self.operator_token_file)
            .map(PathBuf::as_path)
            .collect()
    }
}

/// Secrets (files, so a Kubernetes Secret can be mounted; re-read when a file changes).
#[derive(Debug, Clone, Default)]
pub struct Auth {
    /// Accepted API keys.
    pub api_keys: Vec<String>,
    /// Whether an API key is required: true as soon as a key source is configured, even when
    /// it holds no key (an emptied key file locks the API instead of opening it).
    pub keys_required: bool,
    /// Admin token; None disables the admin endpoints (unless an operator token is set).
    pub admin_token: Option<String>,
    /// The operator's token: accepted on `GET /v1/lora_adapters`, `POST /admin/reload` and
    /// `POST /v1/unload_lora_adapter` whatever the API keys and admin token are.
    pub operator_token: Option<String>,
    source: AuthSource,
    stamps: Vec<Option<FileStamp>>,
}

fn read_token(path: &Path) -> std::io::Result<Option<String>> {
    let t = std::fs::read_to_string(path)?.trim().to_string();
    Ok((!t.is_empty()).then_some(t))
}

impl Auth {
    /// Reads the files named by the config and `MOLE_API_KEYS` / `MOLE_API_KEYS_FILE` (paths
    /// as given, not confined: they are secrets, not models).
    pub fn from_config(cfg: &WorkerConfig) -> std::io::Result<Self> {
        Self::read(AuthSource::new(cfg, &|k| std::env::var(k).ok()))
    }

    /// Reads every source.
    pub fn read(source: AuthSource) -> std::io::Result<Self> {
        let with_path = |p: &Path, e: std::io::Error| {
            std::io::Error::new(e.kind(), format!("{}: {e}", p.display()))
        };
        // Stamp before reading: a change after the stamp is seen by the next check.
        let stamps = source.files().into_iter().map(stamp).collect();
        let mut a = Auth {
            api_keys: source.inline_keys.clone(),
            keys_required: !source.inline_keys.is_empty()
                || source.api_keys_file.is_some()
                || source.env_keys_file.is_some(),
            ..Default::default()
        };
        for f in source.api_keys_file.iter().chain(&source.env_keys_file) {
            let text = std::fs::read_to_string(f).map_err(|e| with_path(f, e))?;
            a.api_keys.extend(
                text.lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty() && !l.starts_with('#'))
                    .map(String::from),
            );
        }
        if let Some(f) = &source.admin_token_file {
            a.admin_token = read_token(f).map_err(|e| with_path(f, e))?;
        }
        if let Some(f) = &source.operator_token_file {
            a.operator_token = read_token(f).map_err(|e| with_path(f, e))?;
        }
        a.source = source;
        a.stamps = stamps;
        Ok(a)
    }

    /// Whether a secret file changed since it was read (one `stat` per file).
    fn changed(&self) -> bool {
        self.source
            .files()
            .into_iter()
            .zip(&self.stamps)
            .any(|(f, s)| stamp(f) != *s)
    }

    fn api_key_ok(&self, h: &HeaderMap) -> bool {
        !self.keys_required || bearer(h).is_some_and(|k| self.api_keys.iter().any(|x| ct_eq(x, k)))
    }
    fn token_ok(t: &Option<String>, h: &HeaderMap) -> bool {
        matches!((t, bearer(h)), (Some(t), Some(k)) if ct_eq(t, k))
    }
}

/// Compares secrets in time independent of where they differ.
fn ct_eq(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

/// What `POST /admin/reload` (and the watcher) did.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ReloadOutcome {
    /// Whether adapters, router or auth settings changed.
    pub changed: bool,
    /// `content_hash()` of the file that was applied.
    pub config_hash: String,
    /// Adapters that could not be loaded (reported, the rest applied).
    pub errors: Vec<String>,
    /// Settings that changed in the file but need a restart; kept at their old values.
    pub restart_required: Vec<&'static str>,
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
    /// Secrets, re-read when their files change.
    auth: RwLock<Arc<Auth>>,
    /// The configured adapters have been tried (loaded or refused) since start.
    started: AtomicBool,
    /// Shutting down: not ready, new requests refused.
    draining: AtomicBool,
    /// Adapter versions being loaded by a reload (`/readyz` is 503 meanwhile).
    pending: Mutex<Vec<(String, String)>>,
    /// Configured versions refused before the engine saw them (path no longer in the root);
    /// listed by `/v1/lora_adapters` beside the engine's own refusals.
    refused: RwLock<HashMap<String, LoadFailure>>,
    /// Settings changed in the file that need a restart.
    restart_required: RwLock<Vec<&'static str>>,
    /// One reload at a time (watcher, `/admin/reload`, start).
    reload_lock: Mutex<()>,
    /// Client for merged pods.
    pub http: reqwest::Client,
    /// Local mode: merged models this process holds, by adapter name.
    pub local_merged: RwLock<HashMap<String, Arc<dyn InferenceEngine>>>,
    /// Sentence-embedding model of the embedding router (set once at start when configured).
    pub embedder: std::sync::OnceLock<Arc<crate::router::embed::SentenceEmbedder>>,
    next_lora_id: AtomicU32,
}

/// Connect timeout to merged pods: a Service without endpoints or a dead pod must fall back
/// fast.
pub const PROXY_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

fn api_err(status: StatusCode, code: &'static str, msg: impl Into<String>) -> ApiError {
    ApiError::new(status, code, msg)
}

impl AppState {
    /// Builds the state. Not ready until the configured adapters were tried
    /// ([`AppState::load_configured`], done by `serve_with`).
    pub fn new(
        cfg: WorkerConfig,
        engine: Arc<dyn InferenceEngine>,
        config_path: Option<PathBuf>,
        auth: Auth,
    ) -> Arc<Self> {
        let timeout = Duration::from_secs(cfg.limits.request_timeout_seconds.max(1));
        // A merged pod that accepts and never answers is caught by the read timeout (no byte
        // for a whole request timeout: it would have answered 504 itself) and the overall
        // timeout; then the request falls back to this worker.
        let http = reqwest::Client::builder()
            .connect_timeout(PROXY_CONNECT_TIMEOUT)
            .read_timeout(timeout + Duration::from_secs(1))
            .timeout(timeout + Duration::from_secs(2))
            .build()
            .unwrap_or_default();
        Arc::new(Self {
            engine,
            config: Arc::new(RwLock::new(Arc::new(cfg))),
            config_path,
            metrics: Metrics::new(),
            auth: RwLock::new(Arc::new(auth)),
            started: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            pending: Mutex::new(Vec::new()),
            refused: RwLock::new(HashMap::new()),
            restart_required: RwLock::new(Vec::new()),
            reload_lock: Mutex::new(()),
            http,
            embedder: std::sync::OnceLock::new(),
            local_merged: Default::default(),
            // Ids for adapters loaded through the API, far from the operator's ids.
            next_lora_id: AtomicU32::new(1 << 30),
        })
    }
    /// Marks the server as shutting down: `/readyz` answers 503 and new requests are refused
    /// while in-flight ones finish.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }
    /// Whether requests are served (started and not draining).
    pub fn accepting(&self) -> bool {
        self.started.load(Ordering::SeqCst) && !self.draining.load(Ordering::SeqCst)
    }
    /// Readiness: the base model is loaded (the engine exists), every adapter configured at
    /// start was tried (loaded, or refused for a reason reported by `/v1/lora_adapters`) and
    /// the server is not shutting down. Err says why not.
    ///
    /// Adapters added later by a reload do not make a serving pod unready: every pod of a pool
    /// reloads at about the same moment, and flipping readiness would empty the Service while
    /// the base model and the other adapters can serve. Per-adapter readiness is what
    /// `/v1/lora_adapters` reports (the operator reads it), and requests for an adapter still
    /// loading wait for it or get its own error.
    pub fn readiness(&self) -> Result<(), String> {
        if self.draining.load(Ordering::SeqCst) {
            return Err("shutting down".into());
        }
        if !self.started.load(Ordering::SeqCst) {
            let p = self.pending.lock().expect("pending lock");
            if p.is_empty() {
                return Err("loading the configured adapters".into());
            }
            let l: Vec<String> = p.iter().map(|(n, v)| format!("{n} {v}")).collect();
            return Err(format!("loading adapters: {}", l.join(", ")));
        }
        Ok(())
    }
    /// The current config.
    pub fn cfg(&self) -> Arc<WorkerConfig> {
        self.config.read().expect("config lock").clone()
    }
    /// Settings the config file changed that need a restart (empty when none).
    pub fn restart_required(&self) -> Vec<&'static str> {
        self.restart_required.read().expect("lock").clone()
    }
    /// The secrets, re-read first when one of their files changed (a rotated Secret). A file
    /// that cannot be read keeps the previous secrets.
    pub fn auth(&self) -> Arc<Auth> {
        let cur = self.auth.read().expect("auth lock").clone();
        if !cur.changed() {
            return cur;
        }
        match Auth::read(cur.source.clone()) {
            Ok(a) => {
                tracing::info!("credentials changed on disk: re-read");
                let a = Arc::new(a);
                *self.auth.write().expect("auth lock") = a.clone();
                a
            }
            Err(e) => {
                tracing::warn!("credentials changed but cannot be read, keeping the old ones: {e}");
                cur
            }
        }
    }
    fn check_api_key(&self, h: &HeaderMap) -> Result<(), ApiError> {
        if self.auth().api_key_ok(h) {
            return Ok(());
        }
        Err(api_err(
            StatusCode::UNAUTHORIZED,
            "invalid_api_key",
            "missing or invalid API key (Authorization: Bearer <key>)",
        ))
    }
    /// Admin endpoints (`/v1/load_lora_adapter`): the admin token only.
    fn check_admin(&self, h: &HeaderMap) -> Result<(), ApiError> {
        self.check_admin_or(h, false)
    }
    /// Endpoints the operator calls (reload, unload): the admin or the operator token.
    fn check_operator(&self, h: &HeaderMap) -> Result<(), ApiError> {
        self.check_admin_or(h, true)
    }
    fn check_admin_or(&self, h: &HeaderMap, operator: bool) -> Result<(), ApiError> {
        let a = self.auth();
        let op = if operator { &a.operator_token } else { &None };
        if a.admin_token.is_none() && op.is_none() {
            return Err(api_err(
                StatusCode::FORBIDDEN,
                "admin_disabled",
                "admin endpoints are disabled: no admin token configured",
            ));
        }
        if Auth::token_ok(&a.admin_token, h) || Auth::token_ok(op, h) {
            return Ok(());
        }
        Err(api_err(
            StatusCode::UNAUTHORIZED,
            "invalid_admin_token",
            "missing or invalid admin token (Authorization: Bearer <token>)",
        ))
    }
    /// `GET /v1/lora_adapters`: an API key, or the operator or admin token.
    fn check_listing(&self, h: &HeaderMap) -> Result<(), ApiError> {
        let a = self.auth();
        if Auth::token_ok(&a.operator_token, h) || Auth::token_ok(&a.admin_token, h) {
            return Ok(());
        }
        self.check_api_key(h)
    }

    fn record_apply(&self, cfg: &WorkerConfig, report: &ApplyReport) {
        let m = &self.metrics.adapter_load_duration;
        for (_, secs) in &report.loaded {
            m.with_label_values(&["ok"]).observe(*secs);
        }
        let mut refused = self.refused.write().expect("lock");
        for (n, _) in &report.loaded {
            refused.remove(n);
        }
        for f in &report.failed {
            m.with_label_values(&["failed"]).observe(0.0);
            tracing::warn!(adapter = %f.name, version = %f.version, "adapter not loaded: {}", f.reason);
            refused.insert(f.name.clone(), f.clone());
        }
        refused.retain(|n, f| {
            cfg.adapters
                .iter()
                .any(|a| &a.name == n && a.version == f.version && a.load)
        });
    }

    /// Loads the configured adapters (and, in local mode, merges the merged ones), then
    /// marks the worker started. Blocking: run it off the async runtime.
    pub fn load_configured(&self) {
        let _g = self.reload_lock.lock().expect("reload lock");
        let cfg = self.cfg();
        let diff = crate::config::diff_adapters(&[], &cfg.adapters);
        let report = crate::config::apply_diff(self.engine.as_ref(), &cfg, &diff);
        self.record_apply(&cfg, &report);
        let (merged, errors) = build_local_merged(&cfg);
        for err in &errors {
            tracing::warn!("served dynamically instead: {err}");
        }
        *self.local_merged.write().expect("lock") = merged;
        self.started.store(true, Ordering::SeqCst);
        tracing::info!(
            loaded = report.loaded.len(),
            refused = report.failed.len(),
            "configured adapters tried; ready"
        );
    }

    /// Answers 409 `config_stale` when the config file's [`WorkerConfig::content_hash`] is not
    /// `want`, without taking the reload lock. Blocking (reads the file).
    pub fn check_config_hash(&self, want: &str) -> Result<(), ApiError> {
        let Some(path) = &self.config_path else {
            return Ok(());
        };
        let file = crate::config::read(path)
            .map_err(|e| api_err(StatusCode::UNPROCESSABLE_ENTITY, e.code(), e.to_string()))?;
        let hash = file.content_hash();
        if hash == want {
            Ok(())
        } else {
            self.metrics
                .config_reloads
                .with_label_values(&["stale"])
                .inc();
            Err(stale(path, &hash, want))
        }
    }

    /// Re-reads the config file and applies it: adapters loaded before removed ones are
    /// unloaded, router and auth settings swapped; settings that need a restart are kept and
    /// reported. With `expect_hash`, a file whose parsed config has another
    /// [`WorkerConfig::content_hash`] is refused with 409 `config_stale` and nothing changes.
    /// Blocking: run it off the async runtime.
    pub fn reload(&self, expect_hash: Option<&str>) -> Result<ReloadOutcome, ApiError> {
        let _g = self.reload_lock.lock().expect("reload lock");
        let count = |r: &str| self.metrics.config_reloads.with_label_values(&[r]).inc();
        let Some(path) = &self.config_path else {
            return Err(api_err(
                StatusCode::BAD_REQUEST,
                "no_config_file",
                "this worker was not started from a config file",
            ));
        };
        let invalid = |e: crate::config::ConfigError| {
            count("invalid");
            api_err(StatusCode::UNPROCESSABLE_ENTITY, e.code(), e.to_string())
        };
        let file = crate::config::read(path).map_err(invalid)?;
        let hash = file.content_hash();
        if let Some(want) = expect_hash.filter(|h| *h != hash) {
            count("stale");
            return Err(stale(path, &hash, want));
        }
        let old = self.cfg();
        let restart = crate::config::restart_required(&old, &file);
        let new = crate::config::hot_applicable(&old, &file);
        crate::config::validate(&new).map_err(invalid)?;
        self.metrics
            .restart_required
            .set(i64::from(!restart.is_empty()));
        if !restart.is_empty() {
            tracing::warn!(
                settings = ?restart,
                "config changed settings that need a restart; serving with the old ones until then"
            );
        }
        *self.restart_required.write().expect("lock") = restart.clone();
        if *old == new {
            count("unchanged");
            return Ok(ReloadOutcome {
                changed: false,
                config_hash: hash,
                errors: vec![],
                restart_required: restart,
            });
        }
        let diff = crate::config::diff_adapters(&old.adapters, &new.adapters);
        *self.pending.lock().expect("pending lock") = diff
            .load
            .iter()
            .map(|a| (a.name.clone(), a.version.clone()))
            .collect();
        // Cleared whatever happens below (a panicking load must not leave the pod unready).
        struct Clear<'a>(&'a Mutex<Vec<(String, String)>>);
        impl Drop for Clear<'_> {
            fn drop(&mut self) {
                if let Ok(mut p) = self.0.lock() {
                    p.clear();
                }
            }
        }
        let _clear = Clear(&self.pending);
        let report = crate::config::apply_diff(self.engine.as_ref(), &new, &diff);
        self.record_apply(&new, &report);
        if new.auth != old.auth {
            let old_src = self.auth.read().expect("auth lock").source.clone();
            let mut src = AuthSource::new(&new, &|_| None);
            // The environment's keys were captured at start; they stay.
            src.inline_keys = old_src.inline_keys;
            src.env_keys_file = old_src.env_keys_file;
            match Auth::read(src) {
                Ok(a) => *self.auth.write().expect("auth lock") = Arc::new(a),
                Err(e) => tracing::warn!("new auth settings cannot be read, keeping the old: {e}"),
            }
        }
        *self.config.write().expect("config lock") = Arc::new(new);
        count("changed");
        let errors = report.errors();
        tracing::info!(hash = %hash, ?errors, "config reloaded");
        Ok(ReloadOutcome {
            changed: true,
            config_hash: hash,
            errors,
            restart_required: restart,
        })
    }

    /// The engine's adapter listing plus configured versions refused before the engine saw
    /// them.
    pub fn adapter_listing(&self) -> Vec<mole_api::LoraAdapterInfo> {
        let mut out = self.engine.adapters();
        for f in self.refused.read().expect("lock").values() {
            if !out
                .iter()
                .any(|a| a.name == f.name && a.version == f.version)
            {
                out.push(mole_api::LoraAdapterInfo {
                    name: f.name.clone(),
                    version: f.version.clone(),
                    lora_id: f.lora_id,
                    residency: mole_api::Residency::Disk,
                    loaded: false,
                    rank: 0,
                    bytes: 0,
                    requests: 0,
                    running: 0,
                    error: Some(f.reason.clone()),
                });
            }
        }
        out.sort_by(|a, b| (&a.name, &a.version).cmp(&(&b.name, &b.version)));
        out
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
    use crate::config::model_dir;
    use crate::engine::{candle_dtype, default_device, Engine, EngineOptions};
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
    if cfg.mode != mole_api::WorkerMode::Local {
        return (out, errors);
    }
    let wanted = cfg
        .adapters
        .iter()
        .filter(|a| a.mode == mole_api::ServingMode::Merged && a.merged_endpoint.is_none());
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

fn stale(path: &std::path::Path, hash: &str, want: &str) -> ApiError {
    api_err(
        StatusCode::CONFLICT,
        "config_stale",
        format!(
            "config file {} has hash {hash}, expected {want}: the kubelet has not refreshed the mounted ConfigMap yet (it can take a minute); retry later",
            path.display()
        ),
    )
}

async fn readyz(axum::extract::State(s): axum::extract::State<Arc<AppState>>) -> Response {
    match s.readiness() {
        Ok(()) => "ready".into_response(),
        Err(why) => {
            let mut e = ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "not_ready",
                format!("not ready: {why}"),
            );
            e.retry_after = Some(1);
            e.into_response()
        }
    }
}

async fn metrics(axum::extract::State(s): axum::extract::State<Arc<AppState>>) -> Response {
    s.metrics.ready.set(i64::from(s.readiness().is_ok()));
    let body = s.metrics.render(&s.engine.stats(), &s.adapter_listing());
    (
        [("content-type", "text/plain; version=0.0.4; charset=utf-8")],
        body,
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(auth: &str) -> WorkerConfig {
        crate::config::parse(
            &format!("pool: p\nbaseModel: {{name: b, path: b}}\n{auth}"),
            "t",
        )
        .unwrap()
    }
    fn hdr(token: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            "authorization",
            HeaderValue::from_str(&format!("Bearer {token}")).unwrap(),
        );
        h
    }

    #[test]
    fn api_keys_from_env_and_files_and_rotation() {
        let d = tempfile::tempdir().unwrap();
        let kf = d.path().join("keys");
        std::fs::write(&kf, "# comment\nfile-key\n").unwrap();
        let env_file = d.path().join("env-keys");
        std::fs::write(&env_file, "env-file-key\n").unwrap();
        let c = cfg(&format!("auth: {{apiKeysFile: {}}}", kf.display()));
        let env = |k: &str| match k {
            "MOLE_API_KEYS" => Some(" a , b,,".to_string()),
            "MOLE_API_KEYS_FILE" => Some(env_file.display().to_string()),
            _ => None,
        };
        let a = Auth::read(AuthSource::new(&c, &env)).unwrap();
        assert!(a.keys_required);
        for k in ["a", "b", "file-key", "env-file-key"] {
            assert!(a.api_key_ok(&hdr(k)), "{k}");
        }
        assert!(!a.api_key_ok(&hdr("c")));
        assert!(!a.api_key_ok(&HeaderMap::new()));
        assert!(!a.changed());
        // A rotated Secret: new content (and inode) is seen; an emptied file locks the API.
        std::fs::write(d.path().join("new"), "").unwrap();
        std::fs::rename(d.path().join("new"), &kf).unwrap();
        assert!(a.changed());
        let a = Auth::read(a.source.clone()).unwrap();
        assert!(!a.api_key_ok(&hdr("file-key")));
        assert!(a.api_key_ok(&hdr("a")));
        // Nothing configured: no key needed.
        let none = Auth::read(AuthSource::new(&cfg(""), &|_| None)).unwrap();
        assert!(none.api_key_ok(&HeaderMap::new()));
        assert!(ct_eq("abc", "abc") && !ct_eq("abc", "abd") && !ct_eq("abc", "ab"));
    }
}
