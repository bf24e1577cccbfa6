//! A forward pass's rows and what every layer of it shares.

use candle_core::{DType, Device, Tensor};

use super::kv::KvPool;
use super::slots::{LoraSlots, StepSlots};
use super::vision::ImageEmbeds;
use super::{LoraAdapter, SeqCache};

/// One sequence of a batch: its new tokens, its cache (the new tokens start at `cache.len()`)
/// and the adapter it runs with.
pub struct Row<'a> {
    /// Tokens to process (the whole prompt at prefill, one token at decode).
    pub tokens: &'a [u32],
    /// The sequence's cache, extended by this forward pass.
    pub cache: &'a mut SeqCache,
    /// The adapter version this sequence pinned, or None for the base model.
    pub adapter: Option<&'a LoraAdapter>,
    /// A vision-language prompt's images, for the steps that prefill it.
    pub vision: Option<RowVision<'a>>,
}

/// What a row of a vision-language prompt brings besides its tokens (Qwen3-VL prefill; see
/// [`super::vision::mrope_positions`]).
#[derive(Clone, Copy)]
pub struct RowVision<'a> {
    /// The M-RoPE (time, height, width) position of each of the row's new tokens.
    pub positions: &'a [[u32; 3]],
    /// The row's new tokens that are image placeholders: (index among the new tokens, row of
    /// `embeds` it takes).
    pub image_tokens: &'a [(u32, u32)],
    /// The images' embeddings and DeepStack features; None when `image_tokens` is empty and
    /// the tower never ran (every placeholder's keys and values came from the prefix cache).
    pub embeds: Option<&'a ImageEmbeds>,
    /// Position minus index of the tokens after the prompt (where decoding continues).
    pub offset: i64,
}

/// Per-forward facts every layer shares: the rows' new and cached tokens, each token's rotary
/// cos/sin at its own position, and the path the step computes on.
pub(super) struct Batch<'a> {
    pub lens: Vec<usize>,
    pub starts: Vec<usize>,
    /// cos/sin `[tokens, head_dim/2]`: each token's rotation at its own position.
    pub cos: Tensor,
    pub sin: Tensor,
    /// Layers of the model (a cache is sized for them on first use).
    pub layers: usize,
    pub device: &'a Device,
    /// The compute dtype.
    pub dtype: DType,
    /// How the step computes: what one path needs, the other cannot have.
    pub path: StepPath<'a>,
}

/// The two ways a step computes. The host path is the CPU's in f32: each row's cache of its
/// own, attention and adapter updates as fused host kernels over the rows grouped by adapter.
/// The tensor path is a GPU's (and the CPU's reference of it): the paged cache, and the LoRA
/// slot pool each token reads its adapter from.
pub(super) enum StepPath<'a> {
    /// The host path: the rows sharing each adapter, and the dtype the rows' caches hold.
    Host { groups: Vec<Group<'a>>, kv: DType },
    /// The tensor path: where the step's keys go and come from in the paged cache, and, when a
    /// row has an adapter, the slot pool and where each token meets its slot.
    Tensor {
        paged: Paged<'a>,
        lora: Option<(&'a LoraSlots, StepSlots)>,
    },
}

/// A tensor-path step's view of the paged cache: the rows padded to `queries` new tokens and
/// `keys` cached ones each, so one attention call covers rows of any lengths.
pub(super) struct Paged<'a> {
    pub pool: &'a KvPool,
    /// Each new token's slot, repeated across the cache's width: `[tokens, width]`.
    pub write: Tensor,
    /// Per row, the slots of its positions `0..keys` (past its length: any slot, masked):
    /// `[rows · keys]`.
    pub gather: Tensor,
    /// Per row, the token each of its `queries` padded positions reads (its last past its
    /// length): `[rows · queries]`.
    pub pad: Tensor,
    /// Each token's padded position, `row · queries + t`: `[tokens]`.
    pub unpad: Tensor,
    /// 0 where a padded query may see a key (causal, within the row), -1e30 elsewhere:
    /// `[rows, 1, 1, queries, keys]`, f32.
    pub mask: Tensor,
    pub rows: usize,
    pub queries: usize,
    pub keys: usize,
}

/// Rows of a batch that share an adapter: the adapter and their token positions in the batch.
pub(super) struct Group<'a> {
    pub adapter: &'a LoraAdapter,
    pub idx: Tensor,
    pub rows: Vec<u32>,
}

/// A step's rotary positions, one per new token.
pub(super) struct Positions {
    /// The time position (text: the only one).
    pub time: Vec<u32>,
    /// With image tokens in the step (M-RoPE): the height and width positions.
    pub spatial: Option<(Vec<u32>, Vec<u32>)>,
}

impl Positions {
    /// Every new token's rotary position: its time (or only) position, and with image tokens in
    /// the step, the height and width positions too (M-RoPE). Text continues each cache at its
    /// length plus its offset.
    pub(super) fn of(rows: &[Row<'_>]) -> Self {
        let spatial = rows.iter().any(|r| r.vision.is_some());
        let mut p = Positions {
            time: Vec::new(),
            spatial: spatial.then(|| (Vec::new(), Vec::new())),
        };
        for r in rows {
            let start = r.cache.len() as i64 + r.cache.pos_offset;
            match (&r.vision, &mut p.spatial) {
                (Some(v), Some((h, w))) => {
                    p.time.extend(v.positions.iter().map(|x| x[0]));
                    h.extend(v.positions.iter().map(|x| x[1]));
                    w.extend(v.positions.iter().map(|x| x[2]));
                }
                (_, spatial) => {
                    let text = (0..r.tokens.len() as i64).map(|i| (start + i).max(0) as u32);
                    p.time.extend(text.clone());
                    if let Some((h, w)) = spatial {
                        h.extend(text.clone());
                        w.extend(text);
                    }
                }
            }
        }
        p
    }
}
