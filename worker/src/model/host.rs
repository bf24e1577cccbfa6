//! Host kernels for CPU f32 decoding: a token's attention over its sequence's cache and a
//! token's low-rank adapter update, read in place from tensor storage.
//!
//! At decode batch sizes the arithmetic of these steps is small and what costs is the fixed
//! price of each tensor op (an allocation, a thread-pool round trip) times rows × layers ×
//! ops; one fused pass per batch removes it. The loops are written so the compiler vectorises
//! them, and compiled twice: for the baseline target and, picked at run time, for AVX2 + FMA
//! (release builds do not assume a CPU newer than x86-64 v1).

use candle_core::{DType, Tensor};

use crate::merge::tensors::madd;

/// `pub(crate) fn $name(args)`: calls `$body::<true>` compiled for AVX2 + FMA when the CPU has
/// them (checked at run time), else `$body::<false>` for the baseline target.
macro_rules! kernel {
    ($(#[$doc:meta])* $name:ident = $body:ident($($arg:ident: $ty:ty),* $(,)?)) => {
        $(#[$doc])*
        #[allow(clippy::too_many_arguments)]
        pub(crate) fn $name($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn fast($($arg: $ty),*) {
                    $body::<true>($($arg),*)
                }
                if avx2_fma() {
                    // SAFETY: the CPU has AVX2 and FMA (checked at run time).
                    return unsafe { fast($($arg),*) };
                }
            }
            $body::<false>($($arg),*)
        }
    };
}

/// Multiply-adds below which the attention of a batch runs on the calling thread: splitting
/// a short decode step's few small products costs more than it saves.
pub(crate) const PARALLEL_MIN_FMAS: usize = 1 << 21;

/// A contiguous CPU f32 tensor's storage, held for reading in place.
pub(crate) struct HostF32<'t> {
    guard: candle_core::StorageRef<'t>,
    offset: usize,
}

impl<'t> HostF32<'t> {
    /// The storage of `t`, or None unless it is contiguous f32 on the CPU.
    pub(crate) fn of(t: &'t Tensor) -> Option<Self> {
        use candle_core::{CpuStorage, Storage};
        if !t.is_contiguous() || t.dtype() != DType::F32 {
            return None;
        }
        let (guard, layout) = t.storage_and_layout();
        let offset = layout.start_offset();
        matches!(&*guard, Storage::Cpu(CpuStorage::F32(_))).then_some(Self { guard, offset })
    }

    /// The first `n` elements of the tensor.
    pub(crate) fn slice(&self, n: usize) -> &[f32] {
        use candle_core::{CpuStorage, Storage};
        match &*self.guard {
            Storage::Cpu(CpuStorage::F32(v)) => &v[self.offset..self.offset + n],
            _ => unreachable!("checked by HostF32::of"),
        }
    }
}

/// Dot product with eight partial sums, so the loop vectorises (float addition is not
/// reassociated by the compiler).
#[inline(always)]
fn dot<const FMA: bool>(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] = madd::<FMA>(x[l], y[l], acc[l]);
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Where one head's keys and values lie in a token-major cache `[len, kv_heads, dim]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KvHead {
    /// Floats per cached token (kv_heads × dim).
    pub stride: usize,
    /// This head's first float within a token.
    pub offset: usize,
    /// Score scale, 1/√dim.
    pub scale: f32,
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn attend_impl<const FMA: bool>(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    seen: usize,
    h: KvHead,
    out: &mut [f32],
    scores: &mut Vec<f32>,
) {
    let dim = q.len();
    scores.resize(seen, 0.0);
    let mut max = f32::NEG_INFINITY;
    for (j, s) in scores.iter_mut().enumerate() {
        let k = &keys[j * h.stride + h.offset..][..dim];
        *s = dot::<FMA>(q, k) * h.scale;
        max = max.max(*s);
    }
    let mut sum = 0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    out.fill(0.0);
    for (j, s) in scores.iter().enumerate() {
        let p = s / sum;
        let v = &values[j * h.stride + h.offset..][..dim];
        for (o, x) in out.iter_mut().zip(v) {
            *o = madd::<FMA>(p, *x, *o);
        }
    }
}

kernel! {
    /// One query head's attention for one token: `q` `[dim]`, `keys`/`values` its sequence's
    /// cache token-major `[len, kv_heads, dim]`, of which the first `seen` positions are
    /// visible (causal: the token's own position + 1); writes `[dim]` into `out`. Softmax in
    /// f32 with the maximum subtracted, as torch computes it. `scores` is scratch space.
    attend_head = attend_impl(
        q: &[f32],
        keys: &[f32],
        values: &[f32],
        seen: usize,
        h: KvHead,
        out: &mut [f32],
        scores: &mut Vec<f32>,
    )
}

#[inline(always)]
fn lora_impl<const FMA: bool>(
    xs: &[f32],
    a: &[f32],
    b: &[f32],
    r: usize,
    outs: &mut [(usize, &mut [f32])],
) {
    let d_in = a.len() / r;
    let mut h = vec![0f32; outs.len() * r];
    for (k, arow) in a.chunks_exact(d_in).enumerate() {
        for ((tok, _), ht) in outs.iter().zip(h.chunks_exact_mut(r)) {
            ht[k] = dot::<FMA>(&xs[tok * d_in..(tok + 1) * d_in], arow);
        }
    }
    // Column blocks of the output: a token's block of sums stays in registers over the r
    // rows of B (loaded and stored once, not once per rank), and the block's slice of B stays
    // in L1 for the next token.
    let d_out = b.len() / r;
    let full = d_out / COLS * COLS;
    for c in (0..full).step_by(COLS) {
        for ((_, out), ht) in outs.iter_mut().zip(h.chunks_exact(r)) {
            let o: &mut [f32; COLS] = (&mut out[c..c + COLS]).try_into().expect("COLS values");
            let mut acc = *o;
            for (k, hk) in ht.iter().enumerate() {
                let bk: &[f32; COLS] = b[k * d_out + c..][..COLS].try_into().expect("COLS values");
                for (x, y) in acc.iter_mut().zip(bk) {
                    *x = madd::<FMA>(*hk, *y, *x);
                }
            }
            *o = acc;
        }
    }
    for ((_, out), ht) in outs.iter_mut().zip(h.chunks_exact(r)) {
        for (k, hk) in ht.iter().enumerate() {
            for (o, y) in out[full..]
                .iter_mut()
                .zip(&b[k * d_out + full..(k + 1) * d_out])
            {
                *o = madd::<FMA>(*hk, *y, *o);
            }
        }
    }
}

/// Output columns per register block of [`lora_tokens`] (8 AVX2 registers).
const COLS: usize = 64;

kernel! {
    /// Adds one adapter's low-rank update to some tokens' output rows: `out += (x·Aᵀ)·(s·B)ᵀ`
    /// with `A` `[r, in]` and `(s·B)ᵀ` `[r, out]` row-major, `xs` the batch's inputs
    /// `[tokens, in]` and `outs` (token, its output row). The tokens share each weight row
    /// while it is in cache, so a few tokens per call cost little more than one.
    lora_tokens = lora_impl(
        xs: &[f32],
        a: &[f32],
        b: &[f32],
        r: usize,
        outs: &mut [(usize, &mut [f32])],
    )
}

#[cfg(target_arch = "x86_64")]
fn avx2_fma() -> bool {
    // The macro caches the CPUID answer.
    std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernels equal the plain formulas (both builds: the test machine picks one, the
    /// baseline is called directly).
    #[test]
    fn kernels_match_the_formulas() {
        let (nq, nkv, dim, len, seen) = (4, 2, 12, 5, 4);
        let scale = 1.0 / (dim as f32).sqrt();
        let val = |i: usize| ((i * 7919 % 101) as f32 - 50.0) / 37.0;
        let q: Vec<f32> = (0..nq * dim).map(val).collect();
        let keys: Vec<f32> = (0..len * nkv * dim).map(|i| val(i + 3)).collect();
        let values: Vec<f32> = (0..len * nkv * dim).map(|i| val(i + 11)).collect();
        let mut scores = Vec::new();
        for head in 0..nq {
            let g = head / (nq / nkv);
            let s: Vec<f64> = (0..seen)
                .map(|j| {
                    (0..dim)
                        .map(|d| q[head * dim + d] as f64 * keys[(j * nkv + g) * dim + d] as f64)
                        .sum::<f64>()
                        * scale as f64
                })
                .collect();
            let m = s.iter().cloned().fold(f64::MIN, f64::max);
            let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
            let want: Vec<f32> = (0..dim)
                .map(|d| {
                    (0..seen)
                        .map(|j| (s[j] - m).exp() / z * values[(j * nkv + g) * dim + d] as f64)
                        .sum::<f64>() as f32
                })
                .collect();
            let kv = KvHead {
                stride: nkv * dim,
                offset: g * dim,
                scale,
            };
            let qh = &q[head * dim..(head + 1) * dim];
            for run in [attend_head, attend_impl::<false>] {
                let mut out = vec![9f32; dim];
                run(qh, &keys, &values, seen, kv, &mut out, &mut scores);
                for (a, b) in out.iter().zip(&want) {
                    assert!((a - b).abs() < 1e-5, "{a} vs {b}");
                }
            }
        }

        let (din, r, dout) = (10, 3, 70);
        let x: Vec<f32> = (0..din).map(val).collect();
        let a: Vec<f32> = (0..din * r).map(|i| val(i + 5)).collect();
        let b: Vec<f32> = (0..r * dout).map(|i| val(i + 13)).collect();
        let base: Vec<f32> = (0..dout).map(|i| val(i + 17)).collect();
        let hid: Vec<f64> = (0..r)
            .map(|k| (0..din).map(|j| x[j] as f64 * a[k * din + j] as f64).sum())
            .collect();
        let want: Vec<f64> = (0..dout)
            .map(|o| base[o] as f64 + (0..r).map(|k| hid[k] * b[k * dout + o] as f64).sum::<f64>())
            .collect();
        // Token 1 of a batch of two; token 0 is another adapter's.
        let xs: Vec<f32> = (0..din)
            .map(|i| val(i + 40))
            .chain(x.iter().copied())
            .collect();
        for run in [lora_tokens, lora_impl::<false>] {
            let mut out = base.clone();
            run(&xs, &a, &b, r, &mut [(1, &mut out[..])]);
            for (a, b) in out.iter().zip(&want) {
                assert!((*a as f64 - b).abs() < 1e-5, "{a} vs {b}");
            }
        }
    }
}
