//! Every sample in config/samples/ deserializes into the Rust types, passes the generated CRD's
//! structural schema (types, required fields, enums, ranges, unknown fields) and the operator's
//! validation (which enforces the same rules as the CRD's CEL expressions); the invalid sample
//! fails for the reason its first line states.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test

use std::path::{Path, PathBuf};

use mole_crds::{Adapter, InferencePool};
use mole_operator::controller::validate::{validate_adapter, validate_pool};
use serde_json::Value;

fn samples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/samples")
}

fn schema_of(kind: &str) -> Value {
    mole_crds::openapi_schema(kind).unwrap()
}

/// Structural validation of `v` against an OpenAPI v3 schema (the subset CRDs use).
fn check(v: &Value, s: &Value, path: &str, errs: &mut Vec<String>) {
    if s.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true))
        || s.get("x-kubernetes-int-or-string") == Some(&Value::Bool(true))
    {
        return;
    }
    if v.is_null() {
        if s.get("nullable") != Some(&Value::Bool(true)) {
            errs.push(format!("{path}: null"));
        }
        return;
    }
    let ty = s.get("type").and_then(Value::as_str).unwrap_or("");
    let ok = match ty {
        "object" => v.is_object(),
        "array" => v.is_array(),
        "string" => v.is_string(),
        "integer" => v.is_i64() || v.is_u64(),
        "number" => v.is_number(),
        "boolean" => v.is_boolean(),
        _ => true,
    };
    if !ok {
        errs.push(format!("{path}: expected {ty}, got {v}"));
        return;
    }
    if let Some(e) = s.get("enum").and_then(Value::as_array) {
        if !e.contains(v) {
            errs.push(format!("{path}: {v} not in {e:?}"));
        }
    }
    if let (Some(min), Some(x)) = (s.get("minimum").and_then(Value::as_f64), v.as_f64()) {
        if x < min {
            errs.push(format!("{path}: {x} < {min}"));
        }
    }
    if let (Some(max), Some(x)) = (s.get("maximum").and_then(Value::as_f64), v.as_f64()) {
        if x > max {
            errs.push(format!("{path}: {x} > {max}"));
        }
    }
    if let (Some(min), Some(x)) = (s.get("minLength").and_then(Value::as_u64), v.as_str()) {
        if (x.chars().count() as u64) < min {
            errs.push(format!("{path}: shorter than {min}"));
        }
    }
    if let Some(obj) = v.as_object() {
        for r in s
            .get("required")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let r = r.as_str().unwrap();
            if !obj.contains_key(r) {
                errs.push(format!("{path}.{r}: required"));
            }
        }
        let props = s.get("properties").and_then(Value::as_object);
        let extra = s.get("additionalProperties");
        for (k, val) in obj {
            let p = format!("{path}.{k}");
            match (props.and_then(|p| p.get(k)), extra) {
                (Some(sub), _) => check(val, sub, &p, errs),
                (None, Some(sub)) if sub.is_object() => check(val, sub, &p, errs),
                (None, _)
                    if path.is_empty() && (k == "apiVersion" || k == "kind" || k == "metadata") => {
                }
                (None, _) if props.is_some() => errs.push(format!("{p}: unknown field")),
                _ => {}
            }
        }
    }
    if let (Some(items), Some(arr)) = (s.get("items"), v.as_array()) {
        for (i, x) in arr.iter().enumerate() {
            check(x, items, &format!("{path}[{i}]"), errs);
        }
    }
}

fn load(name: &str) -> (String, Value) {
    let text = std::fs::read_to_string(samples().join(name)).unwrap();
    let v: Value = serde_yaml::from_str(&text).unwrap();
    (text, v)
}

#[test]
fn every_valid_sample_passes_schema_and_validation() {
    let (_, pool_v) = load("pool-qwen3-vl-8b.yaml");
    let mut errs = Vec::new();
    check(&pool_v, &schema_of("InferencePool"), "", &mut errs);
    assert!(errs.is_empty(), "{errs:?}");
    let pool: InferencePool = serde_json::from_value(pool_v).unwrap();
    assert_eq!(validate_pool(&pool), Ok(()));
    assert_eq!(
        pool.spec.gpu.node_selector["nvidia.com/gpu.product"],
        "NVIDIA-H100-80GB-HBM3"
    );
    let (_, text_v) = load("pool-qwen3-4b.yaml");
    let mut errs = Vec::new();
    check(&text_v, &schema_of("InferencePool"), "", &mut errs);
    assert!(errs.is_empty(), "{errs:?}");
    let text: InferencePool = serde_json::from_value(text_v).unwrap();
    assert_eq!(validate_pool(&text), Ok(()));
    let pools = [pool, text];

    let mut adapters = Vec::new();
    for e in std::fs::read_dir(samples()).unwrap() {
        let name = e.unwrap().file_name().to_string_lossy().to_string();
        if !name.starts_with("adapter-") {
            continue;
        }
        let (_, v) = load(&name);
        let mut errs = Vec::new();
        check(&v, &schema_of("Adapter"), "", &mut errs);
        assert!(errs.is_empty(), "{name}: {errs:?}");
        adapters.push(serde_json::from_value::<Adapter>(v).unwrap());
    }
    assert_eq!(
        adapters.len(),
        7,
        "calendar, claim-window, desktop, appointment, login-window, chart-screen; sql"
    );
    for a in &adapters {
        let pool = pools
            .iter()
            .find(|p| p.metadata.name.as_deref() == Some(a.spec.pool.as_str()))
            .unwrap();
        let siblings: Vec<Adapter> = adapters
            .iter()
            .filter(|b| b.spec.pool == a.spec.pool)
            .cloned()
            .collect();
        assert_eq!(
            validate_adapter(a, Some(pool), &siblings),
            Ok(()),
            "{:?}",
            a.metadata.name
        );
    }
    let merged = adapters
        .iter()
        .filter(|a| a.spec.serving.mode == mole_crds::ServingMode::Merged)
        .count();
    assert_eq!(merged, 2, "calendar and claim-window are merged");
}

/// Every YAML document of `name` (the gateway sample holds two).
fn documents(name: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(samples().join(name)).unwrap();
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect()
}

#[test]
fn every_file_in_the_samples_is_checked_or_explicitly_skipped() {
    let mut mole = 0;
    let mut gateway = Vec::new();
    for e in std::fs::read_dir(samples()).unwrap() {
        let name = e.unwrap().file_name().to_string_lossy().to_string();
        for v in documents(&name) {
            let (api, kind) = (
                v["apiVersion"].as_str().unwrap(),
                v["kind"].as_str().unwrap(),
            );
            if api == "mole.dev/v1alpha1" {
                let mut errs = Vec::new();
                check(&v, &schema_of(kind), "", &mut errs);
                assert!(errs.is_empty(), "{name}: {errs:?}");
                mole += 1;
            } else {
                // Not a mole kind, so not checked against mole's CRDs: only the Gateway API
                // sample may hold such objects (the GIE InferencePool and the HTTPRoute to
                // it), checked against what the operator renders below.
                assert_eq!(name, "gateway-inference.yaml", "{api} {kind}");
                gateway.push(v);
            }
        }
    }
    assert_eq!(
        mole, 10,
        "two pools, six adapters of the VL one and one of the text one, the invalid adapter"
    );
    assert_eq!(gateway.len(), 2);
    let [gie, route] = &gateway[..] else {
        unreachable!()
    };
    assert_eq!(
        (gie["apiVersion"].as_str(), gie["kind"].as_str()),
        (
            Some("inference.networking.k8s.io/v1"),
            Some("InferencePool")
        )
    );
    assert_eq!(route["kind"], "HTTPRoute");
    // The GIE pool selects exactly the sample pool's dynamic pods, on the port they listen on.
    let (_, pool) = load("pool-qwen3-vl-8b.yaml");
    let pool_name = pool["metadata"]["name"].as_str().unwrap();
    let pod_labels = mole_operator::resources::labels(pool_name, "dynamic");
    let selector = gie["spec"]["selector"]["matchLabels"].as_object().unwrap();
    assert!(!selector.is_empty());
    for (k, v) in selector {
        assert_eq!(pod_labels.get(k).map(String::as_str), v.as_str(), "{k}");
    }
    let merged = mole_operator::resources::labels(pool_name, "merged");
    assert!(
        selector
            .iter()
            .any(|(k, v)| merged.get(k).map(String::as_str) != v.as_str()),
        "merged pods are not selected"
    );
    assert_eq!(
        gie["spec"]["targetPorts"],
        serde_json::json!([{"number": mole_crds::constants::WORKER_PORT}])
    );
    assert_eq!(gie["metadata"]["namespace"], pool["metadata"]["namespace"]);
    assert_ne!(gie["metadata"]["name"], pool["metadata"]["name"]);
    assert!(gie["spec"]["endpointPickerRef"]["port"]["number"].is_u64());
    let backend = &route["spec"]["rules"][0]["backendRefs"][0];
    assert_eq!(backend["group"], "inference.networking.k8s.io");
    assert_eq!(backend["kind"], "InferencePool");
    assert_eq!(backend["name"], gie["metadata"]["name"]);
}

#[test]
fn the_invalid_sample_fails_for_its_stated_reason() {
    let (text, v) = load("invalid-adapter.yaml");
    assert!(text
        .lines()
        .next()
        .unwrap()
        .contains("spec.source.path is absolute"));
    let (_, pool_v) = load("pool-qwen3-vl-8b.yaml");
    let pool: InferencePool = serde_json::from_value(pool_v).unwrap();
    let a: Adapter = serde_json::from_value(v).unwrap();
    let err = validate_adapter(&a, Some(&pool), &[] as &[Adapter]).unwrap_err();
    assert_eq!(err.field, "spec.source.path");
    // The API server refuses it too: the CRD carries the same rule for that field.
    let schema = schema_of("Adapter").to_string();
    assert!(schema.contains("source.path must be relative and must not contain '..'"));
}

#[test]
fn the_structural_check_catches_typos_types_and_enums() {
    let (_, mut v) = load("adapter-desktop.yaml");
    v["spec"]["serving"]["mode"] = Value::String("sometimes".into());
    v["spec"]["servng"] = Value::Bool(true);
    v["spec"]["evaluation"]["accuracy"] = Value::from(1.5);
    v["spec"]["keywords"] = Value::String("not a list".into());
    let mut errs = Vec::new();
    check(&v, &schema_of("Adapter"), "", &mut errs);
    let all = errs.join("\n");
    for needle in [
        "serving.mode",
        "spec.servng: unknown field",
        "accuracy: 1.5 > 1",
        "keywords: expected array",
    ] {
        assert!(all.contains(needle), "{needle} not in {all}");
    }
}

/// Serves `wc` (a worker config the operator rendered, its model root set) as a pool's pod
/// would, and waits until it is ready. Returns its URL and the sender whose drop stops it.
async fn serve_rendered(
    wc: &mole_crds::WorkerConfig,
    root: &Path,
    vision: bool,
) -> (String, tokio::sync::oneshot::Sender<()>) {
    use mole_server::{build_engine, cli::serve_with, AppState, Auth};
    let cfg_path = root.join("worker.json");
    std::fs::write(&cfg_path, serde_json::to_string(wc).unwrap()).unwrap();
    let cfg = mole_server::config::load(&cfg_path).unwrap();
    let engine = build_engine(&cfg).unwrap();
    assert_eq!(engine.info.model_info().vision, vision);
    let auth = Auth::from_config(&cfg).unwrap();
    let state = AppState::new(cfg, engine, Some(cfg_path.clone()), auth);
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let (stop, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve_with(
        state,
        l,
        cfg_path,
        std::time::Duration::ZERO,
        async move {
            let _ = rx.await;
        },
    ));
    let c = reqwest::Client::new();
    for _ in 0..500 {
        if let Ok(r) = c.get(format!("{url}/readyz")).send().await {
            if r.status() == 200 {
                return (url, stop);
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    panic!("the worker of the rendered config never became ready");
}

/// The sample Qwen3-VL pool and its six adapters, rendered into the worker config the operator
/// gives the pool's dynamic pods, start a worker and serve screenshots: the model root holds
/// the tiny generated Qwen3-VL where the sample names Qwen3-VL-8B (no real checkpoint can be
/// fetched here) and the tiny adapter at each adapter's path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sample_qwen3_vl_pool_starts_and_serves_screenshots() {
    use base64::Engine as _;
    use mole_operator::resources::{worker_config, Registered};
    let (_, pool_v) = load("pool-qwen3-vl-8b.yaml");
    let pool: InferencePool = serde_json::from_value(pool_v).unwrap();
    let adapters: Vec<Adapter> = ["calendar", "claim-window", "desktop", "login-window"]
        .iter()
        .map(|n| serde_json::from_value(load(&format!("adapter-{n}.yaml")).1).unwrap())
        .collect();
    let vision = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/vision");
    let root = tempfile::tempdir().unwrap();
    let copy = |from: &Path, to: &Path| {
        std::fs::create_dir_all(to).unwrap();
        for e in std::fs::read_dir(from).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    };
    copy(
        &vision.join("qwen3_vl"),
        &root.path().join(&pool.spec.base_model.path),
    );
    for a in &adapters {
        let dir = root.path().join(&a.spec.source.path);
        copy(&vision.join("adapter"), &dir);
        // Trained on the pool's base, as the real adapters are.
        let cfg = dir.join("adapter_config.json");
        let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
        c["base_model_name_or_path"] = Value::from(pool.spec.base_model.name.clone());
        std::fs::write(&cfg, c.to_string()).unwrap();
    }
    let registered: Vec<Registered> = adapters
        .iter()
        .enumerate()
        .map(|(i, adapter)| Registered {
            adapter,
            lora_id: i as u32 + 1,
        })
        .collect();
    let mut wc = worker_config("qwen3-vl", &pool.spec, &registered);
    wc.model_root = root.path().display().to_string();
    wc.auth = None;
    let (url, _stop) = serve_rendered(&wc, root.path(), true).await;
    let c = reqwest::Client::new();
    let png = std::fs::read(vision.join("images/wide.png")).unwrap();
    let image_b64 = base64::engine::general_purpose::STANDARD.encode(&png);
    for (body, adapter, route) in [
        (
            serde_json::json!({"prompt": "What meetings are on this calendar?", "image_b64": image_b64, "max_tokens": 4}),
            "calendar",
            "keywords",
        ),
        (
            serde_json::json!({"prompt": "Read this.", "image_b64": image_b64, "expert": "login-window", "max_tokens": 4}),
            "login-window",
            "explicit",
        ),
    ] {
        let r = c
            .post(format!("{url}/infer"))
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        let v: Value = r.json().await.unwrap();
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["routed_adapter"], adapter, "{v}");
        assert_eq!(v["route"], route, "{v}");
        assert!(v["task_output"].is_string(), "{v}");
        assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 20, "{v}");
    }
}

/// A local server answering the Hugging Face Hub's two calls for `repos` (id → directory):
/// the revision listing (`main` pinned to one commit sha, LFS sha256 for safetensors) and
/// `resolve`. Returns its endpoint, for `HF_ENDPOINT`.
async fn local_hub(repos: Vec<(&'static str, PathBuf)>) -> String {
    use axum::extract::{Path as P, State};
    use axum::routing::get;
    use sha2::Digest;
    use std::sync::Arc;
    type Repos = Arc<Vec<(&'static str, PathBuf)>>;
    const SHA: &str = "0123456789abcdef0123456789abcdef01234567";
    fn dir(repos: &Repos, org: &str, name: &str) -> Option<PathBuf> {
        let id = format!("{org}/{name}");
        repos.iter().find(|(r, _)| *r == id).map(|(_, d)| d.clone())
    }
    async fn revision(
        State(repos): State<Repos>,
        P((org, name, _rev)): P<(String, String, String)>,
    ) -> axum::response::Response {
        use axum::response::IntoResponse;
        let Some(d) = dir(&repos, &org, &name) else {
            return axum::http::StatusCode::NOT_FOUND.into_response();
        };
        let mut siblings = Vec::new();
        for e in std::fs::read_dir(d).unwrap() {
            let e = e.unwrap();
            let f = e.file_name().to_string_lossy().to_string();
            let bytes = std::fs::read(e.path()).unwrap();
            let mut s = serde_json::json!({"rfilename": f, "size": bytes.len()});
            if f.ends_with(".safetensors") {
                let sha = hex::encode(sha2::Sha256::digest(&bytes));
                s["lfs"] = serde_json::json!({"sha256": sha, "size": bytes.len()});
            }
            siblings.push(s);
        }
        axum::Json(serde_json::json!({"sha": SHA, "siblings": siblings})).into_response()
    }
    async fn resolve(
        State(repos): State<Repos>,
        P((org, name, rev, file)): P<(String, String, String, String)>,
    ) -> axum::response::Response {
        use axum::response::IntoResponse;
        match dir(&repos, &org, &name) {
            Some(d) if rev == SHA => std::fs::read(d.join(file)).unwrap().into_response(),
            _ => axum::http::StatusCode::NOT_FOUND.into_response(),
        }
    }
    let app = axum::Router::new()
        .route("/api/models/{org}/{name}/revision/{rev}", get(revision))
        .route("/{org}/{name}/resolve/{rev}/{*file}", get(resolve))
        .with_state(Arc::new(repos));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    url
}

/// Runs a fetch container as the operator renders it (`mole-worker fetch --source ... --dest
/// <mount>/...`), its mount path at `root`, against `hub`.
async fn run_fetch(c: &k8s_openapi::api::core::v1::Container, mount: &str, root: &Path, hub: &str) {
    use clap::Parser;
    let mut args: Vec<String> = c.command.clone().unwrap();
    for a in c.args.clone().unwrap() {
        args.push(match a.strip_prefix(mount) {
            Some(rest) => format!("{}{rest}", root.display()),
            None => a,
        });
    }
    args.extend(["--hf-endpoint".to_string(), hub.to_string()]);
    #[derive(clap::Parser)]
    struct Fetch {
        #[command(flatten)]
        args: mole_tools::fetch::cli::FetchArgs,
    }
    // `mole-worker fetch ...`: "fetch" stands for the program name, the rest are its flags.
    let fa = Fetch::parse_from(&args[1..]).args;
    let code = tokio::task::spawn_blocking(move || mole_tools::fetch::cli::run(fa))
        .await
        .unwrap();
    assert_eq!(code, std::process::ExitCode::SUCCESS, "{args:?}");
}

/// The README's text install path on one machine: the sample Qwen3 pool and its `sql`
/// Adapter, both from `hf://`, rendered by the operator (the pool pod's `fetch-model` init
/// container, the adapter's fetch Job), their fetches run against a local hub holding the
/// tiny Qwen3 and its adapter under the samples' repository names, then the worker config the
/// operator renders served: a chat named `sql` is answered by that adapter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sample_text_pool_fetches_from_hf_and_serves() {
    use mole_operator::resources::{
        adapter_fetch_job, dynamic_deployment, worker_config, Registered, WorkerDefaults,
        FETCH_MODEL_CONTAINER,
    };
    let (_, pool_v) = load("pool-qwen3-4b.yaml");
    let mut pool: InferencePool = serde_json::from_value(pool_v).unwrap();
    // As read back from the API server, which gives it a uid (its children's owner).
    pool.metadata.uid = Some("uid-pool".into());
    let adapter: Adapter = serde_json::from_value(load("adapter-qwen3-sql.yaml").1).unwrap();
    let fx = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/engine");
    // The adapter as its trainer published it: trained on the pool's base.
    let published = tempfile::tempdir().unwrap();
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(
            fx.join("adapters/qwen3/a_r8_all").join(f),
            published.path().join(f),
        )
        .unwrap();
    }
    let cfg = published.path().join("adapter_config.json");
    let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    c["base_model_name_or_path"] = Value::from(pool.spec.base_model.name.clone());
    std::fs::write(&cfg, c.to_string()).unwrap();
    let hub = local_hub(vec![
        ("Qwen/Qwen3-4B", fx.join("qwen3")),
        ("your-org/qwen3-4b-sql-lora", published.path().to_path_buf()),
    ])
    .await;
    let root = tempfile::tempdir().unwrap();
    let mount = pool.spec.storage.mount_path.clone();
    // The pool's pods: the init container the operator renders fetches the base model.
    let d = dynamic_deployment(&pool, 8000, &WorkerDefaults::default());
    let pod = d.spec.unwrap().template.spec.unwrap();
    let init = pod
        .init_containers
        .unwrap()
        .into_iter()
        .find(|c| c.name == FETCH_MODEL_CONTAINER)
        .expect("a pool with baseModel.source gets the fetch init container");
    run_fetch(&init, &mount, root.path(), &hub).await;
    assert!(root
        .path()
        .join(&pool.spec.base_model.path)
        .join("model.safetensors")
        .is_file());
    // The adapter's fetch Job.
    let job = adapter_fetch_job(
        "qwen3",
        &pool.spec,
        "sql",
        &adapter.spec,
        Default::default(),
        &WorkerDefaults::default(),
    )
    .expect("an adapter with source.uri gets a fetch Job");
    let c = job
        .spec
        .unwrap()
        .template
        .spec
        .unwrap()
        .containers
        .remove(0);
    run_fetch(&c, &mount, root.path(), &hub).await;
    // The worker config the pool's pods read, served.
    let registered = [Registered {
        adapter: &adapter,
        lora_id: 1,
    }];
    let mut wc = worker_config("qwen3", &pool.spec, &registered);
    wc.model_root = root.path().display().to_string();
    wc.auth = None;
    let (url, _stop) = serve_rendered(&wc, root.path(), false).await;
    let c = reqwest::Client::new();
    let r = c
        .post(format!("{url}/v1/chat/completions"))
        .json(&serde_json::json!({"model": "sql", "max_tokens": 4,
            "messages": [{"role": "user", "content": "List the tables."}]}))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let v: Value = r.json().await.unwrap();
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["mole"]["adapter"], "sql", "{v}");
    assert_eq!(v["mole"]["adapter_version"], "v1", "{v}");
    let (_, l) = {
        let r = c
            .get(format!("{url}/v1/lora_adapters"))
            .send()
            .await
            .unwrap();
        (r.status(), r.json::<Value>().await.unwrap())
    };
    let sql = &l["data"][0];
    assert_eq!(
        (sql["name"].as_str(), sql["loaded"].as_bool()),
        (Some("sql"), Some(true)),
        "{l}"
    );
    assert!(
        sql.get("warning").is_none(),
        "trained on the pool's base: {sql}"
    );
}
