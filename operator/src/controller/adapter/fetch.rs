//! The fetch step of an Adapter with a `source.uri`: a `fetch-<adapter>-<key>` Job runs
//! `mole-worker fetch` into `source.path` on the pool's volume, and only once it succeeded is
//! the key recorded in `status.fetched`, which is what lets the pool's WorkerConfig list the
//! adapter (`pool/build.rs`). A failure's one-line reason (the tool's termination message)
//! becomes the `Fetched` condition and a `FetchFailed` Event; deleting the failed Job retries.

use std::time::Duration;

use chrono::{DateTime, Utc};
use k8s_openapi::api::batch::v1::Job;
use kube::runtime::controller::Action;
use kube::{Api, Resource, ResourceExt};
use mole_crds::constants::{condition, reason};
use mole_crds::{Adapter, AdapterPhase, AdapterStatus, InferencePool};

use super::{apply, observe, status};
use crate::controller::context::Context;
use crate::error::Result;
use crate::mergedown::{set_condition, JobState};
use crate::resources;

/// How often a running fetch is looked at (the Job's own events wake the controller sooner).
const FETCH_POLL: Duration = Duration::from_secs(15);

/// What the fetch step decided for this reconcile.
#[derive(Debug, PartialEq)]
pub(super) struct Step {
    /// Whether the `Fetched` condition changed (an Event is due).
    pub changed: bool,
    /// The Event's reason and whether it is a warning.
    pub reason: &'static str,
    pub warning: bool,
    /// The condition's message.
    pub message: String,
    /// When to look again.
    pub requeue: Option<Duration>,
}

/// Pure: the status of a fetch in `state` for `key` (with the running Job's last progress
/// line, if any), written into `status`. Progress rewrites the message only: no Event.
pub(super) fn fetch_status(
    adapter: &Adapter,
    key: &str,
    state: &JobState,
    progress: Option<&str>,
    status: &mut AdapterStatus,
    now: DateTime<Utc>,
) -> Step {
    let spec = &adapter.spec;
    let uri = spec.source.uri.as_deref().unwrap_or_default();
    let (ok, why, warning, message, requeue) = match state {
        JobState::Absent | JobState::Running => (
            false,
            reason::FETCHING,
            false,
            match progress {
                Some(p) => format!(
                    "fetching version {} from {uri} into {}, in progress: {p}",
                    spec.version, spec.source.path
                ),
                None => format!(
                    "fetching version {} from {uri} into {}",
                    spec.version, spec.source.path
                ),
            },
            Some(FETCH_POLL),
        ),
        JobState::Succeeded => {
            status.fetched = Some(key.to_string());
            (
                true,
                reason::FETCH_SUCCEEDED,
                false,
                format!(
                    "version {} fetched from {uri} into {}",
                    spec.version, spec.source.path
                ),
                // At once: the next pass carries on with the fetched status.
                Some(Duration::from_secs(1)),
            )
        }
        JobState::Failed { reason: why, .. } => (
            false,
            reason::FETCH_FAILED,
            true,
            format!(
                "version {} could not be fetched from {uri}: {why} (delete the Job {} to retry)",
                spec.version,
                resources::adapter_fetch_job_name(&adapter.name_any(), key)
            ),
            // A failed fetch waits for an edit or for its Job to be deleted (which wakes the
            // controller: it owns the Job).
            None,
        ),
    };
    status.phase = match state {
        JobState::Failed { .. } => AdapterPhase::Failed,
        _ => AdapterPhase::Pending,
    };
    let changed = set_condition(
        &mut status.conditions,
        condition::FETCHED,
        ok,
        why,
        &message,
        adapter.metadata.generation,
        now,
    );
    Step {
        changed,
        reason: why,
        warning,
        message,
        requeue,
    }
}

/// Runs the fetch step: None when the adapter needs none or it is done (carry on serving),
/// else what to do instead of serving this pass.
pub(super) async fn ensure_fetched(
    adapter: &Adapter,
    pool: &InferencePool,
    ctx: &Context,
    lora_id: u32,
    now: DateTime<Utc>,
) -> Result<Option<Action>> {
    let Some(key) = resources::adapter_fetch_key(&adapter.spec) else {
        return Ok(None);
    };
    if adapter.status.as_ref().and_then(|s| s.fetched.as_deref()) == Some(key.as_str()) {
        return Ok(None);
    }
    let ns = adapter.namespace().unwrap_or_default();
    let name = adapter.name_any();
    let job_name = resources::adapter_fetch_job_name(&name, &key);
    let jobs: Api<Job> = Api::namespaced(ctx.client.clone(), &ns);
    let after = adapter
        .status
        .as_ref()
        .and_then(|s| s.fetched_job_uid.as_deref());
    // The pool's reading of its Jobs (this Adapter's own writes below make it read afresh).
    let live = ctx
        .pod_index
        .children(&ctx.client, pool)
        .await?
        .job(&job_name)
        .cloned();
    let (state, uid) = match &live {
        Some(job) if is_current(job, adapter, after) => (
            observe::observe_job(ctx, &ns, &job_name, Some(job.clone()), "fetch Job failed")
                .await?,
            job.metadata.uid.clone(),
        ),
        // A Job of this key from before the fetch now recorded (a rollback within the day the
        // Job is kept, to a version fetched into a path another version overwrote since), or
        // of an Adapter of this name deleted before: its files are not what the path holds.
        Some(_) => {
            apply::delete_ignoring_absent(&jobs, &job_name).await?;
            ctx.pod_index.children_changed(pool);
            (JobState::Absent, None)
        }
        None => (JobState::Absent, None),
    };
    if state == JobState::Absent {
        let owner = adapter
            .controller_owner_ref(&())
            .expect("adapters read from the API have a uid");
        let mut job = resources::adapter_fetch_job(
            &pool.name_any(),
            &pool.spec,
            &name,
            &adapter.spec,
            owner,
            &ctx.images,
        )
        .expect("the adapter has a source.uri");
        job.annotations_mut().insert(
            resources::ANNOTATION_FETCHED_AFTER.to_string(),
            after.unwrap_or_default().to_string(),
        );
        apply::create_ignoring_existing(&jobs, &job).await?;
        ctx.pod_index.children_changed(pool);
    }
    let progress = match state {
        JobState::Running => observe::job_progress(ctx, &ns, &job_name).await,
        _ => None,
    };
    let mut next = status::accepted(adapter, lora_id, now);
    let step = fetch_status(adapter, &key, &state, progress.as_deref(), &mut next, now);
    if state == JobState::Succeeded {
        next.fetched_job_uid = uid;
    }
    if next != adapter.status.clone().unwrap_or_default() {
        status::write_status(adapter, ctx, &next).await?;
    }
    if step.changed {
        ctx.event(
            &adapter.object_ref(&()),
            step.warning,
            step.reason,
            "Fetch",
            step.message,
        )
        .await;
    }
    Ok(Some(match step.requeue {
        Some(d) => Action::requeue(d),
        None => Action::await_change(),
    }))
}

/// Whether the fetch Job `job` writes what the adapter's path should hold now: the
/// adapter's own (not a deleted namesake's) and started after the fetch its status records
/// (`after`, the uid of that fetch's Job).
fn is_current(job: &Job, adapter: &Adapter, after: Option<&str>) -> bool {
    let started_after = job
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(resources::ANNOTATION_FETCHED_AFTER))
        .map(String::as_str)
        .unwrap_or_default();
    observe::owned_by(&job.metadata, adapter) && started_after == after.unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn adapter() -> Adapter {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "mole.dev/v1alpha1", "kind": "Adapter",
            "metadata": {"name": "cal", "namespace": "ml", "generation": 3},
            "spec": {"pool": "vl", "version": "v2",
                     "source": {"path": "adapters/cal/v2", "uri": "hf://org/cal@v2"}}
        }))
        .unwrap()
    }

    fn fetched(s: &AdapterStatus) -> (&str, &str) {
        let c = s.conditions.iter().find(|c| c.type_ == "Fetched").unwrap();
        (c.status.as_str(), c.reason.as_str())
    }

    #[test]
    fn each_job_state_gives_its_condition_and_only_success_records_the_key() {
        let a = adapter();
        let now = Utc.with_ymd_and_hms(2026, 11, 25, 12, 0, 0).unwrap();
        let mut s = AdapterStatus::default();
        let step = fetch_status(&a, "k1", &JobState::Running, None, &mut s, now);
        assert_eq!(fetched(&s), ("False", reason::FETCHING));
        assert!(step.changed && !step.warning);
        assert_eq!(step.requeue, Some(FETCH_POLL));
        assert_eq!(s.fetched, None);
        assert_eq!(s.phase, AdapterPhase::Pending);

        let failed = JobState::Failed {
            uid: "u1".into(),
            reason: "fetch failed (pickle_refused): adapter_model.bin: ...".into(),
        };
        let step = fetch_status(&a, "k1", &failed, None, &mut s, now);
        assert_eq!(fetched(&s), ("False", reason::FETCH_FAILED));
        assert!(step.changed && step.warning);
        assert!(step.message.contains("pickle_refused"), "{}", step.message);
        assert_eq!(step.requeue, None);
        assert_eq!(s.phase, AdapterPhase::Failed);
        assert_eq!(s.fetched, None);
        // The same failure again: no new Event.
        assert!(!fetch_status(&a, "k1", &failed, None, &mut s, now).changed);

        let step = fetch_status(&a, "k1", &JobState::Succeeded, None, &mut s, now);
        assert_eq!(fetched(&s), ("True", reason::FETCH_SUCCEEDED));
        assert_eq!(s.fetched.as_deref(), Some("k1"));
        assert!(step.changed && !step.warning);
    }

    /// A running fetch's last progress line (as `mole-worker fetch` logs it in the Job) is in
    /// the `Fetched` condition's message; a new figure rewrites the message without an Event.
    #[test]
    fn a_running_fetch_shows_its_progress() {
        let a = adapter();
        let now = Utc.with_ymd_and_hms(2026, 11, 25, 12, 0, 0).unwrap();
        let mut s = AdapterStatus::default();
        let line = |done: u64| {
            format!(
                "{{\"timestamp\":\"t\",\"level\":\"INFO\",\"fields\":{{\"message\":\"progress\",\"task\":\"fetch\",\"unit\":\"bytes\",\"done\":{done},\"total\":270000000,\"percent\":{:.1}}}}}\n",
                done as f64 * 100.0 / 270e6
            )
        };
        let first = crate::mergedown::progress_of(&line(100_000_000));
        let step = fetch_status(&a, "k1", &JobState::Running, first.as_deref(), &mut s, now);
        assert!(step.changed);
        let c = s.conditions.iter().find(|c| c.type_ == "Fetched").unwrap();
        assert!(
            c.message
                .ends_with("in progress: fetch: 37.0% (100 of 270 MB)"),
            "{}",
            c.message
        );
        let later = crate::mergedown::progress_of(&line(200_000_000));
        let step = fetch_status(&a, "k1", &JobState::Running, later.as_deref(), &mut s, now);
        assert!(!step.changed, "progress alone is no Event");
        let c = s.conditions.iter().find(|c| c.type_ == "Fetched").unwrap();
        assert!(
            c.message.ends_with("fetch: 74.1% (200 of 270 MB)"),
            "{}",
            c.message
        );
    }
}
