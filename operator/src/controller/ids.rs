//! LoRA id allocation: ids are unique in a pool, start at 1 and are never reused, even after an
//! adapter is deleted and recreated. The pool's status is the ledger (`loraIds`, `nextLoraId`)
//! and the pool controller is its one writer: each reconcile settles the ledger against the
//! pool's Adapters ([`settle`]) and writes it in the pool's one status apply. Pure: no client.

use std::collections::{BTreeMap, BTreeSet};

use mole_crds::InferencePoolStatus;

/// A pool's id ledger.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ledger {
    /// Adapter name → its id.
    pub ids: BTreeMap<String, u32>,
    /// The lowest id never given (None: no id given yet, or a status that lost the counter).
    pub next: Option<u32>,
}

impl Ledger {
    /// The ledger a pool's status holds.
    pub fn of(status: Option<&InferencePoolStatus>) -> Self {
        status.map_or_else(Self::default, |s| Self {
            ids: s.lora_ids.clone(),
            next: s.next_lora_id,
        })
    }

    /// Writes the ledger into `status`.
    pub fn write_into(&self, status: &mut InferencePoolStatus) {
        status.lora_ids = self.ids.clone();
        status.next_lora_id = self.next;
    }

    /// The first id this ledger may give: above every id it holds and its counter, so a
    /// counter lost with an older status never hands out a live id again.
    fn first_free(&self) -> u32 {
        let highest = self.ids.values().copied().max().unwrap_or(0);
        self.next.unwrap_or(1).max(highest + 1)
    }
}

/// One reconcile's settling of a pool's ledger.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Settled {
    /// The ledger to write.
    pub ledger: Ledger,
    /// The ids given in this round, in the order given.
    pub allocated: Vec<(String, u32)>,
    /// The ids taken out in this round (their numbers stay burnt).
    pub released: Vec<(String, u32)>,
}

impl Settled {
    /// The ids the pods may be given now: those of the ledger written before this round (a
    /// new id reaches the WorkerConfig in the reconcile after the status holding it was
    /// written, so no pod ever loads an id a failed status write did not keep).
    pub fn served(&self) -> BTreeMap<String, u32> {
        let mut ids = self.ledger.ids.clone();
        for (name, _) in &self.allocated {
            ids.remove(name);
        }
        ids
    }
}

/// Settles `ledger` against the pool's Adapters: `live` names every Adapter of the pool that
/// is not being deleted (they keep their ids; any other name leaves the ledger, which is how a
/// deleted Adapter's id is released), and `wanting` those that should hold an id, in the order
/// ids are given (each gets the next free number unless it holds one already). `nextLoraId`
/// never moves back, so a released number is never given again.
pub fn settle(ledger: &Ledger, wanting: &[&str], live: &BTreeSet<&str>) -> Settled {
    let mut next = ledger.first_free();
    let mut out = Settled {
        ledger: ledger.clone(),
        ..Default::default()
    };
    out.ledger.ids.retain(|name, id| {
        let keep = live.contains(name.as_str());
        if !keep {
            out.released.push((name.clone(), *id));
        }
        keep
    });
    for name in wanting {
        if !live.contains(name) || out.ledger.ids.contains_key(*name) {
            continue;
        }
        out.ledger.ids.insert((*name).to_string(), next);
        out.allocated.push(((*name).to_string(), next));
        next += 1;
    }
    if !out.allocated.is_empty() {
        out.ledger.next = Some(next);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ledger(ids: &[(&str, u32)], next: Option<u32>) -> Ledger {
        Ledger {
            ids: ids.iter().map(|(n, i)| ((*n).to_string(), *i)).collect(),
            next,
        }
    }

    /// One reconcile after another: (Adapters wanting an id, Adapters live, the ids the
    /// ledger then holds, its counter, what was given, what was released).
    #[test]
    fn ids_are_given_once_kept_across_reconciles_released_on_delete_and_never_reused() {
        type Step<'a> = (
            &'a [&'a str],
            &'a [&'a str],
            &'a [(&'a str, u32)],
            Option<u32>,
            &'a [(&'a str, u32)],
            &'a [(&'a str, u32)],
        );
        let steps: &[Step] = &[
            // Nothing yet: nothing written.
            (&[], &[], &[], None, &[], &[]),
            // Two Adapters applied at once: one id each, in the order asked.
            (
                &["cal", "desk"],
                &["cal", "desk"],
                &[("cal", 1), ("desk", 2)],
                Some(3),
                &[("cal", 1), ("desk", 2)],
                &[],
            ),
            // Reconciled again: the same ids, nothing given.
            (
                &["cal", "desk"],
                &["cal", "desk"],
                &[("cal", 1), ("desk", 2)],
                Some(3),
                &[],
                &[],
            ),
            // An Adapter that turned invalid (live, not wanting) keeps its id.
            (
                &["desk"],
                &["cal", "desk"],
                &[("cal", 1), ("desk", 2)],
                Some(3),
                &[],
                &[],
            ),
            // `cal` deleted (being deleted or gone: not live): released, its number burnt.
            (
                &["desk"],
                &["desk"],
                &[("desk", 2)],
                Some(3),
                &[],
                &[("cal", 1)],
            ),
            // Recreated under its name: a fresh id, never 1 again.
            (
                &["cal", "desk"],
                &["cal", "desk"],
                &[("cal", 3), ("desk", 2)],
                Some(4),
                &[("cal", 3)],
                &[],
            ),
            // The highest id deleted: the counter does not move back either.
            (
                &["desk", "new"],
                &["desk", "new"],
                &[("desk", 2), ("new", 4)],
                Some(5),
                &[("new", 4)],
                &[("cal", 3)],
            ),
        ];
        let mut l = Ledger::default();
        for (i, (wanting, live, ids, next, given, released)) in steps.iter().enumerate() {
            let live: BTreeSet<&str> = live.iter().copied().collect();
            let s = settle(&l, wanting, &live);
            assert_eq!(s.ledger, ledger(ids, *next), "step {i}");
            let pairs = |v: &[(&str, u32)]| -> Vec<(String, u32)> {
                v.iter().map(|(n, i)| ((*n).to_string(), *i)).collect()
            };
            assert_eq!(s.allocated, pairs(given), "step {i}: given");
            assert_eq!(s.released, pairs(released), "step {i}: released");
            l = s.ledger;
        }
    }

    #[test]
    fn a_lost_next_counter_never_collides_with_live_ids() {
        let live = BTreeSet::from(["x", "y"]);
        let s = settle(&ledger(&[("x", 9)], None), &["y"], &live);
        assert_eq!(s.ledger, ledger(&[("x", 9), ("y", 10)], Some(11)));
        // A counter behind the live ids (an edited status) is passed too.
        let s = settle(&ledger(&[("x", 9)], Some(3)), &["y"], &live);
        assert_eq!(s.allocated, vec![("y".to_string(), 10)]);
    }

    #[test]
    fn the_pods_get_an_id_once_it_was_written() {
        let live = BTreeSet::from(["a", "b"]);
        let s = settle(&ledger(&[("a", 1)], Some(2)), &["a", "b"], &live);
        assert_eq!(s.served(), BTreeMap::from([("a".to_string(), 1)]));
        let again = settle(&s.ledger, &["a", "b"], &live);
        assert_eq!(again.served(), s.ledger.ids);
    }

    #[test]
    fn a_released_id_is_not_given_in_the_same_round() {
        // `old` is deleted as `fresh` arrives: `fresh` gets a new number, not `old`'s.
        let live = BTreeSet::from(["fresh"]);
        let s = settle(&ledger(&[("old", 1)], Some(2)), &["fresh"], &live);
        assert_eq!(s.ledger, ledger(&[("fresh", 2)], Some(3)));
        assert_eq!(s.released, vec![("old".to_string(), 1)]);
    }

    #[test]
    fn the_status_round_trips() {
        let l = ledger(&[("a", 1)], Some(2));
        let mut st = InferencePoolStatus::default();
        l.write_into(&mut st);
        assert_eq!(Ledger::of(Some(&st)), l);
        assert_eq!(Ledger::of(None), Ledger::default());
    }
}
