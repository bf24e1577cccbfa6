//! A step with one request whose images the vision tower cannot encode, on the committed tiny
//! Qwen3-VL (tests/fixtures/vision): that request fails alone, its batch-mates are answered as
//! if it had never been there.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test
#![allow(clippy::disallowed_methods)] // tests read results back from the device

use crate::common;

use mole_engine::ModelSource;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device};
use mole_engine::api::*;
use mole_engine::{Engine, EngineOptions};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/vision")
}

/// The fixture's square image, sent as if its bytes had digest `digest`.
fn image(digest: u8) -> Image {
    let bytes = std::fs::read(fixtures().join("images/square.png")).unwrap();
    let rgb = image::load_from_memory(&bytes).unwrap().to_rgb8();
    Image {
        width: rgb.width(),
        height: rgb.height(),
        rgb: Arc::from(rgb.into_raw()),
        digest: [digest; 32],
    }
}

fn outcome(mut rx: EventStream) -> Result<Vec<u32>, EngineError> {
    let mut tokens = Vec::new();
    loop {
        match rx.blocking_recv().expect("a final event") {
            TokenEvent::Token { token_id, .. } => tokens.push(token_id),
            TokenEvent::Finished { .. } => return Ok(tokens),
            TokenEvent::Error(e) => return Err(e),
            TokenEvent::Started { .. } => {}
        }
    }
}

/// Three requests with an image each, released into one step together (they wait on one read
/// of their adapter from disk, held on a FIFO, and are queued when it ends); the tower is made
/// to fail on the middle one's image. That request fails; the other two get the tokens of the
/// same request alone (was: the step failed, and with it every request in it).
#[cfg(target_os = "linux")]
#[test]
fn a_step_with_an_image_that_fails_fails_only_its_request() {
    let e = Engine::load(
        &ModelSource::hf(fixtures().join("qwen3_vl"), DType::F32),
        &Device::Cpu,
        EngineOptions {
            base_name: "qwen3-vl-tiny".into(),
            max_seq_len: 512,
            max_loras: 1,
            max_cpu_loras: 0,
            ..Default::default()
        },
    )
    .unwrap();
    // The adapter's copy whose config is a FIFO: each read of it waits for the test.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("screens");
    std::fs::create_dir(&dir).unwrap();
    let src = fixtures().join("adapter");
    std::fs::copy(
        src.join("adapter_model.safetensors"),
        dir.join("adapter_model.safetensors"),
    )
    .unwrap();
    let fifo = dir.join("adapter_config.json");
    assert!(std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let config = std::fs::read(src.join("adapter_config.json")).unwrap();
    let spec = |name: &str, path: PathBuf| AdapterSpec {
        name: name.into(),
        version: "v1".into(),
        lora_id: 1,
        path,
    };
    std::thread::scope(|sc| {
        let load = sc.spawn(|| e.load_adapter(spec("screens", dir.clone())));
        common::feed_fifo(&fifo, &config, || true);
        load.join().unwrap().unwrap();
    });
    let msg = ChatMessage {
        role: "user".into(),
        content: "What is on the screen?".into(),
        parts: vec![
            ContentPart::Image,
            ContentPart::Text("What is on the screen?".into()),
        ],
        extra: Default::default(),
    };
    let text = e.apply_chat_template(&[msg], &Default::default()).unwrap();
    let req = |digest: u8| GenerateRequest {
        id: format!("image {digest}"),
        prompt: Prompt::Templated(text.clone()),
        adapter: Some("screens".into()),
        sampling: SamplingParams {
            max_tokens: 6,
            ignore_eos: true,
            ..Default::default()
        },
        images: vec![image(digest)],
    };
    let alone = outcome(e.submit(req(1)).unwrap()).unwrap();
    assert_eq!(alone.len(), 6);
    // Back to disk: the next requests wait for one read, then join the batch together.
    e.load_adapter(spec("other", fixtures().join("adapter_all_linear")))
        .unwrap();
    e.fail_images_for_tests([2; 32]);
    let streams: Vec<_> = [1, 2, 3].map(|d| e.submit(req(d)).unwrap()).into();
    common::feed_fifo(&fifo, &config, || true);
    let got: Vec<_> = streams.into_iter().map(outcome).collect();
    assert!(
        matches!(&got[1], Err(EngineError::Internal(m)) if m.contains("image")),
        "the request whose image fails: {:?}",
        got[1]
    );
    assert_eq!(got[0], Ok(alone.clone()), "its neighbour before it");
    assert_eq!(got[2], Ok(alone), "its neighbour after it");
}
