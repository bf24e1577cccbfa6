//! The generation bodies' schemas as validation enforces them, no more and no less: the
//! sampling bounds of [`mole_api::request`], the pool's own limits (`maxTokens`,
//! `maxBatchSize`, the context and the vocabulary), chat's and completions' own `logprobs`,
//! the messages a role may send without content, and every field of the field table
//! ([`super::openai::fields`]): a refused field takes only null or its no-op values, an
//! ignored one anything, and a field in neither is refused (`additionalProperties: false`).

use serde_json::{json, Map, Value};
use utoipa::OpenApi;

use mole_api::request::{self, RealField, MAX_LOGPROBS, MAX_STOP, MAX_STOP_TOKEN_IDS};

use super::openai::fields::{On, Treatment, FIELDS};
use super::openai::request_bodies::RequestSchemas;
use crate::AppState;

/// The limits of this worker that bound a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct RequestLimits {
    /// `limits.maxTokens`.
    pub(super) max_tokens: u64,
    /// `limits.maxBatchSize` (the most choices).
    pub(super) max_batch_size: u32,
    /// The longest sequence (the model's within `limits.maxSeqLen`).
    pub(super) max_seq: usize,
    /// The vocabulary (token ids below it; 0: unknown).
    pub(super) vocab: usize,
    /// The model takes images.
    pub(super) vision: bool,
    /// `limits.maxImages`.
    pub(super) max_images: u32,
    /// `limits.maxStopChars`.
    pub(super) max_stop_chars: u32,
    /// `limits.maxGuideChars`.
    pub(super) max_guide_chars: u64,
    /// `limits.maxGuideChoices`.
    pub(super) max_guide_choices: u32,
    /// The pool knows its model's tool-call format (else `tools` are refused).
    pub(super) tools: bool,
    /// A vision model's image placeholder (never a completion's token id).
    pub(super) image_token: Option<u32>,
}

impl Default for RequestLimits {
    fn default() -> Self {
        let l = mole_api::WorkerLimits::default();
        Self {
            max_tokens: u64::from(l.max_tokens),
            max_batch_size: l.engine.max_batch_size,
            max_seq: l.engine.max_seq_len as usize,
            vocab: 0,
            vision: true,
            max_images: l.max_images,
            max_stop_chars: l.max_stop_chars,
            max_guide_chars: l.max_guide_chars,
            max_guide_choices: l.max_guide_choices,
            tools: true,
            image_token: None,
        }
    }
}

/// A real field's schema from its bounds (null: the default).
fn real(b: &RealField) -> Value {
    let mut s = json!({"type": ["number", "null"], "maximum": b.max});
    let key = match b.min_exclusive {
        true => "exclusiveMinimum",
        false => "minimum",
    };
    s[key] = json!(b.min);
    s
}

/// An optional integer within `[min, max]`.
fn int(min: u64, max: u64) -> Value {
    json!({"type": ["integer", "null"], "minimum": min, "maximum": max})
}

/// `schema` with its `allOf` parts (a `#[serde(flatten)]`ed struct) and their references
/// merged into one object schema.
fn merged(schema: &Value, schemas: &Value) -> Map<String, Value> {
    let mut out = Map::new();
    let mut props = Map::new();
    let mut required: Vec<Value> = Vec::new();
    let mut parts = vec![schema.clone()];
    while let Some(mut p) = parts.pop() {
        if let Some(name) = p["$ref"]
            .as_str()
            .and_then(|r| r.strip_prefix("#/components/schemas/"))
        {
            p = schemas[name].clone();
        }
        if let Some(all) = p["allOf"].as_array() {
            parts.extend(all.iter().cloned());
        }
        if let Some(m) = p["properties"].as_object() {
            props.extend(m.clone());
        }
        if let Some(r) = p["required"].as_array() {
            required.extend(r.iter().cloned());
        }
        if let Some(d) = p.get("description") {
            out.entry("description").or_insert(d.clone());
        }
    }
    out.insert("type".into(), json!("object"));
    out.insert("required".into(), Value::Array(required));
    out.insert("properties".into(), Value::Object(props));
    out
}

/// `expert`: an adapter's name or its integer label (an i64).
fn expert() -> Value {
    json!({"oneOf": [
        {"type": "string"},
        {"type": "integer", "minimum": i64::MIN, "maximum": i64::MAX},
        {"type": "null"},
    ], "description": "The adapter's name or router label (string or integer)."})
}

/// The sampling fields' schemas, shared by chat and completions.
fn sampling(props: &mut Map<String, Value>, lim: &RequestLimits) {
    props.insert("expert".into(), expert());
    for b in request::REAL_FIELDS {
        let mut s = real(&b);
        if let Some(d) = props.get(b.field).and_then(|p| p.get("description")) {
            s["description"] = d.clone();
        }
        props.insert(b.field.into(), s);
    }
    props.insert("seed".into(), int(0, u64::MAX));
    props.insert("top_k".into(), int(0, u64::MAX));
    let most_n = request::MAX_N.min(u64::from(lim.max_batch_size));
    props.insert("n".into(), int(1, most_n));
    props.insert("max_tokens".into(), int(1, lim.max_tokens));
    props.insert("max_completion_tokens".into(), int(1, lim.max_tokens));
    let stop = json!({"type": "string", "minLength": 1, "maxLength": lim.max_stop_chars});
    props.insert(
        "stop".into(),
        json!({"oneOf": [
            stop,
            {"type": "array", "items": stop, "maxItems": MAX_STOP},
            {"type": "null"},
        ]}),
    );
    // The guides' own sizes (a schema's compact text is bounded too, which JSON Schema cannot
    // state).
    let described = |props: &Map<String, Value>, k: &str, mut s: Value| {
        if let Some(d) = props.get(k).and_then(|p| p.get("description")) {
            s["description"] = d.clone();
        }
        s
    };
    for (k, min) in [("guided_regex", 0), ("guided_grammar", 1)] {
        let s =
            json!({"type": ["string", "null"], "minLength": min, "maxLength": lim.max_guide_chars});
        let s = described(props, k, s);
        props.insert(k.into(), s);
    }
    let choices = json!({"type": ["array", "null"], "items": {"type": "string"}, "minItems": 1,
                         "maxItems": lim.max_guide_choices});
    let choices = described(props, "guided_choice", choices);
    props.insert("guided_choice".into(), choices);
    props.insert(
        "stop_token_ids".into(),
        json!({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": u32::MAX},
               "maxItems": MAX_STOP_TOKEN_IDS}),
    );
}

/// The field table's refused and ignored fields of `endpoint`, and no others.
fn table(out: &mut Map<String, Value>, endpoint: On) {
    let Some(props) = out.get_mut("properties").and_then(Value::as_object_mut) else {
        return;
    };
    for f in FIELDS.iter().filter(|f| f.on.covers(endpoint)) {
        match f.treatment {
            Treatment::Served => {}
            Treatment::Ignored(why) => {
                // A typed one (`user`, read for canary sessions) keeps its type.
                let p = props.entry(f.name).or_insert_with(|| json!({}));
                p["description"] = json!(format!("Accepted and ignored ({}): {why}.", f.from));
            }
            Treatment::Refused { why, noop } => {
                let mut values = vec![Value::Null];
                values.extend(noop.iter().filter_map(|n| serde_json::from_str(n).ok()));
                props.insert(
                    f.name.into(),
                    json!({
                        "enum": values,
                        "description": format!(
                            "Not supported ({}: {why}): any other value is refused with 400 unsupported_field.",
                            f.from
                        ),
                    }),
                );
            }
        }
    }
    out.insert("additionalProperties".into(), json!(false));
}

/// A chat message as typed ([`super::openai::request_bodies::InMessage`]), its content's parts as this
/// model takes them (image parts only when it takes images), and every role but `assistant`
/// saying something.
fn message(derived: &Value, schemas: &Value, vision: bool) -> Value {
    let image = json!({"type": "string", "description":
        "The image: a `data:image/...;base64,` URL, base64 alone, or an http(s) URL of an allowed host."});
    let image_url = json!({"oneOf": [
        {"type": "object", "required": ["url"], "properties": {"url": image}},
        image,
    ]});
    let text_part = json!({"type": "object", "required": ["type"], "properties": {
        "type": {"enum": ["text", "input_text"]},
        "text": {"type": ["string", "null"]},
        "image_url": {"oneOf": [image_url, {"type": "null"}]},
    }});
    // `text` is one field of every part ([`super::openai::request_bodies::Part`]), read as a string
    // whatever the part's type (an image part's is ignored), so its shape holds here too.
    let image_part = json!({"type": "object", "required": ["type", "image_url"], "properties": {
        "type": {"enum": ["image_url", "input_image"]},
        "image_url": image_url,
        "text": {"type": ["string", "null"], "description": "Ignored on an image part."},
    }});
    let parts = match vision {
        true => json!({"oneOf": [text_part, image_part]}),
        false => text_part,
    };
    let content =
        json!({"oneOf": [{"type": "string"}, {"type": "array", "items": parts}, {"type": "null"}]});
    let mut m = merged(derived, schemas);
    if let Some(p) = m.get_mut("properties").and_then(Value::as_object_mut) {
        p.insert("content".into(), content);
    }
    m.insert(
        "anyOf".into(),
        json!([
            {"properties": {"role": {"const": "assistant"}}},
            {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
        ]),
    );
    m.insert("description".into(), json!(
        "A chat message: `developer` is read as `system`; only an `assistant` message may leave out its content."));
    Value::Object(m)
}

/// The rules between the fields that shape an answer, which each field's own schema cannot
/// state: at most one structured output (one field, one key of `structured_outputs`, a
/// `response_format` other than `text`), and `tool_choice` other than `none` only beside tools
/// (a forced call beside a format is served: the call shapes that answer). With `tools_known` false (the pool does not know
/// its model's tool-call format) `tools` must be empty.
fn shaping_rules(
    props: &mut Map<String, Value>,
    out: &mut Map<String, Value>,
    tools: Option<bool>,
) {
    let set = |k: &str, inner: Value| json!({"required": [k], "properties": {k: inner}});
    let not_null = json!({"not": {"type": "null"}});
    // structured_outputs holds exactly one constraint (its own schema says so): present, it
    // is one guide.
    let guides = [
        set(
            "response_format",
            json!({"required": ["type"], "properties": {"type": {"enum": ["json_object", "json_schema"]}}}),
        ),
        set("structured_outputs", not_null.clone()),
        set("guided_json", not_null.clone()),
        set("guided_regex", not_null.clone()),
        set("guided_choice", not_null.clone()),
        set("guided_grammar", not_null.clone()),
    ];
    let mut conflicts = Vec::new();
    for (i, a) in guides.iter().enumerate() {
        for b in &guides[i + 1..] {
            conflicts.push(json!({"allOf": [a, b]}));
        }
    }
    let mut all = vec![json!({"not": {"anyOf": conflicts}})];
    if let Some(known) = tools {
        if !known {
            props.insert(
                "tools".into(),
                json!({"type": ["array", "null"], "maxItems": 0, "description":
                    "This model's tool-call format is unknown (no baseModel.toolCallParser, and its template names no <tool_call>): tools are refused with 400 tools_not_supported."}),
            );
        }
        // tool_choice other than none needs tools.
        all.push(json!({"anyOf": [
            {"properties": {"tool_choice": {"enum": [null, "none"]}}},
            set("tools", json!({"type": "array", "minItems": 1})),
        ]}));
    }
    out.insert("allOf".into(), Value::Array(all));
}

/// The prompt of a completion: non-empty text, one text, or token ids of the vocabulary.
fn prompt(lim: &RequestLimits) -> Value {
    let mut ids = json!({"type": "integer", "minimum": 0});
    if lim.vocab > 0 {
        ids["maximum"] = json!(lim.vocab - 1);
    }
    if let Some(i) = lim.image_token {
        ids["not"] = json!({"const": i});
        ids["description"] = json!("A token id of the vocabulary, not the image placeholder (a completion takes no images).");
    }
    json!({"oneOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": ids, "minItems": 1, "maxItems": lim.max_seq.saturating_sub(1).max(1)},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1},
    ]})
}

/// The Responses API's body: its sampling bounds, its input items as this model takes them
/// (image parts in user and system messages only, and only when it takes images; a tool's
/// output and an earlier answer are text), the rules between its fields, and the field table.
fn responses(doc: &mut Value, schemas: &Value, lim: &RequestLimits) {
    let mut body = merged(&schemas["ResponsesBody"], schemas);
    let Some(mut props) = body.remove("properties").and_then(|p| match p {
        Value::Object(m) => Some(m),
        _ => None,
    }) else {
        return;
    };
    // Chat's common part brings the fields of chat's own table too: only this API's stay.
    props.retain(|k, _| super::openai::fields::field(k, On::RESPONSES).is_some());
    props.insert("expert".into(), expert());
    for b in request::REAL_FIELDS
        .iter()
        .filter(|b| ["temperature", "top_p", "min_p", "repetition_penalty"].contains(&b.field))
    {
        let mut s = real(b);
        if let Some(d) = props.get(b.field).and_then(|p| p.get("description")) {
            s["description"] = d.clone();
        }
        props.insert(b.field.into(), s);
    }
    props.insert("seed".into(), int(0, u64::MAX));
    props.insert("top_k".into(), int(0, u64::MAX));
    props.insert("max_output_tokens".into(), int(1, lim.max_tokens));
    let image = json!({"type": "string", "description":
        "The image: a `data:image/...;base64,` URL, base64 alone, or an http(s) URL of an allowed host."});
    let text_parts = json!([
        {"type": "object", "required": ["type", "text"], "properties": {
            "type": {"enum": ["input_text", "output_text"]}, "text": {"type": "string"}}},
        {"type": "object", "required": ["type", "refusal"], "properties": {
            "type": {"const": "refusal"}, "refusal": {"type": "string"}}},
    ]);
    let mut with_images = text_parts.as_array().cloned().unwrap_or_default();
    if lim.vision {
        with_images.push(
            json!({"type": "object", "required": ["type", "image_url"], "properties": {
            "type": {"const": "input_image"}, "image_url": image, "file_id": {"type": "null"}}}),
        );
    }
    let content = |parts: Value| json!({"oneOf": [{"type": "string"}, {"type": "array", "items": {"oneOf": parts}}]});
    let message = |roles: Value, parts: Value| {
        json!({"type": "object", "required": ["role", "content"], "properties": {
            "type": {"enum": ["message", null]}, "role": roles, "content": content(parts)}})
    };
    let item = json!({"oneOf": [
        message(json!({"enum": ["user", "system", "developer"]}), Value::Array(with_images)),
        message(json!({"const": "assistant"}), text_parts.clone()),
        {"type": "object", "required": ["type", "call_id", "name", "arguments"], "properties": {
            "type": {"const": "function_call"}, "call_id": {"type": "string"},
            "name": {"type": "string"},
            "arguments": {"type": "string", "contentMediaType": "application/json",
                          "description": "A JSON object's text."}}},
        {"type": "object", "required": ["type", "call_id", "output"], "properties": {
            "type": {"const": "function_call_output"},
            "call_id": {"type": "string", "description": "A function_call's earlier in input (400 unknown_call_id otherwise)."},
            "output": content(text_parts)}},
        {"type": "object", "required": ["type"], "properties": {
            "type": {"const": "reasoning"},
            "summary": {"type": "array", "items": {"type": "object", "required": ["text"], "properties": {"text": {"type": "string"}}}},
            "content": {"type": ["array", "null"], "items": {"type": "object", "required": ["text"], "properties": {"text": {"type": "string"}}}}}},
    ]});
    props.insert(
        "input".into(),
        json!({"oneOf": [{"type": "string"}, {"type": "array", "items": item, "minItems": 1}],
               "description": format!(
                   "The conversation: a text (one user message), or items. Its image parts are \
                    at most limits.maxImages ({}).", lim.max_images)}),
    );
    props.insert(
        "metadata".into(),
        json!({"type": ["object", "null"], "maxProperties": 16,
               "propertyNames": {"maxLength": 64},
               "additionalProperties": {"type": "string", "maxLength": 512},
               "description": "Up to 16 tags, echoed in the answer."}),
    );
    // tool_choice other than none needs tools; tools only where the pool knows its tool-call
    // format.
    let set = |k: &str, inner: Value| json!({"required": [k], "properties": {k: inner}});
    if !lim.tools {
        props.insert(
            "tools".into(),
            json!({"type": ["array", "null"], "maxItems": 0, "description":
                "This model's tool-call format is unknown: tools are refused with 400 tools_not_supported."}),
        );
    }
    body.insert(
        "allOf".into(),
        json!([
            {"anyOf": [
                {"properties": {"tool_choice": {"enum": [null, "none"]}}},
                set("tools", json!({"type": "array", "minItems": 1})),
            ]},
        ]),
    );
    body.insert("properties".into(), Value::Object(props));
    table(&mut body, On::RESPONSES);
    doc["components"]["schemas"]["ResponsesBody"] = Value::Object(body);
}

/// Rewrites the request schemas of `doc` (the document as JSON) to what validation enforces.
fn enforce(doc: &mut Value, lim: &RequestLimits) {
    let schemas = doc["components"]["schemas"].clone();
    let msg = message(&schemas["InMessage"], &schemas, lim.vision);
    let messages = json!({"type": "array", "items": msg, "minItems": 1, "description": format!(
        "The conversation. Its image parts, in all messages, are at most limits.maxImages ({}); \
         more are refused with 400 too_many_images.", lim.max_images)});
    // Chat.
    let mut chat = merged(&schemas["ChatBody"], &schemas);
    if let Some(p) = chat.get_mut("properties").and_then(Value::as_object_mut) {
        sampling(p, lim);
        p.insert("messages".into(), messages.clone());
        p.insert(
            "logprobs".into(),
            json!({"type": ["boolean", "null"], "description": "Whether to return log probabilities."}),
        );
        p.insert("top_logprobs".into(), int(0, MAX_LOGPROBS as u64));
    }
    // top_logprobs only beside logprobs: true.
    chat.insert(
        "dependentSchemas".into(),
        json!({"top_logprobs": {"anyOf": [
            {"properties": {"top_logprobs": {"type": "null"}}},
            {"required": ["logprobs"], "properties": {"logprobs": {"const": true}}},
        ]}}),
    );
    let mut chat_props = chat.remove("properties").unwrap_or_default();
    if let Value::Object(p) = &mut chat_props {
        shaping_rules(p, &mut chat, Some(lim.tools));
    }
    chat.insert("properties".into(), chat_props);
    table(&mut chat, On::CHAT);
    doc["components"]["schemas"]["ChatBody"] = Value::Object(chat);
    // Completions.
    let mut completion = merged(&schemas["CompletionBody"], &schemas);
    if let Some(p) = completion
        .get_mut("properties")
        .and_then(Value::as_object_mut)
    {
        sampling(p, lim);
        p.insert("prompt".into(), prompt(lim));
        p.insert(
            "logprobs".into(),
            json!({"oneOf": [int(0, MAX_LOGPROBS as u64)], "description": "How many alternatives per token."}),
        );
        p.insert(
            "top_logprobs".into(),
            json!({"type": "null", "description": "A chat field: completions take `logprobs: <count>`."}),
        );
    }
    let mut props = completion.remove("properties").unwrap_or_default();
    if let Value::Object(p) = &mut props {
        shaping_rules(p, &mut completion, None);
    }
    completion.insert("properties".into(), props);
    table(&mut completion, On::COMPLETIONS);
    doc["components"]["schemas"]["CompletionBody"] = Value::Object(completion);
    // The router: input or messages (validated whenever sent), and the model or adapter asked
    // for; the other fields of a chat body sent here are ignored (nothing is generated).
    let mut route = merged(&schemas["RouteBody"], &schemas);
    if let Some(p) = route.get_mut("properties").and_then(Value::as_object_mut) {
        p.retain(|k, _| ["input", "messages", "model", "adapter", "expert"].contains(&k.as_str()));
        p.insert("expert".into(), expert());
        p.insert(
            "messages".into(),
            json!({"oneOf": [messages, {"type": "null"}]}),
        );
    }
    route.insert(
        "anyOf".into(),
        json!([
            {"required": ["input"], "properties": {"input": {"type": "string"}}},
            {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
        ]),
    );
    doc["components"]["schemas"]["RouteBody"] = Value::Object(route);
    // The seeds' task call: chat's sampling (its other fields are mole's own).
    let mut infer = merged(&schemas["InferBody"], &schemas);
    if let Some(p) = infer.get_mut("properties").and_then(Value::as_object_mut) {
        sampling(p, lim);
        // One text, whole.
        let whole = "Not served by /infer, whose answer is one text, whole: any other value is refused with 400 unsupported_field.";
        for (k, values) in [
            ("stream", json!([false])),
            ("stream_options", json!([null])),
            ("n", json!([1, null])),
            ("logprobs", json!([false, null])),
            ("top_logprobs", json!([null])),
        ] {
            p.insert(k.into(), json!({"enum": values, "description": whole}));
        }
        if !lim.vision {
            p.insert(
                "image_b64".into(),
                json!({"type": "null", "description": "This model takes no images."}),
            );
        }
    }
    let mut props = infer.remove("properties").unwrap_or_default();
    if let Value::Object(p) = &mut props {
        shaping_rules(p, &mut infer, None);
    }
    infer.insert("properties".into(), props);
    // The prompt, by either name.
    if let Some(Value::Array(all)) = infer.get_mut("allOf") {
        all.push(json!({"anyOf": [
            {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
            {"required": ["input"], "properties": {"input": {"type": "string"}}},
        ]}));
    }
    // It is a chat: chat's refused and ignored fields, and no other.
    table(&mut infer, On::CHAT);
    doc["components"]["schemas"]["InferBody"] = Value::Object(infer);
    // vLLM's tokenizer calls: a prompt or messages, not both; ids of the vocabulary.
    let tokenize = &mut doc["components"]["schemas"]["TokenizeBody"];
    tokenize["properties"]["messages"] = json!({"oneOf": [messages, {"type": "null"}]});
    tokenize["oneOf"] = json!([
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}, "prompt": {"type": "null"}}},
    ]);
    if lim.vocab > 0 {
        doc["components"]["schemas"]["DetokenizeBody"]["properties"]["tokens"]["items"] =
            json!({"type": "integer", "minimum": 0, "maximum": lim.vocab - 1});
    }
    doc["components"]["schemas"]["InMessage"] = msg;
    responses(doc, &schemas, lim);
    // vLLM's structured_outputs: exactly one constraint.
    let so = &mut doc["components"]["schemas"]["StructuredOutputs"];
    if so.is_object() {
        let set = |k: &str, inner: Value| json!({"required": [k], "properties": {k: inner}});
        let not_null = json!({"not": {"type": "null"}});
        so["oneOf"] = json!([
            set("json", not_null.clone()),
            set("regex", not_null.clone()),
            set("choice", not_null.clone()),
            set("grammar", not_null),
            set("json_object", json!({"const": true})),
        ]);
    }
    // Loading takes a path (unloading does not); a name without '/' or spaces.
    let mut load = doc["components"]["schemas"]["LoadBody"].clone();
    load["required"] = json!(["lora_name", "lora_path"]);
    load["properties"]["lora_name"] = json!({"type": "string",
        "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]*$", "maxLength": crate::config::MAX_ADAPTER_NAME,
        "description": "The adapter's name, as a configured adapter's: letters, digits, '.', '_' \
                        and '-', starting with a letter or digit; not the pool's or the base \
                        model's name."});
    load["properties"]["lora_path"] = json!({"type": "string", "description":
        "The adapter's directory under modelRoot, holding adapter_model.safetensors; not a configured adapter's."});
    doc["components"]["schemas"]["LoadAdapterBody"] = load;
    let body = &mut doc["paths"]["/v1/load_lora_adapter"]["post"]["requestBody"]["content"]
        ["application/json"]["schema"];
    if body.is_object() {
        *body = json!({"$ref": "#/components/schemas/LoadAdapterBody"});
    }
}

/// The request bodies' schemas for this worker's `limits`, as the served document states them
/// ([`finish`] on [`RequestSchemas`]): what a body is held to ([`crate::doc_check`]).
pub(super) fn request_schemas(limits: &RequestLimits) -> Value {
    let mut v = serde_json::to_value(RequestSchemas::openapi()).unwrap_or_default();
    finish(&mut v, limits);
    v["components"]["schemas"].take()
}

/// What the document's derived schemas lack: the limits of this worker ([`enforce`]), and
/// `contentSchema`s, each its own document to validators (schemathesis resolves it apart from
/// the components), with their references inlined.
pub(super) fn finish(doc: &mut Value, limits: &RequestLimits) {
    enforce(doc, limits);
    let schemas = doc["components"]["schemas"].clone();
    inline_content_schemas(doc, &schemas);
}

/// The limits of this worker the request schemas state.
pub(super) fn request_limits(s: &AppState) -> RequestLimits {
    let cfg = s.cfg();
    let info = s.info.model_info();
    RequestLimits {
        max_tokens: u64::from(cfg.limits.max_tokens),
        max_batch_size: cfg.limits.engine.max_batch_size,
        max_seq: (cfg.limits.engine.max_seq_len as usize).min(info.max_seq_len.max(1)),
        vocab: info.vocab_size,
        vision: info.vision,
        max_images: cfg.limits.max_images,
        max_stop_chars: cfg.limits.max_stop_chars,
        max_guide_chars: cfg.limits.max_guide_chars,
        max_guide_choices: cfg.limits.max_guide_choices,
        tools: super::openai::outputs::Formats::for_pool(s).tools.is_some(),
        image_token: info.image_token,
    }
}

/// Turns every `x-content-schema` into `contentSchema` (a JSON Schema keyword utoipa has no
/// field for) with its `$ref`s to `schemas` inlined.
fn inline_content_schemas(v: &mut serde_json::Value, schemas: &serde_json::Value) {
    match v {
        serde_json::Value::Object(m) => {
            if let Some(mut x) = m.remove("x-content-schema") {
                inline_refs(&mut x, schemas, 0);
                m.insert("contentSchema".to_string(), x);
            }
            m.values_mut()
                .for_each(|x| inline_content_schemas(x, schemas));
        }
        serde_json::Value::Array(a) => a
            .iter_mut()
            .for_each(|x| inline_content_schemas(x, schemas)),
        _ => {}
    }
}

/// Replaces `{"$ref": "#/components/schemas/X"}` in `v` by X, recursively (the reply types
/// have no cycles; `depth` stops one that would).
fn inline_refs(v: &mut serde_json::Value, schemas: &serde_json::Value, depth: usize) {
    if let Some(name) = v
        .get("$ref")
        .and_then(|r| r.as_str())
        .and_then(|r| r.strip_prefix("#/components/schemas/"))
    {
        if depth < 16 {
            *v = schemas[name].clone();
        }
    }
    match v {
        serde_json::Value::Object(m) => m
            .values_mut()
            .for_each(|x| inline_refs(x, schemas, depth + 1)),
        serde_json::Value::Array(a) => a
            .iter_mut()
            .for_each(|x| inline_refs(x, schemas, depth + 1)),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field the table serves is in the body's schema, and every property of the schema
    /// is in the table: the document and the table cannot drift apart.
    #[test]
    fn the_bodies_and_the_table_agree() {
        let auth = crate::openapi::DocAuth {
            api_keys: true,
            admin_token: true,
            operator_token: false,
        };
        let doc = crate::openapi::document(auth, &RequestLimits::default());
        for (name, endpoint) in [("ChatBody", On::CHAT), ("CompletionBody", On::COMPLETIONS)] {
            let body = &doc["components"]["schemas"][name];
            assert_eq!(body["additionalProperties"], false, "{name}");
            let props = body["properties"].as_object().unwrap();
            for f in FIELDS.iter().filter(|f| f.on.covers(endpoint)) {
                assert!(props.contains_key(f.name), "{name} lacks {}", f.name);
            }
            for p in props.keys() {
                assert!(
                    crate::openai::fields::field(p, endpoint).is_some(),
                    "{name}.{p} is not in the field table"
                );
            }
        }
        let chat = &doc["components"]["schemas"]["ChatBody"]["properties"];
        assert_eq!(chat["min_p"]["maximum"], 1.0);
        assert_eq!(chat["top_p"]["minimum"], f64::from(f32::MIN_POSITIVE));
        assert_eq!(chat["repetition_penalty"]["maximum"], 100.0);
        // n: OpenAI's 128 within the pool's batch.
        let batch = RequestLimits::default().max_batch_size;
        assert_eq!(chat["n"]["maximum"], 128.min(batch));
    }
}
