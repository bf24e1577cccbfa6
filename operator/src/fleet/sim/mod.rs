//! The fleet simulator (`mole-operator simulate`): a request trace played against a pool of
//! GPU pods under four policies, the traffic-driven one run by the operator's own code
//! ([`crate::fleet::traffic`] smoothing the pods' counters, [`crate::fleet::merge::decide`],
//! [`crate::fleet::placement::place`]), not a copy of it.
//!
//! - `all-dynamic`: every GPU a dynamic pod, every pod takes any adapter (mole without a fleet
//!   policy).
//! - `dynamic-placed`: the same pods, adapters placed by traffic (placement alone).
//! - `all-merged`: one merged pod per adapter (as many GPUs as adapters).
//! - `traffic`: the fleet policy: placement, and hot adapters promoted to merged pods within a
//!   GPU budget, demoted when they cool down.
//!
//! The pods' service rates come from `mole-bench decode` (see [`ServiceModel`]).

pub mod cluster;
pub mod report;
pub mod trace;

use std::collections::BTreeMap;

use chrono::{DateTime, Duration, TimeZone, Utc};

use super::merge::{self, Action};
use super::placement;
use super::traffic::{Counters, Smoother};
use cluster::{route, Done, Kind, Pod, Served};
use trace::Request;

/// Errors of the simulator.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A line of a trace file could not be read.
    #[error("trace line {line}: {message}")]
    Trace {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// A setting is out of range.
    #[error("invalid simulation setting: {0}")]
    Invalid(String),
}

pub use mole_crds::ServiceModel;

/// The service model measured on one H200 with the batched engine
/// (`docs/fleet/service-model-h200.json`, from docs/benchmarks.md): the simulator's default.
pub const H200_MODEL: &str = include_str!("../../../../docs/fleet/service-model-h200.json");

/// [`H200_MODEL`], parsed.
pub fn h200_model() -> ServiceModel {
    serde_json::from_str(H200_MODEL)
        .expect("the committed H200 service model parses (a test reads it)")
}

/// The fleet policy's capacity view of a service model: what one merged GPU generates at the
/// model's batch, and a busy dynamic pod's rate against it (`maxLoras` distinct adapters in
/// the batch, as placement leaves a busy pod), so the earn check counts what a dynamic pod
/// really loses to an adapter's traffic.
pub fn capacity_of(m: &ServiceModel, dynamic_gpus: usize) -> merge::Capacity {
    let b = m.batch.clamp(1, 16);
    let k = m.max_loras.min(b).max(1);
    merge::Capacity {
        merged_tokens_per_min: m.merged_rate(b) * 60.0,
        dynamic_ratio: m.dynamic_rate(b, k) / m.merged_rate(b),
        dynamic_gpus: u32::try_from(dynamic_gpus).unwrap_or(u32::MAX),
    }
}

/// A policy of the simulation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// Every GPU a dynamic pod taking any adapter.
    AllDynamic,
    /// Dynamic pods with traffic-driven placement.
    DynamicPlaced,
    /// One merged pod per adapter.
    AllMerged,
    /// Placement, promotion and demotion by traffic, merging only where it earns its GPUs.
    Traffic,
    /// The same by shares alone.
    TrafficShares,
}

impl Strategy {
    /// Whether it promotes adapters to merged pods by traffic.
    pub fn merges(self) -> bool {
        matches!(self, Strategy::Traffic | Strategy::TrafficShares)
    }

    /// Its name in tables.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::AllDynamic => "all-dynamic",
            Strategy::DynamicPlaced => "dynamic-placed",
            Strategy::AllMerged => "all-merged",
            Strategy::Traffic => "traffic",
            Strategy::TrafficShares => "traffic-share",
        }
    }
}

/// The pool and the fleet policy.
#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    /// GPUs of the pool (one pod each), for every strategy but `all-merged`.
    pub gpus: usize,
    /// Dynamic pods the `traffic` policy always keeps (the rest is its merged budget).
    pub min_dynamic: usize,
    /// Service rates.
    pub model: ServiceModel,
    /// Merge policy (its `budget_gpus` is `gpus - min_dynamic`; its `capacity`, when set, is
    /// taken from `model` at each run).
    pub merge: merge::Policy,
    /// Placement policy (its `capacity` is `max_loras + max_cpu_loras`).
    pub placement: placement::Policy,
    /// Seconds between two decisions (the operator's reconcile period).
    pub control_s: f64,
    /// Smoothing window of the traffic rates.
    pub smoothing_s: f64,
    /// Simulation step.
    pub dt: f64,
}

impl SimConfig {
    /// The defaults for `gpus` GPUs with the measured H200 model.
    pub fn new(gpus: usize) -> Self {
        Self::with_model(gpus, h200_model())
    }

    /// The defaults for `gpus` GPUs with `model`; the traffic policy checks that merging earns
    /// its GPUs against the model's rates.
    pub fn with_model(gpus: usize, model: ServiceModel) -> Self {
        let min_dynamic = gpus.div_ceil(2).max(1);
        Self {
            gpus,
            min_dynamic,
            merge: merge::Policy {
                // About one GPU's share of the pool: an adapter below that would leave its
                // merged GPU mostly idle.
                promote_share: 0.15,
                demote_share: 0.06,
                window_secs: 300,
                min_hold_secs: 900,
                budget_gpus: gpus.saturating_sub(min_dynamic) as u32,
                min_accuracy: None,
                capacity: Some(capacity_of(&model, gpus)),
            },
            placement: placement::Policy {
                min_replicas: 2,
                load_factor: 1.25,
                capacity: model.max_loras + model.max_cpu_loras,
            },
            model,
            control_s: 60.0,
            smoothing_s: 300.0,
            dt: 0.05,
        }
    }

    fn check(&self) -> Result<(), SimError> {
        self.model
            .validate()
            .map_err(|e| SimError::Invalid(e.to_string()))?;
        if self.gpus == 0 || self.min_dynamic == 0 || self.min_dynamic > self.gpus {
            return Err(SimError::Invalid(format!(
                "need 1 <= min dynamic pods ({}) <= GPUs ({})",
                self.min_dynamic, self.gpus
            )));
        }
        if !(self.dt > 0.0 && self.dt <= 1.0 && self.control_s >= self.dt) {
            return Err(SimError::Invalid(
                "step must be in (0, 1] s and at most the control period".into(),
            ));
        }
        if !(0.0 < self.merge.demote_share
            && self.merge.demote_share < self.merge.promote_share
            && self.merge.promote_share <= 1.0)
        {
            return Err(SimError::Invalid(
                "need 0 < demote share < promote share <= 1".into(),
            ));
        }
        Ok(())
    }
}

/// One minute of a run.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Minute {
    /// Requests that arrived in it.
    pub arrivals: usize,
    /// Merged pods serving at its end.
    pub merged_pods: usize,
    /// p99 of the wait of the requests that arrived in it (seconds).
    pub p99_wait: f64,
}

/// What a run gives.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// The strategy.
    pub strategy: Strategy,
    /// GPUs it held (pods).
    pub gpus: usize,
    /// Requests in the trace.
    pub requests: usize,
    /// Requests finished before the run ended.
    pub completed: usize,
    /// Wait until the first token (queue and adapter load), p50 and p99, seconds.
    pub wait_p50: f64,
    /// See `wait_p50`.
    pub wait_p99: f64,
    /// Arrival to last token, p50 and p99, seconds.
    pub latency_p50: f64,
    /// See `latency_p50`.
    pub latency_p99: f64,
    /// Share of requests served merged, from a GPU slot, after a host-cache load, after a
    /// disk load.
    pub served: [f64; 4],
    /// Promotions decided.
    pub promotions: usize,
    /// Demotions decided.
    pub demotions: usize,
    /// Per minute.
    pub timeline: Vec<Minute>,
    /// The policy's decisions (`t=<s> <adapter> <reason>: <numbers>`).
    pub events: Vec<String>,
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn clock(t: f64) -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 1, 1, 0, 0, 0)
        .single()
        .unwrap_or_default()
        + Duration::milliseconds((t * 1000.0) as i64)
}

/// Plays `trace` (over `adapters` adapters) under `strategy`. Deterministic.
pub fn run(
    strategy: Strategy,
    cfg: &SimConfig,
    trace: &[Request],
    adapters: usize,
) -> Result<Outcome, SimError> {
    cfg.check()?;
    let m = &cfg.model;
    let mut policy = cfg.merge.clone();
    let earns = strategy != Strategy::TrafficShares;
    policy.capacity = None;
    let shares_policy = matches!(strategy, Strategy::Traffic | Strategy::TrafficShares);
    let adapters = adapters.max(
        trace
            .iter()
            .map(|r| r.adapter as usize + 1)
            .max()
            .unwrap_or(0),
    );
    let mut pods: Vec<Pod> = match strategy {
        Strategy::AllMerged => (0..adapters)
            .map(|a| Pod::new(format!("pod-{a}"), Kind::Merged(a as u32), 0.0))
            .collect(),
        _ => (0..cfg.gpus)
            .map(|i| Pod::new(format!("pod-{i}"), Kind::Dynamic, 0.0))
            .collect(),
    };
    let mut smoothers: Vec<Smoother> = (0..adapters)
        .map(|_| Smoother::new(cfg.smoothing_s, Default::default()))
        .collect();
    let mut states = vec![merge::State::default(); adapters];
    let mut placed: Option<Vec<Vec<usize>>> = None;
    // Merge Jobs running: (done at, adapter).
    let mut merging: Vec<(f64, u32)> = Vec::new();
    // Promotions whose merge is done, waiting for a dynamic pod to drain.
    let mut waiting_gpu: Vec<u32> = Vec::new();
    let mut unrouted: Vec<Request> = Vec::new();
    let mut done: Vec<Done> = Vec::with_capacity(trace.len());
    let mut out = Outcome {
        strategy,
        gpus: pods.len(),
        requests: trace.len(),
        completed: 0,
        wait_p50: 0.0,
        wait_p99: 0.0,
        latency_p50: 0.0,
        latency_p99: 0.0,
        served: [0.0; 4],
        promotions: 0,
        demotions: 0,
        timeline: Vec::new(),
        events: Vec::new(),
    };
    let last = trace.last().map(|r| r.at).unwrap_or(0.0);
    // After the last arrival the pool gets 15 minutes to finish what it holds.
    let end = last + 900.0;
    let mut next = 0;
    let mut t = 0.0;
    let mut next_control = cfg.control_s;
    let mut merged_at_minute: Vec<usize> = Vec::new();
    while t < end {
        // Arrivals of this step, and requests that found no pod before.
        let mut arriving = std::mem::take(&mut unrouted);
        while next < trace.len() && trace[next].at < t + cfg.dt {
            arriving.push(trace[next]);
            next += 1;
        }
        for r in arriving {
            let placed_pods = placed
                .as_ref()
                .and_then(|p| p.get(r.adapter as usize))
                .map(Vec::as_slice);
            match route(&pods, placed_pods, r.adapter, t) {
                Some(i) => pods[i].push(r, t),
                None => unrouted.push(r),
            }
        }
        for p in pods.iter_mut() {
            p.step(m, t, cfg.dt, &mut done);
        }
        // Drained pods restart as what they were drained for.
        for p in pods.iter_mut() {
            if let Some(then) = p.draining {
                if p.idle() {
                    *p = Pod::new(p.name.clone(), then, t + m.pod_start_s);
                }
            }
        }
        // Merge Jobs that finished take a GPU from the least loaded dynamic pod.
        merging.retain(|&(at, a)| {
            if at <= t {
                waiting_gpu.push(a);
            }
            at > t
        });
        while let Some(&a) = waiting_gpu.first() {
            let dynamic = pods
                .iter()
                .filter(|p| p.kind == Kind::Dynamic && p.draining.is_none())
                .count();
            if dynamic <= cfg.min_dynamic {
                break;
            }
            let Some(i) = (0..pods.len())
                .filter(|&i| pods[i].kind == Kind::Dynamic && pods[i].draining.is_none())
                .min_by_key(|&i| pods[i].load())
            else {
                break;
            };
            pods[i].draining = Some(Kind::Merged(a));
            unrouted.extend(pods[i].take_queue());
            waiting_gpu.remove(0);
        }
        if t >= next_control && (shares_policy || strategy == Strategy::DynamicPlaced) {
            next_control += cfg.control_s;
            let now = clock(t);
            for (a, s) in smoothers.iter_mut().enumerate() {
                let per_pod: BTreeMap<String, Counters> = pods
                    .iter()
                    .filter_map(|p| {
                        p.counters
                            .get(&(a as u32))
                            .map(|c| (p.name.clone(), c.clone()))
                    })
                    .collect();
                s.observe(now, &per_pod);
            }
            if shares_policy {
                let cands: Vec<merge::Candidate> = (0..adapters)
                    .map(|a| {
                        let r = smoothers[a].rates();
                        merge::Candidate {
                            name: format!("adapter-{a}"),
                            tokens_per_min: r.tokens_per_min,
                            requests_per_min: r.requests_per_min,
                            p95_ms: r.p95_ms,
                            gpus: 1,
                            accuracy: None,
                            state: states[a],
                        }
                    })
                    .collect();
                let total: f64 = cands.iter().map(|c| c.tokens_per_min).sum();
                // The dynamic pods serving now (the earn check's headroom counts them).
                let dynamic_now = pods
                    .iter()
                    .filter(|p| p.kind == Kind::Dynamic && p.draining.is_none())
                    .count();
                policy.capacity = earns.then(|| capacity_of(m, dynamic_now));
                for (a, d) in merge::decide(&policy, total, &cands, now)
                    .into_iter()
                    .enumerate()
                {
                    states[a] = d.state;
                    let a = a as u32;
                    match d.action {
                        Action::Promote => {
                            out.promotions += 1;
                            merging.push((t + m.merge_job_s, a));
                        }
                        Action::Demote => {
                            out.demotions += 1;
                            let before = merging.len() + waiting_gpu.len();
                            merging.retain(|(_, x)| *x != a);
                            waiting_gpu.retain(|x| *x != a);
                            if merging.len() + waiting_gpu.len() == before {
                                for p in pods.iter_mut() {
                                    if p.kind == Kind::Merged(a) && p.draining.is_none() {
                                        p.draining = Some(Kind::Dynamic);
                                        unrouted.extend(p.take_queue());
                                    }
                                }
                            }
                        }
                        Action::Stay => continue,
                    }
                    out.events.push(format!("t={t:.0}s {} {}", d.name, d.note));
                }
            }
            let serving: Vec<usize> = (0..pods.len())
                .filter(|&i| pods[i].kind == Kind::Dynamic && pods[i].draining.is_none())
                .collect();
            let names: Vec<String> = serving.iter().map(|&i| pods[i].name.clone()).collect();
            let traffic: Vec<(String, f64)> = (0..adapters)
                .map(|a| {
                    let w = if states[a].merged {
                        0.0
                    } else {
                        smoothers[a].rates().tokens_per_min
                    };
                    (format!("adapter-{a}"), w)
                })
                .collect();
            let by_name = placement::place(&cfg.placement, &traffic, &names);
            let index: BTreeMap<&str, usize> = serving
                .iter()
                .map(|&i| (pods[i].name.as_str(), i))
                .collect();
            placed = Some(
                traffic
                    .iter()
                    .map(|(n, _)| {
                        by_name
                            .get(n)
                            .map(|ps| {
                                ps.iter()
                                    .filter_map(|p| index.get(p.as_str()).copied())
                                    .collect()
                            })
                            .unwrap_or_default()
                    })
                    .collect(),
            );
        }
        let minute = (t / 60.0) as usize;
        if merged_at_minute.len() <= minute {
            merged_at_minute.resize(minute + 1, 0);
        }
        merged_at_minute[minute] = pods
            .iter()
            .filter(|p| matches!(p.kind, Kind::Merged(_)) && p.serving(t))
            .count();
        if next >= trace.len() && unrouted.is_empty() && pods.iter().all(Pod::idle) {
            break;
        }
        t += cfg.dt;
    }
    out.completed = done.len();
    let mut waits: Vec<f64> = done.iter().map(|d| d.wait).collect();
    let mut lats: Vec<f64> = done.iter().map(|d| d.latency).collect();
    waits.sort_by(f64::total_cmp);
    lats.sort_by(f64::total_cmp);
    out.wait_p50 = quantile(&waits, 0.5);
    out.wait_p99 = quantile(&waits, 0.99);
    out.latency_p50 = quantile(&lats, 0.5);
    out.latency_p99 = quantile(&lats, 0.99);
    for d in &done {
        let k = match d.served {
            Served::Merged => 0,
            Served::Gpu => 1,
            Served::Host => 2,
            Served::Disk => 3,
        };
        out.served[k] += 1.0;
    }
    let n = done.len().max(1) as f64;
    for s in out.served.iter_mut() {
        *s /= n;
    }
    let minutes = ((last / 60.0) as usize) + 1;
    let mut per_minute: Vec<Vec<f64>> = vec![Vec::new(); minutes];
    for d in &done {
        if let Some(v) = per_minute.get_mut((d.arrival / 60.0) as usize) {
            v.push(d.wait);
        }
    }
    out.timeline = per_minute
        .into_iter()
        .enumerate()
        .map(|(i, mut w)| {
            w.sort_by(f64::total_cmp);
            Minute {
                arrivals: trace.iter().filter(|r| (r.at / 60.0) as usize == i).count(),
                merged_pods: merged_at_minute.get(i).copied().unwrap_or(0),
                p99_wait: quantile(&w, 0.99),
            }
        })
        .collect();
    Ok(out)
}

#[cfg(test)]
mod tests;
