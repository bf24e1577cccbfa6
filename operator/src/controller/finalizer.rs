//! A finalizer added and removed against the object as the API server holds it, not as the
//! cache last saw it.
//!
//! kube-runtime's `finalizer()` writes a JSON patch whose `test` compares the cached object's
//! finalizers: when the cache had not yet seen the previous write (the object's own last
//! patch, a second trigger right after the first reconcile), the real API server refused it
//! with 422 and every Adapter's first reconcile failed with a Warning Event. Here the write is
//! conditioned on a fresh read's resourceVersion instead, and losing that race is a
//! [`Error::Conflict`], retried at once without an Event.

use k8s_openapi::NamespaceResourceScope;
use kube::api::{Patch, PatchParams};
use kube::{Api, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{json, Value};

use crate::error::{Error, Result};

/// What a reconcile does with an object and its finalizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Live, finalizer in place: reconcile it.
    Serve,
    /// Live without the finalizer: add it first.
    Add,
    /// Being deleted with the finalizer: clean up, then remove it.
    Cleanup,
    /// Being deleted and already cleaned up: nothing to do.
    Done,
}

/// The step for `obj` and finalizer `name`.
pub fn step<K: Resource>(obj: &K, name: &str) -> Step {
    let has = obj.finalizers().iter().any(|f| f == name);
    match (obj.meta().deletion_timestamp.is_some(), has) {
        (false, true) => Step::Serve,
        (false, false) => Step::Add,
        (true, true) => Step::Cleanup,
        (true, false) => Step::Done,
    }
}

/// The JSON patch setting the finalizers of `fresh` to `finalizers`, applied only if the
/// object is still at `fresh`'s resourceVersion (the `test` fails otherwise).
pub fn guarded_patch<K: Resource>(fresh: &K, finalizers: &[String]) -> Value {
    json!([
        {"op": "test", "path": "/metadata/resourceVersion",
         "value": fresh.meta().resource_version.clone().unwrap_or_default()},
        {"op": "add", "path": "/metadata/finalizers", "value": finalizers},
    ])
}

/// What [`add`] and [`remove`] need of an object: namespaced, read and patched through
/// [`Api`].
pub trait Finalized:
    Resource<Scope = NamespaceResourceScope> + Clone + DeserializeOwned + Serialize + std::fmt::Debug
{
}

impl<K> Finalized for K where
    K: Resource<Scope = NamespaceResourceScope>
        + Clone
        + DeserializeOwned
        + Serialize
        + std::fmt::Debug
{
}

fn conflict_or(e: kube::Error, what: &str) -> Error {
    match &e {
        // 422: the `test` failed (the object changed since the read); 409: a conflict.
        kube::Error::Api(s) if s.code == 422 || s.code == 409 => Error::Conflict {
            what: what.into(),
            source: e,
        },
        _ => Error::Kube(e),
    }
}

/// Adds finalizer `name` to the object `obj` names, reading it fresh first: the cached `obj`
/// may lag behind. Returns the object as the server holds it afterwards.
pub async fn add<K: Finalized>(api: &Api<K>, obj: &K, name: &str) -> Result<K> {
    let fresh = api.get(&obj.name_any()).await?;
    if step(&fresh, name) != Step::Add {
        return Ok(fresh);
    }
    let mut finalizers = fresh.finalizers().to_vec();
    finalizers.push(name.to_string());
    let patch: json_patch::Patch = serde_json::from_value(guarded_patch(&fresh, &finalizers))?;
    api.patch(
        &obj.name_any(),
        &PatchParams::default(),
        &Patch::<()>::Json(patch),
    )
    .await
    .map_err(|e| conflict_or(e, &format!("adding the finalizer of {}", obj.name_any())))
}

/// Removes finalizer `name` from the object `obj` names (read fresh), leaving every other
/// finalizer. Gone already (or the finalizer gone): nothing to do.
pub async fn remove<K: Finalized>(api: &Api<K>, obj: &K, name: &str) -> Result<()> {
    let Some(fresh) = api.get_opt(&obj.name_any()).await? else {
        return Ok(());
    };
    if !fresh.finalizers().iter().any(|f| f == name) {
        return Ok(());
    }
    let rest: Vec<String> = fresh
        .finalizers()
        .iter()
        .filter(|f| *f != name)
        .cloned()
        .collect();
    let patch: json_patch::Patch = serde_json::from_value(guarded_patch(&fresh, &rest))?;
    match api
        .patch(
            &obj.name_any(),
            &PatchParams::default(),
            &Patch::<()>::Json(patch),
        )
        .await
    {
        Ok(_) => Ok(()),
        // Deleted meanwhile: the last finalizer went elsewhere.
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(conflict_or(
            e,
            &format!("removing the finalizer of {}", obj.name_any()),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mole_crds::Adapter;

    fn adapter(finalizers: &[&str], deleting: bool) -> Adapter {
        let mut meta = json!({"name": "a", "namespace": "ml", "resourceVersion": "7",
                              "finalizers": finalizers});
        if deleting {
            meta["deletionTimestamp"] = json!("2026-11-29T00:00:00Z");
        }
        serde_json::from_value(json!({
            "apiVersion": "mole.dev/v1alpha1", "kind": "Adapter", "metadata": meta,
            "spec": {"pool": "p", "version": "v1", "source": {"path": "a"}}
        }))
        .unwrap()
    }

    #[test]
    fn the_step_follows_the_finalizer_and_the_deletion() {
        let f = "mole.dev/adapter-cleanup";
        assert_eq!(step(&adapter(&[f], false), f), Step::Serve);
        assert_eq!(step(&adapter(&["other"], false), f), Step::Add);
        assert_eq!(step(&adapter(&["other", f], true), f), Step::Cleanup);
        assert_eq!(step(&adapter(&["other"], true), f), Step::Done);
    }

    #[test]
    fn the_patch_is_guarded_by_the_read_resource_version_and_keeps_the_others() {
        let a = adapter(&["other"], false);
        let p = guarded_patch(&a, &["other".into(), "mine".into()]);
        assert_eq!(
            p[0],
            json!({"op": "test", "path": "/metadata/resourceVersion", "value": "7"})
        );
        assert_eq!(p[1]["value"], json!(["other", "mine"]));
        // Applied to the object it was read from, it passes; to a newer one, its test fails.
        let mut v = serde_json::to_value(&a).unwrap();
        let patch: json_patch::Patch = serde_json::from_value(p).unwrap();
        json_patch::patch(&mut v.clone(), &patch).unwrap();
        v["metadata"]["resourceVersion"] = json!("8");
        assert!(json_patch::patch(&mut v, &patch).is_err());
    }
}
