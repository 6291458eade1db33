//! Feast parity, against real Feast and a real Redis: bench/feast/feast_repo.py
//! builds the test repository (pinned feast, 10,000 users, 5,000 items,
//! 1,000 merchants and 10,000 (user, merchant) pairs over five views of 100
//! features, one keyed by the pair: a composite key) and materializes it into
//! a redis-server this test started; a server with `[feast]` copies it at
//! start-up, and for every entity of every view the row it serves (its
//! admin route, and `quiver features get` for a sample) equals what
//! `FeatureStore.get_online_features` returns converted to f32, value for
//! value, missing for missing. A restart resumes from the files without a
//! copy; bad data written while it follows Redis is skipped and counted per
//! view, and an emptied Redis leaves the files as they were (held, exit 3).
//! Freshness (1,000 users): `feast materialize-incremental` and pushes (to a
//! single-entity view and to the composite one) are served within a deadline, a row past its view's ttl is missing, a change
//! and deletions no notification announced are caught up after Redis
//! restarts (the reconciliation's SCAN and its sweep of the replica's rows,
//! in rounds bounded by `reconcile_keys_max`), `quiver feast sync` refuses
//! to replace files the follower writes, a burst of deletions is held, and
//! a Redis that refuses CONFIG fails start-up naming
//! `notify-keyspace-events`. A model (LightGBM trained on the offline
//! store's features) served on the views scores what LightGBM predicts on
//! `get_online_features`' values, and `features_missing` counts each row
//! with a null.
//!
//! The same repository on a Redis Cluster (`redis_type: redis_cluster`) is
//! served value for value and followed through a master's failover.
//!
//! Feast lives in its own virtual environment (its pins clash with other
//! Python tools the tests use): `QUIVER_FEAST_VENV` names it, and the script
//! installs the pinned feast there when it is missing. CI makes it and sets
//! `QUIVER_REQUIRE_FEAST=1`, so there the test fails, not skips, without it.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::redis::RedisServer;
use common::redis_cluster::RedisCluster;
use common::{demo_dir, http_get, run_quiver, Server};
use quiver::features::replica::ReplicaHandle;

const USERS: usize = 10_000;

/// The longest each Python step (install, build and materialize, read
/// back) may take.
const PYTHON_STEP_MAX: Duration = Duration::from_secs(600);

/// The virtual environment with feast, or `None` (the test is skipped) when
/// none is named and CI does not require it.
fn feast_venv() -> Option<PathBuf> {
    let required = std::env::var("QUIVER_REQUIRE_FEAST").is_ok_and(|v| v == "1");
    match std::env::var_os("QUIVER_FEAST_VENV") {
        Some(dir) => Some(PathBuf::from(dir)),
        None => {
            assert!(!required, "QUIVER_REQUIRE_FEAST=1 but QUIVER_FEAST_VENV names no virtual environment");
            eprintln!(
                "SKIPPED the Feast parity test: set QUIVER_FEAST_VENV=DIR (bench/feast/feast_repo.py venv --venv DIR \
                 installs feast there)"
            );
            None
        }
    }
}

/// Runs bench/feast/feast_repo.py with `args`, its output into `log`,
/// failing the test with that output if it fails or outlives
/// [`PYTHON_STEP_MAX`].
fn feast_repo(log: &Path, args: &[&str]) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/feast/feast_repo.py");
    let out = std::fs::File::create(log).unwrap();
    let mut child = Command::new("python3")
        .arg(&script)
        .args(args)
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .stdin(Stdio::null())
        .spawn()
        .expect("python3 starts");
    let began = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if began.elapsed() > PYTHON_STEP_MAX {
            let _ = child.kill();
            let _ = child.wait();
            panic!("feast_repo.py {args:?} ran past {PYTHON_STEP_MAX:?}: {}", std::fs::read_to_string(log).unwrap());
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(status.success(), "feast_repo.py {args:?} failed: {}", std::fs::read_to_string(log).unwrap());
}

/// What `get_online_features` returned: per view, its join key, features
/// and each entity's row (None: missing).
struct Expected {
    views: Vec<ExpectedView>,
}

/// One view's answer: its name, features, and each entity's row by the
/// key's text.
struct ExpectedView(String, Vec<String>, HashMap<String, Vec<Option<f32>>>);

fn expected(path: &Path) -> Expected {
    let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut views = Vec::new();
    for (name, v) in doc["views"].as_object().unwrap() {
        let features: Vec<String> =
            v["features"].as_array().unwrap().iter().map(|f| f.as_str().unwrap().to_string()).collect();
        let rows = v["rows"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, row)| {
                let row = row.as_array().unwrap().iter().map(|x| x.as_f64().map(|x| x as f32)).collect();
                (k.clone(), row)
            })
            .collect();
        views.push(ExpectedView(name.clone(), features, rows));
    }
    Expected { views }
}

fn encode(key: &str) -> String {
    key.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                char::from(b).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// The row served for `key`, as JSON numbers and nulls, and whether it was found.
fn served_row(admin: &str, view: &str, key: &str) -> (bool, Vec<Option<f32>>) {
    let (code, body) = http_get(&format!("http://{admin}/features/{view}?key={}", encode(key)));
    assert_eq!(code, 200, "{view} {key}: {body}");
    let row: serde_json::Value = serde_json::from_str(&body).unwrap();
    let values = row["row"].as_array().unwrap().iter().map(|x| x.as_f64().map(|x| x as f32)).collect();
    (row["found"].as_bool().unwrap(), values)
}

/// Same as `a`, value for value (bit for bit as f32), missing for missing.
fn same(a: &[Option<f32>], b: &[Option<f32>]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| match (x, y) {
            (Some(x), Some(y)) => x.to_bits() == y.to_bits(),
            (None, None) => true,
            _ => false,
        })
}

fn rows_in(path: &Path, group: &str) -> u64 {
    ReplicaHandle::open(path, group).unwrap().live_rows()
}

/// A repository built, materialized and served, checked value for value.
#[allow(dead_code)]
struct Served {
    venv: String,
    redis: RedisServer,
    repo: PathBuf,
    data: PathBuf,
    config: PathBuf,
    want: Expected,
}

/// Builds the bench repository with `users` users in entity key
/// serialization `version` into a redis-server of its own, serves it with
/// `[feast]`, and checks every entity of every view against Feast's own
/// answer; `None` when the test is skipped (no feast).
fn served_as_feast_serves(name: &str, users: usize, version: u32, redis: RedisServer) -> Option<Served> {
    let port = redis.addr().rsplit(':').next().unwrap().to_string();
    let (venv, repo, data, config, want) = served_from(name, users, version, &["--redis-port", &port])?;
    Some(Served { venv, redis, repo, data, config, want })
}

/// [`served_as_feast_serves`] with the online store `store` names
/// (`feast_repo.py build`'s `--redis-port P` or `--redis-cluster NODES`):
/// the venv, repository, data directory, configuration and what Feast
/// returned.
fn served_from(
    name: &str,
    users: usize,
    version: u32,
    store: &[&str],
) -> Option<(String, PathBuf, PathBuf, PathBuf, Expected)> {
    let venv = feast_venv()?;
    let venv = venv.to_str().unwrap().to_string();
    let dir = common::scratch(name);
    let repo = dir.join("feature_repo");
    let (users_s, version_s) = (users.to_string(), version.to_string());
    let (repo_s, json) = (repo.to_str().unwrap(), dir.join("online.json"));
    let log = dir.join("feast_repo.log");
    feast_repo(
        &log,
        &[
            "build",
            "--venv",
            &venv,
            "--repo",
            repo_s,
            store[0],
            store[1],
            "--users",
            &users_s,
            "--entity-key-serialization-version",
            &version_s,
        ],
    );
    feast_repo(
        &log,
        &["online", "--venv", &venv, "--repo", repo_s, "--out", json.to_str().unwrap(), "--users", &users_s],
    );
    let want = expected(&json);
    assert_eq!(want.views.len(), 5);

    let (code, out, err) = run_quiver(["feast", "inspect", "--repo", repo_s]);
    assert_eq!(code, 0, "{out}{err}");
    for line in [
        &format!("entity key serialization version {version}")[..],
        "user_stats: entity user by user_id (int64 key, group key u64), width 30",
        "user_recent: entity user by user_id (int64 key, group key u64), width 20, ttl 86400 s",
        "item_attrs: entity item by item_id (int64 key, group key u64), width 25",
        "merchant_risk: entity merchant by merchant_id (string key, group key string), width 17",
        "user_merchant: entities user, merchant by merchant_id,user_id (composite key of string, int64; group key \
         string \"<merchant_id>|<user_id>\"",
        "user_merchant:8,user_stats:30,user_recent:20,item_attrs:25,merchant_risk:17\n",
        "refused: nothing",
    ] {
        assert!(out.contains(line), "no '{line}' in:\n{out}");
    }

    // The demo's model reads user and item; the Feast groups are served beside them.
    let data = dir.join("data");
    std::fs::create_dir_all(&data).unwrap();
    let demo = demo_dir();
    let config = format!(
        "model = {model:?}\nuser_features = {user:?}\nitem_features = {item:?}\n\
         [[groups]]\nname = \"user\"\n[[groups]]\nname = \"item\"\nscope = \"candidate\"\n\
         [feast]\nrepo = {repo:?}\ncandidate = [\"item_attrs\"]\n",
        model = demo.join("model.qm"),
        user = demo.join("user.qrep"),
        item = demo.join("item.qrep"),
    );
    let config_path = dir.join("quiver.toml");
    std::fs::write(&config_path, config).unwrap();
    let server = Server::start_with(&data, &["--config", config_path.to_str().unwrap()]);
    let mut compared = 0usize;
    for ExpectedView(view, features, rows) in &want.views {
        assert_eq!(
            rows.len(),
            match view.as_str() {
                "item_attrs" => users / 2,
                "merchant_risk" => users / 10,
                _ => users,
            }
        );
        if view == "user_merchant" {
            // Keyed by the canonical text, merchant (the first join key by
            // name) then user; some merchants' ids are not ASCII.
            assert!(rows.keys().all(|k| k.starts_with("m-") && k.split('|').count() == 2));
            assert!(rows.keys().any(|k| k.contains("-éü|")));
        }
        for (key, row) in rows {
            assert_eq!(row.len(), features.len());
            let (found, got) = served_row(&server.admin, view, key);
            assert!(found, "{view} {key} not found");
            assert!(same(&got, row), "{view} {key}: served {got:?}, feast {row:?}");
            compared += 1;
        }
        // An entity Redis does not hold: missing whole, as Feast returns it.
        let absent = match view.as_str() {
            "merchant_risk" => "no-such-merchant",
            "user_merchant" => "m-00001|999",
            _ => "999",
        };
        let (found, got) = served_row(&server.admin, view, absent);
        assert!(!found && got.iter().all(Option::is_none), "{view} {absent}: {got:?}");
    }
    assert_eq!(compared, users * 3 + users / 2 + users / 10);
    // Some values are missing and some present in every view: the
    // comparison above saw both.
    for ExpectedView(view, features, rows) in &want.views {
        let missing = rows.values().flatten().filter(|x| x.is_none()).count();
        let values = rows.len() * features.len();
        assert!(missing > 0 && missing < values / 10, "{view}: {missing} of {values} missing");
    }
    // `quiver features get` reads the same route: a sample through the CLI.
    for ExpectedView(view, _, rows) in &want.views {
        for (key, row) in rows.iter().take(5) {
            let (code, out, err) =
                run_quiver(["features", "get", "--admin", &server.admin, "--group", view, "--key", key, "--json"]);
            assert_eq!(code, 0, "{view} {key}: {out}{err}");
            let got: serde_json::Value = serde_json::from_str(&out).unwrap();
            let got: Vec<Option<f32>> =
                got["row"].as_array().unwrap().iter().map(|x| x.as_f64().map(|x| x as f32)).collect();
            assert!(same(&got, row), "features get {view} {key}: {got:?}, feast {row:?}");
        }
    }
    Some((venv, repo, data, config_path, want))
}

/// Feast 0.67's default entity key serialization (version 3), at 10,000
/// users; then bad data and an emptied Redis.
#[test]
fn a_feast_repository_is_served_value_for_value() {
    let Some(Served { redis, repo, data, config, want, .. }) =
        served_as_feast_serves("feast-parity", USERS, 3, RedisServer::start())
    else {
        return;
    };
    let repo_s = repo.to_str().unwrap();

    // A server started again resumes from the files (nothing is copied).
    let rows = USERS as u64;
    let config_s = config.to_str().unwrap();
    let server = Server::start_with(&data, &["--config", config_s]);
    let text = server.wait_scrape("quiver_feast_resumed{group=\"user_stats\"} 1");
    assert!(text.contains("quiver_feast_rows_copied{group=\"user_stats\"} 0"), "{text}");
    assert!(server.stderr().contains("no full copy"), "{}", server.stderr());

    // Bad data, written while it follows Redis: an undecodable value in one
    // user's user_stats feature, and a key of another project with this
    // one's name as its tail.
    let mut conn = redis.conn();
    let user = &want.views.iter().find(|v| v.0 == "user_stats").unwrap();
    let first_user: u64 = user.2.keys().next().unwrap().parse().unwrap();
    let codec = quiver::features::feast::redis_layout::EntityCodec::new(
        "user_id",
        quiver::features::feast::redis_layout::JoinKeyType::Int64,
        quiver::features::feast::redis_layout::KeyVersion::V3,
        "quiver_feast",
    );
    let key = codec.redis_key(&quiver::features::replica::EntityKeyBuf::Id(first_user)).unwrap();
    let field = quiver::features::feast::redis_layout::field_name("user_stats", "us_f32_0");
    conn.command(&[b"HSET", &key, &field, b"\xff\xff\xff"]).unwrap();
    let mut other = key[..key.len() - "quiver_feast".len()].to_vec();
    other.extend_from_slice(b"x_quiver_feast");
    conn.command(&[b"HSET", &other, b"_ts:user_stats", b""]).unwrap();
    // The server skips both, counts them per group in /metrics, and serves
    // the user's user_stats row as missing from then on.
    server.wait_scrape(&format!("quiver_feast_rows{{group=\"user_stats\"}} {}", rows - 1));
    let text = server.wait_scrape("quiver_feast_skipped_total{group=\"user_stats\"} 2");
    for want in [
        "quiver_feast_skipped_total{group=\"user_recent\"} 1".to_string(),
        "quiver_feast_skipped_total{group=\"item_attrs\"} 0".into(),
        format!("quiver_feast_rows{{group=\"user_stats\"}} {}", rows - 1),
        format!("quiver_feast_rows{{group=\"user_recent\"}} {rows}"),
        "quiver_feast_sync_held{group=\"user_stats\"} 0".into(),
    ] {
        assert!(text.contains(&want), "no {want} in {text}");
    }
    assert!(server.stderr().contains("skipped bad feast data"), "{}", server.stderr());
    let (found, got) = served_row(&server.admin, "user_stats", &first_user.to_string());
    assert!(!found && got.iter().all(Option::is_none), "{got:?}");
    assert!(served_row(&server.admin, "user_recent", &first_user.to_string()).0);
    drop(server);
    let data_s = data.to_str().unwrap();
    let (code, out, err) = run_quiver(["feast", "sync", "--repo", repo_s, "--data-dir", data_s]);
    assert_eq!(code, 0, "{out}{err}");
    let kept = rows - 1;
    assert!(out.contains(&format!("user_stats: {kept} rows ({kept} before), 2 skipped as bad data")), "{out}");
    assert!(out.contains(&format!("user_recent: {rows} rows ({rows} before), 1 skipped as bad data")), "{out}");
    assert!(err.contains("skipped bad feast data") && err.contains("another project"), "{err}");
    assert_eq!(rows_in(&data.join("user_stats.qrep"), "user_stats"), rows - 1);

    // Redis restarted empty: a server keeps serving every file it had, and
    // says they are held (it resumes from them: the command's sync wrote
    // them for these definitions); the command's copy is held too, with
    // exit code 3.
    conn.command(&[b"FLUSHALL"]).unwrap();
    let server = Server::start_with(&data, &["--config", config_s]);
    let text = server.wait_scrape("quiver_feast_sync_held{group=\"user_stats\"} 1");
    assert!(text.contains("quiver_feast_sync_held{group=\"merchant_risk\"} 1"), "{text}");
    let (view, rows_of) = (&want.views[0].0, &want.views[0].2);
    let (key, row) = rows_of.iter().next().unwrap();
    let (found, got) = served_row(&server.admin, view, key);
    assert!(found && (view == "user_stats" || same(&got, row)), "{view} {key}: {got:?}");
    drop(server);
    let (code, out, err) = run_quiver(["feast", "sync", "--repo", repo_s, "--data-dir", data_s]);
    assert_eq!(code, 3, "{out}{err}");
    assert!(out.contains("HELD (file kept)"), "{out}");
    assert_eq!(rows_in(&data.join("user_stats.qrep"), "user_stats"), rows - 1);
    assert_eq!(rows_in(&data.join("merchant_risk.qrep"), "merchant_risk"), (USERS / 10) as u64);
    let (code, out, err) = run_quiver(["feast", "sync", "--repo", repo_s, "--data-dir", data_s, "--accept-shrink"]);
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(rows_in(&data.join("user_stats.qrep"), "user_stats"), 0);
}

/// Version 2 keys (no key count, no join key length: feast #5357), which
/// repositories made before Feast 0.50 still hold.
#[test]
fn entity_keys_of_serialization_version_2_are_read() {
    served_as_feast_serves("feast-parity-v2", 300, 2, RedisServer::start());
}

/// How long a test waits for a write to Feast's Redis to be served: far
/// past the bound docs/FEATURES.md states (one loop of the follower, at most
/// 50 ms of waiting, and one pipeline of HGETALL), for a loaded CI machine.
const FRESH_WAIT: Duration = Duration::from_secs(30);

/// Waits until every row of `want` (one view's, as `feast_repo.py` wrote
/// them) is served, value for value; fails naming the first that is not at
/// the deadline.
fn wait_served(admin: &str, want: &Path) {
    let want = expected(want);
    let began = Instant::now();
    for ExpectedView(view, _, rows) in &want.views {
        assert!(!rows.is_empty());
        for (key, row) in rows {
            loop {
                let (found, got) = served_row(admin, view, key);
                if found && same(&got, row) {
                    break;
                }
                assert!(began.elapsed() < FRESH_WAIT, "{view} {key}: served {got:?}, feast {row:?}");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// Polls the admin route until `done` holds for `view`'s row of `key`.
fn wait_row(admin: &str, view: &str, key: &str, what: &str, done: impl Fn(&serde_json::Value) -> bool) {
    let began = Instant::now();
    loop {
        let (code, body) = http_get(&format!("http://{admin}/features/{view}?key={}", encode(key)));
        assert_eq!(code, 200, "{body}");
        if done(&serde_json::from_str(&body).unwrap()) {
            return;
        }
        assert!(began.elapsed() < FRESH_WAIT, "{view} {key}: not {what}: {body}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The value of the sample `name` (with its labels) in a scrape; 0 when absent.
fn labeled(text: &str, name: &str) -> u64 {
    text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok()).unwrap_or(0)
}

/// A stored `google.protobuf.Timestamp`, as Feast writes `_ts:` fields.
fn timestamp(unix_s: i64) -> Vec<u8> {
    use protobuf::Message;
    let mut t = protobuf::well_known_types::timestamp::Timestamp::new();
    t.seconds = unix_s;
    t.write_to_bytes().unwrap()
}

fn now_s() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64
}

/// Freshness, against real Feast: after `feast materialize-incremental` and
/// after a push, the server serves Feast's new values; a row past its
/// view's ttl is missing; a change made while no notification could reach
/// the server is caught up by the reconciliation after Redis restarts;
/// notifications the server cannot enable fail start-up naming the
/// setting; a burst of deletions is held.
#[test]
fn feast_writes_are_followed() {
    let users = 1_000;
    let Some(Served { venv, redis, repo, data, config, want }) =
        served_as_feast_serves("feast-fresh", users, 3, RedisServer::start_with(true))
    else {
        return;
    };
    let dir = config.parent().unwrap().to_path_buf();
    let (repo_s, users_s) = (repo.to_str().unwrap(), users.to_string());
    // Only a reconnection starts a reconciliation pass within the test, in
    // rounds of 100 of the 1,600 keys.
    let mut text = std::fs::read_to_string(&config).unwrap();
    text.push_str("reconcile_interval_ms = 3600000\nreconcile_keys_max = 100\n");
    std::fs::write(&config, text).unwrap();
    let server = Server::start_with(&data, &["--config", config.to_str().unwrap()]);
    server.wait_scrape("quiver_feast_resumed{group=\"user_recent\"} 1");
    server.wait_scrape("quiver_feast_connected 1");
    let log = dir.join("fresh.log");

    // The start-up's catch-up: a whole pass of the SCAN and of the sweep,
    // in rounds that each compared at most reconcile_keys_max keys.
    server.wait_metric("quiver_feast_reconcile_passes_total", 1);
    server.wait_metric("quiver_feast_sweep_passes_total", 1);
    let keys = (2 * users + users / 2 + users / 10) as u64;
    assert!(server.metric("quiver_feast_reconciled_keys_total") >= keys);
    assert_eq!(server.metric("quiver_feast_reconcile_round_keys_max"), 100);
    assert!(server.metric("quiver_feast_reconcile_rounds_total") >= keys / 100);
    assert!(server.metric("quiver_feast_swept_rows_total") >= keys + users as u64);

    // `quiver feast sync` will not swap files in under the running follower.
    let data_s = data.to_str().unwrap();
    let before = std::fs::metadata(data.join("user_stats.qrep")).unwrap().modified().unwrap();
    let (code, out, err) = run_quiver(["feast", "sync", "--repo", repo_s, "--data-dir", data_s]);
    assert_ne!(code, 0, "{out}{err}");
    // The first view it would copy (the service `pairs` sorts first) names the lock.
    assert!(err.contains("being written by another process") && err.contains("user_merchant.qrep"), "{err}");
    assert_eq!(std::fs::metadata(data.join("user_stats.qrep")).unwrap().modified().unwrap(), before);

    // feast materialize-incremental, then a push: each served as Feast serves it.
    let out = dir.join("update.json");
    let args = ["--venv", &venv, "--repo", repo_s, "--users", &users_s, "--count", "50"];
    feast_repo(&log, &[&["update", "--out", out.to_str().unwrap()][..], &args[..]].concat());
    wait_served(&server.admin, &out);
    let out = dir.join("push.json");
    feast_repo(&log, &[&["push", "--out", out.to_str().unwrap()][..], &args[..]].concat());
    wait_served(&server.admin, &out);
    // A push to the composite view: its rows are found by their canonical text.
    let out = dir.join("push-pairs.json");
    feast_repo(&log, &[&["push", "--view", "user_merchant", "--out", out.to_str().unwrap()][..], &args[..]].concat());
    wait_served(&server.admin, &out);
    let text = server.wait_scrape("quiver_feast_events_dropped_total 0");
    assert!(labeled(&text, "quiver_feast_applied_total{group=\"user_stats\"}") >= 50, "{text}");
    assert!(labeled(&text, "quiver_feast_applied_total{group=\"user_recent\"}") >= 50, "{text}");
    assert!(labeled(&text, "quiver_feast_applied_total{group=\"user_merchant\"}") >= 50, "{text}");
    assert!(server.metric("quiver_feast_events_total") >= 150, "{text}");

    // A row older than its view's ttl (user_recent: a day) is missing.
    let recent = &want.views.iter().find(|v| v.0 == "user_recent").unwrap().2;
    let old_user = recent.keys().map(|k| k.parse::<u64>().unwrap()).max().unwrap();
    let user_codec = quiver::features::feast::redis_layout::EntityCodec::new(
        "user_id",
        quiver::features::feast::redis_layout::JoinKeyType::Int64,
        quiver::features::feast::redis_layout::KeyVersion::V3,
        "quiver_feast",
    );
    let key_of = |id: u64| user_codec.redis_key(&quiver::features::replica::EntityKeyBuf::Id(id)).unwrap();
    let mut conn = redis.conn();
    conn.command(&[b"HSET", &key_of(old_user), b"_ts:user_recent", &timestamp(now_s() - 2 * 86_400)]).unwrap();
    wait_row(&server.admin, "user_recent", &old_user.to_string(), "expired", |row| {
        row["expired"] == true && row["row"].as_array().unwrap().iter().all(serde_json::Value::is_null)
    });
    assert!(served_row(&server.admin, "user_stats", &old_user.to_string()).0);

    // A change no notification announces (they are off while it is made),
    // then Redis restarts on its port: the follower reconnects, enables
    // them again, and its reconciliation pass re-reads the change.
    let rereads = server.metric("quiver_feast_reconcile_rereads_total");
    let user = recent.keys().map(|k| k.parse::<u64>().unwrap()).min().unwrap();
    // Ten users deleted unannounced too: SCAN cannot show them; the sweep does.
    let mut by_id: Vec<u64> = recent.keys().map(|k| k.parse().unwrap()).filter(|&id| id != user).collect();
    by_id.sort_unstable();
    let deleted = &by_id[..10];
    let field = quiver::features::feast::redis_layout::field_name("user_stats", "us_f32_0");
    conn.command(&[b"CONFIG", b"SET", b"notify-keyspace-events", b""]).unwrap();
    // Value(float_val = 3.0), as Feast stores it.
    conn.command(&[b"HSET", &key_of(user), &field, b"\x35\x00\x00\x40\x40"]).unwrap();
    conn.command(&[b"HSET", &key_of(user), b"_ts:user_stats", &timestamp(now_s() + 3600)]).unwrap();
    for &id in deleted {
        conn.command(&[b"DEL", &key_of(id)]).unwrap();
    }
    drop(conn);
    let mut redis = redis;
    redis.restart();
    wait_row(&server.admin, "user_stats", &user.to_string(), "caught up", |row| row["row"][0] == 3.0);
    assert!(server.metric("quiver_feast_reconcile_rereads_total") > rereads);
    assert!(server.metric("quiver_feast_connect_failures_total") >= 1);
    let left = users - deleted.len();
    server.wait_scrape(&format!("quiver_feast_rows{{group=\"user_stats\"}} {left}"));
    server.wait_scrape(&format!("quiver_feast_rows{{group=\"user_recent\"}} {left}"));
    for id in deleted {
        assert!(!served_row(&server.admin, "user_stats", &id.to_string()).0, "user {id} was deleted");
    }
    assert!(server.metric("quiver_feast_sweep_rereads_total") >= deleted.len() as u64);

    // A burst of deletions: held at shrink_max (0.5) of the most rows.
    let mut conn = redis.conn();
    for id in recent.keys() {
        conn.command(&[b"DEL", &key_of(id.parse().unwrap())]).unwrap();
    }
    let scrape = server.wait_scrape(&format!("quiver_feast_rows{{group=\"user_stats\"}} {}", users / 2));
    assert!(scrape.contains(&format!("quiver_feast_rows{{group=\"user_recent\"}} {}", users / 2)), "{scrape}");
    let scrape = server.wait_scrape("quiver_feast_deletes_held_total{group=\"user_stats\"}");
    assert!(labeled(&scrape, "quiver_feast_deletes_held_total{group=\"user_stats\"}") >= 1, "{scrape}");
    drop(server);

    // A Redis that will not run CONFIG, and notifications off: start-up
    // fails naming the setting.
    let managed = RedisServer::start_opts(false, &["--rename-command", "CONFIG", ""]);
    let mut text = std::fs::read_to_string(&config).unwrap();
    text.push_str(&format!("redis = \"{}\"\n", managed.url()));
    let refused = dir.join("refused.toml");
    std::fs::write(&refused, text).unwrap();
    let failed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        Server::start_with(&data, &["--config", refused.to_str().unwrap()])
    }));
    let why = failed.err().expect("start-up fails");
    let why = why.downcast_ref::<String>().unwrap();
    assert!(why.contains("notify-keyspace-events") && why.contains("Kghx"), "{why}");
}

/// A model served end to end on Feast's features, as a Feast user would:
/// LightGBM trained on the offline store's features through the feature
/// service (`feast_repo.py train`: `get_historical_features`), imported
/// with `quiver import --inputs` naming the Feast views, served by a server
/// whose only features are `[feast]`'s, scored with `quiver score`. Each
/// score is LightGBM's own prediction on the values `get_online_features`
/// returns for the same entities (null: NaN, which the trees send their
/// missing way), and `features_missing` counts every row that is absent or
/// holds a null (most rows hold one: 5% of each column is null).
#[test]
fn a_model_scores_on_feast_features_as_lightgbm_does_on_feasts_values() {
    let users = 300;
    let Some(Served { venv, redis: _redis, repo, config, .. }) =
        served_as_feast_serves("feast-model", users, 3, RedisServer::start())
    else {
        return;
    };
    let dir = config.parent().unwrap().to_path_buf();
    let (model_txt, want_path) = (dir.join("model.txt"), dir.join("train.json"));
    feast_repo(
        &dir.join("train.log"),
        &[
            "train",
            "--venv",
            &venv,
            "--repo",
            repo.to_str().unwrap(),
            "--users",
            &users.to_string(),
            "--model",
            model_txt.to_str().unwrap(),
            "--out",
            want_path.to_str().unwrap(),
        ],
    );
    let want: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&want_path).unwrap()).unwrap();
    let inputs = want["inputs"].as_str().unwrap();
    assert_eq!(inputs, "user_stats:30,user_recent:20,merchant_risk:17,item_attrs@candidate:25");

    // The README's walkthrough: import, a configuration of `[feast]` alone, serve, score.
    let data = dir.join("model-data");
    std::fs::create_dir_all(&data).unwrap();
    let model = data.join("model.qm");
    let (code, out, err) = run_quiver([
        "import",
        "--lightgbm",
        model_txt.to_str().unwrap(),
        "--out",
        model.to_str().unwrap(),
        "--name",
        "feast_demo",
        "--version",
        "1",
        "--inputs",
        inputs,
    ]);
    assert_eq!(code, 0, "{out}{err}");
    let served_config = dir.join("feast-only.toml");
    std::fs::write(&served_config, format!("[feast]\nrepo = {repo:?}\ncandidate = [\"item_attrs\"]\n")).unwrap();
    let server = Server::start_with(&data, &["--config", served_config.to_str().unwrap()]);
    let requests = want["requests"].as_array().unwrap();
    assert!(requests.len() >= 10);
    let (mut nulls_counted, mut missing_total, mut compared) = (0u64, 0u64, 0usize);
    for r in requests {
        let user = r["user"].as_u64().unwrap();
        let merchant = r["merchant"].as_str().unwrap();
        let items: Vec<String> =
            r["items"].as_array().unwrap().iter().map(|i| i.as_u64().unwrap().to_string()).collect();
        let (code, out, err) = run_quiver([
            "score",
            "--addr",
            &server.addr,
            "--key",
            &format!("user_stats={user}"),
            "--key",
            &format!("user_recent={user}"),
            "--str-key",
            &format!("merchant_risk={merchant}"),
            "--key",
            &format!("item_attrs={}", items.join(",")),
            "--json",
        ]);
        assert_eq!(code, 0, "{out}{err}");
        let got: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!((got["status"].as_str(), got["error"].as_str()), (Some("ok"), Some("")), "{out}");
        let scores = got["scores"].as_array().unwrap();
        let expected = r["scores"].as_array().unwrap();
        assert_eq!(scores.len(), expected.len());
        for (i, (g, w)) in scores.iter().zip(expected).enumerate() {
            let (g, w) = (g.as_f64().unwrap(), w.as_f64().unwrap());
            assert!((g - w).abs() < 1e-5, "user {user} item {}: served {g}, lightgbm {w}", items[i]);
            compared += 1;
        }
        // Each row with a null or absent feature counts once; more than
        // the one absent item, so the nulls inside present rows count.
        let missing = r["features_missing"].as_u64().unwrap();
        assert_eq!(got["features_missing"].as_u64(), Some(missing), "user {user}: {out}");
        nulls_counted += missing.saturating_sub(1);
        missing_total += missing;
    }
    assert!(nulls_counted > 0);
    assert_eq!(compared, requests.len() * 32);
    // The server's counter adds them up the same.
    assert_eq!(server.wait_metric("quiver_features_missing_total", missing_total), missing_total);
}

/// Feast's online store on a Redis Cluster (`redis_type: redis_cluster`,
/// three masters with a replica each): Feast materializes into it, the
/// server's first sync SCANs every master and serves every entity as
/// `get_online_features` returns it (1,000 users); a push is served through
/// the masters' own keyspace notifications (node-local in a cluster); a
/// master is killed, its replica promoted, and a push after it (a third of
/// its keys on the promoted node) is served too, the follower having
/// subscribed to the new master.
#[test]
fn a_feast_repository_on_a_redis_cluster_is_served_and_followed() {
    if feast_venv().is_none() {
        return;
    }
    let users = 1_000;
    let mut cluster = RedisCluster::start(3, 1);
    let nodes = cluster.seeds().join(",");
    let Some((venv, repo, data, config, _)) = served_from("feast-cluster", users, 3, &["--redis-cluster", &nodes])
    else {
        return;
    };
    let dir = config.parent().unwrap().to_path_buf();
    let (repo_s, users_s) = (repo.to_str().unwrap(), users.to_string());
    let server = Server::start_with(&data, &["--config", config.to_str().unwrap()]);
    server.wait_scrape("quiver_feast_resumed{group=\"user_stats\"} 1");
    server.wait_scrape("quiver_feast_connected 1");
    // Every master's keys were compared: one pass over all of them.
    server.wait_metric("quiver_feast_reconcile_passes_total", 1);
    let keys = (2 * users + users / 2 + users / 10) as u64;
    assert!(server.metric("quiver_feast_reconciled_keys_total") >= keys);

    let log = dir.join("fresh.log");
    let out = dir.join("push.json");
    let args = ["--venv", &venv, "--repo", repo_s, "--users", &users_s, "--count", "60"];
    feast_repo(&log, &[&["push", "--out", out.to_str().unwrap()][..], &args[..]].concat());
    wait_served(&server.admin, &out);
    let out = dir.join("push-pairs.json");
    feast_repo(&log, &[&["push", "--view", "user_merchant", "--out", out.to_str().unwrap()][..], &args[..]].concat());
    wait_served(&server.admin, &out);

    // A master dies; its replica takes over its slots.
    let seeds = cluster.seeds();
    let topology = quiver::features::feed::redis_cluster::ClusterConn::connect(&cluster.config(), &seeds).unwrap();
    let victim = topology.topology().masters()[0].to_string();
    drop(topology);
    cluster.node(&victim).kill();
    let began = Instant::now();
    loop {
        let alive: Vec<String> = cluster.seeds();
        let promoted = quiver::features::feed::redis_cluster::ClusterConn::connect(&cluster.config(), &alive)
            .is_ok_and(|c| c.topology().covers_all_slots() && !c.topology().masters().contains(&victim.as_str()));
        if promoted {
            break;
        }
        assert!(began.elapsed() < FRESH_WAIT, "no replica of {victim} was promoted");
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = dir.join("push-after-failover.json");
    feast_repo(&log, &[&["push", "--seed", "41", "--out", out.to_str().unwrap()][..], &args[..]].concat());
    wait_served(&server.admin, &out);
    server.wait_scrape("quiver_feast_connected 1");
}
