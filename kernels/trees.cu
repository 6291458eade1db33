// A tree ensemble (src/model/trees.rs) over a batch of rows: the base plus
// every tree's leaf, bit for bit the CPU's `Ensemble::predict_row` (and so
// the CPU evaluator, src/score/cpu/forest/), whose sum is
//   acc = base; acc += leaf(t, row) for t = 0, 1, ..., trees - 1   (f32)
//
// Work split as FIL splits it: one thread per (row, tree group). A block is
// TREE_ROWS rows (threadIdx.x) by TREE_GROUPS tree groups (threadIdx.y). The
// trees go by in chunks of TREE_CHUNK: thread (r, g) walks trees g,
// g + TREE_GROUPS, ... of the chunk for row r and parks each leaf value in
// shared memory; after a barrier, thread (r, 0) adds the chunk's leaves to
// its row's sum in tree order, which keeps the CPU's order of additions (a
// per-group partial sum combined at the end would round differently), and a
// second barrier frees the leaf buffer for the next chunk.
//
// Split rule, the canonical one of src/model/trees.rs (`goes_left`):
//   numeric      left iff x <= threshold; a missing x (NaN, and with
//                ZERO_MISSING also |x| <= 1e-35) goes left iff MISSING_LEFT
//   categorical  left iff x truncates to c >= 0 (x > -1 and x < 2^31) and
//                bit c is set in the node's bitset; otherwise right
//
// Node layout (packed on the host by src/score/gpu_layout.rs, 16 bytes):
//   x  threshold (numeric), leaf value (leaf) as f32 bits, or, for a
//      categorical split, the index in `cat` of its bitset: cat[x] holds the
//      length in words, cat[x + 1 ...] the words
//   y  feature (bits 0..23) | TREE_LEAF | TREE_CATEGORICAL |
//      TREE_MISSING_LEFT | TREE_ZERO_MISSING
//   z  left child, w right child: indices into `nodes` (the whole ensemble)
// `roots[t]` is tree t's root. Row r's features are
// x[r * stride + column0 + feature]: `column0` and `stride` let a tree node
// read the model's input vector (NaN kept: missing) or a node's output.
//
// Launch: block = (TREE_ROWS, TREE_GROUPS, 1), grid = (ceil(rows /
// TREE_ROWS), 1, 1), no dynamic shared memory. Output: y[r * y_stride].

#define TREE_ROWS 32
#define TREE_GROUPS 4
#define TREE_CHUNK 32
#define TREE_DEPTH_MAX 64
#define TREE_FEATURE_MASK 0x00FFFFFFu
#define TREE_LEAF (1u << 24)
#define TREE_CATEGORICAL (1u << 25)
#define TREE_MISSING_LEFT (1u << 26)
#define TREE_ZERO_MISSING (1u << 27)
// LightGBM's kZeroThreshold (model::trees::ZERO_THRESHOLD).
#define TREE_ZERO_THRESHOLD 1e-35f

// Whether `v` takes the left branch of the split `n` (not a leaf).
__device__ __forceinline__ bool tree_goes_left(uint4 n, float v, const unsigned* __restrict__ cat) {
    if (n.y & TREE_CATEGORICAL) {
        // model::trees::category: the truncation of a value in (-1, 2^31).
        if (!(v > -1.0f && v < 2147483648.0f)) {
            return false;
        }
        const unsigned c = (unsigned)v;
        const unsigned words = __ldg(cat + n.x);
        return c / 32u < words && ((__ldg(cat + n.x + 1u + c / 32u) >> (c % 32u)) & 1u) != 0u;
    }
    // v != v: NaN, without relying on a math header's isnan.
    if (v != v || ((n.y & TREE_ZERO_MISSING) && fabsf(v) <= TREE_ZERO_THRESHOLD)) {
        return (n.y & TREE_MISSING_LEFT) != 0u;
    }
    return v <= __uint_as_float(n.x);
}

// The leaf tree `root` gives the row `xr`. A validated tree reaches a leaf
// within TREE_DEPTH_MAX splits; the bound only keeps a corrupt upload from
// looping, and then gives NaN, which the host's parity check reports.
__device__ __forceinline__ float tree_leaf(const uint4* __restrict__ nodes, unsigned root, const float* xr,
                                           const unsigned* __restrict__ cat) {
    unsigned i = root;
    for (int step = 0; step <= TREE_DEPTH_MAX; ++step) {
        const uint4 n = __ldg(nodes + i);
        if (n.y & TREE_LEAF) {
            return __uint_as_float(n.x);
        }
        const float v = xr[n.y & TREE_FEATURE_MASK];
        i = tree_goes_left(n, v, cat) ? n.z : n.w;
    }
    return __uint_as_float(0x7FC00000u);
}

extern "C" __global__ void __launch_bounds__(TREE_ROWS * TREE_GROUPS)
trees_predict(const float* __restrict__ x, int rows, int stride, int column0, const uint4* __restrict__ nodes,
              const unsigned* __restrict__ roots, int trees, const unsigned* __restrict__ cat, float base,
              float* __restrict__ y, int y_stride) {
    __shared__ float tree_leaves[TREE_CHUNK][TREE_ROWS];

    const int lane = threadIdx.x;
    const int group = threadIdx.y;
    const int row = blockIdx.x * TREE_ROWS + lane;
    const bool live = row < rows;
    const float* xr = x + (size_t)(live ? row : 0) * stride + column0;
    float acc = base;
    for (int t0 = 0; t0 < trees; t0 += TREE_CHUNK) {
        const int here = min(TREE_CHUNK, trees - t0);
        if (live) {
            for (int j = group; j < here; j += TREE_GROUPS) {
                tree_leaves[j][lane] = tree_leaf(nodes, __ldg(roots + t0 + j), xr, cat);
            }
        }
        __syncthreads();
        if (live && group == 0) {
            for (int j = 0; j < here; ++j) {
                acc = __fadd_rn(acc, tree_leaves[j][lane]);
            }
        }
        __syncthreads();
    }
    if (live && group == 0) {
        y[(size_t)row * y_stride] = acc;
    }
}
