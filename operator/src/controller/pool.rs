//! The InferencePool controller: observe → validate → build → apply → status.
//!
//! It owns `<pool>-config` (the WorkerConfig), `<pool>-dynamic` (Deployment + PDB) and the
//! Service `<pool>`. Adapter changes rewrite only the ConfigMap (pods never restart for them)
//! and each ready pod is told to reload.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{ListParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::{Api, Resource, ResourceExt};
use mole_crds::constants::{
    condition, reason, LABEL_ADAPTER, LABEL_APP_COMPONENT, LABEL_APP_INSTANCE,
};
use mole_crds::{
    Adapter, AdapterPhase, InferencePool, InferencePoolStatus, MergedDeploymentStatus, PoolPhase,
};

use super::apply::apply_if_changed;
use super::context::{operator_token, ready_pods, Context, Reload};
use super::reconcile::instrumented;
use super::validate::{validate_adapter, validate_pool};
use crate::error::{Error, Result};
use crate::mergedown::set_condition;
use crate::resources::{self, Registered};

/// The controller's name in metric labels and backoff keys.
const CONTROLLER: &str = "pool";
/// Field managers: one per call site, so ownership of every field is clear in `managedFields`.
const FM_CONFIG: &str = "mole-operator/pool-configmap";
const FM_DEPLOY: &str = "mole-operator/pool-deployment";
const FM_SERVICE: &str = "mole-operator/pool-service";
const FM_PDB: &str = "mole-operator/pool-pdb";
const FM_STATUS: &str = "mole-operator/pool-status";
/// How soon pods that have not accepted the current config are asked again.
pub const RELOAD_RETRY: Duration = Duration::from_secs(5);

/// What the pool controller observed.
struct Observed {
    adapters: Vec<Adapter>,
    config_map: Option<ConfigMap>,
    deployment: Option<Deployment>,
    service: Option<Service>,
    pdb: Option<PodDisruptionBudget>,
    merged: Vec<Deployment>,
}

async fn observe(pool: &InferencePool, ctx: &Context) -> Result<Observed> {
    let ns = pool.namespace().unwrap_or_default();
    let name = pool.name_any();
    let c = &ctx.client;
    let adapters: Api<Adapter> = Api::namespaced(c.clone(), &ns);
    let deployments: Api<Deployment> = Api::namespaced(c.clone(), &ns);
    let merged = ListParams::default().labels(&format!(
        "{LABEL_APP_INSTANCE}={name},{LABEL_APP_COMPONENT}=merged"
    ));
    Ok(Observed {
        adapters: adapters.list(&ListParams::default()).await?.items,
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
        merged: deployments.list(&merged).await?.items,
    })
}

/// The pool's merged Deployments as `status.merged` lists them (sorted by adapter).
pub fn merged_status(
    namespace: &str,
    pool: &str,
    deploys: &[Deployment],
) -> Vec<MergedDeploymentStatus> {
    let mut out: Vec<MergedDeploymentStatus> = deploys
        .iter()
        .filter(|d| d.metadata.deletion_timestamp.is_none())
        .filter_map(|d| {
            let adapter = d.metadata.labels.as_ref()?.get(LABEL_ADAPTER)?.clone();
            let version = d
                .spec
                .as_ref()
                .and_then(|s| s.template.metadata.as_ref())
                .and_then(|m| m.annotations.as_ref())
                .and_then(|a| a.get(resources::ANNOTATION_ADAPTER_VERSION))
                .cloned()
                .unwrap_or_default();
            let st = d.status.clone().unwrap_or_default();
            Some(MergedDeploymentStatus {
                endpoint: Some(crate::mergedown::merged_endpoint(pool, &adapter, namespace)),
                adapter,
                version,
                replicas: d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1),
                ready_replicas: st.ready_replicas.unwrap_or(0),
            })
        })
        .collect();
    out.sort_by(|a, b| a.adapter.cmp(&b.adapter));
    out
}

/// The adapters that belong in the pool's WorkerConfig: of this pool, not being deleted, valid,
/// and holding an id in the pool's ledger (the Adapter controller allocates it).
pub fn registered<'a>(pool: &InferencePool, adapters: &'a [Adapter]) -> Vec<Registered<'a>> {
    let name = pool.name_any();
    let ids = pool.status.as_ref().map(|s| &s.lora_ids);
    adapters
        .iter()
        .filter(|a| a.spec.pool == name && a.metadata.deletion_timestamp.is_none())
        .filter(|a| validate_adapter(a, Some(pool), adapters).is_ok())
        .filter_map(|a| {
            let id = ids?.get(&a.name_any())?;
            Some(Registered {
                adapter: a,
                lora_id: *id,
            })
        })
        .collect()
}

/// Reconciles one pool.
pub async fn reconcile(pool: Arc<InferencePool>, ctx: Arc<Context>) -> Result<Action> {
    instrumented(
        CONTROLLER,
        pool.as_ref(),
        &ctx,
        Box::pin(reconcile_inner(&pool, &ctx)),
    )
    .await
}

fn key(pool: &InferencePool) -> String {
    super::reconcile::key(CONTROLLER, pool)
}

async fn reconcile_inner(pool: &InferencePool, ctx: &Context) -> Result<Action> {
    let ns = pool.namespace().unwrap_or_default();
    let name = pool.name_any();
    let pools: Api<InferencePool> = Api::namespaced(ctx.client.clone(), &ns);
    let oref = pool.object_ref(&());
    let old = pool.status.clone().unwrap_or_default();
    let mut status = old.clone();
    status.observed_generation = pool.metadata.generation;
    let now = chrono::Utc::now();

    // validate
    if let Err(fe) = validate_pool(pool) {
        let changed = set_condition(
            &mut status.conditions,
            condition::VALID,
            false,
            fe.reason,
            &fe.to_string(),
            pool.metadata.generation,
            now,
        );
        set_condition(
            &mut status.conditions,
            condition::READY,
            false,
            fe.reason,
            &fe.to_string(),
            pool.metadata.generation,
            now,
        );
        status.phase = PoolPhase::Failed;
        write_status(&pools, &name, &status).await?;
        if changed {
            ctx.event(&oref, true, fe.reason, "Validate", fe.to_string())
                .await;
        }
        // Nothing already running is touched; wait for the spec to change.
        return Ok(Action::await_change());
    }
    set_condition(
        &mut status.conditions,
        condition::VALID,
        true,
        reason::SPEC_VALID,
        "spec accepted",
        pool.metadata.generation,
        now,
    );

    // observe
    let obs = observe(pool, ctx).await?;

    // The operator's token for the pods' API: created once, mounted by every worker pod.
    let token = operator_token(&ctx.client, pool).await?;

    // build
    let reg = registered(pool, &obs.adapters);
    let config = resources::worker_config(&name, &pool.spec, &reg);
    let (cm, config_hash) = resources::config_map(pool, &config);
    let deploy = resources::dynamic_deployment(pool);
    let svc = resources::service(pool);
    let pdb = resources::pdb(pool);

    // apply (nothing is written when the live objects already match)
    let client = ctx.client.clone();
    apply_if_changed(
        &Api::<ConfigMap>::namespaced(client.clone(), &ns),
        &resources::config_map_name(&name),
        FM_CONFIG,
        &cm,
        obs.config_map.as_ref(),
    )
    .await?;
    let applied = apply_if_changed(
        &Api::<Deployment>::namespaced(client.clone(), &ns),
        &resources::dynamic_name(&name),
        FM_DEPLOY,
        &deploy,
        obs.deployment.as_ref(),
    )
    .await?;
    apply_if_changed(
        &Api::<Service>::namespaced(client.clone(), &ns),
        &name,
        FM_SERVICE,
        &svc,
        obs.service.as_ref(),
    )
    .await?;
    apply_if_changed(
        &Api::<PodDisruptionBudget>::namespaced(client.clone(), &ns),
        &resources::dynamic_name(&name),
        FM_PDB,
        &pdb,
        obs.pdb.as_ref(),
    )
    .await?;

    // Every ready pod is asked to reload until it has accepted the current config hash. Right
    // after the ConfigMap changed the kubelet has not refreshed the mounted file yet: the pod
    // answers 409 config_stale and is asked again a few seconds later.
    let pods = ready_pods(&ctx.client, &ns, &name).await?;
    let mut not_reloaded = Vec::new();
    for pod in ctx.pods_to_reload(&key(pool), &pods, &config_hash) {
        match ctx.pods.reload(&pod, &token, &config_hash).await {
            Ok(Reload::Applied) => ctx.reload_accepted(&key(pool), &pod, &config_hash),
            Ok(Reload::Stale) => not_reloaded.push(pod.name.clone()),
            Err(e) => {
                tracing::warn!(error = %e, "reload request failed; retrying");
                not_reloaded.push(pod.name.clone());
            }
        }
    }

    // status
    let dstatus = applied
        .status
        .clone()
        .or(obs.deployment.and_then(|d| d.status))
        .unwrap_or_default();
    status.merged = merged_status(&ns, &name, &obs.merged);
    let desired = pool.spec.dynamic.replicas;
    let ready = dstatus.ready_replicas.unwrap_or(0);
    status.dynamic.replicas = desired;
    status.dynamic.ready_replicas = ready;
    status.ready_display = Some(format!("{ready}/{desired}"));
    let mine: Vec<&Adapter> = obs
        .adapters
        .iter()
        .filter(|a| a.spec.pool == name && a.metadata.deletion_timestamp.is_none())
        .collect();
    status.adapters.total = mine.len() as u32;
    status.adapters.ready = mine
        .iter()
        .filter(|a| {
            a.status
                .as_ref()
                .is_some_and(|s| s.phase == AdapterPhase::Ready)
        })
        .count() as u32;
    status.endpoint = Some(resources::endpoint(pool));
    let all_ready = ready >= desired;
    status.phase = if all_ready {
        PoolPhase::Ready
    } else {
        PoolPhase::Progressing
    };
    let became = set_condition(
        &mut status.conditions,
        condition::READY,
        all_ready,
        if all_ready {
            reason::POOL_READY
        } else {
            reason::PODS_NOT_READY
        },
        &format!("{ready}/{desired} dynamic pods ready"),
        pool.metadata.generation,
        now,
    );
    if status != old {
        write_status(&pools, &name, &status).await?;
    }
    if became {
        let r = if all_ready {
            reason::POOL_READY
        } else {
            reason::PODS_NOT_READY
        };
        ctx.event(
            &oref,
            false,
            r,
            "Reconcile",
            format!("{ready}/{desired} dynamic pods ready"),
        )
        .await;
    }
    Ok(Action::requeue(if !not_reloaded.is_empty() {
        tracing::debug!(pods = ?not_reloaded, "pods not on config {config_hash} yet");
        RELOAD_RETRY
    } else if all_ready {
        Duration::from_secs(300)
    } else {
        Duration::from_secs(15)
    }))
}

/// Writes the pool status with server-side apply (the lora id ledger is written separately,
/// with optimistic concurrency, by the Adapter controller).
async fn write_status(
    pools: &Api<InferencePool>,
    name: &str,
    status: &InferencePoolStatus,
) -> Result<()> {
    let mut status = status.clone();
    // The id ledger is owned by the adapter controller's guarded writes; this writer must
    // never move it backwards.
    status.lora_ids.clear();
    status.next_lora_id = None;
    let patch = serde_json::json!({
        "apiVersion": "mole.dev/v1alpha1",
        "kind": "InferencePool",
        "status": status,
    });
    pools
        .patch_status(
            name,
            &PatchParams::apply(FM_STATUS).force(),
            &Patch::Apply(&patch),
        )
        .await?;
    Ok(())
}

/// Error policy: invalid specs wait for a change; transient errors back off per object.
pub fn error_policy(pool: Arc<InferencePool>, err: &Error, ctx: Arc<Context>) -> Action {
    super::reconcile::error_policy(CONTROLLER, pool.as_ref(), err, &ctx)
}
