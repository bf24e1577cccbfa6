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
}

/// Writes the failure reason where Kubernetes looks for it: the given path (created), or
/// `/dev/termination-log` when it exists (a container's default `terminationMessagePath`).
pub(crate) fn write_termination_log(given: Option<&std::path::Path>, line: &str) {
    let default = std::path::Path::new("/dev/termination-log");
    let path = match given {
        Some(p) => p,
        None if default.exists() => default,
        None => return,
    };
    if let Err(e) = std::fs::write(path, format!("{line}\n")) {
        eprintln!("cannot write the termination log {}: {e}", path.display());
    }
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
            write_termination_log(termination_log.as_deref(), &line);
            ExitCode::from(e.exit_code())
        }
    }
}
