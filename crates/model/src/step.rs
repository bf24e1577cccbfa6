//! What a tensor-path step sends to the device: token ids, positions, where each new key goes
//! and which slots each row's attention reads, the padding maps, the mask's inputs, each
//! token's LoRA slot, where image placeholders take their embeddings, and the caller's own
//! f32 inputs (the engine's sampling parameters), packed into one buffer and uploaded once
//! (on a GPU every upload is a synchronizing copy; the views below are free).
//!
//! The buffer is f32, since candle cannot reinterpret a device buffer's bytes as another
//! dtype: the indices travel as f32 (exact below 2^24, [`EXACT_F32`], which bounds the
//! cache's slots and is checked here for every value) and become u32 in one cast.

use candle_core::{DType, Device, Tensor};

use super::batch::{Paged, Positions, Row};
use super::kv::{BlockTable, KvPool};
use super::slots::{LoraSlots, SlotPlan, StepSlots};
use super::transfer::{self, EXACT_F32};

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
    /// Per row with image placeholders (in the order given): where they are among the step's
    /// tokens (`[n, hidden]`, each row the token's index) and which embedding rows they take
    /// (`[n]`).
    pub images: Vec<(Tensor, Tensor)>,
    /// The caller's f32 inputs, `[len]`, when it gave any.
    pub extra: Option<Tensor>,
}

/// A row's block table, reserved before the step.
fn blocks<'r>(r: &'r Row<'_>) -> &'r BlockTable {
    r.cache
        .blocks
        .as_ref()
        .expect("blocks are reserved before a step's inputs")
}

/// The index part of a step's buffer, as f32.
struct Packer {
    buf: Vec<f32>,
    /// The largest index packed.
    max: u32,
}

impl Packer {
    /// Appends one section; returns its offset and length.
    fn section(&mut self, values: impl IntoIterator<Item = u32>) -> (usize, usize) {
        let at = self.buf.len();
        let mut max = self.max;
        self.buf.extend(values.into_iter().map(|v| {
            max = max.max(v);
            v as f32
        }));
        self.max = max;
        (at, self.buf.len() - at)
    }
}

/// Host-side image placeholders of a step's rows: per row with any, their indices among the
/// step's tokens and the embedding rows they take.
pub(super) type ImageIndices = Vec<(Vec<u32>, Vec<u32>)>;

/// The inputs of `rows` (their blocks already reserved in `kv`), with `slots` the LoRA slot of
/// each row and the slot pool when any row has an adapter, `width` the cache's width
/// (kv heads × head dim), `images` the rows' image placeholders (`hidden` the embeddings'
/// width) and `extra` the caller's own inputs.
#[allow(clippy::too_many_arguments)]
pub(super) fn inputs<'a>(
    rows: &[Row<'_>],
    kv: &'a KvPool,
    slots: Option<(&[u32], &LoraSlots)>,
    positions: &Positions,
    width: usize,
    images: &ImageIndices,
    hidden: usize,
    extra: &[f32],
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
    let mut p = Packer {
        buf: Vec::with_capacity(7 * n + 2 * b * tq + b * keys + keys + b + extra.len()),
        max: 0,
    };
    let ids = p.section(rows.iter().flat_map(|r| r.tokens.iter().copied()));
    let pos = p.section(positions.time.iter().copied());
    let hw = positions
        .spatial
        .as_ref()
        .map(|(h, w)| (p.section(h.iter().copied()), p.section(w.iter().copied())));
    let write = p.section(
        rows.iter()
            .zip(starts.iter().zip(&lens))
            .flat_map(|(r, (&s, &l))| {
                let t = blocks(r);
                (s..s + l).map(move |p| kv.slot(t, p))
            }),
    );
    let gather = p.section(
        rows.iter()
            .zip(starts.iter().zip(&lens))
            .flat_map(|(r, (&s, &l))| {
                let t = blocks(r);
                (0..keys).map(move |j| if j < s + l { kv.slot(t, j) } else { 0 })
            }),
    );
    let pad = p.section(
        offs.iter()
            .zip(&lens)
            .flat_map(|(&o, &l)| (0..tq).map(move |t| (o + t.min(l - 1)) as u32)),
    );
    let unpad = p.section(
        lens.iter()
            .enumerate()
            .flat_map(|(i, &l)| (0..l).map(move |t| (i * tq + t) as u32)),
    );
    // A padded query past its row's end sees what the row's last token sees: every mask row
    // keeps at least one key, so the softmax never divides by zero.
    let qpos = p.section(
        starts
            .iter()
            .zip(&lens)
            .flat_map(|(&s, &l)| (0..tq).map(move |t| (s + t.min(l - 1)) as u32)),
    );
    let key_pos = p.section(0..keys as u32);
    let last = p.section(offs.iter().zip(&lens).map(|(o, l)| (o + l - 1) as u32));
    let lora = slots.map(|(s, pool)| {
        let per_token: Vec<u32> = s
            .iter()
            .zip(&lens)
            .flat_map(|(&s, &l)| std::iter::repeat_n(s, l))
            .collect();
        let plan = SlotPlan::new(&per_token);
        let at = [
            p.section(plan.slots.iter().copied()),
            p.section(plan.gather.iter().copied()),
            p.section(plan.keep.iter().copied()),
            p.section(plan.scatter.iter().copied()),
        ];
        // The BGMV kernels read each token's slot itself (see `slots::LoraKernel`).
        let tokens = pool
            .bgmv_for(n)
            .then(|| p.section(per_token.iter().copied()));
        (plan, at, tokens, pool.dtype())
    });
    let image_at: Vec<[(usize, usize); 2]> = images
        .iter()
        .map(|(at, of)| [p.section(at.iter().copied()), p.section(of.iter().copied())])
        .collect();
    if p.max as usize >= EXACT_F32 {
        candle_core::bail!(
            "a step index of {} is not exact in f32 (the cache has too many slots)",
            p.max
        );
    }
    let indices = p.buf.len();
    let mut buf = p.buf;
    buf.extend_from_slice(extra);
    let all = transfer::upload(buf, device)?;
    let index = all.narrow(0, 0, indices)?.to_dtype(DType::U32)?;
    let view = |(at, len): (usize, usize)| index.narrow(0, at, len);
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
            Some((plan, [s, g, k, t], tokens, dtype)) => Some(StepSlots::new(
                &plan,
                view(s)?,
                view(g)?,
                view(k)?,
                view(t)?,
                tokens.map(view).transpose()?,
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
        images: image_at
            .into_iter()
            .map(|[at, of]| {
                let n = at.1;
                Ok((
                    view(at)?
                        .reshape((n, 1))?
                        .broadcast_as((n, hidden))?
                        .contiguous()?,
                    view(of)?,
                ))
            })
            .collect::<candle_core::Result<_>>()?,
        extra: match extra.is_empty() {
            true => None,
            false => Some(all.narrow(0, indices, extra.len())?),
        },
    })
}
