//! What one request may cost the others, against the real server on the committed tiny Llama
//! (issue 52): a tenant's prompt blocks are not found by another API key's requests, costly
//! fields are refused with their codes before any work (long stops, huge guides, a body that
//! cannot fit the context, a chat template that runs away), the probes answer while huge
//! grammars arrive, and errors say what without internals (a grammar that fails mid-answer,
//! admin names, `Bearer` in any case, images on a text pool, `json_object` with a schema).

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test

use crate::common;

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::response::IntoResponse;
use mole_engine::api::{ChatMessage, EngineError, EngineHandles, Image, Prompt, PromptCodec};
use mole_server::{build_engine, cli::serve_with, AppState, Auth};
use serde_json::{json, Value};

struct Srv {
    url: String,
    _dir: tempfile::TempDir,
    _stop: tokio::sync::oneshot::Sender<()>,
}

/// A model root: the tiny Llama in `base` (its chat template replaced by `template` when
/// given), adapter `fr`, API keys `ka` and `kb`, an admin token `s3cret`.
fn model_root(template: Option<&str>) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    common::llama_root(dir.path(), &[("a_r8_all", "fr")]);
    if let Some(t) = template {
        let p = dir.path().join("base/tokenizer_config.json");
        let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        cfg["chat_template"] = json!(t);
        std::fs::write(&p, cfg.to_string()).unwrap();
    }
    std::fs::write(dir.path().join("keys"), "ka\nkb\n").unwrap();
    std::fs::write(dir.path().join("admin"), "s3cret\n").unwrap();
    dir
}

/// The config: adapter `fr`, API keys, `limits` (YAML flow mapping entries) added.
fn config_yaml(root: &Path, limits: &str) -> String {
    format!(
        "pool: p\nmodelRoot: {root}\nbaseModel: {{name: llama, path: base, dtype: f32}}\n\
         adapters:\n  - {{name: fr, version: v1, loraId: 1, path: fr}}\n\
         router: {{strategies: [explicit], fallback: base}}\n\
         auth: {{apiKeysFile: {root}/keys, adminTokenFile: {root}/admin}}\n\
         limits: {{maxSeqLen: 128, maxTokens: 64, {limits}}}\n",
        root = root.display()
    )
}

/// The worker over `dir` with `limits`, its engine's parts passed through `wrap`.
async fn launch(
    dir: tempfile::TempDir,
    limits: &str,
    wrap: impl FnOnce(EngineHandles) -> EngineHandles,
) -> Srv {
    let cfg_path = dir.path().join("config.yaml");
    std::fs::write(&cfg_path, config_yaml(dir.path(), limits)).unwrap();
    let cfg = mole_server::config::load(&cfg_path).unwrap();
    let engine = wrap(build_engine(&cfg).unwrap());
    let auth = Auth::from_config(&cfg).unwrap();
    let state = AppState::new(cfg, engine, Some(cfg_path.clone()), auth);
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve_with(state, l, cfg_path, Duration::ZERO, async move {
        let _ = rx.await;
    }));
    let c = reqwest::Client::new();
    let t = Instant::now();
    while c
        .get(format!("{url}/readyz"))
        .send()
        .await
        .map_or(true, |r| r.status() != 200)
    {
        assert!(t.elapsed() < Duration::from_secs(10), "never ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Srv {
        url,
        _dir: dir,
        _stop: tx,
    }
}

async fn start(limits: &str) -> Srv {
    launch(model_root(None), limits, |e| e).await
}

/// `POST path` with `body` as API key `key`: status and body.
async fn post(s: &Srv, path: &str, key: &str, body: &Value) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(format!("{}{path}", s.url))
        .header("authorization", format!("Bearer {key}"))
        .json(body)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

fn chat(text: &str) -> Value {
    json!({"model": "llama", "max_tokens": 2, "temperature": 0,
           "messages": [{"role": "user", "content": text}]})
}

fn cached(b: &Value) -> u64 {
    b["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached_tokens in {b}"))
}

fn code(b: &Value) -> &str {
    b["error"]["code"].as_str().unwrap_or("")
}

/// A second key holder sends the first's prompt: nothing of it comes from the cache (else its
/// `cached_tokens` would tell, digit by digit, what the first one's prompt holds); the first
/// key still finds its own blocks.
#[tokio::test]
async fn api_keys_do_not_share_the_prefix_cache() {
    let s = start("").await;
    let secret = chat("the pin of the vault is 4711, never tell it");
    let (st, b) = post(&s, "/v1/chat/completions", "ka", &secret).await;
    assert_eq!((st, cached(&b)), (200, 0), "{b}");
    let (st, b) = post(&s, "/v1/chat/completions", "kb", &secret).await;
    assert_eq!(st, 200, "{b}");
    assert_eq!(cached(&b), 0, "kb found ka's prompt in the cache: {b}");
    let (_, b) = post(&s, "/v1/chat/completions", "ka", &secret).await;
    assert!(cached(&b) > 0, "ka's own prompt is cached for ka: {b}");
    // A salt partitions a key's cache further.
    let mut salted = secret.clone();
    salted["cache_salt"] = json!("s1");
    let (_, b) = post(&s, "/v1/chat/completions", "ka", &salted).await;
    assert_eq!(cached(&b), 0, "{b}");
}

/// `limits.prefixCacheScope: pool` opts into one cache for every key.
#[tokio::test]
async fn a_pool_may_share_its_prefix_cache() {
    let s = start("prefixCacheScope: pool").await;
    let p = chat("a system prompt every caller of this pool sends");
    let (st, _) = post(&s, "/v1/chat/completions", "ka", &p).await;
    assert_eq!(st, 200);
    let (_, b) = post(&s, "/v1/chat/completions", "kb", &p).await;
    assert!(cached(&b) > 0, "{b}");
}

/// `Authorization: bearer <key>` (RFC 9110: the scheme is case-insensitive).
#[tokio::test]
async fn the_bearer_scheme_is_case_insensitive() {
    let s = start("").await;
    for scheme in ["bearer", "BEARER", "Bearer"] {
        let r = reqwest::Client::new()
            .get(format!("{}/v1/models", s.url))
            .header("authorization", format!("{scheme} ka"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{scheme}");
    }
}

/// Huge guides arrive while the probes are polled: each is refused quickly with its code,
/// and every probe answers within a second. The server runs on a runtime of its own with two
/// worker threads, as a pod on two cores does, so that what blocks its threads blocks its
/// probes.
#[test]
fn probes_answer_while_huge_guides_are_refused() {
    let (url_tx, url_rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    // A runtime of two worker threads, as a pod on two cores has.
    let two_threads = || {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
    };
    let server = std::thread::spawn(move || {
        two_threads().block_on(async move {
            let s = start("").await;
            url_tx.send(s.url.clone()).unwrap();
            let _ = stop_rx.await;
        });
    });
    let url = url_rx.recv().unwrap();
    two_threads().block_on(async move {
        let c = reqwest::Client::new();
        // 150,000 choices (about 1.6 MB): what froze a worker's runtime for 45 s.
        let choices: Vec<String> = (0..150_000).map(|i| format!("choice-{i}")).collect();
        let body = json!({"model": "llama", "max_tokens": 2,
            "messages": [{"role": "user", "content": "pick one"}],
            "guided_choice": choices});
        let huge: Vec<_> = (0..4)
            .map(|_| {
                let (c, url, body) = (c.clone(), url.clone(), body.clone());
                tokio::spawn(async move {
                    let t = Instant::now();
                    let r = c
                        .post(format!("{url}/v1/chat/completions"))
                        .bearer_auth("ka")
                        .timeout(Duration::from_secs(20))
                        .json(&body)
                        .send()
                        .await;
                    let answer = match r {
                        Ok(r) => (
                            r.status().as_u16(),
                            r.json::<Value>().await.unwrap_or_default(),
                        ),
                        Err(e) => (0, json!({"error": {"code": e.to_string()}})),
                    };
                    (answer, t.elapsed())
                })
            })
            .collect();
        let mut slowest = Duration::ZERO;
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(4) || !huge.iter().all(|h| h.is_finished()) {
            let p = Instant::now();
            let r = c
                .get(format!("{url}/healthz"))
                .timeout(Duration::from_secs(5))
                .send()
                .await;
            let took = p.elapsed();
            match r {
                Ok(r) => assert_eq!(r.status(), 200),
                Err(e) => panic!("a probe failed after {took:?}: {e}"),
            }
            slowest = slowest.max(took);
            assert!(took < Duration::from_secs(1), "a probe took {took:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "the requests never ended"
            );
        }
        for h in huge {
            let ((st, b), took) = h.await.unwrap();
            assert_eq!((st, code(&b)), (400, "too_many_choices"), "{b}");
            assert!(took < Duration::from_secs(10), "refused after {took:?}");
        }
        eprintln!("slowest probe: {slowest:?}");
    });
    stop_tx.send(()).unwrap();
    server.join().unwrap();
}

/// The parts of a codec that count the chat templates rendered and the prompts tokenized.
struct Counting {
    inner: Arc<dyn PromptCodec>,
    calls: Arc<AtomicUsize>,
}

impl PromptCodec for Counting {
    fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        kwargs: &serde_json::Map<String, Value>,
    ) -> Result<String, EngineError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.apply_chat_template(messages, kwargs)
    }
    fn chat_template(&self) -> Option<String> {
        self.inner.chat_template()
    }
    fn tokenize(&self, prompt: &Prompt, images: &[Image]) -> Result<Vec<u32>, EngineError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.tokenize(prompt, images)
    }
    fn detokenize(&self, ids: &[u32]) -> Result<String, EngineError> {
        self.inner.detokenize(ids)
    }
    fn encode(&self, prompt: &Prompt) -> Result<Vec<u32>, EngineError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.encode(prompt)
    }
    fn image_tokens(&self, width: u32, height: u32) -> Result<usize, EngineError> {
        self.inner.image_tokens(width, height)
    }
}

/// Each costly field over its limit is refused with its code before any template is rendered
/// or prompt tokenized: stop strings, guides, choices, and a body whose text cannot fit the
/// context (maxSeqLen 128 tokens; the byte tokenizer's tokens are at most a few bytes).
#[tokio::test]
async fn costly_fields_are_refused_before_any_work() {
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let s = launch(model_root(None), "", move |mut e| {
        e.codec = Arc::new(Counting {
            inner: e.codec,
            calls: c,
        });
        e
    })
    .await;
    let with = |k: &str, v: Value| {
        let mut b = chat("hi");
        b[k] = v;
        b
    };
    let long = "x".repeat(300_000);
    let many: Vec<String> = (0..5000).map(|i| i.to_string()).collect();
    let chats = "/v1/chat/completions";
    let schema = json!({"type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object", "description": long}}});
    for (path, body, want) in [
        (chats, with("stop", json!([long.clone()])), "stop_too_long"),
        (
            chats,
            with("guided_regex", json!(long.clone())),
            "guide_too_large",
        ),
        (
            chats,
            with("guided_grammar", json!(format!("start: \"{long}\""))),
            "guide_too_large",
        ),
        (chats, with("response_format", schema), "guide_too_large"),
        (
            chats,
            with("guided_choice", json!(many)),
            "too_many_choices",
        ),
        (chats, chat(&"word ".repeat(100_000)), "prompt_too_long"),
        // The same with completions' prompt.
        (
            "/v1/completions",
            json!({"model": "llama", "prompt": "word ".repeat(100_000)}),
            "prompt_too_long",
        ),
    ] {
        let (st, b) = post(&s, path, "ka", &body).await;
        assert_eq!((st, code(&b)), (400, want), "{path}: {b}");
    }
    assert_eq!(
        calls.load(Ordering::SeqCst),
        0,
        "work was done before a refusal"
    );
    // Under the limits, served.
    let (st, b) = post(
        &s,
        "/v1/chat/completions",
        "ka",
        &with("stop", json!(["x".repeat(64)])),
    )
    .await;
    assert_eq!(st, 200, "{b}");
}

/// A chat template that loops (10^8 times: 7 s of a thread before) is stopped by
/// `limits.maxTemplateFuel`: a 400 with its code.
#[tokio::test]
async fn a_runaway_chat_template_runs_out_of_fuel() {
    let t = "{% for a in range(10000) %}{% for b in range(10000) %}{% endfor %}{% endfor %}\
             {% for m in messages %}{{ m.content }}{% endfor %}";
    let s = launch(model_root(Some(t)), "", |e| e).await;
    let r = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", s.url))
        .bearer_auth("ka")
        .timeout(Duration::from_secs(30))
        .json(&chat("hi"))
        .send()
        .await
        .expect("answered within 30 s");
    let st = r.status().as_u16();
    let b: Value = r.json().await.unwrap();
    assert_eq!((st, code(&b)), (400, "template_fuel_exhausted"), "{b}");
}

/// A grammar that fails while the answer is generated (here: an ambiguous grammar past
/// llguidance's items per step, lowered in `limits.guideParser`) ends that request with a
/// 4xx naming the failure, without the parser's state; the next request is served.
#[tokio::test]
async fn a_grammar_failing_mid_answer_is_no_server_error() {
    let s = start("guideParser: {stepMaxItems: 120}").await;
    let mut b = chat("go");
    b["max_tokens"] = json!(60);
    b["ignore_eos"] = json!(true);
    b["guided_grammar"] = json!("start: s\ns: s s | \"a\" | \"b\"\n");
    for stream in [false, true] {
        b["stream"] = json!(stream);
        let r = reqwest::Client::new()
            .post(format!("{}/v1/chat/completions", s.url))
            .bearer_auth("ka")
            .json(&b)
            .send()
            .await
            .unwrap();
        let st = r.status().as_u16();
        let text = r.text().await.unwrap();
        assert!(st < 500, "{st}: {text}");
        assert!(text.contains("grammar_failed"), "{text}");
        for internal in ["backtrace", "Earley", "lexer state", "tokens:"] {
            assert!(!text.contains(internal), "{internal} in {text}");
        }
    }
    let (st, _) = post(&s, "/v1/chat/completions", "ka", &chat("hi")).await;
    assert_eq!(st, 200);
}

/// `/v1/load_lora_adapter` takes names as the config takes adapters' names: a plain name, not
/// the pool's or the base model's.
#[tokio::test]
async fn admin_names_follow_the_adapter_rule() {
    let s = start("").await;
    for name in ["..", "a/b", "p", "llama", "x\ny", ""] {
        let (st, b) = post(
            &s,
            "/v1/load_lora_adapter",
            "s3cret",
            &json!({"lora_name": name, "lora_path": "fr"}),
        )
        .await;
        assert_eq!(
            (st, code(&b)),
            (400, "invalid_adapter_name"),
            "{name:?}: {b}"
        );
    }
    let (st, b) = post(
        &s,
        "/v1/load_lora_adapter",
        "s3cret",
        &json!({"lora_name": "fr-2", "lora_path": "fr"}),
    )
    .await;
    assert!(
        st == 200 || code(&b) == "adapter_path_overlaps",
        "{st}: {b}"
    );
}

/// `/v1/route` on a text-only pool refuses an image before fetching it.
#[tokio::test]
async fn route_refuses_images_on_a_text_pool_before_fetching() {
    let hits = Arc::new(AtomicUsize::new(0));
    let h = hits.clone();
    let app = axum::Router::new().fallback(move || {
        h.fetch_add(1, Ordering::SeqCst);
        async { "not an image".into_response() }
    });
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(l, app).await });
    let s = start(&format!(
        "imageUrlHosts: [\"127.0.0.1:{port}\"], imageUrlAllowPrivate: true"
    ))
    .await;
    let body = json!({"model": "llama", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": format!("http://127.0.0.1:{port}/a.png")}},
        {"type": "text", "text": "what is this"},
    ]}]});
    let (st, b) = post(&s, "/v1/route", "ka", &body).await;
    assert_eq!((st, code(&b)), (400, "images_not_supported"), "{b}");
    assert_eq!(hits.load(Ordering::SeqCst), 0, "the image was fetched");
}

/// `response_format: {"type": "json_object", "schema": ...}` (llama.cpp's form, and older
/// `instructor`'s) follows the schema.
#[tokio::test]
async fn json_object_with_a_schema_follows_the_schema() {
    let s = start("").await;
    let schema = json!({"type": "object", "properties": {"pick": {"enum": ["left", "right"]}},
                        "required": ["pick"], "additionalProperties": false});
    for seed in 0..3 {
        let mut b = chat("choose");
        b["max_tokens"] = json!(40);
        b["temperature"] = json!(1.0);
        b["seed"] = json!(seed);
        b["response_format"] = json!({"type": "json_object", "schema": schema});
        let (st, b) = post(&s, "/v1/chat/completions", "ka", &b).await;
        assert_eq!(st, 200, "{b}");
        let text = b["choices"][0]["message"]["content"].as_str().unwrap();
        let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert!(
            v == json!({"pick": "left"}) || v == json!({"pick": "right"}),
            "{text}"
        );
    }
}
