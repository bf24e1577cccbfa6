//! `POST /v1/completions`: its validation (the prompt forms).

use axum::body::Bytes;

use super::body::Fields;
use super::request_bodies::{CompletionBody, Kind, PromptField};
use super::validate::{check_prompt_bytes, sampling, Caps, Parts, ValidRequest, Validate};
use crate::error::bad;
use crate::{ApiError, AppState};
use mole_engine::api::Prompt;
use mole_engine::grammar::Guided;

impl Validate for CompletionBody {
    /// A string, a one-string array, or token ids of the vocabulary; the router reads the text.
    fn validate(
        fields: Fields,
        forward: Option<Bytes>,
        s: &AppState,
    ) -> Result<ValidRequest, ApiError> {
        let b = CompletionBody::read(fields)?;
        let mut sp = sampling(&b.common, false, &Caps::of(s))?;
        sp.guide = super::guided::guide(b.guides, &s.cfg().limits)?
            .map(|guide| Guided { guide, after: None });
        let info = s.info.model_info();
        let prompt = match completion_prompt(b.own.prompt, info.vocab_size, info.image_token)? {
            Prompt::Text(t) if b.own.add_special_tokens == Some(false) => Prompt::Templated(t),
            p => p,
        };
        if let Prompt::Text(t) | Prompt::Templated(t) = &prompt {
            // A text that cannot fit is refused before it is tokenized.
            check_prompt_bytes(s, t.len() as u64)?;
        }
        let route_text = match &prompt {
            Prompt::Text(t) | Prompt::Templated(t) => t.clone(),
            Prompt::Tokens(_) => String::new(),
        };
        let parts = Parts {
            kind: Kind::Completion,
            prompt,
            route_text,
            forward,
            images: Vec::new(),
            whole: false,
            sampling: sp,
            parse: None,
        };
        ValidRequest::new(s, b.common, parts)
    }
}

/// A completion's prompt: a string, a one-string array, or a non-empty array of token ids
/// below `vocab` (0: unknown, not checked), none of them a vision model's image placeholder
/// (`image`: a completion takes no images for one to stand for).
fn completion_prompt(p: PromptField, vocab: usize, image: Option<u32>) -> Result<Prompt, ApiError> {
    match p {
        PromptField::Text(t) => Ok(Prompt::Text(t)),
        PromptField::Tokens(t) if !t.is_empty() => {
            if let Some(bad_id) = t.iter().find(|&&i| vocab > 0 && i as usize >= vocab) {
                return Err(bad(
                    "invalid_token_id",
                    format!("token id {bad_id} >= vocab size {vocab}"),
                ));
            }
            if let Some(i) = image.filter(|i| t.contains(i)) {
                return Err(bad(
                    "invalid_token_id",
                    format!("token id {i} is the model's image placeholder; a completion takes no images"),
                ));
            }
            Ok(Prompt::Tokens(t))
        }
        PromptField::Texts(mut v) if v.len() == 1 => Ok(Prompt::Text(v.remove(0))),
        _ => Err(bad(
            "invalid_prompt",
            "prompt must be a string, one-string array or a non-empty token id array",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn refused<T: std::fmt::Debug>(r: Result<T, ApiError>) -> &'static str {
        r.unwrap_err().code()
    }

    #[test]
    fn completion_prompts() {
        let p =
            |v: Value, vocab| completion_prompt(serde_json::from_value(v).unwrap(), vocab, None);
        assert_eq!(p(json!("hi"), 10).unwrap(), Prompt::Text("hi".into()));
        assert_eq!(p(json!(["hi"]), 10).unwrap(), Prompt::Text("hi".into()));
        assert_eq!(p(json!([1, 9]), 10).unwrap(), Prompt::Tokens(vec![1, 9]));
        assert_eq!(p(json!([99]), 0).unwrap(), Prompt::Tokens(vec![99]));
        assert_eq!(refused(p(json!([10]), 10)), "invalid_token_id");
        assert_eq!(refused(p(json!([]), 10)), "invalid_prompt");
        assert_eq!(refused(p(json!(["a", "b"]), 10)), "invalid_prompt");
        let image = completion_prompt(serde_json::from_value(json!([1, 7])).unwrap(), 10, Some(7));
        assert_eq!(refused(image), "invalid_token_id");
    }
}
