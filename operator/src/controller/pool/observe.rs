//! Observe: what the pool controller reads before it builds anything.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::ListParams;
use kube::{Api, ResourceExt};
use mole_crds::constants::{LABEL_APP_COMPONENT, LABEL_APP_INSTANCE};
use mole_crds::{Adapter, InferencePool};

use crate::controller::context::Context;
use crate::error::Result;
use crate::resources;

/// What the pool controller observed.
pub(super) struct Observed {
    /// Every Adapter of the namespace (the pool's are picked when building).
    pub adapters: Vec<Adapter>,
    /// The live `<pool>-config`.
    pub config_map: Option<ConfigMap>,
    /// The live `<pool>-dynamic` Deployment.
    pub deployment: Option<Deployment>,
    /// The live Service `<pool>`.
    pub service: Option<Service>,
    /// The live PDB of the dynamic pods.
    pub pdb: Option<PodDisruptionBudget>,
    /// The pool's merged Deployments (owned by their Adapters, reported in the pool's status).
    pub merged: Vec<Deployment>,
}

/// Reads the pool's adapters and the live children the pool controller writes or reports.
pub(super) async fn observe(pool: &InferencePool, ctx: &Context) -> Result<Observed> {
    let ns = pool.namespace().unwrap_or_default();
    let name = pool.name_any();
    let c = &ctx.client;
    let adapters: Api<Adapter> = Api::namespaced(c.clone(), &ns);
    let deployments: Api<Deployment> = Api::namespaced(c.clone(), &ns);
    let merged = ListParams::default().labels(&format!(
        "{LABEL_APP_INSTANCE}={name},{LABEL_APP_COMPONENT}=merged"
    ));
    Ok(Observed {
        adapters: adapters.list(&ListParams::default()).await?.items,
        config_map: Api::<ConfigMap>::namespaced(c.clone(), &ns)
            .get_opt(&resources::config_map_name(&name))
            .await?,
        deployment: deployments.get_opt(&resources::dynamic_name(&name)).await?,
        service: Api::<Service>::namespaced(c.clone(), &ns)
            .get_opt(&name)
            .await?,
        pdb: Api::<PodDisruptionBudget>::namespaced(c.clone(), &ns)
            .get_opt(&resources::dynamic_name(&name))
            .await?,
        merged: deployments.list(&merged).await?.items,
    })
}
