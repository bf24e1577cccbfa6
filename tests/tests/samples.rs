//! Every sample in config/samples/ deserializes into the Rust types, passes the generated CRD's
//! structural schema (types, required fields, enums, ranges, unknown fields) and the operator's
//! validation (which enforces the same rules as the CRD's CEL expressions); the invalid sample
//! fails for the reason its first line states.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test

use std::path::{Path, PathBuf};

use mole_crds::{Adapter, InferencePool};
use mole_operator::controller::validate::{validate_adapter, validate_pool};
use serde_json::Value;

fn samples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/samples")
}

fn schema_of(kind: &str) -> Value {
    mole_crds::openapi_schema(kind).unwrap()
}

/// Structural validation of `v` against an OpenAPI v3 schema (the subset CRDs use).
fn check(v: &Value, s: &Value, path: &str, errs: &mut Vec<String>) {
    if s.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true))
        || s.get("x-kubernetes-int-or-string") == Some(&Value::Bool(true))
    {
        return;
    }
    if v.is_null() {
        if s.get("nullable") != Some(&Value::Bool(true)) {
            errs.push(format!("{path}: null"));
        }
        return;
    }
    let ty = s.get("type").and_then(Value::as_str).unwrap_or("");
    let ok = match ty {
        "object" => v.is_object(),
        "array" => v.is_array(),
        "string" => v.is_string(),
        "integer" => v.is_i64() || v.is_u64(),
        "number" => v.is_number(),
        "boolean" => v.is_boolean(),
        _ => true,
    };
    if !ok {
        errs.push(format!("{path}: expected {ty}, got {v}"));
        return;
    }
    if let Some(e) = s.get("enum").and_then(Value::as_array) {
        if !e.contains(v) {
            errs.push(format!("{path}: {v} not in {e:?}"));
        }
    }
    if let (Some(min), Some(x)) = (s.get("minimum").and_then(Value::as_f64), v.as_f64()) {
        if x < min {
            errs.push(format!("{path}: {x} < {min}"));
        }
    }
    if let (Some(max), Some(x)) = (s.get("maximum").and_then(Value::as_f64), v.as_f64()) {
        if x > max {
            errs.push(format!("{path}: {x} > {max}"));
        }
    }
    if let (Some(min), Some(x)) = (s.get("minLength").and_then(Value::as_u64), v.as_str()) {
        if (x.chars().count() as u64) < min {
            errs.push(format!("{path}: shorter than {min}"));
        }
    }
    if let Some(obj) = v.as_object() {
        for r in s
            .get("required")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let r = r.as_str().unwrap();
            if !obj.contains_key(r) {
                errs.push(format!("{path}.{r}: required"));
            }
        }
        let props = s.get("properties").and_then(Value::as_object);
        let extra = s.get("additionalProperties");
        for (k, val) in obj {
            let p = format!("{path}.{k}");
            match (props.and_then(|p| p.get(k)), extra) {
                (Some(sub), _) => check(val, sub, &p, errs),
                (None, Some(sub)) if sub.is_object() => check(val, sub, &p, errs),
                (None, _)
                    if path.is_empty() && (k == "apiVersion" || k == "kind" || k == "metadata") => {
                }
                (None, _) if props.is_some() => errs.push(format!("{p}: unknown field")),
                _ => {}
            }
        }
    }
    if let (Some(items), Some(arr)) = (s.get("items"), v.as_array()) {
        for (i, x) in arr.iter().enumerate() {
            check(x, items, &format!("{path}[{i}]"), errs);
        }
    }
}

fn load(name: &str) -> (String, Value) {
    let text = std::fs::read_to_string(samples().join(name)).unwrap();
    let v: Value = serde_yaml::from_str(&text).unwrap();
    (text, v)
}

#[test]
fn every_valid_sample_passes_schema_and_validation() {
    let (_, pool_v) = load("pool-qwen3-vl-8b.yaml");
    let mut errs = Vec::new();
    check(&pool_v, &schema_of("InferencePool"), "", &mut errs);
    assert!(errs.is_empty(), "{errs:?}");
    let pool: InferencePool = serde_json::from_value(pool_v).unwrap();
    assert_eq!(validate_pool(&pool), Ok(()));
    assert_eq!(
        pool.spec.gpu.node_selector["nvidia.com/gpu.product"],
        "NVIDIA-H100-80GB-HBM3"
    );

    let mut adapters = Vec::new();
    for e in std::fs::read_dir(samples()).unwrap() {
        let name = e.unwrap().file_name().to_string_lossy().to_string();
        if !name.starts_with("adapter-") {
            continue;
        }
        let (_, v) = load(&name);
        let mut errs = Vec::new();
        check(&v, &schema_of("Adapter"), "", &mut errs);
        assert!(errs.is_empty(), "{name}: {errs:?}");
        adapters.push(serde_json::from_value::<Adapter>(v).unwrap());
    }
    assert_eq!(
        adapters.len(),
        6,
        "calendar, claim-window, desktop, appointment, login-window, chart-screen"
    );
    for a in &adapters {
        assert_eq!(
            validate_adapter(a, Some(&pool), &adapters),
            Ok(()),
            "{:?}",
            a.metadata.name
        );
    }
    let merged = adapters
        .iter()
        .filter(|a| a.spec.serving.mode == mole_crds::ServingMode::Merged)
        .count();
    assert_eq!(merged, 2, "calendar and claim-window are merged");
}

#[test]
fn the_invalid_sample_fails_for_its_stated_reason() {
    let (text, v) = load("invalid-adapter.yaml");
    assert!(text
        .lines()
        .next()
        .unwrap()
        .contains("spec.source.path is absolute"));
    let (_, pool_v) = load("pool-qwen3-vl-8b.yaml");
    let pool: InferencePool = serde_json::from_value(pool_v).unwrap();
    let a: Adapter = serde_json::from_value(v).unwrap();
    let err = validate_adapter(&a, Some(&pool), &[]).unwrap_err();
    assert_eq!(err.field, "spec.source.path");
    // The API server refuses it too: the CRD carries the same rule for that field.
    let schema = schema_of("Adapter").to_string();
    assert!(schema.contains("source.path must be relative and must not contain '..'"));
}

#[test]
fn the_structural_check_catches_typos_types_and_enums() {
    let (_, mut v) = load("adapter-desktop.yaml");
    v["spec"]["serving"]["mode"] = Value::String("sometimes".into());
    v["spec"]["servng"] = Value::Bool(true);
    v["spec"]["evaluation"]["accuracy"] = Value::from(1.5);
    v["spec"]["keywords"] = Value::String("not a list".into());
    let mut errs = Vec::new();
    check(&v, &schema_of("Adapter"), "", &mut errs);
    let all = errs.join("\n");
    for needle in [
        "serving.mode",
        "spec.servng: unknown field",
        "accuracy: 1.5 > 1",
        "keywords: expected array",
    ] {
        assert!(all.contains(needle), "{needle} not in {all}");
    }
}
