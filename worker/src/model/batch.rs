//! A forward pass's rows and what every layer of it shares.

use candle_core::{DType, Device, Tensor};

use super::{LoraAdapter, SeqCache};

/// One sequence of a batch: its new tokens, its cache (the new tokens start at `cache.len()`)
/// and the adapter it runs with.
pub struct Row<'a> {
    /// Tokens to process (the whole prompt at prefill, one token at decode).
    pub tokens: &'a [u32],
    /// The sequence's cache, extended by this forward pass.
    pub cache: &'a mut SeqCache,
    /// The adapter version this sequence pinned, or None for the base model.
    pub adapter: Option<&'a LoraAdapter>,
}

/// Per-forward facts every layer shares: the rows' new and cached tokens, adapter groups,
/// each token's rotary cos/sin at its own position, and how the step computes.
pub(super) struct Batch<'a> {
    pub lens: Vec<usize>,
    pub starts: Vec<usize>,
    pub groups: Vec<Group<'a>>,
    /// cos/sin `[tokens, head_dim/2]`: each token's rotation at its own position.
    pub cos: Tensor,
    pub sin: Tensor,
    /// CPU f32: attention and adapter updates run as fused host kernels.
    pub host: bool,
    /// Layers of the model (a cache is sized for them on first use).
    pub layers: usize,
    pub device: &'a Device,
    /// The compute dtype.
    pub dtype: DType,
}

/// Rows of a batch that share an adapter: the adapter and their token positions in the batch.
pub(super) struct Group<'a> {
    pub adapter: &'a LoraAdapter,
    pub idx: Tensor,
    pub rows: Vec<u32>,
}
