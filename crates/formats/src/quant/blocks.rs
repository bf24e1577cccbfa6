//! AWQ and GPTQ projections repacked into GGML Q4_1 blocks, which candle's quantized matmul
//! runs on the CPU and on a GPU: a 4-bit checkpoint stays 4-bit in memory (20 bytes per 32
//! weights against AWQ's 16 + its scales and zeros), never widened.
//!
//! Both formats hold, per output row `o` and group `g` of `group` consecutive inputs, 4-bit
//! values `q`, a 4-bit zero point `z` and an f16 scale `s`, and define the weight as
//! `(q - z)·s`. A Q4_1 block holds 32 consecutive inputs of one row as `d·q + m` with `d`, `m`
//! f16 and the same 4-bit `q`. Group sizes 32, 64 and 128 are whole blocks, so each block
//! takes its group's `d = s` (exact: the scale is already f16) and `m = -z·s` rounded to f16,
//! the one inexact step: `z·s` needs up to 15 significant bits where f16 keeps 11, so `m`
//! moves by at most 2⁻¹¹·z·s ≤ 2⁻¹¹·15·s (under 0.8% of one quantization step `s`; for
//! subnormal f16 at most 2⁻²⁵). The formats' own dequantizers (AutoAWQ's `dequantize_gemm`,
//! AutoGPTQ's `QuantLinear`) compute `(q - z)·s` in fp16, rounding it by up to
//! 2⁻¹¹·|q - z|·s: a repacked weight is within 2⁻¹¹·30·s of what transformers serves, and
//! exactly the formula's value where `z·s` fits f16 (e.g. power-of-two scales).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use ::safetensors::tensor::TensorView;
use ::safetensors::{Dtype, SafeTensors};
use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::Device;
use half::f16;

use super::{QuantFormat, QuantScheme};

/// Why a quantized checkpoint could not be read. Stable names via [`QuantError::code`].
#[derive(Debug, thiserror::Error)]
pub enum QuantError {
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// Path.
        path: String,
        /// Cause.
        source: std::io::Error,
    },
    /// A tensor is missing, or of another shape or dtype than the format defines.
    #[error("{0}")]
    Layout(String),
    /// A variant the blocks cannot hold (e.g. a `g_idx` that is not `i / group`).
    #[error("{0}")]
    Unsupported(String),
    /// candle refused the blocks.
    #[error("{0}")]
    Candle(#[from] candle_core::Error),
}

impl QuantError {
    /// Stable name.
    pub fn code(&self) -> &'static str {
        match self {
            QuantError::Io { .. } => "io_error",
            QuantError::Layout(_) => "quantized_layout",
            QuantError::Unsupported(_) => "unsupported_quantization",
            QuantError::Candle(_) => "model_tensor",
        }
    }
}

/// Inputs per Q4_1 block.
const BLOCK: usize = 32;
/// Bytes per Q4_1 block: `d` and `m` (f16), then 16 bytes of nibbles.
const BLOCK_BYTES: usize = 20;

/// AWQ's interleaving undone: the nibble (of eight in a word) that holds output column
/// `o % 8` (AutoAWQ's `AWQ_REVERSE_ORDER`; packing wrote column `[0, 2, 4, 6, 1, 3, 5, 7][k]`
/// into nibble `k`).
const AWQ_NIBBLE: [usize; 8] = [0, 4, 1, 5, 2, 6, 3, 7];

/// One quantized projection as its checkpoint holds it, its layout checked.
pub struct Packed<'a> {
    format: QuantFormat,
    qweight: &'a [u8],
    qzeros: &'a [u8],
    scales: &'a [u8],
    d_in: usize,
    d_out: usize,
    group: usize,
}

fn word(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([
        bytes[4 * at],
        bytes[4 * at + 1],
        bytes[4 * at + 2],
        bytes[4 * at + 3],
    ])
}

impl Packed<'_> {
    /// `[out, in]`: the dense weight's shape.
    pub fn shape(&self) -> [usize; 2] {
        [self.d_out, self.d_in]
    }

    /// Output rows `r0..r0 + out.len() / d_in` of the weight, `(q - z)·s`, in f32. Exact: `q - z`
    /// is an integer of magnitude at most 15 (4 bits) and `s` an f16 with an 11-bit
    /// significand, so the product needs at most 15 significant bits, which f32 holds.
    pub fn dequantize_rows(&self, r0: usize, out: &mut [f32]) {
        for (k, row) in out.chunks_exact_mut(self.d_in).enumerate() {
            let o = r0 + k;
            for (i, w) in row.iter_mut().enumerate() {
                let g = i / self.group;
                *w = (self.q(o, i) as f32 - self.z(g, o) as f32) * self.s(g, o).to_f32();
            }
        }
    }

    /// The 4-bit value of output `o`, input `i`.
    fn q(&self, o: usize, i: usize) -> u8 {
        let (w, nibble) = match self.format {
            QuantFormat::Awq => (
                word(self.qweight, i * (self.d_out / 8) + o / 8),
                AWQ_NIBBLE[o % 8],
            ),
            QuantFormat::Gptq => (word(self.qweight, (i / 8) * self.d_out + o), i % 8),
        };
        ((w >> (4 * nibble)) & 15) as u8
    }

    /// The zero point of output `o` in group `g` (GPTQ v1 stores it minus one).
    fn z(&self, g: usize, o: usize) -> u32 {
        let w = word(self.qzeros, g * (self.d_out / 8) + o / 8);
        match self.format {
            QuantFormat::Awq => (w >> (4 * AWQ_NIBBLE[o % 8])) & 15,
            QuantFormat::Gptq => ((w >> (4 * (o % 8))) & 15) + 1,
        }
    }

    /// The scale of output `o` in group `g`.
    fn s(&self, g: usize, o: usize) -> f16 {
        let at = 2 * (g * self.d_out + o);
        f16::from_le_bytes([self.scales[at], self.scales[at + 1]])
    }

    /// The Q4_1 blocks, row-major: `d_out` rows of `d_in / 32` blocks.
    pub fn q4_1(&self) -> Vec<u8> {
        let per_row = self.d_in / BLOCK;
        let mut out = vec![0u8; self.d_out * per_row * BLOCK_BYTES];
        for (o, row) in out.chunks_mut(per_row * BLOCK_BYTES).enumerate() {
            for (b, block) in row.chunks_mut(BLOCK_BYTES).enumerate() {
                let g = b * BLOCK / self.group;
                let s = self.s(g, o);
                let m = f16::from_f32(-(self.z(g, o) as f32) * s.to_f32());
                block[0..2].copy_from_slice(&s.to_le_bytes());
                block[2..4].copy_from_slice(&m.to_le_bytes());
                for j in 0..BLOCK / 2 {
                    let i = b * BLOCK + j;
                    block[4 + j] = self.q(o, i) | (self.q(o, i + BLOCK / 2) << 4);
                }
            }
        }
        out
    }
}

/// The quantized projections of `files` repacked into Q4_1 blocks on `device`, by module name
/// with `.weight` (e.g. `model.layers.0.self_attn.q_proj.weight`), shaped `[out, in]`.
pub fn load_blocks(
    files: &[PathBuf],
    scheme: QuantScheme,
    device: &Device,
) -> Result<HashMap<String, QTensor>, QuantError> {
    let mut out = HashMap::new();
    for path in files {
        let io = |source| QuantError::Io {
            path: path.display().to_string(),
            source,
        };
        let map = crate::safetensors::map(path).map_err(io)?;
        let st = SafeTensors::deserialize(&map)
            .map_err(|e| QuantError::Layout(format!("{}: {e}", path.display())))?;
        for name in st.names() {
            let Some(module) = name.strip_suffix(".qweight") else {
                continue;
            };
            let blocks = repack(&st, module, scheme, path)?;
            out.insert(format!("{module}.weight"), blocks.into_qtensor(device)?);
        }
    }
    Ok(out)
}

/// Q4_1 bytes and the `[out, in]` shape they hold.
struct Blocks {
    bytes: Vec<u8>,
    d_out: usize,
    d_in: usize,
}

impl Blocks {
    fn into_qtensor(self, device: &Device) -> candle_core::Result<QTensor> {
        let storage =
            QStorage::from_data(std::borrow::Cow::Owned(self.bytes), device, GgmlDType::Q4_1)?;
        QTensor::new(storage, (self.d_out, self.d_in))
    }
}

fn repack(
    st: &SafeTensors<'_>,
    module: &str,
    scheme: QuantScheme,
    path: &Path,
) -> Result<Blocks, QuantError> {
    let packed = packed(
        |part| st.tensor(&format!("{module}.{part}")).ok(),
        module,
        scheme,
        &path.display().to_string(),
    )?;
    Ok(Blocks {
        bytes: packed.q4_1(),
        d_out: packed.d_out,
        d_in: packed.d_in,
    })
}

/// Projection `module` of a checkpoint in `scheme`, its parts read by `get` (`"qweight"`,
/// `"qzeros"`, `"scales"`, `"g_idx"`), with their shapes, dtypes and (GPTQ) group index
/// checked against the format. `origin` names where they come from in messages.
pub fn packed<'a>(
    get: impl Fn(&str) -> Option<TensorView<'a>>,
    module: &str,
    scheme: QuantScheme,
    origin: &str,
) -> Result<Packed<'a>, QuantError> {
    let fmt = scheme.format.name();
    let get = |part: &str, dtype: Dtype| {
        let t = get(part).ok_or_else(|| {
            QuantError::Layout(format!("{origin}: {fmt} module {module} has no {part}"))
        })?;
        if t.dtype() != dtype || (t.shape().len() != 2 && part != "g_idx") {
            return Err(QuantError::Layout(format!(
                "{module}.{part}: {:?} {:?}, {fmt} defines a 2-D {dtype:?} tensor",
                t.dtype(),
                t.shape()
            )));
        }
        Ok(t)
    };
    let (qweight, qzeros, scales) = (
        get("qweight", Dtype::I32)?,
        get("qzeros", Dtype::I32)?,
        get("scales", Dtype::F16)?,
    );
    let group = scheme.group_size;
    let (groups, d_out) = (scales.shape()[0], scales.shape()[1]);
    let d_in = groups * group;
    let want_qweight = match scheme.format {
        QuantFormat::Awq => [d_in, d_out / 8],
        QuantFormat::Gptq => [d_in / 8, d_out],
    };
    if !d_out.is_multiple_of(8)
        || qweight.shape() != want_qweight
        || qzeros.shape() != [groups, d_out / 8]
    {
        return Err(QuantError::Layout(format!(
            "{module}: qweight {:?}, qzeros {:?}, scales {:?} do not fit {fmt} with group size \
             {group} (qweight {want_qweight:?}, qzeros [{groups}, {}])",
            qweight.shape(),
            qzeros.shape(),
            scales.shape(),
            d_out / 8
        )));
    }
    if scheme.format == QuantFormat::Gptq {
        if let Ok(g_idx) = get("g_idx", Dtype::I32) {
            let trivial = g_idx.shape() == [d_in]
                && (0..d_in).all(|i| word(g_idx.data(), i) as usize == i / group);
            if !trivial {
                return Err(QuantError::Unsupported(format!(
                    "{module}.g_idx is not input / group_size (act-order GPTQ): its groups are \
                     not blocks of consecutive inputs"
                )));
            }
        }
    }
    Ok(Packed {
        format: scheme.format,
        qweight: qweight.data(),
        qzeros: qzeros.data(),
        scales: scales.data(),
        d_in,
        d_out,
        group,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Packs `q` `[out, in]`, zeros and scales `[groups, out]` as each format does, and checks
    /// the blocks dequantize to `(q - z)·s` within the bound of the module's doc.
    #[test]
    fn both_packings_repack_to_the_formula() {
        let (d_out, d_in, group) = (16, 128, 64);
        let groups = d_in / group;
        let q: Vec<u32> = (0..d_out * d_in).map(|k| (k * 7 % 16) as u32).collect();
        let z: Vec<u32> = (0..groups * d_out).map(|k| (k * 5 % 16) as u32).collect();
        let s: Vec<f16> = (0..groups * d_out)
            .map(|k| f16::from_f32(0.01 + k as f32 * 0.0037))
            .collect();
        let bytes = |w: Vec<u32>| w.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
        let scales: Vec<u8> = s.iter().flat_map(|v| v.to_le_bytes()).collect();
        // AWQ: [in, out/8] and [groups, out/8], column c in nibble AWQ_NIBBLE[c].
        let awq = |rows: usize, at: &dyn Fn(usize, usize) -> u32| {
            let mut w = vec![0u32; rows * d_out / 8];
            for r in 0..rows {
                for o in 0..d_out {
                    w[r * d_out / 8 + o / 8] |= at(r, o) << (4 * AWQ_NIBBLE[o % 8]);
                }
            }
            bytes(w)
        };
        // GPTQ: [in/8, out] along the input, zeros minus one along the output.
        let mut gw = vec![0u32; d_in / 8 * d_out];
        for i in 0..d_in {
            for o in 0..d_out {
                gw[(i / 8) * d_out + o] |= q[o * d_in + i] << (4 * (i % 8));
            }
        }
        let mut gz = vec![0u32; groups * d_out / 8];
        for g in 0..groups {
            for o in 0..d_out {
                gz[g * d_out / 8 + o / 8] |= ((z[g * d_out + o] + 15) % 16) << (4 * (o % 8));
            }
        }
        // Format, qweight, qzeros, and the zero point each stored zero reads back as.
        type Case = (QuantFormat, Vec<u8>, Vec<u8>, fn(u32) -> u32);
        let cases: [Case; 2] = [
            (
                QuantFormat::Awq,
                awq(d_in, &|i, o| q[o * d_in + i]),
                awq(groups, &|g, o| z[g * d_out + o]),
                // GPTQ stores zero 0 as 15 (wrapping), which reads back as 16.
                |z: u32| z,
            ),
            (QuantFormat::Gptq, bytes(gw), bytes(gz), |z: u32| {
                if z == 0 {
                    16
                } else {
                    z
                }
            }),
        ];
        for (format, qweight, qzeros, zero) in cases {
            let p = Packed {
                format,
                qweight: &qweight,
                qzeros: &qzeros,
                scales: &scales,
                d_in,
                d_out,
                group,
            };
            let t = Blocks {
                bytes: p.q4_1(),
                d_out,
                d_in,
            }
            .into_qtensor(&Device::Cpu)
            .unwrap();
            let got: Vec<Vec<f32>> = t.dequantize(&Device::Cpu).unwrap().to_vec2().unwrap();
            // The merge's dequantization (rows 3.. of the weight): the formula, exactly (f64
            // holds every product; f32 must too).
            let mut exact = vec![0f32; (d_out - 3) * d_in];
            p.dequantize_rows(3, &mut exact);
            for (k, w) in exact.iter().enumerate() {
                let (o, i) = (3 + k / d_in, k % d_in);
                let g = i / group;
                let want = (q[o * d_in + i] as f64 - zero(z[g * d_out + o]) as f64)
                    * s[g * d_out + o].to_f64();
                assert_eq!(*w as f64, want, "{format:?} o {o} i {i}");
            }
            for o in 0..d_out {
                for i in 0..d_in {
                    let g = i / group;
                    let (zz, ss) = (zero(z[g * d_out + o]) as f32, s[g * d_out + o].to_f32());
                    let want = (q[o * d_in + i] as f32 - zz) * ss;
                    // m = -z·s rounded to f16: at most 2⁻¹¹·z·s off (plus f32 rounding).
                    let bound = zz * ss / 2048.0 + 1e-6;
                    let err = (got[o][i] - want).abs();
                    assert!(
                        err <= bound,
                        "{format:?} o {o} i {i}: {} vs {want}",
                        got[o][i]
                    );
                }
            }
        }
    }
}
