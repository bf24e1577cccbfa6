//! The classifier router's scoring on the tensor path (what a GPU runs), on the committed tiny
//! Llama (tests/fixtures/engine): scoring is work of the engine thread like any prefill, so it
//! shares the LoRA slots and the KV cache with the steps it rides in and changes no answer.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test
#![allow(clippy::disallowed_methods)] // tests read results back from the device

use crate::common;

use common::{engine_reference as reference, fixture_adapter, greedy, ids, tensor_engine, tokens};
use mole_engine::api::*;

/// One LoRA slot, three adapters: a classifier and two it routes to. Two threads route
/// requests (score, then generate with the adapter the scores pick) while requests for both
/// adapters run: every score is the score of the same text alone (to 1e-5: a row batched
/// beside others may differ in its last bits), and every answer is
/// transformers + PEFT's tokens (was: the scoring ran its forward pass on the caller's thread
/// beside the engine's step and could load its adapter into the slot a running step read).
#[test]
fn classifier_scoring_beside_adapter_requests_changes_no_answer() {
    let r = &reference()["llama"];
    let e = tensor_engine(|o| {
        o.max_loras = 1;
        o.max_cpu_loras = 4;
        o.max_batch_size = 8;
    });
    let dirs = [("b", "b_r4_qv"), ("c", "c_r16_mlp")];
    e.load_adapter(fixture_adapter("cls", "v1", "a_r8_all"))
        .unwrap();
    for (name, dir) in dirs {
        e.load_adapter(fixture_adapter(name, "v1", dir)).unwrap();
    }
    let dir = |name: &str| dirs.iter().find(|(n, _)| *n == name).unwrap().1;
    let want = |name: &str, p: usize| ids(&r["adapters"][dir(name)]["greedy"][p]);
    let labels = ["b".to_string(), "c".to_string()];
    let texts = ["route me", "pick one", "hello there", "xyz"];
    let alone: Vec<Vec<f32>> = texts
        .iter()
        .map(|t| e.score_labels(Some("cls"), t, &labels, &[]).unwrap())
        .collect();
    let e = &e;
    std::thread::scope(|sc| {
        let routers: Vec<_> = (0..2)
            .map(|k| {
                let (labels, alone) = (&labels, &alone);
                sc.spawn(move || {
                    for round in 0..12 {
                        let t = (round + k) % texts.len();
                        let scores = e.score_labels(Some("cls"), texts[t], labels, &[]).unwrap();
                        // Batched beside other rows the logits may differ in their last
                        // bits (the matmuls' shapes differ), never more.
                        let off = scores.iter().zip(&alone[t]).map(|(a, b)| (a - b).abs());
                        assert!(
                            off.fold(0f32, f32::max) < 1e-5,
                            "the scores of {:?}: {scores:?}, alone {:?}",
                            texts[t],
                            alone[t]
                        );
                        let best = (scores[1] > scores[0]) as usize;
                        let p = round % 2;
                        let prompt = ids(&r["prompts"][p]);
                        let got =
                            tokens(e.submit(greedy(prompt, Some(&labels[best]), 12)).unwrap());
                        assert_eq!(
                            got,
                            want(&labels[best], p)[..12],
                            "routed to {}",
                            labels[best]
                        );
                    }
                })
            })
            .collect();
        for round in 0..6 {
            let streams: Vec<_> = ["b", "c", "b", "c"]
                .iter()
                .enumerate()
                .map(|(i, a)| {
                    let p = (round + i) % 2;
                    (
                        *a,
                        p,
                        e.submit(greedy(ids(&r["prompts"][p]), Some(a), 24))
                            .unwrap(),
                    )
                })
                .collect();
            for (a, p, rx) in streams {
                assert_eq!(tokens(rx), want(a, p)[..24], "{a} on prompt {p}");
            }
        }
        for h in routers {
            h.join().unwrap();
        }
    });
}
