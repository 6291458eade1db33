//! The quadrature walk ([`super::TreeAlgorithm::Quadrature`]): the
//! per-node table built once per explainer, and the walk that computes
//! every contribution of one row at the Gauss–Legendre points at once
//! (the algorithm is the parent module's header's). Apart from the
//! explainer so its vector code and its table layout read on their own.

use crate::model::trees::{goes_left, Ensemble, Split, ZERO_THRESHOLD};

/// Bytes of the quadrature's table per tree node (leaves and splits): the
/// table is this times the ensemble's nodes (and 8 bytes a tree and 20 a
/// level of a tree), so
/// `trees::ENSEMBLE_NODES_MAX` bounds it (384 MiB; the ensemble itself
/// holds 28 bytes a node).
pub const TABLE_NODE_BYTES: usize = 24;

const _: () = assert!(std::mem::size_of::<TableNode>() == TABLE_NODE_BYTES);

/// The `repeat` of a node no edge above repeats, while the table is built.
const NO_NODE: u16 = u16::MAX;

/// One node of the quadrature's table: the ensemble's trees one after
/// another, each breadth first (so a node's parent, a whole level earlier,
/// is done long before it, and the nodes of a level are independent), with
/// what the walk needs of the edge into the node.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub(super) struct TableNode {
    /// The merged zero fraction of the edge into the node: the product of
    /// the cover shares (child over parent) of every edge on the path that
    /// splits on the same feature, this one included.
    pub(super) zero: f64,
    /// A leaf's value or a numeric split's threshold (f32 bits), or a
    /// categorical split's first bitset word.
    pub(super) value: u32,
    /// The split's input column (below `model::WIDTH_MAX`).
    pub(super) feature: u16,
    /// A categorical split's bitset words (at most `CATEGORY_WORDS_MAX`).
    pub(super) words: u16,
    /// The parent, within the tree.
    pub(super) parent: u16,
    /// The node (within the tree) whose incoming edge is the nearest above
    /// that splits on the same feature as this one's, or
    /// `Quadrature::dummy`.
    pub(super) repeat: u16,
    /// The slot of the feature the parent splits on.
    pub(super) slot: u16,
    pub(super) flags: u8,
}

pub(super) const LEAF: u8 = 1;
pub(super) const CATEGORICAL: u8 = 2;
pub(super) const MISSING_LEFT: u8 = 4;
pub(super) const ZERO_MISSING: u8 = 8;
/// The node is its parent's left child.
const LEFT_CHILD: u8 = 16;
/// A split below the root whose children are both leaves: it is finished
/// on the way down.
const TWIG: u8 = 32;

impl TableNode {
    pub(super) fn split(&self) -> Split {
        let feature = self.feature as u32;
        if self.flags & CATEGORICAL != 0 {
            Split::Categorical { feature, start: self.value, len: self.words as u32 }
        } else {
            Split::Numeric {
                feature,
                threshold: f32::from_bits(self.value),
                missing_left: self.flags & MISSING_LEFT != 0,
                zero_missing: self.flags & ZERO_MISSING != 0,
            }
        }
    }

    /// `trees::goes_left` of the node's split (anything for a leaf), the
    /// numeric rule without branches: which way the row goes is a coin
    /// toss no branch predictor learns.
    #[inline(always)]
    pub(super) fn goes_left(&self, x: &[f32], words: &[u32]) -> bool {
        let v = x[self.feature as usize];
        if self.flags & CATEGORICAL != 0 {
            return goes_left(&self.split(), v, words);
        }
        let missing = v.is_nan() | ((self.flags & ZERO_MISSING != 0) & (v.abs() <= ZERO_THRESHOLD));
        (missing & (self.flags & MISSING_LEFT != 0)) | (!missing & (v <= f32::from_bits(self.value)))
    }
}

/// The vector builds the walk is compiled for, the widest the CPU runs
/// chosen once per explainer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Isa {
    Baseline,
    Avx2,
    Avx512,
}

impl Isa {
    /// Every build this CPU runs, narrowest first.
    pub(super) fn available() -> Vec<Isa> {
        let mut v = vec![Isa::Baseline];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                v.push(Isa::Avx2);
            }
            if is_x86_feature_detected!("avx512f") {
                v.push(Isa::Avx512);
            }
        }
        v
    }
}

/// A tree ensemble prepared for the quadrature walk.
#[derive(Debug)]
pub(super) struct Quadrature {
    pub(super) nodes: Vec<TableNode>,
    /// Tree `t` is `nodes[starts[t]..starts[t + 1]]` (lone leaves left out).
    pub(super) starts: Vec<u32>,
    /// Tree `t`'s levels below the root are `levels[tree_levels[t]..
    /// tree_levels[t + 1]]`, each the tree-relative bounds of its nine
    /// classes of node, in table order: splits whose feature no edge above
    /// splits on, splits whose feature one does (`repeat`); twigs (splits
    /// over two leaves) of each kind, first those whose own feature no
    /// edge above splits on, then those whose one does; the twigs' leaves
    /// of the level above (a pair each, in their twigs' order); the other
    /// leaves of each kind; and the level's end. The walk runs each class
    /// in its own loop, so nothing branches on a node's class.
    pub(super) levels: Vec<[u16; 10]>,
    pub(super) tree_levels: Vec<u32>,
    /// Each slot's input column: the features the splits read, ascending.
    pub(super) columns: Vec<u16>,
    /// The most nodes of one tree.
    pub(super) tree_nodes_max: usize,
    /// The node index that stands for "no edge above of the same
    /// feature" (factor 1, one 1, zero 1): one past the largest tree's.
    pub(super) dummy: usize,
    /// The Gauss–Legendre points on [0, 1] and their weights, `lanes` each.
    pub(super) t: Vec<f64>,
    pub(super) w: Vec<f64>,
    pub(super) lanes: usize,
    pub(super) isa: Isa,
}

/// The quadrature points for trees of `depth` splits: at least ⌈depth/2⌉,
/// which integrates the degree-(depth − 1) integrands exactly, rounded up
/// to a vector width the walk is compiled for (4, 8, 16 or 32).
pub(super) fn lanes_for(depth: usize) -> usize {
    depth.div_ceil(2).max(4).next_power_of_two()
}

/// The `n`-point Gauss–Legendre rule on [0, 1]: points and weights (which
/// sum to 1), exact for polynomials of degree below `2n`. Each point is the
/// Newton iteration's root of the Legendre polynomial `P_n` from the
/// classical first guess.
pub(super) fn gauss_legendre(n: usize) -> (Vec<f64>, Vec<f64>) {
    let (mut t, mut w) = (vec![0.0; n], vec![0.0; n]);
    // P_n(x) and P_n'(x), by the three-term recurrence.
    let legendre = |x: f64| {
        let (mut p0, mut p1) = (1.0f64, x);
        for k in 2..=n {
            let k = k as f64;
            (p0, p1) = (p1, ((2.0 * k - 1.0) * x * p1 - (k - 1.0) * p0) / k);
        }
        (p1, n as f64 * (x * p1 - p0) / (x * x - 1.0))
    };
    for i in 0..n {
        let mut x = (std::f64::consts::PI * (i as f64 + 0.75) / (n as f64 + 0.5)).cos();
        for _ in 0..100 {
            let (p, dp) = legendre(x);
            let step = p / dp;
            x -= step;
            if step.abs() <= 1e-17 {
                break;
            }
        }
        let (_, dp) = legendre(x);
        t[i] = (1.0 - x) / 2.0;
        w[i] = 1.0 / ((1.0 - x * x) * dp * dp);
    }
    (t, w)
}

impl Quadrature {
    /// The table of `e` (a validated ensemble whose splits have positive
    /// covers), trees of at most `depth_max` splits.
    pub(super) fn new(e: &Ensemble, depth_max: usize) -> Quadrature {
        let used = e.features_used();
        let columns: Vec<u16> = used.iter().map(|&f| f as u16).collect();
        assert!(
            used.iter().all(|&f| f as usize <= u16::MAX as usize) && columns.len() <= u16::MAX as usize + 1,
            "a validated model reads at most WIDTH_MAX columns"
        );
        let mut slot_of = vec![0u16; used.last().map_or(0, |&f| f as usize + 1)];
        for (s, &f) in used.iter().enumerate() {
            slot_of[f as usize] = s as u16;
        }
        let mut nodes: Vec<TableNode> = Vec::with_capacity(e.nodes.len());
        let mut starts = vec![0u32];
        let (mut levels, mut tree_levels) = (Vec::new(), vec![0u32]);
        let mut tree_nodes_max = 0;
        // Per node of the tree at hand, in table order: the split feature
        // (`u32::MAX` for a leaf) and its index in the tree.
        let (mut split_feature, mut in_tree): (Vec<u32>, Vec<usize>) = (Vec::new(), Vec::new());
        // A level's nodes: index in the tree, parent (table order), left.
        let (mut level, mut next) = (Vec::new(), Vec::new());
        let mut built: Vec<(u8, TableNode, usize)> = Vec::new();
        for t in 0..e.trees() {
            let tree = e.tree(t);
            if matches!(tree[0].split, Split::Leaf { .. }) {
                continue; // A lone leaf is all bias.
            }
            let covers = &e.covers[e.starts[t] as usize..e.starts[t + 1] as usize];
            let first = nodes.len();
            split_feature.clear();
            in_tree.clear();
            level.clear();
            level.push((0usize, 0usize, false));
            while !level.is_empty() {
                // Each node of the level, then the level sorted by class
                // (a stable sort: within a class, breadth-first order).
                built.clear();
                for &(i, parent, is_left) in &level {
                    let at = in_tree.len() + built.len();
                    let (mut zero, mut repeat, mut slot) = (1.0f64, NO_NODE, 0);
                    if at > 0 {
                        let feature = split_feature[parent];
                        zero = covers[i] as f64 / covers[in_tree[parent]] as f64;
                        // Up the path: the nearest edge into a node `q`
                        // whose parent splits on the same feature.
                        let mut q = parent;
                        while q != 0 {
                            let above = nodes[first + q].parent as usize;
                            if split_feature[above] == feature {
                                zero *= nodes[first + q].zero;
                                repeat = q as u16;
                                break;
                            }
                            q = above;
                        }
                        slot = slot_of[feature as usize];
                    }
                    let n = &tree[i];
                    let mut flags = if is_left { LEFT_CHILD } else { 0 };
                    let (value, feature, words) = match n.split {
                        Split::Leaf { value } => {
                            flags |= LEAF;
                            (value.to_bits(), 0, 0)
                        }
                        Split::Numeric { feature, threshold, missing_left, zero_missing } => {
                            flags |= if missing_left { MISSING_LEFT } else { 0 };
                            flags |= if zero_missing { ZERO_MISSING } else { 0 };
                            (threshold.to_bits(), feature, 0)
                        }
                        Split::Categorical { feature, start, len } => {
                            flags |= CATEGORICAL;
                            (start, feature, len)
                        }
                    };
                    // Splits, then twigs (below the root, both children
                    // leaves), each plain, then repeated (the twigs' by
                    // their own edge, then by their leaves'); the twigs'
                    // leaves (a twig's pair side by side, in its twig's
                    // order); other leaves, plain, then repeated.
                    let leaf = |c: u32| matches!(tree[c as usize].split, Split::Leaf { .. });
                    let twig = at > 0 && flags & LEAF == 0 && leaf(n.left) && leaf(n.right);
                    // Up the path from the parent: a split on the twig's
                    // own feature above it.
                    let twig_repeated = twig && {
                        let mut q = parent;
                        loop {
                            if split_feature[q] == feature {
                                break true;
                            }
                            if q == 0 {
                                break false;
                            }
                            q = nodes[first + q].parent as usize;
                        }
                    };
                    flags |= if twig { TWIG } else { 0 };
                    let repeated = u8::from(repeat != NO_NODE);
                    let class = if flags & LEAF == 0 {
                        2 * u8::from(twig) + 2 * u8::from(twig_repeated) + repeated
                    } else if at > 0 && nodes[first + parent].flags & TWIG != 0 {
                        6
                    } else {
                        7 + repeated
                    };
                    let node = TableNode {
                        zero,
                        value,
                        feature: feature as u16,
                        words: words as u16,
                        parent: parent as u16,
                        repeat,
                        slot,
                        flags,
                    };
                    built.push((class, node, i));
                }
                built.sort_by_key(|(class, _, _)| *class);
                let at = in_tree.len();
                if at > 0 {
                    // Where each class starts in the level, and its end.
                    let mut bounds = [(at + built.len()) as u16; 10];
                    for class in (0..9u8).rev() {
                        let from = built.iter().position(|(c, _, _)| *c >= class).unwrap_or(built.len());
                        bounds[class as usize] = (at + from) as u16;
                    }
                    levels.push(bounds);
                }
                next.clear();
                for (k, &(_, node, i)) in built.iter().enumerate() {
                    let is_leaf = node.flags & LEAF != 0;
                    split_feature.push(if is_leaf { u32::MAX } else { node.feature as u32 });
                    in_tree.push(i);
                    nodes.push(node);
                    if !is_leaf {
                        next.push((tree[i].left as usize, at + k, true));
                        next.push((tree[i].right as usize, at + k, false));
                    }
                }
                std::mem::swap(&mut level, &mut next);
            }
            starts.push(nodes.len() as u32);
            tree_levels.push(levels.len() as u32);
            tree_nodes_max = tree_nodes_max.max(nodes.len() - first);
        }
        let dummy = tree_nodes_max;
        for n in nodes.iter_mut().filter(|n| n.repeat == NO_NODE) {
            n.repeat = dummy as u16;
        }
        let lanes = lanes_for(depth_max);
        let (t, w) = gauss_legendre(lanes);
        let isa = *Isa::available().last().expect("the baseline always runs");
        Quadrature { nodes, starts, levels, tree_levels, columns, tree_nodes_max, dummy, t, w, lanes, isa }
    }

    /// Bytes of the table: its nodes, tree and level bounds.
    pub(super) fn table_bytes(&self) -> usize {
        self.nodes.len() * TABLE_NODE_BYTES
            + 4 * (self.starts.len() + self.tree_levels.len())
            + std::mem::size_of::<[u16; 10]>() * self.levels.len()
    }

    /// Adds each column's contribution to `phi`.
    pub(super) fn explain(&self, words: &[u32], x: &[f32], walk: &mut Walk, phi: &mut [f64]) {
        match self.lanes {
            4 => self.dispatch::<4>(words, x, walk, phi),
            8 => self.dispatch::<8>(words, x, walk, phi),
            16 => self.dispatch::<16>(words, x, walk, phi),
            32 => self.dispatch::<32>(words, x, walk, phi),
            n => unreachable!("lanes_for gives 4, 8, 16 or 32 lanes, not {n}"),
        }
    }

    fn dispatch<const N: usize>(&self, words: &[u32], x: &[f32], walk: &mut Walk, phi: &mut [f64]) {
        #[cfg(target_arch = "x86_64")]
        match self.isa {
            // SAFETY: `Isa::available` listed the build only because the
            // CPU has the features it is compiled with.
            Isa::Avx512 => return unsafe { self.walk_avx512::<N>(words, x, walk, phi) },
            // SAFETY: as above.
            Isa::Avx2 => return unsafe { self.walk_avx2::<N>(words, x, walk, phi) },
            Isa::Baseline => {}
        }
        self.walk::<N>(words, x, walk, phi)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    fn walk_avx2<const N: usize>(&self, words: &[u32], x: &[f32], walk: &mut Walk, phi: &mut [f64]) {
        self.walk::<N>(words, x, walk, phi)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    fn walk_avx512<const N: usize>(&self, words: &[u32], x: &[f32], walk: &mut Walk, phi: &mut [f64]) {
        self.walk::<N>(words, x, walk, phi)
    }

    /// Two passes over each tree, at `N` quadrature points at once.
    ///
    /// Down, level by level: at each node, from the edge into it (feature
    /// i, merged zero `z`, merged one `o`), its factor `f = z (1 − t) + o
    /// t`; the product of the path's factors (each feature's latest; the
    /// weights at the root); `excl`, the parent's product without feature
    /// i's factor `f_a` from the nearest edge above that splits on i (the
    /// dummy's 1 when none does). The node has `scaled = excl · ((o − z)
    /// − (o_a − z_a) f / f_a)` and `grow = f / f_a`. Where no edge above
    /// splits on i, `f_a` is 1 and `o_a − z_a` 0: those nodes skip the
    /// division (most nodes; their own loop, [`Quadrature::levels`]) and
    /// keep neither, as the parent's product times `o − z` and the factor
    /// are kept anyway.
    ///
    /// Up, children before parents: a node's sum `S` (its leaf value, or
    /// its children's sums grown into it) gives feature i `Σ_t scaled · S`
    /// and the parent `grow · S`. A leaf's `S` is its value, known on the
    /// way down, so a leaf adds both there and keeps nothing; a twig's
    /// `S` is its two leaves', so it too is finished there ([`At::twig`]);
    /// the up pass visits the other splits only. The second term of `scaled` takes back what the
    /// edge above counted for this subtree, when i is split on again; a
    /// subtree whose factor is 0 (no row and no training row reaches it)
    /// has `1 / f` read as 0, so it adds nothing. No branch depends on the
    /// row.
    #[inline(always)]
    fn walk<const N: usize>(&self, words: &[u32], x: &[f32], walk: &mut Walk, phi: &mut [f64]) {
        let t: [f64; N] = self.t[..N].try_into().expect("N points");
        let w: [f64; N] = self.w[..N].try_into().expect("N weights");
        let rest: [f64; N] = std::array::from_fn(|k| 1.0 - t[k]);
        let Walk { node, one, coef, left, phi: lanes, .. } = walk;
        let node = node.as_chunks_mut::<N>().0;
        let lanes = &mut lanes.as_chunks_mut::<N>().0[..self.columns.len()];
        lanes.fill([0.0; N]);
        let dummy = self.dummy;
        node[5 * dummy + FACTOR] = [1.0; N];
        (one[dummy], coef[dummy]) = (1.0, 0.0);
        let at = At { t, rest };
        for (tree, bounds) in self.starts.windows(2).enumerate() {
            let nodes = &self.nodes[bounds[0] as usize..bounds[1] as usize];
            let levels = &self.levels[self.tree_levels[tree] as usize..self.tree_levels[tree + 1] as usize];
            node[PRODUCT] = w;
            left[0] = nodes[0].goes_left(x, words);
            // Index loops: an iterator adapter's closure may be compiled
            // apart, without the target features.
            for (l, level) in levels.iter().enumerate() {
                let [a, b, c, d, e, f, twigs_end, g, h, end] = level.map(usize::from);
                for (k, n) in nodes[a..b].iter().enumerate() {
                    at.split::<false>(n, a + k, x, words, node, one, coef, left);
                }
                for (k, n) in nodes[b..c].iter().enumerate() {
                    at.split::<true>(n, b + k, x, words, node, one, coef, left);
                }
                // The twigs' leaves, two a twig, start the next level (a
                // level of twigs has one).
                let pairs = levels.get(l + 1).map_or(end, |next| usize::from(next[6]));
                let pair = |i: usize| &nodes[pairs + 2 * (i - c)..][..2];
                for (k, n) in nodes[c..d].iter().enumerate() {
                    at.twig::<false, false>(n, c + k, pair(c + k), x, words, node, one, coef, left, lanes);
                }
                for (k, n) in nodes[d..e].iter().enumerate() {
                    at.twig::<true, false>(n, d + k, pair(d + k), x, words, node, one, coef, left, lanes);
                }
                for (k, n) in nodes[e..f].iter().enumerate() {
                    at.twig::<false, true>(n, e + k, pair(e + k), x, words, node, one, coef, left, lanes);
                }
                for (k, n) in nodes[f..twigs_end].iter().enumerate() {
                    at.twig::<true, true>(n, f + k, pair(f + k), x, words, node, one, coef, left, lanes);
                }
                for n in &nodes[g..h] {
                    at.leaf::<false>(n, node, one, coef, left, lanes);
                }
                for n in &nodes[h..end] {
                    at.leaf::<true>(n, node, one, coef, left, lanes);
                }
            }
            for level in levels.iter().rev() {
                let [a, b, c, ..] = level.map(usize::from);
                for i in (a..b).rev() {
                    at.up::<false>(&nodes[i], i, node, coef, lanes);
                }
                for i in (b..c).rev() {
                    at.up::<true>(&nodes[i], i, node, coef, lanes);
                }
            }
        }
        for (l, &column) in lanes.iter().zip(&self.columns) {
            phi[column as usize] += l.iter().sum::<f64>();
        }
    }
}

/// A node's vectors in the walk's memory, five per node.
const PRODUCT: usize = 0;
const FACTOR: usize = 1;
const SCALED: usize = 2;
const GROW: usize = 3;
const SUM: usize = 4;

/// The quadrature points of a walk: `t` and `1 − t`.
struct At<const N: usize> {
    t: [f64; N],
    rest: [f64; N],
}

impl<const N: usize> At<N> {
    /// The edge into `n` (module header, [`Quadrature::walk`]): the node's
    /// `f`, `excl`, `grow` and `scaled` vectors and its merged one, `o`.
    /// `REPEAT`: an edge above splits on the same feature (else `f_a` is
    /// 1 and `o_a − z_a` is 0, and nothing is divided).
    #[inline(always)]
    #[allow(clippy::type_complexity)]
    fn edge<const REPEAT: bool>(
        &self,
        n: &TableNode,
        node: &[[f64; N]],
        one: &[f64],
        coef: &[f64],
        left: &[bool],
    ) -> ([f64; N], [f64; N], [f64; N], [f64; N], f64) {
        let (t, rest) = (&self.t, &self.rest);
        let p = n.parent as usize;
        let taken = ((n.flags & LEFT_CHILD != 0) == left[p]) as u8 as f64;
        let z = n.zero;
        let product = node[5 * p + PRODUCT];
        if REPEAT {
            let a = n.repeat as usize;
            let (o, ca) = (taken * one[a], coef[a]);
            let fa = node[5 * a + FACTOR];
            let f: [f64; N] = std::array::from_fn(|k| z * rest[k] + o * t[k]);
            let r: [f64; N] = std::array::from_fn(|k| if fa[k] == 0.0 { 0.0 } else { 1.0 / fa[k] });
            let excl: [f64; N] = std::array::from_fn(|k| product[k] * r[k]);
            let g: [f64; N] = std::array::from_fn(|k| f[k] * r[k]);
            let scaled = std::array::from_fn(|k| excl[k] * ((o - z) - ca * g[k]));
            (f, excl, g, scaled, o)
        } else {
            let o = taken;
            let f: [f64; N] = std::array::from_fn(|k| z * rest[k] + o * t[k]);
            let scaled = std::array::from_fn(|k| product[k] * (o - z));
            (f, product, f, scaled, o)
        }
    }

    /// A split node `i`: its vectors kept for its children and the up
    /// pass, and which way the row goes.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn split<const REPEAT: bool>(
        &self,
        n: &TableNode,
        i: usize,
        x: &[f32],
        words: &[u32],
        node: &mut [[f64; N]],
        one: &mut [f64],
        coef: &mut [f64],
        left: &mut [bool],
    ) {
        let (f, excl, g, scaled, o) = self.edge::<REPEAT>(n, node, one, coef, left);
        let at = 5 * i;
        node[at + PRODUCT] = std::array::from_fn(|k| excl[k] * f[k]);
        node[at + FACTOR] = f;
        if REPEAT {
            node[at + SCALED] = scaled;
            node[at + GROW] = g;
        }
        node[at + SUM] = [0.0; N];
        (one[i], coef[i]) = (o, o - n.zero);
        left[i] = n.goes_left(x, words);
    }

    /// A split `i` on the way up: its sum `S`, complete, times `scaled`
    /// to its feature's lanes and times `grow` to its parent's sum. Where
    /// no edge above splits on the feature, those are the parent's product
    /// times `o − z` and the factor ([`At::edge`]), not stored on the way
    /// down.
    #[inline(always)]
    fn up<const REPEAT: bool>(
        &self,
        n: &TableNode,
        i: usize,
        node: &mut [[f64; N]],
        coef: &[f64],
        lanes: &mut [[f64; N]],
    ) {
        let (slot, to) = (n.slot as usize, 5 * n.parent as usize + SUM);
        let total = node[5 * i + SUM];
        let (s, g) = if REPEAT {
            (node[5 * i + SCALED], node[5 * i + GROW])
        } else {
            let (product, c) = (node[5 * n.parent as usize + PRODUCT], coef[i]);
            (std::array::from_fn(|k| product[k] * c), node[5 * i + FACTOR])
        };
        // Whole vectors in and out, which the compiler keeps in vector
        // registers (a lane at a time, it did not).
        let (into_lanes, into_parent) = (lanes[slot], node[to]);
        lanes[slot] = std::array::from_fn(|k| into_lanes[k] + s[k] * total[k]);
        node[to] = std::array::from_fn(|k| into_parent[k] + g[k] * total[k]);
    }

    /// A twig `i` (its two leaves, left then right, in `pair`), finished
    /// here. Its leaves share their parent, so their edges share `excl`
    /// and `1 / f_a` (`r`): with `Z` and `O` the sums over the pair of the
    /// leaf value times its `z` and its `o`, they add `excl ((O − Z) −
    /// (o_a − z_a) S)` to the twig's feature's lanes and make the twig's
    /// sum `S = r (Z (1 − t) + O t)`, as [`At::leaf`] would one by one
    /// (`CHILDREN`: an edge above the twig splits on its feature; else `r`
    /// is 1 and `o_a − z_a` is 0). The twig adds `S` times its `scaled`
    /// and `grow` to its parent's feature and sum, as the up pass would.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn twig<const REPEAT: bool, const CHILDREN: bool>(
        &self,
        n: &TableNode,
        i: usize,
        pair: &[TableNode],
        x: &[f32],
        words: &[u32],
        node: &mut [[f64; N]],
        one: &mut [f64],
        coef: &mut [f64],
        left: &[bool],
        lanes: &mut [[f64; N]],
    ) {
        let (t, rest) = (&self.t, &self.rest);
        let (f, excl, g, scaled, o) = self.edge::<REPEAT>(n, node, one, coef, left);
        let (l, r) = (&pair[0], &pair[1]);
        let (vl, vr) = (f32::from_bits(l.value) as f64, f32::from_bits(r.value) as f64);
        let zero = l.zero * vl + r.zero * vr;
        // Which leaf the row takes is the row's: a branch on it is
        // mispredicted half the time (31% of the walk's time on the 500 x 8
        // benchmark). The compiler turns even an unpredictable select after
        // `goes_left`'s own branch (categorical or not) back into a branch,
        // so the side is made opaque to it first.
        let go_left = std::hint::black_box(n.goes_left(x, words));
        let taken = std::hint::select_unpredictable(go_left, vl, vr);
        let product: [f64; N] = std::array::from_fn(|k| excl[k] * f[k]);
        let (sum, into_leaves): ([f64; N], [f64; N]) = if CHILDREN {
            // The leaves' `a` may be the twig itself: its edge first.
            node[5 * i + FACTOR] = f;
            (one[i], coef[i]) = (o, o - n.zero);
            let a = l.repeat as usize;
            let (taken, ca, fa) = (taken * one[a], coef[a], node[5 * a + FACTOR]);
            let r: [f64; N] = std::array::from_fn(|k| if fa[k] == 0.0 { 0.0 } else { 1.0 / fa[k] });
            let sum: [f64; N] = std::array::from_fn(|k| r[k] * (zero * rest[k] + taken * t[k]));
            (sum, std::array::from_fn(|k| product[k] * r[k] * ((taken - zero) - ca * sum[k])))
        } else {
            let sum = std::array::from_fn(|k| zero * rest[k] + taken * t[k]);
            (sum, std::array::from_fn(|k| product[k] * (taken - zero)))
        };
        let into_lanes = lanes[l.slot as usize];
        lanes[l.slot as usize] = std::array::from_fn(|k| into_lanes[k] + into_leaves[k]);
        let into_lanes = lanes[n.slot as usize];
        lanes[n.slot as usize] = std::array::from_fn(|k| into_lanes[k] + scaled[k] * sum[k]);
        let to = 5 * n.parent as usize + SUM;
        let into_parent = node[to];
        node[to] = std::array::from_fn(|k| into_parent[k] + g[k] * sum[k]);
    }

    /// A leaf: its value times `scaled` to its feature's lanes, times
    /// `grow` to its parent's sum; nothing kept.
    #[inline(always)]
    fn leaf<const REPEAT: bool>(
        &self,
        n: &TableNode,
        node: &mut [[f64; N]],
        one: &[f64],
        coef: &[f64],
        left: &[bool],
        lanes: &mut [[f64; N]],
    ) {
        let (_, _, g, scaled, _) = self.edge::<REPEAT>(n, node, one, coef, left);
        let value = f32::from_bits(n.value) as f64;
        let (slot, to) = (n.slot as usize, 5 * n.parent as usize + SUM);
        let (into_lanes, into_parent) = (lanes[slot], node[to]);
        lanes[slot] = std::array::from_fn(|k| into_lanes[k] + scaled[k] * value);
        node[to] = std::array::from_fn(|k| into_parent[k] + g[k] * value);
    }
}

/// The quadrature walk's memory: per node of the largest tree (and the
/// dummy), five vectors of `lanes` values (product, factor, scaled, grow,
/// sum), the edge's merged one and `one − zero`, and which way the row
/// goes; per slot, `lanes` partial contributions.
#[derive(Clone, Debug, Default)]
pub(super) struct Walk {
    pub(super) lanes: usize,
    pub(super) nodes: usize,
    pub(super) node: Vec<f64>,
    pub(super) one: Vec<f64>,
    pub(super) coef: Vec<f64>,
    pub(super) left: Vec<bool>,
    pub(super) phi: Vec<f64>,
}

impl Walk {
    pub(super) fn new(q: &Quadrature) -> Walk {
        // The largest tree's nodes and the dummy after them.
        let nodes = q.tree_nodes_max + 1;
        Walk {
            lanes: q.lanes,
            nodes,
            node: vec![0.0; 5 * q.lanes * nodes],
            one: vec![0.0; nodes],
            coef: vec![0.0; nodes],
            left: vec![false; nodes],
            phi: vec![0.0; q.lanes * q.columns.len()],
        }
    }

    /// Whether it holds what `q`'s walk needs.
    pub(super) fn fits(&self, q: &Quadrature) -> bool {
        self.lanes == q.lanes && self.nodes > q.dummy && self.phi.len() >= q.lanes * q.columns.len()
    }
}
