//! Where each of a model's input segments lands in one input row, checked
//! against the feature replicas' dimensions and the request limits: what a
//! model needs to be served, computed once per served version (the request
//! path) and when a version is loaded (the registry).

use super::{Model, Source};

/// The model's inputs and the replicas do not fit together.
#[derive(Debug, thiserror::Error)]
pub enum LayoutError {
    #[error("model '{model}' reads {input:?} features of dimension {model_dim}, the replica holds {replica_dim}")]
    Dim { model: String, input: Source, model_dim: usize, replica_dim: usize },
    #[error("model '{model}' declares {model_dim} context floats, above limits.context_len_max = {limit}")]
    Context { model: String, model_dim: usize, limit: usize },
    #[error("model '{model}' declares {model_dim} context ids, above limits.context_len_max = {limit}")]
    ContextIds { model: String, model_dim: usize, limit: usize },
}

/// Where each input segment lands inside one row of the model input.
#[derive(Clone, Copy, Debug)]
pub struct InputLayout {
    /// Floats in one model input row.
    pub row_dim: usize,
    /// Where the user vector starts in a row, if the model reads it.
    pub user: Option<usize>,
    pub item: Option<usize>,
    /// Offset and length of the context floats.
    pub context: Option<(usize, usize)>,
    /// Offset and length of the context ids.
    pub context_ids: Option<(usize, usize)>,
}

impl InputLayout {
    /// Checks `model`'s inputs against the replicas' dimensions and the
    /// context limit, and computes where each segment goes.
    pub fn new(
        model: &Model,
        user_dim: usize,
        item_dim: usize,
        context_len_max: usize,
    ) -> Result<InputLayout, LayoutError> {
        let mut layout =
            InputLayout { row_dim: model.input_dim(), user: None, item: None, context: None, context_ids: None };
        let mut offset = 0;
        for seg in &model.inputs {
            let replica_dim = match seg.source {
                Source::User => Some(user_dim),
                Source::Item => Some(item_dim),
                Source::Context | Source::ContextIds => None,
            };
            if let Some(replica_dim) = replica_dim.filter(|&d| d != seg.dim) {
                return Err(LayoutError::Dim {
                    model: model.name.clone(),
                    input: seg.source,
                    model_dim: seg.dim,
                    replica_dim,
                });
            }
            match seg.source {
                Source::User => layout.user = Some(offset),
                Source::Item => layout.item = Some(offset),
                Source::Context => {
                    if seg.dim > context_len_max {
                        return Err(LayoutError::Context {
                            model: model.name.clone(),
                            model_dim: seg.dim,
                            limit: context_len_max,
                        });
                    }
                    layout.context = Some((offset, seg.dim));
                }
                Source::ContextIds => {
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
        Ok(layout)
    }
}
