// The host build of kernels/trees.cu under cuda_emu.h (see int8_dense.cpp):
// the kernel source as NVRTC compiles it, the storage of its __shared__
// leaf buffer, and its launch entry point. QUIVER_EMU_KERNEL names another
// copy of the source (a test's deliberately broken one).
#ifndef QUIVER_EMU_KERNEL
#define QUIVER_EMU_KERNEL "../trees.cu"
#endif
#include QUIVER_EMU_KERNEL

QUIVER_EMU_STATIC_SHARED(float, tree_leaves, [TREE_CHUNK][TREE_ROWS]);

QUIVER_EMU_ENTRIES(QUIVER_EMU_ENTRY(trees_predict))
