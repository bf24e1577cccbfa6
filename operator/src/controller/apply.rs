//! Server-side apply that skips the write when the live object already carries every field
//! the operator would apply, so a restarted operator (or a periodic requeue) writes nothing.
//!
//! "Already carries" is judged as the real API server stores objects (kube-apiserver v1.37,
//! tests/tests/control_plane.rs): it drops fields set to their zero value (`readOnly: false`,
//! `omitempty` in its Go types), adds defaults, and keeps list entries other managers own (an
//! injected sidecar). Fields the operator stopped rendering would look "carried" by such a
//! comparison, so every applied object also carries the hash of what was applied
//! ([`ANNOTATION_APPLIED`]): a changed rendering changes the hash and is applied.

use kube::api::{Patch, PatchParams};
use kube::{Api, Resource};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::error::Result;

/// Annotation on every object the operator applies: the hash of the rendering applied, so a
/// field dropped from the rendering is a change the comparison sees.
pub const ANNOTATION_APPLIED: &str = "mole.dev/applied-hash";

/// Whether every field set in `desired` has the same value in `live` (the API server adds
/// defaults and other managers' fields, which are ignored). A field set to its zero value
/// (`false`, `0`, `""`, empty list or map) may be absent from `live`: the server drops those.
/// Lists of objects with a merge key (`mountPath`, `containerPort`, `name`) match entry by
/// key, and entries only `live` has belong to other managers; other lists match element by
/// element. Resource quantities compare by value: the API server keeps them in canonical
/// form ("1000m" as "1", "1024Mi" as "1Gi"), and comparing spellings would re-apply such
/// objects on every reconcile.
pub fn is_subset(desired: &Value, live: &Value) -> bool {
    subset(desired, live, Quantities::No)
}

/// Whether the server stores `v` as an absent field (Go's zero values under `omitempty`).
fn is_zero(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        // An empty struct can be meaningful (`emptyDir: {}`), but the server keeps those, so
        // an absent one is a real difference only when it had fields.
        Value::Object(o) => o.values().all(is_zero),
    }
}

/// The fields that identify an entry of a list of objects, in the order Kubernetes' list
/// types use them as merge keys: volume mounts by path, container ports by number, containers,
/// volumes, env vars and most others by name.
const MERGE_KEYS: &[&str] = &["mountPath", "containerPort", "name"];

/// The merge key of a desired list: the first of [`MERGE_KEYS`] that every entry has, with no
/// two entries sharing its value.
fn merge_key(desired: &[Value]) -> Option<&'static str> {
    MERGE_KEYS.iter().copied().find(|k| {
        let mut seen = Vec::with_capacity(desired.len());
        desired.iter().all(|e| match e.get(k) {
            Some(v) if !v.is_null() && !seen.contains(&v) => {
                seen.push(v);
                true
            }
            _ => false,
        })
    })
}

/// Whether the strings at a place of an object are resource quantities.
#[derive(Clone, Copy, PartialEq)]
enum Quantities {
    No,
    /// An object whose values are quantities (`resources.requests`, `resources.limits`).
    Map,
    /// A quantity.
    Value,
}

/// Keys whose object maps resource names to quantities.
const QUANTITY_MAPS: &[&str] = &["requests", "limits"];
/// Keys whose value is a quantity (`emptyDir.sizeLimit`, an HPA target's `averageValue`).
const QUANTITY_FIELDS: &[&str] = &["sizeLimit", "averageValue"];

fn subset(desired: &Value, live: &Value, q: Quantities) -> bool {
    match (desired, live) {
        (Value::Null, _) => true,
        (Value::Object(d), Value::Object(l)) => d.iter().all(|(k, v)| {
            let child = if q == Quantities::Map || QUANTITY_FIELDS.contains(&k.as_str()) {
                Quantities::Value
            } else if QUANTITY_MAPS.contains(&k.as_str()) {
                Quantities::Map
            } else {
                Quantities::No
            };
            match l.get(k) {
                Some(lv) => subset(v, lv, child),
                None => is_zero(v),
            }
        }),
        (Value::Array(d), Value::Array(l)) => match merge_key(d) {
            Some(key) => d.iter().all(|e| {
                l.iter()
                    .find(|x| x.get(key) == e.get(key))
                    .is_some_and(|x| subset(e, x, q))
            }),
            None => d.len() == l.len() && d.iter().zip(l).all(|(a, b)| subset(a, b, q)),
        },
        (Value::Number(a), Value::Number(b)) => a.as_f64() == b.as_f64(),
        (Value::String(a), Value::String(b)) if q == Quantities::Value => {
            a == b || same_quantity(a, b)
        }
        (a, b) => a == b,
    }
}

/// Whether two Kubernetes quantities (`1`, `1000m`, `0.5Gi`, `512Mi`, `1e3`) have the same
/// value, compared exactly. Unparsable (or too large to compare) is not the same.
pub fn same_quantity(a: &str, b: &str) -> bool {
    let (Some((an, ad)), Some((bn, bd))) = (parse_quantity(a), parse_quantity(b)) else {
        return false;
    };
    let scale = |n: i128, by: u32| 10i128.checked_pow(by).and_then(|p| n.checked_mul(p));
    match (scale(an, bd), scale(bn, ad)) {
        (Some(x), Some(y)) => x == y,
        _ => false,
    }
}

/// A quantity as `n / 10^d`.
fn parse_quantity(s: &str) -> Option<(i128, u32)> {
    let s = s.trim();
    let (neg, s) = match s.strip_prefix('-') {
        Some(r) => (true, r),
        None => (false, s.strip_prefix('+').unwrap_or(s)),
    };
    let end = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, suffix) = s.split_at(end);
    let (int, frac) = number.split_once('.').unwrap_or((number, ""));
    if (int.is_empty() && frac.is_empty()) || frac.contains('.') {
        return None;
    }
    let digits: i128 = format!("{int}{frac}").parse().ok()?;
    let mut den = u32::try_from(frac.len()).ok()?;
    let exp10: i32 = match suffix {
        "" => 0,
        "n" => -9,
        "u" => -6,
        "m" => -3,
        "k" => 3,
        "M" => 6,
        "G" => 9,
        "T" => 12,
        "P" => 15,
        "E" => 18,
        "Ki" | "Mi" | "Gi" | "Ti" | "Pi" | "Ei" => {
            let k = ["Ki", "Mi", "Gi", "Ti", "Pi", "Ei"]
                .iter()
                .position(|x| *x == suffix)?;
            let n = digits.checked_mul(1i128 << (10 * (k as u32 + 1)))?;
            return Some((if neg { -n } else { n }, den));
        }
        e => e.strip_prefix(['e', 'E'])?.parse().ok()?,
    };
    let mut n = digits;
    if exp10 >= 0 {
        n = n.checked_mul(10i128.checked_pow(exp10.unsigned_abs())?)?;
    } else {
        den = den.checked_add(exp10.unsigned_abs())?;
    }
    Some((if neg { -n } else { n }, den))
}

/// `desired` with [`ANNOTATION_APPLIED`] set to the hash of the rest of it.
pub fn with_applied_hash<K>(desired: &K) -> Result<K>
where
    K: Resource + Clone + Serialize,
{
    let mut out = desired.clone();
    if let Some(a) = out.meta_mut().annotations.as_mut() {
        a.remove(ANNOTATION_APPLIED);
    }
    // k8s-openapi's maps are BTreeMaps: the serialization, and so the hash, is stable.
    let hash = hex::encode(&Sha256::digest(serde_json::to_vec(&out)?)[..8]);
    out.meta_mut()
        .annotations
        .get_or_insert_with(Default::default)
        .insert(ANNOTATION_APPLIED.to_string(), hash);
    Ok(out)
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
    let desired = with_applied_hash(desired)?;
    if let Some(live) = live {
        if is_subset(
            &serde_json::to_value(&desired)?,
            &serde_json::to_value(live)?,
        ) {
            return Ok(live.clone());
        }
    }
    Ok(api
        .patch(
            name,
            &PatchParams::apply(manager).force(),
            &Patch::Apply(&desired),
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

    /// What kube-apiserver v1.37 stores for what the operator applies (read off the real
    /// server): zero values dropped, defaults added, another manager's sidecar kept.
    #[test]
    fn what_the_real_server_stores_is_what_was_applied() {
        let desired = json!({"spec": {"template": {"spec": {
            "containers": [{"name": "worker", "image": "w:1",
                            "ports": [{"containerPort": 8000, "name": "http"}],
                            "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": false},
                                             {"name": "models", "mountPath": "/cache", "readOnly": true}]}],
            "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "m", "readOnly": false}}],
            "hostNetwork": false, "priorityClassName": "", "tolerations": []}}}});
        let live = json!({"spec": {"template": {"spec": {
            "containers": [{"name": "proxy", "image": "envoy"},
                           {"name": "worker", "image": "w:1", "terminationMessagePath": "/dev/termination-log",
                            "ports": [{"containerPort": 8000, "name": "http", "protocol": "TCP"}],
                            "volumeMounts": [{"name": "models", "mountPath": "/cache", "readOnly": true},
                                             {"name": "models", "mountPath": "/models"}]}],
            "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "m"}}],
            "dnsPolicy": "ClusterFirst"}}}});
        assert!(is_subset(&desired, &live));
        // A value that differs is still a change, wherever the entry sits.
        let mut other = desired.clone();
        other["spec"]["template"]["spec"]["containers"][0]["volumeMounts"][1]["readOnly"] =
            json!(false);
        assert!(!is_subset(&other, &live));
        // A true the server would keep is not a dropped zero value.
        let mut ro = desired.clone();
        ro["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["readOnly"] =
            json!(true);
        assert!(!is_subset(&ro, &live));
        // An entry the live object lacks is missing, whatever else it has.
        let mut more = desired.clone();
        more["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
            .as_array_mut()
            .unwrap()
            .push(json!({"name": "tmp", "mountPath": "/tmp"}));
        assert!(!is_subset(&more, &live));
        // Lists without a merge key (args) still match element by element.
        assert!(!is_subset(
            &json!({"args": ["a", "b"]}),
            &json!({"args": ["b", "a"]})
        ));
        assert!(!is_subset(
            &json!({"args": ["a"]}),
            &json!({"args": ["a", "b"]})
        ));
    }

    #[test]
    fn the_applied_hash_changes_with_what_is_applied_and_only_with_it() {
        use k8s_openapi::api::core::v1::ConfigMap;
        let cm = |data: &[(&str, &str)]| -> ConfigMap {
            serde_json::from_value(json!({"metadata": {"name": "c", "annotations": {"x": "1"}},
                "data": data.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<std::collections::BTreeMap<_, _>>()}))
            .unwrap()
        };
        let hash =
            |c: &ConfigMap| c.metadata.annotations.as_ref().unwrap()[ANNOTATION_APPLIED].clone();
        let a = with_applied_hash(&cm(&[("k", "v"), ("gone", "x")])).unwrap();
        // Hashing the hashed object again gives the same hash (the annotation is left out).
        assert_eq!(hash(&with_applied_hash(&a).unwrap()), hash(&a));
        // A key dropped from the rendering: the live object (which still has it) no longer
        // carries what would be applied.
        let b = with_applied_hash(&cm(&[("k", "v")])).unwrap();
        assert_ne!(hash(&a), hash(&b));
        assert!(!is_subset(
            &serde_json::to_value(&b).unwrap(),
            &serde_json::to_value(&a).unwrap()
        ));
        assert_eq!(a.metadata.annotations.as_ref().unwrap()["x"], "1");
    }

    #[test]
    fn quantities_compare_by_value_where_they_are_quantities() {
        for (a, b) in [
            ("1000m", "1"),
            ("1024Mi", "1Gi"),
            ("0.5Gi", "512Mi"),
            ("0.5", "500m"),
            ("1e3", "1k"),
            ("1E", "1000P"),
            ("1.5", "1500m"),
            ("100n", "0.1u"),
            ("2", "2"),
        ] {
            assert!(same_quantity(a, b), "{a} == {b}");
        }
        for (a, b) in [
            ("1", "1001m"),
            ("1Gi", "1G"),
            ("1", "x"),
            ("", "0"),
            ("1.2.3", "1"),
        ] {
            assert!(!same_quantity(a, b), "{a} != {b}");
        }
        let desired = json!({"resources": {"requests": {"cpu": "1000m", "memory": "1024Mi"},
                                           "limits": {"nvidia.com/gpu": "1"}},
                             "emptyDir": {"sizeLimit": "1Gi"}});
        let live = json!({"resources": {"requests": {"cpu": "1", "memory": "1Gi"},
                                        "limits": {"nvidia.com/gpu": "1"}},
                          "emptyDir": {"sizeLimit": "1024Mi"}});
        assert!(is_subset(&desired, &live));
        let more = json!({"resources": {"requests": {"cpu": "2"}}});
        assert!(!is_subset(&more, &live));
        // Elsewhere a string is a string: a label "1000m" is not a label "1".
        assert!(!is_subset(
            &json!({"metadata": {"labels": {"cpu": "1000m"}}}),
            &json!({"metadata": {"labels": {"cpu": "1"}}})
        ));
    }
}
