//! The LoRA slot pool of the tensor path: every adapter a step may use sits in a slot of
//! stacked weights, `Aᵀ` `[slots · n, in, rank]` (n the projections of a group, slot major)
//! and `s·B` `[slots, out, rank]` per layer and projection (slot 0 holds zeros). A step groups
//! its tokens by adapter: the host packer ([`SlotPlan`]) lists the step's slots `U` in
//! ascending order and lays each one's tokens out in a padded block of `rows` rows. A
//! projection group's update is then one gather of `x` into those blocks, one selection of
//! the `U` slots' `Aᵀ` and one batched product `[U·n, rows, in] × [U·n, in, rank]` for the
//! shrink, and per projection one selection of the `U` slots' `B`, one batched product and
//! one gather back to token order for the expand (Punica's SGMV, in candle ops: the reference
//! a CUDA kernel replaces). Each distinct adapter's weights are read once per step, not once
//! per token, and the op count depends on neither the batch size nor how many adapters it
//! mixes (only the shapes do). q/k/v share one shrink, as do gate/up.
//!
//! When the step's slots lie in one short range of the pool (as adapters loaded together do)
//! the selection is a view of that range, read in place; otherwise it is a gather, which
//! copies the `U` slots' weights once more before the product reads them. Both are one op.
//!
//! Base rows belong to no block: they read a padding row, whose shrink is zeroed by a mask, so
//! they cost nothing beyond that row.
//!
//! Slots are filled in place when a step first needs an adapter (least recently used slot not
//! in the step), so a step's cost does not depend on how many distinct adapters it holds.
//!
//! With [`LoraKernel::Bgmv`] (off by default: unproven on a device), a step of at most
//! [`bgmv::MAX_TOKENS`] tokens takes none of the above: each token's slot index travels in
//! the step's upload and [`bgmv`]'s kernels read every token's adapter from the pool in place,
//! one launch per group's shrink and one per projection's expand-add.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use candle_core::{DType, Device, Tensor};

use super::{LoraAdapter, LoraKernel, ModelConfig, ModelError, Proj, TensorPathOptions};
use mole_kernels::{bgmv, RANK_ALIGN};

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
    pub(super) const ALL: [Group; 4] = [Group::Qkv, Group::O, Group::GateUp, Group::Down];

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

/// One layer's pools: per group `Aᵀ` `[slots · n, in, rank]` (n its projections, slot major,
/// so a slot's projections sit together and a range of slots is one contiguous view), per
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
    kernel: LoraKernel,
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
            kernel: opts.lora_kernel,
            layers,
            table: Mutex::new(Table {
                held: vec![None; slots],
                step: 0,
            }),
        })
    }

    /// The dtype the slots hold and compute in.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Whether a step of `tokens` tokens takes the BGMV kernels (see [`LoraKernel`]).
    pub fn bgmv_for(&self, tokens: usize) -> bool {
        self.kernel == LoraKernel::Bgmv && tokens <= bgmv::MAX_TOKENS
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

    /// The shrink of a group: each block of `step` (`x` `[tokens, in]` gathered into `U`
    /// blocks of `rows`) times its slot's `Aᵀ` of every projection of the group, padding rows
    /// zeroed: `[n, U, rows, rank]`.
    pub fn shrink(
        &self,
        li: usize,
        group: Group,
        x: &Tensor,
        step: &StepSlots,
    ) -> candle_core::Result<Tensor> {
        let pool = &self.layers[li].a[group as usize];
        let n = group.projs().len();
        let (_, d_in, r) = pool.dims3()?;
        let (u, rows) = (step.distinct, step.rows);
        let a = step
            .select(&pool.reshape((self.slots, n * d_in * r))?)?
            .reshape((u * n, d_in, r))?;
        let x = x
            .index_select(&step.gather, 0)?
            .to_dtype(self.dtype)?
            .reshape((u, 1, rows, d_in))?;
        // One copy of the gathered `x` per projection: it is `rows · U` tokens, far smaller
        // than the weights the product reads (a group of one projection needs no copy).
        let x = match n {
            1 => x,
            _ => x.broadcast_as((u, n, rows, d_in))?.contiguous()?,
        };
        // Projection major again for the expands; the mask's product makes it contiguous.
        x.reshape((u * n, rows, d_in))?
            .matmul(&a)?
            .reshape((u, n, rows, r))?
            .transpose(0, 1)?
            .broadcast_mul(&step.keep)
    }

    /// The expand of the group's `i`th projection `proj`: its part of the shrink `h` times its
    /// block's slot's `s·B`, back in token order: `[tokens, out]` in `dtype`.
    pub fn expand(
        &self,
        li: usize,
        proj: Proj,
        h: &Tensor,
        i: usize,
        step: &StepSlots,
        dtype: DType,
    ) -> candle_core::Result<Tensor> {
        let pool = &self.layers[li].b[proj as usize];
        let (_, d_out, r) = pool.dims3()?;
        let (u, rows) = (step.distinct, step.rows);
        let b = step.select(pool)?;
        h.narrow(0, i, 1)?
            .reshape((u, rows, r))?
            .matmul(&b.transpose(1, 2)?)?
            .reshape((u * rows, d_out))?
            .index_select(&step.scatter, 0)?
            .to_dtype(dtype)
    }
}

impl LoraSlots {
    /// The BGMV shrink of a group ([`bgmv::shrink`]): `x` `[tokens, in]` times each token's
    /// slot's `Aᵀ` of every projection of the group, `tokens` each token's slot: partial sums
    /// over splits of the input, `[splits, n, tokens, rank]` f32.
    pub fn bgmv_shrink(
        &self,
        li: usize,
        group: Group,
        x: &Tensor,
        tokens: &Tensor,
    ) -> candle_core::Result<Tensor> {
        let pool = &self.layers[li].a[group as usize];
        bgmv::shrink(x, pool, tokens, group.projs().len())
    }

    /// The BGMV expand-add of the group's `i`th projection `proj` ([`bgmv::expand`]): `y` (its
    /// base product) plus `v`'s part times each token's slot's `s·B`, in `y`'s dtype.
    pub fn bgmv_expand(
        &self,
        li: usize,
        proj: Proj,
        v: &Tensor,
        i: usize,
        tokens: &Tensor,
        y: &Tensor,
    ) -> candle_core::Result<Tensor> {
        bgmv::expand(y, v, i, &self.layers[li].b[proj as usize], tokens)
    }
}

/// Where a step's tokens meet their slots, as the host lays them out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct SlotPlan {
    /// The step's blocks' slots `U`, ascending: its distinct adapter slots (never slot 0; at
    /// least one entry: a step without adapters gets slot 0 with every row masked), or, when
    /// those lie in a range at most [`RANGE_SPREAD`] times their number, every slot of that
    /// range (the ones no token uses are blocks of padding).
    pub slots: Vec<u32>,
    /// The first slot when `slots` is a range: the weights are then read in place.
    pub first: Option<u32>,
    /// Rows of every slot's block: its most tokens, plus one when base tokens need a padding
    /// row and no block has one.
    pub rows: usize,
    /// Per block row (`U · rows`), the token it takes (padding: token 0).
    pub gather: Vec<u32>,
    /// Per block row, 1 for a token's row and 0 for padding (the shrink's mask).
    pub keep: Vec<u32>,
    /// Per token, its block row (base tokens: a padding row, whose update is zero).
    pub scatter: Vec<u32>,
}

impl SlotPlan {
    /// The plan of tokens whose slots are `token_slots` (0: base).
    pub fn new(token_slots: &[u32]) -> Self {
        let mut slots: Vec<u32> = token_slots.iter().copied().filter(|&s| s != 0).collect();
        slots.sort_unstable();
        slots.dedup();
        if slots.is_empty() {
            // No adapter row: one masked block of the zero slot keeps the step's ops the same.
            slots.push(0);
        }
        let (lo, hi) = (slots[0], slots[slots.len() - 1]);
        let spread = (hi - lo + 1) as usize;
        // Reading a few idle slots in place costs less than copying the used ones first.
        let first = (spread <= RANGE_SPREAD * slots.len()).then(|| {
            slots = (lo..=hi).collect();
            lo
        });
        let mut counts = vec![0usize; slots.len()];
        let block: Vec<Option<usize>> = token_slots
            .iter()
            .map(|&s| {
                (s != 0).then(|| {
                    let b = slots
                        .binary_search(&s)
                        .expect("every used slot has a block");
                    counts[b] += 1;
                    b
                })
            })
            .collect();
        let most = counts.iter().copied().max().unwrap_or(0);
        let base = block.iter().any(Option::is_none);
        let rows = match base && counts.iter().all(|&c| c == most) {
            true => most + 1,
            false => most.max(1),
        };
        let pad = counts
            .iter()
            .position(|&c| c < rows)
            .map(|b| b * rows + rows - 1);
        let mut gather = vec![0u32; slots.len() * rows];
        let mut keep = vec![0u32; slots.len() * rows];
        let mut next: Vec<usize> = (0..slots.len()).map(|b| b * rows).collect();
        let scatter = block
            .iter()
            .enumerate()
            .map(|(t, b)| {
                let at = match b {
                    Some(b) => {
                        let at = next[*b];
                        next[*b] += 1;
                        gather[at] = t as u32;
                        keep[at] = 1;
                        at
                    }
                    None => pad.expect("a padding row exists when base tokens do"),
                };
                at as u32
            })
            .collect();
        Self {
            slots,
            first,
            rows,
            gather,
            keep,
            scatter,
        }
    }
}

/// A step's slots are read as one range when it spans at most this many times the slots the
/// step uses (at most half of what is read idle), else gathered.
pub(super) const RANGE_SPREAD: usize = 2;

/// A step's [`SlotPlan`] on the device (views of the step's one upload).
pub(super) struct StepSlots {
    /// `U` `[distinct]`.
    pub slots: Tensor,
    /// `[distinct · rows]`.
    pub gather: Tensor,
    /// The mask, `[1, distinct, rows, 1]` in the pool's dtype.
    pub keep: Tensor,
    /// `[tokens]`.
    pub scatter: Tensor,
    /// Each token's slot `[tokens]` (u32), when the step takes the BGMV kernels.
    pub tokens: Option<Tensor>,
    /// Distinct slots `U`.
    pub distinct: usize,
    /// Rows of each slot's block.
    pub rows: usize,
    /// The first slot when the blocks' slots are a range (read in place).
    pub first: Option<usize>,
}

impl StepSlots {
    /// The device side of `plan` from its uploaded sections (and each token's slot, for the
    /// BGMV kernels); `dtype` the pool's.
    pub fn new(
        plan: &SlotPlan,
        slots: Tensor,
        gather: Tensor,
        keep: Tensor,
        scatter: Tensor,
        tokens: Option<Tensor>,
        dtype: DType,
    ) -> candle_core::Result<Self> {
        let (distinct, rows) = (plan.slots.len(), plan.rows);
        Ok(Self {
            slots,
            gather,
            keep: keep.to_dtype(dtype)?.reshape((1, distinct, rows, 1))?,
            scatter,
            tokens,
            distinct,
            rows,
            first: plan.first.map(|f| f as usize),
        })
    }

    /// The step's slots of `pool` (slots along its first dimension): a view of their range,
    /// or a gather of them.
    pub fn select(&self, pool: &Tensor) -> candle_core::Result<Tensor> {
        match self.first {
            Some(first) => pool.narrow(0, first, self.distinct),
            None => pool.index_select(&self.slots, 0),
        }
    }
}

fn unwrap_all<const N: usize>(
    ts: [candle_core::Result<Tensor>; N],
) -> candle_core::Result<[Tensor; N]> {
    let v = ts.into_iter().collect::<candle_core::Result<Vec<_>>>()?;
    Ok(v.try_into().expect("N tensors"))
}

/// A deterministic stream of values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

#[allow(clippy::disallowed_methods)] // a check's input
fn tensor(
    v: Vec<f32>,
    shape: &[usize],
    dtype: DType,
    device: &Device,
) -> candle_core::Result<Tensor> {
    Tensor::from_vec(v, shape, device)?.to_dtype(dtype)
}

#[allow(clippy::disallowed_methods)] // a check's reading
fn f32s(t: &Tensor) -> candle_core::Result<Vec<f32>> {
    t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()
}

/// The unit roundoff of a dtype: the largest relative error of rounding to it.
fn unit(d: DType) -> f64 {
    match d {
        DType::F32 => 2f64.powi(-24),
        DType::BF16 => 2f64.powi(-8),
        DType::F16 => 2f64.powi(-11),
        _ => f64::NAN,
    }
}

/// A check, for tests here and on a GPU (not the serving path): the BGMV ops (on the CPU,
/// their reference arithmetic) against the grouped ops on `device`, every
/// projection of two layers (down's 1100-wide input in three of the shrink's splits), a step
/// mixing three adapters (ranks 16, 8 on three modules,
/// and 4 padded to the pool's 16) with base rows, in every (activations, pool) dtype pair
/// the decoder makes (the pool holds the wider of the two).
///
/// The bound, per output element `j` of a token, with `E_j = Σ_k (Σ_i |x_i·A_ik|)·|B_jk|`
/// (the magnitude of the update's terms), `u_p`/`u_o` the unit roundoffs of the pool's
/// and the output's dtype and `γ = (in + rank + 2)·2⁻²⁴` (f32 accumulation, either path):
/// the grouped ops round `x` to the pool's dtype (`u_x`: 0 when that is exact), the shrink
/// and the expand's product to the pool's dtype (`u_p` each) and the update to the
/// output's (`u_o`); BGMV rounds none of those. Each rounding moves the update by at most
/// its unit times `E_j` to first order, so with `e = u_x + 2u_p + u_o + 3γ` the updates
/// differ by at most `(e + 4e²)·E_j` (`4e²` bounds the products of up to three of these
/// relative errors for `e < 1`); each path then rounds `y + update` once to the output's
/// dtype, which adds at most `u_o/(1 - u_o)` of each result's magnitude. Base rows are `y`
/// itself on both. Returns, per dtype pair, the largest difference as a share of its bound;
/// Err at the first element past it.
#[doc(hidden)]
#[allow(clippy::disallowed_methods)] // a check's own inputs and readings, not a step's
pub fn bgmv_against_grouped_ops(device: &Device) -> anyhow::Result<Vec<String>> {
    let mut report = Vec::new();
    let cfg: ModelConfig = serde_json::from_value(serde_json::json!({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 1100,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6, "vocab_size": 16, "max_position_embeddings": 64,
    }))?;
    let layers = cfg.num_hidden_layers;
    let make = |rank: usize, projs: &[Proj], seed: u64| -> candle_core::Result<LoraAdapter> {
        let mut m = HashMap::new();
        for l in 0..layers {
            for &p in projs {
                let (i, o) = p.dims(&cfg);
                let s = seed * 1000 + (l * 7 + p as usize) as u64 * 2;
                let at = tensor(values(i * rank, s), &[i, rank], DType::F32, device)?;
                // B scaled as PEFT's s·B often is, so updates are not all of one size.
                let b = (tensor(values(o * rank, s + 1), &[o, rank], DType::F32, device)? * 0.25)?;
                m.insert((l, p), (at, b));
            }
        }
        Ok(LoraAdapter::from_modules(m, rank, 0))
    };
    let adapters = [
        make(16, &Proj::ALL, 1)?,
        make(8, &[Proj::Q, Proj::V, Proj::Down], 2)?,
        make(4, &Proj::ALL, 3)?,
    ];
    let a = |k: usize| Some(&adapters[k]);
    let rows = [a(0), None, a(1), a(0), a(2), None, a(1)];
    let tokens = rows.len();
    for (x_dtype, pool_dtype) in [
        (DType::F32, DType::F32),
        (DType::BF16, DType::BF16),
        (DType::F16, DType::F16),
        (DType::BF16, DType::F32),
        (DType::F16, DType::F32),
    ] {
        let opts = TensorPathOptions {
            lora_slots: 4,
            lora_rank: 16,
            lora_kernel: LoraKernel::Bgmv,
            ..Default::default()
        };
        let pool = LoraSlots::new(&cfg, &opts, pool_dtype, device)?;
        anyhow::ensure!(pool.bgmv_for(tokens), "the step does not take the BGMV ops");
        let per_token = pool.assign(&rows)?;
        let plan = SlotPlan::new(&per_token);
        let u = |v: &[u32]| Tensor::new(v, device);
        let step = StepSlots::new(
            &plan,
            u(&plan.slots)?,
            u(&plan.gather)?,
            u(&plan.keep)?,
            u(&plan.scatter)?,
            Some(u(&per_token)?),
            pool_dtype,
        )?;
        let slot_of = u(&per_token)?;
        let (up, uo) = (unit(pool_dtype), unit(x_dtype));
        let ux = if up > uo { up } else { 0.0 };
        let r = pool.rank;
        let mut worst = 0f64;
        for li in 0..layers {
            for group in Group::ALL {
                let n = group.projs().len();
                let (d_in, _) = group.projs()[0].dims(&cfg);
                let seed = 100 * li as u64 + group as u64;
                let x = tensor(
                    values(tokens * d_in, seed),
                    &[tokens, d_in],
                    x_dtype,
                    device,
                )?;
                let h = pool.shrink(li, group, &x, &step)?;
                let v = pool.bgmv_shrink(li, group, &x, &slot_of)?;
                let (xs, at) = (f32s(&x)?, f32s(&pool.layers[li].a[group as usize])?);
                for (i, &p) in group.projs().iter().enumerate() {
                    let d_out = p.dims(&cfg).1;
                    let y = tensor(
                        values(tokens * d_out, seed + 50 + i as u64),
                        &[tokens, d_out],
                        x_dtype,
                        device,
                    )?;
                    let update = pool.expand(li, p, &h, i, &step, x_dtype)?;
                    let ops = f32s(&(&y + update)?)?;
                    let ours = pool.bgmv_expand(li, p, &v, i, &slot_of, &y)?;
                    anyhow::ensure!(ours.dtype() == x_dtype, "bgmv expand in {:?}", ours.dtype());
                    let ours = f32s(&ours)?;
                    let b = f32s(&pool.layers[li].b[p as usize])?;
                    let gamma = (d_in + r + 2) as f64 * 2f64.powi(-24);
                    let e = ux + 2.0 * up + uo + 3.0 * gamma;
                    for (t, &s) in per_token.iter().enumerate() {
                        let s = s as usize;
                        let mag: Vec<f64> = (0..r)
                            .map(|k| {
                                (0..d_in)
                                    .map(|c| {
                                        let w = at[((s * n + i) * d_in + c) * r + k];
                                        (f64::from(xs[t * d_in + c]) * f64::from(w)).abs()
                                    })
                                    .sum()
                            })
                            .collect();
                        for o in 0..d_out {
                            let big_e: f64 = (0..r)
                                .map(|k| mag[k] * f64::from(b[(s * d_out + o) * r + k]).abs())
                                .sum();
                            let (g, w) = (
                                f64::from(ours[t * d_out + o]),
                                f64::from(ops[t * d_out + o]),
                            );
                            let tol =
                                (e + 4.0 * e * e) * big_e + uo / (1.0 - uo) * (g.abs() + w.abs());
                            let d = (g - w).abs();
                            if d > tol || (s == 0 && g != w) {
                                anyhow::bail!(
                                    "{x_dtype:?} over {pool_dtype:?}: layer {li} {p:?} token {t} \
                                     (slot {s}) output {o}: bgmv {g}, grouped ops {w}, bound {tol}"
                                );
                            }
                            if tol > 0.0 {
                                worst = worst.max(d / tol);
                            }
                        }
                    }
                }
            }
        }
        report.push(format!(
            "bgmv vs grouped ops on {}: {x_dtype:?} over {pool_dtype:?}, largest difference {worst:.3} of its bound",
            if device.is_cpu() { "cpu" } else { "the device" }
        ));
    }
    Ok(report)
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)] // test inputs and readings
mod tests {
    use super::*;

    #[test]
    fn one_adapter_is_one_block_of_its_tokens() {
        let p = SlotPlan::new(&[3, 3, 3]);
        assert_eq!(p.slots, [3]);
        assert_eq!(p.rows, 3);
        assert_eq!(p.gather, [0, 1, 2]);
        assert_eq!(p.keep, [1, 1, 1]);
        assert_eq!(p.scatter, [0, 1, 2]);
    }

    #[test]
    fn distinct_adapters_get_blocks_in_slot_order_padded_to_the_largest() {
        let p = SlotPlan::new(&[5, 2, 5, 9]);
        assert_eq!((p.slots.as_slice(), p.first), (&[2, 5, 9][..], None));
        assert_eq!(p.rows, 2);
        assert_eq!(p.gather, [1, 0, 0, 2, 3, 0]);
        assert_eq!(p.keep, [1, 0, 1, 1, 1, 0]);
        assert_eq!(p.scatter, [2, 0, 3, 4]);
    }

    #[test]
    fn slots_in_a_short_range_are_read_in_place_idle_ones_as_padding() {
        // 5..=7: three slots for two used, within the spread.
        let p = SlotPlan::new(&[7, 5, 7]);
        assert_eq!((p.slots.as_slice(), p.first), (&[5, 6, 7][..], Some(5)));
        assert_eq!(p.rows, 2);
        assert_eq!(p.keep, [1, 0, 0, 0, 1, 1]);
        assert_eq!(p.scatter, [4, 0, 5]);
        // 1..=16 all used: the whole range, no idle slot.
        let all: Vec<u32> = (1..=16).rev().collect();
        let p = SlotPlan::new(&all);
        assert_eq!(p.first, Some(1));
        assert_eq!(p.slots, (1..=16).collect::<Vec<_>>());
        assert_eq!(p.scatter, (0..16).rev().collect::<Vec<_>>());
        // One adapter is its own range.
        assert_eq!(SlotPlan::new(&[3, 0]).first, Some(3));
    }

    #[test]
    fn base_tokens_read_a_masked_padding_row_added_when_no_block_has_one() {
        // Every block full: one more row each.
        let p = SlotPlan::new(&[4, 0, 9]);
        assert_eq!(p.slots, [4, 9]);
        assert_eq!(p.rows, 2);
        assert_eq!(p.keep, [1, 0, 1, 0]);
        assert_eq!(p.scatter, [0, 1, 2]);
        assert_eq!(p.keep[p.scatter[1] as usize], 0);
        // A block with room: its last row.
        let p = SlotPlan::new(&[4, 4, 0, 9]);
        assert_eq!(p.rows, 2);
        assert_eq!(p.scatter, [0, 1, 3, 2]);
        assert_eq!(p.keep[3], 0);
    }

    #[test]
    fn a_step_without_adapters_is_one_masked_block_of_the_zero_slot() {
        let p = SlotPlan::new(&[0, 0]);
        assert_eq!(p.slots, [0]);
        assert_eq!(p.rows, 1);
        assert_eq!(p.keep, [0]);
        assert_eq!(p.scatter, [0, 0]);
    }

    /// The BGMV ops (on the CPU: their reference arithmetic) against the grouped ops within
    /// the bound [`bgmv_against_grouped_ops`] states; the device test (tests/model/lora_kernels.rs)
    /// runs the same on a GPU.
    #[test]
    fn bgmv_equals_the_grouped_ops_within_their_roundings() {
        for line in bgmv_against_grouped_ops(&Device::Cpu).unwrap() {
            eprintln!("{line}");
        }
    }

    #[test]
    fn the_lora_kernel_switch_parses_its_names_only() {
        for k in [LoraKernel::Ops, LoraKernel::Bgmv] {
            assert_eq!(k.as_str().parse::<LoraKernel>(), Ok(k));
        }
        assert!("BGMV".parse::<LoraKernel>().is_err());
        assert_eq!(LoraKernel::default(), LoraKernel::Ops);
    }
}
