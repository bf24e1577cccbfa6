//! safetensors files as the engine and the tools read them: one memory-mapping helper and the
//! decoding of float tensors' little-endian bytes to f32.

use std::path::Path;

use ::safetensors::Dtype;

/// Maps a weights file read-only.
pub fn map(path: &Path) -> std::io::Result<memmap2::Mmap> {
    map_file(&std::fs::File::open(path)?)
}

/// Maps an open weights file read-only (when the caller keeps the file for other reads).
pub fn map_file(file: &std::fs::File) -> std::io::Result<memmap2::Mmap> {
    // SAFETY: weight and adapter files are read-only inputs: nothing in this process writes
    // to them while a mapping lives, and a model root is not rewritten in place (merges and
    // imports write a temporary sibling and rename it).
    unsafe { memmap2::Mmap::map(file) }
}

/// Whether a safetensors dtype is a float type mole reads (f32, bf16, f16, f64).
pub fn is_float(d: Dtype) -> bool {
    matches!(d, Dtype::F32 | Dtype::BF16 | Dtype::F16 | Dtype::F64)
}

/// Elements per parallel chunk of the conversions (large enough to amortise scheduling).
const CHUNK: usize = 1 << 16;

/// Decodes a float tensor's little-endian bytes to f32.
pub fn to_f32(dtype: Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    let mut out = Vec::new();
    decode_into(dtype, bytes, &mut out).then_some(out)
}

/// Decodes into `out` (resized), in parallel. False for non-float dtypes.
pub fn decode_into(dtype: Dtype, bytes: &[u8], out: &mut Vec<f32>) -> bool {
    use rayon::prelude::*;
    if !is_float(dtype) {
        return false;
    }
    let size = dtype.bitsize() / 8;
    out.clear();
    out.resize(bytes.len() / size, 0.0);
    out.par_chunks_mut(CHUNK)
        .zip(bytes.par_chunks(CHUNK * size))
        .for_each(|(dst, src)| decode_slice(dtype, src, dst));
    true
}

/// Decodes little-endian `dtype` values into `out` (one per element of `out`).
pub fn decode_slice(dtype: Dtype, src: &[u8], out: &mut [f32]) {
    // Chunk sizes are constants in each arm so the loops vectorise (a runtime chunk size
    // keeps them scalar).
    match dtype {
        // bf16 is the upper half of an f32: widening is exact.
        Dtype::BF16 => out.iter_mut().zip(src.chunks_exact(2)).for_each(|(d, c)| {
            *d = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16)
        }),
        Dtype::F16 => out
            .iter_mut()
            .zip(src.chunks_exact(2))
            .for_each(|(d, c)| *d = half::f16::from_le_bytes([c[0], c[1]]).to_f32()),
        Dtype::F64 => out
            .iter_mut()
            .zip(src.chunks_exact(8))
            .for_each(|(d, c)| *d = f64::from_le_bytes(c.try_into().expect("8 bytes")) as f32),
        _ => out
            .iter_mut()
            .zip(src.chunks_exact(4))
            .for_each(|(d, c)| *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
    }
}
