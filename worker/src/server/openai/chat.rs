//! `POST /v1/chat/completions` and `POST /infer` (the seeds' task call, served as a chat).

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::generate::serve;
use super::types::{ChatBody, InferBody, Kind};
use super::validate::{bad, last_user_text, messages, parse_body, sampling};
use super::{finish, S};
use crate::engine::api::{ChatMessage, Prompt};
use crate::server::ApiError;

/// `POST /v1/chat/completions`.
pub async fn chat(
    State(s): S,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = async {
        s.check_api_key(&headers)?;
        let raw: Value = parse_body(body)?;
        let b: ChatBody = serde_json::from_value(raw.clone())
            .map_err(|e| bad("invalid_request", e.to_string()))?;
        let msgs = messages(b.messages)?;
        let sp = sampling(&s, &b.common, true)?;
        let text = last_user_text(&msgs);
        let prompt = Prompt::Templated(
            s.engine
                .apply_chat_template(&msgs, &b.chat_template_kwargs)?,
        );
        serve(
            s.clone(),
            headers.clone(),
            Kind::Chat,
            raw,
            b.common,
            prompt,
            text,
            sp,
        )
        .await
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
        let raw: Value = parse_body(body)?;
        let mut b: InferBody = serde_json::from_value(raw.clone())
            .map_err(|e| bad("invalid_request", e.to_string()))?;
        if let Some(img) = &b.image_b64 {
            use base64::Engine as _;
            let data = img.split_once("base64,").map_or(img.as_str(), |(_, d)| d);
            base64::engine::general_purpose::STANDARD
                .decode(data.trim())
                .map_err(|e| bad("invalid_image", format!("image_b64 is not base64: {e}")))?;
            return Err(bad(
                "images_not_supported",
                "this worker serves text models; image inputs need a vision base model",
            ));
        }
        b.common.stream = false;
        let msgs = vec![ChatMessage {
            role: "user".into(),
            content: b.prompt.clone(),
        }];
        let sp = sampling(&s, &b.common, true)?;
        let prompt = Prompt::Templated(
            s.engine
                .apply_chat_template(&msgs, &serde_json::Map::new())?,
        );
        // Forwarded requests go to merged pods as chat completions.
        let mut fwd = raw.clone();
        fwd["messages"] = json!([{"role": "user", "content": b.prompt}]);
        let resp = serve(
            s.clone(),
            headers.clone(),
            Kind::Chat,
            fwd,
            b.common,
            prompt,
            b.prompt,
            sp,
        )
        .await?;
        if !resp.status().is_success() {
            return Ok(resp);
        }
        let (parts, body) = resp.into_parts();
        let bytes = axum::body::to_bytes(body, usize::MAX).await.map_err(|e| {
            ApiError::new(StatusCode::BAD_GATEWAY, "invalid_upstream", e.to_string())
        })?;
        let v: Value = serde_json::from_slice(&bytes).map_err(|e| {
            ApiError::new(StatusCode::BAD_GATEWAY, "invalid_upstream", e.to_string())
        })?;
        let out = json!({
            "task_output": v["choices"][0]["message"]["content"],
            "finish_reason": v["choices"][0]["finish_reason"],
            "routed_adapter": v["mole"]["adapter"],
            "adapter_version": v["mole"]["adapter_version"],
            "mode": v["mole"]["mode"],
            "route": v["mole"]["route"],
            "usage": v["usage"],
        });
        Ok::<Response, ApiError>((parts.status, parts.headers, Json(out)).into_response())
    }
    .await;
    finish(&s, r)
}
