//! `vision_config` of a Qwen3-VL `config.json`, as the language model's config reads it (it
//! knows nothing of the tower, which reads it back from [`super::super::ModelConfig`]).

use serde::Deserialize;

/// `vision_config` of a Qwen3-VL `config.json`.
#[derive(Debug, Clone, Deserialize)]
pub struct VisionConfig {
    /// Blocks.
    pub depth: usize,
    /// Width of a patch's hidden state.
    pub hidden_size: usize,
    /// `gelu_pytorch_tanh` (Qwen3-VL) or `gelu`.
    #[serde(default = "default_act")]
    pub hidden_act: String,
    /// MLP width.
    pub intermediate_size: usize,
    /// Attention heads.
    pub num_heads: usize,
    /// Input channels.
    #[serde(default = "default_channels")]
    pub in_channels: usize,
    /// Patch side in pixels.
    pub patch_size: usize,
    /// Patches merged per side into one token.
    pub spatial_merge_size: usize,
    /// Frames per patch.
    pub temporal_patch_size: usize,
    /// Width of the tokens handed to the language model.
    pub out_hidden_size: usize,
    /// Entries of the learned position grid (a square).
    pub num_position_embeddings: usize,
    /// Blocks whose outputs feed the DeepStack mergers, in order.
    #[serde(default)]
    pub deepstack_visual_indexes: Vec<usize>,
    /// `rope_theta` of the 2-D rotary embedding.
    #[serde(default)]
    pub rope_parameters: Option<VisionRope>,
}

/// The vision rotary embedding's parameters.
#[derive(Debug, Clone, Deserialize)]
pub struct VisionRope {
    /// Base of the frequencies.
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
}

fn default_act() -> String {
    "gelu_pytorch_tanh".into()
}
fn default_channels() -> usize {
    3
}
fn default_theta() -> f64 {
    10_000.0
}
