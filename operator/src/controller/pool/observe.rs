//! Observe: what the pool controller reads before it builds anything.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::ListParams;
use kube::{Api, ResourceExt};
use mole_crds::constants::{LABEL_APP_COMPONENT, LABEL_APP_INSTANCE};
use mole_crds::{Adapter, InferencePool, ModelSource};

use crate::controller::context::Context;
use crate::controller::pods::{pod_problem, PodProblem};
use crate::error::Result;
use crate::resources;

/// What the pool controller observed.
pub(super) struct Observed {
    /// Every Adapter of the namespace, from the Adapter store (the pool's are picked when
    /// building).
    pub adapters: Vec<Adapter>,
    /// Names of the dynamic pods not being deleted (where `dynamic.placement` places adapters).
    pub pods: Vec<String>,
    /// The ready dynamic pods: name → pod IP.
    pub ready: std::collections::BTreeMap<String, String>,
    /// The live `<pool>-config`.
    pub config_map: Option<ConfigMap>,
    /// The live `<pool>-dynamic` Deployment.
    pub deployment: Option<Deployment>,
    /// The live Service `<pool>`.
    pub service: Option<Service>,
    /// The live PDB of the dynamic pods.
    pub pdb: Option<PodDisruptionBudget>,
    /// The live HPA of the dynamic pods.
    pub hpa: Option<HorizontalPodAutoscaler>,
    /// The pool's merged Deployments (owned by their Adapters, reported in the pool's status).
    pub merged: Vec<Deployment>,
    /// With a fetched `baseModel.source`: what the pool's pods show of their `fetch-model`
    /// init containers (None without one).
    pub fetch: Option<FetchSeen>,
    /// Why a dynamic pod cannot become ready by itself, when one cannot.
    pub pod_problem: Option<PodProblem>,
}

/// What the pool's pods show of the base model's fetch.
#[derive(Debug, Clone, PartialEq, Default)]
pub(super) struct FetchSeen {
    /// The tool's one line from a failed `fetch-model` container.
    pub failure: Option<String>,
    /// Some pod's `fetch-model` container finished successfully.
    pub done: bool,
    /// The last progress line of a running `fetch-model` container, as a phrase.
    pub progress: Option<String>,
}

/// A pod whose `fetch-model` init container is running now (its log holds the progress).
pub(super) fn fetching_pod(pods: &[Pod]) -> Option<&str> {
    pods.iter().find_map(|p| {
        let running = p
            .status
            .as_ref()?
            .init_container_statuses
            .as_ref()?
            .iter()
            .any(|c| {
                c.name == resources::FETCH_MODEL_CONTAINER
                    && c.state.as_ref().is_some_and(|s| s.running.is_some())
            });
        running.then_some(p.metadata.name.as_deref()).flatten()
    })
}

/// Reads the `fetch-model` init containers of the pool's pods: the first termination message
/// of a failed run (current or last state) and whether any run succeeded.
pub(super) fn fetch_seen(pods: &[Pod]) -> FetchSeen {
    let statuses: Vec<_> = pods
        .iter()
        .filter_map(|p| p.status.as_ref()?.init_container_statuses.as_ref())
        .flatten()
        .filter(|c| c.name == resources::FETCH_MODEL_CONTAINER)
        .collect();
    let done = statuses.iter().any(|c| {
        c.state
            .as_ref()
            .and_then(|s| s.terminated.as_ref())
            .is_some_and(|t| t.exit_code == 0)
    });
    let failure = statuses
        .iter()
        .flat_map(|c| [c.state.as_ref(), c.last_state.as_ref()])
        .flatten()
        .filter_map(|s| s.terminated.as_ref())
        .filter(|t| t.exit_code != 0)
        .filter_map(|t| t.message.as_deref().map(str::trim))
        .find(|m| !m.is_empty())
        .map(String::from);
    FetchSeen {
        // A failure that a later run got past is history, not the state.
        failure: failure.filter(|_| !done),
        done,
        progress: None,
    }
}

/// The pool's id ledger as last written, and how far to trust it.
pub(super) struct LedgerBase {
    /// The ledger.
    pub ledger: crate::controller::ids::Ledger,
    /// The resourceVersion of the cached pool it was read from, when it was not this
    /// operator's own last write (after a start, or a write whose outcome is unknown): the
    /// status write is then made on that version only, so a cache behind a previous leader's
    /// last write cannot give its ids again (see `status::Ids`).
    pub guard: Option<String>,
}

/// The pool's ledger (this operator's last write, else the cached status) and every Adapter of
/// its namespace, from the Adapter store.
pub(super) async fn ledger(
    pool: &InferencePool,
    ctx: &Context,
) -> Result<(LedgerBase, Vec<Adapter>)> {
    ctx.stores.ready().await?;
    let ns = pool.namespace().unwrap_or_default();
    let key = format!("{ns}/{}", pool.name_any());
    let uid = pool.metadata.uid.clone().unwrap_or_default();
    let base = match ctx.written_ledger(&key, &uid) {
        Some(ledger) => LedgerBase {
            ledger,
            guard: None,
        },
        None => LedgerBase {
            ledger: crate::controller::ids::Ledger::of(pool.status.as_ref()),
            guard: pool.metadata.resource_version.clone(),
        },
    };
    Ok((base, ctx.stores.adapters_in(&ns)))
}

/// Reads the pool's adapters and the live children the pool controller writes or reports.
pub(super) async fn observe(pool: &InferencePool, ctx: &Context) -> Result<Observed> {
    let ns = pool.namespace().unwrap_or_default();
    let name = pool.name_any();
    let c = &ctx.client;
    ctx.stores.ready().await?;
    let deployments: Api<Deployment> = Api::namespaced(c.clone(), &ns);
    let merged = ListParams::default().labels(&format!(
        "{LABEL_APP_INSTANCE}={name},{LABEL_APP_COMPONENT}=merged"
    ));
    let fetched = pool
        .spec
        .base_model
        .source
        .as_deref()
        .and_then(|u| ModelSource::parse(u).ok())
        .is_some_and(|s| s.is_fetched());
    let pods = ListParams::default().labels(&format!(
        "{LABEL_APP_INSTANCE}={name},{LABEL_APP_COMPONENT}=dynamic"
    ));
    let pods = Api::<Pod>::namespaced(c.clone(), &ns)
        .list(&pods)
        .await?
        .items;
    let mut fetch = fetched.then(|| fetch_seen(&pods));
    if let Some(f) = fetch.as_mut().filter(|f| !f.done && f.failure.is_none()) {
        if let Some(pod) = fetching_pod(&pods) {
            let api = Api::<Pod>::namespaced(c.clone(), &ns);
            f.progress = crate::controller::pods::log_progress(
                &api,
                pod,
                Some(resources::FETCH_MODEL_CONTAINER),
            )
            .await;
        }
    }
    let names = pods
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter_map(|p| p.metadata.name.clone())
        .collect();
    let ready = pods
        .iter()
        .filter_map(crate::controller::pod_client::ready)
        .map(|p| (p.name, p.ip))
        .collect();
    Ok(Observed {
        fetch,
        pods: names,
        ready,
        pod_problem: pod_problem(&pods),
        adapters: ctx.stores.adapters_in(&ns),
        config_map: Api::<ConfigMap>::namespaced(c.clone(), &ns)
            .get_opt(&resources::config_map_name(&name))
            .await?,
        deployment: deployments.get_opt(&resources::dynamic_name(&name)).await?,
        service: Api::<Service>::namespaced(c.clone(), &ns)
            .get_opt(&name)
            .await?,
        pdb: Api::<PodDisruptionBudget>::namespaced(c.clone(), &ns)
            .get_opt(&resources::dynamic_name(&name))
            .await?,
        hpa: Api::<HorizontalPodAutoscaler>::namespaced(c.clone(), &ns)
            .get_opt(&resources::dynamic_name(&name))
            .await?,
        merged: deployments.list(&merged).await?.items,
    })
}

impl Observed {
    /// The ready dynamic pods' base URLs on `port`, by name (the WorkerConfig's `peers`).
    pub(super) fn peers(&self, port: u16) -> std::collections::BTreeMap<String, String> {
        self.ready
            .iter()
            .map(|(name, ip)| {
                let host = if ip.contains(':') {
                    format!("[{ip}]")
                } else {
                    ip.clone()
                };
                (name.clone(), format!("http://{host}:{port}"))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(state: serde_json::Value, last: serde_json::Value) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p"},
            "status": {"initContainerStatuses": [{"name": "fetch-model", "image": "i", "imageID": "",
                "ready": false, "restartCount": 1, "state": state, "lastState": last}]}
        }))
        .unwrap()
    }

    #[test]
    fn a_failed_fetch_is_read_from_the_termination_message() {
        let line = "fetch failed (unauthorized): https://huggingface.co/...: HTTP 401";
        let failed = pod(
            serde_json::json!({"waiting": {"reason": "CrashLoopBackOff"}}),
            serde_json::json!({"terminated": {"exitCode": 1, "message": format!("{line}\n")}}),
        );
        assert_eq!(
            fetch_seen(std::slice::from_ref(&failed)),
            FetchSeen {
                failure: Some(line.into()),
                done: false,
                progress: None,
            }
        );
        let ok = pod(
            serde_json::json!({"terminated": {"exitCode": 0}}),
            serde_json::json!({}),
        );
        assert_eq!(
            fetch_seen(&[failed, ok]),
            FetchSeen {
                failure: None,
                done: true,
                progress: None,
            }
        );
        assert_eq!(fetch_seen(&[]), FetchSeen::default());
    }

    /// The pod whose log is read for the progress: one whose `fetch-model` runs now, not one
    /// waiting in a back-off or done.
    #[test]
    fn the_progress_is_read_from_a_running_fetch() {
        let named = |name: &str, mut p: Pod| {
            p.metadata.name = Some(name.into());
            p
        };
        let waiting = named(
            "a",
            pod(
                serde_json::json!({"waiting": {"reason": "CrashLoopBackOff"}}),
                serde_json::json!({}),
            ),
        );
        let done = named(
            "b",
            pod(
                serde_json::json!({"terminated": {"exitCode": 0}}),
                serde_json::json!({}),
            ),
        );
        let running = named(
            "c",
            pod(
                serde_json::json!({"running": {"startedAt": "2026-11-28T12:00:00Z"}}),
                serde_json::json!({}),
            ),
        );
        assert_eq!(fetching_pod(&[waiting.clone(), done.clone()]), None);
        assert_eq!(fetching_pod(&[waiting, done, running]), Some("c"));
    }
}
