//! Reason codes through the real server (docs/PROTOCOL.md, "Explanations"):
//! a LightGBM model of the tree fixtures served with `explain_top_k = 5`
//! over 32 candidates returns, per candidate, the top five of what the
//! in-process explainer computes from the same rows, with bias plus every
//! contribution equal to the margin; inline and through the inference
//! thread. A model too slow to explain inside the budget answers its scores
//! with `explain_skipped = budget`; an MLP answers `not_explainable`; a
//! lower rung `lower_rung`; limits beyond `EXPLAIN_TOP_K_MAX` and
//! `EXPLAIN_CANDIDATES_MAX` are a `BadRequest`; `GET /models` names the
//! features (LightGBM's own names, kept by the import) and `quiver score
//! --explain` prints them.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{run_quiver, scratch, Server};
use quiver::features::replica::ReplicaBuilder;
use quiver::loadgen::demo;
use quiver::model::calibrate::read_npy;
use quiver::model::explain::Explainer;
use quiver::model::gbdt::{import_lightgbm_file, GbdtOptions};
use quiver::model::trees::{Ensemble, Split, TreeNode};
use quiver::model::{sigmoid, Graph, InputSegment, Model, Node, Op, OutputKind, Source};
use quiver::registry::ModelStatus;
use quiver::wire::{ExplainSkipped, RequestSpec, Status, Tier, EXPLAIN_CANDIDATES_MAX, EXPLAIN_TOP_K_MAX};

const CANDIDATES: usize = 32;
const TOP_K: usize = 5;
/// bias + Σ contributions (f64) against the served f32 margin.
const MARGIN_TOLERANCE: f64 = 1e-5;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/trees")
}

/// The fixture's rows (`user:4,item:4,context:4`, NaN included).
fn fixture_rows() -> Vec<f32> {
    let t = read_npy(&fixtures().join("lgb_binary.npy")).unwrap();
    t.data.chunks_exact(t.cols).flat_map(|r| r[..12].to_vec()).collect()
}

/// A tree ensemble far slower to explain than to score: complete trees of
/// depth 10 (TreeSHAP's cost grows with leaves × depth², scoring's with
/// depth), over the same twelve columns.
fn slow_model() -> Model {
    const TREES: usize = 200;
    const DEPTH: u32 = 10;
    let mut rng = quiver::seeded::SplitMix64::new(11);
    let mut e = Ensemble::default();
    let mut covers = Vec::new();
    for _ in 0..TREES {
        let internal = (1usize << DEPTH) - 1;
        let nodes: Vec<TreeNode> = (0..2 * internal + 1)
            .map(|i| {
                if i >= internal {
                    return TreeNode::leaf(rng.normal() * 0.01);
                }
                let split = Split::Numeric {
                    feature: rng.below(12) as u32,
                    threshold: rng.normal(),
                    missing_left: rng.below(2) == 0,
                    zero_missing: false,
                };
                TreeNode { split, left: (2 * i + 1) as u32, right: (2 * i + 2) as u32 }
            })
            .collect();
        // A node at depth d covers 2^(DEPTH - d) training rows.
        covers.extend((0..nodes.len()).map(|i| (1u32 << (DEPTH - (i + 1).ilog2())) as f32));
        e.push_tree(&nodes);
    }
    e.covers = covers;
    let model = Model {
        name: "slow".into(),
        inputs: segments(),
        layers: Vec::new(),
        calibration: None,
        graph: Some(Graph {
            nodes: vec![
                Node { op: Op::Input { offset: 0 }, inputs: vec![], width: 12 },
                Node { op: Op::Trees(e), inputs: vec![0], width: 1 },
            ],
            output: OutputKind::Logit,
        }),
        ..demo::context_mlp("slow", 1, &[12, 1])
    };
    model.validate().unwrap();
    model
}

fn segments() -> Vec<InputSegment> {
    vec![
        InputSegment { source: Source::User, dim: 4 },
        InputSegment { source: Source::Item, dim: 4 },
        InputSegment { source: Source::Context, dim: 4 },
    ]
}

/// The served models (`lgb`: the LightGBM fixture; `slow`; `mlp`, which
/// reads the context only) and the replicas: user 1 and items 0..32 hold
/// the fixture's first rows' parts.
struct Setup {
    dir: PathBuf,
    models: PathBuf,
    lgb: Arc<Model>,
    slow: Arc<Model>,
    rows: Vec<f32>,
}

fn setup(name: &str) -> Setup {
    let dir = scratch(name);
    let models = dir.join("models");
    let opts = GbdtOptions {
        name: "lgb".into(),
        version: 1,
        inputs: "user:4,item:4,context:4".parse().unwrap(),
        output_kind: None,
    };
    let lgb = import_lightgbm_file(&fixtures().join("lgb_binary.txt"), &opts).unwrap().model;
    let slow = slow_model();
    let mlp = demo::context_mlp("mlp", 3, &[4, 8, 1]);
    for m in [&lgb, &slow, &mlp] {
        let at = models.join(&m.name).join("1");
        std::fs::create_dir_all(&at).unwrap();
        m.save(&at.join("model.qm")).unwrap();
    }
    let rows = fixture_rows();
    let (mut users, mut items) = (ReplicaBuilder::new("user", 4), ReplicaBuilder::new("item", 4));
    users.push(1, &rows[..4]).unwrap();
    for i in 0..CANDIDATES {
        items.push(i as u64, &rows[i * 12 + 4..i * 12 + 8]).unwrap();
    }
    users.write(&dir.join("user.qrep")).unwrap();
    items.write(&dir.join("item.qrep")).unwrap();
    // Loaded back from the files the server serves.
    let load = |name: &str| Arc::new(Model::load(&models.join(name).join("1/model.qm")).unwrap());
    Setup { lgb: load("lgb"), slow: load("slow"), dir, models, rows }
}

impl Setup {
    /// Candidate `i`'s input row as the server assembles it.
    fn row(&self, i: usize) -> Vec<f32> {
        let r = &self.rows;
        [&r[..4], &r[i * 12 + 4..i * 12 + 8], &r[8..12]].concat()
    }

    fn spec(&self, id: u64, model: &str) -> RequestSpec {
        RequestSpec {
            request_id: id,
            model: model.into(),
            budget_us: 5_000_000,
            user_id: 1,
            item_ids: (0..CANDIDATES as u64).collect(),
            context: self.rows[8..12].to_vec(),
            explain_top_k: TOP_K as u16,
            ..RequestSpec::default()
        }
    }

    fn serve(&self, config: &str) -> Server {
        let cfg = self.dir.join(format!("q-{}.toml", config.len()));
        std::fs::write(&cfg, config).unwrap();
        let models = self.models.to_str().unwrap();
        let args = ["--shards", "1", "--backend", "f32", "--models-dir", models, "--config", cfg.to_str().unwrap()];
        Server::start_with(&self.dir, &args)
    }
}

/// Every contribution of `row` and the bias, in process.
fn contributions(model: &Arc<Model>, row: &[f32]) -> (f64, Vec<f64>) {
    let explainer = Explainer::new(model.clone()).unwrap();
    let mut phi = vec![0.0; explainer.width()];
    let bias = explainer.explain(row, &mut explainer.scratch(), &mut phi).unwrap();
    (bias, phi)
}

/// The JSON's float against the f64 it was printed from: serde_json
/// prints the shortest decimal that reads back exactly, but its default
/// parser may round the last bit.
fn json_f64(v: &serde_json::Value, want: f64) {
    let got = v.as_f64().unwrap();
    assert!((got - want).abs() <= 4.0 * f64::EPSILON * want.abs(), "{got} vs {want}");
}

/// The top `k` by magnitude, ties by the lower index.
fn top(phi: &[f64], k: usize) -> Vec<(u32, f64)> {
    let mut order: Vec<usize> = (0..phi.len()).collect();
    order.sort_by(|&a, &b| phi[b].abs().total_cmp(&phi[a].abs()).then(a.cmp(&b)));
    order.into_iter().take(k).map(|i| (i as u32, phi[i])).collect()
}

/// The served explanation of `spec` equals the in-process explainer's
/// top five for every candidate asked, and each candidate's bias plus all
/// its contributions is the margin it was scored with.
fn check_explained(s: &Setup, c: &mut quiver::client::Client, spec: &RequestSpec, want_candidates: &[u32]) {
    let r = c.score(spec).unwrap();
    assert_eq!((r.status, r.tier), (Status::Ok, Tier::Primary), "{r:?}");
    let e = &r.explanations;
    assert_eq!(e.skipped, ExplainSkipped::None);
    assert_eq!(e.candidates, want_candidates);
    assert_eq!(e.k(), TOP_K);
    for (candidate, served) in e.iter() {
        let row = s.row(candidate);
        let (bias, phi) = contributions(&s.lgb, &row);
        assert_eq!(e.bias, bias);
        assert_eq!(served.collect::<Vec<_>>(), top(&phi, TOP_K), "candidate {candidate}");
        let mut margin = [0f32];
        s.lgb.forward_f32_reference(&row, 1, &mut margin);
        let sum = bias + phi.iter().sum::<f64>();
        let m = f64::from(margin[0]);
        assert!((sum - m).abs() <= MARGIN_TOLERANCE * m.abs().max(1.0), "candidate {candidate}: {sum} vs {m}");
        assert!((r.scores[candidate] - sigmoid(margin[0])).abs() < 1e-6, "candidate {candidate}'s score");
    }
}

#[test]
fn explanations_through_the_server_inline_and_through_the_inference_thread() {
    let s = setup("explain-serve");
    for config in ["", "inference = \"thread\"\n"] {
        let server = s.serve(config);
        let mut c = server.client();
        let all: Vec<u32> = (0..CANDIDATES as u32).collect();
        check_explained(&s, &mut c, &s.spec(1, "lgb"), &all);
        // The top three by score, in request order.
        let spec = RequestSpec { explain_candidates_max: 3, ..s.spec(2, "lgb") };
        let scores = c.score(&RequestSpec { explain_top_k: 0, ..spec.clone() }).unwrap().scores;
        let mut by_score: Vec<u32> = all.clone();
        by_score.sort_by(|&a, &b| scores[b as usize].total_cmp(&scores[a as usize]).then(a.cmp(&b)));
        let mut top3 = by_score[..3].to_vec();
        top3.sort_unstable();
        check_explained(&s, &mut c, &spec, &top3);

        // Not asked: nothing, not even a reason.
        let r = c.score(&RequestSpec { explain_top_k: 0, ..s.spec(3, "lgb") }).unwrap();
        assert_eq!((r.status, r.explanations.clone()), (Status::Ok, Default::default()));

        // An MLP cannot be explained exactly: its scores, and the reason.
        let r = c.score(&RequestSpec { user_id: 0, item_ids: vec![1, 2], ..s.spec(4, "mlp") }).unwrap();
        assert_eq!((r.status, r.tier, r.scores.len()), (Status::Ok, Tier::Primary, 2), "{r:?}");
        assert_eq!(r.explanations.skipped, ExplainSkipped::NotExplainable);
        assert!(r.explanations.candidates.is_empty());

        // Too slow to explain 32 candidates in 20 ms (each takes
        // milliseconds even at issue 37's target speed, tens of them now),
        // fast to score (32 rows of 200 trees): the scores, intact, and
        // `budget`.
        let mut budget_skips = 0;
        for id in 10..50 {
            let spec = RequestSpec { budget_us: 20_000, ..s.spec(id, "slow") };
            let r = c.score(&spec).unwrap();
            if (r.status, r.tier) != (Status::Ok, Tier::Primary) {
                // A pause of this loaded machine past the budget: retried.
                continue;
            }
            assert_eq!(r.explanations.skipped, ExplainSkipped::Budget, "{r:?}");
            assert!(r.explanations.candidates.is_empty());
            for (i, score) in r.scores.iter().enumerate() {
                let mut margin = [0f32];
                s.slow.forward_f32_reference(&s.row(i), 1, &mut margin);
                assert!((score - sigmoid(margin[0])).abs() < 1e-6, "candidate {i}");
            }
            budget_skips += 1;
            if budget_skips == 3 {
                break;
            }
        }
        assert_eq!(budget_skips, 3, "three primary answers skipped for budget");
        // With the time, the same model is explained.
        let r = c.score(&RequestSpec { explain_candidates_max: 1, ..s.spec(20, "slow") }).unwrap();
        assert_eq!((r.explanations.skipped, r.explanations.candidates.len()), (ExplainSkipped::None, 1), "{r:?}");
        // Counted for operators: 32 + 3 + 1 candidates explained.
        assert!(server.wait_metric("quiver_explain_skipped_budget_total", 3) >= 3);
        assert!(server.wait_metric("quiver_explained_candidates_total", 36) >= 36);
    }
}

#[test]
fn limits_are_a_bad_request_and_lower_rungs_explain_nothing() {
    let s = setup("explain-limits");
    let server = s.serve("inference = \"thread\"\nfaults_endpoint = true\n[ladder]\nreserve_us = 40000\n");
    let mut c = server.client();
    let k = RequestSpec { explain_top_k: EXPLAIN_TOP_K_MAX as u16 + 1, ..s.spec(1, "lgb") };
    let r = c.score(&k).unwrap();
    assert_eq!(r.status, Status::BadRequest);
    assert!(r.error.contains("EXPLAIN_TOP_K_MAX"), "{}", r.error);
    let many = RequestSpec { item_ids: (0..EXPLAIN_CANDIDATES_MAX as u64 + 1).collect(), ..s.spec(2, "lgb") };
    let r = c.score(&many).unwrap();
    assert_eq!(r.status, Status::BadRequest);
    assert!(r.error.contains("EXPLAIN_CANDIDATES_MAX") && r.error.contains("explain_candidates_max"), "{}", r.error);
    // Within the limit by naming how many: scored and explained.
    let r = c.score(&RequestSpec { explain_candidates_max: 4, ..many }).unwrap();
    assert_eq!((r.status, r.explanations.candidates.len()), (Status::Ok, 4), "{r:?}");

    // The stage now takes 400 ms a batch, past the 200 ms budget: the
    // request is given up on and a lower rung (cache or static default)
    // answers, which explains nothing and says so.
    let url = format!("http://{}/faults?stage_delay_us=400000", server.admin);
    assert_eq!(common::http_post(&url).0, 200);
    let mut lower = 0;
    for id in 100..120 {
        let r = c.score(&RequestSpec { budget_us: 200_000, ..s.spec(id, "lgb") }).unwrap();
        if r.status != Status::Ok {
            continue;
        }
        assert_ne!(r.tier, Tier::Primary, "{r:?}");
        assert_eq!(r.explanations.skipped, ExplainSkipped::LowerRung, "{r:?}");
        assert!(r.explanations.candidates.is_empty());
        lower += 1;
        if lower == 2 {
            break;
        }
    }
    assert_eq!(lower, 2, "two answers from a lower rung");
}

#[test]
fn models_are_listed_with_their_feature_names_and_quiver_score_prints_reasons() {
    let s = setup("explain-cli");
    let server = s.serve("");
    let (code, body) = common::http_get(&format!("http://{}/models", server.admin));
    assert_eq!(code, 200, "{body}");
    let models: Vec<ModelStatus> = serde_json::from_str(&body).unwrap();
    let lgb = models.iter().find(|m| m.name == "lgb").unwrap();
    assert_eq!(lgb.features, s.lgb.feature_names());
    // LightGBM's own names, kept by the import, not the segments'.
    assert_eq!(lgb.features[..2], ["amount".to_string(), "account_age_days".to_string()]);
    assert_eq!(lgb.features[11], "merchant_category");
    assert_eq!(s.lgb.layout_feature_names()[11], "context[3]");

    let ctx = s.rows[8..12].iter().map(|v| v.to_string()).collect::<Vec<_>>().join(",");
    let context = format!("--context={ctx}");
    let base = [
        "score",
        "--addr",
        server.addr.as_str(),
        "--model",
        "lgb",
        "--user",
        "1",
        "--items",
        "0,1,2,3",
        context.as_str(),
        "--budget-us",
        "5000000",
        "--explain",
        "3",
        "--admin",
        server.admin.as_str(),
    ];
    let (code, out, err) = run_quiver(base.iter().chain(&["--json"]));
    assert_eq!(code, 0, "{out}{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["explain_skipped"], "none");
    let explanations = v["explanations"].as_array().unwrap();
    assert_eq!(explanations.len(), 4);
    for (i, e) in explanations.iter().enumerate() {
        assert_eq!(e["candidate"], i);
        let (bias, phi) = contributions(&s.lgb, &s.row(i));
        json_f64(&e["bias"], bias);
        let want = top(&phi, 3);
        let got = e["top"].as_array().unwrap();
        assert_eq!(got.len(), 3);
        for (g, (index, contribution)) in got.iter().zip(want) {
            assert_eq!(g["index"], index);
            assert_eq!(g["feature"], s.lgb.feature_names()[index as usize]);
            json_f64(&g["contribution"], contribution);
        }
    }
    // No admin endpoint there: the answer all the same, features by index.
    let mut no_admin = base;
    no_admin[base.len() - 1] = "127.0.0.1:1";
    let (code, out, err) = run_quiver(no_admin.iter().chain(&["--json"]));
    assert_eq!(code, 0, "{out}{err}");
    assert!(err.contains("warning: features by index"), "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert!(v["explanations"][0]["top"][0]["feature"].is_null(), "{v}");
    assert!(v["explanations"][0]["top"][0]["index"].is_u64(), "{v}");

    let (code, out, err) = run_quiver(base);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("explanations (margin = bias"), "{out}");
    let (_, phi) = contributions(&s.lgb, &s.row(0));
    let first = top(&phi, 1)[0].0 as usize;
    assert!(out.contains(&format!("{} ({first})", s.lgb.feature_names()[first])), "{out}");
}
