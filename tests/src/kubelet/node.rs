//! The Node object and the kubelet's heartbeats: the node's Lease in `kube-node-lease`
//! renewed every 10 s (what the node lifecycle controller reads), and its status conditions'
//! heartbeat every minute.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::time::Duration;

use anyhow::Result;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::{json, Value};

/// How often the Lease is renewed (the kubelet's default: a quarter of its 40 s duration).
const LEASE_RENEW: Duration = Duration::from_secs(10);
/// How long the Lease holds.
const LEASE_SECONDS: i32 = 40;
/// How often the status conditions' heartbeat is written when nothing changes.
const STATUS_EVERY: Duration = Duration::from_secs(60);

fn micro_now() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%S.%6fZ")
        .to_string()
}

fn now() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

/// What the node reports of itself.
pub struct NodeSpec<'a> {
    /// Name.
    pub name: &'a str,
    /// Labels besides the well-known ones (`kubernetes.io/hostname`, `/os`, `/arch`).
    pub labels: &'a BTreeMap<String, String>,
    /// Capacity (= allocatable).
    pub capacity: &'a BTreeMap<String, String>,
    /// InternalIP.
    pub ip: Ipv4Addr,
    /// The log endpoint's port.
    pub port: u16,
}

fn conditions(heartbeat: &str, since: &str) -> Value {
    let c = |t: &str, s: &str, reason: &str, message: &str| {
        json!({"type": t, "status": s, "reason": reason, "message": message,
               "lastHeartbeatTime": heartbeat, "lastTransitionTime": since})
    };
    json!([
        c(
            "MemoryPressure",
            "False",
            "KubeletHasSufficientMemory",
            "kubelet has sufficient memory available"
        ),
        c(
            "DiskPressure",
            "False",
            "KubeletHasNoDiskPressure",
            "kubelet has no disk pressure"
        ),
        c(
            "PIDPressure",
            "False",
            "KubeletHasSufficientPID",
            "kubelet has sufficient PID available"
        ),
        c(
            "Ready",
            "True",
            "KubeletReady",
            "kubelet is posting ready status"
        ),
    ])
}

/// Registers the node (replacing a stale one of the same name) with its status, and its
/// Lease; returns the time its conditions hold since.
pub async fn register(client: &Client, n: &NodeSpec<'_>) -> Result<String> {
    let nodes: Api<Node> = Api::all(client.clone());
    if nodes.get_opt(n.name).await?.is_some() {
        nodes.delete(n.name, &DeleteParams::default()).await?;
        crate::cluster::wait_for(
            Duration::from_secs(30),
            "the stale node's deletion",
            || async { nodes.get_opt(n.name).await.ok()?.is_none().then_some(()) },
        )
        .await?;
    }
    let mut labels = n.labels.clone();
    labels.insert("kubernetes.io/hostname".into(), n.name.into());
    labels.insert("kubernetes.io/os".into(), "linux".into());
    labels.insert(
        "kubernetes.io/arch".into(),
        std::env::consts::ARCH.replace("x86_64", "amd64"),
    );
    let node: Node = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": n.name, "labels": labels},
        "spec": {},
    }))?;
    let created = nodes.create(&PostParams::default(), &node).await?;
    let since = now();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let status = json!({"status": {
        "capacity": n.capacity,
        "allocatable": n.capacity,
        "conditions": conditions(&since, &since),
        "addresses": [{"type": "InternalIP", "address": n.ip.to_string()}],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": n.port}},
        "nodeInfo": {
            "machineID": n.name, "systemUUID": n.name, "bootID": boot.trim(),
            "kernelVersion": kernel.trim(), "osImage": "mole test kubelet (local processes)",
            "containerRuntimeVersion": "mole-test://0.1.0",
            "kubeletVersion": crate::cluster::K8S_VERSION, "kubeProxyVersion": "",
            "operatingSystem": "linux", "architecture": std::env::consts::ARCH.replace("x86_64", "amd64"),
        },
    }});
    nodes
        .patch_status(n.name, &PatchParams::default(), &Patch::Merge(status))
        .await?;
    let leases: Api<Lease> = Api::namespaced(client.clone(), "kube-node-lease");
    let lease: Lease = serde_json::from_value(json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": n.name, "ownerReferences": [{
            "apiVersion": "v1", "kind": "Node", "name": n.name,
            "uid": created.metadata.uid.unwrap_or_default()}]},
        "spec": {"holderIdentity": n.name, "leaseDurationSeconds": LEASE_SECONDS,
                 "renewTime": micro_now()},
    }))?;
    if leases.get_opt(n.name).await?.is_some() {
        leases.delete(n.name, &DeleteParams::default()).await?;
    }
    leases.create(&PostParams::default(), &lease).await?;
    Ok(since)
}

/// Renews the Lease every 10 s and writes the status heartbeat every minute, forever.
pub async fn heartbeat(client: Client, name: String, since: String) {
    let leases: Api<Lease> = Api::namespaced(client.clone(), "kube-node-lease");
    let nodes: Api<Node> = Api::all(client);
    let mut last_status = tokio::time::Instant::now();
    loop {
        tokio::time::sleep(LEASE_RENEW).await;
        let _ = leases
            .patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"renewTime": micro_now()}})),
            )
            .await;
        if last_status.elapsed() >= STATUS_EVERY {
            let patch = json!({"status": {"conditions": conditions(&now(), &since)}});
            if nodes
                .patch_status(&name, &PatchParams::default(), &Patch::Strategic(patch))
                .await
                .is_ok()
            {
                last_status = tokio::time::Instant::now();
            }
        }
    }
}
