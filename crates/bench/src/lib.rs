//! `mole-bench`: benchmarks that print ratios measured side by side in one run (DESIGN §5).
//! Each kind lives in its own module. On top of every layer: it imports the server, the tools
//! and the engine, and nothing imports it.

// clippy.toml keeps device→host copies and concatenation out of the decode path (mole-model,
// mole-engine's lora); a benchmark reads results back freely.
#![allow(clippy::disallowed_methods)]

mod constrained;
pub mod decode;
mod gguf;
pub mod image;
pub mod memory;
pub mod merge;
pub mod prefix;
mod synthetic;

/// What to run.
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
    /// Time to first token with a long system prompt seen before vs new (prefix caching).
    Prefix(prefix::PrefixBenchArgs),
    /// Resident memory of a GGUF base served quantized vs its bf16 import.
    Memory(memory::MemoryBenchArgs),
}

/// Runs a benchmark.
pub fn run(args: BenchArgs) -> std::process::ExitCode {
    match args.what {
        BenchKind::Merge(a) => merge::run(a),
        BenchKind::Prefix(a) => match prefix::run(&a) {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("bench prefix failed: {e:#}");
                std::process::ExitCode::FAILURE
            }
        },
        BenchKind::Memory(a) => match memory::run(&a) {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("bench memory failed: {e:#}");
                std::process::ExitCode::FAILURE
            }
        },
        BenchKind::Decode(a) => match decode_and_image(&a) {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("bench decode failed: {e:#}");
                std::process::ExitCode::FAILURE
            }
        },
    }
}

/// `bench decode`: the decode case, then the image case unless told otherwise.
fn decode_and_image(args: &decode::DecodeBenchArgs) -> anyhow::Result<()> {
    if let Some(file) = &args.gguf {
        let (dev, _) = decode::device_and_dtype(args)?;
        return gguf::bench(file, args, &dev);
    }
    if let Some(quant) = args.gguf_synthetic {
        let (dev, _) = decode::device_and_dtype(args)?;
        return gguf::bench_synthetic(quant, args, &dev);
    }
    decode::bench(args)?;
    if let (Some(size), false) = (args.image.0, args.tensor_only) {
        let (dev, dtype) = decode::device_and_dtype(args)?;
        image::run(args, size, &dev, dtype)?;
    }
    Ok(())
}
