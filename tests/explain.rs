//! Reason codes against the frameworks' own: `tests/fixtures/explain_oracle.py`
//! trains LightGBM and XGBoost models (missing values, a categorical column,
//! LightGBM's zero-as-missing) in a scratch directory and writes what
//! LightGBM's `predict(pred_contrib=True)` and XGBoost's
//! `predict(pred_contribs=True)` return for held-out rows; Quiver imports
//! the same files and explains the same rows (`model::explain`). The
//! columns are named in the frameworks, and the import keeps the names.
//!
//! Without the pinned lightgbm and xgboost wheels the test says it skipped;
//! with `QUIVER_REQUIRE_TREE_FRAMEWORKS=1` (CI, which installs them) it
//! fails instead.

mod common;

use std::path::Path;
use std::sync::Arc;

use common::scratch;
use quiver::model::explain::Explainer;
use quiver::model::gbdt::{import_lightgbm_file, import_xgboost_file, GbdtOptions};
use quiver::model::Model;

/// Every contribution and the bias against the framework's: absolute up
/// to 1, relative above (XGBoost computes in f32, LightGBM in f64 from
/// leaves Quiver stores in f32).
const CONTRIBUTION_TOLERANCE: f64 = 1e-5;

fn close(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1.0)
}

/// Runs the oracle into `dir`; `false` when the wheels are missing and not
/// required.
fn oracle(dir: &Path) -> bool {
    let required = std::env::var("QUIVER_REQUIRE_TREE_FRAMEWORKS").is_ok_and(|v| v == "1");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/explain_oracle.py");
    let out = std::process::Command::new("python3").arg(&script).arg(dir).output();
    let out = match out {
        Ok(o) => o,
        Err(e) => {
            assert!(!required, "QUIVER_REQUIRE_TREE_FRAMEWORKS=1 but python3 did not start: {e}");
            eprintln!("SKIPPED: python3 did not start: {e}");
            return false;
        }
    };
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.code() == Some(3) {
        assert!(!required, "QUIVER_REQUIRE_TREE_FRAMEWORKS=1 but {stderr}");
        eprintln!("SKIPPED: {stderr}");
        return false;
    }
    assert!(out.status.success(), "explain_oracle.py failed: {stderr}");
    true
}

#[test]
fn tree_contributions_match_lightgbm_and_xgboost() {
    let dir = scratch("explain-oracle");
    if !oracle(&dir) {
        return;
    }
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("explain.json")).unwrap()).unwrap();
    let features = index["features"].as_u64().unwrap() as usize;
    let names: Vec<&str> = index["names"].as_array().unwrap().iter().map(|n| n.as_str().unwrap()).collect();
    let models = index["models"].as_object().unwrap();
    assert_eq!(models.len(), 4, "four oracle models");
    for (name, m) in models {
        let opts = GbdtOptions {
            name: name.clone(),
            version: 1,
            inputs: format!("context:{features}").parse().unwrap(),
            output_kind: None,
        };
        let file = dir.join(m["file"].as_str().unwrap());
        let imported = match m["format"].as_str().unwrap() {
            "lightgbm" => import_lightgbm_file(&file, &opts),
            _ => import_xgboost_file(&file, &opts),
        };
        let model = imported.unwrap_or_else(|e| panic!("{name}: {e}")).model;
        // Through the model file, as the server loads it.
        let model = Arc::new(Model::from_bytes(&model.to_bytes(), name).unwrap());
        // The framework's feature names, kept in the file (what `GET
        // /models` lists and `quiver score --explain` prints).
        assert_eq!(model.feature_names, names, "{name}: the framework's feature names");
        let explainer = Explainer::new(model.clone()).unwrap_or_else(|e| panic!("{name}: {e}"));
        let mut scratch = explainer.scratch();
        let mut phi = vec![0.0; features];
        let (mut worst, mut worst_sum, mut nan_rows, mut max_abs) = (0.0f64, 0.0f64, 0, 0.0f64);
        let rows = m["x"].as_array().unwrap();
        for (r, row) in rows.iter().enumerate() {
            let x: Vec<f32> =
                row.as_array().unwrap().iter().map(|v| v.as_f64().map_or(f32::NAN, |v| v as f32)).collect();
            nan_rows += x.iter().any(|v| v.is_nan()) as usize;
            let want: Vec<f64> = m["contrib"][r].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
            let bias = explainer.explain(&x, &mut scratch, &mut phi).unwrap();
            for f in 0..features {
                let err = close(phi[f], want[f]);
                worst = worst.max(err);
                max_abs = max_abs.max(want[f].abs());
                assert!(err <= CONTRIBUTION_TOLERANCE, "{name} row {r} feature {f}: {} vs {}", phi[f], want[f]);
            }
            let err = close(bias, want[features]);
            worst = worst.max(err);
            assert!(err <= CONTRIBUTION_TOLERANCE, "{name} row {r}: bias {bias} vs {}", want[features]);
            // The sum is the margin: Quiver's own (the f32 specification)
            // and the framework's.
            let sum = bias + phi.iter().sum::<f64>();
            let mut ours = [0.0f32];
            model.forward_f32_reference(&x, 1, &mut ours);
            let theirs = m["margin"][r].as_f64().unwrap();
            for margin in [ours[0] as f64, theirs] {
                let err = close(sum, margin);
                worst_sum = worst_sum.max(err);
                assert!(err <= CONTRIBUTION_TOLERANCE, "{name} row {r}: bias + contributions {sum} vs margin {margin}");
            }
        }
        eprintln!(
            "{name:<13} {} rows ({nan_rows} with NaN): contributions and bias within {worst:.1e} \
             (largest |contribution| {max_abs:.2}), sum vs margin {worst_sum:.1e}",
            rows.len()
        );
        assert!(nan_rows > 20 && max_abs > 0.1, "{name}: the rows exercise missing values and real contributions");
    }
}

/// ONNX `TreeEnsemble*` stores no covers, so an imported ONNX ensemble
/// scores but is refused an explanation, saying what to import instead.
#[test]
fn onnx_tree_ensembles_are_refused_for_want_of_covers() {
    use quiver::model::explain::ExplainError;
    use quiver::model::onnx::{import_file, ImportOptions};
    use quiver::model::OutputKind;
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/trees/lgb_binary_onnx.onnx");
    let opts = ImportOptions {
        name: "lgb_onnx".into(),
        version: 1,
        inputs: "context:12".parse().unwrap(),
        output: Some("probabilities".into()),
        output_kind: OutputKind::Logit,
        base_dir: None,
    };
    let model = import_file(&file, &opts).unwrap().model;
    let err = Explainer::new(Arc::new(model)).unwrap_err();
    assert!(matches!(err, ExplainError::NoCovers { .. }), "{err}");
    assert!(err.to_string().contains("import the LightGBM text or XGBoost JSON model"), "{err}");
}

/// The zoo's scikit-learn LogisticRegression (ONNX `LinearClassifier`,
/// imported as one dense layer): contributions are its weights times the
/// inputs (no scaler: baseline 0), the bias its intercept, and bias plus
/// contributions the logit onnxruntime recorded. The zoo's StandardScaler
/// + MLP pipeline is refused.
#[test]
fn the_zoo_logistic_regression_explains_in_closed_form_and_its_mlp_is_refused() {
    use quiver::model::explain::ExplainError;
    use quiver::model::onnx::import_file;
    let zoo = common::zoo::zoo();
    let get = |name: &str| zoo.iter().find(|z| z.name == name).unwrap();
    let lr = get("logistic_regression");
    let model = import_file(&lr.file, &lr.import_options()).unwrap().model;
    let layer = model.layers[0].clone();
    assert_eq!((model.layers.len(), layer.out_dim), (1, 1), "one dense layer");
    let explainer = Explainer::new(Arc::new(model)).unwrap();
    assert_eq!(explainer.bias(), layer.bias[0] as f64);
    let mut scratch = explainer.scratch();
    let mut phi = vec![0.0; lr.dim];
    let mut worst = 0.0f64;
    for (r, x) in lr.x.chunks_exact(lr.dim).enumerate().take(256) {
        let bias = explainer.explain(x, &mut scratch, &mut phi).unwrap();
        for (i, c) in phi.iter().enumerate() {
            assert_eq!(*c, layer.weights_f32[i] as f64 * x[i] as f64, "row {r} feature {i}");
        }
        let err = close(bias + phi.iter().sum::<f64>(), lr.want[r] as f64);
        worst = worst.max(err);
        assert!(err <= CONTRIBUTION_TOLERANCE, "row {r}: bias + contributions miss the logit by {err}");
    }
    eprintln!("logistic_regression: bias + contributions within {worst:.1e} of onnxruntime's logit");

    let mlp = get("scaler_mlp");
    let model = import_file(&mlp.file, &mlp.import_options()).unwrap().model;
    let err = Explainer::new(Arc::new(model)).unwrap_err();
    assert!(matches!(err, ExplainError::NotExplainable { .. }), "{err}");
    assert!(err.to_string().contains("cannot be explained exactly"), "{err}");
}
