//! Writing a model file: the FlatBuffer, embedding tables too large to be
//! inline streamed after it from the model's memory, and the CRC-32
//! trailer, written to a new file renamed over the old one.

use std::fs::File;
use std::io::Write;
use std::path::Path;

use flatbuffers::{FlatBufferBuilder, WIPOffset};

use super::{
    CHECKSUM_MAGIC, EMBEDDING_INLINE_BYTES_MAX, TABLE_ALIGN_BYTES, TREE_CATEGORICAL, TREE_LEAF, TREE_MISSING_LEFT,
    TREE_ZERO_MISSING,
};
use crate::features::groups::Scope;
use crate::model::trees::{Ensemble, Split};
use crate::model::{fb, Act, ActivationScales, Graph, Layer, Model, ModelError, Op, OutputKind, Source};

impl Model {
    /// The model file's bytes, as `save` writes them.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.write_file(&mut out, EMBEDDING_INLINE_BYTES_MAX).expect("writing into a Vec cannot fail");
        out
    }

    /// Writes the model file atomically: a new file renamed over `path`.
    pub fn save(&self, path: &Path) -> Result<(), ModelError> {
        write_atomically(path, |w| self.write_file(w, EMBEDDING_INLINE_BYTES_MAX))
    }

    /// Writes the file: the FlatBuffer, then, when the embedding tables
    /// together are over `inline_bytes_max`, each table at its `table_at`
    /// (zeros between), streamed from the model's memory.
    pub(super) fn write_file(&self, w: &mut impl Write, inline_bytes_max: usize) -> std::io::Result<()> {
        let mut w = Summing { inner: w, crc: crc32fast::Hasher::new() };
        self.write_body(&mut w, inline_bytes_max)?;
        let crc = w.crc.finalize();
        w.inner.write_all(&CHECKSUM_MAGIC)?;
        w.inner.write_all(&crc.to_le_bytes())
    }

    /// The file before its checksum trailer.
    pub(super) fn write_body(&self, w: &mut impl Write, inline_bytes_max: usize) -> std::io::Result<()> {
        let (b, tables) = self.encode(inline_bytes_max);
        let head = b.finished_data();
        w.write_all(head)?;
        let mut written = head.len() as u64;
        let mut le = Vec::with_capacity(1 << 16);
        for (at, t) in tables {
            w.write_all(&[0; TABLE_ALIGN_BYTES][..(at - written) as usize])?;
            for chunk in t.chunks(1 << 14) {
                le.clear();
                le.extend(chunk.iter().flat_map(|v| v.to_le_bytes()));
                w.write_all(&le)?;
            }
            written = at + 4 * t.len() as u64;
        }
        Ok(())
    }

    /// The FlatBuffer and the tables to write after it, by file offset.
    fn encode(&self, inline_bytes_max: usize) -> (FlatBufferBuilder<'static>, Vec<(u64, &[f32])>) {
        let tables: Vec<(usize, &[f32])> = self.graph.as_ref().map_or_else(Vec::new, |g| {
            g.nodes
                .iter()
                .enumerate()
                .filter_map(|(i, n)| match &n.op {
                    Op::Embedding { table, .. } => Some((i, &**table)),
                    _ => None,
                })
                .collect()
        });
        let bytes: usize = tables.iter().map(|(_, t)| 4 * t.len()).sum();
        if bytes <= inline_bytes_max {
            return (self.build(&[]), Vec::new());
        }
        // Where the tables go depends on the FlatBuffer's length, which does
        // not depend on the offsets' values (a scalar field not at its
        // default takes the same bytes whatever it holds): a first build
        // with placeholders measures it.
        let placeholders: Vec<(usize, u64)> = tables.iter().map(|&(i, _)| (i, u64::MAX)).collect();
        let head_bytes = self.build(&placeholders).finished_data().len();
        let mut at = head_bytes;
        let mut table_at = Vec::with_capacity(tables.len());
        let mut placed = Vec::with_capacity(tables.len());
        for (i, t) in tables {
            at = at.next_multiple_of(TABLE_ALIGN_BYTES);
            table_at.push((i, at as u64));
            placed.push((at as u64, t));
            at += 4 * t.len();
        }
        let b = self.build(&table_at);
        assert_eq!(b.finished_data().len(), head_bytes, "the offsets' values changed the FlatBuffer's length");
        (b, placed)
    }

    /// The FlatBuffer, with the embedding table of each node named in
    /// `table_at` stored at that file offset instead of inline.
    fn build(&self, table_at: &[(usize, u64)]) -> FlatBufferBuilder<'static> {
        let mut b = FlatBufferBuilder::new();
        let inputs: Vec<_> = self
            .inputs
            .iter()
            .map(|s| {
                let (source, group) = match s.source {
                    Source::User => (fb::Source::User, None),
                    Source::Item => (fb::Source::Item, None),
                    Source::Context => (fb::Source::Context, None),
                    Source::ContextIds => (fb::Source::ContextIds, None),
                    Source::Group { name, scope: Scope::Request } => (fb::Source::RequestGroup, Some(name)),
                    Source::Group { name, scope: Scope::Candidate } => (fb::Source::CandidateGroup, Some(name)),
                };
                let group = group.map(|g| b.create_string(g.as_str()));
                fb::InputSegment::create(&mut b, &fb::InputSegmentArgs { source, dim: s.dim as u32, group })
            })
            .collect();
        let layers: Vec<_> = self.layers.iter().map(|l| layer_to_fb(&mut b, l)).collect();
        let graph = self.graph.as_ref().map(|g| graph_to_fb(&mut b, g, table_at));
        let onnx = self.onnx.as_ref().map(|o| o.to_fb(&mut b));
        let calibration = self.calibration.as_ref().map(|c| {
            let edges = Some(b.create_vector(&c.scores.edges));
            let counts = Some(b.create_vector(&c.scores.counts));
            let scores = Some(fb::ScoreHistogram::create(&mut b, &fb::ScoreHistogramArgs { edges, counts }));
            let method = Some(b.create_string(&c.method));
            let input_ranges = Some(b.create_vector(&c.input_ranges));
            // Absent rather than empty, as older writers left them.
            let input_means = (!c.input_means.is_empty()).then(|| b.create_vector(&c.input_means));
            let input_variances = (!c.input_variances.is_empty()).then(|| b.create_vector(&c.input_variances));
            let (static_error_max, static_error_mean) =
                c.static_error.map_or((f32::NAN, f32::NAN), |e| (e.max, e.mean));
            let (dynamic_error_max, dynamic_error_mean) =
                c.dynamic_error.map_or((f32::NAN, f32::NAN), |e| (e.max, e.mean));
            let activations = match c.activations {
                ActivationScales::Static => fb::ActivationScales::Static,
                ActivationScales::Dynamic => fb::ActivationScales::Dynamic,
            };
            fb::Calibration::create(
                &mut b,
                &fb::CalibrationArgs {
                    method,
                    rows: c.rows,
                    input_ranges,
                    scores,
                    input_means,
                    input_variances,
                    activations,
                    static_error_max,
                    static_error_mean,
                    dynamic_error_max,
                    dynamic_error_mean,
                },
            )
        });
        // Absent rather than empty, as files from before names were kept.
        let feature_names = (!self.feature_names.is_empty()).then(|| {
            let names: Vec<_> = self.feature_names.iter().map(|f| b.create_string(f)).collect();
            b.create_vector(&names)
        });
        let name = Some(b.create_string(&self.name));
        let inputs = Some(b.create_vector(&inputs));
        let layers = Some(b.create_vector(&layers));
        let root = fb::Model::create(
            &mut b,
            &fb::ModelArgs { name, version: self.version, inputs, layers, calibration, graph, onnx, feature_names },
        );
        fb::finish_model_buffer(&mut b, root);
        b
    }
}

/// A writer that sums what passes through it.
struct Summing<'w, W: Write> {
    inner: &'w mut W,
    crc: crc32fast::Hasher,
}

impl<W: Write> Write for Summing<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.crc.update(&buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Writes a model file as a new file renamed over `path`, never in place: a
/// server may have the file at `path` mapped (`Model::load`), and a rename
/// leaves that inode, and its mapping, as they were, where truncating it
/// would make the server's next read of a lost page a SIGBUS. (Streams the
/// file, unlike `replica::write_atomically`, so that gigabytes of tables
/// need no second copy in memory.)
fn write_atomically(
    path: &Path,
    write: impl FnOnce(&mut std::io::BufWriter<File>) -> std::io::Result<()>,
) -> Result<(), ModelError> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".write.tmp");
    let tmp = std::path::PathBuf::from(tmp);
    let written = (|| {
        let mut w = std::io::BufWriter::with_capacity(1 << 20, File::create(&tmp)?);
        write(&mut w)?;
        w.into_inner().map_err(std::io::IntoInnerError::into_error)?.sync_all()?;
        std::fs::rename(&tmp, path)?;
        match path.parent().filter(|d| !d.as_os_str().is_empty()) {
            Some(dir) => File::open(dir)?.sync_all(),
            None => Ok(()),
        }
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written.map_err(|source| ModelError::Io { path: path.display().to_string(), source })
}

fn layer_to_fb<'b>(b: &mut FlatBufferBuilder<'b>, l: &Layer) -> WIPOffset<fb::Layer<'b>> {
    let weights_f32 = Some(b.create_vector(&l.weights_f32));
    let weights_i8 = Some(b.create_vector(&l.weights_i8));
    let weight_scales = Some(b.create_vector(&l.weight_scales));
    let bias = Some(b.create_vector(&l.bias));
    fb::Layer::create(
        b,
        &fb::LayerArgs {
            in_dim: l.in_dim as u32,
            out_dim: l.out_dim as u32,
            activation: if l.relu { fb::Activation::Relu } else { fb::Activation::None },
            weights_f32,
            weights_i8,
            weight_scales,
            bias,
        },
    )
}

fn act_to_fb(a: Act) -> (fb::Activation, f32) {
    match a {
        Act::None => (fb::Activation::None, 0.0),
        Act::Relu => (fb::Activation::Relu, 0.0),
        Act::LeakyRelu(alpha) => (fb::Activation::LeakyRelu, alpha),
        Act::Tanh => (fb::Activation::Tanh, 0.0),
        Act::Sigmoid => (fb::Activation::Sigmoid, 0.0),
        Act::GeluErf => (fb::Activation::GeluErf, 0.0),
        Act::GeluTanh => (fb::Activation::GeluTanh, 0.0),
        Act::Silu => (fb::Activation::Silu, 0.0),
        Act::Erf => (fb::Activation::Erf, 0.0),
        Act::Sqrt => (fb::Activation::Sqrt, 0.0),
    }
}

fn graph_to_fb<'b>(b: &mut FlatBufferBuilder<'b>, g: &Graph, table_at: &[(usize, u64)]) -> WIPOffset<fb::Graph<'b>> {
    let nodes: Vec<_> = g
        .nodes
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let inputs: Vec<u32> = n.inputs.iter().map(|&i| i as u32).collect();
            let inputs = Some(b.create_vector(&inputs));
            let mut args = fb::NodeArgs { inputs, width: n.width as u32, ..Default::default() };
            let floats = |b: &mut FlatBufferBuilder<'b>, v: &[f32]| Some(b.create_vector(v));
            match &n.op {
                Op::Input { offset } => {
                    args.op = fb::NodeOp::Input;
                    args.offset = *offset as u32;
                }
                Op::Dense { layer, act } => {
                    args.op = fb::NodeOp::Dense;
                    args.dense = Some(layer_to_fb(b, layer));
                    (args.activation, args.alpha) = act_to_fb(*act);
                }
                Op::Act(act) => {
                    args.op = fb::NodeOp::Activation;
                    (args.activation, args.alpha) = act_to_fb(*act);
                }
                Op::Add => args.op = fb::NodeOp::Add,
                Op::Sub => args.op = fb::NodeOp::Sub,
                Op::Mul => args.op = fb::NodeOp::Mul,
                Op::Div => args.op = fb::NodeOp::Div,
                Op::Affine { center, scale, shift } => {
                    args.op = fb::NodeOp::Affine;
                    args.center = floats(b, center);
                    args.scale = floats(b, scale);
                    args.shift = floats(b, shift);
                }
                Op::Concat => args.op = fb::NodeOp::Concat,
                Op::LayerNorm { epsilon, scale, shift } => {
                    args.op = fb::NodeOp::LayerNorm;
                    args.epsilon = *epsilon;
                    args.scale = floats(b, scale);
                    args.shift = floats(b, shift);
                }
                Op::Dot => args.op = fb::NodeOp::Dot,
                Op::Sum => args.op = fb::NodeOp::Sum,
                Op::Embedding { dim: _, rows, table, default } => {
                    args.op = fb::NodeOp::Embedding;
                    args.table_rows = *rows as u32;
                    match table_at.iter().find(|(node, _)| *node == i) {
                        Some(&(_, at)) => args.table_at = at,
                        None => args.table = floats(b, table),
                    }
                    args.table_default = floats(b, default);
                }
                Op::Trees(e) => {
                    args.op = fb::NodeOp::Trees;
                    args.trees = Some(ensemble_to_fb(b, e));
                }
            }
            fb::Node::create(b, &args)
        })
        .collect();
    let nodes = Some(b.create_vector(&nodes));
    let output = match g.output {
        OutputKind::Logit => fb::OutputKind::Logit,
        OutputKind::Raw => fb::OutputKind::Raw,
    };
    fb::Graph::create(b, &fb::GraphArgs { nodes, output })
}

fn ensemble_to_fb<'b>(b: &mut FlatBufferBuilder<'b>, e: &Ensemble) -> WIPOffset<fb::TreeEnsemble<'b>> {
    let n = e.nodes.len();
    let (mut feature, mut threshold, mut flags) = (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
    let mut cat_ranges = Vec::new();
    for node in &e.nodes {
        let (f, t, fl) = match node.split {
            Split::Leaf { value } => (0, value, TREE_LEAF),
            Split::Numeric { feature, threshold, missing_left, zero_missing } => {
                let fl =
                    if missing_left { TREE_MISSING_LEFT } else { 0 } | if zero_missing { TREE_ZERO_MISSING } else { 0 };
                (feature, threshold, fl)
            }
            Split::Categorical { feature, start, len } => {
                cat_ranges.extend([start, len]);
                (feature, 0.0, TREE_CATEGORICAL)
            }
        };
        feature.push(f);
        threshold.push(t);
        flags.push(fl);
    }
    let left: Vec<u32> = e.nodes.iter().map(|n| n.left).collect();
    let right: Vec<u32> = e.nodes.iter().map(|n| n.right).collect();
    let args = fb::TreeEnsembleArgs {
        tree_starts: Some(b.create_vector(&e.starts)),
        feature: Some(b.create_vector(&feature)),
        threshold: Some(b.create_vector(&threshold)),
        left: Some(b.create_vector(&left)),
        right: Some(b.create_vector(&right)),
        flags: Some(b.create_vector(&flags)),
        cat_ranges: Some(b.create_vector(&cat_ranges)),
        cat_words: Some(b.create_vector(&e.cat_words)),
        base: e.base,
        // Left out when unknown, so the file reads as one written before
        // covers existed.
        covers: (!e.covers.is_empty()).then(|| b.create_vector(&e.covers)),
    };
    fb::TreeEnsemble::create(b, &args)
}
