//! The operator against Kubernetes' own API server: etcd, kube-apiserver,
//! kube-controller-manager and kube-scheduler built from their Go modules
//! (`scripts/k8s-bins.sh`) and started on loopback per test (`mole_tests::cluster`); the chart
//! installed by helm, the operator run as the chart's ServiceAccount, the samples applied with
//! kubectl.
//!
//! Ignored by a plain `cargo test` (they need the control plane's binaries and take minutes);
//! `scripts/checks/control-plane.sh` builds what is missing and runs them with `--ignored`, and
//! reports the suite SKIPPED, never passed, where the Go module proxy cannot be reached.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test is a failed test

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Service};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{ListParams, Patch, PatchParams};
use kube::{Api, Client};
use mole_crds::{Adapter, InferencePool};
use mole_operator::controller::{self, Context, PodClient};
use mole_operator::telemetry::Metrics;
use mole_tests::cluster::{self, wait_for, ControlPlane, Parts};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// helm: `MOLE_HELM`, else `$MOLE_CACHE/bin/helm` (scripts/tools.sh), else the PATH's.
fn helm() -> PathBuf {
    if let Some(h) = std::env::var_os("MOLE_HELM") {
        return h.into();
    }
    let cache = std::env::var_os("MOLE_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(&std::env::var_os("HOME").unwrap()).join(".cache/mole"));
    let h = cache.join("bin/helm");
    if h.is_file() {
        h
    } else {
        "helm".into()
    }
}

/// The operator binary of this build (`MOLE_OPERATOR_BIN`, else beside the test's own
/// target directory: `cargo build -p mole-operator` puts it there).
fn operator_bin() -> PathBuf {
    if let Some(b) = std::env::var_os("MOLE_OPERATOR_BIN") {
        return b.into();
    }
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().unwrap().parent().unwrap();
    let bin = profile_dir.join("mole-operator");
    assert!(
        bin.is_file(),
        "{} is missing: cargo build -p mole-operator",
        bin.display()
    );
    bin
}

/// A control plane with the chart installed in `mole-system` (no operator pods: the tests
/// run the operator themselves) and namespace `ml`.
struct Cluster {
    cp: ControlPlane,
    /// What `helm install` printed on stderr (its warnings).
    helm_stderr: String,
}

impl Cluster {
    async fn up(parts: Parts) -> Self {
        let cp = ControlPlane::start(parts).await.unwrap();
        let out = Command::new(helm())
            .env("KUBECONFIG", &cp.kubeconfig)
            .env("HELM_CACHE_HOME", cp.dir.path().join("helm-cache"))
            .env("HELM_CONFIG_HOME", cp.dir.path().join("helm-config"))
            .env("HELM_DATA_HOME", cp.dir.path().join("helm-data"))
            .args(["install", "mole"])
            .arg(repo().join("charts/mole"))
            .args([
                "--namespace",
                "mole-system",
                "--create-namespace",
                "--set",
                "replicaCount=0",
                "--wait=false",
            ])
            .output()
            .unwrap();
        let helm_stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "helm install: {helm_stderr}");
        cp.kubectl(&["create", "namespace", "ml"]).unwrap();
        Self { cp, helm_stderr }
    }

    async fn admin(&self) -> Client {
        self.cp.client().await.unwrap()
    }

    /// A kubeconfig of the chart's ServiceAccount (its RBAC, enforced by the real authorizer).
    fn operator_kubeconfig(&self) -> PathBuf {
        let token = self.cp.token("mole-system", "mole-operator").unwrap();
        self.cp.token_kubeconfig("operator", &token).unwrap()
    }

    async fn operator_client(&self) -> Client {
        cluster::client_from(&self.operator_kubeconfig())
            .await
            .unwrap()
    }

    /// `kubectl apply -f` of each sample under config/samples named in `files`.
    fn apply_samples(&self, files: &[&str]) {
        for f in files {
            let yaml = std::fs::read_to_string(repo().join("config/samples").join(f)).unwrap();
            self.cp.apply(&yaml).unwrap();
        }
    }

    /// Starts the operator binary as the chart's ServiceAccount, with leader election on the
    /// chart's Lease; its output goes to `<dir>/<identity>.log`.
    fn spawn_operator(&self, identity: &str, kubeconfig: &Path) -> Operator {
        let log = self.cp.dir.path().join(format!("{identity}.log"));
        let out = std::fs::File::create(&log).unwrap();
        let port = cluster::free_port();
        let child = Command::new("setpriv")
            .arg("--pdeathsig=KILL")
            .arg(operator_bin())
            .arg("run")
            .env("KUBECONFIG", kubeconfig)
            .env("MOLE_OPERATOR_LISTEN", format!("127.0.0.1:{port}"))
            .env("MOLE_LEADER_ELECT", "true")
            .env("MOLE_LEADER_LEASE", "mole-operator-leader")
            .env("MOLE_LEADER_NAMESPACE", "mole-system")
            .env("MOLE_LEADER_LEASE_DURATION", "15")
            .env("MOLE_LEADER_RENEW_DEADLINE", "10")
            .env("POD_NAME", identity)
            .env("MOLE_LOG", "info")
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap();
        Operator {
            child,
            log,
            identity: identity.into(),
        }
    }
}

struct Operator {
    child: Child,
    log: PathBuf,
    identity: String,
}

impl Operator {
    fn sigterm(&self) {
        let ok = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -TERM {}", self.child.id());
    }

    /// Waits up to `within` for the process to exit; its exit status.
    async fn exited_within(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Some(s) = self.child.try_wait().unwrap() {
                return Some(s);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        None
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `controller::run` (the wiring `mole-operator run` uses) in this process with `client`.
fn run_in_process(client: Client) -> tokio::task::JoinHandle<()> {
    let ctx = Context::new(
        client.clone(),
        "in-process".into(),
        Metrics::new(),
        PodClient::new(mole_crds::constants::WORKER_PORT),
    );
    tokio::spawn(controller::run(
        client,
        None,
        ctx,
        std::future::pending::<()>(),
    ))
}

/// Waits until pool `pool` of `ml` has its ConfigMap, dynamic Deployment, Service and PDB.
async fn pool_children(client: &Client, pool: &str, within: Duration) -> Result<()> {
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "ml");
    let deploys: Api<Deployment> = Api::namespaced(client.clone(), "ml");
    let svcs: Api<Service> = Api::namespaced(client.clone(), "ml");
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(client.clone(), "ml");
    wait_for(within, &format!("pool {pool}'s objects"), || async {
        let cm = cms.get_opt(&format!("{pool}-config")).await.ok()??;
        let d = deploys.get_opt(&format!("{pool}-dynamic")).await.ok()??;
        let s = svcs.get_opt(pool).await.ok()??;
        let p = pdbs.get_opt(&format!("{pool}-dynamic")).await.ok()??;
        Some((cm, d, s, p))
    })
    .await
    .map(|_| ())
}

/// Every write (create, update, patch, apply, delete) the API server served of the pools'
/// and Adapters' children since `before`.
fn child_writes(
    before: &std::collections::BTreeMap<(String, String), f64>,
    after: &std::collections::BTreeMap<(String, String), f64>,
) -> Vec<String> {
    const WRITES: &[&str] = &["CREATE", "UPDATE", "PATCH", "APPLY", "DELETE"];
    const CHILDREN: &[&str] = &[
        "deployments",
        "services",
        "configmaps",
        "poddisruptionbudgets",
        "jobs",
        "horizontalpodautoscalers",
    ];
    after
        .iter()
        .filter(|((verb, res), _)| {
            WRITES.contains(&verb.as_str()) && CHILDREN.contains(&res.as_str())
        })
        .filter_map(|(k, v)| {
            let d = v - before.get(k).copied().unwrap_or(0.0);
            (d > 0.0).then(|| format!("{} {}: {d}", k.0, k.1))
        })
        .collect()
}

/// A user's first minutes: `helm install` prints no warnings, the samples apply, and the
/// operator (its real wiring, `controller::run`, as the chart's ServiceAccount) gives every
/// pool its ConfigMap, Deployment, Service and PDB. On 47abd32 no pool ever got them: its
/// reconciles waited forever for the Adapter store (kube-runtime's ready signal wakes one
/// waiter of several).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real control plane: scripts/checks/control-plane.sh"]
async fn the_operator_creates_every_pools_objects_on_a_real_api_server() {
    let c = Cluster::up(Parts {
        controller_manager: true,
        scheduler: false,
    })
    .await;
    c.apply_samples(&[
        "pool-qwen3-vl-8b.yaml",
        "pool-qwen3-4b.yaml",
        "adapter-calendar.yaml",
        "adapter-login-window.yaml",
        "adapter-qwen3-sql.yaml",
    ]);
    let op = c.operator_client().await;
    let task = run_in_process(op);
    let admin = c.admin().await;
    for pool in ["qwen3-vl", "qwen3"] {
        pool_children(&admin, pool, Duration::from_secs(60))
            .await
            .unwrap();
    }
    // Nothing the operator did was refused: no Warning Event anywhere.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let events: Api<Event> = Api::namespaced(admin.clone(), "ml");
    let warnings: Vec<String> = events
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.type_.as_deref() == Some("Warning"))
        .map(|e| format!("{:?}: {:?}", e.reason, e.note))
        .collect();
    assert!(warnings.is_empty(), "Warning Events: {warnings:#?}");
    assert!(
        !c.helm_stderr.contains("unrecognized format"),
        "helm install warned about the CRDs' schemas: {}",
        c.helm_stderr
    );
    task.abort();
}

/// With nothing changing, the operator writes none of its children: on 47abd32 a pool whose
/// base model comes from `hf://` re-applied its Deployment on every reconcile (it rendered
/// `readOnly: false`, which the server drops), and a sidecar another manager added to a
/// Deployment made it re-apply forever too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real control plane: scripts/checks/control-plane.sh"]
async fn a_quiet_minute_writes_nothing() {
    let c = Cluster::up(Parts {
        controller_manager: true,
        scheduler: false,
    })
    .await;
    // Every sample: a dynamic and a merged adapter (its merge Job), both pools.
    c.apply_samples(&[
        "pool-qwen3-vl-8b.yaml",
        "pool-qwen3-4b.yaml",
        "adapter-qwen3-sql.yaml",
        "adapter-calendar.yaml",
        "adapter-login-window.yaml",
        "adapter-desktop.yaml",
    ]);
    let task = run_in_process(c.operator_client().await);
    let admin = c.admin().await;
    for pool in ["qwen3-vl", "qwen3"] {
        pool_children(&admin, pool, Duration::from_secs(60))
            .await
            .unwrap();
    }
    // Another manager (an injector, a user's `kubectl patch`) adds a sidecar to one pool's
    // pods: theirs to keep, and no reason to write.
    c.cp.kubectl(&[
        "patch",
        "deployment",
        "qwen3-vl-dynamic",
        "-n",
        "ml",
        "--type=strategic",
        "-p",
        r#"{"spec":{"template":{"spec":{"containers":[{"name":"proxy","image":"envoyproxy/envoy:v1.34"}]}}}}"#,
    ])
    .unwrap();
    // Let the reconciles the patch and the first writes caused settle.
    tokio::time::sleep(Duration::from_secs(15)).await;
    let before = c.cp.request_counts().await.unwrap();
    // The pool controller requeues every few seconds while pods are missing: a window of
    // 40 s holds several reconciles of each pool.
    tokio::time::sleep(Duration::from_secs(40)).await;
    let after = c.cp.request_counts().await.unwrap();
    let writes = child_writes(&before, &after);
    // Every request in the window, for the record (status writes and reads included).
    let all: Vec<String> = after
        .iter()
        .filter_map(|(k, v)| {
            let d = v - before.get(k).copied().unwrap_or(0.0);
            (d > 0.0).then(|| format!("{} {}: {d}", k.0, k.1))
        })
        .collect();
    eprintln!("requests in 40 s: {all:?}");
    assert!(writes.is_empty(), "writes in a quiet window: {writes:?}");
    let d: Deployment = Api::namespaced(admin.clone(), "ml")
        .get("qwen3-vl-dynamic")
        .await
        .unwrap();
    let containers: Vec<String> = d
        .spec
        .unwrap()
        .template
        .spec
        .unwrap()
        .containers
        .into_iter()
        .map(|c| c.name)
        .collect();
    assert!(
        containers.iter().any(|n| n == "proxy"),
        "the sidecar another manager added was removed: {containers:?}"
    );
    task.abort();
}

/// `kubectl rollout` and node drains send SIGTERM: the leader stops within the pod's grace
/// period (30 s by default; we hold it to 10) and hands its Lease over at once, so the
/// standby leads within a retry period, not a lease duration. On 47abd32 SIGTERM waited on
/// reconciles that never ended, and the Lease was never released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real control plane: scripts/checks/control-plane.sh"]
async fn sigterm_stops_the_leader_and_hands_the_lease_over() {
    let c = Cluster::up(Parts {
        controller_manager: true,
        scheduler: false,
    })
    .await;
    c.apply_samples(&["pool-qwen3-vl-8b.yaml", "adapter-calendar.yaml"]);
    let kc = c.operator_kubeconfig();
    let mut a = c.spawn_operator("operator-a", &kc);
    let admin = c.admin().await;
    let leases: Api<Lease> = Api::namespaced(admin.clone(), "mole-system");
    let holder = |leases: Api<Lease>| async move {
        leases
            .get_opt("mole-operator-leader")
            .await
            .ok()
            .flatten()
            .and_then(|l| l.spec?.holder_identity)
            .filter(|h| !h.is_empty())
    };
    let first = wait_for(Duration::from_secs(30), "a leader", || {
        holder(leases.clone())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", a.log()));
    assert_eq!(first, "operator-a");
    let mut b = c.spawn_operator("operator-b", &kc);
    pool_children(&admin, "qwen3-vl", Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", a.log()));
    // The standby has tried at least once and found the Lease held.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(holder(leases.clone()).await.as_deref(), Some("operator-a"));
    let t0 = Instant::now();
    a.sigterm();
    let status = a.exited_within(Duration::from_secs(10)).await;
    assert!(
        status.is_some(),
        "the operator did not exit within 10 s of SIGTERM:\n{}",
        a.log()
    );
    assert!(
        status.unwrap().success(),
        "exit on SIGTERM: {status:?}\n{}",
        a.log()
    );
    // The standby retries every lease_duration/3 = 5 s: with the Lease released it leads at
    // its next try, well before the 15 s an expiry would take.
    let next = wait_for(Duration::from_secs(30), "a new leader", || async {
        holder(leases.clone()).await.filter(|h| h != "operator-a")
    })
    .await
    .unwrap();
    let took = t0.elapsed();
    assert_eq!(next, b.identity);
    assert!(
        took < Duration::from_secs(9),
        "the standby led only {took:?} after SIGTERM (the Lease was not released)\n{}",
        a.log()
    );
    // The new leader stops as promptly.
    b.sigterm();
    assert!(
        b.exited_within(Duration::from_secs(10)).await.is_some(),
        "the new leader did not exit within 10 s of SIGTERM:\n{}",
        b.log()
    );
}

/// A pool whose `storage.mountPath` the API server would refuse in its Deployment is refused
/// up front with a condition and an Event naming the field; fixing it clears the refusal,
/// and the conditions never keep an earlier one. On 47abd32 `/tmp` passed validation, the
/// server refused the Deployment (duplicate mountPath) on every retry, and the condition
/// showed an earlier, already-fixed refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real control plane: scripts/checks/control-plane.sh"]
async fn a_mount_path_the_server_refuses_is_refused_up_front_and_not_kept() {
    let c = Cluster::up(Parts {
        controller_manager: false,
        scheduler: false,
    })
    .await;
    let admin = c.admin().await;
    let task = run_in_process(c.operator_client().await);
    let pools: Api<InferencePool> = Api::namespaced(admin.clone(), "ml");
    let pool = |mount: &str, gpus: i64| {
        serde_json::json!({
            "apiVersion": "mole.dev/v1alpha1", "kind": "InferencePool",
            "metadata": {"name": "p", "namespace": "ml"},
            "spec": {"baseModel": {"name": "m", "path": "base/m"},
                     "storage": {"claimName": "models", "mountPath": mount},
                     "gpu": {"count": gpus}, "dynamic": {"replicas": 1}}
        })
    };
    let apply = |v: serde_json::Value| {
        let pools = pools.clone();
        async move {
            pools
                .patch("p", &PatchParams::apply("test").force(), &Patch::Apply(v))
                .await
                .unwrap();
        }
    };
    let ready_condition = |pools: Api<InferencePool>| async move {
        let p = pools.get("p").await.ok()?;
        p.status?
            .conditions
            .into_iter()
            .find(|c| c.type_ == "Ready")
    };
    // First an unrelated refusal (no GPU without the CPU annotation), then fixed but with
    // /tmp.
    apply(pool("/models", 0)).await;
    wait_for(Duration::from_secs(30), "the gpu.count refusal", || async {
        ready_condition(pools.clone())
            .await
            .filter(|c| c.message.contains("gpu.count"))
    })
    .await
    .unwrap();
    apply(pool("/tmp", 1)).await;
    let refused = match wait_for(Duration::from_secs(30), "the mountPath refusal", || async {
        ready_condition(pools.clone())
            .await
            .filter(|c| c.message.contains("mountPath"))
    })
    .await
    {
        Ok(c) => c,
        Err(e) => {
            let p = pools.get("p").await.unwrap();
            panic!("{e}: the pool's status is {:#?}", p.status)
        }
    };
    assert_eq!(refused.status, "False");
    assert!(
        !refused.message.contains("gpu.count"),
        "the fixed refusal is kept: {}",
        refused.message
    );
    let deploys: Api<Deployment> = Api::namespaced(admin.clone(), "ml");
    assert!(
        deploys.get_opt("p-dynamic").await.unwrap().is_none(),
        "a Deployment the server must refuse was not refused up front"
    );
    let events: Api<Event> = Api::namespaced(admin.clone(), "ml");
    let notes: Vec<String> = events
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.type_.as_deref() == Some("Warning"))
        .filter_map(|e| e.note)
        .collect();
    assert!(
        notes.iter().any(|n| n.contains("storage.mountPath")),
        "no Warning Event names storage.mountPath: {notes:#?}"
    );
    assert!(
        notes.iter().all(|n| !n.contains("Status {")),
        "an Event holds a raw API error: {notes:#?}"
    );
    apply(pool("/models", 1)).await;
    pool_children(&admin, "p", Duration::from_secs(30))
        .await
        .unwrap();
    let after = ready_condition(pools.clone()).await.unwrap();
    assert!(
        !after.message.contains("mountPath"),
        "the fixed refusal is kept: {}",
        after.message
    );
    task.abort();
}

/// Every Adapter's first reconcile succeeds: on some starts of 47abd32 each failed with 422
/// "failed to add finalizer" (a JSON-patch test against a cache that had not seen the last
/// write), and the Warning Event held a raw `Status { .. }` dump. Restarts are repeated to
/// catch the race.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real control plane: scripts/checks/control-plane.sh"]
async fn adapters_get_their_finalizer_without_errors_on_every_start() {
    let c = Cluster::up(Parts {
        controller_manager: false,
        scheduler: false,
    })
    .await;
    c.apply_samples(&[
        "pool-qwen3-vl-8b.yaml",
        "adapter-calendar.yaml",
        "adapter-login-window.yaml",
        "adapter-desktop.yaml",
        "adapter-appointment.yaml",
    ]);
    let admin = c.admin().await;
    let adapters: Api<Adapter> = Api::namespaced(admin.clone(), "ml");
    let kc = c.operator_kubeconfig();
    for round in 0..3 {
        let client = cluster::client_from(&kc).await.unwrap();
        let task = run_in_process(client);
        wait_for(
            Duration::from_secs(30),
            "every Adapter's finalizer",
            || async {
                let list = adapters.list(&ListParams::default()).await.ok()?;
                list.items
                    .iter()
                    .all(|a| {
                        a.metadata
                            .finalizers
                            .as_ref()
                            .is_some_and(|f| !f.is_empty())
                            && a.status.is_some()
                    })
                    .then_some(())
            },
        )
        .await
        .unwrap();
        tokio::time::sleep(Duration::from_secs(2)).await;
        task.abort();
        let _ = task.await;
        let events: Api<Event> = Api::namespaced(admin.clone(), "ml");
        let bad: Vec<String> = events
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .filter(|e| e.type_.as_deref() == Some("Warning"))
            .map(|e| format!("{:?}: {:?}", e.reason, e.note))
            .collect();
        assert!(bad.is_empty(), "round {round}: Warning Events {bad:#?}");
        // Next round starts from scratch: finalizers gone, as after a fresh apply.
        for a in adapters.list(&ListParams::default()).await.unwrap().items {
            let name = a.metadata.name.clone().unwrap();
            adapters
                .patch(
                    &name,
                    &PatchParams::default(),
                    &Patch::Merge(serde_json::json!({"metadata": {"finalizers": null}})),
                )
                .await
                .unwrap();
        }
    }
}

/// The chart's CRDs install without warnings from the server (formats it does not know).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real control plane: scripts/checks/control-plane.sh"]
async fn the_crds_apply_without_warnings() {
    let cp = ControlPlane::start(Parts {
        controller_manager: false,
        scheduler: false,
    })
    .await
    .unwrap();
    for f in ["adapters.mole.dev.yaml", "inferencepools.mole.dev.yaml"] {
        let yaml = std::fs::read_to_string(repo().join("charts/mole/crds").join(f)).unwrap();
        let warnings = cp.apply(&yaml).unwrap();
        assert!(
            !warnings.to_lowercase().contains("warning"),
            "kubectl apply -f {f}: {warnings}"
        );
    }
}

/// Sanity of the harness itself: a control plane comes up and reports its version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real control plane: scripts/checks/control-plane.sh"]
async fn the_control_plane_is_the_pinned_kubernetes() -> Result<()> {
    let cp = ControlPlane::start(Parts {
        controller_manager: false,
        scheduler: false,
    })
    .await?;
    let v = cp.client().await?.apiserver_version().await?;
    if v.git_version != cluster::K8S_VERSION {
        bail!("server {} is not {}", v.git_version, cluster::K8S_VERSION);
    }
    let out = cp
        .kubectl(&["version", "-o", "json"])
        .context("kubectl version")?;
    assert!(out.contains(cluster::K8S_VERSION), "{out}");
    Ok(())
}

/// Turning autoscaling on hands `spec.replicas` to the HPA on the real server: the count
/// stays what it was (no pod goes), the operator's field manager stops owning it (its
/// managedFields as the server records them), a scale by the HPA (here `kubectl scale`, what
/// the HPA controller's `/scale` write amounts to) is never put back, even when the pod
/// template changes, and a quiet window writes nothing. Turning it off takes the count back
/// and removes the HPA.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real control plane: scripts/checks/control-plane.sh"]
async fn the_replicas_are_handed_to_the_hpa_and_back() {
    use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
    let c = Cluster::up(Parts {
        controller_manager: true,
        scheduler: false,
    })
    .await;
    let admin = c.admin().await;
    let task = run_in_process(c.operator_client().await);
    let pools: Api<InferencePool> = Api::namespaced(admin.clone(), "ml");
    let deploys: Api<Deployment> = Api::namespaced(admin.clone(), "ml");
    let hpas: Api<HorizontalPodAutoscaler> = Api::namespaced(admin.clone(), "ml");
    let pool = |dynamic: serde_json::Value| {
        serde_json::json!({
            "apiVersion": "mole.dev/v1alpha1", "kind": "InferencePool",
            "metadata": {"name": "p", "namespace": "ml"},
            "spec": {"baseModel": {"name": "m", "path": "base/m"},
                     "storage": {"claimName": "models"}, "gpu": {"count": 1}, "dynamic": dynamic}
        })
    };
    let apply = |v: serde_json::Value| {
        let pools = pools.clone();
        async move {
            pools
                .patch("p", &PatchParams::apply("user").force(), &Patch::Apply(v))
                .await
                .unwrap();
        }
    };
    let owns_replicas = |d: &Deployment| {
        d.metadata.managed_fields.iter().flatten().any(|m| {
            m.manager.as_deref() == Some("mole-operator/pool-deployment")
                && m.fields_v1
                    .as_ref()
                    .is_some_and(|f| f.0["f:spec"].get("f:replicas").is_some())
        })
    };
    let replicas = |d: &Deployment| d.spec.as_ref().and_then(|s| s.replicas);
    apply(pool(serde_json::json!({"replicas": 2}))).await;
    let d = wait_for(Duration::from_secs(30), "p-dynamic at 2", || async {
        deploys
            .get_opt("p-dynamic")
            .await
            .ok()
            .flatten()
            .filter(|d| replicas(d) == Some(2))
    })
    .await
    .unwrap();
    assert!(owns_replicas(&d));
    apply(pool(serde_json::json!({
        "autoscaling": {"minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": 4}
    })))
    .await;
    wait_for(Duration::from_secs(30), "the HPA", || async {
        hpas.get_opt("p-dynamic").await.ok().flatten()
    })
    .await
    .unwrap();
    let d = wait_for(Duration::from_secs(30), "the count handed over", || async {
        deploys
            .get_opt("p-dynamic")
            .await
            .ok()
            .flatten()
            .filter(|d| !owns_replicas(d))
    })
    .await
    .unwrap();
    assert_eq!(replicas(&d), Some(2), "the hand-over kept the count");
    // The HPA scales.
    c.cp.kubectl(&[
        "scale",
        "deployment",
        "p-dynamic",
        "-n",
        "ml",
        "--replicas=3",
    ])
    .unwrap();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let before = c.cp.request_counts().await.unwrap();
    tokio::time::sleep(Duration::from_secs(20)).await;
    let after = c.cp.request_counts().await.unwrap();
    let writes = child_writes(&before, &after);
    assert!(writes.is_empty(), "writes in a quiet window: {writes:?}");
    assert_eq!(replicas(&deploys.get("p-dynamic").await.unwrap()), Some(3));
    // A change of the pod template is applied, and the count stays the HPA's.
    apply(pool(serde_json::json!({
        "autoscaling": {"minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": 4},
        "maxQueue": 64
    })))
    .await;
    let hash = |d: &Deployment| {
        d.spec
            .as_ref()
            .and_then(|s| s.template.metadata.as_ref())
            .and_then(|m| m.annotations.as_ref())
            .and_then(|a| a.get("mole.dev/spec-hash").cloned())
    };
    let old = hash(&d);
    let d = wait_for(Duration::from_secs(30), "the new template", || async {
        deploys
            .get_opt("p-dynamic")
            .await
            .ok()
            .flatten()
            .filter(|d| hash(d) != old)
    })
    .await
    .unwrap();
    assert_eq!(replicas(&d), Some(3), "the operator put the count back");
    // Autoscaling off: the count is the operator's again and the HPA goes.
    apply(pool(serde_json::json!({"replicas": 1}))).await;
    wait_for(Duration::from_secs(30), "the count taken back", || async {
        let d = deploys.get_opt("p-dynamic").await.ok().flatten()?;
        let gone = hpas.get_opt("p-dynamic").await.ok()?.is_none();
        (replicas(&d) == Some(1) && owns_replicas(&d) && gone).then_some(())
    })
    .await
    .unwrap();
    task.abort();
}

/// An operator restarted while a merge Job is under way (here: its pod never runs, so the
/// Job stays active) finds it by its deterministic name and creates no second one; deleting
/// the pool then removes everything it and its Adapters made, by the garbage collector's
/// owner references (kube-controller-manager's), and the Adapters' finalizers let them go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real control plane: scripts/checks/control-plane.sh"]
async fn a_restart_mid_merge_makes_no_second_job_and_deleting_the_pool_leaves_nothing() {
    use k8s_openapi::api::batch::v1::Job;
    let c = Cluster::up(Parts {
        controller_manager: true,
        scheduler: false,
    })
    .await;
    c.apply_samples(&[
        "pool-qwen3-vl-8b.yaml",
        "adapter-calendar.yaml",
        "adapter-login-window.yaml",
    ]);
    let admin = c.admin().await;
    let jobs: Api<Job> = Api::namespaced(admin.clone(), "ml");
    let merge_jobs = |jobs: Api<Job>| async move {
        jobs.list(&ListParams::default())
            .await
            .map(|l| {
                l.items
                    .into_iter()
                    .filter_map(|j| j.metadata.name)
                    .filter(|n| n.starts_with("merge-"))
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default()
    };
    let kc = c.operator_kubeconfig();
    let first = run_in_process(cluster::client_from(&kc).await.unwrap());
    let before = wait_for(Duration::from_secs(60), "the merge Job", || async {
        let j = merge_jobs(jobs.clone()).await;
        (!j.is_empty()).then_some(j)
    })
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    first.abort();
    let _ = first.await;
    let second = run_in_process(cluster::client_from(&kc).await.unwrap());
    // Long enough for the restarted operator to reconcile every Adapter more than once.
    tokio::time::sleep(Duration::from_secs(15)).await;
    assert_eq!(merge_jobs(jobs.clone()).await, before, "a second merge Job");
    // Delete the pool: its children and the Adapters' go by owner references.
    c.cp.kubectl(&[
        "delete",
        "inferencepool",
        "qwen3-vl",
        "-n",
        "ml",
        "--wait=false",
    ])
    .unwrap();
    c.cp.kubectl(&["delete", "adapters", "--all", "-n", "ml", "--wait=false"])
        .unwrap();
    let left = wait_for(Duration::from_secs(60), "nothing left in ml", || async {
        let out =
            c.cp.kubectl(&[
                "get",
                "deployments,services,configmaps,poddisruptionbudgets,jobs,adapters,inferencepools",
                "-n",
                "ml",
                "-l",
                "app.kubernetes.io/managed-by=mole-operator",
                "-o",
                "name",
            ])
            .ok()?;
        let crs =
            c.cp.kubectl(&["get", "adapters,inferencepools", "-n", "ml", "-o", "name"])
                .ok()?;
        (out.trim().is_empty() && crs.trim().is_empty()).then_some(())
    })
    .await;
    if let Err(e) = left {
        let all =
            c.cp.kubectl(&["get", "all,adapters,inferencepools,configmaps", "-n", "ml"]);
        panic!("{e}: {all:?}");
    }
    second.abort();
}
