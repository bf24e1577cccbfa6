//! Pre-quantized HF checkpoints, the one home of their formats: what a `config.json`'s
//! `quantization_config` says and whether mole serves it (here), and their packed projections
//! repacked into the blocks the model multiplies ([`blocks`]). AWQ (AutoAWQ's GEMM packing)
//! and GPTQ (AutoGPTQ's v1 format, `desc_act` false), 4 bits, group sizes 32, 64 and 128 are
//! served; anything else is refused at load naming the format, before a tensor is read (an
//! unknown layout would otherwise fail as a missing `.weight`). GGUF's own blocks are
//! [`crate::gguf`]'s, the products over them `mole_kernels::quant`'s.

pub mod blocks;

use serde_json::Value;

/// A quantized checkpoint's format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantFormat {
    /// AWQ, GEMM packing: `qweight` int32 `[in, out/8]` and `qzeros` `[in/group, out/8]`
    /// packed along the output in the order 0, 2, 4, 6, 1, 3, 5, 7; `scales` f16.
    Awq,
    /// GPTQ v1 (`checkpoint_format` "gptq"): `qweight` int32 `[in/8, out]` packed along the
    /// input, `qzeros` `[in/group, out/8]` holding each zero minus one; `scales` f16.
    Gptq,
}

impl QuantFormat {
    /// The format's name in messages.
    pub fn name(self) -> &'static str {
        match self {
            QuantFormat::Awq => "AWQ",
            QuantFormat::Gptq => "GPTQ",
        }
    }
}

/// A quantization mole serves: the format and the input values per group of one scale and
/// zero point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantScheme {
    /// The format.
    pub format: QuantFormat,
    /// Input values per group (32, 64 or 128).
    pub group_size: usize,
}

/// Group sizes served: multiples of 32, the width of the blocks they are repacked into.
const GROUP_SIZES: [usize; 3] = [32, 64, 128];

/// The served scheme of a `config.json` (`None`: not quantized), or why it is not served.
pub fn scheme(config: &Value) -> Result<Option<QuantScheme>, String> {
    let Some(q) = config.get("quantization_config") else {
        return Ok(None);
    };
    let method = q
        .get("quant_method")
        .and_then(Value::as_str)
        .unwrap_or("unnamed")
        .to_ascii_lowercase();
    let int = |k: &str| q.get(k).and_then(Value::as_u64);
    let (format, bits, group) = match method.as_str() {
        "awq" => {
            let version = q
                .get("version")
                .and_then(Value::as_str)
                .unwrap_or("gemm")
                .to_ascii_lowercase();
            if version != "gemm" {
                return Err(format!(
                    "AWQ packing version {version:?}: mole serves AWQ's GEMM packing only"
                ));
            }
            if q.get("zero_point").and_then(Value::as_bool) == Some(false) {
                return Err("AWQ without zero points: mole serves zero-point AWQ only".into());
            }
            (
                QuantFormat::Awq,
                int("bits").or(int("w_bit")),
                int("group_size").or(int("q_group_size")),
            )
        }
        "gptq" => {
            if q.get("desc_act").and_then(Value::as_bool) == Some(true) {
                return Err(
                    "GPTQ with act-order (desc_act true): its groups follow a permutation of \
                     the inputs that blocks of consecutive inputs cannot hold; mole serves \
                     desc_act false only"
                        .into(),
                );
            }
            let fmt = q
                .get("checkpoint_format")
                .and_then(Value::as_str)
                .unwrap_or("gptq");
            if fmt != "gptq" {
                return Err(format!(
                    "GPTQ checkpoint_format {fmt:?}: mole serves the \"gptq\" (v1) layout only"
                ));
            }
            (QuantFormat::Gptq, int("bits"), int("group_size"))
        }
        other => {
            return Err(format!(
                "quantization method {other:?}: mole serves AWQ and GPTQ checkpoints (4-bit) \
                 and GGUF files"
            ))
        }
    };
    let name = format.name();
    if bits != Some(4) {
        return Err(format!(
            "{name} with {} bits: mole serves 4-bit {name} only",
            bits.map_or("unstated".into(), |b| b.to_string())
        ));
    }
    match group.map(|g| g as usize) {
        Some(g) if GROUP_SIZES.contains(&g) => Ok(Some(QuantScheme {
            format,
            group_size: g,
        })),
        g => Err(format!(
            "{name} group size {}: mole serves group sizes 32, 64 and 128 (whole blocks of 32)",
            g.map_or("unstated (-1: one group per row)".into(), |g| g.to_string())
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn schemes_served_and_refused() {
        let c = |q: Value| json!({ "quantization_config": q });
        assert_eq!(scheme(&json!({})), Ok(None));
        assert_eq!(
            scheme(&c(
                json!({"quant_method": "awq", "bits": 4, "group_size": 128,
                              "zero_point": true, "version": "GEMM"})
            )),
            Ok(Some(QuantScheme {
                format: QuantFormat::Awq,
                group_size: 128
            }))
        );
        assert_eq!(
            scheme(&c(
                json!({"quant_method": "gptq", "bits": 4, "group_size": 32,
                              "desc_act": false})
            )),
            Ok(Some(QuantScheme {
                format: QuantFormat::Gptq,
                group_size: 32
            }))
        );
        for (q, says) in [
            (
                json!({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": true}),
                "act-order",
            ),
            (
                json!({"quant_method": "gptq", "bits": 4, "group_size": -1}),
                "group size",
            ),
            (
                json!({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "gptq_v2"}),
                "gptq_v2",
            ),
            (
                json!({"quant_method": "awq", "bits": 3, "group_size": 128}),
                "3 bits",
            ),
            (
                json!({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}),
                "gemv",
            ),
            (json!({"quant_method": "fp8"}), "fp8"),
        ] {
            let e = scheme(&c(q)).unwrap_err();
            assert!(e.contains(says), "{e}");
        }
    }
}
