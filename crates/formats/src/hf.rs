//! Hugging Face model directories: `config.json` and `model.safetensors` or shards listed in
//! `model.safetensors.index.json`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::paths;

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
    /// A file the directory names (an index's shard, a symlinked tokenizer) lies outside it.
    #[error("{name} is not inside the model directory {dir}: {reason}")]
    OutsideDir {
        /// The name as the directory's files give it.
        name: String,
        /// The model directory.
        dir: String,
        /// Why.
        reason: String,
    },
}

impl HfError {
    /// Stable name (metric label, log field).
    pub fn code(&self) -> &'static str {
        match self {
            HfError::Io { .. } => "model_io",
            HfError::Json { .. } => "model_json_invalid",
            HfError::Pickle { .. } => "pickle_refused",
            HfError::NoWeights { .. } => "no_weights",
            HfError::OutsideDir { .. } => "path_outside_root",
        }
    }
}

/// The files besides the weights that mole reads from a model directory.
pub const MODEL_FILES: &[&str] = &[
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "model.safetensors",
    "model.safetensors.index.json",
];

/// `name` in `dir`: a plain relative name ([`paths::plain_relative`]) that, when it exists,
/// resolves (symlinks followed) inside `dir` ([`paths::resolve_within`]); a missing file is
/// returned as joined, for the caller to treat as missing.
pub fn confine(dir: &Path, name: &str) -> Result<PathBuf, HfError> {
    let outside = |reason: String| HfError::OutsideDir {
        name: name.to_string(),
        dir: dir.display().to_string(),
        reason,
    };
    paths::plain_relative(name).map_err(|r| outside(r.to_string()))?;
    let joined = dir.join(name);
    if std::fs::symlink_metadata(&joined).is_err() {
        return Ok(joined);
    }
    paths::resolve_within(dir, Path::new(name)).map_err(|e| outside(e.to_string()))
}

/// Checks every file mole reads from a model directory lies inside it: the shards of its
/// index and [`MODEL_FILES`].
pub fn check_confined(dir: &Path) -> Result<(), HfError> {
    for f in MODEL_FILES {
        confine(dir, f)?;
    }
    // A directory quantized by `mole-worker quantize` holds one GGUF file instead of shards.
    if super::gguf::is_quantized_dir(dir) {
        return confine(dir, super::gguf::QUANTIZED_FILE).map(|_| ());
    }
    safetensors_files(dir).map(|_| ())
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
        // safetensors caps its header at 100 MB; a larger one is not a safetensors file (the
        // length is not printed: it is the first bytes of a file that may not be ours).
        if len > 100_000_000 {
            return Err(bad(
                "not a safetensors file (header length over 100 MB)".into()
            ));
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

/// The weight files of a model directory, in shard order, each confined to it ([`confine`]:
/// a fetched index may name `/etc/...` or `../..`).
pub fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>, HfError> {
    let index = confine(dir, "model.safetensors.index.json")?;
    if index.exists() {
        let idx = read_index(&index)?;
        let mut files: Vec<String> = idx.weight_map.values().cloned().collect();
        files.sort();
        files.dedup();
        return files.iter().map(|f| confine(dir, f)).collect();
    }
    let single = confine(dir, "model.safetensors")?;
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

/// Whether a file named `name` holds pickled weights (`*.bin`, `*.pt`, `*.pth`, `*.ckpt`,
/// `*.pkl`, in any case), which can run code when loaded: the one list the fetch (which
/// leaves them behind) and the readers and tools (which refuse them) go by.
pub fn is_pickle(name: &str) -> bool {
    let ext = name.rsplit_once('.').map_or("", |(_, e)| e);
    ["bin", "pt", "pth", "ckpt", "pkl"]
        .iter()
        .any(|p| ext.eq_ignore_ascii_case(p))
}

/// The first pickle weight file ([`is_pickle`]) in a directory, if any.
pub fn find_pickle(dir: &Path) -> Option<PathBuf> {
    let entries = std::fs::read_dir(dir).ok()?;
    entries
        .flatten()
        .find(|e| is_pickle(&e.file_name().to_string_lossy()))
        .map(|e| e.path())
}

/// Reads `config.json` as JSON.
pub fn read_config(dir: &Path) -> Result<serde_json::Value, HfError> {
    let path = confine(dir, "config.json")?;
    let text = std::fs::read_to_string(&path).map_err(|source| HfError::Io {
        path: path.display().to_string(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| HfError::Json {
        path: path.display().to_string(),
        message: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One list of pickle names, in any case: what the fetch leaves behind is what the tools
    /// refuse.
    #[test]
    fn pickles_are_known_by_extension_in_any_case() {
        for p in [
            "pytorch_model.bin",
            "a.pt",
            "b.PTH",
            "MODEL.BIN",
            "x.ckpt",
            "y.pkl",
        ] {
            assert!(is_pickle(p), "{p}");
        }
        for ok in ["model.safetensors", "bin", "config.json", "a.binary"] {
            assert!(!is_pickle(ok), "{ok}");
        }
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("config.json"), "{}").unwrap();
        assert_eq!(find_pickle(d.path()), None);
        std::fs::write(d.path().join("MODEL.BIN"), "x").unwrap();
        assert_eq!(find_pickle(d.path()), Some(d.path().join("MODEL.BIN")));
    }
}
