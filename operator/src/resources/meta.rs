//! The metadata every child object starts from: the `app.kubernetes.io/*` labels, the
//! selector of its pods and the owner reference that garbage-collects it with its parent.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::Resource;
use mole_crds::constants::{
    APP_NAME, LABEL_ADAPTER, LABEL_APP_COMPONENT, LABEL_APP_INSTANCE, LABEL_APP_MANAGED_BY,
    LABEL_APP_NAME, LABEL_POOL, LABEL_ROLE, MANAGED_BY,
};
use mole_crds::InferencePool;
use sha2::{Digest, Sha256};

/// Pod-template annotation: the merged output a merged Deployment serves.
pub const ANNOTATION_MERGED_OUTPUT: &str = "mole.dev/merged-output";
/// Pod-template annotation: the adapter version a merged Deployment serves.
pub const ANNOTATION_ADAPTER_VERSION: &str = "mole.dev/adapter-version";

/// Labels of a pool's children with the given component (`dynamic`, `merged`, `merge`).
pub fn labels(pool: &str, component: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (LABEL_APP_NAME.to_string(), APP_NAME.to_string()),
        (LABEL_APP_INSTANCE.to_string(), pool.to_string()),
        (LABEL_APP_COMPONENT.to_string(), component.to_string()),
        (LABEL_APP_MANAGED_BY.to_string(), MANAGED_BY.to_string()),
        (LABEL_POOL.to_string(), pool.to_string()),
        (LABEL_ROLE.to_string(), component.to_string()),
    ])
}

/// The label selector of a pool's pods of one component (a subset of [`labels`] that never
/// changes, since Deployment selectors are immutable).
pub fn selector(pool: &str, component: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (LABEL_APP_NAME.to_string(), APP_NAME.to_string()),
        (LABEL_APP_INSTANCE.to_string(), pool.to_string()),
        (LABEL_APP_COMPONENT.to_string(), component.to_string()),
    ])
}

/// Owner reference making the pool own (and garbage-collect) a child.
pub fn owner(pool: &InferencePool) -> OwnerReference {
    pool.controller_owner_ref(&())
        .expect("pools read from the API have a name and uid")
}

/// Short sha256 of a JSON value (annotations, names).
pub fn short_hash(v: &serde_json::Value) -> String {
    hex::encode(&Sha256::digest(canonical_json(v).as_bytes())[..8])
}

/// `v` as text with every object's keys sorted: what serde_json writes without its
/// `preserve_order` feature. A hash of it must not change with the build's features (the
/// worker's grammar engine turns `preserve_order` on for the whole workspace), or an upgraded
/// operator would see every pool's pods and merge outputs as changed.
pub fn canonical_json(v: &serde_json::Value) -> String {
    fn sorted(v: &serde_json::Value) -> serde_json::Value {
        match v {
            serde_json::Value::Object(m) => {
                let mut keys: Vec<&String> = m.keys().collect();
                keys.sort();
                serde_json::Value::Object(
                    keys.into_iter()
                        .map(|k| (k.clone(), sorted(&m[k])))
                        .collect(),
                )
            }
            serde_json::Value::Array(a) => serde_json::Value::Array(a.iter().map(sorted).collect()),
            other => other.clone(),
        }
    }
    sorted(v).to_string()
}

/// What a set of sibling children share: namespace, labels, the selector of their pods and
/// their owner. Every builder names its object through [`ChildMeta::named`], so no child can
/// miss the labels the controllers watch by or the owner reference that deletes it.
#[derive(Debug, Clone, PartialEq)]
pub struct ChildMeta {
    /// Namespace (None for objects created through a namespaced API, like merge Jobs).
    pub namespace: Option<String>,
    /// Labels of the objects and of their pods.
    pub labels: BTreeMap<String, String>,
    /// Selector of their pods (immutable once a Deployment exists).
    pub selector: BTreeMap<String, String>,
    /// Owner (the pool, or the Adapter for merge-down children).
    pub owner: OwnerReference,
}

impl ChildMeta {
    /// Children of a pool's `component`, owned by the pool.
    pub fn of_pool(pool: &InferencePool, component: &str) -> Self {
        let name = pool.metadata.name.clone().unwrap_or_default();
        Self {
            namespace: pool.metadata.namespace.clone(),
            labels: labels(&name, component),
            selector: selector(&name, component),
            owner: owner(pool),
        }
    }

    /// Children of one adapter's `component` in `pool`, owned by `owner` (the Adapter).
    /// The adapter label is in the selector too: each adapter's pods are its own.
    pub fn of_adapter(
        pool: &str,
        namespace: Option<String>,
        adapter: &str,
        component: &str,
        owner: OwnerReference,
    ) -> Self {
        let mut meta = Self {
            namespace,
            labels: labels(pool, component),
            selector: selector(pool, component),
            owner,
        };
        meta.labels
            .insert(LABEL_ADAPTER.to_string(), adapter.to_string());
        meta.selector
            .insert(LABEL_ADAPTER.to_string(), adapter.to_string());
        meta
    }

    /// The metadata of one object called `name`.
    pub fn named(&self, name: impl Into<String>) -> ObjectMeta {
        ObjectMeta {
            name: Some(name.into()),
            namespace: self.namespace.clone(),
            labels: Some(self.labels.clone()),
            owner_references: Some(vec![self.owner.clone()]),
            ..Default::default()
        }
    }

    /// The metadata of one object called `name`, with annotations.
    pub fn annotated(
        &self,
        name: impl Into<String>,
        annotations: BTreeMap<String, String>,
    ) -> ObjectMeta {
        ObjectMeta {
            annotations: Some(annotations),
            ..self.named(name)
        }
    }
}
