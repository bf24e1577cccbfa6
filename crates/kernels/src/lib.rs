//! The device's own kernels ([`bgmv`]: LoRA updates by slot index, CUDA under the `cuda`
//! feature, with the CPU reference of their arithmetic), and host kernels for CPU f32
//! decoding, read in place from tensor storage: the base product of a decode step's column
//! blocks ([`dense`]), a token's attention over its sequence's cache
//! ([`attention`]) and a token's low-rank adapter update ([`lora`]). They know tensors only as
//! storage: nothing here knows of models or adapters.
//!
//! At decode batch sizes the arithmetic of these steps is small and what costs is the fixed
//! price of each tensor op (an allocation, a thread-pool round trip) times rows × layers ×
//! ops; one fused pass per batch removes it. The loops are written so the compiler vectorises
//! them, and compiled twice: for the baseline target and, picked at run time, for AVX2 + FMA
//! (release builds do not assume a CPU newer than x86-64 v1).

use candle_core::{DType, Tensor};

/// `pub fn $name(args)`: calls `$body::<true>` compiled for AVX2 + FMA when the CPU has
/// them (checked at run time), else `$body::<false>` for the baseline target.
macro_rules! kernel {
    ($(#[$doc:meta])* $name:ident = $body:ident($($arg:ident: $ty:ty),* $(,)?)) => {
        $(#[$doc])*
        #[allow(clippy::too_many_arguments)]
        pub fn $name($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn fast($($arg: $ty),*) {
                    $body::<true>($($arg),*)
                }
                if $crate::cpu::caps().avx2_fma() {
                    // SAFETY: the CPU has AVX2 and FMA (checked at run time).
                    return unsafe { fast($($arg),*) };
                }
            }
            $body::<false>($($arg),*)
        }
    };
}

pub mod attention;
pub mod bgmv;
pub mod cpu;
pub mod dense;
pub mod lora;
pub mod quant;

pub use self::attention::{attend_head, KvHead, KvRun};
pub use self::lora::{lora_tokens, lora_tokens_bf16, RANK_ALIGN};

/// Multiply-adds below which the attention of a batch runs on the calling thread: splitting
/// a short decode step's few small products costs more than it saves.
pub const PARALLEL_MIN_FMAS: usize = 1 << 21;

/// An element type the host kernels read in place from CPU tensor storage.
pub trait HostElem: Copy + Send + Sync + 'static {
    /// The candle dtype of this element.
    const DTYPE: DType;
    /// The elements of a CPU storage of this type.
    fn of_storage(s: &candle_core::CpuStorage) -> Option<&[Self]>;
}

impl HostElem for f32 {
    const DTYPE: DType = DType::F32;
    fn of_storage(s: &candle_core::CpuStorage) -> Option<&[Self]> {
        match s {
            candle_core::CpuStorage::F32(v) => Some(v),
            _ => None,
        }
    }
}

impl HostElem for half::bf16 {
    const DTYPE: DType = DType::BF16;
    fn of_storage(s: &candle_core::CpuStorage) -> Option<&[Self]> {
        match s {
            candle_core::CpuStorage::BF16(v) => Some(v),
            _ => None,
        }
    }
}

impl HostElem for half::f16 {
    const DTYPE: DType = DType::F16;
    fn of_storage(s: &candle_core::CpuStorage) -> Option<&[Self]> {
        match s {
            candle_core::CpuStorage::F16(v) => Some(v),
            _ => None,
        }
    }
}

/// A contiguous CPU tensor's storage, held for reading in place.
pub struct Host<'t, T> {
    guard: candle_core::StorageRef<'t>,
    offset: usize,
    elem: std::marker::PhantomData<T>,
}

/// A contiguous CPU f32 tensor's storage.
pub type HostF32<'t> = Host<'t, f32>;

impl<'t, T: HostElem> Host<'t, T> {
    /// The storage of `t`, or None unless it is contiguous on the CPU with elements `T`.
    pub fn of(t: &'t Tensor) -> Option<Self> {
        use candle_core::Storage;
        if !t.is_contiguous() || t.dtype() != T::DTYPE {
            return None;
        }
        let (guard, layout) = t.storage_and_layout();
        let offset = layout.start_offset();
        matches!(&*guard, Storage::Cpu(c) if T::of_storage(c).is_some()).then_some(Self {
            guard,
            offset,
            elem: std::marker::PhantomData,
        })
    }

    /// The first `n` elements of the tensor.
    pub fn slice(&self, n: usize) -> &[T] {
        match &*self.guard {
            candle_core::Storage::Cpu(c) => {
                &T::of_storage(c).expect("checked by Host::of")[self.offset..self.offset + n]
            }
            _ => unreachable!("checked by Host::of"),
        }
    }
}

/// Weights the kernels read as f32: f32 itself, bf16 (adapters and base weights held at half
/// the bytes) or f16 (base weights).
pub trait Weight: HostElem {
    /// The value as f32 (exact for every type).
    fn f32(self) -> f32;
    /// The values themselves when they are f32 already.
    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
    }
    /// Eight values from `p` in an AVX register.
    ///
    /// # Safety
    /// The CPU has AVX2 and `p` points at eight readable values; called only from code
    /// compiled for AVX2 (it is inlined there, with the intrinsics).
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
    /// Sixteen values from `p` in an AVX-512 register.
    ///
    /// # Safety
    /// As [`Weight::load8`], for AVX-512F and sixteen values.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
}

impl Weight for f32 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self
    }
    fn as_f32(w: &[Self]) -> Option<&[f32]> {
        Some(w)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        std::arch::x86_64::_mm256_loadu_ps(p)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512 {
        std::arch::x86_64::_mm512_loadu_ps(p)
    }
}

impl Weight for half::bf16 {
    #[inline(always)]
    fn f32(self) -> f32 {
        // bf16 is the top half of an f32. (`half`'s own conversion also quiets NaNs, a
        // branch the loops do not need: loaded adapters are checked finite.)
        f32::from_bits((self.to_bits() as u32) << 16)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        let h = _mm_loadu_si128(p as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        let h = _mm256_loadu_si256(p as *const __m256i);
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
    }
}

impl Weight for half::f16 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self.to_f32()
    }
    /// Needs F16C besides AVX2: the direct kernel's AVX2 build enables it (see
    /// `dense::available`).
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }
}

/// A weight slice as the bytes it occupies.
pub fn bytes<W: Weight>(w: &[W]) -> &[u8] {
    // SAFETY: f32 and bf16 are plain data with no padding; the bytes are those of `w`.
    unsafe { std::slice::from_raw_parts(w.as_ptr().cast(), std::mem::size_of_val(w)) }
}

/// `a·b + c`, fused (one rounding, as BLAS kernels do) where the CPU has FMA (without the
/// instruction `mul_add` is a libm call, so callers compiled for the baseline pass false).
#[inline(always)]
pub fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// `out[i, j] = x[i, ·] · w[j, ·]` (added to what `out` holds when `accumulate`) for the `t`
/// rows of `x` `[t, k]` and the `n` rows of `w` `[n, k]`, both row-major, into an output of
/// `stride` floats per row: gemm on the calling thread (`w`'s rows are the product's
/// columns, read in place).
///
/// # Safety
/// `out` is valid for writes of `t` rows of `stride` floats from its start, `n ≤ stride`, and
/// no other thread reads or writes those `t × n` values meanwhile.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_by_rows(
    t: usize,
    n: usize,
    k: usize,
    out: *mut f32,
    stride: usize,
    accumulate: bool,
    x: &[f32],
    w: &[f32],
) {
    assert!(x.len() >= t * k && w.len() >= n * k, "operands too short");
    gemm::gemm(
        t,
        n,
        k,
        out,
        1,
        stride as isize,
        accumulate,
        x.as_ptr(),
        1,
        k as isize,
        w.as_ptr(),
        k as isize,
        1,
        1.0,
        1.0,
        false,
        false,
        false,
        gemm::Parallelism::None,
    )
}
