//! Pods that run: the test kubelet (`mole_tests::kubelet`) on a real control plane
//! (`mole_tests::cluster`), first on its own (Deployments, Jobs, volumes, logs, deletion,
//! restarts), then with the operator (in-process, as the chart's ServiceAccount) and
//! `mole-worker` of this build serving the tiny llama fixture.
//!
//! Ignored by a plain `cargo test`: they need the control plane's binaries
//! (`scripts/k8s-bins.sh`), root (network namespaces, a bridge, mounts), and minutes. Run with
//! `--ignored --test-threads=1`.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test is a failed test

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, ContainerStateTerminated, Pod};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::{Api, Client};
use mole_tests::cluster::{wait_for, ControlPlane, Parts};
use mole_tests::kubelet::{service_url, Kubelet, KubeletConfig};
use mole_tests::stack;

const PY: &str = "mole-test/python";
const SH: &str = "mole-test/shell";

/// A control plane (controller manager and scheduler) with a kubelet whose images are the
/// host's python3 and sh, and namespace `t`.
struct Env {
    // Dropped first: the test's time is its own, not the teardown's.
    _clock: stack::Stopwatch,
    // Then the kubelet: it deletes its Node while the API server still runs.
    kubelet: Kubelet,
    cp: ControlPlane,
    client: Client,
}

async fn env(cfg: impl FnOnce(KubeletConfig) -> KubeletConfig) -> Env {
    let clock = stack::Stopwatch::start();
    // The host's own interpreter (not a version manager's shim, which needs its environment).
    assert!(
        Path::new("/usr/bin/python3").is_file(),
        "the harness tests run /usr/bin/python3 as the image mole-test/python"
    );
    let cp = ControlPlane::start(Parts::default()).await.unwrap();
    let root = cp.dir.path().join("kubelet");
    let cfg = cfg(KubeletConfig::new("node-a", root)
        .image(PY, "/usr/bin/python3")
        .image(SH, "/bin/sh")
        .label("mole.dev/test", "true"));
    let kubelet = Kubelet::start(&cp, cfg).await.unwrap();
    let client = cp.client().await.unwrap();
    cp.kubectl(&["create", "namespace", "t"]).unwrap();
    // The namespace's default ServiceAccount (pods without one are refused until it exists).
    wait_for(
        Duration::from_secs(30),
        "the default ServiceAccount",
        || async {
            cp.kubectl(&["get", "serviceaccount", "default", "-n", "t"])
                .ok()
                .map(|_| ())
        },
    )
    .await
    .unwrap();
    Env {
        _clock: clock,
        kubelet,
        cp,
        client,
    }
}

fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

/// GET `url`: the body's text (any status).
async fn get_text(url: String) -> String {
    http().get(url).send().await.unwrap().text().await.unwrap()
}

async fn pods(client: &Client, selector: &str) -> Vec<Pod> {
    Api::<Pod>::namespaced(client.clone(), "t")
        .list(&ListParams::default().labels(selector))
        .await
        .unwrap()
        .items
}

fn phase(p: &Pod) -> Option<&str> {
    p.status.as_ref()?.phase.as_deref()
}

/// How the pod's first container last ended.
fn exit(p: &Pod) -> ContainerStateTerminated {
    p.status
        .as_ref()
        .unwrap()
        .container_statuses
        .as_ref()
        .unwrap()[0]
        .state
        .clone()
        .unwrap()
        .terminated
        .unwrap()
}

/// `kubectl ARGS` running, its stdout piped (for `logs -f`, which runs until stopped).
fn kubectl_stdout(cp: &ControlPlane, args: &[&str]) -> std::process::Child {
    Command::new(cp.bins().join("kubectl"))
        .env("KUBECONFIG", &cp.kubeconfig)
        .args(args)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

fn ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// A Job `name` of `t` that runs once (no retry, no restart): its one container `main` runs
/// `image` with `container`, the container's other fields (YAML lines, unindented).
fn one_shot_job(name: &str, image: &str, container: &str) -> String {
    let container: String = container
        .lines()
        .map(|l| format!("        {l}\n"))
        .collect();
    format!(
        r#"
apiVersion: batch/v1
kind: Job
metadata: {{name: {name}, namespace: t}}
spec:
  backoffLimit: 0
  template:
    spec:
      restartPolicy: Never
      containers:
      - name: main
        image: {image}
{container}"#
    )
}

/// The netns and links of `bridge` that exist now.
fn leftovers(bridge: &str) -> Vec<String> {
    let ns = Command::new("ip").args(["netns", "list"]).output().unwrap();
    let links = Command::new("ip").args(["-o", "link"]).output().unwrap();
    String::from_utf8_lossy(&ns.stdout)
        .lines()
        .chain(String::from_utf8_lossy(&links.stdout).lines())
        .filter(|l| l.contains(bridge))
        .map(str::to_string)
        .collect()
}

/// The network namespaces of `bridge`'s pods that exist now.
fn namespaces(bridge: &str) -> Vec<String> {
    let ns = Command::new("ip").args(["netns", "list"]).output().unwrap();
    String::from_utf8_lossy(&ns.stdout)
        .lines()
        .filter(|l| l.starts_with(&format!("{bridge}-")))
        .map(str::to_string)
        .collect()
}

/// A Deployment of 2 python HTTP servers serving a ConfigMap's file: both pods Running and
/// Ready (readiness probe on the named port), each with an address of its own on the
/// kubelet's bridge, reachable from the test, through its Service's EndpointSlices, and by
/// the Service's DNS name from another pod (its /etc/hosts); dropping the kubelet leaves no
/// namespace, link or process behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real control plane: scripts/checks/control-plane.sh"]
async fn a_deployment_gets_ready_pods_with_addresses_of_their_own() {
    let e = env(|c| c).await;
    e.cp.apply(
        r#"
apiVersion: v1
kind: ConfigMap
metadata: {name: site, namespace: t}
data: {hello.txt: "hello from a configMap\n"}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: web, namespace: t}
spec:
  replicas: 2
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec:
      securityContext: {runAsUser: 65532, runAsGroup: 65532, fsGroup: 65532, runAsNonRoot: true}
      containers:
      - name: web
        image: mole-test/python:3
        command: [python3, -m, http.server, "8080", --directory, /srv]
        ports: [{name: http, containerPort: 8080}]
        readinessProbe: {httpGet: {path: /hello.txt, port: http}, periodSeconds: 1}
        volumeMounts: [{name: site, mountPath: /srv}]
      volumes: [{name: site, configMap: {name: site}}]
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: t}
spec:
  selector: {app: web}
  ports: [{name: http, port: 8080, targetPort: http}]
"#,
    )
    .unwrap();
    let ready_pods = wait_for(Duration::from_secs(60), "2 ready web pods", || async {
        let ps = pods(&e.client, "app=web").await;
        (ps.len() == 2 && ps.iter().all(ready)).then_some(ps)
    })
    .await
    .unwrap_or_else(|err| {
        panic!(
            "{err}: {}",
            e.cp.kubectl(&["get", "pods", "-n", "t", "-o", "yaml"])
                .unwrap()
        )
    });
    let ips: Vec<String> = ready_pods
        .iter()
        .map(|p| p.status.as_ref().unwrap().pod_ip.clone().unwrap())
        .collect();
    assert_ne!(ips[0], ips[1], "each pod has an address of its own");
    let gw = e.kubelet.internal_ip.octets();
    for ip in &ips {
        let a: std::net::Ipv4Addr = ip.parse().unwrap();
        assert_eq!(a.octets()[..3], gw[..3], "{ip} is on the kubelet's bridge");
        let body = get_text(format!("http://{ip}:8080/hello.txt")).await;
        assert_eq!(body, "hello from a configMap\n");
    }
    let p0 = &ready_pods[0];
    let st = p0.status.as_ref().unwrap();
    assert_eq!(st.phase.as_deref(), Some("Running"));
    assert_eq!(
        st.host_ip.as_deref(),
        Some(e.kubelet.internal_ip.to_string().as_str())
    );
    let cs = &st.container_statuses.as_ref().unwrap()[0];
    assert!(cs.ready && cs.started == Some(true) && cs.restart_count == 0);
    assert!(cs.state.as_ref().unwrap().running.is_some());
    // The Service, through its EndpointSlices.
    let url = wait_for(
        Duration::from_secs(30),
        "the Service's endpoints",
        || async { service_url(&e.client, "t", "web", 8080).await.ok() },
    )
    .await
    .unwrap();
    let r = http().get(format!("{url}/hello.txt")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    // Another pod reaches it by name (its /etc/hosts), as `web.t.svc` and `web`.
    e.cp.apply(
        r#"
apiVersion: batch/v1
kind: Job
metadata: {name: client, namespace: t}
spec:
  backoffLimit: 0
  template:
    spec:
      restartPolicy: Never
      containers:
      - name: client
        image: mole-test/python:3
        command: [python3, -c]
        args:
        - |
          import urllib.request
          for host in ["web.t.svc", "web", "web.t.svc.cluster.local"]:
              print(host, urllib.request.urlopen(f"http://{host}:8080/hello.txt", timeout=5).read().decode().strip())
"#,
    )
    .unwrap();
    let jobs: Api<Job> = Api::namespaced(e.client.clone(), "t");
    let done = wait_for(Duration::from_secs(60), "the client Job to end", || async {
        let j = jobs.get("client").await.ok()?;
        let st = j.status?;
        (st.succeeded.unwrap_or(0) + st.failed.unwrap_or(0) > 0).then_some(st)
    })
    .await
    .unwrap();
    let logs = e.cp.kubectl(&["logs", "-n", "t", "job/client"]).unwrap();
    assert_eq!(done.succeeded, Some(1), "the client failed: {logs}");
    assert!(logs.contains("web.t.svc hello from a configMap"), "{logs}");
    let bridge = e.kubelet.bridge_name().to_string();
    let procs = e.kubelet.running_processes();
    assert_eq!(procs.len(), 2, "the two servers run: {procs:?}");
    drop(e);
    assert!(leftovers(&bridge).is_empty(), "{:?}", leftovers(&bridge));
    for p in procs {
        assert!(
            !Path::new(&format!("/proc/{p}")).exists()
                || std::fs::read_to_string(format!("/proc/{p}/stat"))
                    .unwrap_or_default()
                    .contains(") Z"),
            "process {p} outlived the kubelet"
        );
    }
}

/// Job pods end with their real exits: 0 and Succeeded; 3 and Failed with the message the
/// process wrote to its termination-message file; 2 with FallbackToLogsOnError, the log's
/// tail as the message. `kubectl logs` (the API server proxying to the kubelet's HTTPS
/// endpoint) shows what they printed, with --tail and -f.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real control plane: scripts/checks/control-plane.sh"]
async fn jobs_end_with_their_exit_codes_messages_and_logs() {
    let e = env(|c| c).await;
    let job_ro = |name: &str, script: &str, policy: &str, ro: bool| {
        one_shot_job(
            name,
            "mole-test/shell:1",
            &format!(
                "command: [sh, -c, {script:?}]\n\
                 terminationMessagePolicy: {policy}\n\
                 securityContext: {{readOnlyRootFilesystem: {ro}}}"
            ),
        )
    };
    let job = |name: &str, script: &str, policy: &str| job_ro(name, script, policy, false);
    // The root filesystem is the container's own copy (writes stay there), read-only when
    // asked.
    let marker = format!("/var/mole-kubelet-test-{}", std::process::id());
    e.cp.apply(&job(
        "rw",
        &format!("echo x > {marker} && cat {marker}"),
        "File",
    ))
    .unwrap();
    e.cp.apply(&job_ro(
        "ro",
        &format!("echo x > {marker}"),
        "FallbackToLogsOnError",
        true,
    ))
    .unwrap();
    e.cp.apply(&job("ok", "echo one; echo two; echo three", "File"))
        .unwrap();
    e.cp.apply(&job(
        "bad",
        "echo 'the disk is full' > /dev/termination-log; echo noise; exit 3",
        "File",
    ))
    .unwrap();
    e.cp.apply(&job(
        "fallback",
        "echo first; echo 'error: model_does_not_fit: 9 GiB > 8 GiB'; exit 2",
        "FallbackToLogsOnError",
    ))
    .unwrap();
    let terminated = |name: &'static str| {
        let client = e.client.clone();
        async move {
            wait_for(Duration::from_secs(60), name, || async {
                let ps = pods(&client, &format!("job-name={name}")).await;
                let p = ps.into_iter().next()?;
                matches!(phase(&p), Some("Succeeded" | "Failed")).then_some(p)
            })
            .await
            .unwrap()
        }
    };
    let ok = terminated("ok").await;
    assert_eq!(phase(&ok), Some("Succeeded"));
    let t = exit(&ok);
    assert_eq!((t.exit_code, t.reason.as_deref()), (0, Some("Completed")));
    let bad = terminated("bad").await;
    assert_eq!(phase(&bad), Some("Failed"));
    let t = exit(&bad);
    assert_eq!(t.exit_code, 3);
    assert_eq!(t.reason.as_deref(), Some("Error"));
    assert_eq!(t.message.as_deref(), Some("the disk is full\n"));
    let t = exit(&terminated("fallback").await);
    assert_eq!(t.exit_code, 2);
    assert_eq!(
        t.message.as_deref(),
        Some("first\nerror: model_does_not_fit: 9 GiB > 8 GiB\n")
    );
    let rw = terminated("rw").await;
    assert_eq!(phase(&rw), Some("Succeeded"));
    assert!(
        !Path::new(&marker).exists(),
        "a container wrote {marker} on the host"
    );
    let t = exit(&terminated("ro").await);
    assert_ne!(t.exit_code, 0);
    assert!(
        t.message
            .as_deref()
            .unwrap_or("")
            .contains("Read-only file system"),
        "{t:?}"
    );
    // The Job controller reads the pods' phases.
    let jobs: Api<Job> = Api::namespaced(e.client.clone(), "t");
    wait_for(Duration::from_secs(30), "the Jobs' verdicts", || async {
        let ok = jobs.get("ok").await.ok()?.status?;
        let bad = jobs.get("bad").await.ok()?.status?;
        (ok.succeeded == Some(1) && bad.failed == Some(1)).then_some(())
    })
    .await
    .unwrap();
    let name = ok.metadata.name.unwrap();
    assert_eq!(
        e.cp.kubectl(&["logs", "-n", "t", &name]).unwrap(),
        "one\ntwo\nthree\n"
    );
    assert_eq!(
        e.cp.kubectl(&["logs", "-n", "t", &name, "--tail=1"])
            .unwrap(),
        "three\n"
    );
    assert_eq!(
        e.cp.kubectl(&["logs", "-n", "t", &name, "-f"]).unwrap(),
        "one\ntwo\nthree\n"
    );
    // The kubelet's own endpoint also answers the client library (kube's `logs`).
    let api: Api<Pod> = Api::namespaced(e.client.clone(), "t");
    let text = api
        .logs(
            bad.metadata.name.as_deref().unwrap(),
            &kube::api::LogParams::default(),
        )
        .await
        .unwrap();
    assert_eq!(text, "noise\n");
}

/// A mounted ConfigMap follows the object within seconds (the kubelet's atomic `..data`
/// swap), seen by the running container; `kubectl logs -f` streams it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real control plane: scripts/checks/control-plane.sh"]
async fn a_config_map_change_reaches_the_mounted_file() {
    let e = env(|c| c).await;
    e.cp.apply(
        r#"
apiVersion: v1
kind: ConfigMap
metadata: {name: conf, namespace: t}
data: {value: "v1"}
---
apiVersion: v1
kind: Pod
metadata: {name: reader, namespace: t}
spec:
  containers:
  - name: main
    image: mole-test/shell:1
    command: [sh, -c, 'while true; do echo "value=$(cat /etc/conf/value) env=$FROM_CM pod=$POD ns=$NS"; sleep 0.3; done']
    env:
    - {name: FROM_CM, valueFrom: {configMapKeyRef: {name: conf, key: value}}}
    - {name: POD, valueFrom: {fieldRef: {fieldPath: metadata.name}}}
    - {name: NS, valueFrom: {fieldRef: {fieldPath: metadata.namespace}}}
    volumeMounts: [{name: conf, mountPath: /etc/conf, readOnly: true}]
  volumes: [{name: conf, configMap: {name: conf}}]
"#,
    )
    .unwrap();
    let last_line = || {
        let out =
            e.cp.kubectl(&["logs", "-n", "t", "reader", "--tail=1"])
                .unwrap_or_default();
        out.trim().to_string()
    };
    wait_for(Duration::from_secs(60), "the first value", || async {
        (last_line() == "value=v1 env=v1 pod=reader ns=t").then_some(())
    })
    .await
    .unwrap_or_else(|err| panic!("{err}: {:?}", last_line()));
    let cms: Api<ConfigMap> = Api::namespaced(e.client.clone(), "t");
    let t = Instant::now();
    cms.patch(
        "conf",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"data": {"value": "v2"}})),
    )
    .await
    .unwrap();
    // Env is set at start (as with a real kubelet); the file follows.
    wait_for(Duration::from_secs(20), "the file's new value", || async {
        (last_line() == "value=v2 env=v1 pod=reader ns=t").then_some(())
    })
    .await
    .unwrap_or_else(|err| panic!("{err}: {:?}", last_line()));
    eprintln!("the change reached the container in {:?}", t.elapsed());
    // `kubectl logs -f` streams until stopped: read a few lines, then stop it.
    let mut child = kubectl_stdout(&e.cp, &["logs", "-f", "-n", "t", "reader", "--tail=0"]);
    let stdout = child.stdout.take().unwrap();
    let lines = tokio::task::spawn_blocking(move || {
        use std::io::BufRead as _;
        std::io::BufReader::new(stdout)
            .lines()
            .take(3)
            .map(|l| l.unwrap())
            .collect::<Vec<_>>()
    });
    let lines = tokio::time::timeout(Duration::from_secs(20), lines)
        .await
        .expect("kubectl logs -f streamed 3 lines within 20 s")
        .unwrap();
    let _ = child.kill();
    let _ = child.wait();
    assert!(lines.iter().all(|l| l.starts_with("value=v2")), "{lines:?}");
}

/// Deleting a pod: SIGTERM, which its process handles (it logs and exits 0), then the
/// object is gone and so are the process and the pod's network namespace; one that ignores
/// SIGTERM is killed after its grace period.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real control plane: scripts/checks/control-plane.sh"]
async fn deleting_a_pod_stops_its_process() {
    let e = env(|c| c).await;
    let pod = |name: &str, script: &str| {
        format!(
            r#"
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: t}}
spec:
  terminationGracePeriodSeconds: 3
  containers:
  - name: main
    image: mole-test/shell:1
    command: [sh, -c, {script:?}]
"#
        )
    };
    e.cp.apply(&pod(
        "polite",
        "trap 'echo got TERM; exit 0' TERM; echo up; while true; do sleep 0.1; done",
    ))
    .unwrap();
    e.cp.apply(&pod(
        "stubborn",
        "trap '' TERM; echo up; while true; do sleep 0.1; done",
    ))
    .unwrap();
    let api: Api<Pod> = Api::namespaced(e.client.clone(), "t");
    wait_for(Duration::from_secs(60), "both pods running", || async {
        let ps = pods(&e.client, "").await;
        (ps.len() == 2 && ps.iter().all(|p| phase(p) == Some("Running"))).then_some(())
    })
    .await
    .unwrap();
    let before = e.kubelet.running_processes();
    assert_eq!(before.len(), 2);
    let ns_before = namespaces(e.kubelet.bridge_name());
    assert_eq!(ns_before.len(), 2, "{ns_before:?}");
    // Read the polite one's log through a follow that outlives its container.
    let follow = kubectl_stdout(&e.cp, &["logs", "-f", "-n", "t", "polite"]);
    tokio::time::sleep(Duration::from_millis(500)).await;
    // How long a delete takes until the object is gone.
    let delete = |name: &'static str| {
        let api = api.clone();
        async move {
            let t = Instant::now();
            api.delete(name, &DeleteParams::default()).await.unwrap();
            wait_for(Duration::from_secs(20), &format!("{name} gone"), || async {
                api.get_opt(name).await.ok()?.is_none().then_some(())
            })
            .await
            .unwrap();
            t.elapsed()
        }
    };
    let polite_took = delete("polite").await;
    let out = follow.wait_with_output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "up\ngot TERM\n");
    let stubborn_took = delete("stubborn").await;
    eprintln!("polite gone in {polite_took:?}, stubborn in {stubborn_took:?}");
    assert!(polite_took < Duration::from_secs(3), "{polite_took:?}");
    assert!(
        stubborn_took >= Duration::from_secs(3) && stubborn_took < Duration::from_secs(8),
        "the grace period is 3 s: {stubborn_took:?}"
    );
    wait_for(Duration::from_secs(5), "the processes gone", || async {
        e.kubelet.running_processes().is_empty().then_some(())
    })
    .await
    .unwrap();
    for p in before {
        assert!(
            !Path::new(&format!("/proc/{p}")).exists(),
            "process {p} lives on"
        );
    }
    let ns_after = namespaces(e.kubelet.bridge_name());
    assert!(ns_after.is_empty(), "{ns_after:?}");
}

/// Restarts as a kubelet makes them: a crashing container of a Deployment-style pod is
/// restarted with back-off (CrashLoopBackOff, the last exit in lastState); a failing liveness
/// probe restarts a live one; an image no one maps fails to pull.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real control plane: scripts/checks/control-plane.sh"]
async fn crashes_and_failed_liveness_probes_restart_containers() {
    let e = env(|mut c| {
        // Short back-off so the test sees several restarts.
        c.crash_backoff = (Duration::from_secs(1), Duration::from_secs(2));
        c
    })
    .await;
    e.cp.apply(
        r#"
apiVersion: v1
kind: Pod
metadata: {name: crasher, namespace: t}
spec:
  containers:
  - name: main
    image: mole-test/shell:1
    command: [sh, -c, 'echo crashing; exit 7']
---
apiVersion: v1
kind: Pod
metadata: {name: unwell, namespace: t}
spec:
  terminationGracePeriodSeconds: 1
  containers:
  - name: main
    image: mole-test/python:3
    command: [python3, -m, http.server, "8080"]
    livenessProbe: {httpGet: {path: /, port: 8081}, periodSeconds: 1, failureThreshold: 2}
---
apiVersion: v1
kind: Pod
metadata: {name: probed, namespace: t}
spec:
  containers:
  - name: main
    image: mole-test/python:3
    command: [sh, -c, 'sleep 2; touch /tmp/ready; exec python3 -m http.server 8080']
    readinessProbe: {exec: {command: [test, -f, /tmp/ready]}, periodSeconds: 1}
    livenessProbe: {tcpSocket: {port: 8080}, initialDelaySeconds: 4, periodSeconds: 1, failureThreshold: 3}
---
apiVersion: v1
kind: Pod
metadata: {name: nowhere, namespace: t}
spec:
  containers:
  - name: main
    image: registry.example/nothing:1
"#,
    )
    .unwrap();
    let api: Api<Pod> = Api::namespaced(e.client.clone(), "t");
    let status = |name: &'static str| {
        let api = api.clone();
        async move {
            api.get(name)
                .await
                .ok()?
                .status?
                .container_statuses?
                .into_iter()
                .next()
        }
    };
    let crash = wait_for(
        Duration::from_secs(60),
        "crasher in CrashLoopBackOff",
        || async {
            let cs = status("crasher").await?;
            let w = cs.state.clone()?.waiting?;
            (w.reason.as_deref() == Some("CrashLoopBackOff") && cs.restart_count >= 2).then_some(cs)
        },
    )
    .await
    .unwrap();
    let last = crash.last_state.unwrap().terminated.unwrap();
    assert_eq!(last.exit_code, 7);
    assert!(!crash.ready);
    let unwell = wait_for(Duration::from_secs(60), "unwell restarted", || async {
        let cs = status("unwell").await?;
        (cs.restart_count >= 1).then_some(cs)
    })
    .await
    .unwrap();
    // Killed by SIGTERM after its liveness probe failed twice.
    let last = unwell.last_state.unwrap().terminated.unwrap();
    assert_eq!(last.exit_code, 143, "{last:?}");
    let pull = wait_for(Duration::from_secs(30), "nowhere's pull error", || async {
        status("nowhere").await?.state?.waiting
    })
    .await
    .unwrap();
    assert!(
        matches!(
            pull.reason.as_deref(),
            Some("ErrImagePull" | "ImagePullBackOff")
        ),
        "{pull:?}"
    );
    assert!(pull
        .message
        .unwrap_or_default()
        .contains("registry.example/nothing:1"),);
    let p = api.get("nowhere").await.unwrap();
    assert_eq!(p.status.unwrap().phase.as_deref(), Some("Pending"));
    // An exec readiness probe (run in the container's namespaces: its /tmp) and a tcpSocket
    // liveness probe that passes: Ready, never restarted.
    let probed = wait_for(Duration::from_secs(30), "probed Ready", || async {
        let cs = status("probed").await?;
        cs.ready.then_some(cs)
    })
    .await
    .unwrap();
    assert!(
        !Path::new("/tmp/ready").exists(),
        "the container's /tmp is not the host's"
    );
    tokio::time::sleep(Duration::from_secs(6)).await;
    let cs = status("probed").await.unwrap();
    assert!(cs.ready && cs.restart_count == 0, "{cs:?} (was {probed:?})");
}

/// `resources.limits.cpu` is a CFS quota as a kubelet sets it: a container limited to `100m`
/// needs about ten times the CPU time it burns in wall time, one without a limit about the
/// same. (The merge Job of tests/fleet_e2e.rs's restart case relies on it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real control plane: scripts/checks/control-plane.sh"]
async fn a_cpu_limit_throttles_the_container() {
    let e = env(|c| c).await;
    // Burns 0.3 s of CPU and prints the wall time it took.
    let burner = |name: &str, limit: &str| {
        one_shot_job(
            name,
            "mole-test/python:3",
            &format!(
                r#"command: [python3, -c, "import time\nt = time.time()\nc = time.process_time()\nwhile time.process_time() - c < 0.3: pass\nprint(round(time.time() - t, 3))"]
resources: {{limits: {{cpu: {limit}}}}}"#
            ),
        )
    };
    e.cp.apply(&burner("limited", "100m")).unwrap();
    e.cp.apply(&burner("free", "\"8\"")).unwrap();
    let jobs: Api<Job> = Api::namespaced(e.client.clone(), "t");
    let wall = |name: &'static str| {
        let jobs = jobs.clone();
        let cp = &e.cp;
        async move {
            wait_for(Duration::from_secs(60), name, || async {
                (jobs.get(name).await.ok()?.status?.succeeded == Some(1)).then_some(())
            })
            .await
            .unwrap();
            let out = cp
                .kubectl(&["logs", "-n", "t", &format!("job/{name}")])
                .unwrap();
            out.trim().parse::<f64>().unwrap()
        }
    };
    let limited = wall("limited").await;
    let free = wall("free").await;
    eprintln!("0.3 s of CPU took {limited} s at 100m, {free} s unlimited");
    assert!(limited >= 2.0, "{limited} s: the limit was not enforced");
    assert!(free < 1.5, "{free} s without a (binding) limit");
    // The containers' cgroups went with them.
    let bridge = e.kubelet.bridge_name().to_string();
    let left: Vec<String> = [
        "/sys/fs/cgroup/mole-kubelet",
        "/sys/fs/cgroup/cpu/mole-kubelet",
    ]
    .iter()
    .flat_map(|d| std::fs::read_dir(d).into_iter().flatten().flatten())
    .map(|e| e.file_name().to_string_lossy().into_owned())
    .filter(|n| n.starts_with(&format!("{bridge}-")))
    .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// The node stays Ready past the node lifecycle controller's grace period (50 s): its Lease
/// is renewed every 10 s, so its pod is neither tainted away nor evicted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real control plane: scripts/checks/control-plane.sh"]
async fn the_node_stays_ready_past_the_lifecycle_grace_period() {
    let e = env(|c| c).await;
    e.cp.apply(
        r#"
apiVersion: v1
kind: Pod
metadata: {name: sleeper, namespace: t}
spec:
  containers:
  - {name: main, image: "mole-test/shell:1", command: [sh, -c, 'while true; do sleep 1; done']}
"#,
    )
    .unwrap();
    let api: Api<Pod> = Api::namespaced(e.client.clone(), "t");
    wait_for(Duration::from_secs(60), "sleeper running", || async {
        let p = api.get("sleeper").await.ok()?;
        (phase(&p) == Some("Running")).then_some(())
    })
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_secs(65)).await;
    let node: k8s_openapi::api::core::v1::Node = Api::all(e.client.clone())
        .get(&e.kubelet.node_name)
        .await
        .unwrap();
    let ready = node
        .status
        .unwrap()
        .conditions
        .unwrap()
        .into_iter()
        .find(|c| c.type_ == "Ready")
        .unwrap();
    assert_eq!(ready.status, "True", "{ready:?}");
    let taints = node.spec.unwrap().taints.unwrap_or_default();
    assert!(taints.is_empty(), "{taints:?}");
    let lease: k8s_openapi::api::coordination::v1::Lease =
        Api::namespaced(e.client.clone(), "kube-node-lease")
            .get(&e.kubelet.node_name)
            .await
            .unwrap();
    let renewed = lease.spec.unwrap().renew_time.unwrap().0;
    let age = k8s_openapi::jiff::Timestamp::now().duration_since(renewed);
    assert!(age.as_secs() < 15, "the Lease was renewed {age:?} ago");
    let p = api.get("sleeper").await.unwrap();
    assert!(
        p.metadata.deletion_timestamp.is_none(),
        "the pod is being evicted"
    );
    let st = p.status.unwrap();
    assert_eq!(st.phase.as_deref(), Some("Running"));
    assert_eq!(st.container_statuses.unwrap()[0].restart_count, 0);
}

// ---------------------------------------------------------------------------------------
// The operator's real path: helm install of the chart, the operator in-process as the chart's
// ServiceAccount, `mole-worker` of this build as the worker image, the tiny llama fixture on
// a hostPath PersistentVolume.

/// [`stack::Mole`] on the tiny llama fixture, the operator in-process; prints the test's wall
/// time when dropped.
struct Mole {
    // Dropped first: the test's time is its own, not the teardown's.
    clock: stack::Stopwatch,
    m: stack::Mole,
}

impl std::ops::Deref for Mole {
    type Target = stack::Mole;
    fn deref(&self) -> &stack::Mole {
        &self.m
    }
}

async fn mole() -> Mole {
    let clock = stack::Stopwatch::start();
    let opts = stack::Options::this_build(stack::Fixture::TinyLlama, true).unwrap();
    Mole {
        clock,
        m: stack::Mole::start(opts).await.unwrap(),
    }
}

/// The tiny llama pool on CPU, one dynamic pod (as scripts/kind-e2e.sh's pools).
fn tiny_pool() -> String {
    stack::cpu_pool("tiny", "llama", "  dynamic: {replicas: 1}")
}

/// Issue 58, item 3, first case: `kubectl apply` of a dynamic pool on the tiny llama fixture
/// and of an Adapter; the operator makes the pool's objects, the kubelet runs the worker pod
/// (`mole-worker serve` on the pool's ConfigMap, model volume, operator token), the pod
/// becomes Ready by its probes, the operator loads the adapter, and a chat completion with
/// `model: calendar` sent to the pool's Service answers 200 from the adapter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real control plane: scripts/checks/control-plane.sh"]
async fn a_dynamic_pool_serves_an_adapter_through_its_service() {
    let m = mole().await;
    m.cp.apply(&tiny_pool()).unwrap();
    m.wait_pool_ready("tiny", Duration::from_secs(240))
        .await
        .unwrap();
    eprintln!("pool Ready after {:.1} s", m.clock.elapsed().as_secs_f64());
    m.cp.apply(
        r#"
apiVersion: mole.dev/v1alpha1
kind: Adapter
metadata: {name: calendar, namespace: ml}
spec: {pool: tiny, version: v1, source: {path: adapters/calendar/v1}, label: calendar}
"#,
    )
    .unwrap();
    m.wait_adapter("calendar", Duration::from_secs(180), |st| {
        st.phase == mole_crds::AdapterPhase::Ready
    })
    .await
    .unwrap();
    eprintln!(
        "adapter Ready after {:.1} s",
        m.clock.elapsed().as_secs_f64()
    );
    let (status, v) = m.chat("tiny", "calendar").await.unwrap();
    assert_eq!(status, 200, "{v}\n{}", m.dump());
    assert_eq!(v["mole"]["adapter"], "calendar", "{v}");
    assert_eq!(v["mole"]["adapter_version"], "v1", "{v}");
    assert_eq!(m.kubelet.running_processes().len(), 1);
}

/// Issue 58, item 3: an Adapter with `serving.mode: merged` is merged by a real merge Job
/// (`mole-worker merge` writing the model volume, its progress read through `pods/log`), its
/// merged Deployment answers through its own Service, and the pool's Service forwards the
/// adapter's requests to it (the dynamic pod calls `http://tiny-calendar.ml.svc:8000`, which
/// its hosts file resolves).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real control plane: scripts/checks/control-plane.sh"]
async fn a_merged_adapter_is_merged_by_a_job_and_served_by_its_deployment() {
    let m = mole().await;
    m.cp.apply(&tiny_pool()).unwrap();
    m.cp.apply(
        r#"
apiVersion: mole.dev/v1alpha1
kind: Adapter
metadata: {name: calendar, namespace: ml}
spec: {pool: tiny, version: v1, source: {path: adapters/calendar/v1}, label: calendar,
       serving: {mode: merged}}
"#,
    )
    .unwrap();
    let st = m
        .wait_adapter("calendar", Duration::from_secs(300), |st| {
            st.phase == mole_crds::AdapterPhase::Ready
                && st.serving_mode == Some(mole_crds::ServingMode::Merged)
                && st.active_version.as_deref() == Some("v1")
        })
        .await
        .unwrap();
    eprintln!(
        "merged and Ready after {:.1} s",
        m.clock.elapsed().as_secs_f64()
    );
    let out = st.history[0].merged_output.clone().unwrap();
    assert!(out.starts_with("merged/calendar/v1-"), "{out}");
    assert!(
        m.models.join(&out).join("config.json").is_file(),
        "the merge Job wrote {out} on the volume"
    );
    assert_eq!(
        st.endpoint.as_deref(),
        Some("http://tiny-calendar.ml.svc:8000")
    );
    // The merge Job's pod succeeded with exit 0.
    let jobs: Api<Job> = Api::namespaced(m.admin.clone(), "ml");
    let merges = jobs
        .list(&ListParams::default().labels("app.kubernetes.io/component=merge"))
        .await
        .unwrap()
        .items;
    assert_eq!(merges.len(), 1, "{}", m.dump());
    assert_eq!(merges[0].status.as_ref().unwrap().succeeded, Some(1));
    // The merged Deployment through its own Service.
    let (status, v) = m.chat("tiny-calendar", "calendar").await.unwrap();
    assert_eq!(status, 200, "{v}\n{}", m.dump());
    // The pool's Service: the dynamic pod forwards to the merged Service by its DNS name
    // once it has reloaded the WorkerConfig that names it.
    m.wait_pool_ready("tiny", Duration::from_secs(120))
        .await
        .unwrap();
    let t = Instant::now();
    let answers = std::sync::Mutex::new(Vec::new());
    let v = wait_for(
        Duration::from_secs(60),
        "an answer forwarded to the merged pod",
        || async {
            let (status, v) = m.chat("tiny", "calendar").await.unwrap();
            let merged = status == 200 && v["mole"]["mode"] == "merged";
            answers
                .lock()
                .unwrap()
                .push(format!("{status} {}", v["mole"]));
            merged.then_some(v)
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}: {:?}\n{}", answers.lock().unwrap(), m.dump()));
    // Until the dynamic pod has reloaded the WorkerConfig naming the merged endpoint it
    // serves the adapter itself (200, `mode: dynamic`): that window is measured here.
    let before: Vec<String> = answers.lock().unwrap().clone();
    eprintln!(
        "forwarded {:?} after the adapter was Ready; answers before: {:?}",
        t.elapsed(),
        &before[..before.len() - 1]
    );
    // It was the merged pod's answer: the dynamic pod counts the forward.
    let dynamic: Vec<Pod> = Api::<Pod>::namespaced(m.admin.clone(), "ml")
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|p| {
            p.metadata
                .name
                .as_deref()
                .is_some_and(|n| n.starts_with("tiny-dynamic-"))
        })
        .collect();
    assert_eq!(dynamic.len(), 1, "{}", m.dump());
    let ip = dynamic[0].status.as_ref().unwrap().pod_ip.clone().unwrap();
    let metrics = get_text(format!("http://{ip}:8000/metrics")).await;
    assert!(
        metrics.contains(r#"mole_merged_proxy_total{adapter="calendar",outcome="ok"} 1"#),
        "{}",
        metrics
            .lines()
            .filter(|l| l.contains("proxy"))
            .collect::<Vec<_>>()
            .join("\n")
            + &format!(
                "\nanswer: {v}\nconfig: {}",
                m.cp.kubectl(&["get", "configmap", "tiny-config", "-n", "ml", "-o", "yaml"])
                    .unwrap_or_default()
            )
    );
    assert_eq!(m.kubelet.running_processes().len(), 2, "{}", m.dump());
}
