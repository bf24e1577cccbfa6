//! Apply: the pool's children written with server-side apply (only when they differ), and
//! every ready pod asked to reload the config.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::{ConfigMap, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::{Api, ResourceExt};
use mole_crds::InferencePool;

use super::build::Desired;
use super::observe::Observed;
use crate::controller::apply::apply_if_changed;
use crate::controller::context::{operator_token, ready_pods, Context, Reload};
use crate::error::Result;
use crate::resources;

/// Field managers: one per call site, so ownership of every field is clear in `managedFields`.
const FM_CONFIG: &str = "mole-operator/pool-configmap";
const FM_DEPLOY: &str = "mole-operator/pool-deployment";
const FM_SERVICE: &str = "mole-operator/pool-service";
const FM_PDB: &str = "mole-operator/pool-pdb";
const FM_HPA: &str = "mole-operator/pool-hpa";

/// What applying left behind.
pub(super) struct Applied {
    /// The dynamic Deployment as the API server holds it now.
    pub deployment: Deployment,
    /// Ready pods that have not accepted the current config yet.
    pub not_reloaded: Vec<String>,
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
    let not_reloaded = reload(pool, ctx, &token, &desired.config_hash).await?;
    Ok(Applied {
        deployment,
        not_reloaded,
    })
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
    let hpas = Api::<HorizontalPodAutoscaler>::namespaced(client.clone(), &ns);
    let hpa_name = resources::dynamic_name(&name);
    match (&desired.hpa, &obs.hpa) {
        (Some(hpa), live) => {
            apply_if_changed(&hpas, &hpa_name, FM_HPA, hpa, live.as_ref()).await?;
        }
        // Autoscaling turned off: an HPA left behind would keep resizing the Deployment
        // against the count the operator applies again. Only the pool's own goes.
        (None, Some(live)) if owned_by_pool(&live.metadata, pool) => {
            match hpas.delete(&hpa_name, &Default::default()).await {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => return Err(e.into()),
            }
        }
        (None, _) => {}
    }
    Ok(deployment)
}

/// Asks every ready pod to reload until it has accepted `config_hash`; returns the pods that
/// have not yet. Right after the ConfigMap changed the kubelet has not refreshed the mounted
/// file: the pod answers 409 config_stale and is asked again a few seconds later.
async fn reload(
    pool: &InferencePool,
    ctx: &Context,
    token: &str,
    config_hash: &str,
) -> Result<Vec<String>> {
    let ns = pool.namespace().unwrap_or_default();
    let key = super::key(pool);
    let pods = ready_pods(&ctx.client, &ns, &pool.name_any()).await?;
    let mut not_reloaded = Vec::new();
    for pod in ctx.pods_to_reload(&key, &pods, config_hash) {
        match ctx.pods.reload(&pod, token, config_hash).await {
            Ok(Reload::Applied) => ctx.reload_accepted(&key, &pod, config_hash),
            Ok(Reload::Stale) => not_reloaded.push(pod.name.clone()),
            Err(e) => {
                tracing::warn!(error = %e, "reload request failed; retrying");
                not_reloaded.push(pod.name.clone());
            }
        }
    }
    Ok(not_reloaded)
}

/// Whether `meta` has an owner reference to `pool` (by uid).
fn owned_by_pool(meta: &ObjectMeta, pool: &InferencePool) -> bool {
    let Some(uid) = pool.metadata.uid.as_deref() else {
        return false;
    };
    meta.owner_references.iter().flatten().any(|o| o.uid == uid)
}
