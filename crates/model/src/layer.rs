//! One decoder layer: pre-norm attention and a SwiGLU MLP, each added to the residual.

use candle_core::{Module, Tensor};
use candle_nn::RmsNorm;

use super::attention::Attention;
use super::batch::{Batch, Row};
use super::project::{fusable_projs, projs};
use super::weights::{Fusable, Weights};
use super::{Lin, ModelConfig, ModelError, Proj};

/// The MLP: `down(silu(gate(x)) · up(x))`.
struct Mlp {
    gate_up: Fusable<2>,
    down: Lin,
}

impl Mlp {
    fn new(cfg: &ModelConfig, w: &dyn Weights, prefix: &str) -> Result<Self, ModelError> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        Ok(Self {
            gate_up: Fusable::Apart([
                w.linear(&format!("{prefix}.gate_proj"), h, i, false)?,
                w.linear(&format!("{prefix}.up_proj"), h, i, false)?,
            ]),
            down: w.linear(&format!("{prefix}.down_proj"), i, h, false)?,
        })
    }

    fn forward(&self, li: usize, x: &Tensor, batch: &Batch<'_>) -> Result<Tensor, ModelError> {
        let [gate, up] = fusable_projs(batch, &self.gate_up, [Proj::Gate, Proj::Up], li, x)?;
        let act = (candle_nn::ops::silu(&gate)? * up)?;
        let [down] = projs(batch, [(&self.down, Proj::Down)], li, &act)?;
        Ok(down)
    }
}

/// Layer `index` of the decoder.
pub(super) struct Layer {
    index: usize,
    input_norm: RmsNorm,
    attn: Attention,
    post_norm: RmsNorm,
    mlp: Mlp,
}

impl Layer {
    /// Layer `index` of the checkpoint (`model.layers.{index}`).
    pub(super) fn new(
        cfg: &ModelConfig,
        w: &dyn Weights,
        index: usize,
    ) -> Result<Self, ModelError> {
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let l = format!("{}.layers.{index}", cfg.text_prefix());
        Ok(Self {
            index,
            input_norm: w.norm(&format!("{l}.input_layernorm"), h, eps)?,
            attn: Attention::new(cfg, w, &format!("{l}.self_attn"))?,
            post_norm: w.norm(&format!("{l}.post_attention_layernorm"), h, eps)?,
            mlp: Mlp::new(cfg, w, &format!("{l}.mlp"))?,
        })
    }

    /// The bytes its projections hold.
    pub(super) fn bytes(&self) -> u64 {
        self.attn.bytes() + self.mlp.gate_up.bytes() + self.mlp.down.bytes()
    }

    /// Projections that share an input fused (the tensor path) or apart (the host path).
    pub(super) fn fuse(&mut self, on: bool) -> candle_core::Result<()> {
        self.attn.fuse(on)?;
        match on {
            true => self.mlp.gate_up.fuse(),
            false => self.mlp.gate_up.unfuse(),
        }
    }

    /// `x` `[tokens, hidden]` through the layer, each row's cache extended.
    pub(super) fn forward(
        &self,
        x: Tensor,
        rows: &mut [Row<'_>],
        batch: &Batch<'_>,
    ) -> Result<Tensor, ModelError> {
        let hn = self.input_norm.forward(&x)?;
        let x = (x + self.attn.forward(self.index, &hn, rows, batch)?)?;
        let hn = self.post_norm.forward(&x)?;
        Ok((x + self.mlp.forward(self.index, &hn, batch)?)?)
    }
}
