//! The crate's layout, held as a test: every op folder is entered through its `mod.rs` only (its CPU and
//! generic kernels are reached from nowhere else), and no source files import each other in a circle.
//!
//! The import graph is read from the source text: every top-level `use` item that names `crate::…`,
//! `super::…` or a child module, every `crate::…` path in code, and every path through a child module
//! (`cpu::forward(…)`; comments excluded), resolved to the file of the longest module prefix that exists.
//! `mod` declarations themselves are not imports.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The op folders: each has one door, its `mod.rs`.
const OPS: [&str; 6] = ["attention", "rms_norm", "rope", "swiglu", "cross_entropy", "merge"];

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `.rs` file under `src/`, as its path relative to `src/` (`attention/cpu/tiles.rs`).
fn files(dir: &Path, out: &mut Vec<String>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path.strip_prefix(src()).unwrap().to_string_lossy().replace('\\', "/"));
        }
    }
}

/// The module path of a file: `attention/cpu/tiles.rs` -> `[attention, cpu, tiles]`, `attention/mod.rs` ->
/// `[attention]`, `lib.rs` -> `[]`.
fn module_of(file: &str) -> Vec<String> {
    let mut parts: Vec<String> = file.trim_end_matches(".rs").split('/').map(String::from).collect();
    if matches!(parts.last().map(String::as_str), Some("mod") | Some("lib")) {
        parts.pop();
    }
    parts
}

/// The file that holds the longest prefix of `path` that is a module with a file of its own; a name the crate
/// root re-exports (`crate::Error`) resolves to the file it comes from (`roots`), not to `lib.rs`.
fn resolve(path: &[String], known: &BTreeSet<String>, roots: &BTreeMap<String, String>) -> Option<String> {
    if let Some(f) = path.first().and_then(|name| roots.get(name)) {
        if !known.contains(&format!("{}.rs", path[0])) && !known.contains(&format!("{}/mod.rs", path[0])) {
            return Some(f.clone());
        }
    }
    for n in (0..=path.len()).rev() {
        let p = path[..n].join("/");
        let candidates =
            if n == 0 { vec!["lib.rs".to_string()] } else { vec![format!("{p}.rs"), format!("{p}/mod.rs")] };
        if let Some(f) = candidates.into_iter().find(|f| known.contains(f)) {
            return Some(f);
        }
    }
    None
}

/// The code of a file without comments (line comments and doc comments; the crate has no block comments).
fn code_lines(text: &str) -> Vec<String> {
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) => l[..i].to_string(),
            None => l.to_string(),
        })
        .collect()
}

/// The paths a use tree names: `a::{b, c::d}` -> `[a::b, a::c::d]` (only the leading segments matter here).
fn use_paths(tree: &str) -> Vec<Vec<String>> {
    let tree: String = tree.chars().filter(|c| !c.is_whitespace()).collect();
    let mut out = Vec::new();
    fn walk(prefix: &[String], t: &str, out: &mut Vec<Vec<String>>) {
        if let Some(open) = t.find('{') {
            let head: Vec<String> =
                t[..open].trim_end_matches("::").split("::").filter(|s| !s.is_empty()).map(String::from).collect();
            let mut base = prefix.to_vec();
            base.extend(head);
            let inner = &t[open + 1..t.rfind('}').unwrap()];
            let (mut depth, mut start) = (0, 0);
            for (i, c) in inner.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        walk(&base, &inner[start..i], out);
                        start = i + 1;
                    }
                    _ => {}
                }
            }
            walk(&base, &inner[start..], out);
        } else if !t.is_empty() {
            let mut p = prefix.to_vec();
            p.extend(t.split(" as ").next().unwrap().split("::").map(String::from));
            out.push(p);
        }
    }
    walk(&[], &tree, &mut out);
    out
}

/// The import graph: file -> the files it takes names from.
fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let mut all = Vec::new();
    files(&src(), &mut all);
    let known: BTreeSet<String> = all.iter().cloned().collect();
    // The names `lib.rs` re-exports from the crate's own modules, and the file each comes from.
    let lib = code_lines(&std::fs::read_to_string(src().join("lib.rs")).unwrap()).join("\n");
    let mut roots = BTreeMap::new();
    for item in lib.split(';') {
        let Some(tree) = item.trim().strip_prefix("pub use ") else { continue };
        for p in use_paths(tree) {
            if let (Some(name), Some(f)) = (p.last(), resolve(&p, &known, &BTreeMap::new())) {
                if f != "lib.rs" {
                    roots.insert(name.clone(), f);
                }
            }
        }
    }
    let mut g = BTreeMap::new();
    for file in &all {
        let text = std::fs::read_to_string(src().join(file)).unwrap();
        let lines = code_lines(&text);
        let here = module_of(file);
        // The child modules this file declares (`mod cpu;`, `pub mod generic;`).
        let children: Vec<String> = lines
            .iter()
            .filter_map(|l| {
                let l = l.trim_start_matches("pub ").trim_start_matches("pub(crate) ");
                l.strip_prefix("mod ").and_then(|m| m.strip_suffix(';')).map(|m| m.trim().to_string())
            })
            .collect();
        let child_path = |p: &[String]| -> Vec<String> { here.iter().cloned().chain(p.iter().cloned()).collect() };
        let mut targets = BTreeSet::new();
        let mut add = |path: Vec<String>| {
            if let Some(t) = resolve(&path, &known, &roots).filter(|t| t != file) {
                targets.insert(t);
            }
        };
        // Top-level use items (possibly over several lines).
        let mut i = 0;
        while i < lines.len() {
            let l = &lines[i];
            let stmt = l
                .strip_prefix("pub use ")
                .or_else(|| l.strip_prefix("pub(crate) use "))
                .or_else(|| l.strip_prefix("use "));
            if let Some(mut s) = stmt.map(String::from) {
                while !s.contains(';') {
                    i += 1;
                    s.push_str(&lines[i]);
                }
                let s = s.split(';').next().unwrap().to_string();
                for p in use_paths(&s) {
                    match p.first().map(String::as_str) {
                        Some("crate") => add(p[1..].to_vec()),
                        Some("super") => {
                            let mut base = here.clone();
                            let mut rest = &p[..];
                            while rest.first().map(String::as_str) == Some("super") {
                                base.pop();
                                rest = &rest[1..];
                            }
                            base.extend(rest.iter().cloned());
                            add(base);
                        }
                        Some(first) if children.iter().any(|c| c == first) => add(child_path(&p)),
                        _ => {}
                    }
                }
            }
            i += 1;
        }
        // Paths through a child module in code: `cpu::forward(…)`.
        for l in &lines {
            for c in &children {
                let needle = format!("{c}::");
                let mut rest = l.as_str();
                while let Some(at) = rest.find(&needle) {
                    let before = &rest[..at];
                    if !before.ends_with(|ch: char| ch.is_alphanumeric() || ch == '_' || ch == ':') {
                        add(child_path(std::slice::from_ref(c)));
                    }
                    rest = &rest[at + needle.len()..];
                }
            }
        }
        // `crate::` paths in code.
        for l in &lines {
            let mut rest = l.as_str();
            while let Some(at) = rest.find("crate::") {
                let tail = &rest[at + "crate::".len()..];
                let end = tail.find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':')).unwrap_or(tail.len());
                let path: Vec<String> = tail[..end].split("::").filter(|s| !s.is_empty()).map(String::from).collect();
                let before = &rest[..at];
                // `autosp_core::…` or another crate's `…crate::` is not ours; `crate::{…}` is a use item, read above.
                if !path.is_empty() && !before.ends_with(|c: char| c.is_alphanumeric() || c == '_' || c == ':') {
                    add(path);
                }
                rest = &tail[end..];
            }
        }
        g.insert(file.clone(), targets);
    }
    g
}

#[test]
fn the_graph_reader_sees_the_imports_it_must() {
    let g = graph();
    // A door imports its kernels; a kernel imports the shared vector code below it.
    assert!(g["rms_norm/mod.rs"].contains("rms_norm/cpu.rs"), "{:?}", g["rms_norm/mod.rs"]);
    assert!(g["rms_norm/cpu.rs"].contains("vector/mod.rs"), "{:?}", g["rms_norm/cpu.rs"]);
    assert!(g["attention/cpu/forward.rs"].contains("attention/cpu/tiles.rs"), "{:?}", g["attention/cpu/forward.rs"]);
    assert!(g["sp/ring.rs"].contains("attention/mod.rs"), "{:?}", g["sp/ring.rs"]);
}

#[test]
fn op_folders_are_entered_through_their_door_only() {
    let g = graph();
    let mut wrong = Vec::new();
    for (from, tos) in &g {
        for to in tos {
            for op in OPS {
                let inside = |f: &str| f.starts_with(&format!("{op}/"));
                if inside(to) && !inside(from) && to != &format!("{op}/mod.rs") {
                    wrong.push(format!("{from} -> {to}"));
                }
            }
        }
    }
    assert!(wrong.is_empty(), "files outside an op folder import past its door: {wrong:?}");
}

#[test]
fn no_import_circles() {
    let g = graph();
    // Depth-first search for a back edge; reports one circle.
    fn visit<'a>(
        f: &'a str,
        g: &'a BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<&'a str, u8>,
        stack: &mut Vec<&'a str>,
    ) -> Option<Vec<String>> {
        state.insert(f, 1);
        stack.push(f);
        for t in g.get(f).into_iter().flatten() {
            match state.get(t.as_str()) {
                Some(1) => {
                    let at = stack.iter().position(|s| *s == t).unwrap();
                    return Some(stack[at..].iter().map(|s| s.to_string()).chain([t.clone()]).collect());
                }
                Some(_) => {}
                None => {
                    if let Some(c) = visit(t, g, state, stack) {
                        return Some(c);
                    }
                }
            }
        }
        stack.pop();
        state.insert(f, 2);
        None
    }
    let mut state = BTreeMap::new();
    for f in g.keys() {
        if !state.contains_key(f.as_str()) {
            if let Some(c) = visit(f, &g, &mut state, &mut Vec::new()) {
                panic!("import circle: {}", c.join(" -> "));
            }
        }
    }
}
