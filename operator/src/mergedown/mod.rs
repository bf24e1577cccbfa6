//! Merge-down: the state machine that turns an `Adapter` with `serving.mode: merged` into a merge
//! Job, then a merged Deployment, with versions, rollback by apply, gates and failure handling.
//!
//! [`plan`] is a pure function of the spec, the adapter's status and what was observed in the
//! cluster; it returns the actions to apply and the new status. Keeping it pure lets every
//! transition (first merge, success, version bump, rollback, gate, failure with backoff, mode
//! switch, restart) be table-tested without a cluster.

pub mod job;
mod merged;

use chrono::{DateTime, Duration, Utc};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use mole_crds::constants::{condition, reason};
use mole_crds::{
    AdapterPhase, AdapterSpec, AdapterStatus, InferencePoolSpec, ServingMode, VersionRecord,
};
use sha2::{Digest, Sha256};

/// Kubernetes object names are at most 63 characters (DNS label).
const MAX_NAME: usize = 63;
/// First retry of a failed merge after this many seconds, doubling per failure.
const BACKOFF_BASE_SECS: i64 = 30;
/// The retry delay never exceeds this (no hot loop).
const BACKOFF_CAP_SECS: i64 = 30 * 60;
/// Failed merges of one merge key before the operator gives up on it (`MergeGaveUp`): with
/// the backoff that is 30 s + 1 + 2 + 4 min between the five attempts. A merge that failed
/// that often fails for its inputs (a broken adapter, a base it does not fit), not by chance;
/// new inputs (a new key) start over.
pub const MAX_MERGE_ATTEMPTS: u32 = 5;

/// Identity of one merge: the inputs that determine the merged weights.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MergeKey {
    /// Short content hash of (base model, adapter source, version, merge settings).
    pub hash: String,
    /// `merge-<adapter>-<hash>`, truncated to a valid object name.
    pub job_name: String,
    /// `merged/<adapter>/<version>-<hash>`, relative to the pool's mount path.
    pub output: String,
}

/// Pruned outputs an adapter's status remembers ([`AdapterStatus::pruned_outputs`]): enough
/// for every rollback within the day a finished merge Job is kept, and a bound on the status.
pub const MAX_PRUNED_OUTPUTS: usize = 32;

/// The merge identity of `spec` in round 0 for an adapter without a uid (see [`current_key`]).
pub fn merge_key(pool: &InferencePoolSpec, adapter: &str, spec: &AdapterSpec) -> MergeKey {
    key_of(pool, adapter, spec, None, 0)
}

/// The merge identity of the adapter `adapter` (uid `uid`) for `spec`: the first round whose
/// output is not among `pruned`. Any change of the base model, the adapter's source or
/// version, or its merge settings gives a new hash, so a new Job and a new output directory;
/// so does a new incarnation of the Adapter (a new uid: its predecessor's merge Job is not its
/// merge, and its predecessor's cleanup Job deletes only its predecessor's directories), and
/// a rollback to a version whose output was pruned (the next round: the old Job, kept a day,
/// names a directory that is gone or being deleted).
pub fn current_key(
    pool: &InferencePoolSpec,
    adapter: &str,
    uid: Option<&str>,
    spec: &AdapterSpec,
    pruned: &[String],
) -> MergeKey {
    let mut round = 0;
    loop {
        let key = key_of(pool, adapter, spec, uid, round);
        // `pruned` is bounded, so this ends after at most its length + 1 rounds.
        if !pruned.contains(&key.output) || round as usize > pruned.len() {
            return key;
        }
        round += 1;
    }
}

fn key_of(
    pool: &InferencePoolSpec,
    adapter: &str,
    spec: &AdapterSpec,
    uid: Option<&str>,
    round: u32,
) -> MergeKey {
    let mut identity = serde_json::json!({
        "base": {"name": pool.base_model.name, "path": pool.base_model.path},
        "source": spec.source.path,
        "version": spec.version,
        "safeMerge": spec.merge.safe_merge,
        "dtype": spec.merge.dtype.map(|d| d.as_str()),
    });
    // Only when set, so adapters without one keep their hashes (and merged outputs): new files
    // fetched into the same path under the same version are a new merge.
    if let Some(uri) = &spec.source.uri {
        identity["uri"] = serde_json::json!(uri);
    }
    // Only when set, as `uri`: adapters merged without quantization keep their hashes.
    if let Some(q) = &spec.merge.quantize {
        identity["quantize"] =
            serde_json::json!({"type": q.quant_type.as_str(), "maxDrift": q.max_drift});
    }
    if let Some(uid) = uid {
        identity["adapterUid"] = serde_json::json!(uid);
    }
    if round > 0 {
        identity["round"] = serde_json::json!(round);
    }
    let digest = Sha256::digest(crate::resources::canonical_json(&identity).as_bytes());
    let hash = hex::encode(&digest[..5]);
    let prefix = "merge-";
    let room = MAX_NAME - prefix.len() - 1 - hash.len();
    let short: String = adapter.chars().take(room).collect();
    let short = short.trim_end_matches('-');
    MergeKey {
        job_name: format!("{prefix}{short}-{hash}"),
        output: format!(
            "merged/{adapter}/{}-{hash}",
            sanitize_version(&spec.version)
        ),
        hash,
    }
}

/// Versions become path components: keep them to a safe alphabet.
fn sanitize_version(v: &str) -> String {
    v.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// What the cluster shows of the merge Job named by the current [`MergeKey`].
#[derive(Debug, Clone, PartialEq)]
pub enum JobState {
    /// Not there (never created, deleted, or removed by its TTL).
    Absent,
    /// Created and not finished.
    Running,
    /// Finished successfully.
    Succeeded,
    /// Failed for good (backoffLimit or deadline); `reason` is the tool's termination message.
    Failed {
        /// One-line reason written by `mole-worker merge` to `/dev/termination-log`.
        reason: String,
        /// The Job's uid: a failure is counted once per Job.
        uid: String,
    },
}

/// What the cluster shows of the merged Deployment `<pool>-<adapter>`.
#[derive(Debug, Clone, PartialEq)]
pub struct DeploymentState {
    /// Merged output it serves (from its pod-template annotation).
    pub output: String,
    /// Adapter version it serves.
    pub version: String,
    /// Desired replicas.
    pub replicas: i32,
    /// Available replicas of the current template, 0 while the Deployment rolls (it has not
    /// seen the latest template yet, or old pods remain).
    pub ready_replicas: i32,
    /// Ready replicas of any template: during a roll the old pods still answer behind the
    /// merged Service, so dynamic pods may keep forwarding there.
    pub serving_replicas: i32,
}

impl DeploymentState {
    /// Whether the Deployment has rolled out `output` and at least one of its pods is available.
    fn serves(&self, output: &str) -> bool {
        self.output == output && self.replicas > 0 && self.ready_replicas >= 1
    }
}

/// Everything [`plan`] reads besides the spec and status.
#[derive(Debug, Clone, PartialEq)]
pub struct Observed {
    /// The Job of the current merge key.
    pub job: JobState,
    /// The merged Deployment, when it exists.
    pub deployment: Option<DeploymentState>,
    /// Every ready dynamic pod reports this adapter version loaded.
    pub dynamic_loaded: bool,
    /// For an `auto` adapter of a pool with `merge.traffic`: whether the traffic-driven
    /// policy ([`crate::fleet::merge`]) wants it merged. None: `auto` merges on the accuracy
    /// gate alone, as without that policy.
    pub fleet_merged: Option<bool>,
    /// No request for the pool's `merge.scaleToZero.idleSeconds` (always false without it):
    /// the merged pods may be scaled to zero ([`scale_to_zero`]).
    pub idle: bool,
    /// A running merge Job's last progress line, summarized (`merge: 41.2% (110 of 267
    /// MB)`), read from its pod's log tail; None when it logged none yet or cannot be read.
    pub job_progress: Option<String>,
    /// Clock (injected so the plan stays pure).
    pub now: DateTime<Utc>,
}

/// The adapter being planned.
#[derive(Debug, Clone, Copy)]
pub struct Subject<'a> {
    /// Adapter name.
    pub name: &'a str,
    /// Namespace.
    pub namespace: &'a str,
    /// `metadata.uid` (None only in tests): part of the merge identity.
    pub uid: Option<&'a str>,
    /// `metadata.generation`.
    pub generation: Option<i64>,
    /// Spec.
    pub spec: &'a AdapterSpec,
    /// Current status (default when none).
    pub status: &'a AdapterStatus,
}

/// What to do with the merge Job.
#[derive(Debug, Clone, PartialEq)]
pub enum JobAction {
    /// Nothing.
    None,
    /// Create the Job for this key (same name after a restart: creation is idempotent).
    Create(MergeKey),
    /// Delete the failed Job, counted and past its backoff, so the retry can reuse its name.
    DeleteFailed(String),
}

/// What to do with the merged Deployment/Service/PDB.
#[derive(Debug, Clone, PartialEq)]
pub enum DeploymentAction {
    /// Leave it as it is (or absent).
    Keep,
    /// Apply it serving `output` at `version` (rolling update when it exists).
    Apply {
        /// Merged output directory.
        output: String,
        /// Adapter version.
        version: String,
    },
    /// Remove it (only once dynamic pods serve the adapter).
    Delete,
}

/// A Kubernetes Event to publish.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedEvent {
    /// Warning (true) or Normal.
    pub warning: bool,
    /// Stable reason (`mole_crds::constants::reason`).
    pub reason: &'static str,
    /// Human text.
    pub note: String,
}

/// The result of [`plan`].
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Serve the adapter from the dynamic pods (keep it in the pool's WorkerConfig).
    pub load_dynamic: bool,
    /// Merged endpoint to publish in the pool's WorkerConfig (when merged pods serve it).
    pub merged_endpoint: Option<String>,
    /// Merge Job action.
    pub job: JobAction,
    /// Merged Deployment action.
    pub deployment: DeploymentAction,
    /// Merged outputs that fell out of the history: a cleanup Job deletes them.
    pub cleanup: Vec<String>,
    /// The one merge Job of the adapter this plan keeps (its current key's, when it should
    /// be served merged): any other unfinished merge Job of the adapter is superseded (an
    /// older version's, or any while it is served dynamically) and is deleted.
    pub merge_job: Option<String>,
    /// The new status.
    pub status: AdapterStatus,
    /// Events for the transitions this plan makes.
    pub events: Vec<PlannedEvent>,
    /// Reconcile again after this many seconds (backoff, polling a running Job).
    pub requeue_after_secs: Option<i64>,
    /// Replicas of the merged Deployment when not `serving.replicas`: 0 while scaled to zero.
    pub merged_replicas: Option<i32>,
}

/// Whether the pool's gate keeps this adapter from being merged, with the reason.
pub fn gate(pool: &InferencePoolSpec, spec: &AdapterSpec) -> Option<String> {
    let min = pool.merge.min_accuracy?;
    match spec.evaluation.as_ref().and_then(|e| e.accuracy) {
        Some(acc) if acc >= min => None,
        Some(acc) => Some(format!(
            "spec.evaluation.accuracy {acc} is below the pool's merge.minAccuracy {min}"
        )),
        None => Some(format!(
            "spec.evaluation.accuracy is not set and the pool requires merge.minAccuracy {min}"
        )),
    }
}

/// Merged Service URL of an adapter.
pub fn merged_endpoint(pool: &str, adapter: &str, namespace: &str) -> String {
    format!(
        "http://{pool}-{adapter}.{namespace}.svc:{}",
        mole_crds::constants::SERVICE_PORT
    )
}

/// Backoff before retry number `failures` (1-based): 30 s doubling, capped at 30 min.
pub fn backoff(failures: u32) -> Duration {
    let exp = failures.saturating_sub(1).min(16);
    Duration::seconds((BACKOFF_BASE_SECS << exp).min(BACKOFF_CAP_SECS))
}

/// Plans one reconcile of an adapter's serving mode. Pure: no I/O, no clock.
pub fn plan(
    pool_name: &str,
    pool: &InferencePoolSpec,
    subject: Subject<'_>,
    obs: &Observed,
) -> Plan {
    let spec = subject.spec;
    let mut status = subject.status.clone();
    status.observed_generation = subject.generation;
    let mut events = Vec::new();
    let gated = gate(pool, spec);
    let want_merged = match spec.serving.mode {
        ServingMode::Merged => gated.is_none(),
        // With the pool's traffic policy, `auto` follows its decision (the gate still applies).
        // Without it `auto` merges only when a gate is configured and passed: merging is a
        // cost the operator should not pay for adapters nobody vouched for.
        ServingMode::Auto => match obs.fleet_merged {
            Some(merged) => merged && gated.is_none(),
            None => pool.merge.min_accuracy.is_some() && gated.is_none(),
        },
        ServingMode::Dynamic => false,
    };
    let asked_merged = spec.serving.mode != ServingMode::Dynamic;
    match &gated {
        Some(msg) if asked_merged => {
            let changed = set_condition(
                &mut status.conditions,
                condition::MERGE_GATED,
                true,
                reason::BELOW_MIN_ACCURACY,
                msg,
                subject.generation,
                obs.now,
            );
            if changed {
                events.push(PlannedEvent {
                    warning: true,
                    reason: reason::BELOW_MIN_ACCURACY,
                    note: format!("not merged, served dynamically: {msg}"),
                });
            }
        }
        _ => {
            remove_condition(&mut status.conditions, condition::MERGE_GATED);
        }
    }

    let key = current_key(
        pool,
        subject.name,
        subject.uid,
        spec,
        &subject.status.pruned_outputs,
    );
    let mut plan = if want_merged {
        let mut p = merged::plan_merged(
            pool_name,
            pool,
            subject,
            obs,
            key.clone(),
            &mut status,
            &mut events,
        );
        scale_to_zero(
            pool_name,
            subject,
            obs,
            &key.output,
            &mut p,
            &mut status,
            &mut events,
        );
        p
    } else {
        plan_dynamic(pool_name, subject, obs, &mut status, &mut events)
    };
    let target = match &plan.deployment {
        DeploymentAction::Apply { output, .. } => Some(output.as_str()),
        _ => None,
    };
    plan.cleanup = trim_history(&mut status.history, pool.merge.keep_versions, obs, target);
    remember_pruned(&mut status.pruned_outputs, &plan.cleanup);
    plan.merge_job = want_merged.then_some(key.job_name);
    plan.status = status;
    plan.events = events;
    plan
}

/// Scale to zero of an idle adapter's merged pods (the pool's `merge.scaleToZero`), on top of
/// the merged plan `p`. Idle, the adapter goes back into the dynamic pods first; only once every
/// ready dynamic pod reports it loaded does the Deployment go to 0 replicas and the dynamic pods
/// stop forwarding to it, so no request finds no pod (as a demotion does, but the Deployment,
/// its Service and its merged output stay). Not idle any more, the merged plan scales it back to
/// `serving.replicas`; the dynamic pods hold the adapter and serve it until its pods are ready
/// (the merged plan's `load_dynamic` while they are not). Only a Deployment already at the
/// desired output is parked: a roll or a merge under way goes on.
fn scale_to_zero(
    pool_name: &str,
    subject: Subject<'_>,
    obs: &Observed,
    desired: &str,
    p: &mut Plan,
    status: &mut AdapterStatus,
    events: &mut Vec<PlannedEvent>,
) {
    let Some(d) = &obs.deployment else { return };
    let DeploymentAction::Apply { output, .. } = &p.deployment else {
        return;
    };
    // The last good output while a new version merges is not the desired one: parking it now
    // would only scale it up again for the roll.
    if d.output != *output || output != desired {
        return;
    }
    let parked = d.replicas == 0;
    if !obs.idle {
        if parked {
            events.push(PlannedEvent {
                warning: false,
                reason: crate::reasons::SCALED_FROM_ZERO,
                note: format!(
                    "requests again: merged pods scaled to {}; the dynamic pods serve it until \
                     they are ready",
                    subject.spec.serving.replicas
                ),
            });
        }
        return;
    }
    // Idle: the dynamic pods hold it again before anything else changes.
    p.load_dynamic = true;
    // Parked already, a dynamic pod may lack it (a new pod still loading): it stays parked and
    // the dynamic pods load it; not parked yet, the merged pods wait for the dynamic ones.
    if !obs.dynamic_loaded && !parked {
        return;
    }
    p.merged_replicas = Some(0);
    p.merged_endpoint = None;
    p.requeue_after_secs = None;
    if !parked {
        events.push(PlannedEvent {
            warning: false,
            reason: crate::reasons::SCALED_TO_ZERO,
            note: format!(
                "no request for the pool's merge.scaleToZero.idleSeconds: merged pods ({}) \
                 scaled to 0; the dynamic pods serve version {}",
                d.output, subject.spec.version
            ),
        });
    }
    status.phase = if obs.dynamic_loaded {
        AdapterPhase::Ready
    } else {
        AdapterPhase::Pending
    };
    status.serving_mode = Some(ServingMode::Dynamic);
    status.endpoint = Some(pool_endpoint(pool_name, subject.namespace));
    set_condition(
        &mut status.conditions,
        condition::READY,
        obs.dynamic_loaded,
        crate::reasons::SCALED_TO_ZERO,
        "merged pods scaled to zero while the adapter is idle; the dynamic pods serve it",
        subject.generation,
        obs.now,
    );
}

fn plan_dynamic(
    pool_name: &str,
    subject: Subject<'_>,
    obs: &Observed,
    status: &mut AdapterStatus,
    events: &mut Vec<PlannedEvent>,
) -> Plan {
    let spec = subject.spec;
    // The merged pods keep serving until the dynamic pods report the adapter: a mode switch
    // never drops requests.
    let deployment = match (&obs.deployment, obs.dynamic_loaded) {
        (Some(d), true) => {
            events.push(PlannedEvent {
                warning: false,
                reason: crate::reasons::MERGED_REMOVED,
                note: format!(
                    "dynamic pods serve version {}; merged pods ({}) removed",
                    spec.version, d.output
                ),
            });
            DeploymentAction::Delete
        }
        _ => DeploymentAction::Keep,
    };
    let still_merged = obs.deployment.as_ref().filter(|_| !obs.dynamic_loaded);
    if obs.dynamic_loaded {
        if status.active_version.as_deref() != Some(spec.version.as_str())
            || status.serving_mode != Some(ServingMode::Dynamic)
        {
            events.push(PlannedEvent {
                warning: false,
                reason: reason::LOADED,
                note: format!("version {} serving dynamically", spec.version),
            });
        }
        status.phase = AdapterPhase::Ready;
        status.serving_mode = Some(ServingMode::Dynamic);
        status.active_version = Some(spec.version.clone());
        promote(status, spec, status.lora_id, None, obs.now);
        set_condition(
            &mut status.conditions,
            condition::READY,
            true,
            reason::LOADED,
            "every ready dynamic pod reports the adapter loaded",
            subject.generation,
            obs.now,
        );
    } else {
        status.phase = if still_merged.is_some() {
            AdapterPhase::Ready
        } else {
            AdapterPhase::Pending
        };
        set_condition(
            &mut status.conditions,
            condition::READY,
            still_merged.is_some(),
            reason::WAITING_FOR_PODS,
            "waiting for the dynamic pods to report the adapter loaded",
            subject.generation,
            obs.now,
        );
    }
    remove_condition(&mut status.conditions, condition::DEGRADED);
    status.endpoint = Some(match still_merged {
        Some(_) => merged_endpoint(pool_name, subject.name, subject.namespace),
        None => pool_endpoint(pool_name, subject.namespace),
    });
    Plan {
        load_dynamic: true,
        merged_endpoint: still_merged
            .map(|_| merged_endpoint(pool_name, subject.name, subject.namespace)),
        job: JobAction::None,
        deployment,
        cleanup: Vec::new(),
        merge_job: None,
        status: AdapterStatus::default(),
        events: Vec::new(),
        requeue_after_secs: (!obs.dynamic_loaded).then_some(10),
        merged_replicas: None,
    }
}

fn pool_endpoint(pool: &str, namespace: &str) -> String {
    format!(
        "http://{pool}.{namespace}.svc:{}",
        mole_crds::constants::SERVICE_PORT
    )
}

/// Records a dynamically served version at the head of the history.
fn promote(
    status: &mut AdapterStatus,
    spec: &AdapterSpec,
    lora_id: Option<u32>,
    merged_output: Option<String>,
    now: DateTime<Utc>,
) {
    let same = |r: &VersionRecord| {
        r.version == spec.version
            && r.source == spec.source.path
            && r.merged_output == merged_output
    };
    if status.history.first().is_some_and(same) {
        return;
    }
    status.history.retain(|r| !same(r));
    status.history.insert(
        0,
        VersionRecord {
            version: spec.version.clone(),
            source: spec.source.path.clone(),
            lora_id,
            merged_output,
            time: Some(now.to_rfc3339()),
        },
    );
}

/// Adds the outputs handed to a cleanup Job to the pruned ones, keeping the most recent
/// [`MAX_PRUNED_OUTPUTS`].
fn remember_pruned(pruned: &mut Vec<String>, cleanup: &[String]) {
    for o in cleanup {
        pruned.retain(|p| p != o);
        pruned.push(o.clone());
    }
    let over = pruned.len().saturating_sub(MAX_PRUNED_OUTPUTS);
    pruned.drain(..over);
}

/// Keeps the active entry plus `keep` previous ones; returns merged outputs to delete. Nothing
/// is trimmed while the Deployment rolls to the newest entry's output, and an entry whose
/// output the Deployment still serves, or is being switched to (`target`: a rollback in this
/// same plan), stays, so outputs are cleaned up later instead of being deleted under running
/// pods or forgotten.
fn trim_history(
    history: &mut Vec<VersionRecord>,
    keep: u32,
    obs: &Observed,
    target: Option<&str>,
) -> Vec<String> {
    let limit = 1 + keep as usize;
    if history.len() <= limit {
        return Vec::new();
    }
    // While the merged Deployment rolls to the newest output, its old pods still run (and may
    // restart) on theirs: nothing is trimmed before the roll completed.
    if let (Some(d), Some(head)) = (
        &obs.deployment,
        history.first().and_then(|r| r.merged_output.as_deref()),
    ) {
        if !d.serves(head) {
            return Vec::new();
        }
    }
    let serving = obs.deployment.as_ref().map(|d| d.output.clone());
    let dropped = history.split_off(limit);
    let (still_served, gone): (Vec<_>, Vec<_>) = dropped.into_iter().partition(|r| {
        r.merged_output.is_some()
            && (r.merged_output == serving || r.merged_output.as_deref() == target)
    });
    history.extend(still_served);
    let kept: Vec<_> = history
        .iter()
        .filter_map(|r| r.merged_output.clone())
        .collect();
    gone.into_iter()
        .filter_map(|r| r.merged_output)
        .filter(|o| !kept.contains(o))
        .collect()
}

/// Sets a condition, keeping `lastTransitionTime` when the status did not change. Returns
/// whether the condition changed (status or reason), i.e. whether an Event is warranted.
pub fn set_condition(
    conditions: &mut Vec<Condition>,
    type_: &str,
    ok: bool,
    reason: &str,
    message: &str,
    generation: Option<i64>,
    now: DateTime<Utc>,
) -> bool {
    let status = if ok { "True" } else { "False" }.to_string();
    if let Some(c) = conditions.iter_mut().find(|c| c.type_ == type_) {
        let changed = c.status != status || c.reason != reason;
        if c.status != status {
            c.last_transition_time = Time(to_jiff(now));
        }
        c.status = status;
        c.reason = reason.to_string();
        c.message = message.to_string();
        c.observed_generation = generation;
        return changed;
    }
    conditions.push(Condition {
        type_: type_.to_string(),
        status,
        reason: reason.to_string(),
        message: message.to_string(),
        observed_generation: generation,
        last_transition_time: Time(to_jiff(now)),
    });
    true
}

fn to_jiff(now: DateTime<Utc>) -> k8s_openapi::jiff::Timestamp {
    k8s_openapi::jiff::Timestamp::from_second(now.timestamp()).unwrap_or_default()
}

fn remove_condition(conditions: &mut Vec<Condition>, type_: &str) {
    conditions.retain(|c| c.type_ != type_);
}

#[cfg(test)]
mod tests;

/// The last structured `progress` line (JSON, as the merge Job logs with
/// `MOLE_LOG_FORMAT=json`) of a log tail, as one phrase for a condition message:
/// `quantize: 44.1% (120 of 272 tensors)`. None when the tail has none.
pub fn progress_of(log_tail: &str) -> Option<String> {
    log_tail.lines().rev().find_map(|line| {
        let v: serde_json::Value = serde_json::from_str(line.trim()).ok()?;
        let f = v.get("fields")?;
        if f.get("message")?.as_str()? != "progress" {
            return None;
        }
        let task = f.get("task")?.as_str()?;
        let unit = f.get("unit")?.as_str()?;
        let (done, total) = (f.get("done")?.as_u64()?, f.get("total")?.as_u64()?);
        let percent = f.get("percent")?.as_f64()?;
        Some(if unit == "bytes" {
            let mb = |b: u64| b / 1_000_000;
            format!("{task}: {percent:.1}% ({} of {} MB)", mb(done), mb(total))
        } else {
            format!("{task}: {percent:.1}% ({done} of {total} {unit})")
        })
    })
}
