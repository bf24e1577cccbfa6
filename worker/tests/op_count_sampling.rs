//! The tensor path's sampling (engine/sample_ops.rs) issues the same candle ops for a batch
//! of one row as for sixteen, and sends back one small tensor: a step's one device→host copy.
//! Every candle op, uploads included, makes a tensor, and every tensor takes the next id of
//! candle's process-wide counter, so the ops are the ids consumed. This file holds one test,
//! so no other test makes tensors in the process while it counts.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test
#![allow(clippy::disallowed_methods)] // tests read results back from the device

use candle_core::{Device, Tensor};
use mole_worker::engine::sample_ops::{read, BatchSampler, CandleSampler, Penalty, RowSampling};
use mole_worker::model::tensors_made;

const VOCAB: usize = 1500;

/// A row with every stage: penalties, temperature, top-k, top-p, min-p, logprobs.
fn everything(k: usize) -> RowSampling {
    RowSampling {
        temperature: 0.8,
        top_k: 20 + k,
        top_p: 0.9,
        min_p: 0.05,
        u: 0.37,
        logprobs: Some(3),
        penalties: (0..3 + k as u32)
            .map(|t| Penalty {
                token: t * 11,
                factor: 1.2,
                minus: 0.1,
            })
            .collect(),
        mask: None,
    }
}

/// Sixteen rows mixing greedy (plain and penalised), temperature alone, top-k, top-p, min-p,
/// logprobs of different counts and idle rows (prompt chunks).
fn mixed() -> Vec<RowSampling> {
    (0..16)
        .map(|i| {
            let mut r = everything(i);
            match i % 8 {
                0 => r = RowSampling::idle(),
                1 => r.temperature = 0.0,
                2 => {
                    r.temperature = 0.0;
                    r.penalties.clear();
                    r.logprobs = None;
                }
                3 => (r.top_k, r.top_p, r.min_p) = (0, 1.0, 0.0),
                4 => (r.top_p, r.min_p, r.logprobs) = (1.0, 0.0, Some(1)),
                5 => (r.top_k, r.min_p) = (0, 0.0),
                6 => (r.top_k, r.top_p, r.logprobs) = (0, 1.0, None),
                _ => {}
            }
            r.u = i as f32 / 16.0;
            r
        })
        .collect()
}

#[test]
fn op_count_of_sampling_is_the_same_for_any_batch() {
    let sampler = CandleSampler::new();
    let ops = |rows: &[RowSampling]| {
        let logits = Tensor::randn(0f32, 2.0, (rows.len(), VOCAB), &Device::Cpu).unwrap();
        let (out, ops) = tensors_made(|| sampler.sample(&logits, rows).unwrap());
        assert_eq!(
            out.dims(),
            [rows.len(), 2 + 2 * 3],
            "one small tensor: one copy back"
        );
        let picked = read(&out, rows).unwrap();
        for (r, p) in rows.iter().zip(&picked) {
            assert!((p.token as usize) < VOCAB);
            assert_eq!(p.top.len(), r.logprobs.unwrap_or(0));
            assert_eq!(p.logprob.is_nan(), r.logprobs.is_none());
        }
        ops
    };
    // Warm-up: the device-resident constants are made on first use.
    ops(&mixed());
    let counts = [
        ("1 row, every stage", ops(&[everything(0)])),
        ("2 rows", ops(&[everything(1), everything(2)])),
        (
            "16 rows, every stage",
            ops(&(0..16).map(everything).collect::<Vec<_>>()),
        ),
        ("16 mixed rows", ops(&mixed())),
    ];
    eprintln!("tensors made by sampling a step: {counts:?}");
    assert!(
        counts[0].1 > 100,
        "the count sees the bisections: {counts:?}"
    );
    for (what, n) in &counts {
        assert_eq!(*n, counts[0].1, "{what}: {counts:?}");
    }
}
