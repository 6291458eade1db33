//! The onnxruntime backend (feature `onnxruntime`) against the real library:
//! graphs the native compiler refuses import with `--onnxruntime` and are
//! served, by the CPU-only request path around them, with exactly the scores
//! onnxruntime computes in Python (`tests/fixtures/ort_fixtures.py` recorded them
//! with the same library and graph); native models forced onto onnxruntime
//! match the native f32 path; a library that cannot be loaded is a typed
//! error and the ladder answers.
//!
//! The library is the pinned PyPI wheel's (`ORT_DYLIB_PATH`, else found
//! through `python3 -c "import onnxruntime"`). Without it these tests skip
//! loudly, or fail when `QUIVER_REQUIRE_ONNXRUNTIME=1` (CI).
#![cfg(feature = "onnxruntime")]

mod common;

use std::path::{Path, PathBuf};

use common::zoo::{segment, zoo};
use common::{http_get, run_quiver, scratch, Server};
use quiver::features::replica::ReplicaBuilder;
use quiver::model::calibrate::read_npy;
use quiver::model::onnx::{import_file_keeping, KeepOnnx};
use quiver::model::{Model, Source};
use quiver::score::{self, BackendKind};
use quiver::wire::{Reason, RequestSpec, Status, Tier};

/// Native f32 against onnxruntime on the same graph, on the score.
const FORCED_TOLERANCE: f32 = 1e-5;

fn required() -> bool {
    std::env::var("QUIVER_REQUIRE_ONNXRUNTIME").is_ok_and(|v| v == "1")
}

/// The onnxruntime shared library, configured for this process; `None`
/// (after saying why) when there is none and it is not required.
fn library() -> Option<PathBuf> {
    let found = match std::env::var_os("ORT_DYLIB_PATH") {
        Some(p) if !p.is_empty() => Some(PathBuf::from(p)),
        _ => common::onnxruntime_wheel_library(),
    };
    match found.filter(|p| p.exists()) {
        Some(p) => {
            score::configure_onnxruntime(&p);
            Some(p)
        }
        None => {
            let why = "no onnxruntime library: set ORT_DYLIB_PATH or pip install onnxruntime==1.32.0";
            assert!(!required(), "QUIVER_REQUIRE_ONNXRUNTIME=1 but {why}");
            eprintln!("SKIPPED: {why}");
            None
        }
    }
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/ort")
}

/// One refused-graph fixture: its `--inputs`, rows and onnxruntime's scores.
struct Fixture {
    name: String,
    inputs: String,
    dim: usize,
    x: Vec<f32>,
    want: Vec<f32>,
}

fn refused() -> (Vec<Fixture>, usize) {
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("ort.json")).unwrap()).unwrap();
    let candidates = index["candidates"].as_u64().unwrap() as usize;
    let mut out = Vec::new();
    for (name, m) in index["models"].as_object().unwrap() {
        let dim = m["dim"].as_u64().unwrap() as usize;
        let table = read_npy(&fixtures().join(format!("{name}.npy"))).unwrap();
        assert_eq!(table.cols, dim + 1, "{name}");
        let (mut x, mut want) = (Vec::new(), Vec::new());
        for row in table.data.chunks_exact(table.cols) {
            x.extend_from_slice(&row[..dim]);
            want.push(row[dim]);
        }
        out.push(Fixture { name: name.clone(), inputs: m["inputs"].as_str().unwrap().into(), dim, x, want });
    }
    assert_eq!(out.len(), 2);
    (out, candidates)
}

/// `quiver import --onnxruntime` of fixture `f` into `out`.
fn import_cli(f: &Fixture, out: &Path, version: u32, extra: &[&str]) -> (i32, String, String) {
    let file = fixtures().join(format!("{}.onnx", f.name));
    let version = version.to_string();
    let args = [
        "import",
        "--onnx",
        file.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--name",
        &f.name,
        "--version",
        &version,
        "--inputs",
        &f.inputs,
        "--onnxruntime",
    ];
    run_quiver(args.iter().copied().chain(extra.iter().copied()))
}

#[test]
fn refused_graphs_import_for_onnxruntime_and_score_as_onnxruntime_does() {
    let Some(_) = library() else { return };
    let dir = scratch("ort-import");
    let (fixtures_, candidates) = refused();
    for f in &fixtures_ {
        // The native compiler refuses it and says what to do instead.
        let out = dir.join(format!("{}.qm", f.name));
        let file = fixtures().join(format!("{}.onnx", f.name));
        let (code, _, err) = run_quiver([
            "import",
            "--onnx",
            file.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--name",
            &f.name,
            "--version",
            "1",
            "--inputs",
            &f.inputs,
        ]);
        assert_ne!(code, 0, "{}", f.name);
        assert!(err.contains("is not supported") && err.contains("rerun with --onnxruntime"), "{err}");
        assert!(!out.exists());

        let (code, stdout, err) = import_cli(f, &out, 1, &[]);
        assert_eq!(code, 0, "{}: {err}", f.name);
        assert!(stdout.contains("backend: onnxruntime"), "{stdout}");
        let model = std::sync::Arc::new(Model::load(&out).unwrap());
        assert!(!model.is_native() && model.onnx.is_some());
        assert_eq!(model.input_dim(), f.dim);

        // Whatever the configured backend, the version runs on onnxruntime,
        // and each request's scores are onnxruntime's, bit for bit.
        let mut backend = score::build(BackendKind::Int8, &model, 64);
        assert_eq!(backend.name(), "onnxruntime");
        for (r, (x, want)) in f.x.chunks(candidates * f.dim).zip(f.want.chunks(candidates)).enumerate() {
            let mut out = vec![0.0; candidates];
            backend.score(x, candidates, &mut out).unwrap();
            let got: Vec<u32> = out.iter().map(|v| model.score(*v).to_bits()).collect();
            let want: Vec<u32> = want.iter().map(|v| v.to_bits()).collect();
            assert_eq!(got, want, "{} request {r}", f.name);
        }
        // A batch of every request's rows, as the stage runs them.
        let rows = f.want.len();
        let mut big = score::build(BackendKind::Int8, &model, rows);
        let mut out = vec![0.0; rows];
        big.score(&f.x, rows, &mut out).unwrap();
        let err = out.iter().zip(&f.want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(err <= 1e-6, "{}: batched scores differ by {err}", f.name);
    }
}

/// The replicas and requests that give the server each fixture's rows:
/// user id = request, item id = row (ids offset per model).
fn serve_fixtures(dir: &Path, fixtures_: &[Fixture], candidates: usize, lib: &Path) -> PathBuf {
    let models = dir.join("models");
    let (mut users, mut items) = (ReplicaBuilder::new("user", 8), ReplicaBuilder::new("item", 8));
    for (m, f) in fixtures_.iter().enumerate() {
        let at = models.join(&f.name).join("1");
        std::fs::create_dir_all(&at).unwrap();
        // Calibrated from the fixture's own rows: drift baselines scored by
        // onnxruntime.
        let set = dir.join(format!("{}.npy", f.name));
        let rows = f.want.len();
        let matrix = quiver::model::calibrate::Matrix { rows, cols: f.dim, data: f.x.clone() };
        std::fs::write(&set, quiver::model::calibrate::npy_bytes(&matrix)).unwrap();
        let (code, stdout, err) = import_cli(
            f,
            &at.join("model.qm"),
            1,
            &["--calibration", set.to_str().unwrap(), "--onnxruntime-lib", lib.to_str().unwrap()],
        );
        assert_eq!(code, 0, "{err}");
        assert!(stdout.contains("rows scored by onnxruntime"), "{stdout}");
        let model = Model::load(&at.join("model.qm")).unwrap();
        let c = model.calibration.expect("calibrated");
        assert_eq!(c.scores.counts.iter().sum::<u64>(), rows as u64);
        for (r, row) in f.x.chunks_exact(f.dim).enumerate() {
            let base = (m * 10_000) as u64;
            if r % candidates == 0 {
                users.push(base + (r / candidates) as u64, &row[..8]).unwrap();
            }
            items.push(base + r as u64, &row[8..16]).unwrap();
        }
    }
    users.write(&dir.join("user.qrep")).unwrap();
    items.write(&dir.join("item.qrep")).unwrap();
    models
}

#[test]
fn refused_graphs_are_served_by_the_real_server_with_onnxruntimes_scores() {
    let Some(lib) = library() else { return };
    let dir = scratch("ort-serve");
    let (fixtures_, candidates) = refused();
    let models = serve_fixtures(&dir, &fixtures_, candidates, &lib);
    for inference in ["inline", "thread"] {
        let server = Server::start_with(
            &dir,
            &[
                "--shards",
                "1",
                "--inference",
                inference,
                "--models-dir",
                models.to_str().unwrap(),
                "--onnxruntime-lib",
                lib.to_str().unwrap(),
            ],
        );
        let mut c = server.client();
        for (m, f) in fixtures_.iter().enumerate() {
            let model = Model::load(&models.join(&f.name).join("1/model.qm")).unwrap();
            for (r, (x, want)) in f.x.chunks(candidates * f.dim).zip(f.want.chunks(candidates)).enumerate() {
                let base = (m * 10_000) as u64;
                let first = &x[..f.dim];
                let spec = RequestSpec {
                    request_id: r as u64,
                    budget_us: 1_000_000,
                    model: f.name.clone(),
                    user_id: base + r as u64,
                    item_ids: (0..candidates).map(|k| base + (r * candidates + k) as u64).collect(),
                    context: segment(&model, first, Source::Context).to_vec(),
                    context_ids: segment(&model, first, Source::ContextIds).iter().map(|v| *v as u64).collect(),
                    ..RequestSpec::default()
                };
                let resp = c.score(&spec).unwrap();
                assert_eq!((resp.status, resp.tier, resp.features_missing), (Status::Ok, Tier::Primary, 0), "{resp:?}");
                let got: Vec<u32> = resp.scores.iter().map(|v| v.to_bits()).collect();
                let want: Vec<u32> = want.iter().map(|v| v.to_bits()).collect();
                assert_eq!(got, want, "{inference} {} request {r}", f.name);
            }
        }
        // /metrics and quiver stats say which backend serves each version,
        // once the shards have published every version's drift window.
        let windows: Vec<String> = fixtures_
            .iter()
            .map(|f| format!("quiver_score_drift_window_scores{{model=\"{}\",version=\"1\"}} {}", f.name, f.want.len()))
            .collect();
        let until = std::time::Instant::now() + common::WAIT;
        let text = loop {
            let (status, text) = http_get(&format!("http://{}/metrics", server.admin));
            assert_eq!(status, 200);
            if windows.iter().all(|w| text.contains(w)) {
                break text;
            }
            assert!(std::time::Instant::now() < until, "{windows:?} not all in\n{text}");
            std::thread::sleep(std::time::Duration::from_millis(50));
        };
        for f in &fixtures_ {
            let line = format!("quiver_model_info{{model=\"{}\",version=\"1\",backend=\"onnxruntime\"}} 1", f.name);
            assert!(text.contains(&line), "{line} not in\n{text}");
            // Drift is measured as for a native version.
            let drift =
                format!("quiver_score_drift_window_scores{{model=\"{}\",version=\"1\"}} {}", f.name, f.want.len());
            assert!(text.contains(&drift), "{drift} not in\n{text}");
        }
        let (code, stdout, err) = run_quiver(["stats", "--admin", &server.admin, "--count", "1"]);
        assert_eq!(code, 0, "{err}");
        assert!(stdout.contains("relu6_mlp@1 on onnxruntime"), "{stdout}");
    }
}

#[test]
fn native_models_forced_onto_onnxruntime_match_the_native_f32_path() {
    let Some(_) = library() else { return };
    let mut checked = 0;
    for z in zoo() {
        let opts = z.import_options();
        let model = std::sync::Arc::new(
            import_file_keeping(&z.file, &opts, KeepOnnx::Beside)
                .unwrap_or_else(|e| panic!("{}: --keep-onnx: {e}", z.name))
                .model,
        );
        assert!(model.is_native() && model.onnx.is_some());
        assert_eq!(Model::from_bytes(&model.to_bytes(), &z.name).unwrap(), *model, "{}", z.name);
        let rows = 256;
        let x = &z.x[..rows * z.dim];
        let mut native = score::build(BackendKind::F32, &model, rows);
        let mut forced = score::build(BackendKind::Onnxruntime, &model, rows);
        assert_eq!((native.name(), forced.name()), ("cpu-f32", "onnxruntime"), "{}", z.name);
        let (mut a, mut b) = (vec![0.0; rows], vec![0.0; rows]);
        native.score(x, rows, &mut a).unwrap();
        forced.score(x, rows, &mut b).unwrap();
        let err = a.iter().zip(&b).map(|(p, q)| (model.score(*p) - model.score(*q)).abs()).fold(0.0f32, f32::max);
        eprintln!("{:<22} native f32 vs onnxruntime, max |Δ score| {err:.2e}", z.name);
        assert!(err <= FORCED_TOLERANCE, "{}: forced onto onnxruntime, scores differ by {err}", z.name);
        checked += 1;
    }
    assert_eq!(checked, 19);
}

#[test]
fn a_missing_library_is_a_typed_error_and_the_ladder_answers() {
    let Some(lib) = library() else { return };
    let dir = scratch("ort-missing");
    let (fixtures_, candidates) = refused();
    let models = serve_fixtures(&dir, &fixtures_, candidates, &lib);
    let server = Server::start_with(
        &dir,
        &[
            "--shards",
            "2",
            "--models-dir",
            models.to_str().unwrap(),
            "--onnxruntime-lib",
            "/nonexistent/libonnxruntime.so.1.32.0",
        ],
    );
    let mut c = server.client();
    for r in 0..40u64 {
        let spec = RequestSpec {
            request_id: r,
            budget_us: 1_000_000,
            model: "relu6_mlp".into(),
            user_id: r % 32,
            item_ids: (0..candidates as u64).collect(),
            context: vec![0.5; 4],
            ..RequestSpec::default()
        };
        let resp = c.score(&spec).unwrap();
        // The static default rung, saying why.
        assert_eq!((resp.status, resp.tier), (Status::Ok, Tier::Default), "{resp:?}");
        assert!(matches!(resp.reason, Reason::ModelError | Reason::BreakerOpen), "{:?}", resp.reason);
        assert_eq!(resp.scores.len(), candidates);
    }
    let log = server.wait_stderr("onnxruntime unavailable");
    let warnings = log.matches("onnxruntime unavailable").count();
    assert_eq!(warnings, 1, "one warning for every shard and version:\n{log}");
    assert!(log.contains("/nonexistent/libonnxruntime.so.1.32.0") && log.contains("pip install onnxruntime"), "{log}");
    server.wait_scrape("quiver_model_info{model=\"relu6_mlp\",version=\"1\",backend=\"unavailable\"} 1");
}

/// onnxruntime on the lower rungs and beside the cache: a native primary
/// (thread mode) whose stage is made slow steps down to an onnxruntime
/// fallback, which answers in time with onnxruntime's scores; with the cache
/// answering first, an onnxruntime primary's scores come back cached.
/// `quiver import` of the zoo's torch_bn_mlp (inputs user 8, item 8,
/// context 4) as `models/torch_bn_mlp/<version>`, with `extra` flags.
fn import_torch_bn_mlp(models: &Path, version: &str, extra: &[&str]) {
    let z = zoo().into_iter().find(|z| z.name == "torch_bn_mlp").unwrap();
    let at = models.join("torch_bn_mlp").join(version);
    std::fs::create_dir_all(&at).unwrap();
    let out = at.join("model.qm");
    let args = [
        "import",
        "--onnx",
        z.file.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--name",
        "torch_bn_mlp",
        "--version",
        version,
        "--inputs",
        &z.inputs,
    ];
    let (code, _, err) = run_quiver(args.iter().copied().chain(extra.iter().copied()));
    assert_eq!(code, 0, "{err}");
}

#[test]
fn an_onnxruntime_model_is_the_fallback_rung_and_its_scores_are_cached() {
    use quiver::wire::Tier;
    let Some(lib) = library() else { return };
    let dir = scratch("ort-rungs");
    let (fixtures_, candidates) = refused();
    let models = serve_fixtures(&dir, &fixtures_, candidates, &lib);
    let relu6 = fixtures_.iter().position(|f| f.name == "relu6_mlp").unwrap();
    let f = &fixtures_[relu6];
    let fallback = models.join("relu6_mlp/1/model.qm");
    // A native primary reading the same inputs (user 8, item 8, context 4).
    import_torch_bn_mlp(&models, "1", &[]);
    let spec = |r: usize, model: &str| {
        let base = (relu6 * 10_000) as u64;
        let first = &f.x[r * candidates * f.dim..][..f.dim];
        RequestSpec {
            request_id: r as u64,
            budget_us: 40_000,
            model: model.into(),
            user_id: base + r as u64,
            item_ids: (0..candidates).map(|k| base + (r * candidates + k) as u64).collect(),
            context: first[16..20].to_vec(),
            ..RequestSpec::default()
        }
    };
    let bits = |v: &[f32]| v.iter().map(|s| s.to_bits()).collect::<Vec<_>>();

    // One shard serving the models with `toml` (and the library) as config.
    let serve = |name: &str, toml: String| {
        let cfg = dir.join(name);
        std::fs::write(&cfg, format!("onnxruntime_lib = \"{}\"\n{toml}", lib.display())).unwrap();
        Server::start_with(
            &dir,
            &["--shards", "1", "--models-dir", models.to_str().unwrap(), "--config", cfg.to_str().unwrap()],
        )
    };
    let rungs = format!(
        "inference = \"thread\"\nfaults_endpoint = true\n[ladder]\nfallback_model = \"{}\"\nreserve_us = 20000\n",
        fallback.display()
    );
    let server = serve("rungs.toml", rungs);
    let mut c = server.client();
    assert_eq!(common::http_post(&format!("http://{}/faults?stage_delay_us=60000", server.admin)).0, 200);
    let mut fallbacks = 0;
    for r in 0..f.want.len() / candidates {
        let resp = c.score(&spec(r, "torch_bn_mlp")).unwrap();
        assert_eq!(resp.status, Status::Ok, "{resp:?}");
        if resp.tier == Tier::Fallback {
            fallbacks += 1;
            assert_eq!(bits(&resp.scores), bits(&f.want[r * candidates..][..candidates]), "request {r}");
        }
    }
    assert!(fallbacks >= 24, "{fallbacks} of 32 from the onnxruntime fallback");
    drop(server);

    let server = serve("cache.toml", "[cache]\nentries_max = 4096\nttl_ms = 60000\nbefore_primary = true\n".into());
    let mut c = server.client();
    for tier in [Tier::Primary, Tier::Cached] {
        let resp = c.score(&spec(3, "relu6_mlp")).unwrap();
        assert_eq!((resp.status, resp.tier), (Status::Ok, tier), "{resp:?}");
        assert_eq!(bits(&resp.scores), bits(&f.want[3 * candidates..][..candidates]));
    }
}

/// An onnxruntime version as the shadow of a native one: the torch_bn_mlp
/// graph served natively as version 1 and through onnxruntime as version 2
/// (the same network): every request is shadowed, the shadow's scores agree
/// with the served ones, and the served answer stays version 1's.
#[test]
fn an_onnxruntime_version_shadows_a_native_one() {
    use quiver::wire::Tier;
    let Some(lib) = library() else { return };
    let dir = scratch("ort-shadow");
    let (fixtures_, candidates) = refused();
    let models = serve_fixtures(&dir, &fixtures_, candidates, &lib);
    import_torch_bn_mlp(&models, "1", &["--keep-onnx"]);
    import_torch_bn_mlp(&models, "2", &["--onnxruntime"]);
    let server = Server::start_with(
        &dir,
        &[
            "--shards",
            "1",
            "--backend",
            "f32",
            "--models-dir",
            models.to_str().unwrap(),
            "--onnxruntime-lib",
            lib.to_str().unwrap(),
        ],
    );
    let admin = &server.admin;
    assert_eq!(common::http_post(&format!("http://{admin}/models/torch_bn_mlp/load?version=1")).0, 200);
    assert_eq!(common::http_post(&format!("http://{admin}/models/torch_bn_mlp/shadow?version=2&fraction=1")).0, 200);
    let mut c = server.client();
    let f = &fixtures_[fixtures_.iter().position(|f| f.name == "relu6_mlp").unwrap()];
    let base = (fixtures_.iter().position(|f| f.name == "relu6_mlp").unwrap() * 10_000) as u64;
    for r in 0..32usize {
        let spec = RequestSpec {
            request_id: r as u64,
            budget_us: 1_000_000,
            model: "torch_bn_mlp".into(),
            user_id: base + r as u64,
            item_ids: (0..candidates).map(|k| base + (r * candidates + k) as u64).collect(),
            context: f.x[r * candidates * f.dim..][16..20].to_vec(),
            ..RequestSpec::default()
        };
        let resp = c.score(&spec).unwrap();
        assert_eq!((resp.status, resp.tier, resp.model_version), (Status::Ok, Tier::Primary, 1), "{resp:?}");
    }
    let until = std::time::Instant::now() + common::WAIT;
    let stats = loop {
        let s = server.stats();
        if s.shadow_requests >= 32 {
            break s;
        }
        assert!(std::time::Instant::now() < until, "{s:?}");
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    assert_eq!(stats.shadow_requests, 32);
    assert!(stats.shadow_mean_abs_diff < 1e-5, "native f32 and onnxruntime disagree: {stats:?}");
    assert_eq!(stats.backend_by_version.get("torch_bn_mlp@1").map(String::as_str), Some("cpu-f32"), "{stats:?}");
}
