//! The paged KV cache of the tensor path (what GPUs run): per layer one key and one value
//! tensor of `blocks × block_size` slots, allocated once and written in place, and per
//! sequence a table of the blocks it holds. Memory is bounded up front (no tensor grows or is
//! concatenated per step), sequences of any lengths share it without fragmentation, and the
//! attention of a whole batch reads every row's keys through one gather.

use std::sync::{Arc, Mutex, PoisonError};

use candle_core::{DType, Device, Tensor};

use super::prefix::{BlockHash, PrefixIndex};
use super::ModelError;

/// The most token slots a paged cache holds (every layer's keys and values): a step's slot
/// indices travel in its one f32 upload, exact below 2^24 (see `model/step.rs`). Sixteen
/// million tokens is more than any device holds for a model of useful size.
pub const MAX_KV_SLOTS: usize = super::transfer::EXACT_F32;

/// How the tensor path applies the LoRA slots' updates (`--lora-kernel`, env
/// `MOLE_LORA_KERNEL`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LoraKernel {
    /// The grouped ops of `slots.rs`, for every step (the default).
    #[default]
    Ops,
    /// The BGMV kernels ([`mole_kernels::bgmv`]) for steps of at most [`mole_kernels::bgmv::MAX_TOKENS`] tokens, the
    /// grouped ops for longer ones. Unproven on a device: off until a GPU run shows its
    /// numerics and speed (docs/benchmarks.md).
    Bgmv,
}

impl LoraKernel {
    /// Its name on the command line and in the environment.
    pub fn as_str(self) -> &'static str {
        match self {
            LoraKernel::Ops => "ops",
            LoraKernel::Bgmv => "bgmv",
        }
    }
}

impl std::fmt::Display for LoraKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for LoraKernel {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "ops" => Ok(LoraKernel::Ops),
            "bgmv" => Ok(LoraKernel::Bgmv),
            other => Err(format!("{other:?}: expected ops or bgmv")),
        }
    }
}

/// How the tensor path's pools are sized.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorPathOptions {
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks of every layer (the cache holds `block_size × kv_blocks` tokens in all).
    pub kv_blocks: usize,
    /// Adapters one step may mix (LoRA slots besides the zero slot of base rows).
    pub lora_slots: usize,
    /// Ranks the LoRA slots hold (adapters' ranks are padded to it).
    pub lora_rank: usize,
    /// The dtype the KV cache holds (`kvCacheDtype`: f32, bf16 or f16, on both paths); None:
    /// the decoder's default (see [`super::Decoder::kv_dtype`]).
    pub kv_dtype: Option<DType>,
    /// How LoRA updates are computed (`--lora-kernel`; the grouped ops unless set).
    pub lora_kernel: LoraKernel,
}

impl Default for TensorPathOptions {
    /// Enough for 16 sequences of 2,048 tokens and 16 adapters of rank 64: what tests and
    /// tools get unless the engine sizes the pools from its limits.
    fn default() -> Self {
        Self {
            block_size: 16,
            kv_blocks: 2048,
            lora_slots: 16,
            lora_rank: 64,
            kv_dtype: None,
            lora_kernel: LoraKernel::Ops,
        }
    }
}

/// A device's memory as its driver reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Bytes free now (after whatever this process and others hold).
    pub free: u64,
    /// Bytes the device has.
    pub total: u64,
}

impl DeviceMemory {
    /// The memory of `device`: a GPU's free and total bytes; None on the CPU, where the
    /// limits alone size the cache (a host's "free memory" says little about what the
    /// process may use: page cache, cgroup limits, overcommit).
    pub fn of(device: &Device) -> Result<Option<Self>, ModelError> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(d) = device {
            let (free, total) = d
                .cuda_stream()
                .context()
                .mem_get_info()
                .map_err(|e| ModelError::Tensor(candle_core::Error::wrap(e)))?;
            return Ok(Some(Self {
                free: free as u64,
                total: total as u64,
            }));
        }
        let _ = device;
        Ok(None)
    }
}

/// How many KV blocks a device can hold: the `gpuMemoryUtilization`-style budget (the share
/// `fraction` of the device's total memory, less what is already used there, the LoRA slots
/// and an activation estimate), capped by what the limits can ever use. One pure function
/// of numbers, so it is tested without a GPU.
#[derive(Debug, Clone, PartialEq)]
pub struct KvBudget {
    /// The device, as logs name it.
    pub device: String,
    /// The device's memory after the weights were loaded; None (CPU): the limits decide.
    pub memory: Option<DeviceMemory>,
    /// Share of the device's total memory the worker may use.
    pub fraction: f64,
    /// The weights' bytes (for the message; they are already in `memory.free`).
    pub weights_bytes: u64,
    /// The LoRA slots' bytes (allocated on the first step with an adapter).
    pub lora_bytes: u64,
    /// Headroom for a step's activations.
    pub activation_bytes: u64,
    /// Bytes of one block across every layer (keys and values).
    pub bytes_per_block: u64,
    /// Blocks the limits can ever use (`maxBatchSize` sequences of `maxSeqLen`).
    pub wanted_blocks: usize,
    /// Blocks of one sequence of `maxSeqLen`: fewer and the worker refuses to start.
    pub min_blocks: usize,
}

impl KvBudget {
    /// The bytes the cache may take (0 when the rest already exceeds the share).
    pub fn budget_bytes(&self) -> Option<u64> {
        let m = self.memory?;
        let share = share(m.total, self.fraction);
        let used = m.total.saturating_sub(m.free);
        Some(
            share
                .saturating_sub(used)
                .saturating_sub(self.lora_bytes)
                .saturating_sub(self.activation_bytes),
        )
    }

    /// The block count, or `DoesNotFit` when the budget cannot hold one sequence of the
    /// longest length.
    pub fn blocks(&self) -> Result<usize, ModelError> {
        let Some(budget) = self.budget_bytes() else {
            return Ok(self.wanted_blocks.max(1));
        };
        let fits = (budget / self.bytes_per_block.max(1)).min(usize::MAX as u64) as usize;
        if fits < self.min_blocks {
            return Err(ModelError::DoesNotFit {
                device: self.device.clone(),
                weights_bytes: self.weights_bytes,
                budget_bytes: budget,
                why: format!(
                    "the KV cache needs {} bytes for one sequence of the longest length, \
                     {} fit beside the weights, the LoRA slots ({} bytes) and activations \
                     ({} bytes); lower maxSeqLen or raise gpuMemoryUtilization ({})",
                    self.min_blocks as u64 * self.bytes_per_block,
                    budget,
                    self.lora_bytes,
                    self.activation_bytes,
                    self.fraction
                ),
            });
        }
        Ok(fits.min(self.wanted_blocks).max(1))
    }

    /// `DoesNotFit` when weights of `weights_bytes` alone exceed the share of `memory`
    /// (checked from the files' headers, before anything is allocated).
    pub fn check_weights(
        device: &str,
        memory: Option<DeviceMemory>,
        fraction: f64,
        weights_bytes: u64,
    ) -> Result<(), ModelError> {
        let Some(m) = memory else { return Ok(()) };
        let share = share(m.total, fraction);
        if weights_bytes > share {
            return Err(ModelError::DoesNotFit {
                device: device.to_string(),
                weights_bytes,
                budget_bytes: share,
                why: format!(
                    "the weights exceed gpuMemoryUtilization {fraction} of the device's {} bytes",
                    m.total
                ),
            });
        }
        Ok(())
    }
}

/// `fraction` of `total` bytes, in millionths so that round fractions give round bytes.
fn share(total: u64, fraction: f64) -> u64 {
    let millionths = (fraction.clamp(0.0, 1.0) * 1e6).round() as u128;
    (total as u128 * millionths / 1_000_000) as u64
}

/// The pool's blocks: which are free, how many tables hold each (choices of one request and
/// requests of one cached prefix share full blocks), and which full blocks are cached by
/// their hash (those nobody holds stay until the pool needs them, least recently used first).
#[derive(Debug)]
struct Blocks {
    /// Blocks nobody holds whose content is not cached.
    free: Vec<u32>,
    holders: Vec<u32>,
    cached: PrefixIndex,
}

impl Blocks {
    /// Blocks a reservation can take: the free ones, then the cached ones nobody holds.
    fn available(&self) -> usize {
        self.free.len() + self.cached.idle()
    }

    /// One block for a table (its holder count set to 1): a free one, else the least recently
    /// used cached one, its hash forgotten.
    fn take(&mut self) -> Option<u32> {
        let id = self.free.pop().or_else(|| self.cached.evict())?;
        self.holders[id as usize] = 1;
        Some(id)
    }

    /// One holder fewer for `id`; nobody left: back to the pool (cached blocks stay found).
    fn release(&mut self, id: u32) {
        let held = &mut self.holders[id as usize];
        *held -= 1;
        if *held == 0 {
            match self.cached.is_cached(id) {
                true => self.cached.release(id),
                false => self.free.push(id),
            }
        }
    }
}

/// The blocks, shared by the pool and every block table drawn from it.
type FreeList = Arc<Mutex<Blocks>>;

/// A sequence's blocks, in position order; each goes back to the pool when the last table
/// holding it is dropped (a finished, cancelled or preempted sequence frees its cache by
/// dropping it).
#[derive(Debug)]
pub(super) struct BlockTable {
    pub ids: Vec<u32>,
    /// Leading blocks whose hash the prefix cache has been told (or that came from it).
    pub hashed: usize,
    free: FreeList,
}

impl BlockTable {
    /// A table holding this one's first `blocks` blocks too: they must be full, since both
    /// sequences read them and neither writes them again.
    pub fn share(&self, blocks: usize) -> BlockTable {
        let ids = self.ids[..blocks.min(self.ids.len())].to_vec();
        let mut b = self.free.lock().unwrap_or_else(PoisonError::into_inner);
        for &id in &ids {
            b.holders[id as usize] += 1;
        }
        BlockTable {
            hashed: self.hashed.min(ids.len()),
            ids,
            free: self.free.clone(),
        }
    }
}

impl Drop for BlockTable {
    fn drop(&mut self) {
        let mut b = self.free.lock().unwrap_or_else(PoisonError::into_inner);
        for id in self.ids.drain(..) {
            b.release(id);
        }
    }
}

/// Every layer's keys and values, `[blocks · block_size, kv_heads · head_dim]` each.
pub(super) struct KvPool {
    block_size: usize,
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    free: FreeList,
}

impl KvPool {
    /// Allocates the pool (zeros, so a gather of an unwritten slot reads finite values that
    /// the mask then hides).
    pub fn new(
        layers: usize,
        width: usize,
        opts: &TensorPathOptions,
        dtype: DType,
        device: &Device,
    ) -> Result<Self, ModelError> {
        let (block_size, blocks) = (opts.block_size.max(1), opts.kv_blocks.max(1));
        let slots = block_size * blocks;
        if slots > MAX_KV_SLOTS {
            return Err(ModelError::Config(format!(
                "a KV cache of {blocks} blocks of {block_size} tokens exceeds {MAX_KV_SLOTS} \
                 token slots"
            )));
        }
        let zeros = || Tensor::zeros((slots, width), dtype, device);
        let k = (0..layers).map(|_| zeros()).collect::<Result<_, _>>()?;
        let v = (0..layers).map(|_| zeros()).collect::<Result<_, _>>()?;
        // Popped from the end: the lowest ids go out first, which keeps tests readable.
        let free = (0..blocks as u32).rev().collect();
        Ok(Self {
            block_size,
            k,
            v,
            free: Arc::new(Mutex::new(Blocks {
                free,
                holders: vec![0; blocks],
                cached: PrefixIndex::default(),
            })),
        })
    }

    /// Blocks no sequence holds: free ones and cached ones a reservation may evict.
    pub fn free_blocks(&self) -> usize {
        self.free
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .available()
    }

    /// Cached blocks no sequence holds (counted in [`Self::free_blocks`] too).
    pub fn cached_idle_blocks(&self) -> usize {
        self.free
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .cached
            .idle()
    }

    /// Starts `table` (empty, or None) with the cached blocks of the longest run of `hashes`
    /// from the first, each held; returns how many. Blocks nobody held leave the eviction
    /// order, so the free count drops by those alone.
    pub fn reuse(&self, table: &mut Option<BlockTable>, hashes: &[BlockHash]) -> usize {
        let table = table.get_or_insert_with(|| BlockTable {
            ids: Vec::new(),
            hashed: 0,
            free: self.free.clone(),
        });
        if !table.ids.is_empty() {
            return 0;
        }
        let mut b = self.free.lock().unwrap_or_else(PoisonError::into_inner);
        for &h in hashes {
            let Some(id) = b.cached.get(h) else { break };
            if b.holders[id as usize] == 0 {
                b.cached.hold(id);
            }
            b.holders[id as usize] += 1;
            table.ids.push(id);
        }
        table.hashed = table.ids.len();
        table.ids.len()
    }

    /// Tells the cache the hashes of `table`'s full blocks past those it knows: `hashes[i]` is
    /// block `i`'s, and only blocks of `full` tokens' worth are cached (their keys and values
    /// are written and never written again).
    pub fn register(&self, table: &mut BlockTable, hashes: &[BlockHash], full: usize) {
        let upto = (full / self.block_size)
            .min(hashes.len())
            .min(table.ids.len());
        if upto <= table.hashed {
            return;
        }
        let mut b = self.free.lock().unwrap_or_else(PoisonError::into_inner);
        for (&id, &h) in table.ids[table.hashed..upto]
            .iter()
            .zip(&hashes[table.hashed..upto])
        {
            b.cached.insert(id, h);
        }
        table.hashed = upto;
    }

    /// Blocks a sequence of `tokens` tokens holds.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Extends `table` (a new one when None) to hold `tokens` tokens; all or nothing.
    pub fn reserve(&self, table: &mut Option<BlockTable>, tokens: usize) -> Result<(), ModelError> {
        let table = table.get_or_insert_with(|| BlockTable {
            ids: Vec::new(),
            hashed: 0,
            free: self.free.clone(),
        });
        let need = self.blocks_for(tokens).saturating_sub(table.ids.len());
        if need == 0 {
            return Ok(());
        }
        let mut b = self.free.lock().unwrap_or_else(PoisonError::into_inner);
        if b.available() < need {
            return Err(ModelError::KvCacheFull {
                needed: need,
                free: b.available(),
            });
        }
        for _ in 0..need {
            let id = b.take().expect("counted available");
            table.ids.push(id);
        }
        Ok(())
    }

    /// The slot of position `pos` of a sequence holding `table`.
    pub fn slot(&self, table: &BlockTable, pos: usize) -> u32 {
        table.ids[pos / self.block_size] * self.block_size as u32 + (pos % self.block_size) as u32
    }

    /// Writes layer `li`'s new keys and values (`[tokens, width]`) to their slots, in place,
    /// rounded to the pool's dtype: `slots` is `[tokens, width]` with every row holding its
    /// token's slot.
    pub fn write(
        &self,
        li: usize,
        k: &Tensor,
        v: &Tensor,
        slots: &Tensor,
    ) -> candle_core::Result<()> {
        let dtype = self.k[li].dtype();
        self.k[li].scatter_set(slots, &k.to_dtype(dtype)?.contiguous()?, 0)?;
        self.v[li].scatter_set(slots, &v.to_dtype(dtype)?.contiguous()?, 0)
    }

    /// Layer `li`'s keys and values at `slots` (`[n]`): `[n, width]` each, in the pool's
    /// dtype.
    pub fn gather(&self, li: usize, slots: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
        Ok((
            self.k[li].index_select(slots, 0)?,
            self.v[li].index_select(slots, 0)?,
        ))
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    /// Pool options of `kv_blocks` blocks of `block_size` tokens.
    fn blocks_of(block_size: usize, kv_blocks: usize) -> TensorPathOptions {
        TensorPathOptions {
            block_size,
            kv_blocks,
            ..Default::default()
        }
    }

    fn budget(free: u64, total: u64) -> KvBudget {
        KvBudget {
            device: "cuda:0".into(),
            memory: Some(DeviceMemory { free, total }),
            fraction: 0.9,
            weights_bytes: 16 * GIB,
            lora_bytes: GIB,
            activation_bytes: GIB,
            bytes_per_block: 2 * 1024 * 1024,
            wanted_blocks: 16 * 256,
            min_blocks: 256,
        }
    }

    #[test]
    fn the_budget_is_the_share_less_what_is_used_the_slots_and_activations() {
        // 80 GiB, 17 GiB used (weights and the context): 72 - 17 - 1 - 1 = 53 GiB.
        let b = budget(63 * GIB, 80 * GIB);
        assert_eq!(b.budget_bytes(), Some(53 * GIB));
        // 53 GiB of 2 MiB blocks: 27,136, capped by the limits' 4,096.
        assert_eq!(b.blocks().unwrap(), 4096);
        let mut wide = b.clone();
        wide.wanted_blocks = 100_000;
        assert_eq!(wide.blocks().unwrap(), 27_136);
        // Another process holding 40 GiB more leaves 13 GiB: 6,656 blocks.
        let mut shared = wide.clone();
        shared.memory = Some(DeviceMemory {
            free: 23 * GIB,
            total: 80 * GIB,
        });
        assert_eq!(shared.blocks().unwrap(), 6656);
    }

    #[test]
    fn a_budget_short_of_one_long_sequence_refuses_with_the_numbers() {
        // 24 GiB device at 0.9: 21.6 - 17 - 2 = 2.6 GiB: 1,331 blocks, fine; at 0.75:
        // 18 - 19 < 0: nothing.
        let mut b = budget(7 * GIB, 24 * GIB);
        assert_eq!(b.blocks().unwrap(), 1331);
        b.fraction = 0.75;
        match b.blocks() {
            Err(e @ ModelError::DoesNotFit { .. }) => {
                assert_eq!(e.code(), "model_does_not_fit");
                let m = e.to_string();
                assert!(
                    m.contains("cuda:0") && m.contains("weights 17179869184 bytes"),
                    "{m}"
                );
                assert!(m.contains("budget 0 bytes"), "{m}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_cpu_sizes_from_the_limits() {
        let mut b = budget(0, 0);
        b.memory = None;
        assert_eq!(b.budget_bytes(), None);
        assert_eq!(b.blocks().unwrap(), 4096);
        assert!(KvBudget::check_weights("cpu", None, 0.9, u64::MAX).is_ok());
    }

    #[test]
    fn weights_beyond_the_share_refuse_before_loading() {
        let m = Some(DeviceMemory {
            free: 80 * GIB,
            total: 80 * GIB,
        });
        assert!(KvBudget::check_weights("cuda:0", m, 0.9, 70 * GIB).is_ok());
        let e = KvBudget::check_weights("cuda:0", m, 0.9, 73 * GIB).unwrap_err();
        assert_eq!(e.code(), "model_does_not_fit");
        assert!(e.to_string().contains("weights exceed"), "{e}");
    }

    #[test]
    fn blocks_are_reserved_all_or_nothing_and_return_when_a_table_drops() {
        let opts = blocks_of(4, 3);
        let pool = KvPool::new(1, 2, &opts, DType::F32, &Device::Cpu).unwrap();
        let mut a = None;
        pool.reserve(&mut a, 5).unwrap();
        assert_eq!(a.as_ref().unwrap().ids, [0, 1]);
        assert_eq!(pool.free_blocks(), 1);
        assert_eq!(pool.slot(a.as_ref().unwrap(), 5), 5);
        let mut b = None;
        match pool.reserve(&mut b, 8) {
            Err(ModelError::KvCacheFull { needed: 2, free: 1 }) => {}
            other => panic!("{other:?}"),
        }
        assert_eq!(pool.free_blocks(), 1, "a refused reservation takes nothing");
        pool.reserve(&mut a, 8).unwrap();
        assert_eq!(pool.free_blocks(), 1, "still inside its second block");
        drop(a);
        assert_eq!(pool.free_blocks(), 3);
    }

    /// Shared blocks go back to the pool only when the last table holding them drops.
    #[test]
    fn a_shared_block_is_free_once_every_holder_dropped_it() {
        let opts = blocks_of(4, 4);
        let pool = KvPool::new(1, 2, &opts, DType::F32, &Device::Cpu).unwrap();
        let mut a = None;
        pool.reserve(&mut a, 10).unwrap();
        assert_eq!(pool.free_blocks(), 1);
        let mut b = Some(a.as_ref().unwrap().share(2));
        assert_eq!(b.as_ref().unwrap().ids, [0, 1]);
        assert_eq!(pool.free_blocks(), 1, "sharing takes no block");
        pool.reserve(&mut b, 9).unwrap();
        assert_eq!(b.as_ref().unwrap().ids, [0, 1, 3]);
        assert_eq!(pool.free_blocks(), 0);
        drop(a);
        assert_eq!(pool.free_blocks(), 1, "only block 2 was a's alone");
        drop(b);
        assert_eq!(pool.free_blocks(), 4);
    }

    /// A finished sequence's hashed full blocks stay found; a new table takes them held,
    /// without counting them as new; a partial block is never cached.
    #[test]
    fn cached_blocks_outlive_their_table_and_are_reused_held() {
        let pool = KvPool::new(1, 2, &blocks_of(4, 4), DType::F32, &Device::Cpu).unwrap();
        let mut a = None;
        pool.reserve(&mut a, 10).unwrap();
        pool.register(a.as_mut().unwrap(), &[7, 8, 9], 10);
        assert_eq!(a.as_ref().unwrap().hashed, 2, "the third block is not full");
        drop(a);
        assert_eq!(
            pool.free_blocks(),
            4,
            "cached blocks nobody holds count as free"
        );
        assert_eq!(pool.cached_idle_blocks(), 2);
        let mut b = None;
        assert_eq!(pool.reuse(&mut b, &[7, 8, 9]), 2);
        assert_eq!(b.as_ref().unwrap().ids, [0, 1]);
        assert_eq!(pool.free_blocks(), 2, "held again: out of the free count");
        let mut c = None;
        assert_eq!(
            pool.reuse(&mut c, &[7, 6]),
            1,
            "the run stops at the first miss"
        );
        assert_eq!(
            pool.free_blocks(),
            2,
            "a block someone holds costs nothing more"
        );
        drop(b);
        assert_eq!(pool.free_blocks(), 3, "c still holds block 0");
        drop(c);
        assert_eq!(pool.free_blocks(), 4);
    }

    /// When the free blocks run out, a reservation evicts the least recently released cached
    /// block (its hash forgotten), never one a table holds.
    #[test]
    fn reservations_evict_cached_blocks_least_recently_used_first() {
        let pool = KvPool::new(1, 2, &blocks_of(4, 3), DType::F32, &Device::Cpu).unwrap();
        let (mut a, mut b) = (None, None);
        pool.reserve(&mut a, 4).unwrap();
        pool.reserve(&mut b, 4).unwrap();
        pool.register(a.as_mut().unwrap(), &[1], 4);
        pool.register(b.as_mut().unwrap(), &[2], 4);
        drop(a);
        drop(b);
        let mut held = None;
        assert_eq!(pool.reuse(&mut held, &[2]), 1);
        let mut c = None;
        pool.reserve(&mut c, 8).unwrap();
        assert_eq!(c.as_ref().unwrap().ids, [2, 0], "the free block, then a's");
        let mut again = None;
        assert_eq!(pool.reuse(&mut again, &[1]), 0, "a's block was evicted");
        assert_eq!(pool.reuse(&mut again, &[2]), 1, "b's, held, was not");
        match pool.reserve(&mut None, 4) {
            Err(ModelError::KvCacheFull { needed: 1, free: 0 }) => {}
            other => panic!("{other:?}"),
        }
    }

    /// A cache past what a step's f32 indices address exactly is refused before anything is
    /// allocated; one at the bound is not.
    #[test]
    fn a_cache_beyond_the_exact_slots_is_refused() {
        let at = |kv_blocks| blocks_of(16, kv_blocks);
        match KvPool::new(1, 1, &at(MAX_KV_SLOTS / 16 + 1), DType::U8, &Device::Cpu) {
            Err(ModelError::Config(m)) => assert!(m.contains("16777216"), "{m}"),
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("a cache of more than 2^24 slots was allocated"),
        }
        assert!(KvPool::new(1, 1, &at(MAX_KV_SLOTS / 16), DType::U8, &Device::Cpu).is_ok());
    }

    #[test]
    fn writes_land_in_their_slots_and_gathers_read_them() {
        let opts = blocks_of(2, 4);
        let dev = Device::Cpu;
        let pool = KvPool::new(2, 3, &opts, DType::F32, &dev).unwrap();
        let k = Tensor::new(&[[1f32, 2., 3.], [4., 5., 6.]], &dev).unwrap();
        let v = (&k * 10.).unwrap();
        let slots = Tensor::new(&[5u32, 2], &dev)
            .unwrap()
            .reshape((2, 1))
            .unwrap()
            .broadcast_as((2, 3))
            .unwrap()
            .contiguous()
            .unwrap();
        pool.write(1, &k, &v, &slots).unwrap();
        let at = Tensor::new(&[2u32, 5, 0], &dev).unwrap();
        let (gk, gv) = pool.gather(1, &at).unwrap();
        assert_eq!(
            gk.to_vec2::<f32>().unwrap(),
            [[4., 5., 6.], [1., 2., 3.], [0., 0., 0.]]
        );
        assert_eq!(gv.to_vec2::<f32>().unwrap()[0], [40., 50., 60.]);
        let (other, _) = pool.gather(0, &at).unwrap();
        assert_eq!(other.sum_all().unwrap().to_scalar::<f32>().unwrap(), 0.0);
    }
}
