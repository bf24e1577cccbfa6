//! `bench decode --gguf FILE`: a GGUF base served quantized against its own bf16 import (the
//! same weights dequantized by `mole-worker import`), side by side in one run: the contenders
//! alternate over rounds and each keeps its best. The quantized base runs three times: with
//! mole's tiled kernel (q4_0, q4_1, q8_0 and the k-quants), the same kernel one activation
//! row at a time (how the Q4_1 kernel ran before the tiles) and candle's quantized product
//! alone (block types the kernel does not cover take candle's product in all three). Measured
//! on the host path (the CPU's own kernels) and on the tensor path (what a GPU runs, here as
//! candle's CPU ops): prefill of a 158-token prompt (the guidellm prompts), and decode
//! at batch 1 and 16 without and with a LoRA adapter on every projection.
//!
//! `bench decode --gguf-synthetic TYPE` runs the same tables on the synthetic model quantized
//! in memory, for block types no small real model here has rows for (the k-quants need rows
//! that are multiples of 256).

use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device};

use super::decode::{tokens_per_s, DecodeBenchArgs, SyntheticQuant};
use super::synthetic::{synthetic_config, synthetic_weights, write_adapter};
use mole_engine::lora::{self, LoadOptions};
use mole_model::{
    BackendKind, Decoder, LoraAdapter, ModelConfig, Row, SeqCache, TensorPathOptions,
};

/// Tokens of the timed prompt.
const PROMPT: usize = 158;

/// Prompt tokens/s of `rows` fresh sequences prefilling [`PROMPT`] tokens each in one step.
fn prefill_per_s(
    model: &Decoder,
    adapter: Option<&LoraAdapter>,
    rows: usize,
) -> anyhow::Result<f64> {
    let vocab = model.config().vocab_size as u32;
    let prompts: Vec<Vec<u32>> = (0..rows)
        .map(|r| {
            (0..PROMPT as u32)
                .map(|i| (i * 7 + r as u32 * 13 + 1) % vocab)
                .collect()
        })
        .collect();
    let mut caches: Vec<SeqCache> = (0..rows).map(|_| SeqCache::default()).collect();
    let mut batch: Vec<Row> = caches
        .iter_mut()
        .zip(&prompts)
        .map(|(cache, p)| Row {
            tokens: p,
            cache,
            adapter,
            vision: None,
        })
        .collect();
    let t = Instant::now();
    let logits = model.forward_batch(&mut batch)?;
    mole_model::download::<u32>(&logits.argmax(candle_core::D::Minus1)?)?;
    Ok((rows * PROMPT) as f64 / t.elapsed().as_secs_f64())
}

/// One measurement of a contender.
#[derive(Clone, Copy)]
enum Case {
    Prefill(usize),
    Decode(usize, bool),
}

impl Case {
    const ALL: [Case; 7] = [
        Case::Prefill(1),
        Case::Prefill(4),
        Case::Decode(1, false),
        Case::Decode(1, true),
        Case::Decode(4, false),
        Case::Decode(16, false),
        Case::Decode(16, true),
    ];

    fn label(self) -> String {
        match self {
            Case::Prefill(b) => format!("prefill, {b} × {PROMPT}-token prompt (prompt tokens/s)"),
            Case::Decode(b, false) => format!("decode batch {b}, no adapter"),
            Case::Decode(b, true) => format!("decode batch {b}, one LoRA adapter"),
        }
    }

    fn run(self, model: &Decoder, adapter: &LoraAdapter, steps: usize) -> anyhow::Result<f64> {
        match self {
            Case::Prefill(b) => prefill_per_s(model, None, b),
            Case::Decode(b, with) => {
                let rows = vec![with.then_some(adapter); b];
                tokens_per_s(model, &rows, steps)
            }
        }
    }
}

/// The GGUF case of `bench decode`.
pub(super) fn bench(file: &Path, args: &DecodeBenchArgs, dev: &Device) -> anyhow::Result<()> {
    let q = mole_formats::gguf::load_quantized(file, dev)?;
    let types = types_of(&q.tensors);
    let cfg = ModelConfig::from_json(q.config.clone())?;
    let quant = Decoder::from_quantized(cfg.clone(), q.tensors, dev)?;
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("bf16");
    mole_tools::import::import(&mole_tools::import::ImportOptions {
        gguf: file.to_path_buf(),
        out: dir.clone(),
        dtype: mole_tools::merge::OutDtype::Bf16,
    })?;
    let dense = Decoder::load(&dir, DType::BF16, dev)?;
    let label = format!("{} ({types})", file.display());
    compare(&label, &cfg, quant, dense, args, dev)
}

/// The block types of a model's matrices, joined by `+`.
fn types_of(tensors: &HashMap<String, QTensor>) -> String {
    let types: std::collections::BTreeSet<String> = tensors
        .values()
        .filter(|t| t.rank() == 2)
        .map(|t| format!("{:?}", t.dtype()))
        .collect();
    types.into_iter().collect::<Vec<_>>().join("+")
}

/// `--gguf-synthetic`: the synthetic model quantized in memory against the same quantized
/// values widened to bf16 (what `import` makes of a GGUF), as [`bench`] compares a file.
pub(super) fn bench_synthetic(
    spec: SyntheticQuant,
    args: &DecodeBenchArgs,
    dev: &Device,
) -> anyhow::Result<()> {
    let cfg = synthetic_config(args.hidden, args.layers);
    let weights = synthetic_weights(&cfg, &Device::Cpu)?;
    let mut quantized = HashMap::new();
    let mut widened = HashMap::new();
    for (name, w) in weights {
        let t = if w.rank() == 2 {
            spec.of(&name)
        } else {
            GgmlDType::F32
        };
        let q = QTensor::quantize(&w, t)?;
        widened.insert(
            name.clone(),
            q.dequantize(&Device::Cpu)?
                .to_dtype(DType::BF16)?
                .to_device(dev)?,
        );
        let q = if dev.is_cpu() {
            q
        } else {
            let dims = q.shape().dims().to_vec();
            candle_core::quantized::ggml_file::qtensor_from_ggml(t, &q.data()?, dims, dev)?
        };
        quantized.insert(name, q);
    }
    let label = format!(
        "synthetic hidden {} × {} layers, {spec:?} ({})",
        args.hidden,
        args.layers,
        types_of(&quantized)
    );
    let quant = Decoder::from_quantized(cfg.clone(), quantized, dev)?;
    let dense = Decoder::new(
        cfg.clone(),
        candle_nn::VarBuilder::from_tensors(widened, DType::BF16, dev),
    )?;
    compare(&label, &cfg, quant, dense, args, dev)
}

/// Times `quant` against `dense` (the same weights widened), side by side.
fn compare(
    label: &str,
    cfg: &ModelConfig,
    mut quant: Decoder,
    mut dense: Decoder,
    args: &DecodeBenchArgs,
    dev: &Device,
) -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let adir = tmp.path().join("a0");
    write_adapter(&adir, cfg, args.rank, 0, dev)?;
    let opts = LoadOptions {
        max_rank: 512,
        expect_base: None,
    };
    let held = |m: &Decoder| mole_model::adapter_dtype(m.weight_dtype(), dev);
    let a_quant = lora::load(&adir, cfg, held(&quant), dev, &opts)?;
    let a_dense = lora::load(&adir, cfg, held(&dense), dev, &opts)?;
    let paths: &[bool] = if dev.is_cpu() && args.gguf_quick {
        &[true]
    } else if dev.is_cpu() {
        &[true, false]
    } else {
        &[false]
    };
    for &host in paths {
        quant.configure(BackendKind::host_if(host), TensorPathOptions::default());
        dense.configure(BackendKind::host_if(host), TensorPathOptions::default());
        // The quantized base with mole's kernel by panels (where the CPU has AVX-512 VNNI;
        // else the tiled kernel again), tiled, one row at a time, with candle's product alone,
        // and the bf16 import.
        use mole_kernels::quant::{set_mode, Mode};
        let all = [
            (&quant, &a_quant, Mode::Panels),
            (&quant, &a_quant, Mode::Tiled),
            (&quant, &a_quant, Mode::Untiled),
            (&quant, &a_quant, Mode::Off),
            (&dense, &a_dense, Mode::Panels),
        ];
        let contenders: Vec<_> = all
            .into_iter()
            .filter(|c| !(args.gguf_quick && matches!(c.2, Mode::Off | Mode::Untiled)))
            .collect();
        let run = |case: Case, (m, a, mode): (&Decoder, &LoraAdapter, Mode), steps| {
            set_mode(mode);
            let r = case.run(m, a, steps);
            set_mode(Mode::Panels);
            r
        };
        for case in Case::ALL {
            for &c in &contenders {
                run(case, c, 2)?;
            }
        }
        // Contenders left out (`--gguf-quick`) read as 0.
        let mut best = vec![[0f64; 5]; Case::ALL.len()];
        for _ in 0..args.rounds {
            for (b, case) in best.iter_mut().zip(Case::ALL) {
                for (slot, c) in b.iter_mut().zip(all) {
                    if contenders
                        .iter()
                        .any(|k| k.2 == c.2 && std::ptr::eq(k.0, c.0))
                    {
                        *slot = slot.max(run(case, c, args.steps)?);
                    }
                }
            }
        }
        println!();
        println!(
            "bench decode --gguf: {label} quantized vs its bf16 import, {} path on {}, rank-{} LoRA, {} decode steps, best of {} rounds",
            if host { "host" } else { "tensor" },
            if dev.is_cuda() { "CUDA GPU 0" } else { "CPU" },
            args.rank,
            args.steps,
            args.rounds,
        );
        println!(
            "| measure | quantized, panels | quantized, tiled kernel | quantized, kernel row by row | quantized, candle's product | bf16 import | panels ÷ bf16 | tiled ÷ bf16 | row by row ÷ bf16 | candle ÷ bf16 |"
        );
        println!("|---|---|---|---|---|---|---|---|---|---|");
        for (case, [p, q, u, c, d]) in Case::ALL.into_iter().zip(&best) {
            println!(
                "| {} | {p:.1} | {q:.1} | {u:.1} | {c:.1} | {d:.1} | {:.2} | {:.2} | {:.2} | {:.2} |",
                case.label(),
                p / d,
                q / d,
                u / d,
                c / d
            );
        }
    }
    Ok(())
}
