//! `mole-worker import`: turns a GGUF model (llama.cpp's format, e.g. the real
//! SmolLM2-135M-Instruct) into an HF directory — dequantised safetensors with HF tensor names,
//! `config.json`, `tokenizer.json` rebuilt from the GGUF vocabulary and merges,
//! `tokenizer_config.json` with the chat template, and `generation_config.json` — so it can be
//! merged and served like any HF checkpoint.
//!
//! llama.cpp's converter permutes the rows of llama-arch Q and K projections (interleaved rotary
//! halves); they are permuted back here, as transformers' GGUF loader does.

pub mod cli;
mod tokenizer;

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file;
use candle_core::{DType, Device, Tensor};
use safetensors::tensor::View;

/// Why an import failed. Stable names via [`ImportError::code`].
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// Path.
        path: String,
        /// Cause.
        source: std::io::Error,
    },
    /// The GGUF file is malformed.
    #[error("invalid GGUF: {0}")]
    Gguf(String),
    /// A metadata key is missing or has the wrong type.
    #[error("GGUF metadata {key}: {message}")]
    Metadata {
        /// Key.
        key: String,
        /// Problem.
        message: String,
    },
    /// An architecture or tokenizer mole cannot import.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The output directory exists.
    #[error("{0} exists; refusing to overwrite it")]
    OutputExists(String),
}

impl ImportError {
    /// Stable name of the error.
    pub fn code(&self) -> &'static str {
        match self {
            ImportError::Io { .. } => "io_error",
            ImportError::Gguf(_) => "invalid_gguf",
            ImportError::Metadata { .. } => "invalid_gguf_metadata",
            ImportError::Unsupported(_) => "unsupported_model",
            ImportError::OutputExists(_) => "output_exists",
        }
    }
    /// Exit code: 1 for I/O, 2 for bad input.
    pub fn exit_code(&self) -> u8 {
        match self {
            ImportError::Io { .. } => 1,
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

/// Typed access to GGUF metadata.
pub(crate) struct Meta<'a>(pub &'a HashMap<String, gguf_file::Value>);

impl Meta<'_> {
    fn get(&self, key: &str) -> Result<&gguf_file::Value, ImportError> {
        self.0.get(key).ok_or_else(|| ImportError::Metadata {
            key: key.into(),
            message: "missing".into(),
        })
    }
    fn bad(key: &str, e: candle_core::Error) -> ImportError {
        ImportError::Metadata {
            key: key.into(),
            message: e.to_string(),
        }
    }
    pub fn u64(&self, key: &str) -> Result<u64, ImportError> {
        let v = self.get(key)?;
        v.to_u64()
            .or_else(|_| v.to_u32().map(u64::from))
            .or_else(|_| v.to_i32().map(|x| x as u64))
            .map_err(|e| Self::bad(key, e))
    }
    pub fn opt_u64(&self, key: &str) -> Option<u64> {
        self.0
            .contains_key(key)
            .then(|| self.u64(key).ok())
            .flatten()
    }
    pub fn f64(&self, key: &str) -> Result<f64, ImportError> {
        let v = self.get(key)?;
        // Through the shortest decimal of the f32, so 1e-5 stays 1e-5 in config.json.
        v.to_f32()
            .map(|x| x.to_string().parse::<f64>().unwrap_or(x as f64))
            .or_else(|_| v.to_f64())
            .map_err(|e| Self::bad(key, e))
    }
    pub fn string(&self, key: &str) -> Result<String, ImportError> {
        self.get(key)?
            .to_string()
            .cloned()
            .map_err(|e| Self::bad(key, e))
    }
    pub fn opt_string(&self, key: &str) -> Option<String> {
        self.0.get(key).and_then(|v| v.to_string().ok().cloned())
    }
    pub fn strings(&self, key: &str) -> Result<Vec<String>, ImportError> {
        self.get(key)?
            .to_vec()
            .map_err(|e| Self::bad(key, e))?
            .iter()
            .map(|v| v.to_string().cloned().map_err(|e| Self::bad(key, e)))
            .collect()
    }
    pub fn ints(&self, key: &str) -> Result<Vec<i64>, ImportError> {
        self.get(key)?
            .to_vec()
            .map_err(|e| Self::bad(key, e))?
            .iter()
            .map(|v| {
                v.to_i32()
                    .map(i64::from)
                    .or_else(|_| v.to_u32().map(i64::from))
                    .or_else(|_| v.to_i64())
                    .map_err(|e| Self::bad(key, e))
            })
            .collect()
    }
}

/// The architectures mole imports (all served by mole's one decoder).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Arch {
    Llama,
    Qwen2,
    Qwen3,
}

/// Decoder hyper-parameters read from GGUF metadata.
#[derive(Debug, Clone)]
struct Hparams {
    arch: Arch,
    layers: usize,
    hidden: usize,
    intermediate: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    rms_eps: f64,
    rope_theta: f64,
    /// HF `rope_scaling`, from llama.cpp's `{arch}.rope.scaling.*` keys.
    rope_scaling: Option<serde_json::Value>,
    context: usize,
    vocab: usize,
}

fn hparams(meta: &Meta, vocab: usize) -> Result<Hparams, ImportError> {
    let arch_name = meta.string("general.architecture")?;
    let arch = match arch_name.as_str() {
        "llama" => Arch::Llama,
        "qwen2" => Arch::Qwen2,
        "qwen3" => Arch::Qwen3,
        other => {
            return Err(ImportError::Unsupported(format!(
                "architecture {other} (mole imports llama, qwen2, qwen3)"
            )))
        }
    };
    let k = |s: &str| format!("{arch_name}.{s}");
    let hidden = meta.u64(&k("embedding_length"))? as usize;
    let heads = meta.u64(&k("attention.head_count"))? as usize;
    Ok(Hparams {
        arch,
        layers: meta.u64(&k("block_count"))? as usize,
        hidden,
        intermediate: meta.u64(&k("feed_forward_length"))? as usize,
        heads,
        kv_heads: meta
            .opt_u64(&k("attention.head_count_kv"))
            .unwrap_or(heads as u64) as usize,
        head_dim: meta
            .opt_u64(&k("attention.key_length"))
            .map(|x| x as usize)
            .unwrap_or(hidden / heads),
        rms_eps: meta.f64(&k("attention.layer_norm_rms_epsilon"))?,
        rope_theta: meta.f64(&k("rope.freq_base")).unwrap_or(10_000.0),
        rope_scaling: rope_scaling(meta, &arch_name)?,
        context: meta.opt_u64(&k("context_length")).unwrap_or(4096) as usize,
        vocab,
    })
}

/// HF name of a GGUF tensor, and whether its rows must be un-permuted (llama Q/K, with the
/// number of heads to use).
fn hf_name(gguf: &str, hp: &Hparams) -> Option<(String, Option<usize>)> {
    let direct = match gguf {
        "token_embd.weight" => Some("model.embed_tokens.weight".to_string()),
        "output_norm.weight" => Some("model.norm.weight".to_string()),
        "output.weight" => Some("lm_head.weight".to_string()),
        _ => None,
    };
    if let Some(d) = direct {
        return Some((d, None));
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (module, suffix) = rest.rsplit_once('.')?;
    let llama = hp.arch == Arch::Llama;
    let (hf, permute) = match module {
        "attn_q" => (
            "self_attn.q_proj",
            (llama && suffix == "weight").then_some(hp.heads),
        ),
        "attn_k" => (
            "self_attn.k_proj",
            (llama && suffix == "weight").then_some(hp.kv_heads),
        ),
        "attn_v" => ("self_attn.v_proj", None),
        "attn_output" => ("self_attn.o_proj", None),
        "attn_q_norm" => ("self_attn.q_norm", None),
        "attn_k_norm" => ("self_attn.k_norm", None),
        "ffn_gate" => ("mlp.gate_proj", None),
        "ffn_up" => ("mlp.up_proj", None),
        "ffn_down" => ("mlp.down_proj", None),
        "attn_norm" => ("input_layernorm", None),
        "ffn_norm" => ("post_attention_layernorm", None),
        _ => return None,
    };
    Some((format!("model.layers.{layer}.{hf}.{suffix}"), permute))
}

/// Inverse of llama.cpp's `permute`: rows were reordered from HF's [half0 | half1] per head to
/// interleaved pairs.
fn unpermute(t: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
    let (rows, cols) = t.dims2()?;
    t.reshape((heads, rows / heads / 2, 2, cols))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((rows, cols))
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
}

impl LazyGguf<'_> {
    fn compute(&self) -> Result<Vec<u8>, ImportError> {
        let gg = |e: candle_core::Error| ImportError::Gguf(format!("{}: {e}", self.name));
        let mut f = std::fs::File::open(self.path).map_err(io_err(self.path))?;
        let q = self
            .info
            .read(&mut f, self.content.tensor_data_offset, &Device::Cpu)
            .map_err(gg)?;
        let mut t = q.dequantize(&Device::Cpu).map_err(gg)?;
        if let Some(h) = self.permute_heads {
            t = unpermute(&t, h).map_err(gg)?;
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
        match self.compute() {
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
    let path = opts.gguf.as_path();
    let mut f = std::fs::File::open(path).map_err(io_err(path))?;
    let content = gguf_file::Content::read(&mut f).map_err(|e| ImportError::Gguf(e.to_string()))?;
    let meta = Meta(&content.metadata);
    let tok = tokenizer::build(&meta)?;
    let hp = hparams(&meta, tok.vocab_size)?;

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
    let result = write_all(opts, &content, &meta, &hp, &tok, &tmp).and_then(|report| {
        std::fs::rename(&tmp, &opts.out).map_err(io_err(&opts.out))?;
        Ok(report)
    });
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result
}

fn write_all(
    opts: &ImportOptions,
    content: &gguf_file::Content,
    meta: &Meta,
    hp: &Hparams,
    tok: &tokenizer::Built,
    dir: &Path,
) -> Result<ImportReport, ImportError> {
    let dtype = match opts.dtype {
        crate::merge::OutDtype::F32 => safetensors::Dtype::F32,
        crate::merge::OutDtype::Bf16 => safetensors::Dtype::BF16,
        crate::merge::OutDtype::F16 => safetensors::Dtype::F16,
    };
    let failure = std::cell::RefCell::new(None);
    let mut views = Vec::new();
    let mut params = 0u64;
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    for gname in names {
        let info = &content.tensor_infos[gname];
        let Some((hf, permute_heads)) = hf_name(gname, hp) else {
            if gname.contains("rope_freqs") {
                return Err(rope_freqs_refused(gname));
            }
            return Err(ImportError::Unsupported(format!("tensor {gname}")));
        };
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
            },
        ));
    }
    let tied = !content.tensor_infos.contains_key("output.weight");
    let n = views.len();
    let meta_map = HashMap::from([("format".to_string(), "pt".to_string())]);
    let dest = dir.join("model.safetensors");
    safetensors::serialize_to_file(views, Some(meta_map), &dest).map_err(|e| ImportError::Io {
        path: dest.display().to_string(),
        source: std::io::Error::other(e.to_string()),
    })?;
    if let Some(e) = failure.borrow_mut().take() {
        return Err(e);
    }

    let model_type = model_type(hp.arch);
    let config = config_json(hp, tok, meta, tied, opts.dtype.torch_name());
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

fn model_type(arch: Arch) -> &'static str {
    match arch {
        Arch::Llama => "llama",
        Arch::Qwen2 => "qwen2",
        Arch::Qwen3 => "qwen3",
    }
}

/// The HF `config.json` of a GGUF model.
fn config_json(
    hp: &Hparams,
    tok: &tokenizer::Built,
    meta: &Meta,
    tied: bool,
    torch_dtype: &str,
) -> serde_json::Value {
    let arch_class = match hp.arch {
        Arch::Llama => "LlamaForCausalLM",
        Arch::Qwen2 => "Qwen2ForCausalLM",
        Arch::Qwen3 => "Qwen3ForCausalLM",
    };
    let mut config = serde_json::json!({
        "architectures": [arch_class],
        "model_type": model_type(hp.arch),
        "hidden_size": hp.hidden,
        "intermediate_size": hp.intermediate,
        "num_hidden_layers": hp.layers,
        "num_attention_heads": hp.heads,
        "num_key_value_heads": hp.kv_heads,
        "head_dim": hp.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": hp.rms_eps,
        "rope_theta": hp.rope_theta,
        "max_position_embeddings": hp.context,
        "vocab_size": hp.vocab,
        "tie_word_embeddings": tied,
        "torch_dtype": torch_dtype,
        "bos_token_id": tok.bos_id,
        "eos_token_id": tok.eos_id,
        "pad_token_id": tok.pad_id,
        "attention_bias": hp.arch == Arch::Qwen2,
        "_name_or_path": meta.opt_string("general.name").unwrap_or_default(),
    });
    if hp.arch == Arch::Qwen2 {
        config["use_sliding_window"] = false.into();
    }
    if let Some(r) = &hp.rope_scaling {
        config["rope_scaling"] = r.clone();
    }
    config
}

/// llama.cpp's RoPE scaling keys as HF's `rope_scaling`: `linear` (or the older
/// `rope.scale_linear`) and `yarn`, whose llama.cpp `attn_factor` multiplies the
/// `0.1·ln(factor) + 1` attention scaling HF computes by default. Other types are refused by
/// name rather than served with the wrong positions.
fn rope_scaling(meta: &Meta, arch: &str) -> Result<Option<serde_json::Value>, ImportError> {
    let k = |s: &str| format!("{arch}.rope.{s}");
    let factor = || meta.f64(&k("scaling.factor"));
    let kind = meta.opt_string(&k("scaling.type"));
    match kind.as_deref() {
        None | Some("none") if meta.0.contains_key(&k("scale_linear")) => {
            let f = meta.f64(&k("scale_linear"))?;
            Ok((f != 1.0).then(|| serde_json::json!({"rope_type": "linear", "factor": f})))
        }
        None | Some("none") => Ok(None),
        Some("linear") => Ok(Some(
            serde_json::json!({"rope_type": "linear", "factor": factor()?}),
        )),
        Some("yarn") => {
            let f = factor()?;
            let mut r = serde_json::json!({"rope_type": "yarn", "factor": f});
            if let Some(orig) = meta.opt_u64(&k("scaling.original_context_length")) {
                r["original_max_position_embeddings"] = orig.into();
            }
            if meta.0.contains_key(&k("scaling.attn_factor")) {
                let a = meta.f64(&k("scaling.attn_factor"))?;
                if a != 1.0 {
                    r["attention_factor"] = (a * (0.1 * f.ln() + 1.0)).into();
                }
            }
            for (gguf, hf) in [
                ("scaling.yarn_beta_fast", "beta_fast"),
                ("scaling.yarn_beta_slow", "beta_slow"),
            ] {
                if meta.0.contains_key(&k(gguf)) {
                    r[hf] = meta.f64(&k(gguf))?.into();
                }
            }
            Ok(Some(r))
        }
        Some(other) => Err(ImportError::Unsupported(format!(
            "{}: RoPE scaling {other} (mole imports linear and yarn)",
            k("scaling.type")
        ))),
    }
}

/// Refusal for llama.cpp's `rope_freqs` tensor: per-frequency RoPE factors (how Llama 3.1
/// GGUFs carry llama3 scaling) that an HF `config.json` cannot express; skipping it would
/// serve every position with the wrong rotation.
fn rope_freqs_refused(name: &str) -> ImportError {
    ImportError::Unsupported(format!(
        "tensor {name}: per-frequency RoPE factors (llama3-style scaling) are not imported; \
         convert from the HF checkpoint, whose config.json keeps its rope_scaling"
    ))
}

/// A GGUF model ready to serve quantized: its HF `config.json`, its tokenizer files, and its
/// tensors under HF names with llama Q/K rows put back in HF order (a byte-level row
/// permutation: quantization blocks never span rows, so nothing is re-quantized).
pub struct QuantizedModel {
    /// HF `config.json`.
    pub config: serde_json::Value,
    /// `tokenizer.json` text.
    pub tokenizer_json: String,
    /// `tokenizer_config.json` (chat template, special tokens).
    pub tokenizer_config: serde_json::Value,
    /// Tensors by HF name.
    pub tensors: HashMap<String, candle_core::quantized::QTensor>,
}

/// Reads a GGUF file for quantized serving (see [`QuantizedModel`]).
pub fn load_quantized(path: &Path, device: &Device) -> Result<QuantizedModel, ImportError> {
    let mut f = std::fs::File::open(path).map_err(io_err(path))?;
    let content = gguf_file::Content::read(&mut f).map_err(|e| ImportError::Gguf(e.to_string()))?;
    let meta = Meta(&content.metadata);
    let tok = tokenizer::build(&meta)?;
    let hp = hparams(&meta, tok.vocab_size)?;
    let mut tensors = HashMap::new();
    for gname in content.tensor_infos.keys() {
        let Some((hf, permute_heads)) = hf_name(gname, &hp) else {
            if gname.contains("rope_freqs") {
                return Err(rope_freqs_refused(gname));
            }
            return Err(ImportError::Unsupported(format!("tensor {gname}")));
        };
        let gg = |e: candle_core::Error| ImportError::Gguf(format!("{gname}: {e}"));
        let mut q = content.tensor(&mut f, gname, device).map_err(gg)?;
        if let Some(heads) = permute_heads {
            q = unpermute_rows(&q, heads).map_err(gg)?;
        }
        tensors.insert(hf, q);
    }
    let tied = !content.tensor_infos.contains_key("output.weight");
    Ok(QuantizedModel {
        config: config_json(&hp, &tok, &meta, tied, "float32"),
        tokenizer_json: tok.tokenizer_json,
        tokenizer_config: tok.tokenizer_config,
        tensors,
    })
}

/// [`unpermute`] on quantized rows: HF row `h·d + a·d/2 + b` is GGUF row `h·d + 2b + a`.
fn unpermute_rows(
    q: &candle_core::quantized::QTensor,
    heads: usize,
) -> candle_core::Result<candle_core::quantized::QTensor> {
    let (rows, _) = q.shape().dims2()?;
    let data = q.data()?;
    let row_bytes = data.len() / rows;
    let (d, half) = (rows / heads, rows / heads / 2);
    let mut out = vec![0u8; data.len()];
    for h in 0..heads {
        for a in 0..2 {
            for b in 0..half {
                let dst = h * d + a * half + b;
                let src = h * d + 2 * b + a;
                out[dst * row_bytes..(dst + 1) * row_bytes]
                    .copy_from_slice(&data[src * row_bytes..(src + 1) * row_bytes]);
            }
        }
    }
    let storage = candle_core::quantized::QStorage::from_data(
        std::borrow::Cow::Owned(out),
        &q.device(),
        q.dtype(),
    )?;
    candle_core::quantized::QTensor::new(storage, q.shape().clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llama.cpp's scaling keys become the `rope_scaling` transformers reads, which mole's
    /// decoder accepts; unknown types are refused by name.
    #[test]
    fn rope_scaling_metadata_becomes_hf_rope_scaling() {
        use gguf_file::Value as V;
        let meta = |kv: Vec<(&str, V)>| -> HashMap<String, V> {
            kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
        };
        let none = meta(vec![]);
        assert_eq!(rope_scaling(&Meta(&none), "qwen2").unwrap(), None);
        let linear = meta(vec![
            ("llama.rope.scaling.type", V::String("linear".into())),
            ("llama.rope.scaling.factor", V::F32(4.0)),
        ]);
        assert_eq!(
            rope_scaling(&Meta(&linear), "llama").unwrap(),
            Some(serde_json::json!({"rope_type": "linear", "factor": 4.0}))
        );
        let old = meta(vec![("llama.rope.scale_linear", V::F32(2.0))]);
        assert_eq!(
            rope_scaling(&Meta(&old), "llama").unwrap(),
            Some(serde_json::json!({"rope_type": "linear", "factor": 2.0}))
        );
        let yarn = meta(vec![
            ("qwen2.rope.scaling.type", V::String("yarn".into())),
            ("qwen2.rope.scaling.factor", V::F32(4.0)),
            ("qwen2.rope.scaling.original_context_length", V::U32(32768)),
        ]);
        let r = rope_scaling(&Meta(&yarn), "qwen2").unwrap().unwrap();
        assert_eq!(
            r,
            serde_json::json!({"rope_type": "yarn", "factor": 4.0,
                               "original_max_position_embeddings": 32768})
        );
        // The decoder takes it: positions stretched from 32768 to 4 × 32768.
        let cfg = crate::model::ModelConfig::from_json(serde_json::json!({
            "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 1, "num_attention_heads": 4, "rms_norm_eps": 1e-6,
            "vocab_size": 16, "max_position_embeddings": 32768, "rope_scaling": r
        }))
        .unwrap();
        assert_eq!(cfg.max_positions(), 131072);
        let odd = meta(vec![
            ("llama.rope.scaling.type", V::String("longrope".into())),
            ("llama.rope.scaling.factor", V::F32(4.0)),
        ]);
        let e = rope_scaling(&Meta(&odd), "llama").unwrap_err();
        assert!(e.to_string().contains("longrope"), "{e}");
        assert!(rope_freqs_refused("rope_freqs.weight")
            .to_string()
            .contains("rope_freqs.weight"));
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        // llama.cpp: w.reshape(h, 2, d/h/2, c).swapaxes(1, 2).reshape(d, c)
        let (h, d, c) = (3usize, 12usize, 2usize);
        let hf: Vec<f32> = (0..d * c).map(|x| x as f32).collect();
        let t = Tensor::from_vec(hf.clone(), (d, c), &Device::Cpu).unwrap();
        let permuted = t
            .reshape((h, 2, d / h / 2, c))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
            .reshape((d, c))
            .unwrap();
        assert_ne!(
            permuted.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            hf
        );
        let back = unpermute(&permuted, h).unwrap();
        assert_eq!(back.flatten_all().unwrap().to_vec1::<f32>().unwrap(), hf);
    }
}
