//! Tool calls in the Hermes format of Qwen2.5, Qwen3 and QwQ (vLLM's `hermes` parser): the
//! request's `tools` reach the chat template as transformers passes them (`tools=`), the
//! model's `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` come back as OpenAI
//! `tool_calls` ([`super::parse`]). `tool_choice: "required"` and a named function are
//! enforced by a grammar whose `arguments` are the function's `parameters` schema, so they
//! always validate; `auto` lets the model choose; `none` parses nothing.

use serde::Deserialize;
use serde_json::{json, Map, Value};
use utoipa::ToSchema;

use mole_api::ToolCallParser;

use crate::error::bad;
use crate::ApiError;
use mole_engine::grammar::Guide;

/// The tool fields of a chat body.
#[derive(Deserialize, ToSchema, Default, Debug)]
pub(crate) struct ToolFields {
    /// OpenAI's `[{"type": "function", "function": {"name", "description", "parameters"}}]`.
    #[serde(default)]
    pub(super) tools: Option<Vec<Tool>>,
    /// `"none"`, `"auto"` (default with tools), `"required"`, or `{"type": "function",
    /// "function": {"name": ...}}`; other than `none` only beside tools.
    #[serde(default)]
    pub(super) tool_choice: Option<ToolChoice>,
    /// Whether the model may call several tools in one answer (default true).
    #[serde(default)]
    pub(super) parallel_tool_calls: Option<bool>,
}

/// A tool: a function.
#[derive(Deserialize, ToSchema, Debug, Clone)]
pub(crate) struct Tool {
    /// `function`.
    #[serde(rename = "type")]
    pub(super) _kind: FunctionTag,
    /// The function.
    pub(super) function: FunctionDef,
}

/// A function the model may call.
#[derive(Deserialize, ToSchema, Debug, Clone)]
pub(crate) struct FunctionDef {
    /// Its name.
    #[schema(min_length = 1)]
    pub(super) name: String,
    /// What it does (the template tells the model).
    #[serde(default)]
    pub(super) description: Option<String>,
    /// A JSON schema of its arguments (default: any object).
    #[serde(default)]
    pub(super) parameters: Option<Map<String, Value>>,
    /// OpenAI's `strict`: with `true` a forced call's arguments follow every keyword of
    /// `parameters` or the request is refused naming the keyword; otherwise what cannot be
    /// enforced is approximated (see `response_format`).
    #[serde(default)]
    pub(super) strict: Option<bool>,
}

super::tag!(FunctionTag, "function");

/// `tool_choice`.
#[derive(Deserialize, ToSchema, Debug, Clone)]
#[serde(
    untagged,
    expecting = "none, auto, required, or {\"type\": \"function\", \"function\": {\"name\": ...}}"
)]
pub(crate) enum ToolChoice {
    /// `none`, `auto` or `required`.
    Mode(ToolMode),
    /// One function by name.
    Function(NamedFunction),
}

/// How tools may be used.
#[derive(Deserialize, ToSchema, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub(crate) enum ToolMode {
    /// No call is parsed (the tools are still rendered).
    None,
    /// The model decides.
    Auto,
    /// At least one call, by grammar.
    Required,
}

/// A function named by `tool_choice`.
#[derive(Deserialize, ToSchema, Debug, Clone)]
pub(crate) struct NamedFunction {
    /// `function`.
    #[serde(rename = "type")]
    pub(super) _kind: FunctionTag,
    /// The function.
    pub(super) function: FunctionName,
}

/// A function's name.
#[derive(Deserialize, ToSchema, Debug, Clone)]
pub(crate) struct FunctionName {
    /// The name, one of `tools`'.
    pub(super) name: String,
}

/// What a request asks of tools.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct ToolRequest {
    /// The tools as the template gets them (`{"type": "function", "function": {...}}`).
    pub(super) tools: Vec<Value>,
    /// The model's calls are parsed (not `none`).
    pub(super) parse: bool,
    /// The grammar that forces a call (`required` or a named function).
    pub(super) forced: Option<Guide>,
    /// With `auto`: the Lark rules of calls to any of the tools (`calls`, `WS`), for an
    /// answer that is either calls or a structured output (see [`super::outputs::finish`]).
    pub(super) calls: Option<String>,
}

/// A function as the template gets it.
fn template_tool(f: &FunctionDef) -> Value {
    let mut function = Map::new();
    function.insert("name".into(), Value::from(f.name.clone()));
    if let Some(d) = &f.description {
        function.insert("description".into(), Value::from(d.clone()));
    }
    if let Some(p) = &f.parameters {
        function.insert("parameters".into(), Value::Object(p.clone()));
    }
    if let Some(s) = f.strict {
        function.insert("strict".into(), Value::Bool(s));
    }
    json!({"type": "function", "function": function})
}

/// Reads `tools`, `tool_choice` and `parallel_tool_calls`. `format` is the pool's tool-call
/// format: tools sent to a model whose format mole does not know are refused (400
/// `tools_not_supported`), never ignored.
pub(super) fn read(
    t: ToolFields,
    format: Option<ToolCallParser>,
) -> Result<Option<ToolRequest>, ApiError> {
    let tools = t.tools.filter(|t| !t.is_empty());
    let Some(tools) = tools else {
        return match t.tool_choice {
            None | Some(ToolChoice::Mode(ToolMode::None)) => Ok(None),
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
    if let Some(i) = tools.iter().position(|t| t.function.name.is_empty()) {
        return Err(bad(
            "invalid_tools",
            format!("tools[{i}]: function.name must be a non-empty string"),
        ));
    }
    let funcs: Vec<&FunctionDef> = tools.iter().map(|t| &t.function).collect();
    let parallel = t.parallel_tool_calls.unwrap_or(true);
    let (parse, forced) = match t.tool_choice {
        None | Some(ToolChoice::Mode(ToolMode::Auto)) => (true, None),
        Some(ToolChoice::Mode(ToolMode::None)) => (false, None),
        Some(ToolChoice::Mode(ToolMode::Required)) => (true, Some(call_grammar(&funcs, parallel))),
        Some(ToolChoice::Function(named)) => {
            let name = named.function.name;
            let one: Vec<&FunctionDef> = funcs.iter().copied().filter(|f| f.name == name).collect();
            if one.is_empty() {
                return Err(bad(
                    "invalid_tool_choice",
                    format!("tool_choice names {name:?}, which is not among tools"),
                ));
            }
            (true, Some(call_grammar(&one, false)))
        }
    };
    let calls = (parse && forced.is_none()).then(|| call_rules(&funcs, parallel));
    Ok(Some(ToolRequest {
        tools: funcs.iter().map(|f| template_tool(f)).collect(),
        parse,
        forced,
        calls,
    }))
}

/// The Lark grammar of one Hermes call to one of `funcs` (or several calls, one per line,
/// when `parallel`), a few whitespace characters allowed first (see [`call_rules`]).
pub(super) fn call_grammar(funcs: &[&FunctionDef], parallel: bool) -> Guide {
    Guide::Lark(format!(
        "start: calls | WS calls\n{}",
        call_rules(funcs, parallel)
    ))
}

/// The Lark rules of Hermes calls: `calls` (one, or several one per line when `parallel`) of
/// `<tool_call>\n{"name": <one of them>, "arguments": <its parameters>}\n</tool_call>`, the
/// JSON part llguidance's `%json` of a schema whose `anyOf` pairs each name with its
/// parameters; strict (every keyword enforced or the request refused) when every function is
/// `strict`; and `WS`, the few whitespace characters that may come first (Qwen3 writes
/// "\n\n" after `</think>`).
pub(super) fn call_rules(funcs: &[&FunctionDef], parallel: bool) -> String {
    let alts: Vec<Value> = funcs
        .iter()
        .map(|f| {
            let params = f
                .parameters
                .clone()
                .map_or_else(|| json!({"type": "object"}), Value::Object);
            json!({
                "type": "object",
                "properties": {"name": {"const": f.name}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": false,
            })
        })
        .collect();
    let strict = funcs.iter().all(|f| f.strict == Some(true));
    let schema = mole_engine::grammar::compact(
        &match alts.len() {
            1 => alts[0].clone(),
            _ => json!({"anyOf": alts}),
        },
        strict,
    );
    let calls = if parallel {
        "call (\"\\n\" call)*"
    } else {
        "call"
    };
    format!(
        "calls: {calls}\nWS: /[ \\t\\r\\n]{{1,4}}/\n\
         call: \"<tool_call>\\n\" args \"\\n</tool_call>\"\nargs: %json {schema}\n"
    )
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
        s.push_str(&mole_engine::pyjson::dumps(t, None));
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

    fn read(v: Value, format: Option<ToolCallParser>) -> Result<Option<ToolRequest>, ApiError> {
        let f = crate::openai::body::Fields::parse(v.to_string().as_bytes())?;
        super::read(f.all()?, format)
    }

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                "required": ["city"]}}})
    }

    #[test]
    fn choices_read_and_refusals_name_the_problem() {
        let hermes = Some(ToolCallParser::Hermes);
        let r = read(json!({"tools": [weather()]}), hermes)
            .unwrap()
            .unwrap();
        assert!(r.parse && r.forced.is_none());
        let r = read(json!({"tools": [weather()], "tool_choice": "none"}), hermes)
            .unwrap()
            .unwrap();
        assert!(!r.parse && r.forced.is_none());
        let r = read(
            json!({"tools": [weather()], "tool_choice": "required"}),
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
        let Some(Guide::Lark(g)) = read(named, hermes).unwrap().unwrap().forced else {
            panic!("a grammar")
        };
        assert!(g.contains("calls: call\n"), "{g}");
        let code = |v: Value, f| read(v, f).unwrap_err().code;
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
        assert_eq!(read(json!({"tool_choice": "none"}), None).unwrap(), None);
    }
}
