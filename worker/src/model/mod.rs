//! One decoder for the Llama (SmolLM2), Qwen2 (QKV bias) and Qwen3 (per-head q/k RMSNorm)
//! families, read from an HF directory.
//!
//! Unlike candle-transformers' models, the model owns no KV cache: each sequence brings its
//! own [`SeqCache`] and position, so one model instance serves many sequences at once. Rows of
//! a batch are concatenated for every projection (one matmul for the whole batch) and split for
//! attention, which is per sequence.
//!
//! RoPE follows `config.json` (`rope_parameters` or `rope_scaling`): default, linear, dynamic
//! NTK, llama3 and YaRN, computed as transformers computes them (see [`rope`]).

mod dense;
pub(crate) mod host;
mod project;
pub mod rope;

use std::path::Path;

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{linear_b, Embedding, Linear, RmsNorm, VarBuilder};
use serde::Deserialize;

use crate::formats::hf;
use crate::lora::{HostUpdates, LoraAdapter, Proj};

pub use self::rope::{Rope, RopeScaling};

/// Errors loading or running a model. Stable names via [`ModelError::code`].
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The directory is unusable.
    #[error("model directory: {0}")]
    Dir(#[from] hf::HfError),
    /// `config.json` does not describe a supported model.
    #[error("config.json: {0}")]
    Config(String),
    /// A tensor is missing or has the wrong shape, or a kernel failed.
    #[error("tensor: {0}")]
    Tensor(#[from] candle_core::Error),
}

impl ModelError {
    /// Stable name.
    pub fn code(&self) -> &'static str {
        match self {
            ModelError::Dir(_) => "model_dir",
            ModelError::Config(_) => "model_config",
            ModelError::Tensor(_) => "model_tensor",
        }
    }
}

/// The decoder families mole runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// Llama / SmolLM2.
    Llama,
    /// Qwen2 / Qwen2.5: bias on q, k, v.
    Qwen2,
    /// Qwen3: RMSNorm on each head of q and k.
    Qwen3,
}

/// `config.json` fields the decoder reads.
#[derive(Debug, Clone, Deserialize)]
pub struct ModelConfig {
    /// `llama`, `qwen2` or `qwen3`.
    pub model_type: String,
    /// Hidden size.
    pub hidden_size: usize,
    /// MLP size.
    pub intermediate_size: usize,
    /// Layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (GQA).
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Head size (default hidden/heads).
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base (older configs and most published checkpoints).
    #[serde(default)]
    pub rope_theta: Option<f64>,
    /// RoPE settings as transformers 5 writes them (`rope_theta`, `rope_type`).
    #[serde(default)]
    pub rope_parameters: Option<serde_json::Value>,
    /// RoPE scaling of older configs (`{"rope_type": "llama3", ...}`).
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    /// Vocabulary.
    pub vocab_size: usize,
    /// lm_head shares the embedding matrix.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Bias on the attention projections (Qwen2 has it on q/k/v even when unset).
    #[serde(default)]
    pub attention_bias: Option<bool>,
    /// Longest position (the pre-scaling window for `linear` and `dynamic` RoPE).
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    /// Pre-training context length when a config keeps it at the top level (else it is read
    /// from the RoPE dict).
    #[serde(default)]
    pub original_max_position_embeddings: Option<usize>,
    /// Share of the head that is rotated (only 1.0 is supported).
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
}

fn default_max_pos() -> usize {
    4096
}

impl ModelConfig {
    /// Reads and checks `config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self, ModelError> {
        Self::from_json(hf::read_config(dir)?)
    }

    /// Parses and checks a `config.json` value.
    pub fn from_json(v: serde_json::Value) -> Result<Self, ModelError> {
        let cfg: ModelConfig =
            serde_json::from_value(v).map_err(|e| ModelError::Config(e.to_string()))?;
        cfg.family()?;
        if cfg.hidden_size == 0 || cfg.num_attention_heads == 0 {
            return Err(ModelError::Config(
                "hidden_size and num_attention_heads must be > 0".into(),
            ));
        }
        if cfg.kv_heads() == 0 || !cfg.num_attention_heads.is_multiple_of(cfg.kv_heads()) {
            return Err(ModelError::Config(
                "num_attention_heads must be a multiple of num_key_value_heads".into(),
            ));
        }
        if cfg.head_dim() == 0 || !cfg.head_dim().is_multiple_of(2) {
            return Err(ModelError::Config(format!(
                "head_dim {} must be even for RoPE",
                cfg.head_dim()
            )));
        }
        cfg.rope()?;
        Ok(cfg)
    }
    /// The family.
    pub fn family(&self) -> Result<Family, ModelError> {
        match self.model_type.as_str() {
            "llama" => Ok(Family::Llama),
            "qwen2" => Ok(Family::Qwen2),
            "qwen3" => Ok(Family::Qwen3),
            other => Err(ModelError::Config(format!(
                "model_type {other} is not supported (llama, qwen2, qwen3)"
            ))),
        }
    }
    /// RoPE base: the RoPE dict's `rope_theta`, else the top-level one, else 10000.
    pub fn rope_theta(&self) -> f64 {
        self.rope()
            .map(|r| r.theta)
            .unwrap_or(self.rope_theta.unwrap_or(10_000.0))
    }
    /// RoPE base and scaling (`rope_scaling` or `rope_parameters`), as transformers reads them.
    pub fn rope(&self) -> Result<Rope, ModelError> {
        Rope::from_config(self)
    }
    /// Longest sequence the model accepts: `max_position_embeddings`, stretched by `linear`,
    /// `dynamic` and `yarn` RoPE scaling (see [`Rope::max_positions`]).
    pub fn max_positions(&self) -> usize {
        self.rope()
            .map(|r| r.max_positions(self.max_position_embeddings))
            .unwrap_or(self.max_position_embeddings)
    }
    /// Key/value heads.
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }
    /// Head size.
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads)
    }
}

/// The KV cache of one sequence, per layer.
#[derive(Debug, Default, Clone)]
pub struct SeqCache {
    layers: Vec<LayerKv>,
    len: usize,
}

/// One layer's keys and values (after RoPE) for one sequence.
#[derive(Debug, Default, Clone)]
enum LayerKv {
    /// Nothing cached yet.
    #[default]
    Empty,
    /// Device tensors `[kv_heads, len, head_dim]`, extended by concatenation.
    Tensors(Tensor, Tensor),
    /// CPU f32 decoders: token-major `[len, kv_heads, head_dim]` vectors that the host
    /// attention kernel reads in place and new tokens extend in place (see [`append_kv`]; a
    /// tensor cache is copied whole at every step).
    Host(Vec<f32>, Vec<f32>),
}

impl SeqCache {
    /// Tokens cached.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One sequence of a batch: its new tokens, its cache (the new tokens start at `cache.len()`)
/// and the adapter it runs with.
pub struct Row<'a> {
    /// Tokens to process (the whole prompt at prefill, one token at decode).
    pub tokens: &'a [u32],
    /// The sequence's cache, extended by this forward pass.
    pub cache: &'a mut SeqCache,
    /// The adapter version this sequence pinned, or None for the base model.
    pub adapter: Option<&'a LoraAdapter>,
}

/// Per-forward facts about the rows: new tokens, cached tokens, adapter groups, and each
/// row's rotary cos/sin for its new positions.
struct Batch<'a> {
    lens: Vec<usize>,
    starts: Vec<usize>,
    groups: Vec<Group<'a>>,
    /// cos/sin `[tokens, head_dim/2]`: each token's rotation at its own position.
    cos: Tensor,
    sin: Tensor,
}

/// Rows of a batch that share an adapter: the adapter and their token positions in the batch.
struct Group<'a> {
    adapter: &'a LoraAdapter,
    idx: Tensor,
    rows: Vec<u32>,
}

struct Layer {
    input_norm: RmsNorm,
    q: Lin,
    k: Lin,
    v: Lin,
    o: Lin,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    post_norm: RmsNorm,
    gate: Lin,
    up: Lin,
    down: Lin,
}

/// The decoder.
pub struct Decoder {
    cfg: ModelConfig,
    embed: Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Lin,
    rope: Rope,
    cos: Tensor,
    sin: Tensor,
    device: Device,
    dtype: DType,
    /// The dtype of the projections and the embedding.
    weights: DType,
    /// CPU f32: attention and adapter updates run as fused host kernels.
    host: bool,
}

impl Decoder {
    /// Loads an HF directory (safetensors, sharded or not) in `dtype` on `device`.
    pub fn load(dir: &Path, dtype: DType, device: &Device) -> Result<Self, ModelError> {
        let cfg = ModelConfig::from_dir(dir)?;
        let files = hf::safetensors_files(dir)?;
        // SAFETY: weight files are read-only inputs for the life of the model.
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(&files, dtype, device)? };
        Self::new(cfg, vb)
    }

    /// Builds the decoder from a VarBuilder rooted at the checkpoint's top level. The
    /// projections and the embedding keep the VarBuilder's dtype; on the CPU, bf16 weights
    /// compute in f32 (see [`compute_dtype`]).
    pub fn new(cfg: ModelConfig, vb: VarBuilder) -> Result<Self, ModelError> {
        let device = vb.device().clone();
        let dtype = compute_dtype(vb.dtype(), &device);
        let weights = vb.dtype();
        Self::build(cfg, &Dense { vb, act: dtype }, device, (weights, dtype))
    }

    /// Builds the decoder from GGUF tensors already renamed to HF names (rows of llama Q/K
    /// un-permuted): projections stay quantized (candle's quantized matmul), norms and the
    /// embedding table are dequantized to f32.
    pub fn from_quantized(
        cfg: ModelConfig,
        tensors: std::collections::HashMap<String, QTensor>,
        device: &Device,
    ) -> Result<Self, ModelError> {
        Self::build(
            cfg,
            &Quantized(tensors, device.clone()),
            device.clone(),
            (DType::F32, DType::F32),
        )
    }

    /// The decoder over `w`, with `dtypes` those of the weights and of compute.
    fn build(
        cfg: ModelConfig,
        w: &dyn Weights,
        device: Device,
        (weights, dtype): (DType, DType),
    ) -> Result<Self, ModelError> {
        let family = cfg.family()?;
        let (h, hd, nh, nkv) = (
            cfg.hidden_size,
            cfg.head_dim(),
            cfg.num_attention_heads,
            cfg.kv_heads(),
        );
        let eps = cfg.rms_norm_eps;
        let embed_w = w.dense("model.embed_tokens.weight", (cfg.vocab_size, h))?;
        let embed = Embedding::new(embed_w.clone(), h);
        let qkv_bias = cfg.attention_bias.unwrap_or(family == Family::Qwen2);
        let o_bias = cfg.attention_bias.unwrap_or(false) && family != Family::Qwen2;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let l = format!("model.layers.{i}");
            let a = format!("{l}.self_attn");
            let (q_norm, k_norm) = if family == Family::Qwen3 {
                (
                    Some(w.norm(&format!("{a}.q_norm"), hd, eps)?),
                    Some(w.norm(&format!("{a}.k_norm"), hd, eps)?),
                )
            } else {
                (None, None)
            };
            layers.push(Layer {
                input_norm: w.norm(&format!("{l}.input_layernorm"), h, eps)?,
                q: w.linear(&format!("{a}.q_proj"), h, nh * hd, qkv_bias)?,
                k: w.linear(&format!("{a}.k_proj"), h, nkv * hd, qkv_bias)?,
                v: w.linear(&format!("{a}.v_proj"), h, nkv * hd, qkv_bias)?,
                o: w.linear(&format!("{a}.o_proj"), nh * hd, h, o_bias)?,
                q_norm,
                k_norm,
                post_norm: w.norm(&format!("{l}.post_attention_layernorm"), h, eps)?,
                gate: w.linear(
                    &format!("{l}.mlp.gate_proj"),
                    h,
                    cfg.intermediate_size,
                    false,
                )?,
                up: w.linear(&format!("{l}.mlp.up_proj"), h, cfg.intermediate_size, false)?,
                down: w.linear(
                    &format!("{l}.mlp.down_proj"),
                    cfg.intermediate_size,
                    h,
                    false,
                )?,
            });
        }
        let norm = w.norm("model.norm", h, eps)?;
        let lm_head = if cfg.tie_word_embeddings {
            w.tied_head("model.embed_tokens.weight", embed_w)?
        } else {
            w.linear("lm_head", h, cfg.vocab_size, false)?
        };
        let rope = cfg.rope()?;
        // Dynamic NTK frequencies depend on the length a pass reaches: the table covers the
        // original window, longer passes compute theirs (see `rotary`).
        let table_len = if rope.is_dynamic() {
            cfg.max_position_embeddings
        } else {
            cfg.max_positions()
        };
        let (cos, sin) = rope_cos_sin(&rope, &cfg, 0, table_len, dtype, &device)?;
        let host = device.is_cpu() && dtype == DType::F32;
        if host {
            // Which kernel multiplies decode steps decides CPU speed (1.5-2x between the direct
            // kernel and gemm): say it once per model.
            let base_product = match dense::available() {
                Some(dense::Isa::Avx512) => "direct AVX-512",
                Some(dense::Isa::Avx2) => "direct AVX2",
                None => "gemm",
            };
            let weights = weights.as_str();
            tracing::info!(base_product, weights, "CPU decode in f32 on host kernels");
        }
        Ok(Self {
            cfg,
            embed,
            layers,
            norm,
            lm_head,
            rope,
            cos,
            sin,
            host,
            device,
            dtype,
            weights,
        })
    }

    /// Whether a CPU f32 decoder runs attention and adapter updates as fused host kernels
    /// (the default) or as the tensor ops every other device and dtype runs. The tests run
    /// both against the same references, so the GPU's code path is checked on CPU too. Off
    /// for other devices and dtypes whatever is asked. Caches are not shared between modes.
    pub fn set_host_kernels(&mut self, on: bool) {
        self.host = on && self.device.is_cpu() && self.dtype == DType::F32;
    }

    /// The dtype of the projections and the embedding (the GGUF path: f32, what its
    /// dequantized parts hold).
    pub fn weight_dtype(&self) -> DType {
        self.weights
    }

    /// The configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The dtype activations are computed in: that of the weights, except half-type weights
    /// on the CPU (f32, see [`compute_dtype`]).
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Runs new tokens of several sequences in one pass; returns each row's logits at its last
    /// new position (`[vocab]`, f32) and extends each row's cache.
    pub fn forward(&self, rows: &mut [Row<'_>]) -> Result<Vec<Tensor>, ModelError> {
        // A CPU step forks the thread pool a few times per layer (projections, attention).
        // Forked from a pool thread, a fork is a push on that thread's own queue; from any
        // other thread, each one hands the work over and sleeps until it is done (tens of
        // microseconds each, most of a dynamic adapter's cost at batch 1), so the whole step
        // runs on the pool.
        if self.device.is_cpu() && rayon::current_thread_index().is_none() {
            return rayon::scope(|_| self.forward_on_pool(rows));
        }
        self.forward_on_pool(rows)
    }

    fn forward_on_pool(&self, rows: &mut [Row<'_>]) -> Result<Vec<Tensor>, ModelError> {
        let lens: Vec<usize> = rows.iter().map(|r| r.tokens.len()).collect();
        let starts: Vec<usize> = rows.iter().map(|r| r.cache.len()).collect();
        for (r, s) in rows.iter().zip(&starts) {
            if r.tokens.is_empty() {
                return Err(ModelError::Config("a row has no tokens".into()));
            }
            if s + r.tokens.len() > self.cfg.max_positions() {
                return Err(ModelError::Config(format!(
                    "sequence of {} tokens exceeds the model's {} positions",
                    s + r.tokens.len(),
                    self.cfg.max_positions()
                )));
            }
        }
        // Group rows by adapter so each adapter's low-rank product runs once per projection.
        let mut groups: Vec<(&LoraAdapter, Vec<u32>)> = Vec::new();
        let mut off = 0u32;
        for r in rows.iter() {
            let n = r.tokens.len() as u32;
            if let Some(a) = r.adapter {
                match groups.iter_mut().find(|(g, _)| std::ptr::eq(*g, a)) {
                    Some((_, idx)) => idx.extend(off..off + n),
                    None => groups.push((a, (off..off + n).collect())),
                }
            }
            off += n;
        }
        let groups: Vec<Group> = groups
            .into_iter()
            .map(|(adapter, idx)| {
                Ok(Group {
                    adapter,
                    idx: Tensor::new(idx.as_slice(), &self.device)?,
                    rows: idx,
                })
            })
            .collect::<Result<_, candle_core::Error>>()?;
        let ids: Vec<u32> = rows.iter().flat_map(|r| r.tokens.iter().copied()).collect();
        let (cos, sin): (Vec<Tensor>, Vec<Tensor>) = starts
            .iter()
            .zip(&lens)
            .map(|(&s, &t)| self.rotary(s, t))
            .collect::<Result<Vec<_>, _>>()?
            .into_iter()
            .unzip();
        let batch = Batch {
            lens: lens.clone(),
            starts,
            groups,
            cos: Tensor::cat(&cos, 0)?,
            sin: Tensor::cat(&sin, 0)?,
        };
        let groups = &batch.groups;
        let ids = Tensor::new(ids.as_slice(), &self.device)?;
        let mut x = self.embed.forward(&ids)?.to_dtype(self.dtype)?; // [T, h]
        for (li, layer) in self.layers.iter().enumerate() {
            let residual = x.clone();
            let hn = layer.input_norm.forward(&x)?;
            let attn = self.attention(layer, li, &hn, rows, &batch)?;
            x = (residual + attn)?;
            let residual = x.clone();
            let hn = layer.post_norm.forward(&x)?;
            let mlp = [(&layer.gate, Proj::Gate), (&layer.up, Proj::Up)];
            let [gate, up] = projs(self.host, mlp, li, &hn, groups)?;
            let act = (candle_nn::ops::silu(&gate)? * up)?;
            let [mlp] = projs(self.host, [(&layer.down, Proj::Down)], li, &act, groups)?;
            x = (residual + mlp)?;
        }
        for (r, (s, l)) in rows.iter_mut().zip(batch.starts.iter().zip(&lens)) {
            r.cache.len = s + l;
        }
        // Only each row's last position needs logits.
        let mut last = Vec::with_capacity(rows.len());
        let mut off = 0;
        for l in &lens {
            off += l;
            last.push((off - 1) as u32);
        }
        let idx = Tensor::new(last.as_slice(), &self.device)?;
        let h = self.norm.forward(&x.index_select(&idx, 0)?)?;
        let on_host = match self.host {
            true => project::host_projections(&h, vec![(&self.lm_head, HostUpdates::none())])?,
            false => None,
        };
        let logits = match on_host.and_then(|mut l| l.pop()) {
            Some(l) => l,
            None => self.lm_head.forward(&h)?.to_dtype(DType::F32)?,
        };
        Ok((0..rows.len())
            .map(|i| logits.get(i))
            .collect::<Result<_, _>>()?)
    }

    /// cos/sin `[t, head_dim/2]` for positions `start..start + t`: rows of the table, or for
    /// a dynamic-NTK pass beyond the original window, frequencies for the length it reaches
    /// (transformers recomputes them whenever a pass grows past what it has seen).
    fn rotary(&self, start: usize, t: usize) -> candle_core::Result<(Tensor, Tensor)> {
        if start + t > self.cos.dim(0)? {
            return rope_cos_sin(&self.rope, &self.cfg, start, t, self.dtype, &self.device);
        }
        Ok((self.cos.narrow(0, start, t)?, self.sin.narrow(0, start, t)?))
    }

    /// Attention of every row over its own cache. Projections, q/k norms and RoPE run once
    /// for the whole batch (each token rotated at its own position); the attention proper is
    /// per sequence: the host kernel on CPU f32 for rows of few new tokens, tensor ops
    /// (gemm) otherwise.
    fn attention(
        &self,
        layer: &Layer,
        li: usize,
        x: &Tensor,
        rows: &mut [Row<'_>],
        batch: &Batch<'_>,
    ) -> Result<Tensor, ModelError> {
        let groups = &batch.groups[..];
        let (nh, nkv, hd) = (
            self.cfg.num_attention_heads,
            self.cfg.kv_heads(),
            self.cfg.head_dim(),
        );
        let n = x.dim(0)?;
        let qkv = [
            (&layer.q, Proj::Q),
            (&layer.k, Proj::K),
            (&layer.v, Proj::V),
        ];
        let [q, k, v] = projs(self.host, qkv, li, x, groups)?;
        let mut q = q.reshape((n, nh, hd))?;
        let mut k = k.reshape((n, nkv, hd))?;
        let v = v.reshape((n, nkv, hd))?;
        if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
            q = qn.forward(&q)?;
            k = kn.forward(&k)?;
        }
        let rope = |x: &Tensor| {
            candle_nn::rotary_emb::rope_thd(&x.unsqueeze(0)?, &batch.cos, &batch.sin)?.squeeze(0)
        };
        let (q, k) = (rope(&q)?, rope(&k)?);
        let out = if self.host {
            self.attend_host(li, &q, &k, &v, rows, batch)?
        } else {
            let mut outs = Vec::with_capacity(rows.len());
            let mut off = 0;
            for (ri, row) in rows.iter_mut().enumerate() {
                let (t, start) = (batch.lens[ri], batch.starts[ri]);
                // [t, heads, hd] → [heads, t, hd]
                let heads = |x: &Tensor| x.narrow(0, off, t)?.transpose(0, 1)?.contiguous();
                let (qr, kr, vr) = (heads(&q)?, heads(&k)?, heads(&v)?);
                let slot = self.cache_slot(row.cache, li);
                let (kr, vr) = match std::mem::take(slot) {
                    LayerKv::Tensors(pk, pv) => {
                        (Tensor::cat(&[&pk, &kr], 1)?, Tensor::cat(&[&pv, &vr], 1)?)
                    }
                    LayerKv::Empty => (kr, vr),
                    LayerKv::Host(..) => return Err(mixed_cache()),
                };
                *slot = LayerKv::Tensors(kr.clone(), vr.clone());
                outs.push(self.attend_tensors(&qr, &kr, &vr, start)?);
                off += t;
            }
            Tensor::cat(&outs, 0)?
        };
        let [o] = projs(self.host, [(&layer.o, Proj::O)], li, &out, groups)?;
        Ok(o)
    }

    /// The layer's cache slot of a sequence (created on first use).
    fn cache_slot<'c>(&self, cache: &'c mut SeqCache, li: usize) -> &'c mut LayerKv {
        if cache.layers.len() < self.layers.len() {
            cache.layers.resize(self.layers.len(), LayerKv::Empty);
        }
        &mut cache.layers[li]
    }

    /// Scaled dot-product attention of one sequence with tensor ops: `q` `[heads, t, hd]` at
    /// positions `start..start + t` over keys/values `[kv_heads, start + t, hd]`; returns
    /// `[t, heads·hd]`.
    fn attend_tensors(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        start: usize,
    ) -> Result<Tensor, ModelError> {
        let (nh, t, hd) = q.dims3()?;
        let rep = nh / k.dim(0)?;
        let (k, v) = (repeat_kv(k, rep)?, repeat_kv(v, rep)?);
        let total = start + t;
        let scale = 1.0 / (hd as f64).sqrt();
        let mut att = (q.matmul(&k.t()?)? * scale)?; // [nh, t, total]
        if t > 1 {
            att = att.broadcast_add(&causal_mask(t, start, total, att.dtype(), &self.device)?)?;
        }
        let att =
            candle_nn::ops::softmax_last_dim(&att.to_dtype(DType::F32)?)?.to_dtype(self.dtype)?;
        let o = att.matmul(&v)?; // [nh, t, hd]
        Ok(o.transpose(0, 1)?.reshape((t, nh * hd))?)
    }

    /// Attention of a CPU f32 batch: new keys/values appended to each row's host cache, then
    /// every token of a row with at most [`HOST_ATTN_MAX_TOKENS`] new tokens attended by the
    /// host kernel (tokens × heads in parallel), longer rows (prefill) with tensor ops over
    /// their cache. `q` `[tokens, heads, hd]`, `k`/`v` `[tokens, kv_heads, hd]`.
    fn attend_host(
        &self,
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
        let (kg, vg) = match (host::HostF32::of(k), host::HostF32::of(v)) {
            (Some(kg), Some(vg)) => (kg, vg),
            _ => {
                return Err(
                    candle_core::Error::Msg("host attention: k/v not CPU f32".into()).into(),
                )
            }
        };
        let (ks, vs) = (kg.slice(n * width), vg.slice(n * width));
        let mut off = 0;
        for (ri, row) in rows.iter_mut().enumerate() {
            let t = batch.lens[ri];
            let slot = self.cache_slot(row.cache, li);
            match slot {
                LayerKv::Empty => *slot = LayerKv::Host(Vec::new(), Vec::new()),
                LayerKv::Tensors(..) => return Err(mixed_cache()),
                LayerKv::Host(..) => {}
            }
            if let LayerKv::Host(kc, vc) = slot {
                append_kv(kc, &ks[off * width..(off + t) * width], width);
                append_kv(vc, &vs[off * width..(off + t) * width], width);
            }
            off += t;
        }
        drop((kg, vg));
        // Per token: its row's cache and how many positions it sees (causal).
        // (keys, values, positions seen), or None for tokens of long rows.
        type Visible<'c> = Option<(&'c [f32], &'c [f32], usize)>;
        let mut tokens: Vec<Visible<'_>> = Vec::with_capacity(n);
        let mut long = Vec::new();
        let mut off = 0;
        for (ri, row) in rows.iter().enumerate() {
            let (t, start) = (batch.lens[ri], batch.starts[ri]);
            let Some(LayerKv::Host(kc, vc)) = row.cache.layers.get(li) else {
                unreachable!("filled above")
            };
            if t <= HOST_ATTN_MAX_TOKENS {
                tokens.extend((0..t).map(|i| Some((&kc[..], &vc[..], start + i + 1))));
            } else {
                tokens.extend((0..t).map(|_| None));
                long.push((ri, off));
            }
            off += t;
        }
        let qg = host::HostF32::of(q)
            .ok_or_else(|| candle_core::Error::Msg("host attention: q not CPU f32".into()))?;
        let qs = qg.slice(n * nh * hd);
        let mut out = vec![0f32; n * nh * hd];
        let scale = 1.0 / (hd as f32).sqrt();
        let work: usize = tokens.iter().flatten().map(|t| t.2 * nh * hd * 2).sum();
        let attend = |scores: &mut Vec<f32>, (c, o): (usize, &mut [f32])| {
            let (tok, head) = (c / nh, c % nh);
            if let Some((kc, vc, seen)) = tokens[tok] {
                let kv = host::KvHead {
                    stride: width,
                    offset: (head / (nh / nkv)) * hd,
                    scale,
                };
                host::attend_head(&qs[c * hd..(c + 1) * hd], kc, vc, seen, kv, o, scores);
            }
        };
        // One task per (token, head) when the batch is worth the threads: a batch-1 decode
        // of a long sequence uses all of them, a short decode step none.
        if work < host::PARALLEL_MIN_FMAS {
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
            let Some(LayerKv::Host(kc, vc)) = rows[ri].cache.layers.get(li) else {
                unreachable!("filled above")
            };
            let total = start + t;
            let cached = |c: &[f32]| -> candle_core::Result<Tensor> {
                Tensor::from_slice(&c[..total * width], (total, nkv, hd), &self.device)?
                    .transpose(0, 1)?
                    .contiguous()
            };
            let qr = q.narrow(0, off, t)?.transpose(0, 1)?.contiguous()?;
            let o = self.attend_tensors(&qr, &cached(kc)?, &cached(vc)?, start)?;
            out[off * nh * hd..(off + t) * nh * hd]
                .copy_from_slice(&o.flatten_all()?.to_vec1::<f32>()?);
        }
        Ok(Tensor::from_vec(out, (n, nh * hd), &self.device)?)
    }
}

/// A sequence's cache was filled in the other attention mode (see
/// [`Decoder::set_host_kernels`]).
fn mixed_cache() -> ModelError {
    ModelError::Config("a sequence cache was filled by the other attention mode".into())
}

/// Spare room, in tokens, a host cache grows by when it is full.
const KV_GROW_TOKENS: usize = 256;

/// Appends new keys (or values) to a host cache. Growth is by [`KV_GROW_TOKENS`] past what is
/// needed, not doubling: a sequence never holds more than that much spare room (doubling would
/// hold up to its whole length again), and a reallocation every 256 tokens costs little next
/// to the steps between.
fn append_kv(cache: &mut Vec<f32>, new: &[f32], width: usize) {
    if cache.capacity() - cache.len() < new.len() {
        cache.reserve_exact(new.len() + KV_GROW_TOKENS * width);
    }
    cache.extend_from_slice(new);
}

/// New tokens of a row at most for the host attention kernel; longer rows (prefill) use
/// gemm, whose tiling wins once there are many queries per key.
const HOST_ATTN_MAX_TOKENS: usize = 16;

/// Projections of one input for the whole batch: each base matmul once, plus each adapter
/// group's low-rank update on its own rows only. On the host (CPU f32, few tokens) all of
/// them run in one fork of the thread pool (see [`project`]).
fn projs<const N: usize>(
    host: bool,
    lins: [(&Lin, Proj); N],
    layer: usize,
    x: &Tensor,
    groups: &[Group<'_>],
) -> Result<[Tensor; N], ModelError> {
    if host {
        let pairs: Vec<(&LoraAdapter, &[u32])> = groups
            .iter()
            .map(|g| (g.adapter, g.rows.as_slice()))
            .collect();
        let mut with_updates = Vec::with_capacity(N);
        for &(lin, which) in &lins {
            match HostUpdates::of(layer, which, &pairs)? {
                Some(u) => with_updates.push((lin, u)),
                None => break,
            }
        }
        if with_updates.len() == N {
            if let Some(out) = project::host_projections(x, with_updates)? {
                return Ok(out.try_into().expect("one output per projection"));
            }
        }
    }
    let mut out = Vec::with_capacity(N);
    for (lin, which) in lins {
        out.push(tensor_updates(lin.forward(x)?, layer, which, x, groups)?);
    }
    Ok(out.try_into().expect("one output per projection"))
}

/// `out` plus each adapter group's update with tensor ops (GPU, other dtypes, prefill).
fn tensor_updates(
    mut out: Tensor,
    layer: usize,
    which: Proj,
    x: &Tensor,
    groups: &[Group<'_>],
) -> Result<Tensor, ModelError> {
    for g in groups {
        out = g.adapter.apply(layer, which, x, &g.idx, &out)?;
    }
    Ok(out)
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

/// cos/sin `[t, head_dim/2]` of HF's non-interleaved rotary embedding for positions
/// `start..start + t`, computed as transformers does: f32 angles `position × inv_freq`, cos and
/// sin times the attention scaling (YaRN), then cast to the model's dtype. The frequencies of
/// dynamic NTK use the length this span reaches.
fn rope_cos_sin(
    rope: &Rope,
    cfg: &ModelConfig,
    start: usize,
    t: usize,
    dtype: DType,
    device: &Device,
) -> candle_core::Result<(Tensor, Tensor)> {
    let (inv, scale) = rope.inv_freq(start + t, cfg.max_position_embeddings);
    let half = inv.len();
    let inv: Vec<f32> = inv.into_iter().map(|f| f as f32).collect();
    let inv = Tensor::from_vec(inv, (1, half), device)?;
    let pos = Tensor::arange(start as u32, (start + t) as u32, device)?
        .to_dtype(DType::F32)?
        .reshape((t, 1))?;
    let freqs = pos.broadcast_mul(&inv)?;
    let (mut cos, mut sin) = (freqs.cos()?, freqs.sin()?);
    if scale != 1.0 {
        cos = (cos * scale)?;
        sin = (sin * scale)?;
    }
    Ok((cos.to_dtype(dtype)?, sin.to_dtype(dtype)?))
}

/// Greedy argmax of a logits vector.
pub fn argmax(logits: &Tensor) -> Result<u32, ModelError> {
    Ok(logits.argmax(D::Minus1)?.to_scalar::<u32>()?)
}

/// The dtype a decoder computes in over weights of `weights`: the same, except the half
/// types on the CPU, which compute in f32. The host kernels read bf16 and f16 weights in place
/// and widen them in registers (exact), so the weights keep half the memory and decode steps
/// read half the bytes, where candle's CPU half-precision ops would be slower than f32 and
/// round every activation (f16 also overflows past 65504).
pub fn compute_dtype(weights: DType, device: &Device) -> DType {
    if device.is_cpu() && matches!(weights, DType::BF16 | DType::F16) {
        DType::F32
    } else {
        weights
    }
}

/// The dtype adapters are held in when the pool does not say (`loraDtype` unset): that of
/// the weights, as vLLM's `lora_dtype="auto"`, where the kernels read it. Over bf16 weights an
/// adapter rounded to bf16 moves the output by 2⁻⁹ of its low-rank update only, far less than
/// the weights' own rounding (2⁻⁹ of the whole product, the same a merged pod's baked weights
/// carry), while it halves the adapter's memory and the bytes each distinct adapter adds to a
/// decode step. The CPU's host kernels read f32 and bf16 adapters but not f16 ones, so over
/// f16 weights a CPU holds them in f32; f32 and quantized (GGUF) bases keep f32 adapters.
pub fn adapter_dtype(weights: DType, device: &Device) -> DType {
    match weights {
        DType::BF16 => DType::BF16,
        w => compute_dtype(w, device),
    }
}

/// The largest absolute difference between two tensors of one shape (tests).
#[cfg(test)]
pub(crate) fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .and_then(|d| d.abs()?.max_all()?.to_dtype(DType::F32)?.to_scalar::<f32>())
        .expect("tensors of one shape")
}

/// Values of a half-type projection widened at once on the tensor path (64 MiB of f32).
const WIDEN_MAX_VALUES: usize = 16 << 20;

/// `l` applied to `x` with its weights widened to `x`'s dtype, `max_values` of them at a time
/// (whole rows, at least one).
fn widened(l: &Linear, x: &Tensor, max_values: usize) -> candle_core::Result<Tensor> {
    let (d_out, d_in) = l.weight().dims2()?;
    let rows = (max_values / d_in).max(1);
    let mut parts = Vec::with_capacity(d_out.div_ceil(rows));
    for lo in (0..d_out).step_by(rows) {
        let n = rows.min(d_out - lo);
        let w = l.weight().narrow(0, lo, n)?.to_dtype(x.dtype())?;
        let b = l.bias().map(|b| b.narrow(0, lo, n)).transpose()?;
        parts.push(Linear::new(w, b).forward(x)?);
    }
    match parts.len() {
        1 => Ok(parts.remove(0)),
        _ => Tensor::cat(&parts, D::Minus1),
    }
}

/// A projection: dense (candle `Linear`, any float dtype) or quantized (GGUF blocks, candle's
/// quantized matmul; activations stay f32).
pub enum Lin {
    /// Dense weights.
    Dense(Linear),
    /// Quantized weights and an optional dense bias.
    Quantized(QMatMul, Option<Tensor>),
}

impl Module for Lin {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            // Half-type weights under f32 activations (the CPU): widened for this product only, so
            // they stay at half the memory. Decode steps read them in place (`project`); this
            // is prefill's path, where the copy costs little next to the arithmetic. A slice of
            // rows at a time, so a large output head (Qwen3's is 389M values) never stands
            // widened whole beside the model.
            Lin::Dense(l) if l.weight().dtype() != x.dtype() => widened(l, x, WIDEN_MAX_VALUES),
            Lin::Dense(l) => l.forward(x),
            Lin::Quantized(w, b) => {
                let y = w.forward(x)?;
                match b {
                    Some(b) => y.broadcast_add(b),
                    None => Ok(y),
                }
            }
        }
    }
}

/// Where the decoder's weights come from (HF names, without the `.weight` suffix except for
/// whole tensors).
trait Weights {
    fn linear(&self, name: &str, d_in: usize, d_out: usize, bias: bool) -> Result<Lin, ModelError>;
    fn norm(&self, name: &str, size: usize, eps: f64) -> Result<RmsNorm, ModelError>;
    fn dense(&self, name: &str, shape: (usize, usize)) -> Result<Tensor, ModelError>;
    /// The output head when it shares the embedding matrix `name` (dense: `embed`).
    fn tied_head(&self, name: &str, embed: Tensor) -> Result<Lin, ModelError>;
}

/// Dense checkpoint tensors: projections and the embedding in the VarBuilder's dtype, biases
/// and norms (small, and added to or multiplied with activations) in the compute dtype `act`.
struct Dense<'a> {
    vb: VarBuilder<'a>,
    act: DType,
}

impl Weights for Dense<'_> {
    fn linear(&self, name: &str, d_in: usize, d_out: usize, bias: bool) -> Result<Lin, ModelError> {
        let l = linear_b(d_in, d_out, bias, self.vb.pp(name))?;
        let b = l.bias().map(|b| b.to_dtype(self.act)).transpose()?;
        Ok(Lin::Dense(Linear::new(l.weight().clone(), b)))
    }
    fn norm(&self, name: &str, size: usize, eps: f64) -> Result<RmsNorm, ModelError> {
        let w = self.vb.pp(name).get(size, "weight")?.to_dtype(self.act)?;
        Ok(RmsNorm::new(w, eps))
    }
    fn dense(&self, name: &str, shape: (usize, usize)) -> Result<Tensor, ModelError> {
        Ok(self.vb.get(shape, name)?)
    }
    fn tied_head(&self, _: &str, embed: Tensor) -> Result<Lin, ModelError> {
        Ok(Lin::Dense(Linear::new(embed, None)))
    }
}

struct Quantized(std::collections::HashMap<String, QTensor>, Device);

impl Quantized {
    fn take(&self, name: &str) -> Result<&QTensor, ModelError> {
        self.0
            .get(name)
            .ok_or_else(|| ModelError::Config(format!("GGUF has no tensor for {name}")))
    }
    fn deq(&self, name: &str) -> Result<Tensor, ModelError> {
        Ok(self.take(name)?.dequantize(&self.1)?)
    }
}

impl Weights for Quantized {
    fn linear(&self, name: &str, d_in: usize, d_out: usize, bias: bool) -> Result<Lin, ModelError> {
        let q = self.take(&format!("{name}.weight"))?;
        if q.shape().dims() != [d_out, d_in] {
            return Err(ModelError::Config(format!(
                "{name}: GGUF shape {:?}, expected [{d_out}, {d_in}]",
                q.shape().dims()
            )));
        }
        let w = QMatMul::from_arc(std::sync::Arc::new(requantized(q)?))?;
        let b = if bias {
            Some(self.deq(&format!("{name}.bias"))?)
        } else {
            None
        };
        Ok(Lin::Quantized(w, b))
    }
    fn norm(&self, name: &str, _: usize, eps: f64) -> Result<RmsNorm, ModelError> {
        Ok(RmsNorm::new(self.deq(&format!("{name}.weight"))?, eps))
    }
    fn dense(&self, name: &str, _: (usize, usize)) -> Result<Tensor, ModelError> {
        self.deq(name)
    }
    fn tied_head(&self, name: &str, _: Tensor) -> Result<Lin, ModelError> {
        Ok(Lin::Quantized(
            QMatMul::from_arc(std::sync::Arc::new(requantized(self.take(name)?)?))?,
            None,
        ))
    }
}

/// A copy of a quantized tensor (the map keeps the original for dequantized uses).
fn requantized(q: &QTensor) -> Result<QTensor, ModelError> {
    let storage = candle_core::quantized::QStorage::from_data(q.data()?, &q.device(), q.dtype())?;
    Ok(QTensor::new(storage, q.shape().clone())?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tensor path over half-type weights, widened a slice of rows at a time, equals the
    /// product with the weights widened whole: slices that divide the rows and one that does
    /// not, with a bias, for bf16 and f16.
    #[test]
    fn widened_slices_match_the_whole_product() {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (37, 8), &dev).unwrap();
        let b = Tensor::randn(0f32, 1.0, 37, &dev).unwrap();
        let x = Tensor::randn(0f32, 1.0, (5, 8), &dev).unwrap();
        for narrow in [DType::BF16, DType::F16] {
            let held = Linear::new(w.to_dtype(narrow).unwrap(), Some(b.clone()));
            let whole = Linear::new(held.weight().to_dtype(DType::F32).unwrap(), Some(b.clone()))
                .forward(&x)
                .unwrap();
            for max_values in [8, 80, 37 * 8, 1 << 20] {
                let got = widened(&held, &x, max_values).unwrap();
                assert_eq!(got.dims(), [5, 37]);
                let err = max_abs_diff(&got, &whole);
                // The same 8 products per output in any blocking: ~1e-7; a shifted or
                // missing slice is ~1.
                assert!(err < 1e-5, "{narrow:?}, {max_values} values a slice: {err}");
            }
        }
    }

    /// A small random Qwen3 (GQA, q/k norm) with room for long sequences.
    fn random_qwen3(max_pos: usize) -> Decoder {
        let cfg = ModelConfig::from_json(serde_json::json!({
            "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "rms_norm_eps": 1e-6, "vocab_size": 50,
            "max_position_embeddings": max_pos, "tie_word_embeddings": true
        }))
        .unwrap();
        let dev = Device::Cpu;
        let r = |s: (usize, usize)| Tensor::randn(0f32, 0.2, s, &dev).unwrap();
        let ones = |n: usize| Tensor::ones(n, DType::F32, &dev).unwrap();
        let mut t = std::collections::HashMap::new();
        t.insert("model.embed_tokens.weight".to_string(), r((50, 64)));
        t.insert("model.norm.weight".to_string(), ones(64));
        for l in 0..2 {
            let p = |s: &str| format!("model.layers.{l}.{s}");
            for (n, s) in [
                ("self_attn.q_proj.weight", (64, 64)),
                ("self_attn.k_proj.weight", (32, 64)),
                ("self_attn.v_proj.weight", (32, 64)),
                ("self_attn.o_proj.weight", (64, 64)),
                ("mlp.gate_proj.weight", (96, 64)),
                ("mlp.up_proj.weight", (96, 64)),
                ("mlp.down_proj.weight", (64, 96)),
            ] {
                t.insert(p(n), r(s));
            }
            for n in ["input_layernorm.weight", "post_attention_layernorm.weight"] {
                t.insert(p(n), ones(64));
            }
            for n in ["self_attn.q_norm.weight", "self_attn.k_norm.weight"] {
                t.insert(p(n), ones(16));
            }
        }
        Decoder::new(cfg, VarBuilder::from_tensors(t, DType::F32, &dev)).unwrap()
    }

    /// The host path's two ways of attending agree past a growth of the token-major cache:
    /// 300 decode steps one token at a time (the fused kernel over the cache as it grows) give
    /// the logits one 308-token prefill gives (gemm over the same cache), within 1e-4 of their
    /// scale (f32, summation order only); and a short row decoding beside a long prefill in
    /// the same batch is unaffected by it.
    #[test]
    fn decode_over_a_growing_host_cache_equals_one_prefill() {
        let m = random_qwen3(1024);
        let toks: Vec<u32> = (0..308u32).map(|i| (i * 7 + 3) % 50).collect();
        let fwd = |rows: &mut [Row<'_>]| m.forward(rows).unwrap();
        let mut stepped = SeqCache::default();
        let mut last = fwd(&mut [Row {
            tokens: &toks[..8],
            cache: &mut stepped,
            adapter: None,
        }]);
        for i in 8..toks.len() {
            last = fwd(&mut [Row {
                tokens: &toks[i..i + 1],
                cache: &mut stepped,
                adapter: None,
            }]);
        }
        assert_eq!(stepped.len(), 308);
        let (mut whole, mut side) = (SeqCache::default(), SeqCache::default());
        fwd(&mut [Row {
            tokens: &toks[..3],
            cache: &mut side,
            adapter: None,
        }]);
        let both = fwd(&mut [
            Row {
                tokens: &toks,
                cache: &mut whole,
                adapter: None,
            },
            Row {
                tokens: &toks[3..4],
                cache: &mut side,
                adapter: None,
            },
        ]);
        let alone = fwd(&mut [Row {
            tokens: &toks[..4],
            cache: &mut SeqCache::default(),
            adapter: None,
        }]);
        let rel = |a: &Tensor, b: &Tensor| {
            let d = (a - b).unwrap().abs().unwrap().max_all().unwrap();
            let s = b.abs().unwrap().max_all().unwrap();
            d.to_scalar::<f32>().unwrap() / s.to_scalar::<f32>().unwrap()
        };
        assert!(
            rel(&last[0], &both[0]) < 1e-4,
            "{}",
            rel(&last[0], &both[0])
        );
        assert!(
            rel(&both[1], &alone[0]) < 1e-4,
            "{}",
            rel(&both[1], &alone[0])
        );

        // The tensor ops (what GPUs run) over the same steps agree too, and a cache filled in
        // one mode is refused by the other rather than read wrongly.
        let mut m = m;
        m.set_host_kernels(false);
        let mut cache = SeqCache::default();
        let step = |m: &Decoder, t: &[u32], cache: &mut SeqCache| {
            m.forward(&mut [Row {
                tokens: t,
                cache,
                adapter: None,
            }])
        };
        let mut ops = step(&m, &toks[..8], &mut cache).unwrap();
        for i in 8..toks.len() {
            ops = step(&m, &toks[i..i + 1], &mut cache).unwrap();
        }
        let err = rel(&ops[0], &last[0]);
        assert!(err < 1e-4, "{err}");
        m.set_host_kernels(true);
        assert!(step(&m, &toks[..1], &mut cache).is_err());
    }
}
