//! The CUDA C++ kernel sources under `kernels/`, embedded in the crate.
//!
//! Compiled in every build, with or without the `cuda` feature, so that
//! `tests/nvrtc.rs` compile-checks exactly the text the CUDA backend hands
//! to NVRTC, and so that a kernel added here is checked without anyone
//! remembering to list it in the test.

/// One kernel source file.
#[derive(Clone, Copy, Debug)]
pub struct KernelSource {
    /// File name under `kernels/`, also the NVRTC program name.
    pub file: &'static str,
    /// The `extern "C"` entry points the file defines.
    pub entries: &'static [&'static str],
    pub source: &'static str,
    /// Whether it includes CUDA toolkit headers (`cuda_fp8.h`), so NVRTC
    /// needs an include path.
    pub needs_cuda_headers: bool,
}

/// The fused INT8 dense layers the CUDA backend runs: `dense_int8` for the
/// dynamic semantics (uncalibrated models), `dense_int8_static` for the
/// static one (calibrated models).
pub const INT8_DENSE: KernelSource = KernelSource {
    file: "int8_dense.cu",
    entries: &["dense_int8", "dense_int8_static"],
    source: include_str!("../../kernels/int8_dense.cu"),
    needs_cuda_headers: false,
};

/// The FP8 E4M3 dense layer; compile-checked, not launched yet.
pub const FP8_DENSE: KernelSource = KernelSource {
    file: "fp8_dense.cu",
    entries: &["dense_fp8"],
    source: include_str!("../../kernels/fp8_dense.cu"),
    needs_cuda_headers: true,
};

/// The tree-ensemble kernel: one thread per row × tree group, leaves
/// summed in tree order (`Ensemble::predict_row`'s bits).
pub const TREES: KernelSource = KernelSource {
    file: "trees.cu",
    entries: &["trees_predict"],
    source: include_str!("../../kernels/trees.cu"),
    needs_cuda_headers: false,
};

/// The graph models' other nodes, in the CPU graph executor's arithmetic.
pub const GRAPH_NODES: KernelSource = KernelSource {
    file: "graph_nodes.cu",
    entries: &[
        "graph_input",
        "graph_activation",
        "dense_f32",
        "elementwise",
        "copy_columns",
        "affine",
        "layer_norm",
        "row_dot",
        "row_sum",
        "embedding",
    ],
    source: include_str!("../../kernels/graph_nodes.cu"),
    needs_cuda_headers: false,
};

/// Every kernel source; `tests/nvrtc.rs` compiles each for every target.
pub const ALL: [KernelSource; 4] = [INT8_DENSE, FP8_DENSE, TREES, GRAPH_NODES];

/// Launch geometry shared by both entries of `kernels/int8_dense.cu` and its
/// host code: the values of its `DENSE_THREADS` and `DENSE_ROWS_MAX`.
pub const DENSE_THREADS: u32 = 128;
pub const DENSE_ROWS_MAX: usize = 8;
/// Dynamic shared memory a block may take without opting in to more.
pub const SHARED_BYTES_DEFAULT_MAX: usize = 48 * 1024;

/// Rows one `dense_int8` or `dense_int8_static` block quantizes into shared memory for a layer with
/// `k4` (padded) inputs: as many as fit in the default shared memory, at
/// most `DENSE_ROWS_MAX`. `k4 <= WIDTH_MAX` (16384) always leaves room for 3.
pub fn dense_rows_per_block(k4: usize) -> usize {
    (SHARED_BYTES_DEFAULT_MAX / k4.max(1)).clamp(1, DENSE_ROWS_MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_constants_match_the_kernel_source() {
        let src = INT8_DENSE.source;
        assert!(src.contains(&format!("#define DENSE_THREADS {DENSE_THREADS}\n")));
        assert!(src.contains(&format!("#define DENSE_ROWS_MAX {DENSE_ROWS_MAX}\n")));
        for k in ALL {
            for e in k.entries {
                assert!(k.source.contains(&format!("{e}(")), "{} lacks {e}", k.file);
            }
        }
    }

    #[test]
    fn rows_per_block_fit_the_default_shared_memory() {
        for k4 in [4usize, 256, 6144, 6148, 16384] {
            let r = dense_rows_per_block(k4);
            assert!((1..=DENSE_ROWS_MAX).contains(&r) && r * k4 <= SHARED_BYTES_DEFAULT_MAX, "k4 {k4}: {r}");
        }
        assert_eq!(dense_rows_per_block(16384), 3);
        assert_eq!(dense_rows_per_block(256), DENSE_ROWS_MAX);
    }
}
