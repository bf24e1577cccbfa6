//! Quantized GGUF bases (q4_0, q4_1, q8_0, q4_k, q5_k, q6_k) served with and without a LoRA,
//! batched and alone, on the host path and the tensor path, against the same decoder and engine
//! on the dequantized weights in f32.
//!
//! Each test quantizes a model with candle (`QTensor::quantize`), writes a GGUF file the way
//! llama.cpp lays one out (llama Q/K rows permuted, tokenizer and chat template in the
//! metadata) and serves it through `Engine::load_gguf` (on x86 with AVX2 every one of these
//! types takes mole's own tiled kernel, `kernels::quant`). q4_0, q4_1 and q8_0 (blocks of 32)
//! run on the committed tiny Llama; the k-quants need rows that are multiples of 256, so they
//! run on a synthetic Llama built in the test (hidden 256, MLP 512, seeded weights and adapter).
//!
//! Exact: every tensor read back from the GGUF (renamed, Q/K rows moved back byte-wise)
//! dequantizes bit for bit to the reference weights.
//!
//! Tolerance: the reference has the same weights (dequantized), so the differences left are
//! that the quantized matmul (mole's kernel or candle's), like llama.cpp, rounds each activation
//! row to 8 bits (blocks of 32 for q4_0/q4_1/q8_0, Q8_K blocks of 256 for the k-quants) before
//! the integer dot products, and that the quantized base's KV cache holds f16 (its default, as
//! llama.cpp's), each key and value rounded by at most 2^-11 of itself: a few hundredths of a
//! percent of the logits (see `model::decoder`'s KV test), nothing beside the activations'.
//! Each activation moves by at most 1/254 of its block's largest magnitude; with the block
//! maximum a few times the RMS, a projection's output moves by up to ~1% of its scale. Errors
//! add along the chain of projections a token goes through (q/k/v, o, gate/up, down per layer,
//! then lm_head: 9 chained ~1% steps for 2 layers, RMSNorm keeping them relative), so logits
//! must stay within 6% of their scale (measured 2.1% for q4_0, 1.0% for q4_1, 2.0% for q8_0,
//! 3.8% for q4_k, 2.9% for q5_k and q6_k, printed). The LoRA moves the logits by 70-126% of
//! their scale, so an adapter lost on a quantized base fails. Greedy tokens must be identical
//! until a step where the quantized pick is within twice the tolerance of the reference's best
//! (a near tie that 8-bit activations may break the other way; the gap is checked and
//! printed).

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test
#![allow(clippy::disallowed_methods)] // tests read results back from the device

use crate::common;

use common::{byte_tokens, seeded};
use mole_engine::ModelSource;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use mole_engine::api::*;
use mole_engine::lora::{self, LoadOptions};
use mole_engine::text::TextModel;
use mole_engine::{Engine, EngineOptions};
use mole_model::LoraAdapter;
use mole_model::{Decoder, ModelConfig, Row, SeqCache};

const TOL: f32 = 0.06;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/engine")
}

/// A model to quantize: config.json, f32 weights by HF name, an adapter directory and the
/// base name its adapter_config.json gives.
struct Base {
    config: serde_json::Value,
    weights: HashMap<String, Tensor>,
    adapter: PathBuf,
    name: String,
    _tmp: Option<tempfile::TempDir>,
}

fn tiny_llama() -> Base {
    let dir = fixtures().join("llama");
    Base {
        config: serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
            .unwrap(),
        weights: candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu)
            .unwrap(),
        adapter: fixtures().join("adapters/llama/a_r8_all"),
        name: "llama".into(),
        _tmp: None,
    }
}

/// A Llama whose projections have rows of 256 and 512 (q4_k blocks are 256 wide), with a
/// rank-8 adapter on every projection.
fn synthetic_llama() -> Base {
    let (h, inter, layers, vocab, nh, nkv, hd) = (256, 512, 2, 256, 4, 2, 64);
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": nh,
        "num_key_value_heads": nkv, "head_dim": hd, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "vocab_size": vocab, "max_position_embeddings": 128, "tie_word_embeddings": false,
    });
    let mut seed = 0u64;
    let mut t = |shape: (usize, usize), scale: f32| {
        seed += 1;
        Tensor::from_vec(seeded(seed, shape.0 * shape.1, scale), shape, &Device::Cpu).unwrap()
    };
    // Uniform in ±sqrt(3/fan_in): unit-variance outputs, so attention and logits are peaked.
    let w = |fan_in: usize| (3.0 / fan_in as f32).sqrt();
    let mut weights = HashMap::new();
    weights.insert("model.embed_tokens.weight".into(), t((vocab, h), 1.0));
    weights.insert("lm_head.weight".into(), t((vocab, h), w(h)));
    let norm = |t: Tensor| (t.squeeze(0).unwrap() + 1.0).unwrap();
    weights.insert("model.norm.weight".into(), norm(t((1, h), 0.1)));
    let projs = [
        ("self_attn.q_proj", nh * hd, h),
        ("self_attn.k_proj", nkv * hd, h),
        ("self_attn.v_proj", nkv * hd, h),
        ("self_attn.o_proj", h, nh * hd),
        ("mlp.gate_proj", inter, h),
        ("mlp.up_proj", inter, h),
        ("mlp.down_proj", h, inter),
    ];
    let tmp = tempfile::tempdir().unwrap();
    let mut lora = HashMap::new();
    let r = 8;
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        weights.insert(format!("{p}.input_layernorm.weight"), norm(t((1, h), 0.1)));
        weights.insert(
            format!("{p}.post_attention_layernorm.weight"),
            norm(t((1, h), 0.1)),
        );
        for (name, out, inp) in projs {
            weights.insert(format!("{p}.{name}.weight"), t((out, inp), w(inp)));
            let k = format!("base_model.model.{p}.{name}");
            lora.insert(format!("{k}.lora_A.weight"), t((r, inp), w(inp)));
            lora.insert(format!("{k}.lora_B.weight"), t((out, r), 0.1));
        }
    }
    let adapter = tmp.path().join("adapter");
    std::fs::create_dir(&adapter).unwrap();
    candle_core::safetensors::save(&lora, adapter.join("adapter_model.safetensors")).unwrap();
    let targets: Vec<&str> = projs
        .iter()
        .map(|p| p.0.rsplit('.').next().unwrap())
        .collect();
    std::fs::write(
        adapter.join("adapter_config.json"),
        serde_json::json!({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": "synthetic",
            "r": r, "lora_alpha": 16, "target_modules": targets, "fan_in_fan_out": false,
            "use_rslora": false, "use_dora": false, "bias": "none",
        })
        .to_string(),
    )
    .unwrap();
    Base {
        config,
        weights,
        adapter,
        name: "synthetic".into(),
        _tmp: Some(tmp),
    }
}

/// llama.cpp's row order for Q/K: per head, HF's [first half | second half] interleaved.
fn permute(w: &Tensor, heads: usize) -> Tensor {
    let (rows, cols) = w.dims2().unwrap();
    w.reshape((heads, 2, rows / heads / 2, cols))
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .contiguous()
        .unwrap()
        .reshape((rows, cols))
        .unwrap()
}

fn gguf_name(hf: &str) -> String {
    match hf {
        "model.embed_tokens.weight" => return "token_embd.weight".into(),
        "model.norm.weight" => return "output_norm.weight".into(),
        "lm_head.weight" => return "output.weight".into(),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.").unwrap();
    let (layer, rest) = rest.split_once('.').unwrap();
    let module = match rest.strip_suffix(".weight").unwrap() {
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => "ffn_norm",
        other => panic!("unexpected tensor {other}"),
    };
    format!("blk.{layer}.{module}.weight")
}

/// Writes `base` quantized to `dtype` as a llama GGUF; returns the reference weights: what
/// each quantized tensor dequantizes to, by HF name.
fn write_gguf(base: &Base, dtype: GgmlDType, path: &Path) -> HashMap<String, Tensor> {
    let c = &base.config;
    let u = |k: &str| c[k].as_u64().unwrap() as u32;
    let (heads, kv_heads) = (u("num_attention_heads"), u("num_key_value_heads"));
    let mut tensors = Vec::new();
    let mut reference = HashMap::new();
    let mut names: Vec<&String> = base.weights.keys().collect();
    names.sort();
    for name in names {
        let w = &base.weights[name];
        let q = if w.rank() == 1 {
            QTensor::quantize(w, GgmlDType::F32).unwrap()
        } else {
            QTensor::quantize(w, dtype).unwrap()
        };
        reference.insert(name.clone(), q.dequantize(&Device::Cpu).unwrap());
        // Quantization blocks lie within rows, so permuting before quantizing gives the same
        // blocks in llama.cpp's row order.
        let stored = if name.ends_with("q_proj.weight") {
            QTensor::quantize(&permute(w, heads as usize), dtype).unwrap()
        } else if name.ends_with("k_proj.weight") {
            QTensor::quantize(&permute(w, kv_heads as usize), dtype).unwrap()
        } else {
            q
        };
        tensors.push((gguf_name(name), stored));
    }
    use gguf_file::Value as V;
    let template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}";
    let meta: Vec<(&str, V)> = vec![
        ("general.architecture", V::String("llama".into())),
        ("general.name", V::String(base.name.clone())),
        ("llama.block_count", V::U32(u("num_hidden_layers"))),
        ("llama.embedding_length", V::U32(u("hidden_size"))),
        ("llama.feed_forward_length", V::U32(u("intermediate_size"))),
        ("llama.attention.head_count", V::U32(heads)),
        ("llama.attention.head_count_kv", V::U32(kv_heads)),
        ("llama.attention.key_length", V::U32(u("head_dim"))),
        (
            "llama.attention.layer_norm_rms_epsilon",
            V::F32(c["rms_norm_eps"].as_f64().unwrap() as f32),
        ),
        (
            "llama.rope.freq_base",
            V::F32(
                c["rope_theta"]
                    .as_f64()
                    .or(c["rope_parameters"]["rope_theta"].as_f64())
                    .unwrap() as f32,
            ),
        ),
        ("llama.context_length", V::U32(u("max_position_embeddings"))),
        ("tokenizer.ggml.model", V::String("gpt2".into())),
        (
            "tokenizer.ggml.tokens",
            V::Array(byte_tokens().into_iter().map(V::String).collect()),
        ),
        ("tokenizer.ggml.merges", V::Array(vec![])),
        ("tokenizer.ggml.eos_token_id", V::U32(2)),
        ("tokenizer.chat_template", V::String(template.into())),
    ];
    let meta_refs: Vec<(&str, &V)> = meta.iter().map(|(k, v)| (*k, v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut f, &meta_refs, &tensor_refs).unwrap();
    reference
}

fn max_rel(a: &Tensor, b: &Tensor) -> f32 {
    let d = (a - b).unwrap().abs().unwrap().max_all().unwrap();
    let s = b.abs().unwrap().max_all().unwrap();
    d.to_scalar::<f32>().unwrap() / s.to_scalar::<f32>().unwrap()
}

/// Logits of each row after its prompt and after each token of `feed` (the same tokens for
/// every model compared, so errors are measured step by step instead of compounding).
fn teacher_forced(
    model: &Decoder,
    rows: &[(Vec<u32>, Option<&LoraAdapter>)],
    feed: &[Vec<u32>],
) -> Vec<Vec<Tensor>> {
    let mut caches = (0..rows.len())
        .map(|_| SeqCache::default())
        .collect::<Vec<_>>();
    let mut out: Vec<Vec<Tensor>> = vec![Vec::new(); rows.len()];
    for step in 0..=feed[0].len() {
        let toks: Vec<Vec<u32>> = (0..rows.len())
            .map(|i| {
                if step == 0 {
                    rows[i].0.clone()
                } else {
                    vec![feed[i][step - 1]]
                }
            })
            .collect();
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
        for (o, l) in out.iter_mut().zip(model.forward(&mut batch).unwrap()) {
            o.push(l);
        }
    }
    out
}

fn greedy_req(prompt: &[u32], adapter: Option<&str>, n: usize) -> GenerateRequest {
    GenerateRequest {
        images: Vec::new(),
        id: "g".into(),
        prompt: Prompt::Tokens(prompt.to_vec()),
        adapter: adapter.map(String::from),
        sampling: SamplingParams {
            max_tokens: n,
            ignore_eos: true,
            ..Default::default()
        },
    }
}

fn tokens(e: &Engine, prompt: &[u32], adapter: Option<&str>, n: usize) -> Vec<u32> {
    let mut rx = e.submit(greedy_req(prompt, adapter, n)).unwrap();
    let mut out = Vec::new();
    loop {
        match rx.blocking_recv().unwrap() {
            TokenEvent::Token { token_id, .. } => out.push(token_id),
            TokenEvent::Finished { .. } => return out,
            TokenEvent::Error(err) => panic!("{err}"),
            TokenEvent::Started { .. } => {}
        }
    }
}

fn check(base: Base, dtype: GgmlDType) {
    let dev = Device::Cpu;
    let label = format!("{} {dtype:?}", base.name);
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("model.gguf");
    let reference = write_gguf(&base, dtype, &path);

    // Exact: the GGUF read back dequantizes to the reference bit for bit.
    let q = mole_formats::gguf::load_quantized(&path, &dev).unwrap();
    assert_eq!(q.tensors.len(), reference.len(), "{label}");
    for (name, qt) in &q.tensors {
        assert_eq!(
            qt.dtype(),
            if qt.rank() == 1 {
                GgmlDType::F32
            } else {
                dtype
            }
        );
        let got: Vec<f32> = qt
            .dequantize(&dev)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let want: Vec<f32> = reference[name].flatten_all().unwrap().to_vec1().unwrap();
        assert!(got == want, "{label}: {name} does not dequantize exactly");
    }
    let quant = Decoder::from_quantized(
        ModelConfig::from_json(q.config.clone()).unwrap(),
        q.tensors,
        &dev,
    )
    .unwrap();
    let cfg = ModelConfig::from_json(base.config.clone()).unwrap();
    let dense = Decoder::new(
        cfg.clone(),
        VarBuilder::from_tensors(reference.clone(), DType::F32, &dev),
    )
    .unwrap();
    let opts = LoadOptions {
        max_rank: 64,
        expect_base: None,
    };
    let adapter_model = lora::load(&base.adapter, &cfg, DType::F32, &dev, &opts).unwrap();
    let adapter = &adapter_model;
    let dense_copy = Decoder::new(
        cfg.clone(),
        VarBuilder::from_tensors(reference.clone(), DType::F32, &dev),
    )
    .unwrap();

    // Logits: one batch, rows with and without the adapter, 8 teacher-forced decode steps.
    let (pa, pb): (Vec<u32>, Vec<u32>) = (
        vec![5, 17, 99, 3, 250, 42, 7, 7, 128, 64, 33, 1],
        vec![200, 11, 90, 4, 4, 180, 2],
    );
    let rows = vec![
        (pa.clone(), None),
        (pa.clone(), Some(adapter)),
        (pb.clone(), Some(adapter)),
    ];
    let probe = teacher_forced(&dense, &rows, &[vec![], vec![], vec![]]);
    let feed: Vec<Vec<u32>> = probe
        .iter()
        .map(|l| {
            let t = mole_model::argmax(&l[0]).unwrap();
            (0..8).map(|i| (t + 37 * i) % 256).collect()
        })
        .collect();
    // On both paths: the host kernels (a CPU's default) and the tensor ops a GPU runs; each
    // row batched and alone. Alone and batched are both held to the reference, not to each
    // other: an adapter's grouped products sum in another order in another batch (~1e-7 of
    // scale), and where an activation lies on a half step of its 8-bit grid that flips its
    // rounding by one step (1/127 of its block's largest value), which the KV cache then
    // carries to later steps (measured up to 1.5e-2 of scale for q6_k, rows with no adapter
    // bit-equal): the same size as the quantization's own error, within the same bound.
    let (mut quant, mut dense) = (quant, dense);
    for host in [true, false] {
        quant.configure(mole_model::BackendKind::host_if(host), Default::default());
        dense.configure(mole_model::BackendKind::host_if(host), Default::default());
        let path = if host { "host" } else { "tensor" };
        let want = teacher_forced(&dense, &rows, &feed);
        let got = teacher_forced(&quant, &rows, &feed);
        let alone: Vec<Vec<Tensor>> = rows
            .iter()
            .zip(&feed)
            .map(|(row, feed)| {
                teacher_forced(
                    &quant,
                    std::slice::from_ref(row),
                    std::slice::from_ref(feed),
                )
                .remove(0)
            })
            .collect();
        let worst = |got: &[Vec<Tensor>]| {
            let mut worst = 0f32;
            for (w, g) in want.iter().zip(got) {
                for (a, b) in g.iter().zip(w) {
                    worst = worst.max(max_rel(a, b));
                }
            }
            worst
        };
        let (batched, alone) = (worst(&got), worst(&alone));
        let lora_effect = max_rel(&want[1][0], &want[0][0]);
        eprintln!("{label} {path}: quantized vs dequantized-f32 logits {batched:.2e} of scale batched, {alone:.2e} alone; the LoRA moves them {lora_effect:.2e}");
        assert!(batched <= TOL, "{label} {path} batched: {batched}");
        assert!(alone <= TOL, "{label} {path} alone: {alone}");
        assert!(
            lora_effect > 5.0 * TOL,
            "{label} {path}: LoRA effect {lora_effect}"
        );
    }

    // Through the engine: the .gguf served quantized against the dense engine, greedy with and
    // without the adapter.
    let opts = |name: &str| EngineOptions {
        base_name: name.into(),
        ..Default::default()
    };
    let qe = Engine::load(
        &ModelSource::Gguf(path.to_path_buf()),
        &dev,
        opts(&base.name),
    )
    .unwrap();
    let text = TextModel::load(&fixtures().join("llama")).unwrap();
    let de = Engine::start(dense, text, opts(&base.name));
    let spec = AdapterSpec {
        name: "a".into(),
        version: "v1".into(),
        lora_id: 1,
        path: base.adapter.clone(),
    };
    qe.load_adapter(spec.clone()).unwrap();
    de.load_adapter(spec).unwrap();
    assert_eq!(
        (qe.stats().kv_cache_dtype, de.stats().kv_cache_dtype),
        (Some("f16"), Some("f32")),
        "a quantized base caches f16 by default, f32 weights f32"
    );
    assert_eq!(
        qe.apply_chat_template(&[ChatMessage::text("user", "hi")], &serde_json::Map::new())
            .unwrap(),
        "<user>hi\n<assistant>",
        "the chat template comes from the GGUF metadata"
    );
    for (prompt, adapter) in [(&pa, None), (&pa, Some("a")), (&pb, Some("a"))] {
        let (q_out, d_out) = (
            tokens(&qe, prompt, adapter, 16),
            tokens(&de, prompt, adapter, 16),
        );
        // Equal up to the first step where the reference's own top-2 margin is within twice
        // the tolerance (there 8-bit activations may pick the runner-up).
        let agree = q_out.iter().zip(&d_out).take_while(|(a, b)| a == b).count();
        if agree < d_out.len() {
            // The quantized pick must be within the error budget of the reference's best.
            let mut seq = prompt.clone();
            seq.extend(&d_out[..agree]);
            let rows = [(seq, adapter.map(|_| &adapter_model))];
            let l: Vec<f32> = teacher_forced(&dense_copy, &rows, &[vec![]])[0][0]
                .to_vec1()
                .unwrap();
            let scale = l.iter().fold(0f32, |m, x| m.max(x.abs()));
            let (best, picked) = (l[d_out[agree] as usize], l[q_out[agree] as usize]);
            let gap = (best - picked) / scale;
            eprintln!("{label} {adapter:?}: diverges at step {agree}, the quantized pick is {gap:.2e} of scale below the best");
            assert!(
                gap <= 2.0 * TOL,
                "{label} {adapter:?}: step {agree}, gap {gap}"
            );
        }
        eprintln!(
            "{label} {adapter:?}: greedy agrees on {agree}/{} tokens",
            d_out.len()
        );
    }
}

#[test]
fn q4_0_base_serves_like_its_dequantized_weights() {
    check(tiny_llama(), GgmlDType::Q4_0);
}

#[test]
fn q4_1_base_serves_like_its_dequantized_weights() {
    check(tiny_llama(), GgmlDType::Q4_1);
}

#[test]
fn q8_0_base_serves_like_its_dequantized_weights() {
    check(tiny_llama(), GgmlDType::Q8_0);
}

#[test]
fn q4_k_base_serves_like_its_dequantized_weights() {
    check(synthetic_llama(), GgmlDType::Q4K);
}

#[test]
fn q5_k_base_serves_like_its_dequantized_weights() {
    check(synthetic_llama(), GgmlDType::Q5K);
}

#[test]
fn q6_k_base_serves_like_its_dequantized_weights() {
    check(synthetic_llama(), GgmlDType::Q6K);
}
