//! The engine's text side as [`PromptCodec`]: the tokenizer, the chat template, the
//! detokenizer and the image placeholders' expansion. None of it runs on the engine thread;
//! the server takes the engine as its codec once at startup, and [`Engine`]'s own submit and
//! scoring tokenize through the same helpers, so a prompt counts the same tokens on both sides.

use super::api::{ChatMessage, EngineError, Image, Prompt, PromptCodec};
use super::images::ImagePrompt;
use super::Engine;

impl Engine {
    /// The prompt's tokens with its images' placeholders expanded, and the images as the
    /// decoder takes them.
    pub(super) fn prompt(
        &self,
        prompt: &Prompt,
        images: &[Image],
    ) -> Result<(Vec<u32>, Option<Box<ImagePrompt>>), EngineError> {
        let ids = self.tokens(prompt)?;
        let Some(proc) = &self.shared.images else {
            return match images.is_empty() {
                true => Ok((ids, None)),
                false => Err(EngineError::ImagesNotSupported),
            };
        };
        // A placeholder without its image is refused too (by `prepare`).
        if images.is_empty() && !proc.has_placeholders(&ids) {
            return Ok((ids, None));
        }
        let (ids, img) = proc.prepare(&ids, images)?;
        Ok((ids, Some(Box::new(img))))
    }

    /// The prompt's own tokens (each image placeholder one token); token ids are checked
    /// against the vocabulary.
    fn tokens(&self, prompt: &Prompt) -> Result<Vec<u32>, EngineError> {
        let t = &self.shared.text;
        let ids = match prompt {
            Prompt::Text(s) => t.encode(s, true),
            Prompt::Templated(s) => t.encode(s, false),
            Prompt::Tokens(ids) => {
                let vocab = self.shared.model.config().vocab_size;
                if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab) {
                    return Err(EngineError::InvalidRequest(format!(
                        "token id {bad} is outside the vocabulary (size {vocab})"
                    )));
                }
                Ok(ids.clone())
            }
        };
        ids.map_err(|e| EngineError::InvalidRequest(e.to_string()))
    }
}

/// The model's own tokenizer and template, read from its directory (or GGUF metadata) at load.
impl PromptCodec for Engine {
    fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, EngineError> {
        self.shared
            .text
            .render_chat_with(messages, true, kwargs)
            .map_err(|e| match e {
                super::text::TextError::TemplateFuel(f) => EngineError::TemplateFuelExhausted(f),
                e => EngineError::InvalidRequest(e.to_string()),
            })
    }

    fn chat_template(&self) -> Option<String> {
        self.shared.text.chat_template().map(String::from)
    }

    fn compile_guide(&self, g: &super::grammar::Guided) -> Result<Vec<String>, EngineError> {
        self.shared
            .grammars
            .compile(g)
            .map(|c| c.unenforced().to_vec())
            .map_err(|e| EngineError::InvalidGuide {
                code: e.code(),
                message: e.to_string(),
            })
    }

    fn tokenize(&self, prompt: &Prompt, images: &[Image]) -> Result<Vec<u32>, EngineError> {
        self.prompt(prompt, images).map(|(ids, _)| ids)
    }

    fn encode(&self, prompt: &Prompt) -> Result<Vec<u32>, EngineError> {
        // The text alone: image placeholders stay one token each (the server adds their
        // images' tokens, the engine expands them at submit).
        self.tokens(prompt)
    }

    fn detokenize(&self, ids: &[u32]) -> Result<String, EngineError> {
        let vocab = self.shared.model.config().vocab_size;
        if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab) {
            return Err(EngineError::InvalidRequest(format!(
                "token id {bad} is outside the vocabulary (size {vocab})"
            )));
        }
        self.shared
            .text
            .decode(ids)
            .map_err(|e| EngineError::InvalidRequest(e.to_string()))
    }

    fn image_tokens(&self, width: u32, height: u32) -> Result<usize, EngineError> {
        self.shared
            .images
            .as_ref()
            .ok_or(EngineError::ImagesNotSupported)?
            .tokens(width, height)
    }
}
