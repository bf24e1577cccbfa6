//! The request extractors of the HTTP layer: a body's bytes within its endpoint's limit, a
//! generation body as it came (parsed later, off the runtime), and the small bodies parsed here
//! and held to the API document ([`crate::doc_check`]) as well as to their types.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use serde::de::DeserializeOwned;

use super::body::{code_of, Fields};
use super::request_bodies::Documented;
use crate::error::bad;
use crate::{ApiError, AppState};

/// A body's bytes, or 413 `body_too_large` / 400 `invalid_body`.
pub(crate) fn body_bytes(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|r| {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body_too_large",
                "request body exceeds this endpoint's limit (limits.maxBodyBytes for \
                 generation, 1 MiB for tokenize, detokenize and route, 64 KiB for admin)",
            )
        } else {
            bad("invalid_body", r.body_text())
        }
    })
}

/// A generation body as it came (chat, completions, responses, `/infer`): its bytes are read
/// on the async runtime, which only moves bytes, and parsed on a preparation thread with the
/// rest of its validation: parsing up to `maxBodyBytes` of JSON is CPU work.
pub(crate) struct RawBody(pub(super) Bytes);

impl<S: Send + Sync> FromRequest<S> for RawBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        body_bytes(Bytes::from_request(req, state).await).map(Self)
    }
}

/// `fields` read by `read`, held to the document's `schema` as well (see
/// [`crate::doc_check`]): a body the document refuses is refused, with the typed
/// read's own code when it refuses it too.
pub(crate) fn documented<T>(
    s: &AppState,
    schema: &str,
    fields: Fields,
    read: impl FnOnce(Fields) -> Result<T, ApiError>,
) -> Result<T, ApiError> {
    let doc = crate::doc_check::check_body(s, schema, fields.value());
    match (doc, read(fields)) {
        (Ok(()), r) | (Err(_), r @ Err(_)) => r,
        (Err(e), Ok(_)) => Err(bad(
            code_of(&e.path),
            format!("{e} (as the API document, GET /openapi.json, states)"),
        )),
    }
}

/// A small JSON body parsed into its fields on the runtime (the routing and tokenizer
/// endpoints, whose bodies are at most 1 MiB), for a handler that reads and checks it within
/// [`documented`].
pub(crate) struct SmallBody(pub(super) Fields);

impl<S: Send + Sync> FromRequest<S> for SmallBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let b = body_bytes(Bytes::from_request(req, state).await)?;
        Fields::parse(&b).map(Self)
    }
}

/// A small JSON body read whole into `T` (the admin, routing and tokenizer endpoints): parsed
/// as [`Fields`], typed and held to the document, with the same codes.
pub(crate) struct Typed<T>(pub(super) T);

impl<T: DeserializeOwned + Documented> FromRequest<Arc<AppState>> for Typed<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &Arc<AppState>) -> Result<Self, ApiError> {
        let b = body_bytes(Bytes::from_request(req, state).await)?;
        documented(state, T::SCHEMA, Fields::parse(&b)?, Fields::all).map(Self)
    }
}

/// A JSON body that may be left out: an empty or blank body, or JSON `null`, reads as
/// `T::default()`.
pub(crate) struct OptionalTyped<T>(pub(super) T);

impl<T: DeserializeOwned + Default + Documented> FromRequest<Arc<AppState>> for OptionalTyped<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &Arc<AppState>) -> Result<Self, ApiError> {
        let b = body_bytes(Bytes::from_request(req, state).await)?;
        if b.iter().all(u8::is_ascii_whitespace) || b.trim_ascii() == b"null" {
            return Ok(Self(T::default()));
        }
        documented(state, T::SCHEMA, Fields::parse(&b)?, Fields::all).map(Self)
    }
}
