// The host build of kernels/fp8_dense.cu under cuda_emu.h (see
// int8_dense.cpp); its `#include <cuda_fp8.h>` finds this directory's
// emulation of that header. The kernel uses no shared memory.
#ifndef QUIVER_EMU_KERNEL
#define QUIVER_EMU_KERNEL "../fp8_dense.cu"
#endif
#include QUIVER_EMU_KERNEL

QUIVER_EMU_ENTRIES(QUIVER_EMU_ENTRY(dense_fp8))

// The emulated conversions alone, so that the test can hold them to
// src/score/e4m3.rs over every code and every rounding boundary.
extern "C" unsigned char quiver_emu_e4m3_from_f32(float x) {
    return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
}
extern "C" float quiver_emu_e4m3_to_f32(unsigned char code) {
    return __half2float(__half(__nv_cvt_fp8_to_halfraw(code, __NV_E4M3)));
}
