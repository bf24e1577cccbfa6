//! BGMV LoRA ops for decode steps on the tensor path (`loraKernel: bgmv`, off by default and
//! unproven on a device until a GPU run says otherwise; see docs/benchmarks.md): per token,
//! its adapter's update read straight from the slot pool by the token's slot index.
//!
//! - [`shrink`]: `v[p, t, ·] = x[t] · Aᵀ[slot[t]·n + p]` for the `n` projections of a group,
//!   as partial sums over splits of the input `[splits, n, tokens, rank]` in f32: one launch
//!   per group (q/k/v share one, gate/up one), spread over many blocks even for one token.
//! - [`expand`]: `out[t] = y[t] + v[p, t] · B[slot[t]]ᵀ` for projection `p`, adding the
//!   splits first: one launch per projection, the add fused, in the dtype of `y`.
//!
//! Slot 0 (the pool's zero slot) means no adapter: those tokens read no weights, their `v`
//! is zero and `out` is `y` itself; a slot at or past the pool's count is treated alike, so no
//! index can read outside the pool.
//!
//! Why: the grouped ops of `model/slots.rs` (gather `x`, select slots, batched matmul, mask,
//! select, matmul, scatter, add) make ~8 tensor ops per projection group and ~5 per projection,
//! each a launch and an allocation; on the H200 a rank-16 update cost ~67 µs per projection,
//! more than the base layer (docs/benchmarks.md). Here it is one launch per group and one per
//! projection, and x, v and y are read where they lie.
//!
//! Numerics: everything accumulates in f32, each product an FMA, in an order fixed by the
//! shapes alone: in each split of [`shrink_split`]`(rank)` input rows, the shrink's thread
//! `(g, c)` of [`shrink_groups`]`(rank)` groups sums the split's rows `g, g + groups, …` in
//! increasing order for its 8 ranks, then the groups' partial sums are added in a tree
//! (`part[g] += part[g + s]` for `s = groups/2, …, 1`); the expand adds the splits' sums in
//! split order, sums ranks `0..rank` in order and adds `y` once, rounding once to `y`'s
//! dtype. The CPU side of
//! both ops (what a CPU runs, and what the device test compares the kernels to) is exactly
//! that arithmetic, so a GPU should agree with it bit for bit. Against the grouped ops the
//! difference is their extra roundings (x, the shrink's result and the product to the pool's
//! dtype, the update to the output's), bounded in the tests of `model/slots.rs`.
//!
//! The CUDA kernels are `crates/kernels/kernels/lora.cu`, compiled to PTX by `build.rs` under the
//! `cuda` feature and loaded with candle's custom-function loader.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Storage, Tensor};
use half::{bf16, f16};

/// Threads of a shrink block at most, and of every expand block.
pub const THREADS: usize = 256;

/// Ranks one shrink thread sums, and one expand load reads: a 16-byte load of bf16/f16. The
/// pool's ranks are padded to a multiple of it ([`super::RANK_ALIGN`]).
pub const CHUNK: usize = 8;

/// Tokens in a step at most for which [`crate::model::LoraKernel::Bgmv`] takes the step:
/// every token reads its adapter's weights for itself, where the grouped ops read each
/// distinct adapter once, so long prefills keep the grouped ops. 64 tokens of one rank-16
/// adapter re-read ~8 MiB per projection of a 4096-wide model from a GPU's L2 (50 MB on an
/// H100): still far below the base weights; unmeasured, a device run should check it.
pub const MAX_TOKENS: usize = 64;

/// The shrink's row groups for `rank`: the largest power of two (a tree of halvings) that
/// keeps a block of `groups · rank / CHUNK` threads within [`THREADS`], at least one.
pub fn shrink_groups(rank: usize) -> usize {
    let chunks = (rank / CHUNK).max(1);
    let most = (THREADS / chunks).max(1);
    1 << most.ilog2()
}

/// Rows of the shrink's input each block sums: four per row group, about 16 KiB of bf16
/// weights whatever the rank, so a decode step's few tokens still spread a matrix over many
/// blocks (a 4096-wide input at rank 16: 8 per token and projection) with several loads in
/// flight per thread.
pub fn shrink_split(rank: usize) -> usize {
    4 * shrink_groups(rank)
}

/// The shrink's splits of a `d_in`-wide input at `rank` (at least one).
pub fn shrink_splits(d_in: usize, rank: usize) -> usize {
    d_in.div_ceil(shrink_split(rank)).max(1)
}

/// An element type of the ops: f32, bf16 or f16 (conversions to f32 are exact).
pub trait Elem: Copy + Send + Sync + 'static {
    /// Its candle dtype.
    const DTYPE: DType;
    /// The value as f32, exactly.
    fn to_f32(self) -> f32;
    /// `v` rounded to nearest, ties to even (as CUDA's `__float2bfloat16_rn`/`__float2half_rn`).
    fn from_f32(v: f32) -> Self;
    /// The elements of a CPU storage of this type.
    fn of(s: &CpuStorage) -> Option<&[Self]>;
    /// A CPU storage of these elements.
    fn storage(v: Vec<Self>) -> CpuStorage;
}

macro_rules! elem {
    ($t:ty, $d:ident, $to:expr, $from:expr) => {
        impl Elem for $t {
            const DTYPE: DType = DType::$d;
            #[inline(always)]
            fn to_f32(self) -> f32 {
                $to(self)
            }
            #[inline(always)]
            fn from_f32(v: f32) -> Self {
                $from(v)
            }
            fn of(s: &CpuStorage) -> Option<&[Self]> {
                match s {
                    CpuStorage::$d(v) => Some(v),
                    _ => None,
                }
            }
            fn storage(v: Vec<Self>) -> CpuStorage {
                CpuStorage::$d(v)
            }
        }
    };
}
elem!(f32, F32, std::convert::identity, std::convert::identity);
elem!(bf16, BF16, bf16::to_f32, bf16::from_f32);
elem!(f16, F16, f16::to_f32, f16::from_f32);

/// Whether token slot `s` reads an adapter of a pool of `num_slots` slots.
#[inline(always)]
fn reads(s: u32, num_slots: usize) -> bool {
    s != 0 && (s as usize) < num_slots
}

/// The shrink's arithmetic (see the module): `x` `[tokens, d_in]`, `at` `[num_slots · n, d_in,
/// rank]`, `slots` `[tokens]`; returns the partial sums `v` `[splits, n, tokens, rank]`
/// ([`shrink_splits`]).
pub fn shrink_reference<X: Elem, W: Elem>(
    x: &[X],
    at: &[W],
    slots: &[u32],
    d_in: usize,
    rank: usize,
    n: usize,
) -> Vec<f32> {
    let tokens = slots.len();
    assert!(rank > 0 && rank.is_multiple_of(CHUNK) && n > 0);
    assert!(x.len() == tokens * d_in && at.len().is_multiple_of(n * d_in * rank));
    let num_slots = at.len() / (n * d_in * rank);
    let groups = shrink_groups(rank);
    let (split, splits) = (shrink_split(rank), shrink_splits(d_in, rank));
    let mut v = vec![0f32; splits * n * tokens * rank];
    let mut part = vec![0f32; groups * rank];
    for (z, p) in (0..splits).flat_map(|z| (0..n).map(move |p| (z, p))) {
        let rows = z * split..d_in.min((z + 1) * split);
        for (t, &slot) in slots.iter().enumerate() {
            if !reads(slot, num_slots) {
                continue;
            }
            let a = &at[(slot as usize * n + p) * d_in * rank..][..d_in * rank];
            let xr = &x[t * d_in..][..d_in];
            for (g, acc) in part.chunks_exact_mut(rank).enumerate() {
                acc.fill(0.0);
                for i in (rows.start + g..rows.end).step_by(groups) {
                    let xi = xr[i].to_f32();
                    for (s, w) in acc.iter_mut().zip(&a[i * rank..][..rank]) {
                        *s = xi.mul_add(w.to_f32(), *s);
                    }
                }
            }
            let mut s = groups / 2;
            while s > 0 {
                let (low, high) = part.split_at_mut(s * rank);
                for (a, b) in low.iter_mut().zip(&high[..s * rank]) {
                    *a += *b;
                }
                s /= 2;
            }
            v[((z * n + p) * tokens + t) * rank..][..rank].copy_from_slice(&part[..rank]);
        }
    }
    v
}

/// The expand's arithmetic (see the module): `y` `[tokens, d_out]` with rows `y_stride`
/// apart, `v` the shrink's partial sums `[splits, n, tokens, rank]` of which projection
/// `proj`, `b` `[num_slots, d_out, rank]`; returns `[tokens, d_out]`.
#[allow(clippy::too_many_arguments)]
pub fn expand_reference<Y: Elem, W: Elem>(
    y: &[Y],
    y_stride: usize,
    v: &[f32],
    n: usize,
    proj: usize,
    b: &[W],
    slots: &[u32],
    d_out: usize,
    rank: usize,
) -> Vec<Y> {
    let tokens = slots.len();
    assert!(rank > 0 && rank.is_multiple_of(CHUNK) && proj < n);
    assert!(b.len().is_multiple_of(d_out * rank) && v.len().is_multiple_of(n * tokens * rank));
    let stride = n * tokens * rank;
    let splits = v.len().checked_div(stride).unwrap_or(0);
    assert!(tokens == 0 || y.len() >= (tokens - 1) * y_stride + d_out);
    let num_slots = b.len() / (d_out * rank);
    let mut out = Vec::with_capacity(tokens * d_out);
    for (t, &slot) in slots.iter().enumerate() {
        let yr = &y[t * y_stride..][..d_out];
        if !reads(slot, num_slots) {
            out.extend_from_slice(yr);
            continue;
        }
        // The splits' partial sums, in split order.
        let at = (proj * tokens + t) * rank;
        let vr: Vec<f32> = (0..rank)
            .map(|k| (1..splits).fold(v[at + k], |s, z| s + v[z * stride + at + k]))
            .collect();
        let bs = &b[slot as usize * d_out * rank..][..d_out * rank];
        out.extend(yr.iter().zip(bs.chunks_exact(rank)).map(|(yo, br)| {
            let acc = vr
                .iter()
                .zip(br)
                .fold(0f32, |acc, (vk, w)| vk.mul_add(w.to_f32(), acc));
            Y::from_f32(yo.to_f32() + acc)
        }));
    }
    out
}

/// The shrink of a projection group: `x` `[tokens, d_in]` (any float dtype), `at` the group's
/// pool `[slots · n, d_in, rank]`, `slots` each token's slot `[tokens]` u32 (0: none) → the
/// partial sums over [`shrink_splits`] of the input, `[splits, n, tokens, rank]` f32.
pub fn shrink(x: &Tensor, at: &Tensor, slots: &Tensor, n: usize) -> Result<Tensor> {
    let (tokens, d_in) = x.dims2()?;
    let (rows, a_in, rank) = at.dims3()?;
    if a_in != d_in || n == 0 || !rows.is_multiple_of(n) || !rank.is_multiple_of(CHUNK) {
        candle_core::bail!(
            "bgmv shrink: x {:?} against a pool {:?} of {n} projections (rank a multiple of {CHUNK})",
            x.dims(),
            at.dims()
        );
    }
    if slots.dims1()? != tokens || slots.dtype() != DType::U32 {
        candle_core::bail!("bgmv shrink: slots {:?} for {tokens} tokens", slots.shape());
    }
    x.contiguous()?
        .apply_op3_no_bwd(&at.contiguous()?, &slots.contiguous()?, &Shrink { n })
}

/// The expand-add of projection `proj` of a group: `y` `[tokens, d_out]` (the base product;
/// rows may be a column slice of a wider one), `v` the group's [`shrink`], `b` the
/// projection's pool `[slots, d_out, rank]` (s·B), `slots` as for [`shrink`] → `y` plus each
/// token's update, `[tokens, d_out]` in `y`'s dtype.
pub fn expand(y: &Tensor, v: &Tensor, proj: usize, b: &Tensor, slots: &Tensor) -> Result<Tensor> {
    let (tokens, d_out) = y.dims2()?;
    let (_, n, v_tokens, rank) = v.dims4()?;
    let (_, b_out, b_rank) = b.dims3()?;
    if v_tokens != tokens || proj >= n || b_out != d_out || b_rank != rank {
        candle_core::bail!(
            "bgmv expand: y {:?}, v {:?} (projection {proj}), b {:?}",
            y.dims(),
            v.dims(),
            b.dims()
        );
    }
    if v.dtype() != DType::F32 || slots.dims1()? != tokens || slots.dtype() != DType::U32 {
        candle_core::bail!("bgmv expand: v {:?}, slots {:?}", v.dtype(), slots.shape());
    }
    // Rows in place (a fused product's column slice); anything else is made contiguous.
    let y = match y.stride()[1] {
        1 => y.clone(),
        _ => y.contiguous()?,
    };
    y.apply_op3_no_bwd(
        &v.contiguous()?,
        &b.contiguous()?,
        &Expand {
            proj,
            slots: slots.contiguous()?,
        },
    )
}

/// The contiguous elements of a CPU operand.
fn cpu<'s, T: Elem>(s: &'s CpuStorage, l: &Layout, what: &str) -> Result<&'s [T]> {
    let Some((a, b)) = l.contiguous_offsets() else {
        candle_core::bail!("bgmv: {what} is not contiguous");
    };
    match T::of(s) {
        Some(v) => Ok(&v[a..b]),
        None => candle_core::bail!("bgmv: {what} is {:?}, expected {:?}", s.dtype(), T::DTYPE),
    }
}

fn cpu_u32<'s>(s: &'s CpuStorage, l: &Layout) -> Result<&'s [u32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::U32(v), Some((a, b))) => Ok(&v[a..b]),
        _ => candle_core::bail!("bgmv: slots must be contiguous u32"),
    }
}

/// Runs `$body` with `$A`, `$B` the element types of two float dtypes.
macro_rules! by_dtypes {
    ($a:expr, $b:expr, |$A:ident, $B:ident| $body:expr) => {{
        macro_rules! arm {
            ($ta:ty, $tb:ty) => {{
                type $A = $ta;
                type $B = $tb;
                $body
            }};
        }
        match ($a, $b) {
            (DType::F32, DType::F32) => arm!(f32, f32),
            (DType::F32, DType::BF16) => arm!(f32, bf16),
            (DType::F32, DType::F16) => arm!(f32, f16),
            (DType::BF16, DType::F32) => arm!(bf16, f32),
            (DType::BF16, DType::BF16) => arm!(bf16, bf16),
            (DType::BF16, DType::F16) => arm!(bf16, f16),
            (DType::F16, DType::F32) => arm!(f16, f32),
            (DType::F16, DType::BF16) => arm!(f16, bf16),
            (DType::F16, DType::F16) => arm!(f16, f16),
            (a, b) => candle_core::bail!("bgmv: dtypes {a:?} and {b:?}"),
        }
    }};
}

/// The shrink as a candle op over `(x, at, slots)`.
struct Shrink {
    n: usize,
}

impl CustomOp3 for Shrink {
    fn name(&self) -> &'static str {
        "bgmv-shrink"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (tokens, d_in) = l1.shape().dims2()?;
        let (_, _, rank) = l2.shape().dims3()?;
        let splits = shrink_splits(d_in, rank);
        let slots = cpu_u32(s3, l3)?;
        let v = by_dtypes!(s1.dtype(), s2.dtype(), |X, W| shrink_reference(
            cpu::<X>(s1, l1, "x")?,
            cpu::<W>(s2, l2, "the A pool")?,
            slots,
            d_in,
            rank,
            self.n,
        ));
        Ok((
            CpuStorage::F32(v),
            Shape::from((splits, self.n, tokens, rank)),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda::shrink(self.n, (s1, l1), (s2, l2), (s3, l3))
    }
}

/// The expand-add as a candle op over `(y, v, b)`, with the tokens' slots.
struct Expand {
    proj: usize,
    slots: Tensor,
}

impl CustomOp3 for Expand {
    fn name(&self) -> &'static str {
        "bgmv-expand"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (tokens, d_out) = l1.shape().dims2()?;
        let (_, n, _, _) = l2.shape().dims4()?;
        let (_, _, rank) = l3.shape().dims3()?;
        let (st, sl) = self.slots.storage_and_layout();
        let Storage::Cpu(st) = &*st else {
            candle_core::bail!("bgmv expand: slots on another device than y");
        };
        let slots = cpu_u32(st, sl)?;
        let v = cpu::<f32>(s2, l2, "v")?;
        // Rows `y_stride` apart from the first element (a column slice read in place).
        let y_stride = l1.stride()[0];
        if tokens > 0 && l1.stride()[1] != 1 {
            candle_core::bail!("bgmv expand: y's columns are not contiguous");
        }
        let ya = l1.start_offset();
        let yb = ya + tokens.saturating_sub(1) * y_stride + if tokens > 0 { d_out } else { 0 };
        let out = by_dtypes!(s1.dtype(), s3.dtype(), |Y, W| {
            let y = match Y::of(s1) {
                Some(y) => &y[ya..yb],
                None => candle_core::bail!("bgmv expand: y"),
            };
            Y::storage(expand_reference(
                y,
                y_stride,
                v,
                n,
                self.proj,
                cpu::<W>(s3, l3, "the B pool")?,
                slots,
                d_out,
                rank,
            ))
        });
        Ok((out, Shape::from((tokens, d_out))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (st, sl) = self.slots.storage_and_layout();
        let Storage::Cuda(st) = &*st else {
            candle_core::bail!("bgmv expand: slots on another device than y");
        };
        cuda::expand(self.proj, (s1, l1), (s2, l2), (s3, l3), (st, sl))
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    //! Launches of `crates/kernels/kernels/lora.cu`'s kernels.

    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{
        CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg, SyncOnDrop,
    };
    use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
    use candle_core::{CudaStorage, DType, Layout, Result, Shape};

    use super::{shrink_groups, shrink_split, shrink_splits, CHUNK, THREADS};

    /// The kernels' PTX, built by build.rs.
    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/lora.ptx"));
    /// The module's name in the device's cache of custom modules.
    const MODULE: &str = "mole_lora";

    fn dtype_name(d: DType) -> Result<&'static str> {
        Ok(match d {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            d => candle_core::bail!("bgmv: no kernel for {d:?}"),
        })
    }

    /// The device address of a contiguous operand's first element, and the guard that records
    /// the read on `stream` once the launch is queued. `align`: elements its offset must be a
    /// multiple of (vector loads).
    fn addr<'a>(
        (s, l): (&'a CudaStorage, &Layout),
        stream: &'a CudaStream,
        align: usize,
        what: &str,
    ) -> Result<(u64, SyncOnDrop<'a>)> {
        let Some((start, _)) = l.contiguous_offsets() else {
            candle_core::bail!("bgmv: {what} is not contiguous");
        };
        if !start.is_multiple_of(align) {
            candle_core::bail!("bgmv: {what} starts at element {start}, not a multiple of {align}");
        }
        let (p, g, size) = match &s.slice {
            CudaStorageSlice::F32(c) => {
                let (p, g) = c.device_ptr(stream);
                (p, g, 4)
            }
            CudaStorageSlice::BF16(c) => {
                let (p, g) = c.device_ptr(stream);
                (p, g, 2)
            }
            CudaStorageSlice::F16(c) => {
                let (p, g) = c.device_ptr(stream);
                (p, g, 2)
            }
            CudaStorageSlice::U32(c) => {
                let (p, g) = c.device_ptr(stream);
                (p, g, 4)
            }
            _ => candle_core::bail!("bgmv: {what} of an unsupported dtype"),
        };
        Ok((p + (start * size) as u64, g))
    }

    pub(super) fn shrink(
        n: usize,
        x: (&CudaStorage, &Layout),
        at: (&CudaStorage, &Layout),
        slots: (&CudaStorage, &Layout),
    ) -> Result<(CudaStorage, Shape)> {
        let (tokens, d_in) = x.1.shape().dims2()?;
        let (rows, _, rank) = at.1.shape().dims3()?;
        let dev = x.0.device.clone();
        let stream = dev.cuda_stream();
        let splits = shrink_splits(d_in, rank);
        let len = splits * n * tokens * rank;
        // SAFETY: every element is written by the kernel (zeros for base tokens).
        let mut v = unsafe { dev.alloc::<f32>(len.max(1))? };
        if tokens > 0 {
            let name = format!(
                "bgmv_shrink_{}_{}",
                dtype_name(x.0.dtype())?,
                dtype_name(at.0.dtype())?
            );
            let func = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
            let groups = shrink_groups(rank);
            let (xp, _gx) = addr(x, &stream, 1, "x")?;
            let (ap, _ga) = addr(at, &stream, CHUNK, "the A pool")?;
            let (sp, _gs) = addr(slots, &stream, 1, "slots")?;
            let (vp, _gv) = v.device_ptr_mut(&stream);
            let args = [
                tokens as u32,
                d_in as u32,
                rank as u32,
                n as u32,
                (rows / n) as u32,
                groups as u32,
                shrink_split(rank) as u32,
            ];
            let mut b = func.builder();
            b.arg(&xp).arg(&ap).arg(&sp).arg(&vp);
            for a in &args {
                b.arg(a);
            }
            let cfg = LaunchConfig {
                grid_dim: (tokens as u32, n as u32, splits as u32),
                block_dim: ((groups * rank / CHUNK) as u32, 1, 1),
                shared_mem_bytes: (groups * rank * 4) as u32,
            };
            // SAFETY: the arguments are the kernel's, in its order and types (device addresses
            // as u64); the shapes were checked by `super::shrink` and the slots are bounded in
            // the kernel.
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok((
            CudaStorage::wrap_cuda_slice(v, dev),
            Shape::from((splits, n, tokens, rank)),
        ))
    }

    pub(super) fn expand(
        proj: usize,
        y: (&CudaStorage, &Layout),
        v: (&CudaStorage, &Layout),
        b: (&CudaStorage, &Layout),
        slots: (&CudaStorage, &Layout),
    ) -> Result<(CudaStorage, Shape)> {
        let (tokens, d_out) = y.1.shape().dims2()?;
        let (splits, n, _, rank) = v.1.shape().dims4()?;
        let (num_slots, _, _) = b.1.shape().dims3()?;
        let dev = y.0.device.clone();
        let stream = dev.cuda_stream();
        let y_stride = y.1.stride()[0] as u64;
        let len = (tokens * d_out).max(1);
        let ydt = y.0.dtype();
        let name = format!(
            "bgmv_expand_{}_{}",
            dtype_name(ydt)?,
            dtype_name(b.0.dtype())?
        );
        // `y` may be a column slice of a wider product: its rows from its first element on.
        let y_at = y.1.start_offset();
        macro_rules! run {
            ($t:ty) => {{
                // SAFETY: every element is written by the kernel.
                let mut out = unsafe { dev.alloc::<$t>(len)? };
                if tokens > 0 {
                    let func = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
                    let (y0, _gy) = match &y.0.slice {
                        CudaStorageSlice::F32(c) => c.device_ptr(&stream),
                        CudaStorageSlice::BF16(c) => c.device_ptr(&stream),
                        CudaStorageSlice::F16(c) => c.device_ptr(&stream),
                        _ => candle_core::bail!("bgmv expand: y of {ydt:?}"),
                    };
                    let yp = y0 + (y_at * ydt.size_in_bytes()) as u64;
                    let (vp, _gv) = addr(v, &stream, 1, "v")?;
                    let (bp, _gb) = addr(b, &stream, CHUNK, "the B pool")?;
                    let (sp, _gs) = addr(slots, &stream, 1, "slots")?;
                    let (op, _go) = out.device_ptr_mut(&stream);
                    let args = [
                        tokens as u32,
                        d_out as u32,
                        rank as u32,
                        proj as u32,
                        num_slots as u32,
                        n as u32,
                        splits as u32,
                    ];
                    let mut l = func.builder();
                    l.arg(&yp)
                        .arg(&y_stride)
                        .arg(&vp)
                        .arg(&bp)
                        .arg(&sp)
                        .arg(&op);
                    for a in &args {
                        l.arg(a);
                    }
                    let cfg = LaunchConfig {
                        grid_dim: (d_out.div_ceil(THREADS) as u32, tokens as u32, 1),
                        block_dim: (THREADS as u32, 1, 1),
                        shared_mem_bytes: (rank * 4) as u32,
                    };
                    // SAFETY: the arguments are the kernel's, in its order and types (device
                    // addresses as u64); the shapes were checked by `super::expand` and the
                    // slots are bounded in the kernel.
                    unsafe { l.launch(cfg) }.w()?;
                }
                CudaStorage::wrap_cuda_slice(out, dev.clone())
            }};
        }
        let out = match ydt {
            DType::F32 => run!(f32),
            DType::BF16 => run!(half::bf16),
            DType::F16 => run!(half::f16),
            d => candle_core::bail!("bgmv expand: y of {d:?}"),
        };
        Ok((out, Shape::from((tokens, d_out))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small deterministic generator of values in [-1, 1).
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn groups_are_powers_of_two_filling_a_block() {
        for (rank, groups) in [(8, 256), (16, 128), (24, 64), (64, 32), (256, 8), (512, 4)] {
            assert_eq!(shrink_groups(rank), groups, "rank {rank}");
            assert!(groups * rank / CHUNK <= THREADS);
            // About 16 KiB of bf16 weights per block (24: 3 chunks of 64 groups, 12 KiB).
            assert!((12 << 10..=16 << 10).contains(&(shrink_split(rank) * rank * 2)));
        }
        assert_eq!(shrink_splits(4096, 16), 8);
        assert_eq!(shrink_splits(14336, 16), 28);
        assert_eq!(shrink_splits(1, 16), 1);
    }

    /// The reference against a plain f64 sum of the same products: every difference is f32
    /// rounding of the sums, at most `(terms + 1)·2⁻²⁴` of the sum of the terms' magnitudes
    /// (the classic bound for a sum of `terms` rounded additions, FMAs included, and the last
    /// rounding of the expand's add), and base tokens read nothing.
    #[test]
    fn the_reference_computes_x_a_b_within_f32_summation_error() {
        // Three splits of the input, the last one short.
        let (d_in, d_out, rank, n, num_slots) = (1200, 48, 16, 3, 4);
        let splits = shrink_splits(d_in, rank);
        assert_eq!(splits, 3);
        let slots = [2u32, 0, 3, 2, 1, 9];
        let tokens = slots.len();
        let x = values(tokens * d_in, 1);
        let at = values(num_slots * n * d_in * rank, 2);
        let b = values(num_slots * d_out * rank, 3);
        let y = values(tokens * d_out, 4);
        let v = shrink_reference(&x, &at, &slots, d_in, rank, n);
        let eps = f64::from(f32::EPSILON) / 2.0;
        for p in 0..n {
            let out = expand_reference(&y, d_out, &v, n, p, &b, &slots, d_out, rank);
            // The splits' partial sums added in order, as the expand does.
            let total = |t: usize, k: usize| {
                (1..splits).fold(v[(p * tokens + t) * rank + k], |s, z| {
                    s + v[((z * n + p) * tokens + t) * rank + k]
                })
            };
            for (t, &s) in slots.iter().enumerate() {
                let s = s as usize;
                let used = s != 0 && s < num_slots;
                for k in 0..rank {
                    let got = total(t, k);
                    if !used {
                        assert!(
                            (0..splits).all(|z| v[((z * n + p) * tokens + t) * rank + k] == 0.0)
                        );
                        continue;
                    }
                    let terms = (0..d_in).map(|i| {
                        f64::from(x[t * d_in + i])
                            * f64::from(at[((s * n + p) * d_in + i) * rank + k])
                    });
                    let (sum, mag) = terms.fold((0.0, 0.0), |(s, m), v| (s + v, m + v.abs()));
                    let bound = (d_in + splits) as f64 * eps * mag;
                    assert!((f64::from(got) - sum).abs() <= bound, "v[{p},{t},{k}]");
                }
                for o in 0..d_out {
                    let got = out[t * d_out + o];
                    let yo = y[t * d_out + o];
                    if !used {
                        assert_eq!(got.to_bits(), yo.to_bits());
                        continue;
                    }
                    let terms = (0..rank)
                        .map(|k| f64::from(total(t, k)) * f64::from(b[(s * d_out + o) * rank + k]));
                    let (sum, mag) = terms
                        .fold((f64::from(yo), f64::from(yo).abs()), |(s, m), v| {
                            (s + v, m + v.abs())
                        });
                    let bound = (rank + 2) as f64 * eps * mag;
                    assert!((f64::from(got) - sum).abs() <= bound, "out[{t},{o}]");
                }
            }
        }
    }

    /// The candle ops on the CPU are the reference itself, in every dtype pair, and an expand
    /// reads a column slice of a wider product in place.
    #[test]
    #[allow(clippy::disallowed_methods)] // test inputs
    fn the_cpu_ops_are_the_reference() {
        // Rank 8: splits of 1024 rows, so three.
        let (d_in, d_out, rank, n, num_slots) = (2100, 24, 8, 2, 3);
        let slots = [1u32, 0, 2, 2];
        let tokens = slots.len();
        let dev = candle_core::Device::Cpu;
        let st = Tensor::new(&slots[..], &dev).unwrap();
        for (xd, wd) in [
            (DType::F32, DType::F32),
            (DType::BF16, DType::BF16),
            (DType::F16, DType::F16),
            (DType::BF16, DType::F32),
            (DType::F32, DType::BF16),
        ] {
            let t = |v: Vec<f32>, shape: &[usize], d: DType| {
                Tensor::from_vec(v, shape, &dev)
                    .unwrap()
                    .to_dtype(d)
                    .unwrap()
            };
            let x = t(values(tokens * d_in, 5), &[tokens, d_in], xd);
            let at = t(
                values(num_slots * n * d_in * rank, 6),
                &[num_slots * n, d_in, rank],
                wd,
            );
            let b = t(
                values(num_slots * d_out * rank, 7),
                &[num_slots, d_out, rank],
                wd,
            );
            // The base product of two projections side by side; the expand reads the second.
            let wide = t(values(tokens * 2 * d_out, 8), &[tokens, 2 * d_out], xd);
            let y = wide.narrow(1, d_out, d_out).unwrap();
            let v = shrink(&x, &at, &st, n).unwrap();
            assert_eq!(v.dims(), [3, n, tokens, rank]);
            let out = expand(&y, &v, 1, &b, &st).unwrap();
            assert_eq!(out.dtype(), xd);
            let f = |t: &Tensor| -> Vec<f32> {
                t.to_dtype(DType::F32)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap()
            };
            let want_v = shrink_reference(&f(&x), &f(&at), &slots, d_in, rank, n);
            assert_eq!(f(&v), want_v, "{xd:?} over {wd:?}");
            let y_rows = f(&y.contiguous().unwrap());
            let want: Vec<f32> =
                expand_reference(&y_rows, d_out, &want_v, n, 1, &f(&b), &slots, d_out, rank)
                    .into_iter()
                    .map(|s| {
                        // Rounded once to y's dtype, as the op does.
                        let one = Tensor::new(&[s], &dev).unwrap().to_dtype(xd).unwrap();
                        f(&one)[0]
                    })
                    .collect();
            assert_eq!(f(&out), want, "{xd:?} over {wd:?}");
        }
    }
}
