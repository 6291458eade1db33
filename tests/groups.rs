//! Feature groups through the real server and a real Redis: groups beyond
//! `user` and `item`, at request and candidate scope, first synced from
//! Redis, followed, kept across a restart and a `kill -9`, held when the
//! source comes back empty, and refused at start-up when a file or a model
//! does not fit the configured groups.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::redis::RedisServer;
use common::{scratch, Server};
use quiver::client::Client;
use quiver::features::feed::Publisher;
use quiver::features::groups::Scope;
use quiver::features::replica::KeyKind;
use quiver::model::{GroupName, InputSegment, Layer, Model, Source};
use quiver::wire::{GroupKeySpec, RequestSpec, Response, Status};

fn group(name: &str, scope: Scope) -> Source {
    Source::Group { name: GroupName::new(name).unwrap(), scope }
}

/// logit = card·(1, 2) + merchant·4 + ad·(1, -1) + context + 8·device: a
/// model whose score says exactly which rows it was given.
fn write_model(dir: &Path) {
    let model = Model {
        name: "fraud".into(),
        version: 1,
        inputs: vec![
            InputSegment { source: group("card", Scope::Request), dim: 2 },
            InputSegment { source: group("merchant", Scope::Request), dim: 1 },
            InputSegment { source: group("ad", Scope::Candidate), dim: 2 },
            InputSegment { source: Source::Context, dim: 1 },
            InputSegment { source: group("device", Scope::Request), dim: 1 },
        ],
        layers: vec![Layer::quantize(7, 1, false, vec![1.0, 2.0, 4.0, 1.0, -1.0, 1.0, 8.0], vec![0.0])],
        calibration: None,
        graph: None,
        onnx: None,
        feature_names: Vec::new(),
    };
    model.save(&dir.join("model.qm")).unwrap();
}

const GROUPS_TOML: &str = r#"
[[groups]]
name = "card"
width = 2
[[groups]]
name = "merchant"
width = 1
[[groups]]
name = "ad"
scope = "candidate"
width = 2
default = [-1.0, -1.0]
[[groups]]
name = "device"
key = "string"
key_bytes_max = 32
width = 1
"#;

fn serve(dir: &Path, redis: &RedisServer) -> Server {
    let config = dir.join("quiver.toml");
    let text = format!("{GROUPS_TOML}\n[feed]\nredis = \"{}\"\nblock_ms = 50\ncheck_interval_ms = 100\n", redis.url());
    std::fs::write(&config, text).unwrap();
    Server::start_with(dir, &["--config", config.to_str().unwrap(), "--shards", "1", "--backend", "f32"])
}

fn request(card: u64, merchant: u64, ads: &[u64], device: &str) -> RequestSpec {
    RequestSpec {
        request_id: 1,
        budget_us: 1_000_000,
        context: vec![0.5],
        groups: vec![
            ("card".into(), GroupKeySpec::Ids(vec![card])),
            ("merchant".into(), GroupKeySpec::Ids(vec![merchant])),
            ("ad".into(), GroupKeySpec::Ids(ads.to_vec())),
            ("device".into(), GroupKeySpec::Strs(vec![device.into()])),
        ],
        ..RequestSpec::default()
    }
}

fn logit(card: [f32; 2], merchant: f32, ad: [f32; 2], device: f32) -> f32 {
    card[0] + 2.0 * card[1] + 4.0 * merchant + ad[0] - ad[1] + 0.5 + 8.0 * device
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

fn assert_scores(r: &Response, want: &[f32]) {
    assert_eq!((r.status, r.error.as_str()), (Status::Ok, ""));
    assert_eq!(r.scores.len(), want.len());
    for (g, w) in r.scores.iter().zip(want) {
        assert!((g - sigmoid(*w)).abs() < 1e-5, "{:?} against logits {want:?}", r.scores);
    }
}

fn publish(redis: &RedisServer, group: &str, rows: &[(u64, Vec<f32>)]) {
    Publisher::new(redis.conn()).unwrap().put_many(group, rows, |_, _| {}).unwrap();
}

fn devices(redis: &RedisServer) -> Publisher {
    Publisher::new(redis.conn()).unwrap().with_key_kind(KeyKind::Str { bytes_max: 32 }).unwrap()
}

/// Asks until `done` holds for the answer (the refresher applies changes
/// in the background).
fn until(c: &mut Client, spec: &RequestSpec, what: &str, done: impl Fn(&Response) -> bool) -> Response {
    let deadline = Instant::now() + common::WAIT;
    loop {
        let r = c.score(spec).unwrap();
        if done(&r) {
            return r;
        }
        assert!(Instant::now() < deadline, "{what}: last answer {r:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until every score is the one `want` names: rows written one by one
/// (`features load`, a pipeline of puts) reach the replica one by one, so a
/// wait on one score says nothing of the others.
fn until_scores(c: &mut Client, spec: &RequestSpec, what: &str, want: &[f32]) -> Response {
    let r = until(c, spec, what, |r| {
        r.scores.len() == want.len() && r.scores.iter().zip(want).all(|(g, w)| (g - sigmoid(*w)).abs() < 1e-5)
    });
    assert_scores(&r, want);
    r
}

#[test]
fn every_group_is_synced_followed_and_kept_across_restarts_and_kill_9() {
    let mut redis = RedisServer::start();
    publish(&redis, "card", &[(1, vec![1.0, 0.0]), (2, vec![0.5, 0.25])]);
    publish(&redis, "merchant", &[(10, vec![0.125]), (11, vec![-0.5])]);
    publish(&redis, "ad", &[(100, vec![1.0, 0.5]), (101, vec![0.0, 2.0])]);
    devices(&redis).put_str("device", b"f7a9c2e1", &[0.25]).unwrap();
    devices(&redis).put_str("device", b"203.0.113.7", &[-0.5]).unwrap();
    let dir = scratch("groups-feed");
    write_model(&dir);
    let mut server = serve(&dir, &redis);
    for g in ["card", "merchant", "ad", "device"] {
        assert!(dir.join(format!("{g}.qrep")).exists(), "{g}: a replica file per group");
    }
    let mut c = server.client();
    let spec = request(2, 10, &[100, 101, 999], "f7a9c2e1");
    let r = c.score(&spec).unwrap();
    let want_on = |card, merchant, device| {
        [
            logit(card, merchant, [1.0, 0.5], device),
            logit(card, merchant, [0.0, 2.0], device),
            logit(card, merchant, [-1.0, -1.0], device),
        ]
    };
    let want = |card, merchant| want_on(card, merchant, 0.25);
    assert_scores(&r, &want([0.5, 0.25], 0.125));
    assert_eq!(r.features_missing, 1, "ad 999 is unknown: its group's default row");
    let other_device = request(2, 10, &[100, 101, 999], "203.0.113.7");
    assert_scores(&c.score(&other_device).unwrap(), &want_on([0.5, 0.25], 0.125, -0.5));
    let unknown_device = request(2, 10, &[100, 101, 999], "unknown");
    let r = c.score(&unknown_device).unwrap();
    assert_scores(&r, &want_on([0.5, 0.25], 0.125, 0.0));
    assert_eq!(r.features_missing, 2, "an unknown device reads the default row");

    // Follow: a change in any group reaches the next requests.
    publish(&redis, "card", &[(2, vec![2.0, 1.0])]);
    let r =
        until(&mut c, &spec, "the card update", |r| (r.scores[0] - sigmoid(want([2.0, 1.0], 0.125)[0])).abs() < 1e-5);
    assert_scores(&r, &want([2.0, 1.0], 0.125));
    Publisher::new(redis.conn()).unwrap().delete("merchant", 10).unwrap();
    let r = until(&mut c, &spec, "the merchant deletion", |r| r.features_missing == 2);
    assert_scores(&r, &want([2.0, 1.0], 0.0));
    devices(&redis).put_str("device", b"f7a9c2e1", &[0.75]).unwrap();
    let r = until(&mut c, &spec, "the device update", |r| {
        (r.scores[0] - sigmoid(want_on([2.0, 1.0], 0.0, 0.75)[0])).abs() < 1e-5
    });
    assert_scores(&r, &want_on([2.0, 1.0], 0.0, 0.75));
    devices(&redis).put_str("device", b"f7a9c2e1", &[0.25]).unwrap();
    until(&mut c, &spec, "the device back", |r| (r.scores[0] - sigmoid(want([2.0, 1.0], 0.0)[0])).abs() < 1e-5);

    // A restart serves the files at once, as they were.
    assert_eq!(server.terminate(), 0);
    let mut server = serve(&dir, &redis);
    let mut c = server.client();
    let r = c.score(&spec).unwrap();
    assert_scores(&r, &want([2.0, 1.0], 0.0));

    // kill -9, a change while down: the next start catches up from its
    // checkpoint.
    server.child.kill().unwrap();
    let _ = server.child.wait();
    publish(&redis, "merchant", &[(10, vec![1.0])]);
    devices(&redis).delete_str("device", b"203.0.113.7").unwrap();
    let server = serve(&dir, &redis);
    let mut c = server.client();
    let r = until(&mut c, &spec, "the change made while the server was down", |r| r.features_missing == 1);
    assert_scores(&r, &want([2.0, 1.0], 1.0));
    let r = until(&mut c, &other_device, "the device deleted while the server was down", |r| r.features_missing == 2);
    assert_scores(&r, &want_on([2.0, 1.0], 1.0, 0.0));

    // Redis comes back empty: every group's resync is held and the last
    // known rows keep answering.
    redis.restart();
    server.wait_stats("every group held", |s| {
        ["card", "merchant", "ad", "device"].iter().all(|g| s.feed.iter().any(|f| f.group == *g && f.resync_held))
    });
    let r = c.score(&spec).unwrap();
    assert_scores(&r, &want([2.0, 1.0], 1.0));
    assert!(r.features_stale, "held groups are flagged stale");
}

#[test]
fn a_file_or_a_model_that_does_not_fit_the_groups_is_refused_at_start_up() {
    use quiver::features::replica::ReplicaBuilder;
    let dir = scratch("groups-misfit");
    write_model(&dir);
    let build = |name: &str, dim: u32, keys: Option<u32>| {
        let mut b = ReplicaBuilder::new(name, dim);
        if let Some(k) = keys {
            b = b.str_keys(k).unwrap();
        }
        b.write(&dir.join(format!("{name}.qrep"))).unwrap();
    };
    build("card", 2, None);
    build("merchant", 1, None);
    build("ad", 2, None);
    build("device", 1, Some(32));
    let config = dir.join("quiver.toml");
    let start = |toml: &str| {
        std::fs::write(&config, toml).unwrap();
        common::run_quiver([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin",
            "off",
            "--data-dir",
            dir.to_str().unwrap(),
            "--config",
            config.to_str().unwrap(),
            "--shards",
            "1",
        ])
    };
    // The file holds u64 keys; the configuration says strings.
    let strings = GROUPS_TOML.replacen("name = \"card\"", "name = \"card\"\nkey = \"string\"", 1);
    let (code, _, err) = start(&strings);
    assert_ne!(code, 0);
    assert!(err.contains("group 'card' is configured with string keys of up to 64 bytes, its replica"), "{err}");
    // A width other than the file's.
    let (code, _, err) = start(&GROUPS_TOML.replacen("width = 1", "width = 3", 1));
    assert_ne!(code, 0);
    assert!(err.contains("group 'merchant' is configured 3 wide"), "{err}");
    // The model reads a group the configuration lacks.
    let no_merchant = GROUPS_TOML.replacen("[[groups]]\nname = \"merchant\"\nwidth = 1\n", "", 1);
    let (code, _, err) = start(&no_merchant);
    assert_ne!(code, 0);
    assert!(err.contains("reads feature group 'merchant', which this server does not serve"), "{err}");
    // ... or reads it at another scope.
    let (code, _, err) = start(&GROUPS_TOML.replacen("scope = \"candidate\"", "scope = \"request\"", 1));
    assert_ne!(code, 0);
    assert!(err.contains("reads group 'ad' once per candidate, the server keys it once per request"), "{err}");
}

/// logit = ad + 2·campaign + 4·advertiser: ads reach their campaign and its
/// advertiser only through the links in their rows.
fn write_chain_model(dir: &Path) {
    let model = Model {
        name: "auction".into(),
        version: 1,
        inputs: vec![
            InputSegment { source: group("advertiser", Scope::Candidate), dim: 1 },
            InputSegment { source: group("ad", Scope::Candidate), dim: 1 },
            InputSegment { source: group("campaign", Scope::Candidate), dim: 1 },
        ],
        layers: vec![Layer::quantize(3, 1, false, vec![4.0, 1.0, 2.0], vec![0.0])],
        calibration: None,
        graph: None,
        onnx: None,
        feature_names: Vec::new(),
    };
    model.save(&dir.join("model.qm")).unwrap();
}

const CHAIN_TOML: &str = r#"
[[groups]]
name = "ad"
scope = "candidate"
width = 1
default = [-1.0]
absent = "default"
parent = "campaign"
[[groups]]
name = "campaign"
scope = "candidate"
key = "string"
key_bytes_max = 16
width = 1
default = [-0.5]
parent = "advertiser"
[[groups]]
name = "advertiser"
scope = "candidate"
width = 1
default = [-0.25]
"#;

fn serve_chain(dir: &Path, redis: &RedisServer) -> Server {
    let config = dir.join("quiver.toml");
    let text = format!("{CHAIN_TOML}\n[feed]\nredis = \"{}\"\nblock_ms = 50\ncheck_interval_ms = 100\n", redis.url());
    std::fs::write(&config, text).unwrap();
    Server::start_with(dir, &["--config", config.to_str().unwrap(), "--shards", "1", "--backend", "f32"])
}

fn ads(ids: &[u64]) -> RequestSpec {
    RequestSpec {
        request_id: 3,
        budget_us: 1_000_000,
        groups: vec![("ad".into(), GroupKeySpec::Ids(ids.to_vec()))],
        ..RequestSpec::default()
    }
}

#[test]
fn parents_are_joined_through_links_synced_followed_and_kept_across_kill_9() {
    use quiver::features::replica::EntityKey;
    let redis = RedisServer::start();
    let mut ad = Publisher::new(redis.conn()).unwrap();
    let mut campaign = Publisher::new(redis.conn()).unwrap().with_key_kind(KeyKind::Str { bytes_max: 16 }).unwrap();
    ad.put_linked("ad", EntityKey::Id(1), &[0.25], Some(EntityKey::Str(b"spring"))).unwrap();
    ad.put_linked("ad", EntityKey::Id(2), &[0.5], Some(EntityKey::Str(b"autumn"))).unwrap();
    ad.put_linked("ad", EntityKey::Id(3), &[0.75], None).unwrap();
    campaign.put_linked("campaign", EntityKey::Str(b"spring"), &[0.125], Some(EntityKey::Id(77))).unwrap();
    campaign.put_linked("campaign", EntityKey::Str(b"autumn"), &[-0.125], Some(EntityKey::Id(78))).unwrap();
    publish(&redis, "advertiser", &[(77, vec![0.0625])]);

    let dir = scratch("groups-chain");
    write_chain_model(&dir);
    let mut server = serve_chain(&dir, &redis);
    let mut c = server.client();
    let spec = ads(&[1, 2, 3, 4]);
    let logit = |ad: f32, campaign: f32, advertiser: f32| ad + 2.0 * campaign + 4.0 * advertiser;
    let r = c.score(&spec).unwrap();
    let want_first = [
        logit(0.25, 0.125, 0.0625),
        // autumn's advertiser 78 is not there
        logit(0.5, -0.125, -0.25),
        // ad 3 names no campaign: campaign and advertiser defaults
        logit(0.75, -0.5, -0.25),
        // ad 4 is unknown: all three defaults
        logit(-1.0, -0.5, -0.25),
    ];
    assert_scores(&r, &want_first);
    assert_eq!(r.features_missing, 1 + 2 + 3);

    // Followed: ad 2 moves to spring through the CLI, then spring changes advertiser.
    let (code, out, err) = common::run_quiver([
        "features",
        "put",
        "--redis",
        &redis.url(),
        "--group",
        "ad",
        "--id",
        "2",
        "--values",
        "0.5",
        "--parent",
        "spring",
        "--parent-key-bytes",
        "16",
    ]);
    assert_eq!(code, 0, "{out}{err}");
    let moved = logit(0.5, 0.125, 0.0625);
    let r = until(&mut c, &spec, "ad 2's new campaign", |r| (r.scores[1] - sigmoid(moved)).abs() < 1e-5);
    assert_eq!(r.features_missing, 2 + 3);
    let (code, out, err) =
        common::run_quiver(["features", "get", "--admin", server.admin.as_str(), "--group", "ad", "--key", "2"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("parent: campaign \"spring\""), "{out}");
    let (code, out, _) =
        common::run_quiver(["features", "get", "--admin", server.admin.as_str(), "--group", "ad", "--key", "3"]);
    assert_eq!(code, 0);
    assert!(out.contains("parent: names no campaign"), "{out}");

    // kill -9; while down spring's advertiser becomes 78, which appears.
    server.child.kill().unwrap();
    let _ = server.child.wait();
    campaign.put_linked("campaign", EntityKey::Str(b"spring"), &[0.125], Some(EntityKey::Id(78))).unwrap();
    publish(&redis, "advertiser", &[(78, vec![0.5])]);
    let server = serve_chain(&dir, &redis);
    let mut c = server.client();
    until_scores(
        &mut c,
        &spec,
        "the changes made while the server was down",
        &[logit(0.25, 0.125, 0.5), logit(0.5, 0.125, 0.5), logit(0.75, -0.5, -0.25), logit(-1.0, -0.5, -0.25)],
    );
    // A request may not key a group that is reached through links.
    let mut named = ads(&[1]);
    named.groups.push(("campaign".into(), GroupKeySpec::Strs(vec!["spring".into()])));
    let r = c.score(&named).unwrap();
    assert_eq!(r.status, Status::BadRequest);
    assert!(r.error.contains("keyed through the links in 'ad''s rows"), "{}", r.error);

    // `features load` reads a parent column (`-`: none) and `replica build` the same file.
    let file = dir.join("ads.txt");
    std::fs::write(&file, "# ad,campaign,features\n5,autumn,0.125\n6,-,0.375\n").unwrap();
    let (code, out, err) = common::run_quiver([
        "features",
        "load",
        "--redis",
        &redis.url(),
        "--group",
        "ad",
        "--input",
        file.to_str().unwrap(),
        "--parent-key-bytes",
        "16",
    ]);
    assert_eq!(code, 0, "{out}{err}");
    let loaded = ads(&[5, 6]);
    let want = [logit(0.125, -0.125, 0.5), logit(0.375, -0.5, -0.25)];
    until_scores(&mut c, &loaded, "the loaded ads", &want);
    let built = dir.join("ad-built.qrep");
    let (code, out, err) = common::run_quiver([
        "replica",
        "build",
        "--group",
        "ad",
        "--input",
        file.to_str().unwrap(),
        "--out",
        built.to_str().unwrap(),
        "--parent-key-bytes",
        "16",
    ]);
    assert_eq!(code, 0, "{out}{err}");
    let handle = quiver::features::replica::ReplicaHandle::open(&built, "ad").unwrap();
    assert_eq!(handle.link_kind(), Some(KeyKind::Str { bytes_max: 16 }));

    // `replica sync` copies the links with the rows when told the parent's key kind.
    let copy = dir.join("ad-copy.qrep");
    let (code, out, err) = common::run_quiver([
        "replica",
        "sync",
        "--redis",
        &redis.url(),
        "--group",
        "ad",
        "--dim",
        "1",
        "--out",
        copy.to_str().unwrap(),
        "--parent-key-bytes",
        "16",
    ]);
    assert_eq!(code, 0, "{out}{err}");
    let (code, out, err) =
        common::run_quiver(["replica", "inspect", "--group", "ad", "--file", copy.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("links: each row names its parent's key (string keys of up to 16 bytes)"), "{out}");
    let handle = quiver::features::replica::ReplicaHandle::open(&copy, "ad").unwrap();
    let (mut row, mut link) = ([0.0f32], vec![0u32; handle.link_words()]);
    assert!(handle.read_linked_into(2, &[], &mut row, &mut link));
    let mut buf = [0u8; 64];
    let parent = quiver::features::replica::decode_link(&link, KeyKind::Str { bytes_max: 16 }, &mut buf);
    assert_eq!((row, parent), ([0.5], Some(EntityKey::Str(b"spring"))));
}
