//! The adapter's LoRA id, read from its pool's ledger (`status.loraIds`, as the cache holds
//! it). The pool controller is the ledger's one writer: it gives ids to the pool's new Adapters
//! and takes out those of deleted ones; this controller only reads, and waits.

use std::time::Duration;

use kube::{Resource, ResourceExt};
use mole_crds::constants::reason;
use mole_crds::{Adapter, InferencePool};

use crate::controller::context::Context;
use crate::error::Result;

/// How soon an adapter without an id, or a deleted one whose id the pool still lists, looks
/// again when no change of its pool wakes it first (the pool's watch normally does:
/// see `PoolTrigger`).
pub(super) const RECHECK_LEDGER: Duration = Duration::from_secs(10);

/// The adapter's id in `pool`'s ledger (None: not given yet), with the `LoraIdAllocated`
/// Event when it is new to the adapter (`known`: the id its status holds).
pub(super) async fn lora_id(
    adapter: &Adapter,
    pool: &InferencePool,
    ctx: &Context,
    known: Option<u32>,
) -> Option<u32> {
    let id = id_in(pool, &adapter.name_any())?;
    if known != Some(id) {
        ctx.event(
            &adapter.object_ref(&()),
            false,
            reason::LORA_ID_ALLOCATED,
            "Register",
            format!("lora id {id} in pool {}", adapter.spec.pool),
        )
        .await;
    }
    Some(id)
}

/// The id `pool`'s ledger gives the adapter named `name`.
pub(super) fn id_in(pool: &InferencePool, name: &str) -> Option<u32> {
    pool.status.as_ref()?.lora_ids.get(name).copied()
}

/// Whether a deleted adapter's pool (as the cache holds it) still lists its id: the pool
/// controller has not seen the deletion yet. Its finalizer waits until it has, so the id
/// leaves the ledger before the name can be taken again (a recreated Adapter then gets a
/// fresh id, never its predecessor's). A pool gone or being deleted holds nothing back.
pub(super) async fn still_listed(adapter: &Adapter, ctx: &Context) -> Result<bool> {
    ctx.stores.ready().await?;
    let ns = adapter.namespace().unwrap_or_default();
    Ok(ctx
        .stores
        .pool(&ns, &adapter.spec.pool)
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .is_some_and(|p| id_in(&p, &adapter.name_any()).is_some()))
}
