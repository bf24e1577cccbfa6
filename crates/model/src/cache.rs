//! The KV cache of one sequence: blocks of the decoder's paged pool on the tensor path (see
//! [`super::kv`]), or on CPU f32 decoders running host kernels, token-major host vectors per
//! layer grown in place, after any leading blocks shared with the prefix cache's store. The
//! host vectors hold the decoder's KV dtype ([`KvBuf`]): f32, or bf16/f16 at half the bytes.

use std::ops::Range;

use candle_core::DType;

use super::kv::BlockTable;
use super::kvbuf::{KvBuf, KvElem};
use super::prefix::HostBlock;
use super::ModelError;
use mole_kernels::KvRun;

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
    /// Token-major `[len, kv_heads, head_dim]` keys and values that the host attention kernel
    /// reads in place and new tokens extend in place (see [`KvBuf::append`]).
    Host(KvBuf, KvBuf),
}

/// A piece of one layer's cached tokens: the buffer holding them, and where its keys and its
/// values lie in it.
pub(super) struct KvPiece<'c> {
    /// The buffer holding the keys.
    pub buf_k: &'c KvBuf,
    /// Where the keys lie in it.
    pub keys: Range<usize>,
    /// The buffer holding the values (the keys' own for a shared block).
    pub buf_v: &'c KvBuf,
    /// Where the values lie in it.
    pub values: Range<usize>,
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
    /// values per token, `layers` layers). Returns it and the tokens it holds.
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

    /// Host path: layer `li`'s cached tokens in order (of `layers` layers) as pieces of the
    /// buffers holding them: the shared blocks', then its own.
    fn host_views(&self, li: usize, layers: usize) -> Vec<KvPiece<'_>> {
        let mut views: Vec<KvPiece<'_>> = self
            .shared
            .iter()
            .map(|b| {
                let n = b.len() / (2 * layers);
                KvPiece {
                    buf_k: b,
                    keys: 2 * li * n..(2 * li + 1) * n,
                    buf_v: b,
                    values: (2 * li + 1) * n..(2 * li + 2) * n,
                }
            })
            .collect();
        if let Some(LayerKv::Host(k, v)) = self.layers.get(li) {
            views.push(KvPiece {
                buf_k: k,
                keys: 0..k.len(),
                buf_v: v,
                values: 0..v.len(),
            });
        }
        views
    }

    /// Host path: layer `li`'s cached tokens in order (of `layers` layers), as runs the
    /// attention kernel reads in place: the shared blocks', then its own. `E` is the dtype
    /// the cache holds (the decoder's).
    pub(super) fn host_runs<E: KvElem>(&self, li: usize, layers: usize) -> Vec<KvRun<'_, E>> {
        self.host_views(li, layers)
            .into_iter()
            .map(|p| KvRun {
                keys: &E::of(p.buf_k)[p.keys],
                values: &E::of(p.buf_v)[p.values],
            })
            .collect()
    }

    /// Host path: layer `li`'s keys and values of tokens `[from, to)`, as the pieces of its
    /// runs that hold them, in order (`width` values per token).
    pub(super) fn host_pieces(
        &self,
        li: usize,
        layers: usize,
        width: usize,
        from: usize,
        to: usize,
    ) -> Vec<KvPiece<'_>> {
        let mut base = 0;
        let mut pieces = Vec::new();
        for r in self.host_views(li, layers) {
            let n = r.keys.len() / width;
            let (a, b) = (from.clamp(base, base + n), to.clamp(base, base + n));
            if a < b {
                let span = (a - base) * width..(b - base) * width;
                pieces.push(KvPiece {
                    buf_k: r.buf_k,
                    keys: r.keys.start + span.start..r.keys.start + span.end,
                    buf_v: r.buf_v,
                    values: r.values.start + span.start..r.values.start + span.end,
                });
            }
            base += n;
        }
        pieces
    }

    /// Host path: layer `li`'s keys and values of tokens `[from, to)`, copied (in the dtype
    /// the cache holds).
    pub(super) fn host_copy(
        &self,
        li: usize,
        layers: usize,
        width: usize,
        from: usize,
        to: usize,
    ) -> LayerKv {
        let pieces = self.host_pieces(li, layers, width, from, to);
        let dtype = pieces.first().map_or(DType::F32, |p| p.buf_k.dtype());
        let (mut k, mut v) = (KvBuf::new(dtype), KvBuf::new(dtype));
        k.reserve_exact((to - from) * width);
        v.reserve_exact((to - from) * width);
        for p in pieces {
            k.extend_from(p.buf_k, p.keys);
            v.extend_from(p.buf_v, p.values);
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
                LayerKv::Host(k, v) => k.bytes() + v.bytes(),
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

/// A sequence's cache was filled by the other step backend (see
/// [`super::Decoder::configure`]).
pub(super) fn mixed_cache() -> ModelError {
    ModelError::Config("a sequence cache was filled by the other attention mode".into())
}
