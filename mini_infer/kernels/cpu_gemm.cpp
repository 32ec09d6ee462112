// out[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) in float32 arithmetic, for CPUs with AVX2 + FMA.
//
// w arrives packed in panels of 16 output columns, [ceil(N / 16), K, 16], float32 or bfloat16, so a tile walks
// its panels as one sequential stream. A bf16 is the high half of a float32: one 32-byte load of a panel row
// (16 bf16) becomes two float32 vectors with a shift (even columns) and a mask (odd columns). Each step
// broadcasts x[m, k] and does one FMA per 8 columns (outer-product form): tiles of MR rows of x by NP panels
// keep 2 * MR * NP accumulators in the 16 vector registers. Threads take runs of panels in turn.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <atomic>
#include <vector>

#include "bf16.h"
#include "panel_runs.h"

namespace {

enum DType : int { F32 = 0, BF16 = 1 };
constexpr int PANEL = 16;
// Tiles of two rows or more prefetch their panels' stream this far ahead, into L1; one row leaves it to the hardware
// prefetcher. On a 2-core Zen 3 (bf16 weights, each row count's matmuls over a decode step's weight shapes, timed
// against the kernel without it in 15 shuffled rounds), 2 KB ahead ran 3-8 rows of the 0.5B shape 0.72-0.92x as
// long (3 rows: with one panel a tile, no longer two), 1 and 2 rows alike; the 7B shape's 3, 5 and 8 rows 0.85x,
// 0.79x, 0.89x. 1-4 KB measured alike.
constexpr int PREFETCH_BYTES = 2048;

// One panel row (16 columns) as two float32 vectors a, b, and how to put them back in column order.
struct F32Weights {
    using T = float;
    static inline void load(const float* p, __m256& a, __m256& b) {
        a = _mm256_loadu_ps(p);
        b = _mm256_loadu_ps(p + 8);
    }
    static inline void columns(__m256 a, __m256 b, float* dst) {
        _mm256_storeu_ps(dst, a);
        _mm256_storeu_ps(dst + 8, b);
    }
};

struct BF16Weights {
    using T = uint16_t;
    static inline void load(const uint16_t* p, __m256& evens, __m256& odds) {
        __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        evens = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        odds = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
    }
    static inline void columns(__m256 evens, __m256 odds, float* dst) {
        const __m256 lo = _mm256_unpacklo_ps(evens, odds), hi = _mm256_unpackhi_ps(evens, odds);
        _mm256_storeu_ps(dst, _mm256_permute2f128_ps(lo, hi, 0x20));
        _mm256_storeu_ps(dst + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
    }
};

struct Problem {
    const float* x;  // float32 [M, K]
    const float* bias;  // float32 [N] or null
    void* out;
    int out_dtype, M, N, K;
};

// Rows m0..m0+MR of out against panels panel0..panel0+NP.
template <int MR, int NP, typename WT>
inline void tile(const Problem& p, const typename WT::T* w, int m0, int panel0) {
    __m256 acc[MR][NP][2];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
        for (int j = 0; j < NP; ++j) acc[i][j][0] = acc[i][j][1] = _mm256_setzero_ps();
    const int K = p.K;
    const float* x = p.x + static_cast<int64_t>(m0) * K;
    const typename WT::T* panel = w + static_cast<int64_t>(panel0) * K * PANEL;
    const auto step = [&](int k) {
#pragma GCC unroll 8
        for (int j = 0; j < NP; ++j) {
            __m256 w0, w1;
            WT::load(panel + (static_cast<int64_t>(j) * K + k) * PANEL, w0, w1);
#pragma GCC unroll 8
            for (int i = 0; i < MR; ++i) {
                const __m256 xv = _mm256_broadcast_ss(x + static_cast<int64_t>(i) * K + k);
                acc[i][j][0] = _mm256_fmadd_ps(xv, w0, acc[i][j][0]);
                acc[i][j][1] = _mm256_fmadd_ps(xv, w1, acc[i][j][1]);
            }
        }
    };
    // A cache line of each panel at a time, its line PREFETCH_BYTES ahead requested first (tiles of 2 rows or more).
    constexpr int LINE_K = 64 / (PANEL * sizeof(typename WT::T));
    int k = 0;
    for (; k + LINE_K <= K; k += LINE_K) {
        if constexpr (MR >= 2)
#pragma GCC unroll 8
            for (int j = 0; j < NP; ++j)
                _mm_prefetch(reinterpret_cast<const char*>(panel + (static_cast<int64_t>(j) * K + k) * PANEL) +
                                 PREFETCH_BYTES,
                             _MM_HINT_T0);
#pragma GCC unroll 4
        for (int u = 0; u < LINE_K; ++u) step(k + u);
    }
    for (; k < K; ++k) step(k);
    alignas(32) float values[PANEL];
    // Unrolled like the loops above: with constant indices the accumulators never leave the registers.
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
        for (int j = 0; j < NP; ++j) {
            WT::columns(acc[i][j][0], acc[i][j][1], values);
            store_columns_f32(p.out, p.out_dtype, p.N, p.bias, m0 + i, (panel0 + j) * PANEL, values);
        }
}

// All rows of out against NP panels: 6-row tiles (12 accumulators), then the remaining rows.
template <int NP, typename WT>
inline void panel_group(const Problem& p, const typename WT::T* w, int panel0) {
    int m = 0;
    for (; m + 6 <= p.M; m += 6) tile<6, NP, WT>(p, w, m, panel0);
    switch (p.M - m) {
        case 5: tile<5, NP, WT>(p, w, m, panel0); break;
        case 4: tile<4, NP, WT>(p, w, m, panel0); break;
        case 3: tile<3, NP, WT>(p, w, m, panel0); break;
        case 2: tile<2, NP, WT>(p, w, m, panel0); break;
        case 1: tile<1, NP, WT>(p, w, m, panel0); break;
        default: break;
    }
}

// The threads take runs of panel groups in turn (panel_runs.h), then the panels left over one each. Against an even
// share each, on a 2-core Zen 3 VM (five runs of 11-15 shuffled rounds over the 7B shape's projections, the same
// bits): 5 rows 0.97-1.02x as long (four of five runs under 0.98x), 8 rows 0.92-1.01x, 1 row 0.96-1.01x.
template <int NP, typename WT>
void run_groups(const Problem& p, const typename WT::T* w, int threads) {
    const int panels = (p.N + PANEL - 1) / PANEL, groups = panels / NP;
    std::atomic<int> next{0};
#pragma omp parallel num_threads(threads)
    {
        take_runs(next, groups, 4, [&](int begin, int end) {
            for (int g = begin; g < end; ++g) panel_group<NP, WT>(p, w, g * NP);
        });
#pragma omp for schedule(static)
        for (int q = groups * NP; q < panels; ++q) panel_group<1, WT>(p, w, q);
    }
}

// One or two rows leave registers for more panels per tile: more independent FMA chains, fewer broadcasts. (Three
// rows in tiles of two panels ran 1.2-1.4x as long as in tiles of one, prefetched, on that Zen 3.)
template <typename WT>
void run(const Problem& p, const typename WT::T* w, int threads) {
    switch (p.M) {
        case 1: run_groups<4, WT>(p, w, threads); break;
        case 2: run_groups<3, WT>(p, w, threads); break;
        default: run_groups<1, WT>(p, w, threads); break;
    }
}

}  // namespace

extern "C" void gemm(const void* x, int x_dtype, const void* w, int w_dtype, const void* bias, int bias_dtype,
                     void* out, int out_dtype, int M, int N, int K, int threads) {
    std::vector<float> x32;
    if (x_dtype == BF16) {
        x32.resize(static_cast<size_t>(M) * K);
        for (size_t i = 0; i < x32.size(); ++i) x32[i] = load_as_f32(x, x_dtype, static_cast<int64_t>(i));
    }
    const std::vector<float> bias32 = bias_as_f32(bias, bias_dtype, N);
    const Problem p{x_dtype == BF16 ? x32.data() : static_cast<const float*>(x), bias ? bias32.data() : nullptr,
                    out, out_dtype, M, N, K};
    if (w_dtype == BF16) run<BF16Weights>(p, static_cast<const uint16_t*>(w), threads);
    else run<F32Weights>(p, static_cast<const float*>(w), threads);
}
