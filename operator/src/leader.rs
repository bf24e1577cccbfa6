//! Leader election on a `coordination.k8s.io/v1` Lease, so two operator replicas never both
//! write. The holder renews every `renew`; a Lease not renewed for `duration` may be taken
//! over. Every write carries the Lease's resourceVersion: of two candidates racing for an
//! expired Lease, exactly one wins. A holder that could not renew for `renew_deadline`
//! (shorter than `duration`, like client-go's renewDeadline) steps down, so it has stopped
//! writing before another replica may take the Lease.
//!
//! Expiry is judged as Kubernetes' own leader election does: by how long the Lease record has
//! gone unchanged on the candidate's own monotonic clock ([`Observer`]), never by comparing
//! the holder's `renewTime` with the candidate's wall clock, which may be skewed by more than
//! the Lease duration on another node.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::PostParams;
use kube::{Api, Client};

/// Lease settings.
#[derive(Debug, Clone)]
pub struct LeaseConfig {
    /// Lease name.
    pub name: String,
    /// Namespace of the Lease.
    pub namespace: String,
    /// This replica's identity (pod name).
    pub identity: String,
    /// How long a Lease stays valid without renewal.
    pub duration: Duration,
    /// How often the holder renews (and a standby retries).
    pub renew: Duration,
    /// The holder steps down when its last successful renewal is this old. Must be shorter
    /// than `duration` (the gap is the margin for clock skew and a slow exit).
    pub renew_deadline: Duration,
}

impl LeaseConfig {
    /// Settings from the Lease duration alone: renew deadline 2/3 of it, renew period 1/3
    /// (client-go's 15 s / 10 s / 2 s scaled).
    pub fn with_duration(
        name: String,
        namespace: String,
        identity: String,
        duration: Duration,
    ) -> Self {
        Self {
            name,
            namespace,
            identity,
            duration,
            renew: duration / 3,
            renew_deadline: duration * 2 / 3,
        }
    }

    /// Checks that renewals fit: `renew < renew_deadline < duration`.
    pub fn validate(&self) -> Result<(), String> {
        if self.renew_deadline >= self.duration {
            return Err(format!(
                "renew deadline {:?} must be shorter than the lease duration {:?}",
                self.renew_deadline, self.duration
            ));
        }
        if self.renew >= self.renew_deadline {
            return Err(format!(
                "renew period {:?} must be shorter than the renew deadline {:?}",
                self.renew, self.renew_deadline
            ));
        }
        Ok(())
    }
}

/// Whether a holder whose last successful renewal was `since_renewal` ago must stop.
pub fn must_step_down(cfg: &LeaseConfig, since_renewal: Duration) -> bool {
    since_renewal >= cfg.renew_deadline
}

/// What a candidate last saw of the Lease's record, and when it first saw it, by its own
/// monotonic clock (client-go's `observedRecord` and `observedTime`).
#[derive(Debug, Default)]
pub struct Observer {
    seen: Option<(LeaseSpec, std::time::Instant)>,
}

impl Observer {
    /// Records `lease` as seen at `now`: the clock restarts only when the record changed.
    pub fn observe(&mut self, lease: &Lease, now: std::time::Instant) {
        let spec = lease.spec.clone().unwrap_or_default();
        match &self.seen {
            Some((s, _)) if *s == spec => {}
            _ => self.seen = Some((spec, now)),
        }
    }

    /// Whether `lease` may be taken by `me` at `now`: it is free or ours, or its record has
    /// not changed for its `leaseDurationSeconds` since this candidate first saw it.
    pub fn can_take(&mut self, lease: &Lease, me: &str, now: std::time::Instant) -> bool {
        self.observe(lease, now);
        let Some(spec) = &lease.spec else { return true };
        match spec.holder_identity.as_deref() {
            None | Some("") => true,
            Some(h) if h == me => true,
            Some(_) => {
                let dur =
                    Duration::from_secs(spec.lease_duration_seconds.unwrap_or(15).max(0) as u64);
                self.seen
                    .as_ref()
                    .is_some_and(|(_, at)| now.saturating_duration_since(*at) > dur)
            }
        }
    }
}

fn spec_for(cfg: &LeaseConfig, now: Timestamp, prior: Option<&LeaseSpec>) -> LeaseSpec {
    let same_holder =
        prior.and_then(|p| p.holder_identity.as_deref()) == Some(cfg.identity.as_str());
    LeaseSpec {
        holder_identity: Some(cfg.identity.clone()),
        lease_duration_seconds: Some(cfg.duration.as_secs() as i32),
        acquire_time: if same_holder {
            prior.and_then(|p| p.acquire_time.clone())
        } else {
            Some(MicroTime(now))
        },
        renew_time: Some(MicroTime(now)),
        lease_transitions: Some(
            prior.and_then(|p| p.lease_transitions).unwrap_or(0) + if same_holder { 0 } else { 1 },
        ),
        ..Default::default()
    }
}

/// Tries once to acquire or renew the Lease. Ok(true): we hold it. `obs` carries what this
/// replica saw of the Lease between calls.
pub async fn try_acquire(
    api: &Api<Lease>,
    cfg: &LeaseConfig,
    obs: &mut Observer,
) -> kube::Result<bool> {
    // renewTime and acquireTime are written for people and other tools; expiry is judged by
    // `obs` on the local monotonic clock.
    let now = Timestamp::now();
    match api.get_opt(&cfg.name).await? {
        None => {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(cfg.name.clone()),
                    namespace: Some(cfg.namespace.clone()),
                    ..Default::default()
                },
                spec: Some(spec_for(cfg, now, None)),
            };
            match api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
                Err(e) => Err(e),
            }
        }
        Some(lease) if obs.can_take(&lease, &cfg.identity, std::time::Instant::now()) => {
            let mut next = lease.clone();
            next.spec = Some(spec_for(cfg, now, lease.spec.as_ref()));
            // replace() sends metadata.resourceVersion: a concurrent writer gets 409.
            match api.replace(&cfg.name, &PostParams::default(), &next).await {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
                Err(e) => Err(e),
            }
        }
        Some(_) => Ok(false),
    }
}

/// Blocks until this replica holds the Lease.
pub async fn acquire(client: Client, cfg: &LeaseConfig) {
    let api: Api<Lease> = Api::namespaced(client, &cfg.namespace);
    let mut obs = Observer::default();
    loop {
        match try_acquire(&api, cfg, &mut obs).await {
            Ok(true) => return,
            Ok(false) => tracing::info!(lease = %cfg.name, "another replica leads; waiting"),
            Err(e) => tracing::warn!(error = %e, "leader election failed; retrying"),
        }
        tokio::time::sleep(cfg.renew).await;
    }
}

/// The Lease record of a holder giving it up (client-go's `ReleaseOnCancel`): no holder, a
/// duration of one second, the transitions kept. A standby then takes it at its next try
/// instead of waiting out the lease duration.
pub fn released(prior: &LeaseSpec, now: Timestamp) -> LeaseSpec {
    LeaseSpec {
        holder_identity: Some(String::new()),
        lease_duration_seconds: Some(1),
        acquire_time: Some(MicroTime(now)),
        renew_time: Some(MicroTime(now)),
        lease_transitions: prior.lease_transitions,
        ..Default::default()
    }
}

/// Gives the Lease up if this replica still holds it, so a rolling update or a drain hands
/// leadership over at once. Ok(true) when released; Ok(false) when another replica holds it
/// (nothing to give). A failure only means the standby waits for the Lease to expire.
pub async fn release(client: Client, cfg: &LeaseConfig) -> kube::Result<bool> {
    let api: Api<Lease> = Api::namespaced(client, &cfg.namespace);
    let Some(lease) = api.get_opt(&cfg.name).await? else {
        return Ok(false);
    };
    let prior = lease.spec.clone().unwrap_or_default();
    if prior.holder_identity.as_deref() != Some(cfg.identity.as_str()) {
        return Ok(false);
    }
    let mut next = lease;
    next.spec = Some(released(&prior, Timestamp::now()));
    // With the resourceVersion read above: a standby that took over meanwhile keeps it.
    match api.replace(&cfg.name, &PostParams::default(), &next).await {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
        Err(e) => Err(e),
    }
}

/// Renews the Lease until it is lost or could not be renewed for `renew_deadline`; then
/// returns (so the process can exit) while the Lease is still valid for the others' view.
pub async fn hold(client: Client, cfg: LeaseConfig) {
    let api: Api<Lease> = Api::namespaced(client, &cfg.namespace);
    let mut last_ok = std::time::Instant::now();
    let mut obs = Observer::default();
    loop {
        tokio::time::sleep(cfg.renew).await;
        // A renewal call that hangs must not carry us past the deadline.
        let left = cfg.renew_deadline.saturating_sub(last_ok.elapsed());
        match tokio::time::timeout(left, try_acquire(&api, &cfg, &mut obs)).await {
            Ok(Ok(true)) => last_ok = std::time::Instant::now(),
            Ok(Ok(false)) => {
                tracing::error!(lease = %cfg.name, "leadership lost");
                return;
            }
            Ok(Err(e)) => tracing::warn!(error = %e, "lease renewal failed"),
            Err(_) => tracing::warn!("lease renewal timed out"),
        }
        if must_step_down(&cfg, last_ok.elapsed()) {
            tracing::error!(
                deadline = ?cfg.renew_deadline,
                "lease not renewed within the renew deadline; stepping down"
            );
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(holder: &str, renewed: i64, dur: i32) -> Lease {
        Lease {
            metadata: Default::default(),
            spec: Some(LeaseSpec {
                holder_identity: Some(holder.into()),
                renew_time: Some(MicroTime(Timestamp::from_second(renewed).unwrap())),
                lease_duration_seconds: Some(dur),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn a_released_lease_is_free_at_once_and_keeps_its_transitions() {
        let mut held = lease("a", 100, 15);
        held.spec.as_mut().unwrap().lease_transitions = Some(3);
        let now = Timestamp::from_second(105).unwrap();
        let mut freed = held.clone();
        freed.spec = Some(released(held.spec.as_ref().unwrap(), now));
        let spec = freed.spec.as_ref().unwrap();
        assert_eq!(spec.holder_identity.as_deref(), Some(""));
        assert_eq!(spec.lease_transitions, Some(3));
        // A standby that saw it held a moment ago takes it without waiting for expiry.
        let mut obs = Observer::default();
        let t0 = std::time::Instant::now();
        assert!(!obs.can_take(&held, "b", t0));
        assert!(obs.can_take(&freed, "b", t0));
    }

    #[test]
    fn the_holder_steps_down_before_the_lease_can_be_taken() {
        let cfg = LeaseConfig::with_duration(
            "l".into(),
            "ns".into(),
            "me".into(),
            Duration::from_secs(15),
        );
        assert_eq!(cfg.renew_deadline, Duration::from_secs(10));
        assert_eq!(cfg.renew, Duration::from_secs(5));
        assert!(cfg.validate().is_ok());
        assert!(!must_step_down(&cfg, Duration::from_secs(9)));
        assert!(must_step_down(&cfg, Duration::from_secs(10)));
        assert!(
            must_step_down(&cfg, cfg.duration - Duration::from_secs(1)),
            "stepping down happens before another replica may take over"
        );
        let bad = LeaseConfig {
            renew_deadline: Duration::from_secs(15),
            ..cfg.clone()
        };
        assert!(bad.validate().is_err());
        let bad = LeaseConfig {
            renew: Duration::from_secs(10),
            ..cfg
        };
        assert!(bad.validate().is_err());
    }

    #[test]
    fn takeover_only_after_the_record_stood_still_for_the_duration_on_our_clock() {
        let t0 = std::time::Instant::now();
        let s = |n: u64| t0 + Duration::from_secs(n);
        let mut obs = Observer::default();
        assert!(obs.can_take(&lease("me", 999, 15), "me", s(0)), "ours");
        assert!(
            Observer::default().can_take(&Lease::default(), "me", s(0)),
            "free"
        );
        // The holder renews every 5 s: never expired, however old its renewTime reads here.
        let mut obs = Observer::default();
        for (i, renewed) in [100, 105, 110, 115].into_iter().enumerate() {
            let at = s(i as u64 * 5);
            assert!(
                !obs.can_take(&lease("other", renewed, 15), "me", at),
                "{renewed}"
            );
        }
        // It stops renewing (the record stays as last seen): takeable once 15 s passed here.
        let last = lease("other", 115, 15);
        assert!(!obs.can_take(&last, "me", s(25)));
        assert!(!obs.can_take(&last, "me", s(30)));
        assert!(obs.can_take(&last, "me", s(31)));
        // A holder whose clock runs ahead (renewTime in our future) expires the same way.
        let mut obs = Observer::default();
        let ahead = lease("other", 4_000_000_000, 15);
        assert!(!obs.can_take(&ahead, "me", s(0)));
        assert!(!obs.can_take(&ahead, "me", s(15)));
        assert!(obs.can_take(&ahead, "me", s(16)));
        // One far behind (renewTime long past on our wall clock) is not taken while it renews.
        let mut obs = Observer::default();
        assert!(!obs.can_take(&lease("other", 1, 15), "me", s(0)));
        assert!(!obs.can_take(&lease("other", 6, 15), "me", s(14)));
        assert!(!obs.can_take(&lease("other", 6, 15), "me", s(28)));
        assert!(obs.can_take(&lease("other", 6, 15), "me", s(30)));
    }
}
