//! Test-only engine: `EchoEngine` answers deterministically so the HTTP layer can be tested
//! without a model. It is NOT an inference engine; the lead swaps the end-to-end tests to the
//! real engine with a fixture model through `server::build_engine`.

#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use mole_crds::{LoraAdapterInfo, Residency};
use mole_worker::engine::api::*;
use tokio::sync::mpsc;

/// Echoes the prompt's whitespace-separated words (prefixed by `[adapter]`) one token each.
pub struct EchoEngine {
    /// Requests in flight (queue capacity check).
    pub in_flight: Arc<AtomicUsize>,
    /// Requests whose receiver was dropped before the end.
    pub cancelled: Arc<AtomicUsize>,
    /// Max in-flight before `Overloaded`.
    pub capacity: usize,
    /// Delay per token.
    pub delay: Duration,
    /// Loaded adapters: name -> version.
    pub adapters: Mutex<HashMap<String, String>>,
}

impl EchoEngine {
    /// A new engine.
    pub fn new(capacity: usize, delay: Duration) -> Arc<Self> {
        Arc::new(Self {
            in_flight: Arc::new(AtomicUsize::new(0)),
            cancelled: Arc::new(AtomicUsize::new(0)),
            capacity,
            delay,
            adapters: Mutex::new(HashMap::new()),
        })
    }
}

impl InferenceEngine for EchoEngine {
    fn submit(&self, req: GenerateRequest) -> Result<EventStream, EngineError> {
        if let Some(a) = &req.adapter {
            if !self.adapters.lock().unwrap().contains_key(a) {
                return Err(EngineError::AdapterNotFound(a.clone()));
            }
        }
        let n = self.in_flight.fetch_add(1, Ordering::SeqCst);
        if n >= self.capacity {
            self.in_flight.fetch_sub(1, Ordering::SeqCst);
            return Err(EngineError::Overloaded(n));
        }
        let text = match &req.prompt {
            Prompt::Text(t) => t.clone(),
            Prompt::Tokens(t) => t
                .iter()
                .map(|i| i.to_string())
                .collect::<Vec<_>>()
                .join(" "),
        };
        let mut words: Vec<String> = vec![format!("[{}]", req.adapter.clone().unwrap_or_default())];
        words.extend(text.split_whitespace().map(String::from));
        let (tx, rx) = mpsc::unbounded_channel();
        let (inf, canc, delay) = (self.in_flight.clone(), self.cancelled.clone(), self.delay);
        let version = req
            .adapter
            .as_ref()
            .map(|a| self.adapters.lock().unwrap()[a].clone());
        let prompt_tokens = words.len() - 1;
        tokio::spawn(async move {
            let _ = tx.send(TokenEvent::Started {
                adapter_version: version,
                prompt_tokens,
            });
            let max = req.sampling.max_tokens;
            let mut n = 0;
            for (i, w) in words.iter().take(max).enumerate() {
                tokio::time::sleep(delay).await;
                let t = if i == 0 { w.clone() } else { format!(" {w}") };
                if tx
                    .send(TokenEvent::Token {
                        token_id: i as u32,
                        text: t,
                        logprob: None,
                    })
                    .is_err()
                {
                    canc.fetch_add(1, Ordering::SeqCst);
                    inf.fetch_sub(1, Ordering::SeqCst);
                    return;
                }
                n += 1;
            }
            let reason = if words.len() > max {
                FinishReason::Length
            } else {
                FinishReason::Stop
            };
            let _ = tx.send(TokenEvent::Finished {
                reason,
                usage: Usage {
                    prompt_tokens,
                    completion_tokens: n,
                },
            });
            inf.fetch_sub(1, Ordering::SeqCst);
        });
        Ok(rx)
    }
    fn apply_chat_template(&self, messages: &[ChatMessage]) -> Result<String, EngineError> {
        Ok(messages
            .iter()
            .map(|m| m.content.as_str())
            .collect::<Vec<_>>()
            .join(" "))
    }
    fn count_tokens(&self, text: &str) -> Result<usize, EngineError> {
        Ok(text.split_whitespace().count())
    }
    fn score_labels(
        &self,
        _: Option<&str>,
        prompt: &str,
        labels: &[String],
    ) -> Result<Vec<f32>, EngineError> {
        // Probability mass on labels that occur in the prompt.
        let hits: Vec<f32> = labels
            .iter()
            .map(|l| {
                if prompt.contains(l.as_str()) {
                    1.0
                } else {
                    0.0
                }
            })
            .collect();
        let s: f32 = hits.iter().sum();
        Ok(if s == 0.0 {
            vec![1.0 / labels.len() as f32; labels.len()]
        } else {
            hits.iter().map(|h| h / s).collect()
        })
    }
    fn load_adapter(&self, spec: AdapterSpec) -> Result<(), EngineError> {
        if !spec.path.join("adapter_config.json").is_file() {
            return Err(EngineError::InvalidAdapter {
                name: spec.name,
                reason: "no adapter_config.json".into(),
            });
        }
        self.adapters
            .lock()
            .unwrap()
            .insert(spec.name, spec.version);
        Ok(())
    }
    fn unload_adapter(&self, name: &str) -> Result<(), EngineError> {
        self.adapters
            .lock()
            .unwrap()
            .remove(name)
            .map(|_| ())
            .ok_or_else(|| EngineError::AdapterNotFound(name.into()))
    }
    fn adapters(&self) -> Vec<LoraAdapterInfo> {
        let mut v: Vec<_> = self
            .adapters
            .lock()
            .unwrap()
            .iter()
            .map(|(n, ver)| LoraAdapterInfo {
                name: n.clone(),
                version: ver.clone(),
                lora_id: 0,
                residency: Residency::Gpu,
                loaded: true,
                rank: 8,
                bytes: 0,
                requests: 0,
                running: 0,
                error: None,
            })
            .collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }
    fn stats(&self) -> EngineStats {
        EngineStats {
            running: self.in_flight.load(Ordering::SeqCst),
            max_loras: 4,
            running_adapters: vec!["fr".into()],
            ..Default::default()
        }
    }
    fn model_info(&self) -> ModelInfo {
        ModelInfo {
            name: "echo".into(),
            max_seq_len: 512,
            vocab_size: 1000,
        }
    }
}
