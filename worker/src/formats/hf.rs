//! Hugging Face model directories: `config.json` and `model.safetensors` or shards listed in
//! `model.safetensors.index.json`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// Errors reading a model directory.
#[derive(Debug, thiserror::Error)]
pub enum HfError {
    /// A file is missing or unreadable.
    #[error("cannot read {path}: {source}")]
    Io {
        /// File.
        path: String,
        /// Cause.
        source: std::io::Error,
    },
    /// A JSON file is malformed.
    #[error("invalid {path}: {message}")]
    Json {
        /// File.
        path: String,
        /// Parser message.
        message: String,
    },
    /// Weights only in a pickle format.
    #[error("{path}: pickle weights (.bin/.pt) are refused; convert them to safetensors")]
    Pickle {
        /// Offending file.
        path: String,
    },
    /// No safetensors weights found.
    #[error("{dir}: no model.safetensors or model.safetensors.index.json")]
    NoWeights {
        /// Directory.
        dir: String,
    },
}

/// `model.safetensors.index.json`.
#[derive(Deserialize, Debug, Clone)]
pub struct SafetensorsIndex {
    /// Tensor name → shard file name.
    pub weight_map: BTreeMap<String, String>,
    /// Free-form metadata (`total_size`).
    #[serde(default)]
    pub metadata: serde_json::Value,
}

/// Elements of every tensor in `files`, read from their safetensors headers alone (no tensor
/// data is read): what the weights will take once loaded, before any is allocated.
pub fn safetensors_elements(files: &[PathBuf]) -> Result<u64, HfError> {
    use std::io::Read;
    let mut total = 0u64;
    for f in files {
        let path = f.display().to_string();
        let io = |source| HfError::Io {
            path: path.clone(),
            source,
        };
        let bad = |message: String| HfError::Json {
            path: path.clone(),
            message,
        };
        let mut file = std::fs::File::open(f).map_err(io)?;
        let mut len = [0u8; 8];
        file.read_exact(&mut len).map_err(io)?;
        let len = u64::from_le_bytes(len);
        // safetensors caps its header at 100 MB; a larger one is not a safetensors file.
        if len > 100_000_000 {
            return Err(bad(format!("a header of {len} bytes")));
        }
        let mut header = vec![0u8; len as usize];
        file.read_exact(&mut header).map_err(io)?;
        let header: BTreeMap<String, serde_json::Value> =
            serde_json::from_slice(&header).map_err(|e| bad(e.to_string()))?;
        for (name, t) in header.iter().filter(|(n, _)| *n != "__metadata__") {
            let shape = t["shape"]
                .as_array()
                .ok_or_else(|| bad(format!("tensor {name} has no shape")))?;
            total += shape
                .iter()
                .map(|d| d.as_u64().unwrap_or(0))
                .product::<u64>();
        }
    }
    Ok(total)
}

/// The weight files of a model directory, in shard order.
pub fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>, HfError> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let idx = read_index(&index)?;
        let mut files: Vec<String> = idx.weight_map.values().cloned().collect();
        files.sort();
        files.dedup();
        return Ok(files.into_iter().map(|f| dir.join(f)).collect());
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    if let Some(p) = find_pickle(dir) {
        return Err(HfError::Pickle {
            path: p.display().to_string(),
        });
    }
    Err(HfError::NoWeights {
        dir: dir.display().to_string(),
    })
}

/// Reads a safetensors index file.
pub fn read_index(path: &Path) -> Result<SafetensorsIndex, HfError> {
    let text = std::fs::read_to_string(path).map_err(|source| HfError::Io {
        path: path.display().to_string(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| HfError::Json {
        path: path.display().to_string(),
        message: e.to_string(),
    })
}

/// The first pickle weight file (`*.bin`, `*.pt`, `*.pth`, `*.ckpt`) in a directory, if any.
pub fn find_pickle(dir: &Path) -> Option<PathBuf> {
    let entries = std::fs::read_dir(dir).ok()?;
    entries.flatten().map(|e| e.path()).find(|p| {
        matches!(
            p.extension().and_then(|e| e.to_str()),
            Some("bin" | "pt" | "pth" | "ckpt" | "pkl")
        )
    })
}

/// Reads `config.json` as JSON.
pub fn read_config(dir: &Path) -> Result<serde_json::Value, HfError> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|source| HfError::Io {
        path: path.display().to_string(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| HfError::Json {
        path: path.display().to_string(),
        message: e.to_string(),
    })
}
