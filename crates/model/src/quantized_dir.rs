//! The model of a directory written by `mole-worker quantize`.

use std::path::Path;

use candle_core::Device;

use super::config::ModelConfig;
use super::decoder::Decoder;
use super::ModelError;

impl Decoder {
    /// Loads a `mole-worker quantize` output: config.json as in any HF directory, and the
    /// weights of its one GGUF file under their HF names
    /// ([`mole_formats::gguf::QUANTIZED_FILE`]), served as [`Decoder::from_quantized`]
    /// serves a GGUF base (projections in their blocks, norms and embedding in f32).
    pub fn load_quantized_dir(dir: &Path, device: &Device) -> Result<Self, ModelError> {
        let file = dir.join(mole_formats::gguf::QUANTIZED_FILE);
        let tensors = mole_formats::gguf::load_hf_named(&file, device)
            .map_err(|e| ModelError::Config(e.to_string()))?;
        Decoder::from_quantized(ModelConfig::from_dir(dir)?, tensors, device)
    }
}
