// The nodes of graph models (src/model/graph) other than INT8 dense layers
// (kernels/int8_dense.cu) and tree ensembles (kernels/trees.cu), each the
// CPU graph executor's arithmetic (src/score/cpu/executor.rs) in the same
// order, so that a graph run node by node on the GPU gives the CPU
// executor's bits:
//
//   graph_input      columns of the input rows; NaN (missing) reads as 0
//   dense_f32        acc = fma(x[k], w[o][k], acc) for k = 0, 1, ... from 0
//                    (src/score/cpu/tiles.rs), then acc + bias, then the
//                    activation
//   graph_activation the activations of src/score/cpu/activation.rs, the
//                    same additions and multiplications (never contracted)
//   elementwise      a op b, b one wide (one value per row) or as wide as a
//   copy_columns     one input of a Concat into its columns
//   affine           (x - center) * scale + shift
//   layer_norm       mean and variance by the CPU's `lanes_sum` (eight
//                    interleaved partial sums combined in a fixed order)
//   row_dot, row_sum the CPU's `lanes_dot` and `lanes_sum`
//   embedding        each value indexes a table row, else the default row
//
// Every float step is an explicit round-to-nearest intrinsic, so neither
// --fmad nor a fast-math flag can contract or reorder it.
//
// Launches: graph_input, graph_activation, elementwise, copy_columns,
// affine and embedding take one thread per output value: block
// NODE_THREADS, grid ceil(count / NODE_THREADS). dense_f32: block
// NODE_THREADS over outputs, grid (ceil(n / NODE_THREADS), rows).
// layer_norm, row_dot and row_sum: one thread per row, block NODE_THREADS,
// grid ceil(rows / NODE_THREADS).

#define NODE_THREADS 128

// Activation codes (src/score/gpu_layout.rs, `act_code`).
#define ACT_NONE 0
#define ACT_RELU 1
#define ACT_LEAKY_RELU 2
#define ACT_TANH 3
#define ACT_SIGMOID 4
#define ACT_GELU_ERF 5
#define ACT_GELU_TANH 6
#define ACT_SILU 7
#define ACT_ERF 8
#define ACT_SQRT 9

// Elementwise operation codes.
#define OP_ADD 0
#define OP_SUB 1
#define OP_MUL 2
#define OP_DIV 3

// activation.rs `exp`: Cephes' range reduction and polynomial, the
// input clamped to [-87, 88] (NaN stays NaN, as Rust's clamp keeps it).
__device__ __forceinline__ float act_exp(float x) {
    const float LOG2E = 1.44269504088896340736f;
    const float C1 = 0.6933594f;
    const float C2 = -2.1219444e-4f;
    const float ROUND = 12582912.0f;
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    const float big = __fadd_rn(__fmul_rn(x, LOG2E), ROUND);
    const float n = __fsub_rn(big, ROUND);
    const float r = __fsub_rn(__fsub_rn(x, __fmul_rn(n, C1)), __fmul_rn(n, C2));
    float p = 1.9875691e-4f;
    p = __fadd_rn(__fmul_rn(p, r), 1.3981999e-3f);
    p = __fadd_rn(__fmul_rn(p, r), 8.333452e-3f);
    p = __fadd_rn(__fmul_rn(p, r), 4.1665796e-2f);
    p = __fadd_rn(__fmul_rn(p, r), 1.6666665e-1f);
    p = __fadd_rn(__fmul_rn(p, r), 0.5f);
    const float e = __fadd_rn(__fadd_rn(__fmul_rn(__fmul_rn(p, r), r), r), 1.0f);
    const unsigned n_bits = __float_as_uint(big) - __float_as_uint(ROUND);
    return __fmul_rn(e, __uint_as_float((n_bits + 127u) << 23));
}

__device__ __forceinline__ float act_sigmoid(float x) {
    return __fdiv_rn(1.0f, __fadd_rn(1.0f, act_exp(-x)));
}

__device__ __forceinline__ float act_tanh(float x) {
    const float t = act_exp(__fmul_rn(-2.0f, fabsf(x)));
    const float y = __fdiv_rn(__fsub_rn(1.0f, t), __fadd_rn(1.0f, t));
    return x < 0.0f ? -y : y;
}

// erfc(a) for a >= 0 (Numerical Recipes' erfcc), e^(-a^2) with Veltkamp's split.
__device__ __forceinline__ float act_erfc_pos(float a) {
    const float t = __fdiv_rn(1.0f, __fadd_rn(1.0f, __fmul_rn(0.5f, a)));
    float p = 0.17087277f;
    p = __fsub_rn(__fmul_rn(p, t), 0.82215223f);
    p = __fadd_rn(__fmul_rn(p, t), 1.4885159f);
    p = __fsub_rn(__fmul_rn(p, t), 1.135204f);
    p = __fadd_rn(__fmul_rn(p, t), 0.27886807f);
    p = __fsub_rn(__fmul_rn(p, t), 0.18628806f);
    p = __fadd_rn(__fmul_rn(p, t), 0.09678418f);
    p = __fadd_rn(__fmul_rn(p, t), 0.37409196f);
    p = __fadd_rn(__fmul_rn(p, t), 1.0000237f);
    p = __fsub_rn(__fmul_rn(p, t), 1.2655122f);
    const float c = __fmul_rn(4097.0f, a);
    const float z = __fsub_rn(c, __fsub_rn(c, a));
    const float tail = act_exp(__fadd_rn(p, __fmul_rn(__fsub_rn(z, a), __fadd_rn(z, a))));
    return __fmul_rn(__fmul_rn(t, act_exp(-__fmul_rn(z, z))), tail);
}

__device__ __forceinline__ float act_apply(int act, float alpha, float v) {
    switch (act) {
        case ACT_RELU:
            // f32::max(v, 0): NaN gives 0, as fmaxf does.
            return fmaxf(v, 0.0f);
        case ACT_LEAKY_RELU:
            return v >= 0.0f ? v : __fmul_rn(v, alpha);
        case ACT_TANH:
            return act_tanh(v);
        case ACT_SIGMOID:
            return act_sigmoid(v);
        case ACT_GELU_ERF: {
            const float e = act_erfc_pos(fabsf(__fmul_rn(v, 0.70710678118654752440f)));
            const float one_plus_erf = v < 0.0f ? e : __fsub_rn(2.0f, e);
            return __fmul_rn(__fmul_rn(0.5f, v), one_plus_erf);
        }
        case ACT_GELU_TANH: {
            const float inner = __fadd_rn(v, __fmul_rn(__fmul_rn(__fmul_rn(0.044715f, v), v), v));
            return __fmul_rn(__fmul_rn(0.5f, v), __fadd_rn(1.0f, act_tanh(__fmul_rn(0.7978846f, inner))));
        }
        case ACT_SILU:
            return __fmul_rn(v, act_sigmoid(v));
        case ACT_ERF: {
            const float y = __fsub_rn(1.0f, act_erfc_pos(fabsf(v)));
            return v < 0.0f ? -y : y;
        }
        case ACT_SQRT:
            return __fsqrt_rn(v);
        default:
            return v;
    }
}

extern "C" __global__ void __launch_bounds__(NODE_THREADS)
graph_input(const float* __restrict__ x, int rows, int input_dim, int offset, int width, float* __restrict__ y) {
    const size_t i = (size_t)blockIdx.x * NODE_THREADS + threadIdx.x;
    if (i >= (size_t)rows * width) {
        return;
    }
    const size_t r = i / width;
    const float v = x[r * input_dim + offset + (i - r * width)];
    y[i] = v != v ? 0.0f : v;
}

// y = act(x) over `count` values; y may be x (in place), hence no __restrict__.
extern "C" __global__ void __launch_bounds__(NODE_THREADS)
graph_activation(const float* x, int count, int act, float alpha, float* y) {
    const int i = blockIdx.x * NODE_THREADS + threadIdx.x;
    if (i < count) {
        y[i] = act_apply(act, alpha, x[i]);
    }
}

extern "C" __global__ void __launch_bounds__(NODE_THREADS)
dense_f32(const float* __restrict__ x, int rows, int k, int n, const float* __restrict__ w_t,
          const float* __restrict__ bias, int act, float alpha, float* __restrict__ y) {
    const int o = blockIdx.x * NODE_THREADS + threadIdx.x;
    const int r = blockIdx.y;
    if (o >= n || r >= rows) {
        return;
    }
    const float* xr = x + (size_t)r * k;
    float acc = 0.0f;
    for (int i = 0; i < k; ++i) {
        // w_t is [k][n]: the warp's outputs read consecutive words.
        acc = __fmaf_rn(xr[i], __ldg(w_t + (size_t)i * n + o), acc);
    }
    y[(size_t)r * n + o] = act_apply(act, alpha, __fadd_rn(acc, bias[o]));
}

extern "C" __global__ void __launch_bounds__(NODE_THREADS)
elementwise(const float* __restrict__ a, const float* __restrict__ b, int rows, int width, int b_width, int op,
            float* __restrict__ y) {
    const size_t i = (size_t)blockIdx.x * NODE_THREADS + threadIdx.x;
    if (i >= (size_t)rows * width) {
        return;
    }
    const float p = a[i];
    const float q = b_width == 1 ? b[i / width] : b[i];
    float v;
    switch (op) {
        case OP_ADD:
            v = __fadd_rn(p, q);
            break;
        case OP_SUB:
            v = __fsub_rn(p, q);
            break;
        case OP_MUL:
            v = __fmul_rn(p, q);
            break;
        default:
            v = __fdiv_rn(p, q);
            break;
    }
    y[i] = v;
}

extern "C" __global__ void __launch_bounds__(NODE_THREADS)
copy_columns(const float* __restrict__ src, int rows, int src_width, float* __restrict__ dst, int dst_width,
             int at) {
    const size_t i = (size_t)blockIdx.x * NODE_THREADS + threadIdx.x;
    if (i >= (size_t)rows * src_width) {
        return;
    }
    const size_t r = i / src_width;
    dst[r * dst_width + at + (i - r * src_width)] = src[i];
}

extern "C" __global__ void __launch_bounds__(NODE_THREADS)
affine(const float* __restrict__ x, int rows, int width, const float* __restrict__ center,
       const float* __restrict__ scale, const float* __restrict__ shift, float* __restrict__ y) {
    const size_t i = (size_t)blockIdx.x * NODE_THREADS + threadIdx.x;
    if (i >= (size_t)rows * width) {
        return;
    }
    const int c = (int)(i % width);
    y[i] = __fadd_rn(__fmul_rn(__fsub_rn(x[i], center[c]), scale[c]), shift[c]);
}

// The CPU's `lanes_sum` of v (square = 0) or of (v - mean)^2 (square = 1):
// eight interleaved partial sums over whole groups of 8, the rest added in
// order from 0, combined as ((a0 + a4) + (a1 + a5)) + ((a2 + a6) + (a3 + a7)) + tail.
__device__ __forceinline__ float lanes_sum(const float* v, int width, int square, float mean) {
    float acc[8];
#pragma unroll
    for (int l = 0; l < 8; ++l) {
        acc[l] = 0.0f;
    }
    const int whole = width / 8 * 8;
    for (int i = 0; i < whole; i += 8) {
#pragma unroll
        for (int l = 0; l < 8; ++l) {
            float f = v[i + l];
            if (square) {
                const float d = __fsub_rn(f, mean);
                f = __fmul_rn(d, d);
            }
            acc[l] = __fadd_rn(acc[l], f);
        }
    }
    float tail = 0.0f;
    for (int i = whole; i < width; ++i) {
        float f = v[i];
        if (square) {
            const float d = __fsub_rn(f, mean);
            f = __fmul_rn(d, d);
        }
        tail = __fadd_rn(tail, f);
    }
    const float lo = __fadd_rn(__fadd_rn(acc[0], acc[4]), __fadd_rn(acc[1], acc[5]));
    const float hi = __fadd_rn(__fadd_rn(acc[2], acc[6]), __fadd_rn(acc[3], acc[7]));
    return __fadd_rn(__fadd_rn(lo, hi), tail);
}

extern "C" __global__ void __launch_bounds__(NODE_THREADS)
layer_norm(const float* __restrict__ x, int rows, int width, float epsilon, const float* __restrict__ scale,
           const float* __restrict__ shift, float* __restrict__ y) {
    const int r = blockIdx.x * NODE_THREADS + threadIdx.x;
    if (r >= rows) {
        return;
    }
    const float* xr = x + (size_t)r * width;
    float* yr = y + (size_t)r * width;
    const float n = (float)width;
    const float mean = __fdiv_rn(lanes_sum(xr, width, 0, 0.0f), n);
    const float var = __fdiv_rn(lanes_sum(xr, width, 1, mean), n);
    const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(var, epsilon)));
    for (int i = 0; i < width; ++i) {
        yr[i] = __fadd_rn(__fmul_rn(__fmul_rn(__fsub_rn(xr[i], mean), inv), scale[i]), shift[i]);
    }
}

// The CPU's `lanes_dot`: products rounded, then summed as `lanes_sum`.
extern "C" __global__ void __launch_bounds__(NODE_THREADS)
row_dot(const float* __restrict__ a, const float* __restrict__ b, int rows, int width, float* __restrict__ y) {
    const int r = blockIdx.x * NODE_THREADS + threadIdx.x;
    if (r >= rows) {
        return;
    }
    const float* ar = a + (size_t)r * width;
    const float* br = b + (size_t)r * width;
    float acc[8];
#pragma unroll
    for (int l = 0; l < 8; ++l) {
        acc[l] = 0.0f;
    }
    const int whole = width / 8 * 8;
    for (int i = 0; i < whole; i += 8) {
#pragma unroll
        for (int l = 0; l < 8; ++l) {
            acc[l] = __fadd_rn(acc[l], __fmul_rn(ar[i + l], br[i + l]));
        }
    }
    float tail = 0.0f;
    for (int i = whole; i < width; ++i) {
        tail = __fadd_rn(tail, __fmul_rn(ar[i], br[i]));
    }
    const float lo = __fadd_rn(__fadd_rn(acc[0], acc[4]), __fadd_rn(acc[1], acc[5]));
    const float hi = __fadd_rn(__fadd_rn(acc[2], acc[6]), __fadd_rn(acc[3], acc[7]));
    y[r] = __fadd_rn(__fadd_rn(lo, hi), tail);
}

extern "C" __global__ void __launch_bounds__(NODE_THREADS)
row_sum(const float* __restrict__ a, int rows, int width, float* __restrict__ y) {
    const int r = blockIdx.x * NODE_THREADS + threadIdx.x;
    if (r < rows) {
        y[r] = lanes_sum(a + (size_t)r * width, width, 0, 0.0f);
    }
}

// Value v of row r (in_width values) names table row v when v is an
// integer in [0, table_rows) (model::graph::embedding_index; table_rows <=
// 2^24, exact in f32); otherwise the default row. Output row r is the
// in_width looked-up rows side by side, dim each.
extern "C" __global__ void __launch_bounds__(NODE_THREADS)
embedding(const float* __restrict__ ids, int rows, int in_width, const float* __restrict__ table, int dim,
          int table_rows, const float* __restrict__ fallback, float* __restrict__ y) {
    const size_t i = (size_t)blockIdx.x * NODE_THREADS + threadIdx.x;
    const size_t out_width = (size_t)in_width * dim;
    if (i >= (size_t)rows * out_width) {
        return;
    }
    const size_t r = i / out_width;
    const size_t slot = (i - r * out_width) / dim;
    const size_t d = i - r * out_width - slot * dim;
    const float v = ids[r * in_width + slot];
    const bool hit = v >= 0.0f && v < (float)table_rows && v == truncf(v);
    y[i] = hit ? __ldg(table + (size_t)v * dim + d) : fallback[d];
}
