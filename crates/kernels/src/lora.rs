//! A task's low-rank adapter update, `out += (x·Aᵀ)·Bᵀ`, for a few tokens of one adapter.

use super::{bytes, madd, Weight};

/// Ranks are held padded with zeros to a multiple of this, so every row of `Aᵀ` and `B`
/// is whole AVX registers (see `lora::LoraAdapter`).
pub const RANK_ALIGN: usize = 8;

/// Ranks per pass of the first product: two registers per token.
const RANK_BLOCK: usize = 16;

/// How far ahead of its reads an adapter kernel asks for weights, in bytes.
///
/// Why software prefetch: with many adapters in a batch every task streams a few tens of KB
/// of cold weights, and the hardware prefetchers neither cross the 4 KiB pages of those runs
/// nor jump to the next task's matrices, so each page starts with misses paid in full. One
/// core of the dev VM (Zen 5), SmolLM2's seven projections at rank 16, 16 adapters each read
/// once per step in step order: 26 → 34 GB/s f32, 22 → 29 GB/s bf16 (4, 8, 16 and 32 KiB
/// ahead measured; 8 was best for both).
const AHEAD: usize = 8 << 10;

/// The weights an adapter kernel reads, in the order it reads them (its `Aᵀ`, its `B`, then
/// the next task's two, empty where there is none), for the prefetches [`AHEAD`] of its reads.
#[derive(Clone, Copy)]
struct Ahead<'a> {
    spans: [&'a [u8]; 4],
}

impl Ahead<'_> {
    /// Reads of `len` bytes at `pos` of `Aᵀ`: asks for the lines [`AHEAD`] past them.
    #[inline(always)]
    fn a(&self, pos: usize, len: usize) {
        let mut line = pos.next_multiple_of(64);
        while line < pos + len {
            self.prefetch(line + AHEAD);
            line += 64;
        }
    }

    /// Reads of `len` bytes at `pos` of `B`.
    #[inline(always)]
    fn b(&self, pos: usize, len: usize) {
        self.a(self.spans[0].len() + pos, len)
    }

    #[inline(always)]
    fn prefetch(&self, mut at: usize) {
        for span in self.spans {
            if at < span.len() {
                return line(span, at);
            }
            at -= span.len();
        }
    }
}

/// Asks for the cache line holding `span[at]`.
#[inline(always)]
fn line(span: &[u8], at: usize) {
    debug_assert!(at < span.len());
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the address is inside the span, and a prefetch neither faults nor changes what
    // the program reads. SSE is in every x86-64 CPU.
    unsafe {
        use std::arch::x86_64::*;
        _mm_prefetch::<_MM_HINT_T0>(span.as_ptr().add(at).cast());
    }
}

/// The update of a task's tokens, `out += (x·Aᵀ)·Bᵀ` with `Aᵀ` `[in, r]` and `B` `[out, r]`
/// (scale folded in), both row-major as PEFT lays out `(lora_A)ᵀ` and `lora_B`.
///
/// Why this layout: with many adapters in a batch each task's weights come cold from
/// memory, and a core streams them fastest as one long run in the order they are used. Both
/// products here walk their matrix front to back — `h += x[i]·Aᵀ[i]` and `y[o] = B[o]·h` —
/// where `A` `[r, in]` and `Bᵀ` `[r, out]` made r short runs each. One core of the 2-CPU
/// dev VM, SmolLM2's seven projections at rank 16, every adapter's matrices allocated apart
/// and cold: 22 → 28 GB/s f32 and 14 → 18 GB/s bf16.
#[inline(always)]
fn lora_impl<const FMA: bool, W: Weight>(
    xs: &[f32],
    at: &[W],
    b: &[W],
    r: usize,
    outs: &mut [(usize, &mut [f32])],
    next: [&[u8]; 2],
) {
    assert!(
        r > 0 && r.is_multiple_of(RANK_ALIGN),
        "rank {r} is not padded"
    );
    let (d_in, d_out) = (at.len() / r, b.len() / r);
    assert!(at.len() == d_in * r && b.len() == d_out * r);
    assert!(outs
        .iter()
        .all(|(i, o)| o.len() == d_out && xs.len() >= (i + 1) * d_in));
    // Ranks that fill whole 16-lane registers take the AVX-512 kernels where the CPU has them.
    #[cfg(target_arch = "x86_64")]
    let wide = FMA && r.is_multiple_of(16) && super::cpu::caps().avx512f;
    #[cfg(not(target_arch = "x86_64"))]
    let wide = false;
    let ahead = Ahead {
        spans: [bytes(at), bytes(b), next[0], next[1]],
    };
    let mut h = vec![0f32; outs.len() * r];
    let x = |i: usize| &xs[outs[i].0 * d_in..][..d_in];
    #[cfg(target_arch = "x86_64")]
    if wide {
        for (c, hc) in h.chunks_mut(8 * r).enumerate() {
            let x = |i: usize| x(8 * c + i);
            // SAFETY: AVX-512F and r a multiple of 16 (`wide`); the lengths are asserted above.
            unsafe {
                match hc.len() / r {
                    1 => shrink_avx512::<W, 1, 8>(at, r, &ahead, [x(0)], hc),
                    2 => shrink_avx512::<W, 2, 4>(at, r, &ahead, std::array::from_fn(x), hc),
                    3 => shrink_avx512::<W, 3, 3>(at, r, &ahead, std::array::from_fn(x), hc),
                    4 => shrink_avx512::<W, 4, 2>(at, r, &ahead, std::array::from_fn(x), hc),
                    5 => shrink_avx512::<W, 5, 2>(at, r, &ahead, std::array::from_fn(x), hc),
                    6 => shrink_avx512::<W, 6, 2>(at, r, &ahead, std::array::from_fn(x), hc),
                    7 => shrink_avx512::<W, 7, 2>(at, r, &ahead, std::array::from_fn(x), hc),
                    _ => shrink_avx512::<W, 8, 2>(at, r, &ahead, std::array::from_fn(x), hc),
                }
            }
        }
        // SAFETY: as above.
        unsafe { expand_avx512(b, r, d_out, &h, outs, &ahead) };
        return;
    }
    for (c, hc) in h.chunks_mut(4 * r).enumerate() {
        let x = |i: usize| x(4 * c + i);
        // Eight independent sums in flight whatever the token count: `U` rows at once.
        match hc.len() / r {
            1 => shrink::<FMA, W, 1, 4>(at, r, &ahead, [x(0)], hc),
            2 => shrink::<FMA, W, 2, 2>(at, r, &ahead, [x(0), x(1)], hc),
            3 => shrink::<FMA, W, 3, 2>(at, r, &ahead, [x(0), x(1), x(2)], hc),
            _ => shrink::<FMA, W, 4, 1>(at, r, &ahead, [x(0), x(1), x(2), x(3)], hc),
        }
    }
    expand::<FMA, W>(b, r, d_out, &h, outs, &ahead);
}

/// `h[t·r + k] = vecs[t] · Aᵀ[·, k]`: the rows of `Aᵀ` `[n, r]` in order, `U` at a time, each
/// row's ranks loaded once for the `T` tokens.
#[inline(always)]
fn shrink<const FMA: bool, W: Weight, const T: usize, const U: usize>(
    at: &[W],
    r: usize,
    ahead: &Ahead,
    vecs: [&[f32]; T],
    h: &mut [f32],
) {
    let n = vecs[0].len();
    assert!(at.len() == n * r && vecs.iter().all(|v| v.len() == n) && h.len() == T * r);
    #[cfg(target_arch = "x86_64")]
    if FMA {
        for k in (0..r).step_by(RANK_BLOCK) {
            // SAFETY: FMA is set only behind the run-time AVX2 + FMA check; the lengths are
            // asserted above and `k + 8·V ≤ r` (r is a multiple of 8).
            let sums: [[f32; RANK_BLOCK]; T] = unsafe {
                if r - k >= RANK_BLOCK {
                    shrink_fma::<W, T, U, 2>(at, r, k, ahead, vecs)
                } else {
                    shrink_fma::<W, T, U, 1>(at, r, k, ahead, vecs)
                }
            };
            let width = (r - k).min(RANK_BLOCK);
            for (t, s) in sums.iter().enumerate() {
                h[t * r + k..][..width].copy_from_slice(&s[..width]);
            }
        }
        return;
    }
    h.fill(0.0);
    for i in 0..n {
        let row = &at[i * r..(i + 1) * r];
        for (t, v) in vecs.iter().enumerate() {
            for (hk, w) in h[t * r..(t + 1) * r].iter_mut().zip(row) {
                *hk = madd::<FMA>(v[i], w.f32(), *hk);
            }
        }
    }
}

/// `step(acc[u], i + u)` over rows `0..n`, `U` rows at a time each into its own accumulators
/// (so every sum waits on its own adds only once per `U` rows), `block(i)` before each such
/// group, and the rows left over into the first accumulators.
#[inline(always)]
fn by_rows<A, const U: usize>(
    n: usize,
    acc: &mut [A; U],
    step: impl Fn(&mut A, usize),
    mut block: impl FnMut(usize),
) {
    let mut i = 0;
    while i + U <= n {
        block(i);
        for (u, a) in acc.iter_mut().enumerate() {
            step(a, i + u);
        }
        i += U;
    }
    for i in i..n {
        step(&mut acc[0], i);
    }
}

/// Ranks `k..k + 8·V` of [`shrink`] in AVX registers: `U × T × V` accumulators, rows `i..i + U`
/// interleaved so each sum waits on its own adds only once per `U` rows.
///
/// # Safety
/// The CPU has AVX2 and FMA, `at` is `[n, r]` with `n` the length of every vector, and
/// `k + 8·V ≤ r`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn shrink_fma<W: Weight, const T: usize, const U: usize, const V: usize>(
    at: &[W],
    r: usize,
    k: usize,
    ahead: &Ahead,
    vecs: [&[f32]; T],
) -> [[f32; RANK_BLOCK]; T] {
    use std::arch::x86_64::*;
    let n = vecs[0].len();
    let base = at.as_ptr().add(k);
    let row = r * std::mem::size_of::<W>();
    let mut acc = [[[_mm256_setzero_ps(); V]; T]; U];
    let step = |acc: &mut [[__m256; V]; T], i: usize| {
        let w: [__m256; V] = std::array::from_fn(|v| W::load8(base.add(i * r + 8 * v)));
        for t in 0..T {
            let x = _mm256_set1_ps(*vecs[t].get_unchecked(i));
            for v in 0..V {
                acc[t][v] = _mm256_fmadd_ps(x, w[v], acc[t][v]);
            }
        }
    };
    by_rows(n, &mut acc, step, |i| {
        if k == 0 {
            ahead.a(i * row, U * row);
        }
    });
    let mut out = [[0f32; RANK_BLOCK]; T];
    for t in 0..T {
        for v in 0..V {
            let mut s = acc[0][t][v];
            for a in &acc[1..] {
                s = _mm256_add_ps(s, a[t][v]);
            }
            _mm256_storeu_ps(out[t].as_mut_ptr().add(8 * v), s);
        }
    }
    out
}

/// `out_t[o] += B[o] · h_t` for each task token `t`: the rows of `B` `[d_out, r]` in order,
/// eight at a time, each block reused from L1 for the task's other tokens.
#[inline(always)]
fn expand<const FMA: bool, W: Weight>(
    b: &[W],
    r: usize,
    d_out: usize,
    h: &[f32],
    outs: &mut [(usize, &mut [f32])],
    ahead: &Ahead,
) {
    assert!(b.len() == d_out * r && h.len() == outs.len() * r);
    assert!(outs.iter().all(|(_, o)| o.len() == d_out));
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if FMA {
        done = d_out / 8 * 8;
        // SAFETY: FMA is set only behind the run-time AVX2 + FMA check; the lengths are
        // asserted above, r is a multiple of 8 and `done ≤ d_out`.
        unsafe { expand_fma(b, r, done, h, outs, ahead) };
    }
    for (ht, (_, out)) in h.chunks_exact(r).zip(outs.iter_mut()) {
        for (o, row) in out.iter_mut().zip(b.chunks_exact(r)).skip(done) {
            *o = row
                .iter()
                .zip(ht)
                .fold(*o, |s, (w, x)| madd::<FMA>(*x, w.f32(), s));
        }
    }
}

/// The first `rows` (a multiple of 8) outputs of [`expand`]: eight dot products in eight
/// registers, folded into one register of eight sums.
///
/// # Safety
/// The CPU has AVX2 and FMA, `b` holds `rows × r` values, r is a multiple of 8, each `h`
/// chunk holds r values and each output at least `rows`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn expand_fma<W: Weight>(
    b: &[W],
    r: usize,
    rows: usize,
    h: &[f32],
    outs: &mut [(usize, &mut [f32])],
    ahead: &Ahead,
) {
    use std::arch::x86_64::*;
    let row = r * std::mem::size_of::<W>();
    for c in (0..rows).step_by(8) {
        ahead.b(c * row, 8 * row);
        let block = b.as_ptr().add(c * r);
        for (ht, (_, out)) in h.chunks_exact(r).zip(outs.iter_mut()) {
            let mut y = [_mm256_setzero_ps(); 8];
            for v in (0..r).step_by(8) {
                let hv = _mm256_loadu_ps(ht.as_ptr().add(v));
                for (u, yu) in y.iter_mut().enumerate() {
                    *yu = _mm256_fmadd_ps(hv, W::load8(block.add(u * r + v)), *yu);
                }
            }
            let o = out.as_mut_ptr().add(c);
            _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), sums8(y)));
        }
    }
}

/// The lane sums of eight registers, as the eight lanes of one.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn sums8(v: [std::arch::x86_64::__m256; 8]) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    // Pairwise adds leave, per 128-bit half, [s0 s1 s2 s3] of the low and of the high lanes.
    let ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    let cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    _mm256_add_ps(
        _mm256_permute2f128_ps::<0x20>(ab, cd),
        _mm256_permute2f128_ps::<0x31>(ab, cd),
    )
}

// The AVX-512 kernels of [`lora_impl`], for ranks that fill whole 16-lane registers: the first
// product's rank block in one register per token (a load and one multiply-add per row and
// token, where AVX2 takes two of each), and the second in the broadcast form over 16×16 tiles
// of `B` transposed in registers (a multiply-add per rank and token for sixteen outputs, where
// the dot form pays a horizontal sum per output and token), the transpose paid once per tile
// for all the task's tokens. Tokens go eight at a time, so eight or more sums are in flight to
// cover the multiply-add's latency. One adapter on 16 tokens of SmolLM2 (all seven
// projections, one core): 2.0 → 1.15 ms per step, from tasks of 16 tokens instead of 4 (one
// transpose per tile instead of four) and chunks of eight. A task of one token (each token on
// its own adapter) takes the dot form with a tree of lane sums instead (see [`DOT_TOKENS`]):
// 16 single-token tasks on each of SmolLM2's 210 projections, weights in cache, 4.3 → 2.2 ms
// of second products on one core; 16 adapters read cold, 6.2 → 5.0-5.4 ms bf16 and
// 9.9 → 8.9-9.8 ms f32 for the whole update.

/// `h[t·r + k] = vecs[t] · Aᵀ[·, k]`, sixteen ranks per pass over the rows of `Aᵀ`, `U` rows
/// interleaved so `T·U` independent sums are in flight.
///
/// # Safety
/// The CPU has AVX-512F and r is a multiple of 16; `at` is `[n, r]` with `n` every vector's
/// length, `h` holds `T·r`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn shrink_avx512<W: Weight, const T: usize, const U: usize>(
    at: &[W],
    r: usize,
    ahead: &Ahead,
    vecs: [&[f32]; T],
    h: &mut [f32],
) {
    use std::arch::x86_64::*;
    let n = vecs[0].len();
    let row = r * std::mem::size_of::<W>();
    for k in (0..r).step_by(16) {
        let base = at.as_ptr().add(k);
        let mut acc = [[_mm512_setzero_ps(); T]; U];
        let step = |acc: &mut [__m512; T], i: usize| {
            let w = W::load16(base.add(i * r));
            for t in 0..T {
                acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(*vecs[t].get_unchecked(i)), w, acc[t]);
            }
        };
        by_rows(n, &mut acc, step, |i| {
            if k == 0 {
                ahead.a(i * row, U * row);
            }
        });
        for t in 0..T {
            let mut s = acc[0][t];
            for a in &acc[1..] {
                s = _mm512_add_ps(s, a[t]);
            }
            _mm512_storeu_ps(h.as_mut_ptr().add(t * r + k), s);
        }
    }
}

/// `out_t[o] += B[o] · h_t`: per sixteen rows of `B` `[d_out, r]` and sixteen ranks, the tile
/// transposed in registers, then one broadcast multiply-add per rank for each token, eight
/// tokens at a time; rows past the last whole sixteen in scalar.
///
/// # Safety
/// The CPU has AVX-512F and r is a multiple of 16; `b` holds `d_out·r` values, `h` `r` per
/// output, and each output `d_out`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn expand_avx512<W: Weight>(
    b: &[W],
    r: usize,
    d_out: usize,
    h: &[f32],
    outs: &mut [(usize, &mut [f32])],
    ahead: &Ahead,
) {
    use std::arch::x86_64::*;
    let full = d_out / 16 * 16;
    let row = r * std::mem::size_of::<W>();
    for o in (0..full).step_by(16) {
        ahead.b(o * row, 16 * row);
        if outs.len() <= DOT_TOKENS {
            for (ht, (_, out)) in h.chunks_exact(r).zip(outs.iter_mut()) {
                let mut p = [_mm512_setzero_ps(); 16];
                for k in (0..r).step_by(16) {
                    let hk = _mm512_loadu_ps(ht.as_ptr().add(k));
                    for (j, pj) in p.iter_mut().enumerate() {
                        *pj = _mm512_fmadd_ps(W::load16(b.as_ptr().add((o + j) * r + k)), hk, *pj);
                    }
                }
                let q = out.as_mut_ptr().add(o);
                _mm512_storeu_ps(q, _mm512_add_ps(_mm512_loadu_ps(q), sums16(p)));
            }
            continue;
        }
        for k in (0..r).step_by(16) {
            let rows: [__m512; 16] =
                std::array::from_fn(|j| W::load16(b.as_ptr().add((o + j) * r + k)));
            let cols = transpose16(rows);
            for (hc, oc) in h.chunks(8 * r).zip(outs.chunks_mut(8)) {
                let mut y = [_mm512_setzero_ps(); 8];
                for (yt, ht) in y.iter_mut().zip(hc.chunks_exact(r)) {
                    for (kk, col) in cols.iter().enumerate() {
                        *yt = _mm512_fmadd_ps(_mm512_set1_ps(*ht.get_unchecked(k + kk)), *col, *yt);
                    }
                }
                for (yt, (_, out)) in y.iter().zip(oc.iter_mut()) {
                    let p = out.as_mut_ptr().add(o);
                    _mm512_storeu_ps(p, _mm512_add_ps(_mm512_loadu_ps(p), *yt));
                }
            }
        }
    }
    for (ht, (_, out)) in h.chunks_exact(r).zip(outs.iter_mut()) {
        for (o, row) in out.iter_mut().zip(b.chunks_exact(r)).skip(full) {
            *o = row
                .iter()
                .zip(ht)
                .fold(*o, |s, (w, x)| x.mul_add(w.f32(), s));
        }
    }
}

/// Tokens at most for which [`expand_avx512`] takes the dot form: per token, sixteen rows'
/// products with `h` summed across lanes by [`sums16`] (30 shuffles), where the broadcast
/// form transposes the tile (64 shuffles) once for all the tokens.
const DOT_TOKENS: usize = 1;

/// The lane sums of sixteen registers, as the sixteen lanes of one: pairs interleaved and
/// added at 32 then 64 bits within each 128-bit lane, then whole lanes in two rounds.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn sums16(v: [std::arch::x86_64::__m512; 16]) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    // a[i], per 128-bit lane: rows 2i and 2i+1 alternating, two partial sums each.
    let a: [__m512; 8] = std::array::from_fn(|i| {
        let (x, y) = (v[2 * i], v[2 * i + 1]);
        _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y))
    });
    // b[m], per 128-bit lane: rows 4m..4m+3, one partial sum each.
    let b: [__m512; 4] = std::array::from_fn(|m| {
        let (x, y) = (_mm512_castps_pd(a[2 * m]), _mm512_castps_pd(a[2 * m + 1]));
        _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
            _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)),
        )
    });
    // c[n]: rows 8n..8n+3 in lanes 0 and 1, rows 8n+4..8n+7 in lanes 2 and 3.
    let c: [__m512; 2] = std::array::from_fn(|n| {
        let (x, y) = (b[2 * n], b[2 * n + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x44>(x, y),
            _mm512_shuffle_f32x4::<0xee>(x, y),
        )
    });
    _mm512_add_ps(
        _mm512_shuffle_f32x4::<0x88>(c[0], c[1]),
        _mm512_shuffle_f32x4::<0xdd>(c[0], c[1]),
    )
}

/// The transpose of a 16×16 tile held as sixteen rows: `out[j]` lane `i` is `rows[i]` lane
/// `j`. Pairs interleaved at 32 then 64 bits within each 128-bit lane, then whole lanes
/// gathered in two rounds of `shuffle_f32x4`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn transpose16(rows: [std::arch::x86_64::__m512; 16]) -> [std::arch::x86_64::__m512; 16] {
    use std::arch::x86_64::*;
    // a[2i], a[2i+1]: rows 2i, 2i+1 interleaved (elements 0,1 and 2,3 of each lane).
    let a: [__m512; 16] = std::array::from_fn(|j| {
        let (x, y) = (rows[j & !1], rows[j | 1]);
        if j % 2 == 0 {
            _mm512_unpacklo_ps(x, y)
        } else {
            _mm512_unpackhi_ps(x, y)
        }
    });
    // b[4i + e]: per 128-bit lane L, rows 4i..4i+3 at element 4L + e.
    let b: [__m512; 16] = std::array::from_fn(|j| {
        let (i, e) = (j / 4, j % 4);
        let x = _mm512_castps_pd(a[4 * i + (e / 2)]);
        let y = _mm512_castps_pd(a[4 * i + 2 + (e / 2)]);
        _mm512_castpd_ps(if e % 2 == 0 {
            _mm512_unpacklo_pd(x, y)
        } else {
            _mm512_unpackhi_pd(x, y)
        })
    });
    let mut out = [_mm512_setzero_ps(); 16];
    for e in 0..4 {
        let p = _mm512_shuffle_f32x4::<0x88>(b[e], b[4 + e]);
        let q = _mm512_shuffle_f32x4::<0xdd>(b[e], b[4 + e]);
        let s = _mm512_shuffle_f32x4::<0x88>(b[8 + e], b[12 + e]);
        let u = _mm512_shuffle_f32x4::<0xdd>(b[8 + e], b[12 + e]);
        out[e] = _mm512_shuffle_f32x4::<0x88>(p, s);
        out[8 + e] = _mm512_shuffle_f32x4::<0xdd>(p, s);
        out[4 + e] = _mm512_shuffle_f32x4::<0x88>(q, u);
        out[12 + e] = _mm512_shuffle_f32x4::<0xdd>(q, u);
    }
    out
}

#[inline(always)]
fn lora_f32<const FMA: bool>(
    xs: &[f32],
    at: &[f32],
    b: &[f32],
    r: usize,
    outs: &mut [(usize, &mut [f32])],
    next: [&[u8]; 2],
) {
    lora_impl::<FMA, f32>(xs, at, b, r, outs, next)
}

#[inline(always)]
fn lora_bf16<const FMA: bool>(
    xs: &[f32],
    at: &[half::bf16],
    b: &[half::bf16],
    r: usize,
    outs: &mut [(usize, &mut [f32])],
    next: [&[u8]; 2],
) {
    lora_impl::<FMA, half::bf16>(xs, at, b, r, outs, next)
}

kernel! {
    /// Adds one adapter's low-rank update to some tokens' output rows: `out += (x·Aᵀ)·(s·B)ᵀ`
    /// with `Aᵀ` `[in, r]` and `s·B` `[out, r]` row-major (r a multiple of [`RANK_ALIGN`]),
    /// `xs` the batch's inputs `[tokens, in]` and `outs` (token, its output row). The tokens
    /// share each weight row while it is in cache, so a few tokens per call cost little more
    /// than one.
    /// `next` is the weights the thread will read after these (the next task's `Aᵀ` and `B`
    /// as [`bytes`], or empty), asked for ahead of need as this task's run out.
    lora_tokens = lora_f32(
        xs: &[f32],
        at: &[f32],
        b: &[f32],
        r: usize,
        outs: &mut [(usize, &mut [f32])],
        next: [&[u8]; 2],
    )
}

kernel! {
    /// [`lora_tokens`] with the adapter's weights held in bf16, read as f32 (exactly) and
    /// summed in f32.
    lora_tokens_bf16 = lora_bf16(
        xs: &[f32],
        at: &[half::bf16],
        b: &[half::bf16],
        r: usize,
        outs: &mut [(usize, &mut [f32])],
        next: [&[u8]; 2],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn val(i: usize) -> f32 {
        ((i * 7919 % 101) as f32 - 50.0) / 37.0
    }

    /// The adapter update equals the plain formula for every token count a task holds (each
    /// with its own interleaving of rows), ranks that fill the rank blocks or leave a half
    /// block, padded ranks, input widths with a partial row group, and an output width with a
    /// partial block of eight; the tokens are rows scattered in a larger batch. Weights in
    /// f32 and in bf16 (the formula then takes the bf16 values, which the kernel reads
    /// exactly).
    #[test]
    fn adapter_update_matches_the_formula() {
        use half::bf16;
        type Run<'a> = Box<dyn Fn(&[f32], &mut [(usize, &mut [f32])]) + 'a>;
        // (dtype, A and B as the formula reads them, the kernels that hold them).
        type Case<'a> = (&'a str, Vec<f32>, Vec<f32>, Vec<Run<'a>>);
        let dout = 70;
        for (din, r) in [(10, 3), (37, 8), (16, 17), (9, 40), (20, 16), (33, 32)] {
            // The formula's A `[r, in]` and Bᵀ `[r, out]`, and the kernel's padded Aᵀ and B.
            let a: Vec<f32> = (0..din * r).map(|i| val(i + 5)).collect();
            let b: Vec<f32> = (0..r * dout).map(|i| val(i + 13)).collect();
            let rp = r.div_ceil(RANK_ALIGN) * RANK_ALIGN;
            // `[n, r]` `m` transposed to `[r, rp]` with zeros past r.
            let padded_t = |m: &[f32], n: usize| -> Vec<f32> {
                (0..n * rp)
                    .map(|i| {
                        if i % rp < r {
                            m[(i % rp) * n + i / rp]
                        } else {
                            0.0
                        }
                    })
                    .collect()
            };
            let (at, bn) = (padded_t(&a, din), padded_t(&b, dout));
            let (at16, bn16): (Vec<bf16>, Vec<bf16>) = (
                at.iter().map(|x| bf16::from_f32(*x)).collect(),
                bn.iter().map(|x| bf16::from_f32(*x)).collect(),
            );
            let round =
                |v: &[f32]| -> Vec<f32> { v.iter().map(|x| bf16::from_f32(*x).to_f32()).collect() };
            let cases: Vec<Case> = vec![
                (
                    "f32",
                    a.clone(),
                    b.clone(),
                    vec![
                        Box::new(|xs, o| {
                            lora_tokens(xs, &at, &bn, rp, o, [bytes(&at), bytes(&bn)])
                        }),
                        Box::new(|xs, o| lora_f32::<false>(xs, &at, &bn, rp, o, [&[], &[]])),
                    ],
                ),
                (
                    "bf16",
                    round(&a),
                    round(&b),
                    vec![
                        Box::new(|xs, o| {
                            lora_tokens_bf16(xs, &at16, &bn16, rp, o, [bytes(&at16), bytes(&bn16)])
                        }),
                        Box::new(|xs, o| lora_bf16::<false>(xs, &at16, &bn16, rp, o, [&[], &[]])),
                    ],
                ),
            ];
            // Token counts that fill and leave every part of the kernels' chunks of 4 and 8.
            let batch = 17;
            let xs: Vec<f32> = (0..batch * din).map(|i| val(i + 40)).collect();
            for (dtype, a, b, runs) in &cases {
                for tokens in [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 17] {
                    let rows: Vec<usize> = (0..tokens).map(|i| (2 * i + 1) % batch).collect();
                    // Per output: the exact value and the sum of its terms' magnitudes, which
                    // bounds f32's rounding in any order of summation.
                    let want: Vec<Vec<(f64, f64)>> = rows
                        .iter()
                        .map(|&t| {
                            let x = &xs[t * din..(t + 1) * din];
                            let hid: Vec<(f64, f64)> = (0..r)
                                .map(|k| {
                                    (0..din)
                                        .map(|j| x[j] as f64 * a[k * din + j] as f64)
                                        .fold((0.0, 0.0), |(s, m), p| (s + p, m + p.abs()))
                                })
                                .collect();
                            (0..dout)
                                .map(|o| {
                                    let init = val(o + t) as f64;
                                    hid.iter().enumerate().fold(
                                        (init, init.abs()),
                                        |(s, m), (k, (h, hm))| {
                                            let w = b[k * dout + o] as f64;
                                            (s + h * w, m + hm * w.abs())
                                        },
                                    )
                                })
                                .collect()
                        })
                        .collect();
                    for run in runs {
                        let mut outs: Vec<Vec<f32>> = rows
                            .iter()
                            .map(|&t| (0..dout).map(|o| val(o + t)).collect())
                            .collect();
                        let mut pairs: Vec<(usize, &mut [f32])> = rows
                            .iter()
                            .zip(outs.iter_mut())
                            .map(|(&t, o)| (t, &mut o[..]))
                            .collect();
                        run(&xs, &mut pairs);
                        for (got, want) in outs.iter().zip(&want) {
                            for (g, (w, m)) in got.iter().zip(want) {
                                // f32 rounding scales with the terms summed: up to ~70 at
                                // rank 32, cancelling to results near 0.1, where one f32 step
                                // of a term is 8e-6. A wrong row, rank or token is off by a
                                // whole term.
                                assert!(
                                    (*g as f64 - w).abs() < 1e-5 * m.max(1.0),
                                    "{dtype}, in {din}, rank {r}, {tokens} tokens: {g} vs {w}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
