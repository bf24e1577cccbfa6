//! Real-cluster suite: runs only when `MOLE_E2E_KUBECONFIG` names a kubeconfig of a cluster
//! where the chart is installed (scripts/kind-e2e.sh does all of it with kind). Without it,
//! every test prints why it skipped and passes.
//!
//! The merge scenario also needs the tiny model fixtures on the nodes: scripts/kind-e2e.sh
//! copies `tests/fixtures/engine/llama` (base) and two llama adapters into a host directory
//! that kind mounts into the node at `MOLE_E2E_MODELS_HOSTPATH` (default `/mole-models`); the
//! test serves it through a hostPath PersistentVolume.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test

use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, PersistentVolume, PersistentVolumeClaim};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
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
                 "gpu": {"count": 0}, "dynamic": {"replicas": 1}}
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

/// `kubectl patch adapter <name> --type merge -p <patch>`, as the README writes it.
async fn kubectl_patch(adapters: &Api<Adapter>, name: &str, patch: serde_json::Value) {
    adapters
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
}

/// Waits until the adapter is Ready, merged, on `version`, and returns its status.
async fn wait_merged_ready(adapters: &Api<Adapter>, version: &str) -> mole_crds::AdapterStatus {
    wait(
        600,
        &format!("calendar merged and Ready on {version}"),
        || async {
            let a = adapters.get("calendar").await.ok()?;
            let st = a.status?;
            (st.phase == AdapterPhase::Ready
                && st.serving_mode == Some(mole_crds::ServingMode::Merged)
                && st.active_version.as_deref() == Some(version)
                && st.observed_generation == a.metadata.generation)
                .then_some(st)
        },
    )
    .await
}

/// The merged output the Deployment `tiny-calendar` serves (pod-template annotation).
async fn served_output(deploys: &Api<Deployment>) -> String {
    let d = deploys.get("tiny-calendar").await.unwrap();
    d.spec
        .unwrap()
        .template
        .metadata
        .unwrap()
        .annotations
        .unwrap()["mole.dev/merged-output"]
        .clone()
}

#[tokio::test]
async fn merge_serve_and_roll_back_on_a_real_cluster() {
    let Some(client) = client().await else { return };
    let host_path =
        std::env::var("MOLE_E2E_MODELS_HOSTPATH").unwrap_or_else(|_| "/mole-models".into());
    let ns = format!("mole-e2e-merge-{}", std::process::id());
    let nss: Api<Namespace> = Api::all(client.clone());
    nss.create(
        &PostParams::default(),
        &serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}))
        .unwrap(),
    )
    .await
    .unwrap();
    // The fixtures' directory on the node, as a PV bound to the PVC `models` of this namespace.
    let pv_name = format!("{ns}-models");
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    pvs.create(
        &PostParams::default(),
        &serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv_name},
            "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"],
                     "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                     "hostPath": {"path": host_path, "type": "Directory"},
                     "claimRef": {"namespace": ns, "name": "models"}}}))
        .unwrap(),
    )
    .await
    .unwrap();
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &ns);
    pvcs.create(
        &PostParams::default(),
        &serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "models"},
            "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": pv_name,
                     "resources": {"requests": {"storage": "1Gi"}}}}))
        .unwrap(),
    )
    .await
    .unwrap();

    // kubectl apply -f pool.yaml: the tiny llama fixture on CPU.
    let pools: Api<InferencePool> = Api::namespaced(client.clone(), &ns);
    let pool: InferencePool = serde_json::from_value(serde_json::json!({
        "apiVersion": "mole.dev/v1alpha1", "kind": "InferencePool",
        "metadata": {"name": "tiny", "annotations": {"mole.dev/allow-cpu": "true"}},
        "spec": {"baseModel": {"name": "llama", "path": "base/llama", "dtype": "f32"},
                 "storage": {"claimName": "models"}, "imagePullPolicy": "Never",
                 "gpu": {"count": 0}, "dynamic": {"replicas": 1}}
    }))
    .unwrap();
    pools.create(&PostParams::default(), &pool).await.unwrap();
    wait(300, "pool Ready", || async {
        let p = pools.get("tiny").await.ok()?;
        (p.status?.phase == mole_crds::PoolPhase::Ready).then_some(())
    })
    .await;

    // kubectl apply -f adapter-calendar.yaml (dynamic first): Ready once the pod loaded it,
    // which needs the operator's token on GET /v1/lora_adapters and a reload.
    let adapters: Api<Adapter> = Api::namespaced(client.clone(), &ns);
    let cal: Adapter = serde_json::from_value(serde_json::json!({
        "apiVersion": "mole.dev/v1alpha1", "kind": "Adapter", "metadata": {"name": "calendar"},
        "spec": {"pool": "tiny", "version": "v1", "source": {"path": "adapters/calendar/v1"},
                 "label": "calendar", "keywords": ["calendar"]}}))
    .unwrap();
    adapters.create(&PostParams::default(), &cal).await.unwrap();
    wait(300, "calendar Ready dynamically", || async {
        let st = adapters.get("calendar").await.ok()?.status?;
        (st.phase == AdapterPhase::Ready).then_some(())
    })
    .await;

    // Promote: kubectl patch adapter calendar --type merge -p '{"spec":{"serving":{"mode":"merged"}}}'
    kubectl_patch(
        &adapters,
        "calendar",
        serde_json::json!({"spec": {"serving": {"mode": "merged"}}}),
    )
    .await;
    let st = wait_merged_ready(&adapters, "v1").await;
    let deploys: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    let v1_out = st.history[0].merged_output.clone().unwrap();
    assert!(v1_out.starts_with("merged/calendar/v1-"), "{v1_out}");
    assert_eq!(served_output(&deploys).await, v1_out);
    assert_eq!(
        st.endpoint.as_deref(),
        Some(format!("http://tiny-calendar.{ns}.svc:8000").as_str())
    );
    let p = pools.get("tiny").await.unwrap().status.unwrap();
    assert_eq!(p.merged.len(), 1, "pool status lists the merged Deployment");

    // Roll forward: kubectl patch ... '{"spec":{"version":"v2","source":{"path":"adapters/calendar/v2"}}}'
    kubectl_patch(
        &adapters,
        "calendar",
        serde_json::json!({"spec": {"version": "v2", "source": {"path": "adapters/calendar/v2"}}}),
    )
    .await;
    let st = wait_merged_ready(&adapters, "v2").await;
    let v2_out = st.history[0].merged_output.clone().unwrap();
    assert_ne!(v2_out, v1_out);
    assert_eq!(served_output(&deploys).await, v2_out);
    assert!(st
        .history
        .iter()
        .any(|r| r.merged_output.as_deref() == Some(v1_out.as_str())));

    // Roll back: kubectl patch ... '{"spec":{"version":"v1","source":{"path":"adapters/calendar/v1"}}}'
    let jobs: Api<Job> = Api::namespaced(client.clone(), &ns);
    let merge_jobs = || async {
        let lp = ListParams::default()
            .labels("mole.dev/adapter=calendar,app.kubernetes.io/component=merge");
        let mut names: Vec<String> = jobs
            .list(&lp)
            .await
            .unwrap()
            .items
            .into_iter()
            .filter_map(|j| j.metadata.name)
            .collect();
        names.sort();
        names
    };
    let before = merge_jobs().await;
    kubectl_patch(
        &adapters,
        "calendar",
        serde_json::json!({"spec": {"version": "v1", "source": {"path": "adapters/calendar/v1"}}}),
    )
    .await;
    let st = wait_merged_ready(&adapters, "v1").await;
    assert_eq!(merge_jobs().await, before, "rollback runs no merge Job");
    assert_eq!(served_output(&deploys).await, v1_out);
    assert_eq!(st.history[0].version, "v1");

    adapters
        .delete("calendar", &DeleteParams::default())
        .await
        .unwrap();
    wait(120, "calendar deleted", || async {
        adapters
            .get_opt("calendar")
            .await
            .ok()?
            .is_none()
            .then_some(())
    })
    .await;
    nss.delete(&ns, &DeleteParams::default()).await.unwrap();
    pvs.delete(&pv_name, &DeleteParams::default())
        .await
        .unwrap();
}
