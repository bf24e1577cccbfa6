//! The OpenAI-compatible HTTP API (axum). Handlers parse and check requests, route them
//! ([`crate::router`]), forward merged adapters to their pods or submit to the engine, and
//! stream the answer back. Every error is OpenAI-shaped (`{error:{message,type,code}}`) with a
//! stable `code`; every answer names the adapter, mode and route (`x-mole-*` headers and a
//! `mole` field).

mod auth;
pub mod cli;
mod engines;
mod error;
mod gateway;
mod openai;
mod reload;
mod state;

use std::sync::Arc;

use axum::extract::DefaultBodyLimit;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use crate::router::Decision;

pub use auth::{Auth, AuthSource};
pub use engines::{build_engine, build_local_merged, BuildError};
pub use error::ApiError;
pub use gateway::PROXY_CONNECT_TIMEOUT;
pub use reload::ReloadOutcome;
pub use state::AppState;

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

/// `GET /readyz`: 200 once [`AppState::readiness`] holds, else 503 `not_ready` with the reason.
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
async fn metrics(axum::extract::State(s): axum::extract::State<Arc<AppState>>) -> Response {
    s.metrics.ready.set(i64::from(s.readiness().is_ok()));
    let body = s.metrics.render(&s.engine.stats(), &s.adapter_listing());
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
