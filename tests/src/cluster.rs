//! A real Kubernetes control plane on loopback, for tests: etcd, kube-apiserver,
//! kube-controller-manager and kube-scheduler built from their Go modules by
//! `scripts/k8s-bins.sh` and started as controller-runtime's envtest starts them, with a PKI of
//! their own (openssl), RBAC and service-account tokens on, and an admin kubeconfig.
//!
//! Every [`ControlPlane`] owns its processes and directory: dropping it kills them (and they
//! die with the test's thread if the test process is killed: `setpriv --pdeathsig`), so tests
//! start one each and never share state.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

/// The pinned versions `scripts/k8s-bins.sh` builds (its defaults).
pub const K8S_VERSION: &str = "v1.37.2";
/// etcd's pinned version.
pub const ETCD_VERSION: &str = "v3.6.16";
/// The service network: its first address is the `kubernetes` Service's, which the serving
/// certificate names.
const SERVICE_CIDR: &str = "10.96.0.0/16";
const FIRST_SERVICE_IP: &str = "10.96.0.1";

/// Where the control plane's binaries are: `MOLE_K8S_BIN`, or the cache `k8s-bins.sh` fills
/// (`$MOLE_CACHE/k8s/<k8s>-etcd<etcd>/bin`, `MOLE_CACHE` defaulting to `~/.cache/mole`).
/// Err says what is missing (the caller reports the test skipped).
pub fn bin_dir() -> Result<PathBuf> {
    let dir = match std::env::var_os("MOLE_K8S_BIN") {
        Some(d) => PathBuf::from(d),
        None => {
            let cache = std::env::var_os("MOLE_CACHE")
                .map(PathBuf::from)
                .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache/mole")))
                .context("neither MOLE_CACHE nor HOME is set")?;
            cache
                .join("k8s")
                .join(format!("{K8S_VERSION}-etcd{ETCD_VERSION}"))
                .join("bin")
        }
    };
    for b in [
        "etcd",
        "kube-apiserver",
        "kube-controller-manager",
        "kube-scheduler",
        "kubectl",
    ] {
        if !dir.join(b).is_file() {
            bail!(
                "{} is missing (run scripts/k8s-bins.sh)",
                dir.join(b).display()
            );
        }
    }
    Ok(dir)
}

/// A free TCP port on loopback (bound then released: the process started next takes it).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// A process the control plane started, its output in `log`.
struct Proc {
    name: &'static str,
    child: Child,
    log: PathBuf,
}

/// Which parts to start beside etcd and kube-apiserver.
#[derive(Debug, Clone, Copy)]
pub struct Parts {
    /// kube-controller-manager: Deployments' ReplicaSets and pods, Jobs' pods, garbage
    /// collection by owner, ServiceAccounts and their tokens, EndpointSlices.
    pub controller_manager: bool,
    /// kube-scheduler: binds pods to nodes (a pod runner needs it).
    pub scheduler: bool,
}

impl Default for Parts {
    fn default() -> Self {
        Self {
            controller_manager: true,
            scheduler: true,
        }
    }
}

/// A running control plane (see the module's doc).
pub struct ControlPlane {
    /// Everything it writes: PKI, etcd's data, logs, kubeconfigs.
    pub dir: tempfile::TempDir,
    /// The admin kubeconfig (client certificate in `system:masters`).
    pub kubeconfig: PathBuf,
    /// `https://127.0.0.1:<port>`.
    pub server: String,
    bins: PathBuf,
    procs: Vec<Proc>,
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        // The reverse of the start order: the API server's clients before it, etcd last.
        for p in self.procs.iter_mut().rev() {
            let _ = p.child.kill();
            let _ = p.child.wait();
        }
        if std::env::var_os("MOLE_K8S_KEEP").is_some() {
            let dir = std::mem::replace(&mut self.dir, tempfile::tempdir().expect("tempdir"));
            eprintln!("control plane kept in {}", dir.keep().display());
        }
    }
}

fn openssl(dir: &Path, args: &[&str]) -> Result<()> {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .context("running openssl")?;
    if !out.status.success() {
        bail!(
            "openssl {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// A CA, the API server's serving certificate, the admin's client certificate and the
/// service-account key pair, in `dir`.
fn make_pki(dir: &Path) -> Result<()> {
    openssl(dir, &["genrsa", "-out", "ca.key", "2048"])?;
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-new",
            "-key",
            "ca.key",
            "-days",
            "2",
            "-subj",
            "/CN=mole-test-ca",
            "-out",
            "ca.crt",
        ],
    )?;
    let sign = |name: &str, subj: &str, ext: &str| -> Result<()> {
        let key = format!("{name}.key");
        let csr = format!("{name}.csr");
        let crt = format!("{name}.crt");
        let extfile = format!("{name}.ext");
        std::fs::write(dir.join(&extfile), ext)?;
        openssl(dir, &["genrsa", "-out", &key, "2048"])?;
        openssl(
            dir,
            &["req", "-new", "-key", &key, "-subj", subj, "-out", &csr],
        )?;
        openssl(
            dir,
            &[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "2",
                "-extfile",
                &extfile,
                "-out",
                &crt,
            ],
        )
    };
    sign(
        "apiserver",
        "/CN=kube-apiserver",
        &format!(
            "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n\
             subjectAltName=IP:127.0.0.1,IP:{FIRST_SERVICE_IP},DNS:localhost,DNS:kubernetes,\
             DNS:kubernetes.default,DNS:kubernetes.default.svc,\
             DNS:kubernetes.default.svc.cluster.local\n"
        ),
    )?;
    sign(
        "admin",
        "/O=system:masters/CN=mole-admin",
        "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n",
    )?;
    openssl(dir, &["genrsa", "-out", "sa.key", "2048"])?;
    openssl(dir, &["rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub"])?;
    Ok(())
}

/// A kubeconfig for `server` trusting `ca`, with `user` (a YAML mapping of the user's fields).
fn kubeconfig_yaml(server: &str, ca: &Path, user: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: local\n  cluster:\n    server: {server}\n    \
         certificate-authority: {ca}\nusers:\n- name: user\n  user:\n{user}contexts:\n- name: local\n  \
         context: {{cluster: local, user: user, namespace: default}}\ncurrent-context: local\n",
        ca = ca.display(),
    )
}

impl ControlPlane {
    /// Starts etcd and kube-apiserver (and `parts`), and waits until the API server is ready
    /// and its default namespace exists (at most 90 s).
    pub async fn start(parts: Parts) -> Result<Self> {
        let bins = bin_dir()?;
        let dir = tempfile::Builder::new().prefix("mole-k8s-").tempdir()?;
        let d = dir.path().to_path_buf();
        make_pki(&d)?;
        let etcd_port = free_port();
        let peer_port = free_port();
        let api_port = free_port();
        let server = format!("https://127.0.0.1:{api_port}");
        let kubeconfig = d.join("admin.kubeconfig");
        std::fs::write(
            &kubeconfig,
            kubeconfig_yaml(
                &server,
                &d.join("ca.crt"),
                &format!(
                    "    client-certificate: {}\n    client-key: {}\n",
                    d.join("admin.crt").display(),
                    d.join("admin.key").display()
                ),
            ),
        )?;
        let mut cp = Self {
            dir,
            kubeconfig,
            server,
            bins,
            procs: Vec::new(),
        };
        let etcd_url = format!("http://127.0.0.1:{etcd_port}");
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        cp.spawn(
            "etcd",
            &[
                "--name=default".into(),
                format!("--data-dir={}", d.join("etcd").display()),
                format!("--listen-client-urls={etcd_url}"),
                format!("--advertise-client-urls={etcd_url}"),
                format!("--listen-peer-urls={peer_url}"),
                format!("--initial-advertise-peer-urls={peer_url}"),
                format!("--initial-cluster=default={peer_url}"),
                "--unsafe-no-fsync=true".into(),
                "--log-level=warn".into(),
            ],
        )?;
        let p = |f: &str| d.join(f).display().to_string();
        cp.spawn(
            "kube-apiserver",
            &[
                format!("--etcd-servers={etcd_url}"),
                format!("--secure-port={api_port}"),
                "--bind-address=127.0.0.1".into(),
                "--advertise-address=127.0.0.1".into(),
                // A loopback advertise address is refused by the endpoint reconciler ("may not
                // be in the loopback range"): envtest turns it off, so do we.
                "--endpoint-reconciler-type=none".into(),
                format!("--service-cluster-ip-range={SERVICE_CIDR}"),
                format!("--tls-cert-file={}", p("apiserver.crt")),
                format!("--tls-private-key-file={}", p("apiserver.key")),
                format!("--client-ca-file={}", p("ca.crt")),
                "--authorization-mode=Node,RBAC".into(),
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
                format!("--service-account-key-file={}", p("sa.pub")),
                format!("--service-account-signing-key-file={}", p("sa.key")),
                "--allow-privileged=true".into(),
                format!("--cert-dir={}", p("apiserver-certs")),
                "--v=0".into(),
            ],
        )?;
        let client = cp.client().await?;
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let ready = client
                .request_text(
                    http::Request::get("/readyz")
                        .body(Vec::new())
                        .expect("a GET request"),
                )
                .await;
            if ready.is_ok() {
                let ns: kube::Api<k8s_openapi::api::core::v1::Namespace> =
                    kube::Api::all(client.clone());
                if ns.get_opt("default").await.ok().flatten().is_some() {
                    break;
                }
            }
            cp.check_alive()?;
            if Instant::now() > deadline {
                bail!(
                    "kube-apiserver not ready in 90 s: {}",
                    cp.log_tail("kube-apiserver", 30)
                );
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let kc = cp.kubeconfig.display().to_string();
        if parts.controller_manager {
            cp.spawn(
                "kube-controller-manager",
                &[
                    format!("--kubeconfig={kc}"),
                    format!("--authentication-kubeconfig={kc}"),
                    format!("--authorization-kubeconfig={kc}"),
                    format!("--service-account-private-key-file={}", p("sa.key")),
                    format!("--root-ca-file={}", p("ca.crt")),
                    "--use-service-account-credentials=true".into(),
                    "--leader-elect=false".into(),
                    format!("--service-cluster-ip-range={SERVICE_CIDR}"),
                    // Serving its own /metrics is not needed, and a fixed port would collide
                    // between tests.
                    "--secure-port=0".into(),
                    "--controllers=*".into(),
                    "--v=0".into(),
                ],
            )?;
        }
        if parts.scheduler {
            cp.spawn(
                "kube-scheduler",
                &[
                    format!("--kubeconfig={kc}"),
                    format!("--authentication-kubeconfig={kc}"),
                    format!("--authorization-kubeconfig={kc}"),
                    "--leader-elect=false".into(),
                    "--secure-port=0".into(),
                    "--v=0".into(),
                ],
            )?;
        }
        Ok(cp)
    }

    fn spawn(&mut self, name: &'static str, args: &[String]) -> Result<()> {
        let log = self.dir.path().join(format!("{name}.log"));
        let out = std::fs::File::create(&log)?;
        // setpriv: the process gets SIGKILL when the thread that started it ends, so a test
        // killed by its harness leaves no server behind.
        let child = Command::new("setpriv")
            .arg("--pdeathsig=KILL")
            .arg(self.bins.join(name))
            .args(args)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        self.procs.push(Proc { name, child, log });
        Ok(())
    }

    /// Fails naming the first process that exited, with its log's last lines.
    pub fn check_alive(&mut self) -> Result<()> {
        for p in &mut self.procs {
            if let Some(status) = p.child.try_wait()? {
                let tail = tail(&p.log, 30);
                bail!("{} exited ({status}):\n{tail}", p.name);
            }
        }
        Ok(())
    }

    /// The last `n` lines of the log of process `name`.
    pub fn log_tail(&self, name: &str, n: usize) -> String {
        self.procs
            .iter()
            .find(|p| p.name == name)
            .map(|p| tail(&p.log, n))
            .unwrap_or_default()
    }

    /// The directory of the control plane's binaries (kubectl among them).
    pub fn bins(&self) -> &Path {
        &self.bins
    }

    /// An admin client.
    pub async fn client(&self) -> Result<Client> {
        client_from(&self.kubeconfig).await
    }

    /// A kubeconfig that authenticates with `token` (a ServiceAccount's), written beside the
    /// admin's.
    pub fn token_kubeconfig(&self, name: &str, token: &str) -> Result<PathBuf> {
        let path = self.dir.path().join(format!("{name}.kubeconfig"));
        std::fs::write(
            &path,
            kubeconfig_yaml(
                &self.server,
                &self.dir.path().join("ca.crt"),
                &format!("    token: {token}\n"),
            ),
        )?;
        Ok(path)
    }

    /// `kubectl ARGS` as the admin; Err with its stderr unless it succeeds.
    pub fn kubectl(&self, args: &[&str]) -> Result<String> {
        let out = self.kubectl_output(args, None)?;
        if !out.status.success() {
            bail!(
                "kubectl {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `kubectl ARGS` as the admin with `stdin`, whatever its exit.
    pub fn kubectl_output(&self, args: &[&str], stdin: Option<&str>) -> Result<Output> {
        let mut child = Command::new(self.bins.join("kubectl"))
            .env("KUBECONFIG", &self.kubeconfig)
            .args(args)
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting kubectl")?;
        if let Some(s) = stdin {
            child
                .stdin
                .take()
                .context("kubectl's stdin")?
                .write_all(s.as_bytes())?;
        }
        Ok(child.wait_with_output()?)
    }

    /// `kubectl apply -f -` of `yaml`; returns kubectl's stderr (its warnings) on success.
    pub fn apply(&self, yaml: &str) -> Result<String> {
        let out = self.kubectl_output(&["apply", "--server-side=false", "-f", "-"], Some(yaml))?;
        if !out.status.success() {
            bail!("kubectl apply: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8_lossy(&out.stderr).into_owned())
    }

    /// A token of ServiceAccount `sa` in `ns` (`kubectl create token`), valid for an hour.
    pub fn token(&self, ns: &str, sa: &str) -> Result<String> {
        Ok(self
            .kubectl(&["create", "token", sa, "-n", ns, "--duration=1h"])?
            .trim()
            .to_string())
    }

    /// The API server's request counter (`apiserver_request_total`) summed by
    /// `(verb, resource)`: every write it served, no-op server-side applies included.
    pub async fn request_counts(&self) -> Result<BTreeMap<(String, String), f64>> {
        let client = self.client().await?;
        let text = client
            .request_text(
                http::Request::get("/metrics")
                    .body(Vec::new())
                    .expect("a GET request"),
            )
            .await?;
        Ok(parse_request_counts(&text))
    }
}

/// `apiserver_request_total` samples summed by `(verb, resource)`.
pub fn parse_request_counts(metrics: &str) -> BTreeMap<(String, String), f64> {
    let mut out = BTreeMap::new();
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix("apiserver_request_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let label = |k: &str| -> String {
            let key = format!("{k}=\"");
            labels
                .split(',')
                .find_map(|kv| kv.strip_prefix(&key))
                .map(|v| v.trim_end_matches('"').to_string())
                .unwrap_or_default()
        };
        let v: f64 = value.trim().parse().unwrap_or(0.0);
        *out.entry((label("verb"), label("resource"))).or_insert(0.0) += v;
    }
    out
}

/// A client from the kubeconfig at `path`.
pub async fn client_from(path: &Path) -> Result<Client> {
    let kc = Kubeconfig::read_from(path)?;
    let cfg = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
    Ok(Client::try_from(cfg)?)
}

fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Polls `f` every 200 ms until it returns Some, for at most `timeout`; Err names `what`.
pub async fn wait_for<T, F, Fut>(timeout: Duration, what: &str, mut f: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return Ok(v);
        }
        if Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_counts_sum_every_sample_of_a_verb_and_resource() {
        let text = r#"# HELP apiserver_request_total x
apiserver_request_total{code="200",component="apiserver",dry_run="",group="apps",resource="deployments",scope="resource",subresource="",verb="APPLY",version="v1"} 3
apiserver_request_total{code="201",component="apiserver",dry_run="",group="apps",resource="deployments",scope="resource",subresource="",verb="APPLY",version="v1"} 1
apiserver_request_total{code="200",component="apiserver",dry_run="",group="",resource="services",scope="resource",subresource="",verb="GET",version="v1"} 7
"#;
        let c = parse_request_counts(text);
        assert_eq!(c[&("APPLY".into(), "deployments".into())], 4.0);
        assert_eq!(c[&("GET".into(), "services".into())], 7.0);
        assert_eq!(c.len(), 2);
    }
}
