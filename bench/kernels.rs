//! Kernel benchmarks: the demo model's forward pass (80 → 256 → 128 → 1) on
//! every CPU backend and INT8 variant this machine runs, at batch 1, 8, 32,
//! 256 and 1024, plus the VNNI peak probe, so each GEMM's rate is read as a
//! measured fraction of the core's peak.
//!
//! Backends: `f32`; `int8-dyn-<kernel>`, the dynamic (per-row) INT8
//! semantics of an uncalibrated model; `int8-static-<kernel>`, the static
//! semantics of the same model calibrated (max-abs on 4,096 seeded normal
//! rows, the distribution the inputs come from); `fp8`, the FP8 E4M3 backend
//! on the calibrated model.
//!
//! Criterion reports rows per second (the throughput is the batch's rows).
//! After the run a table gives, for each benchmark, rows/s and GMAC/s from
//! the median time per call (53,376 multiply-accumulates per row) and the
//! share of the peak probe's measured rate (`int8_peak`), which runs first.
//! Run with `cargo bench --bench kernels`.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use quiver::loadgen::demo::SplitMix64;
use quiver::model::calibrate::{calibrate, Matrix, Method};
use quiver::model::Model;
use quiver::score::cpu::int8_gemm::{vnni_peak_probe, VNNI_PEAK_MACS_PER_ITERATION};
use quiver::score::cpu::{CpuF32, CpuFp8, CpuInt8, Int8Kernel};
use quiver::score::Backend;

const BATCHES: [usize; 5] = [1, 8, 32, 256, 1024];
const PEAK_ITERATIONS: u64 = 10_000;

/// Median ns per call of every benchmark, in run order, and the probe's
/// MAC/s, for the summary.
static MEDIANS: Mutex<Vec<(String, usize, f64)>> = Mutex::new(Vec::new());
static PEAK_MACS_PER_S: Mutex<Option<f64>> = Mutex::new(None);

fn calibrated(model: &Model) -> Model {
    let k = model.input_dim();
    let mut rng = SplitMix64::new(11);
    let set = Matrix { rows: 4096, cols: k, data: (0..4096 * k).map(|_| rng.normal()).collect() };
    let mut m = model.clone();
    m.calibration = Some(calibrate(model, &set, Method::MaxAbs, |_, _| {}).expect("the demo model calibrates"));
    m
}

/// `(name, backend)`: each backend owns the model it was built for.
fn backends(plain: &Arc<Model>, calib: &Arc<Model>, rows_max: usize) -> Vec<(String, Box<dyn Backend>)> {
    let mut v: Vec<(String, Box<dyn Backend>)> = vec![("f32".into(), Box::new(CpuF32::new(plain, rows_max)))];
    for (label, model) in [("dyn", plain), ("static", calib)] {
        for kernel in Int8Kernel::ALL {
            if let Ok(b) = CpuInt8::with_kernel(model, rows_max, kernel) {
                assert_eq!(b.is_static(), label == "static");
                v.push((format!("int8-{label}-{}", kernel.name()), Box::new(b)));
            }
        }
    }
    v.push(("fp8".into(), Box::new(CpuFp8::new(calib, rows_max))));
    v
}

/// Times `f` per call over criterion's batches and remembers every
/// sample's ns per call, so the summary can take their median.
fn timed(b: &mut criterion::Bencher<'_>, samples: &mut Vec<f64>, mut f: impl FnMut()) {
    b.iter_custom(|iters| {
        let t = Instant::now();
        for _ in 0..iters {
            f();
        }
        let e = t.elapsed();
        samples.push(e.as_nanos() as f64 / iters as f64);
        e
    });
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn forward(c: &mut Criterion) {
    let plain = Arc::new(quiver::loadgen::demo::model());
    let calib = Arc::new(calibrated(&plain));
    let rows_max = *BATCHES.iter().max().unwrap_or(&1);
    let mut rng = SplitMix64::new(7);
    let x: Vec<f32> = (0..rows_max * plain.input_dim()).map(|_| rng.normal()).collect();
    let mut out = vec![0.0f32; rows_max];
    let mut backends = backends(&plain, &calib, rows_max);
    let mut group = c.benchmark_group("mlp_forward");
    group.measurement_time(Duration::from_secs(2));
    group.warm_up_time(Duration::from_millis(500));
    group.sample_size(20);
    for rows in BATCHES {
        group.throughput(Throughput::Elements(rows as u64));
        for (name, backend) in backends.iter_mut() {
            let dim = backend.model().input_dim();
            let mut samples = Vec::new();
            group.bench_with_input(BenchmarkId::new(name.as_str(), rows), &rows, |b, &rows| {
                timed(b, &mut samples, || {
                    backend.score(&x[..rows * dim], rows, &mut out[..rows]).unwrap();
                    std::hint::black_box(out[0]);
                })
            });
            if !samples.is_empty() {
                MEDIANS.lock().expect("not poisoned").push((name.clone(), rows, median(samples)));
            }
        }
    }
    group.finish();
    summary(plain.layers.iter().map(|l| l.in_dim * l.out_dim).sum());
}

fn summary(macs_per_row: usize) {
    let peak = *PEAK_MACS_PER_S.lock().expect("not poisoned");
    println!("\nmlp_forward summary (median of criterion's samples, ns per call; {macs_per_row} MACs per row)");
    match peak {
        Some(p) => println!("peak: vpdpbusd probe {:.1} GMAC/s", p / 1e9),
        None => println!("peak: not measured (no AVX-512 VNNI, or filtered out)"),
    }
    println!("| backend | rows | µs per call | rows/s | GMAC/s | % of peak |");
    println!("|---|---:|---:|---:|---:|---:|");
    let mut rows = MEDIANS.lock().expect("not poisoned").clone();
    rows.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
    for (name, n, ns) in rows {
        let gmacs = (n * macs_per_row) as f64 / ns;
        let share = peak.map_or("n/a".to_string(), |p| format!("{:.1}", 100.0 * gmacs * 1e9 / p));
        println!("| {name} | {n} | {:.2} | {:.0} | {gmacs:.1} | {share} |", ns / 1e3, n as f64 * 1e9 / ns);
    }
}

/// The register-resident `vpdpbusd` loop: 16 independent chains, no memory
/// traffic, so its rate is the core's INT8 MAC peak.
fn peak(c: &mut Criterion) {
    if vnni_peak_probe(1).is_none() {
        return;
    }
    let mut group = c.benchmark_group("int8_peak");
    group.measurement_time(Duration::from_secs(2));
    group.warm_up_time(Duration::from_millis(500));
    group.sample_size(20);
    group.throughput(Throughput::Elements(PEAK_ITERATIONS * VNNI_PEAK_MACS_PER_ITERATION));
    let mut samples = Vec::new();
    group.bench_function("vpdpbusd_16_chains", |b| {
        timed(b, &mut samples, || {
            std::hint::black_box(vnni_peak_probe(PEAK_ITERATIONS));
        })
    });
    group.finish();
    let macs = (PEAK_ITERATIONS * VNNI_PEAK_MACS_PER_ITERATION) as f64;
    if samples.is_empty() {
        return;
    }
    *PEAK_MACS_PER_S.lock().expect("not poisoned") = Some(macs / median(samples) * 1e9);
}

criterion_group!(benches, peak, forward);
criterion_main!(benches);
