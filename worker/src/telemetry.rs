//! Logs and traces of every subcommand: the subscriber `mole-telemetry` installs (shared with
//! the operator), under the service name `mole-worker`.

pub use mole_telemetry::{continue_trace, inject, Telemetry, TelemetryError};

/// Installs the logs, and the OTLP trace export when `otlp_traces_endpoint` is set.
pub fn init(otlp_traces_endpoint: Option<&str>) -> Result<Telemetry, TelemetryError> {
    mole_telemetry::init("mole-worker", otlp_traces_endpoint)
}
