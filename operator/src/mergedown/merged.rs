//! The plan of an adapter that should be served by merged pods, phase by phase: what the
//! merge Job does, which output the merged Deployment serves, whether that is the desired
//! version, and the phase, serving mode and conditions that follow.

use chrono::{DateTime, Duration, Utc};
use mole_crds::constants::{condition, reason};
use mole_crds::{AdapterPhase, AdapterStatus, InferencePoolSpec, MergeStatus, ServingMode};
use mole_crds::{AdapterSpec, VersionRecord};

use super::{
    backoff, merged_endpoint, pool_endpoint, remove_condition, set_condition, DeploymentAction,
    JobAction, JobState, MergeKey, Observed, Plan, PlannedEvent, Subject, MAX_MERGE_ATTEMPTS,
};

/// Seconds between looks at a running merge Job.
const POLL_JOB_SECS: i64 = 15;
/// Seconds between looks while the merged pods do not serve the desired version yet.
const POLL_PODS_SECS: i64 = 10;
/// Seconds between looks once the merge was given up: only a spec change (a watch event)
/// or the dynamic pods' state can change anything.
const GAVE_UP_RECHECK_SECS: i64 = 60;

/// What every phase reads: the adapter, what was observed, and the identity of its merge.
struct Inputs<'a> {
    pool_name: &'a str,
    subject: Subject<'a>,
    spec: &'a AdapterSpec,
    obs: &'a Observed,
    key: MergeKey,
    endpoint: String,
}

/// What the merge Job needs this reconcile.
struct JobStep {
    job: JobAction,
    /// Reconcile again after this many seconds.
    requeue: Option<i64>,
}

/// How far the merged Deployment is.
#[derive(Clone, Copy)]
struct Serving {
    /// It has rolled out the desired output and a pod of it is available.
    desired: bool,
    /// Some pod of it answers (any output, old template included).
    any: bool,
}

/// Plans an adapter whose merged pods should serve it (mode `merged`, or `auto` past the
/// gate): the merge Job, the Deployment, and the status that describes them.
pub(super) fn plan_merged(
    pool_name: &str,
    pool: &InferencePoolSpec,
    subject: Subject<'_>,
    obs: &Observed,
    key: MergeKey,
    status: &mut AdapterStatus,
    events: &mut Vec<PlannedEvent>,
) -> Plan {
    let cx = Inputs {
        pool_name,
        subject,
        spec: subject.spec,
        obs,
        key,
        endpoint: merged_endpoint(pool_name, subject.name, subject.namespace),
    };

    // The output to serve: this key's output when it exists (already merged, or a rollback to
    // a version kept in history), else the last good output while the new merge runs.
    let kept = status
        .history
        .iter()
        .position(|r| r.merged_output.as_deref() == Some(cx.key.output.as_str()));
    let (target, step) = match kept {
        Some(idx) => {
            announce_rollback(&cx, idx, events);
            let idle = JobStep {
                job: JobAction::None,
                requeue: None,
            };
            (Some(cx.key.output.clone()), idle)
        }
        None => {
            let step = advance_job(&cx, status, events);
            // While merging, keep serving the last good merged output (never a half-made one).
            let last_good = status.history.iter().find_map(|r| r.merged_output.clone());
            (last_good, step)
        }
    };
    let deployment = deployment_action(&cx, target, status);

    let serving = serving(&cx);
    if serving.desired {
        record_served(&cx, kept, status);
    }
    let this_key = status
        .merge
        .as_ref()
        .filter(|m| m.job.as_deref() == Some(cx.key.job_name.as_str()));
    let failed_reason = this_key.and_then(|m| m.last_failure_reason.clone());
    let gave_up = this_key.is_some_and(|m| m.failures.unwrap_or(0) >= MAX_MERGE_ATTEMPTS);
    let merging = matches!(step.job, JobAction::Create(_)) || obs.job == JobState::Running;
    status.phase = phase(
        serving,
        failed_reason.is_some(),
        obs.dynamic_loaded,
        merging,
    );
    report_serving(&cx, serving, status, events);
    let failure = failed_reason.as_deref().map(|why| Failure { why, gave_up });
    set_conditions(&cx, failure, serving.desired, kept.is_some(), status);

    // The dynamic pods keep the adapter until the merged pods serve it, so promotion never
    // fails a request; afterwards unloading is the pool's choice.
    let load_dynamic = !(serving.desired && pool.merge.unload_from_dynamic);
    Plan {
        load_dynamic,
        merged_endpoint: serving.any.then_some(cx.endpoint),
        job: step.job,
        deployment,
        cleanup: Vec::new(),
        merge_job: None,
        status: AdapterStatus::default(),
        events: Vec::new(),
        requeue_after_secs: step
            .requeue
            .or((!serving.desired).then_some(POLL_PODS_SECS)),
        merged_replicas: None,
    }
}

/// A rollback to a version kept in history is announced once, when the Deployment is switched
/// back (not on every requeue while its pods roll).
fn announce_rollback(cx: &Inputs<'_>, idx: usize, events: &mut Vec<PlannedEvent>) {
    let switching = cx
        .obs
        .deployment
        .as_ref()
        .is_none_or(|d| d.output != cx.key.output);
    if idx != 0 && switching {
        events.push(PlannedEvent {
            warning: false,
            reason: reason::ROLLED_BACK,
            note: format!(
                "switching to version {} from history ({}), no merge needed",
                cx.spec.version, cx.key.output
            ),
        });
    }
}

/// Moves the merge of the desired version on by what its Job shows.
fn advance_job(
    cx: &Inputs<'_>,
    status: &mut AdapterStatus,
    events: &mut Vec<PlannedEvent>,
) -> JobStep {
    match &cx.obs.job {
        JobState::Absent => start_merge(cx, status, events),
        JobState::Running => JobStep {
            job: JobAction::None,
            requeue: Some(POLL_JOB_SECS),
        },
        JobState::Succeeded => {
            record_success(cx, status, events);
            JobStep {
                job: JobAction::None,
                requeue: None,
            }
        }
        JobState::Failed { reason: why, uid } => record_failure(cx, why, uid, status, events),
    }
}

/// No Job: create one, unless the last one of this key failed and its backoff still runs.
fn start_merge(
    cx: &Inputs<'_>,
    status: &mut AdapterStatus,
    events: &mut Vec<PlannedEvent>,
) -> JobStep {
    let key = &cx.key;
    let merge = status.merge.get_or_insert_with(MergeStatus::default);
    let same_key = merge.job.as_deref() == Some(key.job_name.as_str());
    let failures = if same_key {
        merge.failures.unwrap_or(0)
    } else {
        0
    };
    if failures >= MAX_MERGE_ATTEMPTS {
        // Given up on these inputs: no Job until they change (a new key).
        return JobStep {
            job: JobAction::None,
            requeue: Some(GAVE_UP_RECHECK_SECS),
        };
    }
    let wait = retry_wait(merge, failures, cx.obs.now);
    if !same_key {
        *merge = MergeStatus {
            job: Some(key.job_name.clone()),
            output: Some(key.output.clone()),
            ..MergeStatus::default()
        };
    }
    if let Some(d) = wait {
        return JobStep {
            job: JobAction::None,
            requeue: Some(d.num_seconds().max(1)),
        };
    }
    events.push(PlannedEvent {
        warning: false,
        reason: reason::MERGE_STARTED,
        note: format!(
            "merging version {} into {} (Job {})",
            cx.spec.version, key.output, key.job_name
        ),
    });
    JobStep {
        job: JobAction::Create(key.clone()),
        requeue: Some(POLL_JOB_SECS),
    }
}

/// How long a retry after `failures` failures still has to wait (None: retry now).
fn retry_wait(merge: &MergeStatus, failures: u32, now: DateTime<Utc>) -> Option<Duration> {
    if failures == 0 {
        return None;
    }
    let last = merge
        .last_failure_at
        .as_deref()
        .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
        .map(|t| t.with_timezone(&Utc));
    last.map(|t| (t + backoff(failures)) - now)
        .filter(|d| *d > Duration::zero())
}

/// The Job succeeded: its output heads the history.
fn record_success(cx: &Inputs<'_>, status: &mut AdapterStatus, events: &mut Vec<PlannedEvent>) {
    let (key, spec, now) = (&cx.key, cx.spec, cx.obs.now);
    let merge = status.merge.get_or_insert_with(MergeStatus::default);
    merge.job = Some(key.job_name.clone());
    merge.output = Some(key.output.clone());
    merge.completed_at = Some(now.to_rfc3339());
    merge.failures = None;
    merge.last_failure_at = None;
    merge.last_failure_reason = None;
    events.push(PlannedEvent {
        warning: false,
        reason: reason::MERGE_SUCCEEDED,
        note: format!("version {} merged into {}", spec.version, key.output),
    });
    status.history.insert(
        0,
        VersionRecord {
            version: spec.version.clone(),
            source: spec.source.path.clone(),
            lora_id: status.lora_id,
            merged_output: Some(key.output.clone()),
            time: Some(now.to_rfc3339()),
        },
    );
}

/// The Job failed: count it once, keep it through the backoff, then delete it so the retry
/// can take its name.
///
/// The failed Job is the durable record of the failure: deleted at once, a reconcile started
/// by its deletion could read an Adapter from a reflector that has not seen the new count yet,
/// find no Job and retry at once (and write the old count back). Kept, every reconcile finds
/// it, and one reading an older status counts the same Job (its uid) to the same number. It is
/// deleted only by a reconcile whose status already counted it, and the stores never go back
/// behind what a reconcile read. Its pod's logs stay readable through the backoff, too.
fn record_failure(
    cx: &Inputs<'_>,
    why: &str,
    uid: &str,
    status: &mut AdapterStatus,
    events: &mut Vec<PlannedEvent>,
) -> JobStep {
    let key = &cx.key;
    let merge = status.merge.get_or_insert_with(MergeStatus::default);
    if merge.job.as_deref() != Some(key.job_name.as_str()) {
        merge.failures = None;
        merge.failed_job_uid = None;
    }
    merge.job = Some(key.job_name.clone());
    merge.output = Some(key.output.clone());
    if merge.failed_job_uid.as_deref() != Some(uid) {
        let failures = merge.failures.unwrap_or(0) + 1;
        merge.failures = Some(failures);
        merge.failed_job_uid = Some(uid.to_string());
        merge.last_failure_at = Some(cx.obs.now.to_rfc3339());
        merge.last_failure_reason = Some(why.to_string());
        events.push(failure_event(cx, failures, why));
    }
    let failures = merge.failures.unwrap_or(0);
    if failures >= MAX_MERGE_ATTEMPTS {
        // Given up: the Job stays for its TTL (its logs tell why), nothing is retried.
        return JobStep {
            job: JobAction::None,
            requeue: Some(GAVE_UP_RECHECK_SECS),
        };
    }
    match retry_wait(merge, failures, cx.obs.now) {
        Some(wait) => JobStep {
            job: JobAction::None,
            requeue: Some(wait.num_seconds().max(1)),
        },
        // Its deletion wakes the controller (it owns the Job), which then creates the retry.
        None => JobStep {
            job: JobAction::DeleteFailed(key.job_name.clone()),
            requeue: Some(1),
        },
    }
}

/// `MergeFailed`, or `MergeGaveUp` at the last attempt.
fn failure_event(cx: &Inputs<'_>, failures: u32, why: &str) -> PlannedEvent {
    if failures >= MAX_MERGE_ATTEMPTS {
        return PlannedEvent {
            warning: true,
            reason: reason::MERGE_GAVE_UP,
            note: format!(
                "merge of version {} failed {failures} times; not retried until the version, \
                 source or merge settings change: {why}",
                cx.spec.version
            ),
        };
    }
    PlannedEvent {
        warning: true,
        reason: reason::MERGE_FAILED,
        note: format!(
            "merge of version {} failed (attempt {failures} of {MAX_MERGE_ATTEMPTS}, retry in \
             {}s): {why}",
            cx.spec.version,
            backoff(failures).num_seconds()
        ),
    }
}

/// The merged Deployment serves `target` at the version history records for it.
fn deployment_action(
    cx: &Inputs<'_>,
    target: Option<String>,
    status: &AdapterStatus,
) -> DeploymentAction {
    let Some(output) = target else {
        return DeploymentAction::Keep;
    };
    let version = status
        .history
        .iter()
        .find(|r| r.merged_output.as_deref() == Some(output.as_str()))
        .map(|r| r.version.clone())
        .unwrap_or_else(|| cx.spec.version.clone());
    DeploymentAction::Apply { output, version }
}

fn serving(cx: &Inputs<'_>) -> Serving {
    let d = cx.obs.deployment.as_ref();
    Serving {
        desired: d.is_some_and(|d| d.serves(&cx.key.output)),
        any: d.is_some_and(|d| d.replicas > 0 && d.serving_replicas >= 1 && !d.output.is_empty()),
    }
}

/// The merged pods serve the desired output: its history entry moves to the head, stamped
/// with the time it started serving.
fn record_served(cx: &Inputs<'_>, kept: Option<usize>, status: &mut AdapterStatus) {
    if let Some(idx) = kept {
        if idx != 0 {
            let rec = status.history.remove(idx);
            status.history.insert(0, rec);
        }
    }
    if let Some(first) = status.history.first_mut() {
        if first.merged_output.as_deref() == Some(cx.key.output.as_str()) && first.time.is_none() {
            first.time = Some(cx.obs.now.to_rfc3339());
        }
    }
}

/// Ready only when the merged pods serve the desired output.
fn phase(serving: Serving, failed: bool, dynamic_loaded: bool, merging: bool) -> AdapterPhase {
    if serving.desired {
        AdapterPhase::Ready
    } else if failed {
        if serving.any || dynamic_loaded {
            AdapterPhase::Degraded
        } else {
            AdapterPhase::Failed
        }
    } else if merging {
        AdapterPhase::Merging
    } else {
        AdapterPhase::Pending
    }
}

/// Who serves the adapter now (merged pods, or the dynamic ones while there are none), and
/// the promotion Event when the merged pods took over the desired version.
fn report_serving(
    cx: &Inputs<'_>,
    serving: Serving,
    status: &mut AdapterStatus,
    events: &mut Vec<PlannedEvent>,
) {
    let (spec, before) = (cx.spec, cx.subject.status);
    if serving.desired {
        let promoted = before.phase != AdapterPhase::Ready
            || before.serving_mode != Some(ServingMode::Merged)
            || before.active_version.as_deref() != Some(spec.version.as_str());
        if promoted {
            events.push(PlannedEvent {
                warning: false,
                reason: crate::reasons::PROMOTED,
                note: format!(
                    "merged pods serve version {} ({}) at {}",
                    spec.version, cx.key.output, cx.endpoint
                ),
            });
        }
        status.serving_mode = Some(ServingMode::Merged);
        status.active_version = Some(spec.version.clone());
        status.endpoint = Some(cx.endpoint.clone());
    } else if serving.any {
        status.serving_mode = Some(ServingMode::Merged);
        status.endpoint = Some(cx.endpoint.clone());
    } else if cx.obs.dynamic_loaded {
        status.serving_mode = Some(ServingMode::Dynamic);
        status.endpoint = Some(pool_endpoint(cx.pool_name, cx.subject.namespace));
    }
}

/// The last failure of the current merge key.
#[derive(Clone, Copy)]
struct Failure<'a> {
    /// The tool's one-line reason.
    why: &'a str,
    /// It failed [`MAX_MERGE_ATTEMPTS`] times: not retried until the inputs change.
    gave_up: bool,
}

/// `Merged`, `Degraded` and `Ready` as the merge and the merged pods stand.
fn set_conditions(
    cx: &Inputs<'_>,
    failure: Option<Failure<'_>>,
    desired_serving: bool,
    kept: bool,
    status: &mut AdapterStatus,
) {
    let (key, gen, now) = (&cx.key, cx.subject.generation, cx.obs.now);
    match (failure, desired_serving) {
        (Some(Failure { why, gave_up }), false) => {
            let (why_reason, merged_msg, retry) = if gave_up {
                (
                    reason::MERGE_GAVE_UP,
                    format!(
                        "gave up after {MAX_MERGE_ATTEMPTS} failed attempts; change the version, \
                         source or merge settings to retry: {why}"
                    ),
                    "; not retried until the version, source or merge settings change",
                )
            } else {
                (reason::MERGE_FAILED, why.to_string(), "")
            };
            set_condition(
                &mut status.conditions,
                condition::MERGED,
                false,
                why_reason,
                &merged_msg,
                gen,
                now,
            );
            set_condition(
                &mut status.conditions,
                condition::DEGRADED,
                true,
                why_reason,
                &format!(
                    "version {} could not be merged; the previous version keeps serving{retry}: \
                     {why}",
                    cx.spec.version
                ),
                gen,
                now,
            );
        }
        _ => {
            remove_condition(&mut status.conditions, condition::DEGRADED);
            let (ok, why, msg) = if desired_serving || kept {
                (
                    true,
                    reason::MERGE_SUCCEEDED,
                    format!("merged into {}", key.output),
                )
            } else {
                (
                    false,
                    reason::MERGE_STARTED,
                    match &cx.obs.job_progress {
                        Some(p) => format!("merge Job {} in progress: {p}", key.job_name),
                        None => format!("merge Job {} in progress", key.job_name),
                    },
                )
            };
            set_condition(
                &mut status.conditions,
                condition::MERGED,
                ok,
                why,
                &msg,
                gen,
                now,
            );
        }
    }
    let (why, msg) = if desired_serving {
        (
            reason::MERGE_SUCCEEDED,
            "the merged pods serve the desired version",
        )
    } else {
        (
            reason::WAITING_FOR_PODS,
            "waiting for the merged pods to serve the desired version",
        )
    };
    set_condition(
        &mut status.conditions,
        condition::READY,
        desired_serving,
        why,
        msg,
        gen,
        now,
    );
}
