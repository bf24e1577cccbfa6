//! A pod's volumes on the host: emptyDir, configMap, secret, projected (serviceAccountToken,
//! configMap, secret, downwardAPI), downwardAPI, hostPath and persistentVolumeClaim (the bound
//! PV's `hostPath` or `local` path).
//!
//! configMap, secret, projected and downwardAPI volumes are written as the kubelet's
//! `AtomicWriter` writes them: the files live in a timestamped directory `..<ts>`, `..data`
//! points at it, and each visible name is a symlink through `..data`. An update writes a new
//! directory and renames a new `..data` over the old one, so a reader sees the old files or
//! the new ones, never a mix.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::{symlink, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{bail, Context as _, Result};
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{
    ConfigMap, DownwardAPIVolumeFile, KeyToPath, ObjectFieldSelector, PersistentVolume,
    PersistentVolumeClaim, Pod, Secret, ServiceAccount, Volume,
};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::Api;

/// The file mode of configMap/secret/downwardAPI files when the volume gives none.
const DEFAULT_MODE: i32 = 0o644;

/// The stores and client volumes are read from.
#[derive(Clone)]
pub struct Sources {
    /// Admin client (TokenRequest).
    pub client: kube::Client,
    /// Every ConfigMap.
    pub config_maps: Store<ConfigMap>,
    /// Every Secret.
    pub secrets: Store<Secret>,
    /// Every PersistentVolumeClaim.
    pub claims: Store<PersistentVolumeClaim>,
    /// Every PersistentVolume.
    pub volumes: Store<PersistentVolume>,
}

/// Why a volume cannot be set up yet (the pod waits in `ContainerCreating`, as with a real
/// kubelet's `FailedMount`).
#[derive(Debug)]
pub struct NotReady(pub String);

impl std::fmt::Display for NotReady {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for NotReady {}

/// The files of an atomically written volume: relative path -> (bytes, mode).
pub type Payload = BTreeMap<String, (Vec<u8>, u32)>;

/// A token requested for a projected volume, refreshed at 80% of its life.
#[derive(Clone)]
struct Token {
    value: String,
    refresh_at: Instant,
}

/// A pod's volumes as set up on the host.
pub struct PodVolumes {
    /// Volume name -> host directory (or file) that containers mount.
    pub paths: BTreeMap<String, PathBuf>,
    /// Volume name -> whether it is read-only by nature (PVC with readOnly, configMap, ...).
    pub read_only: BTreeMap<String, bool>,
    /// Tokens of projected volumes, by volume name and path.
    tokens: BTreeMap<(String, String), Token>,
    /// The group that owns the files (`fsGroup`).
    fs_group: Option<u32>,
    dir: PathBuf,
}

fn namespace(pod: &Pod) -> String {
    pod.metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into())
}

/// The value of a downward-API `fieldRef` of `pod` (`metadata.name`, `metadata.labels['k']`,
/// `status.podIP`, ...).
pub fn field_ref(pod: &Pod, f: &ObjectFieldSelector) -> Result<String> {
    let m = &pod.metadata;
    let st = pod.status.clone().unwrap_or_default();
    let spec = pod.spec.clone().unwrap_or_default();
    let path = f.field_path.as_str();
    let map_entry = |map: &Option<BTreeMap<String, String>>, prefix: &str| -> Option<String> {
        let key = path.strip_prefix(prefix)?.strip_suffix("']")?;
        Some(map.as_ref()?.get(key).cloned().unwrap_or_default())
    };
    let fmt_map = |map: &Option<BTreeMap<String, String>>| -> String {
        map.iter()
            .flatten()
            .map(|(k, v)| format!("{k}={}", serde_json::Value::String(v.clone())))
            .collect::<Vec<_>>()
            .join("\n")
    };
    Ok(match path {
        "metadata.name" => m.name.clone().unwrap_or_default(),
        "metadata.namespace" => namespace(pod),
        "metadata.uid" => m.uid.clone().unwrap_or_default(),
        "metadata.labels" => fmt_map(&m.labels),
        "metadata.annotations" => fmt_map(&m.annotations),
        "spec.nodeName" => spec.node_name.unwrap_or_default(),
        "spec.serviceAccountName" => spec.service_account_name.unwrap_or_default(),
        "status.podIP" => st.pod_ip.unwrap_or_default(),
        "status.podIPs" => st
            .pod_ips
            .iter()
            .flatten()
            .map(|p| p.ip.clone())
            .collect::<Vec<_>>()
            .join(","),
        "status.hostIP" => st.host_ip.unwrap_or_default(),
        "status.hostIPs" => st
            .host_ips
            .iter()
            .flatten()
            .map(|p| p.ip.clone())
            .collect::<Vec<_>>()
            .join(","),
        _ => {
            if let Some(v) = map_entry(&m.labels, "metadata.labels['") {
                v
            } else if let Some(v) = map_entry(&m.annotations, "metadata.annotations['") {
                v
            } else {
                bail!("unsupported fieldRef {path}")
            }
        }
    })
}

/// A downward-API volume's (or projected source's) `items` of `pod` as a payload with
/// `default_mode`.
fn downward_payload(
    pod: &Pod,
    items: &Option<Vec<DownwardAPIVolumeFile>>,
    default_mode: Option<i32>,
) -> Result<Payload> {
    let mode = default_mode.unwrap_or(DEFAULT_MODE) as u32;
    let mut out = Payload::new();
    for it in items.iter().flatten() {
        let Some(f) = &it.field_ref else {
            bail!("downwardAPI item {}: only fieldRef is supported", it.path);
        };
        out.insert(
            it.path.clone(),
            (
                field_ref(pod, f)?.into_bytes(),
                it.mode.map(|m| m as u32).unwrap_or(mode),
            ),
        );
    }
    Ok(out)
}

/// `data` (every key, or `items`) as a payload with `default_mode`; None when the object is
/// missing (an error unless `optional`).
fn key_payload(
    what: &str,
    data: Option<BTreeMap<String, Vec<u8>>>,
    items: &Option<Vec<KeyToPath>>,
    default_mode: Option<i32>,
    optional: bool,
) -> Result<Payload> {
    let mode = default_mode.unwrap_or(DEFAULT_MODE) as u32;
    let Some(data) = data else {
        if optional {
            return Ok(Payload::new());
        }
        return Err(NotReady(format!("{what} not found")).into());
    };
    let mut out = Payload::new();
    match items {
        None => {
            for (k, v) in data {
                out.insert(k, (v, mode));
            }
        }
        Some(items) => {
            for it in items {
                match data.get(&it.key) {
                    Some(v) => {
                        out.insert(
                            it.path.clone(),
                            (v.clone(), it.mode.map(|m| m as u32).unwrap_or(mode)),
                        );
                    }
                    None if optional => {}
                    None => {
                        return Err(NotReady(format!("{what}: key {:?} not found", it.key)).into());
                    }
                }
            }
        }
    }
    Ok(out)
}

impl Sources {
    /// ConfigMap `ns/name`'s data and binaryData, if it exists.
    pub fn config_map(&self, ns: &str, name: &str) -> Option<BTreeMap<String, Vec<u8>>> {
        let cm = self.config_maps.get(&ObjectRef::new(name).within(ns))?;
        let mut out: BTreeMap<String, Vec<u8>> = cm
            .data
            .clone()
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| (k, v.into_bytes()))
            .collect();
        for (k, v) in cm.binary_data.clone().unwrap_or_default() {
            out.insert(k, v.0);
        }
        Some(out)
    }

    /// Secret `ns/name`'s data (and stringData, which the server folds into data), if it
    /// exists.
    pub fn secret(&self, ns: &str, name: &str) -> Option<BTreeMap<String, Vec<u8>>> {
        let s = self.secrets.get(&ObjectRef::new(name).within(ns))?;
        let mut out: BTreeMap<String, Vec<u8>> = s
            .data
            .clone()
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| (k, v.0))
            .collect();
        for (k, v) in s.string_data.clone().unwrap_or_default() {
            out.insert(k, v.into_bytes());
        }
        Some(out)
    }

    /// The host path of claim `ns/name`'s bound volume (`hostPath` or `local`).
    fn claim_path(&self, ns: &str, name: &str) -> Result<PathBuf> {
        let pvc = self
            .claims
            .get(&ObjectRef::new(name).within(ns))
            .ok_or_else(|| NotReady(format!("persistentvolumeclaim {ns}/{name} not found")))?;
        let phase = pvc.status.as_ref().and_then(|s| s.phase.clone());
        let pv_name = pvc.spec.as_ref().and_then(|s| s.volume_name.clone());
        let (Some("Bound"), Some(pv_name)) = (phase.as_deref(), pv_name) else {
            return Err(NotReady(format!(
                "persistentvolumeclaim {ns}/{name} is not bound (phase {phase:?})"
            ))
            .into());
        };
        let pv = self
            .volumes
            .get(&ObjectRef::new(&pv_name))
            .ok_or_else(|| NotReady(format!("persistentvolume {pv_name} not found")))?;
        let spec = pv.spec.clone().unwrap_or_default();
        if let Some(h) = spec.host_path {
            return Ok(PathBuf::from(h.path));
        }
        if let Some(l) = spec.local {
            return Ok(PathBuf::from(l.path));
        }
        bail!("persistentvolume {pv_name}: only hostPath and local volumes are supported")
    }
}

impl PodVolumes {
    /// An empty set under `dir` (`<pod>/volumes`).
    pub fn new(dir: PathBuf, fs_group: Option<u32>) -> Self {
        Self {
            paths: BTreeMap::new(),
            read_only: BTreeMap::new(),
            tokens: BTreeMap::new(),
            fs_group,
            dir,
        }
    }

    /// Sets up (or re-syncs) every volume of `pod`. Err(NotReady) while one waits for its
    /// source (a missing ConfigMap, an unbound claim); other errors are failures.
    pub async fn sync(&mut self, pod: &Pod, src: &Sources) -> Result<()> {
        let ns = namespace(pod);
        let spec = pod.spec.clone().unwrap_or_default();
        for v in spec.volumes.iter().flatten() {
            self.sync_one(pod, &ns, v, src)
                .await
                .with_context(|| format!("volume {:?}", v.name))?;
        }
        Ok(())
    }

    async fn sync_one(&mut self, pod: &Pod, ns: &str, v: &Volume, src: &Sources) -> Result<()> {
        let dir = self.dir.join(&v.name);
        if let Some(ed) = &v.empty_dir {
            if !self.paths.contains_key(&v.name) {
                // Memory-backed or not, a directory does (its size limit is not enforced).
                let _ = &ed.medium;
                std::fs::create_dir_all(&dir)?;
                std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777))?;
                self.set(&v.name, dir, false);
            }
            return Ok(());
        }
        if let Some(hp) = &v.host_path {
            let p = PathBuf::from(&hp.path);
            if !p.exists() {
                match hp.type_.as_deref() {
                    Some("DirectoryOrCreate") => {
                        std::fs::create_dir_all(&p)?;
                        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755))?;
                    }
                    Some("FileOrCreate") => {
                        std::fs::write(&p, b"")?;
                    }
                    Some("") | None => {}
                    Some(t) => {
                        return Err(
                            NotReady(format!("hostPath {} ({t}) does not exist", hp.path)).into(),
                        )
                    }
                }
            }
            self.set(&v.name, p, false);
            return Ok(());
        }
        if let Some(c) = &v.persistent_volume_claim {
            if !self.paths.contains_key(&v.name) {
                let p = src.claim_path(ns, &c.claim_name)?;
                if !p.exists() {
                    bail!("the claim's host path {} does not exist", p.display());
                }
                self.set(&v.name, p, c.read_only.unwrap_or(false));
            }
            return Ok(());
        }
        let payload = if let Some(cm) = &v.config_map {
            key_payload(
                &format!("configmap {ns}/{}", cm.name),
                src.config_map(ns, &cm.name),
                &cm.items,
                cm.default_mode,
                cm.optional.unwrap_or(false),
            )?
        } else if let Some(s) = &v.secret {
            let name = s.secret_name.clone().unwrap_or_default();
            key_payload(
                &format!("secret {ns}/{name}"),
                src.secret(ns, &name),
                &s.items,
                s.default_mode,
                s.optional.unwrap_or(false),
            )?
        } else if let Some(d) = &v.downward_api {
            downward_payload(pod, &d.items, d.default_mode)?
        } else if let Some(p) = &v.projected {
            let mode = p.default_mode;
            let mut out = Payload::new();
            for s in p.sources.iter().flatten() {
                if let Some(cm) = &s.config_map {
                    out.extend(key_payload(
                        &format!("configmap {ns}/{}", cm.name),
                        src.config_map(ns, &cm.name),
                        &cm.items,
                        mode,
                        cm.optional.unwrap_or(false),
                    )?);
                } else if let Some(sec) = &s.secret {
                    out.extend(key_payload(
                        &format!("secret {ns}/{}", sec.name),
                        src.secret(ns, &sec.name),
                        &sec.items,
                        mode,
                        sec.optional.unwrap_or(false),
                    )?);
                } else if let Some(d) = &s.downward_api {
                    out.extend(downward_payload(pod, &d.items, mode)?);
                } else if let Some(t) = &s.service_account_token {
                    let token = self
                        .token(
                            pod,
                            ns,
                            &v.name,
                            &t.path,
                            t.audience.clone(),
                            t.expiration_seconds,
                            src,
                        )
                        .await?;
                    out.insert(
                        t.path.clone(),
                        (token.into_bytes(), mode.unwrap_or(DEFAULT_MODE) as u32),
                    );
                } else {
                    bail!("unsupported projected source (clusterTrustBundle, podCertificate)");
                }
            }
            out
        } else {
            bail!("unsupported volume type (only emptyDir, configMap, secret, projected, downwardAPI, hostPath, persistentVolumeClaim)");
        };
        write_atomic(&dir, &payload, self.fs_group)?;
        self.set(&v.name, dir, true);
        Ok(())
    }

    fn set(&mut self, name: &str, path: PathBuf, read_only: bool) {
        self.paths.insert(name.to_string(), path);
        self.read_only.insert(name.to_string(), read_only);
    }

    /// A token of the pod's ServiceAccount bound to the pod (TokenRequest), cached until 80%
    /// of its life.
    #[allow(clippy::too_many_arguments)]
    async fn token(
        &mut self,
        pod: &Pod,
        ns: &str,
        volume: &str,
        path: &str,
        audience: Option<String>,
        expiration: Option<i64>,
        src: &Sources,
    ) -> Result<String> {
        let key = (volume.to_string(), path.to_string());
        if let Some(t) = self.tokens.get(&key) {
            if Instant::now() < t.refresh_at {
                return Ok(t.value.clone());
            }
        }
        let sa = pod
            .spec
            .as_ref()
            .and_then(|s| s.service_account_name.clone())
            .unwrap_or_else(|| "default".into());
        let secs = expiration.unwrap_or(3600);
        let req = TokenRequest {
            spec: TokenRequestSpec {
                audiences: audience.into_iter().collect(),
                expiration_seconds: Some(secs),
                bound_object_ref: Some(
                    k8s_openapi::api::authentication::v1::BoundObjectReference {
                        api_version: Some("v1".into()),
                        kind: Some("Pod".into()),
                        name: pod.metadata.name.clone(),
                        uid: pod.metadata.uid.clone(),
                    },
                ),
            },
            ..Default::default()
        };
        let api: Api<ServiceAccount> = Api::namespaced(src.client.clone(), ns);
        let out = api
            .create_token_request(&sa, &Default::default(), &req)
            .await
            .map_err(|e| NotReady(format!("token of serviceaccount {ns}/{sa}: {e}")))?;
        let value = out
            .status
            .map(|s| s.token)
            .context("the TokenRequest came back without a token")?;
        self.tokens.insert(
            key,
            Token {
                value: value.clone(),
                refresh_at: Instant::now() + Duration::from_secs((secs as u64) * 8 / 10),
            },
        );
        Ok(value)
    }
}

/// Writes `payload` into `dir` as the kubelet's AtomicWriter does (see the module's doc);
/// nothing when the files are already those. Files belong to group `gid` when given.
pub fn write_atomic(dir: &Path, payload: &Payload, gid: Option<u32>) -> Result<bool> {
    std::fs::create_dir_all(dir)?;
    let data = dir.join("..data");
    // Unchanged: every file has its bytes and mode, and no other name is visible.
    if data.exists() {
        let same = payload.iter().all(|(rel, (bytes, mode))| {
            let p = data.join(rel);
            std::fs::read(&p).is_ok_and(|b| &b == bytes)
                && std::fs::metadata(&p).is_ok_and(|m| m.permissions().mode() & 0o7777 == *mode)
        }) && visible_names(dir)? == top_names(payload);
        if same {
            return Ok(false);
        }
    }
    let stamp = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    let ts_name = format!("..{stamp}");
    let ts = dir.join(&ts_name);
    std::fs::create_dir(&ts)?;
    std::fs::set_permissions(&ts, std::fs::Permissions::from_mode(0o755))?;
    for (rel, (bytes, mode)) in payload {
        if rel.starts_with('/') || rel.split('/').any(|c| c == ".." || c.starts_with("..")) {
            bail!("refusing the path {rel:?} in a volume");
        }
        let p = ts.join(rel);
        if let Some(parent) = p.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(&p, bytes)?;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(*mode))?;
        if let Some(g) = gid {
            std::os::unix::fs::chown(&p, None, Some(g))?;
        }
    }
    if let Some(g) = gid {
        std::os::unix::fs::chown(&ts, None, Some(g))?;
    }
    let old = std::fs::read_link(&data).ok();
    let tmp = dir.join("..data_tmp");
    let _ = std::fs::remove_file(&tmp);
    symlink(&ts_name, &tmp)?;
    std::fs::rename(&tmp, &data)?;
    let want = top_names(payload);
    for name in &want {
        let link = dir.join(name);
        if std::fs::symlink_metadata(&link).is_err() {
            symlink(Path::new("..data").join(name), &link)?;
        }
    }
    for name in visible_names(dir)? {
        if !want.contains(&name) {
            let _ = std::fs::remove_file(dir.join(&name));
        }
    }
    if let Some(old) = old {
        let _ = std::fs::remove_dir_all(dir.join(old));
    }
    Ok(true)
}

/// The first component of every payload path.
fn top_names(payload: &Payload) -> BTreeSet<String> {
    payload
        .keys()
        .filter_map(|k| k.split('/').next())
        .map(str::to_string)
        .collect()
}

/// The user-visible names of an atomically written directory (not the `..` ones).
fn visible_names(dir: &Path) -> Result<BTreeSet<String>> {
    Ok(std::fs::read_dir(dir)?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with(".."))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomic_writes_swap_the_data_link_and_drop_removed_keys() {
        let d = tempfile::tempdir().unwrap();
        let mut p = Payload::new();
        p.insert("a.json".into(), (b"1".to_vec(), 0o644));
        p.insert("b".into(), (b"2".to_vec(), 0o440));
        assert!(write_atomic(d.path(), &p, None).unwrap());
        assert_eq!(std::fs::read(d.path().join("a.json")).unwrap(), b"1");
        assert!(!write_atomic(d.path(), &p, None).unwrap(), "unchanged");
        let first = std::fs::read_link(d.path().join("..data")).unwrap();
        p.remove("b");
        p.insert("a.json".into(), (b"3".to_vec(), 0o644));
        assert!(write_atomic(d.path(), &p, None).unwrap());
        assert_eq!(std::fs::read(d.path().join("a.json")).unwrap(), b"3");
        assert!(std::fs::symlink_metadata(d.path().join("b")).is_err());
        assert!(!d.path().join(first).exists(), "the old directory is gone");
        let m = std::fs::metadata(d.path().join("a.json")).unwrap();
        assert_eq!(m.permissions().mode() & 0o777, 0o644);
    }
}
