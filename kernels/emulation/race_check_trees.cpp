// A small program that runs kernels/trees.cu (or the copy QUIVER_EMU_KERNEL
// names) under the emulation, for a ThreadSanitizer build
// (tests/cuda_emulation.rs links it with trees.cpp and -fsanitize=thread):
// an access to the shared leaf buffer that no __syncthreads() orders is
// then a reported data race and a non-zero exit. Shape: two blocks of rows
// (the second ragged) and three chunks of trees (the last ragged), so the
// leaf buffer is refilled while rows are still summing. Outputs are not
// checked here; the parity tests do that.
#include <cstdio>
#include <cstring>
#include <vector>

extern "C" int quiver_emu_launch(const char* name, const unsigned grid[3], const unsigned block[3],
                                 std::size_t shared_bytes, void** args, char* error, std::size_t error_len);

namespace {
struct Node {
    unsigned x, y, z, w;
};
unsigned bits(float f) {
    unsigned u;
    std::memcpy(&u, &f, sizeof u);
    return u;
}
}  // namespace

int main() {
    int rows = 40, stride = 3, column0 = 0, trees = 70, y_stride = 1;
    std::vector<float> x(rows * stride), y(rows);
    for (int i = 0; i < rows * stride; ++i) {
        x[i] = static_cast<float>((i * 7919) % 201 - 100) / 50.0f;
    }
    // Every tree a stump on feature t % 3: left leaf t, right leaf -t.
    alignas(16) static Node nodes[70 * 3];
    std::vector<unsigned> roots(trees), cat(1, 0);
    for (int t = 0; t < trees; ++t) {
        const unsigned r = 3u * t;
        roots[t] = r;
        nodes[r] = Node{bits(0.0f), static_cast<unsigned>(t % 3), r + 1, r + 2};
        nodes[r + 1] = Node{bits(static_cast<float>(t)), 1u << 24, 0, 0};
        nodes[r + 2] = Node{bits(-static_cast<float>(t)), 1u << 24, 0, 0};
    }
    const float* xp = x.data();
    const Node* np = nodes;
    const unsigned *rp = roots.data(), *cp = cat.data();
    float base = 0.5f;
    float* yp = y.data();
    void* args[] = {&xp, &rows, &stride, &column0, &np, &rp, &trees, &cp, &base, &yp, &y_stride};
    const unsigned grid[3] = {2, 1, 1};
    const unsigned block[3] = {32, 4, 1};
    char error[256];
    if (quiver_emu_launch("trees_predict", grid, block, 0, args, error, sizeof error) != 0) {
        std::fprintf(stderr, "%s\n", error);
        return 2;
    }
    std::printf("ran trees_predict\n");
    return 0;
}
