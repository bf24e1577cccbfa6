//! Reply types: the JSON bodies the endpoints answer with. Handlers serialize these and
//! nothing else, so the OpenAPI document (`GET /openapi.json`), derived from the same types,
//! describes what is sent.

use serde::Serialize;
use serde_json::{Map, Value};
use utoipa::ToSchema;

use crate::router::{Decision, Mode};

/// How a request was routed and served: the `mole` field of answers, and `POST /v1/route`'s
/// whole answer.
#[derive(Serialize, ToSchema, Clone, Debug)]
pub(crate) struct MoleInfo {
    /// The adapter serving it; null for the base model.
    pub(super) adapter: Option<String>,
    /// The adapter version that served it, once known (not in `/v1/route`'s answer).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) adapter_version: Option<String>,
    /// How it is served.
    #[schema(schema_with = mode_schema)]
    pub(super) mode: Mode,
    /// The router rule that chose it (`explicit`, `keywords`, `classifier`, ...).
    pub(super) route: String,
    /// The rule's confidence, when it has one.
    pub(super) score: Option<f64>,
    /// What of the answer's JSON schema was not enforced (a schema sent without `strict: true`
    /// whose keywords the grammar engine approximates: `uniqueItems`, `format: phone`,
    /// `oneOf` read as `anyOf`...); left out when everything was.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(super) unenforced: Vec<String>,
}

/// `mode`'s schema: the wire names of [`Mode`] (the router stays free of HTTP concerns).
fn mode_schema() -> utoipa::openapi::Object {
    utoipa::openapi::ObjectBuilder::new()
        .schema_type(utoipa::openapi::schema::Type::String)
        .enum_values(Some(["dynamic", "merged", "base"]))
        .build()
}

impl MoleInfo {
    /// The decision `d`, served by `version`.
    pub(super) fn new(d: &Decision, version: Option<String>) -> Self {
        Self {
            adapter: d.adapter.clone(),
            adapter_version: version,
            mode: d.mode,
            route: d.reason.clone(),
            score: d.score,
            unenforced: Vec::new(),
        }
    }
}

/// Token counts of a request.
#[derive(Serialize, ToSchema, Clone, Copy, Debug)]
pub(crate) struct UsageInfo {
    /// Prompt tokens, image tokens included.
    pub(super) prompt_tokens: usize,
    /// Generated tokens.
    pub(super) completion_tokens: usize,
    /// Their sum.
    pub(super) total_tokens: usize,
    /// What the prompt's count is made of.
    pub(super) prompt_tokens_details: PromptTokensDetails,
}

/// OpenAI's `usage.prompt_tokens_details`.
#[derive(Serialize, ToSchema, Clone, Copy, Debug, Default)]
pub(crate) struct PromptTokensDetails {
    /// Prompt tokens whose keys and values came from the prefix cache rather than being
    /// computed (as OpenAI, vLLM and llama.cpp report them).
    pub(super) cached_tokens: usize,
}

/// An OpenAI completion object, whole or one chunk of a stream, around choices `C`.
#[derive(Serialize, ToSchema, Debug)]
pub(crate) struct Answer<C> {
    /// The answer's id (the same in every chunk of a stream).
    pub(super) id: String,
    /// `chat.completion`, `chat.completion.chunk` or `text_completion`.
    pub(super) object: &'static str,
    /// Seconds since the epoch.
    pub(super) created: u64,
    /// The `model` asked for (the pool's name when none was).
    pub(super) model: String,
    /// One choice (`n` is 1); none in a stream's closing usage chunk.
    pub(super) choices: Vec<C>,
    /// Token counts: on whole answers, and on a stream's last chunk when
    /// `stream_options.include_usage` asked for it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) usage: Option<UsageInfo>,
    /// How it was routed and served: on whole answers, and on a stream's first and last
    /// content chunks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) mole: Option<MoleInfo>,
}

/// Why generation ended: `stop` (EOS or a stop sequence), `length` (`max_tokens` or the
/// context), `cancelled`; null while a stream goes on.
pub(super) type Finish = Option<&'static str>;

/// A whole chat answer's choice.
#[derive(Serialize, ToSchema, Debug)]
pub(crate) struct ChatChoice {
    /// The choice's place, 0 to `n - 1`.
    pub(super) index: u32,
    /// The assistant's message.
    pub(super) message: AssistantMessage,
    /// Why generation ended.
    #[schema(value_type = Option<String>)]
    pub(super) finish_reason: Finish,
    /// The tokens' log probabilities, when `logprobs` asked for them.
    pub(super) logprobs: Option<ChatLogprobs>,
}

/// The assistant's message of a chat answer.
#[derive(Serialize, ToSchema, Debug)]
pub(crate) struct AssistantMessage {
    /// `assistant`.
    pub(super) role: &'static str,
    /// The generated text (the answer after the reasoning); null when the answer is tool
    /// calls alone.
    pub(super) content: Option<String>,
    /// The reasoning (`<think>`...`</think>` of Qwen3, QwQ, DeepSeek-R1), vLLM's field.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) reasoning: Option<String>,
    /// The same, under vLLM's older name, for clients that read it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) reasoning_content: Option<String>,
    /// The tool calls the model made.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) tool_calls: Option<Vec<ToolCallOut>>,
}

/// A tool call, whole (`tool_calls` of a message) or a stream's piece of it (`index` set;
/// the first piece has the id, type and name with empty arguments, the later ones more of the
/// arguments as the model writes them).
#[derive(Serialize, ToSchema, Debug, Clone, PartialEq)]
pub(crate) struct ToolCallOut {
    /// The call's place among the choice's calls (stream deltas only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) index: Option<u32>,
    /// `call_...` (the first piece).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) id: Option<String>,
    /// `function` (the first piece).
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub(super) kind: Option<&'static str>,
    /// The function's name and arguments (a JSON object's text).
    pub(super) function: FunctionCall,
}

/// A tool call's function.
#[derive(Serialize, ToSchema, Debug, Clone, PartialEq)]
pub(crate) struct FunctionCall {
    /// The function's name (a stream's first piece).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) name: Option<String>,
    /// Its arguments (JSON text; a stream's later pieces).
    pub(super) arguments: String,
}

/// A chat stream chunk's choice.
#[derive(Serialize, ToSchema, Debug)]
pub(crate) struct ChunkChoice {
    /// The choice's place, 0 to `n - 1`.
    pub(super) index: u32,
    /// The text added by this chunk (the first chunk names the role).
    pub(super) delta: Delta,
    /// Why generation ended, on the last content chunk.
    #[schema(value_type = Option<String>)]
    pub(super) finish_reason: Finish,
    /// The chunk's tokens' log probabilities, when asked for.
    pub(super) logprobs: Option<ChatLogprobs>,
}

/// What a chat chunk adds.
#[derive(Serialize, ToSchema, Debug)]
pub(crate) struct Delta {
    /// `assistant`, on the first chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) role: Option<&'static str>,
    /// Text.
    pub(super) content: String,
    /// Reasoning text (vLLM's `delta.reasoning`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) reasoning: Option<String>,
    /// The same, under vLLM's older name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) reasoning_content: Option<String>,
    /// Tool-call pieces.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) tool_calls: Option<Vec<ToolCallOut>>,
}

/// A completion's choice (whole, or a stream chunk's).
#[derive(Serialize, ToSchema, Debug)]
pub(crate) struct TextChoice {
    /// The choice's place, 0 to `n - 1`.
    pub(super) index: u32,
    /// The generated text (a chunk's part of it).
    pub(super) text: String,
    /// Why generation ended.
    #[schema(value_type = Option<String>)]
    pub(super) finish_reason: Finish,
    /// The tokens' log probabilities, when `logprobs` asked for them.
    pub(super) logprobs: Option<TextLogprobs>,
}

/// A chat choice's `logprobs`.
#[derive(Serialize, ToSchema, Debug)]
pub(crate) struct ChatLogprobs {
    /// One entry per generated token.
    pub(super) content: Vec<TokenLogprob>,
}

/// One generated token's log probability and its most likely alternatives.
#[derive(Serialize, ToSchema, Debug)]
pub(crate) struct TokenLogprob {
    /// The token's text.
    pub(super) token: String,
    /// Its log probability.
    pub(super) logprob: f32,
    /// Its text's UTF-8 bytes.
    pub(super) bytes: Vec<u8>,
    /// The `top_logprobs` most likely tokens at that position.
    pub(super) top_logprobs: Vec<TopLogprob>,
}

/// An alternative token at a position.
#[derive(Serialize, ToSchema, Debug)]
pub(crate) struct TopLogprob {
    /// The token's text.
    pub(super) token: String,
    /// Its log probability.
    pub(super) logprob: f32,
    /// Its text's UTF-8 bytes.
    pub(super) bytes: Vec<u8>,
}

/// A completion choice's `logprobs` (the legacy completions shape).
#[derive(Serialize, ToSchema, Debug)]
pub(crate) struct TextLogprobs {
    /// The generated tokens' texts.
    pub(super) tokens: Vec<String>,
    /// Their log probabilities.
    pub(super) token_logprobs: Vec<f32>,
    /// Per position, the most likely tokens' texts to their log probabilities, most likely
    /// first.
    #[schema(value_type = Vec<std::collections::HashMap<String, f32>>)]
    pub(super) top_logprobs: Vec<Map<String, Value>>,
}

/// `POST /infer`'s answer, the seeds' shape.
#[derive(Serialize, ToSchema, Debug)]
pub(crate) struct TaskAnswer {
    /// The generated text.
    pub(super) task_output: String,
    /// Why generation ended.
    pub(super) finish_reason: Option<String>,
    /// The adapter that answered; null for the base model.
    pub(super) routed_adapter: Option<String>,
    /// Its version.
    pub(super) adapter_version: Option<String>,
    /// How it was served (`dynamic`, `merged` or `base`).
    #[schema(schema_with = mode_schema)]
    pub(super) mode: String,
    /// The router rule that chose the adapter.
    pub(super) route: String,
    /// Token counts.
    pub(super) usage: UsageInfo,
}

/// `GET /v1/models`.
#[derive(Serialize, ToSchema, Debug)]
pub(crate) struct ModelList {
    /// `list`.
    pub(super) object: &'static str,
    /// The pool, the base model and every configured adapter.
    pub(super) data: Vec<ModelCard>,
}

/// One servable `model`.
#[derive(Serialize, ToSchema, Debug)]
pub(crate) struct ModelCard {
    /// The name to put in a request's `model`.
    pub(super) id: String,
    /// `model`.
    pub(super) object: &'static str,
    /// Seconds since the epoch.
    pub(super) created: u64,
    /// `mole`.
    pub(super) owned_by: &'static str,
    /// The base model.
    pub(super) root: String,
    /// The base model, for adapters.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) parent: Option<String>,
    /// What it is in the pool.
    pub(super) mole: ModelKind,
}

/// A model card's `mole` field.
#[derive(Serialize, ToSchema, Debug)]
pub(crate) struct ModelKind {
    /// `pool` (routed by the router), `base` or `adapter`.
    pub(super) kind: &'static str,
    /// An adapter's configured version.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) version: Option<String>,
    /// An adapter's serving mode (`dynamic` or `merged`).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>)]
    pub(super) mode: Option<mole_api::ServingMode>,
    /// Whether an adapter is loaded and serving here.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) loaded: Option<bool>,
    /// An adapter's description.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) description: Option<String>,
    /// The pool's and the base's cards: bytes the base model's weights hold in this pod's
    /// engine as loaded — a quantized base (GGUF, AWQ/GPTQ, a `quantize` output) counted as its
    /// blocks, not as its dense size; the vision tower is not counted. The same number as the
    /// `mole_weights_bytes` gauge and the "base weights held" startup log line.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) weights_bytes: Option<u64>,
}

/// `POST /tokenize`.
#[derive(Serialize, ToSchema, Debug)]
pub(crate) struct TokenizeAnswer {
    /// How many tokens.
    pub(super) count: usize,
    /// The model's context length.
    pub(super) max_model_len: usize,
    /// The ids the engine would run, image placeholders expanded.
    pub(super) tokens: Vec<u32>,
}

/// `POST /detokenize`.
#[derive(Serialize, ToSchema, Debug)]
pub(crate) struct DetokenizeAnswer {
    /// The text, special tokens left out.
    pub(super) prompt: String,
}

/// `GET /version`.
#[derive(Serialize, ToSchema, Debug)]
pub(crate) struct VersionAnswer {
    /// The worker's version.
    pub(super) version: &'static str,
}

/// `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`.
#[derive(Serialize, ToSchema, Debug)]
pub(crate) struct LoraAnswer {
    /// `loaded` or `unloaded`.
    pub(super) status: &'static str,
    /// The adapter.
    pub(super) lora_name: String,
}

/// `POST /admin/reload` when the adapters take longer than the answer waits (202).
#[derive(Serialize, ToSchema, Debug)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ReloadApplying {
    /// Always true: the reload goes on; `/v1/lora_adapters` says when each adapter is loaded.
    pub(super) applying: bool,
    /// The hash the caller expected, if it gave one.
    pub(super) config_hash: Option<String>,
}

/// One server-sent event of a chat stream as a client's parser reads it (see [`event_schema`]).
pub(crate) struct ChatEvent;
/// One server-sent event of a completion stream (see [`event_schema`]).
pub(crate) struct TextEvent;

/// An event of a stream whose chunks are `chunk`: its `data` is a chunk (JSON), OpenAI's error
/// body (a failure after the headers went out, with `mole`), or `[DONE]`, which ends the
/// stream. Events carry no `event:` name, so they are `message`s. utoipa has no
/// `contentSchema`, so it goes in as an extension that [`crate::openapi_requests::finish`] renames.
fn event_schema(chunk: &str) -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
    use utoipa::openapi::extensions::ExtensionsBuilder;
    use utoipa::openapi::schema::{ObjectBuilder, OneOfBuilder, Type};
    let json = serde_json::json!({"oneOf": [
        {"$ref": format!("#/components/schemas/{chunk}")},
        {"$ref": "#/components/schemas/ErrorReply"},
    ]});
    let chunk = ObjectBuilder::new()
        .schema_type(Type::String)
        .description(Some("A chunk, or an error that ended the stream"))
        .content_media_type("application/json")
        .extensions(Some(
            ExtensionsBuilder::new()
                .add("x-content-schema", json)
                .build(),
        ));
    let done = ObjectBuilder::new()
        .schema_type(Type::String)
        .description(Some("The stream's end"))
        .enum_values(Some(["[DONE]"]));
    let data = OneOfBuilder::new().item(chunk).item(done);
    ObjectBuilder::new()
        .schema_type(Type::Object)
        .property("data", data)
        .required("data")
        .property(
            "event",
            ObjectBuilder::new()
                .schema_type(Type::String)
                .enum_values(Some(["message"])),
        )
        .into()
}

impl utoipa::PartialSchema for ChatEvent {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        event_schema("Answer_ChunkChoice")
    }
}
impl ToSchema for ChatEvent {}

impl utoipa::PartialSchema for TextEvent {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        event_schema("Answer_TextChoice")
    }
}
impl ToSchema for TextEvent {}
