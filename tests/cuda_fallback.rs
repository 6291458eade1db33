//! `quiver serve --backend cuda` without a usable GPU: the server starts,
//! says once why it is not using the GPU, and serves the CPU INT8 backend's
//! scores bit for bit.
//!
//! Two machines are simulated: no driver library at all (the loader path
//! holds no `libcuda`), and a driver that initialises but reports no device
//! (a fake `libcuda.so.1`, compiled here with `cc`, first on the loader
//! path). Only built with `--features cuda`, since without it the server has
//! no `cuda` backend to ask for. Skips when the machine has a real driver,
//! where the fallback cannot be provoked this way.

#![cfg(feature = "cuda")]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{demo_dir, demo_request, Server};
use quiver::features::replica::Replica;
use quiver::model::{sigmoid, Model};
use quiver::score::{self, BackendKind};
use quiver::wire::{RequestSpec, Status};

/// The scores the CPU INT8 backend gives `spec`, from the demo files.
fn cpu_int8_scores(spec: &RequestSpec) -> Vec<f32> {
    let dir = demo_dir();
    let model = Model::load(&dir.join("model.qm")).unwrap();
    let user = Replica::open(&dir.join("user.qrep"), "user").unwrap();
    let item = Replica::open(&dir.join("item.qrep"), "item").unwrap();
    let mut u = vec![0.0; user.dim()];
    user.read_into(spec.user_id, &mut u);
    let mut x = Vec::new();
    for &id in &spec.item_ids {
        let mut v = vec![0.0; item.dim()];
        item.read_into(id, &mut v);
        // Demo layout: user, item, context.
        x.extend_from_slice(&u);
        x.extend_from_slice(&v);
        x.extend_from_slice(&spec.context);
    }
    let rows = spec.item_ids.len();
    let mut logits = vec![0.0; rows];
    score::build(BackendKind::Int8, &model, rows).logits(&model, &x, rows, &mut logits);
    logits.into_iter().map(sigmoid).collect()
}

/// Whether a real CUDA driver is installed, in which case the "absent"
/// paths cannot be simulated by the loader path.
fn real_driver_present() -> bool {
    let out = Command::new("sh").args(["-c", "ldconfig -p 2>/dev/null | grep -q 'libcuda\\.so'"]).status();
    out.is_ok_and(|s| s.success())
}

fn serve_and_check(env: &[(&str, &str)], reason: &str) {
    let mut server = Server::start_env(&["--shards", "2", "--backend", "cuda"], env);
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
    let log = server.stderr();
    let warnings: Vec<&str> = log.lines().filter(|l| l.contains("WARN") && l.contains("backend \"cuda\"")).collect();
    assert_eq!(warnings.len(), 1, "expected one fallback warning, log:\n{log}");
    assert!(warnings[0].contains("falling back to the CPU INT8 backend"), "{}", warnings[0]);
    assert!(warnings[0].contains(reason), "the warning does not say '{reason}': {}", warnings[0]);
    assert!(!log.contains("panicked"), "{log}");
    assert_eq!(server.terminate(), 0);
}

#[test]
fn without_a_driver_library_the_server_serves_cpu_int8_and_says_why() {
    if real_driver_present() {
        eprintln!("SKIPPED: a CUDA driver is installed here; the no-driver path cannot be simulated");
        return;
    }
    serve_and_check(&[], "CUDA driver library");
}

/// Builds `libcuda.so.1` exporting `cuInit` (result from the environment),
/// `cuDeviceGetCount` (0 devices) and `cuDriverGetVersion` (12.9, or
/// `FAKE_DRIVER_VERSION`): a driver with no GPU behind it.
fn fake_driver(dir: &Path) -> Option<PathBuf> {
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
    let status = Command::new("cc").args(["-shared", "-fPIC", "-o"]).arg(&lib).arg(&src).status();
    match status {
        Ok(s) if s.success() => Some(lib),
        _ => {
            eprintln!("SKIPPED: no C compiler (cc) to build the fake libcuda.so.1");
            None
        }
    }
}

#[test]
fn with_a_driver_but_no_device_the_server_serves_cpu_int8_and_says_why() {
    if real_driver_present() {
        eprintln!("SKIPPED: a CUDA driver is installed here; the fake driver would not be the one loaded");
        return;
    }
    let dir = common::scratch("fake-cuda");
    let Some(_) = fake_driver(&dir) else { return };
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
}
