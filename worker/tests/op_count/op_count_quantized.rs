//! The tensor path's step over a quantized base (GGUF blocks, as `Engine::load_gguf` serves
//! them) issues the same candle ops whatever the batch, as `op_count.rs` checks for a
//! dense base: one quantized matmul per projection over all the step's rows, one row or
//! sixteen, one adapter or sixteen distinct ones, rows that decode beside rows that prefill.
//! It holds [`crate::alone`] while it counts, so no other test makes tensors meanwhile.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test
#![allow(clippy::disallowed_methods)] // tests read results back from the device

use crate::common;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;
use common::steps::{adapter, ops_of_a_step, tiny_qwen3_weights};
use mole_model::{Decoder, LoraAdapter};

/// A small random Qwen3 (GQA, q/k norm) on the tensor path, its projections quantized to
/// `dtype` (the rest in f32, as a GGUF file's norms are).
fn model(dtype: GgmlDType) -> Decoder {
    let (cfg, t) = tiny_qwen3_weights();
    let dev = Device::Cpu;
    let q = t
        .into_iter()
        .map(|(k, v)| {
            let d = if v.rank() == 2 && k.contains("layers") {
                dtype
            } else {
                GgmlDType::F32
            };
            (k, QTensor::quantize(&v, d).unwrap())
        })
        .collect();
    let mut m = Decoder::from_quantized(cfg, q, &dev).unwrap();
    m.configure(mole_model::BackendKind::Paged, Default::default());
    m
}

/// The count is the same for 2, 8 and 16 rows, for 16 rows on one adapter and on 16 distinct
/// ones, and for ragged batches (some rows prefilling prompts of several lengths beside rows
/// that decode) of 8 and 16 rows with one or many adapters. A single row makes a few fewer:
/// copies that lay out one row's data are already laid out, and candle skips them (a GPU
/// launches nothing for them either).
#[test]
fn op_count_of_a_quantized_step_is_the_same_for_any_batch_and_any_adapters() {
    let _alone = crate::alone();
    // Q4_1 runs mole's kernel (on CPUs with AVX2), Q8_0 candle's quantized matmul.
    for dtype in [GgmlDType::Q4_1, GgmlDType::Q8_0] {
        counts(model(dtype));
    }
}

fn counts(m: Decoder) {
    let adapters: Vec<LoraAdapter> = (0..16).map(|_| adapter(&m)).collect();
    let shared = |n: usize| vec![Some(&adapters[0]); n];
    let distinct = |n: usize| -> Vec<Option<&LoraAdapter>> {
        let mut v: Vec<_> = adapters[..n].iter().map(Some).collect();
        v[n / 2] = None; // and a base row
        v
    };
    // Warm-up: the pools are allocated and every adapter loaded into its slot by a first step
    // (per-process and per-adapter costs, not per-step ones).
    ops_of_a_step(&m, &distinct(16), 0);
    let count = |rows: &[Option<&LoraAdapter>], prefilling: usize| {
        let (ops, dims) = ops_of_a_step(&m, rows, prefilling);
        assert_eq!(
            dims,
            [rows.len(), 50],
            "one tensor of logits: one copy back"
        );
        ops
    };
    let decode = [
        ("1 row", count(&shared(1), 0)),
        ("2 rows, one adapter", count(&shared(2), 0)),
        ("8 rows, one adapter", count(&shared(8), 0)),
        ("16 rows, one adapter", count(&shared(16), 0)),
        (
            "16 rows, 15 distinct adapters and a base row",
            count(&distinct(16), 0),
        ),
    ];
    let ragged = [
        ("8 rows, 3 prefilling, one adapter", count(&shared(8), 3)),
        ("8 rows, 3 prefilling, distinct", count(&distinct(8), 3)),
        ("16 rows, 4 prefilling, one adapter", count(&shared(16), 4)),
        ("16 rows, 4 prefilling, distinct", count(&distinct(16), 4)),
    ];
    eprintln!("tensors made by a step of a 2-layer model: {decode:?}; {ragged:?}");
    let (one, sixteen) = (decode[0].1, decode[3].1);
    assert!(one > 100, "the count sees the step's ops: {one}");
    assert!(one <= sixteen, "{decode:?}");
    for (what, ops) in &decode[1..] {
        assert_eq!(*ops, sixteen, "{what}: {decode:?}");
    }
    for (what, ops) in &ragged {
        assert_eq!(*ops, ragged[0].1, "{what}: {ragged:?}");
    }
}
