//! The request path's per-request memory, allocated when the shard starts
//! (and grown only when a wider model version is swapped in, between read
//! rounds): the model input rows a request is assembled into, and the
//! scores and encoder its answer is written from.

use crate::wire::ResponseEncoder;

/// The current request's model input rows and the lookups that fill them.
pub(super) struct Inputs {
    /// Model input rows, `candidates_max × row_dim`.
    pub(super) x: Vec<f32>,
    /// Item vectors as the batched lookup returns them, `candidates_max × item dim`.
    pub(super) item_vectors: Vec<f32>,
    /// Row index per item from the batched lookup.
    pub(super) item_rows: Vec<u32>,
    /// Item ids copied out of the request, for the batched lookup.
    pub(super) item_ids: Vec<u64>,
}

impl Inputs {
    pub(super) fn new(rows_max: usize, item_dim: usize) -> Inputs {
        Inputs {
            x: Vec::new(),
            item_vectors: vec![0.0; rows_max * item_dim],
            item_rows: vec![0; rows_max],
            item_ids: Vec::with_capacity(rows_max),
        }
    }

    /// Makes room for `floats` input values (a newly served, wider version).
    pub(super) fn fit(&mut self, floats: usize) {
        if self.x.len() < floats {
            self.x = vec![0.0; floats];
        }
    }
}

/// The current answer's scores and the encoder that writes it.
pub(super) struct Answer {
    /// The scores answered, `candidates_max`.
    pub(super) logits: Vec<f32>,
    /// Cached scores of the current request's candidates.
    pub(super) cached: Vec<f32>,
    pub(super) encoder: ResponseEncoder,
}

impl Answer {
    pub(super) fn new(rows_max: usize) -> Answer {
        Answer { logits: vec![0.0; rows_max], cached: vec![0.0; rows_max], encoder: ResponseEncoder::new(rows_max) }
    }
}
