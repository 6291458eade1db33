//! How far a quantized backend's scores are from the f32 oracle's on a set
//! of input rows, and the choice `quiver import --calibration` makes with
//! it: a calibrated model runs static INT8 (one scale per layer) only where
//! that measured at least as accurate as dynamic per-row INT8 on the
//! calibration set, in both the largest and the mean score error. Static
//! scales are the faster path, but one scale per layer for raw features
//! that differ in spread (or a layer whose activations vary a lot from row
//! to row) can cost more accuracy than per-row scales do; the measurement,
//! not a rule, decides.

use super::{build, BackendError, BackendKind};
use crate::model::calibrate::{CalibrationError, Matrix};
use crate::model::{ActivationScales, MeasuredError, Model, ModelError};

/// Why a model could not be calibrated on a set: the set does not fit the
/// model, the calibrated model fails its own checks, or (for a model kept
/// for onnxruntime) the library that scores the set is missing.
#[derive(Debug, thiserror::Error)]
pub enum CalibrateError {
    #[error(transparent)]
    Calibration(#[from] CalibrationError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("calibration scores need onnxruntime: {0}")]
    Onnxruntime(#[source] BackendError),
}

/// Max and mean |score(kind) − score(f32)| over the rows of `set`, for a
/// native model (one the CPU backends run).
pub fn score_error(model: &Model, set: &Matrix, kind: BackendKind) -> MeasuredError {
    assert!(model.is_native(), "onnxruntime-only models are measured by calibrate_onnxruntime");
    const CHUNK: usize = 256;
    assert_eq!(set.cols, model.input_dim(), "rows of the model's input vector");
    // Backends own their model: a copy, once per measurement at import.
    let shared = std::sync::Arc::new(model.clone());
    let mut oracle = build(BackendKind::F32, &shared, CHUNK);
    let mut quantized = build(kind, &shared, CHUNK);
    let (mut max, mut sum) = (0.0f32, 0.0f64);
    let (mut a, mut b) = (vec![0.0; CHUNK], vec![0.0; CHUNK]);
    for x in set.data.chunks(CHUNK * set.cols) {
        let rows = x.len() / set.cols;
        oracle.score(x, rows, &mut a[..rows]).expect("a native model's backends cannot fail");
        quantized.score(x, rows, &mut b[..rows]).expect("a native model's backends cannot fail");
        for (p, q) in a[..rows].iter().zip(&b[..rows]) {
            let d = (model.score(*p) - model.score(*q)).abs();
            max = max.max(d);
            sum += f64::from(d);
        }
    }
    MeasuredError { max, mean: (sum / set.rows.max(1) as f64) as f32 }
}

/// Measures static and dynamic INT8 on `set` for a calibrated model and
/// records the errors and the choice in its calibration. A graph model has
/// no static path: only dynamic is measured, and chosen.
pub fn choose_int8_activations(model: &mut Model, set: &Matrix) {
    assert!(model.calibration.is_some(), "called on a calibrated model");
    let with = |model: &mut Model, a: ActivationScales| {
        model.calibration.as_mut().expect("checked above").activations = a;
    };
    with(model, ActivationScales::Dynamic);
    let dynamic = score_error(model, set, BackendKind::Int8);
    let fixed = if model.graph.is_none() {
        with(model, ActivationScales::Static);
        Some(score_error(model, set, BackendKind::Int8))
    } else {
        None
    };
    let choice = match fixed {
        Some(s) if s.max <= dynamic.max && s.mean <= dynamic.mean => ActivationScales::Static,
        _ => ActivationScales::Dynamic,
    };
    let c = model.calibration.as_mut().expect("checked above");
    c.activations = choice;
    c.static_error = fixed;
    c.dynamic_error = Some(dynamic);
}

/// `quiver import --calibration`: calibrates `model` on `set` by `method`
/// (`progress` hears rows done of total), measures static against dynamic
/// INT8 and records the choice (`choose_int8_activations`), checks the
/// result, and returns the import summary's lines: the ranges, both
/// errors, what was chosen, each layer's static step against a typical
/// row's dynamic one, and with `also_fp8` FP8's error on the set.
pub fn calibrate(
    model: &mut Model,
    set: &Matrix,
    method: crate::model::calibrate::Method,
    also_fp8: bool,
    progress: impl FnMut(usize, usize),
) -> Result<String, CalibrateError> {
    if !model.is_native() {
        return calibrate_onnxruntime(model, set);
    }
    let calibration = crate::model::calibrate::calibrate(model, set, method, progress)?;
    let ranges: Vec<String> = calibration.input_ranges.iter().map(|r| format!("{r:.4}")).collect();
    let bins = calibration.scores.counts.len();
    model.calibration = Some(calibration);
    choose_int8_activations(model, set);
    model.validate()?;
    let c = model.calibration.as_ref().expect("set above");
    let measured = |e: Option<MeasuredError>| {
        e.map_or("not measured (no static path for graph models)".to_string(), |e| {
            format!("max |score diff| {:.5}, mean {:.5}", e.max, e.mean)
        })
    };
    let chosen = match c.activations {
        ActivationScales::Static => "static (one calibrated scale per layer)",
        ActivationScales::Dynamic => "dynamic (per-row scales)",
    };
    let mut report = format!(
        "  calibration: {} rows, {}; activation ranges per layer: {}\n  score histogram: {bins} bins\n  \
         int8 vs f32 on the calibration set: static {}; dynamic {}\n  int8 activations: {chosen}",
        set.rows,
        c.method,
        if ranges.is_empty() { "none".to_string() } else { ranges.join(", ") },
        measured(c.static_error),
        measured(c.dynamic_error),
    );
    let typical = crate::model::calibrate::median_row_ranges(model, set);
    let errors = crate::model::calibrate::input_quantization_errors(model, set);
    let short = match c.activations {
        ActivationScales::Static => "static",
        ActivationScales::Dynamic => "dynamic",
    };
    for (i, ((r, m), e)) in c.input_ranges.iter().zip(&typical).zip(&errors).enumerate() {
        let coarser = if *m > 0.0 { format!("{:.2}x", r / m) } else { "n/a".into() };
        report.push_str(&format!(
            "\n  layer {i}: runs {short}; static range {r:.4}; median row range {m:.4}: the static step is {coarser} \
             a typical row's dynamic step; its input quantized moves its output by {:.3}% static, {:.3}% dynamic \
             (relative RMS)",
            100.0 * e.static_rel,
            100.0 * e.dynamic_rel
        ));
    }
    if also_fp8 {
        let e = score_error(model, set, BackendKind::Fp8);
        report.push_str(&format!(
            "\n  fp8 vs f32 on the calibration set: max |score diff| {:.5}, mean {:.5}",
            e.max, e.mean
        ));
    }
    Ok(report)
}

/// The drift baselines of a model served only through onnxruntime, from
/// the calibration set's scores as onnxruntime computes them (so importing
/// one with `--calibration` needs the library, like serving it).
fn calibrate_onnxruntime(model: &mut Model, set: &Matrix) -> Result<String, CalibrateError> {
    const ROWS_PER_CALL: usize = 256;
    let mut backend = super::build(BackendKind::Int8, &std::sync::Arc::new(model.clone()), ROWS_PER_CALL);
    let dim = model.input_dim();
    if set.cols != dim {
        return Err(CalibrationError::Width { cols: set.cols, want: dim }.into());
    }
    let mut scores = vec![0.0; set.rows];
    for (x, out) in set.data.chunks(ROWS_PER_CALL * dim).zip(scores.chunks_mut(ROWS_PER_CALL)) {
        backend.score(x, out.len(), out).map_err(CalibrateError::Onnxruntime)?;
        for s in out.iter_mut() {
            *s = model.score(*s);
        }
    }
    let calibration = crate::model::calibrate::calibrate_from_scores(model, set, &scores)?;
    let bins = calibration.scores.counts.len();
    model.calibration = Some(calibration);
    model.validate()?;
    Ok(format!(
        "  calibration: {} rows scored by onnxruntime; score histogram: {bins} bins (drift baselines; no INT8 \
         ranges: onnxruntime runs the graph in f32)",
        set.rows
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::calibrate::{calibrate, Method};

    #[test]
    fn the_choice_follows_the_measured_errors() {
        for seed in [3u64, 4, 5] {
            let mut model = crate::loadgen::demo::context_mlp("choice", seed, &[12, 24, 8, 1]);
            let mut rng = crate::loadgen::demo::SplitMix64::new(seed + 100);
            // Rows of similar spread, where one scale per layer loses little.
            let data: Vec<f32> = (0..512 * 12).map(|_| rng.normal().clamp(-2.0, 2.0)).collect();
            let set = Matrix { rows: 512, cols: 12, data };
            model.calibration = Some(calibrate(&model, &set, Method::MaxAbs, |_, _| {}).unwrap());
            choose_int8_activations(&mut model, &set);
            model.validate().unwrap();
            let c = model.calibration.clone().unwrap();
            let (s, d) = (c.static_error.unwrap(), c.dynamic_error.unwrap());
            let want =
                if s.max <= d.max && s.mean <= d.mean { ActivationScales::Static } else { ActivationScales::Dynamic };
            assert_eq!(c.activations, want, "{s:?} {d:?}");
            // The recorded figures are what the chosen semantics score.
            let chosen = score_error(&model, &set, BackendKind::Int8);
            assert_eq!(chosen, if want == ActivationScales::Static { s } else { d });
            assert_eq!(model.static_int8().is_some(), want == ActivationScales::Static);
        }
    }
}
