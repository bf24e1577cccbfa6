//! HTTP API tests: the real server and the real engine on the committed tiny Llama
//! (tests/fixtures/engine, byte-level tokenizer) with its PEFT adapters, on a random port:
//! happy paths (chat, stream, completions, routing headers), the bad-input battery (each
//! answer the right 4xx and the server keeps serving), admin endpoints, metrics, gateway.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test
#![allow(clippy::disallowed_methods)] // tests read results back from the device

use crate::common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use mole_engine::api::{
    AdapterAdmin, AdapterSpec, EngineError, EngineHandles, EventStream, GenerateRequest, Image,
    Serving, TokenEvent,
};
use mole_server::{build_engine, cli::serve_with, AppState, Auth};
use serde_json::{json, Value};

struct Srv {
    url: String,
    engine: EngineHandles,
    state: Arc<AppState>,
    _dir: tempfile::TempDir,
    _stop: tokio::sync::oneshot::Sender<()>,
    served: tokio::task::JoinHandle<anyhow::Result<()>>,
}

/// A model root with the tiny Llama, its fixture adapters (fr, js, extra), an adapter of
/// another base of the same shapes (wrongbase), one of other shapes (misfit), a pickle-only one (binonly) and an admin token file.
fn fixture_root() -> tempfile::TempDir {
    let fx = common::engine_fixtures();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    // fr2, extra2 and extra3: the same weights in directories of their own, for configs that
    // serve them under other names (an adapter's directory must not be another's).
    common::llama_root(
        root,
        &[
            ("a_r8_all", "fr"),
            ("b_r4_qv", "js"),
            ("c_r16_mlp", "extra"),
            ("c_r16_mlp", "extra2"),
            ("c_r16_mlp", "extra3"),
            ("a_r8_all", "fr2"),
        ],
    );
    // Trained on another base whose shapes fit: served, with a warning.
    common::copy_dir(&fx.join("adapters/qwen2/a_r8_all"), &root.join("wrongbase"));
    // Shapes of another model: refused when loaded.
    common::copy_dir(&fx.join("../merge/adapters/plain_r8"), &root.join("misfit"));
    std::fs::create_dir_all(root.join("binonly")).unwrap();
    std::fs::write(root.join("binonly/adapter_config.json"), "{}").unwrap();
    std::fs::write(root.join("binonly/adapter_model.bin"), "x").unwrap();
    std::fs::write(root.join("admin"), "s3cret\n").unwrap();
    dir
}

/// `n` choices: answered whole (every choice indexed, each the text of a request of its own
/// with the seed plus its index, the usage counting the prompt once and every choice's
/// tokens) and streamed (chunks of both choices interleaved by index, each closing with its
/// finish, then one usage chunk and `[DONE]`); more than `maxBatchSize` is refused.
#[tokio::test]
async fn n_choices_are_answered_whole_and_streamed() {
    let s = start("", 4, 64).await;
    let body = |n: u64, seed: u64, stream: bool| {
        json!({"model": "fr", "n": n, "seed": seed, "stream": stream, "max_tokens": 6,
               "ignore_eos": true, "temperature": 0.9,
               "stream_options": if stream { json!({"include_usage": true}) } else { Value::Null },
               "messages": [{"role": "user", "content": "x y"}]})
    };
    let (status, _, whole) = post(&s, "/v1/chat/completions", body(3, 5, false)).await;
    assert_eq!(status, 200, "{whole}");
    let choices = whole["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3, "{whole}");
    let (_, _, one) = post(&s, "/v1/chat/completions", body(1, 5, false)).await;
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i, "{whole}");
        assert_eq!(c["finish_reason"], "length");
        let (_, _, alone) = post(&s, "/v1/chat/completions", body(1, 5 + i as u64, false)).await;
        assert_eq!(
            c["message"]["content"], alone["choices"][0]["message"]["content"],
            "choice {i}"
        );
    }
    assert_eq!(whole["usage"]["completion_tokens"], 18, "{whole}");
    assert_eq!(
        whole["usage"]["prompt_tokens"],
        one["usage"]["prompt_tokens"]
    );

    let r = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", s.url))
        .json(&body(2, 5, true))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    let datas: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(datas.last(), Some(&"[DONE]"));
    let chunks: Vec<Value> = datas[..datas.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let mut texts = [String::new(), String::new()];
    let mut finished = [0, 0];
    for c in &chunks[..chunks.len() - 1] {
        let choice = &c["choices"][0];
        let i = choice["index"].as_u64().unwrap() as usize;
        texts[i].push_str(choice["delta"]["content"].as_str().unwrap_or(""));
        if choice["finish_reason"] == "length" {
            finished[i] += 1;
        }
    }
    assert_eq!(finished, [1, 1], "each choice closes once");
    for (i, t) in texts.iter().enumerate() {
        assert_eq!(
            t,
            choices[i]["message"]["content"].as_str().unwrap(),
            "streamed choice {i}"
        );
    }
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 12, "{usage}");

    let (status, _, refused) = post(&s, "/v1/chat/completions", body(5, 5, false)).await;
    assert_eq!((status, code(&refused)), (400, "invalid_n"), "{refused}");
    assert!(refused["error"]["message"]
        .as_str()
        .unwrap()
        .contains("maxBatchSize"));
    let (status, _, refused) = post(
        &s,
        "/v1/completions",
        json!({"model": "fr", "prompt": "x", "n": 0}),
    )
    .await;
    assert_eq!((status, code(&refused)), (400, "invalid_n"), "{refused}");
}

/// The worker config of [`start`]: adapters fr, js (and whatever `extra_adapters` adds);
/// `batch`/`queue` set the engine's batch and queue sizes.
fn config_yaml(root: &Path, extra_adapters: &str, batch: u32, queue: u32) -> String {
    format!(
        r#"
pool: demo
modelRoot: {root}
baseModel: {{name: llama, path: base, dtype: f32}}
adapters:
  - {{name: fr, version: v1, loraId: 1, path: fr, keywords: [french, bonjour]}}
  - {{name: js, version: v2, loraId: 2, path: js, keywords: [json]}}
{extra_adapters}
router: {{strategies: [explicit, keywords], fallback: base}}
limits: {{maxTokens: 64, maxBodyBytes: 4096, maxSeqLen: 256, requestTimeoutSeconds: 5, maxLoras: 4, maxBatchSize: {batch}, maxQueue: {queue}}}
auth: {{adminTokenFile: {root}/admin}}
"#,
        root = root.display()
    )
}

/// A worker on the tiny Llama (see [`config_yaml`]).
async fn start(extra_adapters: &str, batch: u32, queue: u32) -> Srv {
    start_edited(extra_adapters, batch, queue, |y| y).await
}

/// [`start`] with the config text passed through `edit` first.
async fn start_edited(
    extra_adapters: &str,
    batch: u32,
    queue: u32,
    edit: impl FnOnce(String) -> String,
) -> Srv {
    let dir = fixture_root();
    let yaml = edit(config_yaml(dir.path(), extra_adapters, batch, queue));
    launch(dir, &yaml).await
}

/// Serves `yaml` (written to `<dir>/config.yaml`) until the returned server is dropped.
async fn launch(dir: tempfile::TempDir, yaml: &str) -> Srv {
    launch_with(dir, yaml, |e| e, Duration::from_millis(200), true).await
}

/// [`launch`] with the engine wrapped by `wrap`, the config watcher polling every `poll`
/// (zero: off), and optionally without waiting for `/readyz`.
async fn launch_with(
    dir: tempfile::TempDir,
    yaml: &str,
    wrap: impl FnOnce(EngineHandles) -> EngineHandles,
    poll: Duration,
    wait_ready: bool,
) -> Srv {
    let cfg_path = dir.path().join("config.yaml");
    std::fs::write(&cfg_path, yaml).unwrap();
    let cfg = mole_server::config::load(&cfg_path).unwrap();
    let engine = wrap(build_engine(&cfg).unwrap());
    let auth = Auth::from_config(&cfg).unwrap();
    let state = AppState::new(cfg, engine.clone(), Some(cfg_path.clone()), auth);
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(serve_with(state.clone(), l, cfg_path, poll, async move {
        let _ = rx.await;
    }));
    let srv = Srv {
        url,
        engine,
        state,
        _dir: dir,
        _stop: tx,
        served,
    };
    if wait_ready {
        wait_status(&srv, "/readyz", 200).await;
    }
    srv
}

/// Polls `path` until it answers `status` (10 s at most).
async fn wait_status(s: &Srv, path: &str, status: u16) {
    let c = reqwest::Client::new();
    for _ in 0..500 {
        if let Ok(r) = c.get(format!("{}{path}", s.url)).send().await {
            if r.status() == status {
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{path} never answered {status}");
}

async fn post(s: &Srv, path: &str, body: Value) -> (u16, reqwest::header::HeaderMap, Value) {
    let r = reqwest::Client::new()
        .post(format!("{}{path}", s.url))
        .json(&body)
        .send()
        .await
        .unwrap();
    let (st, h) = (r.status().as_u16(), r.headers().clone());
    (st, h, r.json().await.unwrap_or(Value::Null))
}

/// An upstream merged pod: a second server, serving adapter `mg` itself.
async fn merged_upstream() -> Srv {
    start(
        "  - {name: mg, version: v1, loraId: 3, path: extra}",
        16,
        64,
    )
    .await
}

/// POST `body` to `path`, which must answer 200; the body's text (a stream's whole text).
async fn post_stream(s: &Srv, path: &str, body: &Value) -> String {
    let r = reqwest::Client::new()
        .post(format!("{}{path}", s.url))
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.text().await.unwrap()
}

/// Each `(path, body, status, code)`: POSTed, refused with that status and error code, and a
/// message.
async fn assert_refusals<'a>(
    s: &Srv,
    cases: impl IntoIterator<Item = (&'a str, Value, u16, &'a str)>,
) {
    for (path, body, status, code) in cases {
        let (st, _, b) = post(s, path, body.clone()).await;
        assert_eq!(
            (st, b["error"]["code"].as_str().unwrap_or("")),
            (status, code),
            "{path} {body}: {b}"
        );
        assert!(
            b["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{path} {body}: {b}"
        );
    }
}

/// A chat of one user message `x` to `demo`, 2 tokens at most, with the fields of `extra`.
fn chat(extra: Value) -> Value {
    with_fields(
        json!({"model": "demo", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}),
        extra,
    )
}

/// `base` (a JSON object) with the fields of `extra` (one too) set on it.
fn with_fields(mut base: Value, extra: Value) -> Value {
    base.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    base
}

fn content(b: &Value) -> String {
    b["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string()
}

#[tokio::test]
async fn chat_routes_and_answers() {
    let s = start("", 16, 64).await;
    let ask = |model: &str, text: &str, max: u32| json!({"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max, "ignore_eos": true, "temperature": 0});
    let (st, h, b) = post(&s, "/v1/chat/completions", ask("demo", "say bonjour", 10)).await;
    assert_eq!(st, 200, "{b}");
    assert_eq!(h["x-mole-adapter"], "fr");
    assert_eq!(h["x-mole-route"], "keywords");
    assert_eq!(h["x-mole-mode"], "dynamic");
    assert_eq!(b["choices"][0]["finish_reason"], "length");
    assert_eq!(b["usage"]["completion_tokens"], 10);
    // The byte-level template: "<user>say bonjour\n<assistant>" is 29 tokens.
    assert_eq!(b["usage"]["prompt_tokens"], 29);
    assert_eq!(b["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(b["mole"]["adapter_version"], "v1");
    // Greedy is deterministic; the adapter changes the answer.
    let routed = content(&b);
    let (_, _, again) = post(&s, "/v1/chat/completions", ask("fr", "say bonjour", 10)).await;
    assert_eq!(content(&again), routed);
    // The same prompt under the same adapter: every token but its last from the prefix
    // cache, reported as OpenAI, vLLM and llama.cpp report it.
    assert_eq!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"], 28,
        "{again}"
    );
    let (_, h, base) = post(&s, "/v1/chat/completions", ask("llama", "say bonjour", 10)).await;
    assert_eq!(h["x-mole-mode"], "base");
    assert_ne!(
        content(&base),
        routed,
        "the fr adapter must change the output"
    );
    // Explicit adapter, truncated by max_tokens.
    let (st, _, b) = post(&s, "/v1/chat/completions", ask("js", "a b c d", 2)).await;
    assert_eq!(st, 200);
    assert_eq!(b["choices"][0]["finish_reason"], "length");
    assert_eq!(b["usage"]["completion_tokens"], 2);
    // Unmatched text falls back to base.
    let (_, h, _) = post(
        &s,
        "/v1/chat/completions",
        json!({"model": "demo", "messages": [{"role": "user", "content": "hello"}]}),
    )
    .await;
    assert_eq!(
        (
            h["x-mole-route"].to_str().unwrap(),
            h["x-mole-mode"].to_str().unwrap()
        ),
        ("fallback", "base")
    );
    // Completions with token ids: the fixture's reference prompt.
    let prompt = [5, 17, 99, 3, 250, 42, 7, 7, 128, 64, 33, 1];
    let (st, _, b) = post(
        &s,
        "/v1/completions",
        json!({"model": "llama", "prompt": prompt, "max_tokens": 5, "ignore_eos": true}),
    )
    .await;
    assert_eq!(st, 200, "{b}");
    assert_eq!(b["usage"]["prompt_tokens"], 12);
    assert_eq!(b["usage"]["completion_tokens"], 5);
    assert!(b["choices"][0]["text"].is_string());
    // Route only.
    let (st, _, b) = post(&s, "/v1/route", json!({"input": "to json please"})).await;
    assert_eq!((st, b["adapter"].as_str()), (200, Some("js")));
    // The seeds' /infer call: routed by the prompt, or by `expert`.
    let (st, _, b) = post(
        &s,
        "/infer",
        json!({"prompt": "say bonjour", "max_tokens": 3, "temperature": 0}),
    )
    .await;
    assert_eq!(st, 200, "{b}");
    assert_eq!(
        (
            b["routed_adapter"].as_str(),
            b["mode"].as_str(),
            b["route"].as_str()
        ),
        (Some("fr"), Some("dynamic"), Some("keywords"))
    );
    assert_eq!(b["adapter_version"], "v1");
    assert!(b["task_output"].is_string(), "{b}");
    let (_, _, b) = post(
        &s,
        "/infer",
        json!({"prompt": "say bonjour", "expert": "js", "max_tokens": 3}),
    )
    .await;
    assert_eq!(b["routed_adapter"], "js");
    // A text model refuses any image first (a vision model reads it: vision_serve).
    let (st, _, b) = post(&s, "/infer", json!({"prompt": "x", "image_b64": "@@@"})).await;
    assert_eq!(
        (st, b["error"]["code"].as_str()),
        (400, Some("images_not_supported"))
    );
    let (st, _, b) = post(
        &s,
        "/infer",
        json!({"prompt": "x", "image_b64": "aGVsbG8="}),
    )
    .await;
    assert_eq!(
        (st, b["error"]["code"].as_str()),
        (400, Some("images_not_supported"))
    );
}

#[tokio::test]
async fn stream_sends_chunks_usage_and_done() {
    let s = start("", 16, 64).await;
    let body = |stream: bool| json!({"model": "fr", "stream": stream, "max_tokens": 12, "ignore_eos": true, "temperature": 0, "messages": [{"role": "user", "content": "x y"}]});
    // The `data:` payloads of a streamed answer to `b`.
    let events = |b: Value| {
        let url = format!("{}/v1/chat/completions", s.url);
        async move {
            let r = reqwest::Client::new()
                .post(url)
                .json(&b)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            assert_eq!(r.headers()["x-mole-adapter"], "fr");
            let text = r.text().await.unwrap();
            let datas: Vec<String> = text
                .lines()
                .filter_map(|l| l.strip_prefix("data: ").map(String::from))
                .collect();
            assert_eq!(datas.last().unwrap(), "[DONE]");
            datas[..datas.len() - 1]
                .iter()
                .map(|d| serde_json::from_str::<Value>(d).unwrap())
                .collect::<Vec<Value>>()
        }
    };
    let chunks = events(body(true)).await;
    let mut text = String::new();
    for v in &chunks {
        assert_eq!(v["object"], "chat.completion.chunk");
        assert!(v.get("usage").is_none(), "usage only when asked: {v}");
        text.push_str(v["choices"][0]["delta"]["content"].as_str().unwrap_or(""));
    }
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert_eq!(last["mole"]["adapter"], "fr");
    // OpenAI's `include_usage`: one more chunk, no choices, the usage.
    let mut asked = body(true);
    asked["stream_options"] = json!({"include_usage": true});
    let with_usage = events(asked).await;
    assert_eq!(with_usage.len(), chunks.len() + 1);
    let u = with_usage.last().unwrap();
    assert_eq!(u["choices"], json!([]), "{u}");
    assert_eq!(u["usage"]["completion_tokens"], 12, "{u}");
    let finish = &with_usage[with_usage.len() - 2];
    assert_eq!(finish["choices"][0]["finish_reason"], "length");
    // The stream carries exactly the text of the non-streamed answer.
    let (_, _, whole) = post(&s, "/v1/chat/completions", body(false)).await;
    assert_eq!(text, content(&whole));
}

#[tokio::test]
async fn bad_input_battery_keeps_serving() {
    let s = start("", 16, 64).await;
    let c = reqwest::Client::new();
    let raw = |body: &'static str| {
        c.post(format!("{}/v1/chat/completions", s.url))
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    let r = raw("{not json").await.unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(
        r.json::<Value>().await.unwrap()["error"]["code"],
        "invalid_json"
    );
    let msg = |c: Value| json!({"model": "demo", "messages": [{"role": "user", "content": c}]});
    let cases: Vec<(&str, Value, u16, &str)> = vec![
        (
            "/v1/chat/completions",
            json!({"model": "demo", "messages": "hi"}),
            400,
            "invalid_request",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "demo", "messages": []}),
            400,
            "empty_messages",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
            404,
            "model_not_found",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "demo", "max_tokens": 65, "messages": [{"role": "user", "content": "x"}]}),
            400,
            "max_tokens_exceeded",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "demo", "temperature": "hot", "messages": [{"role": "user", "content": "x"}]}),
            400,
            "invalid_request",
        ),
        (
            "/v1/chat/completions",
            msg(
                json!([{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}]),
            ),
            400,
            "images_not_supported",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "demo", "messages": [{"role": "wizard", "content": "x"}]}),
            400,
            "invalid_role",
        ),
        (
            "/v1/completions",
            json!({"model": "demo", "prompt": [999999]}),
            400,
            "invalid_token_id",
        ),
        (
            "/v1/completions",
            json!({"model": "demo", "prompt": 5}),
            400,
            // A field of the wrong shape is refused with the field's own code.
            "invalid_prompt",
        ),
        (
            "/v1/completions",
            json!({"model": "demo", "prompt": "w ".repeat(250), "max_tokens": 10}),
            400,
            "prompt_too_long",
        ),
        (
            "/v1/load_lora_adapter",
            json!({"lora_name": "x", "lora_path": "fr"}),
            401,
            "invalid_admin_token",
        ),
        (
            "/v1/completions",
            json!({"model": "demo", "prompt": "x", "stop_token_ids": (0..65).collect::<Vec<u32>>()}),
            400,
            "invalid_stop_token_ids",
        ),
        // OpenAI and vLLM answer at most 20 top logprobs, and only when logprobs are asked.
        (
            "/v1/chat/completions",
            json!({"model": "demo", "logprobs": true, "top_logprobs": 100, "messages": [{"role": "user", "content": "x"}]}),
            400,
            "invalid_top_logprobs",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "demo", "top_logprobs": 2, "messages": [{"role": "user", "content": "x"}]}),
            400,
            "invalid_top_logprobs",
        ),
        (
            "/v1/completions",
            json!({"model": "demo", "prompt": "x", "logprobs": 21}),
            400,
            "invalid_logprobs",
        ),
        // Only an assistant message may come without content (its tool calls say the rest).
        (
            "/v1/chat/completions",
            json!({"model": "demo", "messages": [{"role": "user", "content": null}]}),
            400,
            "missing_content",
        ),
        (
            "/tokenize",
            json!({"model": "demo"}),
            400,
            "invalid_request",
        ),
        // The router validates the messages it is given, even beside an input.
        (
            "/v1/route",
            json!({"input": "x", "messages": [{"role": "wizard", "content": "x"}]}),
            400,
            "invalid_role",
        ),
        // A text pool refuses an image part before its URL is read (the URL checks:
        // server_hostile.rs, on a vision pool).
        (
            "/v1/chat/completions",
            msg(
                json!([{"type": "image_url", "image_url": {"url": "http://169.254.169.254\\@img.example.com/x.png"}}]),
            ),
            400,
            "images_not_supported",
        ),
        // Every sampling bound is checked before routing, each with its own code (these were
        // the engine's plain invalid_request after routing, or the router's 404 first).
        (
            "/v1/chat/completions",
            json!({"model": "demo", "min_p": 1.5, "messages": [{"role": "user", "content": "x"}]}),
            400,
            "invalid_min_p",
        ),
        (
            "/v1/completions",
            json!({"model": "demo", "prompt": "x", "presence_penalty": -2.5}),
            400,
            "invalid_presence_penalty",
        ),
        (
            "/v1/completions",
            json!({"model": "demo", "prompt": "x", "frequency_penalty": 2.5}),
            400,
            "invalid_frequency_penalty",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "demo", "repetition_penalty": 0, "messages": [{"role": "user", "content": "x"}]}),
            400,
            "invalid_repetition_penalty",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "nope", "min_p": -0.5, "messages": [{"role": "user", "content": "x"}]}),
            400,
            "invalid_min_p",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "nope", "n": 17, "messages": [{"role": "user", "content": "x"}]}),
            400,
            "invalid_n",
        ),
        (
            "/v1/completions",
            json!({"model": "nope", "prompt": "w ".repeat(250), "max_tokens": 10}),
            400,
            "prompt_too_long",
        ),
        (
            "/v1/completions",
            json!({"model": "demo", "prompt": ""}),
            400,
            "invalid_prompt",
        ),
    ];
    assert_refusals(&s, cases).await;
    // No max_tokens and a long prompt: the answer gets what the 128-token context leaves.
    let (st, _, b) = post(&s, "/v1/chat/completions", msg(json!("y".repeat(90)))).await;
    assert_eq!(st, 200, "{b}");
    assert!(b["usage"]["total_tokens"].as_u64().unwrap() <= 128, "{b}");
    // Huge body: 413 with the JSON error.
    let big =
        json!({"model": "demo", "messages": [{"role": "user", "content": "x".repeat(10_000)}]});
    let (st, _, b) = post(&s, "/v1/chat/completions", big).await;
    assert_eq!(
        (st, b["error"]["code"].as_str()),
        (413, Some("body_too_large"))
    );
    // Admin: traversal, symlink escape and pickle-only are refused with the token.
    let adm = |body: Value| {
        c.post(format!("{}/v1/load_lora_adapter", s.url))
            .bearer_auth("s3cret")
            .json(&body)
            .send()
    };
    // A load that must succeed.
    let load = |body: Value| {
        let sent = adm(body);
        async {
            assert_eq!(sent.await.unwrap().status(), 200);
        }
    };
    // The adapter listing, as the operator reads it (with the token).
    let listing = || async {
        c.get(format!("{}/v1/lora_adapters", s.url))
            .bearer_auth("s3cret")
            .send()
            .await
            .unwrap()
            .json::<Value>()
            .await
            .unwrap()
    };
    for (path, code) in [
        ("../../etc", "path_outside_root"),
        ("/etc", "path_outside_root"),
        ("binonly", "safetensors_required"),
        ("base", "adapter_path_overlaps"),
        ("fr", "adapter_path_overlaps"),
    ] {
        let r = adm(json!({"lora_name": "x", "lora_path": path}))
            .await
            .unwrap();
        assert_eq!(r.status(), 400);
        assert_eq!(
            r.json::<Value>().await.unwrap()["error"]["code"],
            code,
            "{path}"
        );
    }
    // A real adapter of another model's shapes: refused with the reason, nothing else changes.
    let r = adm(json!({"lora_name": "x", "lora_path": "misfit"}))
        .await
        .unwrap();
    assert_eq!(r.status(), 422);
    let e = r.json::<Value>().await.unwrap();
    assert_eq!(e["error"]["code"], "invalid_adapter", "{e}");
    assert!(
        e["error"]["message"].as_str().unwrap().contains("lora_A"),
        "{e}"
    );
    // Trained on a base of another name whose shapes fit: served, the listing warns.
    load(json!({"lora_name": "other", "lora_path": "wrongbase"})).await;
    let l = listing().await;
    let other = l["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["name"] == "other")
        .unwrap();
    assert_eq!(other["loaded"], true, "{other}");
    assert!(
        other["warning"].as_str().unwrap().contains("qwen2"),
        "{other}"
    );
    load(json!({"lora_name": "extra", "lora_path": "extra"})).await;
    let ask_extra = || {
        post(
            &s,
            "/v1/chat/completions",
            json!({"model": "demo", "adapter": "extra", "messages": [{"role": "user", "content": "x"}]}),
        )
    };
    let (st, _, _) = ask_extra().await;
    assert_eq!(st, 200, "an adapter loaded via the API is servable by name");
    // The same call again serves what is held (no read); vLLM's `load_inplace` reads the
    // directory again (its files were replaced): a new id for the same name.
    let extra_id = |l: Value| {
        l["data"]
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["name"] == "extra" && a["loaded"] == true)
            .map(|a| a["lora_id"].as_u64().unwrap())
            .unwrap()
    };
    let first = extra_id(listing().await);
    load(json!({"lora_name": "extra", "lora_path": "extra"})).await;
    assert_eq!(
        extra_id(listing().await),
        first,
        "no reload without load_inplace"
    );
    load(json!({"lora_name": "extra", "lora_path": "extra", "load_inplace": true})).await;
    assert_ne!(
        extra_id(listing().await),
        first,
        "load_inplace read it again"
    );
    let (st, _, _) = ask_extra().await;
    assert_eq!(st, 200, "served after the in-place reload");
    // Still serving.
    let (st, _, _) = post(&s, "/v1/chat/completions", msg(json!("ok"))).await;
    assert_eq!(st, 200);
    let l: Value = c
        .get(format!("{}/v1/lora_adapters", s.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let names: Vec<&str> = l["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["name"].as_str().unwrap())
        .collect();
    // The refused adapter is listed with its reason (the operator shows it on the Adapter).
    assert_eq!(names, ["extra", "fr", "js", "other", "x"]);
    let x = &l["data"][4];
    assert_eq!(x["loaded"], false);
    assert!(x["error"].as_str().unwrap().contains("lora_A"), "{x}");
}

#[tokio::test]
async fn overload_gives_429_and_disconnect_cancels() {
    // One sequence at a time and one waiting: a burst must see 429s, never a crash.
    // Room for long answers (the tiny model's 128 positions): the disconnect below must be
    // seen while the generation still runs.
    let s = start_edited("", 1, 1, |y| y.replace("maxTokens: 64", "maxTokens: 100")).await;
    let c = reqwest::Client::new();
    let body = json!({"model": "fr", "stream": true, "max_tokens": 64, "ignore_eos": true, "messages": [{"role": "user", "content": "a b c d e f"}]});
    let burst = (0..8).map(|_| {
        c.post(format!("{}/v1/chat/completions", s.url))
            .json(&body)
            .send()
    });
    let answers = futures::future::join_all(burst).await;
    let mut ok = 0;
    let mut refused = 0;
    for r in answers {
        let r = r.unwrap();
        match r.status().as_u16() {
            200 => {
                ok += 1;
                // Read to the end: the stream finishes normally.
                assert!(r.text().await.unwrap().ends_with("data: [DONE]\n\n"));
            }
            429 => {
                refused += 1;
                assert_eq!(r.headers()["retry-after"], "1");
                assert_eq!(
                    r.json::<Value>().await.unwrap()["error"]["code"],
                    "overloaded"
                );
            }
            other => panic!("unexpected status {other}"),
        }
    }
    assert!(ok >= 1 && refused >= 1, "ok {ok}, refused {refused}");
    // A client that goes away cancels its generation in the engine. The tiny model can
    // finish 100 tokens before the server sees the connection close (a write or two later),
    // so a few tries: one cancellation proves it, none in all of them is a failure.
    let long = json!({"model": "fr", "stream": true, "max_tokens": 100, "ignore_eos": true, "messages": [{"role": "user", "content": "a"}]});
    let before = s.engine.info.stats().cancelled;
    for _ in 0..20 {
        let mut r1 = c
            .post(format!("{}/v1/chat/completions", s.url))
            .json(&long)
            .send()
            .await
            .unwrap();
        assert_eq!(r1.status(), 200);
        r1.chunk().await.unwrap();
        drop(r1);
        for _ in 0..25 {
            if s.engine.info.stats().cancelled > before || s.engine.info.stats().running == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if s.engine.info.stats().cancelled > before {
            break;
        }
    }
    assert!(
        s.engine.info.stats().cancelled > before,
        "client disconnect must cancel"
    );
    // And the server keeps serving.
    let (st, _, _) = post(
        &s,
        "/v1/chat/completions",
        json!({"model": "fr", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!(st, 200);
}

#[tokio::test]
async fn metrics_models_and_reload() {
    let s = start("", 16, 64).await;
    let c = reqwest::Client::new();
    post(
        &s,
        "/v1/chat/completions",
        json!({"model": "fr", "max_tokens": 4, "ignore_eos": true, "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    // Names a client makes up never become label values.
    let (st, _, _) = post(
        &s,
        "/v1/chat/completions",
        json!({"model": "made-up-name", "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!(st, 404);
    let (st, _, _) = post(
        &s,
        "/v1/chat/completions",
        json!({"model": "llama", "max_tokens": 65, "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!(st, 400);
    let m = c
        .get(format!("{}/metrics", s.url))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    // scripts/checks/server.sh runs promtool on this scrape.
    if let Ok(out) = std::env::var("MOLE_SCRAPE_OUT") {
        std::fs::write(out, &m).unwrap();
    }
    assert!(m.contains("mole_requests_total{adapter=\"fr\",endpoint=\"chat\",mode=\"dynamic\",route=\"explicit\",status=\"200\"} 1"), "{m}");
    assert!(!m.contains("made-up-name"), "{m}");
    assert!(
        m.contains("mole_errors_total{code=\"model_not_found\"} 1"),
        "{m}"
    );
    for want in [
        "mole_adapter_load_duration_seconds_count{result=\"ok\"} 2",
        "mole_config_restart_required 0",
        "mole_ready 1",
        "mole_inter_token_latency_seconds_count{adapter=\"fr\"} 3",
        "mole_time_to_first_token_seconds_count{adapter=\"fr\"} 1",
        "mole_tokens_total{adapter=\"fr\",kind=\"completion\"} 4",
        "mole_adapter_loads_total{result=\"ok\"} 2",
        "mole_adapter_versions{residency=\"cpu\"} 2",
        "mole_requests_cancelled_total 0",
        "mole_batch_size 1",
        // What a Gateway API Inference Extension endpoint picker reads by default.
        "vllm:num_requests_waiting 0",
        "vllm:num_requests_running 0",
        "vllm:kv_cache_usage_perc ",
    ] {
        assert!(m.contains(want), "{want} missing:\n{m}");
    }
    // The adapter lists depend on the moment of the scrape; the series and its slots do not.
    assert!(
        m.contains("vllm:lora_requests_info{max_lora=\"4\",running_lora_adapters=\""),
        "{m}"
    );
    let models: Value = c
        .get(format!("{}/v1/models", s.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["demo", "llama", "fr", "js"]);
    // The weights as held, on the pool's and the base's cards (the gauge's number), not on
    // the adapters'.
    let held = s.engine.info.stats().weights_bytes.unwrap();
    assert!(held > 0);
    assert_eq!(models["data"][0]["mole"]["weights_bytes"], json!(held));
    assert_eq!(models["data"][1]["mole"]["weights_bytes"], json!(held));
    assert!(models["data"][2]["mole"].get("weights_bytes").is_none());
    assert!(m.contains(&format!("mole_weights_bytes {held}")), "{m}");
    // Admin reload without token: 401; the watcher picks up a removed adapter.
    let r = c
        .post(format!("{}/admin/reload", s.url))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let p = s._dir.path().join("config.yaml");
    let y = std::fs::read_to_string(&p).unwrap().replace(
        "  - {name: js, version: v2, loraId: 2, path: js, keywords: [json]}\n",
        "",
    );
    std::fs::write(&p, y).unwrap();
    let has_js = || s.engine.admin.adapters().iter().any(|a| a.name == "js");
    for _ in 0..50 {
        if !has_js() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!has_js());
    let (st, _, _) = post(
        &s,
        "/v1/chat/completions",
        json!({"model": "js", "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!(st, 404);
}

#[tokio::test]
async fn merged_adapter_is_proxied_and_falls_back() {
    let up = merged_upstream().await;
    let extra = format!("  - {{name: mg, version: v1, loraId: 3, path: extra, mode: merged, mergedEndpoint: \"{}\", keywords: [merge]}}\n  - {{name: dead, version: v1, loraId: 4, path: extra, mode: merged, mergedEndpoint: \"http://127.0.0.1:1\", load: false}}\n  - {{name: dead2, version: v1, loraId: 5, path: extra2, mode: merged, mergedEndpoint: \"http://127.0.0.1:1\"}}", up.url);
    let s = start(&extra, 16, 64).await;
    // Forwarded to the upstream, which serves mg itself: the same answer as asking it directly.
    let ask = json!({"model": "mg", "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": "x"}]});
    let (st, h, b) = post(&s, "/v1/chat/completions", ask.clone()).await;
    assert_eq!(h["x-mole-route"], "explicit+proxy");
    assert_eq!(st, 200, "{b}");
    let (_, _, direct) = post(&up, "/v1/chat/completions", ask).await;
    assert_eq!(content(&b), content(&direct));
    // The merged pods go away: the same request is served here, no client-visible failure.
    drop(up);
    let (st, h, b) = post(
        &s,
        "/v1/chat/completions",
        json!({"model": "mg", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!(st, 200, "{b}");
    assert_eq!(h["x-mole-route"], "explicit");
    assert_eq!(h["x-mole-adapter"], "mg");
    // Dead endpoint, not loaded locally: 503 naming the reason.
    let (st, _, b) = post(
        &s,
        "/v1/chat/completions",
        json!({"model": "dead", "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!(
        (st, b["error"]["code"].as_str()),
        (503, Some("merged_unavailable"))
    );
    // Dead endpoint, loaded locally: served here.
    let (st, h, b) = post(
        &s,
        "/v1/chat/completions",
        json!({"model": "dead2", "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!(st, 200, "{b}");
    assert_eq!(h["x-mole-adapter"], "dead2");
}

#[tokio::test]
async fn merged_pod_serves_the_merge_tool_output_as_the_adapter() {
    // The dynamic pool pod, and a merged pod on `mole-worker merge`'s output for fr.
    let dynamic = start("", 16, 64).await;
    let dir = tempfile::tempdir().unwrap();
    let fx = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/engine");
    let root = dir.path();
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_mole-worker"))
        .args(["merge", "--base"])
        .arg(fx.join("llama"))
        .arg("--adapter")
        .arg(fx.join("adapters/llama/a_r8_all"))
        .arg("--out")
        .arg(root.join("merged/fr/v1"))
        .status()
        .unwrap();
    assert!(status.success());
    // The merge tool carries the tokenizer and chat template over with the config.
    assert!(root.join("merged/fr/v1/tokenizer.json").is_file());
    let yaml = format!(
        "mode: merged\npool: demo\nmodelRoot: {}\nbaseModel: {{name: llama, path: merged/fr/v1, dtype: f32}}\nmerged: {{adapter: fr, version: v1, path: merged/fr/v1}}\nlimits: {{maxTokens: 64, maxSeqLen: 256}}\n",
        root.display()
    );
    let merged = launch(dir, &yaml).await;
    let ask = |model: &str| json!({"model": model, "max_tokens": 16, "ignore_eos": true, "temperature": 0, "messages": [{"role": "user", "content": "merge me"}]});
    let (st, h, m) = post(&merged, "/v1/chat/completions", ask("fr")).await;
    assert_eq!(st, 200, "{m}");
    assert_eq!(
        (
            h["x-mole-adapter"].to_str().unwrap(),
            h["x-mole-mode"].to_str().unwrap()
        ),
        ("fr", "merged")
    );
    assert_eq!(m["mole"]["adapter_version"], "v1");
    let (_, _, d) = post(&dynamic, "/v1/chat/completions", ask("fr")).await;
    assert_eq!(
        content(&m),
        content(&d),
        "merged weights and dynamic LoRA give the same greedy text"
    );
    // The pool name routes to the merged adapter; the bare base model is not served here.
    let (_, h, _) = post(&merged, "/v1/chat/completions", ask("demo")).await;
    assert_eq!(h["x-mole-adapter"], "fr");
    let (st, _, _) = post(&merged, "/v1/chat/completions", ask("llama")).await;
    assert_eq!(st, 404);
    // What the operator reads to mark the merged pods ready.
    let l: mole_api::LoraAdaptersResponse =
        reqwest::get(format!("{}/v1/lora_adapters", merged.url))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
    assert!(l.is_loaded("fr", "v1"), "{l:?}");
}

#[tokio::test]
async fn local_mode_merges_merged_adapters_in_process() {
    // fm: the fr adapter configured `mode: merged` with no merged pods: a local worker merges it
    // itself and serves it from the merged weights, beside fr served dynamically.
    let s = start(
        "  - {name: fm, version: v1, loraId: 3, path: fr2, mode: merged}",
        16,
        64,
    )
    .await;
    assert!(s
        ._dir
        .path()
        .join(".mole-merged/fm/v1/merge_metadata.json")
        .is_file());
    let ask = |model: &str| json!({"model": model, "max_tokens": 16, "ignore_eos": true, "temperature": 0, "messages": [{"role": "user", "content": "merge me"}]});
    let (st, h, m) = post(&s, "/v1/chat/completions", ask("fm")).await;
    assert_eq!(st, 200, "{m}");
    assert_eq!(h["x-mole-mode"], "merged");
    assert_eq!(m["mole"]["adapter_version"], "v1");
    let (_, h, d) = post(&s, "/v1/chat/completions", ask("fr")).await;
    assert_eq!(h["x-mole-mode"], "dynamic");
    assert_eq!(content(&m), content(&d));
}

/// The real engine with adapter loads held until the gate opens (a slow load, in a test), and,
/// with `fail`, every request failing after it was accepted (as a failed forward pass fails
/// its rows). Only serving and adapter admin are wrapped; the rest is the real engine's.
struct GatedEngine {
    inner: EngineHandles,
    open: Arc<(std::sync::Mutex<bool>, std::sync::Condvar)>,
    fail: bool,
}

impl GatedEngine {
    fn set(gate: &(std::sync::Mutex<bool>, std::sync::Condvar), open: bool) {
        *gate.0.lock().unwrap() = open;
        gate.1.notify_all();
    }

    /// `inner` with its serving and adapter admin gated.
    fn wrap(
        inner: EngineHandles,
        open: Arc<(std::sync::Mutex<bool>, std::sync::Condvar)>,
        fail: bool,
    ) -> EngineHandles {
        let gated = Arc::new(GatedEngine {
            inner: inner.clone(),
            open,
            fail,
        });
        EngineHandles {
            serving: gated.clone(),
            admin: gated,
            ..inner
        }
    }
}

impl Serving for GatedEngine {
    fn submit(&self, req: GenerateRequest) -> Result<EventStream, EngineError> {
        if !self.fail {
            return self.inner.serving.submit(req);
        }
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let failed = EngineError::Internal("forward pass failed".into());
        tx.send(TokenEvent::Error(failed)).unwrap();
        Ok(rx)
    }
    fn score_labels(
        &self,
        a: Option<&str>,
        p: &str,
        l: &[String],
        i: &[Image],
    ) -> Result<Vec<f32>, EngineError> {
        self.inner.serving.score_labels(a, p, l, i)
    }
}

impl AdapterAdmin for GatedEngine {
    fn load_adapter(&self, spec: AdapterSpec) -> Result<(), EngineError> {
        let (m, cv) = &*self.open;
        let _g = cv.wait_while(m.lock().unwrap(), |open| !*open).unwrap();
        self.inner.admin.load_adapter(spec)
    }
    fn unload_adapter(&self, name: &str) -> Result<(), EngineError> {
        self.inner.admin.unload_adapter(name)
    }
    fn adapters(&self) -> Vec<mole_api::LoraAdapterInfo> {
        self.inner.admin.adapters()
    }
}

async fn get(s: &Srv, path: &str, token: Option<&str>) -> (u16, Value) {
    let mut r = reqwest::Client::new().get(format!("{}{path}", s.url));
    if let Some(t) = token {
        r = r.bearer_auth(t);
    }
    let r = r.send().await.unwrap();
    let st = r.status().as_u16();
    let text = r.text().await.unwrap();
    (
        st,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

async fn post_auth(s: &Srv, path: &str, token: Option<&str>, body: Value) -> (u16, Value) {
    let mut r = reqwest::Client::new()
        .post(format!("{}{path}", s.url))
        .json(&body);
    if let Some(t) = token {
        r = r.bearer_auth(t);
    }
    let r = r.send().await.unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

/// The worker's `/metrics` text.
async fn scrape(s: &Srv) -> String {
    reqwest::get(format!("{}/metrics", s.url))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

fn code(b: &Value) -> &str {
    b["error"]["code"].as_str().unwrap_or("")
}

#[tokio::test]
async fn readiness_waits_for_loads_and_a_refused_adapter_does_not_block_it() {
    let gate = Arc::new((std::sync::Mutex::new(false), std::sync::Condvar::new()));
    let dir = fixture_root();
    let yaml = config_yaml(
        dir.path(),
        "  - {name: bad, version: v1, loraId: 3, path: misfit}",
        16,
        64,
    );
    let g = gate.clone();
    let s = launch_with(
        dir,
        &yaml,
        move |inner| GatedEngine::wrap(inner, g, false),
        Duration::from_millis(100),
        false,
    )
    .await;
    // Loads pending: alive, not ready, requests refused with not_ready.
    wait_status(&s, "/healthz", 200).await;
    let (st, b) = get(&s, "/readyz", None).await;
    assert_eq!((st, code(&b)), (503, "not_ready"), "{b}");
    let ask = |m: &str| json!({"model": m, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]});
    let (st, h, b) = post(&s, "/v1/chat/completions", ask("fr")).await;
    assert_eq!((st, code(&b)), (503, "not_ready"), "{b}");
    assert_eq!(h["retry-after"], "1");
    // Loads done; one adapter was refused (another base): ready anyway, the refusal listed.
    GatedEngine::set(&gate, true);
    wait_status(&s, "/readyz", 200).await;
    let (st, l) = get(&s, "/v1/lora_adapters", None).await;
    assert_eq!(st, 200);
    let bad = l["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["name"] == "bad")
        .unwrap();
    assert_eq!(bad["loaded"], false);
    assert!(bad["error"].as_str().unwrap().contains("lora_A"), "{bad}");
    assert_eq!(post(&s, "/v1/chat/completions", ask("fr")).await.0, 200);
    // Asking for it says it failed to load, and why, instead of "not found".
    let (st, _, b) = post(&s, "/v1/chat/completions", ask("bad")).await;
    assert_eq!((st, code(&b)), (503, "adapter_load_failed"), "{b}");
    assert!(
        b["error"]["message"].as_str().unwrap().contains("lora_A"),
        "{b}"
    );
    // A reload that adds an adapter: the pod stays ready while it loads (every pod of a pool
    // reloads at once; unready pods would empty the Service) and keeps serving the others;
    // the new adapter is reported loaded only when it is.
    GatedEngine::set(&gate, false);
    let p = s._dir.path().join("config.yaml");
    let y = std::fs::read_to_string(&p).unwrap().replace(
        "  - {name: bad,",
        "  - {name: extra, version: v1, loraId: 4, path: extra}\n  - {name: bad,",
    );
    std::fs::write(&p, y).unwrap();
    let extra_loaded = |b: &serde_json::Value| {
        b["data"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a["name"] == "extra" && a["loaded"] == true)
    };
    for _ in 0..10 {
        tokio::time::sleep(std::time::Duration::from_millis(150)).await;
        assert_eq!(get(&s, "/readyz", None).await.0, 200);
        assert!(!extra_loaded(&get(&s, "/v1/lora_adapters", None).await.1));
    }
    assert_eq!(post(&s, "/v1/chat/completions", ask("fr")).await.0, 200);
    GatedEngine::set(&gate, true);
    for i in 0.. {
        if extra_loaded(&get(&s, "/v1/lora_adapters", None).await.1) {
            break;
        }
        assert!(i < 100, "extra never loaded");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(get(&s, "/readyz", None).await.0, 200);
    assert_eq!(post(&s, "/v1/chat/completions", ask("extra")).await.0, 200);
}

#[tokio::test]
async fn operator_token_and_reload_with_config_hash() {
    // API keys required, no admin token: only the operator token opens reload and unload.
    let s = start_edited("", 16, 64, |y| {
        let root = y
            .lines()
            .find_map(|l| l.strip_prefix("modelRoot: "))
            .unwrap()
            .to_string();
        std::fs::write(format!("{root}/keys"), "user-key\n").unwrap();
        std::fs::write(format!("{root}/op"), "op-token\n").unwrap();
        y.replace(
            &format!("auth: {{adminTokenFile: {root}/admin}}"),
            &format!("auth: {{apiKeysFile: {root}/keys, operatorTokenFile: {root}/op}}"),
        )
    })
    .await;
    for (token, status) in [
        (None, 401),
        (Some("wrong"), 401),
        (Some("user-key"), 200),
        (Some("op-token"), 200),
    ] {
        let (st, b) = get(&s, "/v1/lora_adapters", token).await;
        assert_eq!(st, status, "{token:?} {b}");
        if st == 401 {
            assert_eq!(code(&b), "invalid_api_key");
        }
    }
    // The operator token is not an API key.
    let (st, b) = post_auth(
        &s,
        "/v1/chat/completions",
        Some("op-token"),
        json!({"model": "fr", "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!((st, code(&b)), (401, "invalid_api_key"));
    // Nor the admin token of the load API (none configured).
    let (st, b) = post_auth(
        &s,
        "/v1/load_lora_adapter",
        Some("op-token"),
        json!({"lora_name": "x", "lora_path": "extra"}),
    )
    .await;
    assert_eq!((st, code(&b)), (403, "admin_disabled"));
    let (st, b) = post_auth(&s, "/admin/reload", Some("user-key"), json!({})).await;
    assert_eq!((st, code(&b)), (401, "invalid_admin_token"));
    // The file changes (js removed); the operator expects another content: 409, nothing
    // changes.
    let p = s._dir.path().join("config.yaml");
    let y = std::fs::read_to_string(&p).unwrap().replace(
        "  - {name: js, version: v2, loraId: 2, path: js, keywords: [json]}\n",
        "",
    );
    std::fs::write(&p, &y).unwrap();
    let file_hash = mole_server::config::read(&p).unwrap().content_hash();
    let (st, b) = post_auth(
        &s,
        "/admin/reload",
        Some("op-token"),
        json!({"configHash": "0123456789abcdef"}),
    )
    .await;
    assert_eq!((st, code(&b)), (409, "config_stale"), "{b}");
    let msg = b["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains(&file_hash) && msg.contains("0123456789abcdef"),
        "{msg}"
    );
    assert!(s.engine.admin.adapters().iter().any(|a| a.name == "js"));
    // The expected content: applied, and the answer carries the applied hash.
    let (st, b) = post_auth(
        &s,
        "/admin/reload",
        Some("op-token"),
        json!({"configHash": file_hash}),
    )
    .await;
    assert_eq!(st, 200, "{b}");
    assert_eq!(
        (b["changed"].as_bool(), b["configHash"].as_str()),
        (Some(true), Some(file_hash.as_str()))
    );
    assert!(!s.engine.admin.adapters().iter().any(|a| a.name == "js"));
    // Unload through the operator token.
    let (st, b) = post_auth(
        &s,
        "/v1/unload_lora_adapter",
        Some("op-token"),
        json!({"lora_name": "fr"}),
    )
    .await;
    assert_eq!(st, 200, "{b}");
    assert!(!s.engine.admin.adapters().iter().any(|a| a.name == "fr"));
    let m = scrape(&s).await;
    for want in [
        "mole_config_reloads_total{result=\"stale\"} 1",
        "mole_config_reloads_total{result=\"changed\"} 1",
    ] {
        assert!(m.contains(want), "{want}\n{m}");
    }
}

#[tokio::test]
async fn admin_token_reload_without_body_and_unload_disabled_without_tokens() {
    let s = start("", 16, 64).await;
    let (st, b) = {
        let r = reqwest::Client::new()
            .post(format!("{}/admin/reload", s.url))
            .bearer_auth("s3cret")
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.json::<Value>().await.unwrap())
    };
    assert_eq!(st, 200, "{b}");
    assert_eq!(b["changed"], false);
    let (st, b) = post_auth(
        &s,
        "/v1/unload_lora_adapter",
        Some("s3cret"),
        json!({"lora_name": "js"}),
    )
    .await;
    assert_eq!((st, b["status"].as_str()), (200, Some("unloaded")));
    let (st, b) = post_auth(
        &s,
        "/v1/unload_lora_adapter",
        Some("s3cret"),
        json!({"lora_name": "js"}),
    )
    .await;
    assert_eq!((st, code(&b)), (404, "adapter_not_found"));
    // No admin and no operator token: the admin endpoints are off.
    let s = start_edited("", 16, 64, |y| {
        y.lines()
            .filter(|l| !l.starts_with("auth:"))
            .collect::<Vec<_>>()
            .join("\n")
    })
    .await;
    for path in [
        "/v1/unload_lora_adapter",
        "/v1/load_lora_adapter",
        "/admin/reload",
    ] {
        let (st, b) = post_auth(
            &s,
            path,
            Some("s3cret"),
            json!({"lora_name": "js", "lora_path": "js"}),
        )
        .await;
        assert_eq!((st, code(&b)), (403, "admin_disabled"), "{path}");
    }
    assert!(s.engine.admin.adapters().iter().any(|a| a.name == "js"));
}

#[tokio::test]
async fn api_keys_are_checked_and_a_rotated_key_file_is_reread() {
    let s = start_edited("", 16, 64, |y| {
        let root = y
            .lines()
            .find_map(|l| l.strip_prefix("modelRoot: "))
            .unwrap()
            .to_string();
        std::fs::write(format!("{root}/keys"), "k1\n").unwrap();
        y.replace(
            "auth: {adminTokenFile:",
            &format!("auth: {{apiKeysFile: {root}/keys, adminTokenFile:"),
        )
    })
    .await;
    let ask =
        json!({"model": "fr", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]});
    let (st, b) = post_auth(&s, "/v1/chat/completions", None, ask.clone()).await;
    assert_eq!((st, code(&b)), (401, "invalid_api_key"));
    assert_eq!(b["error"]["type"], "authentication_error");
    let (st, b) = post_auth(&s, "/v1/chat/completions", Some("k2"), ask.clone()).await;
    assert_eq!((st, code(&b)), (401, "invalid_api_key"));
    assert_eq!(
        post_auth(&s, "/v1/chat/completions", Some("k1"), ask.clone())
            .await
            .0,
        200
    );
    assert_eq!(get(&s, "/v1/models", None).await.0, 401);
    // The Secret rotates (kubelet: new file, then an atomic rename).
    let root = s._dir.path();
    std::fs::write(root.join("keys.new"), "k2\n").unwrap();
    std::fs::rename(root.join("keys.new"), root.join("keys")).unwrap();
    assert_eq!(
        post_auth(&s, "/v1/chat/completions", Some("k1"), ask.clone())
            .await
            .0,
        401
    );
    assert_eq!(
        post_auth(&s, "/v1/chat/completions", Some("k2"), ask.clone())
            .await
            .0,
        200
    );
    // The admin token is not an API key, but lists adapters.
    assert_eq!(
        post_auth(&s, "/v1/chat/completions", Some("s3cret"), ask)
            .await
            .0,
        401
    );
    assert_eq!(get(&s, "/v1/lora_adapters", Some("s3cret")).await.0, 200);
}

#[tokio::test]
async fn restart_settings_are_reported_not_half_applied() {
    let s = start("", 16, 64).await;
    let p = s._dir.path().join("config.yaml");
    let y = std::fs::read_to_string(&p)
        .unwrap()
        .replace("{name: llama, path: base,", "{name: llama2, path: base,")
        .replace("maxTokens: 64,", "maxTokens: 100,")
        .replace(
            "  - {name: js, version: v2, loraId: 2, path: js, keywords: [json]}\n",
            "",
        );
    std::fs::write(&p, y).unwrap();
    let (st, b) = post_auth(&s, "/admin/reload", Some("s3cret"), json!({})).await;
    assert_eq!(st, 200, "{b}");
    assert_eq!(b["restartRequired"], json!(["baseModel", "limits"]));
    // The adapter change applied; the base model and the limits are the old ones.
    assert!(!s.engine.admin.adapters().iter().any(|a| a.name == "js"));
    assert_eq!(get(&s, "/readyz", None).await.0, 200);
    let (_, m) = get(&s, "/v1/models", None).await;
    assert_eq!(m["data"][1]["id"], "llama");
    let ask = |n: u32| json!({"model": "llama", "max_tokens": n, "messages": [{"role": "user", "content": "x"}]});
    assert_eq!(post(&s, "/v1/chat/completions", ask(64)).await.0, 200);
    let (st, _, b) = post(&s, "/v1/chat/completions", ask(65)).await;
    assert_eq!((st, code(&b)), (400, "max_tokens_exceeded"));
    assert!(scrape(&s).await.contains("mole_config_restart_required 1"));
    // Back to the running settings: nothing left to restart for.
    let y = std::fs::read_to_string(&p)
        .unwrap()
        .replace("llama2", "llama")
        .replace("maxTokens: 100,", "maxTokens: 64,");
    std::fs::write(&p, y).unwrap();
    let (st, b) = post_auth(&s, "/admin/reload", Some("s3cret"), json!({})).await;
    assert_eq!((st, b["restartRequired"].clone()), (200, json!([])));
    assert!(scrape(&s).await.contains("mole_config_restart_required 0"));
}

#[tokio::test]
async fn expert_label_routes_explicitly() {
    let s = start_edited("", 16, 64, |y| {
        y.replace("path: fr, keywords", "path: fr, label: french, keywords")
            .replace("path: js, keywords", "path: js, label: json, keywords")
    })
    .await;
    let (st, _, b) = post(
        &s,
        "/infer",
        json!({"prompt": "give me json", "expert": "french", "max_tokens": 2}),
    )
    .await;
    assert_eq!(st, 200, "{b}");
    assert_eq!(
        (b["routed_adapter"].as_str(), b["route"].as_str()),
        (Some("fr"), Some("explicit"))
    );
    let (_, h, _) = post(&s, "/v1/chat/completions", json!({"model": "demo", "adapter": "json", "max_tokens": 2, "messages": [{"role": "user", "content": "bonjour"}]})).await;
    assert_eq!(
        (
            h["x-mole-adapter"].to_str().unwrap(),
            h["x-mole-route"].to_str().unwrap()
        ),
        ("js", "explicit")
    );
    let (st, _, b) = post(&s, "/infer", json!({"prompt": "x", "expert": "klingon"})).await;
    assert_eq!((st, code(&b)), (404, "model_not_found"));
}

#[tokio::test]
async fn models_and_lora_adapters_fields() {
    let s = start_edited(
        "  - {name: mg, version: v3, loraId: 3, path: extra, mode: merged, mergedEndpoint: \"http://127.0.0.1:1\"}",
        16,
        64,
        |y| y,
    )
    .await;
    post(
        &s,
        "/v1/chat/completions",
        json!({"model": "fr", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    let (st, m) = get(&s, "/v1/models", None).await;
    assert_eq!(st, 200);
    assert_eq!(m["object"], "list");
    let by_id = |id: &str| {
        m["data"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["id"] == id)
            .unwrap()
            .clone()
    };
    assert_eq!(by_id("demo")["mole"]["kind"], "pool");
    assert_eq!(by_id("llama")["mole"]["kind"], "base");
    let fr = by_id("fr");
    assert_eq!(fr["object"], "model");
    assert_eq!(fr["parent"], "llama");
    assert_eq!(fr["owned_by"], "mole");
    assert_eq!(fr["mole"]["version"], "v1");
    assert_eq!(fr["mole"]["mode"], "dynamic");
    assert_eq!(fr["mole"]["loaded"], true);
    assert_eq!(by_id("mg")["mole"]["mode"], "merged");
    assert_eq!(by_id("js")["mole"]["version"], "v2");
    let (st, l) = get(&s, "/v1/lora_adapters", None).await;
    assert_eq!(st, 200);
    assert_eq!(l["base_model"], "llama");
    let fr = l["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["name"] == "fr")
        .unwrap();
    assert_eq!(fr["version"], "v1");
    assert_eq!(fr["lora_id"], 1);
    assert_eq!(fr["rank"], 8, "{fr}");
    assert_eq!(fr["requests"], 1, "{fr}");
    assert_eq!(fr["residency"], "cpu");
    assert!(fr["bytes"].as_u64().unwrap() > 0, "{fr}");
    assert_eq!(fr["loaded"], true);
    let js = l["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["name"] == "js")
        .unwrap();
    assert_eq!(js["rank"], 4, "{js}");
    assert_eq!(js["requests"], 0);
    // Its traffic, which the operator turns into rates (issue 37): the one request, the
    // tokens it generated and its latency in one bucket.
    let fr = l["traffic"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["name"] == "fr" && a["version"] == "v1")
        .unwrap();
    assert_eq!(
        (fr["requests"].as_u64(), fr["errors"].as_u64()),
        (Some(1), Some(0)),
        "{fr}"
    );
    assert!(fr["tokens"].as_u64().unwrap() > 0, "{fr}");
    let buckets: Vec<u64> = serde_json::from_value(fr["latency_ms"].clone()).unwrap();
    assert_eq!(buckets.len(), mole_api::LATENCY_BUCKETS_MS.len() + 1);
    assert_eq!(buckets.iter().sum::<u64>(), 1, "{fr}");
}

#[tokio::test]
async fn stop_strings_top_p_and_reject_fallback() {
    let s = start_edited("", 16, 64, |y| {
        y.replace("fallback: base", "fallback: reject")
    })
    .await;
    let ask = |extra: Value| {
        let mut b = json!({"model": "fr", "max_tokens": 16, "ignore_eos": true, "temperature": 0, "messages": [{"role": "user", "content": "x y"}]});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    let (st, _, whole) = post(&s, "/v1/chat/completions", ask(json!({}))).await;
    assert_eq!(st, 200, "{whole}");
    let text = content(&whole);
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() >= 8, "{text:?}");
    // A stop string from the middle of the greedy answer: the answer ends just before it.
    let stop: String = chars[5..7].iter().collect();
    let cut = &text[..text.find(&stop).unwrap()];
    for stream in [false, true] {
        let body = ask(json!({"stop": [stop.clone(), "\u{1F600}never"], "stream": stream}));
        let r = reqwest::Client::new()
            .post(format!("{}/v1/chat/completions", s.url))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let (got, finish) = if stream {
            let t = r.text().await.unwrap();
            let mut got = String::new();
            let mut finish = Value::Null;
            for d in t.lines().filter_map(|l| l.strip_prefix("data: ")) {
                if d == "[DONE]" {
                    continue;
                }
                let v: Value = serde_json::from_str(d).unwrap();
                got.push_str(v["choices"][0]["delta"]["content"].as_str().unwrap_or(""));
                if !v["choices"][0]["finish_reason"].is_null() {
                    finish = v["choices"][0]["finish_reason"].clone();
                }
            }
            (got, finish)
        } else {
            let b: Value = r.json().await.unwrap();
            (content(&b), b["choices"][0]["finish_reason"].clone())
        };
        assert_eq!(
            (got.as_str(), finish.as_str()),
            (cut, Some("stop")),
            "stream {stream}"
        );
    }
    // top_p this small keeps only the most likely token: sampling at temperature 1 with any
    // seed gives the greedy answer; with top_p 1 some seed differs from it.
    let mut differs = false;
    for seed in 0..4 {
        let (_, _, b) = post(
            &s,
            "/v1/chat/completions",
            ask(json!({"temperature": 1.0, "top_p": 1e-6, "seed": seed})),
        )
        .await;
        assert_eq!(content(&b), text, "seed {seed}");
        let (_, _, b) = post(
            &s,
            "/v1/chat/completions",
            ask(json!({"temperature": 1.0, "top_p": 1.0, "seed": seed})),
        )
        .await;
        differs |= content(&b) != text;
    }
    assert!(differs, "top_p 1 sampling never left the greedy path");
    let (st, _, b) = post(&s, "/v1/chat/completions", ask(json!({"top_p": 0}))).await;
    assert_eq!((st, code(&b)), (400, "invalid_top_p"));
    // Nothing matches and the fallback is reject: 422 no_route.
    let (st, _, b) = post(
        &s,
        "/v1/chat/completions",
        json!({"model": "demo", "messages": [{"role": "user", "content": "hello"}]}),
    )
    .await;
    assert_eq!((st, code(&b)), (422, "no_route"), "{b}");
    assert_eq!(b["error"]["type"], "invalid_request_error");
    let (st, _, b) = post(&s, "/v1/route", json!({"input": "hello"})).await;
    assert_eq!((st, code(&b)), (422, "no_route"));
}

#[tokio::test]
async fn classifier_routes_with_one_scoring_pass() {
    let s = start_edited("", 16, 64, |y| {
        y.replace("path: fr, keywords", "path: fr, label: french, keywords")
            .replace("path: js, keywords", "path: js, label: json, keywords")
            .replace(
                "router: {strategies: [explicit, keywords], fallback: base}",
                "router: {strategies: [classifier, keywords], classifierAdapter: fr, minConfidence: 0.0, fallback: base}",
            )
    })
    .await;
    let labels = ["french".to_string(), "json".to_string()];
    let p = s
        .engine
        .serving
        .score_labels(Some("fr"), "tell me", &labels, &[])
        .unwrap();
    let (best, want) = if p[0] >= p[1] {
        (p[0], "fr")
    } else {
        (p[1], "js")
    };
    let (st, h, b) = post(&s, "/v1/route", json!({"input": "tell me"})).await;
    assert_eq!(st, 200, "{b}");
    assert_eq!(
        (b["route"].as_str(), b["adapter"].as_str()),
        (Some("classifier"), Some(want))
    );
    assert!(
        (b["score"].as_f64().unwrap() - f64::from(best)).abs() < 1e-6,
        "{b} {p:?}"
    );
    assert_eq!(h["x-mole-route"], "classifier");
    let (st, h, b) = post(&s, "/v1/chat/completions", json!({"model": "demo", "max_tokens": 2, "messages": [{"role": "user", "content": "tell me"}]})).await;
    assert_eq!(st, 200, "{b}");
    assert_eq!(
        (
            h["x-mole-route"].to_str().unwrap(),
            h["x-mole-adapter"].to_str().unwrap()
        ),
        ("classifier", want)
    );
    // A confidence the classifier cannot reach: the next strategy (keywords) decides.
    let s2 = start_edited("", 16, 64, |y| {
        y.replace("path: fr, keywords", "path: fr, label: french, keywords")
            .replace("path: js, keywords", "path: js, label: json, keywords")
            .replace(
                "router: {strategies: [explicit, keywords], fallback: base}",
                "router: {strategies: [classifier, keywords], classifierAdapter: fr, minConfidence: 1.0, fallback: base}",
            )
    })
    .await;
    let (_, _, b) = post(&s2, "/v1/route", json!({"input": "as json"})).await;
    assert_eq!(
        (b["route"].as_str(), b["adapter"].as_str()),
        (Some("keywords"), Some("js")),
        "{b}"
    );
}

#[tokio::test]
async fn shutdown_drains_in_flight_requests() {
    let s = start("", 1, 4).await;
    let mut r = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", s.url))
        .json(&json!({"model": "fr", "stream": true, "stream_options": {"include_usage": true}, "max_tokens": 64, "ignore_eos": true, "messages": [{"role": "user", "content": "x"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut body = String::from_utf8(r.chunk().await.unwrap().unwrap().to_vec()).unwrap();
    // SIGTERM (here: the shutdown future) while the answer streams.
    let Srv {
        url,
        state,
        _stop,
        served,
        _dir,
        ..
    } = s;
    _stop.send(()).unwrap();
    for _ in 0..100 {
        if state.readiness().is_err() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(state.readiness().unwrap_err(), "shutting down");
    assert!(!state.accepting());
    // The in-flight answer finishes whole.
    while let Some(c) = r.chunk().await.unwrap() {
        body.push_str(std::str::from_utf8(&c).unwrap());
    }
    assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
    assert!(body.contains("\"completion_tokens\":64"), "{body}");
    drop(r);
    // Then the server stops, and new connections are refused.
    tokio::time::timeout(Duration::from_secs(10), served)
        .await
        .expect("server stopped")
        .unwrap()
        .unwrap();
    assert!(reqwest::get(format!("{url}/healthz")).await.is_err());
}

/// A merged "pod" that accepts connections and never answers.
async fn hanging_upstream() -> (String, tokio::task::JoinHandle<()>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let h = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((c, _)) = l.accept().await {
            held.push(c);
        }
    });
    (url, h)
}

/// A merged "pod" that starts an answer (SSE when asked to stream), sends one chunk and dies.
async fn dying_upstream() -> (String, tokio::task::JoinHandle<()>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let h = tokio::spawn(async move {
        while let Ok((mut c, _)) = l.accept().await {
            let mut buf = vec![0u8; 65536];
            let n = c.read(&mut buf).await.unwrap_or(0);
            let stream = String::from_utf8_lossy(&buf[..n]).contains("\"stream\":true");
            let (ctype, chunk) = if stream {
                (
                    "text/event-stream",
                    "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Bon\"}}]}\n\n",
                )
            } else {
                ("application/json", "{\"choices\":[{\"index\":0,")
            };
            let head = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: {ctype}\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{chunk}\r\n",
                chunk.len()
            );
            let _ = c.write_all(head.as_bytes()).await;
            let _ = c.flush().await;
            tokio::time::sleep(Duration::from_millis(100)).await;
            drop(c);
        }
    });
    (url, h)
}

#[tokio::test]
async fn gateway_streams_and_falls_back_from_hanging_or_dying_pods() {
    let up = merged_upstream().await;
    let (hang, _h1) = hanging_upstream().await;
    let (dying, _h2) = dying_upstream().await;
    let extra = format!(
        "  - {{name: mg, version: v1, loraId: 3, path: extra, mode: merged, mergedEndpoint: \"{}\"}}\n  - {{name: hang, version: v1, loraId: 4, path: extra2, mode: merged, mergedEndpoint: \"{hang}\"}}\n  - {{name: hangnl, version: v1, loraId: 5, path: extra, mode: merged, mergedEndpoint: \"{hang}\", load: false}}\n  - {{name: dying, version: v1, loraId: 6, path: extra3, mode: merged, mergedEndpoint: \"{dying}\"}}",
        up.url
    );
    // A short request timeout: a pod silent that long is given up on.
    let s = start_edited(&extra, 16, 64, |y| {
        y.replace("requestTimeoutSeconds: 5", "requestTimeoutSeconds: 1")
    })
    .await;
    let ask = |model: &str, stream: bool| json!({"model": model, "stream": stream, "max_tokens": 8, "ignore_eos": true, "temperature": 0, "messages": [{"role": "user", "content": "x"}]});
    let sse_text = |t: &str| {
        let mut out = String::new();
        for d in t.lines().filter_map(|l| l.strip_prefix("data: ")) {
            if d != "[DONE]" {
                let v: Value = serde_json::from_str(d).unwrap();
                out.push_str(v["choices"][0]["delta"]["content"].as_str().unwrap_or(""));
            }
        }
        out
    };
    // Streaming through the proxy: the same chunks as asking the merged pod directly.
    let r = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", s.url))
        .json(&ask("mg", true))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-mole-route"], "explicit+proxy");
    assert!(r.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let proxied = r.text().await.unwrap();
    assert!(proxied.ends_with("data: [DONE]\n\n"), "{proxied}");
    let (_, _, direct) = post(&up, "/v1/chat/completions", ask("mg", false)).await;
    assert_eq!(sse_text(&proxied), content(&direct));
    // A pod that accepts and never answers: after the timeout the request is served here.
    let t = std::time::Instant::now();
    let (st, h, b) = post(&s, "/v1/chat/completions", ask("hang", false)).await;
    assert_eq!(st, 200, "{b}");
    assert_eq!(
        (
            h["x-mole-adapter"].to_str().unwrap(),
            h["x-mole-route"].to_str().unwrap()
        ),
        ("hang", "explicit")
    );
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    // Not loaded here: 503 naming the cause, not a hang.
    let (st, _, b) = post(&s, "/v1/chat/completions", ask("hangnl", false)).await;
    assert_eq!((st, code(&b)), (503, "merged_unavailable"));
    assert!(
        b["error"]["message"].as_str().unwrap().contains("in time"),
        "{b}"
    );
    // A pod that dies mid-stream: the client gets what came, then an error event and [DONE].
    let t = post_stream(&s, "/v1/chat/completions", &ask("dying", true)).await;
    let datas: Vec<&str> = t.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(datas.len(), 3, "{t}");
    assert_eq!(sse_text(datas[0]), "");
    assert!(datas[0].contains("Bon"));
    let e: Value = serde_json::from_str(datas[1]).unwrap();
    assert_eq!(e["error"]["code"], "upstream_error", "{e}");
    assert_eq!(e["error"]["type"], "server_error");
    assert_eq!(datas[2], "[DONE]");
    // Non-streamed from the dying pod: cut short before the end, so served here.
    let (st, h, b) = post(&s, "/v1/chat/completions", ask("dying", false)).await;
    assert_eq!(st, 200, "{b}");
    assert_eq!(h["x-mole-route"], "explicit");
    let m = scrape(&s).await;
    assert!(m.contains("mole_requests_total{adapter=\"mg\",endpoint=\"chat\",mode=\"merged\",route=\"explicit+proxy\",status=\"200\"} 1"), "{m}");
}

/// A reload whose adapter load outlasts `/admin/reload`'s answer window is answered 202
/// (`applying`) while the load goes on; the worker stays ready and serving meanwhile, and the
/// adapter is listed loaded — and served — once its files can be read. The load is held by a
/// FIFO as the adapter's `adapter_config.json`, released by writing the real config into it.
#[tokio::test]
async fn a_reload_that_outlasts_its_answer_is_accepted_and_completes_in_the_background() {
    use std::time::Instant;
    let dir = fixture_root();
    let root = dir.path().to_path_buf();
    let yaml = config_yaml(&root, "", 16, 64);
    // Watcher off: only the admin call applies the change.
    let s = launch_with(dir, &yaml, |e| e, Duration::ZERO, true).await;
    let fifo = common::fifo_adapter(&root.join("fr"), &root.join("slow"));
    std::fs::write(
        root.join("config.yaml"),
        config_yaml(
            &root,
            "  - {name: slow, version: v1, loraId: 3, path: slow}",
            16,
            64,
        ),
    )
    .unwrap();
    let t = Instant::now();
    let (st, b) = post_auth(&s, "/admin/reload", Some("s3cret"), json!({})).await;
    assert_eq!((st, &b["applying"]), (202, &json!(true)), "{b}");
    assert!(t.elapsed() >= Duration::from_secs(2), "{:?}", t.elapsed());
    // Meanwhile: ready, serving, and `slow` not reported loaded.
    let (st, _) = get(&s, "/readyz", None).await;
    assert_eq!(st, 200);
    let chat = |model: &str| json!({"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]});
    let (st, _, b) = post(&s, "/v1/chat/completions", chat("fr")).await;
    assert_eq!(st, 200, "{b}");
    let slow_loaded = |l: &Value| {
        l["data"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a["name"] == "slow" && a["loaded"] == true)
    };
    let (_, l) = get(&s, "/v1/lora_adapters", None).await;
    assert!(!slow_loaded(&l), "{l}");
    // Release the load: the writer opens once the loader has the FIFO open for reading.
    let text = std::fs::read(root.join("fr/adapter_config.json")).unwrap();
    tokio::task::spawn_blocking(move || common::feed_fifo(&fifo, &text, || true))
        .await
        .unwrap();
    let t = Instant::now();
    loop {
        let (_, l) = get(&s, "/v1/lora_adapters", None).await;
        if slow_loaded(&l) {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "{l}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (st, h, b) = post(&s, "/v1/chat/completions", chat("slow")).await;
    assert_eq!(st, 200, "{b}");
    assert_eq!(h["x-mole-adapter"].to_str().unwrap(), "slow");
}

/// A request the engine fails after accepting it answers 500 `internal_error`, and counts
/// once in `mole_errors_total` and once in `mole_requests_total`, whole or streamed.
#[tokio::test]
async fn an_engine_failure_is_counted_once() {
    let open = Arc::new((std::sync::Mutex::new(true), std::sync::Condvar::new()));
    let dir = fixture_root();
    let yaml = config_yaml(dir.path(), "", 16, 64);
    let s = launch_with(
        dir,
        &yaml,
        move |inner| GatedEngine::wrap(inner, open, true),
        Duration::from_millis(100),
        true,
    )
    .await;
    let ask = |stream: bool| json!({"model": "fr", "max_tokens": 2, "stream": stream, "messages": [{"role": "user", "content": "x"}]});
    let (st, _, b) = post(&s, "/v1/chat/completions", ask(false)).await;
    assert_eq!((st, code(&b)), (500, "internal_error"), "{b}");
    let r = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", s.url))
        .json(&ask(true))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let events = r.text().await.unwrap();
    assert!(events.contains("internal_error"), "{events}");
    let m = scrape(&s).await;
    for want in [
        "mole_errors_total{code=\"internal_error\"} 2",
        "mole_requests_total{adapter=\"fr\",endpoint=\"chat\",mode=\"dynamic\",route=\"explicit\",status=\"500\"} 2",
    ] {
        assert!(m.contains(want), "{want}\n{m}");
    }
}

/// vLLM's plain endpoints, which guidellm and vLLM's own clients call: `/health`,
/// `/version`, `/tokenize` (a prompt, or messages as the chat endpoint renders them) and
/// `/detokenize`.
#[tokio::test]
async fn vllm_plain_endpoints_answer_as_vllm() {
    let s = start("", 16, 64).await;
    let c = reqwest::Client::new();
    let r = c.get(format!("{}/health", s.url)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = c
        .get(format!("{}/version", s.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["version"], env!("CARGO_PKG_VERSION"));
    // One token per byte in the fixtures' tokenizer.
    let (st, _, v) = post(&s, "/tokenize", json!({"model": "fr", "prompt": "hi!"})).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["tokens"], json!([104, 105, 33]));
    assert_eq!(
        (v["count"].as_u64(), v["max_model_len"].as_u64()),
        (Some(3), Some(128))
    );
    // Messages count as the chat endpoint's prompt does.
    let msgs = json!([{"role": "user", "content": "x y"}]);
    let (_, _, v) = post(&s, "/tokenize", json!({"messages": msgs})).await;
    let (_, _, chat) = post(
        &s,
        "/v1/chat/completions",
        json!({"model": "fr", "messages": msgs, "max_tokens": 1}),
    )
    .await;
    assert_eq!(v["count"], chat["usage"]["prompt_tokens"], "{v} {chat}");
    let (_, _, bare) = post(
        &s,
        "/tokenize",
        json!({"messages": msgs, "add_generation_prompt": false}),
    )
    .await;
    assert!(bare["count"].as_u64() < v["count"].as_u64(), "{bare} {v}");
    let (st, _, v) = post(&s, "/detokenize", json!({"tokens": [104, 105, 33]})).await;
    assert_eq!((st, v["prompt"].as_str()), (200, Some("hi!")), "{v}");
    for (path, body, code) in [
        ("/detokenize", json!({"tokens": [99999]}), "invalid_request"),
        ("/tokenize", json!({}), "invalid_request"),
        (
            "/tokenize",
            json!({"prompt": "a", "messages": msgs}),
            "invalid_request",
        ),
    ] {
        let (st, _, v) = post(&s, path, body).await;
        assert_eq!(
            (st, v["error"]["code"].as_str()),
            (400, Some(code)),
            "{path} {v}"
        );
    }
}

/// `/infer` takes the structured-output fields as chat does (its document listed them while the
/// handler ignored them: schemathesis's "schema-violating request accepted" found it).
#[tokio::test]
async fn infer_answers_follow_a_guide() {
    let s = start("", 16, 64).await;
    let (st, _, b) = post(
        &s,
        "/infer",
        json!({"prompt": "yes or no?", "max_tokens": 8, "temperature": 0,
               "guided_choice": ["maybe", "never"]}),
    )
    .await;
    assert_eq!(st, 200, "{b}");
    let out = b["task_output"].as_str().unwrap();
    assert!(out == "maybe" || out == "never", "{b}");
    let (st, _, b) = post(&s, "/infer", json!({"prompt": "x", "guided_choice": []})).await;
    assert_eq!(
        (st, b["error"]["code"].as_str()),
        (400, Some("invalid_grammar")),
        "{b}"
    );
}

/// Issue 35 item 6: every OpenAI and vLLM request field is served, refused with a 400 that
/// names it, or harmless to ignore; a field of neither API is refused. (Structured outputs and
/// tools are served: engine_structured and the structured-outputs check test them.)
#[tokio::test]
async fn request_fields_are_served_refused_or_harmlessly_ignored() {
    let s = start("", 16, 64).await;
    let completion = |extra| {
        with_fields(
            json!({"model": "demo", "max_tokens": 2, "prompt": "x"}),
            extra,
        )
    };
    let refused_chat = [
        ("guided_decoding_backend", json!("xgrammar")),
        ("functions", json!([{"name": "f"}])),
        ("function_call", json!("auto")),
        ("reasoning_effort", json!("low")),
        ("logit_bias", json!({"5": 10})),
        ("modalities", json!(["text", "audio"])),
        ("audio", json!({"voice": "alloy", "format": "wav"})),
        ("prediction", json!({"type": "content", "content": "x"})),
        ("web_search_options", json!({})),
        ("echo", json!(true)),
        ("min_tokens", json!(3)),
        ("skip_special_tokens", json!(false)),
        ("include_stop_str_in_output", json!(true)),
        ("chat_template", json!("{{ messages }}")),
        ("continue_final_message", json!(true)),
        ("documents", json!([{"text": "d"}])),
        ("priority", json!(1)),
        ("truncate_prompt_tokens", json!(4)),
        ("prompt_logprobs", json!(1)),
        ("return_tokens_as_token_ids", json!(true)),
        ("mm_processor_kwargs", json!({"fps": 1})),
        ("logits_processors", json!(["x"])),
        ("kv_transfer_params", json!({"do_remote_decode": true})),
        ("use_beam_search", json!(true)),
        ("bad_words", json!(["x"])),
        ("allowed_token_ids", json!([1, 2])),
    ];
    for (field, v) in refused_chat {
        let (st, _, b) = post(&s, "/v1/chat/completions", chat(json!({ field: v }))).await;
        assert_eq!(
            (st, b["error"]["code"].as_str().unwrap_or("")),
            (400, "unsupported_field"),
            "{field}: {b}"
        );
        let m = b["error"]["message"].as_str().unwrap();
        assert!(m.starts_with(field), "{field}: {m}");
    }
    for (field, v) in [
        ("echo", json!(true)),
        ("best_of", json!(3)),
        ("suffix", json!("}")),
        ("logit_bias", json!({"5": -100})),
        ("prompt_embeds", json!("AAAA")),
    ] {
        let (st, _, b) = post(&s, "/v1/completions", completion(json!({ field: v }))).await;
        assert_eq!(
            (st, b["error"]["code"].as_str().unwrap_or("")),
            (400, "unsupported_field"),
            "{field}: {b}"
        );
        assert!(b["error"]["message"].as_str().unwrap().starts_with(field));
    }
    // Harmless to ignore (documented), and the values that ask for nothing: answered.
    let harmless = json!({
        "user": "u-1", "safety_identifier": "s", "metadata": {"k": "v"}, "store": true,
        "service_tier": "auto", "prompt_cache_key": "k", "request_id": "r-1", "cache_salt": "x",
        "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
        "echo": false, "modalities": ["text"], "logit_bias": {}, "skip_special_tokens": true,
        "min_tokens": 0, "priority": 0, "parallel_tool_calls": null,
        "add_generation_prompt": true, "add_special_tokens": false,
    });
    let (st, _, b) = post(&s, "/v1/chat/completions", chat(harmless)).await;
    assert_eq!(st, 200, "{b}");
    let (st, _, b) = post(
        &s,
        "/v1/completions",
        completion(json!({"user": "u", "best_of": 1, "suffix": null, "echo": false, "add_special_tokens": false})),
    )
    .await;
    assert_eq!(st, 200, "{b}");
    // A field of neither API, or of the other endpoint: refused, named.
    for (path, body, field) in [
        (
            "/v1/chat/completions",
            chat(json!({"temprature": 0.5})),
            "temprature",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"suffix": "x"})),
            "suffix",
        ),
        (
            "/v1/completions",
            completion(json!({"messages": []})),
            "messages",
        ),
    ] {
        let (st, _, b) = post(&s, path, body).await;
        assert_eq!(
            (st, b["error"]["code"].as_str().unwrap_or("")),
            (400, "unknown_field"),
            "{field}: {b}"
        );
        assert!(b["error"]["message"].as_str().unwrap().starts_with(field));
    }
}

/// A worker on the tiny Llama whose template is given a tools section naming `<tool_call>`
/// (so the Hermes format is detected from it), short (the tiny Llama holds 128 positions,
/// prompt and call together), `maxTokens` 200.
async fn tool_server() -> Srv {
    let dir = fixture_root();
    let tc = dir.path().join("base/tokenizer_config.json");
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(&tc).unwrap()).unwrap();
    cfg["chat_template"] = json!(
        "{% if tools %}<tool_call>{% endif %}{% for m in messages %}<{{ m.role }}>\
         {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    );
    std::fs::write(&tc, cfg.to_string()).unwrap();
    let yaml = config_yaml(dir.path(), "", 16, 64).replace("maxTokens: 64", "maxTokens: 200");
    launch(dir, &yaml).await
}

/// The JSON chunks of a streamed chat answer to `body` (the `data:` payloads before `[DONE]`).
async fn stream_chunks(s: &Srv, body: &Value) -> Vec<Value> {
    let text = post_stream(s, "/v1/chat/completions", body).await;
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

/// Issue 35 item 2: a tool call streams as OpenAI streams it. The tiny Llama's template is
/// given a tools section naming `<tool_call>` (so the Hermes format is detected from it), and
/// the named function forces one call by grammar, a byte a token: the first `tool_calls` delta
/// carries the index, id, type and name with empty arguments, the arguments follow in several
/// pieces as the model writes them, they concatenate to the whole answer's `arguments`
/// exactly, and the stream finishes with `tool_calls`.
#[tokio::test]
async fn a_streamed_tool_call_sends_its_arguments_in_pieces() {
    let s = tool_server().await;
    let f = json!({"type": "function", "function": {"name": "f", "parameters":
        {"type": "object", "properties": {"c": {"type": "string", "maxLength": 4}},
         "required": ["c"], "additionalProperties": false}}});
    let body = |stream: bool| {
        json!({"model": "fr", "stream": stream, "max_tokens": 90, "temperature": 0,
               "messages": [{"role": "user", "content": "w?"}], "tools": [f],
               "tool_choice": {"type": "function", "function": {"name": "f"}}})
    };
    let (st, _, whole) = post(&s, "/v1/chat/completions", body(false)).await;
    assert_eq!(st, 200, "{whole}");
    let choice = &whole["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{whole}");
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(call["function"]["name"], "f", "{whole}");
    let args = call["function"]["arguments"].as_str().unwrap().to_string();
    let parsed: Value = serde_json::from_str(&args).unwrap();
    assert!(parsed["c"].is_string(), "{args}");

    let chunks = stream_chunks(&s, &body(true)).await;
    let deltas: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array())
        .flatten()
        .collect();
    let first = deltas.first().expect("tool_calls deltas");
    assert_eq!(first["index"], 0, "{first}");
    assert!(
        first["id"].as_str().unwrap().starts_with("call_"),
        "{first}"
    );
    assert_eq!(first["type"], "function", "{first}");
    assert_eq!(first["function"]["name"], "f", "{first}");
    assert_eq!(first["function"]["arguments"], "", "{first}");
    let pieces: Vec<&str> = deltas[1..]
        .iter()
        .map(|d| {
            assert_eq!(d["index"], 0, "{d}");
            assert!(
                d.get("id").is_none() && d["function"].get("name").is_none(),
                "{d}"
            );
            d["function"]["arguments"].as_str().unwrap()
        })
        .collect();
    assert!(
        pieces.len() > 1 && pieces.iter().all(|p| !p.is_empty()),
        "the arguments came in {} piece(s): {pieces:?}",
        pieces.len()
    );
    assert_eq!(
        pieces.concat(),
        args,
        "the pieces reassemble to the whole answer"
    );
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(content, "", "nothing of the call leaks into the content");
    let finish = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["finish_reason"].as_str())
        .collect::<Vec<_>>();
    assert_eq!(finish, ["tool_calls"]);
}

/// Issue 52 item 1: one typed request. The bodies schemathesis found the document calling
/// valid and the server refusing are refused by both (the document's side:
/// scripts/checks/openapi_drift.py), each with its code; a field of the wrong shape is refused
/// with its field's code and path; what `/infer`'s one whole text cannot carry is refused, not
/// dropped; the tokenizer's `model` names a model of the pool.
#[tokio::test]
async fn typed_bodies_refuse_with_the_fields_codes() {
    let s = start("", 16, 64).await;
    let cases = [
        (
            "/v1/chat/completions",
            chat(json!({"guided_grammar": ""})),
            400,
            "invalid_grammar",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"tool_choice": "auto"})),
            400,
            "invalid_tool_choice",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"guided_regex": "a", "guided_choice": ["a"]})),
            400,
            "conflicting_guides",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"structured_outputs": {}})),
            400,
            "invalid_structured_outputs",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"tools": [{"type": "function", "function": {"parameters": {}}}]})),
            400,
            "invalid_tools",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"messages": [{"role": "user", "content": [{"type": "audio"}]}]})),
            400,
            "invalid_content_part",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"stop": 5})),
            400,
            "invalid_stop",
        ),
        (
            "/infer",
            json!({"prompt": "x", "stream": true}),
            400,
            "unsupported_field",
        ),
        (
            "/infer",
            json!({"prompt": "x", "n": 2}),
            400,
            "unsupported_field",
        ),
        (
            "/infer",
            json!({"prompt": "x", "logprobs": true}),
            400,
            "unsupported_field",
        ),
        (
            "/infer",
            json!({"prompt": "x", "messages": []}),
            400,
            "unknown_field",
        ),
        // serde reads a struct from an array; the document does not (200 on fc4b38d).
        (
            "/v1/chat/completions",
            json!({"model": "demo", "max_tokens": 2, "messages": [["user", "x"]]}),
            400,
            "invalid_request",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"stream_options": [true]})),
            400,
            "invalid_request",
        ),
        (
            "/v1/responses",
            json!({"input": "x", "reasoning": [null, null]}),
            400,
            "invalid_reasoning",
        ),
        (
            "/tokenize",
            json!({"model": "nope", "prompt": "x"}),
            404,
            "model_not_found",
        ),
        (
            "/detokenize",
            json!({"model": "nope", "tokens": [1]}),
            404,
            "model_not_found",
        ),
    ];
    assert_refusals(&s, cases).await;
    let (_, _, b) = post(
        &s,
        "/v1/chat/completions",
        chat(json!({"tools": [{"type": "function", "function": {"parameters": {}}}]})),
    )
    .await;
    let m = b["error"]["message"].as_str().unwrap();
    assert!(
        m.starts_with("tools[0].function: missing field `name`"),
        "{m}"
    );
    // The seeds' other name of the prompt, and the names the tokenizer takes.
    let (st, _, b) = post(&s, "/infer", json!({"input": "x", "max_tokens": 2})).await;
    assert_eq!(st, 200, "{b}");
    for model in ["demo", "llama", "fr"] {
        let (st, _, b) = post(&s, "/tokenize", json!({"model": model, "prompt": "x"})).await;
        assert_eq!(st, 200, "{model}: {b}");
    }
}

/// Issue 52 item 6: OpenAI's `strict`. A schema with keywords the grammar engine cannot
/// enforce is served without `strict` (approximated: here `uniqueItems` and an unknown
/// `format` go unenforced, `oneOf` is read as `anyOf`) and the answer says what was not
/// enforced; with `strict: true` it is refused naming the keyword.
#[tokio::test]
async fn a_schema_is_approximated_unless_strict_and_the_answer_says_what_was_not_enforced() {
    let s = start("", 16, 64).await;
    let schema = json!({"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2,
                 "uniqueItems": true},
        // Alternatives that overlap (5 to 9 is both): anyOf admits what oneOf does not.
        "id": {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                         {"type": "integer", "minimum": 5, "maximum": 20}]},
        "tel": {"type": "string", "format": "phone", "maxLength": 3},
    }, "required": ["tags", "id", "tel"], "additionalProperties": false});
    let body = |strict: Option<bool>| {
        json!({"model": "demo", "max_tokens": 60, "temperature": 0,
               "messages": [{"role": "user", "content": "x"}],
               "response_format": {"type": "json_schema",
                   "json_schema": {"name": "t", "schema": schema, "strict": strict}}})
    };
    for strict in [None, Some(false)] {
        let (st, _, b) = post(&s, "/v1/chat/completions", body(strict)).await;
        assert_eq!(st, 200, "{b}");
        let mut unenforced: Vec<&str> = b["mole"]["unenforced"]
            .as_array()
            .unwrap_or_else(|| panic!("{b}"))
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        unenforced.sort_unstable();
        assert_eq!(unenforced, ["format: phone", "oneOf", "uniqueItems"], "{b}");
        if b["choices"][0]["finish_reason"] == "stop" {
            let v: Value = serde_json::from_str(&content(&b)).unwrap();
            assert!(
                v["tags"].is_array() && (v["id"].is_i64() || v["id"].is_string()),
                "{v}"
            );
        }
    }
    let (st, _, b) = post(&s, "/v1/chat/completions", body(Some(true))).await;
    assert_eq!((st, code(&b)), (400, "invalid_schema"), "{b}");
    let m = b["error"]["message"].as_str().unwrap();
    assert!(
        m.contains("uniqueItems") || m.contains("oneOf") || m.contains("phone"),
        "{m}"
    );
    // A schema enforced whole says nothing.
    let plain = json!({"model": "demo", "max_tokens": 30, "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_object"}});
    let (st, _, b) = post(&s, "/v1/chat/completions", plain).await;
    assert_eq!(st, 200, "{b}");
    assert!(b["mole"].get("unenforced").is_none(), "{b}");
}

/// The server-sent events of a streamed response: (event name, JSON data).
async fn response_events(s: &Srv, body: &Value) -> Vec<(String, Value)> {
    let text = post_stream(s, "/v1/responses", body).await;
    let mut out = Vec::new();
    let mut event = String::new();
    for line in text.lines() {
        if let Some(e) = line.strip_prefix("event: ") {
            event = e.to_string();
        } else if let Some(d) = line.strip_prefix("data: ") {
            out.push((event.clone(), serde_json::from_str(d).unwrap()));
        }
    }
    out
}

/// Issue 53: `POST /v1/responses` on the tiny Llama. A text input with instructions is
/// answered as a `response` (a message item, usage, `store: false`, the routing in `mole`);
/// streamed, the events come in OpenAI's order with counting sequence numbers, the text
/// deltas join to the whole answer's text, and `response.completed` carries the same output;
/// an adapter is named by `model`; the usage counts the prompt; a stored response is never
/// found.
#[tokio::test]
async fn responses_are_answered_whole_and_streamed_alike() {
    let s = start("", 16, 64).await;
    let body = |stream: bool| {
        json!({"model": "fr", "input": "bonjour", "instructions": "be brief",
               "max_output_tokens": 12, "temperature": 0, "stream": stream,
               "metadata": {"k": "v"}})
    };
    let (st, h, whole) = post(&s, "/v1/responses", body(false)).await;
    assert_eq!(st, 200, "{whole}");
    assert_eq!(whole["object"], "response");
    assert!(
        whole["id"].as_str().unwrap().starts_with("resp_"),
        "{whole}"
    );
    assert_eq!(whole["status"], "incomplete", "{whole}");
    assert_eq!(whole["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(
        (&whole["store"], &whole["metadata"]["k"]),
        (&json!(false), &json!("v"))
    );
    assert_eq!(whole["instructions"], "be brief");
    assert_eq!(whole["mole"]["adapter"], "fr");
    assert_eq!(h["x-mole-adapter"], "fr");
    let item = &whole["output"][0];
    assert_eq!(
        (&item["type"], &item["role"]),
        (&json!("message"), &json!("assistant"))
    );
    let text = item["content"][0]["text"].as_str().unwrap().to_string();
    assert_eq!(whole["usage"]["output_tokens"], 12, "{whole}");
    assert!(
        whole["usage"]["input_tokens"].as_u64().unwrap() > 3,
        "{whole}"
    );
    assert_eq!(
        whole["usage"]["total_tokens"],
        whole["usage"]["input_tokens"].as_u64().unwrap() + 12
    );

    let events = response_events(&s, &body(true)).await;
    let names: Vec<&str> = events.iter().map(|(e, _)| e.as_str()).collect();
    assert_eq!(names[..2], ["response.created", "response.in_progress"]);
    assert_eq!(names.last(), Some(&"response.incomplete"));
    for (i, (name, v)) in events.iter().enumerate() {
        assert_eq!(v["type"], name.as_str(), "{v}");
        assert_eq!(v["sequence_number"], i, "{v}");
    }
    let deltas: String = events
        .iter()
        .filter(|(e, _)| e == "response.output_text.delta")
        .map(|(_, v)| v["delta"].as_str().unwrap())
        .collect();
    assert_eq!(deltas, text, "the deltas join to the whole answer");
    let last = &events.last().unwrap().1["response"];
    assert_eq!(last["output"][0]["content"][0]["text"], text.as_str());
    for k in ["input_tokens", "output_tokens", "total_tokens"] {
        assert_eq!(last["usage"][k], whole["usage"][k], "{k}");
    }
    // The second time the prompt is in the prefix cache.
    assert!(
        last["usage"]["input_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0,
        "{last}"
    );

    for method in [reqwest::Method::GET, reqwest::Method::DELETE] {
        let r = reqwest::Client::new()
            .request(
                method,
                format!("{}/v1/responses/{}", s.url, whole["id"].as_str().unwrap()),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 404);
        let b: Value = r.json().await.unwrap();
        assert_eq!(code(&b), "response_not_found");
    }
    let m = scrape(&s).await;
    assert!(
        m.contains(
            "mole_requests_total{adapter=\"fr\",endpoint=\"responses\",mode=\"dynamic\",route=\"explicit\",status=\"200\"} 2"
        ),
        "per-adapter metrics count the route, whole and streamed: {m}"
    );
}

/// Issue 53: tools on the Responses API take chat's grammar path. A named function forces a
/// `function_call` item (its `call_id`, its arguments valid against the parameters, streamed
/// as argument deltas that join to them); the call and its `function_call_output` fed back
/// make a second turn the model answers; bad inputs are 4xx with stable codes.
#[tokio::test]
async fn a_tool_loop_through_the_responses_api() {
    let s = tool_server().await;
    let f = json!({"type": "function", "name": "f", "parameters":
        {"type": "object", "properties": {"c": {"type": "string", "maxLength": 4}},
         "required": ["c"], "additionalProperties": false}});
    let body = |stream: bool| {
        json!({"model": "fr", "stream": stream, "max_output_tokens": 90, "temperature": 0,
               "input": [{"role": "user", "content": [{"type": "input_text", "text": "w?"}]}],
               "tools": [f], "tool_choice": {"type": "function", "name": "f"}})
    };
    let (st, _, whole) = post(&s, "/v1/responses", body(false)).await;
    assert_eq!(st, 200, "{whole}");
    assert_eq!(whole["status"], "completed", "{whole}");
    let calls: Vec<&Value> = whole["output"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["type"] == "function_call")
        .collect();
    assert_eq!(calls.len(), 1, "{whole}");
    let call = calls[0];
    assert_eq!(call["name"], "f");
    assert!(
        call["call_id"].as_str().unwrap().starts_with("call_"),
        "{call}"
    );
    let args = call["arguments"].as_str().unwrap();
    let parsed: Value = serde_json::from_str(args).unwrap();
    assert!(
        parsed["c"].as_str().is_some_and(|c| c.chars().count() <= 4),
        "{args}"
    );
    assert_eq!(
        whole["tool_choice"],
        json!({"type": "function", "name": "f"})
    );

    let events = response_events(&s, &body(true)).await;
    let deltas: String = events
        .iter()
        .filter(|(e, _)| e == "response.function_call_arguments.delta")
        .map(|(_, v)| v["delta"].as_str().unwrap())
        .collect();
    assert_eq!(deltas, args, "the argument deltas join to the whole call");
    let done = events
        .iter()
        .find(|(e, _)| e == "response.function_call_arguments.done")
        .unwrap();
    assert_eq!(done.1["arguments"], args);

    // The second turn: the call and its output fed back.
    let turn2 = json!({"model": "fr", "max_output_tokens": 6, "temperature": 0, "tools": [f],
    "input": [
        {"role": "user", "content": "w?"},
        {"type": "function_call", "call_id": call["call_id"], "name": "f", "arguments": args},
        {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"},
    ]});
    let (st, _, b) = post(&s, "/v1/responses", turn2).await;
    assert_eq!(st, 200, "{b}");
    assert!(!b["output"].as_array().unwrap().is_empty(), "{b}");

    for (body, status, code_) in [
        (
            json!({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}),
            400,
            "unknown_call_id",
        ),
        (
            json!({"input": [{"type": "web_search_call", "id": "ws"}]}),
            400,
            "invalid_input",
        ),
        (
            json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "AAEC"}]}]}),
            400,
            "images_not_supported",
        ),
        (
            json!({"input": "x", "previous_response_id": "resp_1"}),
            400,
            "unsupported_field",
        ),
        (
            json!({"input": "x", "tools": [{"type": "web_search"}]}),
            400,
            "invalid_tools",
        ),
        (
            json!({"input": "x", "tool_choice": "required"}),
            400,
            "invalid_tool_choice",
        ),
        (json!({"input": "x", "max_tokens": 5}), 400, "unknown_field"),
        (
            json!({"input": "x", "model": "nope"}),
            404,
            "model_not_found",
        ),
    ] {
        let (st, _, b) = post(&s, "/v1/responses", body.clone()).await;
        assert_eq!((st, code(&b)), (status, code_), "{body}: {b}");
    }
}

/// Issue 53: `text.format` takes the structured-output path: a JSON schema's answer parses
/// and validates, strict or not.
#[tokio::test]
async fn responses_follow_their_text_format() {
    let s = start("", 16, 64).await;
    let schema = json!({"type": "object", "properties": {"ok": {"type": "boolean"}},
                        "required": ["ok"], "additionalProperties": false});
    for strict in [true, false] {
        let (st, _, b) = post(
            &s,
            "/v1/responses",
            json!({"input": "x", "max_output_tokens": 20, "temperature": 0,
                   "text": {"format": {"type": "json_schema", "name": "r", "schema": schema, "strict": strict}}}),
        )
        .await;
        assert_eq!(st, 200, "{b}");
        assert_eq!(b["status"], "completed", "{b}");
        let text = b["output"][0]["content"][0]["text"].as_str().unwrap();
        let v: Value = serde_json::from_str(text).unwrap();
        assert!(v["ok"].is_boolean(), "{v}");
        assert_eq!(b["text"]["format"]["name"], "r");
    }
}

/// Issue 53: a response for a merged adapter is forwarded to its pods like chat's (the same
/// answer as asking them, whole or streamed), and a pod that dies mid-stream ends the stream
/// with the Responses API's `error` event, numbered after the events that came.
#[tokio::test]
async fn responses_are_forwarded_to_merged_pods() {
    let up = merged_upstream().await;
    let (dying, _h) = dying_upstream().await;
    let extra = format!(
        "  - {{name: mg, version: v1, loraId: 3, path: extra, mode: merged, mergedEndpoint: \"{}\"}}\n  - {{name: dying, version: v1, loraId: 6, path: extra3, mode: merged, mergedEndpoint: \"{dying}\"}}",
        up.url
    );
    let s = start(&extra, 16, 64).await;
    let ask = |model: &str, stream: bool| {
        json!({"model": model, "stream": stream, "input": "x", "max_output_tokens": 8,
               "temperature": 0})
    };
    let (st, h, b) = post(&s, "/v1/responses", ask("mg", false)).await;
    assert_eq!(st, 200, "{b}");
    assert_eq!(h["x-mole-route"], "explicit+proxy");
    let (_, _, direct) = post(&up, "/v1/responses", ask("mg", false)).await;
    let text = |r: &Value| r["output"][0]["content"][0]["text"].clone();
    assert_eq!(text(&b), text(&direct));
    let events = response_events(&s, &ask("mg", true)).await;
    let last = &events.last().unwrap().1;
    assert_eq!(last["type"], "response.incomplete", "{last}");
    assert_eq!(text(&last["response"]), text(&direct));
    let t = post_stream(&s, "/v1/responses", &ask("dying", true)).await;
    assert!(t.ends_with("\n\n") && t.contains("event: error\n"), "{t}");
    let data = t
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .next_back()
        .unwrap();
    let e: Value = serde_json::from_str(data).unwrap();
    assert_eq!(
        (&e["code"], &e["sequence_number"]),
        (&json!("upstream_error"), &json!(1)),
        "{e}"
    );
    assert!(!t.contains("[DONE]"), "{t}");
}

/// Tools beside a JSON format, as OpenAI serves them: a forced call shapes the answer (the
/// format applies to text, of which there is none), and with `auto` the answer is either calls
/// or the JSON, one grammar of both (the tiny Llama at temperature 0 writes one or the other;
/// either parses).
#[tokio::test]
async fn tools_beside_a_json_format() {
    let s = tool_server().await;
    let f = json!({"type": "function", "function": {"name": "f", "parameters":
        {"type": "object", "properties": {"c": {"type": "string", "maxLength": 4}},
         "required": ["c"], "additionalProperties": false}}});
    let format = json!({"type": "json_schema", "json_schema": {"name": "r", "schema":
        {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
         "additionalProperties": false}}});
    let ask = |choice: Value| {
        json!({"model": "fr", "max_tokens": 90, "temperature": 0,
               "messages": [{"role": "user", "content": "w?"}], "tools": [f],
               "tool_choice": choice, "response_format": format, "parallel_tool_calls": false})
    };
    let (st, _, b) = post(&s, "/v1/chat/completions", ask(json!("required"))).await;
    assert_eq!(st, 200, "{b}");
    assert_eq!(b["choices"][0]["finish_reason"], "tool_calls", "{b}");
    let (st, _, b) = post(&s, "/v1/chat/completions", ask(json!("auto"))).await;
    assert_eq!(st, 200, "{b}");
    let m = &b["choices"][0]["message"];
    match m["tool_calls"].as_array() {
        Some(calls) => {
            let args: Value =
                serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
            assert!(args["c"].is_string(), "{b}");
        }
        None => {
            let v: Value = serde_json::from_str(m["content"].as_str().unwrap()).unwrap();
            assert!(v["ok"].is_boolean(), "{b}");
        }
    }
}

/// The real engine, its classifier's scoring taking 1.5 s (a big classifier, a busy engine).
struct SlowClassifier {
    inner: EngineHandles,
}

impl Serving for SlowClassifier {
    fn submit(&self, req: GenerateRequest) -> Result<EventStream, EngineError> {
        self.inner.serving.submit(req)
    }
    fn score_labels(
        &self,
        a: Option<&str>,
        p: &str,
        l: &[String],
        i: &[Image],
    ) -> Result<Vec<f32>, EngineError> {
        std::thread::sleep(Duration::from_millis(1500));
        self.inner.serving.score_labels(a, p, l, i)
    }
}

/// Issue 52 (still on the runtime): the router's model work (the classifier's pass, an
/// embedding) is done on the preparation stage, not on the async runtime: while a routed
/// request waits for a slow classifier, the runtime answers the probes at once (on a
/// current-thread runtime, as this test's, a router run on the runtime blocks everything).
#[tokio::test]
async fn routing_work_is_off_the_runtime() {
    let dir = fixture_root();
    let yaml = config_yaml(dir.path(), "", 16, 64)
        .replace("path: fr, keywords", "path: fr, label: french, keywords")
        .replace("path: js, keywords", "path: js, label: json, keywords")
        .replace(
            "router: {strategies: [explicit, keywords], fallback: base}",
            "router: {strategies: [classifier, keywords], classifierAdapter: fr, minConfidence: 0.0, fallback: base}",
        );
    let s = launch_with(
        dir,
        &yaml,
        |inner| {
            let slow = Arc::new(SlowClassifier {
                inner: inner.clone(),
            });
            EngineHandles {
                serving: slow,
                ..inner
            }
        },
        Duration::from_millis(200),
        true,
    )
    .await;
    for (path, body) in [
        ("/v1/route", json!({"input": "tell me"})),
        (
            "/v1/chat/completions",
            json!({"model": "demo", "max_tokens": 2, "messages": [{"role": "user", "content": "tell me"}]}),
        ),
    ] {
        let url = format!("{}{path}", s.url);
        let routed = tokio::spawn(async move {
            reqwest::Client::new()
                .post(url)
                .json(&body)
                .send()
                .await
                .unwrap()
                .status()
        });
        // Probes every 100 ms while the request is routed (its classifier takes 1.5 s).
        let mut slowest = Duration::ZERO;
        while !routed.is_finished() {
            let t = std::time::Instant::now();
            let r = reqwest::get(format!("{}/healthz", s.url)).await.unwrap();
            assert_eq!(r.status(), 200);
            slowest = slowest.max(t.elapsed());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(
            slowest < Duration::from_millis(500),
            "{path}: a probe took {slowest:?} while the classifier ran"
        );
        assert_eq!(routed.await.unwrap(), 200, "{path}");
    }
}
