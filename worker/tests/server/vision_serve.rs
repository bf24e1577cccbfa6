//! Qwen3-VL served: the engine and the HTTP API on the committed tiny model
//! (tests/fixtures/vision, tokenizer and chat template from make_chat.py) against
//! transformers' Qwen3VLProcessor and model (chat_reference.json): the chat template's text,
//! the prompt tokens with each image's placeholders expanded, and greedy tokens with and
//! without the adapter, in one mixed batch, prefilled in chunks that split images, through
//! `/infer`'s `image_b64` and chat `image_url` parts; the classifier router's one pass with the
//! image; and the bad-image battery (each a 400/413, the server serving on).

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test
#![allow(clippy::disallowed_methods)] // tests read results back from the device

use crate::common;

use mole_engine::ModelSource;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use base64::Engine as _;
use candle_core::{DType, Device};
use mole_api::ImageProcessor;
use mole_engine::api::*;
use mole_engine::{Engine, EngineOptions};
use serde_json::{json, Value};
use sha2::Digest;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/vision")
}

fn reference() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join("chat_reference.json")).unwrap())
        .unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    serde_json::from_value(v.clone()).unwrap()
}

fn png(name: &str) -> Vec<u8> {
    std::fs::read(fixtures().join(format!("images/{name}.png"))).unwrap()
}

/// A fixture image as the server hands it to the engine.
fn image(name: &str) -> Image {
    let bytes = png(name);
    let rgb = image::load_from_memory(&bytes).unwrap().to_rgb8();
    Image {
        width: rgb.width(),
        height: rgb.height(),
        rgb: Arc::from(rgb.into_raw()),
        digest: sha2::Sha256::digest(&bytes).into(),
    }
}

/// A conversation of the reference as chat messages (image parts in place) and its images.
fn conversation(c: &Value) -> (Vec<ChatMessage>, Vec<Image>) {
    let mut images = Vec::new();
    let msgs = c["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let role = m["role"].as_str().unwrap();
            match &m["content"] {
                Value::String(t) => ChatMessage::text(role, t.as_str()),
                Value::Array(parts) => {
                    let mut msg = ChatMessage::text(role, "");
                    for p in parts {
                        if p["type"] == "image" {
                            images.push(image(p["image"].as_str().unwrap()));
                            msg.parts.push(ContentPart::Image);
                        } else {
                            let t = p["text"].as_str().unwrap();
                            msg.content.push_str(t);
                            msg.parts.push(ContentPart::Text(t.into()));
                        }
                    }
                    msg
                }
                _ => unreachable!(),
            }
        })
        .collect();
    (msgs, images)
}

fn engine(prefill_chunk: usize) -> Engine {
    let o = EngineOptions {
        base_name: "qwen3-vl-tiny".into(),
        prefill_chunk,
        max_seq_len: 512,
        // The references were computed with transformers' PIL backend.
        image_processor: ImageProcessor::Pil,
        ..Default::default()
    };
    let e = Engine::load(
        &ModelSource::hf(fixtures().join("qwen3_vl"), DType::F32),
        &Device::Cpu,
        o,
    )
    .unwrap();
    e.load_adapter(AdapterSpec {
        name: "screens".into(),
        version: "v1".into(),
        lora_id: 1,
        path: fixtures().join("adapter"),
    })
    .unwrap();
    e
}

/// Tokens and prompt length of a finished request.
fn collect(mut rx: EventStream) -> (Vec<u32>, usize) {
    let (mut tokens, mut prompt) = (vec![], 0);
    loop {
        match rx.blocking_recv().unwrap() {
            TokenEvent::Started { prompt_tokens, .. } => prompt = prompt_tokens,
            TokenEvent::Token { token_id, .. } => tokens.push(token_id),
            TokenEvent::Finished { .. } => return (tokens, prompt),
            TokenEvent::Error(e) => panic!("request failed: {e}"),
        }
    }
}

/// Every conversation with and without the adapter, submitted at once (one batch mixing
/// images of different sizes, text, adapters), with prefill chunks of `chunk` tokens: the
/// chat template renders transformers' text, the prompt has the processor's token count, and
/// the greedy tokens are transformers'.
fn serve_all_and_compare(chunk: usize) {
    let r = reference();
    let e = engine(chunk);
    let mut pending = Vec::new();
    for (name, c) in r.as_object().unwrap() {
        let (msgs, images) = conversation(c);
        let text = e.apply_chat_template(&msgs, &Default::default()).unwrap();
        assert_eq!(text, c["text"].as_str().unwrap(), "{name}: template");
        for label in ["base", "adapter"] {
            let rx = e
                .submit(GenerateRequest {
                    id: format!("{name}-{label}"),
                    prompt: Prompt::Templated(text.clone()),
                    adapter: (label == "adapter").then(|| "screens".into()),
                    sampling: SamplingParams {
                        max_tokens: 8,
                        ignore_eos: true,
                        ..Default::default()
                    },
                    images: images.clone(),
                })
                .unwrap();
            pending.push((name.clone(), label, rx));
        }
    }
    for (name, label, rx) in pending {
        let (tokens, prompt) = collect(rx);
        let c = &r[&name];
        assert_eq!(prompt, ids(&c["ids"]).len(), "{name}: prompt tokens");
        assert_eq!(
            tokens,
            ids(&c[label]["greedy"]),
            "{name} {label} (chunk {chunk}): greedy tokens"
        );
    }
}

#[test]
fn conversations_with_images_match_transformers_in_one_mixed_batch() {
    serve_all_and_compare(512);
}

/// Chunks of 5 tokens split every image's placeholders across steps.
#[test]
fn prefill_chunks_that_split_images_change_nothing() {
    serve_all_and_compare(5);
}

#[test]
fn image_token_counts_and_refusals() {
    let e = engine(512);
    let c = &reference()["infer_one_image"];
    let (msgs, images) = conversation(c);
    let grid_tokens = ids(&c["ids"]).iter().filter(|&&t| t == 250).count();
    assert_eq!(
        e.image_tokens(images[0].width, images[0].height).unwrap(),
        grid_tokens
    );
    let text = e.apply_chat_template(&msgs, &Default::default()).unwrap();
    let req = |images: Vec<Image>| GenerateRequest {
        id: "x".into(),
        prompt: Prompt::Templated(text.clone()),
        adapter: None,
        sampling: SamplingParams::default(),
        images,
    };
    // One placeholder, two images; no image for the placeholder.
    for n in [0, 2] {
        let err = e.submit(req(vec![images[0].clone(); n])).unwrap_err();
        assert_eq!(err.code(), "invalid_image", "{n} images: {err}");
    }
    let thin = Image {
        width: 1000,
        height: 2,
        rgb: Arc::from(vec![0u8; 6000]),
        digest: [0; 32],
    };
    let err = e.submit(req(vec![thin])).unwrap_err();
    assert_eq!(err.code(), "invalid_image", "{err}");
    assert!(err.to_string().contains("aspect ratio"), "{err}");
    // A text model refuses images with its own code.
    let text_model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/engine/qwen3");
    let t = Engine::load(
        &ModelSource::hf(text_model, DType::F32),
        &Device::Cpu,
        Default::default(),
    )
    .unwrap();
    let err = t
        .submit(GenerateRequest {
            prompt: Prompt::Text("hi".into()),
            ..req(images.clone())
        })
        .unwrap_err();
    assert_eq!(err.code(), "images_not_supported");
    assert!(!t.model_info().vision && e.model_info().vision);
}

/// The classifier's one pass sees the image: label probabilities are the softmax of
/// transformers' logits (prompt: the image then the text, one user message) at the labels'
/// tokens.
#[test]
fn score_labels_with_an_image_equals_transformers() {
    let e = engine(512);
    let c = &reference()["infer_one_image"];
    let labels: Vec<String> = ["a", "b", "c", "d"].iter().map(|s| s.to_string()).collect();
    for (adapter, label) in [(None, "base"), (Some("screens"), "adapter")] {
        let logits: Vec<f32> = serde_json::from_value(c[label]["last_logits"].clone()).unwrap();
        let picked: Vec<f32> = labels
            .iter()
            .map(|l| logits[l.as_bytes()[0] as usize])
            .collect();
        let max = picked.iter().cloned().fold(f32::MIN, f32::max);
        let z: f32 = picked.iter().map(|x| (x - max).exp()).sum();
        let want: Vec<f32> = picked.iter().map(|x| (x - max).exp() / z).collect();
        let got = e
            .score_labels(
                adapter,
                "What is on the screen?",
                &labels,
                &[image("square")],
            )
            .unwrap();
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() < 1e-4, "{label}: {got:?} vs {want:?}");
        }
        // Without the image the pass differs: the image is seen.
        let blind = e
            .score_labels(adapter, "What is on the screen?", &labels, &[])
            .unwrap();
        assert!(
            blind.iter().zip(&got).any(|(a, b)| (a - b).abs() > 1e-4),
            "{label}: {blind:?}"
        );
    }
}

// ---- HTTP ----

struct Srv {
    url: String,
    _dir: tempfile::TempDir,
    _stop: tokio::sync::oneshot::Sender<()>,
}

/// A worker on the tiny Qwen3-VL with the adapters `screens` (label "1") and `charts` (label
/// "2", the same weights), `router`, and `limits` appended to its limits.
async fn start(router: &str, limits: &str) -> Srv {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    for (from, to) in [
        ("qwen3_vl", "base"),
        ("adapter", "screens"),
        ("adapter", "charts"),
    ] {
        let to = root.join(to);
        std::fs::create_dir_all(&to).unwrap();
        for e in std::fs::read_dir(fixtures().join(from)).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
    let yaml = format!(
        r#"
pool: screens-pool
modelRoot: {root}
baseModel: {{name: qwen3-vl-tiny, path: base, dtype: f32, imageProcessor: pil}}
adapters:
  - {{name: screens, version: v1, loraId: 1, path: screens, label: "1"}}
  - {{name: charts, version: v1, loraId: 2, path: charts, label: "2"}}
router: {router}
limits: {{maxTokens: 16, maxSeqLen: 512, requestTimeoutSeconds: 30{limits}}}
"#,
        root = root.display()
    );
    let (url, tx) = common::serve_config(root, &yaml).await;
    Srv {
        url,
        _dir: dir,
        _stop: tx,
    }
}

async fn post(s: &Srv, path: &str, body: Value) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(format!("{}{path}", s.url))
        .json(&body)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// What the tokenizer makes of reference tokens (the answer's text).
fn text_of(tokens: &[u32]) -> String {
    let t = tokenizers::Tokenizer::from_file(fixtures().join("qwen3_vl/tokenizer.json")).unwrap();
    t.decode(tokens, true).unwrap()
}

const EXPLICIT: &str = "{strategies: [explicit], fallback: base}";

/// The seeds' call (`image_b64` bare and as a data URL, `expert` as the integer label) and the
/// `openai` client's chat with an `image_url` data URL: transformers' tokens as text, the
/// prompt counted with the image's tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn infer_and_chat_with_images_answer_as_transformers() {
    let s = start(EXPLICIT, "").await;
    let c = &reference()["infer_one_image"];
    let prompt_tokens = ids(&c["ids"]).len();
    let want = text_of(&ids(&c["adapter"]["greedy"]));
    let img = png("square");
    for (image_b64, expert) in [
        (b64(&img), json!(1)),
        (
            format!("data:image/png;base64,{}", b64(&img)),
            json!("screens"),
        ),
    ] {
        let (st, v) = post(
            &s,
            "/infer",
            json!({"prompt": "What is on the screen?", "image_b64": image_b64, "expert": expert,
                   "max_tokens": 8, "temperature": 0, "ignore_eos": true}),
        )
        .await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["routed_adapter"], "screens", "{v}");
        assert_eq!(v["task_output"], want.as_str(), "{v}");
        assert_eq!(v["usage"]["prompt_tokens"], prompt_tokens, "{v}");
    }
    let url = format!("data:image/png;base64,{}", b64(&img));
    let (st, v) = post(
        &s,
        "/v1/chat/completions",
        json!({"model": "screens", "max_tokens": 8, "temperature": 0, "ignore_eos": true,
               "messages": [{"role": "user", "content": [
                   {"type": "image_url", "image_url": {"url": url}},
                   {"type": "text", "text": "What is on the screen?"}]}]}),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], want.as_str(), "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], prompt_tokens, "{v}");
    // Three choices of the same image prompt: the others continue the first's cache (its
    // image's positions and embeddings), each still transformers' greedy tokens.
    let (st, v) = post(
        &s,
        "/v1/chat/completions",
        json!({"model": "screens", "max_tokens": 8, "temperature": 0, "ignore_eos": true, "n": 3,
               "messages": [{"role": "user", "content": [
                   {"type": "image_url", "image_url": {"url": url}},
                   {"type": "text", "text": "What is on the screen?"}]}]}),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    for i in 0..3 {
        assert_eq!(
            v["choices"][i]["message"]["content"],
            want.as_str(),
            "choice {i}: {v}"
        );
    }
    assert_eq!(v["usage"]["prompt_tokens"], prompt_tokens, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 24, "{v}");
    // Two images of different sizes and a system message, base model.
    let c = &reference()["system_two_images"];
    let part = |n: &str| json!({"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{}", b64(&png(n)))}});
    let (st, v) = post(
        &s,
        "/v1/chat/completions",
        json!({"model": "qwen3-vl-tiny", "max_tokens": 8, "temperature": 0, "ignore_eos": true,
               "messages": [{"role": "system", "content": "You read screenshots."},
                            {"role": "user", "content": [
                   {"type": "text", "text": "Compare "}, part("wide"),
                   {"type": "text", "text": " and "}, part("large"),
                   {"type": "text", "text": "."}]}]}),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    let want = text_of(&ids(&c["base"]["greedy"]));
    assert_eq!(v["choices"][0]["message"]["content"], want.as_str(), "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], ids(&c["ids"]).len(), "{v}");
}

/// The classifier router's one pass sees the image: its decision and confidence are the
/// softmax of transformers' logits (the adapter on, the image then the text) at the labels'
/// tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_classifier_router_sees_the_image() {
    let s = start(
        "{strategies: [classifier], classifierAdapter: screens, minConfidence: 0.0, fallback: base}",
        "",
    )
    .await;
    let logits: Vec<f32> =
        serde_json::from_value(reference()["infer_one_image"]["adapter"]["last_logits"].clone())
            .unwrap();
    let (l1, l2) = (logits[b'1' as usize], logits[b'2' as usize]);
    let p1 = 1.0 / (1.0 + (l2 - l1).exp());
    let (want, p) = if p1 >= 0.5 {
        ("screens", p1)
    } else {
        ("charts", 1.0 - p1)
    };
    let (st, v) = post(
        &s,
        "/v1/route",
        json!({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{}", b64(&png("square")))}},
            {"type": "text", "text": "What is on the screen?"}]}]}),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        (v["route"].as_str(), v["adapter"].as_str()),
        (Some("classifier"), Some(want)),
        "{v}"
    );
    let score = v["score"].as_f64().unwrap() as f32;
    assert!((score - p).abs() < 1e-4, "{v}: want {p}");
}

/// Bad images: each refused with its code, and the server keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_images_are_refused_and_the_server_keeps_serving() {
    let s = start(EXPLICIT, ", maxImages: 2, maxImageBytes: 200000").await;
    let img = png("square");
    // A 100-megapixel PNG: a few bytes on the wire, refused from its header before a pixel
    // is decoded.
    let huge = png_claiming(10_000, 10_000);
    let mut gif = b"GIF89a".to_vec();
    gif.extend_from_slice(&[1, 0, 1, 0, 0, 0, 0, 0x3b]);
    let infer = |image_b64: String| json!({"prompt": "x", "image_b64": image_b64, "max_tokens": 2});
    for (body, status, code) in [
        (infer(b64(&img[..img.len() / 2])), 400, "invalid_image"),
        (infer("%%%not base64%%%".into()), 400, "invalid_image"),
        (infer(b64(&huge)), 413, "image_too_large"),
        (infer(b64(&gif)), 400, "unsupported_image_format"),
        (infer(b64(&vec![7u8; 300_000])), 413, "image_too_large"),
        (
            infer("https://example.com/a.png".into()),
            400,
            "image_url_not_allowed",
        ),
        (
            json!({"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{}", b64(&img))}},
                {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{}", b64(&img))}},
                {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{}", b64(&img))}}]}]}),
            400,
            "too_many_images",
        ),
    ] {
        let path = if body.get("messages").is_some() {
            "/v1/chat/completions"
        } else {
            "/infer"
        };
        let (st, v) = post(&s, path, body).await;
        assert_eq!(
            (st, v["error"]["code"].as_str()),
            (status, Some(code)),
            "{v}"
        );
    }
    let (st, v) = post(&s, "/infer", infer(b64(&img))).await;
    assert_eq!(st, 200, "still serving: {v}");
}

/// A 1×1 PNG whose header claims `w × h` pixels (its checksum fixed).
fn png_claiming(w: u32, h: u32) -> Vec<u8> {
    let mut out = std::io::Cursor::new(Vec::new());
    image::RgbImage::new(1, 1)
        .write_to(&mut out, image::ImageFormat::Png)
        .unwrap();
    let mut p = out.into_inner();
    // Signature (8), IHDR length (4), "IHDR" (4), width, height, ..., CRC over type + data.
    p[16..20].copy_from_slice(&w.to_be_bytes());
    p[20..24].copy_from_slice(&h.to_be_bytes());
    let crc = crc32(&p[12..29]);
    p[29..33].copy_from_slice(&crc.to_be_bytes());
    p
}

/// PNG's CRC-32 (IEEE, reflected).
fn crc32(bytes: &[u8]) -> u32 {
    let mut c = 0xFFFF_FFFFu32;
    for &b in bytes {
        c ^= u32::from(b);
        for _ in 0..8 {
            c = if c & 1 != 0 {
                0xEDB8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
        }
    }
    !c
}

/// Qwen-VL checkpoints ship their template in the processor's `chat_template.json`.
#[test]
fn a_chat_template_json_is_read() {
    let dir = tempfile::tempdir().unwrap();
    for f in ["tokenizer.json", "config.json"] {
        std::fs::copy(fixtures().join("qwen3_vl").join(f), dir.path().join(f)).unwrap();
    }
    let tcfg: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("qwen3_vl/tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("chat_template.json"),
        json!({"chat_template": tcfg["chat_template"]}).to_string(),
    )
    .unwrap();
    let t = mole_engine::text::TextModel::load(dir.path()).unwrap();
    let c = &reference()["infer_one_image"];
    let (msgs, _) = conversation(c);
    assert_eq!(
        t.render_chat_with(&msgs, true, &Default::default())
            .unwrap(),
        c["text"].as_str().unwrap()
    );
}

fn all_linear_reference() -> Value {
    serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("all_linear_reference.json")).unwrap(),
    )
    .unwrap()
}

/// An adapter on every linear module (PEFT's `all-linear`: the vision tower's attention, MLPs
/// and mergers too) served dynamically in one batch beside the language-model-only adapter and
/// the base: each request's tokens are transformers', so the tower ran once per adapter with
/// the right one; the classifier pass with it equals transformers' logits.
#[test]
fn an_adapter_on_the_vision_tower_is_served_beside_others() {
    let e = engine(512);
    e.load_adapter(AdapterSpec {
        name: "everything".into(),
        version: "v1".into(),
        lora_id: 2,
        path: fixtures().join("adapter_all_linear"),
    })
    .unwrap();
    let r = reference();
    let all = all_linear_reference();
    let mut pending = Vec::new();
    for name in ["infer_one_image", "system_two_images"] {
        let (msgs, images) = conversation(&r[name]);
        let text = e.apply_chat_template(&msgs, &Default::default()).unwrap();
        for adapter in [Some("everything"), Some("screens"), None] {
            let rx = e
                .submit(GenerateRequest {
                    id: format!("{name}-{adapter:?}"),
                    prompt: Prompt::Templated(text.clone()),
                    adapter: adapter.map(String::from),
                    sampling: SamplingParams {
                        max_tokens: 8,
                        ignore_eos: true,
                        ..Default::default()
                    },
                    images: images.clone(),
                })
                .unwrap();
            pending.push((name, adapter, rx));
        }
    }
    for (name, adapter, rx) in pending {
        let want = match adapter {
            Some("everything") => ids(&all[name]["greedy"]),
            Some(_) => ids(&r[name]["adapter"]["greedy"]),
            None => ids(&r[name]["base"]["greedy"]),
        };
        assert_eq!(collect(rx).0, want, "{name} {adapter:?}");
    }
    // The classifier's pass: label probabilities from transformers' logits.
    let logits: Vec<f32> =
        serde_json::from_value(all["infer_one_image"]["last_logits"].clone()).unwrap();
    let labels: Vec<String> = ["a", "b", "c", "d"].iter().map(|s| s.to_string()).collect();
    let picked: Vec<f32> = labels
        .iter()
        .map(|l| logits[l.as_bytes()[0] as usize])
        .collect();
    let max = picked.iter().cloned().fold(f32::MIN, f32::max);
    let z: f32 = picked.iter().map(|x| (x - max).exp()).sum();
    let got = e
        .score_labels(
            Some("everything"),
            "What is on the screen?",
            &labels,
            &[image("square")],
        )
        .unwrap();
    for (g, x) in got.iter().zip(&picked) {
        let w = (x - max).exp() / z;
        assert!((g - w).abs() < 1e-4, "{got:?} vs {picked:?}");
    }
}

/// A module the engine does not apply (here the patch embedding, a Conv3d PEFT can target by
/// name) is refused with the way to serve it.
#[test]
fn an_adapter_on_an_unsupported_vision_module_is_refused_by_name() {
    let e = engine(512);
    let dir = tempfile::tempdir().unwrap();
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(fixtures().join("adapter").join(f), dir.path().join(f)).unwrap();
    }
    let cfg_path = dir.path().join("adapter_config.json");
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["target_modules"]
        .as_array_mut()
        .unwrap()
        .push("patch_embed.proj".into());
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let path = dir.path().join("adapter_model.safetensors");
    let mut tensors = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    let a = candle_core::Tensor::zeros((8, 1536), DType::F32, &Device::Cpu).unwrap();
    let b = candle_core::Tensor::zeros((32, 8), DType::F32, &Device::Cpu).unwrap();
    tensors.insert(
        "base_model.model.model.visual.patch_embed.proj.lora_A.weight".into(),
        a,
    );
    tensors.insert(
        "base_model.model.model.visual.patch_embed.proj.lora_B.weight".into(),
        b,
    );
    candle_core::safetensors::save(&tensors, &path).unwrap();
    let err = e
        .load_adapter(AdapterSpec {
            name: "conv".into(),
            version: "v1".into(),
            lora_id: 3,
            path: dir.path().into(),
        })
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("model.visual.patch_embed.proj") && msg.contains("serving.mode merged"),
        "{msg}"
    );
}

/// `/tokenize` of a chat with a screenshot: transformers' processor's ids, the image's
/// placeholders expanded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_expands_images_as_the_processor() {
    let s = start(EXPLICIT, "").await;
    let c = &reference()["infer_one_image"];
    let (st, v) = post(
        &s,
        "/tokenize",
        json!({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{}", b64(&png("square")))}},
            {"type": "text", "text": "What is on the screen?"}]}]}),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["tokens"], c["ids"], "{v}");
}
