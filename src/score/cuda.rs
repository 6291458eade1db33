//! The CUDA INT8 backend (cargo feature `cuda`): the CPU INT8 semantics,
//! static for calibrated models and dynamic otherwise, designed to match
//! the CPU bit for bit on the first GPU (not yet verified on one).
//!
//! The only module that touches cudarc, so that everything GPU-specific, and
//! every `unsafe` call into the driver, is in one file. The driver
//! (`libcuda.so`) and NVRTC are loaded at run time: a binary built with the
//! feature runs on a machine without either, and [`CudaInt8::new`] says why
//! it cannot start (typed [`CudaError`]) instead of panicking, which is what
//! cudarc does when a library is missing, so it is asked first
//! (`is_culib_present`). `score::build` turns that error into a fallback to
//! the CPU INT8 backend.
//!
//! Construction compiles `kernels/int8_dense.cu` with NVRTC to a CUBIN for
//! the device's exact compute capability, uploads every layer's weights
//! (repacked for the kernels) once with the epilogue constants of the
//! model's semantics: weight scales and float biases for `dense_int8`
//! (dynamic), or `Model::static_int8`'s `bias_q` and requantization scales
//! for `dense_int8_static` (static; the same host function the CPU kernels
//! take them from, so the two cannot disagree), and allocates pinned host
//! buffers and device activations (f32, or int8 between static layers) for
//! `rows_max` rows. A `score` call is then: copy the rows into pinned
//! memory, one async H2D copy, one launch per layer, one async D2H copy of
//! the logits, one stream synchronisation. No device or pinned memory is
//! allocated per call; cudarc's launch builder still keeps its argument
//! list in a small heap vector per launch (one per layer).
//!
//! A graph model (file v2, tree ensembles included) runs as the fixed list
//! of launches `score::gpu_layout::GraphPlan` makes of it: INT8 dense
//! layers (`dense_int8`, dynamic per-row scales, as the CPU INT8 backend
//! runs a graph), every other node on `kernels/graph_nodes.cu` and tree
//! ensembles on `kernels/trees.cu`, in the CPU graph executor's arithmetic,
//! so it is designed to give the CPU INT8 backend's numbers bit for bit
//! (run on the CPU emulation by `tests/cuda_emulation.rs`; not yet verified
//! on a GPU). Each kernel file the plan uses is compiled at construction,
//! the plan's parameters are uploaded once and every node gets a
//! `rows_max`-row device buffer; a call copies the input rows in (NaN
//! kept: trees read missing values, Input nodes map them to 0), replays
//! the launches and copies the last node's values out. A graph the kernels
//! cannot hold is refused with `CudaError::GraphPlan` before any driver
//! call, and `score::build` serves it on the CPU.
//!
//! If the device fails after start-up (an Xid, a reset), the backend logs
//! the error once and scores on a CPU INT8 backend from then on, so a request
//! never sees a panic from the GPU.

use std::ffi::{c_char, CStr, CString};
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{
    sys, CudaContext, CudaFunction, CudaSlice, CudaStream, DriverError, LaunchConfig, PinnedHostSlice, PushKernelArg,
};
use cudarc::nvrtc;

use super::gpu_cases;
use super::gpu_layout::{Arg, GraphPlan, Param, Precision};
use super::kernels::{self, DENSE_THREADS};
use super::{cpu, Backend, BackendError, BackendInfo};
use crate::model::Model;

/// Why the CUDA backend cannot run here.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("the CUDA driver library (libcuda.so / libcuda.so.1) is not installed or not on the loader path")]
    NoDriver,
    #[error("the CUDA driver reports no CUDA device")]
    NoDevice,
    #[error(
        "the CUDA driver is version {}.{}; this build uses the CUDA {}.{} driver API and needs that driver or newer",
        .found / 1000, (.found % 1000) / 10, DRIVER_VERSION_MIN / 1000, (DRIVER_VERSION_MIN % 1000) / 10
    )]
    DriverTooOld { found: i32 },
    #[error("the NVRTC library (libnvrtc.so.12) is not installed or not on the loader path")]
    NoNvrtc,
    #[error("device 0 has compute capability {major}.{minor}; the INT8 kernel needs 6.1 or newer (__dp4a)")]
    Unsupported { major: i32, minor: i32 },
    #[error("CUDA driver call failed during {during}: {source}")]
    Driver {
        during: &'static str,
        #[source]
        source: DriverError,
    },
    #[error("NVRTC failed on {file} for {arch} ({what}): {log}")]
    Compile { file: &'static str, arch: String, what: String, log: String },
    #[error("the model does not fit the INT8 kernel: {0}")]
    Model(String),
    #[error("graph model '{model}' does not fit the graph kernels: {why}")]
    GraphPlan { model: String, why: String },
}

impl CudaError {
    /// No usable GPU (or none for this model) here: an expected operating
    /// condition, not a fault.
    pub fn is_absent(&self) -> bool {
        matches!(
            self,
            CudaError::NoDriver
                | CudaError::NoDevice
                | CudaError::NoNvrtc
                | CudaError::Unsupported { .. }
                | CudaError::DriverTooOld { .. }
        )
    }
}

fn driver(during: &'static str) -> impl FnOnce(DriverError) -> CudaError {
    move |source| {
        if source.0 == sys::CUresult::CUDA_ERROR_NO_DEVICE {
            CudaError::NoDevice
        } else {
            CudaError::Driver { during, source }
        }
    }
}

/// What the driver and NVRTC report about this machine.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DeviceInfo {
    /// `cuDriverGetVersion`, e.g. 12080 for 12.8.
    pub driver_version: i32,
    pub nvrtc_version: (i32, i32),
    pub device_count: i32,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub total_memory_bytes: usize,
}

/// Finds the driver, a device and NVRTC; opens device 0's primary context.
/// The driver API version this build is compiled against (cudarc's
/// `cuda-12040` feature). cudarc's loader panics when a driver lacks one of
/// the symbols it calls, so an older driver is refused before any other call.
const DRIVER_VERSION_MIN: i32 = 12_040;

fn open() -> Result<(Arc<CudaContext>, DeviceInfo), CudaError> {
    // SAFETY: only tries to dlopen the driver library under its usual names.
    if !unsafe { sys::is_culib_present() } {
        return Err(CudaError::NoDriver);
    }
    let mut driver_version = 0;
    // SAFETY: the driver library is loaded (checked above); cuDriverGetVersion
    // exists in every driver since CUDA 2.2 and needs no cuInit; the pointer
    // is valid for one write.
    unsafe { sys::cuDriverGetVersion(&mut driver_version) }.result().map_err(driver("cuDriverGetVersion"))?;
    if driver_version < DRIVER_VERSION_MIN {
        return Err(CudaError::DriverTooOld { found: driver_version });
    }
    let device_count = CudaContext::device_count().map_err(driver("cuInit / cuDeviceGetCount"))?;
    if device_count < 1 {
        return Err(CudaError::NoDevice);
    }
    let ctx = CudaContext::new(0).map_err(driver("creating the context on device 0"))?;
    let (major, minor) = ctx.compute_capability().map_err(driver("cuDeviceGetAttribute"))?;
    // SAFETY: only tries to dlopen NVRTC under its usual names.
    if !unsafe { nvrtc::sys::is_culib_present() } {
        return Err(CudaError::NoNvrtc);
    }
    let (mut nv_major, mut nv_minor) = (0, 0);
    // SAFETY: NVRTC is loaded (checked above); both pointers are valid.
    unsafe { nvrtc::sys::nvrtcVersion(&mut nv_major, &mut nv_minor) }.result().map_err(|e| CudaError::Compile {
        file: "-",
        arch: "-".into(),
        what: format!("nvrtcVersion: {e:?}"),
        log: String::new(),
    })?;
    let info = DeviceInfo {
        driver_version,
        nvrtc_version: (nv_major, nv_minor),
        device_count,
        name: ctx.name().map_err(driver("cuDeviceGetName"))?,
        compute_capability: (major, minor),
        total_memory_bytes: ctx.total_mem().map_err(driver("cuDeviceTotalMem"))?,
    };
    Ok((ctx, info))
}

/// Probes the machine without building a backend.
pub fn probe() -> Result<DeviceInfo, CudaError> {
    open().map(|(_, info)| info)
}

/// Compiles `kernel` with NVRTC to a CUBIN for `arch` (`sm_XY`).
fn compile_cubin(kernel: &kernels::KernelSource, arch: &str) -> Result<Vec<u8>, CudaError> {
    let fail = |what: String, log: String| CudaError::Compile { file: kernel.file, arch: arch.into(), what, log };
    let src = CString::new(kernel.source).map_err(|e| fail(e.to_string(), String::new()))?;
    let name = CString::new(kernel.file).map_err(|e| fail(e.to_string(), String::new()))?;
    let prog = nvrtc::result::create_program(&src, Some(&name)).map_err(|e| fail(format!("{e:?}"), String::new()))?;
    // Default NVRTC float semantics are what the kernel's bit-exactness
    // relies on (no flush to zero, IEEE division); say so explicitly.
    let options = [format!("--gpu-architecture={arch}"), "--ftz=false".into(), "--prec-div=true".into()];
    // SAFETY: `prog` is live until the `destroy_program` below; buffers for
    // the CUBIN are sized by NVRTC's own size query.
    let result = unsafe {
        match nvrtc::result::compile_program(prog, &options) {
            Err(e) => {
                let log = nvrtc::result::get_program_log(prog)
                    .map(|l| CStr::from_ptr(l.as_ptr()).to_string_lossy().into_owned())
                    .unwrap_or_default();
                Err(fail(format!("{e:?}"), log))
            }
            Ok(()) => {
                let mut size = 0usize;
                nvrtc::sys::nvrtcGetCUBINSize(prog, &mut size)
                    .result()
                    .and_then(|()| {
                        let mut cubin = vec![0u8; size];
                        nvrtc::sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut c_char).result().map(|()| cubin)
                    })
                    .map_err(|e| fail(format!("nvrtcGetCUBIN: {e:?}"), String::new()))
            }
        }
    };
    // SAFETY: `prog` came from `create_program` and is destroyed once.
    let _ = unsafe { nvrtc::result::destroy_program(prog) };
    result
}

/// One layer on the device, packed for `dense_int8` or `dense_int8_static`.
struct DeviceLayer {
    k: i32,
    k4: i32,
    n: i32,
    rows_per_block: usize,
    /// `[k4 / 4][n]` words, four consecutive k per word (byte 0 = lowest k).
    weights: CudaSlice<i32>,
    epilogue: Epilogue,
}

/// A layer's epilogue constants, in the model's activation semantics.
enum Epilogue {
    /// `dense_int8`: `acc · (s_w[o] · s_x) + bias[o]`, then ReLU.
    Dynamic { scales: CudaSlice<f32>, bias: CudaSlice<f32>, relu: i32 },
    /// `dense_int8_static`, with `model::StaticInt8Layer`'s constants and
    /// layer 0's `f32(1 / s_in)` (rounded once on the host exactly as the
    /// CPU backend does; only read by the launch of layer 0).
    Static { bias_q: CudaSlice<i32>, scale: CudaSlice<f32>, requantize: i32, lo: i32, inv_s_in: f32 },
}

/// What runs a call: the fused INT8 layers of a plain MLP (file v1), or a
/// graph model's plan.
enum Engine {
    Layers(DeviceMlp),
    Graph(DeviceGraph),
}

/// A plain MLP's layers on the device.
struct DeviceMlp {
    /// `dense_int8` for an uncalibrated model, `dense_int8_static` for a
    /// calibrated one.
    function: CudaFunction,
    /// Whether the model is calibrated, so the static semantics run.
    is_static: bool,
    layers: Vec<DeviceLayer>,
    /// Dynamic: ping-pong f32 activations, `rows_max × width_max` each.
    /// Static: `act_a` holds the output layer's logits, `act_b` is unused.
    act_a: CudaSlice<f32>,
    act_b: CudaSlice<f32>,
    /// Static: ping-pong int8 activations between layers, `rows_max ×
    /// width_max` bytes each; unused (one byte) for the dynamic semantics.
    act_q_a: CudaSlice<i8>,
    act_q_b: CudaSlice<i8>,
}

/// A graph model on the device (`gpu_layout::GraphPlan`, INT8 dense
/// layers): its parameters uploaded once, one buffer per node, and the
/// function of every launch, replayed in order on each call.
struct DeviceGraph {
    plan: GraphPlan,
    functions: Vec<CudaFunction>,
    params: Vec<DeviceParam>,
    /// Node `i`'s `[rows_max][width]` output.
    nodes: Vec<CudaSlice<f32>>,
    /// Each launch's `int` and `float` arguments, by argument position,
    /// rewritten on each call (the row count changes) in buffers allocated
    /// here, so a call allocates none of its own.
    ints: Vec<Vec<i32>>,
    floats: Vec<Vec<f32>>,
}

/// One uploaded plan parameter.
enum DeviceParam {
    F32(CudaSlice<f32>),
    I32(CudaSlice<i32>),
    U32(CudaSlice<u32>),
}

/// The CUDA INT8 backend.
pub struct CudaInt8 {
    backend: BackendInfo,
    input_dim: usize,
    info: DeviceInfo,
    stream: Arc<CudaStream>,
    engine: Engine,
    /// The call's input rows: NaN read as 0 for an MLP (as the CPU INT8
    /// quantizer reads it), kept for a graph (its tree ensembles read
    /// missing values; its Input nodes map them to 0 on the device).
    x_device: CudaSlice<f32>,
    /// Write-combined: the host only writes it.
    x_pinned: PinnedHostSlice<f32>,
    /// Cached (not write-combined): the host reads it.
    out_pinned: PinnedHostSlice<f32>,
    /// Set after a device failure; scores on the CPU from then on.
    failed_over: Option<cpu::CpuInt8>,
}

impl CudaInt8 {
    /// Builds the backend for `model` on device 0, with room for `rows_max`
    /// rows per call.
    pub fn new(model: &Arc<Model>, rows_max: usize) -> Result<CudaInt8, CudaError> {
        // A graph the kernels cannot hold is refused before any driver call.
        let plan = match &model.graph {
            Some(g) => Some(
                GraphPlan::new(g, model.input_dim(), Precision::Int8, rows_max)
                    .map_err(|why| CudaError::GraphPlan { model: model.name.clone(), why })?,
            ),
            None => None,
        };
        let started = Instant::now();
        let (ctx, info) = open()?;
        let (major, minor) = info.compute_capability;
        if (major, minor) < (6, 1) {
            return Err(CudaError::Unsupported { major, minor });
        }
        if let Some(plan) = plan {
            return CudaInt8::with_plan(model, rows_max, plan, ctx, info, started);
        }
        if model.layers.iter().any(|l| l.out_dim > 65_535 * DENSE_THREADS as usize) || rows_max == 0 {
            return Err(CudaError::Model(format!("rows_max {rows_max} or a layer width is out of range")));
        }
        let arch = format!("sm_{major}{minor}");
        let cubin = compile_cubin(&kernels::INT8_DENSE, &arch)?;
        // SAFETY: this backend uses one stream, and every buffer it
        // allocates is used only on that stream and freed after it is
        // synchronised, so cudarc's cross-stream event tracking (two events
        // per buffer per launch) buys nothing.
        unsafe { ctx.disable_event_tracking() };
        let module = ctx.load_module(nvrtc::Ptx::from_binary(cubin)).map_err(driver("loading the CUBIN"))?;
        let statics = model.static_int8();
        if statics.as_ref().is_some_and(|s| s.len() != model.layers.len()) {
            return Err(CudaError::Model("the calibration does not cover every layer".into()));
        }
        let is_static = statics.is_some();
        let entry = if is_static { "dense_int8_static" } else { "dense_int8" };
        // The CPU's `1.0 / statics[0].in_scale`, in f32.
        let inv_s_in = statics.as_ref().map_or(1.0, |st| 1.0f32 / st[0].in_scale);
        let function = module.load_function(entry).map_err(driver("cuModuleGetFunction"))?;
        let stream = ctx.new_stream().map_err(driver("creating a stream"))?;
        let mut layers = Vec::with_capacity(model.layers.len());
        for (i, l) in model.layers.iter().enumerate() {
            let k4 = l.in_dim.next_multiple_of(4);
            let weights = gpu_cases::pack_weights(l);
            let layer = (|| {
                let epilogue = match &statics {
                    Some(st) => Epilogue::Static {
                        bias_q: stream.clone_htod(&st[i].bias_q)?,
                        scale: stream.clone_htod(&st[i].scale)?,
                        requantize: i32::from(st[i].requantize),
                        lo: i32::from(st[i].lo),
                        inv_s_in,
                    },
                    None => Epilogue::Dynamic {
                        scales: stream.clone_htod(&l.weight_scales)?,
                        bias: stream.clone_htod(&l.bias)?,
                        relu: i32::from(l.relu),
                    },
                };
                Ok::<_, DriverError>(DeviceLayer {
                    k: l.in_dim as i32,
                    k4: k4 as i32,
                    n: l.out_dim as i32,
                    rows_per_block: kernels::dense_rows_per_block(k4),
                    weights: stream.clone_htod(&weights)?,
                    epilogue,
                })
            })();
            layers.push(layer.map_err(driver("uploading the model"))?);
        }
        let alloc = |n: usize| stream.alloc_zeros::<f32>(n.max(1));
        let alloc_q = |n: usize| stream.alloc_zeros::<i8>(n.max(1));
        let width = rows_max * model.width_max();
        let logits_len = rows_max * model.layers.last().map_or(1, |l| l.out_dim);
        let (f32_len, q_len) = if is_static { (logits_len, width) } else { (width, 0) };
        let x_device = alloc(rows_max * model.input_dim()).map_err(driver("cuMemAlloc"))?;
        let act_a = alloc(f32_len).map_err(driver("cuMemAlloc"))?;
        let act_b = alloc(if is_static { 0 } else { f32_len }).map_err(driver("cuMemAlloc"))?;
        let act_q_a = alloc_q(q_len).map_err(driver("cuMemAlloc"))?;
        let act_q_b = alloc_q(q_len).map_err(driver("cuMemAlloc"))?;
        // SAFETY: pinned memory starts uninitialised; both buffers are
        // written (the inputs by `logits`, the logits by a D2H copy) before
        // any element is read, and `f32` has no invalid bit patterns.
        let (x_pinned, out_pinned) = unsafe {
            (
                ctx.alloc_pinned::<f32>(rows_max * model.input_dim()).map_err(driver("cuMemHostAlloc"))?,
                ctx.alloc_pinned_with_flags::<f32>(rows_max, 0).map_err(driver("cuMemHostAlloc"))?,
            )
        };
        stream.synchronize().map_err(driver("uploading the model"))?;
        tracing::info!(
            device = info.name,
            arch,
            rows_max,
            layers = layers.len(),
            activations = if is_static { "static (calibrated)" } else { "dynamic (uncalibrated model)" },
            setup_ms = started.elapsed().as_millis() as u64,
            "cuda-int8 backend ready"
        );
        Ok(CudaInt8 {
            backend: BackendInfo { name: "cuda-int8", rows_max, model: model.clone() },
            input_dim: model.input_dim(),
            info,
            stream,
            engine: Engine::Layers(DeviceMlp { function, is_static, layers, act_a, act_b, act_q_a, act_q_b }),
            x_device,
            x_pinned,
            out_pinned,
            failed_over: None,
        })
    }

    /// The graph model's backend: each kernel file the plan launches
    /// compiled for this device, the plan's parameters uploaded once, one
    /// device buffer per node.
    fn with_plan(
        model: &Arc<Model>,
        rows_max: usize,
        plan: GraphPlan,
        ctx: Arc<CudaContext>,
        info: DeviceInfo,
        started: Instant,
    ) -> Result<CudaInt8, CudaError> {
        let (major, minor) = info.compute_capability;
        let arch = format!("sm_{major}{minor}");
        // SAFETY: as in `new`: one stream, every buffer used only on it.
        unsafe { ctx.disable_event_tracking() };
        let mut modules = Vec::new();
        for source in plan.sources() {
            let cubin = compile_cubin(&source, &arch)?;
            let module = ctx.load_module(nvrtc::Ptx::from_binary(cubin)).map_err(driver("loading the CUBIN"))?;
            modules.push((source.file, module));
        }
        let mut functions = Vec::with_capacity(plan.launches.len());
        for l in &plan.launches {
            let (_, module) = modules.iter().find(|(file, _)| *file == l.source.file).expect("compiled above");
            functions.push(module.load_function(l.entry).map_err(driver("cuModuleGetFunction"))?);
        }
        let stream = ctx.new_stream().map_err(driver("creating a stream"))?;
        let upload = |p: &Param| -> Result<DeviceParam, DriverError> {
            Ok(match p {
                Param::F32(v) => DeviceParam::F32(stream.clone_htod(v)?),
                Param::Table(t) => DeviceParam::F32(stream.clone_htod(&t[..])?),
                Param::I32(v) => DeviceParam::I32(stream.clone_htod(v)?),
                Param::U32(v) => DeviceParam::U32(stream.clone_htod(v)?),
                Param::TreeNodes(v) => DeviceParam::U32(stream.clone_htod(v.as_flattened())?),
            })
        };
        let params =
            plan.params.iter().map(upload).collect::<Result<Vec<_>, _>>().map_err(driver("uploading the model"))?;
        let nodes = plan
            .widths
            .iter()
            .map(|w| stream.alloc_zeros::<f32>(rows_max * w))
            .collect::<Result<Vec<_>, _>>()
            .map_err(driver("cuMemAlloc"))?;
        let ints = plan.launches.iter().map(|l| vec![0i32; l.args.len()]).collect();
        let floats = plan.launches.iter().map(|l| vec![0f32; l.args.len()]).collect();
        let x_device = stream.alloc_zeros::<f32>(rows_max * model.input_dim()).map_err(driver("cuMemAlloc"))?;
        // SAFETY: as in `new`: both written before any element is read.
        let (x_pinned, out_pinned) = unsafe {
            (
                ctx.alloc_pinned::<f32>(rows_max * model.input_dim()).map_err(driver("cuMemHostAlloc"))?,
                ctx.alloc_pinned_with_flags::<f32>(rows_max, 0).map_err(driver("cuMemHostAlloc"))?,
            )
        };
        stream.synchronize().map_err(driver("uploading the model"))?;
        tracing::info!(
            device = info.name,
            arch,
            rows_max,
            nodes = plan.widths.len(),
            launches = plan.launches.len(),
            parameter_bytes = plan.params.iter().map(Param::bytes).sum::<usize>(),
            setup_ms = started.elapsed().as_millis() as u64,
            "cuda-int8 backend ready (graph model)"
        );
        Ok(CudaInt8 {
            backend: BackendInfo { name: "cuda-int8", rows_max, model: model.clone() },
            input_dim: model.input_dim(),
            info,
            stream,
            engine: Engine::Graph(DeviceGraph { plan, functions, params, nodes, ints, floats }),
            x_device,
            x_pinned,
            out_pinned,
            failed_over: None,
        })
    }

    pub fn device_info(&self) -> &DeviceInfo {
        &self.info
    }

    /// One batch on the device.
    fn run(&mut self, x: &[f32], rows: usize, out: &mut [f32]) -> Result<(), DriverError> {
        let len = rows * self.input_dim;
        let host_x = self.x_pinned.as_mut_slice()?;
        match self.engine {
            // A missing value (NaN) reads as 0, as the CPU INT8 reference's
            // quantizer reads it.
            Engine::Layers(_) => {
                for (d, v) in host_x[..len].iter_mut().zip(x) {
                    *d = if v.is_nan() { 0.0 } else { *v };
                }
            }
            Engine::Graph(_) => host_x[..len].copy_from_slice(&x[..len]),
        }
        self.stream.memcpy_htod(&host_x[..len], &mut self.x_device.slice_mut(..len))?;
        let last = match &mut self.engine {
            Engine::Layers(mlp) => mlp.run(&self.stream, &self.x_device, rows)?,
            Engine::Graph(graph) => graph.run(&self.stream, &self.x_device, rows)?,
        };
        let host_out = self.out_pinned.as_mut_slice()?;
        self.stream.memcpy_dtoh(&last.slice(..rows), &mut host_out[..rows])?;
        self.stream.synchronize()?;
        out.copy_from_slice(&host_out[..rows]);
        Ok(())
    }
}

impl DeviceMlp {
    /// Launches every layer on `stream` over the input rows in `x_device`;
    /// returns the buffer whose first `rows` values are the logits.
    fn run(
        &mut self,
        stream: &CudaStream,
        x_device: &CudaSlice<f32>,
        rows: usize,
    ) -> Result<&CudaSlice<f32>, DriverError> {
        let rows_arg = rows as i32;
        let (a, b) = (&mut self.act_a, &mut self.act_b);
        let (qa, qb) = (&mut self.act_q_a, &mut self.act_q_b);
        for (i, l) in self.layers.iter().enumerate() {
            let cfg = LaunchConfig {
                grid_dim: (rows.div_ceil(l.rows_per_block) as u32, (l.n as u32).div_ceil(DENSE_THREADS), 1),
                block_dim: (DENSE_THREADS, 1, 1),
                shared_mem_bytes: (l.rows_per_block * l.k4 as usize) as u32,
            };
            let rows_per_block = l.rows_per_block as i32;
            let mut launch = stream.launch_builder(&self.function);
            match &l.epilogue {
                Epilogue::Dynamic { scales, bias, relu } => {
                    let (src, dst): (&CudaSlice<f32>, &mut CudaSlice<f32>) = match i {
                        0 => (x_device, &mut *a),
                        _ if i % 2 == 1 => (&*a, &mut *b),
                        _ => (&*b, &mut *a),
                    };
                    launch
                        .arg(src)
                        .arg(&rows_arg)
                        .arg(&l.k)
                        .arg(&l.k4)
                        .arg(&l.n)
                        .arg(&rows_per_block)
                        .arg(&l.weights)
                        .arg(scales)
                        .arg(bias)
                        .arg(relu)
                        .arg(dst);
                    // SAFETY: the arguments match `dense_int8`'s parameter
                    // list in order and type (pointers as device pointers,
                    // `int` as i32); `src` holds `rows × k` floats and `dst`
                    // room for `rows × n` (both sized for rows_max ×
                    // width_max, rows ≤ rows_max); the weights hold `k4 / 4 ×
                    // n` words; the grid covers `rows` rows and `n` outputs,
                    // and the dynamic shared memory is `rows_per_block × k4`
                    // bytes ≤ 48 KiB.
                    unsafe { launch.launch(cfg) }?;
                }
                Epilogue::Static { bias_q, scale, requantize, lo, inv_s_in } => {
                    // Layer i reads the int8 rows layer i - 1 wrote (layer 0
                    // reads and quantizes the f32 input instead) and writes
                    // int8 into the other buffer, or the f32 logits into
                    // `act_a` when it is the output layer.
                    let (src_q, dst_q): (&CudaSlice<i8>, &mut CudaSlice<i8>) =
                        if i % 2 == 0 { (&*qb, &mut *qa) } else { (&*qa, &mut *qb) };
                    let input_f32 = i32::from(i == 0);
                    launch
                        .arg(x_device)
                        .arg(src_q)
                        .arg(&input_f32)
                        .arg(inv_s_in)
                        .arg(&rows_arg)
                        .arg(&l.k)
                        .arg(&l.k4)
                        .arg(&l.n)
                        .arg(&rows_per_block)
                        .arg(&l.weights)
                        .arg(bias_q)
                        .arg(scale)
                        .arg(requantize)
                        .arg(lo)
                        .arg(dst_q)
                        .arg(&mut *a);
                    // SAFETY: the arguments match `dense_int8_static`'s
                    // parameter list in order and type (pointers as device
                    // pointers, `int` as i32, `float` as f32). The input it
                    // reads (`x_device` when `input_f32`, else `src_q`) holds
                    // `rows × k` elements; the output it writes (`dst_q` when
                    // `requantize`, else `act_a`) has room for `rows × n`:
                    // the int8 buffers are rows_max × width_max bytes and
                    // `act_a` rows_max × n of the output layer, rows ≤
                    // rows_max. The four buffers are distinct allocations, so
                    // the kernel's `__restrict__` holds. Weights, grid and
                    // shared memory are as for `dense_int8`.
                    unsafe { launch.launch(cfg) }?;
                }
            }
        }
        Ok(if self.is_static || self.layers.len() % 2 == 1 { &self.act_a } else { &self.act_b })
    }
}

impl DeviceGraph {
    /// Replays the plan's launches on `stream` over the input rows in
    /// `x_device`; returns the output node's buffer (one value per row).
    fn run(
        &mut self,
        stream: &CudaStream,
        x_device: &CudaSlice<f32>,
        rows: usize,
    ) -> Result<&CudaSlice<f32>, DriverError> {
        for (l, (ints, floats)) in self.plan.launches.iter().zip(self.ints.iter_mut().zip(&mut self.floats)) {
            for (k, a) in l.args.iter().enumerate() {
                match *a {
                    Arg::RowsTimes(m) => ints[k] = (rows * m) as i32,
                    Arg::Int(v) => ints[k] = v,
                    Arg::Float(v) => floats[k] = v,
                    _ => {}
                }
            }
        }
        for (i, l) in self.plan.launches.iter().enumerate() {
            let d = l.geometry.dims(rows);
            let cfg = LaunchConfig {
                grid_dim: (d.grid[0], d.grid[1], d.grid[2]),
                block_dim: (d.block[0], d.block[1], d.block[2]),
                shared_mem_bytes: d.shared_bytes as u32,
            };
            let mut launch = stream.launch_builder(&self.functions[i]);
            for (k, a) in l.args.iter().enumerate() {
                match *a {
                    Arg::Input => launch.arg(x_device),
                    Arg::Node(j) => launch.arg(&self.nodes[j]),
                    Arg::Param(j) => match &self.params[j] {
                        DeviceParam::F32(p) => launch.arg(p),
                        DeviceParam::I32(p) => launch.arg(p),
                        DeviceParam::U32(p) => launch.arg(p),
                    },
                    Arg::RowsTimes(_) | Arg::Int(_) => launch.arg(&self.ints[i][k]),
                    Arg::Float(_) => launch.arg(&self.floats[i][k]),
                };
            }
            // SAFETY: `gpu_layout::GraphPlan` lists each entry's parameters
            // in order and type (pointers as device pointers, `int` as i32,
            // `float` as f32; tree nodes as u32 words, 4 per `uint4`, in an
            // allocation the driver aligns to 256 bytes), which
            // `tests/cuda_emulation.rs` runs on the kernels' host build. Every
            // node buffer holds rows_max × width floats and `rows` ≤
            // rows_max; the input holds rows × input_dim; the geometry is
            // the plan's for `rows`. Buffers are passed by shared reference
            // although the kernel writes its own node's: all work is on
            // this one stream with event tracking off, so cudarc's
            // read/write distinction orders nothing here, and a launch
            // whose output is also its input (an activation in place) is
            // the kernel's own contract (no `__restrict__` there).
            unsafe { launch.launch(cfg) }?;
        }
        Ok(&self.nodes[self.plan.output()])
    }
}

impl Backend for CudaInt8 {
    fn info(&self) -> &BackendInfo {
        &self.backend
    }

    /// Never fails: a device failure moves it to the CPU INT8 backend, for
    /// good, and renames it `cpu-int8`.
    fn score(&mut self, x: &[f32], rows: usize, out: &mut [f32]) -> Result<(), BackendError> {
        self.backend.check(x, rows, out);
        if rows == 0 {
            return Ok(());
        }
        if let Some(cpu) = &mut self.failed_over {
            return cpu.score(x, rows, out);
        }
        if let Err(e) = self.run(x, rows, out) {
            tracing::error!(error = %e, "cuda-int8: the device failed; scoring on the CPU INT8 backend from now on");
            let mut cpu = cpu::CpuInt8::new(&self.backend.model, self.backend.rows_max);
            cpu.score(x, rows, out)?;
            self.backend.name = "cpu-int8";
            self.failed_over = Some(cpu);
        }
        Ok(())
    }
}

fn percentile_us(sorted_ns: &[u64], p: f64) -> f64 {
    let i = ((sorted_ns.len() as f64 * p).ceil() as usize).clamp(1, sorted_ns.len()) - 1;
    sorted_ns[i] as f64 / 1e3
}

/// `quiver gpu-check`: device and NVRTC versions, INT8 parity with the CPU
/// scalar reference (bit for bit; two NaNs count as equal, since their
/// payloads are not specified) at each of `batches` rows on several models,
/// uncalibrated (dynamic semantics) and calibrated (static), and on graph
/// models covering every node kind of the graph kernels and a tree model
/// (`gpu_cases::check_graph_models`, against the CPU INT8 backend's graph
/// executor), and host-timed latency percentiles of `logits` after warm-up
/// for the demo model in both semantics and for those graph and tree
/// models (`"activations": "graph"`). Returns the report, with `"ok":
/// false` when any output differs; an error when there is no GPU to check.
pub fn gpu_check(batches: &[usize], iters: usize) -> Result<serde_json::Value, CudaError> {
    let info = probe()?;
    let rows_max = batches.iter().copied().max().unwrap_or(1);
    let mut models = gpu_cases::check_models(rows_max).map_err(|e| CudaError::Model(e.to_string()))?;
    models.extend(gpu_cases::check_graph_models(rows_max.min(super::gpu_layout::GRAPH_ROWS_MAX)));
    let mut parity = Vec::new();
    let mut ok = true;
    for (model, model_rows_max) in &models {
        let mut gpu = CudaInt8::new(model, *model_rows_max)?;
        let mut cpu = cpu::CpuInt8::with_kernel(model, *model_rows_max, cpu::Int8Kernel::Scalar)
            .map_err(|e| CudaError::Model(e.to_string()))?;
        for &rows in batches.iter().filter(|&&r| r <= *model_rows_max) {
            let x = match model.graph {
                Some(_) => gpu_cases::check_graph_inputs(model, rows as u64, rows),
                None => gpu_cases::check_inputs(rows as u64, rows, model.input_dim()),
            };
            let (mut want, mut got) = (vec![0.0; rows], vec![0.0; rows]);
            cpu.score(&x, rows, &mut want).map_err(|e| CudaError::Model(e.to_string()))?;
            gpu.score(&x, rows, &mut got).map_err(|e| CudaError::Model(e.to_string()))?;
            let same = |g: f32, w: f32| g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan());
            let bad: Vec<usize> = (0..rows).filter(|&r| !same(got[r], want[r])).collect();
            ok &= bad.is_empty() && gpu.failed_over.is_none();
            parity.push(serde_json::json!({
                "model": model.name,
                "activations": activations(model),
                "rows": rows,
                "mismatches": bad.len(),
                "first_mismatch": bad.first().map(|&r| serde_json::json!({
                    "row": r, "gpu": format!("{:e}", got[r]), "cpu": format!("{:e}", want[r]),
                })),
                "failed_over_to_cpu": gpu.failed_over.is_some(),
            }));
        }
    }
    let mut timing = Vec::new();
    let calibrated =
        gpu_cases::check_calibrated(crate::loadgen::demo::model(), 1.0).map_err(|e| CudaError::Model(e.to_string()))?;
    for model in [crate::loadgen::demo::model(), calibrated] {
        timing.extend(time_model(&Arc::new(model), batches, iters, rows_max)?);
    }
    for (model, model_rows_max) in gpu_cases::check_graph_models(rows_max.min(super::gpu_layout::GRAPH_ROWS_MAX)) {
        let fits: Vec<usize> = batches.iter().copied().filter(|&r| r <= model_rows_max).collect();
        timing.extend(time_model(&model, &fits, iters, model_rows_max)?);
    }
    Ok(serde_json::json!({ "ok": ok, "device": info, "parity": parity, "timing": timing }))
}

/// The report's name for how `model` runs: `static` or `dynamic` INT8
/// layers for an MLP, `graph` for a graph model (its dense nodes dynamic).
fn activations(model: &Model) -> &'static str {
    match (&model.graph, &model.calibration) {
        (Some(_), _) => "graph",
        (None, Some(_)) => "static",
        (None, None) => "dynamic",
    }
}

/// Host-timed p50/p99 of `logits` at each of `batches` rows, GPU and CPU
/// INT8 (best kernel), after 10 warm-up calls.
fn time_model(
    model: &Arc<Model>,
    batches: &[usize],
    iters: usize,
    rows_max: usize,
) -> Result<Vec<serde_json::Value>, CudaError> {
    let mut gpu = CudaInt8::new(model, rows_max)?;
    let mut cpu = cpu::CpuInt8::new(model, rows_max);
    let mut timing = Vec::new();
    for &rows in batches {
        let x = match model.graph {
            Some(_) => gpu_cases::check_graph_inputs(model, 7, rows),
            None => gpu_cases::check_inputs(7, rows, model.input_dim()),
        };
        let mut out = vec![0.0; rows];
        let mut time = |b: &mut dyn Backend| -> Result<(f64, f64), CudaError> {
            let mut call = || b.score(&x, rows, &mut out).map_err(|e| CudaError::Model(e.to_string()));
            for _ in 0..10 {
                call()?;
            }
            let mut ns = Vec::with_capacity(iters.max(1));
            for _ in 0..iters.max(1) {
                let t = Instant::now();
                call()?;
                ns.push(t.elapsed().as_nanos() as u64);
            }
            ns.sort_unstable();
            Ok((percentile_us(&ns, 0.5), percentile_us(&ns, 0.99)))
        };
        let (p50, p99) = time(&mut gpu)?;
        let (cpu_p50, cpu_p99) = time(&mut cpu)?;
        timing.push(serde_json::json!({
            "model": model.name,
            "activations": activations(model),
            "rows": rows, "iters": iters,
            "gpu_p50_us": p50, "gpu_p99_us": p99, "cpu_int8_p50_us": cpu_p50, "cpu_int8_p99_us": cpu_p99,
        }));
    }
    Ok(timing)
}

/// What this machine implies for the CUDA backend, and why: a GPU it must
/// use (`true`: a driver library and an NVIDIA device node), or none
/// (`false`: no driver library, or a driver with no device node). Tests
/// decide from the machine rather than from `CudaInt8::new`'s result, which
/// is what lets them fail on either side. (It reads no environment;
/// `tests/cuda_fallback.rs` also takes `QUIVER_REQUIRE_CUDA` for a machine
/// this cannot read right.)
pub fn gpu_expected() -> (bool, &'static str) {
    // SAFETY: only tries to dlopen the driver library under its usual names.
    if !unsafe { sys::is_culib_present() } {
        return (false, "no CUDA driver library");
    }
    let device_node = std::fs::read_dir("/dev").into_iter().flatten().flatten().any(|e| {
        let name = e.file_name();
        let name = name.to_string_lossy();
        name.strip_prefix("nvidia").is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    });
    if device_node {
        (true, "a CUDA driver library and an NVIDIA device node")
    } else {
        (false, "a CUDA driver library but no NVIDIA device node")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Layer;

    #[test]
    fn graph_and_tree_models_are_served_where_a_gpu_is_and_on_the_cpu_where_none_is() {
        use crate::model::{Act, Graph, Node, Op, OutputKind};
        let mlp = crate::loadgen::demo::context_mlp("graph", 5, &[6, 4, 1]);
        let dense = |l: &Layer, input: usize, act: Act| Node {
            op: Op::Dense { layer: Layer { relu: false, ..l.clone() }, act },
            inputs: vec![input],
            width: l.out_dim,
        };
        let nodes = vec![
            Node { op: Op::Input { offset: 0 }, inputs: vec![], width: 6 },
            dense(&mlp.layers[0], 0, Act::Tanh),
            dense(&mlp.layers[1], 1, Act::None),
        ];
        let g = Arc::new(Model { layers: Vec::new(), graph: Some(Graph { nodes, output: OutputKind::Logit }), ..mlp });
        g.validate().unwrap();
        let x = [0.5f32, -1.0, 0.25, 2.0, f32::NAN, -0.5];
        // The CUDA backend (or, without a GPU, its fallback) gives the CPU
        // INT8 backend's numbers bit for bit, NaN inputs included.
        let (gpu, why) = gpu_expected();
        let served = |m: &Arc<Model>| {
            match CudaInt8::new(m, 8) {
                Ok(b) if gpu => assert_eq!(b.info().name, "cuda-int8"),
                Ok(_) => panic!("{why}, yet the CUDA backend started for {}", m.name),
                Err(e) if gpu => panic!("{why}, but {} did not start on the GPU: {e}", m.name),
                Err(e) => assert!(e.is_absent() || matches!(e, CudaError::Driver { .. }), "{e}"),
            }
            let mut backend = crate::score::build(crate::score::BackendKind::Cuda, m, 8);
            assert_eq!(backend.name(), if gpu { "cuda-int8" } else { "cpu-int8" });
            let mut cpu = cpu::CpuInt8::with_kernel(m, 8, cpu::Int8Kernel::Scalar).unwrap();
            let (mut out, mut want) = ([0.0], [0.0]);
            backend.score(&x, 1, &mut out).unwrap();
            cpu.score(&x, 1, &mut want).unwrap();
            assert_eq!(out[0].to_bits(), want[0].to_bits(), "{}: {} vs {}", m.name, out[0], want[0]);
            out[0]
        };
        let logit = served(&g);
        let mut reference = [0.0];
        g.forward_f32_reference(&x, 1, &mut reference);
        assert!((logit - reference[0]).abs() < 0.05, "{logit} vs {}", reference[0]);
        // A graph the kernels cannot hold (more rows than dense_f32's grid)
        // is refused before any driver call, and served on the CPU.
        let rows_max = crate::score::gpu_layout::GRAPH_ROWS_MAX + 1;
        assert!(matches!(CudaInt8::new(&g, rows_max), Err(CudaError::GraphPlan { model, why })
            if model == "graph" && why.contains("rows_max")));
        assert_eq!(crate::score::build(crate::score::BackendKind::Cuda, &g, rows_max).name(), "cpu-int8");

        // A tree model likewise; a NaN takes the split's missing branch (right).
        use crate::model::trees::{Ensemble, Split, TreeNode};
        let mut e = Ensemble { base: 0.25, ..Ensemble::default() };
        let split = Split::Numeric { feature: 3, threshold: 1.0, missing_left: false, zero_missing: false };
        e.push_tree(&[TreeNode { split, left: 1, right: 2 }, TreeNode::leaf(-1.0), TreeNode::leaf(1.0)]);
        let nodes = vec![
            Node { op: Op::Input { offset: 0 }, inputs: vec![], width: 6 },
            Node { op: Op::Trees(e), inputs: vec![0], width: 1 },
        ];
        let t = Arc::new(Model {
            name: "trees".into(),
            graph: Some(Graph { nodes, output: OutputKind::Logit }),
            ..(*g).clone()
        });
        assert_eq!(served(&t), 0.25 + 1.0);
        let split = Split::Numeric { feature: 4, threshold: 1.0, missing_left: true, zero_missing: false };
        let mut e = Ensemble { base: 0.25, ..Ensemble::default() };
        e.push_tree(&[TreeNode { split, left: 1, right: 2 }, TreeNode::leaf(-1.0), TreeNode::leaf(1.0)]);
        let nodes = vec![
            Node { op: Op::Input { offset: 0 }, inputs: vec![], width: 6 },
            Node { op: Op::Trees(e), inputs: vec![0], width: 1 },
        ];
        let missing = Arc::new(Model { graph: Some(Graph { nodes, output: OutputKind::Logit }), ..(*t).clone() });
        assert_eq!(served(&missing), 0.25 - 1.0);
        eprintln!(
            "RAN graph and tree models on the CUDA backend {}",
            if gpu { "on the GPU" } else { "(CPU fallback)" }
        );
    }

    #[test]
    fn weights_are_packed_four_k_per_word_transposed() {
        let layer = Layer {
            in_dim: 5,
            out_dim: 2,
            relu: false,
            weights_f32: vec![0.0; 10],
            weights_i8: vec![1, 2, 3, 4, 5, -1, -2, -3, -4, -5],
            weight_scales: vec![1.0; 2],
            bias: vec![0.0; 2],
        };
        let w = super::gpu_cases::pack_weights(&layer);
        assert_eq!(w.len(), 2 * 2);
        assert_eq!(w[0], i32::from_le_bytes([1, 2, 3, 4]));
        assert_eq!(w[1], i32::from_le_bytes([0xFF, 0xFE, 0xFD, 0xFC]));
        assert_eq!(w[2], i32::from_le_bytes([5, 0, 0, 0]));
        assert_eq!(w[3], i32::from_le_bytes([0xFB, 0, 0, 0]));
    }

    #[test]
    fn construction_gives_the_gpu_this_machine_has_or_a_typed_error_where_it_has_none() {
        let (gpu, why) = gpu_expected();
        let calibrated = super::gpu_cases::check_calibrated(crate::loadgen::demo::model(), 1.0).unwrap();
        for model in [crate::loadgen::demo::model(), calibrated] {
            let built = CudaInt8::new(&Arc::new(model), 8);
            if gpu {
                // Both semantics: a calibrated model is accepted too.
                let b = built.unwrap_or_else(|e| panic!("{why}, but the CUDA backend did not start: {e}"));
                assert_eq!(b.info().name, "cuda-int8");
                continue;
            }
            match built {
                Ok(b) => panic!("{why}, yet the CUDA backend started on {}", b.device_info().name),
                Err(e) if why == "no CUDA driver library" => assert!(matches!(e, CudaError::NoDriver), "{e}"),
                Err(e) => assert!(e.is_absent() || matches!(e, CudaError::Driver { .. }), "{e}"),
            }
        }
        eprintln!("RAN the CUDA construction check {} ({why})", if gpu { "on the GPU" } else { "without a GPU" });
    }

    /// Where a GPU is, every check model's outputs equal the CPU scalar
    /// reference's bit for bit, in both semantics (what `quiver gpu-check`
    /// reports); where none is, `gpu_check` is the typed error, not a panic.
    #[test]
    fn gpu_check_finds_cpu_parity_on_a_gpu_and_a_typed_error_without_one() {
        let (gpu, why) = gpu_expected();
        match gpu_check(&[1, 31, 32, 33, 255], 3) {
            Ok(report) if gpu => {
                assert_eq!(report["ok"], serde_json::Value::Bool(true), "{report:#}");
                eprintln!("RAN the GPU parity check on {} ({why})", report["device"]["name"]);
            }
            Ok(report) => panic!("{why}, yet gpu_check ran: {report:#}"),
            Err(e) if gpu => panic!("{why}, but gpu_check found no GPU: {e}"),
            Err(e) => {
                assert!(e.is_absent() || matches!(e, CudaError::Driver { .. }), "{e}");
                eprintln!("RAN the no-GPU check of gpu_check ({why}): {e}");
            }
        }
    }

    #[test]
    fn the_check_models_cover_both_semantics_and_the_static_edge_cases() {
        let models = super::gpu_cases::check_models(64).unwrap();
        let statics: Vec<_> = models.iter().filter_map(|(m, _)| m.static_int8()).collect();
        assert!(statics.len() >= 4 && statics.len() < models.len(), "both semantics are checked");
        // A single-layer model, whose layer 0 writes the logit, and a hidden
        // layer requantized without ReLU (down to -128).
        assert!(statics.iter().any(|s| s.len() == 1 && !s[0].requantize));
        assert!(statics.iter().any(|s| s.iter().any(|l| l.requantize && l.lo == -128)));
        for (m, _) in &models {
            m.validate().unwrap();
        }
    }
}
