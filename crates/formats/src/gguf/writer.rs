//! A streaming GGUF (v3) writer: the header and every tensor's entry are written first from
//! shapes and types alone, then each tensor's blocks as the caller produces them, so a model
//! is written one tensor at a time (candle's `gguf_file::write` needs every tensor in memory
//! at once).
//!
//! Layout (llama.cpp's `gguf.h`): magic, version, tensor and key counts, key/value pairs,
//! tensor entries (name, dims innermost first, ggml type, offset in the data section), padding
//! to the alignment (32, candle's and llama.cpp's default when `general.alignment` is absent),
//! then each tensor's bytes, each padded to the alignment.

use std::io::Write;

use candle_core::quantized::GgmlDType;

/// Alignment of the data section and of every tensor in it.
pub const ALIGNMENT: u64 = 32;

/// A metadata value the writer emits.
#[derive(Debug, Clone)]
pub enum MetaValue {
    /// GGUF `UINT32`.
    U32(u32),
    /// GGUF `FLOAT32`.
    F32(f32),
    /// GGUF `STRING`.
    Str(String),
}

/// One tensor's entry: its name, shape (outermost first, as candle and HF write it) and type.
#[derive(Debug, Clone)]
pub struct TensorEntry {
    /// Name in the file.
    pub name: String,
    /// Shape, outermost first.
    pub shape: Vec<usize>,
    /// Block type.
    pub dtype: GgmlDType,
}

impl TensorEntry {
    /// Bytes of the tensor's blocks (elements must be a whole number of blocks).
    pub fn bytes(&self) -> u64 {
        let n: usize = self.shape.iter().product();
        (n / self.dtype.block_size() * self.dtype.type_size()) as u64
    }
}

/// ggml's type numbers (candle keeps its own mapping private).
pub fn ggml_type_id(d: GgmlDType) -> u32 {
    match d {
        GgmlDType::F32 => 0,
        GgmlDType::F16 => 1,
        GgmlDType::Q4_0 => 2,
        GgmlDType::Q4_1 => 3,
        GgmlDType::Q5_0 => 6,
        GgmlDType::Q5_1 => 7,
        GgmlDType::Q8_0 => 8,
        GgmlDType::Q8_1 => 9,
        GgmlDType::Q2K => 10,
        GgmlDType::Q3K => 11,
        GgmlDType::Q4K => 12,
        GgmlDType::Q5K => 13,
        GgmlDType::Q6K => 14,
        GgmlDType::Q8K => 15,
        GgmlDType::BF16 => 30,
    }
}

fn pad(n: u64) -> u64 {
    (ALIGNMENT - n % ALIGNMENT) % ALIGNMENT
}

fn string(w: &mut impl Write, s: &str) -> std::io::Result<()> {
    w.write_all(&(s.len() as u64).to_le_bytes())?;
    w.write_all(s.as_bytes())
}

/// A GGUF file being written: [`GgufWriter::new`] writes the header, then
/// [`GgufWriter::tensor`] once per entry, in the entries' order, then [`GgufWriter::finish`].
pub struct GgufWriter<W: Write> {
    w: W,
    entries: Vec<TensorEntry>,
    next: usize,
}

impl<W: Write> GgufWriter<W> {
    /// Writes the header, the metadata and every tensor's entry.
    pub fn new(
        mut w: W,
        metadata: &[(&str, MetaValue)],
        entries: Vec<TensorEntry>,
    ) -> std::io::Result<Self> {
        let mut pos = 0u64;
        let mut head = Vec::new();
        head.extend_from_slice(&0x4655_4747u32.to_le_bytes());
        head.extend_from_slice(&3u32.to_le_bytes());
        head.extend_from_slice(&(entries.len() as u64).to_le_bytes());
        head.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
        for (key, value) in metadata {
            string(&mut head, key)?;
            match value {
                MetaValue::U32(v) => {
                    head.extend_from_slice(&4u32.to_le_bytes());
                    head.extend_from_slice(&v.to_le_bytes());
                }
                MetaValue::F32(v) => {
                    head.extend_from_slice(&6u32.to_le_bytes());
                    head.extend_from_slice(&v.to_le_bytes());
                }
                MetaValue::Str(s) => {
                    head.extend_from_slice(&8u32.to_le_bytes());
                    string(&mut head, s)?;
                }
            }
        }
        let mut offset = 0u64;
        for e in &entries {
            string(&mut head, &e.name)?;
            head.extend_from_slice(&(e.shape.len() as u32).to_le_bytes());
            for d in e.shape.iter().rev() {
                head.extend_from_slice(&(*d as u64).to_le_bytes());
            }
            head.extend_from_slice(&ggml_type_id(e.dtype).to_le_bytes());
            head.extend_from_slice(&offset.to_le_bytes());
            offset += e.bytes() + pad(e.bytes());
        }
        pos += head.len() as u64;
        head.resize(head.len() + pad(pos) as usize, 0);
        w.write_all(&head)?;
        Ok(Self {
            w,
            entries,
            next: 0,
        })
    }

    /// Writes the next entry's blocks; refuses bytes of another size than the entry's (a
    /// file whose offsets lie would be unreadable).
    pub fn tensor(&mut self, data: &[u8]) -> std::io::Result<()> {
        let Some(e) = self.entries.get(self.next) else {
            return Err(std::io::Error::other("more tensors than entries"));
        };
        if data.len() as u64 != e.bytes() {
            return Err(std::io::Error::other(format!(
                "{}: {} bytes, its entry says {}",
                e.name,
                data.len(),
                e.bytes()
            )));
        }
        self.w.write_all(data)?;
        self.w.write_all(&vec![0u8; pad(e.bytes()) as usize])?;
        self.next += 1;
        Ok(())
    }

    /// Checks every entry was written and hands the writer back (flushed).
    pub fn finish(mut self) -> std::io::Result<W> {
        if self.next != self.entries.len() {
            return Err(std::io::Error::other(format!(
                "{} of {} tensors written",
                self.next,
                self.entries.len()
            )));
        }
        self.w.flush()?;
        Ok(self.w)
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use candle_core::quantized::{gguf_file, QTensor};
    use candle_core::{Device, Tensor};

    /// What the streaming writer writes, candle's reader reads back: metadata, shapes, types
    /// and every block byte for byte.
    #[test]
    fn candle_reads_back_what_is_streamed() {
        let dev = Device::Cpu;
        let a = Tensor::randn(0f32, 1.0, (8, 64), &dev).unwrap();
        let b = Tensor::randn(0f32, 1.0, 64, &dev).unwrap();
        let qa = QTensor::quantize(&a, GgmlDType::Q4_0).unwrap();
        let qb = QTensor::quantize(&b, GgmlDType::F32).unwrap();
        let entries = vec![
            TensorEntry {
                name: "a.weight".into(),
                shape: vec![8, 64],
                dtype: GgmlDType::Q4_0,
            },
            TensorEntry {
                name: "b.weight".into(),
                shape: vec![64],
                dtype: GgmlDType::F32,
            },
        ];
        let mut buf = std::io::Cursor::new(Vec::new());
        let mut w = GgufWriter::new(
            &mut buf,
            &[
                ("general.name", MetaValue::Str("t".into())),
                ("x.count", MetaValue::U32(7)),
            ],
            entries,
        )
        .unwrap();
        w.tensor(&qa.data().unwrap()).unwrap();
        assert!(w.tensor(&[0u8; 3]).is_err(), "a wrong size is refused");
        w.tensor(&qb.data().unwrap()).unwrap();
        w.finish().unwrap();
        buf.set_position(0);
        let c = gguf_file::Content::read(&mut buf).unwrap();
        assert_eq!(c.metadata["general.name"].to_string().unwrap(), "t");
        assert_eq!(c.metadata["x.count"].to_u32().unwrap(), 7);
        let ra = c.tensor(&mut buf, "a.weight", &dev).unwrap();
        assert_eq!(ra.shape().dims(), [8, 64]);
        assert_eq!(ra.dtype(), GgmlDType::Q4_0);
        assert_eq!(&*ra.data().unwrap(), &*qa.data().unwrap());
        let rb = c.tensor(&mut buf, "b.weight", &dev).unwrap();
        assert_eq!(&*rb.data().unwrap(), &*qb.data().unwrap());
    }
}
