//! `bench decode --model DIR`'s structured-outputs case: the engine's decode step rate with a
//! batch of 16 rows of which 8 follow a JSON schema (their masks computed on the host while
//! each step's forward pass runs, applied by the batched sampler), ÷ the same batch
//! unconstrained; and the same constrained batch with the masks computed before the forward
//! pass instead (the order the overlap replaced). Measured side by side, rounds alternated,
//! best of each kept. Goal ≥ 0.9.

use mole_engine::ModelSource;
use std::time::Instant;

use candle_core::{DType, Device};

use mole_engine::api::{GenerateRequest, Prompt, PromptCodec, SamplingParams, Serving, TokenEvent};
use mole_engine::grammar::{Guide, Guided};
use mole_engine::{Engine, EngineOptions};

/// Rows of the batch, and of them constrained.
const ROWS: usize = 16;
const CONSTRAINED: usize = 8;

/// A schema whose answer is long (no row completes it within the steps, so both batches
/// keep 16 rows): objects of free strings and integers, the masks of a string's body and of
/// the structure around it both exercised.
fn schema() -> serde_json::Value {
    serde_json::json!({
        "type": "object",
        "properties": {
            "items": {"type": "array", "minItems": 500, "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
                "required": ["name", "n"]
            }}
        },
        "required": ["items"]
    })
}

/// Tokens/s of 16 rows decoding `steps` tokens each, `constrained` of them with the schema.
fn rate(e: &Engine, steps: usize, constrained: usize) -> anyhow::Result<f64> {
    let prompt = e.tokenize(&Prompt::Text("List some things as JSON:".into()), &[])?;
    let start = Instant::now();
    let streams: Vec<_> = (0..ROWS)
        .map(|i| {
            e.submit(GenerateRequest {
                id: format!("bench {i}"),
                prompt: Prompt::Tokens(prompt.clone()),
                adapter: None,
                images: Vec::new(),
                sampling: SamplingParams {
                    max_tokens: steps,
                    ignore_eos: true,
                    guide: (i < constrained).then(|| Guided {
                        guide: Guide::Json {
                            schema: schema(),
                            strict: true,
                        },
                        after: None,
                    }),
                    ..Default::default()
                },
            })
        })
        .collect::<Result<_, _>>()?;
    let mut tokens = 0;
    for mut rx in streams {
        while let Some(ev) = rx.blocking_recv() {
            match ev {
                TokenEvent::Token { .. } => tokens += 1,
                TokenEvent::Finished { .. } => break,
                TokenEvent::Error(e) => anyhow::bail!("{e}"),
                TokenEvent::Started { .. } => {}
            }
        }
    }
    Ok(tokens as f64 / start.elapsed().as_secs_f64())
}

/// Prints the case's table rows for the HF directory `dir` on `dev` in `dtype`.
pub(super) fn bench(
    dir: &std::path::Path,
    dtype: DType,
    dev: &Device,
    steps: usize,
    rounds: usize,
) -> anyhow::Result<()> {
    let e = Engine::load(
        &ModelSource::hf(dir, dtype),
        dev,
        EngineOptions {
            max_batch_size: ROWS,
            base_name: "bench".into(),
            ..Default::default()
        },
    )?;
    // Warm-up: the token trie is built by the first constrained request.
    rate(&e, 4, CONSTRAINED)?;
    let (mut free, mut guided, mut before) = (0f64, 0f64, 0f64);
    for _ in 0..rounds.max(1) {
        free = free.max(rate(&e, steps, 0)?);
        guided = guided.max(rate(&e, steps, CONSTRAINED)?);
        e.overlap_masks_for_bench(false);
        let r = rate(&e, steps, CONSTRAINED);
        e.overlap_masks_for_bench(true);
        before = before.max(r?);
    }
    println!("| batch {ROWS}, engine, free rows | {free:.1} | | |");
    println!(
        "| batch {ROWS}, engine, {CONSTRAINED} rows with a JSON schema | {guided:.1} | {:.2} of free | ≥ 0.90 |",
        guided / free
    );
    println!(
        "| batch {ROWS}, engine, {CONSTRAINED} rows with a JSON schema, masks before the forward pass | {before:.1} | {:.2} of free | |",
        before / free
    );
    Ok(())
}
