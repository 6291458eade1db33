//! The v2 protocol over HTTP/REST: JSON bodies and the binary tensor
//! extension (`Inference-Header-Content-Length`: a JSON header, then each
//! binary tensor's bytes in order), on hyper's HTTP/1 server.
//!
//! Routes (the protocol's): `GET /v2/health/live`, `GET /v2/health/ready`,
//! `GET /v2`, `GET /v2/models/{name}[/versions/{v}]`,
//! `GET /v2/models/{name}[/versions/{v}]/ready` and
//! `POST /v2/models/{name}[/versions/{v}]/infer`; and one of Triton's,
//! `GET /v2/models/{name}[/versions/{v}]/config` (`config.rs`), which
//! perf_analyzer reads. An error is the
//! protocol's `{"error": "..."}` with a status by its [`Code`]: 400 for a
//! bad request, 404 for an unknown model or route, 413 for a body over
//! `[oip] message_bytes_max`, 429 when rate limited, 503 when overloaded or
//! not ready, 504 past the deadline.
//!
//! Limits: `connections_max` connections (one more is closed at once);
//! request heads of [`HEADER_BYTES_MAX`] bytes in [`HEADERS_MAX`] fields
//! within [`HEADER_READ_TIMEOUT`] (also the keep-alive idle limit); bodies
//! of `message_bytes_max` bytes within [`BODY_READ_TIMEOUT`] (a larger
//! declared length is answered 413 before a byte of it is read); each
//! response written whole within [`WRITE_TIMEOUT`] (the admin listeners'
//! `WriteDeadline`), or the connection closes.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Body, Incoming};
use hyper::{Method, Request, Response};
use serde_json::{json, Value};
use tokio::sync::Semaphore;

use super::config::ModelConfig;
use super::grpc::{EXTENSIONS, SERVER_NAME};
use super::tensors::{self, Code, Data, InferError, InferRequest, InferResponse, InputTensor, Param, Params, Service};
use super::{stopping, OipConfig, Stop};
use crate::admin::http::WriteDeadline;

/// This transport in `metrics::OIP_PROTOCOLS`.
const PROTOCOL: usize = 1;
/// The request line and headers together.
pub const HEADER_BYTES_MAX: usize = 16 * 1024;
/// Header fields in one request.
pub const HEADERS_MAX: usize = 64;
/// For a whole request head, and for the next one on a kept-alive connection.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// For a whole response, from its first byte written.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// The binary extension's header naming the JSON part's length.
pub const HEADER_LENGTH: &str = "inference-header-content-length";
/// How the errors of a body not read whole begin.
const BODY_UNREAD: &str = "the request body";
/// How long accepting pauses after an error that more accepts would repeat.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Serves `listener` until `stop`.
pub async fn serve(listener: std::net::TcpListener, service: Arc<Service>, config: OipConfig, mut stop: Stop) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(error = %e, "oip: the HTTP listener could not be registered; it does not serve");
            return;
        }
    };
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .max_headers(HEADERS_MAX)
        .max_buf_size(HEADER_BYTES_MAX.max(8192));
    let builder = Arc::new(builder);
    let permits = Arc::new(Semaphore::new(config.connections_max));
    let body_max = config.message_bytes_max;
    loop {
        let accepted = tokio::select! {
            biased;
            () = stopping(&mut stop) => break,
            accepted = listener.accept() => accepted,
        };
        let (stream, remote) = match accepted {
            Ok(a) => a,
            Err(e) => {
                tracing::debug!(error = %e, "oip: HTTP accept failed; retrying");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            tracing::debug!(%remote, "oip: HTTP connection refused: oip.connections_max held");
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (builder, service, mut stop) = (builder.clone(), service.clone(), stop.clone());
        tokio::spawn(async move {
            let io = hyper_util::rt::TokioIo::new(WriteDeadline::new(stream, WRITE_TIMEOUT));
            let handler = hyper::service::service_fn(move |request| {
                let service = service.clone();
                async move { Ok::<_, std::convert::Infallible>(respond(request, &service, body_max).await) }
            });
            let conn = builder.serve_connection(io, handler);
            tokio::pin!(conn);
            tokio::select! {
                served = conn.as_mut() => if let Err(e) = served {
                    tracing::debug!(%remote, error = %e, "oip: HTTP connection ended");
                },
                () = stopping(&mut stop) => {}
            }
            drop(permit);
        });
    }
}

fn reply(code: u16, content_type: &'static str, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = hyper::StatusCode::from_u16(code).unwrap_or(hyper::StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static(content_type));
    r
}

fn json_reply(code: u16, body: &Value) -> Response<Full<Bytes>> {
    reply(code, "application/json", serde_json::to_vec(body).unwrap_or_default())
}

/// The HTTP status of an error's class.
pub fn http_status(e: &InferError) -> u16 {
    match e.code() {
        Code::InvalidArgument => 400,
        Code::NotFound => 404,
        Code::ResourceExhausted if matches!(e, InferError::TooLarge { .. }) => 413,
        Code::ResourceExhausted => 429,
        Code::Unavailable => 503,
        Code::DeadlineExceeded => 504,
        Code::Internal => 500,
    }
}

fn error_reply(e: &InferError) -> Response<Full<Bytes>> {
    json_reply(http_status(e), &json!({ "error": e.to_string() }))
}

/// `/v2/models/{name}[/versions/{v}][/tail]` as (name, version, tail).
fn model_path<'a>(segments: &[&'a str]) -> Option<(&'a str, &'a str, &'a str)> {
    match segments {
        ["v2", "models", name] => Some((name, "", "")),
        ["v2", "models", name, "versions", v] => Some((name, v, "")),
        ["v2", "models", name, tail] => Some((name, "", tail)),
        ["v2", "models", name, "versions", v, tail] => Some((name, v, tail)),
        _ => None,
    }
}

async fn respond(request: Request<Incoming>, service: &Service, body_max: usize) -> Response<Full<Bytes>> {
    let path = request.uri().path().to_string();
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let method = request.method().clone();
    let not_found = || json_reply(404, &json!({ "error": format!("no route {method} {path}") }));
    match (&method, segments.as_slice()) {
        (&Method::GET, ["v2", "health", "live"]) => json_reply(200, &json!({ "live": service.live() })),
        (&Method::GET, ["v2", "health", "ready"]) => {
            let ready = service.ready();
            json_reply(if ready { 200 } else { 503 }, &json!({ "ready": ready }))
        }
        (&Method::GET, ["v2"]) => json_reply(
            200,
            &json!({ "name": SERVER_NAME, "version": env!("CARGO_PKG_VERSION"), "extensions": EXTENSIONS }),
        ),
        _ => match (&method, model_path(&segments)) {
            (&Method::GET, Some((name, version, ""))) => match service.signature(name, version) {
                Ok(s) => json_reply(200, &metadata(&s)),
                Err(e) => error_reply(&e),
            },
            (&Method::GET, Some((name, version, "config"))) => match service.signature(name, version) {
                Ok(s) => json_reply(200, &ModelConfig::of(&s, SERVER_NAME).to_json()),
                Err(e) => error_reply(&e),
            },
            (&Method::GET, Some((name, version, "ready"))) => {
                let ready = service.model_ready(name, version);
                json_reply(if ready { 200 } else { 503 }, &json!({ "name": name, "ready": ready }))
            }
            (&Method::POST, Some((name, version, "infer"))) => {
                let (name, version) = (name.to_string(), version.to_string());
                let answer = infer(request, service, &name, &version, body_max).await;
                service.count(PROTOCOL, answer.as_ref().err());
                match answer {
                    Ok(r) => r,
                    Err(e) => {
                        let mut r = error_reply(&e);
                        // The client may still be sending a body that will
                        // not be read: the connection is not reused.
                        let unread = matches!(&e, InferError::TooLarge { .. })
                            || matches!(&e, InferError::Malformed(m) if m.starts_with(BODY_UNREAD));
                        if unread {
                            r.headers_mut()
                                .insert(hyper::header::CONNECTION, hyper::header::HeaderValue::from_static("close"));
                        }
                        r
                    }
                }
            }
            _ => not_found(),
        },
    }
}

fn metadata(s: &tensors::Signature) -> Value {
    let tensor = |t: &tensors::TensorSpec| json!({ "name": t.name, "datatype": t.datatype.name(), "shape": t.shape });
    json!({
        "name": s.name,
        "versions": [s.version.to_string()],
        "platform": SERVER_NAME,
        "inputs": s.inputs.iter().map(tensor).collect::<Vec<_>>(),
        "outputs": s.outputs.iter().map(tensor).collect::<Vec<_>>(),
    })
}

fn param(v: &Value) -> Option<Param<'_>> {
    Some(match v {
        Value::Bool(b) => Param::Bool(*b),
        Value::String(s) => Param::Str(s),
        Value::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => Param::Int(i),
            (None, Some(u)) => Param::Uint(u),
            _ => Param::Double(n.as_f64()?),
        },
        _ => return None,
    })
}

fn malformed(why: impl Into<String>) -> InferError {
    InferError::Malformed(why.into())
}

/// Reads the body (bounded in bytes and time), checks and scores it.
async fn infer(
    request: Request<Incoming>,
    service: &Service,
    name: &str,
    version: &str,
    body_max: usize,
) -> Result<Response<Full<Bytes>>, InferError> {
    let declared = request.body().size_hint().lower();
    if declared > body_max as u64 {
        return Err(InferError::TooLarge { bytes: declared, max: body_max });
    }
    if let Some(encoding) = request.headers().get(hyper::header::CONTENT_ENCODING) {
        if encoding.as_bytes() != b"identity" {
            return Err(malformed(format!(
                "Content-Encoding {}: compressed bodies are not accepted",
                String::from_utf8_lossy(encoding.as_bytes())
            )));
        }
    }
    let header_length = match request.headers().get(HEADER_LENGTH) {
        None => None,
        Some(v) => Some(
            std::str::from_utf8(v.as_bytes())
                .ok()
                .and_then(|s| s.trim().parse::<usize>().ok())
                .ok_or_else(|| malformed("Inference-Header-Content-Length is not a length"))?,
        ),
    };
    let body =
        match tokio::time::timeout(BODY_READ_TIMEOUT, Limited::new(request.into_body(), body_max).collect()).await {
            Ok(Ok(body)) => body.to_bytes(),
            Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
                return Err(InferError::TooLarge { bytes: body_max as u64 + 1, max: body_max })
            }
            Ok(Err(e)) => return Err(malformed(format!("the request body could not be read: {e}"))),
            Err(_) => return Err(malformed(format!("the request body was not received within {BODY_READ_TIMEOUT:?}"))),
        };
    let json_length = header_length.unwrap_or(body.len());
    if json_length > body.len() {
        return Err(malformed(format!(
            "Inference-Header-Content-Length is {json_length}, the body only {} bytes",
            body.len()
        )));
    }
    let (head, mut binary) = body.split_at(json_length);
    let head: Value = serde_json::from_slice(head).map_err(|e| malformed(format!("the request is not JSON: {e}")))?;
    let object = head.as_object().ok_or_else(|| malformed("the request is not a JSON object"))?;
    let mut params = Params::default();
    let mut binary_output = false;
    if let Some(p) = object.get("parameters") {
        let p = p.as_object().ok_or_else(|| malformed("'parameters' is not an object"))?;
        for (k, v) in p {
            if k == "binary_data_output" {
                binary_output = v.as_bool().unwrap_or(false);
            } else if let Some(v) = param(v) {
                params.set(k, v)?;
            }
        }
    }
    let id = match object.get("id") {
        None => "",
        Some(Value::String(s)) => s,
        Some(_) => return Err(malformed("'id' is not a string")),
    };
    let no_inputs = Vec::new();
    let inputs_json = match object.get("inputs") {
        Some(Value::Array(a)) => a,
        None => &no_inputs,
        Some(_) => return Err(malformed("'inputs' is not an array")),
    };
    let mut shapes: Vec<Vec<i64>> = Vec::with_capacity(inputs_json.len());
    for t in inputs_json {
        let shape =
            t.get("shape").and_then(Value::as_array).ok_or_else(|| malformed("an input without a 'shape' array"))?;
        shapes.push(
            shape
                .iter()
                .map(|d| d.as_i64().ok_or_else(|| malformed("a 'shape' dimension that is not an integer")))
                .collect::<Result<_, _>>()?,
        );
    }
    let mut inputs = Vec::with_capacity(inputs_json.len());
    for (t, shape) in inputs_json.iter().zip(&shapes) {
        let name = t.get("name").and_then(Value::as_str).ok_or_else(|| malformed("an input without a 'name'"))?;
        let datatype = t
            .get("datatype")
            .and_then(Value::as_str)
            .ok_or_else(|| malformed(format!("input '{name}' has no 'datatype'")))?;
        let binary_size = t.get("parameters").and_then(|p| p.get("binary_data_size"));
        let data = match (binary_size, t.get("data")) {
            (Some(size), _) => {
                let size = size
                    .as_u64()
                    .and_then(|s| usize::try_from(s).ok())
                    .ok_or_else(|| malformed(format!("input '{name}': binary_data_size is not a length")))?;
                if size > binary.len() {
                    return Err(malformed(format!(
                        "input '{name}': binary_data_size {size}, but only {} binary bytes are left",
                        binary.len()
                    )));
                }
                let (mine, rest) = binary.split_at(size);
                binary = rest;
                Data::Raw(mine)
            }
            (None, Some(data)) => Data::Json(data),
            (None, None) => Data::None,
        };
        inputs.push(InputTensor { name, datatype, shape, data });
    }
    if !binary.is_empty() {
        return Err(malformed(format!("{} binary bytes after the last binary input", binary.len())));
    }
    let mut outputs = Vec::new();
    if let Some(list) = object.get("outputs") {
        let list = list.as_array().ok_or_else(|| malformed("'outputs' is not an array"))?;
        for o in list {
            let name = o.get("name").and_then(Value::as_str).ok_or_else(|| malformed("an output without a 'name'"))?;
            if let Some(b) = o.get("parameters").and_then(|p| p.get("binary_data")) {
                binary_output = b.as_bool().unwrap_or(false);
            }
            outputs.push(name);
        }
    }
    let request = InferRequest { model_name: name, model_version: version, id, params, inputs, outputs };
    let answer = service.infer(&request).await?;
    Ok(response(&answer, binary_output))
}

fn response(answer: &InferResponse, binary: bool) -> Response<Full<Bytes>> {
    let n = answer.scores.len();
    let mut output = json!({ "name": tensors::SCORES, "datatype": "FP32", "shape": [n] });
    if binary {
        output["parameters"] = json!({ "binary_data_size": n * 4 });
    } else {
        output["data"] = json!(answer.scores);
    }
    let mut head = json!({
        "model_name": answer.model_name,
        "model_version": answer.model_version,
        "parameters": {
            "tier": answer.tier,
            "reason": answer.reason,
            "model_version": answer.model_version.parse::<u64>().unwrap_or(0),
            "features_missing": answer.features_missing,
            "features_stale": answer.features_stale,
            "server_us": answer.server_us,
        },
        "outputs": [output],
    });
    if !answer.id.is_empty() {
        head["id"] = json!(answer.id);
    }
    let head = serde_json::to_vec(&head).unwrap_or_default();
    if !binary {
        return reply(200, "application/json", head);
    }
    let json_length = head.len();
    let mut body = head;
    body.reserve(n * 4);
    for s in &answer.scores {
        body.extend_from_slice(&s.to_le_bytes());
    }
    let mut r = reply(200, "application/octet-stream", body);
    r.headers_mut().insert(HEADER_LENGTH, hyper::header::HeaderValue::from(json_length));
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_paths_take_an_optional_version_and_a_tail() {
        assert_eq!(model_path(&["v2", "models", "demo"]), Some(("demo", "", "")));
        assert_eq!(model_path(&["v2", "models", "demo", "ready"]), Some(("demo", "", "ready")));
        assert_eq!(model_path(&["v2", "models", "demo", "versions", "3"]), Some(("demo", "3", "")));
        assert_eq!(model_path(&["v2", "models", "demo", "versions", "3", "infer"]), Some(("demo", "3", "infer")));
        assert_eq!(model_path(&["v2", "modelz", "demo"]), None);
    }

    #[test]
    fn a_binary_response_puts_the_scores_after_the_json_header() {
        let answer = InferResponse {
            model_name: "demo".into(),
            model_version: "3".into(),
            id: "x".into(),
            scores: vec![0.25, 0.5],
            tier: "primary",
            reason: "none",
            features_missing: 1,
            features_stale: false,
            server_us: 9,
        };
        let r = response(&answer, true);
        let length: usize = r.headers()[HEADER_LENGTH].to_str().unwrap().parse().unwrap();
        let body = futures_lite::future::block_on(r.into_body().collect()).unwrap().to_bytes();
        let head: Value = serde_json::from_slice(&body[..length]).unwrap();
        assert_eq!(head["outputs"][0]["parameters"]["binary_data_size"], 8);
        assert_eq!(head["parameters"]["features_missing"], 1);
        let scores: Vec<f32> = body[length..].chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        assert_eq!(scores, [0.25, 0.5]);
    }
}
