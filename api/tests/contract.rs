//! The contract's wire format: flat limits with one set of defaults, unknown fields refused on
//! the worker's side, the shared bounds, and a content hash both sides agree on.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test

use mole_api::{
    bounds, EngineLimits, RouterSpec, RouterStrategy, WorkerAdapter, WorkerConfig, WorkerLimits,
};

fn config(limits: &str) -> Result<WorkerConfig, serde_yaml::Error> {
    serde_yaml::from_str(&format!(
        "pool: p\nbaseModel: {{name: b, path: base}}\nlimits: {limits}\n"
    ))
}

#[test]
fn limits_are_one_flat_object_with_one_set_of_defaults() {
    let c = config("{maxLoras: 4, maxTokens: 7}").unwrap();
    assert_eq!(c.limits.engine.max_loras, 4);
    assert_eq!(c.limits.max_tokens, 7);
    assert_eq!(
        c.limits.engine.max_seq_len,
        EngineLimits::default().max_seq_len
    );
    assert_eq!(config("{}").unwrap().limits, WorkerLimits::default());
    assert_eq!(WorkerLimits::default().engine, EngineLimits::default());
    // Flat on the wire, in the field order the hash was always computed over.
    let json = serde_json::to_string(&WorkerLimits::default()).unwrap();
    assert_eq!(
        json,
        r#"{"maxLoras":8,"maxCpuLoras":32,"maxLoraRank":64,"maxBatchSize":16,"maxSeqLen":4096,"maxQueue":256,"gpuMemoryUtilization":0.9,"maxTokens":2048,"maxBodyBytes":16777216,"requestTimeoutSeconds":300,"maxImageBytes":16777216,"maxImagePixels":40000000,"maxImages":8}"#
    );
    let back: WorkerLimits = serde_json::from_str(&json).unwrap();
    assert_eq!(back, WorkerLimits::default());
}

#[test]
fn the_worker_refuses_unknown_fields() {
    assert!(config("{maxLoras: 4, maxLoraz: 5}").is_err());
    assert!(serde_yaml::from_str::<WorkerConfig>(
        "pool: p\nbaseModel: {name: b, path: base}\nrouter: {stratgies: [explicit]}\n"
    )
    .is_err());
}

#[test]
fn bounds_are_checked_once_for_both_sides() {
    assert_eq!(EngineLimits::default().validate(), Ok(()));
    assert_eq!(WorkerLimits::default().validate(), Ok(()));
    assert_eq!(RouterSpec::default().validate(), Ok(()));
    let g = EngineLimits {
        gpu_memory_utilization: 1.5,
        ..Default::default()
    };
    assert_eq!(
        g.validate().unwrap_err().field,
        "gpuMemoryUtilization",
        "a share above the device's memory is refused"
    );
    let l = EngineLimits {
        max_loras: bounds::MAX_LORAS.max + 1,
        ..EngineLimits::default()
    };
    let e = l.validate().unwrap_err();
    assert_eq!(e.field, "maxLoras");
    assert_eq!(e.to_string(), "maxLoras must be within [1, 1024], not 1025");
    let mut w = WorkerLimits::with_engine(EngineLimits {
        max_seq_len: 1024,
        ..EngineLimits::default()
    });
    // Rendered from a pool with a short maxSeqLen: maxTokens follows it.
    assert_eq!((w.max_tokens, w.validate()), (1024, Ok(())));
    w.max_tokens = 2048;
    assert_eq!(w.validate().unwrap_err().field, "maxTokens");
    w.max_tokens = 0;
    assert_eq!(
        w.validate().unwrap_err().to_string(),
        "maxTokens must be > 0"
    );
    let r = RouterSpec {
        min_confidence: f64::NAN,
        ..RouterSpec::default()
    };
    assert_eq!(r.validate().unwrap_err().field, "minConfidence");
}

#[test]
fn the_schema_carries_the_bounds_and_the_router_rules() {
    let limits = serde_json::to_value(schemars::schema_for!(EngineLimits)).unwrap();
    let seq = &limits["properties"]["maxSeqLen"];
    assert_eq!(seq["minimum"], bounds::MAX_SEQ_LEN.min);
    assert_eq!(seq["maximum"], bounds::MAX_SEQ_LEN.max);
    let router = serde_json::to_value(schemars::schema_for!(RouterSpec)).unwrap();
    assert_eq!(
        router["x-kubernetes-validations"].as_array().unwrap().len(),
        2
    );
    assert_eq!(
        router["properties"]["strategies"]["x-kubernetes-validations"][0]["rule"],
        "self.all(s, self.exists_one(t, t == s))"
    );
    assert_eq!(
        RouterSpec::default().strategies,
        [RouterStrategy::Explicit, RouterStrategy::Keywords]
    );
}

#[test]
fn the_content_hash_is_stable() {
    let c = config("{maxLoras: 4}").unwrap();
    assert_eq!(c.content_hash(), c.clone().content_hash());
    let mut d = c.clone();
    d.limits.engine.max_loras = 5;
    assert_ne!(c.content_hash(), d.content_hash());
}

/// An adapter's routing signals sit flat in the adapter, in the field order the hash was
/// always computed over (an operator and a worker of other versions must agree on it), and an
/// unknown field beside them is refused.
#[test]
fn routing_signals_are_flat_in_the_adapter_in_the_hashed_order() {
    let yaml = "name: a\nversion: v1\nloraId: 3\npath: p\nlabel: l\ndescription: d\n\
                examples: [e]\ndomains: [o]\nkeywords: [k]\nextensions: [.x]\n";
    let a: WorkerAdapter = serde_yaml::from_str(yaml).unwrap();
    assert_eq!(a.routing.keywords, ["k"]);
    assert_eq!(
        serde_json::to_string(&a).unwrap(),
        r#"{"name":"a","version":"v1","loraId":3,"path":"p","label":"l","description":"d","examples":["e"],"domains":["o"],"keywords":["k"],"extensions":[".x"],"mode":"dynamic","load":true}"#
    );
    assert!(serde_yaml::from_str::<WorkerAdapter>(&format!("{yaml}keyword: [k]\n")).is_err());
}
