//! External data: initializers whose values an exporter wrote to files
//! beside the `.onnx` (large models), read into the graph before import,
//! every range checked and bounded in total before any is read.

use std::path::Path;

use onnx_protobuf::{tensor_proto, GraphProto, TensorProto};

use super::OnnxError;
use crate::model::graph::EMBEDDING_FLOATS_MAX;

/// Most bytes of external data all initializers may name together: no
/// more can end up in a model file (`MODEL_MAPPED_BYTES_MAX`).
pub const EXTERNAL_DATA_BYTES_MAX: u64 = crate::model::MODEL_MAPPED_BYTES_MAX;

/// Whether `t` keeps its values in an external data file.
pub(super) fn is_external(t: &TensorProto) -> bool {
    t.data_location.enum_value() == Ok(tensor_proto::DataLocation::EXTERNAL)
}

/// A copy of `graph` whose externally stored initializers hold their data
/// inline, read from files next to the model (`location` must be a plain
/// relative path inside `base_dir`).
pub(super) fn inline_external_data(graph: &GraphProto, base_dir: Option<&Path>) -> Result<GraphProto, OnnxError> {
    let mut g = graph.clone();
    // Every range is checked and summed before any is read: initializers
    // may all name the same large file, and each within the per-tensor
    // bound could still add up to more memory than the machine has.
    let mut ranges = Vec::new();
    let mut total = 0u64;
    for (k, t) in g.initializer.iter().enumerate().filter(|(_, t)| is_external(t)) {
        let bad = |what: String| OnnxError::Initializer { name: t.name.clone(), what };
        let Some(base) = base_dir else {
            return Err(bad("is stored in an external data file; import the model from its file path".into()));
        };
        let entry = |key: &str| t.external_data.iter().find(|e| e.key == key).map(|e| e.value.clone());
        let location = entry("location").ok_or_else(|| bad("external data without a 'location'".into()))?;
        let rel = Path::new(&location);
        let plain = rel.components().all(|c| matches!(c, std::path::Component::Normal(_)));
        if !plain {
            return Err(bad(format!("external data location '{location}' is not a plain relative path")));
        }
        let number = |key: &str| -> Result<Option<u64>, OnnxError> {
            entry(key)
                .map(|v| v.parse::<u64>().map_err(|_| bad(format!("external data {key} '{v}' is not a number"))))
                .transpose()
        };
        let (offset, length) = (number("offset")?.unwrap_or(0), number("length")?);
        let path = base.join(rel);
        let io = |e: std::io::Error| bad(format!("external data file {}: {e}", path.display()));
        let size = std::fs::metadata(&path).map_err(io)?.len();
        let length = length.unwrap_or(size.saturating_sub(offset));
        if offset.checked_add(length).is_none_or(|end| end > size) {
            return Err(bad(format!(
                "external data {}: bytes {offset}..{} are outside its {size} bytes",
                path.display(),
                offset.saturating_add(length)
            )));
        }
        // Read whole into memory: as large as the largest embedding table.
        let bytes_max = 4 * EMBEDDING_FLOATS_MAX as u64;
        if length > bytes_max {
            return Err(bad(format!("external data {}: {length} bytes; the limit is {bytes_max}", path.display())));
        }
        total = total.saturating_add(length);
        if total > EXTERNAL_DATA_BYTES_MAX {
            return Err(bad(format!(
                "the initializers' external data adds up to more than {EXTERNAL_DATA_BYTES_MAX} bytes \
                 (EXTERNAL_DATA_BYTES_MAX, the largest model file)"
            )));
        }
        ranges.push((k, path, offset, length));
    }
    for (k, path, offset, length) in ranges {
        let t = &mut g.initializer[k];
        let bad = |what: String| OnnxError::Initializer { name: t.name.clone(), what };
        let io = |e: std::io::Error| bad(format!("external data file {}: {e}", path.display()));
        use std::io::{Read as _, Seek as _};
        let mut f = std::fs::File::open(&path).map_err(io)?;
        f.seek(std::io::SeekFrom::Start(offset)).map_err(io)?;
        let mut data = vec![0u8; length as usize];
        f.read_exact(&mut data).map_err(io)?;
        t.raw_data = data;
        t.external_data.clear();
        t.data_location = tensor_proto::DataLocation::DEFAULT.into();
    }
    Ok(g)
}
