//! Apply: the pool's children written with server-side apply (only when they differ), and
//! every ready pod asked to reload the config.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::{Api, ResourceExt};
use mole_crds::InferencePool;

use super::build::Desired;
use super::observe::Observed;
use crate::controller::apply::apply_if_changed;
use std::time::Duration;

use crate::controller::context::{operator_token, ready_pods, Context, Reload, ReloadFailure};
use crate::error::Result;
use crate::resources;

/// Field managers: one per call site, so ownership of every field is clear in `managedFields`.
const FM_CONFIG: &str = "mole-operator/pool-configmap";
const FM_DEPLOY: &str = "mole-operator/pool-deployment";
const FM_SERVICE: &str = "mole-operator/pool-service";
const FM_PDB: &str = "mole-operator/pool-pdb";

/// What applying left behind.
pub(super) struct Applied {
    /// The dynamic Deployment as the API server holds it now.
    pub deployment: Deployment,
    /// Where the ready pods stand with the current config.
    pub reload: Reloads,
}

/// Where the ready pods stand with the current config after asking them to reload.
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct Reloads {
    /// How many pods are ready.
    pub ready: usize,
    /// Ready pods whose mounted file is older than the ConfigMap (409 `config_stale`): asked
    /// again shortly.
    pub stale: Vec<String>,
    /// Ready pods whose last reload failed otherwise, with why.
    pub failed: Vec<ReloadFailure>,
    /// When the first failed pod is asked again.
    pub retry_in: Option<Duration>,
}

/// Writes the children that differ from what was observed, then brings every ready pod onto
/// the new config.
pub(super) async fn apply(
    pool: &InferencePool,
    ctx: &Context,
    obs: &Observed,
    desired: &Desired,
) -> Result<Applied> {
    // The operator's token for the pods' API: created once, mounted by every worker pod.
    let token = operator_token(&ctx.client, pool).await?;
    let deployment = apply_children(pool, ctx, obs, desired).await?;
    let reload = reload(pool, ctx, &token, &desired.config_hash).await?;
    Ok(Applied { deployment, reload })
}

/// Applies ConfigMap, Deployment, Service and PDB (nothing is written when the live objects
/// already match); returns the Deployment as the API server holds it.
async fn apply_children(
    pool: &InferencePool,
    ctx: &Context,
    obs: &Observed,
    desired: &Desired,
) -> Result<Deployment> {
    let ns = pool.namespace().unwrap_or_default();
    let name = pool.name_any();
    let client = &ctx.client;
    apply_if_changed(
        &Api::<ConfigMap>::namespaced(client.clone(), &ns),
        &resources::config_map_name(&name),
        FM_CONFIG,
        &desired.config_map,
        obs.config_map.as_ref(),
    )
    .await?;
    let deployment = apply_if_changed(
        &Api::<Deployment>::namespaced(client.clone(), &ns),
        &resources::dynamic_name(&name),
        FM_DEPLOY,
        &desired.deployment,
        obs.deployment.as_ref(),
    )
    .await?;
    apply_if_changed(
        &Api::<Service>::namespaced(client.clone(), &ns),
        &name,
        FM_SERVICE,
        &desired.service,
        obs.service.as_ref(),
    )
    .await?;
    apply_if_changed(
        &Api::<PodDisruptionBudget>::namespaced(client.clone(), &ns),
        &resources::dynamic_name(&name),
        FM_PDB,
        &desired.pdb,
        obs.pdb.as_ref(),
    )
    .await?;
    Ok(deployment)
}

/// Asks every ready pod to reload until it has accepted `config_hash`. Right after the
/// ConfigMap changed the kubelet has not refreshed the mounted file: the pod answers 409
/// config_stale and is asked again a few seconds later. Any other failure (a refusal, no
/// answer) would not go away by asking every few seconds: the pod is asked again with a
/// backoff, and the failure is reported (the pool's `AdaptersSynced` condition).
async fn reload(
    pool: &InferencePool,
    ctx: &Context,
    token: &str,
    config_hash: &str,
) -> Result<Reloads> {
    let ns = pool.namespace().unwrap_or_default();
    let key = super::key(pool);
    let pods = ready_pods(&ctx.client, &ns, &pool.name_any()).await?;
    let mut stale = Vec::new();
    for pod in ctx.pods_to_reload(&key, &pods, config_hash) {
        if !ctx.reload_due(&key, &pod, config_hash) {
            continue;
        }
        let failure = |code: String, message: String| ReloadFailure {
            pod: pod.name.clone(),
            code,
            message,
        };
        let failed = match ctx.pods.reload(&pod, token, config_hash).await {
            Ok(Reload::Applied) => {
                ctx.reload_accepted(&key, &pod, config_hash);
                continue;
            }
            Ok(Reload::Stale) => {
                ctx.reload_answered(&key, &pod);
                stale.push(pod.name.clone());
                continue;
            }
            Ok(Reload::Refused { code, message }) => failure(code, message),
            Err(e) => failure(e.code().into(), e.to_string()),
        };
        let delay = ctx.reload_failed(&key, &pod, config_hash, failed.clone());
        tracing::warn!(failure = %failed, retry_in = ?delay, "reload failed");
    }
    let (failed, retry_in) = ctx.reload_failures(&key);
    Ok(Reloads {
        ready: pods.len(),
        stale,
        failed,
        retry_in,
    })
}
