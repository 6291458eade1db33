//! TLS on the scoring port (`[tls]`, `serve --tls-cert/--tls-key`): real
//! servers, certificates made by the test with `openssl`, and the client,
//! `quiver score` and `quiver bench` speaking TLS to them.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::pki::{make_cert, Pki};
use common::{demo_dir, demo_request, reference_scores, run_quiver, scratch, Server, INT8_SCORE_TOLERANCE};
use quiver::client::{Client, ClientError};
use quiver::tls::ClientTls;
use quiver::wire::Status;

const TIMEOUT: Duration = Duration::from_secs(10);

fn trusting(pki: &Pki, ca: &str) -> ClientTls {
    ClientTls { ca_file: Some(pki.dir.join(ca)), ..ClientTls::default() }
}

/// A server on the demo whose scoring port speaks TLS, with `config` as its
/// extra TOML (after the `[tls]` keys).
fn tls_server(pki: &Pki, name: &str, tls_extra: &str) -> Server {
    let config = scratch(name).join("quiver.toml");
    std::fs::write(
        &config,
        format!(
            "[tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\n{tls_extra}",
            pki.path("server.crt"),
            pki.path("server.key")
        ),
    )
    .unwrap();
    Server::start(&["--config", config.to_str().unwrap()])
}

#[test]
fn scoring_over_tls_answers_like_plain_tcp_and_bad_clients_harm_nobody() {
    let pki = Pki::new("tls-listener");
    let server = tls_server(&pki, "tls-listener-config", "handshake_timeout_ms = 300\n");
    let tls = trusting(&pki, "ca.crt");

    // One request, then a pipelined burst large enough that a round's
    // responses span many TLS records.
    let mut c = Client::connect_with(&server.addr, TIMEOUT, Some(&tls)).unwrap();
    let spec = demo_request(1, 7, (0..32).collect());
    let resp = c.score(&spec).unwrap();
    assert_eq!(resp.status, Status::Ok, "{}", resp.error);
    let (want, _) = reference_scores(demo_dir(), &spec);
    assert!(common::max_abs_diff(&resp.scores, &want) <= INT8_SCORE_TOLERANCE);
    let specs: Vec<_> =
        (0..2_000u64).map(|i| demo_request(100 + i, i % 50, (0..48).map(|k| k * 7 + i).collect())).collect();
    let got = c.pipeline(&specs, 500).unwrap();
    for (spec, resp) in specs.iter().zip(&got) {
        assert_eq!(resp.status, Status::Ok, "{}", resp.error);
        let (want, _) = reference_scores(demo_dir(), spec);
        assert!(common::max_abs_diff(&resp.scores, &want) <= INT8_SCORE_TOLERANCE, "request {}", spec.request_id);
    }

    // A malformed frame inside TLS is answered and closes that connection only.
    let mut bad = Client::connect_with(&server.addr, TIMEOUT, Some(&tls)).unwrap();
    bad.send_raw(&[0, 0, 0, 0]).unwrap();
    assert_eq!(bad.recv().unwrap().status, Status::BadRequest);
    assert!(bad.recv().is_err(), "the broken stream is closed");

    // Plain TCP to a TLS port: no answer, a closed connection.
    let mut plain = Client::connect(&server.addr, Duration::from_secs(5)).unwrap();
    assert!(plain.score(&spec).is_err());

    // The wrong CA, and the wrong name, fail at connect with the reason.
    let err = Client::connect_with(&server.addr, TIMEOUT, Some(&trusting(&pki, "other-ca.crt"))).err().unwrap();
    assert!(matches!(&err, ClientError::Tls { what, .. } if what.contains("certificate")), "{err}");
    let misnamed = ClientTls { server_name: Some("elsewhere.example".into()), ..tls.clone() };
    let err = Client::connect_with(&server.addr, TIMEOUT, Some(&misnamed)).err().unwrap();
    assert!(matches!(&err, ClientError::Tls { what, .. } if what.contains("certificate")), "{err}");

    // Garbage instead of a ClientHello, and a client that never speaks:
    // both are closed (the silent one within handshake_timeout_ms).
    for seed in 0..20u8 {
        let mut s = TcpStream::connect(&server.addr).unwrap();
        let junk: Vec<u8> = (0..512u32).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
        let _ = s.write_all(&junk);
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink);
    }
    let mut silent = TcpStream::connect(&server.addr).unwrap();
    silent.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let started = Instant::now();
    let mut byte = [0u8; 1];
    assert!(matches!(silent.read(&mut byte), Ok(0) | Err(_)));
    assert!(started.elapsed() < Duration::from_secs(3), "a silent client is closed at the handshake bound");

    // The first connection still scores after all of that.
    assert_eq!(c.score(&demo_request(9_999, 3, vec![1, 2, 3])).unwrap().status, Status::Ok);

    // Counted: 3 good handshakes (c, bad, the CLI's below aside), and at
    // least the plain client, the two refused and the 21 junk or silent ones.
    let s = server.wait_stats("the handshakes counted", |s| s.tls_handshakes >= 2 && s.tls_handshake_failures >= 24);
    assert!(s.tls_handshakes >= 2, "{} handshakes", s.tls_handshakes);
    assert!(s.tls_handshake_failures >= 24, "{} failed handshakes", s.tls_handshake_failures);
    let (code, metrics) = common::http_get(&format!("http://{}/metrics", server.admin));
    assert_eq!(code, 200);
    assert!(metrics.contains("quiver_tls_handshakes_total "), "{metrics}");
    assert!(metrics.contains("quiver_tls_handshake_failures_total "), "{metrics}");

    // `quiver score` and `quiver bench` speak it too.
    let ca = pki.path("ca.crt");
    let (code, out, err) =
        run_quiver(["score", "--addr", &server.addr, "--tls-ca", &ca, "--user", "3", "--items", "1,2,3", "--json"]);
    assert_eq!(code, 0, "{out}{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["status"], "ok");
    assert_eq!(v["scores"].as_array().unwrap().len(), 3);
    let (code, out, err) = run_quiver([
        "bench",
        "--addr",
        &server.addr,
        "--tls-ca",
        &ca,
        "--duration",
        "1s",
        "--connections",
        "2",
        // A budget no scheduling hiccup of a shared machine can exhaust.
        "--budget-us",
        "1000000",
        "--json",
    ]);
    assert_eq!(code, 0, "{out}{err}");
    let report: quiver::loadgen::BenchReport = serde_json::from_str(out.trim()).unwrap();
    assert!(report.connection_errors.is_empty(), "{:?}", report.connection_errors);
    assert!(report.received > 100 && report.lost == 0, "{report:?}");
    assert_eq!(report.by_status.get("ok").copied(), Some(report.received), "{:?}", report.by_status);
    let (code, out, _) = run_quiver([
        "bench",
        "--addr",
        &server.addr,
        "--tls-ca",
        &pki.path("other-ca.crt"),
        "--duration",
        "1s",
        "--json",
    ]);
    assert_ne!(code, 0);
    assert!(out.contains("certificate"), "{out}");
}

#[test]
fn mutual_tls_admits_only_clients_the_ca_signed() {
    let pki = Pki::new("tls-mutual");
    make_cert(&pki.dir, "other-ca", "stranger", "stranger", "extendedKeyUsage=clientAuth\n");
    let server = tls_server(&pki, "tls-mutual-config", &format!("client_ca_file = \"{}\"\n", pki.path("ca.crt")));
    let spec = demo_request(1, 7, vec![1, 2, 3]);
    let score =
        |tls: &ClientTls| Client::connect_with(&server.addr, TIMEOUT, Some(tls)).and_then(|mut c| c.score(&spec));

    let with = |cert: &str, key: &str| ClientTls {
        cert_file: Some(pki.dir.join(cert)),
        key_file: Some(pki.dir.join(key)),
        ..trusting(&pki, "ca.crt")
    };
    assert_eq!(score(&with("client.crt", "client.key")).unwrap().status, Status::Ok);
    // TLS 1.3 clients finish their side before the server checks theirs, so
    // a refusal may surface at the first request rather than at connect.
    assert!(score(&trusting(&pki, "ca.crt")).is_err(), "no client certificate");
    assert!(score(&with("stranger.crt", "stranger.key")).is_err(), "a certificate another CA signed");
    // Each shard publishes on its own period, and SO_REUSEPORT may have put
    // the accepted connection and the refused ones on different shards.
    let s = server.wait_stats("the handshakes counted", |s| s.tls_handshakes >= 1 && s.tls_handshake_failures >= 2);
    assert_eq!(s.tls_handshakes, 1);
    assert!(s.tls_handshake_failures >= 2, "{}", s.tls_handshake_failures);
}

#[test]
fn a_client_id_bound_to_certificate_names_is_spent_only_by_their_holder() {
    let pki = Pki::new("tls-names");
    make_cert(
        &pki.dir,
        "ca",
        "bidder",
        "bidder",
        "subjectAltName=DNS:bidder-eu.internal,URI:spiffe://ads/bidder\nextendedKeyUsage=clientAuth\n",
    );
    // Client 7 may claim priority 9 and a rate of its own, but only with the
    // bidder's certificate; everyone else is shed as priority 0 at most.
    let extra = format!(
        "client_ca_file = \"{}\"\n[admission]\nunknown_priority_max = 0\n[admission.clients.7]\nrate_per_s = \
         100000.0\nburst = 1000.0\npriority_max = 9\ntls_names = [\"spiffe://ads/bidder\"]\n",
        pki.path("ca.crt")
    );
    let server = tls_server(&pki, "tls-names-config", &extra);
    let with = |cert: &str, key: &str| ClientTls {
        cert_file: Some(pki.dir.join(cert)),
        key_file: Some(pki.dir.join(key)),
        ..trusting(&pki, "ca.crt")
    };
    let mut spec = demo_request(1, 7, vec![1, 2, 3]);
    spec.client_id = 7;
    let mut bidder = Client::connect_with(&server.addr, TIMEOUT, Some(&with("bidder.crt", "bidder.key"))).unwrap();
    assert_eq!(bidder.score(&spec).unwrap().status, Status::Ok);
    // Another client the same CA signed, naming id 7: refused, and counted.
    let mut other = Client::connect_with(&server.addr, TIMEOUT, Some(&with("client.crt", "client.key"))).unwrap();
    let r = other.score(&spec).unwrap();
    assert_eq!(r.status, Status::RateLimited, "{r:?}");
    assert!(r.error.contains("certificate names"), "{}", r.error);
    let s = server.wait_stats("the refusal counted", |s| s.admission_wrong_source >= 1);
    assert_eq!(s.admission_wrong_source, 1);

    // tls_names without client certificates is refused at start-up.
    let bad = scratch("tls-names-bad").join("q.toml");
    std::fs::write(&bad, "[admission.clients.7]\nrate_per_s = 1.0\nburst = 1.0\ntls_names = [\"x\"]\n").unwrap();
    let (code, _, err) = run_quiver(["serve", "--config", bad.to_str().unwrap()]);
    assert_ne!(code, 0);
    assert!(err.contains("tls_names needs [tls] client_ca_file"), "{err}");
}

#[test]
fn new_handshakes_over_the_shards_budget_are_refused_and_open_connections_serve_on() {
    let pki = Pki::new("tls-budget");
    let config = scratch("tls-budget-config").join("quiver.toml");
    std::fs::write(
        &config,
        format!(
            "[tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\nhandshakes_per_s_max = 1\nhandshake_burst = 3\n",
            pki.path("server.crt"),
            pki.path("server.key")
        ),
    )
    .unwrap();
    let server = Server::start(&["--config", config.to_str().unwrap(), "--shards", "1"]);
    let tls = trusting(&pki, "ca.crt");
    let spec = demo_request(1, 7, vec![1, 2, 3]);
    // The bucket refills one a second from its first use, the kept
    // connection's handshake: timed from before it.
    let started = Instant::now();
    let mut kept = Client::connect_with(&server.addr, TIMEOUT, Some(&tls)).unwrap();
    assert_eq!(kept.score(&spec).unwrap().status, Status::Ok);
    // A flood of new connections: the burst's two left pass, and one more
    // for each second that went by (however slow this machine is), the rest
    // are closed before any handshake work.
    let served = (0..10)
        .filter(|_| Client::connect_with(&server.addr, TIMEOUT, Some(&tls)).and_then(|mut c| c.score(&spec)).is_ok())
        .count();
    let extra = started.elapsed().as_secs_f64().ceil() as usize;
    assert!((2..=2 + extra).contains(&served), "{served} of 10 served in {:?}", started.elapsed());
    // The connection already open is not touched.
    for _ in 0..20 {
        assert_eq!(kept.score(&spec).unwrap().status, Status::Ok);
    }
    let refused = (10 - served) as u64;
    assert_eq!(server.wait_metric("quiver_tls_handshakes_refused_total", refused), refused);
}

#[test]
fn a_server_with_unusable_certificates_refuses_to_start() {
    let pki = Pki::new("tls-refused");
    let data = demo_dir().to_str().unwrap();
    let serve = |cert: &str, key: &str| {
        let (cert, key) = (pki.path(cert), pki.path(key));
        let args = ["serve", "--listen", "127.0.0.1:0", "--admin", "off", "--data-dir", data];
        run_quiver(args.into_iter().chain(["--tls-cert", cert.as_str(), "--tls-key", key.as_str()]))
    };
    // A missing key file.
    let (code, out, err) = serve("server.crt", "absent.key");
    assert_ne!(code, 0, "{out}");
    assert!(err.contains("[tls]") && err.contains("absent.key"), "{err}");
    // A key that is not the certificate's.
    let (code, out, err) = serve("server.crt", "client.key");
    assert_ne!(code, 0, "{out}");
    assert!(err.contains("[tls]"), "{err}");
    // A typo in the section is named.
    let config = scratch("tls-refused-config").join("quiver.toml");
    std::fs::write(&config, "[tls]\ncert_file = \"a\"\nkey_file = \"b\"\nhandshake_timeout = 5\n").unwrap();
    let (code, _, err) = run_quiver(["serve", "--config", config.to_str().unwrap()]);
    assert_ne!(code, 0);
    assert!(err.contains("handshake_timeout"), "{err}");
}
