//! The worker's API as an OpenAPI 3.1 document (`GET /openapi.json`), derived from the
//! handlers' own request and reply types and their `#[utoipa::path]` annotations, as TGI's
//! router does: clients can be generated from it and the API fuzzed against it
//! (`scripts/checks/openapi.sh`). The list of documented endpoints ([`ApiDoc`]) sits beside
//! the routes in the server's own file: the handlers hold their bodies to this document
//! ([`super::doc_check`]), so this file names no handler.

use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::OpenApi;

use super::openai;
use super::openapi_requests::{enforce, RequestLimits};
use super::{ApiDoc, AppState};

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
    enforce(&mut v, limits);
    // A `contentSchema` is its own document to validators (schemathesis resolves it apart from
    // the components), so its references are inlined.
    let schemas = v["components"]["schemas"].clone();
    inline_content_schemas(&mut v, &schemas);
    v
}

/// Turns every `x-content-schema` into `contentSchema` (a JSON Schema keyword utoipa has no
/// field for) with its `$ref`s to `schemas` inlined.
fn inline_content_schemas(v: &mut serde_json::Value, schemas: &serde_json::Value) {
    match v {
        serde_json::Value::Object(m) => {
            if let Some(mut x) = m.remove("x-content-schema") {
                inline_refs(&mut x, schemas, 0);
                m.insert("contentSchema".to_string(), x);
            }
            m.values_mut()
                .for_each(|x| inline_content_schemas(x, schemas));
        }
        serde_json::Value::Array(a) => a
            .iter_mut()
            .for_each(|x| inline_content_schemas(x, schemas)),
        _ => {}
    }
}

/// Replaces `{"$ref": "#/components/schemas/X"}` in `v` by X, recursively (the reply types
/// have no cycles; `depth` stops one that would).
fn inline_refs(v: &mut serde_json::Value, schemas: &serde_json::Value, depth: usize) {
    if let Some(name) = v
        .get("$ref")
        .and_then(|r| r.as_str())
        .and_then(|r| r.strip_prefix("#/components/schemas/"))
    {
        if depth < 16 {
            *v = schemas[name].clone();
        }
    }
    match v {
        serde_json::Value::Object(m) => m
            .values_mut()
            .for_each(|x| inline_refs(x, schemas, depth + 1)),
        serde_json::Value::Array(a) => a
            .iter_mut()
            .for_each(|x| inline_refs(x, schemas, depth + 1)),
        _ => {}
    }
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

/// The limits of this worker the request schemas state.
pub(super) fn request_limits(s: &AppState) -> RequestLimits {
    let cfg = s.cfg();
    let info = s.info.model_info();
    RequestLimits {
        max_tokens: u64::from(cfg.limits.max_tokens),
        max_batch_size: cfg.limits.engine.max_batch_size,
        max_seq: (cfg.limits.engine.max_seq_len as usize).min(info.max_seq_len.max(1)),
        vocab: info.vocab_size,
        vision: info.vision,
        max_images: cfg.limits.max_images,
        max_stop_chars: cfg.limits.max_stop_chars,
        max_guide_chars: cfg.limits.max_guide_chars,
        max_guide_choices: cfg.limits.max_guide_choices,
        tools: openai::outputs::Formats::for_pool(s).tools.is_some(),
        image_token: info.image_token,
    }
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
}
