//! `mole-worker bench`: benchmarks that print ratios measured side by side in one run
//! (DESIGN §5). Each kind lives in its own module.

pub mod decode;
pub mod image;
pub mod merge;

/// Arguments of `bench`.
#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    #[command(subcommand)]
    what: BenchKind,
}

#[derive(clap::Subcommand, Debug)]
enum BenchKind {
    /// Merge time vs a plain copy of the base files (and vs PEFT when a Python env is given).
    Merge(merge::MergeBenchArgs),
    /// Decode throughput: dynamic vs merged, mixed vs one adapter, batch 16 vs 1, load vs read.
    Decode(decode::DecodeBenchArgs),
}

/// Runs a benchmark.
pub fn run(args: BenchArgs) -> std::process::ExitCode {
    match args.what {
        BenchKind::Merge(a) => merge::run(a),
        BenchKind::Decode(a) => decode::run(a),
    }
}
