//! `mole-worker quantize` (issue 36 item 3): round trip within stated bounds, the drift it
//! measures, serving of its output, its refusals, atomicity and idempotence, and the merge
//! Job's `merge --quantize`.
//!
//! Round-trip bound. A block of n weights quantized with b-bit levels of step Δ moves each
//! weight by at most Δ/2, uniformly, so the relative RMS error of a tensor is about
//! (Δ/σ)/√12. For the uniform weights used here (|w| ≤ √3·σ): symmetric 8-bit blocks
//! (q8_0: Δ = max/127) give ≈ 1.73/127/3.46 = 0.4%; symmetric 4-bit (q4_0: Δ = max/8) 6.3%;
//! 4-bit with a minimum (q4_1, q4_k: Δ = range/15) 6.7%; 5-bit k-quant (Δ = range/31) 3.2%;
//! 6-bit k-quant (Δ = max/32 over blocks of 16) 1.6%. The bounds below are 1.5× those (the
//! f16 scales and the k-quants' 6-bit sub-block scales add their own rounding), and each is
//! below the next coarser type's estimate, so a tensor written in a coarser type than the one
//! asked for fails.
//!
//! Drift bound. The synthetic model's logits have unit scale, so its next-token distributions
//! are peaked; a relative weight error ε moves each logit by about ε·√(layers·projections)
//! of its scale, and KL ≈ Var(Δlogit)/2. For q4 types (ε ≈ 7%, ~9 chained projections) that
//! is ≈ (0.07·3)²/2 ≈ 0.02 nats; the bound is 0.05. q8_0 must drift at least 10× less than
//! q4_0 (ε 16× smaller): a tool that measured nothing, or compared a model with itself,
//! fails that ordering.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test
#![allow(clippy::disallowed_methods)] // tests read results back from the device

use crate::common;

use common::seeded;
use mole_engine::ModelSource;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use mole_tools::quantize::{quantize, QuantType, QuantizeError, QuantizeOptions};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/engine")
}

fn opts(input: &Path, out: &Path, qtype: QuantType) -> QuantizeOptions {
    QuantizeOptions {
        input: input.to_path_buf(),
        out: out.to_path_buf(),
        qtype,
        root: None,
        drift_tokens: 16,
        max_drift: None,
    }
}

/// A Llama whose rows are 256 and 512 wide (k-quant super-blocks are 256) with unit-scale
/// logits, written as an HF directory with the tiny Llama's byte-level tokenizer.
fn synthetic_llama(dir: &Path) {
    let (h, inter, layers, vocab, nh, nkv, hd) = (256, 512, 2, 256, 4, 2, 64);
    std::fs::create_dir_all(dir).unwrap();
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": nh,
        "num_key_value_heads": nkv, "head_dim": hd, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "vocab_size": vocab, "max_position_embeddings": 128, "tie_word_embeddings": false,
        "torch_dtype": "float32",
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixtures().join("llama").join(f), dir.join(f)).unwrap();
    }
    let mut seed = 0u64;
    let mut t = |shape: (usize, usize), scale: f32| {
        seed += 1;
        Tensor::from_vec(seeded(seed, shape.0 * shape.1, scale), shape, &Device::Cpu).unwrap()
    };
    let w = |fan_in: usize| (3.0 / fan_in as f32).sqrt();
    let mut weights = HashMap::new();
    weights.insert("model.embed_tokens.weight".to_string(), t((vocab, h), 1.0));
    weights.insert("lm_head.weight".into(), t((vocab, h), w(h)));
    let norm = |t: Tensor| (t.squeeze(0).unwrap() + 1.0).unwrap();
    weights.insert("model.norm.weight".into(), norm(t((1, h), 0.1)));
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        weights.insert(format!("{p}.input_layernorm.weight"), norm(t((1, h), 0.1)));
        weights.insert(
            format!("{p}.post_attention_layernorm.weight"),
            norm(t((1, h), 0.1)),
        );
        for (name, out, inp) in [
            ("self_attn.q_proj", nh * hd, h),
            ("self_attn.k_proj", nkv * hd, h),
            ("self_attn.v_proj", nkv * hd, h),
            ("self_attn.o_proj", h, nh * hd),
            ("mlp.gate_proj", inter, h),
            ("mlp.up_proj", inter, h),
            ("mlp.down_proj", h, inter),
        ] {
            weights.insert(format!("{p}.{name}.weight"), t((out, inp), w(inp)));
        }
    }
    candle_core::safetensors::save(&weights, dir.join("model.safetensors")).unwrap();
}

fn gguf_tensors(dir: &Path) -> HashMap<String, QTensor> {
    mole_formats::gguf::load_hf_named(&dir.join("model.gguf"), &Device::Cpu).unwrap()
}

fn rel_rms(got: &Tensor, want: &Tensor) -> f32 {
    let d = (got - want).unwrap().sqr().unwrap().sum_all().unwrap();
    let n = want.sqr().unwrap().sum_all().unwrap();
    (d.to_scalar::<f32>().unwrap() / n.to_scalar::<f32>().unwrap()).sqrt()
}

/// The round-trip bound of each type (see the module's documentation).
fn bound(t: GgmlDType) -> f32 {
    match t {
        GgmlDType::Q8_0 => 0.006,
        GgmlDType::Q4_0 => 0.095,
        GgmlDType::Q4_1 | GgmlDType::Q4K | GgmlDType::Q5_0 => 0.10,
        GgmlDType::Q5K | GgmlDType::Q5_1 => 0.048,
        GgmlDType::Q6K => 0.024,
        GgmlDType::F32 => 0.0,
        other => panic!("unexpected type {other:?}"),
    }
}

/// Every tensor of the output: the type llama.cpp's rules give it, blocks byte-identical to
/// candle quantizing the whole tensor at once (the tool splits rows across threads), and a
/// dequantized relative RMS error within its type's bound; norms are kept exactly.
#[test]
fn every_type_round_trips_within_its_bound() {
    let tmp = tempfile::tempdir().unwrap();
    let synth = tmp.path().join("synthetic");
    synthetic_llama(&synth);
    let original: HashMap<String, Tensor> =
        candle_core::safetensors::load(synth.join("model.safetensors"), &Device::Cpu).unwrap();
    for (name, qtype) in QuantType::ALL {
        let out = tmp.path().join(format!("q-{name}"));
        let mut o = opts(&synth, &out, qtype);
        o.drift_tokens = 0;
        let report = quantize(&o).unwrap();
        assert!(report.written);
        let got = gguf_tensors(&out);
        assert_eq!(got.len(), original.len());
        let mut worst = 0f32;
        for (tensor, w) in &original {
            let q = &got[tensor];
            let expected_type = mole_tools::quantize::tensor_type(tensor, w.dims(), qtype, false);
            assert_eq!(q.dtype(), expected_type, "{name} {tensor}");
            if w.rank() == 1 {
                assert_eq!(q.dtype(), GgmlDType::F32, "{tensor}: norms stay f32");
            } else if tensor == "lm_head.weight" && qtype != QuantType::Q8_0 {
                assert_eq!(q.dtype(), GgmlDType::Q6K, "the head is Q6_K, as llama.cpp");
            } else {
                assert_eq!(
                    q.dtype(),
                    qtype.ggml(),
                    "{tensor}: 256-wide rows need no fallback"
                );
            }
            let whole = QTensor::quantize(w, q.dtype()).unwrap();
            assert_eq!(
                &*q.data().unwrap(),
                &*whole.data().unwrap(),
                "{name} {tensor}: blocks differ from candle's"
            );
            let err = rel_rms(&q.dequantize(&Device::Cpu).unwrap(), w);
            assert!(
                err <= bound(q.dtype()),
                "{name} {tensor}: relative RMS error {err} over {}",
                bound(q.dtype())
            );
            if q.dtype() == qtype.ggml() {
                worst = worst.max(err);
            }
        }
        println!(
            "{name}: worst relative RMS error {worst:.4} (bound {})",
            bound(qtype.ggml())
        );
        let m = &report.metadata;
        assert_eq!(m.quant_type, name);
        assert_eq!(m.tensor_types.values().sum::<usize>(), original.len());
        assert_eq!(
            m.output_bytes,
            std::fs::metadata(out.join("model.gguf")).unwrap().len()
        );
        assert!(m.output_bytes < m.source_bytes / 3, "{name}: {m:?}");
    }
}

/// The tiny Llama's rows are 64 wide: k-quants fall back as llama.cpp does (q4_k → q5_0,
/// q5_k → q5_1, q6_k and the head → q8_0), and the output still serves.
#[test]
fn narrow_rows_fall_back_and_still_serve() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("q");
    let report = quantize(&opts(&fixtures().join("llama"), &out, QuantType::Q4K)).unwrap();
    let types = &report.metadata.tensor_types;
    assert_eq!(types.get("Q5_0"), Some(&15), "{types:?}");
    assert_eq!(types.get("Q8_0"), Some(&1), "{types:?}: the head");
    assert_eq!(types.get("F32"), Some(&5), "{types:?}: the norms");
    let got = gguf_tensors(&out);
    let original: HashMap<String, Tensor> =
        candle_core::safetensors::load(fixtures().join("llama/model.safetensors"), &Device::Cpu)
            .unwrap();
    for (name, w) in &original {
        let err = rel_rms(&got[name].dequantize(&Device::Cpu).unwrap(), w);
        assert!(err <= bound(got[name].dtype()), "{name}: {err}");
    }
    mole_formats::hf::check_confined(&out).unwrap();
    assert!(mole_formats::gguf::is_quantized_dir(&out));
}

/// The drift the tool writes: small for every type, q8_0 far below q4_0, the same model's
/// top token at most positions; and measured against the real input (recomputed here from
/// the two directories, it is the same number).
#[test]
fn drift_is_measured_and_ordered_by_precision() {
    let tmp = tempfile::tempdir().unwrap();
    let synth = tmp.path().join("synthetic");
    synthetic_llama(&synth);
    let mut drifts = HashMap::new();
    for (name, qtype) in QuantType::ALL {
        let out = tmp.path().join(format!("q-{name}"));
        let d = quantize(&opts(&synth, &out, qtype))
            .unwrap()
            .metadata
            .drift
            .unwrap();
        println!(
            "{name}: mean KL {:.6} max {:.6} top-1 agreement {:.3} over {} positions",
            d.mean_kl, d.max_kl, d.top1_agreement, d.positions
        );
        assert_eq!(d.prompts, 8);
        assert_eq!(d.positions, 8 * 16);
        assert!(d.mean_kl > 0.0 && d.mean_kl < 0.05, "{name}: {d:?}");
        // Random weights leave near ties between the top tokens: 4-bit blocks flip some.
        let agreement = if qtype == QuantType::Q8_0 { 0.9 } else { 0.5 };
        assert!(d.top1_agreement > agreement, "{name}: {d:?}");
        let again = mole_tools::quantize::measure_drift(&synth, &out, 16).unwrap();
        assert_eq!(again, d, "the drift is recomputed from the directories");
        drifts.insert(name, d.mean_kl);
    }
    assert!(
        drifts["q8_0"] * 10.0 < drifts["q4_0"],
        "8-bit must drift far less than 4-bit: {drifts:?}"
    );
    assert!(drifts["q6_k"] < drifts["q4_k"], "{drifts:?}");
}

/// The worker's engine serves the output (the merged Deployment's path): greedy tokens from
/// the quantized directory equal those of the dense model on most steps of a short answer.
#[test]
fn the_engine_serves_the_quantized_directory() {
    use mole_engine::api::{EngineInfo, Serving};
    use mole_engine::{Engine, EngineOptions};
    let tmp = tempfile::tempdir().unwrap();
    let synth = tmp.path().join("synthetic");
    synthetic_llama(&synth);
    let out = tmp.path().join("q8");
    quantize(&opts(&synth, &out, QuantType::Q8_0)).unwrap();
    let greedy = |e: &Engine| -> Vec<u32> {
        common::tokens(
            e.submit(common::greedy(vec![5, 17, 99, 42], None, 8))
                .unwrap(),
        )
    };
    let q = Engine::load(
        &ModelSource::QuantizedDir(out.to_path_buf()),
        &Device::Cpu,
        EngineOptions::default(),
    )
    .unwrap();
    let dense = Engine::load(
        &ModelSource::hf(&synth, candle_core::DType::F32),
        &Device::Cpu,
        EngineOptions::default(),
    )
    .unwrap();
    let (a, b) = (greedy(&q), greedy(&dense));
    assert_eq!(a.len(), 8);
    assert_eq!(
        a[0], b[0],
        "the first token of an 8-bit model: {a:?} vs {b:?}"
    );
    let held = q.stats().weights_bytes.unwrap();
    let dense_bytes = std::fs::metadata(synth.join("model.safetensors"))
        .unwrap()
        .len();
    assert!(
        held < dense_bytes,
        "held as blocks: {held} of {dense_bytes} bytes"
    );
}

fn leftovers(parent: &Path, name: &str) -> Vec<String> {
    std::fs::read_dir(parent)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .filter(|n| n.starts_with(&format!(".{name}.tmp-")) || n == name)
        .collect()
}

/// A run that fails — here after the whole file was written, on the drift bound — leaves no
/// output and no temporary directory; a killed run's leftovers go with the next run; a bound
/// it meets keeps the output.
#[test]
fn a_failed_run_leaves_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("q");
    let mut o = opts(&fixtures().join("llama"), &out, QuantType::Q4_0);
    o.max_drift = Some(1e-12);
    let e = quantize(&o).unwrap_err();
    assert_eq!(e.code(), "drift_over_bound", "{e}");
    assert_eq!(e.exit_code(), 2);
    assert!(e.to_string().contains("--max-drift"), "{e}");
    assert!(
        leftovers(tmp.path(), "q").is_empty(),
        "{:?}",
        leftovers(tmp.path(), "q")
    );
    // What a killed run leaves (its temporary sibling) is removed by the next run.
    std::fs::create_dir(tmp.path().join(".q.tmp-999999")).unwrap();
    std::fs::write(tmp.path().join(".q.tmp-999999/model.gguf"), b"partial").unwrap();
    o.max_drift = Some(0.5);
    let r = quantize(&o).unwrap();
    assert_eq!(r.metadata.max_drift, Some(0.5));
    assert_eq!(leftovers(tmp.path(), "q"), ["q"]);
}

/// A re-run with the same inputs is a no-op; other inputs into the same output are refused.
#[test]
fn reruns_are_no_ops_and_other_inputs_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("q");
    let o = opts(&fixtures().join("llama"), &out, QuantType::Q8_0);
    let first = quantize(&o).unwrap();
    let again = quantize(&o).unwrap();
    assert!(!again.written);
    assert_eq!(again.metadata, first.metadata);
    let e = quantize(&opts(&fixtures().join("llama"), &out, QuantType::Q4_0)).unwrap_err();
    assert_eq!(e.code(), "output_exists");
}

/// Bad inputs are refused by stable names before anything is written.
#[test]
fn bad_inputs_are_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("q");
    let code = |e: QuantizeError| e.code();
    assert_eq!(
        code(quantize(&opts(&tmp.path().join("missing"), &out, QuantType::Q8_0)).unwrap_err()),
        "invalid_input"
    );
    // A quantized checkpoint of a variant mole cannot read (act-order GPTQ).
    let gptq = tmp.path().join("gptq");
    std::fs::create_dir_all(&gptq).unwrap();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/quant/gptq_g64");
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), gptq.join(e.file_name())).unwrap();
    }
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(gptq.join("config.json")).unwrap()).unwrap();
    cfg["quantization_config"]["desc_act"] = true.into();
    std::fs::write(gptq.join("config.json"), cfg.to_string()).unwrap();
    let e = quantize(&opts(&gptq, &out, QuantType::Q8_0)).unwrap_err();
    assert!(e.to_string().contains("act-order"), "{e}");
    assert_eq!(code(e), "quantized_input");
    // A quantize output is not quantized again.
    let q = tmp.path().join("first");
    quantize(&opts(&fixtures().join("llama"), &q, QuantType::Q8_0)).unwrap();
    let e = quantize(&opts(&q, &out, QuantType::Q4_0)).unwrap_err();
    assert_eq!(code(e), "quantized_input");
    let mut o = opts(&fixtures().join("llama"), &out, QuantType::Q8_0);
    o.drift_tokens = 0;
    o.max_drift = Some(0.1);
    assert_eq!(code(quantize(&o).unwrap_err()), "invalid_input");
    assert_eq!(
        code(QuantType::parse("q2_k").unwrap_err()),
        "unsupported_quant_type"
    );
    assert!(!out.exists());
}

/// The binary: every flag from the environment too, a bad type exits 2 with its name on
/// stderr and in the termination log, a missing input exits 2.
#[test]
fn the_cli_refuses_with_exit_2_and_a_termination_message() {
    let bin = env!("CARGO_BIN_EXE_mole-worker");
    let tmp = tempfile::tempdir().unwrap();
    let log = tmp.path().join("termination-log");
    let run = |envs: &[(&str, &str)]| {
        std::process::Command::new(bin)
            .arg("quantize")
            .env("MOLE_TERMINATION_LOG", &log)
            .envs(envs.iter().copied())
            .output()
            .unwrap()
    };
    let input = fixtures().join("llama");
    let out = tmp.path().join("q");
    let o = run(&[
        ("MOLE_QUANTIZE_IN", input.to_str().unwrap()),
        ("MOLE_QUANTIZE_OUT", out.to_str().unwrap()),
        ("MOLE_QUANTIZE_TYPE", "q3_k"),
    ]);
    assert_eq!(o.status.code(), Some(2));
    let line = std::fs::read_to_string(&log).unwrap();
    assert!(line.contains("unsupported_quant_type"), "{line}");
    let missing = tmp.path().join("nope");
    let o = run(&[
        ("MOLE_QUANTIZE_IN", missing.to_str().unwrap()),
        ("MOLE_QUANTIZE_OUT", out.to_str().unwrap()),
        ("MOLE_QUANTIZE_TYPE", "q8_0"),
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("invalid_input"));
    let o = run(&[
        ("MOLE_QUANTIZE_IN", input.to_str().unwrap()),
        ("MOLE_QUANTIZE_OUT", out.to_str().unwrap()),
        ("MOLE_QUANTIZE_TYPE", "q8_0"),
        ("MOLE_QUANTIZE_NO_FSYNC", "true"),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // No terminal: structured progress lines, not a bar.
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("progress") && err.contains("tensors"), "{err}");
    assert!(out.join("model.gguf").exists());
}

/// The merge Job with `spec.merge.quantize`: `merge --quantize` writes only the quantized
/// model (with the merge's provenance), leaves no dense copy, and a re-run is a no-op.
#[test]
fn merge_then_quantize_writes_the_quantized_merge_only() {
    use mole_tools::merge::MergeOptions;
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("merged");
    let opts = MergeOptions {
        base: fixtures().join("llama"),
        adapter: fixtures().join("adapters/llama/a_r8_all"),
        out: out.clone(),
        safe_merge: true,
        dtype: None,
        root: None,
        expect_base: None,
        max_rank: 64,
        adapter_name: Some("a".into()),
        adapter_version: Some("v1".into()),
    };
    let r =
        mole_tools::merge::cli::merge_then_quantize(&opts, QuantType::Q8_0, Some(0.5), 16).unwrap();
    assert!(r.written);
    assert!(out.join("model.gguf").exists());
    assert!(!out.join("model.safetensors").exists());
    let merged: mole_tools::merge::MergeMetadata =
        serde_json::from_str(&std::fs::read_to_string(out.join("merge_metadata.json")).unwrap())
            .unwrap();
    assert_eq!(
        r.metadata.merge_inputs_sha256.as_deref(),
        Some(merged.inputs_sha256.as_str())
    );
    assert_eq!(
        leftovers(tmp.path(), "merged"),
        ["merged"],
        "no dense copy left"
    );
    let again =
        mole_tools::merge::cli::merge_then_quantize(&opts, QuantType::Q8_0, Some(0.5), 16).unwrap();
    assert!(!again.written);
    for (t, bound, tokens) in [
        (QuantType::Q4_0, Some(0.5), 16),
        (QuantType::Q8_0, None, 16),
        (QuantType::Q8_0, Some(0.5), 8),
    ] {
        let e = mole_tools::merge::cli::merge_then_quantize(&opts, t, bound, tokens).unwrap_err();
        assert_eq!(e.code(), "output_exists", "{t:?} {bound:?} {tokens}");
    }
    // A merge that fails keeps the merge's own name.
    let mut bad = opts.clone();
    bad.out = tmp.path().join("other");
    bad.adapter = tmp.path().join("no-adapter");
    let e =
        mole_tools::merge::cli::merge_then_quantize(&bad, QuantType::Q8_0, None, 16).unwrap_err();
    assert_eq!(e.code(), "io_error");
    assert!(leftovers(tmp.path(), "other").is_empty());
}

/// An AWQ or GPTQ input (a base, or a merge onto one whose touched modules are dense): its
/// packed projections go into the GGUF as the Q4_1 blocks the loader repacks them into (the
/// same bytes, so no second rounding of 4-bit weights), the dense tensors are quantized to the
/// type asked, and the output serves like the checkpoint itself: logits within the q8_0 bound
/// of its embedding and head (0.6% RMS per tensor, see `bound`; 3% of the logits' scale
/// allowed over 2 layers), and its config no longer claims AWQ/GPTQ.
#[test]
fn packed_awq_and_gptq_projections_stay_4_bit_as_q4_1_blocks() {
    use mole_model::{Decoder, Row, SeqCache};
    let dev = Device::Cpu;
    for name in ["awq_g32", "gptq_g64"] {
        let input = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/quant")
            .join(name);
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("q8");
        quantize(&opts(&input, &out, QuantType::Q8_0))
            .unwrap_or_else(|e| panic!("{name}: {} {e}", e.code()));
        let raw: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(input.join("config.json")).unwrap())
                .unwrap();
        let scheme = mole_formats::quant::scheme(&raw).unwrap().unwrap();
        let blocks = mole_formats::quant::blocks::load_blocks(
            &[input.join("model.safetensors")],
            scheme,
            &dev,
        )
        .unwrap();
        let got = gguf_tensors(&out);
        for (k, want) in &blocks {
            let g = &got[k];
            assert_eq!(g.dtype(), GgmlDType::Q4_1, "{name} {k}");
            assert_eq!(
                g.data().unwrap(),
                want.data().unwrap(),
                "{name} {k}: not the loader's blocks"
            );
        }
        let cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap())
                .unwrap();
        assert!(cfg.get("quantization_config").is_none(), "{name}: {cfg}");

        let logits = |d: &Decoder| {
            let mut cache = SeqCache::default();
            let toks = [5u32, 17, 99, 3, 250, 42];
            let mut rows = vec![Row {
                tokens: &toks,
                cache: &mut cache,
                adapter: None,
                vision: None,
            }];
            d.forward(&mut rows).unwrap().remove(0)
        };
        // Both caches in f32: the bound is the repacking's and the q8_0 tables'. A quantized
        // base's default f16 cache adds its own rounding to each side (gptq_g64: 2.44% with
        // f32 caches, 3.11% with both at their f16 default).
        let f32_cache = |mut d: Decoder| {
            d.configure(
                mole_model::BackendKind::Host,
                mole_model::TensorPathOptions {
                    kv_dtype: Some(candle_core::DType::F32),
                    ..Default::default()
                },
            );
            d
        };
        let q = f32_cache(Decoder::load_quantized_dir(&out, &dev).unwrap());
        let base = f32_cache(Decoder::load(&input, candle_core::DType::F32, &dev).unwrap());
        let (a, b) = (logits(&q), logits(&base));
        let d: f32 = (&a - &b)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar()
            .unwrap();
        let s: f32 = b.abs().unwrap().max_all().unwrap().to_scalar().unwrap();
        eprintln!(
            "{name}: logits within {:.2}% of the checkpoint's",
            100.0 * d / s
        );
        assert!(d / s < 0.03, "{name}: {d} of {s}");
    }
}
