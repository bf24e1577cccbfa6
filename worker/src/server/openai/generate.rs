//! The serving path of a generation: readiness, routing, the gateway, the context limit, the
//! engine.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use serde_json::Value;

use super::answer::{collect_response, req_id, stream_response, Ctx};
use super::route::decide;
use super::types::{Common, Kind};
use super::validate::bad;
use crate::engine::api::{GenerateRequest, Prompt, SamplingParams};
use crate::router::{Decision, Mode};
use crate::server::gateway::proxy;
use crate::server::{ApiError, AppState};

#[allow(clippy::too_many_arguments)]
/// Common entry: readiness, auth, routing, gateway, limits, submit, answer.
pub(super) async fn serve(
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
