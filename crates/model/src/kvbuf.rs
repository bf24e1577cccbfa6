//! The host path's KV storage: keys or values in the decoder's KV dtype (`kvCacheDtype`),
//! which a sequence's cache grows and the prefix store's blocks hold.

use std::ops::Range;

use candle_core::DType;
use half::{bf16, f16};

use mole_kernels::Weight;

/// Spare room, in tokens, a host cache grows by when it is full.
const KV_GROW_TOKENS: usize = 256;

/// Keys or values of the host path's cache, in the decoder's KV dtype (`kvCacheDtype`).
#[derive(Debug, Clone)]
pub enum KvBuf {
    /// f32: the values as computed.
    F32(Vec<f32>),
    /// bf16: each value rounded to 8 significant bits, f32's range.
    Bf16(Vec<bf16>),
    /// f16: each value rounded to 11 significant bits, up to 65,504.
    F16(Vec<f16>),
}

/// An element of a host KV cache: what the attention kernel reads ([`Weight`]) and what a
/// computed f32 key or value is rounded to when cached.
pub trait KvElem: Weight {
    /// `x` rounded to this type (to nearest, ties to even).
    fn round(x: f32) -> Self;
    /// The values of `buf`, which holds this type.
    fn of(buf: &KvBuf) -> &[Self];
}

/// A cache buffer of one dtype read as another: one decoder holds one KV dtype.
fn mixed_dtypes() -> ! {
    panic!("a host KV cache read as another dtype than it holds")
}

macro_rules! kv_elem {
    ($t:ty, $variant:ident, $round:expr) => {
        impl KvElem for $t {
            #[inline(always)]
            fn round(x: f32) -> Self {
                $round(x)
            }
            fn of(buf: &KvBuf) -> &[Self] {
                match buf {
                    KvBuf::$variant(v) => v,
                    _ => mixed_dtypes(),
                }
            }
        }
    };
}

kv_elem!(f32, F32, |x| x);
kv_elem!(bf16, Bf16, bf16::from_f32);
kv_elem!(f16, F16, f16::from_f32);

impl KvBuf {
    /// An empty buffer of `dtype` (bf16 or f16; f32 for any other).
    pub fn new(dtype: DType) -> Self {
        match dtype {
            DType::BF16 => KvBuf::Bf16(Vec::new()),
            DType::F16 => KvBuf::F16(Vec::new()),
            _ => KvBuf::F32(Vec::new()),
        }
    }

    /// The dtype held.
    pub fn dtype(&self) -> DType {
        match self {
            KvBuf::F32(_) => DType::F32,
            KvBuf::Bf16(_) => DType::BF16,
            KvBuf::F16(_) => DType::F16,
        }
    }

    /// Values held.
    pub fn len(&self) -> usize {
        match self {
            KvBuf::F32(v) => v.len(),
            KvBuf::Bf16(v) => v.len(),
            KvBuf::F16(v) => v.len(),
        }
    }

    /// Bytes of the values held.
    pub fn bytes(&self) -> usize {
        self.len() * self.dtype().size_in_bytes()
    }

    /// Drops the values, keeping the memory.
    pub fn clear(&mut self) {
        match self {
            KvBuf::F32(v) => v.clear(),
            KvBuf::Bf16(v) => v.clear(),
            KvBuf::F16(v) => v.clear(),
        }
    }

    /// Makes room for `n` more values, exactly.
    pub fn reserve_exact(&mut self, n: usize) {
        match self {
            KvBuf::F32(v) => v.reserve_exact(n),
            KvBuf::Bf16(v) => v.reserve_exact(n),
            KvBuf::F16(v) => v.reserve_exact(n),
        }
    }

    /// Makes room for `n` more values. When it must grow it takes [`KV_GROW_TOKENS`] more
    /// tokens of `width` values past them: growth by that much, not doubling, so a sequence
    /// never holds more than that much spare room (doubling would hold up to its whole length
    /// again), and a reallocation every 256 tokens costs little next to the steps between.
    fn grow(&mut self, n: usize, width: usize) {
        let spare = match self {
            KvBuf::F32(v) => v.capacity() - v.len(),
            KvBuf::Bf16(v) => v.capacity() - v.len(),
            KvBuf::F16(v) => v.capacity() - v.len(),
        };
        if spare < n {
            self.reserve_exact(n + KV_GROW_TOKENS * width);
        }
    }

    /// Appends computed keys (or values) of new tokens (`width` values each), rounded to the
    /// buffer's dtype (see [`KvBuf::grow`] for the room it takes).
    pub fn append(&mut self, new: &[f32], width: usize) {
        fn push<E: KvElem>(v: &mut Vec<E>, new: &[f32]) {
            v.extend(new.iter().map(|&x| E::round(x)));
        }
        self.grow(new.len(), width);
        match self {
            KvBuf::F32(v) => v.extend_from_slice(new),
            KvBuf::Bf16(v) => push(v, new),
            KvBuf::F16(v) => push(v, new),
        }
    }

    /// Appends values `range` of `src` (of the same dtype), growing as [`KvBuf::append`] does.
    pub fn append_from(&mut self, src: &KvBuf, range: Range<usize>, width: usize) {
        self.grow(range.len(), width);
        self.extend_from(src, range);
    }

    /// Appends values `range` of `src` (of the same dtype), exactly: for a buffer sized once.
    pub fn extend_from(&mut self, src: &KvBuf, range: Range<usize>) {
        match self {
            KvBuf::F32(v) => v.extend_from_slice(&f32::of(src)[range]),
            KvBuf::Bf16(v) => v.extend_from_slice(&bf16::of(src)[range]),
            KvBuf::F16(v) => v.extend_from_slice(&f16::of(src)[range]),
        }
    }

    /// Values `range` widened to f32.
    pub fn widen_into(&self, range: Range<usize>, out: &mut Vec<f32>) {
        match self {
            KvBuf::F32(v) => out.extend_from_slice(&v[range]),
            KvBuf::Bf16(v) => out.extend(v[range].iter().map(|x| x.f32())),
            KvBuf::F16(v) => out.extend(v[range].iter().map(|x| x.f32())),
        }
    }
}

impl Default for KvBuf {
    fn default() -> Self {
        KvBuf::F32(Vec::new())
    }
}
