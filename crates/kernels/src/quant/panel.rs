//! The 32-wide formats (q4_0, q4_1, q8_0) over many activation rows on CPUs with AVX-512
//! VNNI: weight rows repacked, per product, into panels of [`PANEL`] rows whose values lie
//! four bytes of each row after four of the next, so that one 512-bit `vpdpbusd` multiplies
//! four values of sixteen weight rows with the same four values of one activation row
//! (broadcast), and a block's integer dot products for sixteen weight rows land in one
//! register's sixteen lanes, each the block's exact sum. A block then costs one conversion,
//! one scale product and one fused multiply-add per activation row for all sixteen weight rows,
//! where the tiled kernels of [`super::block32`] spend as much per weight row: at a decode
//! step of sixteen rows or a prefill, the integer products are no longer the smaller part.
//!
//! `vpdpbusd` multiplies unsigned bytes with signed ones: the weights go unsigned (Q4_0's and
//! Q4_1's nibbles as stored, Q8_0's bytes plus 128) and each block's sum starts from minus the
//! offset times the activation block's sum, exact in integers (at most 32·255·127 < 2²¹).
//!
//! Each output is `Σ_b float(Σ q_w·q_x)·(d_w·d_x)` in block order, one fused multiply-add a
//! block (Q4_1 adds `Σ_b m_w·s_x`, summed apart), the same 8-bit activations as the tiled
//! kernels but another order of the float sums: within the same bound of the dequantized
//! product, not bit-equal to the tiled kernels. [`tile_scalar`] is this arithmetic in portable
//! Rust, bit for bit (tested).
//!
//! The panels are made anew by every product (weights stay in their GGUF blocks, the memory
//! they are counted at): a repack reads the block once more, by vector transposes, and costs
//! less than the products it saves from [`MIN_ROWS`] activation rows (`bench decode --gguf`,
//! one core, SmolLM2 Q8_0: 281 tok/s at batch 4 by panels against 207 tiled; at batch 1 the
//! tiled kernel's weight-row tiles stay well ahead, 179 against 81 for a lone row by panels).

use super::{f16_at, Format, Q8Rows, BLOCK, Q4_0, Q4_1, Q8_0};

/// Weight rows a panel interleaves: the sixteen 32-bit lanes of an AVX-512 register.
pub(super) const PANEL: usize = 16;
/// Activation rows that meet a panel's block at once: their accumulators, the block's eight
/// registers of values and its scales fit AVX-512's thirty-two registers.
pub(super) const ROWS: usize = 8;
/// Activation rows from which a product takes the panels.
pub(super) const MIN_ROWS: usize = 4;
/// Bytes of one block of a panel: 32 values of each of its sixteen rows.
const PANEL_BLOCK: usize = BLOCK * PANEL;

/// Whether this CPU multiplies format `f` by panels.
pub(super) fn available(f: Format) -> bool {
    f.block_values() == BLOCK && cpu_has()
}

/// Whether the CPU has what panels take: AVX-512 F, BW and VNNI.
pub(super) fn cpu_has() -> bool {
    let c = crate::cpu::caps();
    c.avx512f && c.avx512bw && c.avx512vnni
}

/// Weight rows repacked into panels (see the module).
#[derive(Default)]
pub(super) struct Panels {
    /// Per panel, per block: eight groups of four values, each group the four values of its
    /// sixteen rows side by side (`[(p·nb + b)·8 + g][row][4]`), unsigned.
    values: Vec<u8>,
    /// Per panel, per block: the sixteen rows' scales (`[(p·nb + b)·16 + row]`; 0 for the
    /// rows past the last).
    scales: Vec<f32>,
    /// As `scales`, Q4_1's minimums.
    mins: Vec<f32>,
    /// Blocks per row.
    nb: usize,
}

impl Panels {
    /// Repacks `rows` weight rows of `nb` blocks of format `F` from `w` (row-major blocks).
    fn fill<const F: u8>(&mut self, w: &[u8], rows: usize, nb: usize) {
        let bb = [18, 20, 34][F as usize];
        assert!(w.len() >= rows * nb * bb, "weight rows missing");
        let panels = rows.div_ceil(PANEL);
        self.nb = nb;
        // Rows past the last stay zero: their lanes are computed and never stored.
        self.values.clear();
        self.values.resize(panels * nb * PANEL_BLOCK, 0);
        self.scales.clear();
        self.scales.resize(panels * nb * PANEL, 0.0);
        self.mins.clear();
        if F == Q4_1 {
            self.mins.resize(panels * nb * PANEL, 0.0);
        }
        // Whole panels by vector transposes where the CPU has AVX2 (eight weight rows' blocks
        // at a time); the last, partial one value by value.
        let mut whole = 0;
        #[cfg(target_arch = "x86_64")]
        if crate::cpu::caps().avx2 {
            whole = rows / PANEL;
            for p in 0..whole {
                // SAFETY: the CPU has AVX2; panel `p`'s rows lie within `w` (asserted above).
                unsafe { self.fill_panel_avx2::<F>(&w[p * PANEL * nb * bb..], p, bb) };
            }
        }
        for (c, row) in w
            .chunks_exact(nb * bb)
            .take(rows)
            .enumerate()
            .skip(whole * PANEL)
        {
            let (p, lane) = (c / PANEL, c % PANEL);
            for (b, blk) in row.chunks_exact(bb).enumerate() {
                let at = (p * nb + b) * PANEL;
                self.scales[at + lane] = f16_at(blk);
                let groups = &mut self.values[(p * nb + b) * PANEL_BLOCK..][..PANEL_BLOCK];
                let mut put = |g: usize, v: u32| {
                    groups[(g * PANEL + lane) * 4..][..4].copy_from_slice(&v.to_le_bytes());
                };
                let word = |at: usize| {
                    u32::from_le_bytes([blk[at], blk[at + 1], blk[at + 2], blk[at + 3]])
                };
                match F {
                    // Signed bytes plus 128: the sign bit flipped.
                    Q8_0 => (0..8).for_each(|g| put(g, word(2 + 4 * g) ^ 0x8080_8080)),
                    _ => {
                        let from = if F == Q4_1 {
                            self.mins[at + lane] = f16_at(&blk[2..]);
                            4
                        } else {
                            2
                        };
                        // Values 0..16 are the low nibbles of the 16 bytes, 16..32 the high.
                        for g in 0..4 {
                            let v = word(from + 4 * g);
                            put(g, v & 0x0F0F_0F0F);
                            put(g + 4, (v >> 4) & 0x0F0F_0F0F);
                        }
                    }
                }
            }
        }
    }
}

impl Panels {
    /// Panel `p` from its sixteen weight rows at the start of `w` (blocks of `bb` bytes): per
    /// block, each row's 32 values unpacked to unsigned bytes (one 256-bit register), then
    /// the eight rows' registers of each half of the panel transposed as eight by eight
    /// 32-bit words, so that word `g` of every row lands in group `g`.
    ///
    /// # Safety
    /// The CPU has AVX2; `w` holds sixteen rows of `self.nb` blocks; the panels are sized.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn fill_panel_avx2<const F: u8>(&mut self, w: &[u8], p: usize, bb: usize) {
        use std::arch::x86_64::*;
        let nb = self.nb;
        assert!(
            w.len() >= PANEL * nb * bb && self.values.len() >= (p + 1) * nb * PANEL_BLOCK,
            "out of bounds"
        );
        let (low, flip) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(-128));
        // The next panel's rows follow these sixteen: read them ahead at the pace these are
        // read, as the hardware prefetchers follow sixteen interleaved streams poorly (the
        // weights come from DRAM: a decode step reads the whole model).
        let next = w.as_ptr().wrapping_add(PANEL * nb * bb);
        let lines = (PANEL * bb).div_ceil(64);
        for b in 0..nb {
            for l in 0..lines {
                let at = next.wrapping_add((b * lines + l) * 64);
                _mm_prefetch::<_MM_HINT_T0>(at as *const i8);
            }
            let at = (p * nb + b) * PANEL;
            for lane in 0..PANEL {
                let blk = &w[(lane * nb + b) * bb..][..bb];
                self.scales[at + lane] = f16_at(blk);
                if F == Q4_1 {
                    self.mins[at + lane] = f16_at(&blk[2..]);
                }
            }
            let dst = self.values[(p * nb + b) * PANEL_BLOCK..].as_mut_ptr();
            for half in 0..2 {
                // A loop, not `from_fn`: a closure would not be compiled for AVX2.
                let mut r = [_mm256_setzero_si256(); 8];
                for (j, r) in r.iter_mut().enumerate() {
                    let blk = w[((half * 8 + j) * nb + b) * bb..].as_ptr();
                    // SAFETY: a whole block at `blk` (asserted above).
                    *r = unsafe {
                        match F {
                            Q8_0 => _mm256_xor_si256(
                                _mm256_loadu_si256(blk.add(2) as *const __m256i),
                                flip,
                            ),
                            _ => {
                                let from = if F == Q4_1 { 4 } else { 2 };
                                let nib = _mm_loadu_si128(blk.add(from) as *const __m128i);
                                // Values 0..16 from the low nibbles, 16..32 from the high.
                                _mm256_and_si256(low, _mm256_set_m128i(_mm_srli_epi16(nib, 4), nib))
                            }
                        }
                    };
                }
                // SAFETY: the CPU has AVX2; this block's eight groups lie within the panels.
                unsafe { transpose_store(&r, dst, half) };
            }
        }
    }
}

/// Eight weight rows' 32 values of one block (`r`, unsigned bytes), transposed as eight by
/// eight 32-bit words into half `half` (lanes 0..8 or 8..16) of the block's eight groups at
/// `dst`: word `g` of every row lands in group `g`.
///
/// # Safety
/// The CPU has AVX2; `dst` is valid for writes of eight groups of [`PANEL`] words.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn transpose_store(
    r: &[std::arch::x86_64::__m256i; 8],
    dst: *mut u8,
    half: usize,
) {
    use std::arch::x86_64::*;
    // Pairs of rows: t[2i] their words 0,1 (low half) and 4,5 (high half) side by
    // side, t[2i + 1] words 2,3 and 6,7.
    let mut t = [_mm256_setzero_si256(); 8];
    for i in 0..4 {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    // Quads of rows: rows 4q..4q + 4 of word g (low half) and g + 4 (high half),
    // g = 2w + hi.
    for g in 0..4 {
        let (w, hi) = (g / 2, g % 2 == 1);
        let mut quads = [_mm256_setzero_si256(); 2];
        for (q, v) in quads.iter_mut().enumerate() {
            let (a, b) = (t[4 * q + w], t[4 * q + w + 2]);
            *v = if hi {
                _mm256_unpackhi_epi64(a, b)
            } else {
                _mm256_unpacklo_epi64(a, b)
            };
        }
        let lo = _mm256_permute2x128_si256::<0x20>(quads[0], quads[1]);
        let up = _mm256_permute2x128_si256::<0x31>(quads[0], quads[1]);
        // SAFETY: groups g and g + 4 of this block lie within the panels.
        unsafe {
            _mm256_storeu_si256(dst.add(g * 64 + half * 32) as *mut __m256i, lo);
            _mm256_storeu_si256(dst.add((g + 4) * 64 + half * 32) as *mut __m256i, up);
        }
    }
}

/// What a block's unsigned weights exceed its values by: the sums start from minus this times
/// the activations' sum.
const fn offset<const F: u8>() -> i32 {
    match F {
        Q8_0 => 128,
        Q4_0 => 8,
        _ => 0,
    }
}

thread_local! {
    /// Each thread's panels, reused from product to product.
    pub(super) static SCRATCH: std::cell::RefCell<Panels> = std::cell::RefCell::new(Panels::default());
}

/// Weight rows repacked for products by panels: [`Panels`] (the 32-wide formats) and the
/// k-quants' [`super::panel_k::KPanels`].
pub(super) trait Repack: 'static {
    /// Repacks `rows` weight rows of `k` values of format `f` from `w`.
    fn repack(&mut self, f: Format, w: &[u8], rows: usize, k: usize);

    /// Activation rows `i..i + r` (`r` ≤ [`ROWS`]) · panel `p`: per row, the sixteen lanes.
    ///
    /// # Safety
    /// The CPU has AVX-512 F, BW and VNNI.
    unsafe fn tile(
        &self,
        f: Format,
        p: usize,
        x: &Q8Rows,
        i: usize,
        r: usize,
    ) -> [[f32; PANEL]; ROWS];
}

impl Repack for Panels {
    fn repack(&mut self, f: Format, w: &[u8], rows: usize, k: usize) {
        match f {
            Format::Q4_0 => self.fill::<Q4_0>(w, rows, k / BLOCK),
            Format::Q4_1 => self.fill::<Q4_1>(w, rows, k / BLOCK),
            _ => self.fill::<Q8_0>(w, rows, k / BLOCK),
        }
    }

    unsafe fn tile(
        &self,
        f: Format,
        p: usize,
        x: &Q8Rows,
        i: usize,
        r: usize,
    ) -> [[f32; PANEL]; ROWS] {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's guarantee: the CPU has AVX-512 F, BW and VNNI.
        unsafe {
            match f {
                Format::Q4_0 => by_rows!(tile_avx512, Q4_0, r, self, p, x, i),
                Format::Q4_1 => by_rows!(tile_avx512, Q4_1, r, self, p, x, i),
                _ => by_rows!(tile_avx512, Q8_0, r, self, p, x, i),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (f, p, x, i, r);
            unreachable!("panels are never available off x86-64")
        }
    }
}

/// `$run::<$f, R>($args)` for `R` = `$r` (1..=[`ROWS`]), widened to a whole tile.
macro_rules! by_rows {
    ($run:ident, $f:expr, $r:expr, $($args:expr),*) => {
        match $r {
            1 => widen($run::<$f, 1>($($args),*)),
            2 => widen($run::<$f, 2>($($args),*)),
            3 => widen($run::<$f, 3>($($args),*)),
            4 => widen($run::<$f, 4>($($args),*)),
            5 => widen($run::<$f, 5>($($args),*)),
            6 => widen($run::<$f, 6>($($args),*)),
            7 => widen($run::<$f, 7>($($args),*)),
            _ => widen($run::<$f, 8>($($args),*)),
        }
    };
}
pub(super) use by_rows;

/// [`super::product`] by panels, repacked into the thread's `scratch` ([`SCRATCH`], or the
/// k-quants' `panel_k::SCRATCH`): `out[i·width + c]` (added to when `accumulate`) = row `i` of
/// `x` · weight row `c` for every column of `cols`, whose rows `w` holds. Each panel meets
/// every tile of activation rows while it is in cache.
///
/// # Safety
/// `scratch`'s panels are available for `f` ([`available`], `panel_k::available`); `out` is
/// valid for writes of `x.rows()` rows of `width` values, and no other thread touches these
/// columns meanwhile.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn product_by<P: Repack>(
    scratch: &'static std::thread::LocalKey<std::cell::RefCell<P>>,
    f: Format,
    x: &Q8Rows,
    w: &[u8],
    cols: std::ops::Range<usize>,
    out: *mut f32,
    width: usize,
    accumulate: bool,
) {
    scratch.with_borrow_mut(|pan| {
        pan.repack(f, w, cols.len(), x.k);
        let rows = x.rows();
        for p in 0..cols.len().div_ceil(PANEL) {
            let c0 = cols.start + p * PANEL;
            let lanes = (cols.end - c0).min(PANEL);
            for i in (0..rows).step_by(ROWS) {
                let r = (rows - i).min(ROWS);
                // SAFETY: the caller's guarantees.
                let v = unsafe { pan.tile(f, p, x, i, r) };
                for (dr, v) in v[..r].iter().enumerate() {
                    for (lane, v) in v[..lanes].iter().enumerate() {
                        // SAFETY: within the rows and columns the caller owns.
                        unsafe {
                            let o = out.add((i + dr) * width + c0 + lane);
                            *o = if accumulate { *o + v } else { *v };
                        }
                    }
                }
            }
        }
    });
}

/// `R` rows of lanes in the first `R` of a tile.
pub(super) fn widen<const R: usize>(v: [[f32; PANEL]; R]) -> [[f32; PANEL]; ROWS] {
    let mut out = [[0f32; PANEL]; ROWS];
    out[..R].copy_from_slice(&v);
    out
}

/// [`tile`] with AVX-512 F, BW and VNNI.
///
/// # Safety
/// The CPU has them.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
// `b` indexes the panel's blocks and the rows' scales and sums at once.
#[allow(clippy::needless_range_loop)]
unsafe fn tile_avx512<const F: u8, const R: usize>(
    pan: &Panels,
    p: usize,
    x: &Q8Rows,
    i: usize,
) -> [[f32; PANEL]; R] {
    use std::arch::x86_64::*;
    let nb = pan.nb;
    assert!(
        x.k == nb * BLOCK
            && pan.values.len() >= (p + 1) * nb * PANEL_BLOCK
            && pan.scales.len() >= (p + 1) * nb * PANEL
            && (F != Q4_1 || pan.mins.len() >= (p + 1) * nb * PANEL)
            && x.qs.len() >= (i + R) * x.k
            && x.d.len() >= (i + R) * nb
            && x.sums.len() >= (i + R) * nb,
        "out of bounds"
    );
    let values = pan.values[p * nb * PANEL_BLOCK..].as_ptr();
    let scales = pan.scales[p * nb * PANEL..].as_ptr();
    let mins = if F == Q4_1 {
        pan.mins[p * nb * PANEL..].as_ptr()
    } else {
        scales
    };
    let qs: [*const u8; R] = std::array::from_fn(|r| x.qs[(i + r) * x.k..].as_ptr() as *const u8);
    let mut acc = [_mm512_setzero_ps(); R];
    let mut accm = [_mm512_setzero_ps(); R];
    for b in 0..nb {
        // SAFETY: panel `p`'s block `b` lies within the panels (asserted above).
        let (wv, dw) = unsafe {
            let at = values.add(b * PANEL_BLOCK);
            let wv: [__m512i; 8] =
                std::array::from_fn(|g| _mm512_loadu_si512(at.add(g * 64) as *const _));
            (wv, _mm512_loadu_ps(scales.add(b * PANEL)))
        };
        // SAFETY: as above (Q4_1's minimums; unused otherwise).
        let mw = unsafe { _mm512_loadu_ps(mins.add(b * PANEL)) };
        for r in 0..R {
            let row = (i + r) * nb + b;
            let mut s = _mm512_set1_epi32(-offset::<F>() * x.sums[row]);
            for (g, wv) in wv.iter().enumerate() {
                // SAFETY: block `b` of row `i + r` lies within `x.qs` (asserted above).
                let xq =
                    unsafe { std::ptr::read_unaligned(qs[r].add(b * BLOCK + 4 * g) as *const i32) };
                s = _mm512_dpbusd_epi32(s, *wv, _mm512_set1_epi32(xq));
            }
            let dx = x.d[row];
            let scale = _mm512_mul_ps(dw, _mm512_set1_ps(dx));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[r]);
            if F == Q4_1 {
                // The block's scale times its sum, as `Q8Rows::s` holds it.
                let s = dx * x.sums[row] as f32;
                accm[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(s), accm[r]);
            }
        }
    }
    let mut out = [[0f32; PANEL]; R];
    for r in 0..R {
        let v = if F == Q4_1 {
            _mm512_add_ps(acc[r], accm[r])
        } else {
            acc[r]
        };
        // SAFETY: `out[r]` holds sixteen floats.
        unsafe { _mm512_storeu_ps(out[r].as_mut_ptr(), v) };
    }
    out
}

/// [`tile_avx512`]'s arithmetic in portable Rust, bit for bit: each lane's block sums in
/// integers, then one fused multiply-add a block in block order.
#[cfg(test)]
fn tile_scalar<const F: u8>(
    pan: &Panels,
    p: usize,
    x: &Q8Rows,
    i: usize,
    r: usize,
) -> Vec<[f32; PANEL]> {
    let nb = pan.nb;
    (i..i + r)
        .map(|row| {
            std::array::from_fn(|lane| {
                let (mut acc, mut accm) = (0f32, 0f32);
                for b in 0..nb {
                    let at = (p * nb + b) * PANEL + lane;
                    let mut s = -offset::<F>() * x.sums[row * nb + b];
                    for g in 0..8 {
                        let w =
                            &pan.values[(p * nb + b) * PANEL_BLOCK + (g * PANEL + lane) * 4..][..4];
                        let xq = &x.qs[row * x.k + b * BLOCK + 4 * g..][..4];
                        s += w
                            .iter()
                            .zip(xq)
                            .map(|(&w, &x)| w as i32 * x as i32)
                            .sum::<i32>();
                    }
                    let dx = x.d[row * nb + b];
                    acc = (s as f32).mul_add(pan.scales[at] * dx, acc);
                    if F == Q4_1 {
                        accm = pan.mins[at].mul_add(dx * x.sums[row * nb + b] as f32, accm);
                    }
                }
                if F == Q4_1 {
                    acc + accm
                } else {
                    acc
                }
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::tests::{assert_products, val, weights};
    use super::*;

    /// [`tile_scalar`] of the first `rows` rows of `x` with panel `p` of format `f`.
    fn scalar(f: Format, pan: &Panels, p: usize, x: &Q8Rows, rows: usize) -> Vec<[f32; PANEL]> {
        match f {
            Format::Q4_0 => tile_scalar::<Q4_0>(pan, p, x, 0, rows),
            Format::Q4_1 => tile_scalar::<Q4_1>(pan, p, x, 0, rows),
            _ => tile_scalar::<Q8_0>(pan, p, x, 0, rows),
        }
    }

    /// The panels give [`tile_scalar`]'s arithmetic bit for bit, for every row count of a tile
    /// and a last panel of fewer rows; and that arithmetic is the dequantized product within
    /// the 8-bit activations' bound (d/2 per value).
    #[test]
    fn panels_are_their_scalar_arithmetic_and_within_the_bound() {
        let (n, t) = (PANEL + 5, 2 * ROWS + 3);
        for f in [Format::Q4_0, Format::Q4_1, Format::Q8_0] {
            let k = 4 * BLOCK;
            let (w, deq) = weights(f, n, k);
            let xs: Vec<f32> = (0..t * k)
                .map(|i| val(i + 3) * (1 + i % 5) as f32)
                .collect();
            let x = Q8Rows::for_format(f, &xs, t, k);
            let mut pan = Panels::default();
            pan.repack(f, &w, n, k);
            let mut want = vec![0f32; t * n];
            for p in 0..n.div_ceil(PANEL) {
                let lanes = (n - p * PANEL).min(PANEL);
                let v = scalar(f, &pan, p, &x, t);
                for (i, v) in v.iter().enumerate() {
                    want[i * n + p * PANEL..][..lanes].copy_from_slice(&v[..lanes]);
                }
            }
            assert_products(f, &x, &xs, &deq, &want, n);
            if !available(f) {
                eprintln!("no AVX-512 VNNI: the panels' scalar arithmetic alone is checked");
                continue;
            }
            // Every row count of a tile, through the product (two column blocks, accumulated
            // onto a start that is then taken off, as the tiled kernels' test does).
            for rows in 1..=t {
                let x = Q8Rows::for_format(f, &xs, rows, k);
                let mut out: Vec<f32> = (0..rows * n).map(val).collect();
                let mid = PANEL + 2;
                let row = f.row_bytes(k);
                for cols in [0..mid, mid..n] {
                    let w = &w[cols.start * row..cols.end * row];
                    // SAFETY: `available(f)`; `out` holds every row and column.
                    unsafe { product_by(&SCRATCH, f, &x, w, cols, out.as_mut_ptr(), n, true) };
                }
                let mut pan = Panels::default();
                let mut want = vec![0f32; rows * n];
                for cols in [0..mid, mid..n] {
                    let w = &w[cols.start * row..cols.end * row];
                    pan.repack(f, w, cols.len(), k);
                    for p in 0..cols.len().div_ceil(PANEL) {
                        let lanes = (cols.len() - p * PANEL).min(PANEL);
                        let v = scalar(f, &pan, p, &x, rows);
                        for (i, v) in v.iter().enumerate() {
                            let at = i * n + cols.start + p * PANEL;
                            for (lane, v) in v[..lanes].iter().enumerate() {
                                want[at + lane] = val(at + lane) + v;
                            }
                        }
                    }
                }
                for (e, (a, b)) in out.iter().zip(&want).enumerate() {
                    assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "{f:?} {rows} rows, value {e}: {a} vs {b}"
                    );
                }
            }
        }
    }
}
