//! Which `mole-worker` image a pool's pods and Jobs run: the pool's `spec.image` when set,
//! otherwise the operator's default for the pool's hardware. One GPU image cannot serve CPU
//! pools well (it is several GiB of CUDA libraries that a CPU node pulls for nothing) and a CPU
//! image on a GPU node silently runs the model on the CPU, so there are two defaults.

use mole_crds::InferencePoolSpec;

/// The repository of the worker images (`docker/worker-cuda.Dockerfile`,
/// `docker/worker-cpu.Dockerfile`, pushed by `.github/workflows/images.yml`).
pub const WORKER_REPOSITORY: &str = "ghcr.io/mole-dev/mole-worker";

/// Default worker image of pools that request GPUs: built with `--features cuda`, tagged
/// `<version>-cuda` at this crate's version (the chart's `appVersion`).
pub const DEFAULT_WORKER_IMAGE_GPU: &str = concat!(
    "ghcr.io/mole-dev/mole-worker:",
    env!("CARGO_PKG_VERSION"),
    "-cuda"
);

/// Default worker image of pools without GPUs (`gpu.count: 0`) and of merge and cleanup Jobs:
/// the CPU build, tagged `<version>-cpu`.
pub const DEFAULT_WORKER_IMAGE_CPU: &str = concat!(
    "ghcr.io/mole-dev/mole-worker:",
    env!("CARGO_PKG_VERSION"),
    "-cpu"
);

/// What the operator's flags set in the worker pods it starts: the default images
/// (`--worker-image-gpu`, `--worker-image-cpu`) and the trace collector
/// (`--worker-otlp-traces-endpoint`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerDefaults {
    /// For pools with `spec.gpu.count` > 0.
    pub gpu: String,
    /// For pools with `spec.gpu.count` 0, and for merge and cleanup Jobs.
    pub cpu: String,
    /// The OTLP/HTTP collector the serving pods export their traces to (their
    /// `MOLE_OTLP_TRACES_ENDPOINT`); None: no export.
    pub otlp_traces_endpoint: Option<String>,
}

impl Default for WorkerDefaults {
    fn default() -> Self {
        Self {
            gpu: DEFAULT_WORKER_IMAGE_GPU.into(),
            cpu: DEFAULT_WORKER_IMAGE_CPU.into(),
            otlp_traces_endpoint: None,
        }
    }
}

impl WorkerDefaults {
    /// The image of the pool's serving pods (dynamic and merged): `spec.image`, or the GPU
    /// default when the pool requests GPUs and the CPU default otherwise.
    pub fn serving(&self, spec: &InferencePoolSpec) -> String {
        match &spec.image {
            Some(image) => image.clone(),
            None if spec.gpu.count > 0 => self.gpu.clone(),
            None => self.cpu.clone(),
        }
    }

    /// The image of the pool's merge and cleanup Jobs: `spec.image`, or the CPU default. The
    /// Jobs request no GPU (merging streams shards on the CPU) and are scheduled by
    /// `spec.merge.nodeSelector`, often on CPU nodes, where the CUDA image would be a multi-GiB
    /// pull for nothing; both images carry the same `merge` and `prune` code.
    pub fn jobs(&self, spec: &InferencePoolSpec) -> String {
        spec.image.clone().unwrap_or_else(|| self.cpu.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(image: Option<&str>, gpus: u32) -> InferencePoolSpec {
        let mut s: InferencePoolSpec = serde_yaml::from_str(
            "baseModel: {name: m, path: base/m}\nstorage: {claimName: models}\ngpu: {count: 1}\n",
        )
        .unwrap();
        s.image = image.map(String::from);
        s.gpu.count = gpus;
        s
    }

    #[test]
    fn defaults_carry_the_crate_version_and_the_hardware_suffix() {
        let v = env!("CARGO_PKG_VERSION");
        let d = WorkerDefaults::default();
        assert_eq!(d.gpu, format!("{WORKER_REPOSITORY}:{v}-cuda"));
        assert_eq!(d.cpu, format!("{WORKER_REPOSITORY}:{v}-cpu"));
    }

    #[test]
    fn unset_image_follows_the_gpu_count_and_a_set_one_wins() {
        let i = WorkerDefaults {
            gpu: "reg/w:gpu".into(),
            cpu: "reg/w:cpu".into(),
            ..Default::default()
        };
        assert_eq!(i.serving(&spec(None, 1)), "reg/w:gpu");
        assert_eq!(i.serving(&spec(None, 8)), "reg/w:gpu");
        assert_eq!(i.serving(&spec(None, 0)), "reg/w:cpu");
        assert_eq!(i.serving(&spec(Some("mine:1"), 1)), "mine:1");
        assert_eq!(i.serving(&spec(Some("mine:1"), 0)), "mine:1");
        // Jobs need no GPU: the CPU image unless the pool names one image for everything.
        assert_eq!(i.jobs(&spec(None, 1)), "reg/w:cpu");
        assert_eq!(i.jobs(&spec(None, 0)), "reg/w:cpu");
        assert_eq!(i.jobs(&spec(Some("mine:1"), 1)), "mine:1");
    }
}
