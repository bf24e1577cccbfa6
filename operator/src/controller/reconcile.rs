//! The wrapper every reconcile runs in, whatever the kind: a tracing span naming the object,
//! the reconcile counter and duration histogram, backoff bookkeeping, and the Warning Event of
//! a failed reconcile; and the error policy both controllers share.

use std::time::Instant;

use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};
use tracing::Instrument;

use super::context::Context;
use crate::error::{Error, Result};

/// A controller's name as it appears in metric labels and backoff keys (`pool`, `adapter`).
pub type ControllerName = &'static str;

/// The backoff key of an object: `<controller>/<namespace>/<name>`.
pub(crate) fn key<K: Resource>(controller: ControllerName, obj: &K) -> String {
    format!(
        "{controller}/{}/{}",
        obj.namespace().unwrap_or_default(),
        obj.name_any()
    )
}

/// Runs one reconcile of `obj` (`body`) inside a span carrying the object's kind, namespace
/// and name, counts and times it under `controller`, and settles its backoff: a success
/// forgets earlier failures, an error publishes its Warning Event here because the
/// controller's error policy is synchronous. The body comes boxed: a reconcile's future is
/// large, and moving it through the wrapper's frames by value overflows a thread's stack.
pub(crate) async fn instrumented<K>(
    controller: ControllerName,
    obj: &K,
    ctx: &Context,
    body: BoxFuture<'_, Result<Action>>,
) -> Result<Action>
where
    K: Resource<DynamicType = ()>,
{
    let span = tracing::info_span!(
        "reconcile",
        kind = %K::kind(&()),
        namespace = %obj.namespace().unwrap_or_default(),
        name = %obj.name_any(),
    );
    async move {
        let _in_flight = ctx.reconciling();
        let started = Instant::now();
        ctx.metrics
            .reconciles
            .with_label_values(&[controller])
            .inc();
        let result = body.await;
        ctx.metrics
            .duration
            .with_label_values(&[controller])
            .observe(started.elapsed().as_secs_f64());
        match &result {
            Ok(_) => ctx.succeeded(&key(controller, obj)),
            Err(e) => error_event(ctx, &obj.object_ref(&()), e).await,
        }
        result
    }
    .instrument(span)
    .await
}

/// Error policy of both controllers: invalid specs wait for a change; transient errors back
/// off per object. Counted by controller and the error's stable name.
pub(crate) fn error_policy<K>(
    controller: ControllerName,
    obj: &K,
    err: &Error,
    ctx: &Context,
) -> Action
where
    K: Resource<DynamicType = ()>,
{
    ctx.metrics
        .errors
        .with_label_values(&[controller, err.code()])
        .inc();
    tracing::warn!(
        kind = %K::kind(&()),
        namespace = %obj.namespace().unwrap_or_default(),
        name = %obj.name_any(),
        error = %err,
        "{controller} reconcile failed"
    );
    Action::requeue(ctx.backoff(&key(controller, obj)))
}

/// Publishes the Warning Event of a failed reconcile (`ReconcileError`, the message starting
/// with the error's stable name). Invalid specs never come here (validation reports them as a
/// condition and an Event naming the field, and the reconcile ends well). Nor are conflicts
/// reported: another writer got there first,
/// the retry reads afresh, and nothing is wrong for a person to act on (they are counted in
/// `mole_operator_reconcile_errors_total{error="conflict"}`).
async fn error_event(ctx: &Context, on: &ObjectReference, e: &Error) {
    // A conflict is retried at once; a shutdown is not the object's problem.
    if matches!(e, Error::Conflict { .. } | Error::ShuttingDown) {
        return;
    }
    ctx.event(
        on,
        true,
        mole_crds::constants::reason::RECONCILE_ERROR,
        "Reconcile",
        format!("{}: {e}; retrying with backoff", e.code()),
    )
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use mole_crds::InferencePool;

    #[test]
    fn backoff_keys_name_controller_namespace_and_object() {
        let pool: InferencePool = serde_json::from_value(serde_json::json!({
            "apiVersion": "mole.dev/v1alpha1", "kind": "InferencePool",
            "metadata": {"name": "vl", "namespace": "ml"},
            "spec": {"baseModel": {"name": "b", "path": "b"}, "storage": {"claimName": "m"},
                     "image": "i", "gpu": {"count": 1}}
        }))
        .unwrap();
        assert_eq!(key("pool", &pool), "pool/ml/vl");
    }
}
