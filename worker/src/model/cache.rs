//! The KV cache of one sequence: blocks of the decoder's paged pool on the tensor path (see
//! [`super::kv`]), or on CPU f32 decoders running host kernels, token-major host vectors per
//! layer grown in place, after any leading blocks shared with the prefix cache's store.

use super::kv::BlockTable;
use super::prefix::HostBlock;
use super::ModelError;
use crate::kernels::KvRun;

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
    /// Host path: the leading full blocks reused from the prefix cache, read in place (a
    /// burst of requests with one long prompt holds it once, and admitting one copies
    /// nothing); `layers` holds the tokens after them.
    pub(super) shared: Vec<HostBlock>,
    /// Tokens in `shared`.
    pub(super) shared_tokens: usize,
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
    /// context: with the paged cache (`paged`) the whole blocks among the first `tokens`,
    /// shared, not copied (full blocks are never written again); on the host path the first
    /// `tokens`, its shared blocks among them shared again and the rest copied (`width`
    /// floats per token, `layers` layers). Returns it and the tokens it holds.
    pub(super) fn prefix(
        &self,
        tokens: usize,
        width: usize,
        layers: usize,
        block_size: usize,
        paged: bool,
    ) -> (SeqCache, usize) {
        let tokens = tokens.min(self.len);
        let mut out = SeqCache::default();
        if tokens == 0 {
            return (out, 0);
        }
        let bs = block_size.max(1);
        match (&self.blocks, paged) {
            (Some(table), true) => {
                let blocks = tokens / bs;
                out.blocks = Some(table.share(blocks));
                out.len = blocks * bs;
            }
            _ => {
                let keep = self.shared.len().min(tokens / bs);
                out.shared = self.shared[..keep].to_vec();
                out.shared_tokens = keep * bs;
                if tokens > out.shared_tokens {
                    out.layers = (0..layers)
                        .map(|li| self.host_copy(li, layers, width, out.shared_tokens, tokens))
                        .collect();
                }
                out.len = tokens;
            }
        }
        let held = out.len;
        (out, held)
    }

    /// Host path: layer `li`'s cached tokens in order (of `layers` layers), as runs the
    /// attention kernel reads in place: the shared blocks', then its own.
    pub(super) fn host_runs(&self, li: usize, layers: usize) -> Vec<KvRun<'_>> {
        let mut runs: Vec<KvRun<'_>> = self
            .shared
            .iter()
            .map(|b| {
                let n = b.len() / (2 * layers);
                KvRun {
                    keys: &b[2 * li * n..(2 * li + 1) * n],
                    values: &b[(2 * li + 1) * n..(2 * li + 2) * n],
                }
            })
            .collect();
        if let Some(LayerKv::Host(k, v)) = self.layers.get(li) {
            runs.push(KvRun { keys: k, values: v });
        }
        runs
    }

    /// Host path: layer `li`'s keys and values of tokens `[from, to)`, as the pieces of its
    /// runs that hold them, in order (`width` floats per token).
    pub(super) fn host_pieces(
        &self,
        li: usize,
        layers: usize,
        width: usize,
        from: usize,
        to: usize,
    ) -> Vec<(&[f32], &[f32])> {
        let mut base = 0;
        let mut pieces = Vec::new();
        for r in self.host_runs(li, layers) {
            let n = r.keys.len() / width;
            let (a, b) = (from.clamp(base, base + n), to.clamp(base, base + n));
            if a < b {
                let span = (a - base) * width..(b - base) * width;
                pieces.push((&r.keys[span.clone()], &r.values[span]));
            }
            base += n;
        }
        pieces
    }

    /// Host path: layer `li`'s keys and values of tokens `[from, to)`, copied.
    pub(super) fn host_copy(
        &self,
        li: usize,
        layers: usize,
        width: usize,
        from: usize,
        to: usize,
    ) -> LayerKv {
        let mut k = Vec::with_capacity((to - from) * width);
        let mut v = Vec::with_capacity((to - from) * width);
        for (pk, pv) in self.host_pieces(li, layers, width, from, to) {
            k.extend_from_slice(pk);
            v.extend_from_slice(pv);
        }
        LayerKv::Host(k, v)
    }

    /// Host path: whether anything is cached in host memory.
    pub(super) fn host_filled(&self) -> bool {
        !self.shared.is_empty() || self.layers.iter().any(|l| matches!(l, LayerKv::Host(..)))
    }

    /// Host path: bytes of keys and values this cache holds itself (its shared blocks left
    /// out: the prefix store holds them).
    pub fn own_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerKv::Host(k, v) => (k.len() + v.len()) * std::mem::size_of::<f32>(),
                LayerKv::Empty => 0,
            })
            .sum()
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
