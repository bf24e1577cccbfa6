//! Paths that files and commands name, and the one rule each of them is held to: a plain
//! relative name stays below the directory it is joined to ([`stays_below`], and
//! [`plain_relative`] for a name read from a file: a fetch listing's file, a shard of
//! `model.safetensors.index.json`), and a path is confined to a root only once every symlink
//! is resolved ([`confine`], [`resolve_within`]: a configured adapter, a model directory's
//! files, the merge's, the quantize's and the prune's paths). Each layer maps an
//! [`Unconfined`] into its own error, so the rule is written once and reported in each
//! tool's words.

use std::path::{Component, Path, PathBuf};

/// Whether `rel`, joined to a directory, names something below it, read from its components
/// alone (nothing on disk): every component a plain name, none absolute, `.` or `..`.
pub fn stays_below(rel: &Path) -> bool {
    rel.components().all(|c| matches!(c, Component::Normal(_)))
}

/// Why `name` is not a plain relative path (empty, absolute, `.`/`..` or empty components,
/// a backslash or NUL), or `Ok`. Stricter than [`stays_below`] on the text: a name read from
/// a file must be written the one way (`a//b` and `a/./b` are refused, not normalized).
pub fn plain_relative(name: &str) -> Result<(), &'static str> {
    if name.is_empty() || name.contains('\\') || name.contains('\0') {
        return Err("not a plain relative path");
    }
    if name
        .split('/')
        .any(|s| s.is_empty() || s == "." || s == "..")
    {
        return Err("has an empty, '.' or '..' component");
    }
    if !stays_below(Path::new(name)) {
        return Err("is absolute or not normal");
    }
    Ok(())
}

/// Why a path was not confined to its root.
#[derive(Debug)]
pub enum Unconfined {
    /// The root does not resolve.
    Root(std::io::Error),
    /// The path does not resolve (missing, unreadable): canonicalisation is the only reliable
    /// symlink check, so a path that cannot be resolved cannot be confined.
    Path(std::io::Error),
    /// The path resolves outside the root, to this.
    Outside(PathBuf),
}

impl std::fmt::Display for Unconfined {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unconfined::Root(e) => write!(f, "root: {e}"),
            Unconfined::Path(e) => write!(f, "{e}"),
            Unconfined::Outside(p) => write!(f, "resolves to {}", p.display()),
        }
    }
}

/// `path` (as given: absolute, or relative to the working directory) resolved with every
/// symlink followed, refused unless it lies inside `root` resolved (with no root: resolved
/// only).
pub fn confine(path: &Path, root: Option<&Path>) -> Result<PathBuf, Unconfined> {
    let root = root
        .map(std::fs::canonicalize)
        .transpose()
        .map_err(Unconfined::Root)?;
    let real = std::fs::canonicalize(path).map_err(Unconfined::Path)?;
    match root {
        Some(root) if !real.starts_with(&root) => Err(Unconfined::Outside(real)),
        _ => Ok(real),
    }
}

/// `rel` (relative to `root`, or absolute) confined to `root` as [`confine`] does.
pub fn resolve_within(root: &Path, rel: &Path) -> Result<PathBuf, Unconfined> {
    confine(&root.join(rel), Some(root))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_names_and_confinement() {
        for ok in ["a", "a/b.safetensors", "dir/x-1.json"] {
            assert_eq!(plain_relative(ok), Ok(()), "{ok}");
        }
        for bad in [
            "",
            "/etc/x",
            "../x",
            "a/../../x",
            "a//b",
            "./a",
            "a\\b",
            "a/.",
        ] {
            assert!(plain_relative(bad).is_err(), "{bad}");
        }
        let d = tempfile::tempdir().unwrap();
        let out = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("in"), "x").unwrap();
        std::fs::write(out.path().join("secret"), "x").unwrap();
        std::os::unix::fs::symlink(out.path().join("secret"), d.path().join("link")).unwrap();
        assert!(resolve_within(d.path(), Path::new("in")).is_ok());
        assert!(resolve_within(d.path(), Path::new("link")).is_err());
        assert!(resolve_within(d.path(), &out.path().join("secret")).is_err());
        assert!(resolve_within(d.path(), Path::new("missing")).is_err());
        assert!(matches!(
            resolve_within(d.path(), Path::new("../")),
            Err(Unconfined::Outside(_))
        ));
        assert!(matches!(
            confine(
                Path::new("/nonexistent-root/x"),
                Some(Path::new("/nonexistent-root"))
            ),
            Err(Unconfined::Root(_))
        ));
        // Without a root a path is resolved only.
        assert_eq!(
            confine(&d.path().join("link"), None).unwrap(),
            std::fs::canonicalize(out.path().join("secret")).unwrap()
        );
    }

    #[test]
    fn stays_below_reads_components() {
        for ok in ["a", "a/b", "a/./b", "a//b", ""] {
            assert!(stays_below(Path::new(ok)), "{ok}");
        }
        for bad in ["/a", "../a", "a/../b", ".", "./a"] {
            assert!(!stays_below(Path::new(bad)), "{bad}");
        }
    }
}
