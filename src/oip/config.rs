//! Triton's model configuration for a served model: the answer to
//! Triton's `ModelConfig` call (gRPC `ModelConfig`, HTTP
//! `GET /v2/models/{name}[/versions/{v}]/config`), an extension of Triton's
//! that the protocol lacks but perf_analyzer asks before its first request.
//!
//! Only what Quiver knows of a model is said, and said truthfully: its name,
//! the version serving, `max_batch_size` 0 (a request is one decision: its
//! candidates are the `item_ids` dimension, not a batch dimension), and the
//! inputs and output of its [`Signature`] (the metadata's, with Triton's
//! `TYPE_` datatypes and `optional` for the inputs a request may leave out).
//! Every other field stays at its default, which tells Triton's clients that
//! there is no dynamic or sequence batching and no ensemble. The messages are
//! Triton's own (`proto/oip/model_config.proto`); both transports render
//! this one description (`grpc.rs` as protobuf, `rest.rs` as JSON) so the
//! two never disagree.

use serde_json::{json, Value};

use super::tensors::{DataType, Signature, TensorSpec};

/// One input or output as Triton's config lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigTensor {
    pub name: String,
    /// Triton's `DataType` enumerator, e.g. `TYPE_INT64`.
    pub data_type: &'static str,
    /// -1: as many as the request sends (one per candidate).
    pub dims: Vec<i64>,
    pub optional: bool,
}

/// A served model's configuration, as Triton's `ModelConfig` describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelConfig {
    pub name: String,
    /// The metadata's platform, also the backend's name.
    pub platform: &'static str,
    /// The version serving (the config's `version_policy`, `specific`).
    pub version: u32,
    /// Always 0: no batch dimension.
    pub max_batch_size: i32,
    pub inputs: Vec<ConfigTensor>,
    pub outputs: Vec<ConfigTensor>,
}

/// Triton's `DataType` enumerator for a v2 datatype (model_config.proto:
/// BYTES is `TYPE_STRING` there).
pub fn triton_data_type(d: DataType) -> &'static str {
    match d {
        DataType::Bool => "TYPE_BOOL",
        DataType::Uint8 => "TYPE_UINT8",
        DataType::Uint16 => "TYPE_UINT16",
        DataType::Uint32 => "TYPE_UINT32",
        DataType::Uint64 => "TYPE_UINT64",
        DataType::Int8 => "TYPE_INT8",
        DataType::Int16 => "TYPE_INT16",
        DataType::Int32 => "TYPE_INT32",
        DataType::Int64 => "TYPE_INT64",
        DataType::Fp16 => "TYPE_FP16",
        DataType::Fp32 => "TYPE_FP32",
        DataType::Fp64 => "TYPE_FP64",
        DataType::Bytes => "TYPE_STRING",
    }
}

impl ModelConfig {
    /// `signature`'s config; `platform` as the model's metadata names it.
    pub fn of(signature: &Signature, platform: &'static str) -> ModelConfig {
        let tensor = |t: &TensorSpec| ConfigTensor {
            name: t.name.clone(),
            data_type: triton_data_type(t.datatype),
            dims: t.shape.clone(),
            optional: t.optional,
        };
        ModelConfig {
            name: signature.name.clone(),
            platform,
            version: signature.version,
            max_batch_size: 0,
            inputs: signature.inputs.iter().map(tensor).collect(),
            outputs: signature.outputs.iter().map(tensor).collect(),
        }
    }

    /// The protobuf JSON mapping of Triton's `ModelConfig` with its field
    /// names kept (what Triton's HTTP `/config` returns), dims as numbers.
    pub fn to_json(&self) -> Value {
        let input = |t: &ConfigTensor| json!({ "name": t.name, "data_type": t.data_type, "dims": t.dims, "optional": t.optional });
        let output = |t: &ConfigTensor| json!({ "name": t.name, "data_type": t.data_type, "dims": t.dims });
        json!({
            "name": self.name,
            "platform": self.platform,
            "backend": self.platform,
            "version_policy": { "specific": { "versions": [self.version] } },
            "max_batch_size": self.max_batch_size,
            "input": self.inputs.iter().map(input).collect::<Vec<_>>(),
            "output": self.outputs.iter().map(output).collect::<Vec<_>>(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::oip::tensors::Role;

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
                spec("merchant", DataType::Bytes, &[1], Role::Group { strings: true }, true),
                spec("context", DataType::Fp32, &[16], Role::Context, true),
            ],
            outputs: vec![spec("scores", DataType::Fp32, &[-1], Role::Context, false)],
            row_width: 48,
        }
    }

    #[test]
    fn the_config_lists_the_signatures_tensors_in_tritons_types_without_a_batch_dimension() {
        let c = ModelConfig::of(&signature(), "quiver");
        let j = c.to_json();
        assert_eq!(j["name"], "demo");
        assert_eq!(j["max_batch_size"], 0);
        assert_eq!((&j["platform"], &j["backend"]), (&json!("quiver"), &json!("quiver")));
        assert_eq!(j["version_policy"]["specific"]["versions"], json!([3]));
        let inputs: Vec<(&str, &str, Value, bool)> = j["input"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| {
                (
                    t["name"].as_str().unwrap(),
                    t["data_type"].as_str().unwrap(),
                    t["dims"].clone(),
                    t["optional"].as_bool().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            inputs,
            [
                ("user_id", "TYPE_INT64", json!([1]), false),
                ("item_ids", "TYPE_INT64", json!([-1]), false),
                ("merchant", "TYPE_STRING", json!([1]), true),
                ("context", "TYPE_FP32", json!([16]), true),
            ]
        );
        assert_eq!(j["output"], json!([{"name": "scores", "data_type": "TYPE_FP32", "dims": [-1]}]));
        // Nothing says batching, sequences or an ensemble: perf_analyzer
        // reads their absence as a plain model.
        for absent in ["dynamic_batching", "sequence_batching", "ensemble_scheduling", "model_transaction_policy"] {
            assert!(j.get(absent).is_none(), "{absent}");
        }
    }
}
