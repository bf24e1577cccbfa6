//! The decoder's side of automatic prefix caching (see [`crate::prefix`] for the
//! index and the host store): a new sequence's cache starts from cached blocks, and a step's
//! full blocks are offered to the cache.

use std::sync::PoisonError;

use candle_core::DType;

use super::super::cache::{LayerKv, SeqCache};
use super::super::kvbuf::KvBuf;
use super::super::prefix::{BlockHash, BlockKey, HostBlocks};
use super::super::ModelError;
use super::Decoder;

impl Decoder {
    /// Starts the empty `cache` with the longest run of `hashes` from the first that the
    /// prefix cache holds (`hashes[i]` is the hash of the sequence's block `i`, see
    /// [`BlockHash`]): on the tensor path those blocks are shared, held by the cache until it
    /// drops; on the host path they are read in place from the store. On the host path, with
    /// `tokens` given (the tokens that may be reused: the context but its last token, found by
    /// their tokens only when they hold no image), the block after them is then looked for by
    /// its tokens under `seed`'s chain, and its leading tokens in common are copied too.
    /// Returns the tokens the cache then holds.
    pub fn reuse_prefix(
        &self,
        cache: &mut SeqCache,
        hashes: &[BlockHash],
        seed: BlockHash,
        tokens: Option<&[u32]>,
    ) -> Result<usize, ModelError> {
        if !cache.is_empty() || (hashes.is_empty() && tokens.is_none_or(<[u32]>::is_empty)) {
            return Ok(0);
        }
        let bs = self.tensor_opts.block_size.max(1);
        if !self.host {
            if hashes.is_empty() {
                return Ok(0);
            }
            let state = self.tensor_state()?;
            let blocks = state.kv.reuse(&mut cache.blocks, hashes);
            cache.len = blocks * bs;
            return Ok(cache.len);
        }
        let mut store = self
            .host_blocks
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let Some(store) = store.as_mut() else {
            return Ok(0);
        };
        let found = store.lookup(hashes);
        let n = found.len();
        // The block after the full ones, by its tokens: (block, tokens in common).
        let partial = tokens.and_then(|t| {
            let tail = t.get(n * bs..((n + 1) * bs).min(t.len()))?;
            let parent = n.checked_sub(1).map_or(seed, |i| hashes[i]);
            store.longest(parent, tail)
        });
        if n == 0 && partial.is_none() {
            return Ok(0);
        }
        let w = self.cfg.kv_heads() * self.cfg.head_dim();
        let layers = self.layers.len();
        // Full blocks are read in place; of a block found by its tokens, the tokens in common
        // are copied (the sequence writes its own after them).
        cache.shared = found.iter().map(|&b| store.data(b).clone()).collect();
        cache.shared_tokens = n * bs;
        let extra = partial.map_or(0, |p| p.1);
        let tokens = n * bs + extra;
        if let Some((b, take)) = partial {
            let d = store.data(b);
            let held = store.tokens(b, bs) * w;
            cache.layers = (0..layers)
                .map(|li| {
                    let at = 2 * li * held;
                    let (mut k, mut v) = (KvBuf::new(d.dtype()), KvBuf::new(d.dtype()));
                    k.append_from(d, at..at + take * w, w);
                    v.append_from(d, at + held..at + held + take * w, w);
                    LayerKv::Host(k, v)
                })
                .collect();
        }
        cache.len = tokens;
        cache.hashed = n;
        Ok(tokens)
    }

    /// Tells the prefix cache the hashes of `cache`'s full blocks it has not been told
    /// (`hashes[i]` is block `i`'s; blocks the cache does not hold whole are left out), so
    /// that later sequences reuse them: on the tensor path the blocks themselves, kept when
    /// the cache drops until the pool needs them; on the host path a copy in a store of at
    /// most `kv_blocks` blocks, least recently used evicted, findable also by its tokens
    /// (`tokens`: the sequence's, when they hold no image) after the block before it (the
    /// chain's `seed` for the first).
    pub fn store_prefix(
        &self,
        cache: &mut SeqCache,
        hashes: &[BlockHash],
        seed: BlockHash,
        tokens: Option<&[u32]>,
    ) -> Result<(), ModelError> {
        let bs = self.tensor_opts.block_size.max(1);
        let full = cache.len;
        if !self.host {
            let state = self.tensor_state()?;
            if let Some(table) = cache.blocks.as_mut() {
                state.kv.register(table, hashes, full);
            }
            return Ok(());
        }
        let upto = (full / bs).min(hashes.len());
        if upto <= cache.hashed {
            return Ok(());
        }
        let (layers, dtype) = (self.layers.len(), self.kv_dtype());
        self.host_store(|store, w| {
            for (i, &h) in hashes.iter().enumerate().take(upto).skip(cache.hashed) {
                let key = BlockKey {
                    parent: i.checked_sub(1).map_or(seed, |p| hashes[p]),
                    tokens: tokens.and_then(|t| t.get(i * bs..(i + 1) * bs)),
                };
                store.insert(h, key, |buf| {
                    host_block(buf, cache, (w, layers, dtype), i * bs, bs)
                });
            }
        });
        cache.hashed = upto;
        Ok(())
    }

    /// Offers the prefix cache a finished sequence's last, partial block (its tokens after
    /// its full blocks, whose hashes are `hashes`), findable by `tokens` after the block
    /// before it (host path; the tensor path caches full blocks only, as vLLM does). Its
    /// full blocks must have been offered first ([`Self::store_prefix`]).
    pub fn store_partial(
        &self,
        cache: &SeqCache,
        hashes: &[BlockHash],
        seed: BlockHash,
        tokens: &[u32],
    ) {
        let bs = self.tensor_opts.block_size.max(1);
        let full = cache.len / bs;
        if !self.host || cache.len.is_multiple_of(bs) || cache.hashed != full || hashes.len() < full
        {
            return;
        }
        let Some(tail) = tokens.get(full * bs..cache.len) else {
            return;
        };
        let key = BlockKey {
            parent: full.checked_sub(1).map_or(seed, |p| hashes[p]),
            tokens: Some(tail),
        };
        let (layers, dtype) = (self.layers.len(), self.kv_dtype());
        self.host_store(|store, w| {
            store.insert_partial(key, |buf| {
                host_block(buf, cache, (w, layers, dtype), full * bs, tail.len())
            });
        });
    }

    /// Runs `f` on the host path's store (made on first use, at most `kv_blocks` blocks) with
    /// the floats each cached token holds per layer.
    fn host_store<R>(&self, f: impl FnOnce(&mut HostBlocks, usize) -> R) -> R {
        let mut store = self
            .host_blocks
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let store = store.get_or_insert_with(|| HostBlocks::new(self.tensor_opts.kv_blocks));
        f(store, self.cfg.kv_heads() * self.cfg.head_dim())
    }

    /// Blocks the prefix cache holds that no sequence holds (the tensor path's cached free
    /// blocks; every block of the host path's store).
    pub fn cached_blocks(&self) -> usize {
        match self.host {
            true => self
                .host_blocks
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .as_ref()
                .map_or(0, HostBlocks::len),
            false => match &*self.tensor.lock().unwrap_or_else(PoisonError::into_inner) {
                Some(t) => t.kv.cached_idle_blocks(),
                None => 0,
            },
        }
    }

    /// A cache for another choice of the prompt in `cache`: at most its first `tokens` tokens,
    /// shared on the tensor path (its whole blocks among them, no copy), on the host path its
    /// shared blocks shared again and the rest copied. Returns it and the tokens it holds; the new sequence computes the rest itself.
    pub fn fork_cache(&self, cache: &SeqCache, tokens: usize) -> (SeqCache, usize) {
        let width = self.cfg.kv_heads() * self.cfg.head_dim();
        let bs = self.tensor_opts.block_size;
        cache.prefix(tokens, width, self.layers.len(), bs, !self.host)
    }
}

/// Writes the keys and values of `cache`'s tokens `[from, from + len)` into `buf` (empty):
/// per layer (of `layers`, `w` values a token) its keys then its values, in `dtype` (the
/// cache's).
fn host_block(
    buf: &mut KvBuf,
    cache: &SeqCache,
    (w, layers, dtype): (usize, usize, DType),
    from: usize,
    len: usize,
) {
    if buf.dtype() != dtype {
        *buf = KvBuf::new(dtype);
    }
    buf.reserve_exact(2 * layers * len * w);
    for li in 0..layers {
        let pieces = cache.host_pieces(li, layers, w, from, from + len);
        for p in &pieces {
            buf.extend_from(p.buf_k, p.keys.clone());
        }
        for p in &pieces {
            buf.extend_from(p.buf_v, p.values.clone());
        }
    }
}
