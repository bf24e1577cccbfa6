//! One pod on the node: its sandbox (network namespace, volumes, hosts file), its init
//! containers in order, then its containers, with probes, restarts and back-off, and its
//! status as a kubelet reports it (`pods/status`); on deletion, SIGTERM, the grace period,
//! SIGKILL, and the Pod object deleted with grace 0.

use std::collections::{BTreeSet, HashMap};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Container, Pod, Probe, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{DeleteParams, Patch, PatchParams, Preconditions};
use kube::runtime::reflector::Store;
use kube::Api;
use serde_json::{json, Value};
use tokio::sync::watch;

use super::cgroup;
use super::logs::LogIndex;
use super::net::{Bridge, PodNetwork};
use super::runtime::{self, Launch, Mount, User};
use super::services::hosts_lines;
use super::volumes::{self, NotReady, PodVolumes, Sources};

/// The PATH a container gets when its pod sets none (the host is the image).
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// A termination message is read up to this many bytes (the kubelet's limit).
const MAX_MESSAGE: usize = 4096;
/// FallbackToLogsOnError: the log's last lines, at most this many bytes (the kubelet's).
const FALLBACK_LINES: usize = 80;
const FALLBACK_BYTES: usize = 2048;

/// What every pod worker of a kubelet shares.
pub struct Ctx {
    /// Admin client.
    pub client: kube::Client,
    /// The node's name.
    pub node: String,
    /// The node's InternalIP (the bridge's gateway).
    pub host_ip: Ipv4Addr,
    /// The pods' bridge.
    pub bridge: Arc<Bridge>,
    /// Where volumes come from.
    pub sources: Sources,
    /// Every Service, for the pods' hosts files.
    pub services: Store<Service>,
    /// Every EndpointSlice.
    pub slices: Store<EndpointSlice>,
    /// Image prefix -> host binary.
    pub images: Vec<(String, PathBuf)>,
    /// `<root>/pods`.
    pub pods_dir: PathBuf,
    /// The log endpoint's index.
    pub logs: LogIndex,
    /// Process groups of running containers; `stopping` set once the kubelet is dropped
    /// (nothing starts after).
    pub procs: Arc<Mutex<Procs>>,
    /// First restart back-off after the immediate one (the kubelet's 10 s) and its cap (300 s).
    pub backoff: (Duration, Duration),
    /// Probes' client (no proxy, any certificate: the kubelet does not verify probes' TLS).
    pub http: reqwest::Client,
    /// Numbers the pods' network namespaces.
    pub counter: AtomicU32,
    /// The `kubernetes` Service's address (what pods get as `KUBERNETES_SERVICE_HOST` and
    /// `_PORT`) and the API server's on the host, which each pod reaches through it.
    pub api_server: (SocketAddrV4, SocketAddr),
}

impl Ctx {
    /// Process group `pgid` is no container's any more (it ended, or was killed).
    fn forget_group(&self, pgid: u32) {
        self.procs
            .lock()
            .expect("no panic while holding the lock")
            .groups
            .remove(&pgid);
    }
}

/// The containers' process groups.
#[derive(Default)]
pub struct Procs {
    /// Live process groups.
    pub groups: BTreeSet<u32>,
    /// Set by the kubelet's drop: no process starts after it.
    pub stopping: bool,
}

fn now_rfc3339() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

/// `$(VAR)` references expanded from `vars`, `$$` an escaped `$` (Kubernetes' rules);
/// unknown references kept as written.
pub fn expand(s: &str, vars: &HashMap<String, String>) -> String {
    let b = s.as_bytes();
    let mut out = String::new();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'$' && i + 1 < b.len() {
            if b[i + 1] == b'$' {
                out.push('$');
                i += 2;
                continue;
            }
            if b[i + 1] == b'(' {
                if let Some(end) = s[i + 2..].find(')') {
                    let name = &s[i + 2..i + 2 + end];
                    match vars.get(name) {
                        Some(v) => out.push_str(v),
                        None => out.push_str(&s[i..i + 3 + end]),
                    }
                    i += 3 + end;
                    continue;
                }
            }
        }
        let ch = s[i..].chars().next().expect("i is on a char boundary");
        out.push(ch);
        i += ch.len_utf8();
    }
    out
}

/// A container instance that runs (or ran until just now).
struct Instance {
    child: tokio::process::Child,
    pgid: u32,
    started_at: String,
    dir: PathBuf,
    log: PathBuf,
    term: PathBuf,
    id: String,
    /// Its cgroup when it has a CPU limit (removed once the instance is dropped).
    _cpu: Option<cgroup::CpuLimit>,
}

/// A finished instance, as `state.terminated` shows it.
#[derive(Clone, Debug)]
struct Term {
    exit_code: i32,
    signal: Option<i32>,
    reason: String,
    message: Option<String>,
    started_at: Option<String>,
    finished_at: String,
    id: String,
}

impl Term {
    fn json(&self) -> Value {
        let mut t = json!({
            "exitCode": self.exit_code,
            "reason": self.reason,
            "finishedAt": self.finished_at,
            "containerID": self.id,
        });
        if let Some(s) = &self.started_at {
            t["startedAt"] = json!(s);
        }
        if let Some(m) = &self.message {
            t["message"] = json!(m);
        }
        if let Some(s) = self.signal {
            t["signal"] = json!(s);
        }
        json!({ "terminated": t })
    }
}

enum State {
    Waiting {
        reason: String,
        message: Option<String>,
    },
    Running(Box<Instance>),
    Terminated(Term),
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Startup,
    Readiness,
    Liveness,
}

struct Probing {
    kind: Kind,
    probe: Probe,
    next: Instant,
    inflight: Option<tokio::task::JoinHandle<Result<(), String>>>,
    successes: i32,
    failures: i32,
}

struct Ctr {
    spec: Container,
    init: bool,
    state: State,
    last: Option<Term>,
    restarts: i32,
    /// Instances started so far (a restart is every one after the first).
    instances: i32,
    started: bool,
    ready: bool,
    probes: Vec<Probing>,
    /// The next back-off (None: the next restart is immediate).
    backoff: Option<Duration>,
    restart_at: Option<Instant>,
    /// SIGTERM sent: SIGKILL at this instant.
    killing: Option<Instant>,
    /// Terminated for good (no restart will follow).
    done: bool,
    /// The host binary its image maps to.
    image_bin: Option<PathBuf>,
    /// Pulls that failed (ErrImagePull, then ImagePullBackOff, alternately).
    pull_failures: u32,
    /// Numbers the container IDs of its instances.
    id_seq: u32,
}

impl Ctr {
    fn new(spec: Container, init: bool) -> Self {
        Self {
            spec,
            init,
            state: State::Waiting {
                reason: if init {
                    "PodInitializing"
                } else {
                    "ContainerCreating"
                }
                .into(),
                message: None,
            },
            last: None,
            restarts: 0,
            instances: 0,
            started: false,
            ready: false,
            probes: Vec::new(),
            backoff: None,
            restart_at: None,
            killing: None,
            done: false,
            image_bin: None,
            pull_failures: 0,
            id_seq: 0,
        }
    }

    fn succeeded(&self) -> bool {
        matches!(&self.state, State::Terminated(t) if t.exit_code == 0)
    }

    fn running(&self) -> Option<&Instance> {
        match &self.state {
            State::Running(i) => Some(i),
            _ => None,
        }
    }
}

/// One pod's worker.
pub struct Worker {
    ctx: Arc<Ctx>,
    pod: Arc<Pod>,
    uid: String,
    ns: String,
    name: String,
    dir: PathBuf,
    net: Option<PodNetwork>,
    ip: Option<Ipv4Addr>,
    sandbox_error: Option<String>,
    volumes: PodVolumes,
    volumes_ready: bool,
    volume_error: Option<String>,
    last_volume_sync: Option<Instant>,
    hosts_written: Option<String>,
    ctrs: Vec<Ctr>,
    start_time: String,
    transitions: HashMap<String, (String, String)>,
    last_status: Option<Value>,
    finished: bool,
}

fn restart_policy(pod: &Pod) -> String {
    pod.spec
        .as_ref()
        .and_then(|s| s.restart_policy.clone())
        .unwrap_or_else(|| "Always".into())
}

/// Runs the pod whose latest object `rx` holds (None once it is gone from the API server)
/// until it is deleted.
pub async fn run(ctx: Arc<Ctx>, mut rx: watch::Receiver<Option<Arc<Pod>>>) {
    let Some(pod) = rx.borrow().clone() else {
        return;
    };
    let mut w = Worker::new(ctx, pod);
    w.run(&mut rx).await;
    w.cleanup();
}

impl Worker {
    fn new(ctx: Arc<Ctx>, pod: Arc<Pod>) -> Self {
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let ns = pod
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into());
        let name = pod.metadata.name.clone().unwrap_or_default();
        let dir = ctx.pods_dir.join(&uid);
        let spec = pod.spec.clone().unwrap_or_default();
        let fs_group = spec
            .security_context
            .as_ref()
            .and_then(|s| s.fs_group)
            .and_then(|g| u32::try_from(g).ok());
        let mut ctrs: Vec<Ctr> = spec
            .init_containers
            .unwrap_or_default()
            .into_iter()
            .map(|c| Ctr::new(c, true))
            .collect();
        ctrs.extend(spec.containers.into_iter().map(|c| Ctr::new(c, false)));
        Self {
            volumes: PodVolumes::new(dir.join("volumes"), fs_group),
            ctx,
            pod,
            uid,
            ns,
            name,
            dir,
            net: None,
            ip: None,
            sandbox_error: None,
            volumes_ready: false,
            volume_error: None,
            last_volume_sync: None,
            hosts_written: None,
            ctrs,
            start_time: now_rfc3339(),
            transitions: HashMap::new(),
            last_status: None,
            finished: false,
        }
    }

    async fn run(&mut self, rx: &mut watch::Receiver<Option<Arc<Pod>>>) {
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                r = rx.changed() => {
                    if r.is_err() {
                        return;
                    }
                }
            }
            let latest = rx.borrow().clone();
            let Some(pod) = latest else {
                // Gone from the API server (deleted with grace 0 by someone): stop now.
                self.kill_all("KILL");
                return;
            };
            self.pod = pod;
            if self.pod.metadata.deletion_timestamp.is_some() {
                self.terminate(rx).await;
                return;
            }
            self.step().await;
            self.report().await;
        }
    }

    fn key(&self) -> (String, String) {
        (self.ns.clone(), self.name.clone())
    }

    /// Brings the sandbox up, the volumes in sync, then the containers one step further.
    async fn step(&mut self) {
        if self.finished {
            return;
        }
        if self.net.is_none() {
            if self.pod.spec.as_ref().and_then(|s| s.host_network) == Some(true) {
                self.sandbox_error =
                    Some("hostNetwork is not supported by the test kubelet".into());
                return;
            }
            let n = self.ctx.counter.fetch_add(1, Ordering::Relaxed);
            let net = self.ctx.bridge.pod_network(n).and_then(|mut net| {
                let (service, to) = self.ctx.api_server;
                net.reach_api_server(service, to)?;
                Ok(net)
            });
            match net {
                Ok(net) => {
                    self.ip = Some(net.addr);
                    self.net = Some(net);
                    self.sandbox_error = None;
                }
                Err(e) => {
                    self.sandbox_error = Some(format!("{e:#}"));
                    return;
                }
            }
            if let Err(e) = self.write_pod_etc() {
                self.sandbox_error = Some(format!("{e:#}"));
                return;
            }
        }
        let due = self
            .last_volume_sync
            .is_none_or(|t| t.elapsed() >= Duration::from_secs(1));
        if due || !self.volumes_ready {
            self.last_volume_sync = Some(Instant::now());
            let pod = self.pod_with_status();
            match self.volumes.sync(&pod, &self.ctx.sources).await {
                Ok(()) => {
                    self.volumes_ready = true;
                    self.volume_error = None;
                }
                Err(e) => {
                    // Before the first start the pod waits in ContainerCreating with the
                    // reason; later, a source gone missing keeps the files it had.
                    if !self.volumes_ready {
                        let kind = if e.root_cause().downcast_ref::<NotReady>().is_some() {
                            "waiting for"
                        } else {
                            "failed"
                        };
                        self.volume_error = Some(format!("MountVolume.SetUp {kind}: {e:#}"));
                    }
                }
            }
            let _ = self.write_hosts();
        }
        if !self.volumes_ready {
            return;
        }
        let policy = restart_policy(&self.pod);
        // Init containers, one at a time and in order.
        let n_init = self.ctrs.iter().filter(|c| c.init).count();
        for i in 0..n_init {
            self.step_container(i, &policy).await;
            if !self.ctrs[i].succeeded() {
                if self.ctrs[i].done {
                    // Failed for good (restartPolicy Never): the pod fails.
                    self.finish();
                }
                return;
            }
        }
        for i in n_init..self.ctrs.len() {
            self.step_container(i, &policy).await;
        }
        if self.ctrs.iter().filter(|c| !c.init).all(|c| c.done) {
            self.finish();
        }
    }

    /// Every container is done for good: the sandbox goes (its address stays in the status).
    fn finish(&mut self) {
        self.finished = true;
        self.kill_all("KILL");
        self.net = None;
    }

    /// The pod with the status fields a downward-API reference may name, as they will be.
    fn pod_with_status(&self) -> Pod {
        let mut p = (*self.pod).clone();
        let st = p.status.get_or_insert_with(Default::default);
        if let Some(ip) = self.ip {
            st.pod_ip = Some(ip.to_string());
            st.pod_ips = Some(vec![k8s_openapi::api::core::v1::PodIP {
                ip: ip.to_string(),
            }]);
        }
        st.host_ip = Some(self.ctx.host_ip.to_string());
        st.host_ips = Some(vec![k8s_openapi::api::core::v1::HostIP {
            ip: self.ctx.host_ip.to_string(),
        }]);
        p
    }

    fn hostname(&self) -> String {
        let h = self
            .pod
            .spec
            .as_ref()
            .and_then(|s| s.hostname.clone())
            .unwrap_or_else(|| self.name.clone());
        h.chars().take(63).collect()
    }

    fn pod_etc(&self) -> PathBuf {
        self.dir.join("etc")
    }

    fn write_pod_etc(&mut self) -> anyhow::Result<()> {
        let etc = self.pod_etc();
        std::fs::create_dir_all(&etc)?;
        std::fs::write(etc.join("hostname"), format!("{}\n", self.hostname()))?;
        // No cluster DNS: names resolve through the hosts file; any other lookup fails at
        // once (nothing listens on the pod's own loopback) instead of timing out.
        std::fs::write(
            etc.join("resolv.conf"),
            format!(
                "nameserver 127.0.0.1\nsearch {ns}.svc.cluster.local svc.cluster.local cluster.local\n\
                 options ndots:5 attempts:1 timeout:1\n",
                ns = self.ns
            ),
        )?;
        self.write_hosts()
    }

    /// The pod's hosts file: itself, then the Services (see `services`), replaced by a
    /// rename when it changes.
    fn write_hosts(&mut self) -> anyhow::Result<()> {
        let Some(ip) = self.ip else {
            return Ok(());
        };
        let mut text = format!(
            "# Kubernetes-managed hosts file (mole's test kubelet).\n127.0.0.1\tlocalhost\n\
             ::1\tlocalhost ip6-localhost ip6-loopback\n{ip}\t{}\n",
            self.hostname()
        );
        text.push_str(&hosts_lines(&self.ctx.services, &self.ctx.slices, &self.ns));
        if self.hosts_written.as_deref() == Some(text.as_str()) {
            return Ok(());
        }
        let etc = self.pod_etc();
        let tmp = etc.join(".hosts.tmp");
        std::fs::write(&tmp, &text)?;
        std::fs::rename(&tmp, etc.join("hosts"))?;
        self.hosts_written = Some(text);
        Ok(())
    }

    /// The host binary an image maps to.
    fn image_binary(&self, image: &str) -> Option<PathBuf> {
        self.ctx
            .images
            .iter()
            .filter(|(prefix, _)| image.starts_with(prefix.as_str()))
            .max_by_key(|(prefix, _)| prefix.len())
            .map(|(_, b)| b.clone())
    }

    /// The container's environment, in order (Err: a CreateContainerConfigError message).
    fn env(&self, c: &Container) -> Result<Vec<(String, String)>, String> {
        let pod = self.pod_with_status();
        let src = &self.ctx.sources;
        let mut vars: Vec<(String, String)> = vec![
            ("PATH".into(), DEFAULT_PATH.into()),
            ("HOSTNAME".into(), self.hostname()),
        ];
        // The API server's Service, as a kubelet gives every container whatever its
        // `enableServiceLinks` (in-cluster clients read the first two).
        let (api, _) = self.ctx.api_server;
        let (host, port) = (api.ip().to_string(), api.port().to_string());
        let tcp = format!("tcp://{api}");
        vars.extend(
            [
                ("KUBERNETES_SERVICE_HOST", host.clone()),
                ("KUBERNETES_SERVICE_PORT", port.clone()),
                ("KUBERNETES_SERVICE_PORT_HTTPS", port.clone()),
                ("KUBERNETES_PORT", tcp.clone()),
                (&*format!("KUBERNETES_PORT_{port}_TCP"), tcp),
                (&*format!("KUBERNETES_PORT_{port}_TCP_PROTO"), "tcp".into()),
                (&*format!("KUBERNETES_PORT_{port}_TCP_PORT"), port.clone()),
                (&*format!("KUBERNETES_PORT_{port}_TCP_ADDR"), host),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v)),
        );
        let mut map: HashMap<String, String> = vars.iter().cloned().collect();
        let mut set = |k: String, v: String, vars: &mut Vec<(String, String)>| {
            map.insert(k.clone(), v.clone());
            vars.push((k, v));
        };
        for from in c.env_from.iter().flatten() {
            let prefix = from.prefix.clone().unwrap_or_default();
            let (data, optional, what) = if let Some(r) = &from.config_map_ref {
                (
                    src.config_map(&self.ns, &r.name),
                    r.optional.unwrap_or(false),
                    format!("configmap {:?}", r.name),
                )
            } else if let Some(r) = &from.secret_ref {
                (
                    src.secret(&self.ns, &r.name),
                    r.optional.unwrap_or(false),
                    format!("secret {:?}", r.name),
                )
            } else {
                continue;
            };
            match data {
                Some(d) => {
                    for (k, v) in d {
                        set(
                            format!("{prefix}{k}"),
                            String::from_utf8_lossy(&v).into_owned(),
                            &mut vars,
                        );
                    }
                }
                None if optional => {}
                None => return Err(format!("{what} not found")),
            }
        }
        for e in c.env.iter().flatten() {
            let snapshot: HashMap<String, String> = vars.iter().cloned().collect();
            let value = if let Some(v) = &e.value {
                expand(v, &snapshot)
            } else if let Some(from) = &e.value_from {
                if let Some(f) = &from.field_ref {
                    volumes::field_ref(&pod, f).map_err(|e| format!("{e:#}"))?
                } else if let Some((data, name, key, optional, kind)) = from
                    .secret_key_ref
                    .as_ref()
                    .map(|r| {
                        let data = src.secret(&self.ns, &r.name);
                        (data, &r.name, &r.key, r.optional, "Secret")
                    })
                    .or_else(|| {
                        from.config_map_key_ref.as_ref().map(|r| {
                            let data = src.config_map(&self.ns, &r.name);
                            (data, &r.name, &r.key, r.optional, "ConfigMap")
                        })
                    })
                {
                    // A key of a Secret or of a ConfigMap: missing is the same error for both.
                    match data.and_then(|d| d.get(key).cloned()) {
                        Some(v) => String::from_utf8_lossy(&v).into_owned(),
                        None if optional.unwrap_or(false) => continue,
                        None => {
                            return Err(format!(
                                "couldn't find key {key} in {kind} {}/{name}",
                                self.ns
                            ))
                        }
                    }
                } else {
                    return Err(format!(
                        "env {}: only fieldRef, secretKeyRef and configMapKeyRef are supported",
                        e.name
                    ));
                }
            } else {
                String::new()
            };
            set(e.name.clone(), value, &mut vars);
        }
        Ok(vars)
    }

    /// The user the container runs as (Err: a CreateContainerConfigError message).
    fn user(&self, c: &Container) -> Result<Option<User>, String> {
        let psc = self
            .pod
            .spec
            .as_ref()
            .and_then(|s| s.security_context.clone())
            .unwrap_or_default();
        let csc = c.security_context.clone().unwrap_or_default();
        let uid = csc.run_as_user.or(psc.run_as_user);
        let gid = csc.run_as_group.or(psc.run_as_group);
        let non_root = csc.run_as_non_root.or(psc.run_as_non_root).unwrap_or(false);
        if non_root && uid.unwrap_or(0) == 0 {
            return Err(format!(
                "container has runAsNonRoot and image will run as root (pod: \"{}_{}({})\", container: {})",
                self.name, self.ns, self.uid, c.name
            ));
        }
        let Some(uid) = uid else {
            return Ok(None);
        };
        let mut groups: Vec<i64> = psc.supplemental_groups.clone().unwrap_or_default();
        if let Some(g) = psc.fs_group {
            groups.push(g);
        }
        groups.sort_unstable();
        groups.dedup();
        Ok(Some(User {
            uid,
            gid: gid.unwrap_or(0),
            groups,
        }))
    }

    /// The container's mounts (Err: a CreateContainerConfigError message).
    fn mounts(&self, c: &Container) -> Result<Vec<Mount>, String> {
        let mut out = Vec::new();
        for m in c.volume_mounts.iter().flatten() {
            let Some(host) = self.volumes.paths.get(&m.name) else {
                return Err(format!(
                    "volume {:?} of mount {} not found",
                    m.name, m.mount_path
                ));
            };
            let mut host = host.clone();
            if m.sub_path_expr.is_some() {
                return Err("subPathExpr is not supported".into());
            }
            if let Some(sp) = m.sub_path.as_deref().filter(|s| !s.is_empty()) {
                if sp.starts_with('/') || sp.split('/').any(|c| c == "..") {
                    return Err(format!("invalid subPath {sp:?}"));
                }
                host = host.join(sp);
                if !host.exists() {
                    std::fs::create_dir_all(&host).map_err(|e| format!("subPath {sp}: {e}"))?;
                }
            }
            let ro = m.read_only.unwrap_or(false)
                || self
                    .volumes
                    .read_only
                    .get(&m.name)
                    .copied()
                    .unwrap_or(false);
            out.push(Mount {
                host,
                path: m.mount_path.clone(),
                read_only: ro,
            });
        }
        Ok(out)
    }

    /// Starts container `i`'s next instance; on failure it waits with the reason a kubelet
    /// gives.
    fn start(&mut self, i: usize) {
        let spec = self.ctrs[i].spec.clone();
        if self.ctrs[i].init && spec.restart_policy.as_deref() == Some("Always") {
            let c = &mut self.ctrs[i];
            c.state = State::Waiting {
                reason: "CreateContainerConfigError".into(),
                message: Some("native sidecars (init containers with restartPolicy: Always) are not supported by the test kubelet".into()),
            };
            c.restart_at = Some(Instant::now() + Duration::from_secs(5));
            return;
        }
        let image = spec.image.clone().unwrap_or_default();
        let Some(bin) = self.image_binary(&image) else {
            let c = &mut self.ctrs[i];
            c.pull_failures += 1;
            let (reason, message) = if c.pull_failures % 2 == 1 {
                (
                    "ErrImagePull",
                    format!(
                        "failed to pull and unpack image \"{image}\": no image of this test \
                         kubelet maps it to a host binary"
                    ),
                )
            } else {
                (
                    "ImagePullBackOff",
                    format!("Back-off pulling image \"{image}\""),
                )
            };
            c.state = State::Waiting {
                reason: reason.into(),
                message: Some(message),
            };
            c.restart_at = Some(Instant::now() + Duration::from_secs(5));
            return;
        };
        self.ctrs[i].image_bin = Some(bin.clone());
        let config = (|| -> Result<_, String> {
            let env = self.env(&spec)?;
            let user = self.user(&spec)?;
            let mounts = self.mounts(&spec)?;
            Ok((env, user, mounts))
        })();
        let (env, user, mut mounts) = match config {
            Ok(v) => v,
            Err(message) => {
                let c = &mut self.ctrs[i];
                c.state = State::Waiting {
                    reason: "CreateContainerConfigError".into(),
                    message: Some(message),
                };
                c.restart_at = Some(Instant::now() + Duration::from_secs(1));
                return;
            }
        };
        let vars: HashMap<String, String> = env.iter().cloned().collect();
        let mut argv: Vec<String> = match &spec.command {
            Some(cmd) if !cmd.is_empty() => cmd.iter().map(|a| expand(a, &vars)).collect(),
            _ => vec![bin.display().to_string()],
        };
        // The image's binary by its name (`mole-worker`), or what the command names.
        if let Some(base) = bin.file_name().and_then(|b| b.to_str()) {
            if argv[0] == base {
                argv[0] = bin.display().to_string();
            }
        }
        argv.extend(spec.args.iter().flatten().map(|a| expand(a, &vars)));
        let hostname = self.hostname();
        let netns = self.net.as_ref().map(|n| n.ns.clone()).unwrap_or_default();
        let pod_etc = self.pod_etc();
        let c = &mut self.ctrs[i];
        let n = c.instances;
        let idir = self
            .dir
            .join("containers")
            .join(format!("{}-{n}", spec.name));
        let log_dir = self.dir.join("logs").join(&spec.name);
        let log = log_dir.join(format!("{n}.log"));
        let term = idir.join("termination-log");
        let prepared = (|| -> std::io::Result<()> {
            std::fs::create_dir_all(&idir)?;
            std::fs::create_dir_all(&log_dir)?;
            std::fs::write(&term, b"")?;
            std::fs::set_permissions(
                &term,
                <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o666),
            )?;
            Ok(())
        })();
        if let Err(e) = prepared {
            c.state = State::Waiting {
                reason: "CreateContainerError".into(),
                message: Some(e.to_string()),
            };
            c.restart_at = Some(Instant::now() + Duration::from_secs(1));
            return;
        }
        mounts.push(Mount {
            host: term.clone(),
            path: spec
                .termination_message_path
                .clone()
                .unwrap_or_else(|| "/dev/termination-log".into()),
            read_only: false,
        });
        let launch = Launch {
            netns,
            hostname,
            dir: idir.clone(),
            pod_etc,
            mounts,
            argv,
            env,
            working_dir: spec.working_dir.clone(),
            user,
            read_only_root: spec
                .security_context
                .as_ref()
                .and_then(|s| s.read_only_root_filesystem)
                .unwrap_or(false),
            log: log.clone(),
        };
        c.id_seq += 1;
        let id = format!("mole://{}-{}-{}", self.uid, spec.name, c.id_seq);
        let spawned = {
            let mut procs = self
                .ctx
                .procs
                .lock()
                .expect("no panic while holding the lock");
            if procs.stopping {
                return;
            }
            let child = runtime::spawn(&launch);
            if let Ok(ch) = &child {
                if let Some(pid) = ch.id() {
                    procs.groups.insert(pid);
                }
            }
            child
        };
        match spawned {
            Ok(child) => {
                let pgid = child.id().unwrap_or(0);
                let cpu = spec
                    .resources
                    .as_ref()
                    .and_then(|r| r.limits.as_ref()?.get("cpu"))
                    .and_then(|q| cgroup::millicores(&q.0))
                    .and_then(|millis| {
                        let name = format!(
                            "{}-{}-{}-{}",
                            self.ctx.bridge.name, self.uid, spec.name, c.instances
                        );
                        cgroup::limit(&name, pgid, millis)
                            .map_err(|e| eprintln!("test kubelet: CPU limit not enforced: {e:#}"))
                            .ok()
                            .flatten()
                    });
                if c.instances > 0 {
                    c.restarts += 1;
                }
                c.instances += 1;
                c.started = spec.startup_probe.is_none();
                // Without a readiness probe a started container is ready.
                c.ready = spec.readiness_probe.is_none();
                c.killing = None;
                c.restart_at = None;
                let now = Instant::now();
                c.probes = [
                    (Kind::Startup, spec.startup_probe.clone()),
                    (Kind::Readiness, spec.readiness_probe.clone()),
                    (Kind::Liveness, spec.liveness_probe.clone()),
                ]
                .into_iter()
                .filter(|_| !c.init)
                .filter_map(|(kind, p)| {
                    let p = p?;
                    let delay = p.initial_delay_seconds.unwrap_or(0).max(0) as u64;
                    Some(Probing {
                        kind,
                        next: now + Duration::from_secs(delay),
                        probe: p,
                        inflight: None,
                        successes: 0,
                        failures: 0,
                    })
                })
                .collect();
                c.state = State::Running(Box::new(Instance {
                    child,
                    pgid,
                    started_at: now_rfc3339(),
                    dir: idir,
                    log: log.clone(),
                    term,
                    id,
                    _cpu: cpu,
                }));
                let mut idx = self
                    .ctx
                    .logs
                    .lock()
                    .expect("no panic while holding the lock");
                let entry = idx
                    .entry((self.ns.clone(), self.name.clone()))
                    .or_default()
                    .entry(spec.name.clone())
                    .or_default();
                entry.previous = entry.current.take();
                entry.current = Some(log);
                entry.running = true;
                entry.uid = self.uid.clone();
            }
            Err(e) => {
                c.state = State::Waiting {
                    reason: "RunContainerError".into(),
                    message: Some(format!("{e:#}")),
                };
                c.restart_at = Some(Instant::now() + Duration::from_secs(1));
            }
        }
    }

    /// One step of container `i`: start it when due, notice its exit, run its probes.
    async fn step_container(&mut self, i: usize, policy: &str) {
        if self.ctrs[i].done {
            return;
        }
        let due = self.ctrs[i].restart_at.is_none_or(|t| Instant::now() >= t);
        match &mut self.ctrs[i].state {
            State::Waiting { .. } | State::Terminated(_) => {
                if due {
                    self.start(i);
                }
            }
            State::Running(inst) => match inst.child.try_wait() {
                Ok(Some(status)) => self.exited(i, status, policy),
                Ok(None) => self.probe(i).await,
                Err(_) => {}
            },
        }
    }

    /// Container `i`'s instance exited with `status`: its termination, then a restart per
    /// the pod's restartPolicy (with back-off) or the end.
    fn exited(&mut self, i: usize, status: std::process::ExitStatus, policy: &str) {
        use std::os::unix::process::ExitStatusExt as _;
        let State::Running(inst) = std::mem::replace(
            &mut self.ctrs[i].state,
            State::Waiting {
                reason: String::new(),
                message: None,
            },
        ) else {
            return;
        };
        self.ctx.forget_group(inst.pgid);
        // Whatever the container left in its group.
        runtime::signal_group(inst.pgid, "KILL");
        let started = inst.dir.join(runtime::STARTED_MARKER).exists();
        let (exit_code, signal) = match (status.code(), status.signal()) {
            (Some(c), _) => (c, None),
            (None, Some(s)) => (128 + s, Some(s)),
            _ => (-1, None),
        };
        let c = &mut self.ctrs[i];
        let term = if !started {
            let setup =
                std::fs::read_to_string(inst.dir.join(runtime::SETUP_LOG)).unwrap_or_default();
            Term {
                exit_code: 128,
                signal: None,
                reason: "StartError".into(),
                message: Some(format!("failed to create the container: {}", setup.trim())),
                started_at: None,
                finished_at: now_rfc3339(),
                id: inst.id.clone(),
            }
        } else {
            let mut message = std::fs::read(&inst.term).unwrap_or_default();
            message.truncate(MAX_MESSAGE);
            let mut message = String::from_utf8_lossy(&message).into_owned();
            if message.is_empty()
                && exit_code != 0
                && c.spec.termination_message_policy.as_deref() == Some("FallbackToLogsOnError")
            {
                let log = std::fs::read(&inst.log).unwrap_or_default();
                let mut t = super::logs::tail_lines(&log, FALLBACK_LINES);
                if t.len() > FALLBACK_BYTES {
                    t = &t[t.len() - FALLBACK_BYTES..];
                }
                message = String::from_utf8_lossy(t).into_owned();
            }
            Term {
                exit_code,
                signal,
                reason: if exit_code == 0 { "Completed" } else { "Error" }.into(),
                message: (!message.is_empty()).then_some(message),
                started_at: Some(inst.started_at.clone()),
                finished_at: now_rfc3339(),
                id: inst.id.clone(),
            }
        };
        {
            let mut idx = self
                .ctx
                .logs
                .lock()
                .expect("no panic while holding the lock");
            if let Some(e) = idx
                .get_mut(&(self.ns.clone(), self.name.clone()))
                .and_then(|m| m.get_mut(&c.spec.name))
            {
                e.running = false;
            }
        }
        let _ = std::fs::remove_dir_all(&inst.dir);
        c.ready = false;
        c.started = false;
        c.probes.clear();
        c.killing = None;
        let restart = match (c.init, policy) {
            (true, _) if exit_code == 0 => false,
            (true, "Never") => false,
            (true, _) => true,
            (false, "Always") => true,
            (false, "OnFailure") => exit_code != 0,
            _ => false,
        };
        if !restart {
            c.done = true;
            c.state = State::Terminated(term);
            return;
        }
        // The first restart is immediate; each one after waits twice as long as the last
        // (10 s, 20 s, ... up to 5 minutes), showing CrashLoopBackOff meanwhile.
        let (first, cap) = self.ctx.backoff;
        match c.backoff {
            None => {
                c.backoff = Some(first);
                c.restart_at = Some(Instant::now());
                c.state = State::Terminated(term.clone());
            }
            Some(b) => {
                c.restart_at = Some(Instant::now() + b);
                c.backoff = Some((b * 2).min(cap));
                c.state = State::Waiting {
                    reason: "CrashLoopBackOff".into(),
                    message: Some(format!(
                        "back-off {}s restarting failed container={} pod={}_{}({})",
                        b.as_secs(),
                        c.spec.name,
                        self.name,
                        self.ns,
                        self.uid
                    )),
                };
            }
        }
        c.last = Some(term);
    }

    /// Runs container `i`'s due probes and acts on their results; a SIGKILL when a kill's
    /// grace is over.
    async fn probe(&mut self, i: usize) {
        let now = Instant::now();
        if let Some(deadline) = self.ctrs[i].killing {
            if now >= deadline {
                if let Some(inst) = self.ctrs[i].running() {
                    runtime::signal_group(inst.pgid, "KILL");
                }
            }
            return;
        }
        let ip = self.ip;
        let http = self.ctx.http.clone();
        let pgid = self.ctrs[i].running().map(|r| r.pgid).unwrap_or(0);
        let spec = self.ctrs[i].spec.clone();
        let mut results = Vec::new();
        {
            let c = &mut self.ctrs[i];
            let started = c.started;
            for p in &mut c.probes {
                if let Some(h) = &p.inflight {
                    if h.is_finished() {
                        let h = p.inflight.take().expect("checked above");
                        let r = h.await.unwrap_or_else(|e| Err(e.to_string()));
                        results.push((p.kind, r));
                    }
                    continue;
                }
                let applicable = match p.kind {
                    Kind::Startup => !started,
                    _ => started,
                };
                if !applicable || now < p.next {
                    continue;
                }
                let period = p.probe.period_seconds.unwrap_or(10).max(1) as u64;
                p.next = now + Duration::from_secs(period);
                let probe = p.probe.clone();
                let spec = spec.clone();
                let http = http.clone();
                p.inflight = Some(tokio::spawn(async move {
                    run_probe(&http, ip, &spec, &probe, pgid).await
                }));
            }
        }
        for (kind, r) in results {
            self.probe_result(i, kind, r);
        }
    }

    fn probe_result(&mut self, i: usize, kind: Kind, r: Result<(), String>) {
        let grace = self.grace();
        let c = &mut self.ctrs[i];
        let Some(p) = c.probes.iter_mut().find(|p| p.kind == kind) else {
            return;
        };
        if r.is_ok() {
            p.successes += 1;
            p.failures = 0;
        } else {
            p.failures += 1;
            p.successes = 0;
        }
        let success_threshold = p.probe.success_threshold.unwrap_or(1).max(1);
        let failure_threshold = p.probe.failure_threshold.unwrap_or(3).max(1);
        let probe_grace = p.probe.termination_grace_period_seconds;
        let (succ, fail) = (p.successes, p.failures);
        match kind {
            Kind::Startup => {
                if succ >= 1 {
                    c.started = true;
                    // Readiness and liveness start with the container started.
                    let now = Instant::now();
                    for q in &mut c.probes {
                        if q.kind != Kind::Startup {
                            q.next = q.next.max(now);
                        }
                    }
                } else if fail >= failure_threshold {
                    self.kill_for_restart(i, probe_grace.unwrap_or(grace));
                }
            }
            Kind::Readiness => {
                if succ >= success_threshold {
                    c.ready = true;
                } else if fail >= failure_threshold {
                    c.ready = false;
                }
            }
            Kind::Liveness => {
                if fail >= failure_threshold {
                    self.kill_for_restart(i, probe_grace.unwrap_or(grace));
                }
            }
        }
    }

    /// SIGTERM to container `i` (a failed liveness or startup probe); SIGKILL after `grace`.
    fn kill_for_restart(&mut self, i: usize, grace: i64) {
        let c = &mut self.ctrs[i];
        c.ready = false;
        if let Some(inst) = c.running() {
            runtime::signal(inst.pgid, "TERM");
        }
        c.killing = Some(Instant::now() + Duration::from_secs(grace.max(0) as u64));
    }

    /// The pod's termination grace period.
    fn grace(&self) -> i64 {
        self.pod
            .spec
            .as_ref()
            .and_then(|s| s.termination_grace_period_seconds)
            .unwrap_or(30)
    }

    /// Sends `signal` to every running container: TERM to its main process, KILL to all
    /// of it.
    fn kill_all(&mut self, signal: &str) {
        for c in &self.ctrs {
            if let Some(inst) = c.running() {
                if signal == "KILL" {
                    runtime::signal_group(inst.pgid, signal);
                } else {
                    runtime::signal(inst.pgid, signal);
                }
            }
        }
    }

    /// Deletion: SIGTERM, the grace period, SIGKILL; the final status; the object deleted
    /// with grace 0.
    async fn terminate(&mut self, rx: &mut watch::Receiver<Option<Arc<Pod>>>) {
        let grace = self
            .pod
            .metadata
            .deletion_grace_period_seconds
            .unwrap_or_else(|| self.grace())
            .max(0) as u64;
        let deadline = Instant::now() + Duration::from_secs(grace);
        self.kill_all("TERM");
        let mut killed = false;
        let never = "Never".to_string();
        loop {
            let mut running = false;
            for i in 0..self.ctrs.len() {
                if let State::Running(inst) = &mut self.ctrs[i].state {
                    match inst.child.try_wait() {
                        Ok(Some(status)) => self.exited(i, status, &never),
                        _ => running = true,
                    }
                }
            }
            if !running {
                break;
            }
            if !killed && Instant::now() >= deadline {
                self.kill_all("KILL");
                killed = true;
            }
            self.report().await;
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                r = rx.changed() => {
                    if r.is_err() || rx.borrow().is_none() {
                        self.kill_all("KILL");
                    }
                }
            }
        }
        // Containers that never ran are terminated too.
        for c in &mut self.ctrs {
            if !matches!(c.state, State::Terminated(_)) {
                c.state = State::Terminated(Term {
                    exit_code: 137,
                    signal: None,
                    reason: "ContainerStatusUnknown".into(),
                    message: Some(
                        "The container could not be located when the pod was deleted".into(),
                    ),
                    started_at: None,
                    finished_at: now_rfc3339(),
                    id: String::new(),
                });
            }
            c.done = true;
        }
        self.finished = true;
        self.net = None;
        self.report().await;
        let pods: Api<Pod> = Api::namespaced(self.ctx.client.clone(), &self.ns);
        let dp = DeleteParams {
            grace_period_seconds: Some(0),
            preconditions: Some(Preconditions {
                uid: Some(self.uid.clone()),
                resource_version: None,
            }),
            ..Default::default()
        };
        let _ = pods.delete(&self.name, &dp).await;
    }

    /// Patches `pods/status` when it differs from the last one written.
    async fn report(&mut self) {
        let status = self.status();
        if self.last_status.as_ref() == Some(&status) {
            return;
        }
        let pods: Api<Pod> = Api::namespaced(self.ctx.client.clone(), &self.ns);
        let patch = json!({ "status": status });
        match pods
            .patch_status(
                &self.name,
                &PatchParams::default(),
                &Patch::Strategic(patch),
            )
            .await
        {
            Ok(_) => self.last_status = Some(status),
            Err(kube::Error::Api(e)) if e.code == 404 => self.last_status = Some(status),
            Err(_) => {}
        }
    }

    fn condition(
        &mut self,
        type_: &str,
        ok: bool,
        reason: Option<&str>,
        message: Option<String>,
    ) -> Value {
        let status = if ok { "True" } else { "False" };
        let entry = self
            .transitions
            .entry(type_.to_string())
            .or_insert_with(|| (status.to_string(), now_rfc3339()));
        if entry.0 != status {
            *entry = (status.to_string(), now_rfc3339());
        }
        let mut c = json!({
            "type": type_, "status": status, "lastTransitionTime": entry.1, "lastProbeTime": null,
        });
        if let Some(r) = reason {
            c["reason"] = json!(r);
        }
        if let Some(m) = message {
            c["message"] = json!(m);
        }
        c
    }

    fn container_status(&self, c: &Ctr) -> Value {
        let state = match &c.state {
            State::Waiting { reason, message } => {
                let mut w = json!({ "reason": reason });
                if let Some(m) = message {
                    w["message"] = json!(m);
                }
                // Before the first start the sandbox or a volume may be what it waits for.
                if c.instances == 0 && !c.init {
                    if let Some(m) = self.sandbox_error.clone().or(self.volume_error.clone()) {
                        w["message"] = json!(m);
                    }
                }
                json!({ "waiting": w })
            }
            State::Running(i) => json!({ "running": { "startedAt": i.started_at } }),
            State::Terminated(t) => t.json(),
        };
        let image = c.spec.image.clone().unwrap_or_default();
        let mut s = json!({
            "name": c.spec.name,
            "image": image,
            "imageID": c.image_bin.as_ref().map(|b| format!("mole-test-kubelet://{}", b.display())).unwrap_or_default(),
            "ready": c.ready && c.running().is_some() && (c.started),
            "restartCount": c.restarts,
            "started": c.running().is_some() && c.started,
            "state": state,
            "lastState": c.last.as_ref().map(Term::json).unwrap_or_else(|| json!({})),
        });
        let id = match &c.state {
            State::Running(i) => Some(i.id.clone()),
            State::Terminated(t) if !t.id.is_empty() => Some(t.id.clone()),
            _ => c.last.as_ref().map(|t| t.id.clone()),
        };
        if let Some(id) = id {
            s["containerID"] = json!(id);
        }
        s
    }

    /// The pod's status (kubelet's `getPhase` and conditions).
    fn status(&mut self) -> Value {
        let policy = restart_policy(&self.pod);
        let inits: Vec<&Ctr> = self.ctrs.iter().filter(|c| c.init).collect();
        let mains: Vec<&Ctr> = self.ctrs.iter().filter(|c| !c.init).collect();
        let init_done = inits.iter().all(|c| c.succeeded());
        let init_failed = inits.iter().any(|c| c.done && !c.succeeded());
        let phase = if !init_done {
            if init_failed {
                "Failed"
            } else {
                "Pending"
            }
        } else {
            let (mut running, mut waiting, mut stopped, mut succeeded) = (0, 0, 0, 0);
            for c in &mains {
                match &c.state {
                    State::Running(_) => running += 1,
                    State::Terminated(t) => {
                        stopped += 1;
                        if t.exit_code == 0 {
                            succeeded += 1;
                        }
                    }
                    State::Waiting { .. } => {
                        if c.last.is_some() {
                            stopped += 1;
                        } else {
                            waiting += 1;
                        }
                    }
                }
            }
            if waiting > 0 {
                "Pending"
            } else if running > 0 {
                "Running"
            } else if stopped > 0 {
                let all_done = mains.iter().all(|c| c.done);
                if !all_done || policy == "Always" && !self.finished {
                    "Running"
                } else if stopped == succeeded {
                    "Succeeded"
                } else {
                    "Failed"
                }
            } else {
                "Pending"
            }
        };
        let init_status: Vec<Value> = inits.iter().map(|c| self.container_status(c)).collect();
        let main_status: Vec<Value> = mains.iter().map(|c| self.container_status(c)).collect();
        let unready: Vec<String> = mains
            .iter()
            .filter(|c| !(c.ready && c.started && c.running().is_some()))
            .map(|c| c.spec.name.clone())
            .collect();
        let incomplete: Vec<String> = inits
            .iter()
            .filter(|c| !c.succeeded())
            .map(|c| c.spec.name.clone())
            .collect();
        let completed = matches!(phase, "Succeeded" | "Failed");
        let sandbox = self.net.is_some();
        let mut conditions = vec![self.condition("PodReadyToStartContainers", sandbox, None, None)];
        conditions.push(if incomplete.is_empty() {
            self.condition("Initialized", true, None, None)
        } else {
            self.condition(
                "Initialized",
                false,
                Some("ContainersNotInitialized"),
                Some(format!(
                    "containers with incomplete status: [{}]",
                    incomplete.join(" ")
                )),
            )
        });
        let ready = unready.is_empty() && !completed;
        let (reason, message) = if ready {
            (None, None)
        } else if completed {
            (Some("PodCompleted"), None)
        } else {
            (
                Some("ContainersNotReady"),
                Some(format!(
                    "containers with unready status: [{}]",
                    unready.join(" ")
                )),
            )
        };
        conditions.push(self.condition("ContainersReady", ready, reason, message.clone()));
        conditions.push(self.condition("Ready", ready, reason, message));
        let mut st = json!({
            "phase": phase,
            "hostIP": self.ctx.host_ip.to_string(),
            "hostIPs": [{ "ip": self.ctx.host_ip.to_string() }],
            "startTime": self.start_time,
            "conditions": conditions,
            "containerStatuses": main_status,
        });
        if !init_status.is_empty() {
            st["initContainerStatuses"] = json!(init_status);
        }
        if let Some(ip) = self.ip {
            st["podIP"] = json!(ip.to_string());
            st["podIPs"] = json!([{ "ip": ip.to_string() }]);
        }
        st
    }

    /// Kills what still runs, removes the sandbox and the pod's files.
    fn cleanup(&mut self) {
        self.kill_all("KILL");
        for c in &mut self.ctrs {
            if let State::Running(inst) = &c.state {
                self.ctx.forget_group(inst.pgid);
            }
            c.state = State::Waiting {
                reason: String::new(),
                message: None,
            };
        }
        self.net = None;
        {
            let mut idx = self
                .ctx
                .logs
                .lock()
                .expect("no panic while holding the lock");
            let key = self.key();
            if idx
                .get(&key)
                .is_some_and(|m| m.values().all(|c| c.uid == self.uid))
            {
                idx.remove(&key);
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One probe of `c` (`p`): Ok on success, Err with why.
async fn run_probe(
    http: &reqwest::Client,
    ip: Option<Ipv4Addr>,
    c: &Container,
    p: &Probe,
    pgid: u32,
) -> Result<(), String> {
    let timeout = Duration::from_secs(p.timeout_seconds.unwrap_or(1).max(1) as u64);
    // Where an HTTP or TCP probe connects: its host, else the pod's address; its port, by
    // number or by the container's name for it.
    let target = |host: &Option<String>, port: &IntOrString| -> Result<(String, i32), String> {
        let host = host
            .clone()
            .or(ip.map(|i| i.to_string()))
            .ok_or("the pod has no address")?;
        let port = match port {
            IntOrString::Int(n) => *n,
            IntOrString::String(name) => c
                .ports
                .iter()
                .flatten()
                .find(|cp| cp.name.as_deref() == Some(name.as_str()))
                .map(|cp| cp.container_port)
                .ok_or_else(|| format!("no port named {name}"))?,
        };
        Ok((host, port))
    };
    if let Some(h) = &p.http_get {
        let (host, port) = target(&h.host, &h.port)?;
        let scheme = h.scheme.as_deref().unwrap_or("HTTP").to_lowercase();
        let path = h.path.clone().unwrap_or_else(|| "/".into());
        let path = if path.starts_with('/') {
            path
        } else {
            format!("/{path}")
        };
        let mut req = http
            .get(format!("{scheme}://{host}:{port}{path}"))
            .timeout(timeout)
            .header("User-Agent", "kube-probe/1.37");
        for hh in h.http_headers.iter().flatten() {
            req = req.header(hh.name.as_str(), hh.value.as_str());
        }
        let resp = req.send().await.map_err(|e| e.to_string())?;
        let code = resp.status().as_u16();
        return if (200..400).contains(&code) {
            Ok(())
        } else {
            Err(format!("HTTP probe failed with statuscode: {code}"))
        };
    }
    if let Some(t) = &p.tcp_socket {
        let (host, port) = target(&t.host, &t.port)?;
        return match tokio::time::timeout(
            timeout,
            tokio::net::TcpStream::connect((host.as_str(), port as u16)),
        )
        .await
        {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err("timeout".into()),
        };
    }
    if let Some(e) = &p.exec {
        // In the container's namespaces and root, as `kubectl exec` would run it.
        let mut cmd = tokio::process::Command::new("nsenter");
        cmd.args(["-t", &pgid.to_string(), "-m", "-n", "-u", "-r", "-w", "--"])
            .args(e.command.iter().flatten())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true);
        return match tokio::time::timeout(timeout, cmd.status()).await {
            Ok(Ok(s)) if s.success() => Ok(()),
            Ok(Ok(s)) => Err(format!("command exited with {s}")),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err("timeout".into()),
        };
    }
    Err("unsupported probe (grpc)".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expand_follows_kubernetes_rules() {
        let vars: HashMap<String, String> =
            [("A".to_string(), "x".to_string())].into_iter().collect();
        assert_eq!(expand("$(A)/$(B)", &vars), "x/$(B)");
        assert_eq!(expand("$$(A) $$ $", &vars), "$(A) $ $");
        assert_eq!(expand("é$(A", &vars), "é$(A");
    }
}
