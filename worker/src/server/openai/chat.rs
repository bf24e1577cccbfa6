//! Chats: `POST /v1/chat/completions`'s validation, and `POST /infer` (the seeds' task call,
//! served as a chat).

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::fields::{self, On};
use super::generate::serve;
use super::images::{self, ImageSource};
use super::replies::{PromptTokensDetails, TaskAnswer, UsageInfo};
use super::types::{ChatBody, InferBody, Kind};
use super::validate::{
    check_prompt_bytes, last_user_text, messages, prepare_request, sampling, Caps, Parts, RawBody,
    ValidRequest, Validate, Wire,
};
use super::S;
use super::{guided, outputs};
use crate::engine::api::{ChatMessage, ContentPart, EngineError, Prompt};
use crate::server::openapi::Refusals;
use crate::server::{ApiError, AppState};

impl Validate for ChatBody {
    /// The messages rendered by the model's chat template (an image part becomes the model's
    /// image placeholder); the router reads the last user message and the images.
    fn validate(wire: Wire<Self>, s: &AppState) -> Result<ValidRequest, ApiError> {
        fields::check(
            wire.raw.as_object().unwrap_or(&Default::default()),
            On::Chat,
        )?;
        let Wire { body: mut b, raw } = wire;
        let limits = s.cfg().limits.clone();
        let (mut msgs, images) = messages(b.messages, &limits, s.info.model_info().vision)?;
        // The sampling bounds first: the template is the costly part.
        let mut sp = sampling(&b.common, true, &Caps::of(s))?;
        let route_text = last_user_text(&msgs);
        if let Some(g) = b.add_generation_prompt {
            b.chat_template_kwargs
                .insert("add_generation_prompt".into(), g.into());
        }
        // Tools, their history and the answer's shape (structured outputs, reasoning).
        let formats = outputs::Formats::for_pool(s);
        outputs::message_extras(&raw, &mut msgs)?;
        let mut kwargs = b.chat_template_kwargs;
        let tools = outputs::tools(&raw, &formats, &mut msgs, &mut kwargs)?;
        let guide = guided::guide(&raw, &limits)?;
        // A text that cannot fit is refused before the template renders it: the messages'
        // text, their tool calls and results, and the tools.
        let cap = limits.max_body_bytes;
        let text: u64 = msgs
            .iter()
            .map(|m| m.content.len() as u64 + guided::json_len(&m.extra, cap))
            .sum();
        check_prompt_bytes(s, text + guided::json_len(&kwargs, cap))?;
        let text = s.codec.apply_chat_template(&msgs, &kwargs)?;
        let parse = outputs::finish(&text, &formats, guide, tools.as_ref(), &mut sp)?;
        let prompt = match b.add_special_tokens.unwrap_or(false) {
            true => Prompt::Text(text),
            false => Prompt::Templated(text),
        };
        let parts = Parts {
            kind: Kind::Chat,
            prompt,
            route_text,
            forward: raw,
            images,
            whole: false,
            sampling: sp,
            parse,
        };
        ValidRequest::new(s, b.common, parts)
    }
}

impl Validate for InferBody {
    /// The prompt as the one user message of a chat, its image (if any) before the text, never
    /// streamed.
    fn validate(wire: Wire<Self>, s: &AppState) -> Result<ValidRequest, ApiError> {
        let Wire { body: b, raw } = wire;
        check_prompt_bytes(s, b.prompt.len() as u64)?;
        let mut msg = ChatMessage::text("user", b.prompt.clone());
        let mut content = json!(b.prompt);
        let mut images = Vec::new();
        if let Some(img) = &b.image_b64 {
            if !s.info.model_info().vision {
                return Err(EngineError::ImagesNotSupported.into());
            }
            let src = images::source(img, "image_b64", &s.cfg().limits)?;
            if let ImageSource::Bytes(bytes) = &src {
                // Merged pods get it as a chat image part.
                use base64::Engine as _;
                let mime = image::guess_format(bytes).map_or("image/png", |f| f.to_mime_type());
                let data = base64::engine::general_purpose::STANDARD.encode(bytes);
                content = json!([
                    {"type": "image_url", "image_url": {"url": format!("data:{mime};base64,{data}")}},
                    {"type": "text", "text": b.prompt},
                ]);
            }
            images.push(src);
            msg.parts = vec![ContentPart::Image, ContentPart::Text(b.prompt.clone())];
        }
        let mut sp = sampling(&b.common, true, &Caps::of(s))?;
        // Structured outputs shape the task's answer as a chat's (after any reasoning).
        let guide = guided::guide(&raw, &s.cfg().limits)?;
        let text = s
            .codec
            .apply_chat_template(&[msg], &serde_json::Map::new())?;
        let formats = outputs::Formats::for_pool(s);
        let parse = outputs::finish(&text, &formats, guide, None, &mut sp)?;
        let prompt = Prompt::Templated(text);
        // Merged pods get it as a chat completion.
        let mut forward = raw;
        forward["messages"] = json!([{"role": "user", "content": content}]);
        if let Some(f) = forward.as_object_mut() {
            for k in ["prompt", "input", "image_b64"] {
                f.remove(k);
            }
        }
        let parts = Parts {
            kind: Kind::Chat,
            prompt,
            route_text: b.prompt,
            forward,
            images,
            whole: true,
            sampling: sp,
            parse,
        };
        ValidRequest::new(s, b.common, parts)
    }
}

/// `POST /infer`, the seeds' task call: `{prompt, image_b64?, expert?, prefer_merged?, ...}` →
/// `{task_output, routed_adapter, adapter_version, mode, route, usage}`. The prompt is one user
/// message; `expert` names the adapter (else the router decides).
#[utoipa::path(post, path = "/infer", tag = "mole",
    request_body = InferBody,
    responses((status = 200, description = "The task's answer", body = TaskAnswer), Refusals),
    security(("bearer" = [])))]
pub async fn infer(State(s): S, headers: HeaderMap, body: RawBody) -> Result<Response, ApiError> {
    let deadline = s.deadline();
    let req = prepare_request::<InferBody>(&s, body, deadline).await?;
    let answer = serve(&s, &headers, req, deadline).await?;
    if !answer.status().is_success() {
        return Ok(answer);
    }
    task_answer(answer).await
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
    let text = |v: &Value| v.as_str().map(str::to_string);
    let count = |k: &str| v["usage"][k].as_u64().unwrap_or(0) as usize;
    let out = TaskAnswer {
        task_output: text(&v["choices"][0]["message"]["content"]).unwrap_or_default(),
        finish_reason: text(&v["choices"][0]["finish_reason"]),
        routed_adapter: text(&v["mole"]["adapter"]),
        adapter_version: text(&v["mole"]["adapter_version"]),
        mode: text(&v["mole"]["mode"]).unwrap_or_default(),
        route: text(&v["mole"]["route"]).unwrap_or_default(),
        usage: UsageInfo {
            prompt_tokens: count("prompt_tokens"),
            completion_tokens: count("completion_tokens"),
            total_tokens: count("total_tokens"),
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: v["usage"]["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap_or(0) as usize,
            },
        },
    };
    Ok((parts.status, parts.headers, Json(out)).into_response())
}
