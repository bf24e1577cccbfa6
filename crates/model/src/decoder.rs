//! The decoder: embedding, layers, final norm and output head, run over a batch of rows that
//! each bring their own cache, position and adapter. How a step reaches the layers (the caches,
//! the pools, the prefix cache) is its step backend's ([`super::backend`]).

use std::path::Path;

use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{RmsNorm, VarBuilder};

use super::backend::{self, BackendKind, Shape, StepBackend};
use super::batch::{Batch, Row, StepPath};
use super::cache::{mixed_cache, SeqCache};
use super::kv::TensorPathOptions;
use super::layer::Layer;
use super::prefix::BlockHash;
use super::project;
use super::rope::RotaryTable;
use super::step;
use super::vision::{ImageEmbeds, VisionTower};
use super::weights::{compute_dtype, Dense, Embed, Prequantized, Quantized, Weights};
use super::{HostUpdates, Lin, ModelConfig, ModelError};
use mole_formats::hf;
use mole_kernels as kernels;

/// The decoder: the weights and the layer math, and the step backend that runs them.
pub struct Decoder {
    cfg: ModelConfig,
    embed: Embed,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Lin,
    rotary: RotaryTable,
    device: Device,
    dtype: DType,
    /// The dtype of the projections and the embedding.
    weights: DType,
    /// How the projections are held when quantized (e.g. "GGUF Q4_1", "AWQ 4-bit, group
    /// size 128, as Q4_1 blocks").
    quantization: Option<String>,
    /// A vision-language model's vision tower.
    vision: Option<VisionTower>,
    /// How steps run: the host or the paged backend, with its caches and pools.
    backend: Box<dyn StepBackend>,
}

/// What a step computed: the rows' logits and, on the device, the caller's extra inputs.
pub struct StepOutput {
    /// `[rows, vocab]` f32: each row's logits at its last new position.
    pub logits: Tensor,
    /// The `extra` given to [`Decoder::forward_step`], `[len]` f32 on the device (None when
    /// empty).
    pub extra: Option<Tensor>,
}

/// Per row with image tokens in this step: where they are among the step's tokens, which rows
/// of its embeddings they take, and the embeddings.
fn image_indices<'r>(
    rows: &[Row<'r>],
) -> candle_core::Result<(step::ImageIndices, Vec<&'r ImageEmbeds>)> {
    let mut indices = Vec::new();
    let mut embeds = Vec::new();
    let mut off = 0u32;
    for r in rows {
        if let Some(v) = r.vision.filter(|v| !v.image_tokens.is_empty()) {
            let Some(e) = v.embeds else {
                candle_core::bail!("a row's image placeholders came without their embeddings");
            };
            let at = v.image_tokens.iter().map(|(i, _)| off + i).collect();
            let of = v.image_tokens.iter().map(|(_, e)| *e).collect();
            indices.push((at, of));
            embeds.push(e);
        }
        off += r.tokens.len() as u32;
    }
    Ok((indices, embeds))
}

/// Each row's image placeholders on the device beside its embeddings.
fn attach(
    images: Vec<(Tensor, Tensor)>,
    embeds: Vec<&ImageEmbeds>,
) -> Vec<(Tensor, Tensor, &ImageEmbeds)> {
    images
        .into_iter()
        .zip(embeds)
        .map(|((at, of), e)| (at, of, e))
        .collect()
}

impl Decoder {
    /// Loads an HF directory (safetensors, sharded or not) in `dtype` on `device`.
    /// An AWQ or GPTQ checkpoint (`quantization_config` in config.json) keeps its projections
    /// 4-bit, repacked into Q4_1 blocks (see [`mole_formats::quant::blocks`]); the rest of it
    /// loads in `dtype`.
    pub fn load(dir: &Path, dtype: DType, device: &Device) -> Result<Self, ModelError> {
        let raw = hf::read_config(dir)?;
        let scheme =
            mole_formats::quant::scheme(&raw).map_err(ModelError::UnsupportedQuantization)?;
        let cfg = ModelConfig::from_json(raw)?;
        let files = hf::safetensors_files(dir)?;
        let vb = mole_formats::safetensors::ReadTensors::var_builder(&files, dtype, device)?;
        match scheme {
            None => Self::new(cfg, vb),
            Some(scheme) => {
                let blocks = mole_formats::quant::blocks::load_blocks(&files, scheme, device)
                    .map_err(|e| match e {
                        mole_formats::quant::blocks::QuantError::Unsupported(why) => {
                            ModelError::UnsupportedQuantization(why)
                        }
                        e => ModelError::Config(format!("{}: {e}", scheme.format.name())),
                    })?;
                let act = compute_dtype(dtype, device);
                let w = Prequantized {
                    blocks,
                    dense: Dense { vb, act },
                };
                let quantization = format!(
                    "{} 4-bit, group size {}, as Q4_1 blocks",
                    scheme.format.name(),
                    scheme.group_size
                );
                Self::build(cfg, &w, device.clone(), (dtype, act), Some(quantization))
            }
        }
    }

    /// Builds the decoder from a VarBuilder rooted at the checkpoint's top level. The
    /// projections and the embedding keep the VarBuilder's dtype; on the CPU, bf16 weights
    /// compute in f32 (see [`compute_dtype`]).
    pub fn new(cfg: ModelConfig, vb: VarBuilder) -> Result<Self, ModelError> {
        let device = vb.device().clone();
        let dtype = compute_dtype(vb.dtype(), &device);
        let weights = vb.dtype();
        let vision = match &cfg.vision {
            // The tower computes in the compute dtype (f32 on the CPU).
            Some(v) => Some(VisionTower::new(
                &v.config,
                vb.clone().set_dtype(dtype).pp("model.visual"),
            )?),
            None => None,
        };
        let dense = Dense { vb, act: dtype };
        let mut decoder = Self::build(cfg, &dense, device, (weights, dtype), None)?;
        decoder.vision = vision;
        Ok(decoder)
    }

    /// A vision-language model's vision tower.
    pub fn vision(&self) -> Option<&VisionTower> {
        self.vision.as_ref()
    }

    /// Builds the decoder from GGUF tensors already renamed to HF names (rows of llama Q/K
    /// un-permuted): projections stay quantized (candle's quantized matmul), norms and the
    /// embedding table are dequantized to f32.
    pub fn from_quantized(
        cfg: ModelConfig,
        tensors: std::collections::HashMap<String, QTensor>,
        device: &Device,
    ) -> Result<Self, ModelError> {
        let mut types: Vec<String> = tensors
            .values()
            .filter(|t| t.rank() == 2)
            .map(|t| format!("{:?}", t.dtype()))
            .collect();
        types.sort();
        types.dedup();
        Self::build(
            cfg,
            &Quantized(std::cell::RefCell::new(tensors), device.clone()),
            device.clone(),
            (DType::F32, DType::F32),
            Some(format!("GGUF {}", types.join("+"))),
        )
    }

    /// Loads a `mole-worker quantize` output: config.json as in any HF directory, and the
    /// weights of its one GGUF file under their HF names
    /// ([`mole_formats::gguf::QUANTIZED_FILE`]), served as [`Decoder::from_quantized`]
    /// serves a GGUF base (projections in their blocks, norms and embedding in f32).
    pub fn load_quantized_dir(dir: &Path, device: &Device) -> Result<Self, ModelError> {
        let file = dir.join(mole_formats::gguf::QUANTIZED_FILE);
        let tensors = mole_formats::gguf::load_hf_named(&file, device)
            .map_err(|e| ModelError::Config(e.to_string()))?;
        Self::from_quantized(ModelConfig::from_dir(dir)?, tensors, device)
    }

    /// The decoder over `w`, with `dtypes` those of the weights and of compute, on its default
    /// backend (see [`Self::configure`]).
    fn build(
        cfg: ModelConfig,
        w: &dyn Weights,
        device: Device,
        (weights, dtype): (DType, DType),
        quantization: Option<String>,
    ) -> Result<Self, ModelError> {
        cfg.family()?;
        let h = cfg.hidden_size;
        let prefix = cfg.text_prefix();
        let embed_name = format!("{prefix}.embed_tokens.weight");
        let embed = w.embedding(&embed_name, (cfg.vocab_size, h))?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| Layer::new(&cfg, w, i))
            .collect::<Result<_, _>>()?;
        let norm = w.norm(&format!("{prefix}.norm"), h, cfg.rms_norm_eps)?;
        let lm_head = if cfg.tie_word_embeddings {
            w.tied_head(&embed_name, &embed)?
        } else {
            w.linear("lm_head", h, cfg.vocab_size, false)?
        };
        let rotary = RotaryTable::new(&cfg, dtype, &device)?;
        if device.is_cpu() && dtype == DType::F32 {
            // Which kernel multiplies decode steps decides CPU speed (1.5-2x between the direct
            // kernel and gemm): say it once per model.
            let base_product = match kernels::dense::available() {
                Some(kernels::cpu::Isa::Avx512) => "direct AVX-512",
                Some(kernels::cpu::Isa::Avx2) => "direct AVX2",
                // dense::available picks AVX-512, AVX2 or nothing.
                Some(_) | None => "gemm",
            };
            let weights = weights.as_str();
            tracing::info!(base_product, weights, "CPU decode in f32 on host kernels");
        }
        let opts = TensorPathOptions::default();
        let shape = shape(&cfg, &device, dtype, weights, quantization.is_some(), &opts);
        let mut decoder = Self {
            cfg,
            embed,
            layers,
            norm,
            lm_head,
            rotary,
            device,
            dtype,
            weights,
            quantization,
            vision: None,
            backend: backend::choose(BackendKind::default(), shape, opts),
        };
        decoder.fuse_projections()?;
        Ok(decoder)
    }

    /// Picks the backend steps run on and sizes its pools (the KV blocks and the LoRA slots,
    /// allocated by the first steps that need them), before the first step: the host kernels
    /// (`BackendKind::Host`, the default) run only on the CPU in f32, any other device or
    /// dtype runs the paged backend whatever is asked. The tests run both on the CPU against
    /// the same references, so a GPU's path is checked there too. A new backend starts with
    /// empty pools and an empty prefix cache, and refuses caches the other kind filled.
    pub fn configure(&mut self, kind: BackendKind, opts: TensorPathOptions) {
        let quantized = self.quantization.is_some();
        let shape = shape(
            &self.cfg,
            &self.device,
            self.dtype,
            self.weights,
            quantized,
            &opts,
        );
        self.backend = backend::choose(kind, shape, opts);
        self.fuse_projections()
            .expect("fusing and splitting loaded weights only copies them");
    }

    /// The backend steps run on.
    pub fn backend_kind(&self) -> BackendKind {
        self.backend.kind()
    }

    /// How the pools are sized.
    pub fn tensor_path(&self) -> &TensorPathOptions {
        self.backend.options()
    }

    /// The dtype the KV cache holds keys and values in, on either backend: the pool's setting
    /// (`kvCacheDtype`), else the weights' dtype, as vLLM's `--kv-cache-dtype auto`, and for
    /// a quantized base f16, llama.cpp's default cache type (its weights have no float dtype
    /// of their own). On the CPU's host backend, where the weights are bf16 or f16 and the
    /// activations f32, a half-type cache holds half the bytes and each decode step reads
    /// half of them, at the price of rounding each key and value once.
    pub fn kv_dtype(&self) -> DType {
        self.backend.kv_dtype()
    }

    /// Free KV blocks of the paged backend's pool (all of them before its first step).
    pub fn free_blocks(&self) -> usize {
        self.backend.free_blocks()
    }

    /// The paged backend multiplies q/k/v and gate/up as one matrix each; the host backend
    /// reads them apart.
    fn fuse_projections(&mut self) -> candle_core::Result<()> {
        let fused = self.backend.kind().fuses_projections();
        for l in &mut self.layers {
            l.fuse(fused)?;
        }
        Ok(())
    }

    /// The dtype of the projections and the embedding (the GGUF path: f32, what its
    /// dequantized parts hold).
    pub fn weight_dtype(&self) -> DType {
        self.weights
    }

    /// The bytes the weights hold on the device as loaded: quantized projections as their
    /// blocks, dense ones, the embedding and the head in their dtype (a head tied to the
    /// embedding counted once where it shares its tensor), the norms in the compute dtype.
    /// The vision tower, when there is one, is not counted.
    pub fn weight_bytes(&self) -> u64 {
        // A tied head is the embedding's tensor or blocks themselves (`Weights::tied_head`),
        // but for a GPU's GGUF base, whose table is dequantized beside the head's blocks.
        let shared_head = self.cfg.tie_word_embeddings
            && (matches!(&self.lm_head, Lin::Dense(_))
                || matches!(self.embed, Embed::Quantized(_)));
        let head = if shared_head { 0 } else { self.lm_head.bytes() };
        let norms = (2 * self.layers.len() as u64 + 1)
            * self.cfg.hidden_size as u64
            * self.dtype.size_in_bytes() as u64;
        self.embed.bytes() + head + norms + self.layers.iter().map(|l| l.bytes()).sum::<u64>()
    }

    /// How the projections are held when quantized (None: dense, [`Self::weight_dtype`]).
    pub fn quantization(&self) -> Option<&str> {
        self.quantization.as_deref()
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
        let logits = self.forward_batch(rows)?;
        Ok((0..rows.len())
            .map(|i| logits.get(i))
            .collect::<Result<_, _>>()?)
    }

    /// As [`Decoder::forward`], the rows' logits as one `[rows, vocab]` f32 tensor: what a
    /// step brings back from the device, in one copy.
    pub fn forward_batch(&self, rows: &mut [Row<'_>]) -> Result<Tensor, ModelError> {
        Ok(self.forward_step(rows, &[])?.logits)
    }

    /// As [`Decoder::forward_batch`], with `extra`: the caller's own f32 inputs to the step
    /// (the engine's sampling parameters), uploaded on the tensor path in the step's one copy
    /// and handed back on the device as [`StepOutput::extra`].
    pub fn forward_step(
        &self,
        rows: &mut [Row<'_>],
        extra: &[f32],
    ) -> Result<StepOutput, ModelError> {
        // A CPU step forks the thread pool a few times per layer (projections, attention).
        // Forked from a pool thread, a fork is a push on that thread's own queue; from any
        // other thread, each one hands the work over and sleeps until it is done (tens of
        // microseconds each, most of a dynamic adapter's cost at batch 1), so the whole step
        // runs on the pool.
        if self.device.is_cpu() && rayon::current_thread_index().is_none() {
            return rayon::scope(|_| self.forward_on_pool(rows, extra));
        }
        self.forward_on_pool(rows, extra)
    }

    fn forward_on_pool(
        &self,
        rows: &mut [Row<'_>],
        extra: &[f32],
    ) -> Result<StepOutput, ModelError> {
        self.check(rows)?;
        let (indices, embeds) = image_indices(rows)?;
        self.backend.reserve(rows)?;
        let step = self.backend.prepare(rows, &self.rotary, &indices, extra)?;
        let images = attach(step.images, embeds);
        let x = self.layers(rows, &step.batch, &step.ids, &images)?;
        // Only each row's last position needs logits.
        let h = self.norm.forward(&x.index_select(&step.last, 0)?)?;
        let on_host = match step.batch.path {
            StepPath::Host { .. } => {
                project::host_projections(&h, vec![(&self.lm_head, HostUpdates::none())])?
            }
            StepPath::Tensor { .. } => None,
        };
        let logits = match on_host.and_then(|mut l| l.pop()) {
            Some(l) => l,
            None => self.lm_head.forward(&h)?.to_dtype(DType::F32)?,
        };
        Ok(StepOutput {
            logits,
            extra: step.extra,
        })
    }

    /// The embedded tokens through every layer; each row's cache then holds them. Image
    /// placeholders take their image's embeddings, and after the first layers their DeepStack
    /// features are added.
    fn layers(
        &self,
        rows: &mut [Row<'_>],
        batch: &Batch<'_>,
        ids: &Tensor,
        images: &[(Tensor, Tensor, &ImageEmbeds)],
    ) -> Result<Tensor, ModelError> {
        let x = self.embed.forward(ids)?.to_dtype(self.dtype)?; // [T, h]
        for (at, rows_of, embeds) in images {
            let e = embeds
                .merged
                .index_select(rows_of, 0)?
                .to_dtype(self.dtype)?;
            x.scatter_set(at, &e, 0)?;
        }
        let mut x = x;
        for (li, layer) in self.layers.iter().enumerate() {
            x = layer.forward(x, rows, batch)?;
            for (at, rows_of, embeds) in images {
                if let Some(d) = embeds.deepstack.get(li) {
                    let d = d.index_select(rows_of, 0)?.to_dtype(self.dtype)?;
                    x.scatter_add_set(at, &d, 0)?;
                }
            }
        }
        for (r, (s, l)) in rows.iter_mut().zip(batch.starts.iter().zip(&batch.lens)) {
            r.cache.len = s + l;
            if let Some(v) = &r.vision {
                r.cache.pos_offset = v.offset;
            }
        }
        Ok(x)
    }

    /// Checks that every row has tokens, fits the model's positions, and has a cache of this
    /// decoder's backend.
    fn check(&self, rows: &[Row<'_>]) -> Result<(), ModelError> {
        for r in rows {
            let end = r.cache.len() + r.tokens.len();
            if r.tokens.is_empty() {
                return Err(ModelError::Config("a row has no tokens".into()));
            }
            if end > self.cfg.max_positions() {
                return Err(ModelError::Config(format!(
                    "sequence of {end} tokens exceeds the model's {} positions",
                    self.cfg.max_positions()
                )));
            }
            if !self.backend.holds(r.cache) {
                return Err(mixed_cache());
            }
        }
        Ok(())
    }

    /// Starts the empty `cache` with the longest run of `hashes` from the first that the
    /// prefix cache holds (`hashes[i]` is the hash of the sequence's block `i`, see
    /// [`BlockHash`]): on the paged backend those blocks are shared, held by the cache until it
    /// drops; on the host backend they are read in place from the store. On the host backend,
    /// with `tokens` given (the tokens that may be reused: the context but its last token,
    /// found by their tokens only when they hold no image), the block after them is then
    /// looked for by its tokens under `seed`'s chain, and its leading tokens in common are
    /// copied too. Returns the tokens the cache then holds.
    pub fn reuse_prefix(
        &self,
        cache: &mut SeqCache,
        hashes: &[BlockHash],
        seed: BlockHash,
        tokens: Option<&[u32]>,
    ) -> Result<usize, ModelError> {
        if !cache.is_empty() || (hashes.is_empty() && tokens.is_none_or(<[u32]>::is_empty)) {
            return Ok(0);
        }
        self.backend.reuse_prefix(cache, hashes, seed, tokens)
    }

    /// Tells the prefix cache the hashes of `cache`'s full blocks it has not been told
    /// (`hashes[i]` is block `i`'s; blocks the cache does not hold whole are left out), so
    /// that later sequences reuse them: on the paged backend the blocks themselves, kept when
    /// the cache drops until the pool needs them; on the host backend a copy in a store of at
    /// most `kv_blocks` blocks, least recently used evicted, findable also by its tokens
    /// (`tokens`: the sequence's, when they hold no image) after the block before it (the
    /// chain's `seed` for the first).
    pub fn store_prefix(
        &self,
        cache: &mut SeqCache,
        hashes: &[BlockHash],
        seed: BlockHash,
        tokens: Option<&[u32]>,
    ) -> Result<(), ModelError> {
        self.backend.store_prefix(cache, hashes, seed, tokens)
    }

    /// Offers the prefix cache a finished sequence's last, partial block (its tokens after
    /// its full blocks, whose hashes are `hashes`), findable by `tokens` after the block
    /// before it (host backend; the paged backend caches full blocks only, as vLLM does). Its
    /// full blocks must have been offered first ([`Self::store_prefix`]).
    pub fn store_partial(
        &self,
        cache: &SeqCache,
        hashes: &[BlockHash],
        seed: BlockHash,
        tokens: &[u32],
    ) {
        self.backend.store_partial(cache, hashes, seed, tokens);
    }

    /// Blocks the prefix cache holds that no sequence holds (the paged pool's cached free
    /// blocks; every block of the host store).
    pub fn cached_blocks(&self) -> usize {
        self.backend.cached_blocks()
    }

    /// A cache for another choice of the prompt in `cache`: at most its first `tokens` tokens,
    /// shared on the paged backend (its whole blocks among them, no copy), on the host backend
    /// its shared blocks shared again and the rest copied. Returns it and the tokens it holds;
    /// the new sequence computes the rest itself.
    pub fn fork_cache(&self, cache: &SeqCache, tokens: usize) -> (SeqCache, usize) {
        self.backend.fork_cache(cache, tokens)
    }
}

/// What a backend needs of the model: its configuration, device and compute dtype, and the
/// dtype its caches hold: the pool's setting (`kvCacheDtype`), else the weights' dtype, and
/// for a quantized base f16 (see [`Decoder::kv_dtype`]).
fn shape(
    cfg: &ModelConfig,
    device: &Device,
    dtype: DType,
    weights: DType,
    quantized: bool,
    opts: &TensorPathOptions,
) -> Shape {
    Shape {
        kv: opts.kv_dtype.unwrap_or(match quantized {
            true => DType::F16,
            false => weights,
        }),
        cfg: cfg.clone(),
        device: device.clone(),
        dtype,
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use crate::SeqCache;

    /// A small random Qwen3 (GQA, q/k norm) with room for long sequences; its weights are the
    /// same in every run (seeded), so a bound measured on it is measured once.
    fn random_qwen3(max_pos: usize) -> Decoder {
        let cfg = ModelConfig::from_json(serde_json::json!({
            "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "rms_norm_eps": 1e-6, "vocab_size": 50,
            "max_position_embeddings": max_pos, "tie_word_embeddings": true
        }))
        .unwrap();
        let dev = Device::Cpu;
        // xorshift64*, values near N(0, 0.2²) as a sum of four uniforms.
        let state = std::cell::Cell::new(0x9E37_79B9_7F4A_7C15u64);
        let uniform = || {
            let mut x = state.get();
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            state.set(x);
            (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / (1u64 << 24) as f32
        };
        let r = |s: (usize, usize)| {
            let v: Vec<f32> = (0..s.0 * s.1)
                .map(|_| ((0..4).map(|_| uniform()).sum::<f32>() - 2.0) * 0.2 / 0.577)
                .collect();
            Tensor::from_vec(v, s, &dev).unwrap()
        };
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

    /// The caller's extra inputs come back unchanged on either path (on the tensor path from
    /// the step's one upload, after the indices), and do not change the logits.
    #[test]
    fn a_steps_extra_inputs_come_back_as_given() {
        let extra = [1.5f32, -3.25, 0.0, 1e-7, 16_777_217.0, f32::MAX];
        for host in [true, false] {
            let mut m = random_qwen3(64);
            m.configure(BackendKind::host_if(host), TensorPathOptions::default());
            let toks = [3u32, 9, 27, 4];
            // (Uploads are counted in tests/op_count/op_count_transfers.rs, where nothing runs beside.)
            let run = |extra: &[f32]| {
                let mut cache = SeqCache::default();
                m.forward_step(
                    &mut [Row {
                        tokens: &toks,
                        cache: &mut cache,
                        adapter: None,
                        vision: None,
                    }],
                    extra,
                )
                .unwrap()
            };
            let (with, without) = (run(&extra), run(&[]));
            assert!(without.extra.is_none());
            let back = with.extra.unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(back, extra, "host kernels {host}");
            let d = crate::max_abs_diff(&with.logits, &without.logits);
            assert_eq!(d, 0.0, "host kernels {host}");
        }
    }

    /// The model with its KV cache in `kv`.
    fn with_kv(mut m: Decoder, kv: DType) -> Decoder {
        m.configure(
            BackendKind::Host,
            TensorPathOptions {
                kv_dtype: Some(kv),
                ..Default::default()
            },
        );
        assert_eq!(m.kv_dtype(), kv);
        m
    }

    /// The host path's two ways of attending agree past a growth of the token-major cache:
    /// 300 decode steps one token at a time (the fused kernel over the cache as it grows) give
    /// the logits one 308-token prefill gives (gemm over the same cache), within 1e-4 of their
    /// scale (f32, summation order only); and a short row decoding beside a long prefill in
    /// the same batch is unaffected by it. The same holds with the cache in bf16 or f16: every
    /// read, the step's own tokens included, sees the rounded values the cache holds, on both
    /// paths (the tensor path's pool rounds them alike), so rounding adds no disagreement.
    #[test]
    fn decode_over_a_growing_host_cache_equals_one_prefill() {
        for kv in [DType::F32, DType::BF16, DType::F16] {
            growing_cache_case(kv);
        }
    }

    fn growing_cache_case(kv: DType) {
        let m = with_kv(random_qwen3(1024), kv);
        let toks: Vec<u32> = (0..308u32).map(|i| (i * 7 + 3) % 50).collect();
        let fwd = |rows: &mut [Row<'_>]| m.forward(rows).unwrap();
        let mut stepped = SeqCache::default();
        let mut last = fwd(&mut [Row {
            tokens: &toks[..8],
            cache: &mut stepped,
            adapter: None,
            vision: None,
        }]);
        for i in 8..toks.len() {
            last = fwd(&mut [Row {
                tokens: &toks[i..i + 1],
                cache: &mut stepped,
                adapter: None,
                vision: None,
            }]);
        }
        assert_eq!(stepped.len(), 308);
        let (mut whole, mut side) = (SeqCache::default(), SeqCache::default());
        fwd(&mut [Row {
            tokens: &toks[..3],
            cache: &mut side,
            adapter: None,
            vision: None,
        }]);
        let both = fwd(&mut [
            Row {
                tokens: &toks,
                cache: &mut whole,
                adapter: None,
                vision: None,
            },
            Row {
                tokens: &toks[3..4],
                cache: &mut side,
                adapter: None,
                vision: None,
            },
        ]);
        let alone = fwd(&mut [Row {
            tokens: &toks[..4],
            cache: &mut SeqCache::default(),
            adapter: None,
            vision: None,
        }]);
        let rel = |a: &Tensor, b: &Tensor| {
            let d = (a - b).unwrap().abs().unwrap().max_all().unwrap();
            let s = b.abs().unwrap().max_all().unwrap();
            d.to_scalar::<f32>().unwrap() / s.to_scalar::<f32>().unwrap()
        };
        assert!(
            rel(&last[0], &both[0]) < 1e-4,
            "{kv:?}: {}",
            rel(&last[0], &both[0])
        );
        assert!(
            rel(&both[1], &alone[0]) < 1e-4,
            "{kv:?}: {}",
            rel(&both[1], &alone[0])
        );

        // The tensor ops (what GPUs run) over the same steps agree too, and a cache filled in
        // one mode is refused by the other rather than read wrongly.
        let mut m = m;
        m.configure(BackendKind::Paged, m.tensor_path().clone());
        let mut cache = SeqCache::default();
        let step = |m: &Decoder, t: &[u32], cache: &mut SeqCache| {
            m.forward(&mut [Row {
                tokens: t,
                cache,
                adapter: None,
                vision: None,
            }])
        };
        let mut ops = step(&m, &toks[..8], &mut cache).unwrap();
        for i in 8..toks.len() {
            ops = step(&m, &toks[i..i + 1], &mut cache).unwrap();
        }
        let err = rel(&ops[0], &last[0]);
        assert!(err < 1e-4, "{kv:?}: {err}");
        m.configure(BackendKind::Host, m.tensor_path().clone());
        assert!(step(&m, &toks[..1], &mut cache).is_err());
    }

    /// On the host path a reused prefix is read in place from the prefix store, not copied: a
    /// second sequence of the same prompt holds none of its full blocks' bytes itself, and its
    /// answer is the first's (within 1e-4 of the logits' scale: the tokens after the blocks
    /// were computed in a step of another shape). A choice forked from it shares the blocks
    /// again and copies only the tokens after them.
    #[test]
    fn the_host_path_reads_a_reused_prefix_in_place() {
        let m = random_qwen3(256);
        assert_eq!(m.backend_kind(), BackendKind::Host);
        let bs = m.tensor_path().block_size.max(1);
        let toks: Vec<u32> = (0..(2 * bs + 8) as u32).map(|i| (i * 5 + 1) % 50).collect();
        let end = toks.len() - 1;
        let fwd = |t: &[u32], cache: &mut SeqCache| {
            m.forward(&mut [Row {
                tokens: t,
                cache,
                adapter: None,
                vision: None,
            }])
            .unwrap()
        };
        let mut first = SeqCache::default();
        fwd(&toks[..end], &mut first);
        let (hashes, seed) = ([11u128, 12], 7u128);
        m.store_prefix(&mut first, &hashes, seed, None).unwrap();
        let want = fwd(&toks[end..], &mut first);

        let mut second = SeqCache::default();
        let reused = m.reuse_prefix(&mut second, &hashes, seed, None).unwrap();
        assert_eq!(reused, 2 * bs);
        assert_eq!(second.own_bytes(), 0, "the reused blocks were copied");
        let got = fwd(&toks[2 * bs..], &mut second);
        let d = (&got[0] - &want[0])
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap();
        let s = want[0].abs().unwrap().max_all().unwrap();
        let rel = d.to_scalar::<f32>().unwrap() / s.to_scalar::<f32>().unwrap();
        assert!(rel < 1e-4, "{rel}");

        let (fork, held) = m.fork_cache(&second, end);
        assert_eq!(held, end);
        let width = m.cfg.kv_heads() * m.cfg.head_dim();
        let own = (end - 2 * bs) * width * 2 * m.layers.len() * std::mem::size_of::<f32>();
        assert_eq!(
            fork.own_bytes(),
            own,
            "a fork copies only the tokens after the blocks"
        );
        let forked = fwd(&toks[end..], &mut { fork });
        let d = (&forked[0] - &got[0])
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap();
        assert_eq!(
            d.to_scalar::<f32>().unwrap(),
            0.0,
            "a fork answers as its source"
        );
    }

    /// A bf16 or f16 KV cache holds exactly half the bytes of an f32 one, and moves the logits
    /// only by its rounding: each key and value is rounded once, relatively by at most its
    /// unit roundoff u (2^-8 for bf16's 8 significant bits, 2^-11 for f16's 11). A score q·k
    /// then moves by at most u of Σ|q_i k_i|, an attention output by u of its values' size
    /// plus the softmax's response to the scores, and 2 layers, the residual stream and the
    /// head carry the moves on. Bound: 4u of the logits' scale (1.6e-2 and 2.0e-3); measured
    /// 6.0e-3 (1.5u) and 1.0e-3 (2.1u) on this model, 1.3-2.2u on six unseeded ones. A cache that dropped or misplaced tokens moves
    /// them by tens of percent (the first version of this test, with two different random
    /// models: 2.06 of their scale).
    #[test]
    fn a_half_type_kv_cache_holds_half_the_bytes_and_moves_logits_by_its_rounding() {
        let toks: Vec<u32> = (0..80u32).map(|i| (i * 11 + 5) % 50).collect();
        // One model (its weights are random), its cache set anew for each dtype.
        let model = std::cell::RefCell::new(Some(random_qwen3(256)));
        let run = |kv: DType| {
            let m = with_kv(model.take().unwrap(), kv);
            let mut cache = SeqCache::default();
            let mut out = Vec::new();
            let fwd = |t: &[u32], cache: &mut SeqCache| {
                m.forward(&mut [Row {
                    tokens: t,
                    cache,
                    adapter: None,
                    vision: None,
                }])
                .unwrap()
                .remove(0)
            };
            out.push(fwd(&toks[..60], &mut cache));
            for i in 60..toks.len() {
                out.push(fwd(&toks[i..i + 1], &mut cache));
            }
            let bytes = cache.own_bytes();
            model.replace(Some(m));
            (out, bytes)
        };
        let (want, bytes) = run(DType::F32);
        for (kv, bound) in [
            (DType::BF16, 4.0 * 2f32.powi(-8)),
            (DType::F16, 4.0 * 2f32.powi(-11)),
        ] {
            let (got, half_bytes) = run(kv);
            assert_eq!(half_bytes * 2, bytes, "{kv:?}");
            let worst = got
                .iter()
                .zip(&want)
                .map(|(g, w)| {
                    let d = crate::max_abs_diff(g, w);
                    d / w
                        .abs()
                        .unwrap()
                        .max_all()
                        .unwrap()
                        .to_scalar::<f32>()
                        .unwrap()
                })
                .fold(0f32, f32::max);
            eprintln!("{kv:?} cache: logits moved by {worst:.2e} of their scale");
            assert!(
                worst > 0.0 && worst < bound,
                "{kv:?}: {worst} (bound {bound})"
            );
        }
    }
}
