//! `mole-worker inspect DIR`: says what a model or adapter directory (or a GGUF file) is, and
//! every validation problem found, before a merge Job or a pod trips over it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use serde::Serialize;

use mole_formats::safetensors::to_f32;
use mole_formats::{hf, peft};

/// Arguments of `inspect`.
#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    /// Model directory, adapter directory or .gguf file.
    #[arg(env = "MOLE_INSPECT_PATH")]
    pub path: PathBuf,
    /// Print JSON instead of text.
    #[arg(long, env = "MOLE_INSPECT_JSON")]
    pub json: bool,
}

/// What `inspect` found.
#[derive(Debug, Serialize, Default)]
pub struct Report {
    /// `model`, `adapter` or `gguf`.
    pub kind: String,
    /// Facts (architecture, rank, dtype, ...).
    pub facts: BTreeMap<String, serde_json::Value>,
    /// Validation problems; empty when the directory is usable.
    pub problems: Vec<String>,
}

/// Inspects a path.
pub fn inspect(path: &Path) -> Report {
    let mut r = Report::default();
    if path.is_file() && path.extension().is_some_and(|e| e == "gguf") {
        inspect_gguf(path, &mut r);
    } else if path.join("adapter_config.json").exists() {
        inspect_adapter(path, &mut r);
    } else if path.join("config.json").exists() {
        inspect_model(path, &mut r);
    } else {
        r.kind = "unknown".into();
        r.problems.push(format!(
            "{}: neither a model (config.json), an adapter (adapter_config.json) nor a .gguf file",
            path.display()
        ));
    }
    r
}

/// Every tensor of the safetensors files: name → (dtype, shape); plus float problems.
fn tensors_of(
    files: &[PathBuf],
    r: &mut Report,
    check_finite: bool,
) -> BTreeMap<String, (String, Vec<usize>)> {
    let mut out = BTreeMap::new();
    for f in files {
        let mmap = match mole_formats::safetensors::map(f) {
            Ok(m) => m,
            Err(e) => {
                r.problems.push(format!("{}: {e}", f.display()));
                continue;
            }
        };
        match safetensors::SafeTensors::deserialize(&mmap) {
            Ok(st) => {
                for (name, v) in st.iter() {
                    if check_finite {
                        if let Some(vals) = to_f32(v.dtype(), v.data()) {
                            if vals.iter().any(|x| !x.is_finite()) {
                                r.problems.push(format!("{name}: contains NaN/Inf"));
                            }
                        }
                    }
                    out.insert(
                        name.to_string(),
                        (format!("{:?}", v.dtype()), v.shape().to_vec()),
                    );
                }
            }
            Err(e) => r
                .problems
                .push(format!("{}: invalid safetensors: {e}", f.display())),
        }
    }
    out
}

fn inspect_model(dir: &Path, r: &mut Report) {
    r.kind = "model".into();
    match hf::read_config(dir) {
        Ok(cfg) => {
            for key in [
                "model_type",
                "architectures",
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "vocab_size",
                "torch_dtype",
                "tie_word_embeddings",
            ] {
                if let Some(v) = cfg.get(key) {
                    r.facts.insert(key.into(), v.clone());
                }
            }
        }
        Err(e) => r.problems.push(e.to_string()),
    }
    if let Some(p) = hf::find_pickle(dir) {
        r.problems
            .push(format!("{}: pickle weights are refused", p.display()));
    }
    let files = match hf::safetensors_files(dir) {
        Ok(f) => f,
        Err(e) => {
            r.problems.push(e.to_string());
            return;
        }
    };
    for f in &files {
        if !f.exists() {
            r.problems
                .push(format!("{}: listed in the index but missing", f.display()));
        }
    }
    let tensors = tensors_of(&files, r, false);
    let params: usize = tensors
        .values()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum();
    let mut dtypes: Vec<&String> = tensors.values().map(|(d, _)| d).collect();
    dtypes.sort();
    dtypes.dedup();
    r.facts.insert("params".into(), params.into());
    r.facts.insert("shards".into(), files.len().into());
    r.facts.insert("tensors".into(), tensors.len().into());
    r.facts.insert("dtypes".into(), serde_json::json!(dtypes));
    r.facts.insert(
        "tokenizer".into(),
        dir.join("tokenizer.json").exists().into(),
    );
    let template = std::fs::read_to_string(dir.join("tokenizer_config.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .is_some_and(|c| c.get("chat_template").is_some())
        || dir.join("chat_template.jinja").exists();
    r.facts.insert("chat_template".into(), template.into());
    let index = dir.join("model.safetensors.index.json");
    if let Ok(idx) = hf::read_index(&index) {
        for name in idx.weight_map.keys() {
            if !tensors.contains_key(name) {
                r.problems
                    .push(format!("{name}: in the index but in no shard"));
            }
        }
    }
}

fn inspect_adapter(dir: &Path, r: &mut Report) {
    r.kind = "adapter".into();
    if let Some(p) = hf::find_pickle(dir) {
        r.problems
            .push(format!("{}: pickle weights are refused", p.display()));
    }
    let cfg = match peft::AdapterConfig::from_dir(dir) {
        Ok(c) => c,
        Err(e) => {
            r.problems.push(e.to_string());
            return;
        }
    };
    r.facts.insert("r".into(), cfg.r.into());
    r.facts.insert("lora_alpha".into(), cfg.lora_alpha.into());
    r.facts.insert("use_rslora".into(), cfg.use_rslora.into());
    r.facts.insert("max_rank".into(), cfg.max_rank().into());
    r.facts.insert(
        "target_modules".into(),
        serde_json::json!(cfg.target_modules),
    );
    r.facts.insert(
        "base_model".into(),
        serde_json::json!(cfg.base_model_name_or_path),
    );
    if cfg.use_dora {
        r.problems
            .push("DoRA adapters are not supported by mole".into());
    }
    if let Some(m) = &cfg.modules_to_save {
        r.facts
            .insert("modules_to_save".into(), serde_json::json!(m));
    }
    let weights = dir.join("adapter_model.safetensors");
    if !weights.exists() {
        r.problems
            .push("adapter_model.safetensors is missing".into());
        return;
    }
    r.facts.insert(
        "bytes".into(),
        std::fs::metadata(&weights)
            .map(|m| m.len())
            .unwrap_or(0)
            .into(),
    );
    let tensors = tensors_of(&[weights], r, true);
    let mut modules: BTreeMap<String, (Option<usize>, Option<usize>)> = BTreeMap::new();
    for (name, (_, shape)) in &tensors {
        if let Some((module, part)) = peft::split_adapter_key(name) {
            let e = modules.entry(module).or_default();
            if part.starts_with("lora_A") || part == "lora_embedding_A" {
                e.0 = shape.first().copied();
            } else if part.starts_with("lora_B") && part.ends_with("weight")
                || part == "lora_embedding_B"
            {
                e.1 = shape.get(1).copied();
            }
        }
    }
    let mut families: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for (module, (ra, rb)) in &modules {
        let want = cfg.rank_for(module) as usize;
        if *ra != Some(want) || *rb != Some(want) {
            r.problems.push(format!(
                "{module}: rank in weights A={ra:?} B={rb:?}, adapter_config.json says {want}"
            ));
        }
        if !cfg.targets(module) {
            r.problems.push(format!(
                "{module}: has LoRA weights but is not in target_modules"
            ));
        }
        let fam = module.rsplit('.').next().unwrap_or(module).to_string();
        let s = cfg.scale_for(module);
        let v = families.entry(fam).or_default();
        if !v.contains(&s) {
            v.push(s);
        }
    }
    r.facts.insert("modules".into(), modules.len().into());
    r.facts.insert("scales".into(), serde_json::json!(families));
}

fn inspect_gguf(path: &Path, r: &mut Report) {
    r.kind = "gguf".into();
    let mut f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) => {
            r.problems.push(e.to_string());
            return;
        }
    };
    match candle_core::quantized::gguf_file::Content::read(&mut f) {
        Ok(c) => {
            for key in [
                "general.architecture",
                "general.name",
                "tokenizer.ggml.model",
                "tokenizer.ggml.pre",
            ] {
                if let Some(v) = c.metadata.get(key).and_then(|v| v.to_string().ok()) {
                    r.facts.insert(key.into(), v.clone().into());
                }
            }
            let mut quant: BTreeMap<String, usize> = BTreeMap::new();
            let mut params = 0usize;
            for t in c.tensor_infos.values() {
                *quant.entry(format!("{:?}", t.ggml_dtype)).or_default() += 1;
                params += t.shape.elem_count();
            }
            r.facts
                .insert("tensors".into(), c.tensor_infos.len().into());
            r.facts.insert("params".into(), params.into());
            r.facts
                .insert("quantization".into(), serde_json::json!(quant));
        }
        Err(e) => r.problems.push(format!("invalid GGUF: {e}")),
    }
}

/// Runs `inspect`: exit 0 when usable, 2 when problems were found.
pub fn run(args: InspectArgs) -> ExitCode {
    let report = inspect(&args.path);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report).expect("json"));
    } else {
        println!("{}: {}", args.path.display(), report.kind);
        for (k, v) in &report.facts {
            println!("  {k}: {v}");
        }
        if report.problems.is_empty() {
            println!("no problems found");
        } else {
            println!("problems:");
            for p in &report.problems {
                println!("  - {p}");
            }
        }
    }
    if report.problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixtures() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/merge")
    }

    #[test]
    fn describes_models_and_adapters_and_finds_problems() {
        let m = inspect(&fixtures().join("base_bf16"));
        assert_eq!(m.kind, "model");
        assert_eq!(m.facts["shards"], 2);
        assert_eq!(m.facts["params"], 35008);
        assert_eq!(m.facts["model_type"], "qwen3");
        assert!(m.problems.is_empty(), "{:?}", m.problems);

        let a = inspect(&fixtures().join("adapters/patterns"));
        assert_eq!(a.kind, "adapter");
        assert_eq!(a.facts["r"], 8);
        assert_eq!(a.facts["modules"], 14);
        assert!(a.problems.is_empty(), "{:?}", a.problems);

        let nan = inspect(&fixtures().join("adapters/bad_nan"));
        assert!(nan
            .problems
            .iter()
            .any(|p| p.contains("layers.0.self_attn.q_proj") && p.contains("NaN")));
        let shape = inspect(&fixtures().join("adapters/bad_shape"));
        assert!(
            shape.problems.is_empty(),
            "shape vs base is the merge's check, ranks agree here"
        );

        let none = inspect(&fixtures());
        assert_eq!(none.kind, "unknown");
        assert!(!none.problems.is_empty());
    }
}
