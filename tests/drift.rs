//! Drift against a real server: a model imported with `quiver import
//! --calibration` is served calibration-like traffic (the calibration set's
//! own rows, rebuilt from replicas and request context), then traffic whose
//! context inputs are shifted. The score PSI must stay near 0 on the first
//! and pass the alert threshold on the second, and the input drift gauges
//! must follow the shift; both inference modes count.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{scratch, Server, BIN};
use quiver::admin::Stats;
use quiver::drift::DriftReport;
use quiver::features::replica::ReplicaBuilder;
use quiver::model::calibrate::{read_npy, Matrix};
use quiver::model::Model;
use quiver::wire::{RequestSpec, Status, Tier};

/// Columns of the fixture's input rows: user 0..8, item 8..16, context 16..20.
const USER: std::ops::Range<usize> = 0..8;
const ITEM: std::ops::Range<usize> = 8..16;
const CONTEXT: std::ops::Range<usize> = 16..20;
/// How far the shifted traffic moves every context input, in calibration
/// standard deviations.
const SHIFT_SIGMAS: f32 = 3.0;
/// The bound on the PSI of calibration-like traffic: sampling noise over a
/// few thousand scores in 20 bins is about 0.01, INT8 scoring adds a little.
const PSI_CALM_MAX: f64 = 0.05;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/onnx")
}

fn write_replica(path: &Path, group: &str, set: &Matrix, cols: std::ops::Range<usize>) {
    let mut b = ReplicaBuilder::new(group, cols.len() as u32);
    for r in 0..set.rows {
        b.push(r as u64, &set.row(r)[cols.clone()]).unwrap();
    }
    b.write(path).unwrap();
}

/// A data dir with the calibrated fixture model and replicas whose user `r`
/// and item `r` are the user and item columns of calibration row `r`.
fn calibrated_data_dir(name: &str) -> (PathBuf, Matrix, Model) {
    let dir = scratch(name);
    let calibration = fixtures().join("calibration.npy");
    let out = Command::new(BIN)
        .args(["import", "--onnx"])
        .arg(fixtures().join("ctr_helper.onnx"))
        .arg("--out")
        .arg(dir.join("model.qm"))
        .args(["--name", "ctr", "--version", "7", "--inputs", "user:8,item:8,context:4", "--calibration"])
        .arg(&calibration)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let set = read_npy(&calibration).unwrap();
    write_replica(&dir.join("user.qrep"), "user", &set, USER);
    write_replica(&dir.join("item.qrep"), "item", &set, ITEM);
    let model = Model::load(&dir.join("model.qm")).unwrap();
    (dir, set, model)
}

fn drift(server: &Server) -> (Option<DriftReport>, Stats) {
    let stats: Stats = server.stats();
    (stats.drift.iter().find(|r| (r.model.as_str(), r.version) == ("ctr", 7)).cloned(), stats)
}

/// Polls the drift report until `done` holds for it.
fn wait_for(server: &Server, what: &str, done: impl Fn(&DriftReport) -> bool) -> DriftReport {
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let (report, stats) = drift(server);
        if let Some(r) = report.filter(|r| done(r)) {
            return r;
        }
        assert!(Instant::now() < until, "{what}: never reached; {stats:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

const CALM: u8 = 0;
const SHIFTED: u8 = 1;
const STOP: u8 = 2;

fn scenario(name: &str, extra: &[&str]) {
    let (dir, set, model) = calibrated_data_dir(name);
    let c = model.calibration.as_ref().expect("imported with a calibration");
    // The context's 4 inputs, the user group's 8 (request scope), then the
    // item group's 8 (candidate scope).
    assert_eq!((c.input_means.len(), c.input_variances.len()), (20, 20));
    let sigmas: Vec<f32> = c.input_variances.iter().map(|v| v.sqrt()).collect();
    assert!(sigmas.iter().all(|s| *s > 0.01), "{sigmas:?}");
    let cfg = dir.join("quiver.toml");
    std::fs::write(&cfg, "[drift]\nwindow_s = 3\nmin_count = 2000\n").unwrap();
    let mut args = vec!["--shards", "2", "--config", cfg.to_str().unwrap()];
    args.extend_from_slice(extra);
    let server = Server::start_with(&dir, &args);

    // Calibration row r as one request: user r, item r, the row's context.
    let mode = Arc::new(AtomicU8::new(CALM));
    let traffic = std::thread::spawn({
        let (mode, mut client, set, sigmas) = (mode.clone(), server.client(), set.clone(), sigmas.clone());
        move || {
            let mut r = 0usize;
            let mut sent = 0u64;
            loop {
                let m = mode.load(Ordering::Relaxed);
                if m == STOP {
                    return sent;
                }
                let shift = if m == SHIFTED { SHIFT_SIGMAS } else { 0.0 };
                let spec = RequestSpec {
                    request_id: sent,
                    budget_us: 1_000_000,
                    model: "ctr".into(),
                    user_id: r as u64,
                    item_ids: vec![r as u64],
                    context: set.row(r)[CONTEXT].iter().zip(&sigmas).map(|(v, s)| v + shift * s).collect(),
                    ..RequestSpec::default()
                };
                let resp = client.score(&spec).unwrap();
                assert_eq!((resp.status, resp.tier, resp.features_missing), (Status::Ok, Tier::Primary, 0));
                sent += 1;
                r = (r + 1) % set.rows;
            }
        }
    });

    // Followed: the context's 4 inputs, then the user group's first 4
    // (`drift.context_features_max` = 8 by default).
    let calm = wait_for(&server, "a PSI over calibration-like traffic", |r| r.psi.is_some() && r.features.len() == 8);
    let names: Vec<&str> = calm.features.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(names, ["context_0", "context_1", "context_2", "context_3", "user_0", "user_1", "user_2", "user_3"]);
    eprintln!("{name} calibration-like: {calm:?}");
    let psi = calm.psi.unwrap();
    assert!(psi < PSI_CALM_MAX && !calm.alert, "calibration-like traffic drifted: {calm:?}");
    for f in &calm.features {
        assert!(f.mean_shift < 0.25, "context input {} looks shifted: {calm:?}", f.feature);
        let ratio = f.variance / f.calibration_variance;
        assert!((0.7..1.4).contains(&ratio), "context input {} variance ratio {ratio}: {calm:?}", f.feature);
    }
    let text = common::http_get(&format!("http://{}/metrics", server.admin)).1;
    assert!(text.contains("quiver_score_psi{model=\"ctr\",version=\"7\"} "), "{text}");
    assert!(text.contains("quiver_score_drift_alert{model=\"ctr\",version=\"7\"} 0"), "{text}");
    assert!(text.contains("quiver_input_drift{model=\"ctr\",version=\"7\",feature=\"context_3\"} "), "{text}");
    assert!(text.contains("quiver_input_drift{model=\"ctr\",version=\"7\",feature=\"user_0\"} "), "{text}");

    mode.store(SHIFTED, Ordering::Relaxed);
    // Once the window holds only shifted traffic, every mean has moved by
    // about SHIFT_SIGMAS calibration standard deviations.
    // The user group's rows did not move.
    let shifted = wait_for(&server, "the alert after the context shift", |r| {
        let (context, user): (Vec<_>, Vec<_>) = r.features.iter().partition(|f| f.name.starts_with("context_"));
        r.alert
            && r.features.len() == 8
            && context.iter().all(|f| f.mean_shift > 0.9 * f64::from(SHIFT_SIGMAS))
            && user.iter().all(|f| f.mean_shift < 0.25)
    });
    eprintln!("{name} shifted: {shifted:?}");
    let text = common::http_get(&format!("http://{}/metrics", server.admin)).1;
    assert!(text.contains("quiver_score_drift_alert{model=\"ctr\",version=\"7\"} 1"), "{text}");
    let out = Command::new(BIN).args(["stats", "--admin", &server.admin, "--count", "1"]).output().unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.lines().any(|l| l.starts_with("drift ctr@7: psi ") && l.contains("ALERT")), "{table}");
    mode.store(STOP, Ordering::Relaxed);
    let sent = traffic.join().unwrap();
    assert!(sent >= 4_000, "{sent} requests");
}

#[test]
fn psi_stays_near_zero_on_calibration_traffic_and_alerts_on_a_shift() {
    scenario("drift-inline", &[]);
}

#[test]
fn drift_is_counted_when_the_inference_thread_scores() {
    scenario("drift-thread", &["--inference", "thread"]);
}

/// An uncalibrated model has no baseline: no drift measure at all.
#[test]
fn an_uncalibrated_model_reports_no_drift() {
    let server = Server::start(&["--shards", "1"]);
    let mut c = server.client();
    for i in 0..50u64 {
        assert_eq!(c.score(&common::demo_request(i, i, vec![1, 2])).unwrap().status, Status::Ok);
    }
    let until = Instant::now() + common::WAIT;
    let stats = loop {
        let (_, stats) = drift(&server);
        if stats.requests == 50 {
            break stats;
        }
        assert!(Instant::now() < until, "{stats:?}");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(stats.drift.is_empty(), "{stats:?}");
    let text = common::http_get(&format!("http://{}/metrics", server.admin)).1;
    assert!(text.contains("# TYPE quiver_score_psi gauge"), "{text}");
    assert!(!text.contains("quiver_score_psi{"), "{text}");
    assert!(!text.contains("quiver_input_drift{"), "{text}");
}
