//! The HorizontalPodAutoscaler of a pool's dynamic pods (`spec.dynamic.autoscaling`).

use k8s_openapi::api::autoscaling::v2::{
    CrossVersionObjectReference, HPAScalingPolicy, HPAScalingRules, HorizontalPodAutoscaler,
    HorizontalPodAutoscalerBehavior, HorizontalPodAutoscalerSpec, MetricIdentifier, MetricSpec,
    MetricTarget, PodsMetricSource,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use mole_crds::InferencePool;

use super::deployment::dynamic_name;
use super::meta::ChildMeta;

/// The worker's gauge of requests waiting for a slot (`crates/server/src/metrics.rs`), as the custom
/// metrics API serves it per pod (the chart's prometheus-adapter rule keeps the name).
pub const QUEUE_METRIC: &str = "mole_requests_waiting";

/// The HPA `<pool>-dynamic` scaling the Deployment of the same name on the pods' average
/// [`QUEUE_METRIC`]; None without `spec.dynamic.autoscaling`.
///
/// Its behavior adds pods quickly and removes them slowly: a new GPU pod takes minutes to load
/// the base model, so a dip in the queue must last `scaleDownStabilizationSeconds` before a pod
/// goes, and then one at a time every 5 minutes.
pub fn hpa(pool: &InferencePool) -> Option<HorizontalPodAutoscaler> {
    let a = pool.spec.dynamic.autoscaling.as_ref()?;
    let name = dynamic_name(&pool.metadata.name.clone().unwrap_or_default());
    let meta = ChildMeta::of_pool(pool, "dynamic");
    let rule = |window: i32, pods: i32, period: i32| HPAScalingRules {
        stabilization_window_seconds: Some(window),
        select_policy: Some("Max".into()),
        policies: Some(vec![HPAScalingPolicy {
            type_: "Pods".into(),
            value: pods,
            period_seconds: period,
        }]),
        ..Default::default()
    };
    Some(HorizontalPodAutoscaler {
        metadata: meta.named(name.clone()),
        spec: Some(HorizontalPodAutoscalerSpec {
            scale_target_ref: CrossVersionObjectReference {
                api_version: Some("apps/v1".into()),
                kind: "Deployment".into(),
                name,
            },
            min_replicas: Some(a.min_replicas),
            max_replicas: a.max_replicas,
            metrics: Some(vec![MetricSpec {
                type_: "Pods".into(),
                pods: Some(PodsMetricSource {
                    metric: MetricIdentifier {
                        name: QUEUE_METRIC.into(),
                        selector: None,
                    },
                    target: MetricTarget {
                        type_: "AverageValue".into(),
                        average_value: Some(Quantity(a.target_queue_depth.to_string())),
                        ..Default::default()
                    },
                }),
                ..Default::default()
            }]),
            behavior: Some(HorizontalPodAutoscalerBehavior {
                scale_up: Some(rule(0, 2, 60)),
                scale_down: Some(rule(a.scale_down_stabilization_seconds, 1, 300)),
            }),
        }),
        status: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(dynamic: serde_json::Value) -> InferencePool {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "mole.dev/v1alpha1", "kind": "InferencePool",
            "metadata": {"name": "vl", "namespace": "ml", "uid": "u"},
            "spec": {"baseModel": {"name": "b", "path": "base/b"}, "storage": {"claimName": "m"},
                     "gpu": {"count": 1}, "dynamic": dynamic}
        }))
        .unwrap()
    }

    #[test]
    fn only_autoscaled_pools_get_an_hpa_slow_to_scale_down() {
        assert!(hpa(&pool(serde_json::json!({"replicas": 2}))).is_none());
        let h = hpa(&pool(
            serde_json::json!({"autoscaling": {"maxReplicas": 3}}),
        ))
        .unwrap();
        let spec = h.spec.unwrap();
        assert_eq!(h.metadata.name.as_deref(), Some("vl-dynamic"));
        assert_eq!(spec.scale_target_ref.name, "vl-dynamic");
        // Defaults: at least one pod, 4 waiting per pod, 10 minutes before a pod goes.
        assert_eq!((spec.min_replicas, spec.max_replicas), (Some(1), 3));
        let target = &spec.metrics.unwrap()[0].pods.clone().unwrap().target;
        assert_eq!(target.average_value, Some(Quantity("4".into())));
        let b = spec.behavior.unwrap();
        let down = b.scale_down.unwrap();
        assert_eq!(down.stabilization_window_seconds, Some(600));
        assert_eq!(down.policies.unwrap()[0].value, 1);
        assert_eq!(b.scale_up.unwrap().stabilization_window_seconds, Some(0));
    }
}
