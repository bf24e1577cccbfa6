//! The gateway: requests for an adapter served by merged pods are forwarded to them, answers
//! (streamed or not) passed back with the `x-mole-*` headers.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

use mole_api::WorkerConfig;

use super::{mole_headers, peers, ApiError, AppState};
use crate::router::{Decision, Mode};

/// Largest non-streamed answer read from a merged pod (they are a few KB).
const PROXY_MAX_BODY: usize = 16 << 20;

/// What the gateway forwards to merged pods.
pub(super) struct Upstream<'a> {
    /// Path of the same call on a merged pod.
    pub(super) path: &'static str,
    /// The `endpoint` metric label.
    pub(super) endpoint: &'static str,
    /// The body to send (JSON, as the client sent it).
    pub(super) body: Bytes,
    /// The client's headers (its `Authorization` goes along).
    pub(super) headers: &'a HeaderMap,
    /// The request's `prefer_merged` (None: the router's `preferMerged`).
    pub(super) prefer_merged: Option<bool>,
}

/// Serves `d` from its merged pods when it is a merged adapter with a `mergedEndpoint` and
/// merged pods are preferred. Ok(Some): their answer. Ok(None): serve it here (not forwarded,
/// or the pods failed and the router falls back to the adapter loaded here). Err: the pods
/// failed with no fallback, 503 `merged_unavailable`.
pub(super) async fn forward(
    s: &Arc<AppState>,
    cfg: &WorkerConfig,
    d: &Decision,
    up: &Upstream<'_>,
) -> Result<Option<Response>, ApiError> {
    let Some(name) = &d.adapter else {
        return Ok(None);
    };
    let a = cfg.adapters.iter().find(|a| &a.name == name);
    let Some(ep) = a
        .and_then(|a| a.merged_endpoint.clone())
        .filter(|_| up.prefer_merged.unwrap_or(cfg.router.prefer_merged))
        .filter(|_| d.mode == Mode::Merged)
    else {
        return Ok(None);
    };
    let span = tracing::info_span!(
        "gateway",
        otel.name = "gateway forward",
        otel.kind = "client",
        otel.status_code = tracing::field::Empty,
        mole.adapter = %name,
        server.address = %ep,
    );
    let forwarded = {
        use tracing::Instrument;
        proxy(s, &ep, d, up, Hop::Merged, &span)
            .instrument(span.clone())
            .await
    };
    if forwarded.is_err() {
        span.record("otel.status_code", "ERROR");
    }
    let reason = match forwarded {
        Ok(r) => {
            s.metrics
                .proxy
                .with_label_values(&[name.as_str(), "ok"])
                .inc();
            return Ok(Some(r));
        }
        Err(reason) => reason,
    };
    s.metrics
        .proxy
        .with_label_values(&[name.as_str(), "failed"])
        .inc();
    let local = s
        .admin
        .adapters()
        .iter()
        .any(|x| &x.name == name && x.loaded);
    if !(cfg.router.fallback_to_dynamic && local) {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "merged_unavailable",
            format!("merged pods of {name} unavailable ({reason}) and no local fallback"),
        )
        .with_retry_after(5));
    }
    tracing::warn!(adapter = %name, %reason, "merged pods unavailable, serving locally");
    Ok(None)
}

/// The header a pod sets on a request it forwards to a peer: the peer serves it itself, so a
/// request is forwarded at most once.
pub const FORWARDED_HEADER: &str = "x-mole-forwarded";

/// Where a request is forwarded.
#[derive(Clone, Copy, PartialEq)]
enum Hop {
    /// To the adapter's merged pods.
    Merged,
    /// To a dynamic pod the adapter is placed on.
    Peer,
}

/// Serves `d` from a peer when its adapter is placed on other dynamic pods
/// (`adapters[].pods`) and this pod holds it only on disk: the peers are tried in the order
/// [`peers::choose`] gives from their polled residency and queues (a device slot, then host
/// memory, then the fewest waiting requests; placed peers not heard from lately after those),
/// a peer that fails (refused, timed out, 5xx) marked down and the next tried. None: serve it
/// here after a read from disk — when no peer holds it in memory, every one that does is much
/// busier, or every peer failed — so no request fails for where it landed. A request a peer
/// forwarded is never forwarded again. Each decision counts once in `mole_peer_routes_total`.
pub(super) async fn forward_to_peer(
    s: &Arc<AppState>,
    cfg: &WorkerConfig,
    d: &Decision,
    up: &Upstream<'_>,
) -> Option<Response> {
    let name = d.adapter.as_ref()?;
    if up.headers.contains_key(FORWARDED_HEADER) || cfg.peers.is_empty() {
        return None;
    }
    let a = cfg.adapters.iter().find(|a| &a.name == name)?;
    let me = crate::config::this_pod();
    if a.placed_on(me.as_deref()) {
        return None;
    }
    let resident = s.admin.adapters().iter().any(|x| {
        &x.name == name
            && x.version == a.version
            && x.loaded
            && x.residency != mole_api::Residency::Disk
    });
    if resident {
        return None;
    }
    let views: Vec<peers::PeerView<'_>> = cfg
        .peers
        .iter()
        .filter(|(pod, _)| Some(pod.as_str()) != me.as_deref())
        .map(|(pod, url)| peers::PeerView {
            pod: pod.as_str(),
            placed: a.pods.iter().position(|p| p == pod),
            seen: s.peers.seen(pod, url, name, &a.version),
        })
        .collect();
    let margin = u64::from(cfg.limits.engine.max_batch_size).max(1);
    let pick = peers::choose(s.info.stats().waiting as u64, margin, &views);
    let count = |why: peers::RouteReason| {
        s.metrics
            .peer_routes
            .with_label_values(&[why.as_str()])
            .inc();
    };
    for (pod, why) in pick.tries {
        let Some(ep) = cfg.peers.get(pod) else {
            continue;
        };
        let span = tracing::info_span!(
            "peer",
            otel.name = "peer forward",
            otel.kind = "client",
            mole.adapter = %name,
            server.address = %ep,
        );
        let forwarded = {
            use tracing::Instrument;
            proxy(s, ep, d, up, Hop::Peer, &span)
                .instrument(span.clone())
                .await
        };
        let outcome = if forwarded.is_ok() { "ok" } else { "failed" };
        s.metrics
            .proxy
            .with_label_values(&[name.as_str(), outcome])
            .inc();
        match forwarded {
            Ok(mut r) => {
                count(why);
                if let Ok(v) = HeaderValue::from_str(pod) {
                    r.headers_mut().insert(PEER_HEADER, v);
                }
                return Some(r);
            }
            Err(reason) => {
                tracing::warn!(adapter = %name, peer = %pod, %reason, "peer skipped");
                s.peers.mark_down(pod, ep, reason);
            }
        }
    }
    count(pick.otherwise);
    None
}

/// The header of an answer a peer gave: the peer's pod name.
pub const PEER_HEADER: &str = "x-mole-peer";

/// Forwards a request to a merged pod or a peer. Err carries the reason (connection failure, timeout,
/// 5xx, or a non-streamed answer cut short) so the caller can fall back: a non-streamed answer
/// is read whole before it is sent on. A stream is passed through as it comes; if the pod
/// dies mid-stream the client gets an OpenAI-shaped error event and `data: [DONE]`.
async fn proxy(
    s: &Arc<AppState>,
    ep: &str,
    d: &Decision,
    up: &Upstream<'_>,
    hop: Hop,
    span: &tracing::Span,
) -> Result<Response, String> {
    let url = format!("{}{}", ep.trim_end_matches('/'), up.path);
    let mut req = s
        .http
        .post(&url)
        .header("content-type", "application/json")
        .body(up.body.clone());
    if hop == Hop::Peer {
        req = req.header(
            FORWARDED_HEADER,
            crate::config::this_pod().unwrap_or_else(|| "peer".into()),
        );
        // The session goes along, so the peer's canary split sees it.
        if let Some(v) = up.headers.get(mole_api::SESSION_HEADER) {
            req = req.header(mole_api::SESSION_HEADER, v.clone());
        }
    }
    if let Some(a) = up.headers.get("authorization") {
        req = req.header("authorization", a.clone());
    }
    // The merged pod continues this trace; with export off here, the client's own trace
    // headers go on as they came.
    let mut trace = HeaderMap::new();
    if !mole_telemetry::inject(span, &mut trace) {
        for h in ["traceparent", "tracestate"] {
            if let Some(v) = up.headers.get(h) {
                trace.insert(h, v.clone());
            }
        }
    }
    req = req.headers(trace);
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
    let mode = match hop {
        Hop::Merged => Mode::Merged,
        Hop::Peer => Mode::Dynamic,
    };
    h.insert("x-mole-mode", HeaderValue::from_static(mode.as_str()));
    let route = match hop {
        Hop::Merged => format!("{}+proxy", d.reason),
        Hop::Peer => format!("{}+peer", d.reason),
    };
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
                .with_label_values(&[up.endpoint, &adapter, mode.as_str(), &route, status])
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
        Body::from_stream(guard_sse(r.bytes_stream(), url, up.path == "/v1/responses")),
    )
        .into_response())
}

/// Passes an upstream SSE stream through; if it fails or ends before its end (`data: [DONE]`
/// for chat and completions, `response.completed`, `.incomplete` or `.failed` for a response),
/// appends the error as the stream's kind writes one, so clients see why the answer stopped:
/// OpenAI's error body and `data: [DONE]`, or for a response an `error` event numbered after
/// the events passed through.
fn guard_sse<E: std::fmt::Display>(
    upstream: impl futures::Stream<Item = Result<Bytes, E>> + Send + 'static,
    url: String,
    response: bool,
) -> impl futures::Stream<Item = Result<Bytes, Infallible>> + Send + 'static {
    use futures::StreamExt;
    // State: upstream, the last bytes seen (to spot markers across chunk boundaries), the
    // events seen, whether a response's last event was seen, done.
    futures::stream::unfold(
        (Box::pin(upstream), Vec::<u8>::new(), 0usize, false, false),
        move |(mut up, mut tail, mut events, mut ended, done)| {
            let url = url.clone();
            async move {
                if done {
                    return None;
                }
                let failure = match up.next().await {
                    Some(Ok(b)) => {
                        // A `data: ` split by a chunk boundary is counted once: the tail
                        // keeps the last bytes, and only matches ending in the new ones count.
                        let kept = tail.len();
                        tail.extend_from_slice(&b);
                        events += tail
                            .windows(6)
                            .enumerate()
                            .filter(|(i, w)| *w == b"data: " && i + 6 > kept)
                            .count();
                        ended |= response && response_ended(&tail);
                        let keep = tail.len().saturating_sub(64);
                        tail.drain(..keep);
                        return Some((Ok(b), (up, tail, events, ended, false)));
                    }
                    Some(Err(e)) => format!("merged pod {url} failed mid-stream: {e}"),
                    None if ended || (!response && tail_has_done(&tail)) => return None,
                    None => format!("merged pod {url} ended the stream early"),
                };
                tracing::warn!("{failure}");
                let e = ApiError::new(StatusCode::BAD_GATEWAY, "upstream_error", failure);
                let ev = match response {
                    false => format!("data: {}\n\ndata: [DONE]\n\n", e.body()),
                    true => {
                        let v = serde_json::json!({"type": "error", "code": e.code,
                            "message": e.message, "param": null, "sequence_number": events});
                        format!("event: error\ndata: {v}\n\n")
                    }
                };
                Some((Ok(Bytes::from(ev)), (up, tail, events, ended, true)))
            }
        },
    )
}

/// Whether `bytes` name a response stream's last event.
fn response_ended(bytes: &[u8]) -> bool {
    let t = String::from_utf8_lossy(bytes);
    [
        "response.completed",
        "response.incomplete",
        "response.failed",
    ]
    .iter()
    .any(|e| t.contains(&format!("event: {e}")))
}

fn tail_has_done(tail: &[u8]) -> bool {
    let t = String::from_utf8_lossy(tail);
    t.trim_end().ends_with("data: [DONE]")
}
