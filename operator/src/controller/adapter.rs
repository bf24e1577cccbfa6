//! The Adapter controller (dynamic serving): observe → validate → build → apply → status.
//!
//! It validates the adapter, allocates its LoRA id once in the pool's ledger, and reports
//! `Ready` only when every ready dynamic pod of the pool says (over HTTP,
//! `GET /v1/lora_adapters`) that it serves this adapter version. A finalizer unregisters the
//! adapter and asks the pods to unload it before the object goes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::finalizer::{finalizer, Event as Finalizer};
use kube::{Api, Resource, ResourceExt};
use mole_crds::constants::{condition, reason, ADAPTER_FINALIZER};
use mole_crds::{
    Adapter, AdapterPhase, AdapterStatus, InferencePool, LoraAdaptersResponse, ServingMode,
};

use super::context::{ready_pods, Context};
use super::ids;
use super::validate::validate_adapter;
use crate::error::{Error, Result};
use crate::mergedown::set_condition;
use crate::resources;

const FM_STATUS: &str = "mole-operator/adapter-status";
/// Retries of the optimistic-concurrency loop on the pool's id ledger.
const LEDGER_RETRIES: usize = 8;

/// Whether an adapter version is served by a set of pods: at least one pod, and every pod
/// reports it loaded. Returns (ready, loaded count, first load error).
pub fn loaded_everywhere(
    reports: &[LoraAdaptersResponse],
    name: &str,
    version: &str,
) -> (bool, usize, Option<String>) {
    let loaded = reports
        .iter()
        .filter(|r| r.is_loaded(name, version))
        .count();
    let error = reports
        .iter()
        .flat_map(|r| r.data.iter())
        .find(|a| a.name == name && a.version == version && a.error.is_some())
        .and_then(|a| a.error.clone());
    (
        !reports.is_empty() && loaded == reports.len(),
        loaded,
        error,
    )
}

fn key(a: &Adapter) -> String {
    format!(
        "adapter/{}/{}",
        a.namespace().unwrap_or_default(),
        a.name_any()
    )
}

/// Reconciles one adapter (through the finalizer).
pub async fn reconcile(adapter: Arc<Adapter>, ctx: Arc<Context>) -> Result<Action> {
    let started = Instant::now();
    ctx.metrics.reconciles.with_label_values(&["adapter"]).inc();
    let ns = adapter.namespace().unwrap_or_default();
    let api: Api<Adapter> = Api::namespaced(ctx.client.clone(), &ns);
    let c = ctx.clone();
    let result = finalizer(&api, ADAPTER_FINALIZER, adapter.clone(), |ev| async move {
        match ev {
            Finalizer::Apply(a) => apply(&a, &c).await,
            Finalizer::Cleanup(a) => cleanup(&a, &c).await,
        }
    })
    .await
    .map_err(|e| match e {
        kube::runtime::finalizer::Error::ApplyFailed(e)
        | kube::runtime::finalizer::Error::CleanupFailed(e) => e,
        other => Error::Finalizer(other.to_string()),
    });
    ctx.metrics
        .duration
        .with_label_values(&["adapter"])
        .observe(started.elapsed().as_secs_f64());
    if result.is_ok() {
        ctx.succeeded(&key(&adapter));
    }
    result
}

/// Allocates (or finds) the adapter's id in the pool's ledger with optimistic concurrency.
async fn ensure_id(pools: &Api<InferencePool>, pool: &str, adapter: &str) -> Result<u32> {
    for _ in 0..LEDGER_RETRIES {
        let current = pools.get_status(pool).await?;
        let status = current.status.clone().unwrap_or_default();
        let (id, next) = ids::allocate(&status, adapter);
        let Some(next) = next else { return Ok(id) };
        let mut obj = current.clone();
        obj.status = Some(next);
        // replace_status sends metadata.resourceVersion: a concurrent allocation conflicts.
        match pools
            .replace_status(pool, &PostParams::default(), &obj)
            .await
        {
            Ok(_) => return Ok(id),
            Err(kube::Error::Api(e)) if e.code == 409 => continue,
            Err(e) => return Err(e.into()),
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
        let mut obj = current.clone();
        obj.status = Some(next);
        match pools
            .replace_status(pool, &PostParams::default(), &obj)
            .await
        {
            Ok(_) => return Ok(()),
            Err(kube::Error::Api(e)) if e.code == 409 => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(Error::Conflict(format!("lora id ledger of pool {pool}")))
}

async fn write_status(api: &Api<Adapter>, name: &str, status: &AdapterStatus) -> Result<()> {
    let patch = serde_json::json!({
        "apiVersion": "mole.dev/v1alpha1",
        "kind": "Adapter",
        "status": status,
    });
    api.patch_status(
        name,
        &PatchParams::apply(FM_STATUS).force(),
        &Patch::Apply(&patch),
    )
    .await?;
    Ok(())
}

async fn apply(adapter: &Adapter, ctx: &Context) -> Result<Action> {
    let ns = adapter.namespace().unwrap_or_default();
    let name = adapter.name_any();
    let api: Api<Adapter> = Api::namespaced(ctx.client.clone(), &ns);
    let pools: Api<InferencePool> = Api::namespaced(ctx.client.clone(), &ns);
    let oref = adapter.object_ref(&());
    let generation = adapter.metadata.generation;
    let now = chrono::Utc::now();
    let old = adapter.status.clone().unwrap_or_default();
    let mut status = old.clone();
    status.observed_generation = generation;

    // observe
    let pool = pools.get_opt(&adapter.spec.pool).await?;
    let siblings = api.list(&ListParams::default()).await?.items;

    // validate
    if let Err(fe) = validate_adapter(adapter, pool.as_ref(), &siblings) {
        status.phase = AdapterPhase::Failed;
        let changed = set_condition(
            &mut status.conditions,
            condition::VALID,
            false,
            fe.reason,
            &fe.to_string(),
            generation,
            now,
        );
        set_condition(
            &mut status.conditions,
            condition::READY,
            false,
            fe.reason,
            &fe.to_string(),
            generation,
            now,
        );
        if status != old {
            write_status(&api, &name, &status).await?;
        }
        if changed {
            ctx.event(&oref, true, fe.reason, "Validate", fe.to_string())
                .await;
        }
        // A missing pool may appear later; other invalid specs wait for an edit.
        return Ok(if fe.reason == reason::POOL_NOT_FOUND {
            Action::requeue(Duration::from_secs(30))
        } else {
            Action::await_change()
        });
    }
    let pool = pool.expect("validated");
    set_condition(
        &mut status.conditions,
        condition::VALID,
        true,
        reason::SPEC_VALID,
        "spec accepted",
        generation,
        now,
    );

    // build + apply: the id in the pool's ledger registers the adapter in the pool's config
    // (the pool controller, watching Adapters, rewrites the ConfigMap).
    let lora_id = ensure_id(&pools, &adapter.spec.pool, &name).await?;
    if status.lora_id != Some(lora_id) {
        ctx.event(
            &oref,
            false,
            reason::LORA_ID_ALLOCATED,
            "Register",
            format!("lora id {lora_id} in pool {}", adapter.spec.pool),
        )
        .await;
    }
    status.lora_id = Some(lora_id);

    // status: ask every ready dynamic pod.
    let pods = ready_pods(&ctx.client, &ns, &adapter.spec.pool).await?;
    let mut reports = Vec::with_capacity(pods.len());
    let mut unreachable = Vec::new();
    for pod in &pods {
        match ctx.pods.adapters(pod).await {
            Ok(r) => reports.push(r),
            Err(e) => unreachable.push(e.to_string()),
        }
    }
    let (ready, loaded, load_error) = loaded_everywhere(&reports, &name, &adapter.spec.version);
    let ready = ready && unreachable.is_empty();
    let (phase, why, message) = if ready {
        (
            AdapterPhase::Ready,
            reason::LOADED,
            format!(
                "{loaded}/{} ready dynamic pods serve version {}",
                pods.len(),
                adapter.spec.version
            ),
        )
    } else if let Some(err) = &load_error {
        (
            AdapterPhase::Failed,
            reason::LOAD_FAILED,
            format!("a pod refused version {}: {err}", adapter.spec.version),
        )
    } else if pods.is_empty() {
        (
            AdapterPhase::Pending,
            reason::WAITING_FOR_PODS,
            "the pool has no ready dynamic pod".to_string(),
        )
    } else {
        let mut m = format!(
            "{loaded}/{} ready dynamic pods serve version {}",
            pods.len(),
            adapter.spec.version
        );
        if !unreachable.is_empty() {
            m.push_str(&format!("; unreachable: {}", unreachable.join("; ")));
        }
        (AdapterPhase::Pending, reason::WAITING_FOR_PODS, m)
    };
    // An older version that every pod still serves keeps the adapter usable while a new one
    // loads: Degraded would overstate it, Pending with the active version says it exactly.
    status.phase = phase;
    status.serving_mode = Some(ServingMode::Dynamic);
    if ready {
        status.active_version = Some(adapter.spec.version.clone());
        let rec = mole_crds::VersionRecord {
            version: adapter.spec.version.clone(),
            source: adapter.spec.source.path.clone(),
            lora_id: Some(lora_id),
            merged_output: None,
            time: Some(now.to_rfc3339()),
        };
        if status.history.first().map(|r| (&r.version, &r.source))
            != Some((&rec.version, &rec.source))
        {
            status
                .history
                .retain(|r| !(r.version == rec.version && r.source == rec.source));
            status.history.insert(0, rec);
            status
                .history
                .truncate(1 + pool.spec.merge.keep_versions as usize);
        }
    }
    status.endpoint = Some(resources::endpoint(&pool));
    set_condition(
        &mut status.conditions,
        condition::LOADED,
        ready,
        why,
        &message,
        generation,
        now,
    );
    let became = set_condition(
        &mut status.conditions,
        condition::READY,
        ready,
        why,
        &message,
        generation,
        now,
    );
    if adapter.spec.serving.mode != ServingMode::Dynamic {
        set_condition(
            &mut status.conditions,
            condition::MERGED,
            false,
            "MergeDownNotWired",
            "merge-down (serving.mode merged/auto) is not wired into this operator build yet; the adapter is served dynamically",
            generation,
            now,
        );
    }
    if status != old {
        write_status(&api, &name, &status).await?;
    }
    if became {
        ctx.event(&oref, load_error.is_some(), why, "Load", message)
            .await;
    }
    Ok(Action::requeue(if ready {
        Duration::from_secs(60)
    } else {
        Duration::from_secs(10)
    }))
}

async fn cleanup(adapter: &Adapter, ctx: &Context) -> Result<Action> {
    let ns = adapter.namespace().unwrap_or_default();
    let name = adapter.name_any();
    let pools: Api<InferencePool> = Api::namespaced(ctx.client.clone(), &ns);
    // Leaving the ledger takes it out of the pool's WorkerConfig (and the id stays burnt).
    release_id(&pools, &adapter.spec.pool, &name).await?;
    for pod in ready_pods(&ctx.client, &ns, &adapter.spec.pool).await? {
        if let Err(e) = ctx.pods.unload(&pod, &name).await {
            tracing::warn!(error = %e, "unload request failed; the config change unloads it");
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

/// Error policy: invalid specs wait for a change; transient errors back off per object.
pub fn error_policy(adapter: Arc<Adapter>, err: &Error, ctx: Arc<Context>) -> Action {
    ctx.metrics
        .errors
        .with_label_values(&["adapter", err.code()])
        .inc();
    tracing::warn!(adapter = %adapter.name_any(), error = %err, "adapter reconcile failed");
    match err {
        Error::Invalid(_) => Action::await_change(),
        _ => Action::requeue(ctx.backoff(&key(&adapter))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mole_crds::{LoraAdapterInfo, Residency};

    fn report(entries: &[(&str, &str, bool)]) -> LoraAdaptersResponse {
        LoraAdaptersResponse {
            object: "list".into(),
            base_model: "b".into(),
            data: entries
                .iter()
                .map(|(n, v, loaded)| LoraAdapterInfo {
                    name: n.to_string(),
                    version: v.to_string(),
                    lora_id: 1,
                    residency: Residency::Gpu,
                    loaded: *loaded,
                    rank: 8,
                    bytes: 1,
                    requests: 0,
                    running: 0,
                    error: None,
                })
                .collect(),
        }
    }

    #[test]
    fn ready_needs_every_pod_on_the_exact_version() {
        let both = vec![
            report(&[("cal", "v2", true)]),
            report(&[("cal", "v2", true)]),
        ];
        assert_eq!(loaded_everywhere(&both, "cal", "v2"), (true, 2, None));
        let one_old = vec![
            report(&[("cal", "v2", true)]),
            report(&[("cal", "v1", true)]),
        ];
        assert!(!loaded_everywhere(&one_old, "cal", "v2").0);
        let loading = vec![report(&[("cal", "v2", false)])];
        assert!(!loaded_everywhere(&loading, "cal", "v2").0);
        assert!(!loaded_everywhere(&[], "cal", "v2").0, "no pod, not ready");
        let mut bad = report(&[("cal", "v2", false)]);
        bad.data[0].error = Some("rank 128 over limit 64".into());
        assert_eq!(
            loaded_everywhere(&[bad], "cal", "v2").2.as_deref(),
            Some("rank 128 over limit 64")
        );
    }
}
