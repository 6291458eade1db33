// The host build of kernels/graph_nodes.cu under cuda_emu.h (see
// int8_dense.cpp). Its kernels use no shared memory.
#ifndef QUIVER_EMU_KERNEL
#define QUIVER_EMU_KERNEL "../graph_nodes.cu"
#endif
#include QUIVER_EMU_KERNEL

QUIVER_EMU_ENTRIES(QUIVER_EMU_ENTRY(graph_input), QUIVER_EMU_ENTRY(graph_activation), QUIVER_EMU_ENTRY(dense_f32),
                   QUIVER_EMU_ENTRY(elementwise), QUIVER_EMU_ENTRY(copy_columns), QUIVER_EMU_ENTRY(affine),
                   QUIVER_EMU_ENTRY(layer_norm), QUIVER_EMU_ENTRY(row_dot), QUIVER_EMU_ENTRY(row_sum),
                   QUIVER_EMU_ENTRY(embedding))

// The activations alone, so that the test can hold them to
// src/score/cpu/activation.rs over a sweep of values.
extern "C" float quiver_emu_activation(int act, float alpha, float v) {
    return act_apply(act, alpha, v);
}
