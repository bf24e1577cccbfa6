//! Request bodies held to the OpenAPI document that describes them (`GET /openapi.json`), so
//! that what the server accepts is what the document says, by construction.
//!
//! The typed parse ([`super::openai::body`]) refuses most of what the document refuses, each
//! refusal with its field's code. What it would let through is serde's leniency, which no
//! JSON schema describes: a struct read from an array (`"reasoning": [null, null]`), an enum
//! from a one-key object (`"tool_choice": {"auto": null}`), a field a nested object does not
//! declare. A body the document calls invalid is therefore refused even when the typed parse
//! took it (400, the code of the field it fails in, the failing path and keyword named).
//!
//! The JSON Schema keywords the document uses, and only those, are checked: `$ref` (to
//! `#/components/schemas/...`), `type`, `enum`, `const`, the string, number, array and object
//! bounds, `pattern`, `properties`, `required`, `additionalProperties`, `propertyNames`,
//! `dependentSchemas`, `dependentRequired`, `allOf`, `anyOf`, `oneOf`, `not`, `if`/`then`/
//! `else`. Annotations (`description`, `format`, `contentMediaType`, `contentSchema`,
//! `discriminator`, `default`, `examples`) are not checked, as JSON Schema 2020-12 and
//! schemathesis' validator read them.

use std::sync::Arc;

use serde_json::{Map, Value};

use super::openapi_requests::{request_limits, request_schemas};
use super::AppState;

/// Why a body is not what the document says: the failing path (`messages[0].content`) and
/// what failed there.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{path}: {why}")]
pub(super) struct Invalid {
    /// The path of the failing value (empty: the body).
    pub(super) path: String,
    /// The keyword that failed, said for people.
    pub(super) why: String,
}

/// Holds `body` to the document's schema `name` (`ChatBody`, ...) for this worker's limits:
/// see [`check`]. The schemas are written once per set of limits.
pub(super) fn check_body(
    s: &AppState,
    name: &str,
    body: &serde_json::Value,
) -> Result<(), Invalid> {
    let limits = request_limits(s);
    let doc = {
        let mut cached = s
            .doc
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match &*cached {
            Some((l, d)) if *l == limits => d.clone(),
            _ => {
                let d = Arc::new(request_schemas(&limits));
                *cached = Some((limits, d.clone()));
                d
            }
        }
    };
    let Some(components) = doc.as_object() else {
        return Ok(());
    };
    match components.get(name) {
        Some(schema) => check(schema, components, body),
        None => Ok(()),
    }
}

/// How deep schemas may nest through references (the document has no cycle; this stops one).
const MAX_DEPTH: usize = 64;

/// Checks `v` against `schema`, whose `$ref`s name schemas of `components` (the document's
/// `components.schemas`).
pub(super) fn check(
    schema: &Value,
    components: &Map<String, Value>,
    v: &Value,
) -> Result<(), Invalid> {
    Checker { components }.check(schema, v, &mut Vec::new(), 0)
}

struct Checker<'a> {
    components: &'a Map<String, Value>,
}

/// A path segment.
enum Seg<'a> {
    Key(&'a str),
    Index(usize),
}

fn show(path: &[Seg<'_>]) -> String {
    let mut s = String::new();
    for p in path {
        match p {
            Seg::Key(k) if s.is_empty() => s.push_str(k),
            Seg::Key(k) => {
                s.push('.');
                s.push_str(k);
            }
            Seg::Index(i) => s.push_str(&format!("[{i}]")),
        }
    }
    s
}

fn fail(path: &[Seg<'_>], why: impl Into<String>) -> Result<(), Invalid> {
    Err(Invalid {
        path: show(path),
        why: why.into(),
    })
}

/// Whether `v` is of JSON Schema type `t` (`integer`: a number without a fraction).
fn is_type(v: &Value, t: &str) -> bool {
    match t {
        "null" => v.is_null(),
        "boolean" => v.is_boolean(),
        "string" => v.is_string(),
        "array" => v.is_array(),
        "object" => v.is_object(),
        "number" => v.is_number(),
        "integer" => match v {
            Value::Number(n) => {
                n.is_i64() || n.is_u64() || n.as_f64().is_some_and(|f| f.fract() == 0.0)
            }
            _ => false,
        },
        _ => false,
    }
}

/// `a` compared with `b`, numbers exactly when both are integers.
fn cmp(a: &serde_json::Number, b: &serde_json::Number) -> Option<std::cmp::Ordering> {
    let int = |n: &serde_json::Number| {
        n.as_i64()
            .map(i128::from)
            .or_else(|| n.as_u64().map(i128::from))
    };
    match (int(a), int(b)) {
        (Some(x), Some(y)) => Some(x.cmp(&y)),
        _ => a.as_f64()?.partial_cmp(&b.as_f64()?),
    }
}

/// JSON equality, numbers by value (`1` is `1.0`).
fn equal(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => cmp(x, y) == Some(std::cmp::Ordering::Equal),
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| equal(p, q))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, p)| y.get(k).is_some_and(|q| equal(p, q)))
        }
        _ => a == b,
    }
}

impl Checker<'_> {
    fn check<'v>(
        &self,
        s: &Value,
        v: &'v Value,
        path: &mut Vec<Seg<'v>>,
        depth: usize,
    ) -> Result<(), Invalid> {
        let s = match s {
            Value::Bool(true) => return Ok(()),
            Value::Bool(false) => return fail(path, "no value is allowed here"),
            Value::Object(s) => s,
            _ => return Ok(()),
        };
        if depth > MAX_DEPTH {
            return fail(path, "the schema nests too deep");
        }
        if let Some(r) = s.get("$ref").and_then(Value::as_str) {
            let name = r.strip_prefix("#/components/schemas/").unwrap_or(r);
            match self.components.get(name) {
                Some(target) => self.check(target, v, path, depth + 1)?,
                None => return fail(path, format!("unknown schema {r}")),
            }
        }
        if let Some(t) = s.get("type") {
            let ok = match t {
                Value::String(t) => is_type(v, t),
                Value::Array(ts) => ts.iter().filter_map(Value::as_str).any(|t| is_type(v, t)),
                _ => true,
            };
            if !ok {
                return fail(path, format!("must be of type {t}"));
            }
        }
        if let Some(Value::Array(values)) = s.get("enum") {
            if !values.iter().any(|e| equal(e, v)) {
                return fail(
                    path,
                    format!("must be one of {}", Value::Array(values.clone())),
                );
            }
        }
        if let Some(c) = s.get("const") {
            if !equal(c, v) {
                return fail(path, format!("must be {c}"));
            }
        }
        match v {
            Value::String(t) => self.string(s, t, path)?,
            Value::Number(n) => self.number(s, n, path)?,
            Value::Array(a) => self.array(s, a, path, depth)?,
            Value::Object(o) => self.object(s, v, o, path, depth)?,
            _ => {}
        }
        self.combinators(s, v, path, depth)
    }

    fn string(&self, s: &Map<String, Value>, t: &str, path: &[Seg<'_>]) -> Result<(), Invalid> {
        let n = t.chars().count() as u64;
        if s.get("minLength")
            .and_then(Value::as_u64)
            .is_some_and(|m| n < m)
        {
            return fail(
                path,
                format!("must be at least {} characters", s["minLength"]),
            );
        }
        if s.get("maxLength")
            .and_then(Value::as_u64)
            .is_some_and(|m| n > m)
        {
            return fail(
                path,
                format!("must be at most {} characters", s["maxLength"]),
            );
        }
        if let Some(p) = s.get("pattern").and_then(Value::as_str) {
            match regex::Regex::new(p) {
                Ok(re) if re.is_match(t) => {}
                _ => return fail(path, format!("must match {p}")),
            }
        }
        Ok(())
    }

    fn number(
        &self,
        s: &Map<String, Value>,
        n: &serde_json::Number,
        path: &[Seg<'_>],
    ) -> Result<(), Invalid> {
        use std::cmp::Ordering::{Greater, Less};
        let bound = |k: &str| match s.get(k) {
            Some(Value::Number(b)) => cmp(n, b),
            _ => None,
        };
        let out = [
            ("minimum", bound("minimum") == Some(Less), "at least"),
            ("maximum", bound("maximum") == Some(Greater), "at most"),
            (
                "exclusiveMinimum",
                bound("exclusiveMinimum").is_some_and(|o| o != Greater),
                "above",
            ),
            (
                "exclusiveMaximum",
                bound("exclusiveMaximum").is_some_and(|o| o != Less),
                "below",
            ),
        ];
        match out.iter().find(|(_, out, _)| *out) {
            Some((k, _, what)) => fail(path, format!("must be {what} {}", s[*k])),
            None => Ok(()),
        }
    }

    fn array<'v>(
        &self,
        s: &Map<String, Value>,
        a: &'v [Value],
        path: &mut Vec<Seg<'v>>,
        depth: usize,
    ) -> Result<(), Invalid> {
        let n = a.len() as u64;
        if s.get("minItems")
            .and_then(Value::as_u64)
            .is_some_and(|m| n < m)
        {
            return fail(path, format!("must have at least {} items", s["minItems"]));
        }
        if s.get("maxItems")
            .and_then(Value::as_u64)
            .is_some_and(|m| n > m)
        {
            return fail(path, format!("must have at most {} items", s["maxItems"]));
        }
        if let Some(items) = s.get("items") {
            for (i, x) in a.iter().enumerate() {
                path.push(Seg::Index(i));
                let r = self.check(items, x, path, depth + 1);
                path.pop();
                r?;
            }
        }
        Ok(())
    }

    fn object<'v>(
        &self,
        s: &Map<String, Value>,
        v: &'v Value,
        o: &'v Map<String, Value>,
        path: &mut Vec<Seg<'v>>,
        depth: usize,
    ) -> Result<(), Invalid> {
        if let Some(Value::Array(req)) = s.get("required") {
            if let Some(k) = req
                .iter()
                .filter_map(Value::as_str)
                .find(|k| !o.contains_key(*k))
            {
                return fail(path, format!("{k} is required"));
            }
        }
        let n = o.len() as u64;
        if s.get("maxProperties")
            .and_then(Value::as_u64)
            .is_some_and(|m| n > m)
        {
            return fail(
                path,
                format!("must have at most {} properties", s["maxProperties"]),
            );
        }
        if s.get("minProperties")
            .and_then(Value::as_u64)
            .is_some_and(|m| n < m)
        {
            return fail(
                path,
                format!("must have at least {} properties", s["minProperties"]),
            );
        }
        let props = s.get("properties").and_then(Value::as_object);
        for (k, x) in o {
            path.push(Seg::Key(k));
            let r = (|| {
                if let Some(names) = s.get("propertyNames") {
                    self.check(names, &Value::String(k.clone()), &mut Vec::new(), depth + 1)
                        .map_err(|e| Invalid {
                            path: String::new(),
                            why: format!("the name {}", e.why),
                        })?;
                }
                match (props.and_then(|p| p.get(k)), s.get("additionalProperties")) {
                    (Some(p), _) => self.check(p, x, path, depth + 1),
                    (None, Some(Value::Bool(false))) => fail(path, "is not a field of this object"),
                    (None, Some(extra)) => self.check(extra, x, path, depth + 1),
                    (None, None) => Ok(()),
                }
            })();
            let r = r.map_err(|mut e| {
                if e.path.is_empty() {
                    e.path = show(path);
                }
                e
            });
            path.pop();
            r?;
        }
        if let Some(Value::Object(deps)) = s.get("dependentSchemas") {
            for (k, d) in deps.iter().filter(|(k, _)| o.contains_key(*k)) {
                self.check(d, v, path, depth + 1).map_err(|e| Invalid {
                    why: format!("{} (as {k} is present)", e.why),
                    ..e
                })?;
            }
        }
        if let Some(Value::Object(deps)) = s.get("dependentRequired") {
            for (k, d) in deps.iter().filter(|(k, _)| o.contains_key(*k)) {
                let needed = d.as_array().into_iter().flatten().filter_map(Value::as_str);
                if let Some(missing) = needed.into_iter().find(|n| !o.contains_key(*n)) {
                    return fail(path, format!("{missing} is required beside {k}"));
                }
            }
        }
        Ok(())
    }

    fn combinators<'v>(
        &self,
        s: &Map<String, Value>,
        v: &'v Value,
        path: &mut Vec<Seg<'v>>,
        depth: usize,
    ) -> Result<(), Invalid> {
        if let Some(Value::Array(all)) = s.get("allOf") {
            for x in all {
                self.check(x, v, path, depth + 1)?;
            }
        }
        if let Some(Value::Array(any)) = s.get("anyOf") {
            let mut first = None;
            let matched = any.iter().any(|x| match self.check(x, v, path, depth + 1) {
                Ok(()) => true,
                Err(e) => {
                    first.get_or_insert(e);
                    false
                }
            });
            if !matched {
                return Err(first.unwrap_or_else(|| Invalid {
                    path: show(path),
                    why: "matches none of the alternatives".into(),
                }));
            }
        }
        if let Some(Value::Array(one)) = s.get("oneOf") {
            let mut failures = Vec::new();
            let matched = one
                .iter()
                .filter(|x| match self.check(x, v, path, depth + 1) {
                    Ok(()) => true,
                    Err(e) => {
                        failures.push(e);
                        false
                    }
                })
                .count();
            match matched {
                1 => {}
                0 if one.len() == 1 => return Err(failures.remove(0)),
                0 => {
                    // The deepest failure says most of what was meant.
                    let deepest = failures.into_iter().max_by_key(|e| e.path.len());
                    return Err(deepest.unwrap_or_else(|| Invalid {
                        path: show(path),
                        why: "matches none of the alternatives".into(),
                    }));
                }
                _ => return fail(path, "matches more than one of the alternatives"),
            }
        }
        if let Some(not) = s.get("not") {
            if self.check(not, v, path, depth + 1).is_ok() {
                return fail(path, "is a value the document excludes here");
            }
        }
        if let Some(cond) = s.get("if") {
            let branch = match self.check(cond, v, path, depth + 1) {
                Ok(()) => s.get("then"),
                Err(_) => s.get("else"),
            };
            if let Some(b) = branch {
                self.check(b, v, path, depth + 1)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ok(s: Value, v: Value) -> Result<(), String> {
        let components = json!({"X": {"type": "object", "properties": {"a": {"type": "integer"}},
                                      "additionalProperties": false}});
        check(&s, components.as_object().unwrap(), &v).map_err(|e| e.to_string())
    }

    #[test]
    fn keywords() {
        assert!(ok(json!({"type": "object"}), json!([null])).is_err());
        assert!(ok(json!({"type": ["integer", "null"]}), json!(3.0)).is_ok());
        assert!(ok(json!({"type": "integer"}), json!(3.5)).is_err());
        assert!(ok(json!({"enum": ["a", null]}), json!(null)).is_ok());
        assert!(ok(json!({"maximum": 18446744073709551615u64}), json!(u64::MAX)).is_ok());
        assert!(ok(json!({"minimum": 1, "maximum": 2}), json!(3)).is_err());
        assert!(ok(json!({"exclusiveMinimum": 0}), json!(0)).is_err());
        assert!(ok(json!({"maxLength": 2}), json!("éé")).is_ok());
        assert!(ok(json!({"maxLength": 2}), json!("ééé")).is_err());
        assert!(ok(json!({"$ref": "#/components/schemas/X"}), json!({"a": 1})).is_ok());
        assert_eq!(
            ok(
                json!({"type": "object", "properties": {"x": {"$ref": "#/components/schemas/X"}}}),
                json!({"x": {"a": 1, "b": 2}})
            ),
            Err("x.b: is not a field of this object".to_string())
        );
        let one =
            json!({"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}}]});
        assert!(ok(one.clone(), json!([1, 2])).is_ok());
        assert_eq!(
            ok(one, json!([1, "x"])),
            Err("[1]: must be of type \"integer\"".to_string())
        );
        let not = json!({"not": {"required": ["a", "b"]}});
        assert!(ok(not.clone(), json!({"a": 1})).is_ok());
        assert!(ok(not, json!({"a": 1, "b": 2})).is_err());
        let dep = json!({"dependentSchemas": {"t": {"required": ["l"]}}});
        assert!(ok(dep.clone(), json!({"t": 1})).is_err());
        assert!(ok(dep, json!({"t": 1, "l": true})).is_ok());
        let names = json!({"propertyNames": {"maxLength": 2}});
        assert!(ok(names, json!({"abc": 1})).is_err());
    }
}
