//! Memory under a burst of image requests (issue 33): 16 concurrent requests, each with 8
//! compressible 2000×2000 PNGs (a few KiB on the wire, 12 MB each as RGB), against the real
//! server on the tiny Qwen3-VL with the default limits. The process's peak RSS (VmHWM; this test is
//! alone in its binary so nothing else adds to it) grows by less than a stated bound, and the
//! requests the in-flight image budget cannot hold are answered 429 with a code and
//! Retry-After, not queued.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test

mod common;

use std::path::Path;

use base64::Engine as _;
use serde_json::{json, Value};

/// The largest growth of peak RSS the burst may cause: the default in-flight budget
/// (`maxInflightImagePixels`, 128 Mi pixels ≈ 384 MiB as RGB) plus the decoders' working
/// buffers. Without the budget the burst holds 16 × 8 × 12 MB ≈ 1.5 GB.
const BOUND_MIB: u64 = 800;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_image_requests_stays_in_memory_bounds_and_gets_429() {
    // A vision model: a text pool refuses image parts before reading them.
    let fx = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/vision/qwen3_vl");
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base");
    std::fs::create_dir_all(&base).unwrap();
    for e in std::fs::read_dir(&fx).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), base.join(e.file_name())).unwrap();
    }
    let yaml = format!(
        "pool: p\nmodelRoot: {}\nbaseModel: {{name: llama, path: base, dtype: f32}}\n\
         limits: {{maxSeqLen: 256, maxTokens: 64}}\n",
        dir.path().display()
    );
    let (url, _stop) = common::serve_config(dir.path(), &yaml).await;

    // A compressible PNG: flat colour with a few lines, so the decoder does real work.
    let img = image::RgbImage::from_fn(2000, 2000, |x, y| {
        image::Rgb([(x % 7 == 0) as u8 * 200, (y % 11 == 0) as u8 * 100, 30])
    });
    let mut png = std::io::Cursor::new(Vec::new());
    img.write_to(&mut png, image::ImageFormat::Png).unwrap();
    drop(img);
    let data = format!(
        "data:image/png;base64,{}",
        base64::engine::general_purpose::STANDARD.encode(png.into_inner())
    );
    let mut parts: Vec<Value> = (0..8)
        .map(|_| json!({"type": "image_url", "image_url": {"url": data}}))
        .collect();
    parts.push(json!({"type": "text", "text": "what is this"}));
    let body = json!({"model": "llama", "messages": [{"role": "user", "content": parts}]});

    let before = common::vm_hwm_kib();
    let started = std::time::Instant::now();
    let body = axum::body::Bytes::from(serde_json::to_vec(&body).unwrap());
    let answers = common::burst(&format!("{url}/v1/route"), &body, 16).await;
    let grew_mib = (common::vm_hwm_kib().saturating_sub(before)) >> 10;
    eprintln!(
        "16 requests × 8 images in {:.1} s: peak RSS +{grew_mib} MiB; answers {answers:?}",
        started.elapsed().as_secs_f64()
    );
    assert!(grew_mib < BOUND_MIB, "peak RSS grew by {grew_mib} MiB");
    let ok = answers.iter().filter(|a| a.0 == 200).count();
    let busy: Vec<_> = answers.iter().filter(|a| a.0 == 429).collect();
    assert!(ok >= 1, "{answers:?}");
    assert!(!busy.is_empty(), "no request was turned away: {answers:?}");
    assert!(busy.iter().all(|a| a.1 && a.2 == "images_busy"), "{busy:?}");
    assert_eq!(ok + busy.len(), 16, "{answers:?}");
}
