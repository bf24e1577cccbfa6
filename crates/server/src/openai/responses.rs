//! OpenAI's Responses API (`POST /v1/responses`), as vLLM serves it: the request's `input`
//! (a text, or items: messages, `function_call`s and their `function_call_output`s, `reasoning`
//! items) and `instructions` become a chat, rendered by the model's template; `tools`,
//! `tool_choice` and `text.format` become chat's tools and structured outputs, so they take the
//! same grammar path. The answer is written by [`super::response_out`].
//!
//! mole stores no responses: `store` reads false in every answer, `previous_response_id` and
//! `conversation` are refused (the client sends the conversation as `input`, as the Agents SDK
//! does by default), and `GET`/`DELETE /v1/responses/{id}` answer 404 `response_not_found`.
//! A pool's pods share no state and a load balancer sends each request to any of them: a
//! per-pod store would answer a follow-up only when it lands where the first did.

use std::collections::HashMap;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use serde_json::{json, Value};

use mole_api::WorkerLimits;

use super::body::Fields;
use super::chat::{chat_request, Conversation};
use super::extract::RawBody;
use super::generate::serve;
use super::guided::{Guides, JsonSchemaSpec, ResponseFormat};
use super::images::{self, ImageSource};
use super::parse::ParseSpec;
use super::request_bodies::responses::{
    Effort, Input, InputItem, InputRole, ItemContent, ItemPart, ResponseTool, ResponseToolChoice,
    ResponseToolFields, ResponsesBody, TextFormat,
};
use super::request_bodies::{Arguments, Common, Kind};
use super::response_out::{Echo, ResponseEvent, ResponseObject};
use super::tools::{
    FunctionDef, FunctionName, NamedFunction, Tool, ToolChoice, ToolFields, ToolMode,
};
use super::validate::{prepare_request, tool_call_value, ValidRequest, Validate};
use super::S;
use crate::error::bad;
use crate::error::Refusals;
use crate::{ApiError, AppState};
use mole_engine::api::{ChatMessage, ContentPart, EngineError};

/// The longest `metadata` key and value, and the most keys (OpenAI's bounds).
const METADATA_KEY_CHARS: usize = 64;
const METADATA_VALUE_CHARS: usize = 512;
const METADATA_KEYS: usize = 16;

impl Validate for ResponsesBody {
    /// The input as a chat (see [`conversation`]), its tools and format as chat's: the same
    /// template, grammar and parser path; the answer is a `response`.
    fn validate(
        fields: Fields,
        forward: Option<Bytes>,
        s: &AppState,
    ) -> Result<ValidRequest, ApiError> {
        let b = ResponsesBody::read(fields)?;
        let o = b.own;
        if let Some(m) = &o.metadata {
            let bad_entry = m.iter().find(|(k, v)| {
                k.chars().count() > METADATA_KEY_CHARS || v.chars().count() > METADATA_VALUE_CHARS
            });
            if m.len() > METADATA_KEYS || bad_entry.is_some() {
                return Err(bad(
                    "invalid_metadata",
                    format!(
                        "metadata: at most {METADATA_KEYS} keys of {METADATA_KEY_CHARS} \
                         characters, values of {METADATA_VALUE_CHARS}"
                    ),
                ));
            }
        }
        let text = o.text.unwrap_or_default();
        if text.verbosity.as_deref().is_some_and(|v| v != "medium") {
            return Err(bad(
                "unsupported_field",
                "text.verbosity is not supported by this worker (an answer length the model \
                 is told); it accepts null or \"medium\"",
            ));
        }
        let reasoning = o.reasoning.unwrap_or_default();
        // No summaries are written and nothing is encrypted (the reasoning is the item's
        // content, given back as it is): asking for either changes nothing else.
        tracing::debug!(
            summary = ?reasoning.summary.or(reasoning.generate_summary),
            include = ?o.include,
            "reasoning summary and encrypted content not written"
        );
        let limits = s.cfg().limits.clone();
        let vision = s.info.model_info().vision;
        let (msgs, images) = conversation(o.input, o.instructions.clone(), &limits, vision)?;
        let mut kwargs = o.chat_template_kwargs;
        if let Some(e) = reasoning.effort {
            kwargs.insert("reasoning_effort".into(), Value::from(e.name()));
        }
        let conv = Conversation {
            msgs,
            images,
            kwargs,
            add_special_tokens: false,
        };
        let echo = Echo {
            instructions: o.instructions,
            max_output_tokens: o.max_output_tokens,
            temperature: b.common.temperature,
            top_p: b.common.top_p,
            tools: echo_tools(b.tools.tools.as_deref()),
            tool_choice: echo_tool_choice(b.tools.tool_choice.as_ref()),
            parallel_tool_calls: b.tools.parallel_tool_calls.unwrap_or(true),
            text: echo_text(text.format.as_ref()),
            reasoning: json!({"effort": reasoning.effort.map(Effort::name), "summary": null}),
            metadata: o.metadata.unwrap_or_default(),
            user: b.common.user.clone(),
        };
        let tools = chat_tools(b.tools);
        let guides = Guides {
            response_format: text.format.map(|f| match f {
                TextFormat::Text => ResponseFormat::Text,
                TextFormat::JsonObject => ResponseFormat::JsonObject { schema: None },
                TextFormat::JsonSchema { schema, strict, .. } => ResponseFormat::JsonSchema {
                    json_schema: JsonSchemaSpec { schema, strict },
                },
            }),
            ..Guides::default()
        };
        // `max_output_tokens` is chat's `max_tokens`.
        let common = Common {
            max_tokens: o.max_output_tokens,
            ..b.common
        };
        let mut req = chat_request(s, Kind::Response, conv, tools, guides, common, forward)?;
        // The answer is always split into items: reasoning, messages, function calls.
        req.parse.get_or_insert(ParseSpec {
            reasoning: None,
            tools: false,
        });
        req.echo = Some(echo);
        Ok(req)
    }
}

/// The Responses API's tools as chat's.
fn chat_tools(t: ResponseToolFields) -> ToolFields {
    let tools = t.tools.map(|ts| {
        ts.into_iter()
            .map(
                |ResponseTool::Function {
                     name,
                     description,
                     parameters,
                     strict,
                 }| Tool {
                    _kind: super::tools::FunctionTag,
                    function: FunctionDef {
                        name,
                        description,
                        parameters,
                        strict,
                    },
                },
            )
            .collect()
    });
    let tool_choice = t.tool_choice.map(|c| match c {
        ResponseToolChoice::Mode(m) => ToolChoice::Mode(m),
        ResponseToolChoice::Function(f) => ToolChoice::Function(NamedFunction {
            _kind: super::tools::FunctionTag,
            function: FunctionName { name: f.name },
        }),
    });
    ToolFields {
        tools,
        tool_choice,
        parallel_tool_calls: t.parallel_tool_calls,
    }
}

/// The tools as the answer repeats them.
fn echo_tools(tools: Option<&[ResponseTool]>) -> Vec<Value> {
    tools
        .unwrap_or_default()
        .iter()
        .map(
            |ResponseTool::Function {
                 name,
                 description,
                 parameters,
                 strict,
             }| {
                json!({"type": "function", "name": name, "description": description,
                   "parameters": parameters, "strict": strict.unwrap_or(false)})
            },
        )
        .collect()
}

/// The tool choice as the answer repeats it.
fn echo_tool_choice(c: Option<&ResponseToolChoice>) -> Value {
    match c {
        None | Some(ResponseToolChoice::Mode(ToolMode::Auto)) => json!("auto"),
        Some(ResponseToolChoice::Mode(ToolMode::None)) => json!("none"),
        Some(ResponseToolChoice::Mode(ToolMode::Required)) => json!("required"),
        Some(ResponseToolChoice::Function(f)) => json!({"type": "function", "name": f.name}),
    }
}

/// The format as the answer repeats it.
fn echo_text(f: Option<&TextFormat>) -> Value {
    let format = match f {
        None | Some(TextFormat::Text) => json!({"type": "text"}),
        Some(TextFormat::JsonObject) => json!({"type": "json_object"}),
        Some(TextFormat::JsonSchema {
            name,
            schema,
            strict,
        }) => json!({
            "type": "json_schema", "name": name, "schema": schema.0, "strict": strict.unwrap_or(false),
        }),
    };
    json!({"format": format, "verbosity": "medium"})
}

/// An assistant turn being gathered from consecutive items: a reasoning item, a message, its
/// function calls (one turn, as an answer's output items are).
#[derive(Default)]
struct Turn {
    reasoning: String,
    content: String,
    calls: Vec<Value>,
    started: bool,
}

impl Turn {
    /// The turn as a message, if anything was gathered.
    fn take(&mut self) -> Option<ChatMessage> {
        if !std::mem::take(&mut self.started) {
            return None;
        }
        let mut m = ChatMessage::text("assistant", std::mem::take(&mut self.content));
        if !self.calls.is_empty() {
            m.extra.insert(
                "tool_calls".into(),
                Value::Array(std::mem::take(&mut self.calls)),
            );
        }
        if !self.reasoning.is_empty() {
            m.extra.insert(
                "reasoning_content".into(),
                Value::String(std::mem::take(&mut self.reasoning)),
            );
        }
        Some(m)
    }
}

/// `input` (and `instructions`, a system message first) as chat messages and their images: a
/// message item is a message; an answer's reasoning, message and `function_call`s make one
/// assistant turn with `tool_calls` (arguments parsed, as chat's history is); a
/// `function_call_output` is a `tool` message naming its call, which must be one of an
/// earlier `function_call` (400 `unknown_call_id` otherwise). Images as chat's (400
/// `images_not_supported` on a text pool).
pub(super) fn conversation(
    input: Input,
    instructions: Option<String>,
    limits: &WorkerLimits,
    vision: bool,
) -> Result<(Vec<ChatMessage>, Vec<ImageSource>), ApiError> {
    let mut msgs = Vec::new();
    let mut images = Vec::new();
    if let Some(i) = instructions {
        msgs.push(ChatMessage::text("system", i));
    }
    let items = match input {
        Input::Text(t) => {
            msgs.push(ChatMessage::text("user", t));
            return Ok((msgs, images));
        }
        Input::Items(items) if items.is_empty() => {
            return Err(bad("invalid_input", "input must not be an empty array"))
        }
        Input::Items(items) => items,
    };
    let mut calls: HashMap<String, String> = HashMap::new();
    let mut turn = Turn::default();
    for (i, item) in items.into_iter().enumerate() {
        match item {
            InputItem::Reasoning(r) => {
                // A new answer's reasoning opens a new turn.
                if !turn.content.is_empty() || !turn.calls.is_empty() {
                    msgs.extend(turn.take());
                }
                turn.started = true;
                let texts = r.content.unwrap_or_default().into_iter().chain(r.summary);
                for t in texts {
                    turn.reasoning.push_str(&t.text);
                }
            }
            InputItem::FunctionCall(c) => {
                let args = Arguments::Text(c.arguments);
                let value = tool_call_value(Some(c.call_id.clone()), c.name.clone(), args)
                    .map_err(|e| bad("invalid_input", format!("input[{i}]: {e}")))?;
                calls.insert(c.call_id, c.name);
                turn.started = true;
                turn.calls.push(value);
            }
            InputItem::FunctionCallOutput(o) => {
                msgs.extend(turn.take());
                let Some(name) = calls.get(&o.call_id) else {
                    return Err(bad(
                        "unknown_call_id",
                        format!(
                            "input[{i}]: function_call_output names call_id {:?}, which no \
                             function_call earlier in input made",
                            o.call_id
                        ),
                    ));
                };
                let (text, _) = content(o.output, i, limits, vision, &mut images, false)?;
                let mut m = ChatMessage::text("tool", text);
                m.extra
                    .insert("tool_call_id".into(), Value::String(o.call_id));
                m.extra.insert("name".into(), Value::String(name.clone()));
                msgs.push(m);
            }
            InputItem::Message(m) if m.role == InputRole::Assistant => {
                // A second message of one answer (or after its calls) is a turn of its own.
                if !turn.content.is_empty() || !turn.calls.is_empty() {
                    msgs.extend(turn.take());
                }
                let (text, _) = content(m.content, i, limits, vision, &mut images, false)?;
                turn.started = true;
                turn.content.push_str(&text);
            }
            InputItem::Message(m) => {
                msgs.extend(turn.take());
                let role = match m.role {
                    InputRole::User => "user",
                    _ => "system",
                };
                let (text, parts) = content(m.content, i, limits, vision, &mut images, true)?;
                let mut msg = ChatMessage::text(role, text);
                msg.parts = parts;
                msgs.push(msg);
            }
        }
    }
    msgs.extend(turn.take());
    Ok((msgs, images))
}

/// A content's text and, when it has images, its parts in order (their sources appended to
/// `images`); images only where `images_allowed` (a message of the user or system).
fn content(
    c: ItemContent,
    i: usize,
    limits: &WorkerLimits,
    vision: bool,
    images: &mut Vec<ImageSource>,
    images_allowed: bool,
) -> Result<(String, Vec<ContentPart>), ApiError> {
    let parts = match c {
        ItemContent::Text(t) => return Ok((t, Vec::new())),
        ItemContent::Parts(p) => p,
    };
    let mut text = String::new();
    let mut out = Vec::new();
    for (j, p) in parts.into_iter().enumerate() {
        match p {
            ItemPart::InputText { text: t }
            | ItemPart::OutputText { text: t }
            | ItemPart::Refusal { refusal: t } => {
                text.push_str(&t);
                out.push(ContentPart::Text(t));
            }
            ItemPart::InputImage { image_url, file_id } => {
                if !images_allowed {
                    return Err(bad(
                        "invalid_input",
                        format!("input[{i}].content[{j}]: images go in user and system messages"),
                    ));
                }
                if !vision {
                    return Err(EngineError::ImagesNotSupported.into());
                }
                let Some(url) = image_url.filter(|_| file_id.is_none()) else {
                    return Err(bad(
                        "invalid_input",
                        format!(
                            "input[{i}].content[{j}]: an image is sent as image_url (file_id \
                             needs the Files API, which mole does not serve)"
                        ),
                    ));
                };
                let field = format!("input[{i}].content[{j}].image_url");
                images.push(images::source(&url, &field, limits)?);
                images::check_count(images.len(), limits)?;
                out.push(ContentPart::Image);
            }
        }
    }
    // Text parts alone are plain text to the template.
    if !out.iter().any(|p| matches!(p, ContentPart::Image)) {
        out.clear();
    }
    Ok((text, out))
}

/// `POST /v1/responses`: OpenAI's Responses API (see the module's doc), routed and served as
/// chats are, answered as a `response` or streamed as its events.
#[utoipa::path(post, path = "/v1/responses", tag = "openai",
    request_body = ResponsesBody,
    responses(
        (status = 200, description = "The response; with `stream: true`, the Responses API's events (`response.created` ... `response.completed`) as server-sent events",
            content((ResponseObject = "application/json"), (ResponseEvent = "text/event-stream"))),
        Refusals,
    ),
    security(("bearer" = [])))]
pub async fn create_response(
    State(s): S,
    headers: HeaderMap,
    body: RawBody,
) -> Result<Response, ApiError> {
    let deadline = s.deadline();
    let req = prepare_request::<ResponsesBody>(&s, body, deadline).await?;
    serve(&s, &headers, req, deadline).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conv(input: Value) -> Result<Vec<ChatMessage>, ApiError> {
        let input: Input = serde_json::from_value(input).unwrap();
        conversation(
            input,
            Some("be brief".into()),
            &WorkerLimits::default(),
            false,
        )
        .map(|c| c.0)
    }

    /// A tool loop as the Agents SDK sends it back: the answer's reasoning, message and calls
    /// are one assistant turn whose calls the template reads as chat's `tool_calls`; each
    /// output is a tool message naming its call.
    #[test]
    fn items_become_a_chat() {
        let msgs = conv(json!([
            {"role": "user", "content": "weather in Paris and Rome?"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "two calls"}]},
            {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
             "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
            {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "w", "arguments": "{\"city\": \"Paris\"}"},
            {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{\"city\": \"Rome\"}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
        ]))
        .unwrap();
        let roles: Vec<&str> = msgs.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool", "tool"]);
        assert_eq!(msgs[0].content, "be brief");
        let turn = &msgs[2];
        assert_eq!(turn.content, "Checking.");
        assert_eq!(turn.extra["reasoning_content"], "two calls");
        assert_eq!(
            turn.extra["tool_calls"],
            json!([
                {"id": "c1", "type": "function", "function": {"name": "w", "arguments": {"city": "Paris"}}},
                {"id": "c2", "type": "function", "function": {"name": "w", "arguments": {"city": "Rome"}}},
            ])
        );
        assert_eq!(
            (
                msgs[3].content.as_str(),
                &msgs[3].extra["tool_call_id"],
                &msgs[3].extra["name"]
            ),
            ("sunny", &json!("c1"), &json!("w"))
        );
        assert_eq!(msgs[4].content, "rain");
        // A text is one user message.
        let msgs = conv(json!("hi")).unwrap();
        assert_eq!(
            (msgs[1].role.as_str(), msgs[1].content.as_str()),
            ("user", "hi")
        );
    }

    #[test]
    fn bad_items_are_refused_with_their_codes() {
        let code = |v: Value| conv(v).unwrap_err().code;
        assert_eq!(
            code(json!([{"type": "function_call_output", "call_id": "nope", "output": "x"}])),
            "unknown_call_id"
        );
        assert_eq!(code(json!([])), "invalid_input");
        assert_eq!(
            code(json!([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}])),
            "invalid_input"
        );
        assert_eq!(
            code(
                json!([{"role": "user", "content": [{"type": "input_image", "image_url": "AAEC"}]}])
            ),
            "images_not_supported"
        );
        // Unknown item types fail the parse, with the input's code.
        let f = crate::openai::body::Fields::parse(
            json!({"input": [{"type": "web_search_call", "id": "x"}]})
                .to_string()
                .as_bytes(),
        )
        .unwrap();
        assert_eq!(ResponsesBody::read(f).unwrap_err().code, "invalid_input");
    }
}
