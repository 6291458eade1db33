//! The model registry against a real server: latest version at start, load
//! and rollback through the admin endpoint, several models by name, hot
//! reload under load, and new versions picked up from disk.

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{demo_request, Server, INT8_SCORE_TOLERANCE};
use quiver::model::{sigmoid, Layer, Model};
use quiver::registry::{publish, ModelStatus};
use quiver::wire::{RequestSpec, Status};

/// The demo model with its output bias shifted: same inputs, other scores.
fn demo_version(version: u32, bias_shift: f32) -> Model {
    let mut m = quiver::loadgen::demo::model();
    m.version = version;
    let last = m.layers.last_mut().unwrap();
    last.bias[0] += bias_shift;
    m
}

/// A small model with the demo's inputs: 80 → 16 → 1.
fn small_model(name: &str, version: u32) -> Model {
    let mut rng = quiver::loadgen::demo::SplitMix64::new(99);
    let w1 = (0..80 * 16).map(|_| rng.normal() * 0.15).collect();
    let w2 = (0..16).map(|_| rng.normal() * 0.3).collect();
    Model {
        name: name.into(),
        version,
        inputs: quiver::loadgen::demo::model().inputs,
        layers: vec![Layer::quantize(80, 16, true, w1, vec![0.0; 16]), Layer::quantize(16, 1, false, w2, vec![0.1])],
        calibration: None,
        graph: None,
        onnx: None,
        feature_names: Vec::new(),
    }
}

fn reference(model: &Model, spec: &RequestSpec) -> Vec<f32> {
    let (x, _) = common::demo_rows(spec);
    let mut logits = vec![0.0; spec.item_ids.len()];
    model.forward_f32_reference(&x, spec.item_ids.len(), &mut logits);
    logits.into_iter().map(sigmoid).collect()
}

fn close(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() <= INT8_SCORE_TOLERANCE)
}

fn registry_dir(name: &str, models: &[Model]) -> PathBuf {
    let dir = common::scratch(name);
    for m in models {
        publish(&dir, m).unwrap();
    }
    dir
}

fn start(models: &Path, extra: &[&str]) -> Server {
    let mut args = vec!["--shards", "2", "--models-dir", models.to_str().unwrap()];
    args.extend_from_slice(extra);
    Server::start(&args)
}

fn post(url: &str) -> (u16, String) {
    common::http_post(url)
}

fn models(server: &Server) -> Vec<ModelStatus> {
    let agent: ureq::Agent = ureq::Agent::config_builder().build().into();
    let body =
        agent.get(&format!("http://{}/models", server.admin)).call().unwrap().body_mut().read_to_string().unwrap();
    serde_json::from_str(&body).unwrap()
}

#[test]
fn latest_version_serves_then_load_and_rollback() {
    let v1 = demo_version(1, 0.0);
    let v2 = demo_version(2, 1.5);
    let dir = registry_dir("reg-versions", &[v1.clone(), v2.clone()]);
    let server = start(&dir, &[]);
    let mut c = server.client();
    let spec = demo_request(1, 42, (0..32).collect());
    let r = c.score(&spec).unwrap();
    assert_eq!((r.status, r.model_version), (Status::Ok, 2));
    assert!(close(&r.scores, &reference(&v2, &spec)));
    assert!(!close(&r.scores, &reference(&v1, &spec)), "the versions must be distinguishable");

    let admin = &server.admin;
    assert_eq!(post(&format!("http://{admin}/models/auction-32/load?version=1")), (200, "{\"version\":1}".into()));
    let r = c.score(&spec).unwrap();
    assert_eq!(r.model_version, 1);
    assert!(close(&r.scores, &reference(&v1, &spec)));
    assert_eq!(
        models(&server),
        vec![ModelStatus {
            name: "auction-32".into(),
            version: 1,
            previous: Some(2),
            on_disk: vec![1, 2],
            canary: None,
            shadow: None,
            features: v1.feature_names(),
        }]
    );
    assert!(v1.feature_names().len() == v1.input_dim() && v1.feature_names()[0].ends_with("[0]"));

    assert_eq!(post(&format!("http://{admin}/models/auction-32/rollback")).0, 200);
    assert_eq!(c.score(&spec).unwrap().model_version, 2);
    assert_eq!(post(&format!("http://{admin}/models/auction-32/rollback")).0, 200);
    assert_eq!(c.score(&spec).unwrap().model_version, 1);

    let (code, body) = post(&format!("http://{admin}/models/auction-32/load?version=9"));
    assert_eq!(code, 404, "{body}");
    assert!(body.contains("no version 9"), "{body}");
    assert_eq!(post(&format!("http://{admin}/models/nope/rollback")).0, 404);
    assert_eq!(post(&format!("http://{admin}/models/auction-32/load?version=x")).0, 400);
    assert_eq!(c.score(&spec).unwrap().model_version, 1, "failed loads change nothing");
}

#[test]
fn models_are_served_side_by_side_by_name() {
    let big = demo_version(1, 0.0);
    let small = small_model("small", 3);
    let dir = registry_dir("reg-names", &[big.clone(), small.clone()]);
    let server = start(&dir, &[]);
    let mut c = server.client();
    let mut spec = demo_request(1, 7, (100..132).collect());
    let r = c.score(&spec).unwrap();
    assert_eq!(r.model_version, 1, "no name: the default model (first name)");
    assert!(close(&r.scores, &reference(&big, &spec)));
    spec.model = "small".into();
    let r = c.score(&spec).unwrap();
    assert_eq!((r.status, r.model_version), (Status::Ok, 3));
    assert!(close(&r.scores, &reference(&small, &spec)));
    spec.model = "auction-32".into();
    assert_eq!(c.score(&spec).unwrap().model_version, 1);
    spec.model = "other".into();
    assert_eq!(c.score(&spec).unwrap().status, Status::ModelNotFound);
}

#[test]
fn hot_reload_under_load_never_fails_or_mixes_versions() {
    let v1 = demo_version(1, 0.0);
    let v2 = demo_version(2, 1.5);
    let dir = registry_dir("reg-hot", &[v1.clone(), v2.clone()]);
    let server = start(&dir, &[]);
    let stop = AtomicBool::new(false);
    let answered = std::sync::atomic::AtomicU64::new(0);
    let specs: Vec<RequestSpec> = (0..64u64).map(|i| demo_request(i, i * 31, (i..i + 32).collect())).collect();
    let want: Vec<[Vec<f32>; 2]> = specs.iter().map(|s| [reference(&v1, s), reference(&v2, s)]).collect();
    let (seen, worst) = std::thread::scope(|s| {
        let load = s.spawn(|| {
            let mut c = server.client();
            let mut seen = [0u64; 3];
            let mut worst = Duration::ZERO;
            let mut id = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let k = (id % 64) as usize;
                let mut spec = specs[k].clone();
                spec.request_id = id;
                let started = Instant::now();
                let r = c.score(&spec).unwrap();
                worst = worst.max(started.elapsed());
                assert_eq!(r.status, Status::Ok, "request {id} failed during reload");
                let v = r.model_version as usize;
                assert!(v == 1 || v == 2);
                assert!(close(&r.scores, &want[k][v - 1]), "request {id}: scores are not version {v}'s");
                seen[v] += 1;
                id += 1;
                answered.store(id, Ordering::Relaxed);
            }
            (seen, worst)
        });
        // Each reload comes once answers have gone on since the last, so
        // every version served answers some, however slow the machine.
        let progressed = |since: u64| {
            let until = Instant::now() + common::WAIT;
            loop {
                let now = answered.load(Ordering::Relaxed);
                if now >= since + 20 {
                    return now;
                }
                assert!(Instant::now() < until, "answers stalled at {now}");
                std::thread::sleep(Duration::from_millis(2));
            }
        };
        let mut at = progressed(0);
        for round in 0..10 {
            let (code, body) =
                post(&format!("http://{}/models/auction-32/load?version={}", server.admin, 1 + round % 2));
            assert_eq!(code, 200, "{body}");
            at = progressed(at);
        }
        stop.store(true, Ordering::Relaxed);
        load.join().unwrap()
    });
    eprintln!("hot reload: {} v1 and {} v2 responses, slowest {worst:?}", seen[1], seen[2]);
    assert!(seen[1] > 0 && seen[2] > 0, "{seen:?}");
    // What would stall a request is a swap that builds its backend on the
    // shard: every reload's was built on the admin side, so each shard
    // built only what it served at start (the model and the demo's
    // fallback). A clock bound on the slowest answer would measure the
    // machine as much as the server; this one is only against a hang.
    let shards = 2;
    server.wait_stats("every answer published", |s| s.requests >= seen[1] + seen[2]);
    // A shard no connection reached publishes its start-up builds on its
    // own schedule: wait for every shard's, then ask for no more.
    server.wait_metric("quiver_backends_built_on_shard_total", 2 * shards);
    assert_eq!(server.metric("quiver_backends_built_on_shard_total"), 2 * shards, "a reload built on a shard");
    assert!(worst < common::WAIT, "a reload stalled a request for {worst:?}");
}

#[test]
fn new_versions_on_disk_are_picked_up() {
    let dir = registry_dir("reg-watch", &[demo_version(1, 0.0)]);
    let cfg = common::scratch("reg-watch-cfg").join("q.toml");
    std::fs::write(&cfg, "watch_models_ms = 50\n").unwrap();
    let server = start(&dir, &["--config", cfg.to_str().unwrap()]);
    let mut c = server.client();
    let spec = demo_request(1, 1, vec![1, 2, 3]);
    assert_eq!(c.score(&spec).unwrap().model_version, 1);
    publish(&dir, &demo_version(2, 1.0)).unwrap();
    let until = Instant::now() + common::WAIT;
    while c.score(&spec).unwrap().model_version != 2 {
        assert!(Instant::now() < until, "version 2 was never picked up");
        std::thread::sleep(Duration::from_millis(20));
    }
    // A broken newer version is refused and the served one stays.
    let bad = dir.join("auction-32").join("3");
    std::fs::create_dir_all(&bad).unwrap();
    let logged = server.stderr().len();
    std::fs::write(bad.join("model.qm"), b"not a model").unwrap();
    let until = Instant::now() + common::WAIT;
    while !server.stderr()[logged..].contains("new version not loaded") {
        assert!(Instant::now() < until, "the broken version was never refused: {}", server.stderr());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(c.score(&spec).unwrap().model_version, 2);
    // A version directory still being copied (half its file) is refused,
    // then loads once the copy is complete: no restart needed.
    let v3 = demo_version(3, 2.0).to_bytes();
    let logged = server.stderr().len();
    std::fs::write(bad.join("model.qm"), &v3[..v3.len() / 2]).unwrap();
    let until = Instant::now() + common::WAIT;
    while !server.stderr()[logged..].contains("new version not loaded") {
        assert!(Instant::now() < until, "the half-copied version was never refused: {}", server.stderr());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(c.score(&spec).unwrap().model_version, 2);
    std::fs::write(bad.join("model.qm"), &v3).unwrap();
    let until = Instant::now() + common::WAIT;
    while c.score(&spec).unwrap().model_version != 3 {
        assert!(Instant::now() < until, "version 3 was never picked up once complete: {}", server.stderr());
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_served_model_file_rewritten_in_place_or_damaged_is_harmless() {
    let v1 = demo_version(1, 0.0);
    let dir = registry_dir("reg-in-place", &[v1.clone(), demo_version(2, 1.0)]);
    let mut server = start(&dir, &[]);
    let admin = server.admin.clone();
    assert_eq!(post(&format!("http://{admin}/models/auction-32/load?version=1")).0, 200);
    let mut c = server.client();
    let spec = demo_request(1, 1, vec![1, 2, 3]);
    let before = c.score(&spec).unwrap();
    assert_eq!(before.model_version, 1);
    // `cp other.qm served.qm`: truncated and rewritten in place, then cut to
    // nothing. A mapped file would raise SIGBUS in every shard.
    let served = dir.join("auction-32").join("1").join("model.qm");
    std::fs::write(&served, demo_version(9, 3.0).to_bytes()).unwrap();
    std::fs::File::create(&served).unwrap().set_len(0).unwrap();
    for i in 0..200 {
        let r = c.score(&demo_request(i, i, vec![1, 2, 3])).unwrap();
        assert_eq!((r.status, r.model_version), (Status::Ok, 1));
    }
    assert_eq!(c.score(&spec).unwrap().scores, before.scores);
    assert!(server.is_running());
    // A flipped bit on disk is refused at load, naming the checksum.
    let v2 = dir.join("auction-32").join("2").join("model.qm");
    let mut bytes = std::fs::read(&v2).unwrap();
    let at = bytes.len() / 3;
    bytes[at] ^= 0x04;
    std::fs::write(&v2, &bytes).unwrap();
    let (code, body) = post(&format!("http://{admin}/models/auction-32/load?version=2"));
    assert_eq!(code, 422, "{body}");
    assert!(body.contains("checksum mismatch"), "{body}");
    assert_eq!(c.score(&spec).unwrap().model_version, 1);
}

#[test]
fn a_canary_serves_a_sticky_fraction_of_users_with_its_own_metrics() {
    let v1 = demo_version(1, 0.0);
    let v2 = demo_version(2, 1.5);
    let dir = registry_dir("reg-canary", &[v1.clone(), v2.clone()]);
    let server = start(&dir, &[]);
    let admin = &server.admin;
    assert_eq!(post(&format!("http://{admin}/models/auction-32/load?version=1")).0, 200);
    assert_eq!(
        post(&format!("http://{admin}/models/auction-32/canary?version=2&fraction=0.1")),
        (200, "{\"version\":2}".into())
    );
    assert_eq!(models(&server)[0].canary, Some((2, 0.1)));

    // 10,000 users: about 10% on the candidate, each user on one side only.
    let mut c = server.client();
    let mut specs: Vec<RequestSpec> = (0..10_000u64).map(|u| demo_request(u, u * 7 + 3, vec![u % 10_000])).collect();
    let first = c.pipeline(&specs, 256).unwrap();
    let on_canary = first.iter().filter(|r| r.model_version == 2).count();
    assert!((800..=1_200).contains(&on_canary), "{on_canary} of 10000 users on the canary (10% ± 2%)");
    for (i, s) in specs.iter_mut().enumerate() {
        s.request_id = 20_000 + i as u64;
    }
    let again = c.pipeline(&specs, 256).unwrap();
    for (a, b) in first.iter().zip(&again) {
        assert_eq!(a.model_version, b.model_version, "a user stays on one side");
    }
    // The canary's scores are the candidate's.
    let k = first.iter().position(|r| r.model_version == 2).unwrap();
    assert!(close(&first[k].scores, &reference(&v2, &specs[k])));

    // Per-version metrics are kept apart.
    let agent: ureq::Agent = ureq::Agent::config_builder().build().into();
    let until = Instant::now() + common::WAIT;
    loop {
        let body =
            agent.get(&format!("http://{admin}/stats.json")).call().unwrap().body_mut().read_to_string().unwrap();
        let stats: quiver::admin::Stats = serde_json::from_str(&body).unwrap();
        let canary = stats.by_version.get("auction-32@2+canary").copied().unwrap_or(0);
        let current = stats.by_version.get("auction-32@1").copied().unwrap_or(0);
        if canary + current == 20_000 {
            assert_eq!(canary, 2 * on_canary as u64);
            break;
        }
        assert!(Instant::now() < until, "{:?}", stats.by_version);
        std::thread::sleep(Duration::from_millis(100));
    }
    // Ending the canary sends everyone back to the current version.
    assert_eq!(post(&format!("http://{admin}/models/auction-32/canary?fraction=0")).0, 200);
    let r = c.score(&specs[k]).unwrap();
    assert_eq!(r.model_version, 1);
    assert_eq!(post(&format!("http://{admin}/models/auction-32/canary?version=2&fraction=1.5")).0, 400);
}

#[test]
fn a_shadow_version_is_compared_but_never_returned() {
    shadow_scenario("reg-shadow", &[]);
}

/// With the primary on the inference thread, the shadow still runs on the
/// shard after the response is written.
#[test]
fn a_shadow_version_is_compared_in_thread_mode_too() {
    shadow_scenario("reg-shadow-thread", &["--inference", "thread"]);
}

fn shadow_scenario(name: &str, extra: &[&str]) {
    let v1 = demo_version(1, 0.0);
    let v2 = demo_version(2, 1.5);
    let dir = registry_dir(name, &[v1.clone(), v2.clone()]);
    let server = start(&dir, extra);
    let admin = &server.admin;
    assert_eq!(post(&format!("http://{admin}/models/auction-32/load?version=1")).0, 200);
    assert_eq!(post(&format!("http://{admin}/models/auction-32/shadow?version=2&fraction=1")).0, 200);
    assert_eq!(models(&server)[0].shadow, Some((2, 1.0)));
    let mut c = server.client();
    for i in 0..200u64 {
        let spec = demo_request(i, i * 13, (0..32).map(|k| (i + k * 17) % 10_000).collect());
        let r = c.score(&spec).unwrap();
        assert_eq!((r.tier, r.model_version), (quiver::wire::Tier::Primary, 1), "shadow scores are never returned");
        assert!(close(&r.scores, &reference(&v1, &spec)));
    }
    let agent: ureq::Agent = ureq::Agent::config_builder().build().into();
    let until = Instant::now() + common::WAIT;
    let stats = loop {
        let body =
            agent.get(&format!("http://{admin}/stats.json")).call().unwrap().body_mut().read_to_string().unwrap();
        let stats: quiver::admin::Stats = serde_json::from_str(&body).unwrap();
        if stats.requests == 200 && stats.shadow_requests > 0 {
            break stats;
        }
        assert!(Instant::now() < until, "{stats:?}");
        std::thread::sleep(Duration::from_millis(100));
    };
    // Sequential requests leave time after every write: all are shadowed.
    assert_eq!(stats.shadow_requests, 200);
    // v2 only shifts the output bias: scores move, their order does not.
    assert!(stats.shadow_mean_abs_diff > 0.05, "{stats:?}");
    assert!(stats.shadow_rank_correlation > 0.99, "{stats:?}");
    assert!(stats.stages.iter().any(|s| s.stage == "shadow" && s.count > 0), "{stats:?}");
    assert_eq!(post(&format!("http://{admin}/models/auction-32/shadow?fraction=0")).0, 200);
    assert_eq!(models(&server)[0].shadow, None);
}

#[test]
fn the_score_cache_never_answers_across_a_version_change() {
    use quiver::wire::Tier;
    let dir = registry_dir("reg-cache", &[demo_version(1, 0.0), demo_version(2, 1.5)]);
    let cfg = common::scratch("reg-cache-cfg").join("q.toml");
    std::fs::write(&cfg, "[cache]\nbefore_primary = true\n").unwrap();
    let server = start(&dir, &["--config", cfg.to_str().unwrap()]);
    let mut c = server.client();
    let spec = demo_request(1, 42, (0..32).collect());
    assert_eq!(c.score(&spec).unwrap().tier, Tier::Primary);
    let cached = c.score(&spec).unwrap();
    assert_eq!((cached.tier, cached.model_version), (Tier::Cached, 2));
    assert_eq!(post(&format!("http://{}/models/auction-32/load?version=1", server.admin)).0, 200);
    let after = c.score(&spec).unwrap();
    assert_eq!((after.tier, after.model_version), (Tier::Primary, 1), "version 2's cached scores are not served");
}
