//! `bench prefix`: automatic prefix caching on a worker config's base model (by default
//! `config/local.yaml`, SmolLM2-135M): the time to first token of a request whose long system
//! prompt the engine saw before, against one whose system prompt it did not see, side by
//! side in one run (issue 35's goal: ≤ 0.2 at 2,000 prompt tokens).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use mole_engine::api::{GenerateRequest, Prompt, PromptCodec, SamplingParams, Serving, TokenEvent};

/// Arguments of `bench prefix`.
#[derive(clap::Args, Debug)]
pub struct PrefixBenchArgs {
    /// The worker config whose base model (and `enablePrefixCaching`) is measured.
    #[arg(long, default_value = "config/local.yaml")]
    pub config: PathBuf,
    /// Tokens of the system prompt.
    #[arg(long, default_value_t = 2000)]
    pub prompt_tokens: usize,
    /// Pairs of requests (a new system prompt, then the same one again); the medians are
    /// compared.
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
}

/// A system prompt of `tokens` tokens, distinct per `round` from its first token on.
fn system_prompt(codec: &dyn PromptCodec, round: usize, tokens: usize) -> anyhow::Result<Vec<u32>> {
    let mut text =
        format!("Session {round}. You are the support assistant of shop number {round}.");
    let mut i = 0;
    let mut ids = Vec::new();
    while ids.len() < tokens {
        for _ in 0..50 {
            i += 1;
            text.push_str(&format!(
                " Rule {i}: when a customer asks about order {}, answer politely, briefly and \
                 with the tracking number first.",
                i * 7 + round
            ));
        }
        ids = codec.encode(&Prompt::Text(text.clone()))?;
    }
    ids.truncate(tokens);
    Ok(ids)
}

/// The time from submission to the first token of a greedy one-token answer to `prompt`.
fn ttft(engine: &dyn Serving, prompt: Vec<u32>) -> anyhow::Result<Duration> {
    let req = GenerateRequest {
        id: "bench-prefix".into(),
        prompt: Prompt::Tokens(prompt),
        adapter: None,
        images: Vec::new(),
        sampling: SamplingParams {
            max_tokens: 1,
            ignore_eos: true,
            ..Default::default()
        },
    };
    let t = Instant::now();
    let mut rx = engine.submit(req)?;
    let mut first = None;
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            TokenEvent::Token { .. } if first.is_none() => first = Some(t.elapsed()),
            TokenEvent::Finished { .. } => break,
            TokenEvent::Error(e) => bail!("the request failed: {e}"),
            _ => {}
        }
    }
    first.context("the request ended without a token")
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort_unstable();
    v[v.len() / 2]
}

/// Runs the benchmark and prints the times and their ratio.
pub fn run(args: &PrefixBenchArgs) -> anyhow::Result<()> {
    let cfg = mole_server::config::load(&args.config)
        .with_context(|| format!("config {}", args.config.display()))?;
    let caching = cfg.limits.engine.enable_prefix_caching;
    let engine = mole_server::build_engine(&cfg)?;
    let question = |q: &str| {
        engine
            .codec
            .encode(&Prompt::Text(format!("\nQuestion: {q}\nAnswer:")))
    };
    let (qa, qb) = (
        question("where is my order?")?,
        question("can I return it?")?,
    );
    // One request first: threads, allocations and page faults are not the cold prompt's.
    ttft(
        engine.serving.as_ref(),
        system_prompt(engine.codec.as_ref(), 1_000_000, 64)?,
    )?;
    let (mut cold, mut warm) = (Vec::new(), Vec::new());
    for round in 0..args.rounds.max(1) {
        let sys = system_prompt(engine.codec.as_ref(), round, args.prompt_tokens)?;
        let with = |q: &[u32]| sys.iter().chain(q).copied().collect::<Vec<u32>>();
        let c = ttft(engine.serving.as_ref(), with(&qa))?;
        let w = ttft(engine.serving.as_ref(), with(&qb))?;
        println!(
            "round {round}: system prompt of {} tokens, new {:.1} ms, seen before {:.1} ms",
            sys.len(),
            c.as_secs_f64() * 1e3,
            w.as_secs_f64() * 1e3
        );
        cold.push(c);
        warm.push(w);
    }
    let stats = engine.info.stats();
    let (queries, hits) = stats
        .prefix_cache
        .iter()
        .fold((0, 0), |(q, h), c| (q + c.queries, h + c.hits));
    let path = match stats.kv_blocks {
        Some(_) => "tensor path (paged KV cache)",
        None => "host path (CPU f32 kernels)",
    };
    let (c, w) = (median(cold), median(warm));
    println!(
        "prefix caching {}, {path}: median time to first token, system prompt new {:.1} ms, \
         seen before {:.1} ms; seen ÷ new = {:.3} (goal ≤ 0.2); cache hits {hits} of {queries} \
         prompt tokens",
        if caching { "on" } else { "off" },
        c.as_secs_f64() * 1e3,
        w.as_secs_f64() * 1e3,
        w.as_secs_f64() / c.as_secs_f64()
    );
    Ok(())
}
