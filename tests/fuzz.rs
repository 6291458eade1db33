//! Seeded mutation fuzzing of every parser that reads untrusted bytes:
//! request frames, model files, replica files, ONNX import (bytes, and graph
//! structure: `onnx_graphs`), tree models
//! (LightGBM text, XGBoost JSON), `.npy` calibration files, RESP replies,
//! Feast's registry, values and Redis keys, TOML config, admin routes, raw HTTP bytes at a live admin listener,
//! decision-log segments (`quiver log`'s reader), and ClientHellos at a live TLS scoring port.
//!
//! Stable Rust has no coverage-guided fuzzer here, so each target starts
//! from valid seeds and stacks random mutations (bit flips, interesting
//! bytes, length-field edits, truncation, deletion, duplication, splices
//! from another seed). Every input must come back without a panic, within
//! `HANG_BOUND` (a watchdog aborts the run naming the input), and without
//! allocating more than the target's memory bound (a counting allocator).
//!
//! Input `i` of a run is a pure function of (target, `QUIVER_FUZZ_SEED`,
//! `i`), so any failure replays: `QUIVER_FUZZ_REPLAY=<target>:<seed>:<i>`.
//! `QUIVER_FUZZ_INPUTS` sets inputs per target (default 20,000; CI runs
//! 1,000,000). A failing input is written under `target/fuzz-crashes/`;
//! kept under `tests/fixtures/fuzz/<target>/`, it is replayed by every run.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use quiver::seeded::SplitMix64;

/// Longest one input may take: a hang, not a slow machine (a VM pauses for
/// tens of ms, a CPU hog beside the tests stretches everything), so generous.
const HANG_BOUND: Duration = Duration::from_secs(10);
/// Mutated inputs are cut to this many bytes beyond their seed.
const GROWTH_BYTES_MAX: usize = 4096;

// ---- the counting allocator: each thread's live and peak bytes ----

struct Counting;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn note(delta: isize) {
    let _ = LIVE.try_with(|live| {
        let now = live.get() + delta;
        live.set(now);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

// SAFETY: every call is forwarded to the system allocator unchanged; the
// bookkeeping touches only const-initialised thread-locals, which never
// allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            note(layout.size() as isize);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            note(layout.size() as isize);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        note(-(layout.size() as isize));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            note(new_size as isize - layout.size() as isize);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

// ---- mutations ----

const INTERESTING_U8: [u8; 6] = [0, 1, 0x7f, 0x80, 0xfe, 0xff];

fn interesting_u32(rng: &mut SplitMix64, len: usize) -> u32 {
    let choices = [0, 1, 2, 0x7f, 0x80, 0xff, 0x100, 0xffff, 0x1_0000, 0x7fff_ffff, 0x8000_0000, 0xffff_ffff];
    match rng.below(4) {
        0 => len as u32,
        1 => (len as u32).wrapping_add(1),
        2 => rng.below(4096) as u32,
        _ => choices[rng.below(choices.len() as u64) as usize],
    }
}

/// `seed` with one to eight stacked mutations; `other` feeds splices.
fn mutate(rng: &mut SplitMix64, seed: &[u8], other: &[u8]) -> Vec<u8> {
    let mut b = seed.to_vec();
    let at = |rng: &mut SplitMix64, len: usize| if len == 0 { 0 } else { rng.below(len as u64) as usize };
    for _ in 0..1 + rng.below(8) {
        match rng.below(10) {
            0 if !b.is_empty() => {
                let i = at(rng, b.len());
                b[i] ^= 1 << rng.below(8);
            }
            1 if !b.is_empty() => {
                let i = at(rng, b.len());
                b[i] = INTERESTING_U8[rng.below(INTERESTING_U8.len() as u64) as usize];
            }
            2 if !b.is_empty() => {
                let i = at(rng, b.len());
                b[i] = rng.next_u64() as u8;
            }
            3 | 4 if b.len() >= 4 => {
                // Length and offset fields are little-endian words.
                let i = at(rng, b.len() - 3);
                let v = interesting_u32(rng, b.len());
                if rng.below(2) == 0 {
                    b[i..i + 4].copy_from_slice(&v.to_le_bytes());
                } else {
                    b[i..i + 2].copy_from_slice(&(v as u16).to_le_bytes());
                }
            }
            5 => {
                let keep = at(rng, b.len() + 1);
                b.truncate(keep);
            }
            6 if !b.is_empty() => {
                let i = at(rng, b.len());
                let n = 1 + at(rng, (b.len() - i).min(256));
                b.drain(i..i + n);
            }
            7 if !b.is_empty() => {
                let i = at(rng, b.len());
                let n = 1 + at(rng, (b.len() - i).min(256));
                let chunk = b[i..i + n].to_vec();
                let to = at(rng, b.len() + 1);
                b.splice(to..to, chunk);
            }
            8 if !other.is_empty() => {
                let i = at(rng, other.len());
                let n = 1 + at(rng, (other.len() - i).min(512));
                let to = at(rng, b.len() + 1);
                let end = (to + n).min(b.len());
                b.splice(to..end, other[i..i + n].iter().copied());
            }
            _ => {
                let to = at(rng, b.len() + 1);
                let n = 1 + rng.below(16) as usize;
                let bytes: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
                b.splice(to..to, bytes);
            }
        }
    }
    b.truncate(seed.len() + GROWTH_BYTES_MAX);
    b
}

// ---- the driver ----

/// What a target runs on one input: the bytes and the seed they came from.
type Run<'a> = &'a (dyn Fn(&[u8], usize, &mut Scratch) + Sync);

/// Per-worker state a target may reuse between inputs (a file path).
struct Scratch {
    dir: PathBuf,
    worker: usize,
}

impl Scratch {
    fn file(&self, name: &str) -> PathBuf {
        self.dir.join(format!("w{}-{name}", self.worker))
    }
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.replace('_', "").parse().ok()).unwrap_or(default)
}

fn target_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

/// Input `i` of target `name` under `seed`, and the seed index it grew from.
fn input(name: &str, seeds: &[Vec<u8>], seed: u64, i: u64) -> (Vec<u8>, usize) {
    let mut rng = SplitMix64::new(seed ^ target_hash(name) ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let s = rng.below(seeds.len() as u64) as usize;
    if i < seeds.len() as u64 {
        return (seeds[i as usize].clone(), i as usize);
    }
    let other = &seeds[rng.below(seeds.len() as u64) as usize];
    (mutate(&mut rng, &seeds[s], other), s)
}

fn crash_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("target").join("fuzz-crashes")
}

fn scratch_dir(name: &str) -> PathBuf {
    let base = if Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
    let d = base.join(format!("quiver-fuzz-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Runs `target` on its regression inputs, then on its seeds and
/// `QUIVER_FUZZ_INPUTS` mutations of them, on every core.
fn fuzz(name: &str, seeds: Vec<Vec<u8>>, mem_bytes_max: usize, run: Run<'_>) {
    fuzz_scaled(name, seeds, mem_bytes_max, 1, run);
}

/// `fuzz`, with `1/scale` of the inputs, for targets whose inputs are large.
fn fuzz_scaled(name: &str, seeds: Vec<Vec<u8>>, mem_bytes_max: usize, scale: u64, run: Run<'_>) {
    assert!(!seeds.is_empty(), "{name}: no seeds");
    let seed = env_u64("QUIVER_FUZZ_SEED", 1);
    let inputs = (env_u64("QUIVER_FUZZ_INPUTS", 20_000) / scale.max(1)).max(seeds.len() as u64);
    let dir = scratch_dir(name);
    let mut scratch = Scratch { dir: dir.clone(), worker: 0 };

    if let Ok(spec) = std::env::var("QUIVER_FUZZ_REPLAY") {
        let mut parts = spec.split(':');
        if parts.next() == Some(name) {
            let s: u64 = parts.next().and_then(|v| v.parse().ok()).expect("REPLAY=<target>:<seed>:<index>");
            let i: u64 = parts.next().and_then(|v| v.parse().ok()).expect("REPLAY=<target>:<seed>:<index>");
            let (bytes, from) = input(name, &seeds, s, i);
            let out = crash_dir().join(format!("{name}-{s}-{i}.bin"));
            std::fs::create_dir_all(crash_dir()).unwrap();
            std::fs::write(&out, &bytes).unwrap();
            eprintln!("{name}: replaying input {i} of seed {s} ({} bytes, written to {})", bytes.len(), out.display());
            run(&bytes, from, &mut scratch);
        }
        let _ = std::fs::remove_dir_all(&dir);
        return;
    }

    // Every input found failing once is kept and run first.
    let kept = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/fuzz").join(name);
    if let Ok(entries) = std::fs::read_dir(&kept) {
        let mut files: Vec<PathBuf> = entries.map(|e| e.unwrap().path()).collect();
        files.sort();
        for f in files {
            run(&std::fs::read(&f).unwrap(), 0, &mut scratch);
        }
    }

    let workers = std::thread::available_parallelism().map_or(2, |n| n.get()).clamp(1, 8);
    let started_ns: Vec<AtomicU64> = (0..workers).map(|_| AtomicU64::new(0)).collect();
    let current: Vec<AtomicU64> = (0..workers).map(|_| AtomicU64::new(0)).collect();
    let done = AtomicBool::new(false);
    let clock = Instant::now();
    let failures = std::sync::Mutex::new(Vec::<String>::new());
    std::thread::scope(|scope| {
        scope.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(100));
                let now = clock.elapsed().as_nanos() as u64;
                for w in 0..workers {
                    let t = started_ns[w].load(Ordering::Relaxed);
                    if t != 0 && now.saturating_sub(t) > 4 * HANG_BOUND.as_nanos() as u64 {
                        let i = current[w].load(Ordering::Relaxed);
                        eprintln!(
                            "{name}: input {i} of seed {seed} has run for over {:?}: a hang; replay with \
                             QUIVER_FUZZ_REPLAY={name}:{seed}:{i}",
                            4 * HANG_BOUND
                        );
                        std::process::abort();
                    }
                }
            }
        });
        let handles: Vec<_> = (0..workers)
            .map(|w| {
                let (started_ns, current, failures, dir) = (&started_ns, &current, &failures, dir.clone());
                let seeds = &seeds;
                scope.spawn(move || {
                    let mut scratch = Scratch { dir, worker: w };
                    let mut i = w as u64;
                    while i < inputs && failures.lock().unwrap().len() < 10 {
                        let (bytes, from) = input(name, seeds, seed, i);
                        current[w].store(i, Ordering::Relaxed);
                        let live = LIVE.with(Cell::get);
                        PEAK.with(|p| p.set(live));
                        let t0 = Instant::now();
                        started_ns[w].store(clock.elapsed().as_nanos() as u64 | 1, Ordering::Relaxed);
                        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| run(&bytes, from, &mut scratch)));
                        started_ns[w].store(0, Ordering::Relaxed);
                        let took = t0.elapsed();
                        let grew = (PEAK.with(Cell::get) - live).max(0) as usize;
                        let why = match outcome {
                            Err(_) => Some("panicked".to_string()),
                            Ok(()) if took > HANG_BOUND => Some(format!("took {took:?}")),
                            Ok(()) if grew > mem_bytes_max => Some(format!("allocated {grew} bytes")),
                            Ok(()) => None,
                        };
                        if let Some(why) = why {
                            std::fs::create_dir_all(crash_dir()).unwrap();
                            let out = crash_dir().join(format!("{name}-{seed}-{i}.bin"));
                            std::fs::write(&out, &bytes).unwrap();
                            failures.lock().unwrap().push(format!("input {i}: {why}; saved as {}", out.display()));
                        }
                        i += workers as u64;
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        done.store(true, Ordering::Relaxed);
    });
    let _ = std::fs::remove_dir_all(&dir);
    let failures = failures.into_inner().unwrap();
    assert!(failures.is_empty(), "{name}: {} failing inputs (seed {seed}):\n{}", failures.len(), failures.join("\n"));
    eprintln!("{name}: {inputs} inputs, seed {seed}, {workers} workers, {:.1} s", clock.elapsed().as_secs_f64());
}

const MIB: usize = 1 << 20;

// ---- targets ----

#[test]
fn request_frames() {
    use quiver::wire::{
        decode_request, salvage_request_id, split_frame, GroupKeySpec, RequestEncoder, RequestLimits, RequestSpec,
    };
    let limits = RequestLimits { frame_bytes_max: 64 * 1024, candidates_max: 256, context_len_max: 256 };
    let mut encoder = RequestEncoder::new();
    let mut seeds = Vec::new();
    for n in [0usize, 1, 3, 32] {
        let spec = RequestSpec {
            request_id: 7 + n as u64,
            model: if n == 3 { "auction-32".into() } else { String::new() },
            budget_us: 4000,
            priority: n as u8,
            client_id: 3,
            user_id: 42,
            item_ids: (0..n as u64).collect(),
            context: (0..n.min(8)).map(|k| k as f32 * 0.5).collect(),
            context_ids: (0..n.min(2) as u64).collect(),
            // Seeds with feature groups, so mutations reach their vectors
            // and strings too.
            groups: match n {
                3 => vec![
                    ("device".into(), GroupKeySpec::Strs(vec!["f7a9c2".into()])),
                    ("ad".into(), GroupKeySpec::Ids(vec![1, 2, 3])),
                ],
                32 => vec![("ip".into(), GroupKeySpec::Strs(vec!["203.0.113.7".into()]))],
                _ => Vec::new(),
            },
            // And with reason codes asked for, so mutations reach their
            // limits' checks.
            explain_top_k: if n >= 3 { 5 } else { 0 },
            explain_candidates_max: if n == 32 { 4 } else { 0 },
            ..RequestSpec::default()
        };
        let mut frame = Vec::new();
        encoder.encode(&spec, &mut frame);
        seeds.push(frame.clone());
        // Pipelined: two frames in one read.
        let mut two = frame.clone();
        two.extend_from_slice(&frame);
        seeds.push(two);
    }
    // A raw-rows request, so mutations reach its count checks.
    let raw = RequestSpec {
        request_id: 99,
        rows: (0..12).map(|k| k as f32 - 3.5).collect(),
        row_count: 3,
        explain_top_k: 2,
        ..RequestSpec::default()
    };
    let mut frame = Vec::new();
    encoder.encode(&raw, &mut frame);
    seeds.push(frame);
    fuzz("request_frames", seeds, 4 * MIB, &|bytes, _, _| {
        let mut rest = bytes;
        while let Ok(Some((payload, used))) = split_frame(rest, limits.frame_bytes_max) {
            assert!(used > 0 && used <= rest.len(), "split_frame consumed {used} of {}", rest.len());
            match decode_request(payload, &limits) {
                Ok(r) => {
                    let touched = r.request_id()
                        ^ u64::from(r.budget_us())
                        ^ r.user_id()
                        ^ r.model().len() as u64
                        ^ r.item_ids().iter().fold(0, |a, x| a ^ x)
                        ^ r.context_ids().iter().fold(0, |a, x| a ^ x)
                        ^ r.context().iter().fold(0u64, |a, x| a ^ u64::from(x.to_bits()))
                        ^ r.rows().unwrap_or_default().iter().fold(0u64, |a, x| a ^ u64::from(x.to_bits()));
                    if let Some(rows) = r.rows() {
                        assert!(
                            r.candidates > 0 && rows.len().is_multiple_of(r.candidates),
                            "raw rows passed their checks"
                        );
                    }
                    std::hint::black_box(touched);
                }
                Err(_) => {
                    std::hint::black_box(salvage_request_id(payload, &limits));
                }
            }
            rest = &rest[used..];
        }
    });
}

#[test]
fn model_files() {
    use quiver::model::Model;
    let mut seeds = vec![
        quiver::loadgen::demo::model().to_bytes(),
        quiver::loadgen::demo::fallback_model().to_bytes(),
        quiver::loadgen::demo::context_mlp("ctx", 5, &[12, 8, 1]).to_bytes(),
    ];
    // Imported graph and tree models exercise the newer node kinds.
    let zoo = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/zoo");
    for (file, inputs) in [("wide_deep.onnx", "user:8,item:8,context:4"), ("dcn_v2.onnx", "user:8,item:8,context:4")] {
        let opts = quiver::model::onnx::ImportOptions {
            name: "m".into(),
            version: 1,
            inputs: inputs.parse().unwrap(),
            output: None,
            output_kind: quiver::model::OutputKind::Logit,
            base_dir: None,
        };
        if let Ok(imported) = quiver::model::onnx::import_file(&zoo.join(file), &opts) {
            seeds.push(imported.model.to_bytes());
        }
    }
    // A graph kept for onnxruntime: the OnnxGraph table and its interface.
    let ort = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/ort/hashed_ids.onnx");
    let opts = quiver::model::onnx::ImportOptions {
        name: "kept".into(),
        version: 1,
        inputs: "user=dense:8,item=dense:8,context_ids=ids:2".parse().unwrap(),
        output: None,
        output_kind: quiver::model::OutputKind::Logit,
        base_dir: None,
    };
    let only = quiver::model::onnx::KeepOnnx::Only { output_kind: None };
    seeds.push(quiver::model::onnx::import_file_keeping(&ort, &opts, only).unwrap().model.to_bytes());
    // Without their checksum trailers (8 bytes), as files from before it:
    // nearly every mutation of a file with one fails the checksum, and the
    // parser behind it would go unfuzzed.
    for s in &mut seeds {
        s.truncate(s.len() - 8);
    }
    fuzz("model_files", seeds, 64 * MIB, &|bytes, _, _| {
        if let Ok(m) = Model::from_bytes(bytes, "fuzz.qm") {
            let d = m.input_dim();
            // An onnxruntime-only model has no native network to run.
            if d <= 4096 && m.is_native() {
                let x: Vec<f32> = (0..2 * d).map(|k| (k % 7) as f32 * 0.25 - 0.5).collect();
                let mut out = [0.0f32; 2];
                m.forward_f32_reference(&x, 2, &mut out);
                std::hint::black_box(out);
                // A model that loads must also build and run on every CPU
                // backend: the builders see what loading let through.
                use quiver::score::BackendKind;
                let m = std::sync::Arc::new(m.clone());
                for kind in [BackendKind::F32, BackendKind::Int8, BackendKind::Fp8] {
                    let mut backend = quiver::score::build(kind, &m, 2);
                    let mut out = [0.0f32; 2];
                    backend.score(&x, 2, &mut out).unwrap();
                    std::hint::black_box(out);
                }
            }
        }
    });
}

#[test]
fn replica_files() {
    use quiver::features::replica::{Replica, ReplicaBuilder, ReplicaWriter, Storage};
    let dir = scratch_dir("replica-seeds");
    let mut seeds = Vec::new();
    for (storage, dim) in [(Storage::F32, 4u32), (Storage::F16, 3), (Storage::Int8, 5)] {
        let mut b = ReplicaBuilder::new("user", dim).storage(storage);
        b.set_default(&vec![0.25; dim as usize]).unwrap();
        for key in [1u64, 2, 40, 1 << 40] {
            b.push(key, &(0..dim).map(|k| key as f32 * 0.01 + k as f32).collect::<Vec<_>>()).unwrap();
        }
        let path = dir.join("seed.qrep");
        b.write(&path).unwrap();
        seeds.push(std::fs::read(&path).unwrap());
    }
    let _ = std::fs::remove_dir_all(&dir);
    fuzz("replica_files", seeds, 16 * MIB, &|bytes, _, scratch| {
        let path = scratch.file("r.qrep");
        std::fs::write(&path, bytes).unwrap();
        if let Ok(r) = Replica::open(&path, "user") {
            let mut out = vec![0.0f32; r.dim()];
            for key in [0u64, 1, 2, 40, 1 << 40, u64::MAX] {
                std::hint::black_box(r.read_into(key, &mut out));
            }
        }
        if let Ok((mut w, _)) = ReplicaWriter::open(&path, "user") {
            let v = vec![1.0f32; w.table().dim()];
            let _ = w.upsert(3, &v);
            std::hint::black_box(w.delete(1));
        }
    });
}

/// A segment as the decision log's writer lays it out (its columns, a
/// request's rows consecutive, nulls where a failure has no candidate),
/// in two batches, LZ4-compressed or not.
fn decision_log_segment(compression: Option<arrow_ipc::CompressionType>) -> Vec<u8> {
    use arrow_array::{
        ArrayRef, Float32Array, RecordBatch, StringArray, TimestampNanosecondArray, UInt32Array, UInt64Array,
    };
    use arrow_schema::{DataType, Field, Schema, TimeUnit};
    use std::sync::Arc;
    let schema = Arc::new(Schema::new(vec![
        Field::new("request_id", DataType::UInt64, false),
        Field::new("received", DataType::Timestamp(TimeUnit::Nanosecond, Some("UTC".into())), false),
        Field::new("model", DataType::Utf8, false),
        Field::new("model_version", DataType::UInt32, false),
        Field::new("status", DataType::Utf8, false),
        Field::new("tier", DataType::Utf8, true),
        Field::new("candidate", DataType::UInt32, true),
        Field::new("score", DataType::Float32, true),
        Field::new("user[0]", DataType::Float32, true),
        Field::new("x[1]", DataType::Float32, true),
    ]));
    let batch = |first: u64| {
        let ids = [first, first, first + 1, first + 2, first + 2, first + 2];
        let ok = |i: usize| ids[i] != first + 1;
        let columns: Vec<ArrayRef> = vec![
            Arc::new(UInt64Array::from(ids.to_vec())),
            Arc::new(
                TimestampNanosecondArray::from(
                    ids.iter().map(|&i| 1_800_000_000_000_000_000 + i as i64).collect::<Vec<_>>(),
                )
                .with_timezone("UTC"),
            ),
            Arc::new(StringArray::from(vec!["ranker"; 6])),
            Arc::new(UInt32Array::from(vec![3u32; 6])),
            Arc::new(StringArray::from((0..6).map(|i| if ok(i) { "ok" } else { "bad_request" }).collect::<Vec<_>>())),
            Arc::new(StringArray::from((0..6).map(|i| ok(i).then_some("primary")).collect::<Vec<_>>())),
            Arc::new(UInt32Array::from(vec![Some(0), Some(1), None, Some(0), Some(1), Some(2)])),
            Arc::new(Float32Array::from((0..6).map(|i| ok(i).then_some(i as f32 * 0.125)).collect::<Vec<_>>())),
            Arc::new(Float32Array::from((0..6).map(|i| ok(i).then_some(-(i as f32))).collect::<Vec<_>>())),
            Arc::new(Float32Array::from((0..6).map(|i| ok(i).then_some(i as f32 + 0.5)).collect::<Vec<_>>())),
        ];
        RecordBatch::try_new(schema.clone(), columns).unwrap()
    };
    let options = arrow_ipc::writer::IpcWriteOptions::default().try_with_compression(compression).unwrap();
    let mut out = Vec::new();
    let mut w = arrow_ipc::writer::FileWriter::try_new_with_options(&mut out, &schema, options).unwrap();
    w.write(&batch(10)).unwrap();
    w.write(&batch(20)).unwrap();
    w.finish().unwrap();
    drop(w);
    out
}

#[test]
fn decision_log_segments() {
    use quiver::decision_log::read::{ReadError, Segment};
    let seeds = vec![decision_log_segment(Some(arrow_ipc::CompressionType::LZ4_FRAME)), decision_log_segment(None)];
    let whole = Segment::read(std::io::Cursor::new(&seeds[0]), "seed".into()).unwrap();
    assert_eq!(whole.summary().decisions, 6, "the seed reads back");
    fuzz("decision_log_segments", seeds, 64 * MIB, &|bytes, _, _| {
        match Segment::read(std::io::Cursor::new(bytes), "input".into()) {
            Ok(segment) => {
                std::hint::black_box(segment.summary());
                let _ = std::hint::black_box(segment.dump_json(None, &mut std::io::sink()));
                let _ = std::hint::black_box(segment.decisions(Some(20), &mut |d| {
                    std::hint::black_box(d);
                }));
            }
            // Caught, so `quiver log` reports it; but the layout check
            // should have refused the file before arrow-ipc's reader
            // panicked on it.
            Err(ReadError::ReaderPanicked { what, .. }) => panic!("arrow-ipc's reader panicked: {what}"),
            Err(_) => {}
        }
    });
}

#[test]
fn onnx_import() {
    let (seeds, options) = zoo();
    fuzz("onnx_import", seeds, 256 * MIB, &|bytes, from, _| import_checked(bytes, &options[from]));
}

const INTERESTING_DIMS: [i64; 10] = [0, 1, 2, -1, 3, 1 << 20, 1 << 31, 1 << 40, i64::MAX, i64::MIN];

/// A mutation of an ONNX model's structure, not its bytes: the protobuf
/// stays well formed, so the importer's own checks meet odd dims, data
/// types, tensors too short for their dims, missing or duplicated nodes,
/// rewired inputs and odd attributes.
fn mutate_onnx(rng: &mut SplitMix64, bytes: &[u8]) -> Vec<u8> {
    use onnx_protobuf::{Message as _, ModelProto};
    let Ok(mut m) = ModelProto::parse_from_bytes(bytes) else {
        return bytes.to_vec();
    };
    let g = m.graph.mut_or_insert_default();
    let pick = |rng: &mut SplitMix64, n: usize| rng.below(n.max(1) as u64) as usize;
    let dim = |rng: &mut SplitMix64| INTERESTING_DIMS[rng.below(INTERESTING_DIMS.len() as u64) as usize];
    for _ in 0..1 + rng.below(4) {
        match rng.below(10) {
            0 | 1 if !g.initializer.is_empty() => {
                let i = pick(rng, g.initializer.len());
                let t = &mut g.initializer[i];
                if t.dims.is_empty() || rng.below(4) == 0 {
                    t.dims.push(dim(rng));
                } else {
                    let k = pick(rng, t.dims.len());
                    t.dims[k] = dim(rng);
                }
            }
            2 if !g.initializer.is_empty() => {
                let i = pick(rng, g.initializer.len());
                let t = &mut g.initializer[i];
                let keep = pick(rng, t.raw_data.len() + 1);
                t.raw_data.truncate(keep);
                let keep = pick(rng, t.float_data.len() + 1);
                t.float_data.truncate(keep);
            }
            3 if !g.initializer.is_empty() => {
                let i = pick(rng, g.initializer.len());
                g.initializer[i].data_type = rng.below(24) as i32;
            }
            4 if !g.node.is_empty() => {
                let i = pick(rng, g.node.len());
                g.node.remove(i);
            }
            5 if !g.node.is_empty() => {
                let i = pick(rng, g.node.len());
                let n = g.node[i].clone();
                let to = pick(rng, g.node.len() + 1);
                g.node.insert(to, n);
            }
            6 if !g.node.is_empty() => {
                let i = pick(rng, g.node.len());
                let j = pick(rng, g.node.len());
                let names: Vec<String> = g.node[j].output.iter().chain(&g.node[j].input).cloned().collect();
                let n = &mut g.node[i];
                if !n.input.is_empty() && !names.is_empty() {
                    let k = pick(rng, n.input.len());
                    n.input[k] = names[pick(rng, names.len())].clone();
                }
            }
            7 if !g.node.is_empty() => {
                let i = pick(rng, g.node.len());
                let n = &mut g.node[i];
                if !n.attribute.is_empty() {
                    let k = pick(rng, n.attribute.len());
                    let a = &mut n.attribute[k];
                    a.i = dim(rng);
                    a.f = [0.0, -1.0, f32::NAN, f32::INFINITY, 1e30][rng.below(5) as usize];
                    if let Some(x) = a.ints.first_mut() {
                        *x = dim(rng);
                    }
                    if let Some(t) = a.t.as_mut() {
                        if let Some(d) = t.dims.first_mut() {
                            *d = dim(rng);
                        }
                    }
                }
            }
            8 if !g.node.is_empty() => {
                let i = pick(rng, g.node.len());
                let j = pick(rng, g.node.len());
                g.node[i].op_type = g.node[j].op_type.clone();
            }
            _ if !g.input.is_empty() => {
                let i = pick(rng, g.input.len());
                let shape = g.input[i].type_.mut_or_insert_default().mut_tensor_type().shape.mut_or_insert_default();
                if shape.dim.is_empty() {
                    shape.dim.push(Default::default());
                }
                let k = pick(rng, shape.dim.len());
                shape.dim[k].set_dim_value(dim(rng));
            }
            _ => {}
        }
    }
    m.write_to_bytes().unwrap_or_else(|_| bytes.to_vec())
}

/// The zoo's models and how each imports.
fn zoo() -> (Vec<Vec<u8>>, Vec<quiver::model::onnx::ImportOptions>) {
    use quiver::model::onnx::ImportOptions;
    let zoo = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/zoo");
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(zoo.join("zoo.json")).unwrap()).unwrap();
    let mut seeds = Vec::new();
    let mut options = Vec::new();
    for (name, z) in index["models"].as_object().unwrap() {
        seeds.push(std::fs::read(zoo.join(z["file"].as_str().unwrap())).unwrap());
        options.push(ImportOptions {
            name: name.clone(),
            version: 1,
            inputs: z["inputs"].as_str().unwrap().parse().unwrap(),
            output: z["output"].as_str().map(String::from),
            output_kind: match z["output_kind"].as_str() {
                Some("raw") => quiver::model::OutputKind::Raw,
                _ => quiver::model::OutputKind::Logit,
            },
            base_dir: None,
        });
    }
    (seeds, options)
}

/// What an import must do with any input: an error, or a model that saves
/// and loads back.
fn import_checked(bytes: &[u8], opts: &quiver::model::onnx::ImportOptions) {
    if let Ok(imported) = quiver::model::onnx::import_bytes(bytes, "fuzz.onnx", opts) {
        let saved = imported.model.to_bytes();
        if let Err(e) = quiver::model::Model::from_bytes(&saved, "fuzz.qm") {
            panic!("an imported model does not load back: {e}");
        }
    }
}

/// The zoo's graphs with structural mutations (see [`mutate_onnx`]); the
/// mutation happens inside the run, from the input's bytes as a seed.
#[test]
fn onnx_graphs() {
    let (seeds, options) = zoo();
    // Each input is a seed model's index and 8 bytes of mutation seed.
    let inputs: Vec<Vec<u8>> = (0..seeds.len()).map(|i| (i as u64).to_le_bytes().to_vec()).collect();
    fuzz_scaled("onnx_graphs", inputs, 256 * MIB, 4, &|bytes, from, _| {
        let mut word = [0u8; 8];
        for (i, b) in bytes.iter().enumerate() {
            word[i % 8] ^= *b;
        }
        let mut rng = SplitMix64::new(u64::from_le_bytes(word) ^ (bytes.len() as u64).rotate_left(17));
        let mutated = mutate_onnx(&mut rng, &seeds[from]);
        import_checked(&mutated, &options[from]);
    });
}

/// A float32 or float64 `.npy` file of `rows` × `cols`, header version `v`.
fn npy(descr: &str, rows: usize, cols: usize, v: u8) -> Vec<u8> {
    let dict = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': ({rows}, {cols}), }}");
    let prefix = if v == 1 { 10 } else { 12 };
    let mut header = dict.into_bytes();
    while (prefix + header.len() + 1) % 64 != 0 {
        header.push(b' ');
    }
    header.push(b'\n');
    let mut out = b"\x93NUMPY".to_vec();
    out.extend_from_slice(&[v, 0]);
    if v == 1 {
        out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    } else {
        out.extend_from_slice(&(header.len() as u32).to_le_bytes());
    }
    out.extend_from_slice(&header);
    let width = if descr.ends_with('8') { 8 } else { 4 };
    for k in 0..rows * cols {
        if width == 8 {
            out.extend_from_slice(&(k as f64 * 0.5).to_le_bytes());
        } else {
            out.extend_from_slice(&(k as f32 * 0.5).to_le_bytes());
        }
    }
    out
}

#[test]
fn npy_files() {
    let seeds = vec![npy("<f4", 3, 4, 1), npy("<f4", 1, 20, 2), npy("<f8", 2, 3, 1), npy("<f4", 0, 5, 1)];
    // float64 is refused (calibration data is float32); its seed grows the error paths.
    for s in seeds.iter().filter(|s| !s.windows(3).any(|w| w == b"<f8")) {
        quiver::model::calibrate::parse_npy(s, "seed.npy").expect("the float32 seeds are valid");
    }
    fuzz("npy_files", seeds, 16 * MIB, &|bytes, _, _| {
        if let Ok(m) = quiver::model::calibrate::parse_npy(bytes, "fuzz.npy") {
            std::hint::black_box(m);
        }
    });
}

#[test]
fn resp_replies() {
    let seeds: Vec<Vec<u8>> = [
        &b"+OK\r\n"[..],
        b"-ERR unknown command\r\n",
        b":12345\r\n:-1\r\n",
        b"$5\r\nhello\r\n$-1\r\n$0\r\n\r\n",
        b"*-1\r\n*0\r\n",
        b"*2\r\n$3\r\nfoo\r\n*2\r\n:1\r\n+x\r\n",
        b"*1\r\n*2\r\n$18\r\nquiver:stream:item\r\n*1\r\n*2\r\n$4\r\n12-0\r\n*6\r\n$1\r\nk\r\n$6\r\nitem:7\r\n\
$1\r\nv\r\n$8\r\n\x00\x00\x80?\x00\x00\x00@\r\n$1\r\nt\r\n$3\r\n123\r\n",
        b"*2\r\n$1\r\n0\r\n*2\r\n$6\r\nuser:1\r\n$6\r\nuser:2\r\n",
    ]
    .iter()
    .map(|s| s.to_vec())
    .collect();
    for s in &seeds {
        quiver::features::feed::resp::decode_all(s, 1 << 20, 3).expect("the seeds are valid");
    }
    fuzz("resp_replies", seeds, 16 * MIB, &|bytes, from, _| {
        let chunk = 1 + (bytes.len() + from) % 7;
        std::hint::black_box(quiver::features::feed::resp::decode_all(bytes, 64 * 1024, chunk).ok());
    });
}

/// A Feast registry of one entity, view and service, as `feast apply`
/// writes one (fields as Feast 0.67 sets them).
fn feast_registry() -> Vec<u8> {
    use protobuf::{EnumOrUnknown, Message};
    use quiver::features::feast::protos::Value::value_type::Enum as ValueType;
    use quiver::features::feast::protos::{
        Entity, Feature, FeatureService, FeatureView, FeatureViewProjection, Registry,
    };
    let mut r = Registry::Registry::new();
    let mut entity = Entity::Entity::new();
    let spec = entity.spec.mut_or_insert_default();
    (spec.name, spec.project, spec.join_key) = ("user".into(), "p".into(), "user_id".into());
    spec.value_type = EnumOrUnknown::new(ValueType::INT64);
    r.entities.push(entity);
    let feature = |name: &str, t: ValueType| {
        let mut f = Feature::FeatureSpecV2::new();
        f.name = name.into();
        f.value_type = EnumOrUnknown::new(t);
        f
    };
    let mut view = FeatureView::FeatureView::new();
    let spec = view.spec.mut_or_insert_default();
    (spec.name, spec.project, spec.online) = ("v".into(), "p".into(), true);
    spec.entities.push("user".into());
    spec.features.extend([feature("f", ValueType::FLOAT), feature("g", ValueType::BOOL)]);
    spec.entity_columns.push(feature("user_id", ValueType::INT64));
    spec.ttl.mut_or_insert_default().seconds = 86_400;
    r.feature_views.push(view);
    let mut service = FeatureService::FeatureService::new();
    let spec = service.spec.mut_or_insert_default();
    (spec.name, spec.project) = ("s".into(), "p".into());
    let mut projection = FeatureViewProjection::FeatureViewProjection::new();
    projection.feature_view_name = "v".into();
    projection.feature_columns.push(feature("g", ValueType::BOOL));
    spec.features.push(projection);
    r.feature_services.push(service);
    r.write_to_bytes().unwrap()
}

/// Feast's bytes as Quiver reads them: a registry (and the plan made of
/// it), stored values and `_ts:` timestamps, and Redis keys in both entity
/// key serialization versions. Every input is a value or a typed refusal.
#[test]
fn feast_bytes() {
    use quiver::features::feast::redis_layout::{self, EntityCodec, JoinKeyType, KeyVersion};
    use quiver::features::feast::FeastRepo;
    use quiver::features::replica::EntityKeyBuf;
    let codecs: Vec<EntityCodec> = [KeyVersion::V2, KeyVersion::V3]
        .into_iter()
        .flat_map(|v| {
            [
                EntityCodec::new("user_id", JoinKeyType::Int64, v, "p"),
                EntityCodec::new("shop", JoinKeyType::Int32, v, "p"),
                EntityCodec::new("merchant_id", JoinKeyType::String { bytes_max: 64 }, v, "p"),
                EntityCodec::composite(
                    &[
                        ("user_id".into(), JoinKeyType::Int64),
                        ("merchant_id".into(), JoinKeyType::String { bytes_max: 64 }),
                    ],
                    v,
                    "p",
                ),
            ]
        })
        .collect();
    let mut seeds = vec![
        feast_registry(),
        vec![0x35, 0, 0, 0x40, 0x40],
        vec![0x38, 0x01],
        vec![0x20, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01],
        vec![0x08, 0x80, 0x89, 0xcf, 0xd8, 0x06],
    ];
    for c in &codecs {
        let key = match c.key {
            _ if c.is_composite() => EntityKeyBuf::Str(b"m-\\|1|-7".to_vec()),
            JoinKeyType::String { .. } => EntityKeyBuf::Str(b"m-1".to_vec()),
            _ => EntityKeyBuf::Id(7),
        };
        seeds.push(c.redis_key(&key).expect("a seed key"));
    }
    let repo = FeastRepo::from_registry("p", KeyVersion::V3, &seeds[0]).expect("the seed registry reads");
    assert_eq!(repo.plan(&[]).expect("the seed plan").views.len(), 1);
    fuzz("feast_bytes", seeds, 16 * MIB, &|bytes, _, _| {
        if let Ok(repo) = FeastRepo::from_registry("p", KeyVersion::V3, bytes) {
            std::hint::black_box(repo.plan(&[]).ok());
            std::hint::black_box(repo.plan(&["v".into()]).ok());
        }
        std::hint::black_box(redis_layout::value_f32(bytes).ok());
        std::hint::black_box(redis_layout::ts_unix_s(bytes).ok());
        for c in &codecs {
            if c.claims(bytes) {
                std::hint::black_box(c.parse(bytes).ok());
            }
            // Any bytes as a group key: a Redis key or a typed refusal.
            std::hint::black_box(c.redis_key(&EntityKeyBuf::Str(bytes.to_vec())).ok());
        }
    });
}

/// What the cluster client makes of replies: a `CLUSTER SLOTS` topology and
/// `MOVED`/`ASK` redirects, from mutated replies a node could send. Either a
/// topology that routes every slot somewhere, or a typed refusal.
#[test]
fn cluster_replies() {
    let seeds: Vec<Vec<u8>> = [
        &b"*1\r\n*3\r\n:0\r\n:16383\r\n*3\r\n$9\r\n127.0.0.1\r\n:7000\r\n$40\r\n0123456789012345678901234567890123456789\r\n"[..],
        b"*2\r\n*3\r\n:0\r\n:8191\r\n*2\r\n$9\r\n127.0.0.1\r\n:7000\r\n*4\r\n:8192\r\n:16383\r\n*2\r\n$0\r\n\r\n:7001\r\n*2\r\n$3\r\n::1\r\n:7004\r\n",
        b"-MOVED 3999 127.0.0.1:6381\r\n",
        b"-ASK 3999 [::1]:6381\r\n",
        b"-TRYAGAIN Multiple keys request during rehashing of slot\r\n",
    ]
    .iter()
    .map(|s| s.to_vec())
    .collect();
    for s in &seeds {
        quiver::features::feed::resp::decode_all(s, 1 << 20, 3).expect("the seeds are valid");
    }
    fuzz("cluster_replies", seeds, 16 * MIB, &|bytes, _, _| {
        let Ok(replies) = quiver::features::feed::resp::decode_all(bytes, 64 * 1024, 64) else {
            return;
        };
        for reply in replies {
            std::hint::black_box(quiver::features::feed::redis_cluster::Redirect::parse(&reply));
            std::hint::black_box(
                quiver::features::feed::redis_cluster::Topology::parse_slots(reply, "127.0.0.1:7000").ok(),
            );
        }
    });
}

/// What the refresher makes of a stream entry's fields (XREAD replies):
/// an entity and its vector, a delete, or a reason to skip it.
#[test]
fn stream_entries() {
    let seeds: Vec<Vec<u8>> = [
        &b"*6\r\n$1\r\nk\r\n$6\r\nitem:7\r\n$1\r\nv\r\n$8\r\n\x00\x00\x80?\x00\x00\x00@\r\n$1\r\nt\r\n$3\r\n123\r\n"[..],
        b"*4\r\n$1\r\nk\r\n$6\r\nitem:8\r\n$1\r\nd\r\n$1\r\n1\r\n",
        b"*2\r\n$1\r\nk\r\n$10\r\n{item:3}:9\r\n",
    ]
    .iter()
    .map(|s| s.to_vec())
    .collect();
    let plain = quiver::features::feed::contract::Part::new("item", quiver::features::feed::contract::Layout::Plain, 0);
    let bucketed = quiver::features::feed::contract::Part::new(
        "item",
        quiver::features::feed::contract::Layout::Bucketed { buckets: 16 },
        3,
    );
    // A string-keyed group reads the same entries as keys of up to 8 bytes.
    let strings = plain.clone().with_key_kind(quiver::features::replica::KeyKind::Str { bytes_max: 8 });
    // A group with a parent reads what follows each vector as a parent key.
    let linked = strings.clone().with_link(Some(quiver::features::replica::KeyKind::Str { bytes_max: 4 }));
    fuzz("stream_entries", seeds, 16 * MIB, &|bytes, _, _| {
        let Ok(replies) = quiver::features::feed::resp::decode_all(bytes, 64 * 1024, 64) else {
            return;
        };
        for reply in replies {
            let Some(fields) = reply.into_array() else { continue };
            for part in [&plain, &bucketed, &strings, &linked] {
                if let Ok((key, v, _)) = quiver::features::feed::refresher::change(part, &fields, 2) {
                    if let Some((v, parent)) = v {
                        assert_eq!(v.len(), 2, "a vector of the group's dimension, or a refusal");
                        match parent {
                            None => {}
                            Some(quiver::features::feed::contract::EntityKey::Str(p)) if part == &linked => {
                                assert!((1..=4).contains(&p.len()), "a parent key within its group's limit");
                            }
                            Some(other) => panic!("a parent {other} for a group without one, or of another kind"),
                        }
                    }
                    if let quiver::features::feed::contract::EntityKey::Str(k) = key {
                        assert!((1..=8).contains(&k.len()), "a string key within the group's limit");
                    }
                }
            }
        }
    });
}

/// The configuration reference's example, every key set: the one users copy.
fn reference_config() -> String {
    let page = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/CONFIGURATION.md")).unwrap();
    let start =
        page.find("```toml\nlisten =").expect("docs/CONFIGURATION.md has its example config") + "```toml\n".len();
    let end = start + page[start..].find("```").unwrap();
    page[start..end].to_string()
}

#[test]
fn toml_config() {
    let seeds: Vec<Vec<u8>> = [
        reference_config(),
        "[feed]\nredis = \"redis://u:p@10.0.0.1:6380/2\"\nresync_shrink_max_by_group = { item = 0.9 }\n".into(),
        "[admission.clients.3]\nrate_per_s = 100.0\nburst = 10.0\n[shed]\nenabled = true\n".into(),
        "cores = [0, 1]\ninference = \"thread\"\n[ladder.breaker]\nwindow = 20\n".into(),
    ]
    .into_iter()
    .map(String::into_bytes)
    .collect();
    quiver::config::Config::parse(std::str::from_utf8(&seeds[0]).unwrap(), "docs/CONFIGURATION.md")
        .expect("the reference's example parses");
    fuzz("toml_config", seeds, 16 * MIB, &|bytes, _, _| {
        let text = String::from_utf8_lossy(bytes);
        if let Ok(c) = quiver::config::Config::parse(&text, "fuzz.toml") {
            std::hint::black_box(c.limits.validate().is_ok());
        }
    });
}

#[test]
fn admin_routes() {
    let seeds: Vec<Vec<u8>> = [
        "GET /metrics",
        "GET /readyz",
        "GET /stats.json",
        "POST /drain",
        "POST /faults?stage_delay_us=10000",
        "POST /models/auction-32/load?version=2",
        "POST /models/auction-32/rollback",
        "POST /models/auction-32/canary?version=2&fraction=0.05",
        "POST /models/auction-32/shadow?fraction=1",
        "POST /replica/item/accept",
        "HEAD /healthz?x=1#y",
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect();
    fuzz("admin_routes", seeds, 4 * MIB, &|bytes, _, _| {
        let text = String::from_utf8_lossy(bytes);
        let (method, url) = text.split_once(' ').unwrap_or((&text, "/"));
        let route = quiver::admin::route(method, url);
        std::hint::black_box(route.is_control());
    });
}

/// Tree ensembles as LightGBM text and XGBoost JSON. Their seeds are large
/// (77 KB to 190 KB of real models), so this target runs a twentieth of the
/// inputs the others do.
#[test]
fn tree_model_text() {
    use quiver::model::gbdt::{import_lightgbm_text, import_xgboost_text, GbdtOptions};
    let trees = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/trees");
    let files = ["lgb_regression.txt", "lgb_zero_missing.txt", "xgb_regression.json"];
    let seeds: Vec<Vec<u8>> = files.iter().map(|f| std::fs::read(trees.join(f)).unwrap()).collect();
    let opts = GbdtOptions {
        name: "t".into(),
        version: 1,
        inputs: "user:4,item:4,context:4".parse().unwrap(),
        output_kind: None,
    };
    for (f, s) in files.iter().zip(&seeds) {
        let text = std::str::from_utf8(s).unwrap();
        let imported = if f.ends_with(".txt") {
            import_lightgbm_text(text, f, &opts)
        } else {
            import_xgboost_text(text, f, &opts)
        };
        imported.unwrap_or_else(|e| panic!("{f}: {e}"));
    }
    let scale = 20;
    fuzz_scaled("tree_model_text", seeds, 256 * MIB, scale, &|bytes, from, _| {
        let text = String::from_utf8_lossy(bytes);
        let imported = if from < 2 {
            import_lightgbm_text(&text, "fuzz.txt", &opts)
        } else {
            import_xgboost_text(&text, "fuzz.json", &opts)
        };
        if let Ok(imported) = imported {
            let saved = imported.model.to_bytes();
            if let Err(e) = quiver::model::Model::from_bytes(&saved, "fuzz.qm") {
                panic!("an imported tree model does not load back: {e}");
            }
        }
    });
}

/// Connections live targets leave open: a client that promised bytes (a
/// length, a `Content-Length`, half a frame) and never sends them. At most
/// `HELD_MAX` at once, the oldest let go first.
struct Held {
    conns: std::sync::Mutex<std::collections::VecDeque<std::net::TcpStream>>,
}

const HELD_MAX: usize = 48;

impl Held {
    fn new() -> Held {
        Held { conns: std::sync::Mutex::new(std::collections::VecDeque::new()) }
    }

    /// Sends `bytes` on a new connection to `addr` and keeps it open.
    fn hold(&self, addr: &str, bytes: &[u8], what: &str) {
        use std::io::Write;
        let Ok(mut s) = std::net::TcpStream::connect(addr) else {
            panic!("{what} stopped accepting");
        };
        let _ = s.write_all(bytes);
        let mut conns = self.conns.lock().unwrap();
        if conns.len() == HELD_MAX {
            conns.pop_front();
        }
        conns.push_back(s);
    }

    fn count(&self) -> usize {
        self.conns.lock().unwrap().len()
    }
}

/// One live-target input: a connection to `addr` that sends `bytes`, hangs
/// up its side, and reads whatever comes back until the server closes (or
/// `read_timeout` passes with nothing).
fn send_and_drain(addr: &str, bytes: &[u8], read_timeout: Duration, what: &str) {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(addr) else {
        panic!("{what} stopped accepting");
    };
    s.set_read_timeout(Some(read_timeout)).unwrap();
    let _ = s.write_all(bytes);
    let _ = s.shutdown(std::net::Shutdown::Write);
    let mut sink = [0u8; 4096];
    while let Ok(n) = s.read(&mut sink) {
        if n == 0 {
            break;
        }
    }
}

/// Raw HTTP bytes at a live server's admin listener (with a token, so the
/// controls' refusal path runs too): whatever arrives, the admin thread
/// keeps answering and the server keeps scoring. A fiftieth of the inputs:
/// each is a connection.
#[test]
fn admin_http_bytes() {
    let dir = common::scratch("fuzz-admin-token");
    let token = dir.join("t");
    std::fs::write(&token, "fuzz-token-0123456789").unwrap();
    let server = common::Server::start(&["--shards", "1", "--admin-token-file", token.to_str().unwrap()]);
    let seeds: Vec<Vec<u8>> = [
        "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
        "POST /drain HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nope\r\nContent-Length: 0\r\n\r\n",
        "POST /models/auction-32/canary?version=2&fraction=0.5 HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc",
        "GET /stats.json HTTP/1.0\r\n\r\n",
        "POST /replica/item/accept HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect();
    let admin = server.admin.clone();
    let held = Held::new();
    fuzz_scaled("admin_http_bytes", seeds, 16 * MIB, 50, &|bytes, from, _| {
        // One input in eight stays open with whatever it promised unsent.
        if (bytes.len() + from) % 8 == 0 {
            held.hold(&admin, bytes, "the admin listener");
        } else {
            send_and_drain(&admin, bytes, Duration::from_millis(500), "the admin listener");
        }
    });
    // With the held connections still open, a probe is answered at once.
    let probe = std::time::Instant::now();
    assert_eq!(common::http_get(&format!("http://{admin}/healthz")).0, 200, "the admin thread still answers");
    assert!(probe.elapsed() < common::PROBE_MAX, "a probe waited {:?} beside {} held", probe.elapsed(), held.count());
    let r = server.client().score(&common::demo_request(1, 1, vec![1, 2])).unwrap();
    assert_eq!(r.status, quiver::wire::Status::Ok, "and the server still scores");
    assert_eq!(common::http_get(&format!("http://{admin}/readyz")).0, 200, "no fuzzed request drained it");
}

/// Mutated ClientHellos (and whatever else mutation makes of them) at a live
/// server whose scoring port speaks TLS: each input is a connection that
/// sends its bytes and hangs up. Afterwards the server still completes real
/// handshakes and scores. A fiftieth of the inputs.
#[test]
fn tls_client_hellos() {
    let pki = common::pki::Pki::new("fuzz-tls");
    // A handshake budget no run reaches: every input must reach rustls.
    let config = pki.dir.join("quiver.toml");
    std::fs::write(
        &config,
        format!(
            "[tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\nhandshakes_per_s_max = 1000000\nhandshake_burst = 1000000\n",
            pki.path("server.crt"),
            pki.path("server.key")
        ),
    )
    .unwrap();
    let server = common::Server::start(&["--shards", "1", "--config", config.to_str().unwrap()]);
    let tls = quiver::tls::ClientTls { ca_file: Some(pki.dir.join("ca.crt")), ..Default::default() };
    let config = quiver::tls::client_config(&tls).unwrap();
    let seeds: Vec<Vec<u8>> = ["localhost", "127.0.0.1"]
        .iter()
        .map(|name| {
            let name = rustls::pki_types::ServerName::try_from(name.to_string()).unwrap();
            let mut conn = rustls::ClientConnection::new(config.clone(), name).unwrap();
            let mut hello = Vec::new();
            conn.write_tls(&mut hello).unwrap();
            hello
        })
        .collect();
    let addr = server.addr.clone();
    fuzz_scaled("tls_client_hellos", seeds, 16 * MIB, 50, &|bytes, _, _| {
        send_and_drain(&addr, bytes, Duration::from_secs(3), "the TLS listener");
    });
    let mut c = quiver::client::Client::connect_with(&server.addr, Duration::from_secs(10), Some(&tls)).unwrap();
    let r = c.score(&common::demo_request(1, 1, vec![1, 2])).unwrap();
    assert_eq!(r.status, quiver::wire::Status::Ok, "the server still completes handshakes and scores");
}

/// Mutated request frames at a live server's scoring port, each input a
/// connection: most send their bytes and hang up; one in eight stays open
/// with what it promised (a length prefix, half a frame) unsent. Afterwards,
/// beside the held ones, a client is served at once. A fiftieth of the inputs.
#[test]
fn scoring_port_bytes() {
    let server = common::Server::start(&["--shards", "1"]);
    let mut frame = Vec::new();
    quiver::wire::RequestEncoder::new().encode(&common::demo_request(1, 7, vec![1, 2, 3]), &mut frame);
    let mut two = frame.clone();
    two.extend_from_slice(&frame);
    let seeds = vec![frame.clone(), two, frame[..frame.len() / 2].to_vec(), frame[..4].to_vec()];
    let addr = server.addr.clone();
    let held = Held::new();
    fuzz_scaled("scoring_port_bytes", seeds, 16 * MIB, 50, &|bytes, from, _| {
        if (bytes.len() + from) % 8 == 0 {
            held.hold(&addr, bytes, "the scoring port");
        } else {
            send_and_drain(&addr, bytes, Duration::from_millis(500), "the scoring port");
        }
    });
    let started = std::time::Instant::now();
    let r = server.client().score(&common::demo_request(2, 7, vec![1, 2])).unwrap();
    assert_eq!(r.status, quiver::wire::Status::Ok);
    assert!(started.elapsed() < common::PROBE_MAX, "served after {:?} beside {} held", started.elapsed(), held.count());
}
