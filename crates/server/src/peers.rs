//! What this pod knows of its peers (the pool's other dynamic pods, the WorkerConfig's
//! `peers`), and where a request for an adapter this pod does not hold goes.
//!
//! Design, after the Gateway API Inference Extension's endpoint picker, AIBrix's LoRA router and
//! vLLM's production stack, which filter the pods by LoRA residency and then score them by
//! queue depth:
//!
//! - **Live state by polling, not per request.** A background task asks every peer's
//!   `GET /v1/residency` (which adapter versions it holds in a device slot or host memory, its
//!   waiting and running requests, whether it is ready) every `--peer-poll-ms` (1 s), at most
//!   [`POLL_CONCURRENCY`] at once, each within [`POLL_TIMEOUT`]. A report is trusted for
//!   [`STALE_AFTER_POLLS`] intervals; after that the peer is unknown. A peer whose poll failed
//!   or that answered not ready is down, and so is one a forward just failed on, until a poll
//!   says otherwise: it is skipped. Asking per request would add a round trip to every
//!   forwarded request; `/v1/lora_adapters` would carry the residency too, but with its
//!   per-version counters it weighs hundreds of KB at 500 adapters, `/metrics` more.
//! - **Residency first, then load** ([`choose`]): the peers holding the adapter's version in a
//!   device slot, then those holding it in host memory (a copy to the device, no disk read),
//!   each by waiting requests, then running ones, then placement order. A peer holding it only
//!   on disk is never chosen: this pod reads the disk as fast, without the hop. Peers not heard
//!   from within the bound are tried after those, in placement order (a placed pod loads its
//!   share at start, so it most likely holds it), as before polling existed.
//! - **Local when cheaper.** A request is served here, after a read from disk, when no peer
//!   holds the adapter in memory, or when every peer that does has more than one full batch
//!   (`maxBatchSize`) of waiting requests beyond this pod's: the request would wait for at least
//!   a batch of whole requests to finish there, which takes longer than reading an adapter
//!   (tens to hundreds of milliseconds).
//! - **No request fails for where it landed.** Each chosen peer is tried in order; one that
//!   refuses, times out or answers 5xx is marked down and the next is tried; with none left the
//!   request is served here.
//!
//! A merged adapter's ready merged Deployment comes before all this (`gateway::forward`):
//! a request the router sends to merged pods never reaches the peers.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{PoisonError, RwLock};
use std::time::{Duration, Instant};

use mole_api::{Residency, ResidencyReport};

/// Default time between two polls of the peers.
pub const DEFAULT_POLL: Duration = Duration::from_secs(1);
/// A poll's whole time limit: a peer that takes longer is down for this round.
pub const POLL_TIMEOUT: Duration = Duration::from_millis(500);
/// A poll's connect limit (pod to pod in one cluster: a dead pod refuses or never answers).
const POLL_CONNECT_TIMEOUT: Duration = Duration::from_millis(250);
/// Peers polled at once: a round over 64 peers that all time out takes 2 s.
pub const POLL_CONCURRENCY: usize = 16;
/// A report is trusted for this many poll intervals (the staleness bound: 3 s by default).
pub const STALE_AFTER_POLLS: u32 = 3;

/// Why a request for an adapter this pod does not hold went where it went: the `reason` label
/// of `mole_peer_routes_total`. Stable names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouteReason {
    /// Forwarded to a peer holding it in a device slot.
    PeerGpu,
    /// Forwarded to a peer holding it in host memory.
    PeerCpu,
    /// Forwarded to a placed peer not heard from within the staleness bound.
    PeerUnknown,
    /// Served here: no live peer holds it in memory.
    LocalNotHeld,
    /// Served here: every peer holding it has over a batch more waiting requests.
    LocalPeersBusy,
    /// Served here: every peer tried failed.
    LocalPeersFailed,
    /// Served here: no peer is up.
    LocalNoPeer,
}

impl RouteReason {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::PeerGpu => "peer_gpu",
            Self::PeerCpu => "peer_cpu",
            Self::PeerUnknown => "peer_unknown",
            Self::LocalNotHeld => "local_not_held",
            Self::LocalPeersBusy => "local_peers_busy",
            Self::LocalPeersFailed => "local_peers_failed",
            Self::LocalNoPeer => "local_no_peer",
        }
    }
}

/// What this pod knows of one peer, for one adapter version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Seen {
    /// Up, holding the version in memory.
    Holds {
        /// A device slot or host memory.
        residency: Residency,
        /// Its waiting requests.
        waiting: u64,
        /// Its running requests.
        running: u64,
    },
    /// Up, without the version in memory.
    Lacks,
    /// Its last poll or a forward failed, or it is not ready.
    Down,
    /// Not heard from within the staleness bound.
    Unknown,
}

/// One peer as [`choose`] sees it.
#[derive(Clone, Copy, Debug)]
pub struct PeerView<'a> {
    /// Pod name.
    pub pod: &'a str,
    /// Its position in the adapter's placement (`adapters[].pods`), None when not placed there.
    pub placed: Option<usize>,
    /// What this pod knows of it.
    pub seen: Seen,
}

/// Where a request goes: the peers to try in order, each with the reason that sends it there;
/// then, when that list is empty or every one failed, here for `otherwise`.
#[derive(Debug, PartialEq, Eq)]
pub struct Pick<'a> {
    /// Peers to try, best first.
    pub tries: Vec<(&'a str, RouteReason)>,
    /// Why it is served here when no try answers.
    pub otherwise: RouteReason,
}

/// Orders the peers for a request whose adapter this pod holds only on disk (see the module
/// comment): `local_waiting` is this pod's waiting requests, `margin` how many more a peer may
/// have before a local read is cheaper (the pool's `maxBatchSize`). Pure.
pub fn choose<'a>(local_waiting: u64, margin: u64, peers: &[PeerView<'a>]) -> Pick<'a> {
    let rank = |r: Residency| match r {
        Residency::Gpu => 0,
        Residency::Cpu => 1,
        Residency::Disk => 2,
    };
    let mut holders: Vec<_> = peers
        .iter()
        .filter_map(|p| match p.seen {
            Seen::Holds {
                residency,
                waiting,
                running,
            } if residency != Residency::Disk => Some((p, residency, waiting, running)),
            _ => None,
        })
        .collect();
    holders.sort_by_key(|(p, res, waiting, running)| {
        (
            rank(*res),
            *waiting,
            *running,
            p.placed.unwrap_or(usize::MAX),
            p.pod,
        )
    });
    let any_holder = !holders.is_empty();
    let mut tries: Vec<(&'a str, RouteReason)> = holders
        .into_iter()
        .filter(|(_, _, waiting, _)| *waiting <= local_waiting.saturating_add(margin))
        .map(|(p, res, _, _)| {
            let why = if res == Residency::Gpu {
                RouteReason::PeerGpu
            } else {
                RouteReason::PeerCpu
            };
            (p.pod, why)
        })
        .collect();
    let mut unknown: Vec<_> = peers
        .iter()
        .filter(|p| p.seen == Seen::Unknown)
        .filter_map(|p| p.placed.map(|i| (i, p.pod)))
        .collect();
    unknown.sort();
    tries.extend(
        unknown
            .into_iter()
            .map(|(_, pod)| (pod, RouteReason::PeerUnknown)),
    );
    let otherwise = if !tries.is_empty() {
        RouteReason::LocalPeersFailed
    } else if any_holder {
        RouteReason::LocalPeersBusy
    } else if peers.iter().any(|p| p.seen == Seen::Lacks) {
        RouteReason::LocalNotHeld
    } else {
        RouteReason::LocalNoPeer
    };
    Pick { tries, otherwise }
}

/// The last word from one peer.
#[derive(Clone, Debug)]
pub(super) struct Heard {
    /// The address it was heard at (a peer re-created under its name at another address is
    /// unknown until polled there).
    pub(super) url: String,
    /// When.
    at: Instant,
    /// Its report, or why it is down.
    pub(super) report: Result<ResidencyReport, String>,
}

/// The peers' live state, kept by [`super::residency::poll_loop`] and the forwards' failures.
pub struct Peers {
    poll_ms: AtomicU64,
    pub(super) heard: RwLock<HashMap<String, Heard>>,
    client: reqwest::Client,
}

impl Default for Peers {
    fn default() -> Self {
        Self {
            poll_ms: AtomicU64::new(DEFAULT_POLL.as_millis() as u64),
            heard: RwLock::new(HashMap::new()),
            client: reqwest::Client::builder()
                .connect_timeout(POLL_CONNECT_TIMEOUT)
                .timeout(POLL_TIMEOUT)
                .build()
                .unwrap_or_default(),
        }
    }
}

impl Peers {
    /// Sets the time between polls (zero: no polling; peers are then tried in placement
    /// order).
    pub fn set_interval(&self, every: Duration) {
        self.poll_ms
            .store(every.as_millis() as u64, Ordering::Relaxed);
    }

    /// The time between polls.
    pub fn interval(&self) -> Duration {
        Duration::from_millis(self.poll_ms.load(Ordering::Relaxed))
    }

    /// How long a report is trusted.
    fn stale_after(&self) -> Duration {
        // With polling off, a forward's failure still marks a peer down for a while.
        self.interval().max(DEFAULT_POLL) * STALE_AFTER_POLLS
    }

    /// What is known of `pod` (at `url`) for `name` at `version`.
    pub fn seen(&self, pod: &str, url: &str, name: &str, version: &str) -> Seen {
        let heard = self.heard.read().unwrap_or_else(PoisonError::into_inner);
        let Some(h) = heard
            .get(pod)
            .filter(|h| h.url == url && h.at.elapsed() <= self.stale_after())
        else {
            return Seen::Unknown;
        };
        match &h.report {
            Ok(r) if r.ready => match r.residency_of(name, version) {
                Some(residency) => Seen::Holds {
                    residency,
                    waiting: r.waiting,
                    running: r.running,
                },
                None => Seen::Lacks,
            },
            _ => Seen::Down,
        }
    }

    /// Marks `pod` down after a forward to it failed, so the next requests skip it without
    /// waiting for the next poll.
    pub fn mark_down(&self, pod: &str, url: &str, why: String) {
        self.record(pod, url, Err(why));
    }

    pub(super) fn record(&self, pod: &str, url: &str, report: Result<ResidencyReport, String>) {
        self.heard
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(
                pod.to_string(),
                Heard {
                    url: url.to_string(),
                    at: Instant::now(),
                    report,
                },
            );
    }

    /// One poll of the peer at `url`.
    pub(super) async fn fetch(&self, url: &str) -> Result<ResidencyReport, String> {
        let u = format!("{}/v1/residency", url.trim_end_matches('/'));
        let r = self
            .client
            .get(&u)
            .send()
            .await
            .map_err(|e| format!("{u}: {e}"))?;
        if !r.status().is_success() {
            return Err(format!("{u} answered {}", r.status()));
        }
        r.json().await.map_err(|e| format!("{u}: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mole_api::ResidentAdapter;
    use RouteReason::*;

    fn holds(residency: Residency, waiting: u64, running: u64) -> Seen {
        Seen::Holds {
            residency,
            waiting,
            running,
        }
    }

    fn view(pod: &str, placed: Option<usize>, seen: Seen) -> PeerView<'_> {
        PeerView { pod, placed, seen }
    }

    #[test]
    fn residency_comes_before_placement_order_and_load() {
        // Placement lists c first; c has it on disk only (Lacks), b in a device slot, d in host
        // memory and idle.
        let peers = [
            view("c", Some(0), Seen::Lacks),
            view("d", Some(1), holds(Residency::Cpu, 0, 0)),
            view("b", None, holds(Residency::Gpu, 2, 3)),
        ];
        let p = choose(0, 8, &peers);
        assert_eq!(p.tries, vec![("b", PeerGpu), ("d", PeerCpu)]);
        assert_eq!(p.otherwise, LocalPeersFailed);
    }

    /// A peer of a table row: name, placement position, what is known of it.
    type Peer<'a> = (&'a str, Option<usize>, Seen);

    #[test]
    fn equal_residency_goes_by_waiting_then_running_then_placement() {
        let cases: &[(&[Peer], &[&str])] = &[
            (
                &[
                    ("a", Some(0), holds(Residency::Cpu, 3, 0)),
                    ("b", Some(1), holds(Residency::Cpu, 1, 9)),
                ],
                &["b", "a"],
            ),
            (
                &[
                    ("a", Some(0), holds(Residency::Cpu, 1, 4)),
                    ("b", Some(1), holds(Residency::Cpu, 1, 2)),
                ],
                &["b", "a"],
            ),
            (
                &[
                    ("b", Some(1), holds(Residency::Gpu, 0, 0)),
                    ("a", Some(0), holds(Residency::Gpu, 0, 0)),
                    ("z", None, holds(Residency::Gpu, 0, 0)),
                ],
                &["a", "b", "z"],
            ),
        ];
        for (peers, want) in cases {
            let v: Vec<_> = peers.iter().map(|(p, i, s)| view(p, *i, *s)).collect();
            let got: Vec<&str> = choose(0, 8, &v).tries.iter().map(|t| t.0).collect();
            assert_eq!(got, want.to_vec(), "{peers:?}");
        }
    }

    #[test]
    fn a_much_busier_peer_loses_to_a_local_read() {
        // Margin 4: a peer may have 4 more waiting than this pod.
        let peers = [
            view("a", Some(0), holds(Residency::Gpu, 7, 0)),
            view("b", Some(1), holds(Residency::Cpu, 9, 0)),
        ];
        assert_eq!(choose(3, 4, &peers).tries, vec![("a", PeerGpu)]);
        let p = choose(2, 4, &peers);
        assert_eq!(p.tries, vec![]);
        assert_eq!(p.otherwise, LocalPeersBusy);
    }

    #[test]
    fn disk_only_down_and_unplaced_unknown_peers_are_not_tried() {
        let peers = [
            view("a", Some(0), Seen::Lacks),
            view("b", Some(1), Seen::Down),
            view("c", None, Seen::Unknown),
        ];
        assert_eq!(
            choose(0, 8, &peers),
            Pick {
                tries: vec![],
                otherwise: LocalNotHeld
            }
        );
        let none = [view("b", Some(1), Seen::Down)];
        assert_eq!(choose(0, 8, &none).otherwise, LocalNoPeer);
        assert_eq!(choose(0, 8, &[]).otherwise, LocalNoPeer);
    }

    #[test]
    fn unknown_placed_peers_follow_the_known_holders_in_placement_order() {
        let peers = [
            view("u2", Some(2), Seen::Unknown),
            view("u0", Some(0), Seen::Unknown),
            view("h", Some(1), holds(Residency::Cpu, 0, 0)),
        ];
        assert_eq!(
            choose(0, 8, &peers).tries,
            vec![("h", PeerCpu), ("u0", PeerUnknown), ("u2", PeerUnknown)]
        );
    }

    #[test]
    fn a_report_is_trusted_until_the_staleness_bound_and_a_failure_marks_down() {
        let p = Peers::default();
        p.set_interval(Duration::from_millis(10));
        assert_eq!(p.seen("a", "http://a", "fr", "v1"), Seen::Unknown);
        let report = ResidencyReport {
            ready: true,
            waiting: 2,
            running: 1,
            adapters: vec![ResidentAdapter {
                name: "fr".into(),
                version: "v1".into(),
                residency: Residency::Gpu,
            }],
        };
        p.record("a", "http://a", Ok(report.clone()));
        assert_eq!(
            p.seen("a", "http://a", "fr", "v1"),
            holds(Residency::Gpu, 2, 1)
        );
        assert_eq!(p.seen("a", "http://a", "fr", "v2"), Seen::Lacks);
        // Another address under the same name: not what was heard.
        assert_eq!(p.seen("a", "http://a2", "fr", "v1"), Seen::Unknown);
        p.record(
            "a",
            "http://a",
            Ok(ResidencyReport {
                ready: false,
                ..report.clone()
            }),
        );
        assert_eq!(p.seen("a", "http://a", "fr", "v1"), Seen::Down);
        p.mark_down("a", "http://a", "refused".into());
        assert_eq!(p.seen("a", "http://a", "fr", "v1"), Seen::Down);
        // Past the bound (3 intervals, at least 3 s): unknown again.
        p.heard.write().unwrap().get_mut("a").unwrap().at -= Duration::from_secs(4);
        assert_eq!(p.seen("a", "http://a", "fr", "v1"), Seen::Unknown);
    }
}
