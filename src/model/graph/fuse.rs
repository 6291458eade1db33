//! Fusions found by evaluating a region of the graph, not by matching its
//! shape.
//!
//! Exporters spell a LayerNorm or a tanh-form GELU as a dozen elementwise
//! nodes, each in its own way: tf2onnx writes Keras's LayerNormalization
//! with `Neg`, `Reciprocal` and a broadcast of the reciprocal standard
//! deviation; torch below opset 17 with `ReduceMean`, `Sub`, `Pow`, `Sqrt`
//! and `Div`; Keras's GELU is eight nodes around one `Tanh`. Run node by
//! node, such a chain costs several passes over the row where one would do
//! (on `keras_ln_residual` it made INT8 slower than onnxruntime's f32 at
//! batch 256).
//!
//! Rather than one matcher per exporter, a *region* (the nodes between one
//! tensor `x` and a later tensor `out` that nothing outside the region
//! reads, with no input other than `x`) is evaluated on probe rows and
//! replaced by one `LayerNorm` or one activation when it computes exactly
//! that function, to f32 rounding, on every probe. A region that computes
//! anything else is left as it is, so a false match cannot slip through
//! as a different function.

use super::{Act, Graph, Node, Op};
use crate::seeded::SplitMix64;

/// How far after `x` a region may end, in nodes: the longest spelling
/// seen (tf2onnx's LayerNorm) is 14 internal nodes; this bounds the search
/// to `nodes × SPAN_NODES_MAX` regions.
const SPAN_NODES_MAX: usize = 40;

/// Probe rows each candidate is checked on.
const PROBE_ROWS: usize = 24;

/// The activations a region of elementwise nodes is compared with.
const ACTIVATIONS: [Act; 5] = [Act::GeluTanh, Act::GeluErf, Act::Silu, Act::Sigmoid, Act::Tanh];

/// Agreement required between a region and its replacement on a probe:
/// f32 rounding of a dozen operations, relative to the value's size.
fn agrees(a: f32, b: f32) -> bool {
    a.is_finite() && b.is_finite() && (a - b).abs() <= 1e-4 * (1.0 + a.abs().max(b.abs()))
}

impl Graph {
    /// Replaces one region by a `LayerNorm` or an activation; returns
    /// whether it did (the caller loops until nothing changes).
    pub(super) fn fuse_regions(&mut self, notes: &mut Vec<String>) -> bool {
        let consumers = self.consumers();
        let n = self.nodes.len();
        for x in 0..n {
            let w = self.nodes[x].width;
            // Largest region first: torch's LayerNorm is a LayerNorm before
            // its γ and β are applied, and the whole of it after.
            for out in ((x + 2)..n.min(x + 1 + SPAN_NODES_MAX)).rev() {
                if self.nodes[out].width != w {
                    continue;
                }
                let Some(region) = self.region(x, out, &consumers) else { continue };
                let fused = self.as_activation(x, &region).or_else(|| self.as_layer_norm(x, &region));
                let Some(op) = fused else { continue };
                notes.push(format!(
                    "fused {} nodes into one {} (node {out})",
                    region.len(),
                    match &op {
                        Op::Act(a) => a.name(),
                        _ => "LayerNorm".into(),
                    }
                ));
                for &k in &region[..region.len() - 1] {
                    self.nodes[k].inputs.clear();
                    self.nodes[k].op = Op::Concat;
                }
                self.nodes[out] = Node { op, inputs: vec![x], width: w };
                return true;
            }
        }
        false
    }

    /// The nodes after `x` up to `out` that `x` reaches and that reach
    /// `out`, in order, when they form a region: every input is `x` or in
    /// the region, nothing outside reads a node other than `out`, and
    /// every node is one that can be evaluated from `x` alone.
    fn region(&self, x: usize, out: usize, consumers: &[usize]) -> Option<Vec<usize>> {
        let mut from_x = vec![false; out + 1];
        from_x[x] = true;
        for k in x + 1..=out {
            from_x[k] = self.nodes[k].inputs.iter().any(|&j| from_x[j]);
        }
        if !from_x[out] {
            return None;
        }
        let mut to_out = vec![false; out + 1];
        to_out[out] = true;
        for k in (x + 1..=out).rev() {
            if to_out[k] {
                for &j in &self.nodes[k].inputs {
                    to_out[j] = true;
                }
            }
        }
        let inside: Vec<bool> = (0..=out).map(|k| k > x && from_x[k] && to_out[k]).collect();
        let region: Vec<usize> = (x + 1..=out).filter(|&k| inside[k]).collect();
        if region.len() < 2 {
            return None;
        }
        let mut reads = vec![0usize; out + 1];
        for &k in &region {
            let node = &self.nodes[k];
            if matches!(node.op, Op::Input { .. } | Op::Dense { .. } | Op::Embedding { .. } | Op::Trees(_)) {
                return None;
            }
            for &j in &node.inputs {
                if j != x && !inside[j] {
                    return None;
                }
                reads[j] += 1;
            }
        }
        let private = region[..region.len() - 1].iter().all(|&k| reads[k] == consumers[k]);
        private.then_some(region)
    }

    /// The region's output for one value of `x`.
    fn eval_region(&self, x: usize, region: &[usize], xv: &[f32]) -> Vec<f32> {
        let mut t: Vec<Vec<f32>> = vec![Vec::new(); region[region.len() - 1] + 1];
        t[x] = xv.to_vec();
        for &k in region {
            t[k] = self.node_value(&self.nodes[k], &t, &[]);
        }
        t.pop().expect("a region has nodes")
    }

    /// The activation an elementwise region computes: every node is an
    /// activation, a same-width binary op, or an affine with one scale and
    /// shift for every column, so each column sees the same function.
    fn as_activation(&self, x: usize, region: &[usize]) -> Option<Op> {
        let w = self.nodes[x].width;
        let uniform = |v: &[f32]| v.iter().all(|c| *c == v[0]);
        for &k in region {
            let node = &self.nodes[k];
            let ok = node.width == w
                && match &node.op {
                    Op::Act(_) => true,
                    Op::Add | Op::Sub | Op::Mul | Op::Div => node.inputs.iter().all(|&j| self.nodes[j].width == w),
                    Op::Affine { center, scale, shift } => uniform(center) && uniform(scale) && uniform(shift),
                    _ => false,
                };
            if !ok {
                return None;
            }
        }
        // Values from −8 to 8 (and 0) spread over the columns.
        let probes: Vec<f32> = (0..=256).map(|i| (i as f32 - 128.0) / 16.0).collect();
        let outs: Vec<(f32, f32)> = probes
            .chunks(w)
            .flat_map(|c| {
                let mut row = c.to_vec();
                row.resize(w, 0.0);
                let y = self.eval_region(x, region, &row);
                c.iter().copied().zip(y).collect::<Vec<_>>()
            })
            .collect();
        ACTIVATIONS.into_iter().find(|a| outs.iter().all(|&(v, y)| agrees(y, a.apply(v)))).map(Op::Act)
    }

    /// The `LayerNorm` a region computes over `x`'s row. Its epsilon is
    /// the one positive constant the region adds to a single value (the
    /// variance); its scale and shift are solved from a row and its
    /// negation; then the whole is checked on rows of small, unit and
    /// large spread, with and without an offset.
    fn as_layer_norm(&self, x: usize, region: &[usize]) -> Option<Op> {
        let w = self.nodes[x].width;
        if w < 2 {
            return None;
        }
        let mut eps = region.iter().filter_map(|&k| match &self.nodes[k].op {
            Op::Affine { center, scale, shift } if self.nodes[k].width == 1 => {
                (center[0] == 0.0 && scale[0] == 1.0 && shift[0] > 0.0).then_some(shift[0])
            }
            _ => None,
        });
        let (Some(epsilon), None) = (eps.next(), eps.next()) else { return None };
        // A row of zero mean whose normalised values are all far from 0.
        let mut p: Vec<f64> =
            (0..w).map(|i| if i % 2 == 0 { 1.0 } else { -1.0 } * (1.0 + (i % 3) as f64 / 2.0)).collect();
        let mean = p.iter().sum::<f64>() / w as f64;
        p.iter_mut().for_each(|v| *v -= mean);
        let var = p.iter().map(|v| v * v).sum::<f64>() / w as f64;
        let norm: Vec<f64> = p.iter().map(|v| v / (var + epsilon as f64).sqrt()).collect();
        if norm.iter().any(|v| v.abs() < 0.1) {
            return None;
        }
        let up: Vec<f32> = p.iter().map(|v| *v as f32).collect();
        let down: Vec<f32> = up.iter().map(|v| -v).collect();
        let (o1, o2) = (self.eval_region(x, region, &up), self.eval_region(x, region, &down));
        let scale: Vec<f32> = (0..w).map(|i| ((o1[i] as f64 - o2[i] as f64) / (2.0 * norm[i])) as f32).collect();
        let shift: Vec<f32> = (0..w).map(|i| ((o1[i] as f64 + o2[i] as f64) / 2.0) as f32).collect();
        if !scale.iter().chain(&shift).all(|v| v.is_finite()) {
            return None;
        }
        let op = Op::LayerNorm { epsilon, scale, shift };
        let fused = Node { op, inputs: vec![x], width: w };
        let mut rng = SplitMix64::new(0x1a7e);
        // Spreads from well under epsilon's square root to large.
        let spread = [epsilon.sqrt() * 0.3, epsilon.sqrt() * 3.0, 1.0, 40.0];
        for r in 0..PROBE_ROWS {
            let (s, offset) = (spread[r % spread.len()], if r % 3 == 0 { 3.0 } else { 0.0 });
            let row: Vec<f32> = (0..w).map(|_| rng.normal() * s + offset).collect();
            let want = self.eval_region(x, region, &row);
            let mut t = vec![Vec::new(); x + 1];
            t[x] = row;
            let got = self.node_value(&fused, &t, &[]);
            if !want.iter().zip(&got).all(|(a, b)| agrees(*a, *b)) {
                return None;
            }
        }
        Some(fused.op)
    }
}

#[cfg(test)]
mod tests {
    use super::super::OutputKind;
    use super::*;
    use crate::model::Layer;

    fn node(op: Op, inputs: Vec<usize>, width: usize) -> Node {
        Node { op, inputs, width }
    }

    fn affine(input: usize, width: usize, scale: f32, shift: f32) -> Node {
        let op = Op::Affine { center: vec![0.0; width], scale: vec![scale; width], shift: vec![shift; width] };
        node(op, vec![input], width)
    }

    fn head(input: usize, k: usize) -> Node {
        let w = (0..k).map(|i| 0.3 - 0.1 * i as f32).collect();
        node(Op::Dense { layer: Layer::quantize(k, 1, false, w, vec![0.1]), act: Act::None }, vec![input], 1)
    }

    fn input(width: usize) -> Node {
        node(Op::Input { offset: 0 }, vec![], width)
    }

    /// torch's LayerNorm below opset 17: mean, centre, square, mean, + ε,
    /// √, divide, × γ, + β.
    fn torch_layer_norm(w: usize, eps: f32, gamma: Vec<f32>, beta: Vec<f32>) -> Graph {
        let mean = 1.0 / w as f32;
        let nodes = vec![
            input(w),
            node(Op::Sum, vec![0], 1),
            affine(1, 1, mean, 0.0),
            node(Op::Sub, vec![0, 2], w),
            node(Op::Mul, vec![3, 3], w),
            node(Op::Sum, vec![4], 1),
            affine(5, 1, mean, 0.0),
            affine(6, 1, 1.0, eps),
            node(Op::Act(Act::Sqrt), vec![7], 1),
            node(Op::Div, vec![3, 8], w),
            node(Op::Affine { center: vec![0.0; w], scale: gamma, shift: vec![0.0; w] }, vec![9], w),
            node(Op::Affine { center: vec![0.0; w], scale: vec![1.0; w], shift: beta }, vec![10], w),
            head(11, w),
        ];
        Graph { nodes, output: OutputKind::Logit }
    }

    fn same_function(a: &Graph, b: &Graph, w: usize) {
        let mut rng = SplitMix64::new(3);
        for s in [0.01, 1.0, 50.0] {
            let x: Vec<f32> = (0..w).map(|_| rng.normal() * s + 1.0).collect();
            let (p, q) = (a.forward_row(&x), b.forward_row(&x));
            assert!((p - q).abs() <= 1e-5 * (1.0 + p.abs()), "{p} vs {q}");
        }
    }

    #[test]
    fn a_decomposed_layer_norm_becomes_one_node() {
        let gamma = vec![1.5, -0.5, 2.0, 0.25, 1.0];
        let beta = vec![0.1, 0.0, -0.3, 2.0, 0.5];
        let g = torch_layer_norm(5, 1e-3, gamma.clone(), beta.clone());
        g.validate(5).unwrap();
        let (s, notes) = g.clone().simplify();
        s.validate(5).unwrap();
        assert!(notes.iter().any(|n| n == "fused 10 nodes into one LayerNorm (node 11)"), "{notes:?}");
        assert_eq!(s.nodes.len(), 3, "{:?}", s.nodes);
        let Op::LayerNorm { epsilon, scale, shift } = &s.nodes[1].op else { panic!("{:?}", s.nodes[1]) };
        assert_eq!(*epsilon, 1e-3);
        for (got, want) in scale.iter().zip(&gamma).chain(shift.iter().zip(&beta)) {
            assert!((got - want).abs() <= 1e-5, "{scale:?} {shift:?}");
        }
        same_function(&g, &s, 5);
    }

    #[test]
    fn a_region_that_is_not_a_layer_norm_is_left_alone() {
        // Centring by the mean without dividing by the deviation.
        let mut g = torch_layer_norm(4, 1e-5, vec![1.0; 4], vec![0.0; 4]);
        g.nodes[9] = node(Op::Mul, vec![3, 8], 4);
        let (s, notes) = g.clone().simplify();
        assert!(!notes.iter().any(|n| n.contains("LayerNorm")), "{notes:?}");
        same_function(&g, &s, 4);
        // The right shape with a second reader of an inner node: not a region.
        let mut g = torch_layer_norm(4, 1e-5, vec![1.0; 4], vec![0.0; 4]);
        g.nodes.push(node(Op::Concat, vec![12, 8], 2));
        g.nodes.push(head(13, 2));
        let (_, notes) = g.simplify();
        assert!(!notes.iter().any(|n| n.contains("LayerNorm")), "{notes:?}");
    }

    #[test]
    fn keras_tanh_gelu_becomes_one_activation_and_fuses_into_its_dense() {
        // ½x · (1 + tanh(√(2/π) · (x + 0.044715 · x³))), as Keras writes it.
        let w = 3;
        let c = (2.0f32 / std::f32::consts::PI).sqrt();
        let wts = vec![0.5, -0.25, 1.0, 0.75, 0.1, -1.0, 0.2, 0.3, -0.4];
        let nodes = vec![
            input(w),
            node(Op::Dense { layer: Layer::quantize(w, w, false, wts, vec![0.0; w]), act: Act::None }, vec![0], w),
            affine(1, w, 0.5, 0.0),
            node(Op::Mul, vec![1, 1], w),
            node(Op::Mul, vec![3, 1], w),
            affine(4, w, 0.044715, 0.0),
            node(Op::Add, vec![1, 5], w),
            affine(6, w, c, 0.0),
            node(Op::Act(Act::Tanh), vec![7], w),
            affine(8, w, 1.0, 1.0),
            node(Op::Mul, vec![2, 9], w),
            head(10, w),
        ];
        let g = Graph { nodes, output: OutputKind::Logit };
        let (s, notes) = g.clone().simplify();
        s.validate(w).unwrap();
        assert!(notes.iter().any(|n| n.contains("into one GELU (tanh)")), "{notes:?}");
        assert!(matches!(s.nodes[1].op, Op::Dense { act: Act::GeluTanh, .. }), "{:?}", s.nodes);
        assert_eq!(s.nodes.len(), 3);
        same_function(&g, &s, w);
        // The same chain with another constant is no known activation.
        let mut h = g.clone();
        h.nodes[5] = affine(4, w, 0.5, 0.0);
        let (_, notes) = h.simplify();
        assert!(!notes.iter().any(|n| n.contains("GELU")), "{notes:?}");
    }
}
