//! The k-quants (q4_K, q5_K, q6_K) for a decode step of fewer rows than the k-quant panels
//! repay ([`super::K_PANEL_ROWS`]), on CPUs with AVX-512 BW: each super-block read in place,
//! as stored, 128 values to a 512-bit register.
//!
//! Why: a lone row of the tiled AVX2 kernel ([`super::k`]) spent about a hundred instructions
//! per super-block and row (its scales unpacked value by value, eight 256-bit products), about
//! twice llama.cpp's time per token on the same Q4_K_M file; the panels repack per product,
//! which a lone row cannot repay (see [`super::panel`]). Here a super-block is four registers
//! of values, four of scales (one `vpermw` each from the unpacked scales) and per activation
//! row four `vpmaddubsw`/`vpmaddwd` pairs, whose weighted sums add exactly in 32 bits.
//!
//! The arithmetic is the k-quant panels' ([`super::panel_k`]) lane for lane: the super-block's
//! exact integer sum `Σ sc·Σ q·x` meets `d·dx` in one fused multiply-add, then `dmin·dx` its
//! minimums' `Σ m·Σ x` in a fused negative one, super-block by super-block. So a row gives the
//! same bits whether its step has one row (here) or sixteen (the panels), and the panels'
//! scalar arithmetic is this kernel's reference (tested).
//!
//! q6_K's values (−32..32) go unsigned plus 32 for `vpmaddubsw`, and 32 times the activations'
//! pair sums come off before the scales meet them (each pair at most 63·127·2 + 32·127·2 <
//! 2¹⁵ in magnitude). q4_K's nibbles hold sub-blocks `2p` and `2p + 1` of a group of 64 values
//! in their low and high halves, so its activations are regrouped to match (two 128-bit lane
//! shuffles per 128 values); q5_K adds its fifth bits by a masked add.

use super::k::{k_block_bytes, scales_mins_k4};
use super::{Q8Rows, BLOCK, Q4K, Q5K, Q6K, SUPER};

/// Activation rows that meet each unpacked super-block at once (one call's rows).
pub(super) const ROWS: usize = 8;

/// `out[r·width + c]` (added to when `accumulate`) = activation row `r` (`R` rows) · weight
/// row `c` (a k-quant `F`) for the columns `cols`, whose rows `w` holds: the k-quant panels'
/// arithmetic, a weight row at a time (see the module).
///
/// # Safety
/// The CPU has AVX-512 F and BW, AVX2, FMA and F16C; `out` is valid for writes of `R` rows of
/// `width` values, and no other thread touches these columns meanwhile.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
pub(super) unsafe fn rows_k_avx512<const F: u8, const R: usize>(
    w: &[u8],
    x: &Q8Rows,
    i: usize,
    cols: std::ops::Range<usize>,
    out: *mut f32,
    width: usize,
    accumulate: bool,
) {
    use std::arch::x86_64::*;
    const SUBS: usize = SUPER / BLOCK;
    /// Per register of values, the `vpermw` indices that spread the super-block's unpacked
    /// scales over its 32 pairs: q4_K/q5_K registers hold sub-blocks (0, 2), (1, 3), (4, 6),
    /// (5, 7), a scale per 16 pairs; q6_K's hold (0, 1), (2, 3), …, a scale per 8 pairs.
    const fn spread(q6: bool) -> [[i16; 32]; 4] {
        let mut t = [[0i16; 32]; 4];
        let mut z = 0;
        while z < 4 {
            let mut j = 0;
            while j < 32 {
                t[z][j] = if q6 {
                    (4 * z + j / 8) as i16
                } else {
                    let (a, b) = [(0, 2), (1, 3), (4, 6), (5, 7)][z];
                    if j < 16 {
                        a
                    } else {
                        b
                    }
                };
                j += 1;
            }
            z += 1;
        }
        t
    }
    static SPREAD_K4: [[i16; 32]; 4] = spread(false);
    static SPREAD_K6: [[i16; 32]; 4] = spread(true);
    assert!(
        x.per == SUPER,
        "k-quants multiply rows with a scale per 256"
    );
    let (nb, ns, bb) = (x.k / BLOCK, x.k / SUPER, k_block_bytes::<F>());
    assert!(
        w.len() >= cols.len() * ns * bb
            && x.qs.len() >= (i + R) * x.k
            && x.d.len() >= (i + R) * nb
            && x.sums.len() >= (i + R) * nb,
        "out of bounds"
    );
    let spread = if F == Q6K { &SPREAD_K6 } else { &SPREAD_K4 };
    let mut idx = [_mm512_setzero_si512(); 4];
    for (v, t) in idx.iter_mut().zip(spread) {
        // SAFETY: 64 bytes of a static table.
        *v = unsafe { _mm512_loadu_si512(t.as_ptr() as *const _) };
    }
    let low = _mm512_set1_epi8(0x0F);
    let three = _mm512_set1_epi8(3);
    let sixteen = _mm512_set1_epi8(16);
    let thirty_two = _mm512_set1_epi8(32);
    // q5_K: the fifth bit of sub-block `j` is bit `j` of each value's byte of `qh`; per
    // register, the bits of its two sub-blocks.
    let mut fifth = [_mm512_setzero_si512(); 4];
    for (z, (a, b)) in [(0, 2), (1, 3), (4, 6), (5, 7)].into_iter().enumerate() {
        fifth[z] = _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm256_set1_epi8((1u8 << a) as i8)),
            _mm256_set1_epi8((1u8 << b) as i8),
        );
    }
    for (j, c) in cols.enumerate() {
        let mut acc = [0f32; R];
        for s in 0..ns {
            // SAFETY: super-block `s` of row `j` lies within `w` (asserted above).
            let blk = unsafe { w.as_ptr().add((j * ns + s) * bb) };
            let mut vals = [_mm512_setzero_si512(); 4];
            let mut scales = [_mm512_setzero_si512(); 4];
            let mut mins = _mm256_setzero_si256();
            let (d, dmin);
            if F == Q6K {
                for h in 0..2 {
                    // SAFETY: 64 bytes of low nibbles and 32 of high bits, within the
                    // super-block's 210.
                    let (ql, qh) = unsafe {
                        (
                            _mm512_loadu_si512(blk.add(64 * h) as *const _),
                            _mm256_loadu_si256(blk.add(128 + 32 * h) as *const __m256i),
                        )
                    };
                    // Two high bits per value: bits 0-1 and 2-3 of `qh` for the low nibbles'
                    // two sub-blocks, bits 4-5 and 6-7 for the high nibbles'.
                    let qh = _mm512_inserti64x4::<1>(
                        _mm512_castsi256_si512(qh),
                        _mm256_srli_epi16::<2>(qh),
                    );
                    let hi_lo = _mm512_slli_epi16::<4>(_mm512_and_si512(qh, three));
                    let hi_hi =
                        _mm512_slli_epi16::<4>(_mm512_and_si512(_mm512_srli_epi16::<4>(qh), three));
                    vals[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, low), hi_lo);
                    vals[2 * h + 1] =
                        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16::<4>(ql), low), hi_hi);
                }
                // SAFETY: the 16 scales at bytes 192..208 of the super-block.
                let sc = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(unsafe {
                    _mm_loadu_si128(blk.add(192) as *const __m128i)
                }));
                for (v, ix) in scales.iter_mut().zip(idx) {
                    *v = _mm512_permutexvar_epi16(ix, sc);
                }
                // SAFETY: the f16 `d` is the super-block's last two bytes.
                let d16 = unsafe { std::ptr::read_unaligned(blk.add(208) as *const u16) };
                d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(d16 as i32)));
                dmin = 0.0;
            } else {
                // SAFETY: the super-block's 144 or 176 bytes.
                let b = unsafe { std::slice::from_raw_parts(blk, bb) };
                let sm = scales_mins_k4(&b[4..16]);
                // SAFETY: 8 bytes each of the 16 just made.
                let (sc, mn) = unsafe {
                    (
                        _mm_loadl_epi64(sm.as_ptr() as *const __m128i),
                        _mm_loadl_epi64(sm.as_ptr().add(8) as *const __m128i),
                    )
                };
                let sc = _mm512_castsi128_si512(_mm_cvtepu8_epi16(sc));
                for (v, ix) in scales.iter_mut().zip(idx) {
                    *v = _mm512_permutexvar_epi16(ix, sc);
                }
                mins = _mm256_cvtepu8_epi32(mn);
                let at = if F == Q5K { 48 } else { 16 };
                let qh = if F == Q5K {
                    // SAFETY: q5_K's 32 bytes of fifth bits at 16..48.
                    _mm512_broadcast_i64x4(unsafe {
                        _mm256_loadu_si256(blk.add(16) as *const __m256i)
                    })
                } else {
                    _mm512_setzero_si512()
                };
                for h in 0..2 {
                    // SAFETY: 64 of the 128 bytes of nibbles, within the super-block.
                    // SAFETY: 64 of the 128 bytes of nibbles, within the super-block.
                    let nib = unsafe { _mm512_loadu_si512(blk.add(at + 64 * h) as *const _) };
                    vals[2 * h] = _mm512_and_si512(nib, low);
                    vals[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16::<4>(nib), low);
                }
                if F == Q5K {
                    for (v, bit) in vals.iter_mut().zip(fifth) {
                        let set = _mm512_test_epi8_mask(qh, bit);
                        *v = _mm512_mask_add_epi8(*v, set, *v, sixteen);
                    }
                }
                // SAFETY: `d` and `dmin`, f16, the super-block's first four bytes.
                let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(unsafe {
                    std::ptr::read_unaligned(blk as *const i32)
                }));
                d = _mm_cvtss_f32(dm);
                dmin = _mm_cvtss_f32(_mm_movehdup_ps(dm));
            }
            for (r, acc) in acc.iter_mut().enumerate() {
                let b0 = (i + r) * nb + s * SUBS;
                // SAFETY: this super-block's 256 activations of row `i + r` (asserted above).
                let xp = unsafe { x.qs.as_ptr().add((i + r) * x.k + s * SUPER) };
                let mut xv = [_mm512_setzero_si512(); 4];
                for (z, v) in xv.iter_mut().enumerate() {
                    // SAFETY: as above.
                    *v = unsafe { _mm512_loadu_si512(xp.add(64 * z) as *const _) };
                }
                if F != Q6K {
                    // Sub-blocks (0, 1), (2, 3) → (0, 2), (1, 3), as the nibbles hold them.
                    for h in 0..2 {
                        let (a, b) = (xv[2 * h], xv[2 * h + 1]);
                        xv[2 * h] = _mm512_shuffle_i64x2::<0x44>(a, b);
                        xv[2 * h + 1] = _mm512_shuffle_i64x2::<0xEE>(a, b);
                    }
                }
                let mut total = _mm512_setzero_si512();
                for z in 0..4 {
                    let mut pairs = _mm512_maddubs_epi16(vals[z], xv[z]);
                    if F == Q6K {
                        pairs = _mm512_sub_epi16(pairs, _mm512_maddubs_epi16(thirty_two, xv[z]));
                    }
                    total = _mm512_add_epi32(total, _mm512_madd_epi16(pairs, scales[z]));
                }
                let total = _mm512_reduce_add_epi32(total);
                let dx = x.d[b0];
                *acc = (total as f32).mul_add(d * dx, *acc);
                if F != Q6K {
                    // SAFETY: the super-block's eight sums of row `i + r` (asserted above).
                    let sums =
                        unsafe { _mm256_loadu_si256(x.sums.as_ptr().add(b0) as *const __m256i) };
                    let m = _mm256_mullo_epi32(mins, sums);
                    let m =
                        _mm_add_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256::<1>(m));
                    let m = _mm_add_epi32(m, _mm_shuffle_epi32::<0x4E>(m));
                    let m = _mm_add_epi32(m, _mm_shuffle_epi32::<0xB1>(m));
                    *acc = (-(_mm_cvtsi128_si32(m) as f32)).mul_add(dmin * dx, *acc);
                }
            }
        }
        for (r, v) in acc.iter().enumerate() {
            // SAFETY: within the rows and columns the caller owns.
            unsafe {
                let o = out.add((i + r) * width + c);
                *o = if accumulate { *o + v } else { *v };
            }
        }
    }
}

/// [`super::product`] of a k-quant `f` by [`rows_k_avx512`], [`ROWS`] activation rows a call
/// (the caller sends fewer than [`super::K_PANEL_ROWS`]).
///
/// # Safety
/// The CPU has AVX-512 F and BW, AVX2, FMA and F16C; `out` is valid for writes of `x.rows()`
/// rows of `width` values, and no other thread touches these columns meanwhile.
pub(super) unsafe fn product(
    f: super::Format,
    x: &Q8Rows,
    w: &[u8],
    cols: std::ops::Range<usize>,
    out: *mut f32,
    width: usize,
    accumulate: bool,
) {
    #[cfg(target_arch = "x86_64")]
    for i in (0..x.rows()).step_by(ROWS) {
        let cols = cols.clone();
        macro_rules! by_rows {
            ($f:expr) => {
                // SAFETY: the caller's guarantees.
                unsafe {
                    match x.rows() - i {
                        1 => rows_k_avx512::<$f, 1>(w, x, i, cols, out, width, accumulate),
                        2 => rows_k_avx512::<$f, 2>(w, x, i, cols, out, width, accumulate),
                        3 => rows_k_avx512::<$f, 3>(w, x, i, cols, out, width, accumulate),
                        4 => rows_k_avx512::<$f, 4>(w, x, i, cols, out, width, accumulate),
                        5 => rows_k_avx512::<$f, 5>(w, x, i, cols, out, width, accumulate),
                        6 => rows_k_avx512::<$f, 6>(w, x, i, cols, out, width, accumulate),
                        7 => rows_k_avx512::<$f, 7>(w, x, i, cols, out, width, accumulate),
                        _ => rows_k_avx512::<$f, 8>(w, x, i, cols, out, width, accumulate),
                    }
                }
            };
        }
        match f {
            super::Format::Q4K => by_rows!(Q4K),
            super::Format::Q5K => by_rows!(Q5K),
            _ => by_rows!(Q6K),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (f, w, cols, out, width, accumulate);
        unreachable!("AVX-512 is never detected off x86-64")
    }
}

/// Whether this CPU multiplies the k-quants by [`product`]: AVX-512 F and BW besides the AVX2
/// build's AVX2, FMA and F16C.
pub(super) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let c = crate::cpu::caps();
        super::isa() != super::Isa::Scalar && c.avx512f && c.avx512bw
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

#[cfg(test)]
mod tests {
    use super::super::panel::{Repack, PANEL};
    use super::super::panel_k::{tile_scalar, KPanels};
    use super::super::tests::{assert_products, val, weights};
    use super::super::Format;
    use super::*;

    /// Every row count up to two calls' worth, each format: the k-quant panels' scalar
    /// arithmetic bit for bit (so a row's bits do not depend on its step's size), accumulation
    /// included; and that arithmetic is the dequantized product within the 8-bit bound.
    #[test]
    fn rows_are_the_k_panels_arithmetic_bit_for_bit() {
        if !available() {
            eprintln!("no AVX-512 BW: the k-quants' few-row kernel is not run here");
            return;
        }
        let (n, k) = (PANEL + 3, 3 * SUPER);
        for f in [Format::Q4K, Format::Q5K, Format::Q6K] {
            let (w, deq) = weights(f, n, k);
            let mut pan = KPanels::default();
            pan.repack(f, &w, n, k);
            for rows in 1..=ROWS + 2 {
                let xs: Vec<f32> = (0..rows * k)
                    .map(|i| val(i + 7 * rows) * (1 + i % 3) as f32)
                    .collect();
                let x = Q8Rows::for_format(f, &xs, rows, k);
                let start: Vec<f32> = (0..rows * n).map(|i| val(i + 1)).collect();
                let mut out = start.clone();
                let row = f.row_bytes(k);
                let mid = 5;
                for cols in [0..mid, mid..n] {
                    let w = &w[cols.start * row..cols.end * row];
                    // SAFETY: `available()`; `out` holds every row and column.
                    unsafe { product(f, &x, w, cols, out.as_mut_ptr(), n, true) };
                }
                let mut fresh = vec![f32::NAN; rows * n];
                // SAFETY: as above.
                unsafe { product(f, &x, &w, 0..n, fresh.as_mut_ptr(), n, false) };
                assert_products(f, &x, &xs, &deq, &fresh, n);
                for p in 0..n.div_ceil(PANEL) {
                    let lanes = (n - p * PANEL).min(PANEL);
                    let want = match f {
                        Format::Q4K => tile_scalar::<Q4K>(&pan, p, &x, 0, rows),
                        Format::Q5K => tile_scalar::<Q5K>(&pan, p, &x, 0, rows),
                        _ => tile_scalar::<Q6K>(&pan, p, &x, 0, rows),
                    };
                    for (i, v) in want.iter().enumerate() {
                        for (lane, v) in v[..lanes].iter().enumerate() {
                            let at = i * n + p * PANEL + lane;
                            let (a, b) = (fresh[at], *v);
                            assert_eq!(
                                a.to_bits(),
                                b.to_bits(),
                                "{f:?} {rows} rows, {at}: {a} vs {b}"
                            );
                            let (a, b) = (out[at], start[at] + v);
                            assert_eq!(
                                a.to_bits(),
                                b.to_bits(),
                                "{f:?} {rows} rows, {at} added: {a} vs {b}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// The word-wise unpacking gives `scale_min_k4`'s scales and minimums for every sub-block.
    #[test]
    fn k4_scales_unpack_as_the_bytewise_reference() {
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..2000 {
            let mut s = [0u8; 12];
            for b in &mut s {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                *b = seed as u8;
            }
            let got = scales_mins_k4(&s);
            for j in 0..8 {
                let (sc, m) = super::super::k::scale_min_k4(j, &s);
                assert_eq!((got[j], got[8 + j]), (sc, m), "sub-block {j} of {s:?}");
            }
        }
    }
}
