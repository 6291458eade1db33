//! The model file (`schemas/model.fbs`): reading and writing it, the
//! CRC-32 trailer that guards it, and the limits on what a file may hold.
//!
//! Split from the model type (`model/mod.rs`) so that the type, its
//! invariants and its arithmetic read without the FlatBuffers plumbing:
//! `decode` maps or reads a file, verifies its checksum and its buffer,
//! and copies it into a `Model` that `Model::validate` then checks;
//! `encode` builds the buffer, streams embedding tables too large to be
//! inline after it, and writes the file through a rename. Both directions
//! are methods of `Model` (`Model::load`, `Model::save`, …) so callers
//! never name this module.

mod decode;
mod encode;

use super::graph;

/// Most bytes of a model file that loading copies into the heap: all of it
/// but the embedding tables, counted as the FlatBuffers verifier counts
/// (every byte each reference reaches). Also the most an importer reads of
/// its input file.
pub const MODEL_HEAP_BYTES_MAX: usize = 1 << 30;
/// Largest model file accepted: room for `graph::EMBEDDING_FLOATS_MAX`
/// floats of embedding tables (16 GiB) beside `MODEL_HEAP_BYTES_MAX` of the
/// rest, with some to spare. The file is mapped, not read, so this bounds
/// address space, and the load time through the one pass over the tables.
pub const MODEL_MAPPED_BYTES_MAX: u64 = 18 << 30;
const _: () = assert!(
    MODEL_MAPPED_BYTES_MAX
        >= (MODEL_HEAP_BYTES_MAX + 4 * graph::EMBEDDING_FLOATS_MAX + graph::NODES_MAX * TABLE_ALIGN_BYTES) as u64
);
/// Embedding tables of more bytes than this, all together, are written
/// after the FlatBuffer rather than in it: FlatBuffers caps a buffer at
/// 2 GiB, and written apart they are streamed to the file from the model's
/// memory, not copied into the builder first. Smaller ones stay inline,
/// where servers from before `table_at` read them too.
pub const EMBEDDING_INLINE_BYTES_MAX: usize = 64 << 20;
/// Files up to this size are read into memory, not mapped: nothing of them
/// stays mapped, so a file rewritten in place (`cp new.qm model.qm`) cannot
/// touch a served model. Bigger ones hold embedding tables written apart,
/// which stay mapped (shared, paged in as used) and must be replaced by
/// renaming a new file over them.
pub const MODEL_READ_BYTES_MAX: u64 = EMBEDDING_INLINE_BYTES_MAX as u64;
/// The last bytes of a model file: this magic, then the CRC-32 (little
/// endian) of every byte before them. Files written before it have none
/// and load with a warning.
const CHECKSUM_MAGIC: [u8; 4] = *b"QVC1";
const CHECKSUM_TRAILER_BYTES: usize = 8;
/// A table written after the FlatBuffer starts at a multiple of this.
const TABLE_ALIGN_BYTES: usize = 64;

/// The bits of `TreeEnsemble.flags`, one byte per node.
const TREE_LEAF: u8 = 1;
const TREE_CATEGORICAL: u8 = 2;
const TREE_MISSING_LEFT: u8 = 4;
const TREE_ZERO_MISSING: u8 = 8;

#[cfg(test)]
mod tests {
    use flatbuffers::FlatBufferBuilder;

    use super::*;
    use crate::model::tests::{calibrated, tiny};
    use crate::model::{
        fb, Act, Calibration, EmbeddingTable, Graph, InputSegment, Layer, Model, ModelError, Node, Op, OutputKind,
        Source, TableError,
    };

    #[test]
    fn file_round_trip_and_refusals() {
        let m = tiny();
        let bytes = m.to_bytes();
        assert_eq!(Model::from_bytes(&bytes, "t").unwrap(), m);
        assert!(Model::from_bytes(&bytes[..bytes.len() / 2], "t").is_err());
        assert!(matches!(Model::from_bytes(b"garbage!", "t"), Err(ModelError::Identifier { .. })));

        let mut broken = m.clone();
        broken.layers[1].in_dim = 3;
        let err = Model::from_bytes(&broken.to_bytes(), "t").unwrap_err();
        assert!(err.to_string().contains("layer 1"), "{err}");

        let mut two_outputs = m.clone();
        two_outputs.layers[1] = Layer::quantize(2, 2, false, vec![0.0; 4], vec![0.0; 2]);
        assert!(Model::from_bytes(&two_outputs.to_bytes(), "t").is_err());

        let mut nan = m;
        nan.layers[0].weights_f32[0] = f32::NAN;
        assert!(Model::from_bytes(&nan.to_bytes(), "t").is_err());
    }

    #[test]
    fn group_inputs_round_trip_with_their_scope_and_duplicates_are_refused() {
        use crate::features::groups::Scope;
        use crate::model::GroupName;
        let group = |name: &str, scope| Source::Group { name: GroupName::new(name).unwrap(), scope };
        let mut m = tiny();
        let width: usize = m.inputs.iter().map(|s| s.dim).sum();
        m.inputs = vec![
            InputSegment { source: group("card", Scope::Request), dim: 1 },
            InputSegment { source: group("ad", Scope::Candidate), dim: width - 2 },
            InputSegment { source: Source::Context, dim: 1 },
        ];
        let back = Model::from_bytes(&m.to_bytes(), "t").unwrap();
        assert_eq!(back, m);
        assert_eq!(back.request_columns().iter().filter(|r| !**r).count(), width - 2);

        let mut twice = m.clone();
        twice.inputs[2] = InputSegment { source: group("card", Scope::Candidate), dim: 1 };
        let err = Model::from_bytes(&twice.to_bytes(), "t").unwrap_err();
        assert!(err.to_string().contains("declares the card input more than once"), "{err}");
    }

    #[test]
    fn calibration_round_trips_and_bad_calibrations_are_refused() {
        let m = calibrated();
        assert_eq!(Model::from_bytes(&m.to_bytes(), "t").unwrap(), m);
        let refused = |edit: &dyn Fn(&mut Calibration)| {
            let mut bad = calibrated();
            edit(bad.calibration.as_mut().unwrap());
            Model::from_bytes(&bad.to_bytes(), "t").unwrap_err().to_string()
        };
        assert!(refused(&|c| c.input_ranges.pop().map(drop).unwrap_or(())).contains("1 activation ranges for 2"));
        assert!(refused(&|c| c.input_ranges[1] = 0.0).contains("non-positive activation range"));
        assert!(refused(&|c| c.input_ranges[0] = f32::INFINITY).contains("non-finite"));
        assert!(refused(&|c| c.scores.edges[1] = 1.0).contains("not ascending"));
        assert!(refused(&|c| c.scores.counts.push(0)).contains("not ascending"));
        assert!(refused(&|c| c.input_means.push(0.0))
            .contains("2 input means and 1 variances for 1 context inputs, 3 per-request inputs and"));
        assert!(refused(&|c| c.input_variances[0] = -1.0).contains("bad variance"));
        assert!(refused(&|c| c.input_means[0] = f32::NAN).contains("non-finite input mean"));
        // A calibration written before the moments were stored still reads.
        let mut older = calibrated();
        let c = older.calibration.as_mut().unwrap();
        (c.input_means, c.input_variances) = (Vec::new(), Vec::new());
        let bytes = older.to_bytes();
        assert!(flatbuffers::root::<fb::Model>(&bytes).unwrap().calibration().unwrap().input_means().is_none());
        assert_eq!(Model::from_bytes(&bytes, "t").unwrap(), older);
    }

    /// A user vector and two context ids, each read by its own table.
    fn embedded(rows: usize) -> Model {
        let table = |seed: usize| -> EmbeddingTable {
            (0..rows * 3).map(|i| ((i * 7 + seed) % 101) as f32 / 101.0).collect::<Vec<f32>>().into()
        };
        let nodes = vec![
            Node { op: Op::Input { offset: 2 }, inputs: vec![], width: 1 },
            Node {
                op: Op::Embedding { dim: 3, rows, table: table(1), default: vec![0.5; 3] },
                inputs: vec![0],
                width: 3,
            },
            Node { op: Op::Input { offset: 3 }, inputs: vec![], width: 1 },
            Node {
                op: Op::Embedding { dim: 3, rows, table: table(2), default: vec![-0.5; 3] },
                inputs: vec![2],
                width: 3,
            },
            Node { op: Op::Input { offset: 0 }, inputs: vec![], width: 2 },
            Node { op: Op::Concat, inputs: vec![1, 3, 4], width: 8 },
            Node {
                op: Op::Dense { layer: Layer::quantize(8, 1, false, vec![0.25; 8], vec![0.0]), act: Act::None },
                inputs: vec![5],
                width: 1,
            },
        ];
        Model {
            name: "emb".into(),
            version: 1,
            inputs: vec![
                InputSegment { source: Source::User, dim: 2 },
                InputSegment { source: Source::ContextIds, dim: 2 },
            ],
            layers: vec![],
            calibration: None,
            graph: Some(Graph { nodes, output: OutputKind::Logit }),
            onnx: None,
            feature_names: Vec::new(),
        }
    }

    fn tables(m: &Model) -> Vec<&EmbeddingTable> {
        let nodes = m.graph.as_ref().map_or(&[][..], |g| &g.nodes[..]);
        nodes
            .iter()
            .filter_map(|n| match &n.op {
                Op::Embedding { table, .. } => Some(table),
                _ => None,
            })
            .collect()
    }

    fn scratch(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("quiver-model-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn embedding_tables_round_trip_inline_and_after_the_flatbuffer_and_load_mapped() {
        let m = embedded(1000);
        let dir = scratch("tables");
        for (k, inline_bytes_max) in [usize::MAX, 0].into_iter().enumerate() {
            let mut bytes = Vec::new();
            m.write_file(&mut bytes, inline_bytes_max).unwrap();
            let root = flatbuffers::root::<fb::Model>(&bytes).unwrap();
            let nodes = root.graph().and_then(|g| g.nodes()).unwrap();
            for n in nodes.iter().filter(|n| n.op() == fb::NodeOp::Embedding) {
                if inline_bytes_max == 0 {
                    assert!(n.table().is_none() && n.table_at() > 0 && n.table_at() % TABLE_ALIGN_BYTES as u64 == 0);
                } else {
                    assert!(n.table().is_some() && n.table_at() == 0);
                }
            }
            let copied = Model::from_bytes(&bytes, "t").unwrap();
            assert_eq!(copied, m);
            assert!(tables(&copied).iter().all(|t| !t.is_mapped()));
            // A new file each time: writing over a mapped one in place is
            // exactly what the mapping forbids.
            let path = dir.join(format!("{k}.qm"));
            std::fs::write(&path, &bytes).unwrap();
            // A file this small is read, and nothing of it stays mapped.
            let read = Model::load(&path).unwrap();
            assert_eq!(read, m);
            assert!(tables(&read).iter().all(|t| !t.is_mapped()));
            let loaded = Model::load_reading_at_most(&path, 0).unwrap();
            assert_eq!(loaded, m);
            for t in tables(&loaded) {
                let file = t.file().unwrap();
                assert!(file.bytes().as_ptr_range().contains(&t.as_ptr().cast()), "{t:?}");
                assert_eq!(file.bytes().len(), bytes.len());
                assert_eq!(&bytes[bytes.len() - CHECKSUM_TRAILER_BYTES..][..4], b"QVC1");
            }
            let x = [0.5, -1.0, 999.0, 1000.0, 0.25, 0.75, 3.0, -2.0];
            let (mut want, mut got) = ([0.0; 2], [0.0; 2]);
            m.forward_f32_reference(&x, 2, &mut want);
            loaded.forward_f32_reference(&x, 2, &mut got);
            assert_eq!(want, got);
        }
        // Small tables stay inline, where older servers read them too.
        let mut inline = Vec::new();
        m.write_file(&mut inline, usize::MAX).unwrap();
        assert_eq!(m.to_bytes(), inline);
        let saved = dir.join("saved.qm");
        m.save(&saved).unwrap();
        assert_eq!(std::fs::read(&saved).unwrap(), inline);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn tables_after_the_flatbuffer_are_refused_when_the_file_is_short() {
        // Without the checksum trailer (as files from before it), where the
        // table bounds are the only check.
        let m = embedded(1000);
        let mut bytes = Vec::new();
        m.write_body(&mut bytes, 0).unwrap();
        for cut in [4, 3 * 4 * 1000, 3 * 4 * 1000 + 1] {
            let e = Model::from_bytes(&bytes[..bytes.len() - cut], "t").unwrap_err();
            assert!(
                matches!(e, ModelError::Table { node: 3, source: TableError::OutOfFile { floats: 3000, .. }, .. }),
                "{cut}: {e}"
            );
        }
        let e = Model::from_bytes(&bytes[..bytes.len() - 2 * 3 * 4 * 1000], "t").unwrap_err();
        assert!(matches!(e, ModelError::Table { node: 1, .. }), "{e}");
        assert!(e.to_string().contains("node 1"), "{e}");
    }

    #[test]
    fn a_flipped_bit_or_a_cut_is_refused_with_a_typed_error_and_old_files_still_load() {
        let m = embedded(1000);
        for inline_bytes_max in [usize::MAX, 0] {
            let mut bytes = Vec::new();
            m.write_file(&mut bytes, inline_bytes_max).unwrap();
            for at in [0, 9, bytes.len() / 2, bytes.len() - CHECKSUM_TRAILER_BYTES - 1] {
                let mut flipped = bytes.clone();
                flipped[at] ^= 0x10;
                let e = Model::from_bytes(&flipped, "t").unwrap_err();
                assert!(matches!(e, ModelError::Checksum { .. }), "bit {at}: {e}");
                assert!(e.to_string().contains("checksum mismatch"), "{e}");
            }
            // A copy cut short has no trailer, so it is read as an old file:
            // cut within the trailer, the model is all there; cut further,
            // what is missing is refused (never a panic).
            for cut in [1, 8] {
                assert_eq!(Model::from_bytes(&bytes[..bytes.len() - cut], "t").unwrap(), m);
            }
            for cut in [9, 100, bytes.len() / 2, bytes.len() - 7] {
                let e = Model::from_bytes(&bytes[..bytes.len() - cut], "t");
                assert!(e.is_err(), "cut {cut} of {} loaded", bytes.len());
            }
            // A file from before checksums loads.
            let mut old = Vec::new();
            m.write_body(&mut old, inline_bytes_max).unwrap();
            assert_eq!(Model::from_bytes(&old, "t").unwrap(), m);
        }
    }

    #[test]
    fn heap_parts_over_the_limit_are_refused_even_when_the_file_is_small() {
        // One 64 MiB weight vector that 17 dense layers all point at: a small
        // file, but loading would copy 17 x 64 MiB, over MODEL_HEAP_BYTES_MAX.
        let k = 1 << 12;
        let mut b = FlatBufferBuilder::new();
        let weights = b.create_vector(&vec![0.5f32; k * k]);
        let weights_i8 = b.create_vector(&[1i8; 16]);
        let ones = b.create_vector(&vec![1.0f32; k]);
        let layer = fb::Layer::create(
            &mut b,
            &fb::LayerArgs {
                in_dim: k as u32,
                out_dim: k as u32,
                activation: fb::Activation::None,
                weights_f32: Some(weights),
                weights_i8: Some(weights_i8),
                weight_scales: Some(ones),
                bias: Some(ones),
            },
        );
        let nodes: Vec<_> = (0..17)
            .map(|i| {
                let inputs = Some(b.create_vector(&[i as u32]));
                let args = fb::NodeArgs { op: fb::NodeOp::Dense, inputs, dense: Some(layer), ..Default::default() };
                fb::Node::create(&mut b, &args)
            })
            .collect();
        let nodes = Some(b.create_vector(&nodes));
        let graph = Some(fb::Graph::create(&mut b, &fb::GraphArgs { nodes, output: fb::OutputKind::Logit }));
        let name = Some(b.create_string("shared"));
        let root = fb::Model::create(&mut b, &fb::ModelArgs { name, graph, ..Default::default() });
        fb::finish_model_buffer(&mut b, root);
        let bytes = b.finished_data();
        assert!(bytes.len() < MODEL_HEAP_BYTES_MAX / 8);
        let e = Model::from_bytes(bytes, "shared.qm").unwrap_err();
        assert!(matches!(e, ModelError::HeapTooLarge { .. }), "{e}");
        assert!(e.to_string().contains("MODEL_HEAP_BYTES_MAX"), "{e}");
    }

    fn tree_model(covers: Vec<f32>) -> Model {
        let mut e = crate::model::trees::tests::small();
        e.covers = covers;
        let graph = Graph {
            nodes: vec![
                Node { op: Op::Input { offset: 0 }, inputs: vec![], width: 3 },
                Node { op: Op::Trees(e), inputs: vec![0], width: 1 },
            ],
            output: OutputKind::Logit,
        };
        Model {
            inputs: vec![InputSegment { source: Source::Context, dim: 3 }],
            layers: Vec::new(),
            graph: Some(graph),
            ..tiny()
        }
    }

    #[test]
    fn tree_covers_round_trip_and_files_without_them_read_as_unexplainable() {
        let covered = tree_model(vec![10.0, 4.0, 6.0, 10.0, 3.0, 7.0, 2.5, 4.5]);
        assert_eq!(Model::from_bytes(&covered.to_bytes(), "c.qm").unwrap(), covered);
        let bare = tree_model(Vec::new());
        let bytes = bare.to_bytes();
        let fb_model = flatbuffers::root::<fb::Model>(&bytes).unwrap();
        let fb_trees = fb_model.graph().unwrap().nodes().unwrap().get(1).trees().unwrap();
        assert!(fb_trees.covers().is_none(), "no covers field, as files from before it");
        let read = Model::from_bytes(&bytes, "old.qm").unwrap();
        assert_eq!(read, bare);
        let Some(Op::Trees(e)) = read.graph.as_ref().map(|g| &g.nodes[1].op) else { panic!("no trees") };
        assert!(!e.has_covers());
        let short = tree_model(vec![1.0; 3]);
        let err = Model::from_bytes(&short.to_bytes(), "short.qm").unwrap_err().to_string();
        assert!(err.contains("3 node covers for 8 nodes"), "{err}");
    }

    #[test]
    fn feature_names_round_trip_and_files_without_them_name_columns_by_segment() {
        let bare = tree_model(Vec::new());
        let bytes = bare.to_bytes();
        assert!(flatbuffers::root::<fb::Model>(&bytes).unwrap().feature_names().is_none(), "absent, as before");
        let read = Model::from_bytes(&bytes, "old.qm").unwrap();
        assert_eq!(read.feature_names(), ["context[0]", "context[1]", "context[2]"]);
        let named = Model { feature_names: vec!["amount".into(), "hour".into(), "merchant id".into()], ..bare };
        let read = Model::from_bytes(&named.to_bytes(), "named.qm").unwrap();
        assert_eq!(read, named);
        assert_eq!(read.feature_names(), ["amount", "hour", "merchant id"]);
        assert_eq!(read.layout_feature_names(), ["context[0]", "context[1]", "context[2]"]);
        // A count that is not the input width, an empty name, a control
        // character or an overlong name: a typed refusal at load.
        for (names, want) in [
            (vec!["a", "b"], "names 2 features but reads 3 input columns"),
            (vec!["a", "", "c"], "feature name 1 is empty"),
            (vec!["a", "b", "c\n"], "feature name 2 is empty, over 256 bytes or holds a control character"),
        ] {
            let bad = Model { feature_names: names.into_iter().map(String::from).collect(), ..named.clone() };
            let err = Model::from_bytes(&bad.to_bytes(), "bad.qm").unwrap_err();
            assert!(matches!(err, ModelError::Shape { .. }) && err.to_string().contains(want), "{err}");
        }
        let long = Model { feature_names: vec!["a".into(), "b".into(), "x".repeat(257)], ..named };
        assert!(Model::from_bytes(&long.to_bytes(), "long.qm").unwrap_err().to_string().contains("over 256 bytes"));
    }

    #[test]
    fn files_without_calibration_read_as_uncalibrated() {
        // The builder omits an absent table, so these bytes are what a writer
        // from before the `calibration` field produced.
        let bytes = tiny().to_bytes();
        assert!(flatbuffers::root::<fb::Model>(&bytes).unwrap().calibration().is_none());
        assert_eq!(Model::from_bytes(&bytes, "old.qm").unwrap().calibration, None);
    }
}
