//! Table tests of the merge-down state machine: one test per transition of issue 3.

use chrono::{DateTime, TimeZone, Utc};
use mole_crds::{
    AdapterPhase, AdapterSpec, AdapterStatus, InferencePoolSpec, ServingMode, VersionRecord,
};

use super::*;

fn pool() -> InferencePoolSpec {
    serde_yaml::from_str(
        r#"
baseModel: {name: Qwen/Qwen3-VL-8B-Instruct, path: base/qwen3-vl-8b}
storage: {claimName: models}
image: ghcr.io/mole-dev/mole-worker:0.1.0
gpu: {count: 1}
"#,
    )
    .unwrap()
}

fn adapter(version: &str, mode: &str) -> AdapterSpec {
    serde_yaml::from_str(&format!(
        r#"
pool: vl
version: "{version}"
source: {{path: adapters/calendar/{version}}}
serving: {{mode: {mode}}}
"#
    ))
    .unwrap()
}

fn t0() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 11, 22, 12, 0, 0).unwrap()
}

fn obs(job: JobState) -> Observed {
    Observed {
        job,
        deployment: None,
        dynamic_loaded: true,
        fleet_merged: None,
        idle: false,
        job_progress: None,
        now: t0(),
    }
}

fn run(pool: &InferencePoolSpec, spec: &AdapterSpec, status: &AdapterStatus, o: &Observed) -> Plan {
    plan(
        "vl",
        pool,
        Subject {
            name: "calendar",
            namespace: "ml",
            uid: None,
            generation: Some(3),
            spec,
            status,
        },
        o,
    )
}

fn serving(output: &str, version: &str) -> DeploymentState {
    DeploymentState {
        output: output.into(),
        version: version.into(),
        replicas: 1,
        ready_replicas: 1,
        serving_replicas: 1,
    }
}

fn cond<'a>(s: &'a AdapterStatus, t: &str) -> Option<&'a Condition> {
    s.conditions.iter().find(|c| c.type_ == t)
}

/// Runs a merge of `version` to completion and returns the status with the merged pods ready.
fn merged_status(pool: &InferencePoolSpec, version: &str, prior: &AdapterStatus) -> AdapterStatus {
    let spec = adapter(version, "merged");
    let key = merge_key(pool, "calendar", &spec);
    let p = run(pool, &spec, prior, &obs(JobState::Succeeded));
    let mut o = obs(JobState::Succeeded);
    o.deployment = Some(serving(&key.output, version));
    run(pool, &spec, &p.status, &o).status
}

#[test]
fn merge_key_is_deterministic_and_changes_with_every_input() {
    let p = pool();
    let a = adapter("v1", "merged");
    let k1 = merge_key(&p, "calendar", &a);
    assert_eq!(k1, merge_key(&p, "calendar", &a));
    assert!(k1.job_name.starts_with("merge-calendar-"));
    assert_eq!(k1.output, format!("merged/calendar/v1-{}", k1.hash));
    let mut b = a.clone();
    b.version = "v2".into();
    assert_ne!(merge_key(&p, "calendar", &b).hash, k1.hash);
    let mut c = a.clone();
    c.merge.safe_merge = false;
    assert_ne!(merge_key(&p, "calendar", &c).hash, k1.hash);
    let mut q = p.clone();
    q.base_model.path = "base/other".into();
    assert_ne!(merge_key(&q, "calendar", &a).hash, k1.hash);
    let long = "a".repeat(80);
    assert!(merge_key(&p, &long, &a).job_name.len() <= 63);
}

#[test]
fn first_merge_creates_the_job_and_keeps_the_adapter_dynamic() {
    let p = pool();
    let a = adapter("v1", "merged");
    let plan = run(&p, &a, &AdapterStatus::default(), &obs(JobState::Absent));
    let key = merge_key(&p, "calendar", &a);
    assert_eq!(plan.job, JobAction::Create(key.clone()));
    assert_eq!(plan.deployment, DeploymentAction::Keep);
    assert!(
        plan.load_dynamic,
        "dynamic pods serve it until the merged pods are ready"
    );
    assert_eq!(plan.status.phase, AdapterPhase::Merging);
    assert_eq!(
        plan.status.merge.as_ref().unwrap().job.as_deref(),
        Some(key.job_name.as_str())
    );
    assert_eq!(plan.events[0].reason, reason::MERGE_STARTED);
    assert!(plan.requeue_after_secs.is_some());
}

#[test]
fn running_job_is_left_alone() {
    let p = pool();
    let a = adapter("v1", "merged");
    let first = run(&p, &a, &AdapterStatus::default(), &obs(JobState::Absent));
    let plan = run(&p, &a, &first.status, &obs(JobState::Running));
    assert_eq!(plan.job, JobAction::None);
    assert_eq!(plan.status.phase, AdapterPhase::Merging);
    assert!(plan.events.is_empty());
}

/// A running merge's progress, read from its log, is in the `Merged` condition's message.
#[test]
fn a_running_merge_shows_its_progress() {
    let p = pool();
    let a = adapter("v1", "merged");
    let first = run(&p, &a, &AdapterStatus::default(), &obs(JobState::Absent));
    let mut o = obs(JobState::Running);
    let tail = concat!(
        "{\"timestamp\":\"t\",\"level\":\"INFO\",\"fields\":{\"message\":\"progress\",\"task\":\"merge\",\"unit\":\"bytes\",\"done\":10000000,\"total\":269000000,\"percent\":3.7}}\n",
        "{\"timestamp\":\"t\",\"level\":\"INFO\",\"fields\":{\"message\":\"progress\",\"task\":\"quantize\",\"unit\":\"tensors\",\"done\":120,\"total\":272,\"percent\":44.1}}\n",
        "{\"timestamp\":\"t\",\"level\":\"INFO\",\"fields\":{\"message\":\"quantization drift\"}}\n",
        "not json\n",
    );
    o.job_progress = crate::mergedown::progress_of(tail);
    assert_eq!(
        o.job_progress.as_deref(),
        Some("quantize: 44.1% (120 of 272 tensors)"),
        "the last progress line"
    );
    let plan = run(&p, &a, &first.status, &o);
    let merged = plan
        .status
        .conditions
        .iter()
        .find(|c| c.type_ == "Merged")
        .unwrap();
    assert!(
        merged
            .message
            .ends_with("in progress: quantize: 44.1% (120 of 272 tensors)"),
        "{}",
        merged.message
    );
    assert_eq!(
        crate::mergedown::progress_of(&tail.lines().take(1).collect::<String>()).as_deref(),
        Some("merge: 3.7% (10 of 269 MB)")
    );
    assert_eq!(crate::mergedown::progress_of("plain text\n"), None);
}

#[test]
fn success_applies_the_deployment_and_ready_waits_for_its_pods() {
    let p = pool();
    let a = adapter("v1", "merged");
    let key = merge_key(&p, "calendar", &a);
    let plan = run(&p, &a, &AdapterStatus::default(), &obs(JobState::Succeeded));
    assert_eq!(
        plan.deployment,
        DeploymentAction::Apply {
            output: key.output.clone(),
            version: "v1".into()
        }
    );
    assert_eq!(
        plan.status.history[0].merged_output.as_deref(),
        Some(key.output.as_str())
    );
    assert_ne!(plan.status.phase, AdapterPhase::Ready, "pods not ready yet");
    assert!(plan.merged_endpoint.is_none(), "nothing to forward to yet");

    let mut o = obs(JobState::Succeeded);
    o.deployment = Some(serving(&key.output, "v1"));
    let ready = run(&p, &a, &plan.status, &o);
    assert_eq!(ready.status.phase, AdapterPhase::Ready);
    assert_eq!(ready.status.serving_mode, Some(ServingMode::Merged));
    assert_eq!(ready.status.active_version.as_deref(), Some("v1"));
    assert_eq!(
        ready.merged_endpoint.as_deref(),
        Some("http://vl-calendar.ml.svc:8000")
    );
    assert!(
        ready.load_dynamic,
        "unloading from dynamic pods is off by default"
    );
    assert_eq!(
        cond(&ready.status, condition::READY).unwrap().status,
        "True"
    );
}

#[test]
fn pool_setting_unloads_from_dynamic_only_once_merged_pods_serve() {
    let mut p = pool();
    p.merge.unload_from_dynamic = true;
    let a = adapter("v1", "merged");
    let key = merge_key(&p, "calendar", &a);
    let plan = run(&p, &a, &AdapterStatus::default(), &obs(JobState::Succeeded));
    assert!(plan.load_dynamic);
    let mut o = obs(JobState::Succeeded);
    o.deployment = Some(serving(&key.output, "v1"));
    assert!(!run(&p, &a, &plan.status, &o).load_dynamic);
}

#[test]
fn version_bump_merges_while_the_old_pods_keep_serving() {
    let p = pool();
    let v1 = merged_status(&p, "v1", &AdapterStatus::default());
    let k1 = merge_key(&p, "calendar", &adapter("v1", "merged"));
    let a2 = adapter("v2", "merged");
    let mut o = obs(JobState::Absent);
    o.deployment = Some(serving(&k1.output, "v1"));
    let plan = run(&p, &a2, &v1, &o);
    assert!(matches!(plan.job, JobAction::Create(_)));
    assert_eq!(
        plan.deployment,
        DeploymentAction::Apply {
            output: k1.output.clone(),
            version: "v1".into()
        },
        "the Deployment stays on v1 until the v2 Job succeeds"
    );
    assert_eq!(plan.status.phase, AdapterPhase::Merging);
    assert_eq!(plan.status.active_version.as_deref(), Some("v1"));
    assert!(
        plan.merged_endpoint.is_some(),
        "v1 pods keep taking forwarded requests"
    );
}

#[test]
fn rollback_to_a_kept_version_switches_without_a_job() {
    let p = pool();
    let v1 = merged_status(&p, "v1", &AdapterStatus::default());
    let v2 = merged_status(&p, "v2", &v1);
    assert_eq!(v2.history.len(), 2);
    let k1 = merge_key(&p, "calendar", &adapter("v1", "merged"));
    let k2 = merge_key(&p, "calendar", &adapter("v2", "merged"));

    let back = adapter("v1", "merged");
    let mut o = obs(JobState::Absent);
    o.deployment = Some(serving(&k2.output, "v2"));
    let plan = run(&p, &back, &v2, &o);
    assert_eq!(
        plan.job,
        JobAction::None,
        "no merge Job for a version in history"
    );
    assert_eq!(
        plan.deployment,
        DeploymentAction::Apply {
            output: k1.output.clone(),
            version: "v1".into()
        }
    );
    assert!(plan.events.iter().any(|e| e.reason == reason::ROLLED_BACK));

    o.deployment = Some(serving(&k1.output, "v1"));
    let done = run(&p, &back, &plan.status, &o);
    assert_eq!(done.status.phase, AdapterPhase::Ready);
    assert_eq!(done.status.active_version.as_deref(), Some("v1"));
    assert_eq!(done.status.history[0].version, "v1", "active version first");
}

#[test]
fn failure_with_a_previous_version_degrades_backs_off_and_keeps_serving() {
    let p = pool();
    let v1 = merged_status(&p, "v1", &AdapterStatus::default());
    let k1 = merge_key(&p, "calendar", &adapter("v1", "merged"));
    let a2 = adapter("v2", "merged");
    let k2 = merge_key(&p, "calendar", &a2);
    let mut o = obs(JobState::Absent);
    o.deployment = Some(serving(&k1.output, "v1"));
    let started = run(&p, &a2, &v1, &o);

    o.job = JobState::Failed {
        reason: "NaN in model.layers.0.self_attn.q_proj (safe merge)".into(),
        uid: "job-1".into(),
    };
    let failed = run(&p, &a2, &started.status, &o);
    assert_eq!(failed.status.phase, AdapterPhase::Degraded);
    assert_eq!(
        failed.job,
        JobAction::None,
        "the failed Job stays through its backoff"
    );
    assert_eq!(
        failed.deployment,
        DeploymentAction::Apply {
            output: k1.output.clone(),
            version: "v1".into()
        },
        "the last good output keeps serving"
    );
    assert!(
        failed.cleanup.is_empty(),
        "never deletes the last good output"
    );
    let degraded = cond(&failed.status, condition::DEGRADED).unwrap();
    assert!(degraded
        .message
        .contains("NaN in model.layers.0.self_attn.q_proj"));
    assert_eq!(failed.requeue_after_secs, Some(30));
    assert!(failed
        .events
        .iter()
        .any(|e| e.warning && e.reason == reason::MERGE_FAILED));
    // Seen again (by a later pass, or one from an older copy of the status): counted once.
    let again = run(&p, &a2, &failed.status, &o);
    assert_eq!(again.status.merge.as_ref().unwrap().failures, Some(1));
    assert!(again.events.is_empty());
    let stale = run(&p, &a2, &started.status, &o);
    assert_eq!(
        stale.status.merge, failed.status.merge,
        "an older status counts the same Job to the same number"
    );
    assert_eq!(stale.job, JobAction::None);

    // Before the backoff elapses nothing is deleted or created (no hot loop).
    o.now = t0() + Duration::seconds(10);
    let waiting = run(&p, &a2, &failed.status, &o);
    assert_eq!(waiting.job, JobAction::None);
    assert_eq!(waiting.requeue_after_secs, Some(20));
    assert_eq!(waiting.status.phase, AdapterPhase::Degraded);

    // After the backoff the counted Job is deleted, then the same Job name is created again.
    o.now = t0() + Duration::seconds(31);
    let delete = run(&p, &a2, &waiting.status, &o);
    assert_eq!(delete.job, JobAction::DeleteFailed(k2.job_name.clone()));
    o.job = JobState::Absent;
    let retry = run(&p, &a2, &delete.status, &o);
    assert_eq!(retry.job, JobAction::Create(k2.clone()));

    // A second failure (another Job) doubles the wait.
    o.job = JobState::Failed {
        reason: "again".into(),
        uid: "job-2".into(),
    };
    let second = run(&p, &a2, &retry.status, &o);
    assert_eq!(second.status.merge.as_ref().unwrap().failures, Some(2));
    assert_eq!(second.requeue_after_secs, Some(60));
}

#[test]
fn backoff_is_capped() {
    assert_eq!(backoff(1).num_seconds(), 30);
    assert_eq!(backoff(2).num_seconds(), 60);
    assert_eq!(backoff(50).num_seconds(), 1800);
}

#[test]
fn failure_without_anything_serving_is_failed() {
    let p = pool();
    let a = adapter("v1", "merged");
    let mut o = obs(JobState::Failed {
        reason: "shape mismatch".into(),
        uid: "job-1".into(),
    });
    o.dynamic_loaded = false;
    let plan = run(&p, &a, &AdapterStatus::default(), &o);
    assert_eq!(plan.status.phase, AdapterPhase::Failed);
    o.dynamic_loaded = true;
    let plan = run(&p, &a, &AdapterStatus::default(), &o);
    assert_eq!(
        plan.status.phase,
        AdapterPhase::Degraded,
        "dynamic pods still serve it"
    );
}

#[test]
fn gate_keeps_the_adapter_dynamic_with_a_condition() {
    let mut p = pool();
    p.merge.min_accuracy = Some(0.9);
    let mut a = adapter("v1", "merged");
    a.evaluation = Some(mole_crds::Evaluation {
        accuracy: Some(0.8),
    });
    let plan = run(&p, &a, &AdapterStatus::default(), &obs(JobState::Absent));
    assert_eq!(plan.job, JobAction::None);
    assert_eq!(plan.status.serving_mode, Some(ServingMode::Dynamic));
    let gated = cond(&plan.status, condition::MERGE_GATED).unwrap();
    assert_eq!(gated.status, "True");
    assert_eq!(gated.reason, reason::BELOW_MIN_ACCURACY);
    assert!(gated.message.contains("0.8"));
    // The Event is sent once, not on every reconcile.
    let again = run(&p, &a, &plan.status, &obs(JobState::Absent));
    assert!(again
        .events
        .iter()
        .all(|e| e.reason != reason::BELOW_MIN_ACCURACY));

    a.evaluation = Some(mole_crds::Evaluation {
        accuracy: Some(0.95),
    });
    let ok = run(&p, &a, &plan.status, &obs(JobState::Absent));
    assert!(matches!(ok.job, JobAction::Create(_)));
    assert!(cond(&ok.status, condition::MERGE_GATED).is_none());
}

#[test]
fn auto_merges_only_past_a_configured_gate() {
    let mut p = pool();
    let mut a = adapter("v1", "auto");
    assert_eq!(
        run(&p, &a, &AdapterStatus::default(), &obs(JobState::Absent)).job,
        JobAction::None
    );
    p.merge.min_accuracy = Some(0.5);
    a.evaluation = Some(mole_crds::Evaluation {
        accuracy: Some(0.7),
    });
    assert!(matches!(
        run(&p, &a, &AdapterStatus::default(), &obs(JobState::Absent)).job,
        JobAction::Create(_)
    ));
}

#[test]
fn switching_to_dynamic_removes_merged_pods_only_after_dynamic_pods_load_it() {
    let p = pool();
    let v1 = merged_status(&p, "v1", &AdapterStatus::default());
    let k1 = merge_key(&p, "calendar", &adapter("v1", "merged"));
    let a = adapter("v1", "dynamic");
    let mut o = obs(JobState::Absent);
    o.deployment = Some(serving(&k1.output, "v1"));
    o.dynamic_loaded = false;
    let waiting = run(&p, &a, &v1, &o);
    assert_eq!(waiting.deployment, DeploymentAction::Keep);
    assert!(waiting.load_dynamic);
    assert!(
        waiting.merged_endpoint.is_some(),
        "keep forwarding until dynamic pods serve"
    );
    o.dynamic_loaded = true;
    let done = run(&p, &a, &waiting.status, &o);
    assert_eq!(done.deployment, DeploymentAction::Delete);
    assert_eq!(done.status.serving_mode, Some(ServingMode::Dynamic));
    assert_eq!(done.status.phase, AdapterPhase::Ready);
    assert!(done.merged_endpoint.is_none());
}

#[test]
fn history_overflow_schedules_cleanup_of_old_outputs_only() {
    let mut p = pool();
    p.merge.keep_versions = 1;
    let mut st = AdapterStatus::default();
    for v in ["v1", "v2", "v3"] {
        st = merged_status(&p, v, &st);
    }
    let k1 = merge_key(&p, "calendar", &adapter("v1", "merged"));
    assert_eq!(st.history.len(), 2, "active + keepVersions");
    assert_eq!(st.history[0].version, "v3");
    // The cleanup list was produced by the plan that dropped v1.
    let mut st2 = AdapterStatus::default();
    let mut cleaned = Vec::new();
    for v in ["v1", "v2", "v3"] {
        let spec = adapter(v, "merged");
        let key = merge_key(&p, "calendar", &spec);
        let a = run(&p, &spec, &st2, &obs(JobState::Succeeded));
        cleaned.extend(a.cleanup.clone());
        let mut o = obs(JobState::Succeeded);
        o.deployment = Some(serving(&key.output, v));
        let b = run(&p, &spec, &a.status, &o);
        cleaned.extend(b.cleanup.clone());
        st2 = b.status;
    }
    assert_eq!(cleaned, vec![k1.output]);
}

#[test]
fn restart_with_everything_in_place_changes_nothing() {
    let p = pool();
    let st = merged_status(&p, "v1", &AdapterStatus::default());
    let a = adapter("v1", "merged");
    let k = merge_key(&p, "calendar", &a);
    let mut o = obs(JobState::Absent); // the finished Job was garbage-collected by its TTL
    o.deployment = Some(serving(&k.output, "v1"));
    let plan = run(&p, &a, &st, &o);
    assert_eq!(
        plan.job,
        JobAction::None,
        "no duplicate Job after a restart"
    );
    assert!(plan.events.is_empty());
    assert_eq!(plan.status, st, "status is already what it should be");
    assert!(plan.cleanup.is_empty());
}

#[test]
fn dynamic_adapter_records_history_and_ready_when_loaded() {
    let p = pool();
    let a = adapter("v1", "dynamic");
    let mut o = obs(JobState::Absent);
    o.dynamic_loaded = false;
    let pending = run(&p, &a, &AdapterStatus::default(), &o);
    assert_eq!(pending.status.phase, AdapterPhase::Pending);
    o.dynamic_loaded = true;
    let ready = run(&p, &a, &pending.status, &o);
    assert_eq!(ready.status.phase, AdapterPhase::Ready);
    assert_eq!(
        ready.status.history[0],
        VersionRecord {
            version: "v1".into(),
            source: "adapters/calendar/v1".into(),
            lora_id: None,
            merged_output: None,
            time: Some(t0().to_rfc3339()),
        }
    );
}

#[test]
fn nothing_is_trimmed_while_the_deployment_rolls_to_the_newest_output() {
    let mut p = pool();
    p.merge.keep_versions = 0;
    let v1 = merged_status(&p, "v1", &AdapterStatus::default());
    let k1 = merge_key(&p, "calendar", &adapter("v1", "merged"));
    let spec = adapter("v2", "merged");
    let k2 = merge_key(&p, "calendar", &spec);
    // v2's Job succeeded; the Deployment template already points at v2 but its pods roll.
    let mut o = obs(JobState::Succeeded);
    o.deployment = Some(serving(&k1.output, "v1"));
    let switched = run(&p, &spec, &v1, &o);
    let mut rolling = serving(&k2.output, "v2");
    rolling.ready_replicas = 0; // old pods still ready: serving_replicas stays 1
    o.deployment = Some(rolling);
    let mid = run(&p, &spec, &switched.status, &o);
    assert!(
        mid.cleanup.is_empty(),
        "v1's old pods still run on its output"
    );
    assert_ne!(
        mid.status.phase,
        AdapterPhase::Ready,
        "v2 is not serving yet"
    );
    assert!(
        mid.merged_endpoint.is_some(),
        "the old pods still answer behind the merged Service: keep forwarding"
    );
    assert!(mid
        .status
        .history
        .iter()
        .any(|r| r.merged_output.as_deref() == Some(k1.output.as_str())));
    o.deployment = Some(serving(&k2.output, "v2"));
    let done = run(&p, &spec, &mid.status, &o);
    assert_eq!(done.cleanup, vec![k1.output]);
    assert_eq!(done.status.history.len(), 1);
}

#[test]
fn transitions_are_announced_once() {
    let p = pool();
    let v1 = merged_status(&p, "v1", &AdapterStatus::default());
    let v2 = merged_status(&p, "v2", &v1);
    let k1 = merge_key(&p, "calendar", &adapter("v1", "merged"));
    let k2 = merge_key(&p, "calendar", &adapter("v2", "merged"));
    let reasons = |pl: &Plan| pl.events.iter().map(|e| e.reason).collect::<Vec<_>>();

    // Promotion of v1 completed: Promoted, once.
    let spec = adapter("v1", "merged");
    let mut o = obs(JobState::Succeeded);
    let merged = run(&p, &spec, &AdapterStatus::default(), &o);
    assert!(!reasons(&merged).contains(&crate::reasons::PROMOTED));
    o.deployment = Some(serving(&k1.output, "v1"));
    let ready = run(&p, &spec, &merged.status, &o);
    assert!(reasons(&ready).contains(&crate::reasons::PROMOTED));
    assert!(!reasons(&run(&p, &spec, &ready.status, &o)).contains(&crate::reasons::PROMOTED));

    // Rollback to v1 from v2: RolledBack when the Deployment is switched, not while it rolls.
    let mut o = obs(JobState::Absent);
    o.deployment = Some(serving(&k2.output, "v2"));
    let switch = run(&p, &spec, &v2, &o);
    assert!(reasons(&switch).contains(&reason::ROLLED_BACK));
    let mut rolling = serving(&k1.output, "v1");
    rolling.ready_replicas = 0;
    o.deployment = Some(rolling);
    let mid = run(&p, &spec, &switch.status, &o);
    assert!(!reasons(&mid).contains(&reason::ROLLED_BACK));
    o.deployment = Some(serving(&k1.output, "v1"));
    let done = run(&p, &spec, &mid.status, &o);
    assert_eq!(done.status.phase, AdapterPhase::Ready);
    assert!(!reasons(&done).contains(&reason::ROLLED_BACK));

    // Back to dynamic: the merged pods' removal is announced with the delete.
    let dynamic = adapter("v1", "dynamic");
    let gone = run(&p, &dynamic, &done.status, &o);
    assert_eq!(gone.deployment, DeploymentAction::Delete);
    assert!(reasons(&gone).contains(&crate::reasons::MERGED_REMOVED));
    o.deployment = None;
    assert!(reasons(&run(&p, &dynamic, &gone.status, &o)).is_empty());
}

#[test]
fn the_plan_decides_what_the_dynamic_pods_load() {
    let mut p = pool();
    p.merge.unload_from_dynamic = true;
    let st = merged_status(&p, "v1", &AdapterStatus::default());
    let k1 = merge_key(&p, "calendar", &adapter("v1", "merged"));
    let mut o = obs(JobState::Absent);
    o.deployment = Some(serving(&k1.output, "v1"));
    o.dynamic_loaded = false;
    let merged = run(&p, &adapter("v1", "merged"), &st, &o);
    assert!(!merged.load_dynamic);
    // Switched to dynamic while the status still says merged/Ready: load it again, keep
    // forwarding until the dynamic pods report it.
    let back = run(&p, &adapter("v1", "dynamic"), &merged.status, &o);
    assert_eq!(back.status.serving_mode, Some(ServingMode::Merged));
    assert!(
        back.load_dynamic,
        "the dynamic pods must load it or nothing ever changes"
    );
    assert!(back.merged_endpoint.is_some());
    assert_eq!(back.deployment, DeploymentAction::Keep);
}

#[test]
fn a_merge_that_keeps_failing_is_given_up_until_its_inputs_change() {
    let p = pool();
    let v1 = merged_status(&p, "v1", &AdapterStatus::default());
    let k1 = merge_key(&p, "calendar", &adapter("v1", "merged"));
    let a2 = adapter("v2", "merged");
    let k2 = merge_key(&p, "calendar", &a2);
    let mut o = obs(JobState::Absent);
    o.deployment = Some(serving(&k1.output, "v1"));
    let mut status = run(&p, &a2, &v1, &o).status;
    let mut now = t0();
    for attempt in 1..=MAX_MERGE_ATTEMPTS {
        o.job = JobState::Failed {
            reason: format!("merge failed (shape_mismatch): attempt {attempt}"),
            uid: format!("job-{attempt}"),
        };
        o.now = now;
        let failed = run(&p, &a2, &status, &o);
        assert_eq!(failed.job, JobAction::None, "kept through its backoff");
        let last = attempt == MAX_MERGE_ATTEMPTS;
        let reasons: Vec<_> = failed.events.iter().map(|e| e.reason).collect();
        let want = if last {
            reason::MERGE_GAVE_UP
        } else {
            reason::MERGE_FAILED
        };
        assert_eq!(reasons, [want], "attempt {attempt}");
        status = failed.status;
        // After the backoff the Job is deleted and the next attempt created, except after
        // the last.
        now += backoff(attempt) + Duration::seconds(1);
        o.now = now;
        let next = run(&p, &a2, &status, &o);
        assert!(next.events.is_empty(), "announced once");
        status = next.status;
        if last {
            assert_eq!(
                next.job,
                JobAction::None,
                "given up: the Job stays, no new one"
            );
        } else {
            assert_eq!(next.job, JobAction::DeleteFailed(k2.job_name.clone()));
            o.job = JobState::Absent;
            let create = run(&p, &a2, &status, &o);
            assert_eq!(
                create.job,
                JobAction::Create(k2.clone()),
                "attempt {attempt}"
            );
            status = create.status;
        }
    }
    o.job = JobState::Absent; // its TTL removed the last Job
                              // Hours later still nothing: the cap does not start it over.
    o.now = now + Duration::hours(6);
    let later = run(&p, &a2, &status, &o);
    assert_eq!(later.job, JobAction::None);
    assert_eq!(later.status.phase, AdapterPhase::Degraded);
    assert_eq!(
        later.deployment,
        DeploymentAction::Apply {
            output: k1.output.clone(),
            version: "v1".into()
        },
        "v1 keeps serving"
    );
    for t in [condition::MERGED, condition::DEGRADED] {
        let c = cond(&later.status, t).unwrap();
        assert_eq!(c.reason, reason::MERGE_GAVE_UP, "{t}");
        assert!(c.message.contains("attempt 5"), "{t}: {}", c.message);
    }
    assert_eq!(later.requeue_after_secs, Some(60));

    // New inputs (a version bump) start over with a Job of their own.
    let a3 = adapter("v3", "merged");
    let retry = run(&p, &a3, &later.status, &o);
    assert_eq!(retry.job, JobAction::Create(merge_key(&p, "calendar", &a3)));
    assert_eq!(retry.status.merge.as_ref().unwrap().failures, None);
    assert_ne!(
        cond(&retry.status, condition::MERGED).unwrap().reason,
        reason::MERGE_GAVE_UP
    );
}

#[test]
fn the_plan_names_the_one_merge_job_it_keeps() {
    let p = pool();
    let merged = adapter("v2", "merged");
    let plan = run(
        &p,
        &merged,
        &AdapterStatus::default(),
        &obs(JobState::Absent),
    );
    assert_eq!(
        plan.merge_job,
        Some(merge_key(&p, "calendar", &merged).job_name),
        "the current key's Job: any other is superseded"
    );
    let dynamic = adapter("v2", "dynamic");
    let plan = run(
        &p,
        &dynamic,
        &AdapterStatus::default(),
        &obs(JobState::Absent),
    );
    assert_eq!(plan.merge_job, None, "served dynamically: no merge Job");
}

#[test]
fn the_merge_key_names_the_adapters_incarnation_and_skips_pruned_outputs() {
    let p = pool();
    let a = adapter("v1", "merged");
    let base = merge_key(&p, "calendar", &a);
    assert_eq!(current_key(&p, "calendar", None, &a, &[]), base);
    let one = current_key(&p, "calendar", Some("uid-1"), &a, &[]);
    let two = current_key(&p, "calendar", Some("uid-2"), &a, &[]);
    assert_ne!(
        one.output, two.output,
        "a recreated Adapter merges elsewhere"
    );
    assert_ne!(one.job_name, two.job_name);
    // Its output was pruned: the next round, a new Job and directory; and the one after.
    let again = current_key(
        &p,
        "calendar",
        Some("uid-1"),
        &a,
        std::slice::from_ref(&one.output),
    );
    assert_ne!(again.output, one.output);
    assert_ne!(again.job_name, one.job_name);
    let third = current_key(
        &p,
        "calendar",
        Some("uid-1"),
        &a,
        &[one.output.clone(), again.output.clone()],
    );
    assert!(third != one && third != again);
    assert!(third.output.starts_with("merged/calendar/v1-"));
}

#[test]
fn pruned_outputs_are_remembered_and_a_rollback_to_one_merges_again() {
    let mut p = pool();
    p.merge.keep_versions = 0;
    let mut st = AdapterStatus::default();
    for v in ["v1", "v2"] {
        let spec = adapter(v, "merged");
        let key = current_key(&p, "calendar", None, &spec, &st.pruned_outputs);
        let a = run(&p, &spec, &st, &obs(JobState::Succeeded));
        let mut o = obs(JobState::Succeeded);
        o.deployment = Some(serving(&key.output, v));
        st = run(&p, &spec, &a.status, &o).status;
    }
    let v1 = adapter("v1", "merged");
    let k1 = merge_key(&p, "calendar", &v1);
    assert_eq!(st.pruned_outputs, vec![k1.output.clone()]);
    assert!(st
        .history
        .iter()
        .all(|r| r.merged_output != Some(k1.output.clone())));
    // Applying v1 again: a new key, whose Job is absent, so a merge, not a switch.
    let k1b = current_key(&p, "calendar", None, &v1, &st.pruned_outputs);
    assert_ne!(k1b, k1);
    let mut o = obs(JobState::Absent);
    o.deployment = Some(serving(&st.history[0].merged_output.clone().unwrap(), "v2"));
    let plan = run(&p, &v1, &st, &o);
    assert_eq!(plan.job, JobAction::Create(k1b.clone()));
    assert_eq!(plan.merge_job.as_deref(), Some(k1b.job_name.as_str()));
    match &plan.deployment {
        DeploymentAction::Apply { output, .. } => assert_ne!(output, &k1.output),
        DeploymentAction::Keep => {}
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_pruned_list_is_bounded() {
    let mut pruned = Vec::new();
    for i in 0..(MAX_PRUNED_OUTPUTS + 5) {
        remember_pruned(&mut pruned, &[format!("merged/a/{i}")]);
    }
    assert_eq!(pruned.len(), MAX_PRUNED_OUTPUTS);
    assert_eq!(pruned[0], "merged/a/5", "the oldest go first");
    remember_pruned(&mut pruned, &["merged/a/5".into()]);
    assert_eq!(pruned.len(), MAX_PRUNED_OUTPUTS, "no duplicates");
    assert_eq!(pruned.last().unwrap(), "merged/a/5");
}

/// Issue 34 item 4: a rollback to a version in the history keeps that version's output even
/// when the same plan trims the history (here `keepVersions` lowered to 0 with the rollback):
/// the Deployment is switched to it, so it is never handed to a cleanup Job.
#[test]
fn a_rollback_target_is_never_trimmed_by_its_own_plan() {
    let mut p = pool();
    let v1 = merged_status(&p, "v1", &AdapterStatus::default());
    let v2 = merged_status(&p, "v2", &v1);
    let k1 = merge_key(&p, "calendar", &adapter("v1", "merged"));
    let k2 = merge_key(&p, "calendar", &adapter("v2", "merged"));
    p.merge.keep_versions = 0;
    let mut o = obs(JobState::Absent);
    o.deployment = Some(serving(&k2.output, "v2"));
    let plan = run(&p, &adapter("v1", "merged"), &v2, &o);
    assert_eq!(
        plan.deployment,
        DeploymentAction::Apply {
            output: k1.output.clone(),
            version: "v1".into()
        }
    );
    assert!(
        !plan.cleanup.contains(&k1.output),
        "the rollback target is deleted under the pods switched to it: {:?}",
        plan.cleanup
    );
    assert!(plan
        .status
        .history
        .iter()
        .any(|r| r.merged_output.as_deref() == Some(k1.output.as_str())));
    // Once v1 serves, v2 falls out (keepVersions 0) and goes to the cleanup Job.
    o.deployment = Some(serving(&k1.output, "v1"));
    let done = run(&p, &adapter("v1", "merged"), &plan.status, &o);
    assert_eq!(done.cleanup, vec![k2.output.clone()]);
    assert_eq!(done.status.history.len(), 1);
    assert_eq!(done.status.active_version.as_deref(), Some("v1"));
}

/// Issue 37, item 6: an idle merged adapter goes back into the dynamic pods, and only once they
/// all hold it is its Deployment scaled to 0 (kept, with its output) and the forwarding
/// dropped; requests again scale it back up, with the dynamic pods serving until it is ready.
#[test]
fn idle_merged_pods_scale_to_zero_only_behind_the_dynamic_pods_and_come_back() {
    let mut p = pool();
    p.merge.unload_from_dynamic = true;
    let spec = adapter("v1", "merged");
    let key = merge_key(&p, "calendar", &spec);
    let serving_status = merged_status(&p, "v1", &AdapterStatus::default());
    let at = |replicas: i32, ready: i32| DeploymentState {
        replicas,
        ready_replicas: ready,
        serving_replicas: ready,
        ..serving(&key.output, "v1")
    };
    struct Row {
        idle: bool,
        dynamic_loaded: bool,
        deployment: DeploymentState,
        // What the plan does: merged replicas override, forwarding, dynamic load, Event.
        replicas: Option<i32>,
        forwards: bool,
        load_dynamic: bool,
        event: Option<&'static str>,
    }
    let rows = [
        // Busy and served merged: nothing changes (the pool unloads it from dynamic pods).
        Row {
            idle: false,
            dynamic_loaded: false,
            deployment: at(1, 1),
            replicas: None,
            forwards: true,
            load_dynamic: false,
            event: None,
        },
        // Idle, but the dynamic pods do not hold it: they load it first, merged pods stay.
        Row {
            idle: true,
            dynamic_loaded: false,
            deployment: at(1, 1),
            replicas: None,
            forwards: true,
            load_dynamic: true,
            event: None,
        },
        // Idle and the dynamic pods hold it: scaled to zero, no more forwarding.
        Row {
            idle: true,
            dynamic_loaded: true,
            deployment: at(1, 1),
            replicas: Some(0),
            forwards: false,
            load_dynamic: true,
            event: Some("ScaledToZero"),
        },
        // Stays parked, announced once.
        Row {
            idle: true,
            dynamic_loaded: true,
            deployment: at(0, 0),
            replicas: Some(0),
            forwards: false,
            load_dynamic: true,
            event: None,
        },
        // Requests again: scaled back up; the dynamic pods keep it until the pods are ready.
        Row {
            idle: false,
            dynamic_loaded: true,
            deployment: at(0, 0),
            replicas: None,
            forwards: false,
            load_dynamic: true,
            event: Some("ScaledFromZero"),
        },
    ];
    for (i, r) in rows.iter().enumerate() {
        let mut o = obs(JobState::Succeeded);
        o.idle = r.idle;
        o.dynamic_loaded = r.dynamic_loaded;
        o.deployment = Some(r.deployment.clone());
        let plan = run(&p, &spec, &serving_status, &o);
        assert_eq!(
            plan.deployment,
            DeploymentAction::Apply {
                output: key.output.clone(),
                version: "v1".into()
            },
            "row {i}: the Deployment is kept"
        );
        assert_eq!(plan.merged_replicas, r.replicas, "row {i}");
        assert_eq!(plan.merged_endpoint.is_some(), r.forwards, "row {i}");
        assert_eq!(plan.load_dynamic, r.load_dynamic, "row {i}");
        let reasons: Vec<_> = plan.events.iter().map(|e| e.reason).collect();
        match r.event {
            Some(e) => assert!(reasons.contains(&e), "row {i}: {reasons:?}"),
            None => assert!(
                !reasons.contains(&"ScaledToZero") && !reasons.contains(&"ScaledFromZero"),
                "row {i}: {reasons:?}"
            ),
        }
        if r.replicas == Some(0) {
            assert_eq!(plan.status.phase, AdapterPhase::Ready, "row {i}");
            assert_eq!(plan.status.serving_mode, Some(ServingMode::Dynamic));
            let ready = cond(&plan.status, condition::READY).unwrap();
            assert_eq!(
                (ready.status.as_str(), ready.reason.as_str()),
                ("True", "ScaledToZero")
            );
            assert_eq!(
                plan.status.endpoint.as_deref(),
                Some(pool_endpoint("vl", "ml").as_str())
            );
        }
    }
    // A merge under way for a new version is never parked.
    let v2 = adapter("v2", "merged");
    let mut o = obs(JobState::Running);
    o.idle = true;
    o.deployment = Some(at(1, 1));
    let plan = run(&p, &v2, &serving_status, &o);
    assert_eq!(plan.merged_replicas, None);
}
