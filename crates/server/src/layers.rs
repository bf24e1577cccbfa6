//! The layers every API route passes (see [`super::app`]), outermost first: the request's
//! span, the error counter, the guard of its [`Access`].

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tracing::field::Empty;
use tracing::Instrument;

use super::auth::Access;
use super::error::ErrorCode;
use super::state::AppState;

/// The guard layer (`from_fn_with_state` over the state and the route's [`Access`]): a request
/// whose credentials do not grant the access is refused before its body is read.
pub(super) async fn require(
    State((s, access)): State<(Arc<AppState>, Access)>,
    req: Request,
    next: Next,
) -> Response {
    match s.auth().check(access, req.headers()) {
        Ok(()) => next.run(req).await,
        Err(e) => e.into_response(),
    }
}

/// The counting layer of the API routes (`from_fn_with_state`): every error answer, whichever
/// step refused (guard, body, validation, routing, engine), counts in `mole_errors_total` by its
/// code. Errors inside a stream already under way are counted where they happen.
pub(super) async fn count_errors(
    State(s): State<Arc<AppState>>,
    req: Request,
    next: Next,
) -> Response {
    let r = next.run(req).await;
    if let Some(ErrorCode(code)) = r.extensions().get::<ErrorCode>() {
        s.metrics.errors.with_label_values(&[code]).inc();
    }
    r
}

/// Runs an API request inside its `request` span, which continues the caller's trace
/// (`traceparent`) and is the parent of the gateway's and the engine's spans. The engine's
/// sequences hold it, so a streamed answer's span ends with its last token. Probes and
/// `/metrics` get none: a probe every few seconds is not a trace anyone reads.
pub(super) async fn traced(req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or_else(|| req.uri().path().to_string(), |p| p.as_str().to_string());
    let method = req.method().clone();
    let span = tracing::info_span!(
        "request",
        otel.name = %format_args!("{method} {route}"),
        otel.kind = "server",
        otel.status_code = Empty,
        http.request.method = %method,
        http.route = %route,
        http.response.status_code = Empty,
        mole.adapter = Empty,
        mole.mode = Empty,
        mole.route = Empty,
    );
    mole_telemetry::continue_trace(&span, req.headers());
    let resp = next.run(req).instrument(span.clone()).await;
    span.record("http.response.status_code", resp.status().as_u16());
    if resp.status().is_server_error() {
        span.record("otel.status_code", "ERROR");
    }
    resp
}
