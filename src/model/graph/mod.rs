//! Graph models (model file v2): a small typed graph of nodes over
//! per-candidate tensors, for the models users bring that are not a plain
//! chain of dense layers (BatchNorm, LayerNorm, GELU, residuals, Wide&Deep,
//! DCN-v2 cross layers, two-tower dot products, embeddings of categorical
//! ids, scalers).
//!
//! Every tensor is `[rows][width]` floats; node `i` reads earlier nodes only,
//! by index, so a graph is acyclic by construction and the order of `nodes`
//! is a valid schedule. The last node is the output: one value per row, a
//! logit (the server returns its sigmoid) or a raw value (regression).
//!
//! [`Graph::forward_row`] is the f32 specification every backend is
//! compared with: slow and allocating on purpose. The serving executors
//! live in the scoring layer (`score::cpu::executor`). The rewrites in this module
//! ([`Graph::simplify`]) are exact in f32 and are what `quiver import`
//! reports in its summary.

use super::embedding::EmbeddingTable;
use super::trees::Ensemble;
use super::{Layer, WIDTH_MAX};

mod fuse;

/// Most nodes in one graph.
pub const NODES_MAX: usize = 256;
/// Most rows in one embedding table: a row index arrives as an f32, exact
/// for integers up to 2^24 (the request path sends larger ids as missing).
pub const EMBEDDING_ROWS_MAX: usize = 1 << 24;
/// Most floats in one graph's embedding tables together (16 GiB). Loading
/// serves them from the mapped model file, not the heap, so they are bounded
/// apart from the other parameters; loading still reads every one of them
/// once (the finiteness check).
pub const EMBEDDING_FLOATS_MAX: usize = 1 << 32;
/// Most parameters (floats) in one graph besides its embedding tables, all
/// nodes together: what loading copies into the heap.
pub const PARAMS_MAX: usize = 1 << 28;
/// Most floats all of a graph's tensors take for one row; bounds the
/// executors' buffers (rows × this).
pub const ROW_FLOATS_MAX: usize = 1 << 18;

/// An elementwise activation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Act {
    None,
    Relu,
    LeakyRelu(f32),
    Tanh,
    Sigmoid,
    /// `x · ½ · (1 + erf(x / √2))`, the form `torch.onnx.export` writes.
    GeluErf,
    /// `½ x (1 + tanh(√(2/π) (x + 0.044715 x³)))`.
    GeluTanh,
    /// `x · sigmoid(x)`.
    Silu,
    Erf,
    Sqrt,
}

impl Act {
    /// The activation in f32, as the reference and every CPU backend
    /// compute it.
    #[inline]
    pub fn apply(self, x: f32) -> f32 {
        match self {
            Act::None => x,
            Act::Relu => x.max(0.0),
            Act::LeakyRelu(alpha) => {
                if x >= 0.0 {
                    x
                } else {
                    x * alpha
                }
            }
            Act::Tanh => x.tanh(),
            Act::Sigmoid => 1.0 / (1.0 + (-x).exp()),
            Act::GeluErf => x * (libm::erff(x / std::f32::consts::SQRT_2) + 1.0) * 0.5,
            Act::GeluTanh => {
                let c = (2.0f32 / std::f32::consts::PI).sqrt();
                0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
            }
            Act::Silu => x / (1.0 + (-x).exp()),
            Act::Erf => libm::erff(x),
            Act::Sqrt => x.sqrt(),
        }
    }

    pub fn name(self) -> String {
        match self {
            Act::None => "none".into(),
            Act::Relu => "ReLU".into(),
            Act::LeakyRelu(a) => format!("LeakyReLU({a})"),
            Act::Tanh => "Tanh".into(),
            Act::Sigmoid => "Sigmoid".into(),
            Act::GeluErf => "GELU (erf)".into(),
            Act::GeluTanh => "GELU (tanh)".into(),
            Act::Silu => "SiLU".into(),
            Act::Erf => "Erf".into(),
            Act::Sqrt => "Sqrt".into(),
        }
    }
}

/// What a node computes.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// Columns `offset..offset + width` of the input vector.
    Input {
        offset: usize,
    },
    /// A dense layer (its `relu` false) followed by `act`.
    Dense {
        layer: Layer,
        act: Act,
    },
    Act(Act),
    /// Elementwise; the second input may be one wide (broadcast).
    Add,
    Sub,
    Mul,
    Div,
    /// `(x − center[i]) · scale[i] + shift[i]`, kept in f32.
    Affine {
        center: Vec<f32>,
        scale: Vec<f32>,
        shift: Vec<f32>,
    },
    Concat,
    /// `(x − mean) / √(var + epsilon) · scale + shift` over the row.
    LayerNorm {
        epsilon: f32,
        scale: Vec<f32>,
        shift: Vec<f32>,
    },
    /// Row-wise dot product of two equal-width inputs.
    Dot,
    /// Row-wise sum.
    Sum,
    /// Each input value indexes a row of `table` (`[rows][dim]`); the rows
    /// go side by side. A value that is not an integer in `0..rows` reads
    /// `default` instead. A loaded model's table is a view of its mapped
    /// file, shared by every clone (`model::embedding`).
    Embedding {
        dim: usize,
        rows: usize,
        table: EmbeddingTable,
        default: Vec<f32>,
    },
    /// A tree ensemble over the input's columns (`model::trees`): one value.
    Trees(Ensemble),
}

impl Op {
    pub fn name(&self) -> &'static str {
        match self {
            Op::Input { .. } => "Input",
            Op::Dense { .. } => "Dense",
            Op::Act(_) => "Activation",
            Op::Add => "Add",
            Op::Sub => "Sub",
            Op::Mul => "Mul",
            Op::Div => "Div",
            Op::Affine { .. } => "Affine",
            Op::Concat => "Concat",
            Op::LayerNorm { .. } => "LayerNorm",
            Op::Dot => "Dot",
            Op::Sum => "Sum",
            Op::Embedding { .. } => "Embedding",
            Op::Trees(_) => "Trees",
        }
    }

    fn params(&self) -> usize {
        match self {
            Op::Dense { layer, .. } => layer.weights_f32.len() + layer.bias.len(),
            Op::Affine { center, scale, shift } => center.len() + scale.len() + shift.len(),
            Op::LayerNorm { scale, shift, .. } => scale.len() + shift.len(),
            Op::Embedding { default, .. } => default.len(),
            Op::Trees(e) => 4 * e.nodes.len() + e.cat_words.len(),
            _ => 0,
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    pub op: Op,
    /// Indices of earlier nodes.
    pub inputs: Vec<usize>,
    pub width: usize,
}

/// What the output value is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputKind {
    /// A logit: the server returns `sigmoid(logit)`.
    Logit,
    /// A raw value (price, bid shading), returned as is.
    Raw,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Graph {
    pub nodes: Vec<Node>,
    pub output: OutputKind,
}

/// The embedding row `v` selects, or `None` for the default row.
#[inline]
pub fn embedding_index(v: f32, rows: usize) -> Option<usize> {
    (v >= 0.0 && v < rows as f32 && v.fract() == 0.0).then_some(v as usize)
}

impl Graph {
    /// Checks arity, widths, parameter sizes and limits, that every input
    /// is an earlier node, and that every node reaches the output. Errors
    /// name the node.
    pub fn validate(&self, input_dim: usize) -> Result<(), String> {
        let n = self.nodes.len();
        if n == 0 || n > NODES_MAX {
            return Err(format!("the graph has {n} nodes; 1 to {NODES_MAX} allowed"));
        }
        let mut params = 0usize;
        let mut table_floats = 0usize;
        let mut row_floats = 0usize;
        let mut used = vec![false; n];
        for (i, node) in self.nodes.iter().enumerate() {
            let at = |what: String| format!("node {i} ({}): {what}", node.op.name());
            if node.width == 0 || node.width > WIDTH_MAX {
                return Err(at(format!("width {} is outside 1..={WIDTH_MAX}", node.width)));
            }
            for &j in &node.inputs {
                if j >= i {
                    return Err(at(format!(
                        "reads node {j}, which does not come before it (a cycle or a dangling input)"
                    )));
                }
                used[j] = true;
            }
            let w = |k: usize| self.nodes[node.inputs[k]].width;
            let arity = |want: usize| {
                if node.inputs.len() == want {
                    Ok(())
                } else {
                    Err(at(format!("has {} inputs; {want} expected", node.inputs.len())))
                }
            };
            let same_width = |k: usize| {
                if w(k) == node.width {
                    Ok(())
                } else {
                    Err(at(format!("its input is {} wide but it declares width {}", w(k), node.width)))
                }
            };
            let finite = |v: &[f32]| v.iter().all(|x| x.is_finite());
            let len_is = |v: &[f32], what: &str| {
                if v.len() == node.width && finite(v) {
                    Ok(())
                } else {
                    Err(at(format!("{what} has {} values (or a non-finite one); {} expected", v.len(), node.width)))
                }
            };
            match &node.op {
                Op::Input { offset } => {
                    arity(0)?;
                    if offset + node.width > input_dim {
                        return Err(at(format!(
                            "reads input columns {offset}..{} of an input vector of {input_dim}",
                            offset + node.width
                        )));
                    }
                }
                Op::Dense { layer, act } => {
                    arity(1)?;
                    if layer.in_dim != w(0) || layer.out_dim != node.width {
                        return Err(at(format!(
                            "is {} -> {} but reads {} and declares width {}",
                            layer.in_dim,
                            layer.out_dim,
                            w(0),
                            node.width
                        )));
                    }
                    let k = layer.in_dim * layer.out_dim;
                    if layer.weights_f32.len() != k || layer.weights_i8.len() != k {
                        return Err(at(format!("weights are not {} x {}", layer.out_dim, layer.in_dim)));
                    }
                    if layer.weight_scales.len() != layer.out_dim || layer.bias.len() != layer.out_dim {
                        return Err(at(format!("scales or bias are not of length {}", layer.out_dim)));
                    }
                    let scales_ok = layer.weight_scales.iter().all(|s| s.is_finite() && *s > 0.0);
                    if !finite(&layer.weights_f32) || !finite(&layer.bias) || !scales_ok {
                        return Err(at("holds a non-finite weight or a non-positive scale".into()));
                    }
                    if layer.relu {
                        return Err(at("a graph Dense carries its activation in the node, not the layer".into()));
                    }
                    act_ok(*act).map_err(at)?;
                }
                Op::Act(act) => {
                    arity(1)?;
                    same_width(0)?;
                    act_ok(*act).map_err(at)?;
                }
                Op::Add | Op::Sub | Op::Mul | Op::Div => {
                    arity(2)?;
                    same_width(0)?;
                    if w(1) != node.width && w(1) != 1 {
                        return Err(at(format!(
                            "its inputs are {} and {} wide; equal widths or a 1-wide second input expected",
                            w(0),
                            w(1)
                        )));
                    }
                }
                Op::Affine { center, scale, shift } => {
                    arity(1)?;
                    same_width(0)?;
                    len_is(center, "center")?;
                    len_is(scale, "scale")?;
                    len_is(shift, "shift")?;
                }
                Op::Concat => {
                    if node.inputs.is_empty() {
                        return Err(at("has no inputs".into()));
                    }
                    let total: usize = (0..node.inputs.len()).map(w).sum();
                    if total != node.width {
                        return Err(at(format!("its inputs are {total} wide together but it declares {}", node.width)));
                    }
                }
                Op::LayerNorm { epsilon, scale, shift } => {
                    arity(1)?;
                    same_width(0)?;
                    if !(epsilon.is_finite() && *epsilon > 0.0) {
                        return Err(at(format!("epsilon {epsilon} is not a positive number")));
                    }
                    len_is(scale, "scale")?;
                    len_is(shift, "shift")?;
                }
                Op::Dot => {
                    arity(2)?;
                    if w(0) != w(1) || node.width != 1 {
                        return Err(at(format!("reads {} and {} wide inputs into width {}", w(0), w(1), node.width)));
                    }
                }
                Op::Sum => {
                    arity(1)?;
                    if node.width != 1 {
                        return Err(at(format!("declares width {}; a row sum is 1 wide", node.width)));
                    }
                }
                Op::Embedding { dim, rows, table, default } => {
                    arity(1)?;
                    if *rows == 0 || *rows > EMBEDDING_ROWS_MAX {
                        return Err(at(format!("has {rows} rows; 1 to {EMBEDDING_ROWS_MAX} allowed")));
                    }
                    if *dim == 0 || w(0) * dim != node.width {
                        return Err(at(format!("reads {} indices of {dim} floats into width {}", w(0), node.width)));
                    }
                    let shape_ok = rows.checked_mul(*dim) == Some(table.len()) && default.len() == *dim;
                    if !shape_ok || !all_finite(table) || !finite(default) {
                        return Err(at(format!("its table is not {rows} x {dim} finite floats with a default row")));
                    }
                    table_floats = table_floats.saturating_add(table.len());
                }
                Op::Trees(e) => {
                    arity(1)?;
                    if node.width != 1 {
                        return Err(at(format!("declares width {}; a tree ensemble is 1 wide", node.width)));
                    }
                    e.validate(w(0)).map_err(at)?;
                }
            }
            params = params.saturating_add(node.op.params());
            row_floats = row_floats.saturating_add(node.width);
        }
        if params > PARAMS_MAX {
            return Err(format!(
                "the graph has {params} parameters besides its embedding tables; the limit is {PARAMS_MAX}"
            ));
        }
        if table_floats > EMBEDDING_FLOATS_MAX {
            return Err(format!(
                "the graph's embedding tables hold {table_floats} floats; the limit is {EMBEDDING_FLOATS_MAX}"
            ));
        }
        if row_floats > ROW_FLOATS_MAX {
            return Err(format!("the graph's tensors take {row_floats} floats per row; the limit is {ROW_FLOATS_MAX}"));
        }
        let last = &self.nodes[n - 1];
        if last.width != 1 {
            return Err(format!("the output node {} is {} wide; one value per candidate expected", n - 1, last.width));
        }
        if let Some(i) = used[..n - 1].iter().position(|u| !u) {
            return Err(format!("node {i} ({}) is dangling: nothing reads it", self.nodes[i].op.name()));
        }
        Ok(())
    }

    /// The widest tensor, for sizing scratch.
    pub fn width_max(&self) -> usize {
        self.nodes.iter().map(|n| n.width).max().unwrap_or(0)
    }

    /// Multiply-accumulates per row (dense layers, dots, layer norms).
    pub fn macs_per_row(&self) -> usize {
        self.nodes
            .iter()
            .map(|n| match &n.op {
                Op::Dense { layer, .. } => layer.in_dim * layer.out_dim,
                Op::Dot | Op::Mul | Op::Affine { .. } | Op::LayerNorm { .. } => n.width,
                _ => 0,
            })
            .sum()
    }

    /// The f32 specification for one input row: every node's tensor in
    /// order; returns the output value.
    pub fn forward_row(&self, x: &[f32]) -> f32 {
        let mut t: Vec<Vec<f32>> = Vec::with_capacity(self.nodes.len());
        for node in &self.nodes {
            let y = self.node_value(node, &t, x);
            t.push(y);
        }
        t.last().expect("validated graphs have nodes")[0]
    }

    /// One node's tensor in f32, from the tensors `t` of the nodes before
    /// it and the input row `x`.
    fn node_value(&self, node: &Node, t: &[Vec<f32>], x: &[f32]) -> Vec<f32> {
        let a = |k: usize| &t[node.inputs[k]];
        match &node.op {
            // A NaN (missing) input reads as 0, except in a tree
            // ensemble that reads the input itself.
            Op::Input { offset } => {
                x[*offset..offset + node.width].iter().map(|v| if v.is_nan() { 0.0 } else { *v }).collect()
            }
            Op::Dense { layer, act } => (0..layer.out_dim)
                .map(|o| {
                    let w = &layer.weights_f32[o * layer.in_dim..(o + 1) * layer.in_dim];
                    act.apply(w.iter().zip(a(0)).map(|(p, q)| p * q).sum::<f32>() + layer.bias[o])
                })
                .collect(),
            Op::Act(act) => a(0).iter().map(|v| act.apply(*v)).collect(),
            Op::Add | Op::Sub | Op::Mul | Op::Div => {
                let (p, q) = (a(0), a(1));
                (0..node.width)
                    .map(|i| {
                        let r = q[if q.len() == 1 { 0 } else { i }];
                        match node.op {
                            Op::Add => p[i] + r,
                            Op::Sub => p[i] - r,
                            Op::Mul => p[i] * r,
                            _ => p[i] / r,
                        }
                    })
                    .collect()
            }
            Op::Affine { center, scale, shift } => {
                a(0).iter().enumerate().map(|(i, v)| (v - center[i]) * scale[i] + shift[i]).collect()
            }
            Op::Concat => node.inputs.iter().flat_map(|&j| t[j].iter().copied()).collect(),
            Op::LayerNorm { epsilon, scale, shift } => {
                let v = a(0);
                let n = v.len() as f32;
                let mean = v.iter().sum::<f32>() / n;
                let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / n;
                let inv = 1.0 / (var + epsilon).sqrt();
                v.iter().enumerate().map(|(i, x)| (x - mean) * inv * scale[i] + shift[i]).collect()
            }
            Op::Dot => vec![a(0).iter().zip(a(1)).map(|(p, q)| p * q).sum()],
            Op::Sum => vec![a(0).iter().sum()],
            Op::Embedding { dim, rows, table, default } => a(0)
                .iter()
                .flat_map(|&v| match embedding_index(v, *rows) {
                    Some(r) => table[r * dim..(r + 1) * dim].iter(),
                    None => default.iter(),
                })
                .copied()
                .collect(),
            Op::Trees(e) => match self.nodes[node.inputs[0]].op {
                Op::Input { offset } => vec![e.predict_row(&x[offset..offset + self.nodes[node.inputs[0]].width])],
                _ => vec![e.predict_row(a(0))],
            },
        }
    }

    /// Exact rewrites, in order, returning what each did (for the import
    /// summary): an `Affine` right after a `Dense` that nothing else reads
    /// is folded into its weights (per-output-channel INT8 scales absorb
    /// the per-channel factor, so this costs no INT8 accuracy); an
    /// activation right after such a `Dense` is fused into it; the erf form
    /// of GELU becomes one activation; a LayerNorm or an activation spelled
    /// out node by node becomes one node (`fuse`, checked by evaluation); a
    /// row sum of a product is a dot product; unread nodes are dropped.
    /// An `Affine` *before* a dense layer (a scaler) is never folded: raw
    /// features of very different spreads would then share one INT8 input
    /// scale.
    pub fn simplify(mut self) -> (Graph, Vec<String>) {
        let mut notes = Vec::new();
        loop {
            let consumers = self.consumers();
            let mut changed = false;
            for i in 0..self.nodes.len() {
                if self.nodes[i].inputs.len() != 1 {
                    continue;
                }
                let j = self.nodes[i].inputs[0];
                if consumers[j] != 1 {
                    continue;
                }
                if let (Op::Mul, Op::Sum) = (&self.nodes[j].op, &self.nodes[i].op) {
                    let (a, b) = (self.nodes[j].inputs[0], self.nodes[j].inputs[1]);
                    if self.nodes[a].width == self.nodes[b].width {
                        // The same products summed in the same order: exact.
                        self.nodes[i] = Node { op: Op::Dot, inputs: vec![a, b], width: 1 };
                        self.nodes[j].inputs.clear();
                        self.nodes[j].op = Op::Concat;
                        notes.push(format!("fused a product and a row sum into a dot product (node {i})"));
                        changed = true;
                        break;
                    }
                }
                let fused = match (&self.nodes[j].op, &self.nodes[i].op) {
                    (Op::Dense { act: Act::None, .. }, Op::Affine { .. }) => {
                        let Op::Affine { center, scale, shift } = self.nodes[i].op.clone() else { unreachable!() };
                        let Op::Dense { layer, .. } = &mut self.nodes[j].op else { unreachable!() };
                        let (k, n) = (layer.in_dim, layer.out_dim);
                        let mut w = std::mem::take(&mut layer.weights_f32);
                        let mut b = std::mem::take(&mut layer.bias);
                        for o in 0..n {
                            for v in &mut w[o * k..(o + 1) * k] {
                                *v *= scale[o];
                            }
                            b[o] = (b[o] - center[o]) * scale[o] + shift[o];
                        }
                        *layer = Layer::quantize(k, n, false, w, b);
                        notes
                            .push(format!("folded a per-channel scale and shift (e.g. BatchNorm) into dense node {j}"));
                        true
                    }
                    (Op::Dense { act: Act::None, .. }, Op::Act(a)) => {
                        let a = *a;
                        let Op::Dense { act, .. } = &mut self.nodes[j].op else { unreachable!() };
                        *act = a;
                        notes.push(format!("fused {} into dense node {j}", a.name()));
                        true
                    }
                    _ => false,
                };
                if fused {
                    self.forward_to(i, j);
                    changed = true;
                    break;
                }
            }
            if !changed && !self.fuse_gelu(&mut notes) && !self.fuse_regions(&mut notes) {
                break;
            }
        }
        let before = self.nodes.len();
        self.drop_unread();
        if self.nodes.len() < before {
            notes.push(format!("dropped {} nodes nothing reads", before - self.nodes.len()));
        }
        (self, notes)
    }

    fn consumers(&self) -> Vec<usize> {
        let mut c = vec![0; self.nodes.len()];
        for n in &self.nodes {
            for &j in &n.inputs {
                c[j] += 1;
            }
        }
        if let Some(last) = c.last_mut() {
            *last += 1;
        }
        c
    }

    /// Makes every reader of node `i` read node `j` instead, and leaves `i`
    /// unread and inert (it is dropped later). When `i` is the output, `j`
    /// (which only `i` read) moves into its place, so the output stays last.
    fn forward_to(&mut self, i: usize, j: usize) {
        if i + 1 == self.nodes.len() {
            self.nodes[i] = self.nodes[j].clone();
            self.nodes[j].inputs.clear();
            self.nodes[j].op = Op::Concat;
            return;
        }
        for n in &mut self.nodes {
            for k in &mut n.inputs {
                if *k == i {
                    *k = j;
                }
            }
        }
        self.nodes[i].inputs.clear();
        self.nodes[i].op = Op::Concat;
    }

    /// `Mul(Mul(x, Affine(Erf(Affine(x; 1/√2)); +1)), ½)` and its mirror
    /// images, as `torch.onnx.export` writes `nn.GELU()`, to one GELU.
    fn fuse_gelu(&mut self, notes: &mut Vec<String>) -> bool {
        let consumers = self.consumers();
        let scalar_affine = |n: &Node, scale: f32, shift: f32, tol: f32| match &n.op {
            Op::Affine { center, scale: s, shift: b } => {
                center.iter().all(|c| *c == 0.0)
                    && s.iter().all(|v| (v - scale).abs() <= tol)
                    && b.iter().all(|v| (v - shift).abs() <= tol)
            }
            _ => false,
        };
        for i in 0..self.nodes.len() {
            // i: the final × ½.
            if !scalar_affine(&self.nodes[i], 0.5, 0.0, 0.0) {
                continue;
            }
            let m = self.nodes[i].inputs[0];
            if !matches!(self.nodes[m].op, Op::Mul) || consumers[m] != 1 || self.nodes[m].inputs.len() != 2 {
                continue;
            }
            for (xi, pi) in [(0, 1), (1, 0)] {
                let (x, p) = (self.nodes[m].inputs[xi], self.nodes[m].inputs[pi]);
                // p = erf(x / √2) + 1
                if consumers[p] != 1 || !scalar_affine(&self.nodes[p], 1.0, 1.0, 0.0) {
                    continue;
                }
                let e = self.nodes[p].inputs[0];
                if !matches!(self.nodes[e].op, Op::Act(Act::Erf)) || consumers[e] != 1 {
                    continue;
                }
                let d = self.nodes[e].inputs[0];
                let inv_sqrt2 = std::f32::consts::FRAC_1_SQRT_2;
                if consumers[d] != 1 || !scalar_affine(&self.nodes[d], inv_sqrt2, 0.0, 1e-6) {
                    continue;
                }
                if self.nodes[d].inputs[0] != x {
                    continue;
                }
                self.nodes[i] = Node { op: Op::Act(Act::GeluErf), inputs: vec![x], width: self.nodes[i].width };
                for k in [m, p, e, d] {
                    self.nodes[k].inputs.clear();
                    self.nodes[k].op = Op::Concat;
                }
                notes.push(format!("fused the erf form of GELU into one activation (node {i})"));
                return true;
            }
        }
        false
    }

    /// Removes nodes the output does not depend on, renumbering the rest.
    fn drop_unread(&mut self) {
        let n = self.nodes.len();
        let mut live = vec![false; n];
        live[n - 1] = true;
        for i in (0..n).rev() {
            if live[i] {
                for &j in &self.nodes[i].inputs {
                    live[j] = true;
                }
            }
        }
        let mut map = vec![usize::MAX; n];
        let mut kept = Vec::with_capacity(n);
        for (i, node) in std::mem::take(&mut self.nodes).into_iter().enumerate() {
            if live[i] {
                map[i] = kept.len();
                kept.push(node);
            }
        }
        for node in &mut kept {
            for k in &mut node.inputs {
                *k = map[*k];
            }
        }
        self.nodes = kept;
    }
}

/// Whether every value is finite. Reads every value, so every page of a
/// loaded table (the price of checking it, linear in its size); written to
/// vectorise, with no early exit inside a block.
pub fn all_finite(v: &[f32]) -> bool {
    const EXPONENT: u32 = 0x7f80_0000;
    v.chunks(4096).all(|block| block.iter().fold(true, |ok, x| ok & (x.to_bits() & EXPONENT != EXPONENT)))
}

fn act_ok(a: Act) -> Result<(), String> {
    match a {
        Act::LeakyRelu(alpha) if !alpha.is_finite() => Err(format!("LeakyReLU alpha {alpha} is not finite")),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dense(input: usize, k: usize, n: usize, seed: u64, act: Act) -> Node {
        let mut rng = crate::seeded::SplitMix64::new(seed);
        let w = (0..k * n).map(|_| rng.normal() * 0.5).collect();
        let b = (0..n).map(|_| rng.normal() * 0.1).collect();
        Node { op: Op::Dense { layer: Layer::quantize(k, n, false, w, b), act }, inputs: vec![input], width: n }
    }

    fn input(offset: usize, width: usize) -> Node {
        Node { op: Op::Input { offset }, inputs: vec![], width }
    }

    fn affine(input: usize, width: usize, scale: f32, shift: f32) -> Node {
        Node {
            op: Op::Affine { center: vec![0.0; width], scale: vec![scale; width], shift: vec![shift; width] },
            inputs: vec![input],
            width,
        }
    }

    /// x → Dense(4→3) → BN-like affine → Erf-form GELU → Dense(3→1), plus a
    /// residual Add, written as the importer would before simplifying.
    fn unsimplified() -> Graph {
        let mut nodes = vec![input(0, 4), dense(0, 4, 3, 1, Act::None)];
        nodes.push(Node {
            op: Op::Affine { center: vec![0.1, -0.2, 0.3], scale: vec![1.5, 0.5, 2.0], shift: vec![0.0, 0.1, -0.1] },
            inputs: vec![1],
            width: 3,
        }); // 2
        nodes.push(affine(2, 3, std::f32::consts::FRAC_1_SQRT_2, 0.0)); // 3
        nodes.push(Node { op: Op::Act(Act::Erf), inputs: vec![3], width: 3 }); // 4
        nodes.push(affine(4, 3, 1.0, 1.0)); // 5
        nodes.push(Node { op: Op::Mul, inputs: vec![2, 5], width: 3 }); // 6
        nodes.push(affine(6, 3, 0.5, 0.0)); // 7
        nodes.push(Node { op: Op::Add, inputs: vec![7, 2], width: 3 }); // 8: residual
        nodes.push(dense(8, 3, 1, 2, Act::None)); // 9
        Graph { nodes, output: OutputKind::Logit }
    }

    #[test]
    fn simplify_is_exact_and_reports_its_rewrites() {
        let g = unsimplified();
        g.validate(4).unwrap();
        let (s, notes) = g.clone().simplify();
        s.validate(4).unwrap();
        assert!(notes.iter().any(|n| n.contains("GELU")), "{notes:?}");
        // The BN-like affine feeds the GELU and the residual; only the dense
        // layer before it has one reader, so it folds.
        assert!(notes.iter().any(|n| n.contains("folded")), "{notes:?}");
        assert!(s.nodes.len() < g.nodes.len());
        let mut rng = crate::seeded::SplitMix64::new(9);
        for _ in 0..64 {
            let x: Vec<f32> = (0..4).map(|_| rng.normal()).collect();
            let (a, b) = (g.forward_row(&x), s.forward_row(&x));
            assert!((a - b).abs() <= 1e-5 * (1.0 + a.abs()), "{a} vs {b}");
        }
    }

    #[test]
    fn batchnorm_after_dense_folds_and_activation_fuses() {
        let mut nodes = vec![input(0, 4), dense(0, 4, 3, 1, Act::None)];
        nodes.push(affine(1, 3, 1.7, -0.3));
        nodes.push(Node { op: Op::Act(Act::Tanh), inputs: vec![2], width: 3 });
        nodes.push(dense(3, 3, 1, 2, Act::None));
        let g = Graph { nodes, output: OutputKind::Logit };
        let (s, notes) = g.clone().simplify();
        assert_eq!(s.nodes.len(), 3, "{:?}", s.nodes);
        assert!(matches!(s.nodes[1].op, Op::Dense { act: Act::Tanh, .. }));
        assert_eq!(notes.len(), 3, "{notes:?}");
        let x = [0.3, -1.0, 2.0, 0.5];
        assert!((g.forward_row(&x) - s.forward_row(&x)).abs() < 1e-5);
    }

    #[test]
    fn an_output_activation_fuses_and_stays_last() {
        let nodes =
            vec![input(0, 2), dense(0, 2, 1, 3, Act::None), Node { op: Op::Act(Act::Relu), inputs: vec![1], width: 1 }];
        let g = Graph { nodes, output: OutputKind::Raw };
        let (s, _) = g.clone().simplify();
        s.validate(2).unwrap();
        assert_eq!(s.nodes.len(), 2);
        assert!(matches!(s.nodes[1].op, Op::Dense { act: Act::Relu, .. }));
        for x in [[1.0, 2.0], [-3.0, 0.5]] {
            assert_eq!(g.forward_row(&x), s.forward_row(&x));
        }
    }

    #[test]
    fn refusals_name_the_node() {
        let ok = Graph { nodes: vec![input(0, 4), dense(0, 4, 1, 1, Act::None)], output: OutputKind::Logit };
        ok.validate(4).unwrap();
        let refused = |edit: &dyn Fn(&mut Graph), input_dim: usize| {
            let mut g = ok.clone();
            edit(&mut g);
            g.validate(input_dim).unwrap_err()
        };
        assert!(refused(&|_| {}, 3).contains("node 0 (Input): reads input columns 0..4 of an input vector of 3"));
        assert!(refused(&|g| g.nodes[1].inputs = vec![1], 4).contains("node 1 (Dense): reads node 1"));
        assert!(refused(&|g| g.nodes[1].inputs = vec![7], 4).contains("does not come before it"));
        assert!(refused(&|g| g.nodes[0].width = 3, 4).contains("is 4 -> 1 but reads 3"));
        assert!(refused(&|g| g.nodes.insert(1, input(0, 2)), 4).contains("node 1 (Input) is dangling"));
        assert!(refused(&|g| g.nodes.clear(), 4).contains("0 nodes"));
        let wide = |g: &mut Graph| g.nodes[1] = dense(0, 4, 2, 1, Act::None);
        assert!(refused(&wide, 4).contains("2 wide; one value per candidate"));
        let bad_emb = |g: &mut Graph| {
            g.nodes.insert(
                1,
                Node {
                    op: Op::Embedding { dim: 2, rows: 3, table: vec![0.0; 5].into(), default: vec![0.0; 2] },
                    inputs: vec![0],
                    width: 8,
                },
            );
            g.nodes[2] = dense(1, 8, 1, 1, Act::None);
        };
        assert!(refused(&bad_emb, 4).contains("node 1 (Embedding): its table is not 3 x 2"));
    }

    #[test]
    fn all_finite_finds_one_bad_value_anywhere() {
        let mut v = vec![1.0f32; 10_000];
        assert!(all_finite(&v) && all_finite(&[]));
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            for at in [0, 4095, 4096, 9_999] {
                v[at] = bad;
                assert!(!all_finite(&v), "{bad} at {at}");
                v[at] = f32::MAX;
            }
        }
        assert!(all_finite(&v));
    }

    #[test]
    fn embedding_indices_must_be_integers_in_range() {
        assert_eq!(embedding_index(0.0, 3), Some(0));
        assert_eq!(embedding_index(2.0, 3), Some(2));
        for v in [3.0, -1.0, 0.5, f32::NAN, f32::INFINITY, -0.0001] {
            assert_eq!(embedding_index(v, 3), None, "{v}");
        }
    }
}
