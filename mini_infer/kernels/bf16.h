// bfloat16 <-> float32 for the CPU kernels (a bf16 is the high half of a float32), and the scalar loads and stores
// of float32-or-bf16 data that the matmul kernels share (dtype codes: 0 float32, 1 bfloat16, as kernels/cpu.py's).
#pragma once

#include <stdint.h>
#include <string.h>

#include <vector>

inline float bf16_to_f32(uint16_t v) {
    uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN stays NaN
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
    return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// Element i of float32 or bfloat16 (dtype 1) data, as float32.
inline float load_as_f32(const void* data, int dtype, int64_t i) {
    return dtype == 1 ? bf16_to_f32(static_cast<const uint16_t*>(data)[i]) : static_cast<const float*>(data)[i];
}

// bias [N] (float32 or bfloat16, or null: empty) in float32.
inline std::vector<float> bias_as_f32(const void* bias, int bias_dtype, int N) {
    std::vector<float> out(bias ? N : 0);
    for (int n = 0; n < static_cast<int>(out.size()); ++n) out[n] = load_as_f32(bias, bias_dtype, n);
    return out;
}

// out[m, n0 .. n0 + 16) (fewer past N) = values + bias (float32 [N], or null), in out_dtype (bf16 rounded).
inline void store_columns_f32(void* out, int out_dtype, int N, const float* bias, int m, int n0, const float* values) {
    const int count = N - n0 < 16 ? N - n0 : 16;
    const int64_t row = static_cast<int64_t>(m) * N + n0;
    for (int c = 0; c < count; ++c) {
        const float v = values[c] + (bias ? bias[n0 + c] : 0.0f);
        if (out_dtype == 1) static_cast<uint16_t*>(out)[row + c] = f32_to_bf16(v);
        else static_cast<float*>(out)[row + c] = v;
    }
}
