//! `mole-worker inspect` (being built).

/// Arguments of `inspect`.
#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    /// Model or adapter directory.
    pub dir: std::path::PathBuf,
}

/// Runs `inspect`.
pub fn run(_args: InspectArgs) -> std::process::ExitCode {
    eprintln!("inspect: not built yet");
    std::process::ExitCode::from(2)
}
