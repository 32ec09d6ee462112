// out[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) for CPUs with AVX-512, built twice (cpu.py):
//  - AVX-512F (GEMM_BF16 = 0): float32 FMAs on 16 columns at a time; x in float32; w float32 in panels of 16
//    output columns, [ceil(N / 16), K, 16], or bfloat16 in the pairs layout below, widened in registers.
//  - AVX512_BF16 (GEMM_BF16 = 1): `vdpbf16ps` multiplies bf16 pairs and accumulates in float32, two k per
//    instruction, as oneDNN's bf16 matmul does; w in panels of 16 columns by k pairs, [ceil(N / 16), K / 2, 16, 2]
//    bfloat16 (K padded to even), and x in bfloat16, each row's (x[2p], x[2p + 1]) broadcast as one 32-bit lane.
// Tiles of MR rows by NP panels keep MR * NP accumulators among the 32 vector registers; threads split the panels.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "avx512.h"

namespace {

constexpr int PANEL = 16;
// Each panel's weight stream is prefetched ahead of its loads, one of two ways, which kernels/cpu.py offers as two
// paths each so that the autotuner times both on the machine at hand:
//  - NEAR: into L1, 64 k steps (2-4 KB) ahead. On an AVX-512 Xeon the hardware prefetcher alone left decode
//    matmuls below the memory bandwidth (all of a 0.5B step's matmuls: 8 rows 58-81 -> 48-58 ms, 32 rows 170-208
//    -> 161-177 ms), and 64 steps beat 8, 16, 32 and 128.
//  - FAR: into L2, 512 k steps (16-32 KB) ahead. On a Zen 4 EPYC, NEAR streamed slower than no prefetch at all
//    (1 row from memory: 24-34 vs 28-43 GB/s), FAR faster than both at 1-32 rows (1 row: 32-51 GB/s).
enum Prefetch : int { NEAR = 0, FAR = 1 };
template <int PF>
inline void prefetch(const void* p, int64_t step_bytes) {
    if constexpr (PF == NEAR) _mm_prefetch(static_cast<const char*>(p) + 64 * step_bytes, _MM_HINT_T0);
    else _mm_prefetch(static_cast<const char*>(p) + 512 * step_bytes, _MM_HINT_T1);
}
using gemm512::BF16;
using gemm512::to_bf16;
constexpr int64_t kNextGroupBytes = 256 * 1024;  // the largest panel group whose successor is prefetched (tile())

// A layout (the weights' element type W, x's X, the k per step KSTEP) whose step of a panel is one register.
struct OneRegister {
    using WV = __m512;
    using XV = __m512;
};

struct F32Panels : OneRegister {
    using W = float;
    using X = float;
    static constexpr int KSTEP = 1;
    static inline __m512 weights(const W* p) { return _mm512_loadu_ps(p); }
    static inline __m512 broadcast(const X* x) { return _mm512_set1_ps(*x); }
    static inline __m512 madd(__m512 acc, __m512 w, __m512 x) { return _mm512_fmadd_ps(x, w, acc); }
};

// The pairs layout (below) read with float32 FMAs: one 64-byte load holds k and k + 1 of 16 columns, each lane a
// (k, k + 1) pair of bf16 halves, so a shift gives k's float32 and a mask k + 1's: one cheap op per widened vector
// where the panels take a zero-extend (a shuffle, on the FMA port) and a shift.
struct BF16PairsWidened {
    using W = uint16_t;
    using X = float;
    static constexpr int KSTEP = 2;
    struct WV { __m512 even, odd; };
    struct XV { __m512 even, odd; };
    static inline WV weights(const W* p) {
        const __m512i v = _mm512_loadu_si512(p);
        return {_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)),
                _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xffff0000u))))};
    }
    static inline XV broadcast(const X* x) { return {_mm512_set1_ps(x[0]), _mm512_set1_ps(x[1])}; }
    static inline __m512 madd(__m512 acc, WV w, XV x) {
        return _mm512_fmadd_ps(x.odd, w.odd, _mm512_fmadd_ps(x.even, w.even, acc));
    }
};

#if GEMM_BF16
struct BF16Pairs : OneRegister {
    using W = uint16_t;
    using X = uint16_t;
    static constexpr int KSTEP = 2;
    static inline __m512 weights(const W* p) { return _mm512_castsi512_ps(_mm512_loadu_si512(p)); }
    static inline __m512 broadcast(const X* x) {
        int32_t pair;
        memcpy(&pair, x, sizeof pair);
        return _mm512_castsi512_ps(_mm512_set1_epi32(pair));
    }
    static inline __m512 madd(__m512 acc, __m512 w, __m512 x) {
        return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w);
    }
};
#endif

struct Problem {
    const void* x;  // [M, ldx] in the layout's X type
    int64_t ldx;
    const float* bias;  // float32 [N] or null
    void* out;
    int out_dtype, M, N, steps;  // steps: K / KSTEP
};

inline void store(const Problem& p, int m, int n0, __m512 acc) {
    gemm512::store_columns(p.out, p.out_dtype, p.N, p.bias, m, n0, acc);
}

// Rows beyond the first MR re-read the tile's panels from L2 (the first tile streamed them from memory). While
// they compute, each also streams a share of the next panel group into L2 (`next`, null where there is none to
// fetch): tile t of T (t >= 1) prefetches the next group's panels j with j % (T - 1) == t - 1, one 64-byte line per
// panel and k step. Without it the first tile of every group waited on memory while the others left it idle
// (weights from memory, 32 rows on a Zen 4: 560-675 GFLOP/s against 730-917 with the weights in cache).
template <int MR, int NP, typename L, int PF>
inline void tile(const Problem& p, const typename L::W* w, int m0, int panel0, const typename L::W* next,
                 int t, int tiles) {
    __m512 acc[MR][NP];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
        for (int j = 0; j < NP; ++j) acc[i][j] = _mm512_setzero_ps();
    const int64_t panel_elems = static_cast<int64_t>(p.steps) * PANEL * L::KSTEP;
    const typename L::W* panel = w + panel0 * panel_elems;
    const typename L::X* x = static_cast<const typename L::X*>(p.x) + m0 * p.ldx;
    const int64_t step_elems = PANEL * L::KSTEP;
    unsigned fetch = 0;  // the next group's panels this tile prefetches
    if (t > 0 && next != nullptr)
        for (int j = 0; j < NP; ++j) fetch |= static_cast<unsigned>(j % (tiles - 1) == t - 1) << j;
    for (int s = 0; s < p.steps; ++s) {
        typename L::WV wv[NP];
#pragma GCC unroll 8
        for (int j = 0; j < NP; ++j) {
            const typename L::W* row = panel + j * panel_elems + static_cast<int64_t>(s) * step_elems;
            if (t == 0 || next == nullptr) prefetch<PF>(row, step_elems * sizeof(typename L::W));
            else if (fetch >> j & 1u)
                _mm_prefetch(reinterpret_cast<const char*>(next + j * panel_elems + s * step_elems), _MM_HINT_T1);
            wv[j] = L::weights(row);
        }
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
            const typename L::XV xv = L::broadcast(x + i * p.ldx + static_cast<int64_t>(s) * L::KSTEP);
#pragma GCC unroll 8
            for (int j = 0; j < NP; ++j) acc[i][j] = L::madd(acc[i][j], wv[j], xv);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
        for (int j = 0; j < NP; ++j) store(p, m0 + i, (panel0 + j) * PANEL, acc[i][j]);
}

// All rows against NP panels: MR-row tiles, then the remaining rows; `next`: the panel group after this one, or
// null.
template <int MR, int NP, typename L, int PF>
inline void panel_group(const Problem& p, const typename L::W* w, int panel0, const typename L::W* next) {
    const int tiles = (p.M + MR - 1) / MR;
    int m = 0, t = 0;
    for (; m + MR <= p.M; m += MR, ++t) tile<MR, NP, L, PF>(p, w, m, panel0, next, t, tiles);
    switch (p.M - m) {
        case 7: if constexpr (MR > 7) tile<7, NP, L, PF>(p, w, m, panel0, next, t, tiles); break;
        case 6: if constexpr (MR > 6) tile<6, NP, L, PF>(p, w, m, panel0, next, t, tiles); break;
        case 5: if constexpr (MR > 5) tile<5, NP, L, PF>(p, w, m, panel0, next, t, tiles); break;
        case 4: if constexpr (MR > 4) tile<4, NP, L, PF>(p, w, m, panel0, next, t, tiles); break;
        case 3: if constexpr (MR > 3) tile<3, NP, L, PF>(p, w, m, panel0, next, t, tiles); break;
        case 2: if constexpr (MR > 2) tile<2, NP, L, PF>(p, w, m, panel0, next, t, tiles); break;
        case 1: if constexpr (MR > 1) tile<1, NP, L, PF>(p, w, m, panel0, next, t, tiles); break;
        default: break;
    }
}

// The last panels of a thread's share, fewer than NP: one tile as wide as they are.
template <int MR, int NP, typename L, int PF>
inline void panel_rest(const Problem& p, const typename L::W* w, int panel0, int count) {
    if constexpr (NP > 1) {
        if (count == NP - 1) panel_group<MR, NP - 1, L, PF>(p, w, panel0, nullptr);
        else panel_rest<MR, NP - 1, L, PF>(p, w, panel0, count);
    }
}

// Each thread takes an even share of the panels, in groups of NP and then one narrower group: split by whole
// groups, the 0.5B model's 56-panel (896-column) matmuls at one row gave one thread 4 groups of 8 and the other 3.
template <int MR, int NP, typename L, int PF>
void run_groups(const Problem& p, const typename L::W* w, int threads) {
    const int panels = (p.N + PANEL - 1) / PANEL;
#pragma omp parallel num_threads(threads)
    {
        const int workers = omp_get_num_threads(), id = omp_get_thread_num();
        const int begin = static_cast<int>(static_cast<int64_t>(panels) * id / workers);
        const int end = static_cast<int>(static_cast<int64_t>(panels) * (id + 1) / workers);
        const int64_t panel_elems = static_cast<int64_t>(p.steps) * PANEL * L::KSTEP;
        // A group and the next must share L2 with room to spare: a 3-panel group of the 0.5B model's down_proj
        // (K = 4864, 467 KB) fetched beside the current one slowed 16 rows by 7 % on a Zen 4 (1 MB of L2).
        const bool ahead = NP * panel_elems * static_cast<int64_t>(sizeof(typename L::W)) <= kNextGroupBytes;
        int q = begin;
        for (; q + NP <= end; q += NP)
            panel_group<MR, NP, L, PF>(p, w, q, ahead && q + 2 * NP <= end ? w + (q + NP) * panel_elems : nullptr);
        if (q < end) panel_rest<MR, NP, L, PF>(p, w, q, end - q);
    }
}

// Few rows leave registers for more panels per tile (more independent chains, fewer broadcasts); many rows
// take 8 x 3 tiles: 24 accumulators, 3 weight vectors and a broadcast (measured 5-20 % faster than 6 x 4 on an
// AVX-512 Xeon: fewer bf16 widenings per FMA, and decode batches of 8, 16, 32 rows leave no remainder).
template <typename L, int PF>
void run_prefetching(const Problem& p, const typename L::W* w, int threads) {
    switch (p.M) {
        case 1: run_groups<1, 8, L, PF>(p, w, threads); break;
        case 2: run_groups<2, 6, L, PF>(p, w, threads); break;
        case 3: run_groups<3, 6, L, PF>(p, w, threads); break;
        case 4: run_groups<4, 5, L, PF>(p, w, threads); break;
        case 5: run_groups<5, 4, L, PF>(p, w, threads); break;
        default: run_groups<8, 3, L, PF>(p, w, threads); break;
    }
}

template <typename L>
void run(const Problem& p, const typename L::W* w, int prefetch, int threads) {
    if (prefetch == FAR) run_prefetching<L, FAR>(p, w, threads);
    else run_prefetching<L, NEAR>(p, w, threads);
}

// x [M, K] (float32 or bfloat16) as float32 rows of ld >= K values, the padding zero: 16 at a time, rows split
// over the threads when there are enough of them.
std::vector<float> widen_rows(const void* x, int x_dtype, int M, int K, int ld, int threads) {
    std::vector<float> out(static_cast<size_t>(M) * ld, 0.0f);
#pragma omp parallel for num_threads(threads) if (static_cast<int64_t>(M) * K >= 65536)
    for (int m = 0; m < M; ++m) {
        float* dst = out.data() + static_cast<size_t>(m) * ld;
        const int64_t row = static_cast<int64_t>(m) * K;
        for (int k = 0; k < K; k += PANEL) {
            const __mmask16 mask = K - k >= PANEL ? 0xffff : static_cast<__mmask16>((1u << (K - k)) - 1);
            __m512 v;
            if (x_dtype == BF16) {
                const __m256i raw = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(x) + row + k);
                v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
            } else {
                v = _mm512_maskz_loadu_ps(mask, static_cast<const float*>(x) + row + k);
            }
            _mm512_mask_storeu_ps(dst + k, mask, v);
        }
    }
    return out;
}

}  // namespace

#if GEMM_BF16
// x bfloat16 [M, K]; w packed pairs (K rounded up to even: an odd K's last pair reads a zero x beside it).
extern "C" void gemm_avx512bf16(const uint16_t* x, const uint16_t* w, const void* bias, int bias_dtype, void* out,
                                int out_dtype, int M, int N, int K, int prefetch, int threads) {
    std::vector<uint16_t> padded;
    const int K2 = (K + 1) / 2 * 2;
    x = gemm512::padded_rows(x, M, K, M, K2, padded);
    const std::vector<float> b = bias_as_f32(bias, bias_dtype, N);
    const Problem p{x, K2, bias ? b.data() : nullptr, out, out_dtype, M, N, K2 / 2};
    run<BF16Pairs>(p, w, prefetch, threads);
}
#else
// x float32 or bfloat16 [M, K] (widened once); w float32 packed panels.
extern "C" void gemm_avx512(const void* x, int x_dtype, const float* w, const void* bias, int bias_dtype, void* out,
                            int out_dtype, int M, int N, int K, int prefetch, int threads) {
    const std::vector<float> x32 = x_dtype == BF16 ? widen_rows(x, x_dtype, M, K, K, threads) : std::vector<float>();
    const std::vector<float> b = bias_as_f32(bias, bias_dtype, N);
    const Problem p{x_dtype == BF16 ? x32.data() : x, K, bias ? b.data() : nullptr, out, out_dtype, M, N, K};
    run<F32Panels>(p, w, prefetch, threads);
}

// x float32 or bfloat16 [M, K] (widened once, K padded to even with zeros); w bfloat16 packed pairs.
extern "C" void gemm_avx512_pairs(const void* x, int x_dtype, const uint16_t* w, const void* bias, int bias_dtype,
                                  void* out, int out_dtype, int M, int N, int K, int prefetch, int threads) {
    const int K2 = (K + 1) / 2 * 2;
    const std::vector<float> x32 = widen_rows(x, x_dtype, M, K, K2, threads);
    const std::vector<float> b = bias_as_f32(bias, bias_dtype, N);
    const Problem p{x32.data(), K2, bias ? b.data() : nullptr, out, out_dtype, M, N, K2 / 2};
    run<BF16PairsWidened>(p, w, prefetch, threads);
}
#endif
