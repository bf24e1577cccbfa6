//! A request's time inside the engine as spans under its `request` span: `queue` (waiting for
//! room in the batch, again after a preemption), `prefill` (its context computed, chunk by
//! chunk) and `decode` (from its first token to its last). With trace export on they show
//! where a slow answer spent its time; with it off they cost a few span records per request.

use tracing::field::Empty;
use tracing::Span;

use super::api::{EngineError, FinishReason};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Queue,
    Prefill,
    Decode,
    Done,
}

/// The spans of one sequence (one choice of a request).
pub(super) struct Phases {
    /// The request's span (the server's), kept open while the sequence lives.
    request: Span,
    /// The phase's span; replacing it ends the previous one.
    span: Span,
    phase: Phase,
}

impl Phases {
    /// A sequence just submitted by a caller running in `request`: queued.
    pub(super) fn new(request: Span) -> Self {
        let mut p = Self {
            request,
            span: Span::none(),
            phase: Phase::Done,
        };
        p.queued();
        p
    }

    fn enter(&mut self, phase: Phase, span: impl FnOnce(&Span) -> Span) {
        self.phase = phase;
        // A request outside any span (tools, tests) gets no phases.
        self.span = match self.request.is_disabled() || phase == Phase::Done {
            true => Span::none(),
            false => span(&self.request),
        };
    }

    /// Waiting for the batch (at submit, and after a preemption).
    pub(super) fn queued(&mut self) {
        self.enter(Phase::Queue, |r| tracing::info_span!(parent: r, "queue"));
    }

    /// Admitted: its `context_tokens` are being computed.
    pub(super) fn prefilling(&mut self, context_tokens: usize) {
        self.enter(
            Phase::Prefill,
            |r| tracing::info_span!(parent: r, "prefill", tokens = context_tokens),
        );
    }

    /// A token came out: decoding from now on (once per phase change).
    pub(super) fn decoding(&mut self) {
        if self.phase != Phase::Decode {
            self.enter(
                Phase::Decode,
                |r| tracing::info_span!(parent: r, "decode", tokens = Empty, finish_reason = Empty),
            );
        }
    }

    /// The last token: `generated` tokens in all.
    pub(super) fn finished(&mut self, reason: FinishReason, generated: usize) {
        self.span.record("tokens", generated);
        let reason = match reason {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        };
        self.span.record("finish_reason", reason);
        self.enter(Phase::Done, |_| Span::none());
    }

    /// Failed with `err` (the span says why).
    pub(super) fn failed(&mut self, err: &EngineError) {
        self.span.in_scope(
            || tracing::warn!(code = err.code(), error = %err, "request failed in the engine"),
        );
        self.enter(Phase::Done, |_| Span::none());
    }
}
