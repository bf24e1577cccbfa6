//! `GET` and `DELETE /v1/responses/{id}`: mole stores no responses (every answer says
//! `store: false`, `previous_response_id` is refused), so both answer 404 with a code a client
//! can act on, rather than the router's "no such endpoint".

use axum::extract::Path;
use axum::http::StatusCode;

use super::response_out::ResponseObject;
use crate::error::Refusals;
use crate::ApiError;

/// The answer to a stored response asked for: mole stores none.
fn not_stored(id: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "response_not_found",
        format!(
            "no response {id:?}: this worker stores no responses (every answer says store: \
             false); send the conversation as input"
        ),
    )
}

/// `GET /v1/responses/{id}`: 404 `response_not_found` (mole stores no responses).
#[utoipa::path(get, path = "/v1/responses/{id}", tag = "openai",
    params(("id" = String, Path, description = "A response's id")),
    responses((status = 200, description = "Never: this worker stores no responses", body = ResponseObject), Refusals),
    security(("bearer" = [])))]
pub async fn get_response(Path(id): Path<String>) -> ApiError {
    not_stored(&id)
}

/// `DELETE /v1/responses/{id}`: 404 `response_not_found` (mole stores no responses).
#[utoipa::path(delete, path = "/v1/responses/{id}", tag = "openai",
    params(("id" = String, Path, description = "A response's id")),
    responses((status = 200, description = "Never: this worker stores no responses"), Refusals),
    security(("bearer" = [])))]
pub async fn delete_response(Path(id): Path<String>) -> ApiError {
    not_stored(&id)
}
