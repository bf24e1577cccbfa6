//! Handlers of the OpenAI-compatible and mole endpoints: wire types, validation into one
//! request, routing, the serving path, answers, and the admin endpoints.

/// A unit type that reads exactly one string, a `type` tag: for the tagged objects serde's own
/// tagging cannot read (a tag that may be left out, a tag inside an untagged alternative). A
/// field of such a type is read only to check it.
macro_rules! tag {
    ($name:ident, $value:literal) => {
        #[doc = concat!("The tag `\"", $value, "\"`.")]
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub(crate) struct $name;

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                match String::deserialize(d)?.as_str() {
                    $value => Ok($name),
                    other => Err(serde::de::Error::custom(format!(
                        "type must be {:?}, got {other:?}",
                        $value
                    ))),
                }
            }
        }

        impl utoipa::PartialSchema for $name {
            fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
                utoipa::openapi::ObjectBuilder::new()
                    .schema_type(utoipa::openapi::schema::Type::String)
                    .enum_values(Some([$value]))
                    .into()
            }
        }
        impl utoipa::ToSchema for $name {}
    };
}
// Above the modules that use it: the wire types of several files (types.rs, tools.rs,
// responses.rs) take their tags from here, the module that holds them all.
use tag;

pub(crate) mod admin;
mod answer;
mod body;
mod call_json;
pub(crate) mod chat;
mod completions;
mod extract;
pub(crate) mod fields;
pub(crate) mod generate;
pub(crate) mod guided;
mod image_url;
mod images;
pub(crate) mod models;
pub(crate) mod outputs;
mod parse;
#[cfg(test)]
mod qwen3_checks;
pub(crate) mod reply_bodies;
pub(crate) mod request_bodies;
mod response_out;
pub(crate) mod responses;
pub(crate) mod route;
pub(crate) mod stored;
pub(crate) mod tokens;
pub(crate) mod tools;
mod validate;

use std::sync::Arc;

use axum::extract::State;

use super::AppState;

pub(super) use admin::{admin_reload, load_lora, lora_adapters, unload_lora};
pub(super) use chat::infer;
pub(super) use generate::{chat_completions, completions};

pub(super) use models::models;
pub(super) use responses::create_response;
pub(super) use route::route;
pub(super) use stored::{delete_response, get_response};
pub(super) use tokens::{detokenize, tokenize, version};

/// Seconds since the epoch (the `created` field).
fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The state extractor of every handler.
type S = State<Arc<AppState>>;
