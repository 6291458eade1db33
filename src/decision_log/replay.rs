//! `quiver log replay`: the logged input rows scored again by a model file
//! and compared with the logged scores, bit for bit. On the backend and
//! model version that served them, every score must come back the same:
//! that is the check that the log holds the rows exactly as the kernel saw
//! them (after lookup, defaults and missing flags).
//!
//! Only decisions the file's model answered can be compared: `ok`, tier
//! `primary`, the model's name and version. The others (failures, cached,
//! fallback and default answers, other models and versions) are counted as
//! skipped, each by why. A decision's rows are scored together, as the
//! server scores a request; a row's score does not depend on the rows
//! scored with it (ARCHITECTURE.md, the backends' invariant).

use std::path::Path;
use std::sync::Arc;

use super::read::{self, Logged, ReadError};
use crate::model::Model;
use crate::score::{self, BackendKind};

/// Rows scored in one backend call; a decision with more is scored in
/// parts.
pub const ROWS_PER_CALL: usize = 1024;
/// Differences kept for the report (all are counted).
pub const DIFFERENCES_KEPT: usize = 100;

/// One candidate whose replayed score differs from the logged one.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Difference {
    pub request_id: u64,
    pub candidate: usize,
    pub logged: f32,
    pub replayed: f32,
}

/// What a replay found.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Report {
    /// Decisions read (of the request id asked for, when one was).
    pub decisions: u64,
    /// Decisions and rows scored again.
    pub replayed: u64,
    pub rows: u64,
    /// Rows whose score came back bit for bit, and those that did not.
    pub equal: u64,
    pub differing: u64,
    /// The first [`DIFFERENCES_KEPT`] differences.
    pub differences: Vec<Difference>,
    /// Decisions not replayed: not `ok`; answered below the primary;
    /// another model or version; without input rows; scoring failed.
    pub skipped_failed: u64,
    pub skipped_lower_tier: u64,
    pub skipped_other_model: u64,
    pub skipped_no_rows: u64,
    pub skipped_score_error: u64,
}

impl Report {
    /// Every decision replayed matched, and at least one was.
    pub fn matched(&self) -> bool {
        self.differing == 0 && self.skipped_score_error == 0 && self.replayed > 0
    }
}

/// Why a replay could not run at all.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error(transparent)]
    Read(#[from] ReadError),
    #[error("{path}: rows of {logged} floats, model '{model}' v{version} reads {want}")]
    Width { path: String, logged: usize, model: String, version: u32, want: usize },
}

/// Scores the decisions of the segment at `path` (those of `request_id`
/// when given) again with `model` on `backend`, and compares.
pub fn replay(
    path: &Path,
    model: &Arc<Model>,
    backend: BackendKind,
    request_id: Option<u64>,
) -> Result<Report, ReplayError> {
    let mut scorer = score::build(backend, model, ROWS_PER_CALL);
    let want = model.input_dim();
    let mut report = Report::default();
    let mut logits = vec![0.0f32; ROWS_PER_CALL];
    let logged_width = read::decisions(path, request_id, &mut |d: &Logged| {
        report.decisions += 1;
        let skipped = if d.status != "ok" {
            Some(&mut report.skipped_failed)
        } else if d.tier.as_deref() != Some("primary") {
            Some(&mut report.skipped_lower_tier)
        } else if d.model != model.name || d.model_version != model.version {
            Some(&mut report.skipped_other_model)
        } else if d.scores.is_empty() || d.x.len() != d.scores.len() * want {
            Some(&mut report.skipped_no_rows)
        } else {
            None
        };
        if let Some(count) = skipped {
            *count += 1;
            return;
        }
        let rows = d.scores.len();
        let mut replayed = Vec::with_capacity(rows);
        for start in (0..rows).step_by(ROWS_PER_CALL) {
            let n = (rows - start).min(ROWS_PER_CALL);
            if scorer.score(&d.x[start * want..(start + n) * want], n, &mut logits[..n]).is_err() {
                report.skipped_score_error += 1;
                return;
            }
            replayed.extend(logits[..n].iter().map(|&l| model.score(l)));
        }
        report.replayed += 1;
        for (candidate, (&logged, &again)) in d.scores.iter().zip(&replayed).enumerate() {
            report.rows += 1;
            if logged.to_bits() == again.to_bits() {
                report.equal += 1;
                continue;
            }
            report.differing += 1;
            if report.differences.len() < DIFFERENCES_KEPT {
                report.differences.push(Difference { request_id: d.request_id, candidate, logged, replayed: again });
            }
        }
    })?;
    // The model's name and version on rows of another width: not the file
    // that served them, said so instead of counting every decision skipped.
    if report.replayed == 0 && report.skipped_no_rows > 0 && logged_width != want {
        return Err(ReplayError::Width {
            path: path.display().to_string(),
            logged: logged_width,
            model: model.name.clone(),
            version: model.version,
            want,
        });
    }
    Ok(report)
}
