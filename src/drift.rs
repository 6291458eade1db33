//! Drift: how far the scores a version returns, and the per-request inputs
//! it reads (the context, then the request-scope feature groups' rows),
//! have moved from its calibration set.
//!
//! Why here and how: a shard counts, per served version, the primary-tier
//! scores it returns into the bins of that version's calibration histogram,
//! and the count, sum and sum of squares of the first few per-request inputs
//! ([`DriftCounts`], allocated when the shard builds the version, plain
//! integers and floats touched only by that shard). Once per publication
//! interval the shard timer moves them into its `metrics::Publication`, where
//! each version keeps the last `window_s` intervals ([`VersionWindow`]); the
//! admin thread sums every shard's window and turns the totals into
//! [`DriftReport`]s on each scrape. Versions without a calibration have no
//! counts and no drift measure; calibrations written before the context
//! moments were stored have a score drift but no input drift.
//!
//! Score drift is the population stability index over the calibration bins,
//! `PSI = Σ (a_i − e_i) · ln(a_i / e_i)`, with `a_i` the window's share of
//! scores in bin `i` and `e_i` the calibration set's, each floored at
//! [`PROBABILITY_FLOOR`] so that an empty bin adds a large but finite term.
//! Input drift per followed input is the standardized mean shift
//! `|μ_live − μ_cal| / σ_cal` (σ_cal floored at [`STDDEV_FLOOR`]): how many
//! calibration standard deviations the window's mean has moved. It is blind
//! to a change of spread alone, so the window's variance is exported beside
//! it. Either is reported only once the window holds `min_count` rows.

use std::collections::VecDeque;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::model::{Calibration, Model};

/// Bin shares below this count as this in the PSI, so an empty bin on either
/// side adds a bounded term: (a − 1e-4) · ln(a / 1e-4) ≤ ln(1e4) ≈ 9.2.
pub const PROBABILITY_FLOOR: f64 = 1e-4;
/// Calibration standard deviations below this count as this in the mean
/// shift, so a context input that was constant in calibration does not make
/// every change an infinite drift.
pub const STDDEV_FLOOR: f64 = 1e-3;

/// `[drift]` in the config.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct DriftConfig {
    /// The sliding window the measures cover, in seconds (publication
    /// intervals of one second each).
    pub window_s: u64,
    /// Rows (scores, or context rows) the window must hold before a measure
    /// is reported; below it the PSI of a few hundred scores is mostly noise.
    pub min_count: u64,
    /// `quiver_score_drift_alert` is 1 while the PSI is at least this.
    pub psi_alert: f64,
    /// Per-request inputs followed per version: the first this many of
    /// the context's, then each request-scope group's.
    pub context_features_max: usize,
}

impl Default for DriftConfig {
    fn default() -> Self {
        DriftConfig { window_s: 60, min_count: 1_000, psi_alert: 0.2, context_features_max: 8 }
    }
}

impl DriftConfig {
    pub fn validate(&self) -> Result<(), String> {
        if !(1..=3_600).contains(&self.window_s) {
            return Err(format!("drift.window_s = {} is outside 1..=3600", self.window_s));
        }
        if !(self.psi_alert.is_finite() && self.psi_alert > 0.0) {
            return Err(format!("drift.psi_alert = {} must be a positive number", self.psi_alert));
        }
        if self.context_features_max > 256 {
            return Err(format!("drift.context_features_max = {} is above 256", self.context_features_max));
        }
        Ok(())
    }

    /// Publication intervals of `interval` (the shards' publication period,
    /// `metrics::PUBLISH_INTERVAL`) in the window.
    pub fn window_intervals(&self, interval: std::time::Duration) -> usize {
        let interval_s = interval.as_secs().max(1);
        (self.window_s / interval_s).max(1) as usize
    }
}

/// One version's counts on one shard since the last publication. Shard-local:
/// it lives in the shard's `RequestPath`, which is `!Send`.
#[derive(Debug)]
pub struct DriftCounts {
    /// The calibration histogram's inner edges: a score `s` falls in bin
    /// `inner.partition_point(|e| e <= s)`, as in `model::calibrate`.
    inner_edges: Vec<f32>,
    /// The calibration means of the followed context inputs; values are
    /// accumulated relative to them so the sums stay small.
    shift: Vec<f64>,
    interval: Interval,
}

/// What one shard counted for one version over one interval.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Interval {
    /// Scores returned, by calibration bin.
    pub scores: Vec<u64>,
    /// Model input rows whose context was followed.
    pub rows: u64,
    /// Per followed context input: Σ (x − μ_cal) and Σ (x − μ_cal)² over
    /// those rows.
    pub sum: Vec<f64>,
    pub sum_sq: Vec<f64>,
}

impl Interval {
    fn zeroed(bins: usize, features: usize) -> Interval {
        Interval { scores: vec![0; bins], rows: 0, sum: vec![0.0; features], sum_sq: vec![0.0; features] }
    }

    fn add(&mut self, other: &Interval) {
        for (a, b) in self.scores.iter_mut().zip(&other.scores) {
            *a += b;
        }
        self.rows += other.rows;
        for (a, b) in self.sum.iter_mut().zip(&other.sum) {
            *a += b;
        }
        for (a, b) in self.sum_sq.iter_mut().zip(&other.sum_sq) {
            *a += b;
        }
    }
}

impl DriftCounts {
    /// Counters for a version with this calibration, following the first
    /// `context_features_max` context inputs whose moments it stores.
    pub fn new(calibration: &Calibration, context_features_max: usize) -> DriftCounts {
        let edges = &calibration.scores.edges;
        let inner_edges = edges.get(1..edges.len().saturating_sub(1)).unwrap_or_default().to_vec();
        let features = calibration.input_means.len().min(context_features_max);
        let shift = calibration.input_means[..features].iter().map(|&m| f64::from(m)).collect();
        DriftCounts { interval: Interval::zeroed(inner_edges.len() + 1, features), inner_edges, shift }
    }

    /// Counts returned scores (probabilities) into the calibration bins.
    #[inline]
    pub fn record_scores(&mut self, scores: &[f32]) {
        for &s in scores {
            let bin = self.inner_edges.partition_point(|e| *e <= s);
            self.interval.scores[bin] += 1;
        }
    }

    /// Counts one request's context, which each of its `rows` model input
    /// rows carries; `context` yields what the model read (zeros for a
    /// request that sent none).
    #[inline]
    pub fn record_context(&mut self, context: impl Iterator<Item = f32>, rows: usize) {
        let i = &mut self.interval;
        let w = rows as f64;
        i.rows += rows as u64;
        for ((v, shift), (sum, sum_sq)) in context.zip(&self.shift).zip(i.sum.iter_mut().zip(i.sum_sq.iter_mut())) {
            // A missing value (NaN) counts at the calibration mean.
            let d = if v.is_nan() { 0.0 } else { f64::from(v) - shift };
            *sum += w * d;
            *sum_sq += w * d * d;
        }
    }

    /// The interval so far; the counters start again from zero.
    pub fn take(&mut self) -> Interval {
        let fresh = Interval::zeroed(self.interval.scores.len(), self.shift.len());
        std::mem::replace(&mut self.interval, fresh)
    }
}

/// One version's recent intervals on one shard, newest last.
#[derive(Clone, Debug)]
pub struct VersionWindow {
    pub model: Arc<Model>,
    pub intervals: VecDeque<Interval>,
}

/// Appends each version's interval to its window, keeps the newest
/// `intervals_max`, and drops the windows of versions the shard no longer
/// serves (their measures disappear with them). Versions served in two roles
/// (current and canary) share a window.
pub fn push_intervals(windows: &mut Vec<VersionWindow>, fresh: Vec<(Arc<Model>, Interval)>, intervals_max: usize) {
    windows.retain(|w| fresh.iter().any(|(m, _)| same_version(m, &w.model)));
    for (model, interval) in fresh {
        match windows.iter_mut().find(|w| same_version(&w.model, &model)) {
            Some(w) => {
                w.intervals.push_back(interval);
                while w.intervals.len() > intervals_max {
                    w.intervals.pop_front();
                }
            }
            None => windows.push(VersionWindow { model, intervals: VecDeque::from([interval]) }),
        }
    }
}

fn same_version(a: &Model, b: &Model) -> bool {
    a.name == b.name && a.version == b.version
}

/// One version's windows summed over shards.
#[derive(Clone, Debug)]
pub struct WindowTotals {
    pub model: Arc<Model>,
    pub totals: Interval,
}

/// Adds `window`'s intervals into the totals of its version.
pub fn add_window(totals: &mut Vec<WindowTotals>, window: &VersionWindow) {
    let at = match totals.iter().position(|t| same_version(&t.model, &window.model)) {
        Some(at) => at,
        None => {
            let (bins, features) = window.intervals.front().map_or((0, 0), |i| (i.scores.len(), i.sum.len()));
            totals.push(WindowTotals { model: window.model.clone(), totals: Interval::zeroed(bins, features) });
            totals.len() - 1
        }
    };
    for interval in &window.intervals {
        totals[at].totals.add(interval);
    }
}

/// `PSI = Σ (a_i − e_i) · ln(a_i / e_i)` of the `actual` counts against the
/// `expected` ones, shares floored at [`PROBABILITY_FLOOR`]; `None` when
/// either side is empty or the bins differ.
pub fn psi(actual: &[u64], expected: &[u64]) -> Option<f64> {
    let (n_a, n_e) = (actual.iter().sum::<u64>(), expected.iter().sum::<u64>());
    if n_a == 0 || n_e == 0 || actual.len() != expected.len() {
        return None;
    }
    let share = |c: u64, n: u64| (c as f64 / n as f64).max(PROBABILITY_FLOOR);
    Some(
        actual
            .iter()
            .zip(expected)
            .map(|(&a, &e)| {
                let (a, e) = (share(a, n_a), share(e, n_e));
                (a - e) * (a / e).ln()
            })
            .sum(),
    )
}

/// Input drift of one per-request input over the window.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct FeatureDrift {
    /// Position among the inputs drift follows (`Model::drift_columns`).
    pub feature: usize,
    /// The input's name: `context_3`, or a request-scope group's column,
    /// `card_0`.
    #[serde(default)]
    pub name: String,
    pub mean: f64,
    pub variance: f64,
    pub calibration_mean: f64,
    pub calibration_variance: f64,
    /// `|mean − calibration_mean| / max(√calibration_variance, STDDEV_FLOOR)`.
    pub mean_shift: f64,
}

/// Drift of one served version over the window, for `/metrics` and
/// `/stats.json`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct DriftReport {
    pub model: String,
    pub version: u32,
    /// Scores in the window.
    pub scores: u64,
    /// `None` until the window holds `min_count` scores.
    pub psi: Option<f64>,
    pub alert: bool,
    /// Context rows in the window.
    pub context_rows: u64,
    /// Empty until the window holds `min_count` context rows, and for a
    /// calibration without context moments.
    pub features: Vec<FeatureDrift>,
}

impl DriftReport {
    pub fn new(t: &WindowTotals, config: &DriftConfig) -> DriftReport {
        let mut r = DriftReport {
            model: t.model.name.clone(),
            version: t.model.version,
            scores: t.totals.scores.iter().sum(),
            context_rows: t.totals.rows,
            ..DriftReport::default()
        };
        let Some(c) = &t.model.calibration else {
            return r;
        };
        if r.scores >= config.min_count.max(1) {
            r.psi = psi(&t.totals.scores, &c.scores.counts);
            r.alert = r.psi.is_some_and(|p| p >= config.psi_alert);
        }
        if r.context_rows >= config.min_count.max(1) {
            let n = r.context_rows as f64;
            let names = t.model.drift_column_names();
            r.features = (0..t.totals.sum.len())
                .map(|j| {
                    let calibration_mean = f64::from(c.input_means[j]);
                    let calibration_variance = f64::from(c.input_variances[j]);
                    let shift = t.totals.sum[j] / n;
                    let variance = (t.totals.sum_sq[j] / n - shift * shift).max(0.0);
                    FeatureDrift {
                        feature: j,
                        name: names.get(j).cloned().unwrap_or_else(|| format!("input_{j}")),
                        mean: calibration_mean + shift,
                        variance,
                        calibration_mean,
                        calibration_variance,
                        mean_shift: shift.abs() / calibration_variance.sqrt().max(STDDEV_FLOOR),
                    }
                })
                .collect();
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ScoreHistogram;

    fn calibration() -> Calibration {
        Calibration {
            method: "max-abs".into(),
            rows: 400,
            input_ranges: vec![1.0],
            scores: ScoreHistogram { edges: vec![0.0, 0.25, 0.5, 0.75, 1.0], counts: vec![100; 4] },
            input_means: vec![1.0, -2.0, 5.0],
            input_variances: vec![4.0, 0.0, 1.0],
            activations: Default::default(),
            static_error: None,
            dynamic_error: None,
        }
    }

    fn model(version: u32) -> Arc<Model> {
        let mut m = crate::loadgen::demo::model();
        m.version = version;
        m.calibration = Some(calibration());
        Arc::new(m)
    }

    #[test]
    fn psi_by_hand_and_its_floor() {
        assert_eq!(psi(&[25, 25, 25, 25], &[100; 4]), Some(0.0));
        // Half the mass moved from bin 0 to bin 1: shares (0.125, 0.375) vs 0.25.
        let want = (0.125 - 0.25) * (0.125f64 / 0.25).ln() + (0.375 - 0.25) * (0.375f64 / 0.25).ln();
        assert!((psi(&[1, 3, 2, 2], &[1, 1, 1, 1]).unwrap() - want).abs() < 1e-12);
        // An empty bin counts as a share of 1e-4, not 0: finite and large.
        let empty = psi(&[0, 1, 1, 1], &[1, 1, 1, 1]).unwrap();
        let term = |a: f64, e: f64| (a - e) * (a / e).ln();
        let want = term(PROBABILITY_FLOOR, 0.25) + 3.0 * term(1.0 / 3.0, 0.25);
        assert!((empty - want).abs() < 1e-12, "{empty} vs {want}");
        assert!(empty > 0.2);
        assert_eq!(psi(&[0, 0], &[1, 1]), None);
        assert_eq!(psi(&[1, 1], &[1, 1, 1]), None);
    }

    #[test]
    fn counts_follow_the_calibration_bins_and_context_moments() {
        let m = model(1);
        let mut d = DriftCounts::new(m.calibration.as_ref().unwrap(), 2);
        d.record_scores(&[0.0, 0.24, 0.25, 0.6, 0.99, 1.0]);
        d.record_context([3.0, -2.0, 100.0].into_iter(), 2);
        d.record_context([1.0, -2.0, 100.0].into_iter(), 1);
        let i = d.take();
        assert_eq!(i.scores, vec![2, 1, 1, 2]);
        assert_eq!(i.rows, 3);
        // Only the first two features, relative to their calibration means.
        assert_eq!((i.sum.clone(), i.sum_sq.clone()), (vec![4.0, 0.0], vec![8.0, 0.0]));
        assert_eq!(d.take(), Interval::zeroed(4, 2), "taking starts a new interval");
    }

    #[test]
    fn the_window_keeps_the_newest_intervals_of_served_versions() {
        let (v1, v2) = (model(1), model(2));
        let interval = |n: u64| Interval { scores: vec![n, 0, 0, 0], ..Interval::zeroed(4, 0) };
        let mut windows = Vec::new();
        for n in 1..=5 {
            push_intervals(&mut windows, vec![(v1.clone(), interval(n)), (v2.clone(), interval(10 * n))], 3);
        }
        assert_eq!(windows.len(), 2);
        let firsts = |w: &VersionWindow| w.intervals.iter().map(|i| i.scores[0]).collect::<Vec<_>>();
        assert_eq!(firsts(&windows[0]), vec![3, 4, 5]);
        // Two shards' windows add up per version.
        let mut totals = Vec::new();
        add_window(&mut totals, &windows[0]);
        add_window(&mut totals, &windows[0]);
        add_window(&mut totals, &windows[1]);
        assert_eq!((totals[0].totals.scores[0], totals[1].totals.scores[0]), (24, 120));
        // A version no longer served loses its window.
        push_intervals(&mut windows, vec![(v2.clone(), interval(60))], 3);
        assert_eq!(windows.len(), 1);
        assert_eq!(firsts(&windows[0]), vec![40, 50, 60]);
    }

    #[test]
    fn reports_wait_for_min_count_then_measure() {
        let m = model(1);
        let config = DriftConfig { min_count: 100, context_features_max: 3, ..DriftConfig::default() };
        let mut d = DriftCounts::new(m.calibration.as_ref().unwrap(), config.context_features_max);
        let like_calibration = [0.1, 0.4, 0.6, 0.9];
        for _ in 0..20 {
            d.record_scores(&like_calibration);
            // Feature 0 at its calibration mean ± σ, feature 1 moved off a
            // constant, feature 2 three standard deviations up.
            d.record_context([3.0, -1.0, 8.0].into_iter(), 1);
            d.record_context([-1.0, -1.0, 8.0].into_iter(), 1);
        }
        let mut windows = Vec::new();
        push_intervals(&mut windows, vec![(m.clone(), d.take())], 60);
        let mut totals = Vec::new();
        add_window(&mut totals, &windows[0]);
        let r = DriftReport::new(&totals[0], &config);
        assert_eq!((r.scores, r.psi, r.context_rows, r.features.len()), (80, None, 40, 0), "below min_count");
        for _ in 0..30 {
            d.record_scores(&like_calibration);
            d.record_context([3.0, -1.0, 8.0].into_iter(), 1);
            d.record_context([-1.0, -1.0, 8.0].into_iter(), 1);
        }
        push_intervals(&mut windows, vec![(m.clone(), d.take())], 60);
        let mut totals = Vec::new();
        add_window(&mut totals, &windows[0]);
        let r = DriftReport::new(&totals[0], &config);
        assert_eq!((r.psi, r.alert), (Some(0.0), false));
        let f = &r.features;
        assert_eq!((f[0].mean, f[0].variance, f[0].mean_shift), (1.0, 4.0, 0.0));
        assert_eq!((f[1].mean, f[1].variance, f[1].mean_shift), (-1.0, 0.0, 1.0 / STDDEV_FLOOR));
        assert_eq!((f[2].mean, f[2].calibration_variance, f[2].mean_shift), (8.0, 1.0, 3.0));
        // Every score in the top bin: far past the alert threshold.
        d.record_scores(&[0.9; 200]);
        push_intervals(&mut windows, vec![(m.clone(), d.take())], 1);
        let mut totals = Vec::new();
        add_window(&mut totals, &windows[0]);
        let r = DriftReport::new(&totals[0], &config);
        assert!(r.alert && r.psi.unwrap() > 2.0, "{r:?}");
    }

    #[test]
    fn config_bounds() {
        assert!(DriftConfig::default().validate().is_ok());
        assert_eq!(DriftConfig::default().window_intervals(std::time::Duration::from_secs(1)), 60);
        let bad = DriftConfig { window_s: 0, ..DriftConfig::default() };
        assert!(bad.validate().unwrap_err().contains("window_s = 0"));
        let bad = DriftConfig { psi_alert: f64::NAN, ..DriftConfig::default() };
        assert!(bad.validate().is_err());
    }
}
