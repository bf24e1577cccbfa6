//! The pods' network: a bridge of the kubelet's own with a /24 from 10.0.0.0/8, its first
//! address on the host (the node's InternalIP, which the test process reaches pods through),
//! and per pod a network namespace joined to the bridge by a veth pair.
//!
//! Everything is named with the bridge's name (`mb<pid%1000><n>`), and a state file under
//! [`STATE_DIR`] records the process that owns a bridge: a later start removes the bridges and
//! namespaces of owners that are gone (a test killed before its `Drop` ran).

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{bail, Context as _, Result};

/// Where the owners of live bridges are recorded (one file per bridge: `<pid> <starttime>`).
pub const STATE_DIR: &str = "/run/mole-kubelet";

/// Prefix of every bridge (and of its veths and namespaces' names).
const PREFIX: &str = "mb";

/// Bridges made by this process so far (the `<n>` of their names).
static BRIDGES: AtomicU32 = AtomicU32::new(0);

/// Runs `ip ARGS` (blocking); Err with its stderr unless it succeeds.
pub fn ip(args: &[&str]) -> Result<String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .context("running ip")?;
    if !out.status.success() {
        bail!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The start time of process `pid` (field 22 of its stat), which tells a reused pid apart.
fn start_time(pid: u32) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces: fields after its closing parenthesis.
    let after = stat.rsplit_once(") ")?.1;
    after.split_whitespace().nth(19).map(str::to_string)
}

/// Whether the owner recorded in a state file is still running.
fn owner_alive(record: &str) -> bool {
    let mut it = record.split_whitespace();
    let (Some(pid), Some(start)) = (it.next(), it.next()) else {
        return false;
    };
    pid.parse::<u32>()
        .ok()
        .and_then(start_time)
        .is_some_and(|s| s == start)
}

/// Removes the bridges, namespaces and state files of kubelets whose process is gone, and
/// kills what still runs in those namespaces.
pub fn clean_stale() {
    let Ok(entries) = std::fs::read_dir(STATE_DIR) else {
        return;
    };
    let namespaces = ip(&["netns", "list"]).unwrap_or_default();
    for e in entries.flatten() {
        let bridge = e.file_name().to_string_lossy().into_owned();
        let record = std::fs::read_to_string(e.path()).unwrap_or_default();
        if owner_alive(&record) {
            continue;
        }
        for ns in namespaces
            .lines()
            .filter_map(|l| l.split_whitespace().next())
            .filter(|n| n.starts_with(&format!("{bridge}-")))
        {
            kill_namespace(ns);
        }
        let _ = ip(&["link", "del", &bridge]);
        let _ = std::fs::remove_file(e.path());
        eprintln!("kubelet: removed the stale bridge {bridge} and its namespaces");
    }
}

/// Kills every process in network namespace `ns`, then deletes it.
fn kill_namespace(ns: &str) {
    if let Ok(pids) = ip(&["netns", "pids", ns]) {
        for pid in pids.split_whitespace() {
            let _ = Command::new("kill").args(["-KILL", pid]).status();
        }
    }
    let _ = ip(&["netns", "del", ns]);
}

/// The 10.x.y.0/24 subnets the host already routes or addresses.
fn used_subnets() -> BTreeSet<(u8, u8)> {
    let mut used = BTreeSet::new();
    let text =
        ip(&["-4", "-o", "addr"]).unwrap_or_default() + &ip(&["-4", "route"]).unwrap_or_default();
    for word in text.split_whitespace() {
        let addr = word.split('/').next().unwrap_or("");
        if let Ok(a) = addr.parse::<Ipv4Addr>() {
            let o = a.octets();
            if o[0] == 10 {
                used.insert((o[1], o[2]));
            }
        }
    }
    used
}

/// A bridge of the kubelet's own (deleted on drop).
pub struct Bridge {
    /// Its name, the prefix of its veths and namespaces.
    pub name: String,
    /// The gateway: the bridge's address on the host, the node's InternalIP.
    pub gateway: Ipv4Addr,
    /// The subnet's first three octets.
    net: [u8; 3],
    /// Host octets in use.
    used: Mutex<BTreeSet<u8>>,
    /// The next host octet to try (round robin: an address is not reused at once).
    next: Mutex<u8>,
    state: PathBuf,
}

impl Bridge {
    /// Creates a bridge with a free 10.x.y.0/24 (avoiding the service network 10.96/16).
    pub fn create() -> Result<Self> {
        clean_stale();
        let n = BRIDGES.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let name = format!("{PREFIX}{}{n}", pid % 1000);
        if name.len() > 15 {
            bail!("bridge name {name} is longer than an interface name may be");
        }
        // Start from a spot that depends on the process and count, so two test processes
        // rarely try the same subnet; skip what the host uses.
        let used = used_subnets();
        let start = (pid as usize * 7 + n as usize * 13) % 200;
        let (b, c) = (0..200 * 250)
            .map(|i| {
                let k = (start * 250 + i) % (200 * 250);
                (40 + (k / 250) as u8, (k % 250) as u8 + 1)
            })
            .find(|(b, c)| *b != 96 && !used.contains(&(*b, *c)))
            .context("no free 10.x.y.0/24")?;
        let gateway = Ipv4Addr::new(10, b, c, 1);
        std::fs::create_dir_all(STATE_DIR)?;
        let state = Path::new(STATE_DIR).join(&name);
        std::fs::write(
            &state,
            format!(
                "{pid} {}\n",
                start_time(pid).context("this process's start time")?
            ),
        )?;
        let bridge = Self {
            name: name.clone(),
            gateway,
            net: [10, b, c],
            used: Mutex::new(BTreeSet::new()),
            next: Mutex::new(2),
            state,
        };
        ip(&["link", "add", &name, "type", "bridge"])?;
        ip(&["addr", "add", &format!("{gateway}/24"), "dev", &name])?;
        ip(&["link", "set", &name, "up"])?;
        Ok(bridge)
    }

    /// A free pod address.
    fn allocate(&self) -> Result<Ipv4Addr> {
        let mut used = self.used.lock().expect("no panic while holding the lock");
        let mut next = self.next.lock().expect("no panic while holding the lock");
        for _ in 0..253 {
            let host = *next;
            *next = if host >= 254 { 2 } else { host + 1 };
            if used.insert(host) {
                return Ok(Ipv4Addr::new(self.net[0], self.net[1], self.net[2], host));
            }
        }
        bail!("every address of {} is taken", self.name)
    }

    fn release(&self, addr: Ipv4Addr) {
        self.used
            .lock()
            .expect("no panic while holding the lock")
            .remove(&addr.octets()[3]);
    }

    /// A network namespace for a pod (`<bridge>-<n>`), with `eth0` at a free address on the
    /// bridge, loopback up and the default route through the gateway.
    pub fn pod_network(self: &Arc<Self>, n: u32) -> Result<PodNetwork> {
        let addr = self.allocate()?;
        let ns = format!("{}-{n}", self.name);
        let host_veth = format!("{}v{n}", self.name);
        let net = PodNetwork {
            bridge: self.clone(),
            ns: ns.clone(),
            addr,
            api: None,
        };
        if host_veth.len() > 15 {
            bail!("veth name {host_veth} is longer than an interface name may be");
        }
        ip(&["netns", "add", &ns])?;
        ip(&[
            "link", "add", &host_veth, "type", "veth", "peer", "name", "eth0", "netns", &ns,
        ])?;
        ip(&["link", "set", &host_veth, "master", &self.name, "up"])?;
        ip(&[
            "-n",
            &ns,
            "addr",
            "add",
            &format!("{addr}/24"),
            "dev",
            "eth0",
        ])?;
        ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
        ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        ip(&[
            "-n",
            &ns,
            "route",
            "add",
            "default",
            "via",
            &self.gateway.to_string(),
        ])?;
        Ok(net)
    }
}

impl Bridge {
    /// Kills what runs in the bridge's namespaces, deletes them and the bridge (idempotent:
    /// the kubelet's `Drop` calls it while pod workers may still hold the bridge).
    pub fn teardown(&self) {
        // Namespaces of pods whose worker did not get to clean up (a panic, an abort).
        if let Ok(list) = ip(&["netns", "list"]) {
            for ns in list
                .lines()
                .filter_map(|l| l.split_whitespace().next())
                .filter(|n| n.starts_with(&format!("{}-", self.name)))
            {
                kill_namespace(ns);
            }
        }
        let _ = ip(&["link", "del", &self.name]);
        let _ = std::fs::remove_file(&self.state);
        // Gone once no kubelet runs (fails while another one's file is there).
        let _ = std::fs::remove_dir(STATE_DIR);
    }
}

impl Drop for Bridge {
    fn drop(&mut self) {
        self.teardown();
    }
}

/// A pod's network namespace (deleted, with its veth, on drop).
pub struct PodNetwork {
    bridge: Arc<Bridge>,
    /// The namespace's name (`ip netns exec <ns>`).
    pub ns: String,
    /// The pod's address.
    pub addr: Ipv4Addr,
    /// The pod's way to the API server (see [`PodNetwork::reach_api_server`]).
    api: Option<tokio::task::JoinHandle<()>>,
}

impl PodNetwork {
    /// Lets the pod reach the API server as in-cluster clients do, at the `kubernetes`
    /// Service's address `service` (`KUBERNETES_SERVICE_HOST:PORT`, an address the serving
    /// certificate names): that address is put on the pod's loopback and a listener bound
    /// there inside its namespace hands each connection to the API server at `to` on the
    /// host's loopback, which no pod can reach otherwise. A kube-proxy does the same for a
    /// ClusterIP with a NAT rule; this machine has no netfilter tools, and a listener of the
    /// pod's own keeps every pod (and every kubelet) apart.
    pub fn reach_api_server(&mut self, service: SocketAddrV4, to: SocketAddr) -> Result<()> {
        ip(&[
            "-n",
            &self.ns,
            "addr",
            "add",
            &format!("{}/32", service.ip()),
            "dev",
            "lo",
        ])?;
        let listener = listen_in(&self.ns, service)?;
        let listener = tokio::net::TcpListener::from_std(listener)?;
        self.api = Some(tokio::spawn(async move {
            // Dropped with the accept loop (the pod's network going), the open
            // connections' copies are aborted too.
            let mut conns = tokio::task::JoinSet::new();
            while let Ok((mut inbound, _)) = listener.accept().await {
                conns.spawn(async move {
                    if let Ok(mut out) = tokio::net::TcpStream::connect(to).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut out).await;
                    }
                });
                // Reap the finished copies so a long-lived pod holds only its open ones.
                while conns.try_join_next().is_some() {}
            }
        }));
        Ok(())
    }
}

/// A TCP listener at `addr` inside network namespace `ns`: a socket stays in the namespace
/// it was made in, so it is bound from a thread that joins `ns` and ends right after (the
/// kubelet's own threads stay in the host's namespace).
#[allow(unsafe_code)] // setns has no safe wrapper in the crates used here
fn listen_in(ns: &str, addr: SocketAddrV4) -> Result<std::net::TcpListener> {
    use std::os::fd::AsRawFd as _;
    let handle = std::fs::File::open(format!("/run/netns/{ns}"))
        .with_context(|| format!("opening network namespace {ns}"))?;
    std::thread::scope(|s| {
        s.spawn(|| -> Result<std::net::TcpListener> {
            // SAFETY: setns changes only the calling thread's network namespace; the fd is
            // open for the call, and this scoped thread ends once the socket is bound.
            if unsafe { libc::setns(handle.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                bail!("setns into {ns}: {}", std::io::Error::last_os_error());
            }
            let l = std::net::TcpListener::bind(addr)
                .with_context(|| format!("binding {addr} in {ns}"))?;
            l.set_nonblocking(true)?;
            Ok(l)
        })
        .join()
        .map_err(|_| anyhow::anyhow!("the thread binding {addr} in {ns} panicked"))?
    })
}

impl Drop for PodNetwork {
    fn drop(&mut self) {
        if let Some(t) = self.api.take() {
            t.abort();
        }
        kill_namespace(&self.ns);
        self.bridge.release(self.addr);
    }
}
