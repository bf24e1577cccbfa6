//! Logging setup shared by every subcommand.

/// Installs a tracing subscriber: human-readable by default, JSON with `MOLE_LOG_FORMAT=json`;
/// the filter comes from `MOLE_LOG` (or `RUST_LOG`), default `info`.
pub fn init() {
    use tracing_subscriber::{fmt, EnvFilter};
    let filter = std::env::var("MOLE_LOG")
        .ok()
        .and_then(|v| EnvFilter::try_new(v).ok())
        .or_else(|| EnvFilter::try_from_default_env().ok())
        .unwrap_or_else(|| EnvFilter::new("info"));
    let json = std::env::var("MOLE_LOG_FORMAT").is_ok_and(|v| v == "json");
    let builder = fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}
