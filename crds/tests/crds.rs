//! The committed CRDs in charts/mole/crds/ are exactly what `crdgen` generates (regenerate with
//! `cargo run -p mole-crds --bin crdgen`), and `kubectl get` shows the documented columns.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test

use std::path::Path;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;

fn chart_crds() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../charts/mole/crds")
}

#[test]
fn committed_crds_match_the_generated_ones() {
    for (name, yaml) in mole_crds::crds_yaml().unwrap() {
        let path = chart_crds().join(format!("{name}.yaml"));
        let committed = std::fs::read_to_string(&path).unwrap_or_else(|e| {
            panic!(
                "{}: {e}; run `cargo run -p mole-crds --bin crdgen`",
                path.display()
            )
        });
        // The same document with its keys in another order is not stale: a workspace build
        // turns on serde_json's `preserve_order` (the worker's grammar engine needs it), which
        // orders some generated schema keys as declared instead of sorted.
        let same = committed == yaml
            || serde_yaml::from_str::<serde_yaml::Value>(&committed).unwrap()
                == serde_yaml::from_str::<serde_yaml::Value>(&yaml).unwrap();
        assert!(
            same,
            "{} is stale; run `cargo run -p mole-crds --bin crdgen` and commit the result",
            path.display()
        );
    }
}

fn columns(crd: &CustomResourceDefinition, wide: bool) -> Vec<String> {
    crd.spec.versions[0]
        .additional_printer_columns
        .clone()
        .unwrap_or_default()
        .into_iter()
        .filter(|c| wide || c.priority.unwrap_or(0) == 0)
        .map(|c| c.name.to_uppercase())
        .collect()
}

#[test]
fn kubectl_get_columns() {
    use kube::CustomResourceExt;
    let adapters = mole_crds::Adapter::crd();
    assert_eq!(
        columns(&adapters, false),
        ["POOL", "VERSION", "MODE", "PHASE", "LORA-ID", "AGE"]
    );
    assert_eq!(
        columns(&adapters, true),
        ["POOL", "VERSION", "MODE", "PHASE", "LORA-ID", "ACTIVE", "ENDPOINT", "AGE"]
    );
    let pools = mole_crds::InferencePool::crd();
    assert_eq!(
        columns(&pools, false),
        ["MODEL", "READY", "ADAPTERS", "PHASE", "AGE"]
    );
    assert!(adapters.spec.versions[0]
        .subresources
        .as_ref()
        .unwrap()
        .status
        .is_some());
    assert_eq!(adapters.spec.scope, "Namespaced");
    assert!(adapters
        .spec
        .names
        .short_names
        .as_ref()
        .unwrap()
        .contains(&"lora".to_string()));
}

#[test]
fn cel_rules_are_in_the_schema() {
    let all: String = mole_crds::crds()
        .iter()
        .map(|c| serde_json::to_string(c).unwrap())
        .collect();
    for rule in [
        "!('classifier' in self.strategies) || has(self.classifierAdapter)",
        "source.path must be relative and must not contain '..'",
        "version must not be empty",
        "self == oldSelf",
        "pool is immutable: to move the adapter to another pool, delete it and create it again",
    ] {
        assert!(all.contains(rule), "missing CEL rule or message: {rule}");
    }
}

/// Whether a schema node has a size the API server's CEL cost estimator can use: strings need
/// `maxLength` (or an `enum`, whose longest value bounds them), lists `maxItems` and bounded
/// items, maps `maxProperties`. Without one the estimator assumes the whole request size and
/// rejects rules such as `self.all(s, self.exists_one(t, t == s))` or `self.matches(...)` with
/// "estimated rule cost exceeds budget".
fn bounded(s: &serde_json::Value) -> Result<(), String> {
    match s.get("type").and_then(|t| t.as_str()) {
        Some("string") => {
            if s.get("maxLength").is_some() || s.get("enum").is_some() {
                Ok(())
            } else {
                Err("string without maxLength".into())
            }
        }
        Some("array") => {
            if s.get("maxItems").is_none() {
                return Err("list without maxItems".into());
            }
            bounded(&s["items"]).map_err(|e| format!("items: {e}"))
        }
        Some("object") if s.get("additionalProperties").is_some() => {
            if s.get("maxProperties").is_none() {
                return Err("map without maxProperties".into());
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// Walks the schema; for every `x-kubernetes-validations` rule, checks `self` (when the rule
/// uses it as a value) and every `self.<field>` it names.
fn check_cel_bounds(s: &serde_json::Value, path: &str, errs: &mut Vec<String>, rules: &mut usize) {
    if let Some(validations) = s.get("x-kubernetes-validations").and_then(|v| v.as_array()) {
        for v in validations {
            let rule = v["rule"].as_str().unwrap();
            *rules += 1;
            let props = s.get("properties");
            let mut self_as_value = false;
            for m in rule.match_indices("self") {
                let rest = &rule[m.0 + 4..];
                // `self.<identifier>`: a field of self, unless it is a method call.
                let field = rest.strip_prefix('.').map(|r| {
                    r.chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect::<String>()
                });
                match field {
                    Some(f) if props.and_then(|p| p.get(&f)).is_some() => {
                        if let Err(e) = bounded(&props.unwrap()[&f]) {
                            errs.push(format!("{path}.{f} (used by `{rule}`): {e}"));
                        }
                    }
                    // `self.all(...)`, `self.matches(...)`, `self != ''`: self is the value.
                    _ => self_as_value |= !rest.starts_with('_'),
                }
            }
            if self_as_value {
                if let Err(e) = bounded(s) {
                    errs.push(format!("{path} (used by `{rule}`): {e}"));
                }
            }
        }
    }
    if let Some(props) = s.get("properties").and_then(|p| p.as_object()) {
        for (k, v) in props {
            check_cel_bounds(v, &format!("{path}.{k}"), errs, rules);
        }
    }
    if let Some(items) = s.get("items") {
        check_cel_bounds(items, &format!("{path}[]"), errs, rules);
    }
}

#[test]
fn every_field_a_cel_rule_touches_has_a_size_bound() {
    let mut errs = Vec::new();
    let mut rules = 0;
    for crd in mole_crds::crds() {
        let schema = mole_crds::openapi_schema(&crd.spec.names.kind).unwrap();
        check_cel_bounds(&schema, &crd.spec.names.kind, &mut errs, &mut rules);
    }
    assert!(
        rules >= 8,
        "found only {rules} CEL rules: the walk is broken"
    );
    assert!(
        errs.is_empty(),
        "unbounded CEL inputs:\n{}",
        errs.join("\n")
    );
}

#[test]
fn the_cel_bound_check_catches_an_unbounded_list() {
    let schema = serde_json::json!({"type": "object", "properties": {"strategies": {
        "type": "array", "items": {"type": "string"},
        "x-kubernetes-validations": [{"rule": "self.all(s, self.exists_one(t, t == s))"}]}}});
    let (mut errs, mut rules) = (Vec::new(), 0);
    check_cel_bounds(&schema, "X", &mut errs, &mut rules);
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert!(errs[0].contains("maxItems"));
}

/// The names `kubectl` resolves for the Gateway API Inference Extension's CRDs, from their CRD
/// YAML in kubernetes-sigs/gateway-api-inference-extension (config/crd/bases at 84436a9, and
/// the inference.networking.x-k8s.io CRDs before their removal): the plurals, singulars and
/// kinds of InferencePool (both groups), InferencePoolImport, InferenceModel,
/// InferenceObjective and InferenceModelRewrite, and the short names `infpool` (v1
/// InferencePool), `xinfpool` (v1alpha2 InferencePool) and `infpimp` (InferencePoolImport);
/// the other kinds have none, and none declares a category.
const GIE_NAMES: &[&str] = &[
    "inferencepools",
    "inferencepool",
    "infpool",
    "xinfpool",
    "inferencepoolimports",
    "inferencepoolimport",
    "infpimp",
    "inferencemodels",
    "inferencemodel",
    "inferenceobjectives",
    "inferenceobjective",
    "inferencemodelrewrites",
    "inferencemodelrewrite",
];

#[test]
fn short_names_and_the_mole_category_are_unambiguous_beside_the_inference_extension() {
    use kube::CustomResourceExt;
    let pools = mole_crds::InferencePool::crd().spec.names;
    let adapters = mole_crds::Adapter::crd().spec.names;
    assert_eq!(
        pools.short_names.as_deref(),
        Some(&["ipool".to_string(), "mpool".into(), "molepool".into()][..])
    );
    assert_eq!(
        adapters.short_names.as_deref(),
        Some(&["lora".to_string()][..])
    );
    // `kubectl get mole` lists pools and adapters together.
    for names in [&pools, &adapters] {
        assert_eq!(names.categories.as_deref(), Some(&["mole".to_string()][..]));
    }
    // Every short name and the category name only mole's kinds, whatever else is installed
    // (`inferencepools` itself stays ambiguous: that is what the short names are for).
    for name in pools
        .short_names
        .iter()
        .chain(adapters.short_names.iter())
        .flatten()
        .chain(pools.categories.iter().flatten())
    {
        assert!(
            !GIE_NAMES.contains(&name.as_str()),
            "{name} is also a Gateway API Inference Extension name"
        );
    }
    assert!(
        GIE_NAMES.contains(&pools.plural.as_str()),
        "the clash this guards against"
    );
}

/// Every `format` in the CRDs is one kube-apiserver knows: `uint32`/`uint64` (schemars' names
/// for Rust's unsigned integers) made every `helm install` and `kubectl apply` of the chart
/// print "unrecognized format" warnings (seen against kube-apiserver v1.37.2). The unsigned
/// ones keep their bounds as `minimum`/`maximum`.
#[test]
fn every_schema_format_is_one_the_api_server_knows() {
    fn formats(v: &serde_json::Value, at: &str, out: &mut Vec<(String, String)>) {
        match v {
            serde_json::Value::Object(o) => {
                if let Some(f) = o.get("format").and_then(|f| f.as_str()) {
                    out.push((at.to_string(), f.to_string()));
                }
                for (k, c) in o {
                    formats(c, &format!("{at}.{k}"), out);
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|c| formats(c, at, out)),
            _ => {}
        }
    }
    let known = [
        mole_crds::KNOWN_NUMERIC_FORMATS,
        &["date-time", "byte", "date"],
    ]
    .concat();
    let mut seen = Vec::new();
    for kind in ["InferencePool", "Adapter"] {
        formats(&mole_crds::openapi_schema(kind).unwrap(), kind, &mut seen);
    }
    let unknown: Vec<_> = seen
        .iter()
        .filter(|(_, f)| !known.contains(&f.as_str()))
        .collect();
    assert!(
        unknown.is_empty(),
        "formats the API server does not know: {unknown:?}"
    );
    // A u32 field keeps its range: maxLoras is bounded by its own maximum, and every former
    // uint32 at most by u32::MAX.
    let pool = mole_crds::openapi_schema("InferencePool").unwrap();
    let max_loras = &pool["properties"]["spec"]["properties"]["dynamic"]["properties"]["maxLoras"];
    assert_eq!(max_loras["format"], "int64");
    assert!(max_loras["minimum"].as_f64().unwrap() >= 0.0);
    assert!(max_loras["maximum"].as_f64().unwrap() <= f64::from(u32::MAX));
}
