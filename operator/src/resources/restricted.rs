//! What every pod the operator creates shares (worker pods, merge, cleanup and fetch Jobs):
//! the restricted Pod Security profile, the pool's model volume and its pull secrets; and the
//! pod of every Job, built once here ([`job_template`] around a [`tool_container`]), so a
//! rule of one (its security, its image's pull secrets, its logs) is a rule of all. Below
//! both the worker pod template ([`super::pod`]) and the base-model source
//! ([`super::fetch`]), which each build on it.

use k8s_openapi::api::core::v1::{
    Capabilities, Container, EnvVar, LocalObjectReference, PersistentVolumeClaimVolumeSource,
    PodSecurityContext, PodSpec, PodTemplateSpec, SeccompProfile, SecurityContext, Volume,
    VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use mole_crds::InferencePoolSpec;

use super::meta::ChildMeta;

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
        // The kubelet otherwise walks (and chowns) every file of the model volume at each pod
        // start: minutes for a large checkpoint. Once the volume's root carries the group, it
        // is left alone.
        fs_group_change_policy: Some("OnRootMismatch".into()),
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

/// The pool's `imagePullSecrets` as a pod spec takes them (None when there are none).
pub fn image_pull_secrets(pool: &InferencePoolSpec) -> Option<Vec<LocalObjectReference>> {
    (!pool.image_pull_secrets.is_empty()).then(|| pool.image_pull_secrets.clone())
}

/// `MOLE_LOG_FORMAT=json`: every `mole-worker` process the operator starts logs JSON lines,
/// which the operator reads back (a merge's or a fetch's `progress`) and collectors parse.
pub fn json_logs() -> EnvVar {
    EnvVar {
        name: "MOLE_LOG_FORMAT".into(),
        value: Some("json".into()),
        ..Default::default()
    }
}

/// The container of a `mole-worker <args>` tool (merge, prune, fetch) named `name`: restricted,
/// JSON logs, its failure's one-line reason as the termination message, the pool's volume
/// read-write at its mount path. Its `resources` and `envFrom` are the caller's.
pub fn tool_container(
    name: &str,
    pool: &InferencePoolSpec,
    image: String,
    args: Vec<String>,
) -> Container {
    Container {
        name: name.into(),
        image: Some(image),
        image_pull_policy: pool.image_pull_policy.clone(),
        command: Some(vec!["mole-worker".into()]),
        args: Some(args),
        env: Some(vec![json_logs()]),
        security_context: Some(restricted_container_security()),
        // The tool writes its one-line reason there; the operator copies it into the
        // Adapter's condition. A tool that dies before writing it leaves its last log lines.
        termination_message_path: Some("/dev/termination-log".into()),
        termination_message_policy: Some("FallbackToLogsOnError".into()),
        volume_mounts: Some(vec![VolumeMount {
            name: "models".into(),
            mount_path: pool.storage.mount_path.clone(),
            read_only: Some(false),
            ..Default::default()
        }]),
        ..Default::default()
    }
}

/// Where a Job's pod is scheduled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JobNodes {
    /// On the nodes `spec.merge` names (`nodeSelector`, `tolerations`, `priorityClassName`):
    /// merge and cleanup Jobs.
    Merge,
    /// Wherever the scheduler puts it: an adapter's fetch Job, which `spec.merge` does not
    /// describe.
    Any,
}

/// The pod template of every Job of the operator: `container` alone (a [`tool_container`]),
/// run once, labelled as `meta`, under the restricted profile with no service-account token,
/// the pool's volume read-write and its image's pull secrets, on the nodes of `nodes`.
pub fn job_template(
    pool: &InferencePoolSpec,
    meta: &ChildMeta,
    container: Container,
    nodes: JobNodes,
) -> PodTemplateSpec {
    let merge_nodes = nodes == JobNodes::Merge;
    PodTemplateSpec {
        metadata: Some(ObjectMeta {
            labels: Some(meta.labels.clone()),
            ..Default::default()
        }),
        spec: Some(PodSpec {
            restart_policy: Some("Never".into()),
            security_context: Some(restricted_pod_security()),
            // It never calls the Kubernetes API: no token for a compromised process to use.
            automount_service_account_token: Some(false),
            node_selector: (merge_nodes && !pool.merge.node_selector.is_empty())
                .then(|| pool.merge.node_selector.clone()),
            tolerations: (merge_nodes && !pool.merge.tolerations.is_empty())
                .then(|| pool.merge.tolerations.clone()),
            // Its own class, not the serving pods': see `merge.priorityClassName`. No
            // runtimeClassName: a Job needs no GPU, and a GPU runtime handler is often
            // missing on the CPU nodes it should run on.
            priority_class_name: pool
                .merge
                .priority_class_name
                .clone()
                .filter(|_| merge_nodes),
            image_pull_secrets: image_pull_secrets(pool),
            containers: vec![container],
            volumes: Some(vec![models_volume(pool, false)]),
            ..Default::default()
        }),
    }
}
