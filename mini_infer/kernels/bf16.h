// bfloat16 <-> float32 for the CPU kernels: a bf16 is the high half of a float32.
#pragma once

#include <stdint.h>
#include <string.h>

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
