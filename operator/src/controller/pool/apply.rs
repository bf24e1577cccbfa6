//! Apply: the pool's children written with server-side apply (only when they differ), and
//! every ready pod asked to reload the config.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::{ConfigMap, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Patch, PatchParams};
use kube::{Api, ResourceExt};
use mole_crds::InferencePool;

use super::build::Desired;
use super::observe::Observed;
use crate::controller::apply::apply_if_changed;
use std::time::Duration;

use crate::controller::context::{Context, ReloadFailure};
use crate::controller::pod_client::{ready_pods, Reload};
use crate::error::Result;
use crate::resources;

/// Field managers: one per call site, so ownership of every field is clear in `managedFields`.
const FM_CONFIG: &str = "mole-operator/pool-configmap";
const FM_DEPLOY: &str = "mole-operator/pool-deployment";
const FM_SERVICE: &str = "mole-operator/pool-service";
const FM_PDB: &str = "mole-operator/pool-pdb";
const FM_HPA: &str = "mole-operator/pool-hpa";
const FM_REPLICAS_HANDOFF: &str = "mole-operator/pool-replicas-handoff";

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
    let token = ctx.pod_index.token(&ctx.client, pool).await?;
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
    let deploys = Api::<Deployment>::namespaced(client.clone(), &ns);
    // After a handover the apply must run even when nothing else changed: only a write
    // without `replicas` gives up the operator's ownership of it.
    let handed_over = hand_replicas_over(&deploys, desired, obs.deployment.as_ref()).await?;
    let deployment = apply_if_changed(
        &deploys,
        &resources::dynamic_name(&name),
        FM_DEPLOY,
        &desired.deployment,
        obs.deployment.as_ref().filter(|_| !handed_over),
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
                // What the pods load changed: the Adapters' next readings must be new.
                ctx.pod_index.invalidate(pool);
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

/// Before the first apply without `replicas` (a pool that just turned autoscaling on): if the
/// operator's apply owns the live count alone, dropping it from the apply would reset it to
/// the API server's default of 1, stopping every pod but one until the HPA scales back up.
/// Applying the same count to the scale subresource under a second manager first makes that
/// manager co-own it, so the next apply only gives up the operator's share and the count stays.
/// Returns whether it handed the count over.
async fn hand_replicas_over(
    deploys: &Api<Deployment>,
    desired: &super::build::Desired,
    live: Option<&Deployment>,
) -> Result<bool> {
    let wanted = desired.deployment.spec.as_ref().and_then(|s| s.replicas);
    let Some(live) = live else { return Ok(false) };
    let count = live.spec.as_ref().and_then(|s| s.replicas);
    let (None, Some(count)) = (wanted, count) else {
        return Ok(false);
    };
    if !owns_replicas(live, FM_DEPLOY) {
        return Ok(false);
    }
    let scale = serde_json::json!({
        "apiVersion": "autoscaling/v1", "kind": "Scale",
        "metadata": {"name": live.metadata.name},
        "spec": {"replicas": count},
    });
    deploys
        .patch_scale(
            live.metadata.name.as_deref().unwrap_or_default(),
            &PatchParams::apply(FM_REPLICAS_HANDOFF).force(),
            &Patch::Apply(&scale),
        )
        .await?;
    Ok(true)
}

/// Whether the apply of field manager `manager` owns `spec.replicas` of `d`.
pub(super) fn owns_replicas(d: &Deployment, manager: &str) -> bool {
    d.metadata.managed_fields.iter().flatten().any(|m| {
        m.manager.as_deref() == Some(manager)
            && m.operation.as_deref() == Some("Apply")
            && m.fields_v1
                .as_ref()
                .is_some_and(|f| f.0["f:spec"].get("f:replicas").is_some())
    })
}

/// Whether `meta` has an owner reference to `pool` (by uid).
fn owned_by_pool(meta: &ObjectMeta, pool: &InferencePool) -> bool {
    let Some(uid) = pool.metadata.uid.as_deref() else {
        return false;
    };
    meta.owner_references.iter().flatten().any(|o| o.uid == uid)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deployment(managed: serde_json::Value) -> Deployment {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "vl-dynamic", "managedFields": managed},
            "spec": {"replicas": 3, "selector": {}, "template": {}}
        }))
        .unwrap()
    }

    #[test]
    fn the_replicas_owner_is_read_from_managed_fields() {
        let entry = |manager: &str, op: &str, fields: serde_json::Value| {
            serde_json::json!({"manager": manager, "operation": op, "apiVersion": "apps/v1",
                               "fieldsType": "FieldsV1", "fieldsV1": fields})
        };
        let with_replicas = serde_json::json!({"f:spec": {"f:replicas": {}, "f:template": {}}});
        let without = serde_json::json!({"f:spec": {"f:template": {}}});
        let owned = deployment(serde_json::json!([entry(
            FM_DEPLOY,
            "Apply",
            with_replicas.clone()
        )]));
        assert!(owns_replicas(&owned, FM_DEPLOY));
        let released = deployment(serde_json::json!([entry(FM_DEPLOY, "Apply", without)]));
        assert!(!owns_replicas(&released, FM_DEPLOY));
        // The HPA's scale updates are another manager's.
        let hpa = deployment(serde_json::json!([entry(
            "kube-controller-manager",
            "Update",
            with_replicas
        )]));
        assert!(!owns_replicas(&hpa, FM_DEPLOY));
    }
}
