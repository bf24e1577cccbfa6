//! `mole-operator`: reconciles InferencePool and Adapter. Every flag is also an env var.

#![forbid(unsafe_code)]

mod simulate;

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context as _;
use clap::builder::NonEmptyStringValueParser;
use clap::{Parser, Subcommand};
use mole_operator::controller::{self, Context, PodClient};
use mole_operator::leader::{self, LeaseConfig};
use mole_operator::resources::{
    WorkerDefaults, DEFAULT_WORKER_IMAGE_CPU, DEFAULT_WORKER_IMAGE_GPU,
};
use mole_operator::telemetry::{self, Health, Metrics};

#[derive(Parser)]
#[command(
    name = "mole-operator",
    version,
    about = "Kubernetes operator for mole"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    run: RunArgs,
    /// Export traces (every reconcile's span) over OTLP/HTTP to this collector
    /// (`http://collector:4318`, or the full `.../v1/traces` URL); off when unset. The `OTEL_*`
    /// variables of the OpenTelemetry SDK (service name, resource attributes, sampler,
    /// headers) apply.
    #[arg(long, global = true, env = "MOLE_OTLP_TRACES_ENDPOINT")]
    otlp_traces_endpoint: Option<String>,
}

#[derive(Subcommand)]
enum Command {
    /// Run the controllers (the default).
    Run,
    /// Print the CustomResourceDefinitions as YAML.
    Crd,
    /// Play a request trace against a simulated pool under the fleet policies.
    Simulate(Box<simulate::SimulateArgs>),
}

#[derive(clap::Args, Clone)]
struct RunArgs {
    /// Address of /healthz, /readyz and /metrics.
    #[arg(long, env = "MOLE_OPERATOR_LISTEN", default_value = "0.0.0.0:8080")]
    listen: SocketAddr,
    /// Watch only this namespace (default: all).
    #[arg(long, env = "MOLE_OPERATOR_NAMESPACE")]
    namespace: Option<String>,
    /// Elect a leader on a Lease so only one replica writes.
    #[arg(long, env = "MOLE_LEADER_ELECT", default_value_t = true, action = clap::ArgAction::Set)]
    leader_elect: bool,
    /// Name of the leader Lease.
    #[arg(
        long,
        env = "MOLE_LEADER_LEASE",
        default_value = "mole-operator-leader"
    )]
    lease_name: String,
    /// Namespace of the leader Lease (default: the pod's namespace).
    #[arg(long, env = "MOLE_LEADER_NAMESPACE")]
    lease_namespace: Option<String>,
    /// Seconds a Lease stays valid without renewal (another replica may take it after that).
    #[arg(long, env = "MOLE_LEADER_LEASE_DURATION", default_value_t = 15)]
    lease_duration: u64,
    /// Seconds without a successful renewal after which the leader steps down (and exits);
    /// shorter than the lease duration. Default: 2/3 of it.
    #[arg(long, env = "MOLE_LEADER_RENEW_DEADLINE")]
    renew_deadline: Option<u64>,
    /// Seconds between renewals (and between a standby's attempts). Default: 1/3 of the lease
    /// duration.
    #[arg(long, env = "MOLE_LEADER_RETRY_PERIOD")]
    retry_period: Option<u64>,
    /// This replica's identity in the Lease (default: the pod name).
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// Port of the worker pods' HTTP API: the port the operator renders into their pods
    /// (`--listen`, the container port the probes and Services name) and polls them on.
    #[arg(long, env = "MOLE_WORKER_PORT", default_value_t = mole_crds::constants::WORKER_PORT)]
    worker_port: u16,
    /// Worker image of pools that request GPUs and leave `spec.image` unset (the CUDA build).
    #[arg(
        long,
        env = "MOLE_WORKER_IMAGE_GPU",
        default_value = DEFAULT_WORKER_IMAGE_GPU,
        value_parser = NonEmptyStringValueParser::new()
    )]
    worker_image_gpu: String,
    /// Worker image of pools without GPUs that leave `spec.image` unset, and of their merge
    /// and cleanup Jobs (which need no GPU).
    #[arg(
        long,
        env = "MOLE_WORKER_IMAGE_CPU",
        default_value = DEFAULT_WORKER_IMAGE_CPU,
        value_parser = NonEmptyStringValueParser::new()
    )]
    worker_image_cpu: String,
    /// The OTLP/HTTP trace collector the worker pods export to (their
    /// `MOLE_OTLP_TRACES_ENDPOINT`); unset: they export nothing.
    #[arg(long, env = "MOLE_WORKER_OTLP_TRACES_ENDPOINT")]
    worker_otlp_traces_endpoint: Option<String>,
    /// Seconds reconciles under way may take to finish after SIGTERM or SIGINT before they are
    /// cut off; then the Lease is released and the process exits. Keep it well inside the
    /// pod's terminationGracePeriodSeconds (30 by default).
    #[arg(long, env = "MOLE_SHUTDOWN_GRACE", default_value_t = 10)]
    shutdown_grace: u64,
    /// Milliseconds a pool's reading of its pods (their adapter listings), merged Deployments
    /// and Jobs serves every Adapter reconcile of the pool: the pods are asked at most once per
    /// interval, whatever the number of Adapters.
    #[arg(long, env = "MOLE_POD_POLL_MS", default_value_t = 2000,
          value_parser = clap::value_parser!(u64).range(0..=60_000))]
    pod_poll_ms: u64,
}

/// Resolves at the first SIGTERM or SIGINT (a rollout, a drain, Ctrl+C); cloneable, so the
/// controllers, the leader election and the grace timer all see the same signal.
fn shutdown_signal() -> futures::future::Shared<futures::future::BoxFuture<'static, ()>> {
    use futures::FutureExt;
    async {
        let term = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut s) => {
                    s.recv().await;
                }
                // No handler: only Ctrl+C stops it (never seen on Linux).
                Err(e) => {
                    tracing::warn!(error = %e, "no SIGTERM handler");
                    std::future::pending::<()>().await;
                }
            }
        };
        tokio::select! {
            _ = term => tracing::info!("SIGTERM: shutting down"),
            _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: shutting down"),
        }
    }
    .boxed()
    .shared()
}

/// Runs the controllers until `shutdown`, then gives the reconciles under way `grace` to
/// finish; what is still running after that is dropped (each reconcile is idempotent: the
/// next leader redoes it). Returns as soon as none is under way.
async fn run_controllers(
    client: kube::Client,
    namespace: Option<String>,
    ctx: Context,
    shutdown: futures::future::Shared<futures::future::BoxFuture<'static, ()>>,
    grace: Duration,
) {
    use std::sync::atomic::Ordering;
    let in_flight = ctx.in_flight();
    let run = controller::run(client, namespace, ctx, shutdown.clone());
    tokio::pin!(run);
    let drained = async {
        shutdown.await;
        let deadline = tokio::time::Instant::now() + grace;
        while in_flight.load(Ordering::SeqCst) > 0 {
            if tokio::time::Instant::now() >= deadline {
                tracing::warn!(
                    ?grace,
                    under_way = in_flight.load(Ordering::SeqCst),
                    "reconciles still running after the shutdown grace; stopping them"
                );
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::select! {
        _ = &mut run => {}
        _ = drained => {}
    }
}

fn pod_namespace() -> String {
    std::fs::read_to_string("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "default".into())
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    let metrics = Metrics::new();
    let health = Health::default();
    let server = tokio::spawn(telemetry::serve(
        args.listen,
        metrics.clone(),
        health.clone(),
    ));
    let client = kube::Client::try_default()
        .await
        .context("connecting to Kubernetes")?;
    let identity = args
        .identity
        .clone()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| format!("mole-operator-{}", std::process::id()));
    tracing::info!(
        gpu = %args.worker_image_gpu,
        cpu = %args.worker_image_cpu,
        "default worker images"
    );
    let ctx = Context::new(
        client.clone(),
        identity.clone(),
        metrics.clone(),
        PodClient::new(args.worker_port),
    )
    .with_pod_freshness(Duration::from_millis(args.pod_poll_ms))
    .with_worker_defaults(WorkerDefaults {
        gpu: args.worker_image_gpu.clone(),
        cpu: args.worker_image_cpu.clone(),
        otlp_traces_endpoint: args
            .worker_otlp_traces_endpoint
            .clone()
            .filter(|e| !e.trim().is_empty()),
    });
    let shutdown = shutdown_signal();
    let grace = Duration::from_secs(args.shutdown_grace);
    if args.leader_elect {
        let mut cfg = LeaseConfig::with_duration(
            args.lease_name.clone(),
            args.lease_namespace.clone().unwrap_or_else(pod_namespace),
            identity,
            Duration::from_secs(args.lease_duration),
        );
        if let Some(s) = args.renew_deadline {
            cfg.renew_deadline = Duration::from_secs(s);
        }
        if let Some(s) = args.retry_period {
            cfg.renew = Duration::from_secs(s);
        }
        cfg.validate().map_err(anyhow::Error::msg)?;
        // A standby is healthy and ready: it serves metrics and waits for the Lease.
        health.set_ready();
        tokio::select! {
            _ = leader::acquire(client.clone(), &cfg) => {}
            // A standby stopped before it ever led: nothing to hand over.
            _ = shutdown.clone() => {
                server.abort();
                return Ok(());
            }
        }
        metrics.leader.set(1);
        tracing::info!(identity = %cfg.identity, "leading");
        let lease_client = client.clone();
        tokio::select! {
            _ = run_controllers(client.clone(), args.namespace, ctx, shutdown, grace) => {}
            _ = leader::hold(lease_client, cfg.clone()) => {
                metrics.leader.set(0);
                anyhow::bail!("lost the leader Lease; exiting so a fresh replica can stand by");
            }
        }
        metrics.leader.set(0);
        // Hand over at once: without it a standby waits out the lease duration, and every
        // rolling update of the operator stops reconciling for that long.
        match tokio::time::timeout(Duration::from_secs(5), leader::release(client, &cfg)).await {
            Ok(Ok(true)) => tracing::info!(lease = %cfg.name, "released the leader Lease"),
            Ok(Ok(false)) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "could not release the leader Lease"),
            Err(_) => tracing::warn!("releasing the leader Lease timed out"),
        }
    } else {
        health.set_ready();
        run_controllers(client, args.namespace, ctx, shutdown, grace).await;
    }
    server.abort();
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // Held until main returns: dropping it exports the spans still buffered.
    let _telemetry = mole_telemetry::init("mole-operator", cli.otlp_traces_endpoint.as_deref())
        .map_err(|e| anyhow::anyhow!("{}: {e}", e.code()))?;
    match cli.command {
        Some(Command::Crd) => {
            for (_, yaml) in mole_crds::crds_yaml()? {
                println!("---\n{yaml}");
            }
            Ok(())
        }
        Some(Command::Simulate(a)) => simulate::simulate(*a),
        Some(Command::Run) | None => run(cli.run).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_image_flags_default_to_the_released_images_and_refuse_empty() {
        // Run with neither MOLE_WORKER_IMAGE_* set (as `cargo test` does).
        let cli = Cli::try_parse_from(["mole-operator"]).unwrap();
        assert_eq!(cli.run.worker_image_gpu, DEFAULT_WORKER_IMAGE_GPU);
        assert_eq!(cli.run.worker_image_cpu, DEFAULT_WORKER_IMAGE_CPU);
        let cli = Cli::try_parse_from([
            "mole-operator",
            "--worker-image-gpu",
            "reg/w:1-cuda",
            "--worker-image-cpu",
            "reg/w:1-cpu",
        ])
        .unwrap();
        assert_eq!(
            (
                cli.run.worker_image_gpu.as_str(),
                cli.run.worker_image_cpu.as_str()
            ),
            ("reg/w:1-cuda", "reg/w:1-cpu")
        );
        assert!(Cli::try_parse_from(["mole-operator", "--worker-image-gpu", ""]).is_err());
    }
}
