//! The scale run of issues 58 and 55: 500 Adapters in one pool with 8 dynamic pods on the
//! real control plane (`mole_tests::stack`: Kubernetes' own API server, the test kubelet, this
//! build's worker on the tiny llama fixture, the operator binary as the chart's
//! ServiceAccount). It measures the time until every Adapter is Ready, then a steady minute:
//! API requests and status writes per minute (the API server's own counters), the operator's
//! resident memory and CPU.
//!
//! Not part of the test command (it takes minutes and its figures are a benchmark's, not a
//! pass/fail): `bash scripts/scale-run.sh` runs it and prints the figures
//! (`MOLE_SCALE_ADAPTERS`, `MOLE_SCALE_PODS` change the shape). It fails only when the
//! operator cannot bring every Adapter to Ready within 20 minutes or writes a child in the
//! steady minute.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test is a failed test

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kube::api::ListParams;
use kube::Api;
use mole_crds::{Adapter, AdapterPhase};
use mole_tests::stack::{self, copy_dir, Fixture, Mole, Operator, Options, NS};

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A `/proc/<pid>/status` figure in kB (`VmRSS:`, `VmHWM:`).
fn status_kb(pid: u32, key: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// The operator's memory limit in the chart's values (`resources.limits.memory`, in Mi): what
/// it must live within at this scale, or the kubelet kills it.
fn chart_memory_limit_mib() -> u64 {
    let values = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../charts/mole/values.yaml"
    ))
    .unwrap();
    let at = values.find("limits: {memory: ").unwrap() + "limits: {memory: ".len();
    let mi = values[at..].split_once("Mi").unwrap().0;
    mi.parse().unwrap()
}

/// Resident memory (kB) and CPU seconds (user + system) of process `pid`.
fn usage(pid: u32) -> (u64, f64) {
    let rss = status_kb(pid, "VmRSS:");
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command's closing parenthesis: utime and stime are the 12th and 13th.
    let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // Clock ticks per second: 100 on Linux.
    (rss, (ticks(11) + ticks(12)) / 100.0)
}

fn delta(
    before: &BTreeMap<(String, String), f64>,
    after: &BTreeMap<(String, String), f64>,
) -> BTreeMap<(String, String), f64> {
    after
        .iter()
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0.0)))
        .filter(|(_, d)| *d > 0.0)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a scale run (minutes, figures for docs/benchmarks.md): scripts/scale-run.sh"]
async fn adapters_at_scale_on_the_real_control_plane() {
    let adapters = env_usize("MOLE_SCALE_ADAPTERS", 500);
    let pods = env_usize("MOLE_SCALE_PODS", 8);
    let mole = Mole::start(Options::this_build(Fixture::TinyLlama, false).unwrap())
        .await
        .unwrap();
    // One directory per Adapter (the worker refuses two Adapters on one directory).
    let src = mole.models.join("adapters/calendar/v1");
    for i in 0..adapters {
        copy_dir(&src, &mole.models.join(format!("adapters/a{i}/v1"))).unwrap();
    }
    let ok = std::process::Command::new("chmod")
        .args(["-R", "a+rX"])
        .arg(mole.models.join("adapters"))
        .status()
        .unwrap()
        .success();
    assert!(ok);
    mole.cp
        .apply(&stack::cpu_pool(
            "tiny",
            "llama",
            &format!(
                "  dynamic: {{replicas: {pods}, maxLoras: 8, maxCpuLoras: {cpu}}}",
                cpu = adapters.next_power_of_two().min(4096)
            ),
        ))
        .unwrap();
    mole.wait_pool_ready("tiny", Duration::from_secs(600))
        .await
        .unwrap();
    let t0 = Instant::now();
    let mut yaml = String::new();
    for i in 0..adapters {
        yaml.push_str(&format!(
            "---\napiVersion: mole.dev/v1alpha1\nkind: Adapter\nmetadata: {{name: a{i}, namespace: {NS}}}\n\
             spec: {{pool: tiny, version: v1, source: {{path: adapters/a{i}/v1}}, label: a{i}}}\n"
        ));
    }
    mole.cp.apply(&yaml).unwrap();
    let applied = t0.elapsed();
    let api: Api<Adapter> = Api::namespaced(mole.admin.clone(), NS);
    let mut first_phase_all = None;
    let ready_all = loop {
        let list = api.list(&ListParams::default()).await.unwrap().items;
        let phased = list.iter().filter(|a| a.status.is_some()).count();
        let ready = list
            .iter()
            .filter(|a| {
                a.status
                    .as_ref()
                    .is_some_and(|s| s.phase == AdapterPhase::Ready)
            })
            .count();
        if phased == adapters && first_phase_all.is_none() {
            first_phase_all = Some(t0.elapsed());
        }
        if ready == adapters {
            break t0.elapsed();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(1200),
            "{ready} of {adapters} Ready after 20 minutes\n{}",
            mole.dump()
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
    };
    let pid = match &mole.operator {
        Some(Operator::Process { child, .. }) => child.id(),
        _ => panic!("the operator runs as a process"),
    };
    let (rss_ready, _) = usage(pid);
    // The steady state: a minute after everything is Ready, one minute measured.
    tokio::time::sleep(Duration::from_secs(30)).await;
    let before = mole.cp.request_counts().await.unwrap();
    let (_, cpu0) = usage(pid);
    let w0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(60)).await;
    let after = mole.cp.request_counts().await.unwrap();
    let (rss, cpu1) = usage(pid);
    let minute = w0.elapsed().as_secs_f64() / 60.0;
    let d = delta(&before, &after);
    let per_min = |f: &dyn Fn(&(String, String)) -> bool| {
        // `+ 0.0`: an empty f64 sum is -0.0, printed "-0.0".
        (d.iter().filter(|(k, _)| f(k)).map(|(_, v)| v).sum::<f64>() + 0.0) / minute
    };
    let writes = |k: &(String, String)| {
        ["CREATE", "UPDATE", "PATCH", "APPLY", "DELETE"].contains(&k.0.as_str())
    };
    let all = per_min(&|_| true);
    let all_writes = per_min(&|k| writes(k));
    let child_writes = per_min(&|k| {
        writes(k)
            && [
                "deployments",
                "services",
                "configmaps",
                "poddisruptionbudgets",
                "jobs",
            ]
            .contains(&k.1.as_str())
    });
    let status_writes = per_min(&|k| writes(k) && (k.1 == "adapters" || k.1 == "inferencepools"));
    println!(
        "scale run: {adapters} Adapters, {pods} dynamic pods (tiny llama on CPU), operator {pid}"
    );
    println!("| measure | value |\n|---|---|");
    println!(
        "| kubectl apply of the Adapters | {:.1} s |",
        applied.as_secs_f64()
    );
    if let Some(t) = first_phase_all {
        println!("| every Adapter has a phase | {:.1} s |", t.as_secs_f64());
    }
    println!("| every Adapter Ready | {:.1} s |", ready_all.as_secs_f64());
    println!("| API requests per minute, steady (all clients) | {all:.0} |");
    println!("| of them writes | {all_writes:.1} |");
    println!("| Adapter and pool writes (status, finalizers) per minute | {status_writes:.1} |");
    println!("| child writes per minute | {child_writes:.1} |");
    println!(
        "| operator resident memory (Ready / after the minute) | {:.0} / {:.0} MiB |",
        rss_ready as f64 / 1024.0,
        rss as f64 / 1024.0
    );
    println!(
        "| operator CPU, steady | {:.1}% of a core |",
        100.0 * (cpu1 - cpu0) / (minute * 60.0)
    );
    let mut top: Vec<_> = d.iter().collect();
    top.sort_by(|a, b| b.1.total_cmp(a.1));
    for ((verb, res), n) in top.iter().take(12) {
        println!("|   {verb} {res} | {:.0}/min |", *n / minute);
    }
    let peak_mib = status_kb(pid, "VmHWM:") / 1024;
    let limit = chart_memory_limit_mib();
    println!("| operator peak resident memory | {peak_mib} MiB (the chart's limit: {limit} MiB) |");
    assert!(
        peak_mib < limit,
        "the operator peaked at {peak_mib} MiB, over the chart's limit of {limit} MiB"
    );
    assert_eq!(
        child_writes, 0.0,
        "children written in a steady minute: {d:?}"
    );
}
