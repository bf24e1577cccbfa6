//! What one step runs: which waiting sequences join, which prompt chunks and decode tokens
//! the forward pass takes, and on the tensor path whether the paged KV cache holds them.
//!
//! On the tensor path memory is a fixed pool of KV blocks. A waiting sequence joins only when
//! the free blocks hold its context besides one new block per running sequence; and when a
//! step would need more blocks than are free (running sequences grew), the youngest running
//! sequence is preempted: its blocks go back and it waits at the head of the queue, to be
//! recomputed from its prompt and what it generated (vLLM's recompute preemption). The pool is
//! never overrun, and no request fails for lack of memory that a later step would have.

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::Ordering;

use super::seq::Seq;
use super::Shared;
use mole_model::BackendKind;

/// What one row of the step does for its sequence.
#[derive(Clone, Copy)]
pub(super) enum Work {
    /// Context tokens `[from, to)`; the last chunk samples the next token.
    Prefill(usize, usize),
    /// One decode token.
    Decode,
}

/// Moves waiting sequences into the batch, oldest first, while it has room (for every choice
/// of a request) and, on the tensor path, while the free KV blocks hold their context. A
/// request's choices count as rows from admission on, while the first still carries them: they
/// join after its prompt is in the cache, so the batch never grows past `maxBatchSize` then.
/// Returns how many were admitted (the caller takes them off the waiting count once the batch
/// that holds them is published, so a request is never counted in neither).
// Sequences stay boxed, as the scheduler keeps them: they move between the queue and the
// batch, and a sequence is large.
#[allow(clippy::vec_box)]
pub(super) fn admit(
    shared: &Shared,
    running: &mut Vec<Box<Seq>>,
    waiting: &mut VecDeque<Box<Seq>>,
) -> usize {
    let by_blocks = shared.model.backend_kind().admits_by_blocks();
    let mut free = shared.model.free_blocks();
    let block = shared.model.tensor_path().block_size.max(1);
    let mut rows: usize = running.iter().map(|s| 1 + s.forks.len()).sum();
    let mut admitted = 0;
    while let Some(s) = waiting.front_mut() {
        // A request of several choices joins with room for all of them.
        let width = 1 + s.forks.len();
        if rows + width > shared.opts.max_batch_size {
            break;
        }
        let before = shared.model.free_blocks();
        let reused = reuse_prefix(shared, s);
        if by_blocks {
            // Cached blocks nobody held were counted free: they are held now.
            free = free.saturating_sub(before.saturating_sub(shared.model.free_blocks()));
            // Room for the blocks of its context not in the cache, and for one new block of
            // every row and of each of its other choices.
            let new = s.context.len().div_ceil(block) - s.cache.blocks();
            let need = new + rows + width;
            if need > free && !running.is_empty() {
                // It waits; the blocks it found go back (still cached).
                s.cache.clear();
                s.prefilled = 0;
                break;
            }
            free = free.saturating_sub(new);
        }
        let mut s = waiting.pop_front().expect("peeked");
        // A preempted sequence readmitted looks its blocks up again, but its prompt was
        // counted when it first came in: vLLM counts a resumed request's lookups apart from
        // `prefix_cache_queries`, whose hit rate is then that of requests as clients sent them.
        if let Some(tokens) = reused.filter(|_| !s.queried) {
            count_prefix(shared, &s, tokens);
            s.queried = true;
            s.cached = tokens;
        }
        s.trace.prefilling(s.context.len());
        rows += width;
        admitted += 1;
        running.push(s);
    }
    admitted
}

/// Starts `s`'s empty cache with the longest run of its context's full blocks that the prefix
/// cache holds, leaving at least its last token to compute (the step needs that token's
/// logits). Returns the tokens reused, or None when prefix caching is off.
fn reuse_prefix(shared: &Shared, s: &mut Seq) -> Option<usize> {
    if !shared.opts.prefix_caching || !s.cache.is_empty() {
        return None;
    }
    let block = shared.model.tensor_path().block_size.max(1);
    let blocks = (s.context.len() - 1) / block;
    let blocks = s.block_hashes(block, blocks).len();
    // Every token but the last may be reused; found by their tokens past the full blocks
    // (host path) when no image is among them.
    let mut cache = std::mem::take(&mut s.cache);
    let tokens = s.plain_tokens(s.context.len() - 1);
    let reused =
        shared
            .model
            .reuse_prefix(&mut cache, &s.hashes[..blocks], s.seed, tokens.as_deref());
    drop(tokens);
    s.cache = cache;
    let reused = match reused {
        Ok(n) => n,
        Err(e) => {
            // The cache's failure only costs the recomputation.
            tracing::warn!(request = %s.id, error = %e, "prefix cache lookup failed");
            s.cache.clear();
            0
        }
    };
    s.prefilled = reused;
    Some(reused)
}

/// Counts an admitted sequence's prefix-cache query and hit, in tokens (vLLM's
/// `prefix_cache_queries` and `prefix_cache_hits`), under its adapter.
fn count_prefix(shared: &Shared, s: &Seq, hit: usize) {
    let adapter = s.adapter.as_ref().map_or("", |p| p.name.as_str());
    let mut counts = shared
        .prefix_counts
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let c = counts.entry(adapter.to_string()).or_default();
    c.0 += s.context.len() as u64;
    c.1 += hit as u64;
}

/// The prefix-cache counts so far, by adapter.
pub(super) fn prefix_counts(shared: &Shared) -> Vec<super::api::PrefixCacheCounts> {
    let counts = shared
        .prefix_counts
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    counts
        .iter()
        .map(
            |(adapter, &(queries, hits))| super::api::PrefixCacheCounts {
                adapter: adapter.clone(),
                queries,
                hits,
            },
        )
        .collect()
}

/// Tells the prefix cache the full blocks the step just computed for the sequences of `work`
/// (their hashes as they are, under each one's adapter), so that later requests reuse them.
pub(super) fn store_prefixes(shared: &Shared, running: &mut [Box<Seq>], work: &[(usize, Work)]) {
    if !shared.opts.prefix_caching {
        return;
    }
    let block = shared.model.tensor_path().block_size.max(1);
    for (i, _) in work {
        let s: &mut Seq = &mut running[*i];
        let blocks = s.cache.len() / block;
        s.block_hashes(block, blocks);
        // The host path's store also finds blocks by their tokens (gathered only when it has
        // a new full block to take); the tensor path's does not.
        let by_tokens = shared.model.backend_kind().finds_prefix_by_tokens();
        if by_tokens && blocks <= s.cache.blocks_offered() {
            continue;
        }
        let mut cache = std::mem::take(&mut s.cache);
        let tokens = by_tokens.then(|| s.plain_tokens(blocks * block)).flatten();
        let stored = shared
            .model
            .store_prefix(&mut cache, &s.hashes, s.seed, tokens.as_deref());
        drop(tokens);
        s.cache = cache;
        if let Err(e) = stored {
            tracing::warn!(request = %s.id, error = %e, "prefix cache store failed");
        }
    }
}

/// Offers the prefix cache the last, partial block of a sequence that is done, so that the
/// same prompt again, or the conversation going on, reuses it (host path).
pub(super) fn store_partial(shared: &Shared, s: &Seq) {
    if !shared.opts.prefix_caching || !shared.model.backend_kind().finds_prefix_by_tokens() {
        return;
    }
    if let Some(tokens) = s.plain_tokens(s.cache.len()) {
        shared
            .model
            .store_partial(&s.cache, &s.hashes, s.seed, &tokens);
    }
}

/// The step's rows: prompt chunks within the prefill budget and a decode token for every
/// sequence past its context. On the tensor path, at most as many adapters as the LoRA slots
/// hold (a row of another waits a step), and if the step's new KV blocks are more than the
/// free ones, the youngest sequences are preempted until they fit. Returns the rows and how
/// many sequences were preempted.
#[allow(clippy::vec_box)]
pub(super) fn plan(
    shared: &Shared,
    running: &mut Vec<Box<Seq>>,
    waiting: &mut VecDeque<Box<Seq>>,
) -> (Vec<(usize, Work)>, usize) {
    let mut preempted = 0;
    loop {
        let work = rows(shared, running);
        if !shared.model.backend_kind().admits_by_blocks() || running.len() <= 1 {
            return (work, preempted);
        }
        let block = shared.model.tensor_path().block_size.max(1);
        let need: usize = work
            .iter()
            .map(|(i, w)| {
                let s = &running[*i];
                let tokens = s.cache.len()
                    + match w {
                        Work::Prefill(a, b) => b - a,
                        Work::Decode => 1,
                    };
                tokens.div_ceil(block).saturating_sub(s.cache.blocks())
            })
            .sum();
        if need <= shared.model.free_blocks() {
            return (work, preempted);
        }
        let mut s = running.pop().expect("more than one running");
        tracing::debug!(request = %s.id, need, "KV cache full: preempting the youngest sequence");
        s.preempt();
        shared.waiting.fetch_add(1, Ordering::SeqCst);
        waiting.push_front(s);
        preempted += 1;
    }
}

/// Rows without regard to memory: chunks of contexts under the prefill budget, decode tokens.
fn rows(shared: &Shared, running: &[Box<Seq>]) -> Vec<(usize, Work)> {
    let mut budget = shared.opts.prefill_chunk.max(1);
    let slots = (shared.model.backend_kind() == BackendKind::Paged)
        .then(|| shared.model.tensor_path().lora_slots);
    let mut adapters = HashSet::new();
    let mut work = Vec::with_capacity(running.len());
    for (i, s) in running.iter().enumerate() {
        let w = if s.prefilled < s.context.len() {
            if budget == 0 {
                continue;
            }
            Work::Prefill(s.prefilled, (s.prefilled + budget).min(s.context.len()))
        } else {
            Work::Decode
        };
        if let (Some(slots), Some(p)) = (slots, &s.adapter) {
            let id = std::sync::Arc::as_ptr(&p.adapter) as usize;
            if !adapters.contains(&id) && adapters.len() == slots {
                continue;
            }
            adapters.insert(id);
        }
        if let Work::Prefill(a, b) = w {
            budget -= b - a;
        }
        work.push((i, w));
    }
    work
}
