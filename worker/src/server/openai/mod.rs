//! Handlers of the OpenAI-compatible and mole endpoints: wire types, validation into one
//! request, routing, the serving path, answers, and the admin endpoints.

mod admin;
mod answer;
mod chat;
mod completions;
mod generate;
mod images;
mod models;
mod route;
mod tokens;
mod types;
mod validate;

use std::sync::Arc;

use axum::extract::State;

use super::AppState;

pub(super) use admin::{admin_reload, load_lora, lora_adapters, unload_lora};
pub(super) use chat::infer;
pub(super) use generate::generate;
pub(super) use models::models;
pub(super) use route::route;
pub(super) use tokens::{detokenize, tokenize, version};
pub(super) use types::{ChatBody, CompletionBody};

/// The state extractor of every handler.
type S = State<Arc<AppState>>;
