//! Model sources against the in-memory API server: a pool with `baseModel.source` gets the
//! `fetch-model` init container (with its Secret's keys as env) or the `pvc://` claim mounted
//! over the model's directory, and a bad URI gets a condition and an Event naming the field.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test

mod support;

use std::sync::{Arc, Mutex};

use mole_crds::{Adapter, InferencePool};
use mole_operator::controller::{adapter, pool, Context, PodClient, StoreWriters, Stores};
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
    writers: Mutex<StoreWriters>,
}

async fn env(pool: Value) -> Env {
    let store: Shared = Arc::new(Mutex::new(Store::default()));
    let worker = support::fake_worker(store.clone()).await;
    let (stores, writers) = Stores::new();
    let ctx = Arc::new(
        Context::new(
            support::client(store.clone()),
            "test".into(),
            Metrics::new(),
            PodClient::new(worker.addr.port()),
        )
        .with_pod_freshness(std::time::Duration::ZERO)
        .with_stores(stores),
    );
    store.lock().unwrap().create(POOL, pool);
    let e = Env {
        store,
        ctx,
        writers: Mutex::new(writers),
    };
    e.sync();
    let p: InferencePool = serde_json::from_value(e.get(POOL).unwrap()).unwrap();
    pool::reconcile(Arc::new(p), e.ctx.clone()).await.unwrap();
    e
}

impl Env {
    /// The controllers' stores catch up with the API server (their watches would).
    fn sync(&self) {
        support::sync_stores(&self.store, &mut self.writers.lock().unwrap());
    }
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

    // A pod fetching: its `fetch-model` container's last progress line is in `Fetched`.
    let pod = "/api/v1/namespaces/ml/pods/vl-dynamic-x";
    e.store.lock().unwrap().create(
        pod,
        json!({"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": "vl-dynamic-x", "namespace": "ml",
                            "labels": {"app.kubernetes.io/instance": "vl", "app.kubernetes.io/component": "dynamic"}},
               "status": {"phase": "Pending", "initContainerStatuses": [{"name": "fetch-model", "image": "i",
                   "imageID": "", "ready": false, "restartCount": 0,
                   "state": {"running": {"startedAt": "2026-11-28T12:00:00Z"}}}]}}),
    );
    e.store.lock().unwrap().objects.insert(
        format!("{pod}/log"),
        json!("{\"fields\":{\"message\":\"progress\",\"task\":\"fetch\",\"unit\":\"bytes\",\"done\":6512000000,\"total\":17504000000,\"percent\":37.2}}\n"),
    );
    e.reconcile_pool().await;
    let p = e.get(POOL).unwrap();
    let c = condition(&p, "Fetched");
    assert_eq!(c["reason"], "Fetching");
    assert_eq!(
        c["message"],
        "fetching the base model from hf://Qwen/Qwen3-8B@main, in progress: fetch: 37.2% (6512 of 17504 MB)"
    );
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
        e.sync();
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

const JOBS: &str = "/apis/batch/v1/namespaces/ml/jobs/";
const CM: &str = "/api/v1/namespaces/ml/configmaps/vl-config";

impl Env {
    /// Two passes, as the controllers would run them, with the pool's reconcile in between
    /// when its id ledger does not yet hold what the Adapter waits for (an id, or the release
    /// of a deleted one): the pool controller is the ledger's one writer.
    async fn reconcile_adapter(&self) {
        for pass in 0..2 {
            if pass == 1 {
                let a = self.get(ADAPTER).unwrap();
                let listed = self
                    .get(POOL)
                    .is_some_and(|p| p["status"]["loraIds"].get("calendar").is_some());
                let deleting = a["metadata"].get("deletionTimestamp").is_some();
                if self.get(POOL).is_some() && listed == deleting {
                    self.reconcile_pool().await;
                }
            }
            let a: Adapter = serde_json::from_value(self.get(ADAPTER).unwrap()).unwrap();
            self.sync();
            adapter::reconcile(Arc::new(a), self.ctx.clone())
                .await
                .unwrap();
        }
    }
    async fn reconcile_pool(&self) {
        let p: InferencePool = serde_json::from_value(self.get(POOL).unwrap()).unwrap();
        self.sync();
        pool::reconcile(Arc::new(p), self.ctx.clone())
            .await
            .unwrap();
    }
    fn jobs(&self) -> Vec<(String, Value)> {
        let s = self.store.lock().unwrap();
        s.objects
            .iter()
            .filter(|(k, _)| k.starts_with(JOBS))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }
    fn finish_job(&self, path: &str, status: Value) {
        let mut s = self.store.lock().unwrap();
        let mut v = s.get(path).unwrap();
        v["status"] = status;
        s.objects.insert(path.to_string(), v);
    }
    fn config_adapters(&self) -> Vec<String> {
        let cm = self.get(CM).unwrap();
        let wc: mole_crds::WorkerConfig =
            serde_json::from_str(cm["data"]["worker.json"].as_str().unwrap()).unwrap();
        wc.adapters.into_iter().map(|a| a.name).collect()
    }
}

async fn fetching_adapter() -> (Env, String, String) {
    let e = env(pool_obj(
        json!({"name": "Qwen/Qwen3-8B", "path": "base/qwen3-8b"}),
    ))
    .await;
    e.store.lock().unwrap().create(
        ADAPTER,
        json!({
            "apiVersion": "mole.dev/v1alpha1", "kind": "Adapter",
            "metadata": {"name": "calendar", "namespace": "ml", "generation": 1},
            "spec": {"pool": "vl", "version": "v1",
                     "source": {"path": "adapters/calendar/v1", "uri": "s3://adapters/calendar/v1",
                                "secretRef": {"name": "s3-creds"}}}
        }),
    );
    e.reconcile_adapter().await;
    let jobs = e.jobs();
    assert_eq!(jobs.len(), 1, "one fetch Job");
    let (path, job) = jobs[0].clone();
    let name = job["metadata"]["name"].as_str().unwrap().to_string();
    assert!(name.starts_with("fetch-calendar-"), "{name}");
    let c = &job["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(
        c["args"],
        json!([
            "fetch",
            "--source",
            "s3://adapters/calendar/v1",
            "--dest",
            "/models/adapters/calendar/v1"
        ])
    );
    assert_eq!(c["envFrom"][0]["secretRef"]["name"], "s3-creds");
    let a = e.get(ADAPTER).unwrap();
    assert_eq!(condition(&a, "Fetched")["reason"], "Fetching");
    assert_eq!(a["status"]["phase"], "Pending");
    // Registered (it has its id) but not loaded before its files are there.
    e.reconcile_pool().await;
    assert!(
        e.config_adapters().is_empty(),
        "not in the WorkerConfig while fetching"
    );
    (e, path, name)
}

#[tokio::test]
async fn an_adapter_uri_is_fetched_by_a_job_before_the_pods_load_it() {
    let (e, path, name) = fetching_adapter().await;
    // While the Job's pod runs, its last progress line is in `Fetched`.
    let pod = format!("/api/v1/namespaces/ml/pods/{name}-x");
    e.store.lock().unwrap().create(
        &pod,
        json!({"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": format!("{name}-x"), "namespace": "ml", "labels": {"job-name": name}},
               "status": {"phase": "Running"}}),
    );
    e.store.lock().unwrap().objects.insert(
        format!("{pod}/log"),
        json!("{\"fields\":{\"message\":\"progress\",\"task\":\"fetch\",\"unit\":\"bytes\",\"done\":100000000,\"total\":270000000,\"percent\":37.0}}\n"),
    );
    e.reconcile_adapter().await;
    let a = e.get(ADAPTER).unwrap();
    let c = condition(&a, "Fetched");
    assert!(
        c["message"]
            .as_str()
            .unwrap()
            .ends_with("in progress: fetch: 37.0% (100 of 270 MB)"),
        "{c}"
    );
    e.finish_job(&path, json!({"succeeded": 1}));
    e.reconcile_adapter().await;
    let a = e.get(ADAPTER).unwrap();
    assert_eq!(condition(&a, "Fetched")["status"], "True");
    assert!(a["status"]["fetched"].is_string());
    assert!(e.events().contains(&"FetchSucceeded".to_string()));
    e.reconcile_pool().await;
    assert_eq!(e.config_adapters(), ["calendar"]);
    // Done once: later passes create no Job and keep the status.
    e.reconcile_adapter().await;
    assert_eq!(e.jobs().len(), 1);
    assert_eq!(
        e.get(ADAPTER).unwrap()["status"]["fetched"],
        a["status"]["fetched"]
    );
}

#[tokio::test]
async fn a_failed_fetch_puts_the_tools_reason_in_the_condition() {
    let (e, path, name) = fetching_adapter().await;
    e.finish_job(
        &path,
        json!({"failed": 4, "conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]}),
    );
    let line = "fetch failed (pickle_refused): adapter_model.bin: pickled weights are refused";
    e.store.lock().unwrap().create(
        &format!("/api/v1/namespaces/ml/pods/{name}-x"),
        json!({"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": format!("{name}-x"), "namespace": "ml", "labels": {"job-name": name}},
               "status": {"containerStatuses": [{"name": "fetch", "image": "i", "imageID": "", "ready": false,
                   "restartCount": 0, "state": {"terminated": {"exitCode": 2, "message": line}}}]}}),
    );
    e.reconcile_adapter().await;
    let a = e.get(ADAPTER).unwrap();
    let c = condition(&a, "Fetched");
    assert_eq!(
        (c["status"].as_str(), c["reason"].as_str()),
        (Some("False"), Some("FetchFailed"))
    );
    assert!(c["message"].as_str().unwrap().contains(line), "{c}");
    assert_eq!(a["status"]["phase"], "Failed");
    assert_eq!(
        e.events().iter().filter(|r| *r == "FetchFailed").count(),
        1,
        "one Event for the failure, however often it is seen"
    );
    e.reconcile_pool().await;
    assert!(e.config_adapters().is_empty());
}

/// Issue 34 item 1: versions fetched into one `source.path` overwrite each other's files. A
/// rollback within the day a finished fetch Job is kept must not take v1's old Job as v1's
/// files being there (v2's are): v1 is fetched again before the pods are told to load it.
#[tokio::test]
async fn a_rollback_to_a_version_fetched_into_a_shared_path_fetches_it_again() {
    let e = env(pool_obj(
        json!({"name": "Qwen/Qwen3-8B", "path": "base/qwen3-8b"}),
    ))
    .await;
    let spec = |v: &str| {
        json!({"pool": "vl", "version": v,
               "source": {"path": "adapters/calendar", "uri": format!("hf://org/calendar@{v}")}})
    };
    e.store.lock().unwrap().create(
        ADAPTER,
        json!({"apiVersion": "mole.dev/v1alpha1", "kind": "Adapter",
               "metadata": {"name": "calendar", "namespace": "ml"}, "spec": spec("v1")}),
    );
    let set = |v: &str| {
        let mut s = e.store.lock().unwrap();
        let mut a = s.get(ADAPTER).unwrap();
        a["spec"] = spec(v);
        let g = a["metadata"]["generation"].as_i64().unwrap_or(1);
        a["metadata"]["generation"] = json!(g + 1);
        s.objects.insert(ADAPTER.into(), a);
    };
    let running = |e: &Env| -> Vec<String> {
        e.jobs()
            .into_iter()
            .filter(|(_, j)| j["status"].get("succeeded").is_none())
            .map(|(p, _)| p)
            .collect()
    };
    let fetched = |e: &Env| e.get(ADAPTER).unwrap()["status"]["fetched"].clone();
    e.reconcile_adapter().await;
    let v1_job = running(&e);
    assert_eq!(v1_job.len(), 1);
    e.finish_job(&v1_job[0], json!({"succeeded": 1}));
    e.reconcile_adapter().await;
    let v1_key = fetched(&e);
    assert!(v1_key.is_string());

    set("v2");
    e.reconcile_adapter().await;
    let v2_job = running(&e);
    assert_eq!(v2_job.len(), 1);
    e.finish_job(&v2_job[0], json!({"succeeded": 1}));
    e.reconcile_adapter().await;
    let v2_key = fetched(&e);
    assert_ne!(v2_key, v1_key);

    // Back to v1: adapters/calendar holds v2's files, whatever v1's old Job says.
    set("v1");
    e.reconcile_adapter().await;
    assert_ne!(fetched(&e), v1_key, "v1's files are not there any more");
    let again = running(&e);
    assert_eq!(again.len(), 1, "v1 is fetched again: {:?}", e.jobs());
    let a = e.get(ADAPTER).unwrap();
    assert_eq!(condition(&a, "Fetched")["reason"], "Fetching");
    e.reconcile_pool().await;
    assert!(e.config_adapters().is_empty(), "not loaded from v2's files");
    e.finish_job(&again[0], json!({"succeeded": 1}));
    e.reconcile_adapter().await;
    assert_eq!(fetched(&e), v1_key);
    e.reconcile_pool().await;
    assert_eq!(e.config_adapters(), ["calendar"]);
}
