// What the AVX-512 matmul kernels (cpu_gemm_avx512.cpp, cpu_gemm_amx.cpp) share: float32 -> bf16 rounding of a
// vector, the store of 16 output columns, and x copied zero-padded (the bias in float32: bf16.h).
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "bf16.h"

namespace gemm512 {

enum DType : int { F32 = 0, BF16 = 1 };

// 16 float32 lanes as bf16, rounded to nearest even with NaN kept NaN (bf16.h's rule, vectorised).
inline __m256i to_bf16(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(rounded);
}

// out[m, n0 .. n0 + 16) (fewer past N) = acc + bias (float32 [N], or null), in out_dtype.
inline void store_columns(void* out, int out_dtype, int N, const float* bias, int m, int n0, __m512 acc) {
    const int count = N - n0 < 16 ? N - n0 : 16;
    const __mmask16 mask = count == 16 ? 0xffff : static_cast<__mmask16>((1u << count) - 1);
    if (bias) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(mask, bias + n0));
    const int64_t at = static_cast<int64_t>(m) * N + n0;
    if (out_dtype == BF16) _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + at, mask, to_bf16(acc));
    else _mm512_mask_storeu_ps(static_cast<float*>(out) + at, mask, acc);
}

// bf16 x [M, K] as rows of ld >= K values and `rows` >= M rows, the padding zero: x itself where nothing needs
// padding, else a copy held in `buffer`.
inline const uint16_t* padded_rows(const uint16_t* x, int M, int K, int rows, int ld, std::vector<uint16_t>& buffer) {
    if (rows == M && ld == K) return x;
    buffer.assign(static_cast<size_t>(rows) * ld, 0);
    for (int m = 0; m < M; ++m) memcpy(&buffer[static_cast<size_t>(m) * ld], x + static_cast<int64_t>(m) * K, K * 2);
    return buffer.data();
}

}  // namespace gemm512
