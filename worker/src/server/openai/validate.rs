//! Validation, the shape of TGI's `validation.rs`: a wire body in, one [`ValidRequest`] out
//! (prompt, sampling within the limits, adapter choice, stream flag), or a stable 4xx. The
//! serving path takes nothing else.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{FromRequest, Request};
use axum::http::{HeaderMap, StatusCode};
use serde::de::DeserializeOwned;
use serde_json::Value;

use mole_api::WorkerLimits;

use super::images::{self, ImageSource};
use super::types::{Common, Content, InMessage, Kind, StopField};
use crate::engine::api::{ChatMessage, ContentPart, Prompt, SamplingParams};
use crate::engine::sampler::MAX_LOGPROBS;
use crate::router::RouteInput;
use crate::server::error::bad;
use crate::server::gateway::Upstream;
use crate::server::{ApiError, AppState};

/// A JSON request body (the extractor of every endpoint that takes one): typed, and as sent
/// (what a merged pod is forwarded).
pub(in crate::server) struct Wire<T> {
    /// The body, typed.
    pub(super) body: T,
    /// The body as the client sent it.
    pub(super) raw: Value,
}

impl<T: DeserializeOwned> Wire<T> {
    /// Reads a body, every failure a stable 4xx: 413 `body_too_large`, 400 `invalid_body`,
    /// `invalid_json` (not JSON) or `invalid_request` (JSON of the wrong shape).
    fn read(body: Result<Bytes, BytesRejection>) -> Result<Self, ApiError> {
        let b = body.map_err(|r| {
            if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "body_too_large",
                    "request body exceeds this endpoint's limit (limits.maxBodyBytes for \
                     generation, 1 MiB for tokenize, detokenize and route, 64 KiB for admin)",
                )
            } else {
                bad("invalid_body", r.body_text())
            }
        })?;
        let raw: Value = serde_json::from_slice(&b)
            .map_err(|e| bad("invalid_json", format!("body is not valid JSON: {e}")))?;
        let body = serde_json::from_value(raw.clone())
            .map_err(|e| bad("invalid_request", e.to_string()))?;
        Ok(Self { body, raw })
    }
}

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for Wire<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        Self::read(Bytes::from_request(req, state).await)
    }
}

/// A JSON body that may be left out: an empty or blank body reads as `T::default()`.
pub(in crate::server) struct OptionalWire<T>(pub(super) T);

impl<S: Send + Sync, T: DeserializeOwned + Default> FromRequest<S> for OptionalWire<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let body = Bytes::from_request(req, state).await;
        if body
            .as_ref()
            .is_ok_and(|b| b.iter().all(u8::is_ascii_whitespace))
        {
            return Ok(Self(T::default()));
        }
        Wire::read(body).map(|w| Self(w.body))
    }
}

/// A wire body that validation turns into a [`ValidRequest`]: the bodies of chat, completions
/// and `/infer`.
pub(in crate::server) trait Validate:
    DeserializeOwned + Sized + Send + 'static
{
    /// The validated request, or the 4xx that refuses it.
    fn validate(wire: Wire<Self>, s: &AppState) -> Result<ValidRequest, ApiError>;
}

/// [`Validate::validate`] on a blocking thread: the chat template and the prompt of a body of
/// up to `maxBodyBytes` take long, and the async runtime also answers the probes.
pub(super) async fn validate_blocking<B: Validate>(
    wire: Wire<B>,
    s: &std::sync::Arc<AppState>,
) -> Result<ValidRequest, ApiError> {
    let s = s.clone();
    tokio::task::spawn_blocking(move || B::validate(wire, &s)).await?
}

/// One generation request, validated: what chat, completion and `/infer` bodies become, and
/// all the serving path takes.
pub(in crate::server) struct ValidRequest {
    /// The answer's shape (and the `endpoint` metric label).
    pub(super) kind: Kind,
    /// `model` as asked (empty: the router decides, and answers name the pool).
    pub(super) model: String,
    /// An explicit `adapter` (or the seeds' `expert`), which wins over `model`.
    pub(super) adapter: Option<String>,
    /// What the engine runs: a rendered chat template, text or token ids.
    pub(super) prompt: Prompt,
    /// What the router reads: the last user message, or the completion's text.
    pub(super) route_text: String,
    /// Sampling, `max_tokens` within `limits.maxTokens`.
    pub(super) sampling: SamplingParams,
    /// Choices (OpenAI's `n`, checked by [`sampling`]).
    pub(super) n: usize,
    /// Whether the client set `max_tokens` (else the answer may use what the context leaves).
    pub(super) max_tokens_explicit: bool,
    /// Answer as server-sent events.
    pub(super) stream: bool,
    /// End a stream with a usage chunk (`stream_options.include_usage`).
    pub(super) include_usage: bool,
    /// Forward merged adapters to their pods (None: the router's `preferMerged`).
    pub(super) prefer_merged: Option<bool>,
    /// The body a merged pod gets: the client's (for `/infer`, made a chat completion).
    pub(super) forward: Value,
    /// The prompt's images, in the order of its placeholders (read by [`images::read_all`]
    /// before routing).
    pub(super) images: Vec<ImageSource>,
    /// How a chat's answer splits into reasoning, answer and tool calls (None: all answer).
    pub(super) parse: Option<super::parse::ParseSpec>,
}

impl ValidRequest {
    /// The request of a validated prompt and sampling, the rest as the client gave it.
    pub(super) fn new(
        kind: Kind,
        c: Common,
        prompt: Prompt,
        route_text: String,
        sampling: SamplingParams,
        forward: Value,
    ) -> Self {
        Self {
            kind,
            max_tokens_explicit: c.max_tokens.is_some() || c.max_completion_tokens.is_some(),
            model: c.model,
            adapter: c.adapter.or(c.expert),
            prompt,
            route_text,
            sampling,
            n: c.n.unwrap_or(1) as usize,
            stream: c.stream,
            include_usage: c.stream_options.as_ref().is_some_and(|o| o.include_usage),
            prefer_merged: c.prefer_merged,
            forward,
            images: Vec::new(),
            parse: None,
        }
    }

    /// What the router sees of the request.
    pub(super) fn route_input(&self) -> RouteInput<'_> {
        RouteInput {
            model: &self.model,
            adapter: self.adapter.as_deref(),
            text: &self.route_text,
        }
    }

    /// Fits the answer into a context of `max_seq` tokens: without an explicit `max_tokens` it
    /// gets what the prompt leaves (as vLLM); a prompt plus `max_tokens` over it is refused with
    /// 400 `prompt_too_long`, before queueing, so an oversize prompt costs nothing.
    pub(super) fn fit_context(
        &mut self,
        prompt_tokens: usize,
        max_seq: usize,
    ) -> Result<(), ApiError> {
        let sp = &mut self.sampling;
        if !self.max_tokens_explicit && prompt_tokens < max_seq {
            sp.max_tokens = sp.max_tokens.min(max_seq - prompt_tokens);
        }
        if prompt_tokens + sp.max_tokens > max_seq {
            return Err(bad(
                "prompt_too_long",
                format!(
                    "prompt ({prompt_tokens} tokens) + max_tokens ({}) exceeds {max_seq}",
                    sp.max_tokens
                ),
            ));
        }
        Ok(())
    }

    /// What the gateway forwards to merged pods, with the client's `headers`.
    pub(super) fn upstream<'a>(&'a self, headers: &'a HeaderMap) -> Upstream<'a> {
        Upstream {
            path: self.kind.path(),
            endpoint: self.kind.endpoint(),
            body: &self.forward,
            headers,
            prefer_merged: self.prefer_merged,
        }
    }
}

/// `limits.maxTokens` now.
pub(super) fn token_cap(s: &AppState) -> u64 {
    u64::from(s.cfg().limits.max_tokens)
}

/// The most choices one request may ask for (OpenAI's bound); the engine also holds it to
/// `maxBatchSize`.
pub(super) const MAX_N: u64 = 128;

/// The most `stop_token_ids` a request may list (vLLM has no bound; a model's special tokens
/// are a handful).
pub(super) const MAX_STOP_TOKEN_IDS: usize = 64;

/// The sampling fields, checked; `max_tokens` defaults to 256 and must be within `cap`
/// (`limits.maxTokens`). `logprobs` is a bool in chat, a count in completions.
pub(super) fn sampling(c: &Common, chat: bool, cap: u64) -> Result<SamplingParams, ApiError> {
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
    let n = c.n.unwrap_or(1);
    if !(1..=MAX_N).contains(&n) {
        return Err(bad(
            "invalid_n",
            format!("n must be between 1 and {MAX_N}, got {n}"),
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
    // OpenAI's and vLLM's bounds: at most MAX_LOGPROBS alternatives, and top_logprobs only
    // beside `logprobs: true`.
    let logprobs = match (&c.logprobs, chat) {
        (None, _) | (Some(Value::Null), _) | (Some(Value::Bool(false)), true) => None,
        (Some(Value::Bool(true)), true) => Some(c.top_logprobs.unwrap_or(0)),
        (Some(Value::Number(n)), false) => match n.as_u64() {
            Some(n) if n as usize <= MAX_LOGPROBS => Some(n as usize),
            _ => {
                return Err(bad(
                    "invalid_logprobs",
                    format!("logprobs must be an integer between 0 and {MAX_LOGPROBS}"),
                ))
            }
        },
        _ => return Err(bad("invalid_logprobs", "logprobs has the wrong type")),
    };
    match (c.top_logprobs, chat && logprobs.is_some()) {
        (Some(n), true) if n > MAX_LOGPROBS => {
            return Err(bad(
                "invalid_top_logprobs",
                format!("top_logprobs must be between 0 and {MAX_LOGPROBS}, got {n}"),
            ))
        }
        (Some(_), false) => {
            return Err(bad(
                "invalid_top_logprobs",
                match chat {
                    true => "top_logprobs needs logprobs: true",
                    false => "top_logprobs is a chat field: completions take logprobs: <count>",
                },
            ))
        }
        _ => {}
    }
    let stop = match &c.stop {
        None => vec![],
        Some(StopField::One(s)) => vec![s.clone()],
        Some(StopField::Many(v)) => v.clone(),
    };
    if stop.len() > 4 || stop.iter().any(String::is_empty) {
        return Err(bad("invalid_stop", "stop: at most 4 non-empty strings"));
    }
    // Checked against every token the shared batch generates: bounded, sorted and without
    // duplicates (the engine scans the list).
    if c.stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
        return Err(bad(
            "invalid_stop_token_ids",
            format!(
                "stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {}",
                c.stop_token_ids.len()
            ),
        ));
    }
    let mut stop_token_ids = c.stop_token_ids.clone();
    stop_token_ids.sort_unstable();
    stop_token_ids.dedup();
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
        stop_token_ids,
        logprobs,
        ignore_eos: c.ignore_eos,
        guide: None,
    })
}

/// Chat messages: known roles (`developer` is read as `system`), text and image parts; and the
/// images in the order their parts name them (at most `limits.maxImages`).
pub(super) fn messages(
    msgs: Vec<InMessage>,
    limits: &WorkerLimits,
) -> Result<(Vec<ChatMessage>, Vec<ImageSource>), ApiError> {
    if msgs.is_empty() {
        return Err(bad("empty_messages", "messages must not be empty"));
    }
    let mut out = Vec::with_capacity(msgs.len());
    let mut images = Vec::new();
    for (i, m) in msgs.into_iter().enumerate() {
        if !matches!(
            m.role.as_str(),
            "system" | "user" | "assistant" | "tool" | "developer"
        ) {
            return Err(bad("invalid_role", format!("unknown role {:?}", m.role)));
        }
        let role = if m.role == "developer" {
            "system".into()
        } else {
            m.role
        };
        let mut msg = ChatMessage::text(role, "");
        match m.content {
            // An assistant turn may carry only its tool calls; every other role says something.
            None if msg.role != "assistant" => {
                return Err(bad(
                    "missing_content",
                    format!("messages[{i}].content is required for role {}", msg.role),
                ))
            }
            None => {}
            Some(Content::Text(t)) => msg.content = t,
            Some(Content::Parts(ps)) => {
                for (j, p) in ps.into_iter().enumerate() {
                    match (p.kind.as_str(), p.image_url) {
                        ("text" | "input_text", _) => {
                            let t = p.text.unwrap_or_default();
                            msg.content.push_str(&t);
                            msg.parts.push(ContentPart::Text(t));
                        }
                        ("image_url" | "input_image", Some(u)) => {
                            let field = format!("messages[{i}].content[{j}].image_url");
                            images.push(images::source(u.url(), &field, limits)?);
                            images::check_count(images.len(), limits)?;
                            msg.parts.push(ContentPart::Image);
                        }
                        ("image_url" | "input_image", None) => {
                            return Err(bad(
                                "invalid_content_part",
                                format!("messages[{i}].content[{j}] has no image_url"),
                            ))
                        }
                        (other, _) => {
                            return Err(bad(
                                "invalid_content_part",
                                format!("unsupported content part {other:?}"),
                            ))
                        }
                    }
                }
                // A message of text parts alone is plain text to the template.
                if msg.images() == 0 {
                    msg.parts.clear();
                }
            }
        }
        out.push(msg);
    }
    Ok((out, images))
}

/// What the router reads of a chat: its last user message.
pub(super) fn last_user_text(m: &[ChatMessage]) -> String {
    m.iter()
        .rev()
        .find(|m| m.role == "user")
        .map(|m| m.content.clone())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn common(v: Value) -> Common {
        serde_json::from_value(v).unwrap()
    }
    fn refused<T: std::fmt::Debug>(r: Result<T, ApiError>) -> &'static str {
        r.unwrap_err().code()
    }

    #[test]
    fn sampling_defaults_and_bounds() {
        for n in [0, 129] {
            let e = sampling(&common(json!({"n": n})), true, 64).unwrap_err();
            assert_eq!((e.status.as_u16(), e.code), (400, "invalid_n"));
        }
        for n in [1, 2, 128] {
            assert!(sampling(&common(json!({"n": n})), true, 64).is_ok());
        }
        let sp = sampling(&common(json!({})), true, 64).unwrap();
        assert_eq!((sp.max_tokens, sp.temperature, sp.top_p), (64, 1.0, 1.0));
        assert_eq!(
            sampling(&common(json!({})), true, 4096).unwrap().max_tokens,
            256
        );
        let sp = sampling(
            &common(json!({"max_completion_tokens": 3, "max_tokens": 9})),
            true,
            64,
        );
        assert_eq!(sp.unwrap().max_tokens, 3);
        for (body, code) in [
            (json!({"max_tokens": 0}), "max_tokens_exceeded"),
            (json!({"max_tokens": 65}), "max_tokens_exceeded"),
            (json!({"temperature": 2.5}), "invalid_temperature"),
            (json!({"top_p": 0.0}), "invalid_top_p"),
            (json!({"stop": ["a", "b", "c", "d", "e"]}), "invalid_stop"),
            (json!({"stop": ""}), "invalid_stop"),
            (json!({"logprobs": 2}), "invalid_logprobs"),
        ] {
            assert_eq!(
                refused(sampling(&common(body.clone()), true, 64)),
                code,
                "{body}"
            );
        }
        // logprobs: a bool in chat with at most 20 top_logprobs beside it, a count (at most
        // 20) in completions.
        let c = common(json!({"logprobs": true, "top_logprobs": 20}));
        assert_eq!(sampling(&c, true, 64).unwrap().logprobs, Some(20));
        assert_eq!(refused(sampling(&c, false, 64)), "invalid_logprobs");
        for (body, chat) in [
            (json!({"logprobs": true, "top_logprobs": 21}), true),
            (json!({"top_logprobs": 1}), true),
            (json!({"logprobs": false, "top_logprobs": 1}), true),
            (json!({"logprobs": 2, "top_logprobs": 1}), false),
        ] {
            assert_eq!(
                refused(sampling(&common(body.clone()), chat, 64)),
                "invalid_top_logprobs",
                "{body}"
            );
        }
        assert_eq!(
            refused(sampling(&common(json!({"logprobs": 21})), false, 64)),
            "invalid_logprobs"
        );
        let c = common(json!({"logprobs": 3, "stop": "x"}));
        let sp = sampling(&c, false, 64).unwrap();
        assert_eq!((sp.logprobs, sp.stop), (Some(3), vec!["x".to_string()]));
    }

    #[test]
    fn messages_roles_and_parts() {
        let limits = WorkerLimits {
            max_images: 2,
            ..Default::default()
        };
        let m = |v: Value| messages(serde_json::from_value(v).unwrap(), &limits);
        let (ok, images) = m(json!([
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant"},
        ]))
        .unwrap();
        assert!(images.is_empty() && ok.iter().all(|m| m.parts.is_empty()));
        let got: Vec<(&str, &str)> = ok
            .iter()
            .map(|m| (m.role.as_str(), m.content.as_str()))
            .collect();
        assert_eq!(
            got,
            [("system", "be brief"), ("user", "ab"), ("assistant", "")]
        );
        assert_eq!(last_user_text(&ok), "ab");
        assert_eq!(refused(m(json!([]))), "empty_messages");
        assert_eq!(
            refused(m(json!([{"role": "wizard", "content": "x"}]))),
            "invalid_role"
        );
        let part = |t: &str| json!([{"role": "user", "content": [{"type": t}]}]);
        assert_eq!(refused(m(part("image_url"))), "invalid_content_part");
        assert_eq!(refused(m(part("audio"))), "invalid_content_part");
        // Images keep their place among the text parts, in both wire shapes.
        let img = |u: &str| json!({"type": "image_url", "image_url": {"url": u}});
        let (ok, images) = m(json!([{"role": "user", "content": [
            img("data:image/png;base64,AAEC"),
            {"type": "text", "text": "what is this?"},
            {"type": "input_image", "image_url": "AwQF"},
        ]}]))
        .unwrap();
        assert_eq!(
            images,
            [
                ImageSource::Bytes(vec![0, 1, 2]),
                ImageSource::Bytes(vec![3, 4, 5])
            ]
        );
        assert_eq!(
            ok[0].parts,
            [
                ContentPart::Image,
                ContentPart::Text("what is this?".into()),
                ContentPart::Image
            ]
        );
        assert_eq!(ok[0].content, "what is this?");
        let three = json!([{"role": "user", "content": [img("AAEC"), img("AAEC"), img("AAEC")]}]);
        assert_eq!(refused(m(three)), "too_many_images");
    }

    #[test]
    fn the_context_limit_trims_or_refuses() {
        let req = |explicit: bool, max_tokens: usize| ValidRequest {
            kind: Kind::Chat,
            model: String::new(),
            adapter: None,
            prompt: Prompt::Tokens(vec![1]),
            route_text: String::new(),
            sampling: SamplingParams {
                max_tokens,
                ..Default::default()
            },
            max_tokens_explicit: explicit,
            n: 1,
            stream: false,
            include_usage: false,
            prefer_merged: None,
            forward: Value::Null,
            images: Vec::new(),
            parse: None,
        };
        // No max_tokens asked: what the prompt leaves.
        let mut r = req(false, 256);
        r.fit_context(100, 128).unwrap();
        assert_eq!(r.sampling.max_tokens, 28);
        // Asked for: kept, or refused when it does not fit.
        let mut r = req(true, 28);
        r.fit_context(100, 128).unwrap();
        assert_eq!(r.sampling.max_tokens, 28);
        assert_eq!(
            refused(req(true, 29).fit_context(100, 128)),
            "prompt_too_long"
        );
        assert_eq!(
            refused(req(false, 256).fit_context(128, 128)),
            "prompt_too_long"
        );
    }
}
