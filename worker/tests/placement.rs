//! Placement on the real server (issue 37, item 4): a worker loads at once only the adapters
//! its pool's config places on its pod (`adapters[].pods`, the pod named by `MOLE_POD_NAME`);
//! the others it knows on disk and reads on their first request, so a request that lands on a
//! pod its adapter is not placed on is still answered.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test

mod common;

use std::path::Path;

use serde_json::{json, Value};

/// `name` → (residency, bytes) in `/v1/lora_adapters`.
async fn residency(c: &reqwest::Client, url: &str, name: &str) -> (String, u64) {
    let b: Value = c
        .get(format!("{url}/v1/lora_adapters"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let a = b["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["name"] == name)
        .unwrap_or_else(|| panic!("{name} not listed: {b}"));
    assert_eq!(a["loaded"], true, "{a}");
    (
        a["residency"].as_str().unwrap().to_string(),
        a["bytes"].as_u64().unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_loads_its_share_and_answers_for_the_others_after_a_read() {
    // This process is pod `pool-dynamic-b` (the only test of this binary sets it).
    std::env::set_var("MOLE_POD_NAME", "pool-dynamic-b");
    let fx = common::engine_fixtures();
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
    let yaml = |fr_pods: &str| {
        format!(
            "pool: p\nmodelRoot: {root}\nbaseModel: {{name: llama, path: base, dtype: f32}}\n\
             adapters:\n\
             \x20 - {{name: fr, version: v1, loraId: 1, path: adapters/fr, pods: [{fr_pods}]}}\n\
             \x20 - {{name: js, version: v1, loraId: 2, path: adapters/js, pods: [pool-dynamic-b]}}\n\
             router: {{strategies: [explicit], fallback: base}}\n\
             auth: {{adminTokenFile: {root}/admin}}\n\
             limits: {{maxSeqLen: 128, maxTokens: 8}}\n",
            root = dir.path().display()
        )
    };
    let (url, _stop) =
        common::serve_config(dir.path(), &yaml("pool-dynamic-a, pool-dynamic-c")).await;
    let c = reqwest::Client::new();
    // Its own share is in memory; the other adapter is known, on disk.
    let (js, js_bytes) = residency(&c, &url, "js").await;
    assert_eq!(js, "cpu");
    assert!(js_bytes > 0);
    assert_eq!(residency(&c, &url, "fr").await, ("disk".to_string(), 0));
    // Its placement moves between other pods (a pod joined): still not read here.
    std::fs::write(
        dir.path().join("config.yaml"),
        yaml("pool-dynamic-a, pool-dynamic-d"),
    )
    .unwrap();
    let r = c
        .post(format!("{url}/admin/reload"))
        .bearer_auth("s3cret")
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(residency(&c, &url, "fr").await, ("disk".to_string(), 0));
    // A request for it is answered (after one read), and it is in memory since.
    for _ in 0..3 {
        let r = c
            .post(format!("{url}/v1/completions"))
            .json(&json!({"model": "fr", "prompt": "hello", "max_tokens": 1}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let b: Value = r.json().await.unwrap();
        assert_eq!(b["mole"]["adapter"], "fr", "{b}");
        assert_eq!(b["mole"]["adapter_version"], "v1", "{b}");
    }
    let (fr, fr_bytes) = residency(&c, &url, "fr").await;
    assert_eq!(fr, "cpu");
    assert!(fr_bytes > 0);
}

/// Residency-aware forwarding (issue 37, item 5): a request for an adapter placed on other pods
/// that this pod holds only on disk goes to the placed pods in order: a stopped peer is skipped,
/// the next one answers. With every peer gone it is served here after a read: no request fails
/// for where it landed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_for_an_adapter_held_elsewhere_is_forwarded_past_a_stopped_peer() {
    std::env::set_var("MOLE_POD_NAME", "pool-dynamic-b");
    let fx = common::engine_fixtures();
    let root = |dir: &Path| {
        common::copy_dir(&fx.join("llama"), &dir.join("base"));
        common::copy_dir(
            &fx.join("adapters/llama/a_r8_all"),
            &dir.join("adapters/fr"),
        );
        common::copy_dir(&fx.join("adapters/llama/b_r4_qv"), &dir.join("adapters/js"));
    };
    let cfg = |dir: &Path, fr_pods: &str, peers: &str| {
        format!(
            "pool: p\nmodelRoot: {root}\nbaseModel: {{name: llama, path: base, dtype: f32}}\n\
             adapters:\n\
             \x20 - {{name: fr, version: v1, loraId: 1, path: adapters/fr, pods: [{fr_pods}]}}\n\
             \x20 - {{name: js, version: v1, loraId: 2, path: adapters/js}}\n\
             router: {{strategies: [explicit], fallback: base}}\n\
             limits: {{maxSeqLen: 128, maxTokens: 8}}\n{peers}",
            root = dir.display()
        )
    };
    // The peer that holds fr (its own config places fr everywhere).
    let peer_dir = tempfile::tempdir().unwrap();
    root(peer_dir.path());
    let (peer, peer_stop) =
        common::serve_config(peer_dir.path(), &cfg(peer_dir.path(), "", "")).await;
    // A stopped peer: a port nothing listens on.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let dir = tempfile::tempdir().unwrap();
    root(dir.path());
    let peers = format!("peers: {{pool-dynamic-a: \"{dead}\", pool-dynamic-c: \"{peer}\"}}\n");
    let (url, _stop) = common::serve_config(
        dir.path(),
        &cfg(dir.path(), "pool-dynamic-a, pool-dynamic-c", &peers),
    )
    .await;
    let c = reqwest::Client::new();
    assert_eq!(residency(&c, &url, "fr").await, ("disk".to_string(), 0));
    let served_by_peer = |c: reqwest::Client, peer: String| async move {
        let b: Value = c
            .get(format!("{peer}/v1/lora_adapters"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        b["traffic"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|t| t["name"] == "fr")
            .map(|t| t["requests"].as_u64().unwrap())
            .sum::<u64>()
    };
    for i in 1..=3u64 {
        let r = c
            .post(format!("{url}/v1/completions"))
            .json(&json!({"model": "fr", "prompt": "hello", "max_tokens": 1}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(
            r.headers()["x-mole-route"].to_str().unwrap(),
            "explicit+peer"
        );
        let b: Value = r.json().await.unwrap();
        assert_eq!(b["mole"]["adapter_version"], "v1", "{b}");
        assert_eq!(served_by_peer(c.clone(), peer.clone()).await, i);
    }
    // Never read here while a peer answered.
    assert_eq!(residency(&c, &url, "fr").await, ("disk".to_string(), 0));
    // js is placed everywhere: served here.
    let r = c
        .post(format!("{url}/v1/completions"))
        .json(&json!({"model": "js", "prompt": "hello", "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["x-mole-route"].to_str().unwrap(), "explicit");
    // Every peer stopped: served here, after a read.
    drop(peer_stop);
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let r = c
        .post(format!("{url}/v1/completions"))
        .json(&json!({"model": "fr", "prompt": "hello", "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-mole-route"].to_str().unwrap(), "explicit");
    assert_eq!(residency(&c, &url, "fr").await.0, "cpu");
}
