//! Handlers of the OpenAI-compatible and mole endpoints.

mod admin;
mod answer;
mod chat;
mod completions;
mod generate;
mod models;
mod route;
mod types;
mod validate;

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};

use super::{ApiError, AppState};

pub(super) use admin::{admin_reload, load_lora, lora_adapters, unload_lora};
pub(super) use chat::{chat, infer};
pub(super) use completions::completions;
pub(super) use models::models;
pub(super) use route::route;

type S = State<Arc<AppState>>;

fn finish(s: &AppState, r: Result<Response, ApiError>) -> Response {
    match r {
        Ok(r) => r,
        Err(e) => {
            s.metrics.errors.with_label_values(&[e.code]).inc();
            e.into_response()
        }
    }
}
