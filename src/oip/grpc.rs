//! The v2 protocol over gRPC: `inference.GRPCInferenceService`, generated
//! by tonic from `proto/oip/grpc_service.proto`, served by tonic's HTTP/2
//! server on the front end's runtime.
//!
//! Limits: `[oip] connections_max` connections (one more is closed as soon
//! as it is accepted), `streams_per_connection_max` concurrent streams per
//! connection (advertised in HTTP/2 SETTINGS and enforced per connection),
//! `message_bytes_max` per request message (a larger one is refused with
//! RESOURCE_EXHAUSTED before it is decoded), HTTP/2 header lists of
//! [`HEADER_LIST_BYTES_MAX`], writes that wait on the client at most
//! [`WRITE_TIMEOUT`]. Every error is the protocol's: a gRPC status
//! whose code is the error's [`Code`] and whose message names the input.

use std::collections::HashMap;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::{Request, Response, Status};

use super::config::ModelConfig;
use super::tensors::{self, Code, Data, InferError, InferRequest, InputTensor, Param, Params, Service, Signature};
use super::{stopping, OipConfig, Stop};
use crate::admin::http::WriteDeadline;

/// The messages and service of `proto/oip/grpc_service.proto`.
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod proto {
    tonic::include_proto!("inference");
}

use proto::grpc_inference_service_server::{GrpcInferenceService, GrpcInferenceServiceServer};
use proto::infer_parameter::ParameterChoice;

/// This transport in `metrics::OIP_PROTOCOLS`.
const PROTOCOL: usize = 0;
/// HTTP/2 header list (metadata) of one request.
pub const HEADER_LIST_BYTES_MAX: u32 = 16 * 1024;
/// A connection whose writes have waited on the client this long (it
/// stopped reading) is closed.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long accepting pauses after an error that more accepts would repeat.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// The server's name and the extensions it speaks, for both transports.
pub const SERVER_NAME: &str = "quiver";
pub const EXTENSIONS: &[&str] = &["binary_tensor_data", "parameters"];

/// Serves `listener` until `stop`.
pub async fn serve(listener: std::net::TcpListener, service: Arc<Service>, config: OipConfig, stop: Stop) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(error = %e, "oip: the gRPC listener could not be registered; it does not serve");
            return;
        }
    };
    let permits = Arc::new(Semaphore::new(config.connections_max));
    let incoming = futures_lite::stream::unfold((listener, permits), |(listener, permits)| async move {
        loop {
            match listener.accept().await {
                Ok((stream, remote)) => match permits.clone().try_acquire_owned() {
                    Ok(permit) => {
                        let _ = stream.set_nodelay(true);
                        let stream = WriteDeadline::new(stream, WRITE_TIMEOUT);
                        return Some((Ok::<_, io::Error>(Held { stream, _permit: permit }), (listener, permits)));
                    }
                    Err(_) => tracing::debug!(%remote, "oip: gRPC connection refused: oip.connections_max held"),
                },
                Err(e) => {
                    tracing::debug!(error = %e, "oip: gRPC accept failed; retrying");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                }
            }
        }
    });
    let grpc = GrpcInferenceServiceServer::new(Grpc { service })
        .max_decoding_message_size(config.message_bytes_max)
        .max_encoding_message_size(config.message_bytes_max);
    let mut stop_signal = stop.clone();
    let served = tonic::transport::Server::builder()
        .concurrency_limit_per_connection(config.streams_per_connection_max as usize)
        .max_concurrent_streams(config.streams_per_connection_max)
        .http2_max_header_list_size(HEADER_LIST_BYTES_MAX)
        .tcp_nodelay(true)
        .serve_with_incoming_shutdown(grpc, incoming, async move { stopping(&mut stop_signal).await })
        .await;
    if let Err(e) = served {
        tracing::error!(error = %e, "oip: the gRPC listener stopped");
    }
}

/// An accepted connection with its place among `connections_max`.
struct Held {
    stream: WriteDeadline<tokio::net::TcpStream>,
    _permit: OwnedSemaphorePermit,
}

impl tonic::transport::server::Connected for Held {
    type ConnectInfo = ();
    fn connect_info(&self) {}
}

impl AsyncRead for Held {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Held {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, data)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// The protocol's status for `e`.
pub fn status(e: &InferError) -> Status {
    let message = e.to_string();
    match e.code() {
        Code::InvalidArgument => Status::invalid_argument(message),
        Code::NotFound => Status::not_found(message),
        Code::Unavailable => Status::unavailable(message),
        Code::ResourceExhausted => Status::resource_exhausted(message),
        Code::DeadlineExceeded => Status::deadline_exceeded(message),
        Code::Internal => Status::internal(message),
    }
}

fn param(p: &proto::InferParameter) -> Option<Param<'_>> {
    Some(match p.parameter_choice.as_ref()? {
        ParameterChoice::BoolParam(v) => Param::Bool(*v),
        ParameterChoice::Int64Param(v) => Param::Int(*v),
        ParameterChoice::StringParam(v) => Param::Str(v),
        ParameterChoice::DoubleParam(v) => Param::Double(*v),
        ParameterChoice::Uint64Param(v) => Param::Uint(*v),
    })
}

fn string_param(v: impl Into<String>) -> proto::InferParameter {
    proto::InferParameter { parameter_choice: Some(ParameterChoice::StringParam(v.into())) }
}

fn int_param(v: i64) -> proto::InferParameter {
    proto::InferParameter { parameter_choice: Some(ParameterChoice::Int64Param(v)) }
}

/// A tensor's `contents` field for its datatype.
fn contents<'a>(datatype: &str, c: Option<&'a proto::InferTensorContents>) -> Data<'a> {
    let Some(c) = c else { return Data::None };
    match datatype {
        "INT64" => Data::Int64(&c.int64_contents),
        "UINT64" => Data::Uint64(&c.uint64_contents),
        "INT32" | "INT16" | "INT8" => Data::Int32(&c.int_contents),
        "UINT32" | "UINT16" | "UINT8" => Data::Uint32(&c.uint_contents),
        "FP32" => Data::Fp32(&c.fp32_contents),
        "FP64" => Data::Fp64(&c.fp64_contents),
        "BYTES" => Data::Bytes(&c.bytes_contents),
        _ => Data::None,
    }
}

/// `r` as the protocol-neutral request, borrowing its tensors.
fn infer_request(r: &proto::ModelInferRequest) -> Result<InferRequest<'_>, InferError> {
    let mut params = Params::default();
    for (name, p) in &r.parameters {
        if let Some(v) = param(p) {
            params.set(name, v)?;
        }
    }
    if !r.raw_input_contents.is_empty() && r.raw_input_contents.len() != r.inputs.len() {
        return Err(InferError::Malformed(format!(
            "{} raw_input_contents for {} inputs: with raw contents every input has one",
            r.raw_input_contents.len(),
            r.inputs.len()
        )));
    }
    let inputs = r
        .inputs
        .iter()
        .enumerate()
        .map(|(i, t)| InputTensor {
            name: &t.name,
            datatype: &t.datatype,
            shape: &t.shape,
            data: match r.raw_input_contents.get(i) {
                Some(raw) => Data::Raw(raw),
                None => contents(&t.datatype, t.contents.as_ref()),
            },
        })
        .collect();
    Ok(InferRequest {
        model_name: &r.model_name,
        model_version: &r.model_version,
        id: &r.id,
        params,
        inputs,
        outputs: r.outputs.iter().map(|o| o.name.as_str()).collect(),
    })
}

fn metadata(signature: &Signature) -> proto::ModelMetadataResponse {
    let tensor = |t: &tensors::TensorSpec| proto::model_metadata_response::TensorMetadata {
        name: t.name.clone(),
        datatype: t.datatype.name().into(),
        shape: t.shape.clone(),
    };
    proto::ModelMetadataResponse {
        name: signature.name.clone(),
        versions: vec![signature.version.to_string()],
        platform: SERVER_NAME.into(),
        inputs: signature.inputs.iter().map(tensor).collect(),
        outputs: signature.outputs.iter().map(tensor).collect(),
        properties: HashMap::new(),
    }
}

/// Triton's `ModelConfig` message for `config`.
fn model_config(config: &ModelConfig) -> proto::ModelConfigResponse {
    let data_type = |name: &str| proto::DataType::from_str_name(name).unwrap_or(proto::DataType::TypeInvalid) as i32;
    let input = |t: &super::config::ConfigTensor| proto::ModelInput {
        name: t.name.clone(),
        data_type: data_type(t.data_type),
        dims: t.dims.clone(),
        optional: t.optional,
        ..Default::default()
    };
    let output = |t: &super::config::ConfigTensor| proto::ModelOutput {
        name: t.name.clone(),
        data_type: data_type(t.data_type),
        dims: t.dims.clone(),
        ..Default::default()
    };
    let policy = proto::model_version_policy::PolicyChoice::Specific(proto::model_version_policy::Specific {
        versions: vec![i64::from(config.version)],
    });
    proto::ModelConfigResponse {
        config: Some(proto::ModelConfig {
            name: config.name.clone(),
            platform: config.platform.into(),
            backend: config.platform.into(),
            version_policy: Some(proto::ModelVersionPolicy { policy_choice: Some(policy) }),
            max_batch_size: config.max_batch_size,
            input: config.inputs.iter().map(input).collect(),
            output: config.outputs.iter().map(output).collect(),
            ..Default::default()
        }),
    }
}

struct Grpc {
    service: Arc<Service>,
}

#[tonic::async_trait]
impl GrpcInferenceService for Grpc {
    async fn server_live(
        &self,
        _: Request<proto::ServerLiveRequest>,
    ) -> Result<Response<proto::ServerLiveResponse>, Status> {
        Ok(Response::new(proto::ServerLiveResponse { live: self.service.live() }))
    }

    async fn server_ready(
        &self,
        _: Request<proto::ServerReadyRequest>,
    ) -> Result<Response<proto::ServerReadyResponse>, Status> {
        Ok(Response::new(proto::ServerReadyResponse { ready: self.service.ready() }))
    }

    async fn model_ready(
        &self,
        request: Request<proto::ModelReadyRequest>,
    ) -> Result<Response<proto::ModelReadyResponse>, Status> {
        let r = request.get_ref();
        Ok(Response::new(proto::ModelReadyResponse { ready: self.service.model_ready(&r.name, &r.version) }))
    }

    async fn server_metadata(
        &self,
        _: Request<proto::ServerMetadataRequest>,
    ) -> Result<Response<proto::ServerMetadataResponse>, Status> {
        Ok(Response::new(proto::ServerMetadataResponse {
            name: SERVER_NAME.into(),
            version: env!("CARGO_PKG_VERSION").into(),
            extensions: EXTENSIONS.iter().map(|e| e.to_string()).collect(),
        }))
    }

    async fn model_metadata(
        &self,
        request: Request<proto::ModelMetadataRequest>,
    ) -> Result<Response<proto::ModelMetadataResponse>, Status> {
        let r = request.get_ref();
        let signature = self.service.signature(&r.name, &r.version).map_err(|e| status(&e))?;
        Ok(Response::new(metadata(&signature)))
    }

    async fn model_config(
        &self,
        request: Request<proto::ModelConfigRequest>,
    ) -> Result<Response<proto::ModelConfigResponse>, Status> {
        let r = request.get_ref();
        let signature = self.service.signature(&r.name, &r.version).map_err(|e| status(&e))?;
        Ok(Response::new(model_config(&ModelConfig::of(&signature, SERVER_NAME))))
    }

    async fn model_infer(
        &self,
        request: Request<proto::ModelInferRequest>,
    ) -> Result<Response<proto::ModelInferResponse>, Status> {
        let r = request.into_inner();
        let answer = match infer_request(&r) {
            Ok(infer) => self.service.infer(&infer).await,
            Err(e) => Err(e),
        };
        self.service.count(PROTOCOL, answer.as_ref().err());
        let answer = answer.map_err(|e| status(&e))?;
        let raw: Vec<u8> = answer.scores.iter().flat_map(|s| s.to_le_bytes()).collect();
        let mut parameters = HashMap::with_capacity(6);
        parameters.insert("tier".to_string(), string_param(answer.tier));
        parameters.insert("reason".to_string(), string_param(answer.reason));
        parameters.insert("model_version".to_string(), int_param(answer.model_version.parse().unwrap_or(0)));
        parameters.insert("features_missing".to_string(), int_param(i64::from(answer.features_missing)));
        parameters.insert(
            "features_stale".to_string(),
            proto::InferParameter { parameter_choice: Some(ParameterChoice::BoolParam(answer.features_stale)) },
        );
        parameters.insert("server_us".to_string(), int_param(i64::from(answer.server_us)));
        Ok(Response::new(proto::ModelInferResponse {
            model_name: answer.model_name,
            model_version: answer.model_version,
            id: answer.id,
            parameters,
            outputs: vec![proto::model_infer_response::InferOutputTensor {
                name: tensors::SCORES.into(),
                datatype: "FP32".into(),
                shape: vec![answer.scores.len() as i64],
                parameters: HashMap::new(),
                contents: None,
            }],
            raw_output_contents: vec![raw.into()],
        }))
    }
}
