//! What the op-count tests (op_count.rs, op_count_quantized.rs) share: a random adapter, and
//! the ops and copies of one tensor-path step over a batch of rows.

use std::collections::HashMap;

use candle_core::{Device, Tensor};
use mole_worker::model::{
    tensors_made, transfers_made, Decoder, LoraAdapter, Proj, Row, SeqCache, Transfers,
};

/// A random adapter of rank 8 on every projection.
#[allow(dead_code)] // each test crate uses some of these helpers
pub fn adapter(m: &Decoder) -> LoraAdapter {
    let mut modules = HashMap::new();
    for l in 0..m.config().num_hidden_layers {
        for p in Proj::ALL {
            let (d_in, d_out) = p.dims(m.config());
            let at = Tensor::randn(0f32, 0.1, (d_in, 8), &Device::Cpu).unwrap();
            let b = Tensor::randn(0f32, 0.1, (d_out, 8), &Device::Cpu).unwrap();
            modules.insert((l, p), (at, b));
        }
    }
    LoraAdapter::from_modules(modules, 8, 0)
}

/// Rows on `adapters` with prompts of 3 to 7 tokens; all but the last `prefilling` are
/// prefilled first. Returns the tensors one step makes (it decodes one token of the first
/// rows while the others prefill) and the dims of its logits.
#[allow(dead_code)] // each test crate uses some of these helpers
pub fn ops_of_a_step(
    m: &Decoder,
    adapters: &[Option<&LoraAdapter>],
    prefilling: usize,
) -> (usize, Vec<usize>) {
    let prompts: Vec<Vec<u32>> = (0..adapters.len())
        .map(|k| (1..4 + (k as u32 % 5)).collect())
        .collect();
    let mut caches: Vec<SeqCache> = adapters.iter().map(|_| SeqCache::default()).collect();
    let warm = adapters.len() - prefilling;
    let mut first: Vec<Row> = caches[..warm]
        .iter_mut()
        .zip(&prompts)
        .zip(adapters)
        .map(|((cache, tokens), a)| Row {
            tokens,
            cache,
            adapter: *a,
            vision: None,
        })
        .collect();
    if !first.is_empty() {
        m.forward_batch(&mut first).unwrap();
    }
    drop(first);
    let next = [7u32];
    let mut step: Vec<Row> = caches
        .iter_mut()
        .enumerate()
        .zip(adapters)
        .map(|((k, cache), a)| Row {
            tokens: if k < warm { &next } else { &prompts[k] },
            cache,
            adapter: *a,
            vision: None,
        })
        .collect();
    let ((logits, ops), copies) =
        transfers_made(|| tensors_made(|| m.forward_batch(&mut step).unwrap()));
    assert_eq!(
        copies,
        Transfers {
            uploads: 1,
            downloads: 0
        },
        "a step's inputs go up in one copy (its logits come back in the engine's one read)"
    );
    (ops, logits.dims().to_vec())
}
