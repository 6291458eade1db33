//! The crate's top-level modules layer without cycles (docs/ARCHITECTURE.md,
//! "Invariant: modules layer"): every `crate::X` path in a module's
//! non-test code is an edge, and the graph of those edges must be acyclic.
//! A new edge that closes a cycle fails here, naming the cycle.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The code of a source file without comments and string literals. Test
/// modules count: a module's tests layer like its code (they draw seeded
/// data from `seeded`, not from the demo above them).
fn code(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        let line = match line.find("//") {
            Some(i) => &line[..i],
            None => line,
        };
        // Strings rarely name modules, but error messages may: drop them.
        let mut in_str = false;
        let mut prev = ' ';
        for c in line.chars() {
            if c == '"' && prev != '\\' {
                in_str = !in_str;
            } else if !in_str {
                out.push(c);
            }
            prev = c;
        }
        out.push('\n');
    }
    out
}

fn top_level_modules(src: &Path) -> BTreeSet<String> {
    let mut mods = BTreeSet::new();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        let name = e.file_name().to_string_lossy().into_owned();
        if e.path().is_dir() {
            mods.insert(name);
        } else if let Some(stem) = name.strip_suffix(".rs") {
            if stem != "lib" && stem != "main" {
                mods.insert(stem.to_string());
            }
        }
    }
    mods
}

fn edges(src: &Path, mods: &BTreeSet<String>) -> BTreeMap<String, BTreeSet<String>> {
    let mut graph: BTreeMap<String, BTreeSet<String>> = mods.iter().map(|m| (m.clone(), BTreeSet::new())).collect();
    for p in rs_files(src) {
        let rel = p.strip_prefix(src).unwrap();
        let first = rel.components().next().unwrap().as_os_str().to_string_lossy().into_owned();
        let from = first.strip_suffix(".rs").unwrap_or(&first).to_string();
        if !mods.contains(&from) {
            continue;
        }
        let text = code(&std::fs::read_to_string(&p).unwrap());
        for (i, _) in text.match_indices("crate::") {
            let to: String = text[i + 7..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            if to != from && mods.contains(&to) {
                graph.get_mut(&from).unwrap().insert(to);
            }
        }
    }
    graph
}

/// Every `.rs` file under `src`.
fn rs_files(src: &Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                files.push(p);
            }
        }
    }
    files
}

/// A cycle in `graph`, if there is one, as the modules along it.
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        New,
        Open,
        Done,
    }
    fn visit(
        n: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        mark: &mut BTreeMap<String, Mark>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        mark.insert(n.to_string(), Mark::Open);
        path.push(n.to_string());
        for m in &graph[n] {
            match mark[m.as_str()] {
                Mark::Open => {
                    let at = path.iter().position(|p| p == m).unwrap();
                    let mut cycle = path[at..].to_vec();
                    cycle.push(m.clone());
                    return Some(cycle);
                }
                Mark::New => {
                    if let Some(c) = visit(m, graph, mark, path) {
                        return Some(c);
                    }
                }
                Mark::Done => {}
            }
        }
        path.pop();
        mark.insert(n.to_string(), Mark::Done);
        None
    }
    let mut mark: BTreeMap<String, Mark> = graph.keys().map(|k| (k.clone(), Mark::New)).collect();
    for n in graph.keys() {
        if mark[n.as_str()] == Mark::New {
            if let Some(c) = visit(n, graph, &mut mark, &mut Vec::new()) {
                return Some(c);
            }
        }
    }
    None
}

#[test]
fn src_modules_have_no_import_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mods = top_level_modules(&src);
    let graph = edges(&src, &mods);
    if let Some(cycle) = find_cycle(&graph) {
        let mut listing = String::new();
        for (m, to) in &graph {
            listing.push_str(&format!("\n  {m} -> {}", to.iter().cloned().collect::<Vec<_>>().join(", ")));
        }
        panic!("import cycle among src/ modules: {}{listing}", cycle.join(" -> "));
    }
}

#[test]
fn the_cycle_finder_finds_a_cycle() {
    let g = |edges: &[(&str, &str)]| {
        let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (a, b) in edges {
            graph.entry(a.to_string()).or_default().insert(b.to_string());
            graph.entry(b.to_string()).or_default();
        }
        graph
    };
    assert_eq!(find_cycle(&g(&[("a", "b"), ("b", "c")])), None);
    let c = find_cycle(&g(&[("a", "b"), ("b", "c"), ("c", "a")])).unwrap();
    assert_eq!((c.first(), c.len()), (c.last(), 4));
    let text =
        "use crate::b::X; // crate::c\nlet s = \"crate::d\";\n/// `crate::f`\n#[cfg(test)]\nmod t { use crate::e; }";
    let code = code(text);
    assert!(code.contains("crate::b") && !code.contains("crate::c") && !code.contains("crate::d"));
    assert!(code.contains("crate::e") && !code.contains("crate::f"));
}

/// `config` gathers every section's type from the stage that reads it;
/// nothing but the composition root (`server`) and `main` depends on it.
#[test]
fn only_the_composition_root_reads_config() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mods = top_level_modules(&src);
    let graph = edges(&src, &mods);
    let readers: Vec<&String> =
        graph.iter().filter(|(m, to)| m.as_str() != "server" && to.contains("config")).map(|(m, _)| m).collect();
    assert!(readers.is_empty(), "modules that read crate::config: {readers:?}");
}

/// The "Invariant: only ... imports ..." lines of docs/ARCHITECTURE.md: each
/// crate named here appears in the code of the listed files alone.
#[test]
fn crates_are_imported_only_where_the_architecture_says() {
    let rules: &[(&[&str], &[&str])] = &[
        (&["glommio::"], &["shard/"]),
        (&["redis_protocol::"], &["features/feed/resp.rs"]),
        (&["rustls::"], &["tls.rs", "shard/tls_stream.rs", "loadgen/transport.rs"]),
        (&["webpki::"], &["shard/tls_stream.rs"]),
        (&["hyper::", "hyper_util::", "http_body_util::", "tokio::"], &["admin/http.rs"]),
    ];
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut broken = Vec::new();
    for p in rs_files(&src) {
        let rel = p.strip_prefix(&src).unwrap().to_string_lossy().replace('\\', "/");
        let text = code(&std::fs::read_to_string(&p).unwrap());
        for (names, allowed) in rules {
            if allowed.iter().any(|a| rel.starts_with(a)) {
                continue;
            }
            for name in *names {
                let used = text.match_indices(name).any(|(i, _)| {
                    text[..i].chars().next_back().is_none_or(|c| !(c.is_ascii_alphanumeric() || c == '_'))
                });
                if used {
                    broken.push(format!("src/{rel} uses {name} (allowed in {allowed:?} only)"));
                }
            }
        }
    }
    assert!(broken.is_empty(), "{broken:#?}");
}
