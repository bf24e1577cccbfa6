//! Adapter tensors, the merge plan, and the f32 kernels that apply it row block by row block.

use std::collections::{BTreeMap, HashMap};

use safetensors::Dtype;

use super::MergeError;
use mole_formats::peft::weights::{MappedAdapter, Raw};
use mole_formats::peft::AdapterConfig;
use mole_formats::safetensors::is_float;
use mole_kernels::madd;

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
    /// The safetensors dtype it is written as.
    pub fn safetensors(self) -> Dtype {
        match self {
            Self::F32 => Dtype::F32,
            Self::Bf16 => Dtype::BF16,
            Self::F16 => Dtype::F16,
        }
    }
}

/// f32 → bf16 bits, round to nearest even (as torch and `half` do), branch-free for finite
/// values so the loop vectorises; NaN stays a quiet NaN.
#[inline]
fn bf16_bits(v: f32) -> u16 {
    let b = v.to_bits();
    let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
    let quiet_nan = ((b >> 16) as u16) | 0x0040;
    if v.is_nan() {
        quiet_nan
    } else {
        rounded
    }
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

/// A low-rank update of one base tensor: `W += scale · (B·A)` (transposed for embeddings and
/// fan_in_fan_out), or `bias += scale · b` for a LoRA bias.
#[derive(Debug)]
pub enum Delta<'a> {
    /// Weight update.
    LowRank {
        /// The adapter's module name.
        module: String,
        /// `lora_A`.
        a: &'a Raw,
        /// `lora_B`.
        b: &'a Raw,
        /// `lora_alpha / r` (rsLoRA: `/ sqrt(r)`).
        scale: f64,
        /// Whether `B·A` is added transposed (embeddings, fan_in_fan_out).
        transpose: bool,
    },
    /// Bias update.
    Bias {
        /// The adapter's module name.
        module: String,
        /// `lora_B.bias`.
        b: &'a Raw,
        /// `lora_alpha / r`.
        scale: f64,
    },
}

/// Checked merge plan: base tensor name → what happens to it.
pub struct Plan<'a> {
    /// Base tensor name → the update added to it.
    pub deltas: HashMap<String, Delta<'a>>,
    /// Base tensor name → the adapter's tensor that replaces it (modules_to_save).
    pub replacements: HashMap<String, &'a Raw>,
}

/// Checks every module of `adapter` against the base's tensor shapes and returns the plan.
pub fn plan<'a>(
    adapter: &'a MappedAdapter,
    infos: &HashMap<String, (Vec<usize>, Dtype)>,
    config: &AdapterConfig,
) -> Result<Plan<'a>, MergeError> {
    let mut plan = Plan {
        deltas: HashMap::new(),
        replacements: HashMap::new(),
    };
    for (name, t) in &adapter.replacements {
        let (shape, _) = infos.get(name).ok_or_else(|| MergeError::Shape {
            module: name.clone(),
            message: "adapter replaces a tensor the base model does not have".into(),
        })?;
        if *shape != t.shape {
            return Err(MergeError::Shape {
                module: name.clone(),
                message: format!("replacement shape {:?}, base {:?}", t.shape, shape),
            });
        }
        plan.replacements.insert(name.clone(), t);
    }
    for (module, lora) in &adapter.loras {
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

/// Scales of `adapter` by module family (last name component), for the metadata.
pub fn scales_by_family(adapter: &MappedAdapter) -> BTreeMap<String, Vec<f64>> {
    let mut out: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for (module, lora) in &adapter.loras {
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

/// A [`Delta`] with its adapter tensors decoded to f32 and laid out for row-wise application:
/// row `i` of the base tensor gets `scale · Σ_κ coef[i, κ] · basis[κ, :]`.
///
/// * LoRA, `W [m, n]`: coef = B `[m, k]`, basis = A `[k, n]`.
/// * LoRA on a transposed weight (embeddings, fan_in_fan_out), `W [n, m]`: coef = Aᵀ, basis = Bᵀ.
/// * LoRA bias (a 1-D tensor is one row): coef = `[1]`, basis = `lora_B.bias`.
///
/// As PEFT does, the product is formed in f32, then scaled, then added.
pub struct Prepared {
    coef: Vec<f32>,
    basis: Vec<f32>,
    k: usize,
    scale: f32,
}

fn transpose(data: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0.0; data.len()];
    for (i, row) in data.chunks_exact(cols).enumerate().take(rows) {
        for (j, v) in row.iter().enumerate() {
            t[j * rows + i] = *v;
        }
    }
    t
}

impl Delta<'_> {
    /// Module name (for errors).
    pub fn module(&self) -> &str {
        match self {
            Delta::LowRank { module, .. } | Delta::Bias { module, .. } => module,
        }
    }

    /// Decodes the adapter tensors this delta needs.
    pub fn prepare(&self, adapter: &MappedAdapter) -> Prepared {
        match self {
            Delta::LowRank {
                a,
                b,
                scale,
                transpose: t,
                ..
            } => {
                let (m, k, n) = (b.shape[0], b.shape[1], a.shape[1]);
                let (a, b) = (adapter.decode(a).data, adapter.decode(b).data);
                let (coef, basis) = if *t {
                    (transpose(&a, k, n), transpose(&b, m, k))
                } else {
                    (b, a)
                };
                Prepared {
                    coef,
                    basis,
                    k,
                    scale: *scale as f32,
                }
            }
            Delta::Bias { b, scale, .. } => Prepared {
                coef: vec![1.0],
                basis: adapter.decode(b).data,
                k: 1,
                scale: *scale as f32,
            },
        }
    }
}

/// A storage format of one element.
trait Elem {
    const SIZE: usize;
    fn load(b: &[u8]) -> f32;
    /// Stores `v`; false when the stored value is not finite (a finite f32 may overflow).
    fn store(v: f32, b: &mut [u8]) -> bool;
}
struct EF32;
struct EBf16;
struct EF16;
struct EF64;
impl Elem for EF32 {
    const SIZE: usize = 4;
    #[inline(always)]
    fn load(b: &[u8]) -> f32 {
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
    #[inline(always)]
    fn store(v: f32, b: &mut [u8]) -> bool {
        b.copy_from_slice(&v.to_le_bytes());
        v.is_finite()
    }
}
impl Elem for EBf16 {
    const SIZE: usize = 2;
    #[inline(always)]
    fn load(b: &[u8]) -> f32 {
        // bf16 is the upper half of an f32: widening is exact.
        f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16)
    }
    #[inline(always)]
    fn store(v: f32, b: &mut [u8]) -> bool {
        let h = bf16_bits(v);
        b.copy_from_slice(&h.to_le_bytes());
        h & 0x7f80 != 0x7f80
    }
}
impl Elem for EF16 {
    const SIZE: usize = 2;
    #[inline(always)]
    fn load(b: &[u8]) -> f32 {
        half::f16::from_le_bytes([b[0], b[1]]).to_f32()
    }
    #[inline(always)]
    fn store(v: f32, b: &mut [u8]) -> bool {
        let h = half::f16::from_f32(v);
        b.copy_from_slice(&h.to_le_bytes());
        h.is_finite()
    }
}
impl Elem for EF64 {
    const SIZE: usize = 8;
    #[inline(always)]
    fn load(b: &[u8]) -> f32 {
        f64::from_le_bytes(b.try_into().expect("8 bytes")) as f32
    }
    #[inline(always)]
    fn store(v: f32, b: &mut [u8]) -> bool {
        b.copy_from_slice(&(v as f64).to_le_bytes());
        v.is_finite()
    }
}

/// A tile of the output: rows `r..r + R` (of the task), columns `j..j + len` (`len == L` when
/// `FULL`, so the `R × L` accumulators stay in vector registers and each row of the basis is
/// loaded once for `R` rows). Decodes, adds the update, encodes; false if any output value is
/// not finite.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn tile<I: Elem, O: Elem, const L: usize, const R: usize, const FULL: bool, const FMA: bool>(
    src: &[u8],
    dst: &mut [u8],
    cols: usize,
    r: usize,
    j: usize,
    len: usize,
    delta: Option<(&[f32], &[f32], usize, f32)>,
) -> bool {
    let len = if FULL { L } else { len };
    // The update first, with its accumulators in registers; then the base values.
    let mut d = [[0f32; L]; R];
    if let Some((coef, basis, k, _)) = delta {
        for kk in 0..k {
            let at = kk * cols + j;
            if FULL {
                // By value: loaded into registers once for the R rows (as memory operands of
                // each FMA the loads would outnumber the FMAs, and the loads would bound).
                let a: [f32; L] = basis[at..at + L].try_into().expect("L values");
                for (rr, acc) in d.iter_mut().enumerate() {
                    let c = coef[(r + rr) * k + kk];
                    for (x, b) in acc.iter_mut().zip(a) {
                        *x = madd::<FMA>(c, b, *x);
                    }
                }
            } else {
                let a = &basis[at..at + len];
                for (rr, acc) in d.iter_mut().enumerate() {
                    let c = coef[(r + rr) * k + kk];
                    for (x, b) in acc[..len].iter_mut().zip(a) {
                        *x = madd::<FMA>(c, *b, *x);
                    }
                }
            }
        }
    }
    let mut finite = true;
    for (rr, acc) in d.iter().enumerate() {
        let at = (r + rr) * cols + j;
        let s = &src[at * I::SIZE..(at + len) * I::SIZE];
        let o = &mut dst[at * O::SIZE..(at + len) * O::SIZE];
        let mut w = [0f32; L];
        for (x, b) in w[..len].iter_mut().zip(s.chunks_exact(I::SIZE)) {
            *x = I::load(b);
        }
        if let Some((_, _, _, scale)) = delta {
            for (x, y) in w[..len].iter_mut().zip(&acc[..len]) {
                *x += scale * y;
            }
        }
        for (x, b) in w[..len].iter().zip(o.chunks_exact_mut(O::SIZE)) {
            finite &= O::store(*x, b);
        }
    }
    finite
}

/// Rows `row0..` of a tensor with `cols` values per row: `src` in `I`, `dst` in `O`.
#[inline(always)]
fn rows_typed<I: Elem, O: Elem, const L: usize, const R: usize, const FMA: bool>(
    src: &[u8],
    dst: &mut [u8],
    row0: usize,
    cols: usize,
    delta: Option<&Prepared>,
) -> bool {
    let rows = dst.len() / (cols * O::SIZE);
    let dl = delta.map(|p| {
        (
            &p.coef[row0 * p.k..(row0 + rows) * p.k],
            &p.basis[..],
            p.k,
            p.scale,
        )
    });
    let full = cols / L * L;
    let mut finite = true;
    let mut r = 0;
    while r + R <= rows {
        for j in (0..full).step_by(L) {
            finite &= tile::<I, O, L, R, true, FMA>(src, dst, cols, r, j, L, dl);
        }
        if full < cols {
            finite &= tile::<I, O, L, R, false, FMA>(src, dst, cols, r, full, cols - full, dl);
        }
        r += R;
    }
    while r < rows {
        for j in (0..full).step_by(L) {
            finite &= tile::<I, O, L, 1, true, FMA>(src, dst, cols, r, j, L, dl);
        }
        if full < cols {
            finite &= tile::<I, O, L, 1, false, FMA>(src, dst, cols, r, full, cols - full, dl);
        }
        r += 1;
    }
    finite
}

#[inline(always)]
fn rows_dispatch<const L: usize, const R: usize, const FMA: bool>(
    src_dtype: Dtype,
    src: &[u8],
    out_dtype: Dtype,
    dst: &mut [u8],
    row0: usize,
    cols: usize,
    delta: Option<&Prepared>,
) -> bool {
    macro_rules! out {
        ($i:ty) => {
            match out_dtype {
                Dtype::BF16 => rows_typed::<$i, EBf16, L, R, FMA>(src, dst, row0, cols, delta),
                Dtype::F16 => rows_typed::<$i, EF16, L, R, FMA>(src, dst, row0, cols, delta),
                Dtype::F64 => rows_typed::<$i, EF64, L, R, FMA>(src, dst, row0, cols, delta),
                _ => rows_typed::<$i, EF32, L, R, FMA>(src, dst, row0, cols, delta),
            }
        };
    }
    match src_dtype {
        Dtype::BF16 => out!(EBf16),
        Dtype::F16 => out!(EF16),
        Dtype::F64 => out!(EF64),
        _ => out!(EF32),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rows_avx2(
    src_dtype: Dtype,
    src: &[u8],
    out_dtype: Dtype,
    dst: &mut [u8],
    row0: usize,
    cols: usize,
    delta: Option<&Prepared>,
) -> bool {
    // 2 rows × 32 lanes: 8 of the 16 ymm registers accumulate.
    rows_dispatch::<32, 2, true>(src_dtype, src, out_dtype, dst, row0, cols, delta)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn rows_avx512(
    src_dtype: Dtype,
    src: &[u8],
    out_dtype: Dtype,
    dst: &mut [u8],
    row0: usize,
    cols: usize,
    delta: Option<&Prepared>,
) -> bool {
    // 4 rows × 64 lanes: 16 of the 32 zmm registers accumulate.
    rows_dispatch::<64, 4, true>(src_dtype, src, out_dtype, dst, row0, cols, delta)
}

/// Computes output rows `row0..row0 + dst.len() / (cols · out size)` of a tensor: decodes
/// `src` (those rows, in `src_dtype`), adds the update, encodes into `dst` (in `out_dtype`),
/// in one pass with everything in registers or L1. True when every value is finite. Both
/// dtypes must be float types.
pub fn merge_rows(
    src_dtype: Dtype,
    src: &[u8],
    out_dtype: Dtype,
    dst: &mut [u8],
    row0: usize,
    cols: usize,
    delta: Option<&Prepared>,
) -> bool {
    debug_assert!(is_float(src_dtype) && is_float(out_dtype));
    #[cfg(target_arch = "x86_64")]
    {
        let c = mole_kernels::cpu::caps();
        if c.avx512f && c.avx2_fma() {
            // SAFETY: the CPU has these features (checked just above).
            return unsafe { rows_avx512(src_dtype, src, out_dtype, dst, row0, cols, delta) };
        }
        if c.avx2_fma() {
            // SAFETY: as above.
            return unsafe { rows_avx2(src_dtype, src, out_dtype, dst, row0, cols, delta) };
        }
    }
    rows_dispatch::<32, 2, false>(src_dtype, src, out_dtype, dst, row0, cols, delta)
}

#[cfg(test)]
mod tests {
    use super::*;
    use mole_formats::peft::weights::Lora;
    use mole_formats::safetensors::to_f32;

    fn raw_f32(bytes: &mut Vec<u8>, data: &[f32], shape: &[usize]) -> Raw {
        let start = bytes.len();
        for v in data {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        Raw {
            dtype: Dtype::F32,
            shape: shape.to_vec(),
            start,
            end: bytes.len(),
        }
    }

    fn adapter(bytes: Vec<u8>) -> MappedAdapter {
        MappedAdapter::from_owned(bytes)
    }

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    /// Applies `p` to an f32 tensor `w` of `cols` values per row, in row blocks of `block`.
    fn apply(p: &Prepared, w: &[f32], cols: usize, block: usize) -> Vec<f32> {
        let src = f32_bytes(w);
        let mut dst = vec![0u8; src.len()];
        for (i, (s, d)) in src
            .chunks(block * cols * 4)
            .zip(dst.chunks_mut(block * cols * 4))
            .enumerate()
        {
            assert!(merge_rows(
                Dtype::F32,
                s,
                Dtype::F32,
                d,
                i * block,
                cols,
                Some(p)
            ));
        }
        to_f32(Dtype::F32, &dst).unwrap()
    }

    fn apply_in_blocks(p: &Prepared, rows: usize, cols: usize, block: usize) -> Vec<f32> {
        apply(p, &vec![0.0; rows * cols], cols, block)
    }

    #[test]
    fn low_rank_delta_follows_peft_orientation_in_any_row_blocking() {
        // A: [r=1, in=3], B: [out=2, r=1] → B·A = [[1,2,3],[2,4,6]], scale 0.5.
        let mut bytes = Vec::new();
        let a = raw_f32(&mut bytes, &[1.0, 2.0, 3.0], &[1, 3]);
        let b = raw_f32(&mut bytes, &[1.0, 2.0], &[2, 1]);
        let ad = adapter(bytes);
        let d = Delta::LowRank {
            module: "m".into(),
            a: &a,
            b: &b,
            scale: 0.5,
            transpose: false,
        };
        let p = d.prepare(&ad);
        for block in [1, 2] {
            assert_eq!(
                apply_in_blocks(&p, 2, 3, block),
                vec![0.5, 1.0, 1.5, 1.0, 2.0, 3.0]
            );
        }
        // fan_in_fan_out (and embeddings) store the weight transposed: [in=3, out=2].
        let t = Delta::LowRank {
            module: "m".into(),
            a: &a,
            b: &b,
            scale: 0.5,
            transpose: true,
        };
        let p = t.prepare(&ad);
        for block in [1, 2, 3] {
            assert_eq!(
                apply_in_blocks(&p, 3, 2, block),
                vec![0.5, 1.0, 1.0, 2.0, 1.5, 3.0]
            );
        }
    }

    #[test]
    fn lora_bias_is_scaled_and_added() {
        let mut bytes = Vec::new();
        let b = raw_f32(&mut bytes, &[1.0, -2.0], &[2]);
        let ad = adapter(bytes);
        let d = Delta::Bias {
            module: "m".into(),
            b: &b,
            scale: 2.0,
        };
        assert_eq!(apply(&d.prepare(&ad), &[10.0, 10.0], 2, 1), vec![12.0, 6.0]);
    }

    #[test]
    fn conversions_round_to_nearest_even_and_flag_non_finite() {
        // Ties, near-ties, signed zero, subnormal, huge, infinities and NaN; more values than
        // one LANES chunk so both the full and the tail paths run.
        let mut vals = vec![
            1.0f32,
            1.0 + 1.0 / 256.0,
            1.0 + 3.0 / 256.0,
            -0.0,
            1e-40,
            3.0e38,
            -1.0 - 1.0 / 128.0,
        ];
        vals.extend((0..100).map(|i| (i as f32 - 50.0) * 0.0123));
        let src = f32_bytes(&vals);
        for (dt, size) in [(Dtype::BF16, 2), (Dtype::F16, 2), (Dtype::F64, 8)] {
            let mut out = vec![0u8; vals.len() * size];
            let finite = merge_rows(Dtype::F32, &src, dt, &mut out, 0, vals.len(), None);
            // f16 overflows to infinity on 3e38.
            assert_eq!(finite, dt != Dtype::F16, "{dt:?}");
            let want: Vec<u8> = vals
                .iter()
                .flat_map(|v| match dt {
                    Dtype::BF16 => half::bf16::from_f32(*v).to_le_bytes().to_vec(),
                    Dtype::F16 => half::f16::from_f32(*v).to_le_bytes().to_vec(),
                    _ => (*v as f64).to_le_bytes().to_vec(),
                })
                .collect();
            assert_eq!(out, want, "{dt:?}");
            // And back, exactly.
            let mut back = vec![0u8; src.len()];
            merge_rows(dt, &out, Dtype::F32, &mut back, 0, vals.len(), None);
            assert_eq!(to_f32(Dtype::F32, &back), to_f32(dt, &out), "{dt:?}");
        }
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut out = [0u8; 2];
            assert!(!merge_rows(
                Dtype::F32,
                &f32_bytes(&[bad]),
                Dtype::BF16,
                &mut out,
                0,
                1,
                None
            ));
            let got = half::bf16::from_le_bytes(out);
            assert_eq!(got.is_nan(), bad.is_nan());
        }
    }

    #[test]
    fn wide_rows_match_a_plain_product() {
        // cols not a multiple of LANES, k = 3, both orientations, several row blockings.
        let (m, k, n) = (5, 3, 150);
        let a: Vec<f32> = (0..k * n)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.25)
            .collect();
        let b: Vec<f32> = (0..m * k)
            .map(|i| ((i * 5 % 11) as f32 - 5.0) * 0.5)
            .collect();
        let w: Vec<f32> = (0..m * n).map(|i| (i % 17) as f32).collect();
        let mut bytes = Vec::new();
        let ra = raw_f32(&mut bytes, &a, &[k, n]);
        let rb = raw_f32(&mut bytes, &b, &[m, k]);
        let ad = adapter(bytes);
        let exact = |i: usize, j: usize| -> f32 {
            let d: f32 = (0..k).map(|kk| b[i * k + kk] * a[kk * n + j]).sum();
            0.5 * d
        };
        let d = Delta::LowRank {
            module: "m".into(),
            a: &ra,
            b: &rb,
            scale: 0.5,
            transpose: false,
        };
        let p = d.prepare(&ad);
        for block in [1, 2, 5] {
            let got = apply(&p, &w, n, block);
            for i in 0..m {
                for j in 0..n {
                    assert_eq!(got[i * n + j], w[i * n + j] + exact(i, j), "[{i},{j}]");
                }
            }
        }
        let t = Delta::LowRank {
            module: "m".into(),
            a: &ra,
            b: &rb,
            scale: 0.5,
            transpose: true,
        };
        let p = t.prepare(&ad);
        let wt: Vec<f32> = (0..n * m).map(|i| (i % 19) as f32).collect();
        for block in [1, 7, 150] {
            let got = apply(&p, &wt, m, block);
            for j in 0..n {
                for i in 0..m {
                    assert_eq!(got[j * m + i], wt[j * m + i] + exact(i, j), "[{j},{i}]");
                }
            }
        }
    }

    #[test]
    fn every_kernel_variant_gives_the_same_bits_on_exact_inputs() {
        // The portable kernel (no FMA), AVX2 and AVX-512 (where the CPU has them): on values
        // whose products and sums are exact, all agree with the plain product bit for bit,
        // through bf16 in and out, in row tiles with remainders (7 rows, 100 columns).
        let (m, k, n) = (7, 4, 100);
        let a: Vec<f32> = (0..k * n)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) / 8.0)
            .collect();
        let b: Vec<f32> = (0..m * k)
            .map(|i| ((i * 5 % 11) as f32 - 5.0) / 4.0)
            .collect();
        let w: Vec<f32> = (0..m * n).map(|i| ((i % 23) as f32 - 11.0) / 2.0).collect();
        let mut bytes = Vec::new();
        let ra = raw_f32(&mut bytes, &a, &[k, n]);
        let rb = raw_f32(&mut bytes, &b, &[m, k]);
        let ad = adapter(bytes);
        let d = Delta::LowRank {
            module: "m".into(),
            a: &ra,
            b: &rb,
            scale: 2.0,
            transpose: false,
        };
        let p = d.prepare(&ad);
        let src: Vec<u8> = w
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect();
        let want: Vec<u8> = (0..m * n)
            .flat_map(|idx| {
                let (i, j) = (idx / n, idx % n);
                let dot: f32 = (0..k).map(|kk| b[i * k + kk] * a[kk * n + j]).sum();
                half::bf16::from_f32(w[idx] + 2.0 * dot).to_le_bytes()
            })
            .collect();
        type Kernel<'a> = dyn Fn(&mut [u8]) -> bool + 'a;
        let portable = |dst: &mut [u8]| {
            rows_dispatch::<32, 2, false>(Dtype::BF16, &src, Dtype::BF16, dst, 0, n, Some(&p))
        };
        let mut variants: Vec<(&str, Box<Kernel<'_>>)> = vec![("portable", Box::new(portable))];
        #[cfg(target_arch = "x86_64")]
        {
            let c = mole_kernels::cpu::caps();
            if c.avx2_fma() {
                variants.push((
                    "avx2",
                    // SAFETY: the CPU has the features (checked).
                    Box::new(|dst: &mut [u8]| unsafe {
                        rows_avx2(Dtype::BF16, &src, Dtype::BF16, dst, 0, n, Some(&p))
                    }),
                ));
            }
            if c.avx512f && c.avx2_fma() {
                variants.push((
                    "avx512",
                    // SAFETY: as above.
                    Box::new(|dst: &mut [u8]| unsafe {
                        rows_avx512(Dtype::BF16, &src, Dtype::BF16, dst, 0, n, Some(&p))
                    }),
                ));
            }
        }
        for (name, f) in &variants {
            let mut dst = vec![0u8; src.len()];
            assert!(f(&mut dst), "{name}");
            assert!(dst == want, "{name}");
        }
    }

    #[test]
    fn fan_in_fan_out_plan_checks_transposed_shapes() {
        let cfg = AdapterConfig::from_json(
            r#"{"r":1,"lora_alpha":1,"target_modules":["c_attn"],"fan_in_fan_out":true}"#,
        )
        .unwrap();
        let mut bytes = Vec::new();
        let a = raw_f32(&mut bytes, &[0.0; 3], &[1, 3]);
        let b = raw_f32(&mut bytes, &[0.0; 2], &[2, 1]);
        let mut w = adapter(bytes);
        w.loras.insert(
            "h.0.attn.c_attn".into(),
            Lora {
                a: Some(a),
                b: Some(b),
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
        assert!(plan(&w, &infos, &cfg).is_ok(), "Conv1D weight is [in, out]");
        infos.insert(
            "h.0.attn.c_attn.weight".to_string(),
            (vec![2, 3], Dtype::F32),
        );
        assert!(matches!(
            plan(&w, &infos, &cfg),
            Err(MergeError::Shape { .. })
        ));
    }
}
