//! How fast a pool's pods serve, as `mole-bench decode --service-model FILE` measures it
//! and `mole-operator simulate --service-model FILE` (and the fleet policy's capacity check)
//! read it: merged and dynamic decode rates by batch and distinct adapters, adapter load times.
//! The measured fields come from one bench run side by side; the rest are a pool's settings and
//! stated assumptions.

use serde::{Deserialize, Serialize};

/// A pool's service rates (JSON, camelCase).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ServiceModel {
    /// Where the figures come from (machine, model, commit, command).
    #[serde(default)]
    pub source: String,
    /// Merged tokens/s of one pod, batch 1.
    pub merged_b1: f64,
    /// Merged tokens/s of one pod (all rows together), batch 16.
    pub merged_b16: f64,
    /// One dynamic adapter ÷ merged, batch 1.
    pub dynamic_ratio_b1: f64,
    /// One dynamic adapter ÷ merged, batch 16.
    pub dynamic_ratio_b16: f64,
    /// 16 distinct adapters ÷ one adapter, batch 16.
    pub distinct16_ratio: f64,
    /// Requests decoded together at most (the worker's `maxBatchSize`).
    #[serde(default = "default_batch")]
    pub batch: usize,
    /// Adapters in device slots per dynamic pod (`maxLoras`).
    #[serde(default = "default_max_loras")]
    pub max_loras: usize,
    /// Adapters in host memory per dynamic pod (`maxCpuLoras`).
    #[serde(default = "default_max_cpu_loras")]
    pub max_cpu_loras: usize,
    /// Seconds to move an adapter from host memory to a device slot.
    #[serde(default = "default_host_load")]
    pub host_load_s: f64,
    /// Seconds to load an adapter from disk.
    #[serde(default = "default_disk_load")]
    pub disk_load_s: f64,
    /// Seconds from a pod's creation to its readiness (weights loaded).
    #[serde(default = "default_pod_start")]
    pub pod_start_s: f64,
    /// Seconds a merge Job takes (on CPUs; no GPU is taken meanwhile).
    #[serde(default = "default_merge_job")]
    pub merge_job_s: f64,
}

fn default_batch() -> usize {
    16
}
fn default_max_loras() -> usize {
    8
}
fn default_max_cpu_loras() -> usize {
    32
}
fn default_host_load() -> f64 {
    0.005
}
fn default_disk_load() -> f64 {
    0.1
}
fn default_pod_start() -> f64 {
    90.0
}
fn default_merge_job() -> f64 {
    120.0
}

/// A service model that cannot be used, and why.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("service model: {0}")]
pub struct ServiceModelError(pub String);

fn lerp_batch(b1: f64, b16: f64, b: usize) -> f64 {
    let x = (b.clamp(1, 16) - 1) as f64 / 15.0;
    b1 + (b16 - b1) * x
}

impl ServiceModel {
    /// Checks that every rate is positive and every ratio in (0, 1.5] (a dynamic adapter a
    /// little faster than merged is measurement noise, not a model).
    pub fn validate(&self) -> Result<(), ServiceModelError> {
        let positive = [
            ("mergedB1", self.merged_b1),
            ("mergedB16", self.merged_b16),
            ("hostLoadS", self.host_load_s + 1e-12),
            ("diskLoadS", self.disk_load_s + 1e-12),
        ];
        for (name, v) in positive {
            if !(v.is_finite() && v > 0.0) {
                return Err(ServiceModelError(format!(
                    "{name} must be positive, is {v}"
                )));
            }
        }
        for (name, v) in [
            ("dynamicRatioB1", self.dynamic_ratio_b1),
            ("dynamicRatioB16", self.dynamic_ratio_b16),
            ("distinct16Ratio", self.distinct16_ratio),
        ] {
            if !(v.is_finite() && v > 0.0 && v <= 1.5) {
                return Err(ServiceModelError(format!(
                    "{name} must be in (0, 1.5], is {v}"
                )));
            }
        }
        if self.batch == 0 || self.max_loras == 0 {
            return Err(ServiceModelError(
                "batch and maxLoras must be at least 1".into(),
            ));
        }
        Ok(())
    }

    /// Tokens/s of a merged pod decoding `b` requests (linear between the measured batches).
    pub fn merged_rate(&self, b: usize) -> f64 {
        lerp_batch(self.merged_b1, self.merged_b16, b)
    }

    /// One dynamic adapter ÷ merged at batch `b`.
    pub fn dynamic_ratio(&self, b: usize) -> f64 {
        lerp_batch(self.dynamic_ratio_b1, self.dynamic_ratio_b16, b)
    }

    /// Tokens/s of a dynamic pod decoding `b` requests of `k` distinct adapters. Over distinct
    /// adapters it follows a launch model: a fixed cost per step plus one per distinct adapter,
    /// `(a + 1) / (a + k)` of one adapter, `a` fitted to the 16-distinct figure.
    pub fn dynamic_rate(&self, b: usize, k: usize) -> f64 {
        let r = self.distinct16_ratio.clamp(1e-3, 1.0);
        let a = ((16.0 * r - 1.0) / (1.0 - r).max(1e-9)).max(0.0);
        let k = k.max(1) as f64;
        self.merged_rate(b) * self.dynamic_ratio(b) * ((a + 1.0) / (a + k))
    }

    /// The same model with one dynamic adapter at `ratio` of merged at every batch (the
    /// crossover study's knob).
    #[must_use]
    pub fn with_dynamic_ratio(&self, ratio: f64) -> Self {
        Self {
            dynamic_ratio_b1: ratio,
            dynamic_ratio_b16: ratio,
            ..self.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h200() -> ServiceModel {
        serde_json::from_str(
            r#"{"mergedB1": 104.1, "mergedB16": 1404.2, "dynamicRatioB1": 0.39,
                "dynamicRatioB16": 0.47, "distinct16Ratio": 0.99}"#,
        )
        .unwrap()
    }

    #[test]
    fn rates_interpolate_between_the_measured_batches() {
        let m = h200();
        assert_eq!(m.batch, 16);
        assert!((m.merged_rate(1) - 104.1).abs() < 1e-9);
        assert!((m.merged_rate(16) - 1404.2).abs() < 1e-9);
        assert!((m.dynamic_rate(16, 1) - 1404.2 * 0.47).abs() < 1e-6);
        // 16 distinct adapters: the measured ratio of one.
        let sixteen = m.dynamic_rate(16, 16) / m.dynamic_rate(16, 1);
        assert!((sixteen - 0.99).abs() < 1e-9, "{sixteen}");
        assert!(m.validate().is_ok());
        let r = m.with_dynamic_ratio(0.8);
        assert!((r.dynamic_rate(1, 1) / r.merged_rate(1) - 0.8).abs() < 1e-12);
    }

    #[test]
    fn bad_models_are_refused_naming_the_field() {
        let mut m = h200();
        m.dynamic_ratio_b16 = 0.0;
        assert!(m.validate().unwrap_err().0.contains("dynamicRatioB16"));
        let mut m = h200();
        m.merged_b1 = f64::NAN;
        assert!(m.validate().unwrap_err().0.contains("mergedB1"));
        assert!(serde_json::from_str::<ServiceModel>(r#"{"mergedB1": 1}"#).is_err());
        assert!(serde_json::from_str::<ServiceModel>(
            r#"{"mergedB1": 1, "mergedB16": 2, "dynamicRatioB1": 1, "dynamicRatioB16": 1,
                "distinct16Ratio": 1, "typo": 3}"#
        )
        .is_err());
    }
}
