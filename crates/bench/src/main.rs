//! `mole-bench`: the benchmarks, each printing ratios measured side by side in one run
//! (DESIGN §5), and `decode --service-model`, the service model a pool's fleet policy reads.
//! Its own binary, so the seams by which it sets contenders apart (the quantized kernel, the
//! grammar-mask overlap) are never in the serving binary.

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "mole-bench",
    version,
    about = "mole's benchmarks: decode, prefix, memory, merge"
)]
struct Cli {
    #[command(flatten)]
    args: mole_bench::BenchArgs,
}

fn main() -> std::process::ExitCode {
    // The threads a pod serves with, fixed before any thread starts.
    mole_engine::threads::pin();
    let cli = Cli::parse();
    // Held until main returns (logs of the engines and tools the benchmarks run).
    let _telemetry = match mole_telemetry::init("mole-bench", None) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("{}: {e}", e.code());
            return std::process::ExitCode::from(2);
        }
    };
    mole_bench::run(cli.args)
}
