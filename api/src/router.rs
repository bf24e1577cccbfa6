//! The router: one type for the pool's `spec.router` and the WorkerConfig's `router`, so the
//! operator copies it and both sides share one set of defaults and bounds.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::bounds::{self, BoundsError};
use crate::enums::{RouterFallback, RouterStrategy};

/// The router of the pool: how requests that do not name an adapter are routed.
///
/// The `x-kubernetes-validations` rules are what kube's `KubeSchema` derive would write; they
/// are spelled out here because this crate stays free of Kubernetes types.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "message": "router.classifierAdapter is required when router.strategies contains classifier",
        "rule": "!('classifier' in self.strategies) || has(self.classifierAdapter)"
    },
    {
        "message": "router.embeddingModel is required when router.strategies contains embedding",
        "rule": "!('embedding' in self.strategies) || has(self.embeddingModel)"
    }
]))]
pub struct RouterSpec {
    /// Strategies in the order they are tried.
    #[serde(default = "default_strategies")]
    #[schemars(length(max = 4))]
    #[schemars(extend("x-kubernetes-validations" = [{
        "message": "router.strategies must not repeat a strategy",
        "rule": "self.all(s, self.exists_one(t, t == s))"
    }]))]
    pub strategies: Vec<RouterStrategy>,
    /// Name of the Adapter used as classifier (required with the classifier strategy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub classifier_adapter: Option<String>,
    /// Lowest classifier probability accepted; below it the next strategy is tried.
    #[serde(default = "default_min_confidence")]
    #[schemars(range(min = bounds::MIN_CONFIDENCE.min, max = bounds::MIN_CONFIDENCE.max))]
    pub min_confidence: f64,
    /// Directory of the sentence-embedding model on the volume (required with the embedding strategy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub embedding_model: Option<String>,
    /// Lowest cosine similarity accepted by the embedding strategy.
    #[serde(default = "default_embedding_threshold")]
    #[schemars(range(
        min = bounds::EMBEDDING_THRESHOLD.min,
        max = bounds::EMBEDDING_THRESHOLD.max
    ))]
    pub embedding_threshold: f64,
    /// What to do when no strategy routes a request.
    #[serde(default)]
    pub fallback: RouterFallback,
    /// Forward requests for merged adapters to their merged pods.
    #[serde(default = "yes")]
    pub prefer_merged: bool,
    /// Serve a merged adapter dynamically while its merged pods are unavailable.
    #[serde(default = "yes")]
    pub fallback_to_dynamic: bool,
}

impl Default for RouterSpec {
    fn default() -> Self {
        Self {
            strategies: default_strategies(),
            classifier_adapter: None,
            min_confidence: default_min_confidence(),
            embedding_model: None,
            embedding_threshold: default_embedding_threshold(),
            fallback: RouterFallback::Base,
            prefer_merged: true,
            fallback_to_dynamic: true,
        }
    }
}

impl RouterSpec {
    /// Checks the thresholds against [`bounds::MIN_CONFIDENCE`] and
    /// [`bounds::EMBEDDING_THRESHOLD`].
    pub fn validate(&self) -> Result<(), BoundsError> {
        bounds::MIN_CONFIDENCE.check("minConfidence", self.min_confidence)?;
        bounds::EMBEDDING_THRESHOLD.check("embeddingThreshold", self.embedding_threshold)
    }
}

fn default_strategies() -> Vec<RouterStrategy> {
    vec![RouterStrategy::Explicit, RouterStrategy::Keywords]
}
fn default_min_confidence() -> f64 {
    0.5
}
fn default_embedding_threshold() -> f64 {
    0.35
}
fn yes() -> bool {
    true
}
