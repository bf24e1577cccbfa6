//! Pure validation of pools and adapters. Each error names the field as users write it, so the
//! condition and the Event tell them exactly what to fix.

use mole_crds::constants::reason;
use mole_crds::{Adapter, InferencePool, InferencePoolSpec, RouterSpec, RouterStrategy};

use crate::error::FieldError;

/// Annotation that allows a pool without GPUs (`gpu.count: 0`), for CPU test clusters.
pub const ALLOW_CPU_ANNOTATION: &str = "mole.dev/allow-cpu";

/// Whether `p` is a relative path that stays inside its root (no absolute path, no `..`).
pub fn is_confined_relative(p: &str) -> bool {
    !p.is_empty() && !p.starts_with('/') && !p.split('/').any(|c| c == "..") && !p.contains('\0')
}

/// Validates a pool's spec.
pub fn validate_pool(pool: &InferencePool) -> Result<(), FieldError> {
    let spec: &InferencePoolSpec = &pool.spec;
    if spec.image.as_deref().is_some_and(|i| i.trim().is_empty()) {
        return Err(FieldError::invalid(
            "spec.image",
            "must name the mole-worker image when set (leave it out for the operator's default)",
        ));
    }
    if spec.base_model.name.trim().is_empty() {
        return Err(FieldError::invalid(
            "spec.baseModel.name",
            "must not be empty",
        ));
    }
    if !is_confined_relative(&spec.base_model.path) {
        return Err(FieldError::invalid(
            "spec.baseModel.path",
            format!(
                "{:?} must be a relative path inside the volume, without '..'",
                spec.base_model.path
            ),
        ));
    }
    if spec.storage.claim_name.trim().is_empty() {
        return Err(FieldError::invalid(
            "spec.storage.claimName",
            "must name a PersistentVolumeClaim",
        ));
    }
    if !spec.storage.mount_path.starts_with('/') {
        return Err(FieldError::invalid(
            "spec.storage.mountPath",
            "must be an absolute path",
        ));
    }
    let allow_cpu = pool
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ALLOW_CPU_ANNOTATION))
        .is_some_and(|v| v == "true");
    if spec.gpu.count == 0 && !allow_cpu {
        return Err(FieldError::invalid(
            "spec.gpu.count",
            format!(
                "a pool needs at least one GPU per pod (set gpu.count, or annotate the pool \
                 {ALLOW_CPU_ANNOTATION}=\"true\" to run on CPU)"
            ),
        ));
    }
    if spec.gpu.resource_name.trim().is_empty() {
        return Err(FieldError::invalid(
            "spec.gpu.resourceName",
            "must not be empty",
        ));
    }
    if spec.dynamic.replicas < 0 {
        return Err(FieldError::invalid(
            "spec.dynamic.replicas",
            "must be 0 or more",
        ));
    }
    // The worker refuses a config outside these bounds: refuse the pool instead of rendering it.
    if let Err(e) = spec.dynamic.limits.validate() {
        return Err(FieldError::invalid(
            format!("spec.dynamic.{}", e.field),
            e.message,
        ));
    }
    validate_router(&spec.router)?;
    if let Some(auth) = &spec.auth {
        if auth.secret_name.trim().is_empty() {
            return Err(FieldError::invalid(
                "spec.auth.secretName",
                "must name a Secret",
            ));
        }
    }
    Ok(())
}

/// Validates a pool's `spec.router`: the shared bounds, the strategies' prerequisites, no
/// strategy twice.
fn validate_router(r: &RouterSpec) -> Result<(), FieldError> {
    if let Err(e) = r.validate() {
        return Err(FieldError::invalid(
            format!("spec.router.{}", e.field),
            e.message,
        ));
    }
    if r.strategies.contains(&RouterStrategy::Classifier) && r.classifier_adapter.is_none() {
        return Err(FieldError::invalid(
            "spec.router.classifierAdapter",
            "required when spec.router.strategies contains classifier",
        ));
    }
    if r.strategies.contains(&RouterStrategy::Embedding) {
        match &r.embedding_model {
            None => {
                return Err(FieldError::invalid(
                    "spec.router.embeddingModel",
                    "required when spec.router.strategies contains embedding",
                ))
            }
            Some(p) if !is_confined_relative(p) => {
                return Err(FieldError::invalid(
                    "spec.router.embeddingModel",
                    "must be a relative path inside the volume, without '..'",
                ))
            }
            _ => {}
        }
    }
    let mut seen = Vec::new();
    for s in &r.strategies {
        if seen.contains(s) {
            return Err(FieldError::invalid(
                "spec.router.strategies",
                format!("{s:?} is listed twice"),
            ));
        }
        seen.push(*s);
    }
    Ok(())
}

fn created_key(a: &Adapter) -> (Option<i64>, String) {
    (
        a.metadata
            .creation_timestamp
            .as_ref()
            .map(|t| t.0.as_second()),
        a.metadata.name.clone().unwrap_or_default(),
    )
}

/// Validates an adapter against its pool (None: not found) and the other adapters of the
/// namespace. When two adapters of a pool claim one label, the older keeps it.
pub fn validate_adapter(
    adapter: &Adapter,
    pool: Option<&InferencePool>,
    siblings: &[Adapter],
) -> Result<(), FieldError> {
    let spec = &adapter.spec;
    if pool.is_none() {
        return Err(FieldError {
            reason: reason::POOL_NOT_FOUND,
            field: "spec.pool".into(),
            message: format!(
                "InferencePool {:?} does not exist in this namespace",
                spec.pool
            ),
        });
    }
    if spec.version.trim().is_empty() {
        return Err(FieldError::invalid("spec.version", "must not be empty"));
    }
    if !is_confined_relative(&spec.source.path) {
        return Err(FieldError::invalid(
            "spec.source.path",
            format!(
                "{:?} must be a relative path inside the pool's volume, without '..'",
                spec.source.path
            ),
        ));
    }
    if spec.serving.replicas < 0 {
        return Err(FieldError::invalid(
            "spec.serving.replicas",
            "must be 0 or more",
        ));
    }
    if let Some(acc) = spec.evaluation.as_ref().and_then(|e| e.accuracy) {
        if !(0.0..=1.0).contains(&acc) {
            return Err(FieldError::invalid(
                "spec.evaluation.accuracy",
                "must be within [0, 1]",
            ));
        }
    }
    if let Some(label) = &spec.routing.label {
        if label.trim().is_empty() {
            return Err(FieldError::invalid(
                "spec.label",
                "must not be empty when set",
            ));
        }
        let me = created_key(adapter);
        let holder = siblings.iter().filter(|o| {
            o.spec.pool == spec.pool
                && o.spec.routing.label.as_deref() == Some(label.as_str())
                && o.metadata.name != adapter.metadata.name
                && o.metadata.deletion_timestamp.is_none()
                && created_key(o) < me
        });
        if let Some(other) = holder.min_by_key(|o| created_key(o)) {
            return Err(FieldError {
                reason: reason::DUPLICATE_LABEL,
                field: "spec.label".into(),
                message: format!(
                    "label {label:?} is already used by Adapter {:?} in pool {:?}",
                    other.metadata.name.clone().unwrap_or_default(),
                    spec.pool
                ),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    pub(crate) fn pool() -> InferencePool {
        serde_yaml::from_str(
            r#"
apiVersion: mole.dev/v1alpha1
kind: InferencePool
metadata: {name: vl, namespace: ml, uid: "1"}
spec:
  baseModel: {name: Qwen/Qwen3-VL-8B-Instruct, path: base/qwen3-vl-8b}
  storage: {claimName: models}
  image: ghcr.io/mole-dev/mole-worker:0.1.0
  gpu: {count: 1}
"#,
        )
        .unwrap()
    }

    fn adapter(name: &str, label: Option<&str>, created: i64) -> Adapter {
        let mut a: Adapter = serde_yaml::from_str(&format!(
            r#"
apiVersion: mole.dev/v1alpha1
kind: Adapter
metadata: {{name: {name}, namespace: ml}}
spec: {{pool: vl, version: v1, source: {{path: adapters/{name}/v1}}}}
"#
        ))
        .unwrap();
        a.spec.routing.label = label.map(String::from);
        a.metadata.creation_timestamp = Some(Time(
            k8s_openapi::jiff::Timestamp::from_second(created).unwrap(),
        ));
        a
    }

    type Mutation<T> = fn(&mut T);

    fn field(r: Result<(), FieldError>) -> String {
        r.unwrap_err().field
    }

    #[test]
    fn valid_pool_passes_and_every_field_is_named() {
        assert_eq!(validate_pool(&pool()), Ok(()));
        // Unset is valid: the operator's default worker image applies.
        let mut unset = pool();
        unset.spec.image = None;
        assert_eq!(validate_pool(&unset), Ok(()));
        let cases: Vec<(Mutation<InferencePool>, &str)> = vec![
            (|p| p.spec.image = Some(" ".into()), "spec.image"),
            (
                |p| p.spec.base_model.name = "".into(),
                "spec.baseModel.name",
            ),
            (
                |p| p.spec.base_model.path = "/abs".into(),
                "spec.baseModel.path",
            ),
            (
                |p| p.spec.base_model.path = "a/../../etc".into(),
                "spec.baseModel.path",
            ),
            (
                |p| p.spec.storage.claim_name = "".into(),
                "spec.storage.claimName",
            ),
            (
                |p| p.spec.storage.mount_path = "models".into(),
                "spec.storage.mountPath",
            ),
            (|p| p.spec.gpu.count = 0, "spec.gpu.count"),
            (
                |p| p.spec.gpu.resource_name = "".into(),
                "spec.gpu.resourceName",
            ),
            (|p| p.spec.dynamic.replicas = -1, "spec.dynamic.replicas"),
            (
                |p| p.spec.dynamic.limits.max_loras = 0,
                "spec.dynamic.maxLoras",
            ),
            (
                |p| p.spec.dynamic.limits.max_seq_len = 8,
                "spec.dynamic.maxSeqLen",
            ),
            (
                |p| p.spec.dynamic.limits.max_queue = 100_001,
                "spec.dynamic.maxQueue",
            ),
            (
                |p| p.spec.router.min_confidence = 1.5,
                "spec.router.minConfidence",
            ),
            (
                |p| p.spec.router.embedding_threshold = -2.0,
                "spec.router.embeddingThreshold",
            ),
            (
                |p| p.spec.router.strategies.push(RouterStrategy::Classifier),
                "spec.router.classifierAdapter",
            ),
            (
                |p| p.spec.router.strategies.push(RouterStrategy::Embedding),
                "spec.router.embeddingModel",
            ),
            (
                |p| p.spec.router.strategies.push(RouterStrategy::Explicit),
                "spec.router.strategies",
            ),
        ];
        for (mutate, want) in cases {
            let mut p = pool();
            mutate(&mut p);
            assert_eq!(field(validate_pool(&p)), want);
        }
    }

    #[test]
    fn cpu_pools_need_the_explicit_annotation() {
        let mut p = pool();
        p.spec.gpu.count = 0;
        assert!(validate_pool(&p).is_err());
        p.metadata.annotations =
            Some([(ALLOW_CPU_ANNOTATION.to_string(), "true".to_string())].into());
        assert_eq!(validate_pool(&p), Ok(()));
    }

    #[test]
    fn adapter_errors_name_the_field_and_reason() {
        let p = pool();
        let a = adapter("calendar", None, 10);
        assert_eq!(validate_adapter(&a, Some(&p), &[]), Ok(()));
        let e = validate_adapter(&a, None, &[]).unwrap_err();
        assert_eq!(
            (e.reason, e.field.as_str()),
            (reason::POOL_NOT_FOUND, "spec.pool")
        );
        let cases: Vec<(Mutation<Adapter>, &str)> = vec![
            (|a| a.spec.version = "".into(), "spec.version"),
            (
                |a| a.spec.source.path = "/etc/passwd".into(),
                "spec.source.path",
            ),
            (
                |a| a.spec.source.path = "adapters/../../x".into(),
                "spec.source.path",
            ),
            (|a| a.spec.source.path = "".into(), "spec.source.path"),
            (|a| a.spec.serving.replicas = -2, "spec.serving.replicas"),
            (
                |a| {
                    a.spec.evaluation = Some(mole_crds::Evaluation {
                        accuracy: Some(1.5),
                    })
                },
                "spec.evaluation.accuracy",
            ),
            (|a| a.spec.routing.label = Some(" ".into()), "spec.label"),
        ];
        for (mutate, want) in cases {
            let mut a = adapter("calendar", None, 10);
            mutate(&mut a);
            assert_eq!(field(validate_adapter(&a, Some(&p), &[])), want);
        }
    }

    #[test]
    fn duplicate_label_goes_to_the_newer_adapter() {
        let p = pool();
        let old = adapter("calendar", Some("calendar"), 10);
        let new = adapter("calendar-2", Some("calendar"), 20);
        let all = vec![old.clone(), new.clone()];
        assert_eq!(validate_adapter(&old, Some(&p), &all), Ok(()));
        let e = validate_adapter(&new, Some(&p), &all).unwrap_err();
        assert_eq!(e.reason, reason::DUPLICATE_LABEL);
        assert!(e.message.contains("\"calendar\""));
        // Another pool may use the same label.
        let mut other = new.clone();
        other.spec.pool = "other".into();
        assert_eq!(validate_adapter(&other, Some(&p), &all), Ok(()));
    }

    #[test]
    fn confined_paths() {
        for ok in ["a", "a/b", "a/b..c", "..a/b"] {
            assert!(is_confined_relative(ok), "{ok}");
        }
        for bad in ["", "/a", "..", "a/../b", "a/.."] {
            assert!(!is_confined_relative(bad), "{bad}");
        }
    }
}
