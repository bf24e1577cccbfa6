//! The `Valid` and `Ready` conditions as validation leaves them, the same for every kind.

use chrono::{DateTime, Utc};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use mole_crds::constants::{condition, reason};

use crate::error::{Error, FieldError};
use crate::mergedown::set_condition;

/// Marks a refused spec: `Valid` and `Ready` false with the field error's reason and message.
/// Returns whether `Valid` changed, i.e. whether the refusal deserves an Event: a new refusal
/// does, also when it replaces another (a fixed field, then a wrong one).
pub(crate) fn mark_invalid(
    conditions: &mut Vec<Condition>,
    fe: &FieldError,
    generation: Option<i64>,
    now: DateTime<Utc>,
) -> bool {
    let message = fe.to_string();
    let same_refusal = conditions
        .iter()
        .any(|c| c.type_ == condition::VALID && c.status == "False" && c.message == message);
    let changed = !same_refusal;
    set_condition(
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

/// Marks an accepted spec whose reconcile failed after validation (the API server refused a
/// child, a pod did not answer): `Valid` true, `Ready` false with the error's stable name and
/// text. The conditions then say what is wrong now, never an earlier refusal already fixed.
/// Returns whether `Ready` changed.
pub(crate) fn mark_failed(
    conditions: &mut Vec<Condition>,
    e: &Error,
    generation: Option<i64>,
    now: DateTime<Utc>,
) -> bool {
    mark_valid(conditions, generation, now);
    set_condition(
        conditions,
        condition::READY,
        false,
        reason::RECONCILE_ERROR,
        &format!("{}: {e}", e.code()),
        generation,
        now,
    )
}
