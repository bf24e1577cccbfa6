//! Real-cluster suite: runs only when `MOLE_E2E_KUBECONFIG` names a kubeconfig of a cluster
//! where the chart is installed (scripts/kind-e2e.sh does all of it with kind). Without it,
//! every test prints why it skipped and passes.

use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::api::{DeleteParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};
use mole_crds::{Adapter, AdapterPhase, InferencePool};

async fn client() -> Option<Client> {
    let Ok(path) = std::env::var("MOLE_E2E_KUBECONFIG") else {
        eprintln!("SKIPPED: MOLE_E2E_KUBECONFIG is not set (run scripts/kind-e2e.sh)");
        return None;
    };
    let kc = Kubeconfig::read_from(&path).expect("kubeconfig readable");
    let cfg = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .expect("kubeconfig valid");
    Some(Client::try_from(cfg).expect("client"))
}

/// Polls `f` every second until it returns Some, for at most `secs`.
async fn wait<T, F, Fut>(secs: u64, what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    for _ in 0..secs {
        if let Some(v) = f().await {
            return v;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    panic!("timed out waiting for {what}");
}

#[tokio::test]
async fn pool_and_adapter_lifecycle_on_a_real_cluster() {
    let Some(client) = client().await else { return };
    let ns = format!("mole-e2e-{}", std::process::id());
    let nss: Api<Namespace> = Api::all(client.clone());
    nss.create(
        &PostParams::default(),
        &serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}))
        .unwrap(),
    )
    .await
    .unwrap();

    let pools: Api<InferencePool> = Api::namespaced(client.clone(), &ns);
    let pool: InferencePool = serde_json::from_value(serde_json::json!({
        "apiVersion": "mole.dev/v1alpha1", "kind": "InferencePool",
        "metadata": {"name": "vl", "annotations": {"mole.dev/allow-cpu": "true"}},
        "spec": {"baseModel": {"name": "tiny", "path": "base/tiny"}, "storage": {"claimName": "models"},
                 "image": "mole:e2e", "gpu": {"count": 0}, "dynamic": {"replicas": 1}}
    }))
    .unwrap();
    pools.create(&PostParams::default(), &pool).await.unwrap();

    let deploys: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    wait(60, "vl-dynamic", || async {
        deploys.get_opt("vl-dynamic").await.ok().flatten()
    })
    .await;

    // The API server itself refuses an absolute source path (CEL rule).
    let adapters: Api<Adapter> = Api::namespaced(client.clone(), &ns);
    let bad: Adapter = serde_json::from_value(serde_json::json!({
        "apiVersion": "mole.dev/v1alpha1", "kind": "Adapter", "metadata": {"name": "bad"},
        "spec": {"pool": "vl", "version": "v1", "source": {"path": "/etc/passwd"}}}))
    .unwrap();
    let err = adapters
        .create(&PostParams::default(), &bad)
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("source.path must be relative"),
        "{err}"
    );

    let good: Adapter = serde_json::from_value(serde_json::json!({
        "apiVersion": "mole.dev/v1alpha1", "kind": "Adapter", "metadata": {"name": "calendar"},
        "spec": {"pool": "vl", "version": "v1", "source": {"path": "adapters/calendar/v1"}, "label": "calendar"}}))
    .unwrap();
    adapters
        .create(&PostParams::default(), &good)
        .await
        .unwrap();
    let id = wait(60, "lora id", || async {
        adapters.get("calendar").await.ok()?.status?.lora_id
    })
    .await;
    assert_eq!(id, 1);
    wait(60, "config lists calendar", || async {
        let cm = cms.get("vl-config").await.ok()?;
        cm.data?
            .get("worker.json")?
            .contains("adapters/calendar/v1")
            .then_some(())
    })
    .await;
    // No worker pod serves it (the CPU pool has no model on its volume): never Ready.
    let a = adapters.get("calendar").await.unwrap();
    assert_ne!(a.status.unwrap().phase, AdapterPhase::Ready);

    adapters
        .delete("calendar", &DeleteParams::default())
        .await
        .unwrap();
    wait(60, "calendar deleted", || async {
        adapters
            .get_opt("calendar")
            .await
            .ok()?
            .is_none()
            .then_some(())
    })
    .await;
    let p = pools.get("vl").await.unwrap();
    assert!(!p.status.unwrap().lora_ids.contains_key("calendar"));
    nss.delete(&ns, &DeleteParams::default()).await.unwrap();
}
