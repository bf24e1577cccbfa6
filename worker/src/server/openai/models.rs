//! `GET /v1/models`.

use axum::extract::State;
use axum::Json;

use super::answer::now;
use super::replies::{ModelCard, ModelKind, ModelList};
use super::S;
use crate::server::openapi::Refusals;

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
