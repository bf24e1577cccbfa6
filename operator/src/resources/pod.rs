//! The worker pod template (dynamic and merged pods), built on the pieces of
//! [`super::restricted`] that every pod of the operator shares, and the mount points it
//! reserves.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    ConfigMapVolumeSource, Container, ContainerPort, EmptyDirVolumeSource, EnvVar, HTTPGetAction,
    PodSpec, PodTemplateSpec, Probe, ResourceRequirements, SecretVolumeSource, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use mole_crds::constants::{ANNOTATION_SPEC_HASH, WORKER_CONFIG_KEY, WORKER_CONFIG_MOUNT};
use mole_crds::{EngineLimits, InferencePool, InferencePoolSpec};

use super::fetch::with_base_model_source;
use super::image::WorkerDefaults;
use super::meta::{short_hash, ChildMeta};
use super::restricted::{
    image_pull_secrets, json_logs, models_volume, restricted_container_security,
    restricted_pod_security,
};
use super::secret::{operator_token_secret_name, OPERATOR_TOKEN_MOUNT};

/// Where the pool's auth Secret is mounted in worker pods. Not under `/etc/mole`: that is the
/// ConfigMap's (read-only) volume, and a mount point cannot be created inside it.
pub const AUTH_MOUNT: &str = "/var/run/mole/auth";

/// The worker's scratch directory (an emptyDir: the root filesystem is read-only).
pub const TMP_MOUNT: &str = "/tmp";

/// Where a container's ServiceAccount token would be mounted (Kubernetes' fixed path).
const SERVICE_ACCOUNT_MOUNT: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// The mount points the operator gives worker pods and Jobs besides the model volume.
pub const RESERVED_MOUNTS: &[&str] = &[
    TMP_MOUNT,
    WORKER_CONFIG_MOUNT,
    super::secret::OPERATOR_TOKEN_MOUNT,
    AUTH_MOUNT,
    SERVICE_ACCOUNT_MOUNT,
];

/// Why `path` cannot be the model volume's mount point, if it cannot. The API server refuses a
/// pod whose two mounts share a path ("duplicate entries for key [mountPath=/tmp]"), on every
/// retry; a path above one of ours hides the image's files under the volume (`/etc` takes the
/// CA certificates), and one inside a read-only mount of ours cannot be created.
pub fn mount_path_problem(path: &str) -> Option<String> {
    if !path.starts_with('/') {
        return Some("must be an absolute path".into());
    }
    if path == "/" {
        return Some("must not be the root directory".into());
    }
    if path.ends_with('/')
        || path
            .split('/')
            .skip(1)
            .any(|c| c.is_empty() || c == "." || c == "..")
    {
        return Some(format!(
            "{path:?} must be a normalized path (no trailing '/', '//', '.' or '..')"
        ));
    }
    let within = |inner: &str, outer: &str| {
        inner == outer
            || inner
                .strip_prefix(outer)
                .is_some_and(|r| r.starts_with('/'))
    };
    RESERVED_MOUNTS
        .iter()
        .find(|r| within(path, r) || within(r, path))
        .map(|r| {
            format!(
                "{path:?} collides with {r}, which the operator mounts in every worker pod \
                 (reserved: {}); use a directory of its own such as /models",
                RESERVED_MOUNTS.join(", ")
            )
        })
}

/// Hash of exactly the fields whose change must restart the pool's pods: what the pod spec
/// carries (base model source, image and its pull secrets, storage, GPU scheduling with
/// priority and runtime class, resources, auth) and what the worker reads only at start (its
/// `restart_required` settings: base model, model root, every engine limit, the router's
/// embedding model). Adapters are not in it: adding, updating or removing an adapter never
/// restarts a pod; nor are the router's other settings, which the worker reloads. `image` is
/// the resolved one ([`WorkerDefaults::serving`]), so a new operator default rolls pools that
/// rely on it. `spec_hash_covers_every_start_only_field` (tests) walks every field of the spec
/// against this.
pub fn spec_hash(spec: &InferencePoolSpec, image: &str) -> String {
    let l = &spec.dynamic.limits;
    let mut limits = serde_json::json!({
        "maxLoras": l.max_loras,
        "maxCpuLoras": l.max_cpu_loras,
        "maxLoraRank": l.max_lora_rank,
        "maxBatchSize": l.max_batch_size,
        "maxSeqLen": l.max_seq_len,
    });
    // Only when set: pools that leave it unset keep the hash (and pods) they had before the
    // field existed.
    if let Some(d) = l.lora_dtype {
        limits["loraDtype"] = serde_json::json!(d);
    }
    // Read at startup (the cache's dtype): written only when set, as loraDtype.
    if let Some(d) = l.kv_cache_dtype {
        limits["kvCacheDtype"] = serde_json::json!(d);
    }
    // Added after the fact, so only away from its default: a pool at the default keeps its
    // hash, and any change still changes it (default <-> absent is one-to-one).
    if l.max_queue != EngineLimits::default().max_queue {
        limits["maxQueue"] = serde_json::json!(l.max_queue);
    }
    // Read at startup (the KV cache's size): a change rolls the pods. Away from its default
    // only, as maxQueue.
    if l.gpu_memory_utilization != EngineLimits::default().gpu_memory_utilization {
        limits["gpuMemoryUtilization"] = serde_json::json!(l.gpu_memory_utilization);
    }
    // Read at startup (the engine's options); written only when off, as maxQueue.
    if !l.enable_prefix_caching {
        limits["enablePrefixCaching"] = serde_json::json!(false);
    }
    let mut hashed = serde_json::json!({
        "baseModel": spec.base_model,
        "image": image,
        "imagePullPolicy": spec.image_pull_policy,
        "storage": spec.storage,
        // With its optional fields (priorityClassName, runtimeClassName) only when set, as
        // serde writes it: pools that leave them unset keep their hash.
        "gpu": spec.gpu,
        "resources": spec.resources,
        "limits": limits,
        "auth": spec.auth,
    });
    if !spec.image_pull_secrets.is_empty() {
        hashed["imagePullSecrets"] = serde_json::json!(spec.image_pull_secrets);
    }
    // The worker builds its embedding router at start (`router.embeddingModel` needs a
    // restart); the rest of the router is reloaded.
    if let Some(m) = &spec.router.embedding_model {
        hashed["embeddingModel"] = serde_json::json!(m);
    }
    short_hash(&hashed)
}

/// Container resources: the pool's, plus the GPU request and limit.
fn resources(spec: &InferencePoolSpec) -> ResourceRequirements {
    let mut r = spec.resources.clone().unwrap_or_default();
    if spec.gpu.count > 0 {
        let q = Quantity(spec.gpu.count.to_string());
        r.limits
            .get_or_insert_with(BTreeMap::new)
            .insert(spec.gpu.resource_name.clone(), q.clone());
        r.requests
            .get_or_insert_with(BTreeMap::new)
            .insert(spec.gpu.resource_name.clone(), q);
    }
    r
}

/// The name of the worker container's port, which probes and Services refer to: a Service
/// reaches each pod on the port that pod declares, so a change of the worker port rolls
/// without a window where the Service points at a port old pods do not listen on.
pub const WORKER_PORT_NAME: &str = "http";

/// How long a probe waits for an answer. `/healthz` and `/readyz` read a few atomics and never
/// wait behind inference (the engine runs on its own thread, blocking work leaves the async
/// runtime), so a slow answer means a starved node (a CPU prefill on every core, a swapping
/// host), not a broken pod: 3 s made such pods flap out of their Service and back.
pub const PROBE_TIMEOUT_SECONDS: i32 = 10;
/// The readiness probe: every 10 s, 3 failures in a row (about 30 s of failing or timing out)
/// before a pod leaves its Service's endpoints.
pub const READINESS_PERIOD_SECONDS: i32 = 10;
/// See [`READINESS_PERIOD_SECONDS`].
pub const READINESS_FAILURES: i32 = 3;
/// The liveness probe: every 10 s, 6 failures in a row (about a minute) before the kubelet
/// restarts the worker. A restart costs a model load (minutes on a GPU), so only an HTTP
/// server that stays wedged is restarted.
pub const LIVENESS_PERIOD_SECONDS: i32 = 10;
/// See [`LIVENESS_PERIOD_SECONDS`].
pub const LIVENESS_FAILURES: i32 = 6;

fn http_probe(path: &str, period: i32, failures: i32) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.into()),
            port: IntOrString::String(WORKER_PORT_NAME.into()),
            ..Default::default()
        }),
        period_seconds: Some(period),
        failure_threshold: Some(failures),
        timeout_seconds: Some(PROBE_TIMEOUT_SECONDS),
        ..Default::default()
    }
}

/// A read-only mount of volume `name` at `path`.
fn read_only_mount(name: &str, path: &str) -> VolumeMount {
    VolumeMount {
        name: name.into(),
        mount_path: path.into(),
        read_only: Some(true),
        ..Default::default()
    }
}

/// The volumes of a worker pod and the worker container's mounts of them: the model volume
/// read-only, the WorkerConfig, scratch space, the operator token and the pool's auth Secret.
fn worker_volumes(pool: &InferencePool, config_map: &str) -> (Vec<Volume>, Vec<VolumeMount>) {
    let name = pool.metadata.name.clone().unwrap_or_default();
    let spec = &pool.spec;
    let mut volumes = vec![
        models_volume(spec, true),
        Volume {
            name: "config".into(),
            config_map: Some(ConfigMapVolumeSource {
                name: config_map.to_string(),
                ..Default::default()
            }),
            ..Default::default()
        },
        // The root filesystem is read-only; the worker gets a scratch directory.
        Volume {
            name: "tmp".into(),
            empty_dir: Some(EmptyDirVolumeSource::default()),
            ..Default::default()
        },
    ];
    let mut mounts = vec![
        read_only_mount("models", &spec.storage.mount_path),
        read_only_mount("config", WORKER_CONFIG_MOUNT),
        VolumeMount {
            name: "tmp".into(),
            mount_path: TMP_MOUNT.into(),
            ..Default::default()
        },
    ];
    // The operator's token: constant for the pool's lifetime, so it never rolls the pods.
    volumes.push(Volume {
        name: "operator-token".into(),
        secret: Some(SecretVolumeSource {
            secret_name: Some(operator_token_secret_name(&name)),
            default_mode: Some(0o440),
            ..Default::default()
        }),
        ..Default::default()
    });
    mounts.push(read_only_mount("operator-token", OPERATOR_TOKEN_MOUNT));
    if let Some(auth) = &spec.auth {
        volumes.push(Volume {
            name: "auth".into(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(auth.secret_name.clone()),
                ..Default::default()
            }),
            ..Default::default()
        });
        mounts.push(read_only_mount("auth", AUTH_MOUNT));
    }
    (volumes, mounts)
}

/// The worker container: `mole-worker serve` on the mounted WorkerConfig, listening on `port`.
fn worker_container(
    spec: &InferencePoolSpec,
    image: String,
    mounts: Vec<VolumeMount>,
    port: u16,
    otlp_traces_endpoint: Option<&str>,
) -> Container {
    let mut env = vec![json_logs()];
    if let Some(endpoint) = otlp_traces_endpoint {
        env.push(EnvVar {
            name: "MOLE_OTLP_TRACES_ENDPOINT".into(),
            value: Some(endpoint.into()),
            ..Default::default()
        });
    }
    Container {
        name: "worker".into(),
        image: Some(image),
        image_pull_policy: spec.image_pull_policy.clone(),
        command: Some(vec!["mole-worker".into()]),
        args: Some(vec![
            "serve".into(),
            "--config".into(),
            format!("{WORKER_CONFIG_MOUNT}/{WORKER_CONFIG_KEY}"),
            "--listen".into(),
            format!("0.0.0.0:{port}"),
        ]),
        env: Some(env),
        ports: Some(vec![ContainerPort {
            name: Some(WORKER_PORT_NAME.into()),
            container_port: i32::from(port),
            ..Default::default()
        }]),
        resources: Some(resources(spec)),
        // A worker that refuses its model exits with the reason as its last log line: the
        // kubelet keeps it as the termination message, which the pool's `Ready` condition
        // shows (`PodsFailing`).
        termination_message_policy: Some("FallbackToLogsOnError".into()),
        // Loading a large base model can take minutes: the startup probe allows 20.
        startup_probe: Some(http_probe("/healthz", 10, 120)),
        liveness_probe: Some(http_probe(
            "/healthz",
            LIVENESS_PERIOD_SECONDS,
            LIVENESS_FAILURES,
        )),
        readiness_probe: Some(http_probe(
            "/readyz",
            READINESS_PERIOD_SECONDS,
            READINESS_FAILURES,
        )),
        security_context: Some(restricted_container_security()),
        volume_mounts: Some(mounts),
        ..Default::default()
    }
}

/// The pod template of a worker (dynamic or merged): `mole-worker serve` on the ConfigMap
/// `config_map`, listening on `port` (the operator's `--worker-port`, which it polls pods on),
/// labelled as `meta`, with GPU scheduling, the model volume read-only, probes and restricted
/// security, running `spec.image` or the default of `images` for its hardware.
pub fn worker_pod(
    pool: &InferencePool,
    config_map: &str,
    meta: &ChildMeta,
    port: u16,
    images: &WorkerDefaults,
) -> PodTemplateSpec {
    let spec = &pool.spec;
    let image = images.serving(spec);
    let (volumes, mounts) = worker_volumes(pool, config_map);
    let mut template = PodTemplateSpec {
        metadata: Some(ObjectMeta {
            labels: Some(meta.labels.clone()),
            annotations: Some(BTreeMap::from([(
                ANNOTATION_SPEC_HASH.to_string(),
                spec_hash(spec, &image),
            )])),
            ..Default::default()
        }),
        spec: Some(PodSpec {
            security_context: Some(restricted_pod_security()),
            // It never calls the Kubernetes API: no token for a compromised process to use.
            automount_service_account_token: Some(false),
            node_selector: (!spec.gpu.node_selector.is_empty())
                .then(|| spec.gpu.node_selector.clone()),
            tolerations: (!spec.gpu.tolerations.is_empty()).then(|| spec.gpu.tolerations.clone()),
            affinity: spec.gpu.affinity.clone(),
            priority_class_name: spec.gpu.priority_class_name.clone(),
            runtime_class_name: spec.gpu.runtime_class_name.clone(),
            image_pull_secrets: image_pull_secrets(spec),
            // Long enough for in-flight generations to drain after SIGTERM.
            termination_grace_period_seconds: Some(90),
            containers: vec![worker_container(
                spec,
                image,
                mounts,
                port,
                images.otlp_traces_endpoint.as_deref(),
            )],
            volumes: Some(volumes),
            ..Default::default()
        }),
    };
    with_base_model_source(spec, template.spec.get_or_insert_with(Default::default));
    template
}
