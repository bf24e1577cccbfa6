//! The worker's layers point one way (docs/architecture.md): each module of `worker/src`
//! imports only modules of its own layer or below, and nothing in the serving path imports the
//! tools on top. Read from the source text, test modules left out.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test
#![allow(clippy::disallowed_methods)] // tests read results back from the device

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Layers from the ground up; a module may use `crate::M` only for `M` at its layer or below.
const LAYERS: &[&[&str]] = &[
    &["formats"],
    &["kernels"],
    &["model"],
    &["lora"],
    &["engine"],
    &["router"],
    &["config", "metrics", "telemetry"],
    // The merge (formats and kernels below it): the merge Job's tool, which a local worker
    // also runs in-process for its `mode: merged` adapters. Nothing of the engine imports it.
    &["merge"],
    &["server"],
    // Tools: nothing below imports them.
    &["import", "inspect", "prune", "bench", "fetch"],
];

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
fn every_module_imports_only_its_layer_and_below() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut wrong = Vec::new();
    let mut seen = 0;
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap();
        let top = rel.iter().next().unwrap().to_string_lossy();
        let top = top.trim_end_matches(".rs");
        if matches!(top, "lib" | "main") {
            continue;
        }
        let own = layer(top).unwrap_or_else(|| panic!("{top} has no layer in LAYERS"));
        seen += 1;
        for used in uses(&code(&std::fs::read_to_string(f).unwrap())) {
            let Some(l) = layer(&used) else { continue };
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
