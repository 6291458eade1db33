// The INT8 model's dense layers, fused, in the two activation semantics of
// the CPU INT8 backend (src/score/cpu/mod.rs), each bit for bit:
//
// dense_int8 (dynamic, uncalibrated models): per-row activation
// quantization, int32 dot products, and a float scale/bias/ReLU epilogue:
//   s_x  = max|x| / 127   (1 when the row is all zeros; NaN is ignored by the max)
//   x_q  = clamp(round_ties_even(x * (1 / s_x)), -127, 127)   (NaN gives 0)
//   acc  = sum_k x_q[k] * w[o][k]                              (int32, exact)
//   y    = (float)acc * (s_w[o] * s_x) + bias[o], then ReLU   (no FMA)
//
// dense_int8_static (static, calibrated models; constants from the host's
// Model::static_int8, so CPU and GPU cannot disagree on them): int8
// activations from layer to layer,
//   layer 0 input  x_q = clamp(round_ties_even(x * inv_s_in), -128, 127)  (NaN gives 0;
//                  inv_s_in = f32(1 / s_in), rounded once on the host as the CPU does)
//   acc  = sum_k x_q[k] * w[o][k] + bias_q[o]                  (int32, exact)
//   hidden layer   y_q = clamp(round_ties_even((float)acc * scale[o]), lo, 127)
//                  (lo = 0 for a fused ReLU, -128 without)
//   output layer   logit = (float)acc * scale[o]               (f32; sigmoid on the host)
//
// Every float step is an explicit IEEE round-to-nearest intrinsic so that
// neither --fmad nor a future fast-math flag can contract or reorder it.
//
// Layout: weights are packed on the host as 32-bit words, four consecutive k
// per word, transposed to [k4 / 4][n] so that the threads of a warp (one
// output channel each) read consecutive words; k is padded to k4 with zero
// weights. The block's rows are quantized (or, for int8 inputs, copied) once
// into shared memory, also padded with zeros, and every thread then sweeps
// the whole K for its output channel against all of them with __dp4a.
//
// Launch (both entries): blockDim.x = DENSE_THREADS; grid = (ceil(rows /
// rows_per_block), ceil(n / DENSE_THREADS)); dynamic shared memory =
// rows_per_block * k4 bytes, with 1 <= rows_per_block <= DENSE_ROWS_MAX
// chosen by the host to stay within 48 KiB.

#define DENSE_THREADS 128
#define DENSE_ROWS_MAX 8
#define WARP 32

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int offset = WARP / 2; offset > 0; offset /= 2) {
        // fmaxf returns the other operand when one is NaN, like f32::max.
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    }
    return v;
}

// Round to nearest even and clamp to [-127, 127], as the CPU's
// `round_ties_even().clamp(-127.0, 127.0) as i8`: cvt.rni saturates at the
// int32 range and turns NaN into 0, so clamping the integer is enough.
__device__ __forceinline__ int round_clamp_127(float v) {
    int q = __float2int_rn(v);
    return min(max(q, -127), 127);
}

// The static semantics' `round_clamp_i8(v, lo)`: round to nearest even, then
// clamp to [lo, 127]; as above, cvt.rni saturates and maps NaN to 0, which
// is what Rust's `NaN.clamp(..) as i8` gives too.
__device__ __forceinline__ int round_clamp_lo(float v, int lo) {
    int q = __float2int_rn(v);
    return min(max(q, lo), 127);
}

extern "C" __global__ void __launch_bounds__(DENSE_THREADS)
dense_int8(const float* __restrict__ x, int rows, int k, int k4, int n, int rows_per_block,
           const int* __restrict__ w_packed, const float* __restrict__ w_scale,
           const float* __restrict__ bias, int relu, float* __restrict__ y) {
    extern __shared__ int xq_shared[];
    __shared__ float sx_shared[DENSE_ROWS_MAX];

    const int row0 = blockIdx.x * rows_per_block;
    const int rows_here = min(rows_per_block, rows - row0);
    const int warp = threadIdx.x / WARP;
    const int lane = threadIdx.x % WARP;
    signed char* xq_bytes = reinterpret_cast<signed char*>(xq_shared);

    // Quantize: one warp per row.
    for (int r = warp; r < rows_here; r += DENSE_THREADS / WARP) {
        const float* xr = x + (size_t)(row0 + r) * k;
        float m = 0.0f;
        for (int i = lane; i < k; i += WARP) {
            m = fmaxf(m, fabsf(xr[i]));
        }
        m = warp_max(m);
        const float s_x = m > 0.0f ? __fdiv_rn(m, 127.0f) : 1.0f;
        const float inv = __fdiv_rn(1.0f, s_x);
        signed char* dst = xq_bytes + r * k4;
        for (int i = lane; i < k4; i += WARP) {
            dst[i] = i < k ? (signed char)round_clamp_127(__fmul_rn(xr[i], inv)) : 0;
        }
        if (lane == 0) {
            sx_shared[r] = s_x;
        }
    }
    __syncthreads();

    const int o = blockIdx.y * DENSE_THREADS + threadIdx.x;
    if (o >= n) {
        return;
    }
    const int kw = k4 / 4;
    int acc[DENSE_ROWS_MAX];
#pragma unroll
    for (int r = 0; r < DENSE_ROWS_MAX; ++r) {
        acc[r] = 0;
    }
    for (int j = 0; j < kw; ++j) {
        const int w = __ldg(w_packed + (size_t)j * n + o);
#pragma unroll
        for (int r = 0; r < DENSE_ROWS_MAX; ++r) {
            if (r < rows_here) {
                acc[r] = __dp4a(xq_shared[r * kw + j], w, acc[r]);
            }
        }
    }

    const float s_w = w_scale[o];
    const float b = bias[o];
#pragma unroll
    for (int r = 0; r < DENSE_ROWS_MAX; ++r) {
        if (r < rows_here) {
            float v = __fadd_rn(__fmul_rn(__int2float_rn(acc[r]), __fmul_rn(s_w, sx_shared[r])), b);
            if (relu) {
                v = fmaxf(v, 0.0f);
            }
            y[(size_t)(row0 + r) * n + o] = v;
        }
    }
}

// One dense layer of a calibrated model (static INT8). Layer 0
// (`input_f32` != 0) reads the f32 input rows `x_f32` ([rows][k]) and
// quantizes them with `inv_s_in`; every later layer reads the previous
// layer's int8 output `x_i8` ([rows][k]). A hidden layer (`requantize` != 0)
// writes int8 `y_i8` ([rows][n]); the output layer writes f32 logits `y_f32`
// ([rows][n], n = 1 for a scoring model). The host passes four distinct
// buffers, the unused ones included, so `__restrict__` holds.
extern "C" __global__ void __launch_bounds__(DENSE_THREADS)
dense_int8_static(const float* __restrict__ x_f32, const signed char* __restrict__ x_i8, int input_f32,
                  float inv_s_in, int rows, int k, int k4, int n, int rows_per_block, const int* __restrict__ w_packed,
                  const int* __restrict__ bias_q, const float* __restrict__ scale, int requantize, int lo,
                  signed char* __restrict__ y_i8, float* __restrict__ y_f32) {
    extern __shared__ int xq_shared[];

    const int row0 = blockIdx.x * rows_per_block;
    const int rows_here = min(rows_per_block, rows - row0);
    signed char* xq_bytes = reinterpret_cast<signed char*>(xq_shared);

    // Stage the block's rows as int8 in shared memory, zero-padded to k4.
    // Consecutive threads take consecutive k of a row, so global reads are
    // coalesced within a row.
    const int staged = rows_here * k4;
    for (int idx = threadIdx.x; idx < staged; idx += DENSE_THREADS) {
        const int r = idx / k4;
        const int i = idx - r * k4;
        int q = 0;
        if (i < k) {
            const size_t at = (size_t)(row0 + r) * k + i;
            q = input_f32 ? round_clamp_lo(__fmul_rn(x_f32[at], inv_s_in), -128) : (int)x_i8[at];
        }
        xq_bytes[idx] = (signed char)q;
    }
    __syncthreads();

    const int o = blockIdx.y * DENSE_THREADS + threadIdx.x;
    if (o >= n) {
        return;
    }
    const int kw = k4 / 4;
    int acc[DENSE_ROWS_MAX];
#pragma unroll
    for (int r = 0; r < DENSE_ROWS_MAX; ++r) {
        acc[r] = 0;
    }
    for (int j = 0; j < kw; ++j) {
        const int w = __ldg(w_packed + (size_t)j * n + o);
#pragma unroll
        for (int r = 0; r < DENSE_ROWS_MAX; ++r) {
            if (r < rows_here) {
                acc[r] = __dp4a(xq_shared[r * kw + j], w, acc[r]);
            }
        }
    }

    // |acc| < 2^28 and |bias_q| <= 2^30 (BIAS_Q_MAX): the sum cannot overflow.
    const int b = bias_q[o];
    const float s = scale[o];
#pragma unroll
    for (int r = 0; r < DENSE_ROWS_MAX; ++r) {
        if (r < rows_here) {
            const float v = __fmul_rn(__int2float_rn(acc[r] + b), s);
            const size_t at = (size_t)(row0 + r) * n + o;
            if (requantize) {
                y_i8[at] = (signed char)round_clamp_lo(v, lo);
            } else {
                y_f32[at] = v;
            }
        }
    }
}
