//! Chats: `POST /v1/chat/completions`'s validation (shared with the Responses API, whose input
//! becomes a chat), and `POST /infer` (the seeds' task call, served as a chat).

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

use super::body::Fields;
use super::extract::RawBody;
use super::generate::serve;
use super::guided::{self, Guides};
use super::images::{self, ImageSource};
use super::outputs;
use super::reply_bodies::{PromptTokensDetails, TaskAnswer, UsageInfo};
use super::request_bodies::{ChatBody, Common, InferBody, Kind};
use super::tools::ToolFields;
use super::validate::{
    check_prompt_bytes, last_user_text, messages, prepare_request, sampling, Caps, Parts,
    ValidRequest, Validate,
};
use super::S;
use crate::error::Refusals;
use crate::{ApiError, AppState};
use mole_engine::api::{ChatMessage, ContentPart, EngineError, Prompt};

/// A conversation to render: what a chat body and a Responses API input become.
pub(super) struct Conversation {
    /// The messages, as the template reads them.
    pub(super) msgs: Vec<ChatMessage>,
    /// Their images, in order.
    pub(super) images: Vec<ImageSource>,
    /// The template's extra variables.
    pub(super) kwargs: Map<String, Value>,
    /// The tokenizer's special tokens around the rendered text.
    pub(super) add_special_tokens: bool,
}

/// A conversation rendered by the model's chat template with its tools and the answer's shape
/// (structured outputs or a forced call, starting after the reasoning), checked against the
/// limits: the request the serving path takes.
pub(super) fn chat_request(
    s: &AppState,
    kind: Kind,
    mut conv: Conversation,
    tools: ToolFields,
    guides: Guides,
    common: Common,
    forward: Option<Bytes>,
) -> Result<ValidRequest, ApiError> {
    let limits = s.cfg().limits.clone();
    // The sampling bounds first: the template is the costly part.
    let mut sp = sampling(&common, true, &Caps::of(s))?;
    let route_text = last_user_text(&conv.msgs);
    // Tools and the answer's shape (structured outputs, reasoning).
    let formats = outputs::Formats::for_pool(s);
    let tools = outputs::tools(tools, &formats, &mut conv.msgs, &mut conv.kwargs)?;
    let guide = guided::guide(guides, &limits)?;
    // A text that cannot fit is refused before the template renders it: the messages'
    // text, their tool calls and results, and the tools.
    let cap = limits.max_body_bytes;
    let text: u64 = conv
        .msgs
        .iter()
        .map(|m| m.content.len() as u64 + guided::json_len(&m.extra, cap))
        .sum();
    check_prompt_bytes(s, text + guided::json_len(&conv.kwargs, cap))?;
    let text = s.codec.apply_chat_template(&conv.msgs, &conv.kwargs)?;
    let parse = outputs::finish(&text, &formats, guide, tools.as_ref(), &mut sp)?;
    let prompt = match conv.add_special_tokens {
        true => Prompt::Text(text),
        false => Prompt::Templated(text),
    };
    let parts = Parts {
        kind,
        prompt,
        route_text,
        forward,
        images: conv.images,
        whole: false,
        sampling: sp,
        parse,
    };
    ValidRequest::new(s, common, parts)
}

impl Validate for ChatBody {
    /// The messages rendered by the model's chat template (an image part becomes the model's
    /// image placeholder); the router reads the last user message and the images.
    fn validate(
        fields: Fields,
        forward: Option<Bytes>,
        s: &AppState,
    ) -> Result<ValidRequest, ApiError> {
        let b = ChatBody::read(fields)?;
        let limits = s.cfg().limits.clone();
        let (msgs, images) = messages(b.own.messages, &limits, s.info.model_info().vision)?;
        let mut kwargs = b.own.chat_template_kwargs;
        if let Some(g) = b.own.add_generation_prompt {
            kwargs.insert("add_generation_prompt".into(), g.into());
        }
        let conv = Conversation {
            msgs,
            images,
            kwargs,
            add_special_tokens: b.own.add_special_tokens.unwrap_or(false),
        };
        chat_request(s, Kind::Chat, conv, b.tools, b.guides, b.common, forward)
    }
}

impl Validate for InferBody {
    /// The prompt as the one user message of a chat, its image (if any) before the text, never
    /// streamed.
    fn validate(
        fields: Fields,
        forward: Option<Bytes>,
        s: &AppState,
    ) -> Result<ValidRequest, ApiError> {
        let b = InferBody::read(fields)?;
        let Some(prompt) = b.own.prompt.or(b.own.input) else {
            return Err(super::super::error::bad(
                "invalid_request",
                "prompt (or input) is required",
            ));
        };
        check_prompt_bytes(s, prompt.len() as u64)?;
        let mut msg = ChatMessage::text("user", prompt.clone());
        let mut content = json!(prompt);
        let mut images = Vec::new();
        if let Some(img) = &b.own.image_b64 {
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
                    {"type": "text", "text": prompt},
                ]);
            }
            images.push(src);
            msg.parts = vec![ContentPart::Image, ContentPart::Text(prompt.clone())];
        }
        let mut sp = sampling(&b.common, true, &Caps::of(s))?;
        // Structured outputs shape the task's answer as a chat's (after any reasoning).
        let guide = guided::guide(b.guides, &s.cfg().limits)?;
        let text = s
            .codec
            .apply_chat_template(&[msg], &serde_json::Map::new())?;
        let formats = outputs::Formats::for_pool(s);
        let parse = outputs::finish(&text, &formats, guide, None, &mut sp)?;
        let forward = forward.map(|f| infer_forward(&f, content));
        let parts = Parts {
            kind: Kind::Chat,
            prompt: Prompt::Templated(text),
            route_text: prompt,
            forward,
            images,
            whole: true,
            sampling: sp,
            parse,
        };
        ValidRequest::new(s, b.common, parts)
    }
}

/// `/infer`'s body as merged pods and peers get it: a chat completion, the task's prompt and
/// image made its one user message (`content`), every other field as sent.
fn infer_forward(sent: &[u8], content: Value) -> Bytes {
    let mut body: Map<String, Value> = serde_json::from_slice(sent).unwrap_or_default();
    for k in ["prompt", "input", "image_b64"] {
        body.remove(k);
    }
    body.insert(
        "messages".into(),
        json!([{"role": "user", "content": content}]),
    );
    Bytes::from(serde_json::to_vec(&body).unwrap_or_default())
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
