//! What one batch holds, on the committed tiny Llama (tests/fixtures/engine): a request of `n`
//! choices counts as `n` rows from admission on, so a batch never holds more than
//! `maxBatchSize` rows.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test
#![allow(clippy::disallowed_methods)] // tests read results back from the device

mod common;

use candle_core::{DType, Device};
use common::{engine_fixtures as fixtures, engine_reference as reference, ids, tensor_engine};
use mole_worker::engine::api::*;
use mole_worker::engine::{Engine, EngineOptions};

fn host_engine(f: impl FnOnce(&mut EngineOptions)) -> Engine {
    let mut o = EngineOptions {
        base_name: "llama".into(),
        ..Default::default()
    };
    f(&mut o);
    Engine::load(&fixtures().join("llama"), DType::F32, &Device::Cpu, o).unwrap()
}

fn greedy(prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        images: Vec::new(),
        id: "t".into(),
        prompt: Prompt::Tokens(prompt),
        adapter: None,
        sampling: SamplingParams {
            max_tokens,
            ignore_eos: true,
            ..Default::default()
        },
    }
}

fn tokens(mut rx: EventStream) -> Vec<u32> {
    let mut out = Vec::new();
    loop {
        match rx.blocking_recv().expect("a final event") {
            TokenEvent::Token { token_id, .. } => out.push(token_id),
            TokenEvent::Finished { .. } => return out,
            TokenEvent::Error(e) => panic!("{e}"),
            TokenEvent::Started { .. } => {}
        }
    }
}

/// A request of four choices whose prompt takes many steps to prefill (one token a step),
/// and three requests submitted meanwhile, with `maxBatchSize: 4`: the four choices hold the
/// whole batch from admission on, so the others wait and no step runs more than four rows
/// (was: the unforked request counted as one row, the others joined, then its three other
/// choices: seven rows). Every answer is still transformers' tokens.
#[test]
fn a_request_of_n_choices_never_pushes_a_step_past_max_batch_size() {
    let r = &reference()["llama"];
    let (p0, p1) = (ids(&r["prompts"][0]), ids(&r["prompts"][1]));
    for tensor in [false, true] {
        let opts = |o: &mut EngineOptions| {
            o.max_batch_size = 4;
            o.prefill_chunk = 1;
        };
        let e = if tensor {
            tensor_engine(opts)
        } else {
            host_engine(opts)
        };
        let choices = e.submit_n(greedy(p0.clone(), 8), 4).unwrap();
        let others: Vec<_> = (0..3)
            .map(|_| e.submit(greedy(p1.clone(), 8)).unwrap())
            .collect();
        for rx in choices {
            assert_eq!(tokens(rx), ids(&r["greedy"][0])[..8]);
        }
        for rx in others {
            assert_eq!(tokens(rx), ids(&r["greedy"][1])[..8]);
        }
        let s = e.stats();
        assert!(
            s.largest_batch <= 4,
            "tensor path {tensor}: a batch of {} rows with maxBatchSize 4",
            s.largest_batch
        );
        assert_eq!(s.largest_batch, 4, "the four choices ran together: {s:?}");
    }
}
