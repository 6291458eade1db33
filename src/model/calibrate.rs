//! Calibration: runs the f32 model over a calibration set to choose the
//! static activation ranges of the INT8 (and FP8) paths, and records the set's
//! score histogram in the model file.
//!
//! Why static ranges: with one scale per layer fixed ahead of time, a hidden
//! layer's int32 accumulators are requantized straight to int8 for the next
//! layer, with no per-row max and no float activations in between.
//!
//! Method, per layer and per tensor (all rows, all columns of that layer's
//! input): the range `r` is the maximum |activation| (`max-abs`) or the
//! `p`-th percentile of |activation| (`percentile:p`), read from a 4096-bin
//! histogram over `[0, max]` filled in a second pass, taking the upper edge of
//! the bin where the cumulative count reaches `p`% (so `r` never undershoots
//! the percentile by more than `max / 4096`, and never exceeds `max`). Values
//! beyond `r` saturate. The default is `max-abs`: on the CTR fixture a
//! percentile clips hidden activations that held-out rows do reach, and
//! raises the largest score error (docs/MODELS.md, "Calibration").
//!
//! The mean and variance of each per-request input over the set are stored
//! too (`input_moments`: the context, the request-scope groups, then the candidate-scope groups), as the
//! baseline input drift is measured against.
//!
//! The calibration set is a `.npy` file (`read_npy`): little-endian f32, C
//! order, two dimensions, rows of the model's input vector.

use std::io::Read as _;
use std::path::Path;

use super::{round_clamp_i8, sigmoid, ActivationScales, Calibration, Model, OutputKind, ScoreHistogram};

/// Bins of the score histogram stored in the model file.
pub const SCORE_BINS: usize = 20;
/// Bins of the |activation| histogram a percentile is read from.
const RANGE_BINS: usize = 4096;
/// Largest calibration file accepted.
pub const NPY_BYTES_MAX: u64 = 4 << 30;

#[derive(Debug, thiserror::Error)]
pub enum NpyError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a .npy file ({what})")]
    Format { path: String, what: String },
    #[error("{path}: holds {descr} values; a little-endian float32 ('<f4') array is needed")]
    DType { path: String, descr: String },
    #[error("{path}: is Fortran-ordered; save it in C order (np.ascontiguousarray)")]
    FortranOrder { path: String },
    #[error("{path}: has shape {shape:?}; a 2-D array [rows, features] is needed")]
    Shape { path: String, shape: Vec<usize> },
    #[error("{path}: {rows} rows of {cols} values need {want} data bytes, the file has {have}")]
    Truncated { path: String, rows: usize, cols: usize, want: usize, have: usize },
}

/// A 2-D f32 array read from a `.npy` file.
#[derive(Clone, Debug, PartialEq)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    /// Row-major.
    pub data: Vec<f32>,
}

impl Matrix {
    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }
}

/// Reads a `.npy` file: format version 1, 2 or 3, dtype `<f4`, C order, 2-D.
pub fn read_npy(path: &Path) -> Result<Matrix, NpyError> {
    let p = path.display().to_string();
    let io = |source| NpyError::Io { path: p.clone(), source };
    let file = std::fs::File::open(path).map_err(io)?;
    let len = file.metadata().map_err(io)?.len();
    if len > NPY_BYTES_MAX {
        return Err(NpyError::Format { path: p, what: format!("{len} bytes, the limit is {NPY_BYTES_MAX}") });
    }
    let mut bytes = Vec::with_capacity(len as usize);
    file.take(NPY_BYTES_MAX).read_to_end(&mut bytes).map_err(io)?;
    parse_npy(&bytes, &p)
}

/// Parses `.npy` bytes; `path` names them in errors.
pub fn parse_npy(bytes: &[u8], path: &str) -> Result<Matrix, NpyError> {
    let format = |what: &str| NpyError::Format { path: path.into(), what: what.into() };
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err(format("no \\x93NUMPY magic"));
    }
    let (header_len, start) = match bytes[6] {
        1 => (usize::from(u16::from_le_bytes([bytes[8], bytes[9]])), 10),
        2 | 3 if bytes.len() >= 12 => (u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize, 12),
        v => return Err(format(&format!("unknown format version {v}"))),
    };
    let header = bytes.get(start..start + header_len).ok_or_else(|| format("the header is cut short"))?;
    let header = std::str::from_utf8(header).map_err(|_| format("the header is not text"))?;
    let field = |key: &str| -> Result<&str, NpyError> {
        let at = header.find(&format!("'{key}':")).ok_or_else(|| format(&format!("the header has no '{key}'")))?;
        Ok(header[at + key.len() + 3..].trim_start())
    };
    let descr = field("descr")?;
    let descr = descr.split(['\'', '"']).nth(1).unwrap_or(descr).to_string();
    if descr != "<f4" {
        return Err(NpyError::DType { path: path.into(), descr });
    }
    if field("fortran_order")?.starts_with("True") {
        return Err(NpyError::FortranOrder { path: path.into() });
    }
    let shape = field("shape")?;
    let shape = shape.strip_prefix('(').and_then(|s| s.split_once(')')).ok_or_else(|| format("bad shape"))?.0;
    let shape: Vec<usize> = shape
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().map_err(|_| format(&format!("bad shape entry '{s}'"))))
        .collect::<Result<_, _>>()?;
    let [rows, cols] = shape[..] else {
        return Err(NpyError::Shape { path: path.into(), shape });
    };
    let data = &bytes[start + header_len..];
    let want = rows.checked_mul(cols).and_then(|n| n.checked_mul(4)).ok_or_else(|| format("shape overflows"))?;
    if data.len() != want {
        return Err(NpyError::Truncated { path: path.into(), rows, cols, want, have: data.len() });
    }
    let data = data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    Ok(Matrix { rows, cols, data })
}

/// Writes a `.npy` file (version 1, `<f4`, C order); for tests and tools.
pub fn npy_bytes(m: &Matrix) -> Vec<u8> {
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': ({}, {}), }}", m.rows, m.cols);
    // The data starts on a 64-byte boundary, as numpy writes it.
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend(m.data.iter().flat_map(|v| v.to_le_bytes()));
    out
}

/// How a layer's activation range is chosen.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum Method {
    #[default]
    MaxAbs,
    /// The percentile of |activation|, in (0, 100].
    Percentile(f64),
    /// The range that minimises the INT8 quantization error (rounding
    /// inside the range, clipping beyond it) of the layer's input over the
    /// set, estimated from its |activation| histogram.
    Mse,
}

impl Method {
    pub fn name(self) -> String {
        match self {
            Method::MaxAbs => "max-abs".into(),
            Method::Percentile(p) => format!("percentile:{p}"),
            Method::Mse => "mse".into(),
        }
    }
}

impl std::str::FromStr for Method {
    type Err = String;

    fn from_str(s: &str) -> Result<Method, String> {
        if s == "max-abs" {
            return Ok(Method::MaxAbs);
        }
        if s == "mse" {
            return Ok(Method::Mse);
        }
        let p = s.strip_prefix("percentile:").and_then(|p| p.parse::<f64>().ok());
        match p {
            Some(p) if p > 0.0 && p <= 100.0 => Ok(Method::Percentile(p)),
            _ => Err(format!("'{s}': use max-abs, mse or percentile:P with 0 < P <= 100, e.g. percentile:99.99")),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CalibrationError {
    #[error(transparent)]
    Npy(#[from] NpyError),
    #[error("the calibration set has {cols} columns; the model's input vector has {want}")]
    Width { cols: usize, want: usize },
    #[error("the calibration set has no rows")]
    Empty,
    #[error("calibration row {row}, column {col} is {value}; every value must be finite (NaN, a missing value, only for graph and tree models)")]
    NonFinite { row: usize, col: usize, value: f32 },
    #[error("layer {layer}'s input is zero on every calibration row; no activation range can be chosen")]
    Degenerate { layer: usize },
    #[error(
        "the model's output is a raw value, not a probability; calibration (a score histogram) needs a logit output"
    )]
    RawOutput,
}

/// Runs every layer of the f32 model over one row, calling `visit(i, input)`
/// with each layer's input; returns the logit.
fn forward_visiting(
    model: &Model,
    x: &[f32],
    act: &mut Vec<f32>,
    next: &mut Vec<f32>,
    mut visit: impl FnMut(usize, &[f32]),
) -> f32 {
    act.clear();
    act.extend_from_slice(x);
    for (i, l) in model.layers.iter().enumerate() {
        visit(i, act);
        next.clear();
        next.extend((0..l.out_dim).map(|o| {
            let w = &l.weights_f32[o * l.in_dim..(o + 1) * l.in_dim];
            let y = w.iter().zip(act.iter()).map(|(a, b)| a * b).sum::<f32>() + l.bias[o];
            if l.relu {
                y.max(0.0)
            } else {
                y
            }
        }));
        std::mem::swap(act, next);
    }
    act[0]
}

/// Calibrates `model` on `set` (rows of its input vector). `progress(done,
/// total)` is called now and then over the two passes (`total` = 2 · rows).
pub fn calibrate(
    model: &Model,
    set: &Matrix,
    method: Method,
    mut progress: impl FnMut(usize, usize),
) -> Result<Calibration, CalibrationError> {
    if set.cols != model.input_dim() {
        return Err(CalibrationError::Width { cols: set.cols, want: model.input_dim() });
    }
    if set.rows == 0 {
        return Err(CalibrationError::Empty);
    }
    // NaN is a missing value, as in requests and replicas, for a graph
    // model (which reads it as 0, or as missing in its trees); the v1 MLP's
    // static ranges need every value.
    let bad = |v: &f32| v.is_infinite() || (v.is_nan() && model.graph.is_none());
    if let Some(i) = set.data.iter().position(bad) {
        return Err(CalibrationError::NonFinite { row: i / set.cols, col: i % set.cols, value: set.data[i] });
    }
    if model.output_kind() == OutputKind::Raw {
        return Err(CalibrationError::RawOutput);
    }
    if model.graph.is_some() {
        return Ok(calibrate_graph(model, set, progress));
    }
    let layers = model.layers.len();
    let total = 2 * set.rows;
    let step = (set.rows / 100).max(1);
    let (mut act, mut next) = (Vec::new(), Vec::new());
    let mut max_abs = vec![0.0f32; layers];
    let mut scores = Vec::with_capacity(set.rows);
    for r in 0..set.rows {
        let logit = forward_visiting(model, set.row(r), &mut act, &mut next, |i, input| {
            max_abs[i] = input.iter().fold(max_abs[i], |m, v| m.max(v.abs()));
        });
        scores.push(sigmoid(logit));
        if r % step == 0 {
            progress(r, total);
        }
    }
    if let Some(layer) = max_abs.iter().position(|m| *m <= 0.0) {
        return Err(CalibrationError::Degenerate { layer });
    }
    let input_ranges = match method {
        Method::MaxAbs => max_abs.clone(),
        Method::Percentile(_) | Method::Mse => {
            let mut hist = vec![vec![0u64; RANGE_BINS]; layers];
            for r in 0..set.rows {
                forward_visiting(model, set.row(r), &mut act, &mut next, |i, input| {
                    let per_bin = RANGE_BINS as f32 / max_abs[i];
                    for v in input {
                        let b = ((v.abs() * per_bin) as usize).min(RANGE_BINS - 1);
                        hist[i][b] += 1;
                    }
                });
                if r % step == 0 {
                    progress(set.rows + r, total);
                }
            }
            hist.iter()
                .zip(&max_abs)
                .map(|(h, &m)| {
                    let Method::Percentile(p) = method else { return mse_range(h, m) };
                    let n: u64 = h.iter().sum();
                    let target = ((p / 100.0) * n as f64).ceil() as u64;
                    let mut seen = 0;
                    let bin = h.iter().position(|c| {
                        seen += c;
                        seen >= target.max(1)
                    });
                    let edge = (bin.unwrap_or(RANGE_BINS - 1) + 1) as f32 * (m / RANGE_BINS as f32);
                    edge.min(m)
                })
                .collect()
        }
    };
    progress(total, total);
    let (input_means, input_variances) = input_moments(model, set);
    Ok(Calibration {
        method: method.name(),
        rows: set.rows as u64,
        input_ranges,
        scores: score_histogram(&scores),
        input_means,
        input_variances,
        activations: ActivationScales::Static,
        static_error: None,
        dynamic_error: None,
    })
}

/// Per layer of a plain MLP, the median over `set`'s rows of the row's
/// largest |input|: what a dynamic (per-row) INT8 scale covers for a typical
/// row, to set beside the static range, which must cover every row. Empty
/// for a graph model.
pub fn median_row_ranges(model: &Model, set: &Matrix) -> Vec<f32> {
    if model.graph.is_some() || set.cols != model.input_dim() {
        return Vec::new();
    }
    let (mut act, mut next) = (Vec::new(), Vec::new());
    let mut per_layer: Vec<Vec<f32>> = vec![Vec::with_capacity(set.rows); model.layers.len()];
    for r in 0..set.rows {
        forward_visiting(model, set.row(r), &mut act, &mut next, |i, input| {
            per_layer[i].push(input.iter().fold(0.0f32, |m, v| m.max(v.abs())));
        });
    }
    per_layer
        .into_iter()
        .map(|mut v| {
            v.sort_by(f32::total_cmp);
            v.get(v.len() / 2).copied().unwrap_or(0.0)
        })
        .collect()
}

/// Rows of the set that [`input_quantization_errors`] reads, at most: the
/// first ones, enough for a stable figure at a bounded cost.
const LAYER_ERROR_ROWS_MAX: usize = 4096;

/// How much a layer's pre-activation output moves when only its input is
/// quantized to INT8, the rest in f32: relative RMS error over the rows,
/// `sqrt(Σ |W(x̂ − x)|² / Σ |Wx + b|²)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerError {
    /// `x̂` on the layer's calibrated (static) step.
    pub static_rel: f32,
    /// `x̂` on each row's own step (dynamic).
    pub dynamic_rel: f32,
}

/// Per layer of a calibrated plain MLP, what quantizing its input costs on
/// its output, static against dynamic, over (the first rows of) `set`, with
/// every layer's input taken from the f32 forward pass, so each figure is
/// that layer's alone. Empty for a graph model or an uncalibrated one. It
/// says which layer a static scale hurts, where the score errors only say
/// that one does.
pub fn input_quantization_errors(model: &Model, set: &Matrix) -> Vec<LayerError> {
    let Some(c) = model.calibration.as_ref() else { return Vec::new() };
    if model.graph.is_some() || set.cols != model.input_dim() || c.input_ranges.len() != model.layers.len() {
        return Vec::new();
    }
    let quantized = |x: &[f32], step: f32, out: &mut Vec<f32>| {
        out.clear();
        out.extend(x.iter().map(|v| if step > 0.0 { f32::from(round_clamp_i8(v / step, -127)) * step } else { 0.0 }));
    };
    let n = model.layers.len();
    let (mut err_static, mut err_dynamic, mut norm) = (vec![0.0f64; n], vec![0.0f64; n], vec![0.0f64; n]);
    let (mut act, mut next, mut xs, mut xd) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for r in 0..set.rows.min(LAYER_ERROR_ROWS_MAX) {
        forward_visiting(model, set.row(r), &mut act, &mut next, |i, x| {
            let l = &model.layers[i];
            quantized(x, c.input_ranges[i] / 127.0, &mut xs);
            quantized(x, x.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0, &mut xd);
            for o in 0..l.out_dim {
                let w = &l.weights_f32[o * l.in_dim..(o + 1) * l.in_dim];
                let (mut y, mut ds, mut dd) = (f64::from(l.bias[o]), 0.0f64, 0.0f64);
                for k in 0..l.in_dim {
                    let wk = f64::from(w[k]);
                    y += wk * f64::from(x[k]);
                    ds += wk * f64::from(xs[k] - x[k]);
                    dd += wk * f64::from(xd[k] - x[k]);
                }
                norm[i] += y * y;
                err_static[i] += ds * ds;
                err_dynamic[i] += dd * dd;
            }
        });
    }
    let rel = |e: f64, n: f64| if n > 0.0 { (e / n).sqrt() as f32 } else { 0.0 };
    (0..n)
        .map(|i| LayerError { static_rel: rel(err_static[i], norm[i]), dynamic_rel: rel(err_dynamic[i], norm[i]) })
        .collect()
}

/// A graph model's calibration: the score histogram and context moments,
/// the drift baselines; its INT8 path stays dynamic (no static ranges).
fn calibrate_graph(model: &Model, set: &Matrix, mut progress: impl FnMut(usize, usize)) -> Calibration {
    let step = (set.rows / 100).max(1);
    let mut scores = Vec::with_capacity(set.rows);
    let mut out = [0.0f32];
    for r in 0..set.rows {
        model.forward_f32_reference(set.row(r), 1, &mut out);
        scores.push(sigmoid(out[0]));
        if r % step == 0 {
            progress(r, set.rows);
        }
    }
    progress(set.rows, set.rows);
    drift_baselines(model, set, &scores, "none (graph model: dynamic INT8)")
}

/// The calibration of a model served only through onnxruntime: the drift
/// baselines (score histogram, context moments) from `scores`, the set's
/// scores as onnxruntime computed them; no INT8 ranges.
pub fn calibrate_from_scores(model: &Model, set: &Matrix, scores: &[f32]) -> Result<Calibration, CalibrationError> {
    if set.cols != model.input_dim() {
        return Err(CalibrationError::Width { cols: set.cols, want: model.input_dim() });
    }
    if set.rows == 0 {
        return Err(CalibrationError::Empty);
    }
    assert_eq!(scores.len(), set.rows, "one score per row");
    if let Some(i) = set.data.iter().position(|v| v.is_infinite()) {
        return Err(CalibrationError::NonFinite { row: i / set.cols, col: i % set.cols, value: set.data[i] });
    }
    if !scores.iter().all(|s| (0.0..=1.0).contains(s)) {
        return Err(CalibrationError::RawOutput);
    }
    Ok(drift_baselines(model, set, scores, "none (onnxruntime: drift baselines only)"))
}

fn drift_baselines(model: &Model, set: &Matrix, scores: &[f32], method: &str) -> Calibration {
    let (input_means, input_variances) = input_moments(model, set);
    Calibration {
        method: method.into(),
        rows: set.rows as u64,
        input_ranges: Vec::new(),
        scores: score_histogram(scores),
        input_means,
        input_variances,
        activations: ActivationScales::Dynamic,
        static_error: None,
        dynamic_error: None,
    }
}

/// The range among 1/16 to 16/16 of `max` (in 256 steps) that minimises
/// the estimated squared INT8 error over histogram `h` of |activation| on
/// `[0, max]`: `s² / 12` for a value inside the range (rounding, with
/// `s = r / 127`), `(v − r)²` beyond it (clipping).
fn mse_range(h: &[u64], max: f32) -> f32 {
    let bin = f64::from(max) / h.len() as f64;
    let mut best = (f64::INFINITY, max);
    for k in 16..=256 {
        let r = f64::from(max) * k as f64 / 256.0;
        let s = r / 127.0;
        let err: f64 = h
            .iter()
            .enumerate()
            .filter(|(_, c)| **c > 0)
            .map(|(b, &c)| {
                let v = (b as f64 + 0.5) * bin;
                let e = if v <= r { s * s / 12.0 } else { (v - r) * (v - r) };
                c as f64 * e
            })
            .sum();
        if err < best.0 {
            best = (err, r as f32);
        }
    }
    best.1
}

/// The mean and population variance of each input column drift follows in
/// `set` (`Model::drift_columns`: the context, then the request-scope
/// groups, then the candidate-scope groups; empty when the model reads
/// none), the baseline of input
/// drift. Computed in f64 with each column shifted by its first value, so a
/// large common offset does not cancel the variance away.
pub fn input_moments(model: &Model, set: &Matrix) -> (Vec<f32>, Vec<f32>) {
    let columns: Vec<usize> = model.drift_columns().iter().flat_map(|&(at, dim)| at..at + dim).collect();
    if columns.is_empty() || set.rows == 0 {
        return (Vec::new(), Vec::new());
    }
    let dim = columns.len();
    // Missing values (NaN) are left out of a column's moments; live
    // traffic counts them at the mean (`drift::DriftCounts::record_context`).
    let shift: Vec<f64> = columns
        .iter()
        .map(|&c| (0..set.rows).map(|r| set.row(r)[c]).find(|v| !v.is_nan()).map_or(0.0, f64::from))
        .collect();
    let (mut sum, mut sum_sq, mut count) = (vec![0.0f64; dim], vec![0.0f64; dim], vec![0u64; dim]);
    for r in 0..set.rows {
        let row = set.row(r);
        for (j, v) in columns.iter().map(|&c| row[c]).enumerate() {
            if v.is_nan() {
                continue;
            }
            let d = f64::from(v) - shift[j];
            sum[j] += d;
            sum_sq[j] += d * d;
            count[j] += 1;
        }
    }
    let n = |j: usize| count[j].max(1) as f64;
    let means = (0..dim).map(|j| (shift[j] + sum[j] / n(j)) as f32).collect();
    let variances = (0..dim).map(|j| (sum_sq[j] / n(j) - (sum[j] / n(j)).powi(2)).max(0.0) as f32).collect();
    (means, variances)
}

/// `SCORE_BINS` bins with (about) equal counts on these scores, the edges
/// clamped to [0, 1] and deduplicated, so that a drift measure compares live
/// traffic with bins the calibration set fills evenly.
pub fn score_histogram(scores: &[f32]) -> ScoreHistogram {
    let mut sorted: Vec<f32> = scores.iter().copied().filter(|s| s.is_finite()).collect();
    sorted.sort_by(f32::total_cmp);
    let mut edges = vec![0.0f32];
    for i in 1..SCORE_BINS {
        if let Some(&e) = sorted.get(i * sorted.len() / SCORE_BINS) {
            if e > *edges.last().expect("starts with 0") && e < 1.0 {
                edges.push(e);
            }
        }
    }
    edges.push(1.0);
    let mut counts = vec![0u64; edges.len() - 1];
    for s in &sorted {
        let bin = edges[1..edges.len() - 1].partition_point(|e| e <= s);
        counts[bin] += 1;
    }
    ScoreHistogram { edges, counts }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{InputSegment, Layer, Source};

    fn model() -> Model {
        // Layer 0 copies the input's two columns (and their negatives through
        // the ReLU), so the second layer's input range is the input's.
        Model {
            name: "c".into(),
            version: 1,
            inputs: vec![InputSegment { source: Source::Context, dim: 2 }],
            layers: vec![
                Layer::quantize(2, 2, true, vec![1.0, 0.0, 0.0, 1.0], vec![0.0, 0.0]),
                Layer::quantize(2, 1, false, vec![1.0, -1.0], vec![0.0]),
            ],
            calibration: None,
            graph: None,
            onnx: None,
            feature_names: Vec::new(),
        }
    }

    fn set(values: &[f32]) -> Matrix {
        Matrix { rows: values.len() / 2, cols: 2, data: values.to_vec() }
    }

    #[test]
    fn npy_round_trip_and_refusals() {
        let m = Matrix { rows: 3, cols: 2, data: vec![1.0, -2.0, 3.5, 0.0, f32::MIN_POSITIVE, 7.0] };
        let bytes = npy_bytes(&m);
        assert_eq!((bytes.len() - 24) % 64, 0, "data is 64-byte aligned");
        assert_eq!(parse_npy(&bytes, "a.npy").unwrap(), m);
        let err = |b: &[u8]| parse_npy(b, "a.npy").unwrap_err().to_string();
        assert!(err(b"PK\x03\x04 zip").contains("a.npy: not a .npy file (no \\x93NUMPY magic)"));
        // Same-length edits of the header text.
        let swap = |from: &str, to: &str| {
            assert_eq!(from.len(), to.len());
            let mut b = bytes.clone();
            let at = b.windows(from.len()).position(|w| w == from.as_bytes()).unwrap();
            b[at..at + to.len()].copy_from_slice(to.as_bytes());
            b
        };
        assert!(err(&swap("'<f4'", "'<f8'")).contains("holds <f8 values"));
        assert!(err(&swap("False", "True ")).contains("Fortran-ordered"));
        assert!(err(&swap("(3, 2)", "(6,)  ")).contains("has shape [6]"));
        assert!(err(&bytes[..bytes.len() - 1]).contains("need 24 data bytes, the file has 23"));
        assert!(err(&bytes[..20]).contains("header is cut short"));
    }

    #[test]
    fn reads_a_file_numpy_wrote() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/onnx/calibration.npy");
        let m = read_npy(&path).unwrap();
        assert_eq!(m.cols, 20);
        assert!(m.rows >= 1000 && m.data.iter().all(|v| v.is_finite()));
        let missing = read_npy(Path::new("/nonexistent/calib.npy")).unwrap_err();
        assert!(matches!(missing, NpyError::Io { .. }), "{missing}");
    }

    #[test]
    fn max_abs_and_percentile_ranges() {
        let mut values: Vec<f32> = (0..1000).flat_map(|i| [i as f32 / 1000.0, -(i as f32) / 2000.0]).collect();
        values[0] = 100.0; // one outlier
        let c = calibrate(&model(), &set(&values), Method::MaxAbs, |_, _| {}).unwrap();
        assert_eq!(c.input_ranges, vec![100.0, 100.0]);
        assert_eq!((c.method.as_str(), c.rows), ("max-abs", 1000));
        let c = calibrate(&model(), &set(&values), Method::Percentile(99.0), |_, _| {}).unwrap();
        // 99% of the 2000 |values| are at most 0.99; a bin is 100 / 4096 wide.
        for r in &c.input_ranges {
            assert!(*r >= 0.99 && *r <= 0.99 + 100.0 / 4096.0 + 1e-4, "{r}");
        }
        let mut calls = 0;
        let c = calibrate(&model(), &set(&values), Method::Percentile(100.0), |d, t| {
            calls += 1;
            assert!(d <= t && t == 2000);
        })
        .unwrap();
        assert_eq!(c.input_ranges[0], 100.0);
        assert!(calls > 10);
        // Both columns are context inputs: their moments are stored.
        let c = calibrate(&model(), &set(&[1.0, 10.0, 3.0, 10.0]), Method::MaxAbs, |_, _| {}).unwrap();
        assert_eq!((c.input_means, c.input_variances), (vec![2.0, 10.0], vec![1.0, 0.0]));
    }

    #[test]
    fn a_layer_whose_static_range_an_outlier_set_loses_more_than_dynamic() {
        // Rows of small values and one outlier row: max-abs makes the static
        // step a hundred times a typical row's, so static costs more on
        // every layer; the outlier row itself is exact either way.
        let mut values: Vec<f32> = (0..400).flat_map(|i| [0.3 + i as f32 / 997.0, 0.2 - i as f32 / 1511.0]).collect();
        values[0] = 100.0;
        let mut m = model();
        let set = set(&values);
        assert!(input_quantization_errors(&m, &set).is_empty(), "uncalibrated");
        m.calibration = Some(calibrate(&m, &set, Method::MaxAbs, |_, _| {}).unwrap());
        let e = input_quantization_errors(&m, &set);
        assert_eq!(e.len(), 2);
        for l in &e {
            assert!(l.static_rel > 10.0 * l.dynamic_rel && l.dynamic_rel > 0.0, "{e:?}");
            assert!(l.static_rel < 1.0, "{e:?}");
        }
        // Ranges that are each row's own: static and dynamic agree.
        let same = Matrix { rows: 1, cols: 2, data: vec![0.7, -0.35] };
        m.calibration = Some(calibrate(&m, &same, Method::MaxAbs, |_, _| {}).unwrap());
        for l in input_quantization_errors(&m, &same) {
            assert!((l.static_rel - l.dynamic_rel).abs() < 1e-7, "{l:?}");
        }
    }

    #[test]
    fn the_mse_range_trades_rounding_against_clipping() {
        // Nearly all mass below 1 and one value at 10: the range clips the
        // tail (its squared error is cheaper than a scale ten times coarser
        // for every value) but keeps the bulk.
        let mut h = vec![0u64; RANGE_BINS];
        for (b, c) in h.iter_mut().enumerate().take(RANGE_BINS / 10) {
            *c = 1000 + b as u64 % 7;
        }
        h[RANGE_BINS - 1] = 1;
        let r = mse_range(&h, 10.0);
        assert!(r > 1.0 && r < 5.0, "{r}");
        // Mass spread evenly up to the max: no clipping pays.
        let flat = vec![100u64; RANGE_BINS];
        let r = mse_range(&flat, 10.0);
        assert!(r > 9.0, "{r}");
        assert_eq!("mse".parse::<Method>().unwrap(), Method::Mse);
    }

    #[test]
    fn input_moments_cover_the_context_then_the_request_scope_groups() {
        let mut m = model();
        m.inputs =
            vec![InputSegment { source: Source::User, dim: 1 }, InputSegment { source: Source::Context, dim: 1 }];
        // A large common offset must not cancel the variance away; the
        // context comes first, then the user group.
        let values: Vec<f32> = (0..1000).flat_map(|i| [i as f32, 1e6 + (i % 2) as f32]).collect();
        let (means, variances) = input_moments(&m, &set(&values));
        assert_eq!(means, vec![1e6 + 0.5, 499.5]);
        assert!((variances[0] - 0.25).abs() < 1e-6, "{variances:?}");
        assert!((variances[1] - 83_333.25).abs() < 1.0, "{variances:?}");
        // Candidate-scope columns come after the per-request ones.
        m.inputs[1].source = Source::Item;
        let (means, _) = input_moments(&m, &set(&values));
        assert_eq!(means, vec![499.5, 1e6 + 0.5]);
        m.inputs[0].source = Source::Item;
        assert_eq!(input_moments(&m, &set(&values)).0, vec![499.5, 1e6 + 0.5]);
        m.inputs.clear();
        assert_eq!(input_moments(&m, &set(&values)), (Vec::new(), Vec::new()));
        // Missing values (NaN, the first row's too) are left out.
        m.inputs =
            vec![InputSegment { source: Source::Item, dim: 1 }, InputSegment { source: Source::Context, dim: 1 }];
        let (means, variances) = input_moments(&m, &set(&[0.0, f32::NAN, 0.0, 1.0, 0.0, f32::NAN, 0.0, 3.0]));
        assert_eq!((means, variances), (vec![2.0, 0.0], vec![1.0, 0.0]));
    }

    #[test]
    fn bad_sets_are_refused() {
        let m = model();
        let e = calibrate(&m, &Matrix { rows: 1, cols: 3, data: vec![0.0; 3] }, Method::MaxAbs, |_, _| {});
        assert!(e.unwrap_err().to_string().contains("3 columns; the model's input vector has 2"));
        let e = calibrate(&m, &set(&[]), Method::MaxAbs, |_, _| {});
        assert!(matches!(e, Err(CalibrationError::Empty)));
        let e = calibrate(&m, &set(&[1.0, 2.0, f32::NAN, 0.0]), Method::MaxAbs, |_, _| {});
        assert!(e.unwrap_err().to_string().contains("row 1, column 0 is NaN"));
        let e = calibrate(&m, &set(&[0.0; 4]), Method::MaxAbs, |_, _| {});
        assert!(matches!(e, Err(CalibrationError::Degenerate { layer: 0 })));
        assert!("percentile:0".parse::<Method>().is_err() && "p99".parse::<Method>().is_err());
        assert_eq!("percentile:99.9".parse::<Method>(), Ok(Method::Percentile(99.9)));
    }

    #[test]
    fn the_score_histogram_has_equal_count_bins_from_0_to_1() {
        let scores: Vec<f32> = (0..1000).map(|i| i as f32 / 1000.0).collect();
        let h = score_histogram(&scores);
        assert_eq!(h.edges.len(), SCORE_BINS + 1);
        assert_eq!((h.edges[0], h.edges[SCORE_BINS]), (0.0, 1.0));
        assert!(h.counts.iter().all(|&c| c == 50), "{:?}", h.counts);
        // Ties collapse bins instead of making empty or unordered ones.
        let h = score_histogram(&[0.5; 100]);
        assert_eq!((h.edges.clone(), h.counts.clone()), (vec![0.0, 0.5, 1.0], vec![0, 100]));
        assert_eq!(score_histogram(&[1.0, 0.0]).counts.iter().sum::<u64>(), 2);
    }
}
