//! The k-quants (q4_K, q5_K, q6_K) by panels: [`super::panel`]'s layout and `vpdpbusd` per
//! sub-block of 32 values, each sub-block's sixteen lanes of exact sums weighted by their
//! integer scales (`vpmulld`) and summed in integers over the super-block, which meets the
//! float scales once per activation row: `d·dx·Σ sc·Σ q·x − dmin·dx·Σ m·Σx`, as the tiled
//! k-quant kernel sums, in one lane per weight row.
//!
//! q4_K and q5_K values are unsigned as stored (0..16, 0..32). q6_K's (−32..32) go unsigned
//! plus 32; with a scale per 16 values, each half of a sub-block sums on its own, from minus
//! 32 times the activations' sum over those 16 ([`super::Q8Rows`] keeps it for rows scaled
//! per 256). Exact in 32 bits: at most 8·32·31·127·63 < 2²⁶ (q5_K), 16·16·32·127·128 < 2²⁸
//! (q6_K).
//!
//! The float sums run in another order than the tiled kernel's (one fused multiply-add per
//! super-block and row, in order): [`tile_scalar`] is this arithmetic bit for bit. One core,
//! a random 1024-wide Q4_K_M model (`scripts/make-wide-gguf.py`): a 158-token prefill 448 →
//! 1296 prompt tokens/s, batch-16 decode 270 → 511 tok/s, batch 4 about even (186 against
//! 193: the repack's scales are unpacked row by row), so steps of fewer rows than
//! [`super::K_PANEL_ROWS`] take [`super::k_row`] (408 tok/s at 4), which reads the blocks in
//! place in this arithmetic.

use super::k::k_vectors;
use super::k::{k_block_bytes, k_ints, k_values};
use super::panel::{by_rows, cpu_has, widen, Repack, PANEL, ROWS};
use super::{Format, Q8Rows, BLOCK, Q4K, Q5K, Q6K, SUPER};

/// Sub-blocks of 32 values in a super-block.
const SUBS: usize = SUPER / BLOCK;
/// Bytes of one sub-block of a panel: 32 values of each of its sixteen rows.
const SUB_BYTES: usize = BLOCK * PANEL;

/// Whether this CPU multiplies format `f` by k-quant panels.
pub(super) fn available(f: Format) -> bool {
    f.block_values() == SUPER && cpu_has()
}

/// Weight rows of a k-quant repacked into panels.
#[derive(Default)]
pub(super) struct KPanels {
    /// Per panel, super-block and sub-block: eight groups of four values of the sixteen rows
    /// (`[((p·ns + s)·8 + c)·8 + g][row][4]`), unsigned.
    values: Vec<u8>,
    /// Per panel and super-block: the rows' `d` (`[(p·ns + s)·16 + row]`).
    d: Vec<f32>,
    /// As `d`, the rows' `dmin` (0 for q6_K).
    dmin: Vec<f32>,
    /// Per panel, super-block and 16 values: the rows' integer scales
    /// (`[((p·ns + s)·16 + j)·16 + row]`).
    sc: Vec<i32>,
    /// Per panel, super-block and sub-block: the rows' integer minimums.
    mn: Vec<i32>,
    /// Super-blocks per row.
    ns: usize,
}

impl KPanels {
    /// Repacks `rows` weight rows of `ns` super-blocks of format `F` from `w`.
    fn fill<const F: u8>(&mut self, w: &[u8], rows: usize, ns: usize) {
        let bb = k_block_bytes::<F>();
        assert!(w.len() >= rows * ns * bb, "weight rows missing");
        let panels = rows.div_ceil(PANEL);
        self.ns = ns;
        let resize = |v: &mut Vec<i32>, n: usize| {
            v.clear();
            v.resize(n, 0);
        };
        self.values.clear();
        self.values.resize(panels * ns * SUBS * SUB_BYTES, 0);
        self.d.clear();
        self.d.resize(panels * ns * PANEL, 0.0);
        self.dmin.clear();
        self.dmin.resize(panels * ns * PANEL, 0.0);
        resize(&mut self.sc, panels * ns * 16 * PANEL);
        resize(&mut self.mn, panels * ns * SUBS * PANEL);
        let off = if F == Q6K { 32 } else { 0 };
        // Whole panels' values by vector transposes where the CPU has AVX2; the last, partial
        // one value by value.
        let mut whole = 0;
        #[cfg(target_arch = "x86_64")]
        if crate::cpu::caps().avx2 {
            whole = rows / PANEL;
            for p in 0..whole {
                // SAFETY: the CPU has AVX2; panel `p`'s rows lie within `w` (asserted above).
                unsafe { self.fill_panel_avx2::<F>(&w[p * PANEL * ns * bb..], p) };
            }
        }
        for (row, blocks) in w.chunks_exact(ns * bb).take(rows).enumerate() {
            let (p, lane) = (row / PANEL, row % PANEL);
            for (s, blk) in blocks.chunks_exact(bb).enumerate() {
                let base = p * ns + s;
                let (sc, mn, d, dmin) = k_ints::<F>(blk);
                self.d[base * PANEL + lane] = d;
                self.dmin[base * PANEL + lane] = dmin;
                for (j, &v) in sc.iter().enumerate() {
                    self.sc[(base * 16 + j) * PANEL + lane] = v as i32;
                }
                for (c, &v) in mn.iter().enumerate() {
                    self.mn[(base * SUBS + c) * PANEL + lane] = v as i32;
                }
                if p < whole {
                    continue;
                }
                for (v, &q) in k_values::<F>(blk).iter().enumerate() {
                    let (c, g, e) = (v / BLOCK, v % BLOCK / 4, v % 4);
                    self.values[(base * SUBS + c) * SUB_BYTES + (g * PANEL + lane) * 4 + e] =
                        (q + off) as u8;
                }
            }
        }
    }

    /// Panel `p`'s values from its sixteen weight rows at the start of `w`: per super-block,
    /// each row's eight sub-blocks unpacked to bytes (`k_vectors`), then eight rows at a time
    /// transposed into the sub-blocks' groups ([`super::panel::transpose_store`]).
    ///
    /// # Safety
    /// The CPU has AVX2; `w` holds sixteen rows of `self.ns` super-blocks; the panels are
    /// sized.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    // `c` indexes the sub-block of every row's unpacked values and of the panel at once.
    #[allow(clippy::needless_range_loop)]
    unsafe fn fill_panel_avx2<const F: u8>(&mut self, w: &[u8], p: usize) {
        use std::arch::x86_64::*;
        let (ns, bb) = (self.ns, k_block_bytes::<F>());
        assert!(
            w.len() >= PANEL * ns * bb && self.values.len() >= (p + 1) * ns * SUBS * SUB_BYTES,
            "out of bounds"
        );
        let off = _mm256_set1_epi8(if F == Q6K { 32 } else { 0 });
        // The next panel's rows, read ahead at the pace these are read (see `Panels`).
        let next = w.as_ptr().wrapping_add(PANEL * ns * bb);
        let lines = (PANEL * bb).div_ceil(64);
        for s in 0..ns {
            for l in 0..lines {
                _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add((s * lines + l) * 64) as *const i8);
            }
            let base = p * ns + s;
            for half in 0..2 {
                let mut vals = [[_mm256_setzero_si256(); SUBS]; 8];
                for (j, v) in vals.iter_mut().enumerate() {
                    let blk = &w[((half * 8 + j) * ns + s) * bb..][..bb];
                    // SAFETY: the CPU has AVX2; `blk` is a whole super-block.
                    *v = unsafe { k_vectors::<F>(blk) };
                }
                for c in 0..SUBS {
                    let mut r = [_mm256_setzero_si256(); 8];
                    for (j, r) in r.iter_mut().enumerate() {
                        *r = _mm256_add_epi8(vals[j][c], off);
                    }
                    let dst = self.values[(base * SUBS + c) * SUB_BYTES..].as_mut_ptr();
                    // SAFETY: the CPU has AVX2; the sub-block's groups lie within the panels.
                    unsafe { super::panel::transpose_store(&r, dst, half) };
                }
            }
        }
    }
}

thread_local! {
    /// Each thread's panels, reused from product to product.
    pub(super) static SCRATCH: std::cell::RefCell<KPanels> = std::cell::RefCell::new(KPanels::default());
}

impl Repack for KPanels {
    fn repack(&mut self, f: Format, w: &[u8], rows: usize, k: usize) {
        match f {
            Format::Q4K => self.fill::<Q4K>(w, rows, k / SUPER),
            Format::Q5K => self.fill::<Q5K>(w, rows, k / SUPER),
            _ => self.fill::<Q6K>(w, rows, k / SUPER),
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
                Format::Q4K => by_rows!(tile_avx512, Q4K, r, self, p, x, i),
                Format::Q5K => by_rows!(tile_avx512, Q5K, r, self, p, x, i),
                _ => by_rows!(tile_avx512, Q6K, r, self, p, x, i),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (f, p, x, i, r);
            unreachable!("panels are never available off x86-64")
        }
    }
}

/// [`tile`] with AVX-512 F, BW and VNNI.
///
/// # Safety
/// The CPU has them.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[allow(clippy::needless_range_loop)]
unsafe fn tile_avx512<const F: u8, const R: usize>(
    pan: &KPanels,
    p: usize,
    x: &Q8Rows,
    i: usize,
) -> [[f32; PANEL]; R] {
    use std::arch::x86_64::*;
    let (ns, nb) = (pan.ns, x.k / BLOCK);
    assert!(
        x.per == SUPER
            && x.k == ns * SUPER
            && pan.values.len() >= (p + 1) * ns * SUBS * SUB_BYTES
            && pan.sc.len() >= (p + 1) * ns * 16 * PANEL
            && pan.mn.len() >= (p + 1) * ns * SUBS * PANEL
            && pan.d.len() >= (p + 1) * ns * PANEL
            && pan.dmin.len() >= (p + 1) * ns * PANEL
            && x.qs.len() >= (i + R) * x.k
            && x.d.len() >= (i + R) * nb
            && x.sums.len() >= (i + R) * nb
            && (F != Q6K || x.halves.len() >= (i + R) * nb),
        "out of bounds"
    );
    let qs: [*const u8; R] = std::array::from_fn(|r| x.qs[(i + r) * x.k..].as_ptr() as *const u8);
    let mut acc = [_mm512_setzero_ps(); R];
    for s in 0..ns {
        let base = p * ns + s;
        let mut total = [_mm512_setzero_si512(); R];
        for c in 0..SUBS {
            // SAFETY: this sub-block's groups and scales lie within the panels (asserted).
            let (wv, sc0, sc1) = unsafe {
                let at = pan.values.as_ptr().add((base * SUBS + c) * SUB_BYTES);
                let mut wv = [_mm512_setzero_si512(); 8];
                for (g, v) in wv.iter_mut().enumerate() {
                    *v = _mm512_loadu_si512(at.add(g * 64) as *const _);
                }
                let sc = pan.sc.as_ptr().add((base * 16 + 2 * c) * PANEL);
                (
                    wv,
                    _mm512_loadu_si512(sc as *const _),
                    _mm512_loadu_si512(sc.add(PANEL) as *const _),
                )
            };
            let b = s * SUBS + c;
            for r in 0..R {
                let xq = |g: usize| {
                    // SAFETY: block `b` of row `i + r` lies within `x.qs` (asserted above).
                    _mm512_set1_epi32(unsafe {
                        std::ptr::read_unaligned(qs[r].add(b * BLOCK + 4 * g) as *const i32)
                    })
                };
                let row = (i + r) * nb + b;
                if F == Q6K {
                    let lo = x.halves[row];
                    let mut s0 = _mm512_set1_epi32(-32 * lo);
                    let mut s1 = _mm512_set1_epi32(-32 * (x.sums[row] - lo));
                    for g in 0..4 {
                        s0 = _mm512_dpbusd_epi32(s0, wv[g], xq(g));
                        s1 = _mm512_dpbusd_epi32(s1, wv[g + 4], xq(g + 4));
                    }
                    total[r] = _mm512_add_epi32(total[r], _mm512_mullo_epi32(s0, sc0));
                    total[r] = _mm512_add_epi32(total[r], _mm512_mullo_epi32(s1, sc1));
                } else {
                    let mut s = _mm512_setzero_si512();
                    for g in 0..8 {
                        s = _mm512_dpbusd_epi32(s, wv[g], xq(g));
                    }
                    total[r] = _mm512_add_epi32(total[r], _mm512_mullo_epi32(s, sc0));
                }
            }
        }
        // SAFETY: the super-block's factors and minimums lie within the panels (asserted).
        let (dv, dminv) = unsafe {
            (
                _mm512_loadu_ps(pan.d.as_ptr().add(base * PANEL)),
                _mm512_loadu_ps(pan.dmin.as_ptr().add(base * PANEL)),
            )
        };
        for r in 0..R {
            let b0 = (i + r) * nb + s * SUBS;
            let dx = _mm512_set1_ps(x.d[b0]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[r]), _mm512_mul_ps(dv, dx), acc[r]);
            if F != Q6K {
                let mut m = _mm512_setzero_si512();
                for c in 0..SUBS {
                    // SAFETY: as above.
                    let mn = unsafe {
                        _mm512_loadu_si512(
                            pan.mn.as_ptr().add((base * SUBS + c) * PANEL) as *const _
                        )
                    };
                    m = _mm512_add_epi32(
                        m,
                        _mm512_mullo_epi32(mn, _mm512_set1_epi32(x.sums[b0 + c])),
                    );
                }
                acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(m), _mm512_mul_ps(dminv, dx), acc[r]);
            }
        }
    }
    let mut out = [[0f32; PANEL]; R];
    for r in 0..R {
        // SAFETY: `out[r]` holds sixteen floats.
        unsafe { _mm512_storeu_ps(out[r].as_mut_ptr(), acc[r]) };
    }
    out
}

/// [`tile_avx512`]'s arithmetic in portable Rust, bit for bit.
#[cfg(test)]
pub(super) fn tile_scalar<const F: u8>(
    pan: &KPanels,
    p: usize,
    x: &Q8Rows,
    i: usize,
    r: usize,
) -> Vec<[f32; PANEL]> {
    let (ns, nb) = (pan.ns, x.k / BLOCK);
    (i..i + r)
        .map(|row| {
            std::array::from_fn(|lane| {
                let mut acc = 0f32;
                for s in 0..ns {
                    let base = p * ns + s;
                    let mut total = 0i32;
                    for c in 0..SUBS {
                        let b = row * nb + s * SUBS + c;
                        let mut halves = [0i32; 2];
                        if F == Q6K {
                            halves = [-32 * x.halves[b], -32 * (x.sums[b] - x.halves[b])];
                        }
                        for v in 0..BLOCK {
                            let (g, e) = (v / 4, v % 4);
                            let w = pan.values
                                [(base * SUBS + c) * SUB_BYTES + (g * PANEL + lane) * 4 + e];
                            halves[v / 16] +=
                                w as i32 * x.qs[row * x.k + (s * SUBS + c) * BLOCK + v] as i32;
                        }
                        let sc = |j: usize| pan.sc[(base * 16 + j) * PANEL + lane];
                        if F == Q6K {
                            total += halves[0] * sc(2 * c) + halves[1] * sc(2 * c + 1);
                        } else {
                            total += (halves[0] + halves[1]) * sc(2 * c);
                        }
                    }
                    let b0 = row * nb + s * SUBS;
                    let dx = x.d[b0];
                    acc = (total as f32).mul_add(pan.d[base * PANEL + lane] * dx, acc);
                    if F != Q6K {
                        let m: i32 = (0..SUBS)
                            .map(|c| pan.mn[(base * SUBS + c) * PANEL + lane] * x.sums[b0 + c])
                            .sum();
                        acc = (-(m as f32)).mul_add(pan.dmin[base * PANEL + lane] * dx, acc);
                    }
                }
                acc
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::panel::product_by;
    use super::super::tests::{assert_products, val, weights};
    use super::*;

    /// [`tile_scalar`] of the first `rows` rows of `x` with panel `p` of format `f`.
    fn scalar(f: Format, pan: &KPanels, p: usize, x: &Q8Rows, rows: usize) -> Vec<[f32; PANEL]> {
        match f {
            Format::Q4K => tile_scalar::<Q4K>(pan, p, x, 0, rows),
            Format::Q5K => tile_scalar::<Q5K>(pan, p, x, 0, rows),
            _ => tile_scalar::<Q6K>(pan, p, x, 0, rows),
        }
    }

    /// The k-quant panels give [`tile_scalar`]'s arithmetic bit for bit (every row count of a
    /// tile, a partial last panel, accumulation), and that arithmetic is the dequantized
    /// product within the 8-bit activations' bound.
    #[test]
    fn k_panels_are_their_scalar_arithmetic_and_within_the_bound() {
        let (n, t, k) = (PANEL + 5, ROWS + 3, 2 * SUPER);
        for f in [Format::Q4K, Format::Q5K, Format::Q6K] {
            let (w, deq) = weights(f, n, k);
            let xs: Vec<f32> = (0..t * k)
                .map(|i| val(i + 3) * (1 + i % 5) as f32)
                .collect();
            let x = Q8Rows::for_format(f, &xs, t, k);
            let mut pan = KPanels::default();
            pan.repack(f, &w, n, k);
            let mut want = vec![0f32; t * n];
            for p in 0..n.div_ceil(PANEL) {
                let lanes = (n - p * PANEL).min(PANEL);
                for (i, v) in scalar(f, &pan, p, &x, t).iter().enumerate() {
                    want[i * n + p * PANEL..][..lanes].copy_from_slice(&v[..lanes]);
                }
            }
            assert_products(f, &x, &xs, &deq, &want, n);
            if !available(f) {
                eprintln!(
                    "no AVX-512 VNNI: the k-quant panels' scalar arithmetic alone is checked"
                );
                continue;
            }
            for rows in 1..=t {
                let x = Q8Rows::for_format(f, &xs, rows, k);
                let mut out: Vec<f32> = (0..rows * n).map(val).collect();
                let mut want = out.clone();
                let mid = PANEL + 2;
                let row = f.row_bytes(k);
                for cols in [0..mid, mid..n] {
                    let w = &w[cols.start * row..cols.end * row];
                    // SAFETY: `available(f)`; `out` holds every row and column.
                    unsafe {
                        product_by(&SCRATCH, f, &x, w, cols.clone(), out.as_mut_ptr(), n, true)
                    };
                    let mut pan = KPanels::default();
                    pan.repack(f, w, cols.len(), k);
                    for p in 0..cols.len().div_ceil(PANEL) {
                        let lanes = (cols.len() - p * PANEL).min(PANEL);
                        for (i, v) in scalar(f, &pan, p, &x, rows).iter().enumerate() {
                            let at = i * n + cols.start + p * PANEL;
                            for (o, v) in want[at..at + lanes].iter_mut().zip(v) {
                                *o += v;
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
