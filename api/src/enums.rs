//! The enums both sides of the contract name: in the CRDs users write, and in the WorkerConfig
//! the worker reads.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Numeric type of model weights.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema, Default)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// bfloat16 (the default for GPU serving).
    #[default]
    Bf16,
    /// IEEE half precision.
    F16,
    /// single precision.
    F32,
}

impl Dtype {
    /// The lowercase name used on the command line and in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
            Dtype::F32 => "f32",
        }
    }
}

/// Which of transformers' Qwen2-VL image processors a vision model's pixels equal: they resize
/// with different arithmetic, and a model sees slightly different pixels from each.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema, Default)]
#[serde(rename_all = "lowercase")]
pub enum ImageProcessor {
    /// The torchvision ("fast") processor: what transformers 5 loads by default and vLLM
    /// serves Qwen2/2.5/3-VL with.
    #[default]
    Torchvision,
    /// The PIL ("slow") processor, as Qwen's `qwen-vl-utils` and images pre-resized with
    /// Pillow see them.
    Pil,
}

impl ImageProcessor {
    /// Whether this is the default (kept off the wire at its default).
    pub fn is_default(&self) -> bool {
        *self == Self::default()
    }
}

/// A routing strategy, tried in the order given.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum RouterStrategy {
    /// The request names the adapter (`model`, `adapter` or `expert`).
    Explicit,
    /// The classifier adapter scores each adapter label in one forward pass.
    Classifier,
    /// Adapter keywords and file extensions found in the prompt.
    Keywords,
    /// Embedding similarity against each adapter's description and examples.
    Embedding,
}

/// What happens to a request no strategy could route.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema, Default)]
#[serde(rename_all = "lowercase")]
pub enum RouterFallback {
    /// Serve it with the base model, no adapter.
    #[default]
    Base,
    /// Refuse it with 422.
    Reject,
}

/// Serving mode of an adapter.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema, Default)]
#[serde(rename_all = "lowercase")]
pub enum ServingMode {
    /// Loaded into the shared dynamic pods, switched per request.
    #[default]
    Dynamic,
    /// Baked into the base weights by a merge Job and served by its own pods.
    Merged,
    /// The operator decides (merged when the gates allow it).
    Auto,
}

/// What a worker process is.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum WorkerMode {
    /// A pool's shared pod: base model once, adapters switched per request.
    Dynamic,
    /// A merged adapter's pod: serves one merged model (`merged`).
    Merged,
    /// One process that does everything (development, single machine).
    #[default]
    Local,
}
