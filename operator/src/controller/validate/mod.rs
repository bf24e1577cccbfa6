//! Pure validation of pools and adapters. Each error names the field as users write it, so the
//! condition and the Event tell them exactly what to fix. A pool's rules are in [`pool`], an
//! adapter's in [`adapter`]; the name and path rules both use are here.

mod adapter;
mod pool;

use mole_crds::{ModelSource, SecretRef};

use crate::error::FieldError;
use crate::resources::MAX_CHILD_NAME;

pub use adapter::validate_adapter;
pub use pool::{validate_pool, validate_rollout, validate_scaling, validate_traffic};

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

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::LocalObjectReference;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use mole_crds::constants::reason;
    use mole_crds::{Adapter, InferencePool, ReasoningParser, RouterStrategy, ToolCallParser};

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
