//! Compile-checks every CUDA kernel with NVRTC, without a GPU.
//!
//! NVRTC and the CUDA headers come from the PyPI wheels
//! `nvidia-cuda-nvrtc-cu12` and `nvidia-cuda-runtime-cu12` (pinned in
//! `.ci/run`). NVRTC is loaded here with `libloading` rather than through
//! cudarc so that this runs in the default test run, feature `cuda` or not.
//! Each kernel is compiled to CUBIN for real targets (sm_89, sm_90) with
//! `--ptxas-options=-v`, and ptxas's report must show no spills and a modest
//! register count for every entry point. A missing NVRTC skips loudly, or
//! fails when `QUIVER_REQUIRE_NVRTC=1` (CI).
//!
//! Where things are found: `QUIVER_NVRTC_LIB` (path to `libnvrtc.so.12`) and
//! `QUIVER_CUDA_INCLUDE` (a directory holding `cuda_fp8.h`), else the wheels'
//! locations under python3's site-packages.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::PathBuf;
use std::process::Command;

use libloading::Library;
use quiver::score::kernels::{self, KernelSource};

/// The real targets checked: Ada (L4, L40S) and Hopper (H100, H200).
const ARCHS: [&str; 2] = ["sm_89", "sm_90"];
/// A kernel needing more registers than this per thread halves occupancy at
/// 128-thread blocks well before shared memory does; treat it as a regression.
const REGISTERS_MAX: u32 = 64;

type Program = *mut c_void;

struct Nvrtc {
    _lib: Library,
    version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int,
    create: unsafe extern "C" fn(
        *mut Program,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> c_int,
    compile: unsafe extern "C" fn(Program, c_int, *const *const c_char) -> c_int,
    log_size: unsafe extern "C" fn(Program, *mut usize) -> c_int,
    log: unsafe extern "C" fn(Program, *mut c_char) -> c_int,
    cubin_size: unsafe extern "C" fn(Program, *mut usize) -> c_int,
    cubin: unsafe extern "C" fn(Program, *mut c_char) -> c_int,
    destroy: unsafe extern "C" fn(*mut Program) -> c_int,
    error_string: unsafe extern "C" fn(c_int) -> *const c_char,
}

/// A finished compilation: NVRTC's result code, its log, and the CUBIN on
/// success.
struct Compiled {
    code: c_int,
    log: String,
    cubin: Vec<u8>,
}

fn site_packages() -> Option<PathBuf> {
    let out =
        Command::new("python3").args(["-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).output().ok()?;
    out.status.success().then(|| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

fn nvrtc_lib_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("QUIVER_NVRTC_LIB") {
        return Some(PathBuf::from(p));
    }
    Some(site_packages()?.join("nvidia/cuda_nvrtc/lib/libnvrtc.so.12")).filter(|p| p.exists())
}

fn cuda_include_dir() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("QUIVER_CUDA_INCLUDE") {
        return Some(PathBuf::from(p));
    }
    Some(site_packages()?.join("nvidia/cuda_runtime/include")).filter(|p| p.join("cuda_fp8.h").exists())
}

fn required() -> bool {
    std::env::var("QUIVER_REQUIRE_NVRTC").is_ok_and(|v| v == "1")
}

/// Skips (prints why, returns `None`) or, under `QUIVER_REQUIRE_NVRTC=1`,
/// fails.
fn unavailable<T>(why: String) -> Option<T> {
    assert!(!required(), "QUIVER_REQUIRE_NVRTC=1 but {why}");
    eprintln!("SKIPPED nvrtc kernel checks: {why} (pip install nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12)");
    None
}

impl Nvrtc {
    fn load() -> Option<Nvrtc> {
        let Some(path) = nvrtc_lib_path() else {
            return unavailable("libnvrtc.so.12 not found (QUIVER_NVRTC_LIB unset, no wheel)".into());
        };
        // SAFETY: loading NVRTC runs only its ELF initialisers, which have
        // no preconditions.
        let lib = match unsafe { Library::new(&path) } {
            Ok(lib) => lib,
            Err(e) => return unavailable(format!("cannot load {}: {e}", path.display())),
        };
        // SAFETY: each symbol is looked up with the signature nvrtc.h
        // declares for it (every result is `nvrtcResult`, a C int enum).
        unsafe {
            Some(Nvrtc {
                version: *lib.get(b"nvrtcVersion").ok()?,
                create: *lib.get(b"nvrtcCreateProgram").ok()?,
                compile: *lib.get(b"nvrtcCompileProgram").ok()?,
                log_size: *lib.get(b"nvrtcGetProgramLogSize").ok()?,
                log: *lib.get(b"nvrtcGetProgramLog").ok()?,
                cubin_size: *lib.get(b"nvrtcGetCUBINSize").ok()?,
                cubin: *lib.get(b"nvrtcGetCUBIN").ok()?,
                destroy: *lib.get(b"nvrtcDestroyProgram").ok()?,
                error_string: *lib.get(b"nvrtcGetErrorString").ok()?,
                _lib: lib,
            })
        }
    }

    fn version(&self) -> (i32, i32) {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: both pointers are valid for one write.
        let code = unsafe { (self.version)(&mut major, &mut minor) };
        assert_eq!(code, 0, "nvrtcVersion");
        (major, minor)
    }

    fn error(&self, code: c_int) -> String {
        // SAFETY: nvrtcGetErrorString returns a static C string for any code.
        unsafe { CStr::from_ptr((self.error_string)(code)) }.to_string_lossy().into_owned()
    }

    fn compile(&self, name: &str, source: &str, options: &[String]) -> Compiled {
        let src = CString::new(source).unwrap();
        let name = CString::new(name).unwrap();
        let opts: Vec<CString> = options.iter().map(|o| CString::new(o.as_str()).unwrap()).collect();
        let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
        let mut prog: Program = std::ptr::null_mut();
        // SAFETY: `src`, `name` and the option strings outlive the program;
        // no headers are passed in memory (null arrays with count 0); every
        // out-pointer is valid and buffers are sized from NVRTC's own size
        // queries; the program is destroyed exactly once.
        unsafe {
            let code = (self.create)(&mut prog, src.as_ptr(), name.as_ptr(), 0, std::ptr::null(), std::ptr::null());
            assert_eq!(code, 0, "nvrtcCreateProgram: {}", self.error(code));
            let code = (self.compile)(prog, opt_ptrs.len() as c_int, opt_ptrs.as_ptr());
            let mut n = 0usize;
            assert_eq!((self.log_size)(prog, &mut n), 0);
            let mut log = vec![0u8; n.max(1)];
            assert_eq!((self.log)(prog, log.as_mut_ptr().cast()), 0);
            let log = CStr::from_bytes_until_nul(&log).map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
            let mut cubin = Vec::new();
            if code == 0 {
                assert_eq!((self.cubin_size)(prog, &mut n), 0);
                cubin = vec![0u8; n];
                assert_eq!((self.cubin)(prog, cubin.as_mut_ptr().cast()), 0);
            }
            assert_eq!((self.destroy)(&mut prog), 0);
            Compiled { code, log, cubin }
        }
    }
}

/// What ptxas reported for one entry point.
#[derive(Debug, Default)]
struct EntryReport {
    registers: Option<u32>,
    stack_bytes: Option<u32>,
    spill_store_bytes: Option<u32>,
    spill_load_bytes: Option<u32>,
}

/// The number just before `unit` in `line` ("31 registers" → 31).
fn number_before(line: &str, unit: &str) -> Option<u32> {
    let head = &line[..line.find(unit)?];
    head.trim_end().rsplit(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
}

/// Splits a `-v` ptxas log into per-entry reports. The log names the entry
/// ("Compiling entry function 'f' for 'sm_90'"), then gives its stack and
/// spill line and its register line.
fn parse_ptxas_log(log: &str) -> Vec<(String, EntryReport)> {
    let mut out: Vec<(String, EntryReport)> = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default().to_string();
            out.push((name, EntryReport::default()));
            continue;
        }
        let Some((_, r)) = out.last_mut() else { continue };
        if line.contains("spill stores") {
            r.stack_bytes = number_before(line, "bytes stack frame");
            r.spill_store_bytes = number_before(line, "bytes spill stores");
            r.spill_load_bytes = number_before(line, "bytes spill loads");
        } else if line.contains("Used ") && line.contains(" registers") {
            r.registers = number_before(line, " registers");
        }
    }
    out
}

fn options(arch: &str, kernel: &KernelSource) -> Option<Vec<String>> {
    let mut opts = vec![format!("--gpu-architecture={arch}"), "--ptxas-options=-v".to_string()];
    if kernel.needs_cuda_headers {
        let Some(dir) = cuda_include_dir() else {
            return unavailable(
                "no CUDA include directory with cuda_fp8.h (QUIVER_CUDA_INCLUDE unset, no wheel)".into(),
            );
        };
        opts.push(format!("--include-path={}", dir.display()));
    }
    Some(opts)
}

#[test]
fn every_kernel_compiles_for_sm89_and_sm90_without_spills() {
    let Some(nvrtc) = Nvrtc::load() else { return };
    let (major, minor) = nvrtc.version();
    eprintln!("nvrtc {major}.{minor}");
    for kernel in kernels::ALL {
        for arch in ARCHS {
            let Some(opts) = options(arch, &kernel) else { return };
            let c = nvrtc.compile(kernel.file, kernel.source, &opts);
            assert_eq!(c.code, 0, "{} for {arch}: {}\n{}", kernel.file, nvrtc.error(c.code), c.log);
            assert!(c.cubin.starts_with(b"\x7fELF"), "{} for {arch}: NVRTC returned no CUBIN", kernel.file);
            let reports = parse_ptxas_log(&c.log);
            for entry in kernel.entries {
                let Some((_, r)) = reports.iter().find(|(n, _)| n == entry) else {
                    panic!("{} for {arch}: no ptxas report for {entry} in:\n{}", kernel.file, c.log);
                };
                eprintln!(
                    "{arch} {entry}: {} registers, {} bytes stack, {} bytes spill stores, {} bytes spill loads",
                    r.registers.unwrap_or(0),
                    r.stack_bytes.unwrap_or(0),
                    r.spill_store_bytes.unwrap_or(0),
                    r.spill_load_bytes.unwrap_or(0)
                );
                assert_eq!(r.spill_store_bytes, Some(0), "{arch} {entry} spills:\n{}", c.log);
                assert_eq!(r.spill_load_bytes, Some(0), "{arch} {entry} spills:\n{}", c.log);
                let regs = r.registers.unwrap_or_else(|| panic!("{arch} {entry}: no register count:\n{}", c.log));
                assert!(regs <= REGISTERS_MAX, "{arch} {entry}: {regs} registers > {REGISTERS_MAX}");
            }
        }
    }
}

/// The static INT8 entry is what `--backend cuda` launches for calibrated
/// models: compile it with the float options the backend passes
/// (`src/score/cuda.rs`), on which its bit-exactness relies, and hold it to
/// the same spill and register limits as every entry.
#[test]
fn the_static_int8_kernel_compiles_with_the_backends_options_without_spills() {
    let kernel = kernels::INT8_DENSE;
    assert!(kernel.entries.contains(&"dense_int8_static"), "int8_dense.cu must export dense_int8_static");
    let Some(nvrtc) = Nvrtc::load() else { return };
    for arch in ARCHS {
        let Some(mut opts) = options(arch, &kernel) else { return };
        opts.extend(["--ftz=false", "--prec-div=true"].map(String::from));
        let c = nvrtc.compile(kernel.file, kernel.source, &opts);
        assert_eq!(c.code, 0, "{} for {arch}: {}\n{}", kernel.file, nvrtc.error(c.code), c.log);
        let reports = parse_ptxas_log(&c.log);
        let Some((_, r)) = reports.iter().find(|(n, _)| n == "dense_int8_static") else {
            panic!("{arch}: no ptxas report for dense_int8_static in:\n{}", c.log);
        };
        assert_eq!((r.spill_store_bytes, r.spill_load_bytes), (Some(0), Some(0)), "{arch} spills:\n{}", c.log);
        assert!(r.registers.is_some_and(|n| n <= REGISTERS_MAX), "{arch}: {:?} registers", r.registers);
    }
}

/// The graph and tree kernels are what `--backend cuda` launches for graph
/// models: compile them with the backend's float options, every entry held
/// to the same spill and register limits.
#[test]
fn the_graph_and_tree_kernels_compile_with_the_backends_options_without_spills() {
    let Some(nvrtc) = Nvrtc::load() else { return };
    for kernel in [kernels::TREES, kernels::GRAPH_NODES] {
        for arch in ARCHS {
            let Some(mut opts) = options(arch, &kernel) else { return };
            opts.extend(["--ftz=false", "--prec-div=true"].map(String::from));
            let c = nvrtc.compile(kernel.file, kernel.source, &opts);
            assert_eq!(c.code, 0, "{} for {arch}: {}\n{}", kernel.file, nvrtc.error(c.code), c.log);
            let reports = parse_ptxas_log(&c.log);
            for entry in kernel.entries {
                let Some((_, r)) = reports.iter().find(|(n, _)| n == entry) else {
                    panic!("{arch}: no ptxas report for {entry} in:\n{}", c.log);
                };
                assert_eq!((r.spill_store_bytes, r.spill_load_bytes), (Some(0), Some(0)), "{arch} {entry}:\n{}", c.log);
                assert!(r.registers.is_some_and(|n| n <= REGISTERS_MAX), "{arch} {entry}: {:?} registers", r.registers);
            }
        }
    }
    eprintln!("RAN NVRTC on trees.cu and graph_nodes.cu with the backend's options for {ARCHS:?}");
}

#[test]
fn a_broken_kernel_is_reported_as_a_compile_error() {
    let Some(nvrtc) = Nvrtc::load() else { return };
    let broken = kernels::INT8_DENSE.source.replacen("acc[r] = 0;", "acc[r] = undeclared_name;", 1);
    assert_ne!(broken, kernels::INT8_DENSE.source, "the mutation did not apply");
    let c = nvrtc.compile("broken.cu", &broken, &["--gpu-architecture=sm_90".to_string()]);
    assert_ne!(c.code, 0, "a kernel with an undeclared identifier compiled");
    assert!(c.log.contains("undeclared_name"), "the log does not name the error:\n{}", c.log);
    assert!(c.cubin.is_empty());
}

#[test]
fn a_spilling_kernel_is_caught_by_the_log_parser() {
    let Some(nvrtc) = Nvrtc::load() else { return };
    // A large local array indexed at run time must live in local memory;
    // capping registers forces ptxas to spill around it.
    let src = r#"extern "C" __global__ void spill(const int* in, int* out, int n) {
        float v[64];
        #pragma unroll
        for (int i = 0; i < 64; ++i) v[i] = in[i * n + threadIdx.x] * 1.5f;
        float s = 0.0f;
        #pragma unroll
        for (int i = 0; i < 64; ++i) s += v[i] * v[63 - i] + v[(i * 7) % 64];
        out[threadIdx.x] = (int)s;
    }"#;
    let opts = ["--gpu-architecture=sm_90", "--ptxas-options=-v", "--maxrregcount=16"].map(String::from);
    let c = nvrtc.compile("spill.cu", src, &opts);
    assert_eq!(c.code, 0, "{}", c.log);
    let reports = parse_ptxas_log(&c.log);
    let (_, r) = reports.iter().find(|(n, _)| n == "spill").expect("a report for the entry");
    assert!(
        r.spill_store_bytes.unwrap_or(0) > 0 || r.spill_load_bytes.unwrap_or(0) > 0,
        "expected spills at 16 registers:\n{}",
        c.log
    );
}

#[test]
fn the_ptxas_log_parser_reads_the_numbers() {
    let log = "ptxas info    : 0 bytes gmem\n\
        ptxas info    : Compiling entry function 'dense_int8' for 'sm_90'\n\
        ptxas info    : Function properties for dense_int8\n\
        ptxas         .     8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n\
        ptxas info    : Used 31 registers, used 1 barriers, 32 bytes smem\n";
    let reports = parse_ptxas_log(log);
    assert_eq!(reports.len(), 1);
    let (name, r) = &reports[0];
    assert_eq!(name, "dense_int8");
    assert_eq!((r.registers, r.stack_bytes), (Some(31), Some(8)));
    assert_eq!((r.spill_store_bytes, r.spill_load_bytes), (Some(4), Some(12)));
}
