//! Builders: what gets created for a pool, and what must not restart pods.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{LocalObjectReference, PodSpec, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use mole_crds::constants::{ANNOTATION_SPEC_HASH, SERVICE_PORT, WORKER_CONFIG_MOUNT, WORKER_PORT};
use mole_crds::{Adapter, InferencePool, WorkerConfig, WorkerMode};

use super::*;

fn pool() -> InferencePool {
    serde_yaml::from_str(
        r#"
apiVersion: mole.dev/v1alpha1
kind: InferencePool
metadata: {name: vl, namespace: ml, uid: "uid-1"}
spec:
  baseModel: {name: Qwen/Qwen3-VL-8B-Instruct, path: base/qwen3-vl-8b}
  storage: {claimName: models}
  image: ghcr.io/mole-dev/mole-worker:0.1.0
  gpu:
    count: 1
    nodeSelector: {nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3}
    tolerations: [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]
  resources: {requests: {cpu: "4", memory: 32Gi}, limits: {memory: 64Gi}}
  dynamic: {replicas: 2, maxLoras: 4}
  router: {strategies: [explicit, keywords]}
"#,
    )
    .unwrap()
}

fn adapter(name: &str, version: &str) -> Adapter {
    serde_yaml::from_str(&format!(
        r#"
apiVersion: mole.dev/v1alpha1
kind: Adapter
metadata: {{name: {name}, namespace: ml}}
spec:
  pool: vl
  version: {version}
  source: {{path: adapters/{name}/{version}}}
  label: {name}
  keywords: [{name}]
"#
    ))
    .unwrap()
}

fn template_hash(d: &Deployment) -> String {
    d.spec
        .as_ref()
        .unwrap()
        .template
        .metadata
        .as_ref()
        .unwrap()
        .annotations
        .as_ref()
        .unwrap()[ANNOTATION_SPEC_HASH]
        .clone()
}

#[test]
fn dynamic_deployment_runs_the_worker_on_gpus_securely() {
    let p = pool();
    let d = dynamic_deployment(&p, WORKER_PORT, &WorkerDefaults::default());
    assert_eq!(d.metadata.name.as_deref(), Some("vl-dynamic"));
    assert_eq!(
        d.metadata.owner_references.as_ref().unwrap()[0].uid,
        "uid-1"
    );
    let spec = d.spec.unwrap();
    assert_eq!(spec.replicas, Some(2));
    let pod = spec.template.spec.unwrap();
    assert_eq!(
        pod.node_selector.unwrap()["nvidia.com/gpu.product"],
        "NVIDIA-H100-80GB-HBM3"
    );
    assert_eq!(pod.tolerations.unwrap().len(), 1);
    let sec = pod.security_context.unwrap();
    assert_eq!(sec.run_as_non_root, Some(true));
    let c = &pod.containers[0];
    assert_eq!(
        c.args.as_ref().unwrap()[..3],
        [
            "serve".to_string(),
            "--config".into(),
            "/etc/mole/worker.json".into()
        ]
    );
    let res = c.resources.as_ref().unwrap();
    assert_eq!(res.limits.as_ref().unwrap()["nvidia.com/gpu"].0, "1");
    assert_eq!(res.requests.as_ref().unwrap()["nvidia.com/gpu"].0, "1");
    assert_eq!(res.requests.as_ref().unwrap()["memory"].0, "32Gi");
    let cs = c.security_context.as_ref().unwrap();
    assert_eq!(cs.read_only_root_filesystem, Some(true));
    assert_eq!(cs.allow_privilege_escalation, Some(false));
    assert_eq!(cs.seccomp_profile.as_ref().unwrap().type_, "RuntimeDefault");
    assert_eq!(
        cs.capabilities.as_ref().unwrap().drop.as_ref().unwrap(),
        &["ALL".to_string()]
    );
    let models = c
        .volume_mounts
        .as_ref()
        .unwrap()
        .iter()
        .find(|m| m.name == "models")
        .unwrap();
    assert_eq!(models.read_only, Some(true));
    assert_eq!(models.mount_path, "/models");
    assert_eq!(
        c.readiness_probe
            .as_ref()
            .unwrap()
            .http_get
            .as_ref()
            .unwrap()
            .path
            .as_deref(),
        Some("/readyz")
    );
    assert_eq!(
        c.liveness_probe
            .as_ref()
            .unwrap()
            .http_get
            .as_ref()
            .unwrap()
            .path
            .as_deref(),
        Some("/healthz")
    );
    let vol = pod.volumes.unwrap();
    let pvc = vol.iter().find(|v| v.name == "models").unwrap();
    assert_eq!(
        pvc.persistent_volume_claim.as_ref().unwrap().read_only,
        Some(true)
    );
}

#[test]
fn only_base_image_limits_and_resources_roll_the_pods() {
    let p = pool();
    let h = template_hash(&dynamic_deployment(
        &p,
        WORKER_PORT,
        &WorkerDefaults::default(),
    ));
    // Adapters change the ConfigMap only.
    let a = [adapter("calendar", "v1")];
    let reg: Vec<Registered> = a
        .iter()
        .map(|adapter| Registered {
            adapter,
            lora_id: 1,
        })
        .collect();
    let (cm1, hash1) = config_map(&p, &worker_config("vl", &p.spec, &reg));
    let (_, hash0) = config_map(&p, &worker_config("vl", &p.spec, &[]));
    assert_ne!(hash1, hash0);
    assert!(cm1.data.unwrap()["worker.json"].contains("adapters/calendar/v1"));
    assert_eq!(
        template_hash(&dynamic_deployment(
            &p,
            WORKER_PORT,
            &WorkerDefaults::default()
        )),
        h
    );
    // Replicas and router settings do not restart pods either.
    let mut q = p.clone();
    q.spec.dynamic.replicas = Some(5);
    q.spec.router.min_confidence = 0.9;
    assert_eq!(
        template_hash(&dynamic_deployment(
            &q,
            WORKER_PORT,
            &WorkerDefaults::default()
        )),
        h
    );
    // Merge Job settings are not read by serving pods.
    q.spec.merge.priority_class_name = Some("batch".into());
    assert_eq!(
        template_hash(&dynamic_deployment(
            &q,
            WORKER_PORT,
            &WorkerDefaults::default()
        )),
        h
    );
    // Each of these does: every field a pod reads when it starts.
    let changes: Vec<fn(&mut InferencePool)> = vec![
        |p| p.spec.image = Some("ghcr.io/mole-dev/mole-worker:0.2.0".into()),
        |p| p.spec.image_pull_policy = Some("Always".into()),
        |p| {
            p.spec.image_pull_secrets = vec![LocalObjectReference {
                name: "regcred".into(),
            }]
        },
        |p| p.spec.base_model.path = "base/other".into(),
        |p| p.spec.storage.claim_name = "other".into(),
        |p| p.spec.dynamic.limits.max_loras = 8,
        |p| p.spec.dynamic.limits.max_seq_len = 8192,
        |p| p.spec.dynamic.limits.lora_dtype = Some(mole_crds::Dtype::Bf16),
        |p| p.spec.gpu.count = 2,
        |p| p.spec.gpu.tolerations.clear(),
        |p| p.spec.gpu.priority_class_name = Some("gpu-serving".into()),
        |p| p.spec.gpu.runtime_class_name = Some("nvidia".into()),
        |p| p.spec.resources = None,
    ];
    for (i, change) in changes.into_iter().enumerate() {
        let mut q = p.clone();
        change(&mut q);
        assert_ne!(
            template_hash(&dynamic_deployment(
                &q,
                WORKER_PORT,
                &WorkerDefaults::default()
            )),
            h,
            "change {i}"
        );
    }
}

#[test]
fn new_optional_fields_left_unset_keep_the_spec_hash() {
    // The hash of this spec before imagePullSecrets, priorityClassName and runtimeClassName
    // existed (computed at commit 2b89c36): pools that do not use them keep their hash.
    let p = pool();
    assert_eq!(
        spec_hash(&p.spec, p.spec.image.as_deref().unwrap()),
        "f028a05930e894c4"
    );
}

fn pod_of(d: &Deployment) -> PodSpec {
    d.spec.clone().unwrap().template.spec.unwrap()
}

fn adapter_owner() -> OwnerReference {
    OwnerReference {
        api_version: "mole.dev/v1alpha1".into(),
        kind: "Adapter".into(),
        name: "calendar".into(),
        uid: "uid-a".into(),
        ..Default::default()
    }
}

#[test]
fn dynamic_and_merged_pods_carry_the_pools_pod_settings() {
    let mut p = pool();
    p.spec.image_pull_secrets = vec![LocalObjectReference {
        name: "regcred".into(),
    }];
    p.spec.gpu.priority_class_name = Some("gpu-serving".into());
    p.spec.gpu.runtime_class_name = Some("nvidia".into());
    let (_, merged, _, _) = merged_children(
        &p,
        "calendar",
        "v1",
        "merged/calendar/v1-a",
        1,
        adapter_owner(),
        PodDefaults {
            port: WORKER_PORT,
            images: &WorkerDefaults::default(),
        },
    );
    for d in [
        dynamic_deployment(&p, WORKER_PORT, &WorkerDefaults::default()),
        merged,
    ] {
        let pod = pod_of(&d);
        assert_eq!(pod.image_pull_secrets.unwrap()[0].name, "regcred");
        assert_eq!(pod.priority_class_name.as_deref(), Some("gpu-serving"));
        assert_eq!(pod.runtime_class_name.as_deref(), Some("nvidia"));
        assert_eq!(
            pod.tolerations.unwrap()[0].key.as_deref(),
            Some("nvidia.com/gpu")
        );
        let sec = pod.security_context.unwrap();
        assert_eq!(sec.fs_group, Some(65532));
        assert_eq!(
            sec.fs_group_change_policy.as_deref(),
            Some("OnRootMismatch"),
            "the model volume is not chowned at every start"
        );
    }
    // Unset, they are absent (the API server's defaults apply).
    let pod = pod_of(&dynamic_deployment(
        &pool(),
        WORKER_PORT,
        &WorkerDefaults::default(),
    ));
    assert_eq!(pod.image_pull_secrets, None);
    assert_eq!(pod.priority_class_name, None);
    assert_eq!(pod.runtime_class_name, None);
}

/// The container port named by `svc`'s targetPort in `pod`.
fn target_port(svc: &Service, pod: &PodSpec) -> i32 {
    let sp = &svc.spec.as_ref().unwrap().ports.as_ref().unwrap()[0];
    let IntOrString::String(name) = sp.target_port.clone().unwrap() else {
        panic!("the Service targets the port by name, so each pod resolves its own");
    };
    pod.containers[0]
        .ports
        .as_ref()
        .unwrap()
        .iter()
        .find(|p| p.name.as_deref() == Some(name.as_str()))
        .unwrap()
        .container_port
}

#[test]
fn a_non_default_worker_port_is_used_everywhere_a_pod_is_reached() {
    let p = pool();
    let port = 9123;
    let (_, merged, merged_svc, _) = merged_children(
        &p,
        "calendar",
        "v1",
        "merged/calendar/v1-a",
        1,
        adapter_owner(),
        PodDefaults {
            port,
            images: &WorkerDefaults::default(),
        },
    );
    for (d, svc) in [
        (
            dynamic_deployment(&p, port, &WorkerDefaults::default()),
            service(&p),
        ),
        (merged, merged_svc),
    ] {
        let pod = pod_of(&d);
        let c = &pod.containers[0];
        let declared = c.ports.as_ref().unwrap();
        assert_eq!(declared.len(), 1);
        assert_eq!(declared[0].container_port, 9123);
        let args = c.args.as_ref().unwrap();
        let listen = &args[args.iter().position(|a| a == "--listen").unwrap() + 1];
        assert_eq!(listen, "0.0.0.0:9123");
        for probe in [&c.startup_probe, &c.liveness_probe, &c.readiness_probe] {
            let get = probe.as_ref().unwrap().http_get.as_ref().unwrap();
            assert_eq!(
                get.port,
                IntOrString::String(declared[0].name.clone().unwrap()),
                "probes name the worker port"
            );
        }
        assert_eq!(target_port(&svc, &pod), 9123);
        // The Service itself keeps its port: the published endpoints do not change.
        assert_eq!(
            svc.spec.unwrap().ports.unwrap()[0].port,
            i32::from(SERVICE_PORT)
        );
        assert!(
            !serde_json::to_string(&d)
                .unwrap()
                .contains(&WORKER_PORT.to_string()),
            "no trace of the default port in the pod template"
        );
    }
    assert_eq!(endpoint(&p), format!("http://vl.ml.svc:{SERVICE_PORT}"));
    // The default port renders the same way.
    let pod = pod_of(&dynamic_deployment(
        &p,
        WORKER_PORT,
        &WorkerDefaults::default(),
    ));
    assert_eq!(target_port(&service(&p), &pod), 8000);
}

#[test]
fn worker_config_lists_adapters_sorted_with_ids_and_limits() {
    let p = pool();
    let a = [adapter("login-window", "v2"), adapter("calendar", "v1")];
    let reg = vec![
        Registered {
            adapter: &a[0],
            lora_id: 7,
        },
        Registered {
            adapter: &a[1],
            lora_id: 3,
        },
    ];
    let wc = worker_config("vl", &p.spec, &reg);
    assert_eq!(wc.mode, WorkerMode::Dynamic);
    assert_eq!(wc.model_root, "/models");
    assert_eq!(wc.base_model.path, "base/qwen3-vl-8b");
    assert_eq!(
        wc.base_model.image_processor,
        mole_crds::ImageProcessor::Torchvision
    );
    let mut pil = p.spec.clone();
    pil.base_model.image_processor = mole_crds::ImageProcessor::Pil;
    assert_eq!(
        worker_config("vl", &pil, &reg).base_model.image_processor,
        mole_crds::ImageProcessor::Pil,
        "the pool's imageProcessor reaches the pods"
    );
    // Unset: the worker detects the formats from the chat template.
    assert_eq!(
        (
            wc.base_model.tool_call_parser,
            wc.base_model.reasoning_parser
        ),
        (None, None)
    );
    let mut named = p.spec.clone();
    named.base_model.tool_call_parser = Some("hermes".into());
    named.base_model.reasoning_parser = Some("deepseek_r1".into());
    for wc in [
        worker_config("vl", &named, &reg),
        merged_worker_config("vl", &named, "calendar", "v1", "merged/calendar-v1"),
    ] {
        assert_eq!(
            wc.base_model.tool_call_parser,
            Some(mole_crds::ToolCallParser::Hermes),
            "the pool's toolCallParser reaches {:?} pods",
            wc.mode
        );
        assert_eq!(
            wc.base_model.reasoning_parser,
            Some(mole_crds::ReasoningParser::DeepseekR1),
            "the pool's reasoningParser reaches {:?} pods",
            wc.mode
        );
        // As the worker reads it: vLLM's names in its config file.
        let json = serde_json::to_value(&wc).unwrap();
        assert_eq!(json["baseModel"]["toolCallParser"], "hermes");
        assert_eq!(json["baseModel"]["reasoningParser"], "deepseek_r1");
    }
    let names: Vec<_> = wc
        .adapters
        .iter()
        .map(|a| (a.name.as_str(), a.lora_id))
        .collect();
    assert_eq!(names, vec![("calendar", 3), ("login-window", 7)]);
    assert_eq!(wc.adapters[1].version, "v2");
    assert_eq!(wc.adapters[0].routing.keywords, vec!["calendar"]);
    assert_eq!(wc.limits.engine.max_loras, 4);
    assert_eq!(wc.limits.engine.lora_dtype, None);
    let mut q = p.clone();
    q.spec.dynamic.limits.lora_dtype = Some(mole_crds::Dtype::Bf16);
    assert_eq!(
        worker_config("vl", &q.spec, &reg).limits.engine.lora_dtype,
        Some(mole_crds::Dtype::Bf16)
    );
    // The JSON round-trips through the worker's type.
    let json = serde_json::to_string(&wc).unwrap();
    let back: WorkerConfig = serde_json::from_str(&json).unwrap();
    assert_eq!(back, wc);
}

#[test]
fn service_and_pdb_select_the_dynamic_pods() {
    let p = pool();
    let s = service(&p);
    assert_eq!(s.metadata.name.as_deref(), Some("vl"));
    let spec = s.spec.unwrap();
    let sel = spec.selector.unwrap();
    let pod_labels = dynamic_deployment(&p, WORKER_PORT, &WorkerDefaults::default())
        .spec
        .unwrap()
        .template
        .metadata
        .unwrap()
        .labels
        .unwrap();
    for (k, v) in &sel {
        assert_eq!(pod_labels.get(k), Some(v));
    }
    assert_eq!(spec.ports.unwrap()[0].port, 8000);
    let pdb = pdb(&p);
    assert_eq!(pdb.spec.unwrap().max_unavailable, Some(IntOrString::Int(1)));
    assert_eq!(endpoint(&p), "http://vl.ml.svc:8000");
}

#[test]
fn worker_config_follows_the_plan_recorded_in_the_status() {
    let p = pool();
    let mut a = adapter("calendar", "v1");
    // The status says merged and Ready, but the plan (recorded by the Adapter controller)
    // wants the dynamic pods to load it again: the plan wins.
    a.status = Some(mole_crds::AdapterStatus {
        phase: mole_crds::AdapterPhase::Ready,
        serving_mode: Some(mole_crds::ServingMode::Merged),
        endpoint: Some("http://vl-calendar.ml.svc:8000".into()),
        load_dynamic: Some(true),
        merged_endpoint: Some("http://vl-calendar.ml.svc:8000".into()),
        ..Default::default()
    });
    let mut q = p.clone();
    q.spec.merge.unload_from_dynamic = true;
    let reg = [Registered {
        adapter: &a,
        lora_id: 1,
    }];
    let wc = worker_config("vl", &q.spec, &reg);
    assert!(wc.adapters[0].load);
    assert_eq!(
        wc.adapters[0].merged_endpoint.as_deref(),
        Some("http://vl-calendar.ml.svc:8000")
    );
    a.status.as_mut().unwrap().load_dynamic = Some(false);
    a.status.as_mut().unwrap().merged_endpoint = None;
    let reg = [Registered {
        adapter: &a,
        lora_id: 1,
    }];
    let wc = worker_config("vl", &q.spec, &reg);
    assert!(!wc.adapters[0].load);
    assert_eq!(wc.adapters[0].merged_endpoint, None);
    // No status yet: loaded, not forwarded.
    let fresh = adapter("desktop", "v1");
    let reg = [Registered {
        adapter: &fresh,
        lora_id: 2,
    }];
    let wc = worker_config("vl", &q.spec, &reg);
    assert!(wc.adapters[0].load);
}

#[test]
fn every_worker_pod_mounts_the_operator_token_and_its_config_names_it() {
    let p = pool();
    let secret = operator_token_secret(&p, "abc");
    assert_eq!(secret.metadata.name.as_deref(), Some("vl-operator-token"));
    assert_eq!(secret.data.unwrap()["token"].0, b"abc");
    assert_eq!(
        secret.metadata.owner_references.unwrap()[0].uid,
        "uid-1",
        "owned by the pool"
    );
    let owner = OwnerReference {
        api_version: "mole.dev/v1alpha1".into(),
        kind: "Adapter".into(),
        name: "calendar".into(),
        uid: "uid-a".into(),
        ..Default::default()
    };
    let (merged_cm, merged, _, _) = merged_children(
        &p,
        "calendar",
        "v1",
        "merged/calendar/v1-abc",
        1,
        owner,
        PodDefaults {
            port: WORKER_PORT,
            images: &WorkerDefaults::default(),
        },
    );
    for d in [
        dynamic_deployment(&p, WORKER_PORT, &WorkerDefaults::default()),
        merged,
    ] {
        let pod = d.spec.unwrap().template.spec.unwrap();
        let vol = pod
            .volumes
            .unwrap()
            .into_iter()
            .find(|v| v.name == "operator-token")
            .unwrap();
        assert_eq!(
            vol.secret.unwrap().secret_name.as_deref(),
            Some("vl-operator-token")
        );
        let m = pod.containers[0]
            .volume_mounts
            .clone()
            .unwrap()
            .into_iter()
            .find(|m| m.name == "operator-token")
            .unwrap();
        assert_eq!(m.read_only, Some(true));
        assert!(
            !m.mount_path.starts_with(WORKER_CONFIG_MOUNT),
            "no mount point inside the read-only ConfigMap volume"
        );
        assert_eq!(operator_token_file(), format!("{}/token", m.mount_path));
    }
    for wc in [
        worker_config("vl", &p.spec, &[]),
        serde_json::from_str(&merged_cm.data.unwrap()["worker.json"]).unwrap(),
    ] {
        assert_eq!(
            wc.auth.unwrap().operator_token_file,
            Some(operator_token_file())
        );
    }
}

#[test]
fn merged_config_maps_are_per_output() {
    let p = pool();
    let owner = OwnerReference {
        kind: "Adapter".into(),
        name: "calendar".into(),
        uid: "uid-a".into(),
        ..Default::default()
    };
    let (cm1, d1, _, _) = merged_children(
        &p,
        "calendar",
        "v1",
        "merged/calendar/v1-a",
        1,
        owner.clone(),
        PodDefaults {
            port: WORKER_PORT,
            images: &WorkerDefaults::default(),
        },
    );
    let (cm2, d2, _, _) = merged_children(
        &p,
        "calendar",
        "v2",
        "merged/calendar/v2-b",
        1,
        owner,
        PodDefaults {
            port: WORKER_PORT,
            images: &WorkerDefaults::default(),
        },
    );
    assert_ne!(cm1.metadata.name, cm2.metadata.name);
    let mounted = |d: &Deployment| {
        d.spec
            .as_ref()
            .unwrap()
            .template
            .spec
            .as_ref()
            .unwrap()
            .volumes
            .as_ref()
            .unwrap()
            .iter()
            .find(|v| v.name == "config")
            .unwrap()
            .config_map
            .as_ref()
            .unwrap()
            .name
            .clone()
    };
    assert_eq!(Some(mounted(&d1)), cm1.metadata.name);
    assert_eq!(Some(mounted(&d2)), cm2.metadata.name);
    assert_eq!(
        cm1.metadata.annotations.unwrap()[ANNOTATION_MERGED_OUTPUT],
        "merged/calendar/v1-a"
    );
    assert_eq!(cm1.metadata.owner_references.unwrap()[0].kind, "Adapter");
}

#[test]
fn a_short_max_seq_len_gives_a_config_the_worker_accepts() {
    let mut p = pool();
    p.spec.dynamic.limits.max_seq_len = 1024;
    let wc = worker_config("vl", &p.spec, &[]);
    assert_eq!(wc.limits.max_tokens, 1024);
    assert_eq!(wc.limits.validate(), Ok(()));
    // The default maxSeqLen keeps the default maxTokens (and the config hash).
    assert_eq!(
        worker_config("vl", &pool().spec, &[]).limits.max_tokens,
        2048
    );
}

fn image_of(d: &Deployment) -> String {
    d.spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap()
        .containers[0]
        .image
        .clone()
        .unwrap()
}

#[test]
fn pools_without_an_image_run_the_cuda_default_on_gpus_and_the_cpu_default_otherwise() {
    let mut gpu = pool();
    gpu.spec.image = None;
    let mut cpu = gpu.clone();
    cpu.spec.gpu.count = 0;
    let defaults = WorkerDefaults::default();
    let v = env!("CARGO_PKG_VERSION");
    let owner = OwnerReference {
        kind: "Adapter".into(),
        name: "calendar".into(),
        uid: "uid-a".into(),
        ..Default::default()
    };
    for (p, want) in [
        (&gpu, format!("ghcr.io/mole-dev/mole-worker:{v}-cuda")),
        (&cpu, format!("ghcr.io/mole-dev/mole-worker:{v}-cpu")),
    ] {
        assert_eq!(
            image_of(&dynamic_deployment(p, WORKER_PORT, &defaults)),
            want
        );
        let (_, merged, _, _) = merged_children(
            p,
            "calendar",
            "v1",
            "merged/calendar/v1-a",
            1,
            owner.clone(),
            PodDefaults {
                port: WORKER_PORT,
                images: &defaults,
            },
        );
        assert_eq!(
            image_of(&merged),
            want,
            "merged pods run what dynamic ones run"
        );
    }
    // The operator's flags replace the defaults; a pool's own image wins over both.
    let flags = WorkerDefaults {
        gpu: "registry.local/mole-worker:dev-cuda".into(),
        cpu: "registry.local/mole-worker:dev-cpu".into(),
        ..Default::default()
    };
    assert_eq!(
        image_of(&dynamic_deployment(&gpu, WORKER_PORT, &flags)),
        "registry.local/mole-worker:dev-cuda"
    );
    assert_eq!(
        image_of(&dynamic_deployment(&cpu, WORKER_PORT, &flags)),
        "registry.local/mole-worker:dev-cpu"
    );
    assert_eq!(
        image_of(&dynamic_deployment(&pool(), WORKER_PORT, &flags)),
        "ghcr.io/mole-dev/mole-worker:0.1.0"
    );
}

#[test]
fn a_new_default_image_rolls_the_pools_that_use_it_and_only_those() {
    let mut unset = pool();
    unset.spec.image = None;
    let old = WorkerDefaults::default();
    let new = WorkerDefaults {
        gpu: "ghcr.io/mole-dev/mole-worker:9.9.9-cuda".into(),
        ..old.clone()
    };
    assert_ne!(
        template_hash(&dynamic_deployment(&unset, WORKER_PORT, &old)),
        template_hash(&dynamic_deployment(&unset, WORKER_PORT, &new)),
        "the resolved image is in the spec hash"
    );
    // A pool that names its image keeps its pods.
    assert_eq!(
        template_hash(&dynamic_deployment(&pool(), WORKER_PORT, &old)),
        template_hash(&dynamic_deployment(&pool(), WORKER_PORT, &new))
    );
    // Writing the default out explicitly is the same pod: no restart.
    let mut explicit = unset.clone();
    explicit.spec.image = Some(old.gpu.clone());
    assert_eq!(
        template_hash(&dynamic_deployment(&unset, WORKER_PORT, &old)),
        template_hash(&dynamic_deployment(&explicit, WORKER_PORT, &old))
    );
}

/// A spec with every field of `InferencePoolSpec` set (k8s types with a few fields), so that
/// [`spec_hash_covers_every_start_only_field`] can mutate each one.
fn every_field_spec() -> serde_json::Value {
    serde_json::from_str::<serde_json::Value>(
        r#"{
  "baseModel": {"name": "Qwen/Qwen3-8B", "path": "base/qwen3", "source": "hf://Qwen/Qwen3-8B@main",
                "secretRef": {"name": "hf-token"}, "dtype": "bf16", "imageProcessor": "pil",
                "toolCallParser": "hermes", "reasoningParser": "qwen3"},
  "storage": {"claimName": "models", "mountPath": "/models"},
  "image": "ghcr.io/mole-dev/mole-worker:0.1.0",
  "imagePullPolicy": "IfNotPresent",
  "gpu": {"resourceName": "nvidia.com/gpu", "count": 1,
          "nodeSelector": {"nvidia.com/gpu.product": "H100"},
          "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
          "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution":
              {"nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}},
          "priorityClassName": "gpu-serving", "runtimeClassName": "nvidia"},
  "resources": {"requests": {"cpu": "4"}, "limits": {"memory": "64Gi"}},
  "dynamic": {"replicas": 2, "autoscaling": {"minReplicas": 1, "maxReplicas": 3,
              "targetQueueDepth": 2, "scaleDownStabilizationSeconds": 60}, "maxLoras": 4, "maxCpuLoras": 16, "maxLoraRank": 32, "loraDtype": "f16", "kvCacheDtype": "bf16",
              "maxBatchSize": 8, "maxSeqLen": 2048, "maxQueue": 128,
              "gpuMemoryUtilization": 0.8, "enablePrefixCaching": false,
              "placement": {"minReplicas": 2, "loadFactor": 1.25}},
  "router": {"strategies": ["explicit", "embedding"], "classifierAdapter": "cls", "minConfidence": 0.5,
             "embeddingModel": "embed/minilm", "embeddingThreshold": 0.25, "fallback": "base",
             "preferMerged": true, "fallbackToDynamic": true},
  "merge": {"resources": {"requests": {"cpu": "2"}}, "nodeSelector": {"pool": "cpu"},
            "tolerations": [{"key": "batch", "operator": "Exists"}], "priorityClassName": "batch",
            "keepVersions": 2, "minAccuracy": 0.5, "backoffLimit": 2, "activeDeadlineSeconds": 3600,
            "unloadFromDynamic": false,
            "traffic": {"promoteShare": 0.1, "demoteShare": 0.04, "windowSeconds": 300,
                        "minHoldSeconds": 900, "maxMergedGpus": 2,
                        "capacity": {"mergedTokensPerSecond": 1404.2, "dynamicRatio": 0.47}},
            "scaleToZero": {"idleSeconds": 1800}},
  "auth": {"secretName": "keys", "key": "api-keys", "adminTokenKey": "admin", "prefixCacheScope": "pool"},
  "imagePullSecrets": [{"name": "regcred"}],
  "rollout": {"maxSurge": "25%", "maxUnavailable": 1}
}"#,
    )
    .unwrap()
}

/// Spec fields that are deliberately not in the spec hash, with why: changing them must not
/// restart a pod. Everything else must change the hash. Prefixes cover their subtree.
const NOT_HASHED: &[(&str, &str)] = &[
    (
        "dynamic.replicas",
        "the Deployment's replica count, not its pod template",
    ),
    (
        "dynamic.autoscaling.",
        "the HPA's settings: how many pods, not what they run",
    ),
    (
        "dynamic.placement.",
        "which adapters each pod loads: the WorkerConfig, reloaded",
    ),
    ("router.strategies", "reloaded: the worker swaps its router"),
    ("router.classifierAdapter", "reloaded with the router"),
    ("router.minConfidence", "reloaded with the router"),
    ("router.embeddingThreshold", "reloaded with the router"),
    ("router.fallback", "reloaded with the router"),
    ("router.preferMerged", "reloaded with the router"),
    ("router.fallbackToDynamic", "reloaded with the router"),
    (
        "merge.",
        "merge and cleanup Jobs only: they are built per run, serving pods never read it",
    ),
    (
        "rollout.",
        "the Deployments' strategy: how pods are replaced, not what they run",
    ),
];

/// Leaf paths of a JSON value (`a.b`, `a.list[]`), with the pointer to each leaf.
fn leaves(v: &serde_json::Value, path: &str, ptr: &str, out: &mut Vec<(String, String)>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, x) in m {
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                let key = k.replace('~', "~0").replace('/', "~1");
                leaves(x, &p, &format!("{ptr}/{key}"), out);
            }
        }
        serde_json::Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                leaves(x, &format!("{path}[]"), &format!("{ptr}/{i}"), out);
            }
        }
        _ => out.push((path.to_string(), ptr.to_string())),
    }
}

/// Leaf paths of the CRD's schema of `spec`. Kubernetes' own types (affinity, tolerations,
/// resources, pull secrets, maps) are one leaf each: the spec fixture sets something in them.
fn schema_leaves(s: &serde_json::Value, path: &str, out: &mut Vec<String>) {
    const OPAQUE: &[&str] = &[
        "gpu.affinity",
        "gpu.tolerations",
        "gpu.nodeSelector",
        "resources",
        "merge.resources",
        "merge.tolerations",
        "merge.nodeSelector",
        "imagePullSecrets",
    ];
    if let Some(props) = s.get("properties").and_then(|p| p.as_object()) {
        if !OPAQUE.contains(&path) {
            for (k, x) in props {
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                schema_leaves(x, &p, out);
            }
            return;
        }
    }
    if let (Some(items), false) = (s.get("items"), OPAQUE.contains(&path)) {
        return schema_leaves(items, &format!("{path}[]"), out);
    }
    out.push(path.to_string());
}

/// Another valid value for a leaf: the next member of its enum, or the value changed.
fn mutated(v: &serde_json::Value) -> serde_json::Value {
    const ENUMS: &[&[&str]] = &[
        &["bf16", "f16", "f32"],
        &["explicit", "classifier", "keywords", "embedding"],
        &["base", "reject"],
        &["IfNotPresent", "Always", "Never"],
        &["torchvision", "pil"],
        &["apiKey", "pool"],
    ];
    match v {
        serde_json::Value::String(s) => ENUMS
            .iter()
            .find_map(|e| {
                let i = e.iter().position(|x| x == s)?;
                Some(serde_json::json!(e[(i + 1) % e.len()]))
            })
            .unwrap_or_else(|| serde_json::json!(format!("{s}x"))),
        serde_json::Value::Bool(b) => serde_json::json!(!b),
        serde_json::Value::Number(n) if n.is_f64() => serde_json::json!(n.as_f64().unwrap() / 2.0),
        serde_json::Value::Number(n) => serde_json::json!(n.as_i64().unwrap() + 1),
        other => panic!("no mutation for {other}"),
    }
}

#[test]
fn spec_hash_covers_every_start_only_field() {
    use mole_crds::InferencePoolSpec;
    let full = every_field_spec();
    let base: InferencePoolSpec = serde_json::from_value(full.clone()).unwrap();
    assert_eq!(
        serde_json::to_value(&base).unwrap(),
        full,
        "the fixture round-trips: every field it sets exists"
    );
    let mut paths = Vec::new();
    leaves(&full, "", "", &mut paths);
    // Every field of the CRD is set in the fixture, so a new field cannot be forgotten here.
    let crd = serde_json::to_value(<InferencePool as kube::CustomResourceExt>::crd()).unwrap();
    let spec_schema =
        &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
    let mut schema = Vec::new();
    schema_leaves(spec_schema, "", &mut schema);
    assert!(schema.len() > 30, "{schema:?}");
    for s in &schema {
        assert!(
            paths
                .iter()
                .any(|(p, _)| p == s || p.starts_with(&format!("{s}.")) || p.starts_with(&format!("{s}["))),
            "spec.{s} is not set in every_field_spec(): set it, then hash it or list it in NOT_HASHED"
        );
    }
    let images = WorkerDefaults::default();
    let hash = |s: &InferencePoolSpec| spec_hash(s, &images.serving(s));
    let before = hash(&base);
    let mut allowed_seen = Vec::new();
    for (path, ptr) in &paths {
        let mut v = full.clone();
        let leaf = v.pointer_mut(ptr).unwrap();
        *leaf = mutated(leaf);
        let changed: InferencePoolSpec = serde_json::from_value(v)
            .unwrap_or_else(|e| panic!("spec.{path}: the mutation does not parse: {e}"));
        assert_ne!(changed, base, "spec.{path}: the mutation changed nothing");
        let allowed = NOT_HASHED.iter().find(|(p, _)| {
            path == p
                || path.starts_with(&format!("{p}["))
                || (p.ends_with('.') && path.starts_with(p))
        });
        match (hash(&changed) != before, allowed) {
            (true, None) => {}
            (false, Some((p, _))) => allowed_seen.push(*p),
            (true, Some((p, why))) => panic!(
                "spec.{path} rolls the pods but NOT_HASHED lists {p:?} ({why}): remove it there"
            ),
            (false, None) => panic!(
                "spec.{path} does not change the spec hash: a worker reads it only at start \
                 (config::restart_required) or it is in the pod spec, so add it to spec_hash; \
                 or list it in NOT_HASHED with the reason it is reloaded"
            ),
        }
    }
    for (p, _) in NOT_HASHED {
        assert!(
            allowed_seen.contains(p),
            "NOT_HASHED {p:?} matches no field"
        );
    }
}

#[test]
fn start_only_fields_roll_the_pods_and_default_ones_keep_the_hash() {
    let p = pool();
    let image = p.spec.image.clone().unwrap();
    let before = spec_hash(&p.spec, &image);
    // maxQueue at its default is left out: the pinned hash above still holds for it.
    let mut same = p.clone();
    same.spec.dynamic.limits.max_queue = mole_crds::EngineLimits::default().max_queue;
    assert_eq!(spec_hash(&same.spec, &image), before);
    let mut q = p.clone();
    q.spec.dynamic.limits.max_queue = 64;
    assert_ne!(
        spec_hash(&q.spec, &image),
        before,
        "maxQueue rolls the pods"
    );
    let mut g = p.clone();
    g.spec.dynamic.limits.gpu_memory_utilization = 0.8;
    assert_ne!(
        spec_hash(&g.spec, &image),
        before,
        "gpuMemoryUtilization rolls the pods"
    );
    let mut c = p.clone();
    c.spec.dynamic.limits.enable_prefix_caching = false;
    assert_ne!(
        spec_hash(&c.spec, &image),
        before,
        "turning prefix caching off rolls the pods"
    );
    // The worker reads its output formats at start (baseModel is restart_required); unset,
    // they leave the pinned hash above as it was.
    type Set = fn(&mut InferencePool);
    let formats: [(Set, &str); 2] = [
        (
            |t| t.spec.base_model.tool_call_parser = Some("hermes".into()),
            "toolCallParser",
        ),
        (
            |t| t.spec.base_model.reasoning_parser = Some("qwen3".into()),
            "reasoningParser",
        ),
    ];
    for (set, field) in formats {
        let mut t = p.clone();
        set(&mut t);
        assert_ne!(spec_hash(&t.spec, &image), before, "{field} rolls the pods");
    }
    let mut e = p.clone();
    e.spec.router.embedding_model = Some("embed/minilm".into());
    assert_ne!(
        spec_hash(&e.spec, &image),
        before,
        "embeddingModel rolls the pods"
    );
    let mut r = p.clone();
    r.spec.router.min_confidence = 0.9;
    assert_eq!(spec_hash(&r.spec, &image), before, "the router reloads");
}

#[test]
fn rollouts_fit_the_hardware_unless_the_pool_says_otherwise() {
    let strategy = |p: &InferencePool| {
        let d = dynamic_deployment(p, WORKER_PORT, &WorkerDefaults::default());
        let ru = d.spec.unwrap().strategy.unwrap().rolling_update.unwrap();
        (ru.max_surge.unwrap(), ru.max_unavailable.unwrap())
    };
    // A full GPU node pool has no GPU for a surge pod: replace in place.
    let gpu = pool();
    assert_eq!(strategy(&gpu), (IntOrString::Int(0), IntOrString::Int(1)));
    // CPU pools surge and never lose a pod.
    let mut cpu = pool();
    cpu.spec.gpu.count = 0;
    assert_eq!(strategy(&cpu), (IntOrString::Int(1), IntOrString::Int(0)));
    // The pool's own values, one field falling back to the default.
    let mut own = pool();
    own.spec.rollout = Some(mole_crds::RolloutSpec {
        max_surge: Some(IntOrString::String("50%".into())),
        max_unavailable: None,
    });
    assert_eq!(
        strategy(&own),
        (IntOrString::String("50%".into()), IntOrString::Int(1))
    );
    // Merged Deployments roll the same way (same node pool).
    let (_, merged, _, _) = merged_children(
        &own,
        "calendar",
        "v1",
        "merged/calendar/v1-a",
        2,
        adapter_owner(),
        PodDefaults {
            port: WORKER_PORT,
            images: &WorkerDefaults::default(),
        },
    );
    let ru = merged
        .spec
        .unwrap()
        .strategy
        .unwrap()
        .rolling_update
        .unwrap();
    assert_eq!(ru.max_surge, Some(IntOrString::String("50%".into())));
    assert_eq!(ru.max_unavailable, Some(IntOrString::Int(1)));
    // The rollout is not in the pod template: changing it restarts nothing.
    assert_eq!(
        template_hash(&dynamic_deployment(
            &own,
            WORKER_PORT,
            &WorkerDefaults::default()
        )),
        template_hash(&dynamic_deployment(
            &gpu,
            WORKER_PORT,
            &WorkerDefaults::default()
        ))
    );
}

#[test]
fn rollout_values_scale_as_the_deployment_controller_does() {
    let v = |s: &str| IntOrString::String(s.into());
    assert_eq!(scaled_value(&IntOrString::Int(2), 4, true), Ok(2));
    assert_eq!(scaled_value(&v("25%"), 3, true), Ok(1), "surge rounds up");
    assert_eq!(
        scaled_value(&v("25%"), 3, false),
        Ok(0),
        "unavailable rounds down"
    );
    assert_eq!(scaled_value(&v("100%"), 3, false), Ok(3));
    for bad in ["25", "x%", "101%", "-1%", ""] {
        assert!(scaled_value(&v(bad), 3, true).is_err(), "{bad}");
    }
    assert!(scaled_value(&IntOrString::Int(-1), 3, true).is_err());
}

/// The probes tolerate a busy pod: a probe that times out after 3 s, twice in 10 s, took a pod
/// under a long prefill on a starved node out of its Service and back (issue 25). A pod leaves
/// the endpoints only after ~30 s of failures and is restarted only after ~60 s.
#[test]
fn probes_tolerate_a_busy_pod_for_30_seconds_before_it_leaves_the_service() {
    let d = dynamic_deployment(&pool(), WORKER_PORT, &WorkerDefaults::default());
    let c = pod_of(&d).containers[0].clone();
    let seen = |p: &Option<k8s_openapi::api::core::v1::Probe>| {
        let p = p.as_ref().unwrap();
        (
            p.http_get.as_ref().unwrap().path.clone().unwrap(),
            p.period_seconds.unwrap(),
            p.timeout_seconds.unwrap(),
            p.failure_threshold.unwrap(),
        )
    };
    assert_eq!(seen(&c.readiness_probe), ("/readyz".into(), 10, 10, 3));
    assert_eq!(seen(&c.liveness_probe), ("/healthz".into(), 10, 10, 6));
    assert_eq!(seen(&c.startup_probe), ("/healthz".into(), 10, 10, 120));
    for p in [&c.readiness_probe, &c.liveness_probe] {
        let (_, period, timeout, failures) = seen(p);
        // The kubelet does not overlap probes: a timing-out probe takes max(period, timeout).
        let out_after = period.max(timeout) * failures;
        assert!(out_after >= 30, "{p:?} gives up after {out_after} s");
        assert!(
            timeout <= period,
            "a timeout over the period would stretch it"
        );
    }
}

/// Every pod the operator starts, by kind: the dynamic and merged worker pods and the fetch,
/// merge and cleanup Jobs' pods, for pool `p` (its base model fetched from `hf://`, so the
/// worker and merge pods carry the fetch init container too).
fn every_pod(p: &InferencePool) -> Vec<(&'static str, PodSpec)> {
    let mut p = p.clone();
    p.spec.base_model.source = Some("hf://Qwen/Qwen3-VL-8B-Instruct".into());
    let pods = PodDefaults {
        port: WORKER_PORT,
        images: &WorkerDefaults::default(),
    };
    let merged = merged_children(
        &p,
        "calendar",
        "v1",
        "merged/calendar/v1-a",
        1,
        adapter_owner(),
        pods,
    );
    let mut fetched = adapter("calendar", "v1");
    fetched.spec.source.uri = Some("hf://org/calendar".into());
    let jobs = [
        (
            "fetch",
            adapter_fetch_job(
                "vl",
                &p.spec,
                "calendar",
                &fetched.spec,
                adapter_owner(),
                &WorkerDefaults::default(),
            )
            .unwrap(),
        ),
        (
            "merge",
            crate::mergedown::job::merge_job(
                "vl",
                &p.spec,
                "calendar",
                &fetched.spec,
                &crate::mergedown::merge_key(&p.spec, "calendar", &fetched.spec),
                adapter_owner(),
                &WorkerDefaults::default(),
            ),
        ),
        (
            "cleanup",
            crate::mergedown::job::cleanup_job(
                "vl",
                &p.spec,
                "calendar",
                &["merged/calendar/v0-a".into()],
                adapter_owner(),
                &WorkerDefaults::default(),
            )
            .unwrap(),
        ),
    ];
    let mut specs = vec![
        (
            "dynamic",
            pod_of(&dynamic_deployment(
                &p,
                WORKER_PORT,
                &WorkerDefaults::default(),
            )),
        ),
        ("merged", pod_of(&merged.1)),
    ];
    for (what, job) in jobs {
        specs.push((what, job.spec.unwrap().template.spec.unwrap()));
    }
    specs
}

/// Issue 33 item 6: no pod the operator starts talks to the Kubernetes API (the worker reads
/// its config and tokens from mounted files; merge, fetch and cleanup work on the volume), so
/// none mounts a service-account token a compromised process could use.
#[test]
fn no_pod_mounts_a_service_account_token() {
    for (what, pod) in every_pod(&pool()) {
        assert_eq!(pod.automount_service_account_token, Some(false), "{what}");
    }
}

/// Issue 56: every pod the operator starts, worker or Job, passes the "restricted" Pod
/// Security Standard (a namespace enforcing it admits them all), runs the pool's image with
/// the pool's pull secrets, and each Job runs its one `mole-worker` tool alike: JSON logs,
/// its failure's reason as the termination message, the pool's volume read-write, run once.
#[test]
fn every_pod_is_restricted_and_pulls_with_the_pools_secrets() {
    let mut p = pool();
    p.spec.image_pull_secrets = vec![LocalObjectReference {
        name: "regcred".into(),
    }];
    for (what, pod) in every_pod(&p) {
        let psec = pod.security_context.clone().unwrap();
        assert_eq!(psec.run_as_non_root, Some(true), "{what}");
        assert_ne!(psec.run_as_user, Some(0), "{what}");
        assert_eq!(
            psec.seccomp_profile.as_ref().map(|s| s.type_.as_str()),
            Some("RuntimeDefault"),
            "{what}"
        );
        assert_eq!(pod.host_network, None, "{what}");
        assert_eq!(pod.host_pid, None, "{what}");
        assert_eq!(pod.host_ipc, None, "{what}");
        // The restricted profile allows only these volume types.
        for v in pod.volumes.iter().flatten() {
            assert!(
                v.persistent_volume_claim.is_some()
                    || v.config_map.is_some()
                    || v.secret.is_some()
                    || v.empty_dir.is_some(),
                "{what}: volume {}",
                v.name
            );
        }
        let containers: Vec<_> = pod
            .init_containers
            .iter()
            .flatten()
            .chain(&pod.containers)
            .collect();
        assert!(!containers.is_empty(), "{what}");
        for c in containers {
            let sec = c.security_context.as_ref().unwrap();
            let at = format!("{what}/{}", c.name);
            assert_eq!(sec.allow_privilege_escalation, Some(false), "{at}");
            assert_eq!(sec.privileged, None, "{at}");
            assert_eq!(sec.run_as_non_root, Some(true), "{at}");
            assert_eq!(sec.read_only_root_filesystem, Some(true), "{at}");
            assert_eq!(
                sec.capabilities.as_ref().and_then(|c| c.drop.clone()),
                Some(vec!["ALL".to_string()]),
                "{at}"
            );
            assert_eq!(
                sec.capabilities.as_ref().and_then(|c| c.add.clone()),
                None,
                "{at}"
            );
            assert_eq!(
                sec.seccomp_profile.as_ref().map(|s| s.type_.as_str()),
                Some("RuntimeDefault"),
                "{at}"
            );
            assert_eq!(
                c.image.as_deref(),
                Some("ghcr.io/mole-dev/mole-worker:0.1.0"),
                "{at}"
            );
        }
        assert_eq!(
            pod.image_pull_secrets.as_ref().map(|s| s[0].name.as_str()),
            Some("regcred"),
            "{what}: the pool's image is private"
        );
        if matches!(what, "dynamic" | "merged") {
            continue;
        }
        assert_eq!(pod.restart_policy.as_deref(), Some("Never"), "{what}");
        let [c] = &pod.containers[..] else {
            panic!("{what}: one container");
        };
        assert_eq!(c.command.as_deref(), Some(&["mole-worker".to_string()][..]));
        let env = c.env.clone().unwrap_or_default();
        assert!(
            env.iter()
                .any(|e| e.name == "MOLE_LOG_FORMAT" && e.value.as_deref() == Some("json")),
            "{what}: JSON log lines"
        );
        assert_eq!(
            c.termination_message_policy.as_deref(),
            Some("FallbackToLogsOnError"),
            "{what}: a tool that dies before writing its reason still leaves one"
        );
        let m = &c.volume_mounts.as_ref().unwrap()[0];
        assert_eq!(
            (m.name.as_str(), m.mount_path.as_str(), m.read_only),
            ("models", "/models", Some(false)),
            "{what}"
        );
    }
}

#[test]
fn worker_pods_export_traces_where_the_operator_says_and_nowhere_by_default() {
    let env = |d: &WorkerDefaults| -> Vec<(String, Option<String>)> {
        let dep = dynamic_deployment(&pool(), WORKER_PORT, d);
        let pod = dep.spec.unwrap().template.spec.unwrap();
        pod.containers[0]
            .env
            .clone()
            .unwrap_or_default()
            .into_iter()
            .map(|e| (e.name, e.value))
            .collect()
    };
    let off = env(&WorkerDefaults::default());
    assert!(
        off.iter().all(|(n, _)| n != "MOLE_OTLP_TRACES_ENDPOINT"),
        "{off:?}"
    );
    let on = env(&WorkerDefaults {
        otlp_traces_endpoint: Some("http://otel-collector.observability:4318".into()),
        ..Default::default()
    });
    assert!(on.contains(&(
        "MOLE_OTLP_TRACES_ENDPOINT".into(),
        Some("http://otel-collector.observability:4318".into())
    )));
}

/// Issue 37, item 4: with `dynamic.placement` each adapter the dynamic pods load is placed on
/// `minReplicas` of them (more with more traffic), no pod over the bound, the same pods in any
/// order giving the same config; without it (or without pods) every pod loads every adapter.
#[test]
fn placement_puts_each_adapter_on_a_share_of_the_pods() {
    let mut p = pool();
    let names: Vec<String> = (0..12).map(|i| format!("a{i}")).collect();
    let adapters: Vec<Adapter> = names
        .iter()
        .map(|n| {
            serde_json::from_value(serde_json::json!({
                "apiVersion": "mole.dev/v1alpha1", "kind": "Adapter",
                "metadata": {"name": n, "namespace": "ml"},
                "spec": {"pool": "vl", "version": "v1", "source": {"path": format!("adapters/{n}")}}
            }))
            .unwrap()
        })
        .collect();
    let reg: Vec<Registered<'_>> = adapters
        .iter()
        .enumerate()
        .map(|(i, a)| Registered {
            adapter: a,
            lora_id: i as u32 + 1,
        })
        .collect();
    let pods: Vec<String> = (0..4).map(|i| format!("vl-dynamic-{i}")).collect();
    // a0 carries half the pool's tokens: it goes on more pods.
    let traffic: std::collections::BTreeMap<String, f64> = [("a0".to_string(), 1500.0)]
        .into_iter()
        .chain(names[1..].iter().map(|n| (n.clone(), 100.0)))
        .collect();
    let mut plain = worker_config("vl", &p.spec, &reg);
    place_adapters(&mut plain, &p.spec, &traffic, &pods, &Default::default());
    assert!(
        plain.adapters.iter().all(|a| a.pods.is_empty()),
        "not asked"
    );
    p.spec.dynamic.placement = Some(mole_crds::PlacementSpec {
        min_replicas: 2,
        load_factor: 1.25,
    });
    let peers: std::collections::BTreeMap<String, String> = pods
        .iter()
        .map(|p| (p.clone(), format!("http://{p}:8000")))
        .collect();
    let mut wc = worker_config("vl", &p.spec, &reg);
    place_adapters(&mut wc, &p.spec, &traffic, &pods, &peers);
    assert_eq!(wc.peers, peers, "the pods forward to each other");
    let mut per_pod = std::collections::BTreeMap::<&str, usize>::new();
    for a in &wc.adapters {
        let want = if a.name == "a0" { 3 } else { 2 };
        assert_eq!(a.pods.len(), want, "{}: {:?}", a.name, a.pods);
        for pod in &a.pods {
            *per_pod.entry(pod.as_str()).or_default() += 1;
        }
    }
    // 25 replicas over 4 pods: at most ceil(1.25 x 25 / 4) = 8 per pod.
    assert_eq!(per_pod.len(), 4, "{per_pod:?}");
    assert!(per_pod.values().all(|n| *n <= 8), "{per_pod:?}");
    let mut shuffled = pods.clone();
    shuffled.reverse();
    let mut again = worker_config("vl", &p.spec, &reg);
    place_adapters(&mut again, &p.spec, &traffic, &shuffled, &peers);
    assert_eq!(again, wc);
    let mut none = worker_config("vl", &p.spec, &reg);
    place_adapters(&mut none, &p.spec, &traffic, &[], &Default::default());
    assert!(none.adapters.iter().all(|a| a.pods.is_empty()));
}

/// Issue 52 item 4: a pool opts its tenants into one shared prefix cache explicitly
/// (`auth.prefixCacheScope: pool`), for dynamic and merged pods alike; by default the
/// WorkerConfig leaves the field out and each API key caches its own prompts.
#[test]
fn the_prefix_cache_is_shared_across_keys_only_when_the_pool_says_so() {
    use mole_crds::PrefixCacheScope;
    let mut p = pool();
    let wc = worker_config("vl", &p.spec, &[]);
    assert_eq!(wc.limits.prefix_cache_scope, PrefixCacheScope::ApiKey);
    assert!(serde_json::to_value(&wc).unwrap()["limits"]
        .get("prefixCacheScope")
        .is_none());
    p.spec.auth = Some(
        serde_json::from_value(
            serde_json::json!({"secretName": "keys", "prefixCacheScope": "pool"}),
        )
        .unwrap(),
    );
    let wc = worker_config("vl", &p.spec, &[]);
    assert_eq!(wc.limits.prefix_cache_scope, PrefixCacheScope::Pool);
    let merged = merged_worker_config("vl", &p.spec, "calendar", "v1", "merged/calendar/v1-abc");
    assert_eq!(merged.limits.prefix_cache_scope, PrefixCacheScope::Pool);
}
