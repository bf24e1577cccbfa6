//! The operator's error type. Every variant has a stable name ([`Error::code`]) used as the
//! `error` label of `mole_operator_reconcile_errors_total` and as the Event reason suffix.

/// A spec field that failed validation, named as users write it (`spec.source.path`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct FieldError {
    /// Stable reason (`InvalidSpec`, `PoolNotFound`, `DuplicateLabel`).
    pub reason: &'static str,
    /// JSON path of the field.
    pub field: String,
    /// What is wrong and how to fix it.
    pub message: String,
}

impl FieldError {
    /// An `InvalidSpec` error on `field`.
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            reason: mole_crds::constants::reason::INVALID_SPEC,
            field: field.into(),
            message: message.into(),
        }
    }
}

/// Errors of a reconcile.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The Kubernetes API refused or failed a call (retried with backoff).
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// The spec is invalid; reported as a condition, not retried until the spec changes.
    #[error("invalid spec: {0}")]
    Invalid(#[from] FieldError),
    /// A worker pod did not answer (retried).
    #[error("worker pod {pod}: {message}")]
    Pod {
        /// Pod name.
        pod: String,
        /// What failed.
        message: String,
    },
    /// Another writer changed the object first (retried at once from a fresh read).
    #[error("conflict writing {0}; retrying")]
    Conflict(String),
    /// An object could not be serialized.
    #[error("serialization: {0}")]
    Serialization(#[from] serde_json::Error),
    /// The finalizer machinery failed.
    #[error("finalizer: {0}")]
    Finalizer(String),
    /// The pool's operator-token Secret is unusable.
    #[error("operator token: {0}")]
    OperatorToken(String),
    /// The cache of pools or Adapters has no feed (its watch ended before a first list).
    #[error("object cache: {0}")]
    StoreClosed(String),
}

impl Error {
    /// Stable name of the error.
    pub fn code(&self) -> &'static str {
        match self {
            Error::Kube(_) => "kube_api",
            Error::Invalid(_) => "invalid_spec",
            Error::Pod { .. } => "pod_unreachable",
            Error::Conflict(_) => "conflict",
            Error::Serialization(_) => "serialization",
            Error::Finalizer(_) => "finalizer",
            Error::OperatorToken(_) => "operator_token",
            Error::StoreClosed(_) => "store_closed",
        }
    }
}

/// Result of the operator's fallible steps.
pub type Result<T, E = Error> = std::result::Result<T, E>;
