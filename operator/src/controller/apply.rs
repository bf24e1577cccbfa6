//! Server-side apply that skips the write when the live object already carries every field
//! the operator would apply, so a restarted operator (or a periodic requeue) writes nothing.

use kube::api::{Patch, PatchParams};
use kube::{Api, Resource};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use crate::error::Result;

/// Whether every field set in `desired` has the same value in `live` (the API server adds
/// defaults and other managers' fields, which are ignored). Lists must match element by
/// element.
pub fn is_subset(desired: &Value, live: &Value) -> bool {
    match (desired, live) {
        (Value::Null, _) => true,
        (Value::Object(d), Value::Object(l)) => d
            .iter()
            .all(|(k, v)| v.is_null() || l.get(k).is_some_and(|lv| is_subset(v, lv))),
        (Value::Array(d), Value::Array(l)) => {
            d.len() == l.len() && d.iter().zip(l).all(|(a, b)| is_subset(a, b))
        }
        (Value::Number(a), Value::Number(b)) => a.as_f64() == b.as_f64(),
        (a, b) => a == b,
    }
}

/// Applies `desired` as `manager` unless `live` already has it. Returns the object as the
/// API server holds it afterwards (the live one when nothing was written).
pub async fn apply_if_changed<K>(
    api: &Api<K>,
    name: &str,
    manager: &str,
    desired: &K,
    live: Option<&K>,
) -> Result<K>
where
    K: Resource + Clone + DeserializeOwned + Serialize + std::fmt::Debug,
{
    if let Some(live) = live {
        if is_subset(
            &serde_json::to_value(desired)?,
            &serde_json::to_value(live)?,
        ) {
            return Ok(live.clone());
        }
    }
    Ok(api
        .patch(
            name,
            &PatchParams::apply(manager).force(),
            &Patch::Apply(desired),
        )
        .await?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn defaults_and_foreign_fields_do_not_count_as_changes() {
        let desired = json!({"metadata": {"name": "a", "labels": {"x": "1"}},
                             "spec": {"replicas": 2, "ports": [{"port": 80}]}});
        let live = json!({"metadata": {"name": "a", "uid": "u", "labels": {"x": "1", "y": "2"}},
                          "spec": {"replicas": 2, "ports": [{"port": 80, "protocol": "TCP"}]},
                          "status": {"readyReplicas": 1}});
        assert!(is_subset(&desired, &live));
        let changed = json!({"spec": {"replicas": 3}});
        assert!(!is_subset(&changed, &live));
        let more_ports = json!({"spec": {"ports": [{"port": 80}, {"port": 81}]}});
        assert!(!is_subset(&more_ports, &live));
        assert!(!is_subset(
            &json!({"metadata": {"labels": {"z": "1"}}}),
            &live
        ));
    }
}
