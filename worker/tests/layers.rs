//! The worker's layers point one way (docs/architecture.md). They are crates: each depends
//! only on the crates below it (read from their `Cargo.toml`s, so a new dependency that points
//! up fails here before anyone builds on it). Inside the server crate its own modules are
//! layered too (the router, then the configuration and metrics, then the HTTP API), and in
//! every crate no files import each other in a circle (a type lives in the file that owns it,
//! and the files of a module can be read from the bottom up). Read from the source text, test
//! modules left out.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test
#![allow(clippy::disallowed_methods)] // tests read results back from the device

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// The worker's crates from the ground up, with their directories: each may depend only on
/// those before it. The two binaries are on top side by side: `mole-worker` (what a pod runs)
/// may not depend on `mole-bench`.
const CRATES: &[(&str, &str)] = &[
    ("mole-formats", "crates/formats"),
    ("mole-kernels", "crates/kernels"),
    ("mole-model", "crates/model"),
    ("mole-engine", "crates/engine"),
    ("mole-tools", "crates/tools"),
    ("mole-server", "crates/server"),
    ("mole-worker", "worker"),
    ("mole-bench", "crates/bench"),
];

/// The mole crates a `Cargo.toml` names under `[dependencies]` (dev-dependencies are the
/// tests' and may reach anywhere).
fn mole_dependencies(manifest: &str) -> Vec<String> {
    let mut section = "";
    let mut out = Vec::new();
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            section = line;
            continue;
        }
        if section == "[dependencies]" && line.starts_with("mole-") {
            out.push(line.split(['.', ' ', '=']).next().unwrap().to_string());
        }
    }
    out
}

#[test]
fn each_crate_depends_only_on_the_crates_below_it() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut wrong = Vec::new();
    for (i, (name, dir)) in CRATES.iter().enumerate() {
        let manifest = std::fs::read_to_string(root.join(dir).join("Cargo.toml")).unwrap();
        assert!(
            manifest.contains(&format!("name = \"{name}\"")),
            "{dir} is not {name}"
        );
        for dep in mole_dependencies(&manifest) {
            match CRATES.iter().position(|(n, _)| *n == dep) {
                Some(j) if j >= i => wrong.push(format!("{name} depends on {dep}")),
                _ => {}
            }
        }
    }
    assert!(wrong.is_empty(), "dependencies that point up: {wrong:?}");
    // Every crate of crates/ has its place.
    for e in std::fs::read_dir(root.join("crates")).unwrap() {
        let dir = format!("crates/{}", e.unwrap().file_name().to_string_lossy());
        assert!(
            CRATES.iter().any(|(_, d)| *d == dir),
            "{dir} has no place in CRATES"
        );
    }
}

/// The seams by which tests and benchmarks reach inside (`test-seams`, `bench-seams`) are
/// turned on by no crate's `[dependencies]` but `mole-bench`'s (bench seams): a served build
/// (`cargo build -p mole-worker`) has none of them.
#[test]
fn no_served_build_turns_a_seam_on() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut wrong = Vec::new();
    let dirs = ["api", "crds", "operator", "telemetry", "tests"];
    for dir in CRATES.iter().map(|(_, d)| *d).chain(dirs) {
        let manifest = std::fs::read_to_string(root.join(dir).join("Cargo.toml")).unwrap();
        let mut section = "";
        for line in manifest.lines().map(str::trim) {
            if line.starts_with('[') {
                section = line;
                continue;
            }
            let seam = ["test-seams", "bench-seams"]
                .into_iter()
                .find(|s| line.contains(s));
            // A crate declares its own seams as features, off by default; tests may turn any on.
            let allowed = section == "[dev-dependencies]"
                || (section == "[features]" && !line.starts_with("default"))
                || (dir == "crates/bench" && seam == Some("bench-seams"));
            if let (Some(seam), false) = (seam, allowed) {
                wrong.push(format!("{dir} turns {seam} on in {section}: {line}"));
            }
        }
    }
    assert!(wrong.is_empty(), "seams in a served build: {wrong:?}");
}

/// The checker reads `[dependencies]` only.
#[test]
fn the_dependency_reader_skips_dev_dependencies() {
    let manifest = "[package]\nname = \"mole-x\"\n[dependencies]\nmole-model.workspace = true\n\
                    mole-api = { workspace = true }\nserde = \"1\"\n[dev-dependencies]\n\
                    mole-server.workspace = true\n";
    assert_eq!(mole_dependencies(manifest), ["mole-model", "mole-api"]);
}

/// The server crate's modules from the ground up; a module may use `crate::M` only for `M` at
/// its layer or below. Modules not named are the HTTP API's, the top.
const LAYERS: &[&[&str]] = &[&["router"], &["config", "metrics"]];

fn layer(module: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&module))
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The file's text without its `#[cfg(test)] mod tests { .. }` (the convention of this
/// repository: the test module closes the file) and without comments.
fn code(text: &str) -> String {
    let end = text.find("#[cfg(test)]\nmod tests").unwrap_or(text.len());
    text[..end]
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The top-level modules a file's code names as `crate::module`.
fn uses(code: &str) -> BTreeSet<String> {
    code.match_indices("crate::")
        .filter(|(i, _)| !code[..*i].ends_with('$'))
        .map(|(i, m)| {
            code[i + m.len()..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect()
        })
        .collect()
}

#[test]
fn every_module_of_the_server_imports_only_its_layer_and_below() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../crates/server/src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut wrong = Vec::new();
    let mut seen = 0;
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap();
        let top = rel.iter().next().unwrap().to_string_lossy();
        let top = top.trim_end_matches(".rs");
        let own = layer(top).unwrap_or(LAYERS.len());
        seen += 1;
        for used in uses(&code(&std::fs::read_to_string(f).unwrap())) {
            let l = layer(&used).unwrap_or(LAYERS.len());
            if l > own {
                wrong.push(format!("{} uses crate::{used}", rel.display()));
            }
        }
    }
    assert!(
        seen > 40,
        "read {seen} files: is the source tree where it was?"
    );
    assert!(wrong.is_empty(), "imports that point up: {wrong:#?}");
}

/// The checker itself finds an upward import and skips test modules and comments.
#[test]
fn the_checker_sees_imports() {
    let text = "use crate::merge::x;\n// crate::bench\nfn f() { crate::model::g() }\n\
                #[cfg(test)]\nmod tests { use crate::server; }\n";
    let got: Vec<String> = uses(&code(text)).into_iter().collect();
    assert_eq!(got, ["merge", "model"]);
}

/// A file of `worker/src`: its path, its module's path (`model/kv.rs`: `model::kv`;
/// `model/mod.rs`: `model`) and its code.
struct Source {
    rel: String,
    module: Vec<String>,
    code: String,
}

fn module_of(rel: &Path) -> Vec<String> {
    let mut m: Vec<String> = rel
        .iter()
        .map(|c| c.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    if m.last().is_some_and(|l| l == "mod") {
        m.pop();
    }
    m
}

/// The `use` declarations of `code`: whether each is a re-export (`pub use`, any visibility)
/// and the paths it brings in (`a::{b, c::d as e}`: `a::b`, `a::c::d`; a glob ends in `*`).
fn use_decls(code: &str) -> Vec<(bool, Vec<Vec<String>>)> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find("use ") {
        let before = &rest[..i];
        let starts_item = before
            .chars()
            .last()
            .is_none_or(|c| c.is_whitespace() || c == ';' || c == '{' || c == '}');
        let Some(end) = rest[i..].find(';') else {
            break;
        };
        let body = &rest[i + 4..i + end];
        rest = &rest[i + end + 1..];
        if !starts_item || body.contains('(') || body.contains('=') {
            continue;
        }
        let line_start = before.rfind('\n').map_or(0, |n| n + 1);
        let reexport = before[line_start..].trim_start().starts_with("pub");
        let mut paths = Vec::new();
        expand(
            &[],
            &body.split_whitespace().collect::<Vec<_>>().join(" "),
            &mut paths,
        );
        out.push((reexport, paths));
    }
    out
}

/// Expands one use tree under `prefix` into paths.
fn expand(prefix: &[String], tree: &str, out: &mut Vec<Vec<String>>) {
    let tree = tree.trim();
    if let Some(open) = tree.find('{') {
        let head: Vec<String> = tree[..open]
            .split("::")
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect();
        let inner = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
        let mut depth = 0;
        let mut from = 0;
        let mut parts = Vec::new();
        for (i, c) in inner.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    parts.push(&inner[from..i]);
                    from = i + 1;
                }
                _ => {}
            }
        }
        parts.push(&inner[from..]);
        let mut p = prefix.to_vec();
        p.extend(head);
        for part in parts.into_iter().filter(|s| !s.trim().is_empty()) {
            expand(&p, part, out);
        }
        return;
    }
    let name = tree.split(" as ").next().unwrap_or(tree).trim();
    let mut p = prefix.to_vec();
    p.extend(
        name.split("::")
            .map(str::trim)
            .filter(|s| !s.is_empty() && *s != "self")
            .map(String::from),
    );
    out.push(p);
}

/// The paths `code` names outside its `use` declarations: `crate::a::b`, `super::a`,
/// `self::a`, and `child::a` for a child module of its own.
fn inline_paths(code: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let bytes = code.as_bytes();
    let ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    let mut i = 0;
    while i < bytes.len() {
        if !ident(bytes[i]) || (i > 0 && (ident(bytes[i - 1]) || bytes[i - 1] == b'$')) {
            i += 1;
            continue;
        }
        let mut segs = Vec::new();
        let mut j = i;
        loop {
            let s = j;
            while j < bytes.len() && ident(bytes[j]) {
                j += 1;
            }
            segs.push(code[s..j].to_string());
            if code[j..].starts_with("::") && bytes.get(j + 2).is_some_and(|&b| ident(b)) {
                j += 2;
            } else {
                break;
            }
        }
        if segs.len() > 1 {
            out.push(segs);
        }
        i = j.max(i + 1);
    }
    out
}

/// `path` as named in `file`, from the crate root; None for other crates and local names.
fn absolute(
    module: &[String],
    path: &[String],
    modules: &HashMap<Vec<String>, usize>,
) -> Option<Vec<String>> {
    let first = path.first()?;
    let mut base: Vec<String> = match first.as_str() {
        "crate" => Vec::new(),
        "self" => module.to_vec(),
        "super" => {
            let mut b = module.to_vec();
            let mut rest = path;
            while rest.first().is_some_and(|s| s == "super") {
                b.pop();
                rest = &rest[1..];
            }
            b.extend(rest.iter().cloned());
            return Some(b);
        }
        _ => {
            let mut child = module.to_vec();
            child.push(first.clone());
            if !modules.contains_key(&child) {
                return None;
            }
            module.to_vec()
        }
    };
    let skip = usize::from(matches!(first.as_str(), "crate" | "self"));
    base.extend(path[skip..].iter().cloned());
    Some(base)
}

/// The file that defines what `abs` names: the deepest module file on its path, through the
/// re-exports of that file (`pub use x::Y` makes `Y` the file of `x`'s).
fn resolve(
    abs: &[String],
    modules: &HashMap<Vec<String>, usize>,
    reexports: &[HashMap<String, Vec<String>>],
    depth: usize,
) -> Option<usize> {
    let k = (0..=abs.len())
        .rev()
        .find(|&k| k > 0 && modules.contains_key(&abs[..k]))?;
    let f = modules[&abs[..k]];
    if let Some(name) = abs.get(k) {
        if let Some(target) = reexports[f].get(name).filter(|_| depth < 8) {
            let mut next = target.clone();
            next.extend(abs[k + 1..].iter().cloned());
            return resolve(&next, modules, reexports, depth + 1).or(Some(f));
        }
    }
    Some(f)
}

/// The circles of files inside one layer: each strongly connected set of more than one file,
/// with the names its imports take from each other. What a file takes from its module's own
/// file (`mod.rs`, the parent that declares it) does not count.
fn circles(files: &[Source]) -> Vec<Vec<String>> {
    let modules: HashMap<Vec<String>, usize> = files
        .iter()
        .enumerate()
        .map(|(i, f)| (f.module.clone(), i))
        .collect();
    let decls: Vec<Vec<(bool, Vec<Vec<String>>)>> =
        files.iter().map(|f| use_decls(&f.code)).collect();
    let reexports: Vec<HashMap<String, Vec<String>>> = files
        .iter()
        .zip(&decls)
        .map(|(f, d)| {
            d.iter()
                .filter(|(re, _)| *re)
                .flat_map(|(_, paths)| paths)
                .filter_map(|p| {
                    let abs = absolute(&f.module, p, &modules)?;
                    Some((abs.last()?.clone(), abs))
                })
                .collect()
        })
        .collect();
    // Edges: file -> file it takes names from, inside the same top-level module.
    let mut edges: BTreeMap<(usize, usize), BTreeSet<String>> = BTreeMap::new();
    for (i, f) in files.iter().enumerate() {
        let mut without_uses = f.code.clone();
        for (_, paths) in decls[i].iter().filter(|(re, _)| !*re) {
            for p in paths {
                record(i, f, p, &modules, &reexports, files, &mut edges);
            }
        }
        // Inline paths outside use declarations (a re-export is no use of its own).
        while let Some(s) = without_uses.find("use ") {
            let e = without_uses[s..]
                .find(';')
                .map_or(without_uses.len(), |e| s + e + 1);
            without_uses.replace_range(s..e, " ");
        }
        // A path may start with a name a `use` brought in (`use super::openai;` then
        // `openai::chat::infer` in an attribute): it names what that `use` names.
        let imported: HashMap<&String, &Vec<String>> = decls[i]
            .iter()
            .flat_map(|(_, paths)| paths)
            .filter_map(|p| Some((p.last()?, p)))
            .collect();
        for mut p in inline_paths(&without_uses) {
            if let Some(full) = imported.get(&p[0]) {
                p.splice(..1, full.iter().cloned());
            }
            record(i, f, &p, &modules, &reexports, files, &mut edges);
        }
    }
    // Strongly connected components (Tarjan).
    let n = files.len();
    let adj: Vec<Vec<usize>> = (0..n)
        .map(|a| {
            edges
                .keys()
                .filter(|(x, _)| *x == a)
                .map(|(_, b)| *b)
                .collect()
        })
        .collect();
    let mut index = vec![usize::MAX; n];
    let mut low = vec![0; n];
    let mut on = vec![false; n];
    let mut stack = Vec::new();
    let mut next = 0;
    let mut comps: Vec<Vec<usize>> = Vec::new();
    #[allow(clippy::too_many_arguments)]
    fn visit(
        v: usize,
        adj: &[Vec<usize>],
        index: &mut [usize],
        low: &mut [usize],
        on: &mut [bool],
        stack: &mut Vec<usize>,
        next: &mut usize,
        comps: &mut Vec<Vec<usize>>,
    ) {
        index[v] = *next;
        low[v] = *next;
        *next += 1;
        stack.push(v);
        on[v] = true;
        for &w in &adj[v] {
            if index[w] == usize::MAX {
                visit(w, adj, index, low, on, stack, next, comps);
                low[v] = low[v].min(low[w]);
            } else if on[w] {
                low[v] = low[v].min(index[w]);
            }
        }
        if low[v] == index[v] {
            let mut comp = Vec::new();
            while let Some(w) = stack.pop() {
                on[w] = false;
                comp.push(w);
                if w == v {
                    break;
                }
            }
            comps.push(comp);
        }
    }
    for v in 0..n {
        if index[v] == usize::MAX {
            visit(
                v, &adj, &mut index, &mut low, &mut on, &mut stack, &mut next, &mut comps,
            );
        }
    }
    comps
        .into_iter()
        .filter(|c| c.len() > 1)
        .map(|c| {
            let mut lines: Vec<String> = edges
                .iter()
                .filter(|((a, b), _)| c.contains(a) && c.contains(b))
                .map(|((a, b), names)| {
                    let names: Vec<&str> = names.iter().map(String::as_str).collect();
                    format!(
                        "{} -> {}: {}",
                        files[*a].rel,
                        files[*b].rel,
                        names.join(", ")
                    )
                })
                .collect();
            lines.sort();
            lines
        })
        .collect()
}

/// Records that file `i` takes what `path` names, when it lies in another file of its own
/// layer.
fn record(
    i: usize,
    f: &Source,
    path: &[String],
    modules: &HashMap<Vec<String>, usize>,
    reexports: &[HashMap<String, Vec<String>>],
    files: &[Source],
    edges: &mut BTreeMap<(usize, usize), BTreeSet<String>>,
) {
    let Some(abs) = absolute(&f.module, path, modules) else {
        return;
    };
    let Some(t) = resolve(&abs, modules, reexports, 0) else {
        return;
    };
    // A module's own file (`mod.rs`) declares and drives its children, which may use what it
    // holds for them all (its error type, shared state): only files beside each other count.
    let ancestor = files[t].module.len() < f.module.len() && f.module.starts_with(&files[t].module);
    // Files of two modules of one layer (`merge` and `quantize`) may import each other: what
    // is shared goes to its owner there too, so a circle across them counts.
    let layer_of = |s: &Source| s.module.first().and_then(|m| layer(m));
    if t != i && !ancestor && layer_of(&files[t]) == layer_of(f) {
        let name = path.last().cloned().unwrap_or_default();
        edges.entry((i, t)).or_default().insert(name);
    }
}

/// The source trees of every crate of the workspace: the worker's (`worker/src`, `crates/*/src`)
/// and the others', each checked as a whole (`crate::` paths stay inside their crate; cargo keeps
/// the crates themselves in order).
fn crate_dirs() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut dirs = vec![root.join("src")];
    for other in ["api", "crds", "operator", "telemetry", "tests"] {
        dirs.push(root.join("..").join(other).join("src"));
    }
    for e in std::fs::read_dir(root.join("../crates")).unwrap() {
        let src = e.unwrap().path().join("src");
        if src.is_dir() {
            dirs.push(src);
        }
    }
    dirs.sort();
    dirs
}

fn crate_sources(src: &Path) -> Vec<Source> {
    let mut paths = Vec::new();
    sources(src, &mut paths);
    paths
        .iter()
        .map(|p| {
            let rel = p.strip_prefix(src).unwrap();
            Source {
                rel: rel.display().to_string(),
                module: module_of(rel),
                code: code(&std::fs::read_to_string(p).unwrap()),
            }
        })
        .filter(|s| !matches!(s.rel.as_str(), "lib.rs" | "main.rs"))
        .collect()
}

#[test]
fn no_files_of_a_layer_import_each_other_in_a_circle() {
    let dirs = crate_dirs();
    assert!(dirs.len() > 1, "no crates/*: {dirs:?}");
    let found: Vec<(String, Vec<String>)> = dirs
        .iter()
        .flat_map(|d| {
            let name = d.parent().unwrap().file_name().unwrap().to_string_lossy();
            circles(&crate_sources(d))
                .into_iter()
                .map(move |c| (name.to_string(), c))
        })
        .collect();
    assert!(
        found.is_empty(),
        "files that import each other in a circle (move a type to the file that owns it): {found:#?}"
    );
}

/// A file of a made-up tree for the checker's own tests.
fn file(rel: &str, code: &str) -> Source {
    Source {
        rel: rel.into(),
        module: module_of(Path::new(rel)),
        code: code.into(),
    }
}

/// The checker sees a circle through a parent's re-export and an inline path, and no circle
/// where imports point one way.
#[test]
fn the_circle_checker_follows_reexports() {
    let tree = |y: &str| {
        vec![
            file("a/mod.rs", "mod x;\nmod y;\npub use self::x::X;\n"),
            file("a/x.rs", "use super::y::{Y, Z as W};\npub struct X;\n"),
            file("a/y.rs", y),
            file("b.rs", "use crate::a::X;\n"),
        ]
    };
    let found = circles(&tree("pub struct Y;\nfn f() -> super::X { todo!() }\n"));
    assert_eq!(
        found,
        [["a/x.rs -> a/y.rs: Y, Z", "a/y.rs -> a/x.rs: X"]],
        "a circle through a/mod.rs's re-export"
    );
    assert!(circles(&tree("pub struct Y;\nuse std::fmt::Debug;\n")).is_empty());
    let found = circles(&[
        file("s/mod.rs", "mod doc;\nmod h;\n"),
        file(
            "s/doc.rs",
            "use super::h;\n#[x(paths(h::get))]\nstruct Doc;\npub struct R;\n",
        ),
        file("s/h.rs", "use super::doc::R;\npub fn get() {}\n"),
    ]);
    assert_eq!(
        found,
        [["s/doc.rs -> s/h.rs: get, h", "s/h.rs -> s/doc.rs: R"]],
        "a circle through a path that starts with a name a use brought in"
    );
}

/// Two modules of one layer whose files import each other are a circle too; a module's files
/// taking from a module of a layer below are not.
#[test]
fn the_circle_checker_crosses_the_modules_of_a_layer() {
    let found = circles(&[
        file("merge/mod.rs", "pub mod cli;\n"),
        file(
            "merge/cli.rs",
            "use crate::quantize::cli::print;\npub fn log() {}\n",
        ),
        file("quantize/mod.rs", "pub mod cli;\n"),
        file(
            "quantize/cli.rs",
            "pub fn print() { crate::merge::cli::log() }\n",
        ),
    ]);
    assert_eq!(
        found,
        [[
            "merge/cli.rs -> quantize/cli.rs: print",
            "quantize/cli.rs -> merge/cli.rs: log"
        ]]
    );
    let found = circles(&[
        file("server/mod.rs", "pub mod a;\n"),
        file("server/a.rs", "use crate::router::b::B;\npub struct A;\n"),
        file("router/mod.rs", "pub mod b;\n"),
        file(
            "router/b.rs",
            "pub struct B;\nfn f() -> crate::server::a::A { todo!() }\n",
        ),
    ]);
    assert!(found.is_empty(), "{found:?}");
}

/// A file that grows past this many lines (before its tests) is split by what its parts own:
/// past it, a change means reading more than anyone holds in mind at once.
const MAX_LINES: usize = 800;

#[test]
fn no_file_is_over_800_lines_before_its_tests() {
    let mut long = Vec::new();
    // The cross-crate test crate (tests/) is test code throughout, as is a module's `tests.rs`.
    for src in crate_dirs()
        .into_iter()
        .filter(|d| !d.ends_with("tests/src"))
    {
        let mut files = Vec::new();
        sources(&src, &mut files);
        files.retain(|f| !f.ends_with("tests.rs"));
        long.extend(files.iter().filter_map(|f| {
            let text = std::fs::read_to_string(f).unwrap();
            let lines = text
                .lines()
                .take_while(|l| !l.starts_with("#[cfg(test)]"))
                .count();
            (lines > MAX_LINES).then(|| format!("{} ({lines})", f.display()))
        }));
    }
    assert!(
        long.is_empty(),
        "files over {MAX_LINES} lines before their tests: {long:?}"
    );
}
