//! The scoring seam: a backend turns a batch of input rows into logits.
//!
//! Every backend implements [`Backend`] and runs the same tests; the f32 CPU
//! backend is the oracle the others are compared against. The request path
//! applies the sigmoid on the host, so backends only produce logits.

pub mod cpu;
pub mod fp8;

use crate::model::Model;

/// Turns `rows` input vectors of `model.input_dim()` floats into logits.
///
/// Implementations own their scratch memory, sized at construction for at
/// most `rows_max` rows, and never allocate on this call.
pub trait Backend {
    fn name(&self) -> &'static str;
    fn rows_max(&self) -> usize;
    fn logits(&mut self, model: &Model, x: &[f32], rows: usize, out: &mut [f32]);
}

/// Which backend the server scores with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize, serde::Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// INT8 weights, per-row dynamic INT8 activations, int32 accumulation.
    Int8,
    /// The f32 reference weights.
    F32,
}

/// Builds the backend `kind` for `model`, with scratch for `rows_max` rows.
pub fn build(kind: BackendKind, model: &Model, rows_max: usize) -> Box<dyn Backend> {
    match kind {
        BackendKind::Int8 => Box::new(cpu::CpuInt8::new(model, rows_max)),
        BackendKind::F32 => Box::new(cpu::CpuF32::new(model, rows_max)),
    }
}
