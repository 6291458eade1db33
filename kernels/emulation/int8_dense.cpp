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
