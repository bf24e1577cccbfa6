//! The Hugging Face Hub: the revision's file list (`GET {endpoint}/api/models/{repo}/revision/
//! {rev}?blobs=true`, which resolves a branch or tag to its commit and gives each LFS file's
//! sha256) and the files (`GET {endpoint}/{repo}/resolve/{sha}/{file}`, with Range).
//!
//! Not the `hf-hub` crate: it writes into its own cache layout (blobs with symlinked
//! snapshots), where mole needs plain files in a given directory, verified against the LFS
//! sha256 and resumed from a `.part` of our own.

use serde::Deserialize;

use super::{network, status_error, FetchError, Listing, RemoteFile};

/// A repository at a revision on a hub endpoint.
pub(super) struct Hub {
    pub endpoint: String,
    pub repo: String,
    pub revision: String,
    pub token: Option<String>,
}

#[derive(Deserialize)]
struct RevisionInfo {
    sha: String,
    #[serde(default)]
    siblings: Vec<Sibling>,
}

#[derive(Deserialize)]
struct Sibling {
    rfilename: String,
    #[serde(default)]
    size: Option<u64>,
    #[serde(default)]
    lfs: Option<Lfs>,
}

#[derive(Deserialize)]
struct Lfs {
    sha256: String,
    size: u64,
}

impl Hub {
    fn base(&self) -> &str {
        self.endpoint.trim_end_matches('/')
    }

    fn auth(&self, req: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.token {
            Some(t) => req.bearer_auth(t),
            None => req,
        }
    }

    /// Lists the revision, pinned to its commit sha.
    pub async fn list(&self, client: &reqwest::Client) -> Result<Listing, FetchError> {
        // A revision may hold '/' (refs/pr/1): one path segment, percent-encoded.
        let rev: String = url_segment(&self.revision);
        let url = format!(
            "{}/api/models/{}/revision/{rev}?blobs=true",
            self.base(),
            self.repo
        );
        let resp = self
            .auth(client.get(&url))
            .send()
            .await
            .map_err(|e| network(&url, e))?;
        let status = resp.status();
        if !status.is_success() {
            let body = resp.text().await.unwrap_or_default();
            return Err(status_error(&url, status, body));
        }
        let info: RevisionInfo = resp.json().await.map_err(|e| FetchError::Listing {
            url: url.clone(),
            reason: e.to_string(),
        })?;
        if info.sha.len() != 40 || !info.sha.chars().all(|c| c.is_ascii_hexdigit()) {
            return Err(FetchError::Listing {
                url,
                reason: format!("revision sha {:?} is not a commit sha", info.sha),
            });
        }
        let files = info
            .siblings
            .into_iter()
            .map(|s| {
                let (size, sha256) = match s.lfs {
                    Some(l) => (Some(l.size), Some(l.sha256.to_ascii_lowercase())),
                    None => (s.size, None),
                };
                let size = size.ok_or_else(|| FetchError::Listing {
                    url: url.clone(),
                    reason: format!("{} has no size (is ?blobs=true supported?)", s.rfilename),
                })?;
                Ok(RemoteFile {
                    name: s.rfilename.clone(),
                    key: s.rfilename,
                    size,
                    sha256,
                    md5: None,
                })
            })
            .collect::<Result<Vec<_>, FetchError>>()?;
        Ok(Listing {
            revision: Some(info.sha),
            files,
        })
    }

    /// The GET of a file at the pinned commit (redirects to a CDN are followed; reqwest drops
    /// the token when the host changes).
    pub fn get(&self, client: &reqwest::Client, key: &str, sha: &str) -> reqwest::RequestBuilder {
        let path: Vec<String> = key.split('/').map(url_segment).collect();
        let url = format!(
            "{}/{}/resolve/{sha}/{}",
            self.base(),
            self.repo,
            path.join("/")
        );
        self.auth(client.get(url))
    }
}

/// Percent-encodes one URL path segment.
fn url_segment(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, SEGMENT).to_string()
}

const SEGMENT: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~');
