//! Where a pool's base model comes from (`spec.baseModel.source`): `hf://` and `s3://` are
//! pulled by a `fetch-model` init container running `mole-worker fetch` into
//! `<mountPath>/<baseModel.path>` on the pool's volume; `pvc://claim/path` mounts that claim's
//! directory read-only there instead. Either way the worker reads the model where it always
//! does, so the WorkerConfig does not change. An Adapter's `source.uri` is fetched the same
//! way by a fetch Job per version, before the pool's pods are told to load it.

use std::collections::BTreeMap;

use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::core::v1::{
    Container, EnvFromSource, PersistentVolumeClaimVolumeSource, PodSpec, SecretEnvSource, Volume,
    VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use mole_crds::{AdapterSpec, InferencePoolSpec, ModelSource, SecretRef};

use super::meta::{short_hash, ChildMeta};
use super::restricted::{job_template, tool_container, JobNodes};

/// Name of the init container that fetches the base model.
pub const FETCH_MODEL_CONTAINER: &str = "fetch-model";

/// Name of the volume of a `pvc://` base model's claim.
pub const BASE_MODEL_SOURCE_VOLUME: &str = "base-model-source";

/// `<mount>/<rel>`.
pub fn join(mount: &str, rel: &str) -> String {
    format!(
        "{}/{}",
        mount.trim_end_matches('/'),
        rel.trim_start_matches('/')
    )
}

/// The `mole-worker fetch` container writing `uri` into `dest` on the `models` volume, with
/// the Secret's keys as its environment (`HF_TOKEN`, `AWS_*`: the names the tool reads).
pub fn fetch_container(
    name: &str,
    spec: &InferencePoolSpec,
    image: String,
    uri: &str,
    dest: &str,
    secret: Option<&SecretRef>,
) -> Container {
    let args = vec![
        "fetch".into(),
        "--source".into(),
        uri.to_string(),
        "--dest".into(),
        dest.to_string(),
    ];
    Container {
        env_from: secret.map(|s| {
            vec![EnvFromSource {
                secret_ref: Some(SecretEnvSource {
                    name: s.name.clone(),
                    optional: Some(false),
                }),
                ..Default::default()
            }]
        }),
        ..tool_container(name, spec, image, args)
    }
}

/// Adds what the pool's base-model source needs to a pod that mounts the pool's volume as
/// `models` (worker pods, merge Jobs). Unset source: nothing. A source the validation refused
/// never reaches here; an unparsable one is left alone rather than guessed at.
pub fn with_base_model_source(spec: &InferencePoolSpec, pod: &mut PodSpec) {
    let Some(uri) = spec.base_model.source.as_deref() else {
        return;
    };
    let Ok(source) = ModelSource::parse(uri) else {
        return;
    };
    let target = join(&spec.storage.mount_path, &spec.base_model.path);
    match source {
        ModelSource::Pvc { claim, path } => {
            pod.volumes.get_or_insert_with(Vec::new).push(Volume {
                name: BASE_MODEL_SOURCE_VOLUME.into(),
                persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                    claim_name: claim,
                    read_only: Some(true),
                }),
                ..Default::default()
            });
            // Mounted over the model's directory, so every reader finds it where it always
            // does, inside the model root the worker confines paths to.
            for c in &mut pod.containers {
                c.volume_mounts
                    .get_or_insert_with(Vec::new)
                    .push(VolumeMount {
                        name: BASE_MODEL_SOURCE_VOLUME.into(),
                        mount_path: target.clone(),
                        sub_path: (!path.is_empty()).then_some(path.clone()),
                        read_only: Some(true),
                        ..Default::default()
                    });
            }
        }
        ModelSource::Hf { .. } | ModelSource::S3 { .. } => {
            // The init container writes to the volume: it cannot be read-only as a whole any
            // more; the other containers keep their read-only mounts.
            for v in pod.volumes.iter_mut().flatten() {
                if let (true, Some(pvc)) = (v.name == "models", v.persistent_volume_claim.as_mut())
                {
                    pvc.read_only = Some(false);
                }
            }
            // The pod's own image (resolved from the pool and the operator's defaults): it
            // is pulled for the pod anyway.
            let image = pod
                .containers
                .first()
                .and_then(|c| c.image.clone())
                .unwrap_or_default();
            let init = fetch_container(
                FETCH_MODEL_CONTAINER,
                spec,
                image,
                uri,
                &target,
                spec.base_model.secret_ref.as_ref(),
            );
            pod.init_containers
                .get_or_insert_with(Vec::new)
                .insert(0, init);
        }
    }
}

/// Identity of an adapter's fetch: its `source.uri`, `source.path` and version (None without
/// a `uri`). A new value means a new Job.
pub fn adapter_fetch_key(spec: &AdapterSpec) -> Option<String> {
    let uri = spec.source.uri.as_ref()?;
    Some(
        short_hash(&serde_json::json!({
            "uri": uri,
            "path": spec.source.path,
            "version": spec.version,
        }))[..10]
            .to_string(),
    )
}

/// `fetch-<adapter>-<key>`, within the 63 characters of a label value (the Job controller
/// labels its pods with the Job's name).
pub fn adapter_fetch_job_name(adapter: &str, key: &str) -> String {
    let room = 63 - "fetch-".len() - 1 - key.len();
    let short: String = adapter.chars().take(room).collect();
    format!("fetch-{}-{key}", short.trim_end_matches('-'))
}

/// Finished fetch Jobs go after a day; the Adapter's status keeps the result.
const FETCH_TTL_AFTER_FINISHED: i32 = 24 * 3600;

/// Annotation of a fetch Job: the uid of the fetch Job whose files it replaces (empty: none),
/// the adapter's `status.fetchedJobUid` when it was created (set by the Adapter controller).
pub const ANNOTATION_FETCHED_AFTER: &str = "mole.dev/fetched-after";

/// The fetch Job of an adapter version: `mole-worker fetch` of its `source.uri` into
/// `<mountPath>/<source.path>` with the pool's volume read-write. None without a `uri`.
pub fn adapter_fetch_job(
    pool_name: &str,
    pool: &InferencePoolSpec,
    adapter: &str,
    spec: &AdapterSpec,
    owner: OwnerReference,
    images: &super::WorkerDefaults,
) -> Option<Job> {
    let uri = spec.source.uri.as_deref()?;
    let key = adapter_fetch_key(spec)?;
    let meta = ChildMeta::of_adapter(pool_name, None, adapter, "fetch", owner);
    let dest = join(&pool.storage.mount_path, &spec.source.path);
    // A Job that requests no GPU: the image for Jobs, as merge Jobs have.
    let container = fetch_container(
        "fetch",
        pool,
        images.jobs(pool),
        uri,
        &dest,
        spec.source.secret_ref.as_ref(),
    );
    Some(Job {
        metadata: meta.annotated(
            adapter_fetch_job_name(adapter, &key),
            BTreeMap::from([
                ("mole.dev/fetch-key".to_string(), key),
                ("mole.dev/adapter-version".to_string(), spec.version.clone()),
            ]),
        ),
        spec: Some(JobSpec {
            // The tool resumes a broken download itself; a few pod retries cover the rest
            // (a node lost mid-download), each resuming from the `.part`.
            backoff_limit: Some(3),
            ttl_seconds_after_finished: Some(FETCH_TTL_AFTER_FINISHED),
            template: job_template(pool, &meta, container, JobNodes::Any),
            ..Default::default()
        }),
        status: None,
    })
}

#[cfg(test)]
mod tests {
    use super::super::models_volume;
    use super::*;

    fn spec(source: Option<&str>) -> InferencePoolSpec {
        let mut s: InferencePoolSpec = serde_yaml::from_str(
            "baseModel: {name: m, path: base/m}\nstorage: {claimName: models}\nimage: img\ngpu: {count: 1}\n",
        )
        .unwrap();
        s.base_model.source = source.map(String::from);
        s
    }

    /// A merge Job's pod: one container, the volume read-write.
    fn merge_pod(s: &InferencePoolSpec) -> PodSpec {
        PodSpec {
            containers: vec![Container {
                name: "merge".into(),
                ..Default::default()
            }],
            volumes: Some(vec![models_volume(s, false)]),
            ..Default::default()
        }
    }

    #[test]
    fn adapter_fetch_job_writes_the_version_into_its_path() {
        let s = spec(None);
        let mut a: AdapterSpec = serde_yaml::from_str(
            "pool: vl\nversion: v1\nsource: {path: adapters/cal/v1, uri: 's3://b/cal/v1', secretRef: {name: s3}}\n",
        )
        .unwrap();
        let owner = OwnerReference::default();
        let job = adapter_fetch_job(
            "vl",
            &s,
            "cal",
            &a,
            owner.clone(),
            &super::super::WorkerDefaults::default(),
        )
        .unwrap();
        let key = adapter_fetch_key(&a).unwrap();
        assert_eq!(
            job.metadata.name.as_deref(),
            Some(format!("fetch-cal-{key}").as_str())
        );
        let pod = job.spec.unwrap().template.spec.unwrap();
        let c = &pod.containers[0];
        assert_eq!(
            c.args.as_ref().unwrap()[..],
            [
                "fetch",
                "--source",
                "s3://b/cal/v1",
                "--dest",
                "/models/adapters/cal/v1"
            ]
        );
        assert_eq!(
            c.env_from.as_ref().unwrap()[0]
                .secret_ref
                .as_ref()
                .unwrap()
                .name,
            "s3"
        );
        assert_eq!(pod.restart_policy.as_deref(), Some("Never"));
        // A new version is a new fetch; no uri, no Job.
        a.version = "v2".into();
        assert_ne!(adapter_fetch_key(&a).unwrap(), key);
        a.source.uri = None;
        assert!(adapter_fetch_job(
            "vl",
            &s,
            "cal",
            &a,
            owner,
            &super::super::WorkerDefaults::default()
        )
        .is_none());
        let long = "a".repeat(100);
        assert!(adapter_fetch_job_name(&long, &key).len() <= 63);
    }

    #[test]
    fn no_source_changes_nothing() {
        let s = spec(None);
        let mut pod = merge_pod(&s);
        with_base_model_source(&s, &mut pod);
        assert_eq!(pod, merge_pod(&s));
    }

    #[test]
    fn every_container_sees_a_pvc_source_and_fetched_sources_come_first() {
        let s = spec(Some("pvc://weights/m"));
        let mut pod = merge_pod(&s);
        with_base_model_source(&s, &mut pod);
        let m = &pod.containers[0].volume_mounts.as_ref().unwrap()[0];
        assert_eq!(
            (m.mount_path.as_str(), m.sub_path.as_deref()),
            ("/models/base/m", Some("m"))
        );

        let s = spec(Some("s3://bucket/models/m"));
        let mut pod = merge_pod(&s);
        pod.init_containers = Some(vec![Container {
            name: "other".into(),
            ..Default::default()
        }]);
        with_base_model_source(&s, &mut pod);
        let init = pod.init_containers.unwrap();
        assert_eq!(init[0].name, FETCH_MODEL_CONTAINER);
        assert_eq!(
            init[0].env_from, None,
            "no Secret: anonymous or the node's identity"
        );
        assert_eq!(
            init[0].args.as_ref().unwrap()[1..],
            [
                "--source",
                "s3://bucket/models/m",
                "--dest",
                "/models/base/m"
            ]
        );
    }
}
