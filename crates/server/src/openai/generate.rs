//! The serving path of a validated request: readiness, routing, the gateway, the context limit,
//! the engine.

use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use mole_api::{PrefixCacheScope, WorkerConfig};

use super::answer::{choices, collect_response, req_id, stream_response, Ctx};
use super::extract::RawBody;
use super::images;
use super::parse::OutputParser;
use super::reply_bodies::{Answer, ChatChoice, ChatEvent, TextChoice, TextEvent};
use super::request_bodies::{ChatBody, CompletionBody};
use super::response_out::ResponseState;
use super::route::decide_off_runtime;
use super::validate::{max_seq, prepare_request, ValidRequest, Validate};
use super::S;
use crate::error::Refusals;
use crate::gateway;
use crate::router::{Decision, Mode};
use crate::{ApiError, AppState};
use mole_engine::api::{EngineError, GenerateRequest, Image, Prompt, SamplingParams, Serving};

/// `POST /v1/chat/completions`: the messages through the model's chat template, routed
/// (`model`, `adapter`, or the router), answered whole or streamed.
#[utoipa::path(post, path = "/v1/chat/completions", tag = "openai",
    request_body = ChatBody,
    responses(
        (status = 200, description = "The answer; with `stream: true`, `chat.completion.chunk` objects as server-sent events, then `data: [DONE]`",
            content((Answer<ChatChoice> = "application/json"), (ChatEvent = "text/event-stream"))),
        Refusals,
    ),
    security(("bearer" = [])))]
pub async fn chat_completions(
    s: S,
    headers: HeaderMap,
    body: RawBody,
) -> Result<Response, ApiError> {
    generate::<ChatBody>(s, headers, body).await
}

/// `POST /v1/completions`: a prompt (text or token ids) continued, routed as chats are.
#[utoipa::path(post, path = "/v1/completions", tag = "openai",
    request_body = CompletionBody,
    responses(
        (status = 200, description = "The completion; with `stream: true`, `text_completion` chunks as server-sent events, then `data: [DONE]`",
            content((Answer<TextChoice> = "application/json"), (TextEvent = "text/event-stream"))),
        Refusals,
    ),
    security(("bearer" = [])))]
pub async fn completions(s: S, headers: HeaderMap, body: RawBody) -> Result<Response, ApiError> {
    generate::<CompletionBody>(s, headers, body).await
}

/// Chat and completions: the body validated into one request, then served.
async fn generate<B: Validate>(
    State(s): S,
    headers: HeaderMap,
    body: RawBody,
) -> Result<Response, ApiError> {
    let deadline = s.deadline();
    let req = prepare_request::<B>(&s, body, deadline).await?;
    serve(&s, &headers, req, deadline).await
}

/// Serves a validated request: refused while the worker is not ready, routed, then answered by
/// merged pods or the engine.
pub(super) async fn serve(
    s: &Arc<AppState>,
    headers: &HeaderMap,
    mut req: ValidRequest,
    deadline: std::time::Instant,
) -> Result<Response, ApiError> {
    if !s.accepting() {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "not_ready",
            format!(
                "worker is not ready: {}",
                s.readiness().err().unwrap_or_default()
            ),
        )
        .with_retry_after(1));
    }
    // The sources become pixels (the request keeps the rest).
    let (images, held) = images::read_all(s, std::mem::take(&mut req.images), deadline).await?;
    // What the router reads is not needed afterwards: moved, not copied.
    let text = std::mem::take(&mut req.route_text);
    let (d, images) = decide_off_runtime(
        s,
        req.model.clone(),
        req.adapter.clone(),
        text,
        images,
        deadline,
    )
    .await?;
    let span = tracing::Span::current();
    span.record("mole.adapter", d.adapter.as_deref().unwrap_or(""));
    span.record("mole.mode", d.mode.as_str());
    span.record("mole.route", d.reason.as_str());
    let endpoint = req.kind.endpoint();
    let (adapter, mode, reason) = (d.adapter.clone(), d.mode, d.reason.clone());
    // The images' pixels stay held until the answer is sent, streamed ones with the stream.
    let r = serve_routed(s, headers, req, images, d)
        .await
        .map(|resp| holding(resp, held));
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

/// `resp` with `held` dropped only when its body is: at once for a whole answer once sent, at
/// the end for a stream.
fn holding(resp: Response, held: images::HeldPixels) -> Response {
    if !held.holds() {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let body = futures::StreamExt::map(body.into_data_stream(), move |chunk| {
        let _held = &held;
        chunk
    });
    Response::from_parts(parts, axum::body::Body::from_stream(body))
}

/// Serves a routed request: by the merged pods when the gateway forwards it, else by the engine
/// within the context limit.
async fn serve_routed(
    s: &Arc<AppState>,
    headers: &HeaderMap,
    req: ValidRequest,
    images: Vec<Image>,
    mut d: Decision,
) -> Result<Response, ApiError> {
    let cfg = s.cfg();
    let canary = canary_for(s, &cfg, &d, headers, req.user.as_deref());
    if canary.is_some() {
        // The canary version is served here (dynamically), never by the stable version's
        // merged pods.
        d.mode = Mode::Dynamic;
    } else if let Some(up) = req.upstream(headers) {
        if let Some(r) = gateway::forward(s, &cfg, &d, &up).await? {
            return Ok(r);
        }
        if let Some(r) = gateway::forward_to_peer(s, &cfg, &d, &up).await {
            return Ok(r);
        }
    }
    // The prompt was tokenized by validation; each image's one placeholder becomes its
    // tokens.
    let mut prompt_tokens = req.prompt.len();
    for img in &images {
        prompt_tokens += s
            .codec
            .image_tokens(img.width, img.height)?
            .saturating_sub(1);
    }
    let max_tokens = req.fit_context(prompt_tokens, max_seq(s))?;
    let id = req_id(req.kind.id_prefix());
    let engine = engine_for(s, &cfg, &mut d);
    let n = req.n;
    let gen = GenerateRequest {
        id: id.clone(),
        prompt: Prompt::Tokens(req.prompt),
        adapter: canary.or_else(|| d.adapter.clone()),
        sampling: SamplingParams {
            max_tokens,
            cache_tenant: match cfg.limits.prefix_cache_scope {
                PrefixCacheScope::ApiKey => s.auth().tenant(headers),
                PrefixCacheScope::Pool => None,
            },
            ..req.sampling
        },
        images,
    };
    // Submitting preprocesses the images and compiles the grammar (or finds it compiled):
    // preparation work, off the runtime. Its deadline runs from now: a request that fell back
    // from merged pods or peers has its whole timeout here, as the answer below does.
    let rx = s
        .prepare
        .run(s.deadline(), move || Ok(engine.submit_n(gen, n)))
        .await?
        .map_err(|e| load_failure(s, e, d.adapter.as_deref()))?;
    let timeout = Duration::from_secs(cfg.limits.request_timeout_seconds);
    let model = if req.model.is_empty() {
        cfg.pool.clone()
    } else {
        req.model
    };
    let resp = match (req.echo, req.parse) {
        (Some(echo), Some(spec)) => Some(ResponseState::new(id.clone(), model.clone(), echo, spec)),
        _ => None,
    };
    let ctx = Ctx {
        s: s.clone(),
        d,
        id,
        model,
        kind: req.kind,
        start: Instant::now(),
        deadline: tokio::time::Instant::now() + timeout,
        last_token: vec![None; n],
        started: false,
        left: n,
        usage: Default::default(),
        version: None,
        include_usage: req.include_usage,
        parse: req.parse,
        parsers: match (req.stream, req.parse) {
            (true, Some(spec)) => (0..n).map(|_| OutputParser::new(spec)).collect(),
            _ => Vec::new(),
        },
        unenforced: req.unenforced,
        resp,
    };
    let rx = choices(rx);
    if req.stream {
        Ok(stream_response(ctx, rx))
    } else {
        collect_response(ctx, rx).await
    }
}

/// The engine key of `d`'s canary version when this request goes to it: the adapter has a
/// canary at a weight above 0 that this worker holds, and [`mole_api::canary_pick`] picks it
/// for the request's session (the `x-session-id` header, else the body's OpenAI `user`) or, with
/// none, for its place in the adapter's count. A canary that failed to load takes nothing: its
/// share goes to the stable version, so no request fails for it.
fn canary_for(
    s: &AppState,
    cfg: &WorkerConfig,
    d: &Decision,
    headers: &HeaderMap,
    user: Option<&str>,
) -> Option<String> {
    let name = d.adapter.as_ref()?;
    let c = cfg
        .adapters
        .iter()
        .find(|a| &a.name == name)?
        .canary
        .as_ref()
        .filter(|c| c.weight > 0)?;
    let session = headers
        .get(mole_api::SESSION_HEADER)
        .and_then(|v| v.to_str().ok())
        .or(user)
        .filter(|k| !k.is_empty());
    let count = match session {
        Some(_) => 0,
        None => {
            let mut counts = s
                .canary_counts
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let n = counts.entry(name.clone()).or_default();
            *n += 1;
            *n - 1
        }
    };
    if !mole_api::canary_pick(name, c.weight, session, count) {
        return None;
    }
    let held = s
        .admin
        .adapters()
        .iter()
        .any(|a| &a.name == name && a.version == c.version && a.loaded);
    held.then(|| mole_engine::lora::registry::canary_key(name))
}

/// The answer to an engine refusal. A configured adapter the engine does not hold because it
/// failed to load is not "not found": it answers 503 `adapter_load_failed` with the loader's
/// reason (`/v1/lora_adapters` lists it too) until a fixed version loads.
fn load_failure(s: &AppState, e: EngineError, adapter: Option<&str>) -> ApiError {
    if let (EngineError::AdapterNotFound(_), Some(name)) = (&e, adapter) {
        let failed = s
            .adapter_listing()
            .into_iter()
            .find(|a| a.name == name && !a.loaded && a.error.is_some());
        if let Some(f) = failed {
            return ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "adapter_load_failed",
                format!(
                    "adapter {name} version {} failed to load: {}",
                    f.version,
                    f.error.unwrap_or_default()
                ),
            );
        }
    }
    e.into()
}

/// The engine that serves `d`. A merged adapter served here is served by this process's own
/// merged model (local mode) while it holds the configured version: after a config change it is
/// stale and the new version is served dynamically until a restart merges it. Otherwise the
/// shared engine serves it dynamically, and `d` says so.
fn engine_for(s: &AppState, cfg: &WorkerConfig, d: &mut Decision) -> Arc<dyn Serving> {
    if d.mode != Mode::Merged || cfg.merged.is_some() {
        return s.serving.clone();
    }
    let local = d.adapter.as_ref().and_then(|n| {
        let want = &cfg.adapters.iter().find(|a| &a.name == n)?.version;
        let e = s
            .local_merged
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(n)
            .cloned()?;
        e.adapters()
            .iter()
            .any(|a| &a.name == n && &a.version == want)
            .then_some(e as Arc<dyn Serving>)
    });
    local.unwrap_or_else(|| {
        d.mode = Mode::Dynamic;
        s.serving.clone()
    })
}
