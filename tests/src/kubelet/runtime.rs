//! A container as a local process: in the pod's network namespace, with a mount namespace of
//! its own whose root is a directory built from the host's (the "image" is the host) with the
//! pod's volumes mounted at their `mountPath`s.
//!
//! The root is `<instance>/root`: each top-level directory of the host's `/` is an overlay
//! there whose lower layer is the host's and whose upper layer is the container's own (on a
//! tmpfs that lives as long as the container), so what a container writes outside its volumes,
//! and the mount points made for them (`/etc/mole`, `/dev/termination-log`), never reach the
//! host, as with an image's copy-on-write layer; `readOnlyRootFilesystem` remounts them
//! read-only. `/proc` and `/sys` are the host's (the network namespace's sysfs), `/tmp` an
//! empty tmpfs (an image's /tmp is empty). `chroot` into it, `setpriv` to the pod's user,
//! `env -C` to the working directory, then the command: every step `exec`s, so the process the
//! kubelet spawned *is* the container.
//!
//! The chain is `setpriv --pdeathsig=KILL ip netns exec <ns> unshare --mount --uts
//! --propagation slave sh <setup>`: the container dies with the test's thread, its mounts never
//! propagate to the host (slave: the host's unmounts still reach it, so an `ip netns del` of
//! another pod is not held up by this one), and the hostname is the pod's.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::os::unix::fs::symlink;
use std::path::{Component, Path, PathBuf};
use std::process::Stdio;
use std::sync::OnceLock;

use anyhow::{bail, Context as _, Result};

/// A volume (or file) mounted into a container.
#[derive(Debug, Clone)]
pub struct Mount {
    /// The host path.
    pub host: PathBuf,
    /// Where the container sees it (absolute).
    pub path: String,
    /// Mounted read-only.
    pub read_only: bool,
}

/// The user a container runs as (`runAsUser`, `runAsGroup`, supplementary groups with
/// `fsGroup`); None runs it as root.
#[derive(Debug, Clone)]
pub struct User {
    /// uid.
    pub uid: i64,
    /// gid.
    pub gid: i64,
    /// Supplementary groups.
    pub groups: Vec<i64>,
}

/// Everything needed to start one instance of a container.
#[derive(Debug, Clone)]
pub struct Launch {
    /// The pod's network namespace.
    pub netns: String,
    /// The pod's hostname.
    pub hostname: String,
    /// This instance's directory (root, overlay layers, setup log).
    pub dir: PathBuf,
    /// The pod's directory of `hosts`, `resolv.conf` and `hostname`, seen at `/.kubelet`.
    pub pod_etc: PathBuf,
    /// The volumes, the termination-message file among them.
    pub mounts: Vec<Mount>,
    /// The command and its arguments (argv[0] a host path or a name on the PATH).
    pub argv: Vec<String>,
    /// The environment, in order.
    pub env: Vec<(String, String)>,
    /// `workingDir`.
    pub working_dir: Option<String>,
    /// `runAsUser` and friends.
    pub user: Option<User>,
    /// `readOnlyRootFilesystem`: only volumes (and /dev) are writable.
    pub read_only_root: bool,
    /// The container's log (stdout and stderr).
    pub log: PathBuf,
}

/// The marker file the setup writes just before `exec`ing the container: without it, the
/// container never started (a mount failed) and its exit is a `StartError`.
pub const STARTED_MARKER: &str = "started";
/// Where the setup script's own errors go.
pub const SETUP_LOG: &str = "setup.log";

/// Absolute paths of the host tools the runtime runs (resolved once from this process's PATH:
/// a container's environment never decides which `mount` the setup runs).
struct Tools {
    setpriv: PathBuf,
    ip: PathBuf,
    unshare: PathBuf,
    sh: PathBuf,
    mount: PathBuf,
    umount: PathBuf,
    awk: PathBuf,
    mkdir: PathBuf,
    touch: PathBuf,
    ln: PathBuf,
    chroot: PathBuf,
    hostname: PathBuf,
    env: PathBuf,
}

fn which(name: &str) -> Result<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([
            "/usr/sbin".into(),
            "/usr/bin".into(),
            "/sbin".into(),
            "/bin".into(),
        ])
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .with_context(|| format!("{name} is not on the PATH"))
}

fn tools() -> Result<&'static Tools> {
    static TOOLS: OnceLock<std::result::Result<Tools, String>> = OnceLock::new();
    TOOLS
        .get_or_init(|| {
            (|| -> Result<Tools> {
                Ok(Tools {
                    setpriv: which("setpriv")?,
                    ip: which("ip")?,
                    unshare: which("unshare")?,
                    sh: which("sh")?,
                    mount: which("mount")?,
                    umount: which("umount")?,
                    awk: which("awk")?,
                    mkdir: which("mkdir")?,
                    touch: which("touch")?,
                    ln: which("ln")?,
                    chroot: which("chroot")?,
                    hostname: which("hostname")?,
                    env: which("env")?,
                })
            })()
            .map_err(|e| format!("{e:#}"))
        })
        .as_ref()
        .map_err(|e| anyhow::anyhow!("{e}"))
}

/// `s` quoted for sh.
pub fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

fn q(p: &Path) -> String {
    sh_quote(&p.to_string_lossy())
}

/// `path` (absolute, in the container) with every symlink of the host's tree resolved as a
/// chroot would (absolute targets from the root), `.`/`..` folded; what does not exist on the
/// host is kept as written.
pub fn resolve(path: &str) -> PathBuf {
    let mut todo: Vec<String> = path
        .split('/')
        .filter(|c| !c.is_empty())
        .rev()
        .map(str::to_string)
        .collect();
    let mut cur = PathBuf::from("/");
    let mut links = 0;
    while let Some(c) = todo.pop() {
        match c.as_str() {
            "." => continue,
            ".." => {
                cur.pop();
                continue;
            }
            _ => {}
        }
        let next = cur.join(&c);
        match std::fs::symlink_metadata(&next) {
            Ok(m) if m.file_type().is_symlink() && links < 40 => {
                links += 1;
                let target = std::fs::read_link(&next).unwrap_or_default();
                if target.is_absolute() {
                    cur = PathBuf::from("/");
                }
                for comp in target.components().rev() {
                    match comp {
                        Component::Normal(n) => todo.push(n.to_string_lossy().into_owned()),
                        Component::ParentDir => todo.push("..".into()),
                        _ => {}
                    }
                }
            }
            _ => cur = next,
        }
    }
    cur
}

/// The first component of an absolute container path.
fn top(path: &Path) -> Option<String> {
    path.components().find_map(|c| match c {
        Component::Normal(n) => Some(n.to_string_lossy().into_owned()),
        _ => None,
    })
}

/// Writes the setup script of `l` and prepares its root; returns the script's path.
fn prepare(l: &Launch) -> Result<PathBuf> {
    let t = tools()?;
    let root = l.dir.join("root");
    std::fs::create_dir_all(&root)?;
    let mounts: Vec<(PathBuf, &Mount)> = {
        let mut m: Vec<(PathBuf, &Mount)> =
            l.mounts.iter().map(|m| (resolve(&m.path), m)).collect();
        // Parents before children.
        m.sort_by_key(|(p, _)| p.components().count());
        m
    };
    // Top-level entries that are mount points themselves (left empty for the volume).
    let mut targets: Vec<String> = Vec::new();
    for (p, _) in &mounts {
        let Some(first) = top(p) else {
            bail!("cannot mount a volume at /");
        };
        if p.components().count() == 2 {
            targets.push(first);
        }
    }
    let mut s = String::new();
    let setup_log = l.dir.join(SETUP_LOG);
    writeln!(s, "set -e")?;
    // The setup's errors go to its own log (fd 3 keeps the container's stderr).
    writeln!(s, "exec 3>&2 2>>{}", q(&setup_log))?;
    writeln!(s, "cd /")?;
    let mount = q(&t.mount);
    // The container's writable layers, in memory: gone with its mount namespace.
    let layers = l.dir.join("layers");
    std::fs::create_dir_all(&layers)?;
    writeln!(s, "{mount} -t tmpfs -o mode=0700 layers {}", q(&layers))?;
    // Copy-on-write overlays, remounted read-only for readOnlyRootFilesystem.
    let mut overlays: Vec<PathBuf> = Vec::new();
    for e in std::fs::read_dir("/")?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let ft = e.file_type()?;
        let dst = root.join(&name);
        if ft.is_symlink() {
            if !targets.contains(&name) {
                let _ = std::fs::remove_file(&dst);
                symlink(std::fs::read_link(e.path())?, &dst)?;
            }
            continue;
        }
        if !ft.is_dir() || targets.contains(&name) {
            continue;
        }
        std::fs::create_dir_all(&dst)?;
        match name.as_str() {
            "proc" | "sys" => writeln!(s, "{mount} --rbind {} {}", q(&e.path()), q(&dst))?,
            // An image's /tmp is empty: the host's is not the container's.
            "tmp" => {
                writeln!(s, "{mount} -t tmpfs -o mode=1777 tmp {}", q(&dst))?;
                overlays.push(dst.clone());
            }
            _ => {
                let upper = layers.join(&name).join("upper");
                let work = layers.join(&name).join("work");
                writeln!(s, "{} -p {} {}", q(&t.mkdir), q(&upper), q(&work))?;
                writeln!(
                    s,
                    "{mount} -t overlay overlay -o {} {}",
                    sh_quote(&format!(
                        "lowerdir=/{name},upperdir={},workdir={}",
                        upper.display(),
                        work.display()
                    )),
                    q(&dst)
                )?;
                if name != "dev" {
                    overlays.push(dst.clone());
                }
            }
        }
    }
    // The recursive binds copied the host's `ip netns` handles (nsfs mounts under
    // /run/netns): held here they would keep other pods' namespaces alive after their
    // `ip netns del`.
    writeln!(
        s,
        "{} '{{ for (i = 7; i <= NF; i++) if ($i == \"-\") {{ if ($(i+1) == \"nsfs\") print $5; break }} }}' \
         /proc/self/mountinfo | while read -r m; do case \"$m\" in {}/*) {} -l \"$m\";; esac; done",
        q(&t.awk),
        q(&root),
        q(&t.umount)
    )?;
    // /dev's overlay hides the host's own mounts under it.
    if Path::new("/dev/pts/ptmx").exists() {
        writeln!(s, "{mount} --rbind /dev/pts {}", q(&root.join("dev/pts")))?;
    }
    writeln!(s, "{} -p {}", q(&t.mkdir), q(&root.join("dev/shm")))?;
    writeln!(
        s,
        "{mount} -t tmpfs -o mode=1777 shm {}",
        q(&root.join("dev/shm"))
    )?;
    // The pod's own hosts, resolv.conf and hostname (rewritten by the kubelet with a rename,
    // hence symlinks into a directory rather than file mounts).
    let kdir = root.join(".kubelet");
    std::fs::create_dir_all(&kdir)?;
    writeln!(s, "{mount} --bind {} {}", q(&l.pod_etc), q(&kdir))?;
    writeln!(s, "{mount} -o remount,bind,ro {}", q(&kdir))?;
    for f in ["hosts", "resolv.conf", "hostname"] {
        writeln!(
            s,
            "{} -sfn /.kubelet/{f} {}",
            q(&t.ln),
            q(&root.join("etc").join(f))
        )?;
    }
    for (p, m) in &mounts {
        let rel = p.strip_prefix("/").unwrap_or(p);
        let dst = root.join(rel);
        if m.host.is_dir() {
            if p.components().count() == 2 {
                std::fs::create_dir_all(&dst)?;
            } else {
                writeln!(s, "{} -p {}", q(&t.mkdir), q(&dst))?;
            }
        } else {
            if let Some(parent) = dst.parent() {
                writeln!(s, "{} -p {}", q(&t.mkdir), q(parent))?;
            }
            writeln!(s, "{} {}", q(&t.touch), q(&dst))?;
        }
        writeln!(s, "{mount} --bind {} {}", q(&m.host), q(&dst))?;
        if m.read_only {
            writeln!(s, "{mount} -o remount,bind,ro {}", q(&dst))?;
        }
    }
    // The "image" is this checkout's build, run from its host path. A checkout under the
    // host's /tmp is hidden there (the container's /tmp is its own tmpfs or a volume, as
    // the worker's emptyDir), so the binary is bound, read-only, at `/.image/<name>` and
    // run from there, as an image's binary has a path of its own.
    let mut argv = l.argv.clone();
    if let Some(bin) = argv
        .first()
        .map(PathBuf::from)
        .filter(|b| b.starts_with("/tmp") && b.is_file())
    {
        let name = bin.file_name().context("the command has no file name")?;
        let dir = root.join(".image");
        std::fs::create_dir_all(&dir)?;
        let inside = dir.join(name);
        std::fs::write(&inside, b"")?;
        writeln!(s, "{mount} --bind {} {}", q(&bin), q(&inside))?;
        writeln!(s, "{mount} -o remount,bind,ro {}", q(&inside))?;
        argv[0] = Path::new("/.image").join(name).display().to_string();
    }
    if l.read_only_root {
        for o in &overlays {
            writeln!(s, "{mount} -o remount,ro {}", q(o))?;
        }
    }
    writeln!(s, "{} {}", q(&t.hostname), sh_quote(&l.hostname))?;
    writeln!(s, ": > {}", q(&l.dir.join(STARTED_MARKER)))?;
    writeln!(s, "exec 2>&3 3>&-")?;
    let mut exec = format!("exec {} {}", q(&t.chroot), q(&root));
    // setpriv again after the credentials change (which clears the parent-death signal).
    write!(exec, " {} --pdeathsig=KILL", q(&t.setpriv))?;
    if let Some(u) = &l.user {
        write!(exec, " --reuid={} --regid={}", u.uid, u.gid)?;
        if u.groups.is_empty() {
            write!(exec, " --clear-groups")?;
        } else {
            let g: Vec<String> = u.groups.iter().map(i64::to_string).collect();
            write!(exec, " --groups={}", g.join(","))?;
        }
    }
    write!(
        exec,
        " {} -C {} --",
        q(&t.env),
        sh_quote(l.working_dir.as_deref().unwrap_or("/"))
    )?;
    for a in &argv {
        write!(exec, " {}", sh_quote(a))?;
    }
    writeln!(s, "{exec}")?;
    let script = l.dir.join("setup.sh");
    std::fs::write(&script, s)?;
    Ok(script)
}

/// Starts the container of `l`: the spawned process is the container's (see the module's
/// doc), in a process group of its own, killed if the child handle is dropped.
pub fn spawn(l: &Launch) -> Result<tokio::process::Child> {
    let t = tools()?;
    std::fs::create_dir_all(&l.dir)?;
    let script = prepare(l)?;
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&l.log)
        .with_context(|| format!("opening {}", l.log.display()))?;
    let env: BTreeMap<&str, &str> = l
        .env
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let child = tokio::process::Command::new(&t.setpriv)
        .arg("--pdeathsig=KILL")
        .arg(&t.ip)
        .args(["netns", "exec", &l.netns])
        .arg(&t.unshare)
        .args(["--mount", "--uts", "--propagation", "slave"])
        .arg(&t.sh)
        .arg(&script)
        .env_clear()
        .envs(env)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .context("starting the container")?;
    Ok(child)
}

/// Sends `signal` to process `pid` alone: SIGTERM goes to a container's main process, as a
/// runtime sends it to the container's init (the shell's children do not get it).
pub fn signal(pid: u32, signal: &str) {
    let _ = std::process::Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// Sends `signal` (`KILL`) to the process group `pgid`: everything the container started,
/// as a runtime kills a container's whole cgroup.
pub fn signal_group(pgid: u32, signal: &str) {
    let _ = std::process::Command::new("kill")
        .arg(format!("-{signal}"))
        .arg("--")
        .arg(format!("-{pgid}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}
