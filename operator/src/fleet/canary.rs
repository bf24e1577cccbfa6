//! Canary analysis: whether a canary version goes on, is promoted or is rolled back, from the
//! stable and canary versions' counts over the same interval (as Flagger and Argo Rollouts
//! analyse a canary: thresholds checked once enough requests were seen).
//!
//! The canary is rolled back when, over at least `min_requests` of its own requests, its error
//! rate is above the stable version's by more than `max_error_rate_increase` (absolute), or its
//! p95 latency is above `max_latency_ratio` times the stable version's. It passes when it has
//! served `promote_after` requests without either (ready for a promotion, which is an apply).
//! Until then it goes on.

/// Counts of one version over the analysis interval.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct VersionCounts {
    /// Requests completed.
    pub requests: u64,
    /// Requests that ended in an error.
    pub errors: u64,
    /// p95 latency (ms), when measured.
    pub p95_ms: Option<f64>,
}

impl VersionCounts {
    /// Errors per request (0 without requests).
    pub fn error_rate(&self) -> f64 {
        if self.requests == 0 {
            0.0
        } else {
            self.errors as f64 / self.requests as f64
        }
    }
}

/// The bounds a canary is held to.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bounds {
    /// Canary requests before any verdict.
    pub min_requests: u64,
    /// Canary requests after which a healthy canary is promoted (at least `min_requests`).
    pub promote_after: u64,
    /// Largest allowed excess of the canary's error rate over the stable one's (0.01: one
    /// point).
    pub max_error_rate_increase: f64,
    /// Largest allowed ratio of the canary's p95 latency to the stable one's.
    pub max_latency_ratio: f64,
}

/// The verdict.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// Not enough requests yet, or healthy and not yet `promote_after`.
    Continue(String),
    /// Healthy over `promote_after` requests: ready to be made the stable version.
    Promote(String),
    /// Worse than the stable version beyond a bound: send all traffic back.
    RollBack(String),
}

impl Verdict {
    /// Stable reason (Event, `status.canary.reason`): `CanaryProgressing`, `CanaryPassed`,
    /// `CanaryRolledBack`. (`CanaryPromoted` is the apply that makes it stable.)
    pub fn reason(&self) -> &'static str {
        match self {
            Verdict::Continue(_) => "CanaryProgressing",
            Verdict::Promote(_) => "CanaryPassed",
            Verdict::RollBack(_) => "CanaryRolledBack",
        }
    }

    /// The numbers behind it.
    pub fn note(&self) -> &str {
        match self {
            Verdict::Continue(n) | Verdict::Promote(n) | Verdict::RollBack(n) => n,
        }
    }
}

/// Analyses a canary. Pure.
pub fn analyse(bounds: &Bounds, stable: &VersionCounts, canary: &VersionCounts) -> Verdict {
    let numbers = format!(
        "canary {} requests, {:.2}% errors{}; stable {} requests, {:.2}% errors{}",
        canary.requests,
        100.0 * canary.error_rate(),
        canary
            .p95_ms
            .map(|p| format!(", p95 {p:.0} ms"))
            .unwrap_or_default(),
        stable.requests,
        100.0 * stable.error_rate(),
        stable
            .p95_ms
            .map(|p| format!(", p95 {p:.0} ms"))
            .unwrap_or_default(),
    );
    if canary.requests < bounds.min_requests {
        return Verdict::Continue(format!(
            "{numbers}; waiting for {} canary requests",
            bounds.min_requests
        ));
    }
    let excess = canary.error_rate() - stable.error_rate();
    if excess > bounds.max_error_rate_increase {
        return Verdict::RollBack(format!(
            "{numbers}: error rate {:.2} points above the stable version's, bound {:.2}",
            100.0 * excess,
            100.0 * bounds.max_error_rate_increase
        ));
    }
    if let (Some(c), Some(s)) = (canary.p95_ms, stable.p95_ms) {
        if s > 0.0 && c / s > bounds.max_latency_ratio {
            return Verdict::RollBack(format!(
                "{numbers}: p95 latency {:.2}x the stable version's, bound {:.2}x",
                c / s,
                bounds.max_latency_ratio
            ));
        }
    }
    if canary.requests >= bounds.promote_after.max(bounds.min_requests) {
        return Verdict::Promote(format!("{numbers}: within bounds"));
    }
    Verdict::Continue(format!(
        "{numbers}: within bounds, promoted after {} canary requests",
        bounds.promote_after
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bounds() -> Bounds {
        Bounds {
            min_requests: 100,
            promote_after: 500,
            max_error_rate_increase: 0.01,
            max_latency_ratio: 1.2,
        }
    }

    fn v(requests: u64, errors: u64, p95: f64) -> VersionCounts {
        VersionCounts {
            requests,
            errors,
            p95_ms: Some(p95),
        }
    }

    #[test]
    fn verdicts_by_table() {
        let b = bounds();
        let stable = v(5000, 50, 800.0); // 1% errors
        let cases: &[(VersionCounts, &str)] = &[
            // Too few requests for a verdict, however bad.
            (v(99, 99, 9000.0), "CanaryProgressing"),
            // 3% errors over 100: 2 points above the stable 1%, bound 1.
            (v(100, 3, 800.0), "CanaryRolledBack"),
            // 2% errors: exactly 1 point above: within the bound.
            (v(100, 2, 800.0), "CanaryProgressing"),
            // p95 1.25x the stable's: rolled back.
            (v(200, 0, 1000.0), "CanaryRolledBack"),
            // 1.2x exactly: within.
            (v(200, 0, 960.0), "CanaryProgressing"),
            // Healthy past promote_after.
            (v(500, 5, 700.0), "CanaryPassed"),
            // Errors late in its life still roll it back rather than promote it.
            (v(800, 30, 700.0), "CanaryRolledBack"),
        ];
        for (canary, want) in cases {
            let got = analyse(&b, &stable, canary);
            assert_eq!(got.reason(), *want, "{canary:?}: {}", got.note());
        }
    }

    #[test]
    fn latency_is_judged_only_when_both_versions_measured_it_and_notes_carry_numbers() {
        let b = bounds();
        let stable = VersionCounts {
            requests: 1000,
            errors: 0,
            p95_ms: None,
        };
        let canary = v(600, 0, 50_000.0);
        assert_eq!(analyse(&b, &stable, &canary).reason(), "CanaryPassed");
        let bad = analyse(&b, &v(1000, 10, 800.0), &v(100, 5, 800.0));
        assert_eq!(bad.reason(), "CanaryRolledBack");
        let n = bad.note();
        assert!(
            n.contains("canary 100 requests, 5.00% errors, p95 800 ms"),
            "{n}"
        );
        assert!(n.contains("stable 1000 requests, 1.00% errors"), "{n}");
        assert!(n.contains("4.00 points above"), "{n}");
    }
}
