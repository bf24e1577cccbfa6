//! The Responses API's request body (`POST /v1/responses`) as clients send it: `input` (a
//! text, or items), `instructions`, its tools and `tool_choice`, `text.format`, `reasoning`,
//! and the fields it shares with chat. What the handler makes of it is
//! [`crate::openai::responses`]'s.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::{Map, Value};
use utoipa::ToSchema;

use super::super::body::Fields;
use super::super::fields::On;
use super::super::guided::SchemaArg;
use super::super::tools::ToolMode;
use super::Common;
use crate::ApiError;

tag!(MessageTag, "message");
tag!(FunctionCallTag, "function_call");
tag!(FunctionCallOutputTag, "function_call_output");
tag!(ReasoningTag, "reasoning");

/// `input`: a text (one user message), or items.
#[derive(Deserialize, ToSchema, Debug)]
#[serde(untagged, expecting = "a string, or an array of input items")]
pub(crate) enum Input {
    Text(String),
    Items(Vec<InputItem>),
}

/// An input item.
#[derive(Deserialize, ToSchema, Debug)]
#[serde(
    untagged,
    expecting = "an input item: a message, function_call, function_call_output or reasoning"
)]
pub(crate) enum InputItem {
    Message(MessageItem),
    FunctionCall(FunctionCallItem),
    FunctionCallOutput(FunctionCallOutputItem),
    Reasoning(ReasoningItem),
}

/// A message's role.
#[derive(Deserialize, ToSchema, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub(crate) enum InputRole {
    User,
    Assistant,
    System,
    /// Read as `system`.
    Developer,
}

/// A message (`type` may be left out, as OpenAI's "easy" input messages do).
#[derive(Deserialize, ToSchema, Debug)]
pub(crate) struct MessageItem {
    /// `message`.
    #[serde(rename = "type", default)]
    pub(crate) _kind: Option<MessageTag>,
    /// Who says it.
    pub(crate) role: InputRole,
    /// The text, or parts.
    pub(crate) content: ItemContent,
}

/// A message's content, or a tool output's.
#[derive(Deserialize, ToSchema, Debug)]
#[serde(untagged, expecting = "a string, or an array of content parts")]
pub(crate) enum ItemContent {
    Text(String),
    Parts(Vec<ItemPart>),
}

/// A content part.
#[derive(Deserialize, ToSchema, Debug)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(crate) enum ItemPart {
    /// Text the user (or system) says.
    InputText {
        /// The text.
        text: String,
    },
    /// Text an earlier answer said.
    OutputText {
        /// The text.
        text: String,
    },
    /// An image: a `data:` URL, base64, or an http(s) URL of an allowed host (`detail` is
    /// accepted and not read: an image is read at the resolution the model's processor takes).
    InputImage {
        /// The image.
        #[serde(default)]
        image_url: Option<String>,
        /// A stored file's id: not served (no Files API), only null.
        #[serde(default)]
        file_id: Option<String>,
    },
    /// An earlier answer's refusal.
    Refusal {
        /// Its text.
        refusal: String,
    },
}

/// A function call an earlier answer made.
#[derive(Deserialize, ToSchema, Debug)]
pub(crate) struct FunctionCallItem {
    /// `function_call`.
    #[serde(rename = "type")]
    pub(crate) _kind: FunctionCallTag,
    /// The call's id, which its output names.
    pub(crate) call_id: String,
    /// The function.
    pub(crate) name: String,
    /// Its arguments: a JSON object's text.
    #[schema(content_media_type = "application/json")]
    pub(crate) arguments: String,
}

/// What a called function returned.
#[derive(Deserialize, ToSchema, Debug)]
pub(crate) struct FunctionCallOutputItem {
    /// `function_call_output`.
    #[serde(rename = "type")]
    pub(crate) _kind: FunctionCallOutputTag,
    /// The call it answers: a `function_call` earlier in `input`.
    pub(crate) call_id: String,
    /// The result: text, or text parts.
    pub(crate) output: ItemContent,
}

/// An earlier answer's reasoning (given back as the next assistant turn's reasoning).
#[derive(Deserialize, ToSchema, Debug)]
pub(crate) struct ReasoningItem {
    /// `reasoning`.
    #[serde(rename = "type")]
    pub(crate) _kind: ReasoningTag,
    /// Summaries (mole writes none; a client's are read as reasoning).
    #[serde(default)]
    pub(crate) summary: Vec<ReasoningText>,
    /// The reasoning's text.
    #[serde(default)]
    pub(crate) content: Option<Vec<ReasoningText>>,
}

/// A piece of reasoning text (`summary_text` or `reasoning_text`).
#[derive(Deserialize, ToSchema, Debug)]
pub(crate) struct ReasoningText {
    /// The text.
    pub(crate) text: String,
}

/// `text`: the answer's format.
#[derive(Deserialize, ToSchema, Debug, Default)]
pub(crate) struct TextConfig {
    /// `text` (default), `json_object`, or `json_schema`.
    #[serde(default)]
    pub(crate) format: Option<TextFormat>,
    /// OpenAI's answer length hint: only `medium` (the default) or null.
    #[serde(default)]
    #[schema(schema_with = medium_or_null)]
    pub(crate) verbosity: Option<String>,
}

/// `medium` or null.
fn medium_or_null() -> utoipa::openapi::Object {
    utoipa::openapi::ObjectBuilder::new()
        .schema_type(utoipa::openapi::schema::SchemaType::AnyValue)
        .enum_values(Some([Value::from("medium"), Value::Null]))
        .build()
}

/// `text.format`.
#[derive(Deserialize, ToSchema, Debug)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(crate) enum TextFormat {
    /// Free text.
    Text,
    /// A JSON object.
    JsonObject,
    /// JSON valid against `schema`.
    JsonSchema {
        /// The format's name (echoed in the answer).
        #[serde(default)]
        name: Option<String>,
        /// The schema.
        schema: SchemaArg,
        /// OpenAI's `strict` (see chat's `response_format`).
        #[serde(default)]
        strict: Option<bool>,
    },
}

/// `reasoning`.
#[derive(Deserialize, ToSchema, Debug, Default)]
pub(crate) struct ReasoningConfig {
    /// Handed to the chat template as `reasoning_effort`, as vLLM does (templates that read it
    /// act on it; others do not).
    #[serde(default)]
    pub(crate) effort: Option<Effort>,
    /// A summary of the reasoning: mole writes none (the reasoning itself is the item's
    /// `content`); any value is accepted.
    #[serde(default)]
    pub(crate) summary: Option<String>,
    /// The older name of `summary`.
    #[serde(default)]
    pub(crate) generate_summary: Option<String>,
}

/// `reasoning.effort`.
#[derive(Deserialize, ToSchema, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Effort {
    None,
    Minimal,
    Low,
    Medium,
    High,
    Xhigh,
}

impl Effort {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Effort::None => "none",
            Effort::Minimal => "minimal",
            Effort::Low => "low",
            Effort::Medium => "medium",
            Effort::High => "high",
            Effort::Xhigh => "xhigh",
        }
    }
}

/// What `include` may ask for.
#[derive(Deserialize, ToSchema, Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Includable {
    /// The reasoning encrypted, for a stateless client to give back: mole's reasoning items
    /// carry their text, which a client gives back as it is (nothing is encrypted).
    #[serde(rename = "reasoning.encrypted_content")]
    ReasoningEncryptedContent,
}

/// A tool: a function (OpenAI's hosted tools are not served).
#[derive(Deserialize, ToSchema, Debug)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(crate) enum ResponseTool {
    /// A function the model may call.
    Function {
        /// Its name.
        #[schema(min_length = 1)]
        name: String,
        /// What it does.
        #[serde(default)]
        description: Option<String>,
        /// A JSON schema of its arguments (default: any object).
        #[serde(default)]
        parameters: Option<Map<String, Value>>,
        /// OpenAI's `strict`.
        #[serde(default)]
        strict: Option<bool>,
    },
}

/// `tool_choice`.
#[derive(Deserialize, ToSchema, Debug)]
#[serde(
    untagged,
    expecting = "none, auto, required, or {\"type\": \"function\", \"name\": ...}"
)]
pub(crate) enum ResponseToolChoice {
    /// `none`, `auto` or `required`.
    Mode(ToolMode),
    /// One function by name.
    Function(NamedResponseFunction),
}

/// A function named by `tool_choice`.
#[derive(Deserialize, ToSchema, Debug)]
pub(crate) struct NamedResponseFunction {
    /// `function`.
    #[serde(rename = "type")]
    pub(crate) _kind: super::super::tools::FunctionTag,
    /// The function, one of `tools`.
    pub(crate) name: String,
}

/// The Responses API's own fields.
#[derive(Deserialize, ToSchema, Debug)]
pub(crate) struct ResponsesOwn {
    /// The conversation: a text (one user message), or items.
    pub(crate) input: Input,
    /// A system message before the input.
    #[serde(default)]
    pub(crate) instructions: Option<String>,
    /// Tokens to generate at most, up to `limits.maxTokens`.
    #[schema(minimum = 1)]
    pub(crate) max_output_tokens: Option<u64>,
    /// The answer's format.
    #[serde(default)]
    pub(crate) text: Option<TextConfig>,
    /// A reasoning model's settings.
    #[serde(default)]
    pub(crate) reasoning: Option<ReasoningConfig>,
    /// What else to include in the answer.
    #[serde(default)]
    pub(crate) include: Option<Vec<Includable>>,
    /// Up to 16 tags (keys of 64 characters at most, values of 512), echoed in the answer.
    #[serde(default)]
    pub(crate) metadata: Option<BTreeMap<String, String>>,
    /// Extra chat-template variables (vLLM's field), e.g. `{"enable_thinking": false}`.
    #[serde(default)]
    pub(crate) chat_template_kwargs: Map<String, Value>,
}

/// The Responses API's tool fields.
#[derive(Deserialize, ToSchema, Debug, Default)]
pub(crate) struct ResponseToolFields {
    /// Functions the model may call.
    #[serde(default)]
    pub(crate) tools: Option<Vec<ResponseTool>>,
    /// `none`, `auto` (default with tools), `required`, or `{"type": "function", "name"}`;
    /// other than `none` only beside tools.
    #[serde(default)]
    pub(crate) tool_choice: Option<ResponseToolChoice>,
    /// Whether the model may call several functions in one answer (default true).
    #[serde(default)]
    pub(crate) parallel_tool_calls: Option<bool>,
}

/// `POST /v1/responses`.
#[derive(ToSchema, Debug)]
pub(crate) struct ResponsesBody {
    #[serde(flatten)]
    pub(crate) own: ResponsesOwn,
    #[serde(flatten)]
    pub(crate) tools: ResponseToolFields,
    /// The fields chat's and this API's tables share (model, routing, sampling): the others
    /// of chat's are not this API's.
    #[serde(flatten)]
    pub(crate) common: Common,
}

impl super::Documented for ResponsesBody {
    const SCHEMA: &'static str = "ResponsesBody";
}

impl ResponsesBody {
    /// The body of `f`, its other fields held to the Responses API's field table.
    pub(crate) fn read(mut f: Fields) -> Result<Self, ApiError> {
        let b = Self {
            own: f.take()?,
            tools: f.take()?,
            common: f.take_for(On::RESPONSES)?,
        };
        f.rest(On::RESPONSES)?;
        Ok(b)
    }
}
