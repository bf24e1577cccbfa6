//! Applying the config file: the adapters configured at start, and reloads (the watcher and
//! `POST /admin/reload`) that swap adapters, router and auth settings in place.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};

use axum::http::StatusCode;
use mole_api::WorkerConfig;

use super::engines::build_local_merged;
use super::{ApiError, AppState};
use crate::config::ApplyReport;

/// What `POST /admin/reload` (and the watcher) did.
#[derive(Debug, Clone, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReloadOutcome {
    /// Whether adapters, router or auth settings changed.
    pub changed: bool,
    /// `content_hash()` of the file that was applied.
    pub config_hash: String,
    /// Adapters that could not be loaded (reported, the rest applied).
    pub errors: Vec<String>,
    /// Settings that changed in the file but need a restart; kept at their old values.
    pub restart_required: Vec<&'static str>,
}

impl AppState {
    /// Records what an adapter load did: the load durations, and the refused versions
    /// `/v1/lora_adapters` lists (forgotten once no longer configured).
    fn record_apply(&self, cfg: &WorkerConfig, report: &ApplyReport) {
        let m = &self.metrics.adapter_load_duration;
        for (_, secs) in &report.loaded {
            m.with_label_values(&["ok"]).observe(*secs);
        }
        let mut refused = self.refused.write().unwrap_or_else(PoisonError::into_inner);
        for (n, _) in &report.loaded {
            refused.remove(n);
        }
        for f in &report.failed {
            m.with_label_values(&["failed"]).observe(0.0);
            tracing::warn!(adapter = %f.name, version = %f.version, "adapter not loaded: {}", f.reason);
            refused.insert(f.name.clone(), f.clone());
        }
        let units = crate::config::units(&cfg.adapters);
        refused.retain(|n, f| {
            units
                .iter()
                .any(|a| &a.name == n && a.version == f.version && a.load)
        });
    }

    /// Loads the configured adapters (and, in local mode, merges the merged ones), then
    /// marks the worker started. Blocking: run it off the async runtime.
    pub fn load_configured(&self) {
        let _g = self
            .reload_lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let cfg = self.cfg();
        let diff = crate::config::diff_adapters(&[], &cfg.adapters);
        let report = crate::config::apply_diff(self.admin.as_ref(), &cfg, &diff);
        self.record_apply(&cfg, &report);
        let (merged, errors) = build_local_merged(&cfg);
        for err in &errors {
            tracing::warn!("served dynamically instead: {err}");
        }
        *self
            .local_merged
            .write()
            .unwrap_or_else(PoisonError::into_inner) = merged;
        self.started.store(true, Ordering::SeqCst);
        tracing::info!(
            loaded = report.loaded.len(),
            refused = report.failed.len(),
            "configured adapters tried; ready"
        );
    }

    /// Answers 409 `config_stale` when the config file's [`WorkerConfig::content_hash`] is not
    /// `want`, without taking the reload lock. Blocking (reads the file).
    pub fn check_config_hash(&self, want: &str) -> Result<(), ApiError> {
        let Some(path) = &self.config_path else {
            return Ok(());
        };
        let file = crate::config::read(path).map_err(|e| {
            ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, e.code(), e.to_string())
        })?;
        let hash = file.content_hash();
        if hash == want {
            Ok(())
        } else {
            self.metrics
                .config_reloads
                .with_label_values(&["stale"])
                .inc();
            Err(stale(path, &hash, want))
        }
    }

    /// Re-reads the config file and applies it: adapters loaded before removed ones are
    /// unloaded, router and auth settings swapped; settings that need a restart are kept and
    /// reported. With `expect_hash`, a file whose parsed config has another
    /// [`WorkerConfig::content_hash`] is refused with 409 `config_stale` and nothing changes.
    /// Blocking: run it off the async runtime.
    pub fn reload(&self, expect_hash: Option<&str>) -> Result<ReloadOutcome, ApiError> {
        let _g = self
            .reload_lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let count = |r: &str| self.metrics.config_reloads.with_label_values(&[r]).inc();
        let Some(path) = &self.config_path else {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "no_config_file",
                "this worker was not started from a config file",
            ));
        };
        let invalid = |e: crate::config::ConfigError| {
            count("invalid");
            ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, e.code(), e.to_string())
        };
        let file = crate::config::read(path).map_err(invalid)?;
        let hash = file.content_hash();
        if let Some(want) = expect_hash.filter(|h| *h != hash) {
            count("stale");
            return Err(stale(path, &hash, want));
        }
        let old = self.cfg();
        let restart = crate::config::restart_required(&old, &file);
        let new = crate::config::hot_applicable(&old, &file);
        crate::config::validate(&new).map_err(invalid)?;
        self.metrics
            .restart_required
            .set(i64::from(!restart.is_empty()));
        if !restart.is_empty() {
            tracing::warn!(
                settings = ?restart,
                "config changed settings that need a restart; serving with the old ones until then"
            );
        }
        *self
            .restart_required
            .write()
            .unwrap_or_else(PoisonError::into_inner) = restart.clone();
        if *old == new {
            count("unchanged");
            return Ok(ReloadOutcome {
                changed: false,
                config_hash: hash,
                errors: vec![],
                restart_required: restart,
            });
        }
        let errors = self.apply(&old, new);
        count("changed");
        tracing::info!(hash = %hash, ?errors, "config reloaded");
        Ok(ReloadOutcome {
            changed: true,
            config_hash: hash,
            errors,
            restart_required: restart,
        })
    }

    /// Swaps `new` in for `old`: adapters loaded and unloaded (listed as pending meanwhile),
    /// secrets re-read when the auth settings moved, the config replaced. Returns what could
    /// not be loaded.
    fn apply(&self, old: &WorkerConfig, new: WorkerConfig) -> Vec<String> {
        let diff = crate::config::diff_adapters(&old.adapters, &new.adapters);
        *self.pending.lock().unwrap_or_else(PoisonError::into_inner) = diff
            .load
            .iter()
            .map(|a| (a.name.clone(), a.version.clone()))
            .collect();
        let _clear = ClearPending(&self.pending);
        let report = crate::config::apply_diff(self.admin.as_ref(), &new, &diff);
        self.record_apply(&new, &report);
        if new.auth != old.auth {
            self.auth.reconfigure(&new);
        }
        *self.config.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(new);
        report.errors()
    }
}

/// Empties the pending list when dropped, whatever happens while the adapters load: a
/// panicking load must not leave the pod unready.
struct ClearPending<'a>(&'a Mutex<Vec<(String, String)>>);

impl Drop for ClearPending<'_> {
    fn drop(&mut self) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }
}

/// 409 `config_stale`: the file on disk is not the one the caller expects.
fn stale(path: &std::path::Path, hash: &str, want: &str) -> ApiError {
    ApiError::new(
        StatusCode::CONFLICT,
        "config_stale",
        format!(
            "config file {} has hash {hash}, expected {want}: the kubelet has not refreshed the mounted ConfigMap yet (it can take a minute); retry later",
            path.display()
        ),
    )
}
