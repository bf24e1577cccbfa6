//! Live traffic of an adapter: the pods' counters smoothed into rates (`status.traffic`,
//! written at a bounded rate), and, for an `auto` adapter of a pool with `merge.traffic`, the
//! fleet policy's decision (`status.fleet`, an Event when it promotes or demotes).
//!
//! The policy decides for the whole pool at once (its GPU budget is the pool's): the other
//! adapters' traffic and state are read from their statuses in the controller's store, this
//! adapter's from the reading just taken. Two adapters reconciled at the same moment may each
//! see the other's older state, so the budget can be passed by one promotion until the next
//! round corrects it.

use std::borrow::Borrow;
use std::collections::BTreeMap;
use std::sync::PoisonError;

use chrono::{DateTime, Utc};
use kube::ResourceExt;
use mole_crds::{
    Adapter, AdapterStatus, FleetStatus, InferencePool, InferencePoolSpec, LoraAdaptersResponse,
    ServingMode, TrafficStatus,
};

use crate::controller::context::Context;
use crate::fleet::merge::{self, Action, Decided, Decision};
use crate::fleet::traffic::{Counters, Rates, Smoother, WriteRule};
use crate::mergedown::PlannedEvent;

/// The status write rule of `pool`'s adapters.
pub(super) fn write_rule(pool: &InferencePoolSpec) -> WriteRule {
    WriteRule::for_window(window_secs(pool))
}

/// Smoothing window without `merge.traffic`.
const DEFAULT_WINDOW_SECS: i64 = 300;

/// This adapter's counters in one pod's report, summed over its versions; None when the pod
/// does not list it. A worker that counts no traffic still reports completed requests.
pub(super) fn counters_of(r: &LoraAdaptersResponse, name: &str) -> Option<Counters> {
    let listed: Vec<_> = r.data.iter().filter(|a| a.name == name).collect();
    let counted: Vec<_> = r.traffic.iter().filter(|c| c.name == name).collect();
    if listed.is_empty() && counted.is_empty() {
        return None;
    }
    let mut c = Counters {
        running: listed.iter().map(|a| a.running).sum(),
        ..Default::default()
    };
    if counted.is_empty() {
        c.requests = listed.iter().map(|a| a.requests).sum();
        return Some(c);
    }
    for x in counted {
        c.requests += x.requests;
        c.tokens += x.tokens;
        c.errors += x.errors;
        if c.latency.len() < x.latency_ms.len() {
            c.latency.resize(x.latency_ms.len(), 0);
        }
        for (a, b) in c.latency.iter_mut().zip(&x.latency_ms) {
            *a += b;
        }
    }
    Some(c)
}

/// Adds this adapter's counters in one pod's report to `into`, per version (what the canary
/// analysis compares). Versions a worker lists without counting traffic count their
/// completed requests.
pub(super) fn add_versions(
    into: &mut BTreeMap<String, Counters>,
    r: &LoraAdaptersResponse,
    name: &str,
) {
    let mut counted = false;
    for x in r.traffic.iter().filter(|c| c.name == name) {
        counted = true;
        let c = into.entry(x.version.clone()).or_default();
        c.requests += x.requests;
        c.tokens += x.tokens;
        c.errors += x.errors;
        if c.latency.len() < x.latency_ms.len() {
            c.latency.resize(x.latency_ms.len(), 0);
        }
        for (a, b) in c.latency.iter_mut().zip(&x.latency_ms) {
            *a += b;
        }
    }
    if !counted {
        for a in r.data.iter().filter(|a| a.name == name) {
            into.entry(a.version.clone()).or_default().requests += a.requests;
        }
    }
}

fn window_secs(pool: &InferencePoolSpec) -> i64 {
    pool.merge
        .traffic
        .as_ref()
        .map_or(DEFAULT_WINDOW_SECS, |t| t.window_seconds)
}

fn parse(t: Option<&str>) -> Option<DateTime<Utc>> {
    t.and_then(|t| DateTime::parse_from_rfc3339(t).ok())
        .map(|t| t.with_timezone(&Utc))
}

fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

/// The rates a status recorded (the smoothing's start after a restart).
fn recorded(t: &TrafficStatus) -> Rates {
    Rates {
        requests_per_min: t.requests_per_minute,
        tokens_per_min: t.tokens_per_minute,
        success_rate: t.success_rate,
        p50_ms: t.p50_ms,
        p95_ms: t.p95_ms,
        last_used: parse(t.last_used.as_deref()),
    }
}

/// Feeds this reading to the adapter's smoother (kept in `ctx`) and returns the new rates.
pub(super) fn smooth(
    ctx: &Context,
    adapter: &Adapter,
    pool: &InferencePool,
    counters: &BTreeMap<String, Counters>,
    now: DateTime<Utc>,
) -> Rates {
    let key = format!(
        "{}/{}",
        adapter.namespace().unwrap_or_default(),
        adapter.name_any()
    );
    let seed = adapter
        .status
        .as_ref()
        .and_then(|s| s.traffic.as_ref())
        .map(recorded)
        .unwrap_or_default();
    let mut all = ctx.traffic.lock().unwrap_or_else(PoisonError::into_inner);
    let s = all
        .entry(key)
        .or_insert_with(|| Smoother::new(window_secs(&pool.spec) as f64, seed));
    s.observe(now, counters).clone()
}

/// Forgets a deleted adapter's smoothing and its last fleet decision.
pub(super) fn forget(ctx: &Context, adapter: &Adapter) {
    let ns = adapter.namespace().unwrap_or_default();
    let key = format!("{ns}/{}", adapter.name_any());
    ctx.traffic
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .remove(&key);
    if let Some(pool) = ctx
        .fleet_decisions
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get_mut(&format!("{ns}/{}", adapter.spec.pool))
    {
        pool.remove(&adapter.name_any());
    }
}

/// [`decide_for`] against the pool's latest decisions, recording this one: one decision of a
/// pool at a time (under the record's lock), each seeing every decision made before it
/// whether or not the cache has seen the status it was written to.
pub(super) fn decide_recorded(
    ctx: &Context,
    adapter: &Adapter,
    pool: &InferencePool,
    siblings: &[impl Borrow<Adapter>],
    rates: &Rates,
    now: DateTime<Utc>,
) -> Option<Decision> {
    let key = format!(
        "{}/{}",
        adapter.namespace().unwrap_or_default(),
        adapter.spec.pool
    );
    let mut all = ctx
        .fleet_decisions
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    let decided = all.entry(key).or_default();
    let d = decide_for(adapter, pool, siblings, decided, rates, now)?;
    decided.insert(
        adapter.name_any(),
        Decided {
            state: d.state,
            tokens_per_min: rates.tokens_per_min,
            requests_per_min: rates.requests_per_min,
        },
    );
    Some(d)
}

/// Whether the adapter counts as idle for the pool's `merge.scaleToZero`: no request ran for
/// `idleSeconds`, counted from its last use or, never used since the operator started watching,
/// from when its active version started serving (so a fresh merge is not parked at once).
/// Always false without `merge.scaleToZero`. Pure.
pub fn idle(
    pool: &InferencePoolSpec,
    status: Option<&AdapterStatus>,
    rates: &Rates,
    now: DateTime<Utc>,
) -> bool {
    let Some(z) = &pool.merge.scale_to_zero else {
        return false;
    };
    let since = rates.last_used.or_else(|| {
        status
            .and_then(|s| s.history.first())
            .and_then(|r| parse(r.time.as_deref()))
    });
    since.is_some_and(|t| (now - t).num_seconds() >= z.idle_seconds)
}

/// The pool's merge policy for `auto` adapters, when it has `merge.traffic`.
pub fn policy_of(pool: &InferencePoolSpec) -> Option<merge::Policy> {
    let t = pool.merge.traffic.as_ref()?;
    Some(merge::Policy {
        promote_share: t.promote_share,
        demote_share: t.demote_share,
        window_secs: t.window_seconds,
        min_hold_secs: t.min_hold_seconds,
        budget_gpus: t.max_merged_gpus,
        min_accuracy: pool.merge.min_accuracy,
        capacity: t.capacity.as_ref().map(|c| merge::Capacity {
            merged_tokens_per_min: c.merged_tokens_per_second * 60.0,
            dynamic_ratio: c.dynamic_ratio,
            // The count the pool asks for (an autoscaled pool's floor: what it can rely on).
            dynamic_gpus: u32::try_from(
                pool.dynamic
                    .applied_replicas()
                    .unwrap_or_else(|| pool.dynamic.replica_range().0),
            )
            .unwrap_or(0)
            .saturating_mul(pool.gpu.count.max(1)),
        }),
    })
}

fn state_of(status: Option<&AdapterStatus>) -> merge::State {
    let Some(f) = status.and_then(|s| s.fleet.as_ref()) else {
        return merge::State::default();
    };
    merge::State {
        merged: f.merged,
        since: parse(f.since.as_deref()),
        above_since: parse(f.above_since.as_deref()),
        below_since: parse(f.below_since.as_deref()),
    }
}

fn tokens_of(status: Option<&AdapterStatus>) -> f64 {
    status
        .and_then(|s| s.traffic.as_ref())
        .map_or(0.0, |t| t.tokens_per_minute)
}

/// The fleet policy's decision for `adapter` (None unless it is `auto` in a pool with
/// `merge.traffic`), deciding its pool's `auto` adapters together: the others from `decided`
/// (the pool's latest decisions) where it has them, else from their statuses; this one with
/// `rates`. Pure.
pub fn decide_for(
    adapter: &Adapter,
    pool: &InferencePool,
    siblings: &[impl Borrow<Adapter>],
    decided: &BTreeMap<String, Decided>,
    rates: &Rates,
    now: DateTime<Utc>,
) -> Option<Decision> {
    if adapter.spec.serving.mode != ServingMode::Auto {
        return None;
    }
    let policy = policy_of(&pool.spec)?;
    let name = adapter.name_any();
    let per_gpu = pool.spec.gpu.count.max(1);
    let gpus = |a: &Adapter| (a.spec.serving.replicas.max(1) as u32) * per_gpu;
    let same_pool: Vec<&Adapter> = siblings
        .iter()
        .map(Borrow::<Adapter>::borrow)
        .filter(|a| a.spec.pool == adapter.spec.pool && a.name_any() != name)
        .collect();
    let tokens = |a: &Adapter| {
        decided
            .get(&a.name_any())
            .map_or_else(|| tokens_of(a.status.as_ref()), |d| d.tokens_per_min)
    };
    let pool_total = rates.tokens_per_min + same_pool.iter().map(|a| tokens(a)).sum::<f64>();
    let mut cands = vec![merge::Candidate {
        name: name.clone(),
        tokens_per_min: rates.tokens_per_min,
        requests_per_min: rates.requests_per_min,
        p95_ms: rates.p95_ms,
        gpus: gpus(adapter),
        accuracy: adapter.spec.evaluation.as_ref().and_then(|e| e.accuracy),
        state: decided
            .get(&name)
            .map_or_else(|| state_of(adapter.status.as_ref()), |d| d.state),
    }];
    cands.extend(
        same_pool
            .iter()
            .filter(|a| a.spec.serving.mode == ServingMode::Auto)
            .map(|a| {
                let t = a.status.as_ref().and_then(|s| s.traffic.as_ref());
                let d = decided.get(&a.name_any());
                merge::Candidate {
                    name: a.name_any(),
                    tokens_per_min: d.map_or_else(
                        || t.map_or(0.0, |t| t.tokens_per_minute),
                        |d| d.tokens_per_min,
                    ),
                    requests_per_min: d.map_or_else(
                        || t.map_or(0.0, |t| t.requests_per_minute),
                        |d| d.requests_per_min,
                    ),
                    p95_ms: t.and_then(|t| t.p95_ms),
                    gpus: gpus(a),
                    accuracy: a.spec.evaluation.as_ref().and_then(|e| e.accuracy),
                    state: d.map_or_else(|| state_of(a.status.as_ref()), |d| d.state),
                }
            }),
    );
    merge::decide(&policy, pool_total, &cands, now)
        .into_iter()
        .find(|d| d.name == name)
}

/// How soon an adapter whose serving follows its traffic must be looked at again, whatever
/// its status says: a canary under analysis every 10 s (a broken canary fails requests until
/// it is rolled back), an `auto` adapter of a traffic pool at the rate its rates are written
/// (a tenth of the window, 5 to 30 s), a merged adapter of a scale-to-zero pool at a sixth of
/// the idle time (10 to 60 s). None: the status's own requeue (60 s when nothing moves)
/// serves. Cheap since a round reads the pool's pods once for all its Adapters.
pub fn fleet_cadence(adapter: &Adapter, pool: &InferencePoolSpec) -> Option<std::time::Duration> {
    let secs = |s: i64| std::time::Duration::from_secs(s.max(1) as u64);
    let mut out: Option<std::time::Duration> = None;
    let mut take = |d: std::time::Duration| out = Some(out.map_or(d, |o| o.min(d)));
    if adapter
        .spec
        .canary
        .as_ref()
        .is_some_and(|c| c.weight > 0 && c.analysis.is_some())
    {
        take(secs(10));
    }
    if adapter.spec.serving.mode == ServingMode::Auto && pool.merge.traffic.is_some() {
        take(secs((window_secs(pool) / 10).clamp(5, 30)));
    }
    if let Some(z) = &pool.merge.scale_to_zero {
        if adapter.spec.serving.mode != ServingMode::Dynamic {
            take(secs((z.idle_seconds / 6).clamp(10, 60)));
        }
    }
    out
}

/// What one reconcile read of an adapter's traffic.
pub(super) struct Reading<'a> {
    /// The smoothed rates.
    pub rates: &'a Rates,
    /// The ready dynamic pods that hold it.
    pub holding: Vec<String>,
    /// Whether merged pods serve it.
    pub merged: bool,
}

/// Records the traffic and the decision in `next` (the status about to be written, `old` the
/// one read): the traffic only when [`WriteRule`] says it is due, the fleet state when the
/// decision changed it (or with the traffic), so a steady adapter costs no status write.
/// Returns the Event of a promotion or demotion.
pub(super) fn record(
    next: &mut AdapterStatus,
    old: Option<&AdapterStatus>,
    reading: Reading<'_>,
    decision: Option<&Decision>,
    rule: WriteRule,
    now: DateTime<Utc>,
) -> Option<PlannedEvent> {
    let Reading {
        rates,
        holding,
        merged,
    } = reading;
    let old_traffic = old.and_then(|s| s.traffic.as_ref());
    let age = old_traffic
        .and_then(|t| parse(t.updated_at.as_deref()))
        .map(|t| (now - t).num_seconds());
    let fresh = TrafficStatus {
        requests_per_minute: round(rates.requests_per_min),
        tokens_per_minute: round(rates.tokens_per_min),
        success_rate: rates
            .success_rate
            .map(|s| (s * 10_000.0).round() / 10_000.0),
        p50_ms: rates.p50_ms.map(f64::round),
        p95_ms: rates.p95_ms.map(f64::round),
        last_used: rates.last_used.map(rfc3339),
        pods: holding,
        merged,
        // To the millisecond: whole seconds made a write at .990 s a second old 10 ms later,
        // shortening the minimum interval by up to a second.
        updated_at: Some(now.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)),
    };
    let placement_changed = old_traffic.is_some_and(|t| t.pods != fresh.pods || t.merged != merged);
    let due = placement_changed || rule.due(old_traffic.map(recorded).as_ref(), rates, age);
    next.traffic = if due {
        Some(fresh)
    } else {
        old_traffic.cloned()
    };
    let Some(d) = decision else {
        next.fleet = None;
        return None;
    };
    let fleet = FleetStatus {
        merged: d.state.merged,
        since: d.state.since.map(rfc3339),
        above_since: d.state.above_since.map(rfc3339),
        below_since: d.state.below_since.map(rfc3339),
        share: (d.share * 10_000.0).round() / 10_000.0,
        reason: d.reason.to_string(),
        message: d.note.clone(),
    };
    let old_fleet = old.and_then(|s| s.fleet.as_ref());
    let changed = old_fleet.is_none_or(|f| {
        f.merged != fleet.merged
            || f.reason != fleet.reason
            || f.since != fleet.since
            || f.above_since != fleet.above_since
            || f.below_since != fleet.below_since
    });
    next.fleet = if changed || due {
        Some(fleet)
    } else {
        old_fleet.cloned()
    };
    match d.action {
        Action::Promote | Action::Demote => Some(PlannedEvent {
            warning: false,
            reason: d.reason,
            note: d.note.clone(),
        }),
        Action::Stay => None,
    }
}

fn round(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::{Duration, TimeZone};
    use serde_json::json;

    fn t(secs: i64) -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 11, 27, 12, 0, 0).unwrap() + Duration::seconds(secs)
    }

    fn pool() -> InferencePool {
        serde_json::from_value(json!({
            "apiVersion": "mole.dev/v1alpha1", "kind": "InferencePool",
            "metadata": {"name": "vl", "namespace": "ml"},
            "spec": {"baseModel": {"name": "b", "path": "b"}, "storage": {"claimName": "c"},
                     "gpu": {"count": 1},
                     "merge": {"traffic": {"promoteShare": 0.2, "demoteShare": 0.05,
                               "windowSeconds": 0, "minHoldSeconds": 0, "maxMergedGpus": 1}}}
        }))
        .unwrap()
    }

    fn adapter(name: &str, mode: &str, tpm: f64) -> Adapter {
        serde_json::from_value(json!({
            "apiVersion": "mole.dev/v1alpha1", "kind": "Adapter",
            "metadata": {"name": name, "namespace": "ml"},
            "spec": {"pool": "vl", "version": "v1", "source": {"path": name},
                     "serving": {"mode": mode}},
            "status": {"traffic": {"requestsPerMinute": tpm / 100.0, "tokensPerMinute": tpm, "merged": false}}
        }))
        .unwrap()
    }

    fn rates(tpm: f64) -> Rates {
        Rates {
            requests_per_min: tpm / 100.0,
            tokens_per_min: tpm,
            ..Default::default()
        }
    }

    /// Decisions that follow the traffic are looked at on their own cadence (found on the
    /// real control plane: a broken canary failed ~460 requests in the 60 s before its
    /// Adapter was looked at again, where 10 were enough to roll it back).
    #[test]
    fn adapters_whose_serving_follows_traffic_are_looked_at_sooner() {
        use std::time::Duration;
        let mut p = pool();
        p.spec.merge.traffic.as_mut().unwrap().window_seconds = 300;
        // auto in a traffic pool: a tenth of the window.
        assert_eq!(
            fleet_cadence(&adapter("a", "auto", 0.0), &p.spec),
            Some(Duration::from_secs(30))
        );
        assert_eq!(fleet_cadence(&adapter("d", "dynamic", 0.0), &p.spec), None);
        // A canary under analysis: 10 s, whatever else.
        let mut c = adapter("c", "auto", 0.0);
        c.spec.canary = Some(
            serde_json::from_value(json!({"version": "v2", "source": {"path": "c2"},
                "weight": 10, "analysis": {}}))
            .unwrap(),
        );
        assert_eq!(fleet_cadence(&c, &p.spec), Some(Duration::from_secs(10)));
        // Merged in a scale-to-zero pool: a sixth of the idle time, at least 10 s.
        p.spec.merge.traffic = None;
        p.spec.merge.scale_to_zero =
            Some(serde_json::from_value(json!({"idleSeconds": 60})).unwrap());
        assert_eq!(
            fleet_cadence(&adapter("m", "merged", 0.0), &p.spec),
            Some(Duration::from_secs(10))
        );
        assert_eq!(fleet_cadence(&adapter("d", "dynamic", 0.0), &p.spec), None);
    }

    #[test]
    fn idle_counts_from_the_last_use_or_the_active_version() {
        let mut p = pool();
        let used = |secs: Option<i64>| Rates {
            last_used: secs.map(t),
            ..Default::default()
        };
        assert!(
            !idle(&p.spec, None, &used(Some(0)), t(100_000)),
            "not asked"
        );
        p.spec.merge.scale_to_zero = Some(mole_crds::ScaleToZeroSpec { idle_seconds: 600 });
        assert!(!idle(&p.spec, None, &used(Some(0)), t(599)));
        assert!(idle(&p.spec, None, &used(Some(0)), t(600)));
        // Never used: from when the active version started serving; unknown: not idle.
        let status: AdapterStatus = serde_json::from_value(json!({
            "history": [{"version": "v1", "source": "a", "time": "2026-11-27T12:00:00Z"}]
        }))
        .unwrap();
        assert!(!idle(&p.spec, Some(&status), &used(None), t(300)));
        assert!(idle(&p.spec, Some(&status), &used(None), t(900)));
        assert!(!idle(&p.spec, None, &used(None), t(100_000)));
    }

    #[test]
    fn counters_sum_versions_and_fall_back_to_request_counts() {
        let r: LoraAdaptersResponse = serde_json::from_value(json!({
            "object": "list", "base_model": "b",
            "data": [{"name": "cal", "version": "v1", "lora_id": 1, "residency": "gpu", "loaded": true,
                      "rank": 8, "bytes": 1, "requests": 7, "running": 2}],
            "traffic": [
                {"name": "cal", "version": "v1", "requests": 5, "tokens": 500, "errors": 1, "latency_ms": [1, 4]},
                {"name": "cal", "version": "v2", "requests": 2, "tokens": 50, "errors": 0, "latency_ms": [2, 0]},
                {"name": "other", "version": "v1", "requests": 9, "tokens": 9, "errors": 0}
            ]
        }))
        .unwrap();
        let c = counters_of(&r, "cal").unwrap();
        assert_eq!((c.requests, c.tokens, c.errors, c.running), (7, 550, 1, 2));
        assert_eq!(c.latency, vec![3, 4]);
        assert!(counters_of(&r, "nobody").is_none());
        let mut old = r.clone();
        old.traffic.clear();
        let c = counters_of(&old, "cal").unwrap();
        assert_eq!((c.requests, c.tokens), (7, 0));
    }

    #[test]
    fn only_auto_adapters_of_a_traffic_pool_are_decided_with_the_pool_and_the_budget() {
        let p = pool();
        let me = adapter("hot", "auto", 0.0);
        let others = vec![
            me.clone(),
            adapter("warm", "auto", 400.0),
            adapter("pinned", "dynamic", 500.0),
        ];
        let none = BTreeMap::new();
        // 600 of 1500 tokens/min: 40%, above 20% with a zero window: promoted.
        let d = decide_for(&me, &p, &others, &none, &rates(600.0), t(0)).unwrap();
        assert_eq!(
            (d.action, d.reason),
            (Action::Promote, merge::reason::TRAFFIC_PROMOTED)
        );
        assert!((d.share - 0.4).abs() < 1e-9);
        // The budget (1 GPU) went to the more valuable one.
        let d = decide_for(&me, &p, &others, &none, &rates(300.0), t(0)).unwrap();
        assert_eq!(d.reason, merge::reason::BUDGET_EXHAUSTED, "{}", d.note);
        assert!(decide_for(
            &adapter("x", "dynamic", 0.0),
            &p,
            &others,
            &none,
            &rates(900.0),
            t(0)
        )
        .is_none());
        let mut plain = p.clone();
        plain.spec.merge.traffic = None;
        assert!(decide_for(&me, &plain, &others, &none, &rates(900.0), t(0)).is_none());
        // A sibling decided merged a moment ago (its status not seen yet) holds the budget:
        // the record wins over the status.
        let mut decided = BTreeMap::new();
        decided.insert(
            "warm".to_string(),
            Decided {
                state: merge::State {
                    merged: true,
                    since: Some(t(0)),
                    ..Default::default()
                },
                tokens_per_min: 700.0,
                requests_per_min: 7.0,
            },
        );
        let d = decide_for(&me, &p, &others, &decided, &rates(600.0), t(0)).unwrap();
        assert_eq!(d.reason, merge::reason::BUDGET_EXHAUSTED, "{}", d.note);
    }

    #[test]
    fn traffic_is_written_at_a_bounded_rate_and_a_decision_makes_an_event() {
        let mut next = AdapterStatus::default();
        let ev = record(
            &mut next,
            None,
            Reading {
                rates: &rates(600.0),
                holding: vec!["p1".into()],
                merged: false,
            },
            None,
            WriteRule::default(),
            t(0),
        );
        assert!(ev.is_none());
        let first = next.traffic.clone().unwrap();
        assert_eq!(first.tokens_per_minute, 600.0);
        assert_eq!(first.pods, vec!["p1".to_string()]);
        // 10 s later, doubled: too soon, the old figures stay (no write).
        let old = next.clone();
        let mut again = AdapterStatus::default();
        record(
            &mut again,
            Some(&old),
            Reading {
                rates: &rates(1200.0),
                holding: vec!["p1".into()],
                merged: false,
            },
            None,
            WriteRule::default(),
            t(10),
        );
        assert_eq!(again.traffic, Some(first.clone()));
        // The pods holding it changed: written at once.
        record(
            &mut again,
            Some(&old),
            Reading {
                rates: &rates(1200.0),
                holding: vec!["p1".into(), "p2".into()],
                merged: false,
            },
            None,
            WriteRule::default(),
            t(10),
        );
        assert_eq!(again.traffic.unwrap().tokens_per_minute, 1200.0);
        // A promotion: an Event with the numbers and the state recorded.
        let p = pool();
        let me = adapter("hot", "auto", 0.0);
        let d = decide_for(
            &me,
            &p,
            std::slice::from_ref(&me),
            &BTreeMap::new(),
            &rates(600.0),
            t(40),
        )
        .unwrap();
        let mut next = AdapterStatus::default();
        let ev = record(
            &mut next,
            Some(&old),
            Reading {
                rates: &rates(600.0),
                holding: vec![],
                merged: false,
            },
            Some(&d),
            WriteRule::default(),
            t(40),
        )
        .unwrap();
        assert_eq!(ev.reason, "TrafficPromoted");
        assert!(
            ev.note.contains("100.0% of the pool's 600 tokens/min"),
            "{}",
            ev.note
        );
        let f = next.fleet.unwrap();
        assert!(f.merged);
        assert_eq!(f.since.as_deref(), Some("2026-11-27T12:00:40Z"));
    }

    /// A write is never due sooner than the minimum interval, at whatever fraction of a
    /// second the last one happened: a status written at .990 s is not a second old 10 ms
    /// later (its stamp held whole seconds, so it was, and the traffic was written again).
    #[test]
    fn the_minimum_interval_counts_from_the_write_not_its_whole_second() {
        let rule = WriteRule::for_window(10);
        let at = t(0) + Duration::milliseconds(990);
        let (low, high) = (rates(600.0), rates(1200.0));
        let reading = |rates| Reading {
            rates,
            holding: vec!["p1".into()],
            merged: false,
        };
        let mut first = AdapterStatus::default();
        record(&mut first, None, reading(&low), None, rule, at);
        let mut again = AdapterStatus::default();
        let soon = at + Duration::milliseconds(10);
        record(&mut again, Some(&first), reading(&high), None, rule, soon);
        assert_eq!(again.traffic, first.traffic, "written again 10 ms later");
        let later = at + Duration::milliseconds(1000);
        record(&mut again, Some(&first), reading(&high), None, rule, later);
        assert_eq!(
            again.traffic.unwrap().tokens_per_minute,
            1200.0,
            "due a second later"
        );
    }
}
