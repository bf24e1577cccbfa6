//! Secrets and who may call what: API keys, the admin token and the operator's token, read
//! from files (mounted Secrets) and the environment, re-read when a file changes.

use std::path::{Path, PathBuf};
use std::sync::{Arc, PoisonError, RwLock};

use axum::http::{HeaderMap, StatusCode};
use mole_api::WorkerConfig;

use super::ApiError;

/// Identity of a secret file's current content (a rotated Kubernetes Secret is a symlink swap
/// to new files: inode, mtime or size moves).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileStamp {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: i64,
    mtime_nsec: i64,
}

fn stamp(path: &Path) -> Option<FileStamp> {
    use std::os::unix::fs::MetadataExt;
    // metadata() follows symlinks: the stamp is the target's, which changes on a swap.
    let m = std::fs::metadata(path).ok()?;
    Some(FileStamp {
        dev: m.dev(),
        ino: m.ino(),
        len: m.len(),
        mtime: m.mtime(),
        mtime_nsec: m.mtime_nsec(),
    })
}

/// Where the secrets come from: files named by the config's `auth` (mounted Secrets) and the
/// environment (`MOLE_API_KEYS`, comma-separated; `MOLE_API_KEYS_FILE`), captured at start.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AuthSource {
    /// `auth.apiKeysFile`: API keys, one per line, `#` comments.
    pub api_keys_file: Option<PathBuf>,
    /// `MOLE_API_KEYS_FILE`: the same format.
    pub env_keys_file: Option<PathBuf>,
    /// `MOLE_API_KEYS`: keys given inline.
    pub inline_keys: Vec<String>,
    /// Admin token file.
    pub admin_token_file: Option<PathBuf>,
    /// Operator token file.
    pub operator_token_file: Option<PathBuf>,
}

impl AuthSource {
    /// The sources of a config plus the environment (`env` looks a variable up).
    pub fn new(cfg: &WorkerConfig, env: &dyn Fn(&str) -> Option<String>) -> Self {
        let mut s = AuthSource::default();
        if let Some(a) = &cfg.auth {
            s.api_keys_file = a.api_keys_file.as_ref().map(PathBuf::from);
            s.admin_token_file = a.admin_token_file.as_ref().map(PathBuf::from);
            s.operator_token_file = a.operator_token_file.as_ref().map(PathBuf::from);
        }
        if let Some(f) = env("MOLE_API_KEYS_FILE").filter(|f| !f.trim().is_empty()) {
            s.env_keys_file = Some(PathBuf::from(f.trim()));
        }
        if let Some(k) = env("MOLE_API_KEYS") {
            s.inline_keys = k
                .split(',')
                .map(str::trim)
                .filter(|k| !k.is_empty())
                .map(String::from)
                .collect();
        }
        s
    }
    fn files(&self) -> Vec<&Path> {
        self.api_keys_file
            .iter()
            .chain(&self.env_keys_file)
            .chain(&self.admin_token_file)
            .chain(&self.operator_token_file)
            .map(PathBuf::as_path)
            .collect()
    }
}

/// Secrets (files, so a Kubernetes Secret can be mounted; re-read when a file changes).
#[derive(Debug, Clone, Default)]
pub struct Auth {
    /// Accepted API keys.
    pub api_keys: Vec<String>,
    /// Whether an API key is required: true as soon as a key source is configured, even when
    /// it holds no key (an emptied key file locks the API instead of opening it).
    pub keys_required: bool,
    /// Admin token; None disables the admin endpoints (unless an operator token is set).
    pub admin_token: Option<String>,
    /// The operator's token: accepted on `GET /v1/lora_adapters`, `POST /admin/reload` and
    /// `POST /v1/unload_lora_adapter` whatever the API keys and admin token are.
    pub operator_token: Option<String>,
    pub(super) source: AuthSource,
    stamps: Vec<Option<FileStamp>>,
}

fn read_token(path: &Path) -> std::io::Result<Option<String>> {
    let t = std::fs::read_to_string(path)?.trim().to_string();
    Ok((!t.is_empty()).then_some(t))
}

impl Auth {
    /// Reads the files named by the config and `MOLE_API_KEYS` / `MOLE_API_KEYS_FILE` (paths
    /// as given, not confined: they are secrets, not models).
    pub fn from_config(cfg: &WorkerConfig) -> std::io::Result<Self> {
        Self::read(AuthSource::new(cfg, &|k| std::env::var(k).ok()))
    }

    /// Reads every source.
    pub fn read(source: AuthSource) -> std::io::Result<Self> {
        let with_path = |p: &Path, e: std::io::Error| {
            std::io::Error::new(e.kind(), format!("{}: {e}", p.display()))
        };
        // Stamp before reading: a change after the stamp is seen by the next check.
        let stamps = source.files().into_iter().map(stamp).collect();
        let mut a = Auth {
            api_keys: source.inline_keys.clone(),
            keys_required: !source.inline_keys.is_empty()
                || source.api_keys_file.is_some()
                || source.env_keys_file.is_some(),
            ..Default::default()
        };
        for f in source.api_keys_file.iter().chain(&source.env_keys_file) {
            let text = std::fs::read_to_string(f).map_err(|e| with_path(f, e))?;
            a.api_keys.extend(
                text.lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty() && !l.starts_with('#'))
                    .map(String::from),
            );
        }
        if let Some(f) = &source.admin_token_file {
            a.admin_token = read_token(f).map_err(|e| with_path(f, e))?;
        }
        if let Some(f) = &source.operator_token_file {
            a.operator_token = read_token(f).map_err(|e| with_path(f, e))?;
        }
        a.source = source;
        a.stamps = stamps;
        Ok(a)
    }

    /// Whether a secret file changed since it was read (one `stat` per file).
    fn changed(&self) -> bool {
        self.source
            .files()
            .into_iter()
            .zip(&self.stamps)
            .any(|(f, s)| stamp(f) != *s)
    }

    fn api_key_ok(&self, h: &HeaderMap) -> bool {
        !self.keys_required || bearer(h).is_some_and(|k| self.api_keys.iter().any(|x| ct_eq(x, k)))
    }
    fn token_ok(t: &Option<String>, h: &HeaderMap) -> bool {
        matches!((t, bearer(h)), (Some(t), Some(k)) if ct_eq(t, k))
    }

    /// The prefix-cache tenant of a request that passed the API-key guard: a digest of its
    /// key (None when no key is asked for: every caller is then one tenant). A digest, not
    /// the key, so that the key is not kept in every request's state.
    pub fn tenant(&self, h: &HeaderMap) -> Option<[u8; 32]> {
        use sha2::{Digest, Sha256};
        if !self.keys_required {
            return None;
        }
        let key = bearer(h)?;
        let mut d = Sha256::new();
        d.update(b"mole/tenant\0");
        d.update(key.as_bytes());
        Some(d.finalize().into())
    }
}

/// Compares secrets in time independent of where they differ.
fn ct_eq(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

/// The token of `Authorization: Bearer <token>`, the scheme in any case (RFC 9110 §11.1:
/// schemes are case-insensitive; clients send `bearer` too).
fn bearer(h: &HeaderMap) -> Option<&str> {
    let (scheme, token) = h.get("authorization")?.to_str().ok()?.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then_some(token.trim())
}

/// Who may call an endpoint: the guard of each route (see [`super::app`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// An API key, when keys are configured.
    ApiKey,
    /// An API key, or the operator or admin token (`GET /v1/lora_adapters`, which the
    /// operator reads).
    Listing,
    /// The admin token only (`POST /v1/load_lora_adapter`).
    Admin,
    /// The admin or the operator token (reload, unload).
    Operator,
}

impl Auth {
    /// Whether the bearer token of `h` grants `access`; Err is the answer to give.
    pub fn check(&self, access: Access, h: &HeaderMap) -> Result<(), ApiError> {
        match access {
            Access::ApiKey => self.check_api_key(h),
            Access::Listing
                if Self::token_ok(&self.operator_token, h)
                    || Self::token_ok(&self.admin_token, h) =>
            {
                Ok(())
            }
            Access::Listing => self.check_api_key(h),
            Access::Admin => self.check_admin(h, &None),
            Access::Operator => self.check_admin(h, &self.operator_token),
        }
    }

    fn check_api_key(&self, h: &HeaderMap) -> Result<(), ApiError> {
        if self.api_key_ok(h) {
            return Ok(());
        }
        Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "invalid_api_key",
            "missing or invalid API key (Authorization: Bearer <key>)",
        ))
    }

    /// The admin token, or `operator` when the endpoint also takes the operator's.
    fn check_admin(&self, h: &HeaderMap, operator: &Option<String>) -> Result<(), ApiError> {
        if self.admin_token.is_none() && operator.is_none() {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "admin_disabled",
                "admin endpoints are disabled: no admin token configured",
            ));
        }
        if Self::token_ok(&self.admin_token, h) || Self::token_ok(operator, h) {
            return Ok(());
        }
        Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "invalid_admin_token",
            "missing or invalid admin token (Authorization: Bearer <token>)",
        ))
    }
}

/// The secrets in use: re-read when one of their files changes, replaced by a reload.
pub(super) struct Secrets(RwLock<Arc<Auth>>);

impl Secrets {
    /// Holds `auth`.
    pub(super) fn new(auth: Auth) -> Self {
        Self(RwLock::new(Arc::new(auth)))
    }

    /// The secrets, re-read first when one of their files changed (a rotated Secret). A file
    /// that cannot be read keeps the previous secrets.
    pub(super) fn current(&self) -> Arc<Auth> {
        let cur = self
            .0
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if !cur.changed() {
            return cur;
        }
        match Auth::read(cur.source.clone()) {
            Ok(a) => {
                tracing::info!("credentials changed on disk: re-read");
                let a = Arc::new(a);
                *self.0.write().unwrap_or_else(PoisonError::into_inner) = a.clone();
                a
            }
            Err(e) => {
                tracing::warn!("credentials changed but cannot be read, keeping the old ones: {e}");
                cur
            }
        }
    }

    /// Reads the secrets a reloaded config names. The environment's keys were captured at
    /// start; they stay. Secrets that cannot be read leave the old ones in place.
    pub(super) fn reconfigure(&self, cfg: &WorkerConfig) {
        let old_src = self
            .0
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .source
            .clone();
        let mut src = AuthSource::new(cfg, &|_| None);
        src.inline_keys = old_src.inline_keys;
        src.env_keys_file = old_src.env_keys_file;
        match Auth::read(src) {
            Ok(a) => *self.0.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(a),
            Err(e) => tracing::warn!("new auth settings cannot be read, keeping the old: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn cfg(auth: &str) -> WorkerConfig {
        crate::config::parse(
            &format!("pool: p\nbaseModel: {{name: b, path: b}}\n{auth}"),
            "t",
        )
        .unwrap()
    }
    fn hdr(token: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            "authorization",
            HeaderValue::from_str(&format!("Bearer {token}")).unwrap(),
        );
        h
    }

    #[test]
    fn api_keys_from_env_and_files_and_rotation() {
        let d = tempfile::tempdir().unwrap();
        let kf = d.path().join("keys");
        std::fs::write(&kf, "# comment\nfile-key\n").unwrap();
        let env_file = d.path().join("env-keys");
        std::fs::write(&env_file, "env-file-key\n").unwrap();
        let c = cfg(&format!("auth: {{apiKeysFile: {}}}", kf.display()));
        let env = |k: &str| match k {
            "MOLE_API_KEYS" => Some(" a , b,,".to_string()),
            "MOLE_API_KEYS_FILE" => Some(env_file.display().to_string()),
            _ => None,
        };
        let a = Auth::read(AuthSource::new(&c, &env)).unwrap();
        assert!(a.keys_required);
        for k in ["a", "b", "file-key", "env-file-key"] {
            assert!(a.api_key_ok(&hdr(k)), "{k}");
        }
        assert!(!a.api_key_ok(&hdr("c")));
        assert!(!a.api_key_ok(&HeaderMap::new()));
        assert!(!a.changed());
        // A rotated Secret: new content (and inode) is seen; an emptied file locks the API.
        std::fs::write(d.path().join("new"), "").unwrap();
        std::fs::rename(d.path().join("new"), &kf).unwrap();
        assert!(a.changed());
        let a = Auth::read(a.source.clone()).unwrap();
        assert!(!a.api_key_ok(&hdr("file-key")));
        assert!(a.api_key_ok(&hdr("a")));
        // Nothing configured: no key needed.
        let none = Auth::read(AuthSource::new(&cfg(""), &|_| None)).unwrap();
        assert!(none.api_key_ok(&HeaderMap::new()));
        assert!(ct_eq("abc", "abc") && !ct_eq("abc", "abd") && !ct_eq("abc", "ab"));
    }
}
