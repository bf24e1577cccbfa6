//! Every request field of OpenAI's and vLLM's chat completions and completions, and what mole
//! does with it: served, refused with 400 `unsupported_field` naming it (unless it is null or
//! the value that asks for nothing), or accepted and ignored because ignoring it changes no
//! answer. A field in neither API nor mole's own is refused with 400 `unknown_field`: a client
//! is never answered 200 as if a field it sent had been honoured. This one table decides, and
//! `docs/server.md`'s table and the OpenAPI document are written from it (a test checks the
//! docs), so serving a field flips one entry.

use serde_json::{Map, Value};

use crate::error::bad;
use crate::ApiError;

/// The bodies a field belongs to: a set of endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct On(u8);

impl On {
    /// `POST /v1/chat/completions` (and `/infer`, a chat).
    pub(crate) const CHAT: On = On(1);
    /// `POST /v1/completions`.
    pub(crate) const COMPLETIONS: On = On(2);
    /// `POST /v1/responses`.
    pub(crate) const RESPONSES: On = On(4);
    /// Chat and completions.
    pub(crate) const BOTH: On = On(1 | 2);
    /// Every generation endpoint.
    pub(crate) const ALL: On = On(1 | 2 | 4);

    /// Both sets together.
    const fn and(self, other: On) -> On {
        On(self.0 | other.0)
    }

    /// Whether the field is one of `endpoint`'s.
    pub(crate) fn covers(self, endpoint: On) -> bool {
        self.0 & endpoint.0 != 0
    }

    /// The endpoints' names, as the docs' table shows them.
    #[cfg(test)]
    fn names(self) -> String {
        let all = [
            (On::CHAT, "chat"),
            (On::COMPLETIONS, "completions"),
            (On::RESPONSES, "responses"),
        ];
        let v: Vec<&str> = all
            .iter()
            .filter(|(o, _)| self.covers(*o))
            .map(|(_, n)| *n)
            .collect();
        v.join(", ")
    }
}

/// What mole does with a field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Treatment {
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
pub(crate) struct Field {
    /// The JSON name.
    pub(crate) name: &'static str,
    /// Whose field it is: `OpenAI`, `vLLM` or `mole`.
    pub(crate) from: &'static str,
    /// The bodies it belongs to.
    pub(crate) on: On,
    /// What mole does with it.
    pub(crate) treatment: Treatment,
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

const CHAT: On = On::CHAT;
const COMPLETIONS: On = On::COMPLETIONS;
const RESPONSES: On = On::RESPONSES;
const BOTH: On = On::BOTH;
const ALL: On = On::ALL;
const CHAT_RESPONSES: On = On::CHAT.and(On::RESPONSES);

/// The table: OpenAI's current chat and completions fields, then vLLM's extra parameters, then
/// mole's own.
pub(crate) const FIELDS: &[Field] = &[
    // OpenAI.
    served("messages", "OpenAI", CHAT),
    served("prompt", "OpenAI", COMPLETIONS),
    served("model", "OpenAI", ALL),
    served("frequency_penalty", "OpenAI", BOTH),
    served("presence_penalty", "OpenAI", BOTH),
    served("logprobs", "OpenAI", BOTH),
    served("top_logprobs", "OpenAI", BOTH),
    served("max_tokens", "OpenAI", BOTH),
    served("max_completion_tokens", "OpenAI", BOTH),
    served("n", "OpenAI", BOTH),
    served("seed", "OpenAI", ALL),
    served("stop", "OpenAI", BOTH),
    served("stream", "OpenAI", ALL),
    served("stream_options", "OpenAI", BOTH),
    served("temperature", "OpenAI", ALL),
    served("top_p", "OpenAI", ALL),
    refused("logit_bias", "OpenAI", BOTH, "biases token logits", &["{}"]),
    served("response_format", "OpenAI", BOTH),
    served("tools", "OpenAI", CHAT_RESPONSES),
    served("tool_choice", "OpenAI", CHAT_RESPONSES),
    served("parallel_tool_calls", "OpenAI", CHAT_RESPONSES),
    refused(
        "functions",
        "OpenAI",
        CHAT,
        "function calls (deprecated tools)",
        &["[]"],
    ),
    refused(
        "function_call",
        "OpenAI",
        CHAT,
        "function calls (deprecated tools)",
        &[r#""none""#],
    ),
    refused(
        "modalities",
        "OpenAI",
        CHAT,
        "output modalities other than text",
        &[r#"["text"]"#],
    ),
    refused("audio", "OpenAI", CHAT, "audio output", &[]),
    refused(
        "prediction",
        "OpenAI",
        CHAT,
        "predicted outputs (speculative decoding on given content)",
        &[],
    ),
    refused(
        "reasoning_effort",
        "OpenAI",
        CHAT,
        "a reasoning budget the model is told",
        &[],
    ),
    refused(
        "verbosity",
        "OpenAI",
        CHAT,
        "an answer length the model is told",
        &[],
    ),
    refused("web_search_options", "OpenAI", CHAT, "web search", &[]),
    refused(
        "echo",
        "OpenAI",
        BOTH,
        "the prompt echoed before the answer",
        &["false"],
    ),
    refused(
        "best_of",
        "OpenAI",
        COMPLETIONS,
        "server-side candidates of which the best is answered",
        &["1"],
    ),
    refused(
        "suffix",
        "OpenAI",
        COMPLETIONS,
        "fill-in-the-middle after a suffix",
        &[r#""""#],
    ),
    ignored(
        "user",
        "OpenAI",
        ALL,
        "an end-user id for OpenAI's abuse monitoring; mole logs no end users, and reads it only as the session that keeps a canary split sticky (after the `x-session-id` header)",
    ),
    ignored(
        "safety_identifier",
        "OpenAI",
        ALL,
        "user's successor, for OpenAI's abuse monitoring",
    ),
    ignored(
        "metadata",
        "OpenAI",
        BOTH,
        "tags for OpenAI's stored completions",
    ),
    ignored(
        "store",
        "OpenAI",
        BOTH,
        "asks OpenAI to keep the completion; mole keeps none",
    ),
    ignored(
        "service_tier",
        "OpenAI",
        ALL,
        "OpenAI's billing tier; a pool has one",
    ),
    ignored(
        "prompt_cache_key",
        "OpenAI",
        ALL,
        "a hint for OpenAI's prompt cache; mole's prefix cache is keyed by the prompt itself, partitioned by API key (limits.prefixCacheScope) and cache_salt",
    ),
    // vLLM's extra parameters.
    served("top_k", "vLLM", ALL),
    served("min_p", "vLLM", ALL),
    served("repetition_penalty", "vLLM", ALL),
    served("stop_token_ids", "vLLM", BOTH),
    served("ignore_eos", "vLLM", BOTH),
    served("chat_template_kwargs", "vLLM", CHAT_RESPONSES),
    served("add_generation_prompt", "vLLM", CHAT),
    served("add_special_tokens", "vLLM", BOTH),
    refused(
        "min_tokens",
        "vLLM",
        BOTH,
        "a least number of tokens",
        &["0"],
    ),
    refused(
        "skip_special_tokens",
        "vLLM",
        BOTH,
        "special tokens in the answer's text (mole always leaves them out)",
        &["true"],
    ),
    refused(
        "spaces_between_special_tokens",
        "vLLM",
        BOTH,
        "how special tokens are joined in the text",
        &["true"],
    ),
    refused(
        "include_stop_str_in_output",
        "vLLM",
        BOTH,
        "the matched stop string kept in the answer",
        &["false"],
    ),
    refused(
        "chat_template",
        "vLLM",
        CHAT,
        "a chat template of the client's (mole renders the model's own)",
        &[],
    ),
    refused(
        "continue_final_message",
        "vLLM",
        CHAT,
        "the last assistant message continued",
        &["false"],
    ),
    refused(
        "documents",
        "vLLM",
        CHAT,
        "documents for a RAG chat template",
        &[],
    ),
    served("structured_outputs", "vLLM", BOTH),
    served("guided_json", "vLLM", BOTH),
    served("guided_regex", "vLLM", BOTH),
    served("guided_choice", "vLLM", BOTH),
    served("guided_grammar", "vLLM", BOTH),
    refused(
        "guided_decoding_backend",
        "vLLM",
        BOTH,
        "structured output's backend",
        &[],
    ),
    refused(
        "guided_whitespace_pattern",
        "vLLM",
        BOTH,
        "structured output's whitespace",
        &[],
    ),
    refused(
        "priority",
        "vLLM",
        ALL,
        "priority scheduling (vLLM refuses it too unless its scheduler has priorities)",
        &["0"],
    ),
    ignored(
        "request_id",
        "vLLM",
        ALL,
        "vLLM's id for its logs; mole's answer and logs carry mole's own id",
    ),
    served("cache_salt", "vLLM", ALL),
    refused(
        "truncate_prompt_tokens",
        "vLLM",
        BOTH,
        "the prompt cut to its last tokens",
        &[],
    ),
    refused(
        "prompt_logprobs",
        "vLLM",
        BOTH,
        "log probabilities of the prompt's tokens",
        &[],
    ),
    refused(
        "return_tokens_as_token_ids",
        "vLLM",
        BOTH,
        "logprob tokens as `token_id:N`",
        &["false"],
    ),
    refused(
        "return_token_ids",
        "vLLM",
        BOTH,
        "the prompt's and answer's token ids",
        &["false"],
    ),
    refused(
        "mm_processor_kwargs",
        "vLLM",
        CHAT_RESPONSES,
        "image processor settings",
        &["{}"],
    ),
    refused(
        "logits_processors",
        "vLLM",
        BOTH,
        "logits processors by name",
        &["[]"],
    ),
    refused(
        "allowed_token_ids",
        "vLLM",
        BOTH,
        "sampling restricted to given tokens",
        &[],
    ),
    refused("bad_words", "vLLM", BOTH, "words never generated", &["[]"]),
    refused("use_beam_search", "vLLM", BOTH, "beam search", &["false"]),
    refused(
        "length_penalty",
        "vLLM",
        BOTH,
        "beam search's length penalty",
        &["1"],
    ),
    refused(
        "kv_transfer_params",
        "vLLM",
        BOTH,
        "disaggregated prefill's KV transfer",
        &[],
    ),
    refused(
        "prompt_embeds",
        "vLLM",
        COMPLETIONS,
        "prompt embeddings",
        &[],
    ),
    refused(
        "vllm_xargs",
        "vLLM",
        BOTH,
        "extra arguments for vLLM plugins",
        &[],
    ),
    // mole's own.
    served("adapter", "mole", ALL),
    served("expert", "mole", ALL),
    served("prefer_merged", "mole", ALL),
    // OpenAI's Responses API (`POST /v1/responses`).
    served("input", "OpenAI", RESPONSES),
    served("instructions", "OpenAI", RESPONSES),
    served("max_output_tokens", "OpenAI", RESPONSES),
    served("text", "OpenAI", RESPONSES),
    served("reasoning", "OpenAI", RESPONSES),
    served("include", "OpenAI", RESPONSES),
    served("metadata", "OpenAI", RESPONSES),
    refused(
        "top_logprobs",
        "OpenAI",
        RESPONSES,
        "log probabilities of the answer's tokens",
        &["0"],
    ),
    refused(
        "previous_response_id",
        "OpenAI",
        RESPONSES,
        "a stored response continued; mole stores no responses: send the conversation as `input` items",
        &[],
    ),
    refused(
        "conversation",
        "OpenAI",
        RESPONSES,
        "a stored conversation continued; mole stores none",
        &[],
    ),
    refused(
        "background",
        "OpenAI",
        RESPONSES,
        "a response run in the background and polled",
        &["false"],
    ),
    refused("prompt", "OpenAI", RESPONSES, "a stored prompt template", &[]),
    refused(
        "truncation",
        "OpenAI",
        RESPONSES,
        "the input cut to fit the context",
        &[r#""disabled""#],
    ),
    ignored(
        "store",
        "OpenAI",
        RESPONSES,
        "mole stores no responses: every answer says `store: false`, and `GET`/`DELETE /v1/responses/{id}` answer 404 `response_not_found`",
    ),
    ignored(
        "stream_options",
        "OpenAI",
        RESPONSES,
        "`include_obfuscation` pads a stream's deltas against length side channels; mole sends no padding, and a response stream always ends with the usage",
    ),
    ignored(
        "max_tool_calls",
        "OpenAI",
        RESPONSES,
        "a bound on the calls of OpenAI's built-in tools (web search, file search...), which mole has none of; function calls are made by the client",
    ),
];

/// The field named `name` of `endpoint`'s body.
pub(crate) fn field(name: &str, endpoint: On) -> Option<&'static Field> {
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
pub(crate) fn check(body: &Map<String, Value>, endpoint: On) -> Result<(), ApiError> {
    for (name, v) in body {
        match field(name, endpoint).map(|f| f.treatment) {
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
            // A served field the body's typed parts did not take is another endpoint's (chat's
            // `messages` sent to `/infer`): every endpoint's parts read all it serves (a test
            // checks).
            Some(Treatment::Served) | None => {
                let other = match FIELDS.iter().any(|f| f.name == name) {
                    true => " (a field of another endpoint)",
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
pub(crate) fn markdown() -> String {
    let mut out = String::from("| Field | API | Endpoints | What mole does |\n|---|---|---|---|\n");
    for f in FIELDS {
        let on = f.on.names();
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
        for endpoint in [CHAT, COMPLETIONS, RESPONSES] {
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
            code(json!({"functions": [{"name": "f"}]}), CHAT),
            Some("unsupported_field")
        );
        assert_eq!(code(json!({"functions": []}), CHAT), None);
        assert_eq!(code(json!({"functions": null}), CHAT), None);
        assert_eq!(
            code(json!({"echo": true}), COMPLETIONS),
            Some("unsupported_field")
        );
        assert_eq!(code(json!({"echo": false}), COMPLETIONS), None);
        assert_eq!(
            code(json!({"user": "u1", "metadata": {"a": "b"}}), CHAT),
            None
        );
        assert_eq!(code(json!({"frobnicate": 1}), CHAT), Some("unknown_field"));
        // A field of the other endpoint.
        assert_eq!(code(json!({"suffix": "x"}), CHAT), Some("unknown_field"));
        assert_eq!(
            code(json!({"messages": []}), COMPLETIONS),
            Some("unknown_field")
        );
        let e = check(json!({"logit_bias": {"1": 5}}).as_object().unwrap(), CHAT).unwrap_err();
        assert!(e.message.contains("logit_bias"), "{}", e.message);
    }

    /// The typed parts of each body read exactly the fields the table serves there (and
    /// `user`, ignored but read for canary sessions): a served field no part reads, or a part's
    /// field the table does not name, fails here.
    #[test]
    fn the_typed_bodies_read_the_served_fields() {
        use crate::openai::body::field_names;
        use crate::openai::guided::Guides;
        use crate::openai::request_bodies::{ChatOwn, Common, CompletionOwn};
        use crate::openai::tools::ToolFields;
        use std::collections::BTreeSet;
        let typed = |parts: &[&[&'static str]]| -> BTreeSet<&'static str> {
            parts.iter().flat_map(|p| p.iter().copied()).collect()
        };
        let chat = typed(&[
            field_names::<ChatOwn>(),
            field_names::<ToolFields>(),
            field_names::<Guides>(),
            field_names::<Common>(),
        ]);
        let completions = typed(&[
            field_names::<CompletionOwn>(),
            field_names::<Guides>(),
            field_names::<Common>(),
        ]);
        // Chat's common part, where this API's table has its fields.
        let shared: Vec<&'static str> = field_names::<Common>()
            .iter()
            .copied()
            .filter(|n| {
                field(n, RESPONSES)
                    .is_some_and(|f| !matches!(f.treatment, Treatment::Refused { .. }))
            })
            .collect();
        let responses = typed(&[
            field_names::<crate::openai::request_bodies::responses::ResponsesOwn>(),
            field_names::<crate::openai::request_bodies::responses::ResponseToolFields>(),
            &shared,
        ]);
        for (endpoint, typed) in [
            (CHAT, chat),
            (COMPLETIONS, completions),
            (RESPONSES, responses),
        ] {
            let served: BTreeSet<&str> = FIELDS
                .iter()
                .filter(|f| f.on.covers(endpoint))
                .filter(|f| {
                    f.treatment == Treatment::Served
                        || f.name == "user"
                        || (f.name == "stream_options" && endpoint == RESPONSES)
                })
                .map(|f| f.name)
                .collect();
            assert_eq!(typed, served, "{}", endpoint.names());
        }
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
