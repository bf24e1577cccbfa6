//! Events (`events.k8s.io/v1`) of the controllers, with repeats folded into a series.
//!
//! kube-runtime's `Recorder` folds repeats by type, action, reason and object only, not by
//! note: a second, different refusal of the same kind (`spec.gpu.count` fixed, then a wrong
//! `spec.storage.mountPath`) patched the first Event's series, and `kubectl describe` kept
//! showing the first note. Here the note is part of what makes a repeat, as in client-go's
//! event correlator: the same note again counts up its series; a new note is a new Event.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Mutex;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::{Event as K8sEvent, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};

/// How long a series stays open: a repeat after that starts a new Event (client-go's and
/// kube-runtime's six minutes).
const SERIES_TTL: SignedDuration = SignedDuration::from_mins(6);

/// The API server refuses an Event whose note is over 1 kB (`events.k8s.io/v1`'s validation
/// counts bytes: 1,024), and the Event is then lost.
pub const EVENT_NOTE_MAX_BYTES: usize = 1024;

/// `note` cut to [`EVENT_NOTE_MAX_BYTES`] on a character boundary, an ellipsis marking the cut
/// (a cut by characters, as before, let notes of multi-byte text past the limit).
pub fn event_note(note: &str) -> String {
    if note.len() <= EVENT_NOTE_MAX_BYTES {
        return note.to_string();
    }
    const MORE: &str = "…";
    let mut end = EVENT_NOTE_MAX_BYTES - MORE.len();
    while !note.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{MORE}", &note[..end])
}

/// What identifies a repeat: the same kind of event on the same object with the same note.
#[derive(Clone, PartialEq, Eq, Hash)]
struct Key {
    warning: bool,
    reason: String,
    action: String,
    object: (
        Option<String>,
        Option<String>,
        Option<String>,
        Option<String>,
    ),
    note: u64,
}

/// Publishes the controllers' Events as `controller` / `instance`.
pub struct Publisher {
    client: Client,
    controller: String,
    instance: String,
    series: Mutex<HashMap<Key, K8sEvent>>,
}

impl Publisher {
    /// A publisher reporting as `controller` (`reportingController`) and `instance`.
    pub fn new(client: Client, controller: &str, instance: &str) -> Self {
        Self {
            client,
            controller: controller.into(),
            instance: instance.into(),
            series: Mutex::default(),
        }
    }

    /// The Event to write for `note` about `on`, and whether it continues a series (patched)
    /// or is new (created). Forgets series past [`SERIES_TTL`].
    fn next(
        &self,
        on: &ObjectReference,
        warning: bool,
        reason: &str,
        action: &str,
        note: &str,
        now: Timestamp,
    ) -> (K8sEvent, bool) {
        let note = event_note(note);
        let mut h = std::collections::hash_map::DefaultHasher::new();
        note.hash(&mut h);
        let key = Key {
            warning,
            reason: reason.into(),
            action: action.into(),
            object: (
                on.namespace.clone(),
                on.kind.clone(),
                on.name.clone(),
                on.uid.clone(),
            ),
            note: h.finish(),
        };
        let mut series = self
            .series
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        series.retain(|_, e| {
            let last = e
                .series
                .as_ref()
                .map(|s| s.last_observed_time.0)
                .or(e.event_time.as_ref().map(|t| t.0))
                .unwrap_or(now);
            last + SERIES_TTL > now
        });
        let (event, repeat) = match series.get(&key) {
            Some(e) => {
                let mut e = e.clone();
                let count = e.series.as_ref().map_or(2, |s| s.count + 1);
                e.series = Some(EventSeries {
                    count,
                    last_observed_time: MicroTime(now),
                });
                (e, true)
            }
            None => (
                K8sEvent {
                    metadata: ObjectMeta {
                        namespace: on.namespace.clone(),
                        name: Some(format!(
                            "{}.{:x}",
                            on.name.as_deref().unwrap_or(&self.controller),
                            now.as_nanosecond()
                        )),
                        ..Default::default()
                    },
                    event_time: Some(MicroTime(now)),
                    action: Some(action.into()),
                    reason: Some(reason.into()),
                    note: Some(note),
                    regarding: Some(on.clone()),
                    reporting_controller: Some(self.controller.clone()),
                    reporting_instance: Some(self.instance.clone()),
                    type_: Some(if warning { "Warning" } else { "Normal" }.into()),
                    ..Default::default()
                },
                false,
            ),
        };
        series.insert(key, event.clone());
        (event, repeat)
    }

    /// Publishes an Event about `on`; a repeat (same reason, action and note within
    /// [`SERIES_TTL`]) counts up the first one's series instead of writing another.
    pub async fn publish(
        &self,
        on: &ObjectReference,
        warning: bool,
        reason: &str,
        action: &str,
        note: &str,
    ) -> kube::Result<()> {
        let (event, repeat) = self.next(on, warning, reason, action, note, Timestamp::now());
        let ns = on.namespace.clone().unwrap_or_else(|| "default".into());
        let events: Api<K8sEvent> = Api::namespaced(self.client.clone(), &ns);
        let name = event.metadata.name.clone().unwrap_or_default();
        if repeat {
            events
                .patch(&name, &PatchParams::default(), &Patch::Merge(&event))
                .await?;
        } else {
            events.create(&PostParams::default(), &event).await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn publisher() -> Publisher {
        let svc = tower::service_fn(|_req: http::Request<kube::client::Body>| async {
            Err::<http::Response<kube::client::Body>, std::io::Error>(std::io::Error::other(
                "no API server in this test",
            ))
        });
        Publisher::new(Client::new(svc, "default"), "mole-operator", "test")
    }

    #[test]
    fn event_notes_fit_the_servers_byte_limit_on_a_character_boundary() {
        assert_eq!(event_note("short"), "short");
        let exact = "a".repeat(EVENT_NOTE_MAX_BYTES);
        assert_eq!(event_note(&exact), exact);
        for text in [
            "é".repeat(900),
            "a".repeat(5000),
            format!("a{}", "日本".repeat(400)),
        ] {
            let n = event_note(&text);
            assert!(n.len() <= EVENT_NOTE_MAX_BYTES, "{} bytes", n.len());
            assert!(n.ends_with('…'));
            assert!(text.starts_with(n.trim_end_matches('…')));
        }
    }

    #[tokio::test]
    async fn a_repeat_counts_up_and_a_new_note_is_a_new_event() {
        let p = publisher();
        let on = ObjectReference {
            namespace: Some("ml".into()),
            kind: Some("InferencePool".into()),
            name: Some("p".into()),
            ..Default::default()
        };
        // The same refusal of `on`, but for its note and time.
        let refusal = |note, now| p.next(&on, true, "InvalidSpec", "Validate", note, now);
        let t0 = Timestamp::from_second(1_000).unwrap();
        let (first, repeat) = refusal("spec.gpu.count: x", t0);
        assert!(!repeat);
        let (again, repeat) = refusal("spec.gpu.count: x", t0);
        assert!(repeat);
        assert_eq!(again.metadata.name, first.metadata.name);
        assert_eq!(again.series.as_ref().unwrap().count, 2);
        let later = Timestamp::from_second(1_001).unwrap();
        let (other, repeat) = refusal("spec.storage.mountPath: y", later);
        assert!(!repeat, "a different refusal is a new Event");
        assert_eq!(other.note.as_deref(), Some("spec.storage.mountPath: y"));
        assert_ne!(other.metadata.name, first.metadata.name);
        // Past the series' lifetime the same note starts a new Event.
        let much_later = Timestamp::from_second(1_000 + 7 * 60).unwrap();
        let (fresh, repeat) = refusal("spec.gpu.count: x", much_later);
        assert!(!repeat);
        assert!(fresh.series.is_none());
    }
}
