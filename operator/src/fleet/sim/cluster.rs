//! The simulated pool: pods that batch requests, the dynamic pods' adapter slots (GPU slots,
//! host cache, disk), and a router that prefers a ready merged pod, then the adapter's placed
//! pods by load and residency.

use std::collections::{BTreeMap, VecDeque};

use super::trace::Request;
use super::ServiceModel;
use crate::fleet::traffic::{Counters, LATENCY_BUCKETS_MS};

/// Where a request was served from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Served {
    /// A merged pod.
    Merged,
    /// A dynamic pod that had the adapter in a GPU slot.
    Gpu,
    /// A dynamic pod that loaded it from its host cache.
    Host,
    /// A dynamic pod that loaded it from disk.
    Disk,
}

/// What a pod runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A shared pod: adapters switched per request.
    Dynamic,
    /// One adapter merged into the weights.
    Merged(u32),
}

#[derive(Debug, Clone)]
struct Active {
    adapter: u32,
    remaining: f64,
    arrival: f64,
    start: f64,
    served: Served,
}

/// One finished request.
#[derive(Debug, Clone, Copy)]
pub struct Done {
    /// Arrival.
    pub arrival: f64,
    /// Seconds from arrival until its first token could be generated (queueing and load).
    pub wait: f64,
    /// Seconds from arrival to its last token.
    pub latency: f64,
    /// Where it was served.
    pub served: Served,
}

/// A pod.
#[derive(Debug, Clone)]
pub struct Pod {
    /// Name (`pod-<n>`).
    pub name: String,
    /// What it runs (or will run once it started).
    pub kind: Kind,
    /// When it can take requests.
    pub ready_at: f64,
    /// Takes no new requests; becomes `then` once empty.
    pub draining: Option<Kind>,
    active: Vec<Active>,
    queue: VecDeque<(Request, f64)>,
    /// Adapters in GPU slots, with their last use.
    gpu: Vec<(u32, f64)>,
    /// Adapters in host memory, with their last use.
    host: Vec<(u32, f64)>,
    /// Cumulative counters per adapter (what `/v1/lora_adapters` would report).
    pub counters: BTreeMap<u32, Counters>,
}

impl Pod {
    /// A pod of `kind` ready at `ready_at`.
    pub fn new(name: String, kind: Kind, ready_at: f64) -> Self {
        Self {
            name,
            kind,
            ready_at,
            draining: None,
            active: Vec::new(),
            queue: VecDeque::new(),
            gpu: Vec::new(),
            host: Vec::new(),
            counters: BTreeMap::new(),
        }
    }

    /// Whether it takes new requests at `now`.
    pub fn serving(&self, now: f64) -> bool {
        self.ready_at <= now && self.draining.is_none()
    }

    /// Requests on it (running, loading and queued).
    pub fn load(&self) -> usize {
        self.active.len() + self.queue.len()
    }

    /// Where the adapter is on this pod: 0 GPU slot, 1 host cache, 2 disk.
    pub fn residency(&self, adapter: u32) -> u8 {
        if self.gpu.iter().any(|(a, _)| *a == adapter) {
            0
        } else if self.host.iter().any(|(a, _)| *a == adapter) {
            1
        } else {
            2
        }
    }

    /// Queues a request.
    pub fn push(&mut self, r: Request, now: f64) {
        self.queue.push_back((r, now));
    }

    /// Takes back the queued requests (the pod starts draining).
    pub fn take_queue(&mut self) -> Vec<Request> {
        self.queue.drain(..).map(|(r, _)| r).collect()
    }

    /// Whether nothing runs or waits on it.
    pub fn idle(&self) -> bool {
        self.active.is_empty() && self.queue.is_empty()
    }

    /// Admits what fits, then generates for `dt` seconds; finished requests go to `done`.
    pub fn step(&mut self, m: &ServiceModel, now: f64, dt: f64, done: &mut Vec<Done>) {
        if self.ready_at > now {
            return;
        }
        self.admit(m, now);
        let running: Vec<usize> = (0..self.active.len())
            .filter(|&i| self.active[i].start <= now)
            .collect();
        if running.is_empty() {
            return;
        }
        let b = running.len();
        let rate = match self.kind {
            Kind::Merged(_) => m.merged_rate(b),
            Kind::Dynamic => {
                let mut distinct: Vec<u32> =
                    running.iter().map(|&i| self.active[i].adapter).collect();
                distinct.sort_unstable();
                distinct.dedup();
                m.dynamic_rate(b, distinct.len())
            }
        };
        let per = rate / b as f64 * dt;
        for &i in &running {
            self.active[i].remaining -= per;
        }
        let mut i = 0;
        while i < self.active.len() {
            if self.active[i].remaining <= 0.0 {
                let a = self.active.swap_remove(i);
                let latency = now + dt - a.arrival;
                done.push(Done {
                    arrival: a.arrival,
                    wait: a.start - a.arrival,
                    latency,
                    served: a.served,
                });
                let c = self.counters.entry(a.adapter).or_default();
                c.requests += 1;
                if c.latency.is_empty() {
                    c.latency = vec![0; LATENCY_BUCKETS_MS.len() + 1];
                }
                let ms = latency * 1000.0;
                let bucket = LATENCY_BUCKETS_MS.partition_point(|b| *b < ms);
                c.latency[bucket] += 1;
            } else {
                i += 1;
            }
        }
        for c in self.counters.values_mut() {
            c.running = 0;
        }
        for a in &self.active {
            self.counters.entry(a.adapter).or_default().running += 1;
        }
    }

    fn admit(&mut self, m: &ServiceModel, now: f64) {
        // vLLM's scheduler skips a request whose adapter cannot get a slot and admits later
        // ones that can; so does this, over the first few queued requests.
        let mut i = 0;
        while self.active.len() < m.batch && i < self.queue.len().min(64) {
            let (r, _) = self.queue[i];
            let admitted = match self.kind {
                Kind::Merged(_) => Some((Served::Merged, now)),
                Kind::Dynamic => self.slot_for(m, r.adapter, now),
            };
            match admitted {
                Some((served, start)) => {
                    // Arrivals of a step are routed at its start.
                    let start = start.max(r.at);
                    self.queue.remove(i);
                    self.active.push(Active {
                        adapter: r.adapter,
                        remaining: f64::from(r.tokens),
                        arrival: r.at,
                        start,
                        served,
                    });
                    // Counted when it starts, as the worker counts tokens it generates.
                    self.counters.entry(r.adapter).or_default().tokens += u64::from(r.tokens);
                }
                None => i += 1,
            }
        }
    }

    /// Puts `adapter` in a GPU slot (loading it when it is not there) and says from where
    /// and when it can start; None when every slot holds an adapter in use.
    fn slot_for(&mut self, m: &ServiceModel, adapter: u32, now: f64) -> Option<(Served, f64)> {
        if let Some(s) = self.gpu.iter_mut().find(|(a, _)| *a == adapter) {
            s.1 = now;
            // Still loading for an earlier request: start when that load ends.
            let start = self
                .active
                .iter()
                .filter(|x| x.adapter == adapter)
                .map(|x| x.start)
                .fold(now, f64::max);
            return Some((Served::Gpu, start));
        }
        if self.gpu.len() >= m.max_loras {
            let in_use = |a: u32| self.active.iter().any(|x| x.adapter == a);
            let victim = self
                .gpu
                .iter()
                .enumerate()
                .filter(|(_, (a, _))| !in_use(*a))
                .min_by(|x, y| x.1 .1.total_cmp(&y.1 .1))
                .map(|(i, _)| i)?;
            let (gone, _) = self.gpu.swap_remove(victim);
            self.cache_on_host(m, gone, now);
        }
        let (served, delay) = match self.host.iter().position(|(a, _)| *a == adapter) {
            Some(_) => (Served::Host, m.host_load_s),
            None => (Served::Disk, m.disk_load_s),
        };
        self.cache_on_host(m, adapter, now);
        self.gpu.push((adapter, now));
        Some((served, now + delay))
    }

    fn cache_on_host(&mut self, m: &ServiceModel, adapter: u32, now: f64) {
        if let Some(h) = self.host.iter_mut().find(|(a, _)| *a == adapter) {
            h.1 = now;
            return;
        }
        if self.host.len() >= m.max_cpu_loras {
            if let Some(i) = self
                .host
                .iter()
                .enumerate()
                .min_by(|x, y| x.1 .1.total_cmp(&y.1 .1))
                .map(|(i, _)| i)
            {
                self.host.swap_remove(i);
            }
        }
        if m.max_cpu_loras > 0 {
            self.host.push((adapter, now));
        }
    }
}

/// Requests a placed pod may have beyond the least loaded dynamic pod before a request goes
/// there instead (half a batch): placement concentrates adapters, never at the price of a
/// queue while another pod idles.
const SPILL: usize = 8;

/// Picks the pod for a request: a serving merged pod of its adapter (least loaded), else the
/// serving dynamic pods it is placed on (all of them without a placement, or when none of its
/// placed pods serves, or when they hold [`SPILL`] more requests than the least loaded pod),
/// least loaded, a resident adapter winning a near tie. None when no pod serves.
pub fn route(pods: &[Pod], placed: Option<&[usize]>, adapter: u32, now: f64) -> Option<usize> {
    let merged = (0..pods.len())
        .filter(|&i| pods[i].kind == Kind::Merged(adapter) && pods[i].serving(now))
        .min_by_key(|&i| pods[i].load());
    if merged.is_some() {
        return merged;
    }
    let dynamic = |i: &usize| pods[*i].kind == Kind::Dynamic && pods[*i].serving(now);
    let score = |i: usize| 2 * pods[i].load() + usize::from(pods[i].residency(adapter));
    let any = (0..pods.len()).filter(dynamic).min_by_key(|&i| score(i));
    let from_placed =
        placed.and_then(|p| p.iter().copied().filter(dynamic).min_by_key(|&i| score(i)));
    match (from_placed, any) {
        (Some(p), Some(a)) if pods[p].load() > pods[a].load() + SPILL => Some(a),
        (Some(p), _) => Some(p),
        (None, a) => a,
    }
}
