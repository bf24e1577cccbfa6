//! What a tensor-path step sends to the device: token ids, positions, where each new key goes
//! and which slots each row's attention reads, the padding maps, the mask's inputs and each
//! token's LoRA slot, packed into one buffer and uploaded once (on a GPU every upload is a
//! synchronizing copy; the views below are free).

use candle_core::{DType, Device, Tensor};

use super::batch::{Paged, Row};
use super::decoder::Positions;
use super::kv::{BlockTable, KvPool};
use super::slots::{SlotPlan, StepSlots};

/// A step's inputs on the device.
pub(super) struct Inputs<'a> {
    /// Token ids `[tokens]`.
    pub ids: Tensor,
    /// Each token's position `[tokens]` (M-RoPE: its time position).
    pub positions: Tensor,
    /// M-RoPE: each token's height and width positions, when the step has image tokens.
    pub spatial: Option<(Tensor, Tensor)>,
    /// Each row's last token `[rows]`.
    pub last: Tensor,
    /// Where each token meets its LoRA slot, when rows have adapters.
    pub slots: Option<StepSlots>,
    /// The paged cache's indices.
    pub paged: Paged<'a>,
}

/// A row's block table, reserved before the step.
fn blocks<'r>(r: &'r Row<'_>) -> &'r BlockTable {
    r.cache
        .blocks
        .as_ref()
        .expect("blocks are reserved before a step's inputs")
}

/// Appends one section to the buffer; returns its offset and length.
fn section(buf: &mut Vec<u32>, values: impl IntoIterator<Item = u32>) -> (usize, usize) {
    let at = buf.len();
    buf.extend(values);
    (at, buf.len() - at)
}

/// The inputs of `rows` (their blocks already reserved in `kv`), with `slots` the LoRA slot of
/// each row and the slot pool's dtype when any row has an adapter, and `width` the cache's
/// width (kv heads × head dim).
pub(super) fn inputs<'a>(
    rows: &[Row<'_>],
    kv: &'a KvPool,
    slots: Option<(&[u32], DType)>,
    positions: &Positions,
    width: usize,
    device: &Device,
) -> candle_core::Result<Inputs<'a>> {
    let lens: Vec<usize> = rows.iter().map(|r| r.tokens.len()).collect();
    let starts: Vec<usize> = rows.iter().map(|r| r.cache.len()).collect();
    let n: usize = lens.iter().sum();
    let b = rows.len();
    let tq = lens.iter().copied().max().unwrap_or(1);
    let keys = starts
        .iter()
        .zip(&lens)
        .map(|(s, l)| s + l)
        .max()
        .unwrap_or(1);
    let offs: Vec<usize> = lens
        .iter()
        .scan(0, |o, l| {
            let at = *o;
            *o += l;
            Some(at)
        })
        .collect();
    let mut buf = Vec::with_capacity(7 * n + 2 * b * tq + b * keys + keys + b);
    let ids = section(&mut buf, rows.iter().flat_map(|r| r.tokens.iter().copied()));
    let pos = section(&mut buf, positions.time.iter().copied());
    let hw = positions.spatial.as_ref().map(|(h, w)| {
        (
            section(&mut buf, h.iter().copied()),
            section(&mut buf, w.iter().copied()),
        )
    });
    let write = section(
        &mut buf,
        rows.iter()
            .zip(starts.iter().zip(&lens))
            .flat_map(|(r, (&s, &l))| {
                let t = blocks(r);
                (s..s + l).map(move |p| kv.slot(t, p))
            }),
    );
    let gather = section(
        &mut buf,
        rows.iter()
            .zip(starts.iter().zip(&lens))
            .flat_map(|(r, (&s, &l))| {
                let t = blocks(r);
                (0..keys).map(move |j| if j < s + l { kv.slot(t, j) } else { 0 })
            }),
    );
    let pad = section(
        &mut buf,
        offs.iter()
            .zip(&lens)
            .flat_map(|(&o, &l)| (0..tq).map(move |t| (o + t.min(l - 1)) as u32)),
    );
    let unpad = section(
        &mut buf,
        lens.iter()
            .enumerate()
            .flat_map(|(i, &l)| (0..l).map(move |t| (i * tq + t) as u32)),
    );
    // A padded query past its row's end sees what the row's last token sees: every mask row
    // keeps at least one key, so the softmax never divides by zero.
    let qpos = section(
        &mut buf,
        starts
            .iter()
            .zip(&lens)
            .flat_map(|(&s, &l)| (0..tq).map(move |t| (s + t.min(l - 1)) as u32)),
    );
    let key_pos = section(&mut buf, 0..keys as u32);
    let last = section(
        &mut buf,
        offs.iter().zip(&lens).map(|(o, l)| (o + l - 1) as u32),
    );
    let lora = slots.map(|(s, dtype)| {
        let per_token: Vec<u32> = s
            .iter()
            .zip(&lens)
            .flat_map(|(&s, &l)| std::iter::repeat_n(s, l))
            .collect();
        let plan = SlotPlan::new(&per_token);
        let at = [
            section(&mut buf, plan.slots.iter().copied()),
            section(&mut buf, plan.gather.iter().copied()),
            section(&mut buf, plan.keep.iter().copied()),
            section(&mut buf, plan.scatter.iter().copied()),
        ];
        (plan, at, dtype)
    });
    let len = buf.len();
    let all = Tensor::from_vec(buf, len, device)?;
    let view = |(at, len): (usize, usize)| all.narrow(0, at, len);
    let write = view(write)?
        .reshape((n, 1))?
        .broadcast_as((n, width))?
        .contiguous()?;
    let mask = view(key_pos)?
        .reshape((1, 1, keys))?
        .broadcast_le(&view(qpos)?.reshape((b, tq, 1))?)?
        .to_dtype(DType::F32)?
        .affine(1e30, -1e30)?
        .reshape((b, 1, 1, tq, keys))?;
    Ok(Inputs {
        ids: view(ids)?,
        positions: view(pos)?,
        spatial: match hw {
            Some((h, w)) => Some((view(h)?, view(w)?)),
            None => None,
        },
        last: view(last)?,
        slots: match lora {
            Some((plan, [s, g, k, t], dtype)) => Some(StepSlots::new(
                &plan,
                view(s)?,
                view(g)?,
                view(k)?,
                view(t)?,
                dtype,
            )?),
            None => None,
        },
        paged: Paged {
            pool: kv,
            write,
            gather: view(gather)?,
            pad: view(pad)?,
            unpad: view(unpad)?,
            mask,
            rows: b,
            queries: tq,
            keys,
        },
    })
}
