//! Helpers shared by the integration tests.

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

/// An engine over the llama fixture on the tensor path (what a GPU runs: the host kernels
/// off), its options set by `f`.
#[allow(dead_code)] // each test crate uses some of these helpers
pub fn tensor_engine(
    f: impl FnOnce(&mut mole_worker::engine::EngineOptions),
) -> mole_worker::engine::Engine {
    let dir = engine_fixtures().join("llama");
    let mut model =
        mole_worker::model::Decoder::load(&dir, candle_core::DType::F32, &candle_core::Device::Cpu)
            .expect("the llama fixture loads");
    model.set_host_kernels(false);
    let mut opts = mole_worker::engine::EngineOptions {
        base_name: "llama".into(),
        ..Default::default()
    };
    f(&mut opts);
    let text = mole_worker::engine::text::TextModel::load(&dir).expect("its tokenizer loads");
    mole_worker::engine::Engine::start(model, text, opts)
}
