//! Status: what the pool reports, computed from what was observed and applied (pure), then
//! written with server-side apply and announced by Events.

use std::time::Duration;

use chrono::{DateTime, Utc};
use k8s_openapi::api::apps::v1::Deployment;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::{Api, Resource, ResourceExt};
use mole_crds::constants::{condition, reason, LABEL_ADAPTER};
use mole_crds::{
    Adapter, AdapterPhase, InferencePool, InferencePoolStatus, MergedDeploymentStatus, PoolPhase,
};

use super::apply::{Applied, Reloads};
use super::observe::Observed;
use crate::controller::conditions::{mark_failed, mark_invalid, mark_valid};
use crate::controller::context::Context;
use crate::controller::pods;
use crate::error::{Error, FieldError, Result};
use crate::mergedown::set_condition;
use crate::resources;

const FM_STATUS: &str = "mole-operator/pool-status";
/// Removes ids that earlier versions' Adapter controller wrote to the ledger (see
/// [`drop_legacy_ids`]).
const FM_LEDGER_LEGACY: &str = "mole-operator/pool-ledger-legacy";

/// The pool's id ledger as this reconcile writes it with the status.
pub(super) struct Ids {
    /// The ledger settled against the pool's Adapters.
    pub settled: crate::controller::ids::Settled,
    /// The cached resourceVersion the ledger was read from when it was not this operator's
    /// own last write: the status apply then carries it as a precondition, and a cache behind
    /// the API server makes it fail with a conflict (retried from a fresher cache) instead of
    /// giving ids twice.
    pub guard: Option<String>,
}
/// How soon pods that have not accepted the current config are asked again.
pub const RELOAD_RETRY: Duration = Duration::from_secs(5);
/// How often a pool whose pods are all ready is looked at again.
const RECHECK_READY: Duration = Duration::from_secs(300);
/// How often a pool whose pods are not all ready is looked at again.
const RECHECK_PROGRESSING: Duration = Duration::from_secs(15);

/// The status a reconcile ends with.
pub(super) struct Report {
    /// The new status.
    pub status: InferencePoolStatus,
    /// Every desired dynamic pod is ready.
    pub all_ready: bool,
    /// The `Ready` condition's reason (`PoolReady`, `PodsNotReady`, `ScaledToZero`, or why a
    /// pod fails: `PodsFailing`, `ModelDoesNotFit`, `WorkerConfigRefused`).
    pub ready_reason: &'static str,
    /// `Ready` changed status or reason: an Event is warranted.
    pub became: bool,
    /// `<ready>/<desired> dynamic pods ready`, and a failing pod's name and why.
    pub message: String,
    /// The base model's fetch changed state: (warning, reason, message) of its Event.
    pub fetch_event: Option<(bool, &'static str, String)>,
    /// `AdaptersSynced` changed: (warning, reason, message) of its Event.
    pub reload_event: Option<(bool, &'static str, String)>,
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

/// The pool's status so far, for this generation, with this reconcile's id ledger.
fn current(pool: &InferencePool, ids: &Ids) -> InferencePoolStatus {
    let mut status = pool.status.clone().unwrap_or_default();
    status.observed_generation = pool.metadata.generation;
    ids.settled.ledger.write_into(&mut status);
    status
}

/// Records a refused spec: `Valid` and `Ready` false, phase `Failed`, and an Event when the
/// refusal is new. Nothing already running is touched.
pub(super) async fn refuse(
    pool: &InferencePool,
    ctx: &Context,
    ids: &Ids,
    fe: &FieldError,
    now: DateTime<Utc>,
) -> Result<()> {
    let mut status = current(pool, ids);
    let changed = mark_invalid(&mut status.conditions, fe, pool.metadata.generation, now);
    status.phase = PoolPhase::Failed;
    write_status(pool, ctx, ids, &status).await?;
    if changed {
        ctx.event(
            &pool.object_ref(&()),
            true,
            fe.reason,
            "Validate",
            fe.to_string(),
        )
        .await;
    }
    Ok(())
}

/// Records a reconcile of an accepted spec that failed (see `conditions::mark_failed`); an
/// API server's refusal of a child (a 4xx other than a conflict or throttling) also makes the
/// phase `Failed`. Written only when it changes the status.
pub(super) async fn failed(
    pool: &InferencePool,
    ctx: &Context,
    ids: &Ids,
    e: &Error,
    now: DateTime<Utc>,
) -> Result<()> {
    let mut status = current(pool, ids);
    mark_failed(&mut status.conditions, e, pool.metadata.generation, now);
    if e.is_refusal() {
        status.phase = PoolPhase::Failed;
    }
    if status != pool.status.clone().unwrap_or_default() {
        write_status(pool, ctx, ids, &status).await?;
    }
    Ok(())
}

/// The status of an accepted pool: its dynamic pods, merged Deployments, adapter counts and
/// readiness.
pub(super) fn report(
    pool: &InferencePool,
    ids: &Ids,
    obs: &Observed,
    applied: &Applied,
    now: DateTime<Utc>,
) -> Report {
    let ns = pool.namespace().unwrap_or_default();
    let name = pool.name_any();
    let generation = pool.metadata.generation;
    let mut status = current(pool, ids);
    mark_valid(&mut status.conditions, generation, now);
    status.merged = merged_status(&ns, &name, &obs.merged);
    // With an autoscaler the count is whatever it set on the Deployment (its minimum until it
    // has run).
    let desired = pool.spec.dynamic.applied_replicas().unwrap_or_else(|| {
        applied
            .deployment
            .spec
            .as_ref()
            .and_then(|s| s.replicas)
            .unwrap_or(pool.spec.dynamic.replica_range().0)
    });
    // The applied Deployment's status, or the observed one's when nothing was written back.
    let ready = applied
        .deployment
        .status
        .as_ref()
        .or(obs.deployment.as_ref().and_then(|d| d.status.as_ref()))
        .and_then(|s| s.ready_replicas)
        .unwrap_or(0);
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
    // A pool scaled to zero serves nothing: not Ready, though nothing is missing.
    let all_ready = desired > 0 && ready >= desired;
    status.phase = if all_ready {
        PoolPhase::Ready
    } else {
        PoolPhase::Progressing
    };
    let mut message = format!("{ready}/{desired} dynamic pods ready");
    let why = match (&obs.pod_problem, all_ready, desired) {
        (_, true, _) => reason::POOL_READY,
        (_, false, 0) => reason::SCALED_TO_ZERO,
        (Some(p), false, _) => {
            message.push_str(&format!("; {}", p.message));
            p.reason
        }
        (None, false, _) => reason::PODS_NOT_READY,
    };
    let became = set_condition(
        &mut status.conditions,
        condition::READY,
        all_ready,
        why,
        &message,
        generation,
        now,
    );
    let fetch_event = obs.fetch.as_ref().and_then(|f| {
        let source = pool.spec.base_model.source.as_deref().unwrap_or_default();
        let (ok, why, msg) = match (&f.failure, f.done) {
            (Some(line), _) => (
                false,
                reason::FETCH_FAILED,
                format!("a pod could not fetch the base model from {source}: {line}"),
            ),
            (None, true) => (
                true,
                reason::FETCH_SUCCEEDED,
                format!("the base model was fetched from {source}"),
            ),
            (None, false) => (
                false,
                reason::FETCHING,
                match &f.progress {
                    Some(p) => format!("fetching the base model from {source}, in progress: {p}"),
                    None => format!("fetching the base model from {source}"),
                },
            ),
        };
        set_condition(
            &mut status.conditions,
            condition::FETCHED,
            ok,
            why,
            &msg,
            generation,
            now,
        )
        .then_some((why == reason::FETCH_FAILED, why, msg))
    });
    let reload_event = adapters_synced(&mut status.conditions, &applied.reload, generation, now);
    Report {
        status,
        all_ready,
        ready_reason: why,
        became,
        message,
        fetch_event,
        reload_event,
    }
}

/// Sets `AdaptersSynced` from where the ready pods stand with the current config; returns the
/// Event of a change (a Warning when a pod fails, a Normal one when the pool recovers from a
/// failure; a pending kubelet refresh is routine and gets none).
fn adapters_synced(
    conditions: &mut Vec<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition>,
    r: &Reloads,
    generation: Option<i64>,
    now: DateTime<Utc>,
) -> Option<(bool, &'static str, String)> {
    let was_failing = conditions
        .iter()
        .any(|c| c.type_ == condition::ADAPTERS_SYNCED && c.reason == reason::RELOAD_FAILED);
    let (ok, why, msg) = if let Some(first) = r.failed.first() {
        let more = match r.failed.len() {
            1 => String::new(),
            n => format!(" (and {} more pods)", n - 1),
        };
        let retry = r
            .retry_in
            .map(|d| format!("; asked again in {} s", d.as_secs().max(1)))
            .unwrap_or_default();
        (
            false,
            reason::RELOAD_FAILED,
            format!("{first}{more}: the pod keeps serving its previous config{retry}"),
        )
    } else if !r.stale.is_empty() {
        (
            false,
            reason::RELOADING,
            format!(
                "{}/{} ready pods still read an older copy of the config (the kubelet refreshes it within a minute)",
                r.stale.len(),
                r.ready
            ),
        )
    } else if r.ready == 0 {
        (
            true,
            reason::CONFIG_APPLIED,
            "no ready pod yet; pods read the current config when they start".to_string(),
        )
    } else {
        (
            true,
            reason::CONFIG_APPLIED,
            format!("{} ready pods run the current config", r.ready),
        )
    };
    let changed = set_condition(
        conditions,
        condition::ADAPTERS_SYNCED,
        ok,
        why,
        &msg,
        generation,
        now,
    );
    match why {
        reason::RELOAD_FAILED if changed => Some((true, why, msg)),
        reason::CONFIG_APPLIED if was_failing => Some((false, why, msg)),
        _ => None,
    }
}

/// Writes the status when it changed and announces a change of readiness.
pub(super) async fn publish(
    pool: &InferencePool,
    ctx: &Context,
    ids: &Ids,
    report: &Report,
) -> Result<()> {
    if report.status != pool.status.clone().unwrap_or_default() {
        write_status(pool, ctx, ids, &report.status).await?;
    }
    if report.became {
        ctx.event(
            &pool.object_ref(&()),
            pods::is_failure(report.ready_reason),
            report.ready_reason,
            "Reconcile",
            report.message.clone(),
        )
        .await;
    }
    if let Some((warning, why, msg)) = &report.fetch_event {
        ctx.event(&pool.object_ref(&()), *warning, why, "Fetch", msg.clone())
            .await;
    }
    if let Some((warning, why, msg)) = &report.reload_event {
        ctx.event(&pool.object_ref(&()), *warning, why, "Reload", msg.clone())
            .await;
    }
    Ok(())
}

/// When to look again: soon while pods read a stale config file, when the backoff of a pod
/// whose reload failed runs out, rarely once every pod is ready.
pub(super) fn requeue(report: &Report, reload: &Reloads, config_hash: &str) -> Action {
    if !reload.stale.is_empty() {
        tracing::debug!(pods = ?reload.stale, "pods not on config {config_hash} yet");
        return Action::requeue(RELOAD_RETRY);
    }
    let recheck = if report.all_ready {
        RECHECK_READY
    } else {
        RECHECK_PROGRESSING
    };
    Action::requeue(reload.retry_in.map_or(recheck, |r| r.min(recheck)))
}

/// Writes the pool status, id ledger included, with server-side apply: the pool controller is
/// the status's one writer, so the apply needs no read and never conflicts with another writer
/// (with a [`Ids::guard`] it is made on the cached version only). What the API server
/// accepted becomes the ledger the next reconcile starts from; after a failed write, whose
/// outcome is unknown, the next starts from the cache again, guarded.
async fn write_status(
    pool: &InferencePool,
    ctx: &Context,
    ids: &Ids,
    status: &InferencePoolStatus,
) -> Result<()> {
    let ns = pool.namespace().unwrap_or_default();
    let pools: Api<InferencePool> = Api::namespaced(ctx.client.clone(), &ns);
    let key = format!("{ns}/{}", pool.name_any());
    let uid = pool.metadata.uid.clone().unwrap_or_default();
    let mut patch = serde_json::json!({
        "apiVersion": "mole.dev/v1alpha1",
        "kind": "InferencePool",
        "status": status,
    });
    if let Some(rv) = &ids.guard {
        patch["metadata"] = serde_json::json!({ "resourceVersion": rv });
    }
    let written = pools
        .patch_status(
            &pool.name_any(),
            &PatchParams::apply(FM_STATUS).force(),
            &Patch::Apply(&patch),
        )
        .await;
    let written = match written {
        Ok(w) => w,
        Err(e) => {
            ctx.record_ledger(&key, &uid, None);
            return Err(match e {
                kube::Error::Api(ref ae) if ae.code == 409 => Error::Conflict {
                    what: format!(
                        "the id ledger of pool {key} (the cache was behind the API server)"
                    ),
                    source: e,
                },
                e => e.into(),
            });
        }
    };
    ctx.record_ledger(&key, &uid, Some(ids.settled.ledger.clone()));
    drop_legacy_ids(&pools, &written, &ids.settled.ledger).await
}

/// Earlier versions' Adapter controller wrote the ledger with PUTs, which left its entries
/// co-owned by that writer: an apply that omits a released entry does not remove it then,
/// and the deleted Adapter's finalizer would wait for the release forever. Such entries (in the
/// status written but not in the ledger applied) are removed with a JSON patch, each tested for
/// the id it had, once per pool upgraded.
async fn drop_legacy_ids(
    pools: &Api<InferencePool>,
    written: &InferencePool,
    ledger: &crate::controller::ids::Ledger,
) -> Result<()> {
    let Some(status) = &written.status else {
        return Ok(());
    };
    let ops: Vec<serde_json::Value> = status
        .lora_ids
        .iter()
        .filter(|(name, _)| !ledger.ids.contains_key(*name))
        .flat_map(|(name, id)| {
            // JSON pointer escaping of the map key (RFC 6901).
            let path = format!(
                "/status/loraIds/{}",
                name.replace('~', "~0").replace('/', "~1")
            );
            [
                serde_json::json!({"op": "test", "path": path, "value": id}),
                serde_json::json!({"op": "remove", "path": path}),
            ]
        })
        .collect();
    if ops.is_empty() {
        return Ok(());
    }
    let patch: json_patch::Patch = serde_json::from_value(serde_json::Value::Array(ops))?;
    pools
        .patch_status(
            &written.name_any(),
            &PatchParams {
                field_manager: Some(FM_LEDGER_LEGACY.into()),
                ..Default::default()
            },
            &Patch::<()>::Json(patch),
        )
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;
    use serde_json::json;

    /// The report's condition of `type_` (it must be there).
    fn cond<'a>(
        r: &'a Report,
        type_: &str,
    ) -> &'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
        r.status
            .conditions
            .iter()
            .find(|c| c.type_ == type_)
            .unwrap()
    }

    /// No id ledger (what these tests do not look at).
    fn no_ids() -> Ids {
        Ids {
            settled: Default::default(),
            guard: None,
        }
    }

    fn pool() -> InferencePool {
        serde_json::from_value(json!({
            "apiVersion": "mole.dev/v1alpha1", "kind": "InferencePool",
            "metadata": {"name": "vl", "namespace": "ml", "generation": 3},
            "spec": {"baseModel": {"name": "b", "path": "b"}, "storage": {"claimName": "m"},
                     "image": "i", "gpu": {"count": 1}, "dynamic": {"replicas": 2}}
        }))
        .unwrap()
    }

    fn adapter(name: &str, pool: &str, phase: &str) -> Adapter {
        serde_json::from_value(json!({
            "apiVersion": "mole.dev/v1alpha1", "kind": "Adapter",
            "metadata": {"name": name, "namespace": "ml"},
            "spec": {"pool": pool, "version": "v1", "source": {"path": "a"}},
            "status": {"phase": phase}
        }))
        .unwrap()
    }

    fn deployment(ready: i32) -> Deployment {
        serde_json::from_value(json!({"metadata": {"name": "vl-dynamic"},
                                      "status": {"readyReplicas": ready}}))
        .unwrap()
    }

    fn observed(live: Option<Deployment>) -> Observed {
        Observed {
            adapters: vec![
                adapter("a", "vl", "Ready"),
                adapter("b", "vl", "Pending"),
                adapter("c", "other", "Ready"),
            ],
            pods: Vec::new(),
            ready: Default::default(),
            config_map: None,
            deployment: live,
            service: None,
            pdb: None,
            hpa: None,
            merged: Vec::new(),
            fetch: None,
            pod_problem: None,
        }
    }

    fn applied(d: Deployment) -> Applied {
        Applied {
            deployment: d,
            reload: Reloads::default(),
        }
    }

    #[test]
    fn a_pool_scaled_to_zero_or_with_a_failing_pod_is_not_ready_and_says_why() {
        let now = Utc.with_ymd_and_hms(2026, 11, 22, 12, 0, 0).unwrap();
        let mut p = pool();
        let ready = |r: &Report| {
            let c = cond(r, "Ready");
            (c.status.clone(), c.reason.clone(), c.message.clone())
        };
        let mut obs = observed(None);
        obs.pod_problem = Some(pods::PodProblem {
            reason: reason::PODS_FAILING,
            message: "vl-dynamic-1: Unschedulable: 0/4 nodes are available".into(),
        });
        let r = report(&p, &no_ids(), &obs, &applied(deployment(1)), now);
        assert_eq!(
            ready(&r),
            (
                "False".into(),
                reason::PODS_FAILING.into(),
                "1/2 dynamic pods ready; vl-dynamic-1: Unschedulable: 0/4 nodes are available"
                    .into()
            )
        );
        assert_eq!(r.ready_reason, reason::PODS_FAILING);
        p.spec.dynamic.replicas = Some(0);
        let r = report(&p, &no_ids(), &observed(None), &applied(deployment(0)), now);
        assert!(!r.all_ready);
        assert_eq!(ready(&r).1, reason::SCALED_TO_ZERO);
    }

    #[test]
    fn readiness_counts_the_dynamic_pods_and_the_pools_own_adapters() {
        let now = Utc.with_ymd_and_hms(2026, 11, 22, 12, 0, 0).unwrap();
        let p = pool();
        let r = report(&p, &no_ids(), &observed(None), &applied(deployment(1)), now);
        assert_eq!(r.status.phase, PoolPhase::Progressing);
        assert!(!r.all_ready && r.became);
        assert_eq!(r.message, "1/2 dynamic pods ready");
        assert_eq!(r.status.ready_display.as_deref(), Some("1/2"));
        assert_eq!((r.status.adapters.total, r.status.adapters.ready), (2, 1));
        assert_eq!(r.status.observed_generation, Some(3));
        let valid = r.status.conditions.iter().find(|c| c.type_ == "Valid");
        assert_eq!(valid.unwrap().status, "True");
        // The API server returned no status: the observed Deployment's counts.
        let mut bare = deployment(0);
        bare.status = None;
        let r = report(
            &p,
            &no_ids(),
            &observed(Some(deployment(2))),
            &applied(bare),
            now,
        );
        assert_eq!(r.status.phase, PoolPhase::Ready);
        assert!(r.all_ready);
        assert_eq!(
            requeue(&r, &Reloads::default(), "h"),
            Action::requeue(Duration::from_secs(300))
        );
        let stale = Reloads {
            stale: vec!["p".into()],
            ..Default::default()
        };
        assert_eq!(requeue(&r, &stale, "h"), Action::requeue(RELOAD_RETRY));
        // A failed pod is asked again when its backoff runs out, not every 5 s.
        let failed = Reloads {
            retry_in: Some(Duration::from_secs(40)),
            ..Default::default()
        };
        assert_eq!(
            requeue(&r, &failed, "h"),
            Action::requeue(Duration::from_secs(40))
        );
    }

    #[test]
    fn adapters_synced_says_which_pod_refused_the_config_and_announces_changes() {
        use crate::controller::context::ReloadFailure;
        let now = Utc.with_ymd_and_hms(2026, 11, 22, 12, 0, 0).unwrap();
        let synced = |c: &[k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition]| {
            let c = c.iter().find(|c| c.type_ == "AdaptersSynced").unwrap();
            (c.status.clone(), c.reason.clone(), c.message.clone())
        };
        let mut conditions = Vec::new();
        let ok = Reloads {
            ready: 2,
            ..Default::default()
        };
        assert_eq!(adapters_synced(&mut conditions, &ok, None, now), None);
        assert_eq!(
            synced(&conditions),
            (
                "True".into(),
                reason::CONFIG_APPLIED.into(),
                "2 ready pods run the current config".into()
            )
        );
        let stale = Reloads {
            ready: 2,
            stale: vec!["p1".into()],
            ..Default::default()
        };
        assert_eq!(
            adapters_synced(&mut conditions, &stale, None, now),
            None,
            "a late kubelet refresh is routine"
        );
        assert_eq!(synced(&conditions).1, reason::RELOADING);
        let failed = Reloads {
            ready: 2,
            failed: vec![
                ReloadFailure {
                    pod: "p1".into(),
                    code: "config_invalid".into(),
                    message: "/admin/reload answered 422 Unprocessable Entity: bad router".into(),
                },
                ReloadFailure {
                    pod: "p2".into(),
                    code: "pod_unreachable".into(),
                    message: "connection refused".into(),
                },
            ],
            retry_in: Some(Duration::from_secs(40)),
            ..Default::default()
        };
        let msg = "p1 (config_invalid): /admin/reload answered 422 Unprocessable Entity: bad router \
                   (and 1 more pods): the pod keeps serving its previous config; asked again in 40 s";
        assert_eq!(
            adapters_synced(&mut conditions, &failed, None, now),
            Some((true, reason::RELOAD_FAILED, msg.into()))
        );
        assert_eq!(
            synced(&conditions),
            ("False".into(), reason::RELOAD_FAILED.into(), msg.into())
        );
        // Still failing: no second Event.
        assert_eq!(adapters_synced(&mut conditions, &failed, None, now), None);
        // Recovered: a Normal Event.
        assert_eq!(
            adapters_synced(&mut conditions, &ok, None, now),
            Some((
                false,
                reason::CONFIG_APPLIED,
                "2 ready pods run the current config".into()
            ))
        );
    }

    /// While a pod fetches the base model, the `Fetched` condition carries the fetch's last
    /// progress line; a new figure rewrites the message without an Event.
    #[test]
    fn a_running_base_model_fetch_shows_its_progress() {
        let now = Utc.with_ymd_and_hms(2026, 11, 22, 12, 0, 0).unwrap();
        let mut p = pool();
        p.spec.base_model.source = Some("hf://org/m".into());
        let mut obs = observed(None);
        let seen = |percent: &str| super::super::observe::FetchSeen {
            failure: None,
            done: false,
            progress: Some(format!("fetch: {percent}% (1 of 65 GB)")),
        };
        obs.fetch = Some(seen("1.5"));
        let r = report(&p, &no_ids(), &obs, &applied(deployment(0)), now);
        let message = |r: &Report| {
            let c = cond(r, "Fetched");
            (c.reason.clone(), c.message.clone())
        };
        assert_eq!(
            message(&r),
            (
                "Fetching".into(),
                "fetching the base model from hf://org/m, in progress: fetch: 1.5% (1 of 65 GB)"
                    .into()
            )
        );
        assert!(r.fetch_event.is_some());
        p.status = Some(r.status.clone());
        obs.fetch = Some(seen("40.0"));
        let r = report(&p, &no_ids(), &obs, &applied(deployment(0)), now);
        assert!(message(&r).1.ends_with("fetch: 40.0% (1 of 65 GB)"));
        assert!(r.fetch_event.is_none(), "progress alone is no Event");
    }

    #[test]
    fn a_failed_base_model_fetch_is_a_condition_and_one_warning() {
        let now = Utc.with_ymd_and_hms(2026, 11, 22, 12, 0, 0).unwrap();
        let mut p = pool();
        p.spec.base_model.source = Some("hf://org/m".into());
        let line = "fetch failed (not_found): hf://org/m: not found (HTTP 404)";
        let mut obs = observed(None);
        obs.fetch = Some(super::super::observe::FetchSeen {
            failure: Some(line.into()),
            done: false,
            progress: None,
        });
        let r = report(&p, &no_ids(), &obs, &applied(deployment(0)), now);
        let c = cond(&r, "Fetched");
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", "FetchFailed")
        );
        assert!(c.message.ends_with(line), "{}", c.message);
        let (warning, why, _) = r.fetch_event.clone().unwrap();
        assert!(warning);
        assert_eq!(why, "FetchFailed");
        // Seen again: no new Event.
        p.status = Some(r.status.clone());
        assert!(report(&p, &no_ids(), &obs, &applied(deployment(0)), now)
            .fetch_event
            .is_none());
        // Without a fetched source there is no such condition.
        let r = report(
            &pool(),
            &no_ids(),
            &observed(None),
            &applied(deployment(0)),
            now,
        );
        assert!(r.status.conditions.iter().all(|c| c.type_ != "Fetched"));
    }
}
