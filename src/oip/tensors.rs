//! What a v2 inference request means to Quiver, whatever carried it: the
//! model's signature (the tensors its metadata lists), the checks of a
//! request's inputs against it, and the FlatBuffers request they become.
//!
//! Both transports (`grpc.rs`, `rest.rs`) parse their own framing into an
//! [`InferRequest`] that borrows their buffers, and answer with what
//! [`Service::infer`] returns: an [`InferResponse`], or an [`InferError`]
//! whose [`Code`] each maps to its protocol's status.
//!
//! Inputs, by the groups the model reads (`docs/PROTOCOL.md` has the wire
//! names): `user_id` (INT64 [1]) keys group `user`, `item_ids` (INT64 [-1],
//! one per candidate) keys group `item`; every other group the request keys
//! is an input of its own name, INT64 for u64 keys or BYTES for string keys,
//! [1] at request scope and [-1] at candidate scope; `context` (FP32) and
//! `context_ids` (INT64) carry the context the model reads. The output is
//! `scores` (FP32 [-1]). UINT64 is taken wherever INT64 is.
//!
//! Raw rows: a caller that computes its features itself sends one input,
//! `rows` (FP32 [N, width], the model's input rows), instead of all of the
//! above; it becomes a FlatBuffers raw-rows request, scored with nothing
//! looked up. It is not in the metadata, so tools that fill every listed
//! input (perf_analyzer) keep sending keys; docs/PROTOCOL.md documents it.

use std::time::Duration;

use crate::features::groups::{Absent, Scope};
use crate::features::replica::KeyKind;
use crate::model::{Model, Source};
use crate::wire::{self, GroupKeySpec, RequestSpec, Status};

use super::upstream::{Upstream, UpstreamError};
use super::{Context, OipConfig};

/// The v2 tensor datatypes (the protocol's "Tensor Data Types").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataType {
    Bool,
    Uint8,
    Uint16,
    Uint32,
    Uint64,
    Int8,
    Int16,
    Int32,
    Int64,
    Fp16,
    Fp32,
    Fp64,
    Bytes,
}

impl DataType {
    pub fn parse(name: &str) -> Option<DataType> {
        Some(match name {
            "BOOL" => DataType::Bool,
            "UINT8" => DataType::Uint8,
            "UINT16" => DataType::Uint16,
            "UINT32" => DataType::Uint32,
            "UINT64" => DataType::Uint64,
            "INT8" => DataType::Int8,
            "INT16" => DataType::Int16,
            "INT32" => DataType::Int32,
            "INT64" => DataType::Int64,
            "FP16" => DataType::Fp16,
            "FP32" => DataType::Fp32,
            "FP64" => DataType::Fp64,
            "BYTES" => DataType::Bytes,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            DataType::Bool => "BOOL",
            DataType::Uint8 => "UINT8",
            DataType::Uint16 => "UINT16",
            DataType::Uint32 => "UINT32",
            DataType::Uint64 => "UINT64",
            DataType::Int8 => "INT8",
            DataType::Int16 => "INT16",
            DataType::Int32 => "INT32",
            DataType::Int64 => "INT64",
            DataType::Fp16 => "FP16",
            DataType::Fp32 => "FP32",
            DataType::Fp64 => "FP64",
            DataType::Bytes => "BYTES",
        }
    }
}

/// What an input carries to the request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Role {
    /// `user_id`: the key of group `user`.
    UserId,
    /// `item_ids`: the keys of group `item`, one per candidate.
    ItemIds,
    Context,
    ContextIds,
    /// The keys of a named group: strings when `strings`.
    Group {
        strings: bool,
    },
}

/// One tensor of a signature.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub datatype: DataType,
    /// -1: one per candidate.
    pub shape: Vec<i64>,
    pub role: Role,
    /// A request may leave it out.
    pub optional: bool,
}

/// A served model as the protocol describes it.
#[derive(Clone, Debug, PartialEq)]
pub struct Signature {
    pub name: String,
    /// The version answering unless a canary takes the request.
    pub version: u32,
    pub inputs: Vec<TensorSpec>,
    pub outputs: Vec<TensorSpec>,
    /// Floats in one of the model's input rows: a raw `rows` input's width.
    pub row_width: usize,
}

/// The name of the one output.
pub const SCORES: &str = "scores";

/// The input that carries raw rows in place of keys and context.
pub const RAW_ROWS: &str = "rows";

impl Signature {
    /// `model`'s inputs as requests key them: one per group the model reads
    /// (a group reached through its child's links is keyed by those, not
    /// by requests), then the context.
    pub fn of(model: &Model, groups: &[crate::request::SharedGroup]) -> Signature {
        let mut inputs: Vec<TensorSpec> = Vec::new();
        let mut context = 0i64;
        let mut context_ids = 0i64;
        for segment in &model.inputs {
            match segment.source {
                Source::Context => context += segment.dim as i64,
                Source::ContextIds => context_ids += segment.dim as i64,
                source => {
                    let Some((name, scope)) = source.group() else { continue };
                    if inputs.iter().any(|t| t.name == name || (t.role == Role::UserId && name == "user"))
                        || inputs.iter().any(|t| t.role == Role::ItemIds && name == "item")
                    {
                        continue;
                    }
                    let group = groups.iter().find(|g| g.name == name);
                    if group.is_some_and(|g| g.child.is_some()) {
                        continue;
                    }
                    let strings = group.is_some_and(|g| matches!(g.handle.key_kind(), KeyKind::Str { .. }));
                    let per_candidate = scope == Scope::Candidate;
                    let (name, role) = match (name, strings) {
                        ("user", false) => ("user_id".to_string(), Role::UserId),
                        ("item", false) => ("item_ids".to_string(), Role::ItemIds),
                        (name, strings) => (name.to_string(), Role::Group { strings }),
                    };
                    // The candidates are counted by `item_ids` when the
                    // model reads them: never optional.
                    let optional = role != Role::ItemIds && group.is_some_and(|g| g.absent == Absent::Default);
                    inputs.push(TensorSpec {
                        name,
                        datatype: if strings { DataType::Bytes } else { DataType::Int64 },
                        shape: vec![if per_candidate { -1 } else { 1 }],
                        role,
                        optional,
                    });
                }
            }
        }
        if context > 0 {
            inputs.push(TensorSpec {
                name: "context".into(),
                datatype: DataType::Fp32,
                shape: vec![context],
                role: Role::Context,
                optional: true,
            });
        }
        if context_ids > 0 {
            inputs.push(TensorSpec {
                name: "context_ids".into(),
                datatype: DataType::Int64,
                shape: vec![context_ids],
                role: Role::ContextIds,
                optional: true,
            });
        }
        let outputs = vec![TensorSpec {
            name: SCORES.into(),
            datatype: DataType::Fp32,
            shape: vec![-1],
            role: Role::Context,
            optional: false,
        }];
        let row_width = model.inputs.iter().map(|s| s.dim).sum();
        Signature { name: model.name.clone(), version: model.version, inputs, outputs, row_width }
    }
}

/// An input tensor's values, as its transport carried them.
#[derive(Clone, Copy, Debug)]
pub enum Data<'a> {
    /// Little-endian bytes in row-major order (gRPC `raw_input_contents`,
    /// HTTP's binary extension); a BYTES element is a 4-byte little-endian
    /// length and that many bytes.
    Raw(&'a [u8]),
    /// gRPC `contents`, by field.
    Int64(&'a [i64]),
    Uint64(&'a [u64]),
    Int32(&'a [i32]),
    Uint32(&'a [u32]),
    Fp32(&'a [f32]),
    Fp64(&'a [f64]),
    Bytes(&'a [bytes::Bytes]),
    /// HTTP JSON `data`: a flat or nested array.
    Json(&'a serde_json::Value),
    /// No values at all.
    None,
}

/// One input of a request.
#[derive(Clone, Debug)]
pub struct InputTensor<'a> {
    pub name: &'a str,
    pub datatype: &'a str,
    pub shape: &'a [i64],
    pub data: Data<'a>,
}

/// A request parameter's value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Param<'a> {
    Bool(bool),
    Int(i64),
    Uint(u64),
    Double(f64),
    Str(&'a str),
}

/// The parameters Quiver reads from a request (others are ignored, as the
/// protocol allows): `budget_us` (or `timeout`, which tritonclient's
/// `timeout=` sends, also in microseconds), `priority` (tritonclient's
/// `priority=`) and `client_id`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Params {
    pub budget_us: u32,
    pub priority: u8,
    pub client_id: u32,
}

impl Params {
    /// Takes one named parameter; unknown names are not Quiver's.
    pub fn set(&mut self, name: &str, value: Param<'_>) -> Result<(), InferError> {
        let int = |max: u64| -> Result<u64, InferError> {
            let v = match value {
                Param::Int(v) if v >= 0 => v as u64,
                Param::Uint(v) => v,
                // JSON numbers arrive as doubles when written with a point.
                Param::Double(v) if v >= 0.0 && v.fract() == 0.0 && v <= max as f64 => v as u64,
                _ => {
                    return Err(InferError::Parameter {
                        name: name.into(),
                        why: format!("takes an integer in 0..={max}, not {value:?}"),
                    })
                }
            };
            if v > max {
                return Err(InferError::Parameter { name: name.into(), why: format!("{v} is over {max}") });
            }
            Ok(v)
        };
        match name {
            // tritonclient's `timeout=` (microseconds) is the budget too.
            "budget_us" | "timeout" => self.budget_us = int(u64::from(u32::MAX))? as u32,
            "priority" => self.priority = int(u64::from(u8::MAX))? as u8,
            "client_id" => self.client_id = int(u64::from(u32::MAX))? as u32,
            _ => {}
        }
        Ok(())
    }
}

/// A v2 inference request, borrowing its transport's buffers.
#[derive(Clone, Debug, Default)]
pub struct InferRequest<'a> {
    pub model_name: &'a str,
    /// Empty: the version the server picks.
    pub model_version: &'a str,
    pub id: &'a str,
    pub params: Params,
    pub inputs: Vec<InputTensor<'a>>,
    /// Outputs asked for by name; empty: all.
    pub outputs: Vec<&'a str>,
}

/// A v2 inference response.
#[derive(Clone, Debug, PartialEq)]
pub struct InferResponse {
    pub model_name: String,
    pub model_version: String,
    pub id: String,
    pub scores: Vec<f32>,
    pub tier: &'static str,
    pub reason: &'static str,
    pub features_missing: u16,
    pub features_stale: bool,
    pub server_us: u32,
}

/// The protocol's error classes; each transport maps them to its statuses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Code {
    InvalidArgument,
    NotFound,
    Unavailable,
    ResourceExhausted,
    DeadlineExceeded,
    Internal,
}

/// Why a request got no scores.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum InferError {
    #[error("unknown model '{0}'")]
    UnknownModel(String),
    #[error("model '{model}' version '{asked}' is not served (version {served} is)")]
    UnknownVersion { model: String, asked: String, served: u32 },
    #[error("unexpected inference input '{name}' for model '{model}' (it takes {takes})")]
    UnknownInput { model: String, name: String, takes: String },
    #[error("input '{0}' is given more than once")]
    DuplicateInput(String),
    #[error("expected input '{name}' for model '{model}', which the request does not give")]
    MissingInput { model: String, name: String },
    #[error("input '{name}': datatype {got}, model '{model}' takes {want}")]
    Datatype { model: String, name: String, got: String, want: String },
    #[error(
        "input '{name}': shape {got:?}, model '{model}' takes {want:?} (-1: one per candidate, 1 to {candidates_max})"
    )]
    Shape { model: String, name: String, got: Vec<i64>, want: Vec<i64>, candidates_max: usize },
    #[error("input '{name}': {count} elements, over the limit of {max} (oip.tensor_elements_max)")]
    TooManyElements { name: String, count: u64, max: usize },
    #[error("input '{name}': {why}")]
    Data { name: String, why: String },
    #[error("unexpected inference output '{0}' (the model outputs 'scores')")]
    UnknownOutput(String),
    #[error("parameter '{name}': {why}")]
    Parameter { name: String, why: String },
    #[error("{0}")]
    Malformed(String),
    #[error("the request is {bytes} bytes, over the limit of {max} (oip.message_bytes_max)")]
    TooLarge { bytes: u64, max: usize },
    #[error("{}: {message}", wire::status_name(*.status))]
    Refused { status: Status, message: String },
    #[error("no answer from the shards within {0} ms")]
    Timeout(u64),
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
}

impl InferError {
    pub fn code(&self) -> Code {
        match self {
            InferError::UnknownModel(_) | InferError::UnknownVersion { .. } => Code::NotFound,
            InferError::TooLarge { .. } => Code::ResourceExhausted,
            InferError::Refused { status, .. } => match *status {
                Status::BadRequest => Code::InvalidArgument,
                Status::ModelNotFound => Code::NotFound,
                Status::DeadlineExceeded => Code::DeadlineExceeded,
                Status::Overloaded => Code::Unavailable,
                Status::RateLimited => Code::ResourceExhausted,
                _ => Code::Internal,
            },
            InferError::Timeout(_) => Code::DeadlineExceeded,
            InferError::Upstream(_) => Code::Unavailable,
            _ => Code::InvalidArgument,
        }
    }
}

/// The front end's shared state: what it knows of the server, and its
/// connections to the shards.
pub struct Service {
    pub context: Context,
    upstream: Upstream,
    checker: Checker,
    grace: Duration,
}

impl Service {
    pub fn new(context: Context, upstream: Upstream, config: &OipConfig) -> Service {
        let checker =
            Checker { candidates_max: context.candidates_max, tensor_elements_max: config.tensor_elements_max };
        Service { context, upstream, checker, grace: Duration::from_millis(config.grace_ms) }
    }

    pub fn live(&self) -> bool {
        true
    }

    pub fn ready(&self) -> bool {
        self.context.readiness.is_ready()
    }

    /// The model served under `name` (the default model for an empty name).
    pub fn model(&self, name: &str) -> Result<std::sync::Arc<Model>, InferError> {
        let snapshot = self.context.registry.snapshot();
        let name = if name.is_empty() { snapshot.default.as_str() } else { name };
        snapshot.models.iter().find(|m| m.name == name).cloned().ok_or_else(|| InferError::UnknownModel(name.into()))
    }

    /// The signature of `name` at `version` (empty: the current one).
    pub fn signature(&self, name: &str, version: &str) -> Result<Signature, InferError> {
        let model = self.model(name)?;
        if !version.is_empty() && version.parse::<u32>().ok() != Some(model.version) {
            return Err(InferError::UnknownVersion {
                model: model.name.clone(),
                asked: version.into(),
                served: model.version,
            });
        }
        Ok(Signature::of(&model, &self.context.groups))
    }

    /// Whether `name` (at `version`) serves now.
    pub fn model_ready(&self, name: &str, version: &str) -> bool {
        self.ready() && self.signature(name, version).is_ok()
    }

    /// Counts an inference request of `protocol` (an index of
    /// `metrics::OIP_PROTOCOLS`) that ended in `error`, or did not.
    pub fn count(&self, protocol: usize, error: Option<&InferError>) {
        let status = match error.map(InferError::code) {
            None => 0,
            Some(Code::InvalidArgument) => 1,
            Some(Code::NotFound) => 2,
            Some(Code::ResourceExhausted) => 3,
            Some(Code::Unavailable) => 4,
            Some(Code::DeadlineExceeded) => 5,
            Some(Code::Internal) => 6,
        };
        self.context.counters.count(protocol, status);
    }

    /// Checks `request` against its model, sends it to a shard and waits
    /// for the answer, within its budget and the grace.
    pub async fn infer(&self, request: &InferRequest<'_>) -> Result<InferResponse, InferError> {
        let signature = self.signature(request.model_name, request.model_version)?;
        let spec = self.checker.spec(&signature, request)?;
        let budget_us = match request.params.budget_us {
            0 => self.context.budget_us_default,
            b => b.min(self.context.budget_us_max),
        };
        let wait = Duration::from_micros(u64::from(budget_us)) + self.grace;
        let response = match tokio::time::timeout(wait, self.upstream.call(spec)).await {
            Ok(answer) => answer?,
            Err(_) => return Err(InferError::Timeout(wait.as_millis() as u64)),
        };
        if response.status != Status::Ok {
            return Err(InferError::Refused { status: response.status, message: response.error });
        }
        Ok(InferResponse {
            model_name: signature.name,
            model_version: response.model_version.to_string(),
            id: request.id.to_string(),
            scores: response.scores,
            tier: wire::tier_name(response.tier),
            reason: wire::reason_name(response.reason),
            features_missing: response.features_missing,
            features_stale: response.features_stale,
            server_us: response.server_us,
        })
    }
}

/// The limits a request's inputs are checked against.
#[derive(Clone, Copy, Debug)]
pub struct Checker {
    pub candidates_max: usize,
    pub tensor_elements_max: usize,
}

impl Checker {
    /// The FlatBuffers request `request` asks for, once every input is
    /// checked against `signature`.
    pub fn spec(&self, signature: &Signature, request: &InferRequest<'_>) -> Result<RequestSpec, InferError> {
        for output in &request.outputs {
            if *output != SCORES {
                return Err(InferError::UnknownOutput((*output).into()));
            }
        }
        let mut spec = RequestSpec {
            model: signature.name.clone(),
            budget_us: request.params.budget_us,
            priority: request.params.priority,
            client_id: request.params.client_id,
            ..RequestSpec::default()
        };
        if self.raw_rows(signature, request, &mut spec)? {
            return Ok(spec);
        }
        let mut seen: Vec<&str> = Vec::with_capacity(request.inputs.len());
        for input in &request.inputs {
            if seen.contains(&input.name) {
                return Err(InferError::DuplicateInput(input.name.into()));
            }
            seen.push(input.name);
            let Some(want) = signature.inputs.iter().find(|t| t.name == input.name) else {
                return Err(InferError::UnknownInput {
                    model: signature.name.clone(),
                    name: input.name.into(),
                    takes: signature.inputs.iter().map(|t| format!("'{}'", t.name)).collect::<Vec<_>>().join(", "),
                });
            };
            let count = self.check(signature, want, input)?;
            match &want.role {
                Role::UserId => spec.user_id = ids(input, count)?[0],
                Role::ItemIds => spec.item_ids = ids(input, count)?,
                Role::Context => spec.context = floats(input, count)?,
                Role::ContextIds => spec.context_ids = ids(input, count)?,
                Role::Group { strings: false } => {
                    spec.groups.push((want.name.clone(), GroupKeySpec::Ids(ids(input, count)?)));
                }
                Role::Group { strings: true } => {
                    spec.groups.push((want.name.clone(), GroupKeySpec::Strs(strings(input, count)?)));
                }
            }
        }
        if let Some(missing) = signature.inputs.iter().find(|t| !t.optional && !seen.contains(&t.name.as_str())) {
            return Err(InferError::MissingInput { model: signature.name.clone(), name: missing.name.clone() });
        }
        // The candidate-scope inputs must agree on the count.
        let per_candidate: Vec<(&str, usize)> = signature
            .inputs
            .iter()
            .filter(|t| t.shape == [-1])
            .filter_map(|t| {
                let input = request.inputs.iter().find(|i| i.name == t.name)?;
                Some((input.name, input.shape.first().copied().unwrap_or(0) as usize))
            })
            .collect();
        if let Some(&(first, n)) = per_candidate.first() {
            if let Some(&(other, m)) = per_candidate.iter().find(|(_, m)| *m != n) {
                return Err(InferError::Data {
                    name: other.into(),
                    why: format!("{m} keys, but '{first}' has {n}: every candidate-scope input has one per candidate"),
                });
            }
        }
        Ok(spec)
    }

    /// Takes a request whose input is `rows` into `spec` as raw rows:
    /// FP32 [N, the model's row width], the only input. False when the
    /// request keys its rows instead (or the model has a keyed input of
    /// that name, which wins).
    fn raw_rows(
        &self,
        signature: &Signature,
        request: &InferRequest<'_>,
        spec: &mut RequestSpec,
    ) -> Result<bool, InferError> {
        if signature.inputs.iter().any(|t| t.name == RAW_ROWS) {
            return Ok(false);
        }
        let Some(input) = request.inputs.iter().find(|i| i.name == RAW_ROWS) else {
            return Ok(false);
        };
        if let Some(other) = request.inputs.iter().find(|i| i.name != RAW_ROWS) {
            let why = format!("raw rows are the model's whole input; the request also gives '{}'", other.name);
            return Err(InferError::Data { name: RAW_ROWS.into(), why });
        }
        if request.inputs.len() > 1 {
            return Err(InferError::DuplicateInput(RAW_ROWS.into()));
        }
        let want = TensorSpec {
            name: RAW_ROWS.into(),
            datatype: DataType::Fp32,
            shape: vec![-1, signature.row_width as i64],
            role: Role::Context,
            optional: true,
        };
        let count = self.check(signature, &want, input)?;
        spec.rows = floats(input, count)?;
        // `check` bounded the first dimension by `candidates_max`.
        spec.row_count = input.shape[0] as u32;
        Ok(true)
    }

    /// `input`'s datatype, shape and element count against `want`; returns
    /// the element count.
    fn check(&self, signature: &Signature, want: &TensorSpec, input: &InputTensor<'_>) -> Result<usize, InferError> {
        let datatype = DataType::parse(input.datatype);
        let fits = match (want.datatype, datatype) {
            (DataType::Int64, Some(DataType::Int64 | DataType::Uint64)) => true,
            (w, Some(g)) => w == g,
            (_, None) => false,
        };
        if !fits {
            let want_name = match want.datatype {
                DataType::Int64 => "INT64 (or UINT64)",
                other => other.name(),
            };
            return Err(InferError::Datatype {
                model: signature.name.clone(),
                name: input.name.into(),
                got: input.datatype.into(),
                want: want_name.into(),
            });
        }
        let shape_error = || InferError::Shape {
            model: signature.name.clone(),
            name: input.name.into(),
            got: input.shape.to_vec(),
            want: want.shape.clone(),
            candidates_max: self.candidates_max,
        };
        if input.shape.len() != want.shape.len() {
            return Err(shape_error());
        }
        let mut count: u64 = 1;
        for (&got, &w) in input.shape.iter().zip(&want.shape) {
            let fits = if w == -1 { (1..=self.candidates_max as i64).contains(&got) } else { got == w };
            if !fits {
                return Err(shape_error());
            }
            count = count.saturating_mul(got as u64);
        }
        if count > self.tensor_elements_max as u64 {
            return Err(InferError::TooManyElements { name: input.name.into(), count, max: self.tensor_elements_max });
        }
        Ok(count as usize)
    }
}

fn data_error(input: &InputTensor<'_>, why: impl Into<String>) -> InferError {
    InferError::Data { name: input.name.into(), why: why.into() }
}

fn count_error(input: &InputTensor<'_>, count: usize, got: usize) -> InferError {
    data_error(input, format!("holds {got} elements, its shape {:?} says {count}", input.shape))
}

/// An id input's values (INT64 that are not negative, or UINT64).
fn ids(input: &InputTensor<'_>, count: usize) -> Result<Vec<u64>, InferError> {
    let unsigned = input.datatype == "UINT64";
    let negative = |v: i64| data_error(input, format!("{v} is negative: ids are 0 to 2^63-1 as INT64"));
    let out: Vec<u64> = match input.data {
        Data::Raw(bytes) => {
            if bytes.len() != count * 8 {
                return Err(data_error(
                    input,
                    format!("{} raw bytes, its shape {:?} takes {}", bytes.len(), input.shape, count * 8),
                ));
            }
            let mut out = Vec::with_capacity(count);
            for chunk in bytes.chunks_exact(8) {
                let word: [u8; 8] = chunk.try_into().unwrap_or([0; 8]);
                if unsigned {
                    out.push(u64::from_le_bytes(word));
                } else {
                    let v = i64::from_le_bytes(word);
                    out.push(u64::try_from(v).map_err(|_| negative(v))?);
                }
            }
            out
        }
        Data::Int64(v) if !unsigned => {
            v.iter().map(|&x| u64::try_from(x).map_err(|_| negative(x))).collect::<Result<_, _>>()?
        }
        Data::Uint64(v) if unsigned => v.to_vec(),
        Data::Json(value) => {
            let mut out = Vec::with_capacity(count);
            flatten(value, count, &mut |v| {
                out.push(v.as_u64().ok_or_else(|| match v.as_i64() {
                    Some(n) => negative(n),
                    None => data_error(input, format!("{v} is not an integer id")),
                })?);
                Ok(())
            })
            .map_err(|e| e.unwrap_or_else(|| count_error(input, count, count + 1)))?;
            out
        }
        Data::None => return Err(data_error(input, "carries no values")),
        _ => return Err(data_error(input, format!("its values are not in the contents field for {}", input.datatype))),
    };
    if out.len() != count {
        return Err(count_error(input, count, out.len()));
    }
    Ok(out)
}

/// An FP32 input's values.
fn floats(input: &InputTensor<'_>, count: usize) -> Result<Vec<f32>, InferError> {
    let out: Vec<f32> = match input.data {
        Data::Raw(bytes) => {
            if bytes.len() != count * 4 {
                return Err(data_error(
                    input,
                    format!("{} raw bytes, its shape {:?} takes {}", bytes.len(), input.shape, count * 4),
                ));
            }
            bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap_or([0; 4]))).collect()
        }
        Data::Fp32(v) => v.to_vec(),
        Data::Json(value) => {
            let mut out = Vec::with_capacity(count);
            flatten(value, count, &mut |v| {
                out.push(v.as_f64().ok_or_else(|| data_error(input, format!("{v} is not a number")))? as f32);
                Ok(())
            })
            .map_err(|e| e.unwrap_or_else(|| count_error(input, count, count + 1)))?;
            out
        }
        Data::None => return Err(data_error(input, "carries no values")),
        _ => return Err(data_error(input, "its values are not in fp32_contents")),
    };
    if out.len() != count {
        return Err(count_error(input, count, out.len()));
    }
    Ok(out)
}

/// A BYTES input's values, each UTF-8.
fn strings(input: &InputTensor<'_>, count: usize) -> Result<Vec<String>, InferError> {
    let utf8 =
        |b: &[u8]| std::str::from_utf8(b).map(str::to_string).map_err(|_| data_error(input, "a key that is not UTF-8"));
    let out: Vec<String> = match input.data {
        Data::Raw(mut bytes) => {
            let mut out = Vec::with_capacity(count);
            while !bytes.is_empty() {
                if out.len() == count {
                    return Err(count_error(input, count, count + 1));
                }
                let Some((len, rest)) = bytes.split_first_chunk::<4>() else {
                    return Err(data_error(input, "a BYTES element cut short in its length"));
                };
                let len = u32::from_le_bytes(*len) as usize;
                if rest.len() < len {
                    return Err(data_error(input, "a BYTES element longer than the bytes left"));
                }
                out.push(utf8(&rest[..len])?);
                bytes = &rest[len..];
            }
            out
        }
        Data::Bytes(v) => v.iter().map(|b| utf8(b)).collect::<Result<_, _>>()?,
        Data::Json(value) => {
            let mut out = Vec::with_capacity(count);
            flatten(value, count, &mut |v| {
                out.push(v.as_str().ok_or_else(|| data_error(input, format!("{v} is not a string")))?.to_string());
                Ok(())
            })
            .map_err(|e| e.unwrap_or_else(|| count_error(input, count, count + 1)))?;
            out
        }
        Data::None => return Err(data_error(input, "carries no values")),
        _ => return Err(data_error(input, "its values are not in bytes_contents")),
    };
    if out.len() != count {
        return Err(count_error(input, count, out.len()));
    }
    Ok(out)
}

/// Most levels of nesting a JSON `data` array may have.
const JSON_DEPTH_MAX: usize = 8;

/// Calls `each` on the scalars of a flat or nested JSON array in row-major
/// order, at most `count` of them: `Err(None)` when there are more.
fn flatten(
    value: &serde_json::Value,
    count: usize,
    each: &mut dyn FnMut(&serde_json::Value) -> Result<(), InferError>,
) -> Result<(), Option<InferError>> {
    fn walk(
        value: &serde_json::Value,
        depth: usize,
        left: &mut usize,
        each: &mut dyn FnMut(&serde_json::Value) -> Result<(), InferError>,
    ) -> Result<(), Option<InferError>> {
        match value {
            serde_json::Value::Array(items) => {
                if depth == JSON_DEPTH_MAX {
                    return Err(Some(InferError::Malformed(format!(
                        "'data' nested deeper than {JSON_DEPTH_MAX} arrays"
                    ))));
                }
                for item in items {
                    walk(item, depth + 1, left, each)?;
                }
                Ok(())
            }
            scalar => {
                if *left == 0 {
                    return Err(None);
                }
                *left -= 1;
                each(scalar).map_err(Some)
            }
        }
    }
    let mut left = count;
    walk(value, 0, &mut left, each)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn signature() -> Signature {
        let spec = |name: &str, datatype, shape: &[i64], role, optional| TensorSpec {
            name: name.into(),
            datatype,
            shape: shape.to_vec(),
            role,
            optional,
        };
        Signature {
            name: "demo".into(),
            version: 3,
            inputs: vec![
                spec("user_id", DataType::Int64, &[1], Role::UserId, false),
                spec("item_ids", DataType::Int64, &[-1], Role::ItemIds, false),
                spec("context", DataType::Fp32, &[2], Role::Context, true),
                spec("device", DataType::Bytes, &[1], Role::Group { strings: true }, true),
                spec("ad", DataType::Int64, &[-1], Role::Group { strings: false }, true),
            ],
            outputs: Vec::new(),
            row_width: 3,
        }
    }

    #[test]
    fn a_rows_input_alone_becomes_a_raw_rows_request() {
        let sig = signature();
        let rows = [0.5f32, -1.0, f32::NAN, 2.0, 0.0, 3.5];
        let raw = le(&rows, |v| v.to_le_bytes().to_vec());
        let json = serde_json::json!([[0.5, -1.0, 0.0], [2.0, 0.0, 3.5]]);
        let spec = CHECKER.spec(&sig, &request(vec![input("rows", "FP32", &[2, 3], Data::Raw(&raw))])).unwrap();
        assert_eq!((spec.row_count, spec.rows.len(), spec.model.as_str()), (2, 6, "demo"));
        assert_eq!(spec.rows.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), rows.map(f32::to_bits));
        assert!(spec.item_ids.is_empty() && spec.user_id == 0 && spec.groups.is_empty());
        let spec = CHECKER.spec(&sig, &request(vec![input("rows", "FP32", &[2, 3], Data::Json(&json))])).unwrap();
        assert_eq!(spec.rows, [0.5, -1.0, 0.0, 2.0, 0.0, 3.5]);
        let err = |inputs| CHECKER.spec(&sig, &request(inputs)).unwrap_err();
        let fp = [1.0f32; 6];
        let rows_input = || input("rows", "FP32", &[2, 3], Data::Fp32(&fp));
        assert!(matches!(err(vec![input("rows", "FP32", &[3, 2], Data::Fp32(&fp))]), InferError::Shape { .. }));
        assert!(matches!(err(vec![input("rows", "FP32", &[6], Data::Fp32(&fp))]), InferError::Shape { .. }));
        assert!(matches!(err(vec![input("rows", "FP64", &[2, 3], Data::Fp32(&fp))]), InferError::Datatype { .. }));
        let many = [0.0f32; 27];
        assert!(matches!(err(vec![input("rows", "FP32", &[9, 3], Data::Fp32(&many))]), InferError::Shape { .. }));
        let one = [1i64];
        match err(vec![rows_input(), input("user_id", "INT64", &[1], Data::Int64(&one))]) {
            InferError::Data { name, why } => assert!(name == "rows" && why.contains("'user_id'"), "{why}"),
            other => panic!("{other:?}"),
        }
        assert_eq!(err(vec![rows_input(), rows_input()]), InferError::DuplicateInput("rows".into()));
        // Five rows of three: 15 elements fit; the element limit (16) holds.
        let five = [0.0f32; 15];
        assert_eq!(
            CHECKER.spec(&sig, &request(vec![input("rows", "FP32", &[5, 3], Data::Fp32(&five))])).unwrap().row_count,
            5
        );
    }

    const CHECKER: Checker = Checker { candidates_max: 8, tensor_elements_max: 16 };

    fn input<'a>(name: &'a str, datatype: &'a str, shape: &'a [i64], data: Data<'a>) -> InputTensor<'a> {
        InputTensor { name, datatype, shape, data }
    }

    fn request<'a>(inputs: Vec<InputTensor<'a>>) -> InferRequest<'a> {
        InferRequest { model_name: "demo", inputs, ..InferRequest::default() }
    }

    fn le<T: Copy>(values: &[T], bytes: fn(T) -> Vec<u8>) -> Vec<u8> {
        values.iter().flat_map(|&v| bytes(v)).collect()
    }

    #[test]
    fn datatypes_round_trip_their_names() {
        for name in [
            "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64",
            "BYTES",
        ] {
            assert_eq!(DataType::parse(name).map(DataType::name), Some(name));
        }
        assert_eq!(DataType::parse("FLOAT"), None);
    }

    #[test]
    fn raw_contents_and_json_give_the_same_request() {
        let sig = signature();
        let user = le(&[7i64], |v| v.to_le_bytes().to_vec());
        let items = le(&[1i64, 2, 3], |v| v.to_le_bytes().to_vec());
        let context = le(&[0.5f32, -1.25], |v| v.to_le_bytes().to_vec());
        let mut device = 3u32.to_le_bytes().to_vec();
        device.extend_from_slice(b"ios");
        let raw = request(vec![
            input("user_id", "INT64", &[1], Data::Raw(&user)),
            input("item_ids", "INT64", &[3], Data::Raw(&items)),
            input("context", "FP32", &[2], Data::Raw(&context)),
            input("device", "BYTES", &[1], Data::Raw(&device)),
        ]);
        let device_bytes = [bytes::Bytes::from_static(b"ios")];
        let contents = request(vec![
            input("user_id", "UINT64", &[1], Data::Uint64(&[7])),
            input("item_ids", "INT64", &[3], Data::Int64(&[1, 2, 3])),
            input("context", "FP32", &[2], Data::Fp32(&[0.5, -1.25])),
            input("device", "BYTES", &[1], Data::Bytes(&device_bytes)),
        ]);
        let json_user = serde_json::json!([7]);
        let json_items = serde_json::json!([[1, 2], [3]]);
        let json_context = serde_json::json!([0.5, -1.25]);
        let json_device = serde_json::json!(["ios"]);
        let json = request(vec![
            input("user_id", "INT64", &[1], Data::Json(&json_user)),
            input("item_ids", "INT64", &[3], Data::Json(&json_items)),
            input("context", "FP32", &[2], Data::Json(&json_context)),
            input("device", "BYTES", &[1], Data::Json(&json_device)),
        ]);
        let want = RequestSpec {
            model: "demo".into(),
            user_id: 7,
            item_ids: vec![1, 2, 3],
            context: vec![0.5, -1.25],
            groups: vec![("device".into(), GroupKeySpec::Strs(vec!["ios".into()]))],
            ..RequestSpec::default()
        };
        for r in [raw, contents, json] {
            assert_eq!(CHECKER.spec(&sig, &r).unwrap(), want);
        }
    }

    #[test]
    fn each_bad_input_is_named_with_its_error() {
        let sig = signature();
        let one = [1i64];
        let items = [1i64, 2];
        let ok_user = || input("user_id", "INT64", &[1], Data::Int64(&one));
        let ok_items = || input("item_ids", "INT64", &[2], Data::Int64(&items));
        let cases: Vec<(Vec<InputTensor<'_>>, &str)> = vec![
            (vec![ok_user()], "MissingInput"),
            (vec![ok_user(), ok_items(), input("nope", "INT64", &[1], Data::Int64(&one))], "UnknownInput"),
            (vec![ok_user(), ok_items(), ok_user()], "DuplicateInput"),
            (vec![input("user_id", "FP32", &[1], Data::Fp32(&[1.0])), ok_items()], "Datatype"),
            (vec![input("user_id", "INT64", &[2], Data::Int64(&items)), ok_items()], "Shape"),
            (vec![input("user_id", "INT64", &[1, 1], Data::Int64(&one)), ok_items()], "Shape"),
            (vec![ok_user(), input("item_ids", "INT64", &[9], Data::Int64(&[0; 9]))], "Shape"),
            (vec![ok_user(), input("item_ids", "INT64", &[0], Data::Int64(&[]))], "Shape"),
            (vec![ok_user(), input("item_ids", "INT64", &[3], Data::Int64(&items))], "Data"),
            (vec![input("user_id", "INT64", &[1], Data::Int64(&[-4])), ok_items()], "Data"),
            (vec![input("user_id", "INT64", &[1], Data::Raw(&[1, 2, 3])), ok_items()], "Data"),
            (vec![input("user_id", "INT64", &[1], Data::None), ok_items()], "Data"),
            (vec![input("user_id", "INT64", &[1], Data::Fp32(&[1.0])), ok_items()], "Data"),
            (
                vec![ok_user(), ok_items(), input("ad", "INT64", &[1], Data::Int64(&one))],
                "Data", // one key, two candidates
            ),
            (vec![ok_user(), ok_items(), input("device", "BYTES", &[1], Data::Raw(&[9, 0, 0, 0, b'x']))], "Data"),
            (vec![ok_user(), ok_items(), input("context", "FP32", &[2], Data::Raw(&[0; 7]))], "Data"),
        ];
        for (inputs, want) in cases {
            let got = CHECKER.spec(&sig, &request(inputs.clone())).unwrap_err();
            assert!(format!("{got:?}").starts_with(want), "{inputs:?}: {got:?}, wanted {want}");
            assert_eq!(got.code(), Code::InvalidArgument);
            assert!(!got.to_string().is_empty());
        }
    }

    #[test]
    fn a_tensor_over_the_element_limit_is_refused_before_its_values_are_read() {
        let sig = signature();
        let checker = Checker { candidates_max: 1000, tensor_elements_max: 4 };
        let r = request(vec![
            input("user_id", "INT64", &[1], Data::Int64(&[1])),
            input("item_ids", "INT64", &[5], Data::None),
        ]);
        let err = checker.spec(&sig, &r).unwrap_err();
        assert!(matches!(err, InferError::TooManyElements { count: 5, max: 4, .. }), "{err:?}");
    }

    #[test]
    fn only_the_scores_output_may_be_asked_for() {
        let sig = signature();
        let mut r = request(vec![
            input("user_id", "INT64", &[1], Data::Int64(&[1])),
            input("item_ids", "INT64", &[1], Data::Int64(&[2])),
        ]);
        r.outputs = vec!["scores"];
        assert!(CHECKER.spec(&sig, &r).is_ok());
        r.outputs = vec!["probabilities"];
        assert_eq!(CHECKER.spec(&sig, &r).unwrap_err(), InferError::UnknownOutput("probabilities".into()));
    }

    #[test]
    fn parameters_take_integers_in_range_and_ignore_other_names() {
        let mut p = Params::default();
        p.set("budget_us", Param::Int(5000)).unwrap();
        p.set("priority", Param::Uint(3)).unwrap();
        p.set("client_id", Param::Double(12.0)).unwrap();
        p.set("sequence_id", Param::Str("x")).unwrap();
        assert_eq!(p, Params { budget_us: 5000, priority: 3, client_id: 12 });
        assert!(p.set("priority", Param::Int(256)).is_err());
        assert!(p.set("budget_us", Param::Int(-1)).is_err());
        assert!(p.set("client_id", Param::Str("7")).is_err());
        assert!(p.set("budget_us", Param::Double(1.5)).is_err());
    }

    #[test]
    fn shard_statuses_map_to_the_protocol_codes() {
        let refused = |status| InferError::Refused { status, message: String::new() }.code();
        assert_eq!(refused(Status::BadRequest), Code::InvalidArgument);
        assert_eq!(refused(Status::ModelNotFound), Code::NotFound);
        assert_eq!(refused(Status::DeadlineExceeded), Code::DeadlineExceeded);
        assert_eq!(refused(Status::Overloaded), Code::Unavailable);
        assert_eq!(refused(Status::RateLimited), Code::ResourceExhausted);
        assert_eq!(refused(Status::Internal), Code::Internal);
        assert_eq!(InferError::UnknownModel("m".into()).code(), Code::NotFound);
        assert_eq!(InferError::Timeout(5).code(), Code::DeadlineExceeded);
    }
}
