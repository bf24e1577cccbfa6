//! The Responses API's answer: a `response` object whose `output` items are the answer split
//! by chat's parser ([`super::parse`]): a `reasoning` item (its text as `reasoning_text`
//! content), `message` items (`output_text`), `function_call` items (`call_id`, name,
//! arguments). Whole or streamed, the same [`ResponseState`] writes it from the tokens as they
//! come, so a stream's events join to exactly the whole answer: `response.created`,
//! `response.in_progress`, per item `response.output_item.added`, its content part's
//! `response.content_part.added`, the deltas (`response.reasoning_text.delta`,
//! `response.output_text.delta`, `response.function_call_arguments.delta`), their `.done`,
//! `response.output_item.done`, and last `response.completed` (or `response.incomplete` when
//! `max_output_tokens` cut it) carrying the whole response with its usage. Every event carries
//! its `sequence_number`; events are named (`event:` lines), as OpenAI sends them, and no
//! `[DONE]` follows.

use std::collections::BTreeMap;

use axum::response::sse::Event;
use serde::Serialize;
use serde_json::{json, Value};
use utoipa::ToSchema;

use super::now;
use super::parse::{CallHead, OutputParser, ParseSpec, Parsed};
use super::reply_bodies::MoleInfo;
use crate::ApiError;
use mole_engine::api::{FinishReason, Usage};

/// What an answer repeats of its request (OpenAI's `response` carries its settings).
#[derive(Debug, Clone)]
pub(super) struct Echo {
    pub(super) instructions: Option<String>,
    pub(super) max_output_tokens: Option<u64>,
    pub(super) temperature: Option<f64>,
    pub(super) top_p: Option<f64>,
    pub(super) tools: Vec<Value>,
    pub(super) tool_choice: Value,
    pub(super) parallel_tool_calls: bool,
    pub(super) text: Value,
    pub(super) reasoning: Value,
    pub(super) metadata: BTreeMap<String, String>,
    pub(super) user: Option<String>,
}

/// A `response`.
#[derive(Serialize, ToSchema, Debug, Clone)]
pub(crate) struct ResponseObject {
    /// `resp_...`.
    pub(super) id: String,
    /// `response`.
    pub(super) object: &'static str,
    /// Seconds since the epoch.
    pub(super) created_at: u64,
    /// `in_progress` (a stream's first events), `completed`, `incomplete`
    /// (`max_output_tokens` reached), `cancelled` or `failed`.
    pub(super) status: &'static str,
    /// When it ended.
    pub(super) completed_at: Option<u64>,
    /// Why it failed.
    pub(super) error: Option<ResponseError>,
    /// Why it is incomplete.
    pub(super) incomplete_details: Option<IncompleteDetails>,
    /// The request's `instructions`.
    pub(super) instructions: Option<String>,
    /// The request's `max_output_tokens`.
    pub(super) max_output_tokens: Option<u64>,
    /// The request's `metadata`.
    pub(super) metadata: BTreeMap<String, String>,
    /// The `model` asked for (the pool's name when none was).
    pub(super) model: String,
    /// The answer's items.
    pub(super) output: Vec<OutputItem>,
    /// The request's `parallel_tool_calls`.
    pub(super) parallel_tool_calls: bool,
    /// Always null: responses are not stored, none is continued.
    pub(super) previous_response_id: Option<String>,
    /// The request's `reasoning`.
    pub(super) reasoning: Value,
    /// Always false: this worker stores no responses.
    pub(super) store: bool,
    /// The request's `temperature`.
    pub(super) temperature: Option<f64>,
    /// The request's `text`.
    pub(super) text: Value,
    /// The request's `tool_choice`.
    pub(super) tool_choice: Value,
    /// The request's `tools`.
    pub(super) tools: Vec<Value>,
    /// The request's `top_p`.
    pub(super) top_p: Option<f64>,
    /// Always `disabled`: the input is never cut.
    pub(super) truncation: &'static str,
    /// Token counts, once it ended.
    pub(super) usage: Option<ResponseUsage>,
    /// The request's `user`.
    pub(super) user: Option<String>,
    /// How it was routed and served.
    pub(super) mole: Option<MoleInfo>,
}

/// Why a response failed.
#[derive(Serialize, ToSchema, Debug, Clone)]
pub(crate) struct ResponseError {
    /// The error's stable code.
    pub(super) code: &'static str,
    /// What went wrong.
    pub(super) message: String,
}

/// Why a response is incomplete.
#[derive(Serialize, ToSchema, Debug, Clone)]
pub(crate) struct IncompleteDetails {
    /// `max_output_tokens` (or the context's end).
    pub(super) reason: &'static str,
}

/// A response's token counts.
#[derive(Serialize, ToSchema, Debug, Clone, Copy)]
pub(crate) struct ResponseUsage {
    /// Input tokens, images' included.
    pub(super) input_tokens: usize,
    /// What the input's count is made of.
    pub(super) input_tokens_details: InputTokensDetails,
    /// Generated tokens.
    pub(super) output_tokens: usize,
    /// What the output's count is made of.
    pub(super) output_tokens_details: OutputTokensDetails,
    /// Their sum.
    pub(super) total_tokens: usize,
}

/// `usage.input_tokens_details`.
#[derive(Serialize, ToSchema, Debug, Clone, Copy)]
pub(crate) struct InputTokensDetails {
    /// Input tokens the prefix cache gave (the caller's own reuse).
    pub(super) cached_tokens: usize,
}

/// `usage.output_tokens_details`.
#[derive(Serialize, ToSchema, Debug, Clone, Copy)]
pub(crate) struct OutputTokensDetails {
    /// Generated tokens whose text was reasoning.
    pub(super) reasoning_tokens: usize,
}

/// An output item.
#[derive(Serialize, ToSchema, Debug, Clone)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(crate) enum OutputItem {
    /// The model's reasoning (Qwen3's `<think>`...`</think>`).
    Reasoning {
        /// `rs_...`.
        id: String,
        /// Always empty: no summary is written.
        summary: Vec<Value>,
        /// The reasoning, one `reasoning_text` part.
        content: Vec<ReasoningContent>,
        /// `in_progress`, `completed` or `incomplete`.
        status: &'static str,
    },
    /// The answer's text.
    Message {
        /// `msg_...`.
        id: String,
        /// `assistant`.
        role: &'static str,
        /// `in_progress`, `completed` or `incomplete`.
        status: &'static str,
        /// One `output_text` part.
        content: Vec<OutputText>,
    },
    /// A function call.
    FunctionCall {
        /// `fc_...`.
        id: String,
        /// `call_...`, which the call's `function_call_output` names.
        call_id: String,
        /// The function.
        name: String,
        /// Its arguments, a JSON object's text.
        arguments: String,
        /// `in_progress`, `completed` or `incomplete`.
        status: &'static str,
    },
}

/// A message's text part.
#[derive(Serialize, ToSchema, Debug, Clone)]
pub(crate) struct OutputText {
    /// `output_text`.
    #[serde(rename = "type")]
    pub(super) kind: &'static str,
    /// The text.
    pub(super) text: String,
    /// Always empty.
    pub(super) annotations: Vec<Value>,
    /// Always empty: log probabilities are not served here.
    pub(super) logprobs: Vec<Value>,
}

/// A reasoning item's text part.
#[derive(Serialize, ToSchema, Debug, Clone)]
pub(crate) struct ReasoningContent {
    /// `reasoning_text`.
    #[serde(rename = "type")]
    pub(super) kind: &'static str,
    /// The text.
    pub(super) text: String,
}

/// One server-sent event of a response stream (see the module's doc): `event` names its
/// `type`, `data` is its JSON.
pub(crate) struct ResponseEvent;

impl utoipa::PartialSchema for ResponseEvent {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::extensions::ExtensionsBuilder;
        use utoipa::openapi::schema::{ObjectBuilder, Type};
        let event = json!({"type": "object", "required": ["type", "sequence_number"],
            "properties": {"type": {"type": "string"}, "sequence_number": {"type": "integer", "minimum": 0}}});
        let data = ObjectBuilder::new()
            .schema_type(Type::String)
            .description(Some("The event, JSON"))
            .content_media_type("application/json")
            .extensions(Some(
                ExtensionsBuilder::new()
                    .add("x-content-schema", event)
                    .build(),
            ));
        ObjectBuilder::new()
            .schema_type(Type::Object)
            .property("data", data)
            .required("data")
            .property(
                "event",
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .description(Some("The event's type")),
            )
            .into()
    }
}
impl ToSchema for ResponseEvent {}

/// An event: its type and its JSON.
pub(super) type Ev = (&'static str, Value);

/// The item being written.
#[derive(Debug)]
enum Open {
    Reasoning {
        id: String,
        text: String,
    },
    Message {
        id: String,
        text: String,
    },
    Call {
        id: String,
        call_id: String,
        name: String,
        arguments: String,
    },
}

/// A response being written (see the module's doc).
#[derive(Debug)]
pub(super) struct ResponseState {
    id: String,
    model: String,
    created_at: u64,
    echo: Echo,
    parser: OutputParser,
    output: Vec<OutputItem>,
    open: Option<Open>,
    seq: u64,
    reasoning_tokens: usize,
}

/// A fresh item id.
fn item_id(prefix: &str) -> String {
    use rand::Rng;
    let mut r = rand::rng();
    format!(
        "{prefix}_{:016x}{:08x}",
        r.random::<u64>(),
        r.random::<u32>()
    )
}

impl ResponseState {
    /// The response `id` of `model` answering a request that says `echo`, its text split by
    /// `spec`.
    pub(super) fn new(id: String, model: String, echo: Echo, spec: ParseSpec) -> Self {
        Self {
            id,
            model,
            created_at: now(),
            echo,
            parser: OutputParser::new(spec),
            output: Vec::new(),
            open: None,
            seq: 0,
            reasoning_tokens: 0,
        }
    }

    fn ev(&mut self, kind: &'static str, mut v: Value) -> Ev {
        v["type"] = json!(kind);
        v["sequence_number"] = json!(self.seq);
        self.seq += 1;
        (kind, v)
    }

    /// The response as it stands.
    fn object(
        &self,
        status: &'static str,
        usage: Option<&Usage>,
        mole: MoleInfo,
    ) -> ResponseObject {
        let e = &self.echo;
        ResponseObject {
            id: self.id.clone(),
            object: "response",
            created_at: self.created_at,
            status,
            completed_at: (status != "in_progress").then(now),
            error: None,
            incomplete_details: (status == "incomplete").then_some(IncompleteDetails {
                reason: "max_output_tokens",
            }),
            instructions: e.instructions.clone(),
            max_output_tokens: e.max_output_tokens,
            metadata: e.metadata.clone(),
            model: self.model.clone(),
            output: self.output.clone(),
            parallel_tool_calls: e.parallel_tool_calls,
            previous_response_id: None,
            reasoning: e.reasoning.clone(),
            store: false,
            temperature: e.temperature,
            text: e.text.clone(),
            tool_choice: e.tool_choice.clone(),
            tools: e.tools.clone(),
            top_p: e.top_p,
            truncation: "disabled",
            usage: usage.map(|u| ResponseUsage {
                input_tokens: u.prompt_tokens,
                input_tokens_details: InputTokensDetails {
                    cached_tokens: u.cached_tokens,
                },
                output_tokens: u.completion_tokens,
                output_tokens_details: OutputTokensDetails {
                    reasoning_tokens: self.reasoning_tokens.min(u.completion_tokens),
                },
                total_tokens: u.prompt_tokens + u.completion_tokens,
            }),
            user: e.user.clone(),
            mole: Some(mole),
        }
    }

    fn snapshot(&self, status: &'static str, mole: MoleInfo) -> Value {
        serde_json::to_value(self.object(status, None, mole)).unwrap_or_default()
    }

    /// The stream's first events.
    pub(super) fn started(&mut self, mole: MoleInfo) -> Vec<Ev> {
        let r = self.snapshot("in_progress", mole);
        vec![
            self.ev("response.created", json!({"response": r})),
            self.ev("response.in_progress", json!({"response": r})),
        ]
    }

    /// One token's text: the events of what it decided.
    pub(super) fn push(&mut self, text: &str) -> Vec<Ev> {
        // A token is reasoning when the reasoning had begun before it, or it began or wrote
        // it (the tags included).
        let before = self.parser.in_reasoning();
        let p = self.parser.push(text);
        if before || self.parser.in_reasoning() || !p.reasoning.is_empty() {
            self.reasoning_tokens += 1;
        }
        self.apply(p)
    }

    fn apply(&mut self, p: Parsed) -> Vec<Ev> {
        let mut out = Vec::new();
        if !p.reasoning.is_empty() {
            if !matches!(self.open, Some(Open::Reasoning { .. })) {
                self.close(&mut out, "completed");
                self.open_reasoning(&mut out);
            }
            let index = self.output.len();
            if let Some(Open::Reasoning { id, text }) = &mut self.open {
                text.push_str(&p.reasoning);
                let v = json!({"item_id": id, "output_index": index, "content_index": 0,
                               "delta": p.reasoning});
                let e = self.ev("response.reasoning_text.delta", v);
                out.push(e);
            }
        }
        if !p.content.is_empty() {
            if !matches!(self.open, Some(Open::Message { .. })) {
                self.close(&mut out, "completed");
                self.open_message(&mut out);
            }
            let index = self.output.len();
            if let Some(Open::Message { id, text }) = &mut self.open {
                text.push_str(&p.content);
                let v = json!({"item_id": id, "output_index": index, "content_index": 0,
                               "delta": p.content, "logprobs": []});
                let e = self.ev("response.output_text.delta", v);
                out.push(e);
            }
        }
        for piece in p.calls {
            if let Some(head) = piece.head {
                self.close(&mut out, "completed");
                self.open_call(&mut out, head);
            }
            if piece.arguments.is_empty() {
                continue;
            }
            let index = self.output.len();
            if let Some(Open::Call { id, arguments, .. }) = &mut self.open {
                arguments.push_str(&piece.arguments);
                let v = json!({"item_id": id, "output_index": index, "delta": piece.arguments});
                let e = self.ev("response.function_call_arguments.delta", v);
                out.push(e);
            }
        }
        out
    }

    fn open_reasoning(&mut self, out: &mut Vec<Ev>) {
        let id = item_id("rs");
        let index = self.output.len();
        let item = json!({"type": "reasoning", "id": id, "summary": [], "content": [],
                          "status": "in_progress"});
        let e = self.ev(
            "response.output_item.added",
            json!({"output_index": index, "item": item}),
        );
        out.push(e);
        let part = json!({"type": "reasoning_text", "text": ""});
        let e = self.ev(
            "response.content_part.added",
            json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
        );
        out.push(e);
        self.open = Some(Open::Reasoning {
            id,
            text: String::new(),
        });
    }

    fn open_message(&mut self, out: &mut Vec<Ev>) {
        let id = item_id("msg");
        let index = self.output.len();
        let item = json!({"type": "message", "id": id, "role": "assistant",
                          "status": "in_progress", "content": []});
        let e = self.ev(
            "response.output_item.added",
            json!({"output_index": index, "item": item}),
        );
        out.push(e);
        let part = json!({"type": "output_text", "text": "", "annotations": [], "logprobs": []});
        let e = self.ev(
            "response.content_part.added",
            json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
        );
        out.push(e);
        self.open = Some(Open::Message {
            id,
            text: String::new(),
        });
    }

    fn open_call(&mut self, out: &mut Vec<Ev>, head: CallHead) {
        let id = item_id("fc");
        let index = self.output.len();
        let item = json!({"type": "function_call", "id": id, "call_id": head.id,
                          "name": head.name, "arguments": "", "status": "in_progress"});
        let e = self.ev(
            "response.output_item.added",
            json!({"output_index": index, "item": item}),
        );
        out.push(e);
        self.open = Some(Open::Call {
            id,
            call_id: head.id,
            name: head.name,
            arguments: String::new(),
        });
    }

    /// Closes the item being written (`status` its status): its `.done` events, then it joins
    /// the output.
    fn close(&mut self, out: &mut Vec<Ev>, status: &'static str) {
        let Some(open) = self.open.take() else {
            return;
        };
        let index = self.output.len();
        let item = match open {
            Open::Reasoning { id, text } => {
                let v = json!({"item_id": id, "output_index": index, "content_index": 0,
                               "text": text});
                let e = self.ev("response.reasoning_text.done", v);
                out.push(e);
                let part = json!({"type": "reasoning_text", "text": text});
                let v = json!({"item_id": id, "output_index": index, "content_index": 0,
                               "part": part});
                let e = self.ev("response.content_part.done", v);
                out.push(e);
                OutputItem::Reasoning {
                    id,
                    summary: Vec::new(),
                    content: vec![ReasoningContent {
                        kind: "reasoning_text",
                        text,
                    }],
                    status,
                }
            }
            Open::Message { id, text } => {
                let v = json!({"item_id": id, "output_index": index, "content_index": 0,
                               "text": text, "logprobs": []});
                let e = self.ev("response.output_text.done", v);
                out.push(e);
                let part = json!({"type": "output_text", "text": text, "annotations": [],
                                  "logprobs": []});
                let v = json!({"item_id": id, "output_index": index, "content_index": 0,
                               "part": part});
                let e = self.ev("response.content_part.done", v);
                out.push(e);
                OutputItem::Message {
                    id,
                    role: "assistant",
                    status,
                    content: vec![OutputText {
                        kind: "output_text",
                        text,
                        annotations: Vec::new(),
                        logprobs: Vec::new(),
                    }],
                }
            }
            Open::Call {
                id,
                call_id,
                name,
                arguments,
            } => {
                let v = json!({"item_id": id, "output_index": index, "name": name,
                               "arguments": arguments});
                let e = self.ev("response.function_call_arguments.done", v);
                out.push(e);
                OutputItem::FunctionCall {
                    id,
                    call_id,
                    name,
                    arguments,
                    status,
                }
            }
        };
        let v = json!({"output_index": index, "item": item});
        let e = self.ev("response.output_item.done", v);
        out.push(e);
        self.output.push(item);
    }

    /// The end: what the parser held, the last item closed (an answer of nothing is one empty
    /// message), and the whole response with its `response.completed` (or `.incomplete`)
    /// event.
    pub(super) fn finish(
        &mut self,
        reason: FinishReason,
        usage: &Usage,
        mole: MoleInfo,
    ) -> (Vec<Ev>, ResponseObject) {
        let rest = self.parser.finish();
        let mut out = self.apply(rest);
        let (status, item_status, event) = match reason {
            FinishReason::Stop => ("completed", "completed", "response.completed"),
            FinishReason::Length => ("incomplete", "incomplete", "response.incomplete"),
            FinishReason::Cancelled => ("cancelled", "incomplete", "response.incomplete"),
        };
        if self.open.is_none() && self.output.is_empty() {
            self.open_message(&mut out);
        }
        self.close(&mut out, item_status);
        let r = self.object(status, Some(usage), mole);
        let v = json!({"response": r});
        let e = self.ev(event, v);
        out.push(e);
        (out, r)
    }

    /// A stream that fails after its events began: OpenAI's `error` event, then
    /// `response.failed`.
    pub(super) fn failed(&mut self, e: &ApiError, mole: MoleInfo) -> Vec<Ev> {
        let err = self.ev(
            "error",
            json!({"code": e.code, "message": e.message, "param": null}),
        );
        let mut r = self.object("failed", None, mole);
        r.error = Some(ResponseError {
            code: e.code,
            message: e.message.clone(),
        });
        let failed = self.ev("response.failed", json!({"response": r}));
        vec![err, failed]
    }
}

/// An event as the stream sends it.
pub(super) fn sse((kind, v): Ev) -> Event {
    Event::default().event(kind).data(v.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::router::{Decision, Mode};

    fn state(spec: ParseSpec) -> ResponseState {
        let echo = Echo {
            instructions: None,
            max_output_tokens: None,
            temperature: None,
            top_p: None,
            tools: Vec::new(),
            tool_choice: json!("auto"),
            parallel_tool_calls: true,
            text: json!({"format": {"type": "text"}}),
            reasoning: json!({"effort": null, "summary": null}),
            metadata: BTreeMap::new(),
            user: None,
        };
        ResponseState::new("resp_1".into(), "m".into(), echo, spec)
    }

    fn mole() -> MoleInfo {
        MoleInfo::new(
            &Decision {
                adapter: None,
                reason: "fallback".into(),
                score: None,
                mode: Mode::Base,
            },
            None,
        )
    }

    /// Reasoning, text and a call, token by token: the events come in OpenAI's order, their
    /// sequence numbers count up from 0, every delta joins to its item's whole text, and the
    /// closing event carries exactly the output the whole answer has.
    #[test]
    fn the_events_join_to_the_whole_response() {
        let spec = ParseSpec {
            reasoning: Some(super::super::parse::Start::Sniff),
            tools: true,
        };
        let text = "<think>hmm</think>\n\nSure.<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>";
        let mut s = state(spec);
        let mut events = s.started(mole());
        for c in text.chars() {
            events.extend(s.push(&c.to_string()));
        }
        let usage = Usage {
            prompt_tokens: 5,
            completion_tokens: text.chars().count(),
            cached_tokens: 0,
        };
        let (last, whole) = s.finish(FinishReason::Stop, &usage, mole());
        events.extend(last);
        for (i, (_, v)) in events.iter().enumerate() {
            assert_eq!(v["sequence_number"], i, "{v}");
        }
        let kinds: Vec<&str> = events.iter().map(|(k, _)| *k).collect();
        let mut dedup = kinds.clone();
        dedup.dedup();
        assert_eq!(
            dedup,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        let joined = |kind: &str| -> String {
            events
                .iter()
                .filter(|(k, _)| *k == kind)
                .map(|(_, v)| v["delta"].as_str().unwrap())
                .collect()
        };
        assert_eq!(joined("response.reasoning_text.delta"), "hmm");
        assert_eq!(joined("response.output_text.delta"), "Sure.");
        assert_eq!(
            joined("response.function_call_arguments.delta"),
            "{\"a\": 1}"
        );
        let out = serde_json::to_value(&whole.output).unwrap();
        assert_eq!(out[0]["type"], "reasoning");
        assert_eq!(out[0]["content"][0]["text"], "hmm");
        assert_eq!(out[1]["content"][0]["text"], "Sure.");
        assert_eq!(
            (&out[2]["name"], &out[2]["arguments"]),
            (&json!("f"), &json!("{\"a\": 1}"))
        );
        assert!(out[2]["call_id"].as_str().unwrap().starts_with("call_"));
        let (_, completed) = events.last().unwrap();
        assert_eq!(completed["response"]["output"], out);
        assert_eq!(completed["response"]["status"], "completed");
        // `>` of `<think>` (the tag's last piece opens the reasoning), `hmm`, `</think>`.
        assert_eq!(
            whole.usage.unwrap().output_tokens_details.reasoning_tokens,
            12
        );
        // Items done carry what their deltas made.
        let done: Vec<&Value> = events
            .iter()
            .filter(|(k, _)| *k == "response.output_item.done")
            .map(|(_, v)| &v["item"])
            .collect();
        assert_eq!(Value::Array(done.into_iter().cloned().collect()), out);
    }

    /// An answer of nothing is one empty message; one cut by max_output_tokens is incomplete.
    #[test]
    fn empty_and_cut_answers() {
        let spec = ParseSpec {
            reasoning: None,
            tools: false,
        };
        let u = Usage::default();
        let mut s = state(spec);
        let (_, r) = s.finish(FinishReason::Stop, &u, mole());
        let out = serde_json::to_value(&r.output).unwrap();
        assert_eq!(
            out,
            json!([{"type": "message", "id": out[0]["id"], "role": "assistant",
            "status": "completed", "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}])
        );
        let mut s = state(spec);
        s.push("abc");
        let (events, r) = s.finish(FinishReason::Length, &u, mole());
        assert_eq!(r.status, "incomplete");
        assert_eq!(r.incomplete_details.unwrap().reason, "max_output_tokens");
        assert_eq!(events.last().unwrap().0, "response.incomplete");
    }
}
