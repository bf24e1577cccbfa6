//! The OpenAI-compatible HTTP API (axum). A request passes two layers, the guard of its
//! route's [`Access`] and the error counter (see [`app`]); its handler reads the JSON body,
//! validation turns it into one typed request, the router ([`crate::router`]) picks the
//! adapter, and the gateway forwards it to merged pods or the engine answers, whole or
//! streamed. Every error is OpenAI-shaped (`{error:{message,type,code}}`) with a stable `code`;
//! every answer names the adapter, mode and route (`x-mole-*` headers and a `mole` field).
//!
//! Beside it, what serving needs above the engine: the worker's configuration file
//! ([`config`]), its metrics ([`metrics`]) and the [`router`]. This crate is the top of the
//! serving path: it imports the engine and, of the tools, only the merge.

// Device→host copies are the decode path's concern (mole-model, mole-engine's lora); the
// server only reads the engine's answers.
#![allow(clippy::disallowed_methods)]

mod auth;
pub mod cli;
pub mod config;
mod doc_check;
mod engines;
mod error;
mod gateway;
mod layers;
pub mod metrics;
mod openai;
mod openapi;
mod openapi_requests;
pub mod peers;
mod prepare;
mod reload;
mod residency;
pub mod router;
mod state;

use std::sync::Arc;

use axum::extract::DefaultBodyLimit;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::middleware::from_fn_with_state;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, MethodRouter};

use crate::router::Decision;

pub use auth::{Access, Auth, AuthSource};
pub use engines::{build_engine, build_engine_with, build_local_merged, BuildError, EngineTuning};
pub use error::ApiError;
pub use reload::ReloadOutcome;
pub use state::AppState;
pub use state::PROXY_CONNECT_TIMEOUT;

/// The HTTP routes. Every API endpoint sits behind two layers: the guard of its [`Access`]
/// and the error counter; the probes and `/metrics` behind neither.
pub fn app(state: Arc<AppState>) -> axum::Router {
    use Access::{Admin, ApiKey, Listing, Operator};
    let limit = usize::try_from(state.cfg().limits.max_body_bytes).unwrap_or(usize::MAX);
    // Bodies of the endpoints that never carry a prompt's worth of images: a request cannot
    // make them parse, template or tokenize `maxBodyBytes`.
    let small = DefaultBodyLimit::max(limit.min(SMALL_BODY_BYTES));
    let admin = DefaultBodyLimit::max(limit.min(ADMIN_BODY_BYTES));
    let s = &state;
    axum::Router::new()
        .route(
            "/v1/chat/completions",
            api(s, ApiKey, post(openai::chat_completions)),
        )
        .route("/v1/completions", api(s, ApiKey, post(openai::completions)))
        .route(
            "/v1/responses",
            api(s, ApiKey, post(openai::create_response)),
        )
        .route(
            "/v1/responses/{id}",
            api(
                s,
                ApiKey,
                get(openai::get_response).delete(openai::delete_response),
            )
            .layer(small),
        )
        .route("/infer", api(s, ApiKey, post(openai::infer)))
        .route(
            "/v1/route",
            api(s, ApiKey, post(openai::route)).layer(small),
        )
        .route("/v1/models", api(s, ApiKey, get(openai::models)))
        .route(
            "/v1/lora_adapters",
            api(s, Listing, get(openai::lora_adapters)),
        )
        .route(
            "/v1/load_lora_adapter",
            api(s, Admin, post(openai::load_lora)).layer(admin),
        )
        .route(
            "/v1/unload_lora_adapter",
            api(s, Operator, post(openai::unload_lora)).layer(admin),
        )
        .route(
            "/admin/reload",
            api(s, Operator, post(openai::admin_reload)).layer(admin),
        )
        .route(
            "/tokenize",
            api(s, ApiKey, post(openai::tokenize)).layer(small),
        )
        .route(
            "/detokenize",
            api(s, ApiKey, post(openai::detokenize)).layer(small),
        )
        .route("/version", get(openai::version))
        .route("/health", get(health))
        .route("/healthz", get(healthz))
        .route("/openapi.json", get(openapi::openapi_json))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/v1/residency", get(residency::residency))
        .fallback(|| async {
            ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such endpoint")
        })
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

/// The body limit of `/tokenize`, `/detokenize` and `/v1/route` (or `limits.maxBodyBytes` when
/// lower): a context's worth of text; images go by URL there.
pub const SMALL_BODY_BYTES: usize = 1 << 20;
/// The body limit of the admin and operator endpoints (or `limits.maxBodyBytes` when lower).
pub const ADMIN_BODY_BYTES: usize = 64 << 10;

/// An API endpoint behind its guard, then the error counter (which sees the guard's refusals
/// too). Route layers, so a wrong method stays a plain 405.
fn api(
    s: &Arc<AppState>,
    access: Access,
    endpoint: MethodRouter<Arc<AppState>>,
) -> MethodRouter<Arc<AppState>> {
    endpoint
        .route_layer(from_fn_with_state((s.clone(), access), layers::require))
        .route_layer(from_fn_with_state(s.clone(), layers::count_errors))
        .route_layer(axum::middleware::from_fn(layers::traced))
}

/// `GET /health`: vLLM's and TGI's liveness path, which their clients check before a run.
#[utoipa::path(get, path = "/health", tag = "probes",
    responses((status = 200, description = "The process serves HTTP")))]
async fn health() {}

/// `GET /healthz`: liveness.
#[utoipa::path(get, path = "/healthz", tag = "probes",
    responses((status = 200, description = "The process serves HTTP", body = String, content_type = "text/plain")))]
async fn healthz() -> &'static str {
    "ok"
}

/// `GET /readyz`: 200 once [`AppState::readiness`] holds, else 503 `not_ready` with the reason.
#[utoipa::path(get, path = "/readyz", tag = "probes",
    responses(
        (status = 200, description = "Ready: the model and the configured adapters are loaded", body = String, content_type = "text/plain"),
        (status = 503, description = "Not ready, with the reason", body = error::ErrorReply),
    ))]
async fn readyz(axum::extract::State(s): axum::extract::State<Arc<AppState>>) -> Response {
    match s.readiness() {
        Ok(()) => "ready".into_response(),
        Err(why) => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "not_ready",
            format!("not ready: {why}"),
        )
        .with_retry_after(1)
        .into_response(),
    }
}

/// `GET /metrics`: the Prometheus text, with readiness and the engine's gauges read now.
#[utoipa::path(get, path = "/metrics", tag = "probes",
    responses((status = 200, description = "Prometheus text format", body = String, content_type = "text/plain")))]
async fn metrics(axum::extract::State(s): axum::extract::State<Arc<AppState>>) -> Response {
    s.metrics.ready.set(i64::from(s.readiness().is_ok()));
    s.metrics
        .prepare_queued
        .set(i64::try_from(s.prepare.queued()).unwrap_or(i64::MAX));
    let body = s.metrics.render(&s.info.stats(), &s.adapter_listing());
    (
        [("content-type", "text/plain; version=0.0.4; charset=utf-8")],
        body,
    )
        .into_response()
}

/// The `x-mole-*` headers every answer carries: which adapter, how it is served, which rule
/// routed it.
fn mole_headers(d: &Decision) -> HeaderMap {
    let mut h = HeaderMap::new();
    let v = |s: &str| HeaderValue::from_str(s).unwrap_or(HeaderValue::from_static("?"));
    h.insert("x-mole-adapter", v(d.adapter.as_deref().unwrap_or("")));
    h.insert("x-mole-mode", v(d.mode.as_str()));
    h.insert("x-mole-route", v(&d.reason));
    h
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::Request;
    use mole_engine::api::{
        AdapterAdmin, AdapterSpec, ChatMessage, EngineError, EngineHandles, EngineInfo,
        EngineStats, EventStream, GenerateRequest, Image, ModelInfo, Prompt, PromptCodec, Serving,
    };
    use tower::ServiceExt;

    /// An engine that is never asked to serve or tokenize: the layers answer first. Only
    /// what `/metrics` and the listings read answers.
    struct Unreached;

    impl Serving for Unreached {
        fn submit(&self, _: GenerateRequest) -> Result<EventStream, EngineError> {
            unreachable!("the layers answer first")
        }
        fn score_labels(
            &self,
            _: Option<&str>,
            _: &str,
            _: &[String],
            _: &[Image],
        ) -> Result<Vec<f32>, EngineError> {
            unreachable!("the layers answer first")
        }
    }

    impl PromptCodec for Unreached {
        fn apply_chat_template(
            &self,
            _: &[ChatMessage],
            _: &serde_json::Map<String, serde_json::Value>,
        ) -> Result<String, EngineError> {
            unreachable!("the layers answer first")
        }
        fn tokenize(&self, _: &Prompt, _: &[Image]) -> Result<Vec<u32>, EngineError> {
            unreachable!("the layers answer first")
        }
        fn detokenize(&self, _: &[u32]) -> Result<String, EngineError> {
            unreachable!("the layers answer first")
        }
        fn image_tokens(&self, _: u32, _: u32) -> Result<usize, EngineError> {
            unreachable!("the layers answer first")
        }
    }

    impl AdapterAdmin for Unreached {
        fn load_adapter(&self, _: AdapterSpec) -> Result<(), EngineError> {
            unreachable!("the layers answer first")
        }
        fn unload_adapter(&self, _: &str) -> Result<(), EngineError> {
            unreachable!("the layers answer first")
        }
        fn adapters(&self) -> Vec<mole_api::LoraAdapterInfo> {
            vec![]
        }
    }

    impl EngineInfo for Unreached {
        fn stats(&self) -> EngineStats {
            EngineStats::default()
        }
        fn model_info(&self) -> ModelInfo {
            ModelInfo {
                name: "b".into(),
                max_seq_len: 128,
                vocab_size: 256,
                vision: false,
                image_token: None,
                max_token_bytes: 4,
            }
        }
    }

    #[tokio::test]
    async fn api_routes_are_guarded_and_their_errors_counted_probes_are_not() {
        let d = tempfile::tempdir().unwrap();
        let keys = d.path().join("keys");
        std::fs::write(&keys, "k1\n").unwrap();
        let yaml = format!(
            "pool: p\nbaseModel: {{name: b, path: b}}\nlimits: {{maxBodyBytes: 64}}\nauth: {{apiKeysFile: {}}}\n",
            keys.display()
        );
        let cfg = crate::config::parse(&yaml, "t").unwrap();
        let auth = Auth::read(AuthSource::new(&cfg, &|_| None)).unwrap();
        let s = AppState::new(cfg, EngineHandles::of(Arc::new(Unreached)), None, auth);
        let call = |method: &str, path: &str, key: Option<&str>, body: String| {
            let mut r = Request::builder().method(method).uri(path);
            if let Some(k) = key {
                r = r.header("authorization", format!("Bearer {k}"));
            }
            let r = r.body(Body::from(body)).unwrap();
            let app = app(s.clone());
            async move { app.oneshot(r).await.unwrap().status().as_u16() }
        };
        let errors = |code: &str| s.metrics.errors.with_label_values(&[code]).get();
        // The guard answers before the body is read; the counter sees its refusals.
        let big = "x".repeat(100);
        let chat = "/v1/chat/completions";
        assert_eq!(call("POST", chat, None, big.clone()).await, 401);
        assert_eq!(
            call("GET", "/v1/models", Some("k2"), String::new()).await,
            401
        );
        assert_eq!(errors("invalid_api_key"), 2);
        // Past the guard, the body: too large, not JSON.
        assert_eq!(call("POST", chat, Some("k1"), big).await, 413);
        assert_eq!(call("POST", chat, Some("k1"), "{".into()).await, 400);
        assert_eq!((errors("body_too_large"), errors("invalid_json")), (1, 1));
        // No admin or operator token: the admin endpoints are off, whatever the key.
        let reload = call("POST", "/admin/reload", Some("k1"), String::new()).await;
        assert_eq!((reload, errors("admin_disabled")), (403, 1));
        // The listing takes an API key.
        let listing = call("GET", "/v1/lora_adapters", Some("k1"), String::new()).await;
        assert_eq!(listing, 200);
        // A wrong method is a plain 405; probes and unknown paths are neither guarded nor
        // counted.
        assert_eq!(call("GET", chat, None, String::new()).await, 405);
        assert_eq!(call("GET", "/healthz", None, String::new()).await, 200);
        assert_eq!(call("GET", "/readyz", None, String::new()).await, 503);
        assert_eq!(call("GET", "/nope", None, String::new()).await, 404);
        assert_eq!((errors("not_ready"), errors("not_found")), (0, 0));
    }
}
