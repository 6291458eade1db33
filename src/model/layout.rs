//! Where each of a model's input segments lands in one input row, checked
//! against the served feature groups (name, scope, width) and the request
//! limits: what a model needs to be served, computed once per served
//! version (the request path) and when a version is loaded (the registry).

use super::{Model, Source};
use crate::features::groups::{Scope, CHAIN_LINKS_MAX};

/// The model's inputs and the served groups do not fit together.
#[derive(Debug, thiserror::Error)]
pub enum LayoutError {
    #[error("model '{model}' reads {input} features of dimension {model_dim}, the replica holds {replica_dim}")]
    Dim { model: String, input: Source, model_dim: usize, replica_dim: usize },
    #[error("model '{model}' reads feature group '{group}', which this server does not serve (served: {served})")]
    UnknownGroup { model: String, group: String, served: String },
    #[error(
        "model '{model}' reads group '{group}' once per {model_scope}, the server keys it once per {served_scope}"
    )]
    Scope { model: String, group: String, model_scope: &'static str, served_scope: &'static str },
    #[error("model '{model}' declares {model_dim} context floats, above limits.context_len_max = {limit}")]
    Context { model: String, model_dim: usize, limit: usize },
    #[error("model '{model}' declares {model_dim} context ids, above limits.context_len_max = {limit}")]
    ContextIds { model: String, model_dim: usize, limit: usize },
}

/// One served feature group, as a model's layout is checked against it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupFit {
    pub name: String,
    pub scope: Scope,
    /// Floats per row of its replica.
    pub dim: usize,
    /// The group whose rows link to this one's (`campaign` for
    /// `advertiser`): its keys come from those links, never from a request.
    pub child: Option<String>,
}

/// A group segment of a model's input row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupSegment {
    /// The group's index among the served groups.
    pub group: usize,
    /// Where its floats start in a row.
    pub offset: usize,
    pub dim: usize,
    pub scope: Scope,
}

/// Where each input segment lands inside one row of the model input.
#[derive(Clone, Debug)]
pub struct InputLayout {
    /// Floats in one model input row.
    pub row_dim: usize,
    /// The feature group segments, in the model's input order.
    pub groups: Vec<GroupSegment>,
    /// Offset and length of the context floats.
    pub context: Option<(usize, usize)>,
    /// Offset and length of the context ids.
    pub context_ids: Option<(usize, usize)>,
    /// The groups to look up, in an order in which each group keyed
    /// through a child's links comes right after that child.
    pub lookups: Vec<Lookup>,
}

/// One group looked up for a request: one the model reads, or one whose
/// rows only carry the links to one it reads (`campaign` for a model that
/// reads `advertiser` only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lookup {
    /// The group's index among the served groups.
    pub group: usize,
    pub scope: Scope,
    /// Floats per row.
    pub dim: usize,
    /// Where its floats start in a row, when the model reads it.
    pub offset: Option<usize>,
    /// Whether its keys are the links of the lookup just before.
    pub through_links: bool,
    /// Whether its rows' links key the lookup just after.
    pub keep_links: bool,
}

impl InputLayout {
    /// Checks `model`'s inputs against the served `groups` and the context
    /// limit, and computes where each segment goes.
    pub fn new(model: &Model, groups: &[GroupFit], context_len_max: usize) -> Result<InputLayout, LayoutError> {
        let mut layout = InputLayout {
            row_dim: model.input_dim(),
            groups: Vec::new(),
            context: None,
            context_ids: None,
            lookups: Vec::new(),
        };
        let mut offset = 0;
        for seg in &model.inputs {
            match seg.source.group() {
                Some((name, scope)) => {
                    let Some(group) = groups.iter().position(|g| g.name == name) else {
                        let served: Vec<&str> = groups.iter().map(|g| g.name.as_str()).collect();
                        return Err(LayoutError::UnknownGroup {
                            model: model.name.clone(),
                            group: name.into(),
                            served: served.join(", "),
                        });
                    };
                    let served = &groups[group];
                    if served.scope != scope {
                        return Err(LayoutError::Scope {
                            model: model.name.clone(),
                            group: name.into(),
                            model_scope: scope.name(),
                            served_scope: served.scope.name(),
                        });
                    }
                    if served.dim != seg.dim {
                        return Err(LayoutError::Dim {
                            model: model.name.clone(),
                            input: seg.source,
                            model_dim: seg.dim,
                            replica_dim: served.dim,
                        });
                    }
                    layout.groups.push(GroupSegment { group, offset, dim: seg.dim, scope });
                }
                None if seg.source == Source::Context => {
                    if seg.dim > context_len_max {
                        return Err(LayoutError::Context {
                            model: model.name.clone(),
                            model_dim: seg.dim,
                            limit: context_len_max,
                        });
                    }
                    layout.context = Some((offset, seg.dim));
                }
                None => {
                    if seg.dim > context_len_max {
                        return Err(LayoutError::ContextIds {
                            model: model.name.clone(),
                            model_dim: seg.dim,
                            limit: context_len_max,
                        });
                    }
                    layout.context_ids = Some((offset, seg.dim));
                }
            }
            offset += seg.dim;
        }
        layout.lookups = lookups(&layout.groups, groups);
        Ok(layout)
    }
}

/// The lookup order for the segments `read` of the served `groups`: each
/// group keyed by the request, then, right after it, the chain of groups
/// keyed through its links, as far as the farthest one the model reads.
/// The served groups' chains were checked at start-up (no cycle, at most
/// [`CHAIN_LINKS_MAX`] links, one child per parent).
fn lookups(read: &[GroupSegment], groups: &[GroupFit]) -> Vec<Lookup> {
    let index = |name: &str| groups.iter().position(|g| g.name == name);
    let offset_of = |g: usize| read.iter().find(|s| s.group == g).map(|s| s.offset);
    // The root of each read group's chain: the group the request keys.
    let root_of = |mut g: usize| {
        for _ in 0..=CHAIN_LINKS_MAX {
            match groups[g].child.as_deref().and_then(index) {
                Some(child) => g = child,
                None => break,
            }
        }
        g
    };
    let mut roots: Vec<usize> = Vec::new();
    for seg in read {
        let root = root_of(seg.group);
        if !roots.contains(&root) {
            roots.push(root);
        }
    }
    let mut out = Vec::new();
    for root in roots {
        // The chain from the root up: the groups whose child is the one before.
        let mut chain = vec![root];
        while chain.len() <= CHAIN_LINKS_MAX {
            let last = groups[chain[chain.len() - 1]].name.as_str();
            match groups.iter().position(|g| g.child.as_deref() == Some(last)) {
                Some(parent) => chain.push(parent),
                None => break,
            }
        }
        // Only as far as the last group the model reads.
        let end = chain.iter().rposition(|&g| offset_of(g).is_some()).map_or(0, |i| i + 1);
        for (i, &g) in chain[..end].iter().enumerate() {
            out.push(Lookup {
                group: g,
                scope: groups[g].scope,
                dim: groups[g].dim,
                offset: offset_of(g),
                through_links: i > 0,
                keep_links: i + 1 < end,
            });
        }
    }
    out
}
