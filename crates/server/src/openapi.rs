//! The worker's API as an OpenAPI 3.1 document (`GET /openapi.json`), derived from the
//! handlers' own request and reply types and their `#[utoipa::path]` annotations, as TGI's
//! router does: clients can be generated from it and the API fuzzed against it
//! (`scripts/checks/openapi.sh`). The request bodies' schemas, and this worker's limits in
//! them, are [`super::openapi_requests`]'s: the handlers hold bodies to those alone.

use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::OpenApi;

use super::openai;
use super::openapi_requests::{finish, request_limits, RequestLimits};
use super::AppState;

/// The endpoints and the schemas they name: the document's list (its test holds it equal to
/// [`super::app`]'s routes). The handlers hold their bodies to the request schemas alone
/// ([`super::doc_check`]), so naming them here makes no circle.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "mole-worker",
        description = "One pool's OpenAI-compatible API: chat and completions routed to LoRA adapters \
            (explicit name, classifier, keywords, embeddings), mole's task and routing calls, vLLM's \
            adapter and tokenizer endpoints, probes and metrics."
    ),
    paths(
        openai::generate::chat_completions,
        openai::generate::completions,
        openai::responses::create_response,
        openai::stored::get_response,
        openai::stored::delete_response,
        openai::chat::infer,
        openai::route::route,
        openai::models::models,
        openai::tokens::tokenize,
        openai::tokens::detokenize,
        openai::tokens::version,
        openai::admin::lora_adapters,
        openai::admin::load_lora,
        openai::admin::unload_lora,
        openai::admin::admin_reload,
        super::health,
        super::healthz,
        super::readyz,
        super::metrics,
        super::residency::residency,
        openapi_json,
    ),
    components(schemas(super::error::ErrorReply, super::error::ErrorDetail, openai::reply_bodies::Answer<openai::reply_bodies::ChunkChoice>)),
    tags(
        (name = "openai", description = "OpenAI's API"),
        (name = "mole", description = "mole's task and routing calls"),
        (name = "vllm", description = "vLLM's plain endpoints"),
        (name = "admin", description = "Adapters and config (admin or operator token)"),
        (name = "probes", description = "Liveness, readiness, metrics"),
    )
)]
struct ApiDoc;

/// Which secrets this worker has: what its document asks clients for.
#[derive(Debug, Clone, Copy)]
pub(super) struct DocAuth {
    /// API keys are required.
    pub(super) api_keys: bool,
    /// An admin token is set.
    pub(super) admin_token: bool,
    /// An operator token is set.
    pub(super) operator_token: bool,
}

/// The endpoints that take the admin or operator token (the first the admin token alone).
const ADMIN_ONLY: [&str; 3] = [
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/admin/reload",
];

/// The document as this worker serves it: the admin endpoints always take a bearer token; the
/// others only when `api_keys` are required, so a client is not told to send a token nobody
/// reads. The request bodies state this worker's `limits` (see [`enforce`]).
pub(super) fn document(auth: DocAuth, limits: &RequestLimits) -> serde_json::Value {
    let mut doc = ApiDoc::openapi();
    doc.info.version = env!("CARGO_PKG_VERSION").to_string();
    let scheme = HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build();
    doc.components
        .get_or_insert_with(Default::default)
        .add_security_scheme("bearer", SecurityScheme::Http(scheme));
    for (path, item) in doc.paths.paths.iter_mut() {
        // An admin endpoint whose tokens are all unset answers 403 admin_disabled whatever is
        // sent: no token is asked for.
        let admin = ADMIN_ONLY.contains(&path.as_str());
        let disabled =
            !auth.admin_token && (path.as_str() == ADMIN_ONLY[0] || !auth.operator_token);
        if (admin && !disabled) || (!admin && auth.api_keys) {
            continue;
        }
        for op in [&mut item.get, &mut item.post, &mut item.delete]
            .into_iter()
            .flatten()
        {
            op.security = None;
        }
    }
    let mut v = serde_json::to_value(doc).unwrap_or_default();
    finish(&mut v, limits);
    v
}

/// `GET /openapi.json`: this document (open, as vLLM's and TGI's are).
#[utoipa::path(get, path = "/openapi.json", tag = "probes",
    responses((status = 200, description = "This document", content_type = "application/json", body = Object)))]
pub(super) async fn openapi_json(State(s): State<Arc<AppState>>) -> Json<serde_json::Value> {
    let a = s.auth();
    let auth = DocAuth {
        api_keys: a.keys_required,
        admin_token: a.admin_token.is_some(),
        operator_token: a.operator_token.is_some(),
    };
    Json(document(auth, &request_limits(&s)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every route the app serves is in the document and nothing else is: the paths are read
    /// from `app()`'s source, so a new route without `#[utoipa::path]` fails here.
    #[test]
    fn the_document_lists_every_route() {
        let auth = DocAuth {
            api_keys: true,
            admin_token: true,
            operator_token: false,
        };
        let doc = document(auth, &RequestLimits::default());
        assert!(doc["openapi"].as_str().unwrap().starts_with("3.1"));
        let documented: std::collections::BTreeSet<String> =
            doc["paths"].as_object().unwrap().keys().cloned().collect();
        let src = include_str!("lib.rs");
        let routed: std::collections::BTreeSet<String> = src
            .split(".route(")
            .skip(1)
            .filter_map(|r| r.trim_start().strip_prefix('"')?.split('"').next())
            .map(str::to_string)
            .collect();
        assert_eq!(documented, routed);
        if let Ok(out) = std::env::var("MOLE_OPENAPI_OUT") {
            std::fs::write(out, serde_json::to_string_pretty(&doc).unwrap()).unwrap();
        }
    }

    /// The schemas bodies are held to ([`request_schemas`], built from the request types
    /// alone) are the served document's, for default and for tight limits: a body is refused
    /// only by what the document states.
    #[test]
    fn bodies_are_held_to_the_served_schemas() {
        let auth = DocAuth {
            api_keys: false,
            admin_token: false,
            operator_token: false,
        };
        let tight = RequestLimits {
            max_tokens: 7,
            max_batch_size: 2,
            max_seq: 64,
            vocab: 100,
            vision: true,
            max_images: 1,
            tools: true,
            ..RequestLimits::default()
        };
        for limits in [RequestLimits::default(), tight] {
            let served = document(auth, &limits)["components"]["schemas"].clone();
            let held = super::super::openapi_requests::request_schemas(&limits);
            let held = held.as_object().unwrap();
            for name in [
                "ChatBody",
                "CompletionBody",
                "InferBody",
                "LoadBody",
                "ReloadBody",
                "RouteBody",
                "TokenizeBody",
                "DetokenizeBody",
                "ResponsesBody",
            ] {
                assert!(
                    held.contains_key(name),
                    "{name} is not among the held schemas"
                );
            }
            for (name, schema) in held {
                assert_eq!(
                    &served[name], schema,
                    "{name} differs from the served document"
                );
            }
        }
    }
}
