//! The contract between the HTTP server and the engine. The server builds a
//! [`GenerateRequest`], calls [`Serving::submit`] and reads [`TokenEvent`]s from the
//! returned stream; dropping the stream cancels the request.
//!
//! The engine is split by who calls it, each part a trait the caller depends on alone:
//! [`Serving`] (request handlers), [`AdapterAdmin`] (admin endpoints, config reload),
//! [`EngineInfo`] (metrics, `/v1/models`, limits) and [`PromptCodec`] (tokenizer and chat
//! template, taken once at startup by validation). [`EngineHandles`] carries the four.
//!
//! Types here are shared by the engine and the server: extend them, do not change their meaning.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

pub use crate::lora::AdapterSpec;

/// Why the engine refused or aborted a request. Stable names via [`EngineError::code`].
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum EngineError {
    /// The waiting queue is full: the server answers 429 with Retry-After.
    #[error("overloaded: {0} requests waiting")]
    Overloaded(usize),
    /// The engine is not ready (loading, shutting down): 503.
    #[error("engine not ready: {0}")]
    NotReady(String),
    /// The named adapter is not known or not loaded: 404.
    #[error("adapter not found: {0}")]
    AdapterNotFound(String),
    /// The adapter could not be loaded (validation failed): 422/400.
    #[error("invalid adapter {name}: {reason}")]
    InvalidAdapter {
        /// Adapter name.
        name: String,
        /// Why.
        reason: String,
    },
    /// A configured adapter's read from disk for a request failed (its files changed under
    /// it: a re-upload gone wrong, a volume gone): 503 `adapter_load_failed`. Nothing in the
    /// request is wrong, so not `invalid_adapter`'s 422; the next request reads it again.
    #[error("adapter {name} failed to load: {reason}")]
    AdapterReadFailed {
        /// Adapter name.
        name: String,
        /// Why.
        reason: String,
    },
    /// The request is invalid for this model (prompt too long, bad token id...): 400.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The request has images and the model takes none: 400.
    #[error("this model does not accept images")]
    ImagesNotSupported,
    /// An image the model cannot take (no pixels, aspect ratio over 200) or whose
    /// placeholders do not match the images: 400.
    #[error("invalid image: {0}")]
    InvalidImage(String),
    /// A structured-output guide that does not compile (`code`: `invalid_schema`,
    /// `invalid_grammar`, `structured_outputs_unsupported`): 400.
    #[error("{message}")]
    InvalidGuide {
        /// Stable name.
        code: &'static str,
        /// What is wrong, naming the keyword or position llguidance reports.
        message: String,
    },
    /// The request's grammar could not go on while its answer was generated (it reached
    /// llguidance's limits on one token's mask, `limits.guideParser`): 422 `grammar_failed`.
    /// That request ends; the engine and the other requests go on.
    #[error("the answer's grammar could not continue: {0}")]
    GuideFailed(String),
    /// The chat template ran past `limits.maxTemplateFuel`: 400 `template_fuel_exhausted`.
    #[error("the chat template ran past its fuel ({0} units, limits.maxTemplateFuel)")]
    TemplateFuelExhausted(u64),
    /// The model does not fit the device's memory budget (`gpuMemoryUtilization`): the
    /// worker refuses to start.
    #[error("{0}")]
    ModelDoesNotFit(String),
    /// A pre-quantized checkpoint mole does not serve (AWQ/GPTQ variant named in the
    /// message): the worker refuses to start.
    #[error("{0}")]
    UnsupportedQuantization(String),
    /// The model failed during the forward pass: 500.
    #[error("internal engine error: {0}")]
    Internal(String),
}

impl EngineError {
    /// Stable name (metric label, JSON `code`).
    pub fn code(&self) -> &'static str {
        match self {
            EngineError::Overloaded(_) => "overloaded",
            EngineError::NotReady(_) => "not_ready",
            EngineError::AdapterNotFound(_) => "adapter_not_found",
            EngineError::InvalidAdapter { .. } => "invalid_adapter",
            EngineError::AdapterReadFailed { .. } => "adapter_load_failed",
            EngineError::InvalidRequest(_) => "invalid_request",
            EngineError::ImagesNotSupported => "images_not_supported",
            EngineError::InvalidImage(_) => "invalid_image",
            EngineError::InvalidGuide { code, .. } => code,
            EngineError::GuideFailed(_) => "grammar_failed",
            EngineError::TemplateFuelExhausted(_) => "template_fuel_exhausted",
            EngineError::ModelDoesNotFit(_) => "model_does_not_fit",
            EngineError::Internal(_) => "internal_error",
            EngineError::UnsupportedQuantization(_) => "unsupported_quantization",
        }
    }
}

/// A prompt: text (tokenized by the engine) or token ids.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Raw text; the engine tokenizes it (adding BOS when the tokenizer does).
    Text(String),
    /// Token ids, used as is.
    Tokens(Vec<u32>),
    /// Text that already carries its special tokens (a rendered chat template): tokenized
    /// without adding BOS again, as transformers and vLLM do for chat.
    Templated(String),
}

/// One chat message: its text, and where images go in it.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// Text content (all text parts, in order).
    pub content: String,
    /// Text and image parts in order, when the message has images (empty: `content` alone).
    /// The template sees them as transformers' processors pass them: `{"type": "image"}` and
    /// `{"type": "text", "text": ...}`; the images themselves go in
    /// [`GenerateRequest::images`], in the order the parts of all messages name them.
    #[serde(skip)]
    pub parts: Vec<ContentPart>,
    /// Other fields the template reads, as the client sent them: an assistant turn's
    /// `tool_calls` (each `function.arguments` parsed into an object, as vLLM hands them to
    /// templates), a tool result's `tool_call_id` and `name`.
    #[serde(skip)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl ChatMessage {
    /// A text-only message.
    pub fn text(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            parts: Vec::new(),
            extra: serde_json::Map::new(),
        }
    }

    /// Images in the message.
    pub fn images(&self) -> usize {
        self.parts
            .iter()
            .filter(|p| matches!(p, ContentPart::Image))
            .count()
    }
}

/// A part of a chat message with images.
#[derive(Debug, Clone, PartialEq)]
pub enum ContentPart {
    /// Text.
    Text(String),
    /// The next image of the request.
    Image,
}

impl Serialize for ChatMessage {
    /// As a chat template reads a message: `content` a string, or a list of typed parts when
    /// the message has images.
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(2 + self.extra.len()))?;
        m.serialize_entry("role", &self.role)?;
        for (k, v) in &self.extra {
            m.serialize_entry(k, v)?;
        }
        if self.parts.is_empty() {
            m.serialize_entry("content", &self.content)?;
        } else {
            let parts: Vec<serde_json::Value> = self
                .parts
                .iter()
                .map(|p| match p {
                    ContentPart::Text(t) => serde_json::json!({"type": "text", "text": t}),
                    ContentPart::Image => serde_json::json!({"type": "image"}),
                })
                .collect();
            m.serialize_entry("content", &parts)?;
        }
        m.end()
    }
}

/// A decoded image (8-bit RGB, row-major), as the server hands it to the engine.
#[derive(Clone, PartialEq)]
pub struct Image {
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// `width × height × 3` bytes.
    pub rgb: std::sync::Arc<[u8]>,
    /// Digest of the bytes the client sent: an image sent twice in one request is encoded
    /// once.
    pub digest: [u8; 32],
}

impl std::fmt::Debug for Image {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Image({}×{})", self.width, self.height)
    }
}

/// Sampling parameters. Defaults are greedy with no penalties.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// Nucleus sampling (1.0 disables).
    pub top_p: f32,
    /// Top-k (0 disables).
    pub top_k: usize,
    /// Min-p (0 disables).
    pub min_p: f32,
    /// Multiplicative repetition penalty (1.0 disables).
    pub repetition_penalty: f32,
    /// OpenAI presence penalty.
    pub presence_penalty: f32,
    /// OpenAI frequency penalty.
    pub frequency_penalty: f32,
    /// Seed: same seed, same tokens (on one path: both samplers draw the same uniforms from it
    /// and walk the kept tokens in vocabulary order, but their probabilities are summed in
    /// other orders, so where a uniform falls near a boundary the other path may pick the
    /// neighbouring token).
    pub seed: Option<u64>,
    /// Tokens to generate at most.
    pub max_tokens: usize,
    /// Stop strings (not included in the output).
    pub stop: Vec<String>,
    /// Stop token ids (besides the model's EOS).
    pub stop_token_ids: Vec<u32>,
    /// Return this many top logprobs per token (None: no logprobs).
    pub logprobs: Option<usize>,
    /// Keep generating past EOS.
    pub ignore_eos: bool,
    /// Structured outputs: the grammar the answer follows (None: free text).
    pub guide: Option<super::grammar::Guided>,
    /// vLLM's `cache_salt`: mixed into the request's prefix-cache keys, so that requests
    /// with different salts (or one with a salt and one without) never share cached blocks.
    /// Not a sampling setting; it travels here with the request's other per-call knobs.
    pub cache_salt: Option<String>,
    /// The prefix cache's partition this request reads and writes (None: the shared one): the
    /// server sets a digest of the caller's API key, so that one key holder cannot find
    /// another's prompt blocks and read them off `cached_tokens`. Mixed into the keys as the
    /// salt is; not a sampling setting either.
    pub cache_tenant: Option<[u8; 32]>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            max_tokens: 256,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            logprobs: None,
            ignore_eos: false,
            guide: None,
            cache_salt: None,
            cache_tenant: None,
        }
    }
}

/// A generation request.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateRequest {
    /// Request id (for logs and cancellation).
    pub id: String,
    /// The prompt (already chat-templated for chat requests).
    pub prompt: Prompt,
    /// Adapter name, or None for the base model. The engine pins the version current at submit.
    pub adapter: Option<String>,
    /// Sampling.
    pub sampling: SamplingParams,
    /// Images of the prompt, in the order its placeholders name them (a vision model's chat
    /// template writes one placeholder per image).
    pub images: Vec<Image>,
}

/// Choice `i` of `req`: the same request, its seed (when it has one) plus `i`.
pub fn choice(req: &GenerateRequest, i: usize) -> GenerateRequest {
    let mut r = req.clone();
    r.sampling.seed = r.sampling.seed.map(|s| s.wrapping_add(i as u64));
    r
}

/// Log probability of one token.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TokenLogprob {
    /// Token id.
    pub token_id: u32,
    /// Token text.
    pub token: String,
    /// Log probability.
    pub logprob: f32,
    /// Top alternatives (when asked).
    pub top: Vec<(u32, String, f32)>,
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// EOS, a stop string or a stop token.
    Stop,
    /// `max_tokens` or the model's `max_seq_len`.
    Length,
    /// Cancelled by the caller.
    Cancelled,
}

/// Token counts of a finished request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Prompt tokens whose keys and values the prefix cache gave, found when the request
    /// was first admitted (OpenAI's `prompt_tokens_details.cached_tokens`).
    pub cached_tokens: usize,
}

/// What the engine sends back for a request.
#[derive(Debug, Clone, PartialEq)]
pub enum TokenEvent {
    /// The request left the queue and its prefill ran; carries the adapter version pinned.
    Started {
        /// Pinned adapter version (None: base model).
        adapter_version: Option<String>,
        /// Prompt tokens.
        prompt_tokens: usize,
    },
    /// One generated token. `text` is the UTF-8-safe delta (may be empty while a multi-byte
    /// character is incomplete, and never contains a matched stop string).
    Token {
        /// Token id.
        token_id: u32,
        /// Text delta.
        text: String,
        /// Logprob (when asked).
        logprob: Option<TokenLogprob>,
    },
    /// The last event of a successful request.
    Finished {
        /// Why it ended.
        reason: FinishReason,
        /// Token counts.
        usage: Usage,
    },
    /// The last event of a failed request.
    Error(EngineError),
}

/// Stream of events of one request. Dropping it cancels the request.
pub type EventStream = mpsc::UnboundedReceiver<TokenEvent>;

/// Snapshot of the scheduler (for metrics and `vllm:lora_requests_info`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineStats {
    /// Requests decoding now.
    pub running: usize,
    /// Requests waiting for a slot.
    pub waiting: usize,
    /// Size of the last batch.
    pub last_batch_size: usize,
    /// Sequences of the largest batch since start, a request's choices each counted (never
    /// more than `maxBatchSize`).
    pub largest_batch: usize,
    /// Adapters with running requests.
    pub running_adapters: Vec<String>,
    /// Adapters with waiting requests.
    pub waiting_adapters: Vec<String>,
    /// Device slots for adapters.
    pub max_loras: usize,
    /// Requests cancelled because their caller went away (since start).
    pub cancelled: u64,
    /// Adapter loads that succeeded (since start; reads back after eviction included).
    pub adapter_loads: u64,
    /// Adapter loads refused or failed.
    pub adapter_load_failures: u64,
    /// Seconds spent loading adapters (sum).
    pub adapter_load_seconds: f64,
    /// Adapters evicted to disk by the LRU.
    pub adapter_evictions: u64,
    /// Sequences preempted (their cache freed, to be recomputed) because the KV cache was full.
    pub preemptions: u64,
    /// Forward passes (engine steps) run since start: with the tokens counted, the mean batch.
    pub steps: u64,
    /// Images the vision tower encoded since start (an image a request repeats is encoded
    /// once per request; one whose placeholders all lie in KV blocks reused from the prefix
    /// cache is not encoded).
    pub vision_encodes: u64,
    /// The paged KV cache's free and total blocks (tensor path; None on the CPU's host path,
    /// whose caches grow per sequence).
    pub kv_blocks: Option<(usize, usize)>,
    /// Bytes of the paged KV cache (tensor path).
    pub kv_cache_bytes: Option<u64>,
    /// The dtype the KV cache holds keys and values in (`kvCacheDtype`, or the model's
    /// default): `f32`, `bf16` or `f16`.
    pub kv_cache_dtype: Option<&'static str>,
    /// Bytes the base model's weights hold as loaded (a quantized base: its blocks).
    pub weights_bytes: Option<u64>,
    /// Prefix-cache queries and hits in tokens, per adapter (since start; empty when prefix
    /// caching is off).
    pub prefix_cache: Vec<PrefixCacheCounts>,
    /// Full KV blocks cached that no running request holds (reusable; on the tensor path also
    /// counted free, as a new request may evict them).
    pub prefix_cached_blocks: usize,
}

/// One adapter's prefix-cache counts, in tokens, as vLLM's `prefix_cache_queries` and
/// `prefix_cache_hits`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PrefixCacheCounts {
    /// The adapter ("" for the base model).
    pub adapter: String,
    /// Prompt tokens of the requests admitted (once each: a request preempted and readmitted
    /// is not queried again).
    pub queries: u64,
    /// Of those, the tokens whose keys and values came from the cache.
    pub hits: u64,
}

/// The engine as request handlers call it: generation and the classifier router's scoring,
/// the two things that run the model. TGI's router draws the same line (its `Backend` schedules
/// validated requests; validation holds the tokenizer): what serves requests knows nothing of
/// adapter files or tokenizers. Object-safe: handlers hold `Arc<dyn Serving>`.
pub trait Serving: Send + Sync + 'static {
    /// Queues a request. Fails at once with `Overloaded` when the waiting queue is full.
    fn submit(&self, req: GenerateRequest) -> Result<EventStream, EngineError>;
    /// Queues a request for `n` choices (OpenAI's `n`): one stream each, choice `i` sampled
    /// with the request's seed plus `i` (as vLLM seeds them). By default each choice is a
    /// request of its own; an engine that can computes the prompt once for all of them.
    fn submit_n(&self, req: GenerateRequest, n: usize) -> Result<Vec<EventStream>, EngineError> {
        (0..n).map(|i| self.submit(choice(&req, i))).collect()
    }
    /// Log-probabilities of each candidate label as the next tokens after `prompt`, with
    /// `adapter` applied; one prefill of the prompt (no generation), run by the engine in a
    /// step like any other request's (it waits in the queue like them). Returns a
    /// probability per label (softmax over the labels' first-token logits). With `images`
    /// (a vision model), the prompt is one user message of the images then the text, rendered
    /// by the chat template, and the pass sees the images.
    fn score_labels(
        &self,
        adapter: Option<&str>,
        prompt: &str,
        labels: &[String],
        images: &[Image],
    ) -> Result<Vec<f32>, EngineError>;
}

/// The engine's adapters as the admin endpoints, the config reload and the router's "is it
/// loaded" checks call them. Apart from [`Serving`] because loads block for seconds and are
/// the operator's business, not a request's; a test can slow them without touching serving.
pub trait AdapterAdmin: Send + Sync + 'static {
    /// Loads an adapter version (blocking until loaded or refused).
    fn load_adapter(&self, spec: AdapterSpec) -> Result<(), EngineError>;
    /// Makes an adapter placed on other pods known without reading it: its first request reads
    /// it from disk. An engine without lazy adapters (and any engine, for a name it already
    /// holds in another version) loads it at once.
    fn register_adapter(&self, spec: AdapterSpec) -> Result<(), EngineError> {
        self.load_adapter(spec)
    }
    /// Unloads every version of an adapter; running requests finish on their pinned version.
    fn unload_adapter(&self, name: &str) -> Result<(), EngineError>;
    /// What the registry holds.
    fn adapters(&self) -> Vec<mole_api::LoraAdapterInfo>;
    /// Cumulative traffic per adapter version (none from an engine that does not count it).
    fn adapter_counters(&self) -> Vec<mole_api::AdapterCounters> {
        Vec::new()
    }
}

/// What the engine is and how loaded it is: read by `/metrics`, validation's context and
/// vocabulary bounds, the OpenAPI document's limits, and [`crate::replicas`] to pick
/// the least loaded engine. Cheap snapshots that never wait for a step.
pub trait EngineInfo: Send + Sync + 'static {
    /// Scheduler snapshot.
    fn stats(&self) -> EngineStats;
    /// Base model name and max sequence length.
    fn model_info(&self) -> ModelInfo;
}

/// The model's text side: chat template, tokenizer, detokenizer, and how many tokens an image
/// takes. The server takes it once at startup and validation uses it before routing, so a
/// request is tokenized once and the engine gets token ids. Apart from the engine's other parts
/// because none of this runs on the engine thread or differs between a pod's replicas (one
/// handle serves them all), and because the image placeholders' expansion that
/// [`PromptCodec::tokenize`] does needs [`PromptCodec::image_tokens`]: both count a prompt's
/// tokens the way the engine will run it.
pub trait PromptCodec: Send + Sync + 'static {
    /// Renders chat messages with the model's chat template (`add_generation_prompt`);
    /// `kwargs` become template variables (vLLM's `chat_template_kwargs`, e.g. Qwen3's
    /// `enable_thinking`).
    fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, EngineError>;
    /// The chat template's source (None: no template, or a codec that does not say). The
    /// server reads the tool-call and reasoning formats a pool does not name from it.
    fn chat_template(&self) -> Option<String> {
        None
    }
    /// Token ids of `prompt` as the engine would run it (a text gets the tokenizer's special
    /// tokens; templated text does not), each image placeholder expanded to its image's
    /// tokens.
    fn tokenize(&self, prompt: &Prompt, images: &[Image]) -> Result<Vec<u32>, EngineError>;
    /// The text of token ids, special tokens left out.
    fn detokenize(&self, ids: &[u32]) -> Result<String, EngineError>;
    /// Token ids of `prompt` alone, as [`PromptCodec::tokenize`] reads it but with each
    /// image placeholder left as its one token: what the server's validation tokenizes once and
    /// hands the engine as [`Prompt::Tokens`] (the engine expands the placeholders with the
    /// request's images).
    fn encode(&self, prompt: &Prompt) -> Result<Vec<u32>, EngineError> {
        self.tokenize(prompt, &[])
    }
    /// Tokens an image of `width × height` pixels takes in the prompt (`ImagesNotSupported`
    /// when the model takes no images).
    fn image_tokens(&self, width: u32, height: u32) -> Result<usize, EngineError>;
    /// Compiles a request's grammar (or finds it compiled: the engine's submit then finds it
    /// too), on the calling thread, the server's preparation stage: `InvalidGuide` when it does
    /// not compile, else what of a lenient JSON schema is not enforced (see
    /// [`super::grammar::Compiled::unenforced`]). A codec without grammars compiles nothing.
    fn compile_guide(&self, _g: &super::grammar::Guided) -> Result<Vec<String>, EngineError> {
        Ok(Vec::new())
    }
}

/// One running engine with everything but its text side: what a pod's
/// [`crate::replicas::Replicas`] hold one per device, and what a local worker holds
/// per merged model. Implemented for every type that is the three parts; callers that need
/// one part take that trait instead (an `Arc<dyn Backend>` upcasts to each).
pub trait Backend: Serving + AdapterAdmin + EngineInfo {}

impl<T: Serving + AdapterAdmin + EngineInfo + ?Sized> Backend for T {}

/// The engine's parts as the server holds them, each used by the callers named on its trait.
/// Built once at startup (the server's `build_engine`); the parts may be one object (the
/// engine) or several (replicas behind one codec, a test's wrapper of one part).
#[derive(Clone)]
pub struct EngineHandles {
    /// What request handlers call.
    pub serving: Arc<dyn Serving>,
    /// What the admin endpoints and the config reload call.
    pub admin: Arc<dyn AdapterAdmin>,
    /// What metrics, validation's limits and the OpenAPI document read.
    pub info: Arc<dyn EngineInfo>,
    /// The tokenizer and chat template validation uses.
    pub codec: Arc<dyn PromptCodec>,
}

impl EngineHandles {
    /// The parts of one engine that is all four (the real engine, a test's mock).
    pub fn of<E: Backend + PromptCodec>(engine: Arc<E>) -> Self {
        let codec: Arc<dyn PromptCodec> = engine.clone();
        Self::with_codec(engine, codec)
    }

    /// The parts of `engine`, its text side from `codec` (replicas: the first engine's).
    pub fn with_codec<E: Backend>(engine: Arc<E>, codec: Arc<dyn PromptCodec>) -> Self {
        Self {
            serving: engine.clone(),
            admin: engine.clone(),
            info: engine,
            codec,
        }
    }
}

/// Static facts about the loaded model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelInfo {
    /// Base model name from the config.
    pub name: String,
    /// Longest sequence.
    pub max_seq_len: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// The model takes images.
    pub vision: bool,
    /// A vision model's image placeholder token: each stands for one image of the request's,
    /// so a prompt of token ids holding one without its image is refused.
    pub image_token: Option<u32>,
    /// Bytes of text one token covers at most (the longest token of the vocabulary, special
    /// tokens included): a text longer than this many bytes per token of the context cannot
    /// fit, and is refused before it is tokenized. 0: unknown.
    pub max_token_bytes: usize,
}
