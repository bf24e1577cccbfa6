//! The engine end to end (scheduler, registry, sampler, detokenizer) on the committed tiny
//! Llama (tests/fixtures/engine): what comes out of the continuous-batching loop must be the
//! exact greedy tokens transformers + PEFT produced (reference.json), however requests are
//! chunked, batched, interleaved, cancelled or reloaded under them.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test
#![allow(clippy::disallowed_methods)] // tests read results back from the device

use crate::common;

use candle_core::{DType, Device};
use common::{
    engine_fixtures as fixtures, engine_reference as reference, greedy, ids, tensor_engine,
    wait_until,
};
use mole_engine::api::*;
use mole_engine::ModelSource;
use mole_engine::{Engine, EngineOptions};

fn engine(f: impl FnOnce(&mut EngineOptions)) -> Engine {
    engine_over(DType::F32, f)
}

/// The llama fixture served from weights held in `weights`.
fn engine_over(weights: DType, f: impl FnOnce(&mut EngineOptions)) -> Engine {
    let mut o = EngineOptions {
        base_name: "llama".into(),
        ..Default::default()
    };
    f(&mut o);
    Engine::load(
        &ModelSource::hf(fixtures().join("llama"), weights),
        &Device::Cpu,
        o,
    )
    .unwrap()
}

fn spec(name: &str, version: &str, dir: &str) -> AdapterSpec {
    AdapterSpec {
        name: name.into(),
        version: version.into(),
        lora_id: 1,
        path: fixtures().join("adapters/llama").join(dir),
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

/// A final event's reason, prompt tokens and completion tokens.
fn finished(end: &TokenEvent) -> (FinishReason, usize, usize) {
    match end {
        TokenEvent::Finished { reason, usage } => {
            (*reason, usage.prompt_tokens, usage.completion_tokens)
        }
        other => panic!("not a finish: {other:?}"),
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
        // Cached tokens depend on which requests finished first; prefix caching has its tests.
        assert_eq!(finished(&out.end), (FinishReason::Length, n, want.len()));
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
    // The first request may already have produced all its tokens (its events wait in the
    // channel), so "one left running" is not what cancellation means: the cancelled counter
    // is, and it is published together with the running rows it was taken from.
    wait_until("the cancelled request to leave", || {
        let s = e.stats();
        s.cancelled == 1 && s.running <= 1
    });
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
    let mut old = e.submit(greedy(p.clone(), Some("task"), 100)).unwrap();
    let mut got = vec![next_token(&mut old)];
    e.load_adapter(spec("task", "v2", "b_r4_qv")).unwrap();
    let new = collect(e.submit(greedy(p.clone(), Some("task"), 32)).unwrap());
    assert_eq!(new.version.as_deref(), Some("v2"));
    assert_eq!(new.tokens, ids(&r["adapters"]["b_r4_qv"]["greedy"][0]));
    // v1 is still listed, draining: it takes no new requests.
    let listed = e.adapters();
    let v1 = listed
        .iter()
        .find(|a| a.version == "v1")
        .expect("v1 listed");
    assert!(!v1.loaded && v1.running == 1, "{v1:?}");
    while got.len() < 32 {
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
    assert_eq!(res("a"), mole_api::Residency::Disk);
    assert_eq!(res("c"), mole_api::Residency::Cpu);
    let out = collect(e.submit(greedy(p, Some("a"), 32)).unwrap());
    assert_eq!(out.tokens, ids(&r["adapters"]["a_r8_all"]["greedy"][1]));
    assert_eq!(res("a"), mole_api::Residency::Cpu);
    assert_eq!(res("c"), mole_api::Residency::Disk);
}

/// A copy of fixture adapter `name` in `dir` (its files can then be broken).
fn copied_adapter(dir: &std::path::Path, name: &str) -> std::path::PathBuf {
    let a = dir.join(name);
    std::fs::create_dir_all(&a).unwrap();
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(
            fixtures().join("adapters/llama").join(name).join(f),
            a.join(f),
        )
        .unwrap();
    }
    a
}

/// A version whose read from disk fails (its files broken after it loaded, then evicted) fails
/// the requests that waited for the read, and they count as that version's requests and
/// errors in `/v1/lora_adapters`' traffic: a canary whose every request fails this way is
/// what the operator's analysis must see to roll it back (tests/fleet_e2e.rs). They were
/// counted nowhere.
#[test]
fn a_failed_read_from_disk_counts_as_an_error_of_its_version() {
    let r = &reference()["llama"];
    let p = ids(&r["prompts"][1]);
    let dir = tempfile::tempdir().unwrap();
    let a = copied_adapter(dir.path(), "a_r8_all");
    let e = engine(|o| {
        o.max_loras = 1;
        o.max_cpu_loras = 0;
    });
    e.load_adapter(AdapterSpec {
        path: a.clone(),
        ..spec("a", "v1", "a_r8_all")
    })
    .unwrap();
    e.load_adapter(spec("c", "v1", "c_r16_mlp")).unwrap();
    std::fs::write(a.join("adapter_model.safetensors"), b"not safetensors").unwrap();
    for _ in 0..2 {
        let out = e
            .submit(greedy(p.clone(), Some("a"), 4))
            .map(collect)
            .map(|o| o.end);
        assert!(matches!(out, Err(_) | Ok(TokenEvent::Error(_))), "{out:?}");
    }
    let counted = e
        .adapter_counters()
        .into_iter()
        .find(|c| c.name == "a" && c.version == "v1")
        .unwrap();
    assert_eq!((counted.requests, counted.errors), (2, 2), "{counted:?}");
    // The other version's requests are not its errors.
    collect(e.submit(greedy(p, Some("c"), 4)).unwrap());
    let c = e
        .adapter_counters()
        .into_iter()
        .find(|c| c.name == "c")
        .unwrap();
    assert_eq!((c.requests, c.errors), (1, 0), "{c:?}");
}

/// A canary version whose read from disk fails does not fail the request that went to it: the
/// failed read is the canary's error (what the operator's analysis counts to roll it back),
/// and the stable version answers the request, as it does when a canary fails to load at all.
/// Such requests failed (the sessions sticky to the canary failed until the rollback).
#[test]
fn a_canary_whose_read_fails_is_answered_by_the_stable_version() {
    let r = &reference()["llama"];
    let p = ids(&r["prompts"][1]);
    let dir = tempfile::tempdir().unwrap();
    let a = copied_adapter(dir.path(), "a_r8_all");
    let e = engine(|o| {
        o.max_loras = 1;
        o.max_cpu_loras = 0;
    });
    let canary = mole_engine::lora::registry::canary_key("x");
    e.load_adapter(AdapterSpec {
        path: a.clone(),
        ..spec(&canary, "v2", "a_r8_all")
    })
    .unwrap();
    // The stable version takes the one slot: the canary is read from disk when asked for.
    e.load_adapter(spec("x", "v1", "c_r16_mlp")).unwrap();
    std::fs::write(a.join("adapter_model.safetensors"), b"not safetensors").unwrap();
    let out = collect(e.submit(greedy(p.clone(), Some(&canary), 4)).unwrap());
    assert!(matches!(out.end, TokenEvent::Finished { .. }), "{out:?}");
    assert_eq!(out.version.as_deref(), Some("v1"), "{out:?}");
    let stable = collect(e.submit(greedy(p, Some("x"), 4)).unwrap());
    assert_eq!(out.tokens, stable.tokens, "the stable version's answer");
    let counted = |v: &str| {
        let c = e
            .adapter_counters()
            .into_iter()
            .find(|c| c.name == "x" && c.version == v)
            .unwrap();
        (c.requests, c.errors)
    };
    assert_eq!(
        counted("v2"),
        (1, 1),
        "the canary's failed read is its error"
    );
    assert_eq!(counted("v1"), (2, 0));
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
        .apply_chat_template(&[ChatMessage::text("user", "hi")], &serde_json::Map::new())
        .unwrap();
    assert_eq!(prompt, "<user>hi\n<assistant>");
    assert_eq!(
        e.encode(&Prompt::Text(prompt.clone())).unwrap().len(),
        prompt.len()
    );
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
            &[],
        )
        .unwrap();
    assert_eq!(p.len(), 3);
    assert!((p.iter().sum::<f32>() - 1.0).abs() < 1e-5, "{p:?}");
    let base = e
        .score_labels(None, "route me", &["x".into(), "y".into(), "z".into()], &[])
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
    assert_eq!(info("a").residency, mole_api::Residency::Disk);
    assert!(info("c").bytes > 0 && info("b").bytes > 0);
    assert_eq!(e.stats().adapter_loads, 3);
    assert_eq!(e.stats().adapter_evictions, 2);
    // c comes back from host memory: no file read, same tokens.
    let out = collect(e.submit(greedy(p.clone(), Some("c"), 32)).unwrap());
    assert_eq!(out.tokens, ids(&r["adapters"]["c_r16_mlp"]["greedy"][1]));
    assert_eq!(e.stats().adapter_loads, 3);
    // a comes back from disk.
    let out = collect(e.submit(greedy(p, Some("a"), 32)).unwrap());
    assert_eq!(out.tokens, ids(&r["adapters"]["a_r8_all"]["greedy"][1]));
    assert_eq!(e.stats().adapter_loads, 4);
}

fn text_model() -> mole_engine::text::TextModel {
    mole_engine::text::TextModel::load(&fixtures().join("llama")).unwrap()
}

#[test]
fn stop_token_ids_end_generation_on_that_token() {
    let r = &reference()["llama"];
    let (p, full) = (ids(&r["prompts"][1]), ids(&r["greedy"][1]));
    let e = engine(|_| {});
    // The first token of the continuation that did not occur before it.
    let k = (3..full.len())
        .find(|&k| !full[..k].contains(&full[k]))
        .unwrap();
    let mut req = greedy(p.clone(), None, 32);
    req.sampling.stop_token_ids = vec![full[k], 255];
    let out = collect(e.submit(req).unwrap());
    // The stop token is the last token id (counted in usage), its text is not sent.
    assert_eq!(out.tokens, full[..=k]);
    assert_eq!(finished(&out.end), (FinishReason::Stop, p.len(), k + 1));
    assert_eq!(out.text, text_model().decode(&full[..k]).unwrap());
    // ignore_eos (set by `greedy`) does not switch stop tokens off; tokens never produced
    // change nothing.
    let mut req = greedy(p, None, 32);
    req.sampling.stop_token_ids = vec![255, 254];
    let out = collect(e.submit(req).unwrap());
    assert_eq!(out.tokens, full);
    assert!(matches!(
        out.end,
        TokenEvent::Finished {
            reason: FinishReason::Length,
            ..
        }
    ));
}

/// Whatever `max_tokens` cuts a byte-level stream at (mid-character included), the streamed
/// text is the decode of the streamed tokens.
#[test]
fn streamed_text_is_the_decode_of_the_tokens_wherever_it_stops() {
    let r = &reference()["llama"];
    let (p, full) = (ids(&r["prompts"][1]), ids(&r["greedy"][1]));
    let t = text_model();
    assert!(
        full.iter().any(|&b| b >= 0xC0),
        "the continuation has multi-byte lead bytes"
    );
    let e = engine(|_| {});
    let streams: Vec<_> = (1..=full.len())
        .map(|n| (n, e.submit(greedy(p.clone(), None, n)).unwrap()))
        .collect();
    for (n, rx) in streams {
        let out = collect(rx);
        assert_eq!(out.tokens, full[..n]);
        assert_eq!(
            out.text,
            t.decode(&full[..n]).unwrap(),
            "cut after {n} tokens"
        );
    }
}

/// An adapter load that is still reading its files (its adapter_config.json is a FIFO the test
/// writes only at the end) neither stalls nor changes the requests decoding meanwhile.
#[cfg(target_os = "linux")]
#[test]
fn an_adapter_load_in_progress_stalls_no_decoding() {
    let r = &reference()["llama"];
    let (p0, p1) = (ids(&r["prompts"][0]), ids(&r["prompts"][1]));
    let e = engine(|_| {});
    e.load_adapter(spec("a", "v1", "a_r8_all")).unwrap();
    let src = fixtures().join("adapters/llama/b_r4_qv");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("b");
    std::fs::create_dir(&dir).unwrap();
    std::fs::copy(
        src.join("adapter_model.safetensors"),
        dir.join("adapter_model.safetensors"),
    )
    .unwrap();
    let fifo = dir.join("adapter_config.json");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    let mut running = e.submit(greedy(p0.clone(), Some("a"), 32)).unwrap();
    let mut got = vec![next_token(&mut running)];
    std::thread::scope(|scope| {
        let loader = scope.spawn(|| {
            e.load_adapter(AdapterSpec {
                name: "b".into(),
                version: "v1".into(),
                lora_id: 2,
                path: dir.clone(),
            })
        });
        // While the load waits on its file: the running request finishes with its exact
        // tokens, a new base request runs start to end, and `b` is not there yet.
        let rest = collect(running);
        got.extend(rest.tokens);
        assert_eq!(got, ids(&r["adapters"]["a_r8_all"]["greedy"][0]));
        let base = collect(e.submit(greedy(p1.clone(), None, 32)).unwrap());
        assert_eq!(base.tokens, ids(&r["greedy"][1]));
        assert!(matches!(
            e.submit(greedy(p1.clone(), Some("b"), 1)),
            Err(EngineError::AdapterNotFound(_))
        ));
        assert!(!loader.is_finished(), "the load was still in progress");
        // Release it: the real config, once the loader has the FIFO open for reading.
        let config = std::fs::read(src.join("adapter_config.json")).unwrap();
        common::feed_fifo(&fifo, &config, || !loader.is_finished());
        loader.join().unwrap().unwrap();
    });
    let out = collect(e.submit(greedy(p0, Some("b"), 32)).unwrap());
    assert_eq!(out.tokens, ids(&r["adapters"]["b_r4_qv"]["greedy"][0]));
}

/// Dynamic NTK RoPE stretches the window (16 positions here, factor 4): the engine accepts
/// sequences up to 64 positions and produces transformers' continuation past the window.
#[test]
fn the_engine_serves_past_the_window_with_dynamic_rope() {
    use mole_model::{Decoder, ModelConfig};
    let refs: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("rope_reference.json")).unwrap(),
    )
    .unwrap();
    let r = &refs["llama_dynamic"];
    let cfg = ModelConfig::from_json(r["config"].clone()).unwrap();
    assert_eq!(cfg.max_position_embeddings, 16);
    // SAFETY: committed fixture, read-only.
    let vb = unsafe {
        candle_nn::VarBuilder::from_mmaped_safetensors(
            &[fixtures().join("llama/model.safetensors")],
            DType::F32,
            &Device::Cpu,
        )
        .unwrap()
    };
    let e = Engine::start(
        Decoder::new(cfg, vb).unwrap(),
        text_model(),
        EngineOptions {
            base_name: "llama".into(),
            ..Default::default()
        },
    );
    assert_eq!(e.model_info().max_seq_len, 64);
    let streams: Vec<_> = (0..2)
        .map(|i| {
            let p = ids(&r["prompts"][i]);
            let want = ids(&r["greedy"][i]);
            (want.clone(), e.submit(greedy(p, None, want.len())).unwrap())
        })
        .collect();
    for (want, rx) in streams {
        assert_eq!(collect(rx).tokens, want);
    }
    match e.submit(greedy(vec![5; 64], None, 1)) {
        Err(EngineError::InvalidRequest(m)) => assert!(m.contains("max_seq_len 64"), "{m}"),
        other => panic!("expected InvalidRequest, got {other:?}"),
    }
}

/// Adapters are held in the weights' dtype where the host kernels read it (bf16 over bf16
/// weights, f32 over f32 and f16 ones) unless `loraDtype` says otherwise; held in bf16 they take
/// half the bytes and serve (their numerics against PEFT are checked in numerics.rs).
#[test]
fn adapters_are_held_in_the_weights_dtype_unless_told() {
    let r = &reference()["llama"];
    let p = ids(&r["prompts"][0]);
    let bytes = |weights: DType, lora_dtype: Option<DType>| {
        let e = engine_over(weights, |o| o.lora_dtype = lora_dtype);
        e.load_adapter(spec("a", "v1", "a_r8_all")).unwrap();
        let out = collect(e.submit(greedy(p.clone(), Some("a"), 4)).unwrap());
        assert_eq!(out.tokens.len(), 4);
        e.adapters()
            .into_iter()
            .find(|a| a.name == "a")
            .unwrap()
            .bytes
    };
    let full = bytes(DType::F32, None);
    assert!(full > 0);
    for (weights, lora_dtype, want) in [
        (DType::BF16, None, full / 2),
        (DType::F16, None, full),
        (DType::F32, Some(DType::BF16), full / 2),
        (DType::BF16, Some(DType::F32), full),
    ] {
        assert_eq!(
            bytes(weights, lora_dtype),
            want,
            "{weights:?} weights, loraDtype {lora_dtype:?}"
        );
    }
}

/// The KV cache holds the weights' dtype (vLLM's `--kv-cache-dtype auto`) unless
/// `kvCacheDtype` says otherwise, and the engine serves with each: its greedy answer is the one
/// an f32 cache gives over the same weights (the logits move by the cache's rounding only,
/// bounded in `model::decoder`, far less than this prompt's margins between tokens).
#[test]
fn the_kv_cache_holds_the_weights_dtype_unless_told() {
    let r = &reference()["llama"];
    let p = ids(&r["prompts"][0]);
    let run = |weights: DType, kv: Option<DType>| {
        let e = engine_over(weights, |o| o.kv_cache_dtype = kv);
        let out = collect(e.submit(greedy(p.clone(), None, 6)).unwrap());
        (e.stats().kv_cache_dtype, out.tokens)
    };
    for (weights, kv, want) in [
        (DType::F32, None, "f32"),
        (DType::BF16, None, "bf16"),
        (DType::F16, None, "f16"),
        (DType::BF16, Some(DType::F32), "f32"),
        (DType::F32, Some(DType::BF16), "bf16"),
        (DType::F32, Some(DType::F16), "f16"),
    ] {
        let (held, tokens) = run(weights, kv);
        assert_eq!(held, Some(want), "{weights:?} weights, kvCacheDtype {kv:?}");
        let (_, exact) = run(weights, Some(DType::F32));
        assert_eq!(tokens.len(), 6);
        assert_eq!(tokens, exact, "{weights:?} weights, kvCacheDtype {kv:?}");
    }
}

/// The engine on the tensor path (what a GPU runs) with a KV cache of 6 blocks (96 tokens) for
/// four 44-token sequences: the scheduler admits what fits, preempts the youngest when the
/// running ones outgrow the free blocks, and recomputes it later. Every request still gets the
/// exact tokens transformers + PEFT produce, and each the same as alone.
#[test]
fn a_full_kv_cache_preempts_and_recomputes_without_changing_outputs() {
    let r = &reference()["llama"];
    let (p0, p1) = (ids(&r["prompts"][0]), ids(&r["prompts"][1]));
    let e = tensor_engine(|o| {
        o.max_batch_size = 4;
        o.kv_blocks = Some(6);
    });
    e.load_adapter(spec("task", "v1", "a_r8_all")).unwrap();
    let jobs = [
        (p0.clone(), None, ids(&r["greedy"][0])),
        (p1.clone(), None, ids(&r["greedy"][1])),
        (
            p0,
            Some("task"),
            ids(&r["adapters"]["a_r8_all"]["greedy"][0]),
        ),
        (
            p1,
            Some("task"),
            ids(&r["adapters"]["a_r8_all"]["greedy"][1]),
        ),
    ];
    let streams: Vec<EventStream> = jobs
        .iter()
        .map(|(p, a, _)| e.submit(greedy(p.clone(), *a, 32)).unwrap())
        .collect();
    let together: Vec<Outcome> = streams.into_iter().map(collect).collect();
    assert!(e.stats().preemptions > 0, "{:?}", e.stats());
    for ((p, a, want), got) in jobs.iter().zip(&together) {
        assert_eq!(&got.tokens, want, "{a:?} on a {}-token prompt", p.len());
        let alone = collect(e.submit(greedy(p.clone(), *a, 32)).unwrap());
        assert_eq!(alone.tokens, got.tokens);
    }
    // A finished sequence leaves the batch (and frees its blocks) at the end of its step.
    wait_until("every block back", || e.stats().kv_blocks == Some((6, 6)));
}

/// A pod given two devices runs an engine on each behind one (here two CPU engines): an
/// adapter loads on both and is listed loaded once both hold it, requests go to the least
/// loaded engine (two at once land on different engines), and each answer is exactly
/// transformers + PEFT's.
#[test]
fn replicas_spread_requests_over_engines_that_all_hold_the_adapters() {
    use mole_engine::replicas::Replicas;
    let r = &reference()["llama"];
    let (p0, p1) = (ids(&r["prompts"][0]), ids(&r["prompts"][1]));
    let one = || -> std::sync::Arc<dyn Backend> { std::sync::Arc::new(engine(|_| {})) };
    let pod = Replicas::new(vec![one(), one()]);
    pod.load_adapter(spec("task", "v1", "a_r8_all")).unwrap();
    let listed = pod.adapters();
    assert_eq!(listed.len(), 1);
    assert!(listed[0].loaded, "{listed:?}");
    let a = pod.submit(greedy(p0.clone(), Some("task"), 32)).unwrap();
    let b = pod.submit(greedy(p1.clone(), Some("task"), 32)).unwrap();
    assert_eq!(
        collect(a).tokens,
        ids(&r["adapters"]["a_r8_all"]["greedy"][0])
    );
    assert_eq!(
        collect(b).tokens,
        ids(&r["adapters"]["a_r8_all"]["greedy"][1])
    );
    // One request each (counted when it finished), two in the pod's listing.
    wait_until("both requests counted", || pod.adapters()[0].requests == 2);
    for e in pod.engines() {
        assert_eq!(e.adapters()[0].requests, 1);
    }
    // An adapter one engine lacks is not loaded for the pod.
    pod.engines()[1].unload_adapter("task").unwrap();
    assert!(!pod.adapters().iter().any(|a| a.loaded));
}

/// The tensor path samples on the device: seeded requests batched beside greedy ones give the
/// same tokens twice and different tokens for another seed, with logprobs of the model's
/// distribution, and the greedy rows in the batch still give transformers' tokens.
#[test]
fn seeded_sampling_on_the_tensor_path_repeats_and_seeds_differ() {
    let r = &reference()["llama"];
    let e = tensor_engine(|_| {});
    let sampled = |seed: u64| {
        let mut req = greedy(vec![5, 17, 99], None, 16);
        let s = &mut req.sampling;
        s.temperature = 0.9;
        s.top_k = 40;
        s.top_p = 0.9;
        s.repetition_penalty = 1.1;
        s.frequency_penalty = 0.2;
        s.logprobs = Some(2);
        s.seed = Some(seed);
        req
    };
    // Three sampled requests and a greedy one in one batch, twice.
    let batch = || {
        let p0 = ids(&r["prompts"][0]);
        let streams = [
            e.submit(sampled(3)).unwrap(),
            e.submit(sampled(4)).unwrap(),
            e.submit(greedy(p0, None, 32)).unwrap(),
            e.submit(sampled(3)).unwrap(),
        ];
        streams
            .map(|mut rx| {
                let mut out = Vec::new();
                loop {
                    match rx.blocking_recv().unwrap() {
                        TokenEvent::Token {
                            token_id, logprob, ..
                        } => out.push((token_id, logprob)),
                        TokenEvent::Finished { .. } => return out,
                        TokenEvent::Error(e) => panic!("{e}"),
                        TokenEvent::Started { .. } => {}
                    }
                }
            })
            .to_vec()
    };
    let (one, two) = (batch(), batch());
    let tokens = |v: &Vec<(u32, Option<TokenLogprob>)>| v.iter().map(|t| t.0).collect::<Vec<_>>();
    assert_eq!(
        tokens(&one[2]),
        ids(&r["greedy"][0]),
        "greedy beside sampled rows"
    );
    assert_eq!(tokens(&one[0]), tokens(&one[3]), "one seed, one batch");
    assert_eq!(tokens(&one[0]), tokens(&two[0]), "one seed, two runs");
    assert_ne!(tokens(&one[0]), tokens(&one[1]), "two seeds");
    for (id, lp) in &one[0] {
        let lp = lp.as_ref().expect("logprobs asked");
        assert_eq!(lp.token_id, *id);
        assert!(lp.logprob.is_finite() && lp.logprob <= 0.0, "{lp:?}");
        assert_eq!(lp.top.len(), 2);
        assert!(
            lp.top[0].2 >= lp.top[1].2 && lp.top[0].2 >= lp.logprob,
            "{lp:?}"
        );
    }
    // Parameters either path cannot sample with are outside the bounds the server's
    // validation checks before routing (the engine asserts them in debug builds).
    let mut bad = sampled(1);
    bad.sampling.min_p = 1.5;
    let refused = mole_engine::host_sampler::validate(&bad.sampling).unwrap_err();
    assert_eq!(refused.code, "invalid_min_p");
}

/// A request of three choices (`n`): the first computes the prompt and the others take its
/// cache (on the tensor path its two whole blocks, shared, not copied), each computing only the
/// rest. Each choice is exactly what a request of its own with the seed plus its index gives;
/// on the tensor path the three fit a 6-block cache that three separate copies of the prompt
/// would overflow (no preemption), and every block is free again at the end. Greedy choices
/// are transformers' tokens, and `n` beyond the batch is refused.
#[test]
fn choices_share_the_prompt_and_each_is_the_request_of_its_seed() {
    let r = &reference()["llama"];
    let long: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % 250 + 3).collect();
    let sampled = |seed: u64, max_tokens: usize| {
        let mut req = greedy(long.clone(), Some("task"), max_tokens);
        let s = &mut req.sampling;
        s.temperature = 0.9;
        s.top_p = 0.95;
        s.repetition_penalty = 1.1;
        s.seed = Some(seed);
        req
    };
    for tensor in [false, true] {
        let e = if tensor {
            tensor_engine(|o| {
                o.max_batch_size = 4;
                o.kv_blocks = Some(6);
            })
        } else {
            engine(|o| o.max_batch_size = 4)
        };
        e.load_adapter(spec("task", "v1", "a_r8_all")).unwrap();
        let path = if tensor { "tensor path" } else { "host path" };
        let choices: Vec<Outcome> = e
            .submit_n(sampled(11, 7), 3)
            .unwrap()
            .into_iter()
            .map(collect)
            .collect();
        if tensor {
            assert_eq!(e.stats().preemptions, 0, "the prompt's blocks are shared");
            wait_until("every block back", || e.stats().kv_blocks == Some((6, 6)));
        }
        for (i, got) in choices.iter().enumerate() {
            let alone = collect(e.submit(sampled(11 + i as u64, 7)).unwrap());
            assert_eq!(got.tokens, alone.tokens, "{path}: choice {i}");
            assert_eq!(got.tokens.len(), 7);
            assert_eq!(got.version.as_deref(), Some("v1"));
        }
        assert_ne!(choices[0].tokens, choices[1].tokens, "{path}: seeds differ");
        let p0 = ids(&r["prompts"][0]);
        for got in e.submit_n(greedy(p0, None, 32), 2).unwrap() {
            assert_eq!(collect(got).tokens, ids(&r["greedy"][0]), "{path}");
        }
        match e.submit_n(sampled(1, 4), 5) {
            Err(EngineError::InvalidRequest(m)) => assert!(m.contains("maxBatchSize"), "{m}"),
            other => panic!("{path}: {other:?}"),
        }
    }
}
