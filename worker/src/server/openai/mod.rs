//! Handlers of the OpenAI-compatible and mole endpoints: wire types, validation into one
//! request, routing, the serving path, answers, and the admin endpoints.

pub(in crate::server) mod admin;
mod answer;
mod body;
mod call_json;
pub(in crate::server) mod chat;
mod completions;
pub(in crate::server) mod fields;
pub(in crate::server) mod generate;
pub(in crate::server) mod guided;
mod image_url;
mod images;
pub(in crate::server) mod models;
pub(in crate::server) mod outputs;
mod parse;
#[cfg(test)]
mod qwen3_checks;
pub(in crate::server) mod replies;
mod response_out;
pub(in crate::server) mod responses;
pub(in crate::server) mod route;
pub(in crate::server) mod tokens;
pub(in crate::server) mod tools;
pub(in crate::server) mod types;
mod validate;

use std::sync::Arc;

use axum::extract::State;

use super::AppState;

pub(super) use admin::{admin_reload, load_lora, lora_adapters, unload_lora};
pub(super) use chat::infer;
pub(super) use generate::{chat_completions, completions};

pub(super) use models::models;
pub(super) use responses::{create_response, delete_response, get_response};
pub(super) use route::route;
pub(super) use tokens::{detokenize, tokenize, version};

/// The state extractor of every handler.
type S = State<Arc<AppState>>;
