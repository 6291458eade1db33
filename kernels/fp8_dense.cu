// One dense layer with FP8 E4M3 operands and f32 accumulation. Compile-checked
// only: the CPU does not implement these semantics yet, so there is nothing
// to be bit-exact against, and the server does not launch it.
//
// Semantics (the contract a future CPU reference must implement):
//   weights  w8[o][k] = E4M3(w[o][k] / s_w), one per-tensor scale
//            s_w = max|w| / 448, encoded on the host with src/score/e4m3.rs;
//   inputs   x8[k]    = E4M3(x[k] * inv_s_x), one per-tensor scale s_x given
//            per layer (calibrated offline), inv_s_x = 1 / s_x rounded once
//            on the host, converted here with
//            __NV_SATFINITE: NaN -> 0x7F, |v| > 448 -> +-448, ties to even,
//            exactly src/score/e4m3.rs::from_f32;
//   acc      = fma(x8[k], w8[o][k], acc) for k = 0, 1, ..., K - 1, in that
//            order, in f32 (every product is exact, so only the additions
//            round);
//   y        = acc * (s_w * s_x) + bias[o], then ReLU, without contraction.
//
// Launch: one thread per output (row, o): blockDim.x = FP8_THREADS,
// grid = (ceil(n / FP8_THREADS), rows).

#include <cuda_fp8.h>

#define FP8_THREADS 128

__device__ __forceinline__ float fp8_to_float(__nv_fp8_storage_t v) {
    return __half2float(__half(__nv_cvt_fp8_to_halfraw(v, __NV_E4M3)));
}

extern "C" __global__ void __launch_bounds__(FP8_THREADS)
dense_fp8(const float* __restrict__ x, int rows, int k, int n,
          const __nv_fp8_storage_t* __restrict__ w8, float s_w, float inv_s_x, float s_x,
          const float* __restrict__ bias, int relu, float* __restrict__ y) {
    const int o = blockIdx.x * FP8_THREADS + threadIdx.x;
    const int row = blockIdx.y;
    if (o >= n || row >= rows) {
        return;
    }
    const float* xr = x + (size_t)row * k;
    const __nv_fp8_storage_t* wr = w8 + (size_t)o * k;
    float acc = 0.0f;
    for (int i = 0; i < k; ++i) {
        const __nv_fp8_storage_t xq = __nv_cvt_float_to_fp8(__fmul_rn(xr[i], inv_s_x), __NV_SATFINITE, __NV_E4M3);
        acc = __fmaf_rn(fp8_to_float(xq), fp8_to_float(wr[i]), acc);
    }
    float v = __fadd_rn(__fmul_rn(acc, __fmul_rn(s_w, s_x)), bias[o]);
    if (relu) {
        v = fmaxf(v, 0.0f);
    }
    y[(size_t)row * n + o] = v;
}
