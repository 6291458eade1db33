//! The admin listeners against hostile clients: declared bodies that never
//! come, heads dripped a byte at a time, thousands of idle connections, a
//! process out of file descriptors, web pages posting to the controls, and
//! model names that leave `models_dir`. After each, the node still serves.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::{demo_request, http_raw, Server, BIN};
use quiver::wire::Status;

/// The node is up: it answers `/healthz` and scores.
fn still_serves(server: &mut Server) {
    assert!(server.is_running(), "the server died: {}", server.stderr());
    assert_eq!(common::http_get(&format!("http://{}/healthz", server.admin)).0, 200);
    let r = server.client().score(&demo_request(1, 1, vec![1, 2])).unwrap();
    assert_eq!(r.status, Status::Ok);
}

#[test]
fn hostile_content_lengths_and_slow_heads_are_answered_and_the_node_lives() {
    let mut server = Server::start(&["--shards", "1"]);
    let admin = server.admin.clone();

    // A length whose allocation aborted the process, and u64::MAX, which
    // panicked the admin thread.
    for length in ["1000000000000000000", "18446744073709551615"] {
        let head = format!("GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {length}\r\n\r\n");
        let (status, text, _) = http_raw(&admin, head.as_bytes(), Duration::from_secs(3));
        assert!(status.is_some_and(|s| (400..500).contains(&s)), "Content-Length {length}: {text}");
    }
    // A declared body over the limit that never comes, on a held
    // connection: answered at once, and closed.
    let head = "POST /drain HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2000\r\n\r\n";
    let started = Instant::now();
    let (status, text, closed) = http_raw(&admin, head.as_bytes(), Duration::from_secs(3));
    assert_eq!(status, Some(413), "{text}");
    assert!(closed && started.elapsed() < common::PROBE_MAX, "{text}");
    // A chunked body that goes on past the limit.
    let mut chunked = b"POST /drain HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
    for _ in 0..4 {
        chunked.extend_from_slice(b"400\r\n");
        chunked.extend_from_slice(&[b'x'; 1024]);
        chunked.extend_from_slice(b"\r\n");
    }
    let (status, text, _) = http_raw(&admin, &chunked, Duration::from_secs(3));
    assert_eq!(status, Some(413), "{text}");
    assert_eq!(common::http_get(&format!("http://{admin}/readyz")).0, 200, "nothing was drained");

    // Heads too large, in bytes or in fields.
    let big = format!("GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: {}\r\n\r\n", "a".repeat(9 * 1024));
    assert_eq!(http_raw(&admin, big.as_bytes(), Duration::from_secs(3)).0, Some(431));
    let many: String = (0..40).map(|i| format!("X-H{i}: v\r\n")).collect();
    let many = format!("GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n{many}\r\n");
    assert_eq!(http_raw(&admin, many.as_bytes(), Duration::from_secs(3)).0, Some(431));

    // Held connections that time out, side by side, while a probe answers:
    // a small declared body that never comes (408 after 5 s), and a head
    // dripped a byte every 200 ms (closed within 5 s of its first byte).
    // Both are open, their first bytes sent, before the probe.
    let mut body_conn = TcpStream::connect(&admin).unwrap();
    body_conn.write_all(b"POST /drain HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 500\r\n\r\n").unwrap();
    let body_sent = Instant::now();
    let mut s = TcpStream::connect(&admin).unwrap();
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ").unwrap();
    let held_body = std::thread::spawn(move || {
        let (status, text, _) = common::http_read(&mut body_conn, Duration::from_secs(12));
        (status, text, body_sent.elapsed())
    });
    let dripped = std::thread::spawn({
        let started = Instant::now();
        move || {
            s.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
            let mut buf = [0u8; 512];
            while started.elapsed() < Duration::from_secs(12) {
                match s.read(&mut buf) {
                    Ok(_) => return started.elapsed(),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(_) => return started.elapsed(),
                }
                if s.write_all(b"a").is_err() {
                    return started.elapsed();
                }
            }
            started.elapsed()
        }
    });
    let probe = Instant::now();
    assert_eq!(common::http_get(&format!("http://{admin}/readyz")).0, 200);
    assert!(probe.elapsed() < common::PROBE_MAX, "the probe waited {:?}", probe.elapsed());
    let (status, text, waited) = held_body.join().unwrap();
    assert_eq!(status, Some(408), "{text}");
    assert!(waited < Duration::from_secs(9), "{waited:?}");
    let cut_off = dripped.join().unwrap();
    assert!(cut_off >= Duration::from_secs(4) && cut_off < Duration::from_secs(9), "dripped head ran {cut_off:?}");

    assert!(server.metric("quiver_admin_requests_rejected_total") >= 6);
    still_serves(&mut server);
}

/// The server's threads, by name.
fn threads(pid: u32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|n| n.trim().to_string())
        .collect()
}

#[test]
fn two_thousand_idle_connections_neither_add_threads_nor_lock_out_a_probe() {
    let mut server = Server::start(&["--shards", "1"]);
    let pid = server.child.id();
    let before = threads(pid);
    let mut idle = Vec::new();
    let started = Instant::now();
    while idle.len() < 2_000 && started.elapsed() < Duration::from_secs(20) {
        if let Ok(s) = TcpStream::connect_timeout(&server.admin.parse().unwrap(), Duration::from_secs(2)) {
            idle.push(s);
        }
    }
    assert_eq!(idle.len(), 2_000, "connected in {:?}", started.elapsed());
    let probe = Instant::now();
    let (code, _) = common::http_get(&format!("http://{}/readyz", server.admin));
    assert_eq!(code, 200);
    assert!(probe.elapsed() < common::PROBE_MAX, "/readyz took {:?}", probe.elapsed());
    let after = threads(pid);
    assert!(after.len() <= before.len() + 1, "threads grew from {before:?} to {after:?}");
    assert!(server.metric("quiver_admin_connections_evicted_total") >= 2_000 - 256);
    drop(idle);
    still_serves(&mut server);
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().count()
}

fn set_nofile(pid: u32, soft: u64, hard: u64) {
    let status = std::process::Command::new("prlimit")
        .args(["--pid", &pid.to_string(), &format!("--nofile={soft}:{hard}")])
        .status()
        .expect("prlimit runs");
    assert!(status.success());
}

#[test]
fn the_admin_listener_survives_running_out_of_file_descriptors() {
    let mut server = Server::start(&["--shards", "1"]);
    let pid = server.child.id();
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits.lines().find(|l| l.starts_with("Max open files")).unwrap().to_string();
    let fields: Vec<&str> = line.split_whitespace().collect();
    let (soft, hard): (u64, u64) = (fields[3].parse().unwrap(), fields[4].parse().unwrap());
    let headroom = 4;
    set_nofile(pid, (open_fds(pid) + headroom) as u64, hard);
    let admin = server.admin.clone();
    let flood: Vec<TcpStream> = (0..40).filter_map(|_| TcpStream::connect(&admin).ok()).collect();
    let until = Instant::now() + common::WAIT;
    let log = loop {
        let log = server.stderr();
        if log.contains("accept failed") {
            break log;
        }
        assert!(Instant::now() < until, "the server never ran out of descriptors: {log}");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(log.contains("raise LimitNOFILE"), "{log}");
    drop(flood);
    set_nofile(pid, soft, hard);
    let until = Instant::now() + common::WAIT;
    while common::http_get(&format!("http://{admin}/readyz")).0 != 200 {
        assert!(Instant::now() < until, "the admin listener did not come back");
    }
    assert!(server.metric("quiver_admin_accept_errors_total") > 0);
    still_serves(&mut server);
}

#[test]
fn controls_refuse_web_pages_and_names_outside_models_dir() {
    // A registry, and beside it a model file that a name with `..` would reach.
    let root = common::scratch("admin-names");
    let mut served = quiver::loadgen::demo::model();
    served.version = 1;
    quiver::registry::publish(&root.join("models"), &served).unwrap();
    let mut outside = served.clone();
    outside.name = "evil".into();
    quiver::registry::publish(&root.join("outside"), &outside).unwrap();
    let models = root.join("models");
    let mut server = Server::start(&["--shards", "1", "--models-dir", models.to_str().unwrap()]);
    let admin = server.admin.clone();
    let post = |headers: &str| {
        let req = format!("POST /drain HTTP/1.1\r\n{headers}Content-Length: 0\r\nConnection: close\r\n\r\n");
        http_raw(&admin, req.as_bytes(), Duration::from_secs(3))
    };
    for headers in [
        "Host: 127.0.0.1\r\nOrigin: http://evil.example\r\n",
        "Host: 127.0.0.1\r\nSec-Fetch-Site: cross-site\r\n",
        "Host: rebound.evil.example:7412\r\n",
    ] {
        let (status, text, _) = post(headers);
        assert_eq!(status, Some(403), "{headers}: {text}");
        assert!(text.contains("forbidden"), "{text}");
    }
    assert_eq!(common::http_get(&format!("http://{admin}/readyz")).0, 200, "nothing was drained");
    assert_eq!(post("Host: 127.0.0.1\r\n").0, Some(200), "a program on the host may drain");
    assert_eq!(common::http_post(&format!("http://{admin}/undrain")).0, 200);

    for verb in ["canary?version=1&fraction=0.5", "shadow?version=1&fraction=0.5", "load?version=1"] {
        let req =
            format!("POST /models/../outside/evil/{verb} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
        let (status, text, _) = http_raw(&admin, req.as_bytes(), Duration::from_secs(3));
        assert_eq!(status, Some(400), "{verb}: {text}");
        assert!(text.contains("name"), "{text}");
    }
    still_serves(&mut server);
}

#[test]
fn a_routable_admin_listener_needs_consent_to_send_its_token_in_plain_text() {
    let token = common::scratch("admin-plaintext").join("t");
    std::fs::write(&token, "0123456789abcdef0123\n").unwrap();
    let serve = |extra: &[&str]| {
        std::process::Command::new(BIN)
            .args(["serve", "--listen", "127.0.0.1:0", "--admin", "0.0.0.0:0", "--shards", "1", "--data-dir"])
            .arg(common::demo_dir())
            .arg("--admin-token-file")
            .arg(&token)
            .args(extra)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let out = serve(&[]).wait_with_output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("plain HTTP") && err.contains("admin_token_over_plaintext"), "{err}");

    let mut child = serve(&["--admin-token-over-plaintext"]);
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(child.stdout.take().unwrap()));
    let started = lines.any(|l| l.is_ok_and(|l| l.starts_with("quiver listening on ")));
    let _ = child.kill();
    let _ = child.wait();
    assert!(started, "with consent the server starts");
}
