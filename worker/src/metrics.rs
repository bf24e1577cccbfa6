//! Prometheus metrics of the worker (`mole_` prefix), plus the vLLM-compatible
//! `vllm:lora_requests_info` gauge that LoRA-aware gateways (Gateway API inference extension)
//! read to pick the pod that already holds an adapter.

use prometheus::{
    Encoder, GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

use crate::engine::api::EngineStats;

/// Every metric the server records.
pub struct Metrics {
    registry: Registry,
    /// Requests by endpoint, adapter, mode (dynamic/merged/base), route reason and status code.
    /// Adapter names come from the config (or the admin's load API): bounded.
    pub requests: IntCounterVec,
    /// Errors by stable code.
    pub errors: IntCounterVec,
    /// Request latency by endpoint and adapter.
    pub latency: HistogramVec,
    /// Time to first token by adapter.
    pub ttft: HistogramVec,
    /// Time between consecutive tokens of a request, by adapter.
    pub itl: HistogramVec,
    /// Router confidence (classifier probability, keyword hits, cosine) by strategy.
    pub route_confidence: HistogramVec,
    /// Sequences in the last engine step.
    pub batch_size: IntGauge,
    /// Requests cancelled because their client went away.
    pub cancelled: IntCounter,
    /// Adapter versions by residency (gpu: device slot, cpu: host, disk: evicted).
    pub residency: IntGaugeVec,
    /// Adapter loads by result.
    pub adapter_loads: IntCounterVec,
    /// Seconds spent loading adapters (every engine load, reloads from the disk tier included).
    pub adapter_load_seconds: prometheus::Counter,
    /// Duration of each adapter load the server asked for (config and load API), by result.
    pub adapter_load_duration: HistogramVec,
    /// 1 when the config file changed a setting that needs a restart (base model, limits...).
    pub restart_required: IntGauge,
    /// Config reloads by result (`changed`, `unchanged`, `stale`, `invalid`).
    pub config_reloads: IntCounterVec,
    /// 1 when `/readyz` answers ready.
    pub ready: IntGauge,
    /// LRU evictions.
    pub adapter_evictions: IntCounter,
    /// Prompt and generated tokens by adapter and kind.
    pub tokens: IntCounterVec,
    /// Routing decisions by reason.
    pub routes: IntCounterVec,
    /// Requests decoding now.
    pub running: IntGauge,
    /// Requests waiting.
    pub waiting: IntGauge,
    /// Adapters loaded.
    pub adapters_loaded: IntGauge,
    /// Proxy attempts to merged pods by outcome.
    pub proxy: IntCounterVec,
    /// vLLM-compatible LoRA info gauge (value: scrape time in seconds).
    pub lora_info: GaugeVec,
}

impl Metrics {
    /// Registers every metric in a fresh registry.
    pub fn new() -> Self {
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new("mole_requests_total", "Requests served"),
            &["endpoint", "adapter", "mode", "route", "status"],
        )
        .expect("metric");
        let errors = IntCounterVec::new(
            Opts::new("mole_errors_total", "Errors by stable code"),
            &["code"],
        )
        .expect("metric");
        let latency = HistogramVec::new(
            HistogramOpts::new("mole_request_duration_seconds", "Request latency"),
            &["endpoint", "adapter"],
        )
        .expect("metric");
        let ttft = HistogramVec::new(
            HistogramOpts::new("mole_time_to_first_token_seconds", "Time to first token"),
            &["adapter"],
        )
        .expect("metric");
        // Decode steps on CPU take tens of ms, on GPU a few: buckets cover both.
        let itl = HistogramVec::new(
            HistogramOpts::new(
                "mole_inter_token_latency_seconds",
                "Time between consecutive tokens of a request",
            )
            .buckets(vec![
                0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5,
            ]),
            &["adapter"],
        )
        .expect("metric");
        let route_confidence = HistogramVec::new(
            HistogramOpts::new(
                "mole_route_confidence",
                "Router confidence of routed requests by strategy",
            )
            .buckets(vec![
                0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 2.0, 5.0,
            ]),
            &["strategy"],
        )
        .expect("metric");
        let batch_size =
            IntGauge::new("mole_batch_size", "Sequences in the last engine step").expect("metric");
        let cancelled = IntCounter::new(
            "mole_requests_cancelled_total",
            "Requests cancelled because the client went away",
        )
        .expect("metric");
        let residency = IntGaugeVec::new(
            Opts::new("mole_adapter_versions", "Adapter versions by residency"),
            &["residency"],
        )
        .expect("metric");
        let adapter_loads = IntCounterVec::new(
            Opts::new("mole_adapter_loads_total", "Adapter loads by result"),
            &["result"],
        )
        .expect("metric");
        let adapter_load_seconds = prometheus::Counter::new(
            "mole_adapter_load_seconds_total",
            "Seconds spent loading adapters",
        )
        .expect("metric");
        let adapter_load_duration = HistogramVec::new(
            HistogramOpts::new(
                "mole_adapter_load_duration_seconds",
                "Duration of adapter loads requested by the config or the load API",
            )
            .buckets(vec![
                0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
            ]),
            &["result"],
        )
        .expect("metric");
        let restart_required = IntGauge::new(
            "mole_config_restart_required",
            "1 when the config changed a setting that needs a restart (base model, limits, mode)",
        )
        .expect("metric");
        let config_reloads = IntCounterVec::new(
            Opts::new("mole_config_reloads_total", "Config reloads by result"),
            &["result"],
        )
        .expect("metric");
        let ready = IntGauge::new("mole_ready", "1 when the worker is ready").expect("metric");
        let adapter_evictions = IntCounter::new(
            "mole_adapter_evictions_total",
            "Adapters evicted to disk by the LRU",
        )
        .expect("metric");
        let tokens = IntCounterVec::new(
            Opts::new("mole_tokens_total", "Tokens processed"),
            &["adapter", "kind"],
        )
        .expect("metric");
        let routes = IntCounterVec::new(
            Opts::new("mole_route_decisions_total", "Router decisions"),
            &["reason", "adapter"],
        )
        .expect("metric");
        let running = IntGauge::new("mole_requests_running", "Requests decoding").expect("metric");
        let waiting = IntGauge::new("mole_requests_waiting", "Requests waiting").expect("metric");
        let adapters_loaded =
            IntGauge::new("mole_adapters_loaded", "Adapter versions loaded").expect("metric");
        let proxy = IntCounterVec::new(
            Opts::new("mole_merged_proxy_total", "Forwards to merged pods"),
            &["adapter", "outcome"],
        )
        .expect("metric");
        let lora_info = GaugeVec::new(
            Opts::new(
                "vllm:lora_requests_info",
                "Running and waiting LoRA adapters",
            ),
            &["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        .expect("metric");
        for c in [
            Box::new(requests.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(errors.clone()),
            Box::new(latency.clone()),
            Box::new(ttft.clone()),
            Box::new(itl.clone()),
            Box::new(route_confidence.clone()),
            Box::new(batch_size.clone()),
            Box::new(cancelled.clone()),
            Box::new(residency.clone()),
            Box::new(adapter_loads.clone()),
            Box::new(adapter_load_seconds.clone()),
            Box::new(adapter_load_duration.clone()),
            Box::new(restart_required.clone()),
            Box::new(config_reloads.clone()),
            Box::new(ready.clone()),
            Box::new(adapter_evictions.clone()),
            Box::new(tokens.clone()),
            Box::new(routes.clone()),
            Box::new(running.clone()),
            Box::new(waiting.clone()),
            Box::new(adapters_loaded.clone()),
            Box::new(proxy.clone()),
            Box::new(lora_info.clone()),
        ] {
            registry.register(c).expect("register");
        }
        Self {
            registry,
            requests,
            errors,
            latency,
            ttft,
            itl,
            route_confidence,
            batch_size,
            cancelled,
            residency,
            adapter_loads,
            adapter_load_seconds,
            adapter_load_duration,
            restart_required,
            config_reloads,
            ready,
            adapter_evictions,
            tokens,
            routes,
            running,
            waiting,
            adapters_loaded,
            proxy,
            lora_info,
        }
    }

    /// Refreshes the engine gauges and renders the text exposition format.
    pub fn render(&self, stats: &EngineStats, adapters: &[mole_crds::LoraAdapterInfo]) -> String {
        self.running.set(stats.running as i64);
        self.waiting.set(stats.waiting as i64);
        self.batch_size.set(stats.last_batch_size as i64);
        // The engine keeps cumulative counts; the counters follow them.
        let follow = |c: &IntCounter, v: u64| {
            if v > c.get() {
                c.inc_by(v - c.get());
            }
        };
        follow(&self.cancelled, stats.cancelled);
        follow(&self.adapter_evictions, stats.adapter_evictions);
        follow(
            &self.adapter_loads.with_label_values(&["ok"]),
            stats.adapter_loads,
        );
        follow(
            &self.adapter_loads.with_label_values(&["failed"]),
            stats.adapter_load_failures,
        );
        let secs = self.adapter_load_seconds.get();
        if stats.adapter_load_seconds > secs {
            self.adapter_load_seconds
                .inc_by(stats.adapter_load_seconds - secs);
        }
        self.adapters_loaded
            .set(adapters.iter().filter(|a| a.loaded).count() as i64);
        for r in ["gpu", "cpu", "disk"] {
            let n = adapters
                .iter()
                .filter(|a| a.error.is_none())
                .filter(|a| {
                    serde_json::to_value(a.residency)
                        .ok()
                        .and_then(|v| v.as_str().map(String::from))
                        == Some(r.to_string())
                })
                .count();
            self.residency.with_label_values(&[r]).set(n as i64);
        }
        // vLLM exposes one series whose labels carry the adapter lists; reset so stale label
        // sets do not linger.
        self.lora_info.reset();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        self.lora_info
            .with_label_values(&[
                &stats.running_adapters.join(","),
                &stats.waiting_adapters.join(","),
                &stats.max_loras.to_string(),
            ])
            .set(now);
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .expect("encode");
        String::from_utf8(buf).expect("utf8")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
