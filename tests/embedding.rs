//! Graph models with large embedding tables (issue 19, "Models at scale"):
//! saved, loaded back mapped from the file rather than copied into the heap,
//! scored exactly as the model built in memory, shared (not copied) by every
//! backend built from them, and refused with a typed error, not a panic,
//! when the file is truncated or damaged.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use quiver::model::{
    Act, EmbeddingTable, Graph, InputSegment, Layer, Model, ModelError, Node, Op, OutputKind, Source, TableError,
};
use quiver::registry::{publish, Fit, Registry};
use quiver::score::{self, BackendKind};

/// 2M rows of 16 floats: a 128 MB table, over the inline limit, so it is
/// stored after the FlatBuffer.
const ROWS: usize = 2_000_000;
const DIM: usize = 16;
const USER_DIM: usize = 4;

/// The tests here measure the process's anonymous memory around a load, so
/// they run one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// A directory for one test's files, removed when the test ends, failed or
/// not: its files are hundreds of MB, in memory where /dev/shm is.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let base = if Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
        let d = base.join(format!("quiver-embedding-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Scratch(d)
    }

    fn join(&self, file: &str) -> PathBuf {
        self.0.join(file)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A user vector and one context id; the id reads a row of the table, which
/// is concatenated with the user vector into one dense logit.
fn big_model() -> Model {
    let table: Vec<f32> = (0..ROWS * DIM).map(|i| ((i * 2_654_435_761) % 1997) as f32 / 1997.0 - 0.5).collect();
    let mut rng = quiver::seeded::SplitMix64::new(7);
    let w = (0..DIM + USER_DIM).map(|_| rng.normal() * 0.3).collect();
    let nodes = vec![
        Node { op: Op::Input { offset: USER_DIM }, inputs: vec![], width: 1 },
        Node {
            op: Op::Embedding { dim: DIM, rows: ROWS, table: table.into(), default: vec![0.25; DIM] },
            inputs: vec![0],
            width: DIM,
        },
        Node { op: Op::Input { offset: 0 }, inputs: vec![], width: USER_DIM },
        Node { op: Op::Concat, inputs: vec![1, 2], width: DIM + USER_DIM },
        Node {
            op: Op::Dense { layer: Layer::quantize(DIM + USER_DIM, 1, false, w, vec![0.1]), act: Act::None },
            inputs: vec![3],
            width: 1,
        },
    ];
    Model {
        name: "big".into(),
        version: 1,
        inputs: vec![
            InputSegment { source: Source::User, dim: USER_DIM },
            InputSegment { source: Source::ContextIds, dim: 1 },
        ],
        layers: vec![],
        calibration: None,
        graph: Some(Graph { nodes, output: OutputKind::Logit }),
        onnx: None,
        feature_names: Vec::new(),
    }
}

/// Ids in range (the first and last rows among them) and ids that read the
/// default row: past the end, negative, fractional.
const IDS: [f32; 9] = [0.0, 1.0, 17.0, 1_234_567.0, 1_999_999.0, 2_000_000.0, 5e6, -1.0, 0.5];

fn rows() -> Vec<f32> {
    IDS.iter().enumerate().flat_map(|(r, &id)| [0.1 * r as f32, -0.2, 0.3, 0.05 * r as f32, id]).collect()
}

fn table_of(m: &Model) -> &EmbeddingTable {
    match &m.graph.as_ref().expect("a graph model").nodes[1].op {
        Op::Embedding { table, .. } => table,
        op => panic!("node 1 is {}", op.name()),
    }
}

fn logits(kind: BackendKind, m: &Model) -> Vec<u32> {
    let x = rows();
    let mut out = vec![0.0; IDS.len()];
    score::build(kind, &Arc::new(m.clone()), IDS.len()).score(&x, IDS.len(), &mut out).unwrap();
    out.iter().map(|v| v.to_bits()).collect()
}

/// The process's anonymous resident memory (heap, not file pages), where
/// the kernel reports it.
fn rss_anon_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("RssAnon:"))?;
    line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kb| kb * 1024)
}

#[test]
fn a_big_table_loads_mapped_scores_like_the_model_in_memory_and_is_shared() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let m = big_model();
    let dir = Scratch::new("load");
    let path = dir.join("model.qm");
    m.save(&path).unwrap();
    let file_bytes = std::fs::metadata(&path).unwrap().len();
    assert!(file_bytes > (ROWS * DIM * 4) as u64);

    let anon_before = rss_anon_bytes();
    let loaded = Model::load(&path).unwrap();
    let anon_grew = rss_anon_bytes().zip(anon_before).map(|(after, before)| after.saturating_sub(before));

    // The table is a view of the mapped file, not a heap copy.
    let table = table_of(&loaded);
    assert!(table.is_mapped());
    let file = table.file().unwrap();
    assert_eq!(file.bytes().len() as u64, file_bytes);
    assert!(file.bytes().as_ptr_range().contains(&table.as_ptr().cast()));
    assert_eq!(table.len(), ROWS * DIM);
    if let Some(grew) = anon_grew {
        assert!(grew < (ROWS * DIM * 4 / 4) as u64, "loading grew the heap by {grew} bytes");
    }
    assert_eq!(loaded, m);

    // Every backend scores the loaded model bit for bit as the one built in
    // memory; the default row answers the ids out of range.
    for kind in [BackendKind::F32, BackendKind::Int8, BackendKind::Fp8] {
        assert_eq!(logits(kind, &loaded), logits(kind, &m), "{kind:?}");
    }
    let x = rows();
    let (mut want, mut got) = (vec![0.0; IDS.len()], vec![0.0; IDS.len()]);
    m.forward_f32_reference(&x, IDS.len(), &mut want);
    loaded.forward_f32_reference(&x, IDS.len(), &mut got);
    assert_eq!(want, got);
    assert_ne!(got[0], got[1]);
    // Moving the default row moves exactly the rows whose id reads it.
    let mut one_default = m.clone();
    if let Some(Op::Embedding { default: d, .. }) = one_default.graph.as_mut().map(|g| &mut g.nodes[1].op) {
        d[0] += 1.0;
    }
    let mut moved = vec![0.0; IDS.len()];
    one_default.forward_f32_reference(&x, IDS.len(), &mut moved);
    let reads_default: Vec<bool> = moved.iter().zip(&got).map(|(a, b)| a != b).collect();
    assert_eq!(reads_default, [false, false, false, false, false, true, true, true, true]);

    // Two shards' backends, and any clone of the model, share the mapping.
    let shared = Arc::new(loaded.clone());
    let (a, b) = (score::cpu::CpuF32::new(&shared, 64), score::cpu::CpuF32::new(&shared, 64));
    for backend in [&a, &b] {
        let Op::Embedding { table: t, .. } = &backend.nodes()[1].op else { panic!("node 1 is an embedding") };
        assert_eq!(t.as_ptr(), table.as_ptr());
    }
    assert_eq!(table_of(&loaded.clone()).as_ptr(), table.as_ptr());
}

#[test]
fn the_registry_serves_a_big_table_mapped_and_its_shards_backends_copy_nothing() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let m = big_model();
    let dir = Scratch::new("registry");
    publish(&dir.0, &m).unwrap();
    let fit = Fit::user_item(USER_DIM, 0, 8);
    let registry = Registry::open(&dir.0, None, fit, BackendKind::F32, 64).unwrap().with_shards(2);
    let anon_before = rss_anon_bytes();
    // Loads the version again and builds each shard's backend for it.
    registry.load("big", Some(1)).unwrap();
    let served = registry.snapshot().models[0].clone();
    let prebuilt: Vec<_> = (0..2).map(|shard| registry.take_inbox(shard).unwrap().take(&served).unwrap()).collect();
    if let Some((after, before)) = rss_anon_bytes().zip(anon_before) {
        let grew = after.saturating_sub(before);
        assert!(grew < (ROWS * DIM * 4 / 4) as u64, "a load and two shards' backends grew the heap by {grew} bytes");
    }
    assert!(table_of(&served).is_mapped());
    let x = rows();
    let want = logits(BackendKind::F32, &m);
    for mut p in prebuilt {
        let mut out = vec![0.0; IDS.len()];
        p.backend.score(&x, IDS.len(), &mut out).unwrap();
        assert_eq!(out.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want);
    }
}

#[test]
fn a_damaged_file_with_a_big_table_is_refused_with_a_typed_error() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = Scratch::new("damaged");
    let whole = big_model().to_bytes();
    // Without its checksum trailer (8 bytes), as a file from before it: the
    // structural checks below are then the only ones.
    let bytes = whole[..whole.len() - 8].to_vec();
    let load_from = |base: &Vec<u8>, name: &str, edit: &dyn Fn(&mut Vec<u8>)| -> ModelError {
        let mut b = base.clone();
        edit(&mut b);
        let p = dir.join(name);
        std::fs::write(&p, &b).unwrap();
        let e = Model::load(&p).unwrap_err();
        std::fs::remove_file(&p).unwrap();
        e
    };
    let load = |name: &str, edit: &dyn Fn(&mut Vec<u8>)| load_from(&bytes, name, edit);
    // With it, a flipped bit anywhere in the table is caught.
    let e = load_from(&whole, "flipped.qm", &|b| {
        let at = b.len() / 2;
        b[at] ^= 1;
    });
    assert!(matches!(e, ModelError::Checksum { .. }), "{e}");
    let table_bytes = (ROWS * DIM * 4) as u64;
    let head_bytes = bytes.len() - ROWS * DIM * 4;

    for cut in [4, bytes.len() / 2, bytes.len() - head_bytes] {
        let e = load("cut.qm", &|b| b.truncate(b.len() - cut));
        let ModelError::Table { node: 1, source: TableError::OutOfFile { floats, file_bytes, .. }, .. } = e else {
            panic!("{cut} bytes cut: {e}");
        };
        assert_eq!((floats * 4, file_bytes), (table_bytes, (bytes.len() - cut) as u64));
    }
    let e = load("head.qm", &|b| b.truncate(head_bytes / 2));
    assert!(matches!(e, ModelError::Invalid { .. }), "{e}");
    let e = load("empty.qm", &|b| b.clear());
    assert!(matches!(e, ModelError::Identifier { .. }), "{e}");
    let e = load("nan.qm", &|b| {
        let n = b.len();
        b[n - 4..].copy_from_slice(&f32::NAN.to_le_bytes());
    });
    assert!(matches!(&e, ModelError::Shape { what, .. } if what.contains("finite")), "{e}");
    // The root offset pointing past the end.
    let e = load("root.qm", &|b| b[..4].copy_from_slice(&u32::MAX.to_le_bytes()));
    assert!(matches!(e, ModelError::Invalid { .. }), "{e}");
}

#[test]
fn a_file_over_the_mapped_limit_is_refused_before_it_is_read() {
    // Sparse: the length is all there is to it.
    let dir = std::env::temp_dir().join(format!("quiver-embedding-huge-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let dir = Scratch(dir);
    let path = dir.join("huge.qm");
    let f = std::fs::File::create(&path).unwrap();
    f.set_len(quiver::model::MODEL_MAPPED_BYTES_MAX + 1).unwrap();
    drop(f);
    let e = Model::load(&path).unwrap_err();
    assert!(matches!(e, ModelError::TooLarge { bytes, .. } if bytes == quiver::model::MODEL_MAPPED_BYTES_MAX + 1));
    assert!(e.to_string().contains("MODEL_MAPPED_BYTES_MAX"), "{e}");
}

#[test]
fn a_save_over_a_served_file_replaces_it_and_the_served_model_keeps_its_table() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = Scratch::new("replace");
    let path = dir.join("model.qm");
    let m = big_model();
    m.save(&path).unwrap();
    let served = Arc::new(Model::load(&path).unwrap());
    let first_row: Vec<f32> = table_of(&served)[..DIM].to_vec();
    let mut next = m.clone();
    next.version = 2;
    if let Some(Op::Embedding { table, .. }) = next.graph.as_mut().map(|g| &mut g.nodes[1].op) {
        let mut v = table.to_vec();
        v[..DIM].fill(9.0);
        *table = v.into();
    }
    next.save(&path).unwrap();
    // The served model still reads the file it mapped: rename, not rewrite.
    assert_eq!(&table_of(&served)[..DIM], &first_row[..]);
    assert_eq!(table_of(&served)[ROWS * DIM - 1], table_of(&m)[ROWS * DIM - 1]);
    let reloaded = Model::load(&path).unwrap();
    assert_eq!((reloaded.version, table_of(&reloaded)[0]), (2, 9.0));
}
