//! The pool's LoRA id ledger (in its status), written with optimistic concurrency: the id in
//! it registers the adapter in the pool's WorkerConfig.

use kube::api::PostParams;
use kube::{Api, Resource, ResourceExt};
use mole_crds::constants::reason;
use mole_crds::{Adapter, InferencePool};

use crate::controller::context::Context;
use crate::controller::ids;
use crate::error::{Error, Result};

/// Retries of the optimistic-concurrency loop on the pool's id ledger.
const LEDGER_RETRIES: usize = 8;

/// Registers the adapter in its pool: finds or allocates its id, with an Event when it is new
/// to the adapter (`known`: the id its status holds). The pool controller, watching Adapters,
/// then rewrites the pool's ConfigMap.
pub(super) async fn register(adapter: &Adapter, ctx: &Context, known: Option<u32>) -> Result<u32> {
    // Registered already: the id this object's status holds is the one the pool's ledger (as
    // the cache last saw it) gives its name. Ids are never reused and only leave the ledger
    // when their Adapter is deleted, so the cache cannot show an id that is no longer this
    // object's; a recreated Adapter has no status yet and takes the slow path.
    if let Some(id) = known {
        let ns = adapter.namespace().unwrap_or_default();
        let cached = ctx
            .stores
            .pool(&ns, &adapter.spec.pool)
            .and_then(|p| p.status)
            .and_then(|s| s.lora_ids.get(&adapter.name_any()).copied());
        if cached == Some(id) {
            return Ok(id);
        }
    }
    let pools = pools(adapter, ctx);
    let lock = ctx.ledger_lock(&format!(
        "{}/{}",
        adapter.namespace().unwrap_or_default(),
        adapter.spec.pool
    ));
    let held = lock.lock().await;
    let lora_id = ensure_id(&pools, &adapter.spec.pool, &adapter.name_any()).await?;
    drop(held);
    if known != Some(lora_id) {
        ctx.event(
            &adapter.object_ref(&()),
            false,
            reason::LORA_ID_ALLOCATED,
            "Register",
            format!("lora id {lora_id} in pool {}", adapter.spec.pool),
        )
        .await;
    }
    Ok(lora_id)
}

/// Takes the adapter out of its pool's ledger (its number stays burnt).
pub(super) async fn unregister(adapter: &Adapter, ctx: &Context) -> Result<()> {
    let lock = ctx.ledger_lock(&format!(
        "{}/{}",
        adapter.namespace().unwrap_or_default(),
        adapter.spec.pool
    ));
    let _held = lock.lock().await;
    release_id(
        &pools(adapter, ctx),
        &adapter.spec.pool,
        &adapter.name_any(),
    )
    .await
}

fn pools(adapter: &Adapter, ctx: &Context) -> Api<InferencePool> {
    Api::namespaced(ctx.client.clone(), &adapter.namespace().unwrap_or_default())
}

/// Allocates (or finds) the adapter's id in the pool's ledger with optimistic concurrency.
async fn ensure_id(pools: &Api<InferencePool>, pool: &str, adapter: &str) -> Result<u32> {
    for _ in 0..LEDGER_RETRIES {
        let current = pools.get_status(pool).await?;
        let status = current.status.clone().unwrap_or_default();
        let (id, next) = ids::allocate(&status, adapter);
        let Some(next) = next else { return Ok(id) };
        let mut obj = current;
        obj.status = Some(next);
        if replace(pools, pool, &obj).await? {
            return Ok(id);
        }
    }
    Err(Error::Conflict(format!("lora id ledger of pool {pool}")))
}

async fn release_id(pools: &Api<InferencePool>, pool: &str, adapter: &str) -> Result<()> {
    for _ in 0..LEDGER_RETRIES {
        let Some(current) = pools.get_opt(pool).await? else {
            return Ok(());
        };
        let status = current.status.clone().unwrap_or_default();
        let Some(next) = ids::release(&status, adapter) else {
            return Ok(());
        };
        let mut obj = current;
        obj.status = Some(next);
        if replace(pools, pool, &obj).await? {
            return Ok(());
        }
    }
    Err(Error::Conflict(format!("lora id ledger of pool {pool}")))
}

/// Replaces the pool's status; false when another writer changed it first. replace_status
/// sends metadata.resourceVersion, so a concurrent allocation conflicts instead of handing
/// out one id twice.
async fn replace(pools: &Api<InferencePool>, pool: &str, obj: &InferencePool) -> Result<bool> {
    match pools
        .replace_status(pool, &PostParams::default(), obj)
        .await
    {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
        Err(e) => Err(e.into()),
    }
}
