//! Operator metrics and the one HTTP port with `/healthz`, `/readyz` and `/metrics`.
//! Labels are bounded: controller name and stable error names, never object names.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::Router;
use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, Opts, Registry, TextEncoder,
};

/// The operator's metrics.
#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    /// Reconciles by controller.
    pub reconciles: IntCounterVec,
    /// Failed reconciles by controller and stable error name.
    pub errors: IntCounterVec,
    /// Reconcile duration by controller.
    pub duration: HistogramVec,
    /// 1 while this replica holds the leader Lease.
    pub leader: IntGauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates and registers the metrics.
    pub fn new() -> Self {
        let registry = Registry::new();
        let reconciles = IntCounterVec::new(
            Opts::new(
                "mole_operator_reconciles_total",
                "Reconciles run, by controller.",
            ),
            &["controller"],
        )
        .expect("valid metric");
        let errors = IntCounterVec::new(
            Opts::new(
                "mole_operator_reconcile_errors_total",
                "Reconciles that failed, by controller and stable error name.",
            ),
            &["controller", "error"],
        )
        .expect("valid metric");
        let duration = HistogramVec::new(
            HistogramOpts::new(
                "mole_operator_reconcile_duration_seconds",
                "Reconcile duration.",
            )
            .buckets(vec![
                0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            ]),
            &["controller"],
        )
        .expect("valid metric");
        let leader = IntGauge::new(
            "mole_operator_leader",
            "1 while this replica is the leader.",
        )
        .expect("valid metric");
        for c in [
            Box::new(reconciles.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(errors.clone()),
            Box::new(duration.clone()),
            Box::new(leader.clone()),
        ] {
            registry.register(c).expect("unique metric");
        }
        Self {
            registry,
            reconciles,
            errors,
            duration,
            leader,
        }
    }

    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .expect("text encoding never fails");
        String::from_utf8(buf).expect("prometheus text is UTF-8")
    }
}

/// Health of the process: ready once the controllers run (or it waits as a standby).
#[derive(Clone, Default)]
pub struct Health {
    ready: Arc<AtomicBool>,
}

impl Health {
    /// Marks the process ready.
    pub fn set_ready(&self) {
        self.ready.store(true, Ordering::SeqCst);
    }
}

/// Serves `/healthz`, `/readyz` and `/metrics` on `addr` until the process ends.
pub async fn serve(addr: SocketAddr, metrics: Metrics, health: Health) -> std::io::Result<()> {
    let app = Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(|State((_, h)): State<(Metrics, Health)>| async move {
                if h.ready.load(Ordering::SeqCst) {
                    (StatusCode::OK, "ready")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "starting")
                }
            }),
        )
        .route(
            "/metrics",
            get(|State((m, _)): State<(Metrics, Health)>| async move {
                ([("content-type", "text/plain; version=0.0.4")], m.render())
            }),
        )
        .with_state((metrics, health));
    let listener = tokio::net::TcpListener::bind(addr).await?;
    axum::serve(listener, app).await
}
