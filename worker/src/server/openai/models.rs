//! `GET /v1/models`.

use axum::extract::State;
use axum::Json;
use serde_json::{json, Value};

use super::answer::now;
use super::S;

/// `GET /v1/models`: the pool, the base model and every adapter.
pub async fn models(State(s): S) -> Json<Value> {
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
            "mole": {"kind": "adapter", "version": a.version, "mode": a.mode, "loaded": l, "description": a.routing.description}}));
    }
    Json(json!({"object": "list", "data": data}))
}
