//! Wire types: the JSON bodies of the OpenAI-compatible and mole requests as clients send them,
//! each field typed once. A generation body is a few parts (the fields every generation takes,
//! the structured outputs, the tools, the endpoint's own), each read by [`super::body::Fields`];
//! the OpenAPI document is derived from the same types ([`crate::openapi`]), so what is
//! parsed and what is documented cannot differ in shape.

use serde::Deserialize;
use serde_json::{Map, Value};
use utoipa::ToSchema;

use super::body::Fields;
use super::fields::On;
use super::guided::Guides;
use super::tools::{FunctionTag, ToolFields};
use crate::ApiError;

pub(crate) mod responses;

/// `stop`: one string or up to four, none empty.
#[derive(Deserialize, Debug, Clone, PartialEq)]
#[serde(untagged, expecting = "a string or an array of strings")]
pub(crate) enum StopField {
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
#[derive(Deserialize, ToSchema, Debug)]
#[serde(untagged, expecting = "a string or an array of content parts")]
pub(crate) enum Content {
    Text(String),
    Parts(Vec<Part>),
}

/// A content part's `type`: text (`input_text` as the Responses API names it) or an image
/// (`input_image`).
#[derive(Deserialize, ToSchema, Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PartType {
    #[serde(rename = "text", alias = "input_text")]
    Text,
    #[serde(rename = "image_url", alias = "input_image")]
    Image,
}

/// One content part: `{"type": "text", "text": ...}`, or an image as OpenAI's chat
/// (`{"type": "image_url", "image_url": {"url": ...}}`) or Responses API
/// (`{"type": "input_image", "image_url": ...}`) send it.
#[derive(Deserialize, ToSchema, Debug)]
pub(crate) struct Part {
    /// `text` (`input_text`) or `image_url` (`input_image`).
    #[serde(rename = "type")]
    pub(super) kind: PartType,
    /// A text part's text.
    #[serde(default)]
    pub(super) text: Option<String>,
    /// An image part's image.
    #[serde(default)]
    pub(super) image_url: Option<ImageUrl>,
}

/// An image part's `image_url`: `{"url": ..., "detail": ...}` or the URL alone.
#[derive(Deserialize, ToSchema, Debug)]
#[serde(untagged, expecting = "an image URL, or an object with its url")]
pub(crate) enum ImageUrl {
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
pub(super) fn name_or_label<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(
        untagged,
        expecting = "an adapter's name (a string) or label (an integer)"
    )]
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
pub(super) fn name_or_label_schema() -> utoipa::openapi::schema::Schema {
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

/// `logprobs`: chat's switch or a completion's count (each endpoint refuses the other's).
#[derive(Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(untagged, expecting = "a boolean (chat) or an integer (completions)")]
pub(crate) enum Logprobs {
    /// Chat: whether to return log probabilities.
    Switch(bool),
    /// Completions: how many alternatives per token.
    Count(u64),
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

/// A message's `role`.
#[derive(Deserialize, ToSchema, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Role {
    System,
    User,
    Assistant,
    Tool,
    /// Read as `system`.
    Developer,
}

impl Role {
    /// The role the template sees (`developer` is `system`).
    pub(super) fn template_role(self) -> &'static str {
        match self {
            Role::System | Role::Developer => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// A tool call of an assistant message in the history.
#[derive(Deserialize, ToSchema, Debug, Clone)]
pub(crate) struct InToolCall {
    /// The call's id (`call_...`), which the tool message answering it names.
    #[serde(default)]
    pub(super) id: Option<String>,
    /// `function`.
    #[serde(rename = "type", default)]
    pub(super) _kind: Option<FunctionTag>,
    /// The function called.
    pub(super) function: InFunctionCall,
}

/// A called function: its name and arguments.
#[derive(Deserialize, ToSchema, Debug, Clone)]
pub(crate) struct InFunctionCall {
    /// The function's name.
    pub(super) name: String,
    /// The arguments: a JSON object's text (as OpenAI sends them) or the object.
    pub(super) arguments: Arguments,
}

/// A call's arguments as sent: JSON text, or the object itself.
#[derive(Deserialize, Debug, Clone)]
#[serde(untagged, expecting = "the arguments' JSON text, or a JSON object")]
pub(crate) enum Arguments {
    Text(String),
    Object(Map<String, Value>),
}

impl utoipa::PartialSchema for Arguments {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{OneOfBuilder, Type};
        use utoipa::openapi::ObjectBuilder;
        OneOfBuilder::new()
            .item(
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .content_media_type("application/json")
                    .description(Some(
                        "A JSON object's text (400 invalid_tool_calls otherwise).",
                    )),
            )
            .item(ObjectBuilder::new().schema_type(Type::Object))
            .into()
    }
}
impl ToSchema for Arguments {}

/// A chat message as sent.
#[derive(Deserialize, ToSchema, Debug)]
pub(crate) struct InMessage {
    /// `system`, `user`, `assistant`, `tool`, or `developer` (read as `system`).
    pub(super) role: Role,
    /// The text, or parts (text and images); only an assistant turn may leave it out.
    #[serde(default)]
    pub(super) content: Option<Content>,
    /// An assistant turn's tool calls (the template sees their arguments as objects, as vLLM
    /// hands them to templates).
    #[serde(default)]
    pub(super) tool_calls: Option<Vec<InToolCall>>,
    /// A tool result's call id.
    #[serde(default)]
    pub(super) tool_call_id: Option<String>,
    /// A tool result's function name (or a participant's name, which templates may read).
    #[serde(default)]
    pub(super) name: Option<String>,
    /// An assistant turn's reasoning (vLLM's older field).
    #[serde(default)]
    pub(super) reasoning_content: Option<String>,
    /// An assistant turn's reasoning (vLLM's field).
    #[serde(default)]
    pub(super) reasoning: Option<String>,
}

/// A stream's options.
#[derive(Deserialize, Default, ToSchema, Debug)]
pub(crate) struct StreamOptions {
    /// A chat or completion stream ends with a chunk of no choices that carries the usage.
    #[serde(default)]
    pub(super) include_usage: bool,
}

/// The fields chat, completions and `/infer` share: the model or adapter asked for, and
/// sampling.
#[derive(Deserialize, Default, ToSchema, Debug)]
pub(crate) struct Common {
    /// An adapter, the base model, or the pool (the router decides; also empty or `auto`).
    #[serde(default)]
    pub(super) model: String,
    /// mole extension: the adapter, winning over `model`.
    #[serde(default)]
    pub(super) adapter: Option<String>,
    /// The seeds' name of `adapter`: an adapter's name or its router label.
    #[serde(default, deserialize_with = "name_or_label")]
    #[schema(schema_with = name_or_label_schema)]
    pub(super) expert: Option<String>,
    /// Answer as server-sent events.
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
    /// vLLM's: sample among the `top_k` most likely tokens (0: all).
    pub(super) top_k: Option<usize>,
    /// vLLM's: drop tokens below `min_p` times the most likely one's probability.
    pub(super) min_p: Option<f64>,
    /// OpenAI's presence penalty.
    pub(super) presence_penalty: Option<f64>,
    /// OpenAI's frequency penalty.
    pub(super) frequency_penalty: Option<f64>,
    /// vLLM's multiplicative repetition penalty.
    pub(super) repetition_penalty: Option<f64>,
    /// The same seed gives the same tokens.
    pub(super) seed: Option<u64>,
    /// Text that ends the answer (left out of it).
    #[schema(schema_with = stop_schema)]
    pub(super) stop: Option<StopField>,
    /// Chat: bool; completions: an integer count.
    #[schema(schema_with = logprobs_schema)]
    pub(super) logprobs: Option<Logprobs>,
    /// Chat, beside `logprobs: true`: the most likely alternatives per token, at most 20
    /// (400 `invalid_top_logprobs` otherwise, as OpenAI and vLLM answer).
    #[schema(maximum = 20)]
    pub(super) top_logprobs: Option<usize>,
    /// vLLM's: keep generating past EOS.
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
    /// OpenAI's end-user id: read only as the session that keeps a canary split sticky (after
    /// the `x-session-id` header).
    #[serde(default)]
    pub(super) user: Option<String>,
}

/// Chat's own fields.
#[derive(Deserialize, ToSchema, Debug)]
pub(crate) struct ChatOwn {
    /// The conversation, at least one message.
    #[schema(min_items = 1)]
    pub(super) messages: Vec<InMessage>,
    /// Extra chat-template variables (vLLM's field), e.g. `{"enable_thinking": false}`.
    #[serde(default)]
    pub(super) chat_template_kwargs: Map<String, Value>,
    /// vLLM's: end the prompt with the assistant's turn opening (default true).
    #[serde(default)]
    pub(super) add_generation_prompt: Option<bool>,
    /// vLLM's: the tokenizer's special tokens (BOS) around the rendered template (default
    /// false: the template writes its own).
    #[serde(default)]
    pub(super) add_special_tokens: Option<bool>,
}

/// `POST /v1/chat/completions`.
#[derive(ToSchema, Debug)]
pub(crate) struct ChatBody {
    #[serde(flatten)]
    pub(super) own: ChatOwn,
    /// Tools the model may call.
    #[serde(flatten)]
    pub(super) tools: ToolFields,
    /// Structured outputs.
    #[serde(flatten)]
    pub(super) guides: Guides,
    #[serde(flatten)]
    pub(super) common: Common,
}

impl ChatBody {
    /// The body of `f`, its other fields held to chat's field table.
    pub(super) fn read(mut f: Fields) -> Result<Self, ApiError> {
        let b = Self {
            own: f.take()?,
            tools: f.take()?,
            guides: f.take()?,
            common: f.take()?,
        };
        f.rest(On::CHAT)?;
        Ok(b)
    }
}

/// A completion's `prompt`: text, token ids, or an array of texts (one is served).
#[derive(Deserialize, ToSchema, Debug)]
#[serde(
    untagged,
    expecting = "a string, an array of token ids, or an array of one string"
)]
pub(crate) enum PromptField {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
}

/// Completions' own fields.
#[derive(Deserialize, ToSchema, Debug)]
pub(crate) struct CompletionOwn {
    /// The text (or token ids) to continue.
    pub(super) prompt: PromptField,
    /// vLLM's: the tokenizer's special tokens (BOS) around a text prompt (default true).
    #[serde(default)]
    pub(super) add_special_tokens: Option<bool>,
}

/// `POST /v1/completions`.
#[derive(ToSchema, Debug)]
pub(crate) struct CompletionBody {
    #[serde(flatten)]
    pub(super) own: CompletionOwn,
    /// Structured outputs.
    #[serde(flatten)]
    pub(super) guides: Guides,
    #[serde(flatten)]
    pub(super) common: Common,
}

impl CompletionBody {
    /// The body of `f`, its other fields held to completions' field table.
    pub(super) fn read(mut f: Fields) -> Result<Self, ApiError> {
        let b = Self {
            own: f.take()?,
            guides: f.take()?,
            common: f.take()?,
        };
        f.rest(On::COMPLETIONS)?;
        Ok(b)
    }
}

/// Which OpenAI object shape to answer with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// `chat.completion` (chat, and `/infer`).
    Chat,
    /// `text_completion`.
    Completion,
    /// `response` (the Responses API).
    Response,
}

impl Kind {
    /// The `endpoint` metric label.
    pub(super) fn endpoint(self) -> &'static str {
        match self {
            Kind::Chat => "chat",
            Kind::Completion => "completions",
            Kind::Response => "responses",
        }
    }
    /// The path of the same call on a merged pod.
    pub(super) fn path(self) -> &'static str {
        match self {
            Kind::Chat => "/v1/chat/completions",
            Kind::Completion => "/v1/completions",
            Kind::Response => "/v1/responses",
        }
    }
    /// The prefix of answer ids (OpenAI's: `chatcmpl-`, `cmpl-`, `resp_`).
    pub(super) fn id_prefix(self) -> &'static str {
        match self {
            Kind::Chat => "chatcmpl-",
            Kind::Completion => "cmpl-",
            Kind::Response => "resp_",
        }
    }
}

/// `/infer`'s own fields.
#[derive(Deserialize, ToSchema, Debug)]
pub(crate) struct InferOwn {
    /// The task prompt.
    #[serde(default)]
    pub(super) prompt: Option<String>,
    /// The same as `prompt`, by the seeds' other name.
    #[serde(default)]
    pub(super) input: Option<String>,
    /// The image (the seeds' field): base64 or a `data:` URL, placed before the prompt.
    #[serde(default)]
    pub(super) image_b64: Option<String>,
}

/// `POST /infer`, the seeds' task call: a chat of one user message.
#[derive(ToSchema, Debug)]
pub(crate) struct InferBody {
    #[serde(flatten)]
    pub(super) own: InferOwn,
    /// Structured outputs.
    #[serde(flatten)]
    pub(super) guides: Guides,
    #[serde(flatten)]
    pub(super) common: Common,
}

impl InferBody {
    /// The body of `f`; its other fields are held to chat's field table (it is a chat). The
    /// task's answer is one text, whole: what would ask for more (streaming, choices, log
    /// probabilities) is refused (400 `unsupported_field`), not dropped.
    pub(super) fn read(mut f: Fields) -> Result<Self, ApiError> {
        let b = Self {
            own: f.take()?,
            guides: f.take()?,
            common: f.take()?,
        };
        f.rest(On::CHAT)?;
        let c = &b.common;
        let asked = [
            ("stream", c.stream),
            ("stream_options", c.stream_options.is_some()),
            ("n", c.n.is_some_and(|n| n != 1)),
            (
                "logprobs",
                c.logprobs.is_some_and(|l| l != Logprobs::Switch(false)),
            ),
            ("top_logprobs", c.top_logprobs.is_some()),
        ];
        if let Some((name, _)) = asked.iter().find(|(_, asked)| *asked) {
            return Err(crate::error::bad(
                "unsupported_field",
                format!(
                    "{name} is not served by /infer, whose answer is one text, whole (use \
                     /v1/chat/completions)"
                ),
            ));
        }
        Ok(b)
    }
}

/// `POST /v1/route`: `input`, or chat `messages` (the last user one is routed); the other
/// fields of a chat body sent here are ignored (nothing is generated).
#[derive(Deserialize, ToSchema, Debug)]
pub(crate) struct RouteBody {
    /// The text to route.
    #[serde(default)]
    pub(super) input: Option<String>,
    /// A conversation, whose last user message is routed (`input` wins).
    #[serde(default)]
    pub(super) messages: Option<Vec<InMessage>>,
    /// An adapter, the base model, or the pool (the router decides).
    #[serde(default)]
    pub(super) model: String,
    /// The adapter, winning over `model`.
    #[serde(default)]
    pub(super) adapter: Option<String>,
    /// The seeds' name of `adapter`.
    #[serde(default, deserialize_with = "name_or_label")]
    #[schema(schema_with = name_or_label_schema)]
    pub(super) expert: Option<String>,
}

/// `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vLLM's shape).
#[derive(Deserialize, ToSchema)]
pub(crate) struct LoadBody {
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
pub(crate) struct ReloadBody {
    /// `WorkerConfig::content_hash()` the caller expects the file to have.
    #[serde(default)]
    pub(super) config_hash: Option<String>,
}

/// `POST /tokenize`: a completion's `prompt` or chat `messages` (vLLM's two shapes).
#[derive(Deserialize, utoipa::ToSchema)]
pub(crate) struct TokenizeBody {
    /// A model of this pool (404 `model_not_found` otherwise, as vLLM answers); every model
    /// of a pool shares the base's tokenizer.
    #[serde(default)]
    pub(crate) model: Option<String>,
    #[serde(default)]
    pub(crate) prompt: Option<String>,
    #[serde(default)]
    pub(crate) messages: Option<Vec<InMessage>>,
    /// Chat: end with the assistant's turn opening (vLLM's default: true).
    #[serde(default)]
    pub(crate) add_generation_prompt: Option<bool>,
    /// The tokenizer's special tokens around the text (default: true for a prompt, false for
    /// messages, whose template writes its own).
    #[serde(default)]
    pub(crate) add_special_tokens: Option<bool>,
    #[serde(default)]
    pub(crate) chat_template_kwargs: Map<String, Value>,
}

/// `POST /detokenize`.
#[derive(Deserialize, utoipa::ToSchema)]
pub(crate) struct DetokenizeBody {
    /// A model of this pool (404 `model_not_found` otherwise).
    #[serde(default)]
    pub(crate) model: Option<String>,
    pub(crate) tokens: Vec<u32>,
}

impl Documented for DetokenizeBody {
    const SCHEMA: &'static str = "DetokenizeBody";
}

/// A body type the OpenAPI document describes under a name of its own.
pub(crate) trait Documented {
    /// Its schema's name in the document's components.
    const SCHEMA: &'static str;
}

/// The bodies held to the API document and the schemas they name, built from these types
/// alone: what [`crate::doc_check`] checks a body against, with no endpoint (and so no
/// handler) in sight. The served document lists the endpoints and states the same schemas
/// (`openapi`'s tests hold the two equal).
#[derive(utoipa::OpenApi)]
#[openapi(components(schemas(
    ChatBody,
    CompletionBody,
    InferBody,
    LoadBody,
    ReloadBody,
    RouteBody,
    TokenizeBody,
    DetokenizeBody,
    responses::ResponsesBody
)))]
pub(crate) struct RequestSchemas;

/// The names of the bodies' schemas in the OpenAPI document.
macro_rules! documented {
    ($($t:ty => $name:literal),* $(,)?) => {
        $(impl Documented for $t {
            const SCHEMA: &'static str = $name;
        })*
    };
}
documented! {
    ChatBody => "ChatBody",
    CompletionBody => "CompletionBody",
    InferBody => "InferBody",
    LoadBody => "LoadBody",
    ReloadBody => "ReloadBody",
}
