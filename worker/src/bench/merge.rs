//! `bench merge` (being built).

/// Arguments of `bench merge`.
#[derive(clap::Args, Debug)]
pub struct MergeBenchArgs {
    /// Placeholder.
    #[arg(long)]
    pub placeholder: Option<String>,
}

/// Runs the benchmark.
pub fn run(_args: MergeBenchArgs) -> std::process::ExitCode {
    eprintln!("bench merge: not built yet");
    std::process::ExitCode::from(2)
}
