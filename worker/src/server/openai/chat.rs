//! `POST /v1/chat/completions` and `POST /infer` (the seeds' task call, served as a chat).

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::generate::serve;
use super::validate::{ValidRequest, Wire};
use super::{finish, S};
use crate::server::ApiError;

/// `POST /v1/chat/completions`.
pub async fn chat(
    State(s): S,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = async {
        s.check_api_key(&headers)?;
        let req = ValidRequest::chat(&s, Wire::read(body)?)?;
        serve(&s, &headers, req).await
    }
    .await;
    finish(&s, r)
}

/// `POST /infer`, the seeds' task call: `{prompt, image_b64?, expert?, prefer_merged?, ...}` →
/// `{task_output, routed_adapter, adapter_version, mode, route, usage}`. The prompt is one user
/// message; `expert` names the adapter (else the router decides).
pub async fn infer(
    State(s): S,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = async {
        s.check_api_key(&headers)?;
        let req = ValidRequest::infer(&s, Wire::read(body)?)?;
        let resp = serve(&s, &headers, req).await?;
        if !resp.status().is_success() {
            return Ok(resp);
        }
        task_answer(resp).await
    }
    .await;
    finish(&s, r)
}

/// A chat completion (served here or by a merged pod) in the seeds' shape, status and headers
/// kept.
async fn task_answer(resp: Response) -> Result<Response, ApiError> {
    let upstream = |e: String| ApiError::new(StatusCode::BAD_GATEWAY, "invalid_upstream", e);
    let (parts, body) = resp.into_parts();
    let bytes = axum::body::to_bytes(body, usize::MAX)
        .await
        .map_err(|e| upstream(e.to_string()))?;
    let v: Value = serde_json::from_slice(&bytes).map_err(|e| upstream(e.to_string()))?;
    let out = json!({
        "task_output": v["choices"][0]["message"]["content"],
        "finish_reason": v["choices"][0]["finish_reason"],
        "routed_adapter": v["mole"]["adapter"],
        "adapter_version": v["mole"]["adapter_version"],
        "mode": v["mole"]["mode"],
        "route": v["mole"]["route"],
        "usage": v["usage"],
    });
    Ok((parts.status, parts.headers, Json(out)).into_response())
}
