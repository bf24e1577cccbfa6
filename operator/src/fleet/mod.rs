//! The fleet policy: which adapters get their own merged Deployment, which dynamic pods hold
//! which adapter, and whether a canary version goes on, is promoted or is rolled back.
//!
//! Everything here is pure (no client, no clock: `now` is an argument), so the controllers and
//! the fleet simulator (`mole-operator simulate`) run the same code, and every rule is
//! table-tested. Each decision carries the numbers that caused it, for its Event.
//!
//! - [`traffic`]: per-adapter rates from the pods' cumulative counters, smoothed over a
//!   window, and when a new reading is worth a status write.
//! - [`merge`]: traffic-driven merge-down (`serving.mode: auto` with the pool's
//!   `merge.traffic`): hysteresis, minimum hold, a GPU budget spent on the most valuable
//!   adapters first, the accuracy gate.
//! - [`placement`]: each adapter on a subset of the dynamic pods, replicas by traffic,
//!   rendezvous hashing with bounded load.
//! - [`canary`]: analysis of a canary version against the stable one.

pub mod canary;
pub mod merge;
pub mod placement;
pub mod sim;
pub mod traffic;

/// A stable 64-bit hash (FNV-1a, then the splitmix64 finalizer to spread its bits): placement
/// must give the same answer in every operator replica, release and restart, which
/// `std::hash` does not promise.
pub fn stable_hash(parts: &[&str]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for (i, p) in parts.iter().enumerate() {
        if i > 0 {
            // A separator, so ("ab", "c") and ("a", "bc") differ.
            h ^= 0xff;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        for b in p.bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    let mut z = h.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hash_is_fixed_and_separates_its_parts() {
        // Pinned: a change of the function moves adapters between pods on upgrade.
        assert_eq!(stable_hash(&["a"]), stable_hash(&["a"]));
        assert_ne!(stable_hash(&["ab", "c"]), stable_hash(&["a", "bc"]));
        assert_ne!(stable_hash(&["x", "pod-1"]), stable_hash(&["x", "pod-2"]));
    }
}
