//! mole's decoder against transformers + PEFT on committed tiny random models
//! (tests/fixtures/engine, written by generate.py). Tolerance: last-position logits within 1e-4
//! of the logits' scale in f32 (the only difference left is summation order in matmuls and
//! softmax; measured ~5e-7), and greedy continuations identical. Sequences are batched, each
//! with its own cache and its own adapter (or none).
//!
//! RoPE scaling (`linear`, `dynamic`, `llama3`, `yarn`) is checked on the same weights with the
//! configs of rope_reference.json (generate_rope.py): logits of several generation steps within
//! the same tolerance, greedy continuations identical.
//!
//! On a GPU: `MOLE_TEST_DEVICE=cuda cargo test -p mole-worker --features cuda --test model numerics::`.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test
#![allow(clippy::disallowed_methods)] // tests read results back from the device

use crate::common;

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use mole_engine::lora::{self, LoadOptions};
use mole_model::LoraAdapter;
use mole_model::{argmax, Decoder, LoraKernel, ModelConfig, Row, SeqCache, TensorPathOptions};

/// The device the tests run on (`MOLE_TEST_DEVICE`), where the same tolerances hold: f32
/// matmuls run in full f32 (candle leaves cuBLAS's reduced-precision f32 off).
fn device() -> Device {
    common::test_device()
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/engine")
}

fn reference() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join("reference.json")).unwrap())
        .unwrap()
}

const ADAPTERS: [&str; 3] = ["a_r8_all", "b_r4_qv", "c_r16_mlp"];

/// Runs `rows` (prompt, adapter) as one batch: last logits, then `steps` greedy tokens each.
fn run(
    model: &Decoder,
    rows: &[(Vec<u32>, Option<&LoraAdapter>)],
    steps: usize,
) -> (Vec<Tensor>, Vec<Vec<u32>>) {
    let (mut logits, out) = run_steps(model, rows, steps);
    (logits.iter_mut().map(|l| l.remove(0)).collect(), out)
}

/// As [`run`], with every step's logits (step 0: the last prompt position).
fn run_steps(
    model: &Decoder,
    rows: &[(Vec<u32>, Option<&LoraAdapter>)],
    steps: usize,
) -> (Vec<Vec<Tensor>>, Vec<Vec<u32>>) {
    let mut caches = (0..rows.len())
        .map(|_| SeqCache::default())
        .collect::<Vec<_>>();
    let fwd = |toks: &[Vec<u32>], caches: &mut [SeqCache]| -> Vec<Tensor> {
        let mut batch: Vec<Row> = toks
            .iter()
            .zip(caches.iter_mut())
            .zip(rows)
            .map(|((t, cache), (_, adapter))| Row {
                tokens: t,
                cache,
                adapter: *adapter,
                vision: None,
            })
            .collect();
        model.forward(&mut batch).unwrap()
    };
    let prompts: Vec<Vec<u32>> = rows.iter().map(|(p, _)| p.clone()).collect();
    let first = fwd(&prompts, &mut caches);
    let mut next: Vec<u32> = first.iter().map(|l| argmax(l).unwrap()).collect();
    let mut out: Vec<Vec<u32>> = next.iter().map(|t| vec![*t]).collect();
    let mut logits: Vec<Vec<Tensor>> = first.into_iter().map(|l| vec![l]).collect();
    for _ in 1..steps {
        let toks: Vec<Vec<u32>> = next.iter().map(|t| vec![*t]).collect();
        let step = fwd(&toks, &mut caches);
        next = step.iter().map(|l| argmax(l).unwrap()).collect();
        for ((o, t), (all, l)) in out.iter_mut().zip(&next).zip(logits.iter_mut().zip(step)) {
            o.push(*t);
            all.push(l);
        }
    }
    (logits, out)
}

fn close(name: &str, ours: &Tensor, want: &serde_json::Value) {
    let ours: Vec<f32> = ours.to_vec1().unwrap();
    let want: Vec<f32> = serde_json::from_value(want.clone()).unwrap();
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
    let worst = ours
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max)
        / scale;
    eprintln!("{name}: max logit error {worst:.2e} of scale {scale:.3}");
    assert!(worst <= 1e-4, "{name}: relative error {worst}");
}

fn load(name: &str) -> (Decoder, Vec<LoraAdapter>) {
    load_with(name, DType::F32)
}

/// The f32 model with its adapters held in `lora_dtype`.
fn load_with(name: &str, lora_dtype: DType) -> (Decoder, Vec<LoraAdapter>) {
    let model = Decoder::load(&fixtures().join(name), DType::F32, &device()).unwrap();
    let opts = LoadOptions {
        max_rank: 64,
        expect_base: None,
    };
    let adapters = ADAPTERS
        .iter()
        .map(|a| {
            lora::load(
                &fixtures().join("adapters").join(name).join(a),
                model.config(),
                lora_dtype,
                &device(),
                &opts,
            )
            .unwrap()
        })
        .collect();
    (model, adapters)
}

fn check_family(name: &str) {
    let (mut model, adapters) = load(name);
    // The fused host kernels (CPU f32's default) and the tensor ops GPUs run; a GPU runs
    // only the latter. The tensor path twice: with the grouped LoRA ops (the default) and
    // with the BGMV kernels (`--lora-kernel bgmv`; on the CPU their reference arithmetic,
    // on a GPU the CUDA kernels) for its decode steps, at the same tolerance: in f32 both
    // differ from transformers by summation order only.
    let modes: &[(bool, LoraKernel)] = if device().is_cpu() {
        &[
            (true, LoraKernel::Ops),
            (false, LoraKernel::Ops),
            (false, LoraKernel::Bgmv),
        ]
    } else {
        &[(false, LoraKernel::Ops), (false, LoraKernel::Bgmv)]
    };
    for &(host, kernel) in modes {
        model.configure(
            mole_model::BackendKind::host_if(host),
            TensorPathOptions {
                lora_kernel: kernel,
                ..Default::default()
            },
        );
        let label = match (host, kernel) {
            (true, _) => format!("{name} (host kernels)"),
            (false, k) => format!("{name} (tensor ops, LoRA {k})"),
        };
        check_family_on(&label, name, &model, &adapters);
    }
}

fn check_family_on(label: &str, name: &str, model: &Decoder, adapters: &[LoraAdapter]) {
    let r = &reference()[name];
    let p: Vec<Vec<u32>> = serde_json::from_value(r["prompts"].clone()).unwrap();

    // Base model, two sequences in one batch.
    let (logits, greedy) = run(model, &[(p[0].clone(), None), (p[1].clone(), None)], 32);
    for i in 0..2 {
        close(
            &format!("{label} base prompt {i}"),
            &logits[i],
            &r["last_logits"][i],
        );
        let want: Vec<u32> = serde_json::from_value(r["greedy"][i].clone()).unwrap();
        assert_eq!(greedy[i], want, "{label} base prompt {i}: greedy");
    }

    // A mixed batch: every adapter on each prompt, and rows without adapter, all together.
    let mut rows = Vec::new();
    for (ai, a) in adapters.iter().enumerate() {
        for (pi, prompt) in p.iter().enumerate() {
            rows.push(((ai, pi), (prompt.clone(), Some(a))));
        }
    }
    rows.insert(2, ((usize::MAX, 1), (p[1].clone(), None)));
    let batch: Vec<(Vec<u32>, Option<&LoraAdapter>)> =
        rows.iter().map(|(_, x)| x.clone()).collect();
    let (logits, greedy) = run(model, &batch, 32);
    for (k, ((ai, pi), _)) in rows.iter().enumerate() {
        if *ai == usize::MAX {
            close(
                &format!("{label} mixed batch, no adapter"),
                &logits[k],
                &r["last_logits"][*pi],
            );
            continue;
        }
        let aref = &r["adapters"][ADAPTERS[*ai]];
        close(
            &format!("{label} {} prompt {pi}", ADAPTERS[*ai]),
            &logits[k],
            &aref["last_logits"][*pi],
        );
        let want: Vec<u32> = serde_json::from_value(aref["greedy"][*pi].clone()).unwrap();
        assert_eq!(
            greedy[k], want,
            "{label} {} prompt {pi}: greedy",
            ADAPTERS[*ai]
        );
    }
}

#[test]
fn llama_matches_transformers_and_peft() {
    check_family("llama");
}

#[test]
fn qwen2_with_qkv_bias_matches_transformers_and_peft() {
    check_family("qwen2");
}

#[test]
fn qwen3_with_qk_norm_matches_transformers_and_peft() {
    check_family("qwen3");
}

/// `loraDtype: bf16` on an f32 model: adapters held in bf16, activations and sums in f32 (the
/// host kernels read bf16 exactly; the tensor path widens the weights). Bound: rounding A and
/// s·B to bf16 (8 significant bits, to nearest) moves each weight by at most 2⁻⁸ of itself,
/// so each low-rank update by up to 2 × 2⁻⁸ of its size, and the logits by about that fraction
/// of the adapter's whole effect on them (the difference between the reference logits with and
/// without it), carried through the layers. Allowed: 2⁻⁶ of that effect (4 × 2⁻⁸: twice the
/// update's own rounding, for the layers compounding it), plus the f32 tolerance of the other
/// tests; measured at most 8.6e-3 of it (2.2 × 2⁻⁸, qwen3). Greedy continuations are not
/// compared: these random tiny models have near-flat logits, and a bf16 rounding flips a
/// near-tie (seen on llama). On the CPU the host kernels and the tensor ops, which compute
/// the same sums from the same bf16 weights, agree within the f32 tolerance.
fn check_bf16_adapters(name: &str) {
    let (mut model, adapters) = load_with(name, DType::BF16);
    let r = &reference()[name];
    let p: Vec<Vec<u32>> = serde_json::from_value(r["prompts"].clone()).unwrap();
    let modes: &[bool] = if device().is_cpu() {
        &[true, false]
    } else {
        &[false]
    };
    let vec = |v: &serde_json::Value| -> Vec<f32> { serde_json::from_value(v.clone()).unwrap() };
    let mut per_mode: Vec<Vec<Tensor>> = Vec::new();
    for &host in modes {
        model.configure(mole_model::BackendKind::host_if(host), Default::default());
        let mut rows = Vec::new();
        for (ai, a) in adapters.iter().enumerate() {
            for (pi, prompt) in p.iter().enumerate() {
                rows.push(((ai, pi), (prompt.clone(), Some(a))));
            }
        }
        let batch: Vec<(Vec<u32>, Option<&LoraAdapter>)> =
            rows.iter().map(|(_, x)| x.clone()).collect();
        let (logits, _) = run(&model, &batch, 1);
        for (k, ((ai, pi), _)) in rows.iter().enumerate() {
            let aref = &r["adapters"][ADAPTERS[*ai]];
            let want = vec(&aref["last_logits"][*pi]);
            let base = vec(&r["last_logits"][*pi]);
            let ours: Vec<f32> = logits[k].to_vec1().unwrap();
            let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
            let effect = want
                .iter()
                .zip(&base)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            let worst = ours
                .iter()
                .zip(&want)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            let label = format!(
                "{name} bf16 {} prompt {pi} ({})",
                ADAPTERS[*ai],
                if host { "host kernels" } else { "tensor ops" }
            );
            eprintln!(
                "{label}: max logit error {worst:.2e}, {:.2e} of the adapter's effect {effect:.3}",
                worst / effect
            );
            assert!(
                worst <= effect / 64.0 + 1e-4 * scale,
                "{label}: error {worst} for an adapter effect of {effect}"
            );
        }
        per_mode.push(logits);
    }
    if let [host, tensor] = &per_mode[..] {
        for (k, (h, t)) in host.iter().zip(tensor).enumerate() {
            let t: Vec<f32> = t.to_vec1().unwrap();
            close(
                &format!("{name} bf16 row {k}: host kernels vs tensor ops"),
                h,
                &serde_json::json!(t),
            );
        }
    }
}

#[test]
fn adapters_held_in_bf16_stay_within_their_rounding() {
    for name in ["llama", "qwen2", "qwen3"] {
        check_bf16_adapters(name);
    }
}

/// bf16 and f16 weights on the CPU, as a worker serves such a checkpoint there: held as they
/// are (half the memory, half the bytes a decode step reads) and computed in f32. Reference:
/// the f32 decoder over the same checkpoint rounded to that type (the checks above tie that
/// decoder to transformers). Every bf16 and f16 value widens to f32 exactly, so both compute
/// the same sums of the same values, in the same order on the host kernels: the f32 tolerance
/// (1e-4 of the logits' scale) holds, and greedy continuations are identical. Rows with each adapter
/// and one without share a batch; the adapters are held in f32 and in bf16 (a pool's default
/// over bf16 weights), the same ones on both sides; the host kernels and the tensor ops
/// (prefill's path, which widens each projection per call) are both checked.
#[test]
fn half_weights_compute_as_f32_over_the_rounded_checkpoint() {
    if !device().is_cpu() {
        return; // A GPU computes in the weights' dtype itself.
    }
    let cpu = Device::Cpu;
    let cases = ["llama", "qwen2", "qwen3"].map(|n| [(n, DType::BF16), (n, DType::F16)]);
    for (name, narrow) in cases.into_iter().flatten() {
        let dir = fixtures().join(name);
        let mut held = Decoder::load(&dir, narrow, &cpu).unwrap();
        assert_eq!((held.weight_dtype(), held.dtype()), (narrow, DType::F32));
        // The cache in f32 as the reference's: a half-type cache (the default over half
        // weights) rounds keys and values too, bounded on its own in `model::decoder`.
        assert_eq!(
            held.kv_dtype(),
            narrow,
            "the cache follows the weights by default"
        );
        held.configure(
            mole_model::BackendKind::Host,
            TensorPathOptions {
                kv_dtype: Some(DType::F32),
                ..Default::default()
            },
        );
        let round = |t: Tensor| t.to_dtype(narrow)?.to_dtype(DType::F32);
        let rounded = candle_core::safetensors::load(dir.join("model.safetensors"), &cpu)
            .unwrap()
            .into_iter()
            .map(|(k, t)| (k, round(t).unwrap()))
            .collect();
        let cfg = ModelConfig::from_dir(&dir).unwrap();
        let mut want =
            Decoder::new(cfg, VarBuilder::from_tensors(rounded, DType::F32, &cpu)).unwrap();
        let p: Vec<Vec<u32>> =
            serde_json::from_value(reference()[name]["prompts"].clone()).unwrap();
        for lora in [DType::F32, DType::BF16] {
            let (_, adapters) = load_with(name, lora);
            let mut batch: Vec<(Vec<u32>, Option<&LoraAdapter>)> = adapters
                .iter()
                .flat_map(|a| p.iter().map(move |q| (q.clone(), Some(a))))
                .collect();
            batch.push((p[1].clone(), None));
            for host in [true, false] {
                held.configure(
                    mole_model::BackendKind::host_if(host),
                    held.tensor_path().clone(),
                );
                want.configure(mole_model::BackendKind::host_if(host), Default::default());
                let (ours, ours_greedy) = run(&held, &batch, 8);
                let (theirs, their_greedy) = run(&want, &batch, 8);
                for (k, (o, t)) in ours.iter().zip(&theirs).enumerate() {
                    let label = format!(
                        "{name} {narrow:?} weights, {lora:?} adapters, row {k} (host kernels {host})"
                    );
                    let t: Vec<f32> = t.to_vec1().unwrap();
                    close(&label, o, &serde_json::json!(t));
                    assert_eq!(ours_greedy[k], their_greedy[k], "{label}: greedy");
                }
            }
        }
    }
}

/// Adapters held in f16 (`loraDtype: f16`) are not read by the host kernels: a decode batch
/// with them takes the tensor ops for its projections even with the host kernels on. Both
/// modes then compute the same updates, so they agree at the f32 tolerance; an adapter
/// dropped on the host path would move the logits by its whole effect.
#[test]
fn adapters_held_in_f16_fall_back_to_tensor_ops() {
    if !device().is_cpu() {
        return;
    }
    let (mut model, adapters) = load_with("qwen3", DType::F16);
    let p: Vec<Vec<u32>> = serde_json::from_value(reference()["qwen3"]["prompts"].clone()).unwrap();
    let batch: Vec<(Vec<u32>, Option<&LoraAdapter>)> = adapters
        .iter()
        .map(|a| (p[0].clone(), Some(a)))
        .chain([(p[1].clone(), None)])
        .collect();
    let mut per_mode = Vec::new();
    for host in [true, false] {
        model.configure(mole_model::BackendKind::host_if(host), Default::default());
        per_mode.push(run(&model, &batch, 4));
    }
    let ((host, host_greedy), (tensor, tensor_greedy)) = (&per_mode[0], &per_mode[1]);
    for (k, (h, t)) in host.iter().zip(tensor).enumerate() {
        let t: Vec<f32> = t.to_vec1().unwrap();
        close(
            &format!("qwen3 f16 adapters row {k}: host vs tensor"),
            h,
            &serde_json::json!(t),
        );
        assert_eq!(host_greedy[k], tensor_greedy[k], "row {k}: greedy");
    }
}

#[test]
fn adapters_are_validated_against_the_model() {
    let model = Decoder::load(&fixtures().join("qwen3"), DType::F32, &device()).unwrap();
    let dir = fixtures().join("adapters/qwen3/a_r8_all");
    let strict = LoadOptions {
        max_rank: 4,
        expect_base: None,
    };
    let e = lora::load(&dir, model.config(), DType::F32, &device(), &strict).unwrap_err();
    assert_eq!(e.code(), "rank_over_limit");
    let other = LoadOptions {
        max_rank: 64,
        expect_base: Some("someone/else".into()),
    };
    // Compatibility is by shapes: another base name (a local training path, a renamed copy)
    // loads, with a warning the listing shows.
    let a = lora::load(&dir, model.config(), DType::F32, &device(), &other).unwrap();
    assert!(a.warning.as_deref().unwrap().contains("someone/else"));
    let same = LoadOptions {
        max_rank: 64,
        expect_base: Some("/data/checkpoints/QWEN3".into()),
    };
    let a = lora::load(&dir, model.config(), DType::F32, &device(), &same).unwrap();
    assert_eq!(a.warning, None, "the same last segment is the same model");
    // A llama adapter on the qwen3 model: shapes agree here, but a merge-tool fixture for a
    // smaller model does not fit.
    let small =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/merge/adapters/plain_r8");
    let e = lora::load(
        &small,
        model.config(),
        DType::F32,
        &device(),
        &LoadOptions {
            max_rank: 64,
            expect_base: None,
        },
    )
    .unwrap_err();
    assert_eq!(e.code(), "shape_mismatch", "{e}");
    let nan =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/merge/adapters/bad_nan");
    let e = lora::load(
        &nan,
        model.config(),
        DType::F32,
        &device(),
        &LoadOptions {
            max_rank: 64,
            expect_base: None,
        },
    )
    .unwrap_err();
    assert!(
        matches!(e.code(), "non_finite_weights" | "shape_mismatch"),
        "{e}"
    );
    let lm_head =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/merge/adapters/save_lm_head");
    let e = lora::load(
        &lm_head,
        model.config(),
        DType::F32,
        &device(),
        &LoadOptions {
            max_rank: 64,
            expect_base: None,
        },
    )
    .unwrap_err();
    assert_eq!(e.code(), "unsupported_adapter");
}

/// Each RoPE variant on the weights of its family's tiny model, both prompts in one batch
/// (each row rotates with its own positions: under dynamic NTK the long prompt is past the
/// original window from the start while the short one crosses it while decoding).
#[test]
fn rope_scaling_matches_transformers() {
    let refs: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("rope_reference.json")).unwrap(),
    )
    .unwrap();
    let refs = refs.as_object().unwrap();
    assert_eq!(
        refs.len(),
        5,
        "linear, dynamic, llama3 and two yarn variants"
    );
    for (name, r) in refs {
        let cfg =
            ModelConfig::from_json(r["config"].clone()).unwrap_or_else(|e| panic!("{name}: {e}"));
        let weights = fixtures()
            .join(r["family"].as_str().unwrap())
            .join("model.safetensors");
        // SAFETY: committed fixture, read-only.
        let vb = unsafe {
            VarBuilder::from_mmaped_safetensors(&[weights], DType::F32, &device()).unwrap()
        };
        let model = Decoder::new(cfg, vb).unwrap();
        let prompts: Vec<Vec<u32>> = serde_json::from_value(r["prompts"].clone()).unwrap();
        let steps: Vec<usize> = serde_json::from_value(r["steps"].clone()).unwrap();
        let rows: Vec<(Vec<u32>, Option<&LoraAdapter>)> =
            prompts.iter().map(|p| (p.clone(), None)).collect();
        let want_len = r["greedy"][0].as_array().unwrap().len();
        let (logits, greedy) = run_steps(&model, &rows, want_len);
        for (pi, (got_logits, got)) in logits.iter().zip(&greedy).enumerate() {
            for (si, step) in steps.iter().enumerate() {
                close(
                    &format!("{name} prompt {pi} step {step}"),
                    &got_logits[*step],
                    &r["step_logits"][pi][si],
                );
            }
            let want: Vec<u32> = serde_json::from_value(r["greedy"][pi].clone()).unwrap();
            assert_eq!(got, &want, "{name} prompt {pi}: greedy");
        }
    }
}

/// RoPE types mole does not implement are refused when the model loads, naming the type.
#[test]
fn unknown_rope_types_are_refused_by_name() {
    let mut cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("llama/config.json")).unwrap(),
    )
    .unwrap();
    cfg["rope_scaling"] = serde_json::json!({"rope_type": "longrope", "factor": 2.0,
        "short_factor": [1.0], "long_factor": [1.0]});
    let e = ModelConfig::from_json(cfg.clone()).unwrap_err();
    assert_eq!(e.code(), "model_config");
    assert!(
        e.to_string()
            .contains("rope type \"longrope\" is not supported"),
        "{e}"
    );
    cfg.as_object_mut().unwrap().remove("rope_scaling");
    cfg["rope_parameters"] = serde_json::json!({"rope_type": "fancy", "rope_theta": 10000.0});
    let e = ModelConfig::from_json(cfg).unwrap_err();
    assert!(e.to_string().contains("\"fancy\""), "{e}");
}

/// The tensor path as a GPU runs it, on one ragged batch: 16 distinct adapters (the fixture's
/// three, loaded several times over, each copy its own LoRA slot) and two base rows, prompts of
/// eleven lengths, 90 greedy steps over KV blocks of 4 tokens (so every row crosses many block
/// boundaries), and at step 40 two rows preempted: their caches dropped and recomputed from
/// prompt and output inside the next batched step, beside rows that only decode. From step 60
/// only four adapter rows go on, whose slots (1, 6, 10, 16) are too spread to read as one
/// range: the steps before read the slots in place, those after gather them. Every row's
/// logits stay within the f32 tolerance of the same row run alone on the host kernels (tied to
/// transformers by the tests above) and its greedy tokens are identical; rows on the
/// fixture's full prompts also continue exactly as transformers + PEFT did. All of it twice:
/// LoRA by the grouped ops, then by the BGMV kernels (`--lora-kernel bgmv`) for the decode
/// steps (on the CPU their reference arithmetic).
#[test]
fn a_ragged_batch_of_16_adapters_on_the_paged_path_equals_each_row_alone() {
    if !device().is_cpu() {
        return; // The reference rows run on the host kernels.
    }
    let (mut model, _) = load("llama");
    let r = &reference()["llama"];
    let p: Vec<Vec<u32>> = serde_json::from_value(r["prompts"].clone()).unwrap();
    let opts = LoadOptions {
        max_rank: 64,
        expect_base: None,
    };
    // 16 distinct adapter instances: a_r8_all ×6, b_r4_qv ×5, c_r16_mlp ×5.
    let adapters: Vec<(usize, LoraAdapter)> = (0..16)
        .map(|k| {
            let ai = [0, 1, 2][k % 3];
            let dir = fixtures().join("adapters/llama").join(ADAPTERS[ai]);
            (
                ai,
                lora::load(&dir, model.config(), DType::F32, &device(), &opts).unwrap(),
            )
        })
        .collect();
    // Rows: (prompt, adapter). Prompts are the two fixture prompts and cuts of them.
    let mut rows: Vec<(Vec<u32>, Option<usize>)> = (0..16)
        .map(|k| {
            let full = &p[k % 2];
            let len = if k < 4 {
                full.len()
            } else {
                2 + k % full.len()
            };
            (full[..len.min(full.len())].to_vec(), Some(k))
        })
        .collect();
    rows.insert(3, (p[0].clone(), None));
    rows.insert(9, (p[1][..4].to_vec(), None));
    let steps = 90;

    // Each row alone on the host kernels: the reference.
    model.configure(mole_model::BackendKind::Host, Default::default());
    let alone: Vec<(Vec<Tensor>, Vec<u32>)> = rows
        .iter()
        .map(|(prompt, a)| {
            let a = a.map(|k| &adapters[k].1);
            let (mut l, mut t) = run_steps(&model, &[(prompt.clone(), a)], steps);
            (l.remove(0), t.remove(0))
        })
        .collect();

    // All rows in one batch on the paged path, with small blocks: with the grouped LoRA ops,
    // then with the BGMV kernels for the decode steps (the prefills of more than
    // `bgmv::MAX_TOKENS` tokens keep the grouped ops).
    for kernel in [LoraKernel::Ops, LoraKernel::Bgmv] {
        model.configure(
            mole_model::BackendKind::Paged,
            TensorPathOptions {
                block_size: 4,
                kv_blocks: 1024,
                lora_slots: 16,
                lora_rank: 16,
                kv_dtype: None,
                lora_kernel: kernel,
            },
        );
        let mut caches: Vec<SeqCache> = rows.iter().map(|_| SeqCache::default()).collect();
        let mut out: Vec<Vec<u32>> = vec![Vec::new(); rows.len()];
        let mut logits: Vec<Vec<Tensor>> = vec![Vec::new(); rows.len()];
        // Adapter k holds slot k + 1 (slots are taken in the batch's order on first use).
        let goes_on = |a: &Option<usize>, step: usize| {
            step < 60 || a.is_none_or(|k| [0, 5, 9, 15].contains(&k))
        };
        for step in 0..steps {
            if step == 40 {
                for k in [5, 11] {
                    caches[k].clear();
                }
            }
            // A row with nothing cached (a new or preempted sequence) prefills its prompt and what
            // it generated; the others decode their last token.
            let inputs: Vec<Vec<u32>> = rows
                .iter()
                .zip(&caches)
                .zip(&out)
                .map(|(((prompt, _), cache), o)| match cache.is_empty() {
                    true => prompt.iter().chain(o).copied().collect(),
                    false => vec![*o.last().unwrap()],
                })
                .collect();
            let active: Vec<usize> = (0..rows.len())
                .filter(|&k| goes_on(&rows[k].1, step))
                .collect();
            let mut batch: Vec<Row> = inputs
                .iter()
                .zip(caches.iter_mut())
                .zip(&rows)
                .filter(|(_, (_, a))| goes_on(a, step))
                .map(|((t, cache), (_, a))| Row {
                    tokens: t,
                    cache,
                    adapter: a.map(|k| &adapters[k].1),
                    vision: None,
                })
                .collect();
            let step_logits = model.forward(&mut batch).unwrap();
            drop(batch);
            for (&k, l) in active.iter().zip(step_logits) {
                out[k].push(argmax(&l).unwrap());
                logits[k].push(l);
            }
        }
        assert_eq!(out.iter().filter(|o| o.len() == steps).count(), 6);
        assert!(caches.iter().all(|c| c.blocks() >= 2), "rows span blocks");
        for (k, ((prompt, a), (want_logits, want_tokens))) in rows.iter().zip(&alone).enumerate() {
            assert_eq!(
                out[k],
                want_tokens[..out[k].len()],
                "{kernel}: row {k}: greedy tokens"
            );
            for (s, (ours, want)) in logits[k].iter().zip(want_logits).enumerate() {
                let want: Vec<f32> = want.to_vec1().unwrap();
                let err = max_rel_error(ours, &want);
                assert!(
                    err <= 1e-4,
                    "{kernel}: row {k} step {s}: relative error {err}"
                );
            }
            // Rows on a full fixture prompt: transformers' own greedy continuation.
            if let Some(pi) = p.iter().position(|x| x == prompt) {
                let want: Vec<u32> = match a {
                    None => serde_json::from_value(r["greedy"][pi].clone()).unwrap(),
                    Some(i) => serde_json::from_value(
                        r["adapters"][ADAPTERS[adapters[*i].0]]["greedy"][pi].clone(),
                    )
                    .unwrap(),
                };
                assert_eq!(
                    out[k][..want.len()],
                    want[..],
                    "{kernel}: row {k}: transformers' greedy"
                );
            }
        }
    }
}

/// The largest difference over the largest magnitude of `want`.
fn max_rel_error(ours: &Tensor, want: &[f32]) -> f32 {
    let ours: Vec<f32> = ours.to_vec1().unwrap();
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
    ours.iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max)
        / scale
}
