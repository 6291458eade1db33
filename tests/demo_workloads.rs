//! The fraud worked example end to end: the committed LightGBM model
//! imported by the library against LightGBM's own probabilities, `quiver demo
//! --workload fraud` writing its files and config, `quiver serve --demo
//! --workload fraud` scoring transactions over five groups (two keyed by
//! strings) exactly as the generator's rows and the model say, unknown and
//! absent keys answered as the groups' policies say, `quiver bench
//! --workload fraud` driving it without an error; and the auction example
//! the same way: `quiver demo --workload auction` writing its six linked
//! replicas, `quiver serve --demo --workload auction` joining each ad's
//! campaign and advertiser through the replicas' links exactly as the
//! generator's tables say, and `quiver bench --workload auction` driving it.

mod common;

use common::{run_quiver, scratch, Server};
use quiver::features::replica::Replica;
use quiver::loadgen::auction::{self, Auction};
use quiver::loadgen::demo::SplitMix64;
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

/// The f32 reference probabilities of `rows` model input rows.
fn reference_scores(model: &Model, x: &[f32]) -> Vec<f32> {
    let rows = x.len() / model.input_dim();
    let mut out = vec![0.0f32; rows];
    model.forward_f32_reference(x, rows, &mut out);
    out.into_iter().map(|y| model.score(y)).collect()
}

/// Served by the f32 backend against the f32 reference: the same sums in
/// another order.
const MLP_TOLERANCE: f32 = 1e-5;

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    let worst = got.iter().zip(want).map(|(g, w)| (g - w).abs()).fold(0.0, f32::max);
    assert!(worst <= MLP_TOLERANCE, "{what}: scores differ from the reference by up to {worst}");
}

#[test]
fn demo_writes_the_auction_example_and_serve_demo_joins_each_ads_campaign_and_advertiser() {
    let dir = scratch("auction");
    let d = dir.to_str().unwrap();
    let (code, stdout, stderr) = run_quiver(["demo", "--workload", "auction", "--data-dir", d]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("--workload auction"), "{stdout}");
    for (g, name) in auction::GROUPS.iter().enumerate() {
        let r = Replica::open(&dir.join(format!("{name}.qrep")), name).unwrap();
        assert_eq!((r.dim(), r.header().row_count), (auction::WIDTHS[g] as usize, auction::POPULATIONS[g]), "{name}");
        assert_eq!(r.link_kind().is_some(), auction::PARENTS[g].is_some(), "{name}");
        // What `Tables::features` reads for an unknown entity.
        assert!(r.default_vector().iter().all(|&v| v == 0.0), "{name}");
    }
    let config = quiver::config::Config::load(&dir.join("quiver.toml")).unwrap();
    assert_eq!(config.groups, auction::groups());
    assert_eq!((config.data_dir.as_path(), config.canary_group.as_str()), (dir.as_path(), auction::CANARY_GROUP));
    let model = Model::load(&dir.join("model.qm")).unwrap();
    assert_eq!(model, auction::model());

    // `serve --demo` builds the example itself in a directory with nothing
    // in it; the f32 backend, so scores compare closely with the reference.
    let served = scratch("auction-served");
    let server = Server::start_with(&served, &["--demo", "--workload", "auction", "--shards", "1", "--backend", "f32"]);
    assert_eq!(Model::load(&served.join("model.qm")).unwrap(), model);
    let mut client = server.client();
    let tables = auction::Tables::generate();
    let mut rng = SplitMix64::new(17);
    let (mut scored, mut moved) = (0, 0);
    for n in 1..=20 {
        let a = Auction {
            user: rng.below(auction::POPULATIONS[0]),
            device: rng.below(auction::POPULATIONS[1]),
            publisher: rng.below(auction::POPULATIONS[2]),
            ads: (0..auction::CANDIDATES).map(|_| rng.below(auction::POPULATIONS[3])).collect(),
        };
        let mut spec = a.request(n);
        spec.budget_us = 2_000_000;
        let r = client.score(&spec).unwrap();
        assert_eq!((r.status, r.features_missing, r.scores.len()), (Status::Ok, 0, auction::CANDIDATES), "{r:?}");
        let (x, missing) = tables.features(&a);
        assert_eq!(missing, 0);
        assert_close(&r.scores, &reference_scores(&model, &x), &format!("auction {a:?}"));
        // Had the server not followed the links, each ad's campaign and
        // advertiser would read their default rows: scores far from these.
        let mut unlinked = x.clone();
        for row in unlinked.chunks_exact_mut(auction::ROW_DIM) {
            row[auction::offset(4)..].fill(0.0);
        }
        let ignored = reference_scores(&model, &unlinked);
        scored += r.scores.len();
        moved += r.scores.iter().zip(&ignored).filter(|(g, w)| (*g - *w).abs() > 1e-3).count();
    }
    assert!(moved * 10 >= scored * 9, "only {moved} of {scored} scores depend on the campaign and advertiser rows");

    // One advertiser's row changed and the server started again over the
    // files (`serve --demo` keeps files of the right shape): every ad of its
    // campaigns scores otherwise, the other advertisers' ads do not.
    let advertiser = tables.campaign_advertiser[tables.ad_campaign[0] as usize];
    let ads_of = |adv: u64| -> Vec<u64> {
        (0..auction::POPULATIONS[3])
            .filter(|&ad| tables.campaign_advertiser[tables.ad_campaign[ad as usize] as usize] == adv)
            .take(4)
            .collect()
    };
    let mine = ads_of(advertiser);
    let other = ads_of((advertiser + 1) % auction::POPULATIONS[5]);
    assert!(mine.len() == 4 && other.len() == 4);
    let a = Auction { user: 1, device: 2, publisher: 3, ads: [mine.clone(), other].concat() };
    let mut spec = a.request(50);
    spec.budget_us = 2_000_000;
    let before = client.score(&spec).unwrap();
    drop(client);
    drop(server);
    let mut changed = tables.clone();
    let w = auction::WIDTHS[5] as usize;
    let at = advertiser as usize * w;
    changed.rows[5][at..at + w].iter_mut().for_each(|v| *v += 2.0);
    let mut b = quiver::features::replica::ReplicaBuilder::new("advertiser", w as u32);
    for (i, row) in changed.rows[5].chunks_exact(w).enumerate() {
        b.push(i as u64, row).unwrap();
    }
    b.write(&served.join("advertiser.qrep")).unwrap();
    let server = Server::start_with(&served, &["--demo", "--workload", "auction", "--shards", "1", "--backend", "f32"]);
    let mut client = server.client();
    let after = client.score(&spec).unwrap();
    assert_eq!((after.status, after.features_missing), (Status::Ok, 0), "{after:?}");
    assert_close(&after.scores, &reference_scores(&model, &changed.features(&a).0), "after the advertiser changed");
    let n = mine.len();
    assert!(after.scores[..n].iter().zip(&before.scores).all(|(a, b)| (a - b).abs() > 1e-4), "{after:?}");
    assert_eq!(after.scores[n..], before.scores[n..], "other advertisers' ads are unchanged");

    // An unknown ad: its row, its campaign's and its advertiser's are the
    // defaults, three rows missing; an unknown device is one more.
    let a = Auction { user: 5, device: 6, publisher: 7, ads: vec![10, 1_000_000_000, 11] };
    let mut spec = a.request(100);
    spec.budget_us = 2_000_000;
    let r = client.score(&spec).unwrap();
    let (x, missing) = changed.features(&a);
    assert_eq!((r.status, r.features_missing, missing), (Status::Ok, 3, 3), "{r:?}");
    assert_close(&r.scores, &reference_scores(&model, &x), "an unknown ad");
    let unknown = "0123456789abcdef";
    assert!((0..auction::POPULATIONS[1]).all(|i| auction::device_key(i) != unknown));
    spec.groups[1].1 = GroupKeySpec::Strs(vec![unknown.into()]);
    spec.request_id = 101;
    let r = client.score(&spec).unwrap();
    assert_eq!((r.status, r.features_missing), (Status::Ok, 4), "{r:?}");

    // A request without its ads is refused by name; one naming a campaign
    // too, since campaigns are reached through the ads' links.
    let mut no_ads = a.request(102);
    no_ads.groups.retain(|(g, _)| g != "ad");
    let r = client.score(&no_ads).unwrap();
    assert_eq!(r.status, Status::BadRequest, "{r:?}");
    let mut campaigns = a.request(103);
    campaigns.groups.push(("campaign".into(), GroupKeySpec::Ids(vec![1, 2, 3])));
    let r = client.score(&campaigns).unwrap();
    assert_eq!(r.status, Status::BadRequest, "{r:?}");
    assert!(r.error.contains("keyed through the links in 'ad''s rows"), "{}", r.error);

    // The README's command line: `quiver score` with the keyed groups' keys.
    let a = Auction { user: 42, device: 7, publisher: 5, ads: vec![1, 2, 3] };
    assert_eq!(auction::device_key(7), "1a5122783edfaa43");
    let (code, stdout, stderr) = run_quiver([
        "score",
        "--addr",
        &server.addr,
        "--json",
        "--key",
        "user=42",
        "--str-key",
        "device=1a5122783edfaa43",
        "--key",
        "publisher=5",
        "--key",
        "ad=1,2,3",
    ]);
    assert_eq!(code, 0, "{stdout} {stderr}");
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!((v["status"].as_str(), v["features_missing"].as_u64()), (Some("ok"), Some(0)), "{v}");
    let got: Vec<f32> = v["scores"].as_array().unwrap().iter().map(|s| s.as_f64().unwrap() as f32).collect();
    assert_close(&got, &reference_scores(&model, &changed.features(&a).0), "quiver score");

    // A short bounded load of auctions: every answer Ok.
    let bench = |extra: &[&str]| {
        let mut args = vec!["bench", "--addr", &server.addr, "--workload", "auction", "--duration", "1s"];
        args.extend_from_slice(&["--rate", "300", "--connections", "1", "--budget-us", "2000000", "--json"]);
        args.extend_from_slice(extra);
        let (code, stdout, stderr) = run_quiver(&args);
        assert_eq!(code, 0, "{stderr}");
        serde_json::from_str::<serde_json::Value>(stdout.trim()).unwrap()
    };
    // The server counts missing rows per second: the two requests above, 3 + 4.
    let missing_before = server.wait_stats("the unknown ad and device counted", |s| s.features_missing >= 7);
    let missing_before = missing_before.features_missing;
    assert_eq!(missing_before, 7);
    let v = bench(&[]);
    assert!(v["sent"].as_u64().unwrap() >= 200, "{v}");
    assert_eq!(v["by_status"]["ok"], v["sent"], "{v}");
    assert_eq!(v["connection_errors"].as_array().map(Vec::len), Some(0), "{v}");
    assert_eq!(v["ids"]["groups"][3], serde_json::json!(["ad", 20000]), "{v}");
    let each = "user zipf:1, device zipf:1, publisher zipf:1, ad zipf:1";
    assert_eq!(v["ids"]["group_dist"].as_str(), Some(each), "{v}");
    let v =
        bench(&["--unknown-fraction", "1", "--populations", "ad=1000", "--group-zipf", "ad=1.2", "--candidates", "8"]);
    assert_eq!(v["by_status"]["ok"], v["sent"], "{v}");
    let each = "user zipf:1, device zipf:1, publisher zipf:1, ad zipf:1.2";
    assert_eq!(v["ids"]["group_dist"].as_str(), Some(each), "{v}");
    let sent = v["sent"].as_u64().unwrap();
    // Every device and ad is new: the device, and each ad's three rows; the
    // first run's known keys none (the count is exact).
    let want = missing_before + sent * (1 + 8 * 3);
    let s = server.wait_stats("the unknown keys counted", |s| s.features_missing >= want);
    assert_eq!(s.features_missing, want);
    let (code, _, stderr) =
        run_quiver(["bench", "--addr", &server.addr, "--workload", "auction", "--populations", "campaign=5"]);
    assert_ne!(code, 0);
    assert!(stderr.contains("GROUP one of user, device, publisher, ad"), "{stderr}");
    drop(server);

    // Run again over its own files: they are kept, not rewritten.
    let identity = || {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(dir.join("ad.qrep")).unwrap();
        (m.ino(), m.modified().unwrap())
    };
    let before = identity();
    let (code, _, stderr) = run_quiver(["demo", "--workload", "auction", "--data-dir", d]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(identity(), before);
}

#[test]
fn a_demo_workload_needs_demo_and_brings_its_own_groups() {
    let dir = scratch("workload-flags");
    let d = dir.to_str().unwrap();
    let (code, _, stderr) = run_quiver(["serve", "--workload", "fraud", "--data-dir", d]);
    assert!(code != 0 && stderr.contains("--demo"), "--workload without --demo: {stderr}");

    // The fraud and auction demos set their own groups: a config file's
    // other groups are refused, not merged.
    let config = dir.join("other.toml");
    std::fs::write(&config, "[[groups]]\nname = \"card\"\nwidth = 8\n").unwrap();
    let c = config.to_str().unwrap();
    for w in ["fraud", "auction"] {
        let (code, _, stderr) = run_quiver(["serve", "--demo", "--workload", w, "--config", c, "--data-dir", d]);
        assert!(code != 0 && stderr.contains("drop [[groups]]"), "{w}: {stderr}");
    }
}
