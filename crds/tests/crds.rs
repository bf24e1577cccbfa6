//! The committed CRDs in charts/mole/crds/ are exactly what `crdgen` generates (regenerate with
//! `cargo run -p mole-crds --bin crdgen`), and `kubectl get` shows the documented columns.

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
        assert!(
            committed == yaml,
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
    ] {
        assert!(all.contains(rule), "missing CEL rule or message: {rule}");
    }
}
