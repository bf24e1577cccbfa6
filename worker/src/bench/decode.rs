//! `bench decode` (being built).

/// Arguments of `bench decode`.
#[derive(clap::Args, Debug)]
pub struct DecodeBenchArgs {
    /// Placeholder.
    #[arg(long)]
    pub placeholder: Option<String>,
}

/// Runs the benchmark.
pub fn run(_args: DecodeBenchArgs) -> std::process::ExitCode {
    eprintln!("bench decode: not built yet");
    std::process::ExitCode::from(2)
}
