//! Status: what the adapter reports, computed from the plan and what the pods said (pure),
//! then written with server-side apply and announced by Events.

use std::time::Duration;

use chrono::{DateTime, Utc};
use kube::api::{Patch, PatchParams};
use kube::{Api, Resource, ResourceExt};
use mole_crds::constants::{condition, reason};
use mole_crds::{Adapter, AdapterPhase, AdapterStatus};

use super::observe::Observed;
use crate::controller::conditions::{mark_invalid, mark_valid};
use crate::controller::context::Context;
use crate::controller::pods;
use crate::error::{FieldError, Result};
use crate::mergedown::{set_condition, Plan};

const FM_STATUS: &str = "mole-operator/adapter-status";
/// Requeue when the plan names no time of its own.
const DEFAULT_REQUEUE_SECS: i64 = 60;

/// The adapter's status so far, for this generation.
pub(super) fn current(adapter: &Adapter) -> AdapterStatus {
    let mut status = adapter.status.clone().unwrap_or_default();
    status.observed_generation = adapter.metadata.generation;
    status
}

/// The status of a validated adapter before it is planned: `Valid` true and its id.
pub(super) fn accepted(adapter: &Adapter, lora_id: u32, now: DateTime<Utc>) -> AdapterStatus {
    let mut status = current(adapter);
    mark_valid(&mut status.conditions, adapter.metadata.generation, now);
    status.lora_id = Some(lora_id);
    status
}

/// Records a valid adapter that waits for its pool's controller to give it a lora id: `Valid`
/// true, `Ready` false (`WaitingForLoraId`), phase `Pending` unless a version served before.
/// Written only when it changes the status.
pub(super) async fn waiting_for_id(
    adapter: &Adapter,
    ctx: &Context,
    now: DateTime<Utc>,
) -> Result<()> {
    let mut status = current(adapter);
    let generation = adapter.metadata.generation;
    mark_valid(&mut status.conditions, generation, now);
    set_condition(
        &mut status.conditions,
        condition::READY,
        false,
        reason::WAITING_FOR_LORA_ID,
        &format!(
            "waiting for pool {} to give it a lora id (its controller gives ids in its next reconcile)",
            adapter.spec.pool
        ),
        generation,
        now,
    );
    if status.active_version.is_none() {
        status.phase = AdapterPhase::Pending;
    }
    if status != adapter.status.clone().unwrap_or_default() {
        write_status(adapter, ctx, &status).await?;
    }
    Ok(())
}

/// Records a refused spec: phase `Failed`, `Valid` and `Ready` false, and an Event when the
/// refusal is new.
pub(super) async fn refuse(
    adapter: &Adapter,
    ctx: &Context,
    fe: &FieldError,
    now: DateTime<Utc>,
) -> Result<()> {
    let mut status = current(adapter);
    status.phase = AdapterPhase::Failed;
    let changed = mark_invalid(&mut status.conditions, fe, adapter.metadata.generation, now);
    if status != adapter.status.clone().unwrap_or_default() {
        write_status(adapter, ctx, &status).await?;
    }
    if changed {
        ctx.event(
            &adapter.object_ref(&()),
            true,
            fe.reason,
            "Validate",
            fe.to_string(),
        )
        .await;
    }
    Ok(())
}

/// The status the plan leaves, with `Loaded` as the dynamic pods report it: the plan's
/// serving decision is what the pool's WorkerConfig follows.
pub(super) fn report(
    adapter: &Adapter,
    plan: &Plan,
    obs: &Observed,
    now: DateTime<Utc>,
) -> AdapterStatus {
    let version = &adapter.spec.version;
    let dynamic_loaded = obs.planner.dynamic_loaded;
    let mut status = plan.status.clone();
    status.load_dynamic = Some(plan.load_dynamic);
    status.merged_endpoint = plan.merged_endpoint.clone();
    let pods_msg = {
        let mut m = format!(
            "{}/{} ready dynamic pods serve version {version}",
            obs.loaded, obs.pods
        );
        if !obs.unreachable.is_empty() {
            m.push_str(&format!("; unreachable: {}", obs.unreachable.join("; ")));
        }
        if let Some(w) = &obs.load_warning {
            m.push_str(&format!("; warning: {w}"));
        }
        m
    };
    let (why, msg) = match (&obs.load_error, dynamic_loaded, obs.pods == 0) {
        (_, true, _) => (reason::LOADED, pods_msg),
        (Some(err), _, _) => (
            reason::LOAD_FAILED,
            format!("a pod refused version {version}: {err}"),
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
        adapter.metadata.generation,
        now,
    );
    // Merged pods that cannot start (unschedulable, crash-looping, the worker refusing the
    // model) would otherwise leave `Ready` waiting for them with no word of why.
    if let Some(p) = &obs.merged_problem {
        let waiting = status
            .conditions
            .iter()
            .find(|c| {
                c.type_ == condition::READY
                    && c.status == "False"
                    && (c.reason == reason::WAITING_FOR_PODS || pods::is_failure(&c.reason))
            })
            .map(|c| c.message.clone());
        if let Some(waiting) = waiting {
            let waiting = waiting.split("; merged pod ").next().unwrap_or_default();
            set_condition(
                &mut status.conditions,
                condition::READY,
                false,
                p.reason,
                &format!("{waiting}; merged pod {}", p.message),
                adapter.metadata.generation,
                now,
            );
        }
    }
    if obs.load_error.is_some() && status.phase != AdapterPhase::Ready {
        // Nothing serves this version and a pod says why: that is a failure, not a wait.
        status.phase = if status.active_version.is_some() {
            AdapterPhase::Degraded
        } else {
            AdapterPhase::Failed
        };
    }
    status
}

/// Writes `status` when it changed, publishes the plan's Events and a refused load, and says
/// when to look again.
pub(super) async fn publish(
    adapter: &Adapter,
    ctx: &Context,
    status: &AdapterStatus,
    plan: &Plan,
    load_error: Option<&str>,
) -> Result<Duration> {
    let old = adapter.status.clone().unwrap_or_default();
    if *status != old {
        write_status(adapter, ctx, status).await?;
    }
    let oref = adapter.object_ref(&());
    for ev in &plan.events {
        ctx.event(&oref, ev.warning, ev.reason, "Serve", ev.note.clone())
            .await;
    }
    if let (Some(err), true) = (load_error, status.phase != old.phase) {
        ctx.event(&oref, true, reason::LOAD_FAILED, "Load", err.to_string())
            .await;
    }
    // `Ready` newly says that a merged pod fails: a Warning with the pod and why.
    let ready = |s: &AdapterStatus| {
        s.conditions
            .iter()
            .find(|c| c.type_ == condition::READY)
            .map(|c| (c.reason.clone(), c.message.clone()))
    };
    if let Some((why, msg)) = ready(status) {
        let was = ready(&old).map(|(r, _)| r);
        if pods::is_failure(&why) && was.as_deref() != Some(why.as_str()) {
            ctx.event(&oref, true, &why, "Serve", msg).await;
        }
    }
    let secs = plan
        .requeue_after_secs
        .unwrap_or(DEFAULT_REQUEUE_SECS)
        .clamp(1, 3600) as u64;
    Ok(Duration::from_secs(secs))
}

pub(super) async fn write_status(
    adapter: &Adapter,
    ctx: &Context,
    status: &AdapterStatus,
) -> Result<()> {
    let api: Api<Adapter> =
        Api::namespaced(ctx.client.clone(), &adapter.namespace().unwrap_or_default());
    let patch = serde_json::json!({
        "apiVersion": "mole.dev/v1alpha1",
        "kind": "Adapter",
        "status": status,
    });
    api.patch_status(
        &adapter.name_any(),
        &PatchParams::apply(FM_STATUS).force(),
        &Patch::Apply(&patch),
    )
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mergedown::{DeploymentAction, JobAction, JobState};
    use chrono::TimeZone;
    use serde_json::json;

    fn now() -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 11, 22, 12, 0, 0).unwrap()
    }

    fn adapter() -> Adapter {
        serde_json::from_value(json!({
            "apiVersion": "mole.dev/v1alpha1", "kind": "Adapter",
            "metadata": {"name": "cal", "namespace": "ml", "generation": 2},
            "spec": {"pool": "vl", "version": "v2", "source": {"path": "a"}}
        }))
        .unwrap()
    }

    fn plan(status: AdapterStatus) -> Plan {
        Plan {
            load_dynamic: true,
            merged_endpoint: None,
            job: JobAction::None,
            deployment: DeploymentAction::Keep,
            cleanup: Vec::new(),
            merge_job: None,
            status,
            events: Vec::new(),
            requeue_after_secs: None,
            merged_replicas: None,
        }
    }

    fn observed(pods: usize, loaded: usize, load_error: Option<&str>) -> Observed {
        Observed {
            pods,
            loaded,
            unreachable: Vec::new(),
            load_error: load_error.map(String::from),
            load_warning: None,
            merged: None,
            merged_problem: None,
            counters: Default::default(),
            holding: Vec::new(),
            versions: Default::default(),
            planner: crate::mergedown::Observed {
                job: JobState::Absent,
                deployment: None,
                dynamic_loaded: pods > 0 && loaded == pods,
                fleet_merged: None,
                idle: false,
                job_progress: None,
                now: now(),
            },
        }
    }

    fn loaded(s: &AdapterStatus) -> (String, String, String) {
        let c = s.conditions.iter().find(|c| c.type_ == "Loaded").unwrap();
        (c.status.clone(), c.reason.clone(), c.message.clone())
    }

    #[test]
    fn loaded_says_how_many_pods_serve_and_why_not() {
        let a = adapter();
        let s = report(
            &a,
            &plan(AdapterStatus::default()),
            &observed(2, 2, None),
            now(),
        );
        assert_eq!(
            loaded(&s),
            (
                "True".into(),
                reason::LOADED.into(),
                "2/2 ready dynamic pods serve version v2".into()
            )
        );
        assert_eq!(s.load_dynamic, Some(true));
        // Trained on a base of another name whose shapes fit: loaded, and the message says so.
        let mut warned = observed(2, 2, None);
        warned.load_warning =
            Some("base_model_name_or_path \"/data/my-base\" names another model".into());
        let s = report(&a, &plan(AdapterStatus::default()), &warned, now());
        let (st, why, msg) = loaded(&s);
        assert_eq!((st.as_str(), why.as_str()), ("True", reason::LOADED));
        assert!(
            msg.ends_with(
                "; warning: base_model_name_or_path \"/data/my-base\" names another model"
            ),
            "{msg}"
        );
        let s = report(
            &a,
            &plan(AdapterStatus::default()),
            &observed(0, 0, None),
            now(),
        );
        assert_eq!(loaded(&s).2, "the pool has no ready dynamic pod");
        // A pod refused the version: nothing serves it, so Failed; Degraded when an older
        // version is active.
        let s = report(
            &a,
            &plan(AdapterStatus::default()),
            &observed(1, 0, Some("rank 128 over limit 64")),
            now(),
        );
        assert_eq!(s.phase, AdapterPhase::Failed);
        assert_eq!(loaded(&s).1, reason::LOAD_FAILED);
        let active = AdapterStatus {
            active_version: Some("v1".into()),
            ..Default::default()
        };
        let s = report(&a, &plan(active), &observed(1, 0, Some("bad")), now());
        assert_eq!(s.phase, AdapterPhase::Degraded);
    }

    #[test]
    fn accepted_status_is_valid_and_carries_the_id() {
        let s = accepted(&adapter(), 7, now());
        assert_eq!(s.lora_id, Some(7));
        assert_eq!(s.observed_generation, Some(2));
        let valid = s.conditions.iter().find(|c| c.type_ == "Valid").unwrap();
        assert_eq!(
            (valid.status.as_str(), valid.reason.as_str()),
            ("True", "SpecValid")
        );
    }
}
