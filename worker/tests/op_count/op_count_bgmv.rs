//! The ops a tensor-path decode step issues with the BGMV LoRA kernels (`--lora-kernel bgmv`)
//! against the grouped ops, counted as `op_count.rs` counts them (every candle op makes a
//! tensor, and tensors take ids from one process-wide counter): BGMV makes fewer, and as
//! many for one row as for sixteen distinct adapters. It holds [`crate::alone`] while it
//! counts, so no other test makes tensors in the process meanwhile.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test
#![allow(clippy::disallowed_methods)] // tests build their inputs

use crate::common;

use common::steps::{adapter, ops_of_a_step, tiny_qwen3};
use mole_model::{Decoder, LoraAdapter, LoraKernel, TensorPathOptions};

/// The small random Qwen3 on the tensor path with `kernel` for its LoRA.
fn model(kernel: LoraKernel) -> Decoder {
    let mut m = tiny_qwen3();
    m.configure(
        mole_model::BackendKind::Paged,
        TensorPathOptions {
            lora_kernel: kernel,
            ..Default::default()
        },
    );
    m
}

/// Per step of the 2-layer model with adapters, the grouped ops make their selections,
/// reshapes, batched products, mask, scatter and adds; BGMV one shrink per projection group
/// and one expand-add per projection (measured when written: 356 tensors a step against 175,
/// 105 against 14.5 per layer beyond a base-only step's 146).
#[test]
fn bgmv_steps_make_fewer_ops_and_as_many_for_any_batch() {
    let _alone = crate::alone();
    let mut counts = Vec::new();
    for kernel in [LoraKernel::Ops, LoraKernel::Bgmv] {
        let m = model(kernel);
        let adapters: Vec<LoraAdapter> = (0..16).map(|_| adapter(&m)).collect();
        let distinct = |n: usize| -> Vec<Option<&LoraAdapter>> {
            let mut v: Vec<_> = adapters[..n].iter().map(Some).collect();
            v[n / 2] = None; // and a base row
            v
        };
        // Warm-up: the pools allocated and every adapter loaded into its slot.
        ops_of_a_step(&m, &distinct(16), 0);
        let one = ops_of_a_step(&m, &[Some(&adapters[0])], 0).0;
        let two = ops_of_a_step(&m, &distinct(2), 0).0;
        let sixteen = ops_of_a_step(&m, &distinct(16), 0).0;
        let base = ops_of_a_step(&m, &[None, None], 0).0;
        eprintln!(
            "LoRA {kernel}: tensors made by a decode step: 1 row {one}, 2 rows {two}, \
             16 rows of 15 distinct adapters and a base row {sixteen}; 2 base rows {base}"
        );
        assert_eq!(two, sixteen, "{kernel}: the count depends on the batch");
        counts.push((kernel, sixteen, base));
    }
    let (ops, bgmv) = (counts[0].1, counts[1].1);
    // Base-only steps make no LoRA ops either way: the same count.
    assert_eq!(counts[0].2, counts[1].2, "{counts:?}");
    let layers = 2;
    eprintln!(
        "LoRA ops per layer of a decode step: grouped {}, bgmv {} (with adapters, minus base)",
        (ops - counts[0].2) as f64 / layers as f64,
        (bgmv - counts[1].2) as f64 / layers as f64
    );
    assert!(bgmv < ops, "{counts:?}");
}
