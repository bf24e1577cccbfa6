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
        6,
        "calendar, claim-window, desktop, appointment, login-window, chart-screen"
    );
    for a in &adapters {
        assert_eq!(
            validate_adapter(a, Some(&pool), &adapters),
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
    assert_eq!(mole, 8, "the pool, six adapters and the invalid adapter");
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
    let err = validate_adapter(&a, Some(&pool), &[]).unwrap_err();
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

/// The sample Qwen3-VL pool and its six adapters, rendered into the worker config the operator
/// gives the pool's dynamic pods, start a worker and serve screenshots: the model root holds
/// the tiny generated Qwen3-VL where the sample names Qwen3-VL-8B (no real checkpoint can be
/// fetched here) and the tiny adapter at each adapter's path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sample_qwen3_vl_pool_starts_and_serves_screenshots() {
    use base64::Engine as _;
    use mole_operator::resources::{worker_config, Registered};
    use mole_worker::server::{build_engine, cli::serve_with, AppState, Auth};
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
    let cfg_path = root.path().join("worker.json");
    std::fs::write(&cfg_path, serde_json::to_string(&wc).unwrap()).unwrap();
    let cfg = mole_worker::config::load(&cfg_path).unwrap();
    let engine = build_engine(&cfg).unwrap();
    assert!(engine.model_info().vision);
    let auth = Auth::from_config(&cfg).unwrap();
    let state = AppState::new(cfg, engine, Some(cfg_path.clone()), auth);
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let (_stop, rx) = tokio::sync::oneshot::channel::<()>();
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
    let mut ready = false;
    for _ in 0..500 {
        if let Ok(r) = c.get(format!("{url}/readyz")).send().await {
            if r.status() == 200 {
                ready = true;
                break;
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(ready, "the sample pool's worker never became ready");
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
