//! `GET /features/{group}?key=K` and `quiver features get`: a running
//! server answers one key's row exactly as its shards read it (decoded from
//! the replica's storage, or the default row when the key is missing), for
//! u64 and string keys; the route refuses what it cannot answer with the
//! right status, needs the admin token where one is set, and is not served
//! on the read-only metrics listener; the CLI prints the row and exits 0
//! when found, 2 when the default row is served, 1 on an error. A group
//! that follows Redis answers its staleness and last applied change, and a
//! change the feed applies is seen at once: the route reads the handle the
//! feed writes and the shards read.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::redis::RedisServer;
use common::{demo_dir, http_get, run_quiver, Server, WAIT};
use quiver::features::feed::Publisher;
use quiver::features::replica::{Replica, ReplicaBuilder, Storage};

const CARD_DEFAULT: [f32; 3] = [0.5, -0.5, 0.25];
const CARD_7: [f32; 3] = [1.0, -2.5, 0.333];
const DEVICE_DEFAULT: [f32; 4] = [9.0, 8.0, 7.0, 6.0];
const PHONE: [f32; 4] = [0.1, 0.2, -0.3, 1e-7];
/// A key with every character a URL treats specially.
const ODD_KEY: &str = "a b+c/%&=?#é";
const ODD: [f32; 4] = [-1.5, 2.25, 3.0, -4.0];
const LONG: [f32; 4] = [64.0, 0.0, -64.0, 0.5];
const TOKEN: &str = "features-get-token-0123456789abcdef";

/// A data directory serving the demo's model, user and item replicas, plus
/// `card` (u64 keys, f16 storage) and `device` (string keys, f32), which
/// the model does not read; and the config that names all four.
fn served(name: &str) -> (PathBuf, PathBuf) {
    let dir = common::scratch(name);
    let mut card = ReplicaBuilder::new("card", 3).storage(Storage::F16);
    card.set_default(&CARD_DEFAULT).unwrap();
    card.push(7, &CARD_7).unwrap();
    card.push(u64::MAX, &[1.0, 2.0, 3.0]).unwrap();
    card.write(&dir.join("card.qrep")).unwrap();
    let mut device = ReplicaBuilder::new("device", 4).str_keys(64).unwrap();
    device.set_default(&DEVICE_DEFAULT).unwrap();
    device.push_str(b"phone-1", &PHONE).unwrap();
    device.push_str(ODD_KEY.as_bytes(), &ODD).unwrap();
    device.push_str(&[b'k'; 64], &LONG).unwrap();
    device.write(&dir.join("device.qrep")).unwrap();
    let demo = demo_dir();
    let config = format!(
        "model = {model:?}\nuser_features = {user:?}\nitem_features = {item:?}\n\
         [[groups]]\nname = \"user\"\n\
         [[groups]]\nname = \"item\"\nscope = \"candidate\"\n\
         [[groups]]\nname = \"card\"\nkey = \"u64\"\nwidth = 3\n\
         [[groups]]\nname = \"device\"\nkey = \"string\"\nwidth = 4\n",
        model = demo.join("model.qm"),
        user = demo.join("user.qrep"),
        item = demo.join("item.qrep"),
    );
    let path = dir.join("quiver.toml");
    std::fs::write(&path, config).unwrap();
    (dir, path)
}

/// Every byte but the unreserved ones as `%XX`.
fn encode(key: &[u8]) -> String {
    key.iter()
        .map(|&b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                char::from(b).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// GET with an optional bearer token: the status and the body.
fn get_as(url: &str, token: Option<&str>) -> (u16, String) {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(5)))
        .build()
        .into();
    let mut req = agent.get(url);
    if let Some(t) = token {
        req = req.header("Authorization", format!("Bearer {t}"));
    }
    let mut r = req.call().unwrap();
    (r.status().as_u16(), r.body_mut().read_to_string().unwrap())
}

/// The route's answer for `key` of `group`, which must be a 200.
fn row_of(admin: &str, group: &str, key: &[u8]) -> serde_json::Value {
    let (code, body) = http_get(&format!("http://{admin}/features/{group}?key={}", encode(key)));
    assert_eq!(code, 200, "{group} {key:?}: {body}");
    serde_json::from_str(&body).unwrap()
}

fn floats(v: &serde_json::Value) -> Vec<f32> {
    v["row"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

/// What a shard reads for `key` from the file at `path`: the reference the
/// route must equal bit for bit.
fn read_u64(path: &Path, group: &str, key: u64) -> (bool, Vec<f32>) {
    let r = Replica::open(path, group).unwrap();
    let mut out = vec![0f32; r.dim()];
    (r.read_into(key, &mut out), out)
}

#[test]
fn rows_are_what_the_shards_read_and_errors_are_refused() {
    let (dir, config) = served("features-get-rows");
    let server = Server::start_with(&dir, &["--config", config.to_str().unwrap()]);
    let admin = server.admin.as_str();

    // A found u64 key of an f16 group: the decoded floats a shard reads.
    let card = row_of(admin, "card", b"7");
    let (found, want) = read_u64(&dir.join("card.qrep"), "card", 7);
    assert!(found);
    assert_eq!(floats(&card), want, "{card}");
    for (got, wrote) in floats(&card).iter().zip(CARD_7) {
        assert!((got - wrote).abs() <= wrote.abs() / 1024.0, "f16 of {wrote} is {got}");
    }
    assert_eq!(card["found"], true);
    assert_eq!(card["key"], "7");
    assert_eq!(card["key_type"], "u64");
    assert_eq!(card["storage"], "f16");
    assert_eq!(card["width"], 3);
    assert_eq!(card["scope"], "request");
    assert_eq!(card["absent"], "reject");
    assert_eq!(card["follows_redis"], false);
    assert!(card["staleness_ms"].is_null(), "no feed, no staleness: {card}");
    assert!(card["group_change_unix_ms"].is_null(), "a built file has applied no change: {card}");
    assert_eq!(card["group_applied_seq"], 0);
    assert!(card["note"].as_str().unwrap().contains("not this row's"), "{card}");
    assert_eq!(floats(&row_of(admin, "card", u64::MAX.to_string().as_bytes())), [1.0, 2.0, 3.0]);

    // A u64 group the model reads, from the demo's file.
    let user = row_of(admin, "user", b"42");
    let (found, want) = read_u64(&demo_dir().join("user.qrep"), "user", 42);
    assert_eq!(user["found"], found);
    assert_eq!(floats(&user), want);
    assert_eq!(user["absent"], "default");

    // Found string keys, the odd one and the longest included, exactly.
    let phone = row_of(admin, "device", b"phone-1");
    assert_eq!(phone["found"], true, "{phone}");
    assert_eq!(floats(&phone), PHONE, "{phone}");
    assert_eq!((phone["key_type"].as_str(), phone["storage"].as_str()), (Some("string"), Some("f32")));
    let odd = row_of(admin, "device", ODD_KEY.as_bytes());
    assert_eq!((odd["key"].as_str(), floats(&odd)), (Some(ODD_KEY), ODD.to_vec()), "{odd}");
    assert_eq!(floats(&row_of(admin, "device", &[b'k'; 64])), LONG);

    // Missing keys: found = false and the group's default row.
    let missing: [(&str, &[u8], &[f32]); 4] = [
        ("card", b"8", &CARD_DEFAULT),
        ("device", b"phone-2", &DEVICE_DEFAULT),
        ("device", b"PHONE-1", &DEVICE_DEFAULT),
        ("device", &[b'k'; 63], &DEVICE_DEFAULT),
    ];
    for (group, key, default) in missing {
        let v = row_of(admin, group, key);
        assert_eq!(v["found"], false, "{v}");
        assert_eq!(floats(&v), default, "{v}");
    }
    // A key that is not UTF-8 is answered, and named in hex.
    let raw = row_of(admin, "device", &[0xff, 0x00, b'x']);
    assert_eq!((raw["found"].as_bool(), raw["key_hex"].as_str()), (Some(false), Some("ff0078")), "{raw}");

    // Refusals: the status and a line that says why.
    let url = |rest: &str| format!("http://{admin}/features/{rest}");
    let (code, body) = http_get(&url("nope?key=1"));
    assert_eq!(code, 404, "{body}");
    assert!(body.contains("'nope'") && body.contains("user, item, card, device"), "{body}");
    assert!(body.trim_end().lines().count() == 1, "{body}");
    for (rest, why) in [
        ("card?key=abc", "not a decimal u64"),
        ("card?key=-1", "not a decimal u64"),
        ("card?key=1%0A2", "\"1\\n2\" is not a decimal u64"),
        ("card?key=18446744073709551616", "not a decimal u64"),
        ("card", "no key"),
        ("card?id=7", "no key"),
        ("card?key=", "empty key"),
        ("card?key=7&key=8", "twice"),
        ("device?key=%zz", "hex digits"),
        ("abcdefghijklmnopq?key=1", "1 to 16 bytes"),
    ] {
        let (code, body) = http_get(&url(rest));
        assert_eq!(code, 400, "{rest}: {body}");
        assert!(body.contains(why), "{rest}: {body}");
        assert_eq!(body.trim_end().lines().count(), 1, "one line: {body}");
    }
    let long = url(&format!("device?key={}", "k".repeat(65)));
    let (code, body) = http_get(&long);
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("at most 64 bytes"), "{body}");
    let (code, body) = get_as(&url("card/7?key=7"), None);
    assert_eq!(code, 404, "{body}");

    // The CLI: a table for a person, exit 0 when found.
    let cli = |group: &str, key: &str, more: &[&str]| {
        let mut args = vec!["features", "get", "--admin", admin, "--group", group, "--key", key];
        args.extend(more);
        run_quiver(args)
    };
    let (code, out, err) = cli("device", ODD_KEY, &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("found") && !out.contains("NOT"), "{out}");
    assert!(out.contains("string keys") && out.contains("width 4"), "{out}");
    let lines: Vec<&str> = out.lines().collect();
    let at = lines.iter().position(|l| l.trim() == "index  value").expect("a table") + 1;
    let table: Vec<(usize, f32)> = lines[at..at + 4]
        .iter()
        .map(|l| {
            let (i, v) = l.trim().split_once(char::is_whitespace).unwrap();
            (i.parse().unwrap(), v.trim().parse().unwrap())
        })
        .collect();
    assert_eq!(table, ODD.iter().copied().enumerate().collect::<Vec<_>>(), "{out}");
    assert!(out.contains("staleness unknown: no [feed]"), "{out}");
    assert!(out.contains("last applied change: none recorded"), "{out}");

    // --json prints the route's answer unchanged; a missing key exits 2.
    let (code, out, err) = cli("card", "8", &["--json"]);
    assert_eq!(code, 2, "{out}{err}");
    let route = http_get(&url("card?key=8")).1;
    assert_eq!(out, route);
    let (code, out, _) = cli("device", "phone-2", &[]);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("NOT in the replica: the group's default row is served"), "{out}");
    let (code, out, _) = cli("card", "7", &["--json"]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(serde_json::from_str::<serde_json::Value>(&out).unwrap(), card);
    // Errors exit 1 and say what the server said.
    let (code, _, err) = cli("nope", "1", &[]);
    assert_eq!(code, 1);
    assert!(err.contains("404") && err.contains("user, item, card, device"), "{err}");
    let (code, _, err) = cli("card", "abc", &[]);
    assert_eq!(code, 1);
    assert!(err.contains("400") && err.contains("not a decimal u64"), "{err}");
    let (code, _, err) = cli("../stats.json", "1", &[]);
    assert_eq!(code, 1, "a group name is checked before it goes into a URL: {err}");
}

#[test]
fn the_lookup_needs_the_token_and_the_metrics_listener_has_none() {
    let (dir, config) = served("features-get-token");
    let token_file = dir.join("admin.token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let server = Server::start_with(
        &dir,
        &[
            "--config",
            config.to_str().unwrap(),
            "--admin-token-file",
            token_file.to_str().unwrap(),
            "--metrics-listen",
            "127.0.0.1:0",
        ],
    );
    let url = format!("http://{}/features/device?key=phone-1", server.admin);
    let (code, body) = get_as(&url, None);
    assert_eq!(code, 401, "{body}");
    let (code, body) = get_as(&url, Some("wrong-token-wrong-token-wrong"));
    assert_eq!(code, 401, "{body}");
    let (code, body) = get_as(&url, Some(TOKEN));
    assert_eq!(code, 200, "{body}");
    // A malformed lookup says nothing before the token either.
    let (code, body) = get_as(&format!("http://{}/features/nope?key=%zz", server.admin), None);
    assert_eq!(code, 401, "{body}");
    let (code, body) = get_as(&format!("http://{}/features/nope?key=1", server.admin), None);
    assert_eq!(code, 401, "the served groups are not listed without the token: {body}");

    // The read-only listener does not serve it, token or not.
    assert!(!server.metrics.is_empty());
    for token in [None, Some(TOKEN)] {
        let (code, body) = get_as(&format!("http://{}/features/device?key=phone-1", server.metrics), token);
        assert_eq!(code, 404, "{body}");
        assert!(!body.contains("row"), "{body}");
    }
    assert_eq!(get_as(&format!("http://{}/stats.json", server.metrics), None).0, 200);

    // The CLI sends the token from either flag's file.
    let args = ["features", "get", "--admin", &server.admin, "--group", "device", "--key", "phone-1"];
    let (code, _, err) = run_quiver(args);
    assert_eq!(code, 1);
    assert!(err.contains("401"), "{err}");
    for flag in ["--token-file", "--admin-token-file"] {
        let (code, out, err) = run_quiver(args.iter().copied().chain([flag, token_file.to_str().unwrap()]));
        assert_eq!(code, 0, "{flag}: {out}{err}");
        assert!(out.contains("found"), "{out}");
    }
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64
}

/// The route's answer once the feed has applied change `seq` of `group`.
fn row_after(admin: &str, group: &str, key: &[u8], seq: u64) -> serde_json::Value {
    let until = Instant::now() + WAIT;
    loop {
        let row = row_of(admin, group, key);
        if row["group_applied_seq"].as_u64().unwrap() >= seq {
            return row;
        }
        assert!(Instant::now() < until, "change {seq} of {group} not applied within {WAIT:?}: {row}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_group_that_follows_redis_answers_its_staleness_last_change_and_live_row() {
    let redis = RedisServer::start();
    let dir = common::models_only_dir("features-get-feed");
    let config = dir.join("q.toml");
    std::fs::write(&config, format!("[feed]\nredis = \"{}\"\ninitial_sync_timeout_ms = 5000\n", redis.url())).unwrap();
    let server = Server::start_with(&dir, &["--config", config.to_str().unwrap(), "--shards", "1"]);
    let admin = server.admin.as_str();
    let mut publisher = Publisher::new(redis.conn()).unwrap();

    let v: Vec<f32> = (0..32).map(|i| i as f32 * 0.25 - 3.0).collect();
    let before_ms = now_ms();
    let seq = publisher.put("user", 42, &v).unwrap();
    let row = row_after(admin, "user", b"42", seq);
    assert_eq!(row["found"], true, "{row}");
    assert_eq!(floats(&row), v, "{row}");
    assert_eq!(row["follows_redis"], true);
    assert_eq!(row["group_applied_seq"], seq);
    let staleness_ms = row["staleness_ms"].as_u64().expect("a followed group has a staleness");
    assert!(staleness_ms < WAIT.as_millis() as u64, "{row}");
    let change_ms = row["group_change_unix_ms"].as_u64().expect("a change was applied");
    assert!(change_ms + 1_000 >= before_ms && change_ms <= now_ms() + 1_000, "{change_ms} vs {before_ms}: {row}");

    // A write the feed applies is read at once; a delete serves the default row.
    let w: Vec<f32> = v.iter().map(|x| -x).collect();
    let seq = publisher.put("user", 42, &w).unwrap();
    assert_eq!(floats(&row_after(admin, "user", b"42", seq)), w);
    let seq = publisher.delete("user", 42).unwrap();
    let gone = row_after(admin, "user", b"42", seq);
    let never = row_of(admin, "user", b"43");
    assert_eq!((gone["found"].as_bool(), never["found"].as_bool()), (Some(false), Some(false)), "{gone}");
    assert_eq!(floats(&gone), floats(&never), "a deleted key reads the default row");

    // The CLI says how current the group is and when it last changed.
    let (code, out, err) = run_quiver(["features", "get", "--admin", admin, "--group", "user", "--key", "42"]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(out.contains("ms (the replica follows redis)"), "{out}");
    assert!(out.contains(" UTC (") && out.contains(&format!("seq {seq}")), "{out}");
    assert!(out.contains("not this row's"), "{out}");
}
