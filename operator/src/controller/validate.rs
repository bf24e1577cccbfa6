//! Pure validation of pools and adapters. Each error names the field as users write it, so the
//! condition and the Event tell them exactly what to fix.

use mole_crds::constants::reason;
use mole_crds::{
    Adapter, InferencePool, InferencePoolSpec, ModelSource, ReasoningParser, RouterSpec,
    RouterStrategy, SecretRef, ToolCallParser,
};
use std::borrow::Borrow;

use crate::error::FieldError;
use crate::resources::{
    merged_name, mount_path_problem, rolling_update, scaled_value, MAX_CHILD_NAME,
    RESERVED_ADAPTER_NAMES,
};

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

/// Annotation that allows a pool without GPUs (`gpu.count: 0`), for CPU test clusters.
pub const ALLOW_CPU_ANNOTATION: &str = "mole.dev/allow-cpu";

/// Whether `p` is a relative path that stays inside its root (no absolute path, no `..`).
pub fn is_confined_relative(p: &str) -> bool {
    !p.is_empty() && !p.starts_with('/') && !p.split('/').any(|c| c == "..") && !p.contains('\0')
}

/// Whether `s` is a DNS-1123 subdomain, as the API server requires of the names of Secrets,
/// PriorityClasses and RuntimeClasses: at most 253 characters, dot-separated labels of lower
/// case alphanumerics and `-`, each starting and ending alphanumeric.
pub fn is_dns1123_subdomain(s: &str) -> bool {
    let alnum = |c: u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|label| {
            let b = label.as_bytes();
            matches!((b.first(), b.last()), (Some(&f), Some(&l)) if alnum(f) && alnum(l))
                && b.iter().all(|&c| alnum(c) || c == b'-')
        })
}

/// Whether `s` is a DNS-1035 label, as the API server requires of Service names: at most 63
/// characters of lower case alphanumerics and `-`, starting with a letter and ending
/// alphanumeric.
pub fn is_dns1035_label(s: &str) -> bool {
    let b = s.as_bytes();
    matches!((b.first(), b.last()), (Some(f), Some(l)) if f.is_ascii_lowercase()
        && (l.is_ascii_lowercase() || l.is_ascii_digit()))
        && s.len() <= MAX_CHILD_NAME
        && b.iter()
            .all(|&c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
}

/// `Err` naming `field` when `name` is not a DNS-1123 subdomain (the name of a `what`).
fn dns_name(field: String, what: &str, name: &str) -> Result<(), FieldError> {
    if is_dns1123_subdomain(name) {
        return Ok(());
    }
    Err(FieldError::invalid(
        field,
        format!(
            "{name:?} is not a valid {what} name (a DNS-1123 subdomain: lower case letters, \
             digits, '-' and '.', starting and ending with a letter or digit, at most 253)"
        ),
    ))
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

/// Parses a source URI with the worker's own rules, naming `field` when it is refused.
pub fn parse_source(field: &str, uri: &str) -> Result<ModelSource, FieldError> {
    ModelSource::parse(uri).map_err(|e| FieldError::invalid(field, format!("{uri:?}: {e}")))
}

fn validate_secret_ref(field: &str, r: Option<&SecretRef>) -> Result<(), FieldError> {
    match r {
        Some(r) if r.name.trim().is_empty() => Err(FieldError::invalid(
            format!("{field}.name"),
            "must name a Secret",
        )),
        _ => Ok(()),
    }
}

/// The adapter's merged children are named `<pool>-<adapter>` (Deployment, Service, PDB):
/// that name must be a valid Service name, must not be one of the pool's own children and must
/// not be another adapter's. Checked in every serving mode: the operator looks the merged
/// Deployment up by that name to remove it when an adapter is served dynamically, so a
/// colliding dynamic adapter would find (and delete) the other object too.
fn validate_merged_name(
    adapter: &Adapter,
    siblings: &[impl Borrow<Adapter>],
) -> Result<(), FieldError> {
    let name = adapter.metadata.name.as_deref().unwrap_or_default();
    let pool = adapter.spec.pool.as_str();
    let merged = merged_name(pool, name);
    if RESERVED_ADAPTER_NAMES.contains(&name) {
        return Err(FieldError::invalid(
            "metadata.name",
            format!(
                "{name:?} is reserved: the adapter's merged Deployment {merged:?} would be the \
                 pool's own; rename the adapter (reserved names: {})",
                RESERVED_ADAPTER_NAMES.join(", ")
            ),
        ));
    }
    if merged.len() > MAX_CHILD_NAME {
        return Err(FieldError::invalid(
            "metadata.name",
            format!(
                "the merged children's name {merged:?} (<pool>-<adapter>) has {} characters, \
                 over the limit of {MAX_CHILD_NAME} (a Service name is a DNS-1035 label): \
                 shorten the adapter's or the pool's name",
                merged.len()
            ),
        ));
    }
    if !is_dns1035_label(&merged) {
        return Err(FieldError::invalid(
            "metadata.name",
            format!(
                "the merged children's name {merged:?} (<pool>-<adapter>) is not a DNS-1035 \
                 label (lower case letters, digits and '-'): rename the adapter"
            ),
        ));
    }
    // Across pools, hyphens make names ambiguous (`a` + `b-c` = `a-b` + `c`): the older
    // adapter keeps the name.
    let me = created_key(adapter);
    let holder = siblings.iter().map(Borrow::<Adapter>::borrow).filter(|o| {
        o.metadata.name.as_deref() != Some(name)
            && o.metadata.deletion_timestamp.is_none()
            && merged_name(&o.spec.pool, o.metadata.name.as_deref().unwrap_or_default()) == merged
            && created_key(o) < me
    });
    if let Some(other) = holder.min_by_key(|o| created_key(o)) {
        return Err(FieldError {
            reason: reason::NAME_COLLISION,
            field: "metadata.name".into(),
            message: format!(
                "the merged children's name {merged:?} is already that of Adapter {:?} of \
                 pool {:?}: rename one of them",
                other.metadata.name.clone().unwrap_or_default(),
                other.spec.pool
            ),
        });
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

/// The directory of the pool's volume that holds merged outputs (`merged/<adapter>/...`).
const MERGED_DIR: &str = "merged";

/// The components of a relative path as the filesystem resolves them (empty and `.` dropped).
fn components(p: &str) -> Vec<&str> {
    p.split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .collect()
}

/// Whether one of two paths (as [`components`]) is the other or lies inside it.
fn overlaps(a: &[&str], b: &[&str]) -> bool {
    let n = a.len().min(b.len());
    a[..n] == b[..n]
}

/// `spec.source.path` is the adapter's own directory on the pool's volume: the pods read it,
/// and for a `source.uri` a fetch Job writes it. So it must not be, contain or lie inside the
/// volume's root, the base model (`spec.baseModel.path`), the merged outputs (`merged/`) or
/// another Adapter's source of the same pool (the older adapter keeps a contested path, as
/// it keeps a label): a fetch there would overwrite the base model's weights, config and
/// template, another adapter's files or a merged output that pods serve.
/// A canary is another version in a directory of its own, at a weight in 0..=100, with
/// analysis bounds that can be met. Pure.
fn validate_canary(
    spec: &mole_crds::AdapterSpec,
    canary: &mole_crds::CanarySpec,
    pool: &InferencePool,
) -> Result<(), FieldError> {
    if canary.version.trim().is_empty() {
        return Err(FieldError::invalid(
            "spec.canary.version",
            "must not be empty",
        ));
    }
    if canary.version == spec.version {
        return Err(FieldError::invalid(
            "spec.canary.version",
            format!(
                "{:?} is spec.version: a canary is another version (to promote it, set \
                 spec.version and spec.source to the canary's and drop spec.canary)",
                canary.version
            ),
        ));
    }
    if canary.weight > 100 {
        return Err(FieldError::invalid(
            "spec.canary.weight",
            format!("{} is a percentage: 0 to 100", canary.weight),
        ));
    }
    let path = &canary.source.path;
    if !is_confined_relative(path) {
        return Err(FieldError::invalid(
            "spec.canary.source.path",
            format!("{path:?} must be a relative path inside the pool's volume, without '..'"),
        ));
    }
    let mine = components(path);
    let clash = if mine.is_empty() {
        Some("is the root of the pool's volume".to_string())
    } else if mine[0] == MERGED_DIR {
        Some(format!(
            "lies in {MERGED_DIR}/, where the operator's merge Jobs write"
        ))
    } else if overlaps(&mine, &components(&pool.spec.base_model.path)) {
        Some("overlaps the pool's spec.baseModel.path".to_string())
    } else if overlaps(&mine, &components(&spec.source.path)) {
        Some(format!(
            "overlaps spec.source.path {:?}: the canary's files must be its own",
            spec.source.path
        ))
    } else {
        None
    };
    if let Some(why) = clash {
        return Err(FieldError::invalid(
            "spec.canary.source.path",
            format!("{path:?} {why}"),
        ));
    }
    if let Some(a) = &canary.analysis {
        if a.min_requests == 0 {
            return Err(FieldError::invalid(
                "spec.canary.analysis.minRequests",
                "must be at least 1: a verdict needs requests",
            ));
        }
        if !(0.0..=1.0).contains(&a.max_error_rate_increase) {
            return Err(FieldError::invalid(
                "spec.canary.analysis.maxErrorRateIncrease",
                format!(
                    "{} is a fraction of requests: 0 to 1 (0.01 is one point)",
                    a.max_error_rate_increase
                ),
            ));
        }
        if !(a.max_latency_ratio >= 1.0 && a.max_latency_ratio.is_finite()) {
            return Err(FieldError::invalid(
                "spec.canary.analysis.maxLatencyRatio",
                format!(
                    "{} must be at least 1: below it a canary as fast as the stable version \
                     is rolled back",
                    a.max_latency_ratio
                ),
            ));
        }
    }
    Ok(())
}

fn validate_source_path(
    adapter: &Adapter,
    pool: &InferencePool,
    siblings: &[impl Borrow<Adapter>],
) -> Result<(), FieldError> {
    let spec = &adapter.spec;
    let path = &spec.source.path;
    let mine = components(path);
    let refuse = |why: String| {
        Err(FieldError::invalid(
            "spec.source.path",
            format!(
                "{path:?} {why}; each adapter needs a directory of its own, such as \
                 adapters/<name>/<version>"
            ),
        ))
    };
    if mine.is_empty() {
        return refuse("is the root of the pool's volume".into());
    }
    if mine[0] == MERGED_DIR {
        return refuse(format!(
            "lies in {MERGED_DIR}/, where the operator's merge Jobs write"
        ));
    }
    let base = &pool.spec.base_model.path;
    if overlaps(&mine, &components(base)) {
        return refuse(format!(
            "overlaps the pool's spec.baseModel.path {base:?}: a fetch would overwrite the \
             base model"
        ));
    }
    let me = created_key(adapter);
    let holder = siblings
        .iter()
        .map(Borrow::<Adapter>::borrow)
        .filter(|o| {
            o.spec.pool == spec.pool
                && o.metadata.name != adapter.metadata.name
                && o.metadata.deletion_timestamp.is_none()
                && created_key(o) < me
                && overlaps(&mine, &components(&o.spec.source.path))
        })
        .min_by_key(|o| created_key(o));
    if let Some(other) = holder {
        return Err(FieldError {
            reason: reason::SOURCE_PATH_IN_USE,
            field: "spec.source.path".into(),
            message: format!(
                "{path:?} overlaps {:?}, the source path of Adapter {:?} in pool {:?}; each \
                 adapter needs a directory of its own, such as adapters/<name>/<version>",
                other.spec.source.path,
                other.metadata.name.clone().unwrap_or_default(),
                spec.pool
            ),
        });
    }
    Ok(())
}

/// Validates an adapter against its pool (None: not found) and the other adapters of the
/// namespace. When two adapters of a pool claim one label, the older keeps it.
pub fn validate_adapter(
    adapter: &Adapter,
    pool: Option<&InferencePool>,
    siblings: &[impl Borrow<Adapter>],
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
    validate_merged_name(adapter, siblings)?;
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
    if let Some(pool) = pool {
        validate_source_path(adapter, pool, siblings)?;
    }
    if let Some(uri) = &spec.source.uri {
        if !parse_source("spec.source.uri", uri)?.is_fetched() {
            return Err(FieldError::invalid(
                "spec.source.uri",
                format!(
                    "{uri:?}: adapters are fetched from hf:// or s3:// into the pool's volume; \
                     pvc:// is for base models"
                ),
            ));
        }
    }
    validate_secret_ref("spec.source.secretRef", spec.source.secret_ref.as_ref())?;
    if let (Some(canary), Some(pool)) = (&spec.canary, pool) {
        validate_canary(spec, canary, pool)?;
    }
    if spec.serving.replicas < 0 {
        return Err(FieldError::invalid(
            "spec.serving.replicas",
            "must be 0 or more",
        ));
    }
    // The merged Deployment rolls with the pool's `spec.rollout`: it must suit this adapter's
    // replicas too.
    if spec.serving.mode != mole_crds::ServingMode::Dynamic {
        if let Some(pool) = pool {
            validate_rollout(&pool.spec, spec.serving.replicas, "spec.serving.replicas").map_err(
                |e| {
                    FieldError::invalid(
                        "spec.serving.replicas",
                        format!(
                            "does not fit pool {:?}'s {}: {}",
                            spec.pool, e.field, e.message
                        ),
                    )
                },
            )?;
        }
    }
    if let Some(q) = &spec.merge.quantize {
        if let Some(bound) = q.max_drift {
            if !(bound.is_finite() && bound > 0.0) {
                return Err(FieldError::invalid(
                    "spec.merge.quantize.maxDrift",
                    format!("{bound} must be a positive number of nats"),
                ));
            }
        }
        // A quantized base is served as it is: the merge onto it is refused, and quantizing
        // the result again would compound two roundings.
        if let Some(pool) = pool {
            let path = &pool.spec.base_model.path;
            if path.ends_with(".gguf") {
                return Err(FieldError::invalid(
                    "spec.merge.quantize",
                    format!(
                        "pool {:?} serves a GGUF base ({path}); merges are made onto dense bases, quantize after merging needs one",
                        spec.pool
                    ),
                ));
            }
        }
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
        let holder = siblings.iter().map(Borrow::<Adapter>::borrow).filter(|o| {
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
    use k8s_openapi::api::core::v1::LocalObjectReference;
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

    fn autoscaling(min: i32, max: i32) -> mole_crds::AutoscalingSpec {
        mole_crds::AutoscalingSpec {
            min_replicas: min,
            max_replicas: max,
            target_queue_depth: 4,
            scale_down_stabilization_seconds: 600,
        }
    }

    fn traffic(promote: f64, demote: f64) -> mole_crds::TrafficMergeSpec {
        mole_crds::TrafficMergeSpec {
            promote_share: promote,
            demote_share: demote,
            window_seconds: 300,
            min_hold_seconds: 900,
            max_merged_gpus: 2,
            capacity: None,
        }
    }

    #[test]
    fn a_traffic_capacity_must_be_a_rate_and_a_ratio() {
        let mut p = pool();
        let mut t = traffic(0.1, 0.04);
        t.capacity = Some(mole_crds::MergeCapacity {
            merged_tokens_per_second: 1404.2,
            dynamic_ratio: 0.47,
        });
        p.spec.merge.traffic = Some(t.clone());
        assert_eq!(validate_pool(&p), Ok(()));
        for (rate, ratio, field) in [
            (
                f64::NAN,
                0.5,
                "spec.merge.traffic.capacity.mergedTokensPerSecond",
            ),
            (
                0.0,
                0.5,
                "spec.merge.traffic.capacity.mergedTokensPerSecond",
            ),
            (100.0, 0.0, "spec.merge.traffic.capacity.dynamicRatio"),
            (100.0, 2.0, "spec.merge.traffic.capacity.dynamicRatio"),
        ] {
            let mut t = t.clone();
            t.capacity = Some(mole_crds::MergeCapacity {
                merged_tokens_per_second: rate,
                dynamic_ratio: ratio,
            });
            p.spec.merge.traffic = Some(t);
            assert_eq!(validate_pool(&p).unwrap_err().field, field);
        }
    }

    #[test]
    fn a_traffic_policy_with_a_band_is_valid() {
        let mut p = pool();
        p.spec.merge.traffic = Some(traffic(0.1, 0.04));
        assert_eq!(validate_pool(&p), Ok(()));
    }

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
                |p| p.spec.base_model.tool_call_parser = Some("mistral".into()),
                "spec.baseModel.toolCallParser",
            ),
            (
                |p| p.spec.base_model.tool_call_parser = Some("Hermes".into()),
                "spec.baseModel.toolCallParser",
            ),
            (
                |p| p.spec.base_model.reasoning_parser = Some("deepseek-r1".into()),
                "spec.baseModel.reasoningParser",
            ),
            (
                |p| p.spec.storage.claim_name = "".into(),
                "spec.storage.claimName",
            ),
            (
                |p| p.spec.storage.mount_path = "models".into(),
                "spec.storage.mountPath",
            ),
            // The worker pods' own mount points, a parent of one, one inside one, and paths
            // that are not plain (the API server refused `/tmp` on every retry).
            (
                |p| p.spec.storage.mount_path = "/tmp".into(),
                "spec.storage.mountPath",
            ),
            (
                |p| p.spec.storage.mount_path = "/etc".into(),
                "spec.storage.mountPath",
            ),
            (
                |p| p.spec.storage.mount_path = "/var/run/mole/auth/models".into(),
                "spec.storage.mountPath",
            ),
            (
                |p| p.spec.storage.mount_path = "/".into(),
                "spec.storage.mountPath",
            ),
            (
                |p| p.spec.storage.mount_path = "/models/../tmp".into(),
                "spec.storage.mountPath",
            ),
            (
                |p| p.spec.storage.mount_path = "/models/".into(),
                "spec.storage.mountPath",
            ),
            (|p| p.spec.gpu.count = 0, "spec.gpu.count"),
            (
                |p| p.spec.gpu.resource_name = "".into(),
                "spec.gpu.resourceName",
            ),
            (
                |p| p.spec.dynamic.replicas = Some(-1),
                "spec.dynamic.replicas",
            ),
            (
                |p| {
                    p.spec.dynamic.replicas = Some(2);
                    p.spec.dynamic.autoscaling = Some(autoscaling(1, 4));
                },
                "spec.dynamic.replicas",
            ),
            (
                |p| p.spec.dynamic.autoscaling = Some(autoscaling(0, 4)),
                "spec.dynamic.autoscaling.minReplicas",
            ),
            (
                |p| p.spec.merge.traffic = Some(traffic(0.05, 0.05)),
                "spec.merge.traffic.demoteShare",
            ),
            (
                |p| {
                    p.spec.merge.scale_to_zero =
                        Some(mole_crds::ScaleToZeroSpec { idle_seconds: 30 })
                },
                "spec.merge.scaleToZero.idleSeconds",
            ),
            (
                |p| {
                    p.spec.dynamic.placement = Some(mole_crds::PlacementSpec {
                        min_replicas: 2,
                        load_factor: 0.5,
                    })
                },
                "spec.dynamic.placement.loadFactor",
            ),
            (
                |p| {
                    p.spec.dynamic.placement = Some(mole_crds::PlacementSpec {
                        min_replicas: 0,
                        load_factor: 1.25,
                    })
                },
                "spec.dynamic.placement.minReplicas",
            ),
            (
                |p| p.spec.merge.traffic = Some(traffic(0.0, 0.0)),
                "spec.merge.traffic.promoteShare",
            ),
            (
                |p| p.spec.merge.traffic = Some(traffic(1.5, 0.1)),
                "spec.merge.traffic.promoteShare",
            ),
            (
                |p| {
                    let mut t = traffic(0.1, 0.04);
                    t.min_hold_seconds = -1;
                    p.spec.merge.traffic = Some(t);
                },
                "spec.merge.traffic.minHoldSeconds",
            ),
            (
                |p| p.spec.dynamic.autoscaling = Some(autoscaling(3, 2)),
                "spec.dynamic.autoscaling.maxReplicas",
            ),
            (
                |p| {
                    let mut a = autoscaling(1, 2);
                    a.target_queue_depth = 0;
                    p.spec.dynamic.autoscaling = Some(a);
                },
                "spec.dynamic.autoscaling.targetQueueDepth",
            ),
            (
                |p| {
                    let mut a = autoscaling(1, 2);
                    a.scale_down_stabilization_seconds = 3601;
                    p.spec.dynamic.autoscaling = Some(a);
                },
                "spec.dynamic.autoscaling.scaleDownStabilizationSeconds",
            ),
            (
                // 100% down is fine for one pod, not for the autoscaler's second.
                |p| {
                    p.spec.dynamic.autoscaling = Some(autoscaling(1, 2));
                    p.spec.rollout = Some(mole_crds::RolloutSpec {
                        max_surge: None,
                        max_unavailable: Some(
                            k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(
                                "100%".into(),
                            ),
                        ),
                    });
                },
                "spec.rollout.maxUnavailable",
            ),
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
            (
                |p| {
                    p.spec.image_pull_secrets = vec![
                        LocalObjectReference {
                            name: "regcred".into(),
                        },
                        LocalObjectReference {
                            name: "Reg_Cred".into(),
                        },
                    ]
                },
                "spec.imagePullSecrets[1].name",
            ),
            (
                |p| p.spec.image_pull_secrets = vec![LocalObjectReference { name: "".into() }],
                "spec.imagePullSecrets[0].name",
            ),
            (
                |p| p.spec.gpu.priority_class_name = Some("High Priority".into()),
                "spec.gpu.priorityClassName",
            ),
            (
                |p| p.spec.gpu.runtime_class_name = Some("-nvidia".into()),
                "spec.gpu.runtimeClassName",
            ),
            (
                |p| p.spec.merge.priority_class_name = Some("batch.".into()),
                "spec.merge.priorityClassName",
            ),
            (
                |p| p.spec.base_model.source = Some("http://example.com/m".into()),
                "spec.baseModel.source",
            ),
            (
                |p| p.spec.base_model.source = Some("hf://org/m/extra".into()),
                "spec.baseModel.source",
            ),
            (
                |p| p.spec.base_model.source = Some("s3://Bad_Bucket/x".into()),
                "spec.baseModel.source",
            ),
            (
                |p| p.spec.base_model.source = Some("pvc://models/base".into()),
                "spec.baseModel.source",
            ),
            (
                |p| p.spec.base_model.secret_ref = Some(mole_crds::SecretRef { name: "".into() }),
                "spec.baseModel.secretRef.name",
            ),
        ];
        for (mutate, want) in cases {
            let mut p = pool();
            mutate(&mut p);
            assert_eq!(field(validate_pool(&p)), want);
        }
    }

    /// Every format the worker parses passes, by vLLM's name; another is refused with a
    /// message that names it and the formats mole parses.
    #[test]
    fn parsers_the_worker_parses_pass_and_others_are_named() {
        for n in ToolCallParser::NAMES {
            let mut p = pool();
            p.spec.base_model.tool_call_parser = Some(n.to_string());
            assert_eq!(validate_pool(&p), Ok(()), "{n}");
        }
        for n in ReasoningParser::NAMES {
            let mut p = pool();
            p.spec.base_model.reasoning_parser = Some(n.to_string());
            assert_eq!(validate_pool(&p), Ok(()), "{n}");
        }
        let mut p = pool();
        p.spec.base_model.tool_call_parser = Some("llama3_json".into());
        let e = validate_pool(&p).unwrap_err();
        assert_eq!(e.field, "spec.baseModel.toolCallParser");
        assert!(
            e.message.contains("\"llama3_json\"") && e.message.contains("hermes"),
            "{e:?}"
        );
    }

    #[test]
    fn pod_names_that_are_valid_pass() {
        let mut p = pool();
        p.spec.image_pull_secrets = vec![LocalObjectReference {
            name: "ghcr.io-pull".into(),
        }];
        p.spec.gpu.priority_class_name = Some("gpu-serving".into());
        p.spec.gpu.runtime_class_name = Some("nvidia".into());
        p.spec.merge.priority_class_name = Some("batch-low".into());
        assert_eq!(validate_pool(&p), Ok(()));
        let e = {
            p.spec.gpu.runtime_class_name = Some("NVIDIA".into());
            validate_pool(&p).unwrap_err()
        };
        assert_eq!(e.reason, reason::INVALID_SPEC);
        assert!(e
            .message
            .contains("\"NVIDIA\" is not a valid RuntimeClass name"));
    }

    #[test]
    fn dns1123_subdomains() {
        let long_ok = format!("{}.{}", "a".repeat(63), "b".repeat(189));
        assert_eq!(long_ok.len(), 253);
        for ok in [
            "a",
            "nvidia",
            "gpu-high",
            "a.b-c.d9",
            "0x",
            long_ok.as_str(),
        ] {
            assert!(is_dns1123_subdomain(ok), "{ok}");
        }
        let too_long = "a".repeat(254);
        for bad in [
            "",
            "A",
            "a_b",
            "-a",
            "a-",
            "a..b",
            ".a",
            "a.",
            "a b",
            "é",
            too_long.as_str(),
        ] {
            assert!(!is_dns1123_subdomain(bad), "{bad}");
        }
    }

    #[test]
    fn sources_of_the_three_schemes_pass() {
        for uri in [
            "hf://Qwen/Qwen3-8B@main",
            "s3://models/qwen3-8b",
            "pvc://weights/qwen3",
        ] {
            let mut p = pool();
            p.spec.base_model.source = Some(uri.into());
            assert_eq!(validate_pool(&p), Ok(()), "{uri}");
        }
        let mut a = adapter("calendar", None, 10);
        a.spec.source.uri = Some("s3://adapters/calendar/v1".into());
        assert_eq!(
            validate_adapter(&a, Some(&pool()), &[] as &[Adapter]),
            Ok(())
        );
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

    /// Quantize after merge: a bound that is a positive number passes; a pool serving a
    /// GGUF base refuses it, naming the field (the merge is made onto dense bases only).
    #[test]
    fn merge_quantize_needs_a_positive_bound_and_a_dense_base() {
        let mut a = adapter("calendar", None, 10);
        a.spec.merge.quantize = Some(mole_crds::MergeQuantize {
            quant_type: mole_crds::QuantizeType::Q4K,
            max_drift: Some(0.05),
        });
        assert_eq!(
            validate_adapter(&a, Some(&pool()), &[] as &[Adapter]),
            Ok(())
        );
        let mut p = pool();
        p.spec.base_model.path = "base/model.Q4_1.gguf".into();
        let e = validate_adapter(&a, Some(&p), &[] as &[Adapter]).unwrap_err();
        assert_eq!(e.field, "spec.merge.quantize");
        assert!(e.message.contains("GGUF"), "{}", e.message);
    }

    #[test]
    fn adapter_errors_name_the_field_and_reason() {
        let p = pool();
        let a = adapter("calendar", None, 10);
        assert_eq!(validate_adapter(&a, Some(&p), &[] as &[Adapter]), Ok(()));
        let e = validate_adapter(&a, None, &[] as &[Adapter]).unwrap_err();
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
            (
                |a| {
                    a.spec.merge.quantize = Some(mole_crds::MergeQuantize {
                        quant_type: mole_crds::QuantizeType::Q4K,
                        max_drift: Some(-0.1),
                    })
                },
                "spec.merge.quantize.maxDrift",
            ),
            (
                |a| {
                    a.spec.merge.quantize = Some(mole_crds::MergeQuantize {
                        quant_type: mole_crds::QuantizeType::Q8_0,
                        max_drift: Some(f64::NAN),
                    })
                },
                "spec.merge.quantize.maxDrift",
            ),
            (
                |a| a.spec.source.uri = Some("ftp://x/y".into()),
                "spec.source.uri",
            ),
            (
                |a| a.spec.source.uri = Some("pvc://adapters/x".into()),
                "spec.source.uri",
            ),
            (
                |a| a.spec.source.secret_ref = Some(mole_crds::SecretRef { name: " ".into() }),
                "spec.source.secretRef.name",
            ),
        ];
        for (mutate, want) in cases {
            let mut a = adapter("calendar", None, 10);
            mutate(&mut a);
            assert_eq!(
                field(validate_adapter(&a, Some(&p), &[] as &[Adapter])),
                want
            );
        }
    }

    fn with_canary(a: &mut Adapter, f: Mutation<mole_crds::CanarySpec>) {
        let mut c: mole_crds::CanarySpec = serde_json::from_value(serde_json::json!({
            "version": "v2", "source": {"path": "adapters/calendar/v2"}, "weight": 10,
            "analysis": {}
        }))
        .unwrap();
        f(&mut c);
        a.spec.canary = Some(c);
    }

    #[test]
    fn canary_errors_name_the_field() {
        let p = pool();
        let mut ok = adapter("calendar", None, 10);
        with_canary(&mut ok, |_| {});
        assert_eq!(validate_adapter(&ok, Some(&p), &[] as &[Adapter]), Ok(()));
        let analysis = ok.spec.canary.as_ref().unwrap().analysis.clone().unwrap();
        assert_eq!(
            (
                analysis.min_requests,
                analysis.max_error_rate_increase,
                analysis.max_latency_ratio
            ),
            (100, 0.01, 1.5),
            "defaults"
        );
        let cases: Vec<(Mutation<mole_crds::CanarySpec>, &str)> = vec![
            (|c| c.version = "v1".into(), "spec.canary.version"),
            (|c| c.version = " ".into(), "spec.canary.version"),
            (|c| c.weight = 101, "spec.canary.weight"),
            (|c| c.source.path = "/abs".into(), "spec.canary.source.path"),
            (
                |c| c.source.path = "a/../../b".into(),
                "spec.canary.source.path",
            ),
            (
                |c| c.source.path = "adapters/calendar/v1".into(),
                "spec.canary.source.path",
            ),
            (
                |c| c.source.path = "adapters/calendar/v1/x".into(),
                "spec.canary.source.path",
            ),
            (
                |c| c.source.path = "merged/x".into(),
                "spec.canary.source.path",
            ),
            (
                |c| c.source.path = "base/qwen3-vl-8b/x".into(),
                "spec.canary.source.path",
            ),
            (
                |c| c.analysis.as_mut().unwrap().min_requests = 0,
                "spec.canary.analysis.minRequests",
            ),
            (
                |c| c.analysis.as_mut().unwrap().max_error_rate_increase = 1.5,
                "spec.canary.analysis.maxErrorRateIncrease",
            ),
            (
                |c| c.analysis.as_mut().unwrap().max_latency_ratio = 0.9,
                "spec.canary.analysis.maxLatencyRatio",
            ),
        ];
        for (mutate, want) in cases {
            let mut a = adapter("calendar", None, 10);
            with_canary(&mut a, mutate);
            let e = validate_adapter(&a, Some(&p), &[] as &[Adapter]).unwrap_err();
            assert_eq!(
                (e.reason, e.field.as_str()),
                (reason::INVALID_SPEC, want),
                "{}",
                e.message
            );
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
    fn merged_names_are_valid_unique_and_not_the_pools() {
        let p = pool();
        // `vl-dynamic` is the pool's dynamic Deployment and PDB: refused in every mode.
        for mode in ["dynamic", "merged", "auto"] {
            let mut a = adapter("dynamic", None, 10);
            a.spec.serving.mode = serde_json::from_value(serde_json::json!(mode)).unwrap();
            let e = validate_adapter(&a, Some(&p), &[] as &[Adapter]).unwrap_err();
            assert_eq!(
                (e.reason, e.field.as_str()),
                (reason::INVALID_SPEC, "metadata.name"),
                "{mode}"
            );
            assert!(e.message.contains("\"vl-dynamic\""), "{}", e.message);
        }
        // `vl-` + 60 = 63 characters fit, 61 do not, and the message says the limit.
        let fits = adapter(&"a".repeat(60), None, 10);
        assert_eq!(validate_adapter(&fits, Some(&p), &[] as &[Adapter]), Ok(()));
        let e = validate_adapter(
            &adapter(&"a".repeat(61), None, 10),
            Some(&p),
            &[] as &[Adapter],
        )
        .unwrap_err();
        assert_eq!(e.field, "metadata.name");
        assert!(
            e.message.contains("64 characters") && e.message.contains("limit of 63"),
            "{}",
            e.message
        );
        // A dotted adapter name is a valid object name but not a Service name.
        let e = validate_adapter(&adapter("cal.v2", None, 10), Some(&p), &[] as &[Adapter])
            .unwrap_err();
        assert_eq!(e.field, "metadata.name");
        // `vl` + `b-c` and `vl-b` + `c` share `vl-b-c`: the older adapter keeps it.
        let old = adapter("b-c", None, 10);
        let mut new = adapter("c", None, 20);
        new.spec.pool = "vl-b".into();
        let mut other_pool = pool();
        other_pool.metadata.name = Some("vl-b".into());
        let all = vec![old.clone(), new.clone()];
        assert_eq!(validate_adapter(&old, Some(&p), &all), Ok(()));
        let e = validate_adapter(&new, Some(&other_pool), &all).unwrap_err();
        assert_eq!(
            (e.reason, e.field.as_str()),
            (reason::NAME_COLLISION, "metadata.name")
        );
        assert!(e.message.contains("\"b-c\""), "{}", e.message);
    }

    #[test]
    fn rollouts_must_be_well_formed_progress_and_keep_a_pod_serving() {
        use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
        let with = |surge: Option<IntOrString>, unavailable: Option<IntOrString>, replicas| {
            let mut p = pool();
            p.spec.dynamic.replicas = Some(replicas);
            p.spec.rollout = Some(mole_crds::RolloutSpec {
                max_surge: surge,
                max_unavailable: unavailable,
            });
            validate_pool(&p)
        };
        let s = |v: &str| Some(IntOrString::String(v.into()));
        let i = |v: i32| Some(IntOrString::Int(v));
        // The GPU default (0 surge, 1 down) with 1 or 3 replicas; surge on a roomy pool.
        assert_eq!(with(None, None, 1), Ok(()));
        assert_eq!(with(None, None, 3), Ok(()));
        assert_eq!(with(i(1), i(0), 2), Ok(()));
        assert_eq!(with(s("25%"), s("50%"), 4), Ok(()));
        // One replica: its only pod may be replaced (there is nothing to keep).
        assert_eq!(with(None, s("100%"), 1), Ok(()));
        let cases = [
            (with(s("ten"), None, 2), "spec.rollout.maxSurge"),
            (with(None, i(-1), 2), "spec.rollout.maxUnavailable"),
            (with(None, s("150%"), 2), "spec.rollout.maxUnavailable"),
            (with(i(0), i(0), 2), "spec.rollout"),
            // 25% of 3 rounds down to 0: nothing could move.
            (with(i(0), s("25%"), 3), "spec.rollout"),
            (with(None, i(2), 2), "spec.rollout.maxUnavailable"),
            (with(None, s("100%"), 3), "spec.rollout.maxUnavailable"),
        ];
        for (r, want) in cases {
            assert_eq!(field(r), want);
        }
        // A merged adapter with the pool's rollout: 2 down of its 2 replicas is refused.
        let mut p = pool();
        p.spec.rollout = Some(mole_crds::RolloutSpec {
            max_surge: None,
            max_unavailable: i(2),
        });
        let mut a = adapter("calendar", None, 10);
        a.spec.serving.replicas = 2;
        assert_eq!(
            validate_adapter(&a, Some(&p), &[] as &[Adapter]),
            Ok(()),
            "dynamic: no merged pods"
        );
        a.spec.serving.mode = mole_crds::ServingMode::Merged;
        let e = validate_adapter(&a, Some(&p), &[] as &[Adapter]).unwrap_err();
        assert_eq!(e.field, "spec.serving.replicas");
        assert!(
            e.message.contains("spec.rollout.maxUnavailable"),
            "{}",
            e.message
        );
    }

    #[test]
    fn pool_names_must_fit_a_service_name() {
        for bad in ["1vl", "v.l", &"p".repeat(64)] {
            let mut p = pool();
            p.metadata.name = Some(bad.to_string());
            assert_eq!(field(validate_pool(&p)), "metadata.name", "{bad}");
        }
        let mut p = pool();
        p.metadata.name = Some("p".repeat(63));
        assert_eq!(validate_pool(&p), Ok(()));
    }

    #[test]
    fn dns1035_labels() {
        for ok in ["a", "vl-dynamic", "a1", &"a".repeat(63)] {
            assert!(is_dns1035_label(ok), "{ok}");
        }
        for bad in ["", "1a", "a-", "-a", "a.b", "A", "a_b", &"a".repeat(64)] {
            assert!(!is_dns1035_label(bad), "{bad}");
        }
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

    /// Issue 33 item 3: an adapter's source path is a directory of its own on the pool's
    /// volume (base model at `base/qwen3-vl-8b`).
    #[test]
    fn source_paths_keep_off_the_root_the_base_merged_outputs_and_other_adapters() {
        let p = pool();
        let refused = |path: &str| -> Option<FieldError> {
            let mut a = adapter("calendar", None, 10);
            a.spec.source.path = path.into();
            validate_adapter(&a, Some(&p), &[] as &[Adapter]).err()
        };
        for ok in [
            "adapters/calendar/v1",
            "adapters/calendar",
            "loras/calendar",
            "base/qwen3-vl-8b-v2",
            "base-adapters/x",
            "mergedx/a",
        ] {
            assert_eq!(refused(ok), None, "{ok}");
        }
        for (bad, says) in [
            (".", "root of the pool's volume"),
            ("./", "root of the pool's volume"),
            ("base/qwen3-vl-8b", "spec.baseModel.path"),
            ("base/qwen3-vl-8b/", "spec.baseModel.path"),
            ("./base//qwen3-vl-8b", "spec.baseModel.path"),
            ("base", "spec.baseModel.path"),
            ("base/qwen3-vl-8b/lora", "spec.baseModel.path"),
            ("merged", "merged/"),
            ("merged/calendar/v1-abc", "merged/"),
            ("./merged/x", "merged/"),
        ] {
            let e = refused(bad).unwrap_or_else(|| panic!("{bad} accepted"));
            assert_eq!(
                (e.reason, e.field.as_str()),
                (reason::INVALID_SPEC, "spec.source.path"),
                "{bad}"
            );
            assert!(e.message.contains(says), "{bad}: {}", e.message);
        }
        // Another adapter's directory, the one it lies in or one inside it: the newer is
        // refused, naming the older; other pools and adapters being deleted do not count.
        let mut old = adapter("calendar", None, 10);
        old.spec.source.path = "adapters/calendar".into();
        for (path, clash) in [
            ("adapters/calendar", true),
            ("adapters/calendar/v2", true),
            ("adapters", true),
            ("./adapters/calendar/", true),
            ("adapters/calendar-2", false),
            ("adapters/cal", false),
        ] {
            let mut new = adapter("calendar-2", None, 20);
            new.spec.source.path = path.into();
            let all = vec![old.clone(), new.clone()];
            assert_eq!(
                validate_adapter(&old, Some(&p), &all),
                Ok(()),
                "the older keeps it"
            );
            let got = validate_adapter(&new, Some(&p), &all);
            if clash {
                let e = got.unwrap_err();
                assert_eq!(
                    (e.reason, e.field.as_str()),
                    (reason::SOURCE_PATH_IN_USE, "spec.source.path"),
                    "{path}"
                );
                assert!(e.message.contains("\"calendar\""), "{}", e.message);
            } else {
                assert_eq!(got, Ok(()), "{path}");
            }
        }
        let mut new = adapter("calendar-2", None, 20);
        new.spec.source.path = "adapters/calendar/v2".into();
        let mut elsewhere = old.clone();
        elsewhere.spec.pool = "other".into();
        assert_eq!(
            validate_adapter(&new, Some(&p), &[elsewhere, new.clone()]),
            Ok(())
        );
        let mut leaving = old.clone();
        leaving.metadata.deletion_timestamp =
            Some(Time(k8s_openapi::jiff::Timestamp::from_second(30).unwrap()));
        assert_eq!(
            validate_adapter(&new, Some(&p), &[leaving, new.clone()]),
            Ok(())
        );
    }
}
