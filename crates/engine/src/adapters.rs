//! Adapters for requests: reading a version from disk, pinning it for a request, and the
//! requests that wait for a read. A request for an adapter on disk waits in the registry (no
//! thread of its own) for the one read that the first such request started on a loader
//! thread; when the read ends, every waiter is queued with the weights pinned, or refused
//! with the read's reason (see [`crate::lora::registry`]).

use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};

use super::api::{AdapterAdmin, AdapterSpec, EngineError};
use super::scheduler::Msg;
use super::seq::Seq;
use super::{Engine, Shared};
use crate::lora::registry::{public_name, LoadTicket, Lookup, Missed, Settled, CANARY_SUFFIX};
use crate::lora::LoadOptions;
use mole_api::{LoraAdapterInfo, Residency};
use mole_model::LoraAdapter;

/// What waits for an adapter's read from disk: a request's sequence (with the choices it
/// carries, or a classifier's scoring), queued once the adapter is pinned.
pub(super) type Waiter = Box<Seq>;

/// The error a request waiting for an adapter gets. A failed read is the server's failure
/// (the configured adapter's files broke), not the request's: 503, not `invalid_adapter`.
fn missed(m: Missed) -> EngineError {
    match m {
        Missed::Unloaded(name) => EngineError::AdapterNotFound(name),
        Missed::Failed { name, reason } => EngineError::AdapterReadFailed { name, reason },
    }
}

/// Reads `spec` from disk into the engine's adapter dtype and device (counted in the load
/// metrics).
pub(super) fn load_weights(
    shared: &Shared,
    spec: &AdapterSpec,
) -> Result<Arc<LoraAdapter>, EngineError> {
    let started = std::time::Instant::now();
    let opts = LoadOptions {
        max_rank: shared.opts.max_lora_rank,
        expect_base: Some(shared.opts.base_name.clone()),
    };
    let a = crate::lora::load(
        &spec.path,
        shared.model.config(),
        shared.lora_dtype,
        &shared.device,
        &opts,
    )
    .map_err(|e| {
        shared.load_failures.fetch_add(1, Ordering::Relaxed);
        EngineError::InvalidAdapter {
            name: spec.name.clone(),
            reason: e.to_string(),
        }
    })?;
    shared.loads.fetch_add(1, Ordering::Relaxed);
    shared
        .load_micros
        .fetch_add(started.elapsed().as_micros() as u64, Ordering::Relaxed);
    tracing::info!(adapter = %spec.name, version = %spec.version, rank = a.rank, bytes = a.bytes,
        dtype = ?shared.lora_dtype, seconds = started.elapsed().as_secs_f64(), "adapter loaded");
    Ok(Arc::new(a))
}

/// Hands each waiter what it got: a request is queued with its adapter pinned, or ends with
/// the error. A request for a canary version whose read failed goes to the stable version
/// instead, as when the canary failed to load at all: the failed read is already counted as
/// the canary's error (what the operator's analysis rolls it back on), and the client, who
/// named the adapter and not the version, is answered.
fn settle(shared: &Arc<Shared>, tx: &mpsc::Sender<Msg>, settled: Settled<Waiter>) {
    for (waiter, got) in settled {
        match (waiter, got) {
            (mut s, Ok(p)) => {
                s.pin(p);
                if tx.send(Msg::Submit(s)).is_err() {
                    shared.waiting.fetch_sub(1, Ordering::SeqCst);
                }
            }
            (s, Err(Missed::Failed { name, reason })) if name.ends_with(CANARY_SUFFIX) => {
                tracing::warn!(adapter = %public_name(&name), %reason,
                    "the canary version's read failed: the stable version answers");
                queue_waiter(shared, tx, s, public_name(&name));
            }
            (mut s, Err(m)) => {
                shared.waiting.fetch_sub(1, Ordering::SeqCst);
                s.fail(&missed(m));
            }
        }
    }
}

/// Queues a waiting request (counted in `waiting`) for adapter `name`: at once when it is
/// resident, after its one read from disk otherwise; refused when the adapter is unknown.
fn queue_waiter(shared: &Arc<Shared>, tx: &mpsc::Sender<Msg>, seq: Waiter, name: &str) {
    match shared.registry.lookup(name, seq) {
        Lookup::Ready(p, mut seq) => {
            seq.pin(p);
            if tx.send(Msg::Submit(seq)).is_err() {
                shared.waiting.fetch_sub(1, Ordering::SeqCst);
            }
        }
        Lookup::Unknown(mut seq) => {
            shared.waiting.fetch_sub(1, Ordering::SeqCst);
            seq.fail(&EngineError::AdapterNotFound(name.into()));
        }
        Lookup::Load(ticket) => read(shared.clone(), tx.clone(), ticket),
        Lookup::Queued => {}
    }
}

/// Starts the read of `ticket` on a loader thread, so that neither the caller's async runtime
/// nor the decode loop waits on the disk; its waiters are settled when it ends.
fn read(shared: Arc<Shared>, tx: mpsc::Sender<Msg>, ticket: LoadTicket) {
    std::thread::spawn(move || {
        let weights = load_weights(&shared, &ticket.spec).map_err(|e| match e {
            EngineError::InvalidAdapter { reason, .. } => reason,
            e => e.to_string(),
        });
        let settled = shared.registry.loaded(ticket, weights);
        settle(&shared, &tx, settled);
    });
}

impl Engine {
    /// Queues a request (counted in `waiting`) for the base model or, when it names one, an
    /// adapter: at once when the adapter is resident (or in host memory), after its one read
    /// from disk otherwise.
    pub(super) fn queue(&self, seq: Box<Seq>, adapter: Option<&str>) -> Result<(), EngineError> {
        let sh = &self.shared;
        let unqueue = || {
            sh.waiting.fetch_sub(1, Ordering::SeqCst);
        };
        let Some(name) = adapter else {
            return self.tx.send(Msg::Submit(seq)).map_err(|_| {
                unqueue();
                EngineError::NotReady("engine stopped".into())
            });
        };
        match sh.registry.lookup(name, seq) {
            Lookup::Ready(p, mut seq) => {
                seq.pin(p);
                self.tx.send(Msg::Submit(seq)).map_err(|_| {
                    unqueue();
                    EngineError::NotReady("engine stopped".into())
                })
            }
            Lookup::Unknown(_) => {
                unqueue();
                Err(EngineError::AdapterNotFound(name.into()))
            }
            Lookup::Load(ticket) => {
                self.read(ticket);
                Ok(())
            }
            Lookup::Queued => Ok(()),
        }
    }

    /// Starts the read of `ticket` on a loader thread (see [`read`]).
    fn read(&self, ticket: LoadTicket) {
        read(self.shared.clone(), self.tx.clone(), ticket);
    }

    /// Loads `spec` as the adapter's current version (a no-op when it already is); requests
    /// waiting for a read of the adapter get it.
    pub(super) fn load_version(&self, spec: AdapterSpec) -> Result<(), EngineError> {
        let sh = &self.shared;
        if self.is_merged(&spec.name).is_some() || sh.registry.is_current(&spec) {
            return Ok(());
        }
        match load_weights(sh, &spec) {
            Ok(w) => {
                let settled = sh.registry.insert(spec, w);
                settle(sh, &self.tx, settled);
                Ok(())
            }
            Err(e) => {
                // Reported by /v1/lora_adapters so the operator can show why.
                sh.registry.record_failure(spec, e.to_string());
                Err(e)
            }
        }
    }

    /// Unloads `name`: requests holding it finish on it, requests waiting for its read are
    /// refused `adapter_not_found`.
    pub(super) fn unload(&self, name: &str) -> Result<(), EngineError> {
        let (known, settled) = self.shared.registry.remove(name);
        settle(&self.shared, &self.tx, settled);
        if known {
            Ok(())
        } else {
            Err(EngineError::AdapterNotFound(name.into()))
        }
    }
}

/// Loads read on the caller's thread into the registry; the engine thread only sees the
/// adapter pinned by the requests that name it.
impl AdapterAdmin for Engine {
    fn load_adapter(&self, spec: AdapterSpec) -> Result<(), EngineError> {
        self.load_version(spec)
    }

    fn register_adapter(&self, spec: AdapterSpec) -> Result<(), EngineError> {
        // Placed elsewhere now, it stays where it is (read, or still on disk).
        if self.shared.registry.holds(&spec) {
            return Ok(());
        }
        if self.is_merged(&spec.name).is_some() || self.shared.registry.knows(&spec.name) {
            return self.load_version(spec);
        }
        self.shared.registry.register(spec);
        Ok(())
    }

    fn unload_adapter(&self, name: &str) -> Result<(), EngineError> {
        self.unload(name)
    }

    fn adapters(&self) -> Vec<LoraAdapterInfo> {
        let mut out = self.shared.registry.infos();
        if let Some((name, version)) = &self.shared.opts.merged {
            // The merged adapter is the weights themselves.
            out.push(LoraAdapterInfo {
                name: name.clone(),
                version: version.clone(),
                lora_id: 0,
                path: None,
                residency: if self.shared.device.is_cpu() {
                    Residency::Cpu
                } else {
                    Residency::Gpu
                },
                loaded: true,
                rank: 0,
                bytes: 0,
                requests: 0,
                running: 0,
                error: None,
                warning: None,
            });
        }
        out
    }

    fn adapter_counters(&self) -> Vec<mole_api::AdapterCounters> {
        self.shared.registry.counters()
    }
}
