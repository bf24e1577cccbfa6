//! Answers: engine events into OpenAI completion objects, whole or streamed as SSE.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::types::Kind;
use crate::engine::api::{FinishReason, TokenEvent, Usage};
use crate::router::Decision;
use crate::server::{mole_headers, ApiError, AppState};

pub(super) fn mole_field(d: &Decision, version: &Option<String>) -> Value {
    json!({"adapter": d.adapter, "adapter_version": version, "mode": d.mode, "route": d.reason, "score": d.score})
}

pub(super) fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

pub(super) fn req_id(prefix: &str) -> String {
    use rand::Rng;
    let n: u64 = rand::rng().random();
    format!("{prefix}-{n:016x}")
}

pub(super) struct Ctx {
    pub(super) s: Arc<AppState>,
    pub(super) d: Decision,
    pub(super) id: String,
    pub(super) model: String,
    pub(super) kind: Kind,
    pub(super) start: Instant,
    pub(super) deadline: tokio::time::Instant,
    /// When the previous token arrived (inter-token latency).
    pub(super) last_token: Option<Instant>,
}

impl Ctx {
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
        m.latency
            .with_label_values(&[self.kind.endpoint(), self.adapter_label()])
            .observe(self.start.elapsed().as_secs_f64());
        if let Some(u) = usage {
            m.tokens
                .with_label_values(&[self.adapter_label(), "prompt"])
                .inc_by(u.prompt_tokens as u64);
            m.tokens
                .with_label_values(&[self.adapter_label(), "completion"])
                .inc_by(u.completion_tokens as u64);
        }
    }
    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completion, _) => "text_completion",
        }
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
}

fn usage_json(u: &Usage) -> Value {
    json!({"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens, "total_tokens": u.prompt_tokens + u.completion_tokens})
}

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

pub(super) async fn collect_response(
    mut ctx: Ctx,
    mut rx: crate::engine::api::EventStream,
) -> Result<Response, ApiError> {
    let mut text = String::new();
    let mut lps = Vec::new();
    let mut version = None;
    loop {
        let ev = match tokio::time::timeout_at(ctx.deadline, rx.recv()).await {
            Err(_) => {
                ctx.record("504", None);
                return Err(ApiError::new(
                    StatusCode::GATEWAY_TIMEOUT,
                    "request_timeout",
                    "request exceeded limits.requestTimeoutSeconds",
                ));
            }
            Ok(None) => {
                ctx.record("500", None);
                return Err(ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "engine_closed",
                    "engine ended the request without an answer",
                ));
            }
            Ok(Some(ev)) => ev,
        };
        match ev {
            TokenEvent::Started {
                adapter_version, ..
            } => {
                version = adapter_version;
                ctx.s
                    .metrics
                    .ttft
                    .with_label_values(&[ctx.adapter_label()])
                    .observe(ctx.start.elapsed().as_secs_f64());
            }
            TokenEvent::Token {
                text: t, logprob, ..
            } => {
                ctx.on_token();
                text.push_str(&t);
                lps.extend(logprob);
            }
            TokenEvent::Error(e) => {
                let e = ApiError::from(e);
                ctx.s.metrics.errors.with_label_values(&[e.code]).inc();
                ctx.record(e.status.as_str(), None);
                return Err(e);
            }
            TokenEvent::Finished { reason, usage } => {
                ctx.record("200", Some(usage));
                let lp = (!lps.is_empty()).then(|| lp_json(ctx.kind, &lps));
                let body = json!({
                    "id": ctx.id, "object": ctx.object(false), "created": now(), "model": ctx.model,
                    "choices": [ctx.choice(&text, Some(reason), lp, false)],
                    "usage": usage_json(&usage),
                    "mole": mole_field(&ctx.d, &version),
                });
                return Ok((mole_headers(&ctx.d), Json(body)).into_response());
            }
        }
    }
}

pub(super) fn stream_response(ctx: Ctx, rx: crate::engine::api::EventStream) -> Response {
    let headers = mole_headers(&ctx.d);
    // State: (ctx, receiver, finished). Dropping the stream (client gone) drops the receiver,
    // which cancels the request in the engine.
    let st = futures::stream::unfold(
        (ctx, rx, false, None::<String>),
        |(mut ctx, mut rx, done, mut version)| async move {
            if done {
                return None;
            }
            let ev = match tokio::time::timeout_at(ctx.deadline, rx.recv()).await {
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
                Ok(Some(TokenEvent::Error(e))) => Err(ApiError::from(e)),
                Ok(Some(ev)) => Ok(ev),
            };
            let events: Vec<Event> = match ev {
                Err(e) => {
                    ctx.s.metrics.errors.with_label_values(&[e.code]).inc();
                    ctx.record(e.status.as_str(), None);
                    let mut body = e.body();
                    body["mole"] = mole_field(&ctx.d, &version);
                    return Some((
                        futures::stream::iter(vec![
                            Event::default().data(body.to_string()),
                            Event::default().data("[DONE]"),
                        ]),
                        (ctx, rx, true, version),
                    ));
                }
                Ok(TokenEvent::Started {
                    adapter_version, ..
                }) => {
                    ctx.s
                        .metrics
                        .ttft
                        .with_label_values(&[ctx.adapter_label()])
                        .observe(ctx.start.elapsed().as_secs_f64());
                    version = adapter_version;
                    if ctx.kind == Kind::Chat {
                        let c = json!({"id": ctx.id, "object": ctx.object(true), "created": now(), "model": ctx.model,
                        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}],
                        "mole": mole_field(&ctx.d, &version)});
                        vec![Event::default().data(c.to_string())]
                    } else {
                        vec![]
                    }
                }
                Ok(TokenEvent::Token { text, logprob, .. }) => {
                    ctx.on_token();
                    if text.is_empty() && logprob.is_none() {
                        vec![]
                    } else {
                        let lp = logprob.map(|l| lp_json(ctx.kind, &[l]));
                        let c = json!({"id": ctx.id, "object": ctx.object(true), "created": now(), "model": ctx.model,
                        "choices": [ctx.choice(&text, None, lp, true)]});
                        vec![Event::default().data(c.to_string())]
                    }
                }
                Ok(TokenEvent::Finished { reason, usage }) => {
                    ctx.record("200", Some(usage));
                    let c = json!({"id": ctx.id, "object": ctx.object(true), "created": now(), "model": ctx.model,
                    "choices": [ctx.choice("", Some(reason), None, true)],
                    "usage": usage_json(&usage), "mole": mole_field(&ctx.d, &version)});
                    return Some((
                        futures::stream::iter(vec![
                            Event::default().data(c.to_string()),
                            Event::default().data("[DONE]"),
                        ]),
                        (ctx, rx, true, version),
                    ));
                }
                Ok(TokenEvent::Error(_)) => unreachable!("mapped above"),
            };
            Some((futures::stream::iter(events), (ctx, rx, false, version)))
        },
    );
    use futures::StreamExt;
    let st = st.flatten().map(Ok::<_, Infallible>);
    (headers, Sse::new(st).keep_alive(KeepAlive::default())).into_response()
}
