//! The explainer's unit tests: both algorithms against Shapley values by
//! their definition, against each other, and every ISA build of the walk.

use super::quadrature::{gauss_legendre, lanes_for, Isa, CATEGORICAL, LEAF, MISSING_LEFT, ZERO_MISSING};
use super::*;
use crate::model::graph::{Graph, Node, OutputKind};
use crate::model::tests::tiny;
use crate::model::trees::goes_left;
use crate::model::trees::TreeNode;
use crate::model::{InputSegment, Source};
use crate::seeded::SplitMix64;

const WIDTH: usize = 5;

/// A random ensemble over `WIDTH` features, features repeated along
/// paths, every missing-value rule and categorical splits, with covers
/// that add up (a leaf's count at random, some 0; a split's the sum).
fn random_ensemble(seed: u64, trees: usize, depth: usize) -> Ensemble {
    random_ensemble_over(seed, trees, depth, WIDTH, 4, false)
}

/// As `random_ensemble`, over `width` features, a split's child ending
/// in a leaf with probability 1 / `stop`; with `spine`, the leftmost
/// path always reaches `depth`.
fn random_ensemble_over(seed: u64, trees: usize, depth: usize, width: usize, stop: u64, spine: bool) -> Ensemble {
    let mut rng = SplitMix64::new(seed);
    let mut e = Ensemble { base: rng.normal() * 0.1, ..Ensemble::default() };
    for _ in 0..trees {
        let mut nodes = vec![TreeNode::leaf(0.0)];
        let mut open = vec![(0usize, 0usize, spine)];
        while let Some((i, d, on_spine)) = open.pop() {
            if d >= depth || (d > 0 && !on_spine && rng.below(stop) == 0) {
                nodes[i] = TreeNode::leaf(rng.normal());
                continue;
            }
            let feature = rng.below(width as u64) as u32;
            let split = if rng.below(4) == 0 {
                let (start, len) = e.push_words(&[rng.next_u64() as u32]);
                Split::Categorical { feature, start, len }
            } else {
                Split::Numeric {
                    feature,
                    threshold: rng.normal(),
                    missing_left: rng.below(2) == 0,
                    zero_missing: rng.below(5) == 0,
                }
            };
            let (l, r) = (nodes.len(), nodes.len() + 1);
            nodes.extend([TreeNode::leaf(0.0), TreeNode::leaf(0.0)]);
            nodes[i] = TreeNode { split, left: l as u32, right: r as u32 };
            open.extend([(l, d + 1, on_spine), (r, d + 1, false)]);
        }
        // Top down (children come after their parent): a split shares
        // its cover between its children, a leaf child sometimes
        // getting none (all rows went the other way).
        let mut covers = vec![0.0f32; nodes.len()];
        covers[0] = 100.0;
        for i in 0..nodes.len() {
            if matches!(nodes[i].split, Split::Leaf { .. }) {
                continue;
            }
            let (l, r) = (nodes[i].left as usize, nodes[i].right as usize);
            let leaf = |c: usize| matches!(nodes[c].split, Split::Leaf { .. });
            let share = match rng.below(6) {
                0 if leaf(l) => 0.0,
                1 if leaf(r) => 1.0,
                _ => 0.1 + 0.8 * rng.unit() as f32,
            };
            covers[l] = covers[i] * share;
            covers[r] = covers[i] - covers[l];
        }
        e.push_tree(&nodes);
        e.covers.extend(covers);
    }
    e
}

fn tree_model(e: Ensemble, affine: Option<(f32, f32, f32)>) -> Arc<Model> {
    tree_model_over(e, affine, WIDTH)
}

fn tree_model_over(e: Ensemble, affine: Option<(f32, f32, f32)>, width: usize) -> Arc<Model> {
    let mut nodes = vec![
        Node { op: Op::Input { offset: 0 }, inputs: vec![], width },
        Node { op: Op::Trees(e), inputs: vec![0], width: 1 },
    ];
    if let Some((c, s, h)) = affine {
        nodes.push(Node {
            op: Op::Affine { center: vec![c], scale: vec![s], shift: vec![h] },
            inputs: vec![1],
            width: 1,
        });
    }
    let model = Model {
        name: "trees".into(),
        inputs: vec![InputSegment { source: Source::Context, dim: width }],
        layers: Vec::new(),
        calibration: None,
        graph: Some(Graph { nodes, output: OutputKind::Logit }),
        ..tiny()
    };
    model.validate().unwrap();
    Arc::new(model)
}

/// E[tree(x) | the features in `known` are x's], the others drawn as
/// the covers say: the value function path-dependent TreeSHAP takes
/// the Shapley values of.
fn conditional(e: &Ensemble, t: usize, i: usize, x: &[f32], known: u32) -> f64 {
    let tree = e.tree(t);
    let covers = &e.covers[e.starts[t] as usize..];
    let n = &tree[i];
    match n.split {
        Split::Leaf { value } => value as f64,
        Split::Numeric { feature, .. } | Split::Categorical { feature, .. } => {
            let (l, r) = (n.left as usize, n.right as usize);
            if known >> feature & 1 == 1 {
                let left = goes_left(&n.split, x[feature as usize], &e.cat_words);
                conditional(e, t, if left { l } else { r }, x, known)
            } else {
                (conditional(e, t, l, x, known) * covers[l] as f64 + conditional(e, t, r, x, known) * covers[r] as f64)
                    / covers[i] as f64
            }
        }
    }
}

/// Shapley values by their definition, over all 2^WIDTH subsets.
fn brute_force(e: &Ensemble, x: &[f32]) -> (f64, Vec<f64>) {
    let v = |s: u32| e.base as f64 + (0..e.trees()).map(|t| conditional(e, t, 0, x, s)).sum::<f64>();
    let fact = |n: usize| (1..=n).map(|k| k as f64).product::<f64>();
    let mut phi = vec![0.0; WIDTH];
    for (f, p) in phi.iter_mut().enumerate() {
        for s in 0u32..1 << WIDTH {
            if s >> f & 1 == 1 {
                continue;
            }
            let k = s.count_ones() as usize;
            *p += fact(k) * fact(WIDTH - k - 1) / fact(WIDTH) * (v(s | 1 << f) - v(s));
        }
    }
    (v(0), phi)
}

fn row(rng: &mut SplitMix64) -> Vec<f32> {
    row_of(rng, WIDTH)
}

fn row_of(rng: &mut SplitMix64, width: usize) -> Vec<f32> {
    (0..width)
        .map(|_| match rng.below(8) {
            0 => f32::NAN,
            1 => 0.0,
            2 => rng.below(40) as f32,
            _ => rng.normal(),
        })
        .collect()
}

const ALGORITHMS: [TreeAlgorithm; 2] = [TreeAlgorithm::Quadrature, TreeAlgorithm::Classic];

#[test]
fn tree_shap_is_the_shapley_values_of_the_cover_weighted_expectation() {
    for algorithm in ALGORITHMS {
        let mut rng = SplitMix64::new(37);
        for seed in 0..40 {
            let e = random_ensemble(seed, 1 + seed as usize % 4, 1 + seed as usize % 6);
            let model = tree_model(e.clone(), None);
            let explainer = Explainer::with_tree_algorithm(model, algorithm).unwrap();
            assert_eq!(explainer.tree_algorithm(), Some(algorithm));
            let mut scratch = explainer.scratch();
            let mut phi = vec![0.0; WIDTH];
            for _ in 0..20 {
                let x = row(&mut rng);
                let bias = explainer.explain(&x, &mut scratch, &mut phi).unwrap();
                let (want_bias, want) = brute_force(&e, &x);
                let at = format!("{algorithm:?} seed {seed} x {x:?}");
                assert!((bias - want_bias).abs() <= 1e-9, "{at}: bias {bias} vs {want_bias}");
                for f in 0..WIDTH {
                    assert!((phi[f] - want[f]).abs() <= 1e-9, "{at} feature {f}: {phi:?} vs {want:?}");
                }
                let margin = e.predict_row(&x) as f64;
                let sum = bias + phi.iter().sum::<f64>();
                assert!((sum - margin).abs() <= 1e-5 * (1.0 + margin.abs()), "{at}: {sum} vs {margin}");
            }
        }
    }
}

/// Where the definition is out of reach (dozens of features), the
/// quadrature against the classic algorithm: deep narrow trees (so
/// every lane count, features split on again and again), and wide
/// ones (many distinct features on a path).
#[test]
fn the_quadrature_is_the_classic_algorithm_on_deep_and_wide_trees() {
    let mut rng = SplitMix64::new(8);
    let mut lanes_seen = std::collections::BTreeSet::new();
    for (seed, trees, depth, width, stop) in [
        (1, 6, 8, 40, 8),
        (2, 20, 6, 28, 6),
        (3, 4, 16, 30, 3),
        (4, 4, 24, 12, 2),
        (5, 3, 40, 50, 2),
        (6, 3, 64, 64, 2),
        (7, 2, 64, 4, 2),
    ] {
        let e = random_ensemble_over(seed, trees, depth, width, stop, true);
        let model = tree_model_over(e.clone(), None, width);
        let fast = Explainer::new(model.clone()).unwrap();
        let classic = Explainer::with_tree_algorithm(model, TreeAlgorithm::Classic).unwrap();
        let Method::Trees(t) = &fast.method else { unreachable!() };
        lanes_seen.insert(t.quadrature.as_ref().unwrap().lanes);
        let (mut s1, mut s2) = (fast.scratch(), classic.scratch());
        let (mut a, mut b) = (vec![0.0; width], vec![0.0; width]);
        for _ in 0..20 {
            let x = row_of(&mut rng, width);
            let bias = fast.explain(&x, &mut s1, &mut a).unwrap();
            assert_eq!(bias, classic.explain(&x, &mut s2, &mut b).unwrap());
            for f in 0..width {
                let err = (a[f] - b[f]).abs() / b[f].abs().max(1.0);
                assert!(err <= 1e-9, "seed {seed} depth {} feature {f}: {} vs {}", e.depth_max(), a[f], b[f]);
            }
            let margin = e.predict_row(&x) as f64;
            let sum = bias + a.iter().sum::<f64>();
            assert!((sum - margin).abs() <= 1e-5 * (1.0 + margin.abs()), "seed {seed}: {sum} vs {margin}");
        }
    }
    assert_eq!(lanes_seen.into_iter().collect::<Vec<_>>(), [4, 8, 16, 32], "every compiled width is exercised");
}

/// Every vector build the CPU runs gives the same contributions.
#[test]
fn every_vector_build_computes_the_same() {
    let width = 28;
    let e = random_ensemble_over(11, 30, 8, width, 6, false);
    let mut explainer = Explainer::new(tree_model_over(e, None, width)).unwrap();
    let mut scratch = explainer.scratch();
    let mut rng = SplitMix64::new(3);
    let rows: Vec<Vec<f32>> = (0..20).map(|_| row_of(&mut rng, width)).collect();
    let mut want: Vec<Vec<f64>> = Vec::new();
    for isa in Isa::available() {
        let Method::Trees(t) = &mut explainer.method else { unreachable!() };
        t.quadrature.as_mut().unwrap().isa = isa;
        for (r, x) in rows.iter().enumerate() {
            let mut phi = vec![0.0; width];
            explainer.explain(x, &mut scratch, &mut phi).unwrap();
            if isa == Isa::Baseline {
                want.push(phi);
                continue;
            }
            for f in 0..width {
                assert!((phi[f] - want[r][f]).abs() <= 1e-12, "{isa:?} row {r} feature {f}");
            }
        }
    }
}

#[test]
fn gauss_legendre_integrates_polynomials_below_twice_its_points_exactly() {
    for n in [1, 2, 3, 4, 8, 16, 32] {
        let (t, w) = gauss_legendre(n);
        assert!(t.iter().all(|&t| t > 0.0 && t < 1.0), "{n}: {t:?}");
        for j in 0..2 * n {
            let got: f64 = t.iter().zip(&w).map(|(t, w)| w * t.powi(j as i32)).sum();
            let want = 1.0 / (j + 1) as f64;
            assert!((got - want).abs() <= 1e-14, "{n} points, t^{j}: {got} vs {want}");
        }
    }
    assert_eq!([1, 8, 9, 16, 17, 33, 64].map(lanes_for), [4, 4, 8, 8, 16, 32, 32]);
}

/// A scratch made by an explainer of other lanes and depth is
/// reallocated, not misread.
#[test]
fn a_scratch_made_by_another_explainer_still_explains() {
    let deep = random_ensemble_over(5, 3, 40, WIDTH, 2, true);
    let shallow = random_ensemble(6, 3, 3);
    let (deep, shallow) =
        (Explainer::new(tree_model(deep, None)).unwrap(), Explainer::new(tree_model(shallow, None)).unwrap());
    let x = row(&mut SplitMix64::new(2));
    let (mut a, mut b) = (vec![0.0; WIDTH], vec![0.0; WIDTH]);
    let mut foreign = shallow.scratch();
    deep.explain(&x, &mut foreign, &mut a).unwrap();
    deep.explain(&x, &mut deep.scratch(), &mut b).unwrap();
    assert_eq!(a, b);
}

#[test]
fn an_affine_of_the_sum_scales_the_contributions_and_moves_the_bias() {
    let e = random_ensemble(5, 3, 4);
    let (plain, scaled) = (
        Explainer::new(tree_model(e.clone(), None)).unwrap(),
        Explainer::new(tree_model(e, Some((0.5, 2.0, -1.0)))).unwrap(),
    );
    let mut scratch = plain.scratch();
    let (mut a, mut b) = (vec![0.0; WIDTH], vec![0.0; WIDTH]);
    let x = row(&mut SplitMix64::new(1));
    let bias_a = plain.explain(&x, &mut scratch, &mut a).unwrap();
    let bias_b = scaled.explain(&x, &mut scratch, &mut b).unwrap();
    assert_eq!(bias_b, (bias_a - 0.5) * 2.0 - 1.0);
    assert_eq!(b, a.iter().map(|v| v * 2.0).collect::<Vec<_>>());
    assert_eq!(scaled.bias(), bias_b);
}

#[test]
fn models_that_cannot_be_explained_exactly_are_refused_with_the_reason() {
    let mut bare = random_ensemble(3, 2, 3);
    bare.covers.clear();
    let err = Explainer::new(tree_model(bare, None)).unwrap_err();
    assert!(matches!(err, ExplainError::NoCovers { .. }), "{err}");
    assert!(err.to_string().contains("ONNX tree ensembles have none"), "{err}");

    let mut zero = random_ensemble(3, 2, 3);
    zero.covers[0] = 0.0;
    let err = Explainer::new(tree_model(zero, None)).unwrap_err();
    assert_eq!(err, ExplainError::ZeroCover { model: "trees".into(), tree: 0, node: 0, cover: 0.0 });

    let err = Explainer::new(Arc::new(tiny())).unwrap_err();
    assert!(matches!(err, ExplainError::NotExplainable { .. }), "{err}");
    assert!(err.to_string().contains("an MLP of 2 layers cannot be explained exactly"), "{err}");

    let explainer = Explainer::new(tree_model(random_ensemble(3, 2, 3), None)).unwrap();
    let mut scratch = explainer.scratch();
    let err = explainer.explain(&[0.0; 4], &mut scratch, &mut [0.0; WIDTH]).unwrap_err();
    assert_eq!(err, ExplainError::Width { model: "trees".into(), want: 5, got: 4 });
    let err = explainer.explain(&[0.0; 5], &mut scratch, &mut [0.0; 6]).unwrap_err();
    assert_eq!(err, ExplainError::Width { model: "trees".into(), want: 5, got: 6 });
}

fn linear_row() -> (Vec<f32>, f32) {
    (vec![0.5, -1.25, 2.0, 0.0, 3.0], -0.75)
}

#[test]
fn a_logistic_regression_explains_as_its_weights_times_the_inputs() {
    let (w, b) = linear_row();
    let model = Model {
        inputs: vec![InputSegment { source: Source::Context, dim: WIDTH }],
        layers: vec![crate::model::Layer::quantize(WIDTH, 1, false, w.clone(), vec![b])],
        calibration: None,
        ..tiny()
    };
    model.validate().unwrap();
    let explainer = Explainer::new(Arc::new(model)).unwrap();
    let mut scratch = explainer.scratch();
    let mut phi = vec![0.0; WIDTH];
    let x = [1.0, 2.0, f32::NAN, 7.0, -0.5];
    let bias = explainer.explain(&x, &mut scratch, &mut phi).unwrap();
    // No scaler: the baseline is 0, the bias the intercept; a NaN reads
    // as 0, as the model reads it.
    assert_eq!(bias, b as f64);
    assert_eq!(phi, vec![0.5, -2.5, 0.0, 0.0, -1.5]);
}

#[test]
fn a_scaler_pipeline_explains_against_the_scaler_center() {
    let (w, b) = linear_row();
    let center = vec![1.0f32, -2.0, 0.5, 4.0, 0.0];
    let scale = vec![0.5f32, 2.0, 1.0, 0.25, 4.0];
    let nodes = vec![
        Node { op: Op::Input { offset: 0 }, inputs: vec![], width: WIDTH },
        Node {
            op: Op::Affine { center: center.clone(), scale: scale.clone(), shift: vec![0.0; WIDTH] },
            inputs: vec![0],
            width: WIDTH,
        },
        Node {
            op: Op::Dense {
                layer: crate::model::Layer::quantize(WIDTH, 1, false, w.clone(), vec![b]),
                act: crate::model::Act::None,
            },
            inputs: vec![1],
            width: 1,
        },
        Node { op: Op::Affine { center: vec![0.0], scale: vec![2.0], shift: vec![0.0] }, inputs: vec![2], width: 1 },
    ];
    let graph = Graph { nodes, output: OutputKind::Logit };
    let model = Model {
        inputs: vec![InputSegment { source: Source::Context, dim: WIDTH }],
        layers: Vec::new(),
        calibration: None,
        graph: Some(graph.clone()),
        ..tiny()
    };
    model.validate().unwrap();
    let explainer = Explainer::new(Arc::new(model)).unwrap();
    let mut scratch = explainer.scratch();
    let mut phi = vec![0.0; WIDTH];
    let mut rng = SplitMix64::new(4);
    for _ in 0..20 {
        let x: Vec<f32> = (0..WIDTH).map(|_| rng.normal() * 3.0).collect();
        let bias = explainer.explain(&x, &mut scratch, &mut phi).unwrap();
        // margin = 2 (w · (x − c) s + b): at x = c it is 2b.
        assert_eq!(bias, 2.0 * b as f64);
        for i in 0..WIDTH {
            let want = 2.0 * w[i] as f64 * scale[i] as f64 * (x[i] as f64 - center[i] as f64);
            assert!((phi[i] - want).abs() <= 1e-12 * (1.0 + want.abs()), "{i}: {} vs {want}", phi[i]);
        }
        let margin = graph.forward_row(&x) as f64;
        let sum = bias + phi.iter().sum::<f64>();
        assert!((sum - margin).abs() <= 1e-5 * (1.0 + margin.abs()), "{sum} vs {margin}");
    }
}

#[test]
fn graphs_that_are_not_linear_nor_trees_are_refused() {
    let (w, b) = linear_row();
    let nodes = vec![
        Node { op: Op::Input { offset: 0 }, inputs: vec![], width: WIDTH },
        Node {
            op: Op::Dense {
                layer: crate::model::Layer::quantize(WIDTH, 1, false, w, vec![b]),
                act: crate::model::Act::None,
            },
            inputs: vec![0],
            width: 1,
        },
        Node { op: Op::Act(crate::model::Act::Tanh), inputs: vec![1], width: 1 },
    ];
    let model = Model {
        inputs: vec![InputSegment { source: Source::Context, dim: WIDTH }],
        layers: Vec::new(),
        calibration: None,
        graph: Some(Graph { nodes, output: OutputKind::Logit }),
        ..tiny()
    };
    model.validate().unwrap();
    let err = Explainer::new(Arc::new(model)).unwrap_err();
    assert!(err.to_string().contains("a graph model of 3 nodes that is neither linear nor trees"), "{err}");
}

#[test]
fn a_model_served_only_through_onnxruntime_is_refused() {
    use crate::model::{OnnxElement, OnnxGraph, OnnxInput};
    let model = Model {
        inputs: vec![InputSegment { source: Source::Context, dim: WIDTH }],
        layers: Vec::new(),
        calibration: None,
        graph: None,
        onnx: Some(OnnxGraph {
            bytes: vec![8u8, 1, 2, 3].into(),
            inputs: vec![OnnxInput { name: "x".into(), width: WIDTH, element: OnnxElement::Float, rank: 2 }],
            output: "p".into(),
            output_column: 0,
            output_probability: false,
            output_kind: OutputKind::Logit,
        }),
        ..tiny()
    };
    model.validate().unwrap();
    let err = Explainer::new(Arc::new(model)).unwrap_err();
    assert_eq!(
        err,
        ExplainError::NotExplainable { model: "tiny".into(), kind: "a model served only through onnxruntime".into() }
    );
}

#[test]
fn the_scratch_is_bounded_by_the_deepest_tree_and_the_table_by_the_nodes() {
    assert_eq!(path_len(0), 3);
    assert_eq!(path_len(DEPTH_MAX), PATH_LEN_MAX);
    let e = random_ensemble(9, 4, 6);
    let (depth, nodes) = (e.depth_max(), e.nodes.len());
    let lone_leaves = (0..e.trees()).filter(|&t| e.tree(t).len() == 1).count();
    let model = tree_model(e, None);
    let classic = Explainer::with_tree_algorithm(model.clone(), TreeAlgorithm::Classic).unwrap();
    assert_eq!(classic.scratch().path.len(), path_len(depth));
    assert_eq!(classic.table_bytes(), 0);
    let fast = Explainer::new(model).unwrap();
    let walk = fast.scratch().walk;
    // The nodes of the largest tree and the dummy.
    let Method::Trees(t) = &fast.method else { unreachable!() };
    let q = t.quadrature.as_ref().unwrap();
    assert!(q.tree_nodes_max < 1 << (depth + 1));
    assert_eq!((walk.lanes, walk.nodes, walk.node.len()), (4, q.tree_nodes_max + 1, 5 * 4 * (q.tree_nodes_max + 1)));
    assert!(walk.phi.len() <= 4 * WIDTH);
    let trees = 4 - lone_leaves;
    // A level of each tree below its root: each tree's depth.
    fn below(tree: &[crate::model::trees::TreeNode], i: usize) -> usize {
        match tree[i].split {
            Split::Leaf { .. } => 0,
            _ => 1 + below(tree, tree[i].left as usize).max(below(tree, tree[i].right as usize)),
        }
    }
    let e = t.ensemble();
    let levels: usize = (0..e.trees()).map(|t| below(e.tree(t), 0)).sum();
    assert_eq!(q.levels.len(), levels);
    assert_eq!(fast.table_bytes(), (nodes - lone_leaves) * TABLE_NODE_BYTES + 8 * (trees + 1) + 20 * levels);
}

/// The table's branch-free rule is `trees::goes_left`, missing values,
/// zero-as-missing and categories included.
#[test]
fn the_table_routes_rows_as_the_model_does() {
    let e = random_ensemble_over(12, 40, 6, WIDTH, 4, false);
    let q = Quadrature::new(&e, e.depth_max());
    let mut rng = SplitMix64::new(5);
    let specials = [0.0, -0.0, 1e-36, -1e-36, 1e-30, f32::NAN, -1.0, 3.0, 31.5, 1e10];
    let mut checked = 0;
    for n in q.nodes.iter().filter(|n| n.flags & LEAF == 0) {
        for _ in 0..20 {
            let mut x = row(&mut rng);
            if rng.below(2) == 0 {
                x[n.feature as usize] = specials[rng.below(specials.len() as u64) as usize];
            }
            let want = goes_left(&n.split(), x[n.feature as usize], &e.cat_words);
            assert_eq!(n.goes_left(&x, &e.cat_words), want, "{:?} x {}", n.split(), x[n.feature as usize]);
            checked += 1;
        }
    }
    let kinds = |f: u8| q.nodes.iter().any(|n| n.flags & f != 0);
    assert!(checked > 1000 && kinds(CATEGORICAL) && kinds(ZERO_MISSING) && kinds(MISSING_LEFT));
}
