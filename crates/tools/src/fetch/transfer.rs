//! One file's transfer: the download into its `.part` (resumed from where it stopped,
//! restarted when the remote changed), the checks against the listing's size and digests, and
//! the rename into place.

use std::path::Path;
use std::time::Duration;

use futures::StreamExt;
use tokio::io::AsyncWriteExt;

use super::{digest_file, part_path, remote_name, FetchError, ManifestFile, Remote, RemoteFile};

/// Downloads one file (resuming its `.part`), verifies it and renames it into place. Returns
/// the bytes transferred and its manifest entry.
pub(super) async fn fetch_file(
    client: &reqwest::Client,
    remote: &Remote,
    revision: Option<&str>,
    f: &RemoteFile,
    target: &Path,
    retries: u32,
    (done_before, total, progress): (u64, u64, &crate::progress::Progress),
) -> Result<(u64, ManifestFile), FetchError> {
    // A file a crashed run already verified and renamed: check it rather than fetch it again.
    if let Some(sha) = &f.sha256 {
        if std::fs::metadata(target).is_ok_and(|m| m.is_file() && m.len() == f.size) {
            let (have, _) = digest_file(target, false)?;
            if have == *sha {
                tracing::info!(file = %f.name, "already in place and verified");
                return Ok((0, entry(f, have, "sha256")));
            }
        }
    }
    let part = part_path(target);
    // A `.part` left by an earlier run: if its bytes turn out wrong (a crash that lost
    // written pages), it is fetched again from scratch once rather than failing the run.
    let inherited = std::fs::metadata(&part).is_ok_and(|m| m.len() > 0);
    let fill = || {
        fill_part(
            client,
            remote,
            revision,
            f,
            &part,
            retries,
            (done_before, total, progress),
        )
    };
    let mut transferred = fill().await?;
    let (sha, verified) = match verify(f, &part) {
        Err(e) if inherited => {
            tracing::warn!(file = %f.name, error = %e, "the earlier run's .part is corrupt; fetching it again");
            std::fs::remove_file(&part).map_err(FetchError::io(&part))?;
            transferred += fill().await?;
            verify(f, &part)
        }
        other => other,
    }
    .inspect_err(|_| {
        let _ = std::fs::remove_file(&part);
    })?;
    // The bytes reach the disk before the name does, so a crash cannot leave a torn file
    // under the final name, and the name before the manifest lists it.
    crate::fs::publish_file(&part, target).map_err(|(p, e)| FetchError::io(&p)(e))?;
    tracing::info!(file = %f.name, bytes = f.size, verified, "file done");
    Ok((transferred, entry(f, sha, verified)))
}

/// Downloads what `part` lacks of the file, resuming with Range after a broken transfer (up to
/// `retries` times). Returns the bytes transferred.
async fn fill_part(
    client: &reqwest::Client,
    remote: &Remote,
    revision: Option<&str>,
    f: &RemoteFile,
    part: &Path,
    retries: u32,
    (done_before, total, progress): (u64, u64, &crate::progress::Progress),
) -> Result<u64, FetchError> {
    let mut transferred = 0u64;
    let mut attempt = 0u32;
    loop {
        let have = match std::fs::metadata(part) {
            Ok(m) if m.len() <= f.size => m.len(),
            // Longer than the object: not a prefix of it.
            Ok(_) => {
                std::fs::remove_file(part).map_err(FetchError::io(part))?;
                0
            }
            Err(_) => 0,
        };
        if have == f.size {
            break;
        }
        match download(
            client,
            remote,
            revision,
            f,
            part,
            have,
            (done_before, total, progress),
        )
        .await
        {
            Ok(n) => {
                transferred += n;
                continue;
            }
            Err(Broken::Fatal(e)) => return Err(e),
            Err(Broken::Retry { url, reason, bytes }) => {
                transferred += bytes;
                attempt += 1;
                if attempt > retries {
                    return Err(FetchError::Network { url, reason });
                }
                tracing::warn!(file = %f.name, %reason, attempt, "download broke; resuming");
                tokio::time::sleep(Duration::from_millis(500 * u64::from(attempt))).await;
            }
        }
    }
    Ok(transferred)
}

/// Checks a complete `.part` against the source's digest. Returns its sha256 and what it was
/// verified against.
fn verify(f: &RemoteFile, part: &Path) -> Result<(String, &'static str), FetchError> {
    let (sha, md5) = digest_file(part, f.md5.is_some() && f.sha256.is_none())?;
    let mismatch = |algorithm, expected: &String, actual: String| FetchError::ChecksumMismatch {
        file: f.name.clone(),
        algorithm,
        expected: expected.clone(),
        actual,
    };
    if let Some(want) = &f.sha256 {
        if *want != sha {
            return Err(mismatch("sha256", want, sha));
        }
        return Ok((sha, "sha256"));
    }
    if let (Some(want), Some(got)) = (&f.md5, md5) {
        if *want != got {
            return Err(mismatch("md5", want, got));
        }
        return Ok((sha, "md5"));
    }
    Ok((sha, "none"))
}

fn entry(f: &RemoteFile, sha256: String, verified: &str) -> ManifestFile {
    ManifestFile {
        name: f.name.clone(),
        size: f.size,
        sha256,
        verified: verified.to_string(),
        md5: if verified == "md5" {
            f.md5.clone()
        } else {
            None
        },
    }
}

enum Broken {
    /// Worth resuming: the connection broke or the server had a transient failure.
    Retry {
        url: String,
        reason: String,
        bytes: u64,
    },
    Fatal(FetchError),
}

/// One GET of the rest of a file, appended to its `.part`. Returns the bytes appended.
async fn download(
    client: &reqwest::Client,
    remote: &Remote,
    revision: Option<&str>,
    f: &RemoteFile,
    part: &Path,
    have: u64,
    (done_before, total, progress): (u64, u64, &crate::progress::Progress),
) -> Result<u64, Broken> {
    let mut req = remote.get(client, f, revision);
    if have > 0 {
        tracing::info!(file = %f.name, from = have, size = f.size, "resuming with a Range request");
        req = req.header(reqwest::header::RANGE, format!("bytes={have}-"));
    }
    let url = format!("{}:{}", remote_name(remote), f.key);
    let retry = |reason: String, bytes| Broken::Retry {
        url: url.clone(),
        reason,
        bytes,
    };
    let resp = req.send().await.map_err(|e| retry(e.to_string(), 0))?;
    let status = resp.status();
    let mut offset = have;
    let mut file_opts = tokio::fs::OpenOptions::new();
    file_opts.create(true).write(true);
    if status == reqwest::StatusCode::PARTIAL_CONTENT {
        file_opts.append(true);
    } else if status.is_success() {
        // The server ignored the Range: start over.
        file_opts.truncate(true);
        offset = 0;
    } else if status == reqwest::StatusCode::RANGE_NOT_SATISFIABLE {
        let _ = std::fs::remove_file(part);
        return Err(retry("range not satisfiable; restarting".into(), 0));
    } else {
        let body = resp.text().await.unwrap_or_default();
        return Err(match status.as_u16() {
            401 | 403 => Broken::Fatal(FetchError::Unauthorized {
                url,
                status: status.as_u16(),
            }),
            404 => Broken::Fatal(FetchError::NotFound { url }),
            s if s >= 500 || s == 429 => retry(format!("HTTP {s}"), 0),
            s => Broken::Fatal(FetchError::Http {
                url,
                status: s,
                body: body.chars().take(200).collect(),
            }),
        });
    }
    let mut out = file_opts
        .open(part)
        .await
        .map_err(|e| Broken::Fatal(FetchError::io(part)(e)))?;
    let mut stream = resp.bytes_stream();
    let mut written = 0u64;
    while let Some(chunk) = stream.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => {
                let _ = out.flush().await;
                return Err(retry(e.to_string(), written));
            }
        };
        if offset + chunk.len() as u64 > f.size {
            let _ = out.flush().await;
            drop(out);
            let _ = std::fs::remove_file(part);
            return Err(Broken::Fatal(FetchError::SizeMismatch {
                file: f.name.clone(),
                expected: f.size,
                actual: offset + chunk.len() as u64,
            }));
        }
        out.write_all(&chunk)
            .await
            .map_err(|e| Broken::Fatal(FetchError::io(part)(e)))?;
        offset += chunk.len() as u64;
        written += chunk.len() as u64;
        progress.set(done_before + offset);
    }
    out.flush()
        .await
        .map_err(|e| Broken::Fatal(FetchError::io(part)(e)))?;
    if offset < f.size {
        return Err(retry(
            format!("connection closed at {offset} of {} bytes", f.size),
            written,
        ));
    }
    tracing::info!(
        file = %f.name,
        done = offset,
        size = f.size,
        overall_done = done_before + offset,
        overall_total = total,
        "downloaded"
    );
    Ok(written)
}
