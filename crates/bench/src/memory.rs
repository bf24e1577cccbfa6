//! `bench memory --gguf FILE`: the resident memory of a worker engine serving a GGUF base
//! quantized against the same engine serving its bf16 import (issue 36: a 4-bit base should
//! hold ≤ 0.35× the bytes of its bf16 form). Each contender runs in a process of its own (this
//! binary again, `--child`), so each reading is one engine's alone: `VmRSS` and `VmHWM` from
//! `/proc/self/status` after the load and after a request (a 158-token prompt, 16 tokens).
//! A third process loads nothing: what the binary holds before any model.
//!
//! With `--synthetic TYPE` the contenders are instead a synthetic model of `--hidden` ×
//! `--layers` (the GGUF's tokenizer and vocabulary, random weights) written in bf16, against
//! the same quantized by `mole-worker quantize --type TYPE`: a base the size of the ones mole
//! is for, where the binary's own pages weigh little, and all of it in the type asked for (the
//! tied embedding in q6_k, as llama.cpp and `quantize` keep it).

use mole_engine::ModelSource;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device};

use mole_engine::api::{GenerateRequest, Prompt, SamplingParams, Serving, TokenEvent};
use mole_engine::{Engine, EngineOptions};

/// Arguments of `bench memory`.
#[derive(clap::Args, Debug)]
pub struct MemoryBenchArgs {
    /// The GGUF file served quantized, against its bf16 import.
    #[arg(long)]
    gguf: PathBuf,
    /// A synthetic model quantized to this type (`q4_k`, `q4_0`, … as `quantize --type`)
    /// against its bf16 form, instead of the GGUF's own weights.
    #[arg(long, env = "MOLE_BENCH_MEMORY_SYNTHETIC")]
    synthetic: Option<String>,
    /// The synthetic model's hidden size (a multiple of 256).
    #[arg(long, env = "MOLE_BENCH_HIDDEN", default_value_t = 2048)]
    hidden: usize,
    /// The synthetic model's layers.
    #[arg(long, env = "MOLE_BENCH_LAYERS", default_value_t = 16)]
    layers: usize,
    /// Internal: measure one contender in this process: `gguf`, `dir` (an HF directory in
    /// bf16), `quantized` (a `quantize` output) or `none`, reading `--path`.
    #[arg(long, hide = true)]
    child: Option<String>,
    /// Internal: the file or directory the child loads.
    #[arg(long, hide = true)]
    path: Option<PathBuf>,
}

/// `VmRSS` and `VmHWM` of this process, in bytes.
fn resident() -> anyhow::Result<(u64, u64)> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let field = |name: &str| -> anyhow::Result<u64> {
        let line = status
            .lines()
            .find(|l| l.starts_with(name))
            .ok_or_else(|| anyhow::anyhow!("no {name} in /proc/self/status"))?;
        let kb: u64 = line
            .trim_start_matches(name)
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()?;
        Ok(kb * 1024)
    };
    Ok((field("VmRSS:")?, field("VmHWM:")?))
}

/// One request through the engine: a 158-token prompt, 16 tokens greedy.
fn one_request(e: &Engine) -> anyhow::Result<()> {
    let req = GenerateRequest {
        images: Vec::new(),
        id: "m".into(),
        prompt: Prompt::Tokens((0..158u32).map(|i| (i * 7 + 1) % 1000).collect()),
        adapter: None,
        sampling: SamplingParams {
            max_tokens: 16,
            ignore_eos: true,
            ..Default::default()
        },
    };
    let mut rx = e.submit(req)?;
    loop {
        match rx.blocking_recv() {
            Some(TokenEvent::Finished { .. }) | None => return Ok(()),
            Some(TokenEvent::Error(err)) => anyhow::bail!("{err}"),
            Some(_) => {}
        }
    }
}

/// The child: loads one contender and prints its readings as one line.
fn child(kind: &str, path: &Path) -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let opts = EngineOptions {
        base_name: "m".into(),
        ..Default::default()
    };
    let engine = match kind {
        "gguf" => Some(Engine::load(
            &ModelSource::Gguf(path.to_path_buf()),
            &dev,
            opts,
        )?),
        "dir" => Some(Engine::load(
            &ModelSource::hf(path, DType::BF16),
            &dev,
            opts,
        )?),
        "quantized" => Some(Engine::load(
            &ModelSource::QuantizedDir(path.to_path_buf()),
            &dev,
            opts,
        )?),
        _ => None,
    };
    let loaded = resident()?;
    if let Some(e) = &engine {
        one_request(e)?;
    }
    let served = resident()?;
    println!("MEMORY {} {} {} {}", loaded.0, loaded.1, served.0, served.1);
    Ok(())
}

/// Runs a child of this binary and parses its readings.
fn measure(kind: &str, path: &Path) -> anyhow::Result<[u64; 4]> {
    let out = std::process::Command::new(std::env::current_exe()?)
        .args(["bench", "memory", "--gguf", "-", "--child", kind, "--path"])
        .arg(path)
        .stderr(std::process::Stdio::inherit())
        .output()?;
    anyhow::ensure!(out.status.success(), "the {kind} child failed");
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix("MEMORY "))
        .ok_or_else(|| anyhow::anyhow!("the {kind} child printed no readings"))?;
    let v: Vec<u64> = line.split(' ').map(str::parse).collect::<Result<_, _>>()?;
    v.try_into()
        .map_err(|_| anyhow::anyhow!("the {kind} child printed {line:?}"))
}

/// `bench memory`.
pub fn run(args: &MemoryBenchArgs) -> anyhow::Result<()> {
    if let Some(kind) = &args.child {
        let path = args.path.clone().unwrap_or_default();
        return child(kind, &path);
    }
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("bf16");
    mole_tools::import::import(&mole_tools::import::ImportOptions {
        gguf: args.gguf.clone(),
        out: dir.clone(),
        dtype: mole_tools::merge::OutDtype::Bf16,
    })?;
    let none = measure("none", Path::new("-"))?;
    let (label, quant, dense) = match &args.synthetic {
        None => (
            format!(
                "{} served quantized vs its bf16 import",
                args.gguf.display()
            ),
            measure("gguf", &args.gguf)?,
            measure("dir", &dir)?,
        ),
        Some(t) => {
            let qtype = mole_tools::quantize::QuantType::parse(t)?;
            let syn = tmp.path().join("synthetic");
            write_synthetic(&dir, &syn, args.hidden, args.layers)?;
            let qdir = tmp.path().join("synthetic-q");
            let report = mole_tools::quantize::quantize(&mole_tools::quantize::QuantizeOptions {
                input: syn.clone(),
                out: qdir.clone(),
                qtype,
                root: None,
                drift_tokens: 0,
                max_drift: None,
            })?;
            let m = &report.metadata;
            let label = format!(
                "a synthetic model of hidden {} × {} layers ({:.0} MiB in bf16) quantized to {} ({:.0} MiB: {:?}) vs its bf16 form",
                args.hidden,
                args.layers,
                m.source_bytes as f64 / (1 << 20) as f64,
                m.quant_type,
                m.output_bytes as f64 / (1 << 20) as f64,
                m.tensor_types,
            );
            (label, measure("quantized", &qdir)?, measure("dir", &syn)?)
        }
    };
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!();
    println!("bench memory: {label} (CPU engine, one process each)");
    println!(
        "| process | VmRSS loaded | VmHWM loaded | VmRSS after a request | VmHWM after a request |"
    );
    println!("|---|---|---|---|---|");
    for (name, v) in [("no model", none), ("quantized", quant), ("bf16", dense)] {
        println!(
            "| {name} | {:.1} MiB | {:.1} MiB | {:.1} MiB | {:.1} MiB |",
            mib(v[0]),
            mib(v[1]),
            mib(v[2]),
            mib(v[3])
        );
    }
    let ratio = |i: usize| quant[i] as f64 / dense[i] as f64;
    let net = |i: usize| {
        (quant[i].saturating_sub(none[i])) as f64 / (dense[i].saturating_sub(none[i])) as f64
    };
    println!(
        "| quantized ÷ bf16 | {:.3} | {:.3} | {:.3} | {:.3} |",
        ratio(0),
        ratio(1),
        ratio(2),
        ratio(3)
    );
    println!(
        "| the same, less the no-model process | {:.3} | {:.3} | {:.3} | {:.3} |",
        net(0),
        net(1),
        net(2),
        net(3)
    );
    Ok(())
}

/// Writes into `out` a synthetic model of `hidden` × `layers` in bf16 with the tokenizer files
/// and vocabulary of the model directory `like`.
fn write_synthetic(like: &Path, out: &Path, hidden: usize, layers: usize) -> anyhow::Result<()> {
    anyhow::ensure!(
        hidden > 0 && hidden.is_multiple_of(256),
        "--hidden {hidden}: a positive multiple of 256"
    );
    std::fs::create_dir_all(out)?;
    let like_cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(like.join("config.json"))?)?;
    let mut cfg = super::synthetic::synthetic_json(hidden, layers);
    cfg["vocab_size"] = like_cfg["vocab_size"].clone();
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        if like.join(f).is_file() {
            std::fs::copy(like.join(f), out.join(f))?;
        }
    }
    std::fs::write(out.join("config.json"), serde_json::to_vec_pretty(&cfg)?)?;
    let config: mole_model::ModelConfig = serde_json::from_value(cfg)?;
    let weights = super::synthetic::synthetic_weights(&config, &Device::Cpu)?
        .into_iter()
        .map(|(k, v)| Ok((k, v.to_dtype(DType::BF16)?)))
        .collect::<candle_core::Result<std::collections::HashMap<_, _>>>()?;
    candle_core::safetensors::save(&weights, out.join("model.safetensors"))?;
    Ok(())
}
