//! LoRA id allocation: ids are unique in a pool, start at 1 and are never reused, even after an
//! adapter is deleted and recreated. The pool's status is the ledger; it is written with the
//! object's resourceVersion so two writers (two operators, or one restarted mid-write) conflict
//! instead of handing out one id twice.

use mole_crds::InferencePoolStatus;

/// The id of `adapter` in the pool, and the status to write when it had none yet.
pub fn allocate(status: &InferencePoolStatus, adapter: &str) -> (u32, Option<InferencePoolStatus>) {
    if let Some(id) = status.lora_ids.get(adapter) {
        return (*id, None);
    }
    let highest = status.lora_ids.values().copied().max().unwrap_or(0);
    let id = status.next_lora_id.unwrap_or(1).max(highest + 1);
    let mut next = status.clone();
    next.lora_ids.insert(adapter.to_string(), id);
    next.next_lora_id = Some(id + 1);
    (id, Some(next))
}

/// The status without `adapter`'s id (its number stays burnt: `nextLoraId` does not move back).
pub fn release(status: &InferencePoolStatus, adapter: &str) -> Option<InferencePoolStatus> {
    if !status.lora_ids.contains_key(adapter) {
        return None;
    }
    let mut next = status.clone();
    next.lora_ids.remove(adapter);
    Some(next)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_stable_and_never_reused() {
        let s = InferencePoolStatus::default();
        let (a, s1) = allocate(&s, "calendar");
        let s1 = s1.unwrap();
        assert_eq!(a, 1);
        assert_eq!(
            allocate(&s1, "calendar"),
            (1, None),
            "same adapter, same id, no write"
        );
        let (b, s2) = allocate(&s1, "desktop");
        let s2 = s2.unwrap();
        assert_eq!(b, 2);
        let s3 = release(&s2, "calendar").unwrap();
        assert_eq!(release(&s3, "calendar"), None);
        let (again, s4) = allocate(&s3, "calendar");
        assert_eq!(again, 3, "a recreated adapter gets a fresh id");
        assert_eq!(s4.unwrap().next_lora_id, Some(4));
    }

    #[test]
    fn a_lost_next_counter_never_collides_with_live_ids() {
        let mut s = InferencePoolStatus::default();
        s.lora_ids.insert("x".into(), 9);
        let (id, _) = allocate(&s, "y");
        assert_eq!(id, 10);
    }
}
