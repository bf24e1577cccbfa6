//! What every pod the operator creates shares (worker pods, merge, cleanup and fetch Jobs):
//! the restricted Pod Security profile, the pool's model volume and its pull secrets. Below
//! both the worker pod template ([`super::pod`]) and the base-model source
//! ([`super::fetch`]), which each build on it.

use k8s_openapi::api::core::v1::{
    Capabilities, LocalObjectReference, PersistentVolumeClaimVolumeSource, PodSecurityContext,
    SeccompProfile, SecurityContext, Volume,
};
use mole_crds::InferencePoolSpec;

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
