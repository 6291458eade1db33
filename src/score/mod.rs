//! The scoring seam: a backend turns a batch of input rows into logits.
//!
//! Every backend implements [`Backend`] and runs the same tests; the f32 CPU
//! backend is the oracle the others are compared against. The request path
//! applies the sigmoid on the host, so backends only produce logits.

pub mod accuracy;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod e4m3;
pub mod explaining;
pub mod gpu_cases;
pub mod gpu_layout;
pub mod kernels;
#[cfg(feature = "onnxruntime")]
pub mod ort;
pub mod timing;

use std::sync::Arc;

use crate::model::Model;

/// Scores the rows of one call into logits, for the model it was built for.
///
/// A backend owns its model (the `Arc` in its [`BackendInfo`]), so it cannot
/// be handed another, and its scratch memory, sized at construction for at
/// most `rows_max` rows: the CPU backends' `score` never allocates; what the
/// onnxruntime and CUDA backends still allocate per call, and why, is in
/// docs/ARCHITECTURE.md. Rows that hold the same
/// per-request columns (user, context, context ids) as the row before them
/// belong to one request, and a backend may compute what depends only on
/// those columns once per run of such rows; it gives the same numbers as
/// scoring every row alone. So one call may hold one request's candidates
/// (a shard) or several requests' (the inference thread's batch).
pub trait Backend: Send {
    /// What it is and what it scores: fixed at construction (the name may
    /// change once, when a GPU backend moves to the CPU).
    fn info(&self) -> &BackendInfo;

    /// Turns `rows` input rows of `x` (`[rows][input_dim]`) into `rows`
    /// logits in `out`. Fails only on an operating condition (onnxruntime's
    /// error, or a backend that could not be built); the request path then
    /// steps down the ladder. Native CPU backends never fail.
    fn score(&mut self, x: &[f32], rows: usize, out: &mut [f32]) -> Result<(), BackendError>;
}

/// What a backend is and what it scores.
#[derive(Clone, Debug)]
pub struct BackendInfo {
    pub name: &'static str,
    pub rows_max: usize,
    pub model: Arc<Model>,
}

impl BackendInfo {
    /// Asserts the shape of one `score` call: a caller that passes more
    /// rows than the backend was built for, or buffers of the wrong size,
    /// is a bug.
    pub fn check(&self, x: &[f32], rows: usize, out: &[f32]) {
        assert!(
            rows <= self.rows_max && x.len() == rows * self.model.input_dim() && out.len() == rows,
            "{}: {rows} rows of {} floats (x holds {}, out {}) for at most {} rows",
            self.name,
            self.model.input_dim(),
            x.len(),
            out.len(),
            self.rows_max
        );
    }
}

impl dyn Backend + '_ {
    pub fn name(&self) -> &'static str {
        self.info().name
    }

    pub fn rows_max(&self) -> usize {
        self.info().rows_max
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.info().model
    }
}

/// Why a backend cannot score: operating conditions, each with what to do.
#[derive(Clone, Debug, thiserror::Error)]
pub enum BackendError {
    #[error("the onnxruntime library could not be loaded from {path}: {detail}; {hint}")]
    OnnxruntimeMissing { path: String, detail: String, hint: &'static str },
    #[error("onnxruntime: {0}")]
    Onnxruntime(String),
    #[error(
        "this binary was built without the onnxruntime feature; rebuild with `cargo build --release --features \
         onnxruntime` to serve models kept for onnxruntime"
    )]
    OnnxruntimeNotBuilt,
    #[error("the model file keeps no ONNX graph (import it with --keep-onnx or --onnxruntime)")]
    NoOnnxGraph,
}

/// The backend of a model version that could not be built (onnxruntime
/// missing, say): every call fails, so the ladder answers instead.
pub struct Unavailable {
    error: BackendError,
    info: BackendInfo,
}

impl Backend for Unavailable {
    fn info(&self) -> &BackendInfo {
        &self.info
    }

    fn score(&mut self, _x: &[f32], _rows: usize, _out: &mut [f32]) -> Result<(), BackendError> {
        Err(self.error.clone())
    }
}

/// Which backend the server scores with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize, serde::Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// INT8 weights and activations, int32 accumulation: static activation
    /// scales for a calibrated model, per-row dynamic ones otherwise.
    Int8,
    /// The f32 reference weights.
    F32,
    /// FP8 E4M3 weights and activations, f32 accumulation in k order
    /// (`cpu::fp8`), the specification of `kernels/fp8_dense.cu`.
    Fp8,
    /// The INT8 semantics on the first CUDA GPU (feature `cuda`); falls back
    /// to `int8` on the CPU, with one warning, where there is no usable GPU.
    #[cfg(feature = "cuda")]
    Cuda,
    /// onnxruntime (feature `onnxruntime`) for every version that keeps its
    /// ONNX graph (`import --keep-onnx`), for comparison; the others run on
    /// `int8`. Versions kept only for onnxruntime (`import --onnxruntime`)
    /// use it whatever the backend.
    #[cfg(feature = "onnxruntime")]
    Onnxruntime,
}

/// Builds the backend `kind` for `model`, with scratch for `rows_max` rows.
///
/// Never fails: `Cuda` without a usable GPU gives the CPU INT8 backend,
/// whose numbers the CUDA kernels are designed to match bit for bit (not
/// yet verified on a GPU: the CUDA path has not run on one). A model that only
/// onnxruntime can run goes to onnxruntime whatever `kind` says; when that
/// cannot be built (no library, or a binary without the feature) the version
/// gets an [`Unavailable`] backend, so its requests step down the ladder,
/// and the first such failure in the process is logged as a warning.
pub fn build(kind: BackendKind, model: &Arc<Model>, rows_max: usize) -> Box<dyn Backend> {
    if !model.is_native() {
        return match build_onnxruntime(model, rows_max) {
            Ok(backend) => backend,
            Err(error) => {
                onnxruntime_fallback_logged(model, &error, "its requests step down the ladder");
                Box::new(Unavailable {
                    error,
                    info: BackendInfo { name: "unavailable", rows_max, model: model.clone() },
                })
            }
        };
    }
    #[cfg(feature = "onnxruntime")]
    if kind == BackendKind::Onnxruntime {
        if model.onnx.is_none() {
            onnxruntime_fallback_logged(model, &BackendError::NoOnnxGraph, "it runs on cpu-int8");
            return Box::new(cpu::CpuInt8::new(model, rows_max));
        }
        return match build_onnxruntime(model, rows_max) {
            Ok(backend) => backend,
            Err(error) => {
                onnxruntime_fallback_logged(model, &error, "it runs on cpu-int8");
                Box::new(cpu::CpuInt8::new(model, rows_max))
            }
        };
    }
    match kind {
        BackendKind::Int8 => Box::new(cpu::CpuInt8::new(model, rows_max)),
        BackendKind::F32 => Box::new(cpu::CpuF32::new(model, rows_max)),
        BackendKind::Fp8 => Box::new(cpu::CpuFp8::new(model, rows_max)),
        #[cfg(feature = "cuda")]
        BackendKind::Cuda => match cuda::CudaInt8::new(model, rows_max) {
            Ok(backend) => Box::new(backend),
            Err(e) => {
                cuda_fallback_logged(&e);
                Box::new(cpu::CpuInt8::new(model, rows_max))
            }
        },
        #[cfg(feature = "onnxruntime")]
        BackendKind::Onnxruntime => unreachable!("handled above"),
    }
}

/// Names the onnxruntime shared library (`onnxruntime_lib`), before any
/// backend is built. A binary without the feature has nothing to load and
/// says so.
pub fn configure_onnxruntime(library: &std::path::Path) {
    #[cfg(feature = "onnxruntime")]
    self::ort::configure(library.to_path_buf());
    #[cfg(not(feature = "onnxruntime"))]
    tracing::warn!(
        library = %library.display(),
        "onnxruntime_lib is set, but this binary was built without the onnxruntime feature"
    );
}

#[cfg(feature = "onnxruntime")]
fn build_onnxruntime(model: &Arc<Model>, rows_max: usize) -> Result<Box<dyn Backend>, BackendError> {
    Ok(Box::new(self::ort::OrtBackend::new(model, rows_max)?))
}

#[cfg(not(feature = "onnxruntime"))]
fn build_onnxruntime(_model: &Arc<Model>, _rows_max: usize) -> Result<Box<dyn Backend>, BackendError> {
    Err(BackendError::OnnxruntimeNotBuilt)
}

/// Logs why a version does not run on onnxruntime: every shard and every
/// version builds a backend, so only the first failure in the process is a
/// warning; the rest go to debug.
fn onnxruntime_fallback_logged(model: &Model, e: &BackendError, instead: &str) {
    use std::sync::atomic::{AtomicBool, Ordering};
    static LOGGED: AtomicBool = AtomicBool::new(false);
    if LOGGED.swap(true, Ordering::Relaxed) {
        tracing::debug!(model = %model.name, version = model.version, reason = %e, "onnxruntime backend unavailable");
    } else {
        tracing::warn!("model '{}' version {}: onnxruntime unavailable, {instead}: {e}", model.name, model.version);
    }
}

/// Logs why the CUDA backend is not used. Every shard and every model
/// version builds a backend, so only the first fallback in the process is a
/// warning (or an error, when the GPU is there but failed); the rest go to
/// debug.
#[cfg(feature = "cuda")]
fn cuda_fallback_logged(e: &cuda::CudaError) {
    use std::sync::atomic::{AtomicBool, Ordering};
    static LOGGED: AtomicBool = AtomicBool::new(false);
    if LOGGED.swap(true, Ordering::Relaxed) {
        tracing::debug!(reason = %e, "cuda backend unavailable; using cpu-int8");
    } else if e.is_absent() {
        tracing::warn!("backend \"cuda\" unavailable, falling back to the CPU INT8 backend: {e}");
    } else {
        tracing::error!("backend \"cuda\" failed to start, falling back to the CPU INT8 backend: {e}");
    }
}
