//! Logs and traces of every subcommand: the subscriber `mole-telemetry` installs (shared with
//! the operator), under the service name `mole-worker`, and the one line a failed subcommand
//! leaves in its termination log.

pub use mole_telemetry::{continue_trace, inject, Telemetry, TelemetryError};

/// Installs the logs, and the OTLP trace export when `otlp_traces_endpoint` is set.
pub fn init(otlp_traces_endpoint: Option<&str>) -> Result<Telemetry, TelemetryError> {
    mole_telemetry::init("mole-worker", otlp_traces_endpoint)
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
