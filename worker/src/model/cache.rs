//! The KV cache of one sequence: blocks of the decoder's paged pool on the tensor path (see
//! [`super::kv`]), or on CPU f32 decoders running host kernels, token-major host vectors per
//! layer grown in place.

use super::kv::BlockTable;
use super::ModelError;

/// The KV cache of one sequence. Dropping it frees its blocks.
#[derive(Debug, Default)]
pub struct SeqCache {
    pub(super) layers: Vec<LayerKv>,
    pub(super) blocks: Option<BlockTable>,
    pub(super) len: usize,
    /// Position minus index of the tokens after a vision-language prompt (M-RoPE gives an
    /// image fewer positions than tokens); 0 for text.
    pub(super) pos_offset: i64,
    /// Host path: leading blocks the prefix cache has (see [`super::Decoder::store_prefix`]).
    pub(super) hashed: usize,
}

/// One layer's keys and values (after RoPE) for one sequence, on the host path.
#[derive(Debug, Default, Clone)]
pub(super) enum LayerKv {
    /// Nothing cached yet.
    #[default]
    Empty,
    /// Token-major `[len, kv_heads, head_dim]` vectors that the host attention kernel reads in
    /// place and new tokens extend in place (see [`append_kv`]).
    Host(Vec<f32>, Vec<f32>),
}

impl SeqCache {
    /// Tokens cached.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Full blocks already offered to the host path's prefix store.
    pub fn blocks_offered(&self) -> usize {
        self.hashed
    }

    /// KV blocks held (tensor path).
    pub fn blocks(&self) -> usize {
        self.blocks.as_ref().map_or(0, |b| b.ids.len())
    }

    /// A cache holding this one's first tokens, for another sequence that continues the same
    /// context: with the paged cache (`block_size` given) the whole blocks among the first
    /// `tokens`, shared, not copied (full blocks are never written again); on the host path
    /// the first `tokens`, copied (`width` floats per token). Returns it and the tokens it
    /// holds.
    pub(super) fn prefix(
        &self,
        tokens: usize,
        width: usize,
        block_size: Option<usize>,
    ) -> (SeqCache, usize) {
        let tokens = tokens.min(self.len);
        let mut out = SeqCache::default();
        if tokens == 0 {
            return (out, 0);
        }
        match (&self.blocks, block_size) {
            (Some(table), Some(bs)) => {
                let blocks = tokens / bs.max(1);
                out.blocks = Some(table.share(blocks));
                out.len = blocks * bs;
            }
            _ => {
                out.layers = self
                    .layers
                    .iter()
                    .map(|l| match l {
                        LayerKv::Host(k, v) => LayerKv::Host(
                            k[..tokens * width].to_vec(),
                            v[..tokens * width].to_vec(),
                        ),
                        LayerKv::Empty => LayerKv::Empty,
                    })
                    .collect();
                out.len = tokens;
            }
        }
        let held = out.len;
        (out, held)
    }

    /// Forgets everything cached and frees its blocks (a preempted sequence is recomputed).
    pub fn clear(&mut self) {
        *self = Self::default();
    }

    /// Layer `li`'s keys and values, the cache sized for `layers` layers on first use.
    pub(super) fn layer_mut(&mut self, li: usize, layers: usize) -> &mut LayerKv {
        if self.layers.len() < layers {
            self.layers.resize(layers, LayerKv::Empty);
        }
        &mut self.layers[li]
    }
}

/// A sequence's cache was filled in the other attention mode (see
/// [`Decoder::set_host_kernels`]).
pub(super) fn mixed_cache() -> ModelError {
    ModelError::Config("a sequence cache was filled by the other attention mode".into())
}

/// Spare room, in tokens, a host cache grows by when it is full.
const KV_GROW_TOKENS: usize = 256;

/// Appends new keys (or values) to a host cache. Growth is by [`KV_GROW_TOKENS`] past what is
/// needed, not doubling: a sequence never holds more than that much spare room (doubling would
/// hold up to its whole length again), and a reallocation every 256 tokens costs little next
/// to the steps between.
pub(super) fn append_kv(cache: &mut Vec<f32>, new: &[f32], width: usize) {
    if cache.capacity() - cache.len() < new.len() {
        cache.reserve_exact(new.len() + KV_GROW_TOKENS * width);
    }
    cache.extend_from_slice(new);
}
