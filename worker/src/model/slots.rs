//! The LoRA slot pool of the tensor path: every adapter a step may use sits in a slot of
//! stacked weights, `Aᵀ` `[slots, in, rank]` and `s·B` `[slots, out, rank]` per layer and
//! projection, and each token names its slot (slot 0 holds zeros: base rows). A projection's
//! update is then one gather and one batched product for the shrink, the same for the expand,
//! whatever adapters the batch mixes (Punica's BGMV, in candle ops: the reference a CUDA
//! kernel replaces). q/k/v share one shrink, as do gate/up: their `Aᵀ` sit side by side.
//!
//! Slots are filled in place when a step first needs an adapter (least recently used slot not
//! in the step), so a step's cost does not depend on how many distinct adapters it holds.

use std::sync::{Mutex, PoisonError};

use candle_core::{DType, Device, Tensor};

use super::{LoraAdapter, ModelConfig, ModelError, Proj, TensorPathOptions};
use crate::kernels::RANK_ALIGN;

/// Projections that share an input, and so a shrink.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Group {
    /// q, k, v.
    Qkv,
    /// o.
    O,
    /// gate, up.
    GateUp,
    /// down.
    Down,
}

impl Group {
    const ALL: [Group; 4] = [Group::Qkv, Group::O, Group::GateUp, Group::Down];

    /// Its projections, in the order of their `Aᵀ` in the pool.
    pub fn projs(self) -> &'static [Proj] {
        match self {
            Group::Qkv => &[Proj::Q, Proj::K, Proj::V],
            Group::O => &[Proj::O],
            Group::GateUp => &[Proj::Gate, Proj::Up],
            Group::Down => &[Proj::Down],
        }
    }

    /// The group of a list of projections of one input.
    pub fn of(projs: &[Proj]) -> Option<Group> {
        Self::ALL.into_iter().find(|g| g.projs() == projs)
    }
}

/// One layer's pools: per group `Aᵀ` `[slots · n, in, rank]` (n its projections), per
/// projection `s·B` `[slots, out, rank]`.
struct LayerSlots {
    a: [Tensor; 4],
    b: [Tensor; 7],
}

/// Which adapter each slot holds, and when a step last used it.
#[derive(Debug, Default)]
struct Table {
    held: Vec<Option<(u64, u64)>>,
    step: u64,
}

/// The slot pool.
pub(super) struct LoraSlots {
    slots: usize,
    rank: usize,
    dtype: DType,
    layers: Vec<LayerSlots>,
    table: Mutex<Table>,
}

impl LoraSlots {
    /// Zeroed pools of `opts.lora_slots` adapters (plus the zero slot) at `opts.lora_rank`
    /// (rounded up to the kernels' alignment), in `dtype`.
    pub fn new(
        cfg: &ModelConfig,
        opts: &TensorPathOptions,
        dtype: DType,
        device: &Device,
    ) -> Result<Self, ModelError> {
        let slots = opts.lora_slots.max(1) + 1;
        let rank = opts.lora_rank.max(1).div_ceil(RANK_ALIGN) * RANK_ALIGN;
        let layers = (0..cfg.num_hidden_layers)
            .map(|_| -> candle_core::Result<LayerSlots> {
                let a = Group::ALL.map(|g| {
                    let (d_in, _) = g.projs()[0].dims(cfg);
                    Tensor::zeros((slots * g.projs().len(), d_in, rank), dtype, device)
                });
                let b =
                    Proj::ALL.map(|p| Tensor::zeros((slots, p.dims(cfg).1, rank), dtype, device));
                Ok(LayerSlots {
                    a: unwrap_all(a)?,
                    b: unwrap_all(b)?,
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            slots,
            rank,
            dtype,
            layers,
            table: Mutex::new(Table {
                held: vec![None; slots],
                step: 0,
            }),
        })
    }

    /// Each row's slot (0: base), loading adapters the slots do not hold into the least
    /// recently used slots this step does not need.
    pub fn assign(&self, adapters: &[Option<&LoraAdapter>]) -> Result<Vec<u32>, ModelError> {
        let mut t = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        t.step += 1;
        let step = t.step;
        let mut out = Vec::with_capacity(adapters.len());
        for a in adapters {
            let Some(a) = a else {
                out.push(0);
                continue;
            };
            let held = t
                .held
                .iter()
                .position(|h| h.is_some_and(|(id, _)| id == a.id()));
            let slot = match held {
                Some(s) => s,
                None => {
                    let free = (1..self.slots)
                        .filter(|&s| t.held[s].is_none_or(|(_, used)| used != step))
                        .min_by_key(|&s| t.held[s].map_or(0, |(_, used)| used))
                        .ok_or(ModelError::TooManyAdapters {
                            slots: self.slots - 1,
                        })?;
                    self.load(free, a)?;
                    free
                }
            };
            t.held[slot] = Some((a.id(), step));
            out.push(slot as u32);
        }
        Ok(out)
    }

    /// Copies `adapter` into `slot`, in place: every module it has, zeros where it has none.
    fn load(&self, slot: usize, adapter: &LoraAdapter) -> Result<(), ModelError> {
        for (li, l) in self.layers.iter().enumerate() {
            for (g, a_pool) in Group::ALL.iter().zip(&l.a) {
                for (i, &p) in g.projs().iter().enumerate() {
                    let m = adapter.module(li, p);
                    let (_, d_in, _) = a_pool.dims3()?;
                    let at = self.fit(m.map(|m| &m.0), d_in, a_pool.device())?;
                    a_pool.slice_set(&at, 0, slot * g.projs().len() + i)?;
                    let b_pool = &l.b[p as usize];
                    let (_, d_out, _) = b_pool.dims3()?;
                    let b = self.fit(m.map(|m| &m.1), d_out, b_pool.device())?;
                    b_pool.slice_set(&b, 0, slot)?;
                }
            }
        }
        Ok(())
    }

    /// A module's matrix `[rows, r]` as a slot holds it: `[1, rows, rank]`, zero-padded, in
    /// the pool's dtype and on its device; zeros for an absent module.
    fn fit(&self, m: Option<&Tensor>, rows: usize, device: &Device) -> Result<Tensor, ModelError> {
        let Some(m) = m else {
            return Ok(Tensor::zeros((1, rows, self.rank), self.dtype, device)?);
        };
        let r = m.dim(1)?;
        if r > self.rank {
            return Err(ModelError::Config(format!(
                "an adapter of rank {r} does not fit LoRA slots of rank {}",
                self.rank
            )));
        }
        let m = m.to_device(device)?.to_dtype(self.dtype)?;
        Ok(m.pad_with_zeros(1, 0, self.rank - r)?
            .unsqueeze(0)?
            .contiguous()?)
    }

    /// The shrink of a group: `x` `[tokens, in]` times each token's slot's `Aᵀ` of every
    /// projection of the group, `[tokens, n, 1, rank]`.
    pub fn shrink(
        &self,
        li: usize,
        group: Group,
        x: &Tensor,
        slots: &Tensor,
    ) -> candle_core::Result<Tensor> {
        let pool = &self.layers[li].a[group as usize];
        let n = group.projs().len();
        let (_, d_in, r) = pool.dims3()?;
        let t = x.dim(0)?;
        let a = pool
            .reshape((self.slots, n * d_in * r))?
            .index_select(slots, 0)?
            .reshape((t, n, d_in, r))?;
        let x = x
            .to_dtype(self.dtype)?
            .reshape((t, 1, 1, d_in))?
            .broadcast_as((t, n, 1, d_in))?
            .contiguous()?;
        x.matmul(&a)
    }

    /// The expand of one projection: `h` `[tokens, 1, rank]` (its part of the shrink) times
    /// each token's slot's `s·B`, `[tokens, out]` in `dtype`.
    pub fn expand(
        &self,
        li: usize,
        proj: Proj,
        h: &Tensor,
        slots: &Tensor,
        dtype: DType,
    ) -> candle_core::Result<Tensor> {
        let pool = &self.layers[li].b[proj as usize];
        let (_, d_out, r) = pool.dims3()?;
        let t = h.dim(0)?;
        let b = pool
            .reshape((self.slots, d_out * r))?
            .index_select(slots, 0)?
            .reshape((t, d_out, r))?;
        h.matmul(&b.transpose(1, 2)?)?
            .reshape((t, d_out))?
            .to_dtype(dtype)
    }
}

fn unwrap_all<const N: usize>(
    ts: [candle_core::Result<Tensor>; N],
) -> candle_core::Result<[Tensor; N]> {
    let v = ts.into_iter().collect::<candle_core::Result<Vec<_>>>()?;
    Ok(v.try_into().expect("N tensors"))
}
