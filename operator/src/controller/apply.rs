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
/// element. Resource quantities compare by value: the API server keeps them in canonical form
/// ("1000m" as "1", "1024Mi" as "1Gi"), and comparing spellings would re-apply such objects on
/// every reconcile.
pub fn is_subset(desired: &Value, live: &Value) -> bool {
    subset(desired, live, Quantities::No)
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
            v.is_null() || l.get(k).is_some_and(|lv| subset(v, lv, child))
        }),
        (Value::Array(d), Value::Array(l)) => {
            d.len() == l.len() && d.iter().zip(l).all(|(a, b)| subset(a, b, q))
        }
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
