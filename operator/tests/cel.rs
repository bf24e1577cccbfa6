//! The samples against the CRDs' own `x-kubernetes-validations`: a small interpreter of the CEL
//! subset the generated schemas use (string literals, `self` and field selection, `has()`,
//! `!`, `&&`, `||`, `==`, `!=`, `in`, `startsWith`, `matches`, `all`, `exists_one`) evaluates
//! every rule of the generated schema on every sample, with schema defaults applied first as
//! the API server does. The valid samples pass every rule; `invalid-adapter.yaml` fails exactly
//! the rule its first line names. An expression outside the subset fails the test, so a new
//! rule cannot silently go unchecked.

use std::path::{Path, PathBuf};

use serde_json::Value;

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Str(String),
    Ident(String),
    Op(&'static str),
}

fn lex(src: &str) -> Vec<Tok> {
    let c: Vec<char> = src.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < c.len() {
        let ch = c[i];
        if ch.is_whitespace() {
            i += 1;
        } else if ch == '\'' || ch == '"' {
            let mut s = String::new();
            i += 1;
            while c[i] != ch {
                if c[i] == '\\' {
                    i += 1;
                }
                s.push(c[i]);
                i += 1;
            }
            i += 1;
            out.push(Tok::Str(s));
        } else if ch.is_alphabetic() || ch == '_' {
            let start = i;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            let w: String = c[start..i].iter().collect();
            out.push(if w == "in" {
                Tok::Op("in")
            } else {
                Tok::Ident(w)
            });
        } else {
            let two: String = c[i..(i + 2).min(c.len())].iter().collect();
            let op = ["&&", "||", "==", "!="]
                .into_iter()
                .find(|o| *o == two)
                .map(|o| (o, 2))
                .or_else(|| {
                    ["!", "(", ")", ",", "."]
                        .into_iter()
                        .find(|o| o.starts_with(ch))
                        .map(|o| (o, 1))
                })
                .unwrap_or_else(|| panic!("unsupported CEL character {ch:?} in {src}"));
            out.push(Tok::Op(op.0));
            i += op.1;
        }
    }
    out
}

#[derive(Debug, Clone)]
enum Expr {
    Str(String),
    Var(String),
    Select(Box<Expr>, String),
    Call(Option<Box<Expr>>, String, Vec<Expr>),
    Not(Box<Expr>),
    Bin(&'static str, Box<Expr>, Box<Expr>),
}

struct Parser {
    toks: Vec<Tok>,
    pos: usize,
}

impl Parser {
    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.pos)
    }
    fn eat(&mut self, op: &str) -> bool {
        if self.peek() == Some(&Tok::Op(leak(op))) {
            self.pos += 1;
            true
        } else {
            false
        }
    }
    fn expect(&mut self, op: &str) {
        assert!(self.eat(op), "expected {op} at token {}", self.pos);
    }
    fn or(&mut self) -> Expr {
        let mut e = self.and();
        while self.eat("||") {
            e = Expr::Bin("||", Box::new(e), Box::new(self.and()));
        }
        e
    }
    fn and(&mut self) -> Expr {
        let mut e = self.rel();
        while self.eat("&&") {
            e = Expr::Bin("&&", Box::new(e), Box::new(self.rel()));
        }
        e
    }
    fn rel(&mut self) -> Expr {
        let e = self.unary();
        for op in ["==", "!=", "in"] {
            if self.eat(op) {
                return Expr::Bin(leak(op), Box::new(e), Box::new(self.unary()));
            }
        }
        e
    }
    fn unary(&mut self) -> Expr {
        if self.eat("!") {
            return Expr::Not(Box::new(self.unary()));
        }
        let mut e = self.primary();
        while self.eat(".") {
            let Some(Tok::Ident(name)) = self.peek().cloned() else {
                panic!("expected a name after '.'")
            };
            self.pos += 1;
            e = if self.eat("(") {
                Expr::Call(Some(Box::new(e)), name, self.args())
            } else {
                Expr::Select(Box::new(e), name)
            };
        }
        e
    }
    fn args(&mut self) -> Vec<Expr> {
        let mut out = Vec::new();
        if self.eat(")") {
            return out;
        }
        loop {
            out.push(self.or());
            if self.eat(")") {
                return out;
            }
            self.expect(",");
        }
    }
    fn primary(&mut self) -> Expr {
        match self.peek().cloned() {
            Some(Tok::Str(s)) => {
                self.pos += 1;
                Expr::Str(s)
            }
            Some(Tok::Ident(name)) => {
                self.pos += 1;
                if self.eat("(") {
                    Expr::Call(None, name, self.args())
                } else {
                    Expr::Var(name)
                }
            }
            Some(Tok::Op("(")) => {
                self.pos += 1;
                let e = self.or();
                self.expect(")");
                e
            }
            t => panic!("unexpected token {t:?}"),
        }
    }
}

fn leak(op: &str) -> &'static str {
    ["&&", "||", "==", "!=", "in", "!", "(", ")", ",", "."]
        .into_iter()
        .find(|o| *o == op)
        .unwrap()
}

fn parse(src: &str) -> Expr {
    let mut p = Parser {
        toks: lex(src),
        pos: 0,
    };
    let e = p.or();
    assert_eq!(p.pos, p.toks.len(), "trailing tokens in {src}");
    e
}

type Env = Vec<(String, Value)>;

fn eval(e: &Expr, env: &Env) -> Value {
    let b = |e: &Expr, env: &Env| eval(e, env).as_bool().expect("a boolean");
    match e {
        Expr::Str(s) => Value::String(s.clone()),
        Expr::Var(v) => env
            .iter()
            .rev()
            .find(|(k, _)| k == v)
            .unwrap_or_else(|| panic!("unknown variable {v}"))
            .1
            .clone(),
        Expr::Select(obj, f) => {
            let o = eval(obj, env);
            o.get(f)
                .cloned()
                .unwrap_or_else(|| panic!("no such key {f} (CEL raises an error)"))
        }
        Expr::Not(x) => Value::Bool(!b(x, env)),
        Expr::Bin("&&", l, r) => Value::Bool(b(l, env) && b(r, env)),
        Expr::Bin("||", l, r) => Value::Bool(b(l, env) || b(r, env)),
        Expr::Bin("==", l, r) => Value::Bool(eval(l, env) == eval(r, env)),
        Expr::Bin("!=", l, r) => Value::Bool(eval(l, env) != eval(r, env)),
        Expr::Bin("in", l, r) => {
            let x = eval(l, env);
            Value::Bool(eval(r, env).as_array().expect("a list").contains(&x))
        }
        Expr::Call(None, f, args) if f == "has" => {
            let Expr::Select(obj, field) = &args[0] else {
                panic!("has() takes a field selection")
            };
            Value::Bool(eval(obj, env).get(field).is_some_and(|v| !v.is_null()))
        }
        Expr::Call(Some(target), f, args) => match f.as_str() {
            "startsWith" | "matches" => {
                let s = eval(target, env).as_str().expect("a string").to_string();
                let arg = eval(&args[0], env).as_str().unwrap().to_string();
                Value::Bool(if f == "startsWith" {
                    s.starts_with(&arg)
                } else {
                    regex::Regex::new(&arg).unwrap().is_match(&s)
                })
            }
            "all" | "exists_one" => {
                let list = eval(target, env).as_array().expect("a list").clone();
                let Expr::Var(var) = &args[0] else {
                    panic!("macro variable")
                };
                let hits = list
                    .into_iter()
                    .filter(|x| {
                        let mut env = env.clone();
                        env.push((var.clone(), x.clone()));
                        b(&args[1], &env)
                    })
                    .count();
                let n = eval(target, env).as_array().unwrap().len();
                Value::Bool(if f == "all" { hits == n } else { hits == 1 })
            }
            other => panic!("unsupported CEL function {other}"),
        },
        other => panic!("unsupported CEL expression {other:?}"),
    }
}

/// Applies schema defaults (as the API server does before validation) and evaluates every
/// rule where a value is present. Returns (rule path, message) of each failed rule.
fn validate(
    v: &mut Value,
    s: &Value,
    path: &str,
    failed: &mut Vec<(String, String)>,
    n: &mut usize,
) {
    if let (Some(props), Some(obj)) = (
        s.get("properties").and_then(Value::as_object),
        v.as_object_mut(),
    ) {
        for (k, sub) in props {
            if !obj.contains_key(k) {
                if let Some(d) = sub.get("default") {
                    obj.insert(k.clone(), d.clone());
                }
            }
            if let Some(child) = obj.get_mut(k) {
                validate(child, sub, &format!("{path}.{k}"), failed, n);
            }
        }
    }
    if let (Some(items), Some(arr)) = (s.get("items"), v.as_array_mut()) {
        for (i, x) in arr.iter_mut().enumerate() {
            validate(x, items, &format!("{path}[{i}]"), failed, n);
        }
    }
    for rule in s
        .get("x-kubernetes-validations")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        *n += 1;
        let expr = parse(rule["rule"].as_str().unwrap());
        let ok = eval(&expr, &vec![("self".to_string(), v.clone())]);
        if ok != Value::Bool(true) {
            let msg = rule["message"].as_str().unwrap_or("").to_string();
            failed.push((path.to_string(), msg));
        }
    }
}

fn schema_of(kind: &str) -> Value {
    let crd = mole_crds::crds()
        .into_iter()
        .find(|c| c.spec.names.kind == kind)
        .unwrap();
    serde_json::to_value(
        crd.spec.versions[0]
            .schema
            .as_ref()
            .unwrap()
            .open_api_v3_schema
            .as_ref()
            .unwrap(),
    )
    .unwrap()
}

fn samples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/samples")
}

fn run(kind: &str, mut v: Value) -> (Vec<(String, String)>, usize) {
    let (mut failed, mut n) = (Vec::new(), 0);
    validate(&mut v, &schema_of(kind), "", &mut failed, &mut n);
    (failed, n)
}

#[test]
fn every_sample_meets_the_crd_cel_rules_and_the_invalid_one_fails_its_rule() {
    let mut checked = 0;
    for e in std::fs::read_dir(samples()).unwrap() {
        let path = e.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        let v: Value = serde_yaml::from_str(&text).unwrap();
        let kind = v["kind"].as_str().unwrap().to_string();
        let (failed, rules) = run(&kind, v);
        assert!(rules > 0, "{}: no rule evaluated", path.display());
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        if name.starts_with("invalid-") {
            // "# INVALID: spec.source.path is absolute; ... ("source.path must be relative ...")."
            assert_eq!(
                failed,
                vec![(
                    ".spec.source.path".to_string(),
                    "source.path must be relative and must not contain '..'".to_string()
                )],
                "{name}"
            );
            assert!(text.lines().next().unwrap().contains("spec.source.path"));
        } else {
            assert!(failed.is_empty(), "{name}: {failed:?}");
        }
        checked += 1;
    }
    assert!(checked >= 8, "pool, six adapters and the invalid one");
}

#[test]
fn the_pool_rules_refuse_what_they_say() {
    let pool: Value = serde_yaml::from_str(
        &std::fs::read_to_string(samples().join("pool-qwen3-vl-8b.yaml")).unwrap(),
    )
    .unwrap();
    type Change = fn(&mut Value);
    let cases: Vec<(Change, &str)> = vec![
        (
            |p| p["spec"]["router"]["strategies"] = serde_json::json!(["explicit", "explicit"]),
            "router.strategies must not repeat a strategy",
        ),
        (
            |p| {
                p["spec"]["router"]["strategies"] = serde_json::json!(["classifier"]);
                p["spec"]["router"]
                    .as_object_mut()
                    .unwrap()
                    .remove("classifierAdapter");
            },
            "router.classifierAdapter is required when router.strategies contains classifier",
        ),
        (
            |p| p["spec"]["baseModel"]["path"] = serde_json::json!("base/../../etc"),
            "baseModel.path must be relative and must not contain '..'",
        ),
        (
            |p| p["spec"]["image"] = serde_json::json!(""),
            "image must not be empty",
        ),
    ];
    for (change, message) in cases {
        let mut p = pool.clone();
        change(&mut p);
        let (failed, _) = run("InferencePool", p);
        assert!(
            failed.iter().any(|(_, m)| m == message),
            "{message} not in {failed:?}"
        );
    }
    // Paths with dots that are not `..` components are fine.
    let mut p = pool.clone();
    p["spec"]["baseModel"]["path"] = serde_json::json!("base/qwen3..vl/v1.0");
    assert_eq!(run("InferencePool", p).0, vec![]);
}
