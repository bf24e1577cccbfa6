//! HTTP API tests: the real server and the real engine on the committed tiny Llama
//! (tests/fixtures/engine, byte-level tokenizer) with its PEFT adapters, on a random port:
//! happy paths (chat, stream, completions, routing headers), the bad-input battery (each
//! answer the right 4xx and the server keeps serving), admin endpoints, metrics, gateway.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use mole_worker::engine::api::InferenceEngine;
use mole_worker::server::{build_engine, cli::serve_with, AppState, Auth};
use serde_json::{json, Value};

struct Srv {
    url: String,
    engine: Arc<dyn InferenceEngine>,
    _dir: tempfile::TempDir,
    _stop: tokio::sync::oneshot::Sender<()>,
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// A worker on the tiny Llama: adapters fr, js (and whatever `extra_adapters` adds) from the
/// fixture adapters; `batch`/`queue` set the engine's batch and queue sizes.
async fn start(extra_adapters: &str, batch: u32, queue: u32) -> Srv {
    let fx = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/engine");
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    copy_dir(&fx.join("llama"), &root.join("base"));
    copy_dir(&fx.join("adapters/llama/a_r8_all"), &root.join("fr"));
    copy_dir(&fx.join("adapters/llama/b_r4_qv"), &root.join("js"));
    copy_dir(&fx.join("adapters/llama/c_r16_mlp"), &root.join("extra"));
    // Trained on another base model: refused when loaded.
    copy_dir(&fx.join("adapters/qwen2/a_r8_all"), &root.join("wrongbase"));
    std::fs::create_dir_all(root.join("binonly")).unwrap();
    std::fs::write(root.join("binonly/adapter_config.json"), "{}").unwrap();
    std::fs::write(root.join("binonly/adapter_model.bin"), "x").unwrap();
    std::fs::write(root.join("admin"), "s3cret\n").unwrap();
    let yaml = format!(
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
    );
    launch(dir, &yaml).await
}

/// Serves `yaml` (written to `<dir>/config.yaml`) until the returned server is dropped.
async fn launch(dir: tempfile::TempDir, yaml: &str) -> Srv {
    let cfg_path = dir.path().join("config.yaml");
    std::fs::write(&cfg_path, yaml).unwrap();
    let cfg = mole_worker::config::load(&cfg_path).unwrap();
    let engine = build_engine(&cfg).unwrap();
    let auth = Auth::from_config(&cfg).unwrap();
    let state = AppState::new(cfg, engine.clone(), Some(cfg_path.clone()), auth);
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve_with(
        state,
        l,
        cfg_path,
        Duration::from_millis(200),
        async move {
            let _ = rx.await;
        },
    ));
    let c = reqwest::Client::new();
    for _ in 0..200 {
        if let Ok(r) = c.get(format!("{url}/readyz")).send().await {
            if r.status() == 200 {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Srv {
        url,
        engine,
        _dir: dir,
        _stop: tx,
    }
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
    assert_eq!(b["mole"]["adapter_version"], "v1");
    // Greedy is deterministic; the adapter changes the answer.
    let routed = content(&b);
    let (_, _, again) = post(&s, "/v1/chat/completions", ask("fr", "say bonjour", 10)).await;
    assert_eq!(content(&again), routed);
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
    let (st, _, b) = post(&s, "/infer", json!({"prompt": "x", "image_b64": "@@@"})).await;
    assert_eq!(
        (st, b["error"]["code"].as_str()),
        (400, Some("invalid_image"))
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
    let r = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", s.url))
        .json(&body(true))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-mole-adapter"], "fr");
    let text_body = r.text().await.unwrap();
    let datas: Vec<&str> = text_body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(*datas.last().unwrap(), "[DONE]");
    let mut text = String::new();
    for d in &datas[..datas.len() - 1] {
        let v: Value = serde_json::from_str(d).unwrap();
        assert_eq!(v["object"], "chat.completion.chunk");
        text.push_str(v["choices"][0]["delta"]["content"].as_str().unwrap_or(""));
    }
    let last: Value = serde_json::from_str(datas[datas.len() - 2]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert_eq!(last["usage"]["completion_tokens"], 12);
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
            msg(json!([{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}])),
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
            "invalid_request",
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
    ];
    for (path, body, status, code) in cases {
        let (st, _, b) = post(&s, path, body.clone()).await;
        assert_eq!(
            (st, b["error"]["code"].as_str().unwrap_or("")),
            (status, code),
            "{path} {body}"
        );
        assert!(b["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()));
    }
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
    for (path, code) in [
        ("../../etc", "path_outside_root"),
        ("/etc", "path_outside_root"),
        ("binonly", "safetensors_required"),
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
    // A real adapter trained on another base: refused with the reason, nothing else changes.
    let r = adm(json!({"lora_name": "x", "lora_path": "wrongbase"}))
        .await
        .unwrap();
    assert_eq!(r.status(), 422);
    let e = r.json::<Value>().await.unwrap();
    assert_eq!(e["error"]["code"], "invalid_adapter", "{e}");
    assert!(
        e["error"]["message"].as_str().unwrap().contains("qwen2"),
        "{e}"
    );
    let r = adm(json!({"lora_name": "extra", "lora_path": "extra"}))
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let (st, _, _) = post(&s, "/v1/chat/completions", json!({"model": "demo", "adapter": "extra", "messages": [{"role": "user", "content": "x"}]})).await;
    assert_eq!(st, 200, "an adapter loaded via the API is servable by name");
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
    assert_eq!(names, ["extra", "fr", "js", "x"]);
    let x = &l["data"][3];
    assert_eq!(x["loaded"], false);
    assert!(x["error"].as_str().unwrap().contains("qwen2"), "{x}");
}

#[tokio::test]
async fn overload_gives_429_and_disconnect_cancels() {
    // One sequence at a time and one waiting: a burst must see 429s, never a crash.
    let s = start("", 1, 1).await;
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
    // A client that goes away cancels its generation in the engine.
    let before = s.engine.stats().cancelled;
    let mut r1 = c
        .post(format!("{}/v1/chat/completions", s.url))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r1.status(), 200);
    r1.chunk().await.unwrap();
    drop(r1);
    for _ in 0..100 {
        if s.engine.stats().cancelled > before {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        s.engine.stats().cancelled,
        before + 1,
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
    assert!(m.contains("mole_requests_total{adapter=\"fr\",endpoint=\"chat\",route=\"explicit\",status=\"200\"} 1"), "{m}");
    for want in [
        "mole_inter_token_latency_seconds_count{adapter=\"fr\"} 3",
        "mole_time_to_first_token_seconds_count{adapter=\"fr\"} 1",
        "mole_tokens_total{adapter=\"fr\",kind=\"completion\"} 4",
        "mole_adapter_loads_total{result=\"ok\"} 2",
        "mole_adapter_versions{residency=\"cpu\"} 2",
        "mole_requests_cancelled_total 0",
        "mole_batch_size 1",
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
    let has_js = || s.engine.adapters().iter().any(|a| a.name == "js");
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
    // Upstream merged pod: a second server.
    let up = start(
        "  - {name: mg, version: v1, loraId: 3, path: extra}",
        16,
        64,
    )
    .await;
    let extra = format!("  - {{name: mg, version: v1, loraId: 3, path: extra, mode: merged, mergedEndpoint: \"{}\", keywords: [merge]}}\n  - {{name: dead, version: v1, loraId: 4, path: extra, mode: merged, mergedEndpoint: \"http://127.0.0.1:1\", load: false}}\n  - {{name: dead2, version: v1, loraId: 5, path: extra, mode: merged, mergedEndpoint: \"http://127.0.0.1:1\"}}", up.url);
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
    let l: mole_crds::LoraAdaptersResponse =
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
        "  - {name: fm, version: v1, loraId: 3, path: fr, mode: merged}",
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
