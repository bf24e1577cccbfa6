//! The InferencePool controller: observe → validate → build → apply → status.
//!
//! It owns `<pool>-config` (the WorkerConfig), `<pool>-dynamic` (Deployment + PDB) and the
//! Service `<pool>`. Adapter changes rewrite only the ConfigMap (pods never restart for them)
//! and each ready pod is told to reload.

mod apply;
mod build;
mod observe;
mod status;

use std::sync::Arc;

use kube::runtime::controller::Action;
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

fn key(pool: &InferencePool) -> String {
    super::reconcile::key(CONTROLLER, pool)
}

async fn reconcile_inner(pool: &InferencePool, ctx: &Context) -> Result<Action> {
    let now = chrono::Utc::now();
    if let Err(fe) = validate_pool(pool) {
        status::refuse(pool, ctx, &fe, now).await?;
        // Nothing already running is touched; wait for the spec to change.
        return Ok(Action::await_change());
    }
    let observed = observe::observe(pool, ctx).await?;
    let desired = build::desired(
        pool,
        &observed.adapters,
        &observed.pods,
        &observed.peers(ctx.pods.port()),
        ctx.pods.port(),
        &ctx.images,
    );
    let applied = apply::apply(pool, ctx, &observed, &desired).await?;
    let report = status::report(pool, &observed, &applied, now);
    status::publish(pool, ctx, &report).await?;
    Ok(status::requeue(
        &report,
        &applied.reload,
        &desired.config_hash,
    ))
}
