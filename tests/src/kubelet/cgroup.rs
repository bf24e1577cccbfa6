//! CPU limits (`resources.limits.cpu`) as a kubelet enforces them: the container's process in
//! a cgroup of its own with a CFS quota of the limit per 100 ms period (at least 1 ms, the
//! kernel's and the kubelet's floor), so a Job limited to `100m` runs at a tenth of a core.
//!
//! cgroup v2 (`cpu.max`, where the unified hierarchy offers the cpu controller) or v1
//! (`cpu.cfs_quota_us` under the `cpu` hierarchy); the cgroups are made under
//! `mole-kubelet/` and removed when the container ends. Where neither can be written the
//! limit is not enforced, said once in the log: a test that depends on it checks the effect
//! (a Job that should still run).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{bail, Context as _, Result};

/// The CFS period, as the kubelet sets it.
const PERIOD_US: u64 = 100_000;
/// The smallest quota the kernel accepts (the kubelet's `MinQuotaPeriod`).
const MIN_QUOTA_US: u64 = 1_000;
/// The parent of every container's cgroup.
const PARENT: &str = "mole-kubelet";

/// Where the cpu controller can be written.
#[derive(Debug, Clone)]
enum Hierarchy {
    /// The unified hierarchy at this root, cpu enabled for its children.
    V2(PathBuf),
    /// The v1 `cpu` hierarchy at this root.
    V1(PathBuf),
}

/// A quantity of CPU (`100m`, `0.5`, `2`) in millicores; None when it does not parse.
pub fn millicores(q: &str) -> Option<u64> {
    let q = q.trim();
    if let Some(m) = q.strip_suffix('m') {
        return m.parse().ok();
    }
    let cores: f64 = q.parse().ok()?;
    (cores.is_finite() && cores >= 0.0).then(|| (cores * 1000.0).ceil() as u64)
}

/// The quota per [`PERIOD_US`] of `millis` millicores.
fn quota_us(millis: u64) -> u64 {
    (millis * PERIOD_US / 1000).max(MIN_QUOTA_US)
}

static HIERARCHY: OnceLock<Option<Hierarchy>> = OnceLock::new();

fn hierarchy() -> Option<&'static Hierarchy> {
    HIERARCHY
        .get_or_init(|| {
            let found = find();
            if found.is_none() {
                eprintln!(
                    "test kubelet: no writable cpu cgroup controller: CPU limits are not enforced"
                );
            }
            found
        })
        .as_ref()
}

fn find() -> Option<Hierarchy> {
    let v2 = Path::new("/sys/fs/cgroup");
    let controllers = std::fs::read_to_string(v2.join("cgroup.controllers")).unwrap_or_default();
    if controllers.split_whitespace().any(|c| c == "cpu") {
        let parent = v2.join(PARENT);
        let ok = std::fs::create_dir_all(&parent).is_ok()
            && std::fs::write(v2.join("cgroup.subtree_control"), "+cpu").is_ok()
            && std::fs::write(parent.join("cgroup.subtree_control"), "+cpu").is_ok();
        if ok {
            return Some(Hierarchy::V2(v2.into()));
        }
        let _ = std::fs::remove_dir(&parent);
    }
    let v1 = Path::new("/sys/fs/cgroup/cpu");
    if v1.join("cpu.cfs_quota_us").is_file() && std::fs::create_dir_all(v1.join(PARENT)).is_ok() {
        return Some(Hierarchy::V1(v1.into()));
    }
    None
}

/// A container's cgroup: removed when dropped (after its processes ended).
#[derive(Debug)]
pub struct CpuLimit {
    dir: PathBuf,
}

impl Drop for CpuLimit {
    fn drop(&mut self) {
        // The container's processes were just killed: give the kernel a moment to empty it.
        for _ in 0..20 {
            if std::fs::remove_dir(&self.dir).is_ok() || !self.dir.exists() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Puts process `pid` (the container's, which every process it starts inherits) in a new
/// cgroup `name` limited to `millis` millicores. Ok(None) where no controller can be written.
pub fn limit(name: &str, pid: u32, millis: u64) -> Result<Option<CpuLimit>> {
    let Some(h) = hierarchy() else {
        return Ok(None);
    };
    let (root, v2) = match h {
        Hierarchy::V2(r) => (r, true),
        Hierarchy::V1(r) => (r, false),
    };
    let parent = root.join(PARENT);
    let dir = parent.join(name);
    // The parent again: the last kubelet to stop removes it.
    std::fs::create_dir_all(&parent)?;
    if v2 {
        std::fs::write(parent.join("cgroup.subtree_control"), "+cpu")
            .with_context(|| format!("enabling cpu in {}", parent.display()))?;
    }
    std::fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let guard = CpuLimit { dir: dir.clone() };
    let quota = quota_us(millis);
    let written = if v2 {
        std::fs::write(dir.join("cpu.max"), format!("{quota} {PERIOD_US}"))
    } else {
        std::fs::write(dir.join("cpu.cfs_period_us"), PERIOD_US.to_string())
            .and_then(|()| std::fs::write(dir.join("cpu.cfs_quota_us"), quota.to_string()))
    };
    written.with_context(|| format!("setting the quota of {}", dir.display()))?;
    if let Err(e) = std::fs::write(dir.join("cgroup.procs"), pid.to_string()) {
        bail!("moving {pid} into {}: {e}", dir.display());
    }
    Ok(Some(guard))
}

/// Removes the cgroups of the kubelet of bridge `bridge` (their processes were killed), then
/// the parent once no kubelet uses it.
pub fn remove_all(bridge: &str) {
    let Some(h) = HIERARCHY.get().cloned().flatten() else {
        return;
    };
    let root = match h {
        Hierarchy::V2(r) | Hierarchy::V1(r) => r.join(PARENT),
    };
    for e in std::fs::read_dir(&root).into_iter().flatten().flatten() {
        if e.file_name()
            .to_string_lossy()
            .starts_with(&format!("{bridge}-"))
        {
            drop(CpuLimit { dir: e.path() });
        }
    }
    let _ = std::fs::remove_dir(root);
}

/// Removes the cgroups a killed test process left: those named after a bridge (`name`'s first
/// `-`-separated part, see `pod`) that no longer exists. A cgroup still in use refuses.
pub fn remove_stale() {
    let Some(h) = hierarchy() else {
        return;
    };
    let root = match h {
        Hierarchy::V2(r) | Hierarchy::V1(r) => r.join(PARENT),
    };
    for e in std::fs::read_dir(root).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let bridge = name.split('-').next().unwrap_or_default();
        if !Path::new("/sys/class/net").join(bridge).exists() {
            let _ = std::fs::remove_dir(e.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_and_quotas_as_the_kubelet_reads_them() {
        assert_eq!(millicores("100m"), Some(100));
        assert_eq!(millicores("0.5"), Some(500));
        assert_eq!(millicores("2"), Some(2000));
        assert_eq!(millicores("x"), None);
        assert_eq!(quota_us(100), 10_000);
        assert_eq!(quota_us(1), MIN_QUOTA_US, "the kernel's floor");
        assert_eq!(quota_us(2000), 200_000);
    }
}
