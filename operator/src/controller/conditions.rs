//! The `Valid` and `Ready` conditions as validation leaves them, the same for every kind.

use chrono::{DateTime, Utc};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use mole_crds::constants::{condition, reason};

use crate::error::FieldError;
use crate::mergedown::set_condition;

/// Marks a refused spec: `Valid` and `Ready` false with the field error's reason and message.
/// Returns whether `Valid` changed, i.e. whether the refusal deserves an Event.
pub(crate) fn mark_invalid(
    conditions: &mut Vec<Condition>,
    fe: &FieldError,
    generation: Option<i64>,
    now: DateTime<Utc>,
) -> bool {
    let message = fe.to_string();
    let changed = set_condition(
        conditions,
        condition::VALID,
        false,
        fe.reason,
        &message,
        generation,
        now,
    );
    set_condition(
        conditions,
        condition::READY,
        false,
        fe.reason,
        &message,
        generation,
        now,
    );
    changed
}

/// Marks an accepted spec: `Valid` true.
pub(crate) fn mark_valid(
    conditions: &mut Vec<Condition>,
    generation: Option<i64>,
    now: DateTime<Utc>,
) {
    set_condition(
        conditions,
        condition::VALID,
        true,
        reason::SPEC_VALID,
        "spec accepted",
        generation,
        now,
    );
}
