//! The base product of a host step's few tokens, `x·Wᵀ`, read straight from the weights'
//! row-major `[out, in]` layout, with AVX-512 or AVX2. Weights are f32, bf16 or f16; the
//! half types are widened to f32 in registers as they are loaded (exact), so such a model
//! reads half the bytes per step and sums in f32 as an f32 one does.
//!
//! Why not gemm: an outer-product kernel needs `W` in `k`-major panels, so gemm copies
//! (packs) every weight block before it multiplies it. At decode sizes each block is used
//! for a handful of tokens only, and the packing was half of gemm's time. Here each output
//! is a dot product of a weight row with a token's input, both contiguous in `k`: four rows
//! times up to four tokens (two with AVX2's sixteen registers) in accumulators, the rows
//! streamed from memory once and reused from L1 for the batch's other tokens (half-type rows
//! widened to f32 once per block for them). One core of the 2-CPU dev VM, SmolLM2's
//! projections (540 MB, cold), 128-column blocks, AVX-512: 16 tokens 57 → 100 GFLOP/s, 4
//! tokens 21 → 58, 1 token 29 → 37 GB/s.

use super::cpu::Isa;
use super::Weight;

/// The instruction set the kernel runs with on this CPU, AVX-512 or AVX2; None where it has
/// neither (gemm then).
pub fn available() -> Option<Isa> {
    let c = super::cpu::caps();
    if c.avx512f {
        return Some(Isa::Avx512);
    }
    // F16C for f16 weights: every AVX2 CPU has it.
    c.avx2_fma_f16c().then_some(Isa::Avx2)
}

#[cfg(target_arch = "x86_64")]
impl Isa {
    /// Tokens per kernel call with four rows.
    fn tokens(self) -> usize {
        match self {
            Isa::Avx512 => Avx512::TOKENS,
            Isa::Avx2 => Avx2::TOKENS,
            Isa::Scalar | Isa::AvxVnni => unreachable!("{NOT_DENSE}"),
        }
    }
}

/// Why [`product`] is never given the other instruction sets: [`available`] picks its own two.
#[cfg(target_arch = "x86_64")]
const NOT_DENSE: &str = "the dense kernel has AVX-512 and AVX2 builds only (see available)";

/// Weight rows per kernel call.
const ROWS: usize = 4;
/// Tokens per kernel call at most, of any instruction set (see [`Simd::TOKENS`]).
const TOKENS: usize = 4;

/// `dst[i, j] = x[i] · w[j]` (added to what `dst` holds when `accumulate`) for the `t` tokens
/// of `xs` `[t, d_in]` and every row of `w` `[rows, d_in]`, with `dst` row `i` at
/// `dst + i·stride`.
///
/// # Safety
/// The CPU has `isa` (see [`available`]); `xs` holds `t · d_in` values and `w` a multiple
/// of `d_in`; `dst` is valid for reads and writes of `t` rows of `w.len() / d_in` values at
/// `stride` apart, which no other thread touches meanwhile.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn product<W: Weight>(
    isa: Isa,
    xs: &[f32],
    t: usize,
    d_in: usize,
    w: &[W],
    dst: *mut f32,
    stride: usize,
    accumulate: bool,
) {
    assert!(d_in > 0 && xs.len() >= t * d_in && w.len().is_multiple_of(d_in));
    let rows = w.len() / d_in;
    let tokens = isa.tokens();
    // Half-type rows that pass through the kernel more than once (more tokens than one call
    // takes) are widened once per block into f32, and the passes read that: widening on every
    // pass cost issue slots beside the FMAs, which bound a batch of 16 on AVX2 (where bf16
    // weights ran no faster than f32 ones). The kernel sees the same values either way, so
    // the sums are the same.
    let widen = W::as_f32(w).is_none() && t > tokens;
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
        let out = dst.add(c);
        if widen {
            WIDE.with_borrow_mut(|wide| {
                wide.clear();
                wide.reserve(rn * d_in);
                match isa {
                    Isa::Avx512 => Avx512::widen(block, wide.as_mut_ptr(), rn * d_in, next),
                    Isa::Avx2 => Avx2::widen(block, wide.as_mut_ptr(), rn * d_in, next),
                    Isa::Scalar | Isa::AvxVnni => unreachable!("{NOT_DENSE}"),
                }
                // SAFETY: `widen` wrote every value of the reserved length.
                wide.set_len(rn * d_in);
                let p = wide.as_ptr();
                passes(
                    isa,
                    rn,
                    p,
                    std::ptr::null(),
                    xs,
                    t,
                    d_in,
                    out,
                    stride,
                    accumulate,
                );
            });
        } else {
            passes(isa, rn, block, next, xs, t, d_in, out, stride, accumulate);
        }
        c += rn;
    }
}

thread_local! {
    #[cfg(target_arch = "x86_64")]
    /// A block's rows widened to f32 (see [`product`]): at most four rows of the input size.
    static WIDE: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The kernel calls over `rn` rows at `block` for every token, `tokens` at a time, with `pf`
/// (the next block, or null) prefetched during the first; sums go to `dst + i·stride + r`.
///
/// # Safety
/// As [`product`], for these rows.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn passes<W: Weight>(
    isa: Isa,
    rn: usize,
    block: *const W,
    pf: *const W,
    xs: &[f32],
    t: usize,
    d_in: usize,
    dst: *mut f32,
    stride: usize,
    accumulate: bool,
) {
    let tokens = isa.tokens();
    for t0 in (0..t).step_by(tokens) {
        let tn = (t - t0).min(tokens);
        let x = xs.as_ptr().add(t0 * d_in);
        let pf = if t0 == 0 { pf } else { std::ptr::null() };
        let sums = match isa {
            Isa::Avx512 => sums::<Avx512, W>(rn, tn, block, x, d_in, pf),
            Isa::Avx2 => sums::<Avx2, W>(rn, tn, block, x, d_in, pf),
            Isa::Scalar | Isa::AvxVnni => unreachable!("{NOT_DENSE}"),
        };
        for (r, row) in sums.iter().enumerate().take(rn) {
            for (i, s) in row.iter().enumerate().take(tn) {
                let d = dst.add((t0 + i) * stride + r);
                *d = if accumulate { *d + s } else { *s };
            }
        }
    }
}

/// The kernel call for `rn` rows (four or one) and `tn` tokens (at most `S::TOKENS`), its
/// sums in the largest shape.
///
/// # Safety
/// As [`Simd::dots`].
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn sums<S: Simd, W: Weight>(
    rn: usize,
    tn: usize,
    w: *const W,
    x: *const f32,
    d_in: usize,
    pf: *const W,
) -> [[f32; TOKENS]; ROWS] {
    match (rn == ROWS, tn) {
        (true, 1) => pad(S::dots::<W, ROWS, 1>(w, x, d_in, pf)),
        (true, 2) => pad(S::dots::<W, ROWS, 2>(w, x, d_in, pf)),
        (true, 3) => pad(S::dots::<W, ROWS, 3>(w, x, d_in, pf)),
        (true, _) => pad(S::dots::<W, ROWS, TOKENS>(w, x, d_in, pf)),
        (false, 1) => pad(S::dots::<W, 1, 1>(w, x, d_in, pf)),
        (false, 2) => pad(S::dots::<W, 1, 2>(w, x, d_in, pf)),
        (false, 3) => pad(S::dots::<W, 1, 3>(w, x, d_in, pf)),
        (false, _) => pad(S::dots::<W, 1, TOKENS>(w, x, d_in, pf)),
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

/// One instruction set's vector operations, and the kernel built from them (compiled once
/// per set, with that set enabled).
#[cfg(target_arch = "x86_64")]
trait Simd {
    /// A register of lanes.
    type V: Copy;
    /// f32 lanes per register.
    const LANES: usize;
    /// Tokens per call with four rows: the accumulators, rows and input fit the registers.
    const TOKENS: usize;
    unsafe fn zero() -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    /// `LANES` weights from `p`, as f32.
    unsafe fn load_w<W: Weight>(p: *const W) -> Self::V;
    /// The first `n < LANES` values at `p`, zeros after (nothing past them is read).
    unsafe fn load_part(p: *const f32, n: usize) -> Self::V;
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    unsafe fn sum(v: Self::V) -> f32;
    unsafe fn store(p: *mut f32, v: Self::V);

    /// `n` values at `src` widened to f32 at `dst` (capacity for `n`), prefetching as many
    /// at `pf` (null: none) on the way.
    ///
    /// # Safety
    /// The CPU has the set; `src` and `dst` hold `n` values, `pf` null or `n` readable ones.
    unsafe fn widen<W: Weight>(src: *const W, dst: *mut f32, n: usize, pf: *const W);

    /// The `R × T` dot products of rows `w + r·d_in` with tokens `x + i·d_in`.
    ///
    /// # Safety
    /// The CPU has the set, and the rows and tokens hold `d_in` readable values each.
    unsafe fn dots<W: Weight, const R: usize, const T: usize>(
        w: *const W,
        x: *const f32,
        d_in: usize,
        pf: *const W,
    ) -> [[f32; T]; R];
}

/// The kernel of [`Simd::dots`]: `LANES` values of `k` per step in `R·T` accumulators, the
/// last partial step loaded in part. With `pf` non-null, also prefetches the `R` rows at
/// `pf` (same stride), a line per row per 64 bytes of `k`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::needless_range_loop)]
unsafe fn dots_impl<S: Simd, W: Weight, const R: usize, const T: usize>(
    w: *const W,
    x: *const f32,
    d_in: usize,
    pf: *const W,
) -> [[f32; T]; R] {
    use std::arch::x86_64::*;
    let mut acc = [[S::zero(); T]; R];
    let full = d_in / S::LANES * S::LANES;
    let mut k = 0;
    while k < full {
        if !pf.is_null() && (k * size_of::<W>()).is_multiple_of(64) {
            for r in 0..R {
                _mm_prefetch::<_MM_HINT_T0>(pf.wrapping_add(r * d_in + k).cast());
            }
        }
        let wv: [S::V; R] = std::array::from_fn(|r| S::load_w(w.add(r * d_in + k)));
        for i in 0..T {
            let xv = S::load(x.add(i * d_in + k));
            for r in 0..R {
                acc[r][i] = S::fma(wv[r], xv, acc[r][i]);
            }
        }
        k += S::LANES;
    }
    if k < d_in {
        let n = d_in - k;
        // The tail widened on the stack: one partial step per row, where a masked load of
        // 16-bit values would need AVX-512BW.
        let wv: [S::V; R] = std::array::from_fn(|r| {
            let mut wide = [0f32; 16];
            for (j, v) in wide.iter_mut().take(n).enumerate() {
                *v = (*w.add(r * d_in + k + j)).f32();
            }
            S::load(wide.as_ptr())
        });
        for i in 0..T {
            let xv = S::load_part(x.add(i * d_in + k), n);
            for r in 0..R {
                acc[r][i] = S::fma(wv[r], xv, acc[r][i]);
            }
        }
    }
    let mut out = [[0f32; T]; R];
    for (o, a) in out.iter_mut().zip(&acc) {
        for (o, a) in o.iter_mut().zip(a) {
            *o = S::sum(*a);
        }
    }
    out
}

/// The body of [`Simd::widen`].
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn widen_impl<S: Simd, W: Weight>(src: *const W, dst: *mut f32, n: usize, pf: *const W) {
    use std::arch::x86_64::*;
    let full = n / S::LANES * S::LANES;
    let mut k = 0;
    while k < full {
        if !pf.is_null() && (k * size_of::<W>()).is_multiple_of(64) {
            _mm_prefetch::<_MM_HINT_T0>(pf.wrapping_add(k).cast());
        }
        S::store(dst.add(k), S::load_w(src.add(k)));
        k += S::LANES;
    }
    for j in k..n {
        *dst.add(j) = (*src.add(j)).f32();
    }
}

#[cfg(target_arch = "x86_64")]
struct Avx512;

#[cfg(target_arch = "x86_64")]
impl Simd for Avx512 {
    type V = std::arch::x86_64::__m512;
    const LANES: usize = 16;
    const TOKENS: usize = 4;
    #[inline(always)]
    unsafe fn zero() -> Self::V {
        std::arch::x86_64::_mm512_setzero_ps()
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self::V {
        std::arch::x86_64::_mm512_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn load_part(p: *const f32, n: usize) -> Self::V {
        std::arch::x86_64::_mm512_maskz_loadu_ps(((1u32 << n) - 1) as u16, p)
    }
    #[inline(always)]
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V {
        std::arch::x86_64::_mm512_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn sum(v: Self::V) -> f32 {
        std::arch::x86_64::_mm512_reduce_add_ps(v)
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: Self::V) {
        std::arch::x86_64::_mm512_storeu_ps(p, v)
    }
    #[target_feature(enable = "avx512f")]
    unsafe fn widen<W: Weight>(src: *const W, dst: *mut f32, n: usize, pf: *const W) {
        widen_impl::<Self, W>(src, dst, n, pf)
    }
    #[inline(always)]
    unsafe fn load_w<W: Weight>(p: *const W) -> Self::V {
        W::load16(p)
    }
    #[target_feature(enable = "avx512f")]
    unsafe fn dots<W: Weight, const R: usize, const T: usize>(
        w: *const W,
        x: *const f32,
        d_in: usize,
        pf: *const W,
    ) -> [[f32; T]; R] {
        dots_impl::<Self, W, R, T>(w, x, d_in, pf)
    }
}

#[cfg(target_arch = "x86_64")]
struct Avx2;

#[cfg(target_arch = "x86_64")]
impl Simd for Avx2 {
    type V = std::arch::x86_64::__m256;
    const LANES: usize = 8;
    const TOKENS: usize = 2;
    #[inline(always)]
    unsafe fn zero() -> Self::V {
        std::arch::x86_64::_mm256_setzero_ps()
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self::V {
        std::arch::x86_64::_mm256_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn load_part(p: *const f32, n: usize) -> Self::V {
        use std::arch::x86_64::*;
        let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), lanes))
    }
    #[inline(always)]
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V {
        std::arch::x86_64::_mm256_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn sum(v: Self::V) -> f32 {
        use std::arch::x86_64::*;
        let q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let d = _mm_add_ps(q, _mm_movehl_ps(q, q));
        _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)))
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: Self::V) {
        std::arch::x86_64::_mm256_storeu_ps(p, v)
    }
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn widen<W: Weight>(src: *const W, dst: *mut f32, n: usize, pf: *const W) {
        widen_impl::<Self, W>(src, dst, n, pf)
    }
    #[inline(always)]
    unsafe fn load_w<W: Weight>(p: *const W) -> Self::V {
        W::load8(p)
    }
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dots<W: Weight, const R: usize, const T: usize>(
        w: *const W,
        x: *const f32,
        d_in: usize,
        pf: *const W,
    ) -> [[f32; T]; R] {
        dots_impl::<Self, W, R, T>(w, x, d_in, pf)
    }
}
