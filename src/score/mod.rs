//! The scoring seam: a backend turns a batch of input rows into logits.
//!
//! Every backend implements [`Backend`] and runs the same tests; the f32 CPU
//! backend is the oracle the others are compared against. The request path
//! applies the sigmoid on the host, so backends only produce logits.

pub mod accuracy;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod fp8;
pub mod kernels;
pub mod timing;

use crate::model::Model;

/// Turns `rows` input vectors of `model.input_dim()` floats into logits.
///
/// Implementations own their scratch memory, sized at construction for at
/// most `rows_max` rows, and never allocate on this call.
pub trait Backend {
    fn name(&self) -> &'static str;
    fn rows_max(&self) -> usize;
    fn logits(&mut self, model: &Model, x: &[f32], rows: usize, out: &mut [f32]);

    /// `logits` for the candidates of one request: every row holds the
    /// same per-request columns (user, context, context ids), so a backend
    /// may compute what depends only on them once. The same numbers as
    /// `logits`, except where a backend documents otherwise.
    fn logits_request(&mut self, model: &Model, x: &[f32], rows: usize, out: &mut [f32]) {
        self.logits(model, x, rows, out);
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
}

/// Builds the backend `kind` for `model`, with scratch for `rows_max` rows.
///
/// Never fails: `Cuda` without a usable GPU gives the CPU INT8 backend,
/// which computes the same numbers bit for bit.
pub fn build(kind: BackendKind, model: &Model, rows_max: usize) -> Box<dyn Backend> {
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
