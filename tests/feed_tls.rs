//! The Redis feed over TLS (`rediss://`) against a real `redis-server`
//! started with `--tls-port`, with a CA, server and client certificates made
//! by the test with `openssl`.

mod common;

use std::time::{Duration, Instant};

use common::pki::Pki;
use common::redis::{free_port, RedisServer};
use common::{demo_dir, run_quiver, scratch, Server};
use quiver::features::feed::{Publisher, RedisConfig, RedisConn};

/// A redis-server with a plain port (for the harness) and a TLS port.
fn tls_redis(pki: &Pki, auth_clients: &str) -> (RedisServer, u16) {
    let tls_port = free_port().to_string();
    let (cert, key, ca) = (pki.path("server.crt"), pki.path("server.key"), pki.path("ca.crt"));
    let args = [
        "--tls-port",
        tls_port.as_str(),
        "--tls-cert-file",
        &cert,
        "--tls-key-file",
        &key,
        "--tls-ca-cert-file",
        &ca,
        "--tls-auth-clients",
        auth_clients,
    ];
    (RedisServer::start_opts(false, &args), tls_port.parse().unwrap())
}

fn connect(url: &str) -> Result<RedisConn, String> {
    let config = RedisConfig::from_url(url).map_err(|e| e.to_string())?;
    let mut conn = RedisConn::connect(&config).map_err(|e| e.to_string())?;
    conn.command(&[b"PING"]).map_err(|e| e.to_string())?;
    Ok(conn)
}

#[test]
fn the_feed_follows_redis_over_tls_and_refuses_what_it_cannot_verify() {
    let pki = Pki::new("feed-tls");
    let (redis, port) = tls_redis(&pki, "optional");
    let url = format!("rediss://localhost:{port}?ca={}", pki.path("ca.crt"));

    // The publisher and the CLI speak TLS.
    let mut p = Publisher::new(connect(&url).unwrap()).unwrap();
    let rows: Vec<(u64, Vec<f32>)> = (0..1000u64).map(|id| (id, vec![id as f32; 32])).collect();
    p.put_many("item", &rows, |_, _| {}).unwrap();
    p.put_many("user", &rows[..100], |_, _| {}).unwrap();
    let (code, out, err) = run_quiver(
        ["features", "put", "--redis", &url, "--group", "item", "--id", "5000", "--values"]
            .into_iter()
            .map(String::from)
            .chain([vec!["0.5"; 32].join(",")]),
    );
    assert_eq!(code, 0, "{out}{err}");

    // The server's feed: a first full sync over TLS, then the stream.
    let dir = scratch("feed-tls-data");
    for f in ["model.qm", "fallback.qm"] {
        std::fs::copy(demo_dir().join(f), dir.join(f)).unwrap();
    }
    let config = dir.join("quiver.toml");
    std::fs::write(&config, format!("[feed]\nredis = \"{url}\"\nblock_ms = 50\n")).unwrap();
    let server = Server::start_with(&dir, &["--config", config.to_str().unwrap(), "--shards", "1"]);
    p.put("item", 7, &[7.5; 32]).unwrap();
    let until = Instant::now() + common::WAIT;
    loop {
        let s = server.stats();
        let item = s.feed.iter().find(|g| g.group == "item").unwrap();
        if item.rows == 1001 && item.applied_seq == 1002 {
            break;
        }
        assert!(Instant::now() < until, "the TLS feed did not catch up: {s:?}\n{}", server.stderr());
        std::thread::sleep(Duration::from_millis(20));
    }
    let r = quiver::features::replica::Replica::open(&dir.join("item.qrep"), "item").unwrap();
    let mut v = vec![0.0f32; 32];
    assert!(r.read_into(7, &mut v) && v == vec![7.5; 32], "the streamed change arrived over TLS");
    assert!(r.read_into(5000, &mut v) && v == vec![0.5; 32]);
    drop(redis);

    // What cannot be verified is refused at connect, saying why.
    let (redis, port) = tls_redis(&pki, "optional");
    let wrong_ca = format!("rediss://localhost:{port}?ca={}", pki.path("other-ca.crt"));
    let err = connect(&wrong_ca).err().expect("a wrong CA is refused");
    assert!(err.contains("TLS") && err.contains("UnknownIssuer"), "{err}");
    let wrong_name = format!("rediss://localhost:{port}?ca={}&sni=redis.example.com", pki.path("ca.crt"));
    let err = connect(&wrong_name).err().expect("a wrong name is refused");
    assert!(err.contains("TLS") && err.contains("not valid for name"), "{err}");
    let (code, _, err) = run_quiver(
        ["replica", "sync", "--redis", &wrong_ca, "--group", "item", "--dim", "32", "--out"]
            .into_iter()
            .map(String::from)
            .chain([dir.join("x.qrep").display().to_string()]),
    );
    assert_ne!(code, 0);
    assert!(err.contains("UnknownIssuer"), "{err}");
    assert!(RedisConfig::from_url(&format!("redis://localhost:{port}?ca=x")).is_err(), "options are for rediss://");
    let err = RedisConfig::from_url(&format!("rediss://localhost:{port}?cert=x")).unwrap_err().to_string();
    assert!(err.contains("both cert= and key="), "{err}");
    drop(redis);

    // A server that verifies clients takes only a client with a certificate.
    let (_redis, port) = tls_redis(&pki, "yes");
    let bare = format!("rediss://localhost:{port}?ca={}", pki.path("ca.crt"));
    assert!(connect(&bare).is_err(), "no client certificate");
    let with_cert = format!("{bare}&cert={}&key={}", pki.path("client.crt"), pki.path("client.key"));
    connect(&with_cert).unwrap();
}
