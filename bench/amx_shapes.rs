//! Where AMX tiles beat the AVX-512 VNNI loop, layer shape by layer shape:
//! one dense INT8 layer (dynamic activations, ReLU) of K inputs and N
//! outputs at 16, 32, 64 and 256 rows, packed for `avx512-vnni` and for
//! `amx` with its tiles forced on (`AmxTiles::Always`), timed alternately in
//! one process on one core. `PackedLayer::new` uses tiles only on the
//! shapes where they pay (`amx_tiles_pay`); this bench is the measurement
//! that rule comes from, and prints the rule's choice beside each shape.
//!
//! Writes bench/results/amx_shapes.{json,md} (rendered into
//! docs/BENCHMARKS.md by bench/report.py). On a CPU without AMX it prints
//! one line saying so and writes nothing.
//!
//! Run with `taskset -c 1 cargo bench --bench amx_shapes` on a quiet machine.

use std::fmt::Write as _;
use std::time::Instant;

use quiver::loadgen::demo::SplitMix64;
use quiver::model::Layer;
use quiver::score::cpu::int8_gemm::{amx_tiles_pay, AmxTiles, PackedLayer, Scratch};
use quiver::score::cpu::Int8Kernel;

const KS: [usize; 11] = [8, 16, 20, 32, 48, 64, 80, 128, 192, 256, 512];
const NS: [usize; 6] = [1, 16, 32, 64, 128, 256];
const ROWS: [usize; 4] = [16, 32, 64, 256];
const ROUNDS: usize = 7;
/// Each timed batch of calls lasts about this long.
const BATCH_NS: f64 = 400_000.0;

struct Side {
    layer: PackedLayer,
    scratch: Scratch,
}

/// ns per call of `side.layer.forward` on `rows` rows, over `calls` calls.
fn time(side: &mut Side, x: &[f32], rows: usize, y: &mut [f32], calls: usize) -> f64 {
    let t = Instant::now();
    for _ in 0..calls {
        side.layer.forward(x, rows, y, &mut side.scratch);
        std::hint::black_box(&y[0]);
    }
    t.elapsed().as_nanos() as f64 / calls as f64
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    if !Int8Kernel::Amx.is_available() {
        println!("amx_shapes: skipped: amx not available on this CPU (or the kernel refused the tile permission)");
        return;
    }
    let rows_max = *ROWS.iter().max().expect("rows");
    let mut rng = SplitMix64::new(34);
    let mut lines = Vec::new();
    let mut json = Vec::new();
    for &k in &KS {
        for &n in &NS {
            let w: Vec<f32> = (0..k * n).map(|_| rng.normal() * 0.1).collect();
            let b: Vec<f32> = (0..n).map(|_| rng.normal() * 0.1).collect();
            let layer = Layer::quantize(k, n, true, w, b);
            let x: Vec<f32> = (0..rows_max * k).map(|_| rng.normal()).collect();
            let mut y = vec![0.0f32; rows_max * n];
            let mut vnni = Side {
                layer: PackedLayer::new(Int8Kernel::Avx512Vnni, &layer),
                scratch: Scratch::new(Int8Kernel::Avx512Vnni, k, rows_max),
            };
            let mut amx = Side {
                layer: PackedLayer::with_tiles(Int8Kernel::Amx, &layer, AmxTiles::Always),
                scratch: Scratch::new(Int8Kernel::Amx, k, rows_max),
            };
            for &rows in &ROWS {
                let x = &x[..rows * k];
                let y = &mut y[..rows * n];
                let guess = time(&mut vnni, x, rows, y, 50).max(time(&mut amx, x, rows, y, 50));
                let calls = ((BATCH_NS / guess) as usize).max(20);
                let (mut tv, mut ta) = (Vec::new(), Vec::new());
                for _ in 0..ROUNDS {
                    tv.push(time(&mut vnni, x, rows, y, calls));
                    ta.push(time(&mut amx, x, rows, y, calls));
                }
                let (v, a) = (median(tv), median(ta));
                let tiles = amx_tiles_pay(k, n);
                let line = format!(
                    "| {k} | {n} | {rows} | {:.0} | {:.0} | {:.2} | {} |",
                    v,
                    a,
                    v / a,
                    if tiles { "tiles" } else { "VNNI loop" }
                );
                println!("{line}");
                lines.push(line);
                json.push(format!(
                    "{{\"k\":{k},\"n\":{n},\"rows\":{rows},\"vnni_ns\":{v:.1},\"amx_tiles_ns\":{a:.1},\"rule\":\"{}\"}}",
                    if tiles { "tiles" } else { "vnni" }
                ));
            }
        }
    }
    let commit = std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map_or("unknown".to_string(), |s| s.trim().to_string());
    let dirty = std::process::Command::new("git")
        .args(["status", "--porcelain", "--untracked-files=no", "--", "src", "bench", "Cargo.toml"])
        .output()
        .map(|o| !o.stdout.is_empty())
        .unwrap_or(true);
    let commit = if dirty { format!("{commit}+dirty") } else { commit };
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("?").trim().to_string())
        })
        .unwrap_or_else(|| "?".to_string());
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let load: Vec<&str> = load.split_whitespace().take(3).collect();
    let mut md = String::new();
    let _ = writeln!(md, "## AMX tiles against the AVX-512 VNNI loop, by layer shape\n");
    let _ = writeln!(
        md,
        "Written by `cargo bench --bench amx_shapes` (`bench/amx_shapes.rs`) at commit `{commit}` on {cpu}: one dense \
         INT8 layer (dynamic activations: per-row quantization, GEMM, float epilogue, ReLU) of K inputs and N outputs, \
         packed for `avx512-vnni` and for `amx` with tiles forced on, timed alternately in one process, {ROUNDS} rounds, \
         medians, ns per call; load average at the end {} (other work shared the machine, so read the ratios). \"Rule\" is what `PackedLayer::new` does for `amx` on that shape (`amx_tiles_pay`): \
         tiles, or the VNNI loop on the same packed weights.\n",
        load.join(" ")
    );
    let _ = writeln!(md, "| K | N | rows | avx512-vnni ns | amx tiles ns | vnni / amx | rule |");
    let _ = writeln!(md, "|---:|---:|---:|---:|---:|---:|---|");
    for l in &lines {
        let _ = writeln!(md, "{l}");
    }
    let body = format!(
        "{{\"commit\":\"{commit}\",\"cpu\":\"{cpu}\",\"loadavg\":\"{}\",\"rounds\":{ROUNDS},\"shapes\":[\n{}\n]}}\n",
        load.join(" "),
        json.join(",\n")
    );
    std::fs::create_dir_all("bench/results").expect("bench/results");
    std::fs::write("bench/results/amx_shapes.json", body).expect("write amx_shapes.json");
    std::fs::write("bench/results/amx_shapes.md", md).expect("write amx_shapes.md");
    println!("wrote bench/results/amx_shapes.{{json,md}}");
}
