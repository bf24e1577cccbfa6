//! Structured outputs' request fields, read into one [`Guide`]: OpenAI's `response_format`
//! (`text`, `json_object`, `json_schema`), vLLM's `structured_outputs` object (`json`, `regex`,
//! `choice`, `grammar`, `json_object`) and its older `guided_json`, `guided_regex`,
//! `guided_choice`, `guided_grammar`. At most one of them constrains a request; the engine
//! compiles it (a schema or grammar llguidance refuses is a 400 naming the problem).

use serde_json::Value;

use crate::engine::grammar::Guide;
use crate::server::error::bad;
use crate::server::ApiError;

/// The fields of the request bodies documented in the OpenAPI document (read from the raw
/// body by [`guide`]).
#[derive(serde::Deserialize, utoipa::ToSchema, Default)]
#[allow(dead_code)] // read by `guide` from the raw body; typed here for the OpenAPI document
pub(in crate::server) struct GuidedFields {
    /// OpenAI's `{"type": "text" | "json_object" | "json_schema", "json_schema": {"name",
    /// "schema", "strict"}}`: the answer is JSON (valid against the schema).
    #[serde(default)]
    pub(super) response_format: Option<Value>,
    /// vLLM's `{"json": schema, "regex": ..., "choice": [...], "grammar": lark, "json_object":
    /// true}`, one of them.
    #[serde(default)]
    pub(super) structured_outputs: Option<Value>,
    /// vLLM's older field: a JSON schema (object or its text).
    #[serde(default)]
    pub(super) guided_json: Option<Value>,
    /// vLLM's older field: a regex the whole answer matches.
    #[serde(default)]
    pub(super) guided_regex: Option<String>,
    /// vLLM's older field: the answer is one of these strings.
    #[serde(default)]
    #[schema(min_items = 1)]
    pub(super) guided_choice: Option<Vec<String>>,
    /// vLLM's older field: a Lark grammar (llguidance's dialect).
    #[serde(default)]
    pub(super) guided_grammar: Option<String>,
}

/// A schema given as an object, or as its JSON text (vLLM accepts both).
fn schema(v: &Value, field: &str) -> Result<Value, ApiError> {
    match v {
        Value::Object(_) | Value::Bool(_) => Ok(v.clone()),
        Value::String(s) => serde_json::from_str(s)
            .map_err(|e| bad("invalid_schema", format!("{field} is not JSON: {e}"))),
        _ => Err(bad(
            "invalid_schema",
            format!("{field} must be a JSON schema object"),
        )),
    }
}

fn string(v: &Value, field: &str) -> Result<String, ApiError> {
    v.as_str()
        .map(String::from)
        .ok_or_else(|| bad("invalid_grammar", format!("{field} must be a string")))
}

fn choices(v: &Value, field: &str) -> Result<Vec<String>, ApiError> {
    let list: Option<Vec<String>> = v
        .as_array()
        .and_then(|a| a.iter().map(|c| c.as_str().map(String::from)).collect());
    match list {
        Some(l) if !l.is_empty() => Ok(l),
        _ => Err(bad(
            "invalid_grammar",
            format!("{field} must be a non-empty array of strings"),
        )),
    }
}

/// The guide `raw` (a chat or completions body) asks for, if any.
pub(super) fn guide(raw: &Value) -> Result<Option<Guide>, ApiError> {
    let mut found: Vec<(&str, Guide)> = Vec::new();
    let field = |k: &str| raw.get(k).filter(|v| !v.is_null());
    if let Some(rf) = field("response_format") {
        match rf.get("type").and_then(Value::as_str) {
            Some("text") => {}
            Some("json_object") => found.push((
                "response_format",
                Guide::Json(serde_json::json!({"type": "object"})),
            )),
            Some("json_schema") => {
                let js = rf.get("json_schema").ok_or_else(|| {
                    bad(
                        "invalid_response_format",
                        "response_format json_schema needs a json_schema object",
                    )
                })?;
                let s = js.get("schema").ok_or_else(|| {
                    bad(
                        "invalid_response_format",
                        "response_format.json_schema needs a schema",
                    )
                })?;
                found.push((
                    "response_format",
                    Guide::Json(schema(s, "response_format.json_schema.schema")?),
                ));
            }
            other => {
                return Err(bad(
                    "invalid_response_format",
                    format!(
                        "response_format.type must be text, json_object or json_schema, got {}",
                        other.map_or("nothing".to_string(), |t| format!("{t:?}"))
                    ),
                ))
            }
        }
    }
    if let Some(so) = field("structured_outputs") {
        let Some(obj) = so.as_object() else {
            return Err(bad(
                "invalid_structured_outputs",
                "structured_outputs must be an object",
            ));
        };
        for (k, v) in obj.iter().filter(|(_, v)| !v.is_null()) {
            let g = match k.as_str() {
                "json" => Guide::Json(schema(v, "structured_outputs.json")?),
                "regex" => Guide::Regex(string(v, "structured_outputs.regex")?),
                "choice" => Guide::Choice(choices(v, "structured_outputs.choice")?),
                "grammar" => Guide::Lark(string(v, "structured_outputs.grammar")?),
                "json_object" if v.as_bool() == Some(true) => {
                    Guide::Json(serde_json::json!({"type": "object"}))
                }
                "json_object" => continue,
                // Options that do not constrain (vLLM's backend choice and whitespace
                // pattern) are left to llguidance's defaults.
                "disable_fallback" | "disable_any_whitespace" | "disable_additional_properties"
                | "whitespace_pattern" | "backend" => continue,
                other => {
                    return Err(bad(
                        "invalid_structured_outputs",
                        format!("structured_outputs.{other} is not supported (json, regex, choice, grammar, json_object are)"),
                    ))
                }
            };
            found.push(("structured_outputs", g));
        }
    }
    if let Some(v) = field("guided_json") {
        found.push(("guided_json", Guide::Json(schema(v, "guided_json")?)));
    }
    if let Some(v) = field("guided_regex") {
        found.push(("guided_regex", Guide::Regex(string(v, "guided_regex")?)));
    }
    if let Some(v) = field("guided_choice") {
        found.push(("guided_choice", Guide::Choice(choices(v, "guided_choice")?)));
    }
    if let Some(v) = field("guided_grammar") {
        found.push(("guided_grammar", Guide::Lark(string(v, "guided_grammar")?)));
    }
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|(n, _)| *n).collect();
        return Err(bad(
            "conflicting_guides",
            format!(
                "one structured output per request, got {}",
                names.join(" and ")
            ),
        ));
    }
    Ok(found.pop().map(|(_, g)| g))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn every_field_reads_into_its_guide_and_conflicts_are_refused() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let ok = |v: Value| guide(&v).unwrap();
        assert_eq!(ok(json!({})), None);
        assert_eq!(ok(json!({"response_format": {"type": "text"}})), None);
        assert_eq!(
            ok(json!({"response_format": {"type": "json_object"}})),
            Some(Guide::Json(json!({"type": "object"})))
        );
        let rf = json!({"response_format": {"type": "json_schema",
            "json_schema": {"name": "x", "schema": schema, "strict": true}}});
        assert_eq!(ok(rf), Some(Guide::Json(schema.clone())));
        assert_eq!(
            ok(json!({"guided_json": schema.to_string()})),
            Some(Guide::Json(schema.clone()))
        );
        assert_eq!(
            ok(json!({"structured_outputs": {"regex": "[a-z]+"}})),
            Some(Guide::Regex("[a-z]+".into()))
        );
        assert_eq!(
            ok(json!({"guided_choice": ["yes", "no"]})),
            Some(Guide::Choice(vec!["yes".into(), "no".into()]))
        );
        assert_eq!(
            ok(json!({"structured_outputs": {"grammar": "start: \"a\""}})),
            Some(Guide::Lark("start: \"a\"".into()))
        );
        let code = |v: Value| guide(&v).unwrap_err().code;
        assert_eq!(
            code(json!({"response_format": {"type": "xml"}})),
            "invalid_response_format"
        );
        assert_eq!(
            code(json!({"response_format": {"type": "json_schema"}})),
            "invalid_response_format"
        );
        assert_eq!(code(json!({"guided_json": "{not json"})), "invalid_schema");
        assert_eq!(code(json!({"guided_choice": []})), "invalid_grammar");
        assert_eq!(
            code(json!({"structured_outputs": {"xml": "x"}})),
            "invalid_structured_outputs"
        );
        assert_eq!(
            code(json!({"guided_regex": "a", "response_format": {"type": "json_object"}})),
            "conflicting_guides"
        );
    }
}
