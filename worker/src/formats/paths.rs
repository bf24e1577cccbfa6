//! Paths that files name: the one check of a plain relative name (a fetch listing's file, a
//! shard of `model.safetensors.index.json`) and the one confinement of a path to a directory
//! after symlinks are resolved (a configured adapter, a model directory's files). The fetch,
//! the config and the model readers all use these two.

use std::path::{Component, Path, PathBuf};

/// Why `name` is not a plain relative path (empty, absolute, `.`/`..` or empty components,
/// a backslash or NUL), or `Ok`.
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
    if !Path::new(name)
        .components()
        .all(|c| matches!(c, Component::Normal(_)))
    {
        return Err("is absolute or not normal");
    }
    Ok(())
}

/// `rel` (relative to `root`, or absolute) resolved with every symlink followed, refused
/// (with the reason) unless it lies inside `root` resolved. The target must exist:
/// canonicalisation is the only reliable symlink check.
pub fn resolve_within(root: &Path, rel: &Path) -> Result<PathBuf, String> {
    let root_c = std::fs::canonicalize(root).map_err(|e| format!("root: {e}"))?;
    let joined = if rel.is_absolute() {
        rel.to_path_buf()
    } else {
        root_c.join(rel)
    };
    let c = std::fs::canonicalize(&joined).map_err(|e| e.to_string())?;
    if !c.starts_with(&root_c) {
        return Err(format!("resolves to {}", c.display()));
    }
    Ok(c)
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
    }
}
