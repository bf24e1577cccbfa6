//! One engine per device behind [`Replicas`], on the committed tiny Llama
//! (tests/fixtures/engine): concurrent requests are spread over the engines, and an unload
//! reaches every engine.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test
#![allow(clippy::disallowed_methods)] // tests read results back from the device

use crate::common;

use mole_engine::ModelSource;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use candle_core::{DType, Device};
use common::{
    engine_fixtures as fixtures, engine_reference as reference, greedy, ids, tokens, wait_until,
};
use mole_engine::api::*;
use mole_engine::replicas::Replicas;
use mole_engine::{Engine, EngineOptions};

fn engine() -> Engine {
    let o = EngineOptions {
        base_name: "llama".into(),
        ..Default::default()
    };
    Engine::load(
        &ModelSource::hf(fixtures().join("llama"), DType::F32),
        &Device::Cpu,
        o,
    )
    .unwrap()
}

fn spec(name: &str) -> AdapterSpec {
    AdapterSpec {
        name: name.into(),
        version: "v1".into(),
        lora_id: 1,
        path: fixtures().join("adapters/llama/a_r8_all"),
    }
}

/// Holds the first two reads of the wrapped engine's stats, each taken, until both are taken
/// (or half a second passed): the interleaving of two requests routed at the same moment, both
/// reading the loads before either is sent, made deterministic. Everything else is the real
/// engine's.
struct Rendezvous {
    engine: Engine,
    readers: Mutex<usize>,
    met: Condvar,
}

impl EngineInfo for Rendezvous {
    fn stats(&self) -> EngineStats {
        let stats = self.engine.stats();
        let mut n = self.readers.lock().unwrap();
        *n += 1;
        if *n <= 2 {
            self.met.notify_all();
            let (_n, _) = self
                .met
                .wait_timeout_while(n, Duration::from_millis(500), |n| *n < 2)
                .unwrap();
        }
        stats
    }
    fn model_info(&self) -> ModelInfo {
        self.engine.model_info()
    }
}

impl Serving for Rendezvous {
    fn submit(&self, req: GenerateRequest) -> Result<EventStream, EngineError> {
        self.engine.submit(req)
    }
    fn score_labels(
        &self,
        adapter: Option<&str>,
        prompt: &str,
        labels: &[String],
        images: &[Image],
    ) -> Result<Vec<f32>, EngineError> {
        self.engine.score_labels(adapter, prompt, labels, images)
    }
}

impl AdapterAdmin for Rendezvous {
    fn load_adapter(&self, spec: AdapterSpec) -> Result<(), EngineError> {
        self.engine.load_adapter(spec)
    }
    fn unload_adapter(&self, name: &str) -> Result<(), EngineError> {
        self.engine.unload_adapter(name)
    }
    fn adapters(&self) -> Vec<mole_api::LoraAdapterInfo> {
        self.engine.adapters()
    }
}

/// Two requests routed at the same moment, both reading the engines' loads before either is
/// counted: they go to different engines (was: both read two idle engines and both went to
/// the first).
#[test]
fn requests_routed_at_once_go_to_different_engines() {
    let r = &reference()["llama"];
    let first = Rendezvous {
        engine: engine(),
        readers: Mutex::new(0),
        met: Condvar::new(),
    };
    let pod = Arc::new(Replicas::new(vec![Arc::new(first), Arc::new(engine())]));
    pod.load_adapter(spec("task")).unwrap();
    let routed: Vec<_> = (0..2)
        .map(|i| {
            let (pod, p) = (pod.clone(), ids(&r["prompts"][i]));
            std::thread::spawn(move || pod.submit(greedy(p, Some("task"), 8)).unwrap())
        })
        .collect();
    for (i, h) in routed.into_iter().enumerate() {
        let got = tokens(h.join().unwrap());
        assert_eq!(got, ids(&r["adapters"]["a_r8_all"]["greedy"][i])[..8]);
    }
    wait_until("both requests counted", || pod.adapters()[0].requests == 2);
    let per_engine: Vec<u64> = pod
        .engines()
        .iter()
        .map(|e| e.adapters()[0].requests)
        .collect();
    assert_eq!(per_engine, [1, 1], "one request per engine");
}

/// An unload reaches every engine, even past one that does not hold the adapter (was: it
/// stopped at the first engine's `adapter_not_found`, and the second kept serving it).
#[test]
fn an_unload_reaches_every_engine() {
    let r = &reference()["llama"];
    let pod = Replicas::new(vec![Arc::new(engine()), Arc::new(engine())]);
    pod.load_adapter(spec("task")).unwrap();
    pod.engines()[0].unload_adapter("task").unwrap();
    pod.unload_adapter("task").unwrap();
    for e in pod.engines() {
        assert!(e.adapters().is_empty(), "{:?}", e.adapters());
    }
    assert!(matches!(
        pod.submit(greedy(ids(&r["prompts"][0]), Some("task"), 1)),
        Err(EngineError::AdapterNotFound(_))
    ));
    assert!(matches!(
        pod.unload_adapter("task"),
        Err(EngineError::AdapterNotFound(_))
    ));
}
