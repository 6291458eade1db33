//! What `quiver gpu-check` compares on a GPU and `tests/cuda_emulation.rs`
//! compares on the CPU, kept in one place so both check the same cases:
//! the layout the INT8 kernels read their weights in, the seeded models
//! (both INT8 semantics, odd widths, saturating calibrations, k at the
//! width limit) and the input rows with their planted edge cases. Not
//! behind the `cuda` feature, since the emulation runs in every build.

use std::sync::Arc;

use crate::loadgen::demo::SplitMix64;
use crate::model::calibrate::{calibrate, CalibrationError, Matrix, Method};
use crate::model::{Layer, Model};

/// Packs `layer.weights_i8` (`[n][k]`) as both INT8 kernels read them.
pub fn pack_weights(layer: &Layer) -> Vec<i32> {
    let (k, n) = (layer.in_dim, layer.out_dim);
    let kw = k.div_ceil(4);
    let mut words = vec![0i32; kw * n];
    for o in 0..n {
        for j in 0..kw {
            let mut bytes = [0u8; 4];
            for (t, b) in bytes.iter_mut().enumerate() {
                if 4 * j + t < k {
                    *b = layer.weights_i8[o * k + 4 * j + t] as u8;
                }
            }
            words[j * n + o] = i32::from_le_bytes(bytes);
        }
    }
    words
}

/// A seeded MLP with the given widths.
pub fn check_model(seed: u64, dims: &[usize]) -> Model {
    let name = format!("check-{}", dims.iter().map(|d| d.to_string()).collect::<Vec<_>>().join("x"));
    crate::loadgen::demo::context_mlp(&name, seed, dims)
}

/// `model` calibrated (max-abs over 64 seeded normal rows, as `quiver import
/// --calibration` would), every range then multiplied by `shrink`: below 1,
/// requantized activations saturate at 127 (and -128 without a ReLU).
pub fn check_calibrated(mut model: Model, shrink: f32) -> Result<Model, CalibrationError> {
    let k = model.input_dim();
    let mut rng = SplitMix64::new(77);
    let set = Matrix { rows: 64, cols: k, data: (0..64 * k).map(|_| rng.normal()).collect() };
    let mut c = calibrate(&model, &set, Method::MaxAbs, |_, _| {})?;
    c.input_ranges.iter_mut().for_each(|r| *r *= shrink);
    model.calibration = Some(c);
    model.name = format!("{}-static-{shrink}", model.name);
    Ok(model)
}

/// The models `gpu_check` compares, each with its `rows_max`: uncalibrated
/// ones (dynamic semantics, `dense_int8`) and calibrated ones (static,
/// `dense_int8_static`) at odd widths, a single-layer model (layer 0 is the
/// output layer), a hidden layer without ReLU (requantized to -128), and
/// k = 16384 (three rows per block in shared memory).
pub fn check_models(rows_max: usize) -> Result<Vec<(Arc<Model>, usize)>, CalibrationError> {
    let wide = rows_max.min(255);
    let mut linear_hidden = check_model(45, &[37, 33, 17, 1]);
    linear_hidden.layers[0].relu = false;
    let models = vec![
        (crate::loadgen::demo::model(), rows_max),
        (check_model(41, &[257, 255, 65, 1]), rows_max),
        (check_model(42, &[3, 1]), rows_max),
        (check_model(43, &[crate::model::WIDTH_MAX, 33, 1]), wide),
        (check_calibrated(crate::loadgen::demo::model(), 1.0)?, rows_max),
        (check_calibrated(check_model(44, &[257, 255, 65, 1]), 0.6)?, rows_max),
        (check_calibrated(linear_hidden, 0.5)?, rows_max),
        (check_calibrated(check_model(46, &[3, 1]), 0.3)?, rows_max),
        (check_calibrated(check_model(47, &[crate::model::WIDTH_MAX, 33, 1]), 1.0)?, wide),
    ];
    Ok(models.into_iter().map(|(m, rows)| (Arc::new(m), rows)).collect())
}

/// `rows` seeded normal rows of width `k`, with the edge cases planted in
/// the first rows: all zeros, values near `f32::MAX` (the scale saturates,
/// small values quantize to 0), +inf, -inf, NaN, and a whole NaN row.
pub fn check_inputs(seed: u64, rows: usize, k: usize) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed);
    let mut x: Vec<f32> = (0..rows * k).map(|_| rng.normal()).collect();
    let mut row = |r: usize, f: &dyn Fn(&mut [f32])| {
        if r < rows {
            f(&mut x[r * k..(r + 1) * k]);
        }
    };
    row(0, &|v| v.fill(0.0));
    row(1, &|v| {
        v[0] = 3.0e38;
        v[v.len() / 2] = -3.0e38;
    });
    row(2, &|v| v[v.len() - 1] = f32::INFINITY);
    row(3, &|v| v[0] = f32::NEG_INFINITY);
    row(4, &|v| v[v.len() / 3] = f32::NAN);
    row(5, &|v| v.fill(f32::NAN));
    row(6, &|v| v.iter_mut().for_each(|e| *e *= 1.0e-30));
    x
}
