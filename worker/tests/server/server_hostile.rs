//! Hostile requests against the real server on the committed tiny Llama: image URLs that try to
//! reach what `limits.imageUrlHosts` does not list (a backslash in the authority, a redirect, a
//! loopback address, an odd port), each refused with nothing fetched from the host it aims at
//! (local HTTP servers count their hits), and fetch failures that do not echo the remote;
//! requests that cost memory or time out of proportion (a million `stop_token_ids`, a request's
//! images over the pixel budget, big bodies on the small endpoints); adapters whose directory
//! overlaps the base model's, `merged/` or another adapter's. Images go through
//! `POST /v1/route` on the tiny Qwen3-VL, which reads a request's images as chat does (a text
//! pool refuses image parts before reading them).

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test

use crate::common;

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::response::IntoResponse;
use serde_json::{json, Value};

struct Srv {
    url: String,
    _dir: tempfile::TempDir,
    _stop: tokio::sync::oneshot::Sender<()>,
}

/// A model root: the tiny Llama in `base`, its adapters in `adapters/fr` and `adapters/js`,
/// an admin token in `admin`.
fn model_root() -> tempfile::TempDir {
    let fx = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/engine");
    let dir = tempfile::tempdir().unwrap();
    common::copy_dir(&fx.join("llama"), &dir.path().join("base"));
    common::copy_dir(
        &fx.join("adapters/llama/a_r8_all"),
        &dir.path().join("adapters/fr"),
    );
    common::copy_dir(
        &fx.join("adapters/llama/b_r4_qv"),
        &dir.path().join("adapters/js"),
    );
    std::fs::write(dir.path().join("admin"), "s3cret\n").unwrap();
    dir
}

/// The config of [`start`]: adapter `fr` configured, `limits` (YAML flow mapping entries)
/// added to the limits.
fn config_yaml(root: &Path, limits: &str) -> String {
    format!(
        "pool: p\nmodelRoot: {root}\nbaseModel: {{name: llama, path: base, dtype: f32}}\n\
         adapters:\n  - {{name: fr, version: v1, loraId: 1, path: adapters/fr}}\n\
         router: {{strategies: [explicit], fallback: base}}\n\
         auth: {{adminTokenFile: {root}/admin}}\n\
         limits: {{maxSeqLen: 256, maxTokens: 64, {limits}}}\n",
        root = root.display()
    )
}

/// The worker on the tiny Llama (see [`config_yaml`]).
async fn start(limits: &str) -> Srv {
    start_in(model_root(), limits).await
}

/// A worker on the tiny Qwen3-VL (a text pool refuses image parts before reading them), no
/// adapters, `limits` added to its limits: what the image tests send their images to.
async fn start_vision(limits: &str) -> Srv {
    let fx = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/vision/qwen3_vl");
    let dir = tempfile::tempdir().unwrap();
    common::copy_dir(&fx, &dir.path().join("base"));
    std::fs::write(dir.path().join("admin"), "s3cret\n").unwrap();
    let yaml = format!(
        "pool: p\nmodelRoot: {root}\n\
         baseModel: {{name: llama, path: base, dtype: f32, imageProcessor: pil}}\n\
         router: {{strategies: [explicit], fallback: base}}\n\
         auth: {{adminTokenFile: {root}/admin}}\n\
         limits: {{maxSeqLen: 512, maxTokens: 16, {limits}}}\n",
        root = dir.path().display()
    );
    let (url, tx) = common::serve_config(dir.path(), &yaml).await;
    Srv {
        url,
        _dir: dir,
        _stop: tx,
    }
}

/// [`start`] on the model root `dir`.
async fn start_in(dir: tempfile::TempDir, limits: &str) -> Srv {
    let yaml = config_yaml(dir.path(), limits);
    let (url, tx) = common::serve_config(dir.path(), &yaml).await;
    Srv {
        url,
        _dir: dir,
        _stop: tx,
    }
}

/// A PNG of `w × h`.
fn png(w: u32, h: u32) -> Vec<u8> {
    let img = image::RgbImage::from_fn(w, h, |x, y| image::Rgb([x as u8, y as u8, 7]));
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

/// An image host on 127.0.0.1 that counts every request it gets: `/img.png` is a PNG,
/// `/redirect` a 302 to `redirect_to`, `/broken` a 500 whose body names a secret.
struct Host {
    port: u16,
    hits: Arc<AtomicUsize>,
}

async fn host(redirect_to: Option<String>) -> Host {
    let hits = Arc::new(AtomicUsize::new(0));
    let h = hits.clone();
    let app = axum::Router::new().fallback(move |uri: axum::http::Uri| {
        let h = h.clone();
        let to = redirect_to.clone();
        async move {
            h.fetch_add(1, Ordering::SeqCst);
            match uri.path() {
                "/img.png" => ([("content-type", "image/png")], png(4, 3)).into_response(),
                "/redirect" => (
                    axum::http::StatusCode::FOUND,
                    [("location", to.unwrap_or_default())],
                )
                    .into_response(),
                _ => (
                    axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                    "internal-secret-4711",
                )
                    .into_response(),
            }
        }
    });
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(l, app).await });
    Host { port, hits }
}

/// `POST /v1/route` with one image part of `url`: the status and the error's code and message.
async fn route_image(s: &Srv, url: &str) -> (u16, String, String) {
    let body = json!({"model": "llama", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "what is this"},
    ]}]});
    let r = reqwest::Client::new()
        .post(format!("{}/v1/route", s.url))
        .json(&body)
        .send()
        .await
        .unwrap();
    let st = r.status().as_u16();
    let b: Value = r.json().await.unwrap_or(Value::Null);
    let code = b["error"]["code"].as_str().unwrap_or("").to_string();
    let msg = b["error"]["message"].as_str().unwrap_or("").to_string();
    (st, code, msg)
}

/// By default a listed host is fetched only on its scheme's port and only when it resolves to
/// a public address: a loopback listener is never reached.
#[tokio::test]
async fn image_urls_to_loopback_and_odd_ports_are_refused_by_default() {
    let a = host(None).await;
    let s = start_vision(&format!(
        "imageUrlHosts: [localhost, \"127.0.0.1:{p}\", \"[::ffff:127.0.0.1]:{p}\"]",
        p = a.port
    ))
    .await;
    let p = a.port;
    for url in [
        // Listed without a port: only port 80 is.
        format!("http://localhost:{p}/img.png"),
        // Listed with its port, but loopback, also as an IPv4-mapped IPv6 address.
        format!("http://127.0.0.1:{p}/img.png"),
        format!("http://[::ffff:127.0.0.1]:{p}/img.png"),
        // A listed name on its port that resolves to loopback: refused before any connection
        // (a connection to port 80 would fail as image_fetch_failed instead).
        "http://localhost/img.png".to_string(),
    ] {
        let (st, code, msg) = route_image(&s, &url).await;
        assert_eq!(
            (st, code.as_str()),
            (400, "image_url_not_allowed"),
            "{url}: {msg}"
        );
    }
    assert_eq!(
        a.hits.load(Ordering::SeqCst),
        0,
        "a refused URL was fetched"
    );
}

/// With loopback allowed (as for the test's own hosts), the host compared is the one the client
/// connects to, redirects are not followed and failures do not echo the remote.
#[tokio::test]
async fn image_urls_are_checked_by_the_host_reached_and_redirects_are_not_followed() {
    let b = host(None).await;
    let a = host(Some(format!("http://127.0.0.1:{}/img.png", b.port))).await;
    let s = start_vision(&format!(
        "imageUrlHosts: [img.example.com, \"127.0.0.1:{}\"], imageUrlAllowPrivate: true",
        a.port
    ))
    .await;
    // The url crate (and so reqwest) ends the authority at `\`: this is 127.0.0.1:<b>.
    let sneaky = format!(r"http://127.0.0.1:{}\@img.example.com/img.png", b.port);
    let (st, code, msg) = route_image(&s, &sneaky).await;
    assert_eq!((st, code.as_str()), (400, "image_url_not_allowed"), "{msg}");
    assert_eq!(
        b.hits.load(Ordering::SeqCst),
        0,
        "the backslash URL was fetched"
    );
    // An allowed host's redirect to an unlisted one is not followed.
    let (st, code, msg) = route_image(&s, &format!("http://127.0.0.1:{}/redirect", a.port)).await;
    assert_eq!((st, code.as_str()), (400, "image_fetch_failed"), "{msg}");
    assert_eq!(
        b.hits.load(Ordering::SeqCst),
        0,
        "the redirect was followed"
    );
    // A failure names neither the remote's status nor its body.
    let (st, code, msg) = route_image(&s, &format!("http://127.0.0.1:{}/broken", a.port)).await;
    assert_eq!((st, code.as_str()), (400, "image_fetch_failed"), "{msg}");
    assert!(!msg.contains("500") && !msg.contains("secret"), "{msg}");
    // What is allowed is fetched.
    let (st, code, msg) = route_image(&s, &format!("http://127.0.0.1:{}/img.png", a.port)).await;
    assert_eq!((st, code.as_str()), (200, ""), "{msg}");
    assert_eq!(a.hits.load(Ordering::SeqCst), 3);
}

/// POSTs `body` to `path`: the status and the error code.
async fn post(s: &Srv, path: &str, body: String) -> (u16, String) {
    let r = reqwest::Client::new()
        .post(format!("{}{path}", s.url))
        .header("content-type", "application/json")
        .bearer_auth("s3cret")
        .body(body)
        .send()
        .await
        .unwrap();
    let st = r.status().as_u16();
    let b: Value = r.json().await.unwrap_or(Value::Null);
    (st, b["error"]["code"].as_str().unwrap_or("").to_string())
}

/// `stop_token_ids` is checked against every token a shared batch generates: a million of
/// them is refused, and so is one over 64.
#[tokio::test]
async fn stop_token_ids_are_bounded() {
    let s = start("").await;
    let body = |ids: Vec<u32>| {
        json!({"model": "llama", "prompt": "x", "max_tokens": 1, "stop_token_ids": ids}).to_string()
    };
    let (st, code) = post(&s, "/v1/completions", body(vec![7; 1_000_000])).await;
    assert_eq!((st, code.as_str()), (400, "invalid_stop_token_ids"));
    let (st, code) = post(&s, "/v1/completions", body((0..65).collect())).await;
    assert_eq!((st, code.as_str()), (400, "invalid_stop_token_ids"));
    // 64 are accepted, duplicates among them.
    let many: Vec<u32> = (0..32).cycle().take(64).collect();
    let (st, code) = post(&s, "/v1/completions", body(many)).await;
    assert_eq!((st, code.as_str()), (200, ""));
}

/// The endpoints that take small bodies (tokenize, detokenize, route, admin) refuse a big one
/// with the JSON 413, far below the chat endpoints' `maxBodyBytes`.
#[tokio::test]
async fn small_endpoints_refuse_big_bodies() {
    let s = start("").await;
    let big = |field: &str| json!({"model": "llama", field: "x ".repeat(600_000)}).to_string();
    for (path, body) in [
        ("/tokenize", big("prompt")),
        ("/detokenize", big("tokens")),
        ("/v1/route", big("input")),
        ("/v1/load_lora_adapter", big("lora_name")),
    ] {
        let (st, code) = post(&s, path, body).await;
        assert_eq!((st, code.as_str()), (413, "body_too_large"), "{path}");
    }
    // The chat endpoint still takes a body of that size (and refuses the prompt by length).
    let chat = json!({"model": "llama", "prompt": "x ".repeat(600_000), "max_tokens": 1});
    let (st, code) = post(&s, "/v1/completions", chat.to_string()).await;
    assert_eq!((st, code.as_str()), (400, "prompt_too_long"));
}

/// A request's images together are held to `limits.maxRequestImagePixels`, read from their
/// headers before any is decoded.
#[tokio::test]
async fn a_requests_images_are_held_to_a_pixel_budget() {
    use base64::Engine as _;
    let s = start_vision("maxRequestImagePixels: 5000000").await;
    let img = format!(
        "data:image/png;base64,{}",
        base64::engine::general_purpose::STANDARD.encode(png(2000, 1000))
    );
    let body = |n: usize| {
        let mut parts: Vec<Value> = (0..n)
            .map(|_| json!({"type": "image_url", "image_url": {"url": img}}))
            .collect();
        parts.push(json!({"type": "text", "text": "what is this"}));
        json!({"model": "llama", "messages": [{"role": "user", "content": parts}]}).to_string()
    };
    let (st, code) = post(&s, "/v1/route", body(2)).await;
    assert_eq!((st, code.as_str()), (200, ""));
    let (st, code) = post(&s, "/v1/route", body(3)).await;
    assert_eq!((st, code.as_str()), (413, "image_pixels_exceeded"));
}

/// An adapter's directory must not equal, contain or lie inside the base model's, the
/// `merged/` tree or another adapter's: refused in the config and by `/v1/load_lora_adapter`.
#[tokio::test]
async fn adapter_directories_must_not_overlap() {
    let dir = model_root();
    let root = dir.path();
    std::fs::create_dir_all(root.join("merged/fr-v1")).unwrap();
    let fx = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/engine/adapters/llama");
    common::copy_dir(&fx.join("a_r8_all"), &root.join("base/lora"));
    common::copy_dir(&fx.join("a_r8_all"), &root.join("adapters/fr/inner"));
    let with = |path: &str| {
        config_yaml(root, "").replace(
            "path: adapters/fr}",
            &format!("path: adapters/fr}}\n  - {{name: x, version: v1, loraId: 2, path: {path}}}"),
        )
    };
    for path in [
        "base",
        "base/lora",
        ".",
        "merged/fr-v1",
        "adapters/fr",
        "adapters/fr/inner",
        "adapters",
    ] {
        let e = mole_server::config::parse(&with(path), "t")
            .and_then(|c| mole_server::config::validate(&c))
            .err()
            .unwrap_or_else(|| panic!("{path} was accepted"));
        assert_eq!(e.code(), "adapter_path_overlaps", "{path}: {e}");
    }
    mole_server::config::validate(&mole_server::config::parse(&with("adapters/js"), "t").unwrap())
        .unwrap();

    let s = start_in(dir, "").await;
    for path in [
        "base/lora",
        "adapters/fr/inner",
        "adapters/fr",
        "merged/../base/lora",
    ] {
        let body = json!({"lora_name": "x", "lora_path": path}).to_string();
        let (st, code) = post(&s, "/v1/load_lora_adapter", body).await;
        assert_eq!(
            (st, code.as_str()),
            (400, "adapter_path_overlaps"),
            "{path}"
        );
    }
    let body = json!({"lora_name": "x", "lora_path": "adapters/js"}).to_string();
    assert_eq!(
        post(&s, "/v1/load_lora_adapter", body).await,
        (200, String::new())
    );
}
