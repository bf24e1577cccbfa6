//! Validation: wire bodies into what the engine takes, every refusal a stable 4xx.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use serde_json::Value;

use super::types::{Common, Content, InMessage, StopField};
use crate::engine::api::{ChatMessage, SamplingParams};
use crate::server::{ApiError, AppState};

pub(super) fn bad(code: &'static str, msg: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, code, msg)
}

/// Reads a JSON body, turning every failure into a stable 4xx.
pub(super) fn parse_body<T: serde::de::DeserializeOwned>(
    body: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    let b = body.map_err(|r| {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body_too_large",
                "request body exceeds limits.maxBodyBytes",
            )
        } else {
            bad("invalid_body", r.body_text())
        }
    })?;
    let v: Value = serde_json::from_slice(&b)
        .map_err(|e| bad("invalid_json", format!("body is not valid JSON: {e}")))?;
    serde_json::from_value(v).map_err(|e| bad("invalid_request", e.to_string()))
}

pub(super) fn sampling(s: &AppState, c: &Common, chat: bool) -> Result<SamplingParams, ApiError> {
    let cfg = s.cfg();
    let cap = u64::from(cfg.limits.max_tokens);
    let mt = c
        .max_completion_tokens
        .or(c.max_tokens)
        .unwrap_or(cap.min(256));
    if mt == 0 || mt > cap {
        return Err(bad(
            "max_tokens_exceeded",
            format!("max_tokens must be between 1 and {cap}, got {mt}"),
        ));
    }
    let temperature = c.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(bad("invalid_temperature", "temperature must be in [0, 2]"));
    }
    let top_p = c.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(bad("invalid_top_p", "top_p must be in (0, 1]"));
    }
    let logprobs = match (&c.logprobs, chat) {
        (None, _) | (Some(Value::Null), _) | (Some(Value::Bool(false)), true) => None,
        (Some(Value::Bool(true)), true) => Some(c.top_logprobs.unwrap_or(0).min(20)),
        (Some(Value::Number(n)), false) => Some(n.as_u64().unwrap_or(0).min(20) as usize),
        _ => return Err(bad("invalid_logprobs", "logprobs has the wrong type")),
    };
    let stop = match &c.stop {
        None => vec![],
        Some(StopField::One(s)) => vec![s.clone()],
        Some(StopField::Many(v)) => v.clone(),
    };
    if stop.len() > 4 || stop.iter().any(String::is_empty) {
        return Err(bad("invalid_stop", "stop: at most 4 non-empty strings"));
    }
    Ok(SamplingParams {
        temperature,
        top_p,
        top_k: c.top_k.unwrap_or(0),
        min_p: c.min_p.unwrap_or(0.0),
        repetition_penalty: c.repetition_penalty.unwrap_or(1.0),
        presence_penalty: c.presence_penalty.unwrap_or(0.0),
        frequency_penalty: c.frequency_penalty.unwrap_or(0.0),
        seed: c.seed,
        max_tokens: mt as usize,
        stop,
        stop_token_ids: c.stop_token_ids.clone(),
        logprobs,
        ignore_eos: c.ignore_eos,
    })
}

pub(super) fn messages(msgs: Vec<InMessage>) -> Result<Vec<ChatMessage>, ApiError> {
    if msgs.is_empty() {
        return Err(bad("empty_messages", "messages must not be empty"));
    }
    let mut out = Vec::with_capacity(msgs.len());
    for m in msgs {
        if !matches!(
            m.role.as_str(),
            "system" | "user" | "assistant" | "tool" | "developer"
        ) {
            return Err(bad("invalid_role", format!("unknown role {:?}", m.role)));
        }
        let content = match m.content {
            None => String::new(),
            Some(Content::Text(t)) => t,
            Some(Content::Parts(ps)) => {
                let mut t = String::new();
                for p in ps {
                    match p.kind.as_str() {
                        "text" => t.push_str(p.text.as_deref().unwrap_or("")),
                        "image_url" | "input_image" | "image" => {
                            return Err(bad(
                                "images_not_supported",
                                "this model does not accept images",
                            ))
                        }
                        other => {
                            return Err(bad(
                                "invalid_content_part",
                                format!("unsupported content part {other:?}"),
                            ))
                        }
                    }
                }
                t
            }
        };
        let role = if m.role == "developer" {
            "system".into()
        } else {
            m.role
        };
        out.push(ChatMessage { role, content });
    }
    Ok(out)
}

pub(super) fn last_user_text(m: &[ChatMessage]) -> String {
    m.iter()
        .rev()
        .find(|m| m.role == "user")
        .map(|m| m.content.clone())
        .unwrap_or_default()
}
