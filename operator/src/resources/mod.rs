//! Pure builders of every child object of a pool: the worker ConfigMap, the dynamic
//! Deployment, its Service and PodDisruptionBudget. No client, no I/O: unit-tested directly.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{
    Deployment, DeploymentSpec, DeploymentStrategy, RollingUpdateDeployment,
};
use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMap, ConfigMapVolumeSource, Container, ContainerPort, EmptyDirVolumeSource,
    EnvVar, HTTPGetAction, PersistentVolumeClaimVolumeSource, PodSecurityContext, PodSpec,
    PodTemplateSpec, Probe, ResourceRequirements, SeccompProfile, Secret, SecretVolumeSource,
    SecurityContext, Service, ServicePort, ServiceSpec, Volume, VolumeMount,
};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use k8s_openapi::ByteString;
use kube::Resource;
use mole_crds::constants::*;
use mole_crds::{
    Adapter, InferencePool, InferencePoolSpec, WorkerAdapter, WorkerAuth, WorkerBaseModel,
    WorkerConfig, WorkerLimits, WorkerMode, WorkerRouter,
};
use sha2::{Digest, Sha256};

/// Where the pool's auth Secret is mounted in worker pods. Not under `/etc/mole`: that is the
/// ConfigMap's (read-only) volume, and a mount point cannot be created inside it.
pub const AUTH_MOUNT: &str = "/var/run/mole/auth";
/// Where the pool's operator-token Secret is mounted in worker pods (dynamic and merged).
pub const OPERATOR_TOKEN_MOUNT: &str = "/var/run/mole/operator";
/// Key of the operator token in its Secret (and file name under [`OPERATOR_TOKEN_MOUNT`]).
pub const OPERATOR_TOKEN_KEY: &str = "token";

/// Name of the Secret holding the token the operator presents to a pool's worker pods.
pub fn operator_token_secret_name(pool: &str) -> String {
    format!("{pool}-operator-token")
}

/// Path of the operator token file inside worker pods.
pub fn operator_token_file() -> String {
    format!("{OPERATOR_TOKEN_MOUNT}/{OPERATOR_TOKEN_KEY}")
}

/// The Secret `<pool>-operator-token` with `token`, owned by the pool. Created once when absent
/// and never rewritten (a new token on every reconcile would lock the operator out of pods
/// that have not re-read the file yet).
pub fn operator_token_secret(pool: &InferencePool, token: &str) -> Secret {
    let name = pool.metadata.name.clone().unwrap_or_default();
    Secret {
        metadata: ObjectMeta {
            name: Some(operator_token_secret_name(&name)),
            namespace: pool.metadata.namespace.clone(),
            labels: Some(labels(&name, "dynamic")),
            owner_references: Some(vec![owner(pool)]),
            ..Default::default()
        },
        data: Some(BTreeMap::from([(
            OPERATOR_TOKEN_KEY.to_string(),
            ByteString(token.as_bytes().to_vec()),
        )])),
        type_: Some("Opaque".into()),
        ..Default::default()
    }
}

/// Name of the pool's worker ConfigMap.
pub fn config_map_name(pool: &str) -> String {
    format!("{pool}-config")
}
/// Name of the pool's dynamic Deployment (and its PDB).
pub fn dynamic_name(pool: &str) -> String {
    format!("{pool}-dynamic")
}

/// Labels of a pool's children with the given component (`dynamic`, `merged`, `merge`).
pub fn labels(pool: &str, component: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (LABEL_APP_NAME.to_string(), APP_NAME.to_string()),
        (LABEL_APP_INSTANCE.to_string(), pool.to_string()),
        (LABEL_APP_COMPONENT.to_string(), component.to_string()),
        (LABEL_APP_MANAGED_BY.to_string(), MANAGED_BY.to_string()),
        (LABEL_POOL.to_string(), pool.to_string()),
        (LABEL_ROLE.to_string(), component.to_string()),
    ])
}

/// The label selector of a pool's pods of one component (a subset of [`labels`] that never
/// changes, since Deployment selectors are immutable).
pub fn selector(pool: &str, component: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (LABEL_APP_NAME.to_string(), APP_NAME.to_string()),
        (LABEL_APP_INSTANCE.to_string(), pool.to_string()),
        (LABEL_APP_COMPONENT.to_string(), component.to_string()),
    ])
}

/// Owner reference making the pool own (and garbage-collect) a child.
pub fn owner(pool: &InferencePool) -> OwnerReference {
    pool.controller_owner_ref(&())
        .expect("pools read from the API have a name and uid")
}

/// Pod security "restricted": non-root, read-only root filesystem, no privilege escalation,
/// all capabilities dropped, seccomp RuntimeDefault.
pub fn restricted_container_security() -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        read_only_root_filesystem: Some(true),
        run_as_non_root: Some(true),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".into()]),
            ..Default::default()
        }),
        seccomp_profile: Some(SeccompProfile {
            type_: "RuntimeDefault".into(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Pod-level half of the restricted profile.
pub fn restricted_pod_security() -> PodSecurityContext {
    PodSecurityContext {
        run_as_non_root: Some(true),
        run_as_user: Some(65532),
        run_as_group: Some(65532),
        fs_group: Some(65532),
        seccomp_profile: Some(SeccompProfile {
            type_: "RuntimeDefault".into(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The pool's model volume (read-only for servers, read-write for merge Jobs).
pub fn models_volume(pool: &InferencePoolSpec, read_only: bool) -> Volume {
    Volume {
        name: "models".into(),
        persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
            claim_name: pool.storage.claim_name.clone(),
            read_only: Some(read_only),
        }),
        ..Default::default()
    }
}

/// Short sha256 of a JSON value (annotations, names).
pub fn short_hash(v: &serde_json::Value) -> String {
    hex::encode(&Sha256::digest(v.to_string().as_bytes())[..8])
}

/// Hash of exactly the fields whose change must restart the pool's pods: base model, image,
/// storage, GPU scheduling, resources and engine limits. Adapters are not in it: adding,
/// updating or removing an adapter never restarts a pod.
pub fn spec_hash(spec: &InferencePoolSpec) -> String {
    let mut limits = serde_json::json!({
        "maxLoras": spec.dynamic.max_loras,
        "maxCpuLoras": spec.dynamic.max_cpu_loras,
        "maxLoraRank": spec.dynamic.max_lora_rank,
        "maxBatchSize": spec.dynamic.max_batch_size,
        "maxSeqLen": spec.dynamic.max_seq_len,
    });
    // Only when set: pools that leave it unset keep the hash (and pods) they had before the
    // field existed.
    if let Some(d) = spec.dynamic.lora_dtype {
        limits["loraDtype"] = serde_json::json!(d);
    }
    short_hash(&serde_json::json!({
        "baseModel": spec.base_model,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "storage": spec.storage,
        "gpu": spec.gpu,
        "resources": spec.resources,
        "limits": limits,
        "auth": spec.auth,
    }))
}

/// One adapter as registered in a pool: the Adapter and its allocated id.
#[derive(Debug, Clone)]
pub struct Registered<'a> {
    /// The Adapter.
    pub adapter: &'a Adapter,
    /// Its pool-wide LoRA id.
    pub lora_id: u32,
}

/// The WorkerConfig of a pool's dynamic pods: the base model, every registered adapter, the
/// router and the limits. Adapters are sorted by name so the config (and its hash) is stable.
pub fn worker_config(
    name: &str,
    spec: &InferencePoolSpec,
    adapters: &[Registered<'_>],
) -> WorkerConfig {
    let mut list: Vec<WorkerAdapter> = adapters
        .iter()
        .map(|r| {
            let a = &r.adapter.spec;
            WorkerAdapter {
                name: r.adapter.metadata.name.clone().unwrap_or_default(),
                version: a.version.clone(),
                lora_id: r.lora_id,
                path: a.source.path.clone(),
                label: a.label.clone(),
                description: a.description.clone(),
                examples: a.examples.clone(),
                domains: a.domains.clone(),
                keywords: a.keywords.clone(),
                extensions: a.extensions.clone(),
                mode: a.serving.mode,
                // The merge-down plan decides both (the Adapter controller records it in the
                // status): forward to merged pods while they serve it, and keep it loaded in
                // the dynamic pods unless the plan says otherwise. Deriving them here from the
                // phase or serving mode deadlocks a merged → dynamic switch.
                merged_endpoint: r
                    .adapter
                    .status
                    .as_ref()
                    .and_then(|s| s.merged_endpoint.clone()),
                load: r
                    .adapter
                    .status
                    .as_ref()
                    .and_then(|s| s.load_dynamic)
                    .unwrap_or(true),
            }
        })
        .collect();
    list.sort_by(|a, b| a.name.cmp(&b.name));
    let r = &spec.router;
    WorkerConfig {
        mode: WorkerMode::Dynamic,
        pool: name.to_string(),
        model_root: spec.storage.mount_path.clone(),
        base_model: WorkerBaseModel {
            name: spec.base_model.name.clone(),
            path: spec.base_model.path.clone(),
            dtype: spec.base_model.dtype,
        },
        merged: None,
        adapters: list,
        router: WorkerRouter {
            strategies: r.strategies.clone(),
            classifier_adapter: r.classifier_adapter.clone(),
            min_confidence: r.min_confidence,
            embedding_model: r.embedding_model.clone(),
            embedding_threshold: r.embedding_threshold,
            fallback: r.fallback,
            prefer_merged: r.prefer_merged,
            fallback_to_dynamic: r.fallback_to_dynamic,
        },
        limits: WorkerLimits {
            max_loras: spec.dynamic.max_loras,
            max_cpu_loras: spec.dynamic.max_cpu_loras,
            max_lora_rank: spec.dynamic.max_lora_rank,
            lora_dtype: spec.dynamic.lora_dtype,
            max_batch_size: spec.dynamic.max_batch_size,
            max_seq_len: spec.dynamic.max_seq_len,
            max_queue: spec.dynamic.max_queue,
            ..WorkerLimits::default()
        },
        // Every worker accepts the operator's token on the endpoints the operator calls.
        auth: Some(WorkerAuth {
            api_keys_file: spec
                .auth
                .as_ref()
                .map(|a| format!("{AUTH_MOUNT}/{}", a.key)),
            admin_token_file: spec
                .auth
                .as_ref()
                .and_then(|a| a.admin_token_key.as_ref())
                .map(|k| format!("{AUTH_MOUNT}/{k}")),
            operator_token_file: Some(operator_token_file()),
        }),
    }
}

/// The ConfigMap `<pool>-config` holding the WorkerConfig as JSON, annotated with its
/// [`WorkerConfig::content_hash`] (the hash a worker compares on `POST /admin/reload`).
pub fn config_map(pool: &InferencePool, config: &WorkerConfig) -> (ConfigMap, String) {
    let name = pool.metadata.name.clone().unwrap_or_default();
    let json = serde_json::to_string_pretty(config).expect("WorkerConfig serializes");
    let hash = config.content_hash();
    let cm = ConfigMap {
        metadata: ObjectMeta {
            name: Some(config_map_name(&name)),
            namespace: pool.metadata.namespace.clone(),
            labels: Some(labels(&name, "dynamic")),
            annotations: Some(BTreeMap::from([(
                ANNOTATION_CONFIG_HASH.to_string(),
                hash.clone(),
            )])),
            owner_references: Some(vec![owner(pool)]),
            ..Default::default()
        },
        data: Some(BTreeMap::from([(WORKER_CONFIG_KEY.to_string(), json)])),
        ..Default::default()
    };
    (cm, hash)
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

fn http_probe(path: &str, period: i32, failures: i32) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.into()),
            port: IntOrString::String("http".into()),
            ..Default::default()
        }),
        period_seconds: Some(period),
        failure_threshold: Some(failures),
        timeout_seconds: Some(3),
        ..Default::default()
    }
}

/// The pod template of a worker (dynamic or merged): `mole-worker serve` on the ConfigMap,
/// GPU scheduling, the model volume read-only, probes, restricted security.
pub fn worker_pod(
    pool: &InferencePool,
    config_map: &str,
    component: &str,
    extra_labels: BTreeMap<String, String>,
) -> PodTemplateSpec {
    let name = pool.metadata.name.clone().unwrap_or_default();
    let spec = &pool.spec;
    let mut pod_labels = labels(&name, component);
    pod_labels.extend(extra_labels);
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
        VolumeMount {
            name: "models".into(),
            mount_path: spec.storage.mount_path.clone(),
            read_only: Some(true),
            ..Default::default()
        },
        VolumeMount {
            name: "config".into(),
            mount_path: WORKER_CONFIG_MOUNT.into(),
            read_only: Some(true),
            ..Default::default()
        },
        VolumeMount {
            name: "tmp".into(),
            mount_path: "/tmp".into(),
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
    mounts.push(VolumeMount {
        name: "operator-token".into(),
        mount_path: OPERATOR_TOKEN_MOUNT.into(),
        read_only: Some(true),
        ..Default::default()
    });
    if let Some(auth) = &spec.auth {
        volumes.push(Volume {
            name: "auth".into(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(auth.secret_name.clone()),
                ..Default::default()
            }),
            ..Default::default()
        });
        mounts.push(VolumeMount {
            name: "auth".into(),
            mount_path: AUTH_MOUNT.into(),
            read_only: Some(true),
            ..Default::default()
        });
    }
    PodTemplateSpec {
        metadata: Some(ObjectMeta {
            labels: Some(pod_labels),
            annotations: Some(BTreeMap::from([(
                ANNOTATION_SPEC_HASH.to_string(),
                spec_hash(spec),
            )])),
            ..Default::default()
        }),
        spec: Some(PodSpec {
            security_context: Some(restricted_pod_security()),
            node_selector: (!spec.gpu.node_selector.is_empty())
                .then(|| spec.gpu.node_selector.clone()),
            tolerations: (!spec.gpu.tolerations.is_empty()).then(|| spec.gpu.tolerations.clone()),
            affinity: spec.gpu.affinity.clone(),
            // Long enough for in-flight generations to drain after SIGTERM.
            termination_grace_period_seconds: Some(90),
            containers: vec![Container {
                name: "worker".into(),
                image: Some(spec.image.clone()),
                image_pull_policy: spec.image_pull_policy.clone(),
                command: Some(vec!["mole-worker".into()]),
                args: Some(vec![
                    "serve".into(),
                    "--config".into(),
                    format!("{WORKER_CONFIG_MOUNT}/{WORKER_CONFIG_KEY}"),
                    "--listen".into(),
                    format!("0.0.0.0:{WORKER_PORT}"),
                ]),
                env: Some(vec![EnvVar {
                    name: "MOLE_LOG_FORMAT".into(),
                    value: Some("json".into()),
                    ..Default::default()
                }]),
                ports: Some(vec![ContainerPort {
                    name: Some("http".into()),
                    container_port: WORKER_PORT as i32,
                    ..Default::default()
                }]),
                resources: Some(resources(spec)),
                // Loading a large base model can take minutes: the startup probe allows 20.
                startup_probe: Some(http_probe("/healthz", 10, 120)),
                liveness_probe: Some(http_probe("/healthz", 10, 3)),
                readiness_probe: Some(http_probe("/readyz", 5, 2)),
                security_context: Some(restricted_container_security()),
                volume_mounts: Some(mounts),
                ..Default::default()
            }],
            volumes: Some(volumes),
            ..Default::default()
        }),
    }
}

/// The Deployment `<pool>-dynamic`.
pub fn dynamic_deployment(pool: &InferencePool) -> Deployment {
    let name = pool.metadata.name.clone().unwrap_or_default();
    Deployment {
        metadata: ObjectMeta {
            name: Some(dynamic_name(&name)),
            namespace: pool.metadata.namespace.clone(),
            labels: Some(labels(&name, "dynamic")),
            owner_references: Some(vec![owner(pool)]),
            ..Default::default()
        },
        spec: Some(DeploymentSpec {
            replicas: Some(pool.spec.dynamic.replicas),
            selector: LabelSelector {
                match_labels: Some(selector(&name, "dynamic")),
                ..Default::default()
            },
            // A GPU pod never starts before an old one is gone when the node pool is full;
            // maxSurge 1 lets a rollout proceed when there is room.
            strategy: Some(DeploymentStrategy {
                type_: Some("RollingUpdate".into()),
                rolling_update: Some(RollingUpdateDeployment {
                    max_surge: Some(IntOrString::Int(1)),
                    max_unavailable: Some(IntOrString::Int(0)),
                }),
            }),
            template: worker_pod(pool, &config_map_name(&name), "dynamic", BTreeMap::new()),
            ..Default::default()
        }),
        status: None,
    }
}

/// The Service `<pool>` in front of the dynamic pods.
pub fn service(pool: &InferencePool) -> Service {
    let name = pool.metadata.name.clone().unwrap_or_default();
    Service {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            namespace: pool.metadata.namespace.clone(),
            labels: Some(labels(&name, "dynamic")),
            owner_references: Some(vec![owner(pool)]),
            ..Default::default()
        },
        spec: Some(ServiceSpec {
            selector: Some(selector(&name, "dynamic")),
            ports: Some(vec![ServicePort {
                name: Some("http".into()),
                port: WORKER_PORT as i32,
                target_port: Some(IntOrString::String("http".into())),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        status: None,
    }
}

/// The PodDisruptionBudget of the dynamic pods: at most one voluntarily evicted at a time.
pub fn pdb(pool: &InferencePool) -> PodDisruptionBudget {
    let name = pool.metadata.name.clone().unwrap_or_default();
    PodDisruptionBudget {
        metadata: ObjectMeta {
            name: Some(dynamic_name(&name)),
            namespace: pool.metadata.namespace.clone(),
            labels: Some(labels(&name, "dynamic")),
            owner_references: Some(vec![owner(pool)]),
            ..Default::default()
        },
        spec: Some(PodDisruptionBudgetSpec {
            max_unavailable: Some(IntOrString::Int(1)),
            selector: Some(LabelSelector {
                match_labels: Some(selector(&name, "dynamic")),
                ..Default::default()
            }),
            ..Default::default()
        }),
        status: None,
    }
}

/// Pod-template annotation: the merged output a merged Deployment serves.
pub const ANNOTATION_MERGED_OUTPUT: &str = "mole.dev/merged-output";
/// Pod-template annotation: the adapter version a merged Deployment serves.
pub const ANNOTATION_ADAPTER_VERSION: &str = "mole.dev/adapter-version";

/// Name of an adapter's merged Deployment, Service and PDB: `<pool>-<adapter>`.
pub fn merged_name(pool: &str, adapter: &str) -> String {
    format!("{pool}-{adapter}")
}

/// Name of the ConfigMap of an adapter's merged pods serving `output`:
/// `<pool>-<adapter>-<short hash of output>`. One per output, so rewriting it for a new
/// version never switches the old pods (whose file watcher re-reads their ConfigMap) to the
/// new weights before the Deployment rolls them.
pub fn merged_config_name(pool: &str, adapter: &str, output: &str) -> String {
    let h = short_hash(&serde_json::Value::String(output.to_string()));
    format!("{pool}-{adapter}-{}", &h[..10])
}

/// The WorkerConfig of a merged pod: the merged weights at `output`, served as `adapter`.
pub fn merged_worker_config(
    pool_name: &str,
    spec: &InferencePoolSpec,
    adapter: &str,
    version: &str,
    output: &str,
) -> WorkerConfig {
    let mut wc = worker_config(pool_name, spec, &[]);
    wc.mode = WorkerMode::Merged;
    wc.merged = Some(mole_crds::MergedModel {
        adapter: adapter.to_string(),
        version: version.to_string(),
        path: output.to_string(),
    });
    wc
}

/// The merged children of an adapter: ConfigMap, Deployment, Service and PDB, owned by the
/// Adapter (`owner`) so they go with it.
pub fn merged_children(
    pool: &InferencePool,
    adapter: &str,
    version: &str,
    output: &str,
    replicas: i32,
    owner: OwnerReference,
) -> (ConfigMap, Deployment, Service, PodDisruptionBudget) {
    let pool_name = pool.metadata.name.clone().unwrap_or_default();
    let name = merged_name(&pool_name, adapter);
    let ns = pool.metadata.namespace.clone();
    let component = "merged";
    let mut lbl = labels(&pool_name, component);
    lbl.insert(LABEL_ADAPTER.to_string(), adapter.to_string());
    let mut sel = selector(&pool_name, component);
    sel.insert(LABEL_ADAPTER.to_string(), adapter.to_string());
    let meta = |n: String| ObjectMeta {
        name: Some(n),
        namespace: ns.clone(),
        labels: Some(lbl.clone()),
        owner_references: Some(vec![owner.clone()]),
        ..Default::default()
    };
    let wc = merged_worker_config(&pool_name, &pool.spec, adapter, version, output);
    let cm_name = merged_config_name(&pool_name, adapter, output);
    let mut cm_meta = meta(cm_name.clone());
    cm_meta.annotations = Some(BTreeMap::from([
        (ANNOTATION_MERGED_OUTPUT.to_string(), output.to_string()),
        (ANNOTATION_CONFIG_HASH.to_string(), wc.content_hash()),
    ]));
    let cm = ConfigMap {
        metadata: cm_meta,
        data: Some(BTreeMap::from([(
            WORKER_CONFIG_KEY.to_string(),
            serde_json::to_string_pretty(&wc).expect("WorkerConfig serializes"),
        )])),
        ..Default::default()
    };
    let mut template = worker_pod(
        pool,
        &cm_name,
        component,
        BTreeMap::from([(LABEL_ADAPTER.to_string(), adapter.to_string())]),
    );
    // The output and version are in the template: switching them is a rolling update, and the
    // operator reads back what a Deployment serves from here.
    let ann = template
        .metadata
        .get_or_insert_with(Default::default)
        .annotations
        .get_or_insert_with(BTreeMap::new);
    ann.insert(ANNOTATION_MERGED_OUTPUT.to_string(), output.to_string());
    ann.insert(ANNOTATION_ADAPTER_VERSION.to_string(), version.to_string());
    let deploy = Deployment {
        metadata: meta(name.clone()),
        spec: Some(DeploymentSpec {
            replicas: Some(replicas),
            selector: LabelSelector {
                match_labels: Some(sel.clone()),
                ..Default::default()
            },
            strategy: Some(DeploymentStrategy {
                type_: Some("RollingUpdate".into()),
                rolling_update: Some(RollingUpdateDeployment {
                    max_surge: Some(IntOrString::Int(1)),
                    max_unavailable: Some(IntOrString::Int(0)),
                }),
            }),
            template,
            ..Default::default()
        }),
        status: None,
    };
    let svc = Service {
        metadata: meta(name.clone()),
        spec: Some(ServiceSpec {
            selector: Some(sel.clone()),
            ports: Some(vec![ServicePort {
                name: Some("http".into()),
                port: WORKER_PORT as i32,
                target_port: Some(IntOrString::String("http".into())),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        status: None,
    };
    let pdb = PodDisruptionBudget {
        metadata: meta(name),
        spec: Some(PodDisruptionBudgetSpec {
            max_unavailable: Some(IntOrString::Int(1)),
            selector: Some(LabelSelector {
                match_labels: Some(sel),
                ..Default::default()
            }),
            ..Default::default()
        }),
        status: None,
    };
    (cm, deploy, svc, pdb)
}

/// In-cluster URL of the pool's Service.
pub fn endpoint(pool: &InferencePool) -> String {
    format!(
        "http://{}.{}.svc:{WORKER_PORT}",
        pool.metadata.name.clone().unwrap_or_default(),
        pool.metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into())
    )
}

#[cfg(test)]
mod tests;
