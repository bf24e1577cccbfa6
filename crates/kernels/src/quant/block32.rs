//! The 32-wide formats' side of [`super`]: q4_0, q4_1 and q8_0 blocks unpacked and multiplied
//! with activation rows of one scale per 32 values, tiled over activation rows (a decode
//! step's batch) or, for a lone row, over weight rows (see the parent module for the
//! arithmetic).

#[cfg(target_arch = "x86_64")]
use super::lane_sum;
use super::{f16_at, scalar_lane_sum, Q8Rows, BLOCK, Q4_1, Q8_0, S_GROUP};

/// Weight block `blk` of format `F` as its 32 integer values (Q4_1: 0..16, to be scaled and
/// shifted by its minimum; Q4_0: -8..8; Q8_0: the bytes), its scale and its minimum (0 but for
/// Q4_1).
pub(super) fn unpack<const F: u8>(blk: &[u8]) -> ([i32; BLOCK], f32, f32) {
    let mut q = [0i32; BLOCK];
    match F {
        Q8_0 => {
            for (q, &b) in q.iter_mut().zip(&blk[2..2 + BLOCK]) {
                *q = b as i8 as i32;
            }
            (q, f16_at(blk), 0.0)
        }
        _ => {
            let (at, shift) = if F == Q4_1 { (4, 0) } else { (2, 8) };
            for j in 0..BLOCK / 2 {
                let b = blk[at + j];
                q[j] = (b & 0x0F) as i32 - shift;
                q[j + BLOCK / 2] = (b >> 4) as i32 - shift;
            }
            let m = if F == Q4_1 { f16_at(&blk[2..]) } else { 0.0 };
            (q, f16_at(blk), m)
        }
    }
}

/// [`dots`] in portable Rust: the AVX2 build's arithmetic, lane for lane (see the module).
pub(super) fn dots_scalar<const F: u8, const R: usize>(w: &[u8], x: &Q8Rows, i: usize) -> [f32; R] {
    let nb = x.k / BLOCK;
    let bb = [18, 20, 34][F as usize];
    let mut lanes = [[0f32; 8]; R];
    let mut mins = [0f32; R];
    for b in 0..nb {
        let (q, dw, mw) = unpack::<F>(&w[b * bb..(b + 1) * bb]);
        for r in 0..R {
            let xq = &x.qs[(i + r) * x.k + b * BLOCK..][..BLOCK];
            let scale = dw * x.d[(i + r) * nb + b];
            for (l, acc) in lanes[r].iter_mut().enumerate() {
                let sum: i32 = (4 * l..4 * l + 4).map(|p| q[p] * xq[p] as i32).sum();
                *acc = (sum as f32).mul_add(scale, *acc);
            }
            if F == Q4_1 {
                // A fused multiply-add, as the AVX2 build's vector of a group's rows.
                mins[r] = mw.mul_add(x.s_at(i + r, b), mins[r]);
            }
        }
    }
    std::array::from_fn(|r| scalar_lane_sum(&lanes[r]) + mins[r])
}

/// The 32 products of a block and an activation block, in eight lanes of four (`mag`·`xq`
/// pairwise, pairs summed): `maddubs` then `madd`, AVX2's way.
macro_rules! sums_maddubs {
    ($ones:expr, $mag:expr, $xq:expr) => {
        _mm256_madd_epi16($ones, _mm256_maddubs_epi16($mag, $xq))
    };
}

/// [`sums_maddubs`] in one AVX-VNNI instruction (`vpdpbusd`): the same four products summed
/// per lane, exactly (the pairs never saturate, see the kernels), so bit for bit the same.
macro_rules! sums_vnni {
    ($ones:expr, $mag:expr, $xq:expr) => {{
        let _ = $ones;
        _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), $mag, $xq)
    }};
}

macro_rules! tiled_dots {
    ($name:ident, $features:literal, $sums:ident) => {
        /// [`dots`] with AVX2 (`$name`: its pair sums by `$sums`).
        ///
        /// # Safety
        /// The CPU has AVX2, FMA and F16C.
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        // `b` indexes the weight blocks, the rows' values and their scales at once.
        #[allow(clippy::needless_range_loop)]
        pub(super) unsafe fn $name<const F: u8, const R: usize>(
            w: &[u8],
            x: &Q8Rows,
            i: usize,
        ) -> [f32; R] {
            use std::arch::x86_64::*;
            let nb = x.k / BLOCK;
            let bb = [18, 20, 34][F as usize];
            assert!(
                w.len() >= nb * bb && x.qs.len() >= (i + R) * x.k,
                "out of bounds"
            );
            let qs: [*const i8; R] = std::array::from_fn(|r| x.qs[(i + r) * x.k..].as_ptr());
            let ds: [&[f32]; R] = std::array::from_fn(|r| &x.d[(i + r) * nb..(i + r + 1) * nb]);
            // Q4_1's minimums: the rows' block values `s` lie side by side in groups of `S_GROUP`, so
            // when the tile's rows share a group each block's minimum meets all of them in one
            // fused multiply-add (otherwise, one per row: the same arithmetic, lane by lane).
            let (group, lane) = (i / S_GROUP, i % S_GROUP);
            let grouped = lane + R <= S_GROUP;
            assert!(x.s.len() >= (group + 1) * nb * S_GROUP, "out of bounds");
            let mut minv = _mm_setzero_ps();
            let mut acc = [_mm256_setzero_ps(); R];
            let mut mins = [0f32; R];
            let ones = _mm256_set1_epi16(1);
            for b in 0..nb {
                // SAFETY: block `b` lies within `w` (asserted above).
                let (q, mag, dw, mw) = unsafe { unpack_avx2::<F>(w.as_ptr().add(b * bb)) };
                for r in 0..R {
                    // SAFETY: block `b` of row `i + r` lies within `x.qs` (asserted above).
                    let xq = unsafe { _mm256_loadu_si256(qs[r].add(b * BLOCK) as *const __m256i) };
                    let xq = if F == Q4_1 {
                        xq
                    } else {
                        _mm256_sign_epi8(xq, q)
                    };
                    // Pairs: at most 128·127·2 < 2¹⁵ (activations stay within ±127): exact.
                    let sums = $sums!(ones, mag, xq);
                    let scale = _mm256_set1_ps(dw * ds[r][b]);
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[r]);
                    if F == Q4_1 && !grouped {
                        mins[r] = mw.mul_add(x.s_at(i + r, b), mins[r]);
                    }
                }
                if F == Q4_1 && grouped {
                    // SAFETY: the group's four values of block `b` lie within `x.s` (asserted above).
                    let sv = unsafe { _mm_loadu_ps(x.s.as_ptr().add((group * nb + b) * S_GROUP)) };
                    minv = _mm_fmadd_ps(_mm_set1_ps(mw), sv, minv);
                }
            }
            if F == Q4_1 && grouped {
                let mut m = [0f32; S_GROUP];
                // SAFETY: `m` holds four floats.
                unsafe { _mm_storeu_ps(m.as_mut_ptr(), minv) };
                mins.copy_from_slice(&m[lane..lane + R]);
            }
            // A loop, not `from_fn`: a closure would not be compiled for AVX2.
            let mut out = [0f32; R];
            for (o, (acc, mins)) in out.iter_mut().zip(acc.iter().zip(mins)) {
                // SAFETY: the CPU has AVX2 (this function's contract).
                *o = unsafe { lane_sum(*acc) } + mins;
            }
            out
        }
    };
}

tiled_dots!(dots_avx2, "avx2,fma,f16c", sums_maddubs);
tiled_dots!(dots_vnni, "avx2,fma,f16c,avxvnni", sums_vnni);

/// A weight block of a 32-wide format at `blk`, unpacked for `maddubs`: its 32 values as bytes
/// (unsigned for Q4_1; signed for Q4_0 and Q8_0, whose signs move onto the activations), their
/// magnitudes (the values themselves for Q4_1), its scale and its minimum (Q4_1's; else 0).
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `blk` points at a whole block of format `F`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn unpack_avx2<const F: u8>(
    blk: *const u8,
) -> (
    std::arch::x86_64::__m256i,
    std::arch::x86_64::__m256i,
    f32,
    f32,
) {
    use std::arch::x86_64::*;
    // The block's f16 scale (and Q4_1's minimum after it), widened by F16C.
    // SAFETY: a block starts with 4 readable bytes (its scales, or a scale and data).
    let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(unsafe {
        std::ptr::read_unaligned(blk as *const i32)
    }));
    let dw = _mm_cvtss_f32(dm);
    let mw = _mm_cvtss_f32(_mm_movehdup_ps(dm));
    let q = match F {
        // SAFETY: 32 bytes of values at blk[2..34].
        Q8_0 => unsafe { _mm256_loadu_si256(blk.add(2) as *const __m256i) },
        _ => {
            let at = if F == Q4_1 { 4 } else { 2 };
            // SAFETY: 16 bytes of nibbles at blk[at..at + 16].
            let nib = unsafe { _mm_loadu_si128(blk.add(at) as *const __m128i) };
            // Values 0..16 from the low nibbles, 16..32 from the high ones.
            let q = _mm256_and_si256(
                _mm256_set1_epi8(0x0F),
                _mm256_insertf128_si256::<1>(_mm256_castsi128_si256(nib), _mm_srli_epi16(nib, 4)),
            );
            if F == Q4_1 {
                q
            } else {
                _mm256_sub_epi8(q, _mm256_set1_epi8(8))
            }
        }
    };
    let mag = if F == Q4_1 { q } else { _mm256_abs_epi8(q) };
    (q, mag, dw, mw)
}

macro_rules! column_dots {
    ($name:ident, $features:literal, $sums:ident) => {
        /// One activation row `i` · `C` weight rows `w` of a 32-wide format: a lone row (batch 1)
        /// reuses nothing across rows, so the tile runs over weight rows instead, each its own
        /// accumulator (independent chains of multiply-adds, one activation load per block for all).
        /// Each weight row's arithmetic is [`dots_avx2`]'s for it, in the same order: bit-equal.
        ///
        /// # Safety
        /// The CPU has AVX2, FMA and F16C.
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        pub(super) unsafe fn $name<const F: u8, const C: usize>(
            w: [&[u8]; C],
            ahead: *const u8,
            x: &Q8Rows,
            i: usize,
        ) -> [f32; C] {
            use std::arch::x86_64::*;
            let nb = x.k / BLOCK;
            let bb = [18, 20, 34][F as usize];
            assert!(
                w.iter().all(|w| w.len() >= nb * bb) && x.qs.len() >= (i + 1) * x.k,
                "out of bounds"
            );
            let qs = x.qs[i * x.k..].as_ptr();
            let ds = &x.d[i * nb..(i + 1) * nb];
            let mut acc = [_mm256_setzero_ps(); C];
            let mut mins = [0f32; C];
            let ones = _mm256_set1_epi16(1);
            for (b, &dx) in ds.iter().enumerate() {
                // SAFETY: block `b` of row `i` lies within `x.qs` (asserted above).
                let xq = unsafe { _mm256_loadu_si256(qs.add(b * BLOCK) as *const __m256i) };
                let s = if F == Q4_1 { x.s_at(i, b) } else { 0.0 };
                // The next tile's rows follow these: read ahead at the pace these are read (C blocks
                // a step), as the hardware prefetchers would not on streams this short.
                for p in 0..(C * bb).div_ceil(64) {
                    let at = ahead.wrapping_add(b * C * bb + 64 * p);
                    _mm_prefetch::<_MM_HINT_T0>(at as *const i8);
                }
                for c in 0..C {
                    // SAFETY: block `b` lies within `w[c]` (asserted above).
                    let (q, mag, dw, mw) = unsafe { unpack_avx2::<F>(w[c].as_ptr().add(b * bb)) };
                    let xs = if F == Q4_1 {
                        xq
                    } else {
                        _mm256_sign_epi8(xq, q)
                    };
                    let sums = $sums!(ones, mag, xs);
                    let scale = _mm256_set1_ps(dw * dx);
                    acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[c]);
                    if F == Q4_1 {
                        mins[c] = mw.mul_add(s, mins[c]);
                    }
                }
            }
            let mut out = [0f32; C];
            for (o, (acc, mins)) in out.iter_mut().zip(acc.iter().zip(mins)) {
                // SAFETY: the CPU has AVX2 (this function's contract).
                *o = unsafe { lane_sum(*acc) } + mins;
            }
            out
        }
    };
}

column_dots!(dots_cols_avx2, "avx2,fma,f16c", sums_maddubs);
column_dots!(dots_cols_vnni, "avx2,fma,f16c,avxvnni", sums_vnni);
