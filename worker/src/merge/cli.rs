//! Command line (being built).

/// Arguments.
#[derive(clap::Args, Debug)]
pub struct MergeArgs {
    /// Placeholder.
    #[arg(long)]
    pub placeholder: Option<String>,
}

/// Runs the subcommand.
pub fn run(_args: MergeArgs) -> std::process::ExitCode {
    eprintln!("not built yet");
    std::process::ExitCode::from(2)
}
