//! The CLI contract that scripts and later work rely on.

mod common;

use std::process::Command;

use common::{Server, BIN};

fn run(args: &[&str]) -> std::process::Output {
    Command::new(BIN).args(args).output().expect("quiver runs")
}

#[test]
fn score_json_prints_exactly_one_object() {
    let server = Server::start(&["--shards", "1"]);
    let out = run(&["score", "--addr", &server.addr, "--user", "42", "--items", "1,2,3", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(stdout.trim().lines().count(), 1, "{stdout}");
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(v["status"], "ok");
    assert_eq!((v["tier"].as_str(), v["reason"].as_str()), (Some("primary"), Some("none")));
    assert_eq!(v["scores"].as_array().unwrap().len(), 3);
    assert!(v["rtt_us"].as_u64().unwrap() > 0);
    for s in v["scores"].as_array().unwrap() {
        let s = s.as_f64().unwrap();
        assert!(s > 0.0 && s < 1.0);
    }

    // Context with negative numbers, and a non-OK status exits 2.
    let out =
        run(&["score", "--addr", &server.addr, "--user", "1", "--items", "5", "--context", "-0.5,0.25", "--json"]);
    assert_eq!(out.status.code(), Some(2));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["status"], "bad_request");

    let out = run(&["score", "--addr", &server.addr, "--user", "42", "--items", "1,2,3"]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.starts_with("status ok  tier primary"), "{text}");
    assert_eq!(text.lines().count(), 4);
}

#[test]
fn bench_json_reports_rate_and_percentiles() {
    let server = Server::start(&["--shards", "1"]);
    for extra in [&[][..], &["--rate", "300"][..]] {
        let mut args = vec![
            "bench",
            "--addr",
            &server.addr,
            "--duration",
            "1s",
            "--connections",
            "2",
            // Generous: this checks the report, not the speed of a busy CI machine.
            "--budget-us",
            "2000000",
            "--json",
        ];
        args.extend_from_slice(extra);
        let out = run(&args);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let stdout = String::from_utf8(out.stdout).unwrap();
        assert_eq!(stdout.trim().lines().count(), 1);
        let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
        assert!(v["received"].as_u64().unwrap() > 0);
        assert_eq!(v["received"], v["sent"]);
        let l = &v["latency"];
        assert!(l["p50_us"].as_u64().unwrap() <= l["p99_us"].as_u64().unwrap());
        assert!(l["p99_us"].as_u64().unwrap() <= l["max_us"].as_u64().unwrap());
        assert_eq!(v["by_status"]["ok"], v["received"]);
    }
}

/// `--users`/`--items` set the populations ids are drawn from, and the
/// report says what was sent: past the served replica's users, most
/// requests name a user the server does not know.
#[test]
fn bench_draws_ids_from_the_population_it_is_given() {
    let server = Server::start(&["--shards", "1"]);
    let mut requests_before = 0;
    let mut bench = |extra: &[&str]| {
        let mut args = vec!["bench", "--addr", &server.addr, "--duration", "1s", "--rate", "300", "--connections", "1"];
        args.extend_from_slice(&["--budget-us", "2000000", "--candidates", "1", "--json"]);
        args.extend_from_slice(extra);
        let out = run(&args);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["by_status"]["ok"], v["sent"], "{v}");
        // The shards publish once a second: wait until they counted this run.
        let until = std::time::Instant::now() + common::WAIT;
        let sent = v["sent"].as_u64().unwrap();
        let missing = loop {
            let s = server.stats();
            if s.requests >= requests_before + sent {
                requests_before = s.requests;
                break s.features_missing;
            }
            assert!(std::time::Instant::now() < until, "the server never counted {sent} more requests");
            std::thread::sleep(std::time::Duration::from_millis(50));
        };
        (v, missing, sent)
    };

    let (v, missing_known, _) = bench(&["--users", "100000", "--user-zipf", "1.1", "--items", "10000"]);
    let ids = &v["ids"];
    assert_eq!((ids["users"].as_u64(), ids["items"].as_u64()), (Some(100_000), Some(10_000)), "{v}");
    assert_eq!((ids["user_dist"].as_str(), ids["item_dist"].as_str()), (Some("zipf:1.1"), Some("uniform")), "{v}");
    assert_eq!(missing_known, 0, "every id drawn is in the demo's replicas");

    // Uniform over ten times the demo's users: about nine in ten are unknown.
    let (v, missing_total, sent) = bench(&["--users", "1000000", "--item-zipf", "0.8"]);
    assert_eq!((v["ids"]["user_dist"].as_str(), v["ids"]["item_dist"].as_str()), (Some("uniform"), Some("zipf:0.8")));
    assert!(missing_total * 10 > sent * 8, "{missing_total} users missing in {sent} requests");

    for (bad, why) in [
        (&["--user-zipf", "0"][..], "Zipf exponent 0"),
        (&["--users", "0"][..], "users: a population of 0 ids"),
        (&["--items", "5000000000"][..], "items: a population of 5000000000"),
        (&["--zipf", "1.1", "--user-zipf", "1.1"][..], "cannot be used with"),
    ] {
        let mut args = vec!["bench", "--addr", &server.addr, "--duration", "1s"];
        args.extend_from_slice(bad);
        let out = run(&args);
        assert!(!out.status.success(), "{bad:?} was accepted");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(why), "{bad:?}: {stderr}");
    }
}

#[test]
fn replica_build_and_inspect() {
    let dir = common::scratch("replica-cli");
    let input = dir.join("users.csv");
    std::fs::write(&input, "# id, f0, f1\ndefault,0,0\n1,0.5,1.5\n2,2.5,3.5\n").unwrap();
    let out_file = dir.join("user.qrep");
    let out = run(&[
        "replica",
        "build",
        "--group",
        "user",
        "--input",
        input.to_str().unwrap(),
        "--out",
        out_file.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("dim 2 rows 2"));
    let r = quiver::features::replica::Replica::open(&out_file, "user").unwrap();
    let mut v = [0.0; 2];
    assert!(r.read_into(2, &mut v));
    assert_eq!(v, [2.5, 3.5]);

    let out = run(&["replica", "inspect", "--group", "user", "--file", out_file.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    let bytes = std::fs::metadata(&out_file).unwrap().len();
    let per_entity = format!("({:.0} bytes per entity)", bytes as f64 / 2.0);
    assert!(text.contains("size: 2 entities") && text.contains(&per_entity), "{text}");
    assert!(text.contains("resident when served"), "{text}");
    let out = run(&["replica", "inspect", "--group", "item", "--file", out_file.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("expected 'item'"));

    std::fs::write(&input, "1,0.5\n1,0.7\n").unwrap();
    let out = run(&[
        "replica",
        "build",
        "--group",
        "user",
        "--input",
        input.to_str().unwrap(),
        "--out",
        out_file.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("duplicate key 1"));

    // A group keyed by strings: the first field is the key as written.
    std::fs::write(&input, "default,0,0\nalice,0.5,1.5\nbob,2.5,3.5\n").unwrap();
    let build = |key_bytes: &str| {
        let (input, out_file) = (input.to_str().unwrap(), out_file.to_str().unwrap());
        run(&["replica", "build", "--group", "user", "--key-bytes", key_bytes, "--input", input, "--out", out_file])
    };
    let out = build("8");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("rows 2 (string keys of up to 8 bytes)"), "{out:?}");
    let r = quiver::features::replica::Replica::open(&out_file, "user").unwrap();
    assert!(r.read_str_into(b"bob", &mut v) && v == [2.5, 3.5]);
    let out = run(&["replica", "inspect", "--group", "user", "--file", out_file.to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("string keys of up to 8 bytes rows 2"), "{out:?}");
    let out = build("65");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("the limit is 1 to 64 bytes"), "{out:?}");
}

#[test]
fn demo_generation_is_deterministic() {
    let a = common::scratch("demo-a");
    let b = common::scratch("demo-b");
    for d in [&a, &b] {
        let out = run(&["demo", "--data-dir", d.to_str().unwrap()]);
        assert!(out.status.success());
    }
    for f in ["user.qrep", "item.qrep", "model.qm"] {
        assert!(std::fs::read(a.join(f)).unwrap() == std::fs::read(b.join(f)).unwrap(), "{f} differs");
    }
}

#[test]
fn plots_are_png_files() {
    let dir = common::scratch("plot");
    let mut h = quiver::loadgen::histogram();
    for v in 1..=10_000u64 {
        h.record(v % 977 + 20).unwrap();
    }
    let hgrm = dir.join("a.hgrm");
    std::fs::write(&hgrm, quiver::loadgen::percentile_distribution(&h)).unwrap();
    let png = dir.join("p.png");
    let out = run(&["plot", "percentiles", "--out", png.to_str().unwrap(), &format!("run a={}", hgrm.display())]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    assert!(bytes.len() > 10_000, "a real picture, not an empty canvas");

    let bad = run(&["plot", "percentiles", "--out", png.to_str().unwrap(), "no-equals-sign"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("expected LABEL=FILE"));
}

#[test]
fn scale_curves_plot_one_line_per_storage_and_field() {
    let dir = common::scratch("plot-scale");
    let results = dir.join("scale.jsonl");
    let line = |n: u64, storage: &str, open_s: f64| {
        format!("{{\"entities\":{n},\"storage\":\"{storage}\",\"open_warm_s\":{open_s},\"lookup_uniform\":{{\"p99_ns\":{}}}}}\n", n / 100)
    };
    let text: String = [
        line(1_000_000, "f32", 0.4),
        line(1_000_000, "f16", 0.3),
        line(10_000_000, "f32", 4.0),
        line(10_000_000, "f16", 3.0),
    ]
    .concat();
    std::fs::write(&results, text).unwrap();
    let png = dir.join("s.png");
    let plot = |fields: &[&str]| {
        let mut args = vec!["plot", "scale", "--out", png.to_str().unwrap(), "--y-desc", "seconds"];
        args.extend_from_slice(&["--results", results.to_str().unwrap()]);
        args.extend_from_slice(fields);
        run(&args)
    };
    let out = plot(&["open=open_warm_s", "p99=lookup_uniform.p99_ns"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    assert!(bytes.len() > 10_000, "a real picture, not an empty canvas");
    let none = plot(&["x=no.such.field"]);
    assert!(!none.status.success());
    assert!(String::from_utf8_lossy(&none.stderr).contains("no line has the fields asked for"));
}

#[test]
fn demo_publishes_two_versions_to_a_registry_when_asked() {
    let data = common::scratch("demo-registry-data");
    let models = common::scratch("demo-registry-models");
    let (code, out, err) =
        common::run_quiver(["demo", "--data-dir", data.to_str().unwrap(), "--models-dir", models.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    for version in [1u32, 2] {
        let path = models.join("auction-32").join(version.to_string()).join("model.qm");
        assert!(out.contains(&path.display().to_string()), "{out}");
        let model = quiver::model::Model::load(&path).unwrap();
        assert_eq!((model.name.as_str(), model.version), ("auction-32", version));
    }
}

/// A reader that closes the pipe early (`quiver … | head`) ends the command
/// quietly with the shell's SIGPIPE status, not a panic.
#[test]
fn a_closed_stdout_ends_the_command_quietly() {
    let dir = common::scratch("closed-stdout");
    assert!(run(&["demo", "--data-dir", dir.to_str().unwrap()]).status.success());
    let model = dir.join("model.qm");
    // The pipe's reading end is closed before the command starts, so its
    // first line meets a closed pipe however the two processes are scheduled.
    let (reader, writer) = std::io::pipe().expect("a pipe");
    drop(reader);
    let out = Command::new(BIN)
        .args(["time-model", "--model", model.to_str().unwrap(), "--rows", "1", "--iters", "1"])
        .stdout(writer)
        .output()
        .expect("quiver runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(out.status.code(), Some(141), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}
