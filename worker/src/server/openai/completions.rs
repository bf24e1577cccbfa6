//! `POST /v1/completions`.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;

use super::generate::serve;
use super::validate::{ValidRequest, Wire};
use super::{finish, S};

/// `POST /v1/completions`.
pub async fn completions(
    State(s): S,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = async {
        s.check_api_key(&headers)?;
        let req = ValidRequest::completion(&s, Wire::read(body)?)?;
        serve(&s, &headers, req).await
    }
    .await;
    finish(&s, r)
}
