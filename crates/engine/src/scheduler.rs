//! The engine thread: continuous batching over one model instance.
//!
//! Each step the thread takes new requests (at step boundaries only), admits waiting ones up to
//! `max_batch_size`, and runs ONE forward pass whose rows mix prompt chunks of newly admitted
//! sequences (at most `prefill_chunk` prompt tokens per step, so a long prompt never stalls
//! the others for long) with one decode token of every running sequence. Finished and
//! cancelled sequences leave at once. The thread is a plain OS thread: the tensor work never
//! runs on the async runtime.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use super::api::{EngineError, FinishReason, TokenEvent, TokenLogprob, Usage};
use super::device_sampler::{self, BatchSampler, CandleSampler, RowSampling, SamplePlan};
use super::host_sampler::{Sampled, Sampler};
use super::images;
use super::plan::{self, Work};
use super::seq::Seq;
use super::Shared;
use mole_model::{BackendKind, ModelError, Row, RowVision, StepOutput};

/// Messages to the engine thread.
pub enum Msg {
    /// A new request (already counted in `Shared::waiting`).
    Submit(Box<Seq>),
}

/// Runs until every sender is gone.
pub fn run(shared: Arc<Shared>, rx: Receiver<Msg>) {
    let mut waiting: VecDeque<Box<Seq>> = VecDeque::new();
    let mut running: Vec<Box<Seq>> = Vec::new();
    // The tensor path samples on the device; the host path's logits are already on the host.
    let device = (shared.model.backend_kind() == BackendKind::Paged).then(CandleSampler::new);
    loop {
        // Block only when there is nothing to do; otherwise take what arrived and go on.
        if running.is_empty() && waiting.is_empty() {
            match rx.recv_timeout(Duration::from_millis(500)) {
                Ok(Msg::Submit(s)) => waiting.push_back(s),
                Err(RecvTimeoutError::Timeout) => {
                    shared.registry.trim();
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
        while let Ok(Msg::Submit(s)) = rx.try_recv() {
            waiting.push_back(s);
        }
        let before = waiting.len();
        waiting.retain(|s| !s.cancelled());
        let dropped = before - waiting.len();
        shared.waiting.fetch_sub(dropped, Ordering::SeqCst);
        let mut cancelled = dropped;
        let admitted = plan::admit(&shared, &mut running, &mut waiting);
        let before = running.len();
        running.retain(|s| !s.cancelled());
        cancelled += before - running.len();
        let (work, preempted) = plan::plan(&shared, &mut running, &mut waiting);
        shared
            .preemptions
            .fetch_add(preempted as u64, Ordering::Relaxed);
        publish_stats(&shared, &running, &waiting, cancelled);
        // Off the waiting count only now that the batch holding them is published: the load
        // a router reads (running + waiting) never misses them.
        shared.waiting.fetch_sub(admitted, Ordering::SeqCst);
        if work.is_empty() {
            continue;
        }
        shared.steps.fetch_add(1, Ordering::Relaxed);
        step(&shared, &mut running, &work, device.as_ref());
        // Choices waiting for their prompt join once it is in the cache (admission kept room).
        let mut forked = Vec::new();
        for s in running.iter_mut() {
            if !s.forks.is_empty() && s.prefilled == s.context.len() && !s.cancelled() {
                forked.extend(s.fork(&shared.model));
            }
        }
        running.extend(forked);
        let before = running.len();
        running.retain(|s| s.done || !s.cancelled());
        let cancelled = before - running.len();
        let live = running.len();
        for s in running.iter().filter(|s| s.done) {
            plan::store_partial(&shared, s);
        }
        running.retain(|s| !s.done);
        if cancelled > 0 || running.len() < live {
            // Adapters the finished requests held may be over capacity: evict them now.
            shared.registry.trim();
        }
        publish_stats(&shared, &running, &waiting, cancelled);
    }
}

fn publish_stats(
    shared: &Shared,
    running: &[Box<Seq>],
    waiting: &VecDeque<Box<Seq>>,
    cancelled: usize,
) {
    let names = |it: &mut dyn Iterator<Item = &Box<Seq>>| {
        let mut v: Vec<String> = it
            .filter_map(|s| s.adapter.as_ref().map(|p| p.name.clone()))
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    };
    let batch: usize = running.iter().map(|s| 1 + s.forks.len()).sum();
    shared.largest_batch.fetch_max(batch, Ordering::Relaxed);
    let mut st = shared.stats.lock().unwrap_or_else(PoisonError::into_inner);
    st.running = running.len();
    st.cancelled += cancelled as u64;
    st.waiting = waiting.len();
    if !running.is_empty() {
        st.last_batch_size = running.len();
    }
    st.running_adapters = names(&mut running.iter());
    st.waiting_adapters = names(&mut waiting.iter());
}

/// One forward pass over the planned rows, then sampling and events.
fn step(
    shared: &Shared,
    running: &mut [Box<Seq>],
    work: &[(usize, Work)],
    device: Option<&CandleSampler>,
) {
    // Images first: a sequence whose images the tower cannot encode fails alone.
    let failed = encode_images(shared, running, work);
    let kept: Vec<(usize, Work)>;
    let work = match failed.is_empty() {
        true => work,
        false => {
            kept = work
                .iter()
                .filter(|(i, _)| !failed.contains(i))
                .cloned()
                .collect();
            &kept
        }
    };
    if work.is_empty() {
        return;
    }
    let (sampling, picking) = prepare(running, work, device, shared.model.config().vocab_size);
    let mut extra = Vec::new();
    if let Picking::Device(_, rows, plan) = &picking {
        plan.pack(rows, &mut extra);
    }
    let out = {
        // Each prompt chunk's slice of its images' positions and placeholders.
        let chunks: Vec<Option<images::Chunk>> = work
            .iter()
            .map(|(i, w)| match (w, &running[*i].images) {
                (Work::Prefill(a, b), Some(img)) => Some(img.chunk(*a, *b)),
                _ => None,
            })
            .collect();
        // Rows borrow each sequence's cache mutably: split the borrows by index order. The
        // samplers of the rows whose grammar masks this step are borrowed beside them.
        let mut rows: Vec<Row<'_>> = Vec::with_capacity(work.len());
        let mut masking: Vec<&mut Sampler> = Vec::new();
        let mut rest: &mut [Box<Seq>] = running;
        let mut offset = 0;
        for (((i, w), chunk), &samples) in work.iter().zip(&chunks).zip(&sampling) {
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(i - offset);
            let (s, tail) = tail.split_first_mut().expect("index in range");
            rest = tail;
            offset = i + 1;
            let s: &mut Seq = s;
            let tokens: &[u32] = match w {
                Work::Prefill(a, b) => &s.context[*a..*b],
                Work::Decode => std::slice::from_ref(s.generated.last().expect("decoding")),
            };
            let vision = match (chunk, &s.images) {
                (Some(c), Some(img)) => Some(RowVision {
                    positions: &c.positions,
                    image_tokens: &c.image_tokens,
                    embeds: img.embeds.as_ref(),
                    offset: img.offset(),
                }),
                _ => None,
            };
            if samples && s.sampler.masks_next() {
                masking.push(&mut s.sampler);
            }
            rows.push(Row {
                tokens,
                cache: &mut s.cache,
                adapter: s.adapter.as_ref().map(|p| p.adapter.as_ref()),
                vision,
            });
        }
        forward_and_masks(shared, &mut rows, &extra, masking)
    };
    if out.is_ok() {
        plan::store_prefixes(shared, running, work);
    }
    let picked = out.and_then(|o| {
        let scores = scores(running, work, &sampling, &o.logits)?;
        Ok((pick(running, work, &sampling, picking, o)?, scores))
    });
    let (picked, scores) = match picked {
        Ok(p) => p,
        Err(e) => {
            // A failed step fails its rows, not the engine.
            tracing::error!(error = %e, "forward pass failed");
            for (i, _) in work {
                running[*i].fail(&EngineError::Internal(e.to_string()));
            }
            return;
        }
    };
    for (i, probs) in scores {
        let s = &mut running[i];
        if let Some(score) = s.score.take() {
            let _ = score.reply.send(Ok(probs));
        }
        s.done = true;
    }
    for ((i, _), out) in work.iter().zip(picked) {
        let s = &mut running[*i];
        let Some(out) = out.filter(|_| !s.done) else {
            continue;
        };
        if !s.started {
            s.started = true;
            let _ = s.tx.send(TokenEvent::Started {
                adapter_version: s.version.clone(),
                prompt_tokens: s.prompt.len(),
            });
        }
        emit(shared, s, out);
    }
}

/// The labels' probabilities of each scoring row whose prompt is now in the cache (a softmax
/// over the labels' first-token logits at its last position), by the row's sequence.
fn scores(
    running: &[Box<Seq>],
    work: &[(usize, Work)],
    sampling: &[bool],
    logits: &candle_core::Tensor,
) -> Result<Vec<(usize, Vec<f32>)>, ModelError> {
    let mut out = Vec::new();
    for (k, ((i, _), &samples)) in work.iter().zip(sampling).enumerate() {
        let Some(score) = running[*i].score.as_ref().filter(|_| samples) else {
            continue;
        };
        let row = mole_model::download::<f32>(&logits.get(k)?)?;
        let picked: Vec<f32> = score.labels.iter().map(|&t| row[t as usize]).collect();
        let probs = super::host_sampler::log_softmax(&picked)
            .into_iter()
            .map(f32::exp)
            .collect();
        out.push((*i, probs));
    }
    Ok(out)
}

/// Runs the vision tower once over the images that the prefills of this step need and that
/// were not encoded yet (an image whose placeholders all lie in blocks reused from the prefix
/// cache is never encoded: see [`images`]). When that fails, each sequence's images are
/// encoded alone, and a sequence whose images fail ends with the error: returns those
/// sequences (the step goes on without them), so one bad image never fails its batch-mates.
fn encode_images(shared: &Shared, running: &mut [Box<Seq>], work: &[(usize, Work)]) -> Vec<usize> {
    if shared.model.vision().is_none() {
        return Vec::new();
    }
    // The context token each prefilling sequence with images goes on from.
    let from = |i: usize| {
        work.iter().find_map(|(j, w)| match w {
            Work::Prefill(a, _) if *j == i => Some(*a),
            _ => None,
        })
    };
    let pending: Vec<(usize, usize)> = work
        .iter()
        .filter_map(|(i, w)| match w {
            Work::Prefill(a, _) => running[*i]
                .images
                .as_ref()
                .filter(|img| img.needs_encoding(*a))
                .map(|_| (*i, *a)),
            Work::Decode => None,
        })
        .collect();
    if pending.is_empty() {
        return Vec::new();
    }
    let mut all: Vec<images::Pending<'_>> = running
        .iter_mut()
        .enumerate()
        .filter(|(i, _)| pending.iter().any(|(j, _)| j == i))
        .filter_map(|(i, s)| {
            let adapter = s.adapter.as_ref().map(|p| p.adapter.as_ref());
            let from = from(i)?;
            s.images.as_deref_mut().map(|img| (img, adapter, from))
        })
        .collect();
    let Err(e) = encode(shared, &mut all) else {
        return Vec::new();
    };
    drop(all);
    if pending.len() > 1 {
        tracing::warn!(error = %e, "the vision tower failed on a step's images: each request's alone");
    }
    let mut failed = Vec::new();
    for (i, from) in pending {
        let s: &mut Seq = &mut running[i];
        let adapter = s.adapter.as_ref().map(|p| p.adapter.as_ref());
        let Some(img) = s.images.as_deref_mut() else {
            continue;
        };
        if let Err(e) = encode(shared, &mut [(img, adapter, from)]) {
            tracing::error!(request = %s.id, error = %e, "the vision tower failed on the request's images");
            s.fail(&EngineError::Internal(format!(
                "the vision tower failed on the request's images: {e}"
            )));
            failed.push(i);
        }
    }
    failed
}

/// One tower pass (per adapter) over `group`'s images, counted.
fn encode(shared: &Shared, group: &mut [images::Pending<'_>]) -> Result<(), ModelError> {
    let Some(tower) = shared.model.vision() else {
        return Ok(());
    };
    made_to_fail(shared, group)?;
    let encoded = images::encode(tower, &shared.device, group)?;
    shared
        .vision_encodes
        .fetch_add(encoded as u64, Ordering::Relaxed);
    Ok(())
}

/// An error when one of `pending`'s images is one a test made the tower fail on
/// (`Engine::fail_images_for_tests`, feature `test-seams`); without the feature, none is.
#[cfg(not(feature = "test-seams"))]
fn made_to_fail(_: &Shared, _: &[images::Pending<'_>]) -> Result<(), ModelError> {
    Ok(())
}

/// An error when one of `pending`'s images is one a test made the tower fail on
/// ([`super::Engine::fail_images_for_tests`]).
#[cfg(feature = "test-seams")]
fn made_to_fail(shared: &Shared, pending: &[images::Pending<'_>]) -> Result<(), ModelError> {
    let failing = shared
        .failing_images
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    match pending
        .iter()
        .any(|(p, _, _)| p.digests.iter().any(|d| failing.contains(d)))
    {
        true => {
            Err(candle_core::Error::Msg("an image a test made the tower fail on".into()).into())
        }
        false => Ok(()),
    }
}

/// How a step's rows pick their tokens, decided before its forward pass so that the device
/// sampler's inputs travel in the step's one upload.
enum Picking<'s> {
    /// Every sampling row is plain greedy: the argmax ids come back alone (the first of tied
    /// values, as the device sampler's greedy rows take, so a greedy request's tokens do not
    /// depend on whether another row samples).
    Greedy(Option<&'s CandleSampler>),
    /// The tensor path samples on the device from these rows' inputs.
    Device(&'s CandleSampler, Vec<RowSampling>, SamplePlan),
    /// The host path: every row's logits come back and are sampled on the host.
    Host,
}

/// Runs the step's forward pass while the grammar masks of `masking` (its constrained rows)
/// are computed on the host: the masks are wanted only when the step samples, and llguidance
/// takes tens of microseconds to a few milliseconds a row, time the step otherwise waits. The
/// forward pass stays on the engine thread (on the tensor path it queues the device's work,
/// which runs while the host goes on) and the masks go to the thread pool, the rows in
/// parallel; on the host path the forward pass runs on the pool too, whose threads take the
/// masks between its parallel parts. Joined before the step samples. A step without
/// constrained rows runs its forward pass alone.
fn forward_and_masks(
    shared: &Shared,
    rows: &mut [Row<'_>],
    extra: &[f32],
    mut masking: Vec<&mut Sampler>,
) -> Result<StepOutput, ModelError> {
    use rayon::prelude::*;
    if masking.is_empty() {
        return shared.model.forward_step(rows, extra);
    }
    let mut masks = move || match masking.len() {
        1 => masking[0].prepare_mask(),
        _ => masking.par_iter_mut().for_each(|s| s.prepare_mask()),
    };
    // mole-bench's baseline: the masks before the pass (`Engine::overlap_masks_for_bench`).
    #[cfg(feature = "bench-seams")]
    if !shared.overlap_masks.load(Ordering::Relaxed) {
        masks();
        return shared.model.forward_step(rows, extra);
    }
    rayon::in_place_scope(|scope| {
        scope.spawn(move |_| masks());
        shared.model.forward_step(rows, extra)
    })
}

/// Which rows sample this step (a prompt chunk that leaves part of its context out of the
/// cache samples nothing) and how. `vocab` is the logits' width. The grammar masks are not
/// computed yet ([`forward_and_masks`]): a row whose grammar masks this step is never plain
/// greedy, and on the tensor path its mask goes up after the forward pass.
fn prepare<'s>(
    running: &mut [Box<Seq>],
    work: &[(usize, Work)],
    device: Option<&'s CandleSampler>,
    vocab: usize,
) -> (Vec<bool>, Picking<'s>) {
    let sampling: Vec<bool> = work
        .iter()
        .map(|(i, w)| {
            let s = &running[*i];
            match w {
                Work::Prefill(_, to) => *to == s.context.len(),
                Work::Decode => s.prefilled == s.context.len(),
            }
        })
        .collect();
    let greedy = work
        .iter()
        .zip(&sampling)
        .all(|((i, _), &samples)| !samples || running[*i].sampler.is_plain_greedy());
    let picking = match (greedy, device) {
        (true, device) => Picking::Greedy(device),
        (false, Some(sampler)) => {
            let rows: Vec<RowSampling> = work
                .iter()
                .zip(&sampling)
                .map(|((i, _), &samples)| match samples {
                    true => running[*i].sampler.device_row(),
                    false => RowSampling::idle(),
                })
                .collect();
            let masked = work
                .iter()
                .zip(&sampling)
                .any(|((i, _), &samples)| samples && running[*i].sampler.masks_next());
            let plan = SamplePlan::new(&rows, vocab).masks_apart(masked);
            Picking::Device(sampler, rows, plan)
        }
        (false, None) => Picking::Host,
    };
    (sampling, picking)
}

/// Each row's next token (None for a row that does not sample this step), from the step's
/// one copy back from the device: the argmax ids alone when every sampling row is plain
/// greedy; else, with a `device` sampler (the tensor path), each row's pick (and logprobs)
/// sampled there from the inputs the step uploaded; else every row's logits, sampled on the
/// host (rows in parallel).
fn pick(
    running: &mut [Box<Seq>],
    work: &[(usize, Work)],
    sampling: &[bool],
    picking: Picking<'_>,
    out: StepOutput,
) -> Result<Vec<Option<Sampled>>, ModelError> {
    use rayon::prelude::*;
    for (i, w) in work {
        if let Work::Prefill(_, to) = w {
            running[*i].prefilled = *to;
        }
    }
    let logits = &out.logits;
    match (picking, &out.extra) {
        (Picking::Greedy(device), _) => {
            // The host path runs on the CPU, whose argmax takes the first of tied values.
            let argmax = match device {
                Some(sampler) => sampler.greedy(logits)?,
                None => logits.argmax(candle_core::D::Minus1)?,
            };
            let ids = mole_model::download::<u32>(&argmax)?;
            Ok(work
                .iter()
                .zip(ids)
                .zip(sampling)
                .map(|(((i, _), id), &samples)| samples.then(|| running[*i].sampler.record(id)))
                .collect())
        }
        (Picking::Device(sampler, rows, plan), Some(inputs)) => {
            // The masks computed during the forward pass go up now, in one copy.
            let masks = match plan.has_masks_apart() {
                true => {
                    let mut buf = Vec::new();
                    plan.pack_masks(
                        work.iter()
                            .zip(sampling)
                            .map(|((i, _), &samples)| match samples {
                                true => running[*i].sampler.mask(),
                                false => None,
                            }),
                        &mut buf,
                    );
                    Some(mole_model::upload(buf, logits.device())?)
                }
                false => None,
            };
            let picked = device_sampler::read(
                &sampler.sample_packed(logits, &plan, inputs, masks.as_ref())?,
                &rows,
            )?;
            Ok(work
                .iter()
                .zip(picked)
                .zip(sampling)
                .map(|(((i, _), p), &samples)| {
                    samples.then(|| running[*i].sampler.record_picked(p))
                })
                .collect())
        }
        (Picking::Device(..), None) => Err(candle_core::Error::Msg(
            "a device-sampled step came back without its sampling inputs".into(),
        )
        .into()),
        (Picking::Host, _) => {
            let rows = mole_model::download_rows::<f32>(logits)?;
            let mut seqs: Vec<Option<&mut Box<Seq>>> = running.iter_mut().map(Some).collect();
            let jobs: Vec<(&mut Box<Seq>, Vec<f32>, bool)> = work
                .iter()
                .zip(rows)
                .zip(sampling)
                .map(|(((i, _), row), &samples)| {
                    (seqs[*i].take().expect("a row per sequence"), row, samples)
                })
                .collect();
            Ok(jobs
                .into_par_iter()
                .map(|(s, row, samples)| samples.then(|| s.sampler.sample(&row)))
                .collect())
        }
    }
}

/// Sends the next token of `s` and decides whether the sequence ends.
fn emit(shared: &Shared, s: &mut Seq, out: Sampled) {
    let tok = out.token;
    s.generated.push(tok);
    s.trace.decoding();
    let p = s.sampler.params();
    let eos = !p.ignore_eos && shared.text.eos_ids.contains(&tok);
    let stop_id = p.stop_token_ids.contains(&tok);
    let logprob = p.logprobs.map(|_| TokenLogprob {
        token_id: tok,
        token: shared.text.token_text(tok),
        logprob: out.logprob,
        top: out
            .top
            .iter()
            .map(|(id, lp)| (*id, shared.text.token_text(*id), *lp))
            .collect(),
    });
    let delta = if eos || stop_id {
        String::new()
    } else {
        match s.detok.push(&shared.text, tok) {
            Ok(d) => d,
            Err(e) => {
                let _ =
                    s.tx.send(TokenEvent::Error(EngineError::Internal(e.to_string())));
                s.done = true;
                return;
            }
        }
    };
    if let Some(why) = s.sampler.constraint().and_then(|c| c.failure()) {
        // The request's own grammar (past llguidance's limits), not the engine: that request
        // ends with a 4xx, and nothing of the parser's state reaches the client.
        let err = EngineError::GuideFailed(why.to_string());
        tracing::warn!(request = %s.id, error = %err, "structured output");
        let _ = s.tx.send(TokenEvent::Error(err.clone()));
        s.trace.failed(&err);
        s.done = true;
        return;
    }
    // A complete grammar allows nothing but EOS: the answer ends here, whether or not the
    // model has an EOS token.
    let complete = s.sampler.constraint().is_some_and(|c| c.complete());
    let (mut text, hit) = s.stop.push(&delta);
    let mut reason = if eos || stop_id || hit || complete {
        Some(FinishReason::Stop)
    } else if s.generated.len() >= s.max_new {
        Some(FinishReason::Length)
    } else {
        None
    };
    if reason.is_some() && !hit {
        // Bytes of an unfinished character are released too (as U+FFFD, as a full decode
        // shows them), and may still complete a stop string.
        let rest = s.detok.finish(&shared.text).unwrap_or_default();
        let (more, late_hit) = s.stop.push(&rest);
        text.push_str(&more);
        if late_hit {
            reason = Some(FinishReason::Stop);
        } else {
            text.push_str(&s.stop.flush());
        }
    }
    let _ = s.tx.send(TokenEvent::Token {
        token_id: tok,
        text,
        logprob,
    });
    if let Some(reason) = reason {
        // Counted as done before the caller hears of it, so a client that asks
        // `/v1/lora_adapters` right after its answer sees its request counted; this also
        // releases the pinned version now rather than when the step's bookkeeping ends.
        if let Some(p) = s.adapter.take() {
            p.completed(s.generated.len());
        }
        s.trace.finished(reason, s.generated.len());
        let _ = s.tx.send(TokenEvent::Finished {
            reason,
            usage: Usage {
                prompt_tokens: s.prompt.len(),
                completion_tokens: s.generated.len(),
                cached_tokens: s.cached,
            },
        });
        s.done = true;
    }
}
