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

/// Why a call to a worker pod failed.
#[derive(Debug, thiserror::Error)]
pub enum PodCallError {
    /// The request or the reading of its answer failed (connect, timeout, body).
    #[error(transparent)]
    Http(#[from] reqwest::Error),
    /// The pod answered with a status other than the call's success.
    #[error("{path} answered {status}")]
    Status {
        /// The path called.
        path: &'static str,
        /// What it answered.
        status: reqwest::StatusCode,
    },
}

/// Errors of a reconcile.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The Kubernetes API refused or failed a call (retried with backoff).
    #[error("kubernetes API: {}", api_message(.0))]
    Kube(#[from] kube::Error),
    /// A worker pod did not answer (retried).
    #[error("worker pod {pod}: {source}")]
    Pod {
        /// Pod name.
        pod: String,
        /// What failed, with the HTTP client's error as its source.
        #[source]
        source: PodCallError,
    },
    /// Another writer changed the object first (retried at once from a fresh read).
    #[error("conflict writing {what}; retrying")]
    Conflict {
        /// What was being written.
        what: String,
        /// The API server's answer (409, or 422 for a failed JSON-patch `test`).
        #[source]
        source: kube::Error,
    },
    /// An object could not be serialized.
    #[error("serialization: {0}")]
    Serialization(#[from] serde_json::Error),
    /// The pool's operator-token Secret has no usable `token` key.
    #[error("operator token: Secret {secret} has no `token` key")]
    OperatorToken {
        /// The Secret's name.
        secret: String,
    },
    /// The caches of pools or Adapters have no feed: their watches ended before a first list.
    #[error("object cache: the stores' watches ended before their first list")]
    StoreClosed,
    /// The operator is shutting down before the caches held a first list: the reconcile
    /// stops (its object is reconciled again by the next leader).
    #[error("shutting down before the object caches were filled")]
    ShuttingDown,
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
            Error::Conflict { .. } => "conflict",
            Error::Serialization(_) => "serialization",
            Error::OperatorToken { .. } => "operator_token",
            Error::StoreClosed => "store_closed",
            Error::ShuttingDown => "shutting_down",
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A pod call's failure keeps the HTTP client's error as its source (not only its text),
    /// and its stable name and message stay as they were.
    #[test]
    fn a_pod_error_keeps_the_http_error_as_its_source() {
        let http = reqwest::Client::new().get("not a url").build().unwrap_err();
        let text = http.to_string();
        let e = Error::Pod {
            pod: "vl-dynamic-0".into(),
            source: http.into(),
        };
        assert_eq!(e.code(), "pod_unreachable");
        assert_eq!(e.to_string(), format!("worker pod vl-dynamic-0: {text}"));
        let source = std::error::Error::source(&e).unwrap();
        assert!(matches!(
            source.downcast_ref::<PodCallError>(),
            Some(PodCallError::Http(_))
        ));
        let e = Error::Pod {
            pod: "p".into(),
            source: PodCallError::Status {
                path: "/v1/lora_adapters",
                status: reqwest::StatusCode::SERVICE_UNAVAILABLE,
            },
        };
        assert_eq!(
            e.to_string(),
            "worker pod p: /v1/lora_adapters answered 503 Service Unavailable"
        );
    }

    /// A conflict keeps the API server's answer as its source, so a log of the chain shows
    /// which write lost and what the server said.
    #[test]
    fn a_conflict_keeps_the_api_answer_as_its_source() {
        let status =
            kube::core::Status::failure("the object has been modified", "Conflict").with_code(409);
        let e = Error::Conflict {
            what: "the id ledger of pool ns/p".into(),
            source: kube::Error::Api(Box::new(status)),
        };
        assert_eq!(e.code(), "conflict");
        assert_eq!(
            e.to_string(),
            "conflict writing the id ledger of pool ns/p; retrying"
        );
        let source = std::error::Error::source(&e).unwrap();
        assert!(matches!(
            source.downcast_ref::<kube::Error>(),
            Some(kube::Error::Api(s)) if s.code == 409
        ));
        assert!(!e.is_refusal());
    }
}
