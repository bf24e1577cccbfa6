//! A pool's rules: its model, pods, rollout, fleet policy, scaling and router.

use mole_crds::{
    InferencePool, InferencePoolSpec, ModelSource, ReasoningParser, RouterSpec, RouterStrategy,
    ToolCallParser,
};

use super::{
    dns_name, is_confined_relative, is_dns1035_label, parse_source, validate_secret_ref,
    ALLOW_CPU_ANNOTATION,
};
use crate::error::FieldError;
use crate::resources::{mount_path_problem, rolling_update, scaled_value, MAX_CHILD_NAME};

/// A pool's output formats: a name vLLM may know but the worker does not parse would leave
/// tool calls or reasoning unparsed, so the pool is refused, naming the field. The names are
/// the worker's enums' ([`ToolCallParser::NAMES`], [`ReasoningParser::NAMES`]): a format the
/// worker learns is accepted here with no change.
fn validate_parsers(b: &mole_crds::BaseModel) -> Result<(), FieldError> {
    let refuse = |field: &str, name: &str, known: &[&str]| {
        FieldError::invalid(
            field,
            format!(
                "{name:?} is not a format mole parses (one of: {}); leave it unset to detect \
                 the format from the chat template",
                known.join(", ")
            ),
        )
    };
    if let Some(n) = &b.tool_call_parser {
        if n.parse::<ToolCallParser>().is_err() {
            return Err(refuse(
                "spec.baseModel.toolCallParser",
                n,
                ToolCallParser::NAMES,
            ));
        }
    }
    if let Some(n) = &b.reasoning_parser {
        if n.parse::<ReasoningParser>().is_err() {
            return Err(refuse(
                "spec.baseModel.reasoningParser",
                n,
                ReasoningParser::NAMES,
            ));
        }
    }
    Ok(())
}

/// The names the pods' specs refer to: the API server refuses a pod whose pull Secret,
/// PriorityClass or RuntimeClass name is malformed, and a Deployment would then sit without
/// pods and without saying why on the pool; refuse the pool instead, naming the field.
fn validate_pod_names(spec: &InferencePoolSpec) -> Result<(), FieldError> {
    for (i, s) in spec.image_pull_secrets.iter().enumerate() {
        dns_name(
            format!("spec.imagePullSecrets[{i}].name"),
            "Secret",
            &s.name,
        )?;
    }
    if let Some(n) = &spec.gpu.priority_class_name {
        dns_name("spec.gpu.priorityClassName".into(), "PriorityClass", n)?;
    }
    if let Some(n) = &spec.gpu.runtime_class_name {
        dns_name("spec.gpu.runtimeClassName".into(), "RuntimeClass", n)?;
    }
    if let Some(n) = &spec.merge.priority_class_name {
        dns_name("spec.merge.priorityClassName".into(), "PriorityClass", n)?;
    }
    Ok(())
}

/// Validates a pool's spec.
pub fn validate_pool(pool: &InferencePool) -> Result<(), FieldError> {
    let spec: &InferencePoolSpec = &pool.spec;
    // The pool's Service is `<pool>` and its name is a label value of every child: a name the
    // API server would refuse there leaves the pool without a Service, so refuse it here.
    let name = pool.metadata.name.as_deref().unwrap_or_default();
    if !is_dns1035_label(name) {
        return Err(FieldError::invalid(
            "metadata.name",
            format!(
                "{name:?} cannot name the pool's Service: it must be a DNS-1035 label (lower \
                 case letters, digits and '-', starting with a letter, at most \
                 {MAX_CHILD_NAME} characters)"
            ),
        ));
    }
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
    validate_parsers(&spec.base_model)?;
    if spec.storage.claim_name.trim().is_empty() {
        return Err(FieldError::invalid(
            "spec.storage.claimName",
            "must name a PersistentVolumeClaim",
        ));
    }
    if let Some(uri) = &spec.base_model.source {
        let source = parse_source("spec.baseModel.source", uri)?;
        if let ModelSource::Pvc { claim, .. } = &source {
            if *claim == spec.storage.claim_name {
                return Err(FieldError::invalid(
                    "spec.baseModel.source",
                    format!(
                        "{uri:?} names the pool's own claim: set spec.baseModel.path to the \
                         directory instead"
                    ),
                ));
            }
        }
    }
    validate_secret_ref(
        "spec.baseModel.secretRef",
        spec.base_model.secret_ref.as_ref(),
    )?;
    if let Some(problem) = mount_path_problem(&spec.storage.mount_path) {
        return Err(FieldError::invalid("spec.storage.mountPath", problem));
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
    validate_scaling(&spec.dynamic)?;
    if let Some(t) = &spec.merge.traffic {
        validate_traffic(t)?;
    }
    if let Some(p) = &spec.dynamic.placement {
        if p.min_replicas < 1 {
            return Err(FieldError::invalid(
                "spec.dynamic.placement.minReplicas",
                "must be at least 1: every adapter is loaded by some pod",
            ));
        }
        if !(p.load_factor >= 1.0 && p.load_factor.is_finite()) {
            return Err(FieldError::invalid(
                "spec.dynamic.placement.loadFactor",
                format!(
                    "{} must be at least 1: no pod can hold less than the mean",
                    p.load_factor
                ),
            ));
        }
    }
    if let Some(z) = &spec.merge.scale_to_zero {
        if z.idle_seconds < 60 {
            return Err(FieldError::invalid(
                "spec.merge.scaleToZero.idleSeconds",
                format!(
                    "{} must be at least 60: the operator reads traffic about once a minute, \
                     so a shorter idle time would park adapters between two requests",
                    z.idle_seconds
                ),
            ));
        }
    }
    // The worker refuses a config outside these bounds: refuse the pool instead of rendering it.
    if let Err(e) = spec.dynamic.limits.validate() {
        return Err(FieldError::invalid(
            format!("spec.dynamic.{}", e.field),
            e.message,
        ));
    }
    validate_pod_names(spec)?;
    // Percentages round differently at each count: every count the autoscaler may pick has
    // to roll out.
    let (min, max) = spec.dynamic.replica_range();
    let field = if spec.dynamic.autoscaling.is_some() {
        "spec.dynamic.autoscaling"
    } else {
        "spec.dynamic.replicas"
    };
    for replicas in min..=max {
        validate_rollout(spec, replicas, field)?;
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

/// Checks `spec.rollout` (with the hardware defaults filled in) for a Deployment of
/// `replicas` (named `replicas_field`): well-formed values, a rollout that can progress (the
/// Deployment controller cannot move with both at 0), and with several replicas at least one
/// pod left serving.
pub fn validate_rollout(
    spec: &InferencePoolSpec,
    replicas: i32,
    replicas_field: &str,
) -> Result<(), FieldError> {
    let r = rolling_update(spec);
    let resolve = |field: &str,
                   v: Option<&k8s_openapi::apimachinery::pkg::util::intstr::IntOrString>,
                   up: bool| {
        let v = v.expect("rolling_update fills both");
        scaled_value(v, replicas, up).map_err(|m| FieldError::invalid(field, m))
    };
    let surge = resolve("spec.rollout.maxSurge", r.max_surge.as_ref(), true)?;
    let unavailable = resolve(
        "spec.rollout.maxUnavailable",
        r.max_unavailable.as_ref(),
        false,
    )?;
    if surge == 0 && unavailable == 0 && replicas > 0 {
        return Err(FieldError::invalid(
            "spec.rollout",
            format!(
                "maxSurge and maxUnavailable are both 0 for {replicas} replicas: the rollout \
                 could never replace a pod (allow one more pod, or one pod down)"
            ),
        ));
    }
    if replicas > 1 && unavailable >= replicas {
        return Err(FieldError::invalid(
            "spec.rollout.maxUnavailable",
            format!(
                "{unavailable} of {replicas} replicas ({replicas_field}) may go down at once: \
                 it must leave at least one pod serving"
            ),
        ));
    }
    Ok(())
}

/// Validates `spec.merge.traffic`: shares in [0, 1] with demotion below promotion (the band
/// between them is the hysteresis), non-negative times.
pub fn validate_traffic(t: &mole_crds::TrafficMergeSpec) -> Result<(), FieldError> {
    let f = |k: &str| format!("spec.merge.traffic.{k}");
    let share = |x: f64| (0.0..=1.0).contains(&x);
    if !share(t.promote_share) || t.promote_share == 0.0 {
        return Err(FieldError::invalid(
            f("promoteShare"),
            format!("{} must be in (0, 1]", t.promote_share),
        ));
    }
    if !share(t.demote_share) || t.demote_share >= t.promote_share {
        return Err(FieldError::invalid(
            f("demoteShare"),
            format!(
                "{} must be 0 or more and below promoteShare {} (the band between them keeps an \
                 adapter from flapping)",
                t.demote_share, t.promote_share
            ),
        ));
    }
    if t.window_seconds < 0 || t.min_hold_seconds < 0 {
        return Err(FieldError::invalid(
            f(if t.window_seconds < 0 {
                "windowSeconds"
            } else {
                "minHoldSeconds"
            }),
            "must be 0 or more",
        ));
    }
    if let Some(c) = &t.capacity {
        // The CRD's schema bounds both; a spec that reached the operator another way (or NaN,
        // which no bound refuses) must not make every adapter look infinitely valuable.
        if !(c.merged_tokens_per_second.is_finite() && c.merged_tokens_per_second > 0.0) {
            return Err(FieldError::invalid(
                f("capacity.mergedTokensPerSecond"),
                format!("{} must be a positive number", c.merged_tokens_per_second),
            ));
        }
        if !(c.dynamic_ratio.is_finite() && c.dynamic_ratio > 0.0 && c.dynamic_ratio <= 1.5) {
            return Err(FieldError::invalid(
                f("capacity.dynamicRatio"),
                format!("{} must be in (0, 1.5]", c.dynamic_ratio),
            ));
        }
    }
    Ok(())
}

/// Validates `spec.dynamic.replicas` and `spec.dynamic.autoscaling`: exclusive (both set,
/// the operator and the HPA would fight over the Deployment's count), and bounds the HPA
/// accepts.
pub fn validate_scaling(d: &mole_crds::DynamicSpec) -> Result<(), FieldError> {
    if d.replicas.is_some_and(|r| r < 0) {
        return Err(FieldError::invalid(
            "spec.dynamic.replicas",
            "must be 0 or more",
        ));
    }
    let Some(a) = &d.autoscaling else {
        return Ok(());
    };
    if d.replicas.is_some() {
        return Err(FieldError::invalid(
            "spec.dynamic.replicas",
            "must be unset with spec.dynamic.autoscaling: the HorizontalPodAutoscaler owns the \
             count (bound it with autoscaling.minReplicas/maxReplicas; `replicas: null` removes \
             the `replicas: 1` that pools created by earlier CRDs carry as a default)",
        ));
    }
    let f = |k: &str| format!("spec.dynamic.autoscaling.{k}");
    if a.min_replicas < 1 {
        return Err(FieldError::invalid(
            f("minReplicas"),
            "must be at least 1 (an HPA does not scale from 0)",
        ));
    }
    if a.max_replicas < a.min_replicas {
        return Err(FieldError::invalid(
            f("maxReplicas"),
            format!("{} is below minReplicas {}", a.max_replicas, a.min_replicas),
        ));
    }
    if a.max_replicas > 1000 {
        return Err(FieldError::invalid(
            f("maxReplicas"),
            "must be 1000 or less",
        ));
    }
    if a.target_queue_depth < 1 {
        return Err(FieldError::invalid(
            f("targetQueueDepth"),
            "must be at least 1 request waiting per pod",
        ));
    }
    if !(0..=3600).contains(&a.scale_down_stabilization_seconds) {
        return Err(FieldError::invalid(
            f("scaleDownStabilizationSeconds"),
            "must be 0 to 3600 (the HPA's bounds)",
        ));
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
