//! `mole-worker import --gguf FILE --out DIR`.

use std::path::PathBuf;
use std::process::ExitCode;

use super::{import, ImportOptions};
use crate::merge::OutDtype;

/// Arguments of `import`.
#[derive(clap::Args, Debug)]
pub struct ImportArgs {
    /// GGUF model file (llama, qwen2, qwen3 architectures; byte-level BPE tokenizer).
    #[arg(long, env = "MOLE_IMPORT_GGUF")]
    pub gguf: PathBuf,
    /// Output HF directory (must not exist; written atomically).
    #[arg(long, env = "MOLE_IMPORT_OUT")]
    pub out: PathBuf,
    /// Dtype of the dequantised weights.
    #[arg(long, env = "MOLE_IMPORT_DTYPE", default_value = "f32", value_parser = ["f32", "bf16", "f16"])]
    pub dtype: String,
}

/// Runs `import`; one-line reason on failure, exit 2 for bad input, 1 for I/O.
pub fn run(args: ImportArgs) -> ExitCode {
    let opts = ImportOptions {
        gguf: args.gguf,
        out: args.out,
        dtype: OutDtype::parse(&args.dtype).unwrap_or(OutDtype::F32),
    };
    match import(&opts) {
        Ok(r) => {
            println!(
                "imported {} ({} tensors, {} params, vocab {}) into {}",
                r.arch,
                r.tensors,
                r.params,
                r.vocab,
                opts.out.display()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("import failed ({}): {e}", e.code());
            ExitCode::from(e.exit_code())
        }
    }
}
