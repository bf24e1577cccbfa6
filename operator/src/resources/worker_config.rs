//! The WorkerConfig the operator renders for a pool's pods: what the worker reads from its
//! ConfigMap (`worker.json`).

use mole_crds::{
    Adapter, InferencePoolSpec, MergedModel, WorkerAdapter, WorkerAuth, WorkerBaseModel,
    WorkerConfig, WorkerLimits, WorkerMode,
};

use super::pod::AUTH_MOUNT;
use super::secret::operator_token_file;

/// One adapter as registered in a pool: the Adapter and its allocated id.
#[derive(Debug, Clone)]
pub struct Registered<'a> {
    /// The Adapter.
    pub adapter: &'a Adapter,
    /// Its pool-wide LoRA id.
    pub lora_id: u32,
}

/// The WorkerConfig of a pool's dynamic pods: the base model, every registered adapter, the
/// router and the limits. Adapters are sorted by name so the config (and its hash) is stable.
/// The router and the engine limits are the pool's own, copied: they are the same types.
pub fn worker_config(
    name: &str,
    spec: &InferencePoolSpec,
    adapters: &[Registered<'_>],
) -> WorkerConfig {
    let mut list: Vec<WorkerAdapter> = adapters.iter().map(worker_adapter).collect();
    list.sort_by(|a, b| a.name.cmp(&b.name));
    WorkerConfig {
        mode: WorkerMode::Dynamic,
        pool: name.to_string(),
        model_root: spec.storage.mount_path.clone(),
        base_model: WorkerBaseModel {
            name: spec.base_model.name.clone(),
            path: spec.base_model.path.clone(),
            dtype: spec.base_model.dtype,
            image_processor: spec.base_model.image_processor,
            // Validated by the pool's controller before anything is rendered; an unknown name
            // cannot reach here, and would leave the worker to detect the format.
            tool_call_parser: spec
                .base_model
                .tool_call_parser
                .as_deref()
                .and_then(|n| n.parse().ok()),
            reasoning_parser: spec
                .base_model
                .reasoning_parser
                .as_deref()
                .and_then(|n| n.parse().ok()),
        },
        merged: None,
        adapters: list,
        router: spec.router.clone(),
        limits: WorkerLimits {
            // The pool's tenants (its API keys) and whether they share the prefix cache.
            prefix_cache_scope: spec
                .auth
                .as_ref()
                .map(|a| a.prefix_cache_scope)
                .unwrap_or_default(),
            ..WorkerLimits::with_engine(spec.dynamic.limits.clone())
        },
        // Every worker accepts the operator's token on the endpoints the operator calls.
        auth: Some(WorkerAuth {
            api_keys_file: spec
                .auth
                .as_ref()
                .map(|a| format!("{AUTH_MOUNT}/{}", a.key)),
            admin_token_file: spec
                .auth
                .as_ref()
                .and_then(|a| a.admin_token_key.as_ref())
                .map(|k| format!("{AUTH_MOUNT}/{k}")),
            operator_token_file: Some(operator_token_file()),
        }),
        // Set by `place_adapters` for a pool with `dynamic.placement`.
        peers: Default::default(),
    }
}

/// Places `wc`'s adapters that the dynamic pods load on `pods` (the pool's
/// `dynamic.placement`; nothing without it or without pods): each adapter's `pods` from
/// [`crate::fleet::placement::place`] with its tokens per minute from `traffic` (adapter name
/// → tokens/min, absent: 0), and `peers` (ready pod → URL) for the pods' forwarding. Pods are
/// taken sorted, so the same pods give the same config.
pub fn place_adapters(
    wc: &mut WorkerConfig,
    spec: &InferencePoolSpec,
    traffic: &std::collections::BTreeMap<String, f64>,
    pods: &[String],
    peers: &std::collections::BTreeMap<String, String>,
) {
    let Some(p) = &spec.dynamic.placement else {
        return;
    };
    wc.peers = peers.clone();
    if pods.is_empty() {
        return;
    }
    let mut pods = pods.to_vec();
    pods.sort();
    pods.dedup();
    let policy = crate::fleet::placement::Policy {
        min_replicas: p.min_replicas as usize,
        load_factor: p.load_factor,
        capacity: (spec.dynamic.limits.max_loras + spec.dynamic.limits.max_cpu_loras).max(1)
            as usize,
    };
    let load: Vec<(String, f64)> = wc
        .adapters
        .iter()
        .filter(|a| a.load || a.canary.is_some())
        .map(|a| (a.name.clone(), traffic.get(&a.name).copied().unwrap_or(0.0)))
        .collect();
    let mut placed = crate::fleet::placement::place(&policy, &load, &pods);
    for a in &mut wc.adapters {
        if let Some(on) = placed.remove(&a.name) {
            a.pods = on;
        }
    }
}

fn worker_adapter(r: &Registered<'_>) -> WorkerAdapter {
    let a = &r.adapter.spec;
    let status = r.adapter.status.as_ref();
    WorkerAdapter {
        name: r.adapter.metadata.name.clone().unwrap_or_default(),
        version: a.version.clone(),
        lora_id: r.lora_id,
        path: a.source.path.clone(),
        routing: a.routing.clone(),
        mode: a.serving.mode,
        // The merge-down plan decides both (the Adapter controller records it in the
        // status): forward to merged pods while they serve it, and keep it loaded in the
        // dynamic pods unless the plan says otherwise. Deriving them here from the phase or
        // serving mode deadlocks a merged → dynamic switch.
        merged_endpoint: status.and_then(|s| s.merged_endpoint.clone()),
        load: status.and_then(|s| s.load_dynamic).unwrap_or(true),
        canary: crate::controller::adapter::canary::worker_canary(
            a,
            status.and_then(|s| s.canary.as_ref()),
        ),
        // Set by `place_adapters` for a pool with `dynamic.placement`.
        pods: Vec::new(),
    }
}

/// The WorkerConfig of a merged pod: the merged weights at `output`, served as `adapter`.
pub fn merged_worker_config(
    pool_name: &str,
    spec: &InferencePoolSpec,
    adapter: &str,
    version: &str,
    output: &str,
) -> WorkerConfig {
    let mut wc = worker_config(pool_name, spec, &[]);
    wc.mode = WorkerMode::Merged;
    wc.merged = Some(MergedModel {
        adapter: adapter.to_string(),
        version: version.to_string(),
        path: output.to_string(),
    });
    wc
}
