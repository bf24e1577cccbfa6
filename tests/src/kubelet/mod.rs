//! A kubelet for tests: pods as local processes on a node of the test's [`ControlPlane`].
//!
//! [`Kubelet::start`] registers a Node (Ready, with the capacity and labels the test gives,
//! `nvidia.com/gpu` included), keeps it alive as a kubelet does (Lease renewed every 10 s,
//! status heartbeats), watches the pods bound to it and runs them:
//! - each pod gets a network namespace and an address of its own on a bridge the kubelet
//!   makes (the API server refuses loopback addresses in EndpointSlices); the bridge's
//!   gateway is the node's InternalIP, on the host, so the test reaches pod IPs directly;
//! - each container is a local process in that namespace and a mount namespace of its own
//!   whose root is the host's, copy-on-write (`readOnlyRootFilesystem` honored), with the
//!   pod's volumes mounted at their `mountPath`s (`runtime`), as the pod's user (`runAsUser`,
//!   `runAsGroup`, `fsGroup`, `runAsNonRoot` checked); an image maps to a host binary by
//!   prefix ([`KubeletConfig::images`]); images that map to nothing fail to pull
//!   (`ErrImagePull`, `ImagePullBackOff`);
//! - volumes (`volumes`): emptyDir, configMap and secret (re-synced within a second or two
//!   of a change, atomically), projected (serviceAccountToken by TokenRequest, configMap,
//!   secret, downwardAPI), downwardAPI, hostPath, persistentVolumeClaim (the bound PV's
//!   hostPath or local path);
//! - status as a kubelet reports it (`pod`): phase, podIP, conditions, init containers in
//!   order, container states with exit codes and termination messages, restarts with
//!   back-off, startup/readiness/liveness probes (httpGet, tcpSocket, exec); deletion with
//!   SIGTERM, the grace period, SIGKILL, and the object removed with grace 0;
//! - `pods/log` (`kubectl logs`) through the API server to the kubelet's HTTPS endpoint
//!   (`logs`);
//! - Services: [`service_url`] resolves one through its EndpointSlices for the test; pods
//!   resolve Service names through their `/etc/hosts` (`services` says why not iptables);
//! - CPU limits (`resources.limits.cpu`) as a CFS quota on the container's own cgroup
//!   (`cgroup`), so a Job limited to `100m` runs at a tenth of a core.
//!
//! Not supported: hostNetwork and native sidecars (init containers with `restartPolicy:
//! Always`), which such a pod's status says; ignored: memory limits (requests count for the
//! scheduler only), capabilities and seccomp (the process runs as the pod's
//! user, with no capabilities once it is not root), lifecycle hooks (postStart, preStop),
//! `resourceFieldRef` and `subPathExpr` (a CreateContainerConfigError), ephemeral containers,
//! `kubectl exec` and port-forward, service environment variables, cluster DNS beyond the
//! hosts file, pods reaching the API server (it listens on the host's loopback), log
//! timestamps, Events. The kubelet acts with the admin's credentials, not a node's.
//!
//! Dropping the [`Kubelet`] kills every container, removes the network namespaces, the
//! bridge and the kubelet's files, and deletes its Node; bridges and namespaces of a test
//! process that was killed are removed by the next start (`net`).
//!
//! [`ControlPlane`]: crate::cluster::ControlPlane

mod cgroup;
mod logs;
mod net;
mod node;
mod pod;
mod runtime;
mod services;
mod volumes;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::AtomicU32;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{
    ConfigMap, Node, PersistentVolume, PersistentVolumeClaim, Pod, Secret, Service,
};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{DeleteParams, Preconditions};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt as _};
use kube::{Api, Client, Resource};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::cluster::{wait_for, ControlPlane};

pub use logs::tail_lines;
pub use services::service_url;

/// What the node is and runs.
#[derive(Debug, Clone)]
pub struct KubeletConfig {
    /// The Node's name.
    pub node_name: String,
    /// Labels beside the well-known ones (the pools' `nodeSelector`s select on these).
    pub labels: BTreeMap<String, String>,
    /// Capacity, which is also allocatable: `cpu`, `memory`, `pods`, `nvidia.com/gpu`, ...
    pub capacity: BTreeMap<String, String>,
    /// Image prefix -> host binary: a container whose image starts with the prefix (the
    /// longest wins) runs that binary (its `command[0]` when that names the binary, else the
    /// command as given, resolved on the host's PATH). Others fail to pull.
    pub images: Vec<(String, PathBuf)>,
    /// Where pods' files go (`<root_dir>/<node_name>`, removed on drop).
    pub root_dir: PathBuf,
    /// The back-off before a crashed container's second restart, doubled after each one up
    /// to the second value (a kubelet's 10 s and 5 minutes; the first restart is immediate).
    pub crash_backoff: (Duration, Duration),
}

impl KubeletConfig {
    /// A node `node_name` with 8 CPUs, 32 GiB, 110 pods and 4 `nvidia.com/gpu`, no images.
    pub fn new(node_name: &str, root_dir: impl Into<PathBuf>) -> Self {
        Self {
            node_name: node_name.into(),
            labels: BTreeMap::new(),
            capacity: [
                ("cpu", "8"),
                ("memory", "32Gi"),
                ("pods", "110"),
                ("ephemeral-storage", "100Gi"),
                ("nvidia.com/gpu", "4"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
            images: Vec::new(),
            root_dir: root_dir.into(),
            crash_backoff: (Duration::from_secs(10), Duration::from_secs(300)),
        }
    }

    /// With `image_prefix` mapped to `binary`.
    pub fn image(mut self, image_prefix: &str, binary: impl Into<PathBuf>) -> Self {
        self.images.push((image_prefix.into(), binary.into()));
        self
    }

    /// With label `k=v`.
    pub fn label(mut self, k: &str, v: &str) -> Self {
        self.labels.insert(k.into(), v.into());
        self
    }
}

/// A running kubelet (see the module's doc).
pub struct Kubelet {
    /// The Node's name.
    pub node_name: String,
    /// The node's InternalIP: the pods' gateway, an address of the host.
    pub internal_ip: Ipv4Addr,
    /// The log endpoint's port.
    pub port: u16,
    bridge: Arc<net::Bridge>,
    procs: Arc<Mutex<pod::Procs>>,
    tasks: Tasks,
    workers: Arc<Mutex<Vec<JoinHandle<()>>>>,
    dir: PathBuf,
    kubectl: PathBuf,
    kubeconfig: PathBuf,
}

/// The kubelet's background tasks, aborted when dropped (also when a start fails half-way).
#[derive(Default)]
struct Tasks(Vec<JoinHandle<()>>);

impl Tasks {
    fn push(&mut self, t: JoinHandle<()>) {
        self.0.push(t);
    }
}

impl Drop for Tasks {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

/// A store of every `K`, fed by a task (pushed to `tasks`); returns once it has listed.
async fn store<K>(client: &Client, tasks: &mut Tasks) -> Result<Store<K>>
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    let (reader, writer) = reflector::store();
    let stream = reflector::reflector(
        writer,
        watcher(Api::<K>::all(client.clone()), watcher::Config::default()),
    )
    .default_backoff();
    tasks.push(tokio::spawn(stream.for_each(|_| async {})));
    tokio::time::timeout(Duration::from_secs(30), reader.wait_until_ready())
        .await
        .context("a watch did not list in 30 s")??;
    Ok(reader)
}

impl Kubelet {
    /// Starts a kubelet on `cp` (which needs kube-controller-manager for the node's taints
    /// and kube-scheduler to bind pods): returns once its Node is Ready and schedulable.
    pub async fn start(cp: &ControlPlane, cfg: KubeletConfig) -> Result<Self> {
        let client = cp.client().await?;
        let bridge = Arc::new(net::Bridge::create()?);
        cgroup::remove_stale();
        let internal_ip = bridge.gateway;
        let dir = cfg.root_dir.join(&cfg.node_name);
        std::fs::create_dir_all(dir.join("pods"))?;
        let mut tasks = Tasks::default();
        let sources = volumes::Sources {
            client: client.clone(),
            config_maps: store::<ConfigMap>(&client, &mut tasks).await?,
            secrets: store::<Secret>(&client, &mut tasks).await?,
            claims: store::<PersistentVolumeClaim>(&client, &mut tasks).await?,
            volumes: store::<PersistentVolume>(&client, &mut tasks).await?,
        };
        let services = store::<Service>(&client, &mut tasks).await?;
        let slices = store::<EndpointSlice>(&client, &mut tasks).await?;
        let log_index: logs::LogIndex = Default::default();
        let (port, server) = logs::serve(&dir, internal_ip, log_index.clone()).await?;
        tasks.push(server);
        let since = node::register(
            &client,
            &node::NodeSpec {
                name: &cfg.node_name,
                labels: &cfg.labels,
                capacity: &cfg.capacity,
                ip: internal_ip,
                port,
            },
        )
        .await?;
        tasks.push(tokio::spawn(node::heartbeat(
            client.clone(),
            cfg.node_name.clone(),
            since,
        )));
        let api_server = (kubernetes_service(&client).await?, api_address(&cp.server)?);
        let procs: Arc<Mutex<pod::Procs>> = Default::default();
        let ctx = Arc::new(pod::Ctx {
            client: client.clone(),
            node: cfg.node_name.clone(),
            host_ip: internal_ip,
            bridge: bridge.clone(),
            sources,
            services,
            slices,
            images: cfg.images.clone(),
            pods_dir: dir.join("pods"),
            logs: log_index,
            procs: procs.clone(),
            backoff: cfg.crash_backoff,
            http: reqwest::Client::builder()
                .no_proxy()
                .danger_accept_invalid_certs(true)
                .build()?,
            counter: AtomicU32::new(0),
            api_server,
        });
        let workers: Arc<Mutex<Vec<JoinHandle<()>>>> = Default::default();
        tasks.push(tokio::spawn(watch_pods(ctx, workers.clone())));
        let kubelet = Self {
            node_name: cfg.node_name.clone(),
            internal_ip,
            port,
            bridge,
            procs,
            tasks,
            workers,
            dir,
            kubectl: cp.bins().join("kubectl"),
            kubeconfig: cp.kubeconfig.clone(),
        };
        // The node lifecycle controller lifts the `not-ready` taint that new nodes get once
        // it sees the Ready condition.
        let nodes: Api<Node> = Api::all(client);
        wait_for(
            Duration::from_secs(60),
            "the node Ready without the not-ready taint (is kube-controller-manager running?)",
            || async {
                let n = nodes.get(&cfg.node_name).await.ok()?;
                let tainted = n
                    .spec
                    .and_then(|s| s.taints)
                    .is_some_and(|t| t.iter().any(|t| t.key.starts_with("node.kubernetes.io/")));
                (!tainted).then_some(())
            },
        )
        .await?;
        Ok(kubelet)
    }

    /// Process groups of the containers running now (for tests of the kubelet itself).
    pub fn running_processes(&self) -> Vec<u32> {
        self.procs
            .lock()
            .expect("no panic while holding the lock")
            .groups
            .iter()
            .copied()
            .collect()
    }

    /// The name of the kubelet's bridge (its network namespaces are `<bridge>-<n>`).
    pub fn bridge_name(&self) -> &str {
        &self.bridge.name
    }
}

/// Whether process `pid` is gone (or a zombie nobody reaped yet).
fn gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(s) => s
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('Z')),
    }
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        let groups: Vec<u32> = {
            let mut p = self.procs.lock().unwrap_or_else(|e| e.into_inner());
            p.stopping = true;
            p.groups.iter().copied().collect()
        };
        for g in &groups {
            runtime::signal_group(*g, "KILL");
        }
        for t in &self.tasks.0 {
            t.abort();
        }
        for t in self
            .workers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            t.abort();
        }
        self.bridge.teardown();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline && !groups.iter().all(|g| gone(*g)) {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = std::fs::remove_dir_all(&self.dir);
        cgroup::remove_all(&self.bridge.name);
        // The Node goes too (its pods are then the pod GC's); best effort, the control plane
        // may already be gone.
        let _ = Command::new(&self.kubectl)
            .env("KUBECONFIG", &self.kubeconfig)
            .args([
                "delete",
                "node",
                &self.node_name,
                "--wait=false",
                "--request-timeout=5s",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// Watches the pods bound to the node and gives each a worker.
async fn watch_pods(ctx: Arc<pod::Ctx>, workers: Arc<Mutex<Vec<JoinHandle<()>>>>) {
    let api: Api<Pod> = Api::all(ctx.client.clone());
    let cfg = watcher::Config::default().fields(&format!("spec.nodeName={}", ctx.node));
    let mut stream = watcher(api, cfg).default_backoff().boxed();
    let mut senders: HashMap<String, watch::Sender<Option<Arc<Pod>>>> = HashMap::new();
    let mut listed: HashSet<String> = HashSet::new();
    while let Some(ev) = stream.next().await {
        let pod = match ev {
            Ok(watcher::Event::Apply(p)) => p,
            Ok(watcher::Event::InitApply(p)) => {
                listed.insert(p.meta().uid.clone().unwrap_or_default());
                p
            }
            Ok(watcher::Event::Delete(p)) => {
                if let Some(tx) = senders.get(p.meta().uid.as_deref().unwrap_or_default()) {
                    tx.send_replace(None);
                }
                continue;
            }
            Ok(watcher::Event::Init) => {
                listed.clear();
                continue;
            }
            Ok(watcher::Event::InitDone) => {
                for (uid, tx) in &senders {
                    if !listed.contains(uid) {
                        tx.send_replace(None);
                    }
                }
                continue;
            }
            Err(_) => continue,
        };
        let uid = pod.meta().uid.clone().unwrap_or_default();
        if let Some(tx) = senders.get(&uid) {
            tx.send_replace(Some(Arc::new(pod)));
            continue;
        }
        // A pod that ended before this kubelet saw it is not run again; deleted, it goes.
        let phase = pod.status.as_ref().and_then(|s| s.phase.clone());
        if matches!(phase.as_deref(), Some("Succeeded" | "Failed")) {
            if pod.meta().deletion_timestamp.is_some() {
                let pods: Api<Pod> = Api::namespaced(
                    ctx.client.clone(),
                    pod.meta().namespace.as_deref().unwrap_or("default"),
                );
                let dp = DeleteParams {
                    grace_period_seconds: Some(0),
                    preconditions: Some(Preconditions {
                        uid: Some(uid.clone()),
                        resource_version: None,
                    }),
                    ..Default::default()
                };
                let _ = pods
                    .delete(pod.meta().name.as_deref().unwrap_or_default(), &dp)
                    .await;
            }
            continue;
        }
        let (tx, rx) = watch::channel(Some(Arc::new(pod)));
        senders.insert(uid, tx);
        let handle = tokio::spawn(pod::run(ctx.clone(), rx));
        workers
            .lock()
            .expect("no panic while holding the lock")
            .push(handle);
    }
}

/// The `kubernetes` Service's ClusterIP and HTTPS port in `default` (the API server makes it
/// at start; its address is in the serving certificate).
async fn kubernetes_service(client: &kube::Client) -> Result<SocketAddrV4> {
    let svc = Api::<Service>::namespaced(client.clone(), "default")
        .get("kubernetes")
        .await
        .context("the kubernetes Service")?;
    let spec = svc.spec.context("the kubernetes Service has no spec")?;
    let ip: Ipv4Addr = spec
        .cluster_ip
        .as_deref()
        .context("the kubernetes Service has no clusterIP")?
        .parse()?;
    let port = spec
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some("https"))
        .map_or(443, |p| p.port);
    Ok(SocketAddrV4::new(ip, u16::try_from(port)?))
}

/// The host address of an `https://<ip>:<port>` API server URL.
fn api_address(server: &str) -> Result<SocketAddr> {
    server
        .trim_start_matches("https://")
        .trim_end_matches('/')
        .parse()
        .with_context(|| format!("the API server's address in {server}"))
}
