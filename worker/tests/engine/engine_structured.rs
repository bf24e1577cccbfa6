//! Structured outputs in the batched engine, on the llama fixture (a byte-level tokenizer:
//! token id = byte), on the host path and the tensor path: constrained rows (a JSON schema, a
//! regex, a choice list, a Lark grammar; greedy and sampled; with and without an adapter)
//! beside unconstrained rows in one batch. Every constrained answer matches its grammar; the
//! unconstrained rows' tokens are transformers' (the grammar costs them nothing); both paths
//! pick the same constrained greedy tokens; `max_tokens` cuts with `length`; a schema
//! llguidance refuses is `invalid_schema`.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test
#![allow(clippy::disallowed_methods)] // tests read results back from the device

use crate::common;

use common::{engine_reference, fixture_adapter, host_engine, ids, tensor_engine};
use mole_engine::api::*;
use mole_engine::grammar::{Guide, Guided};
use mole_engine::Engine;
use serde_json::{json, Value};

fn request(
    prompt: Vec<u32>,
    adapter: Option<&str>,
    guide: Option<Guide>,
    f: impl FnOnce(&mut SamplingParams),
) -> GenerateRequest {
    let mut sampling = SamplingParams {
        // Enough for the longest answer of `schema()` (54 bytes).
        max_tokens: 64,
        guide: guide.map(|guide| Guided { guide, after: None }),
        ..Default::default()
    };
    f(&mut sampling);
    GenerateRequest {
        images: Vec::new(),
        id: "t".into(),
        prompt: Prompt::Tokens(prompt),
        adapter: adapter.map(String::from),
        sampling,
    }
}

/// The tokens, the text and the finish reason.
fn collect(mut rx: EventStream) -> (Vec<u32>, String, FinishReason) {
    let (mut tokens, mut text) = (Vec::new(), String::new());
    loop {
        match rx.blocking_recv().expect("a final event") {
            TokenEvent::Started { .. } => {}
            TokenEvent::Token {
                token_id, text: t, ..
            } => {
                tokens.push(token_id);
                text.push_str(&t);
            }
            TokenEvent::Finished { reason, .. } => return (tokens, text, reason),
            TokenEvent::Error(e) => panic!("{e}"),
        }
    }
}

fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
            "tag": {"enum": ["red", "green"]},
            "xs": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 3}
        },
        "required": ["n", "tag", "xs"],
        "additionalProperties": false
    })
}

/// Checks `text` against `schema()` by hand (the fixture's answers are short).
fn valid(text: &str) -> bool {
    let Ok(v) = serde_json::from_str::<Value>(text) else {
        return false;
    };
    let Some(o) = v.as_object() else { return false };
    let n_ok = o["n"].as_i64().is_some_and(|n| (0..=99).contains(&n));
    let tag_ok = matches!(o["tag"].as_str(), Some("red" | "green"));
    let xs_ok = o["xs"]
        .as_array()
        .is_some_and(|a| (2..=3).contains(&a.len()) && a.iter().all(Value::is_boolean));
    o.len() == 3 && n_ok && tag_ok && xs_ok
}

const REGEX: &str = "[a-z]{2,5}-[0-9]{1,3}";

fn matches_regex(text: &str) -> bool {
    let re = regex::Regex::new(&format!("^(?:{REGEX})$")).unwrap();
    re.is_match(text)
}

/// One batch: two unconstrained greedy rows (base, adapter), and constrained rows (schema
/// greedy and sampled with an adapter, regex, choice, Lark); returns every row's answer.
fn mixed_batch(e: &Engine) -> Vec<(Vec<u32>, String, FinishReason)> {
    let reference = engine_reference();
    let r = &reference["llama"];
    let (p0, p1) = (ids(&r["prompts"][0]), ids(&r["prompts"][1]));
    let free = |s: &mut SamplingParams| {
        s.max_tokens = 32;
        s.ignore_eos = true;
    };
    let streams = vec![
        e.submit(request(p0.clone(), None, None, free)).unwrap(),
        e.submit(request(p1.clone(), Some("a"), None, free))
            .unwrap(),
        e.submit(request(
            p0.clone(),
            None,
            Some(Guide::Json {
                schema: schema(),
                strict: true,
            }),
            |_| {},
        ))
        .unwrap(),
        e.submit(request(
            p1.clone(),
            Some("a"),
            Some(Guide::Json {
                schema: schema(),
                strict: true,
            }),
            |s| {
                s.temperature = 1.0;
                s.top_p = 0.95;
                s.seed = Some(3);
            },
        ))
        .unwrap(),
        e.submit(request(
            p1.clone(),
            None,
            Some(Guide::Regex(REGEX.into())),
            |_| {},
        ))
        .unwrap(),
        e.submit(request(
            p0.clone(),
            Some("a"),
            Some(Guide::Choice(vec![
                "yes".into(),
                "no".into(),
                "maybe".into(),
            ])),
            |s| {
                s.temperature = 0.7;
                s.seed = Some(1);
            },
        ))
        .unwrap(),
        e.submit(request(
            p0,
            None,
            Some(Guide::Lark(
                "start: \"(\" NUM (\",\" NUM)* \")\"\nNUM: /[0-9]/\n".into(),
            )),
            |s| s.max_tokens = 12,
        ))
        .unwrap(),
    ];
    streams.into_iter().map(collect).collect()
}

fn check(out: &[(Vec<u32>, String, FinishReason)], path: &str) {
    let reference = engine_reference();
    let r = &reference["llama"];
    assert_eq!(
        out[0].0,
        ids(&r["greedy"][0]),
        "{path}: unconstrained base row"
    );
    assert_eq!(
        out[1].0,
        ids(&r["adapters"]["a_r8_all"]["greedy"][1]),
        "{path}: unconstrained adapter row"
    );
    for (i, o) in out.iter().enumerate().skip(2).take(2) {
        assert!(valid(&o.1), "{path}: row {i}: {:?} is not valid", o.1);
        assert_eq!(o.2, FinishReason::Stop, "{path}: row {i}");
    }
    assert!(matches_regex(&out[4].1), "{path}: regex row {:?}", out[4].1);
    assert!(
        ["yes", "no", "maybe"].contains(&out[5].1.as_str()),
        "{path}: choice row {:?}",
        out[5].1
    );
    let lark = &out[6].1;
    let whole = regex::Regex::new(r"^\([0-9](,[0-9])*\)$").unwrap();
    let prefix = regex::Regex::new(r"^\([0-9](,[0-9])*,?$").unwrap();
    match out[6].2 {
        FinishReason::Stop => assert!(whole.is_match(lark), "{path}: lark {lark:?}"),
        FinishReason::Length => {
            assert!(prefix.is_match(lark), "{path}: lark cut {lark:?}");
            assert_eq!(out[6].0.len(), 12);
        }
        other => panic!("{path}: {other:?}"),
    }
}

#[test]
fn constrained_rows_beside_free_rows_on_the_host_path() {
    let e = host_engine(|o| o.max_batch_size = 8);
    e.load_adapter(fixture_adapter("a", "v1", "a_r8_all"))
        .unwrap();
    let out = mixed_batch(&e);
    check(&out, "host");
}

#[test]
fn constrained_rows_beside_free_rows_on_the_tensor_path_and_both_paths_agree() {
    let t = tensor_engine(|o| o.max_batch_size = 8);
    t.load_adapter(fixture_adapter("a", "v1", "a_r8_all"))
        .unwrap();
    let tensor = mixed_batch(&t);
    check(&tensor, "tensor");
    let h = host_engine(|o| o.max_batch_size = 8);
    h.load_adapter(fixture_adapter("a", "v1", "a_r8_all"))
        .unwrap();
    let host = mixed_batch(&h);
    // Greedy constrained rows: the same argmax over the same allowed tokens.
    for i in [2, 4, 6] {
        assert_eq!(tensor[i].1, host[i].1, "row {i}");
    }
}

#[test]
fn max_tokens_cuts_a_schema_with_length_and_bad_schemas_are_refused() {
    let e = host_engine(|_| {});
    let p = ids(&engine_reference()["llama"]["prompts"][0]);
    let (tokens, text, reason) = collect(
        e.submit(request(
            p.clone(),
            None,
            Some(Guide::Json {
                schema: schema(),
                strict: true,
            }),
            |s| s.max_tokens = 5,
        ))
        .unwrap(),
    );
    assert_eq!((tokens.len(), reason), (5, FinishReason::Length));
    assert!(text.starts_with('{'), "{text:?}");
    let refused = |g: Guide| match e.submit(request(p.clone(), None, Some(g), |_| {})) {
        Err(err) => err.code(),
        Ok(_) => "accepted",
    };
    assert_eq!(
        refused(Guide::Json {
            schema: json!({"type": "object", "properties": {"a": {"type": "wat"}}}),
            strict: true,
        }),
        "invalid_schema"
    );
    assert_eq!(refused(Guide::Regex("(unclosed".into())), "invalid_grammar");
    assert_eq!(
        refused(Guide::Lark("start: nothere".into())),
        "invalid_grammar"
    );
    // n choices each carry their own matcher.
    let choices = e
        .submit_n(
            request(p, None, Some(Guide::Regex(REGEX.into())), |s| {
                s.temperature = 1.0;
                s.seed = Some(9);
            }),
            3,
        )
        .unwrap();
    for c in choices {
        let (_, text, _) = collect(c);
        assert!(matches_regex(&text), "{text:?}");
    }
}

/// A choice may hold any string JSON can carry, control characters (C0, DEL, C1) and quotes
/// included: schemathesis sent `"\u0015j\u008f\u007f"`, and the Lark literal written for it
/// carried the raw DEL and C1 bytes, which llguidance's lexer refuses (400 `invalid_grammar`
/// for a valid request). The greedy answer is one of the choices.
#[test]
fn choices_with_control_characters_and_quotes_compile_and_answer_one_of_them() {
    let e = host_engine(|_| {});
    let p = ids(&engine_reference()["llama"]["prompts"][0]);
    let choices: Vec<String> = [
        "\u{15}j\u{8f}\u{7f}",
        "",
        "say \"hi\" \\ there",
        "tab\there\nnew line",
        "\u{9f}\u{85}\u{2028}",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let (_, text, _) = collect(
        e.submit(request(
            p,
            None,
            Some(Guide::Choice(choices.clone())),
            |s| s.max_tokens = 64,
        ))
        .unwrap(),
    );
    assert!(
        choices.contains(&text),
        "{text:?} is not one of {choices:?}"
    );
}
