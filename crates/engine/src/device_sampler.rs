//! Sampling on the device, for the tensor path: a step's rows pick their tokens with batched
//! candle ops whose number does not depend on the batch size, from the step's sampling inputs
//! ([`SamplePlan::pack`], which the step's one upload carries beside the model's own inputs),
//! and send back one small tensor (`[rows, 1]`, or `[rows, 2 + 2n]` with
//! logprobs) in one copy instead of `[rows, vocab]` logits.
//!
//! The rules are those of [`super::host_sampler::Sampler`] (penalties, temperature, top-k, min-p,
//! top-p, one draw), computed without sorting the vocabulary (candle's CUDA sort holds a row in
//! shared memory, and 151,936 logits do not fit):
//! - **Penalties** come as a per-step list of `(token, repetition factor, subtracted)` entries
//!   per row (the prompt's tokens for the repetition penalty, the output's counts for the
//!   presence and frequency penalties, transformers' and OpenAI's rules), gathered, changed
//!   and scattered back in place. The list is kept up to date on the host as tokens are
//!   recorded ([`super::host_sampler::Sampler`]) rather than on the device: it changes every
//!   step, only rows with penalties have one, and it travels in the step's one upload anyway.
//! - **Top-k and top-p** are cut-offs on the (tempered) logits found by [`BISECT_STEPS`]
//!   steps of bisection per row, each a compare and a sum over `[rows, vocab]`: top-k keeps
//!   the tokens at or above the highest value that at least `k` tokens reach, top-p those at
//!   or above the highest value whose tokens hold at least `top_p` of the mass that top-k and
//!   min-p kept. **Ties at a cut-off are kept** (the host sampler keeps an arbitrary one of
//!   them), and so are tokens within `(max - min) / 2^32` of it that bisection cannot tell
//!   apart in 32 steps. **Min-p** is a direct threshold: `exp(z - max) >= min_p`.
//! - **The draw** is the inverse CDF over the kept tokens in vocabulary order (the host
//!   sampler walks them best first, so the same seed may pick another token there), at one
//!   uniform `u` per row drawn on the host from the request's seeded generator: the first
//!   token whose cumulative weight exceeds `u × total`. The cumulative sum is two-level
//!   (block sums over `[rows, blocks, 512]`, a cumulative sum over blocks, then within the
//!   chosen block) by two small triangular matmuls, since one over the vocabulary would be a
//!   `vocab × vocab` matrix.
//! - **Grammar masks** (structured outputs, [`super::grammar`]): when a row of the step has
//!   one, every row's allowed tokens travel as [`MASK_BITS`] bits per f32 (an unconstrained
//!   row all ones), unpacked by a gather, a scale by powers of two and a parity (all exact in
//!   f32), and the refused tokens' penalised logits become -inf before the greedy pick and the
//!   draw. A step without a constrained row packs and runs none of it. The mask plane follows
//!   the other inputs in one upload ([`SamplePlan::pack`]), or, when the engine computes the
//!   masks while the forward pass runs ([`SamplePlan::masks_apart`]), goes up on its own
//!   after them ([`SamplePlan::pack_masks`]).
//! - **Greedy** rows (penalised or not) take the first largest logit, as the host does, by a
//!   max and a masked min of positions (candle's CUDA argmax picks any of tied values).
//! - **Logprobs** are of the raw logits (log-softmax on the device), the chosen token's and
//!   the top `n` (the step's largest `n`, one max per rank).
//!
//! The number of ops depends only on which of these stages the step needs (any penalty, any
//! sampled row, any top-k, any top-p, the largest logprobs `n`), never on how many rows it has.
//! [`BatchSampler`] is the seam a CUDA kernel will fill; [`CandleSampler`] is its reference.

use std::sync::{Arc, Mutex, PoisonError};

use candle_core::{DType, Device, Tensor, D};

use super::grammar::{pack_mask, MASK_BITS};
use super::sampling::Sampled;
pub use super::sampling::{Penalty, RowSampling};

/// Bisection steps of a top-k or top-p cut-off: enough to separate any two logits further
/// apart than `(max - min) / 2^32` of the row.
pub const BISECT_STEPS: usize = 32;

/// Tokens per block of the two-level cumulative sum (√151,936 ≈ 390, rounded up to a power of
/// two so the within-block matmul is a regular size).
const BLOCK: usize = 512;

/// Per-row fields of the packed upload, in order.
const FIELDS: usize = 6;

/// What sampling a step's rows takes, decided on the host: which stages run (any penalty,
/// any sampled row, any top-k, any top-p, the largest logprobs `n`) and the layout of the
/// inputs [`SamplePlan::pack`] writes for the device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SamplePlan {
    rows: usize,
    vocab: usize,
    sampled: bool,
    top_k: bool,
    top_p: bool,
    top_n: Option<usize>,
    /// Penalty entries per row (the longest list; shorter ones are padded).
    entries: usize,
    /// Whether any row has a grammar mask (then every row packs one).
    masked: bool,
    /// The mask plane travels apart from the other inputs ([`SamplePlan::masks_apart`]).
    apart: bool,
}

/// A row's penalties inside a vocabulary of `v` (the host sampler skips the others too).
fn in_vocab(r: &RowSampling, v: usize) -> impl Iterator<Item = &Penalty> + Clone {
    r.penalties.iter().filter(move |p| (p.token as usize) < v)
}

impl SamplePlan {
    /// The plan for `rows` over a vocabulary of `vocab` tokens.
    pub fn new(rows: &[RowSampling], vocab: usize) -> Self {
        Self {
            rows: rows.len(),
            vocab,
            sampled: rows.iter().any(|r| !r.greedy()),
            top_k: rows
                .iter()
                .any(|r| !r.greedy() && r.top_k > 0 && r.top_k < vocab),
            top_p: rows.iter().any(|r| !r.greedy() && r.top_p < 1.0),
            top_n: rows.iter().filter_map(|r| r.logprobs).max(),
            entries: rows
                .iter()
                .map(|r| in_vocab(r, vocab).count())
                .max()
                .unwrap_or(0),
            masked: rows.iter().any(|r| r.mask.is_some()),
            apart: false,
        }
    }

    /// The plan with the rows' grammar masks uploaded apart from the other inputs (when
    /// `masked`: some row has a grammar that masks this step): the engine computes them while
    /// the forward pass runs, after the step's inputs went up, and packs them with
    /// [`SamplePlan::pack_masks`]; [`SamplePlan::pack`] then leaves them out.
    pub fn masks_apart(mut self, masked: bool) -> Self {
        self.masked = masked;
        self.apart = masked;
        self
    }

    /// Whether the mask plane travels apart ([`SamplePlan::masks_apart`]).
    pub fn has_masks_apart(&self) -> bool {
        self.apart
    }

    /// Packed f32 values of one row's mask.
    fn mask_words(&self) -> usize {
        match self.masked {
            true => self.vocab.div_ceil(MASK_BITS),
            false => 0,
        }
    }

    /// Values [`SamplePlan::pack`] writes.
    pub fn len(&self) -> usize {
        let inline = match self.apart {
            true => 0,
            false => self.mask_words(),
        };
        self.rows * (FIELDS + 3 * self.entries + inline)
    }

    /// Whether the plan packs nothing (no rows).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends the rows' inputs to `buf`: each row's fields, then the penalty entries as three
    /// `[rows, entries]` planes (a short list is padded with its last entry again, which
    /// writes the same value twice, or with a no-op entry on token 0), then, when a row has a
    /// grammar mask, every row's mask as a `[rows, words]` plane (unless the plan has
    /// [`SamplePlan::masks_apart`]).
    pub fn pack(&self, rows: &[RowSampling], buf: &mut Vec<f32>) {
        let v = self.vocab;
        buf.reserve(self.len());
        for r in rows {
            let greedy = r.greedy();
            let k = if r.top_k == 0 || r.top_k >= v {
                v
            } else {
                r.top_k
            };
            buf.extend([
                if greedy { 1.0 } else { r.temperature },
                if greedy { 1.0 } else { 0.0 },
                k as f32,
                if greedy { 1.0 } else { r.top_p },
                if greedy { 0.0 } else { r.min_p },
                if greedy { 0.0 } else { r.u },
            ]);
        }
        let noop = Penalty {
            token: 0,
            factor: 1.0,
            minus: 0.0,
        };
        for plane in 0..3 {
            for r in rows {
                let list = in_vocab(r, v);
                let pad = *list.clone().last().unwrap_or(&noop);
                buf.extend(
                    list.chain(std::iter::repeat(&pad))
                        .take(self.entries)
                        .map(|p| match plane {
                            0 => p.token as f32,
                            1 => p.factor,
                            _ => p.minus,
                        }),
                );
            }
        }
        if self.masked && !self.apart {
            for r in rows {
                pack_mask(r.mask.as_deref(), v, buf);
            }
        }
    }

    /// Appends the mask plane of a plan with [`SamplePlan::masks_apart`]: each row's allowed
    /// tokens in row order (None: every token), `[rows, words]`.
    pub fn pack_masks<'m>(
        &self,
        masks: impl Iterator<Item = Option<&'m [u32]>>,
        buf: &mut Vec<f32>,
    ) {
        buf.reserve(self.rows * self.mask_words());
        for m in masks {
            pack_mask(m, self.vocab, buf);
        }
    }
}

/// Samples a step's rows on the logits' device. Implementations issue a number of device ops
/// that does not depend on the number of rows, and return one small tensor for [`read`].
pub trait BatchSampler: Send + Sync {
    /// The rows' picks from `logits` (`[rows, vocab]`, f32) as one f32 tensor: `[rows, 1]`
    /// token ids, or with logprobs asked by any row `[rows, 2 + 2n]`: id, its logprob, the top
    /// `n` ids, their logprobs (ids are exact in f32 below 2^24). `inputs` is what
    /// `plan.pack` wrote, `[plan.len()]` on the logits' device (a view of the step's upload);
    /// `masks`, what `plan.pack_masks` wrote when the plan has [`SamplePlan::masks_apart`].
    fn sample_packed(
        &self,
        logits: &Tensor,
        plan: &SamplePlan,
        inputs: &Tensor,
        masks: Option<&Tensor>,
    ) -> candle_core::Result<Tensor>;

    /// As [`BatchSampler::sample_packed`], packing and uploading the rows' inputs itself
    /// (tools and tests; the engine's step carries them in its one upload instead).
    fn sample(&self, logits: &Tensor, rows: &[RowSampling]) -> candle_core::Result<Tensor> {
        let (b, v) = logits.dims2()?;
        if rows.len() != b {
            candle_core::bail!("{} sampling rows for {b} rows of logits", rows.len());
        }
        let plan = SamplePlan::new(rows, v);
        let mut buf = Vec::with_capacity(plan.len());
        plan.pack(rows, &mut buf);
        let len = buf.len();
        let inputs = Tensor::from_vec(buf, len, logits.device())?;
        self.sample_packed(logits, &plan, &inputs, None)
    }
}

/// Reads [`BatchSampler::sample`]'s tensor back: the step's one device→host copy.
pub fn read(picked: &Tensor, rows: &[RowSampling]) -> candle_core::Result<Vec<Sampled>> {
    let table = mole_model::download_rows::<f32>(picked)?;
    Ok(rows
        .iter()
        .zip(table)
        .map(|(r, t)| {
            let n = t.len().saturating_sub(2) / 2;
            let top = match r.logprobs {
                Some(k) => (0..k.min(n))
                    .map(|i| (t[2 + i] as u32, t[2 + n + i]))
                    .collect(),
                None => Vec::new(),
            };
            Sampled {
                token: t[0] as u32,
                logprob: match (r.logprobs, t.get(1)) {
                    (Some(_), Some(&lp)) => lp,
                    _ => f32::NAN,
                },
                top,
            }
        })
        .collect())
}

/// Device-resident constants for one vocabulary size: uploaded once, not per step.
struct Consts {
    vocab: usize,
    device: Device,
    /// Blocks of [`BLOCK`] tokens covering the vocabulary.
    blocks: usize,
    /// `[1, vocab]`: 0, 1, 2, ... (positions, f32).
    positions: Tensor,
    /// `[1, vocab]`: `vocab` (a position past every token).
    past: Tensor,
    /// `[1, BLOCK]`: 1, 2, ... (a token's position in its block, plus one).
    in_block: Tensor,
    /// `[1, blocks]`: 1, 2, ...
    block_no: Tensor,
    /// `[blocks, blocks]` and `[BLOCK, BLOCK]` upper triangles of ones: `x · U` is `x`'s
    /// cumulative sum.
    upper_blocks: Tensor,
    upper_block: Tensor,
    /// `[vocab]` u32: the packed mask value holding each token's bit.
    mask_word: Tensor,
    /// `[1, vocab]`: `2^-(t % MASK_BITS)`, which brings token `t`'s bit to the ones place.
    mask_scale: Tensor,
    /// `[1, vocab]`: -inf, a refused token's logit.
    refused: Tensor,
}

impl Consts {
    fn new(vocab: usize, device: &Device) -> candle_core::Result<Self> {
        let blocks = vocab.div_ceil(BLOCK);
        let upper = |n: usize| {
            let v: Vec<f32> = (0..n * n)
                .map(|i| if i / n <= i % n { 1.0 } else { 0.0 })
                .collect();
            Tensor::from_vec(v, (n, n), device)
        };
        let count = |from: usize, n: usize| {
            let v: Vec<f32> = (from..from + n).map(|i| i as f32).collect();
            Tensor::from_vec(v, (1, n), device)
        };
        Ok(Self {
            vocab,
            device: device.clone(),
            blocks,
            positions: count(0, vocab)?,
            past: Tensor::from_vec(vec![vocab as f32; vocab], (1, vocab), device)?,
            in_block: count(1, BLOCK)?,
            block_no: count(1, blocks)?,
            upper_blocks: upper(blocks)?,
            upper_block: upper(BLOCK)?,
            mask_word: Tensor::from_vec(
                (0..vocab)
                    .map(|t| (t / MASK_BITS) as u32)
                    .collect::<Vec<_>>(),
                vocab,
                device,
            )?,
            mask_scale: Tensor::from_vec(
                (0..vocab)
                    .map(|t| 0.5f32.powi((t % MASK_BITS) as i32))
                    .collect::<Vec<_>>(),
                (1, vocab),
                device,
            )?,
            refused: Tensor::from_vec(vec![f32::NEG_INFINITY; vocab], (1, vocab), device)?,
        })
    }
}

/// The candle reference of [`BatchSampler`] (see the module's docs for the rules).
#[derive(Default)]
pub struct CandleSampler {
    consts: Mutex<Option<Arc<Consts>>>,
}

impl CandleSampler {
    /// A sampler; its constants are made on first use.
    pub fn new() -> Self {
        Self::default()
    }

    /// Each row's greedy token (`[rows]` u32): the first of its largest logits on every device,
    /// the rule of this sampler's greedy rows beside sampled ones and of the host sampler, so a
    /// greedy request gets the same tokens whatever its batch-mates sample (candle's argmax
    /// takes the first of tied values on the CPU but any of them on CUDA, and ties are common
    /// in bf16 logits).
    pub fn greedy(&self, logits: &Tensor) -> candle_core::Result<Tensor> {
        let raw = logits.to_dtype(DType::F32)?;
        let c = self.consts(raw.dims2()?.1, raw.device())?;
        first_max(&raw, &c)?.squeeze(1)?.to_dtype(DType::U32)
    }

    fn consts(&self, vocab: usize, device: &Device) -> candle_core::Result<Arc<Consts>> {
        let mut c = self.consts.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(c) = &*c {
            if c.vocab == vocab && c.device.same_device(device) {
                return Ok(c.clone());
            }
        }
        let made = Arc::new(Consts::new(vocab, device)?);
        *c = Some(made.clone());
        Ok(made)
    }
}

/// The first position of each row's largest value (`[rows, 1]`, f32), as the host's argmax.
fn first_max(x: &Tensor, c: &Consts) -> candle_core::Result<Tensor> {
    let shape = x.dims();
    let top = x.broadcast_ge(&x.max_keepdim(D::Minus1)?)?;
    top.where_cond(
        &c.positions.broadcast_as(shape)?,
        &c.past.broadcast_as(shape)?,
    )?
    .min_keepdim(D::Minus1)
}

/// `logits` with the tokens whose bit in `packed` (`[rows, words]`, [`MASK_BITS`] bits per
/// value) is clear set to -inf.
fn masked(logits: &Tensor, packed: &Tensor, c: &Consts) -> candle_core::Result<Tensor> {
    let shape = logits.dims();
    let x = packed
        .index_select(&c.mask_word, 1)?
        .broadcast_mul(&c.mask_scale)?
        .floor()?;
    // The ones bit of floor(word / 2^k): x - 2 floor(x / 2).
    let bit = (&x - x.affine(0.5, 0.0)?.floor()?.affine(2.0, 0.0)?)?;
    bit.gt(0.5)?
        .where_cond(logits, &c.refused.broadcast_as(shape)?)
}

/// The largest `t` in `[lo, hi]` (per row) with `ok(t)`, where `ok` holds at `lo` and, once
/// false, stays false above: bisection, `lo` when `ok` fails everywhere above it.
fn bisect(
    lo: &Tensor,
    hi: &Tensor,
    ok: impl Fn(&Tensor) -> candle_core::Result<Tensor>,
) -> candle_core::Result<Tensor> {
    let (mut lo, mut hi) = (lo.clone(), hi.clone());
    for _ in 0..BISECT_STEPS {
        let mid = (&lo + &hi)?.affine(0.5, 0.0)?;
        let yes = ok(&mid)?;
        lo = yes.where_cond(&mid, &lo)?;
        hi = yes.where_cond(&hi, &mid)?;
    }
    ok(&hi)?.where_cond(&hi, &lo)
}

impl BatchSampler for CandleSampler {
    fn sample_packed(
        &self,
        logits: &Tensor,
        plan: &SamplePlan,
        inputs: &Tensor,
        masks: Option<&Tensor>,
    ) -> candle_core::Result<Tensor> {
        let (b, v) = logits.dims2()?;
        if plan.rows != b || plan.vocab != v || inputs.dims1()? != plan.len() {
            candle_core::bail!(
                "a sampling plan of {} rows over {} tokens ({} inputs) for logits {:?} and {} \
                 inputs",
                plan.rows,
                plan.vocab,
                plan.len(),
                logits.dims(),
                inputs.dims1()?
            );
        }
        let device = logits.device();
        let c = self.consts(v, device)?;
        let raw = logits.to_dtype(DType::F32)?;
        let (sampled, top_k, top_p, top_n, entries) = (
            plan.sampled,
            plan.top_k,
            plan.top_p,
            plan.top_n,
            plan.entries,
        );
        let all = inputs;
        let fields = all.narrow(0, 0, b * FIELDS)?.reshape((b, FIELDS))?;
        let field = |i: usize| fields.narrow(1, i, 1);
        let plane = |i: usize| {
            all.narrow(0, b * FIELDS + i * b * entries, b * entries)?
                .reshape((b, entries))
        };

        // Penalties, on a copy: logprobs are of the raw logits.
        let logits = if entries > 0 {
            let tokens = plane(0)?.to_dtype(DType::U32)?;
            let (factor, minus) = (plane(1)?, plane(2)?);
            let x = raw.gather(&tokens, 1)?;
            let penalised = x
                .gt(&x.zeros_like()?)?
                .where_cond(&(&x / &factor)?, &(&x * &factor)?)?;
            let penalised = (penalised - minus)?;
            let out = raw.copy()?;
            out.scatter_set(&tokens, &penalised, 1)?;
            out
        } else {
            raw.clone()
        };
        let logits = if plan.masked {
            let words = plan.mask_words();
            let packed = match (plan.apart, masks) {
                (false, _) => all.narrow(0, b * (FIELDS + 3 * entries), b * words)?,
                (true, Some(m)) if m.dims1()? == b * words => m.clone(),
                (true, m) => candle_core::bail!(
                    "a plan with {b} masks apart of {words} values each, given {:?}",
                    m.map(|m| m.dims().to_vec())
                ),
            };
            masked(&logits, &packed.reshape((b, words))?, &c)?
        } else {
            logits
        };
        let greedy = first_max(&logits, &c)?;
        let token = if sampled {
            let drawn = draw(&logits, &c, &field, top_k, top_p, plan.masked)?;
            field(1)?.to_dtype(DType::U8)?.where_cond(&greedy, &drawn)?
        } else {
            greedy
        };
        let Some(n) = top_n else {
            return Ok(token);
        };
        let lp = candle_nn::ops::log_softmax(&raw, D::Minus1)?;
        let chosen = lp.gather(&token.to_dtype(DType::U32)?, 1)?;
        let rest = lp.copy()?;
        let mut ids = Vec::with_capacity(n);
        let mut values = Vec::with_capacity(n);
        for _ in 0..n.min(v) {
            let id = first_max(&rest, &c)?;
            let at = id.to_dtype(DType::U32)?;
            let value = rest.gather(&at, 1)?;
            rest.scatter_set(&at, &value.affine(0.0, f64::NEG_INFINITY)?, 1)?;
            ids.push(id);
            values.push(value);
        }
        let mut cols = vec![token, chosen];
        cols.extend(ids);
        cols.extend(values);
        Tensor::cat(&cols, 1)
    }
}

/// The sampled rows' draw (`[rows, 1]` token ids, f32): temperature, top-k, min-p, top-p,
/// then the inverse CDF at each row's `u`.
fn draw(
    logits: &Tensor,
    c: &Consts,
    field: &dyn Fn(usize) -> candle_core::Result<Tensor>,
    top_k: bool,
    top_p: bool,
    masked: bool,
) -> candle_core::Result<Tensor> {
    let (b, v) = logits.dims2()?;
    let z = logits.broadcast_div(&field(0)?)?;
    let max = z.max_keepdim(1)?;
    // The cut-offs bisect between the smallest and largest allowed logit (a refused token's
    // -inf would leave bisection nothing to halve).
    let min = match masked {
        true => z
            .broadcast_gt(&c.refused)?
            .where_cond(&z, &max.broadcast_as((b, v))?)?
            .min_keepdim(1)?,
        false => z.min_keepdim(1)?,
    };
    let e = z.broadcast_sub(&max)?.exp()?;
    let zeros = e.zeros_like()?;
    // min-p: exp(z - max) is a token's probability over the best one's.
    let mut w = e.broadcast_ge(&field(4)?)?.where_cond(&e, &zeros)?;
    if top_k {
        let k = field(2)?;
        let cut = bisect(&min, &max, |t| {
            z.broadcast_ge(t)?
                .to_dtype(DType::F32)?
                .sum_keepdim(1)?
                .ge(&k)
        })?;
        w = z.broadcast_ge(&cut)?.where_cond(&w, &zeros)?;
    }
    if top_p {
        let need = (w.sum_keepdim(1)? * field(3)?)?;
        let cut = bisect(&min, &max, |t| {
            z.broadcast_ge(t)?
                .where_cond(&w, &zeros)?
                .sum_keepdim(1)?
                .ge(&need)
        })?;
        w = z.broadcast_ge(&cut)?.where_cond(&w, &zeros)?;
    }
    // Two-level inverse CDF: the block holding the target, then the token within it.
    let nb = c.blocks;
    let w3 = w
        .pad_with_zeros(1, 0, nb * BLOCK - v)?
        .reshape((b, nb, BLOCK))?;
    let sums = w3.sum_keepdim(2)?.reshape((b, nb))?;
    let cum = sums.matmul(&c.upper_blocks)?;
    let target = (field(5)? * cum.narrow(1, nb - 1, 1)?)?;
    // The first block whose cumulative weight exceeds the target, or (rounding) the last one
    // with any weight.
    let below = cum
        .broadcast_le(&target)?
        .to_dtype(DType::F32)?
        .sum_keepdim(1)?;
    let none = sums.zeros_like()?;
    let last = sums
        .gt(&none)?
        .where_cond(&c.block_no.broadcast_as((b, nb))?, &none)?
        .max_keepdim(1)?
        .affine(1.0, -1.0)?;
    let block = below.minimum(&last)?;
    let at = block.to_dtype(DType::U32)?;
    let before = Tensor::cat(&[&none.narrow(1, 0, 1)?, &cum], 1)?.gather(&at, 1)?;
    let offset = (target - before)?;
    let rows = w3
        .gather(
            &at.reshape((b, 1, 1))?
                .broadcast_as((b, 1, BLOCK))?
                .contiguous()?,
            1,
        )?
        .reshape((b, BLOCK))?;
    let cum = rows.matmul(&c.upper_block)?;
    let below = cum
        .broadcast_le(&offset)?
        .to_dtype(DType::F32)?
        .sum_keepdim(1)?;
    let none = rows.zeros_like()?;
    let last = rows
        .gt(&none)?
        .where_cond(&c.in_block.broadcast_as((b, BLOCK))?, &none)?
        .max_keepdim(1)?
        .affine(1.0, -1.0)?;
    block.affine(BLOCK as f64, 0.0)? + below.minimum(&last)?
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::super::api::SamplingParams;
    use super::super::host_sampler::{log_softmax, Sampler};
    use super::*;

    /// What the device returns for `rows` over `logits` (`rows.len()` rows of `vocab`).
    fn device(logits: &[f32], vocab: usize, rows: &[RowSampling]) -> Vec<Sampled> {
        let t = Tensor::from_vec(logits.to_vec(), (rows.len(), vocab), &Device::Cpu).unwrap();
        let s = CandleSampler::new();
        read(&s.sample(&t, rows).unwrap(), rows).unwrap()
    }

    /// The rules of the module's docs, written plainly on the host (sums in f64): the token,
    /// and whether the draw or the top-p cut-off lies within f32 rounding of a boundary (the
    /// device sums in f32 in another order, so there the two may differ).
    fn reference(logits: &[f32], r: &RowSampling) -> (u32, bool) {
        let mut l = logits.to_vec();
        for p in &r.penalties {
            let x = &mut l[p.token as usize];
            *x = if *x > 0.0 {
                *x / p.factor
            } else {
                *x * p.factor
            };
            *x -= p.minus;
        }
        let first_max = |v: &[f32]| {
            let m = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            v.iter().position(|&x| x == m).unwrap() as u32
        };
        if r.greedy() {
            return (first_max(&l), false);
        }
        let z: Vec<f32> = l.iter().map(|x| x / r.temperature).collect();
        let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f32> = z.iter().map(|x| (x - max).exp()).collect();
        let mut keep: Vec<bool> = e.iter().map(|&e| e >= r.min_p).collect();
        if r.top_k > 0 && r.top_k < z.len() {
            let mut sorted = z.clone();
            sorted.sort_by(|a, b| b.total_cmp(a));
            let kth = sorted[r.top_k - 1];
            keep.iter_mut().zip(&z).for_each(|(k, &x)| *k &= x >= kth);
        }
        let mut near = false;
        let w = |keep: &[bool]| -> Vec<f64> {
            keep.iter()
                .zip(&e)
                .map(|(&k, &e)| if k { e as f64 } else { 0.0 })
                .collect()
        };
        if r.top_p < 1.0 {
            let ws = w(&keep);
            let total: f64 = ws.iter().sum();
            let need = total * r.top_p as f64;
            let mut levels: Vec<f32> = (0..z.len()).filter(|&i| keep[i]).map(|i| z[i]).collect();
            levels.sort_by(|a, b| b.total_cmp(a));
            levels.dedup();
            let cut = levels
                .iter()
                .copied()
                .find(|&c| {
                    let mass: f64 = (0..z.len()).filter(|&i| z[i] >= c).map(|i| ws[i]).sum();
                    near |= (mass - need).abs() < 1e-5 * total;
                    mass >= need
                })
                .unwrap();
            keep.iter_mut().zip(&z).for_each(|(k, &x)| *k &= x >= cut);
        }
        let ws = w(&keep);
        let total: f64 = ws.iter().sum();
        let target = r.u as f64 * total;
        let mut acc = 0.0;
        let mut pick = None;
        for (i, x) in ws.iter().enumerate() {
            acc += x;
            near |= *x > 0.0 && (acc - target).abs() < 1e-5 * total;
            if acc > target && pick.is_none() {
                pick = Some(i as u32);
            }
        }
        let last = ws.iter().rposition(|&x| x > 0.0).unwrap() as u32;
        (pick.unwrap_or(last), near)
    }

    /// A greedy row's tie goes to the lowest index both ways a step picks greedy tokens: a
    /// step of greedy rows alone ([`CandleSampler::greedy`]) and the device sampler's greedy
    /// rows beside a sampled row; the host sampler's argmax agrees.
    #[test]
    fn greedy_ties_go_to_the_lowest_index_alone_and_beside_sampled_rows() {
        let vocab = 8;
        let tied = [0.0, 1.0, 3.0, -1.0, 3.0, 2.0, 3.0, 0.5];
        let other = [0.5, 2.0, 0.0, 1.0, 0.0, 4.0, 1.0, 0.0];
        let s = CandleSampler::new();
        let one = Tensor::from_vec(tied.to_vec(), (1, vocab), &Device::Cpu).unwrap();
        let alone = mole_model::download::<u32>(&s.greedy(&one).unwrap()).unwrap();
        assert_eq!(alone, [2]);
        let sampled = RowSampling {
            temperature: 1.0,
            u: 0.5,
            ..RowSampling::idle()
        };
        let both: Vec<f32> = tied.iter().chain(&other).copied().collect();
        let picked = device(&both, vocab, &[RowSampling::idle(), sampled]);
        assert_eq!(picked[0].token, 2, "beside a sampled row");
        assert_eq!(
            super::super::host_sampler::argmax(&tied),
            2,
            "the host sampler"
        );
    }

    /// Random rows: every parameter combination the rules distinguish, with penalties.
    fn random_row(rng: &mut StdRng, vocab: usize) -> RowSampling {
        let pick = |rng: &mut StdRng, v: &[f32]| v[rng.random_range(0..v.len())];
        let penalties = (0..rng.random_range(0..6))
            .map(|i| Penalty {
                token: (i * 7 + rng.random_range(0..7)) as u32 % vocab as u32,
                factor: pick(rng, &[1.0, 1.3, 0.8]),
                minus: pick(rng, &[0.0, 0.5, -0.2]),
            })
            .fold(Vec::<Penalty>::new(), |mut v, p| {
                if !v.iter().any(|q| q.token == p.token) {
                    v.push(p);
                }
                v
            });
        RowSampling {
            temperature: pick(rng, &[0.0, 0.3, 0.7, 1.0, 1.6]),
            top_k: [0, 1, 2, 5, 40][rng.random_range(0..5)],
            top_p: pick(rng, &[1.0, 0.95, 0.6, 0.2]),
            min_p: pick(rng, &[0.0, 0.02, 0.3]),
            u: rng.random::<f32>(),
            logprobs: [None, Some(0), Some(3)][rng.random_range(0..3)],
            penalties,
            mask: None,
        }
    }

    /// (a) The device's tokens are exactly the reference's, over random logits (normal, and
    /// small integers: ties everywhere) and parameter combinations, in batches of 16, with a
    /// vocabulary of one padded block and one of two; logprobs are the host's log-softmax.
    #[test]
    fn device_picks_exactly_what_the_reference_rule_picks() {
        let mut rng = StdRng::seed_from_u64(11);
        let (mut compared, mut near) = (0, 0);
        for (round, vocab) in [50usize, 700, 50, 700, 700, 1024].into_iter().enumerate() {
            let b = 16;
            let logits: Vec<f32> = (0..b * vocab)
                .map(|_| match round % 2 {
                    0 => rng.random_range(0..6) as f32,
                    _ => (rng.random::<f32>() - 0.5) * 8.0,
                })
                .collect();
            let rows: Vec<RowSampling> = (0..b).map(|_| random_row(&mut rng, vocab)).collect();
            let got = device(&logits, vocab, &rows);
            for (i, (r, g)) in rows.iter().zip(&got).enumerate() {
                let row = &logits[i * vocab..(i + 1) * vocab];
                let (want, close) = reference(row, r);
                if close {
                    near += 1;
                    continue;
                }
                compared += 1;
                assert_eq!(g.token, want, "row {i} of round {round}: {r:?}");
                let lp = log_softmax(row);
                match r.logprobs {
                    None => assert!(g.logprob.is_nan() && g.top.is_empty()),
                    Some(n) => {
                        assert!((g.logprob - lp[g.token as usize]).abs() < 1e-5);
                        let mut order: Vec<usize> = (0..vocab).collect();
                        order.sort_by(|&a, &b| lp[b].total_cmp(&lp[a]).then(a.cmp(&b)));
                        let ids: Vec<u32> = g.top.iter().map(|t| t.0).collect();
                        let want: Vec<u32> = order[..n].iter().map(|&i| i as u32).collect();
                        assert_eq!(ids, want);
                        for (id, v) in &g.top {
                            assert!((v - lp[*id as usize]).abs() < 1e-5);
                        }
                    }
                }
            }
        }
        assert!(
            compared >= 88 && near <= 8,
            "{compared} compared, {near} near"
        );
    }

    /// (b) Over a grid of `u`, each token is drawn as often as the host sampler's filtered
    /// distribution says (its kept set for top-k, top-p and min-p, renormalised), within one
    /// grid step plus f32 rounding.
    #[test]
    fn drawn_frequencies_are_the_host_samplers_filtered_distribution() {
        let logits = [1.0f32, 3.0, 2.5, 0.5, -1.0, 2.9, 0.0, 1.7, 2.2, -0.4];
        let cases: [fn(&mut SamplingParams); 5] = [
            |_| {},
            |p| p.top_k = 4,
            |p| p.top_p = 0.7,
            |p| p.min_p = 0.25,
            |p| {
                p.temperature = 0.8;
                p.top_k = 6;
                p.top_p = 0.9;
                p.min_p = 0.1;
            },
        ];
        let n = 4000;
        for f in cases {
            let mut p = SamplingParams {
                temperature: 1.0,
                ..Default::default()
            };
            f(&mut p);
            let (ids, probs) = Sampler::new(p.clone(), &[]).filtered(logits.to_vec());
            let total: f32 = probs.iter().sum();
            let rows: Vec<RowSampling> = (0..n)
                .map(|i| RowSampling {
                    temperature: p.temperature,
                    top_k: p.top_k,
                    top_p: p.top_p,
                    min_p: p.min_p,
                    u: (i as f32 + 0.5) / n as f32,
                    logprobs: None,
                    penalties: Vec::new(),
                    mask: None,
                })
                .collect();
            let all: Vec<f32> = (0..n).flat_map(|_| logits).collect();
            let mut seen = vec![0usize; logits.len()];
            for s in device(&all, logits.len(), &rows) {
                seen[s.token as usize] += 1;
            }
            for (t, &count) in seen.iter().enumerate() {
                let want = ids
                    .iter()
                    .position(|&i| i as usize == t)
                    .map_or(0.0, |k| probs[k] / total);
                let got = count as f32 / n as f32;
                assert!(
                    (got - want).abs() <= 1.0 / n as f32 + 1e-5,
                    "{p:?}: token {t} drawn {got}, expected {want}"
                );
                assert_eq!(
                    count > 0,
                    want > 0.0,
                    "{p:?}: token {t} kept on one side only"
                );
            }
        }
    }

    /// (e) Penalties change the greedy choice on the device as on the host (host_sampler.rs's
    /// test), through the sampler's packed rows.
    #[test]
    fn penalties_change_the_greedy_choice_on_the_device() {
        const LOGITS: [f32; 6] = [1.0, 3.0, 2.5, 0.5, -1.0, 2.9];
        let run = |f: fn(&mut SamplingParams), prompt: &[u32], steps: usize| {
            let mut p = SamplingParams::default();
            f(&mut p);
            let mut s = Sampler::new(p, prompt);
            (0..steps)
                .map(|_| {
                    let row = s.device_row();
                    let got = device(&LOGITS, 6, std::slice::from_ref(&row));
                    s.record_picked(got[0].clone()).token
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(run(|p| p.frequency_penalty = 0.06, &[], 3), [1, 1, 5]);
        assert_eq!(run(|p| p.presence_penalty = 0.2, &[], 2), [1, 5]);
        assert_eq!(run(|p| p.repetition_penalty = 1.5, &[1], 1), [5]);
        // Negative logits are multiplied (pushed further down): -1.0 × 2 < -1.2.
        let row = RowSampling {
            penalties: vec![Penalty {
                token: 0,
                factor: 2.0,
                minus: 0.0,
            }],
            ..RowSampling::idle()
        };
        assert_eq!(device(&[-1.0, -1.2], 2, &[row])[0].token, 1);
    }

    /// A seeded request's draws are reproducible and differ between seeds; the host and
    /// device take the same uniforms from the seed.
    #[test]
    fn seeded_rows_repeat_and_seeds_differ() {
        let logits: Vec<f32> = (0..300).map(|i| ((i * 37) % 17) as f32 * 0.3).collect();
        let run = |seed| {
            let p = SamplingParams {
                temperature: 1.2,
                top_p: 0.95,
                seed: Some(seed),
                ..Default::default()
            };
            let mut s = Sampler::new(p, &[]);
            (0..32)
                .map(|_| {
                    let row = s.device_row();
                    let got = device(&logits, 300, std::slice::from_ref(&row));
                    s.record_picked(got[0].clone()).token
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(run(5), run(5));
        assert_ne!(run(5), run(6));
    }
}
