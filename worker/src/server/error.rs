//! Errors of the HTTP layer: every refusal is an [`ApiError`], answered as OpenAI's
//! `{error:{message,type,code}}` with a stable `code`.

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::engine::api::EngineError;

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

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut().insert("retry-after", HeaderValue::from(s));
        }
        r
    }
}
