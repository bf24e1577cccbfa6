//! Event reasons of the operator besides the condition reasons in
//! `mole_crds::constants::reason`. Stable names, like those.

/// Merged pods serve the desired version (promotion or roll-forward completed).
pub const PROMOTED: &str = "Promoted";
/// The merged Deployment, Service, PDB and ConfigMaps were removed (the adapter is served
/// dynamically again).
pub const MERGED_REMOVED: &str = "MergedPodsRemoved";
/// A merge Job of an older merge key (or of an adapter now served dynamically) was deleted
/// while it ran: nobody would serve its output.
pub const MERGE_SUPERSEDED: &str = "MergeSuperseded";
/// The adapter's pool is gone: its merged Deployment, Service, PDB, ConfigMaps and unfinished
/// Jobs, which the pool's deletion does not garbage-collect (the Adapter owns them), were
/// removed.
pub const POOL_CHILDREN_REMOVED: &str = "PoolChildrenRemoved";
/// The deleted adapter's merged outputs are pruned by a cleanup Job (owned by the pool, so it
/// outlives the Adapter).
pub const PRUNING_MERGED_OUTPUTS: &str = "PruningMergedOutputs";
/// The deleted adapter's merged outputs stay on the volume: its pool is gone, so no Job can
/// mount the volume to delete them.
pub const MERGED_OUTPUTS_LEFT: &str = "MergedOutputsLeft";
/// A canary version started taking its share of an adapter's requests (`spec.canary`).
pub const CANARY_STARTED: &str = "CanaryStarted";
/// The canary has too few requests for a verdict, or no analysis (`status.canary.reason`).
pub const CANARY_PROGRESSING: &str = "CanaryProgressing";
/// The canary stayed within its analysis bounds over `minRequests`: ready to be promoted by
/// an apply.
pub const CANARY_PASSED: &str = "CanaryPassed";
/// The analysis found the canary worse than the stable version beyond a bound: its traffic
/// went back to the stable version (a Warning with the numbers).
pub const CANARY_ROLLED_BACK: &str = "CanaryRolledBack";
/// An apply made the canary's version the stable one and dropped `spec.canary`.
pub const CANARY_PROMOTED: &str = "CanaryPromoted";
/// An apply dropped `spec.canary` without promoting it: the stable version takes all requests.
pub const CANARY_REMOVED: &str = "CanaryRemoved";
/// An idle adapter's merged pods were scaled to zero (the pool's `merge.scaleToZero`); the
/// dynamic pods serve it. Also the `Ready` reason while it stays so.
pub const SCALED_TO_ZERO: &str = "ScaledToZero";
/// Requests came back for an adapter whose merged pods were scaled to zero: they scale up again.
pub const SCALED_FROM_ZERO: &str = "ScaledFromZero";
