//! A closed-loop load generator for Quiver's Open Inference Protocol
//! listeners, for `bench/oip_side_by_side.sh`: Rust on one thread, like
//! `quiver bench`, so the side by side prices the v2 front end and not a
//! slow client.
//!
//! `--protocol grpc`: one HTTP/2 connection (h2) with `--depth` streams in
//! flight, each a `ModelInfer` with raw tensors, as tritonclient and
//! perf_analyzer send it. `--protocol http`: `--depth` HTTP/1.1
//! connections, one request in flight on each, with the binary tensor
//! extension (tritonclient.http's default). Every request is auction-32
//! shaped (a user, 32 items, 16 context floats) with a budget of 100 ms
//! (`BUDGET_US`, as the side by side gives `quiver bench`); every answer is checked
//! (status, 32 scores). Prints one JSON line: requests/s and latency
//! percentiles in µs.
//!
//!     cargo bench --bench oip_load -- --protocol grpc --addr 127.0.0.1:8001 \
//!         --depth 16 --seconds 3

use std::time::{Duration, Instant};

use bytes::Bytes;
use hdrhistogram::Histogram;
use prost::Message;
use quiver::oip::grpc::proto;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const ITEMS: usize = 32;
const CONTEXT: usize = 16;
/// Each request's budget: `quiver bench --budget-us` in the side by side.
const BUDGET_US: i64 = 100_000;

struct Args {
    protocol: String,
    addr: String,
    model: String,
    depth: usize,
    seconds: f64,
}

fn args() -> Args {
    let mut a =
        Args { protocol: "grpc".into(), addr: String::new(), model: "auction-32".into(), depth: 1, seconds: 3.0 };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--protocol" => a.protocol = value(),
            "--addr" => a.addr = value(),
            "--model" => a.model = value(),
            "--depth" => a.depth = value().parse().expect("--depth N"),
            "--seconds" => a.seconds = value().parse().expect("--seconds S"),
            // cargo bench passes --bench.
            "--bench" => {}
            other => panic!("unknown flag {other}"),
        }
    }
    assert!(!a.addr.is_empty(), "--addr HOST:PORT is required");
    a
}

/// Request `i`'s tensors: user, items, context, as little-endian bytes.
fn tensors(i: u64) -> [Vec<u8>; 3] {
    let user = (i * 7919 % 100_000).to_le_bytes().to_vec();
    let items = (0..ITEMS as u64).flat_map(|k| ((i * 31 + k * 97) % 10_000).to_le_bytes()).collect();
    let context = (0..CONTEXT).flat_map(|k| (((i as usize + k) % 7) as f32 * 0.3 - 0.9).to_le_bytes()).collect();
    [user, items, context]
}

fn grpc_body(model: &str, i: u64) -> Bytes {
    let [user, items, context] = tensors(i);
    let tensor = |name: &str, datatype: &str, shape: Vec<i64>| proto::model_infer_request::InferInputTensor {
        name: name.into(),
        datatype: datatype.into(),
        shape,
        ..Default::default()
    };
    let budget = proto::InferParameter {
        parameter_choice: Some(proto::infer_parameter::ParameterChoice::Int64Param(BUDGET_US)),
    };
    let request = proto::ModelInferRequest {
        model_name: model.into(),
        parameters: [("budget_us".to_string(), budget)].into_iter().collect(),
        inputs: vec![
            tensor("user_id", "INT64", vec![1]),
            tensor("item_ids", "INT64", vec![ITEMS as i64]),
            tensor("context", "FP32", vec![CONTEXT as i64]),
        ],
        raw_input_contents: vec![user.into(), items.into(), context.into()],
        ..Default::default()
    };
    let len = request.encoded_len();
    let mut body = Vec::with_capacity(5 + len);
    body.push(0);
    body.extend_from_slice(&(len as u32).to_be_bytes());
    request.encode(&mut body).expect("a Vec grows");
    body.into()
}

fn http_request(addr: &str, model: &str, i: u64) -> Vec<u8> {
    let [user, items, context] = tensors(i);
    let head = format!(
        concat!(
            r#"{{"inputs":["#,
            r#"{{"name":"user_id","datatype":"INT64","shape":[1],"parameters":{{"binary_data_size":{}}}}},"#,
            r#"{{"name":"item_ids","datatype":"INT64","shape":[{}],"parameters":{{"binary_data_size":{}}}}},"#,
            r#"{{"name":"context","datatype":"FP32","shape":[{}],"parameters":{{"binary_data_size":{}}}}}],"#,
            r#""outputs":[{{"name":"scores","parameters":{{"binary_data":true}}}}],"#,
            r#""parameters":{{"budget_us":{}}}}}"#
        ),
        user.len(),
        ITEMS,
        items.len(),
        CONTEXT,
        context.len(),
        BUDGET_US
    );
    let length = head.len() + user.len() + items.len() + context.len();
    let mut out = format!(
        "POST /v2/models/{model}/infer HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/octet-stream\r\n\
         Inference-Header-Content-Length: {}\r\nContent-Length: {length}\r\n\r\n",
        head.len()
    )
    .into_bytes();
    out.extend_from_slice(head.as_bytes());
    out.extend_from_slice(&user);
    out.extend_from_slice(&items);
    out.extend_from_slice(&context);
    out
}

/// One gRPC call; checks its status and its 32 scores.
async fn grpc_call(client: &mut h2::client::SendRequest<Bytes>, addr: &str, body: Bytes) {
    let request = http::Request::builder()
        .method("POST")
        .uri(format!("http://{addr}/inference.GRPCInferenceService/ModelInfer"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .expect("a valid request");
    let (response, mut send) = client.send_request(request, false).expect("the connection takes a stream");
    send.send_data(body, true).expect("the request body is sent");
    let response = response.await.expect("a response head");
    let mut body = response.into_body();
    let mut got = Vec::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.expect("response data");
        let _ = body.flow_control().release_capacity(chunk.len());
        got.extend_from_slice(&chunk);
    }
    let trailers = body.trailers().await.expect("trailers").unwrap_or_default();
    let status = trailers.get("grpc-status").map(|v| v.to_str().unwrap_or("?").to_string());
    assert_eq!(status.as_deref(), Some("0"), "grpc status {status:?}: {:?}", trailers.get("grpc-message"));
    let answer = proto::ModelInferResponse::decode(&got[5.min(got.len())..]).expect("a ModelInferResponse");
    assert_eq!(answer.raw_output_contents.first().map(|r| r.len()), Some(ITEMS * 4));
}

/// One HTTP request on `conn`; checks its status and its 32 scores.
async fn http_call(conn: &mut tokio::net::TcpStream, request: &[u8], buf: &mut Vec<u8>) {
    conn.write_all(request).await.expect("the request is written");
    buf.clear();
    let mut chunk = [0u8; 16 * 1024];
    let (head_end, length) = loop {
        let n = conn.read(&mut chunk).await.expect("the response is read");
        assert!(n > 0, "the server closed the connection");
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = std::str::from_utf8(&buf[..end]).expect("an ASCII head");
            assert!(head.starts_with("HTTP/1.1 200"), "{head}");
            let length: usize = head
                .lines()
                .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().to_string()))
                .expect("a Content-Length")
                .parse()
                .expect("a length");
            break (end + 4, length);
        }
    };
    while buf.len() < head_end + length {
        let n = conn.read(&mut chunk).await.expect("the body is read");
        assert!(n > 0, "the server closed the connection mid-body");
        buf.extend_from_slice(&chunk[..n]);
    }
    assert!(length > ITEMS * 4, "a body of {length} bytes");
}

fn main() {
    let a = args();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
    let local = tokio::task::LocalSet::new();
    let (hist, requests, elapsed) =
        local.block_on(&runtime, run(a.protocol.clone(), a.addr.clone(), a.model.clone(), a.depth, a.seconds));
    let q = |p: f64| hist.value_at_quantile(p) as f64 / 1000.0;
    println!(
        "{}",
        serde_json::json!({
            "protocol": a.protocol,
            "inflight": a.depth,
            "requests": requests,
            "seconds": elapsed,
            "rate": requests as f64 / elapsed,
            "p50_us": q(0.5),
            "p99_us": q(0.99),
            "p999_us": q(0.999),
            "max_us": hist.max() as f64 / 1000.0,
        })
    );
}

/// Runs `depth` closed loops for `seconds` after a half-second warm-up.
async fn run(protocol: String, addr: String, model: String, depth: usize, seconds: f64) -> (Histogram<u64>, u64, f64) {
    let warm = Instant::now() + Duration::from_millis(500);
    let until = warm + Duration::from_secs_f64(seconds);
    let mut tasks = Vec::new();
    let h2 = if protocol == "grpc" {
        let tcp = tokio::net::TcpStream::connect(&addr).await.expect("connects");
        tcp.set_nodelay(true).expect("nodelay");
        let (client, conn) = h2::client::handshake(tcp).await.expect("an HTTP/2 handshake");
        tokio::task::spawn_local(conn);
        Some(client)
    } else {
        None
    };
    for slot in 0..depth {
        let (protocol, addr, model, h2) = (protocol.clone(), addr.clone(), model.clone(), h2.clone());
        tasks.push(tokio::task::spawn_local(async move {
            let mut hist = Histogram::<u64>::new_with_bounds(1_000, 10_000_000_000, 3).expect("bounds");
            let mut done = 0u64;
            let mut i = slot as u64;
            match protocol.as_str() {
                "grpc" => {
                    let mut client = h2.expect("a connection").ready().await.expect("ready");
                    loop {
                        let body = grpc_body(&model, i);
                        let t = Instant::now();
                        grpc_call(&mut client, &addr, body).await;
                        let now = Instant::now();
                        if now >= until {
                            break;
                        }
                        if now >= warm {
                            hist.record(now.duration_since(t).as_nanos() as u64).expect("in bounds");
                            done += 1;
                        }
                        client = client.ready().await.expect("ready");
                        i += depth as u64;
                    }
                }
                "http" => {
                    let mut conn = tokio::net::TcpStream::connect(&addr).await.expect("connects");
                    conn.set_nodelay(true).expect("nodelay");
                    let mut buf = Vec::with_capacity(4096);
                    loop {
                        let request = http_request(&addr, &model, i);
                        let t = Instant::now();
                        http_call(&mut conn, &request, &mut buf).await;
                        let now = Instant::now();
                        if now >= until {
                            break;
                        }
                        if now >= warm {
                            hist.record(now.duration_since(t).as_nanos() as u64).expect("in bounds");
                            done += 1;
                        }
                        i += depth as u64;
                    }
                }
                other => panic!("--protocol grpc or http, not {other}"),
            }
            (hist, done)
        }));
    }
    let mut total = Histogram::<u64>::new_with_bounds(1_000, 10_000_000_000, 3).expect("bounds");
    let mut requests = 0;
    for t in tasks {
        let (hist, done) = t.await.expect("a load task");
        total.add(&hist).expect("same bounds");
        requests += done;
    }
    (total, requests, seconds)
}
