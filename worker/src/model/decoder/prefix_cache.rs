//! The decoder's side of automatic prefix caching (see [`crate::model::prefix`] for the
//! index and the host store): a new sequence's cache starts from cached blocks, and a step's
//! full blocks are offered to the cache.

use std::sync::PoisonError;

use super::super::cache::{LayerKv, SeqCache};
use super::super::prefix::{BlockHash, HostBlocks};
use super::super::ModelError;
use super::Decoder;

impl Decoder {
    /// Starts the empty `cache` with the longest run of `hashes` from the first that the
    /// prefix cache holds (`hashes[i]` is the hash of the sequence's block `i`, see
    /// [`BlockHash`]): on the tensor path those blocks are shared, held by the cache until it
    /// drops; on the host path their keys and values are copied in. Returns the tokens the
    /// cache then holds, whole blocks.
    pub fn reuse_prefix(
        &self,
        cache: &mut SeqCache,
        hashes: &[BlockHash],
    ) -> Result<usize, ModelError> {
        if !cache.is_empty() || hashes.is_empty() {
            return Ok(0);
        }
        let bs = self.tensor_opts.block_size.max(1);
        if !self.host {
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
        if found.is_empty() {
            return Ok(0);
        }
        let w = bs * self.cfg.kv_heads() * self.cfg.head_dim();
        let tokens = found.len() * bs;
        cache.layers = (0..self.layers.len())
            .map(|li| {
                let mut k = Vec::with_capacity(found.len() * w);
                let mut v = Vec::with_capacity(found.len() * w);
                for &b in &found {
                    let d = store.data(b);
                    k.extend_from_slice(&d[2 * li * w..(2 * li + 1) * w]);
                    v.extend_from_slice(&d[(2 * li + 1) * w..(2 * li + 2) * w]);
                }
                LayerKv::Host(k, v)
            })
            .collect();
        cache.len = tokens;
        cache.hashed = found.len();
        Ok(tokens)
    }

    /// Tells the prefix cache the hashes of `cache`'s full blocks it has not been told
    /// (`hashes[i]` is block `i`'s; blocks the cache does not hold whole are left out), so
    /// that later sequences reuse them: on the tensor path the blocks themselves, kept when
    /// the cache drops until the pool needs them; on the host path a copy in a store of at
    /// most `kv_blocks` blocks, least recently used evicted.
    pub fn store_prefix(
        &self,
        cache: &mut SeqCache,
        hashes: &[BlockHash],
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
        let w = bs * self.cfg.kv_heads() * self.cfg.head_dim();
        let mut store = self
            .host_blocks
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let store = store.get_or_insert_with(|| HostBlocks::new(self.tensor_opts.kv_blocks));
        for (i, &h) in hashes.iter().enumerate().take(upto).skip(cache.hashed) {
            store.insert(h, |buf| {
                buf.reserve_exact(2 * cache.layers.len() * w);
                for l in &cache.layers {
                    if let LayerKv::Host(k, v) = l {
                        buf.extend_from_slice(&k[i * w..(i + 1) * w]);
                        buf.extend_from_slice(&v[i * w..(i + 1) * w]);
                    }
                }
            });
        }
        cache.hashed = upto;
        Ok(())
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
    /// shared on the tensor path (its whole blocks among them, no copy) and copied on the host
    /// path. Returns it and the tokens it holds; the new sequence computes the rest itself.
    pub fn fork_cache(&self, cache: &SeqCache, tokens: usize) -> (SeqCache, usize) {
        let width = self.cfg.kv_heads() * self.cfg.head_dim();
        let paged = (!self.host).then_some(self.tensor_opts.block_size.max(1));
        cache.prefix(tokens, width, paged)
    }
}
