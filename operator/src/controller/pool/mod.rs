//! The InferencePool controller: observe → validate → build → apply → status.
//!
//! It owns `<pool>-config` (the WorkerConfig), `<pool>-dynamic` (Deployment + PDB) and the
//! Service `<pool>`. Adapter changes rewrite only the ConfigMap (pods never restart for them)
//! and each ready pod is told to reload. It is the one writer of the pool's status, the LoRA id
//! ledger included: each reconcile gives ids to the pool's new Adapters and takes out those of
//! deleted ones ([`build::ledger`]), in its one status apply; the Adapter controller reads its
//! id from there.

mod apply;
mod build;
mod observe;
mod status;

use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use kube::ResourceExt;
use mole_crds::constants::{
    APP_NAME, LABEL_APP_COMPONENT, LABEL_APP_INSTANCE, LABEL_APP_NAME, MANAGED_BY,
};
use mole_crds::InferencePool;

pub use build::registered;
pub use status::{merged_status, RELOAD_RETRY};

use super::context::Context;
use super::reconcile::instrumented;
use super::validate::validate_pool;
use crate::error::{Error, Result};

/// The controller's name in metric labels and backoff keys.
const CONTROLLER: &str = "pool";

/// Reconciles one pool.
pub async fn reconcile(pool: Arc<InferencePool>, ctx: Arc<Context>) -> Result<Action> {
    instrumented(
        CONTROLLER,
        pool.as_ref(),
        &ctx,
        Box::pin(reconcile_inner(&pool, &ctx)),
    )
    .await
}

/// Error policy: invalid specs wait for a change; transient errors back off per object.
pub fn error_policy(pool: Arc<InferencePool>, err: &Error, ctx: Arc<Context>) -> Action {
    super::reconcile::error_policy(CONTROLLER, pool.as_ref(), err, &ctx)
}

/// The label selector of the Pods the pool controller watches: every pool's dynamic pods (the
/// labels of their Deployment's immutable selector, so every such pod carries them).
pub fn dynamic_pods_selector() -> String {
    format!("{LABEL_APP_NAME}={APP_NAME},{LABEL_APP_COMPONENT}=dynamic")
}

/// The pool a watched Pod belongs to (its `app.kubernetes.io/instance`), so a dynamic pod
/// turning ready, or going, reconciles its pool at once: the WorkerConfig's `peers` and each
/// pod's reload follow it instead of waiting for the next requeue. None for a pod that is
/// not a pool's dynamic pod (another component, or not the operator's: a Pod can carry any
/// labels, so the managers' own label is checked too).
pub fn pool_of_pod(pod: &Pod) -> Option<ObjectRef<InferencePool>> {
    let l = pod.labels();
    let is = |k: &str, v: &str| l.get(k).is_some_and(|x| x == v);
    let ours = is(LABEL_APP_NAME, APP_NAME)
        && is(LABEL_APP_COMPONENT, "dynamic")
        && l.get(mole_crds::constants::LABEL_APP_MANAGED_BY)
            .is_none_or(|m| m == MANAGED_BY);
    let pool = l.get(LABEL_APP_INSTANCE).filter(|_| ours)?;
    Some(ObjectRef::new(pool).within(&pod.namespace().unwrap_or_default()))
}

fn key(pool: &InferencePool) -> String {
    super::reconcile::key(CONTROLLER, pool)
}

async fn reconcile_inner(pool: &InferencePool, ctx: &Context) -> Result<Action> {
    let now = chrono::Utc::now();
    // The id ledger is settled on every path, a refused pool's included: its status write
    // carries the ledger, and Adapters wait for their ids (and deleted ones for their release)
    // whatever the state of the pool itself.
    let (base, adapters) = observe::ledger(pool, ctx).await?;
    let ids = status::Ids {
        settled: build::ledger(pool, &base.ledger, &adapters),
        guard: base.guard,
    };
    if let Err(fe) = validate_pool(pool) {
        status::refuse(pool, ctx, &ids, &fe, now).await?;
        // Nothing already running is touched; wait for the spec to change.
        return Ok(Action::await_change());
    }
    let result = serve(pool, ctx, &ids, now).await;
    if let Err(e) = &result {
        // Conflicts are retried from a fresh read; anything else is the state now.
        if !matches!(e, Error::Conflict { .. } | Error::StoreClosed) {
            if let Err(write) = status::failed(pool, ctx, &ids, e, now).await {
                tracing::warn!(error = %write, "could not record the failure in the status");
            }
        }
    }
    result
}

/// The pipeline of an accepted pool.
async fn serve(
    pool: &InferencePool,
    ctx: &Context,
    ids: &status::Ids,
    now: chrono::DateTime<chrono::Utc>,
) -> Result<Action> {
    let observed = observe::observe(pool, ctx).await?;
    let desired = build::desired(
        pool,
        &ids.settled.served(),
        &observed.adapters,
        &observed.pods,
        &observed.peers(ctx.pods.port()),
        ctx.pods.port(),
        &ctx.images,
    );
    let applied = apply::apply(pool, ctx, &observed, &desired).await?;
    let report = status::report(pool, ids, &observed, &applied, now);
    status::publish(pool, ctx, ids, &report).await?;
    Ok(status::requeue(
        &report,
        &applied.reload,
        &desired.config_hash,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(labels: serde_json::Value) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "vl-dynamic-x1", "namespace": "ml", "labels": labels}
        }))
        .unwrap()
    }

    #[test]
    fn a_dynamic_pod_maps_to_its_pool_and_nothing_else_does() {
        let labels = |component: &str| {
            crate::resources::labels("vl", component)
                .into_iter()
                .map(|(k, v)| (k, serde_json::Value::String(v)))
                .collect::<serde_json::Map<_, _>>()
        };
        let dynamic = pod(labels("dynamic").into());
        assert_eq!(
            pool_of_pod(&dynamic),
            Some(ObjectRef::new("vl").within("ml"))
        );
        assert_eq!(pool_of_pod(&pod(labels("merged").into())), None);
        // The selector's labels alone (a pod of an older template) are enough.
        let mut bare = labels("dynamic");
        bare.retain(|k, _| crate::resources::selector("vl", "dynamic").contains_key(k));
        assert!(pool_of_pod(&pod(bare.into())).is_some());
        // Another manager's pod with look-alike labels is not ours.
        let mut other = labels("dynamic");
        other.insert(
            mole_crds::constants::LABEL_APP_MANAGED_BY.into(),
            "someone-else".into(),
        );
        assert_eq!(pool_of_pod(&pod(other.into())), None);
        assert_eq!(pool_of_pod(&pod(serde_json::json!({}))), None);
        // The watch selects what the mapping accepts.
        let sel = dynamic_pods_selector();
        for kv in sel.split(',') {
            let (k, v) = kv.split_once('=').unwrap();
            assert_eq!(
                dynamic.labels().get(k).map(String::as_str),
                Some(v),
                "{sel}"
            );
        }
    }
}
