//! Reading a model file: map or read it, check its CRC-32 trailer, verify
//! the FlatBuffer within the heap bound, and copy it into a `Model` (its
//! embedding tables views of the mapping when the file is mapped), which
//! `Model::validate` then checks.

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use flatbuffers::{InvalidFlatbuffer, VerifierOptions};

use super::{
    CHECKSUM_MAGIC, CHECKSUM_TRAILER_BYTES, MODEL_HEAP_BYTES_MAX, MODEL_MAPPED_BYTES_MAX, MODEL_READ_BYTES_MAX,
    TREE_CATEGORICAL, TREE_LEAF, TREE_MISSING_LEFT, TREE_ZERO_MISSING,
};
use crate::features::groups::Scope;
use crate::model::trees::{self, Ensemble, Split, TreeNode};
use crate::model::{
    fb, graph, onnx_graph, Act, ActivationScales, Calibration, EmbeddingTable, Graph, GroupName, InputSegment, Layer,
    MeasuredError, Model, ModelError, ModelFile, Node, OnnxGraph, Op, OutputKind, ScoreHistogram, Source, TableError,
    LAYERS_MAX,
};

impl Model {
    /// Maps and validates a model file.
    ///
    /// What this reads: the FlatBuffer's structure (verified without
    /// walking scalar vectors), every byte outside the embedding tables
    /// (copied into owned arrays, at most `MODEL_HEAP_BYTES_MAX`), and every
    /// float of every embedding table once, for the finiteness check, which
    /// brings the tables into the page cache: its time grows with their
    /// size (90 ms for 1.28 GB already cached, 0.6-0.8 s from the disk, on
    /// a 2-core VM). The tables themselves are not copied: the model serves
    /// them from the mapping.
    pub fn load(path: &Path) -> Result<Model, ModelError> {
        Model::load_reading_at_most(path, MODEL_READ_BYTES_MAX)
    }

    /// `load`, reading files of at most `read_bytes_max` bytes and mapping
    /// bigger ones.
    pub(super) fn load_reading_at_most(path: &Path, read_bytes_max: u64) -> Result<Model, ModelError> {
        let p = path.display().to_string();
        let io = |source| ModelError::Io { path: p.clone(), source };
        let file = File::open(path).map_err(io)?;
        // The open file's length, not the path's: a rename between a stat
        // and the open would pair one file's length with another's bytes.
        let bytes_len = file.metadata().map_err(io)?.len();
        if bytes_len > MODEL_MAPPED_BYTES_MAX {
            return Err(ModelError::TooLarge { path: p, bytes: bytes_len });
        }
        if bytes_len < 8 {
            return Err(ModelError::Identifier { path: p });
        }
        if bytes_len <= read_bytes_max {
            let mut bytes = Vec::with_capacity(bytes_len as usize);
            std::io::Read::read_to_end(&mut std::io::Read::take(&file, bytes_len), &mut bytes).map_err(io)?;
            let body = verify_checksum(&bytes, &p)?;
            return Model::parse(body, None, &p);
        }
        // SAFETY: model files are replaced only by renaming a new file over
        // the old one, never truncated or rewritten in place: this crate
        // writes them only through `write_atomically` (temporary file, then
        // rename), and docs/OPERATING.md tells operators to do the same (`mv`, not
        // `cp` over a served file); smaller files, which hold no tables
        // written apart, are read above and never mapped. A rename leaves
        // the inode mapped here untouched, so the mapping stays valid while
        // the old model serves.
        let file = Arc::new(unsafe { ModelFile::map(&file) }.map_err(io)?);
        let body = verify_checksum(file.bytes(), &p)?;
        Model::parse(body, Some(&file), &p)
    }

    /// Validates a model file held in memory; its embedding tables are
    /// copied out (owned), unlike `load`'s.
    pub fn from_bytes(bytes: &[u8], path_for_errors: &str) -> Result<Model, ModelError> {
        Model::parse(verify_checksum(bytes, path_for_errors)?, None, path_for_errors)
    }

    /// `bytes` are all of `file`'s when it is given, and the embedding
    /// tables are then views of it.
    fn parse(bytes: &[u8], file: Option<&Arc<ModelFile>>, path_for_errors: &str) -> Result<Model, ModelError> {
        let p = path_for_errors.to_string();
        // The generated check asserts the buffer holds a root offset and an
        // identifier (8 bytes); a shorter file is simply not a model file.
        if bytes.len() < 8 || !fb::model_buffer_has_identifier(bytes) {
            return Err(ModelError::Identifier { path: p });
        }
        let opts = |max_apparent_size| VerifierOptions {
            max_depth: 8,
            max_tables: 2 + LAYERS_MAX + 16 + 2 * graph::NODES_MAX + 1 + onnx_graph::ONNX_INPUTS_MAX,
            max_apparent_size,
            ignore_missing_null_terminator: false,
        };
        // The verifier counts every byte each reference reaches (a table
        // read twice counts twice) against `max_apparent_size`, in one
        // check per vector: it never walks a scalar vector's elements, so
        // verifying a big table costs nothing. The first pass only makes
        // the buffer safe to read, with a bound no valid file reaches; the
        // second holds the heap parts to MODEL_HEAP_BYTES_MAX, now that the
        // inline tables it may exceed that by are known.
        let invalid = |source| ModelError::Invalid { path: p.clone(), source };
        let loose = usize::try_from(MODEL_MAPPED_BYTES_MAX).unwrap_or(usize::MAX);
        let m = flatbuffers::root_with_opts::<fb::Model>(&opts(loose), bytes).map_err(invalid)?;
        let heap_bound = MODEL_HEAP_BYTES_MAX.saturating_add(inline_table_bytes(&m));
        flatbuffers::root_with_opts::<fb::Model>(&opts(heap_bound), bytes).map_err(|source| match source {
            InvalidFlatbuffer::ApparentSizeTooLarge => ModelError::HeapTooLarge { path: p.clone() },
            source => invalid(source),
        })?;
        let name = m.name().unwrap_or("").to_string();
        let bad = |what: &str| ModelError::Shape { name: name.clone(), what: what.into() };
        let mut inputs = Vec::new();
        for s in m.inputs().unwrap_or_default() {
            let source = match s.source() {
                fb::Source::User => Source::User,
                fb::Source::Item => Source::Item,
                fb::Source::Context => Source::Context,
                fb::Source::ContextIds => Source::ContextIds,
                fb::Source::RequestGroup | fb::Source::CandidateGroup => {
                    let scope = if s.source() == fb::Source::RequestGroup { Scope::Request } else { Scope::Candidate };
                    let name = s.group().ok_or_else(|| bad("a group input segment names no group"))?;
                    let name = GroupName::new(name).map_err(|why| bad(&format!("an input segment's {why}")))?;
                    Source::Group { name, scope }
                }
                _ => return Err(bad("an input segment has an unknown source")),
            };
            inputs.push(InputSegment { source, dim: s.dim() as usize });
        }
        let mut layers = Vec::new();
        for l in m.layers().unwrap_or_default() {
            layers.push(layer_from_fb(&l).ok_or_else(|| bad("a layer has an unknown activation"))?);
        }
        let calibration = m.calibration().map(|c| Calibration {
            method: c.method().unwrap_or("").to_string(),
            rows: c.rows(),
            input_ranges: c.input_ranges().map(|v| v.iter().collect()).unwrap_or_default(),
            scores: ScoreHistogram {
                edges: c.scores().and_then(|h| h.edges()).map(|v| v.iter().collect()).unwrap_or_default(),
                counts: c.scores().and_then(|h| h.counts()).map(|v| v.iter().collect()).unwrap_or_default(),
            },
            input_means: c.input_means().map(|v| v.iter().collect()).unwrap_or_default(),
            input_variances: c.input_variances().map(|v| v.iter().collect()).unwrap_or_default(),
            activations: if c.activations() == fb::ActivationScales::Dynamic {
                ActivationScales::Dynamic
            } else {
                ActivationScales::Static
            },
            static_error: measured(c.static_error_max(), c.static_error_mean()),
            dynamic_error: measured(c.dynamic_error_max(), c.dynamic_error_mean()),
        });
        let graph = match m.graph() {
            Some(g) => Some(graph_from_fb(&g, bytes, file).map_err(|e| match e {
                FromFb::Shape(what) => bad(&what),
                FromFb::Table { node, source } => ModelError::Table { path: p.clone(), node, source },
            })?),
            None => None,
        };
        let onnx = match m.onnx() {
            Some(o) => Some(OnnxGraph::from_fb(&o).map_err(|what| bad(&what))?),
            None => None,
        };
        // Checked (count, bytes) by `validate`; the verifier bounds the bytes.
        let feature_names = m.feature_names().map(|v| v.iter().map(str::to_string).collect()).unwrap_or_default();
        let model =
            Model { name: name.clone(), version: m.version(), inputs, layers, calibration, graph, onnx, feature_names };
        model.validate()?;
        Ok(model)
    }
}

/// The file's bytes before its checksum trailer, once the checksum matches;
/// all of them, with a warning, for a file written before checksums (no
/// trailer). Reads every byte, so a mapped file's tables are paged in once.
fn verify_checksum<'b>(bytes: &'b [u8], path: &str) -> Result<&'b [u8], ModelError> {
    let Some(at) = bytes.len().checked_sub(CHECKSUM_TRAILER_BYTES) else {
        return Ok(bytes);
    };
    let (body, trailer) = bytes.split_at(at);
    if trailer[..4] != CHECKSUM_MAGIC {
        tracing::warn!(path, "model file has no checksum (written before Quiver stored one); save it again to add one");
        return Ok(bytes);
    }
    let stored = u32::from_le_bytes(trailer[4..].try_into().expect("four bytes"));
    let computed = crc32fast::hash(body);
    if stored != computed {
        return Err(ModelError::Checksum { path: path.into(), stored, computed });
    }
    Ok(body)
}

/// The bytes of the embedding tables stored inline, as the verifier counts
/// them (once per node that reads them).
fn inline_table_bytes(m: &fb::Model<'_>) -> usize {
    let nodes = m.graph().and_then(|g| g.nodes()).unwrap_or_default();
    nodes
        .iter()
        .filter(|n| n.op() == fb::NodeOp::Embedding)
        .map(|n| n.table().map_or(0, |t| 4 * t.len()))
        .fold(0, usize::saturating_add)
}

/// A v1 layer; `None` for an activation other than None or ReLU.
fn layer_from_fb(l: &fb::Layer<'_>) -> Option<Layer> {
    let relu = match l.activation() {
        fb::Activation::None => false,
        fb::Activation::Relu => true,
        _ => return None,
    };
    Some(Layer {
        in_dim: l.in_dim() as usize,
        out_dim: l.out_dim() as usize,
        relu,
        weights_f32: l.weights_f32().map(|v| v.iter().collect()).unwrap_or_default(),
        weights_i8: l.weights_i8().map(|v| v.iter().collect()).unwrap_or_default(),
        weight_scales: l.weight_scales().map(|v| v.iter().collect()).unwrap_or_default(),
        bias: l.bias().map(|v| v.iter().collect()).unwrap_or_default(),
    })
}

/// A measured error read back; NaN (the schema default) is "not measured".
fn measured(max: f32, mean: f32) -> Option<MeasuredError> {
    (!max.is_nan() && !mean.is_nan()).then_some(MeasuredError { max, mean })
}

fn act_from_fb(a: fb::Activation, alpha: f32) -> Option<Act> {
    Some(match a {
        fb::Activation::None => Act::None,
        fb::Activation::Relu => Act::Relu,
        fb::Activation::LeakyRelu => Act::LeakyRelu(alpha),
        fb::Activation::Tanh => Act::Tanh,
        fb::Activation::Sigmoid => Act::Sigmoid,
        fb::Activation::GeluErf => Act::GeluErf,
        fb::Activation::GeluTanh => Act::GeluTanh,
        fb::Activation::Silu => Act::Silu,
        fb::Activation::Erf => Act::Erf,
        fb::Activation::Sqrt => Act::Sqrt,
        _ => return None,
    })
}

/// Why `graph_from_fb` refused a graph.
enum FromFb {
    Shape(String),
    Table { node: usize, source: TableError },
}

impl From<String> for FromFb {
    fn from(what: String) -> FromFb {
        FromFb::Shape(what)
    }
}

/// The graph of a file whose bytes are `bytes`; with `file` (the mapping of
/// those bytes) its embedding tables are views of it, else copies.
fn graph_from_fb(g: &fb::Graph<'_>, bytes: &[u8], file: Option<&Arc<ModelFile>>) -> Result<Graph, FromFb> {
    let output = match g.output() {
        fb::OutputKind::Logit => OutputKind::Logit,
        fb::OutputKind::Raw => OutputKind::Raw,
        _ => return Err(FromFb::Shape("the graph has an unknown output kind".into())),
    };
    let fb_nodes = g.nodes().unwrap_or_default();
    if fb_nodes.len() > graph::NODES_MAX {
        return Err(format!("the graph has {} nodes; the limit is {}", fb_nodes.len(), graph::NODES_MAX).into());
    }
    let mut nodes = Vec::with_capacity(fb_nodes.len());
    for (i, n) in fb_nodes.iter().enumerate() {
        let floats = |v: Option<flatbuffers::Vector<'_, f32>>| v.map(|v| v.iter().collect()).unwrap_or_default();
        let act =
            || act_from_fb(n.activation(), n.alpha()).ok_or_else(|| format!("node {i} has an unknown activation"));
        let width = n.width() as usize;
        let op = match n.op() {
            fb::NodeOp::Input => Op::Input { offset: n.offset() as usize },
            fb::NodeOp::Dense => {
                let layer = n
                    .dense()
                    .and_then(|l| layer_from_fb(&l))
                    .ok_or_else(|| format!("node {i} (Dense) has no layer or an unknown layer activation"))?;
                Op::Dense { layer, act: act()? }
            }
            fb::NodeOp::Activation => Op::Act(act()?),
            fb::NodeOp::Add => Op::Add,
            fb::NodeOp::Sub => Op::Sub,
            fb::NodeOp::Mul => Op::Mul,
            fb::NodeOp::Div => Op::Div,
            fb::NodeOp::Affine => {
                Op::Affine { center: floats(n.center()), scale: floats(n.scale()), shift: floats(n.shift()) }
            }
            fb::NodeOp::Concat => Op::Concat,
            fb::NodeOp::LayerNorm => {
                Op::LayerNorm { epsilon: n.epsilon(), scale: floats(n.scale()), shift: floats(n.shift()) }
            }
            fb::NodeOp::Dot => Op::Dot,
            fb::NodeOp::Sum => Op::Sum,
            fb::NodeOp::Embedding => {
                let default: Vec<f32> = floats(n.table_default());
                let rows = n.table_rows() as usize;
                let table = embedding_table(&n, rows, default.len(), bytes, file).map_err(|e| match e {
                    Some(source) => FromFb::Table { node: i, source },
                    None => FromFb::Shape(format!("node {i} (Embedding) has its table both inline and at table_at")),
                })?;
                Op::Embedding { dim: default.len(), rows, table, default }
            }
            fb::NodeOp::Trees => {
                let e = n.trees().ok_or_else(|| format!("node {i} (Trees) has no ensemble"))?;
                Op::Trees(ensemble_from_fb(&e).map_err(|what| format!("node {i} (Trees): {what}"))?)
            }
            _ => return Err(format!("node {i} has an unknown op").into()),
        };
        let inputs = n.inputs().map(|v| v.iter().map(|x| x as usize).collect()).unwrap_or_default();
        nodes.push(Node { op, inputs, width });
    }
    Ok(Graph { nodes, output })
}

/// An Embedding node's `rows x dim` table, inline or at `table_at`: a view
/// of `file` when given (which `bytes` are all of), else a copy. A node with
/// no table gets an empty one, which validation refuses with the shape it
/// should have had. `Err(None)`: the node has both.
fn embedding_table(
    n: &fb::Node<'_>,
    rows: usize,
    dim: usize,
    bytes: &[u8],
    file: Option<&Arc<ModelFile>>,
) -> Result<EmbeddingTable, Option<TableError>> {
    let (at, floats) = match (n.table(), n.table_at()) {
        (Some(_), 1..) => return Err(None),
        // The verifier checked the vector lies in `bytes`.
        (Some(t), 0) => (t.bytes().as_ptr() as usize - bytes.as_ptr() as usize, t.len()),
        (None, 0) => return Ok(Vec::new().into()),
        (None, at) => {
            let out_of_file = || TableError::OutOfFile {
                at,
                floats: (rows as u64).saturating_mul(dim as u64),
                file_bytes: bytes.len() as u64,
            };
            let at = usize::try_from(at).map_err(|_| out_of_file())?;
            (at, rows.checked_mul(dim).ok_or_else(out_of_file)?)
        }
    };
    match file {
        Some(f) => EmbeddingTable::mapped(f, at, floats),
        None => EmbeddingTable::copied(bytes, at, floats),
    }
    .map_err(Some)
}

/// Reads an ensemble; `Graph::validate` checks it as a tree afterwards.
fn ensemble_from_fb(e: &fb::TreeEnsemble<'_>) -> Result<Ensemble, String> {
    let u32s = |v: Option<flatbuffers::Vector<'_, u32>>| v.map(|v| v.iter().collect::<Vec<u32>>()).unwrap_or_default();
    let starts = u32s(e.tree_starts());
    let feature = u32s(e.feature());
    let left = u32s(e.left());
    let right = u32s(e.right());
    let threshold: Vec<f32> = e.threshold().map(|v| v.iter().collect()).unwrap_or_default();
    let flags: Vec<u8> = e.flags().map(|v| v.iter().collect()).unwrap_or_default();
    let cat_ranges = u32s(e.cat_ranges());
    let n = feature.len();
    if [threshold.len(), left.len(), right.len(), flags.len()].iter().any(|l| *l != n) {
        return Err("its per-node arrays differ in length".into());
    }
    if n > trees::ENSEMBLE_NODES_MAX {
        return Err(format!("{n} nodes; the limit is {}", trees::ENSEMBLE_NODES_MAX));
    }
    let mut nodes = Vec::with_capacity(n);
    let mut cats = cat_ranges.chunks_exact(2);
    for i in 0..n {
        let fl = flags[i];
        let split = if fl & TREE_LEAF != 0 {
            Split::Leaf { value: threshold[i] }
        } else if fl & TREE_CATEGORICAL != 0 {
            let r = cats.next().ok_or("a categorical split has no bitset range")?;
            Split::Categorical { feature: feature[i], start: r[0], len: r[1] }
        } else {
            Split::Numeric {
                feature: feature[i],
                threshold: threshold[i],
                missing_left: fl & TREE_MISSING_LEFT != 0,
                zero_missing: fl & TREE_ZERO_MISSING != 0,
            }
        };
        nodes.push(TreeNode { split, left: left[i], right: right[i] });
    }
    if cats.next().is_some() || cat_ranges.len() % 2 != 0 {
        return Err("more bitset ranges than categorical splits".into());
    }
    let covers: Vec<f32> = e.covers().map(|v| v.iter().collect()).unwrap_or_default();
    if !covers.is_empty() && covers.len() != n {
        return Err(format!("{} node covers for {n} nodes", covers.len()));
    }
    Ok(Ensemble { starts, nodes, cat_words: u32s(e.cat_words()), base: e.base(), covers })
}
