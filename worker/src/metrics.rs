//! Prometheus metrics of the worker (`mole_` prefix), plus the vLLM-compatible
//! `vllm:lora_requests_info` gauge that LoRA-aware gateways (Gateway API inference extension)
//! read to pick the pod that already holds an adapter.

use prometheus::{
    Encoder, GaugeVec, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, Opts, Registry,
    TextEncoder,
};

use crate::engine::api::EngineStats;

/// Every metric the server records.
pub struct Metrics {
    registry: Registry,
    /// Requests by endpoint, adapter, route reason and status code.
    pub requests: IntCounterVec,
    /// Errors by stable code.
    pub errors: IntCounterVec,
    /// Request latency by endpoint and adapter.
    pub latency: HistogramVec,
    /// Time to first token by adapter.
    pub ttft: HistogramVec,
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
            &["endpoint", "adapter", "route", "status"],
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
    pub fn render(&self, stats: &EngineStats, loaded: usize) -> String {
        self.running.set(stats.running as i64);
        self.waiting.set(stats.waiting as i64);
        self.adapters_loaded.set(loaded as i64);
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
