//! The bounds of the shared settings: one set, written into the CRD's schema (so the API
//! server refuses what is out of range), checked by the operator's validation and by the
//! worker's config validation.

/// Inclusive bounds of an integer setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// Smallest accepted value.
    pub min: u32,
    /// Largest accepted value.
    pub max: u32,
}

impl Bounds {
    /// Whether `v` is within the bounds.
    pub fn contains(self, v: u32) -> bool {
        (self.min..=self.max).contains(&v)
    }

    /// `field` = `v` checked against the bounds.
    pub fn check(self, field: &'static str, v: u32) -> Result<(), BoundsError> {
        if self.contains(v) {
            return Ok(());
        }
        Err(BoundsError {
            field,
            message: format!("must be within [{}, {}], not {v}", self.min, self.max),
        })
    }
}

/// Inclusive bounds of a real-valued setting.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RealBounds {
    /// Smallest accepted value.
    pub min: f64,
    /// Largest accepted value.
    pub max: f64,
}

impl RealBounds {
    /// `field` = `v` checked against the bounds (NaN is outside).
    pub fn check(self, field: &'static str, v: f64) -> Result<(), BoundsError> {
        if (self.min..=self.max).contains(&v) {
            return Ok(());
        }
        Err(BoundsError {
            field,
            message: format!("must be within [{}, {}], not {v}", self.min, self.max),
        })
    }
}

/// A shared setting outside its bounds. `field` is the name as written in JSON (`maxLoras`);
/// each side prefixes it with where the setting lives (`spec.dynamic.`, `limits.`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field} {message}")]
pub struct BoundsError {
    /// The setting, as written in JSON.
    pub field: &'static str,
    /// What is wrong.
    pub message: String,
}

/// Adapters resident on the device at once.
pub const MAX_LORAS: Bounds = Bounds { min: 1, max: 1024 };
/// Adapters kept in host memory besides the device-resident ones.
pub const MAX_CPU_LORAS: Bounds = Bounds { min: 0, max: 4096 };
/// Highest LoRA rank accepted.
pub const MAX_LORA_RANK: Bounds = Bounds { min: 1, max: 512 };
/// Sequences decoded together.
pub const MAX_BATCH_SIZE: Bounds = Bounds { min: 1, max: 1024 };
/// Longest sequence in tokens.
pub const MAX_SEQ_LEN: Bounds = Bounds {
    min: 16,
    max: 1_048_576,
};
/// Requests waiting for a batch slot.
pub const MAX_QUEUE: Bounds = Bounds {
    min: 0,
    max: 100_000,
};
/// Share of a GPU's memory the worker may use (weights, KV cache, adapters, activations), as
/// vLLM's `--gpu-memory-utilization`.
pub const GPU_MEMORY_UTILIZATION: RealBounds = RealBounds {
    min: 0.05,
    max: 1.0,
};
/// Lowest classifier probability accepted.
pub const MIN_CONFIDENCE: RealBounds = RealBounds { min: 0.0, max: 1.0 };
/// Lowest cosine similarity accepted by the embedding strategy.
pub const EMBEDDING_THRESHOLD: RealBounds = RealBounds {
    min: -1.0,
    max: 1.0,
};
