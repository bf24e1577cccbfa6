//! Helpers shared by the integration tests.

pub mod steps;

use mole_engine::ModelSource;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Writes `bytes` into the FIFO `fifo` once a reader has it open — the way tests hold an
/// adapter load mid-read and release it. The open is non-blocking and retried while
/// `reader_alive()` and for 20 s at most, so a reader that failed early cannot hang a test.
#[allow(dead_code)] // each test crate uses some of these helpers
pub fn feed_fifo(fifo: &Path, bytes: &[u8], reader_alive: impl Fn() -> bool) {
    const O_NONBLOCK: i32 = 0o4000;
    let t = Instant::now();
    let mut w = loop {
        match std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(O_NONBLOCK)
            .open(fifo)
        {
            Ok(w) => break w,
            Err(_) if reader_alive() && t.elapsed() < Duration::from_secs(20) => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(err) => panic!("nothing opened {} for reading: {err}", fifo.display()),
        }
    };
    std::io::Write::write_all(&mut w, bytes).unwrap();
}

/// Copies the files of directory `from` (not its subdirectories) into `to`, created.
#[allow(dead_code)] // each test crate uses some of these helpers
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("the target directory is created");
    for e in std::fs::read_dir(from).expect("the fixture directory reads") {
        let e = e.expect("a directory entry");
        std::fs::copy(e.path(), to.join(e.file_name())).expect("a fixture file copies");
    }
}

/// The tiny Llama fixture as `<dir>/base` and the fixture adapters `(fixture, dest)` (a
/// directory under `adapters/llama`, a path under `dir`): a loopback worker's model root.
#[allow(dead_code)] // each test crate uses some of these helpers
pub fn llama_root(dir: &Path, adapters: &[(&str, &str)]) {
    let fx = engine_fixtures();
    copy_dir(&fx.join("llama"), &dir.join("base"));
    for (fixture, dest) in adapters {
        copy_dir(&fx.join("adapters/llama").join(fixture), &dir.join(dest));
    }
}

/// A PEFT directory `dir` holding the weights of the adapter directory `from` and a FIFO as
/// its `adapter_config.json` (returned): a load of it blocks until the test writes the real
/// config into the FIFO ([`feed_fifo`]), which holds a load mid-read deterministically.
#[allow(dead_code)] // each test crate uses some of these helpers
pub fn fifo_adapter(from: &Path, dir: &Path) -> PathBuf {
    std::fs::create_dir_all(dir).expect("the adapter directory is created");
    std::fs::copy(
        from.join("adapter_model.safetensors"),
        dir.join("adapter_model.safetensors"),
    )
    .expect("the weights copy");
    let fifo = dir.join("adapter_config.json");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .expect("mkfifo runs");
    assert!(made.success(), "mkfifo {}", fifo.display());
    fifo
}

/// `GET url` as JSON.
#[allow(dead_code)] // each test crate uses some of these helpers
pub async fn get_json(c: &reqwest::Client, url: &str) -> serde_json::Value {
    c.get(url)
        .send()
        .await
        .expect("the worker answers")
        .json()
        .await
        .expect("a JSON answer")
}

/// The `/metrics` text of the worker at `url`.
#[allow(dead_code)] // each test crate uses some of these helpers
pub async fn scrape(c: &reqwest::Client, url: &str) -> String {
    c.get(format!("{url}/metrics"))
        .send()
        .await
        .expect("the worker answers")
        .text()
        .await
        .expect("a text answer")
}

/// Requests completed per version of adapter `name` by the worker at `url` (the traffic
/// counters of its `/v1/lora_adapters`, which the operator reads).
#[allow(dead_code)] // each test crate uses some of these helpers
pub async fn served(
    c: &reqwest::Client,
    url: &str,
    name: &str,
) -> std::collections::BTreeMap<String, u64> {
    let b = get_json(c, &format!("{url}/v1/lora_adapters")).await;
    let mut out = std::collections::BTreeMap::new();
    for t in b["traffic"].as_array().into_iter().flatten() {
        if t["name"] == name {
            *out.entry(t["version"].as_str().unwrap_or_default().to_string())
                .or_default() += t["requests"].as_u64().unwrap_or_default();
        }
    }
    out
}

/// The token ids of a JSON array (the fixtures' reference files).
#[allow(dead_code)] // each test crate uses some of these helpers
pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("an array of token ids")
        .iter()
        .map(|x| x.as_u64().expect("a token id") as u32)
        .collect()
}

/// Waits (20 s at most) until `f` holds.
#[allow(dead_code)] // each test crate uses some of these helpers
pub fn wait_until(what: &str, f: impl Fn() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The engine fixtures (`tests/fixtures/engine`).
#[allow(dead_code)] // each test crate uses some of these helpers
pub fn engine_fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/engine")
}

/// The engine fixtures' transformers + PEFT references.
#[allow(dead_code)] // each test crate uses some of these helpers
pub fn engine_reference() -> serde_json::Value {
    let text = std::fs::read_to_string(engine_fixtures().join("reference.json"))
        .expect("tests/fixtures/engine/reference.json");
    serde_json::from_str(&text).expect("reference.json is JSON")
}

/// The device a test runs on: the CPU, or with `MOLE_TEST_DEVICE=cuda` the first GPU (a
/// `--features cuda` build; `scripts/gpu-bundle.sh` bundles the tests that read this).
#[allow(dead_code)] // each test crate uses some of these helpers
pub fn test_device() -> candle_core::Device {
    match std::env::var("MOLE_TEST_DEVICE").as_deref() {
        Err(_) | Ok("") | Ok("cpu") => candle_core::Device::Cpu,
        Ok("cuda") => candle_core::Device::new_cuda(0)
            .expect("MOLE_TEST_DEVICE=cuda needs a --features cuda build and a GPU"),
        Ok(other) => panic!("MOLE_TEST_DEVICE={other}: expected cpu or cuda"),
    }
}

/// An engine over the llama fixture on the tensor path (what a GPU runs: the host kernels
/// off), its options set by `f`, its LoRA kernel by `MOLE_LORA_KERNEL` as `serve` takes it
/// (`ops` unless set), so a test of the tensor path's engine runs with either.
#[allow(dead_code)] // each test crate uses some of these helpers
pub fn tensor_engine(f: impl FnOnce(&mut mole_engine::EngineOptions)) -> mole_engine::Engine {
    let dir = engine_fixtures().join("llama");
    let model = mole_model::Decoder::load(&dir, candle_core::DType::F32, &test_device())
        .expect("the llama fixture loads");
    let lora_kernel = match std::env::var("MOLE_LORA_KERNEL") {
        Ok(k) => k.parse().expect("MOLE_LORA_KERNEL: ops or bgmv"),
        Err(_) => mole_model::LoraKernel::Ops,
    };
    let mut opts = mole_engine::EngineOptions {
        base_name: "llama".into(),
        lora_kernel,
        backend: mole_model::BackendKind::Paged,
        ..Default::default()
    };
    f(&mut opts);
    let text = mole_engine::text::TextModel::load(&dir).expect("its tokenizer loads");
    mole_engine::Engine::start(model, text, opts)
}

/// A worker serving `yaml` (written to `<dir>/config.yaml`, paths relative to `dir`) on a
/// random loopback port, ready (`/readyz` 200, 10 s at most); it stops when the returned
/// sender is dropped. Returns its base URL and that sender.
#[allow(dead_code)] // each test crate uses some of these helpers
pub async fn serve_config(dir: &Path, yaml: &str) -> (String, tokio::sync::oneshot::Sender<()>) {
    use mole_server::{build_engine, cli::serve_with, AppState, Auth};
    let cfg_path = dir.join("config.yaml");
    std::fs::write(&cfg_path, yaml).expect("the config is written");
    let cfg = mole_server::config::load(&cfg_path).expect("the config loads");
    let engine = build_engine(&cfg).expect("the engine starts");
    let auth = Auth::from_config(&cfg).expect("the auth settings read");
    let state = AppState::new(cfg, engine, Some(cfg_path.clone()), auth);
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a loopback port");
    let url = format!("http://{}", l.local_addr().expect("a bound address"));
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve_with(state, l, cfg_path, Duration::ZERO, async move {
        let _ = rx.await;
    }));
    let c = reqwest::Client::new();
    let t = Instant::now();
    loop {
        if let Ok(r) = c.get(format!("{url}/readyz")).send().await {
            if r.status() == 200 {
                return (url, tx);
            }
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "{url} never became ready"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The llama fixture's engine on the host path (the CPU's), its options set by `f`.
#[allow(dead_code)] // each test crate uses some of these helpers
pub fn host_engine(f: impl FnOnce(&mut mole_engine::EngineOptions)) -> mole_engine::Engine {
    let mut o = mole_engine::EngineOptions {
        base_name: "llama".into(),
        ..Default::default()
    };
    f(&mut o);
    mole_engine::Engine::load(
        &ModelSource::hf(engine_fixtures().join("llama"), candle_core::DType::F32),
        &candle_core::Device::Cpu,
        o,
    )
    .expect("the llama fixture loads")
}

/// The fixture adapter `dir` (under `adapters/llama`) as `name` at `version`, LoRA id 1.
#[allow(dead_code)] // each test crate uses some of these helpers
pub fn fixture_adapter(name: &str, version: &str, dir: &str) -> mole_engine::api::AdapterSpec {
    mole_engine::api::AdapterSpec {
        name: name.into(),
        version: version.into(),
        lora_id: 1,
        path: engine_fixtures().join("adapters/llama").join(dir),
    }
}

/// A greedy request for `max_tokens` tokens (EOS ignored) after `prompt`, with `adapter`.
#[allow(dead_code)] // each test crate uses some of these helpers
pub fn greedy(
    prompt: Vec<u32>,
    adapter: Option<&str>,
    max_tokens: usize,
) -> mole_engine::api::GenerateRequest {
    use mole_engine::api::{GenerateRequest, Prompt, SamplingParams};
    GenerateRequest {
        images: Vec::new(),
        id: "t".into(),
        prompt: Prompt::Tokens(prompt),
        adapter: adapter.map(String::from),
        sampling: SamplingParams {
            max_tokens,
            ignore_eos: true,
            ..Default::default()
        },
    }
}

/// The tokens a request's stream carries to its end (panics on an error event).
#[allow(dead_code)] // each test crate uses some of these helpers
pub fn tokens(mut rx: mole_engine::api::EventStream) -> Vec<u32> {
    use mole_engine::api::TokenEvent;
    let mut out = Vec::new();
    loop {
        match rx.blocking_recv().expect("a final event") {
            TokenEvent::Token { token_id, .. } => out.push(token_id),
            TokenEvent::Finished { .. } => return out,
            TokenEvent::Error(e) => panic!("{e}"),
            TokenEvent::Started { .. } => {}
        }
    }
}

/// GPT-2's byte-to-unicode alphabet: the byte-level fixture tokenizer's 256 tokens.
#[allow(dead_code)] // each test crate uses some of these helpers
pub fn byte_tokens() -> Vec<String> {
    let mut bs: Vec<u32> = (b'!'..=b'~')
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .map(u32::from)
        .collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    let mut tokens = vec![String::new(); 256];
    for (b, c) in bs.into_iter().zip(cs) {
        tokens[b as usize] = char::from_u32(c).expect("a byte's code point").to_string();
    }
    tokens
}

/// Seeded uniform values in [-scale, scale).
#[allow(dead_code)] // each test crate uses some of these helpers
pub fn seeded(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// A `/proc/self/status` field of this process given in kB (`VmRSS:`, `VmHWM:`), in bytes.
#[allow(dead_code)] // each test crate uses some of these helpers
pub fn status_bytes(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with(field)).unwrap();
    let kb: u64 = line[field.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .unwrap();
    kb * 1024
}

/// The process's peak resident memory (VmHWM) in KiB: what a memory test measures, alone in its
/// binary so that nothing else adds to it.
#[allow(dead_code)] // each test crate uses some of these helpers
pub fn vm_hwm_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status reads");
    s.lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM is in /proc/self/status")
}

/// POSTs `n` copies of the JSON `body` to `url` at once (all sent before the first answer is
/// awaited; the bytes are shared, not copied per request): each answer's status, whether it
/// carries `Retry-After`, and its error code ("" for none).
#[allow(dead_code)] // each test crate uses some of these helpers
pub async fn burst(url: &str, body: &axum::body::Bytes, n: usize) -> Vec<(u16, bool, String)> {
    let c = reqwest::Client::new();
    let sends: Vec<_> = (0..n)
        .map(|_| {
            let (c, url, body) = (c.clone(), url.to_string(), body.clone());
            tokio::spawn(async move {
                let r = c
                    .post(url)
                    .header("content-type", "application/json")
                    .body(body)
                    .send()
                    .await
                    .expect("the server answers");
                let st = r.status().as_u16();
                let retry = r.headers().contains_key("retry-after");
                let b: serde_json::Value = r.json().await.unwrap_or_default();
                let code = b["error"]["code"].as_str().unwrap_or("").to_string();
                (st, retry, code)
            })
        })
        .collect();
    let mut out = Vec::new();
    for s in sends {
        out.push(s.await.expect("the send task ends"));
    }
    out
}
