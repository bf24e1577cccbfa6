//! Request traces: generated (Zipf popularity, a diurnal cycle, bursts, a change of the most
//! popular adapters half-way) or read from a CSV file (`at_s,adapter,tokens`).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::SimError;

/// One request of a trace.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Request {
    /// Arrival, seconds from the start.
    pub at: f64,
    /// Adapter index (`adapter-<index>`).
    pub adapter: u32,
    /// Tokens it generates.
    pub tokens: u32,
}

/// What to generate.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceSpec {
    /// Adapters (10 to 1,000).
    pub adapters: usize,
    /// Zipf exponent of their popularity.
    pub zipf: f64,
    /// Seconds of traffic.
    pub duration_s: f64,
    /// Mean requests per second over the whole trace.
    pub rate: f64,
    /// Diurnal swing: the rate goes from `1 - a` to `1 + a` times the mean and back, one cycle
    /// over the trace (a day compressed), starting low.
    pub diurnal: f64,
    /// Bursts: for `burst_s` seconds one adapter from the tail gets `burst_rate` requests per
    /// second more.
    pub bursts: usize,
    /// Length of a burst.
    pub burst_s: f64,
    /// Extra requests per second of a bursting adapter.
    pub burst_rate: f64,
    /// Half-way through, the ten most popular adapters swap ranks with the next ten (what was
    /// hot cools down, and the other way round).
    pub shift: bool,
    /// Mean generated tokens per request (at least 32).
    pub mean_tokens: f64,
    /// Random seed.
    pub seed: u64,
}

impl Default for TraceSpec {
    fn default() -> Self {
        Self {
            adapters: 200,
            zipf: 1.1,
            duration_s: 7200.0,
            rate: 3.0,
            diurnal: 0.5,
            bursts: 4,
            burst_s: 600.0,
            burst_rate: 0.4,
            shift: true,
            mean_tokens: 128.0,
            seed: 37,
        }
    }
}

/// Poisson draw by inversion (the rates here are a few per second).
fn poisson(rng: &mut StdRng, lambda: f64) -> u32 {
    let mut k = 0;
    let mut p = (-lambda).exp();
    let mut s = p;
    let u: f64 = rng.random();
    while u > s && k < 10_000 {
        k += 1;
        p *= lambda / f64::from(k);
        s += p;
    }
    k
}

/// Generates a trace, sorted by arrival.
pub fn generate(spec: &TraceSpec) -> Vec<Request> {
    let mut rng = StdRng::seed_from_u64(spec.seed);
    let n = spec.adapters.max(1);
    let weights: Vec<f64> = (1..=n).map(|k| 1.0 / (k as f64).powf(spec.zipf)).collect();
    let total: f64 = weights.iter().sum();
    let mut cdf = Vec::with_capacity(n);
    let mut acc = 0.0;
    for w in &weights {
        acc += w / total;
        cdf.push(acc);
    }
    // rank → adapter; the second half swaps ranks 0-9 with 10-19.
    let first: Vec<u32> = (0..n as u32).collect();
    let mut second = first.clone();
    if spec.shift && n >= 20 {
        for r in 0..10 {
            second.swap(r, r + 10);
        }
    }
    let bursts: Vec<(f64, u32)> = (0..spec.bursts)
        .map(|_| {
            let start = rng.random::<f64>() * (spec.duration_s - spec.burst_s).max(0.0);
            let adapter = rng.random_range((n / 2).min(n - 1)..n) as u32;
            (start, adapter)
        })
        .collect();
    let mut out = Vec::new();
    let tokens = |rng: &mut StdRng| {
        let mean = (spec.mean_tokens - 32.0).max(1.0);
        let u: f64 = rng.random::<f64>().max(1e-12);
        (32.0 + (-u.ln() * mean).min(992.0)) as u32
    };
    let mut t = 0.0;
    while t < spec.duration_s {
        let phase = 2.0 * std::f64::consts::PI * t / spec.duration_s;
        let rate = spec.rate * (1.0 - spec.diurnal * phase.cos());
        let ranks = if t < spec.duration_s / 2.0 {
            &first
        } else {
            &second
        };
        for _ in 0..poisson(&mut rng, rate.max(0.0)) {
            let u: f64 = rng.random();
            let r = cdf.partition_point(|c| *c < u).min(n - 1);
            out.push(Request {
                at: t + rng.random::<f64>(),
                adapter: ranks[r],
                tokens: tokens(&mut rng),
            });
        }
        for &(start, adapter) in &bursts {
            if t >= start && t < start + spec.burst_s {
                for _ in 0..poisson(&mut rng, spec.burst_rate) {
                    out.push(Request {
                        at: t + rng.random::<f64>(),
                        adapter,
                        tokens: tokens(&mut rng),
                    });
                }
            }
        }
        t += 1.0;
    }
    out.sort_by(|a, b| a.at.total_cmp(&b.at));
    out
}

/// The trace as CSV: a header, then `at_s,adapter,tokens` per request (milliseconds kept).
pub fn to_csv(reqs: &[Request]) -> String {
    let mut s = String::from("at_s,adapter,tokens\n");
    for r in reqs {
        s.push_str(&format!("{:.3},{},{}\n", r.at, r.adapter, r.tokens));
    }
    s
}

/// Reads a CSV trace (`at_s,adapter,tokens`; a header line, blank lines and `#` comments are
/// skipped), sorted by arrival. The adapter is its index; a name `adapter-<n>` is read as `n`.
pub fn from_csv(text: &str) -> Result<Vec<Request>, SimError> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with("at_s") {
            continue;
        }
        let bad = |what: &str| SimError::Trace {
            line: i + 1,
            message: format!("{what} in {line:?}"),
        };
        let mut f = line.split(',').map(str::trim);
        let at: f64 = f
            .next()
            .and_then(|x| x.parse().ok())
            .filter(|x: &f64| x.is_finite() && *x >= 0.0)
            .ok_or_else(|| bad("a bad arrival time"))?;
        let adapter: u32 = f
            .next()
            .map(|x| x.trim_start_matches("adapter-"))
            .and_then(|x| x.parse().ok())
            .ok_or_else(|| bad("a bad adapter index"))?;
        let tokens: u32 = f
            .next()
            .and_then(|x| x.parse().ok())
            .filter(|x| *x > 0)
            .ok_or_else(|| bad("a bad token count"))?;
        out.push(Request {
            at,
            adapter,
            tokens,
        });
    }
    out.sort_by(|a, b| a.at.total_cmp(&b.at));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_generated_trace_has_its_rate_and_zipf_head_and_round_trips() {
        let spec = TraceSpec {
            duration_s: 3600.0,
            bursts: 0,
            shift: false,
            ..TraceSpec::default()
        };
        let t = generate(&spec);
        let rate = t.len() as f64 / spec.duration_s;
        assert!((rate - spec.rate).abs() < 0.1 * spec.rate, "{rate}");
        let top = t.iter().filter(|r| r.adapter == 0).count() as f64 / t.len() as f64;
        // Zipf(1.1) over 200: the first adapter's share is 1 / sum(k^-1.1) = 0.213.
        assert!((top - 0.213).abs() < 0.02, "{top}");
        let back = from_csv(&to_csv(&t)).unwrap();
        assert_eq!(back.len(), t.len());
        assert!(back.iter().zip(&t).all(|(a, b)| a.adapter == b.adapter
            && a.tokens == b.tokens
            && (a.at - b.at).abs() < 1e-3));
    }

    #[test]
    fn bad_lines_are_refused_with_their_number() {
        let e = from_csv("at_s,adapter,tokens\n1.0,3,10\n2.0,x,10\n").unwrap_err();
        assert_eq!(
            e.to_string(),
            "trace line 3: a bad adapter index in \"2.0,x,10\""
        );
        assert!(from_csv("1,adapter-2,5\n").is_ok());
        assert!(from_csv("-1,2,5\n").is_err());
        assert!(from_csv("1,2,0\n").is_err());
    }
}
