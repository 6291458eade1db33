//! The Redis feed against real redis-server processes: the publish contract, the bulk-load
//! CLI, AUTH and SELECT, timeouts, and a server that dies or stops answering.

mod common;

use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::redis::RedisServer;
use common::BIN;
use quiver::features::feed::contract::{self, encode_vector, entity_key, epoch_key, seq_key, stream_key};
use quiver::features::feed::{ContractError, PublishError, Publisher, RedisConfig, RedisConn, RedisError, Reply};

fn get(conn: &mut RedisConn, key: &str) -> Reply {
    conn.command(&[b"GET", key.as_bytes()]).unwrap()
}

fn bulk(s: &str) -> Reply {
    Reply::Bulk(s.as_bytes().to_vec())
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64
}

/// `XRANGE stream - +` as (id, fields) pairs.
fn stream_entries(conn: &mut RedisConn, group: &str) -> Vec<(String, Vec<Reply>)> {
    let reply = conn.command(&[b"XRANGE", stream_key(group).as_bytes(), b"-", b"+"]).unwrap();
    reply
        .into_array()
        .unwrap()
        .into_iter()
        .map(|entry| {
            let mut parts = entry.into_array().unwrap().into_iter();
            let id = String::from_utf8(parts.next().unwrap().into_bytes().unwrap()).unwrap();
            (id, parts.next().unwrap().into_array().unwrap())
        })
        .collect()
}

#[test]
fn publisher_follows_the_contract() {
    let server = RedisServer::start();
    let mut p = Publisher::new(server.conn()).unwrap();
    let before_ms = now_ms();
    let v42 = [0.5f32, -1.0, 2.25];
    assert_eq!(p.put("user", 42, &v42).unwrap(), 1);
    let epoch = get(p.conn().unwrap(), &epoch_key("user"));
    let epoch_text = String::from_utf8(epoch.as_bytes().unwrap().to_vec()).unwrap();
    assert!(epoch_text.len() >= 16 && epoch_text.bytes().all(|b| b.is_ascii_digit()), "{epoch_text}");
    let epoch_secs: u64 = epoch_text[..epoch_text.len() - 6].parse().unwrap();
    assert!(epoch_secs.abs_diff(before_ms / 1000) < 60, "epoch {epoch_text} is not about now");

    std::thread::sleep(Duration::from_millis(5));
    assert_eq!(p.put("user", 7, &[1.0, 2.0, 3.0]).unwrap(), 2);
    assert_eq!(p.delete("user", 42).unwrap(), 3);
    assert_eq!(p.delete("user", 999).unwrap(), 4, "deleting an absent entity is still a change");
    // The script survives a flush of the script cache.
    p.conn().unwrap().command(&[b"SCRIPT", b"FLUSH"]).unwrap();
    assert_eq!(p.put("user", 8, &[4.0, 5.0, 6.0]).unwrap(), 5);

    let c = p.conn().unwrap();
    assert_eq!(get(c, "user:42"), Reply::Nil);
    assert_eq!(get(c, "user:7"), Reply::Bulk(encode_vector(&[1.0, 2.0, 3.0])));
    assert_eq!(get(c, &seq_key("user")), bulk("5"));
    assert_eq!(get(c, &epoch_key("user")), epoch, "the epoch is set once");

    let entries = stream_entries(c, "user");
    let ids: Vec<&str> = entries.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(ids, ["1-0", "2-0", "3-0", "4-0", "5-0"]);
    let (_, put_fields) = &entries[0];
    assert_eq!(put_fields.len(), 6);
    assert_eq!(put_fields[..4], [bulk("k"), bulk("user:42"), bulk("v"), Reply::Bulk(encode_vector(&v42))]);
    assert_eq!(put_fields[4], bulk("t"));
    let t_ms: u64 = std::str::from_utf8(put_fields[5].as_bytes().unwrap()).unwrap().parse().unwrap();
    assert!(t_ms.abs_diff(before_ms) < 60_000, "t {t_ms} is not about now ({before_ms})");
    let (_, del_fields) = &entries[2];
    assert_eq!(del_fields[..5], [bulk("k"), bulk("user:42"), bulk("d"), bulk("1"), bulk("t")]);
    assert_eq!(del_fields.len(), 6);

    // Groups count independently.
    assert_eq!(p.put("item", 42, &[1.0]).unwrap(), 1);
}

#[test]
fn bad_values_are_refused_and_write_nothing() {
    let server = RedisServer::start();
    let mut p = Publisher::new(server.conn()).unwrap();
    let err = p.put("user", 1, &[1.0, f32::NEG_INFINITY]).unwrap_err();
    assert!(matches!(err, PublishError::Contract(ContractError::NonFinite { index: 1, .. })), "{err}");
    assert!(matches!(p.put("user", 1, &[]), Err(PublishError::Contract(ContractError::Dim { found: 0 }))));
    let too_long = vec![0.0; contract::DIM_MAX + 1];
    assert!(matches!(p.put("user", 1, &too_long), Err(PublishError::Contract(ContractError::Dim { .. }))));
    assert!(matches!(p.put("us:er", 1, &[1.0]), Err(PublishError::Contract(ContractError::Group { .. }))));
    let rows = vec![(1, vec![1.0]), (2, vec![f32::INFINITY])];
    let err = p.put_many("user", &rows, |_, _| {}).unwrap_err();
    assert!(err.to_string().starts_with("entity 2: value 0 is infinite"), "{err}");
    assert_eq!(p.conn().unwrap().command(&[b"DBSIZE"]).unwrap(), Reply::Int(0));
}

#[test]
fn put_many_pipelines_in_order_with_dense_seqs() {
    let server = RedisServer::start();
    let mut p = Publisher::new(server.conn()).unwrap().with_stream_maxlen(100_000);
    let rows: Vec<(u64, Vec<f32>)> = (0..2500u64).map(|i| (i * 3, vec![i as f32, -(i as f32)])).collect();
    let mut calls = Vec::new();
    assert_eq!(p.put_many("item", &rows, |done, total| calls.push((done, total))).unwrap(), 2500);
    assert_eq!(calls, [(1000, 2500), (2000, 2500), (2500, 2500)]);
    let c = p.conn().unwrap();
    assert_eq!(get(c, "item:2997"), Reply::Bulk(encode_vector(&[999.0, -999.0])));
    assert_eq!(c.command(&[b"XLEN", stream_key("item").as_bytes()]).unwrap(), Reply::Int(2500));
    let last = c.command(&[b"XREVRANGE", stream_key("item").as_bytes(), b"+", b"-", b"COUNT", b"1"]).unwrap();
    let last_id = last.into_array().unwrap().remove(0).into_array().unwrap().remove(0);
    assert_eq!(last_id, bulk("2500-0"));
}

#[test]
fn publish_refuses_a_stream_ahead_of_its_counter() {
    let server = RedisServer::start();
    let mut p = Publisher::new(server.conn()).unwrap();
    p.put("user", 1, &[1.0]).unwrap();
    p.put("user", 2, &[2.0]).unwrap();
    p.conn().unwrap().command(&[b"DEL", seq_key("user").as_bytes()]).unwrap();
    let err = p.put("user", 3, &[3.0]).unwrap_err();
    assert!(err.to_string().contains("behind the stream"), "{err}");
    let c = p.conn().unwrap();
    assert_eq!(get(c, "user:3"), Reply::Nil, "no entity write without its stream entry");
    assert_eq!(get(c, &seq_key("user")), bulk("0"), "the failed increment is undone");
}

#[test]
fn pipeline_keeps_error_replies_in_place() {
    let server = RedisServer::start();
    let mut c = server.conn();
    let cmds: Vec<Vec<Vec<u8>>> = [&["SET", "k", "v"][..], &["INCR", "k"], &["GET", "k"]]
        .iter()
        .map(|cmd| cmd.iter().map(|a| a.as_bytes().to_vec()).collect())
        .collect();
    let replies = c.pipeline(&cmds).unwrap();
    assert_eq!(replies[0], Reply::Simple(b"OK".to_vec()));
    assert!(matches!(&replies[1], Reply::Error(m) if m.contains("not an integer")), "{:?}", replies[1]);
    assert_eq!(replies[2], bulk("v"));
    let err = c.command(&[b"INCR", b"k"]).unwrap_err();
    assert!(matches!(err, RedisError::Server { .. }), "{err}");
    assert_eq!(c.command(&[b"PING"]).unwrap(), Reply::Simple(b"PONG".to_vec()), "a server error leaves it usable");
}

#[test]
fn large_values_and_blocking_reads() {
    let server = RedisServer::start();
    let mut c = server.conn();
    let big: Vec<u8> = (0..5_000_000u32).map(|i| (i % 253) as u8).collect();
    c.command(&[b"SET", b"big", &big]).unwrap();
    assert_eq!(get(&mut c, "big"), Reply::Bulk(big));

    // XREAD BLOCK needs a read timeout past its block time; then an idle wait is Nil, not an error.
    c.set_read_timeout_ms(2_000).unwrap();
    let t = Instant::now();
    let reply = c.command(&[b"XREAD", b"BLOCK", b"300", b"STREAMS", b"nothing", b"$"]).unwrap();
    assert_eq!(reply, Reply::Nil);
    assert!(t.elapsed() >= Duration::from_millis(250), "{:?}", t.elapsed());
}

fn run_cli(args: &[&str]) -> std::process::Output {
    Command::new(BIN).args(args).output().expect("run quiver")
}

#[test]
fn cli_loads_a_file_and_puts_and_deletes() {
    let server = RedisServer::start();
    let dir = common::scratch("feed-load");
    let input = dir.join("items.txt");
    let dim = 8;
    let mut text = String::from("# id,f0..f7\ndefault,0,0,0,0,0,0,0,0\n");
    let vector = |id: u64| -> Vec<f32> { (0..dim).map(|j| id as f32 * 0.25 - j as f32).collect() };
    for id in 0..10_000u64 {
        let v: Vec<String> = vector(id).iter().map(f32::to_string).collect();
        text.push_str(&format!("{},{}\n", id * 11, v.join(",")));
    }
    std::fs::write(&input, text).unwrap();
    let out =
        run_cli(&["features", "load", "--redis", &server.url(), "--group", "item", "--input", input.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("loaded 10000 entities of dim 8 into group item"), "{stderr}");
    assert!(stderr.contains("skipped 1 'default' line"), "{stderr}");

    let mut c = server.conn();
    let cmds: Vec<Vec<Vec<u8>>> =
        (0..10_000u64).map(|id| vec![b"GET".to_vec(), entity_key("item", id * 11).into_bytes()]).collect();
    let replies = c.pipeline(&cmds).unwrap();
    for (id, reply) in (0..10_000u64).zip(replies) {
        assert_eq!(reply, Reply::Bulk(encode_vector(&vector(id))), "item {}", id * 11);
    }
    assert_eq!(get(&mut c, &seq_key("item")), bulk("10000"));
    assert_eq!(c.command(&[b"XLEN", stream_key("item").as_bytes()]).unwrap(), Reply::Int(10_000));

    let out =
        run_cli(&["features", "put", "--redis", &server.url(), "--group", "user", "--id", "42", "--values", "-0.5,2"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "user:42 seq 1");
    assert_eq!(get(&mut c, "user:42"), Reply::Bulk(encode_vector(&[-0.5, 2.0])));
    let out = run_cli(&["features", "delete", "--redis", &server.url(), "--group", "user", "--id", "42"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(get(&mut c, "user:42"), Reply::Nil);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn cli_errors_are_one_clear_line() {
    let server = RedisServer::start();
    let dir = common::scratch("feed-bad");
    let input = dir.join("bad.txt");
    std::fs::write(&input, "1,1,2\n2,3,4\n# fine\n3,5,6\nx,7,8\n4,9,10\n").unwrap();
    let out =
        run_cli(&["features", "load", "--redis", &server.url(), "--group", "user", "--input", input.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains(&format!("{}:5: 'x' is not an unsigned 64-bit id", input.display())), "{stderr}");
    assert_eq!(server.conn().command(&[b"DBSIZE"]).unwrap(), Reply::Int(0), "a bad file writes nothing");

    let cases: [(&[&str], &str); 4] = [
        (&["--redis", "http://127.0.0.1:1", "--group", "user", "--id", "1", "--values", "1"], "Redis URL"),
        (&["--redis", "redis://127.0.0.1:1", "--group", "user", "--id", "1", "--values", "1"], "redis 127.0.0.1:1"),
        (&["--redis", &server.url(), "--group", "us:er", "--id", "1", "--values", "1"], "feature group 'us:er'"),
        (&["--redis", &server.url(), "--group", "user", "--id", "1", "--values", "1,inf"], "infinite"),
    ];
    for (args, expected) in cases {
        let mut full = vec!["features", "put"];
        full.extend_from_slice(args);
        let out = run_cli(&full);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}");
        assert!(stderr.starts_with("quiver: ") && stderr.contains(expected), "{args:?}: {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn auth_and_database_selection() {
    let server = RedisServer::start_opts(false, &["--requirepass", "secret"]);
    let with_password = RedisConfig::from_url(&format!("redis://:secret@{}", server.addr())).unwrap();
    let mut c = RedisConn::connect(&with_password).unwrap();
    assert_eq!(c.command(&[b"PING"]).unwrap(), Reply::Simple(b"PONG".to_vec()));
    let as_default_user = RedisConfig::from_url(&format!("redis://default:secret@{}", server.addr())).unwrap();
    RedisConn::connect(&as_default_user).unwrap();

    for url in [format!("redis://{}", server.addr()), format!("redis://:wrong@{}", server.addr())] {
        let err = RedisConn::connect(&RedisConfig::from_url(&url).unwrap()).err().expect(&url);
        assert!(matches!(err, RedisError::Auth { .. }), "{url}: {err}");
    }

    let db3 = RedisConfig::from_url(&format!("redis://:secret@{}/3", server.addr())).unwrap();
    let mut p = Publisher::new(RedisConn::connect(&db3).unwrap()).unwrap();
    p.put("user", 5, &[1.5]).unwrap();
    let mut again = RedisConn::connect(&db3).unwrap();
    assert_eq!(get(&mut again, "user:5"), Reply::Bulk(encode_vector(&[1.5])));
    assert_eq!(get(&mut c, "user:5"), Reply::Nil, "db 0 does not see db 3");

    let db99 = RedisConfig::from_url(&format!("redis://:secret@{}/99", server.addr())).unwrap();
    let err = RedisConn::connect(&db99).err().unwrap();
    assert!(matches!(&err, RedisError::Server { message, .. } if message.contains("out of range")), "{err}");
}

#[test]
fn unreachable_or_silent_servers_fail_fast() {
    // Nothing listens on a port we just freed: refused at once.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let err = RedisConn::connect(&RedisConfig::new(format!("127.0.0.1:{port}"))).err().unwrap();
    assert!(matches!(err, RedisError::Io { .. }), "{err}");
    assert!(err.to_string().contains(&format!("127.0.0.1:{port}")), "{err}");

    // A listener whose accept queue is full drops further SYNs, so a connect can only time
    // out. (Addresses outside the machine are no use here: a sandbox may proxy or refuse them.)
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let mut queued = Vec::new();
    let full = (0..2000).any(|_| match std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(50)) {
        Ok(s) => {
            queued.push(s);
            false
        }
        Err(_) => true,
    });
    assert!(full, "the accept queue never filled");
    let mut config = RedisConfig::new(addr.to_string());
    config.connect_timeout_ms = 200;
    let t = Instant::now();
    let err = RedisConn::connect(&config).err().unwrap();
    assert!(matches!(err, RedisError::Timeout { what: "connect", timeout_ms: 200, .. }), "{err}");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    drop(queued);

    // A peer that accepts and never answers: the read times out.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut config = RedisConfig::new(silent.local_addr().unwrap().to_string());
    config.io_timeout_ms = 200;
    let t = Instant::now();
    let err = RedisConn::connect(&config).err().unwrap();
    assert!(matches!(err, RedisError::Timeout { what: "read", .. }), "{err}");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());

    // A peer that is not Redis at all.
    let http = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let config = RedisConfig::new(http.local_addr().unwrap().to_string());
    let answer = std::thread::spawn(move || {
        use std::io::Write;
        let (mut s, _) = http.accept().unwrap();
        s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n").unwrap();
        std::thread::sleep(Duration::from_millis(200));
    });
    let err = RedisConn::connect(&config).err().unwrap();
    assert!(matches!(err, RedisError::Protocol { .. }), "{err}");
    answer.join().unwrap();
}

#[test]
fn a_stopped_server_times_out_and_a_killed_one_closes() {
    let mut server = RedisServer::start_with(true);
    let mut config = server.config();
    config.io_timeout_ms = 300;
    let mut c = RedisConn::connect(&config).unwrap();
    let mut p = Publisher::new(server.conn()).unwrap();
    p.put("user", 1, &[1.0, 2.0]).unwrap();

    server.pause();
    let t = Instant::now();
    let err = c.command(&[b"PING"]).unwrap_err();
    assert!(matches!(err, RedisError::Timeout { what: "read", timeout_ms: 300, .. }), "{err}");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    assert!(matches!(c.command(&[b"PING"]), Err(RedisError::Broken { .. })), "a timed-out connection is not reused");
    server.resume();

    server.kill();
    let err = p.put("user", 2, &[3.0, 4.0]).unwrap_err();
    assert!(matches!(err, PublishError::Redis(RedisError::Closed { .. } | RedisError::Io { .. })), "{err}");

    // With appendfsync always, what was acknowledged survives SIGKILL.
    server.restart();
    let mut c = server.conn();
    assert_eq!(get(&mut c, "user:1"), Reply::Bulk(encode_vector(&[1.0, 2.0])));
    assert_eq!(get(&mut c, &seq_key("user")), bulk("1"));
}

#[test]
fn one_node_takes_the_bucketed_layout_too() {
    let server = RedisServer::start();
    let layout = contract::Layout::bucketed(4).unwrap();
    let mut p = Publisher::new(server.conn()).unwrap().with_layout(layout).unwrap();
    let rows: Vec<(u64, Vec<f32>)> = (0..400u64).map(|id| (id, vec![id as f32])).collect();
    p.put_many("user", &rows, |_, _| {}).unwrap();
    p.delete("user", 5).unwrap();
    let c = p.conn().unwrap();
    for id in 0..400u64 {
        let want = if id == 5 { Reply::Nil } else { Reply::Bulk(encode_vector(&[id as f32])) };
        assert_eq!(get(c, &layout.entity_key("user", id)), want, "entity {id}");
        assert_eq!(get(c, &entity_key("user", id)), Reply::Nil, "no plain key for {id}");
    }
    let mut changes = 0;
    for b in 0..4 {
        let keys = layout.keys("user", b);
        let seq: u64 = String::from_utf8(get(c, &keys.seq).into_bytes().unwrap()).unwrap().parse().unwrap();
        let len = c.command(&[b"XLEN", keys.stream.as_bytes()]).unwrap().as_int().unwrap() as u64;
        assert_eq!(len, seq, "bucket {b}");
        assert!(seq > 50, "bucket {b} has its share: {seq}");
        changes += seq;
    }
    assert_eq!(changes, 401);
    assert_eq!(get(c, &seq_key("user")), Reply::Nil, "the plain counter is untouched");
}
