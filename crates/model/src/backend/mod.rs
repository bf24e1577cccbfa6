//! How a step runs. The decoder's layer math is the same on every path; what differs is where
//! keys and values live and how a step's inputs reach the layers. The host backend (the CPU in
//! f32) gives each sequence a cache of its own, runs attention and adapter updates as fused
//! host kernels, and keeps reused prefixes in a host store; the paged backend (a GPU's, and the
//! CPU's reference of it) keeps every sequence's keys in one paged KV pool and the step's
//! adapters in LoRA slots, and indexes cached prefixes by the pool's blocks. A decoder holds one,
//! chosen before its first step ([`crate::Decoder::configure`]).

mod host;
mod paged;

use candle_core::{DType, Device, Tensor};

use self::host::HostBackend;
use self::paged::PagedBackend;
use super::batch::{Batch, Row};
use super::cache::SeqCache;
use super::config::ModelConfig;
use super::kv::TensorPathOptions;
use super::prefix::BlockHash;
use super::rope::RotaryTable;
use super::step::ImageIndices;
use super::ModelError;

/// The step backends a decoder can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendKind {
    /// The host backend where it runs (the CPU in f32, where it is the default); the paged
    /// backend on any other device or dtype, which the host kernels do not serve.
    #[default]
    Host,
    /// The paged backend on every device: what a GPU runs, and on the CPU its reference, held
    /// by the tests to the same numbers.
    Paged,
}

impl BackendKind {
    /// `Host` when `host`, else `Paged` (for runs over both).
    pub fn host_if(host: bool) -> Self {
        match host {
            true => Self::Host,
            false => Self::Paged,
        }
    }

    /// Whether the scheduler admits and preempts sequences by the free blocks of a KV pool.
    pub fn admits_by_blocks(self) -> bool {
        self == Self::Paged
    }

    /// Whether the prefix cache also finds a block by its tokens, a sequence's last partial
    /// block included (the host store); the paged index finds full blocks by their hash only,
    /// as vLLM's does.
    pub fn finds_prefix_by_tokens(self) -> bool {
        self == Self::Host
    }

    /// Whether the layers multiply q/k/v and gate/up as one matrix each (the paged backend's
    /// tensor ops) or read them apart (the host kernels).
    pub(super) fn fuses_projections(self) -> bool {
        self == Self::Paged
    }

    /// The name logs give it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Host => "host",
            Self::Paged => "paged",
        }
    }
}

/// What a backend needs of the model it steps: its configuration (layers, the KV width, the
/// LoRA slots' shapes), its device, its compute dtype, and the dtype its caches hold.
pub(super) struct Shape {
    pub cfg: ModelConfig,
    pub device: Device,
    pub dtype: DType,
    pub kv: DType,
}

impl Shape {
    /// The floats a token's keys (or values) hold per layer.
    fn width(&self) -> usize {
        self.cfg.kv_heads() * self.cfg.head_dim()
    }

    fn layers(&self) -> usize {
        self.cfg.num_hidden_layers
    }
}

/// A step ready for the layers: its batch, the token ids, each row's last token, the image
/// placeholders on the device (per row with any: where they are among the step's tokens, which
/// embedding rows they take) and the caller's extra inputs there (None when empty).
pub(super) struct Step<'b> {
    pub batch: Batch<'b>,
    pub ids: Tensor,
    pub last: Tensor,
    pub images: Vec<(Tensor, Tensor)>,
    pub extra: Option<Tensor>,
}

/// One way of running steps: the state a path keeps across steps (caches, pools, the prefix
/// store) and how it turns rows into a [`Step`]. The decoder's public prefix-cache methods
/// document what each operation means for its caller.
pub(super) trait StepBackend: Send + Sync {
    /// Which backend this is.
    fn kind(&self) -> BackendKind;

    /// How its pools are sized (the host store takes at most `kv_blocks` blocks, in blocks of
    /// `block_size` tokens, as the paged pool).
    fn options(&self) -> &TensorPathOptions;

    /// The dtype its caches hold keys and values in.
    fn kv_dtype(&self) -> DType;

    /// Whether `cache` is empty or was filled by this backend: a cache filled by the other is
    /// refused rather than read wrongly.
    fn holds(&self, cache: &SeqCache) -> bool;

    /// Makes room for the rows' new tokens before their step (the paged backend reserves their
    /// blocks, its pools allocated on first use).
    fn reserve(&self, rows: &mut [Row<'_>]) -> Result<(), ModelError>;

    /// The step of `rows` (reserved), with `images` the placeholders of the rows that have any
    /// and `extra` the caller's own inputs to the step.
    fn prepare<'b>(
        &'b self,
        rows: &[Row<'b>],
        rotary: &RotaryTable,
        images: &ImageIndices,
        extra: &[f32],
    ) -> Result<Step<'b>, ModelError>;

    /// Free KV blocks of the paged pool (all of them before its first step; the host backend
    /// has none and answers with the pool's size).
    fn free_blocks(&self) -> usize;

    /// Blocks the prefix cache holds that no sequence holds.
    fn cached_blocks(&self) -> usize;

    /// Starts the empty `cache` from the prefix cache; returns the tokens it then holds.
    fn reuse_prefix(
        &self,
        cache: &mut SeqCache,
        hashes: &[BlockHash],
        seed: BlockHash,
        tokens: Option<&[u32]>,
    ) -> Result<usize, ModelError>;

    /// Offers the prefix cache `cache`'s full blocks it has not been offered.
    fn store_prefix(
        &self,
        cache: &mut SeqCache,
        hashes: &[BlockHash],
        seed: BlockHash,
        tokens: Option<&[u32]>,
    ) -> Result<(), ModelError>;

    /// Offers the prefix cache a finished sequence's last, partial block.
    fn store_partial(
        &self,
        cache: &SeqCache,
        hashes: &[BlockHash],
        seed: BlockHash,
        tokens: &[u32],
    );

    /// A cache holding at most the first `tokens` of `cache`, and the tokens it holds.
    fn fork_cache(&self, cache: &SeqCache, tokens: usize) -> (SeqCache, usize);
}

/// The backend of `kind` for a model of `shape`, its pools sized by `opts` (allocated by the
/// steps that need them). The host backend runs only on the CPU in f32; asked for elsewhere,
/// the paged one runs.
pub(super) fn choose(
    kind: BackendKind,
    shape: Shape,
    opts: TensorPathOptions,
) -> Box<dyn StepBackend> {
    let host = kind == BackendKind::Host && shape.device.is_cpu() && shape.dtype == DType::F32;
    match host {
        true => Box::new(HostBackend::new(shape, opts)),
        false => Box::new(PagedBackend::new(shape, opts)),
    }
}
