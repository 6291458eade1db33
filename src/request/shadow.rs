//! Shadow scoring: a candidate version also scores a sample of requests
//! after their responses are written, and how far its scores are from the
//! returned ones is counted. Nothing here runs before a response is out.
//!
//! Both inference modes sample: inline requests from the shard's input rows,
//! handed-off ones from their job slot when the stage's scores come back. The
//! shadow itself always runs inline on the shard, with the shard's own
//! backend for the shadow version: the stage thread serves only the current
//! versions, and a shadow must never take its batch room.

use super::versions::{user_bucket, Served};
use super::Telemetry;
use crate::deadline::Clock;
use crate::metrics::Stage;

/// Shadow requests waiting for spare time: the model input rows and the
/// scores that were returned, in a few preallocated slots. When the slots are
/// full, further shadow samples are skipped rather than queued.
#[derive(Default)]
pub(super) struct ShadowQueue {
    pub(super) x: Vec<f32>,
    pub(super) returned: Vec<f32>,
    pub(super) scores: Vec<f32>,
    pub(super) ranks: Vec<(f32, usize, f32)>,
    pub(super) rank_a: Vec<f32>,
    pub(super) items: Vec<ShadowItem>,
    pub(super) slot_floats: usize,
    pub(super) rows_max: usize,
}

#[derive(Clone, Copy, Debug)]
pub(super) struct ShadowItem {
    pub(super) slot: usize,
    pub(super) served: usize,
    pub(super) rows: usize,
    pub(super) row_dim: usize,
}

/// Shadow requests held at once per shard.
pub(super) const SHADOW_SLOTS: usize = 4;

/// Spearman's rank correlation of two equally long score lists (1 when the
/// candidate orders the items as the returned scores did). `ranks` is scratch.
fn rank_correlation(a: &[f32], b: &[f32], ranks: &mut Vec<(f32, usize, f32)>, rank_a: &mut Vec<f32>) -> f64 {
    let n = a.len();
    if n < 2 {
        return 1.0;
    }
    ranks.clear();
    ranks.extend(a.iter().enumerate().map(|(i, &v)| (v, i, 0.0)));
    ranks.sort_by(|x, y| x.0.total_cmp(&y.0));
    rank_a.clear();
    rank_a.resize(n, 0.0);
    for (r, &(_, i, _)) in ranks.iter().enumerate() {
        rank_a[i] = r as f32;
    }
    ranks.clear();
    ranks.extend(b.iter().enumerate().map(|(i, &v)| (v, i, rank_a[i])));
    ranks.sort_by(|x, y| x.0.total_cmp(&y.0));
    let d2: f64 = ranks.iter().enumerate().map(|(r, &(_, _, ra))| (f64::from(ra) - r as f64).powi(2)).sum();
    let n = n as f64;
    1.0 - 6.0 * d2 / (n * (n * n - 1.0))
}

impl ShadowQueue {
    /// Makes room for `rows_max` candidates of `slot_floats` input values
    /// per sample (a newly served shadow, or a wider version).
    pub(super) fn fit(&mut self, rows_max: usize, slot_floats: usize) {
        if self.slot_floats >= slot_floats {
            return;
        }
        self.slot_floats = slot_floats;
        self.rows_max = rows_max;
        self.x = vec![0.0; SHADOW_SLOTS * slot_floats];
        self.returned = vec![0.0; SHADOW_SLOTS * rows_max];
        self.scores = vec![0.0; rows_max];
        self.ranks = Vec::with_capacity(rows_max);
        self.rank_a = Vec::with_capacity(rows_max);
        self.items = Vec::with_capacity(SHADOW_SLOTS);
    }

    /// Scores the queued samples with their shadow versions (in `served`)
    /// and counts how far their scores are from what was returned.
    pub(super) fn run(&mut self, clock: &impl Clock, served: &mut [Served], telemetry: &mut Telemetry) {
        let ShadowQueue { x, returned, scores, ranks, rank_a, items, slot_floats, rows_max } = self;
        for item in items.drain(..) {
            let Some(served) = served.get_mut(item.served) else {
                continue;
            };
            let rows = item.rows;
            let x = &x[item.slot * *slot_floats..][..rows * item.row_dim];
            let started_ns = clock.now_ns();
            let scored = served.backend.score(x, rows, &mut scores[..rows]);
            telemetry.times.record_ns(Stage::Shadow, clock.now_ns().saturating_sub(started_ns));
            if scored.is_err() {
                // A shadow that cannot score is no sample; the served
                // response was already written.
                continue;
            }
            for s in scores[..rows].iter_mut() {
                *s = served.model.score(*s);
            }
            let returned = &returned[item.slot * *rows_max..][..rows];
            let shadow = &scores[..rows];
            let mad = returned.iter().zip(shadow).map(|(a, b)| (a - b).abs()).sum::<f32>() / rows as f32;
            let rho = rank_correlation(returned, shadow, ranks, rank_a);
            let counters = &mut telemetry.counters;
            counters.shadow_requests += 1;
            counters.shadow_abs_diff_ppm += (f64::from(mad) * 1e6) as u64;
            counters.shadow_rank_corr_ppm += (rho * 1e6) as i64;
        }
    }

    /// Queues a request answered by `served[primary]` for its shadow version,
    /// if one samples it and a slot is free: its model input rows `x`
    /// (`row_dim` floats each) and the `returned` scores are copied, nothing
    /// else.
    pub(super) fn sample(
        &mut self,
        served: &[Served],
        primary: usize,
        user_id: u64,
        x: &[f32],
        returned: &[f32],
        row_dim: usize,
    ) {
        let name = &served[primary].model.name;
        let Some(si) = served.iter().position(|s| s.shadow_ppm > 0 && s.model.name == *name) else {
            return;
        };
        if user_bucket(user_id ^ 0x5348_4144_4f57) >= served[si].shadow_ppm || self.items.len() == SHADOW_SLOTS {
            return;
        }
        let rows = returned.len();
        let slot = (0..SHADOW_SLOTS).find(|k| self.items.iter().all(|i| i.slot != *k)).expect("a slot is free");
        self.x[slot * self.slot_floats..][..rows * row_dim].copy_from_slice(&x[..rows * row_dim]);
        self.returned[slot * self.rows_max..][..rows].copy_from_slice(returned);
        self.items.push(ShadowItem { slot, served: si, rows, row_dim });
    }
}
