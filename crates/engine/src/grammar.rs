//! Structured outputs: a request's grammar (a JSON schema, a regex, a list of choices, a Lark
//! grammar) compiled by llguidance into a per-sequence matcher whose token mask the sampler
//! applies (the host sampler in [`super::sampler`], the device sampler in
//! [`super::device_sampler`], whose mask bits travel in the step's one upload).
//!
//! llguidance is what vLLM, SGLang, llama.cpp and mistral.rs use: an Earley parser over a
//! lexer of derivative-based regexes, computing a mask over a token trie in tens of
//! microseconds. Its token trie is built here from the model's `tokenizer.json` with
//! llguidance's own `token_bytes_from_tokenizer_json` (tokens marked `special` are reachable
//! only by name, so a grammar never emits `<|im_end|>` inside a JSON string), padded to the
//! logits' width, with the model's EOS ids as the trie's end tokens: EOS is allowed exactly
//! where the grammar accepts.
//!
//! A grammar may start after a gate token (Qwen3's `</think>`): until the sequence samples it,
//! the row is unconstrained (reasoning is free text), then the matcher starts.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory, TokenParser};
use serde_json::Value as Json;

/// What a request constrains its answer to.
#[derive(Debug, Clone, PartialEq)]
pub enum Guide {
    /// A JSON schema (OpenAI's `json_schema`, vLLM's `json` / `guided_json`); `{"type":
    /// "object"}` for `json_object`. `strict` (OpenAI's `strict: true`): every keyword is
    /// enforced, and a schema with one llguidance cannot enforce is refused, naming it.
    /// Otherwise llguidance's lenient mode: such keywords (and unknown `format`s) are not
    /// enforced, `oneOf` is read as `anyOf`, the rest is; [`Compiled::unenforced`] says what
    /// was not.
    Json {
        /// The schema.
        schema: Json,
        /// Refuse what cannot be enforced.
        strict: bool,
    },
    /// A regular expression the whole answer matches.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A Lark grammar (llguidance's dialect: `%json {...}` embeds a schema).
    Lark(String),
}

/// A request's guide and where it starts.
#[derive(Debug, Clone, PartialEq)]
pub struct Guided {
    /// The grammar.
    pub guide: Guide,
    /// A token (its text, e.g. `</think>`) after which the grammar starts; None: from the
    /// first generated token.
    pub after: Option<String>,
}

/// Why a guide was refused. Stable names via [`GrammarError::code`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GrammarError {
    /// A JSON schema llguidance cannot compile (bad schema, unsupported keyword).
    #[error("invalid JSON schema: {0}")]
    Schema(String),
    /// A regex, choice list or Lark grammar that does not compile.
    #[error("invalid grammar: {0}")]
    Grammar(String),
    /// The tokenizer cannot be turned into a token trie (neither byte-level nor byte-fallback).
    #[error("structured outputs are not available for this tokenizer: {0}")]
    Tokenizer(String),
}

impl GrammarError {
    /// Stable name (JSON `code`).
    pub fn code(&self) -> &'static str {
        match self {
            GrammarError::Schema(_) => "invalid_schema",
            GrammarError::Grammar(_) => "invalid_grammar",
            GrammarError::Tokenizer(_) => "structured_outputs_unsupported",
        }
    }
}

/// The token trie of a model's tokenizer, tokenizing with the tokenizer itself.
struct Env {
    trie: TokTrie,
    tokenizer: tokenizers::Tokenizer,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |s| {
            self.tokenizer
                .encode(s, false)
                .map(|e| e.get_ids().to_vec())
                .unwrap_or_default()
        })
    }
}

/// Compiles guides for one model: the token trie and llguidance's parser factory, built on
/// first use (a pool that never sees a constrained request never builds them), and the guides
/// compiled lately, by a digest of their text: a schema that every request of a client sends
/// is compiled once.
pub struct Grammars {
    tokenizer: tokenizers::Tokenizer,
    eos: Vec<u32>,
    vocab: usize,
    limits: ParserLimits,
    factory: OnceLock<Result<ParserFactory, GrammarError>>,
    /// The last [`CACHED_GUIDES`] compiled, most recently used last.
    cache: Mutex<VecDeque<([u8; 32], Compiled)>>,
}

/// Compiled guides kept for reuse. A compiled guide holds its lexer and grammar (from a few
/// KiB to some MiB for a large schema); a client's schemas are few.
pub const CACHED_GUIDES: usize = 64;

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Grammars(vocab {})", self.vocab)
    }
}

impl Grammars {
    /// Guides over `tokenizer`'s tokens, for logits `vocab` wide (at least the tokenizer's
    /// size: a padded embedding's extra rows are never allowed), ending at `eos`.
    pub fn new(tokenizer: tokenizers::Tokenizer, eos: &[u32], vocab: usize) -> Self {
        Self::with_limits(
            tokenizer,
            eos,
            vocab,
            &mole_api::GuideParserLimits::default(),
        )
    }

    /// [`Grammars::new`] under a pool's llguidance limits (`limits.guideParser`).
    pub fn with_limits(
        tokenizer: tokenizers::Tokenizer,
        eos: &[u32],
        vocab: usize,
        l: &mole_api::GuideParserLimits,
    ) -> Self {
        let n = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
        let limits = ParserLimits {
            max_items_in_row: n(l.max_items_in_row),
            initial_lexer_fuel: l.initial_lexer_fuel,
            step_lexer_fuel: l.step_lexer_fuel,
            step_max_items: n(l.step_max_items),
            max_lexer_states: n(l.max_lexer_states),
            max_grammar_size: n(l.max_grammar_size),
            // Errors go to the client: they name what is wrong, not the parser's state (the
            // tokens so far, the grammar).
            verbose_errors: false,
            ..ParserLimits::default()
        };
        Self {
            tokenizer,
            eos: eos.to_vec(),
            vocab,
            limits,
            factory: OnceLock::new(),
            cache: Mutex::new(VecDeque::new()),
        }
    }

    fn factory(&self) -> Result<&ParserFactory, GrammarError> {
        self.factory
            .get_or_init(|| self.build())
            .as_ref()
            .map_err(Clone::clone)
    }

    fn build(&self) -> Result<ParserFactory, GrammarError> {
        let bad = |e: String| GrammarError::Tokenizer(e);
        let json: Json = serde_json::from_str(
            &self
                .tokenizer
                .to_string(false)
                .map_err(|e| bad(e.to_string()))?,
        )
        .map_err(|e| bad(e.to_string()))?;
        let mut words =
            llguidance::token_bytes_from_tokenizer_json(&json).map_err(|e| bad(e.to_string()))?;
        // Without an EOS id the trie gets one of its own past the logits (never sampled): a
        // grammar then ends when it is complete (the engine stops the row).
        let n = words.len().max(self.vocab) + usize::from(self.eos.is_empty());
        // Ids the tokenizer leaves unnamed (and a padded embedding's rows) become specials no
        // grammar names.
        for (i, w) in words.iter_mut().enumerate() {
            if w.is_empty() {
                *w = unnamed(i);
            }
        }
        while words.len() < n {
            words.push(unnamed(words.len()));
        }
        let eos = self.eos.first().copied().unwrap_or(n as u32 - 1);
        let info = TokRxInfo::new(n as u32, eos);
        let mut trie = TokTrie::from(&info, &words);
        if self.eos.len() > 1 {
            trie = trie.with_eos_tokens(&self.eos);
        }
        let env: TokEnv = Arc::new(Env {
            trie,
            tokenizer: self.tokenizer.clone(),
        });
        let mut f = ParserFactory::new_simple(&env).map_err(|e| bad(e.to_string()))?;
        f.quiet();
        *f.limits_mut() = self.limits.clone();
        Ok(f)
    }

    /// Compiles `g` (or finds it compiled): a parser each of a request's choices starts a
    /// matcher from.
    pub fn compile(&self, g: &Guided) -> Result<Compiled, GrammarError> {
        let key = digest(g);
        let mut cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(i) = cache.iter().position(|(k, _)| *k == key) {
            let hit = cache.remove(i).expect("the position is in the cache");
            cache.push_back(hit.clone());
            return Ok(hit.1);
        }
        drop(cache);
        let c = self.compile_new(g)?;
        let mut cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        if cache.len() >= CACHED_GUIDES {
            cache.pop_front();
        }
        cache.push_back((key, c.clone()));
        Ok(c)
    }

    /// Guides compiled and kept (for tests and the benchmark: a repeated guide is a hit).
    pub fn cached(&self) -> usize {
        self.cache
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    fn compile_new(&self, g: &Guided) -> Result<Compiled, GrammarError> {
        let f = self.factory()?;
        let (grammar, err): (TopLevelGrammar, fn(String) -> GrammarError) = match &g.guide {
            // After reasoning a few whitespace characters may come first (Qwen3 writes "\n\n"
            // after `</think>`).
            Guide::Json { schema, strict } if g.after.is_some() => (
                TopLevelGrammar::from_lark(format!(
                    "start: json | WS json\nWS: /[ \\t\\r\\n]{{1,4}}/\njson: %json {}\n",
                    compact(schema, *strict)
                )),
                GrammarError::Schema,
            ),
            Guide::Json { schema, strict } => (
                TopLevelGrammar::from_json_schema(compact(schema, *strict)),
                GrammarError::Schema,
            ),
            Guide::Regex(rx) => (TopLevelGrammar::from_regex(rx), GrammarError::Grammar),
            Guide::Choice(c) => (
                TopLevelGrammar::from_lark(choice_lark(c)?),
                GrammarError::Grammar,
            ),
            Guide::Lark(src) => (
                TopLevelGrammar::from_lark(src.clone()),
                GrammarError::Grammar,
            ),
        };
        let mut parser = f.create_parser(grammar).map_err(|e| err(said(&e)))?;
        let unenforced = unenforced(&parser.grammar_warnings());
        let gate = match &g.after {
            None => None,
            Some(t) => Some(self.tokenizer.token_to_id(t).ok_or_else(|| {
                GrammarError::Grammar(format!("{t:?} is not one token of this tokenizer"))
            })?),
        };
        Ok(Compiled {
            parser: Arc::new(parser),
            gate,
            unenforced: Arc::new(unenforced),
        })
    }
}

/// The cache key of a guide: SHA-256 over its kind, its text and its gate, each
/// length-prefixed (two guides hash alike only when they compile alike).
fn digest(g: &Guided) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    let mut part = |tag: &str, text: &str| {
        h.update(tag.as_bytes());
        h.update((text.len() as u64).to_le_bytes());
        h.update(text.as_bytes());
    };
    match &g.guide {
        Guide::Json { schema, strict } => {
            part("json", &schema.to_string());
            part("strict", if *strict { "1" } else { "0" });
        }
        Guide::Regex(r) => part("regex", r),
        Guide::Choice(c) => {
            part("choice", &c.len().to_string());
            for x in c {
                part("", x);
            }
        }
        Guide::Lark(l) => part("lark", l),
    }
    if let Some(a) = &g.after {
        part("after", a);
    }
    h.finalize().into()
}

/// What llguidance says of an error, fit for a client: its first line, without the backtrace
/// its panic handler appends, at most [`SAID_BYTES`] bytes. A panic inside llguidance says only
/// that it happened (its message names llguidance's internals).
pub fn said(e: &dyn std::fmt::Display) -> String {
    let full = e.to_string();
    if full.starts_with("panic:") || full.contains("<backtrace>") {
        return "the grammar engine failed on this grammar (an internal error)".into();
    }
    let line = full.lines().next().unwrap_or_default().trim();
    let mut end = line.len().min(SAID_BYTES);
    while !line.is_char_boundary(end) {
        end -= 1;
    }
    line[..end].to_string()
}

/// The longest error text of llguidance passed on.
pub const SAID_BYTES: usize = 300;

/// `schema` with llguidance's JSON options set as OpenAI and vLLM write JSON (each unless the
/// schema's own `x-guidance` sets it): no free whitespace (a model may otherwise emit tabs or
/// newlines without end), `", "` between items and `": "` after keys; and, unless `strict`,
/// llguidance's lenient mode with `oneOf` read as `anyOf` (see [`Guide::Json`]).
pub fn compact(schema: &Json, strict: bool) -> Json {
    let mut s = match schema {
        Json::Bool(true) => serde_json::json!({}),
        other => other.clone(),
    };
    if let Some(o) = s.as_object_mut() {
        let options = o
            .entry("x-guidance")
            .or_insert_with(|| serde_json::json!({}));
        if let Some(x) = options.as_object_mut() {
            for (k, v) in [
                ("whitespace_flexible", Json::Bool(false)),
                ("item_separator", Json::from(", ")),
                ("key_separator", Json::from(": ")),
                ("lenient", Json::Bool(!strict)),
                ("coerce_one_of", Json::Bool(!strict)),
            ] {
                x.entry(k).or_insert(v);
            }
        }
    }
    s
}

/// What llguidance's warnings say was not enforced, one entry per keyword: `Unimplemented keys:
/// ["not", "uniqueItems"]` is `not` and `uniqueItems`; `Unknown format: phone` is `format:
/// phone`; the `oneOf` fallback (or, strict, its refusal) is `oneOf`; property-count bounds over
/// optional properties are
/// `minProperties/maxProperties`; any other warning as it is.
pub fn unenforced(warnings: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for w in warnings {
        // Rendered as "<message> (N times)" when it was said more than once.
        let w = match w.rfind(" (") {
            Some(i) if w.ends_with(" times)") => &w[..i],
            _ => w.as_str(),
        };
        let found: Vec<String> = if let Some(keys) = w.strip_prefix("Unimplemented keys: ") {
            serde_json::from_str::<Vec<String>>(keys).unwrap_or_else(|_| vec![keys.to_string()])
        } else if let Some(f) = w.strip_prefix("Unknown format: ") {
            vec![format!("format: {f}")]
        } else if w.starts_with("oneOf not fully supported")
            || w.starts_with("oneOf constraints are not supported")
        {
            vec!["oneOf".to_string()]
        } else if w.starts_with("min/maxProperties only supported") {
            // Bounds on how many properties, where some are optional.
            vec!["minProperties/maxProperties".to_string()]
        } else {
            vec![w.to_string()]
        };
        for f in found {
            if !out.contains(&f) {
                out.push(f);
            }
        }
    }
    out
}

/// The placeholder bytes of token `i` (a special token no grammar names).
fn unnamed(i: usize) -> Vec<u8> {
    let mut w = format!(".<[unnamed {i}]>").into_bytes();
    w[0] = TokTrie::SPECIAL_TOKEN_MARKER;
    w
}

/// A Lark grammar accepting exactly one of `choices`.
fn choice_lark(choices: &[String]) -> Result<String, GrammarError> {
    if choices.is_empty() {
        return Err(GrammarError::Grammar(
            "choice needs at least one string".into(),
        ));
    }
    let alts: Vec<String> = choices.iter().map(|c| lark_literal(c)).collect();
    Ok(format!("start: {}\n", alts.join(" | ")))
}

/// `s` as a Lark string literal. Every control character (C0, DEL and C1) is written as a
/// `\uXXXX` escape: llguidance's lexer reads the escape but refuses the raw character, and a
/// choice may hold any string JSON carries.
fn lark_literal(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A compiled guide: shared by a request's choices, each of which clones a matcher from it.
#[derive(Clone)]
pub struct Compiled {
    parser: Arc<TokenParser>,
    gate: Option<u32>,
    unenforced: Arc<Vec<String>>,
}

impl std::fmt::Debug for Compiled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Compiled(gate {:?})", self.gate)
    }
}

impl Compiled {
    /// What of a lenient JSON schema is not enforced (see [`unenforced`]); empty for every
    /// other guide.
    pub fn unenforced(&self) -> &[String] {
        &self.unenforced
    }

    /// A fresh constraint for one sequence.
    pub fn start(&self) -> Constraint {
        Constraint {
            matcher: Matcher::new(Ok(self.parser.deep_clone())),
            waiting: self.gate,
            failed: None,
        }
    }
}

/// One sequence's grammar state.
pub struct Constraint {
    matcher: Matcher,
    /// The gate token not sampled yet (the grammar has not started).
    waiting: Option<u32>,
    failed: Option<String>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Constraint(waiting {:?}, stopped {})",
            self.waiting,
            self.matcher.is_stopped()
        )
    }
}

impl Constraint {
    /// Whether [`Constraint::mask`] gives a mask now: the grammar has started and not failed.
    /// Cheap, so a step decides how it samples before the masks are computed.
    pub fn masks_next(&self) -> bool {
        self.waiting.is_none() && self.failed.is_none()
    }

    /// The tokens allowed next, or None while the grammar has not started (or has failed).
    /// Once the grammar is complete only EOS is allowed.
    pub fn mask(&mut self) -> Option<Vec<u32>> {
        if self.waiting.is_some() || self.failed.is_some() {
            return None;
        }
        match self.matcher.compute_mask_or_eos() {
            Ok(m) => Some(m.as_slice().to_vec()),
            Err(e) => {
                self.failed = Some(said(&e));
                None
            }
        }
    }

    /// Records a generated token: it opens the gate, or advances the grammar.
    pub fn consume(&mut self, token: u32) {
        if let Some(gate) = self.waiting {
            if token == gate {
                self.waiting = None;
            }
            return;
        }
        if self.failed.is_some() || self.matcher.is_stopped() {
            return;
        }
        if let Err(e) = self.matcher.consume_token(token) {
            self.failed = Some(said(&e));
        }
    }

    /// The grammar is complete: nothing but EOS may follow.
    pub fn complete(&self) -> bool {
        self.waiting.is_none() && self.failed.is_none() && self.matcher.is_stopped()
    }

    /// Why the grammar failed (a token it refused, an internal limit), if it did.
    pub fn failure(&self) -> Option<&str> {
        self.failed.as_deref()
    }
}

/// Packs `mask` (llguidance's 32-bit words, token `t` at bit `t % 32` of word `t / 32`) into `vocab` bits of [`MASK_BITS`] per f32, the
/// values exact integers below 2^24, as the device sampler unpacks them; `None` allows every
/// token.
pub fn pack_mask(mask: Option<&[u32]>, vocab: usize, out: &mut Vec<f32>) {
    let words = vocab.div_ceil(MASK_BITS);
    let Some(m) = mask else {
        out.extend(std::iter::repeat_n(((1u32 << MASK_BITS) - 1) as f32, words));
        return;
    };
    let src = m;
    let at = |i: usize| u64::from(src.get(i).copied().unwrap_or(0));
    let full = (1u64 << MASK_BITS) - 1;
    for w in 0..words {
        let s = w * MASK_BITS;
        // The 24 bits from token s on, read from the two 32-bit words they span.
        let pair = at(s / 32) | (at(s / 32 + 1) << 32);
        let mut v = (pair >> (s % 32)) & full;
        let left = vocab - s;
        if left < MASK_BITS {
            v &= (1u64 << left) - 1;
        }
        out.push(v as f32);
    }
}

/// Mask bits per packed f32: integers below 2^24 are exact in f32.
pub const MASK_BITS: usize = 24;

/// Whether token `t` is allowed by `mask` (llguidance's words).
pub fn allowed(mask: &[u32], t: usize) -> bool {
    mask.get(t / 32).is_some_and(|w| (w >> (t % 32)) & 1 == 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Guides over the committed byte-level fixture tokenizer (token id = byte value, EOS 2).
    fn grammars(limits: &mole_api::GuideParserLimits) -> Grammars {
        let t = crate::text::TextModel::load(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../tests/fixtures/engine/llama"),
        )
        .unwrap();
        Grammars::with_limits(t.tokenizer().clone(), &t.eos_ids, 256, limits)
    }

    fn guided(g: Guide) -> Guided {
        Guided {
            guide: g,
            after: None,
        }
    }

    /// A guide sent again is found compiled (the same parser), another one is compiled anew,
    /// and the cache keeps at most [`CACHED_GUIDES`].
    #[test]
    fn a_repeated_guide_is_compiled_once() {
        let g = grammars(&Default::default());
        let a = guided(Guide::Regex("[a-c]+".into()));
        let first = g.compile(&a).unwrap();
        let again = g.compile(&a).unwrap();
        assert!(Arc::ptr_eq(&first.parser, &again.parser));
        assert_eq!(g.cached(), 1);
        let b = g.compile(&guided(Guide::Regex("[a-d]+".into()))).unwrap();
        assert!(!Arc::ptr_eq(&first.parser, &b.parser));
        // The same text as another kind of guide is another guide.
        g.compile(&guided(Guide::Lark("start: \"[a-c]+\"".into())))
            .unwrap();
        assert_eq!(g.cached(), 3);
        for i in 0..CACHED_GUIDES + 5 {
            g.compile(&guided(Guide::Choice(vec![format!("c{i}")])))
                .unwrap();
        }
        assert_eq!(g.cached(), CACHED_GUIDES);
    }

    /// What reaches a client of llguidance's errors: one line, no backtrace, no parser state.
    #[test]
    fn errors_say_what_without_internals() {
        assert_eq!(
            said(&"panic: index out of bounds\n<backtrace>\n  0: llguidance::x\n</backtrace>"),
            "the grammar engine failed on this grammar (an internal error)"
        );
        assert_eq!(
            said(&"bad regex at 3\nstate: [Earley items...]"),
            "bad regex at 3"
        );
        assert_eq!(said(&"é".repeat(400)).len(), SAID_BYTES);
        let g = grammars(&Default::default());
        let e = g
            .compile(&guided(Guide::Lark("start: nope\n".into())))
            .unwrap_err();
        assert!(!e.to_string().contains('\n'), "{e}");
    }

    /// An ambiguous grammar's items grow with the answer: under a low `stepMaxItems` the
    /// constraint fails after some tokens (what the server answers `grammar_failed`), with a
    /// one-line reason.
    #[test]
    fn an_ambiguous_grammar_fails_past_the_step_items() {
        let limits = mole_api::GuideParserLimits {
            step_max_items: 120,
            ..Default::default()
        };
        let g = grammars(&limits);
        let c = g
            .compile(&guided(Guide::Lark(
                "start: s\ns: s s | \"a\" | \"b\"\n".into(),
            )))
            .unwrap();
        let mut con = c.start();
        let mut n = 0;
        while con.failure().is_none() && n < 100 {
            let mask = con.mask();
            con.consume(u32::from(b'a'));
            n += 1;
            if mask.is_none() {
                break;
            }
        }
        let why = con.failure().expect("the grammar fails within 100 tokens");
        // Within what the server's test generates (60 tokens), not at the first token.
        assert!(n > 1 && n < 50, "failed after {n} tokens: {why}");
        assert!(!why.contains('\n'), "{why}");
        eprintln!("failed after {n} tokens: {why}");
    }
}
