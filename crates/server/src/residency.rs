//! The two ends of the peers' residency reports: `GET /v1/residency`, what this worker holds
//! and how busy it is, and the background task that polls every peer's into [`Peers`]
//! (whose choice of peer, [`super::peers::choose`], is pure and lives apart from the state).

use std::sync::{Arc, PoisonError};

use axum::extract::State;
use axum::Json;
use mole_api::{Residency, ResidencyReport, ResidentAdapter};

use super::peers::POLL_CONCURRENCY;
use super::AppState;

/// Polls the peers of the current config until the task is dropped: every interval, each peer's
/// `/v1/residency`, [`POLL_CONCURRENCY`] at once; peers no longer configured are forgotten and
/// their metric series removed.
pub async fn poll_loop(s: Arc<AppState>) {
    use futures::StreamExt;
    loop {
        let every = s.peers.interval();
        if every.is_zero() {
            return;
        }
        let cfg = s.cfg();
        let me = crate::config::this_pod();
        let targets: Vec<(String, String)> = cfg
            .peers
            .iter()
            .filter(|(pod, _)| Some(pod.as_str()) != me.as_deref())
            .map(|(p, u)| (p.clone(), u.clone()))
            .collect();
        s.peers
            .heard
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|pod, _| targets.iter().any(|(p, _)| p == pod));
        // Owned pairs: a spawned task's stream cannot lend out borrows of `targets`.
        futures::stream::iter(targets.clone())
            .map(|(pod, url)| {
                let s = s.clone();
                async move {
                    let r = s.peers.fetch(&url).await;
                    if let Err(e) = &r {
                        tracing::debug!(peer = %pod, "peer poll failed: {e}");
                    }
                    s.peers.record(&pod, &url, r);
                }
            })
            .buffer_unordered(POLL_CONCURRENCY)
            .collect::<()>()
            .await;
        s.metrics.peer_up.reset();
        s.metrics.peer_waiting.reset();
        for (pod, url) in &targets {
            let heard = s.peers.heard.read().unwrap_or_else(PoisonError::into_inner);
            let report = heard
                .get(pod)
                .filter(|h| &h.url == url)
                .and_then(|h| h.report.as_ref().ok());
            let up = report.is_some_and(|r| r.ready);
            s.metrics
                .peer_up
                .with_label_values(&[pod.as_str()])
                .set(i64::from(up));
            if let Some(r) = report {
                s.metrics
                    .peer_waiting
                    .with_label_values(&[pod.as_str()])
                    .set(r.waiting as i64);
            }
        }
        tokio::time::sleep(every).await;
    }
}

/// `GET /v1/residency`: what this worker holds in memory and how busy it is, the report its
/// peers poll to forward requests (no key, as `/metrics`, which tells as much).
#[utoipa::path(get, path = "/v1/residency", tag = "probes",
    responses((status = 200, description = "Adapters in memory and the queue", body = ResidencyReport)))]
pub(super) async fn residency(State(s): State<Arc<AppState>>) -> Json<ResidencyReport> {
    let stats = s.info.stats();
    let adapters = s
        .admin
        .adapters()
        .into_iter()
        .filter(|a| a.loaded && a.residency != Residency::Disk)
        .map(|a| ResidentAdapter {
            name: a.name,
            version: a.version,
            residency: a.residency,
        })
        .collect();
    Json(ResidencyReport {
        ready: s.readiness().is_ok(),
        waiting: stats.waiting as u64,
        running: stats.running as u64,
        adapters,
    })
}
