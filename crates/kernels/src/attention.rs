//! A token's attention over its sequence's token-major cache, one head at a time. The cache
//! holds f32, bf16 or f16 keys and values (`kvCacheDtype`); half types are widened to f32 in
//! registers as they are loaded (exact), and every sum is in f32, so a half-type cache costs
//! only its own rounding, and each step reads half the bytes.

use super::{madd, Weight};

/// The `R` dot products of `R` rows with one vector, all of one length: each sum in its own
/// 8-lane accumulator, so `R` chains of fused multiply-adds run independently (one dot
/// product alone waits on its own adds, four cycles each, and reaches a fraction of the
/// core's throughput), and each loaded chunk of the vector feeds `R` of them. `FMA` is true
/// only in [`attend_head`]'s AVX2 + FMA + F16C build.
#[inline(always)]
fn dots<const FMA: bool, const R: usize, E: Weight>(rows: [&[E]; R], v: &[f32]) -> [f32; R] {
    let n = v.len();
    assert!(rows.iter().all(|r| r.len() == n));
    let full = n / 8 * 8;
    let lanes: [[f32; 8]; R] = {
        #[cfg(target_arch = "x86_64")]
        if FMA {
            // SAFETY: FMA is set only behind the run-time AVX2 + FMA + F16C check, and every
            // row and the vector hold `full` values (asserted above).
            unsafe { dots_fma(rows, v, full) }
        } else {
            dots_plain(rows, v, full)
        }
        #[cfg(not(target_arch = "x86_64"))]
        dots_plain(rows, v, full)
    };
    std::array::from_fn(|i| lane_sum(lanes[i]) + tail(rows[i], v, full))
}

/// The sum of one accumulator's lanes, in the order [`dots8_fma`] adds eight at once (pairs,
/// then pairs of pairs, then the halves), so a key's score does not depend on the keys it
/// was computed with.
#[inline(always)]
fn lane_sum(l: [f32; 8]) -> f32 {
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}

/// The products of a row and the vector past the first `full` values.
#[inline(always)]
fn tail<E: Weight>(row: &[E], v: &[f32], full: usize) -> f32 {
    v[full..]
        .iter()
        .zip(&row[full..])
        .map(|(x, y)| x * y.f32())
        .sum()
}

/// Eight dot products of eight rows with one vector, as [`dots`] computes them: eight
/// independent accumulators, their lanes then summed for all eight at once in registers
/// (a transposition by horizontal adds, in [`lane_sum`]'s order) where adding each one's
/// lanes apart took more instructions than its products.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C, and every row and the vector hold at least `full` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dots8_fma<E: Weight>(rows: [&[E]; 8], v: &[f32], full: usize) -> [f32; 8] {
    use std::arch::x86_64::*;
    let a = dots_fma_lanes(rows, v, full);
    let t0 = _mm256_hadd_ps(a[0], a[1]);
    let t1 = _mm256_hadd_ps(a[2], a[3]);
    let t2 = _mm256_hadd_ps(a[4], a[5]);
    let t3 = _mm256_hadd_ps(a[6], a[7]);
    let u0 = _mm256_hadd_ps(t0, t1);
    let u1 = _mm256_hadd_ps(t2, t3);
    let lo = _mm256_permute2f128_ps::<0x20>(u0, u1);
    let hi = _mm256_permute2f128_ps::<0x31>(u0, u1);
    let mut out = [0f32; 8];
    _mm256_storeu_ps(out.as_mut_ptr(), _mm256_add_ps(lo, hi));
    if full < v.len() {
        for (o, r) in out.iter_mut().zip(rows) {
            *o += tail(r, v, full);
        }
    }
    out
}

/// The lane-wise partial sums of [`dots`] over the first `full` values (a multiple of 8), in
/// plain code. The compiler's vectoriser packs these nested accumulators badly (scalar
/// multiply-adds and shuffles), hence the explicit AVX path beside it.
#[inline(always)]
fn dots_plain<const R: usize, E: Weight>(rows: [&[E]; R], v: &[f32], full: usize) -> [[f32; 8]; R] {
    let mut acc = [[0f32; 8]; R];
    for j in (0..full).step_by(8) {
        for (a, row) in acc.iter_mut().zip(&rows) {
            for l in 0..8 {
                a[l] += v[j + l] * row[j + l].f32();
            }
        }
    }
    acc
}

/// [`dots_plain`] in AVX registers: `R` accumulators, each chunk of the vector loaded once
/// for the `R` rows.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C, and every row and the vector hold at least `full` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dots_fma<const R: usize, E: Weight>(
    rows: [&[E]; R],
    v: &[f32],
    full: usize,
) -> [[f32; 8]; R] {
    use std::arch::x86_64::*;
    let acc = dots_fma_lanes(rows, v, full);
    let mut out = [[0f32; 8]; R];
    for i in 0..R {
        _mm256_storeu_ps(out[i].as_mut_ptr(), acc[i]);
    }
    out
}

/// The accumulators of [`dots_fma`], in registers.
///
/// # Safety
/// As [`dots_fma`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn dots_fma_lanes<const R: usize, E: Weight>(
    rows: [&[E]; R],
    v: &[f32],
    full: usize,
) -> [std::arch::x86_64::__m256; R] {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_ps(); R];
    let mut j = 0;
    while j < full {
        let x = _mm256_loadu_ps(v.as_ptr().add(j));
        for i in 0..R {
            acc[i] = _mm256_fmadd_ps(x, E::load8(rows[i].as_ptr().add(j)), acc[i]);
        }
        j += 8;
    }
    acc
}

/// `out += Σ_j p[j] · values[j·stride + offset ..][..dim]`, in each output's order over `j`
/// (as the plain loop adds), with the outputs held in registers, 64 at a time, across all
/// `j`: read and written back once, where a loop over `j` outside loaded and stored each of
/// them for every value row and waited on that store.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn weigh_fma<E: Weight>(
    p: &[f32],
    values: &[E],
    stride: usize,
    offset: usize,
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let dim = out.len();
    if p.is_empty() {
        return;
    }
    assert!(values.len() >= (p.len() - 1) * stride + offset + dim);
    let full = dim / 64 * 64;
    for c in (0..full).step_by(64) {
        let o = out.as_mut_ptr().add(c);
        let mut acc: [__m256; 8] = std::array::from_fn(|k| _mm256_loadu_ps(o.add(8 * k)));
        for (j, &pj) in p.iter().enumerate() {
            let w = _mm256_set1_ps(pj);
            // In bounds: row j's values [offset + c, offset + c + 64) end within the row's
            // `dim` values, which the assertion above bounds.
            let row = values.as_ptr().add(j * stride + offset + c);
            for (k, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(w, E::load8(row.add(8 * k)), *a);
            }
        }
        for (k, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(o.add(8 * k), *a);
        }
    }
    for (j, &pj) in p.iter().enumerate() {
        let v = &values[j * stride + offset..][..dim];
        for (o, x) in out[full..].iter_mut().zip(&v[full..]) {
            *o = pj.mul_add(x.f32(), *o);
        }
    }
}

/// Where one head's keys and values lie in a token-major cache `[len, kv_heads, dim]`.
#[derive(Debug, Clone, Copy)]
pub struct KvHead {
    /// Values per cached token (kv_heads × dim).
    pub stride: usize,
    /// This head's first value within a token.
    pub offset: usize,
    /// Score scale, 1/√dim.
    pub scale: f32,
}

/// A run of consecutive cached tokens of one layer, token-major `[tokens, kv_heads, dim]`: a
/// sequence's cache is the runs in order (blocks shared with the prefix cache, then its own).
#[derive(Debug)]
pub struct KvRun<'c, E> {
    /// The run's keys.
    pub keys: &'c [E],
    /// The run's values, as many as its keys.
    pub values: &'c [E],
}

impl<E> Clone for KvRun<'_, E> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<E> Copy for KvRun<'_, E> {}

#[inline(always)]
fn attend_impl<const FMA: bool, E: Weight>(
    q: &[f32],
    runs: &[KvRun<'_, E>],
    seen: usize,
    h: KvHead,
    out: &mut [f32],
    scores: &mut Vec<f32>,
) {
    let dim = q.len();
    scores.resize(seen, 0.0);
    // The runs' first `seen` tokens, as (run, tokens of it, index of its first).
    let visible = || {
        runs.iter().scan(0, move |base, r| {
            let first = *base;
            let n = (r.keys.len() / h.stride).min(seen.saturating_sub(first));
            *base += n;
            (n > 0).then_some((r, n, first))
        })
    };
    for (r, n, first) in visible() {
        let key = |j: usize| &r.keys[j * h.stride + h.offset..][..dim];
        // Eight keys at a time: independent sums (see `dots`) and `q` loaded once for eight.
        // A key's sum is the same whichever keys it is grouped with (see `lane_sum`), so a
        // cache read in runs scores as the same cache read whole.
        let mut blocks = scores[first..first + n].chunks_exact_mut(8);
        for (b, s8) in (&mut blocks).enumerate() {
            let rows = std::array::from_fn(|i| key(8 * b + i));
            #[cfg(target_arch = "x86_64")]
            if FMA {
                assert!(rows.iter().all(|r| r.len() == dim));
                // SAFETY: FMA is set only behind the run-time AVX2 + FMA + F16C check, and
                // every row holds `dim` values, as `q` does (asserted).
                s8.copy_from_slice(&unsafe { dots8_fma(rows, q, dim / 8 * 8) });
                continue;
            }
            s8.copy_from_slice(&dots::<FMA, 8, E>(rows, q));
        }
        let done = n / 8 * 8;
        for (j, s) in blocks.into_remainder().iter_mut().enumerate() {
            *s = dots::<FMA, 1, E>([key(done + j)], q)[0];
        }
    }
    let mut max = f32::NEG_INFINITY;
    for s in scores.iter_mut() {
        *s *= h.scale;
        max = max.max(*s);
    }
    let mut sum = 0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    for s in scores.iter_mut() {
        *s /= sum;
    }
    out.fill(0.0);
    for (r, n, first) in visible() {
        let p = &scores[first..first + n];
        #[cfg(target_arch = "x86_64")]
        if FMA {
            // SAFETY: FMA is set only behind the run-time AVX2 + FMA + F16C check.
            unsafe { weigh_fma(p, r.values, h.stride, h.offset, out) };
            continue;
        }
        for (j, &pj) in p.iter().enumerate() {
            let v = &r.values[j * h.stride + h.offset..][..dim];
            for (o, x) in out.iter_mut().zip(v) {
                *o = madd::<FMA>(pj, x.f32(), *o);
            }
        }
    }
}

/// One query head's attention for one token: `q` `[dim]`, `runs` its sequence's cache in
/// order (see [`KvRun`]), of which the first `seen` positions are visible (causal: the token's
/// own position + 1); writes `[dim]` into `out`. Softmax in f32 with the maximum subtracted, as
/// torch computes it. `scores` is scratch space. Runs the AVX2 + FMA build where the CPU has
/// it (and F16C, which every such CPU has, for f16 caches), else the baseline one.
pub fn attend_head<E: Weight>(
    q: &[f32],
    runs: &[KvRun<'_, E>],
    seen: usize,
    h: KvHead,
    out: &mut [f32],
    scores: &mut Vec<f32>,
) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn fast<E: Weight>(
            q: &[f32],
            runs: &[KvRun<'_, E>],
            seen: usize,
            h: KvHead,
            out: &mut [f32],
            scores: &mut Vec<f32>,
        ) {
            attend_impl::<true, E>(q, runs, seen, h, out, scores)
        }
        if super::cpu::caps().avx2_fma_f16c() {
            // SAFETY: the CPU has AVX2, FMA and F16C (checked at run time).
            return unsafe { fast(q, runs, seen, h, out, scores) };
        }
    }
    attend_impl::<false, E>(q, runs, seen, h, out, scores)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn val(i: usize) -> f32 {
        ((i * 7919 % 101) as f32 - 50.0) / 37.0
    }

    /// Attention equals the plain formula (both builds: the test machine picks one, the
    /// baseline is called directly), for cache lengths that fill the eight-key blocks and
    /// leave every remainder; a cache read in runs gives the same bits as read whole. A bf16
    /// or f16 cache gives the formula over its own (rounded) values: widening is exact and
    /// the sums are f32 as an f32 cache's are, so the bound is the same.
    #[test]
    fn attention_matches_the_formula() {
        // 12: the products' 8-wide tail; 72: the outputs' 64-wide chunk and its tail; 19
        // keys: two blocks of eight and a remainder.
        for (dim, len) in [(12, 9), (72, 19)] {
            attention_matches_the_formula_at(dim, len, |x| x);
            attention_matches_the_formula_at(dim, len, half::bf16::from_f32);
            attention_matches_the_formula_at(dim, len, half::f16::from_f32);
        }
    }

    fn attention_matches_the_formula_at<E: Weight>(dim: usize, len: usize, round: fn(f32) -> E) {
        let (nq, nkv) = (4, 2);
        let scale = 1.0 / (dim as f32).sqrt();
        let q: Vec<f32> = (0..nq * dim).map(val).collect();
        let keys: Vec<E> = (0..len * nkv * dim).map(|i| round(val(i + 3))).collect();
        let values: Vec<E> = (0..len * nkv * dim).map(|i| round(val(i + 11))).collect();
        let mut scores = Vec::new();
        for seen in 1..=len {
            for head in 0..nq {
                let g = head / (nq / nkv);
                let s: Vec<f64> = (0..seen)
                    .map(|j| {
                        (0..dim)
                            .map(|d| {
                                q[head * dim + d] as f64
                                    * keys[(j * nkv + g) * dim + d].f32() as f64
                            })
                            .sum::<f64>()
                            * scale as f64
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                let want: Vec<f32> = (0..dim)
                    .map(|d| {
                        (0..seen)
                            .map(|j| {
                                (s[j] - m).exp() / z * values[(j * nkv + g) * dim + d].f32() as f64
                            })
                            .sum::<f64>() as f32
                    })
                    .collect();
                let kv = KvHead {
                    stride: nkv * dim,
                    offset: g * dim,
                    scale,
                };
                let qh = &q[head * dim..(head + 1) * dim];
                let w = nkv * dim;
                let whole = [KvRun {
                    keys: &keys[..],
                    values: &values[..],
                }];
                // The same cache in runs of 2, 4 and 3 tokens (a prefix read in blocks, its
                // own tokens after).
                let cut = |a: usize, b: usize| KvRun {
                    keys: &keys[a * w..b * w],
                    values: &values[a * w..b * w],
                };
                let split = [cut(0, 2), cut(2, 6), cut(6, len)];
                let check = |out: &[f32]| {
                    for (a, b) in out.iter().zip(&want) {
                        assert!((a - b).abs() < 1e-5, "seen {seen}: {a} vs {b}");
                    }
                };
                let mut plain = vec![9f32; dim];
                attend_impl::<false, E>(qh, &whole, seen, kv, &mut plain, &mut scores);
                check(&plain);
                let mut out = vec![9f32; dim];
                attend_head(qh, &whole, seen, kv, &mut out, &mut scores);
                check(&out);
                let mut runs = vec![9f32; dim];
                attend_head(qh, &split, seen, kv, &mut runs, &mut scores);
                assert_eq!(runs, out, "seen {seen}: runs change the result");
            }
        }
    }
}
