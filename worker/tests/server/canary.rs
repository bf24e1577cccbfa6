//! Canary versions on the real server (issue 37, item 3), on the committed tiny Llama over
//! loopback: one config serves adapter `fr` at version v1 with a canary v2 at weight 10. The
//! canary serves 10% ± 2% of 2,000 requests; a session (the `x-session-id` header, or the
//! OpenAI `user` field) stays on one version; the per-version counters the operator reads
//! count each version's own requests; and a rollback by apply (the canary taken out of the
//! config, `POST /admin/reload`) sends all traffic back to v1 while requests keep coming, with
//! no failed request.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test

use crate::common;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};

/// A model root: the tiny Llama in `base`, `fr` v1 and v2 (two different fixture adapters), an
/// admin token.
fn model_root() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    common::llama_root(
        dir.path(),
        &[
            ("a_r8_all", "adapters/fr/v1"),
            ("b_r4_qv", "adapters/fr/v2"),
        ],
    );
    std::fs::write(dir.path().join("admin"), "s3cret\n").unwrap();
    dir
}

/// The config: `fr` v1, and, with `canary`, v2 at that weight.
fn config(root: &Path, canary: Option<u32>) -> String {
    let canary = canary
        .map(|w| format!(", canary: {{version: v2, path: adapters/fr/v2, weight: {w}}}"))
        .unwrap_or_default();
    format!(
        "pool: p\nmodelRoot: {root}\nbaseModel: {{name: llama, path: base, dtype: f32}}\n\
         adapters:\n  - {{name: fr, version: v1, loraId: 1, path: adapters/fr/v1{canary}}}\n\
         router: {{strategies: [explicit], fallback: base}}\n\
         auth: {{adminTokenFile: {root}/admin}}\n\
         limits: {{maxSeqLen: 128, maxTokens: 8}}\n",
        root = root.display()
    )
}

/// One completion for `fr` (one token); `session` as the header, `user` in the body. The
/// version that served it, or the failure.
async fn one(
    c: &reqwest::Client,
    url: &str,
    session: Option<&str>,
    user: Option<&str>,
) -> Result<String, String> {
    let mut body = json!({"model": "fr", "prompt": "hello", "max_tokens": 1, "temperature": 0});
    if let Some(u) = user {
        body["user"] = json!(u);
    }
    let mut req = c.post(format!("{url}/v1/completions")).json(&body);
    if let Some(s) = session {
        req = req.header("x-session-id", s);
    }
    let r = req.send().await.map_err(|e| e.to_string())?;
    let status = r.status();
    let b: Value = r.json().await.map_err(|e| e.to_string())?;
    if status != 200 {
        return Err(format!("{status}: {b}"));
    }
    b["mole"]["adapter_version"]
        .as_str()
        .map(String::from)
        .ok_or_else(|| format!("no version in {b}"))
}

/// Sends `n` requests without a session, `parallel` at a time; counts per version served.
async fn burst(
    c: &reqwest::Client,
    url: &str,
    n: usize,
    parallel: usize,
) -> BTreeMap<String, usize> {
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counts = Arc::new(Mutex::new(BTreeMap::<String, usize>::new()));
    let mut tasks = Vec::new();
    for _ in 0..parallel {
        let (c, url, next, counts) = (c.clone(), url.to_string(), next.clone(), counts.clone());
        tasks.push(tokio::spawn(async move {
            while next.fetch_add(1, Ordering::SeqCst) < n {
                let v = one(&c, &url, None, None).await.unwrap();
                *counts.lock().unwrap().entry(v).or_default() += 1;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let out = counts.lock().unwrap().clone();
    out
}

/// The `/v1/lora_adapters` traffic counters: requests per version of `fr`.
async fn counted(c: &reqwest::Client, url: &str) -> BTreeMap<String, u64> {
    common::served(c, url, "fr").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_canary_takes_its_weight_sessions_stick_and_a_rollback_by_apply_fails_nothing() {
    let dir = model_root();
    let (url, _stop) = common::serve_config(dir.path(), &config(dir.path(), Some(10))).await;
    let c = reqwest::Client::new();

    // Both versions are listed loaded under the adapter's own name.
    let listed = common::get_json(&c, &format!("{url}/v1/lora_adapters")).await;
    let versions: Vec<(&str, &str, bool)> = listed["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            (
                a["name"].as_str().unwrap(),
                a["version"].as_str().unwrap(),
                a["loaded"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(versions, [("fr", "v1", true), ("fr", "v2", true)]);

    // 2,000 requests without a session, 8 at a time: 10% ± 2% on v2.
    let counts = burst(&c, &url, 2000, 8).await;
    let v2 = counts.get("v2").copied().unwrap_or(0);
    let v1 = counts.get("v1").copied().unwrap_or(0);
    eprintln!("canary share: {v2} of {} requests on v2", v1 + v2);
    assert_eq!(v1 + v2, 2000, "{counts:?}");
    assert!((160..=240).contains(&v2), "{counts:?}");
    // The counters the operator reads count each version's own requests.
    let by_version = counted(&c, &url).await;
    assert_eq!(
        by_version.get("v2").copied(),
        Some(v2 as u64),
        "{by_version:?}"
    );
    assert_eq!(
        by_version.get("v1").copied(),
        Some(v1 as u64),
        "{by_version:?}"
    );

    // Sessions stick: 60 sessions by header and 20 by `user`, 5 requests each, each answered
    // by one version every time; both versions get some sessions.
    let mut on_canary = 0;
    for i in 0..80 {
        let key = format!("session-{i}");
        let (header, user) = if i < 60 {
            (Some(key.as_str()), None)
        } else {
            (None, Some(key.as_str()))
        };
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..5 {
            seen.insert(one(&c, &url, header, user).await.unwrap());
        }
        assert_eq!(seen.len(), 1, "session {key} saw {seen:?}");
        if seen.contains("v2") {
            on_canary += 1;
        }
    }
    eprintln!("sessions on the canary: {on_canary} of 80");
    assert!(
        (1..80).contains(&on_canary),
        "{on_canary} of 80 sessions on v2"
    );

    // A rollback by apply while requests keep coming: the canary leaves the config, the
    // worker reloads it; no request fails, and every request after the reload is v1's.
    let stop = Arc::new(AtomicBool::new(false));
    let failures = Arc::new(Mutex::new(Vec::<String>::new()));
    let served = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for t in 0..4 {
        let (c, url, stop, failures, served) = (
            c.clone(),
            url.clone(),
            stop.clone(),
            failures.clone(),
            served.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut i = 0;
            while !stop.load(Ordering::SeqCst) {
                // Half with sessions (some stuck to the canary), half without.
                let key = format!("rb-{t}-{}", i % 7);
                let session = (i % 2 == 0).then_some(key.as_str());
                match one(&c, &url, session, None).await {
                    Ok(_) => {
                        served.fetch_add(1, Ordering::SeqCst);
                    }
                    Err(e) => failures.lock().unwrap().push(e),
                }
                i += 1;
            }
        }));
    }
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    std::fs::write(dir.path().join("config.yaml"), config(dir.path(), None)).unwrap();
    let r = c
        .post(format!("{url}/admin/reload"))
        .bearer_auth("s3cret")
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    let status = r.status();
    let b: Value = r.json().await.unwrap();
    assert_eq!(status, 200, "{b}");
    assert_eq!(b["changed"], true, "{b}");
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    stop.store(true, Ordering::SeqCst);
    for t in tasks {
        t.await.unwrap();
    }
    let failed = failures.lock().unwrap().clone();
    assert!(
        failed.is_empty(),
        "{} failed: {:?}",
        failed.len(),
        &failed[..failed.len().min(3)]
    );
    assert!(served.load(Ordering::SeqCst) > 20, "requests kept coming");
    let after = burst(&c, &url, 200, 8).await;
    assert_eq!(after.get("v1").copied(), Some(200), "{after:?}");
    for i in 0..60 {
        let key = format!("session-{i}");
        assert_eq!(one(&c, &url, Some(&key), None).await.unwrap(), "v1");
    }
}
