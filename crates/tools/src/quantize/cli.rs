//! `mole-worker quantize`: quantizes a merged model for serving (see [`super`]).

use std::path::PathBuf;
use std::process::ExitCode;

use super::{quantize, QuantType, QuantizeOptions};

/// Tokens of each drift prompt by default: 8 prompts × 32 tokens = 256 positions, seconds on
/// a small model, a few minutes on a large one on the CPU.
pub const DEFAULT_DRIFT_TOKENS: usize = 32;

/// Arguments of `quantize`.
#[derive(clap::Args, Debug)]
pub struct QuantizeArgs {
    /// Dense HF model directory (a merge's output).
    #[arg(long = "in", env = "MOLE_QUANTIZE_IN")]
    pub input: PathBuf,
    /// Output directory; written to a temporary sibling and renamed at the end.
    #[arg(long, env = "MOLE_QUANTIZE_OUT")]
    pub out: PathBuf,
    /// Block type: q8_0, q4_0, q4_1, q4_k, q5_k or q6_k.
    #[arg(long = "type", env = "MOLE_QUANTIZE_TYPE")]
    pub qtype: String,
    /// Every path must resolve, symlinks included, inside this directory.
    #[arg(long, env = "MOLE_MODEL_ROOT")]
    pub root: Option<PathBuf>,
    /// Tokens of each of the 8 drift prompts (0: drift not measured).
    #[arg(long, env = "MOLE_QUANTIZE_DRIFT_TOKENS", default_value_t = DEFAULT_DRIFT_TOKENS)]
    pub drift_tokens: usize,
    /// Refuse the output when the mean next-token KL divergence against the input (nats) is
    /// above this.
    #[arg(long, env = "MOLE_QUANTIZE_MAX_DRIFT")]
    pub max_drift: Option<f64>,
    /// Skip the fdatasync of the output before it is renamed into place.
    #[arg(long, env = "MOLE_QUANTIZE_NO_FSYNC")]
    pub no_fsync: bool,
    /// Where the one-line failure reason is also written (Kubernetes copies it into the
    /// Pod's termination message). Default: /dev/termination-log, when it exists.
    #[arg(long, env = "MOLE_TERMINATION_LOG")]
    pub termination_log: Option<PathBuf>,
}

/// Runs `quantize`: exit 2 for bad input (an unknown type, a missing or quantized input, drift
/// over the bound), 1 for I/O; the reason also goes to the termination log.
pub fn run(args: QuantizeArgs) -> ExitCode {
    crate::merge::set_durable(!args.no_fsync);
    let fail = |e: super::QuantizeError| {
        let line = format!("quantize failed ({}): {e}", e.code());
        eprintln!("{line}");
        mole_telemetry::write_termination_log(args.termination_log.as_deref(), &line);
        ExitCode::from(e.exit_code())
    };
    let qtype = match QuantType::parse(&args.qtype) {
        Ok(t) => t,
        Err(e) => return fail(e),
    };
    let opts = QuantizeOptions {
        input: args.input.clone(),
        out: args.out.clone(),
        qtype,
        root: args.root.clone(),
        drift_tokens: args.drift_tokens,
        max_drift: args.max_drift,
    };
    match quantize(&opts) {
        Ok(r) => {
            print_report(&r, &opts.out);
            ExitCode::SUCCESS
        }
        Err(e) => fail(e),
    }
}

/// One line on stdout about the quantized output.
pub fn print_report(r: &super::QuantizeReport, out: &std::path::Path) {
    let m = &r.metadata;
    if !r.written {
        println!(
            "{} already holds this quantization; nothing to do",
            out.display()
        );
        return;
    }
    let drift = m
        .drift
        .as_ref()
        .map(|d| format!(", mean KL {:.6} over {} positions", d.mean_kl, d.positions))
        .unwrap_or_default();
    println!(
        "quantized {} to {} ({} -> {} bytes{drift}) into {} in {:.2}s",
        m.source,
        m.quant_type,
        m.source_bytes,
        m.output_bytes,
        out.display(),
        m.seconds
    );
}
