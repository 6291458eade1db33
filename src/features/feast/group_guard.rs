//! A walk over Feast protobuf bytes before they are decoded, refusing what
//! would make the decoder recurse without bound.
//!
//! `protobuf` 3.4.0 (the runtime `onnx-protobuf` pins, and so the one
//! Feast's messages are generated for here) skips an unknown group field by
//! recursing once per nested group with no depth limit (RUSTSEC-2024-0437):
//! a run of byte 0x0B overflows the stack. A registry file or a Redis value
//! is outside input, so it is walked first, as `src/model/onnx/wire.rs`
//! walks an ONNX file.
//!
//! Why the walk is sound: it is driven by the same descriptors the
//! generated decoder is (`MessageFull::descriptor()`): it descends into a
//! length-delimited field exactly when the field is declared a message (or
//! a map whose values are messages: a map entry is a message with key 1
//! and value 2), and skips every other field by its wire type, consuming
//! what the decoder consumes. Feast's files are proto3, which has no
//! groups, so a group tag (wire type 3 or 4) at any position the walk
//! visits can only be the unknown field the decoder recurses on, and is
//! refused. Nesting deeper than the decoder's own limit (100) is refused
//! too, which bounds the walk's stack; the walk is a loop and reads each
//! byte once.

use protobuf::reflect::{MessageDescriptor, RuntimeFieldType, RuntimeType};

/// Messages nested below the root the decoder parses before it gives up
/// (`protobuf`'s `DEFAULT_RECURSION_LIMIT`).
const NESTING_MAX: usize = 100;

fn varint(bytes: &[u8], pos: &mut usize, end: usize) -> Result<u64, String> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let Some(&b) = bytes.get(*pos).filter(|_| *pos < end) else {
            return Err(format!("a varint runs past its message at byte {pos}"));
        };
        *pos += 1;
        value |= u64::from(b & 0x7f) << shift;
        if b < 0x80 {
            return Ok(value);
        }
    }
    Err(format!("a varint longer than 10 bytes ends at byte {pos}"))
}

/// What the walk is inside: a message, or one entry of a map field (key
/// 1, value 2), with the value's message when the values are messages.
#[derive(Clone)]
enum Frame {
    Message(MessageDescriptor),
    MapEntry(Option<MessageDescriptor>),
}

/// What a length-delimited field `field` of `frame` holds, when the decoder
/// parses it as a message (or a map entry).
fn child(frame: &Frame, field: u32) -> Option<Frame> {
    let message = |t: RuntimeType| match t {
        RuntimeType::Message(d) => Some(d),
        _ => None,
    };
    match frame {
        Frame::MapEntry(value) => value.clone().filter(|_| field == 2).map(Frame::Message),
        Frame::Message(m) => match m.field_by_number(field)?.runtime_field_type() {
            RuntimeFieldType::Singular(t) | RuntimeFieldType::Repeated(t) => message(t).map(Frame::Message),
            RuntimeFieldType::Map(_, value) => Some(Frame::MapEntry(message(value))),
        },
    }
}

/// Checks `bytes` as a serialized `root`: `Err` names the first thing that
/// would make the decoder recurse without bound, or that no decoder takes.
pub fn check(bytes: &[u8], root: &MessageDescriptor) -> Result<(), String> {
    // The open messages: where each ends, and its descriptor.
    let mut open: Vec<(usize, Frame)> = vec![(bytes.len(), Frame::Message(root.clone()))];
    let mut pos = 0usize;
    while let Some((end, m)) = open.last().cloned() {
        if pos == end {
            open.pop();
            continue;
        }
        let at = pos;
        let tag = varint(bytes, &mut pos, end)?;
        let (field, wire) = ((tag >> 3) as u32, tag & 7);
        if field == 0 {
            return Err(format!("field number 0 at byte {at}"));
        }
        match wire {
            0 => {
                varint(bytes, &mut pos, end)?;
            }
            1 | 5 => {
                let width = if wire == 1 { 8 } else { 4 };
                if end - pos < width {
                    return Err(format!("a fixed-width field runs past its message at byte {at}"));
                }
                pos += width;
            }
            2 => {
                let len = varint(bytes, &mut pos, end)?;
                let len = usize::try_from(len).ok().filter(|&l| l <= end - pos);
                let Some(len) = len else {
                    return Err(format!("a length at byte {at} runs past its message"));
                };
                match child(&m, field) {
                    Some(inner) => {
                        if open.len() > NESTING_MAX {
                            return Err(format!("messages nested more than {NESTING_MAX} deep at byte {at}"));
                        }
                        open.push((pos + len, inner));
                    }
                    None => pos += len,
                }
            }
            3 | 4 => return Err(format!("a group (field {field}) at byte {at}: Feast's messages have none")),
            _ => return Err(format!("wire type {wire} at byte {at}")),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use protobuf::{Message, MessageFull};

    use super::*;
    use crate::features::feast::protos::FeatureService::{FeatureService, FeatureServiceSpec};
    use crate::features::feast::protos::FeatureView::{FeatureView, FeatureViewSpec};
    use crate::features::feast::protos::Registry::Registry;
    use crate::features::feast::protos::Value::Value;

    fn wrap(field: u32, inner: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut tag = u64::from(field << 3 | 2);
        loop {
            let b = (tag & 0x7f) as u8;
            tag >>= 7;
            out.push(if tag > 0 { b | 0x80 } else { b });
            if tag == 0 {
                break;
            }
        }
        let mut len = inner.len() as u64;
        loop {
            let b = (len & 0x7f) as u8;
            len >>= 7;
            out.push(if len > 0 { b | 0x80 } else { b });
            if len == 0 {
                break;
            }
        }
        out.extend_from_slice(inner);
        out
    }

    fn registry() -> Registry {
        let mut r = Registry::new();
        let mut view = FeatureView::new();
        let mut spec = FeatureViewSpec::new();
        spec.name = "v".into();
        spec.tags.insert("k".into(), "v".into());
        view.spec = Some(spec).into();
        r.feature_views.push(view);
        let mut service = FeatureService::new();
        let mut spec = FeatureServiceSpec::new();
        spec.name = "s".into();
        service.spec = Some(spec).into();
        r.feature_services.push(service);
        r
    }

    #[test]
    fn a_real_registry_passes_and_groups_are_refused_at_any_depth() {
        let bytes = registry().write_to_bytes().unwrap();
        check(&bytes, &Registry::descriptor()).unwrap();
        // A group inside a feature view's spec (Registry.feature_views = 6,
        // FeatureView.spec = 1): the decoder would recurse on it.
        let bomb = vec![0x0b; 10_000];
        let e = check(&wrap(6, &wrap(1, &bomb)), &Registry::descriptor()).unwrap_err();
        assert!(e.contains("a group"), "{e}");
        // The same bytes as the spec's name (FeatureViewSpec.name = 1) are
        // a string, as the decoder reads them.
        let in_string = wrap(6, &wrap(1, &wrap(1, &bomb)));
        check(&in_string, &Registry::descriptor()).unwrap();
        let decoded = Registry::parse_from_bytes(&in_string).unwrap();
        assert_eq!(decoded.feature_views[0].spec.name.len(), bomb.len());
        // Inside a map's message value: Value.map_val (20) -> Map.val (1),
        // an entry whose value (2) is a Value.
        let e = check(&wrap(20, &wrap(1, &wrap(2, &bomb))), &Value::descriptor()).unwrap_err();
        assert!(e.contains("a group"), "{e}");
        assert!(check(&[0x0b, 0x0c], &Value::descriptor()).is_err());
    }

    #[test]
    fn nesting_and_lengths_are_bounded() {
        // Value -> map_val -> entry -> Value ..., 60 times: 180 messages deep.
        let mut deep = Vec::new();
        for _ in 0..60 {
            deep = wrap(20, &wrap(1, &wrap(2, &deep)));
        }
        let e = check(&deep, &Value::descriptor()).unwrap_err();
        assert!(e.contains("nested more than 100"), "{e}");
        let mut shallow = Vec::new();
        for _ in 0..20 {
            shallow = wrap(20, &wrap(1, &wrap(2, &shallow)));
        }
        check(&shallow, &Value::descriptor()).unwrap();
        assert!(Value::parse_from_bytes(&shallow).is_ok());
        assert!(check(&[0x32, 0x05, 0x00], &Registry::descriptor()).unwrap_err().contains("runs past"));
        assert!(check(&[0x32], &Registry::descriptor()).is_err());
        assert!(check(&[0xff; 12], &Registry::descriptor()).is_err());
        assert!(check(&[0x00], &Registry::descriptor()).unwrap_err().contains("field number 0"));
        assert!(check(&[0x0f], &Registry::descriptor()).unwrap_err().contains("wire type 7"));
    }
}
