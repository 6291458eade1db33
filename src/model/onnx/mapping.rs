//! `--inputs`: how the ONNX graph's inputs map to Quiver input segments,
//! parsed from its text and matched against the inputs a graph declares.

use onnx_protobuf::ValueInfoProto;

use super::OnnxError;
use crate::features::groups::Scope;
use crate::model::{GroupName, InputSegment, Source};

/// One entry of `--inputs`: which Quiver source fills the next `dim` columns,
/// optionally naming the ONNX graph input they come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MappingEntry {
    pub source: Source,
    pub graph_input: Option<String>,
    pub dim: usize,
}

/// How the ONNX graph inputs map to Quiver input segments.
///
/// Written `user:32,item:32,context:16` or, with feature groups,
/// `card:16,device:8,ad@candidate:12,context:6` (entries take the graph inputs in
/// their declared order, one each; a graph with a single input is split into
/// consecutive segments instead) or `user=u:32,item=i:32,context=c:16`
/// (entries name their graph input; several entries naming the same input
/// split it, in the order written).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InputMapping {
    pub entries: Vec<MappingEntry>,
}

impl std::str::FromStr for InputMapping {
    type Err = OnnxError;

    fn from_str(s: &str) -> Result<InputMapping, OnnxError> {
        let bad = |what: String| OnnxError::Mapping { what };
        let mut entries = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (left, dim) = part
                .rsplit_once(':')
                .ok_or_else(|| bad(format!("'{part}': expected SOURCE:DIM or SOURCE=INPUT:DIM")))?;
            let dim: usize = dim
                .parse()
                .ok()
                .filter(|d| *d > 0)
                .ok_or_else(|| bad(format!("'{part}': the dimension must be a positive integer")))?;
            let (source, graph_input) = match left.split_once('=') {
                Some((src, input)) if !input.is_empty() => (src, Some(input.to_string())),
                Some(_) => return Err(bad(format!("'{part}': empty graph input name after '='"))),
                None => (left, None),
            };
            let source = parse_source(source).map_err(|why| bad(format!("'{part}': {why}")))?;
            if entries.iter().any(|e: &MappingEntry| e.source.name() == source.name()) {
                return Err(bad(format!("{} is mapped more than once", source.name())));
            }
            entries.push(MappingEntry { source, graph_input, dim });
        }
        if entries.is_empty() {
            return Err(bad("no entries; e.g. user:32,item:32,context:16".into()));
        }
        let named = entries.iter().filter(|e| e.graph_input.is_some()).count();
        if named != 0 && named != entries.len() {
            return Err(bad("name the graph input in every entry or in none".into()));
        }
        Ok(InputMapping { entries })
    }
}

/// Reads one entry's source: `user`, `item`, `context`, `context_ids`, or
/// a feature group's name, keyed once per request unless written
/// `NAME@candidate` (`NAME@request` says the default).
fn parse_source(text: &str) -> Result<Source, String> {
    let (name, scope) = match text.split_once('@') {
        None => (text, None),
        Some((name, "request")) => (name, Some(Scope::Request)),
        Some((name, "candidate")) => (name, Some(Scope::Candidate)),
        Some((_, other)) => return Err(format!("scope '{other}' is neither request nor candidate")),
    };
    Ok(match (name, scope) {
        ("user", None | Some(Scope::Request)) => Source::User,
        ("item", None | Some(Scope::Candidate)) => Source::Item,
        ("user", _) | ("item", _) => return Err(format!("group '{name}' has a fixed scope; write it bare")),
        ("context" | "context_ids", Some(_)) => return Err(format!("'{name}' is a request input, without a scope")),
        ("context", None) => Source::Context,
        ("context_ids", None) => Source::ContextIds,
        (group, scope) => Source::Group {
            name: GroupName::new(group).map_err(|why| format!("not a source ({why})"))?,
            scope: scope.unwrap_or(Scope::Request),
        },
    })
}

/// The `--inputs` spelling of a source.
pub fn source_name(s: Source) -> String {
    match s {
        Source::Group { name, scope: Scope::Candidate } => format!("{}@candidate", name.as_str()),
        other => other.name().to_string(),
    }
}

/// Assigns `--inputs` entries to the graph inputs; returns each input's
/// segments, in column order.
pub(super) fn resolve_mapping(
    inputs: &[&ValueInfoProto],
    widths: &[usize],
    mapping: &InputMapping,
) -> Result<Vec<Vec<InputSegment>>, OnnxError> {
    let bad = |what: String| OnnxError::Mapping { what };
    let described: Vec<String> =
        inputs.iter().zip(widths).map(|(vi, w)| format!("'{}' [batch, {w}]", vi.name)).collect();
    let described = described.join(", ");
    let mut segments: Vec<Vec<InputSegment>> = vec![Vec::new(); inputs.len()];
    let seg = |e: &MappingEntry| InputSegment { source: e.source, dim: e.dim };
    let named = mapping.entries.iter().all(|e| e.graph_input.is_some());
    if named {
        for e in &mapping.entries {
            let name = e.graph_input.as_deref().expect("all entries are named");
            let i = inputs
                .iter()
                .position(|vi| vi.name == name)
                .ok_or_else(|| bad(format!("the graph has no input '{name}'; its inputs are {described}")))?;
            segments[i].push(seg(e));
        }
    } else if inputs.len() == 1 {
        segments[0] = mapping.entries.iter().map(seg).collect();
    } else if mapping.entries.len() != inputs.len() {
        return Err(bad(format!(
            "{} entries for {} graph inputs ({described}); give one entry per input, in this order",
            mapping.entries.len(),
            inputs.len()
        )));
    } else {
        for (s, e) in segments.iter_mut().zip(&mapping.entries) {
            s.push(seg(e));
        }
    }
    for ((vi, &w), segs) in inputs.iter().zip(widths).zip(&segments) {
        if segs.is_empty() {
            return Err(bad(format!("graph input '{}' is not mapped; its inputs are {described}", vi.name)));
        }
        let total: usize = segs.iter().map(|s| s.dim).sum();
        if total != w {
            let parts: Vec<String> = segs.iter().map(|s| format!("{}:{}", source_name(s.source), s.dim)).collect();
            return Err(bad(format!(
                "graph input '{}' is {w} wide but is mapped to {} = {total}",
                vi.name,
                parts.join(" + ")
            )));
        }
    }
    Ok(segments)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mapping_refusals() {
        let err = |s: &str| s.parse::<InputMapping>().unwrap_err().to_string();
        assert!(err("user:3,item=i:4").contains("in every entry or in none"));
        assert!(err("user:3,user:4").contains("user is mapped more than once"));
        assert!(err("user:0").contains("positive integer"));
        assert!(err("us ers:3").contains("'us ers:3': not a source"), "{}", err("us ers:3"));
        assert!(err("card:3,card@candidate:4").contains("card is mapped more than once"));
        assert!(err("user@candidate:3").contains("group 'user' has a fixed scope"));
        assert!(err("context@request:3").contains("'context' is a request input"));
        assert!(err("ad@sometimes:3").contains("scope 'sometimes' is neither request nor candidate"));
        assert!(err("user").contains("expected SOURCE:DIM"));
        assert!(err("").contains("no entries"));
        let m: InputMapping = "card:16,device@request:8,ad@candidate:4,item:2".parse().unwrap();
        let sources: Vec<String> = m.entries.iter().map(|e| source_name(e.source)).collect();
        assert_eq!(sources, ["card", "device", "ad@candidate", "item"]);
        assert!(!m.entries[1].source.per_candidate() && m.entries[2].source.per_candidate());
        let m: InputMapping = "user=u:3,context=u:1".parse().unwrap();
        assert_eq!(m.entries[1].graph_input.as_deref(), Some("u"));
    }
}
