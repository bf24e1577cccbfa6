//! The Secret with the token the operator presents to a pool's worker pods.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::ByteString;
use mole_crds::InferencePool;

use super::meta::ChildMeta;

/// Where the pool's operator-token Secret is mounted in worker pods (dynamic and merged).
pub const OPERATOR_TOKEN_MOUNT: &str = "/var/run/mole/operator";
/// Key of the operator token in its Secret (and file name under [`OPERATOR_TOKEN_MOUNT`]).
pub const OPERATOR_TOKEN_KEY: &str = "token";

/// Name of the Secret holding the token the operator presents to a pool's worker pods.
pub fn operator_token_secret_name(pool: &str) -> String {
    format!("{pool}-operator-token")
}

/// Path of the operator token file inside worker pods.
pub fn operator_token_file() -> String {
    format!("{OPERATOR_TOKEN_MOUNT}/{OPERATOR_TOKEN_KEY}")
}

/// The Secret `<pool>-operator-token` with `token`, owned by the pool. Created once when absent
/// and never rewritten (a new token on every reconcile would lock the operator out of pods
/// that have not re-read the file yet).
pub fn operator_token_secret(pool: &InferencePool, token: &str) -> Secret {
    let name = pool.metadata.name.clone().unwrap_or_default();
    Secret {
        metadata: ChildMeta::of_pool(pool, "dynamic").named(operator_token_secret_name(&name)),
        data: Some(BTreeMap::from([(
            OPERATOR_TOKEN_KEY.to_string(),
            ByteString(token.as_bytes().to_vec()),
        )])),
        type_: Some("Opaque".into()),
        ..Default::default()
    }
}
