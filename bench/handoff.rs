//! The hand-off round trip: a "shard" (this thread) submits a one-row job to
//! the inference thread and spins until the completion comes back.
//!
//! Two settings: the stage spinning while idle (`spin_us` = 200, the job
//! finds it awake) and parking at once (`spin_us` = 0, every job pays the
//! wake-up of a parked thread, about 30 µs on these VMs). The model is one
//! tiny layer so the kernel is negligible next to the hop. Besides
//! criterion's estimate, p50/p99/p99.9 of 20,000 individual round trips go to
//! `target/criterion/handoff-percentiles.json` for `bench/report.py`.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use quiver::infer::{self, StageConfig};
use quiver::model::{InputSegment, Layer, Model, Source};
use quiver::registry::{Fit, Registry};
use quiver::score::BackendKind;

fn tiny() -> Model {
    Model {
        name: "tiny".into(),
        version: 1,
        inputs: vec![InputSegment { source: Source::Context, dim: 4 }],
        layers: vec![Layer::quantize(4, 1, false, vec![0.5, -0.25, 0.125, 1.0], vec![0.0])],
        calibration: None,
        graph: None,
        onnx: None,
        feature_names: Vec::new(),
    }
}

fn start(spin_us: u64) -> (infer::Stage, infer::ShardEnd, Arc<Model>) {
    let fit = Fit::user_item(1, 1, 4);
    let registry = Arc::new(Registry::from_models(vec![tiny()], fit, BackendKind::Int8, 1).unwrap());
    let model = registry.snapshot().models[0].clone();
    let config = StageConfig {
        batch_rows_max: 1,
        batch_wait_us_max: 0,
        spin_us,
        jobs_per_shard_max: 4,
        rows_per_job_max: 1,
        row_dim_max: 4,
        core: None,
        shares_core: false,
    };
    let (stage, mut ends) = infer::start(config, 1, registry, BackendKind::Int8, Arc::default()).unwrap();
    (stage, ends.remove(0), model)
}

fn round_trip(end: &mut infer::ShardEnd, model: &Arc<Model>, origin: Instant) -> Duration {
    let token = end.acquire().expect("one job in flight at a time");
    let data = end.slot_mut(&token);
    data.rows = 1;
    data.x[..4].copy_from_slice(&[1.0, 2.0, 3.0, 4.0]);
    end.set_model(&token, model);
    let started = Instant::now();
    let now_ns = started.duration_since(origin).as_nanos() as u64;
    end.submit(token, u64::MAX / 2, now_ns).unwrap();
    let (_, token) = loop {
        if let Some(d) = end.poll() {
            break d;
        }
        std::hint::spin_loop();
    };
    let elapsed = started.elapsed();
    black_box(end.slot_mut(&token).logits[0]);
    end.release(token);
    elapsed
}

fn handoff(c: &mut Criterion) {
    let mut g = c.benchmark_group("hand-off round trip");
    let origin = Instant::now();
    let mut percentiles = serde_json::Map::new();
    for (name, spin_us) in [("stage spinning", 200u64), ("stage parked", 0)] {
        let (stage, mut end, model) = start(spin_us);
        // Warm the stage's backend cache before measuring.
        for _ in 0..100 {
            round_trip(&mut end, &model, origin);
        }
        g.bench_function(name, |b| {
            b.iter_custom(|iters| (0..iters).map(|_| round_trip(&mut end, &model, origin)).sum())
        });
        let mut h = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 1_000_000_000, 3).unwrap();
        for _ in 0..20_000 {
            if spin_us == 0 {
                // Let the stage park between jobs, as an idle one would.
                std::thread::sleep(Duration::from_micros(50));
            }
            h.saturating_record(round_trip(&mut end, &model, origin).as_nanos() as u64);
        }
        percentiles.insert(
            name.into(),
            serde_json::json!({
                "p50_ns": h.value_at_quantile(0.5),
                "p99_ns": h.value_at_quantile(0.99),
                "p999_ns": h.value_at_quantile(0.999),
                "max_ns": h.max(),
                "samples": h.len(),
            }),
        );
        stage.stop();
    }
    g.finish();
    let dir = std::path::Path::new("target/criterion");
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("handoff-percentiles.json"), serde_json::to_string_pretty(&percentiles).unwrap()).unwrap();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    targets = handoff
}
criterion_main!(benches);
