// out[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) on Intel AMX (TDPBF16PS): bf16 x, bf16 w in the pairs layout that
// the AVX512_BF16 kernel reads (cpu_gemm_avx512.cpp; one copy serves both), float32 sums.
//
// A tile register holds 16 rows of 64 bytes. One TDPBF16PS multiplies a 16 x 32 bf16 tile of x (16 rows, 16 k
// pairs) by a 32 x 16 tile of w and adds to a 16 x 16 float32 tile: a 16-column panel of the pairs layout,
// [K / 2, 16, 2], is already a column of such w tiles, 1 KB each, rows 64 bytes apart. One instruction does 8192
// multiply-adds (a 512-bit `vdpbf16ps` does 32), so the 8-64 rows of a decode step, compute-bound on AVX-512, are
// bound by the weights' memory stream instead (up to ~64 rows on a Sapphire-Rapids-class Xeon).
//
// Tiles: x rows in blocks of 32 (two x tiles) or 16 (one), against groups of 2 or 3 panels, accumulators in the
// other tiles (2 x 2 or 1 x 3). Rows past M read zeros (x is copied, zero-padded, once per call); k pairs past the
// last full tile of 16 (K not a multiple of 32) are added with `vdpbf16ps` after the tiles. Threads split the
// panels evenly. Each thread loads the tile configuration (8 tiles of 16 x 64 bytes) on entry and releases it.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "amx.h"
#include "avx512.h"

namespace {

using amx::tile_dp;
using amx::tile_load;
using amx::tile_store;
using amx::tile_zero;
using amx::unroll;
using gemm512::BF16;

constexpr int PANEL = 16;       // output columns per panel
constexpr int TILE_PAIRS = 16;  // k pairs per tile (32 k)
constexpr int TILE_ROWS = 16;
constexpr int64_t TILE_BYTES = 1024;

void configure_tiles() {
    amx::configure({16, 16, 16, 16, 16, 16, 16, 16}, {64, 64, 64, 64, 64, 64, 64, 64});
}

struct Problem {
    const uint16_t* x;  // [M rounded up to 16, ldx] bf16, the rows past M zero
    int64_t ldx;
    const float* bias;  // [N] or null
    void* out;
    int out_dtype, M, N, pairs;  // pairs: K / 2 (K even; the weight's panels hold `pairs` rows of 16 x 2)
};

// NA x-row tiles against NP panels from `panel0`: the full k tiles with AMX, stored as float32 [NA][NP][16][16],
// then the k pairs past them with vdpbf16ps, the bias, and the rows below M written out.
template <int NA, int NP>
void block(const Problem& p, const uint16_t* w, int panel0, int m0, float* scratch) {
    constexpr int A0 = NA * NP, B0 = A0 + NA;  // tiles: accumulators 0.., then x, then w
    static_assert(B0 + NP <= 8, "eight tile registers");
    const int ktiles = p.pairs / TILE_PAIRS;
    const int64_t panel_elems = static_cast<int64_t>(p.pairs) * PANEL * 2;
    const uint16_t* panel = w + panel0 * panel_elems;
    unroll<NA * NP>([&](auto c) { tile_zero<decltype(c)::value>(); });
    for (int kt = 0; kt < ktiles; ++kt) {
        unroll<NA>([&](auto i) {
            tile_load<A0 + decltype(i)::value>(p.x + (m0 + i * TILE_ROWS) * p.ldx + kt * 2 * TILE_PAIRS, p.ldx * 2);
        });
        unroll<NP>([&](auto j) {
            tile_load<B0 + decltype(j)::value>(panel + j * panel_elems + kt * (TILE_BYTES / 2), 64);
        });
        unroll<NA>([&](auto i) {
            unroll<NP>([&](auto j) {
                constexpr int I = decltype(i)::value, J = decltype(j)::value;
                tile_dp<I * NP + J, A0 + I, B0 + J>();
            });
        });
    }
    unroll<NA * NP>([&](auto c) { tile_store<decltype(c)::value>(scratch + c * 256, 64); });
    const int rows_here = p.M - m0 < NA * TILE_ROWS ? p.M - m0 : NA * TILE_ROWS;
    for (int r = 0; r < rows_here; ++r) {
        const uint16_t* xr = p.x + (m0 + r) * p.ldx;
        for (int j = 0; j < NP; ++j) {
            __m512 acc = _mm512_loadu_ps(scratch + ((r / TILE_ROWS) * NP + j) * 256 + (r % TILE_ROWS) * 16);
            for (int s = ktiles * TILE_PAIRS; s < p.pairs; ++s) {
                int32_t pair;
                memcpy(&pair, xr + 2 * s, sizeof pair);
                const __m512 wv = _mm512_castsi512_ps(_mm512_loadu_si512(panel + j * panel_elems + s * 32));
                acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(pair), (__m512bh)wv);
            }
            gemm512::store_columns(p.out, p.out_dtype, p.N, p.bias, m0 + r, (panel0 + j) * PANEL, acc);
        }
    }
}

// NP panels from panel0, every row: blocks of 32 rows (16 where no more than 16 remain).
template <int NP>
void panel_group(const Problem& p, const uint16_t* w, int panel0, float* scratch) {
    int m = 0;
    if constexpr (NP <= 2)  // (groups of 3 run M <= 16 only)
        for (; p.M - m > TILE_ROWS; m += 2 * TILE_ROWS) block<2, NP>(p, w, panel0, m, scratch);
    if (m < p.M) block<1, NP>(p, w, panel0, m, scratch);
}

// One row tile (M <= 16) leaves room for 3 panels per group; more rows take 2 x 2 tiles, each weight tile loaded
// once per 32 rows.
template <int NP>
void run_groups(const Problem& p, const uint16_t* w, int threads) {
    const int panels = (p.N + PANEL - 1) / PANEL;
#pragma omp parallel num_threads(threads)
    {
        const int workers = omp_get_num_threads(), id = omp_get_thread_num();
        const int begin = static_cast<int>(static_cast<int64_t>(panels) * id / workers);
        const int end = static_cast<int>(static_cast<int64_t>(panels) * (id + 1) / workers);
        if (begin < end) {
            configure_tiles();
            alignas(64) float scratch[4 * 256];
            int q = begin;
            for (; q + NP <= end; q += NP) panel_group<NP>(p, w, q, scratch);
            if (NP == 3 && end - q == 2) panel_group<2>(p, w, q, scratch);
            else if (q < end) panel_group<1>(p, w, q, scratch);
            _tile_release();
        }
    }
}

}  // namespace

// The process's permission to use the AMX tile data (amx.h): 0 when granted, else the errno of the refusal.
extern "C" int amx_enable() { return amx::request_tile_data(); }

// x bfloat16 [M, K], copied zero-padded where M is not a multiple of 16 or K is odd; w packed pairs (K rounded up
// to even: an odd K's last pair reads a zero x beside it). No software prefetch: 4-32 tiles ahead into L1 or L2
// moved nothing measurable at 1-64 rows from memory on a Sapphire-Rapids-class Xeon (the hardware prefetcher
// follows the panels' sequential streams).
extern "C" void gemm_amx(const uint16_t* x, const uint16_t* w, const void* bias, int bias_dtype, void* out,
                         int out_dtype, int M, int N, int K, int threads) {
    std::vector<uint16_t> padded;
    const int K2 = (K + 1) / 2 * 2;
    x = gemm512::padded_rows(x, M, K, (M + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS, K2, padded);
    const std::vector<float> b = bias_as_f32(bias, bias_dtype, N);
    const Problem p{x, K2, bias ? b.data() : nullptr, out, out_dtype, M, N, K2 / 2};
    if (M <= TILE_ROWS) run_groups<3>(p, w, threads);
    else run_groups<2>(p, w, threads);
}
