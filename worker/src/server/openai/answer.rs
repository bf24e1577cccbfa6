//! Answers: engine events into OpenAI completion objects, whole or streamed as server-sent
//! events, with each answer's per-adapter metrics (requests, latency, time to first token,
//! inter-token latency, tokens).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::types::Kind;
use crate::engine::api::{EventStream, FinishReason, TokenEvent, Usage};
use crate::router::Decision;
use crate::server::{mole_headers, ApiError, AppState};

/// The `mole` field of answers: how the request was routed and served.
pub(super) fn mole_field(d: &Decision, version: &Option<String>) -> Value {
    json!({"adapter": d.adapter, "adapter_version": version, "mode": d.mode, "route": d.reason, "score": d.score})
}

/// Seconds since the epoch (the `created` field).
pub(super) fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A fresh answer id.
pub(super) fn req_id(prefix: &str) -> String {
    use rand::Rng;
    let n: u64 = rand::rng().random();
    format!("{prefix}-{n:016x}")
}

/// An answer under way: what its events and metrics need.
pub(super) struct Ctx {
    /// The shared state (metrics).
    pub(super) s: Arc<AppState>,
    /// How the request was routed and is served.
    pub(super) d: Decision,
    /// The answer's id.
    pub(super) id: String,
    /// The `model` the answer names.
    pub(super) model: String,
    /// The answer's shape.
    pub(super) kind: Kind,
    /// When the request was submitted.
    pub(super) start: Instant,
    /// `limits.requestTimeoutSeconds` after the start.
    pub(super) deadline: tokio::time::Instant,
    /// When the previous token arrived (inter-token latency).
    pub(super) last_token: Option<Instant>,
    /// The adapter version serving it, known once the engine started it.
    pub(super) version: Option<String>,
    /// A stream ends with a chunk of no choices that carries the usage (OpenAI's
    /// `stream_options.include_usage`).
    pub(super) include_usage: bool,
}

impl Ctx {
    /// The next engine event. Err: the deadline passed (504 `request_timeout`) or the engine
    /// dropped the request (500 `engine_closed`); engine errors come as events.
    async fn next_event(&self, rx: &mut EventStream) -> Result<TokenEvent, ApiError> {
        match tokio::time::timeout_at(self.deadline, rx.recv()).await {
            Err(_) => Err(ApiError::new(
                StatusCode::GATEWAY_TIMEOUT,
                "request_timeout",
                "request exceeded limits.requestTimeoutSeconds",
            )),
            Ok(None) => Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "engine_closed",
                "engine ended the request without an answer",
            )),
            Ok(Some(ev)) => Ok(ev),
        }
    }
    fn on_started(&mut self, version: Option<String>) {
        self.s
            .metrics
            .ttft
            .with_label_values(&[self.adapter_label()])
            .observe(self.start.elapsed().as_secs_f64());
        self.version = version;
    }
    fn on_token(&mut self) {
        let now = Instant::now();
        if let Some(prev) = self.last_token.replace(now) {
            self.s
                .metrics
                .itl
                .with_label_values(&[self.adapter_label()])
                .observe((now - prev).as_secs_f64());
        }
    }
    fn adapter_label(&self) -> &str {
        self.d.adapter.as_deref().unwrap_or("")
    }
    /// Counts an answer that ended here: the request by its status, its latency, its tokens.
    fn record(&self, status: &str, usage: Option<Usage>) {
        let m = &self.s.metrics;
        m.requests
            .with_label_values(&[
                self.kind.endpoint(),
                self.adapter_label(),
                self.d.mode.as_str(),
                self.d.reason.as_str(),
                status,
            ])
            .inc();
        self.record_latency();
        if let Some(u) = usage {
            m.tokens
                .with_label_values(&[self.adapter_label(), "prompt"])
                .inc_by(u.prompt_tokens as u64);
            m.tokens
                .with_label_values(&[self.adapter_label(), "completion"])
                .inc_by(u.completion_tokens as u64);
        }
    }
    /// The request's latency alone: a whole answer that fails returns its error, which the
    /// serving path counts by status and the error layer by code.
    fn record_latency(&self) {
        self.s
            .metrics
            .latency
            .with_label_values(&[self.kind.endpoint(), self.adapter_label()])
            .observe(self.start.elapsed().as_secs_f64());
    }

    /// An answer object, or a chunk of a stream, around one choice.
    fn envelope(&self, chunk: bool, choice: Value) -> Value {
        let object = match (self.kind, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completion, _) => "text_completion",
        };
        json!({"id": self.id, "object": object, "created": now(), "model": self.model, "choices": [choice]})
    }
    fn choice(
        &self,
        text: &str,
        finish: Option<FinishReason>,
        logprobs: Option<Value>,
        chunk: bool,
    ) -> Value {
        let finish = finish.map(|f| match f {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        });
        match (self.kind, chunk) {
            (Kind::Chat, false) => {
                json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish, "logprobs": logprobs})
            }
            (Kind::Chat, true) => {
                json!({"index": 0, "delta": {"content": text}, "finish_reason": finish, "logprobs": logprobs})
            }
            (Kind::Completion, _) => {
                json!({"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs})
            }
        }
    }
    fn mole(&self) -> Value {
        mole_field(&self.d, &self.version)
    }

    /// The events one engine event becomes on a stream, and whether the stream ends there.
    fn stream_events(&mut self, ev: Result<TokenEvent, ApiError>) -> (Vec<Event>, bool) {
        let data = |v: Value| Event::default().data(v.to_string());
        let done = || Event::default().data("[DONE]");
        match ev {
            Err(e) => self.stream_error(e),
            Ok(TokenEvent::Error(e)) => self.stream_error(e.into()),
            Ok(TokenEvent::Started {
                adapter_version, ..
            }) => {
                self.on_started(adapter_version);
                if self.kind != Kind::Chat {
                    return (vec![], false);
                }
                let role = json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null});
                let mut c = self.envelope(true, role);
                c["mole"] = self.mole();
                (vec![data(c)], false)
            }
            Ok(TokenEvent::Token { text, logprob, .. }) => {
                self.on_token();
                if text.is_empty() && logprob.is_none() {
                    return (vec![], false);
                }
                let lp = logprob.map(|l| lp_json(self.kind, &[l]));
                let c = self.envelope(true, self.choice(&text, None, lp, true));
                (vec![data(c)], false)
            }
            Ok(TokenEvent::Finished { reason, usage }) => {
                self.record("200", Some(usage));
                let mut c = self.envelope(true, self.choice("", Some(reason), None, true));
                c["mole"] = self.mole();
                let mut events = vec![data(c)];
                if self.include_usage {
                    // As OpenAI sends it: no choices, the whole request's usage.
                    let mut u = self.envelope(true, Value::Null);
                    u["choices"] = json!([]);
                    u["usage"] = usage_json(&usage);
                    events.push(data(u));
                }
                events.push(done());
                (events, true)
            }
        }
    }

    /// A stream that fails after its headers went out ends with the OpenAI error as an event,
    /// then `[DONE]`.
    fn stream_error(&mut self, e: ApiError) -> (Vec<Event>, bool) {
        self.s.metrics.errors.with_label_values(&[e.code]).inc();
        self.record(e.status.as_str(), None);
        let mut body = e.body();
        body["mole"] = self.mole();
        (
            vec![
                Event::default().data(body.to_string()),
                Event::default().data("[DONE]"),
            ],
            true,
        )
    }
}

/// The `usage` object.
fn usage_json(u: &Usage) -> Value {
    json!({"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens, "total_tokens": u.prompt_tokens + u.completion_tokens})
}

/// The `logprobs` object of a choice, in the chat or the completion shape.
fn lp_json(kind: Kind, lps: &[crate::engine::api::TokenLogprob]) -> Value {
    match kind {
        Kind::Chat => json!({"content": lps.iter().map(|l| json!({
            "token": l.token, "logprob": l.logprob, "bytes": l.token.as_bytes(),
            "top_logprobs": l.top.iter().map(|(_, t, p)| json!({"token": t, "logprob": p, "bytes": t.as_bytes()})).collect::<Vec<_>>()
        })).collect::<Vec<_>>()}),
        Kind::Completion => json!({
            "tokens": lps.iter().map(|l| l.token.clone()).collect::<Vec<_>>(),
            "token_logprobs": lps.iter().map(|l| l.logprob).collect::<Vec<_>>(),
            "top_logprobs": lps.iter().map(|l| l.top.iter().map(|(_, t, p)| (t.clone(), json!(p))).collect::<serde_json::Map<_, _>>()).collect::<Vec<_>>(),
        }),
    }
}

/// Collects an answer whole: the completion object, or the error that ended it.
pub(super) async fn collect_response(
    mut ctx: Ctx,
    mut rx: EventStream,
) -> Result<Response, ApiError> {
    let mut text = String::new();
    let mut lps = Vec::new();
    loop {
        let ev = match ctx.next_event(&mut rx).await {
            Ok(ev) => ev,
            Err(e) => {
                ctx.record_latency();
                return Err(e);
            }
        };
        match ev {
            TokenEvent::Started {
                adapter_version, ..
            } => ctx.on_started(adapter_version),
            TokenEvent::Token {
                text: t, logprob, ..
            } => {
                ctx.on_token();
                text.push_str(&t);
                lps.extend(logprob);
            }
            TokenEvent::Error(e) => {
                ctx.record_latency();
                return Err(ApiError::from(e));
            }
            TokenEvent::Finished { reason, usage } => {
                ctx.record("200", Some(usage));
                let lp = (!lps.is_empty()).then(|| lp_json(ctx.kind, &lps));
                let mut body = ctx.envelope(false, ctx.choice(&text, Some(reason), lp, false));
                body["usage"] = usage_json(&usage);
                body["mole"] = ctx.mole();
                return Ok((mole_headers(&ctx.d), Json(body)).into_response());
            }
        }
    }
}

/// Streams an answer as server-sent events. Dropping the stream (the client went away) drops
/// the receiver, which cancels the request in the engine.
pub(super) fn stream_response(ctx: Ctx, rx: EventStream) -> Response {
    use futures::StreamExt;
    let headers = mole_headers(&ctx.d);
    let st = futures::stream::unfold((ctx, rx, false), |(mut ctx, mut rx, done)| async move {
        if done {
            return None;
        }
        let ev = ctx.next_event(&mut rx).await;
        let (events, done) = ctx.stream_events(ev);
        Some((futures::stream::iter(events), (ctx, rx, done)))
    });
    let st = st.flatten().map(Ok::<_, Infallible>);
    (headers, Sse::new(st).keep_alive(KeepAlive::default())).into_response()
}
