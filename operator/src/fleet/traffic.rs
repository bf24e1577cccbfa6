//! Per-adapter traffic from the pods' cumulative counters: rates over the last interval,
//! smoothed by an exponentially weighted moving average whose time constant is the window,
//! and a rule for when a new reading is worth a status write.
//!
//! The pods report totals since they started (`/v1/lora_adapters`); a pod that restarted
//! reports less than before, and its new totals are taken as its traffic since the last
//! reading. A pod seen for the first time contributes from its second reading on: its totals
//! cover an unknown time.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};

/// Upper bounds (milliseconds) of the latency histogram the pods report, the last bucket
/// open-ended; the same as `mole_api::LATENCY_BUCKETS_MS`.
pub use mole_crds::LATENCY_BUCKETS_MS;

/// Cumulative counters of one adapter in one pod.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Counters {
    /// Requests completed (successfully or not).
    pub requests: u64,
    /// Tokens generated.
    pub tokens: u64,
    /// Requests that ended in an error.
    pub errors: u64,
    /// Requests running now (a gauge, not a counter).
    pub running: u64,
    /// Requests per latency bucket ([`LATENCY_BUCKETS_MS`], one more for the open end);
    /// empty when the pod does not report latency.
    pub latency: Vec<u64>,
}

impl Counters {
    /// What happened between `prev` and `self`; a counter that went down means a restart, and
    /// then everything since the restart (`self`) is the delta.
    fn since(&self, prev: &Counters) -> Counters {
        let reset = self.requests < prev.requests
            || self.tokens < prev.tokens
            || self.errors < prev.errors
            || (self.latency.len() == prev.latency.len()
                && self.latency.iter().zip(&prev.latency).any(|(a, b)| a < b));
        if reset {
            return self.clone();
        }
        let latency = if self.latency.len() == prev.latency.len() {
            self.latency
                .iter()
                .zip(&prev.latency)
                .map(|(a, b)| a - b)
                .collect()
        } else {
            Vec::new()
        };
        Counters {
            requests: self.requests - prev.requests,
            tokens: self.tokens - prev.tokens,
            errors: self.errors - prev.errors,
            running: self.running,
            latency,
        }
    }
}

/// Smoothed traffic of one adapter.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Rates {
    /// Requests per minute.
    pub requests_per_min: f64,
    /// Generated tokens per minute.
    pub tokens_per_min: f64,
    /// Share of requests that succeeded, when any completed within the window.
    pub success_rate: Option<f64>,
    /// Median latency (ms), from the smoothed histogram.
    pub p50_ms: Option<f64>,
    /// 95th percentile latency (ms).
    pub p95_ms: Option<f64>,
    /// Last time a request of this adapter ran or completed.
    pub last_used: Option<DateTime<Utc>>,
}

/// The smoothing state of one adapter (kept in the operator's memory; after a restart it
/// starts again from the rates its status last recorded).
#[derive(Debug, Clone)]
pub struct Smoother {
    window_secs: f64,
    last: BTreeMap<String, Counters>,
    last_at: Option<DateTime<Utc>>,
    rates: Rates,
    /// Smoothed requests per second that failed (for the success rate).
    errors_per_sec: f64,
    /// The latency histogram, decayed as the rates are.
    hist: Vec<f64>,
}

impl Smoother {
    /// A smoother with time constant `window_secs`, starting from `seed` (the rates the
    /// status holds, or zero).
    pub fn new(window_secs: f64, seed: Rates) -> Self {
        let errors_per_sec = seed
            .success_rate
            .map(|s| (1.0 - s) * seed.requests_per_min / 60.0)
            .unwrap_or(0.0);
        Self {
            window_secs: window_secs.max(1.0),
            last: BTreeMap::new(),
            last_at: None,
            rates: seed,
            errors_per_sec,
            hist: Vec::new(),
        }
    }

    /// The smoothed rates now.
    pub fn rates(&self) -> &Rates {
        &self.rates
    }

    /// Takes the counters each pod reports now (pods not listed are gone) and returns the
    /// new smoothed rates.
    pub fn observe(&mut self, now: DateTime<Utc>, pods: &BTreeMap<String, Counters>) -> &Rates {
        let mut delta = Counters::default();
        let mut running = 0;
        for (pod, c) in pods {
            running += c.running;
            if let Some(prev) = self.last.get(pod) {
                let d = c.since(prev);
                delta.requests += d.requests;
                delta.tokens += d.tokens;
                delta.errors += d.errors;
                if delta.latency.len() < d.latency.len() {
                    delta.latency.resize(d.latency.len(), 0);
                }
                for (a, b) in delta.latency.iter_mut().zip(&d.latency) {
                    *a += b;
                }
            }
        }
        self.last = pods.clone();
        let Some(prev_at) = self.last_at.replace(now) else {
            return &self.rates;
        };
        let dt = (now - prev_at).num_microseconds().unwrap_or(i64::MAX) as f64 / 1e6;
        if dt <= 0.0 {
            return &self.rates;
        }
        if delta.requests > 0 || running > 0 {
            self.rates.last_used = Some(now);
        }
        // The weight of this interval: an interval as long as the window counts for 63%.
        let a = 1.0 - (-dt / self.window_secs).exp();
        let ewma = |old: f64, new: f64| old + a * (new - old);
        self.rates.requests_per_min = ewma(
            self.rates.requests_per_min,
            delta.requests as f64 * 60.0 / dt,
        );
        self.rates.tokens_per_min =
            ewma(self.rates.tokens_per_min, delta.tokens as f64 * 60.0 / dt);
        self.errors_per_sec = ewma(self.errors_per_sec, delta.errors as f64 / dt);
        let req_per_sec = self.rates.requests_per_min / 60.0;
        // Below one request per hour there is too little to say anything about success.
        self.rates.success_rate = (req_per_sec > 1.0 / 3600.0)
            .then(|| (1.0 - self.errors_per_sec / req_per_sec).clamp(0.0, 1.0));
        if self.hist.len() < delta.latency.len() {
            self.hist.resize(delta.latency.len(), 0.0);
        }
        for (i, h) in self.hist.iter_mut().enumerate() {
            let n = delta.latency.get(i).copied().unwrap_or(0) as f64;
            *h = ewma(*h, n / dt);
        }
        self.rates.p50_ms = percentile(&self.hist, 0.50);
        self.rates.p95_ms = percentile(&self.hist, 0.95);
        &self.rates
    }
}

/// The `q` quantile of a (decayed) histogram over [`LATENCY_BUCKETS_MS`], linear within the
/// bucket it falls in; the open last bucket answers its lower bound. None when empty.
pub fn percentile(hist: &[f64], q: f64) -> Option<f64> {
    let total: f64 = hist.iter().sum();
    if total <= 1e-12 {
        return None;
    }
    let target = q * total;
    let mut seen = 0.0;
    for (i, &n) in hist.iter().enumerate() {
        if n > 0.0 && seen + n >= target {
            let lo = if i == 0 {
                0.0
            } else {
                LATENCY_BUCKETS_MS[i - 1]
            };
            let Some(&hi) = LATENCY_BUCKETS_MS.get(i) else {
                return Some(lo);
            };
            return Some(lo + (hi - lo) * ((target - seen) / n).clamp(0.0, 1.0));
        }
        seen += n;
    }
    LATENCY_BUCKETS_MS.last().copied()
}

/// When a status write is due: never twice within `min_interval_secs` (so 500 adapters cost at
/// most 500 writes per interval), and then only when a rate moved by more than `rel_change`
/// (relative, with a floor of one request or 100 tokens per minute so idle adapters do not
/// write on noise), when it started or stopped being used, or when `max_interval_secs` passed
/// (so `lastUsed` and the rates are never older than that).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WriteRule {
    /// Shortest time between two writes of one adapter's traffic.
    pub min_interval_secs: i64,
    /// Longest time between two writes.
    pub max_interval_secs: i64,
    /// Relative change of a rate that warrants a write.
    pub rel_change: f64,
}

impl Default for WriteRule {
    fn default() -> Self {
        Self {
            min_interval_secs: 30,
            max_interval_secs: 600,
            rel_change: 0.2,
        }
    }
}

impl WriteRule {
    /// The rule for a smoothing window of `window_secs`: at most one write per tenth of the
    /// window, between 1 and 30 s (a rate smoothed over 5 minutes moves little in 30 s).
    pub fn for_window(window_secs: i64) -> Self {
        Self {
            min_interval_secs: (window_secs / 10).clamp(1, 30),
            ..Self::default()
        }
    }

    /// Whether `new` should replace `old` (written `secs_since_write` seconds ago, None: never).
    pub fn due(&self, old: Option<&Rates>, new: &Rates, secs_since_write: Option<i64>) -> bool {
        let (Some(old), Some(age)) = (old, secs_since_write) else {
            return true;
        };
        if age < self.min_interval_secs {
            return false;
        }
        if age >= self.max_interval_secs {
            return true;
        }
        let moved =
            |a: f64, b: f64, floor: f64| (a - b).abs() > self.rel_change * a.abs().max(floor);
        let idle = |r: &Rates| r.requests_per_min < 0.01;
        moved(old.requests_per_min, new.requests_per_min, 1.0)
            || moved(old.tokens_per_min, new.tokens_per_min, 100.0)
            || idle(old) != idle(new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::{Duration, TimeZone};

    fn t(secs: i64) -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 11, 27, 12, 0, 0).unwrap() + Duration::seconds(secs)
    }

    fn pods(list: &[(&str, u64, u64, u64)]) -> BTreeMap<String, Counters> {
        list.iter()
            .map(|(p, r, tok, e)| {
                let mut latency = vec![0; LATENCY_BUCKETS_MS.len() + 1];
                // Every request in the 100-250 ms bucket.
                latency[LATENCY_BUCKETS_MS.iter().position(|b| *b >= 250.0).unwrap()] = *r;
                (
                    p.to_string(),
                    Counters {
                        requests: *r,
                        tokens: *tok,
                        errors: *e,
                        running: 0,
                        latency,
                    },
                )
            })
            .collect()
    }

    #[test]
    fn steady_traffic_converges_to_its_rate_and_first_readings_count_nothing() {
        let mut s = Smoother::new(300.0, Rates::default());
        // Lifetime totals of pods seen for the first time are not a rate.
        s.observe(
            t(0),
            &pods(&[("a", 1000, 100_000, 0), ("b", 500, 50_000, 0)]),
        );
        assert_eq!(s.rates().requests_per_min, 0.0);
        // 200 requests per minute over both pods, 100 tokens each, 1% errors.
        for i in 1..=60 {
            let n = 100 * i as u64;
            s.observe(
                t(60 * i),
                &pods(&[
                    ("a", 1000 + n, 100_000 + 100 * n, n / 100),
                    ("b", 500 + n, 50_000 + 100 * n, n / 100),
                ]),
            );
        }
        let r = s.rates();
        assert!((r.requests_per_min - 200.0).abs() < 0.01, "{r:?}");
        assert!((r.tokens_per_min - 20_000.0).abs() < 1.0, "{r:?}");
        assert!((r.success_rate.unwrap() - 0.99).abs() < 0.002, "{r:?}");
        let p50 = r.p50_ms.unwrap();
        assert!((100.0..=250.0).contains(&p50), "{p50}");
        assert_eq!(r.last_used, Some(t(3600)));
    }

    #[test]
    fn a_restarted_pod_is_not_negative_traffic_and_a_gone_pod_stops_counting() {
        let mut s = Smoother::new(60.0, Rates::default());
        s.observe(t(0), &pods(&[("a", 100, 0, 0)]));
        s.observe(t(60), &pods(&[("a", 160, 0, 0)]));
        let before = s.rates().requests_per_min;
        // Restarted: 10 requests since.
        s.observe(t(120), &pods(&[("a", 10, 0, 0)]));
        let after = s.rates().requests_per_min;
        assert!(after > 0.0 && after < before, "{before} -> {after}");
        // Idle for a long time: decays towards zero, last use stays where it was.
        for i in 3..30 {
            s.observe(t(60 * i), &pods(&[("a", 10, 0, 0)]));
        }
        assert!(s.rates().requests_per_min < 0.01);
        assert_eq!(s.rates().last_used, Some(t(120)));
        assert_eq!(s.rates().success_rate, None, "too little traffic to tell");
    }

    #[test]
    fn a_burst_moves_the_average_by_its_weight_in_the_window() {
        let mut s = Smoother::new(600.0, Rates::default());
        s.observe(t(0), &pods(&[("a", 0, 0, 0)]));
        // 600 requests in one minute after silence: 1 - e^(-60/600) = 9.5% of 600/min.
        s.observe(t(60), &pods(&[("a", 600, 0, 0)]));
        let r = s.rates().requests_per_min;
        assert!((r - 600.0 * (1.0 - (-0.1f64).exp())).abs() < 1e-6, "{r}");
    }

    #[test]
    fn percentiles_interpolate_within_a_bucket() {
        let mut h = vec![0.0; LATENCY_BUCKETS_MS.len() + 1];
        assert_eq!(percentile(&h, 0.5), None);
        h[0] = 10.0;
        // All in [0, first bound]: the median is half-way.
        assert!((percentile(&h, 0.5).unwrap() - LATENCY_BUCKETS_MS[0] / 2.0).abs() < 1e-9);
        let last = h.len() - 1;
        h[last] = 1000.0;
        assert_eq!(percentile(&h, 0.95), LATENCY_BUCKETS_MS.last().copied());
    }

    #[test]
    fn writes_are_bounded_in_time_and_skip_small_changes() {
        let rule = WriteRule::default();
        let r = |rpm: f64| Rates {
            requests_per_min: rpm,
            tokens_per_min: rpm * 100.0,
            ..Default::default()
        };
        assert!(rule.due(None, &r(1.0), None), "first write");
        assert!(!rule.due(Some(&r(1.0)), &r(100.0), Some(10)), "too soon");
        assert!(rule.due(Some(&r(10.0)), &r(20.0), Some(30)), "doubled");
        assert!(
            !rule.due(Some(&r(10.0)), &r(11.0), Some(300)),
            "10%: not worth it"
        );
        assert!(rule.due(Some(&r(10.0)), &r(11.0), Some(600)), "heartbeat");
        assert!(
            !rule.due(Some(&r(0.0)), &r(0.001), Some(60)),
            "noise while idle"
        );
        assert!(
            rule.due(Some(&r(0.0)), &r(0.5), Some(60)),
            "started being used"
        );
        // 500 adapters all changing all the time still write at most once per interval each.
        let writes: usize = (0..500)
            .map(|i| {
                (0..10)
                    .filter(|k| rule.due(Some(&r(i as f64)), &r(i as f64 * 3.0 + 5.0), Some(k * 3)))
                    .count()
            })
            .sum();
        assert_eq!(writes, 0, "nothing within the minimum interval");
    }
}
