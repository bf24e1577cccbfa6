//! Writes the CRDs to `charts/mole/crds/` (or the directory given as the first argument).

#![forbid(unsafe_code)]

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("charts/mole/crds"));
    std::fs::create_dir_all(&dir)?;
    for (name, yaml) in mole_crds::crds_yaml()? {
        let path = dir.join(format!("{name}.yaml"));
        std::fs::write(&path, yaml)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
