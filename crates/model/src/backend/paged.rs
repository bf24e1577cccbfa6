//! The paged backend: a GPU's path, and the CPU's reference of it. Every sequence's keys and
//! values live in one paged KV pool (its blocks reserved before each step, cached prefixes
//! indexed by block), adapters in a pool of LoRA slots each token reads its own from, and a
//! step's inputs go to the device in one upload (see [`super::super::step`]).

use std::sync::{Mutex, OnceLock, PoisonError};

use candle_core::DType;

use super::super::batch::{Batch, Positions, Row, StepPath};
use super::super::cache::SeqCache;
use super::super::kv::{KvPool, TensorPathOptions};
use super::super::prefix::BlockHash;
use super::super::rope::RotaryTable;
use super::super::slots::LoraSlots;
use super::super::step::{self, ImageIndices};
use super::super::ModelError;
use super::{BackendKind, Shape, Step, StepBackend};

/// The paged backend's pools, allocated by the steps that first need them.
pub(super) struct PagedBackend {
    shape: Shape,
    opts: TensorPathOptions,
    /// The paged KV cache, allocated by the first step (or prefix lookup).
    kv: OnceLock<KvPool>,
    /// The LoRA slots, allocated when a step first has an adapter.
    slots: OnceLock<LoraSlots>,
    /// Held while a pool is allocated, so two threads asking at once allocate it once.
    allocating: Mutex<()>,
}

impl PagedBackend {
    pub(super) fn new(shape: Shape, opts: TensorPathOptions) -> Self {
        Self {
            shape,
            opts,
            kv: OnceLock::new(),
            slots: OnceLock::new(),
            allocating: Mutex::new(()),
        }
    }

    /// `cell`'s pool, made by `make` the first time.
    fn pool<'a, T>(
        &self,
        cell: &'a OnceLock<T>,
        make: impl FnOnce() -> Result<T, ModelError>,
    ) -> Result<&'a T, ModelError> {
        if let Some(p) = cell.get() {
            return Ok(p);
        }
        let _held = self
            .allocating
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(p) = cell.get() {
            return Ok(p);
        }
        let p = make()?;
        Ok(cell.get_or_init(|| p))
    }

    /// The paged KV cache, allocated on first use.
    fn kv(&self) -> Result<&KvPool, ModelError> {
        self.pool(&self.kv, || {
            KvPool::new(
                self.shape.layers(),
                self.shape.width(),
                &self.opts,
                self.shape.kv,
                &self.shape.device,
            )
        })
    }

    /// The LoRA slots when a row has an adapter, allocated when a step first has one, computing
    /// in the wider of the activations' dtype and that adapter's (f32 activations are never
    /// rounded to bf16).
    fn slots(&self, rows: &[Row<'_>]) -> Result<Option<&LoraSlots>, ModelError> {
        let Some(first) = rows.iter().find_map(|r| r.adapter) else {
            return Ok(None);
        };
        self.pool(&self.slots, || {
            let dtype = match first.dtype() {
                Some(DType::F32) => DType::F32,
                _ => self.shape.dtype,
            };
            LoraSlots::new(&self.shape.cfg, &self.opts, dtype, &self.shape.device)
        })
        .map(Some)
    }
}

impl StepBackend for PagedBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Paged
    }

    fn options(&self) -> &TensorPathOptions {
        &self.opts
    }

    fn kv_dtype(&self) -> DType {
        self.shape.kv
    }

    fn holds(&self, cache: &SeqCache) -> bool {
        !cache.host_filled()
    }

    fn reserve(&self, rows: &mut [Row<'_>]) -> Result<(), ModelError> {
        let kv = self.kv()?;
        self.slots(rows)?;
        for r in rows.iter_mut() {
            kv.reserve(&mut r.cache.blocks, r.cache.len + r.tokens.len())?;
        }
        Ok(())
    }

    /// Adapters are given LoRA slots, and the step's inputs (`images` and the caller's `extra`
    /// too) uploaded in one copy; rotary cos/sin are gathered by position.
    fn prepare<'b>(
        &'b self,
        rows: &[Row<'b>],
        rotary: &RotaryTable,
        images: &ImageIndices,
        extra: &[f32],
    ) -> Result<Step<'b>, ModelError> {
        let (kv, slots) = (self.kv()?, self.slots(rows)?);
        let row_slots = match slots {
            Some(s) => Some(s.assign(&rows.iter().map(|r| r.adapter).collect::<Vec<_>>())?),
            None => None,
        };
        let positions = Positions::of(rows);
        let inputs = step::inputs(
            rows,
            kv,
            row_slots.as_deref().zip(slots),
            &positions,
            self.shape.width(),
            images,
            self.shape.cfg.hidden_size,
            extra,
            &self.shape.device,
        )?;
        let lens: Vec<usize> = rows.iter().map(|r| r.tokens.len()).collect();
        let starts: Vec<usize> = rows.iter().map(|r| r.cache.len()).collect();
        let table = rotary.len()?;
        let (cos, sin) = if positions.time.iter().any(|&p| p as usize >= table) {
            // Dynamic NTK past the table (text only: M-RoPE refuses dynamic scaling).
            let beyond: Vec<usize> = rows
                .iter()
                .zip(&starts)
                .map(|(r, s)| (*s as i64 + r.cache.pos_offset).max(0) as usize)
                .collect();
            rotary.rows(&beyond, &lens)?
        } else {
            let spatial = inputs.spatial.as_ref().map(|(h, w)| (h, w));
            rotary.at(&inputs.positions, spatial)?
        };
        let batch = Batch {
            lens,
            starts,
            cos,
            sin,
            layers: self.shape.layers(),
            device: &self.shape.device,
            dtype: self.shape.dtype,
            path: StepPath::Tensor {
                paged: inputs.paged,
                lora: slots.zip(inputs.slots),
            },
        };
        Ok(Step {
            batch,
            ids: inputs.ids,
            last: inputs.last,
            images: inputs.images,
            extra: inputs.extra,
        })
    }

    fn free_blocks(&self) -> usize {
        self.kv
            .get()
            .map_or(self.opts.kv_blocks, KvPool::free_blocks)
    }

    fn cached_blocks(&self) -> usize {
        self.kv.get().map_or(0, KvPool::cached_idle_blocks)
    }

    /// The blocks are shared, held by the cache until it drops.
    fn reuse_prefix(
        &self,
        cache: &mut SeqCache,
        hashes: &[BlockHash],
        _seed: BlockHash,
        _tokens: Option<&[u32]>,
    ) -> Result<usize, ModelError> {
        if hashes.is_empty() {
            return Ok(0);
        }
        let blocks = self.kv()?.reuse(&mut cache.blocks, hashes);
        cache.len = blocks * self.opts.block_size.max(1);
        Ok(cache.len)
    }

    /// The blocks themselves are kept when the cache drops, until the pool needs them.
    fn store_prefix(
        &self,
        cache: &mut SeqCache,
        hashes: &[BlockHash],
        _seed: BlockHash,
        _tokens: Option<&[u32]>,
    ) -> Result<(), ModelError> {
        let kv = self.kv()?;
        if let Some(table) = cache.blocks.as_mut() {
            kv.register(table, hashes, cache.len);
        }
        Ok(())
    }

    fn store_partial(&self, _: &SeqCache, _: &[BlockHash], _: BlockHash, _: &[u32]) {
        // Full blocks only, as vLLM caches.
    }

    /// Its whole blocks are shared, no copy.
    fn fork_cache(&self, cache: &SeqCache, tokens: usize) -> (SeqCache, usize) {
        let (w, layers) = (self.shape.width(), self.shape.layers());
        cache.prefix(tokens, w, layers, self.opts.block_size, true)
    }
}
