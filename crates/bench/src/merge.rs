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
    #[arg(long, env = "MOLE_BENCH_REPEAT", default_value_t = 4)]
    pub repeat: usize,
    /// Keep the work directory (synthetic base, adapter) for profiling; its path is printed.
    #[arg(long)]
    pub keep: bool,
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

fn timed(mut f: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<f64> {
    let t = Instant::now();
    f()?;
    Ok(t.elapsed().as_secs_f64())
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
    let work_path = if args.keep {
        work.keep()
    } else {
        work.path().to_path_buf()
    };
    let dir = work_path.as_path();
    eprintln!(
        "generating a {} MiB synthetic base in {} ...",
        args.size_mib,
        dir.display()
    );
    let (base, adapter, bytes) = make_inputs(dir, args.size_mib, args.shards, args.rank)?;
    // Every contender starts from a warm page cache and no pending writeback (`sync` before
    // each run, untimed); runs alternate so background noise hits all alike. Two pairs are
    // like for like: `cp -r` against `merge --no-fsync` (neither waits for the disk), and
    // `cp -r` + `sync` of the copied files against the default, durable `merge` (which
    // fdatasyncs its output before renaming it into place).
    read_all(&base)?;
    read_all(&adapter)?;
    let sync = || {
        let _ = Command::new("sync").status();
    };
    let copy_dst = dir.join("copy");
    let exe = std::env::current_exe()?;
    let out = dir.join("merged");
    let mut peak_rss = 0u64;
    let cp_cmd = |durable: bool| -> anyhow::Result<()> {
        let st = Command::new("cp")
            .arg("-r")
            .arg(&base)
            .arg(&copy_dst)
            .status()?;
        anyhow::ensure!(st.success(), "cp failed");
        if durable {
            let files: Vec<PathBuf> = std::fs::read_dir(&copy_dst)?
                .map(|e| e.map(|e| e.path()))
                .collect::<Result<_, _>>()?;
            let st = Command::new("sync").args(&files).status()?;
            anyhow::ensure!(st.success(), "sync failed");
        }
        Ok(())
    };
    let mut merge_cmd = |durable: bool| -> anyhow::Result<()> {
        let mut c = Command::new(&exe);
        c.args(["merge", "--safe-merge", "--base"])
            .arg(&base)
            .arg("--adapter")
            .arg(&adapter)
            .arg("--out")
            .arg(&out)
            .env("MOLE_MERGE_REPORT_RSS", "1");
        if !durable {
            c.arg("--no-fsync");
        }
        let o = c.output()?;
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
    };
    // Best of `repeat`: [cp, cp + sync, merge --no-fsync, merge]. The order rotates from one
    // repetition to the next: on a VM, how fast fresh page-cache memory is depends on what
    // the previous run freed, so every contender gets every predecessor.
    let mut best = [f64::INFINITY; 4];
    for rep in 0..args.repeat.max(1) {
        for step in 0..4 {
            let i = (step + rep) % 4;
            let _ = std::fs::remove_dir_all(&copy_dst);
            let _ = std::fs::remove_dir_all(&out);
            sync();
            let durable = i % 2 == 1;
            let t = if i < 2 {
                timed(|| cp_cmd(durable))?
            } else {
                timed(|| merge_cmd(durable))?
            };
            best[i] = best[i].min(t);
        }
    }
    let _ = std::fs::remove_dir_all(&copy_dst);
    let _ = std::fs::remove_dir_all(&out);
    let [cp, cp_sync, merge_fast, merge] = best;

    let largest_shard = std::fs::read_dir(&base)?
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
        .map(|e| e.metadata().map(|m| m.len()).unwrap_or(0))
        .max()
        .unwrap_or(0);
    let adapter_bytes = std::fs::metadata(adapter.join("adapter_model.safetensors"))?.len();
    let budget = largest_shard + adapter_bytes + (256 << 20);
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let verdict = |r: f64| {
        if r <= 1.1 {
            "within the 1.1 target"
        } else if r <= 1.3 {
            "over the 1.1 target, within the 1.3 limit"
        } else {
            "OVER the 1.3 limit"
        }
    };
    println!(
        "bench merge: synthetic llama, {:.0} MiB bf16 in {} shards, rank-{} LoRA on every linear module; {} CPUs",
        mib(bytes as u64),
        args.shards,
        args.rank,
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
    );
    println!("| measure (best of {}) | value |", args.repeat.max(1));
    println!("|---|---|");
    println!("| cp -r base | {cp:.3} s |");
    println!("| mole-worker merge --safe-merge --no-fsync | {merge_fast:.3} s |");
    println!(
        "| merge ÷ cp (neither syncs) | {:.2}x: {} |",
        merge_fast / cp,
        verdict(merge_fast / cp)
    );
    println!("| cp -r base + sync of the copied files | {cp_sync:.3} s |");
    println!(
        "| mole-worker merge --safe-merge (fdatasync before rename, the default) | {merge:.3} s |"
    );
    println!(
        "| merge ÷ cp (both durable) | {:.2}x: {} |",
        merge / cp_sync,
        verdict(merge / cp_sync)
    );
    println!(
        "| merge throughput (--no-fsync) | {:.0} MiB/s |",
        mib(bytes as u64) / merge_fast
    );
    println!(
        "| merge peak RSS | {:.0} MiB: {} (budget: largest shard {:.0} + adapter {:.0} + 256 = {:.0} MiB) |",
        mib(peak_rss),
        if peak_rss <= budget {
            "within budget"
        } else {
            "OVER BUDGET"
        },
        mib(largest_shard),
        mib(adapter_bytes),
        mib(budget)
    );
    if let Some(py) = &args.python {
        let peft_out = dir.join("peft");
        // Best of two: the first run also warms python's own files.
        let (mut process, mut o) = (f64::INFINITY, None);
        for _ in 0..2 {
            let _ = std::fs::remove_dir_all(&peft_out);
            sync();
            let started = Instant::now();
            let run = Command::new(py)
                .arg("-c")
                .arg(PEFT_SCRIPT)
                .arg(&base)
                .arg(&adapter)
                .arg(&peft_out)
                .output()?;
            let t = started.elapsed().as_secs_f64();
            let ok = run.status.success();
            if t < process || !ok {
                process = t;
                o = Some(run);
            }
            if !ok {
                break;
            }
        }
        let o = o.expect("ran once");
        if o.status.success() {
            let inner: f64 = String::from_utf8_lossy(&o.stdout)
                .trim()
                .lines()
                .last()
                .unwrap_or("")
                .parse()?;
            println!(
                "| PEFT merge_and_unload + save_pretrained, whole python process | {process:.3} s |"
            );
            println!("| PEFT, load + merge + save only (timed inside python) | {inner:.3} s |");
            // Like for like: whole process against whole process, neither syncing; and the
            // conservative figure that leaves python's start-up out.
            println!(
                "| PEFT ÷ mole (processes, neither syncs) | mole {:.1}x faster (target ≥ 10) |",
                process / merge_fast
            );
            println!(
                "| PEFT (in-python time) ÷ mole (process, neither syncs) | mole {:.1}x faster |",
                inner / merge_fast
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
