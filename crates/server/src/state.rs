//! What the handlers share: the engine's parts, the config, metrics, secrets and the readiness
//! flags.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use mole_api::WorkerConfig;

use super::auth::{Auth, Secrets};
use crate::config::{LoadFailure, SharedConfig};
use crate::metrics::Metrics;
use mole_engine::api::{AdapterAdmin, Backend, EngineHandles, EngineInfo, PromptCodec, Serving};

/// Connect timeout to merged pods: a Service without endpoints or a dead pod must fall back
/// fast.
pub const PROXY_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Pixels per permit of the in-flight image budget (a semaphore counts in `u32`).
pub(crate) const PIXEL_UNIT: u64 = 1024;

/// Everything the handlers share.
pub struct AppState {
    /// The engine as request handlers call it (generation, the classifier's scoring).
    pub serving: Arc<dyn Serving>,
    /// The engine's adapters as the admin endpoints, the reload and routing's checks see them.
    pub admin: Arc<dyn AdapterAdmin>,
    /// The engine's load and model facts (metrics, validation's limits).
    pub info: Arc<dyn EngineInfo>,
    /// The tokenizer and chat template, taken once at startup: validation tokenizes with it.
    pub codec: Arc<dyn PromptCodec>,
    /// The current config (swapped by the watcher and `/admin/reload`).
    pub config: SharedConfig,
    /// File the config came from (for `/admin/reload`).
    pub config_path: Option<PathBuf>,
    /// Metrics.
    pub metrics: Metrics,
    /// Secrets, re-read when their files change.
    pub(super) auth: Secrets,
    /// The configured adapters have been tried (loaded or refused) since start.
    pub(super) started: AtomicBool,
    /// Shutting down: not ready, new requests refused.
    pub(super) draining: AtomicBool,
    /// Adapter versions being loaded by a reload (`/readyz` is 503 meanwhile).
    pub(super) pending: Mutex<Vec<(String, String)>>,
    /// Configured versions refused before the engine saw them (path no longer in the root);
    /// listed by `/v1/lora_adapters` beside the engine's own refusals.
    pub(super) refused: RwLock<HashMap<String, LoadFailure>>,
    /// Settings changed in the file that need a restart.
    pub(super) restart_required: RwLock<Vec<&'static str>>,
    /// One reload at a time (watcher, `/admin/reload`, start).
    pub(super) reload_lock: Mutex<()>,
    /// Client for merged pods.
    pub http: reqwest::Client,
    /// Local mode: merged models this process holds, by adapter name.
    pub local_merged: RwLock<HashMap<String, Arc<dyn Backend>>>,
    /// Sentence-embedding model of the embedding router (set once at start when configured).
    pub embedder: std::sync::OnceLock<Arc<crate::router::embed::SentenceEmbedder>>,
    /// The id of the next adapter loaded through `/v1/load_lora_adapter`.
    pub(super) next_lora_id: AtomicU32,
    /// Pixels the images of requests in flight may hold together
    /// (`limits.maxInflightImagePixels` at start, in permits of
    /// [`PIXEL_UNIT`] pixels).
    pub(super) image_budget: Arc<tokio::sync::Semaphore>,
    /// The preparation stage: the threads and bounded queue that do requests' CPU work
    /// (parsing, templates, tokens, images, grammars) off the async runtime.
    pub(super) prepare: super::prepare::Prepare,
    /// Requests without a session so far, per adapter with a canary: the count that splits
    /// them exactly by the canary's weight ([`mole_api::canary_pick`]).
    pub(super) canary_counts: Mutex<HashMap<String, u64>>,
    /// The peers' live state (residency and queue), polled in the background: where a request
    /// for an adapter this pod does not hold is forwarded.
    pub peers: super::peers::Peers,
    /// The request schemas of the OpenAPI document for the limits they were written for:
    /// bodies are held to them ([`super::doc_check`]); rewritten when the limits change.
    pub(super) doc: Mutex<
        Option<(
            super::openapi_requests::RequestLimits,
            Arc<serde_json::Value>,
        )>,
    >,
}

impl AppState {
    /// Builds the state. Not ready until the configured adapters were tried
    /// ([`AppState::load_configured`], done by `serve_with`).
    pub fn new(
        cfg: WorkerConfig,
        engine: EngineHandles,
        config_path: Option<PathBuf>,
        auth: Auth,
    ) -> Arc<Self> {
        let timeout = Duration::from_secs(cfg.limits.request_timeout_seconds.max(1));
        let pixel_units = cfg
            .limits
            .max_inflight_image_pixels
            .div_ceil(PIXEL_UNIT)
            .min(tokio::sync::Semaphore::MAX_PERMITS as u64) as usize;
        // A merged pod that accepts and never answers is caught by the read timeout (no byte
        // for a whole request timeout: it would have answered 504 itself) and the overall
        // timeout; then the request falls back to this worker.
        let http = reqwest::Client::builder()
            .connect_timeout(PROXY_CONNECT_TIMEOUT)
            .read_timeout(timeout + Duration::from_secs(1))
            .timeout(timeout + Duration::from_secs(2))
            .build()
            .unwrap_or_default();
        let prepare = super::prepare::Prepare::new(
            cfg.limits.prepare_threads as usize,
            cfg.limits.max_prepare_queue as usize,
        );
        tracing::info!(
            threads = prepare.threads(),
            queue = cfg.limits.max_prepare_queue,
            "preparation stage"
        );
        let EngineHandles {
            serving,
            admin,
            info,
            codec,
        } = engine;
        Arc::new(Self {
            serving,
            admin,
            info,
            codec,
            config: Arc::new(RwLock::new(Arc::new(cfg))),
            config_path,
            metrics: Metrics::new(),
            auth: Secrets::new(auth),
            started: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            pending: Mutex::new(Vec::new()),
            refused: RwLock::new(HashMap::new()),
            restart_required: RwLock::new(Vec::new()),
            doc: Mutex::new(None),
            reload_lock: Mutex::new(()),
            http,
            peers: Default::default(),
            embedder: std::sync::OnceLock::new(),
            local_merged: Default::default(),
            // Ids for adapters loaded through the API, far from the operator's ids.
            next_lora_id: AtomicU32::new(1 << 30),
            image_budget: Arc::new(tokio::sync::Semaphore::new(pixel_units)),
            prepare,
            canary_counts: Mutex::default(),
        })
    }
    /// When a request's preparation must have started by, for a request that arrives now:
    /// `limits.requestTimeoutSeconds` from now (see [`super::prepare::Prepare::run`]).
    pub(super) fn deadline(&self) -> std::time::Instant {
        std::time::Instant::now() + Duration::from_secs(self.cfg().limits.request_timeout_seconds)
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
            let p = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
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
        self.config
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
    /// Settings the config file changed that need a restart (empty when none).
    pub fn restart_required(&self) -> Vec<&'static str> {
        self.restart_required
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The engine's adapter listing plus configured versions refused before the engine saw
    /// them.
    pub fn adapter_listing(&self) -> Vec<mole_api::LoraAdapterInfo> {
        let mut out = self.admin.adapters();
        for f in self
            .refused
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
        {
            if !out.iter().any(|a| {
                a.name == mole_engine::lora::registry::public_name(&f.name)
                    && a.version == f.version
            }) {
                out.push(mole_api::LoraAdapterInfo {
                    name: mole_engine::lora::registry::public_name(&f.name).to_string(),
                    version: f.version.clone(),
                    lora_id: f.lora_id,
                    path: None,
                    residency: mole_api::Residency::Disk,
                    loaded: false,
                    rank: 0,
                    bytes: 0,
                    requests: 0,
                    running: 0,
                    error: Some(f.reason.clone()),
                    warning: None,
                });
            }
        }
        out.sort_by(|a, b| (&a.name, &a.version).cmp(&(&b.name, &b.version)));
        out
    }
}

impl AppState {
    /// The secrets, re-read first when one of their files changed (a rotated Secret). A file
    /// that cannot be read keeps the previous secrets.
    pub fn auth(&self) -> Arc<Auth> {
        self.auth.current()
    }
}
