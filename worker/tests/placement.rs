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
    let b = common::get_json(c, &format!("{url}/v1/lora_adapters")).await;
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

/// Requests for `name` (every version) the worker at `url` has completed.
async fn served(c: &reqwest::Client, url: &str, name: &str) -> u64 {
    common::served(c, url, name).await.values().sum()
}

/// The fixture model and its two adapters as `fr` and `js` under `dir`.
fn fixture_root(dir: &Path) {
    common::llama_root(
        dir,
        &[("a_r8_all", "adapters/fr"), ("b_r4_qv", "adapters/js")],
    );
}

/// A WorkerConfig over [`fixture_root`] with `fr` placed on `fr_pods`, `extra` adapters and
/// `tail` (peers, auth) appended.
fn placed_config(dir: &Path, fr_pods: &str, extra: &str, tail: &str) -> String {
    format!(
        "pool: p\nmodelRoot: {root}\nbaseModel: {{name: llama, path: base, dtype: f32}}\n\
         adapters:\n\
         \x20 - {{name: fr, version: v1, loraId: 1, path: adapters/fr, pods: [{fr_pods}]}}\n\
         \x20 - {{name: js, version: v1, loraId: 2, path: adapters/js}}\n{extra}\
         router: {{strategies: [explicit], fallback: base}}\n\
         limits: {{maxSeqLen: 128, maxTokens: 8}}\n{tail}",
        root = dir.display()
    )
}

/// A loopback worker over its own [`fixture_root`] (`prepare` adds to it first) serving
/// [`placed_config`]: its model root, URL and stop handle.
struct Pod {
    dir: tempfile::TempDir,
    url: String,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn pod(fr_pods: &str, extra: &str, tail: &str, prepare: impl FnOnce(&Path)) -> Pod {
    let dir = tempfile::tempdir().unwrap();
    fixture_root(dir.path());
    prepare(dir.path());
    let yaml = placed_config(dir.path(), fr_pods, extra, tail);
    let (url, stop) = common::serve_config(dir.path(), &yaml).await;
    Pod {
        dir,
        url,
        _stop: stop,
    }
}

/// The `peers` line naming `c` and `d` as pods `pool-dynamic-c` and `pool-dynamic-d`.
fn peers(c: &str, d: &str) -> String {
    format!("peers: {{pool-dynamic-c: \"{c}\", pool-dynamic-d: \"{d}\"}}\n")
}

/// Sends one completion for `model` to `url`: its status, `x-mole-route` and `x-mole-peer`.
async fn complete(c: &reqwest::Client, url: &str, model: &str) -> (u16, String, Option<String>) {
    let r = c
        .post(format!("{url}/v1/completions"))
        .json(&json!({"model": model, "prompt": "hello", "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    let header = |h: &str| r.headers().get(h).map(|v| v.to_str().unwrap().to_string());
    let (route, peer) = (
        header("x-mole-route").unwrap_or_default(),
        header("x-mole-peer"),
    );
    let status = r.status().as_u16();
    let b: Value = r.json().await.unwrap();
    if status == 200 {
        assert_eq!(b["mole"]["adapter"], model, "{b}");
    }
    (status, route, peer)
}

/// Waits (10 s at most) until the `/metrics` of `url` has every line of `lines`: a pod's first
/// polls of its peers. Not an assertion: a pod that does not know its peers forwards by
/// placement order, which the tests' own assertions catch.
async fn settle(c: &reqwest::Client, url: &str, lines: &[String]) {
    let t = std::time::Instant::now();
    while t.elapsed() < std::time::Duration::from_secs(10) {
        let m = common::scrape(c, url).await;
        if lines.iter().all(|l| m.lines().any(|x| x == l)) {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_loads_its_share_and_answers_for_the_others_after_a_read() {
    // This process is pod `pool-dynamic-b` (every test of this binary sets the same name).
    std::env::set_var("MOLE_POD_NAME", "pool-dynamic-b");
    let dir = tempfile::tempdir().unwrap();
    fixture_root(dir.path());
    std::fs::write(dir.path().join("admin"), "s3cret\n").unwrap();
    let auth = format!("auth: {{adminTokenFile: {}/admin}}\n", dir.path().display());
    // js placed on this pod alone, fr elsewhere.
    let yaml = |fr_pods: &str| {
        placed_config(dir.path(), fr_pods, "", &auth).replace(
            "path: adapters/js}",
            "path: adapters/js, pods: [pool-dynamic-b]}",
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

/// A request for an adapter placed on other pods that this pod holds only on disk is
/// forwarded: a stopped peer is skipped, the next one answers. With every peer gone it is
/// served here after a read: no request fails for where it landed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_for_an_adapter_held_elsewhere_is_forwarded_past_a_stopped_peer() {
    std::env::set_var("MOLE_POD_NAME", "pool-dynamic-b");
    // The peer that holds fr (its own config places fr everywhere).
    let peer = pod("", "", "", |_| {}).await;
    // A stopped peer: a port nothing listens on.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let peers = format!(
        "peers: {{pool-dynamic-a: \"{dead}\", pool-dynamic-c: \"{}\"}}\n",
        peer.url
    );
    let me = pod("pool-dynamic-a, pool-dynamic-c", "", &peers, |_| {}).await;
    let url = &me.url;
    let c = reqwest::Client::new();
    assert_eq!(residency(&c, url, "fr").await, ("disk".to_string(), 0));
    for i in 1..=3u64 {
        let (status, route, by) = complete(&c, url, "fr").await;
        assert_eq!((status, route.as_str()), (200, "explicit+peer"));
        assert_eq!(by.as_deref(), Some("pool-dynamic-c"));
        assert_eq!(served(&c, &peer.url, "fr").await, i);
    }
    // Never read here while a peer answered.
    assert_eq!(residency(&c, url, "fr").await, ("disk".to_string(), 0));
    // js is placed everywhere: served here.
    assert_eq!(complete(&c, url, "js").await.1, "explicit");
    // Every peer stopped: served here, after a read.
    drop(peer);
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert_eq!(
        complete(&c, url, "fr").await,
        (200, "explicit".into(), None)
    );
    assert_eq!(residency(&c, url, "fr").await.0, "cpu");
}

/// Residency-aware forwarding (issue 37, item 5): a request for an adapter this pod holds only
/// on disk goes to the peer that holds it in memory, though placement lists a peer that holds
/// it only on disk first (forwarding by placement order sent it there, to be read from disk).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_goes_to_the_peer_holding_its_adapter_in_memory_before_placement_order() {
    std::env::set_var("MOLE_POD_NAME", "pool-dynamic-b");
    // Peer c: fr placed on another pod, so on its disk; peer d: fr everywhere, in memory.
    let pc = pod("pool-dynamic-x", "", "", |_| {}).await;
    let pd = pod("", "", "", |_| {}).await;
    let c = reqwest::Client::new();
    assert_eq!(residency(&c, &pc.url, "fr").await.0, "disk");
    assert_eq!(residency(&c, &pd.url, "fr").await.0, "cpu");
    // This pod: fr placed on c, then d.
    let me = pod(
        "pool-dynamic-c, pool-dynamic-d",
        "",
        &peers(&pc.url, &pd.url),
        |_| {},
    )
    .await;
    settle(
        &c,
        &me.url,
        &[
            "mole_peer_up{peer=\"pool-dynamic-c\"} 1".into(),
            "mole_peer_up{peer=\"pool-dynamic-d\"} 1".into(),
        ],
    )
    .await;
    for i in 1..=3u64 {
        let (status, route, by) = complete(&c, &me.url, "fr").await;
        assert_eq!((status, route.as_str()), (200, "explicit+peer"));
        assert_eq!(
            (
                served(&c, &pc.url, "fr").await,
                served(&c, &pd.url, "fr").await
            ),
            (0, i),
            "request {i} (served by c, by d); answered by {by:?}"
        );
        assert_eq!(by.as_deref(), Some("pool-dynamic-d"));
    }
    // Neither this pod nor c read it.
    assert_eq!(residency(&c, &me.url, "fr").await.0, "disk");
    assert_eq!(residency(&c, &pc.url, "fr").await.0, "disk");
    let m = common::scrape(&c, &me.url).await;
    assert!(
        m.lines()
            .any(|l| l == "mole_peer_routes_total{reason=\"peer_cpu\"} 3"),
        "{m}"
    );
}

/// Between peers holding the adapter alike, the one with fewer waiting requests takes it: d,
/// placed first, has a request waiting on an adapter load (held by a FIFO), c none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn between_peers_holding_it_alike_the_one_with_fewer_waiting_requests_takes_it() {
    std::env::set_var("MOLE_POD_NAME", "pool-dynamic-b");
    let pc = pod("", "", "", |_| {}).await;
    // Peer d also holds fr, and registers `slow` on disk (placed on another pod), whose
    // adapter_config.json is a FIFO: a request for it waits on the load until the test feeds it.
    let mut fifo = std::path::PathBuf::new();
    let slow =
        "  - {name: slow, version: v1, loraId: 3, path: adapters/slow, pods: [pool-dynamic-x]}\n";
    let pd = pod("", slow, "", |root| {
        fifo = common::fifo_adapter(&root.join("adapters/fr"), &root.join("adapters/slow"));
    })
    .await;
    let c = reqwest::Client::new();
    let held = {
        let (c, url) = (c.clone(), pd.url.clone());
        tokio::spawn(async move { complete(&c, &url, "slow").await.0 })
    };
    let t = std::time::Instant::now();
    while !common::scrape(&c, &pd.url)
        .await
        .lines()
        .any(|l| l == "mole_requests_waiting 1")
    {
        assert!(t.elapsed().as_secs() < 20, "d never had a waiting request");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    // This pod: fr placed on d, then c.
    let me = pod(
        "pool-dynamic-d, pool-dynamic-c",
        "",
        &peers(&pc.url, &pd.url),
        |_| {},
    )
    .await;
    settle(
        &c,
        &me.url,
        &[
            "mole_peer_waiting{peer=\"pool-dynamic-c\"} 0".into(),
            "mole_peer_waiting{peer=\"pool-dynamic-d\"} 1".into(),
        ],
    )
    .await;
    for i in 1..=3u64 {
        let (status, _, by) = complete(&c, &me.url, "fr").await;
        assert_eq!(status, 200);
        assert_eq!(
            (
                served(&c, &pc.url, "fr").await,
                served(&c, &pd.url, "fr").await
            ),
            (i, 0),
            "request {i} (served by c, by d); answered by {by:?}"
        );
    }
    // The held load goes through, and its request is answered.
    let config = std::fs::read(pd.dir.path().join("adapters/fr/adapter_config.json")).unwrap();
    tokio::task::spawn_blocking(move || common::feed_fifo(&fifo, &config, || true))
        .await
        .unwrap();
    assert_eq!(held.await.unwrap(), 200);
}
