//! `mole-worker`: the binary that runs in every mole pod (and locally).
//! Every flag is also settable from the environment (`MOLE_*`).

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "mole-worker",
    version,
    about = "mole worker: serve, merge, quantize, import, inspect, bench, fetch"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Export traces over OTLP/HTTP to this collector (`http://collector:4318`, or the full
    /// `.../v1/traces` URL); off when unset. The `OTEL_*` variables of the OpenTelemetry SDK
    /// (service name, resource attributes, sampler, headers) apply.
    #[arg(long, global = true, env = "MOLE_OTLP_TRACES_ENDPOINT")]
    otlp_traces_endpoint: Option<String>,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the OpenAI-compatible API for a WorkerConfig (operator ConfigMap or config/local.yaml).
    Serve(mole_server::cli::ServeArgs),
    /// Merge a PEFT LoRA adapter into base HF safetensors weights.
    Merge(mole_tools::merge::cli::MergeArgs),
    /// Quantize a merged (dense) HF model to GGUF blocks, measuring its drift.
    Quantize(mole_tools::quantize::cli::QuantizeArgs),
    /// Convert a GGUF model into an HF safetensors directory.
    Import(mole_tools::import::cli::ImportArgs),
    /// Describe a model or adapter directory and report validation problems.
    Inspect(mole_tools::inspect::InspectArgs),
    /// Benchmarks that print ratios measured side by side in one run.
    Bench(mole_worker::bench::BenchArgs),
    /// Delete old merged outputs (the operator's cleanup Job), refusing paths outside --root.
    Prune(mole_tools::prune::PruneArgs),
    /// Fetch a model or adapter (safetensors only, resumable, checksummed) from hf:// or s3://.
    Fetch(mole_tools::fetch::cli::FetchArgs),
}

/// candle asks for its thread count on every matmul and, unless `RAYON_NUM_THREADS` is set,
/// re-reads /proc/cpuinfo each time: a fifth of the decode time of a small model. Fix the count
/// once, before any thread starts (an explicit setting wins).
///
/// candle also runs large elementwise ops (prefill activations) on a pool of its own whose
/// threads spin 25,000 times after each op before parking, on the cores rayon's matmuls are
/// using: in a prefill-bound load test on 2 cores (scripts/load-test.sh, 64 clients), spinning
/// and waiting at its barrier were 13% of the CPU samples, and parking after 100 spins took
/// answers from 13.2-13.7/s to 14.8-15.5/s.
fn pin_thread_count() {
    // First thing in main, before any other thread exists (set_var is not thread-safe).
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let n = candle_core::utils::get_num_threads();
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
    if std::env::var_os("CANDLE_BARRIER_POOL_SPIN_LIMIT").is_none() {
        std::env::set_var("CANDLE_BARRIER_POOL_SPIN_LIMIT", "100");
    }
}

fn main() -> std::process::ExitCode {
    pin_thread_count();
    let cli = Cli::parse();
    // Held until main returns: dropping it exports the spans still buffered.
    let _telemetry = match mole_telemetry::init("mole-worker", cli.otlp_traces_endpoint.as_deref())
    {
        Ok(t) => t,
        Err(e) => {
            eprintln!("{}: {e}", e.code());
            return std::process::ExitCode::from(2);
        }
    };
    match cli.command {
        Command::Serve(a) => mole_server::cli::run(a),
        Command::Merge(a) => mole_tools::merge::cli::run(a),
        Command::Quantize(a) => mole_tools::quantize::cli::run(a),
        Command::Import(a) => mole_tools::import::cli::run(a),
        Command::Inspect(a) => mole_tools::inspect::run(a),
        Command::Bench(a) => mole_worker::bench::run(a),
        Command::Prune(a) => mole_tools::prune::run(a),
        Command::Fetch(a) => mole_tools::fetch::cli::run(a),
    }
}
