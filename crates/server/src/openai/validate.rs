//! Validation, the shape of TGI's `validation.rs`: a typed body in, one [`ValidRequest`] out
//! (prompt, sampling within the limits, adapter choice, stream flag), or a stable 4xx. The
//! serving path takes nothing else.

use axum::body::Bytes;
use axum::http::HeaderMap;

use mole_api::WorkerLimits;

use super::body::Fields;
use super::extract::RawBody;
use super::images::{self, ImageSource};
use serde_json::Value;

use super::request_bodies::{
    Arguments, Common, Content, InMessage, Kind, Logprobs, PartType, Role, StopField,
};
use crate::error::bad;
use crate::gateway::Upstream;
use crate::{ApiError, AppState};
use mole_api::request::{
    self, RealField, RequestError, MAX_LOGPROBS, MAX_STOP, MAX_STOP_TOKEN_IDS,
};
use mole_engine::api::{ChatMessage, ContentPart, Prompt, SamplingParams};

/// A generation body that validation turns into a [`ValidRequest`]: chat, completions,
/// responses and `/infer`.
pub(crate) trait Validate:
    Sized + Send + 'static + super::request_bodies::Documented
{
    /// The validated request of `fields` (the body, parsed), or the 4xx that refuses it.
    /// `forward` is the body as sent, kept when this pool may forward it to a merged pod or a
    /// peer.
    fn validate(
        fields: Fields,
        forward: Option<Bytes>,
        s: &AppState,
    ) -> Result<ValidRequest, ApiError>;
}

/// A body parsed and validated ([`Validate::validate`]: the chat template, the prompt's
/// tokens) on a preparation thread ([`crate::prepare`]), not on the runtime that also
/// answers the probes; refused with 429 `prepare_busy` when the stage's queue is full.
pub(super) async fn prepare_request<B: Validate>(
    s: &std::sync::Arc<AppState>,
    body: RawBody,
    deadline: std::time::Instant,
) -> Result<ValidRequest, ApiError> {
    let st = s.clone();
    s.prepare
        .run(deadline, move || {
            let fields = Fields::parse(&body.0)?;
            // The bytes are kept only where they may be forwarded as sent: not held while the
            // request is templated otherwise.
            let forward = may_forward(&st).then_some(body.0);
            super::extract::documented(&st, B::SCHEMA, fields, |f| B::validate(f, forward, &st))
        })
        .await
}

/// Whether this pool may forward a request: an adapter has merged pods, or the pool has peers.
fn may_forward(s: &AppState) -> bool {
    let cfg = s.cfg();
    !cfg.peers.is_empty() || cfg.adapters.iter().any(|a| a.merged_endpoint.is_some())
}

/// One generation request, validated: what chat, completion, responses and `/infer` bodies
/// become, and all the serving path takes. Built once, every bound checked
/// ([`mole_api::request`]), the prompt tokenized, its grammar compiled; nothing changes it
/// afterwards.
pub(crate) struct ValidRequest {
    /// The answer's shape (and the `endpoint` metric label).
    pub(super) kind: Kind,
    /// `model` as asked (empty: the router decides, and answers name the pool).
    pub(super) model: String,
    /// An explicit `adapter` (or the seeds' `expert`), which wins over `model`.
    pub(super) adapter: Option<String>,
    /// The prompt's token ids, tokenized once here (a rendered chat template without BOS
    /// again, a completion's text with the tokenizer's special tokens), each image placeholder
    /// one token that the engine expands with its image.
    pub(super) prompt: Vec<u32>,
    /// What the router reads: the last user message, or the completion's text.
    pub(super) route_text: String,
    /// Sampling, `max_tokens` within `limits.maxTokens` (see [`ValidRequest::fit_context`]).
    pub(super) sampling: SamplingParams,
    /// Choices (OpenAI's `n`), within [`mole_api::request::MAX_N`] and `maxBatchSize`.
    pub(super) n: usize,
    /// Whether the client set `max_tokens` (else the answer may use what the context leaves).
    pub(super) max_tokens_explicit: bool,
    /// Answer as server-sent events.
    pub(super) stream: bool,
    /// End a stream with a usage chunk (`stream_options.include_usage`).
    pub(super) include_usage: bool,
    /// Forward merged adapters to their pods (None: the router's `preferMerged`).
    pub(super) prefer_merged: Option<bool>,
    /// OpenAI's `user`: the session of a canary split when no `x-session-id` header names one.
    pub(super) user: Option<String>,
    /// The body a merged pod or a peer gets (for `/infer`, made a chat completion); None when
    /// this pool forwards nothing.
    pub(super) forward: Option<Bytes>,
    /// The prompt's images, in the order of its placeholders (read by [`images::read_all`]
    /// after validation, before routing).
    pub(super) images: Vec<ImageSource>,
    /// How a chat's answer splits into reasoning, answer and tool calls (None: all answer).
    pub(super) parse: Option<super::parse::ParseSpec>,
    /// What of the answer's JSON schema is not enforced (a schema without `strict`; see
    /// [`mole_engine::grammar::Guide::Json`]), reported with the answer.
    pub(super) unenforced: Vec<String>,
    /// What a Responses API answer repeats of its request (None: another kind of answer).
    pub(super) echo: Option<super::response_out::Echo>,
}

/// The parts of a [`ValidRequest`] each body validates its own way.
pub(super) struct Parts {
    /// The answer's shape.
    pub(super) kind: Kind,
    /// The prompt: rendered chat text, a completion's text or its token ids.
    pub(super) prompt: Prompt,
    /// What the router reads.
    pub(super) route_text: String,
    /// The body a merged pod gets.
    pub(super) forward: Option<Bytes>,
    /// The prompt's images.
    pub(super) images: Vec<ImageSource>,
    /// Never streamed (`/infer`), whatever the body says.
    pub(super) whole: bool,
    /// The sampling fields, checked once by [`sampling`] (their `guide`: the grammar the answer
    /// follows, from structured outputs or a forced tool call).
    pub(super) sampling: SamplingParams,
    /// How a chat's answer splits into reasoning, answer and tool calls.
    pub(super) parse: Option<super::parse::ParseSpec>,
}

impl ValidRequest {
    /// The request of `c`'s fields and a body's `parts` (its sampling checked), the prompt
    /// tokenized once and the grammar compiled (on the calling thread: validation runs on a
    /// preparation thread; the engine finds it compiled), a prompt that cannot fit the context
    /// with its `max_tokens` refused.
    pub(super) fn new(s: &AppState, c: Common, parts: Parts) -> Result<Self, ApiError> {
        let sampling = parts.sampling;
        let mut unenforced = Vec::new();
        if let Some(g) = &sampling.guide {
            // A forced tool call's grammar is built from the tools: held to the guides' limits.
            super::guided::check_size(&g.guide, &s.cfg().limits)?;
            // Compiled here, before routing: a grammar that does not compile is refused before
            // the router or the queue spend anything on it.
            unenforced = s.codec.compile_guide(g)?;
        }
        let prompt = match parts.prompt {
            Prompt::Tokens(ids) => ids,
            text => s.codec.encode(&text)?,
        };
        if prompt.is_empty() {
            return Err(bad("invalid_prompt", "the prompt has no tokens"));
        }
        let req = Self {
            kind: parts.kind,
            max_tokens_explicit: c.max_tokens.is_some() || c.max_completion_tokens.is_some(),
            model: c.model,
            adapter: c.adapter.or(c.expert),
            prompt,
            route_text: parts.route_text,
            sampling,
            n: c.n.unwrap_or(1) as usize,
            stream: c.stream && !parts.whole,
            include_usage: c.stream_options.as_ref().is_some_and(|o| o.include_usage),
            prefer_merged: c.prefer_merged,
            user: c.user,
            forward: parts.forward,
            images: parts.images,
            parse: parts.parse,
            unenforced,
            echo: None,
        };
        // Images only add tokens: a prompt too long without them is too long with them, and
        // is refused before routing.
        req.fit_context(req.prompt.len(), max_seq(s))?;
        Ok(req)
    }

    /// The `max_tokens` of an answer in a context of `max_seq` tokens after `prompt_tokens`:
    /// without an explicit `max_tokens`, what the prompt leaves (as vLLM); a prompt plus
    /// `max_tokens` over it is refused with 400 `prompt_too_long`, before queueing, so an
    /// oversize prompt costs nothing.
    pub(super) fn fit_context(
        &self,
        prompt_tokens: usize,
        max_seq: usize,
    ) -> Result<usize, ApiError> {
        let mut max_tokens = self.sampling.max_tokens;
        if !self.max_tokens_explicit && prompt_tokens < max_seq {
            max_tokens = max_tokens.min(max_seq - prompt_tokens);
        }
        if prompt_tokens + max_tokens > max_seq {
            return Err(bad(
                "prompt_too_long",
                format!(
                    "prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds {max_seq}"
                ),
            ));
        }
        Ok(max_tokens)
    }

    /// What the gateway forwards to merged pods, with the client's `headers` (None: this
    /// request is served here).
    pub(super) fn upstream<'a>(&'a self, headers: &'a HeaderMap) -> Option<Upstream<'a>> {
        Some(Upstream {
            path: self.kind.path(),
            endpoint: self.kind.endpoint(),
            body: self.forward.clone()?,
            headers,
            prefer_merged: self.prefer_merged,
        })
    }
}

/// Refuses a prompt whose text (`bytes` of it: a chat's messages, a completion's prompt) cannot
/// fit the context, before any template renders it or tokenizer reads it (400
/// `prompt_too_long`): over `limits.maxPromptBytes`, or by default over the context's tokens
/// times twice the longest token's bytes (twice: a tokenizer's normalizer may shorten text).
pub(super) fn check_prompt_bytes(s: &AppState, bytes: u64) -> Result<(), ApiError> {
    let set = s.cfg().limits.max_prompt_bytes;
    let max_seq = max_seq(s);
    let limit = match set {
        0 => match s.info.model_info().max_token_bytes {
            0 => return Ok(()),
            per_token => (max_seq as u64).saturating_mul(2 * per_token as u64),
        },
        n => n,
    };
    if bytes > limit {
        return Err(bad(
            "prompt_too_long",
            format!(
                "the prompt's text ({bytes} bytes) cannot fit the context of {max_seq} tokens \
                 (limits.maxPromptBytes: {limit} bytes)"
            ),
        ));
    }
    Ok(())
}

/// The longest sequence a request may take here: `limits.maxSeqLen` within the model's.
pub(super) fn max_seq(s: &AppState) -> usize {
    (s.cfg().limits.engine.max_seq_len as usize).min(s.info.model_info().max_seq_len.max(1))
}

/// The pool's limits a request is held to.
pub(super) struct Caps {
    /// `limits.maxTokens`.
    pub(super) max_tokens: u64,
    /// `limits.maxBatchSize`: the most choices (`n`) one request may take.
    pub(super) max_batch_size: u32,
    /// `limits.maxStopChars`: the longest stop string.
    pub(super) max_stop_chars: u32,
}

impl Caps {
    /// The limits of the config now.
    pub(super) fn of(s: &AppState) -> Self {
        let cfg = s.cfg();
        Self {
            max_tokens: u64::from(cfg.limits.max_tokens),
            max_batch_size: cfg.limits.engine.max_batch_size,
            max_stop_chars: cfg.limits.max_stop_chars,
        }
    }
}

/// A real-valued field checked against its bounds, as the engine's f32.
fn real(v: Option<f64>, default: f32, bounds: &RealField) -> Result<f32, ApiError> {
    match v {
        None => Ok(default),
        Some(v) => {
            bounds.check(v).map_err(refusal)?;
            Ok(v as f32)
        }
    }
}

/// A bound's refusal as the 400 it answers.
pub(super) fn refusal(e: RequestError) -> ApiError {
    bad(e.code, e.message)
}

/// The sampling fields, checked against [`mole_api::request`]'s bounds, each refusal with its
/// own code; `max_tokens` defaults to 256 and must be within `caps.max_tokens`. `logprobs` is
/// a bool in chat, a count in completions.
pub(super) fn sampling(c: &Common, chat: bool, caps: &Caps) -> Result<SamplingParams, ApiError> {
    let cap = caps.max_tokens;
    // Each one sent is checked, also the max_tokens that max_completion_tokens overrides.
    for (field, v) in [
        ("max_tokens", c.max_tokens),
        ("max_completion_tokens", c.max_completion_tokens),
    ] {
        if let Some(mt) = v.filter(|&mt| mt == 0 || mt > cap) {
            return Err(bad(
                "max_tokens_exceeded",
                format!("{field} must be between 1 and {cap}, got {mt}"),
            ));
        }
    }
    let mt = c
        .max_completion_tokens
        .or(c.max_tokens)
        .unwrap_or(cap.min(256));
    request::check_n(c.n.unwrap_or(1), caps.max_batch_size).map_err(refusal)?;
    let temperature = real(c.temperature, 1.0, &request::TEMPERATURE)?;
    let top_p = real(c.top_p, 1.0, &request::TOP_P)?;
    let min_p = real(c.min_p, 0.0, &request::MIN_P)?;
    let presence_penalty = real(c.presence_penalty, 0.0, &request::PRESENCE_PENALTY)?;
    let frequency_penalty = real(c.frequency_penalty, 0.0, &request::FREQUENCY_PENALTY)?;
    let repetition_penalty = real(c.repetition_penalty, 1.0, &request::REPETITION_PENALTY)?;
    // OpenAI's and vLLM's bounds: at most MAX_LOGPROBS alternatives, and top_logprobs only
    // beside `logprobs: true`.
    let logprobs = match (c.logprobs, chat) {
        (None, _) | (Some(Logprobs::Switch(false)), true) => None,
        (Some(Logprobs::Switch(true)), true) => Some(c.top_logprobs.unwrap_or(0)),
        (Some(Logprobs::Count(n)), false) if n as usize <= MAX_LOGPROBS => Some(n as usize),
        (Some(Logprobs::Count(_)), false) => {
            return Err(bad(
                "invalid_logprobs",
                format!("logprobs must be an integer between 0 and {MAX_LOGPROBS}"),
            ))
        }
        (Some(Logprobs::Count(_)), true) => {
            return Err(bad("invalid_logprobs", "chat's logprobs is a boolean"))
        }
        (Some(Logprobs::Switch(_)), false) => {
            return Err(bad(
                "invalid_logprobs",
                "completions' logprobs is a count of alternatives",
            ))
        }
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
    if stop.len() > MAX_STOP || stop.iter().any(String::is_empty) {
        return Err(bad(
            "invalid_stop",
            format!("stop: at most {MAX_STOP} non-empty strings"),
        ));
    }
    // Every generated token of the batch is matched against them on the engine thread (in
    // its own bytes, but each string's table is held for the answer's life).
    let max = caps.max_stop_chars as usize;
    if let Some(long) = stop
        .iter()
        .find(|s| s.len() > max && s.chars().count() > max)
    {
        return Err(bad(
            "stop_too_long",
            format!(
                "a stop string of {} characters is over limits.maxStopChars ({max})",
                long.chars().count(),
            ),
        ));
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
    if c.cache_salt.as_deref() == Some("") {
        return Err(bad(
            "invalid_cache_salt",
            "cache_salt must be a non-empty string when given",
        ));
    }
    let mut stop_token_ids = c.stop_token_ids.clone();
    stop_token_ids.sort_unstable();
    stop_token_ids.dedup();
    let sp = SamplingParams {
        temperature,
        top_p,
        top_k: c.top_k.unwrap_or(0),
        min_p,
        repetition_penalty,
        presence_penalty,
        frequency_penalty,
        seed: c.seed,
        max_tokens: mt as usize,
        stop,
        stop_token_ids,
        logprobs,
        ignore_eos: c.ignore_eos,
        guide: None,
        cache_salt: c.cache_salt.clone(),
        // Set when the request is served: the tenant is the caller's, not the body's.
        cache_tenant: None,
    };
    // What the engine asserts is what was checked here.
    debug_assert!(mole_engine::host_sampler::validate(&sp).is_ok());
    Ok(sp)
}

/// Chat messages: text and image parts, and the fields templates read beside them (an
/// assistant turn's `tool_calls`, their `arguments` parsed into objects as vLLM hands them to
/// templates; a tool result's `tool_call_id` and `name`; a reasoning turn's
/// `reasoning_content`); and the images in the order their parts name them (at most
/// `limits.maxImages`). Without `takes_images` (a text model) an image part is refused as
/// soon as it is seen, before it is decoded or fetched.
pub(super) fn messages(
    msgs: Vec<InMessage>,
    limits: &WorkerLimits,
    takes_images: bool,
) -> Result<(Vec<ChatMessage>, Vec<ImageSource>), ApiError> {
    if msgs.is_empty() {
        return Err(bad("empty_messages", "messages must not be empty"));
    }
    let mut out = Vec::with_capacity(msgs.len());
    let mut images = Vec::new();
    for (i, m) in msgs.into_iter().enumerate() {
        let mut msg = ChatMessage::text(m.role.template_role(), "");
        match m.content {
            // An assistant turn may carry only its tool calls; every other role says something.
            None if m.role != Role::Assistant => {
                return Err(bad(
                    "missing_content",
                    format!("messages[{i}].content is required for role {}", msg.role),
                ))
            }
            None => {}
            Some(Content::Text(t)) => msg.content = t,
            Some(Content::Parts(ps)) => {
                for (j, p) in ps.into_iter().enumerate() {
                    let field = || format!("messages[{i}].content[{j}].image_url");
                    match (p.kind, p.image_url) {
                        (PartType::Text, _) => {
                            let t = p.text.unwrap_or_default();
                            msg.content.push_str(&t);
                            msg.parts.push(ContentPart::Text(t));
                        }
                        (PartType::Image, Some(_)) if !takes_images => {
                            return Err(mole_engine::api::EngineError::ImagesNotSupported.into())
                        }
                        (PartType::Image, Some(u)) => {
                            images.push(images::source(u.url(), &field(), limits)?);
                            images::check_count(images.len(), limits)?;
                            msg.parts.push(ContentPart::Image);
                        }
                        (PartType::Image, None) => {
                            return Err(bad(
                                "invalid_content_part",
                                format!("messages[{i}].content[{j}] has no image_url"),
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
        if let Some(calls) = m.tool_calls {
            let calls = calls
                .into_iter()
                .map(|c| tool_call(c, i))
                .collect::<Result<Vec<_>, _>>()?;
            msg.extra.insert("tool_calls".into(), Value::Array(calls));
        }
        for (k, v) in [
            ("tool_call_id", m.tool_call_id),
            ("name", m.name),
            ("reasoning_content", m.reasoning_content.or(m.reasoning)),
        ] {
            if let Some(v) = v {
                msg.extra.insert(k.into(), Value::String(v));
            }
        }
        out.push(msg);
    }
    Ok((out, images))
}

/// A tool call of the history as a template reads it: `{"id", "type": "function", "function":
/// {"name", "arguments": {...}}}`, the arguments an object (400 `invalid_tool_calls` when their
/// text is not JSON).
pub(super) fn tool_call(c: super::request_bodies::InToolCall, i: usize) -> Result<Value, ApiError> {
    tool_call_value(c.id, c.function.name, c.function.arguments).map_err(|e| {
        bad(
            "invalid_tool_calls",
            format!("messages[{i}].tool_calls: {e}"),
        )
    })
}

/// A call as a template reads it (see [`tool_call`]), or why its arguments are not JSON.
pub(super) fn tool_call_value(
    id: Option<String>,
    name: String,
    arguments: Arguments,
) -> Result<Value, String> {
    let arguments = match arguments {
        Arguments::Object(o) => Value::Object(o),
        Arguments::Text(a) => {
            serde_json::from_str(&a).map_err(|e| format!("arguments are not JSON: {e}"))?
        }
    };
    let mut out = serde_json::Map::new();
    if let Some(id) = id {
        out.insert("id".into(), Value::String(id));
    }
    out.insert("type".into(), Value::from("function"));
    out.insert(
        "function".into(),
        serde_json::json!({"name": name, "arguments": arguments}),
    );
    Ok(Value::Object(out))
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
    fn caps(max_tokens: u64) -> Caps {
        Caps {
            max_tokens,
            max_batch_size: 128,
            max_stop_chars: 8,
        }
    }

    #[test]
    fn sampling_defaults_and_bounds() {
        for n in [0, 129] {
            let e = sampling(&common(json!({"n": n})), true, &caps(64)).unwrap_err();
            assert_eq!((e.status.as_u16(), e.code), (400, "invalid_n"));
        }
        for n in [1, 2, 128] {
            assert!(sampling(&common(json!({"n": n})), true, &caps(64)).is_ok());
        }
        let sp = sampling(&common(json!({})), true, &caps(64)).unwrap();
        assert_eq!((sp.max_tokens, sp.temperature, sp.top_p), (64, 1.0, 1.0));
        assert_eq!(
            sampling(&common(json!({})), true, &caps(4096))
                .unwrap()
                .max_tokens,
            256
        );
        let sp = sampling(
            &common(json!({"max_completion_tokens": 3, "max_tokens": 9})),
            true,
            &caps(64),
        );
        assert_eq!(sp.unwrap().max_tokens, 3);
        for (body, code) in [
            (json!({"max_tokens": 0}), "max_tokens_exceeded"),
            (json!({"max_tokens": 65}), "max_tokens_exceeded"),
            (
                json!({"max_tokens": 0, "max_completion_tokens": 5}),
                "max_tokens_exceeded",
            ),
            (json!({"temperature": 2.5}), "invalid_temperature"),
            (json!({"top_p": 0.0}), "invalid_top_p"),
            (json!({"stop": ["a", "b", "c", "d", "e"]}), "invalid_stop"),
            (json!({"stop": ""}), "invalid_stop"),
            (json!({"stop": ["ok", "123456789"]}), "stop_too_long"),
            (json!({"logprobs": 2}), "invalid_logprobs"),
            (json!({"min_p": 1.5}), "invalid_min_p"),
            (
                json!({"presence_penalty": -2.5}),
                "invalid_presence_penalty",
            ),
            (
                json!({"frequency_penalty": 2.5}),
                "invalid_frequency_penalty",
            ),
            (
                json!({"repetition_penalty": 0.0}),
                "invalid_repetition_penalty",
            ),
            (
                json!({"repetition_penalty": 1e39}),
                "invalid_repetition_penalty",
            ),
        ] {
            assert_eq!(
                refused(sampling(&common(body.clone()), true, &caps(64))),
                code,
                "{body}"
            );
        }
        // logprobs: a bool in chat with at most 20 top_logprobs beside it, a count (at most
        // 20) in completions.
        let c = common(json!({"logprobs": true, "top_logprobs": 20}));
        assert_eq!(sampling(&c, true, &caps(64)).unwrap().logprobs, Some(20));
        assert_eq!(refused(sampling(&c, false, &caps(64))), "invalid_logprobs");
        for (body, chat) in [
            (json!({"logprobs": true, "top_logprobs": 21}), true),
            (json!({"top_logprobs": 1}), true),
            (json!({"logprobs": false, "top_logprobs": 1}), true),
            (json!({"logprobs": 2, "top_logprobs": 1}), false),
        ] {
            assert_eq!(
                refused(sampling(&common(body.clone()), chat, &caps(64))),
                "invalid_top_logprobs",
                "{body}"
            );
        }
        assert_eq!(
            refused(sampling(&common(json!({"logprobs": 21})), false, &caps(64))),
            "invalid_logprobs"
        );
        let c = common(json!({"logprobs": 3, "stop": "x"}));
        let sp = sampling(&c, false, &caps(64)).unwrap();
        assert_eq!((sp.logprobs, sp.stop), (Some(3), vec!["x".to_string()]));
    }

    #[test]
    fn messages_roles_and_parts() {
        let limits = WorkerLimits {
            max_images: 2,
            ..Default::default()
        };
        let m = |v: Value| messages(serde_json::from_value(v).unwrap(), &limits, true);
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
        // Roles and part types are typed: the body's parse refuses others with their codes.
        let parsed = |v: Value| {
            Fields::parse(json!({"messages": v}).to_string().as_bytes())
                .unwrap()
                .take::<super::super::request_bodies::ChatOwn>()
        };
        assert_eq!(
            refused(parsed(json!([{"role": "wizard", "content": "x"}]))),
            "invalid_role"
        );
        let part = |t: &str| json!([{"role": "user", "content": [{"type": t}]}]);
        assert_eq!(refused(m(part("image_url"))), "invalid_content_part");
        assert_eq!(refused(parsed(part("audio"))), "invalid_content_part");
        // The history's tool calls reach the template with their arguments as objects.
        let (ok, _) = m(json!([
            {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
            {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "2"},
        ]))
        .unwrap();
        assert_eq!(
            ok[0].extra["tool_calls"],
            json!([{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}])
        );
        assert_eq!(ok[1].extra["tool_call_id"], "c1");
        let bad_args = json!([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]);
        assert_eq!(refused(m(bad_args)), "invalid_tool_calls");
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
        // A text model: refused at the part, unread.
        let text_only = messages(
            serde_json::from_value(json!([{"role": "user", "content": [img("%%")]}])).unwrap(),
            &limits,
            false,
        );
        assert_eq!(refused(text_only), "images_not_supported");
    }

    #[test]
    fn the_context_limit_trims_or_refuses() {
        let req = |explicit: bool, max_tokens: usize| ValidRequest {
            kind: Kind::Chat,
            model: String::new(),
            adapter: None,
            prompt: vec![1],
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
            user: None,
            forward: None,
            images: Vec::new(),
            parse: None,
            unenforced: Vec::new(),
            echo: None,
        };
        // No max_tokens asked: what the prompt leaves.
        assert_eq!(req(false, 256).fit_context(100, 128).unwrap(), 28);
        // Asked for: kept, or refused when it does not fit.
        assert_eq!(req(true, 28).fit_context(100, 128).unwrap(), 28);
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
