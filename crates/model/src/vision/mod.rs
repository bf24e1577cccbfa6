//! Qwen3-VL's vision tower: images (see [`preprocess`]) to the embeddings that replace their
//! placeholder tokens in the language model, and the DeepStack features added to the hidden
//! states of those tokens after the first decoder layers.
//!
//! A ViT over 16-pixel patches (a patch embedding, a learned position grid resampled to each
//! image's grid, 2-D rotary attention within each image, GELU MLPs), whose patches are merged
//! 2 × 2 into one token per block; the DeepStack mergers do the same on the outputs of chosen
//! blocks. Computed as transformers' `Qwen3VLVisionModel` computes it.

mod config;
pub mod preprocess;

pub use config::{VisionConfig, VisionRope};

use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{layer_norm, linear, LayerNorm, LayerNormConfig, Linear, VarBuilder};

use super::{LoraAdapter, ModelError};

/// An image batch's outputs: the merged tokens `[tokens, out_hidden]` of every image in turn,
/// and per DeepStack layer the same shape.
#[derive(Debug, Clone)]
pub struct ImageEmbeds {
    /// Embeddings of the images' tokens.
    pub merged: Tensor,
    /// DeepStack features of the same tokens, one tensor per layer they are added after.
    pub deepstack: Vec<Tensor>,
}

/// A linear layer of the tower with the adapter's update when the adapter targets it: the
/// modules PEFT's `target_modules="all-linear"` reaches (attention, MLPs, mergers).
struct Lin {
    linear: Linear,
    /// The module's path under `model.visual.` (the adapter's key).
    path: String,
}

impl Lin {
    fn new(d_in: usize, d_out: usize, vb: VarBuilder) -> candle_core::Result<Self> {
        let path = vb.prefix();
        let path = path
            .strip_prefix("model.visual.")
            .unwrap_or(&path)
            .to_string();
        Ok(Self {
            linear: linear(d_in, d_out, vb)?,
            path,
        })
    }

    fn forward(&self, x: &Tensor, lora: Option<&LoraAdapter>) -> candle_core::Result<Tensor> {
        let y = self.linear.forward(x)?;
        match lora.and_then(|a| a.vision_module(&self.path)) {
            None => Ok(y),
            // Computed in f32 when either side is (as the decoder's adapters are).
            Some((at, b)) => {
                let wide = match at.dtype() == DType::F32 || x.dtype() == DType::F32 {
                    true => DType::F32,
                    false => x.dtype(),
                };
                let u = x
                    .to_dtype(wide)?
                    .matmul(&at.to_dtype(wide)?)?
                    .matmul(&b.to_dtype(wide)?.t()?)?;
                let dtype = y.dtype();
                y + u.to_dtype(dtype)?
            }
        }
    }
}

/// `(in, out)` features of the tower's linear module `path` (under `model.visual.`), for an
/// adapter's shapes; None for a path the tower has no linear layer at.
pub fn linear_dims(cfg: &VisionConfig, path: &str) -> Option<(usize, usize)> {
    let h = cfg.hidden_size;
    let merged = h * cfg.spatial_merge_size.pow(2);
    let merger = |name: &str| match name {
        "linear_fc1" => Some((merged, merged)),
        "linear_fc2" => Some((merged, cfg.out_hidden_size)),
        _ => None,
    };
    if let Some(name) = path.strip_prefix("merger.") {
        return merger(name);
    }
    let (head, rest) = path.split_once('.')?;
    let (index, name) = rest.split_once('.')?;
    let index: usize = index.parse().ok()?;
    match head {
        "blocks" if index < cfg.depth => match name {
            "attn.qkv" => Some((h, 3 * h)),
            "attn.proj" => Some((h, h)),
            "mlp.linear_fc1" => Some((h, cfg.intermediate_size)),
            "mlp.linear_fc2" => Some((cfg.intermediate_size, h)),
            _ => None,
        },
        "deepstack_merger_list" if index < cfg.deepstack_visual_indexes.len() => merger(name),
        _ => None,
    }
}

/// Layer norms of the tower (transformers' `eps=1e-6`).
fn norm(size: usize, vb: VarBuilder) -> candle_core::Result<LayerNorm> {
    layer_norm(
        size,
        LayerNormConfig {
            eps: 1e-6,
            ..Default::default()
        },
        vb,
    )
}

/// One block: pre-norm attention within each image, pre-norm MLP.
struct Block {
    norm1: LayerNorm,
    norm2: LayerNorm,
    qkv: Lin,
    proj: Lin,
    fc1: Lin,
    fc2: Lin,
    heads: usize,
    tanh_gelu: bool,
}

impl Block {
    fn new(cfg: &VisionConfig, vb: VarBuilder) -> candle_core::Result<Self> {
        let h = cfg.hidden_size;
        Ok(Self {
            norm1: norm(h, vb.pp("norm1"))?,
            norm2: norm(h, vb.pp("norm2"))?,
            qkv: Lin::new(h, 3 * h, vb.pp("attn.qkv"))?,
            proj: Lin::new(h, h, vb.pp("attn.proj"))?,
            fc1: Lin::new(h, cfg.intermediate_size, vb.pp("mlp.linear_fc1"))?,
            fc2: Lin::new(cfg.intermediate_size, h, vb.pp("mlp.linear_fc2"))?,
            heads: cfg.num_heads,
            tanh_gelu: cfg.hidden_act != "gelu",
        })
    }

    /// `x` `[patches, hidden]`; `spans` each image's patches (attention stays within one).
    // A vision pass runs once per image at prefill, not per decode step.
    #[allow(clippy::disallowed_methods)]
    fn forward(
        &self,
        x: &Tensor,
        spans: &[(usize, usize)],
        (cos, sin): (&Tensor, &Tensor),
        lora: Option<&LoraAdapter>,
    ) -> candle_core::Result<Tensor> {
        let (n, h) = x.dims2()?;
        let hd = h / self.heads;
        let qkv = self
            .qkv
            .forward(&self.norm1.forward(x)?, lora)?
            .reshape((n, 3, self.heads, hd))?;
        let rot = |t: Tensor| -> candle_core::Result<Tensor> {
            // [n, heads, hd] in f32, as transformers rotates.
            let t = t.to_dtype(DType::F32)?;
            let c = cos.unsqueeze(1)?;
            let s = sin.unsqueeze(1)?;
            t.broadcast_mul(&c)? + rotate_half(&t)?.broadcast_mul(&s)?
        };
        let q = rot(qkv.narrow(1, 0, 1)?.squeeze(1)?)?.to_dtype(x.dtype())?;
        let k = rot(qkv.narrow(1, 1, 1)?.squeeze(1)?)?.to_dtype(x.dtype())?;
        let v = qkv.narrow(1, 2, 1)?.squeeze(1)?;
        let scale = (hd as f64).powf(-0.5);
        let mut outs = Vec::with_capacity(spans.len());
        for &(start, len) in spans {
            let heads = |t: &Tensor| t.narrow(0, start, len)?.transpose(0, 1)?.contiguous();
            let (q, k, v) = (heads(&q)?, heads(&k)?, heads(&v)?);
            let att = (q.matmul(&k.t()?)? * scale)?;
            let att = candle_nn::ops::softmax_last_dim(&att.to_dtype(DType::F32)?)?
                .to_dtype(x.dtype())?;
            outs.push(att.matmul(&v)?.transpose(0, 1)?.reshape((len, h))?);
        }
        let x = (x + self.proj.forward(&Tensor::cat(&outs, 0)?, lora)?)?;
        let m = self.fc1.forward(&self.norm2.forward(&x)?, lora)?;
        let m = if self.tanh_gelu {
            m.gelu()?
        } else {
            m.gelu_erf()?
        };
        x + self.fc2.forward(&m, lora)?
    }
}

/// `[-x2, x1]` of the halves of the last dim.
// Of a vision pass, once per image.
#[allow(clippy::disallowed_methods)]
fn rotate_half(x: &Tensor) -> candle_core::Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    let (x1, x2) = (
        x.narrow(D::Minus1, 0, d / 2)?,
        x.narrow(D::Minus1, d / 2, d / 2)?,
    );
    Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)
}

/// Merges each block of `merge × merge` patches into one token: a layer norm (over a patch,
/// or with `postshuffle` over the merged block), then a GELU MLP.
struct Merger {
    norm: LayerNorm,
    fc1: Lin,
    fc2: Lin,
    postshuffle: bool,
    merged: usize,
}

impl Merger {
    fn new(cfg: &VisionConfig, postshuffle: bool, vb: VarBuilder) -> candle_core::Result<Self> {
        let merged = cfg.hidden_size * cfg.spatial_merge_size.pow(2);
        Ok(Self {
            norm: norm(
                if postshuffle { merged } else { cfg.hidden_size },
                vb.pp("norm"),
            )?,
            fc1: Lin::new(merged, merged, vb.pp("linear_fc1"))?,
            fc2: Lin::new(merged, cfg.out_hidden_size, vb.pp("linear_fc2"))?,
            postshuffle,
            merged,
        })
    }

    fn forward(&self, x: &Tensor, lora: Option<&LoraAdapter>) -> candle_core::Result<Tensor> {
        let x = match self.postshuffle {
            true => self.norm.forward(&x.reshape(((), self.merged))?)?,
            false => self.norm.forward(x)?.reshape(((), self.merged))?,
        };
        // nn.GELU(): the exact (erf) form.
        self.fc2
            .forward(&self.fc1.forward(&x, lora)?.gelu_erf()?, lora)
    }
}

/// The vision tower.
pub struct VisionTower {
    cfg: VisionConfig,
    patch_embed: Linear,
    pos_embed: Tensor,
    blocks: Vec<Block>,
    merger: Merger,
    deepstack: Vec<(usize, Merger)>,
    inv_freq: Vec<f32>,
    device: Device,
}

impl VisionTower {
    /// The tower under `vb` (a checkpoint's `model.visual`).
    pub fn new(cfg: &VisionConfig, vb: VarBuilder) -> Result<Self, ModelError> {
        let c = cfg;
        let patch_len = c.in_channels * c.temporal_patch_size * c.patch_size * c.patch_size;
        // The 3-D convolution's kernel equals its stride: a linear map of each patch.
        let pe = vb.pp("patch_embed.proj");
        let w = pe
            .get(
                (
                    c.hidden_size,
                    c.in_channels,
                    c.temporal_patch_size,
                    c.patch_size,
                    c.patch_size,
                ),
                "weight",
            )?
            .reshape((c.hidden_size, patch_len))?;
        let patch_embed = Linear::new(w, Some(pe.get(c.hidden_size, "bias")?));
        let pos_embed = vb.get(
            (c.num_position_embeddings, c.hidden_size),
            "pos_embed.weight",
        )?;
        let blocks = (0..c.depth)
            .map(|i| Block::new(c, vb.pp(format!("blocks.{i}"))))
            .collect::<candle_core::Result<_>>()?;
        let deepstack = c
            .deepstack_visual_indexes
            .iter()
            .enumerate()
            .map(|(i, &layer)| {
                Ok((
                    layer,
                    Merger::new(c, true, vb.pp(format!("deepstack_merger_list.{i}")))?,
                ))
            })
            .collect::<candle_core::Result<_>>()?;
        // The axial rotary frequencies over a quarter of the head (rows and columns each take
        // half of the rotated half), in f32 as transformers computes them.
        let spatial = c.hidden_size / c.num_heads / 2;
        let theta = c
            .rope_parameters
            .as_ref()
            .map_or(10_000.0, |r| r.rope_theta) as f32;
        let inv_freq = (0..spatial)
            .step_by(2)
            .map(|i| 1.0 / theta.powf(i as f32 / spatial as f32))
            .collect();
        Ok(Self {
            cfg: c.clone(),
            patch_embed,
            pos_embed,
            blocks,
            merger: Merger::new(c, false, vb.pp("merger"))?,
            deepstack,
            inv_freq,
            device: vb.device().clone(),
        })
    }

    /// The embeddings of images whose patches (in order, see [`preprocess`]) are `pixels`
    /// `[patches, patch_len]` and whose grids are `grids`.
    /// `adapter`, when it targets modules of the tower, applies to them.
    // The tower runs once per image, before the step that prefills it, on inputs made from
    // the image's grid; its uploads (the pixels', these) are the image's, not the step's.
    #[allow(clippy::disallowed_methods)]
    pub fn forward(
        &self,
        pixels: &Tensor,
        grids: &[[usize; 3]],
        adapter: Option<&LoraAdapter>,
    ) -> Result<ImageEmbeds, ModelError> {
        let dtype = self.patch_embed.weight().dtype();
        let x = self.patch_embed.forward(&pixels.to_dtype(dtype)?)?;
        let (idx, w, hw) = self.patch_coordinates(grids);
        let n = hw.len();
        let taps = Tensor::from_vec(idx, n * 4, &self.device)?;
        let weights = Tensor::from_vec(w, (n, 4, 1), &self.device)?;
        let pos = self
            .pos_embed
            .index_select(&taps, 0)?
            .reshape((n, 4, self.cfg.hidden_size))?
            .to_dtype(DType::F32)?
            .broadcast_mul(&weights)?
            .sum(1)?
            .to_dtype(dtype)?;
        let mut x = (x + pos)?;
        let (cos, sin) = self.rotary(&hw)?;
        let spans = spans(grids);
        let mut deepstack = Vec::with_capacity(self.deepstack.len());
        for (i, block) in self.blocks.iter().enumerate() {
            x = block.forward(&x, &spans, (&cos, &sin), adapter)?;
            for (layer, merger) in &self.deepstack {
                if *layer == i {
                    deepstack.push(merger.forward(&x, adapter)?);
                }
            }
        }
        Ok(ImageEmbeds {
            merged: self.merger.forward(&x, adapter)?,
            deepstack,
        })
    }

    /// Per patch, in block order: the 4 taps and weights that resample the learned position
    /// grid to its image's grid (bilinear, corners aligned, as transformers computes them in
    /// f32), and its (row, column).
    fn patch_coordinates(&self, grids: &[[usize; 3]]) -> (Vec<u32>, Vec<f32>, Vec<(usize, usize)>) {
        let side = (self.cfg.num_position_embeddings as f64).sqrt() as usize;
        let m = self.cfg.spatial_merge_size;
        let (mut idx, mut w, mut hw) = (Vec::new(), Vec::new(), Vec::new());
        // One axis: the two taps and weights of position `i` of `size` on a `side` grid.
        let axis = |i: usize, size: usize| -> [(usize, f32); 2] {
            let src = i as f32 * (side - 1) as f32 / (size.max(2) - 1) as f32;
            let floor = src.floor();
            std::array::from_fn(|o| {
                let tap = (floor as usize + o).min(side - 1);
                let d = (src - floor - o as f32).abs();
                (tap, (1.0 - d).max(0.0))
            })
        };
        for &[t, h, w_] in grids {
            for _ in 0..t {
                for bh in 0..h / m {
                    for bw in 0..w_ / m {
                        for ih in 0..m {
                            for iw in 0..m {
                                let (r, c) = (bh * m + ih, bw * m + iw);
                                let (rows, cols) = (axis(r, h), axis(c, w_));
                                for (tr, wr) in rows {
                                    for (tc, wc) in cols {
                                        idx.push((tr * side + tc) as u32);
                                        w.push(wr * wc);
                                    }
                                }
                                hw.push((r, c));
                            }
                        }
                    }
                }
            }
        }
        (idx, w, hw)
    }

    /// cos/sin `[patches, head_dim]` of the 2-D rotary embedding: a row's angles on the first
    /// quarter of each half, its column's on the second.
    #[allow(clippy::disallowed_methods)] // once per image (see `forward`)
    fn rotary(&self, hw: &[(usize, usize)]) -> candle_core::Result<(Tensor, Tensor)> {
        let f = self.inv_freq.len();
        let mut cos = Vec::with_capacity(hw.len() * 4 * f);
        let mut sin = Vec::with_capacity(hw.len() * 4 * f);
        for &(r, c) in hw {
            let angles: Vec<f32> = (self.inv_freq.iter().map(|&k| r as f32 * k))
                .chain(self.inv_freq.iter().map(|&k| c as f32 * k))
                .collect();
            for _ in 0..2 {
                cos.extend(angles.iter().map(|a| a.cos()));
                sin.extend(angles.iter().map(|a| a.sin()));
            }
        }
        let n = hw.len();
        Ok((
            Tensor::from_vec(cos, (n, 4 * f), &self.device)?,
            Tensor::from_vec(sin, (n, 4 * f), &self.device)?,
        ))
    }
}

/// M-RoPE positions of a prompt whose image placeholders are runs of `image_token`, one run
/// per grid of `grids` in order (transformers' `get_rope_index` for images): text counts up
/// on all three axes; an image's tokens take (start, start + row, start + column) over its
/// merged grid, and the text after it continues at start + max(rows, columns). Returns the
/// positions and the offset (position minus index) where the tokens after the prompt go.
pub fn mrope_positions(
    ids: &[u32],
    image_token: u32,
    grids: &[[usize; 3]],
    merge: usize,
) -> Result<(Vec<[u32; 3]>, i64), ModelError> {
    let mut out = Vec::with_capacity(ids.len());
    let mut grids = grids.iter();
    let mut current = 0usize;
    let mut i = 0;
    while i < ids.len() {
        if ids[i] != image_token {
            out.push([current as u32; 3]);
            current += 1;
            i += 1;
            continue;
        }
        let run = ids[i..].iter().take_while(|&&t| t == image_token).count();
        let &[t, h, w] = grids.next().ok_or_else(|| {
            ModelError::Config("the prompt has more image placeholders than images".into())
        })?;
        let (gh, gw) = (h / merge, w / merge);
        if run != t * gh * gw {
            return Err(ModelError::Config(format!(
                "an image of {gh}×{gw} tokens has {run} placeholders"
            )));
        }
        for tt in 0..t {
            for r in 0..gh {
                for c in 0..gw {
                    out.push([
                        (current + tt) as u32,
                        (current + r) as u32,
                        (current + c) as u32,
                    ]);
                }
            }
        }
        current += gh.max(gw);
        i += run;
    }
    if grids.next().is_some() {
        return Err(ModelError::Config(
            "the prompt has fewer image placeholders than images".into(),
        ));
    }
    let next = out
        .iter()
        .flatten()
        .copied()
        .max()
        .map_or(0, |m| m as i64 + 1);
    Ok((out, next - ids.len() as i64))
}

/// Each frame's patches (start, length): attention stays within one frame of one image.
fn spans(grids: &[[usize; 3]]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut at = 0;
    for &[t, h, w] in grids {
        for _ in 0..t {
            out.push((at, h * w));
            at += h * w;
        }
    }
    out
}
