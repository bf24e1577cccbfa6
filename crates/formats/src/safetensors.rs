//! safetensors files as the engine and the tools read them: one memory-mapping helper, the
//! decoding of float tensors' little-endian bytes to f32, and the engine's loader
//! ([`ReadTensors`]), which reads each tensor into memory of its own.

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

/// A model's safetensors files read tensor by tensor into memory of their own (`pread` of each
/// tensor's bytes), for [`candle_nn::VarBuilder`]: the engine's loader. Reading through a
/// mapping instead (candle's `MmapedSafetensors`) leaves every page of the files mapped in
/// the process until the load ends, so the load's resident peak is the weights twice (the
/// file's pages and the copies the model keeps): measured 528 MiB against 290 MiB held after
/// the load of a 257 MiB bf16 SmolLM2. Read this way, the peak is the weights plus the largest
/// tensor in flight; the files' pages stay in the page cache, which the kernel may drop.
pub struct ReadTensors {
    files: Vec<std::fs::File>,
    /// Per tensor: its file, dtype, shape and absolute byte range.
    tensors: std::collections::HashMap<String, Stored>,
}

/// Where a tensor lies.
struct Stored {
    file: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    start: u64,
    len: usize,
}

impl ReadTensors {
    /// Indexes the tensors of `files` (their headers only: a file's data is read when a
    /// tensor of it is asked for). A name in several files is taken from the last.
    pub fn open(files: &[impl AsRef<Path>]) -> candle_core::Result<Self> {
        let mut opened = Vec::with_capacity(files.len());
        let mut tensors = std::collections::HashMap::new();
        for (i, path) in files.iter().enumerate() {
            let path = path.as_ref();
            let file = std::fs::File::open(path)?;
            // The header is parsed through a mapping (it checks the offsets against the file's
            // length); only its first pages are touched.
            let mmap = map_file(&file)?;
            let (n, meta) = ::safetensors::SafeTensors::read_metadata(&mmap)
                .map_err(|e| candle_core::Error::Msg(format!("{}: {e}", path.display())))?;
            for (name, info) in meta.tensors() {
                let (a, b) = info.data_offsets;
                tensors.insert(
                    name,
                    Stored {
                        file: i,
                        dtype: info.dtype,
                        shape: info.shape.clone(),
                        start: (8 + n + a) as u64,
                        len: b - a,
                    },
                );
            }
            opened.push(file);
        }
        Ok(Self {
            files: opened,
            tensors,
        })
    }

    /// A [`candle_nn::VarBuilder`] over `files` read this way, making tensors of `dtype` on
    /// `device`.
    pub fn var_builder(
        files: &[impl AsRef<Path>],
        dtype: candle_core::DType,
        device: &candle_core::Device,
    ) -> candle_core::Result<candle_nn::VarBuilder<'static>> {
        Ok(candle_nn::VarBuilder::from_backend(
            Box::new(Self::open(files)?),
            dtype,
            device.clone(),
        ))
    }

    /// The tensor `name` as stored, on the CPU.
    fn read(&self, name: &str) -> candle_core::Result<candle_core::Tensor> {
        let Some(s) = self.tensors.get(name) else {
            return Err(candle_core::Error::CannotFindTensor {
                path: name.to_string(),
            }
            .bt());
        };
        let file = &self.files[s.file];
        let cpu = &candle_core::Device::Cpu;
        let shape = s.shape.as_slice();
        Ok(match s.dtype {
            Dtype::BF16 => {
                candle_core::Tensor::from_vec(read_values::<half::bf16>(file, s)?, shape, cpu)?
            }
            Dtype::F16 => {
                candle_core::Tensor::from_vec(read_values::<half::f16>(file, s)?, shape, cpu)?
            }
            Dtype::F32 => candle_core::Tensor::from_vec(read_values::<f32>(file, s)?, shape, cpu)?,
            other => {
                let dtype = match other {
                    Dtype::F64 => candle_core::DType::F64,
                    Dtype::I64 => candle_core::DType::I64,
                    Dtype::U32 => candle_core::DType::U32,
                    Dtype::U8 => candle_core::DType::U8,
                    d => candle_core::bail!("{name}: unsupported safetensors dtype {d:?}"),
                };
                let bytes = read_values::<u8>(file, s)?;
                candle_core::Tensor::from_raw_buffer(&bytes, dtype, shape, cpu)?
            }
        })
    }
}

// The values are read as the host lays them out.
#[cfg(target_endian = "big")]
compile_error!("safetensors are little-endian: reading them on a big-endian host needs a swap");

/// Plain values any bit pattern of which is valid, read from a file's little-endian bytes.
trait Plain: Copy + Default {}
impl Plain for half::bf16 {}
impl Plain for half::f16 {}
impl Plain for f32 {}
impl Plain for u8 {}

/// A tensor's values, read straight into their own vector.
fn read_values<T: Plain>(file: &std::fs::File, s: &Stored) -> std::io::Result<Vec<T>> {
    use std::os::unix::fs::FileExt;
    let size = std::mem::size_of::<T>();
    if !s.len.is_multiple_of(size) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{} bytes are not whole {size}-byte values", s.len),
        ));
    }
    let mut v = vec![T::default(); s.len / size];
    // SAFETY: `T` is a plain value type (`Plain`: no padding, every bit pattern valid), so its
    // vector's memory may be written as bytes; the slice covers exactly its `len` bytes.
    let bytes = unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), s.len) };
    file.read_exact_at(bytes, s.start)?;
    Ok(v)
}

impl candle_nn::var_builder::SimpleBackend for ReadTensors {
    fn get(
        &self,
        s: candle_core::Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: candle_core::DType,
        dev: &candle_core::Device,
    ) -> candle_core::Result<candle_core::Tensor> {
        let t = self.get_unchecked(name, dtype, dev)?;
        if t.shape() != &s {
            return Err(candle_core::Error::UnexpectedShape {
                msg: format!("shape mismatch for {name}"),
                expected: s,
                got: t.shape().clone(),
            }
            .bt());
        }
        Ok(t)
    }

    fn get_unchecked(
        &self,
        name: &str,
        dtype: candle_core::DType,
        dev: &candle_core::Device,
    ) -> candle_core::Result<candle_core::Tensor> {
        self.read(name)?.to_dtype(dtype)?.to_device(dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }
}
