//! A model directory is read only inside itself: the shards `model.safetensors.index.json`
//! names and the tokenizer, template and config files, symlinks resolved, on the real engine
//! build path (`build_engine`) of the committed tiny Llama. A fetched repository that names
//! `/etc/...` or `../..` is refused with `path_outside_root`, and the refusal does not print
//! the file it pointed at.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test

use std::path::Path;

use mole_server::build_engine;

/// `<root>/base`: the tiny Llama; `outside`: a directory beside the root.
fn dirs() -> (tempfile::TempDir, tempfile::TempDir) {
    let fx = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/engine/llama");
    let root = tempfile::tempdir().unwrap();
    let base = root.path().join("base");
    std::fs::create_dir_all(&base).unwrap();
    for e in std::fs::read_dir(&fx).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), base.join(e.file_name())).unwrap();
    }
    (root, tempfile::tempdir().unwrap())
}

/// Builds the engine of `<root>/base`: the error's code and message (`None` when it loads).
fn build(root: &Path) -> Option<(&'static str, String)> {
    let yaml = format!(
        "pool: p\nmodelRoot: {}\nbaseModel: {{name: llama, path: base, dtype: f32}}\n",
        root.display()
    );
    let cfg = mole_server::config::parse(&yaml, "t").unwrap();
    match build_engine(&cfg) {
        Ok(_) => None,
        Err(e) => Some((e.code(), e.to_string())),
    }
}

fn index(base: &Path, shard: &str) {
    let idx =
        serde_json::json!({"metadata": {}, "weight_map": {"model.embed_tokens.weight": shard}});
    std::fs::write(base.join("model.safetensors.index.json"), idx.to_string()).unwrap();
}

#[test]
fn index_shards_outside_the_model_dir_are_refused() {
    let (root, outside) = dirs();
    let base = root.path().join("base");
    // The real weights, moved out of the root and named by a relative path.
    let moved = outside.path().join("model.safetensors");
    std::fs::rename(base.join("model.safetensors"), &moved).unwrap();
    let rel = format!(
        "../../{}/model.safetensors",
        outside.path().file_name().unwrap().to_string_lossy()
    );
    assert!(base.join(&rel).exists(), "the test's shard is reachable");
    index(&base, &rel);
    let (code, msg) = build(root.path()).expect("a shard outside the root was loaded");
    assert_eq!(code, "path_outside_root", "{msg}");

    // An absolute shard name: refused, and its bytes are not printed.
    let secret = outside.path().join("secret");
    std::fs::write(&secret, "TOPSECRETTOPSECRET").unwrap();
    index(&base, secret.to_str().unwrap());
    let (code, msg) = build(root.path()).expect("an absolute shard was loaded");
    assert_eq!(code, "path_outside_root", "{msg}");
    let first8 = u64::from_le_bytes(*b"TOPSECRE").to_string();
    assert!(!msg.contains("TOPSECRE") && !msg.contains(&first8), "{msg}");
}

#[test]
fn a_tokenizer_symlinked_outside_the_model_dir_is_refused() {
    let (root, outside) = dirs();
    let base = root.path().join("base");
    let moved = outside.path().join("tokenizer.json");
    std::fs::rename(base.join("tokenizer.json"), &moved).unwrap();
    std::os::unix::fs::symlink(&moved, base.join("tokenizer.json")).unwrap();
    let (code, msg) = build(root.path()).expect("a symlinked tokenizer outside was loaded");
    assert_eq!(code, "path_outside_root", "{msg}");
    // A symlink inside the directory is fine.
    std::fs::rename(&moved, base.join("tok.json")).unwrap();
    std::fs::remove_file(base.join("tokenizer.json")).unwrap();
    std::os::unix::fs::symlink("tok.json", base.join("tokenizer.json")).unwrap();
    assert_eq!(build(root.path()), None);
}
