//! The k-quants' side of [`super`]: q4_K, q5_K and q6_K super-blocks of 256 values unpacked
//! and multiplied with activation rows that have one scale per 256 values (see the parent
//! module for the arithmetic and why mole runs it rather than candle).

use super::{f16_at, scalar_lane_sum, Format, Q8Rows, BLOCK, Q4K, Q5K, Q6K, SUPER};

/// The 6-bit scale and minimum of sub-block `j` (0..8) of a q4_K/q5_K super-block's 12 bytes.
pub(super) fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// A q4_K/q5_K super-block's 12 bytes of 6-bit scales and minimums as 8 scales then 8
/// minimums, one byte each: the bits moved by 32-bit words (`scale_min_k4`'s values, tested).
/// Always inlined: with two callers LLVM once called it out of `k_row`'s loop, per super-block
/// and row, and a lone row fell from 238 to 113 tok/s.
#[inline(always)]
pub(super) fn scales_mins_k4(s: &[u8]) -> [u8; 16] {
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const LOW2: u32 = 0x0303_0303;
    let word = |at: usize| u32::from_le_bytes([s[at], s[at + 1], s[at + 2], s[at + 3]]);
    let (w0, w1, w2) = (word(0), word(4), word(8));
    // Scales 0..4 are the low six bits of bytes 0..4, minimums 0..4 those of bytes 4..8;
    // scales and minimums 4..8 take the nibbles of bytes 8..12 and, on top, the top two bits
    // of bytes 0..4 and 4..8 respectively.
    let out = [
        w0 & LOW6,
        (w2 & LOW4) | (((w0 >> 6) & LOW2) << 4),
        w1 & LOW6,
        ((w2 >> 4) & LOW4) | (((w1 >> 6) & LOW2) << 4),
    ];
    let mut b = [0u8; 16];
    for (d, w) in b.chunks_exact_mut(4).zip(out) {
        d.copy_from_slice(&w.to_le_bytes());
    }
    b
}

/// A k-quant super-block's integer scales, one per 16 values (a q4_K/q5_K sub-block of 32
/// gives both of its halves its own), its integer minimums per 32 values (0 for q6_K), and the
/// factors of both: `d` and `dmin` (f16, widened).
pub(super) fn k_ints<const F: u8>(blk: &[u8]) -> ([i16; 16], [i16; 8], f32, f32) {
    let mut scale = [0i16; 16];
    let mut min = [0i16; 8];
    if F == Q6K {
        for (s, &c) in scale.iter_mut().zip(&blk[192..208]) {
            *s = c as i8 as i16;
        }
        (scale, min, f16_at(&blk[208..]), 0.0)
    } else {
        for (c, m) in min.iter_mut().enumerate() {
            let (sc, mn) = scale_min_k4(c, &blk[4..16]);
            scale[2 * c] = sc as i16;
            scale[2 * c + 1] = sc as i16;
            *m = mn as i16;
        }
        (scale, min, f16_at(blk), f16_at(&blk[2..]))
    }
}

/// A k-quant super-block's scales, one per 16 values, and its minimums per 32 values, to
/// subtract (0 for q6_K): computed as candle dequantizes them, so that `scale·q - min` is
/// candle's value bit for bit.
pub(super) fn k_scales<const F: u8>(blk: &[u8]) -> ([f32; 16], [f32; 8]) {
    let (sc, mn, d, dmin) = k_ints::<F>(blk);
    (
        sc.map(|s| d * s as f32),
        mn.map(|m| if F == Q6K { 0.0 } else { dmin * m as f32 }),
    )
}

/// A k-quant super-block's 256 integer values (q4_K 0..16, q5_K 0..32, q6_K -32..32).
pub(super) fn k_values<const F: u8>(blk: &[u8]) -> [i32; SUPER] {
    let mut q = [0i32; SUPER];
    if F == Q6K {
        let (ql, qh) = (&blk[..128], &blk[128..192]);
        for h in 0..2 {
            let (ql, qh, q) = (&ql[64 * h..], &qh[32 * h..], &mut q[128 * h..]);
            for l in 0..32 {
                let hi = |shift: u8| (((qh[l] >> shift) & 3) << 4) as i32 - 32;
                q[l] = (ql[l] & 0x0F) as i32 + hi(0);
                q[l + 32] = (ql[l + 32] & 0x0F) as i32 + hi(2);
                q[l + 64] = (ql[l] >> 4) as i32 + hi(4);
                q[l + 96] = (ql[l + 32] >> 4) as i32 + hi(6);
            }
        }
    } else {
        let (qh, qs) = if F == Q5K {
            (Some(&blk[16..48]), &blk[48..176])
        } else {
            (None, &blk[16..144])
        };
        for p in 0..4 {
            for l in 0..32 {
                let b = qs[32 * p + l];
                let high = |bit: usize| qh.map_or(0, |qh| ((qh[l] >> bit) & 1) as i32 * 16);
                q[64 * p + l] = (b & 0x0F) as i32 + high(2 * p);
                q[64 * p + 32 + l] = (b >> 4) as i32 + high(2 * p + 1);
            }
        }
    }
    q
}

/// [`dots`] of a k-quant in portable Rust: the AVX2 build's arithmetic, lane for lane.
///
/// With a scale per 256 activations, a super-block's products sum exactly in integers, each
/// sub-block's weighted by its integer scale (`Σ sc·Σ q·x`, in the lanes of four values that
/// `maddubs`/`madd` give), and meet the float scales once: `d·dx·Σ - dmin·dx·Σ m·Σx`.
pub(super) fn dots_k_scalar<const F: u8, const R: usize>(
    w: &[u8],
    x: &Q8Rows,
    i: usize,
) -> [f32; R] {
    assert_eq!(x.per, SUPER, "k-quants multiply rows with a scale per 256");
    let nb = x.k / BLOCK;
    let bb = k_block_bytes::<F>();
    let mut lanes = [[0f32; 8]; R];
    let mut mins = [0f32; R];
    for sb in 0..x.k / SUPER {
        let blk = &w[sb * bb..(sb + 1) * bb];
        let q = k_values::<F>(blk);
        let (sc, mn, d, dmin) = k_ints::<F>(blk);
        for r in 0..R {
            let b0 = (i + r) * nb + sb * (SUPER / BLOCK);
            let mut ints = [0i32; 8];
            let mut min_sum = 0i32;
            for c in 0..SUPER / BLOCK {
                let xq = &x.qs[(i + r) * x.k + (sb * (SUPER / BLOCK) + c) * BLOCK..][..BLOCK];
                let q = &q[c * BLOCK..][..BLOCK];
                for (l, acc) in ints.iter_mut().enumerate() {
                    let sum: i32 = (4 * l..4 * l + 4).map(|p| q[p] * xq[p] as i32).sum();
                    *acc += sum * sc[2 * c + l / 4] as i32;
                }
                min_sum += mn[c] as i32 * x.sums[b0 + c];
            }
            let dx = x.d[b0];
            for (acc, v) in lanes[r].iter_mut().zip(ints) {
                *acc = (v as f32).mul_add(d * dx, *acc);
            }
            if F != Q6K {
                mins[r] += dmin * dx * min_sum as f32;
            }
        }
    }
    std::array::from_fn(|r| scalar_lane_sum(&lanes[r]) - mins[r])
}

/// Bytes of a k-quant super-block of format `F`.
pub(super) const fn k_block_bytes<const F: u8>() -> usize {
    match F {
        Q4K => Format::Q4K.block_bytes(),
        Q5K => Format::Q5K.block_bytes(),
        _ => Format::Q6K.block_bytes(),
    }
}

/// A k-quant super-block's values as eight vectors of 32 bytes, one per sub-block of 32:
/// unsigned for q4_K and q5_K, signed for q6_K.
///
/// # Safety
/// The CPU has AVX2; `blk` holds a whole super-block of format `F`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn k_vectors<const F: u8>(
    blk: &[u8],
) -> [std::arch::x86_64::__m256i; SUPER / BLOCK] {
    use std::arch::x86_64::*;
    debug_assert!(blk.len() >= k_block_bytes::<F>());
    let p = blk.as_ptr();
    // Macros, not closures: a closure would not be compiled for AVX2.
    macro_rules! load {
        ($at:expr) => {
            // SAFETY: 32 bytes within the super-block (the caller's guarantee), at the
            // offsets of its layout.
            unsafe { _mm256_loadu_si256(p.add($at) as *const __m256i) }
        };
    }
    let low = _mm256_set1_epi8(0x0F);
    let mut v = [_mm256_setzero_si256(); SUPER / BLOCK];
    if F == Q6K {
        let three = _mm256_set1_epi8(3);
        let centre = _mm256_set1_epi8(32);
        for h in 0..2 {
            let (ql0, ql1, qh) = (load!(64 * h), load!(64 * h + 32), load!(128 + 32 * h));
            // Two high bits per value, moved to bits 4..6 (16-bit shifts: the masks keep
            // every byte's bits its own).
            let hi0 = _mm256_slli_epi16::<4>(_mm256_and_si256(qh, three));
            let hi1 = _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<2>(qh), three));
            let hi2 = _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<4>(qh), three));
            let hi3 = _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<6>(qh), three));
            let lo0 = _mm256_and_si256(ql0, low);
            let lo1 = _mm256_and_si256(ql1, low);
            let lo2 = _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), low);
            let lo3 = _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), low);
            for (j, (lo, hi)) in [(lo0, hi0), (lo1, hi1), (lo2, hi2), (lo3, hi3)]
                .into_iter()
                .enumerate()
            {
                v[4 * h + j] = _mm256_sub_epi8(_mm256_or_si256(lo, hi), centre);
            }
        }
    } else {
        let at = if F == Q5K { 48 } else { 16 };
        let qh = if F == Q5K {
            load!(16)
        } else {
            _mm256_setzero_si256()
        };
        let sixteen = _mm256_set1_epi8(16);
        for pair in 0..4 {
            let nib = load!(at + 32 * pair);
            let mut lo = _mm256_and_si256(nib, low);
            let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(nib), low);
            if F == Q5K {
                // The fifth bit of sub-block `j` is bit `j` of each value's qh byte.
                macro_rules! bit {
                    ($j:expr) => {{
                        let m = _mm256_set1_epi8((1u8 << $j) as i8);
                        let set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, m), m);
                        _mm256_and_si256(set, sixteen)
                    }};
                }
                lo = _mm256_or_si256(lo, bit!(2 * pair));
                hi = _mm256_or_si256(hi, bit!(2 * pair + 1));
            }
            v[2 * pair] = lo;
            v[2 * pair + 1] = hi;
        }
    }
    v
}

/// [`k_ints`] with the scales and minimums unpacked by words ([`scales_mins_k4`]) and the f16
/// factors widened by F16C: the same values (a lone row of the tiled kernel spent a third of
/// its time in the `half` crate's widening, called per super-block and row).
///
/// # Safety
/// The CPU has F16C; `blk` holds a whole super-block of format `F`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn k_ints_f16c<const F: u8>(blk: &[u8]) -> ([i16; 16], [i16; 8], f32, f32) {
    use std::arch::x86_64::*;
    let mut scale = [0i16; 16];
    let mut min = [0i16; 8];
    if F == Q6K {
        for (s, &c) in scale.iter_mut().zip(&blk[192..208]) {
            *s = c as i8 as i16;
        }
        let d = _mm_cvtph_ps(_mm_cvtsi32_si128(
            u16::from_le_bytes([blk[208], blk[209]]) as i32
        ));
        (scale, min, _mm_cvtss_f32(d), 0.0)
    } else {
        let sm = scales_mins_k4(&blk[4..16]);
        for c in 0..8 {
            scale[2 * c] = sm[c] as i16;
            scale[2 * c + 1] = sm[c] as i16;
            min[c] = sm[8 + c] as i16;
        }
        let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(i32::from_le_bytes([
            blk[0], blk[1], blk[2], blk[3],
        ])));
        (
            scale,
            min,
            _mm_cvtss_f32(dm),
            _mm_cvtss_f32(_mm_movehdup_ps(dm)),
        )
    }
}

/// [`dots`] of a k-quant with AVX2 (the arithmetic of [`dots_k_scalar`]).
///
/// # Safety
/// The CPU has AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dots_k_avx2<const F: u8, const R: usize>(
    w: &[u8],
    x: &Q8Rows,
    i: usize,
) -> [f32; R] {
    use std::arch::x86_64::*;
    assert!(
        x.per == SUPER,
        "k-quants multiply rows with a scale per 256"
    );
    let nb = x.k / BLOCK;
    let bb = k_block_bytes::<F>();
    assert!(
        w.len() >= x.k / SUPER * bb && x.qs.len() >= (i + R) * x.k,
        "out of bounds"
    );
    let qs: [*const i8; R] = std::array::from_fn(|r| x.qs[(i + r) * x.k..].as_ptr());
    let ds: [&[f32]; R] = std::array::from_fn(|r| &x.d[(i + r) * nb..(i + r + 1) * nb]);
    let sums: [&[i32]; R] = std::array::from_fn(|r| &x.sums[(i + r) * nb..(i + r + 1) * nb]);
    let mut acc = [_mm256_setzero_ps(); R];
    let mut mins = [0f32; R];
    for sb in 0..x.k / SUPER {
        let blk = &w[sb * bb..(sb + 1) * bb];
        // SAFETY: the CPU has AVX2; `blk` is a whole super-block.
        let vals = unsafe { k_vectors::<F>(blk) };
        // SAFETY: the CPU has F16C; `blk` is a whole super-block.
        let (sc, mn, d, dmin) = unsafe { k_ints_f16c::<F>(blk) };
        let mut ints = [_mm256_setzero_si256(); R];
        for (c, &q) in vals.iter().enumerate() {
            let b = sb * (SUPER / BLOCK) + c;
            // The 16-bit pair sums of values 0..16 of the block meet the first scale, those of
            // values 16..32 the second.
            let scale = _mm256_set_m128i(_mm_set1_epi16(sc[2 * c + 1]), _mm_set1_epi16(sc[2 * c]));
            let mag = if F == Q6K { _mm256_abs_epi8(q) } else { q };
            for r in 0..R {
                // SAFETY: block `b` of row `i + r` lies within `x.qs` (asserted above).
                let xq = unsafe { _mm256_loadu_si256(qs[r].add(b * BLOCK) as *const __m256i) };
                let xq = if F == Q6K {
                    _mm256_sign_epi8(xq, q)
                } else {
                    xq
                };
                // Pairs: at most 32·127·2 < 2¹⁵; times a scale (|sc| ≤ 128), two per lane,
                // summed over eight blocks: below 2²⁵. Exact.
                let pairs = _mm256_maddubs_epi16(mag, xq);
                ints[r] = _mm256_add_epi32(ints[r], _mm256_madd_epi16(pairs, scale));
            }
        }
        let b0 = sb * (SUPER / BLOCK);
        for r in 0..R {
            let dx = ds[r][b0];
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints[r]), _mm256_set1_ps(d * dx), acc[r]);
            if F != Q6K {
                let mut min_sum = 0i32;
                for (c, &m) in mn.iter().enumerate() {
                    min_sum += m as i32 * sums[r][b0 + c];
                }
                mins[r] += dmin * dx * min_sum as f32;
            }
        }
    }
    let mut out = [0f32; R];
    for (o, (acc, mins)) in out.iter_mut().zip(acc.iter().zip(mins)) {
        // SAFETY: the CPU has AVX2 (this function's contract).
        *o = unsafe { super::lane_sum(*acc) } - mins;
    }
    out
}
