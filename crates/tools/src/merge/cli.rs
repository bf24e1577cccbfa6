//! `mole-worker merge`: the command the operator's merge Job runs.

use std::path::PathBuf;
use std::process::ExitCode;

use super::{merge, MergeOptions, OutDtype};

/// Arguments of `merge`.
#[derive(clap::Args, Debug)]
pub struct MergeArgs {
    /// Base HF model directory (config.json + safetensors, sharded or not).
    #[arg(long, env = "MOLE_MERGE_BASE")]
    pub base: PathBuf,
    /// PEFT adapter directory (adapter_config.json + adapter_model.safetensors).
    #[arg(long, env = "MOLE_MERGE_ADAPTER")]
    pub adapter: PathBuf,
    /// Output directory; written to a temporary sibling and renamed at the end.
    #[arg(long, env = "MOLE_MERGE_OUT")]
    pub out: PathBuf,
    /// Fail, naming the module, when a merged tensor has NaN or Inf.
    #[arg(long, env = "MOLE_MERGE_SAFE")]
    pub safe_merge: bool,
    /// Output dtype (default: the base's).
    #[arg(long, env = "MOLE_MERGE_DTYPE", value_parser = ["bf16", "f16", "f32"])]
    pub dtype: Option<String>,
    /// Every path must resolve, symlinks included, inside this directory.
    #[arg(long, env = "MOLE_MODEL_ROOT")]
    pub root: Option<PathBuf>,
    /// Refuse adapters whose base_model_name_or_path names another model.
    #[arg(long, env = "MOLE_MERGE_EXPECT_BASE")]
    pub expect_base: Option<String>,
    /// Highest LoRA rank accepted.
    #[arg(long, env = "MOLE_MAX_LORA_RANK", default_value_t = 512)]
    pub max_rank: usize,
    /// Adapter name for merge_metadata.json.
    #[arg(long, env = "MOLE_MERGE_ADAPTER_NAME")]
    pub adapter_name: Option<String>,
    /// Adapter version for merge_metadata.json.
    #[arg(long, env = "MOLE_MERGE_ADAPTER_VERSION")]
    pub adapter_version: Option<String>,
    /// Skip the fdatasync of the output before it is renamed into place (outputs on tmpfs,
    /// benchmarks against `cp`); by default a machine crash cannot expose a partial merge.
    #[arg(long, env = "MOLE_MERGE_NO_FSYNC")]
    pub no_fsync: bool,
    /// Where the one-line failure reason is also written (Kubernetes copies it into the
    /// Pod's termination message). Default: /dev/termination-log, when it exists.
    #[arg(long, env = "MOLE_TERMINATION_LOG")]
    pub termination_log: Option<PathBuf>,
    /// Quantize the merged model (q8_0, q4_0, q4_1, q4_k, q5_k, q6_k) and write only the
    /// quantized model to --out (the dense merge goes to a temporary sibling, removed after).
    #[arg(long, env = "MOLE_MERGE_QUANTIZE")]
    pub quantize: Option<String>,
    /// With --quantize: refuse the output when its mean next-token KL divergence against the
    /// dense merge (nats) is above this.
    #[arg(long, env = "MOLE_QUANTIZE_MAX_DRIFT", requires = "quantize")]
    pub max_drift: Option<f64>,
    /// With --quantize: tokens of each of the 8 drift prompts (0: drift not measured).
    #[arg(long, env = "MOLE_QUANTIZE_DRIFT_TOKENS", default_value_t = crate::quantize::cli::DEFAULT_DRIFT_TOKENS)]
    pub drift_tokens: usize,
}

/// Runs `merge`. On failure prints one line to stderr and to the termination log
/// (`--termination-log` / `MOLE_TERMINATION_LOG`, default `/dev/termination-log` when it
/// exists), where Kubernetes picks it up for the Adapter's condition; exit 2 for bad input,
/// 1 for I/O.
pub fn run(args: MergeArgs) -> ExitCode {
    let termination_log = args.termination_log;
    super::set_durable(!args.no_fsync);
    let opts = MergeOptions {
        base: args.base,
        adapter: args.adapter,
        out: args.out,
        safe_merge: args.safe_merge,
        dtype: args.dtype.as_deref().and_then(OutDtype::parse),
        root: args.root,
        expect_base: args.expect_base,
        max_rank: args.max_rank,
        adapter_name: args.adapter_name,
        adapter_version: args.adapter_version,
    };
    if let Some(t) = &args.quantize {
        let quant = match crate::quantize::QuantType::parse(t) {
            Ok(q) => q,
            Err(e) => return quantize_failed(termination_log.as_deref(), e),
        };
        return match merge_then_quantize(&opts, quant, args.max_drift, args.drift_tokens) {
            Ok(r) => {
                crate::quantize::cli::print_report(&r, &opts.out);
                ExitCode::SUCCESS
            }
            Err(e) => quantize_failed(termination_log.as_deref(), e),
        };
    }
    let result = merge(&opts);
    if std::env::var_os("MOLE_MERGE_REPORT_RSS").is_some() {
        // For `bench merge`: the high-water mark of resident memory of this process.
        if let Some(kib) = std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("VmHWM:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            })
        {
            eprintln!("peak_rss_bytes {}", kib * 1024);
        }
    }
    match result {
        Ok(report) => {
            let m = &report.metadata;
            if report.written {
                println!(
                    "merged {} modules ({} tensors replaced, {} params) into {} in {:.2}s",
                    m.modules_merged,
                    m.tensors_replaced,
                    m.total_params,
                    opts.out.display(),
                    m.seconds
                );
                if m.dequantized_modules > 0 {
                    println!(
                        "dequantized {} modules of the quantized base exactly and wrote them \
                         dense (quantization_config.modules_to_not_convert); the rest stays \
                         packed",
                        m.dequantized_modules
                    );
                }
            } else {
                println!(
                    "{} already holds this merge; nothing to do",
                    opts.out.display()
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            let line = format!("merge failed ({}): {e}", e.code());
            eprintln!("{line}");
            mole_telemetry::write_termination_log(termination_log.as_deref(), &line);
            ExitCode::from(e.exit_code())
        }
    }
}

fn quantize_failed(
    termination_log: Option<&std::path::Path>,
    e: crate::quantize::QuantizeError,
) -> ExitCode {
    let line = match &e {
        crate::quantize::QuantizeError::Merge(m) => format!("merge failed ({}): {m}", m.code()),
        e => format!("quantize failed ({}): {e}", e.code()),
    };
    eprintln!("{line}");
    mole_telemetry::write_termination_log(termination_log, &line);
    ExitCode::from(e.exit_code())
}

/// The merge Job with `spec.merge.quantize`: merges into a temporary sibling of `--out`,
/// quantizes that into `--out` (atomic, measured against the dense merge), and removes the
/// dense merge whatever happened. An `--out` that already holds the quantization of this
/// merge is a no-op; one made from other inputs is refused.
pub fn merge_then_quantize(
    opts: &MergeOptions,
    quant: crate::quantize::QuantType,
    max_drift: Option<f64>,
    drift_tokens: usize,
) -> Result<crate::quantize::QuantizeReport, crate::quantize::QuantizeError> {
    use crate::quantize::{QuantizeError, QuantizeOptions};
    let name = opts
        .out
        .file_name()
        .ok_or_else(|| QuantizeError::Input(format!("{}: no directory name", opts.out.display())))?
        .to_string_lossy()
        .to_string();
    if opts.out.exists() {
        let digest = super::inputs_digest(opts)?;
        let merged: Option<super::MergeMetadata> =
            std::fs::read_to_string(opts.out.join("merge_metadata.json"))
                .ok()
                .and_then(|t| serde_json::from_str(&t).ok());
        let quantized = crate::quantize::read_metadata(&opts.out);
        // The dense merge is gone: its identity is the merge's inputs, and the quantization's
        // the options it was made with.
        let same = matches!((&merged, &quantized), (Some(m), Some(q))
            if m.inputs_sha256 == digest
                && q.merge_inputs_sha256.as_deref() == Some(digest.as_str())
                && q.quant_type == quant.name()
                && q.max_drift == max_drift
                && q.drift_tokens == drift_tokens);
        return match (same, quantized) {
            (true, Some(metadata)) => Ok(crate::quantize::QuantizeReport {
                metadata,
                written: false,
            }),
            _ => Err(QuantizeError::OutputExists(opts.out.display().to_string())),
        };
    }
    // A sibling whose name starts like the quantize's temporaries: a crashed run's is removed
    // by the next run's clean-up.
    let dense = opts.out.with_file_name(format!(".{name}.tmp-dense"));
    let _ = std::fs::remove_dir_all(&dense);
    let mut dense_opts = opts.clone();
    dense_opts.out = dense.clone();
    let result = merge(&dense_opts)
        .map_err(QuantizeError::from)
        .and_then(|_| {
            crate::quantize::quantize(&QuantizeOptions {
                input: dense.clone(),
                out: opts.out.clone(),
                qtype: quant,
                root: opts.root.clone(),
                drift_tokens,
                max_drift,
            })
        });
    let _ = std::fs::remove_dir_all(&dense);
    result
}
