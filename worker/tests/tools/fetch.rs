//! `mole-worker fetch` from `hf://` against a local server that answers the hub's two URLs
//! (`/api/models/{repo}/revision/{rev}?blobs=true` and `/{repo}/resolve/{rev}/{file}` with
//! Range), serving tiny repositories generated here: full fetch, resume after a cut
//! connection, a corrupted file, pickle-only and mixed repositories, revision pinning, the
//! no-op rerun, the token, and the command's exit status and termination log.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use mole_tools::fetch::{fetch, FetchOptions, Manifest, MANIFEST};
use serde_json::json;
use sha2::{Digest, Sha256};

const SHA: &str = "0123456789abcdef0123456789abcdef01234567";

/// One file of a mock repository.
#[derive(Clone)]
struct File {
    bytes: Vec<u8>,
    /// Stored in LFS: the listing carries its sha256.
    lfs: bool,
}

/// One request the mock saw.
#[derive(Clone, Debug)]
struct Seen {
    path: String,
    range: Option<String>,
    auth: Option<String>,
}

#[derive(Default)]
struct Hub {
    /// repo → files.
    repos: BTreeMap<String, BTreeMap<String, File>>,
    /// Files whose listed sha256 is wrong (a corrupted upload or a tampering proxy).
    lie_about: HashSet<String>,
    /// Cut the connection after this many bytes the first time this file is served.
    cut: Option<(String, usize)>,
    seen: Vec<Seen>,
}

type Shared = Arc<Mutex<Hub>>;

fn sha256(b: &[u8]) -> String {
    hex::encode(Sha256::digest(b))
}

/// A small but real safetensors file of `n` f32 values.
fn safetensors(n: usize, seed: u8) -> Vec<u8> {
    let data: Vec<u8> = (0..n * 4)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect();
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![n], &data).unwrap();
    safetensors::tensor::serialize([("w", view)], None).unwrap()
}

fn tiny_repo() -> BTreeMap<String, File> {
    let mut files = BTreeMap::new();
    let f = |bytes: Vec<u8>, lfs| File { bytes, lfs };
    files.insert(
        "config.json".into(),
        f(br#"{"model_type":"llama"}"#.to_vec(), false),
    );
    files.insert(
        "model-00001-of-00002.safetensors".into(),
        f(safetensors(20_000, 1), true),
    );
    files.insert(
        "model-00002-of-00002.safetensors".into(),
        f(safetensors(3_000, 2), true),
    );
    files.insert("tokenizer.json".into(), f(b"{}".to_vec(), false));
    files.insert(
        ".gitattributes".into(),
        f(b"*.safetensors lfs".to_vec(), false),
    );
    files
}

async fn handler(State(hub): State<Shared>, uri: Uri, headers: HeaderMap) -> Response {
    let path = uri.path().to_string();
    let header = |n: &str| {
        headers
            .get(n)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let mut hub = hub.lock().unwrap();
    hub.seen.push(Seen {
        path: path.clone(),
        range: header("range"),
        auth: header("authorization"),
    });
    if let Some(rest) = path.strip_prefix("/api/models/") {
        let Some((repo, _rev)) = rest.split_once("/revision/") else {
            return StatusCode::NOT_FOUND.into_response();
        };
        assert_eq!(uri.query(), Some("blobs=true"));
        let Some(files) = hub.repos.get(repo) else {
            return StatusCode::NOT_FOUND.into_response();
        };
        let siblings: Vec<_> = files
            .iter()
            .map(|(name, f)| {
                let mut s = json!({"rfilename": name, "size": f.bytes.len()});
                if f.lfs {
                    let sha = if hub.lie_about.contains(name) {
                        sha256(b"something else")
                    } else {
                        sha256(&f.bytes)
                    };
                    s["lfs"] = json!({"sha256": sha, "size": f.bytes.len(), "pointerSize": 134});
                }
                s
            })
            .collect();
        return axum::Json(json!({"id": repo, "sha": SHA, "siblings": siblings})).into_response();
    }
    // /{org}/{model}/resolve/{rev}/{file...}
    let Some((repo, rest)) = path[1..].split_once("/resolve/") else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let Some((rev, name)) = rest.split_once('/') else {
        return StatusCode::NOT_FOUND.into_response();
    };
    assert_eq!(rev, SHA, "files are fetched at the pinned commit");
    let Some(file) = hub.repos.get(repo).and_then(|r| r.get(name)).cloned() else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let len = file.bytes.len();
    let from = header("range")
        .and_then(|r| {
            r.strip_prefix("bytes=")?
                .strip_suffix('-')?
                .parse::<usize>()
                .ok()
        })
        .unwrap_or(0);
    let body = file.bytes[from..].to_vec();
    let status = if from > 0 {
        StatusCode::PARTIAL_CONTENT
    } else {
        StatusCode::OK
    };
    let mut resp = Response::builder()
        .status(status)
        .header("content-length", body.len().to_string());
    if from > 0 {
        resp = resp.header("content-range", format!("bytes {from}-{}/{len}", len - 1));
    }
    if hub.cut.as_ref().is_some_and(|(n, _)| n == name) {
        let (_, after) = hub.cut.take().unwrap();
        // The promised length, a prefix of it, then a broken connection.
        let head = body[..after].to_vec();
        // The pause lets the prefix reach the client before the connection breaks.
        let stream = futures::StreamExt::chain(
            futures::stream::iter([Ok(axum::body::Bytes::from(head))]),
            futures::stream::once(async {
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                Err(std::io::Error::other("connection cut"))
            }),
        );
        return resp.body(Body::from_stream(stream)).unwrap();
    }
    resp.body(Body::from(body)).unwrap()
}

async fn start(hub: Hub) -> (String, Shared) {
    let shared = Arc::new(Mutex::new(hub));
    let app = axum::Router::new()
        .fallback(handler)
        .with_state(shared.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, shared)
}

fn hub_with(repo: &str, files: BTreeMap<String, File>) -> Hub {
    let mut hub = Hub::default();
    hub.repos.insert(repo.into(), files);
    hub
}

fn opts(url: &str, source: &str, dest: &Path) -> FetchOptions {
    FetchOptions {
        source: source.into(),
        dest: dest.into(),
        hf_endpoint: Some(url.into()),
        retries: 3,
        ..Default::default()
    }
}

fn resolves(hub: &Shared) -> Vec<Seen> {
    hub.lock()
        .unwrap()
        .seen
        .iter()
        .filter(|s| s.path.contains("/resolve/"))
        .cloned()
        .collect()
}

fn manifest(dest: &Path) -> Manifest {
    serde_json::from_slice(&std::fs::read(dest.join(MANIFEST)).unwrap()).unwrap()
}

/// Every fetched file equals the repository's, nothing else is in the destination.
fn assert_same(dest: &Path, files: &BTreeMap<String, File>) {
    let mut on_disk: Vec<String> = std::fs::read_dir(dest)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    on_disk.sort();
    let mut want: Vec<String> = files
        .keys()
        .filter(|n| *n != ".gitattributes")
        .cloned()
        .chain([MANIFEST.to_string(), ".mole-fetch.lock".to_string()])
        .collect();
    want.sort();
    assert_eq!(on_disk, want);
    for (name, f) in files.iter().filter(|(n, _)| *n != ".gitattributes") {
        assert_eq!(std::fs::read(dest.join(name)).unwrap(), f.bytes, "{name}");
    }
}

#[tokio::test]
async fn fetches_a_repository_pinned_to_its_commit() {
    let files = tiny_repo();
    let (url, hub) = start(hub_with("org/tiny", files.clone())).await;
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("base");
    let report = fetch(&opts(&url, "hf://org/tiny@main", &dest))
        .await
        .unwrap();
    assert!(report.downloaded);
    assert_same(&dest, &files);
    let m = manifest(&dest);
    assert_eq!(m.source, "hf://org/tiny@main");
    assert_eq!(
        m.revision.as_deref(),
        Some(SHA),
        "the branch is pinned to its commit"
    );
    assert_eq!(m.skipped, [".gitattributes"]);
    for f in &m.files {
        assert_eq!(f.sha256, sha256(&files[&f.name].bytes), "{}", f.name);
        assert_eq!(f.size, files[&f.name].bytes.len() as u64);
        let expect = if files[&f.name].lfs { "sha256" } else { "none" };
        assert_eq!(f.verified, expect, "{}", f.name);
    }
    // The revision was asked for by name, every file at the sha.
    let seen = hub.lock().unwrap().seen.clone();
    assert!(seen[0].path.ends_with("/api/models/org/tiny/revision/main"));
    assert_eq!(resolves(&hub).len(), 4);
    assert!(resolves(&hub)
        .iter()
        .all(|s| s.path.contains(SHA) && s.auth.is_none()));

    // A rerun finds the manifest matching: no file is requested again.
    let again = fetch(&opts(&url, "hf://org/tiny@main", &dest))
        .await
        .unwrap();
    assert!(!again.downloaded);
    assert_eq!(again.manifest, m);
    assert_eq!(resolves(&hub).len(), 4, "a rerun downloads nothing");
}

/// Two pods of a pool starting together on a shared volume: one downloads, the other waits
/// for its lock and finds the manifest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_fetches_into_one_directory_download_once() {
    let files = tiny_repo();
    let (url, hub) = start(hub_with("org/tiny", files.clone())).await;
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (
        opts(&url, "hf://org/tiny", dir.path()),
        opts(&url, "hf://org/tiny", dir.path()),
    );
    let (ra, rb) = tokio::join!(fetch(&a), fetch(&b));
    let (ra, rb) = (ra.unwrap(), rb.unwrap());
    assert!(
        ra.downloaded != rb.downloaded,
        "exactly one of them downloads"
    );
    assert_same(dir.path(), &files);
    assert_eq!(resolves(&hub).len(), 4);
}

#[tokio::test]
async fn resumes_a_cut_download_with_a_range_request() {
    let files = tiny_repo();
    let big = "model-00001-of-00002.safetensors";
    let mut mock = hub_with("org/tiny", files.clone());
    mock.cut = Some((big.into(), 30_000));
    let (url, hub) = start(mock).await;
    let dir = tempfile::tempdir().unwrap();
    fetch(&opts(&url, "hf://org/tiny", dir.path()))
        .await
        .unwrap();
    assert_same(dir.path(), &files);
    let gets: Vec<_> = resolves(&hub)
        .into_iter()
        .filter(|s| s.path.ends_with(big))
        .collect();
    assert_eq!(gets.len(), 2, "{gets:?}");
    assert_eq!(gets[0].range, None);
    assert_eq!(gets[1].range.as_deref(), Some("bytes=30000-"));
}

#[tokio::test]
async fn resumes_the_part_file_a_killed_run_left() {
    let files = tiny_repo();
    let big = "model-00001-of-00002.safetensors";
    let (url, hub) = start(hub_with("org/tiny", files.clone())).await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join(format!("{big}.part")),
        &files[big].bytes[..12_345],
    )
    .unwrap();
    fetch(&opts(&url, "hf://org/tiny", dir.path()))
        .await
        .unwrap();
    assert_same(dir.path(), &files);
    let get = resolves(&hub)
        .into_iter()
        .find(|s| s.path.ends_with(big))
        .unwrap();
    assert_eq!(get.range.as_deref(), Some("bytes=12345-"));
}

/// A `.part` whose bytes are wrong (a crash that lost written pages) fails the check after
/// the resume and is fetched again from scratch, once.
#[tokio::test]
async fn a_corrupt_part_from_a_killed_run_is_fetched_again() {
    let files = tiny_repo();
    let big = "model-00001-of-00002.safetensors";
    let (url, hub) = start(hub_with("org/tiny", files.clone())).await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join(format!("{big}.part")), vec![0u8; 5_000]).unwrap();
    fetch(&opts(&url, "hf://org/tiny", dir.path()))
        .await
        .unwrap();
    assert_same(dir.path(), &files);
    let gets: Vec<_> = resolves(&hub)
        .into_iter()
        .filter(|s| s.path.ends_with(big))
        .map(|s| s.range)
        .collect();
    assert_eq!(gets, [Some("bytes=5000-".to_string()), None]);
}

#[tokio::test]
async fn refuses_a_corrupted_file_and_leaves_nothing_in_place() {
    let files = tiny_repo();
    let bad = "model-00002-of-00002.safetensors";
    let mut mock = hub_with("org/tiny", files);
    mock.lie_about.insert(bad.into());
    let (url, _hub) = start(mock).await;
    let dir = tempfile::tempdir().unwrap();
    let e = fetch(&opts(&url, "hf://org/tiny", dir.path()))
        .await
        .unwrap_err();
    assert_eq!(e.code(), "checksum_mismatch");
    assert!(e.to_string().contains(bad), "{e}");
    assert!(!dir.path().join(bad).exists());
    assert!(!dir.path().join(format!("{bad}.part")).exists());
    assert!(!dir.path().join(MANIFEST).exists());
}

#[tokio::test]
async fn refuses_a_pickle_only_repository_naming_the_file() {
    let mut files = BTreeMap::new();
    files.insert(
        "config.json".to_string(),
        File {
            bytes: b"{}".to_vec(),
            lfs: false,
        },
    );
    files.insert(
        "pytorch_model.bin".to_string(),
        File {
            bytes: vec![0x80, 2],
            lfs: true,
        },
    );
    let (url, hub) = start(hub_with("org/old", files)).await;
    let dir = tempfile::tempdir().unwrap();
    let e = fetch(&opts(&url, "hf://org/old", dir.path()))
        .await
        .unwrap_err();
    assert_eq!(e.code(), "pickle_refused");
    assert!(e.to_string().contains("pytorch_model.bin"), "{e}");
    assert!(resolves(&hub).is_empty(), "nothing is downloaded");
    assert!(!dir.path().join(MANIFEST).exists());
}

#[tokio::test]
async fn skips_pickles_beside_safetensors() {
    let mut files = tiny_repo();
    files.insert(
        "pytorch_model.bin".to_string(),
        File {
            bytes: vec![0x80, 2],
            lfs: true,
        },
    );
    let (url, hub) = start(hub_with("org/both", files)).await;
    let dir = tempfile::tempdir().unwrap();
    fetch(&opts(&url, "hf://org/both", dir.path()))
        .await
        .unwrap();
    assert!(!dir.path().join("pytorch_model.bin").exists());
    assert!(resolves(&hub).iter().all(|s| !s.path.ends_with(".bin")));
    assert_eq!(
        manifest(dir.path()).skipped,
        [".gitattributes", "pytorch_model.bin"]
    );
}

#[tokio::test]
async fn sends_the_token_as_a_bearer() {
    let (url, hub) = start(hub_with("org/private", tiny_repo())).await;
    let dir = tempfile::tempdir().unwrap();
    let mut o = opts(&url, "hf://org/private", dir.path());
    o.hf_token = Some("hf_secret".into());
    fetch(&o).await.unwrap();
    let seen = hub.lock().unwrap().seen.clone();
    assert_eq!(seen.len(), 5);
    assert!(
        seen.iter()
            .all(|s| s.auth.as_deref() == Some("Bearer hf_secret")),
        "{seen:?}"
    );
}

#[tokio::test]
async fn a_missing_repository_is_not_found() {
    let (url, _hub) = start(Hub::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let e = fetch(&opts(&url, "hf://org/nope", dir.path()))
        .await
        .unwrap_err();
    assert_eq!(e.code(), "not_found");
}

/// The command: exit 2 with one line on stderr and in the termination log for a refused
/// source; exit 0 and the files for a good one (flags from the environment, as the operator
/// passes them).
#[tokio::test]
async fn the_command_reports_failures_in_the_termination_log() {
    let mut files = BTreeMap::new();
    files.insert(
        "pytorch_model.bin".to_string(),
        File {
            bytes: vec![0x80, 2],
            lfs: true,
        },
    );
    let mut mock = hub_with("org/old", files);
    mock.repos.insert("org/tiny".into(), tiny_repo());
    let (url, _hub) = start(mock).await;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("termination-log");
    let bin = env!("CARGO_BIN_EXE_mole-worker");
    let run = |source: &str, dest: &Path| {
        let (url, log, source, dest) = (
            url.clone(),
            log.clone(),
            source.to_string(),
            dest.to_path_buf(),
        );
        tokio::task::spawn_blocking(move || {
            std::process::Command::new(bin)
                .arg("fetch")
                .env("MOLE_FETCH_SOURCE", source)
                .env("MOLE_FETCH_DEST", dest)
                .env("HF_ENDPOINT", url)
                .env("MOLE_TERMINATION_LOG", log)
                .env("MOLE_LOG_FORMAT", "json")
                .env("MOLE_PROGRESS_INTERVAL_SECS", "0")
                .env_remove("HF_TOKEN")
                .output()
                .unwrap()
        })
    };
    let out = run("hf://org/old", &dir.path().join("old")).await.unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let line = std::fs::read_to_string(&log).unwrap();
    assert!(
        line.starts_with("fetch failed (pickle_refused): pytorch_model.bin"),
        "{line}"
    );
    assert!(stderr.contains(line.trim()), "{stderr}");

    let out = run("hf://org/tiny", &dir.path().join("tiny"))
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_same(&dir.path().join("tiny"), &tiny_repo());
    // In a Job's log (JSON, no terminal) the `progress` lines the operator reads back into the
    // Adapter's `Fetched` condition (`mergedown::progress_of`), the last one at the total.
    let logs =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    let progress: Vec<serde_json::Value> = logs
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["fields"]["message"] == "progress")
        .collect();
    let last = &progress.last().expect("progress lines in the log")["fields"];
    let total: u64 = manifest(&dir.path().join("tiny"))
        .files
        .iter()
        .map(|f| f.size)
        .sum();
    assert_eq!(
        (
            &last["task"],
            &last["unit"],
            &last["done"],
            &last["total"],
            &last["percent"]
        ),
        (
            &serde_json::json!("fetch"),
            &serde_json::json!("bytes"),
            &serde_json::json!(total),
            &serde_json::json!(total),
            &serde_json::json!(100.0)
        ),
        "{logs}"
    );
}

/// `app` served as an S3 endpoint on loopback, and the options that fetch
/// `s3://bucket/models/x` from it into `<dest>/m` without retries.
async fn s3_store(app: axum::Router, dest: &Path) -> FetchOptions {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    FetchOptions {
        source: "s3://bucket/models/x".into(),
        dest: dest.join("m"),
        s3_endpoint: Some(url),
        retries: 0,
        ..Default::default()
    }
}

/// An S3 endpoint whose listing names keys outside the prefix asked for (one shorter than the
/// prefix, one of another "directory"): the fetch fails with `bad_listing`, no panic, nothing
/// written.
#[tokio::test]
async fn an_s3_listing_with_keys_outside_the_prefix_is_refused() {
    for key in [
        "a",
        "other/model.safetensors",
        "models/xy/model.safetensors",
    ] {
        let xml = format!(
            r#"<?xml version="1.0" encoding="UTF-8"?>
<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">
<Name>bucket</Name><Prefix>models/x/</Prefix><KeyCount>1</KeyCount><MaxKeys>1000</MaxKeys>
<IsTruncated>false</IsTruncated>
<Contents><Key>{key}</Key><LastModified>2024-01-01T00:00:00.000Z</LastModified>
<ETag>"d41d8cd98f00b204e9800998ecf8427e"</ETag><Size>4</Size>
<StorageClass>STANDARD</StorageClass></Contents>
</ListBucketResult>"#
        );
        let app = axum::Router::new().fallback(move || {
            let xml = xml.clone();
            async move { ([("content-type", "application/xml")], xml) }
        });
        let dest = tempfile::tempdir().unwrap();
        let o = s3_store(app, dest.path()).await;
        let e = fetch(&o).await.expect_err(key);
        assert_eq!(e.code(), "bad_listing", "{key}: {e}");
        assert!(!dest.path().join("m/model.safetensors").exists());
    }
}

/// An S3 endpoint whose listing never ends (every page truncated, with a next token): the
/// fetch gives up after `max_list_pages` pages with `bad_listing` instead of listing forever.
#[tokio::test]
async fn an_endless_s3_listing_is_cut_at_the_page_bound() {
    let pages = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = pages.clone();
    let app = axum::Router::new().fallback(move || {
        let n = seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        async move {
            let xml = format!(
                r#"<?xml version="1.0" encoding="UTF-8"?>
<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">
<Name>bucket</Name><Prefix>models/x/</Prefix><KeyCount>1</KeyCount><MaxKeys>1000</MaxKeys>
<IsTruncated>true</IsTruncated><NextContinuationToken>t{n}</NextContinuationToken>
<Contents><Key>models/x/f{n}</Key><LastModified>2024-01-01T00:00:00.000Z</LastModified>
<ETag>"d41d8cd98f00b204e9800998ecf8427e"</ETag><Size>4</Size>
<StorageClass>STANDARD</StorageClass></Contents>
</ListBucketResult>"#
            );
            ([("content-type", "application/xml")], xml)
        }
    });
    let dest = tempfile::tempdir().unwrap();
    let o = s3_store(app, dest.path()).await;
    let e = tokio::time::timeout(std::time::Duration::from_secs(60), fetch(&o))
        .await
        .expect("the listing ends")
        .expect_err("an endless listing fails");
    assert_eq!(e.code(), "bad_listing", "{e}");
    // The default bound: a thousand pages (a million objects).
    assert_eq!(pages.load(std::sync::atomic::Ordering::SeqCst), 1000);
}
