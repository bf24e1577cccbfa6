//! What worker pods show of why they cannot become ready, read the same way for a pool's
//! dynamic pods and an adapter's merged pods, and what a running tool logs of its progress.

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use mole_crds::constants::reason;

/// Waiting reasons of a container that will not go away by waiting.
const STUCK: [&str; 6] = [
    "CrashLoopBackOff",
    "ImagePullBackOff",
    "ErrImagePull",
    "InvalidImageName",
    "CreateContainerConfigError",
    "CreateContainerError",
];

/// Stable error codes the worker exits with at start (the line of its termination message that
/// begins `<code>:`), and the condition reason each becomes. Any other crash is `PodsFailing`.
const WORKER_START_CODES: [(&str, &str); 6] = [
    ("model_does_not_fit", reason::MODEL_DOES_NOT_FIT),
    ("unsupported_quantization", reason::UNSUPPORTED_QUANTIZATION),
    ("config_io", reason::WORKER_CONFIG_REFUSED),
    ("config_parse", reason::WORKER_CONFIG_REFUSED),
    ("config_invalid", reason::WORKER_CONFIG_REFUSED),
    ("path_outside_root", reason::WORKER_CONFIG_REFUSED),
];

/// A pod that cannot become ready by itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodProblem {
    /// The condition and Event reason: `PodsFailing`, or a worker start-up refusal
    /// (`ModelDoesNotFit`, `UnsupportedQuantization`, `WorkerConfigRefused`).
    pub reason: &'static str,
    /// The pod's name and why (`<pod>: <container> CrashLoopBackOff: <the worker's line>`).
    pub message: String,
}

/// Whether a `Ready` reason says a pod fails (a Warning Event) rather than that it starts.
pub fn is_failure(ready_reason: &str) -> bool {
    ready_reason == reason::PODS_FAILING
        || WORKER_START_CODES.iter().any(|(_, r)| *r == ready_reason)
}

/// The worker's refusal in a termination message: the line that begins with a known start-up
/// code (after an `error: ` prefix, as the worker prints a fatal error) and its reason.
fn worker_refusal(message: &str) -> Option<(&'static str, &str)> {
    message.lines().rev().find_map(|l| {
        let l = l.trim();
        let bare = ["error: ", "Error: "]
            .iter()
            .find_map(|p| l.strip_prefix(p))
            .unwrap_or(l);
        let (code, _) = bare.split_once(':')?;
        let why = WORKER_START_CODES
            .iter()
            .find(|(c, _)| *c == code.trim())?
            .1;
        Some((why, l))
    })
}

/// The first pod of `pods` that cannot become ready by itself, and why: unschedulable (the
/// scheduler's message), or a container stuck waiting (`CrashLoopBackOff` with its last
/// termination message, which holds the worker's own refusal of the model, image pulls...).
pub fn pod_problem(pods: &[Pod]) -> Option<PodProblem> {
    pods.iter().find_map(|p| {
        let name = p.metadata.name.as_deref().unwrap_or("?");
        let st = p.status.as_ref()?;
        let unschedulable = st.conditions.iter().flatten().find(|c| {
            c.type_ == "PodScheduled"
                && c.status == "False"
                && c.reason.as_deref() == Some("Unschedulable")
        });
        if let Some(c) = unschedulable {
            return Some(PodProblem {
                reason: reason::PODS_FAILING,
                message: format!(
                    "{name}: Unschedulable: {}",
                    c.message.as_deref().unwrap_or("no node fits")
                ),
            });
        }
        let containers = st
            .init_container_statuses
            .iter()
            .flatten()
            .chain(st.container_statuses.iter().flatten());
        containers.into_iter().find_map(|c| {
            let w = c.state.as_ref()?.waiting.as_ref()?;
            let why = w.reason.as_deref().filter(|r| STUCK.contains(r))?;
            let said = c
                .last_state
                .as_ref()
                .and_then(|s| s.terminated.as_ref())
                .and_then(|t| t.message.as_deref())
                .or(w.message.as_deref())
                .unwrap_or("");
            // The worker's own refusal, wherever it is among the last log lines; else the
            // last line.
            let (reason, line) = worker_refusal(said).unwrap_or((
                reason::PODS_FAILING,
                said.trim().lines().last().unwrap_or(""),
            ));
            let message = match line.trim() {
                "" => format!("{name}: {} {why}", c.name),
                m => format!("{name}: {} {why}: {m}", c.name),
            };
            Some(PodProblem { reason, message })
        })
    })
}

/// The progress of the tool running in `container` of `pod` (None: the pod's only one), from
/// its last 20 log lines (the tools log a JSON `progress` line every few seconds), as one
/// phrase for a condition message. Best effort: a log that cannot be read gives None and never
/// fails a reconcile.
pub async fn log_progress(pods: &Api<Pod>, pod: &str, container: Option<&str>) -> Option<String> {
    let params = kube::api::LogParams {
        tail_lines: Some(20),
        container: container.map(String::from),
        ..Default::default()
    };
    let tail = pods.logs(pod, &params).await.ok()?;
    crate::mergedown::progress_of(&tail)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stuck(status: serde_json::Value) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "vl-dynamic-1"}, "status": status
        }))
        .unwrap()
    }

    fn crashed(message: &str) -> Pod {
        stuck(
            serde_json::json!({"containerStatuses": [{"name": "worker", "image": "i",
            "imageID": "", "ready": false, "restartCount": 3,
            "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}},
            "lastState": {"terminated": {"exitCode": 1, "message": message}}}]}),
        )
    }

    fn failing(message: &str) -> PodProblem {
        PodProblem {
            reason: reason::PODS_FAILING,
            message: message.into(),
        }
    }

    #[test]
    fn pods_that_cannot_become_ready_are_named_with_why() {
        let unschedulable = stuck(serde_json::json!({"conditions": [{"type": "PodScheduled",
            "status": "False", "reason": "Unschedulable",
            "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."}]}));
        assert_eq!(
            pod_problem(&[unschedulable]).unwrap(),
            failing("vl-dynamic-1: Unschedulable: 0/4 nodes are available: 4 Insufficient nvidia.com/gpu.")
        );
        let crash =
            crashed("loading\nerror: model refused (unsupported_architecture): model_type mamba");
        assert_eq!(
            pod_problem(&[crash]).unwrap(),
            failing("vl-dynamic-1: worker CrashLoopBackOff: error: model refused (unsupported_architecture): model_type mamba")
        );
        let pull = stuck(
            serde_json::json!({"containerStatuses": [{"name": "worker", "image": "i",
            "imageID": "", "ready": false, "restartCount": 0,
            "state": {"waiting": {"reason": "ImagePullBackOff", "message": "pull access denied"}}}]}),
        );
        assert_eq!(
            pod_problem(&[pull]).unwrap(),
            failing("vl-dynamic-1: worker ImagePullBackOff: pull access denied")
        );
        // Starting up is not a problem.
        let starting = stuck(
            serde_json::json!({"containerStatuses": [{"name": "worker", "image": "i",
            "imageID": "", "ready": false, "restartCount": 0,
            "state": {"waiting": {"reason": "ContainerCreating"}}}]}),
        );
        assert_eq!(pod_problem(&[starting]), None);
    }

    #[test]
    fn known_worker_start_up_codes_get_their_own_reason() {
        let cases = [
            (
                "loading base/qwen3-vl-8b\nmodel_does_not_fit: the weights need 17.9 GiB, the device budget is 14.2 GiB\n",
                reason::MODEL_DOES_NOT_FIT,
                "model_does_not_fit: the weights need 17.9 GiB, the device budget is 14.2 GiB",
            ),
            // The line is found among the last log lines, whatever follows it.
            (
                "error: model_does_not_fit: 17.9 GiB > 14.2 GiB\nshutting down",
                reason::MODEL_DOES_NOT_FIT,
                "error: model_does_not_fit: 17.9 GiB > 14.2 GiB",
            ),
            (
                "config_parse: /etc/mole/worker.json: expected value at line 1",
                reason::WORKER_CONFIG_REFUSED,
                "config_parse: /etc/mole/worker.json: expected value at line 1",
            ),
            (
                "error: path_outside_root: path base/x is not inside model root /models: not found",
                reason::WORKER_CONFIG_REFUSED,
                "error: path_outside_root: path base/x is not inside model root /models: not found",
            ),
            // The worker's line for a checkpoint it cannot serve (as `startup_line` writes it).
            (
                "loading base/qwq-32b-awq\nerror: unsupported_quantization: unsupported quantized checkpoint: GPTQ with act-order (desc_act true)\n",
                reason::UNSUPPORTED_QUANTIZATION,
                "error: unsupported_quantization: unsupported quantized checkpoint: GPTQ with act-order (desc_act true)",
            ),
            // An unknown code, or a code further inside a line, is a generic failure.
            (
                "error: something_else: boom",
                reason::PODS_FAILING,
                "error: something_else: boom",
            ),
            (
                "error: cannot load: model_does_not_fit: x",
                reason::PODS_FAILING,
                "error: cannot load: model_does_not_fit: x",
            ),
        ];
        for (said, why, line) in cases {
            let p = pod_problem(&[crashed(said)]).unwrap();
            assert_eq!(
                p,
                PodProblem {
                    reason: why,
                    message: format!("vl-dynamic-1: worker CrashLoopBackOff: {line}")
                },
                "{said}"
            );
            assert!(is_failure(p.reason));
        }
        assert!(!is_failure(reason::PODS_NOT_READY));
    }
}
