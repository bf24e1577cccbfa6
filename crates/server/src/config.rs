//! Loading, validating and watching a [`WorkerConfig`] (JSON from the operator's ConfigMap,
//! YAML or JSON locally). Paths are confined to `modelRoot` after resolving symlinks, because
//! a ConfigMap or an admin request must never make the worker read outside the model volume.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use mole_api::{WorkerAdapter, WorkerConfig};
use sha2::{Digest, Sha256};

use mole_engine::api::{AdapterAdmin, AdapterSpec};

/// Why a configuration was refused. Stable names via [`ConfigError::code`].
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// File.
        path: String,
        /// Cause.
        source: std::io::Error,
    },
    /// Neither valid JSON nor YAML for a WorkerConfig.
    #[error("cannot parse {path}: {reason}")]
    Parse {
        /// File.
        path: String,
        /// Parser message.
        reason: String,
    },
    /// A path escapes `modelRoot` (after resolving symlinks) or does not exist.
    #[error("path {path} is not inside model root {root}: {reason}")]
    PathOutsideRoot {
        /// Offending path.
        path: String,
        /// Model root.
        root: String,
        /// Why.
        reason: String,
    },
    /// An adapter's directory equals, contains or lies inside the base model's, the
    /// `merged/` tree or another adapter's: loading or fetching it would read or overwrite
    /// another model's files.
    #[error("adapter path {path} overlaps {other}; an adapter needs a directory of its own")]
    AdapterPathOverlaps {
        /// The adapter's path as configured or requested.
        path: String,
        /// What it overlaps (the base model, `merged/` or adapter NAME), with its path.
        other: String,
    },
    /// A semantic rule is broken (duplicate names, zero limits...).
    #[error("invalid config: {0}")]
    Invalid(String),
}

impl ConfigError {
    /// Stable name (metric label, JSON `code`).
    pub fn code(&self) -> &'static str {
        match self {
            ConfigError::Io { .. } => "config_io",
            ConfigError::Parse { .. } => "config_parse",
            ConfigError::PathOutsideRoot { .. } => "path_outside_root",
            ConfigError::AdapterPathOverlaps { .. } => "adapter_path_overlaps",
            ConfigError::Invalid(_) => "config_invalid",
        }
    }
}

/// Parses a config from text: JSON first (what the operator writes), then YAML.
pub fn parse(text: &str, origin: &str) -> Result<WorkerConfig, ConfigError> {
    let trimmed = text.trim_start();
    if trimmed.starts_with('{') {
        return serde_json::from_str(text).map_err(|e| ConfigError::Parse {
            path: origin.into(),
            reason: e.to_string(),
        });
    }
    serde_yaml::from_str(text).map_err(|e| ConfigError::Parse {
        path: origin.into(),
        reason: e.to_string(),
    })
}

/// Reads, parses and validates a config file.
pub fn load(path: &Path) -> Result<WorkerConfig, ConfigError> {
    let cfg = read(path)?;
    validate(&cfg)?;
    Ok(cfg)
}

/// Resolves `rel` against `root` (symlinks included) and refuses anything outside `root`.
/// The target must exist, since canonicalisation is the only reliable symlink check.
pub fn resolve_in_root(root: &str, rel: &str) -> Result<PathBuf, ConfigError> {
    mole_formats::paths::resolve_within(Path::new(root), Path::new(rel)).map_err(|e| {
        ConfigError::PathOutsideRoot {
            path: rel.into(),
            root: root.into(),
            reason: e.to_string(),
        }
    })
}

/// The model directory a worker config serves: the merged output in a merged pod, else the
/// base model.
pub fn model_dir(cfg: &WorkerConfig) -> Result<PathBuf, ConfigError> {
    let rel = match &cfg.merged {
        Some(m) => &m.path,
        None => &cfg.base_model.path,
    };
    resolve_in_root(&cfg.model_root, rel)
}

/// The one rule of an adapter's name, configured or given to `/v1/load_lora_adapter`: 1 to
/// [`MAX_ADAPTER_NAME`] ASCII letters, digits, `.`, `_` and `-`, starting with a letter or a
/// digit (so no `.`, `..`, path separators, spaces or control characters: names reach logs,
/// metric labels, headers and paths), and neither the pool's nor the base model's name (a
/// request's `model` names those). Err says why.
pub fn check_adapter_name(cfg: &WorkerConfig, name: &str) -> Result<(), String> {
    let shape = name.len() <= MAX_ADAPTER_NAME
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if !shape {
        return Err(format!(
            "bad adapter name {name:?}: 1 to {MAX_ADAPTER_NAME} letters, digits, '.', '_' or \
             '-', starting with a letter or digit"
        ));
    }
    if name == cfg.pool {
        return Err(format!("adapter {name} has the pool's name"));
    }
    if name == cfg.base_model.name {
        return Err(format!("adapter {name} has the base model's name"));
    }
    Ok(())
}

/// The longest adapter name (a Kubernetes object name's limit).
pub const MAX_ADAPTER_NAME: usize = 253;

/// Checks names, limits and that every path stays inside `modelRoot`.
pub fn validate(cfg: &WorkerConfig) -> Result<(), ConfigError> {
    if cfg.pool.trim().is_empty() {
        return Err(ConfigError::Invalid("pool must not be empty".into()));
    }
    // The bounds the operator checks too (mole_api::bounds), plus the request limits.
    cfg.limits
        .validate()
        .map_err(|e| ConfigError::Invalid(format!("limits.{e}")))?;
    cfg.router
        .validate()
        .map_err(|e| ConfigError::Invalid(format!("router.{e}")))?;
    let mut names = HashSet::new();
    let mut ids = HashMap::new();
    for a in &cfg.adapters {
        check_adapter_name(cfg, &a.name).map_err(ConfigError::Invalid)?;
        if !names.insert(a.name.clone()) {
            return Err(ConfigError::Invalid(format!(
                "duplicate adapter name {}",
                a.name
            )));
        }
        if let Some(other) = ids.insert(a.lora_id, a.name.clone()) {
            return Err(ConfigError::Invalid(format!(
                "loraId {} used by {} and {}",
                a.lora_id, other, a.name
            )));
        }
        if a.load {
            resolve_in_root(&cfg.model_root, &a.path)?;
        }
        if let Some(c) = &a.canary {
            if c.weight > 100 {
                return Err(ConfigError::Invalid(format!(
                    "adapter {}: canary weight {} is over 100",
                    a.name, c.weight
                )));
            }
            if c.version == a.version || c.version.is_empty() {
                return Err(ConfigError::Invalid(format!(
                    "adapter {}: canary version {:?} must be set and differ from the stable version",
                    a.name, c.version
                )));
            }
            let path = resolve_in_root(&cfg.model_root, &c.path)?;
            check_adapter_dir(cfg, &c.path, &path, Some(&a.name))?;
        }
    }
    if let Some(c) = &cfg.router.classifier_adapter {
        if !names.contains(c) {
            return Err(ConfigError::Invalid(format!(
                "classifierAdapter {c} is not an adapter"
            )));
        }
    }
    resolve_in_root(&cfg.model_root, &cfg.base_model.path)?;
    for a in cfg.adapters.iter().filter(|a| a.load) {
        let path = resolve_in_root(&cfg.model_root, &a.path)?;
        check_adapter_dir(cfg, &a.path, &path, Some(&a.name))?;
    }
    Ok(())
}

/// The rule the operator holds Adapters' source paths to, on the worker's side: an adapter's
/// directory (`resolved`, as [`resolve_in_root`] gives it; `path` as configured or
/// requested) must not equal, contain or lie inside the base model's directory, the
/// `<modelRoot>/merged` tree or another loaded adapter's directory (`except` names the
/// adapter itself). Paths are compared resolved, so symlinks and `..` do not hide an overlap.
pub fn check_adapter_dir(
    cfg: &WorkerConfig,
    path: &str,
    resolved: &Path,
    except: Option<&str>,
) -> Result<(), ConfigError> {
    let overlaps = |other: &Path| resolved.starts_with(other) || other.starts_with(resolved);
    let refuse = |other: String| ConfigError::AdapterPathOverlaps {
        path: path.to_string(),
        other,
    };
    let root = resolve_in_root(&cfg.model_root, ".")?;
    let base = resolve_in_root(&cfg.model_root, &cfg.base_model.path)?;
    if overlaps(&base) {
        return Err(refuse(format!("the base model ({})", cfg.base_model.path)));
    }
    let merged = std::fs::canonicalize(root.join("merged")).unwrap_or(root.join("merged"));
    if overlaps(&merged) {
        return Err(refuse("the merged/ tree".into()));
    }
    for o in cfg
        .adapters
        .iter()
        .filter(|o| o.load && Some(o.name.as_str()) != except)
    {
        if let Ok(p) = resolve_in_root(&cfg.model_root, &o.path) {
            if overlaps(&p) {
                return Err(refuse(format!("adapter {} ({})", o.name, o.path)));
            }
        }
    }
    Ok(())
}

/// What changed in the adapter list between two configs.
#[derive(Debug, Default, PartialEq)]
pub struct AdapterDiff {
    /// New names, or a new version/path of a known name (loaded beside the old version).
    pub load: Vec<WorkerAdapter>,
    /// Names no longer present (or no longer loaded here).
    pub unload: Vec<String>,
}

/// What the engine holds for a configured adapter list: each adapter this worker loads, and
/// each canary version as an adapter of its own under
/// [`canary_key`](mole_engine::lora::registry::canary_key) (loaded whether or not the stable version
/// is: a merged adapter's canary share is served here).
pub fn units(adapters: &[WorkerAdapter]) -> Vec<WorkerAdapter> {
    let mut out = Vec::with_capacity(adapters.len());
    for a in adapters {
        if a.load {
            out.push(WorkerAdapter {
                canary: None,
                ..a.clone()
            });
        }
        if let Some(c) = &a.canary {
            out.push(WorkerAdapter {
                name: mole_engine::lora::registry::canary_key(&a.name),
                version: c.version.clone(),
                path: c.path.clone(),
                load: true,
                canary: None,
                merged_endpoint: None,
                ..a.clone()
            });
        }
    }
    out
}

/// Diffs adapter lists, considering only what this worker loads ([`units`]: canary versions
/// are loaded and unloaded on their own).
pub fn diff_adapters(old: &[WorkerAdapter], new: &[WorkerAdapter]) -> AdapterDiff {
    let (old, new) = (&units(old)[..], &units(new)[..]);
    let old_m: HashMap<&str, &WorkerAdapter> = old
        .iter()
        .filter(|a| a.load)
        .map(|a| (a.name.as_str(), a))
        .collect();
    let new_m: HashMap<&str, &WorkerAdapter> = new
        .iter()
        .filter(|a| a.load)
        .map(|a| (a.name.as_str(), a))
        .collect();
    let mut d = AdapterDiff::default();
    for a in new.iter().filter(|a| a.load) {
        match old_m.get(a.name.as_str()) {
            // A new id (the Adapter was recreated) is a new load too: the operator reads
            // readiness by it.
            // A new placement is a new load too: a pod it now lands on reads it at once.
            Some(o)
                if o.version == a.version
                    && o.path == a.path
                    && o.lora_id == a.lora_id
                    && o.pods == a.pods => {}
            _ => d.load.push(a.clone()),
        }
    }
    for a in old.iter().filter(|a| a.load) {
        if !new_m.contains_key(a.name.as_str()) {
            d.unload.push(a.name.clone());
        }
    }
    d
}

/// Engine spec of a configured adapter (path confined to the model root).
pub fn adapter_spec(cfg: &WorkerConfig, a: &WorkerAdapter) -> Result<AdapterSpec, ConfigError> {
    Ok(AdapterSpec {
        name: a.name.clone(),
        version: a.version.clone(),
        lora_id: a.lora_id,
        path: resolve_in_root(&cfg.model_root, &a.path)?,
    })
}

/// One configured adapter version the worker could not load, and why. Every reason is
/// permanent for that version (bad files, wrong base model, rank over the cap, path outside the
/// root): the worker reports it and stays ready, and a new version in the config is tried again.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadFailure {
    /// Adapter name.
    pub name: String,
    /// Version.
    pub version: String,
    /// Pool-wide id.
    pub lora_id: u32,
    /// Why.
    pub reason: String,
}

/// What [`apply_diff`] did.
#[derive(Debug, Default)]
pub struct ApplyReport {
    /// Versions loaded, with the seconds each load took.
    pub loaded: Vec<(String, f64)>,
    /// Versions refused.
    pub failed: Vec<LoadFailure>,
    /// Adapters that could not be unloaded (already gone).
    pub unload_errors: Vec<String>,
}

impl ApplyReport {
    /// One message per problem (for logs and `/admin/reload`).
    pub fn errors(&self) -> Vec<String> {
        self.failed
            .iter()
            .map(|f| format!("load {} {}: {}", f.name, f.version, f.reason))
            .chain(self.unload_errors.iter().cloned())
            .collect()
    }
}

/// Applies a diff through the engine's adapter admin. Loads before unloads so a renamed
/// adapter never leaves a gap; the engine keeps old versions alive for requests already pinned
/// to them. An adapter that fails is reported and the others are applied.
pub fn apply_diff(
    engine: &dyn AdapterAdmin,
    cfg: &WorkerConfig,
    diff: &AdapterDiff,
) -> ApplyReport {
    let mut report = ApplyReport::default();
    let pod = this_pod();
    for a in &diff.load {
        let started = std::time::Instant::now();
        let placed = a.placed_on(pod.as_deref());
        let r = adapter_spec(cfg, a)
            .map_err(|e| e.to_string())
            .and_then(|s| {
                if placed {
                    engine.load_adapter(s)
                } else {
                    engine.register_adapter(s)
                }
                .map_err(|e| e.to_string())
            });
        match r {
            Ok(()) => report
                .loaded
                .push((a.name.clone(), started.elapsed().as_secs_f64())),
            Err(reason) => report.failed.push(LoadFailure {
                name: a.name.clone(),
                version: a.version.clone(),
                lora_id: a.lora_id,
                reason,
            }),
        }
    }
    for n in &diff.unload {
        if let Err(e) = engine.unload_adapter(n) {
            report.unload_errors.push(format!("unload {n}: {e}"));
        }
    }
    report
}

/// The name of the pod this worker runs in: `MOLE_POD_NAME` (the operator sets it from the
/// downward API), else `HOSTNAME` (a pod's hostname is its name); None outside a pod. It picks
/// the adapters placed on this pod ([`WorkerAdapter::placed_on`]).
pub fn this_pod() -> Option<String> {
    ["MOLE_POD_NAME", "HOSTNAME"]
        .iter()
        .find_map(|k| std::env::var(k).ok().filter(|v| !v.is_empty()))
}

/// Shared current config, swapped atomically by the watcher and `/admin/reload`.
pub type SharedConfig = Arc<std::sync::RwLock<Arc<WorkerConfig>>>;

/// Reads and parses a config file without validating it (the hash check of `/admin/reload`
/// comes first: a stale file is reported as stale, not as whatever else is wrong with it).
pub fn read(path: &Path) -> Result<WorkerConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Io {
        path: path.display().to_string(),
        source: e,
    })?;
    parse(&text, &path.display().to_string())
}

/// Settings a running worker cannot change: the engine, the body limit and the embedding
/// model are built from them at start. The operator rolls the pods when they change (they are
/// in its pod-spec hash); until then the worker keeps serving with the old values.
pub fn restart_required(old: &WorkerConfig, new: &WorkerConfig) -> Vec<&'static str> {
    let mut out = Vec::new();
    if old.mode != new.mode {
        out.push("mode");
    }
    if old.model_root != new.model_root {
        out.push("modelRoot");
    }
    if old.base_model != new.base_model {
        out.push("baseModel");
    }
    if old.merged != new.merged {
        out.push("merged");
    }
    if old.limits != new.limits {
        out.push("limits");
    }
    if old.router.embedding_model != new.router.embedding_model {
        out.push("router.embeddingModel");
    }
    out
}

/// The config a running worker applies from `new`: everything but the [`restart_required`]
/// settings, which keep their `old` values (never half-applied).
pub fn hot_applicable(old: &WorkerConfig, new: &WorkerConfig) -> WorkerConfig {
    let mut c = new.clone();
    c.mode = old.mode;
    c.model_root = old.model_root.clone();
    c.base_model = old.base_model.clone();
    c.merged = old.merged.clone();
    c.limits = old.limits.clone();
    c.router.embedding_model = old.router.embedding_model.clone();
    c
}

/// Hash of a file's bytes (change detection by the watcher). Content, not mtime: a ConfigMap
/// update is a symlink swap whose target mtime may not move.
pub fn file_hash(path: &Path) -> Option<Vec<u8>> {
    std::fs::read(path)
        .ok()
        .map(|b| Sha256::digest(&b).to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg_yaml(root: &str, extra: &str) -> String {
        format!(
            "pool: p\nmodelRoot: {root}\nbaseModel: {{name: b, path: base}}\nadapters:\n{extra}"
        )
    }

    fn setup() -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("base")).unwrap();
        std::fs::create_dir_all(d.path().join("a1")).unwrap();
        d
    }

    #[test]
    fn yaml_and_json_load_and_validate() {
        let d = setup();
        let root = d.path().to_str().unwrap();
        let y = cfg_yaml(root, "  - {name: fr, version: v1, loraId: 1, path: a1}\n");
        let c = parse(&y, "t").unwrap();
        validate(&c).unwrap();
        let j = serde_json::to_string(&c).unwrap();
        assert_eq!(parse(&j, "t").unwrap(), c);
    }

    #[test]
    fn refuses_duplicates_traversal_and_symlink_escape() {
        let d = setup();
        let root = d.path().to_str().unwrap();
        let dup = cfg_yaml(
            root,
            "  - {name: fr, version: v1, loraId: 1, path: a1}\n  - {name: fr, version: v1, loraId: 2, path: a1}\n",
        );
        assert_eq!(
            validate(&parse(&dup, "t").unwrap()).unwrap_err().code(),
            "config_invalid"
        );
        let trav = cfg_yaml(
            root,
            "  - {name: fr, version: v1, loraId: 1, path: ../../etc}\n",
        );
        assert_eq!(
            validate(&parse(&trav, "t").unwrap()).unwrap_err().code(),
            "path_outside_root"
        );
        let outside = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(outside.path(), d.path().join("link")).unwrap();
        let sym = cfg_yaml(root, "  - {name: fr, version: v1, loraId: 1, path: link}\n");
        assert_eq!(
            validate(&parse(&sym, "t").unwrap()).unwrap_err().code(),
            "path_outside_root"
        );
        assert_eq!(parse("pool: [", "t").unwrap_err().code(), "config_parse");
        let unknown = format!("{}\nbogus: 1\n", cfg_yaml(root, "  []"));
        assert_eq!(parse(&unknown, "t").unwrap_err().code(), "config_parse");
    }

    #[test]
    fn diff_detects_new_versions_and_removals() {
        let a = |n: &str, v: &str| WorkerAdapter {
            name: n.into(),
            version: v.into(),
            lora_id: 1,
            path: n.into(),
            routing: Default::default(),
            mode: Default::default(),
            merged_endpoint: None,
            load: true,
            canary: None,
            pods: Vec::new(),
        };
        let d = diff_adapters(&[a("x", "1"), a("y", "1")], &[a("x", "2"), a("z", "1")]);
        assert_eq!(
            d.load.iter().map(|a| a.name.as_str()).collect::<Vec<_>>(),
            ["x", "z"]
        );
        assert_eq!(d.unload, ["y"]);
        assert_eq!(
            diff_adapters(&[a("x", "1")], &[a("x", "1")]),
            AdapterDiff::default()
        );
        // The same version from another directory, or under a new id (a recreated Adapter),
        // loads anew.
        let moved = WorkerAdapter {
            path: "x-retrained".into(),
            ..a("x", "1")
        };
        let renumbered = WorkerAdapter {
            lora_id: 7,
            ..a("x", "1")
        };
        for new in [moved, renumbered] {
            let d = diff_adapters(&[a("x", "1")], std::slice::from_ref(&new));
            assert_eq!(d.load, [new]);
        }
        // A canary loads and unloads on its own, under its key, whatever the stable one does;
        // a new weight alone changes nothing the engine holds.
        let canary = |w: u32| WorkerAdapter {
            canary: Some(mole_api::WorkerCanary {
                version: "2".into(),
                path: "x2".into(),
                weight: w,
            }),
            ..a("x", "1")
        };
        let d = diff_adapters(&[a("x", "1")], &[canary(10)]);
        assert_eq!(
            d.load
                .iter()
                .map(|a| (a.name.as_str(), a.version.as_str(), a.path.as_str()))
                .collect::<Vec<_>>(),
            [("x/canary", "2", "x2")]
        );
        assert!(d.unload.is_empty());
        assert_eq!(
            diff_adapters(&[canary(10)], &[canary(50)]),
            AdapterDiff::default()
        );
        let back = diff_adapters(&[canary(10)], &[a("x", "1")]);
        assert!(back.load.is_empty());
        assert_eq!(back.unload, ["x/canary"]);
    }

    #[test]
    fn restart_settings_are_kept_not_half_applied() {
        let d = setup();
        let root = d.path().to_str().unwrap();
        let old = parse(&cfg_yaml(root, "  []"), "t").unwrap();
        let mut new = old.clone();
        assert!(restart_required(&old, &new).is_empty());
        new.base_model.name = "other".into();
        new.limits.max_tokens = 7;
        new.router.min_confidence = 0.9;
        assert_eq!(restart_required(&old, &new), ["baseModel", "limits"]);
        let eff = hot_applicable(&old, &new);
        // The router change applies; the base model and limits stay as they were.
        assert_eq!(eff.router.min_confidence, 0.9);
        assert_eq!(eff.base_model, old.base_model);
        assert_eq!(eff.limits, old.limits);
        assert!(restart_required(&old, &eff).is_empty());
    }
}
