//! A request inside the engine: its prompt and what it generated, its cache, its sampler and
//! stop rules, its pinned adapter, the choices it carries, and where its tokens go. The
//! scheduler moves sequences between the queue and the batch; this file owns what one is.

use tokio::sync::mpsc::UnboundedSender;

use super::api::{EngineError, TokenEvent};
use super::host_sampler::Sampler;
use super::images::ImagePrompt;
use super::text::{Detokenizer, StopMatcher};
use super::trace::Phases;
use crate::lora::registry::Pinned;
use mole_model::{BlockHash, SeqCache};

/// One request inside the engine.
pub struct Seq {
    /// Request id (logs).
    pub id: String,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Adapter version pinned at submit.
    pub adapter: Option<Pinned>,
    /// Sampling state.
    pub sampler: Sampler,
    /// Where events go; closed means the caller went away (cancel).
    pub tx: UnboundedSender<TokenEvent>,
    /// Tokens generated at most (already capped by the model's length).
    pub max_new: usize,
    pub(super) cache: SeqCache,
    /// Tokens the cache must hold before decoding: the prompt, or after a preemption the
    /// prompt and what was generated, recomputed.
    pub(super) context: Vec<u32>,
    /// Tokens of `context` in the cache.
    pub(super) prefilled: usize,
    /// `Started` was sent (a recomputed sequence does not send it again).
    pub(super) started: bool,
    pub(super) generated: Vec<u32>,
    pub(super) detok: Detokenizer,
    pub(super) stop: StopMatcher,
    pub(super) done: bool,
    /// Version reported in `Started`: the pinned adapter's, or the merged weights'.
    pub version: Option<String>,
    /// The prompt's images (a vision model's request with images).
    pub(super) images: Option<Box<ImagePrompt>>,
    /// The request's other choices (`n` > 1), until this one's prompt is in the cache: then
    /// each takes its blocks and joins the batch ([`Seq::fork`]). Boxed as the batch holds
    /// them.
    #[allow(clippy::vec_box)]
    pub(super) forks: Vec<Box<Seq>>,
    /// Its spans (queue, prefill, decode) under the request's.
    pub(super) trace: Phases,
    /// A classifier's scoring: no tokens, the labels' probabilities once the prompt is in.
    pub(super) score: Option<Score>,
    /// Where the hashes of its KV blocks start: the weights it runs on (prefix caching).
    pub(super) seed: BlockHash,
    /// The hashes of its full blocks computed so far (see [`super::prefix`]).
    pub(super) hashes: Vec<BlockHash>,
    /// Its prefix-cache query was counted (at its first admission; not again after a
    /// preemption).
    pub(super) queried: bool,
    /// Prompt tokens the prefix cache gave it at that query.
    pub(super) cached: usize,
}

/// What a scoring sequence answers: the probabilities of `labels` (token ids) as the next
/// token after its prompt.
pub(super) struct Score {
    /// Each label's first token.
    pub(super) labels: Vec<u32>,
    /// Where the probabilities go.
    pub(super) reply: std::sync::mpsc::Sender<Result<Vec<f32>, EngineError>>,
}

impl Seq {
    /// A new sequence; `max_new` is the number of tokens it may still generate.
    pub fn new(
        id: String,
        prompt: Vec<u32>,
        adapter: Option<Pinned>,
        sampler: Sampler,
        tx: UnboundedSender<TokenEvent>,
        max_new: usize,
    ) -> Self {
        let stop = StopMatcher::new(&sampler.params().stop);
        let version = adapter.as_ref().map(|p| p.version.clone());
        let seed = Self::prefix_seed(adapter.as_ref(), &sampler);
        Self {
            seed,
            hashes: Vec::new(),
            queried: false,
            cached: 0,
            version,
            detok: Detokenizer::new(&prompt),
            id,
            context: prompt.clone(),
            started: false,
            prompt,
            adapter,
            sampler,
            tx,
            max_new,
            cache: SeqCache::default(),
            prefilled: 0,
            generated: Vec::new(),
            stop,
            done: false,
            images: None,
            forks: Vec::new(),
            trace: Phases::new(tracing::Span::current()),
            score: None,
        }
    }

    /// Pins `p` for this request and the choices it carries (each counted running).
    pub(super) fn pin(&mut self, p: Pinned) {
        for f in &mut self.forks {
            f.pin(p.clone());
        }
        p.start();
        self.seed = Self::prefix_seed(Some(&p), &self.sampler);
        self.hashes.clear();
        self.version = Some(p.version.clone());
        self.adapter = Some(p);
    }

    /// The seed of this sequence's prefix-cache keys: its weights, salt and tenant.
    fn prefix_seed(adapter: Option<&Pinned>, sampler: &Sampler) -> BlockHash {
        let p = sampler.params();
        super::prefix::seed(adapter, p.cache_salt.as_deref(), p.cache_tenant.as_ref())
    }

    pub(super) fn cancelled(&self) -> bool {
        self.tx.is_closed()
    }

    /// Ends the sequence, and the choices it still carries, with `err`.
    pub(super) fn fail(&mut self, err: &EngineError) {
        for f in self.forks.drain(..) {
            let _ = f.tx.send(TokenEvent::Error(err.clone()));
        }
        let _ = self.tx.send(TokenEvent::Error(err.clone()));
        if let Some(p) = self.adapter.take() {
            p.failed();
        }
        self.trace.failed(err);
        self.done = true;
    }

    /// Its first `upto` tokens, prompt then generated, when the prefix cache may match them
    /// by their tokens alone: None for a prompt with images (its placeholders' tokens do not
    /// say which image).
    pub(super) fn plain_tokens(&self, upto: usize) -> Option<std::borrow::Cow<'_, [u32]>> {
        if self.images.is_some() {
            return None;
        }
        if upto <= self.context.len() {
            return Some(std::borrow::Cow::Borrowed(&self.context[..upto]));
        }
        let known = self.prompt.iter().chain(&self.generated);
        Some(std::borrow::Cow::Owned(known.take(upto).copied().collect()))
    }

    /// The hashes of its first `blocks` full blocks (fewer when it has fewer tokens).
    pub(super) fn block_hashes(&mut self, block: usize, blocks: usize) -> &[BlockHash] {
        super::prefix::extend(
            &mut self.hashes,
            self.seed,
            block,
            blocks,
            &self.prompt,
            &self.generated,
            self.images.as_deref(),
        );
        &self.hashes[..blocks.min(self.hashes.len())]
    }

    /// Frees the sequence's cache to be recomputed later from its prompt and what it generated
    /// (preemption: the KV cache is full).
    pub(super) fn preempt(&mut self) {
        self.cache.clear();
        self.context = self.prompt.clone();
        self.context.extend_from_slice(&self.generated);
        self.prefilled = 0;
        self.trace.queued();
    }

    /// The choices this sequence carries, now that its prompt is in the cache: each takes the
    /// cached prompt but its last token (shared blocks on the tensor path) and computes the
    /// rest itself.
    #[allow(clippy::vec_box)] // the batch holds sequences boxed
    pub(super) fn fork(&mut self, model: &mole_model::Decoder) -> Vec<Box<Seq>> {
        let forks = std::mem::take(&mut self.forks);
        forks
            .into_iter()
            .map(|mut f| {
                let (cache, held) = model.fork_cache(&self.cache, f.context.len() - 1);
                f.cache = cache;
                f.prefilled = held;
                f.trace.prefilling(f.context.len());
                // Its images, with the embeddings the tower computed for this one.
                f.images.clone_from(&self.images);
                f
            })
            .collect()
    }
}

impl Drop for Seq {
    fn drop(&mut self) {
        if let Some(p) = &self.adapter {
            p.finish();
        }
    }
}
