//! onnxruntime as a backend (feature `onnxruntime`): the safety net for ONNX
//! graphs the native compiler refuses, and a comparison for those it takes.
//!
//! The shared library is loaded at run time (the `ort` crate's
//! `load-dynamic`), from the path the binary configured (`onnxruntime_lib`
//! in the config or `--onnxruntime-lib`, else its `ORT_DYLIB_PATH`: the
//! library reads no environment), else the loader's search path; nothing
//! is downloaded or linked at build time. A library that cannot be loaded is an operating
//! condition ([`BackendError::OnnxruntimeMissing`]), never a panic: the
//! library is loaded through `ort::init_from` before any other `ort` call,
//! because `ort` panics when its first call finds no library.
//!
//! Each backend instance owns one session (a shard's, or the stage's), with
//! one intra-op and one inter-op thread so shards keep their cores, and
//! per-input buffers sized at construction for `rows_max` rows. A graph with
//! one f32 input spanning the input vector reads the request's rows in
//! place; otherwise each input's columns are copied out (and converted, for
//! integer ids) into its buffer. The output column is copied into the
//! caller's buffer. What still allocates per call (docs/ARCHITECTURE.md):
//! the list of inputs handed to `Session::run`, onnxruntime's value for
//! each input (a header over the staged buffer, not a copy), and the
//! outputs onnxruntime allocates itself, whose shape follows the call's row
//! count.

use std::borrow::Cow;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use ort::environment::Environment;
use ort::session::{Session, SessionInputValue};
use ort::value::{Shape, TensorElementType, TensorRef, ValueType};

use super::{Backend, BackendError, BackendInfo};
use crate::model::{Model, OnnxElement, OnnxGraph};

/// The library the binary named (`onnxruntime_lib`, or its
/// `ORT_DYLIB_PATH`); set once, at start-up, before any backend is built.
static LIBRARY: OnceLock<PathBuf> = OnceLock::new();
/// The process's one onnxruntime environment, or why there is none.
static ENVIRONMENT: OnceLock<Result<Environment, BackendError>> = OnceLock::new();

/// What the shared library is called when nothing names it.
const LIBRARY_DEFAULT: &str = "libonnxruntime.so";
/// What to install when it is missing.
const INSTALL_HINT: &str = "install onnxruntime (e.g. `pip install onnxruntime==1.32.0`) and set onnxruntime_lib in \
     the config, or ORT_DYLIB_PATH, to its onnxruntime/capi/libonnxruntime.so.* (1.22 or later)";

/// Names the shared library to load. Only the first call counts; later
/// ones, and calls after the library was loaded, are ignored.
pub fn configure(library: PathBuf) {
    let _ = LIBRARY.set(library);
}

/// The library path in effect: the configured one, else the loader's
/// search for `libonnxruntime.so`.
pub fn library_path() -> PathBuf {
    LIBRARY.get().cloned().unwrap_or_else(|| PathBuf::from(LIBRARY_DEFAULT))
}

/// Loads the library and makes the environment on first use.
fn environment() -> Result<&'static Environment, BackendError> {
    let env = ENVIRONMENT.get_or_init(|| {
        let path = library_path();
        let missing = |detail: String| BackendError::OnnxruntimeMissing {
            path: path.display().to_string(),
            detail,
            hint: INSTALL_HINT,
        };
        let builder = ort::init_from(&path).map_err(|e| missing(e.to_string()))?;
        builder.with_name("quiver").build().map_err(|e| missing(e.to_string()))
    });
    env.as_ref().map_err(Clone::clone)
}

/// Whether the library loads (loading it if not yet done).
pub fn available() -> Result<(), BackendError> {
    environment().map(|_| ())
}

fn ort_error(e: impl std::fmt::Display) -> BackendError {
    BackendError::Onnxruntime(e.to_string())
}

/// One input's staging buffer.
enum Staged {
    /// The request's rows are the input, read in place.
    InPlace,
    F32(Vec<f32>),
    I64(Vec<i64>),
    I32(Vec<i32>),
}

struct Input {
    name: String,
    /// First column in the input vector, and width.
    offset: usize,
    width: usize,
    rank: u8,
    staged: Staged,
}

pub struct OrtBackend {
    session: Session,
    inputs: Vec<Input>,
    output: String,
    output_column: usize,
    output_probability: bool,
    dim: usize,
    info: BackendInfo,
}

impl OrtBackend {
    /// A session for `model`'s kept graph, checked against its interface.
    pub fn new(model: &Arc<Model>, rows_max: usize) -> Result<OrtBackend, BackendError> {
        let kept: &OnnxGraph = model.onnx.as_ref().ok_or(BackendError::NoOnnxGraph)?;
        let env = environment()?;
        // Memory patterns pre-plan buffers for one input shape; requests
        // vary their candidate count, so they would be re-planned per call.
        let session = Session::builder(env)
            .map_err(ort_error)?
            .with_intra_threads(1)
            .map_err(ort_error)?
            .with_inter_threads(1)
            .map_err(ort_error)?
            .with_memory_pattern(false)
            .map_err(ort_error)?
            .commit_from_memory(&kept.bytes)
            .map_err(ort_error)?;
        let mismatch = |what: String| BackendError::Onnxruntime(format!("model '{}': {what}", model.name));
        let mut inputs = Vec::with_capacity(kept.inputs.len());
        let mut offset = 0;
        let in_place = kept.inputs.len() == 1 && kept.inputs[0].element == OnnxElement::Float;
        for i in &kept.inputs {
            let outlet = session
                .inputs()
                .iter()
                .find(|o| o.name() == i.name)
                .ok_or_else(|| mismatch(format!("the graph has no input '{}'", i.name)))?;
            let want = match i.element {
                OnnxElement::Float => TensorElementType::Float32,
                OnnxElement::Int64 => TensorElementType::Int64,
                OnnxElement::Int32 => TensorElementType::Int32,
            };
            if !matches!(outlet.dtype(), ValueType::Tensor { ty, .. } if *ty == want) {
                return Err(mismatch(format!("input '{}' is {:?}, the file says {want:?}", i.name, outlet.dtype())));
            }
            let n = rows_max * i.width;
            let staged = match i.element {
                OnnxElement::Float if in_place => Staged::InPlace,
                OnnxElement::Float => Staged::F32(vec![0.0; n]),
                OnnxElement::Int64 => Staged::I64(vec![0; n]),
                OnnxElement::Int32 => Staged::I32(vec![0; n]),
            };
            inputs.push(Input { name: i.name.clone(), offset, width: i.width, rank: i.rank, staged });
            offset += i.width;
        }
        if let Some(unfed) = session.inputs().iter().find(|o| !kept.inputs.iter().any(|i| i.name == o.name())) {
            return Err(mismatch(format!("graph input '{}' is not in the file's interface", unfed.name())));
        }
        let output = session
            .outputs()
            .iter()
            .find(|o| o.name() == kept.output)
            .ok_or_else(|| mismatch(format!("the graph has no output '{}'", kept.output)))?;
        if !matches!(output.dtype(), ValueType::Tensor { ty: TensorElementType::Float32, .. }) {
            return Err(mismatch(format!(
                "output '{}' is {:?}; the server reads float32",
                kept.output,
                output.dtype()
            )));
        }
        Ok(OrtBackend {
            session,
            inputs,
            output: kept.output.clone(),
            output_column: kept.output_column,
            output_probability: kept.output_probability,
            dim: model.input_dim(),
            info: BackendInfo { name: "onnxruntime", rows_max, model: model.clone() },
        })
    }

    fn run(&mut self, x: &[f32], rows: usize, out: &mut [f32]) -> Result<(), BackendError> {
        self.info.check(x, rows, out);
        if rows == 0 {
            return Ok(());
        }
        let dim = self.dim;
        for input in &mut self.inputs {
            let (at, w) = (input.offset, input.width);
            let columns = x.chunks_exact(dim).map(|row| &row[at..at + w]);
            match &mut input.staged {
                Staged::InPlace => {}
                Staged::F32(buf) => {
                    for (dst, src) in buf.chunks_exact_mut(w).zip(columns) {
                        dst.copy_from_slice(src);
                    }
                }
                // Ids arrive as floats (exact below 2^24); a missing id is
                // -1 or NaN, which the graph sees as -1 or 0.
                Staged::I64(buf) => {
                    for (dst, src) in buf.chunks_exact_mut(w).zip(columns) {
                        for (d, s) in dst.iter_mut().zip(src) {
                            *d = *s as i64;
                        }
                    }
                }
                Staged::I32(buf) => {
                    for (dst, src) in buf.chunks_exact_mut(w).zip(columns) {
                        for (d, s) in dst.iter_mut().zip(src) {
                            *d = *s as i32;
                        }
                    }
                }
            }
        }
        let mut values: Vec<(Cow<'_, str>, SessionInputValue<'_>)> = Vec::with_capacity(self.inputs.len());
        for input in &self.inputs {
            let n = rows * input.width;
            // A `Shape` keeps up to four dimensions inline: no allocation.
            let dims = [rows as i64, input.width as i64];
            let shape = Shape::new(dims.into_iter().take(usize::from(input.rank)));
            let value: SessionInputValue<'_> = match &input.staged {
                Staged::InPlace => TensorRef::from_array_view((shape, x)).map_err(ort_error)?.into(),
                Staged::F32(buf) => TensorRef::from_array_view((shape, &buf[..n])).map_err(ort_error)?.into(),
                Staged::I64(buf) => TensorRef::from_array_view((shape, &buf[..n])).map_err(ort_error)?.into(),
                Staged::I32(buf) => TensorRef::from_array_view((shape, &buf[..n])).map_err(ort_error)?.into(),
            };
            values.push((Cow::Borrowed(input.name.as_str()), value));
        }
        let outputs = self.session.run(values).map_err(ort_error)?;
        let value = outputs.get(&self.output).ok_or_else(|| ort_error(format!("no output '{}'", self.output)))?;
        let (_, data) = value.try_extract_tensor::<f32>().map_err(ort_error)?;
        if data.len() % rows != 0 || data.len() / rows <= self.output_column {
            return Err(ort_error(format!(
                "output '{}' holds {} values for {rows} rows; column {} was expected",
                self.output,
                data.len(),
                self.output_column
            )));
        }
        let width = data.len() / rows;
        for (o, row) in out.iter_mut().zip(data.chunks_exact(width)) {
            let v = row[self.output_column];
            *o = if self.output_probability { logit(v) } else { v };
        }
        Ok(())
    }
}

/// The logit of probability `p`, in f64 so that `sigmoid(logit(p))` is `p`
/// to within an f32 rounding.
fn logit(p: f32) -> f32 {
    let p = f64::from(p);
    (p / (1.0 - p)).ln() as f32
}

impl Backend for OrtBackend {
    fn info(&self) -> &BackendInfo {
        &self.info
    }

    fn score(&mut self, x: &[f32], rows: usize, out: &mut [f32]) -> Result<(), BackendError> {
        self.run(x, rows, out)
    }
}
