//! Issue 52 item 6: JSON Schema coverage as users need it, measured on a corpus of schemas
//! shaped as the real world writes them (worker/tests/schemas/corpus.json: API payloads,
//! function-calling parameters, LLM extraction outputs, the shapes of package.json, tsconfig,
//! docker-compose, GitHub Actions, OpenAPI-generated models; written for this test, not
//! downloaded), each compiled by the worker's grammar engine as a request asks for it: with
//! OpenAI's `strict: true` (every keyword enforced, or refused naming it) and without (approximated:
//! what cannot be enforced is not, `oneOf` is read as `anyOf`, and the answer says what).
//!
//! `scripts/checks/schema-coverage.sh` prints the measurement (`--nocapture`).

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test

use std::collections::BTreeMap;

use mole_engine::grammar::{unenforced, Grammars, Guide, Guided};
use mole_engine::text::TextModel;
use serde_json::Value;

/// Every key of `v` (a schema's keywords and property names) and every `format` value.
fn words(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                out.push(k.clone());
                if k == "format" {
                    if let Some(f) = x.as_str() {
                        out.push(f.to_string());
                    }
                }
                words(x, out);
            }
        }
        Value::Array(a) => a.iter().for_each(|x| words(x, out)),
        _ => {}
    }
}

#[test]
fn schema_coverage() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let t = TextModel::load(&dir.join("../tests/fixtures/engine/llama")).unwrap();
    let g = Grammars::new(t.tokenizer().clone(), &t.eos_ids, 256);
    let corpus: Vec<Value> = serde_json::from_str(include_str!("../schemas/corpus.json")).unwrap();
    assert!(corpus.len() >= 100, "{} schemas", corpus.len());
    let compile = |schema: &Value, strict: bool| {
        g.compile(&Guided {
            guide: Guide::Json {
                schema: schema.clone(),
                strict,
            },
            after: None,
        })
        .map(|c| c.unenforced().to_vec())
        .map_err(|e| e.to_string())
    };
    let (mut strict_ok, mut lenient_ok, mut approximated) = (0, 0, 0);
    let mut refused_for: BTreeMap<String, usize> = BTreeMap::new();
    let mut unenforced_for: BTreeMap<String, usize> = BTreeMap::new();
    let mut lenient_refused = Vec::new();
    let mut rows = Vec::new();
    for entry in &corpus {
        let name = entry["name"].as_str().unwrap();
        let schema = &entry["schema"];
        let mut present = Vec::new();
        words(schema, &mut present);
        let strict = compile(schema, true);
        let lenient = compile(schema, false);
        match &strict {
            Ok(unenforced) => {
                strict_ok += 1;
                // Strict compiled means every keyword is enforced.
                assert!(unenforced.is_empty(), "{name}: strict left {unenforced:?}");
            }
            Err(e) => {
                // A strict refusal names what it refuses: the schema's own keywords or formats
                // (read as the answer's `mole.unenforced` reads llguidance's words), or its
                // remote reference.
                let said = e.trim_start_matches("invalid JSON schema: ").to_string();
                let named = unenforced(std::slice::from_ref(&said));
                let in_schema = |u: &String| {
                    let bare = u.strip_prefix("format: ").unwrap_or(u);
                    bare.split('/').any(|b| present.iter().any(|w| w == b))
                };
                match named.iter().all(in_schema) {
                    true => {
                        for u in named {
                            *refused_for.entry(u).or_default() += 1;
                        }
                    }
                    false if said.contains("$ref") => {
                        *refused_for.entry("remote $ref".into()).or_default() += 1;
                    }
                    false => panic!("{name}: strict refusal names nothing of the schema: {e}"),
                }
            }
        }
        match &lenient {
            Ok(unenforced) => {
                lenient_ok += 1;
                if !unenforced.is_empty() {
                    approximated += 1;
                }
                for u in unenforced {
                    // Each one names something of the schema.
                    let bare = u.strip_prefix("format: ").unwrap_or(u);
                    assert!(
                        bare.split('/').any(|b| present.iter().any(|w| w == b)),
                        "{name}: unenforced {u:?} is not in the schema"
                    );
                    *unenforced_for.entry(u.clone()).or_default() += 1;
                }
                // What compiles strict compiles the same lenient.
                if strict.is_ok() {
                    assert!(unenforced.is_empty(), "{name}: {unenforced:?}");
                }
            }
            Err(e) => lenient_refused.push(format!("{name}: {e}")),
        }
        let show = |r: &Result<Vec<String>, String>| match r {
            Ok(u) if u.is_empty() => "ok".to_string(),
            Ok(u) => format!("ok, not enforced: {}", u.join(", ")),
            Err(e) => format!("refused: {}", e.chars().take(90).collect::<String>()),
        };
        rows.push(format!(
            "  {name:<30} strict {:<50} lenient {}",
            show(&strict),
            show(&lenient)
        ));
    }
    let n = corpus.len();
    println!("JSON Schema coverage on {n} schemas (worker/tests/schemas/corpus.json):");
    println!("  strict: true  compiles {strict_ok}/{n} (every keyword enforced)");
    println!(
        "  without strict compiles {lenient_ok}/{n} ({approximated} approximated, the answer's mole.unenforced says what)"
    );
    println!("  strict refusals by keyword: {refused_for:?}");
    println!("  not enforced without strict, by keyword: {unenforced_for:?}");
    println!("  refused either way: {lenient_refused:#?}");
    for r in &rows {
        println!("{r}");
    }
    // The measurement held: what users send compiles without strict, bar what no server may
    // do (fetch a remote $ref) or no grammar can (2020-12's dynamic references).
    assert!(
        lenient_ok >= n - 3,
        "{lenient_ok}/{n} compile without strict: {lenient_refused:#?}"
    );
    assert!(
        strict_ok < lenient_ok,
        "strict refuses what cannot be enforced"
    );
}
