//! AWQ and GPTQ checkpoints (safetensors with `qweight`/`qzeros`/`scales` and a
//! `quantization_config` in config.json), from tests/fixtures/quant (written by its
//! generate.py from the formats' definitions, checked there against AutoAWQ's and AutoGPTQ's
//! unpackers).
//!
//! Served (4-bit AWQ GEMM and GPTQ desc_act false, group sizes 32/64/128): the projections
//! stay 4-bit, repacked into Q4_1 blocks, and the model's logits match mole's dense decoder on
//! the format's reference dequantization (`reference.safetensors`, what AutoAWQ's and
//! AutoGPTQ's fp16 dequantizers give; the dense decoder itself is checked against
//! transformers by tests/model/numerics.rs), on the host path and the tensor path, batched and
//! alone, with and without a LoRA adapter.
//!
//! Bounds. Weights: a repacked weight is within 2⁻¹¹·30·s of the reference (s its group's
//! scale: the block's offset `-z·s` rounded to f16, and the reference's own fp16 rounding of
//! `(q - z)·s`; see `formats::quant::blocks`). Logits: candle's Q4_1 matmul rounds each
//! activation row to 8 bits per block of 32 (Q8_1) before its integer dot products, as
//! llama.cpp does, which moves a projection's output by up to ~1% of its scale; 9 chained
//! projections (2 layers and the head, RMSNorm keeping errors relative) stay within 6% of the
//! logits' scale (the bound tests/engine/engine_gguf.rs justifies for GGUF blocks of 32; measured
//! values printed). The adapter moves the logits by far more than that, so an adapter lost on
//! a quantized base fails.
//!
//! Variants mole cannot serve are refused at load with the stable code
//! `unsupported_quantization` and a message naming the format, never with a missing-tensor
//! error.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test
#![allow(clippy::disallowed_methods)] // tests read results back from the device

use mole_engine::ModelSource;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use mole_engine::{Engine, EngineOptions};
use mole_model::{Decoder, LoraAdapter, ModelConfig, Proj, Row, SeqCache};

const TOL: f32 = 0.06;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/quant")
        .join(name)
}

/// A copy of fixture `name` with its `quantization_config` edited.
fn edited(name: &str, edit: impl FnOnce(&mut serde_json::Value)) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(fixture(name)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), tmp.path().join(e.file_name())).unwrap();
    }
    let path = tmp.path().join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut cfg["quantization_config"]);
    std::fs::write(&path, cfg.to_string()).unwrap();
    tmp
}

fn refusal(dir: &Path) -> (String, String) {
    match Engine::load(
        &ModelSource::hf(dir, DType::F32),
        &Device::Cpu,
        EngineOptions::default(),
    ) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => (e.code().to_string(), e.to_string()),
    }
}

#[test]
fn unsupported_quantized_checkpoints_are_refused_naming_the_format() {
    let cases: Vec<(&str, tempfile::TempDir, &str)> = vec![
        (
            "GPTQ with act-order",
            edited("gptq_g64", |q| q["desc_act"] = true.into()),
            "GPTQ",
        ),
        (
            "3-bit AWQ",
            edited("awq_g32", |q| q["bits"] = 3.into()),
            "AWQ",
        ),
        (
            "8-bit GPTQ",
            edited("gptq_g64", |q| q["bits"] = 8.into()),
            "GPTQ",
        ),
        (
            "AWQ GEMV packing",
            edited("awq_g32", |q| q["version"] = "gemv".into()),
            "AWQ",
        ),
        (
            "AWQ group size 16",
            edited("awq_g32", |q| q["group_size"] = 16.into()),
            "AWQ",
        ),
        (
            "bitsandbytes",
            edited(
                "awq_g32",
                |q| *q = serde_json::json!({"quant_method": "bitsandbytes", "load_in_4bit": true}),
            ),
            "bitsandbytes",
        ),
    ];
    for (what, dir, format) in cases {
        let (code, msg) = refusal(dir.path());
        eprintln!("{what}: {code}: {msg}");
        assert_eq!(code, "unsupported_quantization", "{what}: {msg}");
        assert!(msg.contains(format), "{what}: {msg}");
    }
}

/// The dense reference: the checkpoint's unquantized tensors and the reference weights of the
/// quantized projections, in f32.
fn reference_decoder(dir: &Path) -> Decoder {
    let dev = Device::Cpu;
    let mut t = HashMap::new();
    for file in ["model.safetensors", "reference.safetensors"] {
        for (k, v) in candle_core::safetensors::load(dir.join(file), &dev).unwrap() {
            if !k.ends_with(".qweight")
                && !k.ends_with(".qzeros")
                && !k.ends_with(".scales")
                && !k.ends_with(".g_idx")
            {
                t.insert(k, v.to_dtype(DType::F32).unwrap());
            }
        }
    }
    let cfg = ModelConfig::from_dir(dir).unwrap();
    Decoder::new(cfg, VarBuilder::from_tensors(t, DType::F32, &dev)).unwrap()
}

/// A seeded rank-8 adapter on every projection, moving outputs by a good fraction of their
/// scale.
fn adapter(cfg: &ModelConfig) -> LoraAdapter {
    let dev = Device::Cpu;
    let mut modules = HashMap::new();
    let mut seed = 7u64;
    let mut r = |shape: (usize, usize), scale: f32| {
        let v: Vec<f32> = (0..shape.0 * shape.1)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                ((seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
            })
            .collect();
        Tensor::from_vec(v, shape, &dev).unwrap()
    };
    for l in 0..cfg.num_hidden_layers {
        for p in Proj::ALL {
            let (d_in, d_out) = p.dims(cfg);
            let at = r((d_in, 8), (3.0 / d_in as f32).sqrt());
            let b = r((d_out, 8), 0.15);
            modules.insert((l, p), (at, b));
        }
    }
    LoraAdapter::from_modules(modules, 8, 0)
}

/// Logits of each row after its prompt and after each token of `feed` (the same tokens for
/// both models, so errors are measured step by step instead of compounding).
fn teacher_forced(
    model: &Decoder,
    rows: &[(Vec<u32>, Option<&LoraAdapter>)],
    feed: &[u32],
) -> Vec<Vec<Tensor>> {
    let mut caches: Vec<SeqCache> = rows.iter().map(|_| SeqCache::default()).collect();
    let mut out = vec![Vec::new(); rows.len()];
    for step in 0..=feed.len() {
        let toks: Vec<Vec<u32>> = rows
            .iter()
            .map(|(p, _)| match step {
                0 => p.clone(),
                s => vec![feed[s - 1]],
            })
            .collect();
        let mut batch: Vec<Row> = toks
            .iter()
            .zip(caches.iter_mut())
            .zip(rows)
            .map(|((t, cache), (_, a))| Row {
                tokens: t,
                cache,
                adapter: *a,
                vision: None,
            })
            .collect();
        for (o, l) in out.iter_mut().zip(model.forward(&mut batch).unwrap()) {
            o.push(l);
        }
    }
    out
}

fn max_rel(a: &Tensor, b: &Tensor) -> f32 {
    let d = (a - b).unwrap().abs().unwrap().max_all().unwrap();
    let s = b.abs().unwrap().max_all().unwrap();
    d.to_scalar::<f32>().unwrap() / s.to_scalar::<f32>().unwrap()
}

#[test]
fn awq_and_gptq_serve_4_bit_within_bound_of_their_reference() {
    let dev = Device::Cpu;
    for name in ["awq_g32", "awq_g128", "gptq_g64"] {
        let dir = fixture(name);
        // Weights: the repacked blocks against the reference dequantization.
        let raw: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                .unwrap();
        let scheme = mole_formats::quant::scheme(&raw).unwrap().unwrap();
        let files = [dir.join("model.safetensors")];
        let blocks = mole_formats::quant::blocks::load_blocks(&files, scheme, &dev).unwrap();
        let reference =
            candle_core::safetensors::load(dir.join("reference.safetensors"), &dev).unwrap();
        let ckpt = candle_core::safetensors::load(dir.join("model.safetensors"), &dev).unwrap();
        assert_eq!(
            blocks.len(),
            reference.len(),
            "{name}: every projection repacked"
        );
        for (k, want) in &reference {
            let q = &blocks[k];
            assert_eq!(q.dtype(), candle_core::quantized::GgmlDType::Q4_1);
            let got = q.dequantize(&dev).unwrap();
            let want = want.to_dtype(DType::F32).unwrap();
            let err: f32 = (&got - &want)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar()
                .unwrap();
            let module = k.strip_suffix(".weight").unwrap();
            let s_max: f32 = ckpt[&format!("{module}.scales")]
                .to_dtype(DType::F32)
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar()
                .unwrap();
            assert!(
                err <= 30.0 / 2048.0 * s_max,
                "{name} {k}: {err} over 2^-11·30·{s_max}"
            );
        }

        let mut quant = Decoder::load(&dir, DType::F32, &dev).unwrap();
        let held = quant.weight_bytes();
        let mut dense = reference_decoder(&dir);
        assert!(
            quant.quantization().unwrap().contains(scheme.format.name()),
            "{:?}",
            quant.quantization()
        );
        // Projections as 4-bit blocks: 20 bytes per 32 weights against 128 in f32.
        let proj_params: u64 = reference.values().map(|t| t.elem_count() as u64).sum();
        assert!(
            held < dense.weight_bytes() - proj_params * 4 + proj_params * 20 / 32 + 1,
            "{name}: {held} bytes held"
        );
        let a = adapter(quant.config());
        let (pa, pb) = (
            vec![5u32, 17, 99, 3, 250, 42, 7, 7, 128, 64, 33, 1],
            vec![200u32, 11, 90, 4, 4, 180, 2],
        );
        let feed: Vec<u32> = (0..6).map(|i| (31 + 37 * i) % 256).collect();
        for host in [true, false] {
            quant.configure(mole_model::BackendKind::host_if(host), Default::default());
            dense.configure(mole_model::BackendKind::host_if(host), Default::default());
            let batched = vec![
                (pa.clone(), None),
                (pa.clone(), Some(&a)),
                (pb.clone(), Some(&a)),
            ];
            let want = teacher_forced(&dense, &batched, &feed);
            let got = teacher_forced(&quant, &batched, &feed);
            let mut worst = 0f32;
            for (w, g) in want.iter().zip(&got) {
                for (x, y) in g.iter().zip(w) {
                    worst = worst.max(max_rel(x, y));
                }
            }
            // Alone: each row in a batch of its own gives its batched logits' reference too.
            for (i, row) in batched.iter().enumerate() {
                let alone = teacher_forced(&quant, std::slice::from_ref(row), &feed);
                for (x, y) in alone[0].iter().zip(&want[i]) {
                    worst = worst.max(max_rel(x, y));
                }
            }
            let lora_effect = max_rel(&want[1][0], &want[0][0]);
            eprintln!(
                "{name} host={host}: logits within {:.2}% of scale (bound {:.0}%), the adapter \
                 moves them {:.0}%, weights held {held} bytes",
                worst * 100.0,
                TOL * 100.0,
                lora_effect * 100.0
            );
            assert!(worst < TOL, "{name} host={host}: {worst}");
            assert!(
                lora_effect > 4.0 * TOL,
                "{name}: adapter effect {lora_effect}"
            );
        }
    }
}

#[test]
fn a_served_checkpoint_starts_an_engine() {
    let e = Engine::load(
        &ModelSource::hf(fixture("awq_g128"), DType::F32),
        &Device::Cpu,
        EngineOptions::default(),
    )
    .unwrap();
    use mole_engine::api::EngineInfo;
    let held = e.stats().weights_bytes.unwrap();
    // Per layer q, k, v, o, gate, up, down: 147,456 weights held as 4-bit blocks (20 bytes per
    // 32), not widened (4 bytes each); the embedding and the head in f32; norms and slack 8 KiB.
    let proj: u64 = 2 * (128 * 128 + 2 * 64 * 128 + 128 * 128 + 3 * 128 * 256);
    let bound = proj * 20 / 32 + 2 * 256 * 128 * 4 + 8 * 1024;
    assert!(held <= bound, "{held} bytes held, bound {bound}");
    assert!(
        held > bound - 16 * 1024,
        "{held} bytes held: the projections missing?"
    );
}

/// A PEFT LoRA adapter for the quantized fixtures' shapes (hidden 128, MLP 256, 2 layers), of
/// rank 8 on the `targets` projections, with seeded weights moving outputs by a good fraction
/// of their scale; written as PEFT saves one.
fn peft_adapter(dir: &Path, targets: &[&str]) {
    let dev = Device::Cpu;
    std::fs::create_dir_all(dir).unwrap();
    let config = serde_json::json!({
        "peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": targets,
        "base_model_name_or_path": "quant-fixture", "fan_in_fan_out": false, "bias": "none",
        "use_rslora": false, "use_dora": false, "task_type": "CAUSAL_LM"
    });
    std::fs::write(dir.join("adapter_config.json"), config.to_string()).unwrap();
    let dims = |p: &str| match p {
        "q_proj" | "o_proj" => (128, 128),
        "k_proj" | "v_proj" => (128, 64),
        "gate_proj" | "up_proj" => (128, 256),
        _ => (256, 128),
    };
    let mut t = HashMap::new();
    let mut seed = 11u64;
    let mut r = |n: usize, scale: f32| {
        (0..n)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                ((seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
            })
            .collect::<Vec<f32>>()
    };
    for l in 0..2 {
        for p in targets {
            let family =
                if p.ends_with("gate_proj") || p.ends_with("up_proj") || p.ends_with("down_proj") {
                    "mlp"
                } else {
                    "self_attn"
                };
            let (d_in, d_out) = dims(p);
            let key = format!("base_model.model.model.layers.{l}.{family}.{p}");
            let a =
                Tensor::from_vec(r(8 * d_in, (3.0 / d_in as f32).sqrt()), (8, d_in), &dev).unwrap();
            let b = Tensor::from_vec(r(d_out * 8, 0.05), (d_out, 8), &dev).unwrap();
            t.insert(format!("{key}.lora_A.weight"), a);
            t.insert(format!("{key}.lora_B.weight"), b);
        }
    }
    candle_core::safetensors::save(&t, dir.join("adapter_model.safetensors")).unwrap();
}

fn merge_opts(base: PathBuf, adapter: PathBuf, out: PathBuf) -> mole_tools::merge::MergeOptions {
    mole_tools::merge::MergeOptions {
        base,
        adapter,
        out,
        safe_merge: true,
        dtype: Some(mole_tools::merge::OutDtype::F32),
        root: None,
        expect_base: None,
        max_rank: 64,
        adapter_name: None,
        adapter_version: None,
    }
}

/// A quantized variant mole cannot serve is not merged onto either, naming why.
#[test]
fn merging_onto_an_unsupported_quantized_base_is_refused_naming_why() {
    let tmp = tempfile::tempdir().unwrap();
    let base = edited("gptq_g64", |q| q["desc_act"] = true.into());
    peft_adapter(&tmp.path().join("lora"), &["q_proj", "v_proj"]);
    let err = mole_tools::merge::merge(&merge_opts(
        base.path().to_path_buf(),
        tmp.path().join("lora"),
        tmp.path().join("out"),
    ))
    .unwrap_err();
    assert_eq!(err.code(), "quantized_base", "{err}");
    assert!(err.to_string().contains("act-order"), "{err}");
    assert!(!tmp.path().join("out").exists());
}

/// The dense twin of quantized fixture `name`: its unquantized tensors and the reference
/// dequantization of its projections (what transformers serves), without
/// `quantization_config`.
fn dense_twin(name: &str) -> tempfile::TempDir {
    let dir = fixture(name);
    let tmp = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(&dir).unwrap() {
        let e = e.unwrap();
        let f = e.file_name().to_string_lossy().to_string();
        if f.ends_with(".json") {
            std::fs::copy(e.path(), tmp.path().join(&f)).unwrap();
        }
    }
    let cfg_path = tmp.path().join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg.as_object_mut().unwrap().remove("quantization_config");
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let dev = Device::Cpu;
    let mut t = HashMap::new();
    for file in ["model.safetensors", "reference.safetensors"] {
        for (k, v) in candle_core::safetensors::load(dir.join(file), &dev).unwrap() {
            if [".qweight", ".qzeros", ".scales", ".g_idx"]
                .iter()
                .all(|s| !k.ends_with(s))
            {
                t.insert(k, v);
            }
        }
    }
    candle_core::safetensors::save(&t, tmp.path().join("model.safetensors")).unwrap();
    tmp
}

/// Merging onto an AWQ or GPTQ base dequantizes the modules the adapter touches, `(q - z)·s`
/// in f32 (exact: |q - z| ≤ 15 and an f16 scale need at most 15 significant bits), adds the
/// update, and writes them dense; untouched projections stay packed, byte for byte, and
/// `quantization_config.modules_to_not_convert` names the dense ones.
///
/// Reference: mole's dense merge (checked against PEFT by tests/merge_reference.rs) of the
/// same adapter onto the fixture's dense twin, whose projections are the fp16 reference
/// dequantization. The only difference allowed is that fp16 rounding, at most 2⁻¹¹ of a
/// weight (half an f16 ulp; 2⁻²⁵ for subnormals), plus f32 rounding of the sum (2⁻²³ of it).
/// Served, the merged model's logits equal the dense merge's within the Q4_1 bound (TOL) of
/// the projections still packed.
#[test]
fn merging_onto_awq_and_gptq_dequantizes_the_touched_modules_exactly() {
    let dev = Device::Cpu;
    for name in ["awq_g32", "gptq_g64"] {
        let twin = dense_twin(name);
        let all = [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ];
        for (adapter, targets, touched) in [("all", &all[..], 14usize), ("q", &all[..1], 2)] {
            let tmp = tempfile::tempdir().unwrap();
            let (out_q, out_d) = (tmp.path().join("q"), tmp.path().join("d"));
            let lora = tmp.path().join("lora");
            peft_adapter(&lora, targets);
            let report =
                mole_tools::merge::merge(&merge_opts(fixture(name), lora.clone(), out_q.clone()))
                    .unwrap_or_else(|e| panic!("{name} + {adapter}: {} {e}", e.code()));
            assert_eq!(
                report.metadata.dequantized_modules, touched,
                "{name} + {adapter}"
            );
            mole_tools::merge::merge(&merge_opts(twin.path().to_path_buf(), lora, out_d.clone()))
                .unwrap();

            let got =
                candle_core::safetensors::load(out_q.join("model.safetensors"), &dev).unwrap();
            let want =
                candle_core::safetensors::load(out_d.join("model.safetensors"), &dev).unwrap();
            let base =
                candle_core::safetensors::load(fixture(name).join("model.safetensors"), &dev)
                    .unwrap();
            let reference =
                candle_core::safetensors::load(fixture(name).join("reference.safetensors"), &dev)
                    .unwrap();
            let cfg: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(out_q.join("config.json")).unwrap())
                    .unwrap();
            let mut dense: Vec<String> = cfg["quantization_config"]["modules_to_not_convert"]
                .as_array()
                .unwrap_or_else(|| panic!("{name} + {adapter}: {cfg}"))
                .iter()
                .map(|m| m.as_str().unwrap().to_string())
                .collect();
            dense.sort();
            let mut merged_dense = Vec::new();
            for (k, w) in &want {
                let module = k.strip_suffix(".weight").unwrap_or(k);
                match got.get(k) {
                    Some(g) if reference.contains_key(k) => {
                        // A touched projection, now dense.
                        merged_dense.push(module.to_string());
                        let r = reference[k].to_dtype(DType::F32).unwrap();
                        let diff = (g - w).unwrap().abs().unwrap();
                        let bound = ((r.abs().unwrap() * (1.0 / 2048.0)).unwrap()
                            + (w.abs().unwrap() * (1.0 / 4_194_304.0)).unwrap())
                        .unwrap()
                        .affine(1.0, 1.0 / 33_554_432.0)
                        .unwrap();
                        let over: f32 = (diff - bound)
                            .unwrap()
                            .max_all()
                            .unwrap()
                            .to_scalar()
                            .unwrap();
                        assert!(
                            over <= 0.0,
                            "{name} + {adapter} {k}: over the bound by {over}"
                        );
                    }
                    Some(g) => {
                        let same: f32 = (g - w)
                            .unwrap()
                            .abs()
                            .unwrap()
                            .max_all()
                            .unwrap()
                            .to_scalar()
                            .unwrap();
                        assert_eq!(
                            same, 0.0,
                            "{name} + {adapter} {k}: an unquantized tensor changed"
                        );
                    }
                    None => {
                        // Untouched: still packed, every part byte for byte.
                        assert!(reference.contains_key(k), "{name} + {adapter}: {k} missing");
                        for part in ["qweight", "qzeros", "scales"] {
                            let key = format!("{module}.{part}");
                            let (a, b) = (&got[&key], &base[&key]);
                            assert_eq!(a.dtype(), b.dtype(), "{key}");
                            let eq: u8 = a
                                .to_dtype(DType::F32)
                                .unwrap()
                                .eq(&b.to_dtype(DType::F32).unwrap())
                                .unwrap()
                                .min_all()
                                .unwrap()
                                .to_scalar()
                                .unwrap();
                            assert_eq!(eq, 1, "{name} + {adapter}: {key} changed");
                        }
                    }
                }
            }
            merged_dense.sort();
            assert_eq!(merged_dense.len(), touched, "{name} + {adapter}");
            assert_eq!(
                dense, merged_dense,
                "{name} + {adapter}: modules_to_not_convert"
            );

            // Served: the packed rest within the Q4_1 bound of the dense merge.
            let q = Decoder::load(&out_q, DType::F32, &dev).unwrap();
            let d = Decoder::load(&out_d, DType::F32, &dev).unwrap();
            let rows = vec![(vec![5u32, 17, 99, 3, 250, 42, 7, 7], None)];
            let feed: Vec<u32> = (0..4).map(|i| (31 + 37 * i) % 256).collect();
            let (a, b) = (
                teacher_forced(&q, &rows, &feed),
                teacher_forced(&d, &rows, &feed),
            );
            let worst = a[0]
                .iter()
                .zip(&b[0])
                .map(|(x, y)| max_rel(x, y))
                .fold(0f32, f32::max);
            eprintln!(
                "{name} + {adapter}: served logits within {:.3}% of the dense merge",
                worst * 100.0
            );
            assert!(worst < TOL, "{name} + {adapter}: {worst}");
        }
    }
}

/// GGUF files quantized by llama.cpp's own Python package (tests/fixtures/quant/make_gguf.py):
/// one all Q4_1 (mole's kernel), one mixing Q4_0, Q8_0 and Q4_1 per tensor (candle's products
/// and mole's). Their logits equal those of the same decoder on candle's dequantization of the
/// same blocks within the 6% bound above (the 8-bit activations), on both paths, batched and
/// alone, with and without a LoRA adapter; a step's rows share one quantized product per
/// projection (tests/op_count/op_count_quantized.rs counts them).
#[test]
fn gguf_files_written_by_gguf_py_serve_like_their_dequantized_weights() {
    let dev = Device::Cpu;
    for name in ["llama_q4_1.gguf", "llama_mixed.gguf"] {
        let q = mole_formats::gguf::load_quantized(&fixture(name), &dev).unwrap();
        let cfg = ModelConfig::from_json(q.config.clone()).unwrap();
        let reference: HashMap<String, Tensor> = q
            .tensors
            .iter()
            .map(|(k, t)| (k.clone(), t.dequantize(&dev).unwrap()))
            .collect();
        let mut types: Vec<String> = q
            .tensors
            .values()
            .filter(|t| t.rank() == 2)
            .map(|t| format!("{:?}", t.dtype()))
            .collect();
        types.sort();
        types.dedup();
        let mut quant = Decoder::from_quantized(cfg.clone(), q.tensors, &dev).unwrap();
        let mut dense = Decoder::new(
            cfg.clone(),
            VarBuilder::from_tensors(reference, DType::F32, &dev),
        )
        .unwrap();
        let a = adapter(&cfg);
        let (pa, pb) = (
            vec![5u32, 17, 99, 3, 250, 42, 7, 7, 128, 64, 33, 1],
            vec![200u32, 11, 90, 4, 4, 180, 2],
        );
        let feed: Vec<u32> = (0..6).map(|i| (31 + 37 * i) % 256).collect();
        for host in [true, false] {
            quant.configure(mole_model::BackendKind::host_if(host), Default::default());
            dense.configure(mole_model::BackendKind::host_if(host), Default::default());
            let batched = vec![
                (pa.clone(), None),
                (pa.clone(), Some(&a)),
                (pb.clone(), Some(&a)),
            ];
            let want = teacher_forced(&dense, &batched, &feed);
            let got = teacher_forced(&quant, &batched, &feed);
            let mut worst = 0f32;
            for (w, g) in want.iter().zip(&got) {
                for (x, y) in g.iter().zip(w) {
                    worst = worst.max(max_rel(x, y));
                }
            }
            for (i, row) in batched.iter().enumerate() {
                let alone = teacher_forced(&quant, std::slice::from_ref(row), &feed);
                for (x, y) in alone[0].iter().zip(&want[i]) {
                    worst = worst.max(max_rel(x, y));
                }
            }
            let lora_effect = max_rel(&want[1][0], &want[0][0]);
            eprintln!(
                "{name} ({}) host={host}: logits within {:.2}% of scale (bound {:.0}%), the \
                 adapter moves them {:.0}%",
                types.join("+"),
                worst * 100.0,
                TOL * 100.0,
                lora_effect * 100.0
            );
            assert!(worst < TOL, "{name} host={host}: {worst}");
            assert!(
                lora_effect > 4.0 * TOL,
                "{name}: adapter effect {lora_effect}"
            );
        }
    }
}

/// The k-quants (blocks of 256, which gguf-py does not quantize: candle's quantizer, which
/// follows llama.cpp's) on a Llama whose rows are multiples of 256: the same bound on both
/// paths, batched and alone, with and without an adapter. Their products are candle's.
#[test]
fn k_quant_bases_serve_like_their_dequantized_weights_on_both_paths() {
    use candle_core::quantized::{GgmlDType, QTensor};
    let dev = Device::Cpu;
    let cfg = ModelConfig::from_json(serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "vocab_size": 256, "max_position_embeddings": 128, "tie_word_embeddings": false,
    }))
    .unwrap();
    let mut seed = 11u64;
    let mut r = |shape: (usize, usize), scale: f32| {
        let v: Vec<f32> = (0..shape.0 * shape.1)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                ((seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
            })
            .collect();
        Tensor::from_vec(v, shape, &dev).unwrap()
    };
    let mut dense_w: HashMap<String, Tensor> = HashMap::new();
    dense_w.insert("model.embed_tokens.weight".into(), r((256, 256), 1.0));
    dense_w.insert(
        "lm_head.weight".into(),
        r((256, 256), (3.0f32 / 256.0).sqrt()),
    );
    let ones = |r: Tensor| (r.squeeze(0).unwrap() + 1.0).unwrap();
    dense_w.insert("model.norm.weight".into(), ones(r((1, 256), 0.1)));
    for l in 0..2 {
        let p = format!("model.layers.{l}");
        for n in ["input_layernorm", "post_attention_layernorm"] {
            dense_w.insert(format!("{p}.{n}.weight"), ones(r((1, 256), 0.1)));
        }
        for proj in Proj::ALL {
            let (d_in, d_out) = proj.dims(&cfg);
            let name = match proj {
                Proj::Q => "self_attn.q_proj",
                Proj::K => "self_attn.k_proj",
                Proj::V => "self_attn.v_proj",
                Proj::O => "self_attn.o_proj",
                Proj::Gate => "mlp.gate_proj",
                Proj::Up => "mlp.up_proj",
                Proj::Down => "mlp.down_proj",
            };
            let w = r((d_out, d_in), (3.0 / d_in as f32).sqrt());
            dense_w.insert(format!("{p}.{name}.weight"), w);
        }
    }
    let a = adapter(&cfg);
    let (pa, pb) = (vec![5u32, 17, 99, 3, 250, 42, 7], vec![200u32, 11, 90, 4]);
    let feed: Vec<u32> = (0..5).map(|i| (31 + 37 * i) % 256).collect();
    for dtype in [GgmlDType::Q4K, GgmlDType::Q5K, GgmlDType::Q6K] {
        let q: HashMap<String, QTensor> = dense_w
            .iter()
            .map(|(k, t)| {
                let d = if t.rank() == 2 && k != "model.embed_tokens.weight" {
                    dtype
                } else {
                    GgmlDType::F32
                };
                (k.clone(), QTensor::quantize(t, d).unwrap())
            })
            .collect();
        let reference: HashMap<String, Tensor> = q
            .iter()
            .map(|(k, t)| (k.clone(), t.dequantize(&dev).unwrap()))
            .collect();
        let mut quant = Decoder::from_quantized(cfg.clone(), q, &dev).unwrap();
        let mut dense = Decoder::new(
            cfg.clone(),
            VarBuilder::from_tensors(reference, DType::F32, &dev),
        )
        .unwrap();
        for host in [true, false] {
            quant.configure(mole_model::BackendKind::host_if(host), Default::default());
            dense.configure(mole_model::BackendKind::host_if(host), Default::default());
            let batched = vec![
                (pa.clone(), None),
                (pa.clone(), Some(&a)),
                (pb.clone(), Some(&a)),
            ];
            let want = teacher_forced(&dense, &batched, &feed);
            let got = teacher_forced(&quant, &batched, &feed);
            let mut worst = 0f32;
            for (w, g) in want.iter().zip(&got) {
                for (x, y) in g.iter().zip(w) {
                    worst = worst.max(max_rel(x, y));
                }
            }
            for (i, row) in batched.iter().enumerate() {
                let alone = teacher_forced(&quant, std::slice::from_ref(row), &feed);
                for (x, y) in alone[0].iter().zip(&want[i]) {
                    worst = worst.max(max_rel(x, y));
                }
            }
            let lora_effect = max_rel(&want[1][0], &want[0][0]);
            eprintln!(
                "{dtype:?} host={host}: logits within {:.2}% of scale (bound {:.0}%), the \
                 adapter moves them {:.0}%",
                worst * 100.0,
                TOL * 100.0,
                lora_effect * 100.0
            );
            assert!(worst < TOL, "{dtype:?} host={host}: {worst}");
            assert!(
                lora_effect > 4.0 * TOL,
                "{dtype:?}: adapter effect {lora_effect}"
            );
        }
    }
}

/// `mole-worker serve` on a checkpoint it cannot serve exits 1 and leaves one line,
/// `unsupported_quantization: …` naming the variant, in its termination log: the line the
/// operator turns into the pool's `UnsupportedQuantization` condition
/// (operator/src/controller/pods.rs reads it from the Pod's last termination message).
#[test]
fn serve_leaves_the_refusal_in_the_termination_log() {
    let base = edited("gptq_g64", |q| q["desc_act"] = true.into());
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("worker.yaml");
    std::fs::write(
        &cfg,
        format!(
            "mode: local\npool: q\nmodelRoot: {}\nbaseModel: {{name: tiny, path: ., dtype: f32}}\n\
             adapters: []\nrouter: {{strategies: [explicit], fallback: base}}\n",
            base.path().display()
        ),
    )
    .unwrap();
    let log = tmp.path().join("termination-log");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mole-worker"))
        .args(["serve", "--listen", "127.0.0.1:0"])
        .arg("--config")
        .arg(&cfg)
        .env("MOLE_TERMINATION_LOG", &log)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = std::fs::read_to_string(&log).unwrap();
    assert!(
        line.starts_with("unsupported_quantization: ") && line.contains("act-order"),
        "{line}"
    );
}
