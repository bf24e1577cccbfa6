//! An adapter's rules: its merged children's name, its canary, its source and paths.

use std::borrow::Borrow;

use mole_crds::constants::reason;
use mole_crds::{Adapter, InferencePool};

use super::pool::validate_rollout;
use super::{is_confined_relative, is_dns1035_label, parse_source, validate_secret_ref};
use crate::error::FieldError;
use crate::resources::{merged_name, MAX_CHILD_NAME, RESERVED_ADAPTER_NAMES};

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
