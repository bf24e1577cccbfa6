//! `mole-worker serve`: load the config, build the engine, load adapters, serve HTTP, watch
//! the config file, drain on SIGTERM.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::{app, build_engine_with, AppState, Auth};

/// Arguments of `serve`.
#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// WorkerConfig file (YAML or JSON; the operator mounts its ConfigMap here).
    #[arg(long, env = "MOLE_CONFIG")]
    pub config: PathBuf,
    /// Address to listen on.
    #[arg(long, env = "MOLE_LISTEN", default_value = "0.0.0.0:8000")]
    pub listen: String,
    /// Seconds between config file checks (0 disables the watcher).
    #[arg(long, env = "MOLE_CONFIG_POLL_SECONDS", default_value_t = 2)]
    pub config_poll_seconds: u64,
    /// Share of each GPU's memory the worker may use, overriding the config's
    /// `limits.gpuMemoryUtilization` (0.05-1.0).
    #[arg(long, env = "MOLE_GPU_MEMORY_UTILIZATION")]
    pub gpu_memory_utilization: Option<f64>,
    /// Where a startup failure's one line (`code: message`) is also written (Kubernetes
    /// copies it into the Pod's termination message). Default: /dev/termination-log, when it
    /// exists.
    #[arg(long, env = "MOLE_TERMINATION_LOG")]
    pub termination_log: Option<PathBuf>,
    /// Milliseconds between two polls of the peers' `/v1/residency` (their adapters in memory
    /// and queues), by which a request for an adapter this pod does not hold is forwarded; 0
    /// turns polling off (peers are then tried in placement order).
    #[arg(long, env = "MOLE_PEER_POLL_MS", default_value_t = 1000)]
    pub peer_poll_ms: u64,
    /// How a GPU computes LoRA updates: `ops` (grouped tensor ops, the default) or `bgmv`
    /// (the worker's own CUDA kernels for decode steps; unproven on a device, see
    /// docs/benchmarks.md). The CPU's host path ignores it.
    #[arg(long, env = "MOLE_LORA_KERNEL", default_value = "ops")]
    pub lora_kernel: mole_model::LoraKernel,
    /// Prompt tokens one step takes across new sequences (chunked prefill, as vLLM's
    /// `--max-num-batched-tokens`): larger finishes a long prompt in fewer steps, smaller
    /// keeps the running sequences' next tokens coming sooner.
    #[arg(long, env = "MOLE_PREFILL_CHUNK",
          default_value_t = mole_engine::DEFAULT_PREFILL_CHUNK as u32,
          value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub prefill_chunk: u32,
}

/// Runs the subcommand.
pub fn run(args: ServeArgs) -> std::process::ExitCode {
    let rt = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start runtime: {e}");
            return std::process::ExitCode::from(1);
        }
    };
    let termination_log = args.termination_log.clone();
    match rt.block_on(serve(args)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            let line = startup_line(&e);
            eprintln!("error: {line}");
            mole_telemetry::write_termination_log(termination_log.as_deref(), &line);
            std::process::ExitCode::from(1)
        }
    }
}

/// The one line a failed start leaves for the pool's condition: `code: message` when the
/// failure has a stable code (the operator maps `model_does_not_fit` and the `config_*` codes
/// to their own Ready reasons), the whole chain otherwise.
fn startup_line(e: &anyhow::Error) -> String {
    if let Some(b) = e.downcast_ref::<super::BuildError>() {
        return format!("{}: {b}", b.code());
    }
    if let Some(c) = e.downcast_ref::<crate::config::ConfigError>() {
        return format!("{}: {c}", c.code());
    }
    format!("{e:#}")
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let mut cfg = crate::config::load(&args.config)?;
    if let Some(f) = args.gpu_memory_utilization {
        mole_api::bounds::GPU_MEMORY_UTILIZATION
            .check("gpuMemoryUtilization", f)
            .map_err(|e| anyhow::anyhow!("--gpu-memory-utilization: {e}"))?;
        cfg.limits.engine.gpu_memory_utilization = f;
    }
    let auth = Auth::from_config(&cfg)?;
    let tuning = super::EngineTuning {
        lora_kernel: args.lora_kernel,
        prefill_chunk: args.prefill_chunk as usize,
    };
    let engine = build_engine_with(&cfg, tuning)?;
    let state = AppState::new(cfg.clone(), engine, Some(args.config.clone()), auth);
    state
        .peers
        .set_interval(Duration::from_millis(args.peer_poll_ms));
    if let Some(rel) = &cfg.router.embedding_model {
        let dir = crate::config::resolve_in_root(&cfg.model_root, rel)?;
        let e =
            tokio::task::spawn_blocking(move || crate::router::embed::SentenceEmbedder::load(&dir))
                .await??;
        let _ = state.embedder.set(Arc::new(e));
        tracing::info!(model = %rel, "embedding router ready");
    }
    let listener = tokio::net::TcpListener::bind(&args.listen).await?;
    tracing::info!(listen = %args.listen, "serving");
    serve_with(
        state,
        listener,
        args.config,
        Duration::from_secs(args.config_poll_seconds),
        shutdown_signal(),
    )
    .await
}

/// Serves until `shutdown` resolves: the HTTP server starts at once (`/healthz` answers,
/// `/readyz` and requests are 503 `not_ready`) while the configured adapters load; then the
/// config watcher starts. On shutdown: not ready, no new connections, in-flight requests
/// finish (graceful drain).
pub async fn serve_with(
    state: Arc<AppState>,
    listener: tokio::net::TcpListener,
    config_path: PathBuf,
    poll: Duration,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    // The file as it was when the config was read: a change during the loads is seen.
    let first = crate::config::file_hash(&config_path);
    let st = state.clone();
    let background = tokio::spawn(async move {
        let s = st.clone();
        if let Err(e) = tokio::task::spawn_blocking(move || s.load_configured()).await {
            tracing::error!("loading the configured adapters failed: {e}");
            return;
        }
        if !poll.is_zero() {
            watch(config_path, st, poll, first).await;
        }
    });
    // Peers are polled from the start, beside the configured adapters' loads.
    let polling = tokio::spawn(super::residency::poll_loop(state.clone()));
    let st = state.clone();
    let r = axum::serve(listener, app(state))
        .with_graceful_shutdown(async move {
            shutdown.await;
            st.start_draining();
            tracing::info!("draining");
        })
        .await;
    background.abort();
    polling.abort();
    r?;
    Ok(())
}

/// Polls the config file every `every` and reloads on content change.
async fn watch(path: PathBuf, state: Arc<AppState>, every: Duration, first: Option<Vec<u8>>) {
    let mut last = first;
    let mut tick = tokio::time::interval(every);
    loop {
        tick.tick().await;
        let h = crate::config::file_hash(&path);
        if h.is_none() || h == last {
            continue;
        }
        last = h;
        let s = state.clone();
        match tokio::task::spawn_blocking(move || s.reload(None)).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => tracing::warn!(code = e.code(), "config reload refused: {e}"),
            Err(e) => tracing::warn!("config reload task failed: {e}"),
        }
    }
}

async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {},
        _ = term => {},
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_start_names_its_code_first() {
        let missing = std::path::Path::new("/nonexistent/mole/worker.yaml");
        let e = anyhow::Error::from(crate::config::load(missing).unwrap_err());
        assert!(
            startup_line(&e).starts_with("config_io: "),
            "{}",
            startup_line(&e)
        );
        let build = super::super::BuildError::Config(crate::config::ConfigError::Invalid(
            "limits.maxSeqLen: 0".into(),
        ));
        assert_eq!(
            startup_line(&anyhow::Error::from(build)),
            "config_invalid: invalid config: limits.maxSeqLen: 0"
        );
        let plain = anyhow::anyhow!("bind failed").context("listening");
        assert_eq!(startup_line(&plain), "listening: bind failed");
    }
}
