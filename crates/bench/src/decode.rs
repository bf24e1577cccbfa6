//! `bench decode`: decode throughput of mole's decoder, each line a ratio measured side by side
//! in one run on one synthetic model (default ~0.5B parameters), on the device and in the dtype
//! a worker serves with (the first CUDA GPU when built with `cuda` and one is present, else the
//! CPU; bf16 weights, which the CPU computes on in f32):
//! dynamic LoRA ÷ merged (batch 1 and 16), 16 distinct adapters ÷ one adapter (batch 16),
//! batch 16 ÷ batch 1, adapter load ÷ raw read of its file, and on the CPU half-type weights ÷
//! the same widened to f32; then the image case (see [`super::image`]).
//!
//! "Merged" is the base model without adapter: a merged model has exactly the base's shapes,
//! so its decode cost is the base's.

use super::synthetic::{synthetic_config, synthetic_json, synthetic_weights, write_adapter};
use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

use candle_core::{DType, Device};
use candle_nn::VarBuilder;

use mole_engine::lora::{self, LoadOptions};
use mole_model::LoraAdapter;
use mole_model::{BackendKind, Decoder, Row, SeqCache, TensorPathOptions};

/// Arguments of `bench decode`.
#[derive(clap::Args, Debug)]
pub struct DecodeBenchArgs {
    /// Hidden size of the synthetic model: a multiple of 256 (heads of 64, four query heads
    /// per key/value head).
    #[arg(long, env = "MOLE_BENCH_HIDDEN", default_value_t = 1024, value_parser = synthetic_hidden)]
    pub hidden: usize,
    /// Layers of the synthetic model.
    #[arg(long, env = "MOLE_BENCH_LAYERS", default_value_t = 42)]
    pub layers: usize,
    /// LoRA rank of the adapters (every linear module).
    #[arg(long, env = "MOLE_BENCH_RANK", default_value_t = 16)]
    pub rank: usize,
    /// Decode steps timed per measurement.
    #[arg(long, env = "MOLE_BENCH_STEPS", default_value_t = 16)]
    pub steps: usize,
    /// Rounds over all contenders (best of each is kept).
    #[arg(long, env = "MOLE_BENCH_ROUNDS", default_value_t = 5)]
    pub rounds: usize,
    /// Also measure an HF model directory (e.g. the imported SmolLM2) with a synthetic adapter.
    #[arg(long, env = "MOLE_BENCH_MODEL")]
    pub model: Option<std::path::PathBuf>,
    /// A Python with torch, transformers and peft: also time transformers + PEFT `generate` on
    /// the `--model` directory (without one, on the synthetic model) with the same adapter,
    /// batch 1 and 16, on as many threads and on the same device and dtype.
    #[arg(long, env = "MOLE_BENCH_PYTHON")]
    pub python: Option<std::path::PathBuf>,
    /// The weights' dtype: `auto` (bf16, a pool's default), `f32`, `bf16` or `f16`. A GPU
    /// computes in it; the CPU computes in f32 and also times the half types widened to f32.
    #[arg(long, env = "MOLE_BENCH_DTYPE", default_value = "auto")]
    pub dtype: String,
    /// The image case: time to first token for one `WxH` screenshot on the synthetic model
    /// with a vision tower (`none` skips it).
    #[arg(long, env = "MOLE_BENCH_IMAGE", default_value = "1024x768", value_parser = parse_image)]
    pub image: ImageSize,
    /// Blocks of the image case's vision tower (Qwen3-VL-8B: 27).
    #[arg(long, env = "MOLE_BENCH_VISION_DEPTH", default_value_t = 27)]
    pub vision_depth: usize,
    /// Width of the image case's vision tower, a multiple of 72 (Qwen3-VL-8B: 1152, 16 heads).
    #[arg(long, env = "MOLE_BENCH_VISION_HIDDEN", default_value_t = 1152, value_parser = vision_hidden)]
    pub vision_hidden: usize,
    /// A GGUF file: time it served quantized against its own bf16 import, side by side, on
    /// both paths (prefill and decode, batch 1 and 16, with and without an adapter), instead
    /// of the synthetic model and the image case.
    #[arg(long, env = "MOLE_BENCH_GGUF")]
    pub gguf: Option<std::path::PathBuf>,
    /// On the CPU, time the tensor path's table alone (no host-path table, no f32 twin, no
    /// image case, no transformers): about a third of the full run.
    #[arg(long, env = "MOLE_BENCH_TENSOR_ONLY")]
    pub tensor_only: bool,
    /// With `--gguf`: the host path's table alone, and without candle's quantized product as
    /// a contender (its scalar Q4_1 product takes minutes per round on two cores).
    #[arg(long, env = "MOLE_BENCH_GGUF_QUICK")]
    pub gguf_quick: bool,
    /// Instead of a GGUF file, the synthetic model (`--hidden`, `--layers`) quantized in
    /// memory: `q4_k_m` (llama.cpp's Q4_K_M mix: q4_K, with q6_K for every `v_proj` and
    /// `down_proj` and the tied embedding/head), or one type for every matrix (`q4_0`, `q4_1`,
    /// `q8_0`, `q4_k`, `q5_k`, `q6_k`); the same tables as `--gguf`. The k-quants need rows
    /// that are multiples of 256, which no small real model here has (SmolLM2's 576).
    #[arg(long, env = "MOLE_BENCH_GGUF_SYNTHETIC", value_parser = synthetic_quant)]
    pub gguf_synthetic: Option<SyntheticQuant>,
    /// Also write the measured rates as a service model (JSON) that `mole-operator simulate
    /// --service-model` and a pool's `merge.traffic.capacity` read: merged tokens/s at batch 1
    /// and 16, one dynamic adapter ÷ merged at both, 16 distinct ÷ one, and the adapter load
    /// time (the rest keeps the model's stated defaults).
    #[arg(long, env = "MOLE_BENCH_SERVICE_MODEL")]
    pub service_model: Option<std::path::PathBuf>,
    /// How the tensor path computes LoRA updates (as `serve --lora-kernel`): `ops` or `bgmv`.
    #[arg(long, env = "MOLE_LORA_KERNEL", default_value = "ops")]
    pub lora_kernel: mole_model::LoraKernel,
}

/// What `--gguf-synthetic` quantizes the synthetic model to.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SyntheticQuant {
    /// llama.cpp's Q4_K_M mix (see `--gguf-synthetic`).
    Q4KM,
    /// One block type for every matrix.
    All(candle_core::quantized::GgmlDType),
}

impl SyntheticQuant {
    /// The block type of the matrix `name` (an HF name).
    pub fn of(self, name: &str) -> candle_core::quantized::GgmlDType {
        use candle_core::quantized::GgmlDType;
        match self {
            Self::All(t) => t,
            Self::Q4KM
                if name.ends_with("v_proj.weight")
                    || name.ends_with("down_proj.weight")
                    || name == "model.embed_tokens.weight" =>
            {
                GgmlDType::Q6K
            }
            Self::Q4KM => GgmlDType::Q4K,
        }
    }
}

/// `--gguf-synthetic`.
fn synthetic_quant(v: &str) -> Result<SyntheticQuant, String> {
    use candle_core::quantized::GgmlDType as T;
    Ok(match v.to_ascii_lowercase().as_str() {
        "q4_k_m" => SyntheticQuant::Q4KM,
        "q4_0" => SyntheticQuant::All(T::Q4_0),
        "q4_1" => SyntheticQuant::All(T::Q4_1),
        "q8_0" => SyntheticQuant::All(T::Q8_0),
        "q4_k" => SyntheticQuant::All(T::Q4K),
        "q5_k" => SyntheticQuant::All(T::Q5K),
        "q6_k" => SyntheticQuant::All(T::Q6K),
        _ => {
            return Err(format!(
                "{v}: expected q4_k_m, q4_0, q4_1, q8_0, q4_k, q5_k or q6_k"
            ))
        }
    })
}

/// `--vision-hidden`: whole heads of 72.
fn vision_hidden(v: &str) -> Result<usize, String> {
    match v.parse::<usize>() {
        Ok(h) if h > 0 && h.is_multiple_of(72) => Ok(h),
        _ => Err(format!(
            "{v}: the vision width must be a positive multiple of 72"
        )),
    }
}

/// `--hidden`: the synthetic model needs whole key/value heads.
fn synthetic_hidden(v: &str) -> Result<usize, String> {
    match v.parse::<usize>() {
        Ok(h) if h > 0 && h.is_multiple_of(256) => Ok(h),
        _ => Err(format!(
            "{v}: the synthetic model's hidden size must be a positive multiple of 256"
        )),
    }
}

/// `--image`: a screenshot's width and height, or None to skip the case.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ImageSize(pub Option<(u32, u32)>);

/// `--image`: `WxH`, or `none` to skip the case.
pub(super) fn parse_image(v: &str) -> Result<ImageSize, String> {
    parse_size(v).map(ImageSize)
}

fn parse_size(v: &str) -> Result<Option<(u32, u32)>, String> {
    if v.eq_ignore_ascii_case("none") {
        return Ok(None);
    }
    let (w, h) = v
        .split_once(['x', 'X', '×'])
        .ok_or_else(|| format!("{v}: expected WxH (e.g. 1024x768) or none"))?;
    match (w.parse(), h.parse()) {
        (Ok(w), Ok(h)) if w > 0 && h > 0 => Ok(Some((w, h))),
        _ => Err(format!("{v}: expected WxH with positive integers")),
    }
}

/// The device and dtype of a run: the worker's own choice, or `--dtype` as given.
pub(super) fn device_and_dtype(args: &DecodeBenchArgs) -> anyhow::Result<(Device, DType)> {
    let dev = mole_engine::default_device();
    let dtype = match args.dtype.to_ascii_lowercase().as_str() {
        "auto" => mole_engine::candle_dtype(mole_api::Dtype::default()),
        other => mole_engine::candle_dtype(
            serde_json::from_value(serde_json::json!(other))
                .map_err(|_| anyhow::anyhow!("--dtype {other}: expected auto, f32, bf16 or f16"))?,
        ),
    };
    Ok((dev, dtype))
}

/// Decode tokens/s of a batch whose row `k` uses `adapters[k]`: an 8-token prefill, then
/// `steps` timed decode steps, each read back as the engine reads a greedy step (one argmax
/// over the batch, one copy).
pub(super) fn tokens_per_s(
    model: &Decoder,
    adapters: &[Option<&LoraAdapter>],
    steps: usize,
) -> anyhow::Result<f64> {
    let mut caches = (0..adapters.len())
        .map(|_| SeqCache::default())
        .collect::<Vec<_>>();
    let prompt: Vec<u32> = (1..9).collect();
    let mut next: Vec<u32> = {
        let mut rows: Vec<Row> = caches
            .iter_mut()
            .zip(adapters)
            .map(|(cache, a)| Row {
                tokens: &prompt,
                cache,
                adapter: *a,
                vision: None,
            })
            .collect();
        greedy(model, &mut rows)?
    };
    let start = Instant::now();
    for _ in 0..steps {
        let toks: Vec<[u32; 1]> = next.iter().map(|t| [*t]).collect();
        let mut rows: Vec<Row> = caches
            .iter_mut()
            .zip(adapters)
            .zip(&toks)
            .map(|((cache, a), t)| Row {
                tokens: t,
                cache,
                adapter: *a,
                vision: None,
            })
            .collect();
        next = greedy(model, &mut rows)?;
    }
    Ok((steps * adapters.len()) as f64 / start.elapsed().as_secs_f64())
}

/// One step of `rows` and its greedy tokens, in one copy back.
fn greedy(model: &Decoder, rows: &mut [Row<'_>]) -> anyhow::Result<Vec<u32>> {
    let logits = model.forward_batch(rows)?;
    Ok(mole_model::download(
        &logits.argmax(candle_core::D::Minus1)?,
    )?)
}

/// Measures `model`; `wide`, when given, is the same model with its weights widened to its
/// compute dtype (bf16 weights on the CPU against f32 ones), timed merged beside it.
fn bench_model(
    label: &str,
    model: &mut Decoder,
    wide: Option<&Decoder>,
    model_dir: Option<&Path>,
    args: &DecodeBenchArgs,
    dev: &Device,
) -> anyhow::Result<()> {
    let cfg = model.config().clone();
    model.configure(BackendKind::Host, tensor_pools(args));
    let tmp = tempfile::tempdir()?;
    let opts = LoadOptions {
        max_rank: 512,
        expect_base: None,
    };
    // Adapters held as a pool holds them by default (`loraDtype` unset).
    let held = mole_model::adapter_dtype(model.weight_dtype(), dev);
    let mut adapters = Vec::new();
    let (mut load_ms, mut read_ms) = (f64::NAN, f64::NAN);
    for k in 0..16u64 {
        let dir = tmp.path().join(format!("a{k}"));
        write_adapter(&dir, &cfg, args.rank, k, dev)?;
        if k == 0 {
            // Warm the page cache, then time raw reads against loads, each from cache,
            // alternating and keeping the best of each. Both end with the bytes in memory
            // the process did not have before (the read into a fresh anonymous mapping), as a
            // loader's would: a read into a buffer the allocator just freed skips the page
            // faults every real load pays.
            let file = dir.join("adapter_model.safetensors");
            std::fs::read(&file)?;
            let (mut read_s, mut load_s) = (f64::MAX, f64::MAX);
            let mut loaded = None;
            for _ in 0..3 {
                let t = Instant::now();
                let len = std::fs::metadata(&file)?.len() as usize;
                let mut raw = memmap2::MmapMut::map_anon(len)?;
                std::io::Read::read_exact(&mut std::fs::File::open(&file)?, &mut raw)?;
                read_s = read_s.min(t.elapsed().as_secs_f64());
                drop(raw);
                let t = Instant::now();
                let a = lora::load(&dir, &cfg, held, dev, &opts)?;
                load_s = load_s.min(t.elapsed().as_secs_f64());
                loaded = Some(a);
            }
            (load_ms, read_ms) = (load_s * 1e3, read_s * 1e3);
            adapters.extend(loaded);
        } else {
            adapters.push(lora::load(&dir, &cfg, held, dev, &opts)?);
        }
    }
    // Computing in f32 (the CPU), the same adapters also held in the other dtype the host
    // kernels read (`loraDtype: f32` over bf16 weights, `bf16` over f32 ones): what each
    // distinct adapter's bytes cost a step.
    let alt = match (model.dtype(), held) {
        (DType::F32, DType::BF16) => Some(DType::F32),
        (DType::F32, _) => Some(DType::BF16),
        _ => None,
    };
    let in_alt: Vec<LoraAdapter> = match alt {
        Some(d) => (0..16)
            .map(|k| {
                let dir = tmp.path().join(format!("a{k}"));
                lora::load(&dir, &cfg, d, dev, &opts)
            })
            .collect::<Result<_, _>>()?,
        None => Vec::new(),
    };
    if args.tensor_only && model.backend_kind() == BackendKind::Host {
        return tensor_path_table(model, &adapters, args);
    }
    let s = args.steps;
    let distinct: Vec<Option<&LoraAdapter>> = adapters.iter().map(Some).collect();
    let mut configs: Vec<Vec<Option<&LoraAdapter>>> = vec![
        vec![None],
        vec![Some(&adapters[0])],
        vec![None; 16],
        vec![Some(&adapters[0]); 16],
        distinct,
    ];
    if let Some(first) = in_alt.first() {
        configs.push(vec![Some(first); 16]);
        configs.push(in_alt.iter().map(Some).collect());
    }
    // Warm-up, then the contenders alternate over rounds and each keeps its best, so drift
    // of the machine affects all of them alike.
    let mut contenders: Vec<(&Decoder, &[Option<&LoraAdapter>])> =
        configs.iter().map(|c| (&*model, c.as_slice())).collect();
    let (one_none, sixteen_none) = ([None], [None; 16]);
    if let Some(w) = wide {
        contenders.push((w, &one_none));
        contenders.push((w, &sixteen_none));
    }
    for (m, c) in &contenders[..] {
        tokens_per_s(m, c, 2)?;
    }
    let mut best = vec![0f64; contenders.len()];
    for _ in 0..args.rounds {
        for (b, (m, c)) in best.iter_mut().zip(&contenders) {
            *b = b.max(tokens_per_s(m, c, s)?);
        }
    }
    let wide_best = best.split_off(configs.len());
    let (base1, dyn1, base16, one16, mixed16) = (best[0], best[1], best[2], best[3], best[4]);
    // The issue's goals: a GPU must come closer to merged and further ahead of transformers.
    let (near, ahead16) = if dev.is_cuda() {
        ("≥ 0.95", "≥ 3.0")
    } else {
        ("≥ 0.90", "≥ 1.0")
    };
    println!(
        "bench decode: {label}, rank-{} LoRA on every linear module held in {held:?} (a pool's default), {} on {}, {} decode steps, LoRA kernel {}",
        args.rank,
        dtypes(model),
        device_name(dev),
        s,
        args.lora_kernel
    );
    println!("| measure | tokens/s | ratio | goal |");
    println!("|---|---|---|---|");
    println!("| batch 1: merged (base weights) | {base1:.1} | | |");
    println!(
        "| batch 1: dynamic adapter | {dyn1:.1} | {:.2} of merged | {near} |",
        dyn1 / base1
    );
    println!("| batch 16: merged | {base16:.1} | | |");
    println!(
        "| batch 16: one dynamic adapter | {one16:.1} | {:.2} of merged | {near} |",
        one16 / base16
    );
    println!(
        "| batch 16: 16 distinct adapters | {mixed16:.1} | {:.2} of one adapter | ≥ 0.90 |",
        mixed16 / one16
    );
    if let ([one_h, mixed_h], Some(d)) = (&best[5..], alt) {
        println!(
            "| batch 16: one dynamic adapter, held in {d:?} | {one_h:.1} | {:.2} of merged | {near} |",
            one_h / base16
        );
        println!(
            "| batch 16: 16 distinct adapters, held in {d:?} | {mixed_h:.1} | {:.2} of one adapter in {d:?} | ≥ 0.90 |",
            mixed_h / one_h
        );
    }
    if let [wide1, wide16] = wide_best[..] {
        let (w, c) = (model.weight_dtype(), model.dtype());
        for (b, here, wide) in [(1, base1, wide1), (16, base16, wide16)] {
            println!(
                "| batch {b}: merged, weights widened to {c:?} | {wide:.1} | {w:?} weights {:.2}x of it | |",
                here / wide
            );
        }
    }
    println!(
        "| batch 16 ÷ batch 1 (merged) | | {:.2}x | |",
        base16 / base1
    );
    // One line for scripts (scripts/gpu-run.sh puts two runs side by side): the rates, and the
    // bytes of weights a merged step reads at most (for its share of the memory bound).
    println!(
        "bench-summary label={label:?} lora_kernel={} merged_b1={base1:.3} dynamic_b1={dyn1:.3} merged_b16={base16:.3} one_b16={one16:.3} distinct_b16={mixed16:.3} weight_bytes={}",
        args.lora_kernel,
        model.weight_bytes()
    );
    if model.backend_kind() == BackendKind::Paged {
        print_ops(model, &adapters, args)?;
    }
    println!(
        "| adapter load ÷ raw read of its file into new memory ({} MiB, from page cache: {load_ms:.1} ms ÷ {read_ms:.1} ms) | | {:.2} | ≤ 1.5 |",
        std::fs::metadata(tmp.path().join("a0/adapter_model.safetensors"))?.len() >> 20,
        load_ms / read_ms
    );
    if let Some(path) = &args.service_model {
        let model = service_model(
            label,
            args,
            dev,
            [base1, dyn1, base16, one16, mixed16],
            load_ms,
        );
        model
            .validate()
            .map_err(|e| anyhow::anyhow!("{e} (measured: {model:?})"))?;
        std::fs::write(path, serde_json::to_vec_pretty(&model)?)?;
        println!("service model written to {}", path.display());
    }
    if let (Some(py), Some(dir)) = (&args.python, model_dir) {
        let threads = candle_core::utils::get_num_threads();
        // transformers holds the weights in mole's weight dtype (and computes in it).
        let hf_dtype = match model.weight_dtype() {
            DType::BF16 => "bfloat16",
            DType::F16 => "float16",
            _ => "float32",
        };
        let o = std::process::Command::new(py)
            .arg("-c")
            .arg(HF_SCRIPT)
            .arg(dir)
            .arg(tmp.path().join("a0"))
            .arg(s.to_string())
            .arg(threads.to_string())
            .arg(if dev.is_cuda() { "cuda" } else { "cpu" })
            .arg(hf_dtype)
            .output()?;
        let last = String::from_utf8_lossy(&o.stdout)
            .lines()
            .last()
            .unwrap_or("")
            .to_string();
        let nums: Vec<f64> = last
            .split_whitespace()
            .filter_map(|x| x.parse().ok())
            .collect();
        match (o.status.success(), nums.as_slice()) {
            (true, [hf1, hf16]) => {
                println!(
                    "| batch 1: transformers + PEFT generate ({hf_dtype}, {threads} threads) | {hf1:.1} | mole dynamic {:.2}x of it | ≥ 1.0 |",
                    dyn1 / hf1
                );
                println!(
                    "| batch 16: transformers + PEFT generate | {hf16:.1} | mole dynamic {:.2}x of it | {ahead16} |",
                    one16 / hf16
                );
            }
            _ => println!(
                "| transformers + PEFT | failed: {} | | |",
                String::from_utf8_lossy(&o.stderr)
                    .lines()
                    .last()
                    .unwrap_or("")
            ),
        }
    }
    if model.backend_kind() == BackendKind::Host {
        drop(contenders);
        tensor_path_table(model, &adapters, args)?;
    }
    Ok(())
}

/// The service model of one run: `[merged b1, dynamic b1, merged b16, one adapter b16, 16
/// distinct b16]` tokens/s and the adapter load (page cache to a slot, ms); the adapter's disk
/// read, pod start and merge time keep the model's defaults (not measured here).
fn service_model(
    label: &str,
    args: &DecodeBenchArgs,
    dev: &Device,
    [base1, dyn1, base16, one16, mixed16]: [f64; 5],
    load_ms: f64,
) -> mole_api::ServiceModel {
    let mut m: mole_api::ServiceModel = serde_json::from_value(serde_json::json!({
        "mergedB1": base1, "mergedB16": base16,
        "dynamicRatioB1": dyn1 / base1, "dynamicRatioB16": one16 / base16,
        "distinct16Ratio": mixed16 / one16,
    }))
    .expect("the five measured fields are the model's required ones");
    m.host_load_s = load_ms / 1e3;
    m.source = format!(
        "mole-bench {} decode: {label}, rank-{} adapters on every linear module, {} decode steps x {} rounds on {}",
        env!("CARGO_PKG_VERSION"),
        args.rank,
        args.steps,
        args.rounds,
        device_name(dev)
    );
    m
}

/// The tensor path's pools for a benchmark: 16 rows of an 8-token prompt and the timed steps,
/// 16 adapters at the benchmark's rank.
fn tensor_pools(args: &DecodeBenchArgs) -> TensorPathOptions {
    let block_size = TensorPathOptions::default().block_size;
    TensorPathOptions {
        block_size,
        kv_blocks: 16 * (9 + args.steps).div_ceil(block_size) + 16,
        lora_slots: 16,
        lora_rank: args.rank,
        kv_dtype: None,
        lora_kernel: args.lora_kernel,
    }
}

/// The candle ops of one tensor-path decode step at batch 16 on 16 distinct adapters (after a
/// step that put them in their slots), per layer: what a GPU launches.
fn print_ops(
    model: &Decoder,
    adapters: &[LoraAdapter],
    args: &DecodeBenchArgs,
) -> anyhow::Result<()> {
    let distinct: Vec<Option<&LoraAdapter>> = adapters.iter().map(Some).collect();
    tokens_per_s(model, &distinct, 1)?;
    let (r, ops) = mole_model::tensors_made(|| tokens_per_s(model, &distinct, 1));
    r?;
    // The measured call also prefills: that is a second step (a prefill has the same ops as a
    // decode step); each step's argmax is one more.
    let per_step = ops.saturating_sub(2) / 2;
    println!(
        "| ops per decode step (tensors candle makes, views included; {} layers, rank {}) | | {per_step} ({:.1} per layer) | the same at any batch |",
        model.config().num_hidden_layers,
        args.rank,
        per_step as f64 / model.config().num_hidden_layers as f64
    );
    Ok(())
}

/// On the CPU, the same measurements on the tensor path, with the host kernels off: the path a
/// GPU runs (paged KV cache, batched attention, LoRA slots), here as candle's CPU ops.
fn tensor_path_table(
    model: &mut Decoder,
    adapters: &[LoraAdapter],
    args: &DecodeBenchArgs,
) -> anyhow::Result<()> {
    model.configure(BackendKind::Paged, model.tensor_path().clone());
    let distinct: Vec<Option<&LoraAdapter>> = adapters.iter().map(Some).collect();
    let configs: [Vec<Option<&LoraAdapter>>; 5] = [
        vec![None],
        vec![Some(&adapters[0])],
        vec![None; 16],
        vec![Some(&adapters[0]); 16],
        distinct,
    ];
    let model: &Decoder = model;
    for c in &configs {
        tokens_per_s(model, c, 2)?;
    }
    let mut best = [0f64; 5];
    for _ in 0..args.rounds {
        for (b, c) in best.iter_mut().zip(&configs) {
            *b = b.max(tokens_per_s(model, c, args.steps)?);
        }
    }
    let [base1, dyn1, base16, one16, mixed16] = best;
    println!();
    println!("tensor path on the CPU (host kernels off: what a GPU runs, as candle's CPU ops)");
    println!("| measure | tokens/s | ratio | goal |");
    println!("|---|---|---|---|");
    println!("| batch 1: merged | {base1:.1} | | |");
    println!(
        "| batch 1: dynamic adapter | {dyn1:.1} | {:.2} of merged | ≥ 0.90 |",
        dyn1 / base1
    );
    println!("| batch 16: merged | {base16:.1} | | |");
    println!(
        "| batch 16: one dynamic adapter | {one16:.1} | {:.2} of merged | ≥ 0.90 |",
        one16 / base16
    );
    println!(
        "| batch 16: 16 distinct adapters | {mixed16:.1} | {:.2} of one adapter | ≥ 0.90 |",
        mixed16 / one16
    );
    println!(
        "| batch 16 step ÷ batch 1 step (merged) | | {:.2} | |",
        base1 * 16.0 / base16
    );
    print_ops(model, adapters, args)
}

/// transformers + PEFT decode tokens/s at batch 1 and 16: the same 8-token prompt, greedy,
/// decode time = generate(steps + 1 tokens) - generate(1 token), best of two.
const HF_SCRIPT: &str = r#"
import sys, time, torch
from transformers import AutoModelForCausalLM
from peft import PeftModel
model_dir, adapter_dir, steps, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
device, dtype = sys.argv[5], getattr(torch, sys.argv[6])
torch.set_num_threads(threads)
m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
m = PeftModel.from_pretrained(m, adapter_dir).to(device).eval()
def sync():
    if device == "cuda":
        torch.cuda.synchronize()
def gen(ids, n):
    sync()
    t = time.perf_counter()
    m.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    sync()
    return time.perf_counter() - t
def tps(b):
    ids = torch.arange(1, 9).repeat(b, 1).to(device)
    best = 0.0
    with torch.no_grad():
        gen(ids, 2)
        for _ in range(2):
            one = gen(ids, 1)
            full = gen(ids, steps + 1)
            best = max(best, b * steps / max(full - one, 1e-9))
    return best
print(tps(1), tps(16))
"#;

/// The decode case (the image case runs after it, see [`super::image`]).
pub(super) fn bench(args: &DecodeBenchArgs) -> anyhow::Result<()> {
    let (dev, dtype) = device_and_dtype(args)?;
    let cfg = synthetic_config(args.hidden, args.layers);
    let weights = synthetic_weights(&cfg, &dev)?;
    // With a Python but no --model, transformers + PEFT run on the synthetic model itself,
    // written out as an HF directory (a GPU machine may have no other model at hand).
    let saved = tempfile::tempdir()?;
    let saved_dir = match (&args.python, &args.model) {
        (Some(_), None) => {
            // In the dtype timed: f32 copies of a 5.9B model would be 24 GB to write and read.
            let narrow = weights
                .iter()
                .map(|(k, t)| Ok((k.clone(), t.to_dtype(dtype)?)))
                .collect::<candle_core::Result<HashMap<_, _>>>()?;
            candle_core::safetensors::save(&narrow, saved.path().join("model.safetensors"))?;
            drop(narrow);
            std::fs::write(
                saved.path().join("config.json"),
                serde_json::to_vec_pretty(&synthetic_json(args.hidden, args.layers))?,
            )?;
            Some(saved.path())
        }
        _ => None,
    };
    let mut model = Decoder::new(
        cfg.clone(),
        VarBuilder::from_tensors(weights.clone(), dtype, &dev),
    )?;
    // Held narrower than computed (bf16 on the CPU): the widened twin, timed beside it.
    let wide = match model.weight_dtype() == model.dtype() || args.tensor_only {
        true => None,
        false => Some(Decoder::new(
            cfg.clone(),
            VarBuilder::from_tensors(weights.clone(), model.dtype(), &dev),
        )?),
    };
    let params: usize = {
        let (h, i, l) = (
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_hidden_layers,
        );
        let attn = h * cfg.num_attention_heads * cfg.head_dim() * 2
            + h * cfg.kv_heads() * cfg.head_dim() * 2;
        l * (attn + 3 * h * i) + cfg.vocab_size * h
    };
    bench_model(
        &format!("synthetic qwen3, {:.2}B params", params as f64 / 1e9),
        &mut model,
        wide.as_ref(),
        saved_dir,
        args,
        &dev,
    )?;
    drop((wide, model, weights));
    if let Some(dir) = &args.model {
        let mut m = Decoder::load(dir, dtype, &dev)?;
        let wide = match m.weight_dtype() == m.dtype() {
            true => None,
            false => Some(Decoder::load(dir, m.dtype(), &dev)?),
        };
        let label = dir.display().to_string();
        bench_model(&label, &mut m, wide.as_ref(), Some(dir), args, &dev)?;
        drop((m, wide));
        super::constrained::bench(dir, dtype, &dev, args.steps * 4, args.rounds)?;
    }
    Ok(())
}

/// The model's dtypes as the header names them: one, or the weights' and compute's.
fn dtypes(model: &Decoder) -> String {
    match (model.weight_dtype(), model.dtype()) {
        (w, c) if w == c => format!("{c:?}"),
        (w, c) => format!("{w:?} weights computed in {c:?}"),
    }
}

fn device_name(dev: &Device) -> &'static str {
    if dev.is_cuda() {
        "CUDA GPU 0"
    } else {
        "CPU"
    }
}
