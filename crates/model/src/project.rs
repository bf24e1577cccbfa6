//! The projections of a batch: each base product once for the whole batch plus each adapter
//! group's update on its own rows ([`projs`]).
//!
//! Host projections of a CPU step of few tokens, computed in f32 over f32, bf16 or f16 base
//! weights: the base matmuls of the projections that share an input and their adapters'
//! updates, in one fork of the thread pool.
//!
//! Why one fork, and why a shared queue: a decode step makes a few hundred projections, and
//! each fork of the pool costs a wake-up of the other threads (tens of microseconds on a VM)
//! and a wait for the slowest. gemm's own threading forks once per block of the product and
//! runs small products (a token's) on one thread. Here the work is cut into column blocks of the
//! base product (each multiplied by [`dense`]'s kernel, or gemm on CPUs without AVX2) and tasks
//! of the adapter updates, every thread takes from both queues until
//! they are empty (so a thread woken late just finds less work), and the threads start on
//! different queues: one streams adapter weights from memory while the other multiplies the
//! base weights, where two threads streaming adapters at once share the memory bus.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

use candle_core::{Module, Tensor, D};
use rayon::prelude::*;

use super::batch::{Batch, Group, StepPath};
use super::lora::{HostUpdates, UpdateTask, HOST_LORA_MAX_TOKENS};
use super::slots::Group as Projections;
use super::weights::{quant_blocks, Fusable};
use super::{Lin, LoraAdapter, ModelError, Proj};
use mole_kernels::cpu::Isa;
use mole_kernels::dense;
use mole_kernels::quant::{self, Format, Q8Rows};
use mole_kernels::{Host, HostF32, Weight};

/// Projections of one input for the whole batch: each base matmul once, plus the adapters'
/// low-rank updates. On the tensor path every token's update comes from its LoRA slot, one
/// shrink for the projections of the input and one expand each, whatever adapters the batch
/// mixes (see [`super::slots`]). On the host path (CPU f32, few tokens) all of them run in one
/// fork of the thread pool (see [`host_projections`]); adapters the host kernels cannot read,
/// and longer inputs, take tensor ops per adapter group.
pub(super) fn projs<const N: usize>(
    batch: &Batch<'_>,
    lins: [(&Lin, Proj); N],
    layer: usize,
    x: &Tensor,
) -> Result<[Tensor; N], ModelError> {
    let groups = match &batch.path {
        StepPath::Tensor { .. } => return slot_projs(batch, lins, layer, x),
        StepPath::Host { groups, .. } => &groups[..],
    };
    let pairs: Vec<(&LoraAdapter, &[u32])> = groups
        .iter()
        .map(|g| (g.adapter, g.rows.as_slice()))
        .collect();
    let mut with_updates = Vec::with_capacity(N);
    for &(lin, which) in &lins {
        match HostUpdates::of(layer, which, &pairs)? {
            Some(u) => with_updates.push((lin, u)),
            None => break,
        }
    }
    if with_updates.len() == N {
        if let Some(out) = host_projections(x, with_updates)? {
            return Ok(out.try_into().expect("one output per projection"));
        }
    }
    let mut out = Vec::with_capacity(N);
    for (lin, which) in lins {
        out.push(tensor_updates(lin.forward(x)?, layer, which, x, groups)?);
    }
    Ok(out.try_into().expect("one output per projection"))
}

/// The tensor path's projections apart (quantized ones): base products, then the slots'
/// updates.
fn slot_projs<const N: usize>(
    batch: &Batch<'_>,
    lins: [(&Lin, Proj); N],
    layer: usize,
    x: &Tensor,
) -> Result<[Tensor; N], ModelError> {
    let mut out = Vec::with_capacity(N);
    for (lin, _) in &lins {
        out.push(lin.forward(x)?);
    }
    let out: [Tensor; N] = out.try_into().expect("one output per projection");
    slot_updates(batch, out, lins.map(|(_, p)| p), layer, x)
}

/// The projections of one input, held apart or fused (see [`Fusable`]): a fused matrix is
/// one product, split by width.
pub(super) fn fusable_projs<const N: usize>(
    batch: &Batch<'_>,
    f: &Fusable<N>,
    projs: [Proj; N],
    layer: usize,
    x: &Tensor,
) -> Result<[Tensor; N], ModelError> {
    match f {
        Fusable::Apart(lins) => self::projs(
            batch,
            std::array::from_fn(|i| (&lins[i], projs[i])),
            layer,
            x,
        ),
        Fusable::Fused(lin, widths) => {
            let y = lin.forward(x)?;
            let mut at = 0;
            let mut out = Vec::with_capacity(N);
            for &n in widths {
                out.push(y.narrow(D::Minus1, at, n)?);
                at += n;
            }
            let out: [Tensor; N] = out.try_into().expect("one output per projection");
            slot_updates(batch, out, projs, layer, x)
        }
    }
}

/// `out` (the base products of `projs` over `x`) plus the rows' adapters' updates: on the
/// tensor path, when a row has an adapter, the group's shrink once from the slots, then each
/// projection's expand; on the host path, each adapter group's by tensor ops.
fn slot_updates<const N: usize>(
    batch: &Batch<'_>,
    mut out: [Tensor; N],
    projs: [Proj; N],
    layer: usize,
    x: &Tensor,
) -> Result<[Tensor; N], ModelError> {
    match &batch.path {
        StepPath::Tensor {
            lora: Some((slots, step)),
            ..
        } => {
            let group = Projections::of(&projs).expect("the projections of one input form a group");
            match &step.tokens {
                // BGMV: each token's slot read in place, the add fused into the expand.
                Some(tokens) => {
                    let v = slots.bgmv_shrink(layer, group, x, tokens)?; // [splits, N, tokens, rank]
                    for (i, o) in out.iter_mut().enumerate() {
                        *o = slots.bgmv_expand(layer, projs[i], &v, i, tokens, o)?;
                    }
                }
                None => {
                    let h = slots.shrink(layer, group, x, step)?; // [N, distinct, rows, rank]
                    for (i, o) in out.iter_mut().enumerate() {
                        let update = slots.expand(layer, projs[i], &h, i, step, o.dtype())?;
                        *o = (&*o + update)?;
                    }
                }
            }
        }
        StepPath::Tensor { lora: None, .. } => {}
        // Fused weights on the host path: each adapter group's update by tensor ops.
        StepPath::Host { groups, .. } => {
            for (o, &which) in out.iter_mut().zip(&projs) {
                *o = tensor_updates(o.clone(), layer, which, x, groups)?;
            }
        }
    }
    Ok(out)
}

/// `out` plus each adapter group's update with tensor ops (GPU, other dtypes, prefill).
fn tensor_updates(
    mut out: Tensor,
    layer: usize,
    which: Proj,
    x: &Tensor,
    groups: &[Group<'_>],
) -> Result<Tensor, ModelError> {
    for g in groups {
        out = g.adapter.apply(layer, which, x, &g.idx, &out)?;
    }
    Ok(out)
}

/// Output columns per block of a base product: enough blocks for every thread to take
/// several (so they finish together), each block's weights (`in` × 128 × 4 bytes) within a
/// core's L2 for the usual widths, and each block long enough to cost little to start.
const COLUMNS_PER_BLOCK: usize = 128;

/// `x·Wᵀ + bias` plus the adapters' updates, for each `(lin, updates)` over the same input
/// `x` `[tokens, in]`. None when the batch does not qualify (`x` not CPU f32, weights not
/// f32/bf16/f16, no tokens or more than [`HOST_LORA_MAX_TOKENS`], or a quantized base whose
/// output is not f32): the caller takes the tensor path.
#[allow(clippy::disallowed_methods)] // the CPU host path: its "upload" is a move
pub fn host_projections(
    x: &Tensor,
    lins: Vec<(&Lin, HostUpdates<'_>)>,
) -> candle_core::Result<Option<Vec<Tensor>>> {
    let (t, d_in) = x.dims2()?;
    let Some(xg) = HostF32::of(x).filter(|_| (1..=HOST_LORA_MAX_TOKENS).contains(&t)) else {
        return Ok(None);
    };
    let xs = xg.slice(t * d_in);
    let Some((weights, mut outs)) = base_outputs(x, &lins)? else {
        return Ok(None);
    };
    let mut sums: Vec<Vec<f32>> = lins
        .iter()
        .zip(&outs)
        .map(|((_, u), o)| {
            if u.is_empty() {
                Vec::new()
            } else {
                vec![0f32; o.len()]
            }
        })
        .collect();
    {
        let tasks: Vec<UpdateTask<'_>> = lins
            .iter()
            .zip(sums.iter_mut())
            .flat_map(|((_, u), s)| u.tasks(d_in, s))
            .collect();
        // What a thread reads after a task: likeliest, the next one in the queue.
        let reads: Vec<[&[u8]; 2]> = tasks.iter().map(UpdateTask::reads).collect();
        let tasks: Vec<Mutex<Option<UpdateTask<'_>>>> = tasks
            .into_iter()
            .map(|task| Mutex::new(Some(task)))
            .collect();
        // Quantized weights multiply the input rounded to 8 bits, once for all of them: with
        // a scale per 256 values where a k-quant is among them (the other formats multiply
        // such rows too).
        let q8 = weights
            .iter()
            .filter_map(|w| match w {
                Some((Base::Quant(_, f), ..)) => Some(*f),
                _ => None,
            })
            .max_by_key(|f| f.block_values())
            .map(|f| Q8Rows::for_format(f, xs, t, d_in));
        let mut blocks = Vec::new();
        for (w, out) in weights.iter().zip(outs.iter_mut()) {
            if let Some((w, d_out, bias)) = w {
                let out = Columns::new(out, *d_out);
                for lo in (0..*d_out).step_by(COLUMNS_PER_BLOCK) {
                    let hi = (lo + COLUMNS_PER_BLOCK).min(*d_out);
                    blocks.push((w.rows(d_out * d_in, q8.as_ref()), out, lo..hi, *bias));
                }
            }
        }
        let direct = dense::available();
        let (next_task, next_block) = (AtomicUsize::new(0), AtomicUsize::new(0));
        let take_task = || {
            let i = next_task.fetch_add(1, Ordering::Relaxed);
            let Some(task) = tasks.get(i) else {
                return false;
            };
            let task = task.lock().unwrap_or_else(PoisonError::into_inner).take();
            if let Some(task) = task {
                task.run(xs, reads.get(i + 1).copied().unwrap_or([&[], &[]]));
            }
            true
        };
        let take_block = || match blocks.get(next_block.fetch_add(1, Ordering::Relaxed)) {
            Some((w, out, cols, bias)) => {
                // SAFETY: every block is taken once (the counter) and blocks of one output
                // cover disjoint columns, so no two threads write the same element.
                unsafe { out.product(xs, t, d_in, *w, cols.clone(), *bias, direct) };
                true
            }
            None => false,
        };
        let threads = rayon::current_num_threads().max(1);
        (0..threads).into_par_iter().with_max_len(1).for_each(|j| {
            if j % 2 == 0 {
                while take_task() {}
                while take_block() {}
            } else {
                while take_block() {}
                while take_task() {}
            }
        });
    }
    outs.into_iter()
        .zip(sums)
        .map(|(mut out, sum)| {
            for (o, s) in out.iter_mut().zip(&sum) {
                *o += s;
            }
            let d_out = out.len() / t;
            Tensor::from_vec(out, (t, d_out), x.device())
        })
        .collect::<candle_core::Result<Vec<_>>>()
        .map(Some)
}

/// A projection's base weights for the kernels, its output width and whether its output
/// starts from a bias; None where candle already computed the output (a quantized base).
type BaseWork<'t> = Option<(Base<'t>, usize, bool)>;

/// Per projection, its [`BaseWork`] and its output.
type BaseOutputs<'t> = (Vec<BaseWork<'t>>, Vec<Vec<f32>>);

/// Per projection of `lins`: the base weights to multiply here and the output, holding the
/// bias or, for a quantized base, candle's product. None when a projection's weights, bias or
/// quantized output cannot be read in place.
fn base_outputs<'t>(
    x: &Tensor,
    lins: &[(&'t Lin, HostUpdates<'_>)],
) -> candle_core::Result<Option<BaseOutputs<'t>>> {
    let (t, d_in) = x.dims2()?;
    let mut weights = Vec::with_capacity(lins.len());
    let mut outs = Vec::with_capacity(lins.len());
    for (lin, _) in lins {
        match lin {
            Lin::Dense(l) => {
                let (d_out, w_in) = l.weight().dims2()?;
                let w = l.weight();
                let w = match (HostF32::of(w), Host::of(w), Host::of(w)) {
                    (Some(w), _, _) => Base::F32(w),
                    (_, Some(w), _) => Base::Bf16(w),
                    (_, _, Some(w)) => Base::F16(w),
                    _ => return Ok(None),
                };
                let bias = l.bias();
                let mut out = vec![0f32; t * d_out];
                if let Some(b) = bias {
                    let Some(b) = HostF32::of(b) else {
                        return Ok(None);
                    };
                    for row in out.chunks_mut(d_out) {
                        row.copy_from_slice(b.slice(d_out));
                    }
                }
                debug_assert_eq!(w_in, d_in);
                weights.push(Some((w, d_out, bias.is_some())));
                outs.push(out);
            }
            Lin::Quantized(w, bias) if quant_blocks(w).is_some() => {
                let Some((q, f, d_out, _)) = quant_blocks(w) else {
                    unreachable!("matched")
                };
                let mut out = vec![0f32; t * d_out];
                if let Some(b) = bias {
                    let Some(b) = HostF32::of(b) else {
                        return Ok(None);
                    };
                    for row in out.chunks_mut(d_out) {
                        row.copy_from_slice(b.slice(d_out));
                    }
                }
                weights.push(Some((Base::Quant(q.data()?, f), d_out, bias.is_some())));
                outs.push(out);
            }
            Lin::Quantized(..) => {
                let y = lin.forward(x)?;
                let Some(yg) = HostF32::of(&y) else {
                    return Ok(None);
                };
                let d_out = y.dim(1)?;
                weights.push(None);
                outs.push(yg.slice(t * d_out).to_vec());
            }
        }
    }
    Ok(Some((weights, outs)))
}

/// A projection's base weights as held: f32, or a half type widened to f32 as the kernel
/// loads it, or quantized blocks (multiplied with the input rounded to 8 bits, see
/// [`mole_kernels::quant`]).
enum Base<'t> {
    F32(HostF32<'t>),
    Bf16(Host<'t, half::bf16>),
    F16(Host<'t, half::f16>),
    Quant(std::borrow::Cow<'t, [u8]>, Format),
}

impl Base<'_> {
    /// The first `n` weights; `q8` the input rounded for quantized weights.
    fn rows<'a>(&'a self, n: usize, q8: Option<&'a Q8Rows>) -> Rows<'a> {
        match self {
            Base::F32(w) => Rows::F32(w.slice(n)),
            Base::Bf16(w) => Rows::Bf16(w.slice(n)),
            Base::F16(w) => Rows::F16(w.slice(n)),
            Base::Quant(w, f) => Rows::Quant(
                w,
                *f,
                q8.expect("the input is rounded for quantized weights"),
            ),
        }
    }
}

/// Base weights `[rows, in]`, row-major, in their held type.
#[derive(Clone, Copy)]
enum Rows<'a> {
    F32(&'a [f32]),
    Bf16(&'a [half::bf16]),
    F16(&'a [half::f16]),
    /// Blocks of every row, their format, and the input rounded to 8 bits.
    Quant(&'a [u8], Format, &'a Q8Rows),
}

/// A `[tokens, width]` row-major output that threads write in disjoint column blocks.
#[derive(Clone, Copy)]
struct Columns {
    ptr: *mut f32,
    width: usize,
}

// SAFETY: shared only within `host_projections`, while the buffer lives, by threads that
// write disjoint column blocks (see `product`).
unsafe impl Send for Columns {}
// SAFETY: as for Send: the threads that share it write disjoint elements.
unsafe impl Sync for Columns {}

impl Columns {
    fn new(out: &mut [f32], width: usize) -> Self {
        Self {
            ptr: out.as_mut_ptr(),
            width,
        }
    }

    /// Columns `cols` of `x·Wᵀ` (added to what they hold when `accumulate`: the bias), with
    /// `W` `[width, in]` row-major, on the calling thread: by [`dense::product`] when
    /// `direct` names an instruction set, else by gemm (half-type weights widened first).
    ///
    /// # Safety
    /// The buffer is alive and no other thread reads or writes these columns meanwhile;
    /// `direct` names an instruction set the CPU has.
    #[allow(clippy::too_many_arguments)]
    unsafe fn product(
        self,
        xs: &[f32],
        t: usize,
        d_in: usize,
        w: Rows<'_>,
        cols: std::ops::Range<usize>,
        accumulate: bool,
        direct: Option<Isa>,
    ) {
        let span = cols.start * d_in..cols.end * d_in;
        match w {
            Rows::Quant(w, f, q8) => {
                let row = f.row_bytes(d_in);
                let w = &w[cols.start * row..cols.end * row];
                // SAFETY: `isa` is the CPU's; the caller owns these columns of the live buffer.
                quant::product(
                    quant::isa(),
                    f,
                    q8,
                    w,
                    cols,
                    self.ptr,
                    self.width,
                    accumulate,
                );
            }
            Rows::F32(w) => self.product_of(xs, t, d_in, &w[span], cols, accumulate, direct),
            Rows::Bf16(w) => self.product_of(xs, t, d_in, &w[span], cols, accumulate, direct),
            Rows::F16(w) => self.product_of(xs, t, d_in, &w[span], cols, accumulate, direct),
        }
    }

    /// [`product`](Self::product) of the block's own rows `w`.
    ///
    /// # Safety
    /// As [`product`](Self::product).
    #[allow(clippy::too_many_arguments)]
    unsafe fn product_of<W: Weight>(
        self,
        xs: &[f32],
        t: usize,
        d_in: usize,
        w: &[W],
        cols: std::ops::Range<usize>,
        accumulate: bool,
        direct: Option<Isa>,
    ) {
        #[cfg(target_arch = "x86_64")]
        if let Some(isa) = direct {
            dense::product(
                isa,
                xs,
                t,
                d_in,
                w,
                self.ptr.add(cols.start),
                self.width,
                accumulate,
            );
            return;
        }
        let _ = direct; // Other architectures: gemm only.
        let wide: Vec<f32>;
        let w: &[f32] = match W::as_f32(w) {
            Some(w) => w,
            None => {
                wide = w.iter().map(|v| v.f32()).collect();
                &wide
            }
        };
        // Columns `cols` of the output are the block's rows; its window starts at cols.start.
        mole_kernels::gemm_by_rows(
            t,
            cols.len(),
            d_in,
            self.ptr.add(cols.start),
            self.width,
            accumulate,
            xs,
            w,
        );
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};
    use candle_nn::Linear;

    /// The blocked product equals candle's matmul: widths that are not a multiple of the
    /// block, with and without bias, one token and several, two projections in one call.
    #[test]
    fn blocked_products_match_the_matmul() {
        let dev = Device::Cpu;
        let r = |s: (usize, usize)| Tensor::randn(0f32, 1.0, s, &dev).unwrap();
        let d_in = 72;
        let wide = Lin::Dense(Linear::new(
            r((2 * COLUMNS_PER_BLOCK + 44, d_in)),
            Some(r((1, 2 * COLUMNS_PER_BLOCK + 44)).squeeze(0).unwrap()),
        ));
        let narrow = Lin::Dense(Linear::new(r((40, d_in)), None));
        for t in [1, 3, 17] {
            let x = r((t, d_in));
            let got = host_projections(
                &x,
                vec![(&wide, HostUpdates::none()), (&narrow, HostUpdates::none())],
            )
            .unwrap()
            .expect("a CPU f32 batch of few tokens qualifies");
            for (lin, y) in [&wide, &narrow].into_iter().zip(got) {
                let want = lin.forward(&x).unwrap();
                let err = crate::max_abs_diff(&y, &want);
                // Sums of 72 products of unit normals: f32 rounding in another order is
                // ~1e-6 of the result; a wrong column or a missing bias is ~1.
                assert!(err < 1e-4, "t={t}: max error {err}");
            }
        }
        for t in [0, HOST_LORA_MAX_TOKENS + 1] {
            let x = Tensor::zeros((t, d_in), candle_core::DType::F32, &dev).unwrap();
            let got = host_projections(&x, vec![(&narrow, HostUpdates::none())]).unwrap();
            assert!(got.is_none(), "{t} tokens take the tensor path");
        }
    }

    /// Every kernel of a column block (the direct ones the CPU has, and gemm), over f32,
    /// bf16 and f16 weights, equals the plain formula: widths that leave rows past the four-row blocks, inputs with a
    /// partial sixteen-value step, every token count of a kernel call and more, onto zeros
    /// and accumulated onto what the output held.
    #[test]
    fn column_blocks_match_the_formula() {
        let val = |i: usize| ((i * 7919 % 101) as f32 - 50.0) / 37.0;
        let mut kernels = vec![None, dense::available()];
        #[cfg(target_arch = "x86_64")]
        if kernels[1] == Some(Isa::Avx512) && mole_kernels::cpu::caps().avx2_fma() {
            kernels.push(Some(Isa::Avx2));
        }
        kernels.dedup();
        eprintln!("kernels checked: {kernels:?} (None: gemm)");
        let shapes = [(72, 19), (16, 8), (5, 6), (13, 10), (40, 1)];
        let held = [DType::F32, DType::BF16, DType::F16];
        for ((d_in, width), held) in shapes.into_iter().flat_map(|s| held.map(|h| (s, h))) {
            // Half-type weights: the formula takes the values they hold, widened exactly.
            let exact: Vec<f32> = (0..width * d_in).map(|i| val(i + 3)).collect();
            let bf: Vec<half::bf16> = exact.iter().map(|&v| half::bf16::from_f32(v)).collect();
            let hf: Vec<half::f16> = exact.iter().map(|&v| half::f16::from_f32(v)).collect();
            let (w, rows): (Vec<f32>, Rows<'_>) = match held {
                DType::BF16 => (bf.iter().map(|v| v.to_f32()).collect(), Rows::Bf16(&bf)),
                DType::F16 => (hf.iter().map(|v| v.to_f32()).collect(), Rows::F16(&hf)),
                _ => (exact.clone(), Rows::F32(&exact)),
            };
            for t in [1, 2, 3, 4, 5, 9, 17] {
                let xs: Vec<f32> = (0..t * d_in).map(|i| val(i + 17)).collect();
                for accumulate in [false, true] {
                    let want: Vec<f64> = (0..t * width)
                        .map(|e| {
                            let (i, j) = (e / width, e % width);
                            let dot: f64 = (0..d_in)
                                .map(|k| xs[i * d_in + k] as f64 * w[j * d_in + k] as f64)
                                .sum();
                            dot + if accumulate { val(e) as f64 } else { 0.0 }
                        })
                        .collect();
                    for &direct in &kernels {
                        let run = |rows: Rows<'_>| {
                            let mut out: Vec<f32> = (0..t * width).map(val).collect();
                            let cols = Columns::new(&mut out, width);
                            // Two blocks, split off the four-row grid.
                            let mid = width / 2 + 1;
                            for range in [0..mid.min(width), mid.min(width)..width] {
                                // SAFETY: `out` lives, this thread alone writes it; `direct`
                                // only where available.
                                unsafe {
                                    cols.product(&xs, t, d_in, rows, range, accumulate, direct)
                                };
                            }
                            out
                        };
                        let out = run(rows);
                        // Half-type rows, widened on each pass or once per block, give the
                        // sums the same kernel gives over the widened values, bit for bit.
                        assert_eq!(
                            out,
                            run(Rows::F32(&w)),
                            "direct {direct:?}, in {d_in}, width {width}, t {t}, {held:?}"
                        );
                        for (g, want) in out.iter().zip(&want) {
                            // Sums of at most 72 products of values under 1.4: f32 rounding
                            // in any order stays under 1e-4; a wrong row, token or a
                            // dropped tail is ~1.
                            assert!(
                                (*g as f64 - want).abs() < 1e-4,
                                "direct {direct:?}, in {d_in}, width {width}, t {t}, \
                                 accumulate {accumulate}, {held:?}: {g} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }
}
