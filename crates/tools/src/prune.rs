//! `mole-worker prune`: deletes merged outputs that fell out of an adapter's history. It runs
//! in the operator's cleanup Job (the operator pod never touches the model volume) and refuses
//! any path that does not resolve, symlinks included, strictly inside `--root`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use mole_formats::paths::Unconfined;

/// Arguments of `prune`.
#[derive(clap::Args, Debug)]
pub struct PruneArgs {
    /// Only directories strictly inside this one may be deleted.
    #[arg(long, env = "MOLE_PRUNE_ROOT")]
    pub root: PathBuf,
    /// Directories to delete.
    pub paths: Vec<PathBuf>,
}

/// Why a prune failed. Stable names via [`PruneError::code`].
#[derive(Debug, thiserror::Error)]
pub enum PruneError {
    /// A path resolves outside the root (or is the root itself).
    #[error("{path}: outside {root}; refusing to delete it")]
    OutsideRoot {
        /// Offending path.
        path: String,
        /// The root.
        root: String,
    },
    /// Filesystem error.
    #[error("{path}: {source}")]
    Io {
        /// Path.
        path: String,
        /// Cause.
        source: std::io::Error,
    },
}

impl PruneError {
    /// Stable name of the error.
    pub fn code(&self) -> &'static str {
        match self {
            PruneError::OutsideRoot { .. } => "path_outside_root",
            PruneError::Io { .. } => "io_error",
        }
    }
}

/// Deletes each path after checking it resolves strictly inside `root`. A path that does not
/// exist is already pruned (the Job may run twice). Returns the directories deleted.
pub fn prune(root: &Path, paths: &[PathBuf]) -> Result<Vec<PathBuf>, PruneError> {
    let io = |p: &Path| {
        let path = p.display().to_string();
        move |source| PruneError::Io { path, source }
    };
    let root = root.canonicalize().map_err(io(root))?;
    // Check every path before deleting any, so a bad list deletes nothing.
    let mut targets = Vec::new();
    for p in paths {
        match mole_formats::paths::confine(p, Some(&root)) {
            // Strictly inside: the root itself is never deleted.
            Ok(real) if real != root => targets.push(real),
            Ok(_) | Err(Unconfined::Outside(_)) => {
                return Err(PruneError::OutsideRoot {
                    path: p.display().to_string(),
                    root: root.display().to_string(),
                })
            }
            Err(Unconfined::Path(e)) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(Unconfined::Path(e)) => return Err(io(p)(e)),
            Err(Unconfined::Root(e)) => return Err(io(&root)(e)),
        }
    }
    for t in &targets {
        std::fs::remove_dir_all(t).map_err(io(t))?;
    }
    Ok(targets)
}

/// Runs `prune`: exit 2 for a refused path, 1 for an I/O failure.
pub fn run(args: PruneArgs) -> ExitCode {
    match prune(&args.root, &args.paths) {
        Ok(done) => {
            for d in done {
                println!("deleted {}", d.display());
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            let line = format!("prune failed ({}): {e}", e.code());
            eprintln!("{line}");
            mole_telemetry::write_termination_log(None, &line);
            ExitCode::from(match e {
                PruneError::OutsideRoot { .. } => 2,
                PruneError::Io { .. } => 1,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deletes_inside_and_refuses_escapes_without_deleting_anything() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("merged/calendar");
        let old = root.join("v1-abc");
        std::fs::create_dir_all(old.join("sub")).unwrap();
        let outside = tmp.path().join("base");
        std::fs::create_dir_all(&outside).unwrap();
        #[cfg(unix)]
        std::os::unix::fs::symlink(&outside, root.join("link")).unwrap();

        for bad in [root.join("link"), root.join("../../base"), root.clone()] {
            let err = prune(&root, &[old.clone(), bad]).unwrap_err();
            assert_eq!(err.code(), "path_outside_root");
            assert!(old.exists(), "a refused list deletes nothing");
            assert!(outside.exists());
        }
        let done = prune(&root, &[old.clone(), root.join("v0-gone")]).unwrap();
        assert_eq!(done.len(), 1);
        assert!(!old.exists());
        assert!(outside.exists());
    }
}
