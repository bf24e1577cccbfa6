//! Prometheus metrics of the worker (`mole_` prefix), plus the vLLM-compatible
//! `vllm:lora_requests_info` gauge that LoRA-aware gateways (Gateway API inference extension)
//! read to pick the pod that already holds an adapter.

use prometheus::{
    Encoder, GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

use mole_engine::api::EngineStats;

/// Inter-token latency buckets: decode steps on CPU take tens of ms, on GPU a few.
const ITL_BUCKETS: [f64; 13] = [
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5,
];
/// Router confidence buckets: probabilities and cosines below 1, keyword hits above.
const CONFIDENCE_BUCKETS: [f64; 12] = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 2.0, 5.0];
/// Adapter load duration buckets, from a page-cached small adapter to a cold large one.
const LOAD_BUCKETS: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

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
    /// Requests waiting for a preparation thread (`limits.maxPrepareQueue` bounds it).
    pub prepare_queued: IntGauge,
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
    /// Where requests for an adapter this pod does not hold went, by the
    /// `server::peers::RouteReason` that sent them (`mole_peer_routes_total{reason}`).
    pub peer_routes: IntCounterVec,
    /// 1 for a peer whose last poll of `/v1/residency` answered ready within the staleness
    /// bound, 0 for one marked down or not heard from (`mole_peer_up{peer}`).
    pub peer_up: IntGaugeVec,
    /// A peer's waiting requests as its last poll saw them (`mole_peer_waiting{peer}`).
    pub peer_waiting: IntGaugeVec,
    /// vLLM-compatible LoRA info gauge (value: scrape time in seconds).
    pub lora_info: GaugeVec,
    /// `vllm:lora_adapter_loaded{adapter_name, level, pinned, rank}`: 1 for each adapter held
    /// in a device slot (`level="gpu"`) or in host memory (`"cpu"`), absent once evicted:
    /// the residency a LoRA-aware router (llm-d's load-state scorer, the Gateway API
    /// Inference Extension) reads, as vLLM publishes it (vllm-project/vllm#54830).
    /// `vllm:lora_requests_info` only lists adapters with requests in flight.
    pub lora_loaded: IntGaugeVec,
    /// `vllm:num_gpu_loaded_lora_adapters`, `vllm:num_cpu_loaded_lora_adapters` and
    /// `vllm:max_gpu_lora_adapters` (the device slots, `maxLoras`).
    pub lora_counts: (IntGauge, IntGauge, IntGauge),
    /// `vllm:num_requests_waiting` and `vllm:num_requests_running`, the queue gauges a Gateway
    /// API Inference Extension endpoint picker reads by default (the same values as
    /// `mole_requests_waiting` and `mole_requests_running`).
    pub vllm_queue: (IntGauge, IntGauge),
    /// `vllm:kv_cache_usage_perc`: the fraction (0-1) of the paged KV cache in use, which the
    /// endpoint picker's KV-cache scorer reads (0 on the CPU path, which has no paged cache).
    pub vllm_kv_usage: prometheus::Gauge,
    /// Free blocks of the paged KV cache (tensor path only).
    pub kv_blocks_free: IntGauge,
    /// Blocks of the paged KV cache (tensor path only).
    pub kv_blocks: IntGauge,
    /// Bytes of the paged KV cache (tensor path only).
    pub kv_cache_bytes: IntGauge,
    /// 1 for the dtype the KV cache holds (`kvCacheDtype`, as vLLM's `cache_config_info`
    /// carries its `cache_dtype`), so a dashboard can tell a half-type cache's figures apart.
    pub kv_cache_info: IntGaugeVec,
    /// Bytes of the base model's weights as held.
    pub weights_bytes: IntGauge,
    /// Sequences preempted because the KV cache was full.
    pub preemptions: IntCounter,
    /// Engine steps (forward passes).
    pub steps: IntCounter,
    /// Images the vision tower encoded.
    pub vision_encodes: IntCounter,
    /// Prefix-cache queries in prompt tokens, by adapter (vLLM's `prefix_cache_queries`).
    pub prefix_cache_queries: IntCounterVec,
    /// Prefix-cache hits in prompt tokens, by adapter (vLLM's `prefix_cache_hits`).
    pub prefix_cache_hits: IntCounterVec,
    /// Cached KV blocks no running request holds.
    pub prefix_cache_blocks: IntGauge,
}

impl Metrics {
    /// Registers every metric in a fresh registry.
    pub fn new() -> Self {
        let r = Registry::new();
        Self {
            requests: counters(
                &r,
                "mole_requests_total",
                "Requests served",
                &["endpoint", "adapter", "mode", "route", "status"],
            ),
            errors: counters(&r, "mole_errors_total", "Errors by stable code", &["code"]),
            latency: histograms(
                &r,
                HistogramOpts::new("mole_request_duration_seconds", "Request latency"),
                &["endpoint", "adapter"],
            ),
            ttft: histograms(
                &r,
                HistogramOpts::new("mole_time_to_first_token_seconds", "Time to first token"),
                &["adapter"],
            ),
            itl: histograms(
                &r,
                HistogramOpts::new(
                    "mole_inter_token_latency_seconds",
                    "Time between consecutive tokens of a request",
                )
                .buckets(ITL_BUCKETS.to_vec()),
                &["adapter"],
            ),
            route_confidence: histograms(
                &r,
                HistogramOpts::new(
                    "mole_route_confidence",
                    "Router confidence of routed requests by strategy",
                )
                .buckets(CONFIDENCE_BUCKETS.to_vec()),
                &["strategy"],
            ),
            batch_size: gauge(&r, "mole_batch_size", "Sequences in the last engine step"),
            cancelled: registered(
                &r,
                IntCounter::new(
                    "mole_requests_cancelled_total",
                    "Requests cancelled because the client went away",
                ),
            ),
            residency: registered(
                &r,
                IntGaugeVec::new(
                    Opts::new("mole_adapter_versions", "Adapter versions by residency"),
                    &["residency"],
                ),
            ),
            adapter_loads: counters(
                &r,
                "mole_adapter_loads_total",
                "Adapter loads by result",
                &["result"],
            ),
            adapter_load_seconds: registered(
                &r,
                prometheus::Counter::new(
                    "mole_adapter_load_seconds_total",
                    "Seconds spent loading adapters",
                ),
            ),
            adapter_load_duration: histograms(
                &r,
                HistogramOpts::new(
                    "mole_adapter_load_duration_seconds",
                    "Duration of adapter loads requested by the config or the load API",
                )
                .buckets(LOAD_BUCKETS.to_vec()),
                &["result"],
            ),
            restart_required: gauge(
                &r,
                "mole_config_restart_required",
                "1 when the config changed a setting that needs a restart (base model, limits, mode)",
            ),
            config_reloads: counters(
                &r,
                "mole_config_reloads_total",
                "Config reloads by result",
                &["result"],
            ),
            ready: gauge(&r, "mole_ready", "1 when the worker is ready"),
            prepare_queued: gauge(
                &r,
                "mole_prepare_queued",
                "Requests waiting for a preparation thread",
            ),
            adapter_evictions: registered(
                &r,
                IntCounter::new(
                    "mole_adapter_evictions_total",
                    "Adapters evicted to disk by the LRU",
                ),
            ),
            tokens: counters(&r, "mole_tokens_total", "Tokens processed", &["adapter", "kind"]),
            routes: counters(
                &r,
                "mole_route_decisions_total",
                "Router decisions",
                &["reason", "adapter"],
            ),
            running: gauge(&r, "mole_requests_running", "Requests decoding"),
            waiting: gauge(&r, "mole_requests_waiting", "Requests waiting"),
            adapters_loaded: gauge(&r, "mole_adapters_loaded", "Adapter versions loaded"),
            proxy: counters(
                &r,
                "mole_merged_proxy_total",
                "Forwards to merged pods",
                &["adapter", "outcome"],
            ),
            peer_routes: counters(
                &r,
                "mole_peer_routes_total",
                "Requests for an adapter this pod does not hold, by where they went and why",
                &["reason"],
            ),
            peer_up: registered(
                &r,
                IntGaugeVec::new(
                    Opts::new(
                        "mole_peer_up",
                        "1 when the peer's last poll answered ready within the staleness bound",
                    ),
                    &["peer"],
                ),
            ),
            peer_waiting: registered(
                &r,
                IntGaugeVec::new(
                    Opts::new("mole_peer_waiting", "The peer's waiting requests at its last poll"),
                    &["peer"],
                ),
            ),
            lora_info: registered(
                &r,
                GaugeVec::new(
                    Opts::new(
                        "vllm:lora_requests_info",
                        "Running and waiting LoRA adapters",
                    ),
                    &["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
                ),
            ),
            lora_loaded: registered(
                &r,
                IntGaugeVec::new(
                    Opts::new(
                        "vllm:lora_adapter_loaded",
                        "1 for each LoRA adapter held in a device slot (level gpu) or host memory (level cpu)",
                    ),
                    &["adapter_name", "level", "pinned", "rank"],
                ),
            ),
            lora_counts: (
                gauge(
                    &r,
                    "vllm:num_gpu_loaded_lora_adapters",
                    "LoRA adapters in device slots (vLLM's name)",
                ),
                gauge(
                    &r,
                    "vllm:num_cpu_loaded_lora_adapters",
                    "LoRA adapters in host memory (vLLM's name)",
                ),
                gauge(
                    &r,
                    "vllm:max_gpu_lora_adapters",
                    "Device slots for LoRA adapters (maxLoras; vLLM's name)",
                ),
            ),
            vllm_queue: (
                gauge(&r, "vllm:num_requests_waiting", "Requests waiting (vLLM's name)"),
                gauge(&r, "vllm:num_requests_running", "Requests decoding (vLLM's name)"),
            ),
            vllm_kv_usage: registered(
                &r,
                prometheus::Gauge::new(
                    "vllm:kv_cache_usage_perc",
                    "Fraction of the paged KV cache in use, 0-1 (vLLM's name)",
                ),
            ),
            weights_bytes: gauge(
                &r,
                "mole_weights_bytes",
                "Bytes the base model's weights hold as loaded (a quantized base: its quantized blocks)",
            ),
            kv_blocks_free: gauge(&r, "mole_kv_blocks_free", "Free blocks of the paged KV cache"),
            kv_blocks: gauge(&r, "mole_kv_blocks", "Blocks of the paged KV cache"),
            kv_cache_bytes: gauge(
                &r,
                "mole_kv_cache_bytes",
                "Bytes of the paged KV cache (keys and values of every layer)",
            ),
            kv_cache_info: registered(
                &r,
                IntGaugeVec::new(
                    Opts::new(
                        "mole_kv_cache_info",
                        "1 for the dtype the KV cache holds keys and values in (kvCacheDtype)",
                    ),
                    &["dtype"],
                ),
            ),
            preemptions: registered(
                &r,
                IntCounter::new(
                    "mole_preemptions_total",
                    "Sequences preempted (cache freed, recomputed later) because the KV cache was full",
                ),
            ),
            steps: registered(
                &r,
                IntCounter::new(
                    "mole_engine_steps_total",
                    "Engine steps: forward passes over the running batch (tokens ÷ steps is the mean batch)",
                ),
            ),
            vision_encodes: registered(
                &r,
                IntCounter::new(
                    "mole_vision_encodes_total",
                    "Images the vision tower encoded (an image whose KV blocks all came from the prefix cache is not)",
                ),
            ),
            prefix_cache_queries: counters(
                &r,
                "mole_prefix_cache_queries_total",
                "Prefix-cache queries: prompt tokens of the requests admitted, by adapter (vLLM's prefix_cache_queries)",
                &["adapter"],
            ),
            prefix_cache_hits: counters(
                &r,
                "mole_prefix_cache_hits_total",
                "Prefix-cache hits: prompt tokens whose KV blocks came from the cache, by adapter (vLLM's prefix_cache_hits)",
                &["adapter"],
            ),
            prefix_cache_blocks: gauge(
                &r,
                "mole_prefix_cache_blocks",
                "Cached KV blocks no running request holds (reusable until evicted)",
            ),
            registry: r,
        }
    }

    /// Refreshes the engine gauges and renders the text exposition format.
    pub fn render(&self, stats: &EngineStats, adapters: &[mole_api::LoraAdapterInfo]) -> String {
        self.running.set(stats.running as i64);
        self.waiting.set(stats.waiting as i64);
        self.vllm_queue.0.set(stats.waiting as i64);
        self.vllm_queue.1.set(stats.running as i64);
        self.batch_size.set(stats.last_batch_size as i64);
        // The engine keeps cumulative counts; the counters follow them.
        let follow = |c: &IntCounter, v: u64| {
            if v > c.get() {
                c.inc_by(v - c.get());
            }
        };
        follow(&self.cancelled, stats.cancelled);
        follow(&self.preemptions, stats.preemptions);
        follow(&self.steps, stats.steps);
        follow(&self.vision_encodes, stats.vision_encodes);
        if let Some((free, total)) = stats.kv_blocks {
            self.kv_blocks_free.set(free as i64);
            self.kv_blocks.set(total as i64);
            if total > 0 {
                self.vllm_kv_usage.set(1.0 - free as f64 / total as f64);
            }
        }
        if let Some(bytes) = stats.weights_bytes {
            self.weights_bytes.set(bytes as i64);
        }
        if let Some(bytes) = stats.kv_cache_bytes {
            self.kv_cache_bytes.set(bytes as i64);
        }
        if let Some(dtype) = stats.kv_cache_dtype {
            self.kv_cache_info.reset();
            self.kv_cache_info.with_label_values(&[dtype]).set(1);
        }
        for c in &stats.prefix_cache {
            follow(
                &self.prefix_cache_queries.with_label_values(&[&c.adapter]),
                c.queries,
            );
            follow(
                &self.prefix_cache_hits.with_label_values(&[&c.adapter]),
                c.hits,
            );
        }
        self.prefix_cache_blocks
            .set(stats.prefix_cached_blocks as i64);
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
        // Residency by vLLM's names: the adapters serving now (not a draining or refused
        // version), by where they are held; reset so an evicted adapter's series goes.
        self.lora_loaded.reset();
        let (mut on_device, mut in_host) = (0i64, 0i64);
        for a in adapters.iter().filter(|a| a.loaded && a.error.is_none()) {
            let level = match a.residency {
                mole_api::Residency::Gpu => "gpu",
                mole_api::Residency::Cpu => "cpu",
                mole_api::Residency::Disk => continue,
            };
            if level == "gpu" {
                on_device += 1;
            } else {
                in_host += 1;
            }
            self.lora_loaded
                .with_label_values(&[a.name.as_str(), level, "false", &a.rank.to_string()])
                .set(1);
        }
        self.lora_counts.0.set(on_device);
        self.lora_counts.1.set(in_host);
        self.lora_counts.2.set(stats.max_loras as i64);
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

/// `metric`, registered in `r`. The names and labels are constants of this file: a failure
/// is a programming error caught by every test that builds the metrics.
fn registered<M: prometheus::core::Collector + Clone + 'static>(
    r: &Registry,
    metric: prometheus::Result<M>,
) -> M {
    let m = metric.expect("valid metric");
    r.register(Box::new(m.clone()))
        .expect("metric registered once");
    m
}

/// A counter per label set.
fn counters(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    registered(r, IntCounterVec::new(Opts::new(name, help), labels))
}

/// A histogram per label set.
fn histograms(r: &Registry, opts: HistogramOpts, labels: &[&str]) -> HistogramVec {
    registered(r, HistogramVec::new(opts, labels))
}

/// One gauge.
fn gauge(r: &Registry, name: &str, help: &str) -> IntGauge {
    registered(r, IntGauge::new(name, help))
}

#[cfg(test)]
mod tests {
    use super::*;
    use mole_engine::api::PrefixCacheCounts;

    /// Issue 55 item 5: residency by vLLM's metric names, which LoRA-aware routers read: one
    /// series per adapter in a device slot or host memory, none for one on disk or draining,
    /// gone once evicted; the counts and the slots beside them.
    #[test]
    fn residency_is_exported_by_vllms_names() {
        let m = Metrics::new();
        let info = |name: &str, residency: mole_api::Residency, loaded: bool| {
            serde_json::from_value::<mole_api::LoraAdapterInfo>(serde_json::json!({
                "name": name, "version": "v1", "lora_id": 1, "residency": residency,
                "loaded": loaded, "rank": 8, "bytes": 10, "requests": 0, "running": 0
            }))
            .unwrap()
        };
        let stats = EngineStats {
            max_loras: 4,
            ..Default::default()
        };
        let text = m.render(
            &stats,
            &[
                info("calendar", mole_api::Residency::Gpu, true),
                info("mail", mole_api::Residency::Cpu, true),
                info("cold", mole_api::Residency::Disk, true),
                info("old", mole_api::Residency::Gpu, false),
            ],
        );
        let line = |s: &str| text.lines().any(|l| l == s);
        assert!(
            line(
                r#"vllm:lora_adapter_loaded{adapter_name="calendar",level="gpu",pinned="false",rank="8"} 1"#
            ),
            "{text}"
        );
        assert!(line(
            r#"vllm:lora_adapter_loaded{adapter_name="mail",level="cpu",pinned="false",rank="8"} 1"#
        ));
        assert!(
            !text.contains(r#"adapter_name="cold""#) && !text.contains(r#"adapter_name="old""#)
        );
        assert!(line("vllm:num_gpu_loaded_lora_adapters 1"));
        assert!(line("vllm:num_cpu_loaded_lora_adapters 1"));
        assert!(line("vllm:max_gpu_lora_adapters 4"));
        // Evicted: its series goes.
        let text = m.render(&stats, &[info("mail", mole_api::Residency::Cpu, true)]);
        assert!(!text.contains(r#"adapter_name="calendar""#), "{text}");
    }

    /// The engine's cumulative prefix-cache counts become counters per adapter, by vLLM's
    /// names under mole's prefix; its count of images encoded a counter; its KV cache's dtype
    /// an info gauge.
    #[test]
    fn prefix_cache_counts_are_counters_per_adapter() {
        let m = Metrics::new();
        let mut stats = EngineStats {
            prefix_cache: vec![
                PrefixCacheCounts {
                    adapter: String::new(),
                    queries: 40,
                    hits: 32,
                },
                PrefixCacheCounts {
                    adapter: "a".into(),
                    queries: 10,
                    hits: 0,
                },
            ],
            prefix_cached_blocks: 3,
            vision_encodes: 2,
            kv_cache_dtype: Some("f32"),
            ..Default::default()
        };
        m.render(&stats, &[]);
        stats.prefix_cache[0].queries = 80;
        stats.prefix_cache[0].hits = 64;
        stats.vision_encodes = 5;
        stats.kv_cache_dtype = Some("bf16");
        let text = m.render(&stats, &[]);
        assert!(
            !text.contains("dtype=\"f32\""),
            "one dtype at a time:\n{text}"
        );
        for line in [
            "mole_prefix_cache_queries_total{adapter=\"\"} 80",
            "mole_prefix_cache_hits_total{adapter=\"\"} 64",
            "mole_prefix_cache_queries_total{adapter=\"a\"} 10",
            "mole_prefix_cache_hits_total{adapter=\"a\"} 0",
            "mole_prefix_cache_blocks 3",
            "mole_vision_encodes_total 5",
            "mole_kv_cache_info{dtype=\"bf16\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing:\n{text}");
        }
    }
}
