//! String-keyed feature groups fed from a real Redis: publish, first full sync
//! into a new keyed replica, following the stream, a warm restart from the
//! checkpoint, a source emptied under it, the bucketed layout, malformed keys,
//! and the refusals that keep u64 and string groups from mixing (in Redis, in
//! a replica, in a file). The feed runs in this process (`feed::start`); the
//! CLI round trip runs the binary. Every test starts its own `redis-server`.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::redis::RedisServer;
use common::BIN;
use quiver::features::feed::contract::{self, ContractError, KeyKind, Layout};
use quiver::features::feed::{self, FeedConfig, GroupSpec, PublishError, Publisher, RedisError, RefreshError, Reply};
use quiver::features::replica::{ReplicaError, ReplicaHandle, ReplicaWriter, Storage};

const DIM: usize = 4;
const DEVICE: KeyKind = KeyKind::Str { bytes_max: 64 };

/// A vector that names its key and generation, so a read shows whose it is.
fn vector(key: &str, generation: u32) -> Vec<f32> {
    let h = key.bytes().fold(0u32, |h, b| h.wrapping_mul(31).wrapping_add(u32::from(b))) % 10_000;
    vec![h as f32, generation as f32, key.len() as f32, -1.5]
}

fn name(n: usize) -> String {
    format!("device-{n:05}/ü")
}

fn publisher(redis: &RedisServer, layout: Layout) -> Publisher {
    Publisher::new(redis.conn()).unwrap().with_layout(layout).unwrap().with_key_kind(DEVICE).unwrap()
}

fn put_range(p: &mut Publisher, range: std::ops::Range<usize>, generation: u32) {
    let rows: Vec<(Vec<u8>, Vec<f32>)> = range.map(|n| (name(n).into_bytes(), vector(&name(n), generation))).collect();
    p.put_many_str("device", &rows, |_, _| {}).unwrap();
}

fn config(redis: &RedisServer, layout: Layout) -> FeedConfig {
    FeedConfig {
        redis: redis.url(),
        buckets: match layout {
            Layout::Plain => None,
            Layout::Bucketed { buckets } => Some(buckets),
        },
        block_ms: 50,
        check_interval_ms: 200,
        initial_sync_timeout_ms: 20_000,
        ..FeedConfig::default()
    }
}

fn spec(path: &Path, key: KeyKind) -> GroupSpec {
    GroupSpec {
        name: "device".into(),
        path: path.to_path_buf(),
        dim: Some(DIM as u32),
        key,
        storage: Storage::F32,
        default: vec![9.0; DIM],
        link: None,
    }
}

/// The feed of one group, stopped (and its checkpoint written) when dropped.
struct Running {
    feed: Option<feed::Feed>,
    stop: Arc<AtomicBool>,
}

impl Running {
    /// Starts the feed; a file still locked by the previous `Running` is
    /// tried again for a while. Its writer is gone once `drop` joined the
    /// feed's thread, but a child that another test of this binary forked
    /// at that moment shares the descriptor, and with it the flock, until
    /// its exec closes it: under load that window can be long.
    fn start(config: &FeedConfig, spec: GroupSpec) -> Result<Running, RefreshError> {
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            let stop = Arc::new(AtomicBool::new(false));
            match feed::start(config, std::slice::from_ref(&spec), stop.clone()) {
                Ok(feed) => return Ok(Running { feed: Some(feed), stop }),
                Err(RefreshError::Replica(ReplicaError::Locked { .. })) if Instant::now() < until => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn feed(&self) -> &feed::Feed {
        self.feed.as_ref().expect("running")
    }

    fn handle(&self) -> Arc<ReplicaHandle> {
        self.feed().handles[0].clone()
    }

    fn status(&self) -> &feed::GroupStatus {
        &self.feed().status.groups[0]
    }

    /// Waits until `done` holds, for at most 20 s.
    fn wait(&self, what: &str, done: impl Fn(&Running) -> bool) {
        let started = Instant::now();
        while !done(self) {
            assert!(started.elapsed() < Duration::from_secs(20), "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(feed) = self.feed.take() {
            let _ = feed.thread.join();
        }
    }
}

fn read(handle: &ReplicaHandle, key: &str) -> Option<Vec<f32>> {
    let mut out = vec![0.0; DIM];
    handle.read_str_into(key.as_bytes(), &mut out).then_some(out)
}

fn seq(redis: &RedisServer, key: &str) -> u64 {
    match redis.conn().command(&[b"GET", key.as_bytes()]).unwrap() {
        Reply::Bulk(b) => std::str::from_utf8(&b).unwrap().parse().unwrap(),
        Reply::Nil => 0,
        other => panic!("{key}: {other:?}"),
    }
}

fn scratch(name: &str) -> PathBuf {
    common::scratch(name)
}

#[test]
fn a_string_keyed_group_syncs_follows_restarts_warm_and_holds_an_emptied_source() {
    let redis = RedisServer::start();
    let mut p = publisher(&redis, Layout::Plain);
    put_range(&mut p, 0..500, 0);
    // A key past the group's limit, written around the script: skipped and counted, not served.
    let long = format!("device:{}", "x".repeat(65));
    redis.conn().command(&[b"SET", long.as_bytes(), &contract::encode_vector(&[1.0; DIM])]).unwrap();
    assert_eq!(
        redis.conn().command(&[b"GET", b"quiver:keys:device"]).unwrap(),
        Reply::Bulk(b"string".to_vec()),
        "the first write records the group's key kind"
    );

    let dir = scratch("strkeys-follow");
    let path = dir.join("device.qrep");
    let cfg = config(&redis, Layout::Plain);
    let running = Running::start(&cfg, spec(&path, DEVICE)).unwrap();
    let handle = running.handle();
    assert_eq!(handle.key_kind(), DEVICE);
    assert_eq!(handle.live_rows(), 500);
    for n in [0, 1, 250, 499] {
        assert_eq!(read(&handle, &name(n)), Some(vector(&name(n), 0)), "{}", name(n));
    }
    assert_eq!(read(&handle, "device-00500/ü"), None);
    assert_eq!(running.status().skipped_total.load(Ordering::Relaxed), 1, "the over-long key");

    // Followed while running: a put, an overwrite and a delete.
    p.put_str("device", b"new", &vector("new", 1)).unwrap();
    p.put_str("device", name(7).as_bytes(), &vector(&name(7), 2)).unwrap();
    p.delete_str("device", name(8).as_bytes()).unwrap();
    // An over-long key through the script itself (it does not know the replica's limit):
    // the stream entry is skipped, and the ones after it applied.
    let lua_long = [b'k'; 70];
    p.put_str("device", &lua_long[..64], &vector("k64", 3)).unwrap();
    let sha = redis.conn().command(&[b"SCRIPT", b"LOAD", contract::PUBLISH_LUA.as_bytes()]).unwrap();
    let sha = sha.into_bytes().unwrap();
    let mut entity = b"device:".to_vec();
    entity.extend_from_slice(&lua_long);
    let keys = Layout::Plain.keys("device", 0);
    let reply = redis
        .conn()
        .command(&[
            b"EVALSHA",
            &sha,
            b"5",
            &entity,
            keys.seq.as_bytes(),
            keys.stream.as_bytes(),
            keys.epoch.as_bytes(),
            keys.kind.as_bytes(),
            b"put",
            &contract::encode_vector(&[1.0; DIM]),
            b"1000",
            b"0",
            b"string",
        ])
        .unwrap();
    assert!(matches!(reply, Reply::Int(_)), "{reply:?}");
    p.put_str("device", b"after", &vector("after", 4)).unwrap();
    let want = seq(&redis, &keys.seq);
    running.wait("the stream to be applied", |r| r.status().applied_seq.load(Ordering::Relaxed) == want);
    assert_eq!(read(&handle, "new"), Some(vector("new", 1)));
    assert_eq!(read(&handle, &name(7)), Some(vector(&name(7), 2)));
    assert_eq!(read(&handle, &name(8)), None);
    assert_eq!(read(&handle, std::str::from_utf8(&lua_long[..64]).unwrap()), Some(vector("k64", 3)));
    assert_eq!(read(&handle, "after"), Some(vector("after", 4)));
    assert_eq!(handle.live_rows(), 502);
    assert_eq!(running.status().skipped_total.load(Ordering::Relaxed), 2, "and the over-long stream entry");
    assert_eq!(running.status().resyncs_total.load(Ordering::Relaxed), 1, "the first sync only");
    drop(running);

    // Written while no replica follows; the restart is warm (its file, its
    // checkpoint) and catches up from the stream without a resync.
    p.put_str("device", b"while-down", &vector("while-down", 5)).unwrap();
    p.delete_str("device", name(9).as_bytes()).unwrap();
    let running = Running::start(&cfg, spec(&path, DEVICE)).unwrap();
    let handle = running.handle();
    let want = seq(&redis, &keys.seq);
    running.wait("the restart to catch up", |r| r.status().applied_seq.load(Ordering::Relaxed) == want);
    assert_eq!(read(&handle, "while-down"), Some(vector("while-down", 5)));
    assert_eq!(read(&handle, &name(9)), None);
    assert_eq!(read(&handle, &name(7)), Some(vector(&name(7), 2)));
    assert_eq!(running.status().resyncs_total.load(Ordering::Relaxed), 0, "caught up from the checkpoint");

    // Redis emptied under it: the resync is held and the replica keeps its rows.
    redis.conn().command(&[b"FLUSHALL"]).unwrap();
    running.wait("the resync to be held", |r| r.status().resync_held.load(Ordering::Relaxed));
    assert_eq!(handle.live_rows(), 502);
    assert_eq!(read(&handle, "while-down"), Some(vector("while-down", 5)));
}

#[test]
fn a_gap_in_a_string_groups_stream_resyncs_it_whole() {
    let redis = RedisServer::start();
    let mut p = publisher(&redis, Layout::Plain);
    put_range(&mut p, 0..300, 0);
    let dir = scratch("strkeys-gap");
    let path = dir.join("device.qrep");
    let cfg = config(&redis, Layout::Plain);
    drop(Running::start(&cfg, spec(&path, DEVICE)).unwrap());
    // While it is down, the stream is trimmed past its position.
    put_range(&mut p, 0..300, 1);
    p.delete_str("device", name(5).as_bytes()).unwrap();
    let keys = Layout::Plain.keys("device", 0);
    redis.conn().command(&[b"XTRIM", keys.stream.as_bytes(), b"MAXLEN", b"10"]).unwrap();
    let running = Running::start(&cfg, spec(&path, DEVICE)).unwrap();
    let handle = running.handle();
    let want = seq(&redis, &keys.seq);
    running.wait("the resync and the replay", |r| r.status().applied_seq.load(Ordering::Relaxed) == want);
    assert_eq!(running.status().resyncs_total.load(Ordering::Relaxed), 1, "the gap was resynced");
    assert_eq!(handle.live_rows(), 299);
    assert_eq!(read(&handle, &name(5)), None);
    for n in [0, 6, 299] {
        assert_eq!(read(&handle, &name(n)), Some(vector(&name(n), 1)), "{}", name(n));
    }
}

#[test]
fn the_bucketed_layout_takes_string_keys() {
    let redis = RedisServer::start();
    let layout = Layout::bucketed(4).unwrap();
    let mut p = publisher(&redis, layout);
    put_range(&mut p, 0..400, 0);
    let mut conn = redis.conn();
    for b in 0..4 {
        let keys = layout.keys("device", b);
        assert!(seq(&redis, &keys.seq) > 50, "bucket {b} has its share");
        assert_eq!(conn.command(&[b"GET", keys.kind.as_bytes()]).unwrap(), Reply::Bulk(b"string".to_vec()));
    }
    let stored =
        conn.command(&[b"GET", &layout.key_of("device", contract::EntityKey::Str(name(3).as_bytes()))]).unwrap();
    assert_eq!(stored, Reply::Bulk(contract::encode_vector(&vector(&name(3), 0))));

    let dir = scratch("strkeys-buckets");
    let path = dir.join("device.qrep");
    let running = Running::start(&config(&redis, layout), spec(&path, DEVICE)).unwrap();
    let handle = running.handle();
    assert_eq!(handle.parts(), 4);
    assert_eq!(handle.live_rows(), 400);
    for n in [0, 3, 399] {
        assert_eq!(read(&handle, &name(n)), Some(vector(&name(n), 0)), "{}", name(n));
    }
    for b in 0..4 {
        assert!(quiver::features::replica::bucket_path(&path, b).exists(), "bucket {b}'s file");
    }
    p.put_str("device", name(3).as_bytes(), &vector(&name(3), 1)).unwrap();
    p.delete_str("device", name(4).as_bytes()).unwrap();
    running.wait("the buckets' streams to be applied", |_| {
        read(&handle, &name(3)) == Some(vector(&name(3), 1)) && read(&handle, &name(4)).is_none()
    });
    assert_eq!(handle.live_rows(), 399);
}

#[test]
fn key_kinds_do_not_mix() {
    let redis = RedisServer::start();
    let mut strings = publisher(&redis, Layout::Plain);
    strings.put_str("device", b"alice", &[1.0; DIM]).unwrap();
    let mut ids = Publisher::new(redis.conn()).unwrap();
    ids.put("user", 1, &[1.0; DIM]).unwrap();

    // A u64 writer on a string group, and a string writer on a u64 group.
    let refused = ids.put("device", 1, &[1.0; DIM]).unwrap_err();
    assert!(
        matches!(&refused, PublishError::Contract(ContractError::KeyKind { group, stored, writer, .. })
            if group == "device" && stored == "string" && writer == "u64"),
        "{refused}"
    );
    let refused = strings.put_str("user", b"bob", &[1.0; DIM]).unwrap_err();
    assert!(
        matches!(&refused, PublishError::Contract(ContractError::KeyKind { stored, writer, .. })
            if stored == "u64" && writer == "string"),
        "{refused}"
    );
    let refused = strings.delete_many_str("user", &[b"bob".to_vec()], |_, _| {}).unwrap_err();
    assert!(refused.to_string().contains("quiver:keys:user says group 'user' has u64 keys"), "{refused}");
    // A group written before kinds were recorded (a counter, no kind) is a u64 group.
    let mut conn = redis.conn();
    conn.command(&[b"DEL", b"quiver:keys:user"]).unwrap();
    let refused = strings.put_str("user", b"bob", &[1.0; DIM]).unwrap_err();
    assert!(matches!(refused, PublishError::Contract(ContractError::KeyKind { .. })), "{refused}");
    ids.put("user", 2, &[2.0; DIM]).unwrap();
    assert_eq!(conn.command(&[b"GET", b"quiver:keys:user"]).unwrap(), Reply::Bulk(b"u64".to_vec()));
    // The script's older form is a u64 writer: refused on a string group.
    let sha = conn.command(&[b"SCRIPT", b"LOAD", contract::PUBLISH_LUA.as_bytes()]).unwrap().into_bytes().unwrap();
    let keys = Layout::Plain.keys("device", 0);
    let old = conn
        .command(&[
            b"EVALSHA",
            &sha,
            b"4",
            b"device:7",
            keys.seq.as_bytes(),
            keys.stream.as_bytes(),
            keys.epoch.as_bytes(),
            b"put",
            &contract::encode_vector(&[1.0; DIM]),
            b"1000",
        ])
        .unwrap_err();
    assert!(
        matches!(&old, RedisError::Server { message, .. } if message.contains("key kind string in quiver:keys:device")),
        "{old:?}"
    );
    assert_eq!(conn.command(&[b"GET", b"device:7"]).unwrap(), Reply::Nil);

    // Keys outside the limit, or of the publisher's other kind, are refused before Redis.
    let before = conn.command(&[b"INFO", b"commandstats"]).unwrap().into_bytes().unwrap();
    let before = String::from_utf8_lossy(&before).into_owned();
    let calls = |info: &str| info.lines().find(|l| l.starts_with("cmdstat_evalsha:")).map(str::to_string);
    let mut short = publisher(&redis, Layout::Plain).with_key_kind(KeyKind::Str { bytes_max: 4 }).unwrap();
    assert!(matches!(
        short.put_str("device", b"alice", &[1.0; DIM]),
        Err(PublishError::Contract(ContractError::KeyBytes { bytes: 5, bytes_max: 4 }))
    ));
    assert!(matches!(
        short.put_str("device", b"", &[1.0; DIM]),
        Err(PublishError::Contract(ContractError::KeyBytes { bytes: 0, .. }))
    ));
    let rows = vec![(b"ok".to_vec(), vec![1.0; DIM]), (b"too-long".to_vec(), vec![1.0; DIM])];
    let err = short.put_many_str("device", &rows, |_, _| {}).unwrap_err();
    assert!(err.to_string().starts_with("entity too-long: a key of 8 bytes"), "{err}");
    assert!(matches!(
        short.put("device", 1, &[1.0; DIM]),
        Err(PublishError::Contract(ContractError::KeyKindUsed { .. }))
    ));
    assert!(matches!(
        ids.put_str("user", b"x", &[1.0; DIM]),
        Err(PublishError::Contract(ContractError::KeyKindUsed { .. }))
    ));
    assert!(matches!(
        Publisher::new(redis.conn()).unwrap().with_key_kind(KeyKind::Str { bytes_max: 65 }),
        Err(PublishError::Contract(ContractError::KeyBytesMax { bytes_max: 65 }))
    ));
    let after = conn.command(&[b"INFO", b"commandstats"]).unwrap().into_bytes().unwrap();
    assert_eq!(calls(&before), calls(&String::from_utf8_lossy(&after)), "nothing was sent");

    // A replica of the other kind refuses the group, naming it, without waiting out its timeout.
    let dir = scratch("strkeys-kinds");
    let mut user = spec(&dir.join("user.qrep"), DEVICE);
    user.name = "user".into();
    let started = Instant::now();
    let refused = Running::start(&config(&redis, Layout::Plain), user).err().expect("a string replica of a u64 group");
    assert!(
        matches!(&refused, RefreshError::KeyKind { group, stored, .. } if group == "user" && stored == "u64"),
        "{refused}"
    );
    assert!(started.elapsed() < Duration::from_secs(10), "refused at once, not after the sync timeout");
    assert!(!dir.join("user.qrep").exists(), "no empty file is left to be served");
    let target = feed::sync::GroupTarget {
        link: None,
        group: "device",
        layout: Layout::Plain,
        key_kind: KeyKind::U64,
        path: &dir.join("device-u64.qrep"),
        dim: DIM,
        storage: Storage::F32,
        default: &[0.0; DIM],
        batch_keys_max: 100,
        connections: 1,
    };
    let source = feed::redis_cluster::RedisSource::Node(redis.config());
    let refused = feed::sync::sync_group(&source, &target, &mut |_| {}).expect_err("a u64 copy of a string group");
    assert!(refused.to_string().contains("quiver:keys:device says its keys are string"), "{refused}");

    // An existing u64 file opened for a string-keyed group: refused, naming
    // the group, the file and both kinds; the file is left where it is.
    let path = dir.join("device.qrep");
    drop(ReplicaWriter::create(&path, "device", DIM as u32, Storage::F32, 16, &[0.0; DIM]).unwrap());
    let refused = Running::start(&config(&redis, Layout::Plain), spec(&path, DEVICE)).err().expect("a u64 file");
    assert!(
        matches!(&refused, RefreshError::KeyKindMismatch { group, found: KeyKind::U64, configured, .. }
            if group == "device" && *configured == DEVICE),
        "{refused}"
    );
    let message = refused.to_string();
    assert!(message.contains(&path.display().to_string()) && message.contains("u64 keys"), "{message}");
    assert!(message.contains("string keys of up to 64 bytes"), "{message}");
    assert!(path.exists(), "not set aside as damage");
}

fn run(args: &[&str]) -> std::process::Output {
    Command::new(BIN).args(args).output().unwrap()
}

#[test]
fn cli_puts_loads_deletes_and_syncs_a_string_keyed_group() {
    let redis = RedisServer::start();
    let url = redis.url();
    let dir = scratch("strkeys-cli");
    let target = ["--redis", url.as_str(), "--group", "device", "--key-bytes", "64"];
    let out = run(&[&["features", "put"][..], &target, &["--id", "alice", "--values", "1,2"]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "device:alice seq 1");
    let input = dir.join("devices.txt");
    std::fs::write(&input, "# devices\ndefault,0,0\nbob,3,4\n42,5,6\ncarol,7,8\n").unwrap();
    let out = run(&[&["features", "load"][..], &target, &["--input", input.to_str().unwrap()]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("loaded 3 entities of dim 2"), "{out:?}");
    let out = run(&[&["features", "delete"][..], &target, &["--id", "carol"]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // Without --key-bytes the ids are u64: a string is refused, and a u64
    // writer on this group is refused by Redis.
    let plain = ["--redis", url.as_str(), "--group", "device"];
    let out = run(&[&["features", "put"][..], &plain, &["--id", "alice", "--values", "1,2"]].concat());
    assert!(String::from_utf8_lossy(&out.stderr).contains("'alice' is not a u64 id"), "{out:?}");
    let out = run(&[&["features", "put"][..], &plain, &["--id", "5", "--values", "1,2"]].concat());
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("has string keys; this writer writes u64 keys"), "{out:?}");
    let long = "x".repeat(65);
    let out = run(&[&["features", "put"][..], &target, &["--id", &long, "--values", "1,2"]].concat());
    assert!(String::from_utf8_lossy(&out.stderr).contains("a key of 65 bytes"), "{out:?}");

    let file = dir.join("device.qrep");
    let sync = |key_bytes: &[&str]| {
        let args = ["replica", "sync", "--redis", &url, "--group", "device", "--dim", "2", "--out"];
        run(&[&args[..], &[file.to_str().unwrap()], key_bytes].concat())
    };
    let out = sync(&[]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("says its keys are string"), "{out:?}");
    let out = sync(&["--key-bytes", "64"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("synced 3 entities of group device"), "{out:?}");
    let r = quiver::features::replica::Replica::open(&file, "device").unwrap();
    assert_eq!(r.key_kind(), DEVICE);
    let mut v = [0.0; 2];
    for (key, want) in [("alice", [1.0, 2.0]), ("bob", [3.0, 4.0]), ("42", [5.0, 6.0])] {
        assert!(r.read_str_into(key.as_bytes(), &mut v) && v == want, "{key}: {v:?}");
    }
    assert!(!r.read_str_into(b"carol", &mut v), "deleted");
    let out = run(&["replica", "inspect", "--group", "device", "--file", file.to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("string keys of up to 64 bytes rows 3"), "{out:?}");
}

/// The parent key a row of `handle` names, and whether the row is there.
fn parent_of(handle: &ReplicaHandle, key: &str) -> (bool, Option<quiver::features::replica::EntityKeyBuf>) {
    let mut out = vec![0.0; DIM];
    let mut link = vec![0u32; handle.link_words()];
    let filed = quiver::features::replica::key_hash(key.as_bytes());
    let found = handle.read_linked_into(filed, key.as_bytes(), &mut out, &mut link);
    let mut buf = [0u8; 64];
    let parent = quiver::features::replica::decode_link(&link, handle.link_kind().unwrap(), &mut buf);
    (found, parent.map(|p| p.to_buf()))
}

#[test]
fn a_groups_links_to_its_parent_are_synced_followed_and_kept_across_a_restart() {
    use quiver::features::replica::{EntityKey, EntityKeyBuf};
    let redis = RedisServer::start();
    let mut p = publisher(&redis, Layout::Plain);
    // Devices name their model (a u64 parent), one names none.
    p.put_linked("device", EntityKey::Str(b"d1"), &vector("d1", 0), Some(EntityKey::Id(7))).unwrap();
    p.put_linked("device", EntityKey::Str(b"d2"), &vector("d2", 0), None).unwrap();
    // A value whose tail is no u64 (3 bytes), written around the publisher: skipped and counted.
    let mut bad = contract::encode_vector(&vector("d3", 0));
    bad.extend_from_slice(b"abc");
    redis.conn().command(&[b"SET", b"device:d3", &bad]).unwrap();

    let dir = scratch("strkeys-links");
    let path = dir.join("device.qrep");
    let cfg = config(&redis, Layout::Plain);
    let linked = GroupSpec { link: Some(KeyKind::U64), ..spec(&path, DEVICE) };
    let running = Running::start(&cfg, linked.clone()).unwrap();
    let handle = running.handle();
    assert_eq!(handle.link_kind(), Some(KeyKind::U64));
    assert_eq!(parent_of(&handle, "d1"), (true, Some(EntityKeyBuf::Id(7))));
    assert_eq!(parent_of(&handle, "d2"), (true, None));
    assert_eq!(parent_of(&handle, "d3"), (false, None));
    assert_eq!(running.status().skipped_total.load(Ordering::Relaxed), 1, "the value with a 3-byte tail");

    // Followed: a new parent, a parent dropped, a new row with one.
    p.put_linked("device", EntityKey::Str(b"d2"), &vector("d2", 1), Some(EntityKey::Id(8))).unwrap();
    p.put_linked("device", EntityKey::Str(b"d1"), &vector("d1", 1), None).unwrap();
    p.put_linked("device", EntityKey::Str(b"d4"), &vector("d4", 1), Some(EntityKey::Id(u64::MAX))).unwrap();
    let want = seq(&redis, "quiver:seq:device");
    running.wait("the stream to be applied", |r| r.status().applied_seq.load(Ordering::Relaxed) == want);
    assert_eq!(parent_of(&handle, "d1"), (true, None));
    assert_eq!(parent_of(&handle, "d2"), (true, Some(EntityKeyBuf::Id(8))));
    assert_eq!(parent_of(&handle, "d4"), (true, Some(EntityKeyBuf::Id(u64::MAX))));
    drop(running);

    // A warm restart keeps the links; a file without links, for a group given a parent since,
    // is moved aside and replaced by a full sync from Redis.
    let running = Running::start(&cfg, linked.clone()).unwrap();
    assert_eq!(parent_of(&running.handle(), "d2"), (true, Some(EntityKeyBuf::Id(8))));
    assert_eq!(running.status().resyncs_total.load(Ordering::Relaxed), 0, "warm: no full sync");
    drop(running);
    let plain = dir.join("plain.qrep");
    ReplicaWriter::create_keyed(&plain, "device", DIM as u32, Storage::F32, DEVICE, 16, &[0.0; DIM]).unwrap();
    let running = Running::start(&cfg, GroupSpec { link: Some(KeyKind::U64), ..spec(&plain, DEVICE) }).unwrap();
    assert_eq!(running.handle().link_kind(), Some(KeyKind::U64), "rebuilt with links");
    assert_eq!(parent_of(&running.handle(), "d4"), (true, Some(EntityKeyBuf::Id(u64::MAX))));
    assert!(dir.join("plain.qrep.relinked").exists(), "the old file kept aside");
    drop(running);
    // The publisher refuses a string parent key no group could hold.
    let e =
        p.put_linked("device", EntityKey::Str(b"d5"), &vector("d5", 0), Some(EntityKey::Str(&[b'x'; 65]))).unwrap_err();
    assert!(matches!(e, PublishError::Contract(ContractError::KeyBytes { bytes: 65, .. })), "{e}");
}
