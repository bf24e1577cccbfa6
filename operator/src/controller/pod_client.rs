//! The pool's worker pods as the operator reaches them: which are ready (listed from the API
//! server), the HTTP client that calls them (`/v1/lora_adapters`, `/admin/reload`, unload) and
//! the token it presents. Below the reconcile's [`super::context::Context`], which holds a
//! [`PodClient`], and the [`super::pod_index::PodIndex`], which reads through these.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{ListParams, PostParams};
use kube::{Api, Client, ResourceExt};
use mole_crds::constants::{LABEL_APP_COMPONENT, LABEL_APP_INSTANCE};
use mole_crds::{InferencePool, LoraAdaptersResponse};

use crate::error::{Error, PodCallError, Result};
use crate::resources;

/// A ready worker pod.
#[derive(Debug, Clone, PartialEq)]
pub struct ReadyPod {
    /// Pod name.
    pub name: String,
    /// Pod IP.
    pub ip: String,
}

impl ReadyPod {
    /// `name@ip`: one pod incarnation (a pod recreated under its name has a new IP).
    pub(super) fn key(&self) -> String {
        format!("{}@{}", self.name, self.ip)
    }
}

/// What a worker answered to `POST /admin/reload`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reload {
    /// It re-read its file, which has the expected hash, and applied it.
    Applied,
    /// 409 `config_stale`: its mounted file is older than the ConfigMap (the kubelet refreshes
    /// it up to a minute later). Ask again shortly; this is no error.
    Stale,
    /// Any other error answer: the worker's JSON error `code` (or `http_<status>`) and
    /// message. Asking again at once would get the same answer.
    Refused {
        /// The worker's error code.
        code: String,
        /// The HTTP status and the worker's message.
        message: String,
    },
}

/// HTTP client of the worker pods (`/v1/lora_adapters`, `/admin/reload`, unload).
#[derive(Clone)]
pub struct PodClient {
    http: reqwest::Client,
    port: u16,
}

impl PodClient {
    /// A client that reaches workers on `port` with a short timeout (an unresponsive pod must
    /// not stall the reconcile of every other object).
    pub fn new(port: u16) -> Self {
        Self {
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(3))
                .build()
                .expect("reqwest client builds"),
            port,
        }
    }

    /// The port workers are reached on, which is also the port the operator renders into their
    /// pods (`--listen`, the container port the probes name): the two cannot disagree.
    pub fn port(&self) -> u16 {
        self.port
    }

    fn url(&self, pod: &ReadyPod, path: &str) -> String {
        format!("http://{}:{}{path}", pod.ip, self.port)
    }

    fn err(pod: &ReadyPod, e: impl Into<PodCallError>) -> Error {
        Error::Pod {
            pod: pod.name.clone(),
            source: e.into(),
        }
    }

    /// `GET /v1/lora_adapters`, authenticated with the pool's operator token.
    pub async fn adapters(&self, pod: &ReadyPod, token: &str) -> Result<LoraAdaptersResponse> {
        let r = self
            .http
            .get(self.url(pod, "/v1/lora_adapters"))
            .bearer_auth(token)
            .send()
            .await
            .map_err(|e| Self::err(pod, e))?;
        if !r.status().is_success() {
            return Err(Self::err(
                pod,
                PodCallError::Status {
                    path: "/v1/lora_adapters",
                    status: r.status(),
                },
            ));
        }
        r.json().await.map_err(|e| Self::err(pod, e))
    }

    /// `POST /admin/reload` with the config hash the pod should end up with.
    pub async fn reload(&self, pod: &ReadyPod, token: &str, config_hash: &str) -> Result<Reload> {
        let r = self
            .http
            .post(self.url(pod, "/admin/reload"))
            .bearer_auth(token)
            .json(&serde_json::json!({"configHash": config_hash}))
            .send()
            .await
            .map_err(|e| Self::err(pod, e))?;
        let status = r.status();
        if status.is_success() {
            return Ok(Reload::Applied);
        }
        // The worker's errors are `{"error": {"code", "message", ...}}` (OpenAI's shape).
        let body: serde_json::Value = r.json().await.unwrap_or_default();
        let code = body["error"]["code"].as_str();
        if status == reqwest::StatusCode::CONFLICT && code == Some("config_stale") {
            return Ok(Reload::Stale);
        }
        let said = body["error"]["message"]
            .as_str()
            .unwrap_or("no error message");
        Ok(Reload::Refused {
            code: code.map_or_else(|| format!("http_{}", status.as_u16()), String::from),
            message: format!("/admin/reload answered {status}: {said}"),
        })
    }

    /// `POST /v1/unload_lora_adapter` (vLLM's shape).
    pub async fn unload(&self, pod: &ReadyPod, token: &str, name: &str) -> Result<()> {
        let r = self
            .http
            .post(self.url(pod, "/v1/unload_lora_adapter"))
            .bearer_auth(token)
            .json(&serde_json::json!({"lora_name": name}))
            .send()
            .await
            .map_err(|e| Self::err(pod, e))?;
        // 404: the pod never had it (or already dropped it): the goal is reached.
        if r.status().is_success() || r.status() == reqwest::StatusCode::NOT_FOUND {
            Ok(())
        } else {
            Err(Self::err(
                pod,
                PodCallError::Status {
                    path: "/v1/unload_lora_adapter",
                    status: r.status(),
                },
            ))
        }
    }
}

/// The ready dynamic pods of a pool (Ready condition true and an IP).
pub async fn ready_pods(client: &Client, ns: &str, pool: &str) -> Result<Vec<ReadyPod>> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let lp = ListParams::default().labels(&format!(
        "{LABEL_APP_INSTANCE}={pool},{LABEL_APP_COMPONENT}=dynamic"
    ));
    Ok(pods
        .list(&lp)
        .await?
        .items
        .iter()
        .filter_map(ready)
        .collect())
}

/// A pod's name and IP when it is Ready and not terminating.
pub fn ready(p: &Pod) -> Option<ReadyPod> {
    if p.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = p.status.as_ref()?;
    let is_ready = status
        .conditions
        .as_ref()?
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    let ip = status.pod_ip.clone()?;
    is_ready.then(|| ReadyPod {
        name: p.metadata.name.clone().unwrap_or_default(),
        ip,
    })
}

/// A fresh operator token: 32 random bytes, hex.
fn new_token() -> String {
    use rand::RngCore;
    let mut b = [0u8; 32];
    rand::rng().fill_bytes(&mut b);
    hex::encode(b)
}

fn token_of(s: &Secret) -> Option<String> {
    let b = s.data.as_ref()?.get(resources::OPERATOR_TOKEN_KEY)?;
    let t = String::from_utf8(b.0.clone()).ok()?.trim().to_string();
    (!t.is_empty()).then_some(t)
}

/// The token the operator presents to `pool`'s worker pods: read from the Secret
/// `<pool>-operator-token`, which is created (owned by the pool) only when absent. Two writers
/// racing both create it; the loser's 409 makes it read the winner's token.
pub async fn operator_token(client: &Client, pool: &InferencePool) -> Result<String> {
    let ns = pool.namespace().unwrap_or_default();
    let name = resources::operator_token_secret_name(&pool.name_any());
    let api: Api<Secret> = Api::namespaced(client.clone(), &ns);
    let missing = || Error::OperatorToken {
        secret: name.clone(),
    };
    if let Some(s) = api.get_opt(&name).await? {
        return token_of(&s).ok_or_else(missing);
    }
    let secret = resources::operator_token_secret(pool, &new_token());
    match api.create(&PostParams::default(), &secret).await {
        Ok(_) => token_of(&secret).ok_or_else(missing),
        Err(kube::Error::Api(e)) if e.code == 409 => {
            token_of(&api.get(&name).await?).ok_or_else(missing)
        }
        Err(e) => Err(e.into()),
    }
}
