//! `mole-worker fetch`: the command the operator's `fetch-model` init container and adapter
//! fetch Jobs run.

use std::path::PathBuf;
use std::process::ExitCode;

use super::{fetch, FetchError, FetchOptions};

/// Arguments of `fetch`. Credentials come from the variables the hub's and AWS's own tools
/// read, so a Secret's keys can be passed to the container unchanged.
#[derive(clap::Args, Debug)]
pub struct FetchArgs {
    /// `hf://org/model[@revision]` or `s3://bucket/prefix` (`pvc://` is mounted, not fetched).
    #[arg(long, env = "MOLE_FETCH_SOURCE")]
    pub source: String,
    /// Directory the files are written into (created); `DEST/.mole-fetch.json` is written last.
    #[arg(long, env = "MOLE_FETCH_DEST")]
    pub dest: PathBuf,
    /// Hugging Face Hub endpoint.
    #[arg(long, env = "HF_ENDPOINT", default_value = "https://huggingface.co")]
    pub hf_endpoint: String,
    /// Hub token, sent as `Authorization: Bearer`.
    #[arg(long, env = "HF_TOKEN", hide_env_values = true)]
    pub hf_token: Option<String>,
    /// File holding the hub token (a mounted Secret); used when --hf-token is not set.
    #[arg(long, env = "MOLE_HF_TOKEN_FILE")]
    pub hf_token_file: Option<PathBuf>,
    /// S3-compatible endpoint (MinIO, Ceph...): path-style addressing. Default: AWS.
    #[arg(long, env = "AWS_ENDPOINT_URL")]
    pub s3_endpoint: Option<String>,
    /// S3 region (AWS_DEFAULT_REGION is read too). Default: us-east-1.
    #[arg(long, env = "AWS_REGION")]
    pub s3_region: Option<String>,
    /// S3 access key id; without one requests are anonymous (public buckets).
    #[arg(long, env = "AWS_ACCESS_KEY_ID", hide_env_values = true)]
    pub aws_access_key_id: Option<String>,
    /// S3 secret access key.
    #[arg(long, env = "AWS_SECRET_ACCESS_KEY", hide_env_values = true)]
    pub aws_secret_access_key: Option<String>,
    /// S3 session token, for temporary credentials.
    #[arg(long, env = "AWS_SESSION_TOKEN", hide_env_values = true)]
    pub aws_session_token: Option<String>,
    /// How many times a broken download is resumed (with a Range request) before failing.
    #[arg(long, env = "MOLE_FETCH_RETRIES", default_value_t = 5)]
    pub retries: u32,
    /// Pages of an S3 listing read at most (1000 objects a page): a store whose listing goes
    /// on past them fails the fetch instead of listing forever.
    #[arg(long, env = "MOLE_FETCH_MAX_LIST_PAGES", default_value_t = super::DEFAULT_MAX_LIST_PAGES)]
    pub max_list_pages: u32,
    /// Where the one-line failure reason is also written (Kubernetes copies it into the
    /// Pod's termination message). Default: /dev/termination-log, when it exists.
    #[arg(long, env = "MOLE_TERMINATION_LOG")]
    pub termination_log: Option<PathBuf>,
}

/// Runs `fetch`. On failure prints one line to stderr and to the termination log, where the
/// operator picks it up for the pool's or adapter's condition; exit 2 for what a retry cannot
/// fix (bad source, refused files), 1 for the rest.
pub fn run(args: FetchArgs) -> ExitCode {
    let termination_log = args.termination_log.clone();
    let result = options(args).and_then(|opts| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| FetchError::Io {
                path: "tokio runtime".into(),
                source: e,
            })?;
        rt.block_on(fetch(&opts)).map(|r| (opts, r))
    });
    match result {
        Ok((opts, report)) => {
            let m = &report.manifest;
            if report.downloaded {
                println!(
                    "fetched {} files ({} bytes transferred) from {}{} into {}",
                    m.files.len(),
                    report.bytes,
                    m.source,
                    m.revision
                        .as_deref()
                        .map(|r| format!(" at {r}"))
                        .unwrap_or_default(),
                    opts.dest.display()
                );
            } else {
                println!(
                    "{} already holds {}; nothing to do",
                    opts.dest.display(),
                    m.source
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            let line = format!("fetch failed ({}): {e}", e.code());
            eprintln!("{line}");
            mole_telemetry::write_termination_log(termination_log.as_deref(), &line);
            ExitCode::from(e.exit_code())
        }
    }
}

fn options(args: FetchArgs) -> Result<FetchOptions, FetchError> {
    let hf_token = match (args.hf_token, &args.hf_token_file) {
        (Some(t), _) if !t.is_empty() => Some(t),
        (_, Some(path)) => Some(
            std::fs::read_to_string(path)
                .map_err(|source| FetchError::Io {
                    path: path.display().to_string(),
                    source,
                })?
                .trim()
                .to_string(),
        ),
        _ => None,
    };
    let s3_region = args
        .s3_region
        .or_else(|| std::env::var("AWS_DEFAULT_REGION").ok());
    Ok(FetchOptions {
        source: args.source,
        dest: args.dest,
        hf_endpoint: Some(args.hf_endpoint),
        hf_token,
        s3_endpoint: args.s3_endpoint,
        s3_region,
        aws_access_key_id: args.aws_access_key_id,
        aws_secret_access_key: args.aws_secret_access_key,
        aws_session_token: args.aws_session_token,
        retries: args.retries,
        max_list_pages: args.max_list_pages,
    })
}
