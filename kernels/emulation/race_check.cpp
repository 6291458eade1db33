// A small program that runs both entries of kernels/int8_dense.cu (or the
// copy QUIVER_EMU_KERNEL names) under the emulation, for a ThreadSanitizer
// build (tests/cuda_emulation.rs links it with int8_dense.cpp and
// -fsanitize=thread): every shared-memory access that no __syncthreads()
// orders is then a reported data race and a non-zero exit. Shapes: two
// blocks of rows (the second ragged), two blocks of outputs (the second
// ragged), k not a multiple of 4. Outputs are not checked here; the parity
// tests do that.
#include <cstdio>
#include <vector>

extern "C" int quiver_emu_launch(const char* name, const unsigned grid[3], const unsigned block[3],
                                 std::size_t shared_bytes, void** args, char* error, std::size_t error_len);

int main() {
    int rows = 9, k = 37, k4 = 40, n = 130, rows_per_block = 8;
    std::vector<float> x(rows * k), w_scale(n, 0.01f), bias(n, 0.5f), y(rows * n), logits(rows * n);
    std::vector<signed char> x_i8(rows * k), y_i8(rows * n);
    std::vector<int> w_packed(k4 / 4 * n), bias_q(n, 3);
    for (int i = 0; i < rows * k; ++i) {
        x[i] = static_cast<float>((i * 7919) % 201 - 100) / 10.0f;
        x_i8[i] = static_cast<signed char>((i * 31) % 255 - 127);
    }
    for (std::size_t i = 0; i < w_packed.size(); ++i) {
        w_packed[i] = static_cast<int>(i * 2654435761u);
    }
    const unsigned grid[3] = {static_cast<unsigned>((rows + rows_per_block - 1) / rows_per_block),
                              static_cast<unsigned>((n + 127) / 128), 1};
    const unsigned block[3] = {128, 1, 1};
    const std::size_t shared = static_cast<std::size_t>(rows_per_block) * k4;
    char error[256];

    const float* xp = x.data();
    const int* wp = w_packed.data();
    const float *sp = w_scale.data(), *bp = bias.data();
    float* yp = y.data();
    int relu = 1;
    void* dynamic_args[] = {&xp, &rows, &k, &k4, &n, &rows_per_block, &wp, &sp, &bp, &relu, &yp};
    if (quiver_emu_launch("dense_int8", grid, block, shared, dynamic_args, error, sizeof error) != 0) {
        std::fprintf(stderr, "%s\n", error);
        return 2;
    }

    const signed char* xq = x_i8.data();
    const int* bq = bias_q.data();
    signed char* yq = y_i8.data();
    float* lp = logits.data();
    float inv_s_in = 12.7f;
    int lo = -128;
    for (int input_f32 = 0; input_f32 < 2; ++input_f32) {
        int requantize = input_f32;
        void* static_args[] = {&xp, &xq, &input_f32, &inv_s_in, &rows, &k, &k4, &n, &rows_per_block,
                               &wp, &bq, &sp, &requantize, &lo, &yq, &lp};
        if (quiver_emu_launch("dense_int8_static", grid, block, shared, static_args, error, sizeof error) != 0) {
            std::fprintf(stderr, "%s\n", error);
            return 2;
        }
    }
    std::printf("ran dense_int8 and dense_int8_static\n");
    return 0;
}
