//! Apply: the merge-down plan carried out — the merge Job (superseded ones deleted), the
//! merged ConfigMap, Deployment, Service and PDB (or their removal), and the cleanup Job of
//! outputs that fell out of the history; and what an adapter leaves behind when its pool goes
//! or it is deleted.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Resource, ResourceExt};
use mole_crds::constants::{LABEL_ADAPTER, LABEL_APP_COMPONENT, LABEL_APP_INSTANCE};
use mole_crds::{Adapter, InferencePool};

use super::observe::{observe_merged, owned_by};
use crate::controller::apply::apply_if_changed;
use crate::controller::context::Context;
use crate::error::Result;
use crate::mergedown::{self, DeploymentAction, JobAction, Plan};
use crate::resources;

/// Field manager of merge-down writes.
const FM_MERGED: &str = "mole-operator/adapter-merged";

/// The adapter's children in its namespace, owned by it.
struct Children<'a> {
    ctx: &'a Context,
    ns: String,
    pool: &'a InferencePool,
    pool_name: String,
    adapter: &'a Adapter,
    name: String,
    owner: OwnerReference,
}

impl Children<'_> {
    fn api<K>(&self) -> Api<K>
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>,
    {
        Api::namespaced(self.ctx.client.clone(), &self.ns)
    }
}

/// Carries out `plan`; `live` is the merged Deployment as observed.
pub(super) async fn apply_plan(
    ctx: &Context,
    adapter: &Adapter,
    pool: &InferencePool,
    plan: &Plan,
    live: Option<&Deployment>,
) -> Result<()> {
    let c = Children {
        ctx,
        ns: adapter.namespace().unwrap_or_default(),
        pool,
        pool_name: pool.name_any(),
        adapter,
        name: adapter.name_any(),
        owner: adapter
            .controller_owner_ref(&())
            .expect("adapters read from the API have a uid"),
    };
    if apply_job(&c, &plan.job).await? {
        ctx.pod_index.children_changed(pool);
    }
    let selector = format!("{LABEL_ADAPTER}={},{LABEL_APP_COMPONENT}=merge", c.name);
    for job in
        delete_unfinished_jobs(ctx, adapter, pool, &selector, plan.merge_job.as_deref()).await?
    {
        ctx.event(
            &adapter.object_ref(&()),
            false,
            crate::reasons::MERGE_SUPERSEDED,
            "Merge",
            format!("deleted the merge Job {job}: its inputs are no longer the adapter's"),
        )
        .await;
    }
    match &plan.deployment {
        DeploymentAction::Apply { output, version } => {
            apply_merged(&c, plan, output, version, live).await?
        }
        DeploymentAction::Delete => {
            delete_merged(&c).await?;
            ctx.pod_index.children_changed(pool);
        }
        DeploymentAction::Keep => {}
    }
    // Owned by the pool: a cleanup Job deleted with the Adapter could stop halfway.
    let cleanup = mergedown::job::cleanup_job(
        &c.pool_name,
        &pool.spec,
        &c.name,
        &plan.cleanup,
        resources::owner(pool),
        &c.ctx.images,
    );
    if let Some(job) = cleanup {
        create_ignoring_existing(&c.api(), &job).await?;
        ctx.pod_index.children_changed(pool);
    }
    Ok(())
}

/// Deletes the adapter's unfinished Jobs among `candidates` other than `keep`, with their
/// pods (background propagation); returns their names. Only Jobs the adapter owns.
async fn delete_unfinished(
    ctx: &Context,
    adapter: &Adapter,
    candidates: Vec<Job>,
    keep: Option<&str>,
) -> Result<Vec<String>> {
    let jobs: Api<Job> =
        Api::namespaced(ctx.client.clone(), &adapter.namespace().unwrap_or_default());
    let owned: Vec<Job> = candidates
        .into_iter()
        .filter(|j| owned_by(&j.metadata, adapter))
        .collect();
    let names = mergedown::job::superseded(&owned, keep);
    for name in &names {
        delete_ignoring_absent(&jobs, name).await?;
    }
    Ok(names)
}

/// [`delete_unfinished`] of the Jobs matching `selector` in the pool's reading of its Jobs
/// (a Job this reconcile created made it read afresh): the steady path, one LIST per round.
async fn delete_unfinished_jobs(
    ctx: &Context,
    adapter: &Adapter,
    pool: &InferencePool,
    selector: &str,
    keep: Option<&str>,
) -> Result<Vec<String>> {
    let candidates = ctx
        .pod_index
        .children(&ctx.client, pool)
        .await?
        .jobs_matching(selector);
    let names = delete_unfinished(ctx, adapter, candidates, keep).await?;
    if !names.is_empty() {
        ctx.pod_index.children_changed(pool);
    }
    Ok(names)
}

/// [`delete_unfinished`] of the Jobs matching `selector`, listed now (the pool may be gone).
async fn delete_unfinished_listed(
    ctx: &Context,
    adapter: &Adapter,
    selector: &str,
    keep: Option<&str>,
) -> Result<Vec<String>> {
    let jobs: Api<Job> =
        Api::namespaced(ctx.client.clone(), &adapter.namespace().unwrap_or_default());
    let candidates = jobs
        .list(&ListParams::default().labels(selector))
        .await?
        .items;
    delete_unfinished(ctx, adapter, candidates, keep).await
}

/// Removes what the adapter owns for its pool once the pool is gone: the merged Deployment,
/// Service, PDB and ConfigMaps and the unfinished merge and fetch Jobs. The pool's deletion
/// does not garbage-collect them (their owner is the Adapter, which lives on), so without this
/// the merged pods would keep their GPUs. Returns `Kind/name` of each object removed. Merged
/// outputs stay on the volume and in the history: a pool re-created on the same volume serves
/// them again without a merge.
pub(super) async fn remove_pool_children(ctx: &Context, adapter: &Adapter) -> Result<Vec<String>> {
    let ns = adapter.namespace().unwrap_or_default();
    let name = adapter.name_any();
    let pool = &adapter.spec.pool;
    let mut removed = Vec::new();
    let merged = resources::merged_name(pool, &name);
    if delete_owned(
        &Api::<Deployment>::namespaced(ctx.client.clone(), &ns),
        &merged,
        adapter,
    )
    .await?
    {
        removed.push(format!("Deployment/{merged}"));
    }
    if delete_owned(
        &Api::<Service>::namespaced(ctx.client.clone(), &ns),
        &merged,
        adapter,
    )
    .await?
    {
        removed.push(format!("Service/{merged}"));
    }
    if delete_owned(
        &Api::<PodDisruptionBudget>::namespaced(ctx.client.clone(), &ns),
        &merged,
        adapter,
    )
    .await?
    {
        removed.push(format!("PodDisruptionBudget/{merged}"));
    }
    let cms: Api<ConfigMap> = Api::namespaced(ctx.client.clone(), &ns);
    let lp = ListParams::default().labels(&format!(
        "{LABEL_APP_INSTANCE}={pool},{LABEL_APP_COMPONENT}=merged,{LABEL_ADAPTER}={name}"
    ));
    for cm in cms.list(&lp).await?.items {
        if delete_owned(&cms, &cm.name_any(), adapter).await? {
            removed.push(format!("ConfigMap/{}", cm.name_any()));
        }
    }
    for component in ["merge", "fetch"] {
        let selector = format!(
            "{LABEL_APP_INSTANCE}={pool},{LABEL_APP_COMPONENT}={component},{LABEL_ADAPTER}={name}"
        );
        let jobs = delete_unfinished_listed(ctx, adapter, &selector, None).await?;
        removed.extend(jobs.into_iter().map(|j| format!("Job/{j}")));
    }
    Ok(removed)
}

/// Launches the deleted adapter's last cleanup Job: `mole-worker prune` of every merged output
/// its status names (the history, and the merge in progress). The Job is owned by the pool, so
/// it outlives the Adapter. Unfinished merge Jobs are deleted first, so none writes an output
/// after the prune. Returns the Job's name and the outputs, None when there is nothing to
/// prune.
pub(super) async fn prune_outputs(
    ctx: &Context,
    adapter: &Adapter,
    pool: &InferencePool,
) -> Result<Option<(String, Vec<String>)>> {
    let name = adapter.name_any();
    let selector = format!("{LABEL_ADAPTER}={name},{LABEL_APP_COMPONENT}=merge");
    delete_unfinished_listed(ctx, adapter, &selector, None).await?;
    let status = adapter.status.clone().unwrap_or_default();
    let mut outputs: Vec<String> = status
        .history
        .iter()
        .filter_map(|r| r.merged_output.clone())
        .chain(status.merge.and_then(|m| m.output))
        .collect();
    outputs.sort();
    outputs.dedup();
    let Some(job) = mergedown::job::cleanup_job(
        &pool.name_any(),
        &pool.spec,
        &name,
        &outputs,
        resources::owner(pool),
        &ctx.images,
    ) else {
        return Ok(None);
    };
    let jobs: Api<Job> =
        Api::namespaced(ctx.client.clone(), &adapter.namespace().unwrap_or_default());
    create_ignoring_existing(&jobs, &job).await?;
    Ok(Some((job.name_any(), outputs)))
}

/// Carries out the Job action; whether it wrote.
async fn apply_job(c: &Children<'_>, action: &JobAction) -> Result<bool> {
    let jobs: Api<Job> = c.api();
    match action {
        JobAction::Create(key) => {
            let job = mergedown::job::merge_job(
                &c.pool_name,
                &c.pool.spec,
                &c.name,
                &c.adapter.spec,
                key,
                c.owner.clone(),
                &c.ctx.images,
            );
            create_ignoring_existing(&jobs, &job).await?;
            Ok(true)
        }
        JobAction::DeleteFailed(name) => {
            delete_ignoring_absent(&jobs, name).await?;
            Ok(true)
        }
        JobAction::None => Ok(false),
    }
}

/// The merged pods serving `output` at `version`, and the ConfigMaps of outputs nobody needs
/// any more removed.
async fn apply_merged(
    c: &Children<'_>,
    plan: &Plan,
    output: &str,
    version: &str,
    live: Option<&Deployment>,
) -> Result<()> {
    let name = resources::merged_name(&c.pool_name, &c.name);
    let (cm, d, s, p) = resources::merged_children(
        c.pool,
        &c.name,
        version,
        output,
        plan.merged_replicas
            .unwrap_or(c.adapter.spec.serving.replicas),
        c.owner.clone(),
        resources::PodDefaults {
            port: c.ctx.pods.port(),
            images: &c.ctx.images,
        },
    );
    let cms: Api<ConfigMap> = c.api();
    let svcs: Api<Service> = c.api();
    let pdbs: Api<PodDisruptionBudget> = c.api();
    // The ConfigMap of this output first: the pod template references it.
    let cm_name = resources::merged_config_name(&c.pool_name, &c.name, output);
    let live_cm = cms.get_opt(&cm_name).await?;
    apply_if_changed(&cms, &cm_name, FM_MERGED, &cm, live_cm.as_ref()).await?;
    let applied = apply_if_changed(&c.api::<Deployment>(), &name, FM_MERGED, &d, live).await?;
    // Written (a new resourceVersion): the pool's reading of its Deployments is stale.
    if live.map(|l| &l.metadata.resource_version) != Some(&applied.metadata.resource_version) {
        c.ctx.pod_index.children_changed(c.pool);
    }
    let live_svc = svcs.get_opt(&name).await?;
    apply_if_changed(&svcs, &name, FM_MERGED, &s, live_svc.as_ref()).await?;
    let live_pdb = pdbs.get_opt(&name).await?;
    apply_if_changed(&pdbs, &name, FM_MERGED, &p, live_pdb.as_ref()).await?;
    // ConfigMaps of outputs no history entry references any more (and that neither the
    // Deployment's old pods nor its new ones mount) go.
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
    for old in merged_config_maps(c).await? {
        if !config_output(&old).is_some_and(keep) {
            delete_ignoring_absent(&cms, &old.name_any()).await?;
        }
    }
    Ok(())
}

/// The merged Deployment, Service, PDB and every merged ConfigMap removed: only those the
/// adapter owns, so a name shared with another object never deletes that object.
async fn delete_merged(c: &Children<'_>) -> Result<()> {
    let name = resources::merged_name(&c.pool_name, &c.name);
    delete_owned(&c.api::<Deployment>(), &name, c.adapter).await?;
    delete_owned(&c.api::<Service>(), &name, c.adapter).await?;
    delete_owned(&c.api::<PodDisruptionBudget>(), &name, c.adapter).await?;
    let cms: Api<ConfigMap> = c.api();
    for old in merged_config_maps(c).await? {
        delete_ignoring_absent(&cms, &old.name_any()).await?;
    }
    Ok(())
}

/// Deletes `name` when it exists and `adapter` owns it, with the uid as precondition (so a
/// replacement created in between is not deleted either).
async fn delete_owned<K>(api: &Api<K>, name: &str, adapter: &Adapter) -> Result<bool>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let Some(live) = api.get_opt(name).await? else {
        return Ok(false);
    };
    if !owned_by(live.meta(), adapter) {
        tracing::warn!(name, "not deleting an object the adapter does not own");
        return Ok(false);
    }
    let dp = DeleteParams {
        preconditions: Some(kube::api::Preconditions {
            uid: live.meta().uid.clone(),
            resource_version: None,
        }),
        ..DeleteParams::background()
    };
    match api.delete(name, &dp).await {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => Ok(false),
        Err(e) => Err(e.into()),
    }
}

pub(super) async fn delete_ignoring_absent<K>(api: &Api<K>, name: &str) -> Result<()>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.delete(name, &DeleteParams::background()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

pub(super) async fn create_ignoring_existing(api: &Api<Job>, job: &Job) -> Result<()> {
    match api.create(&PostParams::default(), job).await {
        Ok(_) => Ok(()),
        // Same inputs, same name: a restarted operator finds the Job instead of duplicating it.
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// The merged ConfigMaps of the adapter (one per output).
async fn merged_config_maps(c: &Children<'_>) -> Result<Vec<ConfigMap>> {
    let lp = ListParams::default().labels(&format!(
        "{LABEL_APP_INSTANCE}={},{LABEL_APP_COMPONENT}=merged,{LABEL_ADAPTER}={}",
        c.pool_name, c.name
    ));
    Ok(c.api::<ConfigMap>().list(&lp).await?.items)
}

/// The output a merged ConfigMap is for.
fn config_output(cm: &ConfigMap) -> Option<&str> {
    cm.metadata
        .annotations
        .as_ref()?
        .get(resources::ANNOTATION_MERGED_OUTPUT)
        .map(String::as_str)
}
