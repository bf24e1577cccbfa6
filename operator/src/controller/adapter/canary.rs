//! The canary of an adapter (`spec.canary`, `status.canary`): its counts per version read from
//! the pods, the analysis against the stable version (`crate::fleet::canary`), and the Events
//! of its life: started, passed, rolled back by the analysis, promoted or removed by an apply.
//!
//! A rollback by the analysis is recorded in the status (phase `RolledBack`, weight 0), not in
//! the spec, which is the user's: the pool's WorkerConfig leaves out a canary whose version the
//! status records as rolled back, so the pods unload it, and it stays out until `spec.canary`
//! names another version or is dropped. Pure: the controller passes the reading and the time.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};

use mole_crds::{AdapterSpec, CanaryPhase, CanaryStatus, VersionTraffic, WorkerCanary};

use crate::fleet::canary::{analyse, Bounds, Verdict, VersionCounts};
use crate::fleet::traffic::{percentile, Counters, WriteRule};
use crate::mergedown::PlannedEvent;
use crate::reasons;

/// What the pool's pods should serve of `spec`'s canary, given the canary state `status`
/// records: nothing at weight 0 or once the analysis rolled this version back.
pub fn worker_canary(spec: &AdapterSpec, status: Option<&CanaryStatus>) -> Option<WorkerCanary> {
    let c = spec.canary.as_ref().filter(|c| c.weight > 0)?;
    let rolled_back =
        status.is_some_and(|s| s.version == c.version && s.phase == CanaryPhase::RolledBack);
    (!rolled_back).then(|| WorkerCanary {
        version: c.version.clone(),
        path: c.source.path.clone(),
        weight: c.weight,
    })
}

/// One version's counts over the pods, for the analysis and the status.
fn counts(version: &str, c: Option<&Counters>) -> (VersionCounts, VersionTraffic) {
    let c = c.cloned().unwrap_or_default();
    let hist: Vec<f64> = c.latency.iter().map(|n| *n as f64).collect();
    let p95 = percentile(&hist, 0.95).map(f64::round);
    (
        VersionCounts {
            requests: c.requests,
            errors: c.errors,
            p95_ms: p95,
        },
        VersionTraffic {
            version: version.to_string(),
            requests: c.requests,
            errors: c.errors,
            p95_ms: p95,
        },
    )
}

/// The next `status.canary` of an adapter with `spec`, the last one `old`, and the
/// adapter's counters per version summed over the pods (`versions`); with the Event of a
/// change: `CanaryStarted`, `CanaryPassed`, `CanaryRolledBack` (a Warning, with the numbers),
/// or, once `spec.canary` is dropped, `CanaryPromoted` (its version became `spec.version`) or
/// `CanaryRemoved`.
pub fn step(
    spec: &AdapterSpec,
    old: Option<&CanaryStatus>,
    versions: &BTreeMap<String, Counters>,
    now: &str,
) -> (Option<CanaryStatus>, Option<PlannedEvent>) {
    let Some(c) = &spec.canary else {
        let ev = old.map(|o| {
            if o.version == spec.version {
                PlannedEvent {
                    warning: false,
                    reason: reasons::CANARY_PROMOTED,
                    note: format!(
                        "version {} promoted by apply: it serves all requests",
                        o.version
                    ),
                }
            } else {
                PlannedEvent {
                    warning: false,
                    reason: reasons::CANARY_REMOVED,
                    note: format!(
                        "canary {} removed by apply: version {} serves all requests",
                        o.version, spec.version
                    ),
                }
            }
        });
        return (None, ev);
    };
    let same = old.filter(|o| o.version == c.version);
    if let Some(o) = same.filter(|o| o.phase == CanaryPhase::RolledBack) {
        // Rolled back for good: its pods unloaded it, so its counts are gone; keep the ones
        // that decided.
        return (Some(o.clone()), None);
    }
    let (stable_n, stable_t) = counts(&spec.version, versions.get(&spec.version));
    let (canary_n, canary_t) = counts(&c.version, versions.get(&c.version));
    let verdict = c.analysis.as_ref().map(|a| {
        analyse(
            &Bounds {
                min_requests: a.min_requests,
                promote_after: a.min_requests,
                max_error_rate_increase: a.max_error_rate_increase,
                max_latency_ratio: a.max_latency_ratio,
            },
            &stable_n,
            &canary_n,
        )
    });
    let (phase, reason, message) = match &verdict {
        Some(Verdict::RollBack(n)) => (
            CanaryPhase::RolledBack,
            reasons::CANARY_ROLLED_BACK,
            n.clone(),
        ),
        Some(Verdict::Promote(n)) => (CanaryPhase::Passed, reasons::CANARY_PASSED, n.clone()),
        Some(Verdict::Continue(n)) => (
            CanaryPhase::Progressing,
            reasons::CANARY_PROGRESSING,
            n.clone(),
        ),
        None => (
            CanaryPhase::Progressing,
            reasons::CANARY_PROGRESSING,
            format!(
                "no analysis: promote or roll back by an apply; canary {} requests, {} errors; \
                 stable {} requests, {} errors",
                canary_n.requests, canary_n.errors, stable_n.requests, stable_n.errors
            ),
        ),
    };
    let next = CanaryStatus {
        updated_at: None,
        version: c.version.clone(),
        weight: if phase == CanaryPhase::RolledBack {
            0
        } else {
            c.weight
        },
        phase,
        reason: reason.to_string(),
        message: message.clone(),
        stable: stable_t,
        canary: canary_t,
        since: same
            .and_then(|o| o.since.clone())
            .or_else(|| Some(now.to_string())),
    };
    let ev = match (phase, same.map(|o| o.phase)) {
        (CanaryPhase::RolledBack, _) => Some(PlannedEvent {
            warning: true,
            reason: reasons::CANARY_ROLLED_BACK,
            note: format!(
                "canary {} rolled back, all requests to {}: {message}",
                c.version, spec.version
            ),
        }),
        (CanaryPhase::Passed, Some(CanaryPhase::Passed)) => None,
        (CanaryPhase::Passed, _) => Some(PlannedEvent {
            warning: false,
            reason: reasons::CANARY_PASSED,
            note: format!(
                "canary {} within bounds ({message}); promote it by applying spec.version {} \
                 with its source",
                c.version, c.version
            ),
        }),
        (_, None) => Some(PlannedEvent {
            warning: false,
            reason: reasons::CANARY_STARTED,
            note: format!(
                "canary {} takes {}% of the requests beside {}",
                c.version, c.weight, spec.version
            ),
        }),
        _ => None,
    };
    (Some(next), ev)
}

/// `next` as the status should record it, after `old` (written at `old.updatedAt`): a change
/// of version, phase, weight or reason is written at once; counts alone (every request moves
/// them) wait for `rule` as `status.traffic` does (`min_interval_secs` since the last write,
/// then a relative change of either version's requests beyond `rel_change`, a new error, or
/// `max_interval_secs`), so 500 adapters with canaries under load do not write their statuses
/// on every reconcile. A written status carries `updatedAt: now`. Pure.
pub fn throttle(
    old: Option<&CanaryStatus>,
    next: Option<CanaryStatus>,
    rule: &WriteRule,
    now: DateTime<Utc>,
) -> Option<CanaryStatus> {
    let mut next = next?;
    let stamp = |mut s: CanaryStatus| {
        // To the millisecond, as the traffic's stamp: whole seconds shortened the minimum
        // interval by up to a second.
        s.updated_at = Some(now.to_rfc3339_opts(chrono::SecondsFormat::Millis, true));
        Some(s)
    };
    let Some(o) = old else {
        return stamp(next);
    };
    let same_state = o.version == next.version
        && o.phase == next.phase
        && o.weight == next.weight
        && o.reason == next.reason;
    let age = o
        .updated_at
        .as_deref()
        .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
        .map(|t| (now - t.with_timezone(&Utc)).num_seconds());
    let Some(age) = age.filter(|_| same_state) else {
        return stamp(next);
    };
    next.updated_at.clone_from(&o.updated_at);
    if next == *o || age < rule.min_interval_secs {
        return Some(o.clone());
    }
    let moved = |a: u64, b: u64| (a.abs_diff(b) as f64) > rule.rel_change * (a.max(10) as f64);
    let due = age >= rule.max_interval_secs
        || moved(o.stable.requests, next.stable.requests)
        || moved(o.canary.requests, next.canary.requests)
        || o.stable.errors != next.stable.errors
        || o.canary.errors != next.canary.errors;
    if due {
        stamp(next)
    } else {
        Some(o.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(canary: serde_json::Value) -> AdapterSpec {
        let mut s = json!({"pool": "vl", "version": "v1", "source": {"path": "a/v1"}});
        if !canary.is_null() {
            s["canary"] = canary;
        }
        serde_json::from_value(s).unwrap()
    }

    fn analysed() -> serde_json::Value {
        json!({"version": "v2", "source": {"path": "a/v2"}, "weight": 10,
               "analysis": {"minRequests": 100, "maxErrorRateIncrease": 0.05, "maxLatencyRatio": 2.0}})
    }

    fn c(requests: u64, errors: u64) -> Counters {
        Counters {
            requests,
            errors,
            ..Default::default()
        }
    }

    fn read(stable: Counters, canary: Counters) -> BTreeMap<String, Counters> {
        BTreeMap::from([("v1".to_string(), stable), ("v2".to_string(), canary)])
    }

    #[test]
    fn a_canary_starts_passes_and_is_rolled_back_with_its_numbers() {
        let s = spec(analysed());
        // Table: (stable, canary) counts → phase, weight to the pods, Event.
        let cases: &[(Counters, Counters, CanaryPhase, Option<&str>)] = &[
            // Too few requests, however bad.
            (
                c(1000, 0),
                c(99, 99),
                CanaryPhase::Progressing,
                Some("CanaryStarted"),
            ),
            // 4 points above stable at 100 requests: within 5.
            (
                c(1000, 10),
                c(100, 5),
                CanaryPhase::Passed,
                Some("CanaryPassed"),
            ),
            // 6 points above: rolled back.
            (
                c(1000, 10),
                c(100, 7),
                CanaryPhase::RolledBack,
                Some("CanaryRolledBack"),
            ),
        ];
        for (stable, canary, phase, event) in cases {
            let (st, ev) = step(&s, None, &read(stable.clone(), canary.clone()), "t0");
            let st = st.unwrap();
            assert_eq!(st.phase, *phase, "{}", st.message);
            assert_eq!(ev.as_ref().map(|e| e.reason), *event);
            assert_eq!(
                st.weight,
                if *phase == CanaryPhase::RolledBack {
                    0
                } else {
                    10
                }
            );
            assert_eq!(
                (st.stable.requests, st.canary.requests),
                (stable.requests, canary.requests)
            );
        }
        // The rollback's Event is a Warning with the numbers.
        let (st, ev) = step(&s, None, &read(c(1000, 10), c(100, 7)), "t0");
        let ev = ev.unwrap();
        assert!(ev.warning);
        assert!(
            ev.note.contains("canary 100 requests, 7.00% errors"),
            "{}",
            ev.note
        );
        assert!(ev.note.contains("6.00 points above"), "{}", ev.note);
        // Rolled back stays rolled back (the pods unloaded it): no new Event, no traffic, even
        // when the counts look fine now.
        let st = st.unwrap();
        let (again, ev) = step(&s, Some(&st), &read(c(2000, 0), c(0, 0)), "t1");
        assert_eq!(again.as_ref(), Some(&st));
        assert!(ev.is_none());
        assert_eq!(worker_canary(&s, Some(&st)), None);
        // Another version is a new canary.
        let mut v3 = analysed();
        v3["version"] = json!("v3");
        v3["source"]["path"] = json!("a/v3");
        let s3 = spec(v3);
        assert_eq!(worker_canary(&s3, Some(&st)).unwrap().version, "v3");
        let (st3, ev) = step(&s3, Some(&st), &read(c(2000, 0), c(0, 0)), "t2");
        assert_eq!(st3.unwrap().since.as_deref(), Some("t2"));
        assert_eq!(ev.unwrap().reason, "CanaryStarted");
    }

    #[test]
    fn passing_is_announced_once_and_applies_end_it() {
        let s = spec(analysed());
        let (st, _) = step(&s, None, &read(c(1000, 0), c(10, 0)), "t0");
        let (st, ev) = step(&s, st.as_ref(), &read(c(1000, 0), c(150, 0)), "t1");
        assert_eq!(ev.unwrap().reason, "CanaryPassed");
        let (st, ev) = step(&s, st.as_ref(), &read(c(1000, 0), c(300, 0)), "t2");
        assert!(ev.is_none());
        let st = st.unwrap();
        assert_eq!(st.since.as_deref(), Some("t0"));
        assert_eq!(worker_canary(&s, Some(&st)).unwrap().weight, 10);
        // Without analysis it only progresses.
        let mut plain = analysed();
        plain.as_object_mut().unwrap().remove("analysis");
        let (p, _) = step(&spec(plain), None, &read(c(10, 0), c(10, 10)), "t0");
        assert_eq!(p.unwrap().phase, CanaryPhase::Progressing);
        // Weight 0: nothing to the pods.
        let mut zero = analysed();
        zero["weight"] = json!(0);
        assert_eq!(worker_canary(&spec(zero), None), None);
        // Dropped from the spec: promoted when its version became the stable one, else removed.
        let mut promoted = spec(serde_json::Value::Null);
        promoted.version = "v2".into();
        let (none, ev) = step(&promoted, Some(&st), &BTreeMap::new(), "t3");
        assert!(none.is_none());
        assert_eq!(ev.unwrap().reason, "CanaryPromoted");
        let (_, ev) = step(
            &spec(serde_json::Value::Null),
            Some(&st),
            &BTreeMap::new(),
            "t3",
        );
        assert_eq!(ev.unwrap().reason, "CanaryRemoved");
        assert!(
            step(&spec(serde_json::Value::Null), None, &BTreeMap::new(), "t3")
                .1
                .is_none()
        );
    }

    #[test]
    fn counts_alone_are_written_at_the_traffic_rate_and_a_verdict_at_once() {
        use chrono::TimeZone;
        let t = |secs: i64| {
            Utc.with_ymd_and_hms(2026, 11, 27, 12, 0, 0).unwrap() + chrono::Duration::seconds(secs)
        };
        let rule = WriteRule::for_window(300);
        assert_eq!((rule.min_interval_secs, rule.max_interval_secs), (30, 600));
        let s = spec(analysed());
        let at = |stable: Counters, canary: Counters, old: Option<&CanaryStatus>, secs: i64| {
            let (next, _) = step(&s, old, &read(stable, canary), "t0");
            throttle(old, next, &rule, t(secs))
        };
        let first = at(c(100, 0), c(10, 0), None, 0).unwrap();
        assert_eq!(
            first.updated_at.as_deref(),
            Some("2026-11-27T12:00:00.000Z")
        );
        // Written at .990 s, not due 10 ms later (a whole-second stamp made it a second old).
        let late = t(0) + chrono::Duration::milliseconds(990);
        let short = WriteRule::for_window(10);
        let (next, _) = step(&s, None, &read(c(100, 0), c(10, 0)), "t0");
        let w = throttle(None, next, &short, late).unwrap();
        let (next, _) = step(&s, Some(&w), &read(c(200, 0), c(30, 0)), "t0");
        let soon = throttle(
            Some(&w),
            next,
            &short,
            late + chrono::Duration::milliseconds(10),
        );
        assert_eq!(soon.as_ref(), Some(&w), "written again 10 ms later");
        // Table: (stable, canary, seconds since the first write) → rewritten?
        let cases: &[(Counters, Counters, i64, bool, &str)] = &[
            (c(100, 0), c(10, 0), 5, false, "nothing moved"),
            (c(200, 0), c(30, 0), 5, false, "moved, but too soon"),
            (c(200, 0), c(30, 0), 30, true, "moved beyond 20% after 30 s"),
            (
                c(110, 0),
                c(11, 0),
                300,
                false,
                "10% after 5 min: not worth it",
            ),
            (c(110, 0), c(11, 0), 600, true, "heartbeat"),
            (c(101, 1), c(10, 0), 30, true, "a new error"),
            (c(100, 1), c(10, 0), 5, false, "a new error, too soon"),
            (c(1000, 10), c(100, 7), 1, true, "rolled back: at once"),
            (c(1000, 0), c(150, 0), 1, true, "passed: at once"),
        ];
        for (stable, canary, secs, written, why) in cases {
            let got = at(stable.clone(), canary.clone(), Some(&first), *secs).unwrap();
            assert_eq!(got != first, *written, "{why}: {got:?}");
            if *written {
                assert_eq!(
                    got.updated_at,
                    Some(t(*secs).to_rfc3339_opts(chrono::SecondsFormat::Millis, true)),
                    "{why}"
                );
                assert_eq!(got.canary.requests, canary.requests, "{why}");
            }
        }
        // One adapter reconciled every 5 s for 10 minutes with requests flowing (its canary
        // passes at 100 requests, on the way): written about once per 30 s, not 120 times. At
        // 500 such adapters: under 20 status writes a second instead of 100.
        let mut writes = 0;
        let mut last = first.clone();
        for k in 1..=120i64 {
            let n = 10 + k as u64;
            let next = at(c(100 + 10 * n, 0), c(n, 0), Some(&last), 5 * k).unwrap();
            if next != last {
                writes += 1;
                last = next;
            }
        }
        assert!(writes <= 22, "{writes} writes in 10 minutes");
        assert!(writes >= 2, "{writes}: the counts still move");
        // No canary: nothing.
        assert_eq!(throttle(Some(&first), None, &rule, t(1)), None);
    }
}
