//! `mole-worker`: the binary that runs in every mole pod (and locally), a thin command line
//! over the server (`mole_server`) and the tools (`mole_tools`); the benchmarks are
//! `mole-bench`'s, so no benchmark seam is in this binary. Every flag is also settable from the
//! environment (`MOLE_*`).

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "mole-worker",
    version,
    about = "mole worker: serve, merge, quantize, import, inspect, prune, fetch"
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
    /// Delete old merged outputs (the operator's cleanup Job), refusing paths outside --root.
    Prune(mole_tools::prune::PruneArgs),
    /// Fetch a model or adapter (safetensors only, resumable, checksummed) from hf:// or s3://.
    Fetch(mole_tools::fetch::cli::FetchArgs),
}

fn main() -> std::process::ExitCode {
    mole_engine::threads::pin();
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
        Command::Prune(a) => mole_tools::prune::run(a),
        Command::Fetch(a) => mole_tools::fetch::cli::run(a),
    }
}
