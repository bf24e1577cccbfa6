//! Memory under big bodies (issue 52): eight concurrent chats of 1 MiB of text each against the
//! real server on the tiny Llama (a context of 128 tokens). Each text can never fit, and is
//! refused (400 `prompt_too_long`) before the chat template renders it or the tokenizer reads
//! it, so the process's peak RSS (VmHWM; this test is alone in its binary so nothing else adds
//! to it) grows by less than a stated bound. Before, each body was rendered and tokenized whole
//! on a blocking thread of its own (a million byte tokens with their offsets and strings each).
//! Then the same burst against a preparation stage of one thread and a queue of one: what does
//! not fit the queue is answered 429 `prepare_busy` with `Retry-After`, at once.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test

mod common;

use serde_json::json;

/// The largest growth of peak RSS the burst may cause: the bodies themselves (8 MiB), a few
/// parsed copies of those being prepared, the allocator's slack.
const BOUND_MIB: u64 = 160;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn big_bodies_are_refused_before_templating_within_memory_bounds() {
    let yaml = |dir: &std::path::Path, limits: &str| {
        format!(
            "pool: p\nmodelRoot: {}\nbaseModel: {{name: llama, path: base, dtype: f32}}\n\
             limits: {{maxSeqLen: 128, maxTokens: 64{limits}}}\n",
            dir.display()
        )
    };
    let dir = tempfile::tempdir().unwrap();
    common::llama_root(dir.path(), &[]);
    let (url, _stop) = common::serve_config(dir.path(), &yaml(dir.path(), "")).await;
    // One body, shared by the sends (its bytes are not copied per request on this side).
    let text = "word ".repeat(1 << 18);
    let body = axum::body::Bytes::from(
        serde_json::to_vec(&json!({"model": "llama", "max_tokens": 1,
            "messages": [{"role": "user", "content": text}]}))
        .unwrap(),
    );
    drop(text);
    let before = common::vm_hwm_kib();
    let chats = |url: &str| format!("{url}/v1/chat/completions");
    let answers = common::burst(&chats(&url), &body, 8).await;
    let grown_mib = common::vm_hwm_kib().saturating_sub(before) / 1024;
    for (st, _, code) in &answers {
        assert_eq!(
            (*st, code.as_str()),
            (400, "prompt_too_long"),
            "{answers:?}"
        );
    }
    eprintln!("peak RSS grew {grown_mib} MiB (bound {BOUND_MIB})");
    assert!(
        grown_mib < BOUND_MIB,
        "peak RSS grew {grown_mib} MiB, over {BOUND_MIB}"
    );

    // A stage of one thread and a queue of one: the burst's overflow is answered 429 at once.
    let dir2 = tempfile::tempdir().unwrap();
    common::llama_root(dir2.path(), &[]);
    let limits = ", prepareThreads: 1, maxPrepareQueue: 1";
    let (url2, _stop2) = common::serve_config(dir2.path(), &yaml(dir2.path(), limits)).await;
    let answers = common::burst(&chats(&url2), &body, 8).await;
    for (st, retry, code) in &answers {
        let ok = matches!((*st, code.as_str()), (400, "prompt_too_long"))
            || (*st, code.as_str(), *retry) == (429, "prepare_busy", true);
        assert!(ok, "{answers:?}");
    }
    eprintln!("{answers:?}");
}
