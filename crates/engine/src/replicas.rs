//! One engine per device of the pod, behind one [`Backend`]: a pod given several GPUs
//! holds the model on each (data parallel; tensor parallelism does not exist yet) and sends
//! each request to the least loaded engine. Adapters load on every engine, and the listing
//! says an adapter is loaded only when every engine holds it, so the operator's readiness
//! means the whole pod serves it. The text side is not here: every engine holds the same
//! tokenizer and template, so the server takes the first engine's
//! [`PromptCodec`](super::api::PromptCodec) as the pod's.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use mole_api::LoraAdapterInfo;

use super::api::{
    AdapterAdmin, AdapterSpec, Backend, EngineError, EngineInfo, EngineStats, EventStream,
    GenerateRequest, Image, ModelInfo, Serving,
};

/// Engines of one model, one per device.
pub struct Replicas {
    engines: Vec<Arc<dyn Backend>>,
    /// Requests sent to each engine whose submit has not returned yet (after it, the engine
    /// counts them itself); the lock makes reading the loads and choosing one step, so
    /// requests routed at the same moment do not all read the same idle engine.
    routing: Mutex<Vec<usize>>,
}

impl Replicas {
    /// Engines over the same model and options, each on its own device; at least one.
    pub fn new(engines: Vec<Arc<dyn Backend>>) -> Self {
        assert!(!engines.is_empty(), "replicas of at least one engine");
        let routing = Mutex::new(vec![0; engines.len()]);
        Self { engines, routing }
    }

    /// The engines, one per device.
    pub fn engines(&self) -> &[Arc<dyn Backend>] {
        &self.engines
    }

    /// Engines behind this one.
    pub fn len(&self) -> usize {
        self.engines.len()
    }

    /// Whether there is none (never: [`Replicas::new`] refuses it).
    pub fn is_empty(&self) -> bool {
        self.engines.is_empty()
    }

    /// Runs `f` on the engine with the fewest requests running, waiting and being sent to it
    /// (the first of equals), counting it as sent to that engine until `f` returns.
    fn on_least_loaded<T>(&self, f: impl FnOnce(&dyn Backend) -> T) -> T {
        let i = {
            let mut sending = self.routing.lock().unwrap_or_else(PoisonError::into_inner);
            let i = (0..self.engines.len())
                .min_by_key(|&i| {
                    let s = self.engines[i].stats();
                    s.running + s.waiting + sending[i]
                })
                .expect("at least one engine");
            sending[i] += 1;
            i
        };
        let out = f(self.engines[i].as_ref());
        self.routing.lock().unwrap_or_else(PoisonError::into_inner)[i] -= 1;
        out
    }
}

impl Serving for Replicas {
    fn submit(&self, req: GenerateRequest) -> Result<EventStream, EngineError> {
        self.on_least_loaded(|e| e.submit(req))
    }

    fn submit_n(&self, req: GenerateRequest, n: usize) -> Result<Vec<EventStream>, EngineError> {
        // One engine serves every choice, so they share the prompt's cache there.
        self.on_least_loaded(|e| e.submit_n(req, n))
    }

    fn score_labels(
        &self,
        adapter: Option<&str>,
        prompt: &str,
        labels: &[String],
        images: &[Image],
    ) -> Result<Vec<f32>, EngineError> {
        self.on_least_loaded(|e| e.score_labels(adapter, prompt, labels, images))
    }
}

impl AdapterAdmin for Replicas {
    /// Loads on every engine, in parallel; the first refusal is the answer (the engines
    /// that took it keep it: a later load of the version or an unload settles them alike).
    fn load_adapter(&self, spec: AdapterSpec) -> Result<(), EngineError> {
        std::thread::scope(|sc| {
            let loads: Vec<_> = self
                .engines
                .iter()
                .map(|e| {
                    let spec = spec.clone();
                    sc.spawn(move || e.load_adapter(spec))
                })
                .collect();
            loads
                .into_iter()
                .map(|h| h.join().expect("a load does not panic"))
                .collect::<Result<Vec<()>, _>>()
                .map(|_| ())
        })
    }

    /// Registers on every engine (each reads it on its own first request).
    fn register_adapter(&self, spec: AdapterSpec) -> Result<(), EngineError> {
        for e in &self.engines {
            e.register_adapter(spec.clone())?;
        }
        Ok(())
    }

    /// Unloads from every engine, whatever one of them answers: done when some engine held
    /// it and none failed otherwise; `adapter_not_found` when none held it; else the first
    /// failure (after every engine was tried).
    fn unload_adapter(&self, name: &str) -> Result<(), EngineError> {
        let results: Vec<Result<(), EngineError>> = self
            .engines
            .iter()
            .map(|e| e.unload_adapter(name))
            .collect();
        let failed = results
            .iter()
            .filter_map(|r| r.as_ref().err())
            .find(|e| !matches!(e, EngineError::AdapterNotFound(_)));
        match failed {
            Some(e) => Err(e.clone()),
            None if results.iter().any(Result::is_ok) => Ok(()),
            None => Err(EngineError::AdapterNotFound(name.into())),
        }
    }

    /// Every engine's traffic per adapter version, summed.
    fn adapter_counters(&self) -> Vec<mole_api::AdapterCounters> {
        let mut out: Vec<mole_api::AdapterCounters> = Vec::new();
        for e in &self.engines {
            for c in e.adapter_counters() {
                match out
                    .iter_mut()
                    .find(|x| x.name == c.name && x.version == c.version)
                {
                    Some(x) => {
                        x.requests += c.requests;
                        x.tokens += c.tokens;
                        x.errors += c.errors;
                        if x.latency_ms.len() < c.latency_ms.len() {
                            x.latency_ms.resize(c.latency_ms.len(), 0);
                        }
                        for (a, b) in x.latency_ms.iter_mut().zip(&c.latency_ms) {
                            *a += b;
                        }
                    }
                    None => out.push(c),
                }
            }
        }
        out
    }

    /// Every version any engine knows: loaded when all of them hold it, requests summed,
    /// bytes and residency of the first engine that has it.
    fn adapters(&self) -> Vec<LoraAdapterInfo> {
        let n = self.engines.len();
        let mut seen: HashMap<(String, String), (LoraAdapterInfo, usize)> = HashMap::new();
        let mut order = Vec::new();
        for e in &self.engines {
            for a in e.adapters() {
                let key = (a.name.clone(), a.version.clone());
                match seen.get_mut(&key) {
                    Some((sum, loaded)) => {
                        sum.requests += a.requests;
                        sum.running += a.running;
                        *loaded += usize::from(a.loaded);
                        if sum.error.is_none() {
                            sum.error = a.error;
                        }
                    }
                    None => {
                        order.push(key.clone());
                        let loaded = usize::from(a.loaded);
                        seen.insert(key, (a, loaded));
                    }
                }
            }
        }
        order
            .into_iter()
            .filter_map(|k| seen.remove(&k))
            .map(|(mut a, loaded)| {
                a.loaded = loaded == n;
                a
            })
            .collect()
    }
}

impl EngineInfo for Replicas {
    /// Sums over the engines (the last batch: the largest).
    fn stats(&self) -> EngineStats {
        let mut out = EngineStats::default();
        for e in &self.engines {
            let s = e.stats();
            out.running += s.running;
            out.waiting += s.waiting;
            out.last_batch_size = out.last_batch_size.max(s.last_batch_size);
            out.largest_batch = out.largest_batch.max(s.largest_batch);
            out.running_adapters.extend(s.running_adapters);
            out.waiting_adapters.extend(s.waiting_adapters);
            out.max_loras = s.max_loras;
            out.cancelled += s.cancelled;
            out.adapter_loads += s.adapter_loads;
            out.adapter_load_failures += s.adapter_load_failures;
            out.adapter_load_seconds += s.adapter_load_seconds;
            out.adapter_evictions += s.adapter_evictions;
            out.preemptions += s.preemptions;
            out.steps += s.steps;
            out.vision_encodes += s.vision_encodes;
            out.kv_blocks = match (out.kv_blocks, s.kv_blocks) {
                (Some((f, t)), Some((f2, t2))) => Some((f + f2, t + t2)),
                (a, b) => a.or(b),
            };
            out.kv_cache_bytes = match (out.kv_cache_bytes, s.kv_cache_bytes) {
                (Some(a), Some(b)) => Some(a + b),
                (a, b) => a.or(b),
            };
            // Each replica holds its own copy of the weights.
            out.weights_bytes = match (out.weights_bytes, s.weights_bytes) {
                (Some(a), Some(b)) => Some(a + b),
                (a, b) => a.or(b),
            };
            out.prefix_cached_blocks += s.prefix_cached_blocks;
            for c in s.prefix_cache {
                match out.prefix_cache.iter_mut().find(|o| o.adapter == c.adapter) {
                    Some(o) => {
                        o.queries += c.queries;
                        o.hits += c.hits;
                    }
                    None => out.prefix_cache.push(c),
                }
            }
        }
        out.prefix_cache.sort_by(|a, b| a.adapter.cmp(&b.adapter));
        for v in [&mut out.running_adapters, &mut out.waiting_adapters] {
            v.sort_unstable();
            v.dedup();
        }
        out
    }

    fn model_info(&self) -> ModelInfo {
        self.engines[0].model_info()
    }
}
