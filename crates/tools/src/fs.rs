//! Durable writes, shared by every tool that publishes files: a file's bytes reach the disk
//! before its name does, and a renamed name reaches the disk (its directory synced) before the
//! tool says it is done, so a machine crash leaves either the old state or the whole new one,
//! never a name over torn bytes. Errors are plain `io::Error`s, which each tool maps into its
//! own error naming the path. (Which paths a tool may touch is `mole_formats::paths`'s.)

use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

/// Whether outputs are made durable (fdatasync) before and after their rename; see
/// [`set_durable`].
static DURABLE: AtomicBool = AtomicBool::new(true);

/// Turns the fdatasyncs off for this process (`merge --no-fsync`, `quantize --no-fsync`:
/// outputs on tmpfs, or timing against `cp`). On by default.
pub fn set_durable(on: bool) {
    DURABLE.store(on, Ordering::Relaxed);
}

/// Whether files are fdatasync'd before their rename ([`set_durable`]).
pub fn durable() -> bool {
    DURABLE.load(Ordering::Relaxed)
}

/// fdatasyncs a file, unless [`durable`] is off.
pub fn sync_file(path: &Path) -> io::Result<()> {
    if !durable() {
        return Ok(());
    }
    std::fs::File::open(path)?.sync_data()
}

/// Syncs a directory (its entries: names created, renamed or removed in it), unless
/// [`durable`] is off.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    if !durable() {
        return Ok(());
    }
    std::fs::File::open(dir)?.sync_all()
}

/// Publishes the finished file `tmp` as `dest` (same directory): its bytes synced, renamed,
/// then the directory synced so the new name survives a crash. The error names the step's
/// path: `tmp` for the sync, `dest` for the rename and its directory.
pub fn publish_file(tmp: &Path, dest: &Path) -> Result<(), (std::path::PathBuf, io::Error)> {
    sync_file(tmp).map_err(|e| (tmp.to_path_buf(), e))?;
    std::fs::rename(tmp, dest).map_err(|e| (dest.to_path_buf(), e))?;
    let dir = dest.parent().filter(|p| !p.as_os_str().is_empty());
    sync_dir(dir.unwrap_or(Path::new("."))).map_err(|e| (dest.to_path_buf(), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_published_file_has_its_bytes_under_the_new_name_and_none_under_the_old() {
        let d = tempfile::tempdir().unwrap();
        let (tmp, dest) = (d.path().join("x.part"), d.path().join("x"));
        std::fs::write(&tmp, b"weights").unwrap();
        publish_file(&tmp, &dest).unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), b"weights");
        assert!(!tmp.exists());
        // A missing file names the path the sync failed on.
        let (p, _) = publish_file(&tmp, &dest).unwrap_err();
        assert_eq!(p, tmp);
    }
}
