//! Text in and out of the engine: the model's `tokenizer.json`, its chat template rendered as
//! transformers renders it, incremental UTF-8-safe detokenization for streaming, and stop
//! strings that never leak into the output.

use std::path::Path;

use minijinja::{Environment, ErrorKind, Value};
use serde_json::Value as Json;
use tokenizers::Tokenizer;

use super::api::ChatMessage;

/// Why the text side of a model could not be loaded or used. Stable names via
/// [`TextError::code`].
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// `tokenizer.json` is missing or unreadable.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The model ships no chat template (chat requests need one).
    #[error("the model has no chat template (tokenizer_config.json chat_template)")]
    NoChatTemplate,
    /// The chat template failed to compile or render (including `raise_exception`).
    #[error("chat template: {0}")]
    Template(String),
    /// The chat template ran past its fuel (`limits.maxTemplateFuel`).
    #[error("the chat template ran past its fuel ({0} units)")]
    TemplateFuel(u64),
    /// A file of the model directory resolves outside it (a symlink to elsewhere).
    #[error(transparent)]
    OutsideDir(mole_formats::hf::HfError),
}

impl TextError {
    /// Stable name (metric label, JSON `code`).
    pub fn code(&self) -> &'static str {
        match self {
            TextError::Tokenizer(_) => "tokenizer_error",
            TextError::NoChatTemplate => "no_chat_template",
            TextError::Template(_) => "chat_template_error",
            TextError::TemplateFuel(_) => "template_fuel_exhausted",
            TextError::OutsideDir(e) => e.code(),
        }
    }
}

/// Tokenizer, chat template and stop tokens of one model directory.
pub struct TextModel {
    tokenizer: Tokenizer,
    template: Option<Environment<'static>>,
    /// The chat template's source (what the server reads the tool-call and reasoning formats
    /// from).
    template_source: Option<String>,
    bos: Option<String>,
    eos: Option<String>,
    /// Token ids that end generation (EOS from every config that names one).
    pub eos_ids: Vec<u32>,
    /// See [`TextModel::max_token_bytes`].
    max_token_bytes: usize,
    /// See [`TextModel::set_template_fuel`].
    fuel: Option<u64>,
}

impl std::fmt::Debug for TextModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextModel")
            .field("eos_ids", &self.eos_ids)
            .field("chat_template", &self.template.is_some())
            .finish()
    }
}

fn read_json(p: &Path) -> Option<Json> {
    serde_json::from_str(&std::fs::read_to_string(p).ok()?).ok()
}

/// `"<s>"` or `{"content": "<s>", ...}` as tokenizer_config.json writes special tokens.
fn token_string(v: Option<&Json>) -> Option<String> {
    match v? {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content")?.as_str().map(String::from),
        _ => None,
    }
}

fn push_ids(v: Option<&Json>, out: &mut Vec<u32>) {
    match v {
        Some(Json::Number(n)) => out.extend(n.as_u64().map(|x| x as u32)),
        Some(Json::Array(a)) => out.extend(a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32)),
        _ => {}
    }
}

/// The template transformers would pick: a string, or the `default` entry of a named list.
fn pick_template(v: Option<&Json>) -> Option<String> {
    match v? {
        Json::String(s) => Some(s.clone()),
        Json::Array(list) => list
            .iter()
            .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
            .or_else(|| list.first())
            .and_then(|t| t.get("template")?.as_str().map(String::from)),
        _ => None,
    }
}

/// A Jinja environment configured like transformers' `_compile_jinja_template`: trimmed blocks,
/// Python string methods, `raise_exception`, `strftime_now`, and `tojson` that keeps non-ASCII.
fn chat_env(source: String) -> Result<Environment<'static>, TextError> {
    let mut env = Environment::new();
    env.set_syntax(
        minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| TextError::Template(e.to_string()))?,
    );
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |msg: String| -> Result<Value, _> {
        Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
    });
    // transformers' tojson is Python's json.dumps (", " and ": ", nothing HTML-escaped),
    // not minijinja's compact, HTML-safe one: tools rendered by `tool | tojson` read as the
    // model saw them in training.
    env.add_filter(
        "tojson",
        |v: Value, kwargs: minijinja::value::Kwargs| -> Result<Value, minijinja::Error> {
            let indent: Option<usize> = kwargs.get("indent")?;
            kwargs.assert_all_used()?;
            let json = serde_json::to_value(&v)
                .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
            Ok(Value::from_safe_string(super::pyjson::dumps(&json, indent)))
        },
    );
    env.add_function("strftime_now", |fmt: String| {
        chrono::Local::now().format(&fmt).to_string()
    });
    env.add_template_owned("chat", source)
        .map_err(|e| TextError::Template(e.to_string()))?;
    Ok(env)
}

impl TextModel {
    /// Loads `tokenizer.json`, `tokenizer_config.json` (chat template, special tokens) and the
    /// EOS ids of `config.json` and `generation_config.json` from a model directory.
    pub fn load(dir: &Path) -> Result<Self, TextError> {
        // Every file confined to the directory: a symlink out of it is refused, not read.
        let file = |name: &str| mole_formats::hf::confine(dir, name).map_err(TextError::OutsideDir);
        let tokenizer = Tokenizer::from_file(file("tokenizer.json")?)
            .map_err(|e| TextError::Tokenizer(format!("{}: {e}", dir.display())))?;
        let tcfg = read_json(&file("tokenizer_config.json")?).unwrap_or(Json::Null);
        let mut configs = Vec::new();
        for f in ["generation_config.json", "config.json"] {
            configs.extend(read_json(&file(f)?));
        }
        // Newer checkpoints keep the template in its own file: `chat_template.jinja`, or the
        // processor's `chat_template.json` (Qwen-VL checkpoints).
        let template_json = file("chat_template.json")?;
        let template_file = std::fs::read_to_string(file("chat_template.jinja")?)
            .ok()
            .or_else(|| {
                read_json(&template_json)?
                    .get("chat_template")?
                    .as_str()
                    .map(String::from)
            });
        Self::from_parts(tokenizer, tcfg, &configs, template_file)
    }

    /// Builds from a `tokenizer.json` text, `tokenizer_config.json` and the configs that name
    /// EOS ids (a GGUF file carries all of them in its metadata).
    pub fn from_json(
        tokenizer_json: &str,
        tcfg: Json,
        configs: &[Json],
    ) -> Result<Self, TextError> {
        let tokenizer = Tokenizer::from_bytes(tokenizer_json.as_bytes())
            .map_err(|e| TextError::Tokenizer(e.to_string()))?;
        Self::from_parts(tokenizer, tcfg, configs, None)
    }

    fn from_parts(
        tokenizer: Tokenizer,
        tcfg: Json,
        configs: &[Json],
        template_file: Option<String>,
    ) -> Result<Self, TextError> {
        let bos = token_string(tcfg.get("bos_token"));
        let eos = token_string(tcfg.get("eos_token"));
        let mut eos_ids = Vec::new();
        for c in configs {
            push_ids(c.get("eos_token_id"), &mut eos_ids);
        }
        if let Some(id) = eos.as_deref().and_then(|t| tokenizer.token_to_id(t)) {
            eos_ids.push(id);
        }
        eos_ids.sort_unstable();
        eos_ids.dedup();
        let template_source = pick_template(tcfg.get("chat_template")).or(template_file);
        let template = match &template_source {
            Some(src) => Some(chat_env(src.clone())?),
            None => None,
        };
        let max_token_bytes = tokenizer
            .get_vocab(true)
            .keys()
            .map(String::len)
            .max()
            .unwrap_or(0);
        Ok(Self {
            tokenizer,
            template,
            template_source,
            bos,
            eos,
            eos_ids,
            max_token_bytes,
            fuel: None,
        })
    }

    /// The chat template's source, if the model has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.template_source.as_deref()
    }

    /// Bounds each rendering of the chat template to `fuel` (minijinja's units, about one an
    /// instruction; None: unbounded): a template that loops past it fails with
    /// [`TextError::TemplateFuel`] instead of holding a thread for minutes.
    pub fn set_template_fuel(&mut self, fuel: Option<u64>) {
        if let Some(env) = &mut self.template {
            env.set_fuel(fuel);
        }
        self.fuel = fuel;
    }

    /// Bytes of text one token covers at most: the longest token of the vocabulary, special
    /// tokens included, measured on its vocabulary string (whose byte-level or SentencePiece
    /// spelling is at least as long as the text it stands for).
    pub fn max_token_bytes(&self) -> usize {
        self.max_token_bytes
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// Token ids of a text. `special` adds the tokenizer's BOS/EOS template (raw completions
    /// prompts); chat prompts already carry their special tokens as text.
    pub fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>, TextError> {
        self.tokenizer
            .encode(text, special)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TextError::Tokenizer(e.to_string()))
    }

    /// Text of token ids, without special tokens.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TextError> {
        self.tokenizer
            .decode(ids, true)
            .map_err(|e| TextError::Tokenizer(e.to_string()))
    }

    /// The token's own string (for logprobs), special tokens included.
    pub fn token_text(&self, id: u32) -> String {
        self.tokenizer
            .decode(&[id], false)
            .unwrap_or_else(|_| format!("<{id}>"))
    }

    /// Renders chat messages as transformers' `apply_chat_template(..., add_generation_prompt=True)`.
    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, TextError> {
        self.render_chat_with(messages, true, &serde_json::Map::new())
    }

    /// Renders chat messages as transformers'
    /// `apply_chat_template(messages, tokenize=False, add_generation_prompt=..., **kwargs)`:
    /// `kwargs` (vLLM's `chat_template_kwargs`, e.g. Qwen3's `enable_thinking`) become template
    /// variables beside the special tokens.
    pub fn render_chat_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, Json>,
    ) -> Result<String, TextError> {
        let env = self.template.as_ref().ok_or(TextError::NoChatTemplate)?;
        let tmpl = env
            .get_template("chat")
            .map_err(|e| TextError::Template(e.to_string()))?;
        let mut ctx = serde_json::Map::new();
        ctx.insert(
            "bos_token".into(),
            self.bos.clone().unwrap_or_default().into(),
        );
        ctx.insert(
            "eos_token".into(),
            self.eos.clone().unwrap_or_default().into(),
        );
        ctx.insert("add_generation_prompt".into(), add_generation_prompt.into());
        // A caller's variables win (`/tokenize` sets `add_generation_prompt` through them).
        ctx.extend(kwargs.iter().map(|(k, v)| (k.clone(), v.clone())));
        ctx.insert(
            "messages".into(),
            serde_json::to_value(messages).map_err(|e| TextError::Template(e.to_string()))?,
        );
        tmpl.render(Value::from(minijinja::value::Serde(&ctx)))
            .map_err(|e| match (e.kind(), self.fuel) {
                (ErrorKind::OutOfFuel, Some(f)) => TextError::TemplateFuel(f),
                _ => TextError::Template(e.to_string()),
            })
    }
}

/// Turns a growing list of token ids into text deltas that never split a UTF-8 character:
/// the last few tokens are decoded together and a delta is released only when it does not
/// end in a replacement character (the approach of vLLM and TGI).
#[derive(Debug)]
pub struct Detokenizer {
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
}

/// Prompt tokens kept as decoding context, so tokenizers that strip a leading space at the
/// start of a decode (SentencePiece) see the same context for the old and the new text.
const CONTEXT_TOKENS: usize = 5;

impl Detokenizer {
    /// Starts after `prompt` (its last tokens give the first generated token its context).
    pub fn new(prompt: &[u32]) -> Self {
        let ctx = &prompt[prompt.len().saturating_sub(CONTEXT_TOKENS)..];
        Self {
            ids: ctx.to_vec(),
            prefix: 0,
            read: ctx.len(),
        }
    }

    /// Adds a token; returns the text it completes (possibly empty).
    pub fn push(&mut self, text: &TextModel, id: u32) -> Result<String, TextError> {
        self.ids.push(id);
        let before = text.decode(&self.ids[self.prefix..self.read])?;
        let now = text.decode(&self.ids[self.prefix..])?;
        if now.len() > before.len() && !now.ends_with('\u{FFFD}') && now.starts_with(&before) {
            let delta = now[before.len()..].to_string();
            self.prefix = self.read;
            self.read = self.ids.len();
            Ok(delta)
        } else if now.len() > before.len() && !now.ends_with('\u{FFFD}') {
            // The tokenizer rewrote earlier text (rare cleanup rules): emit the new tail by
            // characters so the stream stays valid UTF-8.
            let delta: String = now.chars().skip(before.chars().count()).collect();
            self.prefix = self.read;
            self.read = self.ids.len();
            Ok(delta)
        } else {
            Ok(String::new())
        }
    }

    /// Text still held back when generation ends: a character left incomplete decodes as
    /// U+FFFD, as the full decode of the tokens does, so the deltas of a sequence always add
    /// up to the decode of its tokens.
    pub fn finish(&mut self, text: &TextModel) -> Result<String, TextError> {
        if self.read == self.ids.len() {
            return Ok(String::new());
        }
        let before = text.decode(&self.ids[self.prefix..self.read])?;
        let now = text.decode(&self.ids[self.prefix..])?;
        self.prefix = self.read;
        self.read = self.ids.len();
        Ok(match now.strip_prefix(&before) {
            Some(rest) => rest.to_string(),
            None => now.chars().skip(before.chars().count()).collect(),
        })
    }
}

/// Holds back text that could be the start of a stop string, and cuts the output at the
/// first stop string found (the stop string itself is never sent).
///
/// Each stop string is matched as KMP matches it: a state (how many of its leading bytes the
/// text so far ends with) advanced by each new byte through the string's failure table. So a
/// token costs the engine thread time in its own bytes, not in the stop strings' lengths (the
/// earlier scan of every tail against every stop was quadratic in a stop's length, which let a
/// request of long stops slow every sequence of the batch).
#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<Stop>,
    pending: String,
}

/// One stop string, its KMP failure table and how much of it the text so far ends with.
#[derive(Debug)]
struct Stop {
    bytes: Vec<u8>,
    /// `fail[i]`: the longest proper prefix of `bytes[..=i]` that is also its suffix.
    fail: Vec<usize>,
    /// Bytes of the string the text so far ends with.
    state: usize,
}

impl Stop {
    fn new(s: &str) -> Self {
        let bytes = s.as_bytes().to_vec();
        let mut fail = vec![0; bytes.len()];
        let mut k = 0;
        for i in 1..bytes.len() {
            while k > 0 && bytes[i] != bytes[k] {
                k = fail[k - 1];
            }
            if bytes[i] == bytes[k] {
                k += 1;
            }
            fail[i] = k;
        }
        Self {
            bytes,
            fail,
            state: 0,
        }
    }

    /// Advances by `b`; true when the whole string now ends the text.
    fn step(&mut self, b: u8) -> bool {
        let mut k = self.state;
        while k > 0 && self.bytes[k] != b {
            k = self.fail[k - 1];
        }
        if self.bytes[k] == b {
            k += 1;
        }
        if k == self.bytes.len() {
            self.state = self.fail[k - 1];
            return true;
        }
        self.state = k;
        false
    }
}

impl StopMatcher {
    /// A matcher for these stop strings (empty ones are ignored).
    pub fn new(stops: &[String]) -> Self {
        Self {
            stops: stops
                .iter()
                .filter(|s| !s.is_empty())
                .map(|s| Stop::new(s))
                .collect(),
            pending: String::new(),
        }
    }

    /// Adds a delta. Returns the text safe to send and whether a stop string was hit (then
    /// generation ends and the rest is dropped).
    pub fn push(&mut self, delta: &str) -> (String, bool) {
        if self.stops.is_empty() {
            return (delta.to_string(), false);
        }
        let before = self.pending.len();
        self.pending.push_str(delta);
        // The earliest start among the stop strings this delta completes.
        let mut hit: Option<usize> = None;
        for stop in &mut self.stops {
            for (i, &b) in delta.as_bytes().iter().enumerate() {
                if stop.step(b) {
                    let start = before + i + 1 - stop.bytes.len();
                    hit = Some(hit.map_or(start, |h| h.min(start)));
                    break;
                }
            }
        }
        if let Some(at) = hit {
            let out = self.pending[..at].to_string();
            self.flush();
            return (out, true);
        }
        // Keep the longest tail that is a prefix of some stop string: it starts where a stop
        // string does, on a character boundary.
        let keep = self.stops.iter().map(|s| s.state).max().unwrap_or(0);
        let cut = self.pending.len() - keep.min(self.pending.len());
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (out, false)
    }

    /// Text held back when generation ends for another reason (it was not a stop string).
    pub fn flush(&mut self) -> String {
        for s in &mut self.stops {
            s.state = 0;
        }
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The committed byte-level fixture tokenizer: token id = byte value.
    fn bytes_model() -> TextModel {
        TextModel::load(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../tests/fixtures/engine/llama"),
        )
        .unwrap()
    }

    /// Streams `ids` after `prompt`; returns the deltas (the last one from `finish`).
    fn stream(t: &TextModel, prompt: &[u32], ids: &[u32]) -> Vec<String> {
        let mut d = Detokenizer::new(prompt);
        let mut out: Vec<String> = ids.iter().map(|&i| d.push(t, i).unwrap()).collect();
        out.push(d.finish(t).unwrap());
        out
    }

    fn bytes(s: &str) -> Vec<u32> {
        s.bytes().map(u32::from).collect()
    }

    #[test]
    fn multibyte_characters_split_across_tokens_are_released_whole() {
        let t = bytes_model();
        assert_eq!(
            t.encode("é€", false).unwrap(),
            bytes("é€"),
            "one token per byte"
        );
        let text = "aé€😀中 z";
        let deltas = stream(&t, &bytes("hi "), &bytes(text));
        // A character comes out with its last byte, never before, never broken.
        let want: Vec<&str> = vec![
            "a", "", "é", "", "", "€", "", "", "", "😀", "", "", "中", " ", "z", "",
        ];
        assert_eq!(deltas, want);
        assert_eq!(deltas.concat(), text);
    }

    #[test]
    fn deltas_add_up_to_the_full_decode() {
        let t = bytes_model();
        let alphabet: Vec<char> = "ab \nçé€中😀🦀ß".chars().collect();
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut rnd = |n: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % n as u64) as usize
        };
        for _ in 0..200 {
            let text: String = (0..rnd(12))
                .map(|_| alphabet[rnd(alphabet.len())])
                .collect();
            let prompt: String = (0..rnd(8)).map(|_| alphabet[rnd(alphabet.len())]).collect();
            let deltas = stream(&t, &bytes(&prompt), &bytes(&text));
            assert!(deltas.iter().all(|d| !d.contains('\u{FFFD}')), "{deltas:?}");
            assert_eq!(deltas.concat(), text, "after prompt {prompt:?}");
            assert_eq!(deltas.concat(), t.decode(&bytes(&text)).unwrap());
        }
        // Invalid bytes from the model are not waited on forever: they show as U+FFFD once
        // valid text follows, exactly as the full decode shows them.
        let ids = [0xFFu32, b'a' as u32, 0xE2, 0x82];
        let deltas = stream(&t, &[], &ids);
        assert_eq!(deltas, vec!["", "\u{FFFD}a", "", "", "\u{FFFD}"]);
        assert_eq!(deltas.concat(), t.decode(&ids).unwrap());
        // Nothing held back: finish adds nothing.
        assert_eq!(stream(&t, &[], &bytes("ok")), vec!["o", "k", ""]);
    }

    #[test]
    fn stop_strings_are_cut_and_partial_matches_held() {
        let mut m = StopMatcher::new(&["###".into(), "END".into()]);
        assert_eq!(m.push("hello #"), ("hello ".into(), false));
        assert_eq!(m.push("# world"), ("## world".into(), false));
        assert_eq!(m.push(" E"), (" ".into(), false));
        assert_eq!(m.push("NDx"), ("".into(), true));
        let mut m = StopMatcher::new(&["ab".into()]);
        assert_eq!(m.push("xa"), ("x".into(), false));
        assert_eq!(m.flush(), "a");
        let mut m = StopMatcher::new(&[]);
        assert_eq!(m.push("abc"), ("abc".into(), false));
        // Multi-byte text next to a partial match keeps valid boundaries.
        let mut m = StopMatcher::new(&["éé".into()]);
        assert_eq!(m.push("caféé!"), ("caf".into(), true));
        let mut m = StopMatcher::new(&["éz".into()]);
        assert_eq!(m.push("café"), ("caf".into(), false));
        // Overlapping and repeated prefixes: the failure table finds the match a naive reset
        // would miss, and the earliest start wins among the strings a delta completes.
        let mut m = StopMatcher::new(&["aab".into()]);
        assert_eq!(m.push("aa"), ("".into(), false));
        assert_eq!(m.push("aab"), ("aa".into(), true));
        let mut m = StopMatcher::new(&["abcd".into(), "c".into()]);
        assert_eq!(m.push("ab"), ("".into(), false));
        assert_eq!(m.push("cd"), ("".into(), true));
        let mut m = StopMatcher::new(&["bc".into(), "abcd".into()]);
        assert_eq!(m.push("xabcd"), ("x".into(), true));
    }

    /// The matcher before it matched by KMP: every tail against every stop string each delta.
    /// The reference the linear matcher must equal.
    fn naive_push(stops: &[String], pending: &mut String, delta: &str) -> (String, bool) {
        pending.push_str(delta);
        let hit = stops.iter().filter_map(|s| pending.find(s.as_str())).min();
        if let Some(at) = hit {
            let out = pending[..at].to_string();
            pending.clear();
            return (out, true);
        }
        let keep = stops
            .iter()
            .map(|s| {
                (1..s.len().min(pending.len() + 1))
                    .rev()
                    .find(|&n| {
                        s.is_char_boundary(n)
                            && pending.is_char_boundary(pending.len() - n)
                            && pending.ends_with(&s[..n])
                    })
                    .unwrap_or(0)
            })
            .max()
            .unwrap_or(0);
        let cut = pending.len() - keep;
        let out = pending[..cut].to_string();
        pending.drain(..cut);
        (out, false)
    }

    /// The matcher equals the naive one, delta by delta, on random texts over a small
    /// alphabet (one multi-byte letter) split at random points.
    #[test]
    fn stop_matching_equals_the_naive_scan() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let word = |rng: &mut rand::rngs::StdRng, n: usize| -> String {
            (0..n)
                .map(|_| ['a', 'b', 'é'][rng.random_range(0..3)])
                .collect()
        };
        for _ in 0..5000 {
            let stops: Vec<String> = (0..rng.random_range(1..4))
                .map(|_| {
                    let n = rng.random_range(1..5);
                    word(&mut rng, n)
                })
                .collect();
            let chars: Vec<char> = word(&mut rng, 14).chars().collect();
            let mut m = StopMatcher::new(&stops);
            let mut pending = String::new();
            let mut i = 0;
            while i < chars.len() {
                let j = (i + rng.random_range(1..4)).min(chars.len());
                let delta: String = chars[i..j].iter().collect();
                let want = naive_push(&stops, &mut pending, &delta);
                assert_eq!(m.push(&delta), want, "stops {stops:?} at {delta:?}");
                if want.1 {
                    break;
                }
                i = j;
            }
        }
    }

    #[test]
    fn template_picks_default_and_special_tokens_read_both_forms() {
        let list = serde_json::json!([{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]);
        assert_eq!(pick_template(Some(&list)).as_deref(), Some("D"));
        assert_eq!(
            token_string(Some(&serde_json::json!({"content": "<s>"}))).as_deref(),
            Some("<s>")
        );
        let mut ids = vec![];
        push_ids(Some(&serde_json::json!([2, 7])), &mut ids);
        push_ids(Some(&serde_json::json!(3)), &mut ids);
        assert_eq!(ids, vec![2, 7, 3]);
    }

    #[test]
    fn raise_exception_and_python_methods_work_in_templates() {
        let env = chat_env(
            "{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}{{ m.content.strip().upper() }}|{% endfor %}".into(),
        )
        .unwrap();
        let t = env.get_template("chat").unwrap();
        let ok = t
            .render(minijinja::context! { messages => Value::from(minijinja::value::Serde(serde_json::json!([{"role": "user", "content": " hi "}]))) })
            .unwrap();
        assert_eq!(ok, "HI|");
        let err = t
            .render(minijinja::context! { messages => Value::from(minijinja::value::Serde(serde_json::json!([{"role": "bad", "content": ""}]))) })
            .unwrap_err();
        assert!(err.to_string().contains("no bad roles"), "{err}");
    }
}
