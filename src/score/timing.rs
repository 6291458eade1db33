//! `quiver time-model`: the median wall time of one backend's `score` per
//! batch size, on seeded normal inputs or on rows from a file, and with
//! `--explain` of explaining that many candidates (`model::explain`). A
//! measurement tool for people comparing backends and peers, not a test:
//! nothing asserts on its figures.

use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use crate::loadgen::demo::SplitMix64;
use crate::model::calibrate::Matrix;
use crate::model::explain::Explainer;
use crate::model::Model;
use crate::score::{self, BackendKind};

/// Calls before the timed ones, so caches, branch predictors and lazily
/// built state are warm.
const WARM_UP_CALLS: usize = 10;

/// One batch size's figures (a JSON line of `quiver time-model`).
#[derive(Clone, Debug, Serialize)]
pub struct Timing {
    pub backend: &'static str,
    /// The INT8 kernel, for the CPU INT8 backend (`--kernel`, or auto's
    /// choice); absent for the others.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kernel: Option<&'static str>,
    pub one_request: bool,
    pub rows: usize,
    pub iters: usize,
    pub median_us: f64,
    pub rows_per_s: f64,
    pub gmac_per_s: f64,
}

/// One batch size's explanation figures (a JSON line of `quiver
/// time-model --explain`): every candidate's contributions, one after
/// another, as the server would explain its top candidates.
#[derive(Clone, Debug, Serialize)]
pub struct ExplainTiming {
    pub explain: &'static str,
    pub candidates: usize,
    pub iters: usize,
    pub median_us: f64,
    pub us_per_candidate: f64,
}

/// Times explaining `n` candidates for each `n` of `rows`, `iters` calls
/// each, on the rows `time_model` would score; a model that cannot be
/// explained is refused with the reason.
pub fn time_explain(
    model: &Arc<Model>,
    rows: &[usize],
    iters: usize,
    data: Option<&Matrix>,
) -> Result<Vec<ExplainTiming>, String> {
    let explainer = Explainer::new(model.clone()).map_err(|e| e.to_string())?;
    let rows_max = rows.iter().copied().max().unwrap_or(1).max(1);
    let dim = model.input_dim();
    let x = inputs(dim, rows_max, data)?;
    let total_rows = x.len() / dim.max(1);
    let mut scratch = explainer.scratch();
    let mut phi = vec![0.0f64; dim];
    let mut timings = Vec::with_capacity(rows.len());
    for &n in rows.iter().filter(|&&n| n > 0) {
        let windows = total_rows - n + 1;
        let mut k = 0;
        let mut call = || -> Result<(), String> {
            let at = (k * n) % windows;
            k += 1;
            for r in at..at + n {
                let bias = explainer.explain(&x[r * dim..(r + 1) * dim], &mut scratch, &mut phi);
                std::hint::black_box((bias.map_err(|e| e.to_string())?, &phi));
            }
            Ok(())
        };
        for _ in 0..WARM_UP_CALLS {
            call()?;
        }
        let mut ns = Vec::with_capacity(iters.max(1));
        for _ in 0..iters.max(1) {
            let t = Instant::now();
            call()?;
            ns.push(t.elapsed().as_nanos() as u64);
        }
        ns.sort_unstable();
        let median_ns = ns[ns.len() / 2].max(1);
        timings.push(ExplainTiming {
            explain: explainer.method(),
            candidates: n,
            iters: ns.len(),
            median_us: median_ns as f64 / 1e3,
            us_per_candidate: median_ns as f64 / 1e3 / n as f64,
        });
    }
    Ok(timings)
}

/// At least `rows_max` input rows: seeded normals, or `data`'s rows
/// repeated.
fn inputs(dim: usize, rows_max: usize, data: Option<&Matrix>) -> Result<Vec<f32>, String> {
    Ok(match data {
        None => {
            let mut rng = SplitMix64::new(7);
            (0..rows_max * dim).map(|_| rng.normal()).collect()
        }
        Some(t) => {
            if t.cols < dim || t.data.is_empty() {
                return Err(format!("{} columns; the model reads {dim}", t.cols));
            }
            let rows_in = t.data.len() / t.cols;
            let total = rows_in.max(rows_max);
            (0..total).flat_map(|r| t.data[(r % rows_in) * t.cols..][..dim].iter().copied()).collect()
        }
    })
}

/// Times `kind` on `model` at each batch size of `rows`, `iters` calls each.
/// With `data`, call k scores the window of rows starting at k * rows
/// (wrapping), so successive calls see different rows, as traffic does.
/// With `one_request`, every row carries the first row's per-request
/// columns (user, context), so a backend that computes what depends only on
/// them once per request does so once per call.
pub fn time_model(
    model: &Arc<Model>,
    kind: BackendKind,
    rows: &[usize],
    iters: usize,
    one_request: bool,
    data: Option<&Matrix>,
) -> Result<Vec<Timing>, String> {
    let rows_max = rows.iter().copied().max().unwrap_or(1).max(1);
    let dim = model.input_dim();
    let mut x = inputs(dim, rows_max, data)?;
    let total_rows = x.len() / dim.max(1);
    if one_request {
        let shared = model.request_columns();
        for r in 1..total_rows {
            for c in (0..dim).filter(|&c| shared[c]) {
                x[r * dim + c] = x[c];
            }
        }
    }
    let mut backend = score::build(kind, model, rows_max);
    // A backend that cannot score (onnxruntime missing) has nothing to time.
    let mut probe = vec![0.0; 1];
    backend.score(&x[..dim], 1, &mut probe).map_err(|e| e.to_string())?;
    let macs_per_row = model.macs_per_row();
    let mut timings = Vec::with_capacity(rows.len());
    for &n in rows.iter().filter(|&&n| n > 0) {
        let mut out = vec![0.0; n];
        let windows = total_rows - n + 1;
        let mut k = 0;
        let mut call = |out: &mut [f32]| {
            let at = (k * n) % windows;
            k += 1;
            backend.score(&x[at * dim..(at + n) * dim], n, out)
        };
        for _ in 0..WARM_UP_CALLS {
            call(&mut out).map_err(|e| e.to_string())?;
        }
        let mut ns = Vec::with_capacity(iters.max(1));
        for _ in 0..iters.max(1) {
            let t = Instant::now();
            call(&mut out).map_err(|e| e.to_string())?;
            ns.push(t.elapsed().as_nanos() as u64);
        }
        ns.sort_unstable();
        let median_ns = ns[ns.len() / 2].max(1);
        timings.push(Timing {
            backend: backend.name(),
            kernel: (kind == BackendKind::Int8).then(|| score::cpu::configured_kernel().name()),
            one_request,
            rows: n,
            iters: ns.len(),
            median_us: median_ns as f64 / 1e3,
            rows_per_s: n as f64 / (median_ns as f64 / 1e9),
            gmac_per_s: (n * macs_per_row) as f64 / median_ns as f64,
        });
    }
    Ok(timings)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_batch_size_with_the_rows_it_timed() {
        let model = Arc::new(crate::loadgen::demo::model());
        let t = time_model(&model, BackendKind::Int8, &[1, 8], 3, false, None).unwrap();
        assert_eq!(t.iter().map(|t| (t.rows, t.iters)).collect::<Vec<_>>(), vec![(1, 3), (8, 3)]);
        assert!(t.iter().all(|t| t.median_us > 0.0 && t.rows_per_s > 0.0 && t.gmac_per_s > 0.0));
        let kernel = crate::score::cpu::configured_kernel().name();
        assert!(t.iter().all(|t| t.kernel == Some(kernel)), "{t:?}");
        let f32 = time_model(&model, BackendKind::F32, &[1], 1, false, None).unwrap();
        assert_eq!(f32[0].kernel, None);
        assert!(!serde_json::to_string(&f32[0]).unwrap().contains("kernel"));
        let narrow = Matrix { rows: 2, cols: 3, data: vec![0.0; 6] };
        let err = time_model(&model, BackendKind::F32, &[1], 1, false, Some(&narrow)).unwrap_err();
        assert!(err.contains("3 columns"), "{err}");
        let rows = Matrix { rows: 4, cols: model.input_dim(), data: vec![0.5; 4 * model.input_dim()] };
        let t = time_model(&model, BackendKind::F32, &[2, 16], 2, true, Some(&rows)).unwrap();
        assert_eq!(t.len(), 2);
        assert!(t[1].one_request);
    }

    #[test]
    fn explanations_are_timed_per_candidate_and_refused_for_an_mlp() {
        let mlp = Arc::new(crate::loadgen::demo::model());
        let err = time_explain(&mlp, &[1], 1, None).unwrap_err();
        assert!(err.contains("cannot be explained exactly"), "{err}");
        let t = time_explain(&Arc::new(crate::model::trees::tests::small_explainable()), &[1, 4], 3, None).unwrap();
        assert_eq!(t.iter().map(|t| (t.candidates, t.iters)).collect::<Vec<_>>(), vec![(1, 3), (4, 3)]);
        assert!(t.iter().all(|t| t.explain == "treeshap" && t.us_per_candidate > 0.0));
        assert_eq!(t[1].us_per_candidate, t[1].median_us / 4.0);
    }
}
