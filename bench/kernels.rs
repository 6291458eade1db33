//! Kernel benchmarks: the demo model's forward pass on every CPU backend and
//! INT8 variant this machine runs, at several batch sizes, plus the VNNI peak
//! probe, so each GEMM's rate can be read as a fraction of the core's peak.
//!
//! Throughput is reported in elements per second: rows for the forward pass,
//! multiply-accumulates for the peak probe. Run with `cargo bench --bench
//! kernels`; `docs/KERNELS.md` records a run and how to turn rows/s into
//! GMAC/s.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use quiver::demo::SplitMix64;
use quiver::model::Model;
use quiver::score::cpu::int8_gemm::{vnni_peak_probe, VNNI_PEAK_MACS_PER_ITERATION};
use quiver::score::cpu::{CpuF32, CpuInt8, Int8Kernel};
use quiver::score::Backend;

const BATCHES: [usize; 5] = [1, 8, 32, 256, 1024];

fn backends(model: &Model, rows_max: usize) -> Vec<(String, Box<dyn Backend>)> {
    let mut v: Vec<(String, Box<dyn Backend>)> = vec![("f32".into(), Box::new(CpuF32::new(model, rows_max)))];
    for kernel in Int8Kernel::ALL {
        if let Ok(b) = CpuInt8::with_kernel(model, rows_max, kernel) {
            v.push((format!("int8-{}", kernel.name()), Box::new(b)));
        }
    }
    v
}

fn forward(c: &mut Criterion) {
    let model = quiver::demo::model();
    let rows_max = *BATCHES.iter().max().unwrap_or(&1);
    let mut rng = SplitMix64::new(7);
    let x: Vec<f32> = (0..rows_max * model.input_dim()).map(|_| rng.normal()).collect();
    let mut out = vec![0.0f32; rows_max];
    let mut backends = backends(&model, rows_max);
    let mut group = c.benchmark_group("mlp_forward");
    group.measurement_time(Duration::from_secs(2));
    group.warm_up_time(Duration::from_millis(500));
    group.sample_size(20);
    for rows in BATCHES {
        group.throughput(Throughput::Elements(rows as u64));
        for (name, backend) in backends.iter_mut() {
            group.bench_with_input(BenchmarkId::new(name.as_str(), rows), &rows, |b, &rows| {
                b.iter(|| {
                    backend.logits(&model, &x[..rows * model.input_dim()], rows, &mut out[..rows]);
                    std::hint::black_box(out[0])
                })
            });
        }
    }
    group.finish();
}

fn peak(c: &mut Criterion) {
    const ITERATIONS: u64 = 10_000;
    if vnni_peak_probe(1).is_none() {
        return;
    }
    let mut group = c.benchmark_group("int8_peak");
    group.measurement_time(Duration::from_secs(2));
    group.warm_up_time(Duration::from_millis(500));
    group.sample_size(20);
    group.throughput(Throughput::Elements(ITERATIONS * VNNI_PEAK_MACS_PER_ITERATION));
    group.bench_function("vpdpbusd_16_chains", |b| b.iter(|| vnni_peak_probe(ITERATIONS)));
    group.finish();
}

criterion_group!(benches, forward, peak);
criterion_main!(benches);
