//! `quiver serve --backend cuda` on this machine, whichever kind it is:
//! where a GPU is (a driver library and an NVIDIA device node, or
//! `QUIVER_REQUIRE_CUDA=1`), the server scores on it, the CPU INT8 backend's
//! scores bit for bit, and `quiver gpu-check` finds parity; where none is
//! (or `QUIVER_REQUIRE_CUDA=0`), the server starts, says once why it is not
//! using the GPU, and serves the CPU INT8 backend's scores bit for bit. Each
//! test prints which of the two it ran.
//!
//! A driver that initialises but reports no device is simulated on every
//! machine: a fake `libcuda.so` (and `.so.1`), compiled here with `cc`,
//! first on the loader path, which the driver loader searches before the
//! system's library cache. Only built with `--features cuda`, since without
//! it the server has no `cuda` backend to ask for.

#![cfg(feature = "cuda")]

mod common;

use std::path::Path;
use std::process::Command;

use common::{demo_dir, demo_request, Server};
use quiver::model::{sigmoid, Model};
use quiver::score::cuda::{self, CudaError};
use quiver::score::{self, BackendKind};
use quiver::wire::{RequestSpec, Status};

/// The scores the CPU INT8 backend gives `spec`, from the demo files.
fn cpu_int8_scores(spec: &RequestSpec) -> Vec<f32> {
    let dir = demo_dir();
    let model = std::sync::Arc::new(Model::load(&dir.join("model.qm")).unwrap());
    let (x, _) = common::demo_rows(spec);
    let rows = spec.item_ids.len();
    let mut logits = vec![0.0; rows];
    score::build(BackendKind::Int8, &model, rows).score(&x, rows, &mut logits).unwrap();
    logits.into_iter().map(sigmoid).collect()
}

/// Whether this machine should score on a GPU, and why: `QUIVER_REQUIRE_CUDA`
/// (1 or 0) says so; unset, a driver library the backend can load and an
/// NVIDIA device node (`/dev/nvidia0`, ...) imply a GPU. Decided from the
/// machine, not from what the server did, so either answer can fail.
fn gpu_expected() -> (bool, String) {
    match std::env::var("QUIVER_REQUIRE_CUDA").as_deref() {
        Ok("1") => return (true, "QUIVER_REQUIRE_CUDA=1".into()),
        Ok("0") => return (false, "QUIVER_REQUIRE_CUDA=0".into()),
        Ok(other) => panic!("QUIVER_REQUIRE_CUDA={other}: 1 (a GPU must be used) or 0 (none must be)"),
        Err(_) => {}
    }
    if matches!(cuda::probe(), Err(CudaError::NoDriver)) {
        return (false, "no CUDA driver library".into());
    }
    let device_node = std::fs::read_dir("/dev").into_iter().flatten().flatten().any(|e| {
        let name = e.file_name();
        let name = name.to_string_lossy();
        name.strip_prefix("nvidia").is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    });
    if device_node {
        (true, "a CUDA driver library and an NVIDIA device node".into())
    } else {
        (false, "a CUDA driver library but no NVIDIA device node".into())
    }
}

/// Twenty demo requests to `server`: each must be answered with the CPU
/// INT8 backend's scores, bit for bit.
fn scores_are_cpu_int8(server: &Server) {
    let mut c = server.client();
    for i in 0..20u64 {
        let items: Vec<u64> = (0..32).map(|k| (i * 7919 + k * 104_729) % 10_000).collect();
        let spec = demo_request(i, (i * 15_485_863) % 100_000, items);
        let r = c.score(&spec).unwrap();
        assert_eq!(r.status, Status::Ok);
        let want = cpu_int8_scores(&spec);
        let bits = |v: &[f32]| v.iter().map(|s| s.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&r.scores), bits(&want), "request {i}: not the CPU INT8 scores");
    }
}

fn serve_and_check(env: &[(&str, &str)], reason: &str) {
    let mut server = Server::start_env(&["--shards", "2", "--backend", "cuda"], env);
    scores_are_cpu_int8(&server);
    let log = server.wait_stderr("falling back to the CPU INT8 backend");
    let warnings: Vec<&str> = log.lines().filter(|l| l.contains("WARN") && l.contains("backend \"cuda\"")).collect();
    assert_eq!(warnings.len(), 1, "expected one fallback warning, log:\n{log}");
    assert!(warnings[0].contains("falling back to the CPU INT8 backend"), "{}", warnings[0]);
    assert!(warnings[0].contains(reason), "the warning does not say '{reason}': {}", warnings[0]);
    assert!(!log.contains("panicked"), "{log}");
    assert_eq!(server.terminate(), 0);
}

#[test]
fn the_server_scores_on_the_gpu_where_there_is_one_and_falls_back_where_there_is_none() {
    let (gpu, why) = gpu_expected();
    if !gpu {
        // The warning names what the backend found missing.
        let reason = cuda::probe().expect_err("no GPU is expected here, yet the driver found one").to_string();
        serve_and_check(&[], &reason);
        eprintln!("RAN the CPU fallback checks ({why}): {reason}");
        return;
    }
    let info = cuda::probe().unwrap_or_else(|e| panic!("{why}, but the driver says: {e}"));
    let mut server = Server::start(&["--shards", "2", "--backend", "cuda"]);
    scores_are_cpu_int8(&server);
    let metrics = server.wait_scrape("backend=\"cuda-int8\"");
    assert!(!metrics.contains("backend=\"cpu-int8\""), "a version fell back to the CPU:\n{metrics}");
    let log = server.stderr();
    assert!(!log.contains("backend \"cuda\""), "no fallback, no failure: {log}");
    assert!(!log.contains("panicked"), "{log}");
    assert_eq!(server.terminate(), 0);
    // Parity on the GPU over the check models, both semantics.
    let (code, out, err) = common::run_quiver(["gpu-check", "--batches", "1,31,32,33,255,1024", "--iters", "5"]);
    assert_eq!(code, 0, "gpu-check: {out}{err}");
    let report: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(report["ok"], serde_json::Value::Bool(true), "{report:#}");
    eprintln!("RAN the GPU checks on {} ({why})", info.name);
}

/// Builds a fake driver exporting `cuInit` (result from the environment),
/// `cuDeviceGetCount` (0 devices) and `cuDriverGetVersion` (12.9, or
/// `FAKE_DRIVER_VERSION`): a driver with no GPU behind it. It is written as
/// `libcuda.so` and `libcuda.so.1` in `dir`, since the loader asks for
/// `libcuda.so` first and a machine with a real driver has one.
fn fake_driver(dir: &Path) {
    let src = dir.join("fake_cuda.c");
    std::fs::write(
        &src,
        "#include <stdlib.h>\n\
         int cuInit(unsigned int flags) { const char* r = getenv(\"FAKE_CUINIT_RESULT\"); (void)flags; return r ? atoi(r) : 0; }\n\
         int cuDeviceGetCount(int* count) { *count = 0; return 0; }\n\
         int cuDriverGetVersion(int* v) { const char* r = getenv(\"FAKE_DRIVER_VERSION\"); *v = r ? atoi(r) : 12090; return 0; }\n",
    )
    .unwrap();
    let lib = dir.join("libcuda.so.1");
    // cc links every Rust binary on Linux, so it is here wherever this test built.
    let status = Command::new("cc").args(["-shared", "-fPIC", "-o"]).arg(&lib).arg(&src).status().expect("cc runs");
    assert!(status.success(), "cc could not build the fake driver");
    std::fs::copy(&lib, dir.join("libcuda.so")).unwrap();
}

/// Runs on every machine, a GPU's too: the fake driver comes first on the
/// loader path.
#[test]
fn with_a_driver_but_no_device_the_server_serves_cpu_int8_and_says_why() {
    let dir = common::scratch("fake-cuda");
    fake_driver(&dir);
    let path = match std::env::var("LD_LIBRARY_PATH") {
        Ok(p) if !p.is_empty() => format!("{}:{p}", dir.display()),
        _ => dir.display().to_string(),
    };
    // cuInit succeeds and the device count is 0.
    serve_and_check(&[("LD_LIBRARY_PATH", &path)], "no CUDA device");
    // cuInit itself says CUDA_ERROR_NO_DEVICE (100), as a real driver does.
    serve_and_check(&[("LD_LIBRARY_PATH", &path), ("FAKE_CUINIT_RESULT", "100")], "no CUDA device");
    // A driver older than the API this build targets is refused by its
    // version, before cudarc could call a symbol it lacks (and panic).
    serve_and_check(
        &[("LD_LIBRARY_PATH", &path), ("FAKE_DRIVER_VERSION", "11080")],
        "the CUDA driver is version 11.8; this build uses the CUDA 12.4 driver API",
    );
    eprintln!("RAN the fake-driver fallback checks");
}
