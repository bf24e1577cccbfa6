//! The inference engine: an engine thread with a continuous-batching scheduler over one
//! model instance and a registry of LoRA adapters. The server talks to it only through
//! [`api`]; [`Engine`] is the implementation.

// clippy.toml keeps device→host copies and concatenation out of the decode path: `lora` (and
// mole-model below) hold to it; the engine's one copy of a step's logits and its tools may not.
#![allow(clippy::disallowed_methods)]

mod adapters;
pub mod api;
mod codec;
pub mod device_sampler;
pub mod grammar;
pub mod host_sampler;
mod images;
mod load;
#[warn(clippy::disallowed_methods)]
pub mod lora;
mod plan;
mod prefix;
pub mod pyjson;
pub mod replicas;
mod sampling;
pub mod scheduler;
mod seq;
pub mod text;
pub mod threads;
mod trace;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, PoisonError};

use candle_core::{DType, Device};

use self::api::*;
use self::host_sampler::Sampler;
use self::images::ImageProcessor;
pub use self::load::ModelSource;
use self::scheduler::Msg;
use self::seq::{Score, Seq};
use self::text::TextModel;
use crate::lora::registry::Registry;
use mole_model::{BackendKind, Decoder, LoraKernel, TensorPathOptions, MAX_KV_SLOTS};

/// Engine settings (from the worker config's limits).
#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Base model identity (adapters naming another base are refused; `/v1/models`).
    pub base_name: String,
    /// Sequences decoded together.
    pub max_batch_size: usize,
    /// Longest sequence (prompt + output), capped by the model's own limit.
    pub max_seq_len: usize,
    /// Waiting requests before `Overloaded`.
    pub max_queue: usize,
    /// Adapters on the compute device at once (least recently used idle ones move to host
    /// memory, then back to disk).
    pub max_loras: usize,
    /// Adapters kept in host memory beyond the device slots.
    pub max_cpu_loras: usize,
    /// Highest LoRA rank accepted.
    pub max_lora_rank: usize,
    /// The dtype adapters' weights are held in; None: the weights' own where the kernels
    /// read it (see [`mole_model::adapter_dtype`]).
    pub lora_dtype: Option<DType>,
    /// Prompt tokens processed per step across new sequences (chunked prefill).
    pub prefill_chunk: usize,
    /// In a merged pod: the adapter baked into the weights and its version (requests naming
    /// it run on the weights as they are).
    pub merged: Option<(String, String)>,
    /// KV blocks of the tensor path's cache; None: sized by [`Engine::load`] from the
    /// device's memory ([`KvBudget`]), else enough for a full batch at the longest length.
    pub kv_blocks: Option<usize>,
    /// Share of a GPU's total memory the worker may use (`gpuMemoryUtilization`).
    pub gpu_memory_utilization: f64,
    /// Which of transformers' image processors a vision model's pixels equal.
    pub image_processor: mole_api::ImageProcessor,
    /// Automatic prefix caching (vLLM's `enable_prefix_caching`): full KV blocks stay cached
    /// by the hash of their tokens, images and adapter, and later requests reuse them.
    pub prefix_caching: bool,
    /// The dtype the KV cache holds (`kvCacheDtype`); None: the model's default (see
    /// [`Decoder::kv_dtype`]).
    pub kv_cache_dtype: Option<DType>,
    /// How the tensor path computes LoRA updates (`serve --lora-kernel`, `MOLE_LORA_KERNEL`):
    /// the grouped ops by default; the BGMV kernels are unproven on a device.
    pub lora_kernel: LoraKernel,
    /// llguidance's limits on compiling a guide and on each token's mask
    /// (`limits.guideParser`).
    pub guide_limits: mole_api::GuideParserLimits,
    /// Fuel of one chat template rendering (`limits.maxTemplateFuel`; None: unbounded).
    pub template_fuel: Option<u64>,
    /// The step backend the model runs on: the host kernels where they run (the CPU in f32)
    /// unless `Paged` is asked for, as tests do to run a GPU's path on the CPU.
    pub backend: BackendKind,
}

/// Prompt tokens a step takes across new sequences by default (`serve --prefill-chunk`).
pub const DEFAULT_PREFILL_CHUNK: usize = 512;

impl Default for EngineOptions {
    /// The pool's defaults ([`mole_api::EngineLimits`]'s, owned there once), no merged
    /// adapter, an unbounded template.
    fn default() -> Self {
        Self {
            base_name: "base".into(),
            max_batch_size: 0,
            max_seq_len: 0,
            max_queue: 0,
            max_loras: 0,
            max_cpu_loras: 0,
            max_lora_rank: 0,
            lora_dtype: None,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
            merged: None,
            kv_blocks: None,
            gpu_memory_utilization: 0.0,
            image_processor: mole_api::ImageProcessor::default(),
            prefix_caching: false,
            kv_cache_dtype: None,
            lora_kernel: LoraKernel::Ops,
            guide_limits: mole_api::GuideParserLimits::default(),
            template_fuel: None,
            backend: BackendKind::default(),
        }
        .with_limits(&mole_api::EngineLimits::default())
    }
}

impl EngineOptions {
    /// With the engine limits a pool sets (`spec.dynamic`, the worker config's
    /// `limits.engine`): the one conversion from them, defaults included.
    pub fn with_limits(self, l: &mole_api::EngineLimits) -> Self {
        Self {
            max_batch_size: l.max_batch_size as usize,
            max_seq_len: l.max_seq_len as usize,
            max_queue: l.max_queue as usize,
            max_loras: l.max_loras as usize,
            max_cpu_loras: l.max_cpu_loras as usize,
            max_lora_rank: l.max_lora_rank as usize,
            lora_dtype: l.lora_dtype.map(candle_dtype),
            kv_cache_dtype: l.kv_cache_dtype.map(candle_dtype),
            gpu_memory_utilization: l.gpu_memory_utilization,
            prefix_caching: l.enable_prefix_caching,
            ..self
        }
    }
}

/// The tensor path's pools sized from the limits: KV blocks for a full batch of sequences at
/// the longest length (so preemption only trims an overcommitted batch), and a LoRA slot per
/// device-resident adapter at the highest rank accepted. The cache never exceeds
/// [`MAX_KV_SLOTS`] tokens.
pub(crate) fn tensor_path(opts: &EngineOptions) -> TensorPathOptions {
    let block_size = TensorPathOptions::default().block_size;
    TensorPathOptions {
        block_size,
        kv_blocks: opts
            .kv_blocks
            .unwrap_or(opts.max_batch_size.max(1) * opts.max_seq_len.div_ceil(block_size))
            .min(MAX_KV_SLOTS / block_size),
        lora_slots: opts.max_loras.max(1),
        lora_rank: opts.max_lora_rank.max(1),
        kv_dtype: opts.kv_cache_dtype,
        lora_kernel: opts.lora_kernel,
    }
}

/// The image processor of a vision model whose source has no preprocessor config of its own:
/// Qwen3-VL's defaults with `backend`'s pixels.
fn default_images(model: &Decoder, backend: mole_api::ImageProcessor) -> Option<ImageProcessor> {
    model.config().vision.as_ref().map(|spec| {
        let cfg = mole_model::vision::preprocess::ProcessorConfig {
            backend,
            ..Default::default()
        };
        ImageProcessor::new(cfg, spec)
    })
}

/// The device as logs and messages name it (`cpu`, `cuda:0`).
pub fn device_name(device: &Device) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cpu => "cpu".into(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

/// State shared by the engine handle and the engine thread.
pub struct Shared {
    model: Decoder,
    text: TextModel,
    registry: Registry<adapters::Waiter>,
    opts: EngineOptions,
    /// Requests submitted and not yet admitted to the batch.
    waiting: AtomicUsize,
    stats: Mutex<EngineStats>,
    loads: std::sync::atomic::AtomicU64,
    load_failures: std::sync::atomic::AtomicU64,
    load_micros: std::sync::atomic::AtomicU64,
    /// Sequences preempted because the KV cache was full (since start).
    preemptions: std::sync::atomic::AtomicU64,
    /// Forward passes run (since start).
    steps: std::sync::atomic::AtomicU64,
    /// Images the vision tower encoded (since start).
    vision_encodes: std::sync::atomic::AtomicU64,
    /// Grammar masks are computed while the forward pass runs (else before it: the
    /// benchmark's baseline, [`Engine::overlap_masks_for_bench`], feature `bench-seams`).
    #[cfg(feature = "bench-seams")]
    overlap_masks: std::sync::atomic::AtomicBool,
    /// Sequences of the largest batch (since start).
    largest_batch: AtomicUsize,
    /// What adapters are held in: `opts.lora_dtype` or the model's default.
    lora_dtype: DType,
    device: Device,
    /// How a vision model takes images (None: a text model).
    images: Option<ImageProcessor>,
    /// Digests of images the vision tower is made to fail on ([`Engine::fail_images_for_tests`]).
    #[cfg(feature = "test-seams")]
    failing_images: Mutex<Vec<[u8; 32]>>,
    /// Structured outputs' grammars over this model's tokens (built on first use).
    grammars: grammar::Grammars,
    /// Prefix-cache queries and hits in tokens, by adapter ("" for the base model).
    prefix_counts: Mutex<std::collections::BTreeMap<String, (u64, u64)>>,
}

/// The engine: a handle to the engine thread.
pub struct Engine {
    shared: Arc<Shared>,
    tx: mpsc::Sender<Msg>,
}

impl Engine {
    /// Loads a base model from `source` (every kind through one path: its weights' size checked
    /// against the device's share before they are read, the KV cache sized after) and starts
    /// the engine thread.
    pub fn load(
        source: &ModelSource,
        device: &Device,
        mut opts: EngineOptions,
    ) -> Result<Self, EngineError> {
        let l = source.load(device, &mut opts)?;
        let images = l
            .images
            .or_else(|| default_images(&l.model, opts.image_processor));
        Ok(Self::spawn(l.model, l.text, images, opts))
    }

    /// Starts the engine thread over a loaded model (a vision model takes images as Qwen3-VL's
    /// processor prepares them), on the step backend `opts.backend` names, its pools sized
    /// from `opts`.
    pub fn start(model: Decoder, text: TextModel, opts: EngineOptions) -> Self {
        let images = default_images(&model, opts.image_processor);
        Self::spawn(model, text, images, opts)
    }

    fn spawn(
        mut model: Decoder,
        mut text: TextModel,
        images: Option<ImageProcessor>,
        mut opts: EngineOptions,
    ) -> Self {
        opts.max_seq_len = opts.max_seq_len.min(model.config().max_positions()).max(2);
        tracing::info!(
            weights_bytes = model.weight_bytes(),
            weights = model
                .quantization()
                .map_or_else(|| format!("{:?}", model.weight_dtype()), String::from),
            "base weights held"
        );
        model.configure(opts.backend, tensor_path(&opts));
        tracing::info!(
            kv_cache_dtype = model.kv_dtype().as_str(),
            backend = model.backend_kind().as_str(),
            lora_kernel = opts.lora_kernel.as_str(),
            "KV cache dtype"
        );
        let device = model.device().clone();
        text.set_template_fuel(opts.template_fuel);
        let shared = Arc::new(Shared {
            lora_dtype: opts
                .lora_dtype
                .unwrap_or(mole_model::adapter_dtype(model.weight_dtype(), &device)),
            device,
            registry: Registry::new(opts.max_loras, opts.max_cpu_loras, model.device().clone()),
            waiting: AtomicUsize::new(0),
            stats: Mutex::new(EngineStats {
                max_loras: opts.max_loras,
                ..Default::default()
            }),
            loads: Default::default(),
            load_failures: Default::default(),
            load_micros: Default::default(),
            preemptions: Default::default(),
            steps: Default::default(),
            vision_encodes: Default::default(),
            #[cfg(feature = "bench-seams")]
            overlap_masks: std::sync::atomic::AtomicBool::new(true),
            largest_batch: Default::default(),
            grammars: grammar::Grammars::with_limits(
                text.tokenizer().clone(),
                &text.eos_ids,
                model.config().vocab_size,
                &opts.guide_limits,
            ),
            model,
            text,
            opts,
            images,
            #[cfg(feature = "test-seams")]
            failing_images: Mutex::default(),
            prefix_counts: Mutex::default(),
        });
        let (tx, rx) = mpsc::channel();
        let sh = shared.clone();
        std::thread::Builder::new()
            .name("mole-engine".into())
            .spawn(move || scheduler::run(sh, rx))
            .expect("spawn engine thread");
        Self { shared, tx }
    }

    /// Makes the vision tower fail on every image with `digest` from now on: the seam by which
    /// tests make one request's input fail deterministically inside a step (feature
    /// `test-seams`, this crate's tests only).
    #[cfg(feature = "test-seams")]
    pub fn fail_images_for_tests(&self, digest: [u8; 32]) {
        self.shared
            .failing_images
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(digest);
    }

    /// Computes the grammar masks of constrained rows while the step's forward pass runs
    /// (`true`, the default) or before it: the seam by which `mole-bench decode` measures the
    /// overlap against the order it replaced, in one run (feature `bench-seams`, mole-bench's
    /// alone).
    #[cfg(feature = "bench-seams")]
    pub fn overlap_masks_for_bench(&self, on: bool) {
        self.shared.overlap_masks.store(on, Ordering::Relaxed);
    }

    fn is_merged(&self, name: &str) -> Option<&str> {
        self.shared
            .opts
            .merged
            .as_ref()
            .filter(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Every forward pass, the classifier's scoring included, is work queued to the engine thread.
impl Serving for Engine {
    fn submit(&self, req: GenerateRequest) -> Result<EventStream, EngineError> {
        let mut streams = self.submit_n(req, 1)?;
        Ok(streams.pop().expect("one choice, one stream"))
    }

    /// The choices share the prompt: the first computes it, and when it is in the cache the
    /// others take its blocks (on the tensor path, no copy; on the host path, a copy) and each
    /// computes only what is left, at least the prompt's last token, for logits of its own.
    /// A request of `n` choices joins the batch when it has room for all of them.
    fn submit_n(&self, req: GenerateRequest, n: usize) -> Result<Vec<EventStream>, EngineError> {
        let sh = &self.shared;
        if n == 0 || n > sh.opts.max_batch_size {
            return Err(EngineError::InvalidRequest(format!(
                "n must be between 1 and maxBatchSize ({}), got {n}",
                sh.opts.max_batch_size
            )));
        }
        let (prompt, images) = self.prompt(&req.prompt, &req.images)?;
        if prompt.is_empty() {
            return Err(EngineError::InvalidRequest("the prompt is empty".into()));
        }
        let max_seq = sh.opts.max_seq_len;
        if prompt.len() >= max_seq {
            return Err(EngineError::InvalidRequest(format!(
                "prompt of {} tokens leaves no room in max_seq_len {max_seq}",
                prompt.len()
            )));
        }
        // The server's validation checked these bounds before routing (each refusal with its
        // own code); the engine takes the request as given.
        debug_assert!(
            host_sampler::validate(&req.sampling).is_ok(),
            "unvalidated sampling: {:?}",
            host_sampler::validate(&req.sampling)
        );
        if req.sampling.max_tokens == 0 {
            return Err(EngineError::InvalidRequest(
                "max_tokens must be at least 1".into(),
            ));
        }
        let max_new = req.sampling.max_tokens.min(max_seq - prompt.len());
        // Compiled once for every choice; a grammar that does not compile is refused here.
        let guide = match &req.sampling.guide {
            Some(g) => Some(
                sh.grammars
                    .compile(g)
                    .map_err(|e| EngineError::InvalidGuide {
                        code: e.code(),
                        message: e.to_string(),
                    })?,
            ),
            None => None,
        };
        let merged_version = req
            .adapter
            .as_deref()
            .and_then(|n| self.is_merged(n))
            .map(String::from);
        let adapter_name = req
            .adapter
            .as_deref()
            .filter(|n| self.is_merged(n).is_none());
        let queued = sh.waiting.fetch_add(1, Ordering::SeqCst);
        if queued >= sh.opts.max_queue {
            sh.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(EngineError::Overloaded(queued));
        }
        let mut streams = Vec::with_capacity(n);
        // The first choice, carrying the others until its prompt is in the cache (then they
        // take its images, embeddings included: see `Seq::fork`).
        let mut seqs: Vec<Box<Seq>> = (0..n)
            .map(|i| {
                let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                streams.push(rx);
                let mut sampler = Sampler::new(choice(&req, i).sampling, &prompt);
                if let Some(g) = &guide {
                    sampler = sampler.with_constraint(g.start());
                }
                let id = match i {
                    0 => req.id.clone(),
                    i => format!("{}/{i}", req.id),
                };
                let mut s = Seq::new(id, prompt.clone(), None, sampler, tx, max_new);
                s.version.clone_from(&merged_version);
                Box::new(s)
            })
            .collect();
        let mut first = seqs.remove(0);
        first.images = images;
        first.forks = seqs;
        self.queue(first, adapter_name)?;
        Ok(streams)
    }

    fn score_labels(
        &self,
        adapter: Option<&str>,
        prompt: &str,
        labels: &[String],
        images: &[Image],
    ) -> Result<Vec<f32>, EngineError> {
        let t = &self.shared.text;
        let prompt = if images.is_empty() {
            Prompt::Text(prompt.into())
        } else {
            // The images then the text, as one user message.
            let mut parts = vec![ContentPart::Image; images.len()];
            parts.push(ContentPart::Text(prompt.into()));
            let msg = ChatMessage {
                role: "user".into(),
                content: prompt.into(),
                parts,
                extra: Default::default(),
            };
            Prompt::Templated(self.apply_chat_template(&[msg], &Default::default())?)
        };
        let (ids, img) = self.prompt(&prompt, images)?;
        let max = self.shared.opts.max_seq_len - 1;
        if ids.len() > max && img.is_some() {
            return Err(EngineError::InvalidRequest(format!(
                "the prompt and its images take {} tokens, over max_seq_len",
                ids.len()
            )));
        }
        let ids = &ids[..ids.len().min(max)];
        if ids.is_empty() || labels.is_empty() {
            return Err(EngineError::InvalidRequest("nothing to score".into()));
        }
        let firsts = labels
            .iter()
            .map(|l| {
                t.encode(l, false)
                    .ok()
                    .and_then(|v| v.first().copied())
                    .ok_or_else(|| {
                        EngineError::InvalidRequest(format!("label {l:?} has no tokens"))
                    })
            })
            .collect::<Result<Vec<u32>, _>>()?;
        // One prefill of the prompt on the engine thread, riding in its next step like any
        // other row: the LoRA slots, the KV cache and the device are touched by that thread
        // alone (a pass of its own here could reload a slot a running step reads).
        let sh = &self.shared;
        let queued = sh.waiting.fetch_add(1, Ordering::SeqCst);
        if queued >= sh.opts.max_queue {
            sh.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(EngineError::Overloaded(queued));
        }
        let (reply, answer) = mpsc::channel();
        let (tx, mut events) = tokio::sync::mpsc::unbounded_channel();
        let sampling = SamplingParams {
            max_tokens: 1,
            ..Default::default()
        };
        let sampler = Sampler::new(sampling, ids);
        let mut seq = Seq::new("score".into(), ids.to_vec(), None, sampler, tx, 1);
        seq.images = img;
        seq.score = Some(Score {
            labels: firsts,
            reply,
        });
        self.queue(
            Box::new(seq),
            adapter.filter(|n| self.is_merged(n).is_none()),
        )?;
        answer.recv().unwrap_or_else(|_| {
            // Ended without scores: the reason went to its events.
            Err(match events.try_recv() {
                Ok(TokenEvent::Error(e)) => e,
                _ => EngineError::Internal("the scoring pass ended without an answer".into()),
            })
        })
    }
}

/// Snapshots of counters the engine thread keeps; reading them never waits on a step.
impl EngineInfo for Engine {
    fn stats(&self) -> EngineStats {
        let mut s = self
            .shared
            .stats
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        // Requests still on a loader thread count as waiting too.
        let sh = &self.shared;
        s.waiting = s.waiting.max(sh.waiting.load(Ordering::SeqCst));
        s.adapter_loads = sh.loads.load(Ordering::Relaxed);
        s.adapter_load_failures = sh.load_failures.load(Ordering::Relaxed);
        s.adapter_load_seconds = sh.load_micros.load(Ordering::Relaxed) as f64 / 1e6;
        s.adapter_evictions = sh.registry.evictions.load(Ordering::Relaxed);
        s.preemptions = sh.preemptions.load(Ordering::Relaxed);
        s.steps = sh.steps.load(Ordering::Relaxed);
        s.vision_encodes = sh.vision_encodes.load(Ordering::Relaxed);
        s.largest_batch = sh.largest_batch.load(Ordering::Relaxed);
        s.weights_bytes = Some(sh.model.weight_bytes());
        s.kv_cache_dtype = Some(sh.model.kv_dtype().as_str());
        s.prefix_cache = plan::prefix_counts(sh);
        s.prefix_cached_blocks = sh.model.cached_blocks();
        if sh.model.backend_kind() == BackendKind::Paged {
            let tp = sh.model.tensor_path();
            s.kv_blocks = Some((sh.model.free_blocks(), tp.kv_blocks));
            let cfg = sh.model.config();
            let per_block = 2
                * cfg.num_hidden_layers
                * tp.block_size
                * cfg.kv_heads()
                * cfg.head_dim()
                * sh.model.kv_dtype().size_in_bytes();
            s.kv_cache_bytes = Some((tp.kv_blocks * per_block) as u64);
        }
        s
    }

    fn model_info(&self) -> ModelInfo {
        ModelInfo {
            name: self.shared.opts.base_name.clone(),
            max_seq_len: self.shared.opts.max_seq_len,
            vocab_size: self.shared.model.config().vocab_size,
            vision: self.shared.images.is_some(),
            image_token: self.shared.images.as_ref().map(|i| i.image_token()),
            max_token_bytes: self.shared.text.max_token_bytes(),
        }
    }
}

/// The device the engine runs on: the first CUDA GPU when built with `cuda` and one is
/// present, else the CPU.
pub fn default_device() -> Device {
    #[cfg(feature = "cuda")]
    {
        match Device::new_cuda(0) {
            Ok(d) => return d,
            Err(e) => tracing::warn!(error = %e, "no CUDA device, serving on CPU"),
        }
    }
    Device::Cpu
}

/// The devices a pod's engines run on, one engine each: every CUDA GPU visible to the process
/// (the ones the pod was given) when built with `cuda`, else the CPU.
pub fn compute_devices() -> Vec<Device> {
    #[cfg(feature = "cuda")]
    {
        let gpus: Vec<Device> = (0..64).map_while(|i| Device::new_cuda(i).ok()).collect();
        if !gpus.is_empty() {
            return gpus;
        }
        tracing::warn!("no CUDA device, serving on CPU");
    }
    vec![Device::Cpu]
}

/// candle's type for a configured dtype: the weights' serving dtype. A GPU computes in it; the
/// CPU computes in f32 over half-type weights (see [`mole_model::compute_dtype`]).
pub fn candle_dtype(configured: mole_api::Dtype) -> DType {
    match configured {
        mole_api::Dtype::Bf16 => DType::BF16,
        mole_api::Dtype::F16 => DType::F16,
        mole_api::Dtype::F32 => DType::F32,
    }
}
