//! The tensor path's engine (what a GPU runs) copies between host and device exactly twice a
//! step, whatever the step holds: its inputs (token ids, positions, cache slots, LoRA slots,
//! the sampling parameters) go up in one upload, and its tokens (or sampled tokens with
//! logprobs) come back in one download. A step with rows that follow a grammar uploads their
//! masks once more, after its forward pass is queued: they are computed while it runs. The copies are counted where they happen
//! (`model::transfer`; clippy.toml bans candle's own constructors and readers in `model/` and
//! `lora/`), process-wide, so it holds [`crate::alone`] and nothing else copies while it runs.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test
#![allow(clippy::disallowed_methods)] // tests read results back from the device

use crate::common;

use common::{engine_fixtures, engine_reference, ids, tensor_engine, wait_until};
use mole_engine::api::*;
use mole_model::Transfers;

fn request(
    prompt: Vec<u32>,
    adapter: Option<&str>,
    f: impl FnOnce(&mut SamplingParams),
) -> GenerateRequest {
    let mut sampling = SamplingParams {
        max_tokens: 32,
        ignore_eos: true,
        ..Default::default()
    };
    f(&mut sampling);
    GenerateRequest {
        images: Vec::new(),
        id: "t".into(),
        prompt: Prompt::Tokens(prompt),
        adapter: adapter.map(String::from),
        sampling,
    }
}

/// The tokens and each token's logprob.
fn collect(mut rx: EventStream) -> (Vec<u32>, Vec<f32>) {
    let (mut tokens, mut logprobs) = (Vec::new(), Vec::new());
    loop {
        match rx.blocking_recv().expect("a final event") {
            TokenEvent::Started { .. } => {}
            TokenEvent::Token {
                token_id, logprob, ..
            } => {
                tokens.push(token_id);
                logprobs.push(logprob.map_or(f32::NAN, |l| l.logprob));
            }
            TokenEvent::Finished { .. } => return (tokens, logprobs),
            other => panic!("{other:?}"),
        }
    }
}

/// Steps that prefill in chunks beside rows that decode, mix two adapters and base rows,
/// sample on the device (temperature, top-k/p, penalties, logprobs) beside greedy rows,
/// penalise greedy rows, and preempt and recompute when the 6-block cache is full; then steps
/// whose rows are all plain greedy. Every step makes one upload and one download (and one more
/// upload, of the masks, where it samples rows that follow a grammar).
#[test]
fn op_count_transfers_are_one_upload_and_one_download_per_step() {
    let _alone = crate::alone();
    let reference = engine_reference();
    let r = &reference["llama"];
    let (p0, p1) = (ids(&r["prompts"][0]), ids(&r["prompts"][1]));
    let e = tensor_engine(|o| {
        o.max_batch_size = 4;
        o.prefill_chunk = 5;
        o.kv_blocks = Some(6);
    });
    for a in ["a_r8_all", "b_r4_qv"] {
        e.load_adapter(AdapterSpec {
            name: a.into(),
            version: "v1".into(),
            lora_id: 1,
            path: engine_fixtures().join("adapters/llama").join(a),
        })
        .unwrap();
    }
    let count = |f: &dyn Fn()| {
        let (steps, before) = (e.stats().steps, Transfers::now());
        f();
        wait_until("an idle engine", || {
            let s = e.stats();
            s.running == 0 && s.waiting == 0
        });
        (e.stats().steps - steps, Transfers::now().since(before))
    };

    let (steps, mixed) = count(&|| {
        let streams = [
            e.submit(request(p0.clone(), None, |_| {})).unwrap(),
            e.submit(request(p1.clone(), Some("a_r8_all"), |_| {}))
                .unwrap(),
            e.submit(request(p0.clone(), Some("b_r4_qv"), |s| {
                s.temperature = 0.8;
                s.top_k = 20;
                s.top_p = 0.9;
                s.repetition_penalty = 1.2;
                s.presence_penalty = 0.5;
                s.frequency_penalty = 0.3;
                s.logprobs = Some(2);
                s.seed = Some(7);
            }))
            .unwrap(),
            e.submit(request(p1.clone(), None, |s| s.repetition_penalty = 1.3))
                .unwrap(),
        ];
        let out = streams.map(collect);
        // The plain greedy rows are still transformers' tokens; the sampled row's logprobs
        // came from the device sampler.
        assert_eq!(out[0].0, ids(&r["greedy"][0]));
        assert_eq!(out[1].0, ids(&r["adapters"]["a_r8_all"]["greedy"][1]));
        assert!(
            out[2].1.iter().all(|l| l.is_finite() && *l <= 0.0),
            "{:?}",
            out[2].1
        );
        assert_eq!(out[2].0.len(), 32);
    });
    assert!(e.stats().preemptions > 0, "{:?}", e.stats());
    eprintln!("mixed steps: {steps}, {mixed:?}");
    assert!(steps >= 32, "{steps} steps");
    assert_eq!(
        mixed,
        Transfers {
            uploads: steps as usize,
            downloads: steps as usize
        },
        "one upload and one download per step"
    );

    // Grammar masks (structured outputs), computed while the forward pass runs, go up in one
    // more upload in each step that samples a constrained row, never more: a constrained
    // greedy row (not plain greedy any more: its mask goes up) beside a free greedy row and a
    // sampled constrained row with an adapter.
    // The steps that sampled a masked row: at least those of the longer answer, at most one
    // per token of either (each token of theirs was sampled in a step whose masks went up).
    let masked = std::cell::Cell::new((0, 0));
    let (steps, constrained) = count(&|| {
        let guide = |rx: &str| {
            Some(mole_engine::grammar::Guided {
                guide: mole_engine::grammar::Guide::Regex(rx.into()),
                after: None,
            })
        };
        let a = e
            .submit(request(p0.clone(), None, |s| {
                s.guide = guide("[a-z]{20,30}");
                s.ignore_eos = false;
            }))
            .unwrap();
        let b = e.submit(request(p1.clone(), None, |_| {})).unwrap();
        let c = e
            .submit(request(p1.clone(), Some("b_r4_qv"), |s| {
                s.guide = guide("[0-9 ]{20,30}");
                s.ignore_eos = false;
                s.temperature = 0.9;
                s.seed = Some(4);
            }))
            .unwrap();
        // Token id = byte; a final EOS (id 2, allowed once the regex accepts) is no text.
        let text = |mut t: Vec<u32>| {
            if t.last() == Some(&2) {
                t.pop();
            }
            String::from_utf8(t.iter().map(|&b| b as u8).collect()).unwrap()
        };
        let (a, c) = (collect(a).0, collect(c).0);
        masked.set((a.len().max(c.len()), a.len() + c.len()));
        let (a, c) = (text(a), text(c));
        assert!(
            a.len() >= 20 && a.bytes().all(|b| b.is_ascii_lowercase()),
            "{a:?}"
        );
        assert!(
            c.len() >= 20 && c.bytes().all(|b| b == b' ' || b.is_ascii_digit()),
            "{c:?}"
        );
        assert_eq!(collect(b).0, ids(&r["greedy"][1]));
    });
    eprintln!("constrained steps: {steps}, {constrained:?}");
    assert!(steps >= 20, "{steps} steps");
    assert_eq!(
        constrained.downloads, steps as usize,
        "one download per step with grammar masks"
    );
    let masked = masked.get();
    assert!(
        (masked.0..=masked.1).contains(&(constrained.uploads - steps as usize)),
        "one upload per step and one per step with masks: {constrained:?} in {steps} steps, \
         {masked:?} masked"
    );

    let (steps, greedy) = count(&|| {
        let a = e.submit(request(p0.clone(), None, |_| {})).unwrap();
        let b = e
            .submit(request(p1.clone(), Some("a_r8_all"), |_| {}))
            .unwrap();
        assert_eq!(collect(a).0, ids(&r["greedy"][0]));
        assert_eq!(collect(b).0, ids(&r["adapters"]["a_r8_all"]["greedy"][1]));
    });
    eprintln!("greedy steps: {steps}, {greedy:?}");
    assert!(steps >= 32, "{steps} steps");
    assert_eq!(
        greedy,
        Transfers {
            uploads: steps as usize,
            downloads: steps as usize
        },
        "one upload and one download per step"
    );
}
