//! An AWQ or GPTQ input: a pre-quantized base, or a merge onto one (whose touched modules
//! are dense, see `merge::quantized_base`). Its packed projections already hold 4-bit values; quantizing
//! their dequantized weights again would round them a second time. Instead each goes into the
//! GGUF as the Q4_1 blocks the loader repacks it into ([`mole_formats::quant::blocks`]): the
//! same bytes the checkpoint is served with, so the output serves those projections exactly as
//! the input does, and only its dense tensors take the type asked.

use std::path::Path;

use safetensors::SafeTensors;

use super::{io_err, QuantizeError};
use mole_formats::quant::blocks::{packed, QuantError};
use mole_formats::quant::QuantScheme;

/// What a tensor of a packed checkpoint becomes.
pub(super) enum Part {
    /// A projection's `qweight`: its dense weight, `[out, in]`, as Q4_1 blocks.
    Projection {
        /// The module (`model.layers.0.self_attn.q_proj`).
        module: String,
        /// `[out, in]`.
        shape: Vec<usize>,
    },
    /// Its `qzeros`, `scales` or `g_idx`: held in the projection's blocks.
    Skip,
    /// Any other tensor: quantized as in a dense input.
    Dense,
}

/// The part tensor `name` of `st` plays.
pub(super) fn plan(st: &SafeTensors<'_>, name: &str, scheme: QuantScheme) -> Part {
    let packed_module = |suffix: &str| {
        name.strip_suffix(suffix)
            .filter(|m| st.tensor(&format!("{m}.qweight")).is_ok())
    };
    if let Some(module) = packed_module(".qweight") {
        let shape = match st.tensor(&format!("{module}.scales")) {
            Ok(s) if s.shape().len() == 2 => {
                vec![s.shape()[1], s.shape()[0] * scheme.group_size]
            }
            // Checked again, with the format's message, when its blocks are written.
            _ => vec![0, 0],
        };
        return Part::Projection {
            module: module.to_string(),
            shape,
        };
    }
    if [".qzeros", ".scales", ".g_idx"]
        .iter()
        .any(|s| packed_module(s).is_some())
    {
        return Part::Skip;
    }
    Part::Dense
}

/// The Q4_1 blocks of packed projection `module` (all its parts in this shard).
pub(super) fn q4_1(
    st: &SafeTensors<'_>,
    module: &str,
    scheme: QuantScheme,
    path: &Path,
) -> Result<Vec<u8>, QuantizeError> {
    let p = packed(
        |part| st.tensor(&format!("{module}.{part}")).ok(),
        module,
        scheme,
        &path.display().to_string(),
    )
    .map_err(|e| match e {
        QuantError::Unsupported(why) => QuantizeError::QuantizedInput(why),
        e => QuantizeError::Tensor {
            tensor: module.to_string(),
            message: e.to_string(),
        },
    })?;
    Ok(p.q4_1())
}

/// The output's `config.json` without `quantization_config`: its weights are the GGUF's,
/// which says each tensor's block type itself.
pub(super) fn drop_quantization_config(dir: &Path) -> Result<(), QuantizeError> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(io_err(&path))?;
    let mut json: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| QuantizeError::Input(format!("{}: {e}", path.display())))?;
    if let Some(o) = json.as_object_mut() {
        o.remove("quantization_config");
    }
    std::fs::write(&path, serde_json::to_string_pretty(&json).expect("json"))
        .map_err(io_err(&path))?;
    crate::merge::sync_file(&path).map_err(QuantizeError::of_merge)
}
