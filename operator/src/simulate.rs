//! `mole-operator simulate`: the fleet simulator's command line.

use std::path::PathBuf;

use anyhow::Context as _;
use mole_operator::fleet::sim::{self, report, trace, SimConfig, Strategy};

/// Plays a request trace against a pool under the static policies (all dynamic, all merged),
/// placement alone, and the operator's traffic-driven policy; prints a Markdown table.
#[derive(clap::Args, Clone, Debug)]
pub struct SimulateArgs {
    /// A trace to play (`at_s,adapter,tokens` CSV); unset: one is generated from the flags
    /// below.
    #[arg(long, env = "MOLE_SIM_TRACE")]
    trace: Option<PathBuf>,
    /// Write the generated trace here.
    #[arg(long, env = "MOLE_SIM_WRITE_TRACE")]
    write_trace: Option<PathBuf>,
    /// Adapters of a generated trace (10 to 1,000).
    #[arg(long, env = "MOLE_SIM_ADAPTERS", default_value_t = 200,
          value_parser = clap::value_parser!(u32).range(1..=1000))]
    adapters: u32,
    /// Zipf exponent of the adapters' popularity.
    #[arg(long, env = "MOLE_SIM_ZIPF", default_value_t = 1.1)]
    zipf: f64,
    /// Seconds of generated traffic.
    #[arg(long, env = "MOLE_SIM_DURATION", default_value_t = 3600.0)]
    duration: f64,
    /// Mean requests per second of a generated trace.
    #[arg(long, env = "MOLE_SIM_RATE", default_value_t = 2.0)]
    rate: f64,
    /// Diurnal swing of the rate (0: flat; 0.5: from half to 1.5 times the mean).
    #[arg(long, env = "MOLE_SIM_DIURNAL", default_value_t = 0.5)]
    diurnal: f64,
    /// Bursts of a tail adapter in a generated trace.
    #[arg(long, env = "MOLE_SIM_BURSTS", default_value_t = 4)]
    bursts: usize,
    /// Mean generated tokens per request.
    #[arg(long, env = "MOLE_SIM_MEAN_TOKENS", default_value_t = 128.0)]
    mean_tokens: f64,
    /// Seed of a generated trace.
    #[arg(long, env = "MOLE_SIM_SEED", default_value_t = 37)]
    seed: u64,
    /// GPUs of the pool (comma-separated for several runs: `8,6`).
    #[arg(
        long,
        env = "MOLE_SIM_GPUS",
        default_value = "8,7,6",
        value_delimiter = ','
    )]
    gpus: Vec<usize>,
    /// Share of the pool's tokens at which the traffic policy promotes an adapter.
    #[arg(long, env = "MOLE_SIM_PROMOTE_SHARE", default_value_t = 0.15)]
    promote_share: f64,
    /// Share below which it demotes one.
    #[arg(long, env = "MOLE_SIM_DEMOTE_SHARE", default_value_t = 0.06)]
    demote_share: f64,
    /// Write the per-minute figures here (CSV).
    #[arg(long, env = "MOLE_SIM_CSV")]
    csv: Option<PathBuf>,
    /// Write the plot here (SVG).
    #[arg(long, env = "MOLE_SIM_SVG")]
    svg: Option<PathBuf>,
    /// Print the traffic policy's decisions.
    #[arg(long, env = "MOLE_SIM_EVENTS")]
    events: bool,
}

/// Runs the simulation and prints its table.
pub fn simulate(a: SimulateArgs) -> anyhow::Result<()> {
    let (requests, adapters) = match &a.trace {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            let reqs = trace::from_csv(&text)?;
            let n = reqs
                .iter()
                .map(|r| r.adapter as usize + 1)
                .max()
                .unwrap_or(0);
            (reqs, n)
        }
        None => {
            let spec = trace::TraceSpec {
                adapters: a.adapters as usize,
                zipf: a.zipf,
                duration_s: a.duration,
                rate: a.rate,
                diurnal: a.diurnal.clamp(0.0, 1.0),
                bursts: a.bursts,
                mean_tokens: a.mean_tokens,
                seed: a.seed,
                ..trace::TraceSpec::default()
            };
            (trace::generate(&spec), a.adapters as usize)
        }
    };
    if let Some(path) = &a.write_trace {
        std::fs::write(path, trace::to_csv(&requests))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    let mut outcomes = Vec::new();
    let first = a.gpus.first().copied().unwrap_or(8);
    for s in [
        Strategy::AllDynamic,
        Strategy::DynamicPlaced,
        Strategy::AllMerged,
    ] {
        outcomes.push(sim::run(s, &config(&a, first), &requests, adapters)?);
    }
    for &g in &a.gpus {
        outcomes.push(sim::run(
            Strategy::Traffic,
            &config(&a, g),
            &requests,
            adapters,
        )?);
    }
    println!(
        "{} requests over {adapters} adapters, {:.0} s\n",
        requests.len(),
        requests.last().map(|r| r.at).unwrap_or(0.0)
    );
    print!("{}", report::table(&outcomes));
    if a.events {
        for o in &outcomes {
            for e in &o.events {
                println!("{} ({} GPUs): {e}", o.strategy.name(), o.gpus);
            }
        }
    }
    if let Some(path) = &a.csv {
        std::fs::write(path, report::csv(&outcomes))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &a.svg {
        let title = format!(
            "{} requests, {adapters} adapters: p99 wait per minute",
            requests.len()
        );
        std::fs::write(path, report::svg(&outcomes, &title))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn config(a: &SimulateArgs, gpus: usize) -> SimConfig {
    let mut c = SimConfig::new(gpus);
    c.merge.promote_share = a.promote_share;
    c.merge.demote_share = a.demote_share;
    c
}
