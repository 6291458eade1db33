//! ONNX export of a v1 MLP (`quiver export-onnx`): one input `x` [batch,
//! input width] and a chain of Gemm (weights [out, in], transB) and Relu
//! nodes ending in the logit `logit` [batch, 1].
//!
//! Why: the onnxruntime backend is compared with the native ones on the
//! models Quiver itself ships (the auction-32 demo), which exist only as
//! `.qm` files; exporting them lets the same network run both ways
//! (`bench/ort_backend.sh`). Re-importing the export gives the same model.

use onnx_protobuf::attribute_proto::AttributeType;
use onnx_protobuf::{
    tensor_proto, tensor_shape_proto, type_proto, AttributeProto, GraphProto, ModelProto, NodeProto,
    OperatorSetIdProto, TensorProto, TensorShapeProto, TypeProto, ValueInfoProto,
};
use protobuf::{Message as _, MessageField};

use super::proto::DT_FLOAT;
use super::OnnxError;
use crate::model::Model;

fn dim(d: tensor_shape_proto::dimension::Value) -> tensor_shape_proto::Dimension {
    tensor_shape_proto::Dimension { value: Some(d), ..Default::default() }
}

fn float_tensor(name: &str, width: usize) -> ValueInfoProto {
    let shape = TensorShapeProto {
        dim: vec![
            dim(tensor_shape_proto::dimension::Value::DimParam("batch".into())),
            dim(tensor_shape_proto::dimension::Value::DimValue(width as i64)),
        ],
        ..Default::default()
    };
    let tensor = type_proto::Tensor { elem_type: DT_FLOAT, shape: MessageField::some(shape), ..Default::default() };
    let type_ = TypeProto { value: Some(type_proto::Value::TensorType(tensor)), ..Default::default() };
    ValueInfoProto { name: name.into(), type_: MessageField::some(type_), ..Default::default() }
}

fn initializer(name: &str, dims: &[usize], data: &[f32]) -> TensorProto {
    TensorProto {
        name: name.into(),
        dims: dims.iter().map(|d| *d as i64).collect(),
        data_type: tensor_proto::DataType::FLOAT as i32,
        raw_data: data.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ..Default::default()
    }
}

fn node(op: &str, name: &str, inputs: &[&str], output: &str) -> NodeProto {
    NodeProto {
        op_type: op.into(),
        name: name.into(),
        input: inputs.iter().map(|s| s.to_string()).collect(),
        output: vec![output.into()],
        ..Default::default()
    }
}

/// The ONNX bytes of `model`, a v1 MLP (its f32 weights).
pub fn export_mlp(model: &Model) -> Result<Vec<u8>, OnnxError> {
    if model.layers.is_empty() {
        return Err(OnnxError::Output {
            what: format!("model '{}' is not a plain MLP (file v1); only those export", model.name),
        });
    }
    let mut g = GraphProto { name: model.name.clone(), ..Default::default() };
    g.input.push(float_tensor("x", model.input_dim()));
    let mut at = "x".to_string();
    for (i, l) in model.layers.iter().enumerate() {
        let (w, b) = (format!("fc{i}.weight"), format!("fc{i}.bias"));
        g.initializer.push(initializer(&w, &[l.out_dim, l.in_dim], &l.weights_f32));
        g.initializer.push(initializer(&b, &[l.out_dim], &l.bias));
        let last = i + 1 == model.layers.len();
        let out = if last { "logit".to_string() } else { format!("fc{i}") };
        let mut gemm = node("Gemm", &format!("/fc{i}/Gemm"), &[&at, &w, &b], &out);
        gemm.attribute.push(AttributeProto {
            name: "transB".into(),
            i: 1,
            type_: AttributeType::INT.into(),
            ..Default::default()
        });
        g.node.push(gemm);
        at = out;
        if l.relu {
            let relu = format!("relu{i}");
            g.node.push(node("Relu", &format!("/relu{i}/Relu"), &[&at], &relu));
            at = relu;
        }
    }
    g.output.push(float_tensor("logit", 1));
    let proto = ModelProto {
        ir_version: 8,
        producer_name: "quiver export-onnx".into(),
        opset_import: vec![OperatorSetIdProto { domain: String::new(), version: 17, ..Default::default() }],
        graph: MessageField::some(g),
        ..Default::default()
    };
    proto.write_to_bytes().map_err(|e| OnnxError::Output { what: format!("encoding the export: {e}") })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::onnx::{import_bytes, ImportOptions};
    use crate::model::OutputKind;

    /// A small MLP made here (model sits below demo in the layering).
    fn mlp() -> Model {
        use crate::model::{InputSegment, Layer, Source};
        let mut rng = crate::seeded::SplitMix64::new(3);
        let mut layer = |i: usize, o: usize, relu| {
            let w: Vec<f32> = (0..i * o).map(|_| rng.normal() * 0.3).collect();
            let b: Vec<f32> = (0..o).map(|_| rng.normal() * 0.1).collect();
            Layer::quantize(i, o, relu, w, b)
        };
        Model {
            name: "exported".into(),
            version: 2,
            inputs: vec![
                InputSegment { source: Source::User, dim: 4 },
                InputSegment { source: Source::Item, dim: 4 },
                InputSegment { source: Source::Context, dim: 4 },
            ],
            layers: vec![layer(12, 24, true), layer(24, 8, true), layer(8, 1, false)],
            calibration: None,
            graph: None,
            onnx: None,
            feature_names: Vec::new(),
        }
    }

    #[test]
    fn an_exported_mlp_imports_back_as_the_same_network() {
        let model = mlp();
        let bytes = export_mlp(&model).unwrap();
        let inputs = model
            .inputs
            .iter()
            .map(|s| format!("{}:{}", crate::model::onnx::source_name(s.source), s.dim))
            .collect::<Vec<_>>()
            .join(",");
        let opts = ImportOptions {
            name: model.name.clone(),
            version: model.version,
            inputs: inputs.parse().unwrap(),
            output: None,
            output_kind: OutputKind::Logit,
            base_dir: None,
        };
        let back = import_bytes(&bytes, "exported.onnx", &opts).unwrap().model;
        assert_eq!((back.inputs.clone(), back.layers.len()), (model.inputs.clone(), model.layers.len()));
        for (a, b) in back.layers.iter().zip(&model.layers) {
            assert_eq!((a.relu, &a.weights_f32, &a.bias), (b.relu, &b.weights_f32, &b.bias));
        }
        let mut not_mlp = mlp();
        not_mlp.layers.clear();
        assert!(export_mlp(&not_mlp).is_err());
    }
}
