//! Errors of the HTTP layer: every refusal is an [`ApiError`], answered as OpenAI's
//! `{error:{message,type,code}}` with a stable `code`.

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::engine::api::EngineError;
use crate::router::RouteError;

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
        json!({"error": {"message": self.message, "type": self.kind(), "code": self.code}})
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        let status = match &e {
            EngineError::Overloaded(_) => StatusCode::TOO_MANY_REQUESTS,
            EngineError::NotReady(_) => StatusCode::SERVICE_UNAVAILABLE,
            EngineError::AdapterNotFound(_) => StatusCode::NOT_FOUND,
            EngineError::InvalidAdapter { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            EngineError::InvalidRequest(_) => StatusCode::BAD_REQUEST,
            EngineError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
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

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut().insert("retry-after", HeaderValue::from(s));
        }
        r
    }
}
