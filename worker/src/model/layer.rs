//! One decoder layer: pre-norm attention and a SwiGLU MLP, each added to the residual.

use candle_core::{Module, Tensor};
use candle_nn::RmsNorm;

use super::attention::Attention;
use super::batch::{Batch, Row};
use super::project::projs;
use super::weights::Weights;
use super::{Lin, ModelConfig, ModelError, Proj};

/// The MLP: `down(silu(gate(x)) · up(x))`.
struct Mlp {
    gate: Lin,
    up: Lin,
    down: Lin,
}

impl Mlp {
    fn new(cfg: &ModelConfig, w: &dyn Weights, prefix: &str) -> Result<Self, ModelError> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        Ok(Self {
            gate: w.linear(&format!("{prefix}.gate_proj"), h, i, false)?,
            up: w.linear(&format!("{prefix}.up_proj"), h, i, false)?,
            down: w.linear(&format!("{prefix}.down_proj"), i, h, false)?,
        })
    }

    fn forward(&self, li: usize, x: &Tensor, batch: &Batch<'_>) -> Result<Tensor, ModelError> {
        let gate_up = [(&self.gate, Proj::Gate), (&self.up, Proj::Up)];
        let [gate, up] = projs(batch, gate_up, li, x)?;
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
        let l = format!("model.layers.{index}");
        Ok(Self {
            index,
            input_norm: w.norm(&format!("{l}.input_layernorm"), h, eps)?,
            attn: Attention::new(cfg, w, &format!("{l}.self_attn"))?,
            post_norm: w.norm(&format!("{l}.post_attention_layernorm"), h, eps)?,
            mlp: Mlp::new(cfg, w, &format!("{l}.mlp"))?,
        })
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
