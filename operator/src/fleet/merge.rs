//! Traffic-driven merge-down: which `auto` adapters get their own merged Deployment.
//!
//! An adapter is promoted when its share of the pool's generated tokens has stayed at or
//! above `promote_share` for `window_secs`, and demoted when it has stayed below the lower
//! `demote_share` for as long (hysteresis: between the two nothing changes). No adapter
//! changes again within `min_hold_secs` of its last change. Merged Deployments share a budget
//! of GPUs, spent on the most valuable adapters first: value is tokens per minute per GPU (the
//! work taken off the dynamic pods, where every distinct adapter in a batch costs), and an
//! adapter already merged counts [`INCUMBENT_MARGIN`] times its value, so two adapters of
//! about the same traffic do not take turns. The accuracy gate, when the pool sets one, is
//! checked before anything else: a merged adapter whose accuracy fell below it is demoted
//! even within its hold time.
//!
//! With the pool's [`Capacity`] (what a merged GPU serves, and a dynamic adapter's rate
//! against it), a share is not enough: merging must earn its GPUs. An adapter of `T`
//! tokens/min occupies `T / (r × M)` GPUs of dynamic capacity (`M` tokens/min a merged GPU
//! serves, `r` a dynamic adapter's rate ÷ merged); its merged Deployment takes `g` GPUs off the
//! dynamic pods. It is promoted only while it occupies at least [`EARN_PROMOTE`] × `g`, and
//! demoted once it has stayed under [`EARN_DEMOTE`] × `g` for the window: below that, the
//! dynamic pods would lose more capacity than the merged pod takes off them. Nor is it
//! promoted when its traffic would fill more than [`MERGED_TARGET`] of its merged pods (they
//! serve all of it, peaks included), or when the dynamic pods left would be over
//! [`HEADROOM`] while its merged pod starts.

use chrono::{DateTime, Duration, Utc};

/// How much more an adapter that is not merged must be worth than one that is (past its hold
/// time) to take its GPUs: 25%, so noise in the measured rates does not swap them back and
/// forth.
pub const INCUMBENT_MARGIN: f64 = 1.25;

/// The occupancy (dynamic GPUs taken ÷ merged GPUs given) at or above which merging earns its
/// GPUs: 50% over break-even, for the drain and restart a change costs. Chosen on the
/// simulator (docs/operator.md, the fleet simulator): at 1.2 the policy merged at a dynamic ÷
/// merged ratio of 0.4 and lost 44% of p99 wait to placement alone; at 1.5 it does not.
pub const EARN_PROMOTE: f64 = 1.5;
/// The occupancy below which a merged adapter no longer earns its GPUs (hysteresis with
/// [`EARN_PROMOTE`]).
pub const EARN_DEMOTE: f64 = 0.8;

/// The share of its merged pods' capacity an adapter's traffic may fill at promotion: the
/// merged pods serve every request of the adapter (the gateway does not spill to the dynamic
/// pods), so traffic that would fill them queues at every peak.
pub const MERGED_TARGET: f64 = 0.7;

/// The share of the remaining dynamic pods' capacity the dynamic traffic may fill during a
/// promotion: the promoted adapter stays on the dynamic pods until its merged pod is ready,
/// while the GPU it takes is already gone from them (drained, restarted merged).
pub const HEADROOM: f64 = 0.85;

/// What the pool's pods serve, for the earn check.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Capacity {
    /// Tokens per minute one merged GPU generates at the pool's batch size.
    pub merged_tokens_per_min: f64,
    /// One dynamic adapter's rate ÷ merged at that batch size, in (0, 1.5].
    pub dynamic_ratio: f64,
    /// Dynamic pods (GPUs) serving now: a promotion takes its GPUs from them.
    pub dynamic_gpus: u32,
}

impl Capacity {
    /// GPUs of dynamic capacity `tokens_per_min` occupies.
    pub fn dynamic_gpus(&self, tokens_per_min: f64) -> f64 {
        tokens_per_min / (self.dynamic_ratio * self.merged_tokens_per_min).max(f64::MIN_POSITIVE)
    }
}

/// The pool's merge policy.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    /// Share of the pool's tokens at or above which an adapter is promoted, in (0, 1].
    pub promote_share: f64,
    /// Share below which a merged adapter is demoted (less than `promote_share`).
    pub demote_share: f64,
    /// How long a share must stay above (below) its threshold before a promotion (demotion).
    pub window_secs: i64,
    /// Shortest time between two changes of one adapter.
    pub min_hold_secs: i64,
    /// GPUs all merged Deployments of the pool may take together.
    pub budget_gpus: u32,
    /// The pool's `merge.minAccuracy`.
    pub min_accuracy: Option<f64>,
    /// What the pods serve (`merge.traffic.capacity`): with it, merging must earn its GPUs.
    pub capacity: Option<Capacity>,
}

/// Where an adapter stands, as its status records it between reconciles.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct State {
    /// Whether it is (to be) served by its own merged Deployment.
    pub merged: bool,
    /// When it last changed between merged and dynamic.
    pub since: Option<DateTime<Utc>>,
    /// Since when its share has stayed at or above the promotion threshold.
    pub above_since: Option<DateTime<Utc>>,
    /// Since when its share has stayed below the demotion threshold.
    pub below_since: Option<DateTime<Utc>>,
}

/// One `auto` adapter of the pool.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    /// Adapter name.
    pub name: String,
    /// Smoothed generated tokens per minute.
    pub tokens_per_min: f64,
    /// Smoothed requests per minute.
    pub requests_per_min: f64,
    /// Smoothed p95 latency, when known.
    pub p95_ms: Option<f64>,
    /// GPUs its merged Deployment takes (replicas × the pool's GPUs per pod).
    pub gpus: u32,
    /// `spec.evaluation.accuracy`.
    pub accuracy: Option<f64>,
    /// Its state before this decision.
    pub state: State,
}

/// What happens to an adapter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Give it a merged Deployment (the dynamic pods keep it until that is ready).
    Promote,
    /// Back to the dynamic pods (the merged Deployment goes once they hold it).
    Demote,
    /// No change.
    Stay,
}

/// A decision, with the numbers that caused it.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// Adapter name.
    pub name: String,
    /// What happens.
    pub action: Action,
    /// Stable reason (an Event reason when the action is a change): `TrafficPromoted`,
    /// `TrafficDemoted`, `BudgetDemoted`, `GateDemoted`; when it stays: `Merged`, `Dynamic`,
    /// `BudgetExhausted`, `MergeGated`, `HoldTime`, `Rising`, `Falling`.
    pub reason: &'static str,
    /// The state to record.
    pub state: State,
    /// Its share of the pool's tokens.
    pub share: f64,
    /// Human text with the numbers.
    pub note: String,
}

impl Decision {
    /// Whether it is to be served merged after this decision.
    pub fn merged(&self) -> bool {
        self.state.merged
    }
}

/// Stable decision reasons.
pub mod reason {
    /// Promoted: share above the threshold for the window.
    pub const TRAFFIC_PROMOTED: &str = "TrafficPromoted";
    /// Demoted: share below the lower threshold for the window.
    pub const TRAFFIC_DEMOTED: &str = "TrafficDemoted";
    /// Demoted: a more valuable adapter took its GPUs.
    pub const BUDGET_DEMOTED: &str = "BudgetDemoted";
    /// Demoted: its accuracy is below the pool's gate.
    pub const GATE_DEMOTED: &str = "GateDemoted";
    /// Stays merged.
    pub const MERGED: &str = "Merged";
    /// Stays dynamic.
    pub const DYNAMIC: &str = "Dynamic";
    /// Would be promoted, but the budget is spent on more valuable adapters.
    pub const BUDGET_EXHAUSTED: &str = "BudgetExhausted";
    /// Would be promoted, but the accuracy gate refuses it.
    pub const MERGE_GATED: &str = "MergeGated";
    /// Would change, but changed too recently.
    pub const HOLD_TIME: &str = "HoldTime";
    /// Above the promotion threshold, not yet for the window.
    pub const RISING: &str = "Rising";
    /// Above the promotion share, but its traffic occupies too little dynamic capacity for a
    /// merged Deployment to earn its GPUs, or more than its merged pods could carry.
    pub const WOULD_NOT_EARN: &str = "WouldNotEarn";
    /// Would earn its GPUs, but the dynamic pods left could not carry the pool's dynamic
    /// traffic while its merged pod starts.
    pub const NO_HEADROOM: &str = "NoHeadroom";
    /// Below the demotion threshold, not yet for the window.
    pub const FALLING: &str = "Falling";
}

struct Scored<'a> {
    c: &'a Candidate,
    share: f64,
    /// Dynamic GPUs its traffic occupies ÷ GPUs its merged Deployment takes (None without a
    /// capacity).
    occupancy: Option<f64>,
    state: State,
    gate_ok: bool,
    held: bool,
    sustained_above: bool,
    sustained_below: bool,
    wants: bool,
    pinned: bool,
}

/// Decides every `auto` adapter of a pool at once (the budget is the pool's). `pool_tokens_per_min`
/// is the whole pool's traffic, `auto` or not, at least the sum of the candidates'. Pure.
pub fn decide(
    policy: &Policy,
    pool_tokens_per_min: f64,
    candidates: &[Candidate],
    now: DateTime<Utc>,
) -> Vec<Decision> {
    let total = candidates
        .iter()
        .map(|c| c.tokens_per_min)
        .sum::<f64>()
        .max(pool_tokens_per_min);
    let window = Duration::seconds(policy.window_secs);
    let hold = Duration::seconds(policy.min_hold_secs);
    let scored: Vec<Scored> = candidates
        .iter()
        .map(|c| {
            let share = if total > 0.0 {
                c.tokens_per_min / total
            } else {
                0.0
            };
            let occupancy = policy
                .capacity
                .map(|cap| cap.dynamic_gpus(c.tokens_per_min) / f64::from(c.gpus.max(1)));
            // Earns its GPUs, and its merged pods can carry it.
            let earns = occupancy.is_none_or(|o| o >= EARN_PROMOTE)
                && policy.capacity.is_none_or(|cap| {
                    c.tokens_per_min
                        <= cap.merged_tokens_per_min * f64::from(c.gpus.max(1)) * MERGED_TARGET
                });
            let stopped_earning = occupancy.is_some_and(|o| o < EARN_DEMOTE);
            let mut state = c.state;
            state.above_since = (share >= policy.promote_share && earns)
                .then(|| c.state.above_since.unwrap_or(now));
            state.below_since = (share < policy.demote_share || stopped_earning)
                .then(|| c.state.below_since.unwrap_or(now));
            let lasted = |t: Option<DateTime<Utc>>| t.is_some_and(|t| now - t >= window);
            let gate_ok = match policy.min_accuracy {
                Some(min) => c.accuracy.is_some_and(|a| a >= min),
                None => true,
            };
            let held = c.state.since.is_none_or(|s| now - s >= hold);
            let sustained_above = lasted(state.above_since);
            let sustained_below = lasted(state.below_since);
            let wants = if c.state.merged {
                gate_ok && !(sustained_below && held)
            } else {
                gate_ok && sustained_above && held
            };
            Scored {
                c,
                share,
                occupancy,
                state,
                gate_ok,
                held,
                sustained_above,
                sustained_below,
                wants,
                pinned: c.state.merged && gate_ok && !held,
            }
        })
        .collect();

    // Adapters within their hold time keep their GPUs; the rest go by value.
    let mut used: u32 = scored.iter().filter(|s| s.pinned).map(|s| s.c.gpus).sum();
    let mut order: Vec<usize> = (0..scored.len())
        .filter(|&i| scored[i].wants && !scored[i].pinned)
        .collect();
    let value = |s: &Scored| {
        let margin = if s.c.state.merged {
            INCUMBENT_MARGIN
        } else {
            1.0
        };
        margin * s.c.tokens_per_min / f64::from(s.c.gpus.max(1))
    };
    order.sort_by(|&a, &b| {
        value(&scored[b])
            .total_cmp(&value(&scored[a]))
            .then_with(|| scored[a].c.name.cmp(&scored[b].c.name))
    });
    let mut granted = vec![false; scored.len()];
    for (i, s) in scored.iter().enumerate() {
        granted[i] = s.pinned;
    }
    // The dynamic pods' load now, in GPUs: the pool's traffic less what merged pods serve.
    let merged_tokens: f64 = scored
        .iter()
        .filter(|s| s.c.state.merged)
        .map(|s| s.c.tokens_per_min)
        .sum();
    let dynamic_load = policy
        .capacity
        .map(|cap| cap.dynamic_gpus(total - merged_tokens));
    let mut taken: u32 = 0;
    let mut no_headroom = vec![false; scored.len()];
    for i in order {
        let g = scored[i].c.gpus;
        if used + g > policy.budget_gpus {
            continue;
        }
        // A promotion also needs the dynamic pods left to carry the dynamic traffic (its own
        // included) until its merged pod is ready.
        if let (false, Some(cap), Some(load)) =
            (scored[i].c.state.merged, policy.capacity, dynamic_load)
        {
            let left = f64::from(cap.dynamic_gpus.saturating_sub(taken + g));
            if load > left * HEADROOM {
                no_headroom[i] = true;
                continue;
            }
            taken += g;
        }
        used += g;
        granted[i] = true;
    }

    scored
        .iter()
        .zip(granted)
        .zip(no_headroom)
        .map(|((s, granted), no_headroom)| {
            let was = s.c.state.merged;
            let (action, why) = match (was, granted) {
                (true, true) => (
                    Action::Stay,
                    if s.sustained_below {
                        reason::HOLD_TIME
                    } else if s.state.below_since.is_some() {
                        reason::FALLING
                    } else {
                        reason::MERGED
                    },
                ),
                (true, false) => (
                    Action::Demote,
                    if !s.gate_ok {
                        reason::GATE_DEMOTED
                    } else if s.sustained_below {
                        reason::TRAFFIC_DEMOTED
                    } else {
                        reason::BUDGET_DEMOTED
                    },
                ),
                (false, true) => (Action::Promote, reason::TRAFFIC_PROMOTED),
                (false, false) => (
                    Action::Stay,
                    if !s.sustained_above {
                        if s.state.above_since.is_some() {
                            reason::RISING
                        } else if s.share >= policy.promote_share {
                            reason::WOULD_NOT_EARN
                        } else {
                            reason::DYNAMIC
                        }
                    } else if !s.gate_ok {
                        reason::MERGE_GATED
                    } else if !s.held {
                        reason::HOLD_TIME
                    } else if no_headroom {
                        reason::NO_HEADROOM
                    } else {
                        reason::BUDGET_EXHAUSTED
                    },
                ),
            };
            let mut state = s.state;
            state.merged = granted;
            if granted != was {
                state.since = Some(now);
            }
            Decision {
                name: s.c.name.clone(),
                action,
                reason: why,
                state,
                share: s.share,
                note: note(policy, s, total, used, why),
            }
        })
        .collect()
}

fn note(policy: &Policy, s: &Scored, total: f64, used: u32, why: &str) -> String {
    let c = s.c;
    let mut n = format!(
        "{why}: {:.1}% of the pool's {:.0} tokens/min ({:.0} tokens/min, {:.1} requests/min",
        100.0 * s.share,
        total,
        c.tokens_per_min,
        c.requests_per_min
    );
    if let Some(p95) = c.p95_ms {
        n.push_str(&format!(", p95 {p95:.0} ms"));
    }
    if let Some(o) = s.occupancy {
        n.push_str(&format!(
            ", {o:.2}x its merged GPUs in dynamic capacity (earns at {EARN_PROMOTE}x, stops below {EARN_DEMOTE}x)"
        ));
    }
    n.push_str(&format!(
        "); promote at {:.1}%, demote below {:.1}%, window {}s, hold {}s; merged GPUs {used}/{}",
        100.0 * policy.promote_share,
        100.0 * policy.demote_share,
        policy.window_secs,
        policy.min_hold_secs,
        policy.budget_gpus
    ));
    if let (Some(acc), Some(min)) = (c.accuracy, policy.min_accuracy) {
        n.push_str(&format!("; accuracy {acc} (gate {min})"));
    } else if let Some(min) = policy.min_accuracy {
        n.push_str(&format!("; no accuracy (gate {min})"));
    }
    n
}

/// What the last decision of an adapter said, as the decider recorded it: its state and the
/// rates it was decided with. Newer than the adapter's status as a cache may hold it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Decided {
    /// The state the decision left.
    pub state: State,
    /// Tokens per minute it was decided with.
    pub tokens_per_min: f64,
    /// Requests per minute it was decided with.
    pub requests_per_min: f64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn t(secs: i64) -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 11, 27, 12, 0, 0).unwrap() + Duration::seconds(secs)
    }

    fn policy() -> Policy {
        Policy {
            promote_share: 0.10,
            demote_share: 0.04,
            window_secs: 300,
            min_hold_secs: 900,
            budget_gpus: 2,
            min_accuracy: None,
            capacity: None,
        }
    }

    fn cand(name: &str, tpm: f64, state: State) -> Candidate {
        Candidate {
            name: name.into(),
            tokens_per_min: tpm,
            requests_per_min: tpm / 100.0,
            p95_ms: Some(800.0),
            gpus: 1,
            accuracy: None,
            state,
        }
    }

    /// Runs the policy over `steps` (seconds, tokens/min of `hot`) with the rest of the pool at
    /// 1000 tokens/min, carrying the state; returns the (time, action, reason) of each step.
    fn run(p: &Policy, steps: &[(i64, f64)]) -> Vec<(i64, Action, &'static str)> {
        let mut state = State::default();
        steps
            .iter()
            .map(|&(at, tpm)| {
                let d = decide(p, tpm + 1000.0, &[cand("hot", tpm, state)], t(at));
                state = d[0].state;
                (at, d[0].action, d[0].reason)
            })
            .collect()
    }

    /// With the pool's capacity, a share is not enough: an adapter is merged only while its
    /// traffic occupies more dynamic capacity than the merged GPU it takes (1.5x) and fits
    /// its merged pod (70%), and demoted once it stays under 0.8x for the window, whatever its
    /// share.
    #[test]
    fn merging_must_earn_its_gpus_when_the_capacity_is_known() {
        use reason::*;
        // A merged GPU serves 1,000 tokens/min; a dynamic adapter at 0.4 of that: 200
        // tokens/min occupy 0.5 dynamic GPUs, 650 occupy 1.625 (and fill 65% of the merged
        // pod, under its 70%).
        let p = Policy {
            capacity: Some(Capacity {
                merged_tokens_per_min: 1000.0,
                dynamic_ratio: 0.4,
                dynamic_gpus: 8,
            }),
            ..policy()
        };
        // 16.7% of the pool, well over the share, but 0.5x: never merged, and says why.
        let got = run(&p, &[(0, 200.0), (300, 200.0), (600, 200.0)]);
        assert_eq!(
            got,
            [
                (0, Action::Stay, WOULD_NOT_EARN),
                (300, Action::Stay, WOULD_NOT_EARN),
                (600, Action::Stay, WOULD_NOT_EARN)
            ]
        );
        // 650 tokens/min (1.625x) for the window: promoted; at 500 (1.25x, between the
        // bounds) it stays; at 300 (0.75x) for the window it goes back, its share (23%)
        // notwithstanding.
        let got = run(
            &p,
            &[
                (0, 650.0),
                (300, 650.0),
                (1200, 500.0),
                (1300, 300.0),
                (1600, 300.0),
            ],
        );
        assert_eq!(
            got,
            [
                (0, Action::Stay, RISING),
                (300, Action::Promote, TRAFFIC_PROMOTED),
                (1200, Action::Stay, MERGED),
                (1300, Action::Stay, FALLING),
                (1600, Action::Demote, TRAFFIC_DEMOTED)
            ]
        );
        // The same traffic without a capacity: the share alone promotes it.
        let got = run(&policy(), &[(0, 200.0), (300, 200.0)]);
        assert_eq!(got[1].1, Action::Promote);
        // The note gives the occupancy.
        let d = decide(&p, 1200.0, &[cand("hot", 200.0, State::default())], t(0));
        assert!(d[0].note.contains("0.50x its merged GPUs"), "{}", d[0].note);
        // Too hot for its one merged pod (800 of 1,000 tokens/min): stays dynamic.
        let mut state = State::default();
        let mut last = Vec::new();
        for at in [0, 300] {
            last = decide(&p, 1800.0, &[cand("hot", 800.0, state)], t(at));
            state = last[0].state;
        }
        assert_eq!(
            (last[0].action, last[0].reason),
            (Action::Stay, WOULD_NOT_EARN)
        );
        // Without headroom (the pool's dynamic traffic fills 3.4 of 3 dynamic GPUs: 2 left
        // after the promotion, 1.7 at 85%) the same adapter waits, and says why.
        let tight = Policy {
            capacity: Some(Capacity {
                dynamic_gpus: 3,
                ..p.capacity.unwrap()
            }),
            ..p.clone()
        };
        let mut state = State::default();
        let mut last = Vec::new();
        for at in [0, 300] {
            last = decide(&tight, 1350.0, &[cand("hot", 650.0, state)], t(at));
            state = last[0].state;
        }
        assert_eq!(
            (last[0].action, last[0].reason),
            (Action::Stay, NO_HEADROOM)
        );
    }

    #[test]
    fn promotion_needs_the_share_for_the_whole_window_and_demotion_the_lower_one() {
        use reason::*;
        let p = policy();
        // 200 tokens/min of 1200: 16.7%, above 10%. Promoted once it lasted 300 s.
        let got = run(
            &p,
            &[
                (0, 200.0),
                (120, 200.0),
                (299, 200.0),
                (300, 200.0),
                (600, 200.0),
                // 7% of the pool: between the thresholds, stays merged (hysteresis).
                (1200, 75.0),
                // 2%: below 4%, falling; demoted once it lasted the window.
                (1300, 20.0),
                (1500, 20.0),
                (1600, 20.0),
                (1700, 20.0),
            ],
        );
        assert_eq!(
            got,
            vec![
                (0, Action::Stay, RISING),
                (120, Action::Stay, RISING),
                (299, Action::Stay, RISING),
                (300, Action::Promote, TRAFFIC_PROMOTED),
                (600, Action::Stay, MERGED),
                (1200, Action::Stay, MERGED),
                (1300, Action::Stay, FALLING),
                (1500, Action::Stay, FALLING),
                (1600, Action::Demote, TRAFFIC_DEMOTED),
                (1700, Action::Stay, DYNAMIC),
            ]
        );
    }

    #[test]
    fn a_dip_restarts_the_window_and_the_band_between_thresholds_changes_nothing() {
        use reason::*;
        let p = policy();
        let got = run(
            &p,
            &[
                (0, 200.0),
                (200, 200.0),
                // 7%: not above 10%, the window starts over.
                (250, 75.0),
                (300, 200.0),
                (550, 200.0),
                (600, 200.0),
            ],
        );
        assert_eq!(
            got,
            vec![
                (0, Action::Stay, RISING),
                (200, Action::Stay, RISING),
                (250, Action::Stay, DYNAMIC),
                (300, Action::Stay, RISING),
                (550, Action::Stay, RISING),
                (600, Action::Promote, TRAFFIC_PROMOTED),
            ]
        );
        // Hovering in the band for hours: a dynamic adapter never becomes merged.
        let band: Vec<(i64, f64)> = (0..50).map(|i| (i * 300, 75.0)).collect();
        assert!(run(&p, &band).iter().all(|s| s.1 == Action::Stay));
    }

    #[test]
    fn no_change_within_the_hold_time() {
        use reason::*;
        let p = policy();
        // Promoted at 300, traffic gone at once: below 4% from 310, lasted the window at 610,
        // but the hold (900 s from 300) keeps it merged until 1200.
        let got = run(
            &p,
            &[
                (0, 200.0),
                (300, 200.0),
                (310, 0.0),
                (610, 0.0),
                (1199, 0.0),
                (1200, 0.0),
            ],
        );
        assert_eq!(
            got,
            vec![
                (0, Action::Stay, RISING),
                (300, Action::Promote, TRAFFIC_PROMOTED),
                (310, Action::Stay, FALLING),
                (610, Action::Stay, HOLD_TIME),
                (1199, Action::Stay, HOLD_TIME),
                (1200, Action::Demote, TRAFFIC_DEMOTED),
            ]
        );
    }

    fn sustained() -> State {
        State {
            merged: false,
            since: None,
            above_since: Some(t(0)),
            below_since: None,
        }
    }

    fn merged_since(at: i64) -> State {
        State {
            merged: true,
            since: Some(t(at)),
            above_since: Some(t(at)),
            below_since: None,
        }
    }

    #[test]
    fn the_budget_goes_to_the_most_valuable_adapters_first() {
        use reason::*;
        let p = policy();
        let mut big = cand("big", 500.0, sustained());
        big.gpus = 2;
        let cands = vec![
            cand("a", 300.0, sustained()),
            cand("b", 400.0, sustained()),
            cand("c", 200.0, sustained()),
            big,
        ];
        let d = decide(&p, 1800.0, &cands, t(600));
        let got: Vec<_> = d
            .iter()
            .map(|d| (d.name.as_str(), d.action, d.reason))
            .collect();
        // Per GPU: b 400, a 300, big 250, c 200; two GPUs: b and a.
        assert_eq!(
            got,
            vec![
                ("a", Action::Promote, TRAFFIC_PROMOTED),
                ("b", Action::Promote, TRAFFIC_PROMOTED),
                ("c", Action::Stay, BUDGET_EXHAUSTED),
                ("big", Action::Stay, BUDGET_EXHAUSTED),
            ]
        );
        assert!(d[2].note.contains("merged GPUs 2/2"), "{}", d[2].note);
    }

    #[test]
    fn an_incumbent_past_its_hold_is_displaced_only_by_a_clearly_better_adapter() {
        use reason::*;
        let p = Policy {
            budget_gpus: 1,
            ..policy()
        };
        // Incumbent at 300, newcomer at 360: 1.2x, within the 25% margin; kept.
        let d = decide(
            &p,
            1000.0,
            &[
                cand("old", 300.0, merged_since(0)),
                cand("new", 360.0, sustained()),
            ],
            t(2000),
        );
        assert_eq!(
            (d[0].action, d[1].action, d[1].reason),
            (Action::Stay, Action::Stay, BUDGET_EXHAUSTED)
        );
        // Newcomer at 400: 1.33x; takes the GPU.
        let d = decide(
            &p,
            1000.0,
            &[
                cand("old", 300.0, merged_since(0)),
                cand("new", 400.0, sustained()),
            ],
            t(2000),
        );
        assert_eq!(
            (d[0].action, d[0].reason, d[1].action),
            (Action::Demote, BUDGET_DEMOTED, Action::Promote)
        );
        // Within its hold time the incumbent keeps its GPU whatever the newcomer's worth.
        let d = decide(
            &p,
            1000.0,
            &[
                cand("old", 300.0, merged_since(1500)),
                cand("new", 900.0, sustained()),
            ],
            t(2000),
        );
        assert_eq!(
            (d[0].action, d[1].action, d[1].reason),
            (Action::Stay, Action::Stay, BUDGET_EXHAUSTED)
        );
    }

    #[test]
    fn the_accuracy_gate_blocks_promotion_and_demotes_at_once() {
        use reason::*;
        let p = Policy {
            min_accuracy: Some(0.8),
            capacity: None,
            ..policy()
        };
        let mut low = cand("low", 500.0, sustained());
        low.accuracy = Some(0.7);
        let mut none = cand("none", 500.0, sustained());
        none.accuracy = None;
        let mut good = cand("good", 300.0, sustained());
        good.accuracy = Some(0.9);
        let mut fell = cand("fell", 500.0, merged_since(500));
        fell.accuracy = Some(0.5);
        let d = decide(&p, 1800.0, &[low, none, good, fell], t(600));
        let got: Vec<_> = d.iter().map(|d| (d.action, d.reason)).collect();
        assert_eq!(
            got,
            vec![
                (Action::Stay, MERGE_GATED),
                (Action::Stay, MERGE_GATED),
                (Action::Promote, TRAFFIC_PROMOTED),
                (Action::Demote, GATE_DEMOTED),
            ]
        );
        assert!(
            d[0].note.contains("accuracy 0.7 (gate 0.8)"),
            "{}",
            d[0].note
        );
    }

    #[test]
    fn every_decision_carries_its_numbers_and_an_idle_pool_promotes_nothing() {
        let p = policy();
        let d = decide(&p, 2000.0, &[cand("hot", 500.0, sustained())], t(600));
        assert_eq!(d[0].action, Action::Promote);
        assert!((d[0].share - 0.25).abs() < 1e-9);
        let n = &d[0].note;
        for part in [
            "25.0% of the pool's 2000 tokens/min",
            "500 tokens/min",
            "5.0 requests/min",
            "p95 800 ms",
            "promote at 10.0%",
            "window 300s",
        ] {
            assert!(n.contains(part), "{part} not in {n}");
        }
        let d = decide(
            &p,
            0.0,
            &[
                cand("a", 0.0, sustained()),
                cand("b", 0.0, State::default()),
            ],
            t(600),
        );
        assert!(d.iter().all(|d| d.action == Action::Stay && d.share == 0.0));
    }
}
