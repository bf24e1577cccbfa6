//! The host backend: the CPU in f32. Each sequence's cache is its own (token-major, grown as it
//! goes), the rows of a step are grouped by adapter for the fused host kernels, and reused
//! prefixes live in a host store of at most `kv_blocks` blocks that sequences read in place.

use std::sync::{Mutex, PoisonError};

use candle_core::{DType, Tensor};

use super::super::batch::{Batch, Group, Positions, Row, StepPath};
use super::super::cache::{LayerKv, SeqCache};
use super::super::kv::TensorPathOptions;
use super::super::kvbuf::KvBuf;
use super::super::prefix::{BlockHash, BlockKey, HostBlocks};
use super::super::rope::RotaryTable;
use super::super::step::ImageIndices;
use super::super::{LoraAdapter, ModelError};
use super::{BackendKind, Shape, Step, StepBackend};

/// The host backend's state across steps: its prefix store.
pub(super) struct HostBackend {
    shape: Shape,
    opts: TensorPathOptions,
    /// The prefix store, made on first use (at most `opts.kv_blocks` blocks).
    store: Mutex<Option<HostBlocks>>,
}

impl HostBackend {
    pub(super) fn new(shape: Shape, opts: TensorPathOptions) -> Self {
        Self {
            shape,
            opts,
            store: Mutex::new(None),
        }
    }

    fn block_size(&self) -> usize {
        self.opts.block_size.max(1)
    }

    /// Runs `f` on the prefix store (made on first use) with the floats each cached token
    /// holds per layer.
    fn with_store<R>(&self, f: impl FnOnce(&mut HostBlocks, usize) -> R) -> R {
        let mut store = self.store.lock().unwrap_or_else(PoisonError::into_inner);
        let store = store.get_or_insert_with(|| HostBlocks::new(self.opts.kv_blocks));
        f(store, self.shape.width())
    }

    /// The step's batch, token ids and last-token indices. Rows are grouped by adapter so each
    /// adapter's low-rank product runs once per projection.
    #[allow(clippy::disallowed_methods)] // the host path (CPU) uploads as it goes
    fn batch<'r>(
        &'r self,
        rows: &[Row<'r>],
        rotary: &RotaryTable,
    ) -> Result<(Batch<'r>, Tensor, Tensor), ModelError> {
        let device = &self.shape.device;
        let lens: Vec<usize> = rows.iter().map(|r| r.tokens.len()).collect();
        let starts: Vec<usize> = rows.iter().map(|r| r.cache.len()).collect();
        let mut groups: Vec<(&LoraAdapter, Vec<u32>)> = Vec::new();
        let mut off = 0u32;
        let mut last = Vec::with_capacity(rows.len());
        for r in rows {
            let n = r.tokens.len() as u32;
            if let Some(a) = r.adapter {
                match groups.iter_mut().find(|(g, _)| std::ptr::eq(*g, a)) {
                    Some((_, idx)) => idx.extend(off..off + n),
                    None => groups.push((a, (off..off + n).collect())),
                }
            }
            off += n;
            last.push(off - 1);
        }
        let groups: Vec<Group> = groups
            .into_iter()
            .map(|(adapter, idx)| {
                Ok(Group {
                    adapter,
                    idx: Tensor::new(idx.as_slice(), device)?,
                    rows: idx,
                })
            })
            .collect::<Result<_, candle_core::Error>>()?;
        let positions = Positions::of(rows);
        let (cos, sin) = match &positions.spatial {
            Some((h, w)) => {
                let up = |v: &[u32]| Tensor::new(v, device);
                let (t, h, w) = (up(&positions.time)?, up(h)?, up(w)?);
                rotary.at(&t, Some((&h, &w)))?
            }
            None => {
                let offsets: Vec<usize> = rows
                    .iter()
                    .zip(&starts)
                    .map(|(r, s)| (*s as i64 + r.cache.pos_offset).max(0) as usize)
                    .collect();
                rotary.rows(&offsets, &lens)?
            }
        };
        let ids: Vec<u32> = rows.iter().flat_map(|r| r.tokens.iter().copied()).collect();
        let batch = Batch {
            lens,
            starts,
            cos,
            sin,
            layers: self.shape.layers(),
            device,
            dtype: self.shape.dtype,
            path: StepPath::Host {
                groups,
                kv: self.shape.kv,
            },
        };
        let ids = Tensor::new(ids.as_slice(), device)?;
        Ok((batch, ids, Tensor::new(last.as_slice(), device)?))
    }

    /// The image placeholders on the device (see [`super::super::step::Inputs::images`]): the
    /// host path's steps upload as they go.
    #[allow(clippy::disallowed_methods)] // the host path (CPU) uploads as it goes
    fn images(&self, indices: &ImageIndices) -> candle_core::Result<Vec<(Tensor, Tensor)>> {
        let (h, device) = (self.shape.cfg.hidden_size, &self.shape.device);
        indices
            .iter()
            .map(|(at, of)| {
                let n = at.len();
                let at = Tensor::new(at.as_slice(), device)?
                    .reshape((n, 1))?
                    .broadcast_as((n, h))?
                    .contiguous()?;
                Ok((at, Tensor::new(of.as_slice(), device)?))
            })
            .collect()
    }

    /// A copy of the caller's step inputs.
    #[allow(clippy::disallowed_methods)] // the host path (CPU) uploads as it goes
    fn extra(&self, extra: &[f32]) -> candle_core::Result<Option<Tensor>> {
        match extra.is_empty() {
            true => Ok(None),
            false => Ok(Some(Tensor::new(extra, &self.shape.device)?)),
        }
    }
}

impl StepBackend for HostBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Host
    }

    fn options(&self) -> &TensorPathOptions {
        &self.opts
    }

    fn kv_dtype(&self) -> DType {
        self.shape.kv
    }

    fn holds(&self, cache: &SeqCache) -> bool {
        cache.blocks.is_none()
    }

    fn reserve(&self, _rows: &mut [Row<'_>]) -> Result<(), ModelError> {
        // A host cache grows as its tokens are written.
        Ok(())
    }

    fn prepare<'b>(
        &'b self,
        rows: &[Row<'b>],
        rotary: &RotaryTable,
        images: &ImageIndices,
        extra: &[f32],
    ) -> Result<Step<'b>, ModelError> {
        let (batch, ids, last) = self.batch(rows, rotary)?;
        Ok(Step {
            batch,
            ids,
            last,
            images: self.images(images)?,
            extra: self.extra(extra)?,
        })
    }

    fn free_blocks(&self) -> usize {
        self.opts.kv_blocks
    }

    fn cached_blocks(&self) -> usize {
        self.store
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map_or(0, HostBlocks::len)
    }

    /// Full blocks are read in place from the store; with `tokens` given, the block after them
    /// is looked for by its tokens under `seed`'s chain, and its leading tokens in common are
    /// copied.
    fn reuse_prefix(
        &self,
        cache: &mut SeqCache,
        hashes: &[BlockHash],
        seed: BlockHash,
        tokens: Option<&[u32]>,
    ) -> Result<usize, ModelError> {
        let bs = self.block_size();
        let mut store = self.store.lock().unwrap_or_else(PoisonError::into_inner);
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
        let (w, layers) = (self.shape.width(), self.shape.layers());
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

    /// A copy of each new full block goes to the store (least recently used evicted),
    /// findable also by its tokens after the block before it.
    fn store_prefix(
        &self,
        cache: &mut SeqCache,
        hashes: &[BlockHash],
        seed: BlockHash,
        tokens: Option<&[u32]>,
    ) -> Result<(), ModelError> {
        let bs = self.block_size();
        let upto = (cache.len / bs).min(hashes.len());
        if upto <= cache.hashed {
            return Ok(());
        }
        let (layers, dtype) = (self.shape.layers(), self.shape.kv);
        self.with_store(|store, w| {
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

    fn store_partial(
        &self,
        cache: &SeqCache,
        hashes: &[BlockHash],
        seed: BlockHash,
        tokens: &[u32],
    ) {
        let bs = self.block_size();
        let full = cache.len / bs;
        if cache.len.is_multiple_of(bs) || cache.hashed != full || hashes.len() < full {
            return;
        }
        let Some(tail) = tokens.get(full * bs..cache.len) else {
            return;
        };
        let key = BlockKey {
            parent: full.checked_sub(1).map_or(seed, |p| hashes[p]),
            tokens: Some(tail),
        };
        let (layers, dtype) = (self.shape.layers(), self.shape.kv);
        self.with_store(|store, w| {
            store.insert_partial(key, |buf| {
                host_block(buf, cache, (w, layers, dtype), full * bs, tail.len())
            });
        });
    }

    /// The source's shared blocks are shared again and the rest copied.
    fn fork_cache(&self, cache: &SeqCache, tokens: usize) -> (SeqCache, usize) {
        let (w, layers) = (self.shape.width(), self.shape.layers());
        cache.prefix(tokens, w, layers, self.opts.block_size, false)
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
