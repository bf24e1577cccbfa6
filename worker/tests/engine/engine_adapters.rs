//! Adapter residency under load on the committed tiny Llama (tests/fixtures/engine): more
//! adapters with traffic than `maxLoras`, bursts for one adapter on disk, loads that fail,
//! and reads from disk racing a hot-swap or an unload. Every request for a known adapter is
//! answered by that adapter (transformers + PEFT's tokens), never 404 for lack of a slot; one
//! read per adapter however many requests wait on it; a read that ends after the adapter
//! changed never brings the old version back.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test
#![allow(clippy::disallowed_methods)] // tests read results back from the device

use crate::common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::{
    engine_fixtures as fixtures, engine_reference as reference, greedy, host_engine, ids,
    tensor_engine,
};
use mole_engine::api::*;
use mole_engine::{Engine, EngineOptions};

/// The engine on the host path (`tensor: false`, the CPU's) or the tensor path (a GPU's).
fn engine(tensor: bool, f: impl FnOnce(&mut EngineOptions)) -> Engine {
    if tensor {
        tensor_engine(f)
    } else {
        host_engine(f)
    }
}

fn spec_at(name: &str, version: &str, path: PathBuf) -> AdapterSpec {
    AdapterSpec {
        name: name.into(),
        version: version.into(),
        lora_id: 1,
        path,
    }
}

fn spec(name: &str, version: &str, dir: &str) -> AdapterSpec {
    spec_at(name, version, fixtures().join("adapters/llama").join(dir))
}

/// A request's tokens and pinned version, or the error that ended it; panics when nothing
/// ends it within 30 s (a request stuck behind a load that never finishes).
fn outcome(mut rx: EventStream) -> Result<(Vec<u32>, Option<String>), EngineError> {
    let (mut tokens, mut version) = (Vec::new(), None);
    let t = Instant::now();
    loop {
        match rx.try_recv() {
            Ok(TokenEvent::Started {
                adapter_version, ..
            }) => version = adapter_version,
            Ok(TokenEvent::Token { token_id, .. }) => tokens.push(token_id),
            Ok(TokenEvent::Finished { .. }) => return Ok((tokens, version)),
            Ok(TokenEvent::Error(e)) => return Err(e),
            Err(tokio::sync::mpsc::error::TryRecvError::Empty) => {
                assert!(
                    t.elapsed() < Duration::from_secs(30),
                    "no answer within 30 s"
                );
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => panic!("the stream ended without a final event: {e}"),
        }
    }
}

/// The fixture's PEFT directory `dir` copied to a temporary directory whose
/// adapter_config.json is a FIFO: every read of the adapter blocks until the test feeds it
/// ([`common::feed_fifo`]), which holds a load mid-read deterministically.
struct SlowAdapter {
    _tmp: tempfile::TempDir,
    dir: PathBuf,
    config: Vec<u8>,
}

impl SlowAdapter {
    fn new(dir: &str) -> Self {
        let src = fixtures().join("adapters/llama").join(dir);
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join(dir);
        std::fs::create_dir(&path).unwrap();
        std::fs::copy(
            src.join("adapter_model.safetensors"),
            path.join("adapter_model.safetensors"),
        )
        .unwrap();
        let made = std::process::Command::new("mkfifo")
            .arg(path.join("adapter_config.json"))
            .status()
            .unwrap();
        assert!(made.success());
        Self {
            config: std::fs::read(src.join("adapter_config.json")).unwrap(),
            _tmp: tmp,
            dir: path,
        }
    }

    fn fifo(&self) -> PathBuf {
        self.dir.join("adapter_config.json")
    }

    /// Lets one read through with the real config.
    fn feed(&self) {
        common::feed_fifo(&self.fifo(), &self.config, || true);
    }

    /// Lets one read through with `bytes` (a broken config).
    fn feed_bytes(&self, bytes: &[u8]) {
        common::feed_fifo(&self.fifo(), bytes, || true);
    }
}

/// Loads `name` from `slow` (feeding its one read), then pushes it back to disk by loading
/// `other` into the engine's only slot (`maxLoras: 1`, `maxCpuLoras: 0`).
fn load_then_evict(e: &Engine, name: &str, slow: &SlowAdapter, other: &str) {
    std::thread::scope(|sc| {
        let load = sc.spawn(|| e.load_adapter(spec_at(name, "v1", slow.dir.clone())));
        slow.feed();
        load.join().unwrap().unwrap();
    });
    e.load_adapter(spec(other, "v1", "b_r4_qv")).unwrap();
    let on_disk = e
        .adapters()
        .into_iter()
        .any(|a| a.name == name && a.residency == mole_api::Residency::Disk);
    assert!(on_disk, "{name} evicted to disk: {:?}", e.adapters());
}

fn path_name(tensor: bool) -> &'static str {
    if tensor {
        "tensor path"
    } else {
        "host path"
    }
}

/// More adapters with traffic than device slots: with `maxLoras` adapters pinned by queued
/// requests, a request for another one waits for its turn and is answered by it — never 404
/// (was: the adapter brought back evicted itself, and the request was refused
/// `adapter_not_found`). 32 concurrent requests over four adapters with two slots and two
/// host slots, and over two adapters with one slot and none in host memory.
#[test]
fn every_request_for_a_known_adapter_is_answered_by_it_under_slot_pressure() {
    let r = &reference()["llama"];
    let dirs = ["a_r8_all", "b_r4_qv", "c_r16_mlp", "a_r8_all"];
    for tensor in [false, true] {
        for (max_loras, max_cpu_loras, adapters) in [(2, 2, 4), (1, 0, 2)] {
            let e = engine(tensor, |o| {
                o.max_loras = max_loras;
                o.max_cpu_loras = max_cpu_loras;
                o.max_batch_size = 4;
            });
            let names: Vec<String> = (0..adapters).map(|i| format!("task{i}")).collect();
            for (name, dir) in names.iter().zip(dirs) {
                e.load_adapter(spec(name, "v1", dir)).unwrap();
            }
            let jobs: Vec<(usize, usize)> = (0..32).map(|k| (k % adapters, k % 2)).collect();
            let streams: Vec<_> = jobs
                .iter()
                .map(|&(a, p)| {
                    let prompt = ids(&r["prompts"][p]);
                    e.submit(greedy(prompt, Some(&names[a]), 6))
                })
                .collect();
            let what = format!(
                "{}, maxLoras {max_loras}, maxCpuLoras {max_cpu_loras}, {adapters} adapters",
                path_name(tensor)
            );
            let mut refused = Vec::new();
            for (&(a, p), s) in jobs.iter().zip(streams) {
                let got = s
                    .map_err(|e| e.code())
                    .and_then(|rx| outcome(rx).map_err(|e| e.code()));
                match got {
                    Ok((tokens, version)) => {
                        let want = ids(&r["adapters"][dirs[a]]["greedy"][p]);
                        assert_eq!(tokens, want[..6], "{what}: {} on prompt {p}", names[a]);
                        assert_eq!(version.as_deref(), Some("v1"));
                    }
                    Err(code) => refused.push((names[a].clone(), code)),
                }
            }
            assert!(
                refused.is_empty(),
                "{what}: {} of 32 refused: {refused:?}",
                refused.len()
            );
        }
    }
}

/// 50 requests for an adapter on disk while its read is held: one read (the loads counter
/// goes up by one), every request answered by it.
#[cfg(target_os = "linux")]
#[test]
fn a_burst_for_an_evicted_adapter_reads_it_once() {
    let r = &reference()["llama"];
    for tensor in [false, true] {
        let e = engine(tensor, |o| {
            o.max_loras = 1;
            o.max_cpu_loras = 0;
        });
        let slow = SlowAdapter::new("a_r8_all");
        load_then_evict(&e, "x", &slow, "other");
        let loads = e.stats().adapter_loads;
        let streams: Vec<_> = (0..50)
            .map(|k| {
                let p = ids(&r["prompts"][k % 2]);
                (k % 2, e.submit(greedy(p, Some("x"), 4)).unwrap())
            })
            .collect();
        slow.feed();
        for (p, rx) in streams {
            let (tokens, _) = outcome(rx).unwrap();
            let want = ids(&r["adapters"]["a_r8_all"]["greedy"][p]);
            assert_eq!(tokens, want[..4], "{}", path_name(tensor));
        }
        assert_eq!(
            e.stats().adapter_loads - loads,
            1,
            "{}: one read for 50 requests",
            path_name(tensor)
        );
    }
}

/// A read from disk that fails fails every request waiting on it, with the reason, as the
/// server's failure (`adapter_load_failed`, 503: the client named a configured adapter whose
/// files broke, nothing in its request is wrong; it was 422 `invalid_adapter`); the next
/// request reads it again, and is served.
#[cfg(target_os = "linux")]
#[test]
fn a_failed_read_fails_its_waiters_and_the_next_request_retries() {
    let r = &reference()["llama"];
    let p = ids(&r["prompts"][0]);
    let e = host_engine(|o| {
        o.max_loras = 1;
        o.max_cpu_loras = 0;
    });
    let slow = SlowAdapter::new("a_r8_all");
    load_then_evict(&e, "x", &slow, "other");
    let (loads, failures) = (e.stats().adapter_loads, e.stats().adapter_load_failures);
    let streams: Vec<_> = (0..5)
        .map(|_| e.submit(greedy(p.clone(), Some("x"), 4)).unwrap())
        .collect();
    slow.feed_bytes(b"{ not json");
    for rx in streams {
        match outcome(rx) {
            Err(e @ EngineError::AdapterReadFailed { .. }) => {
                assert_eq!(e.code(), "adapter_load_failed");
                let EngineError::AdapterReadFailed { name, reason } = e else {
                    unreachable!()
                };
                assert_eq!(name, "x");
                assert!(!reason.is_empty());
            }
            other => panic!("expected adapter_load_failed with the reason, got {other:?}"),
        }
    }
    assert_eq!(
        e.stats().adapter_load_failures - failures,
        1,
        "one failed read"
    );
    // Still known: the next request reads it again.
    let rx = e.submit(greedy(p.clone(), Some("x"), 4)).unwrap();
    slow.feed();
    let (tokens, version) = outcome(rx).unwrap();
    assert_eq!(tokens, ids(&r["adapters"]["a_r8_all"]["greedy"][0])[..4]);
    assert_eq!(version.as_deref(), Some("v1"));
    assert_eq!(e.stats().adapter_loads - loads, 1);
}

fn current(e: &Engine, name: &str) -> Vec<(String, bool)> {
    e.adapters()
        .into_iter()
        .filter(|a| a.name == name && a.error.is_none())
        .map(|a| (a.version, a.loaded))
        .collect()
}

/// v1 is read back from disk for a request (held mid-read) while v2 is loaded: when the read
/// of v1 ends, v2 stays current — the waiting request and every later one run v2.
#[cfg(target_os = "linux")]
#[test]
fn a_read_of_the_old_version_ending_after_a_hot_swap_leaves_the_new_one_current() {
    let r = &reference()["llama"];
    let p = ids(&r["prompts"][0]);
    let e = host_engine(|o| {
        o.max_loras = 1;
        o.max_cpu_loras = 0;
    });
    let slow = SlowAdapter::new("a_r8_all");
    load_then_evict(&e, "x", &slow, "other");
    let waiting = e.submit(greedy(p.clone(), Some("x"), 4)).unwrap();
    // The read of v1 is under way (held on its FIFO) when v2 loads.
    e.load_adapter(spec("x", "v2", "c_r16_mlp")).unwrap();
    slow.feed();
    let v2 = ids(&r["adapters"]["c_r16_mlp"]["greedy"][0]);
    let (tokens, version) = outcome(waiting).unwrap();
    assert_eq!((tokens, version.as_deref()), (v2[..4].to_vec(), Some("v2")));
    // The read of v1 has ended (nothing is left waiting on it) and changed nothing.
    common::wait_until("the read of v1 to end", || {
        let s = e.stats();
        s.adapter_loads + s.adapter_load_failures >= 4
    });
    let (tokens, version) = outcome(e.submit(greedy(p, Some("x"), 4)).unwrap()).unwrap();
    assert_eq!((tokens, version.as_deref()), (v2[..4].to_vec(), Some("v2")));
    assert_eq!(current(&e, "x"), [("v2".to_string(), true)]);
}

/// An unload while the adapter is read back from disk for a request: the waiting request is
/// refused `adapter_not_found`, and when the read ends the adapter stays unloaded.
#[cfg(target_os = "linux")]
#[test]
fn an_unload_during_a_read_from_disk_leaves_the_adapter_unloaded() {
    let r = &reference()["llama"];
    let p = ids(&r["prompts"][0]);
    let e = host_engine(|o| {
        o.max_loras = 1;
        o.max_cpu_loras = 0;
    });
    let slow = SlowAdapter::new("a_r8_all");
    load_then_evict(&e, "x", &slow, "other");
    let loads = e.stats().adapter_loads;
    let waiting = e.submit(greedy(p.clone(), Some("x"), 4)).unwrap();
    e.unload_adapter("x").unwrap();
    slow.feed();
    assert!(
        matches!(outcome(waiting), Err(EngineError::AdapterNotFound(_))),
        "the request waiting on an unloaded adapter is refused"
    );
    common::wait_until("the read to end", || e.stats().adapter_loads > loads);
    assert_eq!(current(&e, "x"), []);
    assert!(matches!(
        e.submit(greedy(p, Some("x"), 1)),
        Err(EngineError::AdapterNotFound(_))
    ));
}

/// The same version from another directory is a new load (the operator edits `source.path`
/// without a new version): the new files serve, the listing names their directory, and loading
/// the same version from the same directory again reads nothing.
#[test]
fn the_same_version_from_another_directory_loads_anew() {
    let r = &reference()["llama"];
    let p = ids(&r["prompts"][0]);
    let e = host_engine(|_| {});
    let (a, c) = (spec("x", "v1", "a_r8_all"), spec("x", "v1", "c_r16_mlp"));
    e.load_adapter(a.clone()).unwrap();
    let path_of = |e: &Engine| {
        e.adapters()
            .into_iter()
            .find(|i| i.name == "x" && i.loaded)
            .and_then(|i| i.path)
    };
    assert_eq!(path_of(&e), Some(a.path.display().to_string()));
    let loads = e.stats().adapter_loads;
    e.load_adapter(a).unwrap();
    assert_eq!(e.stats().adapter_loads, loads, "the same files: no read");
    e.load_adapter(c.clone()).unwrap();
    assert_eq!(
        e.stats().adapter_loads,
        loads + 1,
        "another directory: read"
    );
    assert_eq!(path_of(&e), Some(c.path.display().to_string()));
    let (tokens, version) = outcome(e.submit(greedy(p, Some("x"), 4)).unwrap()).unwrap();
    let want = ids(&r["adapters"]["c_r16_mlp"]["greedy"][0]);
    assert_eq!(
        (tokens, version.as_deref()),
        (want[..4].to_vec(), Some("v1"))
    );
}
