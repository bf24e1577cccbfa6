//! The samples against the CRDs' own `x-kubernetes-validations`, evaluated by the `cel` crate
//! (cel-rust): every rule of the generated schema is compiled and evaluated at its schema
//! location (object properties and array items alike) on every sample, with `self` bound to the
//! value there and schema defaults applied first, as the API server does on create (so
//! `oldSelf` is unbound and transition rules are skipped) and on update (`oldSelf` bound to the
//! stored value at the same location). The valid samples pass every rule, on create and as an
//! unchanged update; `invalid-adapter.yaml` fails exactly the rule its first line names. A rule
//! that does not compile, errors, or yields a non-boolean fails the test, so a new rule cannot
//! silently go unchecked.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test

use std::path::{Path, PathBuf};

use serde_json::Value;

/// Evaluates one rule with `self` bound to `v` and, on an update, `oldSelf` to `old`. A
/// transition rule (one that reads `oldSelf`) without an old value is skipped (None), as the
/// API server skips it on create.
fn holds(rule: &str, v: &Value, old: Option<&Value>) -> Option<bool> {
    let program =
        cel::Program::compile(rule).unwrap_or_else(|e| panic!("{rule:?} does not compile: {e}"));
    let mut ctx = cel::Context::default();
    ctx.add_variable_from_value("self", cel::to_value(v).expect("JSON converts to CEL"));
    if program.references().has_variable("oldSelf") {
        let old = old?;
        ctx.add_variable_from_value("oldSelf", cel::to_value(old).expect("JSON converts to CEL"));
    }
    match program.execute(&ctx) {
        Ok(cel::Value::Bool(ok)) => Some(ok),
        other => panic!("{rule:?} on {v}: {other:?}, not a boolean"),
    }
}

/// Applies schema defaults (as the API server does before validation) and evaluates every
/// rule where a value is present; `old` is the stored object at the same location on an
/// update. Returns (rule path, message) of each failed rule; `n` counts the rules evaluated.
fn validate(
    v: &mut Value,
    old: Option<&Value>,
    s: &Value,
    path: &str,
    failed: &mut Vec<(String, String)>,
    n: &mut usize,
) {
    if let (Some(props), Some(obj)) = (
        s.get("properties").and_then(Value::as_object),
        v.as_object_mut(),
    ) {
        for (k, sub) in props {
            // The API server prunes a null it may not keep before defaulting.
            if obj.get(k).is_some_and(Value::is_null)
                && sub.get("nullable") != Some(&Value::Bool(true))
            {
                obj.remove(k);
            }
            if !obj.contains_key(k) {
                if let Some(d) = sub.get("default") {
                    obj.insert(k.clone(), d.clone());
                }
            }
            if let Some(child) = obj.get_mut(k) {
                let was = old.and_then(|o| o.get(k));
                validate(child, was, sub, &format!("{path}.{k}"), failed, n);
            }
        }
    }
    if let (Some(items), Some(arr)) = (s.get("items"), v.as_array_mut()) {
        for (i, x) in arr.iter_mut().enumerate() {
            let was = old.and_then(|o| o.get(i));
            validate(x, was, items, &format!("{path}[{i}]"), failed, n);
        }
    }
    for rule in s
        .get("x-kubernetes-validations")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        match holds(rule["rule"].as_str().unwrap(), v, old) {
            Some(true) => *n += 1,
            Some(false) => {
                *n += 1;
                let msg = rule["message"].as_str().unwrap_or("").to_string();
                failed.push((path.to_string(), msg));
            }
            None => {}
        }
    }
}

fn schema_of(kind: &str) -> Value {
    mole_crds::openapi_schema(kind).unwrap()
}

fn samples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/samples")
}

fn run(kind: &str, mut v: Value) -> (Vec<(String, String)>, usize) {
    let (mut failed, mut n) = (Vec::new(), 0);
    validate(&mut v, None, &schema_of(kind), "", &mut failed, &mut n);
    (failed, n)
}

/// An update of `old` (as stored: defaults applied) to `new`: transition rules run too.
fn run_update(kind: &str, old: Value, mut new: Value) -> (Vec<(String, String)>, usize) {
    let schema = schema_of(kind);
    // Stored as created: with its defaults (its own rules are not what this checks).
    let mut stored = old;
    validate(&mut stored, None, &schema, "", &mut Vec::new(), &mut 0);
    let (mut failed, mut n) = (Vec::new(), 0);
    validate(&mut new, Some(&stored), &schema, "", &mut failed, &mut n);
    (failed, n)
}

#[test]
fn every_sample_meets_the_crd_cel_rules_and_the_invalid_one_fails_its_rule() {
    let mut checked = 0;
    for e in std::fs::read_dir(samples()).unwrap() {
        let path = e.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let v: Value = serde::Deserialize::deserialize(doc).unwrap();
            // gateway-inference.yaml holds Gateway API objects (a GIE InferencePool, an
            // HTTPRoute): their rules are in CRDs mole does not ship, so only mole's kinds
            // are evaluated here (tests/tests/samples.rs checks that sample otherwise).
            if v["apiVersion"] != "mole.dev/v1alpha1" {
                assert_eq!(name, "gateway-inference.yaml", "a non-mole kind elsewhere");
                continue;
            }
            check_sample(&name, &text, v);
            checked += 1;
        }
    }
    assert_eq!(checked, 10, "two pools, seven adapters and the invalid one");
}

/// One mole object of the sample `name` (whose text is `text`) against its CRD's rules.
fn check_sample(name: &str, text: &str, v: Value) {
    let kind = v["kind"].as_str().unwrap().to_string();
    let (failed, rules) = run(&kind, v.clone());
    assert!(rules > 0, "{name}: no rule evaluated");
    if !name.starts_with("invalid-") {
        // Applied again unchanged: every rule holds, transition rules included (and some ran).
        let (failed, on_update) = run_update(&kind, v.clone(), v);
        assert!(failed.is_empty(), "{name} on update: {failed:?}");
        assert!(
            on_update >= rules,
            "{name}: transition rules skipped on update"
        );
    }
    if name.starts_with("invalid-") {
        // "# INVALID: spec.source.path is absolute; ... ("source.path must be relative ...")."
        assert_eq!(
            failed,
            vec![(
                ".spec.source.path".to_string(),
                "source.path must be relative and must not contain '..'".to_string()
            )],
            "{name}"
        );
        assert!(text.lines().next().unwrap().contains("spec.source.path"));
    } else {
        assert!(failed.is_empty(), "{name}: {failed:?}");
    }
}

#[test]
fn the_pool_rules_refuse_what_they_say() {
    let pool: Value = serde_yaml::from_str(
        &std::fs::read_to_string(samples().join("pool-qwen3-vl-8b.yaml")).unwrap(),
    )
    .unwrap();
    type Change = fn(&mut Value);
    let cases: Vec<(Change, &str)> = vec![
        (
            |p| p["spec"]["router"]["strategies"] = serde_json::json!(["explicit", "explicit"]),
            "router.strategies must not repeat a strategy",
        ),
        (
            |p| {
                p["spec"]["router"]["strategies"] = serde_json::json!(["classifier"]);
                p["spec"]["router"]
                    .as_object_mut()
                    .unwrap()
                    .remove("classifierAdapter");
            },
            "router.classifierAdapter is required when router.strategies contains classifier",
        ),
        (
            |p| p["spec"]["baseModel"]["path"] = serde_json::json!("base/../../etc"),
            "baseModel.path must be relative and must not contain '..'",
        ),
        (
            |p| p["spec"]["image"] = serde_json::json!(""),
            "image must not be empty",
        ),
        (
            |p| p["spec"]["baseModel"]["source"] = serde_json::json!("https://example.com/m"),
            "baseModel.source must be an hf://, s3:// or pvc:// URI",
        ),
    ];
    for (change, message) in cases {
        let mut p = pool.clone();
        change(&mut p);
        let (failed, _) = run("InferencePool", p);
        assert!(
            failed.iter().any(|(_, m)| m == message),
            "{message} not in {failed:?}"
        );
    }
    // Paths with dots that are not `..` components are fine.
    let mut p = pool.clone();
    p["spec"]["baseModel"]["path"] = serde_json::json!("base/qwen3..vl/v1.0");
    assert_eq!(run("InferencePool", p).0, vec![]);
    for uri in [
        "hf://Qwen/Qwen3-VL-8B-Instruct@main",
        "s3://models/qwen3",
        "pvc://weights/q",
    ] {
        let mut p = pool.clone();
        p["spec"]["baseModel"]["source"] = serde_json::json!(uri);
        p["spec"]["baseModel"]["secretRef"] = serde_json::json!({"name": "creds"});
        assert_eq!(run("InferencePool", p).0, vec![], "{uri}");
    }
}

#[test]
fn an_adapters_pool_cannot_change() {
    let adapter: Value = serde_yaml::from_str(
        &std::fs::read_to_string(samples().join("adapter-calendar.yaml")).unwrap(),
    )
    .unwrap();
    let message = "pool is immutable: to move the adapter to another pool, delete it and \
                   create it again naming that pool";
    // On create there is no old object: the rule does not apply.
    assert_eq!(run("Adapter", adapter.clone()).0, vec![]);
    // Any other field may change.
    let mut bumped = adapter.clone();
    bumped["spec"]["version"] = serde_json::json!("v9");
    assert_eq!(run_update("Adapter", adapter.clone(), bumped).0, vec![]);
    let mut moved = adapter.clone();
    moved["spec"]["pool"] = serde_json::json!("another-pool");
    assert_eq!(
        run_update("Adapter", adapter, moved).0,
        vec![(".spec.pool".to_string(), message.to_string())]
    );
}
