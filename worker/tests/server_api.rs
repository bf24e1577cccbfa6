//! HTTP API tests against a running server on a random port with the test-only `EchoEngine`:
//! happy paths (chat, stream, completions, routing headers), the bad-input battery (each
//! answer the right 4xx and the server keeps serving), admin endpoints, metrics, gateway.

mod support;

use std::sync::Arc;
use std::time::Duration;

use mole_worker::server::{cli::serve_with, AppState, Auth};
use serde_json::{json, Value};
use support::EchoEngine;

struct Srv {
    url: String,
    engine: Arc<EchoEngine>,
    _dir: tempfile::TempDir,
    _stop: tokio::sync::oneshot::Sender<()>,
}

fn adapter_dir(root: &std::path::Path, name: &str) {
    let d = root.join(name);
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join("adapter_config.json"), "{}").unwrap();
    std::fs::write(d.join("adapter_model.safetensors"), "x").unwrap();
}

async fn start(extra_adapters: &str, capacity: usize, delay_ms: u64) -> Srv {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    std::fs::create_dir_all(root.join("base")).unwrap();
    adapter_dir(root, "fr");
    adapter_dir(root, "js");
    adapter_dir(root, "extra");
    std::fs::create_dir_all(root.join("binonly")).unwrap();
    std::fs::write(root.join("binonly/adapter_config.json"), "{}").unwrap();
    std::fs::write(root.join("binonly/adapter_model.bin"), "x").unwrap();
    std::fs::write(root.join("admin"), "s3cret\n").unwrap();
    let yaml = format!(
        r#"
pool: demo
modelRoot: {root}
baseModel: {{name: smol, path: base}}
adapters:
  - {{name: fr, version: v1, loraId: 1, path: fr, keywords: [french, bonjour]}}
  - {{name: js, version: v2, loraId: 2, path: js, keywords: [json]}}
{extra_adapters}
router: {{strategies: [explicit, keywords], fallback: base}}
limits: {{maxTokens: 64, maxBodyBytes: 4096, maxSeqLen: 256, requestTimeoutSeconds: 5}}
auth: {{adminTokenFile: {root}/admin}}
"#,
        root = root.display()
    );
    let cfg_path = root.join("config.yaml");
    std::fs::write(&cfg_path, yaml).unwrap();
    let cfg = mole_worker::config::load(&cfg_path).unwrap();
    let engine = EchoEngine::new(capacity, Duration::from_millis(delay_ms));
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
    for _ in 0..100 {
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

#[tokio::test]
async fn chat_routes_and_answers() {
    let s = start("", 8, 0).await;
    let (st, h, b) = post(&s, "/v1/chat/completions", json!({"model": "demo", "messages": [{"role": "user", "content": "say bonjour"}], "max_tokens": 10})).await;
    assert_eq!(st, 200, "{b}");
    assert_eq!(h["x-mole-adapter"], "fr");
    assert_eq!(h["x-mole-route"], "keywords");
    assert_eq!(h["x-mole-mode"], "dynamic");
    assert_eq!(b["choices"][0]["message"]["content"], "[fr] say bonjour");
    assert_eq!(b["choices"][0]["finish_reason"], "stop");
    assert_eq!(b["usage"]["completion_tokens"], 3);
    assert_eq!(b["mole"]["adapter_version"], "v1");
    // Explicit adapter, truncated by max_tokens.
    let (st, _, b) = post(&s, "/v1/chat/completions", json!({"model": "js", "messages": [{"role": "user", "content": "a b c d"}], "max_tokens": 2})).await;
    assert_eq!(st, 200);
    assert_eq!(b["choices"][0]["message"]["content"], "[js] a");
    assert_eq!(b["choices"][0]["finish_reason"], "length");
    // Base model by name; unmatched text falls back to base.
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
    // Completions with token ids.
    let (st, _, b) = post(
        &s,
        "/v1/completions",
        json!({"model": "smol", "prompt": [5, 6], "max_tokens": 5}),
    )
    .await;
    assert_eq!(st, 200, "{b}");
    assert_eq!(b["choices"][0]["text"], "[] 5 6");
    // Route only.
    let (st, _, b) = post(&s, "/v1/route", json!({"input": "to json please"})).await;
    assert_eq!((st, b["adapter"].as_str()), (200, Some("js")));
}

#[tokio::test]
async fn stream_sends_chunks_usage_and_done() {
    let s = start("", 8, 0).await;
    let r = reqwest::Client::new().post(format!("{}/v1/chat/completions", s.url))
        .json(&json!({"model": "fr", "stream": true, "messages": [{"role": "user", "content": "x y"}]}))
        .send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-mole-adapter"], "fr");
    let body = r.text().await.unwrap();
    let datas: Vec<&str> = body
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
    assert_eq!(text, "[fr] x y");
    let last: Value = serde_json::from_str(datas[datas.len() - 2]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "stop");
    assert_eq!(last["usage"]["completion_tokens"], 3);
}

#[tokio::test]
async fn bad_input_battery_keeps_serving() {
    let s = start("", 8, 0).await;
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
    assert_eq!(names, ["extra", "fr", "js"]);
}

#[tokio::test]
async fn overload_gives_429_and_disconnect_cancels() {
    let s = start("", 1, 200).await;
    let c = reqwest::Client::new();
    let body = json!({"model": "fr", "stream": true, "messages": [{"role": "user", "content": "a b c d e f"}]});
    let r1 = c
        .post(format!("{}/v1/chat/completions", s.url))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r1.status(), 200);
    let r2 = c
        .post(format!("{}/v1/chat/completions", s.url))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r2.status(), 429);
    assert_eq!(r2.headers()["retry-after"], "1");
    assert_eq!(
        r2.json::<Value>().await.unwrap()["error"]["code"],
        "overloaded"
    );
    drop(r1);
    for _ in 0..50 {
        if s.engine.cancelled.load(std::sync::atomic::Ordering::SeqCst) == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        s.engine.cancelled.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "client disconnect must cancel"
    );
}

#[tokio::test]
async fn metrics_models_and_reload() {
    let s = start("", 8, 0).await;
    let c = reqwest::Client::new();
    post(
        &s,
        "/v1/chat/completions",
        json!({"model": "fr", "messages": [{"role": "user", "content": "x"}]}),
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
    assert!(m.contains("vllm:lora_requests_info{max_lora=\"4\",running_lora_adapters=\"fr\",waiting_lora_adapters=\"\"}"), "{m}");
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
    assert_eq!(ids, ["demo", "smol", "fr", "js"]);
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
    for _ in 0..50 {
        if !s.engine.adapters.lock().unwrap().contains_key("js") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!s.engine.adapters.lock().unwrap().contains_key("js"));
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
    let up = start("  - {name: mg, version: v1, loraId: 3, path: extra}", 8, 0).await;
    let extra = format!("  - {{name: mg, version: v1, loraId: 3, path: extra, mode: merged, mergedEndpoint: \"{}\", keywords: [merge]}}\n  - {{name: dead, version: v1, loraId: 4, path: extra, mode: merged, mergedEndpoint: \"http://127.0.0.1:1\", load: false}}\n  - {{name: dead2, version: v1, loraId: 5, path: extra, mode: merged, mergedEndpoint: \"http://127.0.0.1:1\"}}", up.url);
    let s = start(&extra, 8, 0).await;
    // Forwarded to the upstream, which serves mg itself.
    let (st, h, b) = post(
        &s,
        "/v1/chat/completions",
        json!({"model": "mg", "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!(h["x-mole-route"], "explicit+proxy");
    assert_eq!(st, 200, "{b}");
    assert_eq!(b["choices"][0]["message"]["content"], "[mg] x");
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

/// Not a test: serves the EchoEngine-backed API on `MOLE_TEST_LISTEN` for
/// `scripts/checks/server-openai.sh` (the `openai` Python client) until killed.
#[tokio::test]
#[ignore]
async fn serve_for_clients() {
    let Ok(addr) = std::env::var("MOLE_TEST_LISTEN") else {
        return;
    };
    let s = start("", 8, 0).await;
    // Relay addr -> the random-port server so the script can use a fixed port.
    let l = tokio::net::TcpListener::bind(&addr).await.unwrap();
    let target = s.url.trim_start_matches("http://").to_string();
    loop {
        let (mut inbound, _) = l.accept().await.unwrap();
        let t = target.clone();
        tokio::spawn(async move {
            if let Ok(mut out) = tokio::net::TcpStream::connect(t).await {
                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut out).await;
            }
        });
    }
}
