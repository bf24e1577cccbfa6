//! Placement of adapters on the pool's dynamic pods: each adapter on a subset of them,
//! replicated by its traffic, spread by rendezvous (highest-random-weight) hashing with
//! bounded load, so that a pod joining or leaving moves few adapters.
//!
//! Replicas: an adapter gets one replica per pod's fair share of the pool's traffic it
//! carries (`ceil(traffic / (total / pods))`), at least `min_replicas`, at most every pod.
//! Each adapter ranks the pods by `hash(adapter, pod)` and takes the first ones that are not
//! full; a pod is full at `ceil(load_factor × replicas / pods)` adapters (Mirrokni, Thorup and
//! Zadimoghaddam's bound: no pod holds more than `load_factor` times the mean) or at its
//! capacity (`maxLoras + maxCpuLoras`), whichever is less, unless the adapters do not fit at
//! all (then the bound is what fitting needs, and pods hold the rest on disk). Adapters are
//! placed in a fixed order (by their hash), so the same inputs give the same placement in
//! every operator replica.

use std::collections::{BTreeMap, BTreeSet};

use super::stable_hash;

/// How adapters are spread.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Policy {
    /// Fewest pods an adapter is placed on (2: a pod's restart never leaves it cold).
    pub min_replicas: usize,
    /// No pod holds more than this times the mean number of adapters per pod (> 1).
    pub load_factor: f64,
    /// Adapters one pod can hold in memory (`maxLoras + maxCpuLoras`).
    pub capacity: usize,
}

/// Where each adapter is placed: adapter name → pod names (best first).
pub type Placement = BTreeMap<String, Vec<String>>;

/// Replicas per adapter for `traffic` (adapter, tokens per minute) over `pods` pods.
pub fn replicas(policy: &Policy, traffic: &[(String, f64)], pods: usize) -> Vec<usize> {
    if pods == 0 {
        return vec![0; traffic.len()];
    }
    let total: f64 = traffic.iter().map(|(_, w)| w.max(0.0)).sum();
    let fair = total / pods as f64;
    let floor = policy.min_replicas.clamp(1, pods);
    let mut reps: Vec<usize> = traffic
        .iter()
        .map(|(_, w)| {
            let by_traffic = if fair > 0.0 {
                (w.max(0.0) / fair).ceil() as usize
            } else {
                0
            };
            by_traffic.clamp(floor, pods)
        })
        .collect();
    // More replicas than the pods can hold: the least used adapters lose their extra
    // replicas first (down to one).
    let room = policy.capacity.max(1) * pods;
    let mut order: Vec<usize> = (0..traffic.len()).collect();
    order.sort_by(|&a, &b| traffic[a].1.total_cmp(&traffic[b].1));
    while reps.iter().sum::<usize>() > room {
        let Some(&i) = order.iter().find(|&&i| reps[i] > 1) else {
            break;
        };
        reps[i] -= 1;
        if reps[i] == 1 {
            order.retain(|&j| j != i);
        }
    }
    reps
}

/// The most adapters a pod may hold for `total` replicas over `pods` pods.
pub fn bound(policy: &Policy, total: usize, pods: usize) -> usize {
    if pods == 0 {
        return 0;
    }
    let need = total.div_ceil(pods);
    let balanced = (policy.load_factor * total as f64 / pods as f64).ceil() as usize;
    balanced.min(policy.capacity).max(need)
}

/// Places `traffic` (adapter, tokens per minute) on `pods`. Pure and deterministic.
pub fn place(policy: &Policy, traffic: &[(String, f64)], pods: &[String]) -> Placement {
    let mut out = Placement::new();
    if pods.is_empty() {
        return out;
    }
    let reps = replicas(policy, traffic, pods.len());
    let cap = bound(policy, reps.iter().sum(), pods.len());
    let mut load: BTreeMap<&str, usize> = pods.iter().map(|p| (p.as_str(), 0)).collect();
    // The most replicated first (they need the most distinct pods with room), then by hash.
    let mut order: Vec<usize> = (0..traffic.len()).collect();
    order.sort_by_key(|&i| {
        (
            std::cmp::Reverse(reps[i]),
            stable_hash(&[traffic[i].0.as_str()]),
            i,
        )
    });
    for i in order {
        let name = &traffic[i].0;
        let mut ranked: Vec<&String> = pods.iter().collect();
        ranked.sort_by_key(|p| std::cmp::Reverse(stable_hash(&[name.as_str(), p.as_str()])));
        let mut chosen = Vec::with_capacity(reps[i]);
        for p in ranked {
            if chosen.len() == reps[i] {
                break;
            }
            if let Some(l) = load.get_mut(p.as_str()).filter(|l| **l < cap) {
                *l += 1;
                chosen.push(p.clone());
            }
        }
        // The room left may sit on fewer pods than it needs (only when the bound leaves no
        // slack: the pods' capacity, not the load factor, set it); then the least loaded other
        // pods take it one over the bound, holding it in host memory or on disk.
        while chosen.len() < reps[i] {
            let Some(p) = pods.iter().filter(|p| !chosen.contains(p)).min_by_key(|p| {
                (
                    load.get(p.as_str()).copied().unwrap_or(0),
                    stable_hash(&[name.as_str(), p.as_str()]),
                )
            }) else {
                break;
            };
            *load.entry(p.as_str()).or_insert(0) += 1;
            chosen.push(p.clone());
        }
        out.insert(name.clone(), chosen);
    }
    out
}

/// Replicas that moved from `old` to `new`: (adapter, pod) pairs `new` has and `old` had not.
pub fn moves(old: &Placement, new: &Placement) -> usize {
    let pairs = |p: &Placement| -> BTreeSet<(String, String)> {
        p.iter()
            .flat_map(|(a, pods)| pods.iter().map(move |p| (a.clone(), p.clone())))
            .collect()
    };
    pairs(new).difference(&pairs(old)).count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn policy() -> Policy {
        Policy {
            min_replicas: 2,
            load_factor: 1.25,
            capacity: 64,
        }
    }

    fn pods(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("vl-dynamic-{i}")).collect()
    }

    /// Zipf(1.1) traffic over `n` adapters.
    fn zipf(n: usize) -> Vec<(String, f64)> {
        (1..=n)
            .map(|k| (format!("adapter-{k}"), 10_000.0 / (k as f64).powf(1.1)))
            .collect()
    }

    fn loads(p: &Placement) -> BTreeMap<String, usize> {
        let mut l = BTreeMap::new();
        for pods in p.values() {
            for pod in pods {
                *l.entry(pod.clone()).or_insert(0) += 1;
            }
        }
        l
    }

    #[test]
    fn replicas_follow_traffic_within_the_floor_and_the_pods() {
        let p = policy();
        let t = vec![
            ("hot".to_string(), 5000.0),
            ("warm".to_string(), 1500.0),
            ("cold".to_string(), 10.0),
            ("idle".to_string(), 0.0),
        ];
        // 6510 over 4 pods: fair share 1627.5 per pod.
        assert_eq!(replicas(&p, &t, 4), vec![4, 2, 2, 2]);
        assert_eq!(replicas(&p, &t, 1), vec![1, 1, 1, 1]);
        assert_eq!(replicas(&p, &t, 0), vec![0, 0, 0, 0]);
        // Two slots per pod on 4 pods: 8 replicas at most; the cold ones give theirs up first.
        let tight = Policy { capacity: 2, ..p };
        assert_eq!(replicas(&tight, &t, 4), vec![4, 2, 1, 1]);
    }

    #[test]
    fn every_adapter_gets_its_replicas_on_distinct_pods_within_the_load_bound() {
        let mut rng = StdRng::seed_from_u64(37);
        for _ in 0..200 {
            let n_pods = rng.random_range(1..=24);
            let n_adapters = rng.random_range(1..=600);
            let capacity = rng.random_range(4..=128);
            let p = Policy {
                capacity,
                ..policy()
            };
            let t = zipf(n_adapters);
            let pl = place(&p, &t, &pods(n_pods));
            let reps = replicas(&p, &t, n_pods);
            let cap = bound(&p, reps.iter().sum(), n_pods);
            for ((name, _), r) in t.iter().zip(&reps) {
                let got = &pl[name];
                assert_eq!(got.len(), *r, "{name} on {got:?}");
                assert_eq!(got.iter().collect::<BTreeSet<_>>().len(), got.len());
            }
            // Over the bound only by one, and only when the bound has no slack (capacity set it).
            let total: usize = reps.iter().sum();
            let slack = cap * n_pods > total + reps.iter().max().copied().unwrap_or(0) * n_pods;
            for (pod, l) in loads(&pl) {
                assert!(l <= cap + 1, "{pod} holds {l} > {cap} + 1");
                assert!(!slack || l <= cap, "{pod} holds {l} > {cap} with slack");
            }
            // The bound is the load factor's unless the capacity (or fitting at all) says less.
            let mean = total as f64 / n_pods as f64;
            assert!(cap as f64 <= (1.25 * mean).ceil().max(mean.ceil()));
        }
    }

    #[test]
    fn a_pod_joining_or_leaving_moves_few_adapters() {
        let p = policy();
        let mut worst: f64 = 0.0;
        for (n_adapters, n_pods) in [(200, 8), (500, 16), (50, 4), (1000, 12), (100, 3)] {
            let t = zipf(n_adapters);
            let before = place(&p, &t, &pods(n_pods));
            let after = place(&p, &t, &pods(n_pods + 1));
            let total: usize = after.values().map(Vec::len).sum();
            // The new pod has to take its share, total / (n + 1), at the least; replicas that
            // change because the fair share per pod changed are counted too.
            let least = total as f64 / (n_pods + 1) as f64;
            let moved = moves(&before, &after) as f64;
            worst = worst.max(moved / least);
            assert!(
                moved <= 2.0 * least,
                "{n_adapters} adapters, {n_pods} -> {} pods: {moved} moves, least {least}",
                n_pods + 1
            );
            // A pod leaving: its replicas move, and not many more.
            let gone = place(&p, &t, &pods(n_pods - 1));
            let held = loads(&before)[&pods(n_pods)[n_pods - 1]] as f64;
            let moved = moves(&before, &gone) as f64;
            assert!(
                moved <= 2.0 * held.max(1.0),
                "{moved} moves for a pod that held {held}"
            );
        }
        assert!(worst > 0.0);
    }

    #[test]
    fn placement_is_deterministic_and_empty_without_pods() {
        let p = policy();
        let t = zipf(50);
        assert_eq!(place(&p, &t, &pods(5)), place(&p, &t, &pods(5)));
        // Listing order of the pods does not matter.
        let mut rev = pods(5);
        rev.reverse();
        let a = place(&p, &t, &pods(5));
        let b = place(&p, &t, &rev);
        for (k, v) in &a {
            let mut x = v.clone();
            let mut y = b[k].clone();
            x.sort();
            y.sort();
            assert_eq!(x, y);
        }
        assert!(place(&p, &t, &[]).is_empty());
    }
}
