//! `mole-cluster`: mole on a Kubernetes control plane of its own, on this machine, to look at
//! and to try (`scripts/run-cluster.sh` builds and runs it).
//!
//! It starts etcd, kube-apiserver, kube-controller-manager and kube-scheduler on loopback
//! (`mole_tests::cluster`, the binaries `scripts/k8s-bins.sh` built), a node whose pods run as
//! local processes in network namespaces of their own (`mole_tests::kubelet`; the worker image
//! runs the `mole-worker` given), installs `charts/mole` with helm, whose operator Deployment's
//! pod runs the `mole-operator` given in-cluster, as users run it (`mole_tests::stack`), lays out
//! SmolLM2-135M-Instruct and the demo adapters on a hostPath PersistentVolume, applies a pool
//! (`demo`) and two Adapters (`french`, served by the pool's dynamic pods; `json`, merged by a
//! Job and served by its own pods), waits until they are Ready, prints what to try, and runs
//! until Ctrl+C (or SIGTERM), which stops and removes everything.
//!
//! Needs root (network namespaces, a bridge, mounts, cgroups), as the test kubelet does.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use clap::Parser;
use mole_tests::stack::{self, Fixture, Mole, OperatorMode, Options, NS, SMOLLM2};

/// mole on a local Kubernetes control plane (see the crate's `src/bin/mole-cluster.rs`).
#[derive(Parser, Debug)]
struct Args {
    /// The worker binary the node runs for the worker image.
    #[arg(long, env = "MOLE_WORKER_BIN")]
    worker: Option<PathBuf>,
    /// The operator binary.
    #[arg(long, env = "MOLE_OPERATOR_BIN")]
    operator: Option<PathBuf>,
    /// Where the model volume's directory is made (default: the system's temporary directory;
    /// it is removed on exit). The same filesystem as `$MOLE_CACHE` saves copying the base.
    #[arg(long)]
    models_parent: Option<PathBuf>,
}

/// The pool applied: SmolLM2 on CPU, one dynamic pod, routing by name and keywords.
fn demo_pool() -> String {
    stack::cpu_pool(
        "demo",
        SMOLLM2,
        "  dynamic: {replicas: 1}\n  router: {strategies: [explicit, keywords]}",
    )
}

/// The Adapters applied to [`demo_pool`].
const ADAPTERS: &str = r#"
apiVersion: mole.dev/v1alpha1
kind: Adapter
metadata: {name: french, namespace: ml}
spec:
  pool: demo
  version: v1
  source: {path: adapters/french/v1}
  keywords: [french, bonjour]
  description: Answers in French.
---
apiVersion: mole.dev/v1alpha1
kind: Adapter
metadata: {name: json, namespace: ml}
spec:
  pool: demo
  version: v1
  source: {path: adapters/json/v1}
  keywords: [json]
  description: Answers as a JSON object.
  serving: {mode: merged}
"#;

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("Uid:"))
        .and_then(|l| l.split_whitespace().nth(2))
        == Some("0")
}

fn step(t0: Instant, what: &str) {
    eprintln!("[{:5.1} s] {what}", t0.elapsed().as_secs_f64());
}

/// Resolves at Ctrl+C or SIGTERM.
async fn interrupted() -> Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r?,
        _ = term.recv() => {}
    }
    Ok(())
}

async fn up(args: Args, t0: Instant) -> Result<Mole> {
    let worker = match args.worker {
        Some(w) => w,
        None => stack::built_bin("MOLE_WORKER_BIN", "mole-worker")?,
    };
    let operator = match args.operator {
        Some(o) => o,
        None => stack::built_bin("MOLE_OPERATOR_BIN", "mole-operator")?,
    };
    step(
        t0,
        &format!(
            "control plane, chart, node, operator ({}), worker {}",
            operator.display(),
            worker.display()
        ),
    );
    let m = Mole::start(Options {
        worker,
        operator: OperatorMode::Pod(operator),
        fixture: Fixture::SmolLm2,
        models_parent: args.models_parent,
        // As long as anyone keeps it running.
        token_ttl: Duration::from_secs(7 * 24 * 3600),
    })
    .await?;
    step(t0, "applying pool demo and Adapters french and json");
    m.cp.apply(&format!("{}---{ADAPTERS}", demo_pool()))?;
    m.wait_pool_ready("demo", Duration::from_secs(300)).await?;
    step(t0, "pool demo Ready");
    for (name, mode) in [
        ("french", mole_crds::ServingMode::Dynamic),
        ("json", mole_crds::ServingMode::Merged),
    ] {
        m.wait_adapter(name, Duration::from_secs(600), |st| {
            st.phase == mole_crds::AdapterPhase::Ready && st.serving_mode == Some(mode)
        })
        .await?;
        step(t0, &format!("adapter {name} Ready ({mode:?})"));
    }
    Ok(m)
}

fn instructions(m: &Mole, url: &str) -> String {
    let kc = m.cp.kubeconfig.display();
    let kubectl = m.cp.bins().join("kubectl");
    let chat = |model: &str, text: &str| {
        format!(
            "curl -s {url}/v1/chat/completions -H 'content-type: application/json' \\\n    \
             -d '{{\"model\": \"{model}\", \"max_tokens\": 32, \"messages\": [{{\"role\": \
             \"user\", \"content\": \"{text}\"}}]}}'"
        )
    };
    format!(
        "\nmole runs on a local Kubernetes (v{k8s}); pods are processes on this machine.\n\n\
         KUBECONFIG={kc}\n\n\
         Try:\n\
         export KUBECONFIG={kc}\n\
         alias kubectl={kubectl}\n\
         kubectl get inferencepools,adapters -n {NS}\n\
         kubectl get pods,jobs -n {NS} -o wide\n\
         kubectl describe adapter json -n {NS}\n\
         kubectl logs -n {NS} deploy/demo-dynamic\n\
         kubectl logs -n mole-system deploy/{operator}\n\n\
         The pool's Service (demo.{NS}.svc) has a ready pod at {url}:\n\
         curl -s {url}/v1/models\n\
         {french}\n\
         {json}\n\
         {routed}\n\n\
         Base model {SMOLLM2} and the adapters are on the volume at {models}.\n\
         Ctrl+C stops and removes everything.\n",
        k8s = mole_tests::cluster::K8S_VERSION.trim_start_matches('v'),
        kubectl = kubectl.display(),
        french = chat("french", "Tell me about bees."),
        json = chat("json", "Describe a bee."),
        routed = chat("demo", "Bonjour! Tell me about bees."),
        models = m.models.display(),
        operator = stack::OPERATOR_DEPLOYMENT,
    )
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let args = Args::parse();
    if !is_root() {
        bail!("mole-cluster needs root: its pods get network namespaces, a bridge, mounts and cgroups");
    }
    let t0 = Instant::now();
    // Interrupted while starting: what was started is dropped (and removed) on the way out.
    let m = tokio::select! {
        m = up(args, t0) => m?,
        r = interrupted() => {
            r?;
            eprintln!("interrupted while starting; removing what was started");
            return Ok(());
        }
    };
    let url = m.service_url("demo").await.context("the pool's Service")?;
    println!("{}", instructions(&m, &url));
    // The operator is the chart's pod: its Deployment restarts it as a cluster would.
    interrupted().await?;
    eprintln!("stopping: operator, pods, control plane; removing the volume and the network");
    drop(m);
    eprintln!("done");
    Ok(())
}
