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

/// A unit enum whose variants are written by the names given: serde, [`FromStr`](std::str::FromStr),
/// `name()`, `NAMES` and `ALL` all read the one list, so a variant added to it is parsed,
/// written and accepted by the operator's validation at once.
macro_rules! named_enum {
    (
        $(#[$meta:meta])*
        pub enum $name:ident {
            $($(#[$vmeta:meta])* $variant:ident = $text:literal,)+
        }
    ) => {
        $(#[$meta])*
        #[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
        pub enum $name {
            $($(#[$vmeta])* #[serde(rename = $text)] $variant,)+
        }

        impl $name {
            /// Every variant, in the order declared.
            pub const ALL: &'static [Self] = &[$(Self::$variant),+];
            /// The names of [`Self::ALL`], as written.
            pub const NAMES: &'static [&'static str] = &[$($text),+];

            /// The name it is written by.
            pub fn name(self) -> &'static str {
                match self {
                    $(Self::$variant => $text,)+
                }
            }
        }

        impl std::str::FromStr for $name {
            type Err = UnknownName;

            fn from_str(s: &str) -> Result<Self, UnknownName> {
                Self::ALL
                    .iter()
                    .copied()
                    .find(|v| v.name() == s)
                    .ok_or_else(|| UnknownName {
                        name: s.to_string(),
                        known: Self::NAMES,
                    })
            }
        }
    };
}

/// A name that is none of those a named enum (the parsers above) is written by.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{name:?} is not one of: {}", known.join(", "))]
pub struct UnknownName {
    /// The name given.
    pub name: String,
    /// The names known.
    pub known: &'static [&'static str],
}

named_enum! {
    /// A tool-call format the worker parses (vLLM's `--tool-call-parser` names).
    pub enum ToolCallParser {
        /// `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5, Qwen3, QwQ, Hermes).
        Hermes = "hermes",
    }
}

named_enum! {
    /// A reasoning format the worker parses (vLLM's `--reasoning-parser` names).
    pub enum ReasoningParser {
        /// `<think>...</think>` that the model opens itself (Qwen3; with `enable_thinking: false`
        /// the template closes it in the prompt).
        Qwen3 = "qwen3",
        /// `...</think>` after a prompt that opens `<think>` (DeepSeek-R1, QwQ).
        DeepseekR1 = "deepseek_r1",
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Each parser is written, read and parsed by the one name it lists (vLLM's, as before the
    /// enums were named here); another name is refused, listing the known ones.
    #[test]
    fn parsers_are_written_and_parsed_by_their_listed_names() {
        fn check<T>(all: &[T], names: &[&str], name: fn(T) -> &'static str)
        where
            T: Copy + PartialEq + std::fmt::Debug + Serialize + serde::de::DeserializeOwned,
            T: std::str::FromStr<Err = UnknownName>,
        {
            assert_eq!(all.len(), names.len());
            for (&v, &n) in all.iter().zip(names) {
                assert_eq!(name(v), n);
                assert_eq!(serde_json::to_value(v).unwrap(), serde_json::json!(n));
                assert_eq!(
                    serde_json::from_value::<T>(serde_json::json!(n)).unwrap(),
                    v
                );
                assert_eq!(n.parse::<T>(), Ok(v));
            }
        }
        check(
            ToolCallParser::ALL,
            ToolCallParser::NAMES,
            ToolCallParser::name,
        );
        check(
            ReasoningParser::ALL,
            ReasoningParser::NAMES,
            ReasoningParser::name,
        );
        assert_eq!(ToolCallParser::NAMES, ["hermes"]);
        assert_eq!(ReasoningParser::NAMES, ["qwen3", "deepseek_r1"]);
        let e = "deepseek-r1".parse::<ReasoningParser>().unwrap_err();
        assert_eq!(
            e.to_string(),
            "\"deepseek-r1\" is not one of: qwen3, deepseek_r1"
        );
        assert!("Hermes".parse::<ToolCallParser>().is_err());
    }
}
