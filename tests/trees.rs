//! Gradient-boosted trees: LightGBM text, XGBoost JSON and ONNX tree
//! ensembles (`tests/fixtures/tree_fixtures.py`: a synthetic fraud set with missing
//! values and a categorical column), imported and scored by every CPU
//! backend and a real server, against the frameworks' own margins and
//! probabilities recorded beside each file (`tests/fixtures/trees/<name>.npy`:
//! 2048 held-out rows of 12 features, NaN kept, then label, margin, score).

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{logits_in_batches, max_abs_diff, rel_err, run_quiver, scratch, Server};
use quiver::features::replica::ReplicaBuilder;
use quiver::model::calibrate::read_npy;
use quiver::model::gbdt::{import_lightgbm_file, import_xgboost_file, GbdtOptions};
use quiver::model::onnx::{import_file, ImportOptions};
use quiver::model::{sigmoid, Model, Op, OutputKind};
use quiver::score::cpu::{CpuF32, CpuFp8, CpuInt8};
use quiver::score::Backend;
use quiver::wire::{RequestSpec, Status, Tier};

/// The raw margin against the framework's, relative above 1 (sums of f32
/// leaves in a fixed order against the frameworks' own sums).
const MARGIN_TOLERANCE: f32 = 1e-5;
/// The probability against the framework's (or onnxruntime's).
const SCORE_TOLERANCE: f32 = 1e-6;

struct Fixture {
    name: String,
    file: PathBuf,
    format: String,
    inputs: String,
    output: Option<String>,
    kind: OutputKind,
    dim: usize,
    /// What NaN was replaced by for a framework that refuses it.
    imputed: bool,
    x: Vec<f32>,
    margin: Vec<f32>,
    score: Vec<f32>,
}

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/trees")
}

fn fixtures() -> Vec<Fixture> {
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir().join("trees.json")).unwrap()).unwrap();
    let mut out = Vec::new();
    for (name, m) in index["models"].as_object().unwrap() {
        let dim = m["dim"].as_u64().unwrap() as usize;
        let t = read_npy(&dir().join(m["data"].as_str().unwrap())).unwrap();
        assert_eq!(t.cols, dim + 3, "{name}");
        let (mut x, mut margin, mut score) = (Vec::new(), Vec::new(), Vec::new());
        for row in t.data.chunks_exact(t.cols) {
            x.extend_from_slice(&row[..dim]);
            margin.push(row[dim + 1]);
            score.push(row[dim + 2]);
        }
        out.push(Fixture {
            name: name.clone(),
            file: dir().join(m["file"].as_str().unwrap()),
            format: m["format"].as_str().unwrap().into(),
            inputs: m["inputs"].as_str().unwrap().into(),
            output: m["output"].as_str().map(str::to_string),
            kind: if m["output_kind"] == "raw" { OutputKind::Raw } else { OutputKind::Logit },
            dim,
            imputed: !m["imputed_nan"].is_null(),
            x,
            margin,
            score,
        });
    }
    assert_eq!(out.len(), 11, "eleven tree fixtures");
    out
}

fn import(f: &Fixture) -> Model {
    let model = match f.format.as_str() {
        "onnx" => {
            let opts = ImportOptions {
                name: f.name.clone(),
                version: 1,
                inputs: f.inputs.parse().unwrap(),
                output: f.output.clone(),
                output_kind: f.kind,
                base_dir: None,
            };
            import_file(&f.file, &opts).unwrap_or_else(|e| panic!("{}: {e}", f.name)).model
        }
        format => {
            let opts =
                GbdtOptions { name: f.name.clone(), version: 1, inputs: f.inputs.parse().unwrap(), output_kind: None };
            let imported = if format == "lightgbm" {
                import_lightgbm_file(&f.file, &opts)
            } else {
                import_xgboost_file(&f.file, &opts)
            };
            imported.unwrap_or_else(|e| panic!("{}: {e}", f.name)).model
        }
    };
    assert_eq!((model.input_dim(), model.output_kind()), (f.dim, f.kind), "{}", f.name);
    let covered = model.graph.as_ref().unwrap().nodes.iter().any(|n| matches!(&n.op, Op::Trees(e) if e.has_covers()));
    assert!(model.graph.as_ref().unwrap().nodes.iter().any(|n| matches!(n.op, Op::Trees(_))), "{}", f.name);
    // The native files carry covers (what explanation needs); ONNX has none.
    assert_eq!(covered, f.format != "onnx", "{}: covers", f.name);
    assert_eq!(Model::from_bytes(&model.to_bytes(), &f.name).unwrap(), model, "{}", f.name);
    model
}

#[test]
fn every_tree_model_matches_its_framework_on_every_cpu_backend() {
    for f in fixtures() {
        let model = Arc::new(import(&f));
        let rows = f.margin.len();
        let margin = logits_in_batches(&mut CpuF32::new(&model, 256), &model, &f.x);
        let scores: Vec<f32> = margin.iter().map(|v| model.score(*v)).collect();
        let em = rel_err(&margin, &f.margin);
        let (es, score_tolerance) = match f.kind {
            OutputKind::Logit => (max_abs_diff(&scores, &f.score), SCORE_TOLERANCE),
            OutputKind::Raw => (rel_err(&scores, &f.score), MARGIN_TOLERANCE),
        };
        let nan_rows = f.x.chunks_exact(f.dim).filter(|r| r.iter().any(|v| v.is_nan())).count();
        eprintln!("{:<20} margin {em:.2e} score {es:.2e} ({rows} rows, {nan_rows} with NaN)", f.name);
        assert!(f.imputed || nan_rows > 100, "{}: the fixture exercises missing values", f.name);
        assert!(em <= MARGIN_TOLERANCE, "{}: margin differs from the framework's by {em}", f.name);
        assert!(es <= score_tolerance, "{}: score differs by {es}", f.name);
        // The specification, and every backend: trees run the same code in each.
        let mut reference = vec![0.0; rows];
        model.forward_f32_reference(&f.x, rows, &mut reference);
        assert_eq!(reference, margin, "{}: the f32 backend is not the specification", f.name);
        assert_eq!(logits_in_batches(&mut CpuInt8::new(&model, 256), &model, &f.x), margin, "{} int8", f.name);
        assert_eq!(logits_in_batches(&mut CpuFp8::new(&model, 256), &model, &f.x), margin, "{} fp8", f.name);
    }
}

#[test]
fn onnx_exports_agree_with_their_native_twins() {
    let all = fixtures();
    for (native, onnx) in [("lgb_numeric", "lgb_binary_onnx"), ("xgb_binary", "xgb_binary_onnx")] {
        let (a, b) = (all.iter().find(|f| f.name == native).unwrap(), all.iter().find(|f| f.name == onnx).unwrap());
        let (ma, mb) = (Arc::new(import(a)), Arc::new(import(b)));
        let ya = logits_in_batches(&mut CpuF32::new(&ma, 256), &ma, &a.x);
        let yb = logits_in_batches(&mut CpuF32::new(&mb, 256), &mb, &b.x);
        let err = rel_err(&ya, &yb);
        assert!(err <= MARGIN_TOLERANCE, "{native} vs {onnx}: {err}");
    }
}

/// The columns of input vector `row` the mapping gives `source`, for the
/// 4 + 4 + 4 layout of every fixture.
fn parts(row: &[f32]) -> (&[f32], &[f32], &[f32]) {
    (&row[..4], &row[4..8], &row[8..12])
}

/// Every tree model served through a real server: user and item features
/// (NaN included) from the replicas, the rest as the request's context.
#[test]
fn served_tree_scores_match_the_frameworks() {
    const PER_MODEL: usize = 32;
    let dir = scratch("trees-serve");
    let models_dir = dir.join("models");
    let all = fixtures();
    let (mut users, mut items) = (ReplicaBuilder::new("user", 4), ReplicaBuilder::new("item", 4));
    for (m, f) in all.iter().enumerate() {
        let model = import(f);
        let at = models_dir.join(&f.name).join("1");
        std::fs::create_dir_all(&at).unwrap();
        model.save(&at.join("model.qm")).unwrap();
        for r in 0..PER_MODEL {
            let (u, i, _) = parts(&f.x[r * f.dim..(r + 1) * f.dim]);
            let id = (m * 1000 + r) as u64;
            users.push(id, u).unwrap();
            items.push(id, i).unwrap();
        }
    }
    users.write(&dir.join("user.qrep")).unwrap();
    items.write(&dir.join("item.qrep")).unwrap();
    for backend in ["f32", "int8"] {
        let server = Server::start_with(
            &dir,
            &["--shards", "1", "--backend", backend, "--models-dir", models_dir.to_str().unwrap()],
        );
        let mut c = server.client();
        for (m, f) in all.iter().enumerate() {
            let mut worst = 0.0f32;
            for r in 0..PER_MODEL {
                let (_, _, ctx) = parts(&f.x[r * f.dim..(r + 1) * f.dim]);
                let id = (m * 1000 + r) as u64;
                let spec = RequestSpec {
                    request_id: id,
                    budget_us: 1_000_000,
                    model: f.name.clone(),
                    user_id: id,
                    item_ids: vec![id],
                    context: ctx.to_vec(),
                    ..RequestSpec::default()
                };
                let resp = c.score(&spec).unwrap();
                assert_eq!(
                    (resp.status, resp.tier, resp.features_missing),
                    (Status::Ok, Tier::Primary, 0),
                    "{}",
                    f.name
                );
                let err = match f.kind {
                    OutputKind::Logit => (resp.scores[0] - f.score[r]).abs(),
                    OutputKind::Raw => (resp.scores[0] - f.score[r]).abs() / f.score[r].abs().max(1.0),
                };
                worst = worst.max(err);
            }
            eprintln!("served {backend} {:<20} max err {worst:.2e}", f.name);
            let tolerance = if f.kind == OutputKind::Logit { SCORE_TOLERANCE } else { MARGIN_TOLERANCE };
            assert!(worst <= tolerance, "{backend} {}: served scores differ by {worst}", f.name);
        }
    }
}

fn quiver_import(args: &[&str]) -> (i32, String, String) {
    run_quiver(std::iter::once("import").chain(args.iter().copied()))
}

#[test]
fn import_summarises_trees_and_refuses_bad_files() {
    let scratch_dir = scratch("trees-cli");
    let out = scratch_dir.join("m.qm");
    let out_s = out.to_str().unwrap();
    let lgb = dir().join("lgb_binary.txt");
    let base = ["--out", out_s, "--name", "fraud", "--version", "1", "--inputs", "user:4,item:4,context:4"];
    let (code, stdout, stderr) = quiver_import(&[&["--lightgbm", lgb.to_str().unwrap()][..], &base[..]].concat());
    assert_eq!(code, 0, "{stderr}");
    for want in ["LightGBM text model v4", "Trees (100 trees, depth 6", "categorical splits", "12 features used"] {
        assert!(stdout.contains(want), "missing '{want}' in:\n{stdout}");
    }
    let xgb = dir().join("xgb_regression.json");
    let (code, stdout, stderr) = quiver_import(&[&["--xgboost", xgb.to_str().unwrap()][..], &base[..]].concat());
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stdout.contains("one raw value, returned as is") && stdout.contains("XGBoost JSON model 3.2.0"),
        "{stdout}"
    );

    let bad = |file: &Path, flag: &str, inputs: &str| {
        let (code, _, stderr) = quiver_import(&[
            flag,
            file.to_str().unwrap(),
            "--out",
            out_s,
            "--name",
            "fraud",
            "--version",
            "1",
            "--inputs",
            inputs,
        ]);
        assert_eq!(code, 1, "{stderr}");
        stderr
    };
    let text = std::fs::read_to_string(&lgb).unwrap();
    let write = |name: &str, body: &str| {
        let p = scratch_dir.join(name);
        std::fs::write(&p, body).unwrap();
        p
    };
    let truncated = write("truncated.txt", &text[..text.len() / 2]);
    assert!(bad(&truncated, "--lightgbm", "context:12").contains("truncated"));
    let rank = write("rank.txt", &text.replace("objective=binary sigmoid:1", "objective=lambdarank"));
    assert!(bad(&rank, "--lightgbm", "context:12").contains("objective 'lambdarank' is not supported"));
    // A split on a feature past the declared width (the names list shortened
    // with it, or the names' count is what is refused).
    let narrowed = text.replace("max_feature_idx=11", "max_feature_idx=10").replace(" merchant_category\n", "\n");
    let wide = write("wide.txt", &narrowed);
    assert!(bad(&wide, "--lightgbm", "context:11").contains("past the input's 11 features"));
    assert!(bad(&lgb, "--lightgbm", "user:4,item:4").contains("add up to 8 features but the model has 12"));
    let json = std::fs::read_to_string(dir().join("xgb_binary.json")).unwrap();
    let cut = write("cut.json", &json[..json.len() - 10]);
    assert!(bad(&cut, "--xgboost", "context:12").contains("not a valid XGBoost JSON model"));
    let multi = write("multi.json", &json.replace("binary:logistic", "multi:softprob"));
    assert!(bad(&multi, "--xgboost", "context:12").contains("'multi:softprob' is not supported"));
    assert!(bad(&lgb, "--xgboost", "context:12").contains("not a valid XGBoost JSON model"));
}

/// A NaN context float is a missing value: the trees take their default
/// direction (and the f32 path of a graph reads it as 0 elsewhere).
#[test]
fn a_nan_feature_follows_the_default_direction() {
    let all = fixtures();
    let f = all.iter().find(|f| f.name == "xgb_binary").unwrap();
    let model = Arc::new(import(f));
    let r = f.x.chunks_exact(f.dim).position(|row| row[10].is_nan()).expect("a row with column 10 missing");
    let row = &f.x[r * f.dim..(r + 1) * f.dim];
    let mut b = CpuF32::new(&model, 1);
    let mut y = [0.0];
    b.score(row, 1, &mut y).unwrap();
    assert!((sigmoid(y[0]) - f.score[r]).abs() <= SCORE_TOLERANCE);
    let mut zero = row.to_vec();
    zero[10] = 0.0;
    let mut z = [0.0];
    b.score(&zero, 1, &mut z).unwrap();
    assert_ne!(y[0], z[0], "missing is not zero for this row's trees");
}

/// A model file whose ensemble is damaged is refused at load, naming it.
#[test]
fn a_damaged_tree_model_file_is_refused_at_load() {
    let all = fixtures();
    let model = import(all.iter().find(|f| f.name == "xgb_binary").unwrap());
    let damage = |edit: &dyn Fn(&mut quiver::model::trees::Ensemble)| {
        let mut m = model.clone();
        let g = m.graph.as_mut().unwrap();
        let Op::Trees(e) = &mut g.nodes[1].op else { panic!("node 1 is the ensemble") };
        edit(e);
        Model::from_bytes(&m.to_bytes(), "damaged.qm").unwrap_err().to_string()
    };
    use quiver::model::trees::Split;
    let past = damage(&|e| {
        if let Split::Numeric { feature, .. } = &mut e.nodes[0].split {
            *feature = 99;
        }
    });
    assert!(past.contains("tree 0 node 0: splits on feature 99, past the input's 12 features"), "{past}");
    assert!(damage(&|e| e.nodes[0].left = 0).contains("reached twice"));
    assert!(damage(&|e| e.starts.push(1)).contains("tree boundaries"));
    let bytes = model.to_bytes();
    assert!(Model::from_bytes(&bytes[..bytes.len() / 2], "cut.qm").is_err());
}
