//! The bounds of a generation request's fields: one set, checked by the worker's validation
//! before a request is routed or its images decoded (each refusal with its own stable `code`),
//! written into the worker's OpenAPI document, and asserted by the engine, which takes a
//! validated request as given. OpenAI's bounds where it states them, else vLLM's.

/// A request field refused by its bounds: the 400 the worker answers.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct RequestError {
    /// The stable `code` of the refusal (a JSON error code and metric label).
    pub code: &'static str,
    /// What is wrong, naming the field.
    pub message: String,
}

impl RequestError {
    /// A refusal with `code` and `message`.
    pub fn new(code: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}

/// The bounds of a real-valued request field and the code of its refusal. Values are read as
/// f64 and checked before they become the engine's f32, so a finite value in bounds stays
/// finite.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RealField {
    /// The field as sent (`temperature`).
    pub field: &'static str,
    /// The code of its refusal (`invalid_temperature`).
    pub code: &'static str,
    /// Smallest accepted value.
    pub min: f64,
    /// Whether `min` itself is refused.
    pub min_exclusive: bool,
    /// Largest accepted value.
    pub max: f64,
}

impl RealField {
    /// Whether `v` is accepted (NaN never is).
    pub fn contains(&self, v: f64) -> bool {
        let above = match self.min_exclusive {
            true => v > self.min,
            false => v >= self.min,
        };
        above && v <= self.max
    }

    /// `v` checked, or the refusal naming the field and its bounds.
    pub fn check(&self, v: f64) -> Result<(), RequestError> {
        if self.contains(v) {
            return Ok(());
        }
        let open = if self.min_exclusive { '(' } else { '[' };
        Err(RequestError::new(
            self.code,
            format!(
                "{} must be in {open}{}, {}], got {v}",
                self.field, self.min, self.max
            ),
        ))
    }

    /// An f32 the engine holds checked against the bounds as f32: what [`RealField::check`]
    /// accepted stays accepted once rounded to f32 (rounding is monotonic).
    pub fn check_f32(&self, v: f32) -> Result<(), RequestError> {
        let bounds = RealField {
            min: f64::from(self.min as f32),
            max: f64::from(self.max as f32),
            ..*self
        };
        bounds.check(f64::from(v))
    }
}

/// Sampling temperature, 0 greedy (OpenAI's bound).
pub const TEMPERATURE: RealField = RealField {
    field: "temperature",
    code: "invalid_temperature",
    min: 0.0,
    min_exclusive: false,
    max: 2.0,
};
/// Nucleus mass: 0 would keep no token, so at least the smallest positive normal f32 (what a
/// smaller positive number would round to, or below, in the engine's f32).
pub const TOP_P: RealField = RealField {
    field: "top_p",
    code: "invalid_top_p",
    min: f32::MIN_POSITIVE as f64,
    min_exclusive: false,
    max: 1.0,
};
/// Min-p (vLLM's bound): above 1 would keep no token.
pub const MIN_P: RealField = RealField {
    field: "min_p",
    code: "invalid_min_p",
    min: 0.0,
    min_exclusive: false,
    max: 1.0,
};
/// OpenAI's presence penalty.
pub const PRESENCE_PENALTY: RealField = RealField {
    field: "presence_penalty",
    code: "invalid_presence_penalty",
    min: -2.0,
    min_exclusive: false,
    max: 2.0,
};
/// OpenAI's frequency penalty.
pub const FREQUENCY_PENALTY: RealField = RealField {
    field: "frequency_penalty",
    code: "invalid_frequency_penalty",
    min: -2.0,
    min_exclusive: false,
    max: 2.0,
};
/// vLLM's multiplicative repetition penalty (1 disables): 0 or below divides by zero or flips
/// signs. vLLM takes any positive value; mole holds it to [0.01, 100] so that a penalised
/// logit stays finite in f32 (a logit divided by 1e-40 is infinite, and poisons the row).
pub const REPETITION_PENALTY: RealField = RealField {
    field: "repetition_penalty",
    code: "invalid_repetition_penalty",
    min: 0.01,
    min_exclusive: false,
    max: 100.0,
};

/// Every real-valued sampling field, in the order the engine's assertion reads them.
pub const REAL_FIELDS: [RealField; 6] = [
    TEMPERATURE,
    TOP_P,
    MIN_P,
    PRESENCE_PENALTY,
    FREQUENCY_PENALTY,
    REPETITION_PENALTY,
];

/// The most choices (`n`) one request may ask for (OpenAI's bound); a pool also holds it to
/// its `maxBatchSize` (code `invalid_n`).
pub const MAX_N: u64 = 128;

/// `n` checked against [`MAX_N`] and the pool's `max_batch_size`.
pub fn check_n(n: u64, max_batch_size: u32) -> Result<(), RequestError> {
    let most = MAX_N.min(u64::from(max_batch_size));
    if (1..=most).contains(&n) {
        return Ok(());
    }
    Err(RequestError::new(
        "invalid_n",
        format!("n must be between 1 and {most} (at most {MAX_N}, and the pool's maxBatchSize {max_batch_size}), got {n}"),
    ))
}

/// The most top log probabilities per token (OpenAI's and vLLM's `top_logprobs` bound, and a
/// completion's `logprobs` count).
pub const MAX_LOGPROBS: usize = 20;

/// The most stop strings (OpenAI's bound; none may be empty).
pub const MAX_STOP: usize = 4;

/// The most `stop_token_ids` a request may list (vLLM has no bound; a model's special tokens
/// are a handful, and the engine scans the list at every token).
pub const MAX_STOP_TOKEN_IDS: usize = 64;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn real_fields_refuse_with_their_own_code() {
        assert!(TEMPERATURE.check(0.0).is_ok() && TEMPERATURE.check(2.0).is_ok());
        assert_eq!(
            TEMPERATURE.check(2.5).unwrap_err().code,
            "invalid_temperature"
        );
        assert_eq!(TOP_P.check(0.0).unwrap_err().code, "invalid_top_p");
        assert!(TOP_P.check(1e-9).is_ok());
        // A positive f64 that an f32 holds as 0 (or a subnormal) is refused.
        assert!(TOP_P.check(5e-324).is_err() && TOP_P.check(1e-40).is_err());
        // What is accepted stays accepted as the engine's f32.
        for b in REAL_FIELDS {
            for v in [b.min, b.max, 0.01, 0.1, 0.3, 1.0 / 3.0, 1.1, 1.7] {
                if b.check(v).is_ok() {
                    assert!(b.check_f32(v as f32).is_ok(), "{} {v}", b.field);
                }
            }
        }
        assert_eq!(MIN_P.check(1.5).unwrap_err().code, "invalid_min_p");
        assert_eq!(MIN_P.check(f64::NAN).unwrap_err().code, "invalid_min_p");
        let e = PRESENCE_PENALTY.check(-2.5).unwrap_err();
        assert_eq!(e.code, "invalid_presence_penalty");
        assert!(
            e.message.contains("presence_penalty must be in [-2, 2]"),
            "{e}"
        );
        assert_eq!(
            FREQUENCY_PENALTY.check(3.0).unwrap_err().code,
            "invalid_frequency_penalty"
        );
        assert_eq!(
            REPETITION_PENALTY.check(0.0).unwrap_err().code,
            "invalid_repetition_penalty"
        );
        assert!(REPETITION_PENALTY.check(100.0).is_ok());
        assert!(REPETITION_PENALTY.check(1e39).is_err());
        assert!(REPETITION_PENALTY.check(5e-324).is_err());
        assert!(REPETITION_PENALTY.check(f64::INFINITY).is_err());
    }

    #[test]
    fn n_is_held_to_the_batch() {
        assert!(check_n(1, 16).is_ok() && check_n(16, 16).is_ok());
        assert_eq!(check_n(0, 16).unwrap_err().code, "invalid_n");
        assert_eq!(check_n(17, 16).unwrap_err().code, "invalid_n");
        assert!(check_n(128, 1024).is_ok());
        assert!(check_n(129, 1024).is_err());
    }
}
