//! Names shared by the operator, the worker and users: API group, labels, annotations,
//! condition types and reasons. Reasons double as Event reasons and metric labels, so they are
//! stable identifiers: never rename one.

/// API group of every mole resource.
pub const GROUP: &str = "mole.dev";
/// API version served by this crate.
pub const VERSION: &str = "v1alpha1";

/// Finalizer put on Adapters so the operator can unregister them before they go.
pub const ADAPTER_FINALIZER: &str = "mole.dev/adapter-cleanup";

/// Label: the pool a child object belongs to.
pub const LABEL_POOL: &str = "mole.dev/pool";
/// Label: the adapter a child object belongs to (merged Deployments, merge Jobs).
pub const LABEL_ADAPTER: &str = "mole.dev/adapter";
/// Label: the role of a pod (`dynamic`, `merged`, `merge`).
pub const LABEL_ROLE: &str = "mole.dev/role";
/// Standard label values.
pub const LABEL_APP_NAME: &str = "app.kubernetes.io/name";
/// Standard label: the instance (pool name).
pub const LABEL_APP_INSTANCE: &str = "app.kubernetes.io/instance";
/// Standard label: component (`dynamic`, `merged`, `merge`).
pub const LABEL_APP_COMPONENT: &str = "app.kubernetes.io/component";
/// Standard label: who manages the object.
pub const LABEL_APP_MANAGED_BY: &str = "app.kubernetes.io/managed-by";
/// Value of `app.kubernetes.io/name` on every child.
pub const APP_NAME: &str = "mole";
/// Value of `app.kubernetes.io/managed-by` on every child.
pub const MANAGED_BY: &str = "mole-operator";

/// Pod-template annotation: hash of the fields whose change must roll the pods (base model,
/// image, limits, resources). Adapter changes never touch it.
pub const ANNOTATION_SPEC_HASH: &str = "mole.dev/spec-hash";
/// ConfigMap annotation: hash of the WorkerConfig, so pods and humans can tell which one they run.
pub const ANNOTATION_CONFIG_HASH: &str = "mole.dev/config-hash";

/// Key of the worker configuration inside the pool's ConfigMap.
pub const WORKER_CONFIG_KEY: &str = "worker.json";
/// Where the ConfigMap is mounted in worker pods.
pub const WORKER_CONFIG_MOUNT: &str = "/etc/mole";
/// Port workers listen on unless the operator's `--worker-port` (`MOLE_WORKER_PORT`, the
/// chart's `workerPort`) says otherwise.
pub const WORKER_PORT: u16 = 8000;
/// Port of every pool's Services (`<pool>`, `<pool>-<adapter>`) and so of the endpoints the
/// operator publishes; they forward to the pods' named worker port, whatever its number.
pub const SERVICE_PORT: u16 = 8000;

/// Condition types.
pub mod condition {
    /// The object is serving as asked.
    pub const READY: &str = "Ready";
    /// The spec was accepted (it names a field when it was not).
    pub const VALID: &str = "Valid";
    /// Dynamic pods report the adapter loaded (Adapter) / all configured adapters (pool).
    pub const LOADED: &str = "Loaded";
    /// A merge Job runs or ran for the desired version.
    pub const MERGED: &str = "Merged";
    /// The adapter is not merged because of a pool gate (`minAccuracy`).
    pub const MERGE_GATED: &str = "MergeGated";
    /// Something serves, but not as asked (e.g. a failed merge with an older version serving).
    pub const DEGRADED: &str = "Degraded";
    /// The adapter's files were fetched from its `source.uri` for the desired version.
    pub const FETCHED: &str = "Fetched";
    /// Every ready dynamic pod of the pool runs the pool's current WorkerConfig (its adapters
    /// and router): each accepted `POST /admin/reload` of it.
    pub const ADAPTERS_SYNCED: &str = "AdaptersSynced";
}

/// Condition/Event reasons. Stable names: also used as metric labels.
pub mod reason {
    /// Spec passed validation.
    pub const SPEC_VALID: &str = "SpecValid";
    /// A field is invalid; the message names it.
    pub const INVALID_SPEC: &str = "InvalidSpec";
    /// The Adapter names a pool that does not exist in its namespace.
    pub const POOL_NOT_FOUND: &str = "PoolNotFound";
    /// Another Adapter of the pool already uses this label.
    pub const DUPLICATE_LABEL: &str = "DuplicateLabel";
    /// The adapter's merged children (`<pool>-<adapter>`) would take the name of another
    /// adapter's (of another pool); the older adapter keeps it.
    pub const NAME_COLLISION: &str = "NameCollision";
    /// The adapter's `source.path` is, contains or lies inside another Adapter's of the same
    /// pool; the older adapter keeps it.
    pub const SOURCE_PATH_IN_USE: &str = "SourcePathInUse";
    /// Waiting for pods to report the adapter loaded.
    pub const WAITING_FOR_PODS: &str = "WaitingForPods";
    /// Every ready pod reports the adapter loaded.
    pub const LOADED: &str = "AdapterLoaded";
    /// At least one pod failed to load the adapter.
    pub const LOAD_FAILED: &str = "AdapterLoadFailed";
    /// A lora id was allocated.
    pub const LORA_ID_ALLOCATED: &str = "LoraIdAllocated";
    /// The pool controller has not given the adapter a lora id yet (it does in its next
    /// reconcile of the pool).
    pub const WAITING_FOR_LORA_ID: &str = "WaitingForLoraId";
    /// The pool's children are applied and its pods ready.
    pub const POOL_READY: &str = "PoolReady";
    /// The pool's pods are not all ready yet.
    pub const PODS_NOT_READY: &str = "PodsNotReady";
    /// A pod of the pool cannot become ready by itself: unschedulable, crash-looping, its
    /// image not pulled, its config not mountable. The message names the pod and why.
    pub const PODS_FAILING: &str = "PodsFailing";
    /// `dynamic.replicas` is 0: nothing serves the pool's Service.
    pub const SCALED_TO_ZERO: &str = "ScaledToZero";
    /// A worker exits at start because the base model does not fit the device memory budget
    /// (its termination message starts with `model_does_not_fit:`).
    pub const MODEL_DOES_NOT_FIT: &str = "ModelDoesNotFit";
    /// A worker exits at start because it refuses its WorkerConfig (`config_io`,
    /// `config_parse`, `config_invalid`) or a path in it (`path_outside_root`).
    pub const WORKER_CONFIG_REFUSED: &str = "WorkerConfigRefused";
    /// A worker exits at start because its base is a quantized checkpoint of a variant it does
    /// not serve (act-order GPTQ, 3-bit, AWQ GEMV packing...; its termination message starts
    /// with `unsupported_quantization:` and names the variant). No restart fixes it: the pool
    /// needs another checkpoint.
    pub const UNSUPPORTED_QUANTIZATION: &str = "UnsupportedQuantization";
    /// Every ready dynamic pod accepted the pool's current config.
    pub const CONFIG_APPLIED: &str = "ConfigApplied";
    /// Ready pods still read an older copy of the config file (the kubelet refreshes mounted
    /// ConfigMaps up to a minute late); they are asked again every few seconds.
    pub const RELOADING: &str = "Reloading";
    /// A ready pod refused `POST /admin/reload` or did not answer; the message names the pod
    /// and the worker's error code. Asked again with a backoff.
    pub const RELOAD_FAILED: &str = "ReloadFailed";
    /// A merge Job was created.
    pub const MERGE_STARTED: &str = "MergeStarted";
    /// A merge Job succeeded.
    pub const MERGE_SUCCEEDED: &str = "MergeSucceeded";
    /// A merge Job failed; the message carries the tool's reason.
    pub const MERGE_FAILED: &str = "MergeFailed";
    /// The merge of one set of inputs failed `MAX_MERGE_ATTEMPTS` times in a row and is not
    /// retried until they change (version, source, merge settings, base model); the message
    /// carries the tool's last reason.
    pub const MERGE_GAVE_UP: &str = "MergeGaveUp";
    /// The adapter's accuracy is under the pool's `minAccuracy`.
    pub const BELOW_MIN_ACCURACY: &str = "BelowMinAccuracy";
    /// Rolled back to a version kept in history without a merge.
    pub const ROLLED_BACK: &str = "RolledBack";
    /// The adapter was removed from the pool and unloaded from its pods.
    pub const UNREGISTERED: &str = "Unregistered";
    /// A fetch Job runs for the adapter's `source.uri`.
    pub const FETCHING: &str = "Fetching";
    /// A fetch Job succeeded: the pool's pods may load the version.
    pub const FETCH_SUCCEEDED: &str = "FetchSucceeded";
    /// A fetch Job failed; the message carries the tool's reason.
    pub const FETCH_FAILED: &str = "FetchFailed";
    /// An API call failed; the operator retries with backoff.
    pub const RECONCILE_ERROR: &str = "ReconcileError";
}
