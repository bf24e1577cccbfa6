//! Products with GGML Q4_1 weights (GGUF q4_1 files, and AWQ/GPTQ checkpoints repacked into
//! Q4_1 blocks) on x86-64 with AVX2: candle 0.11's Q4_1 dot product is its generic scalar
//! loop on x86 (its AVX2 kernels cover q4_0, q8_0 and the k-quants), which made a Q4_1 base
//! 7-10x slower than its own bf16 import. This is llama.cpp's `ggml_vec_dot_q4_1_q8_1`
//! arithmetic: each activation row is rounded to 8 bits per block of 32 (scale `d = max|x| /
//! 127`, and `s = d·Σq`), then per block `d_w·d_x·Σ q_w·q_x + m_w·s_x` with the 4-bit × 8-bit
//! products summed exactly in integers (`maddubs`: at most 15·127·2 per 16-bit lane).
//! The activation scales are kept in f32 where ggml rounds them to f16: the result is at
//! least as close to the dequantized product as candle's.
//!
//! Layout of a weight row: `k / 32` blocks of 20 bytes, `d` and `m` (f16), then 16 bytes
//! whose low nibbles are the block's values 0..16 and high nibbles 16..32.

/// Values per block.
pub(crate) const BLOCK: usize = 32;
/// Bytes per Q4_1 block.
pub(crate) const BLOCK_BYTES: usize = 20;
/// Activation rows multiplied with a weight row while it is in L1 (llama.cpp's 16).
const ROW_TILE: usize = 16;

/// Off: Q4_1 weights take candle's product (`bench decode --gguf` times both, side by side).
static ENABLED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Turns these kernels on or off for the process (a benchmark's before/after).
pub(crate) fn set_enabled(on: bool) {
    ENABLED.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether the CPU runs these kernels (AVX2 and FMA) and they are on.
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        super::avx2_fma() && ENABLED.load(std::sync::atomic::Ordering::Relaxed)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Activation rows rounded to 8 bits per block of 32.
pub(crate) struct Q8Rows {
    /// Per block: its scale.
    d: Vec<f32>,
    /// Per block: its scale times the sum of its values.
    s: Vec<f32>,
    /// The values, `k` per row.
    qs: Vec<i8>,
    /// Values per row.
    k: usize,
}

impl Q8Rows {
    /// `t` rows of `k` values (`k` a multiple of 32) from `xs` row-major.
    pub(crate) fn of(xs: &[f32], t: usize, k: usize) -> Self {
        debug_assert!(k.is_multiple_of(BLOCK) && xs.len() >= t * k);
        let blocks = t * k / BLOCK;
        let mut d = Vec::with_capacity(blocks);
        let mut s = Vec::with_capacity(blocks);
        let mut qs = vec![0i8; t * k];
        for (x, q) in xs[..t * k]
            .chunks_exact(BLOCK)
            .zip(qs.chunks_exact_mut(BLOCK))
        {
            let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
            let scale = amax / 127.0;
            let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
            let mut sum = 0i32;
            for (q, v) in q.iter_mut().zip(x) {
                // |v·inv| ≤ 127: the cast cannot saturate.
                *q = (v * inv).round() as i8;
                sum += *q as i32;
            }
            d.push(scale);
            s.push(scale * sum as f32);
        }
        Self { d, s, qs, k }
    }

    /// Rows held.
    pub(crate) fn rows(&self) -> usize {
        self.qs.len() / self.k.max(1)
    }
}

/// `out[i·width + c]` (added to what it holds when `accumulate`) = row `i` of `x` · weight row
/// `c` for every row of `x` and every column `c` of `cols`, whose weight rows `w` holds
/// (`cols.len()` rows of `k / 32` blocks).
///
/// # Safety
/// The CPU has AVX2 and FMA ([`available`]); `out` is valid for writes of `x.rows()` rows of
/// `width` values, and no other thread touches these columns meanwhile.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn product(
    x: &Q8Rows,
    w: &[u8],
    cols: std::ops::Range<usize>,
    out: *mut f32,
    width: usize,
    accumulate: bool,
) {
    let row_bytes = x.k / BLOCK * BLOCK_BYTES;
    debug_assert!(w.len() >= cols.len() * row_bytes);
    // Tiles of activation rows (a prefill's are many): a tile's 8-bit rows stay in L1 while
    // the block's weight rows stream past it once per tile.
    let rows = x.rows();
    for lo in (0..rows).step_by(ROW_TILE) {
        for (j, c) in cols.clone().enumerate() {
            let wr = &w[j * row_bytes..(j + 1) * row_bytes];
            for i in lo..(lo + ROW_TILE).min(rows) {
                // SAFETY: the caller's guarantees.
                let v = unsafe { dot(wr, x, i) };
                // SAFETY: within the rows and columns the caller owns.
                unsafe {
                    let o = out.add(i * width + c);
                    *o = if accumulate { *o + v } else { v };
                }
            }
        }
    }
}

/// Weight row `w` · activation row `i`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot(w: &[u8], x: &Q8Rows, i: usize) -> f32 {
    use std::arch::x86_64::*;
    let nb = x.k / BLOCK;
    let (d, s) = (&x.d[i * nb..(i + 1) * nb], &x.s[i * nb..(i + 1) * nb]);
    let qs = &x.qs[i * x.k..(i + 1) * x.k];
    let mut acc = _mm256_setzero_ps();
    let mut mins = 0f32;
    let low = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    for b in 0..nb {
        let blk = &w[b * BLOCK_BYTES..(b + 1) * BLOCK_BYTES];
        let dw = half::f16::from_le_bytes([blk[0], blk[1]]).to_f32();
        let mw = half::f16::from_le_bytes([blk[2], blk[3]]).to_f32();
        // SAFETY: 16 bytes of nibbles at blk[4..20] and 32 values at qs[b·32..]: in bounds.
        let (nib, q8) = unsafe {
            (
                _mm_loadu_si128(blk.as_ptr().add(4) as *const __m128i),
                _mm256_loadu_si256(qs.as_ptr().add(b * BLOCK) as *const __m256i),
            )
        };
        // Values 0..16 from the low nibbles, 16..32 from the high ones.
        let q4 = _mm256_and_si256(
            low,
            _mm256_insertf128_si256::<1>(_mm256_castsi128_si256(nib), _mm_srli_epi16(nib, 4)),
        );
        let pairs = _mm256_maddubs_epi16(q4, q8);
        let sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(ones, pairs));
        acc = _mm256_fmadd_ps(sums, _mm256_set1_ps(dw * d[b]), acc);
        mins += mw * s[b];
    }
    let hi = _mm256_extractf128_ps::<1>(acc);
    let v = _mm_add_ps(hi, _mm256_castps256_ps128(acc));
    let v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    let v = _mm_add_ss(v, _mm_movehdup_ps(v));
    _mm_cvtss_f32(v) + mins
}

/// `x·Wᵀ` for `x` `[t, k]` row-major and `W` `n` rows of Q4_1 blocks: `[t, n]`, column blocks
/// spread over the thread pool. None where the CPU lacks AVX2 ([`available`]).
pub(crate) fn matmul(xs: &[f32], t: usize, k: usize, w: &[u8], n: usize) -> Option<Vec<f32>> {
    #[cfg(target_arch = "x86_64")]
    if available() {
        use rayon::prelude::*;
        let x = Q8Rows::of(xs, t, k);
        let mut out = vec![0f32; t * n];
        let ptr = Out(out.as_mut_ptr());
        let row_bytes = k / BLOCK * BLOCK_BYTES;
        // Enough blocks for every thread to take several, each long enough to cost little to
        // start.
        let per = 64usize;
        (0..n.div_ceil(per)).into_par_iter().for_each(|b| {
            let cols = b * per..((b + 1) * per).min(n);
            let ptr = &ptr;
            // SAFETY: AVX2 checked above; `out` holds t × n values and each block of columns
            // is written by one task only.
            unsafe {
                product(
                    &x,
                    &w[cols.start * row_bytes..cols.end * row_bytes],
                    cols,
                    ptr.0,
                    n,
                    false,
                )
            };
        });
        return Some(out);
    }
    let _ = (xs, t, k, w, n);
    None
}

/// The output of [`matmul`], shared by the tasks that write its disjoint column blocks.
struct Out(*mut f32);
// SAFETY: the tasks that share it write disjoint elements while the buffer lives.
unsafe impl Sync for Out {}
// SAFETY: as for Sync.
unsafe impl Send for Out {}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel against the formula over the dequantized weights and the 8-bit activations
    /// it multiplies (equal up to f32 summation order), and against the f32 activations within
    /// the 8-bit rounding's bound.
    #[test]
    fn q4_1_products_match_the_formula() {
        if !available() {
            eprintln!("no AVX2: kernel not checked");
            return;
        }
        let (k, n) = (96, 67);
        let val = |i: usize| ((i * 7919 % 101) as f32 - 50.0) / 37.0;
        let mut w = Vec::new();
        let mut deq = vec![0f32; n * k];
        for c in 0..n {
            for b in 0..k / BLOCK {
                let d = half::f16::from_f32(0.01 + (c + b) as f32 * 0.001);
                let m = half::f16::from_f32(-0.05 * ((c * 3 + b) % 7) as f32);
                w.extend(d.to_le_bytes());
                w.extend(m.to_le_bytes());
                let q = |j: usize| ((c * 31 + b * 17 + j * 5) % 16) as u8;
                for j in 0..16 {
                    w.push(q(j) | (q(j + 16) << 4));
                }
                for j in 0..BLOCK {
                    deq[c * k + b * BLOCK + j] = d.to_f32() * q(j) as f32 + m.to_f32();
                }
            }
        }
        // One row, a few, and more than a tile of rows.
        for t in [1, 5, 2 * ROW_TILE + 3] {
            let xs: Vec<f32> = (0..t * k).map(|i| val(i + 3)).collect();
            let got = matmul(&xs, t, k, &w, n).unwrap();
            let x8 = Q8Rows::of(&xs, t, k);
            for i in 0..t {
                for c in 0..n {
                    let (mut exact, mut f32_dot, mut scale, mut rounding) =
                        (0f64, 0f64, 0f64, 0f64);
                    for kk in 0..k {
                        let b = i * k / BLOCK + kk / BLOCK;
                        let xq = x8.d[b] as f64 * x8.qs[i * k + kk] as f64;
                        exact += xq * deq[c * k + kk] as f64;
                        f32_dot += xs[i * k + kk] as f64 * deq[c * k + kk] as f64;
                        scale += (xq * deq[c * k + kk] as f64).abs();
                        rounding += x8.d[b] as f64 / 2.0 * (deq[c * k + kk] as f64).abs();
                    }
                    let g = got[i * n + c] as f64;
                    // The same products summed in another order: f32 rounding, ~1e-6 of the sum
                    // of magnitudes.
                    assert!(
                        (g - exact).abs() <= 1e-5 * scale + 1e-6,
                        "{i},{c}: {g} vs {exact}"
                    );
                    // Each activation moves by at most half its block's step (d/2 = max|x|/254):
                    // the product by at most Σ d/2·|w|.
                    assert!(
                        (g - f32_dot).abs() <= rounding + 1e-5 * scale + 1e-6,
                        "{i},{c}"
                    );
                }
            }
        }
    }
}
