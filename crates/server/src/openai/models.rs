//! `GET /v1/models`.

use axum::extract::State;
use axum::Json;

use super::now;
use super::reply_bodies::{ModelCard, ModelKind, ModelList};
use super::S;
use crate::error::Refusals;
use crate::{ApiError, AppState};

/// `GET /v1/models`: the pool, the base model and every adapter.
#[utoipa::path(get, path = "/v1/models", tag = "openai",
    responses((status = 200, description = "The servable models", body = ModelList), Refusals),
    security(("bearer" = [])))]
pub async fn models(State(s): S) -> Json<ModelList> {
    let cfg = s.cfg();
    let created = now();
    let base = &cfg.base_model.name;
    let card = |id: &str, parent: Option<String>, mole: ModelKind| ModelCard {
        id: id.to_string(),
        object: "model",
        created,
        owned_by: "mole",
        root: base.clone(),
        parent,
        mole,
    };
    let kind = |kind| ModelKind {
        kind,
        version: None,
        mode: None,
        loaded: None,
        description: None,
        weights_bytes: None,
    };
    let held = s.info.stats().weights_bytes;
    let mut data = vec![
        card(
            &cfg.pool,
            None,
            ModelKind {
                weights_bytes: held,
                ..kind("pool")
            },
        ),
        card(
            base,
            None,
            ModelKind {
                weights_bytes: held,
                ..kind("base")
            },
        ),
    ];
    let loaded = s.admin.adapters();
    for a in &cfg.adapters {
        let l = loaded.iter().any(|x| x.name == a.name && x.loaded);
        data.push(card(
            &a.name,
            Some(base.clone()),
            ModelKind {
                version: Some(a.version.clone()),
                mode: Some(a.mode),
                loaded: Some(l),
                description: a.routing.description.clone(),
                ..kind("adapter")
            },
        ));
    }
    Json(ModelList {
        object: "list",
        data,
    })
}

/// Refuses a `model` this pool does not serve (404 `model_not_found`): the endpoints that take
/// a model only to say which (the tokenizer's, shared by every model of a pool) check it as
/// vLLM does. Any name the router takes passes: empty, `auto`, the pool, the base model, an
/// adapter's name or label, an adapter loaded through the API.
pub(super) fn check_model(s: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    let Some(name) = model else {
        return Ok(());
    };
    let cfg = s.cfg();
    let input = crate::router::RouteInput {
        model: name,
        adapter: None,
        text: "",
    };
    // The explicit names only: nothing is scored.
    let routed = name.is_empty() || name == cfg.pool || name == "auto";
    if routed
        || crate::router::decide(&cfg, &input, &|_, _, _| None, &|_| None).is_ok()
        || s.admin
            .adapters()
            .iter()
            .any(|a| a.name == name && a.loaded)
    {
        return Ok(());
    }
    Err(crate::router::RouteError::UnknownModel(name.into()).into())
}
