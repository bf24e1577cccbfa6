//! Next-token selection for one sequence: penalties, then greedy or temperature sampling
//! through top-k, min-p and top-p, with a per-request seeded generator so the same seed gives
//! the same tokens. Logprobs are those of the model's distribution (before penalties and
//! temperature), as vLLM reports them by default.
//!
//! The host path samples here, one row per thread; the tensor path samples on the device
//! ([`super::device_sampler`]) from what [`Sampler::device_row`] packs, by the same rules, and
//! both accept only what [`validate`] accepts.

use std::collections::HashMap;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::api::SamplingParams;
use super::grammar::{self, Constraint};
use super::sampling::{Penalty, RowSampling};
pub use super::sampling::{Sampled, GREEDY_BELOW};

pub use mole_api::request::MAX_LOGPROBS;

/// Whether sampling parameters are within the bounds both paths are defined for (a min-p above
/// 1 or a top-p of 0 would keep no token, a repetition penalty of 0 or below divides by zero or
/// flips signs, a non-finite value poisons every logit it touches): the bounds of
/// [`mole_api::request`], which the server's validation checks before a request is routed.
/// The engine takes a validated request as given and asserts this in debug builds.
pub fn validate(p: &SamplingParams) -> Result<(), mole_api::request::RequestError> {
    let values = [
        p.temperature,
        p.top_p,
        p.min_p,
        p.presence_penalty,
        p.frequency_penalty,
        p.repetition_penalty,
    ];
    for (bounds, v) in mole_api::request::REAL_FIELDS.iter().zip(values) {
        bounds.check_f32(v)?;
    }
    if let Some(n) = p.logprobs.filter(|&n| n > MAX_LOGPROBS) {
        return Err(mole_api::request::RequestError::new(
            "invalid_logprobs",
            format!("top logprobs must be at most {MAX_LOGPROBS}, got {n}"),
        ));
    }
    Ok(())
}

/// Sampling state of one sequence.
#[derive(Debug)]
pub struct Sampler {
    p: SamplingParams,
    rng: StdRng,
    /// Generated-token counts (presence/frequency penalties).
    counts: HashMap<u32, u32>,
    /// The penalised tokens, each once: the repetition factor on the prompt's and the
    /// output's tokens (as in transformers), the presence and frequency subtraction on the
    /// output's. Kept up to date as tokens are recorded, so a step reads it rather than
    /// rebuilding it from the prompt; empty when no penalty is asked.
    penalties: Vec<Penalty>,
    /// Where each token of `penalties` is.
    penalised: HashMap<u32, usize>,
    /// The request's grammar (structured outputs), if any.
    constraint: Option<Constraint>,
    /// This step's allowed tokens (llguidance's bit words), computed by
    /// [`Sampler::prepare_mask`] while the step's forward pass runs and used by its pick.
    mask: Option<Vec<u32>>,
}

impl Sampler {
    /// A sampler for one request.
    pub fn new(p: SamplingParams, prompt: &[u32]) -> Self {
        let rng = match p.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        let mut s = Self {
            p,
            rng,
            counts: HashMap::new(),
            penalties: Vec::new(),
            penalised: HashMap::new(),
            constraint: None,
            mask: None,
        };
        if s.repeats() {
            for &t in prompt {
                s.penalty_of(t);
            }
        }
        s
    }

    /// The sampler with a grammar its tokens must follow.
    pub fn with_constraint(mut self, c: Constraint) -> Self {
        self.constraint = Some(c);
        self
    }

    /// The request's grammar, if any.
    pub fn constraint(&self) -> Option<&Constraint> {
        self.constraint.as_ref()
    }

    /// Whether this row has a grammar that may mask its next token.
    pub fn constrained(&self) -> bool {
        self.constraint.is_some()
    }

    /// Whether [`Sampler::prepare_mask`] computes a mask for the next token: the row has a
    /// grammar that has started and not failed. Known before the mask is, so a step decides
    /// how it samples (and what it uploads) before computing masks during its forward pass.
    pub fn masks_next(&self) -> bool {
        self.constraint.as_ref().is_some_and(Constraint::masks_next)
    }

    /// Computes this step's mask of allowed tokens (nothing for an unconstrained row, or a
    /// grammar that has not started).
    pub fn prepare_mask(&mut self) {
        self.mask = self.constraint.as_mut().and_then(Constraint::mask);
    }

    /// This step's mask, once [`Sampler::prepare_mask`] computed it.
    pub fn mask(&self) -> Option<&[u32]> {
        self.mask.as_deref()
    }

    /// Whether the repetition penalty applies.
    fn repeats(&self) -> bool {
        let rp = self.p.repetition_penalty;
        rp != 1.0 && rp > 0.0
    }

    /// Whether the presence or frequency penalty applies.
    fn subtracts(&self) -> bool {
        self.p.presence_penalty != 0.0 || self.p.frequency_penalty != 0.0
    }

    /// The entry of `token` in `penalties`, added (with the repetition factor, nothing
    /// subtracted) if it has none.
    fn penalty_of(&mut self, token: u32) -> &mut Penalty {
        let factor = match self.repeats() {
            true => self.p.repetition_penalty,
            false => 1.0,
        };
        let penalties = &mut self.penalties;
        let at = *self.penalised.entry(token).or_insert_with(|| {
            penalties.push(Penalty {
                token,
                factor,
                minus: 0.0,
            });
            penalties.len() - 1
        });
        &mut self.penalties[at]
    }

    /// Counts a generated token, updates its penalty and advances the grammar.
    fn note(&mut self, token: u32) {
        self.mask = None;
        if let Some(c) = &mut self.constraint {
            c.consume(token);
        }
        let count = {
            let c = self.counts.entry(token).or_default();
            *c += 1;
            *c
        };
        if !(self.repeats() || self.subtracts()) {
            return;
        }
        let (pp, fp) = (self.p.presence_penalty, self.p.frequency_penalty);
        let subtracts = self.subtracts();
        let entry = self.penalty_of(token);
        if subtracts {
            entry.minus = pp + fp * count as f32;
        }
    }

    /// The sampling parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.p
    }

    /// Whether the next token is the logits' argmax and nothing else is asked of them: greedy,
    /// no penalty, no logprobs, no grammar mask (now or to be computed this step). Then the
    /// device can pick it and send back the id alone.
    pub fn is_plain_greedy(&self) -> bool {
        let p = &self.p;
        p.temperature < GREEDY_BELOW
            && p.logprobs.is_none()
            && p.repetition_penalty == 1.0
            && p.presence_penalty == 0.0
            && p.frequency_penalty == 0.0
            && self.mask.is_none()
            && !self.masks_next()
    }

    /// Records a token the device picked for a plain-greedy sequence (see
    /// [`Sampler::is_plain_greedy`]), as [`Sampler::sample`] records its own.
    pub fn record(&mut self, token: u32) -> Sampled {
        self.record_picked(Sampled {
            token,
            logprob: f32::NAN,
            top: Vec::new(),
        })
    }

    /// Records what the device sampler picked from [`Sampler::device_row`]'s inputs.
    pub fn record_picked(&mut self, picked: Sampled) -> Sampled {
        self.note(picked.token);
        picked
    }

    /// This step's inputs to the device sampler: the parameters, the penalised tokens (each
    /// once, with the factor and the subtraction [`Sampler::sample`] would apply) and, when
    /// the row samples, the next uniform of the request's generator, the one number the host
    /// draw would take from it: a seed gives the same stream on both paths.
    pub fn device_row(&mut self) -> RowSampling {
        let greedy = self.p.temperature < GREEDY_BELOW;
        let u = if greedy {
            0.0
        } else {
            self.rng.random::<f32>()
        };
        let p = &self.p;
        RowSampling {
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: p.top_p,
            min_p: p.min_p,
            logprobs: p.logprobs,
            penalties: self.penalties.clone(),
            u,
            mask: self.mask.clone(),
        }
    }

    /// Picks the next token from the last position's logits and records it.
    pub fn sample(&mut self, logits: &[f32]) -> Sampled {
        let (logprob_of, top) = match self.p.logprobs {
            Some(n) => {
                let lp = log_softmax(logits);
                let top = top_n(&lp, n);
                (Some(lp), top)
            }
            None => (None, Vec::new()),
        };
        let mut l = logits.to_vec();
        self.apply_penalties(&mut l);
        if let Some(m) = &self.mask {
            // Tokens the grammar refuses are out (logprobs stay the model's own).
            for (t, x) in l.iter_mut().enumerate() {
                if !grammar::allowed(m, t) {
                    *x = f32::NEG_INFINITY;
                }
            }
        }
        let token = if self.p.temperature < GREEDY_BELOW {
            argmax(&l)
        } else {
            self.draw(l)
        };
        self.note(token);
        Sampled {
            token,
            logprob: logprob_of.map_or(f32::NAN, |lp| lp[token as usize]),
            top,
        }
    }

    fn apply_penalties(&self, l: &mut [f32]) {
        for p in &self.penalties {
            if let Some(x) = l.get_mut(p.token as usize) {
                *x = p.apply(*x);
            }
        }
    }

    /// Temperature, top-k, min-p, top-p, then one draw among the kept tokens in vocabulary
    /// order (as the tensor path's device sampler walks them).
    fn draw(&mut self, l: Vec<f32>) -> u32 {
        let (idx, probs) = self.filtered(l);
        let total: f32 = probs.iter().sum();
        let mut u = self.rng.random::<f32>() * total;
        for (i, p) in probs.iter().enumerate() {
            if u < *p {
                return idx[i];
            }
            u -= p;
        }
        // Rounding left `u` past the last: the last token kept.
        idx[probs.len() - 1]
    }

    /// The tokens a draw chooses among, in vocabulary order, with their probabilities up to a
    /// common factor: temperature, top-k, min-p and top-p over penalised logits `l`. Tokens of
    /// probability 0 (a grammar's mask) are never kept. Without top-k and top-p nothing is
    /// sorted (a full sort of a 150k vocabulary per row took a fifth of a CPU decode step);
    /// top-p sorts only the most likely tokens, as many as its mass needs.
    pub fn filtered(&self, mut l: Vec<f32>) -> (Vec<u32>, Vec<f32>) {
        let t = self.p.temperature;
        for x in l.iter_mut() {
            *x /= t;
        }
        let by_logit = |a: &u32, b: &u32| l[*b as usize].total_cmp(&l[*a as usize]);
        let mut idx: Vec<u32> = (0..l.len() as u32).collect();
        // top-k cuts before the softmax.
        let mut reordered = false;
        if self.p.top_k > 0 && self.p.top_k < idx.len() {
            idx.select_nth_unstable_by(self.p.top_k - 1, by_logit);
            idx.truncate(self.p.top_k);
            reordered = true;
        }
        let max = idx
            .iter()
            .map(|&i| l[i as usize])
            .fold(f32::NEG_INFINITY, f32::max);
        // Each candidate's weight, computed once (0 for the tokens top-k left out).
        let mut w = vec![0f32; l.len()];
        for &i in &idx {
            w[i as usize] = (l[i as usize] - max).exp();
        }
        let prob = |i: u32| w[i as usize];
        // min-p: drop tokens less likely than min_p times the best one (whose weight is 1).
        // Masked tokens (weight 0) go with them.
        let floor = self.p.min_p.max(0.0);
        idx.retain(|&i| {
            let p = prob(i);
            p > 0.0 && p >= floor
        });
        if idx.is_empty() {
            // Every token masked or not finite: the best logit, as greedy would pick.
            return (vec![argmax(&l)], vec![1.0]);
        }
        // top-p: the smallest set of the most likely tokens whose mass reaches top_p, found
        // among the `m` most likely, `m` growing until their mass does.
        if self.p.top_p < 1.0 {
            let total: f32 = idx.iter().map(|&i| prob(i)).sum();
            let mut m = 64.min(idx.len());
            loop {
                if m < idx.len() {
                    idx.select_nth_unstable_by(m - 1, by_logit);
                }
                idx[..m].sort_unstable_by(by_logit);
                let mut acc = 0.0;
                let keep = idx[..m].iter().position(|&i| {
                    acc += prob(i) / total;
                    acc >= self.p.top_p
                });
                match keep {
                    Some(k) => {
                        idx.truncate(k + 1);
                        break;
                    }
                    None if m == idx.len() => break,
                    None => m = (m * 8).min(idx.len()),
                }
            }
            reordered = true;
        }
        if reordered {
            idx.sort_unstable();
        }
        let probs = idx.iter().map(|&i| prob(i)).collect();
        (idx, probs)
    }
}

/// Index of the largest value (the first on ties, as torch's argmax).
pub fn argmax(l: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in l.iter().enumerate() {
        if *x > l[best] {
            best = i;
        }
    }
    best as u32
}

/// Numerically stable log-softmax.
pub fn log_softmax(l: &[f32]) -> Vec<f32> {
    let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = l.iter().map(|x| (x - max).exp()).sum::<f32>().ln() + max;
    l.iter().map(|x| x - lse).collect()
}

fn top_n(lp: &[f32], n: usize) -> Vec<(u32, f32)> {
    if n == 0 {
        return Vec::new();
    }
    let mut idx: Vec<u32> = (0..lp.len() as u32).collect();
    let by = |a: &u32, b: &u32| lp[*b as usize].total_cmp(&lp[*a as usize]);
    let n = n.min(idx.len());
    idx.select_nth_unstable_by(n - 1, by);
    idx.truncate(n);
    idx.sort_unstable_by(by);
    idx.into_iter().map(|i| (i, lp[i as usize])).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams::default();
        f(&mut p);
        p
    }

    const LOGITS: [f32; 6] = [1.0, 3.0, 2.5, 0.5, -1.0, 2.9];

    #[test]
    fn greedy_is_argmax_and_logprobs_are_the_model_distribution() {
        let mut s = Sampler::new(params(|p| p.logprobs = Some(2)), &[]);
        let out = s.sample(&LOGITS);
        assert_eq!(out.token, 1);
        let lp = log_softmax(&LOGITS);
        assert_eq!(out.logprob, lp[1]);
        assert_eq!(out.top, vec![(1, lp[1]), (5, lp[5])]);
        let total: f32 = lp.iter().map(|x| x.exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
    }

    #[test]
    fn same_seed_same_tokens_and_seeds_differ() {
        let run = |seed| {
            let mut s = Sampler::new(
                params(|p| {
                    p.temperature = 1.5;
                    p.seed = Some(seed);
                }),
                &[],
            );
            (0..64).map(|_| s.sample(&LOGITS).token).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    #[test]
    fn top_k_top_p_and_min_p_restrict_the_candidates() {
        let draw = |f: fn(&mut SamplingParams)| {
            let mut s = Sampler::new(
                params(|p| {
                    p.temperature = 1.0;
                    p.seed = Some(1);
                    f(p)
                }),
                &[],
            );
            let mut seen: Vec<u32> = (0..400).map(|_| s.draw(LOGITS.to_vec())).collect();
            seen.sort_unstable();
            seen.dedup();
            seen
        };
        assert_eq!(draw(|p| p.top_k = 2), vec![1, 5]);
        // Probabilities: 3.0 -> .33, 2.9 -> .30, 2.5 -> .20 ...: top_p .6 keeps two.
        assert_eq!(draw(|p| p.top_p = 0.6), vec![1, 5]);
        // min_p .7 of the best keeps tokens 1 (1.0) and 5 (e^-0.1 = .90), drops 2 (e^-0.5 = .61).
        assert_eq!(draw(|p| p.min_p = 0.7), vec![1, 5]);
        assert_eq!(draw(|_| {}).len(), 6);
    }

    /// top-p grows its sorted candidates until their mass reaches it: over a flat vocabulary
    /// of 5000 it keeps exactly the set a full sort keeps, in vocabulary order; and a token of
    /// probability 0 (masked) is never kept.
    #[test]
    fn top_p_keeps_what_a_full_sort_keeps_and_never_a_masked_token() {
        let logits: Vec<f32> = (0..5000u32)
            .map(|i| ((i * 7919) % 5000) as f32 / 2500.0)
            .collect();
        for top_p in [0.05, 0.5, 0.9, 0.999] {
            let s = Sampler::new(
                params(|p| {
                    p.temperature = 0.7;
                    p.top_p = top_p;
                }),
                &[],
            );
            let (got, _) = s.filtered(logits.clone());
            let mut order: Vec<u32> = (0..5000).collect();
            order.sort_by(|a, b| logits[*b as usize].total_cmp(&logits[*a as usize]));
            let w: Vec<f64> = order
                .iter()
                .map(|&i| ((logits[i as usize] - 2.0) as f64 / 0.7).exp())
                .collect();
            let total: f64 = w.iter().sum();
            let mut acc = 0.0;
            let keep = w.iter().position(|x| {
                acc += x / total;
                acc >= top_p as f64
            });
            let mut want = order[..=keep.unwrap()].to_vec();
            want.sort_unstable();
            assert_eq!(got, want, "top_p {top_p}");
        }
        let mut masked = LOGITS.to_vec();
        masked[1] = f32::NEG_INFINITY;
        let s = Sampler::new(params(|p| p.temperature = 1.0), &[]);
        assert_eq!(s.filtered(masked).0, [0, 2, 3, 4, 5]);
    }

    #[test]
    fn penalties_change_the_greedy_choice() {
        // Frequency penalty: after choosing 1 twice it falls below 5.
        let mut s = Sampler::new(params(|p| p.frequency_penalty = 0.06), &[]);
        assert_eq!(s.sample(&LOGITS).token, 1);
        assert_eq!(s.sample(&LOGITS).token, 1);
        assert_eq!(s.sample(&LOGITS).token, 5);
        // Presence penalty: once is enough.
        let mut s = Sampler::new(params(|p| p.presence_penalty = 0.2), &[]);
        assert_eq!(s.sample(&LOGITS).token, 1);
        assert_eq!(s.sample(&LOGITS).token, 5);
        // Repetition penalty covers the prompt: token 1 in the prompt is divided by 1.5.
        let mut s = Sampler::new(params(|p| p.repetition_penalty = 1.5), &[1]);
        assert_eq!(s.sample(&LOGITS).token, 5);
        // Negative logits are multiplied (pushed further down).
        let mut l = vec![-1.0, -1.2];
        Sampler::new(params(|p| p.repetition_penalty = 2.0), &[0]).apply_penalties(&mut l);
        assert_eq!(l, vec![-2.0, -1.2]);
    }
}
