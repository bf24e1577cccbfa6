//! Adapter tensors, the merge plan, and the lazily merged output tensors.

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use safetensors::tensor::{TensorView, View};
use safetensors::Dtype;

use super::{io_err, MergeError, MergeOptions};
use crate::formats::peft::{split_adapter_key, AdapterConfig};

/// Output dtype of merged weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutDtype {
    /// float32.
    F32,
    /// bfloat16.
    Bf16,
    /// float16.
    F16,
}

impl OutDtype {
    /// Parses `f32|bf16|f16`.
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Some(Self::F32),
            "bf16" | "bfloat16" => Some(Self::Bf16),
            "f16" | "float16" => Some(Self::F16),
            _ => None,
        }
    }
    /// Short name.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::F16 => "f16",
        }
    }
    /// Name used by transformers' `torch_dtype`.
    pub fn torch_name(self) -> &'static str {
        match self {
            Self::F32 => "float32",
            Self::Bf16 => "bfloat16",
            Self::F16 => "float16",
        }
    }
    fn safetensors(self) -> Dtype {
        match self {
            Self::F32 => Dtype::F32,
            Self::Bf16 => Dtype::BF16,
            Self::F16 => Dtype::F16,
        }
    }
}

fn is_float(d: Dtype) -> bool {
    matches!(d, Dtype::F32 | Dtype::BF16 | Dtype::F16 | Dtype::F64)
}

/// Elements per parallel chunk of the conversions (large enough to amortise scheduling).
const CHUNK: usize = 1 << 16;

/// Decodes a float tensor's little-endian bytes to f32.
pub fn to_f32(dtype: Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    let mut out = Vec::new();
    decode_into(dtype, bytes, &mut out).then_some(out)
}

/// Decodes into `out` (resized; reusing its allocation avoids re-faulting fresh pages for
/// every tensor). False for non-float dtypes.
fn decode_into(dtype: Dtype, bytes: &[u8], out: &mut Vec<f32>) -> bool {
    use rayon::prelude::*;
    let size = match dtype {
        Dtype::F32 => 4,
        Dtype::BF16 | Dtype::F16 => 2,
        Dtype::F64 => 8,
        _ => return false,
    };
    out.resize(bytes.len() / size, 0.0);
    out.par_chunks_mut(CHUNK)
        .zip(bytes.par_chunks(CHUNK * size))
        .for_each(|(dst, src)| {
            let it = dst.iter_mut().zip(src.chunks_exact(size));
            match dtype {
                // bf16 is the upper half of an f32: widening is exact.
                Dtype::BF16 => it.for_each(|(d, c)| {
                    *d = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16)
                }),
                Dtype::F16 => {
                    it.for_each(|(d, c)| *d = half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                }
                Dtype::F64 => it.for_each(|(d, c)| {
                    *d = f64::from_le_bytes(c.try_into().expect("8 bytes")) as f32
                }),
                _ => it.for_each(|(d, c)| *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            }
        });
    true
}

/// f32 → bf16 bits, round to nearest even (as torch and `half` do), branch-free for finite
/// values so the loop vectorises; NaN stays a quiet NaN.
#[inline]
fn bf16_bits(v: f32) -> u16 {
    let b = v.to_bits();
    if v.is_nan() {
        return ((b >> 16) as u16) | 0x0040;
    }
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// Encodes f32 values to `dtype` (round to nearest even); returns the bytes and whether every
/// value was finite.
fn from_f32(dtype: Dtype, values: &[f32]) -> (Vec<u8>, bool) {
    use rayon::prelude::*;
    let size = dtype.bitsize() / 8;
    let mut out = vec![0u8; values.len() * size];
    let finite = out
        .par_chunks_mut(CHUNK * size)
        .zip(values.par_chunks(CHUNK))
        .map(|(dst, src)| {
            let mut ok = true;
            for (d, v) in dst.chunks_exact_mut(size).zip(src) {
                ok &= v.is_finite();
                match dtype {
                    Dtype::BF16 => d.copy_from_slice(&bf16_bits(*v).to_le_bytes()),
                    Dtype::F16 => d.copy_from_slice(&half::f16::from_f32(*v).to_le_bytes()),
                    Dtype::F64 => d.copy_from_slice(&(*v as f64).to_le_bytes()),
                    _ => d.copy_from_slice(&v.to_le_bytes()),
                }
            }
            ok
        })
        .reduce(|| true, |a, b| a && b);
    (out, finite)
}

/// Distance in units in the last place between two bf16 values (bit patterns), for tests.
pub fn bf16_ulp_distance(a: u16, b: u16) -> u32 {
    // Map sign-magnitude to a monotonic integer line.
    let key = |x: u16| -> i32 {
        if x & 0x8000 != 0 {
            -((x & 0x7fff) as i32)
        } else {
            x as i32
        }
    };
    (key(a) - key(b)).unsigned_abs()
}

/// An f32 matrix read from the adapter.
#[derive(Debug, Clone)]
pub(crate) struct Mat {
    pub data: Vec<f32>,
    pub shape: Vec<usize>,
}

/// One LoRA module of the adapter.
#[derive(Debug, Default)]
pub(crate) struct Lora {
    pub a: Option<Mat>,
    pub b: Option<Mat>,
    pub b_bias: Option<Mat>,
    pub embedding: bool,
    pub scale: f64,
}

impl Lora {
    /// Rank (rows of A).
    pub fn rank(&self) -> usize {
        self.a.as_ref().map(|a| a.shape[0]).unwrap_or(0)
    }
}

/// Every tensor of a PEFT adapter file, grouped by module.
#[derive(Debug, Default)]
pub(crate) struct AdapterWeights {
    pub loras: BTreeMap<String, Lora>,
    /// Base tensor name → full replacement (modules_to_save, saved embeddings, biases).
    pub replacements: BTreeMap<String, Mat>,
}

/// A low-rank update of one base tensor: `W += scale · (B·A)` (transposed for embeddings and
/// fan_in_fan_out), or `bias += scale · b` for a LoRA bias.
#[derive(Debug)]
pub(crate) enum Delta<'a> {
    /// Weight update.
    LowRank {
        module: String,
        a: &'a Mat,
        b: &'a Mat,
        scale: f64,
        transpose: bool,
    },
    /// Bias update.
    Bias {
        module: String,
        b: &'a Mat,
        scale: f64,
    },
}

/// Checked merge plan: base tensor name → what happens to it.
pub(crate) struct Plan<'a> {
    pub deltas: HashMap<String, Delta<'a>>,
    pub replacements: HashMap<String, &'a Mat>,
}

impl AdapterWeights {
    /// Reads `adapter_model.safetensors` (all tensors, as f32: adapters are small).
    pub fn load(path: &Path, config: &AdapterConfig) -> Result<Self, MergeError> {
        let bytes = std::fs::read(path).map_err(io_err(path))?;
        let st =
            safetensors::SafeTensors::deserialize(&bytes).map_err(|e| MergeError::Safetensors {
                path: path.display().to_string(),
                message: e.to_string(),
            })?;
        let mut out = AdapterWeights::default();
        for (key, view) in st.iter() {
            let data = to_f32(view.dtype(), view.data()).ok_or_else(|| MergeError::Shape {
                module: key.to_string(),
                message: format!("dtype {:?} is not a float type", view.dtype()),
            })?;
            let mat = Mat {
                data,
                shape: view.shape().to_vec(),
            };
            if let Some((module, part)) = split_adapter_key(key) {
                let lora = out.loras.entry(module.clone()).or_default();
                match part.as_str() {
                    "lora_A.weight" => lora.a = Some(mat),
                    "lora_B.weight" => lora.b = Some(mat),
                    "lora_B.bias" => lora.b_bias = Some(mat),
                    "lora_embedding_A" => {
                        lora.a = Some(mat);
                        lora.embedding = true;
                    }
                    "lora_embedding_B" => {
                        lora.b = Some(mat);
                        lora.embedding = true;
                    }
                    p if p.starts_with("lora_magnitude_vector") => {
                        return Err(MergeError::Unsupported(format!(
                            "{module}: DoRA magnitude vectors are not merged by mole"
                        )))
                    }
                    other => {
                        return Err(MergeError::Unsupported(format!(
                            "{key}: unknown LoRA tensor {other}"
                        )))
                    }
                }
                lora.scale = config.scale_for(&module);
            } else {
                let name = key.strip_prefix("base_model.model.").unwrap_or(key);
                let name = name
                    .replace(".modules_to_save.default", "")
                    .replace(".original_module", "")
                    .replace(".base_layer", "");
                out.replacements.insert(name, mat);
            }
        }
        for (module, lora) in &out.loras {
            if lora.a.is_none() || lora.b.is_none() {
                return Err(MergeError::Shape {
                    module: module.clone(),
                    message: "adapter has only one of lora_A / lora_B".into(),
                });
            }
            if !config.targets(module) {
                return Err(MergeError::Shape {
                    module: module.clone(),
                    message: "adapter has LoRA weights for a module its target_modules do not name"
                        .into(),
                });
            }
        }
        Ok(out)
    }

    /// Checks every module against the base's tensor shapes and returns the plan.
    pub fn plan<'a>(
        &'a self,
        infos: &HashMap<String, (Vec<usize>, Dtype)>,
        config: &AdapterConfig,
    ) -> Result<Plan<'a>, MergeError> {
        let mut plan = Plan {
            deltas: HashMap::new(),
            replacements: HashMap::new(),
        };
        for (name, mat) in &self.replacements {
            let (shape, _) = infos.get(name).ok_or_else(|| MergeError::Shape {
                module: name.clone(),
                message: "adapter replaces a tensor the base model does not have".into(),
            })?;
            if *shape != mat.shape {
                return Err(MergeError::Shape {
                    module: name.clone(),
                    message: format!("replacement shape {:?}, base {:?}", mat.shape, shape),
                });
            }
            plan.replacements.insert(name.clone(), mat);
        }
        for (module, lora) in &self.loras {
            let (a, b) = (
                lora.a.as_ref().expect("checked"),
                lora.b.as_ref().expect("checked"),
            );
            let weight = format!("{module}.weight");
            let (shape, _) = infos.get(&weight).ok_or_else(|| MergeError::Shape {
                module: module.clone(),
                message: "targeted module is not in the base model".into(),
            })?;
            let bad = |message: String| MergeError::Shape {
                module: module.clone(),
                message,
            };
            if a.shape.len() != 2 || b.shape.len() != 2 || shape.len() != 2 {
                return Err(bad("LoRA and base weights must be matrices".into()));
            }
            let r = a.shape[0];
            if b.shape[1] != r {
                return Err(bad(format!(
                    "lora_A is {:?} but lora_B is {:?}: ranks differ",
                    a.shape, b.shape
                )));
            }
            let expected_r = config.rank_for(module) as usize;
            if r != expected_r {
                return Err(bad(format!(
                    "rank {r} in the weights, {expected_r} in adapter_config.json"
                )));
            }
            let transpose = lora.embedding || config.fan_in_fan_out;
            // delta = B·A is [b0, a1]; stored transposed for embeddings / fan_in_fan_out.
            let delta_shape = if transpose {
                vec![a.shape[1], b.shape[0]]
            } else {
                vec![b.shape[0], a.shape[1]]
            };
            if *shape != delta_shape {
                return Err(bad(format!(
                    "base weight is {:?} but lora_B·lora_A gives {:?} (lora_A {:?}, lora_B {:?})",
                    shape, delta_shape, a.shape, b.shape
                )));
            }
            plan.deltas.insert(
                weight,
                Delta::LowRank {
                    module: module.clone(),
                    a,
                    b,
                    scale: lora.scale,
                    transpose,
                },
            );
            if let Some(bias) = &lora.b_bias {
                let name = format!("{module}.bias");
                match infos.get(&name) {
                    Some((s, _)) if *s == bias.shape => {}
                    _ => return Err(bad("lora_B has a bias but the base layer has none".into())),
                }
                plan.deltas.insert(
                    name,
                    Delta::Bias {
                        module: module.clone(),
                        b: bias,
                        scale: lora.scale,
                    },
                );
            }
        }
        Ok(plan)
    }

    /// Scales by module family (last name component), for the metadata.
    pub fn scales_by_family(&self) -> BTreeMap<String, Vec<f64>> {
        let mut out: BTreeMap<String, Vec<f64>> = BTreeMap::new();
        for (module, lora) in &self.loras {
            let family = module.rsplit('.').next().unwrap_or(module).to_string();
            let v = out.entry(family).or_default();
            if !v.contains(&lora.scale) {
                v.push(lora.scale);
            }
        }
        for v in out.values_mut() {
            v.sort_by(|a, b| a.total_cmp(b));
        }
        out
    }
}

impl Delta<'_> {
    fn module(&self) -> &str {
        match self {
            Delta::LowRank { module, .. } | Delta::Bias { module, .. } => module,
        }
    }

    /// Adds the update to `w` (f32, row-major, the base tensor's shape).
    fn apply(&self, w: &mut [f32]) -> Result<(), MergeError> {
        match self {
            Delta::Bias { b, scale, .. } => {
                for (x, d) in w.iter_mut().zip(&b.data) {
                    *x += (*d as f64 * scale) as f32;
                }
                Ok(())
            }
            Delta::LowRank {
                a,
                b,
                scale,
                transpose,
                ..
            } => {
                let (m, k, n) = (b.shape[0], b.shape[1], a.shape[1]);
                assert_eq!(w.len(), m * n, "plan checked the shapes");
                assert_eq!((a.data.len(), b.data.len()), (k * n, m * k));
                // dst = 1·dst + scale·(B·A), in place; like PEFT, the product is formed in f32
                // and then scaled. Transposed weights ([n, m]: embeddings, fan_in_fan_out) are
                // the same product written with swapped strides.
                let (dst_cs, dst_rs) = if *transpose {
                    (m as isize, 1)
                } else {
                    (1, n as isize)
                };
                // SAFETY: dst is m·n f32 values addressed by (dst_rs, dst_cs) within bounds
                // for both layouts; lhs is B [m, k] row-major, rhs is A [k, n] row-major; the
                // asserts above pin those lengths.
                unsafe {
                    gemm::gemm(
                        m,
                        n,
                        k,
                        w.as_mut_ptr(),
                        dst_cs,
                        dst_rs,
                        true,
                        b.data.as_ptr(),
                        1,
                        k as isize,
                        a.data.as_ptr(),
                        1,
                        n as isize,
                        1.0f32,
                        *scale as f32,
                        false,
                        false,
                        false,
                        gemm::Parallelism::Rayon(0),
                    );
                }
                Ok(())
            }
        }
    }
}

/// State shared by the lazy tensors of one write: the first error raised (the writer cannot
/// return ours) and an f32 scratch buffer reused from tensor to tensor.
#[derive(Default)]
pub(crate) struct FailureCell(RefCell<Option<MergeError>>, RefCell<Vec<f32>>);

impl FailureCell {
    fn set(&self, e: MergeError) {
        let mut slot = self.0.borrow_mut();
        if slot.is_none() {
            *slot = Some(e);
        }
    }
    /// The recorded error, if any.
    pub fn check(&self) -> Result<(), MergeError> {
        match self.0.borrow_mut().take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// An output tensor, computed only when the writer asks for its bytes.
pub(crate) struct LazyTensor<'a> {
    view: TensorView<'a>,
    replacement: Option<&'a Mat>,
    delta: Option<&'a Delta<'a>>,
    out: Dtype,
    safe_merge: bool,
    failure: &'a FailureCell,
}

impl<'a> LazyTensor<'a> {
    pub fn new(
        view: TensorView<'a>,
        replacement: Option<&'a Mat>,
        delta: Option<&'a Delta<'a>>,
        opts: &MergeOptions,
        failure: &'a FailureCell,
    ) -> Self {
        let out = match opts.dtype {
            Some(d) if is_float(view.dtype()) => d.safetensors(),
            _ => view.dtype(),
        };
        Self {
            view,
            replacement,
            delta,
            out,
            safe_merge: opts.safe_merge,
            failure,
        }
    }

    /// Bytes this tensor takes in the output.
    pub fn byte_len(&self) -> usize {
        self.view.shape().iter().product::<usize>() * (self.out.bitsize() / 8)
    }

    fn compute(&self) -> Result<Vec<u8>, MergeError> {
        // Accumulate in f32 whatever the storage dtype, round once on write.
        let mut w = self.failure.1.borrow_mut();
        match self.replacement {
            Some(m) => {
                w.clear();
                w.extend_from_slice(&m.data);
            }
            None => {
                if !decode_into(self.view.dtype(), self.view.data(), &mut w) {
                    return Err(MergeError::Unsupported(format!(
                        "cannot convert dtype {:?}",
                        self.view.dtype()
                    )));
                }
            }
        }
        if let Some(delta) = self.delta {
            delta.apply(&mut w)?;
        }
        let (bytes, finite) = from_f32(self.out, &w);
        if let (Some(delta), true, false) = (self.delta, self.safe_merge, finite) {
            return Err(MergeError::NonFinite {
                module: delta.module().to_string(),
            });
        }
        Ok(bytes)
    }
}

impl View for LazyTensor<'_> {
    fn dtype(&self) -> Dtype {
        self.out
    }
    fn shape(&self) -> &[usize] {
        self.view.shape()
    }
    fn data(&self) -> Cow<'_, [u8]> {
        if self.replacement.is_none() && self.delta.is_none() && self.out == self.view.dtype() {
            return Cow::Borrowed(self.view.data());
        }
        match self.compute() {
            Ok(bytes) => Cow::Owned(bytes),
            Err(e) => {
                self.failure.set(e);
                Cow::Owned(vec![0u8; self.byte_len()])
            }
        }
    }
    fn data_len(&self) -> usize {
        self.byte_len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mat(data: Vec<f32>, shape: &[usize]) -> Mat {
        Mat {
            data,
            shape: shape.to_vec(),
        }
    }

    #[test]
    fn low_rank_delta_follows_peft_orientation() {
        // A: [r=1, in=3], B: [out=2, r=1] → B·A = [[1,2,3],[2,4,6]], scale 0.5.
        let a = mat(vec![1.0, 2.0, 3.0], &[1, 3]);
        let b = mat(vec![1.0, 2.0], &[2, 1]);
        let d = Delta::LowRank {
            module: "m".into(),
            a: &a,
            b: &b,
            scale: 0.5,
            transpose: false,
        };
        let mut w = vec![0.0; 6];
        d.apply(&mut w).unwrap();
        assert_eq!(w, vec![0.5, 1.0, 1.5, 1.0, 2.0, 3.0]);
        // fan_in_fan_out (and embeddings) store the weight transposed: [in=3, out=2].
        let t = Delta::LowRank {
            module: "m".into(),
            a: &a,
            b: &b,
            scale: 0.5,
            transpose: true,
        };
        let mut w = vec![0.0; 6];
        t.apply(&mut w).unwrap();
        assert_eq!(w, vec![0.5, 1.0, 1.0, 2.0, 1.5, 3.0]);
    }

    #[test]
    fn lora_bias_is_scaled_and_added() {
        let b = mat(vec![1.0, -2.0], &[2]);
        let d = Delta::Bias {
            module: "m".into(),
            b: &b,
            scale: 2.0,
        };
        let mut w = vec![10.0, 10.0];
        d.apply(&mut w).unwrap();
        assert_eq!(w, vec![12.0, 6.0]);
    }

    #[test]
    fn fan_in_fan_out_plan_checks_transposed_shapes() {
        let cfg = AdapterConfig::from_json(
            r#"{"r":1,"lora_alpha":1,"target_modules":["c_attn"],"fan_in_fan_out":true}"#,
        )
        .unwrap();
        let mut w = AdapterWeights::default();
        w.loras.insert(
            "h.0.attn.c_attn".into(),
            Lora {
                a: Some(mat(vec![0.0; 3], &[1, 3])),
                b: Some(mat(vec![0.0; 2], &[2, 1])),
                b_bias: None,
                embedding: false,
                scale: 1.0,
            },
        );
        let mut infos = HashMap::new();
        infos.insert(
            "h.0.attn.c_attn.weight".to_string(),
            (vec![3, 2], Dtype::F32),
        );
        assert!(w.plan(&infos, &cfg).is_ok(), "Conv1D weight is [in, out]");
        infos.insert(
            "h.0.attn.c_attn.weight".to_string(),
            (vec![2, 3], Dtype::F32),
        );
        assert!(matches!(
            w.plan(&infos, &cfg),
            Err(MergeError::Shape { .. })
        ));
    }
}
