//! The request path's per-request memory, allocated when the shard starts
//! (and grown only when a wider model version is swapped in, between read
//! rounds): the model input rows a request is assembled into, and the
//! scores and encoder its answer is written from.

use super::explained::Explained;
use crate::features::replica::LINK_WORDS_MAX;
use crate::wire::ResponseEncoder;

/// The current request's model input rows and the lookups that fill them.
pub(super) struct Inputs {
    /// Model input rows, `candidates_max × row_dim`.
    pub(super) x: Vec<f32>,
    /// One group's vectors as a lookup returns them, before they are placed
    /// in the rows: as many floats as the largest lookup (a candidate-scope
    /// group's row per candidate, a request-scope group's one row) takes.
    pub(super) vectors: Vec<f32>,
    /// Row index per candidate from the batched lookup.
    pub(super) rows: Vec<u32>,
    /// u64 keys copied out of the request, for the batched lookup.
    pub(super) ids: Vec<u64>,
    /// String keys' hashes, from the batched lookup.
    pub(super) hashes: Vec<u64>,
    /// Each candidate's score-cache key: its item id, mixed with its key
    /// in every other candidate-scope group the model reads.
    pub(super) candidate_keys: Vec<u64>,
    /// The links of the rows a lookup in a chain of parents just read
    /// (`ad` → `campaign`), `candidates_max × LINK_WORDS_MAX`, and the
    /// links the next lookup reads into: swapped at each step of a chain.
    pub(super) links: Vec<u32>,
    pub(super) links_next: Vec<u32>,
    /// The request's context floats, read out of the frame once so that
    /// each row takes them in one copy (element by element from the
    /// frame, 32 rows of 16 were a tenth of an auction-32's lookup stage),
    /// `context_len_max`.
    pub(super) context: Vec<f32>,
}

impl Inputs {
    pub(super) fn new(rows_max: usize, vectors_len: usize, context_len_max: usize) -> Inputs {
        Inputs {
            x: Vec::new(),
            vectors: vec![0.0; vectors_len],
            rows: vec![0; rows_max],
            ids: Vec::with_capacity(rows_max),
            hashes: vec![0; rows_max],
            candidate_keys: Vec::with_capacity(rows_max),
            links: vec![0; rows_max * LINK_WORDS_MAX],
            links_next: vec![0; rows_max * LINK_WORDS_MAX],
            context: Vec::with_capacity(context_len_max),
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
    /// The current answer's explanations, when its request asked.
    pub(super) explained: Explained,
    /// What the last response said, for the decision log.
    pub(super) last: Outcome,
}

/// The fields of the last encoded response the decision log records
/// (its scores are in `Answer::logits`).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Outcome {
    /// `Status.0`, `Tier.0`, `Reason.0`.
    pub(super) status: u8,
    pub(super) tier: u8,
    pub(super) reason: u8,
    pub(super) version: u32,
    pub(super) server_us: u32,
    pub(super) missing: u16,
    pub(super) stale: bool,
    /// Candidates answered, and the width of their assembled rows (0 when
    /// none were assembled: shed, or a failure).
    pub(super) rows: usize,
    pub(super) row_dim: usize,
}

impl Answer {
    pub(super) fn new(rows_max: usize) -> Answer {
        Answer {
            logits: vec![0.0; rows_max],
            cached: vec![0.0; rows_max],
            encoder: ResponseEncoder::new(rows_max),
            explained: Explained::new(),
            last: Outcome::default(),
        }
    }
}
