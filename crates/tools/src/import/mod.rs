//! `mole-worker import`: turns a GGUF model (llama.cpp's format, e.g. the real
//! SmolLM2-135M-Instruct) into an HF directory — dequantised safetensors with HF tensor names,
//! `config.json`, `tokenizer.json` rebuilt from the GGUF vocabulary and merges,
//! `tokenizer_config.json` with the chat template, and `generation_config.json` — so it can be
//! merged and served like any HF checkpoint. The reading itself is [`mole_formats::gguf`].

pub mod cli;

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file;
use candle_core::{DType, Device};
use safetensors::tensor::View;

use mole_formats::gguf::{self, GgufError, Opened};

/// Why an import failed. Stable names via [`ImportError::code`].
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    /// The output could not be written.
    #[error("{path}: {source}")]
    Io {
        /// Path.
        path: String,
        /// Cause.
        source: std::io::Error,
    },
    /// The GGUF file cannot be read.
    #[error(transparent)]
    Read(#[from] GgufError),
    /// The output directory exists.
    #[error("{0} exists; refusing to overwrite it")]
    OutputExists(String),
}

impl ImportError {
    /// Stable name of the error.
    pub fn code(&self) -> &'static str {
        match self {
            ImportError::Io { .. } => "io_error",
            ImportError::Read(e) => e.code(),
            ImportError::OutputExists(_) => "output_exists",
        }
    }
    /// Exit code: 1 for I/O, 2 for bad input.
    pub fn exit_code(&self) -> u8 {
        match self {
            ImportError::Io { .. } | ImportError::Read(GgufError::Io { .. }) => 1,
            _ => 2,
        }
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ImportError + '_ {
    move |source| ImportError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Options of [`import`].
#[derive(Debug, Clone)]
pub struct ImportOptions {
    /// GGUF file.
    pub gguf: PathBuf,
    /// Output directory (must not exist).
    pub out: PathBuf,
    /// Output dtype of the dequantised weights.
    pub dtype: crate::merge::OutDtype,
}

/// What [`import`] wrote.
#[derive(Debug, Clone)]
pub struct ImportReport {
    /// Architecture name.
    pub arch: String,
    /// Tensors written.
    pub tensors: usize,
    /// Parameters written.
    pub params: u64,
    /// Vocabulary size of the rebuilt tokenizer.
    pub vocab: usize,
}

/// A tensor dequantised when the writer asks for its bytes (one at a time: bounded memory).
struct LazyGguf<'a> {
    name: String,
    info: &'a gguf_file::TensorInfo,
    content: &'a gguf_file::Content,
    path: &'a Path,
    permute_heads: Option<usize>,
    shape: Vec<usize>,
    dtype: safetensors::Dtype,
    failure: &'a std::cell::RefCell<Option<ImportError>>,
    progress: &'a crate::progress::Progress,
}

impl LazyGguf<'_> {
    fn compute(&self) -> Result<Vec<u8>, ImportError> {
        let gg = |e: candle_core::Error| GgufError::Gguf(format!("{}: {e}", self.name));
        let mut f = std::fs::File::open(self.path).map_err(gguf::io_err(self.path))?;
        let q = self
            .info
            .read(&mut f, self.content.tensor_data_offset, &Device::Cpu)
            .map_err(gg)?;
        let mut t = q.dequantize(&Device::Cpu).map_err(gg)?;
        if let Some(h) = self.permute_heads {
            t = gguf::unpermute(&t, h).map_err(gg)?;
        }
        let t = match self.dtype {
            safetensors::Dtype::BF16 => t.to_dtype(DType::BF16),
            safetensors::Dtype::F16 => t.to_dtype(DType::F16),
            _ => t.to_dtype(DType::F32),
        }
        .map_err(gg)?;
        let t = t.flatten_all().map_err(gg)?;
        Ok(match t.dtype() {
            DType::BF16 => t
                .to_vec1::<half::bf16>()
                .map_err(gg)?
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
            DType::F16 => t
                .to_vec1::<half::f16>()
                .map_err(gg)?
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
            _ => t
                .to_vec1::<f32>()
                .map_err(gg)?
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
        })
    }
}

impl View for LazyGguf<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        let computed = self.compute();
        self.progress.inc(1);
        match computed {
            Ok(b) => Cow::Owned(b),
            Err(e) => {
                let mut slot = self.failure.borrow_mut();
                if slot.is_none() {
                    *slot = Some(e);
                }
                Cow::Owned(vec![0; self.data_len()])
            }
        }
    }
    fn data_len(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.bitsize() / 8
    }
}

/// Converts a GGUF file into an HF directory.
pub fn import(opts: &ImportOptions) -> Result<ImportReport, ImportError> {
    if opts.out.exists() {
        return Err(ImportError::OutputExists(opts.out.display().to_string()));
    }
    let (gguf, _) = Opened::read(&opts.gguf)?;

    let parent = opts
        .out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(io_err(parent))?;
    let name = opts
        .out
        .file_name()
        .unwrap_or_default()
        .to_string_lossy()
        .to_string();
    let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(io_err(&tmp))?;
    let result = write_all(opts, &gguf, &tmp).and_then(|report| {
        std::fs::rename(&tmp, &opts.out).map_err(io_err(&opts.out))?;
        Ok(report)
    });
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result
}

fn write_all(opts: &ImportOptions, gguf: &Opened, dir: &Path) -> Result<ImportReport, ImportError> {
    let (content, hp, tok) = (&gguf.content, &gguf.hp, &gguf.tok);
    let dtype = match opts.dtype {
        crate::merge::OutDtype::F32 => safetensors::Dtype::F32,
        crate::merge::OutDtype::Bf16 => safetensors::Dtype::BF16,
        crate::merge::OutDtype::F16 => safetensors::Dtype::F16,
    };
    let failure = std::cell::RefCell::new(None);
    let progress =
        crate::progress::Progress::new("import", "tensors", content.tensor_infos.len() as u64);
    let mut views = Vec::new();
    let mut params = 0u64;
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    for gname in names {
        let info = &content.tensor_infos[gname];
        let (hf, permute_heads) = gguf.hf_name(gname)?;
        let shape = info.shape.dims().to_vec();
        params += shape.iter().product::<usize>() as u64;
        views.push((
            hf.clone(),
            LazyGguf {
                name: gname.clone(),
                info,
                content,
                path: &opts.gguf,
                permute_heads,
                shape,
                dtype,
                failure: &failure,
                progress: &progress,
            },
        ));
    }
    let n = views.len();
    let meta_map = HashMap::from([("format".to_string(), "pt".to_string())]);
    let dest = dir.join("model.safetensors");
    safetensors::serialize_to_file(views, Some(meta_map), &dest).map_err(|e| ImportError::Io {
        path: dest.display().to_string(),
        source: std::io::Error::other(e.to_string()),
    })?;
    // safetensors writes through a private temporary file (0600): readable by this user only,
    // where a model directory is read by every pod that mounts it (the pods' user is not the
    // importer). The weights are not secret; the config files beside them are 0644 too.
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dest, std::fs::Permissions::from_mode(0o644))
            .map_err(io_err(&dest))?;
    }
    progress.finish();
    if let Some(e) = failure.borrow_mut().take() {
        return Err(e);
    }

    let model_type = gguf::model_type(hp.arch);
    let config = gguf.config_json(opts.dtype.torch_name());
    write_json(&dir.join("config.json"), &config)?;
    write_json(
        &dir.join("generation_config.json"),
        &serde_json::json!({
            "bos_token_id": tok.bos_id,
            "eos_token_id": tok.eos_id,
            "pad_token_id": tok.pad_id,
        }),
    )?;
    let tj = dir.join("tokenizer.json");
    std::fs::write(&tj, &tok.tokenizer_json).map_err(io_err(&tj))?;
    write_json(&dir.join("tokenizer_config.json"), &tok.tokenizer_config)?;
    Ok(ImportReport {
        arch: model_type.into(),
        tensors: n,
        params,
        vocab: hp.vocab,
    })
}

fn write_json(path: &Path, v: &serde_json::Value) -> Result<(), ImportError> {
    std::fs::write(path, serde_json::to_string_pretty(v).expect("json")).map_err(io_err(path))
}
