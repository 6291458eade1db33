//! Model v1: an MLP stored in a `.qm` file (`schemas/model.fbs`).
//!
//! The file carries f32 weights (the reference every backend is compared
//! against) and INT8 weights quantized when the file is built, with one
//! symmetric scale per output channel. It also declares the input layout:
//! which slice of the input vector comes from the `user` feature group, which
//! from the `item` group and which from the request context. Loading copies
//! everything into owned, validated arrays; a file that does not describe a
//! consistent network is refused with the reason.

#[cfg(quiver_flatc_generated)]
#[allow(clippy::all, clippy::pedantic, unsafe_op_in_unsafe_fn, mismatched_lifetime_syntaxes, deprecated)]
#[rustfmt::skip]
mod generated {
    include!(concat!(env!("OUT_DIR"), "/model_generated.rs"));
}
#[cfg(not(quiver_flatc_generated))]
#[allow(clippy::all, clippy::pedantic, unsafe_op_in_unsafe_fn, mismatched_lifetime_syntaxes, deprecated)]
#[rustfmt::skip]
#[path = "model_generated.rs"]
mod generated;
pub mod onnx;

use std::path::Path;

use flatbuffers::{FlatBufferBuilder, VerifierOptions};
pub use generated::quiver::model as fb;

/// Largest model file accepted, and the verifier's size bound.
pub const MODEL_BYTES_MAX: usize = 1 << 30;
/// Widest layer accepted; bounds per-shard scratch buffers.
pub const WIDTH_MAX: usize = 16_384;
/// Deepest network accepted.
pub const LAYERS_MAX: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a Quiver model file: {source}")]
    Invalid {
        path: String,
        #[source]
        source: flatbuffers::InvalidFlatbuffer,
    },
    #[error("{path}: model file is {bytes} bytes, the limit is {MODEL_BYTES_MAX}")]
    TooLarge { path: String, bytes: u64 },
    #[error("{path}: not a Quiver model file (file identifier is not QVM1)")]
    Identifier { path: String },
    #[error("model '{name}': {what}")]
    Shape { name: String, what: String },
}

/// Where an input segment's values come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    User,
    Item,
    Context,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InputSegment {
    pub source: Source,
    pub dim: usize,
}

/// One dense layer. Weights are row-major `[out_dim][in_dim]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Layer {
    pub in_dim: usize,
    pub out_dim: usize,
    pub relu: bool,
    pub weights_f32: Vec<f32>,
    pub weights_i8: Vec<i8>,
    pub weight_scales: Vec<f32>,
    pub bias: Vec<f32>,
}

impl Layer {
    /// Builds a layer from f32 weights, quantizing them per output channel:
    /// `scale[o] = max|w[o][*]| / 127`, `w_i8 = round_ties_even(w / scale)`.
    pub fn quantize(in_dim: usize, out_dim: usize, relu: bool, weights_f32: Vec<f32>, bias: Vec<f32>) -> Layer {
        assert_eq!(weights_f32.len(), in_dim * out_dim);
        assert_eq!(bias.len(), out_dim);
        let mut weights_i8 = Vec::with_capacity(weights_f32.len());
        let mut weight_scales = Vec::with_capacity(out_dim);
        for row in weights_f32.chunks_exact(in_dim) {
            let max_abs = row.iter().fold(0.0f32, |m, w| m.max(w.abs()));
            let scale = if max_abs > 0.0 { max_abs / 127.0 } else { 1.0 };
            weight_scales.push(scale);
            weights_i8.extend(row.iter().map(|w| (w / scale).round_ties_even().clamp(-127.0, 127.0) as i8));
        }
        Layer { in_dim, out_dim, relu, weights_f32, weights_i8, weight_scales, bias }
    }
}

/// A loaded, validated model.
#[derive(Clone, Debug, PartialEq)]
pub struct Model {
    pub name: String,
    pub version: u32,
    pub inputs: Vec<InputSegment>,
    pub layers: Vec<Layer>,
}

impl Model {
    /// Checks that the layers chain, the arrays have the declared sizes, the
    /// output is one logit and every number is finite.
    pub fn validate(&self) -> Result<(), ModelError> {
        let bad = |what: String| ModelError::Shape { name: self.name.clone(), what };
        if self.inputs.is_empty() {
            return Err(bad("declares no inputs".into()));
        }
        for s in [Source::User, Source::Item, Source::Context] {
            if self.inputs.iter().filter(|i| i.source == s).count() > 1 {
                return Err(bad(format!("declares the {s:?} input more than once")));
            }
        }
        if self.inputs.iter().any(|i| i.dim == 0) {
            return Err(bad("an input segment has dimension 0".into()));
        }
        if self.layers.is_empty() || self.layers.len() > LAYERS_MAX {
            return Err(bad(format!("has {} layers; 1 to {LAYERS_MAX} allowed", self.layers.len())));
        }
        let mut width = self.input_dim();
        for (i, l) in self.layers.iter().enumerate() {
            if l.in_dim != width {
                return Err(bad(format!("layer {i} takes {} inputs but receives {width}", l.in_dim)));
            }
            if l.out_dim == 0 || l.out_dim > WIDTH_MAX || l.in_dim > WIDTH_MAX {
                return Err(bad(format!("layer {i} has a width outside 1..={WIDTH_MAX}")));
            }
            let n = l.in_dim * l.out_dim;
            if l.weights_f32.len() != n || l.weights_i8.len() != n {
                return Err(bad(format!("layer {i} weights are not {} x {}", l.out_dim, l.in_dim)));
            }
            if l.weight_scales.len() != l.out_dim || l.bias.len() != l.out_dim {
                return Err(bad(format!("layer {i} scales or bias are not of length {}", l.out_dim)));
            }
            let finite = l.weights_f32.iter().chain(&l.bias).all(|x| x.is_finite());
            let scales_ok = l.weight_scales.iter().all(|s| s.is_finite() && *s > 0.0);
            if !finite || !scales_ok {
                return Err(bad(format!("layer {i} holds a non-finite weight or a non-positive scale")));
            }
            width = l.out_dim;
        }
        if width != 1 {
            return Err(bad(format!("the last layer has {width} outputs; one logit expected")));
        }
        if self.layers.last().is_some_and(|l| l.relu) {
            return Err(bad("the output layer must not have an activation".into()));
        }
        Ok(())
    }

    /// Length of the concatenated input vector.
    pub fn input_dim(&self) -> usize {
        self.inputs.iter().map(|s| s.dim).sum()
    }

    /// Widest activation vector, for sizing scratch buffers.
    pub fn width_max(&self) -> usize {
        self.layers.iter().map(|l| l.out_dim).chain([self.input_dim()]).max().unwrap_or(0)
    }

    /// Dimension declared for `source`, if the model reads it.
    pub fn input_dim_of(&self, source: Source) -> Option<usize> {
        self.inputs.iter().find(|s| s.source == source).map(|s| s.dim)
    }

    /// The f32 reference forward pass: `x` holds `rows` input vectors, the
    /// logits go to `out`. Slow and allocating on purpose: it is the
    /// specification, not the serving path.
    pub fn forward_f32_reference(&self, x: &[f32], rows: usize, out: &mut [f32]) {
        assert_eq!(x.len(), rows * self.input_dim());
        assert_eq!(out.len(), rows);
        for r in 0..rows {
            let mut act: Vec<f32> = x[r * self.input_dim()..(r + 1) * self.input_dim()].to_vec();
            for l in &self.layers {
                act = (0..l.out_dim)
                    .map(|o| {
                        let w = &l.weights_f32[o * l.in_dim..(o + 1) * l.in_dim];
                        let y = w.iter().zip(&act).map(|(a, b)| a * b).sum::<f32>() + l.bias[o];
                        if l.relu {
                            y.max(0.0)
                        } else {
                            y
                        }
                    })
                    .collect();
            }
            out[r] = act[0];
        }
    }

    /// Reads and validates a model file.
    pub fn load(path: &Path) -> Result<Model, ModelError> {
        let p = path.display().to_string();
        let io = |source| ModelError::Io { path: p.clone(), source };
        let bytes_len = std::fs::metadata(path).map_err(io)?.len();
        if bytes_len > MODEL_BYTES_MAX as u64 {
            return Err(ModelError::TooLarge { path: p, bytes: bytes_len });
        }
        let bytes = std::fs::read(path).map_err(io)?;
        Model::from_bytes(&bytes, &p)
    }

    pub fn from_bytes(bytes: &[u8], path_for_errors: &str) -> Result<Model, ModelError> {
        let p = path_for_errors.to_string();
        if !fb::model_buffer_has_identifier(bytes) {
            return Err(ModelError::Identifier { path: p });
        }
        let opts = VerifierOptions {
            max_depth: 8,
            max_tables: 2 + LAYERS_MAX + 16,
            max_apparent_size: MODEL_BYTES_MAX,
            ignore_missing_null_terminator: false,
        };
        let m = flatbuffers::root_with_opts::<fb::Model>(&opts, bytes)
            .map_err(|source| ModelError::Invalid { path: p.clone(), source })?;
        let name = m.name().unwrap_or("").to_string();
        let bad = |what: &str| ModelError::Shape { name: name.clone(), what: what.into() };
        let mut inputs = Vec::new();
        for s in m.inputs().unwrap_or_default() {
            let source = match s.source() {
                fb::Source::User => Source::User,
                fb::Source::Item => Source::Item,
                fb::Source::Context => Source::Context,
                _ => return Err(bad("an input segment has an unknown source")),
            };
            inputs.push(InputSegment { source, dim: s.dim() as usize });
        }
        let mut layers = Vec::new();
        for l in m.layers().unwrap_or_default() {
            let relu = match l.activation() {
                fb::Activation::None => false,
                fb::Activation::Relu => true,
                _ => return Err(bad("a layer has an unknown activation")),
            };
            layers.push(Layer {
                in_dim: l.in_dim() as usize,
                out_dim: l.out_dim() as usize,
                relu,
                weights_f32: l.weights_f32().map(|v| v.iter().collect()).unwrap_or_default(),
                weights_i8: l.weights_i8().map(|v| v.iter().collect()).unwrap_or_default(),
                weight_scales: l.weight_scales().map(|v| v.iter().collect()).unwrap_or_default(),
                bias: l.bias().map(|v| v.iter().collect()).unwrap_or_default(),
            });
        }
        let model = Model { name: name.clone(), version: m.version(), inputs, layers };
        model.validate()?;
        Ok(model)
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = FlatBufferBuilder::new();
        let inputs: Vec<_> = self
            .inputs
            .iter()
            .map(|s| {
                let source = match s.source {
                    Source::User => fb::Source::User,
                    Source::Item => fb::Source::Item,
                    Source::Context => fb::Source::Context,
                };
                fb::InputSegment::create(&mut b, &fb::InputSegmentArgs { source, dim: s.dim as u32 })
            })
            .collect();
        let layers: Vec<_> = self
            .layers
            .iter()
            .map(|l| {
                let weights_f32 = Some(b.create_vector(&l.weights_f32));
                let weights_i8 = Some(b.create_vector(&l.weights_i8));
                let weight_scales = Some(b.create_vector(&l.weight_scales));
                let bias = Some(b.create_vector(&l.bias));
                fb::Layer::create(
                    &mut b,
                    &fb::LayerArgs {
                        in_dim: l.in_dim as u32,
                        out_dim: l.out_dim as u32,
                        activation: if l.relu { fb::Activation::Relu } else { fb::Activation::None },
                        weights_f32,
                        weights_i8,
                        weight_scales,
                        bias,
                    },
                )
            })
            .collect();
        let name = Some(b.create_string(&self.name));
        let inputs = Some(b.create_vector(&inputs));
        let layers = Some(b.create_vector(&layers));
        let root = fb::Model::create(&mut b, &fb::ModelArgs { name, version: self.version, inputs, layers });
        fb::finish_model_buffer(&mut b, root);
        b.finished_data().to_vec()
    }

    /// Writes the model file atomically.
    pub fn save(&self, path: &Path) -> Result<(), ModelError> {
        crate::replica::write_atomically(path, &self.to_bytes()).map_err(|e| ModelError::Io {
            path: path.display().to_string(),
            source: std::io::Error::other(e.to_string()),
        })
    }
}

/// The logistic function applied on the host to the output logit.
#[inline]
pub fn sigmoid(logit: f32) -> f32 {
    1.0 / (1.0 + (-logit).exp())
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn tiny() -> Model {
        Model {
            name: "tiny".into(),
            version: 3,
            inputs: vec![
                InputSegment { source: Source::User, dim: 2 },
                InputSegment { source: Source::Context, dim: 1 },
            ],
            layers: vec![
                Layer::quantize(3, 2, true, vec![1.0, -2.0, 0.5, 0.0, 0.0, 0.0], vec![0.1, 0.2]),
                Layer::quantize(2, 1, false, vec![1.5, -1.0], vec![-0.25]),
            ],
        }
    }

    #[test]
    fn quantization_is_per_output_channel() {
        let l = &tiny().layers[0];
        assert_eq!(l.weight_scales, vec![2.0 / 127.0, 1.0]);
        assert_eq!(l.weights_i8, vec![64, -127, 32, 0, 0, 0]);
    }

    #[test]
    fn reference_forward_by_hand() {
        let m = tiny();
        let mut out = [0.0];
        m.forward_f32_reference(&[1.0, 0.5, 2.0], 1, &mut out);
        // hidden = relu([1 - 1 + 1 + 0.1, 0.2]) = [1.1, 0.2]; logit = 1.65 - 0.2 - 0.25
        assert!((out[0] - 1.2).abs() < 1e-6, "{}", out[0]);
    }

    #[test]
    fn file_round_trip_and_refusals() {
        let m = tiny();
        let bytes = m.to_bytes();
        assert_eq!(Model::from_bytes(&bytes, "t").unwrap(), m);
        assert!(Model::from_bytes(&bytes[..bytes.len() / 2], "t").is_err());
        assert!(matches!(Model::from_bytes(b"garbage!", "t"), Err(ModelError::Identifier { .. })));

        let mut broken = m.clone();
        broken.layers[1].in_dim = 3;
        let err = Model::from_bytes(&broken.to_bytes(), "t").unwrap_err();
        assert!(err.to_string().contains("layer 1"), "{err}");

        let mut two_outputs = m.clone();
        two_outputs.layers[1] = Layer::quantize(2, 2, false, vec![0.0; 4], vec![0.0; 2]);
        assert!(Model::from_bytes(&two_outputs.to_bytes(), "t").is_err());

        let mut nan = m;
        nan.layers[0].weights_f32[0] = f32::NAN;
        assert!(Model::from_bytes(&nan.to_bytes(), "t").is_err());
    }
}
