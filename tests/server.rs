//! End-to-end tests against a real `quiver serve` process.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::{demo_dir, demo_request, reference_scores, Server, INT8_SCORE_TOLERANCE};
use quiver::client::ClientError;
use quiver::wire::{RequestEncoder, RequestSpec, Status, Tier};

fn assert_close(got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol, "candidate {i}: score {g}, reference {w}");
    }
}

#[test]
fn scores_match_the_f32_reference() {
    let server = Server::start(&["--shards", "2"]);
    let mut c = server.client();
    let mut worst = 0.0f32;
    for i in 0..200u64 {
        let items: Vec<u64> = (0..32).map(|k| (i * 7919 + k * 104_729) % 10_000).collect();
        let spec = demo_request(i, (i * 15_485_863) % 100_000, items);
        let r = c.score(&spec).unwrap();
        assert_eq!((r.request_id, r.status, r.tier, r.model_version), (i, Status::Ok, Tier::Primary, 1));
        assert_eq!(r.features_missing, 0);
        let (want, _) = reference_scores(demo_dir(), &spec);
        assert_close(&r.scores, &want, INT8_SCORE_TOLERANCE);
        for (g, w) in r.scores.iter().zip(&want) {
            worst = worst.max((g - w).abs());
        }
    }
    eprintln!("largest |int8 - f32| score difference: {worst}");
}

#[test]
fn f32_backend_matches_the_reference_closely() {
    let server = Server::start(&["--shards", "1", "--backend", "f32"]);
    let mut c = server.client();
    let spec = demo_request(1, 4242, (0..32).collect());
    let r = c.score(&spec).unwrap();
    let (want, _) = reference_scores(demo_dir(), &spec);
    assert_close(&r.scores, &want, 1e-5);
}

#[test]
fn unknown_ids_are_counted_and_still_scored() {
    let server = Server::start(&["--shards", "1"]);
    let mut c = server.client();
    let spec = demo_request(5, 1_000_000_000, vec![1, 1_000_000_001, 2, 1_000_000_002]);
    let r = c.score(&spec).unwrap();
    assert_eq!(r.status, Status::Ok);
    assert_eq!(r.features_missing, 3);
    let (want, missing) = reference_scores(demo_dir(), &spec);
    assert_eq!(missing, 3);
    assert_close(&r.scores, &want, INT8_SCORE_TOLERANCE);
}

#[test]
fn a_thousand_pipelined_requests_on_one_connection() {
    let server = Server::start(&["--shards", "2"]);
    let mut c = server.client();
    let specs: Vec<RequestSpec> = (0..1000u64)
        .map(|i| demo_request(10_000 + i, i * 97 % 100_000, (0..32).map(|k| (i + k * 31) % 10_000).collect()))
        .collect();
    let responses = c.pipeline(&specs, 1000).unwrap();
    assert_eq!(responses.len(), 1000);
    for (spec, r) in specs.iter().zip(&responses) {
        assert_eq!((r.request_id, r.status), (spec.request_id, Status::Ok));
        assert_eq!(r.scores.len(), 32);
    }
    // Pipelining does not change results: a lone request scores the same.
    let again = c.score(&specs[500]).unwrap();
    assert_eq!(again.scores, responses[500].scores);
}

/// One frame a round: every buffered frame is still answered, in order,
/// with nothing left waiting for another read, while a second connection on
/// the same shard is served between the burst's rounds.
#[test]
fn a_burst_answered_one_frame_a_round_loses_nothing() {
    let cfg = common::scratch("frames-per-round").join("q.toml");
    std::fs::write(&cfg, "[limits]\nframes_per_round_max = 1\n").unwrap();
    let server = Server::start(&["--shards", "1", "--config", cfg.to_str().unwrap()]);
    let specs: Vec<RequestSpec> = (0..1000u64)
        .map(|i| demo_request(20_000 + i, i * 89 % 100_000, (0..32).map(|k| (i + k * 17) % 10_000).collect()))
        .collect();
    std::thread::scope(|s| {
        let burst = s.spawn(|| server.client().pipeline(&specs, 1000).unwrap());
        let mut other = server.client();
        for i in 0..20u64 {
            let r = other.score(&demo_request(i, i, vec![i, i + 1])).unwrap();
            assert_eq!((r.request_id, r.status), (i, Status::Ok));
        }
        let responses = burst.join().unwrap();
        assert_eq!(responses.len(), 1000);
        for (spec, r) in specs.iter().zip(&responses) {
            assert_eq!((r.request_id, r.status, r.scores.len()), (spec.request_id, Status::Ok, 32));
        }
    });
}

#[test]
fn fifty_concurrent_connections_spread_over_the_shards() {
    let mut server = Server::start(&["--shards", "2"]);
    let addr = server.addr.clone();
    std::thread::scope(|s| {
        for t in 0..50u64 {
            let addr = addr.clone();
            s.spawn(move || {
                let mut c = quiver::client::Client::connect(&addr, Duration::from_secs(20)).unwrap();
                for i in 0..20u64 {
                    let id = t * 1000 + i;
                    let spec = demo_request(id, id % 100_000, (0..32).map(|k| (id + k) % 10_000).collect());
                    let r = c.score(&spec).unwrap();
                    assert_eq!((r.request_id, r.status, r.scores.len()), (id, Status::Ok, 32));
                }
            });
        }
    });
    assert_eq!(server.terminate(), 0);
    let log = server.stderr();
    let per_shard: Vec<u64> = log
        .lines()
        .filter(|l| l.contains("shard stopped"))
        .map(|l| {
            let v = l.split("connections=").nth(1).unwrap().split_whitespace().next().unwrap();
            v.parse().unwrap()
        })
        .collect();
    assert_eq!(per_shard.len(), 2, "{log}");
    assert_eq!(per_shard.iter().sum::<u64>(), 50, "{log}");
    assert!(per_shard.iter().all(|&n| n > 0), "both shards accepted connections: {per_shard:?}");
}

#[test]
fn an_expired_budget_gets_deadline_exceeded() {
    let server = Server::start(&["--shards", "1"]);
    let mut c = server.client();
    let mut spec = demo_request(9, 1, (0..32).collect());
    spec.budget_us = 1;
    let r = c.score(&spec).unwrap();
    assert_eq!((r.request_id, r.status), (9, Status::DeadlineExceeded));
    assert!(r.scores.is_empty());
    // The connection is fine afterwards.
    spec.budget_us = 1_000_000;
    assert_eq!(c.score(&spec).unwrap().status, Status::Ok);
}

fn frame(payload: &[u8]) -> Vec<u8> {
    let mut f = (payload.len() as u32).to_le_bytes().to_vec();
    f.extend_from_slice(payload);
    f
}

/// Reads until EOF or timeout; returns what arrived and whether EOF was seen.
fn read_to_close(s: &mut TcpStream) -> (Vec<u8>, bool) {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return (got, true),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(_) => return (got, false),
        }
    }
}

fn decode_all(bytes: &[u8]) -> Vec<quiver::wire::Response> {
    let codec = quiver::client::Codec::default();
    let mut out = Vec::new();
    let mut at = 0;
    while let Some((r, used)) = codec.decode(&bytes[at..]).unwrap() {
        out.push(r);
        at += used;
    }
    assert_eq!(at, bytes.len(), "only whole response frames");
    out
}

#[test]
fn malformed_input_is_answered_or_closed_and_harms_nobody_else() {
    let mut server = Server::start(&["--shards", "1"]);
    let mut bystander = server.client();
    let check_bystander = |c: &mut quiver::client::Client, id: u64| {
        let r = c.score(&demo_request(id, 3, vec![1, 2, 3])).unwrap();
        assert_eq!((r.request_id, r.status), (id, Status::Ok));
    };
    check_bystander(&mut bystander, 1);

    // Truncated frame: the prefix promises 100 bytes, 10 arrive, then EOF.
    let mut s = TcpStream::connect(&server.addr).unwrap();
    s.write_all(&100u32.to_le_bytes()).unwrap();
    s.write_all(&[7u8; 10]).unwrap();
    s.shutdown(std::net::Shutdown::Write).unwrap();
    let (got, closed) = read_to_close(&mut s);
    assert!(closed && got.is_empty(), "truncated frame: closed without an answer");
    check_bystander(&mut bystander, 2);

    // Oversized length prefix: one BadRequest, then the connection closes.
    let mut s = TcpStream::connect(&server.addr).unwrap();
    s.write_all(&(1u32 << 30).to_le_bytes()).unwrap();
    s.write_all(&[0u8; 64]).unwrap();
    let (got, closed) = read_to_close(&mut s);
    let rs = decode_all(&got);
    assert!(closed);
    assert_eq!(rs.len(), 1);
    assert_eq!((rs[0].request_id, rs[0].status), (0, Status::BadRequest));
    assert!(rs[0].error.contains("exceeds the limit"), "{}", rs[0].error);
    check_bystander(&mut bystander, 3);

    // Garbage bytes: answered with BadRequest or closed, never a crash.
    let mut x = 0x2545_f491_4f6c_dd1du64;
    for round in 0..20 {
        let soup: Vec<u8> = (0..(37 + round * 53))
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let mut s = TcpStream::connect(&server.addr).unwrap();
        s.write_all(&soup).unwrap();
        s.shutdown(std::net::Shutdown::Write).unwrap();
        let (got, closed) = read_to_close(&mut s);
        assert!(closed, "round {round}: the server closes after garbage and EOF");
        for r in decode_all(&got) {
            assert_eq!(r.status, Status::BadRequest);
        }
    }
    check_bystander(&mut bystander, 4);

    // A well-framed buffer that fails verification: BadRequest, connection stays.
    let mut c = server.client();
    c.send_raw(&frame(&[0xEEu8; 48])).unwrap();
    let r = c.recv().unwrap();
    assert_eq!((r.request_id, r.status), (0, Status::BadRequest));
    assert!(r.error.contains("verification"), "{}", r.error);
    // A zero-length frame cannot be resynchronised: BadRequest and close.
    let mut s = TcpStream::connect(&server.addr).unwrap();
    s.write_all(&0u32.to_le_bytes()).unwrap();
    let (got, closed) = read_to_close(&mut s);
    assert!(closed);
    assert_eq!(decode_all(&got)[0].status, Status::BadRequest);

    // More candidates than the limit (256): BadRequest with the request's id.
    let too_many = demo_request(77, 1, (0..257).collect());
    let r = c.score(&too_many).unwrap();
    assert_eq!((r.request_id, r.status), (77, Status::BadRequest));
    assert!(r.error.contains("257 candidates exceed the limit of 256"), "{}", r.error);
    // Wrong context length, and an unknown model name.
    let mut bad_ctx = demo_request(78, 1, vec![1]);
    bad_ctx.context = vec![1.0; 3];
    assert_eq!(c.score(&bad_ctx).unwrap().status, Status::BadRequest);
    let mut bad_model = demo_request(79, 1, vec![1]);
    bad_model.model = "nope".into();
    assert_eq!(c.score(&bad_model).unwrap().status, Status::ModelNotFound);
    // The same connection still serves good requests.
    let r = c.score(&demo_request(80, 1, vec![1, 2])).unwrap();
    assert_eq!(r.status, Status::Ok);

    check_bystander(&mut bystander, 5);
    assert!(server.is_running());
    assert_eq!(server.terminate(), 0);
}

#[test]
fn the_connection_limit_closes_extra_connections() {
    let cfg = common::scratch("connlimit").join("quiver.toml");
    std::fs::write(&cfg, "[limits]\nconnections_per_shard_max = 2\n").unwrap();
    let server = Server::start(&["--shards", "1", "--config", cfg.to_str().unwrap()]);
    let mut a = server.client();
    let mut b = server.client();
    assert_eq!(a.score(&demo_request(1, 1, vec![1])).unwrap().status, Status::Ok);
    assert_eq!(b.score(&demo_request(2, 1, vec![1])).unwrap().status, Status::Ok);
    let mut c = server.client();
    let third = c.score(&demo_request(3, 1, vec![1]));
    assert!(matches!(third, Err(ClientError::Closed) | Err(ClientError::Io(_))), "{third:?}");
    drop(a);
    // The freed slot is usable again once the server has seen the close.
    let until = std::time::Instant::now() + common::WAIT;
    while server.client().score(&demo_request(4, 1, vec![1])).is_err() {
        assert!(std::time::Instant::now() < until, "a closed connection never freed its slot");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn sigterm_drains_and_exits_zero() {
    let mut server = Server::start(&["--shards", "2"]);
    let mut c = server.client();
    let specs: Vec<RequestSpec> = (0..300u64).map(|i| demo_request(i, i, (0..32).collect())).collect();
    let mut bytes = Vec::new();
    let mut enc = RequestEncoder::new();
    for s in &specs {
        enc.encode(s, &mut bytes);
    }
    c.send_raw(&bytes).unwrap();
    // Wait for the first answer so the server has read (some of) the batch.
    let first = c.recv().unwrap();
    assert_eq!(first.status, Status::Ok);
    assert_eq!(server.terminate(), 0);
    // Everything the server read before stopping was answered in full; the
    // rest of the stream ends cleanly at a frame boundary.
    let mut answered = 1;
    loop {
        match c.recv() {
            Ok(r) => {
                assert_eq!(r.status, Status::Ok);
                answered += 1;
            }
            Err(ClientError::Closed) => break,
            Err(e) => panic!("unexpected {e}"),
        }
    }
    assert!((1..=300).contains(&answered));
    assert!(TcpStream::connect(&server.addr).is_err(), "no longer accepting");
}

/// A client that saw the listening line, connected and wrote its requests
/// gets every one answered even when SIGTERM arrives right after its write:
/// the shards accept what is queued and read what is in the socket before
/// they drain (12 trials, the signal a moment after the write).
#[test]
fn sigterm_right_after_start_answers_what_was_already_sent() {
    for trial in 0..12u64 {
        let mut server = Server::start(&["--shards", "1"]);
        let mut c = server.client();
        let mut bytes = Vec::new();
        let mut enc = RequestEncoder::new();
        for i in 0..32u64 {
            enc.encode(&demo_request(trial * 100 + i, i, (0..32).collect()), &mut bytes);
        }
        c.send_raw(&bytes).unwrap();
        assert_eq!(server.terminate(), 0, "trial {trial}");
        let mut answered = 0;
        loop {
            match c.recv() {
                Ok(r) => {
                    assert_eq!(r.status, Status::Ok, "trial {trial}");
                    answered += 1;
                }
                Err(ClientError::Closed) => break,
                Err(e) => panic!("trial {trial}: after {answered} answers: {e}"),
            }
        }
        assert_eq!(answered, 32, "trial {trial}: every request already sent is answered");
    }
}

#[test]
fn a_corrupt_replica_row_is_found_in_the_background_and_a_truncated_file_refused_at_start_up() {
    let dir = common::scratch("corrupt");
    for f in ["user.qrep", "item.qrep", "model.qm"] {
        std::fs::copy(demo_dir().join(f), dir.join(f)).unwrap();
    }
    let item = dir.join("item.qrep");
    let mut bytes = std::fs::read(&item).unwrap();
    let n = bytes.len();
    bytes[n / 2] ^= 0x10;
    std::fs::write(&item, &bytes).unwrap();
    // A flipped byte among the rows: the server serves at once, its
    // background scan names the damage, and rows failing their CRC are
    // served as unknown (replica::tests checks which).
    let server = Server::start_with(&dir, &[]);
    let err = server.wait_stderr("serving only the rows that pass their checksum");
    assert!(err.contains("item.qrep") && err.contains("checksum") && err.contains("corrupt"), "{err}");
    let r = server.client().score(&demo_request(1, 7, vec![1, 2, 3])).unwrap();
    assert_eq!(r.status, Status::Ok);
    drop(server);

    std::fs::write(&item, &bytes[..n - 100]).unwrap();
    let out = std::process::Command::new(common::BIN)
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("truncated"));
}

#[test]
fn the_inference_thread_scores_like_inline() {
    let mut server = Server::start(&["--shards", "2", "--inference", "thread"]);
    let mut c = server.client();
    for i in 0..100u64 {
        let items: Vec<u64> = (0..32).map(|k| (i * 7919 + k * 104_729) % 10_000).collect();
        let spec = demo_request(i, (i * 15_485_863) % 100_000, items);
        let r = c.score(&spec).unwrap();
        assert_eq!((r.request_id, r.status, r.tier), (i, Status::Ok, Tier::Primary));
        let (want, _) = reference_scores(demo_dir(), &spec);
        assert_close(&r.scores, &want, INT8_SCORE_TOLERANCE);
    }
    // Pipelined, up to the stage's 256 slots per shard: responses may come
    // back in any order; all must come back.
    let specs: Vec<RequestSpec> = (0..1000u64)
        .map(|i| demo_request(50_000 + i, i * 13 % 100_000, (0..32).map(|k| (i + k * 7) % 10_000).collect()))
        .collect();
    let responses = c.pipeline(&specs, 200).unwrap();
    assert!(responses.iter().zip(&specs).all(|(r, s)| r.request_id == s.request_id && r.status == Status::Ok));
    // An already-expired budget never reaches the kernel.
    let mut spec = demo_request(9, 1, (0..32).collect());
    spec.budget_us = 1;
    assert_eq!(c.score(&spec).unwrap().status, Status::DeadlineExceeded);
    // Unknown ids, a bad request and an unknown model behave as inline.
    let r = c.score(&demo_request(10, 1_000_000_000, vec![1, 1_000_000_001])).unwrap();
    assert_eq!((r.status, r.features_missing), (Status::Ok, 2));
    let mut bad = demo_request(11, 1, vec![1]);
    bad.model = "nope".into();
    assert_eq!(c.score(&bad).unwrap().status, Status::ModelNotFound);
    // SIGTERM with requests in the stage: every one is answered, exit 0.
    let mut bytes = Vec::new();
    let mut enc = RequestEncoder::new();
    for s in &specs[..200] {
        enc.encode(s, &mut bytes);
    }
    c.send_raw(&bytes).unwrap();
    assert_eq!(c.recv().unwrap().status, Status::Ok);
    assert_eq!(server.terminate(), 0);
    loop {
        match c.recv() {
            Ok(r) => assert_eq!(r.status, Status::Ok),
            Err(ClientError::Closed) => break,
            Err(e) => panic!("unexpected {e}"),
        }
    }
}

#[test]
fn a_full_inference_stage_steps_down_at_once() {
    let cfg = common::scratch("stage-full").join("q.toml");
    std::fs::write(&cfg, "inference = \"thread\"\n[stage]\njobs_per_shard_max = 4\nbatch_wait_us_max = 2000\n")
        .unwrap();
    let server = Server::start(&["--shards", "1", "--config", cfg.to_str().unwrap()]);
    let mut c = server.client();
    let mut bytes = Vec::new();
    let mut enc = RequestEncoder::new();
    for i in 0..64u64 {
        enc.encode(&demo_request(i, i, (0..32).collect()), &mut bytes);
    }
    c.send_raw(&bytes).unwrap();
    let mut by_rung = std::collections::BTreeMap::new();
    for _ in 0..64 {
        let r = c.recv().unwrap();
        assert_eq!(r.status, Status::Ok, "{r:?}");
        if r.tier != Tier::Primary {
            // Overload at first; enough of them open the breaker.
            assert!(matches!(r.reason, quiver::wire::Reason::Overload | quiver::wire::Reason::BreakerOpen), "{r:?}");
            assert_eq!(r.tier, Tier::Fallback, "the demo's fallback model answers: {r:?}");
        }
        *by_rung.entry(quiver::wire::tier_name(r.tier)).or_insert(0) += 1;
    }
    // Four slots: at most a handful reach the stage, the rest step down.
    assert!(by_rung.get("primary").copied().unwrap_or(0) >= 4, "{by_rung:?}");
    assert!(by_rung.get("fallback").copied().unwrap_or(0) > 0, "{by_rung:?}");
    assert_eq!(by_rung.values().sum::<i32>(), 64);
}

/// `quiver::server::run` serves in-process: a library user (or a test) gets
/// the listening address as an event, scores, sets `stop`, and gets each
/// shard's report back.
#[test]
fn the_library_runs_a_server_in_process_until_stopped() {
    use quiver::server::{run, Event};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{mpsc, Arc};
    let config = quiver::config::Config {
        listen: "127.0.0.1:0".into(),
        admin_listen: "127.0.0.1:0".into(),
        shards: 1,
        data_dir: demo_dir().to_path_buf(),
        ..Default::default()
    };
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, rx) = mpsc::channel();
    let server = std::thread::spawn({
        let stop = stop.clone();
        move || run(config, stop, move |e| tx.send(e).unwrap())
    });
    let mut events = Vec::new();
    let addr = loop {
        match rx.recv_timeout(Duration::from_secs(30)).expect("the server starts") {
            Event::Serving { addr, shards, tls } => {
                assert!(!tls);
                assert_eq!(shards, 1);
                break addr;
            }
            e => events.push(e),
        }
    };
    assert!(matches!(events.as_slice(), [Event::Listening { what: "admin", .. }]), "{events:?}");
    let mut c = quiver::client::Client::connect(&addr.to_string(), Duration::from_secs(5)).unwrap();
    for i in 0..10 {
        assert_eq!(c.score(&demo_request(i, i, vec![1, 2, 3])).unwrap().status, Status::Ok);
    }
    stop.store(true, Ordering::Relaxed);
    let reports = server.join().unwrap().expect("a clean stop");
    assert_eq!(reports.len(), 1);
    assert_eq!(reports[0].counters.requests, 10);
}

#[test]
fn frames_encoded_before_feature_groups_are_answered_as_before() {
    let server = Server::start(&["--shards", "1"]);
    let context = |r: u64| (0..16).map(|i| (((r + i) % 7) as f64 * 0.3 - 0.9) as f32).collect::<Vec<f32>>();
    let spec = |request_id, user_id, item_ids: &[u64], context: Vec<f32>| RequestSpec {
        request_id,
        budget_us: 1_000_000,
        user_id,
        item_ids: item_ids.to_vec(),
        context,
        ..RequestSpec::default()
    };
    let cases = [
        ("one_item", spec(1, 3, &[5], context(1))),
        ("four_items", RequestSpec { priority: 3, client_id: 9, ..spec(2, 17, &[1, 9, 400, 999_999_999], context(2)) }),
        ("no_context", spec(3, 1, &[2, 3], Vec::new())),
        ("named_model", RequestSpec { model: "auction-32".into(), ..spec(4, 8, &[7, 6, 5], context(4)) }),
    ];
    let mut c = server.client();
    for (name, today) in cases {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/fixtures/frames_v1/{name}.bin"));
        let old = std::fs::read(&path).unwrap();
        let mut s = TcpStream::connect(&server.addr).unwrap();
        s.write_all(&old).unwrap();
        s.shutdown(std::net::Shutdown::Write).unwrap();
        let (bytes, _) = read_to_close(&mut s);
        let answers = decode_all(&bytes);
        assert_eq!(answers.len(), 1, "{name}");
        let want = c.score(&today).unwrap();
        assert_eq!((answers[0].status, answers[0].error.as_str()), (Status::Ok, ""), "{name}");
        assert_eq!(answers[0].request_id, today.request_id, "{name}");
        assert_eq!(answers[0].scores, want.scores, "{name}: the old frame scores as the same request encoded today");
        assert_eq!(answers[0].features_missing, want.features_missing, "{name}");
        // The reference agrees too, so neither encoding lost a field.
        let (reference, _) = reference_scores(demo_dir(), &today);
        assert_close(&answers[0].scores, &reference, INT8_SCORE_TOLERANCE);
    }
}
