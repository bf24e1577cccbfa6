//! `POST /v1/completions`.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use serde_json::Value;

use super::generate::serve;
use super::types::{CompletionBody, Kind, PromptField};
use super::validate::{bad, parse_body, sampling};
use super::{finish, S};
use crate::engine::api::Prompt;

/// `POST /v1/completions`.
pub async fn completions(
    State(s): S,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = async {
        s.check_api_key(&headers)?;
        let raw: Value = parse_body(body)?;
        let b: CompletionBody = serde_json::from_value(raw.clone())
            .map_err(|e| bad("invalid_request", e.to_string()))?;
        let sp = sampling(&s, &b.common, false)?;
        let prompt = match b.prompt {
            PromptField::Text(t) => Prompt::Text(t),
            PromptField::Tokens(t) if !t.is_empty() => {
                let vocab = s.engine.model_info().vocab_size;
                if let Some(bad_id) = t.iter().find(|&&i| vocab > 0 && i as usize >= vocab) {
                    return Err(bad(
                        "invalid_token_id",
                        format!("token id {bad_id} >= vocab size {vocab}"),
                    ));
                }
                Prompt::Tokens(t)
            }
            PromptField::Texts(mut v) if v.len() == 1 => Prompt::Text(v.remove(0)),
            _ => {
                return Err(bad(
                    "invalid_prompt",
                    "prompt must be a string, one-string array or a non-empty token id array",
                ))
            }
        };
        let text = match &prompt {
            Prompt::Text(t) | Prompt::Templated(t) => t.clone(),
            Prompt::Tokens(_) => String::new(),
        };
        serve(
            s.clone(),
            headers.clone(),
            Kind::Completion,
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
