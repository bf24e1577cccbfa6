//! Routing a request ([`crate::router::decide`] with the engine's scorer and the embedder),
//! and `POST /v1/route`, the decision alone.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::body::{documented, SmallBody};
use super::images;
use super::replies::MoleInfo;
use super::types::RouteBody;
use super::validate::{last_user_text, messages};
use super::S;
use crate::engine::api::Image;
use crate::router::{self, Decision, Mode, RouteInput};
use crate::server::error::bad;
use crate::server::openapi::Refusals;
use crate::server::{mole_headers, ApiError, AppState};

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

/// Runs `f` (a classifier pass, an embedding), telling a multi-threaded runtime that this worker
/// thread blocks so other requests move to another thread meanwhile.
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
    let input = RouteInput {
        model: &b.model,
        adapter: b.adapter.as_deref().or(b.expert.as_deref()),
        text: &text,
    };
    let d = decide(&s, &input, &images)?;
    Ok((mole_headers(&d), Json(MoleInfo::new(&d, None))).into_response())
}
