//! JSON as Python's `json.dumps(x, ensure_ascii=False, indent=...)` writes it, the `tojson` of
//! transformers' chat templates: `", "` and `": "` between items (`","` before a newline with
//! an indent), keys in the order given, nothing HTML-escaped. Qwen's templates write each tool
//! with `tool | tojson`, so the model sees its tools as it was trained on them.

use serde_json::Value as Json;

/// `v` as `json.dumps(v, ensure_ascii=False, indent=indent)` writes it.
pub fn dumps(v: &Json, indent: Option<usize>) -> String {
    let mut out = String::new();
    write(v, indent, 0, &mut out);
    out
}

fn write(v: &Json, indent: Option<usize>, depth: usize, out: &mut String) {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    match v {
        Json::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, x) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                write(x, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        Json::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (k, x)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                out.push_str(&Json::String(k.clone()).to_string());
                out.push_str(": ");
                write(x, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        // Scalars, `[]` and `{}`: serde_json writes strings with the escapes Python's
        // ensure_ascii=False writes (quote, backslash, control characters).
        other => out.push_str(&other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Python 3: `json.dumps({"b": [1, 2.5, None], "a": {"x": "é<&>"}, "e": []}, ensure_ascii=False)`
    /// and the same with `indent=2`.
    #[test]
    fn writes_as_python_json_dumps() {
        let v = json!({"b": [1, 2.5, null], "a": {"x": "é<&>\"\n"}, "e": []});
        assert_eq!(
            dumps(&v, None),
            r#"{"b": [1, 2.5, null], "a": {"x": "é<&>\"\n"}, "e": []}"#
        );
        assert_eq!(
            dumps(&v, Some(2)),
            "{\n  \"b\": [\n    1,\n    2.5,\n    null\n  ],\n  \"a\": {\n    \"x\": \"é<&>\\\"\\n\"\n  },\n  \"e\": []\n}"
        );
    }
}
