//! A walk over an ONNX file's protobuf wire format before it is decoded,
//! refusing what would make the decoder recurse without bound.
//!
//! `protobuf` 3.4.0, the runtime `onnx-protobuf`'s generated code is built
//! for and checks the exact version of, skips an unknown group field by
//! recursing once per nested group with no depth limit (RUSTSEC-2024-0437):
//! a megabyte of byte 0x0B (field 1, wire type 3, "start group") is a
//! million nested calls and overflows the stack. No `onnx-protobuf`
//! release accepts the fixed runtime (3.7.2 and later), so the file is
//! walked here first.
//!
//! Why the walk is sound. It follows the same schema the decoder does:
//! [`child`] lists, for each ONNX message, the fields the generated code
//! parses as messages (its `read_message` arms), and a test decodes a probe
//! for every field number 1..=100 of every message, and of every message
//! reached through each listed field, to check the table against the
//! decoder itself. So the walk descends into a length-delimited field
//! exactly when the decoder parses that field as a message, and skips every
//! other field by its wire type, consuming the same bytes the decoder does
//! (a varint ends at the first byte below 0x80 in both; the decoder's
//! stricter 32-bit reads only make it stop earlier). It therefore visits
//! every position the decoder visits, in the same nesting, until either
//! stops. At every such position a tag of wire type 3 or 4 is refused: ONNX
//! declares no group fields, so a group can only be an unknown field, the
//! case the decoder recurses on, and no ONNX writer produces one. Anything
//! else malformed is refused too, where the decoder would fail anyway.
//! Message nesting deeper than the decoder's own limit (100,
//! `DEFAULT_RECURSION_LIMIT`) is refused for the same reason, which also
//! bounds this walk's stack of open messages; the walk is a loop, not a
//! recursion, and reads each byte once.

/// Messages nested below the root the decoder parses before it gives up
/// (`protobuf`'s `DEFAULT_RECURSION_LIMIT`).
const NESTING_MAX: usize = 100;

/// The ONNX messages (`onnx.proto`, as `onnx-protobuf` 0.2.3 generates it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Msg {
    Model,
    Graph,
    Node,
    Attribute,
    ValueInfo,
    TrainingInfo,
    StringStringEntry,
    TensorAnnotation,
    Tensor,
    TensorSegment,
    SparseTensor,
    TensorShape,
    TensorShapeDimension,
    Type,
    TypeTensor,
    TypeSequence,
    TypeMap,
    TypeOptional,
    TypeSparseTensor,
    OperatorSetId,
    Function,
}

/// The message the decoder parses field `field` of a `m` as, if any.
fn child(m: Msg, field: u32) -> Option<Msg> {
    use Msg::*;
    Some(match (m, field) {
        (Model, 7) => Graph,
        (Model, 8) => OperatorSetId,
        (Model, 14) => StringStringEntry,
        (Model, 20) => TrainingInfo,
        (Model, 25) => Function,
        (Graph, 1) => Node,
        (Graph, 5) => Tensor,
        (Graph, 11..=13) => ValueInfo,
        (Graph, 14) => TensorAnnotation,
        (Graph, 15) => SparseTensor,
        (Graph, 16) => StringStringEntry,
        (Node, 5) => Attribute,
        (Node, 9) => StringStringEntry,
        (Attribute, 5 | 10) => Tensor,
        (Attribute, 6 | 11) => Graph,
        (Attribute, 14 | 15) => Type,
        (Attribute, 22 | 23) => SparseTensor,
        (ValueInfo, 2) => Type,
        (ValueInfo, 4) => StringStringEntry,
        (TrainingInfo, 1 | 2) => Graph,
        (TrainingInfo, 3 | 4) => StringStringEntry,
        (TensorAnnotation, 2) => StringStringEntry,
        (Tensor, 3) => TensorSegment,
        (Tensor, 13 | 16) => StringStringEntry,
        (SparseTensor, 1 | 2) => Tensor,
        (TensorShape, 1) => TensorShapeDimension,
        (Type, 1) => TypeTensor,
        (Type, 4) => TypeSequence,
        (Type, 5) => TypeMap,
        (Type, 8) => TypeSparseTensor,
        (Type, 9) => TypeOptional,
        (TypeTensor | TypeSparseTensor, 2) => TensorShape,
        (TypeSequence | TypeOptional, 1) | (TypeMap, 2) => Type,
        (Function, 7) => Node,
        (Function, 9) => OperatorSetId,
        (Function, 11) => Attribute,
        (Function, 12) => ValueInfo,
        (Function, 14) => StringStringEntry,
        _ => return None,
    })
}

/// A varint at `*pos`, at most 10 bytes (the tenth holding one bit), not
/// past `end`.
fn varint(bytes: &[u8], pos: &mut usize, end: usize) -> Result<u64, String> {
    let mut value = 0u64;
    for i in 0..10 {
        let Some(&b) = bytes[..end].get(*pos) else {
            return Err(format!("a varint runs past its message's end at byte {end}"));
        };
        *pos += 1;
        if i == 9 && b > 1 {
            return Err(format!("a varint longer than 64 bits ends at byte {pos}"));
        }
        value |= u64::from(b & 0x7f) << (7 * i);
        if b < 0x80 {
            return Ok(value);
        }
    }
    Err(format!("a varint longer than 10 bytes ends at byte {pos}"))
}

/// Walks `bytes` as a `ModelProto` (see the module header); `Err` says what
/// was refused and where.
pub(super) fn check(bytes: &[u8]) -> Result<(), String> {
    // Open messages: (type, end offset), the root at the bottom.
    let mut open: Vec<(Msg, usize)> = vec![(Msg::Model, bytes.len())];
    let mut pos = 0usize;
    while let Some(&(message, end)) = open.last() {
        if pos == end {
            open.pop();
            continue;
        }
        let at = pos;
        let tag = varint(bytes, &mut pos, end)?;
        let (field, wire_type) = (tag >> 3, tag & 7);
        let field = u32::try_from(field)
            .ok()
            .filter(|f| *f != 0 && tag <= u64::from(u32::MAX))
            .ok_or_else(|| format!("tag {tag} at byte {at} is not a field"))?;
        let skip = |pos: &mut usize, n: u64| -> Result<(), String> {
            match pos.checked_add(usize::try_from(n).unwrap_or(usize::MAX)) {
                Some(p) if p <= end => {
                    *pos = p;
                    Ok(())
                }
                _ => Err(format!("field {field} at byte {at} runs past its message's end at byte {end}")),
            }
        };
        match wire_type {
            0 => {
                varint(bytes, &mut pos, end)?;
            }
            1 => skip(&mut pos, 8)?,
            5 => skip(&mut pos, 4)?,
            2 => {
                let len = varint(bytes, &mut pos, end)?;
                let start = pos;
                skip(&mut pos, len)?;
                if let Some(child) = child(message, field) {
                    if open.len() > NESTING_MAX {
                        return Err(format!("messages nest deeper than {NESTING_MAX} at byte {at} (a {child:?})"));
                    }
                    open.push((child, pos));
                    pos = start;
                }
            }
            3 | 4 => {
                return Err(format!("field {field} of a {message:?} at byte {at} is a group, which ONNX never writes"))
            }
            _ => return Err(format!("tag {tag} at byte {at} has wire type {wire_type}, which does not exist")),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use onnx_protobuf::{tensor_proto, tensor_shape_proto, type_proto, Message};
    use onnx_protobuf::{GraphProto, ModelProto, NodeProto};

    const ALL: [Msg; 21] = {
        use Msg::*;
        [
            Model,
            Graph,
            Node,
            Attribute,
            ValueInfo,
            TrainingInfo,
            StringStringEntry,
            TensorAnnotation,
            Tensor,
            TensorSegment,
            SparseTensor,
            TensorShape,
            TensorShapeDimension,
            Type,
            TypeTensor,
            TypeSequence,
            TypeMap,
            TypeOptional,
            TypeSparseTensor,
            OperatorSetId,
            Function,
        ]
    };

    /// Whether the generated code decodes `bytes` as an `m`.
    fn decodes(m: Msg, bytes: &[u8]) -> bool {
        fn ok<T: Message>(bytes: &[u8]) -> bool {
            T::parse_from_bytes(bytes).is_ok()
        }
        use Msg::*;
        match m {
            Model => ok::<ModelProto>(bytes),
            Graph => ok::<GraphProto>(bytes),
            Node => ok::<NodeProto>(bytes),
            Attribute => ok::<onnx_protobuf::AttributeProto>(bytes),
            ValueInfo => ok::<onnx_protobuf::ValueInfoProto>(bytes),
            TrainingInfo => ok::<onnx_protobuf::TrainingInfoProto>(bytes),
            StringStringEntry => ok::<onnx_protobuf::StringStringEntryProto>(bytes),
            TensorAnnotation => ok::<onnx_protobuf::TensorAnnotation>(bytes),
            Tensor => ok::<onnx_protobuf::TensorProto>(bytes),
            TensorSegment => ok::<tensor_proto::Segment>(bytes),
            SparseTensor => ok::<onnx_protobuf::SparseTensorProto>(bytes),
            TensorShape => ok::<onnx_protobuf::TensorShapeProto>(bytes),
            TensorShapeDimension => ok::<tensor_shape_proto::Dimension>(bytes),
            Type => ok::<onnx_protobuf::TypeProto>(bytes),
            TypeTensor => ok::<type_proto::Tensor>(bytes),
            TypeSequence => ok::<type_proto::Sequence>(bytes),
            TypeMap => ok::<type_proto::Map>(bytes),
            TypeOptional => ok::<type_proto::Optional>(bytes),
            TypeSparseTensor => ok::<type_proto::SparseTensor>(bytes),
            OperatorSetId => ok::<onnx_protobuf::OperatorSetIdProto>(bytes),
            Function => ok::<onnx_protobuf::FunctionProto>(bytes),
        }
    }

    /// Field `field` (wire type 2) holding `inner`.
    fn wrap(field: u32, inner: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        for mut v in [u64::from(field) << 3 | 2, inner.len() as u64] {
            while v >= 0x80 {
                out.push(v as u8 | 0x80);
                v >>= 7;
            }
            out.push(v as u8);
        }
        out.extend_from_slice(inner);
        out
    }

    /// Eight bytes of 0x07: as a message, a tag of wire type 7, which the
    /// decoder refuses; as anything else a length-delimited field can be
    /// (string, bytes, packed varints, floats or doubles), valid.
    const PROBE: [u8; 8] = [7; 8];

    /// The table of message fields is the decoder's: for every message,
    /// and every message reached through a listed field, exactly the listed
    /// field numbers make the decoder parse the probe as a message.
    #[test]
    fn the_table_matches_the_generated_decoder() {
        for m in ALL {
            for f in 1..=100 {
                let parsed_as_message = !decodes(m, &wrap(f, &PROBE));
                assert_eq!(parsed_as_message, child(m, f).is_some(), "{m:?} field {f}");
                if let Some(c) = child(m, f) {
                    for g in 1..=100 {
                        let parsed_as_message = !decodes(m, &wrap(f, &wrap(g, &PROBE)));
                        assert_eq!(parsed_as_message, child(c, g).is_some(), "{m:?}.{f} ({c:?}) field {g}");
                    }
                }
            }
        }
    }

    #[test]
    fn a_real_model_passes_and_groups_are_refused_at_any_depth() {
        let mut model = ModelProto { producer_name: "t".into(), ..Default::default() };
        let mut graph = GraphProto { name: "g".into(), ..Default::default() };
        graph.node.push(NodeProto { op_type: "Relu".into(), input: vec!["x".into()], ..Default::default() });
        model.graph = Some(graph).into();
        let bytes = model.write_to_bytes().unwrap();
        check(&bytes).unwrap();

        assert!(check(&[0x0b; 1 << 20]).unwrap_err().contains("field 1 of a Model at byte 0 is a group"));
        // The same group inside the graph's node: ModelProto.graph (7) ->
        // GraphProto.node (1) -> an unknown group field 1 in the NodeProto.
        let nested = [0x3a, 4, 0x0a, 2, 0x0b, 0x0c];
        assert!(check(&nested).unwrap_err().contains("field 1 of a Node at byte 4 is a group"));
        // In a bytes field (TensorProto.raw_data of an initializer) the
        // decoder never parses the content, so neither does the walk.
        let raw = [0x3a, 7, 0x2a, 5, 0x4a, 3, 0x0b, 0x0b, 0x0b];
        check(&raw).unwrap();
        ModelProto::parse_from_bytes(&raw).unwrap();
    }

    #[test]
    fn nesting_and_lengths_are_bounded() {
        // GraphProto.node (1) -> NodeProto.attribute (5) -> AttributeProto.g
        // (6) -> GraphProto..., built from the inside out: 120 levels.
        let chain = |rounds: usize| {
            let mut graph: Vec<u8> = Vec::new();
            for _ in 0..rounds {
                graph = wrap(1, &wrap(5, &wrap(6, &graph)));
            }
            wrap(7, &graph)
        };
        let e = check(&chain(40)).unwrap_err();
        assert!(e.contains("nest deeper than 100"), "{e}");
        assert!(ModelProto::parse_from_bytes(&chain(40)).is_err());
        // 99 levels below the root are within both bounds.
        check(&chain(33)).unwrap();
        ModelProto::parse_from_bytes(&chain(33)).unwrap();

        assert!(check(&[0x3a, 9, 0]).unwrap_err().contains("runs past its message's end"));
        assert!(check(&[0x3a]).unwrap_err().contains("varint runs past"));
        assert!(check(&[0x0f]).unwrap_err().contains("wire type 7"));
        let long = [0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f];
        assert!(check(&long).unwrap_err().contains("64 bits"));
    }
}
