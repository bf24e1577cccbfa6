//! The hashes of a sequence's full KV blocks, by which automatic prefix caching finds blocks
//! another sequence computed (see [`mole_model::BlockHash`]).
//!
//! Block `i`'s hash is SHA-256 over the hash of block `i - 1` (block 0: the seed of the
//! weights that compute it, [`seed`]), the block's token ids, and for each image placeholder
//! in it the image's digest and which of its embedding rows it takes; kept to 128 bits. So
//! two blocks hash alike only when the whole prefix up to their end is the same tokens and
//! images under the same weights: a block computed under one adapter (or version) is never
//! found by a request under another, or under the base. 128 bits make an accidental
//! collision negligible: among a billion cached blocks its chance is about 1.5e-21 (the
//! birthday bound n²/2^129), far below that of a memory fault; and vLLM keys its cache with
//! SHA-256 for the same reason (`--prefix-caching-hash-algo sha256`).

use sha2::{Digest, Sha256};

use super::images::ImagePrompt;
use crate::lora::registry::Pinned;
use mole_model::BlockHash;

/// The first 128 bits of a SHA-256 digest.
fn truncate(d: &[u8]) -> BlockHash {
    let mut b = [0u8; 16];
    b.copy_from_slice(&d[..16]);
    BlockHash::from_le_bytes(b)
}

/// The hash a chain of blocks starts from: the weights that compute its keys and values.
/// The base model's, or an adapter's name, version and the identity of its weights (of the
/// files it was read from, as they were: a version loaded again from the same unchanged
/// files finds its blocks again, one loaded from other files is other weights); and the
/// request's `cache_salt` when it has one (vLLM's: requests of different salts share
/// nothing), and its tenant (a digest of the caller's API key) when the server gives one, so
/// that tenants share nothing either.
pub(super) fn seed(
    adapter: Option<&Pinned>,
    salt: Option<&str>,
    tenant: Option<&[u8; 32]>,
) -> BlockHash {
    let mut h = Sha256::new();
    if let Some(t) = tenant {
        h.update(b"mole/prefix/tenant\0");
        h.update(t);
    }
    if let Some(salt) = salt {
        h.update(b"mole/prefix/salt\0");
        h.update((salt.len() as u64).to_le_bytes());
        h.update(salt.as_bytes());
    }
    match adapter {
        None => h.update(b"mole/prefix/base"),
        Some(p) => {
            h.update(b"mole/prefix/adapter\0");
            h.update(p.name.as_bytes());
            h.update([0]);
            h.update(p.version.as_bytes());
            h.update([0]);
            h.update(p.adapter.weights_key().to_le_bytes());
        }
    }
    truncate(&h.finalize())
}

/// Extends `hashes` (the chain from `seed`) to the first `blocks` full blocks of `block`
/// tokens of the sequence `prompt` then `generated`; never past the tokens known. `images`:
/// the prompt's images, whose placeholders' content enters their blocks' hashes.
pub(super) fn extend(
    hashes: &mut Vec<BlockHash>,
    seed: BlockHash,
    block: usize,
    blocks: usize,
    prompt: &[u32],
    generated: &[u32],
    images: Option<&ImagePrompt>,
) {
    let block = block.max(1);
    let blocks = blocks.min((prompt.len() + generated.len()) / block);
    while hashes.len() < blocks {
        let i = hashes.len();
        let parent = hashes.last().copied().unwrap_or(seed);
        let mut h = Sha256::new();
        h.update(parent.to_le_bytes());
        for p in i * block..(i + 1) * block {
            let t = match prompt.get(p) {
                Some(&t) => t,
                None => generated[p - prompt.len()],
            };
            h.update(t.to_le_bytes());
        }
        if let Some(img) = images {
            for (at, digest, row) in img.keys_in(i * block, (i + 1) * block) {
                h.update(at.to_le_bytes());
                h.update(digest);
                h.update(row.to_le_bytes());
            }
        }
        hashes.push(truncate(&h.finalize()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(seed: BlockHash, tokens: &[u32], generated: &[u32]) -> Vec<BlockHash> {
        let mut h = Vec::new();
        extend(&mut h, seed, 4, usize::MAX, tokens, generated, None);
        h
    }

    #[test]
    fn a_block_hash_covers_its_whole_prefix_and_the_weights() {
        let base = seed(None, None, None);
        assert_ne!(seed(None, Some("x"), None), base, "a salt changes the seed");
        let t = Some(&[7u8; 32]);
        assert_ne!(seed(None, None, t), base, "a tenant changes the seed");
        assert_ne!(seed(None, None, t), seed(None, None, Some(&[8u8; 32])));
        assert_ne!(seed(None, Some("x"), t), seed(None, Some("x"), None));
        let a = chain(base, &[1, 2, 3, 4, 5, 6, 7, 8, 9], &[]);
        assert_eq!(a.len(), 2, "the partial third block has no hash");
        let b = chain(base, &[1, 2, 3, 4, 5, 6, 7, 9], &[]);
        assert_eq!(a[0], b[0]);
        assert_ne!(a[1], b[1]);
        let c = chain(base, &[0, 2, 3, 4, 5, 6, 7, 8], &[]);
        assert_ne!(a[1], c[1], "a block's hash depends on the blocks before it");
        assert_eq!(chain(base, &[1, 2, 3, 4, 5], &[6, 7, 8]), a);
        let other = chain(BlockHash::MAX, &[1, 2, 3, 4], &[]);
        assert_ne!(other[0], a[0], "another seed, other hashes");
        let mut part = chain(base, &[1, 2, 3, 4], &[]);
        extend(
            &mut part,
            base,
            4,
            2,
            &[1, 2, 3, 4, 5, 6, 7, 8, 9],
            &[],
            None,
        );
        assert_eq!(part, a, "extending goes on from where the chain was");
    }
}
