//! Generates the Rust for Feast's `.proto` files, and regenerates the
//! FlatBuffers bindings when the pinned `flatc` is on the PATH.
//!
//! Feast's protobufs (`proto/feast/`, copied from the pinned feast sdist)
//! are compiled on every build by protobuf-codegen's pure-Rust parser into
//! OUT_DIR (`src/features/feast/protos.rs` includes them): no protoc, and
//! nothing generated is checked in.
//!
//! The Open Inference Protocol's gRPC service (`proto/oip/grpc_service.proto`,
//! with Triton's `model_config.proto` it imports) is compiled on every build too, by tonic-prost-build into OUT_DIR
//! (`src/oip/grpc.rs` includes it), with the protoc binary the
//! protoc-bin-vendored crate carries: no protoc installed, nothing
//! generated checked in.
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

/// Feast's messages Quiver reads: the registry (and the files it imports),
/// the entity key and the value. Relative to `proto/`.
const FEAST_PROTOS: &[&str] = &[
    "feast/core/Aggregation.proto",
    "feast/core/DataFormat.proto",
    "feast/core/DataSource.proto",
    "feast/core/DatastoreTable.proto",
    "feast/core/Entity.proto",
    "feast/core/Feature.proto",
    "feast/core/FeatureService.proto",
    "feast/core/FeatureTable.proto",
    "feast/core/FeatureView.proto",
    "feast/core/FeatureViewProjection.proto",
    "feast/core/FeatureViewVersion.proto",
    "feast/core/InfraObject.proto",
    "feast/core/LabelView.proto",
    "feast/core/OnDemandFeatureView.proto",
    "feast/core/Permission.proto",
    "feast/core/Policy.proto",
    "feast/core/Project.proto",
    "feast/core/Registry.proto",
    "feast/core/SavedDataset.proto",
    "feast/core/SqliteTable.proto",
    "feast/core/StreamFeatureView.proto",
    "feast/core/Transformation.proto",
    "feast/core/ValidationProfile.proto",
    "feast/types/EntityKey.proto",
    "feast/types/Value.proto",
];

fn main() {
    feast_protos();
    oip_proto();
    flatbuffers();
}

fn feast_protos() {
    let inputs: Vec<PathBuf> = FEAST_PROTOS.iter().map(|p| PathBuf::from("proto").join(p)).collect();
    for input in &inputs {
        println!("cargo::rerun-if-changed={}", input.display());
    }
    protobuf_codegen::Codegen::new()
        .pure()
        .include("proto")
        .inputs(&inputs)
        .cargo_out_dir("feast_proto")
        .run_from_script();
}

fn oip_proto() {
    let proto = "proto/oip/grpc_service.proto";
    println!("cargo::rerun-if-changed={proto}");
    // Triton's model configuration, which the service's ModelConfig returns.
    println!("cargo::rerun-if-changed=proto/oip/model_config.proto");
    let protoc = protoc_bin_vendored::protoc_bin_path().expect("protoc-bin-vendored carries protoc for this host");
    let mut config = prost_build::Config::new();
    config.protoc_executable(protoc);
    tonic_prost_build::configure()
        .build_client(false)
        .build_server(true)
        // Tensor bytes (raw_input_contents, BYTES elements) as `Bytes`:
        // slices of the received message, not copies.
        .bytes(".inference")
        .compile_with_config(config, &[proto], &["proto/oip"])
        .expect("proto/oip/grpc_service.proto compiles");
}

fn flatbuffers() {
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
