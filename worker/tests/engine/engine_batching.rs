//! What one batch holds, on the committed tiny Llama (tests/fixtures/engine): a request of `n`
//! choices counts as `n` rows from admission on, so a batch never holds more than
//! `maxBatchSize` rows.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test
#![allow(clippy::disallowed_methods)] // tests read results back from the device

use crate::common;

use common::{engine_reference as reference, greedy, host_engine, ids, tensor_engine, tokens};
use mole_engine::api::*;
use mole_engine::EngineOptions;

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
        let choices = e.submit_n(greedy(p0.clone(), None, 8), 4).unwrap();
        let others: Vec<_> = (0..3)
            .map(|_| e.submit(greedy(p1.clone(), None, 8)).unwrap())
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
