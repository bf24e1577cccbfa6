//! Self-attention of a decoder layer over every row's own cache. Projections, q/k norms and
//! RoPE run once for the whole batch (each token rotated at its own position). On the tensor
//! path (GPUs, and the CPU when host kernels are off) the attention is one call for the whole
//! batch over the paged cache: rows padded to one shape, keys gathered by block table, heads
//! grouped for GQA, a masked softmax in f32 ([`attend_paged`]). CPU f32 decoders run the host
//! kernel per token for rows of few new tokens, gemm per row for longer ones.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::RmsNorm;

use super::batch::{Batch, Paged, Row, StepPath};
use super::cache::LayerKv;
use super::kvbuf::{KvBuf, KvElem};
use super::project::{fusable_projs, projs};
use super::weights::{Fusable, Weights};
use super::{Family, Lin, ModelConfig, ModelError, Proj};
use mole_kernels as kernels;

/// New tokens of a row at most for the host attention kernel; longer rows (prefill) use
/// gemm, whose tiling wins once there are many queries per key.
const HOST_ATTN_MAX_TOKENS: usize = 16;

/// One layer's attention: q/k/v/o projections, Qwen3's per-head q/k norms, and the shape.
pub(super) struct Attention {
    qkv: Fusable<3>,
    o: Lin,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl Attention {
    /// The attention of `prefix` (`model.layers.{i}.self_attn`): Qwen2 has a bias on q/k/v
    /// whatever `attention_bias` says, Qwen3 a norm on each head of q and k.
    pub(super) fn new(
        cfg: &ModelConfig,
        w: &dyn Weights,
        prefix: &str,
    ) -> Result<Self, ModelError> {
        let family = cfg.family()?;
        let (h, hd, nh, nkv) = (
            cfg.hidden_size,
            cfg.head_dim(),
            cfg.num_attention_heads,
            cfg.kv_heads(),
        );
        let eps = cfg.rms_norm_eps;
        let qkv_bias = cfg.attention_bias.unwrap_or(family == Family::Qwen2);
        let o_bias = cfg.attention_bias.unwrap_or(false) && family != Family::Qwen2;
        let (q_norm, k_norm) = if family == Family::Qwen3 {
            (
                Some(w.norm(&format!("{prefix}.q_norm"), hd, eps)?),
                Some(w.norm(&format!("{prefix}.k_norm"), hd, eps)?),
            )
        } else {
            (None, None)
        };
        Ok(Self {
            qkv: Fusable::Apart([
                w.linear(&format!("{prefix}.q_proj"), h, nh * hd, qkv_bias)?,
                w.linear(&format!("{prefix}.k_proj"), h, nkv * hd, qkv_bias)?,
                w.linear(&format!("{prefix}.v_proj"), h, nkv * hd, qkv_bias)?,
            ]),
            o: w.linear(&format!("{prefix}.o_proj"), nh * hd, h, o_bias)?,
            q_norm,
            k_norm,
            heads: nh,
            kv_heads: nkv,
            head_dim: hd,
        })
    }

    /// q/k/v fused into one product (the tensor path) or apart (the host path).
    /// The bytes its projections hold.
    pub(super) fn bytes(&self) -> u64 {
        self.qkv.bytes() + self.o.bytes()
    }

    pub(super) fn fuse(&mut self, on: bool) -> candle_core::Result<()> {
        match on {
            true => self.qkv.fuse(),
            false => self.qkv.unfuse(),
        }
    }

    /// Attention of every row of the batch over its own cache (extended by the new keys and
    /// values of layer `li`): `x` `[tokens, hidden]` → `[tokens, hidden]`.
    pub(super) fn forward(
        &self,
        li: usize,
        x: &Tensor,
        rows: &mut [Row<'_>],
        batch: &Batch<'_>,
    ) -> Result<Tensor, ModelError> {
        let (nh, nkv, hd) = (self.heads, self.kv_heads, self.head_dim);
        let n = x.dim(0)?;
        let [q, k, v] = fusable_projs(batch, &self.qkv, [Proj::Q, Proj::K, Proj::V], li, x)?;
        let mut q = q.reshape((n, nh, hd))?;
        let mut k = k.reshape((n, nkv, hd))?;
        let v = v.reshape((n, nkv, hd))?;
        if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
            q = qn.forward(&q)?;
            k = kn.forward(&k)?;
        }
        let rope = |x: &Tensor| {
            candle_nn::rotary_emb::rope_thd(&x.unsqueeze(0)?, &batch.cos, &batch.sin)?.squeeze(0)
        };
        let (q, k) = (rope(&q)?, rope(&k)?);
        let out = match &batch.path {
            StepPath::Tensor { paged, .. } => attend_paged(li, &q, &k, &v, batch, paged)?,
            StepPath::Host { kv, .. } => match *kv {
                DType::BF16 => attend_host::<half::bf16>(li, &q, &k, &v, rows, batch)?,
                DType::F16 => attend_host::<half::f16>(li, &q, &k, &v, rows, batch)?,
                _ => attend_host::<f32>(li, &q, &k, &v, rows, batch)?,
            },
        };
        let [o] = projs(batch, [(&self.o, Proj::O)], li, &out)?;
        Ok(o)
    }
}

/// The attention of a whole tensor-path batch: the new keys and values written to their slots
/// in place, every row's keys gathered by its block table, and one scaled dot-product over
/// rows padded to `queries × keys`, the heads of a KV group sharing its keys (no copy per
/// head), softmax in f32 under the causal mask. `q` `[tokens, heads, hd]`, `k`/`v`
/// `[tokens, kv_heads, hd]`; returns `[tokens, heads·hd]`. The op count is the same for any
/// batch: this is the reference a fused paged-attention kernel replaces.
fn attend_paged(
    li: usize,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    batch: &Batch<'_>,
    p: &Paged<'_>,
) -> Result<Tensor, ModelError> {
    let (n, nh, hd) = q.dims3()?;
    let nkv = k.dim(1)?;
    let g = nh / nkv;
    let (rows, tq, keys) = (p.rows, p.queries, p.keys);
    p.pool.write(
        li,
        &k.reshape((n, nkv * hd))?,
        &v.reshape((n, nkv * hd))?,
        &p.write,
    )?;
    let (kc, vc) = p.pool.gather(li, &p.gather)?;
    // A cache held in another dtype than the compute one (`kvCacheDtype`) is widened here.
    let heads = |c: Tensor| -> candle_core::Result<Tensor> {
        c.to_dtype(batch.dtype)?
            .reshape((rows, keys, nkv, hd))?
            .transpose(1, 2)?
            .contiguous()
    };
    let (kc, vc) = (heads(kc)?, heads(vc)?); // [rows, kv, keys, hd]
                                             // [tokens, heads·hd] → [rows, kv, g·queries, hd]: a KV group's heads as more queries.
    let qp = q
        .reshape((n, nh * hd))?
        .index_select(&p.pad, 0)?
        .reshape((rows, tq, nkv, g, hd))?
        .permute((0, 2, 3, 1, 4))?
        .contiguous()?
        .reshape((rows, nkv, g * tq, hd))?;
    let scale = 1.0 / (hd as f64).sqrt();
    let att = (qp.matmul(&kc.t()?)? * scale)?
        .to_dtype(DType::F32)?
        .reshape((rows, nkv, g, tq, keys))?
        .broadcast_add(&p.mask)?;
    let att = candle_nn::ops::softmax_last_dim(&att)?
        .to_dtype(batch.dtype)?
        .reshape((rows, nkv, g * tq, keys))?;
    Ok(att
        .matmul(&vc)? // [rows, kv, g·queries, hd]
        .reshape((rows, nkv, g, tq, hd))?
        .permute((0, 3, 1, 2, 4))?
        .contiguous()?
        .reshape((rows * tq, nh * hd))?
        .index_select(&p.unpad, 0)?)
}

/// Scaled dot-product attention of one sequence with tensor ops: `q` `[heads, t, hd]` at
/// positions `start..start + t` over keys/values `[kv_heads, start + t, hd]`; returns
/// `[t, heads·hd]`.
fn attend_tensors(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    start: usize,
    batch: &Batch<'_>,
) -> Result<Tensor, ModelError> {
    let (nh, t, hd) = q.dims3()?;
    let rep = nh / k.dim(0)?;
    let (k, v) = (repeat_kv(k, rep)?, repeat_kv(v, rep)?);
    let total = start + t;
    let scale = 1.0 / (hd as f64).sqrt();
    let mut att = (q.matmul(&k.t()?)? * scale)?; // [nh, t, total]
    if t > 1 {
        att = att.broadcast_add(&causal_mask(t, start, total, att.dtype(), batch.device)?)?;
    }
    let att =
        candle_nn::ops::softmax_last_dim(&att.to_dtype(DType::F32)?)?.to_dtype(batch.dtype)?;
    let o = att.matmul(&v)?; // [nh, t, hd]
    Ok(o.transpose(0, 1)?.reshape((t, nh * hd))?)
}

/// Attention of a CPU f32 batch: new keys/values appended to each row's host cache (rounded
/// to its dtype `E`, so every later read, this step's included, sees the values the cache
/// holds), then every token of a row with at most [`HOST_ATTN_MAX_TOKENS`] new tokens
/// attended by the host kernel (tokens × heads in parallel), longer rows (prefill) with tensor
/// ops over their cache widened to f32. `q` `[tokens, heads, hd]`, `k`/`v`
/// `[tokens, kv_heads, hd]`.
// The CPU host path: its copies are memcpys and its concatenations never reach a GPU.
#[allow(clippy::disallowed_methods)]
fn attend_host<E: KvElem>(
    li: usize,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    rows: &mut [Row<'_>],
    batch: &Batch<'_>,
) -> Result<Tensor, ModelError> {
    use rayon::prelude::*;
    let (n, nh, hd) = q.dims3()?;
    let nkv = k.dim(1)?;
    let width = nkv * hd;
    let (kg, vg) = match (kernels::HostF32::of(k), kernels::HostF32::of(v)) {
        (Some(kg), Some(vg)) => (kg, vg),
        _ => return Err(candle_core::Error::Msg("host attention: k/v not CPU f32".into()).into()),
    };
    let (ks, vs) = (kg.slice(n * width), vg.slice(n * width));
    let mut off = 0;
    for (ri, row) in rows.iter_mut().enumerate() {
        let t = batch.lens[ri];
        let slot = row.cache.layer_mut(li, batch.layers);
        if let LayerKv::Empty = slot {
            let new = || KvBuf::new(<E as mole_kernels::HostElem>::DTYPE);
            *slot = LayerKv::Host(new(), new());
        }
        if let LayerKv::Host(kc, vc) = slot {
            kc.append(&ks[off * width..(off + t) * width], width);
            vc.append(&vs[off * width..(off + t) * width], width);
        }
        off += t;
    }
    drop((kg, vg));
    // Each row's cache of this layer, read in place: its shared blocks, then its own tokens.
    let runs: Vec<Vec<kernels::KvRun<'_, E>>> = rows
        .iter()
        .map(|row| row.cache.host_runs::<E>(li, batch.layers))
        .collect();
    // Per token: its row and how many positions it sees (causal), or None for tokens of
    // long rows.
    let mut tokens: Vec<Option<(usize, usize)>> = Vec::with_capacity(n);
    let mut long = Vec::new();
    let mut off = 0;
    for ri in 0..rows.len() {
        let (t, start) = (batch.lens[ri], batch.starts[ri]);
        if t <= HOST_ATTN_MAX_TOKENS {
            tokens.extend((0..t).map(|i| Some((ri, start + i + 1))));
        } else {
            tokens.extend((0..t).map(|_| None));
            long.push((ri, off));
        }
        off += t;
    }
    let qg = kernels::HostF32::of(q)
        .ok_or_else(|| candle_core::Error::Msg("host attention: q not CPU f32".into()))?;
    let qs = qg.slice(n * nh * hd);
    let mut out = vec![0f32; n * nh * hd];
    let scale = 1.0 / (hd as f32).sqrt();
    let work: usize = tokens.iter().flatten().map(|t| t.1 * nh * hd * 2).sum();
    let attend = |scores: &mut Vec<f32>, (c, o): (usize, &mut [f32])| {
        let (tok, head) = (c / nh, c % nh);
        if let Some((ri, seen)) = tokens[tok] {
            let kv = kernels::KvHead {
                stride: width,
                offset: (head / (nh / nkv)) * hd,
                scale,
            };
            kernels::attend_head(&qs[c * hd..(c + 1) * hd], &runs[ri], seen, kv, o, scores);
        }
    };
    // One task per (token, head) when the batch is worth the threads: a batch-1 decode
    // of a long sequence uses all of them, a short decode step none.
    if work < kernels::PARALLEL_MIN_FMAS {
        let mut scores = Vec::new();
        out.chunks_mut(hd)
            .enumerate()
            .for_each(|c| attend(&mut scores, c));
    } else {
        out.par_chunks_mut(hd)
            .enumerate()
            .for_each_init(Vec::new, attend);
    }
    drop(qg);
    for (ri, off) in long {
        let (t, start) = (batch.lens[ri], batch.starts[ri]);
        let total = start + t;
        // A long row's whole context as one f32 tensor (copied, as a tensor needs it
        // contiguous).
        let whole = |c: Vec<f32>| -> candle_core::Result<Tensor> {
            Tensor::from_vec(c, (total, nkv, hd), batch.device)?
                .transpose(0, 1)?
                .contiguous()
        };
        let (mut kc, mut vc) = (
            Vec::with_capacity(total * width),
            Vec::with_capacity(total * width),
        );
        for p in rows[ri]
            .cache
            .host_pieces(li, batch.layers, width, 0, total)
        {
            p.buf_k.widen_into(p.keys, &mut kc);
            p.buf_v.widen_into(p.values, &mut vc);
        }
        let qr = q.narrow(0, off, t)?.transpose(0, 1)?.contiguous()?;
        let o = attend_tensors(&qr, &whole(kc)?, &whole(vc)?, start, batch)?;
        out[off * nh * hd..(off + t) * nh * hd]
            .copy_from_slice(&o.flatten_all()?.to_vec1::<f32>()?);
    }
    Ok(Tensor::from_vec(out, (n, nh * hd), batch.device)?)
}

fn repeat_kv(x: &Tensor, rep: usize) -> candle_core::Result<Tensor> {
    if rep == 1 {
        return Ok(x.clone());
    }
    let (h, l, d) = x.dims3()?;
    x.unsqueeze(1)?
        .expand((h, rep, l, d))?
        .reshape((h * rep, l, d))
}

/// -inf above the diagonal of the new block (position `start + i` sees keys up to itself).
#[allow(clippy::disallowed_methods)] // the CPU host path's prefill
fn causal_mask(
    t: usize,
    start: usize,
    total: usize,
    dtype: DType,
    device: &Device,
) -> candle_core::Result<Tensor> {
    let mask: Vec<f32> = (0..t)
        .flat_map(|i| {
            (0..total).map(move |j| {
                if j > start + i {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
        })
        .collect();
    Tensor::from_slice(&mask, (t, total), device)?.to_dtype(dtype)
}
