//! The kubelet's log endpoint: the API server proxies `pods/log` (`kubectl logs`) to
//! `https://<node InternalIP>:<kubeletEndpoint port>/containerLogs/{ns}/{pod}/{container}`.
//! Served over TLS with a self-signed certificate (made by openssl, as the control plane's
//! PKI is): the API server does not verify the kubelet's certificate unless it is given
//! `--kubelet-certificate-authority`.
//!
//! Query parameters: `tailLines`, `limitBytes`, `previous`, `follow` (streams until the
//! container instance ends). `timestamps` and `sinceSeconds` are accepted and ignored: the
//! logs are the processes' raw output, without the runtime's per-line timestamps.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use axum::body::Body;
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde::Deserialize;
use tokio::io::{AsyncReadExt as _, AsyncSeekExt as _};

/// The logs of one container of a pod.
#[derive(Debug, Clone, Default)]
pub struct ContainerLogs {
    /// The current (or last) instance's log.
    pub current: Option<PathBuf>,
    /// The instance before it (`previous=true`).
    pub previous: Option<PathBuf>,
    /// Whether the current instance still runs (`follow` ends when it does not).
    pub running: bool,
    /// The pod's uid (a pod of the same name that replaces it takes the entry over).
    pub uid: String,
}

/// `(namespace, pod) -> container -> logs`, kept by the pod workers.
pub type LogIndex = Arc<Mutex<HashMap<(String, String), HashMap<String, ContainerLogs>>>>;

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct LogQuery {
    tail_lines: Option<usize>,
    limit_bytes: Option<usize>,
    #[serde(default)]
    previous: bool,
    #[serde(default)]
    follow: bool,
}

fn not_found(what: String) -> Response {
    (StatusCode::NOT_FOUND, what).into_response()
}

/// The last `n` lines of `text`.
pub fn tail_lines(text: &[u8], n: usize) -> &[u8] {
    if n == 0 {
        return &text[text.len()..];
    }
    let body = text.strip_suffix(b"\n").unwrap_or(text);
    let mut seen = 0;
    for (i, b) in body.iter().enumerate().rev() {
        if *b == b'\n' {
            seen += 1;
            if seen == n {
                return &text[i + 1..];
            }
        }
    }
    text
}

async fn container_logs(
    State(index): State<LogIndex>,
    UrlPath((ns, pod, container)): UrlPath<(String, String, String)>,
    Query(q): Query<LogQuery>,
) -> Response {
    let entry = {
        let idx = index.lock().expect("no panic while holding the lock");
        idx.get(&(ns.clone(), pod.clone()))
            .and_then(|c| c.get(&container))
            .cloned()
    };
    let Some(entry) = entry else {
        return not_found(format!("container {container} of pod {ns}/{pod} not found"));
    };
    let path = if q.previous {
        entry.previous.clone()
    } else {
        entry.current.clone()
    };
    let Some(path) = path else {
        return (
            StatusCode::BAD_REQUEST,
            format!(
                "{} container {container} of pod {ns}/{pod} has no logs",
                if q.previous {
                    "previous terminated"
                } else {
                    ""
                }
            ),
        )
            .into_response();
    };
    let text = tokio::fs::read(&path).await.unwrap_or_default();
    let mut first = match q.tail_lines {
        Some(n) => tail_lines(&text, n).to_vec(),
        None => text.clone(),
    };
    if let Some(limit) = q.limit_bytes {
        first.truncate(limit);
    }
    if !q.follow || q.previous {
        return (StatusCode::OK, first).into_response();
    }
    // Follow: what is there, then what the process appends until its instance ends.
    let offset = text.len() as u64;
    // The file is opened once and read through that handle: the pod's directory (its logs
    // with it) goes when a deleted pod's last container ends, and an open file stays readable
    // after that, so the last lines are never lost to the removal.
    let file = match tokio::fs::File::open(&path).await {
        Ok(mut f) => f
            .seek(std::io::SeekFrom::Start(offset))
            .await
            .ok()
            .map(|_| f),
        Err(_) => None,
    };
    let stream = futures::stream::unfold(
        (
            Some(first),
            offset,
            path,
            index,
            (ns, pod, container),
            false,
            file,
        ),
        |(first, mut offset, path, index, key, done, mut file)| async move {
            if let Some(first) = first {
                return Some((
                    Ok::<_, std::io::Error>(first),
                    (None, offset, path, index, key, done, file),
                ));
            }
            if done {
                return None;
            }
            loop {
                // Whether the instance runs is read before the file: when it had ended, the
                // read below holds all it wrote. Read after, a last line written between the
                // read and the exit was lost (`kubectl logs -f` missed a SIGTERM handler's
                // last words under load).
                let still = {
                    let idx = index.lock().expect("no panic while holding the lock");
                    idx.get(&(key.0.clone(), key.1.clone()))
                        .and_then(|c| c.get(&key.2))
                        .is_some_and(|c| c.running && c.current.as_deref() == Some(path.as_path()))
                };
                let mut chunk = Vec::new();
                if let Some(f) = file.as_mut() {
                    let _ = f.read_to_end(&mut chunk).await;
                }
                if !chunk.is_empty() {
                    offset += chunk.len() as u64;
                    return Some((Ok(chunk), (None, offset, path, index, key, !still, file)));
                }
                if !still {
                    return None;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        },
    );
    (StatusCode::OK, Body::from_stream(stream)).into_response()
}

/// A self-signed certificate for `ip` in `dir` (`kubelet.crt`, `kubelet.key`).
fn self_signed(dir: &Path, ip: Ipv4Addr) -> Result<(PathBuf, PathBuf)> {
    let crt = dir.join("kubelet.crt");
    let key = dir.join("kubelet.key");
    let out = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
        ])
        .args(["-nodes", "-days", "2", "-subj", "/CN=mole-test-kubelet"])
        .arg("-addext")
        .arg(format!("subjectAltName=IP:{ip}"))
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&crt)
        .output()
        .context("running openssl")?;
    if !out.status.success() {
        bail!("openssl req: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok((crt, key))
}

/// Serves the log endpoint on `ip` (a free port); returns the port and the server's task.
pub async fn serve(
    dir: &Path,
    ip: Ipv4Addr,
    index: LogIndex,
) -> Result<(u16, tokio::task::JoinHandle<()>)> {
    let (crt, key) = self_signed(dir, ip)?;
    let certs: Vec<CertificateDer<'static>> =
        CertificateDer::pem_file_iter(&crt)?.collect::<std::result::Result<_, _>>()?;
    let key = PrivateKeyDer::from_pem_file(&key)?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(certs, key)?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
    let listener = tokio::net::TcpListener::bind(SocketAddr::from((ip, 0))).await?;
    let port = listener.local_addr()?.port();
    let app = Router::new()
        .route("/containerLogs/{ns}/{pod}/{container}", get(container_logs))
        .with_state(index);
    let task = tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                continue;
            };
            let acceptor = acceptor.clone();
            let app = app.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let svc = hyper_util::service::TowerToHyperService::new(app);
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(tls), svc)
                    .await;
            });
        }
    });
    Ok((port, task))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_lines_counts_lines_from_the_end() {
        assert_eq!(tail_lines(b"a\nb\nc\n", 2), b"b\nc\n");
        assert_eq!(tail_lines(b"a\nb\nc", 2), b"b\nc");
        assert_eq!(tail_lines(b"a\nb\n", 5), b"a\nb\n");
        assert_eq!(tail_lines(b"a\nb\n", 0), b"");
    }
}
