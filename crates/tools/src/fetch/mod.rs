//! `mole-worker fetch`: pulls a model or adapter from the Hugging Face Hub (`hf://`) or an S3
//! bucket (`s3://`) into a directory, as the operator's `fetch-model` init container and
//! adapter fetch Jobs run it.
//!
//! Only safetensors weights are fetched (pickles can run code when loaded); every file is
//! downloaded to `NAME.part`, resumed with an HTTP Range from its length, and checked against
//! the source's sha256 (or S3's MD5 ETag) before it is renamed into place. `DEST/.mole-fetch.json`
//! is written last: a rerun that finds it matching the source downloads nothing, which is what
//! makes a restarted init container cheap.
//!
//! A tool on top of the layers: nothing in the serving path imports it.

pub mod cli;
mod hf;
mod s3;
mod transfer;

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Name of the manifest the fetch writes last into its destination.
pub const MANIFEST: &str = ".mole-fetch.json";

/// Why a fetch failed. Stable names via [`FetchError::code`].
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// The source URI cannot be parsed or has an unknown scheme.
    #[error("bad source {source_uri:?}: {reason}")]
    BadSource {
        /// The URI as given.
        source_uri: String,
        /// What is wrong with it.
        reason: String,
    },
    /// `pvc://` sources are mounted by the operator, not fetched.
    #[error("{0}: pvc:// sources are mounted by the operator, not fetched")]
    NotFetched(String),
    /// The source holds only pickled weights, which mole refuses.
    #[error("{file}: pickled weights are refused (they can run code when loaded); the source has no safetensors weights")]
    PickleOnly {
        /// The first pickle found.
        file: String,
    },
    /// The source holds no `*.safetensors` file at all.
    #[error("{0}: no *.safetensors file in the source")]
    NoWeights(String),
    /// A file name would escape the destination (`..`, absolute, or through a symlink).
    #[error("{name}: {reason}; refusing to write it")]
    UnsafePath {
        /// The offending name.
        name: String,
        /// Why.
        reason: String,
    },
    /// The server refused the credentials (401/403).
    #[error("{url}: HTTP {status} (check the token or credentials)")]
    Unauthorized {
        /// The request.
        url: String,
        /// The status.
        status: u16,
    },
    /// The repository, revision, bucket or object does not exist (404).
    #[error("{url}: not found (HTTP 404)")]
    NotFound {
        /// The request.
        url: String,
    },
    /// Any other HTTP status.
    #[error("{url}: HTTP {status}: {body}")]
    Http {
        /// The request.
        url: String,
        /// The status.
        status: u16,
        /// The start of the body.
        body: String,
    },
    /// A connection failed or broke, after the retries.
    #[error("{url}: {reason}")]
    Network {
        /// The request.
        url: String,
        /// The cause.
        reason: String,
    },
    /// A listing (hub revision, S3 ListObjectsV2) could not be read.
    #[error("{url}: unreadable listing: {reason}")]
    Listing {
        /// The request.
        url: String,
        /// The cause.
        reason: String,
    },
    /// A downloaded file does not have the size the source listed.
    #[error("{file}: {actual} bytes downloaded, the source lists {expected}")]
    SizeMismatch {
        /// The file.
        file: String,
        /// Listed size.
        expected: u64,
        /// Downloaded size.
        actual: u64,
    },
    /// A downloaded file's digest differs from the source's; it was deleted.
    #[error("{file}: {algorithm} {actual} does not match the source's {expected}; the download was deleted")]
    ChecksumMismatch {
        /// The file.
        file: String,
        /// `sha256` or `md5`.
        algorithm: &'static str,
        /// The source's digest (hex).
        expected: String,
        /// The download's digest (hex).
        actual: String,
    },
    /// Filesystem error.
    #[error("{path}: {source}")]
    Io {
        /// Path.
        path: String,
        /// Cause.
        source: std::io::Error,
    },
}

impl FetchError {
    /// Stable name of the error (termination message, logs).
    pub fn code(&self) -> &'static str {
        match self {
            FetchError::BadSource { .. } => "bad_source",
            FetchError::NotFetched(_) => "source_not_fetched",
            FetchError::PickleOnly { .. } => "pickle_refused",
            FetchError::NoWeights(_) => "no_safetensors",
            FetchError::UnsafePath { .. } => "path_outside_dest",
            FetchError::Unauthorized { .. } => "unauthorized",
            FetchError::NotFound { .. } => "not_found",
            FetchError::Http { .. } => "http_error",
            FetchError::Network { .. } => "network_error",
            FetchError::Listing { .. } => "bad_listing",
            FetchError::SizeMismatch { .. } => "size_mismatch",
            FetchError::ChecksumMismatch { .. } => "checksum_mismatch",
            FetchError::Io { .. } => "io_error",
        }
    }

    /// Process exit status: 2 for what a retry cannot fix (bad input, refused content), 1 for
    /// the rest (network, server, I/O).
    pub fn exit_code(&self) -> u8 {
        match self {
            FetchError::BadSource { .. }
            | FetchError::NotFetched(_)
            | FetchError::PickleOnly { .. }
            | FetchError::NoWeights(_)
            | FetchError::UnsafePath { .. } => 2,
            _ => 1,
        }
    }

    fn io(path: &Path) -> impl FnOnce(std::io::Error) -> FetchError + '_ {
        move |source| FetchError::Io {
            path: path.display().to_string(),
            source,
        }
    }
}

pub use mole_api::ModelSource as Source;

fn parse_source(uri: &str) -> Result<Source, FetchError> {
    Source::parse(uri).map_err(|e| FetchError::BadSource {
        source_uri: uri.to_string(),
        reason: e.reason,
    })
}

/// What the fetch needs besides the source and destination.
#[derive(Debug, Clone, Default)]
pub struct FetchOptions {
    /// The source URI.
    pub source: String,
    /// Destination directory (created).
    pub dest: PathBuf,
    /// Hub endpoint (`HF_ENDPOINT`), default `https://huggingface.co`.
    pub hf_endpoint: Option<String>,
    /// Hub token, sent as `Authorization: Bearer`.
    pub hf_token: Option<String>,
    /// S3 endpoint for S3-compatible stores (path-style addressing when set).
    pub s3_endpoint: Option<String>,
    /// S3 region, default `us-east-1`.
    pub s3_region: Option<String>,
    /// S3 access key id; anonymous requests without one.
    pub aws_access_key_id: Option<String>,
    /// S3 secret access key.
    pub aws_secret_access_key: Option<String>,
    /// S3 session token (temporary credentials).
    pub aws_session_token: Option<String>,
    /// How many times a broken download is resumed within one run.
    pub retries: u32,
    /// Pages of an S3 listing read at most (0: [`DEFAULT_MAX_LIST_PAGES`]): a store that
    /// answers a truncated page with a next token forever fails the fetch (`bad_listing`)
    /// instead of listing forever.
    pub max_list_pages: u32,
}

/// The default bound on an S3 listing's pages: a million objects at S3's 1000 a page, far
/// more than a model's files.
pub const DEFAULT_MAX_LIST_PAGES: u32 = 1000;

/// One file of a listing, before it is fetched.
#[derive(Debug, Clone)]
struct RemoteFile {
    /// Path relative to the destination (and to the repository / prefix).
    name: String,
    /// The object's key (S3) or path in the repository (hub).
    key: String,
    /// Size in bytes.
    size: u64,
    /// The source's sha256 (hex), when it publishes one.
    sha256: Option<String>,
    /// The source's MD5 (hex): S3's ETag of an unencrypted single-part object.
    md5: Option<String>,
}

/// What a source lists.
#[derive(Debug)]
struct Listing {
    /// The resolved revision (hub commit sha); none for S3.
    revision: Option<String>,
    files: Vec<RemoteFile>,
}

/// The record of a completed fetch, `DEST/.mole-fetch.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// The source URI as given.
    pub source: String,
    /// The commit sha a hub branch or tag resolved to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
    /// The files fetched.
    pub files: Vec<ManifestFile>,
    /// Files of the source that were not fetched (pickles and other formats).
    #[serde(default)]
    pub skipped: Vec<String>,
}

/// One fetched file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestFile {
    /// Path relative to the destination.
    pub name: String,
    /// Size in bytes.
    pub size: u64,
    /// sha256 of the bytes written (hex).
    pub sha256: String,
    /// What the file was checked against: `sha256` (the source's), `md5` (S3's ETag) or
    /// `none` (the source publishes no digest; `sha256` is the one computed).
    pub verified: String,
    /// The source's MD5 (S3 ETag), when it was checked against it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub md5: Option<String>,
}

/// What a fetch did.
#[derive(Debug, Clone)]
pub struct FetchReport {
    /// The manifest now in the destination.
    pub manifest: Manifest,
    /// False when the destination already held this fetch (nothing downloaded).
    pub downloaded: bool,
    /// Bytes transferred in this run.
    pub bytes: u64,
}

enum Remote {
    Hf(hf::Hub),
    S3(s3::Store),
}

impl Remote {
    async fn list(
        &self,
        client: &reqwest::Client,
        opts: &FetchOptions,
    ) -> Result<Listing, FetchError> {
        match self {
            Remote::Hf(h) => h.list(client).await,
            Remote::S3(s) => {
                let pages = match opts.max_list_pages {
                    0 => DEFAULT_MAX_LIST_PAGES,
                    n => n,
                };
                s.list(client, pages).await
            }
        }
    }

    /// Digests the listing does not carry (S3's come from a HEAD per object).
    async fn checksums(
        &self,
        client: &reqwest::Client,
        files: &mut [RemoteFile],
    ) -> Result<(), FetchError> {
        if let Remote::S3(s) = self {
            for f in files {
                s.checksums(client, f).await?;
            }
        }
        Ok(())
    }

    fn get(
        &self,
        client: &reqwest::Client,
        file: &RemoteFile,
        rev: Option<&str>,
    ) -> reqwest::RequestBuilder {
        match self {
            Remote::Hf(h) => h.get(client, &file.key, rev.unwrap_or(&h.revision)),
            Remote::S3(s) => s.get(client, &file.key),
        }
    }
}

/// Which files of a source are fetched: safetensors weights, JSON (configs, tokenizer, index),
/// tokenizer files, chat templates, README/LICENSE. Pickles are refused; anything else is
/// skipped.
fn classify(name: &str) -> Kind {
    let base = name.rsplit('/').next().unwrap_or(name);
    if mole_formats::hf::is_pickle(base) {
        return Kind::Pickle;
    }
    let lower = base.to_ascii_lowercase();
    let ext = lower.rsplit_once('.').map(|(_, e)| e).unwrap_or("");
    match ext {
        "safetensors" => return Kind::Weights,
        "json" | "txt" | "jinja" => return Kind::Keep,
        _ => {}
    }
    if lower == "tokenizer.model"
        || lower.starts_with("readme")
        || lower.starts_with("license")
        || lower.starts_with("licence")
    {
        Kind::Keep
    } else {
        Kind::Skip
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Kind {
    Weights,
    Keep,
    Pickle,
    Skip,
}

/// Checks a listed name is a plain relative path: no `..`, `.`, empty or absolute parts.
fn safe_name(name: &str) -> Result<(), FetchError> {
    let unsafe_path = |reason: &str| FetchError::UnsafePath {
        name: name.to_string(),
        reason: reason.to_string(),
    };
    mole_formats::paths::plain_relative(name).map_err(unsafe_path)?;
    if name.ends_with(".part") || name == MANIFEST || name == ".mole-fetch.lock" {
        return Err(unsafe_path("collides with the fetch's own files"));
    }
    Ok(())
}

/// Keeps the files mole may load; fails when no safetensors weights remain.
fn select(
    source: &str,
    files: Vec<RemoteFile>,
) -> Result<(Vec<RemoteFile>, Vec<String>), FetchError> {
    let mut keep = Vec::new();
    let mut skipped = Vec::new();
    let mut pickles = Vec::new();
    let mut weights = 0;
    for f in files {
        match classify(&f.name) {
            Kind::Weights => {
                weights += 1;
                keep.push(f);
            }
            Kind::Keep => keep.push(f),
            Kind::Pickle => {
                pickles.push(f.name.clone());
                skipped.push(f.name);
            }
            Kind::Skip => skipped.push(f.name),
        }
    }
    if weights == 0 {
        return Err(match pickles.into_iter().next() {
            Some(file) => FetchError::PickleOnly { file },
            None => FetchError::NoWeights(source.to_string()),
        });
    }
    for p in &pickles {
        tracing::warn!(file = %p, "skipping pickled weights; the safetensors are fetched instead");
    }
    for f in &keep {
        safe_name(&f.name)?;
    }
    keep.sort_by(|a, b| a.name.cmp(&b.name));
    skipped.sort();
    Ok((keep, skipped))
}

/// Creates `dest/name`'s parent directories, refusing any component (existing or not) that is
/// a symlink or not a directory, so no write can land outside `dest`.
fn prepare_parent(dest: &Path, name: &str) -> Result<PathBuf, FetchError> {
    let mut dir = dest.to_path_buf();
    let parts: Vec<&str> = name.split('/').collect();
    for part in &parts[..parts.len() - 1] {
        dir.push(part);
        match std::fs::symlink_metadata(&dir) {
            Ok(m) if m.file_type().is_symlink() => {
                return Err(FetchError::UnsafePath {
                    name: name.to_string(),
                    reason: format!("{} is a symlink", dir.display()),
                })
            }
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(FetchError::UnsafePath {
                    name: name.to_string(),
                    reason: format!("{} is not a directory", dir.display()),
                })
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                std::fs::create_dir(&dir).map_err(FetchError::io(&dir))?;
            }
            Err(e) => return Err(FetchError::io(&dir)(e)),
        }
    }
    let target = dest.join(name);
    for p in [target.clone(), part_path(&target)] {
        if std::fs::symlink_metadata(&p).is_ok_and(|m| m.file_type().is_symlink()) {
            return Err(FetchError::UnsafePath {
                name: name.to_string(),
                reason: format!("{} is a symlink", p.display()),
            });
        }
    }
    Ok(target)
}

fn part_path(target: &Path) -> PathBuf {
    let mut s = target.as_os_str().to_owned();
    s.push(".part");
    PathBuf::from(s)
}

/// sha256 and MD5 of a file, read once.
fn digest_file(path: &Path, md5: bool) -> Result<(String, Option<String>), FetchError> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).map_err(FetchError::io(path))?;
    let mut sha = Sha256::new();
    let mut m = md5.then(md5::Md5::new);
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(FetchError::io(path))?;
        if n == 0 {
            break;
        }
        sha.update(&buf[..n]);
        if let Some(m) = m.as_mut() {
            md5::Digest::update(m, &buf[..n]);
        }
    }
    Ok((
        hex::encode(sha.finalize()),
        m.map(|m| hex::encode(md5::Digest::finalize(m))),
    ))
}

/// Whether `dest` already holds exactly what the listing describes.
fn up_to_date(
    dest: &Path,
    source: &str,
    listing: &Listing,
    keep: &[RemoteFile],
) -> Option<Manifest> {
    let text = std::fs::read(dest.join(MANIFEST)).ok()?;
    let m: Manifest = serde_json::from_slice(&text).ok()?;
    if m.source != source || m.revision != listing.revision || m.files.len() != keep.len() {
        return None;
    }
    let same = m.files.iter().zip(keep).all(|(have, want)| {
        have.name == want.name
            && have.size == want.size
            && want.sha256.as_ref().is_none_or(|s| *s == have.sha256)
            && (want.md5.is_none() || want.md5 == have.md5)
            && std::fs::symlink_metadata(dest.join(&have.name))
                .is_ok_and(|md| md.is_file() && md.len() == have.size)
    });
    same.then_some(m)
}

/// Builds the remote for a source.
fn remote(opts: &FetchOptions, source: &Source) -> Result<Remote, FetchError> {
    match source {
        Source::Hf { repo, revision } => Ok(Remote::Hf(hf::Hub {
            endpoint: opts
                .hf_endpoint
                .clone()
                .unwrap_or_else(|| "https://huggingface.co".to_string()),
            repo: repo.clone(),
            revision: revision.clone(),
            token: opts.hf_token.clone().filter(|t| !t.is_empty()),
        })),
        Source::S3 { bucket, prefix } => Ok(Remote::S3(s3::Store::new(opts, bucket, prefix)?)),
        Source::Pvc { .. } => Err(FetchError::NotFetched(opts.source.clone())),
    }
}

/// Fetches `opts.source` into `opts.dest`. See the module documentation.
pub async fn fetch(opts: &FetchOptions) -> Result<FetchReport, FetchError> {
    let source = parse_source(&opts.source)?;
    let remote = remote(opts, &source)?;
    let client = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(30))
        // A stalled body is a broken download: resume it rather than wait forever.
        .read_timeout(Duration::from_secs(120))
        .user_agent(concat!("mole-worker/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| FetchError::Network {
            url: opts.source.clone(),
            reason: e.to_string(),
        })?;
    let dest = &opts.dest;
    std::fs::create_dir_all(dest).map_err(FetchError::io(dest))?;
    // Pods of one pool start together and fetch into the same directory of a shared volume:
    // one downloads, the others wait and then find its manifest.
    let _lock = lock(dest).await?;

    let listing = remote.list(&client, opts).await?;
    let (mut keep, skipped) = select(&opts.source, listing.files.clone())?;
    remote.checksums(&client, &mut keep).await?;
    if let Some(manifest) = up_to_date(dest, &opts.source, &listing, &keep) {
        tracing::info!(source = %opts.source, dest = %dest.display(), "already fetched; nothing to do");
        return Ok(FetchReport {
            manifest,
            downloaded: false,
            bytes: 0,
        });
    }
    let total: u64 = keep.iter().map(|f| f.size).sum();
    tracing::info!(
        source = %opts.source,
        revision = listing.revision.as_deref().unwrap_or("-"),
        files = keep.len(),
        skipped = skipped.len(),
        total_bytes = total,
        "fetching"
    );
    let mut done_before = 0u64;
    let mut transferred = 0u64;
    let mut files = Vec::new();
    // A bar on a terminal; in a Job's log the `progress` lines every tool writes, which the
    // operator puts in the Adapter's `Fetched` condition.
    let progress = crate::progress::Progress::new("fetch", "bytes", total);
    for f in &keep {
        let target = prepare_parent(dest, &f.name)?;
        let (written, entry) = transfer::fetch_file(
            &client,
            &remote,
            listing.revision.as_deref(),
            f,
            &target,
            opts.retries,
            (done_before, total, &progress),
        )
        .await?;
        transferred += written;
        done_before += f.size;
        files.push(entry);
    }
    progress.finish();
    let manifest = Manifest {
        source: opts.source.clone(),
        revision: listing.revision,
        files,
        skipped,
    };
    write_manifest(dest, &manifest)?;
    tracing::info!(bytes = transferred, total_bytes = total, "fetch complete");
    Ok(FetchReport {
        manifest,
        downloaded: true,
        bytes: transferred,
    })
}

/// Holds an exclusive `flock` on `DEST/.mole-fetch.lock` until dropped (the file closes).
async fn lock(dest: &Path) -> Result<std::fs::File, FetchError> {
    use std::os::fd::AsRawFd;
    let path = dest.join(".mole-fetch.lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(FetchError::io(&path))?;
    let file = tokio::task::spawn_blocking(move || {
        // SAFETY: flock on a descriptor this closure owns for the whole call.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) };
        if rc == 0 {
            Ok(file)
        } else {
            Err(std::io::Error::last_os_error())
        }
    })
    .await
    .map_err(|e| FetchError::Io {
        path: path.display().to_string(),
        source: std::io::Error::other(e.to_string()),
    })?
    .map_err(FetchError::io(&path))?;
    Ok(file)
}

fn write_manifest(dest: &Path, m: &Manifest) -> Result<(), FetchError> {
    let tmp = dest.join(format!("{MANIFEST}.tmp"));
    let text = serde_json::to_vec_pretty(m).expect("the manifest is plain data");
    std::fs::write(&tmp, text).map_err(FetchError::io(&tmp))?;
    crate::fs::publish_file(&tmp, &dest.join(MANIFEST)).map_err(|(p, e)| FetchError::io(&p)(e))
}

fn remote_name(remote: &Remote) -> String {
    match remote {
        Remote::Hf(h) => format!("hf://{}", h.repo),
        Remote::S3(s) => format!("s3://{}", s.bucket_name()),
    }
}

/// Maps a listing request's failure status to the error.
fn status_error(url: &str, status: reqwest::StatusCode, body: String) -> FetchError {
    match status.as_u16() {
        401 | 403 => FetchError::Unauthorized {
            url: url.to_string(),
            status: status.as_u16(),
        },
        404 => FetchError::NotFound {
            url: url.to_string(),
        },
        s => FetchError::Http {
            url: url.to_string(),
            status: s,
            body: body.chars().take(200).collect(),
        },
    }
}

fn network(url: &str, e: reqwest::Error) -> FetchError {
    FetchError::Network {
        url: url.to_string(),
        reason: e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_files() {
        assert_eq!(classify("model-00001-of-00002.safetensors"), Kind::Weights);
        assert_eq!(classify("config.json"), Kind::Keep);
        assert_eq!(classify("tokenizer.model"), Kind::Keep);
        assert_eq!(classify("merges.txt"), Kind::Keep);
        assert_eq!(classify("chat_template.jinja"), Kind::Keep);
        assert_eq!(classify("README.md"), Kind::Keep);
        assert_eq!(classify("LICENSE"), Kind::Keep);
        for p in [
            "pytorch_model.bin",
            "a.pt",
            "original/consolidated.00.pth",
            "x.pkl",
            "y.ckpt",
        ] {
            assert_eq!(classify(p), Kind::Pickle, "{p}");
        }
        assert_eq!(classify(".gitattributes"), Kind::Skip);
        assert_eq!(classify("model.gguf"), Kind::Skip);
    }

    fn rf(name: &str) -> RemoteFile {
        RemoteFile {
            name: name.into(),
            key: name.into(),
            size: 1,
            sha256: None,
            md5: None,
        }
    }

    #[test]
    fn selects_safetensors_and_refuses_pickle_only() {
        let (keep, skipped) = select(
            "s",
            vec![
                rf("model.safetensors"),
                rf("pytorch_model.bin"),
                rf("config.json"),
            ],
        )
        .unwrap();
        assert_eq!(
            keep.iter().map(|f| f.name.as_str()).collect::<Vec<_>>(),
            ["config.json", "model.safetensors"]
        );
        assert_eq!(skipped, ["pytorch_model.bin"]);
        let e = select("s", vec![rf("config.json"), rf("pytorch_model.bin")]).unwrap_err();
        assert_eq!(e.code(), "pickle_refused");
        assert!(e.to_string().contains("pytorch_model.bin"), "{e}");
        let e = select("s", vec![rf("config.json")]).unwrap_err();
        assert_eq!(e.code(), "no_safetensors");
    }

    #[test]
    fn refuses_names_that_escape() {
        for bad in [
            "../x.json",
            "/etc/x.json",
            "a/../../x.json",
            "a//b.json",
            "./a.json",
            ".mole-fetch.json",
            "a.safetensors.part",
        ] {
            assert_eq!(
                safe_name(bad).unwrap_err().code(),
                "path_outside_dest",
                "{bad}"
            );
        }
        safe_name("sub/dir/model.safetensors").unwrap();
    }

    #[test]
    fn refuses_a_symlinked_directory() {
        let dest = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(outside.path(), dest.path().join("sub")).unwrap();
        let e = prepare_parent(dest.path(), "sub/model.safetensors").unwrap_err();
        assert_eq!(e.code(), "path_outside_dest");
        std::os::unix::fs::symlink(outside.path().join("f"), dest.path().join("m.safetensors"))
            .unwrap();
        let e = prepare_parent(dest.path(), "m.safetensors").unwrap_err();
        assert_eq!(e.code(), "path_outside_dest");
        prepare_parent(dest.path(), "a/b/c.json").unwrap();
        assert!(dest.path().join("a/b").is_dir());
    }
}
