//! Structured outputs' request fields, read into one [`Guide`]: OpenAI's `response_format`
//! (`text`, `json_object`, `json_schema`), vLLM's `structured_outputs` object (`json`, `regex`,
//! `choice`, `grammar`, `json_object`) and its older `guided_json`, `guided_regex`,
//! `guided_choice`, `guided_grammar`. At most one of them constrains a request; the engine
//! compiles it (a schema or grammar llguidance refuses is a 400 naming the problem).

use mole_api::WorkerLimits;
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
    /// "schema", "strict"}}`: the answer is JSON (valid against the schema); llama.cpp's
    /// `{"type": "json_object", "schema": {...}}` follows its schema too.
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

/// The guide `raw` (a chat or completions body) asks for, if any, within the limits (see
/// [`check_size`]).
pub(super) fn guide(raw: &Value, limits: &WorkerLimits) -> Result<Option<Guide>, ApiError> {
    let g = read(raw)?;
    if let Some(g) = &g {
        check_size(g, limits)?;
    }
    Ok(g)
}

/// Refuses a guide whose compilation would cost out of proportion, before it is compiled:
/// more than `limits.maxGuideChoices` choices (400 `too_many_choices`), or more than
/// `limits.maxGuideChars` characters of text (400 `guide_too_large`; a schema counted as
/// compact JSON, choices together).
pub(super) fn check_size(g: &Guide, limits: &WorkerLimits) -> Result<(), ApiError> {
    let max = limits.max_guide_chars;
    let chars = |t: &str| t.chars().count() as u64;
    let length = match g {
        Guide::Choice(c) => {
            if c.len() > limits.max_guide_choices as usize {
                return Err(bad(
                    "too_many_choices",
                    format!(
                        "{} choices, over limits.maxGuideChoices ({})",
                        c.len(),
                        limits.max_guide_choices
                    ),
                ));
            }
            c.iter().map(|x| chars(x)).sum()
        }
        Guide::Regex(t) | Guide::Lark(t) => chars(t),
        Guide::Json(v) => json_len(v, max),
    };
    if length > max {
        return Err(bad(
            "guide_too_large",
            format!("the structured output's text is over limits.maxGuideChars ({max} characters)"),
        ));
    }
    Ok(())
}

/// The characters of `v` as compact JSON, counted up to just past `cap` (a huge schema is not
/// written out to be measured).
pub(super) fn json_len(v: &impl serde::Serialize, cap: u64) -> u64 {
    struct Count(u64, u64);
    impl std::io::Write for Count {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            // Each character has exactly one byte that is not a UTF-8 continuation byte.
            self.0 += b.iter().filter(|&&x| x & 0xC0 != 0x80).count() as u64;
            if self.0 > self.1 {
                return Err(std::io::Error::other("over the cap"));
            }
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut c = Count(0, cap);
    let _ = serde_json::to_writer(&mut c, v);
    c.0
}

/// The guide `raw` asks for, read (see the module's doc).
fn read(raw: &Value) -> Result<Option<Guide>, ApiError> {
    let mut found: Vec<(&str, Guide)> = Vec::new();
    let field = |k: &str| raw.get(k).filter(|v| !v.is_null());
    if let Some(rf) = field("response_format") {
        match rf.get("type").and_then(Value::as_str) {
            Some("text") => {}
            // llama.cpp's form (and older `instructor`'s) carries a schema beside the type:
            // followed, not dropped for any object.
            Some("json_object") => found.push((
                "response_format",
                match rf.get("schema").filter(|v| !v.is_null()) {
                    Some(sc) => Guide::Json(schema(sc, "response_format.schema")?),
                    None => Guide::Json(serde_json::json!({"type": "object"})),
                },
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
        let l = WorkerLimits::default();
        let ok = |v: Value| guide(&v, &l).unwrap();
        assert_eq!(ok(json!({})), None);
        assert_eq!(ok(json!({"response_format": {"type": "text"}})), None);
        assert_eq!(
            ok(json!({"response_format": {"type": "json_object"}})),
            Some(Guide::Json(json!({"type": "object"})))
        );
        assert_eq!(
            ok(json!({"response_format": {"type": "json_object", "schema": schema}})),
            Some(Guide::Json(schema.clone()))
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
        let code = |v: Value| guide(&v, &l).unwrap_err().code;
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

    /// Each guide's text is measured before compilation: choices by count and bytes, a schema
    /// as compact JSON (without writing a huge one out).
    #[test]
    fn guides_over_the_limits_are_refused() {
        let l = WorkerLimits {
            max_guide_chars: 20,
            max_guide_choices: 3,
            ..WorkerLimits::default()
        };
        let code = |v: Value| guide(&v, &l).map(|_| "ok").unwrap_or_else(|e| e.code);
        assert_eq!(code(json!({"guided_choice": ["a", "b", "c"]})), "ok");
        assert_eq!(
            code(json!({"guided_choice": ["a", "b", "c", "d"]})),
            "too_many_choices"
        );
        assert_eq!(
            code(json!({"guided_choice": ["0123456789", "0123456789x"]})),
            "guide_too_large"
        );
        assert_eq!(code(json!({"guided_regex": "a".repeat(20)})), "ok");
        assert_eq!(
            code(json!({"guided_regex": "a".repeat(21)})),
            "guide_too_large"
        );
        assert_eq!(
            code(json!({"guided_grammar": "a".repeat(21)})),
            "guide_too_large"
        );
        // {"type":"object"} is 17 bytes compact, whatever its spacing as sent.
        assert_eq!(
            code(json!({"guided_json": "{ \"type\" :  \"object\" }"})),
            "ok"
        );
        let big = json!({"guided_json": {"type": "object", "description": "x".repeat(10_000)}});
        assert_eq!(code(big), "guide_too_large");
        let n = json_len(&json!({"a": "x".repeat(1000)}), 10);
        assert!((11..=1008).contains(&n), "{n}");
    }
}
