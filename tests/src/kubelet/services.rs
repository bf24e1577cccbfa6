//! Services without kube-proxy: the test resolves a Service through its EndpointSlices
//! ([`service_url`]), and pods resolve `<svc>`, `<svc>.<ns>`, `<svc>.<ns>.svc` and
//! `<svc>.<ns>.svc.cluster.local` through their `/etc/hosts`, which maps each name to the
//! Service's ready endpoints.
//!
//! Why names rather than ClusterIPs DNAT'ed by iptables as kube-proxy does: the host's network
//! namespace (and its netfilter tables) is shared with every other build and test on the
//! machine, so rules there would reach beyond the test and outlive a killed one; bridged
//! traffic would also need `br_netfilter` for hairpin cases. A name maps to a pod's address,
//! which is right only when the Service's port equals the port the pod listens on (its
//! resolved `targetPort`): true of mole's Services. A Service whose ports differ is left out
//! of the hosts files (a name that does not resolve, not one that reaches the wrong port).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use anyhow::{Context as _, Result};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::ListParams;
use kube::runtime::reflector::Store;
use kube::{Api, Client, ResourceExt as _};

/// The label that ties an EndpointSlice to its Service.
const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// The ready addresses of `slices` and each port name's number.
fn ready_endpoints(slices: &[&EndpointSlice]) -> (Vec<String>, BTreeMap<String, i32>) {
    let mut ips = Vec::new();
    let mut ports = BTreeMap::new();
    for s in slices {
        for p in s.ports.iter().flatten() {
            if let Some(n) = p.port {
                ports.insert(p.name.clone().unwrap_or_default(), n);
            }
        }
        for e in &s.endpoints {
            // A missing `ready` means ready (the API's convention).
            let ready = e.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true);
            if ready {
                ips.extend(e.addresses.iter().cloned());
            }
        }
    }
    (ips, ports)
}

/// The hosts-file lines of every Service whose ready endpoints listen on the Service's own
/// ports, as seen from a pod in namespace `pod_ns` (the short name only for its namespace).
pub fn hosts_lines(
    services: &Store<Service>,
    slices: &Store<EndpointSlice>,
    pod_ns: &str,
) -> String {
    let all_slices = slices.state();
    let mut lines = String::new();
    let mut svcs = services.state();
    svcs.sort_by_key(|s| (s.namespace(), s.name_any()));
    for svc in svcs {
        let ns = svc.namespace().unwrap_or_default();
        let name = svc.name_any();
        let mine: Vec<&EndpointSlice> = all_slices
            .iter()
            .filter(|s| {
                s.namespace().as_deref() == Some(ns.as_str())
                    && s.labels().get(SERVICE_NAME_LABEL) == Some(&name)
            })
            .map(|s| s.as_ref())
            .collect();
        let (ips, ports) = ready_endpoints(&mine);
        let same_ports = svc
            .spec
            .as_ref()
            .and_then(|s| s.ports.as_ref())
            .is_some_and(|ps| {
                ps.iter()
                    .all(|p| ports.get(p.name.as_deref().unwrap_or("")) == Some(&p.port))
            });
        if !same_ports {
            continue;
        }
        let mut names = vec![
            format!("{name}.{ns}"),
            format!("{name}.{ns}.svc"),
            format!("{name}.{ns}.svc.cluster.local"),
        ];
        if ns == pod_ns {
            names.insert(0, name.clone());
        }
        for ip in ips {
            let _ = writeln!(lines, "{ip}\t{}", names.join(" "));
        }
    }
    lines
}

/// `http://<ip>:<port>` of a ready endpoint of Service `ns/name`'s port `port`, through its
/// EndpointSlices (the port its pods listen on, the Service's `targetPort` resolved).
pub async fn service_url(client: &Client, ns: &str, name: &str, port: i32) -> Result<String> {
    let svc = Api::<Service>::namespaced(client.clone(), ns)
        .get(name)
        .await
        .with_context(|| format!("service {ns}/{name}"))?;
    let sp = svc
        .spec
        .as_ref()
        .and_then(|s| s.ports.as_ref())
        .and_then(|ps| ps.iter().find(|p| p.port == port))
        .with_context(|| format!("service {ns}/{name} has no port {port}"))?;
    let slices = Api::<EndpointSlice>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(&format!("{SERVICE_NAME_LABEL}={name}")))
        .await?;
    let refs: Vec<&EndpointSlice> = slices.items.iter().collect();
    let (ips, ports) = ready_endpoints(&refs);
    let ip = ips
        .first()
        .with_context(|| format!("service {ns}/{name} has no ready endpoint"))?;
    let target = ports
        .get(sp.name.as_deref().unwrap_or(""))
        .with_context(|| format!("service {ns}/{name}: no endpoint port for {port}"))?;
    Ok(format!("http://{ip}:{target}"))
}
