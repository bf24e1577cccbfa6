//! Traces leave the process: with `--otlp-traces-endpoint` set, a request's spans reach an OTLP
//! collector (here a receiver in the test process decoding what the real exporter sends) under
//! one trace id from the client's `traceparent`, through the gateway, into the merged pod's
//! server and its engine's queue, prefill and decode spans.
//!
//! One test in this binary: the subscriber is process-wide.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message as _;
use serde_json::json;

/// A span as the collector received it.
#[derive(Debug, Clone)]
struct Got {
    name: String,
    trace: String,
    id: String,
    parent: String,
    service: String,
    attrs: HashMap<String, String>,
}

/// An OTLP/HTTP traces receiver on a random port: every span posted to `/v1/traces`.
async fn collector() -> (String, Arc<Mutex<Vec<Got>>>) {
    let got: Arc<Mutex<Vec<Got>>> = Arc::default();
    let sink = got.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: Bytes| {
            let sink = sink.clone();
            async move {
                let req = ExportTraceServiceRequest::decode(body).expect("OTLP protobuf");
                let mut out = sink.lock().unwrap();
                for rs in req.resource_spans {
                    let service = rs
                        .resource
                        .iter()
                        .flat_map(|r| &r.attributes)
                        .find(|a| a.key == "service.name")
                        .and_then(|a| text(a.value.as_ref()?.value.as_ref()?))
                        .unwrap_or_default();
                    for s in rs.scope_spans.into_iter().flat_map(|s| s.spans) {
                        out.push(got_span(&s, &service));
                    }
                }
                [("content-type", "application/x-protobuf")]
            }
        }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    (url, got)
}

fn text(v: &AnyValue) -> Option<String> {
    Some(match v {
        AnyValue::StringValue(s) => s.clone(),
        AnyValue::IntValue(i) => i.to_string(),
        AnyValue::BoolValue(b) => b.to_string(),
        AnyValue::DoubleValue(d) => d.to_string(),
        _ => return None,
    })
}

fn got_span(s: &Span, service: &str) -> Got {
    Got {
        name: s.name.clone(),
        trace: hex::encode(&s.trace_id),
        id: hex::encode(&s.span_id),
        parent: hex::encode(&s.parent_span_id),
        service: service.into(),
        attrs: s
            .attributes
            .iter()
            .filter_map(|a| Some((a.key.clone(), text(a.value.as_ref()?.value.as_ref()?)?)))
            .collect(),
    }
}

/// A worker on the tiny Llama fixture serving adapter `mg` (the fixture's c_r16_mlp) as
/// `mg_line` configures it; the returned sender stops it when dropped.
async fn worker(mg_line: &str) -> (String, tempfile::TempDir, tokio::sync::oneshot::Sender<()>) {
    let fx = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/engine");
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    common::copy_dir(&fx.join("llama"), &root.join("base"));
    common::copy_dir(&fx.join("adapters/llama/c_r16_mlp"), &root.join("mg"));
    let yaml = format!(
        "pool: demo\nmodelRoot: {}\nbaseModel: {{name: llama, path: base, dtype: f32}}\nadapters:\n  - {mg_line}\nrouter: {{strategies: [explicit], fallback: base}}\nlimits: {{maxTokens: 16, maxSeqLen: 128}}\n",
        root.display()
    );
    let (url, tx) = common::serve_config(root, &yaml).await;
    (url, dir, tx)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_runs_from_the_client_through_the_gateway_into_the_merged_pods_engine() {
    let (endpoint, got) = collector().await;
    let telemetry = mole_telemetry::init("mole-worker", Some(&endpoint)).unwrap();
    assert!(telemetry.exporting());
    // The merged pod serves mg itself; the pool's pod forwards mg's requests to it.
    let (merged, _d1, _s1) = worker("{name: mg, version: v1, loraId: 3, path: mg}").await;
    let (pool, _d2, _s2) = worker(&format!(
        "{{name: mg, version: v1, loraId: 3, path: mg, mode: merged, mergedEndpoint: \"{merged}\"}}"
    ))
    .await;
    // The client's own trace: every span below must continue it.
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let client_span = "00f067aa0ba902b7";
    let r = reqwest::Client::new()
        .post(format!("{pool}/v1/chat/completions"))
        .header("traceparent", format!("00-{trace}-{client_span}-01"))
        .json(
            &json!({"model": "mg", "max_tokens": 4, "temperature": 0, "ignore_eos": true,
            "messages": [{"role": "user", "content": "x"}]}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-mole-route"], "explicit+proxy");
    let spans = tokio::task::spawn_blocking(move || {
        // The batch exporter sends what has ended: both servers' spans end with the answer.
        for _ in 0..100 {
            telemetry.flush();
            let g = got.lock().unwrap().clone();
            let names: Vec<&str> = g.iter().map(|s| s.name.as_str()).collect();
            if ["gateway forward", "queue", "prefill", "decode"]
                .iter()
                .all(|n| names.contains(n))
                && names
                    .iter()
                    .filter(|n| **n == "POST /v1/chat/completions")
                    .count()
                    == 2
            {
                return g;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("spans never arrived: {:?}", got.lock().unwrap());
    })
    .await
    .unwrap();
    let in_trace: Vec<&Got> = spans.iter().filter(|s| s.trace == trace).collect();
    let find = |name: &str, parent: &str| {
        in_trace
            .iter()
            .find(|s| s.name == name && s.parent == parent)
            .unwrap_or_else(|| panic!("no span {name} under {parent} in {in_trace:#?}"))
    };
    // The pool's server span continues the client's; the gateway's is its child; the merged
    // pod's server span continues the gateway's (the traceparent it sent); the engine's
    // phases are the merged pod's request's children.
    let front = find("POST /v1/chat/completions", client_span);
    assert_eq!(front.service, "mole-worker");
    assert_eq!(front.attrs["mole.adapter"], "mg");
    assert_eq!(front.attrs["http.response.status_code"], "200");
    let gateway = find("gateway forward", &front.id);
    assert_eq!(gateway.attrs["server.address"], merged);
    let back = find("POST /v1/chat/completions", &gateway.id);
    assert_eq!(back.attrs["mole.mode"], "dynamic");
    for phase in ["queue", "prefill", "decode"] {
        find(phase, &back.id);
    }
    let decode = find("decode", &back.id);
    assert_eq!(decode.attrs["tokens"], "4");
    assert_eq!(decode.attrs["finish_reason"], "length");
}
