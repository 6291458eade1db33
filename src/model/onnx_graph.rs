//! An ONNX graph kept in a model file, for the onnxruntime backend
//! (`score::ort`, feature `onnxruntime`).
//!
//! The native compiler (`model::onnx`) covers the ops Quiver runs fast; the
//! long tail of ONNX operators users export runs through onnxruntime instead.
//! The file then carries the graph's bytes and its interface: which columns
//! of the model's input vector feed which graph input (in order, each input
//! taking the next `width` columns), with which element type and rank, and
//! which column of which output tensor is the model's output. The graph is
//! stored as onnxruntime will read it; Quiver never interprets it here.

use std::sync::Arc;

use super::fb;
use super::graph::OutputKind;
use flatbuffers::FlatBufferBuilder;
use flatbuffers::WIPOffset;

/// Most graph inputs an interface may list.
pub const ONNX_INPUTS_MAX: usize = 64;

/// The element type a graph input is fed as; the model's f32 columns are
/// converted to it (ids truncate toward zero, as `Cast` does).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnnxElement {
    Float,
    Int64,
    Int32,
}

/// One graph input and the columns it takes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OnnxInput {
    pub name: String,
    pub width: usize,
    pub element: OnnxElement,
    /// 1: fed as `[rows]` (width 1); 2: `[rows, width]`.
    pub rank: u8,
}

/// The kept graph and how the server feeds and reads it.
#[derive(Clone, Debug, PartialEq)]
pub struct OnnxGraph {
    /// The ONNX `ModelProto` bytes, external data inlined.
    pub bytes: Arc<[u8]>,
    pub inputs: Vec<OnnxInput>,
    /// The output tensor read, and the column of it that is the output.
    pub output: String,
    pub output_column: usize,
    /// The column is a probability of a model whose native network outputs
    /// its logit (a Sigmoid the native import dropped): the backend returns
    /// the logit, so both backends mean the same number.
    pub output_probability: bool,
    /// What the output is, for a model served only through onnxruntime.
    pub output_kind: OutputKind,
}

impl OnnxGraph {
    /// Checks the interface against the model's input width.
    pub fn validate(&self, input_dim: usize) -> Result<(), String> {
        if self.bytes.is_empty() {
            return Err("the kept ONNX graph is empty".into());
        }
        if self.inputs.is_empty() || self.inputs.len() > ONNX_INPUTS_MAX {
            return Err(format!(
                "the ONNX interface lists {} inputs; 1 to {ONNX_INPUTS_MAX} allowed",
                self.inputs.len()
            ));
        }
        for i in &self.inputs {
            if i.name.is_empty() || i.width == 0 {
                return Err("an ONNX input has no name or zero width".into());
            }
            if !(i.rank == 2 || (i.rank == 1 && i.width == 1)) {
                return Err(format!("ONNX input '{}' has rank {} and width {}", i.name, i.rank, i.width));
            }
        }
        let total: usize = self.inputs.iter().map(|i| i.width).sum();
        if total != input_dim {
            return Err(format!("the ONNX inputs take {total} columns; the model's input vector has {input_dim}"));
        }
        if self.output.is_empty() {
            return Err("the ONNX interface names no output".into());
        }
        Ok(())
    }

    pub(super) fn to_fb<'b>(&self, b: &mut FlatBufferBuilder<'b>) -> WIPOffset<fb::OnnxGraph<'b>> {
        let inputs: Vec<_> = self
            .inputs
            .iter()
            .map(|i| {
                let name = Some(b.create_string(&i.name));
                let element = match i.element {
                    OnnxElement::Float => fb::OnnxElement::Float,
                    OnnxElement::Int64 => fb::OnnxElement::Int64,
                    OnnxElement::Int32 => fb::OnnxElement::Int32,
                };
                fb::OnnxInput::create(b, &fb::OnnxInputArgs { name, width: i.width as u32, element, rank: i.rank })
            })
            .collect();
        let model = Some(b.create_vector(&self.bytes));
        let inputs = Some(b.create_vector(&inputs));
        let output = Some(b.create_string(&self.output));
        let output_kind = match self.output_kind {
            OutputKind::Logit => fb::OutputKind::Logit,
            OutputKind::Raw => fb::OutputKind::Raw,
        };
        fb::OnnxGraph::create(
            b,
            &fb::OnnxGraphArgs {
                model,
                inputs,
                output,
                output_column: self.output_column as u32,
                output_probability: self.output_probability,
                output_kind,
            },
        )
    }

    pub(super) fn from_fb(g: &fb::OnnxGraph<'_>) -> Result<OnnxGraph, String> {
        let mut inputs = Vec::new();
        for i in g.inputs().unwrap_or_default() {
            let element = match i.element() {
                fb::OnnxElement::Float => OnnxElement::Float,
                fb::OnnxElement::Int64 => OnnxElement::Int64,
                fb::OnnxElement::Int32 => OnnxElement::Int32,
                _ => return Err("an ONNX input has an unknown element type".into()),
            };
            let name = i.name().unwrap_or("").to_string();
            inputs.push(OnnxInput { name, width: i.width() as usize, element, rank: i.rank() });
        }
        let output_kind = match g.output_kind() {
            fb::OutputKind::Logit => OutputKind::Logit,
            fb::OutputKind::Raw => OutputKind::Raw,
            _ => return Err("the ONNX graph has an unknown output kind".into()),
        };
        Ok(OnnxGraph {
            bytes: g.model().map(|v| v.bytes()).unwrap_or_default().into(),
            inputs,
            output: g.output().unwrap_or("").to_string(),
            output_column: g.output_column() as usize,
            output_probability: g.output_probability(),
            output_kind,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{InputSegment, Model, Source};

    fn kept() -> Model {
        let input = |name: &str, width, element, rank| OnnxInput { name: name.into(), width, element, rank };
        Model {
            name: "kept".into(),
            version: 3,
            inputs: vec![
                InputSegment { source: Source::User, dim: 4 },
                InputSegment { source: Source::ContextIds, dim: 1 },
            ],
            layers: Vec::new(),
            calibration: None,
            graph: None,
            onnx: Some(OnnxGraph {
                bytes: vec![8u8, 1, 2, 3].into(),
                inputs: vec![input("x", 4, OnnxElement::Float, 2), input("id", 1, OnnxElement::Int64, 1)],
                output: "p".into(),
                output_column: 1,
                output_probability: false,
                output_kind: OutputKind::Raw,
            }),
            feature_names: Vec::new(),
        }
    }

    #[test]
    fn a_kept_graph_round_trips_and_bad_interfaces_are_refused() {
        let m = kept();
        assert!(!m.is_native());
        assert_eq!(m.output_kind(), OutputKind::Raw);
        let back = Model::from_bytes(&m.to_bytes(), "kept").unwrap();
        assert_eq!(back, m);

        let refused = |edit: fn(&mut Model), why: &str| {
            let mut bad = kept();
            edit(&mut bad);
            let e = Model::from_bytes(&bad.to_bytes(), "kept").unwrap_err().to_string();
            assert!(e.contains(why), "{e}");
        };
        refused(|m| m.onnx.as_mut().unwrap().inputs[0].width = 3, "take 4 columns");
        refused(|m| m.onnx.as_mut().unwrap().inputs[0].rank = 1, "has rank 1 and width 4");
        refused(|m| m.onnx.as_mut().unwrap().bytes = Vec::new().into(), "is empty");
        refused(|m| m.onnx.as_mut().unwrap().output.clear(), "names no output");
        refused(|m| m.onnx = None, "has 0 layers");
    }
}
