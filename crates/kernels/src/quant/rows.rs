//! Rounding activation blocks to 8 bits ([`super::Q8Rows`]), the same values in vector
//! registers as in portable Rust: a prefill rounds every value of every projection's input,
//! and `f32::round` is a library call per value, where eight values take a few instructions.

use super::BLOCK;

/// Whether the vector builds run here (asked once per product, not per block).
pub(super) fn vectors() -> bool {
    crate::cpu::caps().avx2
}

/// The largest magnitude of `x` (NaN ignored, as `f32::max` ignores it); `simd`: [`vectors`].
pub(super) fn amax(x: &[f32], simd: bool) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if simd && x.len().is_multiple_of(8) {
        // SAFETY: the CPU has AVX2; `x` is whole vectors of eight.
        return unsafe { amax_avx2(x) };
    }
    let _ = simd;
    x.iter().fold(0f32, |m, v| m.max(v.abs()))
}

/// Block `x` times `inv`, rounded half away from zero and clamped to ±127, into `q`; the
/// sum of the values; `simd`: [`vectors`].
pub(super) fn round_block(x: &[f32], inv: f32, q: &mut [i8], simd: bool) -> i32 {
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: the CPU has AVX2.
        return unsafe { round_block_avx2(x, inv, q) };
    }
    let _ = simd;
    round_block_scalar(x, inv, q)
}

/// [`round_block`] in portable Rust.
fn round_block_scalar(x: &[f32], inv: f32, q: &mut [i8]) -> i32 {
    let mut sum = 0i32;
    for (q, v) in q[..BLOCK].iter_mut().zip(&x[..BLOCK]) {
        // |v·inv| ≤ 127 (up to rounding, which the clamp absorbs): the values stay in
        // -127..=127, so `maddubs` pairs cannot saturate. NaN becomes 0 (the saturating cast).
        *q = (v * inv).round().clamp(-127.0, 127.0) as i8;
        sum += *q as i32;
    }
    sum
}

/// [`amax`] with AVX2.
///
/// # Safety
/// The CPU has AVX2; `x.len()` is a multiple of 8.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn amax_avx2(x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let sign = _mm256_set1_ps(-0.0);
    let mut m = _mm256_setzero_ps();
    for v in x.chunks_exact(8) {
        // SAFETY: eight floats.
        let a = _mm256_andnot_ps(sign, unsafe { _mm256_loadu_ps(v.as_ptr()) });
        // `maxps` answers its second operand where either is NaN: the running maximum.
        m = _mm256_max_ps(a, m);
    }
    let mut l = [0f32; 8];
    // SAFETY: eight floats.
    unsafe { _mm256_storeu_ps(l.as_mut_ptr(), m) };
    l.iter().fold(0f32, |m, v| m.max(*v))
}

/// [`round_block`] with AVX2: `roundf`'s half-away-from-zero as truncation plus a step of one
/// where the (exact) remainder is at least a half.
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn round_block_avx2(x: &[f32], inv: f32, q: &mut [i8]) -> i32 {
    use std::arch::x86_64::*;
    assert!(x.len() >= BLOCK && q.len() >= BLOCK, "a whole block");
    let (vinv, sign) = (_mm256_set1_ps(inv), _mm256_set1_ps(-0.0));
    let (half, one, lim) = (
        _mm256_set1_ps(0.5),
        _mm256_set1_ps(1.0),
        _mm256_set1_ps(127.0),
    );
    let mut ints = [_mm256_setzero_si256(); 4];
    let mut sum = _mm256_setzero_si256();
    for (j, i) in ints.iter_mut().enumerate() {
        // SAFETY: eight floats of the block (asserted above).
        let y = _mm256_mul_ps(unsafe { _mm256_loadu_ps(x.as_ptr().add(8 * j)) }, vinv);
        let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
        // y - trunc(y) is exact below 2²³.
        let frac = _mm256_andnot_ps(sign, _mm256_sub_ps(y, t));
        let step = _mm256_and_ps(
            _mm256_cmp_ps::<_CMP_GE_OQ>(frac, half),
            _mm256_or_ps(one, _mm256_and_ps(y, sign)),
        );
        let r = _mm256_min_ps(
            _mm256_max_ps(
                _mm256_add_ps(t, step),
                _mm256_sub_ps(_mm256_setzero_ps(), lim),
            ),
            lim,
        );
        // NaN lanes to 0, as the scalar cast.
        let r = _mm256_and_ps(r, _mm256_cmp_ps::<_CMP_ORD_Q>(y, y));
        *i = _mm256_cvtps_epi32(r);
        sum = _mm256_add_epi32(sum, *i);
    }
    // 32 integers to bytes: the packs work within 128-bit halves, the permutation puts the
    // four groups of eight back in order.
    let words = _mm256_packs_epi16(
        _mm256_packs_epi32(ints[0], ints[1]),
        _mm256_packs_epi32(ints[2], ints[3]),
    );
    let bytes = _mm256_permutevar8x32_epi32(words, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    // SAFETY: 32 bytes of `q` (asserted above).
    unsafe { _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, bytes) };
    let mut l = [0i32; 8];
    // SAFETY: eight integers.
    unsafe { _mm256_storeu_si256(l.as_mut_ptr() as *mut __m256i, sum) };
    l.iter().sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vector build rounds every value as `f32::round` does, ties, clamps and NaN
    /// included, and finds the same maximum.
    #[test]
    fn vectors_round_as_the_scalar_build() {
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for case in 0..400 {
            let mut x: Vec<f32> = (0..BLOCK)
                .map(|_| (next() % 20_001) as f32 / 100.0 - 100.0)
                .collect();
            // Exact halves (ties), values past the clamp, NaN, -0.0 and infinities.
            x[case % BLOCK] = (case as f32 - 200.0) + 0.5;
            x[(case + 7) % BLOCK] = 300.0 * if case % 2 == 0 { 1.0 } else { -1.0 };
            if case % 5 == 0 {
                x[(case + 11) % BLOCK] = f32::NAN;
            }
            if case % 7 == 0 {
                x[(case + 13) % BLOCK] = -0.0;
            }
            if case % 11 == 0 {
                x[(case + 17) % BLOCK] = f32::NEG_INFINITY;
            }
            for inv in [1.0, 0.5, 1.27, 0.0, 3.0e-3] {
                let (mut a, mut b) = ([0i8; BLOCK], [0i8; BLOCK]);
                let sa = round_block(&x, inv, &mut a, vectors());
                let sb = round_block_scalar(&x, inv, &mut b);
                assert_eq!((a, sa), (b, sb), "case {case}, inv {inv}");
            }
            let scalar = x.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(
                amax(&x, vectors()).to_bits(),
                scalar.to_bits(),
                "case {case}"
            );
        }
    }
}
