//! Services in front of worker pods: `<pool>` for the dynamic pods, `<pool>-<adapter>` for an
//! adapter's merged pods.

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use mole_crds::constants::SERVICE_PORT;
use mole_crds::InferencePool;

use super::meta::ChildMeta;
use super::pod::WORKER_PORT_NAME;

/// The Service `<pool>` in front of the dynamic pods.
pub fn service(pool: &InferencePool) -> Service {
    let name = pool.metadata.name.clone().unwrap_or_default();
    worker_service(&ChildMeta::of_pool(pool, "dynamic"), name)
}

/// A Service `name` on the pods `meta` selects. It listens on [`SERVICE_PORT`] (the
/// endpoint URLs the operator publishes) and forwards to each pod's named worker port,
/// whatever number the operator's `--worker-port` gave it.
pub fn worker_service(meta: &ChildMeta, name: String) -> Service {
    Service {
        metadata: meta.named(name),
        spec: Some(ServiceSpec {
            selector: Some(meta.selector.clone()),
            ports: Some(vec![ServicePort {
                name: Some(WORKER_PORT_NAME.into()),
                port: i32::from(SERVICE_PORT),
                target_port: Some(IntOrString::String(WORKER_PORT_NAME.into())),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        status: None,
    }
}

/// In-cluster URL of the pool's Service.
pub fn endpoint(pool: &InferencePool) -> String {
    format!(
        "http://{}.{}.svc:{SERVICE_PORT}",
        pool.metadata.name.clone().unwrap_or_default(),
        pool.metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into())
    )
}
