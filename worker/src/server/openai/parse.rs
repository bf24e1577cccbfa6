//! A chat answer's text split as vLLM's reasoning and tool parsers split it: the reasoning
//! between `<think>` and `</think>` (Qwen3, QwQ, DeepSeek-R1) apart from the answer, and the
//! Hermes calls `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` as OpenAI tool
//! calls. The same parser serves a whole answer and a stream: text goes in as it comes, and
//! what is decided comes out; a tag's first characters are held until the tag is known.

use mole_api::ReasoningParser;
use serde_json::Value;

const THINK: &str = "<think>";
const END_THINK: &str = "</think>";
const CALL: &str = "<tool_call>";
const END_CALL: &str = "</tool_call>";

/// How a chat's answer is parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ParseSpec {
    /// Where the answer starts: in reasoning, in the answer, or decided by whether it opens
    /// with `<think>`; None: no reasoning format.
    pub(super) reasoning: Option<Start>,
    /// Parse Hermes tool calls.
    pub(super) tools: bool,
}

/// Where a reasoning model's answer starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Start {
    /// Inside the reasoning (the prompt opened `<think>`, or DeepSeek-R1's format).
    Reasoning,
    /// In the answer (the prompt closed the reasoning: Qwen3's `enable_thinking: false`).
    Answer,
    /// Reasoning when the answer opens with `<think>` (Qwen3).
    Sniff,
}

impl Start {
    /// Where an answer after `prompt` starts, for `format`.
    pub(super) fn after(prompt: &str, format: ReasoningParser) -> Self {
        let tail = prompt.trim_end();
        match (tail.rfind(THINK), tail.rfind(END_THINK)) {
            // The prompt's last tag is a `</think>` that ends it: the reasoning is over.
            (_, Some(e)) if e + END_THINK.len() == tail.len() => Start::Answer,
            (Some(o), _) if o + THINK.len() == tail.len() => Start::Reasoning,
            _ => match format {
                ReasoningParser::Qwen3 => Start::Sniff,
                ReasoningParser::DeepseekR1 => Start::Reasoning,
            },
        }
    }
}

/// One tool call of an answer.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct ToolCall {
    /// `call_` and 24 hex digits.
    pub(super) id: String,
    /// The function's name.
    pub(super) name: String,
    /// Its arguments, a JSON object's text.
    pub(super) arguments: String,
}

/// What a piece of text became.
#[derive(Debug, Default, Clone, PartialEq)]
pub(super) struct Parsed {
    /// Answer text.
    pub(super) content: String,
    /// Reasoning text.
    pub(super) reasoning: String,
    /// Calls completed.
    pub(super) calls: Vec<ToolCall>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Sniff,
    Reasoning,
    Content,
    Call,
}

/// The parser of one choice.
#[derive(Debug)]
pub(super) struct OutputParser {
    spec: ParseSpec,
    phase: Phase,
    /// Text not decided yet.
    held: String,
    /// Calls made so far.
    calls: usize,
    /// Whether the answer text has started (the whitespace between `</think>` and the answer
    /// is dropped).
    answered: bool,
}

/// The length of the longest suffix of `s` that is a proper prefix of `tag` (text that may be
/// the start of the tag).
fn partial(s: &str, tag: &str) -> usize {
    (1..tag.len().min(s.len() + 1))
        .rev()
        .find(|&n| s.is_char_boundary(s.len() - n) && tag.starts_with(&s[s.len() - n..]))
        .unwrap_or(0)
}

/// A call id.
fn call_id() -> String {
    use rand::Rng;
    let mut r = rand::rng();
    format!("call_{:016x}{:08x}", r.random::<u64>(), r.random::<u32>())
}

impl OutputParser {
    /// A parser for one choice.
    pub(super) fn new(spec: ParseSpec) -> Self {
        let phase = match spec.reasoning {
            Some(Start::Reasoning) => Phase::Reasoning,
            Some(Start::Sniff) => Phase::Sniff,
            Some(Start::Answer) | None => Phase::Content,
        };
        Self {
            spec,
            phase,
            held: String::new(),
            calls: 0,
            // Only the answer after a `</think>` loses its leading whitespace.
            answered: phase == Phase::Content,
        }
    }

    /// Calls made so far.
    pub(super) fn calls(&self) -> usize {
        self.calls
    }

    /// Takes `text`, returns what is decided.
    pub(super) fn push(&mut self, text: &str) -> Parsed {
        self.held.push_str(text);
        let mut out = Parsed::default();
        self.run(&mut out, false);
        out
    }

    /// The end of the answer: what was held comes out.
    pub(super) fn finish(&mut self) -> Parsed {
        let mut out = Parsed::default();
        self.run(&mut out, true);
        out
    }

    fn answer(&mut self, out: &mut Parsed, text: &str) {
        let text = match self.answered {
            true => text,
            false => text.trim_start(),
        };
        if !text.is_empty() {
            self.answered = true;
            out.content.push_str(text);
        }
    }

    fn run(&mut self, out: &mut Parsed, end: bool) {
        loop {
            match self.phase {
                Phase::Sniff => {
                    let t = self.held.trim_start();
                    if let Some(rest) = t.strip_prefix(THINK) {
                        self.held = rest.to_string();
                        self.phase = Phase::Reasoning;
                    } else if !end && THINK.starts_with(t) {
                        return;
                    } else {
                        self.phase = Phase::Content;
                    }
                }
                Phase::Reasoning => match self.held.find(END_THINK) {
                    Some(at) => {
                        out.reasoning.push_str(&self.held[..at]);
                        self.held.drain(..at + END_THINK.len());
                        self.phase = Phase::Content;
                        self.answered = false;
                    }
                    None => {
                        let keep = if end {
                            0
                        } else {
                            partial(&self.held, END_THINK)
                        };
                        let n = self.held.len() - keep;
                        out.reasoning.push_str(&self.held[..n]);
                        self.held.drain(..n);
                        return;
                    }
                },
                Phase::Content if !self.spec.tools => {
                    let t = std::mem::take(&mut self.held);
                    self.answer(out, &t);
                    return;
                }
                Phase::Content => match self.held.find(CALL) {
                    Some(at) => {
                        // The whitespace before a call is not the answer's.
                        let before = self.held[..at].trim_end().to_string();
                        self.answer(out, &before);
                        self.held.drain(..at + CALL.len());
                        self.phase = Phase::Call;
                    }
                    None => {
                        // Whitespace is held too: between calls it is not an answer.
                        let keep = partial(&self.held, CALL);
                        let n = self.held.len() - keep;
                        let n = match end {
                            true => self.held.len(),
                            false => self.held[..n].trim_end().len(),
                        };
                        let ready: String = self.held.drain(..n).collect();
                        if end && self.calls > 0 && ready.trim().is_empty() {
                            return;
                        }
                        self.answer(out, &ready);
                        return;
                    }
                },
                Phase::Call => match self.held.find(END_CALL) {
                    Some(at) => {
                        let body: String = self.held.drain(..at + END_CALL.len()).collect();
                        let body = &body[..at];
                        self.phase = Phase::Content;
                        match call(body) {
                            Some((name, arguments)) => {
                                self.calls += 1;
                                out.calls.push(ToolCall {
                                    id: call_id(),
                                    name,
                                    arguments,
                                });
                            }
                            // Not a call: the text stays the answer's, as vLLM leaves it.
                            None => self.answer(out, &format!("{CALL}{body}{END_CALL}")),
                        }
                    }
                    None if end => {
                        // Cut before its end (max_tokens): the answer's text, unparsed.
                        let body = std::mem::take(&mut self.held);
                        self.phase = Phase::Content;
                        self.answer(out, &format!("{CALL}{body}"));
                        return;
                    }
                    None => return,
                },
            }
        }
    }
}

/// A call's name and arguments (a JSON object's text) from its JSON body.
fn call(body: &str) -> Option<(String, String)> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
        None | Some(Value::Null) => "{}".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(a) => serde_json::to_string(a).ok()?,
    };
    Some((name, arguments))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(reasoning: Option<Start>, tools: bool) -> ParseSpec {
        ParseSpec { reasoning, tools }
    }

    /// Whole, and streamed in pieces of every size from 1 to 7 bytes: the same split.
    fn both(s: ParseSpec, text: &str) -> Parsed {
        let mut p = OutputParser::new(s);
        let mut whole = p.push(text);
        let rest = p.finish();
        whole.content.push_str(&rest.content);
        whole.reasoning.push_str(&rest.reasoning);
        whole.calls.extend(rest.calls);
        for size in 1..8 {
            let mut p = OutputParser::new(s);
            let mut got = Parsed::default();
            let chars: Vec<char> = text.chars().collect();
            for piece in chars.chunks(size) {
                let o = p.push(&piece.iter().collect::<String>());
                got.content.push_str(&o.content);
                got.reasoning.push_str(&o.reasoning);
                got.calls.extend(o.calls);
            }
            let o = p.finish();
            got.content.push_str(&o.content);
            got.reasoning.push_str(&o.reasoning);
            got.calls.extend(o.calls);
            let strip = |v: &[ToolCall]| -> Vec<(String, String)> {
                v.iter()
                    .map(|c| (c.name.clone(), c.arguments.clone()))
                    .collect()
            };
            assert_eq!(got.content, whole.content, "pieces of {size}");
            assert_eq!(got.reasoning, whole.reasoning, "pieces of {size}");
            assert_eq!(strip(&got.calls), strip(&whole.calls), "pieces of {size}");
        }
        whole
    }

    #[test]
    fn reasoning_splits_from_the_answer_whole_and_streamed() {
        let p = both(
            spec(Some(Start::Sniff), false),
            "<think>\nLet me see: 2+2.\n</think>\n\nIt is 4.",
        );
        assert_eq!(p.reasoning, "\nLet me see: 2+2.\n");
        assert_eq!(p.content, "It is 4.");
        // Without <think> a Qwen3 answer is all answer.
        let p = both(spec(Some(Start::Sniff), false), "It is 4.");
        assert_eq!((p.reasoning.as_str(), p.content.as_str()), ("", "It is 4."));
        // After a prompt that opened it, the reasoning needs no opening tag.
        let p = both(spec(Some(Start::Reasoning), false), "hmm</think>4");
        assert_eq!((p.reasoning.as_str(), p.content.as_str()), ("hmm", "4"));
        // Cut before </think>: all reasoning.
        let p = both(spec(Some(Start::Sniff), false), "<think>still going");
        assert_eq!(
            (p.reasoning.as_str(), p.content.as_str()),
            ("still going", "")
        );
        let p = both(spec(None, false), "<think>x</think>y");
        assert_eq!(p.content, "<think>x</think>y");
    }

    #[test]
    fn hermes_calls_parse_and_bad_ones_stay_text() {
        let out = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"t\", \"arguments\": {}}\n</tool_call>";
        let p = both(spec(Some(Start::Sniff), true), out);
        assert_eq!(p.content, "");
        let calls: Vec<(&str, &str)> = p
            .calls
            .iter()
            .map(|c| (c.name.as_str(), c.arguments.as_str()))
            .collect();
        assert_eq!(
            calls,
            [("get_weather", "{\"city\":\"Paris\"}"), ("t", "{}")]
        );
        assert!(p.calls[0].id.starts_with("call_") && p.calls[0].id.len() == 29);
        let p = both(
            spec(None, true),
            "Let me check. <tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}}</tool_call>",
        );
        assert_eq!(p.content, "Let me check.");
        assert_eq!(p.calls.len(), 1);
        let p = both(spec(None, true), "<tool_call>not json</tool_call> ok");
        assert_eq!(p.content, "<tool_call>not json</tool_call> ok");
        assert!(p.calls.is_empty());
        let p = both(spec(None, true), "x <tool_call>{\"name\": \"f\", \"argu");
        // Cut before its end: the call's text is the answer's (the whitespace before a call
        // is dropped before it is known to be cut).
        assert_eq!(p.content, "x<tool_call>{\"name\": \"f\", \"argu");
    }

    #[test]
    fn where_the_answer_starts_follows_the_prompt() {
        let q = ReasoningParser::Qwen3;
        assert_eq!(Start::after("<|im_start|>assistant\n", q), Start::Sniff);
        assert_eq!(
            Start::after("<|im_start|>assistant\n<think>\n\n</think>\n\n", q),
            Start::Answer
        );
        assert_eq!(
            Start::after("<|im_start|>assistant\n<think>\n", q),
            Start::Reasoning
        );
        assert_eq!(
            Start::after("<|Assistant|>", ReasoningParser::DeepseekR1),
            Start::Reasoning
        );
    }
}
