//! The base product of a host step's few tokens, `x·Wᵀ`, read straight from the weights'
//! row-major `[out, in]` layout with AVX-512.
//!
//! Why not gemm: an outer-product kernel needs `W` in `k`-major panels, so gemm copies
//! (packs) every weight block before it multiplies it. At decode sizes each block is used
//! for a handful of tokens only, and the packing was half of gemm's time. Here each output
//! is a dot product of a weight row with a token's input, both contiguous in `k`: four rows
//! times up to four tokens in sixteen registers, the rows streamed from memory once and
//! reused from L1 for the batch's other tokens. One core of the 2-CPU dev VM, SmolLM2's
//! projections (540 MB, cold), 128-column blocks: 16 tokens 57 → 100 GFLOP/s, 4 tokens
//! 21 → 58, 1 token 29 → 37 GB/s.

/// Whether the CPU has the AVX-512 this kernel needs (the macro caches the CPUID answer).
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Weight rows per kernel call.
const ROWS: usize = 4;
/// Tokens per kernel call.
const TOKENS: usize = 4;

/// `dst[i, j] = x[i] · w[j]` (added to what `dst` holds when `accumulate`) for the `t` tokens
/// of `xs` `[t, d_in]` and every row of `w` `[rows, d_in]`, with `dst` row `i` at
/// `dst + i·stride`.
///
/// # Safety
/// [`available`] is true; `xs` holds `t · d_in` values and `w` a multiple of `d_in`; `dst`
/// is valid for reads and writes of `t` rows of `w.len() / d_in` values at `stride` apart,
/// which no other thread touches meanwhile.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn product(
    xs: &[f32],
    t: usize,
    d_in: usize,
    w: &[f32],
    dst: *mut f32,
    stride: usize,
    accumulate: bool,
) {
    assert!(d_in > 0 && xs.len() >= t * d_in && w.len().is_multiple_of(d_in));
    let rows = w.len() / d_in;
    let mut c = 0;
    while c < rows {
        let rn = if rows - c >= ROWS { ROWS } else { 1 };
        let block = w.as_ptr().add(c * d_in);
        // The next block's rows, fetched into L1 while this one's first tokens run: the
        // hardware prefetcher alone leaves the first pass over each block waiting on memory.
        let next = if c + rn + ROWS <= rows {
            block.add(rn * d_in)
        } else {
            std::ptr::null()
        };
        for t0 in (0..t).step_by(TOKENS) {
            let tn = (t - t0).min(TOKENS);
            let x = xs.as_ptr().add(t0 * d_in);
            let pf = if t0 == 0 { next } else { std::ptr::null() };
            let sums = match (rn, tn) {
                (ROWS, 1) => pad(dots::<ROWS, 1>(block, x, d_in, pf)),
                (ROWS, 2) => pad(dots::<ROWS, 2>(block, x, d_in, pf)),
                (ROWS, 3) => pad(dots::<ROWS, 3>(block, x, d_in, pf)),
                (ROWS, _) => pad(dots::<ROWS, TOKENS>(block, x, d_in, pf)),
                (_, 1) => pad(dots::<1, 1>(block, x, d_in, pf)),
                (_, 2) => pad(dots::<1, 2>(block, x, d_in, pf)),
                (_, 3) => pad(dots::<1, 3>(block, x, d_in, pf)),
                (_, _) => pad(dots::<1, TOKENS>(block, x, d_in, pf)),
            };
            for (r, row) in sums.iter().enumerate().take(rn) {
                for (i, s) in row.iter().enumerate().take(tn) {
                    let d = dst.add((t0 + i) * stride + c + r);
                    *d = if accumulate { *d + s } else { *s };
                }
            }
        }
        c += rn;
    }
}

/// A kernel's sums in the largest shape, so one match arm type fits all.
#[inline(always)]
fn pad<const R: usize, const T: usize>(s: [[f32; T]; R]) -> [[f32; TOKENS]; ROWS] {
    let mut out = [[0f32; TOKENS]; ROWS];
    for (o, s) in out.iter_mut().zip(s) {
        o[..T].copy_from_slice(&s);
    }
    out
}

/// The `R × T` dot products of rows `w + r·d_in` with tokens `x + i·d_in`, sixteen `k` per
/// step in `R·T` accumulators; the last partial step loads under a mask. With `pf` non-null,
/// also prefetches the `R` rows at `pf` (same stride), one line per row per step.
///
/// # Safety
/// AVX-512F is present and the rows and tokens hold `d_in` readable values each.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::needless_range_loop)]
unsafe fn dots<const R: usize, const T: usize>(
    w: *const f32,
    x: *const f32,
    d_in: usize,
    pf: *const f32,
) -> [[f32; T]; R] {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    let full = d_in / 16 * 16;
    let mut k = 0;
    while k < full {
        if !pf.is_null() {
            for r in 0..R {
                _mm_prefetch::<_MM_HINT_T0>(pf.wrapping_add(r * d_in + k).cast());
            }
        }
        let wv: [__m512; R] = std::array::from_fn(|r| _mm512_loadu_ps(w.add(r * d_in + k)));
        for i in 0..T {
            let xv = _mm512_loadu_ps(x.add(i * d_in + k));
            for r in 0..R {
                acc[r][i] = _mm512_fmadd_ps(wv[r], xv, acc[r][i]);
            }
        }
        k += 16;
    }
    if k < d_in {
        let m: __mmask16 = ((1u32 << (d_in - k)) - 1) as u16;
        let wv: [__m512; R] =
            std::array::from_fn(|r| _mm512_maskz_loadu_ps(m, w.add(r * d_in + k)));
        for i in 0..T {
            let xv = _mm512_maskz_loadu_ps(m, x.add(i * d_in + k));
            for r in 0..R {
                acc[r][i] = _mm512_fmadd_ps(wv[r], xv, acc[r][i]);
            }
        }
    }
    let mut out = [[0f32; T]; R];
    for (o, a) in out.iter_mut().zip(&acc) {
        for (o, a) in o.iter_mut().zip(a) {
            *o = _mm512_reduce_add_ps(*a);
        }
    }
    out
}
