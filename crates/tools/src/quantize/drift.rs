//! The drift of a quantized model: next-token distributions against its dense input,
//! teacher-forced on a fixed prompt set, compared by KL divergence.

use std::path::Path;

use candle_core::{DType, Device};
use serde::{Deserialize, Serialize};

use super::QuantizeError;
use mole_formats::hf;
use mole_model::{Decoder, Row, SeqCache};

/// The drift of a quantized model against its input.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Drift {
    /// Mean over the positions of KL(P_input ‖ P_quantized) of the next-token distribution,
    /// in nats.
    pub mean_kl: f64,
    /// The largest position's KL.
    pub max_kl: f64,
    /// Share of positions whose most likely next token is the same.
    pub top1_agreement: f64,
    /// Prompts evaluated.
    pub prompts: usize,
    /// Positions evaluated (every token of every prompt).
    pub positions: usize,
}

/// The fixed prompt set of the drift: prose, code, structured data, arithmetic and other
/// scripts, so the comparison covers more than one kind of token.
pub const DRIFT_PROMPTS: [&str; 8] = [
    "The capital of France is Paris, and the capital of Italy is Rome. The largest city in",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(",
    "{\"name\": \"mole\", \"version\": \"0.1.0\", \"adapters\": [\"calendar\", \"contracts\"], \"pool\":",
    "Question: what is 17 multiplied by 23? Answer: 17 times 20 is 340, and 17 times 3 is",
    "Der schnelle braune Fuchs springt über den faulen Hund. Le renard brun rapide saute",
    "SELECT name, count(*) FROM adapters WHERE pool = 'vl' GROUP BY name ORDER BY",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Kubernetes operators reconcile the desired state of custom resources with the actual",
];

/// Next-token log-probabilities (f32) at every position of every prompt, teacher-forced: all
/// prompts step together, one token each per pass.
fn log_probs(model: &Decoder, prompts: &[Vec<u32>]) -> Result<Vec<Vec<f32>>, QuantizeError> {
    let drift = |e: &dyn std::fmt::Display| QuantizeError::Drift(e.to_string());
    let mut caches: Vec<SeqCache> = prompts.iter().map(|_| SeqCache::default()).collect();
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let mut out = Vec::new();
    for t in 0..longest {
        let mut rows: Vec<Row> = prompts
            .iter()
            .zip(caches.iter_mut())
            .filter(|(p, _)| p.len() > t)
            .map(|(p, cache)| Row {
                tokens: &p[t..t + 1],
                cache,
                adapter: None,
                vision: None,
            })
            .collect();
        let logits = model.forward_batch(&mut rows).map_err(|e| drift(&e))?;
        let lp = candle_nn::ops::log_softmax(&logits, candle_core::D::Minus1)
            .and_then(|l| l.to_vec2::<f32>())
            .map_err(|e| drift(&e))?;
        out.extend(lp);
    }
    Ok(out)
}

/// KL(P ‖ Q) of two distributions given by their log-probabilities, in nats.
pub fn kl(log_p: &[f32], log_q: &[f32]) -> f64 {
    log_p
        .iter()
        .zip(log_q)
        .map(|(&lp, &lq)| {
            let p = (lp as f64).exp();
            if p == 0.0 {
                0.0
            } else {
                p * (lp as f64 - lq as f64)
            }
        })
        .sum()
}

fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |b, (i, &x)| if x > b.1 { (i, x) } else { b },
        )
        .0
}

/// The reference's weights dtype as its config.json names it (its weights are read as
/// stored; the CPU computes in f32 either way).
fn stored_dtype(dir: &Path) -> DType {
    let raw = hf::read_config(dir).unwrap_or_default();
    let name = raw
        .get("torch_dtype")
        .or_else(|| raw.get("dtype"))
        .and_then(|v| v.as_str())
        .unwrap_or("float32");
    match name {
        "bfloat16" => DType::BF16,
        "float16" => DType::F16,
        _ => DType::F32,
    }
}

/// Measures the drift of the quantized directory `quantized` against the dense `reference`
/// on [`DRIFT_PROMPTS`] (each cut to `tokens` tokens), on the CPU. The reference runs first
/// and is dropped before the quantized model loads: one model in memory at a time, plus the
/// reference's log-probabilities.
pub fn measure_drift(
    reference: &Path,
    quantized: &Path,
    tokens: usize,
) -> Result<Drift, QuantizeError> {
    let drift = |e: &dyn std::fmt::Display| QuantizeError::Drift(e.to_string());
    let text = mole_engine::text::TextModel::load(reference).map_err(|e| drift(&e))?;
    let reference_model =
        Decoder::load(reference, stored_dtype(reference), &Device::Cpu).map_err(|e| drift(&e))?;
    let cap = tokens.min(reference_model.config().max_positions().saturating_sub(1));
    let prompts: Vec<Vec<u32>> = DRIFT_PROMPTS
        .iter()
        .map(|p| text.encode(p, false).map_err(|e| drift(&e)))
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .map(|mut t| {
            t.truncate(cap);
            t
        })
        .filter(|t| !t.is_empty())
        .collect();
    if prompts.is_empty() {
        return Err(QuantizeError::Drift("no prompt has a token".into()));
    }
    let want = log_probs(&reference_model, &prompts)?;
    drop(reference_model);
    let quantized_model =
        Decoder::load_quantized_dir(quantized, &Device::Cpu).map_err(|e| drift(&e))?;
    let got = log_probs(&quantized_model, &prompts)?;
    let kls: Vec<f64> = want.iter().zip(&got).map(|(p, q)| kl(p, q)).collect();
    let agree = want
        .iter()
        .zip(&got)
        .filter(|(p, q)| argmax(p) == argmax(q))
        .count();
    let n = kls.len().max(1) as f64;
    Ok(Drift {
        mean_kl: kls.iter().sum::<f64>() / n,
        max_kl: kls.iter().cloned().fold(0.0, f64::max),
        top1_agreement: agree as f64 / n,
        prompts: prompts.len(),
        positions: kls.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kl_is_zero_for_equal_and_positive_otherwise() {
        let p = [0.5f32.ln(), 0.25f32.ln(), 0.25f32.ln()];
        let q = [0.25f32.ln(), 0.5f32.ln(), 0.25f32.ln()];
        assert!(kl(&p, &p).abs() < 1e-12);
        let expected = 0.5 * (2f64).ln() + 0.25 * (0.5f64).ln();
        assert!((kl(&p, &q) - expected).abs() < 1e-6);
    }
}
