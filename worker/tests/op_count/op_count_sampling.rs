//! The tensor path's sampling (engine/device_sampler.rs) issues the same candle ops for a batch
//! of one row as for sixteen, and sends back one small tensor: a step's one device→host copy.
//! Grammar masks (structured outputs) add a fixed number of ops whatever the rows and however
//! many of them are constrained: their bits travel in the sampling inputs' one upload.
//! Every candle op, uploads included, makes a tensor, and every tensor takes the next id of
//! candle's process-wide counter, so the ops are the ids consumed. It holds [`crate::alone`]
//! while it counts, so no other test makes tensors in the process meanwhile.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test
#![allow(clippy::disallowed_methods)] // tests read results back from the device

use candle_core::{Device, Tensor};
use mole_engine::device_sampler::{
    read, BatchSampler, CandleSampler, Penalty, RowSampling, SamplePlan,
};
use mole_engine::grammar::allowed;
use mole_model::tensors_made;

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

/// A grammar mask (llguidance's 32-bit words) allowing every `step`-th token from `from`.
fn every(step: usize, from: usize) -> Vec<u32> {
    let mut m = vec![0u32; VOCAB.div_ceil(32)];
    for t in (from..VOCAB).step_by(step) {
        m[t / 32] |= 1 << (t % 32);
    }
    m
}

/// `rows` with a mask on every `nth` row (from the first), each its own.
fn masked(mut rows: Vec<RowSampling>, nth: usize) -> Vec<RowSampling> {
    for (i, r) in rows.iter_mut().enumerate().step_by(nth) {
        r.mask = Some(every(3 + i % 5, i));
    }
    rows
}

/// Checks `out` against `rows`: each pick is in the vocabulary and allowed by its row's mask,
/// and a plain greedy masked row took the first largest allowed logit.
fn check(logits: &Tensor, rows: &[RowSampling], out: &Tensor) {
    let picked = read(out, rows).unwrap();
    let values = logits.to_vec2::<f32>().unwrap();
    for ((r, p), l) in rows.iter().zip(&picked).zip(&values) {
        assert!((p.token as usize) < VOCAB);
        assert_eq!(p.top.len(), r.logprobs.unwrap_or(0));
        assert_eq!(p.logprob.is_nan(), r.logprobs.is_none());
        let Some(m) = &r.mask else { continue };
        assert!(allowed(m, p.token as usize), "{} refused", p.token);
        if r.greedy() && r.penalties.is_empty() {
            let best = (0..VOCAB)
                .filter(|&t| allowed(m, t))
                .max_by(|&a, &b| l[a].total_cmp(&l[b]).then(b.cmp(&a)))
                .unwrap();
            assert_eq!(p.token as usize, best, "a greedy masked row");
        }
    }
}

#[test]
fn op_count_of_sampling_is_the_same_for_any_batch() {
    let _alone = crate::alone();
    let sampler = CandleSampler::new();
    let ops = |rows: &[RowSampling]| {
        let logits = Tensor::randn(0f32, 2.0, (rows.len(), VOCAB), &Device::Cpu).unwrap();
        let (out, ops) = tensors_made(|| sampler.sample(&logits, rows).unwrap());
        check(&logits, rows, &out);
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

    // Masked: the same ops for one constrained row as for sixteen, half or all of them
    // constrained, and the same number more than unmasked whatever the rows.
    let all = |n: usize| (0..n).map(everything).collect::<Vec<_>>();
    let masked_counts = [
        ("1 row masked", ops(&masked(all(1), 1))),
        ("2 rows, 1 masked", ops(&masked(all(2), 2))),
        ("16 rows, 8 masked", ops(&masked(all(16), 2))),
        ("16 rows masked", ops(&masked(all(16), 1))),
        ("16 mixed rows, 8 masked", ops(&masked(mixed(), 2))),
    ];
    eprintln!("tensors made by sampling a masked step: {masked_counts:?}");
    // One row makes two tensors fewer: broadcasting the `[1, vocab]` refused-logit constant
    // to a `[1, vocab]` batch makes no tensor in candle. From two rows on, the same count.
    assert_eq!(
        masked_counts[0].1 + 2,
        masked_counts[1].1,
        "{masked_counts:?}"
    );
    for (what, n) in &masked_counts[1..] {
        assert_eq!(*n, masked_counts[1].1, "{what}: {masked_counts:?}");
    }
    // The equalities above show no op per row; this bounds the fixed cost (the mask's
    // unpacking and the draw's masked minimum are about twenty ops).
    let extra = masked_counts[1].1 - counts[0].1;
    assert!(
        (1..=32).contains(&extra),
        "masking adds a few batched ops: {extra}"
    );

    // The engine computes masks while the forward pass runs and uploads them after the step's
    // inputs: the same count, the masks' own upload in place of the view of the inputs that
    // held them.
    let rows = masked(mixed(), 2);
    let logits = Tensor::randn(0f32, 2.0, (rows.len(), VOCAB), &Device::Cpu).unwrap();
    let plan = SamplePlan::new(&rows, VOCAB).masks_apart(true);
    let mut inputs = Vec::new();
    plan.pack(&rows, &mut inputs);
    assert_eq!(inputs.len(), plan.len());
    let mut masks = Vec::new();
    plan.pack_masks(rows.iter().map(|r| r.mask.as_deref()), &mut masks);
    let (out, apart) = tensors_made(|| {
        let n = inputs.len();
        let inputs = Tensor::from_vec(inputs, n, &Device::Cpu).unwrap();
        let n = masks.len();
        let masks = Tensor::from_vec(masks, n, &Device::Cpu).unwrap();
        sampler
            .sample_packed(&logits, &plan, &inputs, Some(&masks))
            .unwrap()
    });
    check(&logits, &rows, &out);
    assert_eq!(apart, masked_counts[1].1, "masks uploaded apart");
}
