//! Every CUDA kernel in `kernels/` run on the CPU and held to the CPU
//! backends, in plain `cargo test`, without a GPU (issue 40).
//!
//! Each kernel source, unchanged, is compiled for the host by the C++
//! compiler that the `cc` crate finds (g++ on CI), with the emulation header
//! `kernels/emulation/cuda_emu.h` included first and the wrapper
//! `kernels/emulation/<file>.cpp` (shared-memory storage, launch entry),
//! into a shared library this test loads. A launch runs each block's
//! threads as real threads, so `__syncthreads()`, shared memory and the warp
//! shuffles are exercised for real (docs/TESTING.md says what the emulation
//! cannot show).
//!
//! - `dense_int8` (uncalibrated models) and `dense_int8_static` (calibrated)
//!   against `cpu::CpuInt8` with the scalar reference kernel, bit for bit,
//!   on the models, row counts and edge-case rows of `quiver gpu-check`,
//!   driven layer by layer as `src/score/cuda.rs` drives them;
//! - `dense_fp8` against `cpu::CpuFp8`, bit for bit (the contract in
//!   docs/KERNELS.md: every product is exact, so the `__fmaf_rn` chain and the
//!   CPU's `mul_add` chain round the same additions);
//! - the emulated `cuda_fp8.h` conversions against `score::e4m3`, and
//!   `__float2int_rn`, `__int2float_rn` and `__dp4a` against their
//!   definitions at the edges;
//! - a ThreadSanitizer build runs both INT8 entries without a report, and
//!   copies with one `__syncthreads()` removed are reported as data races.
//!
//! A missing C++ compiler fails these tests: CI has one (`.ci/run`).

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, OnceLock};

#[path = "common/zoo.rs"]
#[allow(dead_code)]
mod zoo;

use quiver::loadgen::demo::SplitMix64;
use quiver::model::gbdt::{import_lightgbm_file, import_xgboost_file, GbdtOptions};
use quiver::model::onnx::{import_file, ImportOptions};
use quiver::model::{Model, Op, OutputKind};
use quiver::score::gpu_cases::{check_graph_inputs, check_graph_models, check_inputs, check_models, pack_weights};
use quiver::score::gpu_layout::{Arg, GraphPlan, Param, Precision};
use quiver::score::{cpu, e4m3, kernels, Backend};

type LaunchFn = unsafe extern "C" fn(
    *const c_char,
    *const c_uint,
    *const c_uint,
    usize,
    *mut *mut c_void,
    *mut c_char,
    usize,
) -> c_int;

fn emulation_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/emulation")
}

/// Compiles `wrapper` (under `kernels/emulation/`) and `extra_sources` with
/// the emulation header, `flags` added, to `out`; `kernel` replaces the
/// source the wrapper includes. Panics with the compiler's output on failure.
fn compile(wrapper: &str, kernel: Option<&Path>, extra_sources: &[&str], flags: &[&str], out: &Path) {
    let triple = format!("{}-unknown-linux-gnu", std::env::consts::ARCH);
    let tool = cc::Build::new()
        .cpp(true)
        .cargo_metadata(false)
        .cargo_warnings(false)
        .debug(false)
        .opt_level(2)
        .target(&triple)
        .host(&triple)
        .try_get_compiler()
        .unwrap_or_else(|e| panic!("no C++ compiler for the kernel emulation (install g++): {e}"));
    let dir = emulation_dir();
    let mut cmd = tool.to_command();
    // Strict IEEE single arithmetic: no contraction into FMA, no fast math.
    cmd.args(["-std=c++17", "-ffp-contract=off", "-fno-fast-math", "-pthread"])
        .args(["-Wall", "-Wextra", "-Werror", "-Wno-unknown-pragmas"])
        .arg("-I")
        .arg(&dir)
        .args(["-include", "cuda_emu.h"]);
    if let Some(k) = kernel {
        cmd.arg(format!("-DQUIVER_EMU_KERNEL=\"{}\"", k.display()));
    }
    cmd.args(flags).arg(dir.join(wrapper));
    for s in extra_sources {
        cmd.arg(dir.join(s));
    }
    cmd.arg("-o").arg(out);
    let output =
        cmd.output().unwrap_or_else(|e| panic!("could not run the C++ compiler {:?} (install g++): {e}", tool.path()));
    assert!(
        output.status.success(),
        "compiling {wrapper} failed ({cmd:?}):\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

fn scratch(name: &str) -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("cuda-emu-{}-{name}", std::process::id()))
}

/// One kernel file built for the host and loaded.
struct Emulated {
    lib: libloading::Library,
}

impl Emulated {
    fn build(wrapper: &str) -> Emulated {
        let path = scratch(&wrapper.replace(".cpp", ".so"));
        compile(wrapper, None, &[], &["-shared", "-fPIC", "-Wl,-z,defs"], &path);
        // SAFETY: the library is ours, just built; its static constructors
        // only register shared-memory regions.
        let lib = unsafe { libloading::Library::new(&path) }.expect("loading the emulated kernels");
        // Mapped now; the file is no longer needed (each test process builds its own).
        let _ = std::fs::remove_file(&path);
        Emulated { lib }
    }

    /// Runs `entry` over `grid` × `block` threads with `shared_bytes` of
    /// dynamic shared memory.
    ///
    /// # Safety
    /// `args` are the entry's parameters in order, each a value of the
    /// parameter's C type (`int` as i32, `float` as f32, pointers as
    /// pointers), and every buffer a pointer names is as large as the
    /// kernel reads or writes for this launch.
    unsafe fn launch(&self, entry: &str, grid: [u32; 3], block: [u32; 3], shared_bytes: usize, args: &mut Args) {
        // SAFETY: `quiver_emu_launch` is defined with this signature by
        // QUIVER_EMU_ENTRIES (kernels/emulation/cuda_emu.h).
        let launch: libloading::Symbol<LaunchFn> = unsafe { self.lib.get(b"quiver_emu_launch") }.unwrap();
        let name = CString::new(entry).unwrap();
        let mut pointers = args.pointers();
        let mut error = [0 as c_char; 256];
        // SAFETY: as the caller promises; the dims are three u32 each and
        // the error buffer's length is passed with it.
        let rc = unsafe {
            launch(
                name.as_ptr(),
                grid.as_ptr(),
                block.as_ptr(),
                shared_bytes,
                pointers.as_mut_ptr(),
                error.as_mut_ptr(),
                error.len(),
            )
        };
        // SAFETY: the launcher writes a NUL-terminated message (snprintf).
        assert_eq!(rc, 0, "{}", unsafe { CStr::from_ptr(error.as_ptr()) }.to_string_lossy());
    }
}

fn int8_lib() -> &'static Emulated {
    static LIB: OnceLock<Emulated> = OnceLock::new();
    LIB.get_or_init(|| Emulated::build("int8_dense.cpp"))
}

fn fp8_lib() -> &'static Emulated {
    static LIB: OnceLock<Emulated> = OnceLock::new();
    LIB.get_or_init(|| Emulated::build("fp8_dense.cpp"))
}

fn trees_lib() -> &'static Emulated {
    static LIB: OnceLock<Emulated> = OnceLock::new();
    LIB.get_or_init(|| Emulated::build("trees.cpp"))
}

fn graph_lib() -> &'static Emulated {
    static LIB: OnceLock<Emulated> = OnceLock::new();
    LIB.get_or_init(|| Emulated::build("graph_nodes.cpp"))
}

/// The emulated build of a kernel file.
fn lib_of(file: &str) -> &'static Emulated {
    match file {
        "int8_dense.cu" => int8_lib(),
        "trees.cu" => trees_lib(),
        "graph_nodes.cu" => graph_lib(),
        other => panic!("no emulation wrapper for {other}"),
    }
}

/// A launch's parameters, each in an 8-byte slot, as cuLaunchKernel takes
/// them (a pointer to each value).
#[derive(Default)]
struct Args {
    slots: Vec<u64>,
}

impl Args {
    fn push(mut self, bytes: &[u8]) -> Self {
        let mut slot = [0u8; 8];
        slot[..bytes.len()].copy_from_slice(bytes);
        self.slots.push(u64::from_ne_bytes(slot));
        self
    }
    fn int(self, v: i32) -> Self {
        self.push(&v.to_ne_bytes())
    }
    fn float(self, v: f32) -> Self {
        self.push(&v.to_ne_bytes())
    }
    fn ptr<T>(self, p: *const T) -> Self {
        self.push(&(p as usize).to_ne_bytes())
    }
    fn pointers(&mut self) -> Vec<*mut c_void> {
        self.slots.iter_mut().map(|s| s as *mut u64 as *mut c_void).collect()
    }
}

/// What `CudaInt8::run` does, on the emulation: NaN read as 0, one launch
/// per layer with the backend's geometry, `dense_int8` or
/// `dense_int8_static` by the model's semantics. Outputs start poisoned so
/// that an element a kernel leaves unwritten shows.
fn emulated_int8(model: &Model, x: &[f32], rows: usize) -> Vec<f32> {
    let lib = int8_lib();
    let clean: Vec<f32> = x.iter().map(|v| if v.is_nan() { 0.0 } else { *v }).collect();
    let statics = model.static_int8();
    let inv_s_in = statics.as_ref().map_or(1.0, |st| 1.0f32 / st[0].in_scale);
    let mut act = clean.clone();
    let mut act_q: Vec<i8> = vec![0x5A];
    let mut logits = Vec::new();
    for (i, l) in model.layers.iter().enumerate() {
        let (k, n) = (l.in_dim, l.out_dim);
        let k4 = k.next_multiple_of(4);
        let rows_per_block = kernels::dense_rows_per_block(k4);
        let grid = [rows.div_ceil(rows_per_block) as u32, (n as u32).div_ceil(kernels::DENSE_THREADS), 1];
        let block = [kernels::DENSE_THREADS, 1, 1];
        let shared = rows_per_block * k4;
        let w = pack_weights(l);
        let geometry =
            |a: Args| a.int(rows as i32).int(k as i32).int(k4 as i32).int(n as i32).int(rows_per_block as i32);
        match &statics {
            None => {
                let mut y = vec![3.0e38f32; rows * n];
                let args = geometry(Args::default().ptr(act.as_ptr()));
                let mut args = args
                    .ptr(w.as_ptr())
                    .ptr(l.weight_scales.as_ptr())
                    .ptr(l.bias.as_ptr())
                    .int(i32::from(l.relu))
                    .ptr(y.as_mut_ptr());
                // SAFETY: dense_int8's parameters in order; `act` holds rows
                // × k floats, `y` rows × n, `w` k4 / 4 × n words, the scales
                // and bias n each; the grid covers rows and n as the backend's.
                unsafe { lib.launch("dense_int8", grid, block, shared, &mut args) };
                act = y;
            }
            Some(st) => {
                let s = &st[i];
                let mut y_q = vec![0x5Ai8; rows * n];
                let mut y_f32 = vec![3.0e38f32; if s.requantize { 1 } else { rows * n }];
                let args =
                    Args::default().ptr(clean.as_ptr()).ptr(act_q.as_ptr()).int(i32::from(i == 0)).float(inv_s_in);
                let mut args = geometry(args)
                    .ptr(w.as_ptr())
                    .ptr(s.bias_q.as_ptr())
                    .ptr(s.scale.as_ptr())
                    .int(i32::from(s.requantize))
                    .int(i32::from(s.lo))
                    .ptr(y_q.as_mut_ptr())
                    .ptr(y_f32.as_mut_ptr());
                // SAFETY: dense_int8_static's parameters in order; layer 0
                // reads `clean` (rows × k floats), later layers `act_q`
                // (rows × k bytes, the previous layer's output); a hidden
                // layer writes `y_q` (rows × n), the output layer `y_f32`
                // (rows × n); the constants hold n each.
                unsafe { lib.launch("dense_int8_static", grid, block, shared, &mut args) };
                if s.requantize {
                    act_q = y_q;
                } else {
                    logits = y_f32;
                }
            }
        }
    }
    if statics.is_some() {
        logits
    } else {
        act
    }
}

/// Rows 1 to 1,024: single rows, ragged last blocks of rows (3 and 8 rows
/// per block), exact multiples, and a warp's worth either side of 32.
const BATCHES: [usize; 10] = [1, 2, 7, 8, 9, 31, 32, 33, 255, 1024];

/// Bit for bit, two NaNs (payloads unspecified) counting as equal.
fn mismatches(got: &[f32], want: &[f32]) -> Vec<usize> {
    (0..want.len())
        .filter(|&r| !(got[r].to_bits() == want[r].to_bits() || (got[r].is_nan() && want[r].is_nan())))
        .collect()
}

#[test]
fn int8_kernels_match_the_cpu_scalar_reference_bit_for_bit() {
    let rows_max = *BATCHES.iter().max().unwrap();
    let mut checked = [0usize; 2];
    for (model, model_rows_max) in check_models(rows_max).expect("the check models calibrate") {
        let mut cpu = cpu::CpuInt8::with_kernel(&model, model_rows_max, cpu::Int8Kernel::Scalar).unwrap();
        for &rows in BATCHES.iter().filter(|&&r| r <= model_rows_max) {
            let x = check_inputs(rows as u64, rows, model.input_dim());
            let mut want = vec![0.0; rows];
            cpu.score(&x, rows, &mut want).unwrap();
            let got = emulated_int8(&model, &x, rows);
            assert_eq!(got.len(), rows);
            let bad = mismatches(&got, &want);
            assert!(
                bad.is_empty(),
                "{} ({}), {rows} rows: {} rows differ, first row {}: emulated {:e}, CPU {:e}",
                model.name,
                if cpu.is_static() { "static" } else { "dynamic" },
                bad.len(),
                bad[0],
                got[bad[0]],
                want[bad[0]]
            );
            checked[usize::from(cpu.is_static())] += 1;
        }
    }
    // Both entries ran, on every batch of every model.
    assert_eq!(checked, [4 * BATCHES.len() - 1, 5 * BATCHES.len() - 1]);
    eprintln!(
        "RAN dense_int8 on {} and dense_int8_static on {} (model, rows) cases, bit for bit",
        checked[0], checked[1]
    );
}

/// What the FP8 backend's host side would do (nothing launches `dense_fp8`
/// yet; this is the contract of docs/KERNELS.md): per layer `s_w = max|w| /
/// 448` (1 for an all-zero layer), weights encoded `[n][k]` with
/// `e4m3::from_f32`, `s_x` the calibrated range / 448 or 1, NaN inputs read
/// as 0, one launch per layer.
fn emulated_fp8(model: &Model, x: &[f32], rows: usize) -> Vec<f32> {
    let lib = fp8_lib();
    let mut act: Vec<f32> = x.iter().map(|v| if v.is_nan() { 0.0 } else { *v }).collect();
    for (i, l) in model.layers.iter().enumerate() {
        let (k, n) = (l.in_dim, l.out_dim);
        let max_abs = l.weights_f32.iter().fold(0.0f32, |m, w| m.max(w.abs()));
        let s_w = if max_abs > 0.0 { max_abs / e4m3::MAX } else { 1.0 };
        let w8: Vec<u8> = l.weights_f32.iter().map(|w| e4m3::from_f32(w / s_w)).collect();
        let s_x = model.calibration.as_ref().map_or(1.0, |c| c.input_ranges[i] / e4m3::MAX);
        let mut y = vec![3.0e38f32; rows * n];
        let mut args = Args::default()
            .ptr(act.as_ptr())
            .int(rows as i32)
            .int(k as i32)
            .int(n as i32)
            .ptr(w8.as_ptr())
            .float(s_w)
            .float(1.0 / s_x)
            .float(s_x)
            .ptr(l.bias.as_ptr())
            .int(i32::from(l.relu))
            .ptr(y.as_mut_ptr());
        // SAFETY: dense_fp8's parameters in order; `act` holds rows × k
        // floats, `w8` n × k codes, the bias n floats, `y` rows × n; the grid
        // is the one its header states.
        unsafe { lib.launch("dense_fp8", [(n as u32).div_ceil(128), rows as u32, 1], [128, 1, 1], 0, &mut args) };
        act = y;
    }
    act
}

#[test]
fn fp8_kernel_matches_the_cpu_fp8_backend_bit_for_bit() {
    let mut cases = 0;
    for (model, model_rows_max) in check_models(1024).expect("the check models calibrate") {
        // The k = 16384 models at fewer rows: 16,384 emulated conversions per output.
        let batches: &[usize] = if model_rows_max < 1024 { &[1, 9, 33] } else { &BATCHES };
        let mut cpu = cpu::CpuFp8::new(&model, model_rows_max);
        for &rows in batches {
            let x = check_inputs(rows as u64 + 100, rows, model.input_dim());
            let mut want = vec![0.0; rows];
            cpu.score(&x, rows, &mut want).unwrap();
            let got = emulated_fp8(&model, &x, rows);
            let bad = mismatches(&got, &want);
            assert!(
                bad.is_empty(),
                "{}, {rows} rows: {} rows differ, first row {}: emulated {:e}, CPU FP8 {:e}",
                model.name,
                bad.len(),
                bad[0],
                got[bad[0]],
                want[bad[0]]
            );
            cases += 1;
        }
    }
    assert_eq!(cases, 7 * BATCHES.len() + 2 * 3);
    eprintln!("RAN dense_fp8 on {cases} (model, rows) cases, bit for bit with cpu-fp8");
}

#[test]
fn emulated_fp8_conversions_are_the_e4m3_module_s() {
    let lib = fp8_lib();
    // SAFETY: both are defined with these signatures in kernels/emulation/fp8_dense.cpp.
    let (encode, decode) = unsafe {
        (
            *lib.lib.get::<unsafe extern "C" fn(f32) -> u8>(b"quiver_emu_e4m3_from_f32").unwrap(),
            *lib.lib.get::<unsafe extern "C" fn(u8) -> f32>(b"quiver_emu_e4m3_to_f32").unwrap(),
        )
    };
    // SAFETY (both closures): plain value functions.
    let enc = |v: f32| unsafe { encode(v) };
    let dec = |c: u8| unsafe { decode(c) };
    for code in 0..=255u8 {
        let (got, want) = (dec(code), e4m3::to_f32(code));
        assert!(
            got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
            "code {code:#04x}: {got:e} vs {want:e}"
        );
    }
    // Every code's value, the midpoints between neighbours (ties) and one
    // f32 ulp either side of each, both signs; then a sweep of f32 bit
    // patterns (NaNs, infinities and subnormals among them).
    let mut values: Vec<f32> = (0..0x7Fu8).map(e4m3::to_f32).collect();
    let mids: Vec<f32> = values.windows(2).map(|w| (w[0] + w[1]) / 2.0).collect();
    for m in mids {
        values.extend([m, f32::from_bits(m.to_bits() + 1), f32::from_bits(m.to_bits() - 1)]);
    }
    values.extend([448.0, 464.0, 480.0, 1.0e6, f32::INFINITY, f32::NAN, 0.0, 2f32.powi(-10)]);
    let negated: Vec<f32> = values.iter().map(|v| -v).collect();
    values.extend(negated);
    values.extend((0..u32::MAX / 4093).map(|i| f32::from_bits(i * 4093)));
    for v in values {
        assert_eq!(enc(v), e4m3::from_f32(v), "{v:e} ({:#010x})", v.to_bits());
    }
}

#[test]
fn emulated_integer_intrinsics_follow_the_cuda_definitions() {
    let lib = int8_lib();
    // SAFETY: defined with these signatures in kernels/emulation/int8_dense.cpp.
    let (f2i, i2f, dp4a) = unsafe {
        (
            *lib.lib.get::<unsafe extern "C" fn(f32) -> i32>(b"quiver_emu_float2int_rn").unwrap(),
            *lib.lib.get::<unsafe extern "C" fn(i32) -> f32>(b"quiver_emu_int2float_rn").unwrap(),
            *lib.lib.get::<unsafe extern "C" fn(i32, i32, i32) -> i32>(b"quiver_emu_dp4a").unwrap(),
        )
    };
    // cvt.rni.s32.f32: ties to even, saturating, NaN to 0, which is Rust's
    // `round_ties_even() as i32`.
    let mut floats = vec![0.5f32, 1.5, 2.5, -0.5, -2.5, 2147483520.0, 2147483648.0, -2147483648.0, -2147483904.0];
    floats.extend([f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -f32::NAN, f32::MAX, f32::MIN_POSITIVE, -0.0]);
    floats.extend((0..u32::MAX / 65521).map(|i| f32::from_bits(i * 65521)));
    for v in floats {
        // SAFETY (this loop and the next two): plain value functions.
        assert_eq!(unsafe { f2i(v) }, v.round_ties_even() as i32, "__float2int_rn({v:e})");
    }
    for i in [0, 1, -1, 16_777_217, -16_777_219, i32::MAX, i32::MIN, 0x7FFF_FFC0, 123_456_789] {
        assert_eq!(unsafe { i2f(i) }.to_bits(), (i as f32).to_bits(), "__int2float_rn({i})");
    }
    // dp4a.s32.s32: four signed byte products added to c, wrapping.
    let mut rng = SplitMix64::new(9);
    let mut words: Vec<i32> = vec![0, -1, i32::MIN, i32::MAX, 0x8080_8080u32 as i32, 0x7F7F_7F7F];
    words.extend((0..2000).map(|_| rng.next_u64() as i32));
    for (i, &a) in words.iter().enumerate() {
        let b = words[(i * 7 + 3) % words.len()];
        let c = words[(i * 13 + 5) % words.len()];
        let bytes = |w: i32| w.to_le_bytes().map(|x| i32::from(x as i8));
        let want = bytes(a).iter().zip(bytes(b)).fold(c, |acc, (x, y)| acc.wrapping_add(x * y));
        assert_eq!(unsafe { dp4a(a, b, c) }, want, "__dp4a({a:#x}, {b:#x}, {c})");
    }
}

/// Builds `program` (a race check under `kernels/emulation/`) with the
/// kernel file's `wrapper` under ThreadSanitizer, with `kernel` as the
/// source when given; runs it and returns whether it exited 0, and its
/// stderr.
fn run_under_tsan(name: &str, wrapper: &str, program: &str, kernel: Option<&Path>) -> (bool, String) {
    let exe = scratch(name);
    compile(wrapper, kernel, &[program], &["-fsanitize=thread", "-g", "-O1"], &exe);
    let out = Command::new(&exe)
        .env("TSAN_OPTIONS", "halt_on_error=1 exitcode=66")
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", exe.display()));
    let _ = std::fs::remove_file(&exe);
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// The shipped `source` runs clean under ThreadSanitizer, and every copy
/// of it with one of its `barriers` `__syncthreads()` removed is reported
/// as a data race.
fn shipped_is_race_free_and_each_removed_barrier_is_caught(
    source: &kernels::KernelSource,
    wrapper: &str,
    program: &str,
    barriers: usize,
) {
    let stem = source.file.trim_end_matches(".cu");
    let (ok, stderr) = run_under_tsan(&format!("tsan-{stem}-shipped"), wrapper, program, None);
    assert!(ok && !stderr.contains("ThreadSanitizer"), "the shipped {} under TSan:\n{stderr}", source.file);
    let at: Vec<usize> = source.source.match_indices("__syncthreads();").map(|(i, _)| i).collect();
    assert_eq!(at.len(), barriers, "the barriers of {}", source.file);
    for (i, at) in at.iter().enumerate() {
        let mutant = format!("{}{}", &source.source[..*at], &source.source[at + "__syncthreads();".len()..]);
        let path = scratch(&format!("{stem}_without_barrier_{i}.cu"));
        std::fs::write(&path, mutant).unwrap();
        let (ok, stderr) = run_under_tsan(&format!("tsan-{stem}-mutant-{i}"), wrapper, program, Some(&path));
        let _ = std::fs::remove_file(&path);
        assert!(
            !ok && stderr.contains("WARNING: ThreadSanitizer: data race"),
            "removing __syncthreads() #{i} of {} went unreported:\n{stderr}",
            source.file
        );
    }
}

#[test]
fn thread_sanitizer_finds_no_race_in_the_int8_kernels_and_finds_a_removed_barrier() {
    // One barrier per entry of int8_dense.cu.
    shipped_is_race_free_and_each_removed_barrier_is_caught(
        &kernels::INT8_DENSE,
        "int8_dense.cpp",
        "race_check.cpp",
        2,
    );
    eprintln!("RAN ThreadSanitizer: the shipped INT8 kernels are race-free and both removed barriers are reported");
}

#[test]
fn thread_sanitizer_finds_no_race_in_the_tree_kernel_and_finds_a_removed_barrier() {
    // Before the leaves of a chunk are summed, and before they are overwritten.
    shipped_is_race_free_and_each_removed_barrier_is_caught(&kernels::TREES, "trees.cpp", "race_check_trees.cpp", 2);
    eprintln!("RAN ThreadSanitizer: the shipped tree kernel is race-free and both removed barriers are reported");
}

/// What `CudaInt8` does with a graph model, on the emulation: `plan`'s
/// parameters as host buffers (a tree ensemble's nodes 16-byte aligned, as
/// `uint4` needs), one poisoned buffer per node, and every launch of the
/// plan with its own geometry and arguments, in order. Returns the output
/// node's first `rows` values.
fn emulated_plan(plan: &GraphPlan, x: &[f32], rows: usize) -> Vec<f32> {
    assert!(rows <= plan.rows_max && x.len() == rows * plan.input_dim);
    enum Host {
        Words(Vec<u32>),
        Nodes(Vec<u128>),
        Floats(Vec<f32>),
    }
    let params: Vec<Host> = plan
        .params
        .iter()
        .map(|p| match p {
            Param::F32(v) => Host::Floats(v.clone()),
            Param::Table(t) => Host::Floats(t.to_vec()),
            Param::I32(v) => Host::Words(v.iter().map(|w| *w as u32).collect()),
            Param::U32(v) => Host::Words(v.clone()),
            Param::TreeNodes(v) => Host::Nodes(
                v.iter().map(|n| n.iter().rev().fold(0u128, |acc, w| (acc << 32) | u128::from(*w))).collect(),
            ),
        })
        .collect();
    let param_ptr = |i: usize| match &params[i] {
        Host::Words(v) => v.as_ptr() as *const c_void,
        Host::Nodes(v) => v.as_ptr() as *const c_void,
        Host::Floats(v) => v.as_ptr() as *const c_void,
    };
    let mut nodes: Vec<Vec<f32>> = plan.widths.iter().map(|w| vec![3.0e38f32; plan.rows_max * w]).collect();
    let node_ptrs: Vec<*mut f32> = nodes.iter_mut().map(|n| n.as_mut_ptr()).collect();
    for l in &plan.launches {
        let mut args = Args::default();
        for a in &l.args {
            args = match *a {
                Arg::Input => args.ptr(x.as_ptr()),
                Arg::Node(j) => args.ptr(node_ptrs[j]),
                Arg::Param(j) => args.ptr(param_ptr(j)),
                Arg::RowsTimes(m) => args.int((rows * m) as i32),
                Arg::Int(v) => args.int(v),
                Arg::Float(v) => args.float(v),
            };
        }
        let d = l.geometry.dims(rows);
        // SAFETY: the plan's arguments are the entry's parameters in order
        // (`score::gpu_layout` builds them from the kernel's signature);
        // every node buffer holds rows_max × width floats, the input rows ×
        // input_dim, each parameter what the plan packed for that launch,
        // and the geometry is the plan's for `rows` rows.
        unsafe { lib_of(l.source.file).launch(l.entry, d.grid, d.block, d.shared_bytes, &mut args) };
    }
    nodes.swap_remove(plan.output())[..rows].to_vec()
}

/// The tree fixtures of `tests/fixtures/trees` (as `tests/trees.rs` reads
/// them): each imported model and its held-out rows (NaN kept).
fn tree_fixtures() -> Vec<(Model, Vec<f32>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/trees");
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("trees.json")).unwrap()).unwrap();
    let mut out = Vec::new();
    for (name, m) in index["models"].as_object().unwrap() {
        let dim = m["dim"].as_u64().unwrap() as usize;
        let file = dir.join(m["file"].as_str().unwrap());
        let inputs = m["inputs"].as_str().unwrap();
        let kind = if m["output_kind"] == "raw" { OutputKind::Raw } else { OutputKind::Logit };
        let model = match m["format"].as_str().unwrap() {
            "onnx" => {
                let opts = ImportOptions {
                    name: name.clone(),
                    version: 1,
                    inputs: inputs.parse().unwrap(),
                    output: m["output"].as_str().map(str::to_string),
                    output_kind: kind,
                    base_dir: None,
                };
                import_file(&file, &opts).unwrap_or_else(|e| panic!("{name}: {e}")).model
            }
            format => {
                let opts =
                    GbdtOptions { name: name.clone(), version: 1, inputs: inputs.parse().unwrap(), output_kind: None };
                let imported = if format == "lightgbm" {
                    import_lightgbm_file(&file, &opts)
                } else {
                    import_xgboost_file(&file, &opts)
                };
                imported.unwrap_or_else(|e| panic!("{name}: {e}")).model
            }
        };
        let t = quiver::model::calibrate::read_npy(&dir.join(m["data"].as_str().unwrap())).unwrap();
        let x: Vec<f32> = t.data.chunks_exact(t.cols).flat_map(|row| row[..dim].to_vec()).collect();
        out.push((model, x));
    }
    assert_eq!(out.len(), 11, "eleven tree fixtures");
    out
}

/// `x`'s rows, then each again with three values replaced by a split
/// rule's edge cases: NaN, ±0, values zero-as-missing reads as missing
/// (±1e-36), just above (1e-30), negative categories (-0.5 truncates to
/// category 0, -1 names none), categories past a bitset, and infinities.
fn with_edge_rows(x: &[f32], dim: usize, seed: u64) -> Vec<f32> {
    const EDGES: [f32; 12] =
        [f32::NAN, 0.0, -0.0, 1e-36, -1e-36, 1e-30, -0.5, -1.0, 1e9, 31.0, f32::INFINITY, f32::NEG_INFINITY];
    let mut rng = SplitMix64::new(seed);
    let mut out = x.to_vec();
    for row in x.chunks_exact(dim) {
        let mut row = row.to_vec();
        for _ in 0..3 {
            row[rng.below(dim as u64) as usize] = EDGES[rng.below(EDGES.len() as u64) as usize];
        }
        out.extend(row);
    }
    out
}

/// Rows per call, in turn: one, ragged tails of the 32-row tree blocks and
/// of the 128-thread node blocks, and a full batch.
const GRAPH_BATCHES: [usize; 5] = [1, 33, 127, 200, 256];

/// Runs `model` through both plans (f32 and INT8 dense layers) on the
/// emulation against the CPU f32 backend and the CPU INT8 backend's scalar
/// reference, bit for bit, over `x`'s rows in calls of `GRAPH_BATCHES` rows.
/// Returns the rows compared.
fn check_graph_model(model: &Arc<Model>, x: &[f32]) -> usize {
    let dim = model.input_dim();
    let rows_max = *GRAPH_BATCHES.iter().max().unwrap();
    let mut cpu_f32 = cpu::CpuF32::new(model, rows_max);
    let mut cpu_int8 = cpu::CpuInt8::with_kernel(model, rows_max, cpu::Int8Kernel::Scalar).unwrap();
    let graph = model.graph.as_ref().unwrap();
    let plans = [Precision::F32, Precision::Int8]
        .map(|p| GraphPlan::new(graph, dim, p, rows_max).unwrap_or_else(|e| panic!("{}: {e}", model.name)));
    let total = x.len() / dim;
    let mut at = 0;
    for &rows in GRAPH_BATCHES.iter().cycle() {
        if at >= total {
            break;
        }
        let rows = rows.min(total - at);
        let chunk = &x[at * dim..(at + rows) * dim];
        for (plan, cpu) in plans.iter().zip([&mut cpu_f32 as &mut dyn Backend, &mut cpu_int8]) {
            let mut want = vec![0.0; rows];
            cpu.score(chunk, rows, &mut want).unwrap();
            let got = emulated_plan(plan, chunk, rows);
            let bad = mismatches(&got, &want);
            assert!(
                bad.is_empty(),
                "{} ({:?} plan), rows {at}..{}: {} rows differ, first row {}: emulated {:e}, CPU {} {:e}",
                model.name,
                plan.precision,
                at + rows,
                bad.len(),
                at + bad[0],
                got[bad[0]],
                cpu.name(),
                want[bad[0]]
            );
        }
        at += rows;
    }
    total
}

#[test]
fn tree_kernel_matches_the_cpu_evaluator_bit_for_bit_on_every_tree_fixture() {
    let mut rows = 0;
    let mut trees = Vec::new();
    for (model, x) in tree_fixtures() {
        let dim = model.input_dim();
        // 512 held-out rows (NaN kept), then each again with edge cases.
        let x = with_edge_rows(&x[..512 * dim], dim, 5);
        let model = Arc::new(model);
        rows += check_graph_model(&model, &x);
        // The kernel's sum is the specification's, not only the evaluator's.
        let graph = model.graph.as_ref().unwrap();
        let e = graph.nodes.iter().find_map(|n| if let Op::Trees(e) = &n.op { Some(e) } else { None }).unwrap();
        trees.push(format!("{} ({} trees)", model.name, e.trees()));
        if let [input, _] = &graph.nodes[..] {
            let Op::Input { offset } = input.op else { panic!("{}: a tree model reads its input", model.name) };
            let plan = GraphPlan::new(graph, dim, Precision::F32, 256).unwrap();
            let got = emulated_plan(&plan, &x[512 * dim..768 * dim], 256);
            for (r, g) in got.iter().enumerate() {
                let row = &x[(512 + r) * dim..(513 + r) * dim];
                let want = e.predict_row(&row[offset..]);
                assert_eq!(g.to_bits(), want.to_bits(), "{} row {r}: {g:e} vs predict_row {want:e}", model.name);
            }
        }
    }
    for (model, rows_max) in check_graph_models(256) {
        if model.name == "check-trees" {
            rows += check_graph_model(&model, &check_graph_inputs(&model, 3, rows_max));
        }
    }
    eprintln!("RAN trees_predict on {rows} rows of the 11 tree fixtures and check-trees, bit for bit: {trees:?}");
}

#[test]
fn graph_kernels_match_the_cpu_executors_bit_for_bit_on_every_zoo_model() {
    let mut names = Vec::new();
    for z in zoo::zoo() {
        let model = Arc::new(import_file(&z.file, &z.import_options()).unwrap().model);
        // 256 held-out rows, then each again with edge cases.
        let x = with_edge_rows(&z.x[..256 * z.dim], z.dim, 7);
        if model.graph.is_some() {
            check_graph_model(&model, &x);
            names.push(z.name.clone());
        } else {
            // A plain ReLU MLP: the INT8 layers the backend runs for it.
            let mut cpu = cpu::CpuInt8::with_kernel(&model, 256, cpu::Int8Kernel::Scalar).unwrap();
            let mut want = vec![0.0; 256];
            cpu.score(&x[..256 * z.dim], 256, &mut want).unwrap();
            let got = emulated_int8(&model, &x[..256 * z.dim], 256);
            assert!(mismatches(&got, &want).is_empty(), "{}: dense_int8 differs from the CPU", z.name);
        }
    }
    let mut kinds = Vec::new();
    for (model, rows_max) in check_graph_models(256) {
        check_graph_model(&model, &check_graph_inputs(&model, 4, rows_max));
        kinds.push(model.name.clone());
    }
    assert!(names.len() >= 10, "the zoo's graph models: {names:?}");
    eprintln!("RAN the graph kernels on the zoo's graph models {names:?} and {kinds:?}, bit for bit (f32 and INT8)");
}

/// Every activation, value by value, over a sweep that includes the
/// clamps of `exp` (±87, 88), signed zeros, infinities and the extremes,
/// against the CPU executor (a model of one Act node over one input).
#[test]
fn emulated_activations_are_the_cpu_executor_s() {
    use quiver::model::graph::{Act, Graph, Node};
    use quiver::model::{InputSegment, Source};
    let mut xs: Vec<f32> = (-40 * 64..=40 * 64).map(|i| i as f32 / 64.0).collect();
    xs.extend([
        87.0,
        87.5,
        88.0,
        88.5,
        -87.0,
        -87.5,
        -88.0,
        1e-30,
        -1e-30,
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
    ]);
    xs.extend([f32::MAX, f32::MIN, f32::MIN_POSITIVE, 1e10, -1e10, 0.044715, 0.7978846]);
    let rows = xs.len();
    let acts = [
        Act::Relu,
        Act::LeakyRelu(0.01),
        Act::Tanh,
        Act::Sigmoid,
        Act::GeluErf,
        Act::GeluTanh,
        Act::Silu,
        Act::Erf,
        Act::Sqrt,
    ];
    for act in acts {
        let model = Arc::new(Model {
            name: format!("act-{}", act.name()),
            version: 1,
            inputs: vec![InputSegment { source: Source::Context, dim: 1 }],
            layers: Vec::new(),
            calibration: None,
            graph: Some(Graph {
                nodes: vec![
                    Node { op: Op::Input { offset: 0 }, inputs: vec![], width: 1 },
                    Node { op: Op::Act(act), inputs: vec![0], width: 1 },
                ],
                output: OutputKind::Raw,
            }),
            onnx: None,
            feature_names: Vec::new(),
        });
        model.validate().unwrap();
        let plan = GraphPlan::new(model.graph.as_ref().unwrap(), 1, Precision::F32, rows).unwrap();
        let mut cpu = cpu::CpuF32::new(&model, rows);
        let mut want = vec![0.0; rows];
        cpu.score(&xs, rows, &mut want).unwrap();
        let got = emulated_plan(&plan, &xs, rows);
        let bad = mismatches(&got, &want);
        assert!(
            bad.is_empty(),
            "{}: {} values differ, first {:e}: emulated {:e}, CPU {:e}",
            act.name(),
            bad.len(),
            xs[bad[0]],
            got[bad[0]],
            want[bad[0]]
        );
    }
}
