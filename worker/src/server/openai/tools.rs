//! Tool calls in the Hermes format of Qwen2.5, Qwen3 and QwQ (vLLM's `hermes` parser): the
//! request's `tools` reach the chat template as transformers passes them (`tools=`), the
//! model's `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` come back as OpenAI
//! `tool_calls` ([`super::parse`]). `tool_choice: "required"` and a named function are
//! enforced by a grammar whose `arguments` are the function's `parameters` schema, so they
//! always validate; `auto` lets the model choose; `none` parses nothing.

use serde_json::{json, Value};

use mole_api::ToolCallParser;

use crate::engine::grammar::Guide;
use crate::server::error::bad;
use crate::server::ApiError;

/// The tool fields of a chat body, for the OpenAPI document (read from the raw body).
#[derive(serde::Deserialize, utoipa::ToSchema, Default)]
#[allow(dead_code)] // read by `read` from the raw body; typed here for the OpenAPI document
pub(in crate::server) struct ToolFields {
    /// OpenAI's `[{"type": "function", "function": {"name", "description", "parameters"}}]`.
    #[serde(default)]
    pub(super) tools: Option<Vec<Value>>,
    /// `"none"`, `"auto"` (default with tools), `"required"`, or `{"type": "function",
    /// "function": {"name": ...}}`.
    #[serde(default)]
    pub(super) tool_choice: Option<Value>,
    /// Whether the model may call several tools in one answer (default true).
    #[serde(default)]
    pub(super) parallel_tool_calls: Option<bool>,
}

/// What a request asks of tools.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct ToolRequest {
    /// The tools as sent (what the template gets).
    pub(super) tools: Vec<Value>,
    /// The model's calls are parsed (not `none`).
    pub(super) parse: bool,
    /// The grammar that forces a call (`required` or a named function).
    pub(super) forced: Option<Guide>,
}

/// One function of `tools`: its name and parameters schema.
fn function(t: &Value, i: usize) -> Result<(&str, Value), ApiError> {
    let invalid = |why: &str| bad("invalid_tools", format!("tools[{i}]: {why}"));
    if t.get("type").and_then(Value::as_str) != Some("function") {
        return Err(invalid("type must be \"function\""));
    }
    let f = t
        .get("function")
        .filter(|f| f.is_object())
        .ok_or_else(|| invalid("function must be an object"))?;
    let name = f
        .get("name")
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
        .ok_or_else(|| invalid("function.name must be a non-empty string"))?;
    let params = match f.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object"}),
        Some(p) if p.is_object() => p.clone(),
        Some(_) => return Err(invalid("function.parameters must be a JSON schema object")),
    };
    Ok((name, params))
}

/// Reads `tools`, `tool_choice` and `parallel_tool_calls` from `raw`. `format` is the pool's
/// tool-call format: tools sent to a model whose format mole does not know are refused
/// (400 `tools_not_supported`), never ignored.
pub(super) fn read(
    raw: &Value,
    format: Option<ToolCallParser>,
) -> Result<Option<ToolRequest>, ApiError> {
    let tools = match raw.get("tools") {
        None | Some(Value::Null) => None,
        Some(Value::Array(t)) if t.is_empty() => None,
        Some(Value::Array(t)) => Some(t.clone()),
        Some(_) => return Err(bad("invalid_tools", "tools must be an array")),
    };
    let choice = raw.get("tool_choice").filter(|v| !v.is_null());
    let Some(tools) = tools else {
        return match choice.and_then(Value::as_str) {
            None | Some("none") => Ok(None),
            Some(_) => Err(bad(
                "invalid_tool_choice",
                "tool_choice other than none needs tools",
            )),
        };
    };
    if format.is_none() {
        return Err(bad(
            "tools_not_supported",
            "this model's tool-call format is unknown: its chat template names no \
             <tool_call>, and the pool sets no baseModel.toolCallParser (hermes)",
        ));
    }
    let funcs: Vec<(&str, Value)> = tools
        .iter()
        .enumerate()
        .map(|(i, t)| function(t, i))
        .collect::<Result<_, _>>()?;
    let parallel = match raw.get("parallel_tool_calls") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(bad(
                "invalid_tool_choice",
                "parallel_tool_calls must be a boolean",
            ))
        }
    };
    let (parse, forced) = match choice {
        None => (true, None),
        Some(Value::String(s)) => match s.as_str() {
            "auto" => (true, None),
            "none" => (false, None),
            "required" => (true, Some(call_grammar(&funcs, parallel))),
            other => {
                return Err(bad(
                    "invalid_tool_choice",
                    format!(
                        "tool_choice must be none, auto, required or a function, got {other:?}"
                    ),
                ))
            }
        },
        Some(v) => {
            let name = v
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    bad(
                        "invalid_tool_choice",
                        "tool_choice must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    )
                })?;
            let one: Vec<(&str, Value)> =
                funcs.iter().filter(|(n, _)| *n == name).cloned().collect();
            if one.is_empty() {
                return Err(bad(
                    "invalid_tool_choice",
                    format!("tool_choice names {name:?}, which is not among tools"),
                ));
            }
            (true, Some(call_grammar(&one, false)))
        }
    };
    Ok(Some(ToolRequest {
        tools,
        parse,
        forced,
    }))
}

/// The Lark grammar of one Hermes call to one of `funcs` (or several calls, one per line,
/// when `parallel`): `<tool_call>\n{"name": <one of them>, "arguments": <its parameters>}\n
/// </tool_call>`, the JSON part llguidance's `%json` of a schema whose `anyOf` pairs each name
/// with its parameters.
pub(super) fn call_grammar(funcs: &[(&str, Value)], parallel: bool) -> Guide {
    let alts: Vec<Value> = funcs
        .iter()
        .map(|(name, params)| {
            json!({
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": false,
            })
        })
        .collect();
    let schema = crate::engine::grammar::compact(&match alts.len() {
        1 => alts[0].clone(),
        _ => json!({"anyOf": alts}),
    });
    let calls = if parallel {
        "call (\"\\n\" call)*"
    } else {
        "call"
    };
    // A few whitespace characters may come first (Qwen3 writes "\n\n" after `</think>`).
    Guide::Lark(format!(
        "start: calls | WS calls\ncalls: {calls}\nWS: /[ \\t\\r\\n]{{1,4}}/\n\
         call: \"<tool_call>\\n\" args \"\\n</tool_call>\"\nargs: %json {schema}\n"
    ))
}

/// The tools section Qwen2.5's and Qwen3's templates write, for a template that has none
/// (the model is told its tools in the system prompt, as vLLM does for such templates when a
/// pool declares the format).
pub(super) fn system_section(tools: &[Value]) -> String {
    let mut s = String::from(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
         You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
    );
    for t in tools {
        s.push('\n');
        s.push_str(&crate::engine::pyjson::dumps(t, None));
    }
    s.push_str(
        "\n</tools>\n\nFor each function call, return a json object with function name and \
         arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": \
         <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                "required": ["city"]}}})
    }

    #[test]
    fn choices_read_and_refusals_name_the_problem() {
        let hermes = Some(ToolCallParser::Hermes);
        let r = read(&json!({"tools": [weather()]}), hermes)
            .unwrap()
            .unwrap();
        assert!(r.parse && r.forced.is_none());
        let r = read(
            &json!({"tools": [weather()], "tool_choice": "none"}),
            hermes,
        )
        .unwrap()
        .unwrap();
        assert!(!r.parse && r.forced.is_none());
        let r = read(
            &json!({"tools": [weather()], "tool_choice": "required"}),
            hermes,
        )
        .unwrap()
        .unwrap();
        let Some(Guide::Lark(g)) = r.forced else {
            panic!("a grammar")
        };
        assert!(
            g.contains("get_weather") && g.contains("(\"\\n\" call)*"),
            "{g}"
        );
        let named = json!({"tools": [weather()], "parallel_tool_calls": true,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}});
        let Some(Guide::Lark(g)) = read(&named, hermes).unwrap().unwrap().forced else {
            panic!("a grammar")
        };
        assert!(g.contains("calls: call\n"), "{g}");
        let code = |v: Value, f| read(&v, f).unwrap_err().code;
        assert_eq!(
            code(json!({"tools": [weather()]}), None),
            "tools_not_supported"
        );
        assert_eq!(
            code(json!({"tools": [{"type": "function"}]}), hermes),
            "invalid_tools"
        );
        assert_eq!(
            code(
                json!({"tools": [weather()], "tool_choice": {"type": "function", "function": {"name": "x"}}}),
                hermes
            ),
            "invalid_tool_choice"
        );
        assert_eq!(
            code(json!({"tool_choice": "required"}), hermes),
            "invalid_tool_choice"
        );
        assert_eq!(read(&json!({"tool_choice": "none"}), None).unwrap(), None);
    }
}
