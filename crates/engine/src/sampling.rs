//! What a row asks of sampling and what it gets back, shared by the host's sampler
//! ([`super::host_sampler`]) and the device's ([`super::device_sampler`]): one definition of greedy, of a
//! penalty, of a step's per-row inputs and of a pick.

/// Below this temperature sampling is greedy (as in vLLM), avoiding a division blow-up.
pub const GREEDY_BELOW: f32 = 1e-5;

/// The chosen token and, when asked, its logprob and the top alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    /// Token id.
    pub token: u32,
    /// Its log-probability under the model (NaN when logprobs were not asked).
    pub logprob: f32,
    /// Top alternatives (id, logprob), best first.
    pub top: Vec<(u32, f32)>,
}

/// One penalised token of a row: its logit `x` becomes `x / factor` when positive, `x × factor`
/// otherwise (the repetition penalty; 1 leaves it), then `x - minus` (presence and frequency).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Penalty {
    /// Token id.
    pub token: u32,
    /// Repetition factor (1: none).
    pub factor: f32,
    /// Subtracted after the factor: `presence + frequency × count` for output tokens.
    pub minus: f32,
}

impl Penalty {
    /// The penalised logit (the host's rule; the device computes the same).
    pub fn apply(&self, x: f32) -> f32 {
        let x = if x > 0.0 {
            x / self.factor
        } else {
            x * self.factor
        };
        x - self.minus
    }
}

/// A row's sampling inputs for one step.
#[derive(Debug, Clone, PartialEq)]
pub struct RowSampling {
    /// Temperature; below [`GREEDY_BELOW`] the row is greedy.
    pub temperature: f32,
    /// Top-k (0: off).
    pub top_k: usize,
    /// Top-p (1: off).
    pub top_p: f32,
    /// Min-p (0: off).
    pub min_p: f32,
    /// The row's uniform draw in `[0, 1)` (unused when greedy).
    pub u: f32,
    /// Top logprobs asked (None: no logprobs).
    pub logprobs: Option<usize>,
    /// Penalised tokens, each at most once.
    pub penalties: Vec<Penalty>,
    /// The tokens a grammar allows (llguidance's 32-bit words, token `t` at bit `t % 32` of
    /// word `t / 32`); None: every token.
    pub mask: Option<Vec<u32>>,
}

impl RowSampling {
    /// A row that samples nothing this step (a prompt chunk): greedy, nothing asked.
    pub fn idle() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            u: 0.0,
            logprobs: None,
            penalties: Vec::new(),
            mask: None,
        }
    }

    /// Whether the row takes the largest (penalised) logit.
    pub fn greedy(&self) -> bool {
        self.temperature < GREEDY_BELOW
    }
}
