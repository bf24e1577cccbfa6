//! Merging onto an AWQ or GPTQ base. A LoRA update is dense, so a module it touches cannot
//! stay 4-bit without requantizing it, which would round the update away in part. Instead the
//! touched module is dequantized exactly, `(q - z)·s` in f32 (see
//! [`Packed::dequantize_rows`]), the update added as on a dense base, and the sum written as
//! a dense `.weight` (f16, the scales' dtype, unless `--dtype` says otherwise) in place of its
//! `qweight`/`qzeros`/`scales`/`g_idx`. Every other projection stays packed, byte for byte,
//! and `quantization_config.modules_to_not_convert` names the dense ones, as transformers'
//! AWQ integration reads it (mole's loader takes a dense `.weight` wherever one is present).
//! `quantize` after the merge brings the output back to 4 bits where memory matters.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};

use super::tensors::{Delta, Plan};
use super::{io_err, MergeError};
use mole_formats::quant::blocks::{packed, Packed, QuantError};
use mole_formats::quant::QuantScheme;

/// The parts of a packed module, by suffix; `qweight` is where its dense weight takes its
/// place in the output.
const PARTS: [&str; 4] = ["qweight", "qzeros", "scales", "g_idx"];

/// Adds, for every packed module `M` of the base, the dense `M.weight` it stands for
/// (`[out, in]`, f16 like its scales) to `infos`, so the merge plan checks an adapter's shapes
/// against it. Returns those names.
pub fn add_dense_infos(
    infos: &mut HashMap<String, (Vec<usize>, Dtype)>,
    scheme: QuantScheme,
) -> HashSet<String> {
    let mut added = HashSet::new();
    let modules: Vec<String> = infos
        .keys()
        .filter_map(|k| k.strip_suffix(".qweight").map(str::to_string))
        .collect();
    for m in modules {
        let Some((shape, dtype)) = infos.get(&format!("{m}.scales")).cloned() else {
            continue;
        };
        if let [groups, d_out] = shape[..] {
            let name = format!("{m}.weight");
            if !infos.contains_key(&name) {
                infos.insert(
                    name.clone(),
                    (vec![d_out, groups * scheme.group_size], dtype),
                );
                added.insert(name);
            }
        }
    }
    added
}

/// The base shards, mapped, and which shard holds each tensor.
pub struct Shards {
    maps: Vec<memmap2::Mmap>,
    paths: Vec<PathBuf>,
}

impl Shards {
    /// Maps every shard.
    pub fn open(shards: &[PathBuf]) -> Result<Self, MergeError> {
        let maps = shards
            .iter()
            .map(|s| mole_formats::safetensors::map(s).map_err(io_err(s)))
            .collect::<Result<_, _>>()?;
        Ok(Shards {
            maps,
            paths: shards.to_vec(),
        })
    }
}

/// The touched packed modules of a quantized base, read and checked.
#[derive(Default)]
pub struct QuantBase<'a> {
    /// `M.weight` → its packed parts, for each touched module `M`.
    pub touched: HashMap<String, Packed<'a>>,
    /// `M.qweight` → `M.weight`: where each dense weight goes in the output.
    pub replaces: HashMap<String, String>,
    /// Every packed part of a touched module (they leave the output).
    pub dropped: HashSet<String>,
    /// Every packed part of the modules left alone: copied as they are, whatever `--dtype`
    /// says (the format defines their dtypes).
    pub kept: HashSet<String>,
}

impl<'a> QuantBase<'a> {
    /// The modules of `dense` (the names [`add_dense_infos`] added) that `plan` updates, their
    /// parts read from `shards` and checked against `scheme`.
    pub fn read(
        shards: &'a Shards,
        parsed: &'a [SafeTensors<'a>],
        plan: &Plan<'_>,
        dense: &HashSet<String>,
        scheme: QuantScheme,
    ) -> Result<Self, MergeError> {
        let mut home: HashMap<String, usize> = HashMap::new();
        for (i, st) in parsed.iter().enumerate() {
            for name in st.names() {
                home.insert(name.to_string(), i);
            }
        }
        let mut out = QuantBase::default();
        for (weight, delta) in &plan.deltas {
            if !dense.contains(weight) || !matches!(delta, Delta::LowRank { .. }) {
                continue;
            }
            let module = weight
                .strip_suffix(".weight")
                .expect("dense names end in .weight");
            let get = |part: &str| {
                let name = format!("{module}.{part}");
                home.get(&name).and_then(|&i| parsed[i].tensor(&name).ok())
            };
            let origin = home
                .get(&format!("{module}.qweight"))
                .map(|&i| shards.paths[i].display().to_string())
                .unwrap_or_default();
            let p = packed(get, module, scheme, &origin).map_err(|e| match e {
                QuantError::Unsupported(why) => MergeError::QuantizedBase(why),
                e => MergeError::Safetensors {
                    path: origin.clone(),
                    message: e.to_string(),
                },
            })?;
            out.touched.insert(weight.clone(), p);
            out.replaces
                .insert(format!("{module}.qweight"), weight.clone());
            for part in PARTS {
                out.dropped.insert(format!("{module}.{part}"));
            }
        }
        for name in home.keys() {
            if let Some(module) = name.strip_suffix(".qweight") {
                if !out.touched.contains_key(&format!("{module}.weight")) {
                    out.kept
                        .extend(PARTS.iter().map(|part| format!("{module}.{part}")));
                }
            }
        }
        Ok(out)
    }

    /// The touched modules' names, sorted (`modules_to_not_convert`).
    pub fn modules(&self) -> Vec<String> {
        let mut m: Vec<String> = self
            .touched
            .keys()
            .map(|w| w.trim_end_matches(".weight").to_string())
            .collect();
        m.sort();
        m
    }
}

/// Each shard's header parsed, borrowing the maps.
pub fn parse(shards: &Shards) -> Result<Vec<SafeTensors<'_>>, MergeError> {
    shards
        .maps
        .iter()
        .zip(&shards.paths)
        .map(|(m, p)| {
            SafeTensors::deserialize(m).map_err(|e| MergeError::Safetensors {
                path: p.display().to_string(),
                message: e.to_string(),
            })
        })
        .collect()
}

/// The output's index: the dropped parts gone, each dense weight in the shard its `qweight`
/// was in.
pub fn rewrite_index(json: &mut serde_json::Value, quant: &QuantBase<'_>) {
    let Some(map) = json.get_mut("weight_map").and_then(|m| m.as_object_mut()) else {
        return;
    };
    for (qweight, dense) in &quant.replaces {
        if let Some(file) = map.get(qweight).cloned() {
            map.insert(dense.clone(), file);
        }
    }
    for part in &quant.dropped {
        map.remove(part);
    }
}

/// The output's `config.json` names the dense modules in
/// `quantization_config.modules_to_not_convert` (added to any it listed).
pub fn rewrite_config(dir: &Path, quant: &QuantBase<'_>) -> Result<(), MergeError> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(io_err(&path))?;
    let mut json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| MergeError::Safetensors {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
    if let Some(q) = json
        .get_mut("quantization_config")
        .and_then(|q| q.as_object_mut())
    {
        let mut names: Vec<String> = q
            .get("modules_to_not_convert")
            .and_then(|m| m.as_array())
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default();
        for m in quant.modules() {
            if !names.contains(&m) {
                names.push(m);
            }
        }
        q.insert("modules_to_not_convert".into(), names.into());
    }
    std::fs::write(&path, serde_json::to_string_pretty(&json).expect("json")).map_err(io_err(&path))
}
