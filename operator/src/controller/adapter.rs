//! The Adapter controller (dynamic serving): observe → validate → build → apply → status.
//!
//! It validates the adapter, allocates its LoRA id once in the pool's ledger, and reports
//! `Ready` only when every ready dynamic pod of the pool says (over HTTP,
//! `GET /v1/lora_adapters`) that it serves this adapter version. A finalizer unregisters the
//! adapter and asks the pods to unload it before the object goes.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::finalizer::{finalizer, Event as Finalizer};
use kube::{Api, Resource, ResourceExt};
use mole_crds::constants::{
    condition, reason, ADAPTER_FINALIZER, LABEL_ADAPTER, LABEL_APP_COMPONENT, LABEL_APP_INSTANCE,
};
use mole_crds::{Adapter, AdapterPhase, AdapterStatus, InferencePool, LoraAdaptersResponse};

use super::apply::apply_if_changed;
use super::context::{operator_token, ready_pods, Context};
use super::ids;
use super::reconcile::instrumented;
use super::validate::validate_adapter;
use crate::error::{Error, Result};
use crate::mergedown::{self, set_condition};
use crate::resources;

/// The controller's name in metric labels and backoff keys.
const CONTROLLER: &str = "adapter";
const FM_STATUS: &str = "mole-operator/adapter-status";
/// Retries of the optimistic-concurrency loop on the pool's id ledger.
const LEDGER_RETRIES: usize = 8;

/// Whether an adapter version is served by a set of pods: at least one pod, and every pod
/// reports it loaded. Returns (ready, loaded count, first load error).
pub fn loaded_everywhere(
    reports: &[LoraAdaptersResponse],
    name: &str,
    version: &str,
) -> (bool, usize, Option<String>) {
    let loaded = reports
        .iter()
        .filter(|r| r.is_loaded(name, version))
        .count();
    let error = reports
        .iter()
        .flat_map(|r| r.data.iter())
        .find(|a| a.name == name && a.version == version && a.error.is_some())
        .and_then(|a| a.error.clone());
    (
        !reports.is_empty() && loaded == reports.len(),
        loaded,
        error,
    )
}

/// Reconciles one adapter (through the finalizer).
pub async fn reconcile(adapter: Arc<Adapter>, ctx: Arc<Context>) -> Result<Action> {
    instrumented(
        CONTROLLER,
        adapter.as_ref(),
        &ctx,
        Box::pin(finalize(&adapter, &ctx)),
    )
    .await
}

/// Runs [`apply`] or, once the Adapter is being deleted, [`cleanup`] behind the finalizer.
async fn finalize(adapter: &Arc<Adapter>, ctx: &Arc<Context>) -> Result<Action> {
    let ns = adapter.namespace().unwrap_or_default();
    let api: Api<Adapter> = Api::namespaced(ctx.client.clone(), &ns);
    let c = ctx.clone();
    finalizer(&api, ADAPTER_FINALIZER, adapter.clone(), |ev| async move {
        match ev {
            Finalizer::Apply(a) => apply(&a, &c).await,
            Finalizer::Cleanup(a) => cleanup(&a, &c).await,
        }
    })
    .await
    .map_err(|e| match e {
        kube::runtime::finalizer::Error::ApplyFailed(e)
        | kube::runtime::finalizer::Error::CleanupFailed(e) => e,
        other => Error::Finalizer(other.to_string()),
    })
}

/// How often an adapter refused for a reason that depends on other objects (its pool is
/// missing, another adapter holds its label) is checked again.
pub const RECHECK_OTHERS: Duration = Duration::from_secs(60);

/// What to do after a validation failure with `reason`: a missing pool may be created and a
/// clashing adapter deleted, so those are checked again; a wrong field waits for an edit.
pub fn invalid_action(reason: &str) -> Action {
    if reason == reason::POOL_NOT_FOUND || reason == reason::DUPLICATE_LABEL {
        Action::requeue(RECHECK_OTHERS)
    } else {
        Action::await_change()
    }
}

/// Allocates (or finds) the adapter's id in the pool's ledger with optimistic concurrency.
async fn ensure_id(pools: &Api<InferencePool>, pool: &str, adapter: &str) -> Result<u32> {
    for _ in 0..LEDGER_RETRIES {
        let current = pools.get_status(pool).await?;
        let status = current.status.clone().unwrap_or_default();
        let (id, next) = ids::allocate(&status, adapter);
        let Some(next) = next else { return Ok(id) };
        let mut obj = current.clone();
        obj.status = Some(next);
        // replace_status sends metadata.resourceVersion: a concurrent allocation conflicts.
        match pools
            .replace_status(pool, &PostParams::default(), &obj)
            .await
        {
            Ok(_) => return Ok(id),
            Err(kube::Error::Api(e)) if e.code == 409 => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(Error::Conflict(format!("lora id ledger of pool {pool}")))
}

async fn release_id(pools: &Api<InferencePool>, pool: &str, adapter: &str) -> Result<()> {
    for _ in 0..LEDGER_RETRIES {
        let Some(current) = pools.get_opt(pool).await? else {
            return Ok(());
        };
        let status = current.status.clone().unwrap_or_default();
        let Some(next) = ids::release(&status, adapter) else {
            return Ok(());
        };
        let mut obj = current.clone();
        obj.status = Some(next);
        match pools
            .replace_status(pool, &PostParams::default(), &obj)
            .await
        {
            Ok(_) => return Ok(()),
            Err(kube::Error::Api(e)) if e.code == 409 => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(Error::Conflict(format!("lora id ledger of pool {pool}")))
}

async fn write_status(api: &Api<Adapter>, name: &str, status: &AdapterStatus) -> Result<()> {
    let patch = serde_json::json!({
        "apiVersion": "mole.dev/v1alpha1",
        "kind": "Adapter",
        "status": status,
    });
    api.patch_status(
        name,
        &PatchParams::apply(FM_STATUS).force(),
        &Patch::Apply(&patch),
    )
    .await?;
    Ok(())
}

async fn apply(adapter: &Adapter, ctx: &Context) -> Result<Action> {
    let ns = adapter.namespace().unwrap_or_default();
    let name = adapter.name_any();
    let api: Api<Adapter> = Api::namespaced(ctx.client.clone(), &ns);
    let pools: Api<InferencePool> = Api::namespaced(ctx.client.clone(), &ns);
    let oref = adapter.object_ref(&());
    let generation = adapter.metadata.generation;
    let now = chrono::Utc::now();
    let old = adapter.status.clone().unwrap_or_default();
    let mut status = old.clone();
    status.observed_generation = generation;

    // observe
    let pool = pools.get_opt(&adapter.spec.pool).await?;
    let siblings = api.list(&ListParams::default()).await?.items;

    // validate
    if let Err(fe) = validate_adapter(adapter, pool.as_ref(), &siblings) {
        status.phase = AdapterPhase::Failed;
        let changed = set_condition(
            &mut status.conditions,
            condition::VALID,
            false,
            fe.reason,
            &fe.to_string(),
            generation,
            now,
        );
        set_condition(
            &mut status.conditions,
            condition::READY,
            false,
            fe.reason,
            &fe.to_string(),
            generation,
            now,
        );
        if status != old {
            write_status(&api, &name, &status).await?;
        }
        if changed {
            ctx.event(&oref, true, fe.reason, "Validate", fe.to_string())
                .await;
        }
        // A missing pool may appear later, a clashing adapter may go; other invalid specs
        // wait for an edit.
        return Ok(invalid_action(fe.reason));
    }
    let pool = pool.expect("validated");
    set_condition(
        &mut status.conditions,
        condition::VALID,
        true,
        reason::SPEC_VALID,
        "spec accepted",
        generation,
        now,
    );

    // build + apply: the id in the pool's ledger registers the adapter in the pool's config
    // (the pool controller, watching Adapters, rewrites the ConfigMap).
    let lora_id = ensure_id(&pools, &adapter.spec.pool, &name).await?;
    if status.lora_id != Some(lora_id) {
        ctx.event(
            &oref,
            false,
            reason::LORA_ID_ALLOCATED,
            "Register",
            format!("lora id {lora_id} in pool {}", adapter.spec.pool),
        )
        .await;
    }
    status.lora_id = Some(lora_id);

    // observe: every ready dynamic pod, the merge Job of the desired inputs, the merged pods.
    let token = operator_token(&ctx.client, &pool).await?;
    let pods = ready_pods(&ctx.client, &ns, &adapter.spec.pool).await?;
    let mut reports = Vec::with_capacity(pods.len());
    let mut unreachable = Vec::new();
    for pod in &pods {
        match ctx.pods.adapters(pod, &token).await {
            Ok(r) => reports.push(r),
            Err(e) => unreachable.push(e.to_string()),
        }
    }
    let (all_loaded, loaded, load_error) =
        loaded_everywhere(&reports, &name, &adapter.spec.version);
    let dynamic_loaded = all_loaded && unreachable.is_empty();
    let pool_name = adapter.spec.pool.clone();
    let key = mergedown::merge_key(&pool.spec, &name, &adapter.spec);
    let merged = Api::<Deployment>::namespaced(ctx.client.clone(), &ns)
        .get_opt(&resources::merged_name(&pool_name, &name))
        .await?;
    let observed = mergedown::Observed {
        job: observe_job(ctx, &ns, &key.job_name).await?,
        deployment: merged.as_ref().map(observe_merged),
        dynamic_loaded,
        now,
    };

    // build: the pure merge-down plan (dynamic mode included: it removes merged pods only once
    // the dynamic pods serve the adapter).
    let plan = mergedown::plan(
        &pool_name,
        &pool.spec,
        mergedown::Subject {
            name: &name,
            namespace: &ns,
            generation,
            spec: &adapter.spec,
            status: &status,
        },
        &observed,
    );

    // apply
    let owner = adapter
        .controller_owner_ref(&())
        .expect("adapters read from the API have a uid");
    apply_plan(
        ctx,
        &ns,
        &pool,
        &name,
        &adapter.spec,
        &plan,
        merged.as_ref(),
        owner,
    )
    .await?;

    // status: the plan's serving decision is what the pool's WorkerConfig follows.
    let mut status = plan.status.clone();
    status.load_dynamic = Some(plan.load_dynamic);
    status.merged_endpoint = plan.merged_endpoint.clone();
    let pods_msg = {
        let mut m = format!(
            "{loaded}/{} ready dynamic pods serve version {}",
            pods.len(),
            adapter.spec.version
        );
        if !unreachable.is_empty() {
            m.push_str(&format!("; unreachable: {}", unreachable.join("; ")));
        }
        m
    };
    let (why, msg) = match (&load_error, dynamic_loaded, pods.is_empty()) {
        (_, true, _) => (reason::LOADED, pods_msg),
        (Some(err), _, _) => (
            reason::LOAD_FAILED,
            format!("a pod refused version {}: {err}", adapter.spec.version),
        ),
        (None, _, true) => (
            reason::WAITING_FOR_PODS,
            "the pool has no ready dynamic pod".to_string(),
        ),
        (None, _, false) => (reason::WAITING_FOR_PODS, pods_msg),
    };
    set_condition(
        &mut status.conditions,
        condition::LOADED,
        dynamic_loaded,
        why,
        &msg,
        generation,
        now,
    );
    if load_error.is_some() && status.phase != AdapterPhase::Ready {
        // Nothing serves this version and a pod says why: that is a failure, not a wait.
        status.phase = if status.active_version.is_some() {
            AdapterPhase::Degraded
        } else {
            AdapterPhase::Failed
        };
    }
    if status != old {
        write_status(&api, &name, &status).await?;
    }
    let oref = adapter.object_ref(&());
    for ev in &plan.events {
        ctx.event(&oref, ev.warning, ev.reason, "Serve", ev.note.clone())
            .await;
    }
    if let (Some(err), true) = (&load_error, status.phase != old.phase) {
        ctx.event(&oref, true, reason::LOAD_FAILED, "Load", err.clone())
            .await;
    }
    let secs = plan.requeue_after_secs.unwrap_or(60).clamp(1, 3600) as u64;
    Ok(Action::requeue(Duration::from_secs(secs)))
}

/// What the cluster shows of the merge Job `name`, with the tool's reason when it failed.
async fn observe_job(ctx: &Context, ns: &str, name: &str) -> Result<mergedown::JobState> {
    let jobs: Api<Job> = Api::namespaced(ctx.client.clone(), ns);
    let Some(job) = jobs.get_opt(name).await? else {
        return Ok(mergedown::JobState::Absent);
    };
    let st = job.status.unwrap_or_default();
    if st.succeeded.unwrap_or(0) > 0 {
        return Ok(mergedown::JobState::Succeeded);
    }
    let failed = st
        .conditions
        .unwrap_or_default()
        .into_iter()
        .find(|c| c.type_ == "Failed" && c.status == "True");
    let Some(cond) = failed else {
        return Ok(mergedown::JobState::Running);
    };
    // `mole-worker merge` writes its one-line reason to /dev/termination-log.
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
    let lp = ListParams::default().labels(&format!("job-name={name}"));
    let message = pods
        .list(&lp)
        .await?
        .items
        .into_iter()
        .flat_map(|p| {
            p.status
                .and_then(|s| s.container_statuses)
                .unwrap_or_default()
        })
        .filter_map(|c| c.state?.terminated?.message)
        .find(|m| !m.trim().is_empty());
    Ok(mergedown::JobState::Failed {
        reason: message
            .map(|m| m.trim().to_string())
            .or(cond.message)
            .unwrap_or_else(|| "merge Job failed".into()),
    })
}

/// The merged Deployment of an adapter as the planner sees it. Its pods count as ready only
/// for the current template: the Deployment controller has seen the latest generation, every
/// pod runs the updated template (no old pod left, which could still be the one answering) and
/// at least one of them is available. During a rolling update the old pods stay ready while the
/// new ones start; counting them would call the new version serving too early.
pub fn observe_merged(d: &Deployment) -> mergedown::DeploymentState {
    let ann = d
        .spec
        .as_ref()
        .and_then(|s| s.template.metadata.as_ref())
        .and_then(|m| m.annotations.clone())
        .unwrap_or_default();
    let replicas = d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
    let st = d.status.clone().unwrap_or_default();
    let updated = st.updated_replicas.unwrap_or(0);
    let available = st.available_replicas.unwrap_or(0);
    let current = st.observed_generation.unwrap_or(0) >= d.metadata.generation.unwrap_or(0)
        && updated == st.replicas.unwrap_or(0)
        && available >= 1;
    mergedown::DeploymentState {
        output: ann
            .get(resources::ANNOTATION_MERGED_OUTPUT)
            .cloned()
            .unwrap_or_default(),
        version: ann
            .get(resources::ANNOTATION_ADAPTER_VERSION)
            .cloned()
            .unwrap_or_default(),
        replicas,
        ready_replicas: if current { available.min(updated) } else { 0 },
        serving_replicas: st.ready_replicas.unwrap_or(0),
    }
}

/// Field managers of merge-down writes (one per call site).
const FM_MERGED: &str = "mole-operator/adapter-merged";

async fn delete_ignoring_absent<K>(api: &Api<K>, name: &str) -> Result<()>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.delete(name, &DeleteParams::background()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

async fn create_ignoring_existing(api: &Api<Job>, job: &Job) -> Result<()> {
    match api.create(&PostParams::default(), job).await {
        Ok(_) => Ok(()),
        // Same inputs, same name: a restarted operator finds the Job instead of duplicating it.
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// The merged ConfigMaps of an adapter (one per output).
async fn merged_config_maps(
    cms: &Api<ConfigMap>,
    pool: &str,
    adapter: &str,
) -> Result<Vec<ConfigMap>> {
    let lp = ListParams::default().labels(&format!(
        "{LABEL_APP_INSTANCE}={pool},{LABEL_APP_COMPONENT}=merged,{LABEL_ADAPTER}={adapter}"
    ));
    Ok(cms.list(&lp).await?.items)
}

/// The output a merged ConfigMap is for.
fn config_output(cm: &ConfigMap) -> Option<&str> {
    cm.metadata
        .annotations
        .as_ref()?
        .get(resources::ANNOTATION_MERGED_OUTPUT)
        .map(String::as_str)
}

#[allow(clippy::too_many_arguments)]
async fn apply_plan(
    ctx: &Context,
    ns: &str,
    pool: &InferencePool,
    adapter: &str,
    spec: &mole_crds::AdapterSpec,
    plan: &mergedown::Plan,
    live: Option<&Deployment>,
    owner: k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference,
) -> Result<()> {
    let pool_name = pool.name_any();
    let jobs: Api<Job> = Api::namespaced(ctx.client.clone(), ns);
    match &plan.job {
        mergedown::JobAction::Create(key) => {
            let job = mergedown::job::merge_job(
                &pool_name,
                &pool.spec,
                adapter,
                spec,
                key,
                owner.clone(),
            );
            create_ignoring_existing(&jobs, &job).await?;
        }
        mergedown::JobAction::DeleteFailed(name) => delete_ignoring_absent(&jobs, name).await?,
        mergedown::JobAction::None => {}
    }
    let name = resources::merged_name(&pool_name, adapter);
    let cms: Api<ConfigMap> = Api::namespaced(ctx.client.clone(), ns);
    let deploys: Api<Deployment> = Api::namespaced(ctx.client.clone(), ns);
    let svcs: Api<Service> = Api::namespaced(ctx.client.clone(), ns);
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(ctx.client.clone(), ns);
    match &plan.deployment {
        mergedown::DeploymentAction::Apply { output, version } => {
            let (cm, d, s, p) = resources::merged_children(
                pool,
                adapter,
                version,
                output,
                spec.serving.replicas,
                owner.clone(),
            );
            // The ConfigMap of this output first: the pod template references it.
            let cm_name = resources::merged_config_name(&pool_name, adapter, output);
            let live_cm = cms.get_opt(&cm_name).await?;
            apply_if_changed(&cms, &cm_name, FM_MERGED, &cm, live_cm.as_ref()).await?;
            apply_if_changed(&deploys, &name, FM_MERGED, &d, live).await?;
            let live_svc = svcs.get_opt(&name).await?;
            apply_if_changed(&svcs, &name, FM_MERGED, &s, live_svc.as_ref()).await?;
            let live_pdb = pdbs.get_opt(&name).await?;
            apply_if_changed(&pdbs, &name, FM_MERGED, &p, live_pdb.as_ref()).await?;
            // ConfigMaps of outputs no history entry references any more (and that neither
            // the Deployment's old pods nor its new ones mount) go.
            let live_output = live.map(|d| observe_merged(d).output);
            let keep = |o: &str| {
                o == output
                    || live_output.as_deref() == Some(o)
                    || plan
                        .status
                        .history
                        .iter()
                        .any(|r| r.merged_output.as_deref() == Some(o))
            };
            for old in merged_config_maps(&cms, &pool_name, adapter).await? {
                if !config_output(&old).is_some_and(keep) {
                    delete_ignoring_absent(&cms, &old.name_any()).await?;
                }
            }
        }
        mergedown::DeploymentAction::Delete => {
            delete_ignoring_absent(&deploys, &name).await?;
            delete_ignoring_absent(&svcs, &name).await?;
            delete_ignoring_absent(&pdbs, &name).await?;
            for old in merged_config_maps(&cms, &pool_name, adapter).await? {
                delete_ignoring_absent(&cms, &old.name_any()).await?;
            }
        }
        mergedown::DeploymentAction::Keep => {}
    }
    if let Some(job) =
        mergedown::job::cleanup_job(&pool_name, &pool.spec, adapter, &plan.cleanup, owner)
    {
        create_ignoring_existing(&jobs, &job).await?;
    }
    Ok(())
}

async fn cleanup(adapter: &Adapter, ctx: &Context) -> Result<Action> {
    let ns = adapter.namespace().unwrap_or_default();
    let name = adapter.name_any();
    let pools: Api<InferencePool> = Api::namespaced(ctx.client.clone(), &ns);
    // Leaving the ledger takes it out of the pool's WorkerConfig (and the id stays burnt).
    release_id(&pools, &adapter.spec.pool, &name).await?;
    // Without the pool there are no pods to unload it from.
    if let Some(pool) = pools.get_opt(&adapter.spec.pool).await? {
        let token = operator_token(&ctx.client, &pool).await?;
        for pod in ready_pods(&ctx.client, &ns, &adapter.spec.pool).await? {
            if let Err(e) = ctx.pods.unload(&pod, &token, &name).await {
                tracing::warn!(error = %e, "unload request failed; the config change unloads it");
            }
        }
    }
    ctx.event(
        &adapter.object_ref(&()),
        false,
        reason::UNREGISTERED,
        "Unregister",
        format!("removed from pool {}", adapter.spec.pool),
    )
    .await;
    Ok(Action::await_change())
}

/// Error policy: invalid specs wait for a change; transient errors back off per object.
pub fn error_policy(adapter: Arc<Adapter>, err: &Error, ctx: Arc<Context>) -> Action {
    super::reconcile::error_policy(CONTROLLER, adapter.as_ref(), err, &ctx)
}

#[cfg(test)]
mod tests {
    use super::*;
    use mole_crds::{LoraAdapterInfo, Residency};

    fn report(entries: &[(&str, &str, bool)]) -> LoraAdaptersResponse {
        LoraAdaptersResponse {
            object: "list".into(),
            base_model: "b".into(),
            data: entries
                .iter()
                .map(|(n, v, loaded)| LoraAdapterInfo {
                    name: n.to_string(),
                    version: v.to_string(),
                    lora_id: 1,
                    residency: Residency::Gpu,
                    loaded: *loaded,
                    rank: 8,
                    bytes: 1,
                    requests: 0,
                    running: 0,
                    error: None,
                })
                .collect(),
        }
    }

    fn deployment(generation: i64, status: serde_json::Value) -> Deployment {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "vl-calendar", "generation": generation},
            "spec": {"replicas": 2, "selector": {}, "template": {"metadata": {"annotations": {
                "mole.dev/merged-output": "merged/calendar/v2-x", "mole.dev/adapter-version": "v2"}}}},
            "status": status,
        }))
        .unwrap()
    }

    #[test]
    fn merged_pods_count_only_when_the_new_template_is_rolled_out() {
        use serde_json::json;
        let ready = |d: &Deployment| observe_merged(d).ready_replicas;
        // The controller has not seen generation 3 yet: the counts are the old template's.
        let stale = deployment(
            3,
            json!({"observedGeneration": 2, "replicas": 2, "updatedReplicas": 2, "readyReplicas": 2, "availableReplicas": 2}),
        );
        assert_eq!(ready(&stale), 0);
        // Rolling: old pods ready, one new pod not available yet.
        let rolling = deployment(
            3,
            json!({"observedGeneration": 3, "replicas": 3, "updatedReplicas": 1, "readyReplicas": 2, "availableReplicas": 2}),
        );
        assert_eq!(ready(&rolling), 0);
        // Every pod updated, none available.
        let starting = deployment(
            3,
            json!({"observedGeneration": 3, "replicas": 2, "updatedReplicas": 2, "readyReplicas": 0, "availableReplicas": 0}),
        );
        assert_eq!(ready(&starting), 0);
        let done = deployment(
            3,
            json!({"observedGeneration": 3, "replicas": 2, "updatedReplicas": 2, "readyReplicas": 2, "availableReplicas": 2}),
        );
        let st = observe_merged(&done);
        assert_eq!(st.ready_replicas, 2);
        assert_eq!(st.output, "merged/calendar/v2-x");
        assert_eq!(st.version, "v2");
    }

    #[test]
    fn refusals_that_depend_on_other_objects_are_retried() {
        assert_eq!(
            invalid_action(reason::POOL_NOT_FOUND),
            Action::requeue(RECHECK_OTHERS)
        );
        assert_eq!(
            invalid_action(reason::DUPLICATE_LABEL),
            Action::requeue(RECHECK_OTHERS)
        );
        assert_eq!(invalid_action(reason::INVALID_SPEC), Action::await_change());
    }

    #[test]
    fn ready_needs_every_pod_on_the_exact_version() {
        let both = vec![
            report(&[("cal", "v2", true)]),
            report(&[("cal", "v2", true)]),
        ];
        assert_eq!(loaded_everywhere(&both, "cal", "v2"), (true, 2, None));
        let one_old = vec![
            report(&[("cal", "v2", true)]),
            report(&[("cal", "v1", true)]),
        ];
        assert!(!loaded_everywhere(&one_old, "cal", "v2").0);
        let loading = vec![report(&[("cal", "v2", false)])];
        assert!(!loaded_everywhere(&loading, "cal", "v2").0);
        assert!(!loaded_everywhere(&[], "cal", "v2").0, "no pod, not ready");
        let mut bad = report(&[("cal", "v2", false)]);
        bad.data[0].error = Some("rank 128 over limit 64".into());
        assert_eq!(
            loaded_everywhere(&[bad], "cal", "v2").2.as_deref(),
            Some("rank 128 over limit 64")
        );
    }
}
