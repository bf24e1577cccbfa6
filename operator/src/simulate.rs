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
    /// The pods' service rates (JSON, as `mole-bench decode --service-model` writes
    /// them); unset: the H200 model measured with the batched engine
    /// (docs/fleet/service-model-h200.json).
    #[arg(long, env = "MOLE_SIM_SERVICE_MODEL")]
    service_model: Option<PathBuf>,
    /// The crossover study: run every policy at each of these dynamic ÷ merged ratios (both
    /// batch sizes; e.g. `0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0`) on the first `--gpus`, and print
    /// p99 wait per policy and ratio instead of the usual table.
    #[arg(long, env = "MOLE_SIM_DYNAMIC_RATIOS", value_delimiter = ',')]
    dynamic_ratios: Vec<f64>,
    /// Write the crossover plot here (SVG).
    #[arg(long, env = "MOLE_SIM_CROSSOVER_SVG")]
    crossover_svg: Option<PathBuf>,
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
    let model = match &a.service_model {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            let m: sim::ServiceModel = serde_json::from_str(&text)
                .with_context(|| format!("parsing {}", path.display()))?;
            m.validate()?;
            m
        }
        None => sim::h200_model(),
    };
    println!(
        "{} requests over {adapters} adapters, {:.0} s; service model: {}\n",
        requests.len(),
        requests.last().map(|r| r.at).unwrap_or(0.0),
        model.source
    );
    let first = a.gpus.first().copied().unwrap_or(8);
    if !a.dynamic_ratios.is_empty() {
        return crossover(&a, &model, first, &requests, adapters);
    }
    let mut outcomes = Vec::new();
    for s in [
        Strategy::AllDynamic,
        Strategy::DynamicPlaced,
        Strategy::AllMerged,
    ] {
        outcomes.push(sim::run(
            s,
            &config(&a, &model, first),
            &requests,
            adapters,
        )?);
    }
    for &g in &a.gpus {
        for s in [Strategy::Traffic, Strategy::TrafficShares] {
            outcomes.push(sim::run(s, &config(&a, &model, g), &requests, adapters)?);
        }
    }
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

/// Every policy but all-merged on `gpus` GPUs at each of `--dynamic-ratios`.
fn crossover(
    a: &SimulateArgs,
    model: &sim::ServiceModel,
    gpus: usize,
    requests: &[trace::Request],
    adapters: usize,
) -> anyhow::Result<()> {
    let mut rows = Vec::new();
    for &r in &a.dynamic_ratios {
        let m = model.with_dynamic_ratio(r);
        m.validate()?;
        let cfg = config(a, &m, gpus);
        let mut outcomes = Vec::new();
        for s in [
            Strategy::AllDynamic,
            Strategy::DynamicPlaced,
            Strategy::Traffic,
            Strategy::TrafficShares,
        ] {
            outcomes.push(sim::run(s, &cfg, requests, adapters)?);
        }
        rows.push(report::CrossoverRow { ratio: r, outcomes });
    }
    print!("{}", report::crossover_table(&rows));
    if let Some(path) = &a.crossover_svg {
        let title = format!(
            "{} requests, {adapters} adapters, {gpus} GPUs: p99 wait against dynamic ÷ merged",
            requests.len()
        );
        std::fs::write(path, report::crossover_svg(&rows, &title))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn config(a: &SimulateArgs, model: &sim::ServiceModel, gpus: usize) -> SimConfig {
    let mut c = SimConfig::with_model(gpus, model.clone());
    c.merge.promote_share = a.promote_share;
    c.merge.demote_share = a.demote_share;
    c
}
