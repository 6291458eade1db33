// The host build of kernels/int8_dense.cu under cuda_emu.h (compiled with
// `-include cuda_emu.h` by tests/cuda_emulation.rs): the kernel source as
// NVRTC compiles it, the storage of its __shared__ variables, and its
// launch entry point. QUIVER_EMU_KERNEL names another copy of the source
// (a test's deliberately broken one); the storage below must declare every
// __shared__ variable the source declares, or the library does not link.
#ifndef QUIVER_EMU_KERNEL
#define QUIVER_EMU_KERNEL "../int8_dense.cu"
#endif
#include QUIVER_EMU_KERNEL

QUIVER_EMU_DYNAMIC_SHARED(int, xq_shared);
QUIVER_EMU_STATIC_SHARED(float, sx_shared, [DENSE_ROWS_MAX]);

QUIVER_EMU_ENTRIES(QUIVER_EMU_ENTRY(dense_int8), QUIVER_EMU_ENTRY(dense_int8_static))

// The emulated integer intrinsics alone, so that the test can hold them to
// their definitions at the edges (saturation, NaN, ties, wrap-around).
extern "C" int quiver_emu_float2int_rn(float v) {
    return __float2int_rn(v);
}
extern "C" float quiver_emu_int2float_rn(int v) {
    return __int2float_rn(v);
}
extern "C" int quiver_emu_dp4a(int a, int b, int c) {
    return __dp4a(a, b, c);
}
