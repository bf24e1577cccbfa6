//! Logs and traces of mole's binaries, shared by `mole-worker` and `mole-operator`.
//!
//! Logs go to stderr (human-readable, coloured only on a terminal, or JSON with `MOLE_LOG_FORMAT=json`; the filter from
//! `MOLE_LOG`, else `RUST_LOG`, default `info`). Traces leave the process only when an OTLP
//! endpoint is configured (`--otlp-traces-endpoint`, as vLLM names it): then every `tracing`
//! span the filter lets through is also an OpenTelemetry span, batched and exported over
//! OTLP/HTTP (protobuf) on a thread of its own, and W3C `traceparent` headers carry a trace
//! from one process to the next ([`continue_trace`], [`inject`]). The OpenTelemetry SDK's own
//! variables apply (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER`,
//! `OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_EXPORTER_OTLP_TIMEOUT`).

#![forbid(unsafe_code)]

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{fmt, EnvFilter, Layer};

/// Why telemetry could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// The OTLP endpoint is not an http(s) URL.
    #[error("invalid OTLP traces endpoint {endpoint:?}: {reason}")]
    InvalidEndpoint {
        /// The endpoint as given.
        endpoint: String,
        /// Why it is refused.
        reason: String,
    },
    /// The exporter could not be built.
    #[error("OTLP exporter: {0}")]
    Exporter(String),
}

impl TelemetryError {
    /// Stable name (logs, exit messages).
    pub fn code(&self) -> &'static str {
        match self {
            TelemetryError::InvalidEndpoint { .. } => "invalid_otlp_endpoint",
            TelemetryError::Exporter(_) => "otlp_exporter",
        }
    }
}

/// Holds the trace exporter while the program runs; dropping it exports what is still
/// buffered (a few seconds at most), so keep it until `main` returns.
#[must_use = "dropping the guard stops the trace export"]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Whether spans are exported.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Exports every span ended so far (tests read them right after).
    pub fn flush(&self) {
        if let Some(p) = &self.provider {
            if let Err(e) = p.force_flush() {
                tracing::warn!(error = %e, "exporting traces failed");
            }
        }
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take() {
            if let Err(e) = p.shutdown() {
                eprintln!("exporting the last traces failed: {e}");
            }
        }
    }
}

/// The OTLP/HTTP traces URL of `endpoint`: a collector's base URL (`http://collector:4318`)
/// gets the signal's path `/v1/traces`, as the OpenTelemetry specification builds it from
/// `OTEL_EXPORTER_OTLP_ENDPOINT`; a URL with a path is used as it is.
pub fn traces_url(endpoint: &str) -> Result<String, TelemetryError> {
    let bad = |reason: &str| TelemetryError::InvalidEndpoint {
        endpoint: endpoint.into(),
        reason: reason.into(),
    };
    let uri: http::Uri = endpoint.parse().map_err(|e| bad(&format!("{e}")))?;
    match uri.scheme_str() {
        Some("http" | "https") => {}
        _ => return Err(bad("OTLP/HTTP needs an http:// or https:// URL")),
    }
    if uri.host().is_none_or(str::is_empty) {
        return Err(bad("no host"));
    }
    Ok(match uri.path() {
        "" | "/" => format!("{}/v1/traces", endpoint.trim_end_matches('/')),
        _ => endpoint.into(),
    })
}

/// Installs the process's subscriber: logs always, OpenTelemetry spans for `service` when
/// `otlp_traces_endpoint` is set (`OTEL_SERVICE_NAME` overrides the name). A second call in
/// one process (tests) keeps the first subscriber and returns a guard that exports nothing.
pub fn init(
    service: &'static str,
    otlp_traces_endpoint: Option<&str>,
) -> Result<Telemetry, TelemetryError> {
    let filter = || {
        std::env::var("MOLE_LOG")
            .ok()
            .and_then(|v| EnvFilter::try_new(v).ok())
            .or_else(|| EnvFilter::try_from_default_env().ok())
            .unwrap_or_else(|| EnvFilter::new("info"))
    };
    let json = std::env::var("MOLE_LOG_FORMAT").is_ok_and(|v| v == "json");
    let logs = match json {
        true => fmt::layer().json().with_writer(std::io::stderr).boxed(),
        // Colours only for a terminal: in a pod stderr is a file, and `kubectl logs` would
        // show the escape codes.
        false => fmt::layer()
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_writer(std::io::stderr)
            .boxed(),
    };
    let provider = otlp_traces_endpoint
        .filter(|e| !e.trim().is_empty())
        .map(|e| provider(service, e))
        .transpose()?;
    let traces = provider.as_ref().map(|p| {
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer(service))
            .with_filter(filter())
    });
    let installed = tracing_subscriber::registry()
        .with(logs.with_filter(filter()))
        .with(traces)
        .try_init()
        .is_ok();
    if !installed {
        if let Some(p) = provider {
            let _ = p.shutdown();
        }
        return Ok(Telemetry { provider: None });
    }
    if let Some(e) = otlp_traces_endpoint.filter(|_| provider.is_some()) {
        opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
        tracing::info!(endpoint = %e, service, "exporting traces over OTLP/HTTP");
    }
    Ok(Telemetry { provider })
}

/// The tracer provider exporting `service`'s spans in batches to `endpoint`.
fn provider(service: &'static str, endpoint: &str) -> Result<SdkTracerProvider, TelemetryError> {
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_endpoint(traces_url(endpoint)?)
        .build()
        .map_err(|e| TelemetryError::Exporter(e.to_string()))?;
    let mut resource = opentelemetry_sdk::Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name(service);
    }
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.build())
        .build())
}

/// Makes `span` continue the trace whose W3C `traceparent` (and `tracestate`) `headers`
/// carry: the caller's span becomes its parent. Without such headers, or with export off, the
/// span starts a trace of its own.
pub fn continue_trace(span: &tracing::Span, headers: &http::HeaderMap) {
    if !headers.contains_key("traceparent") {
        return;
    }
    let parent = opentelemetry::global::get_text_map_propagator(|p| {
        p.extract(&opentelemetry_http::HeaderExtractor(headers))
    });
    // Fails only when export is off (no OpenTelemetry layer): nothing to continue then.
    let _ = span.set_parent(parent);
}

/// Writes `span`'s W3C trace context into `headers`, so the process they go to continues the
/// trace. False when there is none to write (export off): the caller may pass on the trace
/// headers it received instead.
pub fn inject(span: &tracing::Span, headers: &mut http::HeaderMap) -> bool {
    let cx = span.context();
    opentelemetry::global::get_text_map_propagator(|p| {
        p.inject_context(&cx, &mut opentelemetry_http::HeaderInjector(headers))
    });
    headers.contains_key("traceparent")
}

/// Writes a failed subcommand's one-line reason where Kubernetes looks for it: the given path
/// (created), or `/dev/termination-log` when it exists (a container's default
/// `terminationMessagePath`), so `kubectl describe` and the operator read why a Job failed.
pub fn write_termination_log(given: Option<&std::path::Path>, line: &str) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_collector_base_url_gets_the_traces_path_and_others_are_refused() {
        assert_eq!(
            traces_url("http://collector:4318").unwrap(),
            "http://collector:4318/v1/traces"
        );
        assert_eq!(
            traces_url("https://c.example/").unwrap(),
            "https://c.example/v1/traces"
        );
        assert_eq!(
            traces_url("http://c:4318/custom/traces").unwrap(),
            "http://c:4318/custom/traces"
        );
        for bad in ["grpc://c:4317", "c:4318", "", "http://"] {
            let e = traces_url(bad).unwrap_err();
            assert_eq!(e.code(), "invalid_otlp_endpoint", "{bad}");
        }
    }
}
