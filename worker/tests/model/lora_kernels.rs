//! The BGMV LoRA kernels (`crates/kernels/kernels/lora.cu`, `--lora-kernel bgmv`) on a GPU: equal to
//! their CPU reference (`mole_kernels::bgmv`, which repeats their arithmetic in their
//! order) bit for bit, on decode shapes of the 5.9B benchmark model and odd ones, every dtype
//! pair the decoder makes, base rows and out-of-range slots; and equal to the grouped ops they
//! replace within the bound `mole_model::bgmv_against_grouped_ops` states.
//!
//! Device tests: ignored unless asked for, with `MOLE_TEST_DEVICE=cuda` on a `--features cuda`
//! build (`scripts/gpu-run.sh` runs them with `--include-ignored`). On the CPU the ops are the
//! reference itself, which the library's own tests check against the grouped ops.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test is a failed test
#![allow(clippy::disallowed_methods)] // tests upload inputs and read results back

use crate::common;

use candle_core::{DType, Device, Tensor};
use mole_kernels::bgmv;

const DEVICE_ONLY: &str = "set MOLE_TEST_DEVICE=cuda on a --features cuda build: on the CPU \
                           the ops are their reference itself";

/// A deterministic stream of values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn tensor(v: Vec<f32>, shape: &[usize], dtype: DType) -> Tensor {
    Tensor::from_vec(v, shape, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

fn f32s(t: &Tensor) -> Vec<f32> {
    t.to_device(&Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// `(name, device, reference)`: how many of the values differ in their bits, and the largest
/// difference.
fn compare(name: &str, device: &[f32], reference: &[f32]) -> usize {
    assert_eq!(device.len(), reference.len(), "{name}: lengths");
    let mut differ = 0;
    let mut worst = 0f32;
    for (d, r) in device.iter().zip(reference) {
        if d.to_bits() != r.to_bits() {
            differ += 1;
            worst = worst.max((d - r).abs());
        }
    }
    eprintln!(
        "{name}: {differ} of {} values differ from the CPU reference (largest by {worst:e})",
        device.len()
    );
    differ
}

/// One case: `tokens` tokens over a group of `n` projections of `d_in` → `d_out` at `rank`
/// (a multiple of 8, as the pool pads it) in a pool of `slots` slots.
struct Case {
    tokens: usize,
    d_in: usize,
    d_out: usize,
    rank: usize,
    n: usize,
    slots: usize,
}

const CASES: [Case; 7] = [
    // The 5.9B benchmark model (hidden 4096, intermediate 14336), rank 16, 16 adapters: q/k/v
    // at batch 1 and 16, gate/up and down at batch 16.
    Case {
        tokens: 1,
        d_in: 4096,
        d_out: 4096,
        rank: 16,
        n: 3,
        slots: 17,
    },
    Case {
        tokens: 16,
        d_in: 4096,
        d_out: 4096,
        rank: 16,
        n: 3,
        slots: 17,
    },
    Case {
        tokens: 16,
        d_in: 4096,
        d_out: 14336,
        rank: 16,
        n: 2,
        slots: 17,
    },
    Case {
        tokens: 16,
        d_in: 14336,
        d_out: 4096,
        rank: 16,
        n: 1,
        slots: 17,
    },
    // Odd widths and the rank range (8: 256 row groups; 24: a non-power-of-two chunk count;
    // 512: the largest rank a pool accepts).
    Case {
        tokens: 5,
        d_in: 1000,
        d_out: 520,
        rank: 8,
        n: 3,
        slots: 5,
    },
    Case {
        tokens: 7,
        d_in: 333,
        d_out: 77,
        rank: 24,
        n: 2,
        slots: 4,
    },
    Case {
        tokens: 3,
        d_in: 640,
        d_out: 300,
        rank: 512,
        n: 1,
        slots: 3,
    },
];

#[test]
#[ignore = "a device test: MOLE_TEST_DEVICE=cuda on a --features cuda build (scripts/gpu-run.sh)"]
fn the_kernels_equal_their_cpu_reference_bit_for_bit() {
    let dev = common::test_device();
    assert!(!dev.is_cpu(), "{DEVICE_ONLY}");
    let mut differ = 0;
    for (ci, c) in CASES.iter().enumerate() {
        // Every token's slot: adapters, repeats, base rows (0) and one past the pool.
        let slots: Vec<u32> = (0..c.tokens)
            .map(|t| match t % 5 {
                1 => 0,
                4 => c.slots as u32 + 3,
                _ => (1 + (t * 7) % (c.slots - 1)) as u32,
            })
            .collect();
        for (xd, wd) in [
            (DType::BF16, DType::BF16),
            (DType::F16, DType::F16),
            (DType::F32, DType::F32),
            (DType::BF16, DType::F32),
            (DType::F16, DType::F32),
            (DType::F32, DType::BF16),
        ] {
            let seed = ci as u64 * 10;
            let x = tensor(values(c.tokens * c.d_in, seed), &[c.tokens, c.d_in], xd);
            let at = tensor(
                values(c.slots * c.n * c.d_in * c.rank, seed + 1),
                &[c.slots * c.n, c.d_in, c.rank],
                wd,
            );
            let b = tensor(
                values(c.slots * c.d_out * c.rank, seed + 2),
                &[c.slots, c.d_out, c.rank],
                wd,
            );
            // The base product of two projections side by side: the expand reads the second
            // as a column slice, in place.
            let wide = tensor(
                values(c.tokens * 2 * c.d_out, seed + 3),
                &[c.tokens, 2 * c.d_out],
                xd,
            );
            let st = Tensor::new(slots.as_slice(), &Device::Cpu).unwrap();
            let on = |t: &Tensor| t.to_device(&dev).unwrap();
            let name = format!(
                "{} tokens, {}→{} rank {} ×{}, {xd:?} over {wd:?}",
                c.tokens, c.d_in, c.d_out, c.rank, c.n
            );

            let v_ref = bgmv::shrink(&x, &at, &st, c.n).unwrap();
            let v_dev = bgmv::shrink(&on(&x), &on(&at), &on(&st), c.n).unwrap();
            differ += compare(&format!("shrink, {name}"), &f32s(&v_dev), &f32s(&v_ref));

            let y = wide.narrow(1, c.d_out, c.d_out).unwrap();
            let y_dev = on(&wide).narrow(1, c.d_out, c.d_out).unwrap();
            let p = c.n - 1;
            let out_ref = bgmv::expand(&y, &v_ref, p, &b, &st).unwrap();
            let out_dev = bgmv::expand(
                &y_dev,
                &v_ref.to_device(&dev).unwrap(),
                p,
                &on(&b),
                &on(&st),
            )
            .unwrap();
            assert_eq!(out_dev.dtype(), xd);
            differ += compare(&format!("expand, {name}"), &f32s(&out_dev), &f32s(&out_ref));
        }
    }
    assert_eq!(
        differ, 0,
        "values that differ from the CPU reference (see above)"
    );
}

#[test]
#[ignore = "a device test: MOLE_TEST_DEVICE=cuda on a --features cuda build (scripts/gpu-run.sh)"]
fn the_kernels_equal_the_grouped_ops_within_their_roundings() {
    let dev = common::test_device();
    assert!(!dev.is_cpu(), "{DEVICE_ONLY}");
    for line in mole_model::bgmv_against_grouped_ops(&dev).unwrap() {
        eprintln!("{line}");
    }
}
