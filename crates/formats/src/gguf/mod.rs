//! GGUF (llama.cpp's format): metadata read as an HF `config.json` and tokenizer, tensor names
//! mapped to HF names, and models loaded for quantized serving. `mole-worker import` writes the
//! same reading out as an HF directory.
//!
//! llama.cpp's converter permutes the rows of llama-arch Q and K projections (interleaved rotary
//! halves); they are permuted back here, as transformers' GGUF loader does.

pub mod tokenizer;
pub mod writer;

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};

/// Why a GGUF file cannot be read. Stable names via [`GgufError::code`].
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// A file could not be read.
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
    /// An architecture or tokenizer mole cannot read.
    #[error("unsupported: {0}")]
    Unsupported(String),
}

impl GgufError {
    /// Stable name of the error.
    pub fn code(&self) -> &'static str {
        match self {
            GgufError::Io { .. } => "io_error",
            GgufError::Gguf(_) => "invalid_gguf",
            GgufError::Metadata { .. } => "invalid_gguf_metadata",
            GgufError::Unsupported(_) => "unsupported_model",
        }
    }
}

/// Maps an I/O error on `path` to [`GgufError::Io`] naming the file.
pub fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> GgufError + '_ {
    move |source| GgufError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// A GGUF file's metadata read once: its tokenizer and its decoder's hyper-parameters.
pub struct Opened {
    /// The file's directory of tensors and metadata.
    pub content: gguf_file::Content,
    /// The tokenizer rebuilt from the vocabulary and merges.
    pub tok: tokenizer::Built,
    /// The decoder's shape.
    pub hp: Hparams,
}

impl Opened {
    /// Reads the metadata of `path` (not the tensors).
    pub fn read(path: &Path) -> Result<(Self, std::fs::File), GgufError> {
        let mut f = std::fs::File::open(path).map_err(io_err(path))?;
        let content =
            gguf_file::Content::read(&mut f).map_err(|e| GgufError::Gguf(e.to_string()))?;
        let meta = Meta(&content.metadata);
        let tok = tokenizer::build(&meta)?;
        let hp = hparams(&meta, tok.vocab_size)?;
        Ok((Self { content, tok, hp }, f))
    }

    /// The metadata.
    pub fn meta(&self) -> Meta<'_> {
        Meta(&self.content.metadata)
    }

    /// The HF `config.json` of the model, with `torch_dtype` as given and the output head tied
    /// when the file has none.
    pub fn config_json(&self, torch_dtype: &str) -> serde_json::Value {
        let tied = !self.content.tensor_infos.contains_key("output.weight");
        config_json(&self.hp, &self.tok, &self.meta(), tied, torch_dtype)
    }

    /// The HF name of a tensor and the heads to un-permute its rows by (llama Q/K); a refusal
    /// naming the tensor when mole does not know it.
    pub fn hf_name(&self, gguf: &str) -> Result<(String, Option<usize>), GgufError> {
        hf_name(gguf, &self.hp).ok_or_else(|| {
            if gguf.contains("rope_freqs") {
                rope_freqs_refused(gguf)
            } else {
                GgufError::Unsupported(format!("tensor {gguf}"))
            }
        })
    }
}

/// Typed access to GGUF metadata.
pub struct Meta<'a>(pub &'a HashMap<String, gguf_file::Value>);

impl Meta<'_> {
    fn get(&self, key: &str) -> Result<&gguf_file::Value, GgufError> {
        self.0.get(key).ok_or_else(|| GgufError::Metadata {
            key: key.into(),
            message: "missing".into(),
        })
    }
    fn bad(key: &str, e: candle_core::Error) -> GgufError {
        GgufError::Metadata {
            key: key.into(),
            message: e.to_string(),
        }
    }
    /// An unsigned integer (any of GGUF's integer widths).
    pub fn u64(&self, key: &str) -> Result<u64, GgufError> {
        let v = self.get(key)?;
        v.to_u64()
            .or_else(|_| v.to_u32().map(u64::from))
            .or_else(|_| v.to_i32().map(|x| x as u64))
            .map_err(|e| Self::bad(key, e))
    }
    /// An unsigned integer if the key is there and readable as one.
    pub fn opt_u64(&self, key: &str) -> Option<u64> {
        self.0
            .contains_key(key)
            .then(|| self.u64(key).ok())
            .flatten()
    }
    /// A float, through the shortest decimal of an f32 value.
    pub fn f64(&self, key: &str) -> Result<f64, GgufError> {
        let v = self.get(key)?;
        // Through the shortest decimal of the f32, so 1e-5 stays 1e-5 in config.json.
        v.to_f32()
            .map(|x| x.to_string().parse::<f64>().unwrap_or(x as f64))
            .or_else(|_| v.to_f64())
            .map_err(|e| Self::bad(key, e))
    }
    /// A string.
    pub fn string(&self, key: &str) -> Result<String, GgufError> {
        self.get(key)?
            .to_string()
            .cloned()
            .map_err(|e| Self::bad(key, e))
    }
    /// A string if the key is there and one.
    pub fn opt_string(&self, key: &str) -> Option<String> {
        self.0.get(key).and_then(|v| v.to_string().ok().cloned())
    }
    /// An array of strings.
    pub fn strings(&self, key: &str) -> Result<Vec<String>, GgufError> {
        self.get(key)?
            .to_vec()
            .map_err(|e| Self::bad(key, e))?
            .iter()
            .map(|v| v.to_string().cloned().map_err(|e| Self::bad(key, e)))
            .collect()
    }
    /// An array of integers (i32, u32 or i64 elements).
    pub fn ints(&self, key: &str) -> Result<Vec<i64>, GgufError> {
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
pub enum Arch {
    /// llama.cpp's `llama` (Llama, SmolLM, Mistral).
    Llama,
    /// `qwen2`.
    Qwen2,
    /// `qwen3` (q/k norms).
    Qwen3,
}

/// Decoder hyper-parameters read from GGUF metadata.
#[derive(Debug, Clone)]
pub struct Hparams {
    /// The architecture.
    pub arch: Arch,
    /// Decoder layers (`{arch}.block_count`).
    pub layers: usize,
    /// Hidden size (`{arch}.embedding_length`).
    pub hidden: usize,
    /// MLP width (`{arch}.feed_forward_length`).
    pub intermediate: usize,
    /// Attention heads.
    pub heads: usize,
    /// Key/value heads (grouped-query attention).
    pub kv_heads: usize,
    /// One head's width.
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_eps: f64,
    /// RoPE base frequency.
    pub rope_theta: f64,
    /// HF `rope_scaling`, from llama.cpp's `{arch}.rope.scaling.*` keys.
    pub rope_scaling: Option<serde_json::Value>,
    /// Context length the model was trained to.
    pub context: usize,
    /// Vocabulary size (the token embedding's rows).
    pub vocab: usize,
}

fn hparams(meta: &Meta, vocab: usize) -> Result<Hparams, GgufError> {
    let arch_name = meta.string("general.architecture")?;
    let arch = match arch_name.as_str() {
        "llama" => Arch::Llama,
        "qwen2" => Arch::Qwen2,
        "qwen3" => Arch::Qwen3,
        other => {
            return Err(GgufError::Unsupported(format!(
                "architecture {other} (mole imports llama, qwen2, qwen3)"
            )))
        }
    };
    let k = |s: &str| format!("{arch_name}.{s}");
    let hidden = meta.u64(&k("embedding_length"))? as usize;
    let heads = meta.u64(&k("attention.head_count"))? as usize;
    let kv_heads = meta
        .opt_u64(&k("attention.head_count_kv"))
        .unwrap_or(heads as u64) as usize;
    // Shapes are divided by these: a file that says zero (or heads that do not group) is
    // refused here rather than dividing by zero later.
    let bad = |key: &str, message: String| GgufError::Metadata {
        key: k(key),
        message,
    };
    if heads == 0 {
        return Err(bad("attention.head_count", "zero heads".into()));
    }
    if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
        return Err(bad(
            "attention.head_count_kv",
            format!("{kv_heads} KV heads do not divide {heads} heads"),
        ));
    }
    let head_dim = meta
        .opt_u64(&k("attention.key_length"))
        .map_or(hidden / heads, |x| x as usize);
    if head_dim == 0 || !head_dim.is_multiple_of(2) {
        return Err(bad(
            "attention.key_length",
            format!("head dimension {head_dim} is not a positive even number"),
        ));
    }
    Ok(Hparams {
        arch,
        layers: meta.u64(&k("block_count"))? as usize,
        hidden,
        intermediate: meta.u64(&k("feed_forward_length"))? as usize,
        heads,
        kv_heads,
        head_dim,
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
pub fn unpermute(t: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
    let (rows, cols) = t.dims2()?;
    t.reshape((heads, rows / heads / 2, 2, cols))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((rows, cols))
}

/// HF `config.json`'s `model_type` of an architecture.
pub fn model_type(arch: Arch) -> &'static str {
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
fn rope_scaling(meta: &Meta, arch: &str) -> Result<Option<serde_json::Value>, GgufError> {
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
        Some(other) => Err(GgufError::Unsupported(format!(
            "{}: RoPE scaling {other} (mole imports linear and yarn)",
            k("scaling.type")
        ))),
    }
}

/// Refusal for llama.cpp's `rope_freqs` tensor: per-frequency RoPE factors (how Llama 3.1
/// GGUFs carry llama3 scaling) that an HF `config.json` cannot express; skipping it would
/// serve every position with the wrong rotation.
fn rope_freqs_refused(name: &str) -> GgufError {
    GgufError::Unsupported(format!(
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
pub fn load_quantized(path: &Path, device: &Device) -> Result<QuantizedModel, GgufError> {
    let (gguf, mut f) = Opened::read(path)?;
    let mut tensors = HashMap::new();
    for (gname, info) in &gguf.content.tensor_infos {
        check_size(gname, info)?;
        let (hf, permute_heads) = gguf.hf_name(gname)?;
        let gg = |e: candle_core::Error| GgufError::Gguf(format!("{gname}: {e}"));
        let mut q = gguf.content.tensor(&mut f, gname, device).map_err(gg)?;
        if let Some(heads) = permute_heads {
            q = unpermute_rows(&q, heads).map_err(gg)?;
        }
        tensors.insert(hf, q);
    }
    let config = gguf.config_json("float32");
    Ok(QuantizedModel {
        config,
        tokenizer_json: gguf.tok.tokenizer_json,
        tokenizer_config: gguf.tok.tokenizer_config,
        tensors,
    })
}

/// The file of a model quantized by `mole-worker quantize`: an HF directory (config.json,
/// tokenizer files) whose weights are this one GGUF file, its tensors under their HF names.
pub const QUANTIZED_FILE: &str = "model.gguf";

/// Whether `dir` is a directory quantized by `mole-worker quantize` (it holds
/// [`QUANTIZED_FILE`] and no safetensors weights).
pub fn is_quantized_dir(dir: &Path) -> bool {
    dir.join(QUANTIZED_FILE).is_file()
        && !dir.join("model.safetensors").exists()
        && !dir.join("model.safetensors.index.json").exists()
}

/// Reads every tensor of a GGUF file written with HF names (see [`QUANTIZED_FILE`]) as is:
/// no renaming, no row permutation.
pub fn load_hf_named(
    path: &Path,
    device: &Device,
) -> Result<HashMap<String, candle_core::quantized::QTensor>, GgufError> {
    let mut f = std::fs::File::open(path).map_err(io_err(path))?;
    let content = gguf_file::Content::read(&mut f).map_err(|e| GgufError::Gguf(e.to_string()))?;
    let mut tensors = HashMap::new();
    for (name, info) in &content.tensor_infos {
        check_size(name, info)?;
        let q = content
            .tensor(&mut f, name, device)
            .map_err(|e| GgufError::Gguf(format!("{name}: {e}")))?;
        tensors.insert(name.clone(), q);
    }
    Ok(tensors)
}

/// The reader multiplies the dimensions, then the blocks by their bytes: a file's are checked
/// first (no overflow).
fn check_size(name: &str, info: &gguf_file::TensorInfo) -> Result<(), GgufError> {
    let bytes = info
        .shape
        .dims()
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .and_then(|n| (n / info.ggml_dtype.block_size()).checked_mul(info.ggml_dtype.type_size()));
    match bytes {
        Some(_) => Ok(()),
        None => Err(GgufError::Gguf(format!("{name}: its shape overflows"))),
    }
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
