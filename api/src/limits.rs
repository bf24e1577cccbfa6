//! Limits: [`EngineLimits`], which a pool sets (its `spec.dynamic` embeds them) and the worker
//! reads, with one set of defaults and bounds; and [`WorkerLimits`], those plus the limits of
//! one request, which only the worker's config carries.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::bounds::{self, BoundsError};
use crate::enums::Dtype;

/// The limits of a worker's engine, as a pool's `spec.dynamic` sets them.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EngineLimits {
    /// Adapters resident on the device at once.
    #[serde(default = "default_max_loras")]
    #[schemars(range(min = bounds::MAX_LORAS.min, max = bounds::MAX_LORAS.max))]
    pub max_loras: u32,
    /// Adapters kept in host memory (LRU) besides the device-resident ones.
    #[serde(default = "default_max_cpu_loras")]
    #[schemars(range(min = bounds::MAX_CPU_LORAS.min, max = bounds::MAX_CPU_LORAS.max))]
    pub max_cpu_loras: u32,
    /// Highest LoRA rank accepted.
    #[serde(default = "default_max_lora_rank")]
    #[schemars(range(min = bounds::MAX_LORA_RANK.min, max = bounds::MAX_LORA_RANK.max))]
    pub max_lora_rank: u32,
    /// Precision the dynamic pods hold adapter weights in, as vLLM's `--lora-dtype`. Unset:
    /// `baseModel.dtype`, except f16 weights on the CPU (adapters in f32 there; a GGUF base:
    /// f32). `bf16` (the default over bf16 weights) halves adapters' memory (device slots and
    /// the `maxCpuLoras` host tier) and the bytes a decode step reads per distinct adapter in
    /// its batch, at the price of rounding each weight to bf16 (8 significant bits), as the
    /// base weights already are; `f32` keeps them exactly as PEFT trained them. On the CPU
    /// `f32` and `bf16` run the fused kernels; `f16` runs tensor ops.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "lora_dtype_schema")]
    pub lora_dtype: Option<Dtype>,
    /// Precision the KV cache holds keys and values in, as vLLM's `--kv-cache-dtype`. Unset:
    /// `baseModel.dtype` (vLLM's `auto`), and f16 for a quantized (GGUF, AWQ, GPTQ) base, as
    /// llama.cpp's default cache type. On the CPU, where bf16/f16 weights are computed in
    /// f32, a `bf16` or `f16` cache holds half the bytes of an `f32` one and a decode step
    /// reads half of them (the attention of a long context is bound by those reads), at the
    /// price of rounding each key and value once when it is cached, as a GPU serving the
    /// model in bf16 does; `f32` keeps them as computed. On a GPU the memory left for the
    /// cache (`gpuMemoryUtilization`) holds twice the tokens in a 16-bit dtype as in f32.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "kv_cache_dtype_schema")]
    pub kv_cache_dtype: Option<Dtype>,
    /// Sequences decoded together.
    #[serde(default = "default_max_batch")]
    #[schemars(range(min = bounds::MAX_BATCH_SIZE.min, max = bounds::MAX_BATCH_SIZE.max))]
    pub max_batch_size: u32,
    /// Longest sequence (prompt + generation) in tokens.
    #[serde(default = "default_max_seq_len")]
    #[schemars(range(min = bounds::MAX_SEQ_LEN.min, max = bounds::MAX_SEQ_LEN.max))]
    pub max_seq_len: u32,
    /// Requests waiting for a batch slot before new ones get 429.
    #[serde(default = "default_max_queue")]
    #[schemars(range(min = bounds::MAX_QUEUE.min, max = bounds::MAX_QUEUE.max))]
    pub max_queue: u32,
    /// Share of each GPU's total memory the worker may use, as vLLM's
    /// `--gpu-memory-utilization`: what is left of it after the weights (and whatever else
    /// holds device memory), the LoRA slots and an activation estimate becomes the paged KV
    /// cache, up to what `maxBatchSize` sequences of `maxSeqLen` can use. A worker whose share
    /// cannot hold the weights, or one sequence of `maxSeqLen`, refuses to start
    /// (`model_does_not_fit`). Ignored on the CPU, where the cache is sized from the limits.
    #[serde(default = "default_gpu_memory_utilization")]
    #[schemars(range(
        min = bounds::GPU_MEMORY_UTILIZATION.min,
        max = bounds::GPU_MEMORY_UTILIZATION.max
    ))]
    pub gpu_memory_utilization: f64,
    /// Automatic prefix caching, as vLLM's `--enable-prefix-caching` (on by default, as
    /// there): full KV blocks (16 tokens) stay cached, keyed by a hash of their tokens, their
    /// images and everything before them, and of the adapter and version that computed them
    /// (a block is never reused under another adapter, version, or the base); a request whose
    /// prompt starts with cached blocks (a shared system prompt, a conversation's earlier
    /// turns, the classifier router's instructions, `n` choices) computes only the rest.
    /// Cached blocks no request holds are evicted least recently used when the cache needs
    /// room. On a GPU (the paged cache) the blocks themselves are shared; on the CPU's host
    /// path a hit copies them from a store of at most as many blocks as the paged cache would
    /// hold. `false` recomputes every prompt.
    // Written only when off: configs (and their hashes) at the default stay as they were.
    #[serde(default = "default_true", skip_serializing_if = "is_true")]
    pub enable_prefix_caching: bool,
}

impl Default for EngineLimits {
    fn default() -> Self {
        Self {
            max_loras: default_max_loras(),
            max_cpu_loras: default_max_cpu_loras(),
            max_lora_rank: default_max_lora_rank(),
            lora_dtype: None,
            kv_cache_dtype: None,
            max_batch_size: default_max_batch(),
            max_seq_len: default_max_seq_len(),
            max_queue: default_max_queue(),
            gpu_memory_utilization: default_gpu_memory_utilization(),
            enable_prefix_caching: true,
        }
    }
}

impl EngineLimits {
    /// Checks every limit against its bounds in [`crate::bounds`].
    pub fn validate(&self) -> Result<(), BoundsError> {
        bounds::MAX_LORAS.check("maxLoras", self.max_loras)?;
        bounds::MAX_CPU_LORAS.check("maxCpuLoras", self.max_cpu_loras)?;
        bounds::MAX_LORA_RANK.check("maxLoraRank", self.max_lora_rank)?;
        bounds::MAX_BATCH_SIZE.check("maxBatchSize", self.max_batch_size)?;
        bounds::MAX_SEQ_LEN.check("maxSeqLen", self.max_seq_len)?;
        bounds::MAX_QUEUE.check("maxQueue", self.max_queue)?;
        bounds::GPU_MEMORY_UTILIZATION.check("gpuMemoryUtilization", self.gpu_memory_utilization)
    }
}

/// The schema of `loraDtype` without a reference to [`Dtype`]: kube's hoisting of an optional
/// enum would keep the enum's description ("Numeric type of model weights.") over the field's
/// doc.
fn lora_dtype_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "string",
        "enum": ["bf16", "f16", "f32"],
        "nullable": true,
    })
}

/// The schema of `kvCacheDtype` (see [`lora_dtype_schema`] for why not a reference).
fn kv_cache_dtype_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    lora_dtype_schema(&mut schemars::SchemaGenerator::default())
}

fn default_max_loras() -> u32 {
    8
}
fn default_max_cpu_loras() -> u32 {
    32
}
fn default_max_lora_rank() -> u32 {
    64
}
fn default_max_batch() -> u32 {
    16
}
fn default_max_seq_len() -> u32 {
    4096
}
fn default_max_queue() -> u32 {
    256
}
fn default_true() -> bool {
    true
}
#[allow(clippy::trivially_copy_pass_by_ref)] // serde's skip_serializing_if passes a reference
fn is_true(b: &bool) -> bool {
    *b
}
fn default_gpu_memory_utilization() -> f64 {
    0.9
}

/// Limits of a worker: its engine's, and those of one request. In JSON they are one flat
/// object (`limits: {maxLoras, ..., maxTokens}`); in Rust the engine limits are a field of their
/// own (`limits.engine.max_loras`), the same struct the pool's `spec.dynamic` flattens.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WorkerLimits {
    /// The engine's limits (from the pool's `spec.dynamic`).
    #[serde(flatten)]
    pub engine: EngineLimits,
    /// Highest `max_tokens` a request may ask for.
    #[serde(default = "default_max_tokens")]
    pub max_tokens: u32,
    /// Largest request body in bytes.
    #[serde(default = "default_max_body")]
    pub max_body_bytes: u64,
    /// Longest a request may take, in seconds.
    #[serde(default = "default_timeout")]
    pub request_timeout_seconds: u64,
    /// Largest image a request may carry, in bytes as sent (decoded from base64, or fetched).
    #[serde(default = "default_max_image_bytes")]
    pub max_image_bytes: u64,
    /// Most pixels (width × height) of one image, checked from its header before it is
    /// decoded: a small file that unpacks into a huge bitmap is refused unread.
    #[serde(default = "default_max_image_pixels")]
    pub max_image_pixels: u64,
    /// Most images in one request.
    #[serde(default = "default_max_images")]
    pub max_images: u32,
    /// Most pixels of all of one request's images together, read from their headers before
    /// any is decoded (413 `image_pixels_exceeded`). Default 64 Mi pixels (about 192 MiB as
    /// RGB): four images at Qwen3-VL's largest processed size (16 Mi pixels), or one image of
    /// `maxImagePixels`.
    #[serde(
        default = "default_max_request_image_pixels",
        skip_serializing_if = "is_default_request_image_pixels"
    )]
    pub max_request_image_pixels: u64,
    /// Most pixels of the images all requests hold at once, decoding or decoded (the worker's
    /// memory for images is about 3 bytes a pixel of this, plus the decoders' buffers). A
    /// request whose images do not fit in what is left is answered 429 `images_busy` at
    /// once, not queued. Default 128 Mi pixels (about 384 MiB as RGB); at least
    /// `maxRequestImagePixels`. Read at start.
    #[serde(
        default = "default_max_inflight_image_pixels",
        skip_serializing_if = "is_default_inflight_image_pixels"
    )]
    pub max_inflight_image_pixels: u64,
    /// Hosts whose `http(s)://` image URLs the worker fetches: exact names or IP literals,
    /// compared with the host the URL's parser (the HTTP client's) reads; on the scheme's
    /// default port only, unless an entry names its port (`host:8080`). Empty: only `data:`
    /// URLs and base64 are accepted, so a request cannot make the worker fetch.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub image_url_hosts: Vec<String>,
    /// Fetch images from listed hosts that resolve to non-public addresses (private,
    /// loopback, link-local, CGNAT, multicast, ...). Off: such a URL is refused
    /// (`image_url_not_allowed`) after its host is resolved, whatever the list says, so that a
    /// listed name cannot be pointed at the cloud metadata service or the pod's neighbours.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub image_url_allow_private: bool,
    /// Who shares the prefix cache's blocks (and so moves each other's
    /// `usage.prompt_tokens_details.cached_tokens`). `apiKey` (the default): each API key has
    /// a cache of its own, so a key holder cannot learn another's prompt by the tokens its own
    /// requests find cached; without API keys every caller is one tenant. `pool`: every caller
    /// shares one cache, for a pool whose callers trust each other (more hits on a system
    /// prompt they all send). `cache_salt` partitions either further.
    #[serde(default, skip_serializing_if = "PrefixCacheScope::is_default")]
    pub prefix_cache_scope: PrefixCacheScope,
    /// Longest text of one structured-output guide, in characters (as JSON Schema's
    /// `maxLength` counts them): a JSON schema (as compact JSON), a regex, a Lark grammar, or
    /// a choice list's strings together (400 `guide_too_large`, before anything is compiled).
    /// Default 262,144: a large real-world schema is a few tens of thousands.
    #[serde(
        default = "default_max_guide_chars",
        skip_serializing_if = "is_default_guide_chars"
    )]
    pub max_guide_chars: u64,
    /// Most strings of a choice guide (`guided_choice`, `structured_outputs.choice`; 400
    /// `too_many_choices`). Default 4096.
    #[serde(
        default = "default_max_guide_choices",
        skip_serializing_if = "is_default_guide_choices"
    )]
    pub max_guide_choices: u32,
    /// Longest stop string, in characters (400 `stop_too_long`); at most four are taken.
    /// Default 1024.
    #[serde(
        default = "default_max_stop_chars",
        skip_serializing_if = "is_default_stop_chars"
    )]
    pub max_stop_chars: u32,
    /// Most bytes of a prompt's text (a chat's messages, their tool calls and the tools, as
    /// compact JSON for those; a completion's prompt),
    /// checked before the chat template is rendered or anything tokenized (400
    /// `prompt_too_long`). 0 (the default): what can fit, `maxSeqLen` times twice the bytes of
    /// the tokenizer's longest token, so that only a text that can never fit is refused
    /// before it is tokenized.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub max_prompt_bytes: u64,
    /// Fuel of one chat template rendering (minijinja's, about one unit per instruction): a
    /// template that would run past it is stopped with 400 `template_fuel_exhausted`.
    /// Default 10,000,000 (a chat of a thousand turns with tools takes well under a million).
    #[serde(
        default = "default_max_template_fuel",
        skip_serializing_if = "is_default_template_fuel"
    )]
    pub max_template_fuel: u64,
    /// llguidance's limits on a guide's compilation and on each token's mask.
    #[serde(default, skip_serializing_if = "GuideParserLimits::is_default")]
    pub guide_parser: GuideParserLimits,
    /// Threads of the preparation stage (parsing bodies, chat templates, tokenizing, image
    /// decoding and preprocessing, grammar compilation): 0 (the default) is one per core.
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub prepare_threads: u32,
    /// Requests waiting for a preparation thread before new ones are answered 429
    /// `prepare_busy` with `Retry-After`. Default 64.
    #[serde(
        default = "default_max_prepare_queue",
        skip_serializing_if = "is_default_prepare_queue"
    )]
    pub max_prepare_queue: u32,
}

/// llguidance's `ParserLimits` as a pool sets them (its defaults): what compiling one guide,
/// and computing one token's mask, may cost. A guide over them is refused at compilation
/// (400 `invalid_grammar` or `invalid_schema`, naming the limit); an answer whose grammar
/// reaches them while it is generated ends with `grammar_failed`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GuideParserLimits {
    /// Symbols of the compiled grammar (default 500,000, a few MB of JSON schema).
    #[serde(default = "default_max_grammar_size")]
    pub max_grammar_size: u64,
    /// Lexer work building a grammar's initial regexes (default 1,000,000).
    #[serde(default = "default_initial_lexer_fuel")]
    pub initial_lexer_fuel: u64,
    /// Lexer work of one token's mask (default 200,000).
    #[serde(default = "default_step_lexer_fuel")]
    pub step_lexer_fuel: u64,
    /// Earley items of one token's mask (default 50,000).
    #[serde(default = "default_step_max_items")]
    pub step_max_items: u64,
    /// Earley items in one row: the grammar's branching (default 2,000).
    #[serde(default = "default_max_items_in_row")]
    pub max_items_in_row: u64,
    /// Lexer states of one answer (default 250,000; 1-2 kB each).
    #[serde(default = "default_max_lexer_states")]
    pub max_lexer_states: u64,
}

impl Default for GuideParserLimits {
    fn default() -> Self {
        Self {
            max_grammar_size: default_max_grammar_size(),
            initial_lexer_fuel: default_initial_lexer_fuel(),
            step_lexer_fuel: default_step_lexer_fuel(),
            step_max_items: default_step_max_items(),
            max_items_in_row: default_max_items_in_row(),
            max_lexer_states: default_max_lexer_states(),
        }
    }
}

impl GuideParserLimits {
    /// Whether these are llguidance's defaults (kept off the wire then).
    pub fn is_default(&self) -> bool {
        *self == Self::default()
    }

    fn validate(&self) -> Result<(), BoundsError> {
        for (field, v) in [
            ("guideParser.maxGrammarSize", self.max_grammar_size),
            ("guideParser.initialLexerFuel", self.initial_lexer_fuel),
            ("guideParser.stepLexerFuel", self.step_lexer_fuel),
            ("guideParser.stepMaxItems", self.step_max_items),
            ("guideParser.maxItemsInRow", self.max_items_in_row),
            ("guideParser.maxLexerStates", self.max_lexer_states),
        ] {
            if v == 0 {
                return Err(BoundsError {
                    field,
                    message: "must be > 0".into(),
                });
            }
        }
        Ok(())
    }
}

fn default_max_grammar_size() -> u64 {
    500_000
}
fn default_initial_lexer_fuel() -> u64 {
    1_000_000
}
fn default_step_lexer_fuel() -> u64 {
    200_000
}
fn default_step_max_items() -> u64 {
    50_000
}
fn default_max_items_in_row() -> u64 {
    2_000
}
fn default_max_lexer_states() -> u64 {
    250_000
}

/// Who shares the prefix cache's blocks: see [`WorkerLimits::prefix_cache_scope`] (and an
/// InferencePool's `auth.prefixCacheScope`, which sets it).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum PrefixCacheScope {
    /// Each API key reads and writes a partition of its own.
    #[default]
    ApiKey,
    /// One cache for every caller of the pool (an explicit opt-in).
    Pool,
}

impl PrefixCacheScope {
    /// Whether this is the default (kept off the wire at its default).
    pub fn is_default(&self) -> bool {
        *self == Self::default()
    }
}

impl Default for WorkerLimits {
    fn default() -> Self {
        Self::with_engine(EngineLimits::default())
    }
}

impl WorkerLimits {
    /// `engine` with the request limits' defaults, `maxTokens` lowered to `maxSeqLen` when
    /// that is shorter: a pool cannot set `maxTokens`, and a WorkerConfig whose `maxTokens`
    /// exceeds its `maxSeqLen` is refused by the worker.
    pub fn with_engine(engine: EngineLimits) -> Self {
        Self {
            max_tokens: default_max_tokens().min(engine.max_seq_len),
            engine,
            max_body_bytes: default_max_body(),
            request_timeout_seconds: default_timeout(),
            max_image_bytes: default_max_image_bytes(),
            max_image_pixels: default_max_image_pixels(),
            max_images: default_max_images(),
            max_request_image_pixels: default_max_request_image_pixels(),
            max_inflight_image_pixels: default_max_inflight_image_pixels(),
            image_url_hosts: Vec::new(),
            image_url_allow_private: false,
            prefix_cache_scope: PrefixCacheScope::ApiKey,
            max_guide_chars: default_max_guide_chars(),
            max_guide_choices: default_max_guide_choices(),
            max_stop_chars: default_max_stop_chars(),
            max_prompt_bytes: 0,
            max_template_fuel: default_max_template_fuel(),
            guide_parser: GuideParserLimits::default(),
            prepare_threads: 0,
            max_prepare_queue: default_max_prepare_queue(),
        }
    }

    /// Checks the engine's limits against their shared bounds, then the request limits: each
    /// at least 1, and `maxTokens` no more than `maxSeqLen`.
    pub fn validate(&self) -> Result<(), BoundsError> {
        self.engine.validate()?;
        for (field, v) in [
            ("maxTokens", u64::from(self.max_tokens)),
            ("maxBodyBytes", self.max_body_bytes),
            ("requestTimeoutSeconds", self.request_timeout_seconds),
            ("maxImageBytes", self.max_image_bytes),
            ("maxImagePixels", self.max_image_pixels),
            ("maxImages", u64::from(self.max_images)),
            ("maxRequestImagePixels", self.max_request_image_pixels),
            ("maxInflightImagePixels", self.max_inflight_image_pixels),
            ("maxGuideChars", self.max_guide_chars),
            ("maxGuideChoices", u64::from(self.max_guide_choices)),
            ("maxStopChars", u64::from(self.max_stop_chars)),
            ("maxTemplateFuel", self.max_template_fuel),
            ("maxPrepareQueue", u64::from(self.max_prepare_queue)),
        ] {
            if v == 0 {
                return Err(BoundsError {
                    field,
                    message: "must be > 0".into(),
                });
            }
        }
        self.guide_parser.validate()?;
        if self.max_request_image_pixels > self.max_inflight_image_pixels {
            return Err(BoundsError {
                field: "maxRequestImagePixels",
                message: format!(
                    "{} exceeds maxInflightImagePixels {}: such a request could never run",
                    self.max_request_image_pixels, self.max_inflight_image_pixels
                ),
            });
        }
        if self.max_tokens > self.engine.max_seq_len {
            return Err(BoundsError {
                field: "maxTokens",
                message: format!(
                    "{} exceeds maxSeqLen {}",
                    self.max_tokens, self.engine.max_seq_len
                ),
            });
        }
        Ok(())
    }
}

fn default_max_tokens() -> u32 {
    2048
}
fn default_max_body() -> u64 {
    16 * 1024 * 1024
}
fn default_timeout() -> u64 {
    300
}
fn default_max_image_bytes() -> u64 {
    16 * 1024 * 1024
}
/// 40 megapixels: an 8K screenshot (7680 × 4320) fits, a 100-megapixel bitmap does not.
fn default_max_image_pixels() -> u64 {
    40_000_000
}
fn default_max_images() -> u32 {
    8
}
/// 64 Mi pixels: 4 × Qwen3-VL's `longest_edge` (16 Mi pixels, the most its processor keeps of
/// one image), above one image of the default `maxImagePixels`.
fn default_max_request_image_pixels() -> u64 {
    64 << 20
}
/// 128 Mi pixels: two requests at the default `maxRequestImagePixels`.
fn default_max_inflight_image_pixels() -> u64 {
    128 << 20
}
fn default_max_guide_chars() -> u64 {
    256 << 10
}
fn default_max_guide_choices() -> u32 {
    4096
}
fn default_max_stop_chars() -> u32 {
    1024
}
fn default_max_template_fuel() -> u64 {
    10_000_000
}
fn default_max_prepare_queue() -> u32 {
    64
}
// Settings added after the fact are left out of the wire format at their defaults, so that a
// config's content hash is what it was before they existed.
fn is_default_guide_chars(v: &u64) -> bool {
    *v == default_max_guide_chars()
}
fn is_default_guide_choices(v: &u32) -> bool {
    *v == default_max_guide_choices()
}
fn is_default_stop_chars(v: &u32) -> bool {
    *v == default_max_stop_chars()
}
fn is_default_template_fuel(v: &u64) -> bool {
    *v == default_max_template_fuel()
}
fn is_default_prepare_queue(v: &u32) -> bool {
    *v == default_max_prepare_queue()
}
fn is_zero(v: &u64) -> bool {
    *v == 0
}
fn is_zero_u32(v: &u32) -> bool {
    *v == 0
}
// The image budgets are left out of the wire format at their defaults, so that a config's
// content hash (which both sides compute over it) is what it was before they existed.
fn is_default_request_image_pixels(v: &u64) -> bool {
    *v == default_max_request_image_pixels()
}
fn is_default_inflight_image_pixels(v: &u64) -> bool {
    *v == default_max_inflight_image_pixels()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The image budgets are on the wire only when set, read back as set, and a request budget
    /// over the in-flight one is refused.
    #[test]
    fn image_budgets_round_trip_and_are_checked() {
        let l = WorkerLimits {
            max_request_image_pixels: 1000,
            max_inflight_image_pixels: 2000,
            image_url_allow_private: true,
            ..WorkerLimits::default()
        };
        let json = serde_json::to_value(&l).expect("serializes");
        assert_eq!(json["maxRequestImagePixels"], 1000);
        assert_eq!(json["maxInflightImagePixels"], 2000);
        assert_eq!(json["imageUrlAllowPrivate"], true);
        assert_eq!(
            serde_json::from_value::<WorkerLimits>(json).ok(),
            Some(l.clone())
        );
        let d = serde_json::to_value(WorkerLimits::default()).expect("serializes");
        assert!(
            d.get("maxRequestImagePixels").is_none() && d.get("imageUrlAllowPrivate").is_none()
        );
        let over = WorkerLimits {
            max_request_image_pixels: 3000,
            ..l
        };
        assert_eq!(
            over.validate().map_err(|e| e.field),
            Err("maxRequestImagePixels")
        );
    }

    /// The request-cost limits and the cache scope: off the wire at their defaults (a config's
    /// hash is what it was before they existed), read back as set, and 0 refused where 0 would
    /// refuse every request.
    #[test]
    fn cost_limits_round_trip_and_are_checked() {
        let d = serde_json::to_value(WorkerLimits::default()).expect("serializes");
        for k in [
            "prefixCacheScope",
            "maxGuideChars",
            "maxGuideChoices",
            "maxStopChars",
            "maxPromptBytes",
            "maxTemplateFuel",
            "guideParser",
            "prepareThreads",
            "maxPrepareQueue",
        ] {
            assert!(d.get(k).is_none(), "{k} is on the wire at its default");
        }
        let l: WorkerLimits = serde_json::from_value(serde_json::json!({
            "prefixCacheScope": "pool", "maxStopChars": 9, "guideParser": {"stepMaxItems": 7},
            "prepareThreads": 3,
        }))
        .expect("reads");
        assert_eq!(l.prefix_cache_scope, PrefixCacheScope::Pool);
        assert_eq!((l.max_stop_chars, l.prepare_threads), (9, 3));
        assert_eq!(l.guide_parser.step_max_items, 7);
        assert_eq!(l.guide_parser.max_grammar_size, 500_000);
        let json = serde_json::to_value(&l).expect("serializes");
        assert_eq!(json["guideParser"]["stepMaxItems"], 7);
        assert_eq!(serde_json::from_value::<WorkerLimits>(json).ok(), Some(l));
        for bad in [
            serde_json::json!({"maxGuideChars": 0}),
            serde_json::json!({"maxPrepareQueue": 0}),
            serde_json::json!({"guideParser": {"maxGrammarSize": 0}}),
        ] {
            let l: WorkerLimits = serde_json::from_value(bad.clone()).expect("reads");
            assert!(l.validate().is_err(), "{bad}");
        }
    }
}
