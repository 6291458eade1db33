//! Shadow scoring: a candidate version also scores a sample of requests
//! after their responses are written, and how far its scores are from the
//! returned ones is counted. Nothing here runs before a response is out.
//!
//! Both inference modes sample: inline requests from the shard's input rows,
//! handed-off ones from their job slot when the stage's scores come back. The
//! shadow itself always runs inline on the shard, with the shard's own
//! backend for the shadow version: the stage thread serves only the current
//! versions, and a shadow must never take its batch room.
//!
//! With `[log] always_log_shadow_diff`, the decision-log record of a
//! queued request waits in its slot (`logged::Held`, its spans and keys in
//! the slot's staging bytes) and is finished here, after the shadow scored
//! it: logged when the sample or an always rule took it, or when the
//! shadow's scores are that far from the returned ones.

use super::logged::{self, Held};
use super::versions::{user_bucket, Served};
use super::Telemetry;
use crate::deadline::Clock;
use crate::decision_log::record::ShadowRef;
use crate::decision_log::ShardLog;
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
    /// The slot the request being answered was just queued in (set by
    /// `sample`, cleared before each request), where its log record may
    /// wait for the shadow.
    pub(super) queued_now: Option<usize>,
    /// Per slot, a decision-log record waiting for the shadow's scores,
    /// and its spans and keys (`held_bytes` per slot; empty unless
    /// `always_log_shadow_diff` is set).
    pub(super) held: [Option<Held>; SHADOW_SLOTS],
    pub(super) held_staging: Vec<u8>,
    pub(super) held_bytes: usize,
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

    /// Keeps `bytes` of staging per slot for log records that wait for
    /// their shadow (allocated when the shard starts, with the log).
    pub(super) fn keep_log(&mut self, bytes: usize) {
        self.held_bytes = bytes;
        self.held_staging = vec![0; SHADOW_SLOTS * bytes];
    }

    /// Where the log record of the request being answered can wait for its
    /// shadow: its slot's held record and staging bytes, when `sample`
    /// just queued it and records can wait.
    pub(super) fn holding(&mut self) -> logged::Waits<'_> {
        let slot = self.queued_now.take()?;
        if self.held_bytes == 0 {
            return None;
        }
        let staging = self.held_staging.get_mut(slot * self.held_bytes..(slot + 1) * self.held_bytes)?;
        Some((self.held.get_mut(slot)?, staging))
    }

    /// Logs, without the shadow's scores, every record still waiting (the
    /// queued work is about to be dropped: the served versions changed).
    pub(super) fn release_held(&mut self, log: Option<&mut ShardLog>, served: &[Served]) {
        let Some(log) = log else {
            return;
        };
        for item in &self.items {
            if let Some(held) = self.held.get_mut(item.slot).and_then(Option::take) {
                let staging = &self.held_staging[item.slot * self.held_bytes..][..self.held_bytes];
                let x = &self.x[item.slot * self.slot_floats..][..item.rows * item.row_dim];
                let returned = &self.returned[item.slot * self.rows_max..][..item.rows];
                logged::log_shadowed(log, &held, served, staging, x, returned, None);
            }
        }
    }

    /// Scores the queued samples with their shadow versions (in `served`)
    /// and counts how far their scores are from what was returned; logs
    /// the records that waited for them.
    pub(super) fn run(
        &mut self,
        clock: &impl Clock,
        served: &mut [Served],
        telemetry: &mut Telemetry,
        mut log: Option<&mut ShardLog>,
    ) {
        let ShadowQueue {
            x,
            returned,
            scores,
            ranks,
            rank_a,
            items,
            slot_floats,
            rows_max,
            held,
            held_staging,
            held_bytes,
            ..
        } = self;
        for item in items.drain(..) {
            let rows = item.rows;
            let x = &x[item.slot * *slot_floats..][..rows * item.row_dim];
            let returned = &returned[item.slot * *rows_max..][..rows];
            let waiting = held.get_mut(item.slot).and_then(Option::take);
            let scored = match served.get_mut(item.served) {
                Some(shadow) => {
                    let started_ns = clock.now_ns();
                    let scored = shadow.backend.score(x, rows, &mut scores[..rows]);
                    telemetry.times.record_ns(Stage::Shadow, clock.now_ns().saturating_sub(started_ns));
                    for s in scores[..rows].iter_mut() {
                        *s = shadow.model.score(*s);
                    }
                    scored.ok().map(|_| shadow.model.version)
                }
                None => None,
            };
            if let (Some(held), Some(log)) = (waiting, log.as_deref_mut()) {
                let staging = &held_staging[item.slot * *held_bytes..][..*held_bytes];
                let shadow = scored.map(|version| ShadowRef { version, scores: &scores[..rows] });
                logged::log_shadowed(log, &held, served, staging, x, returned, shadow);
            }
            if scored.is_none() {
                // A shadow that cannot score is no sample; the served
                // response was already written.
                continue;
            }
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
        self.queued_now = None;
        let name = &served[primary].model.name;
        let Some(si) = served.iter().position(|s| s.shadow_ppm > 0 && s.model.name == *name) else {
            return;
        };
        if user_bucket(user_id ^ 0x5348_4144_4f57) >= served[si].shadow_ppm || self.items.len() == SHADOW_SLOTS {
            return;
        }
        let rows = returned.len();
        let slot = (0..SHADOW_SLOTS).find(|k| self.items.iter().all(|i| i.slot != *k)).expect("a slot is free");
        self.queued_now = Some(slot);
        self.x[slot * self.slot_floats..][..rows * row_dim].copy_from_slice(&x[..rows * row_dim]);
        self.returned[slot * self.rows_max..][..rows].copy_from_slice(returned);
        self.items.push(ShadowItem { slot, served: si, rows, row_dim });
    }
}
