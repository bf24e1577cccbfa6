//! The engine end to end (scheduler, registry, sampler, detokenizer) on the committed tiny
//! Llama (tests/fixtures/engine): what comes out of the continuous-batching loop must be the
//! exact greedy tokens transformers + PEFT produced (reference.json), however requests are
//! chunked, batched, interleaved, cancelled or reloaded under them.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use candle_core::{DType, Device};
use mole_worker::engine::api::*;
use mole_worker::engine::{Engine, EngineOptions};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/engine")
}

fn reference() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join("reference.json")).unwrap())
        .unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn engine(f: impl FnOnce(&mut EngineOptions)) -> Engine {
    let mut o = EngineOptions {
        base_name: "llama".into(),
        ..Default::default()
    };
    f(&mut o);
    Engine::load(&fixtures().join("llama"), DType::F32, &Device::Cpu, o).unwrap()
}

fn spec(name: &str, version: &str, dir: &str) -> AdapterSpec {
    AdapterSpec {
        name: name.into(),
        version: version.into(),
        lora_id: 1,
        path: fixtures().join("adapters/llama").join(dir),
    }
}

fn greedy(prompt: Vec<u32>, adapter: Option<&str>, max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        id: "t".into(),
        prompt: Prompt::Tokens(prompt),
        adapter: adapter.map(String::from),
        sampling: SamplingParams {
            max_tokens,
            ignore_eos: true,
            ..Default::default()
        },
    }
}

/// Everything a request produced: tokens, the final event, the pinned version.
#[derive(Debug)]
struct Outcome {
    tokens: Vec<u32>,
    text: String,
    end: TokenEvent,
    version: Option<String>,
}

fn collect(mut rx: EventStream) -> Outcome {
    let (mut tokens, mut text, mut version) = (vec![], String::new(), None);
    loop {
        match rx
            .blocking_recv()
            .expect("stream ended without a final event")
        {
            TokenEvent::Started {
                adapter_version, ..
            } => version = adapter_version,
            TokenEvent::Token {
                token_id, text: t, ..
            } => {
                tokens.push(token_id);
                text.push_str(&t);
            }
            end => {
                return Outcome {
                    tokens,
                    text,
                    end,
                    version,
                }
            }
        }
    }
}

fn next_token(rx: &mut EventStream) -> u32 {
    loop {
        if let TokenEvent::Token { token_id, .. } = rx.blocking_recv().unwrap() {
            return token_id;
        }
    }
}

fn wait_until(what: &str, f: impl Fn() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn batched_chunked_and_mixed_adapter_requests_match_transformers() {
    let r = &reference()["llama"];
    // Chunks of 5 prompt tokens per step: the 12-token prompt needs three steps while the
    // other rows already decode.
    let e = engine(|o| o.prefill_chunk = 5);
    for a in ["a_r8_all", "b_r4_qv", "c_r16_mlp"] {
        e.load_adapter(spec(a, "v1", a)).unwrap();
    }
    let mut streams = vec![];
    for (i, p) in r["prompts"].as_array().unwrap().iter().enumerate() {
        let p = ids(p);
        let n = p.len();
        streams.push((
            n,
            ids(&r["greedy"][i]),
            e.submit(greedy(p.clone(), None, 32)).unwrap(),
        ));
        for a in ["a_r8_all", "b_r4_qv", "c_r16_mlp"] {
            let want = ids(&r["adapters"][a]["greedy"][i]);
            let rx = e.submit(greedy(p.clone(), Some(a), want.len())).unwrap();
            streams.push((n, want, rx));
        }
    }
    for (n, want, rx) in streams {
        let out = collect(rx);
        assert_eq!(out.tokens, want);
        let usage = Usage {
            prompt_tokens: n,
            completion_tokens: want.len(),
        };
        assert_eq!(
            out.end,
            TokenEvent::Finished {
                reason: FinishReason::Length,
                usage
            }
        );
    }
}

#[test]
fn requests_join_mid_batch_and_cancelled_ones_leave() {
    let r = &reference()["llama"];
    let (p0, p1) = (ids(&r["prompts"][0]), ids(&r["prompts"][1]));
    let e = engine(|_| {});
    let mut first = e.submit(greedy(p0.clone(), None, 100)).unwrap();
    let mut got = vec![next_token(&mut first), next_token(&mut first)];
    // Joins while the first is decoding, and must still produce its own exact continuation.
    let second = e.submit(greedy(p1.clone(), None, 32)).unwrap();
    let mut doomed = e.submit(greedy(p1, None, 100)).unwrap();
    next_token(&mut doomed);
    drop(doomed);
    assert_eq!(collect(second).tokens, ids(&r["greedy"][1]));
    wait_until("the cancelled request to leave", || e.stats().running == 1);
    while got.len() < 32 {
        got.push(next_token(&mut first));
    }
    assert_eq!(got, ids(&r["greedy"][0]));
    drop(first);
    wait_until("an idle engine", || e.stats().running == 0);
}

#[test]
fn full_queue_is_refused_and_sequence_length_is_capped() {
    let r = &reference()["llama"];
    let p = ids(&r["prompts"][0]);
    let e = engine(|o| {
        o.max_batch_size = 1;
        o.max_queue = 1;
        o.max_seq_len = 20;
    });
    let mut running = e.submit(greedy(p.clone(), None, 8)).unwrap();
    next_token(&mut running);
    let queued = e.submit(greedy(p.clone(), None, 100)).unwrap();
    match e.submit(greedy(p.clone(), None, 8)) {
        Err(EngineError::Overloaded(1)) => {}
        other => panic!("expected Overloaded(1), got {other:?}"),
    }
    assert!(matches!(collect(running).end, TokenEvent::Finished { .. }));
    // 12 prompt tokens in a 20-token window: 8 tokens at most, then `length`.
    let out = collect(queued);
    assert_eq!(out.tokens.len(), 8);
    assert!(matches!(
        out.end,
        TokenEvent::Finished {
            reason: FinishReason::Length,
            ..
        }
    ));
    match e.submit(greedy(vec![5; 20], None, 1)) {
        Err(EngineError::InvalidRequest(m)) => assert!(m.contains("max_seq_len"), "{m}"),
        other => panic!("expected InvalidRequest, got {other:?}"),
    }
    assert!(matches!(
        e.submit(greedy(vec![300], None, 1)),
        Err(EngineError::InvalidRequest(_))
    ));
    assert!(matches!(
        e.submit(greedy(p, Some("nope"), 1)),
        Err(EngineError::AdapterNotFound(_))
    ));
}

#[test]
fn a_reload_moves_new_requests_while_running_ones_finish_on_their_version() {
    let r = &reference()["llama"];
    let p = ids(&r["prompts"][0]);
    let e = engine(|_| {});
    e.load_adapter(spec("task", "v1", "a_r8_all")).unwrap();
    let mut old = e.submit(greedy(p.clone(), Some("task"), 32)).unwrap();
    let mut got = vec![next_token(&mut old)];
    e.load_adapter(spec("task", "v2", "b_r4_qv")).unwrap();
    let new = collect(e.submit(greedy(p.clone(), Some("task"), 16)).unwrap());
    assert_eq!(new.version.as_deref(), Some("v2"));
    assert_eq!(new.tokens, ids(&r["adapters"]["b_r4_qv"]["greedy"][0]));
    // v1 is still listed, draining: it takes no new requests.
    let listed = e.adapters();
    let v1 = listed
        .iter()
        .find(|a| a.version == "v1")
        .expect("v1 listed");
    assert!(!v1.loaded && v1.running == 1, "{v1:?}");
    while got.len() < 16 {
        got.push(next_token(&mut old));
    }
    assert_eq!(got, ids(&r["adapters"]["a_r8_all"]["greedy"][0]));
    drop(old);
    wait_until("v1 to be freed", || {
        e.adapters().iter().all(|a| a.version != "v1")
    });
    // Unload: gone for new requests.
    e.unload_adapter("task").unwrap();
    assert!(matches!(
        e.submit(greedy(p, Some("task"), 1)),
        Err(EngineError::AdapterNotFound(_))
    ));
    assert!(matches!(
        e.unload_adapter("task"),
        Err(EngineError::AdapterNotFound(_))
    ));
}

#[test]
fn evicted_adapters_come_back_from_disk_with_the_same_output() {
    let r = &reference()["llama"];
    let p = ids(&r["prompts"][1]);
    let e = engine(|o| {
        o.max_loras = 1;
        o.max_cpu_loras = 0;
    });
    e.load_adapter(spec("a", "v1", "a_r8_all")).unwrap();
    e.load_adapter(spec("c", "v1", "c_r16_mlp")).unwrap();
    let res = |n: &str| {
        e.adapters()
            .into_iter()
            .find(|a| a.name == n)
            .unwrap()
            .residency
    };
    assert_eq!(res("a"), mole_crds::Residency::Disk);
    assert_eq!(res("c"), mole_crds::Residency::Cpu);
    let out = collect(e.submit(greedy(p, Some("a"), 16)).unwrap());
    assert_eq!(out.tokens, ids(&r["adapters"]["a_r8_all"]["greedy"][1]));
    assert_eq!(res("a"), mole_crds::Residency::Cpu);
    assert_eq!(res("c"), mole_crds::Residency::Disk);
}

#[test]
fn seeds_stop_strings_chat_template_and_classifier_scores() {
    let e = engine(|_| {});
    let sampled = |seed| {
        let mut req = greedy(vec![5, 17, 99], None, 24);
        req.sampling.temperature = 1.0;
        req.sampling.seed = Some(seed);
        collect(e.submit(req).unwrap()).tokens
    };
    assert_eq!(sampled(3), sampled(3));
    assert_ne!(sampled(3), sampled(4));
    // The byte-level fixture tokenizer: text in, text out; the chat template is applied.
    let prompt = e
        .apply_chat_template(&[ChatMessage {
            role: "user".into(),
            content: "hi".into(),
        }])
        .unwrap();
    assert_eq!(prompt, "<user>hi\n<assistant>");
    assert_eq!(e.count_tokens(&prompt).unwrap(), prompt.len());
    let mut req = greedy(vec![], None, 32);
    req.prompt = Prompt::Templated(prompt);
    let full = collect(e.submit(req.clone()).unwrap());
    assert!(!full.text.is_empty());
    // Stop at a string that the unrestricted output contains: the output ends right before it.
    let cut = full.text.char_indices().nth(3).map(|(i, _)| i).unwrap();
    let stop: String = full.text[cut..].chars().take(2).collect();
    req.sampling.stop = vec![stop.clone()];
    let stopped = collect(e.submit(req).unwrap());
    let first = full.text.find(&stop).unwrap();
    assert_eq!(stopped.text, full.text[..first]);
    assert!(matches!(
        stopped.end,
        TokenEvent::Finished {
            reason: FinishReason::Stop,
            ..
        }
    ));
    e.load_adapter(spec("cls", "v1", "a_r8_all")).unwrap();
    let p = e
        .score_labels(
            Some("cls"),
            "route me",
            &["x".into(), "y".into(), "z".into()],
        )
        .unwrap();
    assert_eq!(p.len(), 3);
    assert!((p.iter().sum::<f32>() - 1.0).abs() < 1e-5, "{p:?}");
    let base = e
        .score_labels(None, "route me", &["x".into(), "y".into(), "z".into()])
        .unwrap();
    assert_ne!(p, base, "the classifier adapter changes the scores");
}

#[test]
fn the_host_tier_keeps_evicted_adapters_off_the_disk() {
    let r = &reference()["llama"];
    let p = ids(&r["prompts"][1]);
    // One device slot, one host slot.
    let e = engine(|o| {
        o.max_loras = 1;
        o.max_cpu_loras = 1;
    });
    e.load_adapter(spec("a", "v1", "a_r8_all")).unwrap();
    e.load_adapter(spec("c", "v1", "c_r16_mlp")).unwrap();
    e.load_adapter(spec("b", "v1", "b_r4_qv")).unwrap();
    // b on the device, c in host memory, a (least recently used) back on disk.
    let info = |n: &str| e.adapters().into_iter().find(|a| a.name == n).unwrap();
    assert_eq!(info("a").residency, mole_crds::Residency::Disk);
    assert!(info("c").bytes > 0 && info("b").bytes > 0);
    assert_eq!(e.stats().adapter_loads, 3);
    assert_eq!(e.stats().adapter_evictions, 2);
    // c comes back from host memory: no file read, same tokens.
    let out = collect(e.submit(greedy(p.clone(), Some("c"), 16)).unwrap());
    assert_eq!(out.tokens, ids(&r["adapters"]["c_r16_mlp"]["greedy"][1]));
    assert_eq!(e.stats().adapter_loads, 3);
    // a comes back from disk.
    let out = collect(e.submit(greedy(p, Some("a"), 16)).unwrap());
    assert_eq!(out.tokens, ids(&r["adapters"]["a_r8_all"]["greedy"][1]));
    assert_eq!(e.stats().adapter_loads, 4);
}
