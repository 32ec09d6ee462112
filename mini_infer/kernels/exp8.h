// A vectorised float32 exp for the CPU kernels (AVX2 + FMA), shared by the fused elementwise kernels (silu) and
// decode attention (softmax).
#pragma once

#include <immintrin.h>
#include <math.h>

// exp of eight float32 values: 2^k * p(r) with r = x - k ln2 in [-ln2/2, ln2/2] and p the degree-7
// Taylor polynomial (its truncation error there is ~0.05 ulp); overflow gives inf and underflow 0, as expf.
inline __m256 exp8(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.7228394f), lo = _mm256_set1_ps(-103.972076f);
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693145752f), x);  // ln2 split in two for an exact k * ln2
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(1.42860677e-06f), r);
    const float inverse_factorials[] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
    __m256 p = _mm256_set1_ps(inverse_factorials[0]);
    for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(inverse_factorials[i]));
    // 2^k in two factors so that k down to -150 (a subnormal result) stays representable.
    const __m256i ki = _mm256_cvtps_epi32(k), half = _mm256_srai_epi32(ki, 1);
    auto power = [](__m256i e) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23)); };
    __m256 result = _mm256_mul_ps(_mm256_mul_ps(p, power(half)), power(_mm256_sub_epi32(ki, half)));
    result = _mm256_blendv_ps(result, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x, hi, _CMP_GT_OQ));
    result = _mm256_blendv_ps(result, _mm256_setzero_ps(), _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
    return _mm256_blendv_ps(result, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));  // NaN stays NaN
}
