//! Rebuilds an HF `tokenizer.json` (byte-level BPE) from GGUF tokenizer metadata.

use serde_json::{json, Value};

use super::{GgufError, Meta};

/// GGUF `tokenizer.ggml.token_type` values.
const TOKEN_CONTROL: i64 = 3;
const TOKEN_USER_DEFINED: i64 = 4;

/// Qwen2's pre-tokenizer split (llama.cpp `qwen2` pre-type, transformers' Qwen2 tokenizer).
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Llama 3's pre-tokenizer split (llama.cpp `llama-bpe`).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The rebuilt tokenizer files.
pub struct Built {
    /// `tokenizer.json`'s text.
    pub tokenizer_json: String,
    /// `tokenizer_config.json` (chat template, special tokens).
    pub tokenizer_config: Value,
    /// Tokens in the vocabulary.
    pub vocab_size: usize,
    /// Beginning-of-sequence token id.
    pub bos_id: Option<u64>,
    /// End-of-sequence token id.
    pub eos_id: Option<u64>,
    /// Padding token id.
    pub pad_id: Option<u64>,
}

fn byte_level(add_prefix_space: bool, use_regex: bool) -> Value {
    json!({"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": true, "use_regex": use_regex})
}

fn split_then_bytes(pattern: &str) -> Value {
    json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
        byte_level(false, false),
    ]})
}

/// Builds the tokenizer from GGUF metadata (`tokenizer.ggml.*`).
pub fn build(meta: &Meta) -> Result<Built, GgufError> {
    let model = meta.string("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(GgufError::Unsupported(format!(
            "tokenizer model {model} (mole rebuilds byte-level BPE, tokenizer.ggml.model = gpt2)"
        )));
    }
    let tokens = meta.strings("tokenizer.ggml.tokens")?;
    // A vocabulary without merges is a valid BPE; llama.cpp's gguf-py writes no key for an
    // empty list.
    let merges = match meta.0.get("tokenizer.ggml.merges") {
        Some(_) => meta.strings("tokenizer.ggml.merges")?,
        None => Vec::new(),
    };
    let types = meta
        .ints("tokenizer.ggml.token_type")
        .unwrap_or_else(|_| vec![1; tokens.len()]);
    let add_prefix = meta
        .0
        .get("tokenizer.ggml.add_space_prefix")
        .and_then(|v| v.to_bool().ok())
        .unwrap_or(false);
    let pre = meta
        .opt_string("tokenizer.ggml.pre")
        .unwrap_or_else(|| "default".into());
    let pre_tokenizer = match pre.as_str() {
        "default" | "gpt-2" | "gpt2" => byte_level(add_prefix, true),
        "smollm" => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true},
            byte_level(false, true),
        ]}),
        "qwen2" => split_then_bytes(QWEN2_SPLIT),
        "llama-bpe" | "llama3" => split_then_bytes(LLAMA3_SPLIT),
        other => {
            return Err(GgufError::Unsupported(format!(
                "tokenizer pre-type {other} (supported: default, gpt2, smollm, qwen2, llama-bpe)"
            )))
        }
    };
    let bos = meta.opt_u64("tokenizer.ggml.bos_token_id");
    let eos = meta.opt_u64("tokenizer.ggml.eos_token_id");
    let pad = meta.opt_u64("tokenizer.ggml.padding_token_id");
    let unk = meta.opt_u64("tokenizer.ggml.unknown_token_id");
    let add_bos = meta
        .0
        .get("tokenizer.ggml.add_bos_token")
        .and_then(|v| v.to_bool().ok())
        .unwrap_or(false);

    let vocab: serde_json::Map<String, Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect();
    let added: Vec<Value> = tokens
        .iter()
        .enumerate()
        .filter(|(i, _)| {
            let t = types.get(*i).copied().unwrap_or(1);
            t == TOKEN_CONTROL || t == TOKEN_USER_DEFINED
        })
        .map(|(i, t)| {
            json!({"id": i, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": types[i] != TOKEN_CONTROL, "special": types[i] == TOKEN_CONTROL})
        })
        .collect();
    let name = |id: Option<u64>| id.and_then(|i| tokens.get(i as usize).cloned());
    let post_processor = match (add_bos, name(bos)) {
        (true, Some(b)) => json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": b, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {b.clone(): {"id": b, "ids": [bos], "tokens": [b]}},
        }),
        _ => {
            json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true})
        }
    };
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": false, "vocab": vocab, "merges": merges,
        },
    });
    let mut config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": false,
        "add_bos_token": add_bos,
        "add_prefix_space": add_prefix,
        "model_max_length": 131072,
    });
    for (key, id) in [
        ("bos_token", bos),
        ("eos_token", eos),
        ("pad_token", pad),
        ("unk_token", unk),
    ] {
        if let Some(t) = name(id) {
            config[key] = json!(t);
        }
    }
    if let Some(t) = meta.opt_string("tokenizer.chat_template") {
        config["chat_template"] = json!(t);
    }
    Ok(Built {
        tokenizer_json: serde_json::to_string(&tokenizer).expect("json"),
        tokenizer_config: config,
        vocab_size: tokens.len(),
        bos_id: bos,
        eos_id: eos,
        pad_id: pad,
    })
}
