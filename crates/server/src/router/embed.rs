//! Sentence embeddings for the embedding router: a BERT encoder (all-MiniLM-L6-v2 or any
//! sentence-transformers BERT) with mean pooling over the attention mask and L2
//! normalisation, as sentence-transformers computes them. Adapter descriptions and examples
//! are embedded once and cached; only the request text is encoded per request.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use candle_core::{DType, Device, Tensor};
use candle_transformers::models::bert::{BertModel, Config};
use tokenizers::{PaddingParams, PaddingStrategy, Tokenizer, TruncationParams};

/// Why the embedding model could not be loaded or run. Stable names via [`EmbedError::code`].
#[derive(Debug, thiserror::Error)]
pub enum EmbedError {
    /// Files missing or unreadable.
    #[error("embedding model {path}: {reason}")]
    Load {
        /// Directory.
        path: String,
        /// Why.
        reason: String,
    },
    /// The forward pass or tokenizer failed.
    #[error("embedding: {0}")]
    Run(String),
}

impl EmbedError {
    /// Stable name (metric label, JSON `code`).
    pub fn code(&self) -> &'static str {
        match self {
            EmbedError::Load { .. } => "embedding_model_invalid",
            EmbedError::Run(_) => "embedding_failed",
        }
    }
}

/// Longest text encoded, in tokens (MiniLM was trained on 128 and supports 512).
const MAX_TOKENS: usize = 256;
/// Cached texts at most: adapter descriptions and examples, not an unbounded request log.
const CACHE_LIMIT: usize = 4096;

/// A loaded sentence-embedding model.
pub struct SentenceEmbedder {
    model: BertModel,
    tokenizer: Tokenizer,
    device: Device,
    cache: Mutex<HashMap<String, Arc<Vec<f32>>>>,
}

impl std::fmt::Debug for SentenceEmbedder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SentenceEmbedder").finish_non_exhaustive()
    }
}

impl SentenceEmbedder {
    /// Loads `config.json`, `model.safetensors` and `tokenizer.json` from `dir` (CPU, f32: the
    /// model is small and runs once per routed request).
    pub fn load(dir: &Path) -> Result<Self, EmbedError> {
        let err = |reason: String| EmbedError::Load {
            path: dir.display().to_string(),
            reason,
        };
        let cfg: Config = serde_json::from_str(
            &std::fs::read_to_string(dir.join("config.json")).map_err(|e| err(e.to_string()))?,
        )
        .map_err(|e| err(format!("config.json: {e}")))?;
        let mut tokenizer =
            Tokenizer::from_file(dir.join("tokenizer.json")).map_err(|e| err(e.to_string()))?;
        // The shipped tokenizer pads every input to 128; pad to the longest in the batch
        // instead (pooling uses the mask, so padding never changes the result).
        tokenizer.with_padding(Some(PaddingParams {
            strategy: PaddingStrategy::BatchLongest,
            ..Default::default()
        }));
        tokenizer
            .with_truncation(Some(TruncationParams {
                max_length: MAX_TOKENS,
                ..Default::default()
            }))
            .map_err(|e| err(e.to_string()))?;
        let device = Device::Cpu;
        // Read tensor by tensor, as the engine loads its model (one copy of the weights).
        let files = [dir.join("model.safetensors")];
        let vb = mole_formats::safetensors::ReadTensors::var_builder(&files, DType::F32, &device)
            .map_err(|e| err(e.to_string()))?;
        let model = BertModel::load(vb, &cfg).map_err(|e| err(e.to_string()))?;
        Ok(Self {
            model,
            tokenizer,
            device,
            cache: Mutex::new(HashMap::new()),
        })
    }

    /// Embeds texts in one batch: unit vectors, so a dot product is the cosine similarity.
    pub fn encode(&self, texts: &[String]) -> Result<Vec<Vec<f32>>, EmbedError> {
        let run = |e: &dyn std::fmt::Display| EmbedError::Run(e.to_string());
        let enc = self
            .tokenizer
            .encode_batch(texts.to_vec(), true)
            .map_err(|e| run(&e))?;
        let rows = |f: &dyn Fn(&tokenizers::Encoding) -> Vec<u32>| -> Result<Tensor, EmbedError> {
            let v: Vec<Tensor> = enc
                .iter()
                .map(|e| Tensor::new(f(e), &self.device))
                .collect::<Result<_, _>>()
                .map_err(|e| run(&e))?;
            Tensor::stack(&v, 0).map_err(|e| run(&e))
        };
        let ids = rows(&|e| e.get_ids().to_vec())?;
        let types = rows(&|e| e.get_type_ids().to_vec())?;
        let mask = rows(&|e| e.get_attention_mask().to_vec())?;
        let pooled = (|| {
            let out = self.model.forward(&ids, &types, Some(&mask))?;
            let m = mask.to_dtype(DType::F32)?.unsqueeze(2)?;
            let sum = out.broadcast_mul(&m)?.sum(1)?;
            let count = m.sum(1)?.clamp(1e-9, f64::MAX)?;
            let mean = sum.broadcast_div(&count)?;
            let norm = mean.sqr()?.sum_keepdim(1)?.sqrt()?.clamp(1e-12, f64::MAX)?;
            mean.broadcast_div(&norm)?.to_vec2::<f32>()
        })()
        .map_err(|e: candle_core::Error| run(&e))?;
        Ok(pooled)
    }

    /// Like [`SentenceEmbedder::encode`], reusing cached vectors of texts seen before.
    pub fn encode_cached(&self, texts: &[String]) -> Result<Vec<Arc<Vec<f32>>>, EmbedError> {
        let missing: Vec<String> = {
            let c = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
            let mut m: Vec<String> = texts
                .iter()
                .filter(|t| !c.contains_key(*t))
                .cloned()
                .collect();
            m.sort();
            m.dedup();
            m
        };
        let fresh = if missing.is_empty() {
            Vec::new()
        } else {
            self.encode(&missing)?
        };
        let mut c = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        let mut extra: HashMap<&str, Arc<Vec<f32>>> = HashMap::new();
        for (t, v) in missing.iter().zip(fresh) {
            let v = Arc::new(v);
            if c.len() < CACHE_LIMIT {
                c.insert(t.clone(), v.clone());
            }
            extra.insert(t.as_str(), v);
        }
        Ok(texts
            .iter()
            .map(|t| {
                c.get(t)
                    .or_else(|| extra.get(t.as_str()))
                    .cloned()
                    .expect("every text embedded")
            })
            .collect())
    }
}
