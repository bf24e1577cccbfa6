//! Routing a request ([`crate::router::decide`] with the engine's scorer and the embedder),
//! and `POST /v1/route`, the decision alone.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::extract::{documented, SmallBody};
use super::images;
use super::reply_bodies::MoleInfo;
use super::request_bodies::RouteBody;
use super::validate::{last_user_text, messages};
use super::S;
use crate::error::bad;
use crate::error::Refusals;
use crate::router::{self, Decision, Mode, RouteInput};
use crate::{mole_headers, ApiError, AppState};
use mole_engine::api::Image;

/// Routes a request: [`router::decide`] with the engine's classifier (whose one pass sees the
/// request's `images` too) and the embedding model, plus adapters loaded through
/// `/v1/load_lora_adapter` (not in the config, servable by explicit name, as in vLLM). Counts
/// the decision.
pub(super) fn decide(
    s: &AppState,
    input: &RouteInput<'_>,
    images: &[Image],
) -> Result<Decision, ApiError> {
    let cfg = s.cfg();
    let serving = s.serving.clone();
    let scorer = move |cls: &str, p: &str, labels: &[String]| {
        blocking(|| serving.score_labels(Some(cls), p, labels, images).ok())
    };
    // The request text is encoded each time; adapter descriptions and examples come from the
    // embedder's cache. Without a configured model the strategy falls through.
    let emb = s.embedder.get().cloned();
    let embedder = move |texts: &[String]| -> Option<Vec<Vec<f32>>> {
        let e = emb.as_ref()?;
        blocking(|| {
            let q = e.encode(&texts[..1]).ok()?;
            let rest = e.encode_cached(&texts[1..]).ok()?;
            Some(
                q.into_iter()
                    .chain(rest.iter().map(|v| v.to_vec()))
                    .collect(),
            )
        })
    };
    let d = match router::decide(&cfg, input, &scorer, &embedder) {
        Err(router::RouteError::UnknownModel(n))
            if s.admin.adapters().iter().any(|a| a.name == n && a.loaded) =>
        {
            Decision {
                adapter: Some(n),
                reason: "explicit".into(),
                score: None,
                mode: Mode::Dynamic,
            }
        }
        r => r?,
    };
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

/// Routes a request as [`decide`] does, on the preparation stage when the router has model
/// work to do (a classifier pass, an embedding: a request for the pool, or `auto`, with such a
/// strategy), so the async runtime only moves bytes; explicit names and keywords are decided
/// here at once. The images (the classifier's pass sees them) come back with the decision.
pub(super) async fn decide_off_runtime(
    s: &Arc<AppState>,
    model: String,
    adapter: Option<String>,
    text: String,
    images: Vec<Image>,
    deadline: std::time::Instant,
) -> Result<(Decision, Vec<Image>), ApiError> {
    let cfg = s.cfg();
    let named = adapter.as_deref().unwrap_or(&model);
    let routed = named.is_empty() || named == cfg.pool || named == "auto";
    let model_work = routed
        && cfg.merged.is_none()
        && cfg.router.strategies.iter().any(|st| {
            matches!(
                st,
                mole_api::RouterStrategy::Classifier | mole_api::RouterStrategy::Embedding
            )
        });
    drop(cfg);
    let run = {
        let s = s.clone();
        move || {
            let input = RouteInput {
                model: &model,
                adapter: adapter.as_deref(),
                text: &text,
            };
            decide(&s, &input, &images).map(|d| (d, images))
        }
    };
    match model_work {
        true => s.prepare.run(deadline, run).await,
        false => run(),
    }
}

/// Runs `f` (a classifier pass, an embedding), telling a multi-threaded runtime that this worker
/// thread blocks so other requests move to another thread meanwhile (the routing of
/// [`decide_off_runtime`] runs on a preparation thread, where this is a plain call).
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// `POST /v1/route`: the routing decision only, no generation.
#[utoipa::path(post, path = "/v1/route", tag = "mole",
    request_body = RouteBody,
    responses((status = 200, description = "Where the request would go", body = MoleInfo), Refusals),
    security(("bearer" = [])))]
pub async fn route(State(s): S, SmallBody(f): SmallBody) -> Result<Response, ApiError> {
    let (mut b, given) = documented(&s, "RouteBody", f, |f| {
        let mut b: RouteBody = f.all()?;
        // Messages are validated whenever they are sent, also beside an `input` (which wins).
        let given = match b.messages.take() {
            // A text model refuses image parts here, before any is fetched or decoded.
            Some(m) => Some(messages(m, &s.cfg().limits, s.info.model_info().vision)?),
            None => None,
        };
        Ok((b, given))
    })?;
    let (text, images) = match (b.input.take(), given) {
        (Some(t), _) => (t, Vec::new()),
        (None, Some((msgs, images))) => (last_user_text(&msgs), images),
        (None, None) => return Err(bad("invalid_request", "give input or messages")),
    };
    let deadline = s.deadline();
    let (images, _held) = images::read_all(&s, images, deadline).await?;
    let adapter = b.adapter.or(b.expert);
    let (d, _) = decide_off_runtime(&s, b.model, adapter, text, images, deadline).await?;
    Ok((mole_headers(&d), Json(MoleInfo::new(&d, None))).into_response())
}
