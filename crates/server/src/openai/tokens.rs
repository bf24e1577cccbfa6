//! vLLM's plain endpoints, which its clients and benchmarks (guidellm) call on any
//! OpenAI-compatible server: `POST /tokenize`, `POST /detokenize` and `GET /version` (`GET
//! /health` sits with the probes).

use axum::extract::State;
use axum::Json;

use super::extract::{documented, SmallBody, Typed};
use super::images;
use super::reply_bodies::{DetokenizeAnswer, TokenizeAnswer, VersionAnswer};
use super::request_bodies::{DetokenizeBody, TokenizeBody};
use super::validate::messages;
use super::S;
use crate::error::bad;
use crate::error::Refusals;
use crate::ApiError;
use mole_engine::api::Prompt;

/// `POST /tokenize` → `{count, max_model_len, tokens}`: the ids the engine would run, image
/// placeholders expanded to their images' tokens.
#[utoipa::path(post, path = "/tokenize", tag = "vllm",
    request_body = TokenizeBody,
    responses((status = 200, description = "The token ids", body = TokenizeAnswer), Refusals),
    security(("bearer" = [])))]
pub async fn tokenize(
    State(s): S,
    SmallBody(f): SmallBody,
) -> Result<Json<TokenizeAnswer>, ApiError> {
    let (b, given) = documented(&s, "TokenizeBody", f, |f| {
        let mut b: TokenizeBody = f.all()?;
        // A text model refuses image parts here, before any is fetched or decoded.
        let given = match b.messages.take() {
            Some(m) => Some(messages(m, &s.cfg().limits, s.info.model_info().vision)?),
            None => None,
        };
        Ok((b, given))
    })?;
    super::models::check_model(&s, b.model.as_deref())?;
    let deadline = s.deadline();
    let (prompt, sources) = match (b.prompt, given) {
        (Some(p), None) => match b.add_special_tokens.unwrap_or(true) {
            true => (Prompt::Text(p), Vec::new()),
            false => (Prompt::Templated(p), Vec::new()),
        },
        (None, Some((msgs, sources))) => {
            let mut kwargs = b.chat_template_kwargs;
            kwargs.insert(
                "add_generation_prompt".into(),
                b.add_generation_prompt.unwrap_or(true).into(),
            );
            // Templating a large body takes long: on the preparation stage.
            let codec = s.codec.clone();
            let text = s
                .prepare
                .run(deadline, move || {
                    Ok(codec.apply_chat_template(&msgs, &kwargs)?)
                })
                .await?;
            match b.add_special_tokens.unwrap_or(false) {
                true => (Prompt::Text(text), sources),
                false => (Prompt::Templated(text), sources),
            }
        }
        (Some(_), Some(_)) => {
            return Err(bad("invalid_request", "give prompt or messages, not both"))
        }
        (None, None) => return Err(bad("invalid_request", "give prompt or messages")),
    };
    let (images, _held) = images::read_all(&s, sources, deadline).await?;
    let codec = s.codec.clone();
    let ids = s
        .prepare
        .run(deadline, move || Ok(codec.tokenize(&prompt, &images)?))
        .await?;
    Ok(Json(TokenizeAnswer {
        count: ids.len(),
        max_model_len: s.info.model_info().max_seq_len,
        tokens: ids,
    }))
}

/// `POST /detokenize` → `{prompt}`: the text of token ids, special tokens left out.
#[utoipa::path(post, path = "/detokenize", tag = "vllm",
    request_body = DetokenizeBody,
    responses((status = 200, description = "The text", body = DetokenizeAnswer), Refusals),
    security(("bearer" = [])))]
pub async fn detokenize(
    State(s): S,
    Typed(b): Typed<DetokenizeBody>,
) -> Result<Json<DetokenizeAnswer>, ApiError> {
    super::models::check_model(&s, b.model.as_deref())?;
    let codec = s.codec.clone();
    let deadline = s.deadline();
    Ok(Json(DetokenizeAnswer {
        prompt: s
            .prepare
            .run(deadline, move || Ok(codec.detokenize(&b.tokens)?))
            .await?,
    }))
}

/// `GET /version` → `{version}`: the worker's version.
#[utoipa::path(get, path = "/version", tag = "vllm",
    responses((status = 200, description = "The worker's version", body = VersionAnswer)))]
pub async fn version() -> Json<VersionAnswer> {
    Json(VersionAnswer {
        version: env!("CARGO_PKG_VERSION"),
    })
}
