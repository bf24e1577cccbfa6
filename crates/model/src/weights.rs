//! Where a decoder's weights come from and how a projection multiplies: dense checkpoint
//! tensors (any float dtype, half types widened on the tensor path) or GGUF blocks (candle's
//! quantized matmul), and the dtype policy that pairs weights with compute and adapters.

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{linear_b, Embedding, Linear, RmsNorm, VarBuilder};

use super::ModelError;
use mole_kernels::quant::{self, Format};

/// The dtype a decoder computes in over weights of `weights`: the same, except the half
/// types on the CPU, which compute in f32. The host kernels read bf16 and f16 weights in place
/// and widen them in registers (exact), so the weights keep half the memory and decode steps
/// read half the bytes, where candle's CPU half-precision ops would be slower than f32 and
/// round every activation (f16 also overflows past 65504).
pub fn compute_dtype(weights: DType, device: &Device) -> DType {
    if device.is_cpu() && matches!(weights, DType::BF16 | DType::F16) {
        DType::F32
    } else {
        weights
    }
}

/// The dtype adapters are held in when the pool does not say (`loraDtype` unset): that of
/// the weights, as vLLM's `lora_dtype="auto"`, where the kernels read it. Over bf16 weights an
/// adapter rounded to bf16 moves the output by 2⁻⁹ of its low-rank update only, far less than
/// the weights' own rounding (2⁻⁹ of the whole product, the same a merged pod's baked weights
/// carry), while it halves the adapter's memory and the bytes each distinct adapter adds to a
/// decode step. The CPU's host kernels read f32 and bf16 adapters but not f16 ones, so over
/// f16 weights a CPU holds them in f32; f32 and quantized (GGUF) bases keep f32 adapters.
pub fn adapter_dtype(weights: DType, device: &Device) -> DType {
    match weights {
        DType::BF16 => DType::BF16,
        w => compute_dtype(w, device),
    }
}

/// Values of a half-type projection widened at once on the tensor path (64 MiB of f32).
const WIDEN_MAX_VALUES: usize = 16 << 20;

/// `l` applied to `x` with its weights widened to `x`'s dtype, `max_values` of them at a time
/// (whole rows, at least one).
// Prefill over half-type CPU weights: the slices of a projection widened one after another
// (a GPU computes in the weights' dtype and never comes here).
#[allow(clippy::disallowed_methods)]
fn widened(l: &Linear, x: &Tensor, max_values: usize) -> candle_core::Result<Tensor> {
    let (d_out, d_in) = l.weight().dims2()?;
    let rows = (max_values / d_in).max(1);
    let mut parts = Vec::with_capacity(d_out.div_ceil(rows));
    for lo in (0..d_out).step_by(rows) {
        let n = rows.min(d_out - lo);
        let w = l.weight().narrow(0, lo, n)?.to_dtype(x.dtype())?;
        let b = l.bias().map(|b| b.narrow(0, lo, n)).transpose()?;
        parts.push(Linear::new(w, b).forward(x)?);
    }
    match parts.len() {
        1 => Ok(parts.remove(0)),
        _ => Tensor::cat(&parts, D::Minus1),
    }
}

/// A projection: dense (candle `Linear`, any float dtype) or quantized (GGUF blocks, candle's
/// quantized matmul; activations stay f32).
pub enum Lin {
    /// Dense weights.
    Dense(Linear),
    /// Quantized weights and an optional dense bias.
    Quantized(QMatMul, Option<Tensor>),
}

/// Bytes of a tensor as held.
pub(super) fn tensor_bytes(t: &Tensor) -> u64 {
    (t.elem_count() * t.dtype().size_in_bytes()) as u64
}

impl Lin {
    /// The bytes its weights and bias hold: quantized blocks as stored, dense tensors in
    /// their dtype.
    pub fn bytes(&self) -> u64 {
        match self {
            Lin::Dense(l) => tensor_bytes(l.weight()) + l.bias().map_or(0, tensor_bytes),
            Lin::Quantized(w, b) => {
                let w = match w {
                    QMatMul::QTensor(q) => q.storage_size_in_bytes() as u64,
                    QMatMul::Tensor(t) | QMatMul::TensorF16(t) => tensor_bytes(t),
                };
                w + b.as_ref().map_or(0, tensor_bytes)
            }
        }
    }
}

impl Module for Lin {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            // Half-type weights under f32 activations (the CPU): widened for this product only, so
            // they stay at half the memory. Decode steps read them in place (`project`); this
            // is prefill's path, where the copy costs little next to the arithmetic. A slice of
            // rows at a time, so a large output head (Qwen3's is 389M values) never stands
            // widened whole beside the model.
            Lin::Dense(l) if l.weight().dtype() != x.dtype() => widened(l, x, WIDEN_MAX_VALUES),
            Lin::Dense(l) => l.forward(x),
            Lin::Quantized(w, b) => {
                let y = match quant_product(w, x)? {
                    Some(y) => y,
                    None => w.forward(x)?,
                };
                match b {
                    Some(b) => y.broadcast_add(b),
                    None => Ok(y),
                }
            }
        }
    }
}

/// The blocks of a quantized projection held on the CPU, as a tensor, their format, and its
/// output and input widths, when mole's kernel multiplies them (see
/// [`mole_kernels::quant`]); None otherwise (other block types, a GPU: candle's quantized
/// matmul).
pub(super) fn quant_blocks(w: &QMatMul) -> Option<(&QTensor, Format, usize, usize)> {
    let QMatMul::QTensor(q) = w else {
        return None;
    };
    let (n, k) = q.shape().dims2().ok()?;
    let f = Format::of(q.dtype())?;
    (q.device().is_cpu() && k.is_multiple_of(f.block_values()) && quant::available(f)).then_some((
        q.as_ref(),
        f,
        n,
        k,
    ))
}

/// `x·Wᵀ` by mole's kernel where it applies ([`quant_blocks`], `x` f32 on the CPU): it
/// rounds each activation row once and reuses each unpacked weight block for several rows.
#[allow(clippy::disallowed_methods)] // the CPU: its "upload" is a move
fn quant_product(w: &QMatMul, x: &Tensor) -> candle_core::Result<Option<Tensor>> {
    let Some((q, f, n, k)) = quant_blocks(w) else {
        return Ok(None);
    };
    let x = x.contiguous()?;
    let Some(xs) = mole_kernels::HostF32::of(&x) else {
        return Ok(None);
    };
    let t = x.elem_count() / k;
    let data = q.data()?;
    let Some(y) = quant::matmul(f, xs.slice(t * k), t, k, &data, n) else {
        return Ok(None);
    };
    let mut dims = x.dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last = n;
    }
    Tensor::from_vec(y, dims, x.device()).map(Some)
}

/// Projections of one input (q/k/v, or gate/up): held apart, as the CPU's host kernels read
/// them, or fused into one matrix whose one product the tensor path splits (one matmul where
/// a GPU launched one per projection). Quantized projections stay apart.
pub(super) enum Fusable<const N: usize> {
    /// One projection each.
    Apart([Lin; N]),
    /// Rows of the projections stacked (a dense [`Lin`]), and each one's output width.
    Fused(Lin, [usize; N]),
}

impl<const N: usize> Fusable<N> {
    /// Stacks dense projections into one (biases too: zeros for a projection without one
    /// beside others with one); quantized ones stay apart.
    // Done once, when the decoder takes the tensor path: not in a step.
    #[allow(clippy::disallowed_methods)]
    pub fn fuse(&mut self) -> candle_core::Result<()> {
        let Fusable::Apart(lins) = self else {
            return Ok(());
        };
        let mut dense = Vec::with_capacity(N);
        for l in lins.iter() {
            match l {
                Lin::Dense(d) => dense.push(d),
                Lin::Quantized(..) => return Ok(()),
            }
        }
        let widths: Vec<usize> = dense
            .iter()
            .map(|d| d.weight().dim(0))
            .collect::<candle_core::Result<_>>()?;
        let w = Tensor::cat(&dense.iter().map(|d| d.weight()).collect::<Vec<_>>(), 0)?;
        let b = match dense.iter().find_map(|d| d.bias()) {
            Some(like) => {
                let parts = dense
                    .iter()
                    .zip(&widths)
                    .map(|(d, &n)| match d.bias() {
                        Some(b) => Ok(b.clone()),
                        None => Tensor::zeros(n, like.dtype(), like.device()),
                    })
                    .collect::<candle_core::Result<Vec<_>>>()?;
                Some(Tensor::cat(&parts, 0)?)
            }
            None => None,
        };
        *self = Fusable::Fused(
            Lin::Dense(Linear::new(w, b)),
            widths.try_into().expect("one width per projection"),
        );
        Ok(())
    }

    /// The bytes its projections hold.
    pub fn bytes(&self) -> u64 {
        match self {
            Fusable::Apart(lins) => lins.iter().map(Lin::bytes).sum(),
            Fusable::Fused(l, _) => l.bytes(),
        }
    }

    /// The projections apart again (the host path reads each in place).
    pub fn unfuse(&mut self) -> candle_core::Result<()> {
        let Fusable::Fused(Lin::Dense(l), widths) = self else {
            return Ok(());
        };
        let mut lins = Vec::with_capacity(N);
        let mut at = 0;
        for &n in widths.iter() {
            let w = l.weight().narrow(0, at, n)?.contiguous()?;
            let b = l
                .bias()
                .map(|b| b.narrow(0, at, n)?.contiguous())
                .transpose()?;
            lins.push(Lin::Dense(Linear::new(w, b)));
            at += n;
        }
        *self = Fusable::Apart(lins.try_into().ok().expect("one projection per width"));
        Ok(())
    }
}

/// The token embedding table: dense, or a GGUF base's blocks on the CPU, of which a step
/// dequantizes the rows its tokens take. Widened whole to f32, the table held 4-7x the bytes
/// of its blocks (113 MiB for SmolLM2-135M's 49152 × 576, more than all of its quantized
/// projections), which kept a 4-bit base's memory far above a third of its bf16 form's.
pub enum Embed {
    /// A dense table.
    Dense(Embedding),
    /// Blocks, shared with a tied output head.
    Quantized(std::sync::Arc<QTensor>),
}

impl Embed {
    /// The rows of the tokens `ids` (any shape): `[..ids, hidden]`, f32 for a quantized table.
    #[allow(clippy::disallowed_methods)] // quantized tables are held on the CPU only
    pub fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let q = match self {
            Embed::Dense(e) => return e.forward(ids),
            Embed::Quantized(q) => q,
        };
        let (vocab, h) = q.shape().dims2()?;
        let mut dims = ids.dims().to_vec();
        dims.push(h);
        let ids: Vec<u32> = ids.flatten_all()?.to_dtype(DType::U32)?.to_vec1()?;
        if ids.is_empty() {
            return Tensor::zeros(dims, DType::F32, &Device::Cpu);
        }
        let data = q.data()?;
        let row = data.len() / vocab;
        let mut rows = Vec::with_capacity(ids.len() * row);
        for &i in &ids {
            let i = i as usize;
            if i >= vocab {
                candle_core::bail!("token {i} is outside the vocabulary of {vocab}");
            }
            rows.extend_from_slice(&data[i * row..(i + 1) * row]);
        }
        let storage = candle_core::quantized::QStorage::from_data(
            std::borrow::Cow::Owned(rows),
            &Device::Cpu,
            q.dtype(),
        )?;
        QTensor::new(storage, (ids.len(), h))?
            .dequantize(&Device::Cpu)?
            .reshape(dims)
    }

    /// The bytes the table holds.
    pub fn bytes(&self) -> u64 {
        match self {
            Embed::Dense(e) => tensor_bytes(e.embeddings()),
            Embed::Quantized(q) => q.storage_size_in_bytes() as u64,
        }
    }
}

/// Where the decoder's weights come from (HF names, without the `.weight` suffix except for
/// whole tensors).
pub(super) trait Weights {
    fn linear(&self, name: &str, d_in: usize, d_out: usize, bias: bool) -> Result<Lin, ModelError>;
    fn norm(&self, name: &str, size: usize, eps: f64) -> Result<RmsNorm, ModelError>;
    fn dense(&self, name: &str, shape: (usize, usize)) -> Result<Tensor, ModelError>;
    /// The token embedding table `name`.
    fn embedding(&self, name: &str, shape: (usize, usize)) -> Result<Embed, ModelError> {
        Ok(Embed::Dense(Embedding::new(
            self.dense(name, shape)?,
            shape.1,
        )))
    }
    /// The output head when it shares the embedding matrix `name` (held as `embed`).
    fn tied_head(&self, name: &str, embed: &Embed) -> Result<Lin, ModelError>;
}

/// The output head that is a dense embedding table itself.
fn dense_tied_head(name: &str, embed: &Embed) -> Result<Lin, ModelError> {
    match embed {
        Embed::Dense(e) => Ok(Lin::Dense(Linear::new(e.embeddings().clone(), None))),
        Embed::Quantized(_) => Err(ModelError::Config(format!(
            "{name}: a quantized embedding outside a GGUF base"
        ))),
    }
}

/// Dense checkpoint tensors: projections and the embedding in the VarBuilder's dtype, biases
/// and norms (small, and added to or multiplied with activations) in the compute dtype `act`.
pub(super) struct Dense<'a> {
    /// The checkpoint.
    pub vb: VarBuilder<'a>,
    /// The compute dtype.
    pub act: DType,
}

impl Weights for Dense<'_> {
    fn linear(&self, name: &str, d_in: usize, d_out: usize, bias: bool) -> Result<Lin, ModelError> {
        let l = linear_b(d_in, d_out, bias, self.vb.pp(name))?;
        let b = l.bias().map(|b| b.to_dtype(self.act)).transpose()?;
        Ok(Lin::Dense(Linear::new(l.weight().clone(), b)))
    }
    fn norm(&self, name: &str, size: usize, eps: f64) -> Result<RmsNorm, ModelError> {
        let w = self.vb.pp(name).get(size, "weight")?.to_dtype(self.act)?;
        Ok(RmsNorm::new(w, eps))
    }
    fn dense(&self, name: &str, shape: (usize, usize)) -> Result<Tensor, ModelError> {
        Ok(self.vb.get(shape, name)?)
    }
    fn tied_head(&self, name: &str, embed: &Embed) -> Result<Lin, ModelError> {
        dense_tied_head(name, embed)
    }
}

/// A GGUF base's tensors, each taken out of the map as the decoder takes it (no copy: the
/// blocks are held once, during the load as after it).
pub(super) struct Quantized(
    pub std::cell::RefCell<std::collections::HashMap<String, QTensor>>,
    pub Device,
);

impl Quantized {
    fn take(&self, name: &str) -> Result<QTensor, ModelError> {
        self.0
            .borrow_mut()
            .remove(name)
            .ok_or_else(|| ModelError::Config(format!("GGUF has no tensor for {name}")))
    }
    fn deq(&self, name: &str) -> Result<Tensor, ModelError> {
        Ok(self.take(name)?.dequantize(&self.1)?)
    }
}

impl Weights for Quantized {
    fn linear(&self, name: &str, d_in: usize, d_out: usize, bias: bool) -> Result<Lin, ModelError> {
        let q = self.take(&format!("{name}.weight"))?;
        if q.shape().dims() != [d_out, d_in] {
            return Err(ModelError::Config(format!(
                "{name}: GGUF shape {:?}, expected [{d_out}, {d_in}]",
                q.shape().dims()
            )));
        }
        let w = QMatMul::from_arc(std::sync::Arc::new(q))?;
        let b = if bias {
            Some(self.deq(&format!("{name}.bias"))?)
        } else {
            None
        };
        Ok(Lin::Quantized(w, b))
    }
    fn norm(&self, name: &str, _: usize, eps: f64) -> Result<RmsNorm, ModelError> {
        Ok(RmsNorm::new(self.deq(&format!("{name}.weight"))?, eps))
    }
    fn dense(&self, name: &str, _: (usize, usize)) -> Result<Tensor, ModelError> {
        self.deq(name)
    }
    /// On the CPU the table stays in its blocks (see [`Embed`]); on a GPU it is dequantized,
    /// and left in the map for a tied head.
    fn embedding(&self, name: &str, shape: (usize, usize)) -> Result<Embed, ModelError> {
        if self.1.is_cpu() {
            let q = self.take(name)?;
            if q.shape().dims() != [shape.0, shape.1] {
                return Err(ModelError::Config(format!(
                    "{name}: GGUF shape {:?}, expected {shape:?}",
                    q.shape().dims()
                )));
            }
            return Ok(Embed::Quantized(std::sync::Arc::new(q)));
        }
        let map = self.0.borrow();
        let q = map
            .get(name)
            .ok_or_else(|| ModelError::Config(format!("GGUF has no tensor for {name}")))?;
        Ok(Embed::Dense(Embedding::new(
            q.dequantize(&self.1)?,
            shape.1,
        )))
    }
    fn tied_head(&self, name: &str, embed: &Embed) -> Result<Lin, ModelError> {
        let q = match embed {
            Embed::Quantized(q) => q.clone(),
            Embed::Dense(_) => std::sync::Arc::new(self.take(name)?),
        };
        Ok(Lin::Quantized(QMatMul::from_arc(q)?, None))
    }
}

/// A pre-quantized (AWQ/GPTQ) checkpoint: its quantized projections repacked into blocks
/// (by name with `.weight`), everything else (embedding, norms, an unquantized head, biases)
/// dense as in any checkpoint.
pub(super) struct Prequantized<'a> {
    /// The repacked projections.
    pub blocks: std::collections::HashMap<String, QTensor>,
    /// The checkpoint's other tensors.
    pub dense: Dense<'a>,
}

impl Weights for Prequantized<'_> {
    fn linear(&self, name: &str, d_in: usize, d_out: usize, bias: bool) -> Result<Lin, ModelError> {
        let Some(q) = self.blocks.get(&format!("{name}.weight")) else {
            return self.dense.linear(name, d_in, d_out, bias);
        };
        if q.shape().dims() != [d_out, d_in] {
            return Err(ModelError::Config(format!(
                "{name}: quantized shape {:?}, expected [{d_out}, {d_in}]",
                q.shape().dims()
            )));
        }
        let b = match bias {
            true => Some(
                self.dense
                    .vb
                    .pp(name)
                    .get(d_out, "bias")?
                    .to_dtype(self.dense.act)?,
            ),
            false => None,
        };
        Ok(Lin::Quantized(
            QMatMul::from_arc(std::sync::Arc::new(requantized(q)?))?,
            b,
        ))
    }
    fn norm(&self, name: &str, size: usize, eps: f64) -> Result<RmsNorm, ModelError> {
        self.dense.norm(name, size, eps)
    }
    fn dense(&self, name: &str, shape: (usize, usize)) -> Result<Tensor, ModelError> {
        self.dense.dense(name, shape)
    }
    fn tied_head(&self, name: &str, embed: &Embed) -> Result<Lin, ModelError> {
        self.dense.tied_head(name, embed)
    }
}

/// A copy of a quantized tensor (the map keeps the original for dequantized uses).
fn requantized(q: &QTensor) -> Result<QTensor, ModelError> {
    let storage = candle_core::quantized::QStorage::from_data(q.data()?, &q.device(), q.dtype())?;
    Ok(QTensor::new(storage, q.shape().clone())?)
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use crate::max_abs_diff;

    /// The tensor path over half-type weights, widened a slice of rows at a time, equals the
    /// product with the weights widened whole: slices that divide the rows and one that does
    /// not, with a bias, for bf16 and f16.
    #[test]
    fn widened_slices_match_the_whole_product() {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (37, 8), &dev).unwrap();
        let b = Tensor::randn(0f32, 1.0, 37, &dev).unwrap();
        let x = Tensor::randn(0f32, 1.0, (5, 8), &dev).unwrap();
        for narrow in [DType::BF16, DType::F16] {
            let held = Linear::new(w.to_dtype(narrow).unwrap(), Some(b.clone()));
            let whole = Linear::new(held.weight().to_dtype(DType::F32).unwrap(), Some(b.clone()))
                .forward(&x)
                .unwrap();
            for max_values in [8, 80, 37 * 8, 1 << 20] {
                let got = widened(&held, &x, max_values).unwrap();
                assert_eq!(got.dims(), [5, 37]);
                let err = max_abs_diff(&got, &whole);
                // The same 8 products per output in any blocking: ~1e-7; a shifted or
                // missing slice is ~1.
                assert!(err < 1e-5, "{narrow:?}, {max_values} values a slice: {err}");
            }
        }
    }
}
