//! Every request field of OpenAI's and vLLM's chat completions and completions, and what mole
//! does with it: served, refused with 400 `unsupported_field` naming it (unless it is null or
//! the value that asks for nothing), or accepted and ignored because ignoring it changes no
//! answer. A field in neither API nor mole's own is refused with 400 `unknown_field`: a client
//! is never answered 200 as if a field it sent had been honoured. This one table decides, and
//! `docs/server.md`'s table and the OpenAPI document are written from it (a test checks the
//! docs), so serving a field flips one entry.

use serde_json::{Map, Value};

use crate::server::error::bad;
use crate::server::ApiError;

/// Which body a field belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::server) enum On {
    /// `POST /v1/chat/completions`.
    Chat,
    /// `POST /v1/completions`.
    Completions,
    /// Both.
    Both,
}

impl On {
    /// Whether the field is one of `endpoint`'s.
    fn covers(self, endpoint: On) -> bool {
        self == On::Both || self == endpoint
    }
}

/// What mole does with a field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::server) enum Treatment {
    /// Served as OpenAI or vLLM define it (or as mole's own field).
    Served,
    /// Accepted and ignored: it changes no answer here (why).
    Ignored(&'static str),
    /// Refused with 400 `unsupported_field` naming it, unless null or one of `noop` (JSON
    /// values that ask for nothing: `false`, the default); `why` says what it would ask for.
    Refused {
        /// What it asks for that mole does not do.
        why: &'static str,
        /// JSON values accepted besides null (each one asks for what mole does anyway).
        noop: &'static [&'static str],
    },
}

/// One request field.
#[derive(Debug, Clone, Copy)]
pub(in crate::server) struct Field {
    /// The JSON name.
    pub(in crate::server) name: &'static str,
    /// Whose field it is: `OpenAI`, `vLLM` or `mole`.
    pub(in crate::server) from: &'static str,
    /// The bodies it belongs to.
    pub(in crate::server) on: On,
    /// What mole does with it.
    pub(in crate::server) treatment: Treatment,
}

const fn served(name: &'static str, from: &'static str, on: On) -> Field {
    Field {
        name,
        from,
        on,
        treatment: Treatment::Served,
    }
}

const fn ignored(name: &'static str, from: &'static str, on: On, why: &'static str) -> Field {
    Field {
        name,
        from,
        on,
        treatment: Treatment::Ignored(why),
    }
}

const fn refused(
    name: &'static str,
    from: &'static str,
    on: On,
    why: &'static str,
    noop: &'static [&'static str],
) -> Field {
    Field {
        name,
        from,
        on,
        treatment: Treatment::Refused { why, noop },
    }
}

use On::{Both, Chat, Completions};

/// The table: OpenAI's current chat and completions fields, then vLLM's extra parameters, then
/// mole's own.
pub(in crate::server) const FIELDS: &[Field] = &[
    // OpenAI.
    served("messages", "OpenAI", Chat),
    served("prompt", "OpenAI", Completions),
    served("model", "OpenAI", Both),
    served("frequency_penalty", "OpenAI", Both),
    served("presence_penalty", "OpenAI", Both),
    served("logprobs", "OpenAI", Both),
    served("top_logprobs", "OpenAI", Both),
    served("max_tokens", "OpenAI", Both),
    served("max_completion_tokens", "OpenAI", Both),
    served("n", "OpenAI", Both),
    served("seed", "OpenAI", Both),
    served("stop", "OpenAI", Both),
    served("stream", "OpenAI", Both),
    served("stream_options", "OpenAI", Both),
    served("temperature", "OpenAI", Both),
    served("top_p", "OpenAI", Both),
    refused("logit_bias", "OpenAI", Both, "biases token logits", &["{}"]),
    served("response_format", "OpenAI", Both),
    served("tools", "OpenAI", Chat),
    served("tool_choice", "OpenAI", Chat),
    served("parallel_tool_calls", "OpenAI", Chat),
    refused(
        "functions",
        "OpenAI",
        Chat,
        "function calls (deprecated tools)",
        &["[]"],
    ),
    refused(
        "function_call",
        "OpenAI",
        Chat,
        "function calls (deprecated tools)",
        &[r#""none""#],
    ),
    refused(
        "modalities",
        "OpenAI",
        Chat,
        "output modalities other than text",
        &[r#"["text"]"#],
    ),
    refused("audio", "OpenAI", Chat, "audio output", &[]),
    refused(
        "prediction",
        "OpenAI",
        Chat,
        "predicted outputs (speculative decoding on given content)",
        &[],
    ),
    refused(
        "reasoning_effort",
        "OpenAI",
        Chat,
        "a reasoning budget the model is told",
        &[],
    ),
    refused(
        "verbosity",
        "OpenAI",
        Chat,
        "an answer length the model is told",
        &[],
    ),
    refused("web_search_options", "OpenAI", Chat, "web search", &[]),
    refused(
        "echo",
        "OpenAI",
        Both,
        "the prompt echoed before the answer",
        &["false"],
    ),
    refused(
        "best_of",
        "OpenAI",
        Completions,
        "server-side candidates of which the best is answered",
        &["1"],
    ),
    refused(
        "suffix",
        "OpenAI",
        Completions,
        "fill-in-the-middle after a suffix",
        &[r#""""#],
    ),
    ignored(
        "user",
        "OpenAI",
        Both,
        "an end-user id for OpenAI's abuse monitoring; mole logs no end users, and reads it only as the session that keeps a canary split sticky (after the `x-session-id` header)",
    ),
    ignored(
        "safety_identifier",
        "OpenAI",
        Both,
        "user's successor, for OpenAI's abuse monitoring",
    ),
    ignored(
        "metadata",
        "OpenAI",
        Both,
        "tags for OpenAI's stored completions",
    ),
    ignored(
        "store",
        "OpenAI",
        Both,
        "asks OpenAI to keep the completion; mole keeps none",
    ),
    ignored(
        "service_tier",
        "OpenAI",
        Both,
        "OpenAI's billing tier; a pool has one",
    ),
    ignored(
        "prompt_cache_key",
        "OpenAI",
        Both,
        "a hint for OpenAI's prompt cache; mole's prefix cache is keyed by the prompt itself, partitioned by API key (limits.prefixCacheScope) and cache_salt",
    ),
    // vLLM's extra parameters.
    served("top_k", "vLLM", Both),
    served("min_p", "vLLM", Both),
    served("repetition_penalty", "vLLM", Both),
    served("stop_token_ids", "vLLM", Both),
    served("ignore_eos", "vLLM", Both),
    served("chat_template_kwargs", "vLLM", Chat),
    served("add_generation_prompt", "vLLM", Chat),
    served("add_special_tokens", "vLLM", Both),
    refused(
        "min_tokens",
        "vLLM",
        Both,
        "a least number of tokens",
        &["0"],
    ),
    refused(
        "skip_special_tokens",
        "vLLM",
        Both,
        "special tokens in the answer's text (mole always leaves them out)",
        &["true"],
    ),
    refused(
        "spaces_between_special_tokens",
        "vLLM",
        Both,
        "how special tokens are joined in the text",
        &["true"],
    ),
    refused(
        "include_stop_str_in_output",
        "vLLM",
        Both,
        "the matched stop string kept in the answer",
        &["false"],
    ),
    refused(
        "chat_template",
        "vLLM",
        Chat,
        "a chat template of the client's (mole renders the model's own)",
        &[],
    ),
    refused(
        "continue_final_message",
        "vLLM",
        Chat,
        "the last assistant message continued",
        &["false"],
    ),
    refused(
        "documents",
        "vLLM",
        Chat,
        "documents for a RAG chat template",
        &[],
    ),
    served("structured_outputs", "vLLM", Both),
    served("guided_json", "vLLM", Both),
    served("guided_regex", "vLLM", Both),
    served("guided_choice", "vLLM", Both),
    served("guided_grammar", "vLLM", Both),
    refused(
        "guided_decoding_backend",
        "vLLM",
        Both,
        "structured output's backend",
        &[],
    ),
    refused(
        "guided_whitespace_pattern",
        "vLLM",
        Both,
        "structured output's whitespace",
        &[],
    ),
    refused(
        "priority",
        "vLLM",
        Both,
        "priority scheduling (vLLM refuses it too unless its scheduler has priorities)",
        &["0"],
    ),
    ignored(
        "request_id",
        "vLLM",
        Both,
        "vLLM's id for its logs; mole's answer and logs carry mole's own id",
    ),
    served("cache_salt", "vLLM", Both),
    refused(
        "truncate_prompt_tokens",
        "vLLM",
        Both,
        "the prompt cut to its last tokens",
        &[],
    ),
    refused(
        "prompt_logprobs",
        "vLLM",
        Both,
        "log probabilities of the prompt's tokens",
        &[],
    ),
    refused(
        "return_tokens_as_token_ids",
        "vLLM",
        Both,
        "logprob tokens as `token_id:N`",
        &["false"],
    ),
    refused(
        "return_token_ids",
        "vLLM",
        Both,
        "the prompt's and answer's token ids",
        &["false"],
    ),
    refused(
        "mm_processor_kwargs",
        "vLLM",
        Chat,
        "image processor settings",
        &["{}"],
    ),
    refused(
        "logits_processors",
        "vLLM",
        Both,
        "logits processors by name",
        &["[]"],
    ),
    refused(
        "allowed_token_ids",
        "vLLM",
        Both,
        "sampling restricted to given tokens",
        &[],
    ),
    refused("bad_words", "vLLM", Both, "words never generated", &["[]"]),
    refused("use_beam_search", "vLLM", Both, "beam search", &["false"]),
    refused(
        "length_penalty",
        "vLLM",
        Both,
        "beam search's length penalty",
        &["1"],
    ),
    refused(
        "kv_transfer_params",
        "vLLM",
        Both,
        "disaggregated prefill's KV transfer",
        &[],
    ),
    refused(
        "prompt_embeds",
        "vLLM",
        Completions,
        "prompt embeddings",
        &[],
    ),
    refused(
        "vllm_xargs",
        "vLLM",
        Both,
        "extra arguments for vLLM plugins",
        &[],
    ),
    // mole's own.
    served("adapter", "mole", Both),
    served("expert", "mole", Both),
    served("prefer_merged", "mole", Both),
];

/// The field named `name` of `endpoint`'s body.
pub(in crate::server) fn field(name: &str, endpoint: On) -> Option<&'static Field> {
    FIELDS
        .iter()
        .find(|f| f.name == name && f.on.covers(endpoint))
}

/// Whether `v` asks for nothing of a refused field: null, or one of its `noop` values.
fn noop(v: &Value, values: &[&str]) -> bool {
    v.is_null()
        || values
            .iter()
            .any(|n| serde_json::from_str::<Value>(n).is_ok_and(|n| &n == v))
}

/// `body`'s fields checked against the table: 400 `unsupported_field` for a refused field that
/// asks for something, 400 `unknown_field` for a field of neither API; ignored fields are
/// logged at debug level.
pub(in crate::server) fn check(body: &Map<String, Value>, endpoint: On) -> Result<(), ApiError> {
    for (name, v) in body {
        match field(name, endpoint).map(|f| f.treatment) {
            Some(Treatment::Served) => {}
            Some(Treatment::Ignored(why)) => {
                tracing::debug!(field = %name, why, "request field ignored");
            }
            Some(Treatment::Refused { noop: values, .. }) if noop(v, values) => {}
            Some(Treatment::Refused { why, noop: values }) => {
                let accepted = match values {
                    [] => "null".to_string(),
                    vs => format!("null or {}", vs.join(" or ")),
                };
                return Err(bad(
                    "unsupported_field",
                    format!(
                        "{name} is not supported by this worker ({why}); it accepts {accepted}"
                    ),
                ));
            }
            None => {
                let other = match FIELDS.iter().any(|f| f.name == name) {
                    true => " (a field of the other endpoint)",
                    false => "",
                };
                return Err(bad(
                    "unknown_field",
                    format!("{name} is not a field of this endpoint{other}"),
                ));
            }
        }
    }
    Ok(())
}

/// The table as `docs/server.md` shows it.
#[cfg(test)]
pub(in crate::server) fn markdown() -> String {
    let mut out = String::from("| Field | API | Endpoints | What mole does |\n|---|---|---|---|\n");
    for f in FIELDS {
        let on = match f.on {
            Chat => "chat",
            Completions => "completions",
            Both => "chat, completions",
        };
        let what = match f.treatment {
            Treatment::Served => "served".to_string(),
            Treatment::Ignored(why) => format!("ignored: {why}"),
            Treatment::Refused { why, noop } => {
                let values: Vec<String> = noop.iter().map(|n| format!("`{n}`")).collect();
                let accepted = match values.is_empty() {
                    true => "null".to_string(),
                    false => format!("null, {}", values.join(", ")),
                };
                format!("refused (`unsupported_field`): {why}; accepted: {accepted}")
            }
        };
        out.push_str(&format!("| `{}` | {} | {on} | {what} |\n", f.name, f.from));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn code(body: Value, on: On) -> Option<&'static str> {
        check(body.as_object().unwrap(), on).err().map(|e| e.code)
    }

    #[test]
    fn each_field_is_named_once_per_endpoint() {
        for endpoint in [Chat, Completions] {
            let mut seen = std::collections::BTreeSet::new();
            for f in FIELDS.iter().filter(|f| f.on.covers(endpoint)) {
                assert!(seen.insert(f.name), "{} twice", f.name);
            }
        }
        // Every noop value is JSON.
        for f in FIELDS {
            if let Treatment::Refused { noop, .. } = f.treatment {
                for n in noop {
                    serde_json::from_str::<Value>(n).unwrap_or_else(|e| panic!("{n}: {e}"));
                }
            }
        }
    }

    #[test]
    fn refused_unknown_and_noop_values() {
        assert_eq!(
            code(json!({"functions": [{"name": "f"}]}), Chat),
            Some("unsupported_field")
        );
        assert_eq!(code(json!({"functions": []}), Chat), None);
        assert_eq!(code(json!({"functions": null}), Chat), None);
        assert_eq!(
            code(json!({"echo": true}), Completions),
            Some("unsupported_field")
        );
        assert_eq!(code(json!({"echo": false}), Completions), None);
        assert_eq!(
            code(json!({"user": "u1", "metadata": {"a": "b"}}), Chat),
            None
        );
        assert_eq!(code(json!({"frobnicate": 1}), Chat), Some("unknown_field"));
        // A field of the other endpoint.
        assert_eq!(code(json!({"suffix": "x"}), Chat), Some("unknown_field"));
        assert_eq!(
            code(json!({"messages": []}), Completions),
            Some("unknown_field")
        );
        let e = check(json!({"logit_bias": {"1": 5}}).as_object().unwrap(), Chat).unwrap_err();
        assert!(e.message.contains("logit_bias"), "{}", e.message);
    }

    /// `docs/server.md` shows this table as it is.
    #[test]
    fn the_docs_show_the_table() {
        let docs = include_str!("../../../../docs/server.md");
        assert!(
            docs.contains(&markdown()),
            "docs/server.md's field table is not the code's; write this there:\n{}",
            markdown()
        );
    }
}
