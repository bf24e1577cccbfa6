//! Model sources against the in-memory API server: a pool with `baseModel.source` gets the
//! `fetch-model` init container (with its Secret's keys as env) or the `pvc://` claim mounted
//! over the model's directory, and a bad URI gets a condition and an Event naming the field.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test

mod support;

use std::sync::{Arc, Mutex};

use mole_crds::{Adapter, InferencePool};
use mole_operator::controller::{adapter, pool, Context, PodClient};
use mole_operator::telemetry::Metrics;
use serde_json::{json, Value};
use support::{Shared, Store};

const POOL: &str = "/apis/mole.dev/v1alpha1/namespaces/ml/inferencepools/vl";
const DEPLOY: &str = "/apis/apps/v1/namespaces/ml/deployments/vl-dynamic";
const ADAPTER: &str = "/apis/mole.dev/v1alpha1/namespaces/ml/adapters/calendar";

fn pool_obj(base_model: Value) -> Value {
    json!({
        "apiVersion": "mole.dev/v1alpha1", "kind": "InferencePool",
        "metadata": {"name": "vl", "namespace": "ml"},
        "spec": {
            "baseModel": base_model,
            "storage": {"claimName": "models"},
            "image": "ghcr.io/mole-dev/mole-worker:0.1.0",
            "gpu": {"count": 1},
            "dynamic": {"replicas": 1}
        }
    })
}

struct Env {
    store: Shared,
    ctx: Arc<Context>,
}

async fn env(pool: Value) -> Env {
    let store: Shared = Arc::new(Mutex::new(Store::default()));
    let worker = support::fake_worker(store.clone()).await;
    let ctx = Arc::new(Context::new(
        support::client(store.clone()),
        "test".into(),
        Metrics::new(),
        PodClient::new(worker.addr.port()),
    ));
    store.lock().unwrap().create(POOL, pool);
    let e = Env { store, ctx };
    let p: InferencePool = serde_json::from_value(e.get(POOL).unwrap()).unwrap();
    pool::reconcile(Arc::new(p), e.ctx.clone()).await.unwrap();
    e
}

impl Env {
    fn get(&self, path: &str) -> Option<Value> {
        self.store.lock().unwrap().get(path)
    }
    fn events(&self) -> Vec<String> {
        self.store.lock().unwrap().events.clone()
    }
    fn pod_spec(&self) -> Value {
        self.get(DEPLOY).unwrap()["spec"]["template"]["spec"].clone()
    }
    fn spec_hash(&self) -> String {
        self.get(DEPLOY).unwrap()["spec"]["template"]["metadata"]["annotations"]
            ["mole.dev/spec-hash"]
            .as_str()
            .unwrap()
            .to_string()
    }
}

fn condition<'a>(obj: &'a Value, t: &str) -> &'a Value {
    obj["status"]["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == t))
        .unwrap_or(&Value::Null)
}

fn container<'a>(list: &'a Value, name: &str) -> &'a Value {
    list.as_array()
        .and_then(|c| c.iter().find(|c| c["name"] == name))
        .unwrap_or(&Value::Null)
}

#[tokio::test]
async fn an_hf_source_gets_the_fetch_init_container_with_the_secret_env() {
    let plain = env(pool_obj(
        json!({"name": "Qwen/Qwen3-8B", "path": "base/qwen3-8b"}),
    ))
    .await;
    let e = env(pool_obj(json!({
        "name": "Qwen/Qwen3-8B", "path": "base/qwen3-8b",
        "source": "hf://Qwen/Qwen3-8B@main", "secretRef": {"name": "hf-token"}
    })))
    .await;
    let p = e.get(POOL).unwrap();
    assert_eq!(condition(&p, "Valid")["status"], "True");
    let spec = e.pod_spec();
    let init = container(&spec["initContainers"], "fetch-model");
    assert_eq!(init["command"], json!(["mole-worker"]));
    assert_eq!(
        init["args"],
        json!([
            "fetch",
            "--source",
            "hf://Qwen/Qwen3-8B@main",
            "--dest",
            "/models/base/qwen3-8b"
        ])
    );
    assert_eq!(
        init["envFrom"],
        json!([{"secretRef": {"name": "hf-token", "optional": false}}])
    );
    assert_eq!(init["image"], "ghcr.io/mole-dev/mole-worker:0.1.0");
    assert_eq!(init["terminationMessagePolicy"], "FallbackToLogsOnError");
    assert_eq!(init["volumeMounts"][0]["mountPath"], "/models");
    assert_eq!(init["volumeMounts"][0]["readOnly"], false);
    // The volume is writable for the init container; the worker still mounts it read-only.
    let models = spec["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "models")
        .unwrap();
    assert_eq!(models["persistentVolumeClaim"]["readOnly"], false);
    let worker = container(&spec["containers"], "worker");
    let mount = worker["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == "models")
        .unwrap();
    assert_eq!(mount["readOnly"], true);
    // The source is in the spec hash: a new revision rolls the pods.
    assert_ne!(e.spec_hash(), plain.spec_hash());
    assert!(plain.pod_spec()["initContainers"].is_null());
}

#[tokio::test]
async fn a_pvc_source_mounts_the_claim_over_the_model_directory() {
    let e = env(pool_obj(json!({
        "name": "Qwen/Qwen3-8B", "path": "base/qwen3-8b", "source": "pvc://weights/qwen3/8b"
    })))
    .await;
    let spec = e.pod_spec();
    assert!(spec["initContainers"].is_null(), "nothing is fetched");
    let vol = spec["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "base-model-source")
        .unwrap();
    assert_eq!(
        vol["persistentVolumeClaim"],
        json!({"claimName": "weights", "readOnly": true})
    );
    let worker = container(&spec["containers"], "worker");
    let mount = worker["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == "base-model-source")
        .unwrap();
    assert_eq!(
        *mount,
        json!({"name": "base-model-source", "mountPath": "/models/base/qwen3-8b",
               "subPath": "qwen3/8b", "readOnly": true})
    );
}

#[tokio::test]
async fn a_bad_source_gets_a_condition_and_an_event_naming_the_field() {
    let e = env(pool_obj(json!({
        "name": "Qwen/Qwen3-8B", "path": "base/qwen3-8b", "source": "hf://Qwen/Qwen3-8B/extra"
    })))
    .await;
    let p = e.get(POOL).unwrap();
    assert_eq!(p["status"]["phase"], "Failed");
    let valid = condition(&p, "Valid");
    assert_eq!(valid["status"], "False");
    let msg = valid["message"].as_str().unwrap();
    assert!(msg.starts_with("spec.baseModel.source"), "{msg}");
    assert!(msg.contains("hf://org/model"), "{msg}");
    assert!(
        e.get(DEPLOY).is_none(),
        "nothing is created for an invalid spec"
    );
    assert!(e.events().contains(&"InvalidSpec".to_string()));
}

#[tokio::test]
async fn an_adapter_with_a_bad_uri_gets_a_condition_naming_the_field() {
    let e = env(pool_obj(
        json!({"name": "Qwen/Qwen3-8B", "path": "base/qwen3-8b"}),
    ))
    .await;
    e.store.lock().unwrap().create(
        ADAPTER,
        json!({
            "apiVersion": "mole.dev/v1alpha1", "kind": "Adapter",
            "metadata": {"name": "calendar", "namespace": "ml"},
            "spec": {"pool": "vl", "version": "v1",
                     "source": {"path": "adapters/calendar/v1", "uri": "pvc://adapters/calendar"}}
        }),
    );
    for _ in 0..2 {
        let a: Adapter = serde_json::from_value(e.get(ADAPTER).unwrap()).unwrap();
        adapter::reconcile(Arc::new(a), e.ctx.clone())
            .await
            .unwrap();
    }
    let a = e.get(ADAPTER).unwrap();
    let valid = condition(&a, "Valid");
    assert_eq!(valid["status"], "False");
    assert!(
        valid["message"]
            .as_str()
            .unwrap()
            .starts_with("spec.source.uri"),
        "{valid}"
    );
    assert!(e.events().contains(&"InvalidSpec".to_string()));
}
