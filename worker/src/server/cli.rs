//! `mole-worker serve`: load the config, build the engine, load adapters, serve HTTP, watch
//! the config file, drain on SIGTERM.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::{app, build_engine, AppState, Auth};

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
    match rt.block_on(serve(args)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::from(1)
        }
    }
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let cfg = crate::config::load(&args.config)?;
    let auth = Auth::from_config(&cfg)?;
    let engine = build_engine(&cfg)?;
    let state = AppState::new(cfg.clone(), engine.clone(), Some(args.config.clone()), auth);
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

/// Loads the configured adapters, starts the watcher and serves until `shutdown` resolves;
/// then stops accepting, reports not ready and waits for in-flight requests (graceful drain).
pub async fn serve_with(
    state: Arc<AppState>,
    listener: tokio::net::TcpListener,
    config_path: PathBuf,
    poll: Duration,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let cfg = state.cfg();
    let diff = crate::config::diff_adapters(&[], &cfg.adapters);
    let (e, c) = (state.engine.clone(), cfg.clone());
    let errors =
        tokio::task::spawn_blocking(move || crate::config::apply_diff(e.as_ref(), &c, &diff))
            .await?;
    for err in &errors {
        tracing::warn!("adapter not loaded: {err}");
    }
    let c = cfg.clone();
    let (merged, errors) =
        tokio::task::spawn_blocking(move || super::build_local_merged(&c)).await?;
    for err in &errors {
        tracing::warn!("served dynamically instead: {err}");
    }
    if let Ok(mut m) = state.local_merged.write() {
        *m = merged;
    }
    state.set_ready(true);
    let watcher = (!poll.is_zero()).then(|| {
        tokio::spawn(crate::config::watch(
            config_path,
            state.config.clone(),
            state.engine.clone(),
            poll,
        ))
    });
    let st = state.clone();
    axum::serve(listener, app(state))
        .with_graceful_shutdown(async move {
            shutdown.await;
            st.set_ready(false);
            tracing::info!("draining");
        })
        .await?;
    if let Some(w) = watcher {
        w.abort();
    }
    Ok(())
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
