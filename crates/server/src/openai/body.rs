//! A request body, parsed once into typed parts. The bytes are read as JSON (one parse), its
//! top-level fields are split among the parts of the body's type by the names each part's
//! `Deserialize` declares, and each part is deserialized from its own fields, moving them (no
//! copy). A field of the wrong shape is refused with the stable code of the field it is in
//! (`invalid_tools`, `invalid_schema`, ...) and a message naming its path; the fields no part
//! takes are the field table's ([`super::fields`]): refused, ignored, or unknown.
//!
//! Parts rather than one struct with `#[serde(flatten)]`: serde reads a flattened struct from a
//! buffer that loses the path of an error (a wrong `tools[0].function` would be refused as the
//! whole body), and refuses unknown fields only without flattening.

use serde::de::{DeserializeOwned, Visitor};
use serde::Deserializer;
use serde_json::{Map, Value};

use super::fields::{self, On};
use crate::error::bad;
use crate::ApiError;

/// A body's top-level fields not yet taken by a part.
pub(crate) struct Fields {
    /// The body, an object.
    body: Value,
}

impl Fields {
    /// Parses a body's bytes (400 `invalid_json`; `invalid_request` when it is not an object).
    /// Integral floats become integers (`10.0` reads as `10`), as JSON Schema's `integer` and
    /// vLLM's (pydantic's) `int` fields take them; a chat template's variables are left as
    /// sent.
    pub(crate) fn parse(b: &[u8]) -> Result<Self, ApiError> {
        let raw: Value = serde_json::from_slice(b)
            .map_err(|e| bad("invalid_json", format!("body is not valid JSON: {e}")))?;
        // Every body is an object (serde would read a struct from an array too).
        let Value::Object(mut map) = raw else {
            return Err(bad("invalid_request", "the body must be a JSON object"));
        };
        for (k, v) in map.iter_mut() {
            if k != "chat_template_kwargs" {
                integral(v);
            }
        }
        Ok(Self {
            body: Value::Object(map),
        })
    }

    /// The fields not taken yet, as JSON.
    pub(crate) fn value(&self) -> &Value {
        &self.body
    }

    fn map(&mut self) -> &mut Map<String, Value> {
        match &mut self.body {
            Value::Object(m) => m,
            // `parse` made it an object.
            other => {
                *other = Value::Object(Map::new());
                match other {
                    Value::Object(m) => m,
                    _ => unreachable!("just made an object"),
                }
            }
        }
    }

    /// Takes part `T`: the fields `T` declares, typed. A malformed one is refused with its
    /// field's code ([`code_of`]).
    pub(crate) fn take<T: DeserializeOwned>(&mut self) -> Result<T, ApiError> {
        let mut own = Map::new();
        let map = self.map();
        for name in field_names::<T>() {
            if let Some((k, v)) = map.remove_entry(*name) {
                own.insert(k, v);
            }
        }
        typed(Value::Object(own))
    }

    /// Takes part `T` where `endpoint` shares it with others: only the fields of `T` that
    /// `endpoint`'s table serves or ignores; the others are left to [`Fields::rest`], which
    /// refuses them as another endpoint's.
    pub(crate) fn take_for<T: DeserializeOwned>(&mut self, endpoint: On) -> Result<T, ApiError> {
        let mut own = Map::new();
        let map = self.map();
        for name in field_names::<T>() {
            let ours = fields::field(name, endpoint)
                .is_some_and(|f| !matches!(f.treatment, fields::Treatment::Refused { .. }));
            if !ours {
                continue;
            }
            if let Some((k, v)) = map.remove_entry(*name) {
                own.insert(k, v);
            }
        }
        typed(Value::Object(own))
    }

    /// Takes every field as `T` (a body of one part; fields `T` does not declare are left to
    /// its own `deny_unknown_fields`, or ignored).
    pub(crate) fn all<T: DeserializeOwned>(self) -> Result<T, ApiError> {
        typed(self.body)
    }

    /// The fields no part took, held to `endpoint`'s field table: a refused one asking for
    /// something is 400 `unsupported_field`, one in no table of the endpoint 400
    /// `unknown_field`; ignored ones are logged.
    pub(crate) fn rest(mut self, endpoint: On) -> Result<(), ApiError> {
        fields::check(self.map(), endpoint)
    }
}

/// `v` typed, a failure refused with the code of the field it is in.
fn typed<T: DeserializeOwned>(v: Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        let at = match path.as_str() {
            "." | "" => String::new(),
            p => format!("{p}: "),
        };
        bad(code_of(&path), format!("{at}{}", e.inner()))
    })
}

/// The code of a malformed field at `path` (`tools[0].function.name`): the code its checks
/// answer with once typed, so a field refused by its shape and by its value says the same.
pub(crate) fn code_of(path: &str) -> &'static str {
    // Indexes do not matter: `messages[3].role` is `messages.role`.
    let mut plain = String::with_capacity(path.len());
    let mut skip = false;
    for c in path.chars() {
        match c {
            '[' => skip = true,
            ']' => skip = false,
            c if !skip => plain.push(c),
            _ => {}
        }
    }
    const CODES: &[(&str, &str)] = &[
        ("messages.role", "invalid_role"),
        ("messages.content", "invalid_content_part"),
        ("messages.tool_calls", "invalid_tool_calls"),
        ("response_format", "invalid_response_format"),
        ("structured_outputs.json", "invalid_schema"),
        ("structured_outputs", "invalid_structured_outputs"),
        ("guided_json", "invalid_schema"),
        ("guided_regex", "invalid_grammar"),
        ("guided_choice", "invalid_grammar"),
        ("guided_grammar", "invalid_grammar"),
        ("tools", "invalid_tools"),
        ("tool_choice", "invalid_tool_choice"),
        ("parallel_tool_calls", "invalid_tool_choice"),
        ("stop_token_ids", "invalid_stop_token_ids"),
        ("stop", "invalid_stop"),
        ("top_logprobs", "invalid_top_logprobs"),
        ("logprobs", "invalid_logprobs"),
        ("cache_salt", "invalid_cache_salt"),
        ("prompt", "invalid_prompt"),
        ("n", "invalid_n"),
        ("input", "invalid_input"),
        ("text", "invalid_text_format"),
        ("reasoning", "invalid_reasoning"),
        ("include", "invalid_include"),
    ];
    CODES
        .iter()
        .find(|(p, _)| plain == *p || plain.strip_prefix(p).is_some_and(|r| r.starts_with('.')))
        .map_or("invalid_request", |(_, c)| c)
}

/// The field names `T`'s `Deserialize` asks a struct for (aliases included): what
/// [`Fields::take`] hands it.
pub(crate) fn field_names<T: DeserializeOwned>() -> &'static [&'static str] {
    /// A deserializer that answers every question with the names it was asked for.
    struct Names;
    #[derive(Debug)]
    struct Asked(&'static [&'static str]);
    impl std::fmt::Display for Asked {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("field names")
        }
    }
    impl std::error::Error for Asked {}
    impl serde::de::Error for Asked {
        fn custom<M: std::fmt::Display>(_: M) -> Self {
            Asked(&[])
        }
    }
    impl<'de> Deserializer<'de> for Names {
        type Error = Asked;
        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Asked> {
            Err(Asked(&[]))
        }
        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Asked> {
            Err(Asked(fields))
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
            byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map enum
            identifier ignored_any
        }
    }
    match T::deserialize(Names) {
        Err(Asked(names)) => names,
        Ok(_) => &[],
    }
}

/// Integral floats (`10.0`) made integers, recursively.
fn integral(v: &mut Value) {
    match v {
        Value::Number(n) if n.is_f64() => {
            let f = n.as_f64().unwrap_or(f64::NAN);
            if f.fract() == 0.0 && f >= 0.0 && f < u64::MAX as f64 {
                *v = Value::from(f as u64);
            } else if f.fract() == 0.0 && f < 0.0 && f >= i64::MIN as f64 {
                *v = Value::from(f as i64);
            }
        }
        Value::Array(a) => a.iter_mut().for_each(integral),
        Value::Object(m) => m.values_mut().for_each(integral),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[derive(serde::Deserialize, Debug, PartialEq)]
    struct A {
        x: Option<u32>,
        #[serde(alias = "why")]
        y: Option<String>,
    }

    #[derive(serde::Deserialize, Debug, PartialEq)]
    struct B {
        stop: Option<Vec<String>>,
        tools: Option<Vec<u32>>,
    }

    fn fields(v: Value) -> Fields {
        Fields::parse(v.to_string().as_bytes()).unwrap()
    }

    #[test]
    fn parts_take_their_own_fields_and_name_the_field_of_a_failure() {
        assert_eq!(field_names::<A>(), ["x", "why", "y"]);
        let mut f = fields(json!({"x": 3.0, "why": "w", "stop": ["s"], "other": 1}));
        assert_eq!(
            f.take::<A>().unwrap(),
            A {
                x: Some(3),
                y: Some("w".into())
            }
        );
        let b: B = f.take().unwrap();
        assert_eq!(b.stop, Some(vec!["s".to_string()]));
        assert_eq!(f.map().keys().collect::<Vec<_>>(), ["other"]);
        let e = fields(json!({"tools": [1, "x"]})).take::<B>().unwrap_err();
        assert_eq!(e.code, "invalid_tools");
        assert!(e.message.starts_with("tools[1]: "), "{}", e.message);
        let e = fields(json!({"stop": "x"})).take::<B>().unwrap_err();
        assert_eq!(e.code, "invalid_stop");
        for (bytes, code) in [(&b"{"[..], "invalid_json"), (b"[1]", "invalid_request")] {
            assert_eq!(Fields::parse(bytes).err().unwrap().code, code);
        }
    }

    #[test]
    fn codes_follow_the_path() {
        assert_eq!(code_of("messages[2].role"), "invalid_role");
        assert_eq!(
            code_of("messages[0].content[1].type"),
            "invalid_content_part"
        );
        assert_eq!(code_of("structured_outputs.json"), "invalid_schema");
        assert_eq!(
            code_of("structured_outputs.regex"),
            "invalid_structured_outputs"
        );
        assert_eq!(code_of("stop_token_ids[0]"), "invalid_stop_token_ids");
        assert_eq!(code_of("stop"), "invalid_stop");
        assert_eq!(code_of("n"), "invalid_n");
        assert_eq!(code_of("nope"), "invalid_request");
        assert_eq!(code_of("text.format"), "invalid_text_format");
    }

    #[test]
    fn integral_floats_are_integers() {
        let f = fields(json!({"n": 10.0, "t": 0.5, "ids": [1.0, -2.0],
                              "chat_template_kwargs": {"x": 1.0}}));
        assert_eq!(
            f.body,
            json!({"n": 10, "t": 0.5, "ids": [1, -2], "chat_template_kwargs": {"x": 1.0}})
        );
    }

    /// An integral float is read exactly, however large, so it becomes the integer it is
    /// (schemathesis sent `"top_k": 1866002013573059.0`, which serde_json's default parser read
    /// one unit in the last place off, as 1866002013573059.25, and refused as not an integer).
    #[test]
    fn large_integral_floats_are_read_exactly() {
        let f =
            Fields::parse(br#"{"top_k": 1866002013573059.0, "seed": 9007199254740990.0}"#).unwrap();
        assert_eq!(
            f.body,
            json!({"top_k": 1866002013573059u64, "seed": 9007199254740990u64})
        );
    }
}
