//! Observe: the pool and sibling adapters validation compares against, then what serves the
//! adapter: every ready dynamic pod's report, the merge Job of the desired inputs and the
//! merged Deployment.

use std::borrow::Borrow;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use kube::{Api, ResourceExt};
use mole_crds::{Adapter, InferencePool, LoraAdaptersResponse};

use crate::controller::context::Context;
use crate::controller::pods::{pod_problem, PodProblem};
use crate::error::Result;
use crate::mergedown;
use crate::resources;

/// What validation needs: the adapter's pool (None: not found) and every Adapter of the
/// namespace (label clashes), both read from the controllers' stores: no API call, whatever
/// the number of Adapters.
pub(super) async fn pool_and_siblings(
    adapter: &Adapter,
    ctx: &Context,
) -> Result<(Option<InferencePool>, Vec<Arc<Adapter>>)> {
    ctx.stores.ready().await?;
    let ns = adapter.namespace().unwrap_or_default();
    Ok((
        ctx.stores.pool(&ns, &adapter.spec.pool),
        ctx.stores.adapters_shared(&ns),
    ))
}

/// What serves the adapter now.
pub(super) struct Observed {
    /// Ready dynamic pods of the pool.
    pub pods: usize,
    /// Pods that report the desired version loaded.
    pub loaded: usize,
    /// Why pods could not be asked.
    pub unreachable: Vec<String>,
    /// The first reason a pod gave for not loading the desired version.
    pub load_error: Option<String>,
    /// What a pod that loaded the desired version found worth a look (another base name
    /// whose shapes fit).
    pub load_warning: Option<String>,
    /// The live merged Deployment `<pool>-<adapter>`.
    pub merged: Option<Deployment>,
    /// Why one of the merged Deployment's pods cannot become ready by itself, when one cannot.
    pub merged_problem: Option<PodProblem>,
    /// This adapter's cumulative counters in each pod that reports it (dynamic and merged),
    /// by pod name.
    pub counters: std::collections::BTreeMap<String, crate::fleet::traffic::Counters>,
    /// The ready dynamic pods that hold it loaded (any version).
    pub holding: Vec<String>,
    /// This adapter's cumulative counters per version, summed over the pods (dynamic and
    /// merged): what the canary analysis compares.
    pub versions: std::collections::BTreeMap<String, crate::fleet::traffic::Counters>,
    /// What the merge-down planner reads.
    pub planner: mergedown::Observed,
}

/// Asks every ready dynamic pod what it serves and reads the merge Job and merged Deployment.
pub(super) async fn observe(
    adapter: &Adapter,
    pool: &InferencePool,
    lora_id: u32,
    ctx: &Context,
    now: DateTime<Utc>,
) -> Result<Observed> {
    let ns = adapter.namespace().unwrap_or_default();
    let name = adapter.name_any();
    // The pool's pods as this round read them (one reading shared by its Adapters).
    let token = ctx.pod_index.token(&ctx.client, pool).await?;
    let reading = ctx.pod_index.reading(&ctx.client, &ctx.pods, pool).await?;
    let pods = &reading.pods;
    let mut reports = Vec::with_capacity(pods.len());
    let mut unreachable = Vec::new();
    let mut counters = std::collections::BTreeMap::new();
    let mut holding = Vec::new();
    let mut versions = std::collections::BTreeMap::new();
    for (pod, report) in pods.iter().zip(&reading.reports) {
        match report {
            Ok(r) => {
                if let Some(c) = super::traffic::counters_of(r, &name) {
                    counters.insert(pod.name.clone(), c);
                }
                super::traffic::add_versions(&mut versions, r, &name);
                if r.data.iter().any(|a| a.name == name && a.loaded) {
                    holding.push(pod.name.clone());
                }
                // Borrowed from the round's reading: each of a pool's Adapters reads every
                // pod's whole listing, so copies would cost adapters² × pods.
                reports.push(r)
            }
            Err(e) => unreachable.push(e.clone()),
        }
    }
    let (all_loaded, loaded, load_error) = loaded_everywhere(
        &reports,
        &name,
        &adapter.spec.version,
        lora_id,
        &adapter.spec.source.path,
    );
    let load_warning = reports
        .iter()
        .flat_map(|r| r.data.iter())
        .find(|a| a.name == name && a.version == adapter.spec.version && a.warning.is_some())
        .and_then(|a| a.warning.clone());
    let pruned = adapter
        .status
        .as_ref()
        .map(|s| s.pruned_outputs.as_slice())
        .unwrap_or_default();
    let key = mergedown::current_key(
        &pool.spec,
        &name,
        adapter.metadata.uid.as_deref(),
        &adapter.spec,
        pruned,
    );
    // Only a Deployment this adapter owns is its merged one: one of the same name owned by
    // something else (a pool's, after a collision validation could not see) is never
    // rolled or deleted as if it were.
    // The pool's merged Deployments and Jobs as this round read them (shared by its Adapters).
    let children = ctx.pod_index.children(&ctx.client, pool).await?;
    let merged = children
        .deployment(&resources::merged_name(&adapter.spec.pool, &name))
        .filter(|d| owned_by(&d.metadata, adapter))
        .cloned();
    let merged_problem = match &merged {
        Some(d) => {
            let mpods = merged_pods(ctx, &ns, d).await?;
            // The merged pods' traffic is the adapter's too; one that does not answer only
            // leaves its share out of this reading.
            for pod in mpods
                .iter()
                .filter_map(crate::controller::pod_client::ready)
            {
                if let Ok(r) = ctx.pods.adapters(&pod, &token).await {
                    if let Some(c) = super::traffic::counters_of(&r, &name) {
                        counters.insert(pod.name.clone(), c);
                    }
                    super::traffic::add_versions(&mut versions, &r, &name);
                }
            }
            pod_problem(&mpods)
        }
        None => None,
    };
    let job = observe_job(
        ctx,
        &ns,
        &key.job_name,
        children.job(&key.job_name).cloned(),
        "merge Job failed",
    )
    .await?;
    let job_progress = match job {
        mergedown::JobState::Running => job_progress(ctx, &ns, &key.job_name).await,
        _ => None,
    };
    let planner = mergedown::Observed {
        job,
        deployment: merged.as_ref().map(observe_merged),
        dynamic_loaded: all_loaded && unreachable.is_empty(),
        fleet_merged: None,
        idle: false,
        job_progress,
        now,
    };
    Ok(Observed {
        pods: pods.len(),
        loaded,
        unreachable,
        load_error,
        load_warning,
        merged,
        merged_problem,
        counters,
        holding,
        versions,
        planner,
    })
}

/// The pods of a merged Deployment (those its selector picks).
async fn merged_pods(ctx: &Context, ns: &str, d: &Deployment) -> Result<Vec<Pod>> {
    let Some(labels) = d
        .spec
        .as_ref()
        .and_then(|s| s.selector.match_labels.as_ref())
        .filter(|l| !l.is_empty())
    else {
        return Ok(Vec::new());
    };
    let selector: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let lp = ListParams::default().labels(&selector.join(","));
    Ok(Api::<Pod>::namespaced(ctx.client.clone(), ns)
        .list(&lp)
        .await?
        .items)
}

/// Whether the object with `meta` is owned by `adapter` (an owner reference with its uid).
pub(super) fn owned_by(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    adapter: &Adapter,
) -> bool {
    let Some(uid) = adapter.metadata.uid.as_deref() else {
        return false;
    };
    meta.owner_references.iter().flatten().any(|o| o.uid == uid)
}

/// Whether the directory a worker reports (absolute, inside its model root) is `source` (a
/// path relative to the pool's volume): the same last components.
fn same_dir(reported: &str, source: &str) -> bool {
    use std::path::{Component, Path};
    let normal = |p: &str| -> Vec<String> {
        Path::new(p)
            .components()
            .filter_map(|c| match c {
                Component::Normal(s) => Some(s.to_string_lossy().into_owned()),
                _ => None,
            })
            .collect()
    };
    let (r, s) = (normal(reported), normal(source));
    !s.is_empty() && r.ends_with(&s)
}

/// Whether an adapter version is served by a set of pods: at least one pod, and every pod
/// reports it loaded under the adapter's `lora_id` (an entry of the same name and version
/// under another id is a load of an Adapter of the same name deleted before, whose files may
/// not be this one's) from the directory `source` names (a new source under the same version
/// is loaded anew; a pod still on the old one does not serve this spec; workers that report no
/// path are taken at their word). Returns (ready, loaded count, first load error).
pub fn loaded_everywhere(
    reports: &[impl Borrow<LoraAdaptersResponse>],
    name: &str,
    version: &str,
    lora_id: u32,
    source: &str,
) -> (bool, usize, Option<String>) {
    let loaded = reports
        .iter()
        .map(Borrow::<LoraAdaptersResponse>::borrow)
        .filter(|r| {
            r.data.iter().any(|a| {
                a.name == name
                    && a.version == version
                    && a.lora_id == lora_id
                    && a.loaded
                    && a.path.as_deref().is_none_or(|p| same_dir(p, source))
            })
        })
        .count();
    let error = reports
        .iter()
        .map(Borrow::<LoraAdaptersResponse>::borrow)
        .flat_map(|r| r.data.iter())
        .find(|a| a.name == name && a.version == version && a.error.is_some())
        .and_then(|a| a.error.clone());
    (
        !reports.is_empty() && loaded == reports.len(),
        loaded,
        error,
    )
}

/// A running Job's progress from its pod's last log lines (the merge and fetch Jobs log a
/// JSON `progress` line every few seconds): one list of its pods and one read of 20 lines per
/// reconcile while it runs. Best effort: a pod not started yet, or a log that cannot be read,
/// gives None and never fails the reconcile.
pub(super) async fn job_progress(ctx: &Context, ns: &str, name: &str) -> Option<String> {
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
    let lp = ListParams::default().labels(&format!("job-name={name}"));
    let pod = pods
        .list(&lp)
        .await
        .ok()?
        .items
        .into_iter()
        .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
        .find_map(|p| p.metadata.name)?;
    crate::controller::pods::log_progress(&pods, &pod, None).await
}

/// What the cluster shows of the Job `name` (merge or fetch), with the tool's reason when it
/// failed (`fallback` when it left none).
pub(super) async fn observe_job(
    ctx: &Context,
    ns: &str,
    name: &str,
    job: Option<Job>,
    fallback: &str,
) -> Result<mergedown::JobState> {
    let Some(job) = job else {
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
    // `mole-worker merge` and `fetch` write their one-line reason to /dev/termination-log.
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
        uid: job.metadata.uid.clone().unwrap_or_default(),
        reason: message
            .map(|m| m.trim().to_string())
            .or(cond.message)
            .unwrap_or_else(|| fallback.into()),
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
                    path: Some(format!("/models/adapters/{n}/{v}")),
                    residency: Residency::Gpu,
                    loaded: *loaded,
                    rank: 8,
                    bytes: 1,
                    requests: 0,
                    running: 0,
                    error: None,
                    warning: None,
                })
                .collect(),
            traffic: Vec::new(),
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
    fn ready_needs_every_pod_on_the_exact_version() {
        let both = vec![
            report(&[("cal", "v2", true)]),
            report(&[("cal", "v2", true)]),
        ];
        assert_eq!(
            loaded_everywhere(&both, "cal", "v2", 1, "adapters/cal/v2"),
            (true, 2, None)
        );
        let one_old = vec![
            report(&[("cal", "v2", true)]),
            report(&[("cal", "v1", true)]),
        ];
        assert!(!loaded_everywhere(&one_old, "cal", "v2", 1, "adapters/cal/v2").0);
        let loading = vec![report(&[("cal", "v2", false)])];
        assert!(!loaded_everywhere(&loading, "cal", "v2", 1, "adapters/cal/v2").0);
        assert!(
            !loaded_everywhere(
                &[] as &[LoraAdaptersResponse],
                "cal",
                "v2",
                1,
                "adapters/cal/v2"
            )
            .0,
            "no pod, not ready"
        );
        // The same name and version under another id: an Adapter deleted before this one.
        assert_eq!(
            loaded_everywhere(&both, "cal", "v2", 2, "adapters/cal/v2"),
            (false, 0, None)
        );
        let mut bad = report(&[("cal", "v2", false)]);
        bad.data[0].error = Some("rank 128 over limit 64".into());
        assert_eq!(
            loaded_everywhere(&[bad], "cal", "v2", 1, "adapters/cal/v2")
                .2
                .as_deref(),
            Some("rank 128 over limit 64")
        );
    }

    #[test]
    fn ready_needs_every_pod_on_the_source_the_spec_names() {
        let both = vec![report(&[("cal", "v2", true)])];
        let ready = |source: &str| loaded_everywhere(&both, "cal", "v2", 1, source).0;
        assert!(ready("adapters/cal/v2"));
        assert!(
            ready("./adapters/cal/v2/"),
            "the same directory, spelled otherwise"
        );
        // The source moved under the same version: the pods still hold the old files.
        assert!(!ready("adapters/cal/v2-retrained"));
        assert!(!ready("cal"), "a name alone is no directory's tail");
        // A worker that reports no path is taken at its word.
        let mut old = report(&[("cal", "v2", true)]);
        old.data[0].path = None;
        assert!(loaded_everywhere(&[old], "cal", "v2", 1, "anything").0);
    }
}
