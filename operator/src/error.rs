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
    #[error("kubernetes API: {}", api_message(.0))]
    Kube(#[from] kube::Error),
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
    /// The pool's operator-token Secret is unusable.
    #[error("operator token: {0}")]
    OperatorToken(String),
    /// The cache of pools or Adapters has no feed (its watch ended before a first list).
    #[error("object cache: {0}")]
    StoreClosed(String),
}

impl Error {
    /// Whether the API server refused the request for what it held (a 4xx other than a
    /// conflict or throttling): retrying the same write will not help.
    pub fn is_refusal(&self) -> bool {
        matches!(self, Error::Kube(kube::Error::Api(s))
            if (400..500).contains(&s.code) && s.code != 409 && s.code != 429)
    }

    /// Stable name of the error.
    pub fn code(&self) -> &'static str {
        match self {
            Error::Kube(_) => "kube_api",
            Error::Pod { .. } => "pod_unreachable",
            Error::Conflict(_) => "conflict",
            Error::Serialization(_) => "serialization",
            Error::OperatorToken(_) => "operator_token",
            Error::StoreClosed(_) => "store_closed",
        }
    }
}

/// What the API server said, as a person reads it: `<code> <reason>: <message>` for its
/// refusals (kube's own Display appends the whole `Status` in Debug form, which ended up in
/// users' Events), kube's text otherwise.
pub fn api_message(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) => format!("{} {}: {}", s.code, s.reason, s.message),
        other => other.to_string(),
    }
}

/// Result of the operator's fallible steps.
pub type Result<T, E = Error> = std::result::Result<T, E>;
