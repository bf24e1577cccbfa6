//! Pure builders of the merge Job and the cleanup Job of merge-down.

use std::collections::BTreeMap;

use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::core::v1::Container;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use mole_crds::{AdapterSpec, InferencePoolSpec};

use crate::resources::{
    job_template, join, tool_container, with_base_model_source, ChildMeta, JobNodes, WorkerDefaults,
};

use super::MergeKey;

/// Finished merge Jobs are garbage-collected after a day; the Adapter's status keeps the result.
const TTL_AFTER_FINISHED: i32 = 24 * 3600;

/// The metadata of an adapter's `component` Job (created through a namespaced API, so
/// without a namespace of its own).
fn job_meta(pool: &str, adapter: &str, component: &str, owner: OwnerReference) -> ChildMeta {
    ChildMeta::of_adapter(pool, None, adapter, component, owner)
}

/// The merge Job of `key`: `mole-worker merge` with the pool volume read-write, in the pool's
/// Job image ([`WorkerDefaults::jobs`]). The Job's name is deterministic, so a restarted
/// operator finds it instead of creating a duplicate.
pub fn merge_job(
    pool_name: &str,
    pool: &InferencePoolSpec,
    adapter: &str,
    spec: &AdapterSpec,
    key: &MergeKey,
    owner: OwnerReference,
    images: &WorkerDefaults,
) -> Job {
    let mount = &pool.storage.mount_path;
    let mut args = vec![
        "merge".to_string(),
        "--base".into(),
        join(mount, &pool.base_model.path),
        "--adapter".into(),
        join(mount, &spec.source.path),
        "--out".into(),
        join(mount, &key.output),
        "--root".into(),
        mount.clone(),
        // No `--expect-base`: the merge checks every module's shapes against the base, and a
        // base named otherwise (a local training path) is compatible when they fit, as the
        // dynamic pods serve it.
        "--adapter-name".into(),
        adapter.to_string(),
        "--adapter-version".into(),
        spec.version.clone(),
    ];
    if spec.merge.safe_merge {
        args.push("--safe-merge".into());
    }
    if let Some(d) = spec.merge.dtype {
        args.push("--dtype".into());
        args.push(d.as_str().into());
    }
    // The Job writes only the quantized model to the output the merged Deployment serves;
    // a drift over the bound fails the Job with `drift_over_bound` in its termination message.
    if let Some(q) = &spec.merge.quantize {
        args.push("--quantize".into());
        args.push(q.quant_type.as_str().into());
        if let Some(bound) = q.max_drift {
            args.push("--max-drift".into());
            args.push(bound.to_string());
        }
    }
    let container = Container {
        resources: pool.merge.resources.clone(),
        ..tool_container("merge", pool, images.jobs(pool), args)
    };
    let meta = job_meta(pool_name, adapter, "merge", owner);
    let mut job = Job {
        metadata: meta.annotated(
            key.job_name.clone(),
            BTreeMap::from([
                ("mole.dev/merge-hash".to_string(), key.hash.clone()),
                ("mole.dev/merge-output".to_string(), key.output.clone()),
                ("mole.dev/adapter-version".to_string(), spec.version.clone()),
            ]),
        ),
        spec: Some(JobSpec {
            backoff_limit: Some(pool.merge.backoff_limit),
            active_deadline_seconds: Some(pool.merge.active_deadline_seconds),
            ttl_seconds_after_finished: Some(TTL_AFTER_FINISHED),
            template: job_template(pool, &meta, container, JobNodes::Merge),
            ..Default::default()
        }),
        status: None,
    };
    // The merge reads the base model where the pods do: fetched first (a no-op when the pods
    // already did) or the pvc:// claim mounted over its directory.
    if let Some(pod) = job.spec.as_mut().and_then(|s| s.template.spec.as_mut()) {
        with_base_model_source(pool, pod);
    }
    job
}

/// A Job that deletes merged outputs that fell out of the history. The operator pod never
/// touches the volume itself; this Job runs `mole-worker prune`, which refuses any path outside
/// `<mount>/merged/<adapter>/`. Same image as the merge Job.
pub fn cleanup_job(
    pool_name: &str,
    pool: &InferencePoolSpec,
    adapter: &str,
    outputs: &[String],
    owner: OwnerReference,
    images: &WorkerDefaults,
) -> Option<Job> {
    if outputs.is_empty() {
        return None;
    }
    let mount = &pool.storage.mount_path;
    let mut sorted = outputs.to_vec();
    sorted.sort();
    let digest = sha2::Digest::finalize(sha2::Digest::chain_update(
        <sha2::Sha256 as sha2::Digest>::new(),
        sorted.join("\n").as_bytes(),
    ));
    let hash = hex::encode(&digest[..5]);
    let room = 63 - "cleanup-".len() - 1 - hash.len();
    let short: String = adapter.chars().take(room).collect();
    let mut args = vec![
        "prune".to_string(),
        "--root".into(),
        join(mount, &format!("merged/{adapter}")),
    ];
    args.extend(sorted.iter().map(|o| join(mount, o)));
    let container = Container {
        // Deleting directories: a little CPU and memory, bounded so a node's scheduler
        // accounts for it and it cannot grow past a small limit.
        resources: Some(cleanup_resources()),
        ..tool_container("cleanup", pool, images.jobs(pool), args)
    };
    let meta = job_meta(pool_name, adapter, "cleanup", owner);
    Some(Job {
        metadata: meta.named(format!("cleanup-{}-{hash}", short.trim_end_matches('-'))),
        spec: Some(JobSpec {
            backoff_limit: Some(3),
            ttl_seconds_after_finished: Some(3600),
            template: job_template(pool, &meta, container, JobNodes::Merge),
            ..Default::default()
        }),
        status: None,
    })
}

/// Whether a Job has finished: succeeded, or failed for good (a `Complete` or `Failed`
/// condition). Only an unfinished Job still runs, or will run, pods worth stopping.
pub fn finished(job: &Job) -> bool {
    let Some(st) = &job.status else {
        return false;
    };
    st.succeeded.unwrap_or(0) > 0
        || st
            .conditions
            .iter()
            .flatten()
            .any(|c| matches!(c.type_.as_str(), "Complete" | "Failed") && c.status == "True")
}

/// The names of the unfinished `jobs` other than `keep`: merge Jobs superseded by a newer
/// merge key (or by the adapter going dynamic, `keep` None), whose output nobody will serve.
/// Finished Jobs are left to their TTL: they run nothing, and a succeeded one is what a
/// restarted operator reads its result from.
pub fn superseded(jobs: &[Job], keep: Option<&str>) -> Vec<String> {
    jobs.iter()
        .filter(|j| !finished(j))
        .filter_map(|j| j.metadata.name.clone())
        .filter(|n| Some(n.as_str()) != keep)
        .collect()
}

/// The cleanup container's requests and limits.
fn cleanup_resources() -> k8s_openapi::api::core::v1::ResourceRequirements {
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    let q = |s: &str| Quantity(s.to_string());
    k8s_openapi::api::core::v1::ResourceRequirements {
        requests: Some(
            [
                ("cpu".to_string(), q("50m")),
                ("memory".to_string(), q("64Mi")),
            ]
            .into_iter()
            .collect(),
        ),
        limits: Some([("memory".to_string(), q("256Mi"))].into_iter().collect()),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mergedown::merge_key;

    #[test]
    fn merge_job_is_bounded_restricted_scheduled_and_writes_the_volume() {
        let pool: InferencePoolSpec = serde_yaml::from_str(
            r#"
baseModel: {name: Qwen/Qwen3-VL-8B-Instruct, path: base/qwen3-vl-8b}
storage: {claimName: models, mountPath: /models}
image: ghcr.io/mole-dev/mole-worker:0.1.0
imagePullPolicy: IfNotPresent
imagePullSecrets: [{name: regcred}]
gpu: {count: 1, priorityClassName: gpu-serving, runtimeClassName: nvidia}
merge:
  priorityClassName: batch-low
  backoffLimit: 3
  activeDeadlineSeconds: 1800
  nodeSelector: {node-role/merge: "true"}
  tolerations: [{key: merge, operator: Exists, effect: NoSchedule}]
  resources: {requests: {cpu: "2", memory: 24Gi}, limits: {memory: 32Gi}}
"#,
        )
        .unwrap();
        let spec: AdapterSpec = serde_yaml::from_str(
            "pool: vl\nversion: v2\nsource: {path: adapters/calendar/v2}\nmerge: {dtype: bf16}\n",
        )
        .unwrap();
        let key = merge_key(&pool, "calendar", &spec);
        let owner = OwnerReference {
            api_version: "mole.dev/v1alpha1".into(),
            kind: "Adapter".into(),
            name: "calendar".into(),
            uid: "uid-a".into(),
            controller: Some(true),
            block_owner_deletion: Some(true),
        };
        let job = merge_job(
            "vl",
            &pool,
            "calendar",
            &spec,
            &key,
            owner,
            &WorkerDefaults::default(),
        );
        assert_eq!(job.metadata.name.as_deref(), Some(key.job_name.as_str()));
        assert_eq!(
            job.metadata.owner_references.as_ref().unwrap()[0].kind,
            "Adapter"
        );
        let js = job.spec.unwrap();
        assert_eq!(js.backoff_limit, Some(3));
        assert_eq!(js.active_deadline_seconds, Some(1800));
        assert_eq!(js.ttl_seconds_after_finished, Some(TTL_AFTER_FINISHED));
        let pod = js.template.spec.unwrap();
        assert_eq!(pod.restart_policy.as_deref(), Some("Never"));
        assert_eq!(pod.node_selector.unwrap()["node-role/merge"], "true");
        assert_eq!(pod.tolerations.unwrap()[0].key.as_deref(), Some("merge"));
        assert_eq!(pod.image_pull_secrets.unwrap()[0].name, "regcred");
        assert_eq!(
            pod.priority_class_name.as_deref(),
            Some("batch-low"),
            "the merge class, not the serving pods'"
        );
        assert_eq!(pod.runtime_class_name, None, "merging needs no GPU runtime");
        let psec = pod.security_context.unwrap();
        assert_eq!(
            psec.fs_group_change_policy.as_deref(),
            Some("OnRootMismatch")
        );
        assert_eq!(psec.run_as_non_root, Some(true));
        assert_eq!(
            psec.seccomp_profile.unwrap().type_,
            "RuntimeDefault",
            "restricted profile"
        );
        let c = &pod.containers[0];
        let sec = c.security_context.as_ref().unwrap();
        assert_eq!(sec.allow_privilege_escalation, Some(false));
        assert_eq!(sec.read_only_root_filesystem, Some(true));
        assert_eq!(
            sec.capabilities.as_ref().unwrap().drop.as_deref(),
            Some(&["ALL".to_string()][..])
        );
        let res = c.resources.as_ref().unwrap();
        assert_eq!(res.requests.as_ref().unwrap()["memory"].0, "24Gi");
        assert_eq!(res.limits.as_ref().unwrap()["memory"].0, "32Gi");
        assert!(
            res.limits.as_ref().unwrap().get("nvidia.com/gpu").is_none(),
            "merging needs no GPU"
        );
        assert_eq!(c.image_pull_policy.as_deref(), Some("IfNotPresent"));
        assert_eq!(
            c.termination_message_path.as_deref(),
            Some("/dev/termination-log")
        );
        // The pool volume read-write at the mount path (servers mount it read-only).
        let m = &c.volume_mounts.as_ref().unwrap()[0];
        assert_eq!(
            (m.mount_path.as_str(), m.read_only),
            ("/models", Some(false))
        );
        let v = &pod.volumes.unwrap()[0];
        let pvc = v.persistent_volume_claim.as_ref().unwrap();
        assert_eq!(
            (pvc.claim_name.as_str(), pvc.read_only),
            ("models", Some(false))
        );
        assert_eq!(v.name, m.name);
        let args = c.args.as_ref().unwrap();
        let after = |flag: &str| {
            let i = args.iter().position(|a| a == flag).unwrap();
            args[i + 1].clone()
        };
        assert_eq!(after("--base"), "/models/base/qwen3-vl-8b");
        assert_eq!(after("--adapter"), "/models/adapters/calendar/v2");
        assert_eq!(after("--out"), format!("/models/{}", key.output));
        assert_eq!(after("--dtype"), "bf16");
        assert!(args.contains(&"--safe-merge".to_string()));
        // The cleanup Job runs the same image on the same nodes as the merge Job.
        let cleanup = cleanup_job(
            "vl",
            &pool,
            "calendar",
            &["merged/calendar/v1-a".to_string()],
            job.metadata.owner_references.unwrap()[0].clone(),
            &WorkerDefaults::default(),
        )
        .unwrap();
        let pod = cleanup.spec.unwrap().template.spec.unwrap();
        assert_eq!(pod.image_pull_secrets.unwrap()[0].name, "regcred");
        assert_eq!(pod.tolerations.unwrap()[0].key.as_deref(), Some("merge"));
        assert_eq!(pod.node_selector.unwrap()["node-role/merge"], "true");
        assert_eq!(pod.priority_class_name.as_deref(), Some("batch-low"));
        assert_eq!(pod.runtime_class_name, None);
        let res = pod.containers[0].resources.clone().unwrap();
        assert_eq!(res.requests.unwrap()["memory"].0, "64Mi");
        assert_eq!(res.limits.unwrap()["memory"].0, "256Mi");
        assert_eq!(
            c.image.as_deref(),
            Some("ghcr.io/mole-dev/mole-worker:0.1.0")
        );
    }

    /// `spec.merge.quantize` adds `--quantize` (and the bound) to the merge Job, and is a new
    /// merge: another hash, another output directory. Unset, the hash is what it was.
    #[test]
    fn quantize_after_merge_is_in_the_job_and_the_hash() {
        let pool: InferencePoolSpec = serde_yaml::from_str(
            "baseModel: {name: m, path: base/m}\nstorage: {claimName: models}\ngpu: {count: 1}\n",
        )
        .unwrap();
        let plain: AdapterSpec =
            serde_yaml::from_str("pool: p\nversion: v1\nsource: {path: adapters/a/v1}\n").unwrap();
        let quantized: AdapterSpec = serde_yaml::from_str(
            "pool: p\nversion: v1\nsource: {path: adapters/a/v1}\nmerge: {quantize: {type: q4_k, maxDrift: 0.05}}\n",
        )
        .unwrap();
        let unbounded: AdapterSpec = serde_yaml::from_str(
            "pool: p\nversion: v1\nsource: {path: adapters/a/v1}\nmerge: {quantize: {type: q8_0}}\n",
        )
        .unwrap();
        let args = |spec: &AdapterSpec| {
            let key = merge_key(&pool, "a", spec);
            let job = merge_job(
                "p",
                &pool,
                "a",
                spec,
                &key,
                OwnerReference::default(),
                &WorkerDefaults::default(),
            );
            (
                key,
                job.spec.unwrap().template.spec.unwrap().containers[0]
                    .args
                    .clone()
                    .unwrap(),
            )
        };
        let (k0, a0) = args(&plain);
        let (k1, a1) = args(&quantized);
        let (k2, a2) = args(&unbounded);
        assert!(!a0.contains(&"--quantize".to_string()));
        let after = |args: &[String], flag: &str| {
            args.iter()
                .position(|a| a == flag)
                .map(|i| args[i + 1].clone())
        };
        assert_eq!(after(&a1, "--quantize").as_deref(), Some("q4_k"));
        assert_eq!(after(&a1, "--max-drift").as_deref(), Some("0.05"));
        assert_eq!(after(&a2, "--quantize").as_deref(), Some("q8_0"));
        assert_eq!(after(&a2, "--max-drift"), None);
        assert_ne!(k0.hash, k1.hash);
        assert_ne!(k1.hash, k2.hash);
        assert_ne!(k0.output, k1.output);
        // The dense merge's identity is unchanged by the new field's existence.
        let mut same = plain.clone();
        same.merge.quantize = None;
        assert_eq!(merge_key(&pool, "a", &same).hash, k0.hash);
    }

    #[test]
    fn only_unfinished_jobs_other_than_the_current_one_are_superseded() {
        let job = |name: &str, status: serde_json::Value| -> Job {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": name}, "status": status,
            }))
            .unwrap()
        };
        let jobs = [
            job("merge-a-old", serde_json::json!({"active": 1})),
            job("merge-a-new", serde_json::json!({"active": 1})),
            job("merge-a-done", serde_json::json!({"succeeded": 1})),
            job(
                "merge-a-failed",
                serde_json::json!({"failed": 3, "conditions": [{"type": "Failed", "status": "True"}]}),
            ),
            job("merge-a-pending", serde_json::json!({})),
        ];
        assert_eq!(
            superseded(&jobs, Some("merge-a-new")),
            ["merge-a-old", "merge-a-pending"]
        );
        assert_eq!(
            superseded(&jobs, None),
            ["merge-a-old", "merge-a-new", "merge-a-pending"],
            "served dynamically: no merge Job is wanted"
        );
    }

    #[test]
    fn jobs_of_a_gpu_pool_without_an_image_run_the_cpu_default() {
        let mut pool: InferencePoolSpec = serde_yaml::from_str(
            "baseModel: {name: m, path: base/m}\nstorage: {claimName: models}\ngpu: {count: 1}\n",
        )
        .unwrap();
        let spec: AdapterSpec =
            serde_yaml::from_str("pool: vl\nversion: v1\nsource: {path: adapters/a/v1}\n").unwrap();
        let key = merge_key(&pool, "a", &spec);
        let images = WorkerDefaults {
            gpu: "reg/worker:1-cuda".into(),
            cpu: "reg/worker:1-cpu".into(),
            ..Default::default()
        };
        let image_of = |pool: &InferencePoolSpec| {
            let jobs = [
                merge_job(
                    "vl",
                    pool,
                    "a",
                    &spec,
                    &key,
                    OwnerReference::default(),
                    &images,
                ),
                cleanup_job(
                    "vl",
                    pool,
                    "a",
                    &["merged/a/old".into()],
                    OwnerReference::default(),
                    &images,
                )
                .unwrap(),
            ];
            jobs.map(|j| {
                j.spec.unwrap().template.spec.unwrap().containers[0]
                    .image
                    .clone()
                    .unwrap()
            })
        };
        assert_eq!(image_of(&pool), ["reg/worker:1-cpu"; 2]);
        pool.image = Some("mine:2".into());
        assert_eq!(image_of(&pool), ["mine:2"; 2]);
    }
}
