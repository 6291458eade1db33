//! The fraud worked example end to end: the committed LightGBM model
//! imported by the library against LightGBM's own probabilities, `quiver demo
//! --workload fraud` writing its files and config, `quiver serve --demo
//! --workload fraud` scoring transactions over five groups (two keyed by
//! strings) exactly as the generator's rows and the model say, unknown and
//! absent keys answered as the groups' policies say, `quiver bench
//! --workload fraud` driving it without an error, and the ads workload
//! refused until foreign keys exist.

mod common;

use common::{run_quiver, scratch, Server};
use quiver::features::replica::Replica;
use quiver::loadgen::fraud::{self, Tables, TrainingRows, Transaction};
use quiver::model::Model;
use quiver::wire::{GroupKeySpec, RequestSpec, Status};

/// Served against the reference probability: the tree scorer sums the
/// same f32 leaves in the same order, so only the sigmoid's rounding differs.
const SCORE_TOLERANCE: f32 = 1e-6;

fn reference_score(model: &Model, x: &[f32]) -> f32 {
    let mut out = [0.0f32];
    model.forward_f32_reference(x, 1, &mut out);
    model.score(out[0])
}

#[test]
fn the_committed_model_scores_as_lightgbm_did_on_held_out_rows() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/fraud_reference.csv");
    let text = std::fs::read_to_string(&path).unwrap();
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    assert_eq!(&header[..fraud::FEATURES.len()], fraud::FEATURES, "the reference's columns are the model's inputs");
    let model = fraud::model().unwrap();
    assert_eq!(model.input_dim(), fraud::FEATURES.len());
    let (mut rows, mut worst, mut scores, mut labels) = (0, 0.0f32, Vec::new(), Vec::new());
    for line in lines {
        let v: Vec<f64> = line.split(',').map(|f| f.parse().unwrap()).collect();
        let x: Vec<f32> = v[..fraud::FEATURES.len()].iter().map(|&f| f as f32).collect();
        let ours = reference_score(&model, &x);
        worst = worst.max((ours - v[v.len() - 1] as f32).abs());
        scores.push(ours);
        labels.push(v[v.len() - 2] == 1.0);
        rows += 1;
    }
    assert!(rows >= 200, "{rows} reference rows");
    assert!(worst <= SCORE_TOLERANCE, "scores differ from LightGBM's by up to {worst}");
    // The model learned the hidden rule: it ranks held-out fraud well above chance.
    if labels.iter().any(|l| *l) {
        assert!(common::auc(&scores, &labels) > 0.75, "AUC {}", common::auc(&scores, &labels));
    }
}

fn ids(spec: &RequestSpec, group: &str) -> GroupKeySpec {
    spec.groups.iter().find(|(g, _)| g == group).unwrap().1.clone()
}

fn key_arg(spec: &RequestSpec, group: &str) -> String {
    match ids(spec, group) {
        GroupKeySpec::Ids(v) => format!("{group}={}", v[0]),
        GroupKeySpec::Strs(v) => format!("{group}={}", v[0]),
    }
}

#[test]
fn demo_writes_the_files_and_serve_demo_scores_transactions_as_the_model_says() {
    let dir = scratch("fraud");
    let (code, stdout, stderr) = run_quiver(["demo", "--workload", "fraud", "--data-dir", dir.to_str().unwrap()]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("--workload fraud"), "{stdout}");
    for g in fraud::GROUPS {
        let r = Replica::open(&dir.join(format!("{g}.qrep")), g).unwrap();
        assert_eq!(r.dim(), fraud::WIDTH as usize, "{g}");
    }
    let config = quiver::config::Config::load(&dir.join("quiver.toml")).unwrap();
    assert_eq!(config.groups, fraud::groups());
    assert_eq!((config.data_dir.as_path(), config.canary_group.as_str()), (dir.as_path(), fraud::CANARY_GROUP));
    let model = Model::load(&dir.join("model.qm")).unwrap();
    assert_eq!(model, fraud::model().unwrap());

    // `serve --demo` builds the example itself in a directory with nothing in it.
    let served = scratch("fraud-served");
    let server = Server::start_with(&served, &["--demo", "--workload", "fraud", "--shards", "1"]);
    assert_eq!(Model::load(&served.join("model.qm")).unwrap(), model);
    let mut client = server.client();
    let tables = Tables::generate();
    let mut rows = TrainingRows::new(tables.clone(), 11);
    for n in 1..=40 {
        let (t, x, _) = rows.next_row();
        let mut spec = t.request(n);
        spec.budget_us = 2_000_000;
        let r = client.score(&spec).unwrap();
        assert_eq!((r.status, r.features_missing, r.scores.len()), (Status::Ok, 0, 1), "{r:?}");
        let want = reference_score(&model, &x);
        assert!((r.scores[0] - want).abs() <= SCORE_TOLERANCE, "transaction {t:?}: {} against {want}", r.scores[0]);
    }

    // A device never seen: its group's default row, counted missing.
    let t = Transaction { entities: [42, 7, 3, 9, 5], amount_usd: 250.0, hour: 3.0 };
    let mut x = tables.features(&t).unwrap();
    let device = Replica::open(&served.join("device.qrep"), "device").unwrap();
    x[8..12].copy_from_slice(&device.default_vector());
    let mut spec = t.request(100);
    spec.budget_us = 2_000_000;
    let unknown = "0123456789abcdef";
    assert!((0..fraud::POPULATIONS[2]).all(|i| fraud::device_key(i) != unknown));
    spec.groups[2].1 = GroupKeySpec::Strs(vec![unknown.into()]);
    let r = client.score(&spec).unwrap();
    assert_eq!((r.status, r.features_missing), (Status::Ok, 1), "{r:?}");
    let want = reference_score(&model, &x);
    assert!((r.scores[0] - want).abs() <= SCORE_TOLERANCE, "unknown device: {} against {want}", r.scores[0]);

    // Every group is required: a transaction without its IP is refused, by name.
    spec.groups.retain(|(g, _)| g != "ip");
    spec.request_id = 101;
    let r = client.score(&spec).unwrap();
    assert_eq!(r.status, Status::BadRequest, "{r:?}");
    assert!(r.error.contains("ip"), "{}", r.error);

    // The README's command line: `quiver score` with one --key per group.
    let spec = t.request(102);
    let x = tables.features(&t).unwrap();
    let context = format!("{},{}", t.amount_usd, t.hour);
    let mut args = vec!["score".to_string(), "--addr".into(), server.addr.clone(), "--json".into()];
    for g in ["card", "account", "ip", "merchant"] {
        args.extend(["--key".into(), key_arg(&spec, g)]);
    }
    args.extend(["--str-key".into(), key_arg(&spec, "device"), "--context".into(), context]);
    let (code, stdout, stderr) = run_quiver(&args);
    assert_eq!(code, 0, "{stdout} {stderr}");
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!((v["status"].as_str(), v["features_missing"].as_u64()), (Some("ok"), Some(0)), "{v}");
    let got = v["scores"][0].as_f64().unwrap() as f32;
    assert!((got - reference_score(&model, &x)).abs() <= SCORE_TOLERANCE, "{v}");

    // A short bounded load over the five groups: every answer Ok.
    let bench = |extra: &[&str]| {
        let mut args = vec!["bench", "--addr", &server.addr, "--workload", "fraud", "--duration", "1s"];
        args.extend_from_slice(&["--rate", "300", "--connections", "1", "--budget-us", "2000000", "--json"]);
        args.extend_from_slice(extra);
        let (code, stdout, stderr) = run_quiver(&args);
        assert_eq!(code, 0, "{stderr}");
        serde_json::from_str::<serde_json::Value>(stdout.trim()).unwrap()
    };
    let v = bench(&[]);
    assert!(v["sent"].as_u64().unwrap() >= 200, "{v}");
    assert_eq!(v["by_status"]["ok"], v["sent"], "{v}");
    assert_eq!(v["connection_errors"].as_array().map(Vec::len), Some(0), "{v}");
    assert_eq!(v["ids"]["groups"][3], serde_json::json!(["ip", 40000]), "{v}");
    let each = "card zipf:1, account zipf:1, device zipf:1, ip zipf:1, merchant zipf:1";
    assert_eq!(v["ids"]["group_dist"].as_str(), Some(each), "{v}");
    assert_eq!(v["ids"]["users"].as_u64(), Some(0), "no user ids were sent: {v}");
    let missing_before = server.stats().features_missing;
    let v = bench(&["--unknown-fraction", "1", "--populations", "card=1000", "--zipf", "1.2", "--seed", "5"]);
    assert_eq!(v["by_status"]["ok"], v["sent"], "{v}");
    let each = "card zipf:1.2, account zipf:1.2, device zipf:1.2, ip zipf:1.2, merchant zipf:1.2";
    assert_eq!(v["ids"]["group_dist"].as_str(), Some(each), "{v}");
    let sent = v["sent"].as_u64().unwrap();
    // Every device and IP is new: two missing rows per request.
    let s = server.wait_stats("the unknown keys counted", |s| s.features_missing >= missing_before + 2 * sent);
    assert_eq!(s.features_missing, missing_before + 2 * sent);
    // Each group's exponent apart; a group the example lacks is refused.
    let v = bench(&["--group-zipf", "device=0.5,merchant=1.5"]);
    assert_eq!(v["by_status"]["ok"], v["sent"], "{v}");
    let each = "card zipf:1, account zipf:1, device zipf:0.5, ip zipf:1, merchant zipf:1.5";
    assert_eq!(v["ids"]["group_dist"].as_str(), Some(each), "{v}");
    let (code, _, stderr) =
        run_quiver(["bench", "--addr", &server.addr, "--workload", "fraud", "--group-zipf", "user=1"]);
    assert_ne!(code, 0);
    assert!(stderr.contains("--group-zipf 'user=1': expected GROUP=VALUE"), "{stderr}");
    drop(server);

    // Run again over its own files: they are kept, not rewritten (a file is
    // written whole to a temporary name and renamed, so a rewrite would be
    // another inode, however coarse the clock's file times).
    let identity = || {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(dir.join("card.qrep")).unwrap();
        (m.ino(), m.modified().unwrap())
    };
    let before = identity();
    let (code, _, stderr) = run_quiver(["demo", "--workload", "fraud", "--data-dir", dir.to_str().unwrap()]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(identity(), before);

    // --models-dir publishes the example's model twice, for hot swaps.
    let models = dir.join("models");
    let (code, _, stderr) = run_quiver([
        "demo",
        "--workload",
        "fraud",
        "--data-dir",
        dir.to_str().unwrap(),
        "--models-dir",
        models.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{stderr}");
    for version in [1, 2] {
        let m = Model::load(&models.join(format!("fraud/{version}/model.qm"))).unwrap();
        assert_eq!((m.name.as_str(), m.version, m.input_dim()), ("fraud", version, fraud::FEATURES.len()));
    }
}

#[test]
fn the_training_set_is_the_model_input_columns_and_a_label() {
    let dir = scratch("fraud-training");
    let path = dir.join("train.csv");
    let p = path.to_str().unwrap();
    let (code, stdout, stderr) = run_quiver(["demo", "--workload", "fraud", "--training-set", p, "--rows", "5000"]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("5000 rows"), "{stdout}");
    let text = std::fs::read_to_string(&path).unwrap();
    let mut lines = text.lines();
    let header = lines.next().unwrap();
    assert_eq!(header, format!("{},label", fraud::FEATURES.join(",")));
    let rows: Vec<Vec<f32>> = lines.map(|l| l.split(',').map(|f| f.parse().unwrap()).collect()).collect();
    assert_eq!(rows.len(), 5000);
    assert!(rows.iter().all(|r| r.len() == fraud::FEATURES.len() + 1));
    let positives = rows.iter().filter(|r| r[fraud::FEATURES.len()] == 1.0).count();
    assert!((50..=300).contains(&positives), "{positives} of 5000 labelled fraud");
    // Same seed, same file; another seed, other rows.
    let again = dir.join("again.csv");
    assert_eq!(
        run_quiver(["demo", "--workload", "fraud", "--training-set", again.to_str().unwrap(), "--rows", "5000"]).0,
        0
    );
    assert_eq!(std::fs::read(&again).unwrap(), text.as_bytes());
    let (code, _, stderr) = run_quiver(["demo", "--workload", "fraud", "--training-set", p, "--rows", "0"]);
    assert!(code != 0 && stderr.contains("1..="), "{stderr}");
}

#[test]
fn the_ads_workload_is_refused_as_not_yet_built() {
    let dir = scratch("ads");
    let d = dir.to_str().unwrap();
    for args in [
        &["demo", "--workload", "auction", "--data-dir", d][..],
        &["serve", "--demo", "--workload", "auction", "--data-dir", d, "--listen", "127.0.0.1:0", "--admin", "off"][..],
        &["bench", "--workload", "auction", "--addr", "127.0.0.1:9", "--duration", "1s"][..],
    ] {
        let (code, _, stderr) = run_quiver(args);
        assert!(code != 0 && stderr.contains("not yet built"), "{args:?}: {stderr}");
    }
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "nothing was written");
    let (code, _, stderr) = run_quiver(["serve", "--workload", "fraud", "--data-dir", d]);
    assert!(code != 0 && stderr.contains("--demo"), "--workload without --demo: {stderr}");

    // The fraud demo sets its own groups: a config file's other groups are refused, not merged.
    let config = dir.join("other.toml");
    std::fs::write(&config, "[[groups]]\nname = \"card\"\nwidth = 8\n").unwrap();
    let c = config.to_str().unwrap();
    let (code, _, stderr) = run_quiver(["serve", "--demo", "--workload", "fraud", "--config", c, "--data-dir", d]);
    assert!(code != 0 && stderr.contains("drop [[groups]]"), "{stderr}");
}
