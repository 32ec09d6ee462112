// out[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) in float32 arithmetic, with w stored as bfloat16 or float32.
//
// For CPUs without native bf16 matmul (AVX2 + FMA only): bf16 weights are widened to float32 in registers
// (a bf16 is the high half of a float32), so each weight byte is read from memory once per call and every
// multiply-add runs on the float32 FMA units. Dot-product form over K, tiles of MR rows of x by NR rows of w;
// threads split the output columns, so each thread streams its own slice of w.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

namespace {

constexpr int NR = 3;  // rows of w per tile; MR (rows of x) is at most 4: 12 accumulators + 3 w + 1 x = 16 ymm

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline float scalar(float v) { return v; }
inline float scalar(uint16_t v) {
    uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    __builtin_memcpy(&f, &bits, sizeof f);
    return f;
}
inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// One MR x nr tile of out: rows m0.. of x against rows n0.. of w.
template <int MR, int nr, typename W>
inline void tile(const float* x, const W* w, const float* bias, float* out, int K, int N, int m0, int n0) {
    __m256 acc[MR][nr];
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 3
        for (int j = 0; j < nr; ++j) acc[i][j] = _mm256_setzero_ps();
    const int k8 = K & ~7;
    for (int k = 0; k < k8; k += 8) {
        __m256 wv[nr];
#pragma GCC unroll 3
        for (int j = 0; j < nr; ++j) wv[j] = load8(w + (int64_t)(n0 + j) * K + k);
#pragma GCC unroll 4
        for (int i = 0; i < MR; ++i) {
            __m256 xv = _mm256_loadu_ps(x + (int64_t)(m0 + i) * K + k);
#pragma GCC unroll 3
            for (int j = 0; j < nr; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < nr; ++j) {
            float s = hsum(acc[i][j]);
            for (int k = k8; k < K; ++k) s += x[(int64_t)(m0 + i) * K + k] * scalar(w[(int64_t)(n0 + j) * K + k]);
            out[(int64_t)(m0 + i) * N + n0 + j] = s + (bias ? bias[n0 + j] : 0.0f);
        }
}

template <int nr, typename W>
inline void column_block(const float* x, const W* w, const float* bias, float* out, int K, int N, int m_begin,
                         int m_end, int n0) {
    int m = m_begin;
    for (; m + 4 <= m_end; m += 4) tile<4, nr>(x, w, bias, out, K, N, m, n0);
    switch (m_end - m) {
        case 3: tile<3, nr>(x, w, bias, out, K, N, m, n0); break;
        case 2: tile<2, nr>(x, w, bias, out, K, N, m, n0); break;
        case 1: tile<1, nr>(x, w, bias, out, K, N, m, n0); break;
        default: break;
    }
}

template <typename W>
void gemm(const float* x, const W* w, const float* bias, float* out, int M, int N, int K, int threads) {
    // Rows of x per pass: keep the pass's slice of x (rows x K floats) within about 256 KiB of L2.
    int m_chunk = (256 * 1024) / (4 * K);
    m_chunk = m_chunk < 4 ? 4 : (m_chunk > 64 ? 64 : m_chunk & ~3);
    const int n_tiles = N / NR;
    const int n_tail = N - n_tiles * NR;
#pragma omp parallel num_threads(threads)
    for (int m_begin = 0; m_begin < M; m_begin += m_chunk) {
        const int m_end = m_begin + m_chunk < M ? m_begin + m_chunk : M;
#pragma omp for schedule(static)
        for (int t = 0; t < n_tiles; ++t) column_block<NR>(x, w, bias, out, K, N, m_begin, m_end, t * NR);
#pragma omp single
        {
            if (n_tail == 2) column_block<2>(x, w, bias, out, K, N, m_begin, m_end, n_tiles * NR);
            if (n_tail == 1) column_block<1>(x, w, bias, out, K, N, m_begin, m_end, n_tiles * NR);
        }
    }
}

}  // namespace

extern "C" {
void gemm_bf16(const float* x, const uint16_t* w, const float* bias, float* out, int M, int N, int K, int threads) {
    gemm(x, w, bias, out, M, N, K, threads);
}
void gemm_f32(const float* x, const float* w, const float* bias, float* out, int M, int N, int K, int threads) {
    gemm(x, w, bias, out, M, N, K, threads);
}
}
