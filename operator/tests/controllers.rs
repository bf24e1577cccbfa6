//! Controller scenarios against an in-memory API server (tests/support), one per transition of
//! issue 2: create pool, add adapter, Ready when the pods report it, label clash, missing pool,
//! delete with finalizer, id never reused, restart writes nothing new.

mod support;

use std::sync::{Arc, Mutex};

use mole_crds::{Adapter, InferencePool};
use mole_operator::controller::{adapter, pool, Context, PodClient};
use mole_operator::telemetry::Metrics;
use serde_json::{json, Value};
use support::{FakeWorker, Shared, Store};

const POOL: &str = "/apis/mole.dev/v1alpha1/namespaces/ml/inferencepools/vl";
const CM: &str = "/api/v1/namespaces/ml/configmaps/vl-config";
const DEPLOY: &str = "/apis/apps/v1/namespaces/ml/deployments/vl-dynamic";
const SVC: &str = "/api/v1/namespaces/ml/services/vl";
const PDB: &str = "/apis/policy/v1/namespaces/ml/poddisruptionbudgets/vl-dynamic";

fn adapter_path(name: &str) -> String {
    format!("/apis/mole.dev/v1alpha1/namespaces/ml/adapters/{name}")
}

fn pool_obj() -> Value {
    json!({
        "apiVersion": "mole.dev/v1alpha1", "kind": "InferencePool",
        "metadata": {"name": "vl", "namespace": "ml"},
        "spec": {
            "baseModel": {"name": "Qwen/Qwen3-VL-8B-Instruct", "path": "base/qwen3-vl-8b"},
            "storage": {"claimName": "models"},
            "image": "ghcr.io/mole-dev/mole-worker:0.1.0",
            "gpu": {"count": 1},
            "dynamic": {"replicas": 1}
        }
    })
}

fn adapter_obj(name: &str, pool: &str, label: &str) -> Value {
    json!({
        "apiVersion": "mole.dev/v1alpha1", "kind": "Adapter",
        "metadata": {"name": name, "namespace": "ml"},
        "spec": {"pool": pool, "version": "v1", "source": {"path": format!("adapters/{name}/v1")},
                 "label": label, "keywords": [name]}
    })
}

struct Env {
    store: Shared,
    ctx: Arc<Context>,
    worker: FakeWorker,
}

async fn env() -> Env {
    let store: Shared = Arc::new(Mutex::new(Store::default()));
    let worker = support::fake_worker().await;
    let ctx = Arc::new(Context::new(
        support::client(store.clone()),
        "test".into(),
        Metrics::new(),
        PodClient::new(worker.addr.port()),
    ));
    Env { store, ctx, worker }
}

impl Env {
    fn get(&self, path: &str) -> Option<Value> {
        self.store.lock().unwrap().get(path)
    }
    fn pool(&self) -> Arc<InferencePool> {
        Arc::new(serde_json::from_value(self.get(POOL).unwrap()).unwrap())
    }
    fn adapter(&self, name: &str) -> Option<Arc<Adapter>> {
        self.get(&adapter_path(name))
            .map(|v| Arc::new(serde_json::from_value(v).unwrap()))
    }
    async fn reconcile_pool(&self) {
        pool::reconcile(self.pool(), self.ctx.clone())
            .await
            .unwrap();
    }
    /// Two passes, as the controller would run them: the first adds the finalizer.
    async fn reconcile_adapter(&self, name: &str) {
        for _ in 0..2 {
            if let Some(a) = self.adapter(name) {
                adapter::reconcile(a, self.ctx.clone()).await.unwrap();
            }
        }
    }
    fn add_ready_pod(&self) {
        let pod = json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "vl-dynamic-abc", "namespace": "ml",
                         "labels": {"app.kubernetes.io/instance": "vl", "app.kubernetes.io/component": "dynamic"}},
            "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}
        });
        self.store
            .lock()
            .unwrap()
            .create("/api/v1/namespaces/ml/pods/vl-dynamic-abc", pod);
    }
    fn worker_reports(&self, entries: &[(&str, &str, u32)]) {
        let data: Vec<Value> = entries
            .iter()
            .map(|(n, v, id)| json!({"name": n, "version": v, "lora_id": id, "residency": "gpu",
                                     "loaded": true, "rank": 8, "bytes": 1000, "requests": 0, "running": 0}))
            .collect();
        *self.worker.adapters.lock().unwrap() =
            json!({"object": "list", "base_model": "b", "data": data});
    }
}

fn condition<'a>(obj: &'a Value, t: &str) -> &'a Value {
    obj["status"]["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == t))
        .unwrap_or(&Value::Null)
}

fn without_rv(mut v: Value) -> Value {
    v["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("resourceVersion");
    v
}

#[tokio::test]
async fn create_pool_applies_children_and_status_and_a_restart_changes_nothing() {
    let e = env().await;
    e.store.lock().unwrap().create(POOL, pool_obj());
    e.reconcile_pool().await;
    for p in [CM, DEPLOY, SVC, PDB] {
        assert!(e.get(p).is_some(), "{p} applied");
    }
    let cm = e.get(CM).unwrap();
    let wc: mole_crds::WorkerConfig =
        serde_json::from_str(cm["data"]["worker.json"].as_str().unwrap()).unwrap();
    assert_eq!(wc.pool, "vl");
    assert!(wc.adapters.is_empty());
    let p = e.get(POOL).unwrap();
    assert_eq!(p["status"]["phase"], "Progressing", "no pod is ready yet");
    assert_eq!(condition(&p, "Valid")["status"], "True");
    assert_eq!(p["status"]["endpoint"], "http://vl.ml.svc:8000");
    assert!(e
        .store
        .lock()
        .unwrap()
        .events
        .contains(&"PodsNotReady".to_string()));

    // An operator restart finds the children and writes nothing new.
    let before: Vec<Value> = [CM, DEPLOY, SVC, PDB]
        .iter()
        .map(|p| without_rv(e.get(p).unwrap()))
        .collect();
    let events = e.store.lock().unwrap().events.len();
    e.reconcile_pool().await;
    let after: Vec<Value> = [CM, DEPLOY, SVC, PDB]
        .iter()
        .map(|p| without_rv(e.get(p).unwrap()))
        .collect();
    assert_eq!(before, after);
    assert_eq!(e.store.lock().unwrap().events.len(), events, "no new Event");
}

#[tokio::test]
async fn invalid_pool_gets_a_condition_naming_the_field_and_no_children() {
    let e = env().await;
    let mut p = pool_obj();
    p["spec"]["gpu"]["count"] = json!(0);
    e.store.lock().unwrap().create(POOL, p);
    e.reconcile_pool().await;
    let p = e.get(POOL).unwrap();
    assert_eq!(p["status"]["phase"], "Failed");
    let valid = condition(&p, "Valid");
    assert_eq!(valid["status"], "False");
    assert!(valid["message"]
        .as_str()
        .unwrap()
        .starts_with("spec.gpu.count"));
    assert!(
        e.get(DEPLOY).is_none(),
        "nothing is created for an invalid spec"
    );
    assert!(e
        .store
        .lock()
        .unwrap()
        .events
        .contains(&"InvalidSpec".to_string()));
}

#[tokio::test]
async fn adapter_registers_and_is_ready_only_when_the_pods_report_it() {
    let e = env().await;
    e.store.lock().unwrap().create(POOL, pool_obj());
    e.reconcile_pool().await;
    e.store.lock().unwrap().create(
        &adapter_path("calendar"),
        adapter_obj("calendar", "vl", "calendar"),
    );
    e.reconcile_adapter("calendar").await;

    let a = e.get(&adapter_path("calendar")).unwrap();
    assert_eq!(
        a["metadata"]["finalizers"],
        json!(["mole.dev/adapter-cleanup"])
    );
    assert_eq!(a["status"]["loraId"], 1);
    assert_eq!(a["status"]["phase"], "Pending", "no ready pod: not Ready");
    assert_eq!(e.get(POOL).unwrap()["status"]["loraIds"]["calendar"], 1);

    // The pool's config now lists it; the ready pod is told to reload.
    e.add_ready_pod();
    e.reconcile_pool().await;
    let cm = e.get(CM).unwrap();
    assert!(cm["data"]["worker.json"]
        .as_str()
        .unwrap()
        .contains("adapters/calendar/v1"));
    assert!(e
        .worker
        .calls
        .lock()
        .unwrap()
        .iter()
        .any(|(p, _)| p == "/admin/reload"));

    // The pod has not loaded it yet: still not Ready, and the status says why.
    e.reconcile_adapter("calendar").await;
    let a = e.get(&adapter_path("calendar")).unwrap();
    assert_eq!(a["status"]["phase"], "Pending");
    assert!(condition(&a, "Loaded")["message"]
        .as_str()
        .unwrap()
        .contains("0/1"));

    // An older version loaded is not the version asked for.
    e.worker_reports(&[("calendar", "v0", 1)]);
    e.reconcile_adapter("calendar").await;
    assert_eq!(
        e.get(&adapter_path("calendar")).unwrap()["status"]["phase"],
        "Pending"
    );

    e.worker_reports(&[("calendar", "v1", 1)]);
    e.reconcile_adapter("calendar").await;
    let a = e.get(&adapter_path("calendar")).unwrap();
    assert_eq!(a["status"]["phase"], "Ready");
    assert_eq!(condition(&a, "Loaded")["status"], "True");
    assert_eq!(a["status"]["activeVersion"], "v1");
    assert!(e
        .store
        .lock()
        .unwrap()
        .events
        .contains(&"AdapterLoaded".to_string()));
}

#[tokio::test]
async fn label_clash_and_missing_pool_are_refused_with_conditions() {
    let e = env().await;
    e.store.lock().unwrap().create(POOL, pool_obj());
    e.store.lock().unwrap().create(
        &adapter_path("calendar"),
        adapter_obj("calendar", "vl", "calendar"),
    );
    e.store.lock().unwrap().create(
        &adapter_path("calendar-copy"),
        adapter_obj("calendar-copy", "vl", "calendar"),
    );
    e.store.lock().unwrap().create(
        &adapter_path("orphan"),
        adapter_obj("orphan", "nope", "orphan"),
    );
    for n in ["calendar", "calendar-copy", "orphan"] {
        e.reconcile_adapter(n).await;
    }
    let ok = e.get(&adapter_path("calendar")).unwrap();
    assert_eq!(ok["status"]["loraId"], 1);
    let dup = e.get(&adapter_path("calendar-copy")).unwrap();
    assert_eq!(dup["status"]["phase"], "Failed");
    assert_eq!(condition(&dup, "Valid")["reason"], "DuplicateLabel");
    assert!(condition(&dup, "Valid")["message"]
        .as_str()
        .unwrap()
        .starts_with("spec.label"));
    assert!(
        dup["status"].get("loraId").is_none(),
        "no id for an invalid adapter"
    );
    let orphan = e.get(&adapter_path("orphan")).unwrap();
    assert_eq!(condition(&orphan, "Valid")["reason"], "PoolNotFound");
    let events = e.store.lock().unwrap().events.clone();
    assert!(events.contains(&"DuplicateLabel".into()) && events.contains(&"PoolNotFound".into()));
    // The valid adapter is still registered; the invalid ones are not in the config.
    e.reconcile_pool().await;
    let wc = e.get(CM).unwrap()["data"]["worker.json"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(wc.contains("\"calendar\"") && !wc.contains("calendar-copy"));
}

#[tokio::test]
async fn delete_runs_the_finalizer_and_ids_are_never_reused() {
    let e = env().await;
    e.store.lock().unwrap().create(POOL, pool_obj());
    e.add_ready_pod();
    e.store.lock().unwrap().create(
        &adapter_path("calendar"),
        adapter_obj("calendar", "vl", "calendar"),
    );
    e.reconcile_adapter("calendar").await;
    assert_eq!(
        e.get(&adapter_path("calendar")).unwrap()["status"]["loraId"],
        1
    );

    // kubectl delete: the API server sets deletionTimestamp and waits for the finalizer.
    {
        let mut s = e.store.lock().unwrap();
        let p = adapter_path("calendar");
        let mut a = s.get(&p).unwrap();
        a["metadata"]["deletionTimestamp"] = json!("2026-11-22T12:30:00Z");
        s.objects.insert(p, a);
    }
    e.reconcile_adapter("calendar").await;
    assert!(
        e.get(&adapter_path("calendar")).is_none(),
        "finalizer removed, object gone"
    );
    let unloads: Vec<Value> = e
        .worker
        .calls
        .lock()
        .unwrap()
        .iter()
        .filter(|(p, _)| p == "/v1/unload_lora_adapter")
        .map(|(_, b)| b.clone())
        .collect();
    assert_eq!(unloads, vec![json!({"lora_name": "calendar"})]);
    let pool = e.get(POOL).unwrap();
    assert!(pool["status"]["loraIds"].get("calendar").is_none());
    assert!(e
        .store
        .lock()
        .unwrap()
        .events
        .contains(&"Unregistered".to_string()));

    // Recreated with the same name: a fresh id.
    e.store.lock().unwrap().create(
        &adapter_path("calendar"),
        adapter_obj("calendar", "vl", "calendar"),
    );
    e.reconcile_adapter("calendar").await;
    assert_eq!(
        e.get(&adapter_path("calendar")).unwrap()["status"]["loraId"],
        2
    );
}

const JOBS: &str = "/apis/batch/v1/namespaces/ml/jobs";
const MERGED: &str = "/apis/apps/v1/namespaces/ml/deployments/vl-calendar";

impl Env {
    fn jobs(&self) -> Vec<(String, Value)> {
        let s = self.store.lock().unwrap();
        s.objects
            .iter()
            .filter(|(k, _)| k.starts_with(JOBS))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }
    fn edit(&self, path: &str, f: impl FnOnce(&mut Value)) {
        let mut s = self.store.lock().unwrap();
        let mut v = s.get(path).unwrap();
        f(&mut v);
        s.objects.insert(path.to_string(), v);
    }
    fn set_version(&self, v: &str) {
        self.edit(&adapter_path("calendar"), |a| {
            a["spec"]["version"] = json!(v);
            a["spec"]["source"]["path"] = json!(format!("adapters/calendar/{v}"));
            let g = a["metadata"]["generation"].as_i64().unwrap_or(1);
            a["metadata"]["generation"] = json!(g + 1);
        });
    }
    fn finish_only_job(&self, ok: bool, message: &str) -> String {
        let jobs = self.jobs();
        assert_eq!(
            jobs.len(),
            1,
            "exactly one merge Job: {:?}",
            jobs.iter().map(|j| &j.0).collect::<Vec<_>>()
        );
        let (path, job) = jobs[0].clone();
        let name = job["metadata"]["name"].as_str().unwrap().to_string();
        self.edit(&path, |j| {
            j["status"] = if ok {
                json!({"succeeded": 1})
            } else {
                json!({"failed": 3, "conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded", "message": "Job has reached the specified backoff limit"}]})
            };
        });
        if !ok {
            let pod = json!({"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": format!("{name}-x"), "namespace": "ml", "labels": {"job-name": name}},
                "status": {"containerStatuses": [{"name": "merge", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
                    "state": {"terminated": {"exitCode": 2, "message": message}}}]}});
            self.store
                .lock()
                .unwrap()
                .create(&format!("/api/v1/namespaces/ml/pods/{name}-x"), pod);
        }
        name
    }
    fn merged_ready(&self) {
        self.edit(MERGED, |d| {
            d["status"] = json!({"observedGeneration": 0, "replicas": 1, "updatedReplicas": 1, "readyReplicas": 1});
        });
    }
    fn merged_output(&self) -> String {
        self.get(MERGED).unwrap()["spec"]["template"]["metadata"]["annotations"]
            ["mole.dev/merged-output"]
            .as_str()
            .unwrap()
            .to_string()
    }
}

async fn merged_env() -> Env {
    let e = env().await;
    e.store.lock().unwrap().create(POOL, pool_obj());
    e.add_ready_pod();
    let mut a = adapter_obj("calendar", "vl", "calendar");
    a["spec"]["serving"] = json!({"mode": "merged", "replicas": 1});
    e.store.lock().unwrap().create(&adapter_path("calendar"), a);
    e
}

#[tokio::test]
async fn merge_job_then_merged_deployment_then_ready_and_forwarded() {
    let e = merged_env().await;
    e.worker_reports(&[("calendar", "v1", 1)]);
    e.reconcile_adapter("calendar").await;
    let jobs = e.jobs();
    assert_eq!(jobs.len(), 1);
    let job = &jobs[0].1;
    assert!(job["metadata"]["name"]
        .as_str()
        .unwrap()
        .starts_with("merge-calendar-"));
    let args: Vec<String> =
        serde_json::from_value(job["spec"]["template"]["spec"]["containers"][0]["args"].clone())
            .unwrap();
    assert_eq!(args[0], "merge");
    assert!(args.contains(&"--safe-merge".to_string()));
    assert!(args
        .iter()
        .any(|a| a.starts_with("/models/merged/calendar/v1-")));
    let a = e.get(&adapter_path("calendar")).unwrap();
    assert_eq!(a["status"]["phase"], "Merging");
    assert!(
        e.get(MERGED).is_none(),
        "no merged pods before the Job succeeds"
    );

    e.finish_only_job(true, "");
    e.reconcile_adapter("calendar").await;
    let out = e.merged_output();
    assert!(out.starts_with("merged/calendar/v1-"));
    assert!(e
        .get("/api/v1/namespaces/ml/services/vl-calendar")
        .is_some());
    assert!(e
        .get("/api/v1/namespaces/ml/configmaps/vl-calendar-config")
        .unwrap()["data"]["worker.json"]
        .as_str()
        .unwrap()
        .contains("\"mode\": \"merged\""));
    assert_ne!(
        e.get(&adapter_path("calendar")).unwrap()["status"]["phase"],
        "Ready",
        "merged pods not ready yet"
    );

    e.merged_ready();
    e.reconcile_adapter("calendar").await;
    let a = e.get(&adapter_path("calendar")).unwrap();
    assert_eq!(a["status"]["phase"], "Ready");
    assert_eq!(a["status"]["servingMode"], "merged");
    assert_eq!(a["status"]["endpoint"], "http://vl-calendar.ml.svc:8000");
    assert_eq!(a["status"]["history"][0]["mergedOutput"], json!(out));
    // Dynamic pods forward to the merged Service and keep the adapter loaded as a fallback.
    e.reconcile_pool().await;
    let wc: mole_crds::WorkerConfig =
        serde_json::from_str(e.get(CM).unwrap()["data"]["worker.json"].as_str().unwrap()).unwrap();
    let cal = wc.adapters.iter().find(|a| a.name == "calendar").unwrap();
    assert_eq!(
        cal.merged_endpoint.as_deref(),
        Some("http://vl-calendar.ml.svc:8000")
    );
    assert!(cal.load);
    let events = e.store.lock().unwrap().events.clone();
    assert!(events.contains(&"MergeStarted".into()) && events.contains(&"MergeSucceeded".into()));
}

#[tokio::test]
async fn failed_version_bump_keeps_the_old_version_serving_and_rollback_needs_no_job() {
    let e = merged_env().await;
    e.worker_reports(&[("calendar", "v1", 1)]);
    e.reconcile_adapter("calendar").await;
    e.finish_only_job(true, "");
    e.reconcile_adapter("calendar").await;
    e.merged_ready();
    e.reconcile_adapter("calendar").await;
    let v1_out = e.merged_output();

    // Roll forward to v2: a new Job while v1 keeps serving.
    e.set_version("v2");
    e.reconcile_adapter("calendar").await;
    let jobs = e.jobs();
    assert_eq!(jobs.len(), 2, "v1's finished Job and v2's");
    assert_eq!(
        e.merged_output(),
        v1_out,
        "the Deployment stays on v1 while v2 merges"
    );
    assert_eq!(
        e.get(&adapter_path("calendar")).unwrap()["status"]["phase"],
        "Merging"
    );

    // v2's merge fails: Degraded with the tool's reason, v1 still serving, the Job deleted.
    {
        let mut s = e.store.lock().unwrap();
        let v1_job = jobs
            .iter()
            .find(|(_, j)| j["status"]["succeeded"] == 1)
            .unwrap()
            .0
            .clone();
        s.objects.remove(&v1_job);
    }
    let v2_job = e.finish_only_job(false, "merge failed (non_finite_weights): model.layers.3.self_attn.q_proj: merged weights contain NaN/Inf");
    e.reconcile_adapter("calendar").await;
    let a = e.get(&adapter_path("calendar")).unwrap();
    assert_eq!(a["status"]["phase"], "Degraded");
    assert!(condition(&a, "Degraded")["message"]
        .as_str()
        .unwrap()
        .contains("non_finite_weights"));
    assert_eq!(a["status"]["activeVersion"], "v1");
    assert_eq!(e.merged_output(), v1_out);
    assert!(
        e.jobs().is_empty(),
        "the failed Job {v2_job} is deleted so a retry can reuse its name"
    );
    assert!(e
        .store
        .lock()
        .unwrap()
        .events
        .contains(&"MergeFailed".into()));
    // Within the backoff nothing is retried.
    e.reconcile_adapter("calendar").await;
    assert!(e.jobs().is_empty(), "no hot loop");

    // Roll back by applying v1 again: no Job, the Deployment serves v1, Ready.
    e.set_version("v1");
    e.reconcile_adapter("calendar").await;
    assert!(
        e.jobs().is_empty(),
        "rollback to a kept version needs no merge"
    );
    assert_eq!(e.merged_output(), v1_out);
    let a = e.get(&adapter_path("calendar")).unwrap();
    assert_eq!(a["status"]["phase"], "Ready");
    assert_eq!(a["status"]["activeVersion"], "v1");
}

#[tokio::test]
async fn switching_merged_to_dynamic_removes_merged_pods_once_dynamic_pods_serve_it() {
    let e = merged_env().await;
    e.reconcile_adapter("calendar").await;
    e.finish_only_job(true, "");
    e.reconcile_adapter("calendar").await;
    e.merged_ready();
    e.reconcile_adapter("calendar").await;
    e.edit(&adapter_path("calendar"), |a| {
        a["spec"]["serving"]["mode"] = json!("dynamic")
    });
    // The dynamic pods have not loaded it yet: the merged pods stay.
    e.reconcile_adapter("calendar").await;
    assert!(e.get(MERGED).is_some());
    e.worker_reports(&[("calendar", "v1", 1)]);
    e.reconcile_adapter("calendar").await;
    assert!(e.get(MERGED).is_none(), "merged Deployment removed");
    assert!(e
        .get("/api/v1/namespaces/ml/services/vl-calendar")
        .is_none());
    let a = e.get(&adapter_path("calendar")).unwrap();
    assert_eq!(a["status"]["servingMode"], "dynamic");
    assert_eq!(a["status"]["phase"], "Ready");
}

#[tokio::test]
async fn deleted_children_come_back_and_old_outputs_get_a_cleanup_job() {
    let e = merged_env().await;
    e.edit(POOL, |p| p["spec"]["merge"] = json!({"keepVersions": 0}));
    e.reconcile_adapter("calendar").await;
    // A Job deleted mid-run is recreated with the same name.
    let first = e.jobs()[0].0.clone();
    e.store.lock().unwrap().objects.remove(&first);
    e.reconcile_adapter("calendar").await;
    assert_eq!(e.jobs()[0].0, first);
    e.finish_only_job(true, "");
    e.reconcile_adapter("calendar").await;
    e.merged_ready();
    e.reconcile_adapter("calendar").await;
    // A deleted merged Deployment is recreated on the next reconcile.
    e.store.lock().unwrap().objects.remove(MERGED);
    e.reconcile_adapter("calendar").await;
    assert!(e.get(MERGED).is_some());
    e.merged_ready();
    e.reconcile_adapter("calendar").await;
    let v1_out = e.merged_output();

    // v2 replaces v1; with keepVersions 0 v1's output falls out of the history.
    e.set_version("v2");
    e.reconcile_adapter("calendar").await;
    let done: Vec<String> = e
        .jobs()
        .into_iter()
        .filter(|(_, j)| j["status"]["succeeded"] == 1)
        .map(|(p, _)| p)
        .collect();
    for p in done {
        e.store.lock().unwrap().objects.remove(&p);
    }
    e.finish_only_job(true, "");
    e.reconcile_adapter("calendar").await;
    e.merged_ready();
    e.reconcile_adapter("calendar").await;
    let cleanup: Vec<Value> = e
        .jobs()
        .into_iter()
        .filter(|(p, _)| p.contains("/cleanup-calendar-"))
        .map(|(_, j)| j)
        .collect();
    assert_eq!(cleanup.len(), 1, "one cleanup Job");
    let args: Vec<String> = serde_json::from_value(
        cleanup[0]["spec"]["template"]["spec"]["containers"][0]["args"].clone(),
    )
    .unwrap();
    assert_eq!(
        args[..3],
        [
            "prune".to_string(),
            "--root".into(),
            "/models/merged/calendar".into()
        ]
    );
    assert_eq!(args[3], format!("/models/{v1_out}"));
    assert_ne!(e.merged_output(), v1_out, "the Deployment serves v2");
}
