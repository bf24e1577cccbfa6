//! Event reasons of the operator besides the condition reasons in
//! `mole_crds::constants::reason`. Stable names, like those.

/// Merged pods serve the desired version (promotion or roll-forward completed).
pub const PROMOTED: &str = "Promoted";
/// The merged Deployment, Service, PDB and ConfigMaps were removed (the adapter is served
/// dynamically again).
pub const MERGED_REMOVED: &str = "MergedPodsRemoved";
