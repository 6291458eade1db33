//! Tree-ensemble evaluator benchmarks: each build of `score::cpu::forest`
//! this machine runs (scalar, AVX2, AVX-512) and the one construction picks
//! by timing (`auto`), on two fixture models of `tests/fixtures/trees/`
//! (`lgb_numeric`: LightGBM, 100 trees of depth 6, numeric splits;
//! `lgb_binary`: the same shape with categorical splits), at batch 1, 8, 32
//! and 256, on the fixtures' held-out rows (NaN included).
//!
//! This is the measurement behind the evaluator's design choices: the
//! builds differ only in how they step (gathers over rows, trees in lanes
//! for a single row), and every one computes the same bits. Criterion
//! reports rows per second. Run with `cargo bench --bench trees`.

use std::path::Path;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use quiver::model::calibrate::read_npy;
use quiver::model::gbdt::{import_lightgbm_file, GbdtOptions};
use quiver::model::Op;
use quiver::score::cpu::forest::{CompiledTrees, TreeKernel};

const BATCHES: [usize; 4] = [1, 8, 32, 256];

fn fixture(name: &str) -> (quiver::model::trees::Ensemble, Vec<f32>, usize) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/trees");
    let opts = GbdtOptions { name: name.into(), version: 1, inputs: "context:12".parse().unwrap(), output_kind: None };
    let model = import_lightgbm_file(&dir.join(format!("{name}.txt")), &opts).unwrap().model;
    let graph = model.graph.unwrap();
    let Op::Trees(e) = &graph.nodes[1].op else { panic!("node 1 is the ensemble") };
    let t = read_npy(&dir.join(format!("{name}.npy"))).unwrap();
    let x: Vec<f32> = t.data.chunks_exact(t.cols).flat_map(|r| r[..12].iter().copied()).collect();
    (e.clone(), x, 12)
}

fn trees(c: &mut Criterion) {
    for name in ["lgb_numeric", "lgb_binary"] {
        let (e, x, dim) = fixture(name);
        let mut builds: Vec<(String, CompiledTrees)> = TreeKernel::ALL
            .into_iter()
            .filter_map(|k| CompiledTrees::with_kernel(&e, k).map(|t| (k.name().to_string(), t)))
            .collect();
        let auto = CompiledTrees::new(&e);
        builds.push((format!("auto({})", auto.kernel().name()), auto));
        let mut g = c.benchmark_group(format!("trees/{name}"));
        for rows in BATCHES {
            g.throughput(Throughput::Elements(rows as u64));
            let mut out = vec![0.0f32; rows];
            for (label, t) in &builds {
                // Rotate through the held-out rows so every call sees new paths.
                let windows = x.len() / dim / rows;
                let mut k = 0;
                g.bench_function(BenchmarkId::new(label.as_str(), rows), |b| {
                    b.iter(|| {
                        let at = (k % windows) * rows * dim;
                        k += 1;
                        t.eval(&x[at..at + rows * dim], dim, rows, &mut out);
                        std::hint::black_box(&out);
                    })
                });
            }
        }
        g.finish();
    }
}

criterion_group!(benches, trees);
criterion_main!(benches);
