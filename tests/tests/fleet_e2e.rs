//! Issue 58, item 3: the fleet's life on Kubernetes' own control plane, with the pods run by the
//! test kubelet (`mole_tests::kubelet`) and mole installed as a user installs it
//! (`mole_tests::stack`: `helm install` of the chart, the `mole-operator` binary as the chart's
//! ServiceAccount with its Lease, this build's `mole-worker` as the worker image, the models on
//! a hostPath PersistentVolume). Every request goes to the pool's Service (through its
//! EndpointSlices, as kube-proxy would route it), every change is a `kubectl apply`.
//!
//! Cases (the kind suite's, `tests/e2e_cluster.rs`, which never ran): rollback by apply; a
//! canary that errors rolled back by the operator; scale to zero and back; promotion under
//! traffic with no failed request; an operator restart while a merge Job runs.
//!
//! Ignored by a plain `cargo test`: they need the control plane's binaries
//! (`scripts/k8s-bins.sh`), root (network namespaces, a bridge, mounts, cgroups) and minutes.
//! `scripts/checks/control-plane.sh` runs them with `--ignored --test-threads=1`.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test is a failed test

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use k8s_openapi::api::events::v1::Event;
use kube::api::ListParams;
use kube::{Api, Client};
use mole_crds::{AdapterPhase, AdapterStatus, CanaryPhase, ServingMode};
use mole_tests::cluster::wait_for;
use mole_tests::kubelet::service_url;
use mole_tests::stack::{self, Fixture, Mole, NS};

/// A [`Mole`] (the operator as a process) that prints the test's wall time when dropped.
struct Env {
    // Dropped first: the test's time is its own, not the teardown's.
    clock: stack::Stopwatch,
    m: Mole,
}

impl std::ops::Deref for Env {
    type Target = Mole;
    fn deref(&self) -> &Mole {
        &self.m
    }
}

impl std::ops::DerefMut for Env {
    fn deref_mut(&mut self) -> &mut Mole {
        &mut self.m
    }
}

impl Env {
    async fn start(fixture: Fixture) -> Self {
        let clock = stack::Stopwatch::start();
        let opts = stack::Options::this_build(fixture, false).unwrap();
        let m = Mole::start(opts).await.unwrap();
        Self { clock, m }
    }

    /// Seconds since the test started, for its log.
    fn at(&self) -> f64 {
        (self.clock.elapsed().as_secs_f64() * 10.0).round() / 10.0
    }

    /// `kubectl apply` of `yaml`, which must succeed.
    fn apply(&self, yaml: &str) {
        self.cp.apply(yaml).unwrap();
    }

    /// Names of the merge Jobs of adapter `name`, sorted.
    async fn merge_jobs(&self, name: &str) -> Vec<String> {
        stack::merge_jobs(&self.admin, NS, name).await.unwrap()
    }

    /// Waits until `name` is Ready, served by merged pods, on `version`.
    async fn merged_ready(&self, name: &str, version: &str, within: Duration) -> AdapterStatus {
        self.wait_adapter(name, within, |st| {
            st.phase == AdapterPhase::Ready
                && st.serving_mode == Some(ServingMode::Merged)
                && st.active_version.as_deref() == Some(version)
        })
        .await
        .unwrap()
    }

    /// Sends requests for `model` to the pool's Service one after another until `done` accepts
    /// an answer, for at most `within`; returns every answer seen, the last one the accepted.
    /// Fails on a connection error or a timeout.
    async fn until(
        &self,
        pool: &str,
        model: &str,
        within: Duration,
        done: impl Fn(&Answer) -> bool,
    ) -> Vec<Answer> {
        let deadline = Instant::now() + within;
        let mut seen = Vec::new();
        loop {
            let (status, body) = self.chat(pool, model).await.unwrap();
            let a = Answer {
                at: self.at(),
                session: String::new(),
                status,
                body,
            };
            let ok = done(&a);
            seen.push(a);
            if ok {
                return seen;
            }
            assert!(
                Instant::now() < deadline,
                "no accepted answer within {within:?}: {}\n{}",
                summary(&seen),
                self.dump()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Events of `ml` about `object` with `reason`: (type, note).
    async fn events(&self, object: &str, reason: &str) -> Vec<(String, String)> {
        Api::<Event>::namespaced(self.admin.clone(), NS)
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(object))
            .filter(|e| e.reason.as_deref() == Some(reason))
            .map(|e| (e.type_.unwrap_or_default(), e.note.unwrap_or_default()))
            .collect()
    }

    /// The Events of `object` with `reason` once there is one, waiting up to 15 s: a
    /// reconcile publishes its Events after its writes, so the change they announce (a
    /// Deployment's replicas) can be seen before them.
    async fn events_once_posted(&self, object: &str, reason: &str) -> Vec<(String, String)> {
        let wait = wait_for(
            Duration::from_secs(15),
            &format!("an Event {reason} of {object}"),
            || async {
                let seen = self.events(object, reason).await;
                (!seen.is_empty()).then_some(seen)
            },
        )
        .await;
        wait.unwrap_or_else(|err| panic!("{err}\n{}", self.dump()))
    }

    /// The entry of adapter `name` in pool `pool`'s WorkerConfig (its ConfigMap).
    async fn worker_entry(&self, pool: &str, name: &str) -> Option<mole_crds::WorkerAdapter> {
        let cm = Api::<ConfigMap>::namespaced(self.admin.clone(), NS)
            .get(&format!("{pool}-config"))
            .await
            .ok()?;
        let wc: mole_crds::WorkerConfig =
            serde_json::from_str(cm.data?.get("worker.json")?).ok()?;
        wc.adapters.into_iter().find(|a| a.name == name)
    }
}

/// One answer a [`Traffic`] client got.
#[derive(Debug, Clone)]
struct Answer {
    /// Seconds since the client started.
    at: f64,
    /// The request's `x-session-id` (empty without).
    session: String,
    /// The HTTP status; 0 when no answer came (no endpoint, a connection error).
    status: u16,
    /// The body (or the connection error as a JSON string).
    body: serde_json::Value,
}

impl Answer {
    fn served(&self) -> (&str, &str) {
        served(&self.body)
    }
}

/// A client sending chat completions for `model` to a pool's Service one after another (each
/// resolved anew through the Service's EndpointSlices, as kube-proxy routes each connection)
/// until stopped; with `sessions`, request n carries `x-session-id: s<n>`.
struct Traffic {
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Vec<Answer>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Traffic {
    fn start(admin: &Client, pool: &str, model: &str, sessions: bool) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let seen: Arc<Mutex<Vec<Answer>>> = Arc::default();
        let (admin, pool, model) = (admin.clone(), pool.to_string(), model.to_string());
        let (stop2, seen2) = (stop.clone(), seen.clone());
        let task = tokio::spawn(async move {
            let http = stack::http().unwrap();
            let t0 = Instant::now();
            let port = i32::from(mole_crds::constants::SERVICE_PORT);
            let mut n = 0u64;
            while !stop2.load(Ordering::SeqCst) {
                let session = if sessions {
                    format!("s{n}")
                } else {
                    String::new()
                };
                n += 1;
                let (status, body) = match service_url(&admin, NS, &pool, port).await {
                    Err(e) => (0, serde_json::json!(format!("{e:#}"))),
                    Ok(url) => {
                        let mut req = http
                            .post(format!("{url}/v1/chat/completions"))
                            .json(&stack::chat_body(&model));
                        if sessions {
                            req = req.header(mole_api::SESSION_HEADER, &session);
                        }
                        match req.send().await {
                            Err(e) => (0, serde_json::json!(format!("{e:#}"))),
                            Ok(r) => {
                                let s = r.status().as_u16();
                                (s, r.json().await.unwrap_or_default())
                            }
                        }
                    }
                };
                seen2.lock().unwrap().push(Answer {
                    at: t0.elapsed().as_secs_f64(),
                    session,
                    status,
                    body,
                });
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
        Self { stop, seen, task }
    }

    /// The answers so far.
    fn seen(&self) -> Vec<Answer> {
        self.seen.lock().unwrap().clone()
    }

    /// Waits up to `within` until `done` accepts the answers so far; fails showing them and
    /// `m`'s state.
    async fn until(
        &self,
        m: &Mole,
        within: Duration,
        what: &str,
        done: impl Fn(&[Answer]) -> bool,
    ) {
        if let Err(e) = wait_for(within, what, || async { done(&self.seen()).then_some(()) }).await
        {
            panic!("{e}: {}\n{}", summary(&self.seen()), m.dump());
        }
    }

    /// Stops the client; every answer it got.
    async fn stop(self) -> Vec<Answer> {
        self.stop.store(true, Ordering::SeqCst);
        self.task.await.unwrap();
        let seen = self.seen.lock().unwrap().clone();
        seen
    }
}

/// Each answer as `status mode version "text"`, runs of equal ones counted.
fn summary(answers: &[Answer]) -> String {
    let mut out: Vec<(String, usize)> = Vec::new();
    for a in answers {
        let v = &a.body;
        let line = if a.status == 200 {
            format!(
                "{} {} {} {:?}",
                a.status,
                v["mole"]["mode"].as_str().unwrap_or("-"),
                v["mole"]["adapter_version"].as_str().unwrap_or("-"),
                text(v)
            )
        } else {
            format!("{} {}", a.status, v.get("error").map_or(v, |e| &e["code"]))
        };
        match out.last_mut() {
            Some((l, n)) if *l == line => *n += 1,
            _ => out.push((line, 1)),
        }
    }
    let mut parts: Vec<String> = out.iter().map(|(l, n)| format!("{n} x {l}")).collect();
    // The start and the end of a long alternation say enough.
    if parts.len() > 16 {
        let n = parts.len() - 12;
        parts.splice(6..parts.len() - 6, [format!("... ({n} more runs)")]);
    }
    parts.join("; ")
}

/// The answer's text.
fn text(v: &serde_json::Value) -> String {
    v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// `(mode, adapter_version)` of an answer.
fn served(v: &serde_json::Value) -> (&str, &str) {
    (
        v["mole"]["mode"].as_str().unwrap_or(""),
        v["mole"]["adapter_version"].as_str().unwrap_or(""),
    )
}

/// The tiny llama pool on CPU, one dynamic pod; `merge` is its `spec.merge` (YAML flow).
fn tiny_pool(merge: &str) -> String {
    stack::cpu_pool(
        "tiny",
        "llama",
        &format!("  dynamic: {{replicas: 1}}\n  merge: {merge}"),
    )
}

/// Adapter `calendar` of pool `tiny` on `version` (`adapters/calendar/<version>`), with
/// `spec.serving` `serving` (YAML flow) and `extra` spec lines.
fn calendar(version: &str, serving: &str, extra: &str) -> String {
    format!(
        r#"
apiVersion: mole.dev/v1alpha1
kind: Adapter
metadata: {{name: calendar, namespace: {NS}}}
spec:
  pool: tiny
  version: {version}
  source: {{path: adapters/calendar/{version}}}
  label: calendar
  serving: {serving}
{extra}
"#
    )
}

/// The merged output the Deployment `tiny-calendar` serves (its pod template's annotation).
async fn served_output(m: &Mole) -> String {
    let d = Api::<Deployment>::namespaced(m.admin.clone(), NS)
        .get("tiny-calendar")
        .await
        .unwrap();
    stack::template_annotation(&d, "mole.dev/merged-output").unwrap()
}

/// Rollback is "apply the previous version" (DESIGN §2): an Adapter merged on v1 and served by
/// its merged pods, then `kubectl apply` of v2 (a second merge Job, the merged pods rolled to
/// its output), then `kubectl apply` of the v1 manifest again: the merged pods go back to v1's
/// output, still on the volume, with no new merge Job, and the answers through the pool's
/// Service come from v1's merged pods again (same text as before; v2's differs). Every answer
/// along the way is a 200.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real control plane: scripts/checks/control-plane.sh"]
async fn rollback_by_apply_switches_back_without_a_merge() {
    let e = Env::start(Fixture::TinyLlama).await;
    e.apply(&tiny_pool("{}"));
    let v1_manifest = calendar("v1", "{mode: merged}", "");
    e.apply(&v1_manifest);
    let st = e
        .merged_ready("calendar", "v1", Duration::from_secs(180))
        .await;
    let v1_out = st.history[0].merged_output.clone().unwrap();
    eprintln!("{} s: merged on v1 ({v1_out})", e.at());
    let mut answers = e
        .until("tiny", "calendar", Duration::from_secs(60), |a| {
            a.status == 200 && a.served() == ("merged", "v1")
        })
        .await;
    let v1_text = text(&answers.last().unwrap().body);
    assert_eq!(e.merge_jobs("calendar").await.len(), 1);

    // Roll forward: a second merge.
    e.apply(&calendar("v2", "{mode: merged}", ""));
    let st = e
        .merged_ready("calendar", "v2", Duration::from_secs(180))
        .await;
    let v2_out = st.history[0].merged_output.clone().unwrap();
    assert_ne!(v2_out, v1_out);
    assert!(
        st.history
            .iter()
            .any(|r| r.merged_output.as_deref() == Some(v1_out.as_str())),
        "v1 kept in the history: {:?}",
        st.history
    );
    let jobs = e.merge_jobs("calendar").await;
    assert_eq!(jobs.len(), 2, "{jobs:?}");
    eprintln!("{} s: merged on v2 ({v2_out})", e.at());
    answers.extend(
        e.until("tiny", "calendar", Duration::from_secs(60), |a| {
            a.status == 200 && a.served() == ("merged", "v2")
        })
        .await,
    );
    let v2_text = text(&answers.last().unwrap().body);
    assert_ne!(v1_text, v2_text, "the two versions answer differently");

    // Roll back: the v1 manifest again, with a client sending requests the whole time.
    let traffic = Traffic::start(&e.admin, "tiny", "calendar", false);
    let t = Instant::now();
    e.apply(&v1_manifest);
    let st = e
        .merged_ready("calendar", "v1", Duration::from_secs(120))
        .await;
    let ready_after = t.elapsed();
    assert_eq!(st.history[0].version, "v1");
    assert_eq!(
        st.history[0].merged_output.as_deref(),
        Some(v1_out.as_str())
    );
    assert_eq!(served_output(&e).await, v1_out);
    traffic
        .until(
            &e,
            Duration::from_secs(60),
            "answers of v1's merged pods",
            |a| {
                a.last()
                    .is_some_and(|a| a.status == 200 && a.served() == ("merged", "v1"))
            },
        )
        .await;
    let routed_after = t.elapsed();
    let during = traffic.stop().await;
    assert_eq!(
        text(&during.last().unwrap().body),
        v1_text,
        "{}",
        summary(&during)
    );
    assert_eq!(
        e.merge_jobs("calendar").await,
        jobs,
        "the rollback ran a merge Job"
    );
    answers.extend(during.iter().cloned());
    assert!(
        answers.iter().all(|a| a.status == 200),
        "{}",
        summary(&answers)
    );
    eprintln!(
        "{} s: rolled back: Ready on v1 {ready_after:?} after the apply, answered by v1's merged \
         pods {routed_after:?} after it; answers during the rollback: {}",
        e.at(),
        summary(&during)
    );
}

/// A canary that errors is rolled back by the operator (issue 37, item 3, on the real path):
/// adapter `calendar` v1 with canary v2 at 50% and an analysis (10 requests at least, 10
/// points of errors over the stable version at most), in a pool whose pods hold one adapter at
/// a time (`maxLoras: 1`, no host tier), so each version is read from the volume when its
/// turn comes, as in a pool with more adapters than slots. v2's weights are then broken on the
/// volume (a re-upload gone wrong): every read of the canary fails, counted as its error, and
/// the stable version answers the request instead. A client sends requests with sessions
/// through the pool's Service; the operator reads the pods' counts, rolls the canary back with
/// a Warning Event that gives the numbers, takes it out of the WorkerConfig, and the canary's
/// sessions get v1. No request fails (before the worker fell back to the stable version, the
/// canary's sessions failed until the rollback: 10 and more).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real control plane: scripts/checks/control-plane.sh"]
async fn a_canary_that_errors_is_rolled_back_with_a_warning() {
    let e = Env::start(Fixture::TinyLlama).await;
    e.apply(&tiny_pool("{}").replace(
        "dynamic: {replicas: 1}",
        "dynamic: {replicas: 1, maxLoras: 1, maxCpuLoras: 0}",
    ));
    e.apply(&calendar(
        "v1",
        "{mode: dynamic}",
        "  canary: {version: v2, source: {path: adapters/calendar/v2}, weight: 50,\n           \
         analysis: {minRequests: 10, maxErrorRateIncrease: 0.1}}",
    ));
    let st = e
        .wait_adapter("calendar", Duration::from_secs(120), |st| {
            st.phase == AdapterPhase::Ready
                && st
                    .canary
                    .as_ref()
                    .is_some_and(|c| c.phase == CanaryPhase::Progressing)
        })
        .await
        .unwrap();
    assert_eq!(st.canary.unwrap().weight, 50);
    assert!(e
        .worker_entry("tiny", "calendar")
        .await
        .unwrap()
        .canary
        .is_some());
    eprintln!("{} s: Ready with canary v2 at 50%", e.at());
    std::fs::write(
        e.models
            .join("adapters/calendar/v2/adapter_model.safetensors"),
        b"not a safetensors file",
    )
    .unwrap();
    let canary_session =
        |a: &Answer| mole_api::canary_pick("calendar", 50, Some(a.session.as_str()), 0);
    let traffic = Traffic::start(&e.admin, "tiny", "calendar", true);
    let t = Instant::now();
    let st = e
        .wait_adapter("calendar", Duration::from_secs(150), |st| {
            st.canary
                .as_ref()
                .is_some_and(|c| c.phase == CanaryPhase::RolledBack)
        })
        .await
        .unwrap();
    let rolled_back_after = t.elapsed();
    let c = st.canary.unwrap();
    assert_eq!(c.weight, 0);
    assert_eq!(st.phase, AdapterPhase::Ready, "v1 serves");
    assert!(c.canary.errors >= 10, "{c:?}");
    let warned = e.events("calendar", "CanaryRolledBack").await;
    assert!(
        warned
            .iter()
            .any(|(ty, note)| ty == "Warning" && note.contains("errors")),
        "{warned:?}"
    );
    // Out of the WorkerConfig; once the pod reloaded it, the canary's sessions get v1.
    wait_for(
        Duration::from_secs(30),
        "the canary out of the WorkerConfig",
        || async {
            e.worker_entry("tiny", "calendar")
                .await
                .filter(|w| w.canary.is_none())
        },
    )
    .await
    .unwrap();
    let n0 = traffic.seen().len();
    traffic
        .until(
            &e,
            Duration::from_secs(60),
            "10 canary sessions served by v1",
            |a| {
                a[n0..]
                    .iter()
                    .filter(|a| canary_session(a) && a.status == 200 && a.served().1 == "v1")
                    .count()
                    >= 10
            },
        )
        .await;
    let served_after = t.elapsed();
    let answers = traffic.stop().await;
    let (canary, stable): (Vec<&Answer>, Vec<&Answer>) =
        answers.iter().partition(|a| canary_session(a));
    let failed_stable: Vec<&&Answer> = stable.iter().filter(|a| a.status != 200).collect();
    assert!(failed_stable.is_empty(), "{failed_stable:?}");
    assert!(stable.iter().all(|a| a.served().1 == "v1"));
    let failed: Vec<&&Answer> = canary.iter().filter(|a| a.status != 200).collect();
    assert!(
        failed.is_empty(),
        "the stable version answers a broken canary's share: {failed:?}"
    );
    let on_v1 = canary.iter().filter(|a| a.served().1 == "v1").count();
    eprintln!(
        "{} s: rolled back {rolled_back_after:?} after the canary's files broke, its sessions \
         on v1 by config {served_after:?} after; canary: {c:?}; {} stable-session answers all \
         200 v1, {} canary-session answers all 200, {on_v1} of them by v1: {}",
        e.at(),
        stable.len(),
        canary.len(),
        summary(&answers)
    );
}

/// The Deployment `tiny-calendar`: (spec.replicas, status.readyReplicas).
async fn merged_replicas(m: &Mole) -> Option<(i32, i32)> {
    let d = Api::<Deployment>::namespaced(m.admin.clone(), NS)
        .get_opt("tiny-calendar")
        .await
        .ok()??;
    let want = d.spec?.replicas.unwrap_or(1);
    let ready = d.status.and_then(|s| s.ready_replicas).unwrap_or(0);
    Some((want, ready))
}

/// Scale to zero and back (issue 37, item 6): a pool with `merge.scaleToZero` at the shortest
/// idle time the CRD allows (60 s) and `unloadFromDynamic`, an Adapter served by its merged
/// pods. Left idle, it is loaded into the dynamic pods again and only then is its merged
/// Deployment scaled to 0 (kept, with its Service), with a `ScaledToZero` Event; the adapter
/// stays Ready and its requests are answered by the dynamic pods. One request brings the
/// Deployment back (the dynamic pods count it), and once its pod is ready the pool's Service
/// forwards to it again. Every answer is a 200.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real control plane: scripts/checks/control-plane.sh"]
async fn idle_merged_pods_scale_to_zero_and_a_request_brings_them_back() {
    let e = Env::start(Fixture::TinyLlama).await;
    e.apply(&tiny_pool(
        "{unloadFromDynamic: true, scaleToZero: {idleSeconds: 60}}",
    ));
    e.apply(&calendar("v1", "{mode: merged, replicas: 1}", ""));
    e.merged_ready("calendar", "v1", Duration::from_secs(180))
        .await;
    let mut answers = e
        .until("tiny", "calendar", Duration::from_secs(60), |a| {
            a.status == 200 && a.served() == ("merged", "v1")
        })
        .await;
    let last_request = Instant::now();
    eprintln!("{} s: merged and forwarded to; now idle", e.at());

    // Idle: scaled to zero once the dynamic pods hold it again.
    let st = e
        .wait_adapter("calendar", Duration::from_secs(180), |st| {
            st.conditions
                .iter()
                .any(|c| c.type_ == "Ready" && c.reason == "ScaledToZero")
        })
        .await
        .unwrap();
    let zero_after = last_request.elapsed();
    assert_eq!(st.phase, AdapterPhase::Ready);
    assert_eq!(st.serving_mode, Some(ServingMode::Dynamic));
    wait_for(Duration::from_secs(60), "no merged pod left", || async {
        (merged_replicas(&e).await? == (0, 0)).then_some(())
    })
    .await
    .unwrap_or_else(|err| panic!("{err}\n{}", e.dump()));
    // The adapter's status (no merged endpoint) and its Deployment's scale are written by one
    // reconcile; the pool's WorkerConfig follows when the pool reconciles on that status, so
    // it may lag the Deployment by a reconcile (the dynamic pods fall back to the adapter they
    // hold when the parked Service answers nothing meanwhile).
    let synced = wait_for(
        Duration::from_secs(30),
        "the WorkerConfig loads it with no merged endpoint",
        || async {
            let w = e.worker_entry("tiny", "calendar").await?;
            (w.load && w.merged_endpoint.is_none()).then_some(())
        },
    )
    .await;
    if let Err(err) = synced {
        let w = e.worker_entry("tiny", "calendar").await;
        panic!("{err}\n{w:?}\n{}", e.dump());
    }
    let svc: Api<k8s_openapi::api::core::v1::Service> = Api::namespaced(e.admin.clone(), NS);
    assert!(
        svc.get_opt("tiny-calendar").await.unwrap().is_some(),
        "the Service is kept"
    );
    assert_eq!(
        e.events_once_posted("calendar", "ScaledToZero").await.len(),
        1
    );
    eprintln!(
        "{} s: scaled to zero {zero_after:?} after the last request",
        e.at()
    );

    // One request: served by the dynamic pods, and it brings the merged pods back.
    let t = Instant::now();
    let (status, body) = e.chat("tiny", "calendar").await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(served(&body), ("dynamic", "v1"), "{body}");
    answers.push(Answer {
        at: e.at(),
        session: String::new(),
        status,
        body,
    });
    wait_for(
        Duration::from_secs(120),
        "the merged Deployment back at 1",
        || async { (merged_replicas(&e).await?.0 == 1).then_some(()) },
    )
    .await
    .unwrap_or_else(|err| panic!("{err}\n{}", e.dump()));
    let up_after = t.elapsed();
    assert_eq!(
        e.events_once_posted("calendar", "ScaledFromZero")
            .await
            .len(),
        1
    );
    answers.extend(
        e.until("tiny", "calendar", Duration::from_secs(90), |a| {
            a.status == 200 && a.served() == ("merged", "v1")
        })
        .await,
    );
    let forwarded_after = t.elapsed();
    let st = e
        .merged_ready("calendar", "v1", Duration::from_secs(30))
        .await;
    assert_eq!(st.phase, AdapterPhase::Ready);
    assert!(
        answers.iter().all(|a| a.status == 200),
        "{}",
        summary(&answers)
    );
    eprintln!(
        "{} s: scaled back to 1 {up_after:?} after the request, forwarded to again \
         {forwarded_after:?} after it; answers: {}",
        e.at(),
        summary(&answers)
    );
}

/// Promotion under traffic with no failed request (issue 37, item 2): a pool with
/// `merge.traffic` (promote at half the pool's tokens, no window, no hold, one merged GPU) and an
/// `auto` Adapter served by the dynamic pods. A client sends requests for it through the pool's
/// Service one after another the whole time; the operator reads the pods' counters, decides
/// the promotion (Event `Promoted`, `status.fleet.merged`), runs the merge Job, starts the
/// merged pods, and the dynamic pods forward to them once ready. Every answer is a 200, and the
/// client ends once 20 answers in a row came from the merged pods.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real control plane: scripts/checks/control-plane.sh"]
async fn an_auto_adapter_is_promoted_under_traffic_with_no_failed_request() {
    let e = Env::start(Fixture::TinyLlama).await;
    e.apply(&tiny_pool(
        "{traffic: {promoteShare: 0.5, demoteShare: 0.1, windowSeconds: 0, minHoldSeconds: 0, \
         maxMergedGpus: 1}}",
    ));
    e.apply(&calendar("v1", "{mode: auto}", ""));
    e.wait_adapter("calendar", Duration::from_secs(120), |st| {
        st.phase == AdapterPhase::Ready && st.serving_mode == Some(ServingMode::Dynamic)
    })
    .await
    .unwrap();
    eprintln!("{} s: Ready on the dynamic pods; traffic starts", e.at());
    let traffic = Traffic::start(&e.admin, "tiny", "calendar", false);
    let t = Instant::now();
    // The fleet decision (TrafficPromoted), then the merged pods serving (Promoted).
    let mut at = Vec::new();
    for reason in ["TrafficPromoted", "Promoted"] {
        let took = wait_for(Duration::from_secs(120), reason, || async {
            (!e.events("calendar", reason).await.is_empty()).then(|| t.elapsed())
        })
        .await
        .unwrap_or_else(|err| panic!("{err}: {}\n{}", summary(&traffic.seen()), e.dump()));
        at.push(took);
    }
    let (decided, promoted) = (at[0], at[1]);
    traffic
        .until(
            &e,
            Duration::from_secs(120),
            "20 answers in a row from the merged pods",
            |a| {
                a.len() >= 20
                    && a[a.len() - 20..]
                        .iter()
                        .all(|a| a.status == 200 && a.served().0 == "merged")
            },
        )
        .await;
    let answers = traffic.stop().await;
    let first_merged = answers
        .iter()
        .find(|a| a.served().0 == "merged")
        .map(|a| a.at)
        .unwrap();
    let failed: Vec<&Answer> = answers.iter().filter(|a| a.status != 200).collect();
    assert!(
        failed.is_empty(),
        "{} failed: {failed:?}\n{}",
        failed.len(),
        summary(&answers)
    );
    let st = e
        .merged_ready("calendar", "v1", Duration::from_secs(10))
        .await;
    assert!(
        st.fleet.as_ref().is_some_and(|f| f.merged),
        "{:?}",
        st.fleet
    );
    assert_eq!(e.merge_jobs("calendar").await.len(), 1);
    eprintln!(
        "{} s: decided {decided:?} and promoted {promoted:?} after the traffic started, first \
         answer from the merged pods at {first_merged:.1} s; {} answers, all 200: {}",
        e.at(),
        answers.len(),
        summary(&answers)
    );
}

/// The SmolLM2 pool on CPU (`base/smollm2-135m-instruct`, f32), one dynamic pod, merge Jobs
/// limited to a tenth of a core.
fn smol_pool() -> String {
    stack::cpu_pool(
        "smol",
        stack::SMOLLM2,
        "  dynamic: {replicas: 1}\n  merge: {resources: {limits: {cpu: 100m}}}",
    )
}

/// An operator restarted while a merge Job really runs: SmolLM2-135M (the real model, 538 MB
/// of f32 weights) merged with the demo `french` adapter by a Job limited to `100m` of CPU (the
/// test kubelet enforces it as a CFS quota: the merge takes ~40 s instead of ~4). Once the
/// Job's pod runs, the operator is killed (SIGKILL: a crash, nothing drained, its Lease not
/// released) and a new one started; it waits out the Lease, finds the Job by its deterministic
/// name and waits for it. There is one merge Job and one pod of it, the merge completes, the
/// merged pods serve the adapter through the pool's Service, and nothing is left over: no
/// second output or half-written directory on the volume, no object without its owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real control plane: scripts/checks/control-plane.sh"]
async fn an_operator_restarted_mid_merge_makes_no_second_job_and_the_merge_completes() {
    let mut e = Env::start(Fixture::SmolLm2).await;
    e.apply(&smol_pool());
    e.apply(&format!(
        r#"
apiVersion: mole.dev/v1alpha1
kind: Adapter
metadata: {{name: french, namespace: {NS}}}
spec: {{pool: smol, version: v1, source: {{path: adapters/french/v1}}, label: french,
       serving: {{mode: merged}}}}
"#
    ));
    let jobs: Api<Job> = Api::namespaced(e.admin.clone(), NS);
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(e.admin.clone(), NS);
    let merge_pods = |job: String| {
        let pods = pods.clone();
        async move {
            pods.list(&ListParams::default().labels(&format!("job-name={job}")))
                .await
                .unwrap()
                .items
        }
    };
    // The Job's pod running (the merge under way).
    let job = wait_for(
        Duration::from_secs(120),
        "the merge Job's pod running",
        || async {
            let j = e.merge_jobs("french").await.into_iter().next()?;
            let running = merge_pods(j.clone())
                .await
                .iter()
                .any(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"));
            running.then_some(j)
        },
    )
    .await
    .unwrap_or_else(|err| panic!("{err}\n{}", e.dump()));
    let uid = jobs.get(&job).await.unwrap().metadata.uid.unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    eprintln!(
        "{} s: merge Job {job} running; killing the operator",
        e.at()
    );
    e.operator.as_mut().unwrap().kill();
    e.start_operator().await.unwrap();
    let t = Instant::now();
    wait_for(
        Duration::from_secs(60),
        "the new operator leading",
        || async {
            e.operator
                .as_ref()
                .unwrap()
                .log_tail(50)
                .contains("leading")
                .then_some(())
        },
    )
    .await
    .unwrap();
    let leading_after = t.elapsed();
    // Still merging when the new operator took over: the case under test.
    let active = jobs.get(&job).await.unwrap().status.and_then(|s| s.active);
    assert_eq!(
        active,
        Some(1),
        "the merge ended before the new operator led ({leading_after:?}): no restart mid-merge\n{}",
        e.dump()
    );
    eprintln!(
        "{} s: the new operator leads ({leading_after:?} after its start), the Job still runs",
        e.at()
    );
    let st = e
        .merged_ready("french", "v1", Duration::from_secs(180))
        .await;
    eprintln!("{} s: merged and Ready", e.at());
    // One Job, the same one, one pod of it, Succeeded.
    assert_eq!(e.merge_jobs("french").await, std::slice::from_ref(&job));
    let j = jobs.get(&job).await.unwrap();
    assert_eq!(j.metadata.uid.as_deref(), Some(uid.as_str()));
    assert_eq!(j.status.as_ref().and_then(|s| s.succeeded), Some(1));
    let ps = merge_pods(job.clone()).await;
    assert_eq!(ps.len(), 1, "{}", e.dump());
    let started = e.events("french", "MergeStarted").await;
    assert_eq!(started.len(), 1, "{started:?}");
    // The volume: the one output, complete, nothing half-written beside it.
    let out = st.merge.as_ref().unwrap().output.clone().unwrap();
    let dir = e.models.join(&out);
    assert!(dir.join("config.json").is_file() && dir.join("merge_metadata.json").is_file());
    let siblings: Vec<String> = std::fs::read_dir(dir.parent().unwrap())
        .unwrap()
        .map(|d| d.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(siblings.len(), 1, "{siblings:?}");
    // Every object the operator made has its owner.
    let owned = |kind: &str| {
        let out = e
            .cp
            .kubectl(&[
                "get",
                kind,
                "-n",
                NS,
                "-o",
                "jsonpath={range .items[*]}{.metadata.name} {.metadata.ownerReferences[0].kind}/{.metadata.ownerReferences[0].name}{\"\\n\"}{end}",
            ])
            .unwrap();
        out.lines().map(str::to_string).collect::<Vec<_>>()
    };
    let mut all = owned("jobs");
    all.extend(owned("deployments"));
    all.extend(owned("services"));
    all.extend(
        owned("configmaps")
            .into_iter()
            .filter(|l| !l.starts_with("kube-root-ca")),
    );
    all.sort();
    // The pool's ConfigMap, Deployment and Service; the Adapter's Job, merged Deployment,
    // Service and the merged pods' ConfigMap (named by its output).
    assert_eq!(all.len(), 7, "{all:?}");
    assert!(
        all.iter()
            .all(|l| l.ends_with(" Adapter/french") || l.ends_with(" InferencePool/smol")),
        "{all:?}"
    );
    // Served by its merged pods through the pool's Service.
    let answers = e
        .until("smol", "french", Duration::from_secs(120), |a| {
            a.status == 200 && a.served() == ("merged", "v1")
        })
        .await;
    assert!(
        answers.iter().all(|a| a.status == 200),
        "{}",
        summary(&answers)
    );
    eprintln!(
        "{} s: answered by the merged pods: {}",
        e.at(),
        summary(&answers)
    );
}

/// The Lease's holder, if any (an empty identity is a released Lease).
async fn lease_holder(m: &Mole) -> Option<String> {
    Api::<Lease>::namespaced(m.admin.clone(), "mole-system")
        .get_opt(stack::OPERATOR_LEASE)
        .await
        .ok()??
        .spec?
        .holder_identity
        .filter(|h| !h.is_empty())
}

/// The operator as users run it (issue 58, item 3): `helm install` of the chart with one
/// replica, its pod run by the node from the chart's image (this build's `mole-operator`),
/// in-cluster: the ServiceAccount token the API server projects into the pod, the
/// `kubernetes` Service's address from the environment, the chart's RBAC, leader election
/// on with the pod's name. It leads, a dynamic Adapter gets Ready and answers through the
/// pool's Service. Then `kubectl delete pod` (what a rollout or a drain does): the pod gets
/// SIGTERM and is gone within seconds, not after its 30 s grace period, the Lease released
/// on the way out, so the ReplicaSet's new pod leads at once and reconciles the next change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real control plane: scripts/checks/control-plane.sh"]
async fn the_operator_as_the_charts_pod_leads_serves_and_hands_over_on_delete() {
    let clock = stack::Stopwatch::start();
    let mut opts = stack::Options::this_build(Fixture::TinyLlama, false).unwrap();
    let stack::OperatorMode::Process(bin) = opts.operator else {
        unreachable!("this_build(_, false) runs the binary")
    };
    opts.operator = stack::OperatorMode::Pod(bin);
    let e = Env {
        clock,
        m: Mole::start(opts).await.unwrap(),
    };
    let pods: Api<Pod> = Api::namespaced(e.admin.clone(), "mole-system");
    let first = wait_for(Duration::from_secs(90), "a leader", || lease_holder(&e))
        .await
        .unwrap_or_else(|err| panic!("{err}\n{}", e.dump()));
    let pod = pods.get(&first).await.unwrap_or_else(|err| {
        panic!(
            "the leader {first:?} is not the chart's pod: {err}\n{}",
            e.dump()
        )
    });
    assert_eq!(
        pod.spec
            .as_ref()
            .and_then(|s| s.service_account_name.as_deref()),
        Some("mole-operator")
    );
    // What `kubectl logs` shows a user: plain lines (no terminal colour codes in a file).
    let log =
        e.cp.kubectl(&["logs", "-n", "mole-system", &first])
            .unwrap();
    assert!(log.contains("leading"), "{log}");
    assert!(
        !log.contains('\u{1b}'),
        "escape codes in the pod's log:\n{log}"
    );
    eprintln!("{} s: the chart's pod {first} leads", e.at());

    e.apply(&tiny_pool("{}"));
    e.apply(&calendar("v1", "{mode: dynamic}", ""));
    e.wait_adapter("calendar", Duration::from_secs(120), |st| {
        st.phase == AdapterPhase::Ready
            && st.serving_mode == Some(ServingMode::Dynamic)
            && st.active_version.as_deref() == Some("v1")
    })
    .await
    .unwrap();
    e.until("tiny", "calendar", Duration::from_secs(60), |a| {
        a.status == 200 && a.served() == ("dynamic", "v1")
    })
    .await;
    eprintln!("{} s: calendar v1 Ready and answered", e.at());

    let t0 = Instant::now();
    e.cp.kubectl(&["delete", "pod", "-n", "mole-system", &first, "--wait=false"])
        .unwrap();
    wait_for(Duration::from_secs(45), "the deleted pod gone", || async {
        pods.get_opt(&first)
            .await
            .ok()
            .and_then(|p| p.is_none().then_some(()))
    })
    .await
    .unwrap_or_else(|err| panic!("{err}\n{}", e.dump()));
    let gone = t0.elapsed();
    // A leader that ignored SIGTERM, or waited on its reconciles, would be killed only at the
    // end of the pod's 30 s grace period.
    assert!(
        gone < Duration::from_secs(10),
        "the operator's pod took {gone:?} to stop after its delete\n{}",
        e.dump()
    );
    // The Lease was released on the way out: once the pod is gone it names no one but the
    // new pod, where an expiry would keep the old name for up to the 15 s lease duration.
    assert_ne!(
        lease_holder(&e).await.as_deref(),
        Some(first.as_str()),
        "the Lease still names the deleted pod {gone:?} after its delete\n{}",
        e.dump()
    );
    let next = wait_for(Duration::from_secs(60), "a new leader", || async {
        lease_holder(&e).await.filter(|h| *h != first)
    })
    .await
    .unwrap_or_else(|err| panic!("{err}\n{}", e.dump()));
    let took = t0.elapsed();
    assert!(pods.get_opt(&next).await.unwrap().is_some(), "{next}");
    eprintln!(
        "{} s: {first} gone {gone:?} after its delete; {next} leads {took:?} after it",
        e.at()
    );

    // The new leader acts on the next change.
    e.apply(&calendar("v2", "{mode: dynamic}", ""));
    e.wait_adapter("calendar", Duration::from_secs(120), |st| {
        st.phase == AdapterPhase::Ready && st.active_version.as_deref() == Some("v2")
    })
    .await
    .unwrap();
    e.until("tiny", "calendar", Duration::from_secs(60), |a| {
        a.status == 200 && a.served() == ("dynamic", "v2")
    })
    .await;
}
