//! Controller scenarios against an in-memory API server (tests/support), one per transition of
//! issue 2: create pool, add adapter, Ready when the pods report it, label clash, missing pool,
//! delete with finalizer, id never reused, restart writes nothing new.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test

mod support;

use std::sync::{Arc, Mutex};

use kube::runtime::controller::Action;
use mole_crds::{Adapter, InferencePool};
use mole_operator::controller::{adapter, pool, Context, PodClient, StoreWriters, Stores};
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
    stores: Stores,
    writers: Mutex<StoreWriters>,
}

async fn env() -> Env {
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
        .with_stores(stores.clone()),
    );
    Env {
        store,
        ctx,
        worker,
        stores,
        writers: Mutex::new(writers),
    }
}

impl Env {
    /// A Context against this store and worker reporting as `identity`, as the operator
    /// builds it (its default pod freshness, no stores): a case adds what it needs.
    fn bare_context(&self, identity: &str) -> Context {
        Context::new(
            support::client(self.store.clone()),
            identity.into(),
            Metrics::new(),
            PodClient::new(self.worker.addr.port()),
        )
    }

    /// Another operator's Context (a restart: nothing in memory) with the scenarios'
    /// settings: pods read afresh, the controllers' stores.
    fn operator_context(&self, identity: &str) -> Arc<Context> {
        Arc::new(
            self.bare_context(identity)
                .with_pod_freshness(std::time::Duration::ZERO)
                .with_stores(self.stores.clone()),
        )
    }

    /// The methods (PUT, APPLY, ...) of the writes of the pool's status so far.
    fn pool_status_writes(&self) -> Vec<String> {
        let status = format!("{POOL}/status");
        let s = self.store.lock().unwrap();
        s.writes
            .iter()
            .filter(|(_, p)| *p == status)
            .map(|(m, _)| m.clone())
            .collect()
    }

    /// The controllers' stores catch up with the API server (their watches would).
    fn sync(&self) {
        support::sync_stores(&self.store, &mut self.writers.lock().unwrap());
    }
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
    async fn reconcile_pool(&self) -> Action {
        self.sync();
        pool::reconcile(self.pool(), self.ctx.clone())
            .await
            .unwrap()
    }
    /// The kubelet refreshed the pod's mounted ConfigMap: the fake worker's file now has the
    /// ConfigMap's content hash.
    fn refresh_config_file(&self) {
        let cm = self.get(CM).unwrap();
        let hash = cm["metadata"]["annotations"]["mole.dev/config-hash"]
            .as_str()
            .unwrap()
            .to_string();
        *self.worker.file_hash.lock().unwrap() = Some(hash);
    }
    fn writes(&self) -> usize {
        self.store.lock().unwrap().writes.len()
    }
    fn events(&self) -> Vec<String> {
        self.store.lock().unwrap().events.clone()
    }
    fn count_events(&self, reason: &str) -> usize {
        self.events().iter().filter(|r| *r == reason).count()
    }
    fn unauthorized(&self) -> usize {
        *self.worker.unauthorized.lock().unwrap()
    }
    /// One pass from what the watches deliver now.
    async fn reconcile_adapter_once(&self, name: &str) {
        self.sync();
        adapter::reconcile(self.adapter(name).unwrap(), self.ctx.clone())
            .await
            .unwrap();
    }
    /// One pass from what a lagging watch delivers: the stores and the Adapter as they were
    /// at `snapshot` (taken before the last passes wrote).
    async fn reconcile_adapter_lagging(
        &self,
        name: &str,
        snapshot: &std::collections::BTreeMap<String, Value>,
    ) {
        support::sync_stores_to(snapshot, &mut self.writers.lock().unwrap());
        let stale: Arc<Adapter> =
            Arc::new(serde_json::from_value(snapshot[&adapter_path(name)].clone()).unwrap());
        adapter::reconcile(stale, self.ctx.clone()).await.unwrap();
    }
    /// Two passes, as the controllers would run them: the first adds the finalizer (and, with
    /// no id yet, waits for one); then, when the pool's id ledger does not hold what the
    /// Adapter waits for (an id for a live one, a release for a deleted one), a reconcile of
    /// the pool, which the Adapter's event triggers; then the second pass.
    async fn reconcile_adapter(&self, name: &str) {
        for pass in 0..2 {
            if pass == 1 {
                self.settle_ledger(name).await;
            }
            if let Some(a) = self.adapter(name) {
                self.sync();
                adapter::reconcile(a, self.ctx.clone()).await.unwrap();
            }
        }
    }
    /// A reconcile of `name`'s pool when its ledger does not yet hold what the Adapter waits
    /// for (see [`Env::reconcile_adapter`]).
    async fn settle_ledger(&self, name: &str) {
        let Some(a) = self.get(&adapter_path(name)) else {
            return;
        };
        let pool = format!(
            "/apis/mole.dev/v1alpha1/namespaces/ml/inferencepools/{}",
            a["spec"]["pool"].as_str().unwrap()
        );
        let Some(p) = self.get(&pool) else { return };
        let listed = p["status"]["loraIds"].get(name).is_some();
        let deleting = a["metadata"].get("deletionTimestamp").is_some();
        if listed == deleting {
            self.sync();
            let p: Arc<InferencePool> = Arc::new(serde_json::from_value(p).unwrap());
            pool::reconcile(p, self.ctx.clone()).await.unwrap();
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

    /// As [`Env::worker_reports`], each entry also naming the directory it was read from.
    fn worker_reports_from(&self, entries: &[(&str, &str, u32, &str)]) {
        let data: Vec<Value> = entries
            .iter()
            .map(|(n, v, id, path)| json!({"name": n, "version": v, "lora_id": id, "path": path,
                "residency": "gpu", "loaded": true, "rank": 8, "bytes": 1000, "requests": 0, "running": 0}))
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
    // The pods listen where the operator polls them (here the fake worker's port, not 8000).
    let port = e.worker.addr.port();
    let c = &e.get(DEPLOY).unwrap()["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(c["ports"][0]["containerPort"], json!(port));
    assert!(c["args"]
        .as_array()
        .unwrap()
        .contains(&json!(format!("0.0.0.0:{port}"))));
    assert!(e
        .store
        .lock()
        .unwrap()
        .events
        .contains(&"PodsNotReady".to_string()));

    // An operator restart (a fresh Context: nothing in memory) finds the children and writes
    // nothing at all: no apply, no status write, no Event.
    let before: Vec<Value> = [CM, DEPLOY, SVC, PDB]
        .iter()
        .map(|p| e.get(p).unwrap())
        .collect();
    let writes = e.writes();
    let events = e.store.lock().unwrap().events.len();
    let restarted = e.operator_context("test-2");
    e.sync();
    pool::reconcile(e.pool(), restarted).await.unwrap();
    let after: Vec<Value> = [CM, DEPLOY, SVC, PDB]
        .iter()
        .map(|p| e.get(p).unwrap())
        .collect();
    assert_eq!(before, after, "same objects, same resourceVersions");
    assert_eq!(
        e.store.lock().unwrap().writes[writes..],
        [],
        "a restarted operator writes nothing"
    );
    assert_eq!(e.store.lock().unwrap().events.len(), events, "no new Event");
}

#[tokio::test]
async fn a_pool_without_an_image_runs_the_operators_default_for_its_hardware() {
    let mut e = env().await;
    let images = mole_operator::resources::WorkerDefaults {
        gpu: "registry.local/mole-worker:dev-cuda".into(),
        cpu: "registry.local/mole-worker:dev-cpu".into(),
        ..Default::default()
    };
    e.ctx = Arc::new(
        Context::new(
            e.ctx.client.clone(),
            "test".into(),
            Metrics::new(),
            PodClient::new(e.worker.addr.port()),
        )
        .with_worker_defaults(images)
        .with_pod_freshness(std::time::Duration::ZERO)
        .with_stores(e.stores.clone()),
    );
    let mut obj = pool_obj();
    obj["spec"].as_object_mut().unwrap().remove("image");
    e.store.lock().unwrap().create(POOL, obj.clone());
    e.reconcile_pool().await;
    let image = |e: &Env| {
        e.get(DEPLOY).unwrap()["spec"]["template"]["spec"]["containers"][0]["image"].clone()
    };
    assert_eq!(image(&e), "registry.local/mole-worker:dev-cuda");
    // The same pool on CPU nodes gets the CPU build.
    obj["metadata"]["annotations"] = json!({"mole.dev/allow-cpu": "true"});
    obj["spec"]["gpu"]["count"] = json!(0);
    e.store.lock().unwrap().create(POOL, obj);
    e.reconcile_pool().await;
    assert_eq!(image(&e), "registry.local/mole-worker:dev-cpu");
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
async fn malformed_pod_setting_names_are_refused_naming_the_field() {
    for (field, path, value) in [
        (
            "spec.imagePullSecrets[0].name",
            "/spec/imagePullSecrets",
            json!([{"name": "Reg_Cred"}]),
        ),
        (
            "spec.gpu.runtimeClassName",
            "/spec/gpu/runtimeClassName",
            json!("NVIDIA"),
        ),
        (
            "spec.gpu.priorityClassName",
            "/spec/gpu/priorityClassName",
            json!("high priority"),
        ),
    ] {
        let e = env().await;
        let mut p = pool_obj();
        let (parent, key) = path.rsplit_once('/').unwrap();
        p.pointer_mut(parent).unwrap()[key] = value;
        e.store.lock().unwrap().create(POOL, p);
        e.reconcile_pool().await;
        let p = e.get(POOL).unwrap();
        let valid = condition(&p, "Valid");
        assert_eq!(valid["status"], "False", "{field}");
        assert!(
            valid["message"].as_str().unwrap().starts_with(field),
            "{field}: {}",
            valid["message"]
        );
        assert!(
            e.get(DEPLOY).is_none(),
            "{field}: no pods without a valid name"
        );
        assert!(e.events().contains(&"InvalidSpec".to_string()), "{field}");
    }
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

/// Issue 55 item 2: the pool's status has one writer. 300 Adapters applied at once, their
/// reconciles running together with their pool's, as the controllers run them: every Adapter
/// gets an id of its own, and the pool's status is written by the pool controller's one apply
/// per reconcile, not once per Adapter (before: each Adapter's reconcile wrote the id ledger
/// with a GET + PUT of the pool's status, 300 PUTs here; against a real API server, with the
/// pool controller's applies in between, 851 conflicts).
#[tokio::test]
async fn adapters_applied_at_once_get_their_ids_from_one_pool_status_writer() {
    const N: usize = 300;
    let e = env().await;
    e.store.lock().unwrap().create(POOL, pool_obj());
    e.reconcile_pool().await;
    for i in 0..N {
        let name = format!("a{i}");
        e.store
            .lock()
            .unwrap()
            .create(&adapter_path(&name), adapter_obj(&name, "vl", &name));
    }
    let before = e.pool_status_writes().len();
    // Rounds as the controllers run them: every Adapter and the pool at once, from what the
    // watches delivered before the round.
    const ROUNDS: usize = 3;
    for _ in 0..ROUNDS {
        e.sync();
        let adapters = futures::future::join_all(
            (0..N).map(|i| adapter::reconcile(e.adapter(&format!("a{i}")).unwrap(), e.ctx.clone())),
        );
        let pool = pool::reconcile(e.pool(), e.ctx.clone());
        let (adapters, pool) = futures::join!(adapters, pool);
        pool.unwrap();
        for a in adapters {
            a.unwrap();
        }
    }
    let writes = e.pool_status_writes()[before..].to_vec();
    let conflicts = e.store.lock().unwrap().conflicts;
    let mut ids: Vec<u64> = (0..N)
        .map(|i| {
            let a = e.get(&adapter_path(&format!("a{i}"))).unwrap();
            a["status"]["loraId"]
                .as_u64()
                .unwrap_or_else(|| panic!("a{i} has no id: {}", a["status"]))
        })
        .collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), N, "ids are unique");
    let ledger = &e.get(POOL).unwrap()["status"]["loraIds"];
    assert_eq!(ledger.as_object().unwrap().len(), N, "{ledger}");
    eprintln!(
        "{N} Adapters at once: {} writes of the pool's status ({:?} PUT), {conflicts} conflicts",
        writes.len(),
        writes.iter().filter(|m| *m == "PUT").count()
    );
    assert!(
        writes.iter().all(|m| m == "APPLY"),
        "only the pool controller's apply writes the pool's status"
    );
    assert!(
        writes.len() <= ROUNDS,
        "at most one write of the pool's status per pool reconcile: {}",
        writes.len()
    );
    assert_eq!(conflicts, 0);
}

/// A deleted Adapter's finalizer waits until the pool controller has seen the deletion and
/// taken its id out of the ledger; the Adapter controller writes nothing to the pool.
#[tokio::test]
async fn a_deleted_adapters_id_is_released_by_the_pool_controller_before_the_finalizer_goes() {
    let e = env().await;
    e.store.lock().unwrap().create(POOL, pool_obj());
    e.store.lock().unwrap().create(
        &adapter_path("calendar"),
        adapter_obj("calendar", "vl", "calendar"),
    );
    e.reconcile_adapter("calendar").await;
    assert_eq!(e.get(POOL).unwrap()["status"]["loraIds"]["calendar"], 1);
    e.edit(&adapter_path("calendar"), |a| {
        a["metadata"]["deletionTimestamp"] = json!("2026-11-22T12:30:00Z");
    });
    let before = e.pool_status_writes().len();
    e.reconcile_adapter_once("calendar").await;
    assert!(
        e.get(&adapter_path("calendar")).is_some(),
        "the finalizer waits for the release"
    );
    assert_eq!(e.get(POOL).unwrap()["status"]["loraIds"]["calendar"], 1);
    assert_eq!(
        e.pool_status_writes().len(),
        before,
        "the Adapter controller wrote the pool"
    );
    // The pool's reconcile (the Adapter's change triggers it) releases the id ...
    e.reconcile_pool().await;
    let pool = e.get(POOL).unwrap();
    assert!(
        pool["status"]["loraIds"].get("calendar").is_none(),
        "{pool}"
    );
    assert_eq!(pool["status"]["nextLoraId"], 2, "the number stays burnt");
    // ... and the Adapter (woken by the ledger's change) goes.
    e.reconcile_adapter_once("calendar").await;
    assert!(e.get(&adapter_path("calendar")).is_none());
}

/// The pool controller settles the ledger from its own last write, not from a cache that has
/// not seen it yet: a reconcile from a lagging cache gives no id twice. After a restart (no
/// such record) the ledger is read from the status and written on the cached version only: a
/// cache behind the API server conflicts instead of giving ids again, and a fresh one changes
/// nothing.
#[tokio::test]
async fn ids_survive_a_restart_and_a_lagging_cache_never_gives_one_twice() {
    let e = env().await;
    e.store.lock().unwrap().create(POOL, pool_obj());
    for n in ["a", "b"] {
        e.store
            .lock()
            .unwrap()
            .create(&adapter_path(n), adapter_obj(n, "vl", n));
    }
    let before_ids = support::snapshot(&e.store);
    e.reconcile_pool().await;
    let ids = |e: &Env| e.get(POOL).unwrap()["status"]["loraIds"].clone();
    assert_eq!(ids(&e), json!({"a": 1, "b": 2}));
    e.store
        .lock()
        .unwrap()
        .create(&adapter_path("c"), adapter_obj("c", "vl", "c"));
    // The pool's watch lags: its cache still shows the status before the ids.
    let mut lagging = support::snapshot(&e.store);
    lagging.insert(POOL.to_string(), before_ids[POOL].clone());
    let stale_pool = |ctx: &Arc<Context>| {
        support::sync_stores_to(&lagging, &mut e.writers.lock().unwrap());
        let p: Arc<InferencePool> =
            Arc::new(serde_json::from_value(lagging[POOL].clone()).unwrap());
        pool::reconcile(p, ctx.clone())
    };
    stale_pool(&e.ctx).await.unwrap();
    assert_eq!(ids(&e), json!({"a": 1, "b": 2, "c": 3}));
    // A restarted operator whose first look at the pool is that lagging cache.
    let restarted = e.operator_context("test");
    let err = stale_pool(&restarted).await.unwrap_err();
    assert_eq!(err.code(), "conflict", "{err}");
    assert_eq!(ids(&e), json!({"a": 1, "b": 2, "c": 3}));
    e.sync();
    pool::reconcile(e.pool(), restarted.clone()).await.unwrap();
    assert_eq!(ids(&e), json!({"a": 1, "b": 2, "c": 3}));
    assert_eq!(e.get(POOL).unwrap()["status"]["nextLoraId"], 4);
}

const JOBS: &str = "/apis/batch/v1/namespaces/ml/jobs";

fn cm_path(name: &str) -> String {
    format!("/api/v1/namespaces/ml/configmaps/{name}")
}
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
    /// The Deployment controller finished rolling the merged Deployment: it saw the current
    /// generation and every replica runs the current template and is available.
    fn merged_ready(&self) {
        self.edit(MERGED, |d| {
            let g = d["metadata"]["generation"].as_i64().unwrap_or(1);
            let n = d["spec"]["replicas"].as_i64().unwrap_or(1);
            d["status"] = json!({"observedGeneration": g, "replicas": n, "updatedReplicas": n,
                                 "readyReplicas": n, "availableReplicas": n});
        });
    }
    /// Mid-rollout: the controller saw the new template, one new pod exists but is not
    /// available, the old pods are still ready.
    fn merged_rolling(&self) {
        self.edit(MERGED, |d| {
            let g = d["metadata"]["generation"].as_i64().unwrap_or(1);
            let n = d["spec"]["replicas"].as_i64().unwrap_or(1);
            d["status"] = json!({"observedGeneration": g, "replicas": n + 1, "updatedReplicas": 1,
                                 "readyReplicas": n, "availableReplicas": n});
        });
    }
    /// The ConfigMap the merged Deployment's pod template mounts.
    fn merged_config_name(&self) -> String {
        let d = self.get(MERGED).unwrap();
        d["spec"]["template"]["spec"]["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == "config")
            .unwrap()["configMap"]["name"]
            .as_str()
            .unwrap()
            .to_string()
    }
    /// Names of the adapter's merged ConfigMaps.
    fn merged_config_maps(&self) -> Vec<String> {
        let s = self.store.lock().unwrap();
        s.objects
            .iter()
            .filter(|(k, v)| {
                k.starts_with("/api/v1/namespaces/ml/configmaps/")
                    && v["metadata"]["labels"]["mole.dev/adapter"] == "calendar"
            })
            .map(|(_, v)| v["metadata"]["name"].as_str().unwrap().to_string())
            .collect()
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
    let cm = e.get(&cm_path(&e.merged_config_name())).unwrap();
    assert!(cm["data"]["worker.json"]
        .as_str()
        .unwrap()
        .contains("\"mode\": \"merged\""));
    assert_eq!(cm["metadata"]["ownerReferences"][0]["kind"], "Adapter");
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
    assert_eq!(
        e.count_events("Promoted"),
        1,
        "promotion completed: one Event"
    );
    // Requeues while Ready announce nothing new.
    e.reconcile_adapter("calendar").await;
    assert_eq!(e.count_events("Promoted"), 1);
    assert_eq!(
        e.unauthorized(),
        0,
        "every pod call carried the operator token"
    );
}

/// `spec.merge.quantize`: the merge Job runs `merge --quantize` into the output the merged
/// Deployment then serves; a drift over the bound fails the Job and the Adapter says why; a
/// bound that is not positive is refused by a condition and an Event naming the field.
#[tokio::test]
async fn quantized_merge_is_served_and_its_drift_refusal_is_reported() {
    let e = merged_env().await;
    e.edit(&adapter_path("calendar"), |a| {
        a["spec"]["merge"] = json!({"quantize": {"type": "q4_k", "maxDrift": 0.05}});
    });
    e.worker_reports(&[("calendar", "v1", 1)]);
    e.reconcile_adapter("calendar").await;
    let jobs = e.jobs();
    assert_eq!(jobs.len(), 1);
    let args: Vec<String> = serde_json::from_value(
        jobs[0].1["spec"]["template"]["spec"]["containers"][0]["args"].clone(),
    )
    .unwrap();
    let after = |flag: &str| {
        let i = args.iter().position(|a| a == flag).unwrap();
        args[i + 1].clone()
    };
    assert_eq!(after("--quantize"), "q4_k");
    assert_eq!(after("--max-drift"), "0.05");
    let out = after("--out");
    // While it runs, its last progress line is in the Merged condition.
    let job_name = jobs[0].1["metadata"]["name"].as_str().unwrap().to_string();
    let pod = format!("/api/v1/namespaces/ml/pods/{job_name}-run");
    e.store.lock().unwrap().create(
        &pod,
        json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": format!("{job_name}-run"), "namespace": "ml", "labels": {"job-name": job_name}},
            "status": {"phase": "Running"}}),
    );
    e.store.lock().unwrap().objects.insert(
        format!("{pod}/log"),
        json!("{\"fields\":{\"message\":\"progress\",\"task\":\"quantize\",\"unit\":\"tensors\",\"done\":120,\"total\":272,\"percent\":44.1}}\n"),
    );
    e.reconcile_adapter("calendar").await;
    let a = e.get(&adapter_path("calendar")).unwrap();
    assert!(condition(&a, "Merged")["message"]
        .as_str()
        .unwrap()
        .ends_with("in progress: quantize: 44.1% (120 of 272 tensors)"));
    e.store.lock().unwrap().objects.remove(&pod);
    e.finish_only_job(true, "");
    e.reconcile_adapter("calendar").await;
    assert_eq!(
        format!("/models/{}", e.merged_output()),
        out,
        "the merged Deployment serves the quantized output"
    );

    // v2 drifts too far: the Job fails, v1 (quantized) keeps serving, the reason is shown.
    e.merged_ready();
    e.reconcile_adapter("calendar").await;
    e.set_version("v2");
    e.reconcile_adapter("calendar").await;
    {
        let mut s = e.store.lock().unwrap();
        let done: Vec<String> = s
            .objects
            .iter()
            .filter(|(k, v)| k.contains("/jobs/") && v["status"]["succeeded"] == 1)
            .map(|(k, _)| k.clone())
            .collect();
        for k in done {
            s.objects.remove(&k);
        }
    }
    e.finish_only_job(
        false,
        "quantize failed (drift_over_bound): mean next-token KL divergence 0.081000 is over the bound 0.05 (--max-drift); the output was not kept",
    );
    e.reconcile_adapter("calendar").await;
    let a = e.get(&adapter_path("calendar")).unwrap();
    assert_eq!(a["status"]["phase"], "Degraded");
    assert!(condition(&a, "Degraded")["message"]
        .as_str()
        .unwrap()
        .contains("drift_over_bound"));
    assert_eq!(a["status"]["activeVersion"], "v1");

    // A bound that is not a positive number: refused, naming the field.
    e.edit(&adapter_path("calendar"), |a| {
        a["spec"]["merge"] = json!({"quantize": {"type": "q4_k", "maxDrift": -1.0}});
        let g = a["metadata"]["generation"].as_i64().unwrap_or(1);
        a["metadata"]["generation"] = json!(g + 1);
    });
    e.reconcile_adapter("calendar").await;
    let a = e.get(&adapter_path("calendar")).unwrap();
    let valid = condition(&a, "Valid");
    assert_eq!(valid["status"], "False");
    assert!(
        valid["message"]
            .as_str()
            .unwrap()
            .starts_with("spec.merge.quantize.maxDrift"),
        "{}",
        valid["message"]
    );
    assert!(e.events().contains(&"InvalidSpec".to_string()));
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
        e.running_jobs("merge-").is_empty() && e.jobs().len() == 1,
        "the failed Job {v2_job} stays (failed) through its backoff"
    );
    assert!(e
        .store
        .lock()
        .unwrap()
        .events
        .contains(&"MergeFailed".into()));
    // Within the backoff nothing is retried.
    e.reconcile_adapter("calendar").await;
    assert!(e.running_jobs("merge-").is_empty(), "no hot loop");
    assert_eq!(e.jobs().len(), 1, "nor deleted");

    // Roll back by applying v1 again: no Job, the Deployment serves v1, Ready.
    e.set_version("v1");
    e.reconcile_adapter("calendar").await;
    assert!(
        e.running_jobs("merge-").is_empty(),
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

/// Brings the merged adapter `calendar` to Ready on v1.
async fn merged_ready_on_v1(e: &Env) {
    e.worker_reports(&[("calendar", "v1", 1)]);
    e.reconcile_adapter("calendar").await;
    e.finish_only_job(true, "");
    e.reconcile_adapter("calendar").await;
    e.merged_ready();
    e.reconcile_adapter("calendar").await;
    assert_eq!(
        e.get(&adapter_path("calendar")).unwrap()["status"]["phase"],
        "Ready"
    );
}

/// Removes the finished merge Jobs (their TTL).
fn drop_finished_jobs(e: &Env) {
    for (p, j) in e.jobs() {
        if j["status"]["succeeded"] == 1 {
            e.store.lock().unwrap().objects.remove(&p);
        }
    }
}

#[tokio::test]
async fn the_operator_token_is_created_once_mounted_everywhere_and_required_by_the_pods() {
    let e = merged_env().await;
    e.reconcile_pool().await;
    let secret_path = "/api/v1/namespaces/ml/secrets/vl-operator-token";
    let secret = e.get(secret_path).expect("token Secret created");
    assert_eq!(
        secret["metadata"]["ownerReferences"][0]["kind"],
        "InferencePool"
    );
    let token = support::stored_token(&e.store).unwrap();
    assert_eq!(token.len(), 64, "32 random bytes, hex");
    // Never regenerated: further reconciles of both controllers keep it.
    e.reconcile_pool().await;
    merged_ready_on_v1(&e).await;
    assert_eq!(support::stored_token(&e.store).unwrap(), token);
    let posts = e
        .store
        .lock()
        .unwrap()
        .writes
        .iter()
        .filter(|(_, p)| p == secret_path)
        .count();
    assert_eq!(posts, 1, "created once");

    // Mounted read-only in the dynamic and the merged pods; the WorkerConfigs name the file.
    for (deploy, cm) in [
        (DEPLOY.to_string(), CM.to_string()),
        (MERGED.to_string(), cm_path(&e.merged_config_name())),
    ] {
        let d = e.get(&deploy).unwrap();
        let pod = &d["spec"]["template"]["spec"];
        let vol = pod["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["secret"]["secretName"] == "vl-operator-token")
            .unwrap_or_else(|| panic!("{deploy} mounts the token"));
        let mount = pod["containers"][0]["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["name"] == vol["name"])
            .unwrap();
        assert_eq!(mount["readOnly"], true);
        let wc: mole_crds::WorkerConfig =
            serde_json::from_str(e.get(&cm).unwrap()["data"]["worker.json"].as_str().unwrap())
                .unwrap();
        let file = wc.auth.unwrap().operator_token_file.unwrap();
        assert_eq!(
            file,
            format!("{}/token", mount["mountPath"].as_str().unwrap())
        );
    }
    // The fake worker refuses calls without the token: the operator sent it on every one
    // (lora_adapters to decide readiness, reload), which is how calendar became Ready.
    assert_eq!(e.unauthorized(), 0);
    assert!(!e.worker.calls.lock().unwrap().is_empty());

    // A wrong token is refused (the fake checks).
    let r = reqwest::Client::new()
        .get(format!("http://{}/v1/lora_adapters", e.worker.addr))
        .bearer_auth("nope")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
}

#[tokio::test]
async fn reload_is_retried_until_the_pod_has_the_refreshed_file() {
    let e = env().await;
    e.store.lock().unwrap().create(POOL, pool_obj());
    e.add_ready_pod();
    e.reconcile_pool().await;
    e.store.lock().unwrap().create(
        &adapter_path("calendar"),
        adapter_obj("calendar", "vl", "calendar"),
    );
    e.reconcile_adapter("calendar").await;
    let action = e.reconcile_pool().await;
    let cm = e.get(CM).unwrap();
    let hash = cm["metadata"]["annotations"]["mole.dev/config-hash"]
        .as_str()
        .unwrap()
        .to_string();
    let wc: mole_crds::WorkerConfig =
        serde_json::from_str(cm["data"]["worker.json"].as_str().unwrap()).unwrap();
    assert_eq!(
        hash,
        wc.content_hash(),
        "the annotation is the worker's content hash"
    );
    // The kubelet has not refreshed the file: 409 config_stale, retried soon, no error.
    assert!(e.worker.applied.lock().unwrap().is_empty());
    assert_eq!(action, Action::requeue(pool::RELOAD_RETRY));
    let errors = e
        .ctx
        .metrics
        .errors
        .with_label_values(&["pool", "pod_unreachable"])
        .get();
    assert_eq!(errors, 0);
    // Still stale on the next pass: asked again.
    let reloads = |e: &Env| {
        e.worker
            .calls
            .lock()
            .unwrap()
            .iter()
            .filter(|(p, b)| p == "/admin/reload" && b["configHash"] == json!(hash))
            .count()
    };
    let before = reloads(&e);
    assert_eq!(
        e.reconcile_pool().await,
        Action::requeue(pool::RELOAD_RETRY)
    );
    assert_eq!(reloads(&e), before + 1);
    // The file is refreshed: the pod accepts the hash and the fast retries stop.
    e.refresh_config_file();
    let action = e.reconcile_pool().await;
    assert_eq!(*e.worker.applied.lock().unwrap(), vec![hash.clone()]);
    assert_ne!(action, Action::requeue(pool::RELOAD_RETRY));
    // A pod that accepted the current hash is not asked again.
    let n = reloads(&e);
    e.reconcile_pool().await;
    assert_eq!(reloads(&e), n);
    assert_eq!(e.unauthorized(), 0);
}

#[tokio::test]
async fn old_pods_ready_during_a_roll_do_not_make_the_new_version_ready() {
    let e = merged_env().await;
    merged_ready_on_v1(&e).await;
    let v1_out = e.merged_output();
    e.set_version("v2");
    e.reconcile_adapter("calendar").await;
    drop_finished_jobs(&e);
    e.finish_only_job(true, "");
    e.reconcile_adapter("calendar").await;
    let v2_out = e.merged_output();
    assert_ne!(v2_out, v1_out, "the Deployment rolls to v2");
    // The Deployment controller has not even seen the new template: the old status says
    // 1/1 ready, but that is v1.
    e.reconcile_adapter("calendar").await;
    let a = e.get(&adapter_path("calendar")).unwrap();
    assert_ne!(a["status"]["phase"], "Ready");
    assert_eq!(a["status"]["activeVersion"], "v1");
    // Rolling: the old pod is ready, the new one is not.
    e.merged_rolling();
    e.reconcile_adapter("calendar").await;
    let a = e.get(&adapter_path("calendar")).unwrap();
    assert_ne!(
        a["status"]["phase"], "Ready",
        "old pods ready, new ones not"
    );
    assert_eq!(a["status"]["activeVersion"], "v1");
    assert_eq!(
        a["status"]["mergedEndpoint"], "http://vl-calendar.ml.svc:8000",
        "the old pods keep answering behind the Service"
    );
    // Done rolling.
    e.merged_ready();
    e.reconcile_adapter("calendar").await;
    let a = e.get(&adapter_path("calendar")).unwrap();
    assert_eq!(a["status"]["phase"], "Ready");
    assert_eq!(a["status"]["activeVersion"], "v2");
}

#[tokio::test]
async fn merged_to_dynamic_with_unload_from_dynamic_does_not_deadlock() {
    let e = merged_env().await;
    e.edit(POOL, |p| {
        p["spec"]["merge"] = json!({"unloadFromDynamic": true})
    });
    e.reconcile_pool().await;
    merged_ready_on_v1(&e).await;
    // Merged pods serve it: the dynamic pods drop it and forward.
    e.reconcile_pool().await;
    let config = |e: &Env| -> mole_crds::WorkerAdapter {
        let wc: mole_crds::WorkerConfig =
            serde_json::from_str(e.get(CM).unwrap()["data"]["worker.json"].as_str().unwrap())
                .unwrap();
        wc.adapters
            .into_iter()
            .find(|a| a.name == "calendar")
            .unwrap()
    };
    let cal = config(&e);
    assert!(!cal.load);
    assert_eq!(
        cal.merged_endpoint.as_deref(),
        Some("http://vl-calendar.ml.svc:8000")
    );
    e.worker_reports(&[]);

    // Switch back to dynamic: the dynamic pods must load it again before the merged pods go.
    e.edit(&adapter_path("calendar"), |a| {
        a["spec"]["serving"]["mode"] = json!("dynamic")
    });
    e.reconcile_adapter("calendar").await;
    e.reconcile_pool().await;
    let cal = config(&e);
    assert!(cal.load, "the plan asks the dynamic pods to load it again");
    assert_eq!(
        cal.merged_endpoint.as_deref(),
        Some("http://vl-calendar.ml.svc:8000"),
        "merged pods keep serving until then"
    );
    assert!(e.get(MERGED).is_some());
    // The dynamic pods load it (they read load=true): the merged pods go.
    e.worker_reports(&[("calendar", "v1", 1)]);
    e.reconcile_adapter("calendar").await;
    assert!(e.get(MERGED).is_none());
    assert!(
        e.merged_config_maps().is_empty(),
        "merged ConfigMaps removed too"
    );
    assert_eq!(e.count_events("MergedPodsRemoved"), 1);
    e.reconcile_pool().await;
    let cal = config(&e);
    assert!(cal.load);
    assert_eq!(cal.merged_endpoint, None);
    let a = e.get(&adapter_path("calendar")).unwrap();
    assert_eq!(a["status"]["servingMode"], "dynamic");
    assert_eq!(a["status"]["phase"], "Ready");
}

#[tokio::test]
async fn each_output_has_its_own_config_map_and_old_ones_go_with_the_history() {
    let e = merged_env().await;
    e.edit(POOL, |p| p["spec"]["merge"] = json!({"keepVersions": 0}));
    merged_ready_on_v1(&e).await;
    let v1_cm = e.merged_config_name();
    let v1_content = e.get(&cm_path(&v1_cm)).unwrap()["data"].clone();
    assert!(v1_content["worker.json"]
        .as_str()
        .unwrap()
        .contains(&e.merged_output()));

    e.set_version("v2");
    e.reconcile_adapter("calendar").await;
    drop_finished_jobs(&e);
    e.finish_only_job(true, "");
    e.reconcile_adapter("calendar").await;
    // The Deployment now mounts v2's ConfigMap; v1's is untouched for the old pods.
    let v2_cm = e.merged_config_name();
    assert_ne!(v2_cm, v1_cm);
    assert_eq!(
        e.get(&cm_path(&v1_cm)).unwrap()["data"],
        v1_content,
        "old pods keep reading the config of their own output"
    );
    assert!(e.get(&cm_path(&v2_cm)).unwrap()["data"]["worker.json"]
        .as_str()
        .unwrap()
        .contains(&e.merged_output()));
    assert_eq!(
        e.get(&cm_path(&v2_cm)).unwrap()["metadata"]["ownerReferences"][0]["kind"],
        "Adapter"
    );
    // Once v2 serves and v1 fell out of the history (keepVersions 0), v1's ConfigMap goes.
    e.merged_ready();
    e.reconcile_adapter("calendar").await;
    e.reconcile_adapter("calendar").await;
    assert_eq!(e.merged_config_maps(), vec![v2_cm]);
}

#[tokio::test]
async fn rollback_after_the_new_version_served_switches_the_deployment_back_without_a_job() {
    let e = merged_env().await;
    merged_ready_on_v1(&e).await;
    let v1_out = e.merged_output();
    let v1_cm = e.merged_config_name();
    e.set_version("v2");
    e.reconcile_adapter("calendar").await;
    drop_finished_jobs(&e);
    e.finish_only_job(true, "");
    e.reconcile_adapter("calendar").await;
    e.merged_ready();
    e.reconcile_adapter("calendar").await;
    let a = e.get(&adapter_path("calendar")).unwrap();
    assert_eq!(a["status"]["activeVersion"], "v2");
    assert_eq!(a["status"]["phase"], "Ready");
    let v2_out = e.merged_output();
    drop_finished_jobs(&e);

    // kubectl patch ... version v1: the Deployment goes back to v1's output, no Job.
    e.set_version("v1");
    e.reconcile_adapter("calendar").await;
    assert!(e.jobs().is_empty(), "no merge for a version in history");
    assert_eq!(e.merged_output(), v1_out);
    assert_eq!(e.merged_config_name(), v1_cm, "v1's own ConfigMap again");
    assert_eq!(e.count_events("RolledBack"), 1);
    // While the pods roll back, v2 still answers: not Ready on v1 yet, and no second Event.
    e.merged_rolling();
    e.reconcile_adapter("calendar").await;
    e.reconcile_adapter("calendar").await;
    assert_eq!(
        e.count_events("RolledBack"),
        1,
        "announced once, on the switch"
    );
    assert_ne!(
        e.get(&adapter_path("calendar")).unwrap()["status"]["phase"],
        "Ready"
    );
    e.merged_ready();
    e.reconcile_adapter("calendar").await;
    let a = e.get(&adapter_path("calendar")).unwrap();
    assert_eq!(a["status"]["phase"], "Ready");
    assert_eq!(a["status"]["activeVersion"], "v1");
    assert_eq!(a["status"]["history"][0]["version"], "v1");
    assert_eq!(a["status"]["history"][1]["mergedOutput"], json!(v2_out));
    assert!(e.jobs().is_empty());
}

#[tokio::test]
async fn a_restarted_operator_writes_nothing_for_a_serving_merged_adapter() {
    let e = merged_env().await;
    e.reconcile_pool().await;
    merged_ready_on_v1(&e).await;
    e.refresh_config_file();
    e.reconcile_pool().await;
    // Settle: one more pass of each.
    e.reconcile_adapter("calendar").await;
    e.reconcile_pool().await;
    let writes = e.writes();
    let events = e.events().len();
    let restarted = e.operator_context("test-2");
    e.sync();
    for _ in 0..2 {
        e.sync();
        pool::reconcile(e.pool(), restarted.clone()).await.unwrap();
        e.sync();
        adapter::reconcile(e.adapter("calendar").unwrap(), restarted.clone())
            .await
            .unwrap();
    }
    let new_writes = e.store.lock().unwrap().writes[writes..].to_vec();
    assert_eq!(new_writes, [], "a restarted operator writes nothing");
    assert_eq!(e.events().len(), events, "and publishes no Event");
}

#[tokio::test]
async fn adapters_refused_because_of_other_objects_are_checked_again() {
    let e = env().await;
    e.store.lock().unwrap().create(POOL, pool_obj());
    e.store.lock().unwrap().create(
        &adapter_path("calendar"),
        adapter_obj("calendar", "vl", "calendar"),
    );
    e.store
        .lock()
        .unwrap()
        .create(&adapter_path("copy"), adapter_obj("copy", "vl", "calendar"));
    e.store.lock().unwrap().create(
        &adapter_path("orphan"),
        adapter_obj("orphan", "nope", "orphan"),
    );
    let mut bad = adapter_obj("bad", "vl", "bad");
    bad["spec"]["source"]["path"] = json!("../etc");
    e.store.lock().unwrap().create(&adapter_path("bad"), bad);
    let mut actions = std::collections::BTreeMap::new();
    for n in ["calendar", "copy", "orphan", "bad"] {
        for _ in 0..2 {
            let a = e.adapter(n).unwrap();
            e.sync();
            actions.insert(n, adapter::reconcile(a, e.ctx.clone()).await.unwrap());
        }
    }
    assert_eq!(actions["copy"], Action::requeue(adapter::RECHECK_OTHERS));
    assert_eq!(actions["orphan"], Action::requeue(adapter::RECHECK_OTHERS));
    assert_eq!(
        actions["bad"],
        Action::await_change(),
        "a wrong field waits for an edit"
    );
    // The adapter holding the label goes: the copy, checked again, is accepted.
    e.store
        .lock()
        .unwrap()
        .objects
        .remove(&adapter_path("calendar"));
    e.reconcile_adapter("copy").await;
    let copy = e.get(&adapter_path("copy")).unwrap();
    assert_eq!(condition(&copy, "Valid")["status"], "True");
    assert!(copy["status"]["loraId"].is_number());
}

#[tokio::test]
async fn transient_errors_publish_a_warning_event() {
    let e = env().await;
    e.store.lock().unwrap().create(POOL, pool_obj());
    e.store
        .lock()
        .unwrap()
        .failing
        .push("/apis/apps/v1/namespaces/ml/deployments".into());
    e.sync();
    let err = pool::reconcile(e.pool(), e.ctx.clone()).await.unwrap_err();
    assert_eq!(err.code(), "kube_api");
    let notes = e.store.lock().unwrap().event_notes.clone();
    let (reason, note) = notes.last().unwrap();
    assert_eq!(reason, "ReconcileError");
    assert!(note.starts_with("kube_api"), "{note}");
    e.store.lock().unwrap().create(
        &adapter_path("calendar"),
        adapter_obj("calendar", "vl", "calendar"),
    );
    e.sync();
    // The failing pool still gives the new Adapter its id (its failure's status write
    // carries the ledger).
    assert!(pool::reconcile(e.pool(), e.ctx.clone()).await.is_err());
    assert_eq!(e.get(POOL).unwrap()["status"]["loraIds"]["calendar"], 1);
    e.sync();
    // The first pass adds the finalizer and goes on serving from the object it wrote.
    assert!(
        adapter::reconcile(e.adapter("calendar").unwrap(), e.ctx.clone())
            .await
            .is_err()
    );
    assert_eq!(
        e.get(&adapter_path("calendar")).unwrap()["metadata"]["finalizers"],
        json!(["mole.dev/adapter-cleanup"])
    );
    // The pool's second failure repeats its Event (a series, not a new one).
    assert_eq!(e.count_events("ReconcileError"), 2);
}

#[tokio::test]
async fn pool_status_lists_its_merged_deployments() {
    let e = merged_env().await;
    merged_ready_on_v1(&e).await;
    e.reconcile_pool().await;
    let p = e.get(POOL).unwrap();
    assert_eq!(
        p["status"]["merged"],
        json!([{"adapter": "calendar", "version": "v1", "replicas": 1, "readyReplicas": 1,
                "endpoint": "http://vl-calendar.ml.svc:8000"}])
    );
}

/// Issue 25, item 1: an Adapter named `dynamic` would have `<pool>-dynamic`, the pool's GPU
/// Deployment, as its merged Deployment; dynamic or merged, it is refused naming the field and
/// the pool's children are never touched.
#[tokio::test]
async fn an_adapter_named_like_a_pool_child_is_refused_and_the_pool_is_untouched() {
    for mode in ["dynamic", "merged"] {
        let e = env().await;
        e.store.lock().unwrap().create(POOL, pool_obj());
        e.add_ready_pod();
        e.reconcile_pool().await;
        let before = e.get(DEPLOY).unwrap();
        let mut a = adapter_obj("dynamic", "vl", "dynamic");
        a["spec"]["serving"] = json!({"mode": mode, "replicas": 1});
        e.store.lock().unwrap().create(&adapter_path("dynamic"), a);
        // The pods even report it: a dynamic adapter that is loaded is what made the operator
        // remove "its merged pods", i.e. the pool's Deployment.
        e.worker_reports(&[("dynamic", "v1", 1)]);
        for _ in 0..2 {
            e.reconcile_adapter("dynamic").await;
            e.reconcile_pool().await;
        }
        let a = e.get(&adapter_path("dynamic")).unwrap();
        assert_eq!(a["status"]["phase"], "Failed", "{mode}");
        let valid = condition(&a, "Valid");
        assert_eq!(valid["status"], "False");
        assert_eq!(valid["reason"], "InvalidSpec");
        let msg = valid["message"].as_str().unwrap();
        assert!(
            msg.starts_with("metadata.name") && msg.contains("\"vl-dynamic\""),
            "{msg}"
        );
        assert!(e.events().contains(&"InvalidSpec".to_string()));
        let deletes: Vec<_> = e
            .store
            .lock()
            .unwrap()
            .writes
            .iter()
            .filter(|(verb, _)| verb == "DELETE")
            .cloned()
            .collect();
        assert_eq!(deletes, vec![], "{mode}: nothing deleted");
        assert_eq!(
            e.get(DEPLOY).unwrap(),
            before,
            "{mode}: the pool's Deployment untouched"
        );
        assert!(e.jobs().is_empty(), "{mode}: no merge Job");
        let wc: mole_crds::WorkerConfig =
            serde_json::from_str(e.get(CM).unwrap()["data"]["worker.json"].as_str().unwrap())
                .unwrap();
        assert!(wc.adapters.is_empty(), "not registered in the pool");
    }
}

/// Issue 25, item 1: `<pool>-<adapter>` names the merged Service, a DNS-1035 label of at most
/// 63 characters: a longer combination is refused saying so, before any merge.
#[tokio::test]
async fn a_merged_name_over_63_characters_is_refused_naming_the_limit() {
    let e = env().await;
    e.store.lock().unwrap().create(POOL, pool_obj());
    let name = "a".repeat(61); // vl- + 61 = 64
    let mut a = adapter_obj(&name, "vl", "long");
    a["spec"]["serving"] = json!({"mode": "merged", "replicas": 1});
    e.store.lock().unwrap().create(&adapter_path(&name), a);
    e.reconcile_adapter(&name).await;
    let a = e.get(&adapter_path(&name)).unwrap();
    let msg = condition(&a, "Valid")["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        msg.starts_with("metadata.name") && msg.contains("limit of 63"),
        "{msg}"
    );
    assert!(e.jobs().is_empty());
}

/// Issue 25, item 1: what validation cannot see (pool `vl` + adapter `x-dynamic` and pool
/// `vl-x` both name `vl-x-dynamic`) is still never deleted: the adapter removes only merged
/// children it owns.
#[tokio::test]
async fn an_adapter_never_deletes_a_same_named_object_it_does_not_own() {
    let e = env().await;
    e.store.lock().unwrap().create(POOL, pool_obj());
    let other = "/apis/mole.dev/v1alpha1/namespaces/ml/inferencepools/vl-x";
    let mut p = pool_obj();
    p["metadata"]["name"] = json!("vl-x");
    e.store.lock().unwrap().create(other, p);
    let other_pool: Arc<InferencePool> =
        Arc::new(serde_json::from_value(e.get(other).unwrap()).unwrap());
    e.sync();
    pool::reconcile(other_pool, e.ctx.clone()).await.unwrap();
    let theirs = "/apis/apps/v1/namespaces/ml/deployments/vl-x-dynamic";
    let before = e.get(theirs).unwrap();
    e.add_ready_pod();
    e.store.lock().unwrap().create(
        &adapter_path("x-dynamic"),
        adapter_obj("x-dynamic", "vl", "x"),
    );
    e.worker_reports(&[("x-dynamic", "v1", 1)]);
    e.reconcile_pool().await;
    for _ in 0..2 {
        e.reconcile_adapter("x-dynamic").await;
    }
    assert_eq!(
        e.get(theirs).unwrap(),
        before,
        "the other pool's Deployment untouched"
    );
    assert_eq!(
        e.get(&adapter_path("x-dynamic")).unwrap()["status"]["phase"],
        "Ready"
    );
}

/// Issue 25, item 4: a GPU pool's Deployment replaces pods in place by default (a full node
/// pool has no GPU for a surge pod), `spec.rollout` overrides it, and a rollout that would
/// take every pod down is refused naming the field, leaving the running Deployment as it was.
#[tokio::test]
async fn gpu_pools_roll_without_a_surge_pod_and_rollouts_are_validated() {
    let e = env().await;
    let mut p = pool_obj();
    p["spec"]["dynamic"]["replicas"] = json!(3);
    e.store.lock().unwrap().create(POOL, p);
    e.reconcile_pool().await;
    let ru = |e: &Env| e.get(DEPLOY).unwrap()["spec"]["strategy"]["rollingUpdate"].clone();
    assert_eq!(ru(&e), json!({"maxSurge": 0, "maxUnavailable": 1}));

    e.edit(POOL, |p| {
        p["spec"]["rollout"] = json!({"maxSurge": "34%", "maxUnavailable": 0});
        p["metadata"]["generation"] = json!(2);
    });
    e.reconcile_pool().await;
    assert_eq!(ru(&e), json!({"maxSurge": "34%", "maxUnavailable": 0}));

    e.edit(POOL, |p| {
        p["spec"]["rollout"] = json!({"maxUnavailable": "100%"});
        p["metadata"]["generation"] = json!(3);
    });
    e.reconcile_pool().await;
    let pool = e.get(POOL).unwrap();
    let valid = condition(&pool, "Valid");
    assert_eq!(valid["status"], "False");
    let msg = valid["message"].as_str().unwrap();
    assert!(
        msg.starts_with("spec.rollout.maxUnavailable") && msg.contains("3 of 3"),
        "{msg}"
    );
    assert_eq!(
        ru(&e),
        json!({"maxSurge": "34%", "maxUnavailable": 0}),
        "the refused spec is not applied"
    );
}

#[tokio::test]
async fn a_crash_looping_worker_puts_its_reason_in_the_pools_ready_condition() {
    let e = env().await;
    e.store.lock().unwrap().create(POOL, pool_obj());
    // The worker refuses the model and exits; the kubelet keeps its last log line.
    let pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "vl-dynamic-abc", "namespace": "ml",
                     "labels": {"app.kubernetes.io/instance": "vl", "app.kubernetes.io/component": "dynamic"}},
        "status": {"containerStatuses": [{"name": "worker", "image": "i", "imageID": "",
            "ready": false, "restartCount": 4,
            "state": {"waiting": {"reason": "CrashLoopBackOff"}},
            "lastState": {"terminated": {"exitCode": 1,
                "message": "Error: model refused (missing_weights): model.safetensors not found"}}}]}
    });
    e.store
        .lock()
        .unwrap()
        .create("/api/v1/namespaces/ml/pods/vl-dynamic-abc", pod);
    e.reconcile_pool().await;
    let p = e.get(POOL).unwrap();
    let ready = condition(&p, "Ready");
    assert_eq!(ready["status"], "False");
    assert_eq!(ready["reason"], "PodsFailing");
    assert!(
        ready["message"]
            .as_str()
            .unwrap()
            .ends_with("vl-dynamic-abc: worker CrashLoopBackOff: Error: model refused (missing_weights): model.safetensors not found"),
        "{ready}"
    );
    let notes = e.store.lock().unwrap().event_notes.clone();
    assert!(
        notes
            .iter()
            .any(|(r, n)| r == "PodsFailing" && n.contains("missing_weights")),
        "{notes:?}"
    );
}

/// Reloads of the config that a pod refuses (anything but 409 `config_stale`) are issue 25's
/// "retried forever without a condition": now a condition naming the pod and the worker's
/// code, one Warning Event, a backoff instead of a retry every 5 s, and a success clears it.
#[tokio::test]
async fn a_refused_reload_is_a_condition_an_event_and_a_backoff_and_a_success_clears_it() {
    use std::time::Duration;
    let mut e = env().await;
    e.ctx = Arc::new(
        e.bare_context("test")
            .with_reload_backoff(Duration::from_millis(400), Duration::from_secs(2))
            .with_pod_freshness(std::time::Duration::ZERO)
            .with_stores(e.stores.clone()),
    );
    e.store.lock().unwrap().create(POOL, pool_obj());
    e.add_ready_pod();
    *e.worker.reload_error.lock().unwrap() = Some((
        422,
        json!({"error": {"message": "router.classifierAdapter names no adapter of the config",
                         "type": "invalid_request_error", "code": "config_invalid"}}),
    ));
    let reloads = |e: &Env| {
        e.worker
            .calls
            .lock()
            .unwrap()
            .iter()
            .filter(|(p, _)| p == "/admin/reload")
            .count()
    };
    let action = e.reconcile_pool().await;
    assert_eq!(reloads(&e), 1);
    let p = e.get(POOL).unwrap();
    let synced = condition(&p, "AdaptersSynced");
    assert_eq!(synced["status"], "False");
    assert_eq!(synced["reason"], "ReloadFailed");
    let msg = synced["message"].as_str().unwrap();
    assert!(
        msg.starts_with("vl-dynamic-abc (config_invalid): /admin/reload answered 422")
            && msg.contains("router.classifierAdapter names no adapter"),
        "{msg}"
    );
    assert_eq!(e.count_events("ReloadFailed"), 1);
    let notes = e.store.lock().unwrap().event_notes.clone();
    assert!(notes
        .iter()
        .any(|(r, n)| r == "ReloadFailed" && n.contains("config_invalid")));
    // Not the 5 s retry of a stale file: the backoff.
    assert_ne!(action, Action::requeue(pool::RELOAD_RETRY));
    assert_ne!(action, Action::requeue(Duration::from_secs(15)));
    // Within the backoff the pod is not asked again, and nothing new is announced.
    e.reconcile_pool().await;
    assert_eq!(reloads(&e), 1, "asked again within its backoff");
    // Once it ran out: asked again, still refusing; the backoff doubles; no second Event.
    tokio::time::sleep(Duration::from_millis(450)).await;
    e.reconcile_pool().await;
    assert_eq!(reloads(&e), 2);
    tokio::time::sleep(Duration::from_millis(450)).await;
    e.reconcile_pool().await;
    assert_eq!(reloads(&e), 2, "the second delay is twice the first");
    assert_eq!(e.count_events("ReloadFailed"), 1);
    // The worker accepts the config: the condition clears, with a Normal Event.
    *e.worker.reload_error.lock().unwrap() = None;
    e.refresh_config_file();
    tokio::time::sleep(Duration::from_millis(400)).await;
    e.reconcile_pool().await;
    assert_eq!(reloads(&e), 3);
    assert_eq!(e.worker.applied.lock().unwrap().len(), 1);
    let p = e.get(POOL).unwrap();
    let synced = condition(&p, "AdaptersSynced");
    assert_eq!(
        (synced["status"].as_str(), synced["reason"].as_str()),
        (Some("True"), Some("ConfigApplied")),
        "{synced}"
    );
    assert_eq!(e.count_events("ConfigApplied"), 1);
    // No reconcile failed on the way: a refusing pod is reported, not an API error.
    let errors = e
        .ctx
        .metrics
        .errors
        .with_label_values(&["pool", "pod_unreachable"])
        .get();
    assert_eq!(errors, 0);
}

#[tokio::test]
async fn a_ready_pod_that_does_not_answer_reloads_is_named_in_the_condition() {
    let e = env().await;
    e.store.lock().unwrap().create(POOL, pool_obj());
    // Ready, but nothing listens at its address (the fake worker is on 127.0.0.1 only).
    let pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "vl-dynamic-gone", "namespace": "ml",
                     "labels": {"app.kubernetes.io/instance": "vl", "app.kubernetes.io/component": "dynamic"}},
        "status": {"podIP": "127.0.0.2", "conditions": [{"type": "Ready", "status": "True"}]}
    });
    e.store
        .lock()
        .unwrap()
        .create("/api/v1/namespaces/ml/pods/vl-dynamic-gone", pod);
    e.reconcile_pool().await;
    let p = e.get(POOL).unwrap();
    let synced = condition(&p, "AdaptersSynced");
    assert_eq!(synced["reason"], "ReloadFailed");
    assert!(
        synced["message"]
            .as_str()
            .unwrap()
            .starts_with("vl-dynamic-gone (pod_unreachable): "),
        "{synced}"
    );
    assert_eq!(e.count_events("ReloadFailed"), 1);
}

/// What the controllers' watches ask: every watched kind is listed and watched (the runtime,
/// not a reconcile, makes these calls), each granted by the chart. Pods too: a pool's dynamic
/// pod turning ready reconciles the pool at once (its address joins the WorkerConfig's
/// `peers`), not at the next requeue.
#[tokio::test]
async fn the_controllers_list_and_watch_what_they_own_and_the_chart_grants_it() {
    let e = env().await;
    e.store.lock().unwrap().create(POOL, pool_obj());
    // `run` feeds its own stores into the context it is given.
    let ctx = e.bare_context("test");
    let run = mole_operator::controller::run(
        support::client(e.store.clone()),
        Some("ml".into()),
        ctx,
        std::future::pending::<()>(),
    );
    let watched: Vec<support::Access> = [
        ("mole.dev", "inferencepools"),
        ("mole.dev", "adapters"),
        ("", "configmaps"),
        ("apps", "deployments"),
        ("", "services"),
        ("policy", "poddisruptionbudgets"),
        ("autoscaling", "horizontalpodautoscalers"),
        ("batch", "jobs"),
        ("", "pods"),
    ]
    .iter()
    .flat_map(|(g, r)| ["list", "watch"].map(|v| (g.to_string(), r.to_string(), v.to_string())))
    .collect();
    // The controllers run until every watch was asked for (the fake API server answers a
    // watch with a list, which ends it; the watcher asks again after a backoff).
    let all_asked = async {
        while !watched.iter().all(|a| support::rbac_used().contains(a)) || e.get(DEPLOY).is_none() {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    };
    let asked = tokio::select! {
        _ = run => false,
        r = tokio::time::timeout(std::time::Duration::from_secs(20), all_asked) => r.is_ok(),
    };
    let used = support::rbac_used();
    assert!(asked, "not every watch was asked for: {used:?}");
    assert_eq!(support::rbac_denied(), Vec::<support::Access>::new());
    assert!(
        e.get(DEPLOY).is_some(),
        "the runtime reconciled the pool it listed"
    );
}

/// Leader election asks for its Lease: read, created once, renewed by update.
#[tokio::test]
async fn leader_election_reads_creates_and_renews_its_lease_as_the_chart_grants() {
    use mole_operator::leader::{try_acquire, LeaseConfig, Observer};
    let store: Shared = Arc::new(Mutex::new(Store::default()));
    let api: kube::Api<k8s_openapi::api::coordination::v1::Lease> =
        kube::Api::namespaced(support::client(store.clone()), "ml");
    let cfg = LeaseConfig::with_duration(
        "mole-operator-leader".into(),
        "ml".into(),
        "pod-a".into(),
        std::time::Duration::from_secs(15),
    );
    let mut obs = Observer::default();
    assert!(try_acquire(&api, &cfg, &mut obs).await.unwrap(), "created");
    assert!(try_acquire(&api, &cfg, &mut obs).await.unwrap(), "renewed");
    let used = support::rbac_used();
    for verb in ["get", "create", "update"] {
        let a = ("coordination.k8s.io".into(), "leases".into(), verb.into());
        assert!(used.contains(&a), "{a:?} not asked: {used:?}");
    }
    assert_eq!(support::rbac_denied(), Vec::<support::Access>::new());
}

/// Scenarios that together make every kind of call the operator makes. Each runs on this
/// thread, so the fake API server's record of what they asked ([`support::rbac_used`]) is
/// theirs alone. A scenario that exercises a new call (a new verb or resource in the chart)
/// goes here.
const RBAC_SCENARIOS: &[(&str, fn())] = &[
    (
        "create_pool",
        create_pool_applies_children_and_status_and_a_restart_changes_nothing,
    ),
    (
        "adapter_registers",
        adapter_registers_and_is_ready_only_when_the_pods_report_it,
    ),
    (
        "delete_finalizer",
        delete_runs_the_finalizer_and_ids_are_never_reused,
    ),
    (
        "merge",
        merge_job_then_merged_deployment_then_ready_and_forwarded,
    ),
    (
        "merged_to_dynamic",
        switching_merged_to_dynamic_removes_merged_pods_once_dynamic_pods_serve_it,
    ),
    (
        "cleanup_jobs",
        deleted_children_come_back_and_old_outputs_get_a_cleanup_job,
    ),
    (
        "failed_merge",
        failed_version_bump_keeps_the_old_version_serving_and_rollback_needs_no_job,
    ),
    (
        "quantized_merge",
        quantized_merge_is_served_and_its_drift_refusal_is_reported,
    ),
    (
        "failed_merge_retried",
        a_failing_merge_backs_off_and_gives_up_even_when_the_watch_lags,
    ),
    ("drift", children_edited_by_hand_are_put_back),
    (
        "config_maps_per_output",
        each_output_has_its_own_config_map_and_old_ones_go_with_the_history,
    ),
    (
        "repeated_events",
        a_refused_reload_is_a_condition_an_event_and_a_backoff_and_a_success_clears_it,
    ),
    (
        "watches",
        the_controllers_list_and_watch_what_they_own_and_the_chart_grants_it,
    ),
    (
        "leader",
        leader_election_reads_creates_and_renews_its_lease_as_the_chart_grants,
    ),
    (
        "autoscaling",
        an_autoscaled_pool_gets_an_hpa_and_leaves_it_the_replicas,
    ),
    (
        "autoscaling_handover",
        turning_autoscaling_on_hands_the_count_over_first,
    ),
];

/// Issue 25 item 7: "a test compares the RBAC rules with the API calls the code makes". Every
/// scenario already fails on a call the chart does not grant (403); this fails on the other
/// side: a verb the chart grants that none of [`RBAC_SCENARIOS`] asks for is more than the
/// operator needs (remove it from `charts/mole/templates/rbac.yaml`, or add the scenario that
/// needs it).
#[test]
fn the_chart_grants_nothing_the_scenarios_do_not_use() {
    for (name, scenario) in RBAC_SCENARIOS {
        eprintln!("scenario {name}");
        scenario();
    }
    let used = support::rbac_used();
    let unused: Vec<_> = support::granted().difference(&used).cloned().collect();
    assert!(
        unused.is_empty(),
        "granted by the chart but asked by no scenario: {unused:?}"
    );
    assert_eq!(support::rbac_denied(), Vec::<support::Access>::new());
}

/// A pod with `labels` whose worker container waits (`waiting`: `CrashLoopBackOff`, ...) after
/// it exited with `said` as its termination message.
fn stuck_pod(name: &str, labels: Value, waiting: &str, said: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "ml", "labels": labels},
        "status": {"containerStatuses": [{"name": "worker", "image": "i", "imageID": "",
            "ready": false, "restartCount": 4,
            "state": {"waiting": {"reason": waiting}},
            "lastState": {"terminated": {"exitCode": 1, "message": said}}}]}
    })
}

#[tokio::test]
async fn a_model_that_does_not_fit_is_its_own_reason_not_a_generic_crash() {
    let e = env().await;
    e.store.lock().unwrap().create(POOL, pool_obj());
    let said = "loading base/qwen3-vl-8b on cuda:0\n\
                model_does_not_fit: the weights need 17.9 GiB and the device budget is 14.2 GiB\n";
    e.store.lock().unwrap().create(
        "/api/v1/namespaces/ml/pods/vl-dynamic-abc",
        stuck_pod(
            "vl-dynamic-abc",
            json!({"app.kubernetes.io/instance": "vl", "app.kubernetes.io/component": "dynamic"}),
            "CrashLoopBackOff",
            said,
        ),
    );
    e.reconcile_pool().await;
    let p = e.get(POOL).unwrap();
    let ready = condition(&p, "Ready");
    assert_eq!(ready["status"], "False");
    assert_eq!(ready["reason"], "ModelDoesNotFit");
    assert!(
        ready["message"].as_str().unwrap().ends_with(
            "vl-dynamic-abc: worker CrashLoopBackOff: model_does_not_fit: the weights need 17.9 GiB and the device budget is 14.2 GiB"
        ),
        "{ready}"
    );
    assert_eq!(e.count_events("ModelDoesNotFit"), 1);
    assert_eq!(e.count_events("PodsFailing"), 0);
}

#[tokio::test]
async fn merged_pods_that_cannot_start_say_why_in_the_adapters_ready_condition() {
    let e = merged_env().await;
    e.worker_reports(&[("calendar", "v1", 1)]);
    e.reconcile_adapter("calendar").await;
    e.finish_only_job(true, "");
    e.reconcile_adapter("calendar").await;
    assert!(e.get(MERGED).is_some(), "merged Deployment applied");
    // Its pod is not scheduled: no free GPU.
    let labels = e.get(MERGED).unwrap()["spec"]["selector"]["matchLabels"].clone();
    let mut pod = stuck_pod("vl-calendar-q7", labels, "ContainerCreating", "");
    pod["status"] = json!({"conditions": [{"type": "PodScheduled", "status": "False",
        "reason": "Unschedulable",
        "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."}]});
    e.store
        .lock()
        .unwrap()
        .create("/api/v1/namespaces/ml/pods/vl-calendar-q7", pod);
    // A dynamic pod of the same pool that crashes is not this adapter's merged pod.
    e.store.lock().unwrap().create(
        "/api/v1/namespaces/ml/pods/vl-dynamic-zz",
        stuck_pod(
            "vl-dynamic-zz",
            json!({"app.kubernetes.io/instance": "vl", "app.kubernetes.io/component": "dynamic"}),
            "CrashLoopBackOff",
            "boom",
        ),
    );
    e.reconcile_adapter("calendar").await;
    let a = e.get(&adapter_path("calendar")).unwrap();
    let ready = condition(&a, "Ready");
    assert_eq!(ready["status"], "False");
    assert_eq!(ready["reason"], "PodsFailing");
    let msg = ready["message"].as_str().unwrap();
    assert!(
        msg.ends_with("; merged pod vl-calendar-q7: Unschedulable: 0/4 nodes are available: 4 Insufficient nvidia.com/gpu."),
        "{msg}"
    );
    assert_eq!(e.count_events("PodsFailing"), 1);
    // Seen again: the same condition, no second Event.
    e.reconcile_adapter("calendar").await;
    let again = e.get(&adapter_path("calendar")).unwrap();
    assert_eq!(condition(&again, "Ready")["message"], json!(msg));
    assert_eq!(e.count_events("PodsFailing"), 1);
    // Scheduled and serving: Ready as before.
    e.store
        .lock()
        .unwrap()
        .objects
        .remove("/api/v1/namespaces/ml/pods/vl-calendar-q7");
    e.merged_ready();
    e.reconcile_adapter("calendar").await;
    let a = e.get(&adapter_path("calendar")).unwrap();
    assert_eq!(condition(&a, "Ready")["status"], "True");
    assert_eq!(a["status"]["phase"], "Ready");
}

#[tokio::test]
async fn children_edited_by_hand_are_put_back() {
    let e = env().await;
    e.store.lock().unwrap().create(POOL, pool_obj());
    e.reconcile_pool().await;
    let (svc, pdb) = (e.get(SVC).unwrap(), e.get(PDB).unwrap());
    e.edit(SVC, |s| s["spec"]["ports"][0]["port"] = json!(9999));
    e.edit(PDB, |p| p["spec"]["maxUnavailable"] = json!(3));
    let writes = e.writes();
    e.reconcile_pool().await;
    let applied: Vec<String> = e.store.lock().unwrap().writes[writes..]
        .iter()
        .filter(|(m, _)| m == "APPLY")
        .map(|(_, p)| p.clone())
        .collect();
    assert!(
        applied.contains(&SVC.to_string()) && applied.contains(&PDB.to_string()),
        "{applied:?}"
    );
    assert_eq!(e.get(SVC).unwrap()["spec"], svc["spec"]);
    assert_eq!(e.get(PDB).unwrap()["spec"], pdb["spec"]);
}

// Issue 25 item 2: nothing an adapter starts outlives what it was for.

const MERGED_SVC: &str = "/api/v1/namespaces/ml/services/vl-calendar";
const MERGED_PDB: &str = "/apis/policy/v1/namespaces/ml/poddisruptionbudgets/vl-calendar";

impl Env {
    /// Names of the unfinished Jobs whose name starts with `prefix`.
    fn running_jobs(&self, prefix: &str) -> Vec<String> {
        self.jobs()
            .into_iter()
            .filter(|(_, j)| j["status"]["succeeded"] != 1 && j["status"]["conditions"].is_null())
            .map(|(_, j)| j["metadata"]["name"].as_str().unwrap().to_string())
            .filter(|n| n.starts_with(prefix))
            .collect()
    }
    /// `kubectl delete adapter`: the API server sets deletionTimestamp and waits for the
    /// finalizer.
    fn delete_adapter(&self, name: &str) {
        self.edit(&adapter_path(name), |a| {
            a["metadata"]["deletionTimestamp"] = json!("2026-11-22T12:30:00Z")
        });
    }
    /// The last merge failed long ago: its backoff has run out.
    fn backoff_elapsed(&self) {
        self.edit(&adapter_path("calendar"), |a| {
            a["status"]["merge"]["lastFailureAt"] = json!("2000-01-01T00:00:00Z")
        });
    }
    fn note_of(&self, reason: &str) -> String {
        let notes = self.store.lock().unwrap().event_notes.clone();
        notes
            .into_iter()
            .find(|(r, _)| r == reason)
            .unwrap_or_else(|| panic!("no {reason} Event"))
            .1
    }
}

#[tokio::test]
async fn deleting_the_pool_removes_the_merged_pods_and_merge_jobs_the_adapter_owns() {
    let e = merged_env().await;
    merged_ready_on_v1(&e).await;
    let v1_out = e.merged_output();
    let merged_cm = cm_path(&e.merged_config_name());
    // v2 merges while the pool is deleted.
    e.set_version("v2");
    e.reconcile_adapter("calendar").await;
    let v2_job = e.running_jobs("merge-calendar-");
    assert_eq!(v2_job.len(), 1);
    assert!(e.get(MERGED_SVC).is_some() && e.get(MERGED_PDB).is_some());

    // Kubernetes collects the pool's own children; the adapter's have the Adapter as owner.
    e.store.lock().unwrap().objects.remove(POOL);
    e.reconcile_adapter("calendar").await;
    let a = e.get(&adapter_path("calendar")).unwrap();
    assert_eq!(condition(&a, "Valid")["reason"], "PoolNotFound");
    for (what, path) in [
        ("merged Deployment", MERGED),
        ("merged Service", MERGED_SVC),
        ("merged PDB", MERGED_PDB),
        ("merged ConfigMap", merged_cm.as_str()),
    ] {
        assert!(e.get(path).is_none(), "{what} left behind");
    }
    assert!(
        e.running_jobs("merge-").is_empty(),
        "running merge Job left"
    );
    assert_eq!(e.count_events("PoolChildrenRemoved"), 1, "{:?}", e.events());
    let note = e.note_of("PoolChildrenRemoved");
    assert!(
        note.contains("Deployment/vl-calendar") && note.contains(&format!("Job/{}", v2_job[0])),
        "{note}"
    );
    // The history keeps its outputs: a pool re-created on the volume serves them again.
    assert_eq!(a["status"]["history"][0]["mergedOutput"], json!(v1_out));

    // Deleting the adapter now does not wait for the pool; its outputs are reported left.
    e.delete_adapter("calendar");
    e.reconcile_adapter("calendar").await;
    assert!(e.get(&adapter_path("calendar")).is_none(), "finalizer done");
    assert!(e.note_of("MergedOutputsLeft").contains(&v1_out));
    assert!(e.jobs().iter().all(|(p, _)| !p.contains("/cleanup-")));
}

#[tokio::test]
async fn a_merge_job_of_superseded_inputs_is_deleted() {
    let e = merged_env().await;
    merged_ready_on_v1(&e).await;
    drop_finished_jobs(&e);
    e.set_version("v2");
    e.reconcile_adapter("calendar").await;
    let v2 = e.running_jobs("merge-calendar-");
    assert_eq!(v2.len(), 1);
    // v3 is applied while v2 still merges: v2's Job is deleted, v3's runs.
    e.set_version("v3");
    e.reconcile_adapter("calendar").await;
    let v3 = e.running_jobs("merge-calendar-");
    assert_eq!(v3.len(), 1, "{v3:?}");
    assert_ne!(v3, v2);
    assert!(e
        .store
        .lock()
        .unwrap()
        .writes
        .contains(&("DELETE".into(), format!("{JOBS}/{}", v2[0]))));
    assert_eq!(e.count_events("MergeSuperseded"), 1);
    assert!(e.note_of("MergeSuperseded").contains(&v2[0]));
    assert!(e.merged_output().contains("/v1-"), "v1 keeps serving");
    // Served dynamically again while v3 merges: v3's Job is superseded too.
    e.edit(&adapter_path("calendar"), |a| {
        a["spec"]["serving"]["mode"] = json!("dynamic")
    });
    e.reconcile_adapter("calendar").await;
    assert!(e.running_jobs("merge-").is_empty());
    assert!(e
        .store
        .lock()
        .unwrap()
        .writes
        .contains(&("DELETE".into(), format!("{JOBS}/{}", v3[0]))));
}

#[tokio::test]
async fn deleting_an_adapter_prunes_its_merged_outputs_with_a_job_the_pool_owns() {
    let e = merged_env().await;
    merged_ready_on_v1(&e).await;
    let v1_out = e.merged_output();
    // v2 merges when the adapter is deleted.
    e.set_version("v2");
    e.reconcile_adapter("calendar").await;
    let v2_job = e.running_jobs("merge-calendar-");
    assert_eq!(v2_job.len(), 1);
    let v2_out = e.get(&format!("{JOBS}/{}", v2_job[0])).unwrap()["metadata"]["annotations"]
        ["mole.dev/merge-output"]
        .as_str()
        .unwrap()
        .to_string();

    e.delete_adapter("calendar");
    e.reconcile_adapter("calendar").await;
    assert!(e.get(&adapter_path("calendar")).is_none(), "finalizer done");
    assert!(
        e.running_jobs("merge-").is_empty(),
        "the merge stops before the prune"
    );
    let cleanup: Vec<Value> = e
        .jobs()
        .into_iter()
        .filter(|(p, _)| p.contains("/cleanup-calendar-"))
        .map(|(_, j)| j)
        .collect();
    assert_eq!(cleanup.len(), 1, "one cleanup Job");
    let job = &cleanup[0];
    // The Adapter is gone: the Job must not be collected with it.
    let owners = job["metadata"]["ownerReferences"].as_array().unwrap();
    assert_eq!(owners.len(), 1);
    assert_eq!(owners[0]["kind"], "InferencePool");
    assert_eq!(owners[0]["name"], "vl");
    let args: Vec<String> =
        serde_json::from_value(job["spec"]["template"]["spec"]["containers"][0]["args"].clone())
            .unwrap();
    let mut want = [format!("/models/{v1_out}"), format!("/models/{v2_out}")];
    want.sort();
    assert_eq!(args[..3], ["prune", "--root", "/models/merged/calendar"]);
    assert_eq!(args[3..], want[..]);
    assert!(e.note_of("PruningMergedOutputs").contains(&v1_out));
    assert!(e.events().contains(&"Unregistered".to_string()));
}

#[tokio::test]
async fn a_merge_that_keeps_failing_is_given_up_until_the_version_changes() {
    let e = merged_env().await;
    e.worker_reports(&[("calendar", "v1", 1)]);
    e.reconcile_adapter("calendar").await;
    let why = "merge failed (shape_mismatch): model.layers.0.self_attn.q_proj: lora_B is 8x64, the base expects 96";
    for attempt in 1..=mole_operator::mergedown::MAX_MERGE_ATTEMPTS {
        e.finish_only_job(false, why);
        e.reconcile_adapter("calendar").await;
        assert!(
            e.running_jobs("merge-").is_empty(),
            "attempt {attempt}: the failed Job waits out its backoff"
        );
        e.backoff_elapsed();
        // The counted Job is deleted, then its retry created.
        e.reconcile_adapter("calendar").await;
    }
    // Given up: however long ago the last failure was, no Job comes back.
    e.backoff_elapsed();
    e.reconcile_adapter("calendar").await;
    assert!(e.running_jobs("merge-").is_empty(), "no sixth attempt");
    let a = e.get(&adapter_path("calendar")).unwrap();
    assert_eq!(condition(&a, "Merged")["status"], "False");
    assert_eq!(condition(&a, "Merged")["reason"], "MergeGaveUp");
    assert!(condition(&a, "Merged")["message"]
        .as_str()
        .unwrap()
        .contains("shape_mismatch"));
    assert_eq!(condition(&a, "Degraded")["reason"], "MergeGaveUp");
    assert_eq!(
        a["status"]["phase"], "Degraded",
        "the dynamic pods keep serving it"
    );
    // One MergeFailed Event per failed attempt before the last (each note names its attempt,
    // so none is folded into another's series); the last is MergeGaveUp.
    assert_eq!(
        e.count_events("MergeFailed"),
        mole_operator::mergedown::MAX_MERGE_ATTEMPTS as usize - 1
    );
    assert_eq!(e.count_events("MergeGaveUp"), 1);
    assert!(e.note_of("MergeGaveUp").contains("failed 5 times"));
    // The pool still lists it for the dynamic pods.
    e.reconcile_pool().await;
    let wc: mole_crds::WorkerConfig =
        serde_json::from_str(e.get(CM).unwrap()["data"]["worker.json"].as_str().unwrap()).unwrap();
    assert!(wc.adapters.iter().any(|a| a.name == "calendar" && a.load));

    // A new version is a new merge.
    e.set_version("v2");
    e.reconcile_adapter("calendar").await;
    assert_eq!(e.running_jobs("merge-calendar-").len(), 1);
}

/// The pool and `n` Adapters of it, `a0` to `a{n-1}` (each labelled its name), once the pool
/// has reconciled (given them their ids).
async fn env_with_adapters(n: usize) -> Env {
    let e = env().await;
    e.store.lock().unwrap().create(POOL, pool_obj());
    for i in 0..n {
        let name = format!("a{i}");
        e.store
            .lock()
            .unwrap()
            .create(&adapter_path(&name), adapter_obj(&name, "vl", &name));
    }
    e.reconcile_pool().await;
    e
}

/// Issue 25 item 6: an Adapter reconcile reads its pool and siblings from the controllers'
/// stores, so it costs the same API calls, reading the same objects, with 5 or 500 Adapters
/// in the namespace, and never LISTs Adapters (each of n reconciles listing n Adapters was
/// O(n²)); the pool's reconcile reads its Adapters from the store too.
#[tokio::test]
async fn reconciles_cost_the_same_api_calls_with_5_or_500_adapters() {
    type Calls = Vec<(String, String)>;
    async fn cost(n: usize) -> (Calls, usize, Calls, usize) {
        let e = env_with_adapters(n).await;
        e.add_ready_pod();
        // The pool's reconcile gave every Adapter its id, the oldest first.
        let id = e.get(POOL).unwrap()["status"]["loraIds"]["a0"]
            .as_u64()
            .unwrap();
        e.worker_reports(&[("a0", "v1", id as u32)]);
        // Finalizer, registration: then a steady reconcile of each is measured.
        e.reconcile_adapter("a0").await;
        e.reconcile_pool().await;
        let mark = |e: &Env| {
            let s = e.store.lock().unwrap();
            (s.requests.len(), s.objects_read)
        };
        let since = |e: &Env, (r, o): (usize, usize)| {
            let s = e.store.lock().unwrap();
            (s.requests[r..].to_vec(), s.objects_read - o)
        };
        e.sync();
        let m = mark(&e);
        adapter::reconcile(e.adapter("a0").unwrap(), e.ctx.clone())
            .await
            .unwrap();
        let (adapter_calls, adapter_read) = since(&e, m);
        let m = mark(&e);
        pool::reconcile(e.pool(), e.ctx.clone()).await.unwrap();
        let (pool_calls, pool_read) = since(&e, m);
        let a0 = e.get(&adapter_path("a0")).unwrap();
        assert_eq!(condition(&a0, "Ready")["status"], "True", "{a0}");
        (adapter_calls, adapter_read, pool_calls, pool_read)
    }
    let (a5, read5, p5, pread5) = cost(5).await;
    let (a500, read500, p500, pread500) = cost(500).await;
    let lists_adapters = |c: &Calls| c.iter().any(|(v, r)| v == "list" && r == "adapters");
    assert!(
        !lists_adapters(&a500),
        "an adapter reconcile lists Adapters: {a500:?}"
    );
    assert!(
        !lists_adapters(&p500),
        "a pool reconcile lists Adapters: {p500:?}"
    );
    assert_eq!(a5, a500, "adapter reconcile: the same calls");
    assert_eq!(read5, read500, "adapter reconcile: objects read");
    assert_eq!(p5, p500, "pool reconcile: the same calls");
    assert_eq!(pread5, pread500, "pool reconcile: objects read");
    assert!(!a500.is_empty() && a500.len() < 20, "{a500:?}");
}

/// Issue 55 item 1: a resync of 500 registered Adapters of a pool with 8 ready dynamic pods
/// costs pod calls by the pods, not by adapters × pods (one poll of each pod serves every
/// Adapter reconcile of a round), and API calls by the Adapters that changed, not by every
/// Adapter (their pool, pods, Deployments, Jobs and the pool's token come from caches). On
/// 47abd32+: 4,000 pod calls and 6 API calls per Adapter.
#[tokio::test]
async fn a_resync_of_500_adapters_on_8_pods_costs_calls_by_pods_and_changes() {
    const ADAPTERS: usize = 500;
    const PODS: usize = 8;
    let e = env_with_adapters(ADAPTERS).await;
    for k in 0..PODS {
        let pod = json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": format!("vl-dynamic-{k}"), "namespace": "ml",
                         "labels": {"app.kubernetes.io/instance": "vl", "app.kubernetes.io/component": "dynamic"}},
            "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}
        });
        e.store
            .lock()
            .unwrap()
            .create(&format!("/api/v1/namespaces/ml/pods/vl-dynamic-{k}"), pod);
    }
    // Every adapter loaded on every pod, with the id the pool's reconcile gave it.
    let ledger = e.get(POOL).unwrap()["status"]["loraIds"].clone();
    let reports: Vec<(String, &str, u32)> = (0..ADAPTERS)
        .map(|i| {
            let name = format!("a{i}");
            let id = ledger[&name].as_u64().unwrap() as u32;
            (name, "v1", id)
        })
        .collect();
    let reports: Vec<(&str, &str, u32)> = reports
        .iter()
        .map(|(n, v, id)| (n.as_str(), *v, *id))
        .collect();
    e.worker_reports(&reports);
    // First round: finalizers, registration, Ready.
    for i in 0..ADAPTERS {
        e.reconcile_adapter(&format!("a{i}")).await;
    }
    e.reconcile_pool().await;
    // The measured round: nothing changed since, with the operator's default pod freshness
    // (the scenarios read the pods afresh on every reconcile to see each change at once).
    let ctx = Arc::new(e.bare_context("test").with_stores(e.stores.clone()));
    e.sync();
    let api_before = e.store.lock().unwrap().requests.len();
    let started = std::time::Instant::now();
    let listings = || e.worker.listings.load(std::sync::atomic::Ordering::SeqCst);
    let pod_before = listings();
    for i in 0..ADAPTERS {
        adapter::reconcile(e.adapter(&format!("a{i}")).unwrap(), ctx.clone())
            .await
            .unwrap();
    }
    let api: Vec<(String, String)> = e.store.lock().unwrap().requests[api_before..].to_vec();
    let pod_calls = listings() - pod_before;
    let a = e.get(&adapter_path("a499")).unwrap();
    assert_eq!(condition(&a, "Ready")["status"], "True", "{a}");
    eprintln!(
        "a resync of {ADAPTERS} Adapters on {PODS} pods: {} API calls, {pod_calls} pod calls",
        api.len()
    );
    // One reading of the pods per freshness interval (2 s) the round lasted, whatever the
    // number of Adapters.
    let readings = (started.elapsed().as_secs_f64() / 2.0).ceil() as usize + 1;
    assert!(
        pod_calls <= PODS * readings,
        "{pod_calls} pod calls for a resync of {:?}: by adapters x pods, not by pods",
        started.elapsed()
    );
    assert!(
        api.len() <= 20,
        "{} API calls for a resync of unchanged Adapters: {:?}",
        api.len(),
        &api[..api.len().min(40)]
    );
}

const HPA: &str = "/apis/autoscaling/v2/namespaces/ml/horizontalpodautoscalers/vl-dynamic";

/// Issue 25 item 6: `spec.dynamic.autoscaling` gets an HPA on the workers' queue gauge for
/// the dynamic Deployment, whose `replicas` the operator then leaves alone (the count the HPA
/// set survives reconciles); both `replicas` and `autoscaling` set is refused naming the field;
/// autoscaling turned off removes the HPA and the operator applies the count again.
#[tokio::test]
async fn an_autoscaled_pool_gets_an_hpa_and_leaves_it_the_replicas() {
    let e = env().await;
    let mut obj = pool_obj();
    obj["spec"]["dynamic"] = json!({"autoscaling": {"minReplicas": 1, "maxReplicas": 4}});
    e.store.lock().unwrap().create(POOL, obj.clone());
    e.reconcile_pool().await;
    let hpa = e.get(HPA).expect("an HPA for the dynamic Deployment");
    assert_eq!(
        hpa["spec"]["scaleTargetRef"],
        json!({"apiVersion": "apps/v1", "kind": "Deployment", "name": "vl-dynamic"})
    );
    assert_eq!(
        (&hpa["spec"]["minReplicas"], &hpa["spec"]["maxReplicas"]),
        (&json!(1), &json!(4))
    );
    let metric = &hpa["spec"]["metrics"][0];
    assert_eq!(metric["type"], "Pods");
    assert_eq!(metric["pods"]["metric"]["name"], "mole_requests_waiting");
    assert_eq!(
        metric["pods"]["target"],
        json!({"type": "AverageValue", "averageValue": "4"})
    );
    assert_eq!(
        hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"],
        600
    );
    assert_eq!(
        hpa["metadata"]["ownerReferences"][0]["kind"],
        "InferencePool"
    );
    let deploy = e.get(DEPLOY).unwrap();
    assert!(
        deploy["spec"].get("replicas").is_none(),
        "the operator applies no replicas: {}",
        deploy["spec"]
    );
    // The HPA scales the Deployment to 3; the next reconciles write nothing and keep it.
    {
        let mut s = e.store.lock().unwrap();
        let mut d = s.get(DEPLOY).unwrap();
        d["spec"]["replicas"] = json!(3);
        s.objects.insert(DEPLOY.into(), d);
    }
    let writes = e.writes();
    e.reconcile_pool().await;
    e.reconcile_pool().await;
    let new: Vec<_> = e.store.lock().unwrap().writes[writes..]
        .iter()
        .filter(|(_, p)| !p.ends_with("/status"))
        .cloned()
        .collect();
    assert_eq!(new, [], "nothing but status written");
    assert_eq!(e.get(DEPLOY).unwrap()["spec"]["replicas"], 3);
    assert_eq!(e.get(POOL).unwrap()["status"]["dynamic"]["replicas"], 3);
    // A new bound reaches the HPA; the Deployment's count stays the HPA's.
    e.edit(POOL, |p| {
        p["spec"]["dynamic"]["autoscaling"]["maxReplicas"] = json!(6)
    });
    e.reconcile_pool().await;
    assert_eq!(e.get(HPA).unwrap()["spec"]["maxReplicas"], 6);
    assert_eq!(e.get(DEPLOY).unwrap()["spec"]["replicas"], 3);
    // replicas and autoscaling together: refused, naming the field.
    let mut both = e.get(POOL).unwrap();
    both["spec"]["dynamic"]["replicas"] = json!(2);
    e.store.lock().unwrap().objects.insert(POOL.into(), both);
    e.reconcile_pool().await;
    let p = e.get(POOL).unwrap();
    assert_eq!(condition(&p, "Valid")["status"], "False");
    assert!(
        condition(&p, "Valid")["message"]
            .as_str()
            .unwrap()
            .starts_with("spec.dynamic.replicas"),
        "{p}"
    );
    assert!(e.events().contains(&"InvalidSpec".to_string()));
    assert_eq!(
        e.get(DEPLOY).unwrap()["spec"]["replicas"],
        3,
        "a refused spec changes nothing"
    );
    // Autoscaling off, two fixed replicas: the HPA goes, the operator owns the count again.
    let mut fixed = e.get(POOL).unwrap();
    fixed["spec"]["dynamic"] = json!({"replicas": 2});
    e.store.lock().unwrap().objects.insert(POOL.into(), fixed);
    e.reconcile_pool().await;
    assert!(e.get(HPA).is_none(), "the HPA is deleted");
    assert_eq!(e.get(DEPLOY).unwrap()["spec"]["replicas"], 2);
}

/// A pool turning autoscaling on hands its count over before the Deployment apply drops
/// `replicas` (which the operator's apply owned: the API server would reset it to 1): the
/// count goes to the scale subresource under a second manager, then the Deployment is applied
/// even though nothing else changed; once released, reconciles write nothing more.
#[tokio::test]
async fn turning_autoscaling_on_hands_the_count_over_first() {
    let e = env().await;
    let mut obj = pool_obj();
    obj["spec"]["dynamic"] = json!({"replicas": 2});
    e.store.lock().unwrap().create(POOL, obj);
    e.reconcile_pool().await;
    // What the API server records of the operator's apply (the fake keeps no managedFields).
    {
        let mut s = e.store.lock().unwrap();
        let mut d = s.get(DEPLOY).unwrap();
        assert_eq!(d["spec"]["replicas"], 2);
        d["metadata"]["managedFields"] = json!([{"manager": "mole-operator/pool-deployment",
            "operation": "Apply", "apiVersion": "apps/v1", "fieldsType": "FieldsV1",
            "fieldsV1": {"f:spec": {"f:replicas": {}, "f:template": {}}}}]);
        s.objects.insert(DEPLOY.into(), d);
    }
    let mut p = e.get(POOL).unwrap();
    p["spec"]["dynamic"] = json!({"autoscaling": {"minReplicas": 1, "maxReplicas": 3}});
    e.store.lock().unwrap().objects.insert(POOL.into(), p);
    let writes = e.writes();
    e.reconcile_pool().await;
    let new: Vec<(String, String)> = e.store.lock().unwrap().writes[writes..].to_vec();
    let at = |path: &str| new.iter().position(|(m, p)| m == "APPLY" && p == path);
    let scale = at(&format!("{DEPLOY}/scale")).expect("the count applied to /scale");
    let deploy = at(DEPLOY).expect("the Deployment applied without replicas");
    assert!(scale < deploy, "{new:?}");
    assert!(at(HPA).is_some(), "{new:?}");
    let writes = e.writes();
    e.reconcile_pool().await;
    let again: Vec<_> = e.store.lock().unwrap().writes[writes..]
        .iter()
        .filter(|(_, p)| !p.ends_with("/status"))
        .cloned()
        .collect();
    assert_eq!(again, [], "handed over once");
}

impl Env {
    /// The output the merge Job `name` writes (its annotation).
    fn job_output(&self, name: &str) -> String {
        self.get(&format!("{JOBS}/{name}")).unwrap()["metadata"]["annotations"]
            ["mole.dev/merge-output"]
            .as_str()
            .unwrap()
            .to_string()
    }
    /// The merge Job `name` succeeded.
    fn job_succeeded(&self, name: &str) {
        self.edit(&format!("{JOBS}/{name}"), |j| {
            j["status"] = json!({"succeeded": 1})
        });
    }
    /// The paths every cleanup Job deletes.
    fn pruned_paths(&self) -> Vec<String> {
        self.jobs()
            .into_iter()
            .filter(|(p, _)| p.contains("/cleanup-"))
            .flat_map(|(_, j)| {
                let args: Vec<String> = serde_json::from_value(
                    j["spec"]["template"]["spec"]["containers"][0]["args"].clone(),
                )
                .unwrap();
                args.into_iter().skip(3).collect::<Vec<_>>()
            })
            .collect()
    }
    /// Every merged output the adapter's status names (history and merge in progress).
    fn recorded_outputs(&self, name: &str) -> Vec<String> {
        let a = self.get(&adapter_path(name)).unwrap();
        let mut out: Vec<String> = a["status"]["history"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|r| r["mergedOutput"].as_str().map(String::from))
            .collect();
        out.extend(a["status"]["merge"]["output"].as_str().map(String::from));
        out
    }
}

/// Issue 34 item 1: with `keepVersions: 0`, v1's merged output is pruned once v2 serves.
/// Applying v1 again within the day its finished merge Job is kept must not take that Job as
/// the merge of v1 (its output is gone): v1 is merged again into a new directory while v2
/// keeps serving, and the merged pods are never pointed at the pruned one.
#[tokio::test]
async fn rollback_to_a_pruned_version_merges_it_again_into_a_new_directory() {
    let e = merged_env().await;
    e.edit(POOL, |p| p["spec"]["merge"] = json!({"keepVersions": 0}));
    merged_ready_on_v1(&e).await;
    let v1_out = e.merged_output();
    e.set_version("v2");
    e.reconcile_adapter("calendar").await;
    let v2_job = e.running_jobs("merge-calendar-");
    assert_eq!(v2_job.len(), 1);
    e.job_succeeded(&v2_job[0]);
    e.reconcile_adapter("calendar").await;
    e.merged_ready();
    e.reconcile_adapter("calendar").await;
    let v2_out = e.merged_output();
    assert_ne!(v2_out, v1_out);
    assert!(
        e.pruned_paths().contains(&format!("/models/{v1_out}")),
        "v1's output is pruned: {:?}",
        e.pruned_paths()
    );

    // Back to v1 while v1's succeeded merge Job is still there (its TTL is a day).
    e.set_version("v1");
    e.reconcile_adapter("calendar").await;
    assert_eq!(
        e.merged_output(),
        v2_out,
        "the merged pods stay on v2 while v1 is merged again, never on the pruned directory"
    );
    assert!(
        !e.recorded_outputs("calendar").contains(&v1_out),
        "the pruned output is never recorded again"
    );
    let again = e.running_jobs("merge-calendar-");
    assert_eq!(again.len(), 1, "v1 is merged again: {again:?}");
    let v1_again = e.job_output(&again[0]);
    assert_ne!(v1_again, v1_out, "into a new directory");
    e.job_succeeded(&again[0]);
    e.reconcile_adapter("calendar").await;
    assert_eq!(e.merged_output(), v1_again);
    e.merged_ready();
    e.reconcile_adapter("calendar").await;
    let a = e.get(&adapter_path("calendar")).unwrap();
    assert_eq!(a["status"]["phase"], "Ready");
    assert_eq!(a["status"]["activeVersion"], "v1");
    assert!(!e.recorded_outputs("calendar").contains(&v1_out));
}

/// Issue 34 item 1: an Adapter deleted and created again under the same name, with the same
/// spec, has its own merge: its predecessor's succeeded merge Job (kept a day) is not its
/// merge, and its output directory is not the one its predecessor's cleanup Job (owned by the
/// pool, running on) deletes.
#[tokio::test]
async fn a_recreated_adapter_never_merges_into_what_its_predecessors_cleanup_deletes() {
    let e = merged_env().await;
    merged_ready_on_v1(&e).await;
    let v1_out = e.merged_output();
    e.delete_adapter("calendar");
    e.reconcile_adapter("calendar").await;
    assert!(e.get(&adapter_path("calendar")).is_none(), "finalizer done");
    let pruned = e.pruned_paths();
    assert!(pruned.contains(&format!("/models/{v1_out}")), "{pruned:?}");

    let mut a = adapter_obj("calendar", "vl", "calendar");
    a["spec"]["serving"] = json!({"mode": "merged", "replicas": 1});
    e.store.lock().unwrap().create(&adapter_path("calendar"), a);
    e.reconcile_adapter("calendar").await;
    let jobs = e.running_jobs("merge-calendar-");
    assert_eq!(jobs.len(), 1, "a merge of its own: {jobs:?}");
    let out = e.job_output(&jobs[0]);
    assert!(
        !pruned.contains(&format!("/models/{out}")),
        "{out} is being deleted by the old Adapter's cleanup Job"
    );
    assert!(!e.recorded_outputs("calendar").contains(&v1_out));
}

/// Issue 34 item 2: a failed merge is counted once and backs off, and the merge is given up
/// after `MAX_MERGE_ATTEMPTS` failures, even when the watch lags: each pass that sees a
/// failure is followed by one from the Adapter as it was before that pass wrote (the Job's
/// own event re-queues the Adapter before the reflector has its new status).
#[tokio::test]
async fn a_failing_merge_backs_off_and_gives_up_even_when_the_watch_lags() {
    use mole_operator::mergedown::MAX_MERGE_ATTEMPTS;
    let e = merged_env().await;
    e.worker_reports(&[("calendar", "v1", 1)]);
    e.reconcile_adapter("calendar").await;
    let why = "merge failed (shape_mismatch): lora_B is 8x64, the base expects 96";
    let created = |e: &Env| {
        e.store
            .lock()
            .unwrap()
            .writes
            .iter()
            .filter(|(m, p)| m == "POST" && p.starts_with(&format!("{JOBS}/merge-calendar-")))
            .count()
    };
    for attempt in 1..=MAX_MERGE_ATTEMPTS {
        e.finish_only_job(false, why);
        let lagging = support::snapshot(&e.store);
        e.reconcile_adapter_once("calendar").await;
        e.reconcile_adapter_lagging("calendar", &lagging).await;
        assert!(
            e.running_jobs("merge-").is_empty(),
            "attempt {attempt}: retried at once, within its backoff"
        );
        let a = e.get(&adapter_path("calendar")).unwrap();
        assert_eq!(
            a["status"]["merge"]["failures"],
            json!(attempt),
            "attempt {attempt}: counted once"
        );
        e.backoff_elapsed();
        for _ in 0..2 {
            let lagging = support::snapshot(&e.store);
            e.reconcile_adapter_once("calendar").await;
            e.reconcile_adapter_lagging("calendar", &lagging).await;
        }
        if attempt < MAX_MERGE_ATTEMPTS {
            assert_eq!(
                e.running_jobs("merge-calendar-").len(),
                1,
                "attempt {attempt}: retried once the backoff ran out"
            );
        }
    }
    assert!(e.running_jobs("merge-").is_empty(), "no sixth attempt");
    assert_eq!(created(&e), MAX_MERGE_ATTEMPTS as usize);
    let a = e.get(&adapter_path("calendar")).unwrap();
    assert_eq!(condition(&a, "Merged")["reason"], "MergeGaveUp");
    assert_eq!(a["status"]["merge"]["failures"], json!(MAX_MERGE_ATTEMPTS));
}

/// Issue 34 item 3: validation of an Adapter reads its pool (`serving.replicas` against the
/// pool's `rollout`), so a change of the pool's spec re-queues the pool's Adapters: an Adapter
/// the new pool refuses says so (and the pool's WorkerConfig drops it), and once the pool is
/// fixed it is accepted again (and listed again); the Adapter's status and the WorkerConfig
/// agree at every step. Status-only changes of the pool re-queue nothing.
#[tokio::test]
async fn changing_or_fixing_a_pool_revalidates_its_adapters() {
    let e = env().await;
    e.store.lock().unwrap().create(POOL, pool_obj());
    e.add_ready_pod();
    let mut a = adapter_obj("calendar", "vl", "calendar");
    a["spec"]["serving"] = json!({"mode": "merged", "replicas": 2});
    e.store.lock().unwrap().create(&adapter_path("calendar"), a);
    let trigger = adapter::PoolTrigger::default();
    let mapped = |e: &Env| -> Vec<String> {
        e.sync();
        trigger
            .adapters(&e.pool(), &e.stores.adapters)
            .into_iter()
            .map(|r| r.name)
            .collect()
    };
    let listed = |e: &Env| -> bool {
        let wc: mole_crds::WorkerConfig =
            serde_json::from_str(e.get(CM).unwrap()["data"]["worker.json"].as_str().unwrap())
                .unwrap();
        wc.adapters.iter().any(|a| a.name == "calendar")
    };
    let valid = |e: &Env| -> String {
        let a = e.get(&adapter_path("calendar")).unwrap();
        condition(&a, "Valid")["status"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert_eq!(mapped(&e), ["calendar"], "first sight of the pool");
    e.reconcile_adapter("calendar").await;
    assert_eq!(
        mapped(&e),
        ["calendar"],
        "its id given: the Adapter that waits for it is woken"
    );
    e.reconcile_pool().await;
    assert_eq!(valid(&e), "True");
    assert!(listed(&e));
    // The pool's status moves on (its reconcile wrote it): nothing to re-validate.
    e.reconcile_pool().await;
    assert!(
        mapped(&e).is_empty(),
        "a status change re-queues no Adapter"
    );

    // A rollout that may take both merged pods down at once.
    e.edit(POOL, |p| {
        p["spec"]["rollout"] = json!({"maxSurge": 0, "maxUnavailable": "100%"});
        p["metadata"]["generation"] = json!(2);
    });
    assert_eq!(mapped(&e), ["calendar"]);
    e.reconcile_adapter("calendar").await;
    e.reconcile_pool().await;
    let a = e.get(&adapter_path("calendar")).unwrap();
    assert_eq!(valid(&e), "False");
    assert!(
        condition(&a, "Valid")["message"]
            .as_str()
            .unwrap()
            .contains("spec.serving.replicas"),
        "{a}"
    );
    assert!(!listed(&e), "refused, and not loaded either");

    // The pool is fixed: its Adapter is accepted again without any change of its own.
    e.edit(POOL, |p| {
        p["spec"]["rollout"] = json!({"maxSurge": 0, "maxUnavailable": 1});
        p["metadata"]["generation"] = json!(3);
    });
    assert_eq!(mapped(&e), ["calendar"]);
    e.reconcile_adapter("calendar").await;
    e.reconcile_pool().await;
    assert_eq!(valid(&e), "True");
    assert!(listed(&e));
}

/// Issue 33 item 3: an Adapter whose `source.path` is its pool's base model (a fetch Job
/// would overwrite the base's weights, config and template) is refused with a condition and a
/// Warning Event naming the field; no fetch Job is created and the pool does not list it.
#[tokio::test]
async fn an_adapter_whose_source_is_the_base_model_is_refused_naming_the_field() {
    let e = env().await;
    e.store.lock().unwrap().create(POOL, pool_obj());
    let mut a = adapter_obj("calendar", "vl", "calendar");
    a["spec"]["source"] = json!({"path": "base/qwen3-vl-8b", "uri": "hf://org/calendar"});
    e.store.lock().unwrap().create(&adapter_path("calendar"), a);
    e.reconcile_adapter("calendar").await;
    let a = e.get(&adapter_path("calendar")).unwrap();
    assert_eq!(a["status"]["phase"], "Failed");
    let valid = condition(&a, "Valid");
    assert_eq!(valid["status"], "False");
    assert_eq!(valid["reason"], "InvalidSpec");
    let msg = valid["message"].as_str().unwrap();
    assert!(
        msg.contains("spec.source.path") && msg.contains("spec.baseModel.path"),
        "{msg}"
    );
    let note = e.note_of("InvalidSpec");
    assert!(note.contains("spec.source.path"), "{note}");
    assert!(e.jobs().is_empty(), "no fetch Job writes over the base");
    e.reconcile_pool().await;
    let wc: mole_crds::WorkerConfig =
        serde_json::from_str(e.get(CM).unwrap()["data"]["worker.json"].as_str().unwrap()).unwrap();
    assert!(wc.adapters.is_empty());
}

/// Issue 34 item 4: an Adapter deleted and created again gets a new LoRA id (ids are never
/// reused); until the pods report the adapter under that id, what they report is the old
/// Adapter's load, and the new one is not Ready.
#[tokio::test]
async fn a_recreated_adapter_is_not_ready_from_its_predecessors_load() {
    let e = env().await;
    e.store.lock().unwrap().create(POOL, pool_obj());
    e.add_ready_pod();
    e.store.lock().unwrap().create(
        &adapter_path("calendar"),
        adapter_obj("calendar", "vl", "calendar"),
    );
    e.worker_reports(&[("calendar", "v1", 1)]);
    e.reconcile_adapter("calendar").await;
    assert_eq!(
        e.get(&adapter_path("calendar")).unwrap()["status"]["phase"],
        "Ready"
    );
    e.delete_adapter("calendar");
    e.reconcile_adapter("calendar").await;
    assert!(e.get(&adapter_path("calendar")).is_none());
    e.store.lock().unwrap().create(
        &adapter_path("calendar"),
        adapter_obj("calendar", "vl", "calendar"),
    );
    e.reconcile_adapter("calendar").await;
    let a = e.get(&adapter_path("calendar")).unwrap();
    assert_eq!(a["status"]["loraId"], 2);
    assert_ne!(
        a["status"]["phase"], "Ready",
        "the pod still reports the old Adapter (lora id 1)"
    );
    assert_eq!(condition(&a, "Ready")["status"], "False");
    e.worker_reports(&[("calendar", "v1", 2)]);
    e.reconcile_adapter("calendar").await;
    assert_eq!(
        e.get(&adapter_path("calendar")).unwrap()["status"]["phase"],
        "Ready"
    );
}

/// Issue 34 item 4: an edit of `source.path` without a new `spec.version` is a new load for the
/// pods (their listing names the directory each version was read from); the Adapter must not
/// read Ready from their load of the old files, and reads Ready once they hold the new ones.
#[tokio::test]
async fn a_source_changed_without_a_version_bump_is_not_ready_from_the_old_load() {
    let e = env().await;
    e.store.lock().unwrap().create(POOL, pool_obj());
    e.add_ready_pod();
    e.store.lock().unwrap().create(
        &adapter_path("calendar"),
        adapter_obj("calendar", "vl", "calendar"),
    );
    let old = e.get(&adapter_path("calendar")).unwrap()["spec"]["source"]["path"]
        .as_str()
        .unwrap()
        .to_string();
    e.worker_reports_from(&[("calendar", "v1", 1, &format!("/models/{old}"))]);
    e.reconcile_adapter("calendar").await;
    assert_eq!(
        e.get(&adapter_path("calendar")).unwrap()["status"]["phase"],
        "Ready"
    );
    e.edit(&adapter_path("calendar"), |a| {
        a["spec"]["source"]["path"] = json!("adapters/calendar/v1-retrained");
        a["metadata"]["generation"] = json!(2);
    });
    // The pods still hold the old directory's files under v1: not Ready from them.
    e.reconcile_adapter("calendar").await;
    let a = e.get(&adapter_path("calendar")).unwrap();
    assert_ne!(a["status"]["phase"], "Ready", "{}", a["status"]);
    assert_eq!(condition(&a, "Ready")["status"], "False");
    // The worker config names the new directory, which the pods load anew under v1.
    e.reconcile_pool().await;
    let cm = e.get(CM).unwrap();
    assert!(
        cm.to_string().contains("adapters/calendar/v1-retrained"),
        "the pods are told to load the new source: {cm}"
    );
    e.worker_reports_from(&[(
        "calendar",
        "v1",
        1,
        "/models/adapters/calendar/v1-retrained",
    )]);
    e.reconcile_adapter("calendar").await;
    let a = e.get(&adapter_path("calendar")).unwrap();
    assert_eq!(a["status"]["phase"], "Ready", "{}", a["status"]);
    assert_eq!(
        a["status"]["history"][0]["source"], "adapters/calendar/v1-retrained",
        "the new source is recorded"
    );
}

/// Issue 34 item 4: the API server stores quantities in canonical form ("1000m" as "1",
/// "1024Mi" as "1Gi"); the "unchanged" check compares them by value, so a pool written with
/// other spellings is not applied again on every reconcile.
#[tokio::test]
async fn canonicalized_quantities_are_not_a_change() {
    let e = env().await;
    let mut p = pool_obj();
    p["spec"]["resources"] =
        json!({"requests": {"cpu": "1000m", "memory": "1024Mi"}, "limits": {"memory": "0.5Gi"}});
    e.store.lock().unwrap().create(POOL, p);
    e.reconcile_pool().await;
    let res = |e: &Env| {
        e.get(DEPLOY).unwrap()["spec"]["template"]["spec"]["containers"][0]["resources"].clone()
    };
    assert_eq!(res(&e)["requests"]["cpu"], "1000m");
    // What the API server keeps of them.
    e.edit(DEPLOY, |d| {
        let r = &mut d["spec"]["template"]["spec"]["containers"][0]["resources"];
        r["requests"]["cpu"] = json!("1");
        r["requests"]["memory"] = json!("1Gi");
        r["limits"]["memory"] = json!("512Mi");
    });
    let before = e.writes();
    e.reconcile_pool().await;
    let deploy_writes: Vec<_> = e.store.lock().unwrap().writes[before..]
        .iter()
        .filter(|(_, p)| p == DEPLOY)
        .cloned()
        .collect();
    assert_eq!(
        deploy_writes,
        [],
        "the same quantities, spelled canonically"
    );
    // A real change is still applied.
    e.edit(POOL, |p| {
        p["spec"]["resources"]["requests"]["cpu"] = json!("2");
        p["metadata"]["generation"] = json!(2);
    });
    e.reconcile_pool().await;
    assert_eq!(res(&e)["requests"]["cpu"], "2");
}

impl Env {
    /// The dynamic pod lists `calendar` and `mail` (calendar loaded or not) with these
    /// cumulative token counts (one request per 100 tokens).
    fn worker_traffic(&self, calendar_loaded: bool, calendar_tokens: u64, mail_tokens: u64) {
        let entry = |n: &str, id: u32, loaded: bool| {
            json!({"name": n, "version": "v1", "lora_id": id, "residency": "gpu", "loaded": loaded,
                   "rank": 8, "bytes": 1000, "requests": 0, "running": 0})
        };
        let count = |n: &str, tokens: u64| json!({"name": n, "version": "v1", "requests": tokens / 100, "tokens": tokens, "errors": 0});
        *self.worker.adapters.lock().unwrap() = json!({
            "object": "list", "base_model": "b",
            "data": [entry("calendar", 1, calendar_loaded), entry("mail", 2, true)],
            "traffic": [count("calendar", calendar_tokens), count("mail", mail_tokens)],
        });
    }

    /// Whether the pool's WorkerConfig has the dynamic pods load `name`.
    fn dynamic_loads(&self, name: &str) -> bool {
        let wc: mole_crds::WorkerConfig = serde_json::from_str(
            self.get(CM).unwrap()["data"]["worker.json"]
                .as_str()
                .unwrap(),
        )
        .unwrap();
        wc.adapters.iter().any(|a| a.name == name && a.load)
    }
}

/// Issue 37: an `auto` adapter whose traffic rises gets merged pods, while the dynamic pods
/// keep serving it until they are ready; when its traffic falls it goes back to the dynamic
/// pods, and the merged pods go only once the dynamic pods report it loaded again. Each
/// decision is an Event with its numbers.
#[tokio::test]
async fn traffic_rises_to_merged_and_falls_back_to_dynamic_without_a_gap() {
    let e = env().await;
    let mut pool = pool_obj();
    pool["spec"]["merge"] = json!({"traffic": {"promoteShare": 0.5, "demoteShare": 0.2,
        "windowSeconds": 0, "minHoldSeconds": 0, "maxMergedGpus": 1}});
    e.store.lock().unwrap().create(POOL, pool);
    e.add_ready_pod();
    let mut cal = adapter_obj("calendar", "vl", "calendar");
    cal["spec"]["serving"] = json!({"mode": "auto"});
    e.store
        .lock()
        .unwrap()
        .create(&adapter_path("calendar"), cal);
    e.store
        .lock()
        .unwrap()
        .create(&adapter_path("mail"), adapter_obj("mail", "vl", "mail"));
    e.worker_traffic(true, 0, 0);
    e.reconcile_pool().await;
    // Ids in order of registration: calendar 1, mail 2, as the pod reports them.
    e.reconcile_adapter("calendar").await;
    e.reconcile_adapter("mail").await;
    e.reconcile_pool().await;
    let a = e.get(&adapter_path("calendar")).unwrap();
    assert_eq!(a["status"]["servingMode"], "dynamic");
    assert_eq!(a["status"]["fleet"]["merged"], false);
    assert_eq!(e.count_events("TrafficPromoted"), 0);

    // Calendar's traffic rises: 99% of the pool's tokens.
    tokio::time::sleep(std::time::Duration::from_millis(30)).await;
    e.worker_traffic(true, 100_000, 1_000);
    e.reconcile_adapter("mail").await;
    e.reconcile_adapter("calendar").await;
    assert_eq!(e.count_events("TrafficPromoted"), 1);
    let note = e
        .store
        .lock()
        .unwrap()
        .event_notes
        .iter()
        .find(|(r, _)| r == "TrafficPromoted")
        .unwrap()
        .1
        .clone();
    assert!(
        note.contains("% of the pool's") && note.contains("promote at 50.0%"),
        "{note}"
    );
    let a = e.get(&adapter_path("calendar")).unwrap();
    assert_eq!(a["status"]["fleet"]["merged"], true);
    assert!(
        a["status"]["fleet"]["share"].as_f64().unwrap() > 0.9,
        "{}",
        a["status"]
    );
    assert_eq!(a["status"]["traffic"]["pods"], json!(["vl-dynamic-abc"]));
    // Its rates are not written again within the status write interval (1 s here).
    assert_eq!(a["status"]["traffic"]["tokensPerMinute"], 0.0);
    assert_eq!(e.jobs().len(), 1, "a merge Job");
    // Until the merged pods are ready the dynamic pods serve it.
    e.reconcile_pool().await;
    assert!(e.dynamic_loads("calendar"));
    e.finish_only_job(true, "");
    e.reconcile_adapter("calendar").await;
    assert!(e.get(MERGED).is_some());
    e.reconcile_pool().await;
    assert!(e.dynamic_loads("calendar"), "merged pods not ready yet");
    e.merged_ready();
    e.reconcile_adapter("calendar").await;
    let a = e.get(&adapter_path("calendar")).unwrap();
    assert_eq!(a["status"]["servingMode"], "merged");
    assert_eq!(a["status"]["phase"], "Ready");
    e.reconcile_pool().await;
    assert!(e.dynamic_loads("calendar"), "kept as the fallback");

    // Its traffic falls: mail takes nearly all of it. Past the status write interval (a tenth
    // of the window, at least 1 s) mail's new rate is recorded for calendar to read.
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    e.worker_traffic(false, 100_000, 10_000_000);
    e.reconcile_adapter("mail").await;
    e.reconcile_adapter("calendar").await;
    assert_eq!(e.count_events("TrafficDemoted"), 1, "{:?}", e.events());
    let a = e.get(&adapter_path("calendar")).unwrap();
    assert_eq!(a["status"]["fleet"]["merged"], false);
    assert!(
        a["status"]["traffic"]["tokensPerMinute"].as_f64().unwrap() > 0.0,
        "{}",
        a["status"]
    );
    assert!(
        e.get(&adapter_path("mail")).unwrap()["status"]["traffic"]["tokensPerMinute"]
            .as_f64()
            .unwrap()
            > 0.0
    );
    // The dynamic pod does not hold it (it reports it not loaded): the merged pods stay.
    assert!(e.get(MERGED).is_some(), "no window without a serving pod");
    e.worker_traffic(true, 100_000, 10_000_000);
    e.reconcile_adapter("calendar").await;
    assert!(
        e.get(MERGED).is_none(),
        "merged pods go once the dynamic pods hold it"
    );
    let a = e.get(&adapter_path("calendar")).unwrap();
    assert_eq!(a["status"]["servingMode"], "dynamic");
    assert_eq!(a["status"]["phase"], "Ready");
    assert_eq!(e.count_events("TrafficDemoted"), 1, "decided once");
}

/// The `calendar` entry of the pool's WorkerConfig.
fn worker_entry(e: &Env, name: &str) -> Option<mole_crds::WorkerAdapter> {
    let wc: mole_crds::WorkerConfig =
        serde_json::from_str(e.get(CM).unwrap()["data"]["worker.json"].as_str().unwrap()).unwrap();
    wc.adapters.into_iter().find(|a| a.name == name)
}

/// Issue 37, item 3: an adapter with a canary version gets both versions into the pool's
/// WorkerConfig (the canary at its weight); when the pods' per-version counters show the canary
/// erring beyond its bound over `minRequests`, the operator rolls it back by itself: a Warning
/// Event with the numbers, `status.canary` RolledBack at weight 0, and the canary out of the
/// WorkerConfig. A bad canary is refused with `Valid=False` and an Event naming the field.
#[tokio::test]
async fn a_canary_that_errors_is_rolled_back_automatically_with_an_event() {
    let e = env().await;
    e.store.lock().unwrap().create(POOL, pool_obj());
    e.add_ready_pod();
    let mut cal = adapter_obj("calendar", "vl", "calendar");
    cal["spec"]["canary"] = json!({"version": "v2", "source": {"path": "adapters/calendar/v2"},
        "weight": 10, "analysis": {"minRequests": 50, "maxErrorRateIncrease": 0.05}});
    e.store
        .lock()
        .unwrap()
        .create(&adapter_path("calendar"), cal);
    let report = |v1: (u64, u64), v2: (u64, u64)| {
        let entry = |v: &str| {
            json!({"name": "calendar", "version": v, "lora_id": 1, "residency": "gpu",
            "loaded": true, "rank": 8, "bytes": 1000, "requests": 0, "running": 0})
        };
        let count = |v: &str, (r, err): (u64, u64)| {
            json!({"name": "calendar", "version": v,
            "requests": r, "tokens": r * 10, "errors": err, "latency_ms": []})
        };
        *e.worker.adapters.lock().unwrap() = json!({
            "object": "list", "base_model": "b",
            "data": [entry("v1"), entry("v2")],
            "traffic": [count("v1", v1), count("v2", v2)],
        });
    };
    report((0, 0), (0, 0));
    e.reconcile_pool().await;
    e.reconcile_adapter("calendar").await;
    e.reconcile_pool().await;
    let a = e.get(&adapter_path("calendar")).unwrap();
    assert_eq!(a["status"]["phase"], "Ready", "{}", a["status"]);
    assert_eq!(a["status"]["canary"]["phase"], "Progressing");
    assert_eq!(a["status"]["canary"]["weight"], 10);
    assert_eq!(e.count_events("CanaryStarted"), 1);
    let w = worker_entry(&e, "calendar").unwrap();
    assert_eq!(
        (w.version.as_str(), w.path.as_str()),
        ("v1", "adapters/calendar/v1")
    );
    assert_eq!(
        w.canary,
        Some(mole_crds::WorkerCanary {
            version: "v2".into(),
            path: "adapters/calendar/v2".into(),
            weight: 10
        })
    );

    // Below minRequests, however bad: it goes on. Counts alone are written at
    // `status.traffic`'s rate (canary::throttle), so the status written a moment ago keeps
    // its counts: the analysis reads the pods' counts, not the status.
    report((400, 2), (40, 40));
    e.reconcile_adapter("calendar").await;
    assert_eq!(e.count_events("CanaryRolledBack"), 0);
    let a = e.get(&adapter_path("calendar")).unwrap();
    assert_eq!(a["status"]["canary"]["phase"], "Progressing");
    assert_eq!(
        a["status"]["canary"]["canary"]["requests"], 0,
        "{}",
        a["status"]
    );

    // 60 requests, 12 errors (20%) against the stable 0.5%: rolled back.
    report((900, 4), (60, 12));
    e.reconcile_adapter("calendar").await;
    assert_eq!(e.count_events("CanaryRolledBack"), 1, "{:?}", e.events());
    let note = e
        .store
        .lock()
        .unwrap()
        .event_notes
        .iter()
        .find(|(r, _)| r == "CanaryRolledBack")
        .unwrap()
        .1
        .clone();
    assert!(
        note.contains("canary 60 requests, 20.00% errors")
            && note.contains("stable 900 requests, 0.44% errors")
            && note.contains("bound 5.00"),
        "{note}"
    );
    let a = e.get(&adapter_path("calendar")).unwrap();
    assert_eq!(a["status"]["canary"]["phase"], "RolledBack");
    assert_eq!(a["status"]["canary"]["weight"], 0);
    // A verdict is written at once, with the counts that caused it.
    assert_eq!(a["status"]["canary"]["canary"]["requests"], 60);
    assert_eq!(a["status"]["canary"]["stable"]["requests"], 900);
    assert_eq!(a["status"]["phase"], "Ready", "the stable version serves");
    e.reconcile_pool().await;
    let w = worker_entry(&e, "calendar").unwrap();
    assert_eq!(w.canary, None, "all traffic back to v1");
    assert_eq!(w.version, "v1");
    // It stays rolled back, announced once, while the spec still names it.
    report((1000, 4), (0, 0));
    e.reconcile_adapter("calendar").await;
    e.reconcile_pool().await;
    assert_eq!(e.count_events("CanaryRolledBack"), 1);
    assert_eq!(worker_entry(&e, "calendar").unwrap().canary, None);

    // A canary of the stable version itself: refused, naming the field.
    let mut bad = e.get(&adapter_path("calendar")).unwrap();
    bad["spec"]["canary"]["version"] = json!("v1");
    bad["metadata"]["generation"] = json!(bad["metadata"]["generation"].as_i64().unwrap_or(1) + 1);
    e.store
        .lock()
        .unwrap()
        .objects
        .insert(adapter_path("calendar"), bad);
    e.reconcile_adapter("calendar").await;
    let a = e.get(&adapter_path("calendar")).unwrap();
    let valid = condition(&a, "Valid");
    assert_eq!(valid["status"], "False");
    assert!(
        valid["message"]
            .as_str()
            .unwrap()
            .starts_with("spec.canary.version"),
        "{}",
        valid["message"]
    );
    assert!(e.events().contains(&"InvalidSpec".to_string()));
}

/// Issue 37, item 6: with the pool's `merge.scaleToZero`, an idle merged adapter is loaded into
/// the dynamic pods again, and only once they report it does its merged Deployment go to 0
/// replicas (kept, with its Service) and the dynamic pods stop forwarding to it; requests for it
/// (counted by the dynamic pods) bring the Deployment back, and the forwarding returns only once
/// its pods are ready. At no step is the adapter neither loaded in the dynamic pods nor
/// forwarded to ready merged pods.
#[tokio::test]
async fn idle_merged_pods_scale_to_zero_behind_the_dynamic_pods_and_come_back_with_requests() {
    let e = env().await;
    let mut pool = pool_obj();
    pool["spec"]["merge"] = json!({"unloadFromDynamic": true});
    e.store.lock().unwrap().create(POOL, pool);
    e.add_ready_pod();
    let mut a = adapter_obj("calendar", "vl", "calendar");
    a["spec"]["serving"] = json!({"mode": "merged", "replicas": 1});
    // Last used long ago (what a restarted operator reads back).
    a["status"] = json!({"traffic": {"requestsPerMinute": 0.0, "tokensPerMinute": 0.0,
        "merged": true, "lastUsed": "2026-01-01T00:00:00Z"}});
    e.store.lock().unwrap().create(&adapter_path("calendar"), a);
    e.reconcile_pool().await;
    merged_ready_on_v1(&e).await;
    e.reconcile_pool().await;
    assert!(
        !e.dynamic_loads("calendar"),
        "served by the merged pods only"
    );
    assert!(worker_entry(&e, "calendar")
        .unwrap()
        .merged_endpoint
        .is_some());
    // The dynamic pod unloaded it.
    let report = |loaded: bool, requests: u64| {
        let data: Vec<Value> = loaded
            .then(|| {
                json!({"name": "calendar", "version": "v1", "lora_id": 1, "residency": "gpu",
                "loaded": true, "rank": 8, "bytes": 1000, "requests": requests, "running": 0})
            })
            .into_iter()
            .collect();
        *e.worker.adapters.lock().unwrap() = json!({"object": "list", "base_model": "b",
            "data": data, "traffic": [{"name": "calendar", "version": "v1", "requests": requests,
            "tokens": requests * 10, "errors": 0}]});
    };
    report(false, 0);
    e.reconcile_adapter("calendar").await;

    // The pool asks for scale to zero after 60 idle seconds: calendar is idle.
    e.edit(POOL, |p| {
        p["spec"]["merge"]["scaleToZero"] = json!({"idleSeconds": 60});
        p["metadata"]["generation"] = json!(p["metadata"]["generation"].as_i64().unwrap_or(1) + 1);
    });
    e.reconcile_pool().await;
    e.reconcile_adapter("calendar").await;
    e.reconcile_pool().await;
    // First the dynamic pods load it; the merged pods keep serving and forwarding goes on.
    assert!(e.dynamic_loads("calendar"));
    assert!(worker_entry(&e, "calendar")
        .unwrap()
        .merged_endpoint
        .is_some());
    assert_eq!(e.get(MERGED).unwrap()["spec"]["replicas"], 1);
    assert_eq!(e.count_events("ScaledToZero"), 0);

    // The dynamic pod reports it loaded: scaled to zero, forwarding dropped, still Ready.
    report(true, 0);
    e.reconcile_adapter("calendar").await;
    e.reconcile_pool().await;
    assert_eq!(
        e.get(MERGED).unwrap()["spec"]["replicas"],
        0,
        "kept at 0, not deleted"
    );
    assert!(e
        .get("/api/v1/namespaces/ml/services/vl-calendar")
        .is_some());
    assert_eq!(e.count_events("ScaledToZero"), 1);
    let w = worker_entry(&e, "calendar").unwrap();
    assert!(w.load && w.merged_endpoint.is_none(), "{w:?}");
    let a = e.get(&adapter_path("calendar")).unwrap();
    assert_eq!(a["status"]["phase"], "Ready");
    assert_eq!(a["status"]["servingMode"], "dynamic");
    assert_eq!(condition(&a, "Ready")["reason"], "ScaledToZero");
    // The Deployment controller took its pods away.
    e.edit(MERGED, |d| {
        let g = d["metadata"]["generation"].as_i64().unwrap_or(1);
        d["status"] = json!({"observedGeneration": g, "replicas": 0});
    });
    e.reconcile_adapter("calendar").await;
    assert_eq!(e.count_events("ScaledToZero"), 1, "announced once");

    // Requests return (the dynamic pod counts them): scaled back up; the dynamic pods serve
    // until the merged pods are ready, then the forwarding returns.
    report(true, 5);
    e.reconcile_adapter("calendar").await;
    e.reconcile_pool().await;
    assert_eq!(e.count_events("ScaledFromZero"), 1, "{:?}", e.events());
    assert_eq!(e.get(MERGED).unwrap()["spec"]["replicas"], 1);
    let w = worker_entry(&e, "calendar").unwrap();
    assert!(w.load && w.merged_endpoint.is_none(), "{w:?}");
    e.merged_ready();
    e.reconcile_adapter("calendar").await;
    e.reconcile_pool().await;
    let w = worker_entry(&e, "calendar").unwrap();
    assert!(w.merged_endpoint.is_some(), "{w:?}");
    let a = e.get(&adapter_path("calendar")).unwrap();
    assert_eq!(a["status"]["servingMode"], "merged");
    assert_eq!(a["status"]["phase"], "Ready");
}

/// Issue 37, items 4 and 5, through the pool controller: with `dynamic.placement` the pool's
/// WorkerConfig places each adapter on its share of the dynamic pods (every pod not being
/// deleted, ready or not) and lists the ready pods' addresses for forwarding; a pod joining
/// moves few adapters; without `placement` neither is written.
#[tokio::test]
async fn placement_writes_each_adapters_pods_and_the_peers_into_the_worker_config() {
    let e = env().await;
    let mut pool = pool_obj();
    pool["spec"]["dynamic"]["placement"] = json!({"minReplicas": 2, "loadFactor": 1.25});
    e.store.lock().unwrap().create(POOL, pool);
    e.add_ready_pod();
    let pod = |name: &str, ready: bool| {
        json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "ml",
                "labels": {"app.kubernetes.io/instance": "vl", "app.kubernetes.io/component": "dynamic"}},
            "status": {"podIP": "10.0.0.9", "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]}})
    };
    for (name, ready) in [("vl-dynamic-def", true), ("vl-dynamic-ghi", false)] {
        e.store.lock().unwrap().create(
            &format!("/api/v1/namespaces/ml/pods/{name}"),
            pod(name, ready),
        );
    }
    let names: Vec<String> = (0..6).map(|i| format!("a{i}")).collect();
    for n in &names {
        e.store
            .lock()
            .unwrap()
            .create(&adapter_path(n), adapter_obj(n, "vl", n));
    }
    e.reconcile_pool().await;
    for n in &names {
        e.reconcile_adapter(n).await;
    }
    e.reconcile_pool().await;
    let wc: mole_crds::WorkerConfig =
        serde_json::from_str(e.get(CM).unwrap()["data"]["worker.json"].as_str().unwrap()).unwrap();
    assert_eq!(wc.adapters.len(), 6);
    let mut per_pod = std::collections::BTreeMap::<String, usize>::new();
    for a in &wc.adapters {
        assert_eq!(a.pods.len(), 2, "{}: {:?}", a.name, a.pods);
        for p in &a.pods {
            *per_pod.entry(p.clone()).or_default() += 1;
        }
    }
    // 12 replicas over 3 pods, none over ceil(1.25 x 4) = 5; the unready pod takes its share.
    assert_eq!(per_pod.len(), 3, "{per_pod:?}");
    assert!(per_pod.values().all(|n| *n <= 5), "{per_pod:?}");
    let port = wc.peers["vl-dynamic-abc"]
        .rsplit(':')
        .next()
        .unwrap()
        .to_string();
    assert_eq!(
        wc.peers.keys().collect::<Vec<_>>(),
        ["vl-dynamic-abc", "vl-dynamic-def"],
        "ready pods only"
    );
    assert_eq!(
        wc.peers["vl-dynamic-def"],
        format!("http://10.0.0.9:{port}")
    );
    let before: std::collections::BTreeMap<String, Vec<String>> = wc
        .adapters
        .iter()
        .map(|a| (a.name.clone(), a.pods.clone()))
        .collect();

    // A fourth pod joins: few adapters move.
    e.store.lock().unwrap().create(
        "/api/v1/namespaces/ml/pods/vl-dynamic-jkl",
        pod("vl-dynamic-jkl", true),
    );
    e.reconcile_pool().await;
    let wc: mole_crds::WorkerConfig =
        serde_json::from_str(e.get(CM).unwrap()["data"]["worker.json"].as_str().unwrap()).unwrap();
    let moved: usize = wc
        .adapters
        .iter()
        .map(|a| {
            a.pods
                .iter()
                .filter(|p| !before[&a.name].contains(p))
                .count()
        })
        .sum();
    assert!((1..=5).contains(&moved), "{moved} replicas moved of 12");

    // Without placement: every pod loads every adapter, no peers.
    e.edit(POOL, |p| {
        p["spec"]["dynamic"]
            .as_object_mut()
            .unwrap()
            .remove("placement");
        p["metadata"]["generation"] = json!(p["metadata"]["generation"].as_i64().unwrap_or(1) + 1);
    });
    e.reconcile_pool().await;
    let wc: mole_crds::WorkerConfig =
        serde_json::from_str(e.get(CM).unwrap()["data"]["worker.json"].as_str().unwrap()).unwrap();
    assert!(wc.adapters.iter().all(|a| a.pods.is_empty()));
    assert!(wc.peers.is_empty());
}

/// Issue 55 item 2: the merge budget holds across the Adapters of a pool decided in separate
/// reconciles, even when the second one's cache has not seen the first one's promotion yet:
/// each decision reads the pool's latest decisions (one record per pool in the operator), not
/// the siblings' statuses as a lagging watch delivers them. On 8824d9e both were promoted
/// (two merge Jobs for a budget of one GPU).
#[tokio::test]
async fn the_merge_budget_holds_when_siblings_are_decided_from_a_lagging_cache() {
    let e = env().await;
    let mut pool = pool_obj();
    pool["spec"]["merge"] = json!({"traffic": {"promoteShare": 0.3, "demoteShare": 0.1,
        "windowSeconds": 0, "minHoldSeconds": 0, "maxMergedGpus": 1}});
    e.store.lock().unwrap().create(POOL, pool);
    e.add_ready_pod();
    for name in ["calendar", "mail"] {
        let mut a = adapter_obj(name, "vl", name);
        a["spec"]["serving"] = json!({"mode": "auto"});
        e.store.lock().unwrap().create(&adapter_path(name), a);
    }
    e.worker_traffic(true, 0, 0);
    e.reconcile_pool().await;
    e.reconcile_adapter("calendar").await;
    e.reconcile_adapter("mail").await;
    e.reconcile_pool().await;
    // Both hot: half the pool's tokens each, over the 30% share.
    tokio::time::sleep(std::time::Duration::from_millis(30)).await;
    e.worker_traffic(true, 100_000, 100_000);
    e.sync();
    let before = support::snapshot(&e.store);
    e.reconcile_adapter_once("calendar").await;
    // Mail's reconcile runs from a cache that has not seen calendar's new status.
    e.reconcile_adapter_lagging("mail", &before).await;
    let merged: Vec<&str> = ["calendar", "mail"]
        .into_iter()
        .filter(|n| e.get(&adapter_path(n)).unwrap()["status"]["fleet"]["merged"] == true)
        .collect();
    assert_eq!(merged.len(), 1, "merged for a budget of 1 GPU: {merged:?}");
    assert_eq!(e.jobs().len(), 1, "merge Jobs: {:?}", e.jobs());
    let other = if merged[0] == "calendar" {
        "mail"
    } else {
        "calendar"
    };
    assert_eq!(
        e.get(&adapter_path(other)).unwrap()["status"]["fleet"]["reason"],
        "BudgetExhausted"
    );
}
