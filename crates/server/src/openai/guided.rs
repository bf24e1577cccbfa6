//! Structured outputs' request fields, read into one [`Guide`]: OpenAI's `response_format`
//! (`text`, `json_object`, `json_schema`), vLLM's `structured_outputs` object (`json`, `regex`,
//! `choice`, `grammar`, `json_object`) and its older `guided_json`, `guided_regex`,
//! `guided_choice`, `guided_grammar`. At most one of them constrains a request; the engine
//! compiles it (a schema or grammar llguidance refuses is a 400 naming the problem).

use mole_api::WorkerLimits;
use serde::Deserialize;
use serde_json::Value;
use utoipa::ToSchema;

use crate::error::bad;
use crate::ApiError;
use mole_engine::grammar::Guide;

/// The structured-output fields of a generation body (at most one of them constrains it).
#[derive(Deserialize, ToSchema, Default, Debug)]
pub(crate) struct Guides {
    /// OpenAI's `{"type": "text" | "json_object" | "json_schema", "json_schema": {"name",
    /// "schema", "strict"}}`: the answer is JSON (valid against the schema); llama.cpp's
    /// `{"type": "json_object", "schema": {...}}` follows its schema too.
    #[serde(default)]
    pub(super) response_format: Option<ResponseFormat>,
    /// vLLM's `{"json": schema, "regex": ..., "choice": [...], "grammar": lark, "json_object":
    /// true}`, one of them.
    #[serde(default)]
    pub(super) structured_outputs: Option<StructuredOutputs>,
    /// vLLM's older field: a JSON schema (object or its text).
    #[serde(default)]
    pub(super) guided_json: Option<SchemaArg>,
    /// vLLM's older field: a regex the whole answer matches.
    #[serde(default)]
    pub(super) guided_regex: Option<String>,
    /// vLLM's older field: the answer is one of these strings.
    #[serde(default)]
    #[schema(min_items = 1)]
    pub(super) guided_choice: Option<Vec<String>>,
    /// vLLM's older field: a Lark grammar (llguidance's dialect), not empty.
    #[serde(default)]
    #[schema(min_length = 1)]
    pub(super) guided_grammar: Option<String>,
}

/// OpenAI's `response_format`.
#[derive(Deserialize, ToSchema, Debug)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(crate) enum ResponseFormat {
    /// Free text (the default).
    Text,
    /// A JSON object; with llama.cpp's `schema`, one valid against it.
    JsonObject {
        /// llama.cpp's (and older `instructor`'s) schema beside the type.
        #[serde(default)]
        schema: Option<SchemaArg>,
    },
    /// JSON valid against `json_schema.schema`.
    JsonSchema {
        /// The schema (its `name` and `description` are accepted and not read).
        json_schema: JsonSchemaSpec,
    },
}

/// `response_format.json_schema`.
#[derive(Deserialize, ToSchema, Debug)]
pub(crate) struct JsonSchemaSpec {
    /// The schema the answer follows.
    pub(super) schema: SchemaArg,
    /// OpenAI's `strict`: true refuses a schema with keywords that cannot be enforced, naming
    /// them; otherwise they are approximated and the answer's `mole.unenforced` lists them.
    #[serde(default)]
    pub(super) strict: Option<bool>,
}

/// vLLM's `structured_outputs`.
#[derive(Deserialize, ToSchema, Default, Debug)]
#[serde(deny_unknown_fields)]
pub(crate) struct StructuredOutputs {
    /// A JSON schema (object or its text).
    #[serde(default)]
    pub(super) json: Option<SchemaArg>,
    /// A regex the whole answer matches.
    #[serde(default)]
    pub(super) regex: Option<String>,
    /// The answer is one of these strings.
    #[serde(default)]
    #[schema(min_items = 1)]
    pub(super) choice: Option<Vec<String>>,
    /// A Lark grammar (llguidance's dialect), not empty.
    #[serde(default)]
    #[schema(min_length = 1)]
    pub(super) grammar: Option<String>,
    /// `true`: a JSON object (only `true` or null).
    #[serde(default)]
    #[schema(schema_with = true_or_null)]
    pub(super) json_object: Option<bool>,
    /// vLLM's choice of grammar engine: mole has one (llguidance); any value is accepted.
    #[serde(default)]
    pub(super) backend: Option<String>,
    /// vLLM's switch off its fallback between engines: mole has none to fall back to.
    #[serde(default)]
    pub(super) disable_fallback: Option<bool>,
    /// vLLM's switch off free whitespace in JSON: mole's JSON has none either way.
    #[serde(default)]
    pub(super) disable_any_whitespace: Option<bool>,
    /// vLLM's `additionalProperties: false` by default: not served, only `false` or null.
    #[serde(default)]
    #[schema(schema_with = false_or_null)]
    pub(super) disable_additional_properties: Option<bool>,
    /// vLLM's whitespace regex in JSON: not served, only null.
    #[serde(default)]
    #[schema(schema_with = null_only)]
    pub(super) whitespace_pattern: Option<String>,
}

/// `false` or null.
fn false_or_null() -> utoipa::openapi::Object {
    utoipa::openapi::ObjectBuilder::new()
        .schema_type(utoipa::openapi::schema::SchemaType::AnyValue)
        .enum_values(Some([Value::Bool(false), Value::Null]))
        .build()
}

/// `true` or null.
fn true_or_null() -> utoipa::openapi::Object {
    utoipa::openapi::ObjectBuilder::new()
        .schema_type(utoipa::openapi::schema::SchemaType::AnyValue)
        .enum_values(Some([Value::Bool(true), Value::Null]))
        .build()
}

/// Null only.
fn null_only() -> utoipa::openapi::Object {
    utoipa::openapi::ObjectBuilder::new()
        .schema_type(utoipa::openapi::schema::Type::Null)
        .build()
}

/// A JSON schema as sent: an object (or `true`/`false`), or its JSON text (vLLM takes both).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct SchemaArg(pub(super) Value);

impl<'de> Deserialize<'de> for SchemaArg {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let v = match Value::deserialize(d)? {
            Value::String(s) => serde_json::from_str(&s)
                .map_err(|e| D::Error::custom(format!("the schema's text is not JSON: {e}")))?,
            v => v,
        };
        match v {
            Value::Object(_) | Value::Bool(_) => Ok(Self(v)),
            _ => Err(D::Error::custom(
                "a JSON schema must be an object (or true/false), or its JSON text",
            )),
        }
    }
}

impl utoipa::PartialSchema for SchemaArg {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{OneOfBuilder, Type};
        use utoipa::openapi::ObjectBuilder;
        OneOfBuilder::new()
            .item(ObjectBuilder::new().schema_type(Type::Object))
            .item(ObjectBuilder::new().schema_type(Type::Boolean))
            .item(
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .content_media_type("application/json"),
            )
            .description(Some("A JSON schema: an object, or its JSON text."))
            .into()
    }
}
impl ToSchema for SchemaArg {}

/// The guide `g` asks for, if any, within the limits (see [`check_size`]).
pub(super) fn guide(g: Guides, limits: &WorkerLimits) -> Result<Option<Guide>, ApiError> {
    let g = read(g)?;
    if let Some(g) = &g {
        check_size(g, limits)?;
    }
    Ok(g)
}

/// A JSON schema guide: `strict` is OpenAI's `strict: true` (see [`Guide::Json`]); vLLM's
/// fields have no `strict` and are not.
pub(super) fn json_guide(schema: Value, strict: bool) -> Guide {
    Guide::Json { schema, strict }
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
        Guide::Json { schema, .. } => json_len(schema, max),
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

/// The guide `g` asks for, read (see the module's doc): at most one field constrains.
fn read(g: Guides) -> Result<Option<Guide>, ApiError> {
    let mut found: Vec<(&str, Guide)> = Vec::new();
    match g.response_format {
        None | Some(ResponseFormat::Text) => {}
        // llama.cpp's form (and older `instructor`'s) carries a schema beside the type:
        // followed, not dropped for any object.
        Some(ResponseFormat::JsonObject { schema }) => {
            let schema = schema.map_or_else(|| serde_json::json!({"type": "object"}), |s| s.0);
            found.push(("response_format", json_guide(schema, false)));
        }
        Some(ResponseFormat::JsonSchema { json_schema: js }) => found.push((
            "response_format",
            json_guide(js.schema.0, js.strict.unwrap_or(false)),
        )),
    }
    if let Some(so) = g.structured_outputs {
        if so.disable_additional_properties == Some(true) || so.whitespace_pattern.is_some() {
            return Err(bad(
                "invalid_structured_outputs",
                "structured_outputs.disable_additional_properties and whitespace_pattern are \
                 not supported (JSON is written without free whitespace)",
            ));
        }
        if so.json_object == Some(false) {
            return Err(bad(
                "invalid_structured_outputs",
                "structured_outputs.json_object takes true (or null)",
            ));
        }
        // As vLLM: exactly one constraint (two are refused below with the other guides').
        let given = [
            so.json.is_some(),
            so.regex.is_some(),
            so.choice.is_some(),
            so.grammar.is_some(),
            so.json_object.is_some(),
        ];
        if !given.contains(&true) {
            return Err(bad(
                "invalid_structured_outputs",
                "structured_outputs needs one of json, regex, choice, grammar, json_object",
            ));
        }
        // What changes no answer here: a backend (mole has one), its fallback, free
        // whitespace (mole's JSON has none).
        tracing::debug!(
            backend = ?so.backend,
            disable_fallback = ?so.disable_fallback,
            disable_any_whitespace = ?so.disable_any_whitespace,
            "structured_outputs options ignored"
        );
        let name = "structured_outputs";
        if let Some(s) = so.json {
            found.push((name, json_guide(s.0, false)));
        }
        if let Some(r) = so.regex {
            found.push((name, Guide::Regex(r)));
        }
        if let Some(c) = so.choice {
            found.push((
                name,
                Guide::Choice(choices(c, "structured_outputs.choice")?),
            ));
        }
        if let Some(l) = so.grammar {
            found.push((name, Guide::Lark(lark(l, "structured_outputs.grammar")?)));
        }
        if so.json_object == Some(true) {
            found.push((
                name,
                json_guide(serde_json::json!({"type": "object"}), false),
            ));
        }
    }
    if let Some(s) = g.guided_json {
        found.push(("guided_json", json_guide(s.0, false)));
    }
    if let Some(r) = g.guided_regex {
        found.push(("guided_regex", Guide::Regex(r)));
    }
    if let Some(c) = g.guided_choice {
        found.push(("guided_choice", Guide::Choice(choices(c, "guided_choice")?)));
    }
    if let Some(l) = g.guided_grammar {
        found.push(("guided_grammar", Guide::Lark(lark(l, "guided_grammar")?)));
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

/// Choices: at least one.
fn choices(c: Vec<String>, field: &str) -> Result<Vec<String>, ApiError> {
    match c.is_empty() {
        true => Err(bad(
            "invalid_grammar",
            format!("{field} must be a non-empty array of strings"),
        )),
        false => Ok(c),
    }
}

/// A Lark grammar: not empty (it would have no start rule).
fn lark(l: String, field: &str) -> Result<String, ApiError> {
    match l.is_empty() {
        true => Err(bad("invalid_grammar", format!("{field} must not be empty"))),
        false => Ok(l),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn guide(v: &Value, l: &WorkerLimits) -> Result<Option<Guide>, ApiError> {
        let g = crate::openai::body::Fields::parse(v.to_string().as_bytes())?.take()?;
        super::guide(g, l)
    }
    fn json(schema: Value, strict: bool) -> Option<Guide> {
        Some(Guide::Json { schema, strict })
    }

    #[test]
    fn every_field_reads_into_its_guide_and_conflicts_are_refused() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let l = WorkerLimits::default();
        let ok = |v: Value| guide(&v, &l).unwrap();
        assert_eq!(ok(json!({})), None);
        assert_eq!(ok(json!({"response_format": {"type": "text"}})), None);
        assert_eq!(
            ok(json!({"response_format": {"type": "json_object"}})),
            json(json!({"type": "object"}), false)
        );
        assert_eq!(
            ok(json!({"response_format": {"type": "json_object", "schema": schema}})),
            json(schema.clone(), false)
        );
        let rf = json!({"response_format": {"type": "json_schema",
            "json_schema": {"name": "x", "schema": schema, "strict": true}}});
        assert_eq!(ok(rf), json(schema.clone(), true));
        assert_eq!(
            ok(json!({"guided_json": schema.to_string()})),
            json(schema.clone(), false)
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
        assert_eq!(
            code(json!({"structured_outputs": {"regex": "a", "choice": ["a"]}})),
            "conflicting_guides"
        );
        assert_eq!(code(json!({"guided_grammar": ""})), "invalid_grammar");
        // As vLLM: one constraint in structured_outputs, json_object only true.
        for so in [
            json!({}),
            json!({"backend": "x"}),
            json!({"json_object": false}),
        ] {
            assert_eq!(
                code(json!({ "structured_outputs": so })),
                "invalid_structured_outputs"
            );
        }
        assert_eq!(
            code(json!({"structured_outputs": {"whitespace_pattern": " "}})),
            "invalid_structured_outputs"
        );
        // What changes no answer is accepted.
        assert_eq!(
            ok(
                json!({"structured_outputs": {"json_object": null, "backend": "xgrammar", "choice": ["a"]}})
            ),
            Some(Guide::Choice(vec!["a".into()]))
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
