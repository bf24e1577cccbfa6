//! Products with GGML block-quantized weights (GGUF q4_0, q4_1, q8_0, q4_K, q5_K and q6_K files,
//! and AWQ/GPTQ checkpoints repacked into Q4_1 blocks) on the CPU.
//!
//! llama.cpp's arithmetic: each activation row is rounded once per product to 8 bits per
//! block of 32 ([`Q8Rows`]: scale `d = max|x| / 127`, and `s = d·Σq`), then each weight block
//! meets each activation block as `d_w·d_x·Σ q_w·q_x` (+ `m_w·s_x` for Q4_1's minimum), the
//! 4- or 8-bit × 8-bit products summed exactly in integers (AVX2 `maddubs`/`madd`).
//!
//! Why it is tiled: a decode step of 16 rows multiplies every weight block with 16 activation
//! rows. Unpacking the block (nibbles to bytes, two f16 scales to f32) is as much work as one
//! row's integer dot, so the block is unpacked once for a tile of [`TILE`] rows, whose
//! accumulators are independent (the FMA latency of one row's chain no longer bounds the loop).
//! candle 0.11 computes each (weight row, activation row) dot on its own (and Q4_1's with its
//! generic scalar loop on x86).
//!
//! A lone activation row (batch-1 decode) has no rows to share a block with: it meets tiles of
//! [`COL_TILE`] weight rows instead, each its own accumulator, so the multiply-adds of one
//! weight row no longer wait on each other (Q8_0 at batch 1 read its weights at 14.7 GB/s that
//! way, at 31 GB/s tiled), and reads the next tiles ahead, as rows this short (612 bytes for
//! SmolLM2's Q8_0) are streams too short for the hardware prefetchers.
//!
//! On CPUs with AVX-512 VNNI a product of [`panel::MIN_ROWS`] activation rows or more (a decode
//! step of several rows, a prefill) takes the 32-wide formats by panels instead ([`panel`]):
//! sixteen weight rows repacked per product so that one 512-bit `vpdpbusd` serves all sixteen,
//! each block's sum exact in one lane (one SmolLM2 decode step of 16 rows on one core: Q8_0
//! 209 → 603 tok/s; a 158-token prefill 645 → 1052 prompt tokens/s), and the k-quants by
//! their own panels ([`panel_k`]) from [`K_PANEL_ROWS`] rows. Fewer k-quant rows (a decode
//! step of 1 to 11) go by [`k_row`] where the CPU has AVX-512 BW: each super-block read in
//! place, 128 values to a register, in the panels' arithmetic (a lone row of the wide Q4_K_M
//! file on one core: 96 → 224 tok/s; 4 rows 192 → 408).
//!
//! Elsewhere, a product of more than [`GEMM_ROWS`] activation rows (a prefill) takes another
//! way: each column block's weights are dequantized exactly to f32 (`d·q + m` from the f16 scales, as
//! candle dequantizes them) and multiplied with the f32 activations by gemm, whose register
//! tiles reuse every load for many rows. Dequantizing costs about one row's products, so with
//! many rows the product runs at the dense f32 rate: a 218-token prompt of SmolLM2's Q4_1 file
//! prefilled in about the time of its bf16 import's (the integer path took 1.6 times as long),
//! and the result is candle's dequantized reference's up to the order of the sums, with no
//! 8-bit rounding of the activations.
//!
//! The k-quants (super-blocks of 256 values) meet activation rows with one scale per 256
//! values, as llama.cpp's `block_q8_K`: a q4_K or q5_K super-block is eight sub-blocks of 32
//! values, each `d·sc·q - dmin·m` with its own 6-bit integer scale and minimum, a q6_K one has
//! a signed 8-bit scale per 16 values; with one activation scale `dx` per 256, a super-block's
//! products sum exactly in integers, each sub-block's sum weighted by its integer scale, and
//! meet the float scales once: `d·dx·Σ sc·Σ q·x - dmin·dx·Σ m·Σ x`, so a tile holds
//! [`K_TILE`] rows. (With a scale per 32 the products of every block of 32 needed their own
//! float step: batch 16 ran at 0.59x the bf16 form's rate; with tiles of 4 rows at 0.73x, of 8
//! at 0.96-0.98x.) The activations round within the same bound per value, `dx/2`.
//!
//! Why mole multiplies the k-quants itself although candle 0.11.1 has fast products for them:
//! candle repacks q4_K (and q6_K, for more than one row) on first use into expanded tiles that
//! it keeps beside the blocks for the tensor's life, so a q4_K base's memory about doubles
//! after its first request (tests/quantized_memory.rs), while `/v1/models`, the startup log
//! and the KV-cache budget count the blocks. Those tiles are faster at batch 16 (`bench decode
//! --gguf-synthetic q4_k_m --hidden 1024 --layers 8`, 2 cores: 1.24x the bf16 form's rate,
//! against 0.96-0.98x here); at batch 1 the two run alike.
//!
//! The scalar build ([`Isa::Scalar`], CPUs without AVX2, FMA and F16C) gives the AVX2 build's
//! results bit for bit: it sums the same integer products into the same eight lanes and adds
//! the lanes in the AVX2 reduction's order. The activation scales stay f32 where ggml rounds
//! them to f16, so the error is at most the 8-bit rounding's (see [`Q8Rows`]).

mod block32;
mod k;
mod k_row;
mod panel;
mod panel_k;
mod rows;

#[cfg(feature = "bench-seams")]
use std::sync::atomic::{AtomicU8, Ordering};

use candle_core::quantized::GgmlDType;

use super::cpu::Isa;

#[cfg(target_arch = "x86_64")]
use block32::{dots_avx2, dots_cols_avx2, dots_cols_vnni, dots_vnni};
use block32::{dots_scalar, unpack};
#[cfg(target_arch = "x86_64")]
use k::dots_k_avx2;
use k::{dots_k_scalar, k_block_bytes, k_scales, k_values};

/// Values per block (and per activation block of [`Q8Rows`]).
pub const BLOCK: usize = 32;
/// Values per k-quant super-block.
pub const SUPER: usize = 256;
/// Activation rows multiplied with the weight rows of a column block while they are in L1.
const ROW_TILE: usize = 16;
/// Activation rows over which [`matmul`] multiplies dequantized weights by gemm.
pub const GEMM_ROWS: usize = 64;
/// Activation rows that share one unpacked weight block: four accumulators, the unpacked
/// block and the loads fit AVX2's sixteen registers.
const TILE: usize = 4;
/// Weight rows multiplied with a lone activation row at once (see `dots_cols_avx2`).
const COL_TILE: usize = 4;
/// Activation rows from which the k-quants take the panels rather than [`k_row`], where the
/// CPU has both. One core, the wide Q4_K_M file: a decode step of 4 rows ran at 408 tok/s by
/// `k_row` against 192 by panels, one of 16 at 439 against 532; with each way's time a fixed
/// part (the panels' repack) plus a part per row, they cross at about 12 rows.
const K_PANEL_ROWS: usize = 12;
/// Activation rows that share one unpacked k-quant super-block: its products sum in eight
/// integer accumulators (the float ones are touched once per super-block), and unpacking a
/// super-block (scales, values) costs more than a block of 32, so it serves twice the rows.
const K_TILE: usize = 8;

/// A block format the kernel multiplies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// `d` (f16), 16 bytes of nibbles: `d·(q - 8)`.
    Q4_0,
    /// `d`, `m` (f16), 16 bytes of nibbles: `d·q + m`.
    Q4_1,
    /// `d` (f16), 32 signed bytes: `d·q`.
    Q8_0,
    /// Super-block of 256: `d`, `dmin` (f16), 12 bytes of 6-bit scales and minimums for eight
    /// sub-blocks of 32, 128 bytes of nibbles: `d·sc·q - dmin·m`.
    Q4K,
    /// As [`Format::Q4K`] with a fifth bit per value (32 bytes of high bits before the
    /// nibbles): values 0..32.
    Q5K,
    /// Super-block of 256: 128 bytes of low nibbles, 64 of 2-bit high parts, 16 signed 8-bit
    /// scales (one per 16 values), `d` (f16) last: `d·sc·(q - 32)`.
    Q6K,
}

impl Format {
    /// The format of GGML blocks of type `t`, where the kernel covers it.
    pub fn of(t: GgmlDType) -> Option<Self> {
        match t {
            GgmlDType::Q4_0 => Some(Self::Q4_0),
            GgmlDType::Q4_1 => Some(Self::Q4_1),
            GgmlDType::Q8_0 => Some(Self::Q8_0),
            GgmlDType::Q4K => Some(Self::Q4K),
            GgmlDType::Q5K => Some(Self::Q5K),
            GgmlDType::Q6K => Some(Self::Q6K),
            _ => None,
        }
    }

    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self {
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q8_0 => 34,
            Self::Q4K => 144,
            Self::Q5K => 176,
            Self::Q6K => 210,
        }
    }

    /// Values per block: a row's length is a multiple of it.
    pub const fn block_values(self) -> usize {
        match self {
            Self::Q4_0 | Self::Q4_1 | Self::Q8_0 => BLOCK,
            Self::Q4K | Self::Q5K | Self::Q6K => SUPER,
        }
    }

    /// Bytes of a weight row of `k` values.
    pub const fn row_bytes(self, k: usize) -> usize {
        k / self.block_values() * self.block_bytes()
    }

    /// As a const-generic parameter.
    const fn id(self) -> u8 {
        self as u8
    }
}

const Q4_0: u8 = Format::Q4_0.id();
const Q4_1: u8 = Format::Q4_1.id();
const Q8_0: u8 = Format::Q8_0.id();
const Q4K: u8 = Format::Q4K.id();
const Q5K: u8 = Format::Q5K.id();
const Q6K: u8 = Format::Q6K.id();

/// How quantized products are computed in this process: `bench decode --gguf` times them side
/// by side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Panels ([`panel`]) from [`panel::MIN_ROWS`] rows where the CPU has AVX-512 VNNI,
    /// else the tiled kernel (the default).
    Panels = 0,
    /// The tiled kernel, never panels.
    Tiled = 1,
    /// The tiled kernel one activation row at a time (each weight block unpacked once per
    /// row, as the Q4_1 kernel before the tiles did).
    Untiled = 2,
    /// candle's quantized product.
    Off = 3,
}

#[cfg(feature = "bench-seams")]
static MODE: AtomicU8 = AtomicU8::new(Mode::Panels as u8);

/// Sets how quantized products are computed for the process: `mole-bench`'s contenders
/// (feature `bench-seams`, mole-bench's alone; a served build always runs [`Mode::Panels`]).
#[cfg(feature = "bench-seams")]
pub fn set_mode(m: Mode) {
    MODE.store(m as u8, Ordering::Relaxed);
}

#[cfg(feature = "bench-seams")]
fn mode() -> Mode {
    match MODE.load(Ordering::Relaxed) {
        0 => Mode::Panels,
        1 => Mode::Tiled,
        2 => Mode::Untiled,
        _ => Mode::Off,
    }
}

#[cfg(not(feature = "bench-seams"))]
fn mode() -> Mode {
    Mode::Panels
}

/// The best instruction set the CPU has for these kernels: scalar, AVX2 or AVX-VNNI (their
/// AVX-512 builds are the panels', chosen apart: [`panel::available`]).
pub fn isa() -> Isa {
    let c = super::cpu::caps();
    match (c.avx2_fma_f16c(), c.avxvnni) {
        (true, true) => Isa::AvxVnni,
        (true, false) => Isa::Avx2,
        (false, _) => Isa::Scalar,
    }
}

/// Whether weights of format `f` take this kernel: with AVX2 all of them; without, Q4_1 only
/// (candle has SIMD products of its own for q4_0 and q8_0 on ARM and older x86, but runs Q4_1
/// through a scalar loop that the scalar build here beats by summing in integers).
pub fn available(f: Format) -> bool {
    mode() != Mode::Off && (isa() != Isa::Scalar || f == Format::Q4_1)
}

/// Whether products of format `f` over [`panel::MIN_ROWS`] rows or more take the panels.
fn panels(f: Format) -> bool {
    mode() == Mode::Panels && (panel::available(f) || panel_k::available(f))
}

/// Activation rows rounded to 8 bits per block of 32.
///
/// Bound: a value `v` of a block becomes `d·q` with `d = max|x|/127` and `q = round(v/d)`,
/// so it moves by at most `d/2 = max|x|/254`; a product with weights `w` moves by at most
/// `Σ_blocks d/2 · Σ|w|` (tested on the kernel against the dequantized f32 product).
pub struct Q8Rows {
    /// Per block of 32: its scale (the same for the eight blocks of a group of 256 in rows
    /// made by [`Q8Rows::for_format`] for a k-quant).
    d: Vec<f32>,
    /// Per block of 32: its scale times the sum of its values (what a Q4_1 block's minimum
    /// multiplies), grouped by [`S_GROUP`] rows block by block, the rows of a group side by side
    /// (`[(row / S_GROUP · blocks + block) · S_GROUP + row % S_GROUP]`, the last group padded
    /// with zeros): a tile of rows reads a block's values of all its rows with one load.
    s: Vec<f32>,
    /// Per block of 32: the sum of its values.
    sums: Vec<i32>,
    /// Per block of 32, in rows scaled per 256 (the k-quants'): the sum of its first 16
    /// values (q6_K's scales cover 16 values each); empty otherwise.
    halves: Vec<i32>,
    /// The values, `k` per row.
    qs: Vec<i8>,
    /// Values per row.
    k: usize,
    /// Values that share a scale: [`BLOCK`], or [`SUPER`].
    per: usize,
}

impl Q8Rows {
    /// `t` rows of `k` values from `xs` row-major, as weights of format `f` multiply them:
    /// a scale per 32 values for the 32-wide formats, per 256 for a k-quant (as llama.cpp's
    /// `block_q8_K`, so that a super-block's products sum in integers). Rows with a scale per
    /// 256 serve the 32-wide formats too, rounded more coarsely (within the same bound, `d/2`
    /// per value, with `d` the larger scale).
    pub fn for_format(f: Format, xs: &[f32], t: usize, k: usize) -> Self {
        Self::scaled_per(xs, t, k, f.block_values())
    }

    fn scaled_per(xs: &[f32], t: usize, k: usize, per: usize) -> Self {
        debug_assert!(k.is_multiple_of(per) && xs.len() >= t * k);
        let (blocks, nb) = (t * k / BLOCK, k / BLOCK);
        let mut d = Vec::with_capacity(blocks);
        let mut s = vec![0f32; t.div_ceil(S_GROUP) * S_GROUP * nb];
        let mut sums = Vec::with_capacity(blocks);
        let mut halves = Vec::new();
        let simd = rows::vectors();
        let mut qs = vec![0i8; t * k];
        for (x, q) in xs[..t * k].chunks_exact(per).zip(qs.chunks_exact_mut(per)) {
            let scale = rows::amax(x, simd) / 127.0;
            let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
            for (x, q) in x.chunks_exact(BLOCK).zip(q.chunks_exact_mut(BLOCK)) {
                let sum = rows::round_block(x, inv, q, simd);
                if per == SUPER {
                    halves.push(q[..BLOCK / 2].iter().map(|&v| v as i32).sum());
                }
                s[s_index(nb, d.len() / nb, d.len() % nb)] = scale * sum as f32;
                d.push(scale);
                sums.push(sum);
            }
        }
        Self {
            d,
            s,
            sums,
            halves,
            qs,
            k,
            per,
        }
    }

    /// Block `b`'s scale times its values' sum, of row `row`.
    fn s_at(&self, row: usize, b: usize) -> f32 {
        self.s[s_index(self.k / BLOCK, row, b)]
    }

    /// Rows held.
    pub fn rows(&self) -> usize {
        self.qs.len() / self.k.max(1)
    }
}

/// `out[i·width + c]` (added to what it holds when `accumulate`) = row `i` of `x` · weight row
/// `c` for every row of `x` and every column `c` of `cols`, whose weight rows `w` holds
/// (`cols.len()` rows of `k / 32` blocks of `f`).
///
/// # Safety
/// `isa` is one the CPU has ([`isa`]); `out` is valid for writes of `x.rows()` rows of
/// `width` values, and no other thread touches these columns meanwhile.
#[allow(clippy::too_many_arguments)]
pub unsafe fn product(
    isa: Isa,
    f: Format,
    x: &Q8Rows,
    w: &[u8],
    cols: std::ops::Range<usize>,
    out: *mut f32,
    width: usize,
    accumulate: bool,
) {
    if mode() == Mode::Panels {
        if f.block_values() == SUPER && x.rows() < K_PANEL_ROWS && k_row::available() {
            // SAFETY: the caller's guarantees; `available` checked the CPU.
            return unsafe { k_row::product(f, x, w, cols, out, width, accumulate) };
        }
        if x.rows() >= panel::MIN_ROWS && panels(f) {
            // SAFETY: the caller's guarantees; `panels` checked the CPU.
            return unsafe {
                if f.block_values() == SUPER {
                    panel::product_by(&panel_k::SCRATCH, f, x, w, cols, out, width, accumulate)
                } else {
                    panel::product_by(&panel::SCRATCH, f, x, w, cols, out, width, accumulate)
                }
            };
        }
    }
    let tile = if mode() == Mode::Untiled {
        1
    } else {
        tile_of(f)
    };
    // SAFETY: the caller's guarantees.
    unsafe { product_by(isa, f, x, w, cols, out, width, accumulate, tile) }
}

/// [`product`] with `tile` activation rows (1..=[`tile_of`] `f`) per unpacked weight block.
///
/// # Safety
/// As [`product`].
#[allow(clippy::too_many_arguments)]
unsafe fn product_by(
    isa: Isa,
    f: Format,
    x: &Q8Rows,
    w: &[u8],
    cols: std::ops::Range<usize>,
    out: *mut f32,
    width: usize,
    accumulate: bool,
    tile: usize,
) {
    let row_bytes = f.row_bytes(x.k);
    assert!(w.len() >= cols.len() * row_bytes, "weight rows missing");
    let rows = x.rows();
    for lo in (0..rows).step_by(ROW_TILE) {
        let hi = (lo + ROW_TILE).min(rows);
        if hi - lo == 1 && tile > 1 && f.block_values() == BLOCK {
            // A lone row: tiles of weight rows instead (see `dots_cols_avx2`).
            let mut j = 0;
            while j < cols.len() {
                let m = (cols.len() - j).min(COL_TILE);
                // SAFETY: the caller's guarantee on `isa`.
                let v = unsafe { dots_cols(isa, f, &w[j * row_bytes..], row_bytes, x, lo, m) };
                for (q, v) in v[..m].iter().enumerate() {
                    // SAFETY: within the rows and columns the caller owns.
                    unsafe {
                        let o = out.add(lo * width + cols.start + j + q);
                        *o = if accumulate { *o + v } else { *v };
                    }
                }
                j += m;
            }
            continue;
        }
        for (j, c) in cols.clone().enumerate() {
            let wr = &w[j * row_bytes..(j + 1) * row_bytes];
            let mut i = lo;
            while i < hi {
                let n = (hi - i).min(tile);
                // SAFETY: the caller's guarantee on `isa`.
                let v = unsafe { dots(isa, f, wr, x, i, n) };
                for (r, v) in v[..n].iter().enumerate() {
                    // SAFETY: within the rows and columns the caller owns.
                    unsafe {
                        let o = out.add((i + r) * width + c);
                        *o = if accumulate { *o + v } else { *v };
                    }
                }
                i += n;
            }
        }
    }
}

/// Weight row `w` · activation rows `i..i + n` (`n` ≤ [`tile_of`] the format), in the first
/// `n` values.
///
/// # Safety
/// `isa` is one the CPU has.
unsafe fn dots(isa: Isa, f: Format, w: &[u8], x: &Q8Rows, i: usize, n: usize) -> [f32; K_TILE] {
    macro_rules! by_rows {
        ($run:ident, $f:expr) => {
            match n {
                1 => widen($run::<$f, 1>(w, x, i)),
                2 => widen($run::<$f, 2>(w, x, i)),
                3 => widen($run::<$f, 3>(w, x, i)),
                _ => widen($run::<$f, 4>(w, x, i)),
            }
        };
    }
    macro_rules! by_rows_k {
        ($run:ident, $f:expr) => {
            match n {
                1 => widen($run::<$f, 1>(w, x, i)),
                2 => widen($run::<$f, 2>(w, x, i)),
                3 => widen($run::<$f, 3>(w, x, i)),
                4 => widen($run::<$f, 4>(w, x, i)),
                5 => widen($run::<$f, 5>(w, x, i)),
                6 => widen($run::<$f, 6>(w, x, i)),
                7 => widen($run::<$f, 7>(w, x, i)),
                _ => widen($run::<$f, 8>(w, x, i)),
            }
        };
    }
    macro_rules! by_format {
        ($run:ident, $run_k:ident) => {
            match f {
                Format::Q4_0 => by_rows!($run, Q4_0),
                Format::Q4_1 => by_rows!($run, Q4_1),
                Format::Q8_0 => by_rows!($run, Q8_0),
                Format::Q4K => by_rows_k!($run_k, Q4K),
                Format::Q5K => by_rows_k!($run_k, Q5K),
                Format::Q6K => by_rows_k!($run_k, Q6K),
            }
        };
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's guarantee: the CPU has AVX2, FMA and F16C.
        Isa::Avx2 => unsafe { by_format!(dots_avx2, dots_k_avx2) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's guarantee: the CPU has AVX2, FMA, F16C and AVX-VNNI.
        Isa::AvxVnni => unsafe { by_format!(dots_vnni, dots_k_avx2) },
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Avx2 | Isa::AvxVnni => unreachable!("AVX2 is never detected off x86-64"),
        Isa::Avx512 => unreachable!("isa() never picks AVX-512: the panels are its build"),
        Isa::Scalar => by_format!(dots_scalar, dots_k_scalar),
    }
}

/// Activation row `i` · the `m` (≤ [`COL_TILE`]) weight rows of `row_bytes` each at the start
/// of `w` (a 32-wide format), in the first `m` values: bit-equal to [`dots`] row by row.
///
/// # Safety
/// `isa` is one the CPU has.
unsafe fn dots_cols(
    isa: Isa,
    f: Format,
    w: &[u8],
    row_bytes: usize,
    x: &Q8Rows,
    i: usize,
    m: usize,
) -> [f32; COL_TILE] {
    let row = |c: usize| &w[c * row_bytes..(c + 1) * row_bytes];
    // Four tiles ahead: about the DRAM latency's worth of blocks at this kernel's pace
    // (measured: one or two tiles ahead left the Q4_1 stream at its row-by-row rate, eight
    // lost some of Q8_0's gain).
    let ahead = w.as_ptr().wrapping_add(4 * m * row_bytes);
    match isa {
        #[cfg(target_arch = "x86_64")]
        isa @ (Isa::Avx2 | Isa::AvxVnni) => {
            macro_rules! by_cols {
                ($run:ident, $f:expr) => {
                    // SAFETY: the caller's guarantee: the CPU has AVX2, FMA and F16C.
                    unsafe {
                        match m {
                            1 => widen_cols($run::<$f, 1>([row(0)], ahead, x, i)),
                            2 => widen_cols($run::<$f, 2>([row(0), row(1)], ahead, x, i)),
                            3 => widen_cols($run::<$f, 3>([row(0), row(1), row(2)], ahead, x, i)),
                            _ => widen_cols($run::<$f, 4>(
                                [row(0), row(1), row(2), row(3)],
                                ahead,
                                x,
                                i,
                            )),
                        }
                    }
                };
            }
            macro_rules! by_format {
                ($run:ident) => {
                    match f {
                        Format::Q4_0 => by_cols!($run, Q4_0),
                        Format::Q4_1 => by_cols!($run, Q4_1),
                        Format::Q8_0 => by_cols!($run, Q8_0),
                        _ => unreachable!("the k-quants tile their own way"),
                    }
                };
            }
            if isa == Isa::AvxVnni {
                by_format!(dots_cols_vnni)
            } else {
                by_format!(dots_cols_avx2)
            }
        }
        _ => {
            let mut out = [0f32; COL_TILE];
            for (c, o) in out.iter_mut().enumerate().take(m) {
                // SAFETY: the caller's guarantee on `isa`.
                *o = unsafe { dots(isa, f, row(c), x, i, 1) }[0];
            }
            out
        }
    }
}

/// `C` values in the first `C` of a column tile.
fn widen_cols<const C: usize>(v: [f32; C]) -> [f32; COL_TILE] {
    let mut out = [0f32; COL_TILE];
    out[..C].copy_from_slice(&v);
    out
}

/// The rows a format's tile holds: [`K_TILE`] for the k-quants, else [`TILE`].
const fn tile_of(f: Format) -> usize {
    if f.block_values() == SUPER {
        K_TILE
    } else {
        TILE
    }
}

/// `R` values in the first `R` of a tile.
fn widen<const R: usize>(v: [f32; R]) -> [f32; K_TILE] {
    let mut out = [0f32; K_TILE];
    out[..R].copy_from_slice(&v);
    out
}

/// The f16 at `p` (little-endian) as f32.
fn f16_at(p: &[u8]) -> f32 {
    half::f16::from_le_bytes([p[0], p[1]]).to_f32()
}

/// Rows whose block values `s` lie side by side in [`Q8Rows`] (a tile of the 32-wide formats).
const S_GROUP: usize = 4;

/// Where [`Q8Rows::s`] holds block `b` of row `row`, for rows of `nb` blocks.
fn s_index(nb: usize, row: usize, b: usize) -> usize {
    ((row / S_GROUP) * nb + b) * S_GROUP + row % S_GROUP
}

/// The sum of eight lanes, in the order [`scalar_lane_sum`] adds them.
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn lane_sum(acc: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let hi = _mm256_extractf128_ps::<1>(acc);
    let v = _mm_add_ps(_mm256_castps256_ps128(acc), hi);
    let v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    let v = _mm_add_ss(v, _mm_movehdup_ps(v));
    _mm_cvtss_f32(v)
}

/// [`lane_sum`] in portable Rust: halves, then pairs, then the two.
fn scalar_lane_sum(a: &[f32; 8]) -> f32 {
    let v = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    (v[0] + v[2]) + (v[1] + v[3])
}

/// `x·Wᵀ` for `x` `[t, k]` row-major and `W` `n` rows of blocks of `f`: `[t, n]`, column
/// blocks spread over the thread pool. None where the kernel does not take `f`
/// ([`available`]).
pub fn matmul(f: Format, xs: &[f32], t: usize, k: usize, w: &[u8], n: usize) -> Option<Vec<f32>> {
    use rayon::prelude::*;
    if !available(f) {
        return None;
    }
    if t > GEMM_ROWS && !panels(f) {
        return Some(by_gemm(f, xs, t, k, w, n));
    }
    let mut out = vec![0f32; t * n];
    let ptr = Out(out.as_mut_ptr());
    let row_bytes = f.row_bytes(k);
    let isa = isa();
    let x = Q8Rows::for_format(f, xs, t, k);
    (0..n.div_ceil(PER_TASK)).into_par_iter().for_each(|b| {
        let cols = b * PER_TASK..((b + 1) * PER_TASK).min(n);
        let ptr = &ptr;
        // SAFETY: `isa` is the CPU's; `out` holds t × n values and each block of columns is
        // written by one task only.
        unsafe {
            product(
                isa,
                f,
                &x,
                &w[cols.start * row_bytes..cols.end * row_bytes],
                cols,
                ptr.0,
                n,
                false,
            )
        };
    });
    Some(out)
}

/// Column blocks of [`matmul`]: enough for every thread to take several, each long enough to
/// cost little to start.
const PER_TASK: usize = 64;

/// [`matmul`] of many rows with the column blocks' weights dequantized exactly to f32 and
/// multiplied by gemm (see the module).
fn by_gemm(f: Format, xs: &[f32], t: usize, k: usize, w: &[u8], n: usize) -> Vec<f32> {
    use rayon::prelude::*;
    let mut out = vec![0f32; t * n];
    let ptr = Out(out.as_mut_ptr());
    let row_bytes = f.row_bytes(k);
    (0..n.div_ceil(PER_TASK))
        .into_par_iter()
        .for_each_init(Vec::new, |wide: &mut Vec<f32>, b| {
            let cols = b * PER_TASK..((b + 1) * PER_TASK).min(n);
            let blocks = &w[cols.start * row_bytes..cols.end * row_bytes];
            dequantize(f, blocks, cols.len(), k, wide);
            let ptr = &ptr;
            // SAFETY: `out` holds t × n values, each block of columns written by one task
            // only; `xs` holds t × k values and `wide` the block's cols × k.
            unsafe {
                super::gemm_by_rows(t, cols.len(), k, ptr.0.add(cols.start), n, false, xs, wide)
            };
        });
    out
}

/// The values of `rows` weight rows of `k` values in blocks of `f`, exactly as f32 (`d·q + m`),
/// row-major into `out`: candle's dequantized values bit for bit.
fn dequantize(f: Format, w: &[u8], rows: usize, k: usize, out: &mut Vec<f32>) {
    fn rows_of<const F: u8>(w: &[u8], blocks: usize, out: &mut Vec<f32>) {
        let bb = w.len() / blocks.max(1);
        for blk in w.chunks_exact(bb).take(blocks) {
            let (q, d, m) = unpack::<F>(blk);
            out.extend(q.iter().map(|&q| d * q as f32 + m));
        }
    }
    fn k_rows_of<const F: u8>(w: &[u8], blocks: usize, out: &mut Vec<f32>) {
        for blk in w.chunks_exact(k_block_bytes::<F>()).take(blocks) {
            let (q, (scale, min)) = (k_values::<F>(blk), k_scales::<F>(blk));
            out.extend(q.iter().enumerate().map(|(p, &q)| {
                let v = scale[p / 16] * q as f32;
                // candle subtracts no minimum from q6_K: `- 0.0` would turn its -0.0 to 0.0.
                if F == Q6K {
                    v
                } else {
                    v - min[p / BLOCK]
                }
            }));
        }
    }
    out.clear();
    out.reserve(rows * k);
    let blocks = rows * k / f.block_values();
    match f {
        Format::Q4_0 => rows_of::<Q4_0>(w, blocks, out),
        Format::Q4_1 => rows_of::<Q4_1>(w, blocks, out),
        Format::Q8_0 => rows_of::<Q8_0>(w, blocks, out),
        Format::Q4K => k_rows_of::<Q4K>(w, blocks, out),
        Format::Q5K => k_rows_of::<Q5K>(w, blocks, out),
        Format::Q6K => k_rows_of::<Q6K>(w, blocks, out),
    }
}

/// The output of [`matmul`], shared by the tasks that write its disjoint column blocks.
struct Out(*mut f32);
// SAFETY: the tasks that share it write disjoint elements while the buffer lives.
unsafe impl Sync for Out {}
// SAFETY: as for Sync.
unsafe impl Send for Out {}

#[cfg(test)]
#[allow(clippy::disallowed_methods)] // a test reads its results back to compare them
mod tests {
    use super::*;

    /// Deterministic values in about -1.35..1.35.
    pub(super) fn val(i: usize) -> f32 {
        ((i * 7919 % 101) as f32 - 50.0) / 37.0
    }

    /// Every format the kernel multiplies.
    const FORMATS: [Format; 6] = [
        Format::Q4_0,
        Format::Q4_1,
        Format::Q8_0,
        Format::Q4K,
        Format::Q5K,
        Format::Q6K,
    ];

    /// candle's type of a format.
    fn ggml(f: Format) -> GgmlDType {
        match f {
            Format::Q4_0 => GgmlDType::Q4_0,
            Format::Q4_1 => GgmlDType::Q4_1,
            Format::Q8_0 => GgmlDType::Q8_0,
            Format::Q4K => GgmlDType::Q4K,
            Format::Q5K => GgmlDType::Q5K,
            Format::Q6K => GgmlDType::Q6K,
        }
    }

    /// A row length of two blocks and a half of the 32-wide formats (three of their blocks),
    /// two super-blocks of the k-quants.
    fn width(f: Format) -> usize {
        if f.block_values() == SUPER {
            2 * SUPER
        } else {
            96
        }
    }

    /// candle's dequantization of `n` rows of blocks `w`.
    fn candle_values(f: Format, w: &[u8], n: usize, k: usize) -> Vec<f32> {
        let dev = candle_core::Device::Cpu;
        let q = candle_core::quantized::ggml_file::qtensor_from_ggml(ggml(f), w, vec![n, k], &dev)
            .unwrap();
        q.dequantize(&dev)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    /// `n` weight rows of `k` values in format `f`, and their values dequantized (the k-quants:
    /// every byte drawn at random but the f16 scales, dequantized by candle).
    pub(super) fn weights(f: Format, n: usize, k: usize) -> (Vec<u8>, Vec<f32>) {
        if f.block_values() == SUPER {
            let mut w = Vec::with_capacity(n * f.row_bytes(k));
            let mut state = 0x9E37_79B9_7F4A_7C15u64;
            let mut byte = || {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 24) as u8
            };
            for blk in 0..n * k / SUPER {
                let mut b: Vec<u8> = (0..f.block_bytes()).map(|_| byte()).collect();
                let d = half::f16::from_f32(0.001 + (blk % 13) as f32 * 0.0007);
                let dmin = half::f16::from_f32(0.002 + (blk % 7) as f32 * 0.0005);
                if f == Format::Q6K {
                    b[208..].copy_from_slice(&d.to_le_bytes());
                } else {
                    b[..2].copy_from_slice(&d.to_le_bytes());
                    b[2..4].copy_from_slice(&dmin.to_le_bytes());
                }
                w.extend(b);
            }
            let deq = candle_values(f, &w, n, k);
            return (w, deq);
        }
        let mut w = Vec::new();
        let mut deq = vec![0f32; n * k];
        for c in 0..n {
            for b in 0..k / BLOCK {
                let d = half::f16::from_f32(0.01 + (c + b) as f32 * 0.001);
                let m = half::f16::from_f32(-0.05 * ((c * 3 + b) % 7) as f32);
                w.extend(d.to_le_bytes());
                if f == Format::Q4_1 {
                    w.extend(m.to_le_bytes());
                }
                let at = |j: usize| c * k + b * BLOCK + j;
                match f {
                    Format::Q8_0 => {
                        for j in 0..BLOCK {
                            // The whole byte range, -128 included.
                            let q = ((c * 31 + b * 17 + j * 53) % 256) as u8 as i8;
                            w.push(q as u8);
                            deq[at(j)] = d.to_f32() * q as f32;
                        }
                    }
                    _ => {
                        let q = |j: usize| ((c * 31 + b * 17 + j * 5) % 16) as u8;
                        for j in 0..16 {
                            w.push(q(j) | (q(j + 16) << 4));
                        }
                        for j in 0..BLOCK {
                            deq[at(j)] = match f {
                                Format::Q4_1 => d.to_f32() * q(j) as f32 + m.to_f32(),
                                _ => d.to_f32() * (q(j) as f32 - 8.0),
                            };
                        }
                    }
                }
            }
        }
        assert_eq!(w.len(), n * f.row_bytes(k));
        (w, deq)
    }

    /// The gemm way (over [`GEMM_ROWS`] rows without panels): every format's product is the
    /// dequantized weights' with the
    /// f32 activations, up to the order of the sums: f32 sums of `k` products are within
    /// `k·ε/2·Σ|p|` of the exact sum.
    #[test]
    fn many_rows_multiply_the_exactly_dequantized_weights() {
        let (n, t) = (131, GEMM_ROWS + 9);
        for f in FORMATS {
            let k = width(f);
            let xs: Vec<f32> = (0..t * k).map(|i| val(i * 3 + 1)).collect();
            let (w, deq) = weights(f, n, k);
            let got = by_gemm(f, &xs, t, k, &w, n);
            for i in 0..t {
                for c in 0..n {
                    let (mut want, mut mag) = (0f64, 0f64);
                    for kk in 0..k {
                        let p = xs[i * k + kk] as f64 * deq[c * k + kk] as f64;
                        want += p;
                        mag += p.abs();
                    }
                    let g = got[i * n + c] as f64;
                    assert!(
                        (g - want).abs() <= k as f64 * f64::from(f32::EPSILON) / 2.0 * mag,
                        "{f:?} row {i} col {c}: {g} against {want}"
                    );
                }
            }
        }
    }

    /// Runs the product of all of `x`'s rows with `n` weight rows, in two column blocks.
    fn run(isa: Isa, f: Format, x: &Q8Rows, w: &[u8], n: usize, tile: usize) -> Vec<f32> {
        let mut out: Vec<f32> = (0..x.rows() * n).map(val).collect();
        let mid = n / 2 + 1;
        let row = f.row_bytes(x.k);
        for cols in [0..mid, mid..n] {
            let w = &w[cols.start * row..cols.end * row];
            // SAFETY: `isa` is the CPU's (the caller checks); `out` holds every row and
            // column and this thread alone writes it.
            unsafe { product_by(isa, f, x, w, cols, out.as_mut_ptr(), n, true, tile) };
        }
        // Accumulated onto what `out` held: take it off again for the checks (exact: the
        // kernel's value is the f32 closest to the sum minus the start, within rounding).
        out.iter_mut().enumerate().for_each(|(e, o)| *o -= val(e));
        out
    }

    /// Asserts `got` (every row of `x8` × `n` weight rows) is the product of the 8-bit rows
    /// `x8` with the dequantized weights `deq`: the same products in another order, and the
    /// accumulation onto the output (f32 rounding, ~1e-6 of the sum of magnitudes); and the
    /// product of the f32 activations `xs` within the 8-bit rounding's bound (each activation
    /// moves by at most half its block's step, d/2 = max|x|/254: the product by at most
    /// Σ d/2·|w|).
    pub(super) fn assert_products(
        f: Format,
        x8: &Q8Rows,
        xs: &[f32],
        deq: &[f32],
        got: &[f32],
        n: usize,
    ) {
        let k = x8.k;
        for i in 0..x8.rows() {
            for c in 0..n {
                let (mut exact, mut f32_dot, mut scale, mut rounding) = (0f64, 0f64, 0f64, 0f64);
                for kk in 0..k {
                    let b = (i * k + kk) / BLOCK;
                    let wv = deq[c * k + kk] as f64;
                    let xq = x8.d[b] as f64 * x8.qs[i * k + kk] as f64;
                    exact += xq * wv;
                    f32_dot += xs[i * k + kk] as f64 * wv;
                    scale += (xq * wv).abs();
                    rounding += x8.d[b] as f64 / 2.0 * wv.abs();
                }
                let g = got[i * n + c] as f64;
                assert!(
                    (g - exact).abs() <= 1e-5 * scale + 1e-5,
                    "{f:?} {i},{c}: {g} vs {exact}"
                );
                assert!(
                    (g - f32_dot).abs() <= rounding + 1e-5 * scale + 1e-5,
                    "{f:?} {i},{c}: {g} vs f32 {f32_dot}, bound {rounding}"
                );
            }
        }
    }

    /// Every format against the formula over its dequantized weights: with the 8-bit
    /// activations it multiplies (the same products summed in another order), and with the f32
    /// activations within the 8-bit rounding's bound. Scalar and AVX2 builds, tiled and one row
    /// at a time, agree bit for bit.
    #[test]
    fn products_match_the_formula_and_each_other() {
        let n = 67;
        let mut isas = vec![Isa::Scalar];
        match isa() {
            Isa::Scalar => eprintln!("no AVX2: the scalar build alone is checked"),
            Isa::Avx2 => isas.push(Isa::Avx2),
            Isa::AvxVnni => isas.extend([Isa::Avx2, Isa::AvxVnni]),
            Isa::Avx512 => unreachable!("isa() never picks AVX-512"),
        }
        for f in FORMATS {
            let k = width(f);
            let (w, deq) = weights(f, n, k);
            // One row, a partial tile, and more than an L1 tile of rows.
            for t in [1, 6, 2 * ROW_TILE + 3] {
                let xs: Vec<f32> = (0..t * k)
                    .map(|i| val(i + 3) * (1 + i % 5) as f32)
                    .collect();
                let x8 = Q8Rows::for_format(f, &xs, t, k);
                let got = run(Isa::Scalar, f, &x8, &w, n, tile_of(f));
                for &isa in &isas {
                    for tile in 1..=tile_of(f) {
                        let other = run(isa, f, &x8, &w, n, tile);
                        let same = got
                            .iter()
                            .zip(&other)
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(same, "{f:?} t={t}: {isa:?} with tiles of {tile} differs");
                    }
                }
                assert_products(f, &x8, &xs, &deq, &got, n);
            }
        }
    }

    /// The gemm path's weights are candle's dequantized values bit for bit, every format (the
    /// 32-wide ones from the tests' own blocks, the k-quants from random bytes).
    #[test]
    fn dequantized_weights_are_candles_bit_for_bit() {
        for f in FORMATS {
            let (n, k) = (5, width(f));
            let (w, _) = weights(f, n, k);
            let mut ours = Vec::new();
            dequantize(f, &w, n, k, &mut ours);
            let theirs = candle_values(f, &w, n, k);
            assert_eq!(ours.len(), theirs.len());
            for (e, (a, b)) in ours.iter().zip(&theirs).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{f:?} value {e}: {a} against {b}");
            }
        }
    }

    /// The 8-bit rows: every value within half a step of its activation, sums as held.
    #[test]
    fn activation_rows_round_within_half_a_step() {
        let (t, k) = (3, 64);
        let mut xs: Vec<f32> = (0..t * k)
            .map(|i| val(i) * 10f32.powi(i as i32 % 7 - 3))
            .collect();
        xs[..BLOCK].fill(0.0);
        let x = Q8Rows::for_format(Format::Q8_0, &xs, t, k);
        for (b, v) in xs.chunks(BLOCK).enumerate() {
            let q = &x.qs[b * BLOCK..][..BLOCK];
            let amax = v.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(x.d[b], amax / 127.0);
            for (q, v) in q.iter().zip(v) {
                assert!(
                    (x.d[b] * *q as f32 - v).abs() <= x.d[b] / 2.0 * 1.0001,
                    "{b}"
                );
            }
            let sum: i32 = q.iter().map(|&q| q as i32).sum();
            let nb = k / BLOCK;
            assert_eq!(x.s_at(b / nb, b % nb), x.d[b] * sum as f32);
        }
    }
}
