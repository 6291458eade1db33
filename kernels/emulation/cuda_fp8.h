// Host emulation of the part of the CUDA toolkit's cuda_fp8.h that
// kernels/fp8_dense.cu uses, for the emulated build (cuda_emu.h): E4M3
// storage, float -> E4M3 with __NV_SATFINITE, and E4M3 -> half -> float.
// Written from the CUDA Math API's definitions, independently of
// src/score/e4m3.rs, and checked against it code for code and at every
// rounding boundary by tests/cuda_emulation.rs. E5M2 and __NV_NOSAT are not
// emulated: asking for them aborts, loudly.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

typedef unsigned char __nv_fp8_storage_t;
typedef enum { __NV_NOSAT = 0, __NV_SATFINITE = 1 } __nv_saturation_t;
typedef enum { __NV_E4M3 = 0, __NV_E5M2 = 1 } __nv_fp8_interpretation_t;

struct __half_raw {
    unsigned short x;
};
struct __half {
    unsigned short x;
    __half() = default;
    __half(__half_raw r) : x(r.x) {}
};

namespace quiver_emu {
[[noreturn]] inline void fp8_unsupported(const char* what) {
    std::fprintf(stderr, "cuda_emu: %s is not emulated\n", what);
    std::abort();
}
}  // namespace quiver_emu

// Round to the nearest E4M3 value, ties to even; NaN gives 0x7F; with
// __NV_SATFINITE, magnitudes above 448 (infinities too) give +-448.
inline __nv_fp8_storage_t __nv_cvt_float_to_fp8(float x, __nv_saturation_t sat, __nv_fp8_interpretation_t kind) {
    if (kind != __NV_E4M3 || sat != __NV_SATFINITE) {
        quiver_emu::fp8_unsupported("__nv_cvt_float_to_fp8 other than E4M3 with __NV_SATFINITE");
    }
    if (std::isnan(x)) {
        return 0x7F;
    }
    const unsigned sign = std::signbit(x) ? 0x80u : 0u;
    float a = std::fabs(x);
    if (a > 448.0f) {
        return static_cast<__nv_fp8_storage_t>(sign | 0x7Eu);
    }
    // The spacing of E4M3 values around `a`: 2^(e - 3) in the binade
    // [2^e, 2^(e+1)), and 2^-9 throughout the subnormals (below 2^-6).
    int e = 0;
    std::frexp(a, &e);  // a = f * 2^e, f in [0.5, 1): the binade is 2^(e-1)
    const int quantum_exp = (e - 1 - 3) < -9 ? -9 : (e - 1 - 3);
    // Scaling by a power of two is exact; nearbyint rounds ties to even.
    const float steps = std::nearbyint(std::ldexp(a, -quantum_exp));
    a = std::ldexp(steps, quantum_exp);  // exact, at most 448
    unsigned code;
    if (a < 0.015625f) {  // 2^-6: subnormal, m * 2^-9 (8 is 2^-6 itself)
        code = static_cast<unsigned>(steps);
    } else {
        int ea = 0;
        const float f = std::frexp(a, &ea);                                    // a = f * 2^ea
        const unsigned mantissa = static_cast<unsigned>(f * 16.0f) - 8u;        // 3 bits below the leading 1
        code = (static_cast<unsigned>(ea - 1 + 7) << 3) | mantissa;
    }
    return static_cast<__nv_fp8_storage_t>(sign | code);
}

// Exact: every E4M3 value is a half; both NaN codes give the half NaN 0x7FFF.
inline __half_raw __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t v, __nv_fp8_interpretation_t kind) {
    if (kind != __NV_E4M3) {
        quiver_emu::fp8_unsupported("__nv_cvt_fp8_to_halfraw other than E4M3");
    }
    const unsigned sign = (v & 0x80u) << 8;
    const unsigned e = (v >> 3) & 0xFu, m = v & 7u;
    unsigned bits;
    if (e == 15 && m == 7) {
        return __half_raw{0x7FFF};
    } else if (e != 0) {
        bits = ((e - 7 + 15) << 10) | (m << 7);
    } else if (m == 0) {
        bits = 0;
    } else {
        // m * 2^-9, normalised: the leading one of m sets the exponent.
        int shift = 0;
        unsigned mm = m;
        while (mm < 4) {
            mm <<= 1;
            ++shift;
        }
        // mm in [4, 8): value = (mm / 4) * 2^(-7 - shift)
        bits = ((static_cast<unsigned>(-7 - shift + 15)) << 10) | ((mm - 4) << 8);
    }
    return __half_raw{static_cast<unsigned short>(sign | bits)};
}

// Exact widening of an IEEE half.
inline float __half2float(__half h) {
    const unsigned sign = (h.x & 0x8000u) ? 1u : 0u;
    const int e = (h.x >> 10) & 0x1F;
    const unsigned m = h.x & 0x3FFu;
    float v;
    if (e == 31) {
        v = m ? NAN : INFINITY;
    } else if (e == 0) {
        v = std::ldexp(static_cast<float>(m), -24);
    } else {
        v = std::ldexp(static_cast<float>(m | 0x400u), e - 25);
    }
    return sign ? -v : v;
}
