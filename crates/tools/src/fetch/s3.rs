//! S3 and S3-compatible stores (MinIO, Ceph, R2...): ListObjectsV2 under the prefix, a HEAD per
//! file for its checksum, and presigned GETs with Range.
//!
//! `rusty-s3` signs the requests (SigV4, sans I/O) and reqwest sends them: the downloads share
//! the hub's resume and verify path, and the build gains a handful of crates where
//! `object_store`'s `aws` feature brought about two hundred.

use std::time::Duration;

use rusty_s3::actions::{ListObjectsV2, S3Action};
use rusty_s3::{Bucket, Credentials, UrlStyle};

use super::{network, status_error, FetchError, FetchOptions, Listing, RemoteFile};

/// How long a presigned URL lives. Each GET (and each resume) signs a new one, so this only
/// bounds one request; S3 allows up to 7 days.
const URL_LIFETIME: Duration = Duration::from_secs(6 * 3600);

/// A bucket and prefix with the credentials to read them.
pub(super) struct Store {
    bucket: Bucket,
    prefix: String,
    credentials: Option<Credentials>,
}

impl Store {
    /// Path-style addressing when an endpoint is given (what MinIO and most S3-compatible
    /// stores expect); AWS's virtual-hosted style otherwise.
    pub fn new(opts: &FetchOptions, bucket: &str, prefix: &str) -> Result<Store, FetchError> {
        let region = opts
            .s3_region
            .clone()
            .filter(|r| !r.is_empty())
            .unwrap_or_else(|| "us-east-1".to_string());
        let (endpoint, style) = match opts.s3_endpoint.as_deref().filter(|e| !e.is_empty()) {
            Some(e) => (e.to_string(), UrlStyle::Path),
            None => (
                format!("https://s3.{region}.amazonaws.com"),
                UrlStyle::VirtualHost,
            ),
        };
        let bad = |reason: String| FetchError::BadSource {
            source_uri: opts.source.clone(),
            reason,
        };
        let url: reqwest::Url = endpoint
            .parse()
            .map_err(|e| bad(format!("S3 endpoint {endpoint:?}: {e}")))?;
        let bucket = Bucket::new(url, style, bucket.to_string(), region)
            .map_err(|e| bad(format!("S3 endpoint {endpoint:?}: {e}")))?;
        let credentials = match (&opts.aws_access_key_id, &opts.aws_secret_access_key) {
            (Some(k), Some(s)) if !k.is_empty() => Some(match &opts.aws_session_token {
                Some(t) if !t.is_empty() => Credentials::new_with_token(k, s, t),
                _ => Credentials::new(k, s),
            }),
            // Public buckets: anonymous, unsigned requests.
            _ => None,
        };
        Ok(Store {
            bucket,
            prefix: prefix.to_string(),
            credentials,
        })
    }

    pub fn bucket_name(&self) -> &str {
        self.bucket.name()
    }

    /// Every object under the prefix ("directory" markers left out), with the checksum a HEAD
    /// gives; at most `max_pages` pages (a store that never ends its listing is refused).
    pub async fn list(
        &self,
        client: &reqwest::Client,
        max_pages: u32,
    ) -> Result<Listing, FetchError> {
        let prefix = if self.prefix.is_empty() {
            String::new()
        } else {
            format!("{}/", self.prefix)
        };
        let mut files = Vec::new();
        let mut token: Option<String> = None;
        for page_no in 1u32.. {
            let mut action = ListObjectsV2::new(&self.bucket, self.credentials.as_ref());
            action.with_prefix(prefix.as_str());
            if let Some(t) = &token {
                action.with_continuation_token(t.as_str());
            }
            let url = action.sign(URL_LIFETIME);
            let shown = format!("s3://{}/{prefix}", self.bucket.name());
            let resp = client
                .get(url)
                .send()
                .await
                .map_err(|e| network(&shown, e))?;
            let status = resp.status();
            let body = resp.text().await.map_err(|e| network(&shown, e))?;
            if !status.is_success() {
                return Err(status_error(&shown, status, body));
            }
            let page = ListObjectsV2::parse_response(&body).map_err(|e| FetchError::Listing {
                url: shown.clone(),
                reason: e.to_string(),
            })?;
            for o in page.contents {
                if o.key.ends_with('/') {
                    continue;
                }
                // A store that answers keys outside the prefix asked for is broken or hostile:
                // refused, not sliced (a short key would panic, a foreign one be misnamed).
                let Some(name) = o.key.strip_prefix(prefix.as_str()) else {
                    return Err(FetchError::Listing {
                        url: shown,
                        reason: format!("the listing names key {:?} outside the prefix", o.key),
                    });
                };
                let name = name.to_string();
                files.push(RemoteFile {
                    name,
                    size: o.size.unwrap_or(0),
                    key: o.key,
                    sha256: None,
                    md5: None,
                });
            }
            match page.next_continuation_token {
                Some(_) if page_no >= max_pages => {
                    return Err(FetchError::Listing {
                        url: shown,
                        reason: format!(
                            "the listing goes on past {max_pages} pages (--max-list-pages)"
                        ),
                    })
                }
                Some(t) => token = Some(t),
                None => break,
            }
        }
        if files.is_empty() {
            return Err(FetchError::NotFound {
                url: format!("s3://{}/{prefix} (no objects)", self.bucket.name()),
            });
        }
        Ok(Listing {
            revision: None,
            files,
        })
    }

    /// Fills in a file's checksum from a HEAD: `x-amz-checksum-sha256` for objects uploaded
    /// with a full-object SHA-256, else the ETag when it is the MD5 of the bytes (single-part,
    /// not KMS/customer-key encrypted), else nothing (the computed sha256 is recorded).
    pub async fn checksums(
        &self,
        client: &reqwest::Client,
        f: &mut RemoteFile,
    ) -> Result<(), FetchError> {
        let mut action = self
            .bucket
            .head_object(self.credentials.as_ref(), f.key.as_str());
        action
            .headers_mut()
            .insert("x-amz-checksum-mode", "ENABLED");
        let url = action.sign(URL_LIFETIME);
        let shown = format!("s3://{}/{}", self.bucket.name(), f.key);
        let resp = client
            .head(url)
            .header("x-amz-checksum-mode", "ENABLED")
            .send()
            .await
            .map_err(|e| network(&shown, e))?;
        let status = resp.status();
        if !status.is_success() {
            return Err(status_error(&shown, status, String::new()));
        }
        let h = resp.headers();
        let header = |n: &str| h.get(n).and_then(|v| v.to_str().ok()).map(str::to_string);
        if let Some(len) = header("content-length").and_then(|l| l.parse().ok()) {
            f.size = len;
        }
        if let Some(sha) = header("x-amz-checksum-sha256")
            .filter(|s| !s.contains('-'))
            .and_then(|s| base64_decode(&s))
            .filter(|b| b.len() == 32)
        {
            f.sha256 = Some(hex::encode(sha));
            return Ok(());
        }
        let encrypted = header("x-amz-server-side-encryption").is_some_and(|e| e != "AES256")
            || header("x-amz-server-side-encryption-customer-algorithm").is_some();
        let etag = header("etag").map(|e| e.trim_matches('"').to_ascii_lowercase());
        if let Some(etag) =
            etag.filter(|e| !encrypted && e.len() == 32 && e.chars().all(|c| c.is_ascii_hexdigit()))
        {
            f.md5 = Some(etag);
        }
        Ok(())
    }

    /// A presigned GET of an object.
    pub fn get(&self, client: &reqwest::Client, key: &str) -> reqwest::RequestBuilder {
        let url = self
            .bucket
            .get_object(self.credentials.as_ref(), key)
            .sign(URL_LIFETIME);
        client.get(url)
    }
}

fn base64_decode(s: &str) -> Option<Vec<u8>> {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.decode(s).ok()
}
