//! Handlers of the OpenAI-compatible and mole endpoints.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::{ApiError, AppState};
use crate::engine::api::{
    ChatMessage, FinishReason, GenerateRequest, Prompt, SamplingParams, TokenEvent, Usage,
};
use crate::router::{self, Decision, Mode, RouteInput};

type S = State<Arc<AppState>>;

fn bad(code: &'static str, msg: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, code, msg)
}

/// Reads a JSON body, turning every failure into a stable 4xx.
fn parse_body<T: serde::de::DeserializeOwned>(
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

#[derive(Deserialize)]
#[serde(untagged)]
enum StopField {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize)]
struct Part {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
}

#[derive(Deserialize)]
struct InMessage {
    role: String,
    #[serde(default)]
    content: Option<Content>,
}

/// Sampling fields shared by chat and completions.
#[derive(Deserialize, Default)]
struct Common {
    #[serde(default)]
    model: String,
    #[serde(default)]
    adapter: Option<String>,
    #[serde(default)]
    expert: Option<String>,
    #[serde(default)]
    stream: bool,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<usize>,
    min_p: Option<f32>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    repetition_penalty: Option<f32>,
    seed: Option<u64>,
    stop: Option<StopField>,
    /// Chat: bool; completions: an integer count. Kept raw and read per endpoint.
    logprobs: Option<Value>,
    top_logprobs: Option<usize>,
    #[serde(default)]
    ignore_eos: bool,
    /// vLLM extension: token ids that end generation besides EOS.
    #[serde(default)]
    stop_token_ids: Vec<u32>,
    /// mole extension: forward merged adapters to their pods (default: the router setting).
    #[serde(default)]
    prefer_merged: Option<bool>,
}

#[derive(Deserialize)]
struct ChatBody {
    messages: Vec<InMessage>,
    /// Extra chat-template variables (vLLM's field), e.g. `{"enable_thinking": false}`.
    #[serde(default)]
    chat_template_kwargs: serde_json::Map<String, Value>,
    #[serde(flatten)]
    common: Common,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum PromptField {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
}

#[derive(Deserialize)]
struct CompletionBody {
    prompt: PromptField,
    #[serde(flatten)]
    common: Common,
}

fn sampling(s: &AppState, c: &Common, chat: bool) -> Result<SamplingParams, ApiError> {
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

fn messages(msgs: Vec<InMessage>) -> Result<Vec<ChatMessage>, ApiError> {
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

fn decide(s: &AppState, c: &Common, text: &str) -> Result<Decision, ApiError> {
    let cfg = s.cfg();
    let engine = s.engine.clone();
    // The classifier runs one forward pass: tell the runtime this worker thread blocks so
    // other requests move to another thread meanwhile.
    let scorer = move |cls: &str, p: &str, labels: &[String]| {
        let run = || engine.score_labels(Some(cls), p, labels).ok();
        match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
            Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(run),
            _ => run(),
        }
    };
    // The request text is encoded each time; adapter descriptions and examples come from the
    // embedder's cache. Without a configured model the strategy falls through.
    let emb = s.embedder.get().cloned();
    let embedder = move |texts: &[String]| -> Option<Vec<Vec<f32>>> {
        let e = emb.as_ref()?;
        let run = || {
            let q = e.encode(&texts[..1]).ok()?;
            let rest = e.encode_cached(&texts[1..]).ok()?;
            Some(
                q.into_iter()
                    .chain(rest.iter().map(|v| v.to_vec()))
                    .collect(),
            )
        };
        match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
            Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(run),
            _ => run(),
        }
    };
    let input = RouteInput {
        model: &c.model,
        adapter: c.adapter.as_deref().or(c.expert.as_deref()),
        text,
    };
    let d = match router::decide(&cfg, &input, &scorer, &embedder) {
        // Adapters loaded through /v1/load_lora_adapter are not in the config but are
        // servable by explicit name, as in vLLM.
        Err(router::RouteError::UnknownModel(n))
            if s.engine.adapters().iter().any(|a| a.name == n && a.loaded) =>
        {
            Ok(Decision {
                adapter: Some(n),
                reason: "explicit".into(),
                score: None,
                mode: Mode::Dynamic,
            })
        }
        r => r,
    }
    .map_err(|e| {
        let status = match e {
            router::RouteError::UnknownModel(_) => StatusCode::NOT_FOUND,
            router::RouteError::NoRoute => StatusCode::UNPROCESSABLE_ENTITY,
        };
        ApiError::new(status, e.code(), e.to_string())
    })?;
    s.metrics
        .routes
        .with_label_values(&[d.reason.as_str(), d.adapter.as_deref().unwrap_or("")])
        .inc();
    if let Some(score) = d.score {
        s.metrics
            .route_confidence
            .with_label_values(&[d.reason.as_str()])
            .observe(score);
    }
    Ok(d)
}

fn mole_headers(d: &Decision) -> HeaderMap {
    let mut h = HeaderMap::new();
    let v = |s: &str| HeaderValue::from_str(s).unwrap_or(HeaderValue::from_static("?"));
    h.insert("x-mole-adapter", v(d.adapter.as_deref().unwrap_or("")));
    h.insert("x-mole-mode", v(d.mode.as_str()));
    h.insert("x-mole-route", v(&d.reason));
    h
}

fn mole_field(d: &Decision, version: &Option<String>) -> Value {
    json!({"adapter": d.adapter, "adapter_version": version, "mode": d.mode, "route": d.reason, "score": d.score})
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn req_id(prefix: &str) -> String {
    use rand::Rng;
    let n: u64 = rand::rng().random();
    format!("{prefix}-{n:016x}")
}

/// Which OpenAI object shape to answer with.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Chat,
    Completion,
}

#[allow(clippy::too_many_arguments)]
/// Common entry: readiness, auth, routing, gateway, limits, submit, answer.
async fn serve(
    s: Arc<AppState>,
    headers: HeaderMap,
    kind: Kind,
    raw: Value,
    common: Common,
    prompt: Prompt,
    route_text: String,
    sampling: SamplingParams,
) -> Result<Response, ApiError> {
    let endpoint = if kind == Kind::Chat {
        "chat"
    } else {
        "completions"
    };
    if !s.accepting() {
        let mut e = ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "not_ready",
            format!(
                "worker is not ready: {}",
                s.readiness().err().unwrap_or_default()
            ),
        );
        e.retry_after = Some(1);
        return Err(e);
    }
    let d = decide(&s, &common, &route_text)?;
    let (adapter, mode, reason) = (d.adapter.clone(), d.mode, d.reason.clone());
    let r = serve_routed(
        s.clone(),
        headers,
        kind,
        endpoint,
        raw,
        common,
        prompt,
        sampling,
        d,
    )
    .await;
    // Refusals after routing (429, prompt too long, merged pods down) count per adapter too;
    // answers count when they end (status of the stream's end).
    if let Err(e) = &r {
        s.metrics
            .requests
            .with_label_values(&[
                endpoint,
                adapter.as_deref().unwrap_or(""),
                mode.as_str(),
                &reason,
                e.status.as_str(),
            ])
            .inc();
    }
    r
}

#[allow(clippy::too_many_arguments)]
async fn serve_routed(
    s: Arc<AppState>,
    headers: HeaderMap,
    kind: Kind,
    endpoint: &'static str,
    raw: Value,
    common: Common,
    prompt: Prompt,
    mut sampling: SamplingParams,
    mut d: Decision,
) -> Result<Response, ApiError> {
    let cfg = s.cfg();
    // Gateway: a merged adapter is served by its own pods when asked to.
    if let Some(name) = &d.adapter {
        let a = cfg.adapters.iter().find(|a| &a.name == name);
        if let Some(ep) = a
            .and_then(|a| a.merged_endpoint.clone())
            .filter(|_| common.prefer_merged.unwrap_or(cfg.router.prefer_merged))
            .filter(|_| d.mode == Mode::Merged)
        {
            let path = if kind == Kind::Chat {
                "/v1/chat/completions"
            } else {
                "/v1/completions"
            };
            match proxy(&s, &ep, path, &raw, &headers, &d, endpoint).await {
                Ok(r) => {
                    s.metrics
                        .proxy
                        .with_label_values(&[name.as_str(), "ok"])
                        .inc();
                    return Ok(r);
                }
                Err(reason) => {
                    s.metrics
                        .proxy
                        .with_label_values(&[name.as_str(), "failed"])
                        .inc();
                    let local = s
                        .engine
                        .adapters()
                        .iter()
                        .any(|x| &x.name == name && x.loaded);
                    if !(cfg.router.fallback_to_dynamic && local) {
                        let mut e = ApiError::new(
                            StatusCode::SERVICE_UNAVAILABLE,
                            "merged_unavailable",
                            format!("merged pods of {name} unavailable ({reason}) and no local fallback"),
                        );
                        e.retry_after = Some(5);
                        return Err(e);
                    }
                    tracing::warn!(adapter = %name, %reason, "merged pods unavailable, serving locally");
                }
            }
        }
    }
    // Prompt length limit, checked before queueing so an oversize prompt costs nothing.
    let ptoks = match &prompt {
        Prompt::Text(t) | Prompt::Templated(t) => s.engine.count_tokens(t)?,
        Prompt::Tokens(t) => t.len(),
    };
    let max_seq = (cfg.limits.max_seq_len as usize).min(s.engine.model_info().max_seq_len.max(1));
    // Without an explicit max_tokens the answer may use what the context leaves (as vLLM).
    let explicit = common.max_tokens.is_some() || common.max_completion_tokens.is_some();
    if !explicit && ptoks < max_seq {
        sampling.max_tokens = sampling.max_tokens.min(max_seq - ptoks);
    }
    if ptoks + sampling.max_tokens > max_seq {
        return Err(bad(
            "prompt_too_long",
            format!(
                "prompt ({ptoks} tokens) + max_tokens ({}) exceeds {max_seq}",
                sampling.max_tokens
            ),
        ));
    }
    let id = req_id(if kind == Kind::Chat {
        "chatcmpl"
    } else {
        "cmpl"
    });
    // A merged adapter served here: by this process's own merged model when it has one (local
    // mode), else dynamically, and the answer says so.
    let mut engine = s.engine.clone();
    if d.mode == Mode::Merged && cfg.merged.is_none() {
        // Only while it holds the configured version: after a config change it is stale and
        // the new version is served dynamically (a restart merges it).
        let local = d.adapter.as_ref().and_then(|n| {
            let want = &cfg.adapters.iter().find(|a| &a.name == n)?.version;
            let e = s.local_merged.read().ok()?.get(n).cloned()?;
            e.adapters()
                .iter()
                .any(|a| &a.name == n && &a.version == want)
                .then_some(e)
        });
        match local {
            Some(e) => engine = e,
            None => d.mode = Mode::Dynamic,
        }
    }
    let rx = engine.submit(GenerateRequest {
        id: id.clone(),
        prompt,
        adapter: d.adapter.clone(),
        sampling: sampling.clone(),
    })?;
    let timeout = Duration::from_secs(cfg.limits.request_timeout_seconds);
    let model = if common.model.is_empty() {
        cfg.pool.clone()
    } else {
        common.model.clone()
    };
    let ctx = Ctx {
        s: s.clone(),
        d,
        id,
        model,
        kind,
        endpoint,
        start: Instant::now(),
        deadline: tokio::time::Instant::now() + timeout,
        last_token: None,
    };
    if common.stream {
        Ok(stream_response(ctx, rx))
    } else {
        collect_response(ctx, rx).await
    }
}

struct Ctx {
    s: Arc<AppState>,
    d: Decision,
    id: String,
    model: String,
    kind: Kind,
    endpoint: &'static str,
    start: Instant,
    deadline: tokio::time::Instant,
    /// When the previous token arrived (inter-token latency).
    last_token: Option<Instant>,
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
                self.endpoint,
                self.adapter_label(),
                self.d.mode.as_str(),
                self.d.reason.as_str(),
                status,
            ])
            .inc();
        m.latency
            .with_label_values(&[self.endpoint, self.adapter_label()])
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

async fn collect_response(
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

fn stream_response(ctx: Ctx, rx: crate::engine::api::EventStream) -> Response {
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

/// Largest non-streamed answer read from a merged pod (they are a few KB).
const PROXY_MAX_BODY: usize = 16 << 20;

/// Forwards a request to a merged pod. Err carries the reason (connection failure, timeout,
/// 5xx, or a non-streamed answer cut short) so the caller can fall back: a non-streamed answer
/// is read whole before it is sent on. A stream is passed through as it comes; if the pod
/// dies mid-stream the client gets an OpenAI-shaped error event and `data: [DONE]`.
#[allow(clippy::too_many_arguments)]
async fn proxy(
    s: &Arc<AppState>,
    ep: &str,
    path: &str,
    raw: &Value,
    headers: &HeaderMap,
    d: &Decision,
    endpoint: &'static str,
) -> Result<Response, String> {
    let url = format!("{}{}", ep.trim_end_matches('/'), path);
    let mut req = s.http.post(&url).json(raw);
    if let Some(a) = headers.get("authorization") {
        req = req.header("authorization", a.clone());
    }
    let r = req.send().await.map_err(|e| {
        if e.is_timeout() {
            format!("{url}: no answer in time ({e})")
        } else {
            format!("connect {url}: {e}")
        }
    })?;
    if r.status().is_server_error() {
        return Err(format!("{url} answered {}", r.status()));
    }
    let status = StatusCode::from_u16(r.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let ctype = r.headers().get("content-type").cloned();
    let mut h = mole_headers(d);
    h.insert(
        "x-mole-mode",
        HeaderValue::from_static(Mode::Merged.as_str()),
    );
    let route = format!("{}+proxy", d.reason);
    h.insert(
        "x-mole-route",
        HeaderValue::from_str(&route).unwrap_or(HeaderValue::from_static("proxy")),
    );
    if let Some(c) = &ctype {
        h.insert(
            "content-type",
            HeaderValue::from_bytes(c.as_bytes()).map_err(|e| e.to_string())?,
        );
    }
    let adapter = d.adapter.clone().unwrap_or_default();
    let count = {
        let s = s.clone();
        let route = route.clone();
        move |status: &str| {
            s.metrics
                .requests
                .with_label_values(&[endpoint, &adapter, Mode::Merged.as_str(), &route, status])
                .inc();
        }
    };
    let sse = ctype
        .as_ref()
        .and_then(|c| c.to_str().ok())
        .is_some_and(|c| c.starts_with("text/event-stream"));
    if !sse {
        // Read whole: a pod that dies before the end is a failure we can still fall back from.
        let mut body = Vec::new();
        let mut st = r.bytes_stream();
        use futures::StreamExt;
        while let Some(chunk) = st.next().await {
            let chunk = chunk.map_err(|e| format!("{url}: answer cut short ({e})"))?;
            if body.len() + chunk.len() > PROXY_MAX_BODY {
                return Err(format!("{url}: answer over {PROXY_MAX_BODY} bytes"));
            }
            body.extend_from_slice(&chunk);
        }
        count(status.as_str());
        return Ok((status, h, Body::from(body)).into_response());
    }
    count(status.as_str());
    Ok((
        status,
        h,
        Body::from_stream(guard_sse(r.bytes_stream(), url)),
    )
        .into_response())
}

/// Passes an upstream SSE stream through; if it fails or ends before `data: [DONE]`, appends
/// an OpenAI-shaped error event and `data: [DONE]` so clients see why the answer stopped.
fn guard_sse<E: std::fmt::Display>(
    upstream: impl futures::Stream<Item = Result<Bytes, E>> + Send + 'static,
    url: String,
) -> impl futures::Stream<Item = Result<Bytes, Infallible>> + Send + 'static {
    use futures::StreamExt;
    // State: upstream, the last bytes seen (to spot `[DONE]` across chunk boundaries), done.
    futures::stream::unfold(
        (Box::pin(upstream), Vec::<u8>::new(), false),
        move |(mut up, mut tail, done)| {
            let url = url.clone();
            async move {
                if done {
                    return None;
                }
                let failure = match up.next().await {
                    Some(Ok(b)) => {
                        tail.extend_from_slice(&b);
                        let keep = tail.len().saturating_sub(32);
                        tail.drain(..keep);
                        return Some((Ok(b), (up, tail, false)));
                    }
                    Some(Err(e)) => format!("merged pod {url} failed mid-stream: {e}"),
                    None if tail_has_done(&tail) => return None,
                    None => format!("merged pod {url} ended the stream early"),
                };
                tracing::warn!("{failure}");
                let e = ApiError::new(StatusCode::BAD_GATEWAY, "upstream_error", failure);
                let ev = format!("data: {}\n\ndata: [DONE]\n\n", e.body());
                Some((Ok(Bytes::from(ev)), (up, tail, true)))
            }
        },
    )
}

fn tail_has_done(tail: &[u8]) -> bool {
    let t = String::from_utf8_lossy(tail);
    t.trim_end().ends_with("data: [DONE]")
}

fn last_user_text(m: &[ChatMessage]) -> String {
    m.iter()
        .rev()
        .find(|m| m.role == "user")
        .map(|m| m.content.clone())
        .unwrap_or_default()
}

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

fn finish(s: &AppState, r: Result<Response, ApiError>) -> Response {
    match r {
        Ok(r) => r,
        Err(e) => {
            s.metrics.errors.with_label_values(&[e.code]).inc();
            e.into_response()
        }
    }
}

#[derive(Deserialize)]
struct InferBody {
    /// The task prompt (`input` is accepted as an alias).
    #[serde(alias = "input")]
    prompt: String,
    /// Base64 image (the seeds' field): checked, then refused until vision lands.
    #[serde(default)]
    image_b64: Option<String>,
    #[serde(flatten)]
    common: Common,
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

#[derive(Deserialize)]
struct RouteBody {
    #[serde(default)]
    input: Option<String>,
    #[serde(default)]
    messages: Option<Vec<InMessage>>,
    #[serde(flatten)]
    common: Common,
}

/// `POST /v1/route`: the routing decision only, no generation.
pub async fn route(
    State(s): S,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = async {
        s.check_api_key(&headers)?;
        let b: RouteBody = parse_body(body)?;
        let text = match (b.input, b.messages) {
            (Some(t), _) => t,
            (None, Some(m)) => last_user_text(&messages(m)?),
            (None, None) => return Err(bad("invalid_request", "give input or messages")),
        };
        let d = decide(&s, &b.common, &text)?;
        Ok::<Response, ApiError>((mole_headers(&d), Json(json!({"adapter": d.adapter, "mode": d.mode, "route": d.reason, "score": d.score}))).into_response())
    }
    .await;
    finish(&s, r)
}

/// `GET /v1/models`: the pool, the base model and every adapter.
pub async fn models(State(s): S, headers: HeaderMap) -> Response {
    if let Err(e) = s.check_api_key(&headers) {
        return finish(&s, Err(e));
    }
    let cfg = s.cfg();
    let t = now();
    let mut data = vec![
        json!({"id": cfg.pool, "object": "model", "created": t, "owned_by": "mole", "root": cfg.base_model.name, "mole": {"kind": "pool"}}),
        json!({"id": cfg.base_model.name, "object": "model", "created": t, "owned_by": "mole", "root": cfg.base_model.name, "mole": {"kind": "base"}}),
    ];
    let loaded = s.engine.adapters();
    for a in &cfg.adapters {
        let l = loaded.iter().any(|x| x.name == a.name && x.loaded);
        data.push(json!({"id": a.name, "object": "model", "created": t, "owned_by": "mole", "root": cfg.base_model.name, "parent": cfg.base_model.name,
            "mole": {"kind": "adapter", "version": a.version, "mode": a.mode, "loaded": l, "description": a.description}}));
    }
    Json(json!({"object": "list", "data": data})).into_response()
}

/// `GET /v1/lora_adapters` (API key, or the operator or admin token): every version, loaded
/// or refused with the reason.
pub async fn lora_adapters(State(s): S, headers: HeaderMap) -> Response {
    if let Err(e) = s.check_listing(&headers) {
        return finish(&s, Err(e));
    }
    Json(mole_crds::LoraAdaptersResponse {
        object: "list".into(),
        base_model: s.cfg().base_model.name.clone(),
        data: s.adapter_listing(),
    })
    .into_response()
}

#[derive(Deserialize)]
struct LoadBody {
    lora_name: String,
    #[serde(default)]
    lora_path: Option<String>,
}

/// `POST /v1/load_lora_adapter` (vLLM shape). Admin only; path confined to the model root;
/// safetensors weights only (pickle `.bin` files can run code).
pub async fn load_lora(
    State(s): S,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = async {
        s.check_admin(&headers)?;
        let b: LoadBody = parse_body(body)?;
        let Some(p) = b.lora_path else {
            return Err(bad("invalid_request", "lora_path is required"));
        };
        if b.lora_name.is_empty() || b.lora_name.contains(['/', ' ']) {
            return Err(bad(
                "invalid_adapter_name",
                "lora_name must be non-empty without '/' or spaces",
            ));
        }
        let cfg = s.cfg();
        let path = crate::config::resolve_in_root(&cfg.model_root, &p)
            .map_err(|e| bad(e.code(), e.to_string()))?;
        if !path.join("adapter_model.safetensors").is_file() {
            return Err(bad(
                "safetensors_required",
                "the adapter directory needs adapter_model.safetensors (pickle .bin is refused)",
            ));
        }
        let spec = crate::engine::api::AdapterSpec {
            name: b.lora_name.clone(),
            version: "api".into(),
            lora_id: s.next_lora_id.fetch_add(1, Ordering::SeqCst),
            path,
        };
        let e = s.engine.clone();
        let started = Instant::now();
        let r = tokio::task::spawn_blocking(move || e.load_adapter(spec))
            .await
            .map_err(|e| {
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal_error",
                    e.to_string(),
                )
            })?;
        s.metrics
            .adapter_load_duration
            .with_label_values(&[if r.is_ok() { "ok" } else { "failed" }])
            .observe(started.elapsed().as_secs_f64());
        r?;
        Ok::<Response, ApiError>(
            Json(json!({"status": "loaded", "lora_name": b.lora_name})).into_response(),
        )
    }
    .await;
    finish(&s, r)
}

/// `POST /v1/unload_lora_adapter` (vLLM shape). Admin or operator token.
pub async fn unload_lora(
    State(s): S,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = async {
        s.check_operator(&headers)?;
        let b: LoadBody = parse_body(body)?;
        s.engine.unload_adapter(&b.lora_name)?;
        Ok::<Response, ApiError>(
            Json(json!({"status": "unloaded", "lora_name": b.lora_name})).into_response(),
        )
    }
    .await;
    finish(&s, r)
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ReloadBody {
    /// `WorkerConfig::content_hash()` the caller expects the file to have.
    #[serde(default)]
    config_hash: Option<String>,
}

/// `POST /admin/reload` (admin or operator token), optional body `{"configHash": H}`:
/// re-reads the config file now. With H, a file whose parsed config hashes otherwise is
/// refused with 409 `config_stale` (the kubelet refreshes a mounted ConfigMap late) and
/// nothing changes; else it is applied and the answer carries the applied `configHash`.
/// How long `POST /admin/reload` waits for the adapters to load before answering 202.
const RELOAD_ANSWER_WITHIN: std::time::Duration = std::time::Duration::from_secs(2);

/// `POST /admin/reload`.
pub async fn admin_reload(
    State(s): S,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = async {
        s.check_operator(&headers)?;
        let empty = body
            .as_ref()
            .is_ok_and(|b| b.iter().all(u8::is_ascii_whitespace));
        let b: ReloadBody = if empty {
            ReloadBody::default()
        } else {
            parse_body(body)?
        };
        let internal = |e: tokio::task::JoinError| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal_error",
                e.to_string(),
            )
        };
        // A stale file is answered at once (the operator retries), even while a watcher
        // reload holds the reload lock.
        if let Some(want) = b.config_hash.clone() {
            let st = s.clone();
            tokio::task::spawn_blocking(move || st.check_config_hash(&want))
                .await
                .map_err(internal)??;
        }
        let st = s.clone();
        let want = b.config_hash.clone();
        let job = tokio::task::spawn_blocking(move || st.reload(want.as_deref()));
        // Loading large adapters can take longer than a caller should wait: after a while the
        // reload goes on in the background and the answer is 202; `/v1/lora_adapters` says
        // when each adapter is loaded.
        let out = match tokio::time::timeout(RELOAD_ANSWER_WITHIN, job).await {
            Ok(joined) => joined.map_err(internal)??,
            Err(_) => {
                return Ok((
                    StatusCode::ACCEPTED,
                    Json(serde_json::json!({"applying": true, "configHash": b.config_hash})),
                )
                    .into_response())
            }
        };
        Ok::<Response, ApiError>(Json(out).into_response())
    }
    .await;
    finish(&s, r)
}
