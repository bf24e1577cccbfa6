//! `bench merge`: merge time against a plain copy of the base files, measured side by side in
//! one run on a synthetic model (≥ 1 GiB by default), with the merge's peak RSS and, when a
//! Python with transformers + peft is given, the ratio against PEFT's
//! `merge_and_unload()` + `save_pretrained()` on the same input.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Instant;

use half::bf16;
use rand::{Rng, SeedableRng};

/// Arguments of `bench merge`.
#[derive(clap::Args, Debug)]
pub struct MergeBenchArgs {
    /// Size of the synthetic base in MiB (bf16 weights).
    #[arg(long, env = "MOLE_BENCH_SIZE_MIB", default_value_t = 1024)]
    pub size_mib: usize,
    /// Number of safetensors shards of the base.
    #[arg(long, env = "MOLE_BENCH_SHARDS", default_value_t = 2)]
    pub shards: usize,
    /// LoRA rank of the synthetic adapter (on every linear module).
    #[arg(long, env = "MOLE_BENCH_RANK", default_value_t = 16)]
    pub rank: usize,
    /// Work directory (a fresh subdirectory is created and removed).
    #[arg(long, env = "MOLE_BENCH_DIR")]
    pub dir: Option<PathBuf>,
    /// Python with torch, transformers and peft: also time PEFT on the same input.
    #[arg(long, env = "MOLE_BENCH_PYTHON")]
    pub python: Option<PathBuf>,
    /// Repetitions of each timed step (the best is kept).
    #[arg(long, env = "MOLE_BENCH_REPEAT", default_value_t = 2)]
    pub repeat: usize,
}

const HIDDEN: usize = 2048;
const INTERMEDIATE: usize = 5632;
const KV: usize = 512;
const VOCAB: usize = 32000;

fn layer_tensors(l: usize) -> Vec<(String, Vec<usize>)> {
    let p = |m: &str| format!("model.layers.{l}.{m}");
    vec![
        (p("input_layernorm.weight"), vec![HIDDEN]),
        (p("post_attention_layernorm.weight"), vec![HIDDEN]),
        (p("self_attn.q_proj.weight"), vec![HIDDEN, HIDDEN]),
        (p("self_attn.k_proj.weight"), vec![KV, HIDDEN]),
        (p("self_attn.v_proj.weight"), vec![KV, HIDDEN]),
        (p("self_attn.o_proj.weight"), vec![HIDDEN, HIDDEN]),
        (p("mlp.gate_proj.weight"), vec![INTERMEDIATE, HIDDEN]),
        (p("mlp.up_proj.weight"), vec![INTERMEDIATE, HIDDEN]),
        (p("mlp.down_proj.weight"), vec![HIDDEN, INTERMEDIATE]),
    ]
}

fn numel(s: &[usize]) -> usize {
    s.iter().product()
}

/// Writes tensors of random small bf16 values as one safetensors file, streaming.
fn write_safetensors(
    path: &Path,
    tensors: &[(String, Vec<usize>)],
    rng: &mut rand::rngs::StdRng,
) -> std::io::Result<()> {
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    for (name, shape) in tensors {
        let len = numel(shape) * 2;
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + len]}),
        );
        offset += len;
    }
    let mut h = serde_json::to_vec(&header).expect("json");
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut f = std::io::BufWriter::with_capacity(8 << 20, std::fs::File::create(path)?);
    f.write_all(&(h.len() as u64).to_le_bytes())?;
    f.write_all(&h)?;
    // A small table of values repeated with a random start keeps generation fast.
    let table: Vec<u8> = (0..1 << 16)
        .flat_map(|_| bf16::from_f32(rng.random_range(-0.05f32..0.05)).to_le_bytes())
        .collect();
    for (_, shape) in tensors {
        let mut left = numel(shape) * 2;
        while left > 0 {
            let start = rng.random_range(0..table.len() / 4) & !1;
            let n = left.min(table.len() - start);
            f.write_all(&table[start..start + n])?;
            left -= n;
        }
    }
    f.flush()
}

/// Builds the synthetic base (config.json, shards, index) and a rank-`rank` adapter.
fn make_inputs(
    dir: &Path,
    size_mib: usize,
    shards: usize,
    rank: usize,
) -> std::io::Result<(PathBuf, PathBuf, usize)> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let per_layer: usize = layer_tensors(0).iter().map(|(_, s)| numel(s) * 2).sum();
    let fixed = (2 * VOCAB * HIDDEN + HIDDEN) * 2;
    let layers = ((size_mib << 20).saturating_sub(fixed))
        .div_ceil(per_layer)
        .max(1);
    let base = dir.join("base");
    std::fs::create_dir_all(&base)?;
    let mut all: Vec<(String, Vec<usize>)> =
        vec![("model.embed_tokens.weight".into(), vec![VOCAB, HIDDEN])];
    for l in 0..layers {
        all.extend(layer_tensors(l));
    }
    all.push(("model.norm.weight".into(), vec![HIDDEN]));
    all.push(("lm_head.weight".into(), vec![VOCAB, HIDDEN]));
    let total: usize = all.iter().map(|(_, s)| numel(s) * 2).sum();
    let per_shard = total.div_ceil(shards.max(1));
    let mut groups: Vec<Vec<(String, Vec<usize>)>> = vec![Vec::new()];
    let mut acc = 0;
    for t in all {
        let len = numel(&t.1) * 2;
        if acc + len > per_shard && !groups.last().expect("one group").is_empty() {
            groups.push(Vec::new());
            acc = 0;
        }
        acc += len;
        groups.last_mut().expect("one group").push(t);
    }
    let n = groups.len();
    let mut weight_map = serde_json::Map::new();
    for (i, g) in groups.iter().enumerate() {
        let name = format!("model-{:05}-of-{:05}.safetensors", i + 1, n);
        write_safetensors(&base.join(&name), g, &mut rng)?;
        for (t, _) in g {
            weight_map.insert(t.clone(), name.clone().into());
        }
    }
    std::fs::write(
        base.join("model.safetensors.index.json"),
        serde_json::to_vec_pretty(
            &serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map}),
        )
        .expect("json"),
    )?;
    std::fs::write(
        base.join("config.json"),
        serde_json::to_vec_pretty(&serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE, "num_hidden_layers": layers,
            "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128,
            "vocab_size": VOCAB, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "max_position_embeddings": 4096, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
            "hidden_act": "silu"
        }))
        .expect("json"),
    )?;

    let adapter = dir.join("adapter");
    std::fs::create_dir_all(&adapter)?;
    let mut lora: Vec<(String, Vec<usize>)> = Vec::new();
    for l in 0..layers {
        for (name, shape) in layer_tensors(l).into_iter().filter(|(_, s)| s.len() == 2) {
            let module = name.trim_end_matches(".weight");
            lora.push((
                format!("base_model.model.{module}.lora_A.weight"),
                vec![rank, shape[1]],
            ));
            lora.push((
                format!("base_model.model.{module}.lora_B.weight"),
                vec![shape[0], rank],
            ));
        }
    }
    write_safetensors(&adapter.join("adapter_model.safetensors"), &lora, &mut rng)?;
    std::fs::write(
        adapter.join("adapter_config.json"),
        serde_json::to_vec_pretty(&serde_json::json!({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            "base_model_name_or_path": "mole-bench/synthetic", "bias": "none"
        }))
        .expect("json"),
    )?;
    Ok((base, adapter, total))
}

fn read_all(dir: &Path) -> std::io::Result<()> {
    for e in std::fs::read_dir(dir)? {
        let p = e?.path();
        if p.is_file() {
            std::io::copy(&mut std::fs::File::open(&p)?, &mut std::io::sink())?;
        }
    }
    Ok(())
}

fn timed(mut f: impl FnMut() -> anyhow::Result<()>, repeat: usize) -> anyhow::Result<f64> {
    let mut best = f64::INFINITY;
    for _ in 0..repeat.max(1) {
        let t = Instant::now();
        f()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best)
}

const PEFT_SCRIPT: &str = r#"
import sys, time, torch
from transformers import AutoModelForCausalLM
from peft import PeftModel
base, adapter, out = sys.argv[1:4]
t = time.time()
m = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
m = PeftModel.from_pretrained(m, adapter).merge_and_unload(safe_merge=True)
m.save_pretrained(out, max_shard_size="600MB")
print(time.time() - t)
"#;

fn bench(args: &MergeBenchArgs) -> anyhow::Result<()> {
    let parent = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    let work = tempfile::Builder::new()
        .prefix("mole-bench-merge-")
        .tempdir_in(&parent)?;
    let dir = work.path();
    eprintln!(
        "generating a {} MiB synthetic base in {} ...",
        args.size_mib,
        dir.display()
    );
    let (base, adapter, bytes) = make_inputs(dir, args.size_mib, args.shards, args.rank)?;
    // Both contenders start from a warm page cache.
    read_all(&base)?;
    read_all(&adapter)?;

    let copy_dst = dir.join("copy");
    let cp = timed(
        || {
            let _ = std::fs::remove_dir_all(&copy_dst);
            let st = Command::new("cp")
                .arg("-r")
                .arg(&base)
                .arg(&copy_dst)
                .status()?;
            anyhow::ensure!(st.success(), "cp failed");
            Ok(())
        },
        args.repeat,
    )?;
    std::fs::remove_dir_all(&copy_dst)?;

    let exe = std::env::current_exe()?;
    let out = dir.join("merged");
    let mut peak_rss = 0u64;
    let merge = timed(
        || {
            let _ = std::fs::remove_dir_all(&out);
            let o = Command::new(&exe)
                .args(["merge", "--safe-merge", "--base"])
                .arg(&base)
                .arg("--adapter")
                .arg(&adapter)
                .arg("--out")
                .arg(&out)
                .env("MOLE_MERGE_REPORT_RSS", "1")
                .output()?;
            anyhow::ensure!(
                o.status.success(),
                "merge failed: {}",
                String::from_utf8_lossy(&o.stderr)
            );
            for line in String::from_utf8_lossy(&o.stderr).lines() {
                if let Some(v) = line.strip_prefix("peak_rss_bytes ") {
                    peak_rss = peak_rss.max(v.trim().parse().unwrap_or(0));
                }
            }
            Ok(())
        },
        args.repeat,
    )?;
    std::fs::remove_dir_all(&out)?;

    let largest_shard = std::fs::read_dir(&base)?
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
        .map(|e| e.metadata().map(|m| m.len()).unwrap_or(0))
        .max()
        .unwrap_or(0);
    let adapter_bytes = std::fs::metadata(adapter.join("adapter_model.safetensors"))?.len();
    let budget = largest_shard + adapter_bytes + (256 << 20);
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!("bench merge: synthetic llama, {:.0} MiB bf16 in {} shards, rank-{} LoRA on every linear module", mib(bytes as u64), args.shards, args.rank);
    println!("| measure | value |");
    println!("|---|---|");
    println!("| cp -r base (best of {}) | {cp:.3} s |", args.repeat);
    println!(
        "| mole-worker merge --safe-merge (best of {}) | {merge:.3} s |",
        args.repeat
    );
    println!(
        "| merge ÷ cp | {:.2}x (target ≤ 1.1, must be ≤ 1.3) |",
        merge / cp
    );
    println!(
        "| merge throughput | {:.0} MiB/s |",
        mib(bytes as u64) / merge
    );
    println!(
        "| merge peak RSS | {:.0} MiB (budget: largest shard {:.0} + adapter {:.0} + 256 = {:.0} MiB) |",
        mib(peak_rss),
        mib(largest_shard),
        mib(adapter_bytes),
        mib(budget)
    );
    if let Some(py) = &args.python {
        let peft_out = dir.join("peft");
        let o = Command::new(py)
            .arg("-c")
            .arg(PEFT_SCRIPT)
            .arg(&base)
            .arg(&adapter)
            .arg(&peft_out)
            .output()?;
        if o.status.success() {
            let secs: f64 = String::from_utf8_lossy(&o.stdout)
                .trim()
                .lines()
                .last()
                .unwrap_or("")
                .parse()?;
            println!("| PEFT merge_and_unload + save_pretrained | {secs:.3} s |");
            println!(
                "| PEFT ÷ mole | {:.1}x faster (target ≥ 10) |",
                secs / merge
            );
        } else {
            println!(
                "| PEFT | failed: {} |",
                String::from_utf8_lossy(&o.stderr)
                    .lines()
                    .last()
                    .unwrap_or("")
            );
        }
    }
    Ok(())
}

/// Runs the benchmark.
pub fn run(args: MergeBenchArgs) -> ExitCode {
    match bench(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench merge failed: {e:#}");
            ExitCode::FAILURE
        }
    }
}
