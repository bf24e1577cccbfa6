//! Automatic prefix caching: full KV blocks kept after the sequences that computed them are
//! gone, found again by the hash of their content, as vLLM's automatic prefix caching does.
//!
//! A block's hash ([`BlockHash`]) is given by the engine: it chains the hash of the block
//! before it with the block's tokens (and images) and starts from the adapter's identity, so
//! equal hashes mean the same tokens after the same prefix under the same weights. This file
//! only keeps which block holds which hash, and which cached blocks nobody holds, least
//! recently used first: the tensor path's pool takes those last, evicting their hashes
//! ([`super::kv`]); the host path keeps copies of cached blocks in a [`HostBlocks`] store,
//! which sequences then read in place.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use super::kvbuf::KvBuf;

/// The identity of a full block's content: its tokens, its images, the blocks before it and
/// the weights that computed it. 128 bits of SHA-256 (see `engine::prefix`).
pub type BlockHash = u128;

/// A block of the host path's prefix store: every layer's keys then values of its tokens,
/// token-major (`[layer][keys | values][tokens, kv_heads, head_dim]`), in the decoder's KV
/// dtype. Never written once stored, so sequences read it in place.
pub(super) type HostBlock = Arc<KvBuf>;

/// Which block holds which hash, and the cached blocks no sequence holds by the time they
/// were last used (the LRU order of eviction).
#[derive(Debug, Default)]
pub(super) struct PrefixIndex {
    by_hash: HashMap<BlockHash, u32>,
    hash_of: HashMap<u32, BlockHash>,
    /// Cached blocks nobody holds, by the tick they were released at.
    idle: BTreeMap<u64, u32>,
    idle_since: HashMap<u32, u64>,
    clock: u64,
}

impl PrefixIndex {
    /// The block holding `hash`, if any.
    pub fn get(&self, hash: BlockHash) -> Option<u32> {
        self.by_hash.get(&hash).copied()
    }

    /// Whether `block` holds a hash.
    pub fn is_cached(&self, block: u32) -> bool {
        self.hash_of.contains_key(&block)
    }

    /// Records that `block` holds `hash`. A hash already held by another block (two sequences
    /// computed the same block at once) keeps its first block, and this one stays uncached:
    /// returns whether it was recorded.
    pub fn insert(&mut self, block: u32, hash: BlockHash) -> bool {
        if self.by_hash.contains_key(&hash) || self.hash_of.contains_key(&block) {
            return false;
        }
        self.by_hash.insert(hash, block);
        self.hash_of.insert(block, hash);
        true
    }

    /// Cached blocks nobody holds.
    pub fn idle(&self) -> usize {
        self.idle.len()
    }

    /// Marks cached `block` as held by nobody, the most recently used.
    pub fn release(&mut self, block: u32) {
        self.hold(block);
        self.clock += 1;
        self.idle.insert(self.clock, block);
        self.idle_since.insert(block, self.clock);
    }

    /// Marks cached `block` as held (out of the eviction order).
    pub fn hold(&mut self, block: u32) {
        if let Some(t) = self.idle_since.remove(&block) {
            self.idle.remove(&t);
        }
    }

    /// Evicts the least recently used idle block: forgets its hash and returns it.
    pub fn evict(&mut self) -> Option<u32> {
        let (_, block) = self.idle.pop_first()?;
        self.idle_since.remove(&block);
        if let Some(h) = self.hash_of.remove(&block) {
            self.by_hash.remove(&h);
        }
        Some(block)
    }
}

/// The host path's cached blocks: copies of blocks' keys and values of every layer
/// (`layers × 2 × tokens × width` values each, in the KV dtype), at most `capacity` blocks, evicted least
/// recently used. A host-path sequence grows its own token-major cache, which its attention
/// kernel reads in place; a hit copies the blocks into it, which costs far less than
/// computing them (a copy of 46 KB per token for SmolLM2 against its forward pass).
///
/// Besides the full blocks found by their hash chain, the store finds a block by its tokens
/// among the blocks cached after the same parent (the hash of the full block before it), and
/// keeps a finished sequence's last, partial block that way: a prompt sent again, or a
/// conversation going on, reuses every token computed before but the one whose logits the
/// step needs, as llama.cpp's prompt cache and SGLang's radix cache do, where whole blocks
/// alone leave up to a block's tokens to compute again.
#[derive(Debug)]
pub(super) struct HostBlocks {
    index: PrefixIndex,
    data: Vec<HostBlock>,
    meta: Vec<Option<Meta>>,
    /// The blocks that follow each parent, findable by their tokens.
    children: HashMap<BlockHash, Vec<u32>>,
    /// Keys of partial blocks (which have no hash of their own), counting down from the top
    /// of the hash space.
    partial_keys: BlockHash,
    capacity: usize,
}

/// What finds a cached block by its tokens.
#[derive(Debug)]
struct Meta {
    parent: BlockHash,
    tokens: Vec<u32>,
}

/// Where a block stored in the host store goes: its parent (the hash of the full block
/// before it, or the chain's seed) and its tokens, when it may be found by them (a block
/// holding an image's placeholders may not: its tokens do not say which image).
pub struct BlockKey<'t> {
    /// The hash of the block before it, or the chain's seed for the first.
    pub parent: BlockHash,
    /// Its tokens; None when it may be found by its hash only.
    pub tokens: Option<&'t [u32]>,
}

impl HostBlocks {
    /// An empty store of at most `capacity` blocks.
    pub fn new(capacity: usize) -> Self {
        Self {
            index: PrefixIndex::default(),
            data: Vec::new(),
            meta: Vec::new(),
            children: HashMap::new(),
            partial_keys: BlockHash::MAX,
            capacity: capacity.max(1),
        }
    }

    /// The blocks cached for the longest run of `hashes` from the first: each marked most
    /// recently used.
    pub fn lookup(&mut self, hashes: &[BlockHash]) -> Vec<u32> {
        let found: Vec<u32> = hashes.iter().map_while(|&h| self.index.get(h)).collect();
        for &b in &found {
            self.index.release(b);
        }
        found
    }

    /// The cached block after `parent` whose tokens start with the longest run of `tokens`
    /// (at least one), marked most recently used, and the length of that run.
    pub fn longest(&mut self, parent: BlockHash, tokens: &[u32]) -> Option<(u32, usize)> {
        let common = |b: &u32| {
            let m = self.meta[*b as usize].as_ref()?;
            let n = m
                .tokens
                .iter()
                .zip(tokens)
                .take_while(|(a, b)| a == b)
                .count();
            Some((*b, n))
        };
        let best = self
            .children
            .get(&parent)?
            .iter()
            .filter_map(common)
            .max_by_key(|&(_, n)| n)
            .filter(|&(_, n)| n > 0)?;
        self.index.release(best.0);
        Some(best)
    }

    /// A block's data, which a sequence may hold past its eviction (a block evicted while
    /// held is not written again: its slot takes a new buffer).
    pub fn data(&self, block: u32) -> &HostBlock {
        &self.data[block as usize]
    }

    /// Tokens a block holds (a partial block fewer than a full one).
    pub fn tokens(&self, block: u32, full: usize) -> usize {
        self.meta[block as usize]
            .as_ref()
            .map_or(full, |m| m.tokens.len())
    }

    /// Whether `hash` is cached (marked most recently used when it is).
    pub fn touch(&mut self, hash: BlockHash) -> bool {
        match self.index.get(hash) {
            Some(b) => {
                self.index.release(b);
                true
            }
            None => false,
        }
    }

    /// Stores a full block under `hash`, `fill` writing its data into the buffer it is given
    /// (cleared: the memory of a block this slot held before); evicts the least recently used block when full.
    pub fn insert(&mut self, hash: BlockHash, key: BlockKey<'_>, fill: impl FnOnce(&mut KvBuf)) {
        if self.touch(hash) {
            return;
        }
        self.put(hash, key, fill);
    }

    /// Stores a partial block (`key.tokens`, fewer than a full block's), found by its tokens
    /// after `key.parent` only; nothing when a block after the same parent already starts
    /// with those tokens.
    pub fn insert_partial(&mut self, key: BlockKey<'_>, fill: impl FnOnce(&mut KvBuf)) {
        let Some(tokens) = key.tokens.filter(|t| !t.is_empty()) else {
            return;
        };
        // A block that already starts with these tokens covers them (`longest` marked it used).
        if self
            .longest(key.parent, tokens)
            .is_some_and(|(_, n)| n == tokens.len())
        {
            return;
        }
        self.partial_keys -= 1;
        let hash = self.partial_keys;
        self.put(hash, key, fill);
    }

    fn put(&mut self, hash: BlockHash, key: BlockKey<'_>, fill: impl FnOnce(&mut KvBuf)) {
        let block = match self.data.len() < self.capacity {
            true => {
                self.data.push(HostBlock::default());
                self.meta.push(None);
                (self.data.len() - 1) as u32
            }
            false => match self.index.evict() {
                Some(b) => {
                    self.forget(b);
                    b
                }
                None => return,
            },
        };
        let slot = &mut self.data[block as usize];
        if Arc::get_mut(slot).is_none() {
            *slot = HostBlock::default();
        }
        let buf = Arc::get_mut(slot).expect("a new or unshared buffer");
        buf.clear();
        fill(buf);
        if let Some(tokens) = key.tokens {
            self.children.entry(key.parent).or_default().push(block);
            self.meta[block as usize] = Some(Meta {
                parent: key.parent,
                tokens: tokens.to_vec(),
            });
        }
        self.index.insert(block, hash);
        self.index.release(block);
    }

    /// Takes an evicted block out of the index by tokens.
    fn forget(&mut self, block: u32) {
        let Some(m) = self.meta[block as usize].take() else {
            return;
        };
        if let Some(v) = self.children.get_mut(&m.parent) {
            v.retain(|&b| b != block);
            if v.is_empty() {
                self.children.remove(&m.parent);
            }
        }
    }

    /// Blocks cached.
    pub fn len(&self) -> usize {
        self.index.idle()
    }
}

#[cfg(test)]
mod tests {
    use super::super::kvbuf::KvElem;
    use super::*;

    fn key(parent: BlockHash, tokens: Option<&[u32]>) -> BlockKey<'_> {
        BlockKey { parent, tokens }
    }

    #[test]
    fn idle_blocks_are_evicted_least_recently_used_first_and_lose_their_hash() {
        let mut ix = PrefixIndex::default();
        for (b, h) in [(0, 10), (1, 11), (2, 12)] {
            assert!(ix.insert(b, h));
        }
        assert!(!ix.insert(3, 10), "a hash keeps its first block");
        ix.release(1);
        ix.release(0);
        ix.release(2);
        ix.hold(0);
        assert_eq!(ix.idle(), 2);
        assert_eq!(ix.evict(), Some(1));
        assert_eq!(ix.get(11), None);
        assert_eq!(ix.evict(), Some(2));
        assert_eq!(ix.evict(), None, "a held block is never evicted");
        assert_eq!(ix.get(10), Some(0));
    }

    #[test]
    fn the_host_store_finds_the_longest_run_and_evicts_the_least_recently_used() {
        let mut s = HostBlocks::new(2);
        s.insert(1, key(0, None), |b| b.append(&[1.0], 1));
        s.insert(2, key(1, None), |b| b.append(&[2.0], 1));
        assert_eq!(s.lookup(&[1, 2, 3]), [0, 1]);
        // 1 was used before 2 in that lookup: it goes first.
        s.insert(3, key(2, None), |b| b.append(&[3.0], 1));
        assert_eq!(s.lookup(&[1]), Vec::<u32>::new());
        assert_eq!(s.lookup(&[2, 3]), [1, 0]);
        assert_eq!(f32::of(s.data(0))[..], [3.0]);
        assert_eq!(s.len(), 2);
    }

    #[test]
    fn the_host_store_finds_a_block_by_its_tokens_after_the_same_parent() {
        let mut s = HostBlocks::new(3);
        s.insert(10, key(7, Some(&[1, 2, 3, 4])), |b| b.append(&[10.0], 1));
        s.insert(11, key(7, Some(&[1, 2, 9, 9])), |b| b.append(&[11.0], 1));
        s.insert(12, key(8, None), |b| b.append(&[12.0], 1));
        assert_eq!(s.longest(7, &[1, 2, 3]), Some((0, 3)), "the longest run");
        assert_eq!(s.longest(7, &[1, 2, 9, 9]), Some((1, 4)));
        assert_eq!(s.longest(7, &[5]), None, "no token in common");
        assert_eq!(s.longest(9, &[1]), None, "another parent");
        assert_eq!(s.longest(8, &[1]), None, "found by its hash only");
        // A partial block already covered is not stored again.
        s.insert_partial(key(7, Some(&[1, 2, 3])), |b| b.append(&[0.0], 1));
        assert_eq!(s.len(), 3);
        // A new one evicts the least recently used (12), and then is found by its tokens.
        s.insert_partial(key(7, Some(&[1, 5])), |b| b.append(&[13.0], 1));
        assert!(!s.touch(12));
        assert_eq!(s.longest(7, &[1, 5, 6]), Some((2, 2)));
        assert_eq!(s.tokens(2, 4), 2);
        assert_eq!(f32::of(s.data(2))[..], [13.0]);
        // Evicted, a block is no longer found by its tokens: 10 then 11 go.
        s.insert(20, key(1, None), |b| b.append(&[20.0], 1));
        s.insert(21, key(1, None), |b| b.append(&[21.0], 1));
        assert_eq!(
            s.longest(7, &[1, 2, 3]),
            Some((2, 1)),
            "only the partial one is left"
        );
    }

    /// A block a sequence still reads is never written again: evicting it gives its slot a
    /// new buffer and leaves the sequence's data as it was.
    #[test]
    fn an_evicted_block_a_sequence_holds_keeps_its_data() {
        let mut s = HostBlocks::new(1);
        s.insert(1, key(0, None), |b| b.append(&[1.0], 1));
        let held = s.data(0).clone();
        s.insert(2, key(0, None), |b| b.append(&[2.0], 1));
        assert_eq!(s.lookup(&[1]), Vec::<u32>::new(), "evicted");
        assert_eq!(f32::of(&held)[..], [1.0]);
        assert_eq!(f32::of(s.data(0))[..], [2.0]);
        drop(held);
        s.insert(3, key(0, None), |b| b.append(&[3.0], 1));
        assert_eq!(f32::of(s.data(0))[..], [3.0]);
    }
}
