//! The JSON body of a Hermes call (`{"name": ..., "arguments": {...}}`) read a character at a
//! time, as the model writes it: its syntax is checked as it comes (the first character that
//! cannot continue JSON is known at once), and the top-level `name` string and `arguments`
//! value are located, so a call's arguments can stream while they are written and their
//! pieces are exactly the text of the whole.

/// What comes next in the body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Before the body's object (whitespace allowed).
    Start,
    /// A value: after `:` or an array's `,`.
    Value,
    /// After `[`: a value or `]`.
    ValueOrClose,
    /// After `{`: a key or `}`.
    KeyOrClose,
    /// After an object's `,`: a key.
    Key,
    /// After a key: `:`.
    Colon,
    /// After a value: `,` or the close of its container.
    After,
    /// Inside a string (`key`: an object's key).
    Str { key: bool, esc: Esc },
    /// Inside a number.
    Num(Number),
    /// Inside `true`, `false` or `null`: the letters still to come.
    Lit(&'static [u8]),
    /// After the body's object: whitespace only.
    Done,
    /// Not JSON (or not an object).
    Bad,
}

/// Where a string is in an escape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Esc {
    No,
    Backslash,
    /// Hex digits of `\u` still to come.
    Hex(u8),
}

/// Where a number is (RFC 8259's grammar).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Number {
    Minus,
    Zero,
    Int,
    Dot,
    Frac,
    Exp,
    ExpSign,
    ExpInt,
}

impl Number {
    /// The state after `c`, or None when `c` does not continue the number.
    fn next(self, c: char) -> Option<Number> {
        use Number::*;
        let digit = c.is_ascii_digit();
        Some(match (self, c) {
            (Minus, '0') => Zero,
            (Minus, _) if digit => Int,
            (Int, _) if digit => Int,
            (Zero | Int, '.') => Dot,
            (Dot | Frac, _) if digit => Frac,
            (Zero | Int | Frac, 'e' | 'E') => Exp,
            (Exp, '+' | '-') => ExpSign,
            (Exp | ExpSign | ExpInt, _) if digit => ExpInt,
            _ => return None,
        })
    }

    /// Whether a number may end here.
    fn complete(self) -> bool {
        matches!(
            self,
            Number::Zero | Number::Int | Number::Frac | Number::ExpInt
        )
    }
}

/// A call's arguments value: where it starts in the body and, once complete, where it ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Span {
    start: usize,
    end: Option<usize>,
}

/// One call's body, read so far.
#[derive(Debug)]
pub(super) struct CallJson {
    text: String,
    state: State,
    /// The open containers, `{` or `[`.
    stack: Vec<u8>,
    /// Where the body stopped being JSON.
    bad_at: Option<usize>,
    /// Where the top-level key being read starts.
    key_start: usize,
    /// The top-level member being read: its key and where its value starts.
    key: Option<String>,
    member_start: Option<usize>,
    /// The first top-level `name`, when a string.
    name: Option<String>,
    /// The first top-level `arguments` (or `parameters`, which some models write) value.
    args: Option<Span>,
}

impl CallJson {
    /// An empty body.
    pub(super) fn new() -> Self {
        Self {
            text: String::new(),
            state: State::Start,
            stack: Vec::new(),
            bad_at: None,
            key_start: 0,
            key: None,
            member_start: None,
            name: None,
            args: None,
        }
    }

    /// The body so far, as written.
    pub(super) fn text(&self) -> &str {
        &self.text
    }

    /// Whether the next character is inside a JSON string (where a tag is text).
    pub(super) fn in_string(&self) -> bool {
        matches!(self.state, State::Str { .. })
    }

    /// Whether the body is one whole JSON object (and whitespace).
    pub(super) fn complete(&self) -> bool {
        self.state == State::Done
    }

    /// The call's name, once its string is complete.
    pub(super) fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// Where the arguments start, when they are an object that has started.
    pub(super) fn object_args_start(&self) -> Option<usize> {
        self.args
            .filter(|a| self.text.as_bytes().get(a.start) == Some(&b'{'))
            .map(|a| a.start)
    }

    /// How much of the arguments is known good: to their end once complete, else as far as
    /// the body is still JSON.
    pub(super) fn args_good_to(&self) -> usize {
        match self.args.and_then(|a| a.end) {
            Some(end) => end,
            None => self.bad_at.unwrap_or(self.text.len()),
        }
    }

    /// The arguments of a complete body as a JSON object's text: the value as written, a
    /// string's contents (some models write the arguments as a JSON string), `{}` when absent
    /// or null.
    pub(super) fn whole_arguments(&self) -> Option<String> {
        if !self.complete() {
            return None;
        }
        let Some(Span {
            start,
            end: Some(end),
        }) = self.args
        else {
            return Some("{}".into());
        };
        let raw = &self.text[start..end];
        match raw.as_bytes()[0] {
            b'n' => Some("{}".into()),
            b'"' => serde_json::from_str::<String>(raw).ok(),
            _ => Some(raw.to_string()),
        }
    }

    /// Reads `c`.
    pub(super) fn push(&mut self, c: char) {
        let at = self.text.len();
        self.text.push(c);
        self.step(c, at);
    }

    fn fail(&mut self, at: usize) {
        self.state = State::Bad;
        self.bad_at.get_or_insert(at);
    }

    fn step(&mut self, c: char, at: usize) {
        use State::*;
        let ws = matches!(c, ' ' | '\t' | '\n' | '\r');
        match self.state {
            Bad => {}
            Done if ws => {}
            Done => self.fail(at),
            // A call is an object; anything else is not a call.
            Start if ws => {}
            Start if c == '{' => {
                self.stack.push(b'{');
                self.state = KeyOrClose;
            }
            Start => self.fail(at),
            KeyOrClose | Key | Colon | Value | ValueOrClose | After if ws => {}
            KeyOrClose | Key if c == '"' => {
                if self.stack.len() == 1 {
                    self.key_start = at;
                }
                self.state = Str {
                    key: true,
                    esc: Esc::No,
                };
            }
            KeyOrClose if c == '}' => self.close(at),
            KeyOrClose | Key => self.fail(at),
            Colon if c == ':' => self.state = Value,
            Colon => self.fail(at),
            ValueOrClose if c == ']' => self.close(at),
            Value | ValueOrClose => self.begin_value(c, at),
            After => match (c, self.stack.last()) {
                (',', Some(b'{')) => self.state = Key,
                (',', _) => self.state = Value,
                ('}', Some(b'{')) | (']', Some(b'[')) => self.close(at),
                _ => self.fail(at),
            },
            Str { key, esc } => {
                let esc = match esc {
                    Esc::No if c == '"' => return self.end_string(key, at),
                    Esc::No if c == '\\' => Esc::Backslash,
                    // Control characters must be escaped in JSON strings.
                    Esc::No if (c as u32) < 0x20 => return self.fail(at),
                    Esc::No => Esc::No,
                    Esc::Backslash if c == 'u' => Esc::Hex(4),
                    Esc::Backslash if "\"\\/bfnrt".contains(c) => Esc::No,
                    Esc::Hex(n) if c.is_ascii_hexdigit() => match n {
                        1 => Esc::No,
                        n => Esc::Hex(n - 1),
                    },
                    _ => return self.fail(at),
                };
                self.state = Str { key, esc };
            }
            Num(n) => match n.next(c) {
                Some(n) => self.state = Num(n),
                None if n.complete() => {
                    // The character after a number ends it, then is read on its own.
                    self.value_done(at);
                    self.step(c, at);
                }
                None => self.fail(at),
            },
            Lit(rest) => match rest.split_first() {
                Some((&b, rest)) if c as u32 == b as u32 => match rest.is_empty() {
                    true => self.value_done(at + 1),
                    false => self.state = Lit(rest),
                },
                _ => self.fail(at),
            },
        }
    }

    fn begin_value(&mut self, c: char, at: usize) {
        use State::*;
        if self.stack.len() == 1 {
            self.member_start = Some(at);
            let is_args = matches!(self.key.as_deref(), Some("arguments" | "parameters"));
            if is_args && self.args.is_none() {
                self.args = Some(Span {
                    start: at,
                    end: None,
                });
            }
        }
        self.state = match c {
            '{' => {
                self.stack.push(b'{');
                KeyOrClose
            }
            '[' => {
                self.stack.push(b'[');
                ValueOrClose
            }
            '"' => Str {
                key: false,
                esc: Esc::No,
            },
            '-' => Num(Number::Minus),
            '0' => Num(Number::Zero),
            '1'..='9' => Num(Number::Int),
            't' => Lit(b"rue"),
            'f' => Lit(b"alse"),
            'n' => Lit(b"ull"),
            _ => return self.fail(at),
        };
    }

    fn end_string(&mut self, key: bool, at: usize) {
        if !key {
            return self.value_done(at + 1);
        }
        if self.stack.len() == 1 {
            self.key = serde_json::from_str(&self.text[self.key_start..=at]).ok();
        }
        self.state = State::Colon;
    }

    /// The close of a container at `at`.
    fn close(&mut self, at: usize) {
        self.stack.pop();
        match self.stack.is_empty() {
            true => self.state = State::Done,
            false => self.value_done(at + 1),
        }
    }

    /// A value ended before `end`.
    fn value_done(&mut self, end: usize) {
        self.state = State::After;
        if self.stack.len() != 1 {
            return;
        }
        let Some(start) = self.member_start.take() else {
            return;
        };
        match self.key.as_deref() {
            Some("name") if self.name.is_none() && self.text.as_bytes()[start] == b'"' => {
                self.name = serde_json::from_str(&self.text[start..end]).ok();
            }
            _ => {}
        }
        if let Some(a) = self.args.as_mut().filter(|a| a.start == start) {
            a.end = Some(end);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(s: &str) -> CallJson {
        let mut j = CallJson::new();
        s.chars().for_each(|c| j.push(c));
        j
    }

    /// Every JSON text serde reads is complete here and every text it refuses is not, for a
    /// battery of objects (numbers, escapes, nesting, literals, whitespace).
    #[test]
    fn syntax_agrees_with_serde() {
        let texts = [
            r#"{}"#,
            r#" { "a" : 1 } "#,
            r#"{"a": -0.5e+3, "b": [1, 2.0, -3E2, 0], "c": {"d": [true, false, null]}}"#,
            r#"{"s": "x\"y\\z\/\b\f\n\r\t\u00e9\uD83D\uDE00 é"}"#,
            r#"{"a": [], "b": {}, "c": [[]], "d": [{}]}"#,
            r#"{"a": 01}"#,
            r#"{"a": 1.}"#,
            r#"{"a": .5}"#,
            r#"{"a": -}"#,
            r#"{"a": 1e}"#,
            r#"{"a": tru}"#,
            r#"{"a": nul}"#,
            r#"{"a": "\x"}"#,
            r#"{"a": "\u12G4"}"#,
            "{\"a\": \"line\nbreak\"}",
            r#"{"a": 1,}"#,
            r#"{"a" 1}"#,
            r#"{,}"#,
            r#"{"a": [1,]}"#,
            r#"{"a": [1 2]}"#,
            r#"{"a": 1}}"#,
            r#"{"a": 1} x"#,
            r#"[1]"#,
            r#""s""#,
            r#"{"a": {"b": 1]}"#,
            r#"{"a": 1"#,
        ];
        for t in texts {
            let serde_ok =
                serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(t).is_ok();
            assert_eq!(read(t).complete(), serde_ok, "{t}");
        }
    }

    #[test]
    fn name_and_arguments_are_located() {
        let j =
            read(r#"{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, {"x": 2}]}}"#);
        assert_eq!(j.name(), Some("get_weather"));
        assert_eq!(
            j.whole_arguments().as_deref(),
            Some(r#"{"city": "Paris", "n": [1, {"x": 2}]}"#)
        );
        let start = j.object_args_start().unwrap();
        assert_eq!(
            &j.text()[start..j.args_good_to()],
            j.whole_arguments().unwrap()
        );
        // Arguments written as a string, or under `parameters`, or left out.
        let j = read(r#"{"arguments": "{\"a\": 1}", "name": "f"}"#);
        assert_eq!(
            (j.name(), j.whole_arguments().as_deref()),
            (Some("f"), Some(r#"{"a": 1}"#))
        );
        assert_eq!(
            j.object_args_start(),
            None,
            "a string is not streamed as an object"
        );
        let j = read(r#"{"name": "f", "parameters": {"a": 1}}"#);
        assert_eq!(j.whole_arguments().as_deref(), Some(r#"{"a": 1}"#));
        let j = read(r#"{"name": "f"}"#);
        assert_eq!(j.whole_arguments().as_deref(), Some("{}"));
        let j = read(r#"{"name": "f", "arguments": null}"#);
        assert_eq!(j.whole_arguments().as_deref(), Some("{}"));
        // A nested `name` is not the call's.
        let j = read(r#"{"arguments": {"name": "inner"}, "name": "outer"}"#);
        assert_eq!(j.name(), Some("outer"));
        // A key with an escape is read decoded.
        let j = read(r#"{"n\u0061me": "f", "arguments": {}}"#);
        assert_eq!(j.name(), Some("f"));
    }

    #[test]
    fn arguments_are_good_as_far_as_the_body_is_json() {
        let j = read(r#"{"name": "f", "arguments": {"a": 12"#);
        assert_eq!(j.args_good_to(), j.text().len(), "a number may continue");
        let j = read(r#"{"name": "f", "arguments": {"a": 1 x"#);
        assert_eq!(
            &j.text()[..j.args_good_to()],
            r#"{"name": "f", "arguments": {"a": 1 "#
        );
        let j = read(r#"{"name": "f", "arguments": {"a": 1}} junk"#);
        let start = j.object_args_start().unwrap();
        assert_eq!(&j.text()[start..j.args_good_to()], r#"{"a": 1}"#);
        assert!(!j.complete() && j.whole_arguments().is_none());
        // Inside a string a tag is text.
        let j = read(r#"{"name": "f", "arguments": {"a": "</tool_call"#);
        assert!(j.in_string());
    }
}
