//! The paged KV cache of the tensor path (what GPUs run): per layer one key and one value
//! tensor of `blocks × block_size` slots, allocated once and written in place, and per
//! sequence a table of the blocks it holds. Memory is bounded up front (no tensor grows or is
//! concatenated per step), sequences of any lengths share it without fragmentation, and the
//! attention of a whole batch reads every row's keys through one gather.

use std::sync::{Arc, Mutex, PoisonError};

use candle_core::{DType, Device, Tensor};

use super::ModelError;

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
        }
    }
}

/// Free block ids, shared by the pool and every block table drawn from it.
type FreeList = Arc<Mutex<Vec<u32>>>;

/// A sequence's blocks, in position order; they go back to the pool when the table is dropped
/// (a finished, cancelled or preempted sequence frees its cache by dropping it).
#[derive(Debug)]
pub(super) struct BlockTable {
    pub ids: Vec<u32>,
    free: FreeList,
}

impl Drop for BlockTable {
    fn drop(&mut self) {
        self.free
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend(self.ids.drain(..));
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
        let zeros = || Tensor::zeros((slots, width), dtype, device);
        let k = (0..layers).map(|_| zeros()).collect::<Result<_, _>>()?;
        let v = (0..layers).map(|_| zeros()).collect::<Result<_, _>>()?;
        // Popped from the end: the lowest ids go out first, which keeps tests readable.
        let free = (0..blocks as u32).rev().collect();
        Ok(Self {
            block_size,
            k,
            v,
            free: Arc::new(Mutex::new(free)),
        })
    }

    /// Blocks no sequence holds.
    pub fn free_blocks(&self) -> usize {
        self.free
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// Blocks a sequence of `tokens` tokens holds.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Extends `table` (a new one when None) to hold `tokens` tokens; all or nothing.
    pub fn reserve(&self, table: &mut Option<BlockTable>, tokens: usize) -> Result<(), ModelError> {
        let table = table.get_or_insert_with(|| BlockTable {
            ids: Vec::new(),
            free: self.free.clone(),
        });
        let need = self.blocks_for(tokens).saturating_sub(table.ids.len());
        if need == 0 {
            return Ok(());
        }
        let mut free = self.free.lock().unwrap_or_else(PoisonError::into_inner);
        if free.len() < need {
            return Err(ModelError::KvCacheFull {
                needed: need,
                free: free.len(),
            });
        }
        let at = free.len() - need;
        table.ids.extend(free.drain(at..).rev());
        Ok(())
    }

    /// The slot of position `pos` of a sequence holding `table`.
    pub fn slot(&self, table: &BlockTable, pos: usize) -> u32 {
        table.ids[pos / self.block_size] * self.block_size as u32 + (pos % self.block_size) as u32
    }

    /// Writes layer `li`'s new keys and values (`[tokens, width]`) to their slots, in place:
    /// `slots` is `[tokens, width]` with every row holding its token's slot.
    pub fn write(
        &self,
        li: usize,
        k: &Tensor,
        v: &Tensor,
        slots: &Tensor,
    ) -> candle_core::Result<()> {
        self.k[li].scatter_set(slots, &k.contiguous()?, 0)?;
        self.v[li].scatter_set(slots, &v.contiguous()?, 0)
    }

    /// Layer `li`'s keys and values at `slots` (`[n]`): `[n, width]` each.
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

    #[test]
    fn blocks_are_reserved_all_or_nothing_and_return_when_a_table_drops() {
        let opts = TensorPathOptions {
            block_size: 4,
            kv_blocks: 3,
            ..Default::default()
        };
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

    #[test]
    fn writes_land_in_their_slots_and_gathers_read_them() {
        let opts = TensorPathOptions {
            block_size: 2,
            kv_blocks: 4,
            ..Default::default()
        };
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
