//! The Adapter controller: observe → validate → build → apply → status.
//!
//! It validates the adapter, reads its LoRA id from the pool's ledger (the pool controller, the
//! ledger's one writer, gives it; until then the adapter waits, `WaitingForLoraId`), fetches
//! its files when it has a `source.uri` (`fetch.rs`), and reports
//! `Ready` only when every ready dynamic pod of the pool says (over HTTP,
//! `GET /v1/lora_adapters`) that it serves this adapter version, or, for a merged adapter,
//! when its merged pods serve it (see `crate::mergedown`). A finalizer waits until the pool
//! controller has released its id, asks the pods to unload it and has its merged outputs
//! pruned before the object goes. When its pool is gone it removes the merged pods and Jobs it owns for that pool.

mod apply;
mod build;
pub mod canary;
mod fetch;
mod ledger;
mod observe;
mod status;
pub mod traffic;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use kube::runtime::controller::Action;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Resource, ResourceExt};
use mole_crds::constants::{reason, ADAPTER_FINALIZER};
use mole_crds::{Adapter, InferencePool};

pub use observe::{loaded_everywhere, observe_merged};

use super::context::Context;
use super::finalizer::{self, Step};
use super::pod_client::{operator_token, ready_pods};
use super::reconcile::instrumented;
use super::validate::validate_adapter;
use crate::error::{Error, Result};

/// The controller's name in metric labels and backoff keys.
const CONTROLLER: &str = "adapter";

/// How often an adapter refused for a reason that depends on other objects (its pool is
/// missing, another adapter holds its label) is checked again.
pub const RECHECK_OTHERS: Duration = Duration::from_secs(60);

/// Maps a pool's watch events to its Adapters, so that a change of the pool's spec re-validates
/// them: validation reads the pool (`serving.replicas` against its `rollout`, and what the pool
/// names), and a refusal otherwise waits for a change of the Adapter, while the pool's
/// WorkerConfig, validating with the new pool, would already load (or drop) it. It also wakes
/// the Adapters whose entry in the pool's id ledger changed: one waiting for its id, and a
/// deleted one whose finalizer waits for the release.
///
/// Otherwise only a new generation of the pool (or its deletion starting) triggers, as
/// controller-runtime's `GenerationChangedPredicate` does: the pool's status changes with every
/// Adapter's readiness, and re-queueing every Adapter of the pool for each would make one
/// Adapter's change cost a reconcile (and a round of pod requests) of all of them.
#[derive(Default)]
pub struct PoolTrigger {
    /// The generation and id ledger last seen of each pool (`ns/name`).
    seen: Mutex<HashMap<String, Seen>>,
}

/// What [`PoolTrigger`] last saw of a pool.
struct Seen {
    generation: Option<i64>,
    ids: std::collections::BTreeMap<String, u32>,
}

impl PoolTrigger {
    /// The Adapters of `pool` (read from the Adapter controller's store) to reconcile for this
    /// event of it: all of them when its generation is new to this trigger or it is being
    /// deleted, those whose id entry changed otherwise.
    pub fn adapters(
        &self,
        pool: &InferencePool,
        adapters: &Store<Adapter>,
    ) -> Vec<ObjectRef<Adapter>> {
        let ns = pool.namespace().unwrap_or_default();
        let name = pool.name_any();
        let now = Seen {
            generation: pool.metadata.generation,
            ids: pool
                .status
                .as_ref()
                .map(|s| s.lora_ids.clone())
                .unwrap_or_default(),
        };
        let (all, moved): (bool, Vec<String>) = {
            let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
            let before = seen.remove(&format!("{ns}/{name}"));
            let out = match &before {
                Some(b) if b.generation == now.generation => {
                    let keys: std::collections::BTreeSet<&String> =
                        b.ids.keys().chain(now.ids.keys()).collect();
                    let moved = keys
                        .into_iter()
                        .filter(|k| b.ids.get(*k) != now.ids.get(*k))
                        .cloned()
                        .collect();
                    (false, moved)
                }
                _ => (true, Vec::new()),
            };
            seen.insert(format!("{ns}/{name}"), now);
            out
        };
        let all = all || pool.metadata.deletion_timestamp.is_some();
        if !all && moved.is_empty() {
            return Vec::new();
        }
        adapters
            .state()
            .iter()
            .filter(|a| a.metadata.namespace.as_deref() == Some(ns.as_str()) && a.spec.pool == name)
            .filter(|a| all || moved.iter().any(|m| *m == a.name_any()))
            .map(|a| ObjectRef::from_obj(a.as_ref()))
            .collect()
    }
}

/// Reconciles one adapter (through the finalizer).
pub async fn reconcile(adapter: Arc<Adapter>, ctx: Arc<Context>) -> Result<Action> {
    instrumented(
        CONTROLLER,
        adapter.as_ref(),
        &ctx,
        Box::pin(finalize(&adapter, &ctx)),
    )
    .await
}

/// Error policy: invalid specs wait for a change; transient errors back off per object.
pub fn error_policy(adapter: Arc<Adapter>, err: &Error, ctx: Arc<Context>) -> Action {
    super::reconcile::error_policy(CONTROLLER, adapter.as_ref(), err, &ctx)
}

/// What to do after a validation failure with `reason`: a missing pool may be created and a
/// clashing adapter (label, name, source path) deleted, so those are checked again; a wrong
/// field waits for an edit (or for a change of the pool, see [`PoolTrigger`]).
pub fn invalid_action(reason: &str) -> Action {
    if reason == reason::POOL_NOT_FOUND
        || reason == reason::DUPLICATE_LABEL
        || reason == reason::NAME_COLLISION
        || reason == reason::SOURCE_PATH_IN_USE
    {
        Action::requeue(RECHECK_OTHERS)
    } else {
        Action::await_change()
    }
}

/// Runs [`serve`] or, once the Adapter is being deleted, [`cleanup`] behind the finalizer
/// (added and removed against the object as the server holds it: see
/// [`super::finalizer`]).
async fn finalize(adapter: &Arc<Adapter>, ctx: &Arc<Context>) -> Result<Action> {
    let ns = adapter.namespace().unwrap_or_default();
    let api: Api<Adapter> = Api::namespaced(ctx.client.clone(), &ns);
    match finalizer::step(adapter.as_ref(), ADAPTER_FINALIZER) {
        Step::Serve => serve(adapter, ctx).await,
        Step::Add => {
            let fresh = finalizer::add(&api, adapter.as_ref(), ADAPTER_FINALIZER).await?;
            match finalizer::step(&fresh, ADAPTER_FINALIZER) {
                // Served from the object as the server holds it: waiting for the watch to
                // deliver our own patch would only delay the first status.
                Step::Serve => serve(&fresh, ctx).await,
                // Deleted meanwhile: the next event says what to do.
                _ => Ok(Action::await_change()),
            }
        }
        Step::Cleanup => {
            // The pool controller releases the id once it sees the deletion; until then the
            // name keeps its entry, and nothing else is undone twice meanwhile.
            if ledger::still_listed(adapter, ctx).await? {
                return Ok(Action::requeue(ledger::RECHECK_LEDGER));
            }
            let action = cleanup(adapter, ctx).await?;
            finalizer::remove(&api, adapter.as_ref(), ADAPTER_FINALIZER).await?;
            Ok(action)
        }
        Step::Done => Ok(Action::await_change()),
    }
}

/// The pipeline of a live adapter. Its id in the pool's ledger is read between validation and
/// the pods' observation: the pods load only adapters with an id, which the pool controller
/// gives (one writer of the pool's status); until it has, the adapter waits.
async fn serve(adapter: &Adapter, ctx: &Context) -> Result<Action> {
    let now = chrono::Utc::now();
    let (pool, siblings) = observe::pool_and_siblings(adapter, ctx).await?;
    if let Err(fe) = validate_adapter(adapter, pool.as_ref(), &siblings) {
        if pool.is_none() && fe.reason == reason::POOL_NOT_FOUND {
            remove_pool_children(adapter, ctx).await?;
        }
        status::refuse(adapter, ctx, &fe, now).await?;
        return Ok(invalid_action(fe.reason));
    }
    let pool = pool.expect("validated");
    let known_id = adapter.status.as_ref().and_then(|s| s.lora_id);
    let Some(lora_id) = ledger::lora_id(adapter, &pool, ctx, known_id).await else {
        status::waiting_for_id(adapter, ctx, now).await?;
        return Ok(Action::requeue(ledger::RECHECK_LEDGER));
    };
    // Files fetched from a `source.uri` first: the pods load the version only after that.
    if let Some(action) = fetch::ensure_fetched(adapter, &pool, ctx, lora_id, now).await? {
        return Ok(action);
    }
    let mut observed = observe::observe(adapter, &pool, lora_id, ctx, now).await?;
    let rates = traffic::smooth(ctx, adapter, &pool, &observed.counters, now);
    let decision = traffic::decide_recorded(ctx, adapter, &pool, &siblings, &rates, now);
    observed.planner.fleet_merged = decision.as_ref().map(|d| d.merged());
    observed.planner.idle = traffic::idle(&pool.spec, adapter.status.as_ref(), &rates, now);
    let mut plan = build::plan(
        adapter,
        &pool,
        &status::accepted(adapter, lora_id, now),
        &observed,
    );
    // Build: the next status (traffic record, canary analysis) is decided from this round's
    // observation and plan, before anything is applied, and nothing is decided after.
    let mut next = status::report(adapter, &plan, &observed, now);
    let merged_serving = plan.merged_endpoint.is_some();
    let holding = std::mem::take(&mut observed.holding);
    if let Some(ev) = traffic::record(
        &mut next,
        adapter.status.as_ref(),
        traffic::Reading {
            rates: &rates,
            holding,
            merged: merged_serving,
        },
        decision.as_ref(),
        traffic::write_rule(&pool.spec),
        now,
    ) {
        plan.events.insert(0, ev);
    }
    let (canary, ev) = canary::step(
        &adapter.spec,
        adapter.status.as_ref().and_then(|s| s.canary.as_ref()),
        &observed.versions,
        &now.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
    );
    next.canary = canary::throttle(
        adapter.status.as_ref().and_then(|s| s.canary.as_ref()),
        canary,
        &traffic::write_rule(&pool.spec),
        now,
    );
    plan.events.extend(ev);
    apply::apply_plan(ctx, adapter, &pool, &plan, observed.merged.as_ref()).await?;
    let again = status::publish(adapter, ctx, &next, &plan, observed.load_error.as_deref()).await?;
    // Decisions that follow the traffic (canary analysis, promotion, scale to zero) are taken
    // at their own cadence, not at the 60 s of an adapter that is merely Ready.
    Ok(Action::requeue(
        traffic::fleet_cadence(adapter, &pool.spec).map_or(again, |d| d.min(again)),
    ))
}

/// The pool of a live adapter is gone: what the adapter owns for it goes too (the pool's
/// deletion does not collect it), announced once per removal.
async fn remove_pool_children(adapter: &Adapter, ctx: &Context) -> Result<()> {
    let removed = apply::remove_pool_children(ctx, adapter).await?;
    if !removed.is_empty() {
        ctx.event(
            &adapter.object_ref(&()),
            false,
            crate::reasons::POOL_CHILDREN_REMOVED,
            "Cleanup",
            format!(
                "pool {} is gone: removed {}",
                adapter.spec.pool,
                removed.join(", ")
            ),
        )
        .await;
    }
    Ok(())
}

/// Once the pool controller has released its id (which took it out of the pool's
/// WorkerConfig), asks the pool's pods to unload a deleted adapter and has its merged outputs
/// pruned. Without the pool (or with the pool being deleted) nothing can be unloaded
/// or pruned, and deletion goes on: it never waits for a pool that may not come back.
async fn cleanup(adapter: &Adapter, ctx: &Context) -> Result<Action> {
    let ns = adapter.namespace().unwrap_or_default();
    let name = adapter.name_any();
    traffic::forget(ctx, adapter);
    let pools: Api<InferencePool> = Api::namespaced(ctx.client.clone(), &ns);
    let pool = pools
        .get_opt(&adapter.spec.pool)
        .await?
        .filter(|p| p.metadata.deletion_timestamp.is_none());
    if let Some(pool) = &pool {
        let token = operator_token(&ctx.client, pool).await?;
        for pod in ready_pods(&ctx.client, &ns, &adapter.spec.pool).await? {
            if let Err(e) = ctx.pods.unload(&pod, &token, &name).await {
                tracing::warn!(error = %e, "unload request failed; the config change unloads it");
            }
        }
        if let Some((job, outputs)) = apply::prune_outputs(ctx, adapter, pool).await? {
            ctx.event(
                &adapter.object_ref(&()),
                false,
                crate::reasons::PRUNING_MERGED_OUTPUTS,
                "Cleanup",
                format!("the Job {job} deletes {}", outputs.join(", ")),
            )
            .await;
        }
    } else {
        let status = adapter.status.clone().unwrap_or_default();
        let outputs: Vec<String> = status
            .history
            .iter()
            .filter_map(|r| r.merged_output.clone())
            .collect();
        if !outputs.is_empty() {
            ctx.event(
                &adapter.object_ref(&()),
                true,
                crate::reasons::MERGED_OUTPUTS_LEFT,
                "Cleanup",
                format!(
                    "pool {} is gone, so no Job can mount its volume: {} stay there",
                    adapter.spec.pool,
                    outputs.join(", ")
                ),
            )
            .await;
        }
    }
    ctx.event(
        &adapter.object_ref(&()),
        false,
        reason::UNREGISTERED,
        "Unregister",
        format!("removed from pool {}", adapter.spec.pool),
    )
    .await;
    Ok(Action::await_change())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_that_depend_on_other_objects_are_retried() {
        assert_eq!(
            invalid_action(reason::POOL_NOT_FOUND),
            Action::requeue(RECHECK_OTHERS)
        );
        assert_eq!(
            invalid_action(reason::DUPLICATE_LABEL),
            Action::requeue(RECHECK_OTHERS)
        );
        assert_eq!(
            invalid_action(reason::NAME_COLLISION),
            Action::requeue(RECHECK_OTHERS)
        );
        assert_eq!(
            invalid_action(reason::SOURCE_PATH_IN_USE),
            Action::requeue(RECHECK_OTHERS)
        );
        assert_eq!(invalid_action(reason::INVALID_SPEC), Action::await_change());
    }
}
