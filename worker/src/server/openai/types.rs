//! Wire types: the JSON bodies of the OpenAI-compatible and mole requests as clients send them.

use serde::Deserialize;
use serde_json::Value;
use utoipa::ToSchema;

/// `stop`: one string or up to four, none empty.
#[derive(Deserialize)]
#[serde(untagged)]
pub(in crate::server) enum StopField {
    One(String),
    Many(Vec<String>),
}

/// `stop`'s schema.
fn stop_schema() -> utoipa::openapi::schema::Schema {
    use utoipa::openapi::schema::{ArrayBuilder, OneOfBuilder, Type};
    use utoipa::openapi::ObjectBuilder;
    let one = || {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .min_length(Some(1))
    };
    utoipa::openapi::schema::Schema::OneOf(
        OneOfBuilder::new()
            .item(one())
            .item(ArrayBuilder::new().items(one()).max_items(Some(4)))
            .item(ObjectBuilder::new().schema_type(Type::Null))
            .description(Some("One stop sequence or up to four, none empty."))
            .build(),
    )
}

/// A message's `content`: text, or typed parts.
#[derive(Deserialize, ToSchema)]
#[serde(untagged)]
pub(in crate::server) enum Content {
    Text(String),
    Parts(Vec<Part>),
}

/// One content part: `{"type": "text", "text": ...}`, or an image as OpenAI's chat
/// (`{"type": "image_url", "image_url": {"url": ...}}`) or Responses API
/// (`{"type": "input_image", "image_url": ...}`) send it.
#[derive(Deserialize, ToSchema)]
pub(in crate::server) struct Part {
    /// `text` (`input_text`) or `image_url` (`input_image`).
    #[serde(rename = "type")]
    #[schema(schema_with = part_type_schema)]
    pub(super) kind: String,
    #[serde(default)]
    pub(super) text: Option<String>,
    #[serde(default)]
    pub(super) image_url: Option<ImageUrl>,
}

/// An image part's `image_url`: `{"url": ..., "detail": ...}` or the URL alone.
#[derive(Deserialize, ToSchema)]
#[serde(untagged)]
pub(in crate::server) enum ImageUrl {
    Object { url: String },
    Url(String),
}

impl ImageUrl {
    /// The URL (a `data:` URL, or `http(s)://`).
    pub(super) fn url(&self) -> &str {
        match self {
            ImageUrl::Object { url } | ImageUrl::Url(url) => url,
        }
    }
}

/// The seeds' `expert`: an adapter name or its router label, a string or an integer label
/// (`"expert": 1`).
fn name_or_label<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum NameOrLabel {
        Name(String),
        Label(i64),
    }
    Ok(Option::<NameOrLabel>::deserialize(d)?.map(|v| match v {
        NameOrLabel::Name(s) => s,
        NameOrLabel::Label(n) => n.to_string(),
    }))
}

/// `expert`'s schema: an adapter name or an integer label.
fn name_or_label_schema() -> utoipa::openapi::schema::Schema {
    use utoipa::openapi::schema::{OneOfBuilder, Type};
    use utoipa::openapi::ObjectBuilder;
    utoipa::openapi::schema::Schema::OneOf(
        OneOfBuilder::new()
            .item(ObjectBuilder::new().schema_type(Type::String))
            .item(ObjectBuilder::new().schema_type(Type::Integer))
            .item(ObjectBuilder::new().schema_type(Type::Null))
            .description(Some(
                "The adapter's name or router label (string or integer).",
            ))
            .build(),
    )
}

/// `logprobs`' schema: chat's switch or a completion's count.
fn logprobs_schema() -> utoipa::openapi::schema::Schema {
    use utoipa::openapi::schema::{OneOfBuilder, Type};
    use utoipa::openapi::ObjectBuilder;
    utoipa::openapi::schema::Schema::OneOf(OneOfBuilder::new()
        .item(ObjectBuilder::new().schema_type(Type::Boolean))
        .item(ObjectBuilder::new().schema_type(Type::Integer).minimum(Some(0)).maximum(Some(20)))
        .item(ObjectBuilder::new().schema_type(Type::Null))
        .description(Some("Chat: whether to return log probabilities; completions: how many alternatives per token."))
        .build())
}

/// A string among `values`.
fn one_of(values: &[&str]) -> utoipa::openapi::Object {
    utoipa::openapi::ObjectBuilder::new()
        .schema_type(utoipa::openapi::schema::Type::String)
        .enum_values(Some(values.iter().copied()))
        .build()
}

/// A message's `role`.
fn role_schema() -> utoipa::openapi::Object {
    one_of(&["system", "user", "assistant", "tool", "developer"])
}

/// A content part's `type`.
fn part_type_schema() -> utoipa::openapi::Object {
    one_of(&["text", "input_text", "image_url", "input_image"])
}

/// A chat message as sent.
#[derive(Deserialize, ToSchema)]
pub(in crate::server) struct InMessage {
    /// `system`, `user`, `assistant`, `tool`, or `developer` (read as `system`).
    #[schema(schema_with = role_schema)]
    pub(super) role: String,
    #[serde(default)]
    pub(super) content: Option<Content>,
}

/// A stream's options.
#[derive(Deserialize, Default, ToSchema)]
pub(in crate::server) struct StreamOptions {
    #[serde(default)]
    pub(super) include_usage: bool,
}

/// The fields chat, completions, `/infer` and `/v1/route` share: the model or adapter asked
/// for, and sampling.
#[derive(Deserialize, Default, ToSchema)]
pub(in crate::server) struct Common {
    #[serde(default)]
    pub(super) model: String,
    #[serde(default)]
    pub(super) adapter: Option<String>,
    #[serde(default, deserialize_with = "name_or_label")]
    #[schema(schema_with = name_or_label_schema)]
    pub(super) expert: Option<String>,
    #[serde(default)]
    pub(super) stream: bool,
    /// OpenAI's `{"include_usage": true}`: a stream's last chunk carries the usage.
    #[serde(default)]
    pub(super) stream_options: Option<StreamOptions>,
    /// Choices asked for (default 1): they share the prompt's computation, choice `i` sampled
    /// with `seed + i`; at most 128, and at most the pool's `maxBatchSize`.
    #[schema(minimum = 1, maximum = 128)]
    pub(super) n: Option<u64>,
    /// Tokens to generate at most, up to `limits.maxTokens` (default: 256 or that limit).
    #[schema(minimum = 1)]
    pub(super) max_tokens: Option<u64>,
    /// OpenAI's newer name of `max_tokens`; wins over it.
    #[schema(minimum = 1)]
    pub(super) max_completion_tokens: Option<u64>,
    /// Sampling temperature; 0 is greedy.
    #[schema(minimum = 0, maximum = 2)]
    pub(super) temperature: Option<f64>,
    /// Nucleus sampling mass.
    #[schema(exclusive_minimum = 0, maximum = 1)]
    pub(super) top_p: Option<f64>,
    pub(super) top_k: Option<usize>,
    pub(super) min_p: Option<f64>,
    pub(super) presence_penalty: Option<f64>,
    pub(super) frequency_penalty: Option<f64>,
    pub(super) repetition_penalty: Option<f64>,
    pub(super) seed: Option<u64>,
    #[schema(schema_with = stop_schema)]
    pub(super) stop: Option<StopField>,
    /// Chat: bool; completions: an integer count. Kept raw and read per endpoint.
    #[schema(schema_with = logprobs_schema)]
    pub(super) logprobs: Option<Value>,
    /// Chat, beside `logprobs: true`: the most likely alternatives per token, at most 20
    /// (400 `invalid_top_logprobs` otherwise, as OpenAI and vLLM answer).
    #[schema(maximum = 20)]
    pub(super) top_logprobs: Option<usize>,
    #[serde(default)]
    pub(super) ignore_eos: bool,
    /// vLLM extension: token ids that end generation besides EOS; at most 64
    /// (400 `invalid_stop_token_ids`).
    #[serde(default)]
    #[schema(max_items = 64)]
    pub(super) stop_token_ids: Vec<u32>,
    /// vLLM's: a salt mixed into the prompt's prefix-cache keys; requests with different
    /// salts never share cached KV blocks. A non-empty string (400 `invalid_cache_salt`).
    #[schema(min_length = 1)]
    pub(super) cache_salt: Option<String>,
    /// mole extension: forward merged adapters to their pods (default: the router setting).
    #[serde(default)]
    pub(super) prefer_merged: Option<bool>,
    /// Structured outputs (chat and completions).
    #[serde(flatten)]
    #[allow(dead_code)] // validation reads them from the raw body (guided.rs)
    pub(super) guided: super::guided::GuidedFields,
}

impl Common {
    /// The explicitly named adapter: `adapter`, else the seeds' `expert`.
    pub(super) fn named_adapter(&self) -> Option<&str> {
        self.adapter.as_deref().or(self.expert.as_deref())
    }
}

/// `POST /v1/chat/completions`.
#[derive(Deserialize, ToSchema)]
pub(in crate::server) struct ChatBody {
    /// The conversation, at least one message.
    #[schema(min_items = 1)]
    pub(super) messages: Vec<InMessage>,
    /// Extra chat-template variables (vLLM's field), e.g. `{"enable_thinking": false}`.
    #[serde(default)]
    pub(super) chat_template_kwargs: serde_json::Map<String, Value>,
    /// vLLM's: end the prompt with the assistant's turn opening (default true).
    #[serde(default)]
    pub(super) add_generation_prompt: Option<bool>,
    /// vLLM's: the tokenizer's special tokens (BOS) around the rendered template (default
    /// false: the template writes its own).
    #[serde(default)]
    pub(super) add_special_tokens: Option<bool>,
    /// Tools the model may call.
    #[serde(flatten)]
    #[allow(dead_code)] // validation reads them from the raw body (tools.rs)
    pub(super) tools: super::tools::ToolFields,
    #[serde(flatten)]
    pub(super) common: Common,
}

/// A completion's `prompt`: text, token ids, or an array of texts (one is served).
#[derive(Deserialize, ToSchema)]
#[serde(untagged)]
pub(in crate::server) enum PromptField {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
}

/// `POST /v1/completions`.
#[derive(Deserialize, ToSchema)]
pub(in crate::server) struct CompletionBody {
    pub(super) prompt: PromptField,
    /// vLLM's: the tokenizer's special tokens (BOS) around a text prompt (default true).
    #[serde(default)]
    pub(super) add_special_tokens: Option<bool>,
    #[serde(flatten)]
    pub(super) common: Common,
}

/// Which OpenAI object shape to answer with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::server) enum Kind {
    /// `chat.completion` (chat, and `/infer`).
    Chat,
    /// `text_completion`.
    Completion,
}

impl Kind {
    /// The `endpoint` metric label.
    pub(super) fn endpoint(self) -> &'static str {
        match self {
            Kind::Chat => "chat",
            Kind::Completion => "completions",
        }
    }
    /// The path of the same call on a merged pod.
    pub(super) fn path(self) -> &'static str {
        match self {
            Kind::Chat => "/v1/chat/completions",
            Kind::Completion => "/v1/completions",
        }
    }
    /// The prefix of answer ids.
    pub(super) fn id_prefix(self) -> &'static str {
        match self {
            Kind::Chat => "chatcmpl",
            Kind::Completion => "cmpl",
        }
    }
}

/// `POST /infer`, the seeds' task call.
#[derive(Deserialize, ToSchema)]
pub(in crate::server) struct InferBody {
    /// The task prompt (`input` is accepted as an alias).
    #[serde(alias = "input")]
    pub(super) prompt: String,
    /// The image (the seeds' field): base64 or a `data:` URL, placed before the prompt.
    #[serde(default)]
    pub(super) image_b64: Option<String>,
    #[serde(flatten)]
    pub(super) common: Common,
}

/// `POST /v1/route`: `input`, or chat `messages` (the last user one is routed).
#[derive(Deserialize, ToSchema)]
pub(in crate::server) struct RouteBody {
    #[serde(default)]
    pub(super) input: Option<String>,
    #[serde(default)]
    pub(super) messages: Option<Vec<InMessage>>,
    #[serde(flatten)]
    pub(super) common: Common,
}

/// `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vLLM's shape).
#[derive(Deserialize, ToSchema)]
pub(in crate::server) struct LoadBody {
    pub(super) lora_name: String,
    #[serde(default)]
    pub(super) lora_path: Option<String>,
    /// vLLM's in-place reload: read the adapter again even when this name already serves
    /// this directory (its files were replaced). Without it such a call answers at once.
    #[serde(default)]
    pub(super) load_inplace: bool,
}

/// `POST /admin/reload`'s optional body.
#[derive(Deserialize, Default, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(in crate::server) struct ReloadBody {
    /// `WorkerConfig::content_hash()` the caller expects the file to have.
    #[serde(default)]
    pub(super) config_hash: Option<String>,
}
