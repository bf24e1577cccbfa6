//! Errors of the HTTP layer: every refusal is an [`ApiError`], answered as OpenAI's
//! `{error:{message,type,code}}` with a stable `code`.

use std::collections::BTreeMap;

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use utoipa::openapi::{ContentBuilder, Ref, RefOr, ResponseBuilder};
use utoipa::ToSchema;

use crate::router::RouteError;
use mole_engine::api::EngineError;

/// Why the server refused a request. Stable names via [`ApiError::code`].
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Stable code.
    pub code: &'static str,
    /// Human message.
    pub message: String,
    /// Seconds for Retry-After (429/503).
    pub retry_after: Option<u64>,
}

impl ApiError {
    /// A new error.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            retry_after: None,
        }
    }
    /// The same error, answered with `Retry-After: secs`.
    pub fn with_retry_after(mut self, secs: u64) -> Self {
        self.retry_after = Some(secs);
        self
    }
    /// Stable name (metric label, JSON `code`).
    pub fn code(&self) -> &'static str {
        self.code
    }
    fn kind(&self) -> &'static str {
        match self.status.as_u16() {
            401 | 403 => "authentication_error",
            404 => "not_found_error",
            429 => "rate_limit_error",
            400..=499 => "invalid_request_error",
            _ => "server_error",
        }
    }
    /// The OpenAI error body.
    pub fn body(&self) -> serde_json::Value {
        serde_json::to_value(self.reply()).unwrap_or_default()
    }
    fn reply(&self) -> ErrorReply {
        ErrorReply {
            error: ErrorDetail {
                message: self.message.clone(),
                kind: self.kind(),
                code: self.code,
            },
        }
    }
}

/// OpenAI's error body, every refusal's answer.
#[derive(Serialize, ToSchema)]
pub(super) struct ErrorReply {
    /// What went wrong.
    error: ErrorDetail,
}

/// An error: the message for people, the stable `code` for programs.
#[derive(Serialize, ToSchema)]
pub(super) struct ErrorDetail {
    /// For people.
    message: String,
    /// OpenAI's class: `invalid_request_error`, `authentication_error`, `not_found_error`,
    /// `rate_limit_error` or `server_error`.
    #[serde(rename = "type")]
    kind: &'static str,
    /// Stable name (also the `code` label of `mole_errors_total`).
    code: &'static str,
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        let status = match &e {
            EngineError::Overloaded(_) => StatusCode::TOO_MANY_REQUESTS,
            EngineError::NotReady(_) | EngineError::AdapterReadFailed { .. } => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            EngineError::AdapterNotFound(_) => StatusCode::NOT_FOUND,
            EngineError::InvalidAdapter { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            EngineError::InvalidRequest(_)
            | EngineError::ImagesNotSupported
            | EngineError::InvalidImage(_)
            | EngineError::InvalidGuide { .. }
            | EngineError::TemplateFuelExhausted(_) => StatusCode::BAD_REQUEST,
            EngineError::GuideFailed(_) => StatusCode::UNPROCESSABLE_ENTITY,
            EngineError::ModelDoesNotFit(_)
            | EngineError::UnsupportedQuantization(_)
            | EngineError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        let mut a = ApiError::new(status, e.code(), e.to_string());
        if matches!(status.as_u16(), 429 | 503) {
            a.retry_after = Some(1);
        }
        a
    }
}

impl From<RouteError> for ApiError {
    fn from(e: RouteError) -> Self {
        let status = match e {
            RouteError::UnknownModel(_) => StatusCode::NOT_FOUND,
            RouteError::NoRoute => StatusCode::UNPROCESSABLE_ENTITY,
        };
        ApiError::new(status, e.code(), e.to_string())
    }
}

impl From<tokio::task::JoinError> for ApiError {
    fn from(e: tokio::task::JoinError) -> Self {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            e.to_string(),
        )
    }
}

/// A 400 with a stable code.
pub(crate) fn bad(code: &'static str, msg: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, code, msg)
}

/// The code of the error a response answers, a response extension that the error counter
/// ([`super::layers::count_errors`]) reads.
#[derive(Debug, Clone, Copy)]
pub(super) struct ErrorCode(pub(super) &'static str);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, Json(self.reply())).into_response();
        r.extensions_mut().insert(ErrorCode(self.code));
        if let Some(s) = self.retry_after {
            r.headers_mut().insert("retry-after", HeaderValue::from(s));
        }
        r
    }
}

/// The refusals an API endpoint may answer, each with OpenAI's error body and a stable `code`.
pub(super) struct Refusals;

impl utoipa::IntoResponses for Refusals {
    fn responses() -> BTreeMap<String, RefOr<utoipa::openapi::Response>> {
        [
            (
                "400",
                "Invalid request: bad JSON, a field out of its limits, a bad image",
            ),
            ("401", "Missing or wrong bearer token"),
            ("403", "The token does not grant this endpoint"),
            ("404", "No such model or adapter"),
            ("409", "The config file is not the one expected (reload)"),
            ("413", "Body, image or prompt too large"),
            ("422", "The adapter or the request cannot be served"),
            ("429", "The queue is full (Retry-After)"),
            ("500", "The engine failed the request"),
            ("502", "A merged pod answered something else than an answer"),
            (
                "503",
                "Not ready, or the merged pods are down (Retry-After)",
            ),
            ("504", "limits.requestTimeoutSeconds passed"),
        ]
        .into_iter()
        .map(|(status, why)| {
            let body = ContentBuilder::new()
                .schema(Some(Ref::from_schema_name("ErrorReply")))
                .build();
            let r = ResponseBuilder::new()
                .description(why)
                .content("application/json", body)
                .build();
            (status.to_string(), RefOr::T(r))
        })
        .collect()
    }
}
