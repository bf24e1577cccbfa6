//! A chat answer's text split as vLLM's reasoning and tool parsers split it: the reasoning
//! between `<think>` and `</think>` (Qwen3, QwQ, DeepSeek-R1) apart from the answer, and the
//! Hermes calls `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` as OpenAI tool
//! calls. The same parser serves a whole answer and a stream: text goes in as it comes, and
//! what is decided comes out; a tag's first characters are held until the tag is known.
//!
//! A call streams as OpenAI streams one: once its name is read and its arguments object has
//! begun, its head (index, id, name) goes out, then the arguments as the model writes them,
//! checked character by character ([`CallJson`]). A whole answer is the same pieces joined,
//! so the streamed pieces of a call's arguments concatenate to the whole answer's exactly.
//! The arguments are the text the model wrote (as OpenAI's are; Qwen's `{"a": 1}` is also
//! what vLLM's `json.dumps` writes). Text after `<tool_call>` is held until the call is
//! known: a body that never names a function with object arguments (bad JSON, or cut before
//! the arguments begin) is given back as answer text, as vLLM's parser gives it back whole.
//! Once a call has begun it is a call: cut by `max_tokens`, it keeps the arguments written
//! so far (`finish_reason: length`, as OpenAI); arguments that stop being JSON end at the
//! last character that was (the stream cannot take back what it sent). Forced calls
//! (`required`, named) are grammar-constrained and never end that way.

use mole_api::ReasoningParser;

use super::call_json::CallJson;

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

/// One tool call of an answer, whole.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct ToolCall {
    /// `call_` and 24 hex digits.
    pub(super) id: String,
    /// The function's name.
    pub(super) name: String,
    /// Its arguments, a JSON object's text.
    pub(super) arguments: String,
}

/// A call's first piece: its id and name.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct CallHead {
    /// `call_` and 24 hex digits.
    pub(super) id: String,
    /// The function's name.
    pub(super) name: String,
}

/// A piece of a tool call, as a stream sends it: the head, or more of its arguments.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct CallPiece {
    /// The call's place among the choice's calls.
    pub(super) index: usize,
    /// The id and name (the call's first piece only).
    pub(super) head: Option<CallHead>,
    /// More of the arguments (empty in a head).
    pub(super) arguments: String,
}

/// The whole calls that `pieces` make, in order.
pub(super) fn join(pieces: impl IntoIterator<Item = CallPiece>) -> Vec<ToolCall> {
    let mut calls: Vec<ToolCall> = Vec::new();
    for p in pieces {
        if let Some(h) = p.head {
            calls.push(ToolCall {
                id: h.id,
                name: h.name,
                arguments: String::new(),
            });
        }
        if let Some(c) = calls.get_mut(p.index) {
            c.arguments.push_str(&p.arguments);
        }
    }
    calls
}

/// What a piece of text became.
#[derive(Debug, Default, Clone, PartialEq)]
pub(super) struct Parsed {
    /// Answer text.
    pub(super) content: String,
    /// Reasoning text.
    pub(super) reasoning: String,
    /// Pieces of calls, in order.
    pub(super) calls: Vec<CallPiece>,
}

impl Parsed {
    /// Appends `more` (what the next text became).
    pub(super) fn extend(&mut self, more: Parsed) {
        self.content.push_str(&more.content);
        self.reasoning.push_str(&more.reasoning);
        self.calls.extend(more.calls);
    }
}

/// The call being read.
#[derive(Debug)]
struct OpenCall {
    json: CallJson,
    /// Its index, once its head went out.
    index: Option<usize>,
    /// How much of the body went out as arguments.
    sent: usize,
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
    /// The call being read (in [`Phase::Call`]).
    call: Option<OpenCall>,
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
            call: None,
            // Only the answer after a `</think>` loses its leading whitespace.
            answered: phase == Phase::Content,
        }
    }

    /// Calls made so far.
    pub(super) fn calls(&self) -> usize {
        self.calls
    }

    /// Whether the text now goes to the reasoning.
    pub(super) fn in_reasoning(&self) -> bool {
        self.phase == Phase::Reasoning
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
                        self.call = Some(OpenCall {
                            json: CallJson::new(),
                            index: None,
                            sent: 0,
                        });
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
                Phase::Call => {
                    let closed = self.read_call(end);
                    if !closed && !end {
                        self.send_call(out);
                        return;
                    }
                    self.phase = Phase::Content;
                    self.close_call(out, closed);
                }
            }
        }
    }

    /// Reads the held text into the open call, up to its `</tool_call>` (consumed), and sends
    /// what became known; true when the call is closed. Outside the JSON's strings a held
    /// `</tool_call>`'s first characters wait for the rest.
    fn read_call(&mut self, end: bool) -> bool {
        let Some(call) = self.call.as_mut() else {
            return true;
        };
        let mut used = self.held.len();
        let mut closed = false;
        for (i, c) in self.held.char_indices() {
            if !call.json.in_string() {
                let rest = &self.held[i..];
                if rest.starts_with(END_CALL) {
                    (used, closed) = (i + END_CALL.len(), true);
                    break;
                }
                if !end && END_CALL.starts_with(rest) {
                    used = i;
                    break;
                }
            }
            call.json.push(c);
        }
        self.held.drain(..used);
        closed
    }

    /// The open call's new pieces: its head once its name is read and its arguments object
    /// has begun, then the arguments as far as they are good.
    fn send_call(&mut self, out: &mut Parsed) {
        let Some(call) = self.call.as_mut() else {
            return;
        };
        if call.index.is_none() {
            let (Some(name), Some(start)) = (call.json.name(), call.json.object_args_start())
            else {
                return;
            };
            call.index = Some(self.calls);
            call.sent = start;
            out.calls.push(CallPiece {
                index: self.calls,
                head: Some(CallHead {
                    id: call_id(),
                    name: name.to_string(),
                }),
                arguments: String::new(),
            });
            self.calls += 1;
        }
        let (Some(index), to) = (call.index, call.json.args_good_to()) else {
            return;
        };
        if to > call.sent {
            out.calls.push(CallPiece {
                index,
                head: None,
                arguments: call.json.text()[call.sent..to].to_string(),
            });
            call.sent = to;
        }
    }

    /// The end of the open call (`closed`: by `</tool_call>`, else by the end of the answer).
    /// A call that began stays one; another is a call if its body is whole JSON that names a
    /// function (its arguments in one piece: a string, or written before the name), else its
    /// text is the answer's.
    fn close_call(&mut self, out: &mut Parsed, closed: bool) {
        self.send_call(out);
        let Some(call) = self.call.take() else {
            return;
        };
        if call.index.is_some() {
            return;
        }
        let whole = match (closed, call.json.name(), call.json.whole_arguments()) {
            (true, Some(name), Some(arguments)) => Some((name.to_string(), arguments)),
            _ => None,
        };
        match whole {
            Some((name, arguments)) => {
                out.calls.push(CallPiece {
                    index: self.calls,
                    head: Some(CallHead {
                        id: call_id(),
                        name,
                    }),
                    arguments: String::new(),
                });
                if !arguments.is_empty() {
                    out.calls.push(CallPiece {
                        index: self.calls,
                        head: None,
                        arguments,
                    });
                }
                self.calls += 1;
            }
            // Not a call: the text stays the answer's, as vLLM leaves it.
            None => {
                let tail = if closed { END_CALL } else { "" };
                let text = format!("{CALL}{}{tail}", call.json.text());
                self.answer(out, &text);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(reasoning: Option<Start>, tools: bool) -> ParseSpec {
        ParseSpec { reasoning, tools }
    }

    /// Whole, and streamed in pieces of every size from 1 to 7 characters: the same split,
    /// and the same calls (their arguments' pieces joined). Returns the whole answer's split
    /// and its calls.
    fn both(s: ParseSpec, text: &str) -> (Parsed, Vec<ToolCall>) {
        let mut p = OutputParser::new(s);
        let mut whole = p.push(text);
        whole.extend(p.finish());
        let strip = |v: Vec<ToolCall>| -> Vec<(String, String)> {
            v.into_iter().map(|c| (c.name, c.arguments)).collect()
        };
        let calls = join(whole.calls.clone());
        for size in 1..8 {
            let got = streamed(s, text, size);
            assert_eq!(got.content, whole.content, "pieces of {size}");
            assert_eq!(got.reasoning, whole.reasoning, "pieces of {size}");
            assert_eq!(
                strip(join(got.calls)),
                strip(calls.clone()),
                "pieces of {size}"
            );
        }
        (whole, calls)
    }

    /// Each call's name and arguments.
    fn named(calls: &[ToolCall]) -> Vec<(&str, &str)> {
        calls
            .iter()
            .map(|c| (c.name.as_str(), c.arguments.as_str()))
            .collect()
    }

    /// `text` pushed `size` characters at a time.
    fn streamed(s: ParseSpec, text: &str, size: usize) -> Parsed {
        let mut p = OutputParser::new(s);
        let mut got = Parsed::default();
        let chars: Vec<char> = text.chars().collect();
        for piece in chars.chunks(size) {
            got.extend(p.push(&piece.iter().collect::<String>()));
        }
        got.extend(p.finish());
        got
    }

    #[test]
    fn reasoning_splits_from_the_answer_whole_and_streamed() {
        let (p, _) = both(
            spec(Some(Start::Sniff), false),
            "<think>\nLet me see: 2+2.\n</think>\n\nIt is 4.",
        );
        assert_eq!(p.reasoning, "\nLet me see: 2+2.\n");
        assert_eq!(p.content, "It is 4.");
        // Without <think> a Qwen3 answer is all answer.
        let (p, _) = both(spec(Some(Start::Sniff), false), "It is 4.");
        assert_eq!((p.reasoning.as_str(), p.content.as_str()), ("", "It is 4."));
        // After a prompt that opened it, the reasoning needs no opening tag.
        let (p, _) = both(spec(Some(Start::Reasoning), false), "hmm</think>4");
        assert_eq!((p.reasoning.as_str(), p.content.as_str()), ("hmm", "4"));
        // Cut before </think>: all reasoning.
        let (p, _) = both(spec(Some(Start::Sniff), false), "<think>still going");
        assert_eq!(
            (p.reasoning.as_str(), p.content.as_str()),
            ("still going", "")
        );
        let (p, _) = both(spec(None, false), "<think>x</think>y");
        assert_eq!(p.content, "<think>x</think>y");
    }

    #[test]
    fn hermes_calls_parse_and_bad_ones_stay_text() {
        let out = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"t\", \"arguments\": {}}\n</tool_call>";
        let (p, calls) = both(spec(Some(Start::Sniff), true), out);
        assert_eq!(p.content, "");
        let got = named(&calls);
        // The arguments as the model wrote them.
        assert_eq!(got, [("get_weather", "{\"city\": \"Paris\"}"), ("t", "{}")]);
        assert!(calls[0].id.starts_with("call_") && calls[0].id.len() == 29);
        assert_ne!(calls[0].id, calls[1].id);
        let (p, calls) = both(
            spec(None, true),
            "Let me check. <tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}}</tool_call>",
        );
        assert_eq!(p.content, "Let me check.");
        assert_eq!(calls.len(), 1);
        let (p, calls) = both(spec(None, true), "<tool_call>not json</tool_call> ok");
        assert_eq!(p.content, "<tool_call>not json</tool_call> ok");
        assert!(calls.is_empty());
        // Cut before its arguments began: the call's text is the answer's (the whitespace
        // before a call is dropped before it is known to be cut).
        let (p, calls) = both(spec(None, true), "x <tool_call>{\"name\": \"f\", \"argu");
        assert_eq!(p.content, "x<tool_call>{\"name\": \"f\", \"argu");
        assert!(calls.is_empty());
        // Arguments as a string, or before the name: a call once whole, in one piece.
        let (p, calls) = both(
            spec(None, true),
            "<tool_call>{\"arguments\": {\"a\": 1}, \"name\": \"f\"}</tool_call>\
             <tool_call>{\"name\": \"g\", \"arguments\": \"{\\\"b\\\": 2}\"}</tool_call>",
        );
        assert_eq!(p.content, "");
        let got = named(&calls);
        assert_eq!(got, [("f", "{\"a\": 1}"), ("g", "{\"b\": 2}")]);
        // A `</tool_call>` inside a JSON string is text of the arguments.
        let (_, calls) = both(
            spec(None, true),
            "<tool_call>{\"name\": \"f\", \"arguments\": {\"s\": \"a</tool_call>b\"}}</tool_call>",
        );
        assert_eq!(calls[0].arguments, "{\"s\": \"a</tool_call>b\"}");
    }

    /// A call streams as OpenAI streams it: its head (index, id, name, no arguments) once the
    /// name is read and the arguments begin, then the arguments in pieces as they come, which
    /// join to the whole answer's; parallel calls take increasing indexes; content before a
    /// call streams as content.
    #[test]
    fn call_arguments_stream_in_pieces_that_join_to_the_whole() {
        let text = "Checking. <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": [1, 2]}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": \"CET\"}}\n</tool_call>";
        let s = spec(None, true);
        let (whole, calls) = both(s, text);
        assert_eq!(whole.content, "Checking.");
        assert_eq!(
            calls[0].arguments,
            "{\"city\": \"Paris\", \"days\": [1, 2]}"
        );
        for size in 1..8 {
            let got = streamed(s, text, size);
            for (index, call) in calls.iter().enumerate() {
                let pieces: Vec<&CallPiece> =
                    got.calls.iter().filter(|p| p.index == index).collect();
                let head = pieces[0]
                    .head
                    .as_ref()
                    .expect("the first piece is the head");
                assert_eq!(head.name, call.name);
                assert_eq!(pieces[0].arguments, "");
                assert!(pieces[1..]
                    .iter()
                    .all(|p| p.head.is_none() && !p.arguments.is_empty()));
                let args: Vec<&str> = pieces[1..].iter().map(|p| p.arguments.as_str()).collect();
                assert!(
                    args.len() > 1,
                    "pieces of {size}: call {index}'s arguments came in {} piece(s): {args:?}",
                    args.len()
                );
                assert_eq!(args.concat(), call.arguments, "pieces of {size}");
            }
            // The heads go out in order, each before its arguments.
            let heads: Vec<usize> = got
                .calls
                .iter()
                .filter(|p| p.head.is_some())
                .map(|p| p.index)
                .collect();
            assert_eq!(heads, [0, 1]);
        }
        // Pushed a character at a time, the arguments go out as they come: every piece is
        // the character just read.
        let got = streamed(s, text, 1);
        let args = got.calls.iter().filter(|p| p.head.is_none()).count();
        assert_eq!(
            args,
            calls
                .iter()
                .map(|c| c.arguments.chars().count())
                .sum::<usize>()
        );
    }

    /// A call that began is a call: cut by the end of the answer it keeps the arguments
    /// written so far; arguments that stop being JSON end where they stopped, and nothing of
    /// the rest of the body leaks into the content. Whole and streamed agree.
    #[test]
    fn a_call_that_began_keeps_its_good_arguments() {
        let s = spec(None, true);
        let (p, calls) = both(
            s,
            "<tool_call>{\"name\": \"f\", \"arguments\": {\"city\": \"Par",
        );
        assert_eq!(p.content, "");
        assert_eq!(
            (calls[0].name.as_str(), calls[0].arguments.as_str()),
            ("f", "{\"city\": \"Par")
        );
        let (p, calls) = both(
            s,
            "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1 oops}}</tool_call> after",
        );
        assert_eq!(calls[0].arguments, "{\"a\": 1 ");
        assert_eq!(p.content, " after");
        // Garbage after whole arguments: the call stands as written.
        let (p, calls) = both(
            s,
            "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}, oops</tool_call>",
        );
        assert_eq!(calls[0].arguments, "{\"a\": 1}");
        assert_eq!(p.content, "");
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
