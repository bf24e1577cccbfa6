//! Answers: engine events into OpenAI completion objects, whole or streamed as server-sent
//! events, with each answer's per-adapter metrics (requests, latency, time to first token,
//! inter-token latency, tokens). A request of `n` choices reads its choices' streams as one,
//! each event tagged with its choice's index.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream::{BoxStream, SelectAll};
use futures::StreamExt;
use serde::Serialize;

use super::now;
use super::parse::{join, OutputParser, ParseSpec, Parsed};
use super::reply_bodies::{
    Answer, AssistantMessage, ChatChoice, ChatLogprobs, ChunkChoice, Delta, Finish, FunctionCall,
    MoleInfo, PromptTokensDetails, TextChoice, TextLogprobs, TokenLogprob, ToolCallOut, TopLogprob,
    UsageInfo,
};
use super::request_bodies::Kind;
use super::response_out::{sse, ResponseState};
use crate::router::Decision;
use crate::{mole_headers, ApiError, AppState};
use mole_engine::api::{self, EventStream, FinishReason, TokenEvent, Usage};

/// A fresh answer id.
pub(super) fn req_id(prefix: &str) -> String {
    use rand::Rng;
    let n: u64 = rand::rng().random();
    format!("{prefix}{n:016x}")
}

/// A request's choices' events as one stream, each with its choice's index. Dropping it drops
/// every choice's receiver, which cancels them in the engine.
pub(super) type Choices = SelectAll<BoxStream<'static, (usize, TokenEvent)>>;

/// The choices' streams (choice `i` the `i`-th) read as one.
pub(super) fn choices(streams: Vec<EventStream>) -> Choices {
    futures::stream::select_all(streams.into_iter().enumerate().map(|(i, rx)| {
        futures::stream::unfold(rx, move |mut rx| async move {
            rx.recv().await.map(|ev| ((i, ev), rx))
        })
        .boxed()
    }))
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
    /// Per choice, when its previous token arrived (inter-token latency).
    pub(super) last_token: Vec<Option<Instant>>,
    /// Whether a choice has started (the request's time to first token is taken).
    pub(super) started: bool,
    /// Choices not finished yet.
    pub(super) left: usize,
    /// The finished choices' usage: the prompt's tokens once, every choice's completion.
    pub(super) usage: Usage,
    /// The adapter version serving it, known once the engine started it.
    pub(super) version: Option<String>,
    /// A stream ends with a chunk of no choices that carries the usage (OpenAI's
    /// `stream_options.include_usage`).
    pub(super) include_usage: bool,
    /// How a chat's answers split into reasoning, answer and tool calls (None: all answer).
    pub(super) parse: Option<ParseSpec>,
    /// Each choice's parser of a streamed chat with `parse`.
    pub(super) parsers: Vec<OutputParser>,
    /// What of the answer's JSON schema is not enforced (`mole.unenforced`).
    pub(super) unenforced: Vec<String>,
    /// A Responses API answer being written (its kind is [`Kind::Response`]).
    pub(super) resp: Option<ResponseState>,
}

impl Ctx {
    /// The next engine event. Err: the deadline passed (504 `request_timeout`) or the engine
    /// dropped the request (500 `engine_closed`); engine errors come as events.
    async fn next_event(&self, rx: &mut Choices) -> Result<(usize, TokenEvent), ApiError> {
        match tokio::time::timeout_at(self.deadline, rx.next()).await {
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
    /// A choice started; the first to start is the request's time to first token.
    pub(super) fn on_started(&mut self, version: Option<String>) {
        if std::mem::replace(&mut self.started, true) {
            return;
        }
        self.s
            .metrics
            .ttft
            .with_label_values(&[self.adapter_label()])
            .observe(self.start.elapsed().as_secs_f64());
        self.version = version;
    }
    pub(super) fn on_token(&mut self, choice: usize) {
        let now = Instant::now();
        let Some(last) = self.last_token.get_mut(choice) else {
            return;
        };
        if let Some(prev) = last.replace(now) {
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
    pub(super) fn record(&self, status: &str, usage: Option<Usage>) {
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
    /// Counts choice `i`'s end; true when it was the last.
    pub(super) fn on_finished(&mut self, u: Usage) -> bool {
        self.usage.prompt_tokens = u.prompt_tokens;
        self.usage.completion_tokens += u.completion_tokens;
        // The choices share the prompt; the first computed it, the others reused it.
        self.usage.cached_tokens = self.usage.cached_tokens.max(u.cached_tokens);
        self.left = self.left.saturating_sub(1);
        self.left == 0
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

    /// An answer object, or a chunk of a stream, around `choices`.
    fn answer<C>(&self, object: &'static str, choices: Vec<C>) -> Answer<C> {
        Answer {
            id: self.id.clone(),
            object,
            created: now(),
            model: self.model.clone(),
            choices,
            usage: None,
            mole: None,
        }
    }
    pub(super) fn mole(&self) -> MoleInfo {
        MoleInfo {
            unenforced: self.unenforced.clone(),
            ..MoleInfo::new(&self.d, self.version.clone())
        }
    }
    /// One chunk of a stream, serialized: `text` with its tokens' `lps`, the role on a chat's
    /// first chunk, the finish and `mole` on the last. `choice: false` is the closing usage
    /// chunk (no choices).
    fn chunk(&self, c: Chunk<'_>) -> String {
        fn data<C: Serialize>(mut a: Answer<C>, c: &Chunk<'_>, mole: MoleInfo) -> String {
            a.mole = c.mole.then_some(mole);
            a.usage = c.usage.map(usage_info);
            serde_json::to_string(&a).unwrap_or_default()
        }
        let finish = finish_name(c.finish);
        match self.kind {
            // A response's events are written by its state (`response_events`), never here.
            Kind::Chat | Kind::Response => {
                let choice = ChunkChoice {
                    index: c.index,
                    delta: Delta {
                        role: c.role.then_some("assistant"),
                        content: c.text.to_string(),
                        reasoning: (!c.reasoning.is_empty()).then(|| c.reasoning.to_string()),
                        reasoning_content: (!c.reasoning.is_empty())
                            .then(|| c.reasoning.to_string()),
                        tool_calls: (!c.calls.is_empty()).then(|| c.calls.to_vec()),
                    },
                    finish_reason: match c.tool_calls_made {
                        true => finish.map(|f| if f == "stop" { "tool_calls" } else { f }),
                        false => finish,
                    },
                    logprobs: (!c.lps.is_empty()).then(|| chat_logprobs(c.lps)),
                };
                let choices = if c.choice { vec![choice] } else { vec![] };
                data(
                    self.answer("chat.completion.chunk", choices),
                    &c,
                    self.mole(),
                )
            }
            Kind::Completion => {
                let choice = TextChoice {
                    index: c.index,
                    text: c.text.to_string(),
                    finish_reason: finish,
                    logprobs: (!c.lps.is_empty()).then(|| text_logprobs(c.lps)),
                };
                let choices = if c.choice { vec![choice] } else { vec![] };
                data(self.answer("text_completion", choices), &c, self.mole())
            }
        }
    }
    /// The whole answer: each choice's text, finish and logprobs, in order.
    fn whole(&self, choices: Vec<Whole>, u: &Usage) -> Response {
        let headers = mole_headers(&self.d);
        match self.kind {
            // A response is written by its state (`response_whole`), never here.
            Kind::Chat | Kind::Response => {
                let choices = choices
                    .into_iter()
                    .enumerate()
                    .map(|(index, c)| {
                        let (message, calls) = message(self.parse, c.text);
                        let finish = match (finish_name(c.finish), calls) {
                            (Some("stop"), true) => Some("tool_calls"),
                            (f, _) => f,
                        };
                        ChatChoice {
                            index: index as u32,
                            message,
                            finish_reason: finish,
                            logprobs: (!c.lps.is_empty()).then(|| chat_logprobs(&c.lps)),
                        }
                    })
                    .collect();
                let mut a = self.answer("chat.completion", choices);
                a.usage = Some(usage_info(u));
                a.mole = Some(self.mole());
                (headers, Json(a)).into_response()
            }
            Kind::Completion => {
                let choices = choices
                    .into_iter()
                    .enumerate()
                    .map(|(index, c)| TextChoice {
                        index: index as u32,
                        text: c.text,
                        finish_reason: finish_name(c.finish),
                        logprobs: (!c.lps.is_empty()).then(|| text_logprobs(&c.lps)),
                    })
                    .collect();
                let mut a = self.answer("text_completion", choices);
                a.usage = Some(usage_info(u));
                a.mole = Some(self.mole());
                (headers, Json(a)).into_response()
            }
        }
    }

    /// The events one engine event becomes on a stream, and whether the stream ends there.
    fn stream_events(&mut self, ev: Result<(usize, TokenEvent), ApiError>) -> (Vec<Event>, bool) {
        if self.resp.is_some() {
            return self.response_events(ev);
        }
        let data = |v: String| Event::default().data(v);
        let done = || Event::default().data("[DONE]");
        let (index, ev) = match ev {
            Err(e) => return self.stream_error(e),
            Ok((i, ev)) => (i as u32, ev),
        };
        match ev {
            TokenEvent::Error(e) => self.stream_error(e.into()),
            TokenEvent::Started {
                adapter_version, ..
            } => {
                self.on_started(adapter_version);
                if self.kind != Kind::Chat {
                    return (vec![], false);
                }
                let c = Chunk {
                    index,
                    role: true,
                    mole: true,
                    ..Chunk::default()
                };
                (vec![data(self.chunk(c))], false)
            }
            TokenEvent::Token { text, logprob, .. } => {
                self.on_token(index as usize);
                if text.is_empty() && logprob.is_none() {
                    return (vec![], false);
                }
                let lps: Vec<_> = logprob.into_iter().collect();
                if let Some(p) = self.parsers.get_mut(index as usize) {
                    let parsed = p.push(&text);
                    let events = self.parsed_chunks(index, parsed, &lps);
                    return (events.into_iter().map(data).collect(), false);
                }
                let c = Chunk {
                    index,
                    text: &text,
                    lps: &lps,
                    ..Chunk::default()
                };
                (vec![data(self.chunk(c))], false)
            }
            TokenEvent::Finished { reason, usage } => {
                let mut events = Vec::new();
                let mut tool_calls_made = false;
                if let Some(p) = self.parsers.get_mut(index as usize) {
                    let parsed = p.finish();
                    tool_calls_made = p.calls() > 0;
                    events.extend(self.parsed_chunks(index, parsed, &[]).into_iter().map(data));
                }
                let last = Chunk {
                    index,
                    finish: Some(reason),
                    mole: true,
                    tool_calls_made,
                    ..Chunk::default()
                };
                events.push(data(self.chunk(last)));
                if !self.on_finished(usage) {
                    return (events, false);
                }
                let usage = self.usage;
                self.record("200", Some(usage));
                if self.include_usage {
                    // As OpenAI sends it: no choices, the whole request's usage.
                    let u = Chunk {
                        choice: false,
                        usage: Some(&usage),
                        ..Chunk::default()
                    };
                    events.push(data(self.chunk(u)));
                }
                events.push(done());
                (events, true)
            }
        }
    }

    /// The chunks of what a parser decided: reasoning and answer text (with the token's
    /// logprobs), then each piece of a call as OpenAI streams it: the head with the call's
    /// index, id, type and name and empty arguments, then pieces of its arguments under its
    /// index alone.
    fn parsed_chunks(&self, index: u32, p: Parsed, lps: &[api::TokenLogprob]) -> Vec<String> {
        let mut out = Vec::new();
        if !p.content.is_empty() || !p.reasoning.is_empty() || !lps.is_empty() {
            out.push(self.chunk(Chunk {
                index,
                text: &p.content,
                reasoning: &p.reasoning,
                lps,
                ..Chunk::default()
            }));
        }
        for piece in p.calls {
            let (id, kind, name) = match piece.head {
                Some(h) => (Some(h.id), Some("function"), Some(h.name)),
                None => (None, None, None),
            };
            let call = [ToolCallOut {
                index: Some(piece.index as u32),
                id,
                kind,
                function: FunctionCall {
                    name,
                    arguments: piece.arguments,
                },
            }];
            out.push(self.chunk(Chunk {
                index,
                calls: &call,
                ..Chunk::default()
            }));
        }
        out
    }

    /// A stream that fails after its headers went out ends with the OpenAI error as an event,
    /// then `[DONE]`.
    fn stream_error(&mut self, e: ApiError) -> (Vec<Event>, bool) {
        self.s.metrics.errors.with_label_values(&[e.code]).inc();
        self.record(e.status.as_str(), None);
        let mut body = e.body();
        body["mole"] = serde_json::to_value(self.mole()).unwrap_or_default();
        (
            vec![
                Event::default().data(body.to_string()),
                Event::default().data("[DONE]"),
            ],
            true,
        )
    }
}

/// What one stream chunk carries.
struct Chunk<'a> {
    /// The choice it belongs to.
    index: u32,
    /// Text added.
    text: &'a str,
    /// Its tokens' log probabilities.
    lps: &'a [api::TokenLogprob],
    /// Why generation ended (the last content chunk).
    finish: Option<FinishReason>,
    /// The chat role (the first chunk).
    role: bool,
    /// With `mole` (the first and last content chunks).
    mole: bool,
    /// With a choice (all but the closing usage chunk).
    choice: bool,
    /// The usage (the closing usage chunk).
    usage: Option<&'a Usage>,
    /// Reasoning text added.
    reasoning: &'a str,
    /// Tool-call pieces.
    calls: &'a [ToolCallOut],
    /// The choice made tool calls (a `stop` finish reads `tool_calls`).
    tool_calls_made: bool,
}

impl Default for Chunk<'_> {
    fn default() -> Self {
        Self {
            index: 0,
            text: "",
            lps: &[],
            finish: None,
            role: false,
            mole: false,
            choice: true,
            usage: None,
            reasoning: "",
            calls: &[],
            tool_calls_made: false,
        }
    }
}

/// A whole chat answer's message from its text, split by `spec`; and whether it made tool
/// calls.
fn message(spec: Option<ParseSpec>, text: String) -> (AssistantMessage, bool) {
    let Some(spec) = spec else {
        let m = AssistantMessage {
            role: "assistant",
            content: Some(text),
            reasoning: None,
            reasoning_content: None,
            tool_calls: None,
        };
        return (m, false);
    };
    // The stream's parser, its pieces joined: a whole answer's calls are its stream's.
    let mut p = OutputParser::new(spec);
    let mut all = p.push(&text);
    all.extend(p.finish());
    let calls: Vec<ToolCallOut> = join(std::mem::take(&mut all.calls))
        .into_iter()
        .map(|c| ToolCallOut {
            index: None,
            id: Some(c.id),
            kind: Some("function"),
            function: FunctionCall {
                name: Some(c.name),
                arguments: c.arguments,
            },
        })
        .collect();
    let made = !calls.is_empty();
    let reasoning =
        (spec.reasoning.is_some() && !all.reasoning.is_empty()).then_some(all.reasoning);
    let m = AssistantMessage {
        role: "assistant",
        content: match (made, all.content.is_empty()) {
            (true, true) => None,
            _ => Some(all.content),
        },
        reasoning_content: reasoning.clone(),
        reasoning,
        tool_calls: made.then_some(calls),
    };
    (m, made)
}

/// The wire name of a finish reason.
fn finish_name(f: Option<FinishReason>) -> Finish {
    f.map(|f| match f {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Cancelled => "cancelled",
    })
}

/// The `usage` object.
fn usage_info(u: &Usage) -> UsageInfo {
    UsageInfo {
        prompt_tokens: u.prompt_tokens,
        completion_tokens: u.completion_tokens,
        total_tokens: u.prompt_tokens + u.completion_tokens,
        prompt_tokens_details: PromptTokensDetails {
            cached_tokens: u.cached_tokens,
        },
    }
}

/// A chat choice's `logprobs`.
fn chat_logprobs(lps: &[api::TokenLogprob]) -> ChatLogprobs {
    ChatLogprobs {
        content: lps
            .iter()
            .map(|l| TokenLogprob {
                token: l.token.clone(),
                logprob: l.logprob,
                bytes: l.token.as_bytes().to_vec(),
                top_logprobs: l
                    .top
                    .iter()
                    .map(|(_, t, p)| TopLogprob {
                        token: t.clone(),
                        logprob: *p,
                        bytes: t.as_bytes().to_vec(),
                    })
                    .collect(),
            })
            .collect(),
    }
}

/// A completion choice's `logprobs`.
fn text_logprobs(lps: &[api::TokenLogprob]) -> TextLogprobs {
    TextLogprobs {
        tokens: lps.iter().map(|l| l.token.clone()).collect(),
        token_logprobs: lps.iter().map(|l| l.logprob).collect(),
        top_logprobs: lps
            .iter()
            .map(|l| {
                l.top
                    .iter()
                    .map(|(_, t, p)| (t.clone(), serde_json::json!(p)))
                    .collect()
            })
            .collect(),
    }
}

/// One choice of a whole answer.
#[derive(Default)]
struct Whole {
    text: String,
    finish: Option<FinishReason>,
    lps: Vec<api::TokenLogprob>,
}

/// Collects an answer whole: the completion object once every choice finished, or the error
/// that ended one of them.
pub(super) async fn collect_response(mut ctx: Ctx, mut rx: Choices) -> Result<Response, ApiError> {
    let mut out: Vec<Whole> = (0..ctx.left).map(|_| Whole::default()).collect();
    loop {
        let (i, ev) = match ctx.next_event(&mut rx).await {
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
                ctx.on_token(i);
                // A response is written as it comes, as its stream is: the two are one.
                if let Some(r) = &mut ctx.resp {
                    r.push(&t);
                }
                out[i].text.push_str(&t);
                out[i].lps.extend(logprob);
            }
            TokenEvent::Error(e) => {
                ctx.record_latency();
                return Err(ApiError::from(e));
            }
            TokenEvent::Finished { reason, usage } => {
                out[i].finish = Some(reason);
                if ctx.on_finished(usage) {
                    let usage = ctx.usage;
                    ctx.record("200", Some(usage));
                    if ctx.resp.is_some() {
                        return Ok(ctx.response_whole(reason, &usage));
                    }
                    return Ok(ctx.whole(out, &usage));
                }
            }
        }
    }
}

/// Streams an answer as server-sent events. Dropping the stream (the client went away) drops
/// the receiver, which cancels the request in the engine.
pub(super) fn stream_response(ctx: Ctx, rx: Choices) -> Response {
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

// The Responses API's answers (their state is `response_out.rs`'s).
impl Ctx {
    /// The events one engine event becomes on a response stream, and whether the stream ends
    /// there (see [`ResponseState`]).
    pub(super) fn response_events(
        &mut self,
        ev: Result<(usize, TokenEvent), ApiError>,
    ) -> (Vec<Event>, bool) {
        let mole = self.mole();
        let fail = |ctx: &mut Ctx, e: ApiError| {
            ctx.s.metrics.errors.with_label_values(&[e.code]).inc();
            ctx.record(e.status.as_str(), None);
            let mole = ctx.mole();
            let events = match &mut ctx.resp {
                Some(r) => r.failed(&e, mole),
                None => Vec::new(),
            };
            (events.into_iter().map(sse).collect(), true)
        };
        let ev = match ev {
            Err(e) => return fail(self, e),
            Ok((_, ev)) => ev,
        };
        match ev {
            TokenEvent::Error(e) => fail(self, e.into()),
            TokenEvent::Started {
                adapter_version, ..
            } => {
                self.on_started(adapter_version);
                let mole = self.mole();
                let events = self.resp.as_mut().map(|r| r.started(mole));
                (
                    events.unwrap_or_default().into_iter().map(sse).collect(),
                    false,
                )
            }
            TokenEvent::Token { text, .. } => {
                self.on_token(0);
                let events = self.resp.as_mut().map(|r| r.push(&text));
                (
                    events.unwrap_or_default().into_iter().map(sse).collect(),
                    false,
                )
            }
            TokenEvent::Finished { reason, usage } => {
                self.on_finished(usage);
                let usage = self.usage;
                self.record("200", Some(usage));
                let events = self.resp.as_mut().map(|r| r.finish(reason, &usage, mole).0);
                (
                    events.unwrap_or_default().into_iter().map(sse).collect(),
                    true,
                )
            }
        }
    }

    /// The whole response, once the engine finished it.
    pub(super) fn response_whole(&mut self, reason: FinishReason, usage: &Usage) -> Response {
        let mole = self.mole();
        let headers = mole_headers(&self.d);
        match &mut self.resp {
            Some(r) => {
                let (_, object) = r.finish(reason, usage, mole);
                (headers, Json(object)).into_response()
            }
            None => ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal_error",
                "a response without its state",
            )
            .into_response(),
        }
    }
}
