//! LoRA adapters as the decoder applies them: per (layer, projection) `Aᵀ` and `s·B`, and
//! the two ways a batch's rows get their adapter's update — tensor ops per adapter group
//! ([`LoraAdapter::apply`], the path GPUs run) or, on the CPU, one host task list per
//! projection however many adapters the batch holds ([`HostUpdates`]). Reading and validating
//! PEFT files is the worker's `lora` module's.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};

use super::ModelConfig;
use mole_kernels::{self as kernels, Host, HostF32};

/// A projection of a decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Proj {
    /// q_proj.
    Q,
    /// k_proj.
    K,
    /// v_proj.
    V,
    /// o_proj.
    O,
    /// mlp.gate_proj.
    Gate,
    /// mlp.up_proj.
    Up,
    /// mlp.down_proj.
    Down,
}

impl Proj {
    /// Every projection, in order.
    pub const ALL: [Proj; 7] = [
        Proj::Q,
        Proj::K,
        Proj::V,
        Proj::O,
        Proj::Gate,
        Proj::Up,
        Proj::Down,
    ];

    /// The layer and projection of an HF module name (`model.layers.3.self_attn.q_proj`, or a
    /// Qwen3-VL's `model.language_model.layers.3.self_attn.q_proj`);
    /// None for modules outside the decoder layers' seven projections.
    pub fn parse(module: &str) -> Option<(usize, Proj)> {
        let rest = module
            .strip_prefix("model.layers.")
            .or_else(|| module.strip_prefix("model.language_model.layers."))?;
        let (layer, name) = rest.split_once('.')?;
        let p = match name {
            "self_attn.q_proj" => Proj::Q,
            "self_attn.k_proj" => Proj::K,
            "self_attn.v_proj" => Proj::V,
            "self_attn.o_proj" => Proj::O,
            "mlp.gate_proj" => Proj::Gate,
            "mlp.up_proj" => Proj::Up,
            "mlp.down_proj" => Proj::Down,
            _ => return None,
        };
        Some((layer.parse().ok()?, p))
    }

    /// (in, out) features of this projection.
    pub fn dims(self, c: &ModelConfig) -> (usize, usize) {
        let (h, q, kv, i) = (
            c.hidden_size,
            c.num_attention_heads * c.head_dim(),
            c.kv_heads() * c.head_dim(),
            c.intermediate_size,
        );
        match self {
            Proj::Q => (h, q),
            Proj::K | Proj::V => (h, kv),
            Proj::O => (q, h),
            Proj::Gate | Proj::Up => (h, i),
            Proj::Down => (i, h),
        }
    }
}

/// One loaded adapter version: per (layer, projection), `Aᵀ` `[in, r]` and `s·B` `[out, r]`
/// (scale folded in), row-major so that a token's update reads each matrix front to back
/// (see `kernels::lora::lora_impl`), with the rank padded with zeros to a multiple of
/// [`kernels::RANK_ALIGN`] (a no-op for the usual ranks 8, 16, 32, 64).
#[derive(Debug)]
pub struct LoraAdapter {
    /// Unique to a load for the life of the process (its copies on another device share it:
    /// the same weights): the tensor path's slot pool knows which adapter a slot holds by it
    /// (an address could be reused by a later adapter).
    id: u64,
    /// The identity of the weights for the prefix cache: the files they were read from as
    /// they were then (see [`LoraAdapter::with_weights_key`]), so that the same files loaded
    /// again find the blocks computed before; else unique to the load.
    weights_key: u128,
    modules: HashMap<(usize, Proj), (Tensor, Tensor)>,
    /// Modules of a vision tower (`Aᵀ`, `s·B`), by their path under `model.visual.`
    /// (`blocks.0.attn.qkv`, `merger.linear_fc1`...): applied when the tower encodes the
    /// images of this adapter's requests.
    vision: HashMap<String, (Tensor, Tensor)>,
    /// Per `layer · PROJS + proj`, where the host kernels read the module in place (None:
    /// absent, or not on the CPU in f32/bf16). A decode step looks up every adapter of its
    /// batch for every projection: through the tensors that is a chain of cold pointers and
    /// lock words per matrix (about 0.45 µs each, 1.5 ms of a 29 ms SmolLM2 step with 16
    /// adapters), here one entry.
    host: Vec<Option<HostModule>>,
    /// Every module is in `host`.
    all_host: bool,
    /// Highest rank over modules.
    pub rank: usize,
    /// Bytes of weights held.
    pub bytes: u64,
    /// What loading found worth a look though it loaded (see [`mole_api::LoraAdapterInfo`]).
    pub warning: Option<String>,
}

/// Projections per layer, for [`LoraAdapter`]'s table.
const PROJS: usize = 7;

/// One module's weights as the host kernels read them: `Aᵀ` and `s·B` in the storage of the
/// adapter's own tensors.
#[derive(Debug, Clone, Copy)]
struct HostModule {
    a: *const u8,
    b: *const u8,
    /// Elements of `Aᵀ` and of `B`.
    a_len: usize,
    b_len: usize,
    bf16: bool,
    /// The padded rank.
    r: usize,
    d_out: usize,
}

// SAFETY: the pointers are into CPU storage the adapter owns (its `modules`) and never writes:
// reading them from any thread while the adapter lives is reading immutable memory.
unsafe impl Send for HostModule {}
// SAFETY: as for Send: shared reads of memory nothing writes.
unsafe impl Sync for HostModule {}

impl HostModule {
    /// Where `at` and `b` lie, when both are contiguous CPU f32 or bf16 tensors.
    fn of(at: &Tensor, b: &Tensor) -> Option<Self> {
        let (r, d_out) = (at.dim(1).ok()?, b.dim(0).ok()?);
        let (a_len, b_len) = (at.elem_count(), b.elem_count());
        // The guards are dropped at once: candle moves or rewrites a CPU storage only for
        // in-place ops on it, and nothing writes an adapter's tensors after load.
        let (a, b, bf16) = match (HostF32::of(at), HostF32::of(b)) {
            (Some(ag), Some(bg)) => (
                ag.slice(a_len).as_ptr().cast(),
                bg.slice(b_len).as_ptr().cast(),
                false,
            ),
            _ => {
                let (ag, bg) = (Host::<half::bf16>::of(at)?, Host::<half::bf16>::of(b)?);
                (
                    ag.slice(a_len).as_ptr().cast(),
                    bg.slice(b_len).as_ptr().cast(),
                    true,
                )
            }
        };
        Some(Self {
            a,
            b,
            a_len,
            b_len,
            bf16,
            r,
            d_out,
        })
    }

    /// The weights, borrowed for as long as the adapter that holds them.
    fn weights<'t>(&self, _owner: &'t LoraAdapter) -> Weights<'t> {
        // SAFETY: `of` took the pointers and lengths from the owner's own tensors, which live
        // as long as the borrow of the owner and are never written (see `HostModule`).
        unsafe {
            use std::slice::from_raw_parts;
            match self.bf16 {
                false => Weights::F32(
                    from_raw_parts(self.a.cast(), self.a_len),
                    from_raw_parts(self.b.cast(), self.b_len),
                ),
                true => Weights::Bf16(
                    from_raw_parts(self.a.cast(), self.a_len),
                    from_raw_parts(self.b.cast(), self.b_len),
                ),
            }
        }
    }
}

impl LoraAdapter {
    /// The adapter over `modules` (`Aᵀ` and `s·B` per (layer, projection), laid out as
    /// above), with its host table; `rank` is the highest unpadded rank, `bytes` what the
    /// weights hold.
    pub fn from_modules(
        modules: HashMap<(usize, Proj), (Tensor, Tensor)>,
        rank: usize,
        bytes: u64,
    ) -> Self {
        let layers = modules.keys().map(|(l, _)| l + 1).max().unwrap_or(0);
        let mut host = vec![None; layers * PROJS];
        let mut all_host = true;
        for (&(layer, proj), (at, b)) in &modules {
            let m = HostModule::of(at, b);
            all_host &= m.is_some();
            host[layer * PROJS + proj as usize] = m;
        }
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let id = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Self {
            id,
            weights_key: u128::from(id),
            modules,
            vision: HashMap::new(),
            host,
            all_host,
            rank,
            bytes,
            warning: None,
        }
    }

    /// The same adapter with modules of the vision tower too (see [`LoraAdapter::vision_module`]).
    pub fn with_vision(mut self, vision: HashMap<String, (Tensor, Tensor)>) -> Self {
        self.vision = vision;
        self
    }

    /// `Aᵀ` `[in, r]` and `s·B` `[out, r]` of the vision tower's module `path` (under
    /// `model.visual.`), when the adapter has it.
    pub fn vision_module(&self, path: &str) -> Option<&(Tensor, Tensor)> {
        self.vision.get(path)
    }

    /// Whether the adapter changes the vision tower.
    pub fn has_vision(&self) -> bool {
        !self.vision.is_empty()
    }

    /// The dtype its weights are held in (None: no module).
    pub(super) fn dtype(&self) -> Option<DType> {
        self.modules.values().next().map(|(a, _)| a.dtype())
    }

    /// This adapter's process-wide id: a new one for every load, so it tells apart weights
    /// that share a name and version (the same version loaded again from another directory).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The identity of its weights for the prefix cache (see [`Self::with_weights_key`]).
    pub fn weights_key(&self) -> u128 {
        self.weights_key
    }

    /// The same adapter, its weights known by `key`: a digest of the files they were read
    /// from, as they were (path, size, modification time, inode), so that an adapter evicted
    /// and loaded again from the same unchanged files keeps its cached KV blocks.
    pub fn with_weights_key(mut self, key: u128) -> Self {
        self.weights_key = key;
        self
    }

    /// `Aᵀ` `[in, r]` and `s·B` `[out, r]` of `(layer, proj)`, when the adapter has it.
    pub(super) fn module(&self, layer: usize, proj: Proj) -> Option<&(Tensor, Tensor)> {
        self.modules.get(&(layer, proj))
    }

    /// The same weights on another device (the registry's host tier and its way back).
    pub fn to_device(&self, device: &Device) -> candle_core::Result<Self> {
        let modules = self
            .modules
            .iter()
            .map(|(k, (a, b))| Ok((*k, (a.to_device(device)?, b.to_device(device)?))))
            .collect::<candle_core::Result<_>>()?;
        let vision = self
            .vision
            .iter()
            .map(|(k, (a, b))| Ok((k.clone(), (a.to_device(device)?, b.to_device(device)?))))
            .collect::<candle_core::Result<_>>()?;
        // Complete before another thread reads them (see the worker's `lora::load`).
        device.synchronize()?;
        let mut copy = Self::from_modules(modules, self.rank, self.bytes).with_vision(vision);
        // The same weights: the same identity for the slot pool and the prefix cache.
        copy.id = self.id;
        copy.weights_key = self.weights_key;
        copy.warning.clone_from(&self.warning);
        Ok(copy)
    }

    /// Adds this adapter's low-rank update of `(layer, proj)` to the rows `idx` of `out`, whose
    /// inputs are the rows `idx` of `x`.
    pub fn apply(
        &self,
        layer: usize,
        proj: Proj,
        x: &Tensor,
        idx: &Tensor,
        out: &Tensor,
    ) -> candle_core::Result<Tensor> {
        let Some((at, b)) = self.modules.get(&(layer, proj)) else {
            return Ok(out.clone());
        };
        // Weights held in another dtype than the activations (`loraDtype`): the product runs
        // in the wider of the two, so f32 activations are never rounded to bf16.
        let wide = if at.dtype() == DType::F32 || x.dtype() == DType::F32 {
            DType::F32
        } else {
            x.dtype()
        };
        let (at, b) = (at.to_dtype(wide)?, b.to_dtype(wide)?);
        let update = |x: &Tensor| -> candle_core::Result<Tensor> {
            x.to_dtype(wide)?
                .matmul(&at)?
                .matmul(&b.t()?)?
                .to_dtype(out.dtype())
        };
        // Every row of the batch on this adapter: no gather/scatter copies.
        if idx.dim(0)? == x.dim(0)? {
            return out + update(x)?;
        }
        out.index_add(idx, &update(&x.index_select(idx, 0)?)?, 0)
    }
}

/// Tokens of a batch at most for the host path ([`HostUpdates`]): beyond, per-adapter
/// matmuls (gemm) win.
pub const HOST_LORA_MAX_TOKENS: usize = 64;

/// Tokens of one adapter per [`UpdateTask`]: a task reads its adapter's weights once for all
/// its tokens (and the AVX-512 kernel transposes each tile of `B` once), and one thread runs
/// the updates while the other multiplies base weights, so fewer, larger tasks cost nothing in
/// balance at decode batch sizes.
const LORA_TOKENS_PER_TASK: usize = 16;

/// The adapters of one projection of a batch, held for the host kernels to read in place:
/// per token `(x·Aᵀ)·(s·B)ᵀ` for CPU f32 batches of few tokens (decode steps, with one
/// adapter or many). One output buffer per projection however many adapters the batch
/// holds, where the tensor path costs four ops (two matmuls, gather, scatter-add) per
/// adapter — at decode batch sizes their fixed costs, not the arithmetic, are what a dynamic
/// adapter would add to a step (the CPU counterpart of Punica's BGMV).
pub struct HostUpdates<'t> {
    /// Per adapter that has this module: its weights, padded rank and token positions.
    held: Vec<(Weights<'t>, usize, &'t [u32])>,
    /// The module's output width.
    d_out: usize,
}

impl<'t> HostUpdates<'t> {
    /// The updates of `(layer, proj)` for `groups` (each adapter with its token positions),
    /// or None when an adapter's tensors are neither CPU f32 nor CPU bf16 (the tensor path
    /// applies them).
    pub fn of(
        layer: usize,
        proj: Proj,
        groups: &[(&'t LoraAdapter, &'t [u32])],
    ) -> candle_core::Result<Option<Self>> {
        let mut held = Vec::with_capacity(groups.len());
        let mut d_out = 0;
        for &(a, rows) in groups {
            match a.host.get(layer * PROJS + proj as usize).copied().flatten() {
                Some(m) => {
                    // The padded rank: the kernels read whole rows.
                    held.push((m.weights(a), m.r, rows));
                    d_out = m.d_out;
                }
                // Held where the kernels cannot read it (a GPU, f16): the tensor path.
                None if !a.all_host && a.modules.contains_key(&(layer, proj)) => return Ok(None),
                None => {}
            }
        }
        Ok(Some(Self { held, d_out }))
    }

    /// No updates (a projection no adapter targets, such as the output head).
    pub fn none() -> Self {
        Self {
            held: Vec::new(),
            d_out: 0,
        }
    }

    /// Whether no adapter of the batch has this module.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Tasks of up to [`LORA_TOKENS_PER_TASK`] tokens of one adapter each, adding to `sum`
    /// (`[tokens, d_out]`, row-major): the tokens share each weight row while it is in cache,
    /// so an adapter's weights are read once per task, not once per token.
    pub fn tasks<'s>(&'s self, d_in: usize, sum: &'s mut [f32]) -> Vec<UpdateTask<'s>> {
        if self.held.is_empty() {
            return Vec::new();
        }
        let d_out = self.d_out;
        let mut slots: Vec<Option<&mut [f32]>> = sum.chunks_mut(d_out).map(Some).collect();
        let mut tasks = Vec::new();
        for (w, r, rows) in &self.held {
            let w = *w;
            debug_assert!(
                w.lens() == (d_in * r, r * d_out),
                "the adapter fits the model"
            );
            for chunk in rows.chunks(LORA_TOKENS_PER_TASK) {
                let outs = chunk
                    .iter()
                    .filter_map(|&i| Some((i as usize, slots.get_mut(i as usize)?.take()?)))
                    .collect();
                tasks.push(UpdateTask { w, r: *r, outs });
            }
        }
        tasks
    }
}

/// One adapter's update of a few tokens' output rows (see [`HostUpdates::tasks`]).
pub struct UpdateTask<'s> {
    w: Weights<'s>,
    r: usize,
    outs: Vec<(usize, &'s mut [f32])>,
}

impl<'s> UpdateTask<'s> {
    /// Adds the update to the task's rows; `xs` is the batch's inputs `[tokens, in]`, `next`
    /// the [`reads`](Self::reads) of the task this thread will likely run next (empty when
    /// none), asked of the memory ahead of need as this task's own weights run out.
    pub fn run(mut self, xs: &[f32], next: [&[u8]; 2]) {
        match self.w {
            Weights::F32(a, b) => kernels::lora_tokens(xs, a, b, self.r, &mut self.outs, next),
            Weights::Bf16(a, b) => {
                kernels::lora_tokens_bf16(xs, a, b, self.r, &mut self.outs, next)
            }
        }
    }

    /// The weights the task reads, in the order it reads them, as bytes.
    pub fn reads(&self) -> [&'s [u8]; 2] {
        match self.w {
            Weights::F32(a, b) => [kernels::bytes(a), kernels::bytes(b)],
            Weights::Bf16(a, b) => [kernels::bytes(a), kernels::bytes(b)],
        }
    }
}

/// One module's A and B, read in place.
#[derive(Clone, Copy)]
enum Weights<'t> {
    F32(&'t [f32], &'t [f32]),
    Bf16(&'t [half::bf16], &'t [half::bf16]),
}

impl Weights<'_> {
    /// Elements of A and of B.
    fn lens(&self) -> (usize, usize) {
        match self {
            Weights::F32(a, b) => (a.len(), b.len()),
            Weights::Bf16(a, b) => (a.len(), b.len()),
        }
    }
}
