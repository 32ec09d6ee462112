// What the AMX kernels (cpu_gemm_amx.cpp, cpu_gemm_quant.cpp's AMX build) share: the tile instructions by register
// number, a compile-time unroll, the tile configuration, and the process's permission to use the tile data.
#pragma once

#include <errno.h>
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <utility>

namespace amx {

// GCC's intrinsics paste the register number into the asm text, so they take literals only; a template argument
// goes through an "i" operand instead.
template <int T>
inline void tile_zero() { asm volatile("tilezero %%tmm%c0" ::"i"(T)); }
template <int T>
inline void tile_load(const void* base, int64_t stride) {
    asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(base), "r"(stride), "i"(T) : "memory");
}
template <int T>
inline void tile_store(void* base, int64_t stride) {
    asm volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(base), "r"(stride), "i"(T) : "memory");
}
template <int C, int A, int B>  // C += A (x rows, bf16 pairs) . B (w, bf16 pairs)
inline void tile_dp() { asm volatile("tdpbf16ps %%tmm%c0, %%tmm%c1, %%tmm%c2" ::"i"(B), "i"(A), "i"(C)); }

template <typename F, int... I>
inline void unroll_seq(F&& f, std::integer_sequence<int, I...>) { (f(std::integral_constant<int, I>{}), ...); }
template <int N, typename F>
inline void unroll(F&& f) { unroll_seq(f, std::make_integer_sequence<int, N>{}); }

struct alignas(64) TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// Tile t of `rows` rows of `colsb` bytes, for each t of the eight (palette 1).
inline void configure(const uint8_t (&rows)[8], const uint16_t (&colsb)[8]) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; ++t) config.colsb[t] = colsb[t], config.rows[t] = rows[t];
    // As an asm that reads `config`: GCC 12's _tile_loadconfig let the stores above be dropped as dead.
    asm volatile("ldtilecfg %0" ::"m"(config));
}

// Linux grants a process the AMX tile data on request, once: 0 when granted, else the errno of the refusal.
inline int request_tile_data() {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : errno;
}

}  // namespace amx
