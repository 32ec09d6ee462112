// out[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) with w quantised weight-only, group-wise along K; built four times
// (kernels/cpu.py): AVX2 (QUANT_AVX512 = 0: 8 int32 lanes, vpmaddwd + vpaddd), AVX-512BW (QUANT_AVX512 = 1, 16
// lanes, the same two instructions), AVX512_VNNI (QUANT_VNNI = 1: vpdpwssd, the two in one) and AMX (QUANT_AMX = 1,
// bf16 x only: the integers widened to bf16 tiles, TDPBF16PS; its section below).
//
// Formats (kernels/quant.py packs them), for each group of G consecutive k of a column n:
//  - int8: w[n, k] = q[n, k] * scale[n, g], q signed 8-bit (symmetric).
//  - int4: w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g], q an unsigned nibble (zero null: 0).
// Two-level scales (llama.cpp's K-quants, S > 0 groups under each float16 scale): w[n, k] = q[n, k] * d[n, b] *
// sc[n, g] - dmin[n, b] * m[n, g] for group g in super-block b = g / S, sc and m int8, d and dmin float16 (mins
// optional: 0), q signed 8-bit (int8), an unsigned nibble (int4, mins required) or signed 6-bit, -32..31 (int6, Q6_K's
// q - 32, no mins).
// Layout: panels of 16 output columns (columns past N are zero), each one run of bytes (`panel_layout`): its scales
// [Kp / G, 16] float32 or bfloat16 (scale_dtype), then its zeros likewise (int4 with zero points) -- or, two-level,
// d [Kp / (G S), 16] float16, dmin likewise, sc [Kp / G, 16] int8, m likewise --, padded to a
// multiple of 64 bytes, then its q in steps of 64 bytes: 4 bytes per column of 4 k (int8: bytes k, k + 2, k + 1,
// k + 3) or 8 k (int4: nibble d / 2 holds k + d for even d, 4 + d / 2 for odd d), so that in-lane shifts give int16
// (k, k + 1) pairs; int6 steps of 96 bytes, q + 32's low nibbles as int4's and then its high bits (int6_pairs). Kp:
// K rounded up to a multiple of G, or of G S (the weights past K are zero). A tile of NP panels reads NP streams
// (blocks of 8 panels whose steps alternated, one stream per tile, streamed 15-20 % slower at one row on a Zen 4
// EPYC). The scales inside the panel's run, not in an array of their own: read from there, one row's matmuls
// over a 0.5B model's int8 weights streamed at 0.77-0.85 of the bf16 kernel's rate on a Zen 4, at 0.89-0.97 without
// reading scales at all (a separate stream every tile read a line of per 2 groups; the weight prefetch now covers
// them).
//
// The products are integer: each row of x is rounded to int16 per group of G, x[m, k] ~ xq[m, k] * 2^e[m, g], with
// the power of two that puts the group's largest |x| in [2^14, 2^15) (a bf16 x at least 2^-7 of its group's largest
// is exact; the rounding error is at most 2^-16 of the group's largest). A group's sum of xq * q (at most
// G * 2^15 * 127 < 2^31 for G <= 512) is widened to float32 and added to the accumulator times scale * 2^e, and for
// int4 x's float32 group sum times (zero - 8 * scale) (two-level: times -dmin * m, where there are mins). Tiles of MR
// rows by NP panels; threads split the panels.
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <atomic>
#include <initializer_list>
#include <vector>

#include "bf16.h"
#include "panel_runs.h"
#ifndef QUANT_AMX
#define QUANT_AMX 0
#endif
#if QUANT_AMX
#include "amx.h"
#endif

namespace {

enum DType : int { F32 = 0, BF16 = 1, F16 = 2 };  // F16: two-level scales' d and dmin only
enum Bits : int { INT4 = 4, INT6 = 6, INT8 = 8 };
enum Prefetch : int { NEAR = 0, FAR = 1 };  // as cpu_gemm_avx512.cpp's
constexpr int PANEL = 16;
constexpr int MAX_GROUP = 512;

// The operations both widths spell alike (SIMD(op): _mm512_op or _mm256_op), written once after the two blocks.
#if QUANT_AVX512
#define SIMD(op) _mm512_##op
constexpr int LANES = 16;
using VI = __m512i;
using VF = __m512;
inline VI izero() { return _mm512_setzero_si512(); }
// acc += the int16 pair products of w and x, summed per 32-bit lane.
inline VI dot(VI acc, VI w, VI x) {
#if QUANT_VNNI
    return _mm512_dpwssd_epi32(acc, w, x);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}
// One step of a panel (64 bytes: 16 columns x 4 bytes) as int16 k pairs, with in-lane shifts only (a widening
// shuffle across the register runs at half the rate on a Zen 4). int8: column c's bytes are k, k + 2, k + 1, k + 3,
// so the low bytes of its two 16-bit lanes are the pair (k, k + 1) and the high bytes (k + 2, k + 3).
inline void int8_pairs(const uint8_t* p, VI* w) {
    const __m512i v = _mm512_loadu_si512(p);
    w[0] = _mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8);
    w[1] = _mm512_srai_epi16(v, 8);
}
// int4: column c's 32-bit word holds k + d in nibble d / 2 (d even) or 4 + d / 2 (d odd), so nibble i of each
// 16-bit lane, for i = 0 .. 3, is the pair (k + 2i, k + 2i + 1).
inline void int4_pairs(const uint8_t* p, VI* w) {
    const __m512i v = _mm512_loadu_si512(p), nibble = _mm512_set1_epi16(15);
    w[0] = _mm512_and_si512(v, nibble);
    w[1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
    w[2] = _mm512_and_si512(_mm512_srli_epi16(v, 8), nibble);
    w[3] = _mm512_srli_epi16(v, 12);
}
// int6 (two-level, Q6_K's q - 32): a step of 8 k is 64 bytes of low nibbles laid out as int4's, then 32 bytes of high
// bits, byte i holding the top 2 bits of 16-bit lane i's four values (value t at bits 2t): q = (low | high << 4) - 32.
inline void int6_pairs(const uint8_t* p, VI* w) {
    const __m512i high = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64)));
    const __m512i two = _mm512_set1_epi16(0x30), offset = _mm512_set1_epi16(32);
    int4_pairs(p, w);
    w[0] = _mm512_sub_epi16(_mm512_or_si512(w[0], _mm512_and_si512(_mm512_slli_epi16(high, 4), two)), offset);
    w[1] = _mm512_sub_epi16(_mm512_or_si512(w[1], _mm512_and_si512(_mm512_slli_epi16(high, 2), two)), offset);
    w[2] = _mm512_sub_epi16(_mm512_or_si512(w[2], _mm512_and_si512(high, two)), offset);
    w[3] = _mm512_sub_epi16(_mm512_or_si512(w[3], _mm512_and_si512(_mm512_srli_epi16(high, 2), two)), offset);
}
inline void scale_columns(const void* p, int dtype, VF* s) {
    if (dtype == BF16) {
        const __m256i raw = _mm256_loadu_si256(static_cast<const __m256i*>(p));
        s[0] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    } else {
        s[0] = _mm512_loadu_ps(static_cast<const float*>(p));
    }
}
// 16 float16 values (F16C's conversion, exact) and 16 int8 ones as float32.
inline void half_columns(const uint8_t* p, VF* s) {
    s[0] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void byte_columns(const uint8_t* p, VF* s) {
    s[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline void store16(float* dst, const VF* v) { _mm512_storeu_ps(dst, v[0]); }
inline float reduce_max(VF v) { return _mm512_reduce_max_ps(v); }
inline float reduce_add(VF v) { return _mm512_reduce_add_ps(v); }
inline VF vabs(VF v) { return _mm512_abs_ps(v); }
// LANES floats times `scale`, rounded to nearest even, clamped to [-32767, 32767], stored as int16.
inline void store_rounded(int16_t* dst, VF v, VF scale) {
    __m512i i = _mm512_cvtps_epi32(_mm512_mul_ps(v, scale));
    i = _mm512_min_epi32(_mm512_max_epi32(i, _mm512_set1_epi32(-32767)), _mm512_set1_epi32(32767));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(i));
}
#else
#define SIMD(op) _mm256_##op
constexpr int LANES = 8;
using VI = __m256i;
using VF = __m256;
inline VI izero() { return _mm256_setzero_si256(); }
inline VI dot(VI acc, VI w, VI x) { return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x)); }
// As the AVX-512 ones (above), for each half of the panel (columns 0-7, then 8-15): w[pair * L + half].
inline void int8_pairs(const uint8_t* p, VI* w) {
    for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h));
        w[h] = _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8);
        w[2 + h] = _mm256_srai_epi16(v, 8);
    }
}
inline void int4_pairs(const uint8_t* p, VI* w) {
    const __m256i nibble = _mm256_set1_epi16(15);
    for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h));
        w[h] = _mm256_and_si256(v, nibble);
        w[2 + h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        w[4 + h] = _mm256_and_si256(_mm256_srli_epi16(v, 8), nibble);
        w[6 + h] = _mm256_srli_epi16(v, 12);
    }
}
inline void int6_pairs(const uint8_t* p, VI* w) {
    const __m256i two = _mm256_set1_epi16(0x30), offset = _mm256_set1_epi16(32);
    int4_pairs(p, w);
    for (int h = 0; h < 2; ++h) {
        const __m256i high = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 64 + 16 * h)));
        w[h] = _mm256_sub_epi16(_mm256_or_si256(w[h], _mm256_and_si256(_mm256_slli_epi16(high, 4), two)), offset);
        w[2 + h] = _mm256_sub_epi16(_mm256_or_si256(w[2 + h], _mm256_and_si256(_mm256_slli_epi16(high, 2), two)),
                                    offset);
        w[4 + h] = _mm256_sub_epi16(_mm256_or_si256(w[4 + h], _mm256_and_si256(high, two)), offset);
        w[6 + h] = _mm256_sub_epi16(_mm256_or_si256(w[6 + h], _mm256_and_si256(_mm256_srli_epi16(high, 2), two)),
                                    offset);
    }
}
inline void scale_columns(const void* p, int dtype, VF* s) {
    for (int h = 0; h < 2; ++h) {
        if (dtype == BF16) {
            const __m128i raw = _mm_loadu_si128(static_cast<const __m128i*>(p) + h);
            s[h] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
        } else {
            s[h] = _mm256_loadu_ps(static_cast<const float*>(p) + 8 * h);
        }
    }
}
inline void half_columns(const uint8_t* p, VF* s) {
    for (int h = 0; h < 2; ++h) s[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * h)));
}
inline void byte_columns(const uint8_t* p, VF* s) {
    for (int h = 0; h < 2; ++h)
        s[h] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * h))));
}
inline void store16(float* dst, const VF* v) {
    _mm256_storeu_ps(dst, v[0]);
    _mm256_storeu_ps(dst + 8, v[1]);
}
inline float reduce_max(VF v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}
inline float reduce_add(VF v) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_add_ss(m, _mm_shuffle_ps(m, m, 1)));
}
inline VF vabs(VF v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }
inline void store_rounded(int16_t* dst, VF v, VF scale) {
    __m256i i = _mm256_cvtps_epi32(_mm256_mul_ps(v, scale));
    i = _mm256_min_epi32(_mm256_max_epi32(i, _mm256_set1_epi32(-32767)), _mm256_set1_epi32(32767));
    const __m128i packed = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), packed);
}
#endif
inline VF fzero() { return SIMD(setzero_ps)(); }
inline VF fset1(float v) { return SIMD(set1_ps)(v); }
inline VF ffma(VF a, VF b, VF c) { return SIMD(fmadd_ps)(a, b, c); }
inline VF fmul(VF a, VF b) { return SIMD(mul_ps)(a, b); }
inline VF vmax(VF a, VF b) { return SIMD(max_ps)(a, b); }
inline VF vadd(VF a, VF b) { return SIMD(add_ps)(a, b); }
inline VF vload_f(const float* p) { return SIMD(loadu_ps)(p); }
inline void vstore_f(float* p, VF v) { SIMD(storeu_ps)(p, v); }
inline VF to_float(VI v) { return SIMD(cvtepi32_ps)(v); }
inline VI pair_broadcast(const int16_t* x) {
    int32_t pair;
    memcpy(&pair, x, sizeof pair);
    return SIMD(set1_epi32)(pair);
}
#undef SIMD
// The weight stream ahead of a step's cache line (every build: on a Zen 3 with AVX2 only, one row's int8 matmuls
// streamed at 0.66-0.76 of the bf16 kernel's rate without it, 0.80-0.83 with NEAR and 0.78-0.85 with FAR). NEAR's
// distance in steps: the AVX2 build's 256 (16 KB) against 64 timed one row's int8 matmuls over a 0.5B model's
// weights at 1.72-1.80x the bf16 kernel's speed against 1.63-1.70x, int4 at 2.94x against 2.60x, on that Zen 3 in
// three interleaved runs; the AVX-512 builds keep the 64 they were tuned with on a Zen 4.
#if QUANT_AVX512
constexpr int64_t NEAR_STEPS = 64;
#else
constexpr int64_t NEAR_STEPS = 256;
#endif
// FAR: each panel's own stream FAR_BYTES ahead, into L2, and past the end of the panel's run the same panel of the
// next tile (a tile's NP panels are consecutive runs), from the start of its run (its scales first), so that a tile
// starts on lines already fetched. Before, FAR prefetched 128 KB ahead on the whole share: the next tile, but none of
// the current tile's streams. On a Zen 4 (2 threads, every one-row int8 matmul of a 0.5B decode step, each build's
// step timed against the bf16 kernel's in 30 rounds, the order shuffled each round, in a C++ harness): the
// AVX512_VNNI build 1.78-1.79x the bf16 kernel's speed in three runs against 1.74-1.76x; the AVX2 build 1.66x and
// 1.49x in two runs against 1.63x and 1.43x. Distances of 3-12 KB measured within 2-3 % of each other, into L1 (T0)
// 10-14 % slower (docs/decisions/004-weight-prefetch.md). NEAR: NEAR_STEPS steps ahead on the share, into L1.
constexpr int64_t FAR_BYTES = 4096;
// Only within the thread's share of the panels (`limit`: its end): past it, a prefetch fetched lines that this core
// never reads. Clamped, the 0.5B shape's one-row int4 matmuls (the AVX512_VNNI build, FAR as then: 128 KB ahead, on
// a Zen 4) streamed at 0.70 / 0.73 / 0.86 of the bf16 kernel's rate against 0.66 / 0.68 / 0.83 in three interleaved
// runs.
// `step`: a step of a panel in a tile of NP; `at`: the step's offset in the panel's run of `panel_bytes`.
template <int PF, int NP>
inline void prefetch(const uint8_t* step, int64_t at, int64_t panel_bytes, const uint8_t* limit) {
    const uint8_t* ahead;
    if constexpr (PF == NEAR) ahead = step + NEAR_STEPS * 64;
    else ahead = step + FAR_BYTES + (at + FAR_BYTES < panel_bytes ? 0 : (NP - 1) * panel_bytes);
    if (ahead < limit) _mm_prefetch(reinterpret_cast<const char*>(ahead), PF == NEAR ? _MM_HINT_T0 : _MM_HINT_T1);
}
constexpr int L = PANEL / LANES;  // vectors per panel

// Where a panel's parts lie in its run of bytes.
// Offsets in bytes; -1: absent.
struct PanelLayout {
    int64_t scales;      // the scales (two-level: sc)
    int64_t zeros;       // the zeros (two-level: m)
    int64_t supers;      // two-level: d
    int64_t super_mins;  // two-level: dmin
    int64_t q;           // the q steps
    int64_t bytes;       // the whole panel
};

// K rounded up to whole groups (one-level, S = 0) or whole super-blocks of S groups.
inline int padded_k(int K, int G, int S) {
    const int64_t unit = static_cast<int64_t>(G) * (S > 0 ? S : 1);
    return static_cast<int>((K + unit - 1) / unit * unit);
}

PanelLayout panel_layout(int bits, int G, int S, int Kp, int scale_dtype, bool zeros) {
    const int64_t groups = Kp / G, q_bytes = static_cast<int64_t>(Kp) * PANEL * bits / 8;
    if (S > 0) {
        const int64_t supers = groups / S * PANEL * 2, subs = groups * PANEL;
        const int64_t scales = supers * (zeros ? 2 : 1), head = (scales + subs * (zeros ? 2 : 1) + 63) / 64 * 64;
        return {scales, zeros ? scales + subs : -1, 0, zeros ? supers : -1, head, head + q_bytes};
    }
    const int64_t block = groups * PANEL * (scale_dtype == BF16 ? 2 : 4);
    const int64_t head = (block * (zeros ? 2 : 1) + 63) / 64 * 64;
    return {0, zeros ? block : -1, -1, -1, head, head + q_bytes};
}

struct Problem {
    const int16_t* x;        // [M, Kp]: x rounded to int16 per group, zero past K
    const float* unit;       // [M, Kp / G]: 2^e of each row's group (x ~ xq * unit)
    const float* xsum;       // int4, or mins: float32 [M, Kp / G], each group's sum of x; else null
    const uint8_t* panels;   // ceil(N / 16) runs of layout.bytes
    PanelLayout layout;
    const float* bias;       // float32 [N] or null
    void* out;
    int scale_dtype, out_dtype, M, N, Kp, G, S;
};

inline void store_columns(const Problem& p, int m, int n0, const VF* acc) {
    alignas(64) float values[PANEL];
    store16(values, acc);
    store_columns_f32(p.out, p.out_dtype, p.N, p.bias, m, n0, values);
}

// A panel's bytes per step: 4 k (int8), 8 k (int4; int6: 64 bytes of low nibbles and 32 of high bits) of 16 columns.
constexpr int64_t step_bytes(int bits) { return bits == INT6 ? 96 : 64; }
constexpr int step_k(int bits) { return bits == INT8 ? 4 : 8; }
// A step's q as int16 (k, k + 1) pairs, step_k / 2 of them (times L vectors).
template <int BITS>
inline void step_pairs(const uint8_t* step, VI* w) {
    if constexpr (BITS == INT8) int8_pairs(step, w);
    else if constexpr (BITS == INT6) int6_pairs(step, w);
    else int4_pairs(step, w);
}

// step_pairs of `step` (at offset `at` of its panel's run, in a tile of NP panels), after prefetching the stream
// ahead of it (prefetch's arguments).
template <int BITS, int PF, int NP>
inline void prefetched_pairs(const uint8_t* step, int64_t at, int64_t panel_bytes, const uint8_t* limit, VI* w) {
    prefetch<PF, NP>(step, at, panel_bytes, limit);
    if constexpr (BITS == INT6)  // 1.5 lines a step: the next line's prefetch too
        prefetch<PF, NP>(step + 64, at + 64, panel_bytes, limit);
    step_pairs<BITS>(step, w);
}

// Group g's scale s of the panel's 16 columns (one level: its scales; two: d sc) and, where x's group sums enter
// (int4, or mins), the offset they are multiplied by (int4: zero - 8 s, or -8 s; two-level: -dmin m).
template <int BITS>
inline void group_scales(const Problem& p, const uint8_t* panel, int g, VF* s, VF* offset) {
    if (p.S > 0) {
        const int64_t super = static_cast<int64_t>(g / p.S) * PANEL * 2, sub = static_cast<int64_t>(g) * PANEL;
        VF d[L];
        half_columns(panel + p.layout.supers + super, d);
        byte_columns(panel + p.layout.scales + sub, s);
#pragma GCC unroll 2
        for (int h = 0; h < L; ++h) s[h] = fmul(s[h], d[h]);
        if (p.xsum != nullptr) {
            VF dmin[L], m[L];
            half_columns(panel + p.layout.super_mins + super, dmin);
            byte_columns(panel + p.layout.zeros + sub, m);
#pragma GCC unroll 2
            for (int h = 0; h < L; ++h) offset[h] = fmul(fset1(-1.0f), fmul(dmin[h], m[h]));
        }
    } else {
        const int64_t at = static_cast<int64_t>(g) * PANEL * (p.scale_dtype == BF16 ? 2 : 4);
        scale_columns(panel + p.layout.scales + at, p.scale_dtype, s);
        if constexpr (BITS == INT4) {
            // the sums hold x . q with q in 0..15: w = (q - 8) s + z adds (z - 8 s) times x's group sum.
            const bool zeros = p.layout.zeros >= 0;
            VF z[L];
            if (zeros) scale_columns(panel + p.layout.zeros + at, p.scale_dtype, z);
#pragma GCC unroll 2
            for (int h = 0; h < L; ++h) offset[h] = ffma(fset1(-8.0f), s[h], zeros ? z[h] : fzero());
        }
    }
}

// Every register of a tile's MR x NP x L accumulators set to `value`.
template <typename V, int MR, int NP>
inline void fill(V (&registers)[MR][NP][L], V value) {
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
        for (int j = 0; j < NP; ++j)
#pragma GCC unroll 2
            for (int h = 0; h < L; ++h) registers[i][j][h] = value;
}

// A panel widened once for all its row tiles (the AVX2 build's tiles of several rows, `share_wide`): each group's
// scales and offsets (group_scales' vectors as 2 x PANEL floats) and, WIDE_Q, its q as int16 pairs, pair after pair
// (step_pairs' vectors, L of them a pair).
enum Wide : int { WIDE_NONE = 0, WIDE_SCALES = 1, WIDE_Q = 2 };
struct Widened {
    const float* scales;
    const VI* pairs;
};

// Rows m0 .. m0 + MR of out against panels panel0 .. panel0 + NP; `limit`: the end of the thread's panels. WIDE: one
// panel (NP = 1), its scales (and with WIDE_Q its q) read from `wide` instead.
template <int BITS, int MR, int NP, int PF, int WIDE = WIDE_NONE>
inline void tile(const Problem& p, int m0, int panel0, const uint8_t* limit, Widened wide = {}) {
    static_assert(WIDE == WIDE_NONE || NP == 1);
    VF acc[MR][NP][L];
    fill(acc, fzero());
    const int groups = p.Kp / p.G;
    constexpr int64_t STEP_BYTES = step_bytes(BITS);
    constexpr int STEP_K = step_k(BITS), PAIRS = STEP_K / 2;
    const uint8_t* base[NP];
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) base[j] = p.panels + (panel0 + j) * p.layout.bytes + p.layout.q;
    const bool sums = p.xsum != nullptr;  // an offset times x's group sum: int4, or two-level with mins
    // On a 2-core Zen 3, broadcasting at use ran the AVX2 build's 4-row tiles 0.91x (int6, Q6_K), 0.92-0.94x (int4:
    // Q4_K and Q4_0) and 0.97x (int8) as long over the 1.5B shape's projections at 4-32 rows, the same bits (10
    // shuffled rounds against the kernel before, in one process); 1-3 rows alike or faster. Keeping each sum one
    // chain (below) then ran them 0.84-0.87x (int4), 0.94x (int6) and 0.93-0.96x (int8) as long; one row alike. The
    // AVX-512 builds keep their order (not measured there).
    constexpr bool X_AT_USE = !QUANT_AVX512 && MR > 1;
    const int16_t* x = p.x + static_cast<int64_t>(m0) * p.Kp;
    for (int g = 0; g < groups; ++g) {
        VI sum[MR][NP][L];
        fill(sum, izero());
        for (int k = g * p.G; k < (g + 1) * p.G; k += STEP_K) {
            const int64_t at = static_cast<int64_t>(k / STEP_K) * STEP_BYTES;
            // x's pairs first, then one panel at a time (its weights used at once: all of them live at once spilled
            // registers at one row, 8 panels x 4 pairs). AVX2's tiles of several rows (one panel) instead broadcast
            // each row's pair where it is multiplied, pair by pair: MR x PAIRS broadcasts held at once spilled there
            // (16 registers for 4 rows of int4 pairs, beside 8 sums and 8 weight vectors).
            VI xv[MR][PAIRS];
            if constexpr (!X_AT_USE)
#pragma GCC unroll 8
                for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
                    for (int t = 0; t < PAIRS; ++t)
                        xv[i][t] = pair_broadcast(x + static_cast<int64_t>(i) * p.Kp + k + 2 * t);
#pragma GCC unroll 8
            for (int j = 0; j < NP; ++j) {
                VI w[PAIRS * L];
                if constexpr (WIDE == WIDE_Q) {
#pragma GCC unroll 8
                    for (int u = 0; u < PAIRS * L; ++u) w[u] = wide.pairs[k / 2 * L + u];
                } else {
                    prefetched_pairs<BITS, PF, NP>(base[j] + at, p.layout.q + at, p.layout.bytes, limit, w);
                }
                if constexpr (X_AT_USE) {
#pragma GCC unroll 4
                    for (int t = 0; t < PAIRS; ++t)
#pragma GCC unroll 8
                        for (int i = 0; i < MR; ++i) {
                            const VI xi = pair_broadcast(x + static_cast<int64_t>(i) * p.Kp + k + 2 * t);
#pragma GCC unroll 2
                            for (int h = 0; h < L; ++h) {
                                sum[i][j][h] = dot(sum[i][j][h], w[t * L + h], xi);
                                // Each sum one chain in a register: without this the compiler regrouped the step's
                                // integer adds into trees over all 32 products, whose partial sums spilled.
                                __asm__("" : "+x"(sum[i][j][h]));
                            }
                        }
                } else {
#pragma GCC unroll 8
                    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
                        for (int t = 0; t < PAIRS; ++t)
#pragma GCC unroll 2
                            for (int h = 0; h < L; ++h) sum[i][j][h] = dot(sum[i][j][h], w[t * L + h], xv[i][t]);
                }
            }
        }
#pragma GCC unroll 8
        for (int j = 0; j < NP; ++j) {
            VF s[L], offset[L];
            if constexpr (WIDE != WIDE_NONE) {
                const float* at = wide.scales + g * 2 * PANEL;
#pragma GCC unroll 2
                for (int h = 0; h < L; ++h) s[h] = vload_f(at + h * LANES), offset[h] = vload_f(at + PANEL + h * LANES);
            } else {
                group_scales<BITS>(p, p.panels + (panel0 + j) * p.layout.bytes, g, s, offset);
            }
#pragma GCC unroll 8
            for (int i = 0; i < MR; ++i) {
                const int64_t row_group = static_cast<int64_t>(m0 + i) * groups + g;
                const VF unit = fset1(p.unit[row_group]);
#pragma GCC unroll 2
                for (int h = 0; h < L; ++h) {
                    acc[i][j][h] = ffma(to_float(sum[i][j][h]), fmul(s[h], unit), acc[i][j][h]);
                    if (sums) acc[i][j][h] = ffma(fset1(p.xsum[row_group]), offset[h], acc[i][j][h]);
                }
            }
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
        for (int j = 0; j < NP; ++j) store_columns(p, m0 + i, (panel0 + j) * PANEL, acc[i][j]);
}

template <int BITS, int MR, int NP, int PF, int WIDE = WIDE_NONE>
inline void panel_group(const Problem& p, int panel0, const uint8_t* limit, Widened wide = {}) {
    int m = 0;
    for (; m + MR <= p.M; m += MR) tile<BITS, MR, NP, PF, WIDE>(p, m, panel0, limit, wide);
    switch (p.M - m) {
        case 3: if constexpr (MR > 3) tile<BITS, 3, NP, PF, WIDE>(p, m, panel0, limit, wide); break;
        case 2: if constexpr (MR > 2) tile<BITS, 2, NP, PF, WIDE>(p, m, panel0, limit, wide); break;
        case 1: if constexpr (MR > 1) tile<BITS, 1, NP, PF, WIDE>(p, m, panel0, limit, wide); break;
        default: break;
    }
}

// The last panels of a thread's share, fewer than NP: one group as wide as they are.
template <int BITS, int MR, int NP, int PF>
inline void panel_rest(const Problem& p, int panel0, int count, const uint8_t* limit) {
    if constexpr (NP > 1) {
        if (count == NP - 1) panel_group<BITS, MR, NP - 1, PF>(p, panel0, limit);
        else panel_rest<BITS, MR, NP - 1, PF>(p, panel0, count, limit);
    }
}

// Panels [begin, end) of p: groups of NP, then one narrower group (a thread's share).
template <int BITS, int MR, int NP, int PF>
void share(const Problem& p, int begin, int end) {
    const uint8_t* limit = p.panels + end * p.layout.bytes;
    int q = begin;
    for (; q + NP <= end; q += NP) panel_group<BITS, MR, NP, PF>(p, q, limit);
    if (q < end) panel_rest<BITS, MR, NP, PF>(p, q, end - q, limit);
}

// The AVX2 build's tiles of several rows unpack a step's q (int6: 44 vector operations for 32 int16 products of each
// of 4 rows, beside their 64 multiply-adds) and would compute each group's scales (Q4_K's: 18 operations for 4 rows'
// 32 x 16 products) once per tile. Instead the thread widens each panel's scales once for all its row tiles, and from
// WIDE_Q_ROWS rows (by bits) its q too. On a 2-core Zen 3, over the 1.5B shape's projections (9-15 shuffled rounds
// against the kernel before, the same bits): the scales alone, Q4_K at 2-4 rows 0.93-0.99x as long, 5-12 rows
// 0.88-0.95x, Q8_0 0.98-1.02x and 0.90-0.97x, Q6_K 0.91-0.98x at 2-4 rows; the q as well, Q6_K at 5 rows 0.75x, 8
// rows 0.77x, 16 0.62x, 64 0.57x, 256 0.53x; Q4_K at 8 rows 1.00-1.07x (not taken), 16 0.91x, 64 0.81x; Q8_0 at 8
// rows 1.18x (not taken), 16 1.00x, 32 0.88x, 64 0.86x.
constexpr int wide_q_rows(int bits) { return bits == INT6 ? 5 : (bits == INT4 ? 16 : 32); }

// A panel's scales (and with WIDE_Q its q) in the thread's buffer: 2 x PANEL floats a group, then Kp / 2 pairs of L
// vectors.
template <int BITS, int PF, int WIDE>
Widened widen(const Problem& p, int panel, const uint8_t* limit) {
    constexpr int64_t STEP_BYTES = step_bytes(BITS);
    constexpr int STEP_K = step_k(BITS);
    const int64_t scale_bytes = static_cast<int64_t>(p.Kp / p.G) * 2 * PANEL * sizeof(float);
    static thread_local std::vector<uint8_t> buffer;
    buffer.resize(scale_bytes + (WIDE == WIDE_Q ? static_cast<int64_t>(p.Kp / 2) * L * sizeof(VI) : 0) + 64);
    uint8_t* start = buffer.data() + (64 - reinterpret_cast<uintptr_t>(buffer.data()) % 64) % 64;
    float* scales = reinterpret_cast<float*>(start);
    VI* pairs = reinterpret_cast<VI*>(start + scale_bytes);
    const uint8_t* run = p.panels + static_cast<int64_t>(panel) * p.layout.bytes;
    for (int g = 0; g < p.Kp / p.G; ++g) {
        VF s[L], offset[L];
        group_scales<BITS>(p, run, g, s, offset);
#pragma GCC unroll 2
        for (int h = 0; h < L; ++h) {
            vstore_f(scales + g * 2 * PANEL + h * LANES, s[h]);
            if (p.xsum != nullptr) vstore_f(scales + g * 2 * PANEL + PANEL + h * LANES, offset[h]);
        }
    }
    if constexpr (WIDE == WIDE_Q)
        for (int k = 0; k < p.Kp; k += STEP_K) {
            const int64_t at = p.layout.q + static_cast<int64_t>(k / STEP_K) * STEP_BYTES;
            prefetched_pairs<BITS, PF, 1>(run + at, at, p.layout.bytes, limit, pairs + k / 2 * L);
        }
    return {scales, pairs};
}

// Panels [begin, end) of p, each widened once and then multiplied by every tile of 4 rows (the rest in one of 1-3).
template <int BITS, int PF, int WIDE>
void share_wide(const Problem& p, int begin, int end) {
    const uint8_t* limit = p.panels + end * p.layout.bytes;
    for (int q = begin; q < end; ++q)
        panel_group<BITS, 4, 1, PF, WIDE>(p, q, limit, widen<BITS, PF, WIDE>(p, q, limit));
}

// One row: more panels per tile (independent chains, each weight vector used once); more rows: MR x NP tiles that
// keep MR * NP * L float accumulators and as many integer group sums in the vector registers.
template <int BITS, int PF>
void share_rows(const Problem& p, int begin, int end) {
#if QUANT_AVX512
    if (p.M == 1) share<BITS, 1, 8, PF>(p, begin, end);
    else if (p.M == 2) share<BITS, 2, 4, PF>(p, begin, end);
    else share<BITS, 4, 2, PF>(p, begin, end);
#else
    if (p.M == 1) share<BITS, 1, 4, PF>(p, begin, end);  // 4 panels: int8 0.78 -> 0.84 of bf16's rate on a Zen 3
    // 4-row tiles, the rest in one tile of 1-3 rows (the float accumulators spill; each is touched once a group): on
    // that Zen 3, the 0.5B shape's projections at 8 rows ran 1.23x (int8) and 1.21x (int4) as fast as with 2-row
    // tiles, at 32 rows 1.07x and 1.21x, at 3 rows (one tile, not 2 + 1) 1.17x and 1.15x.
    else if (p.M >= wide_q_rows(BITS)) share_wide<BITS, PF, WIDE_Q>(p, begin, end);
    else share_wide<BITS, PF, WIDE_SCALES>(p, begin, end);
#endif
}

// AVX2: the threads take runs of panels in turn (panel_runs.h; at least 4 panels, the one-row tile's width). Against
// an even share each, on a 2-core Zen 3 VM whose host takes a core now and then (11 shuffled rounds over the 1.5B
// shape's projections, the same bits): 64 rows 0.90-0.93x as long, 256 rows 0.84x, 8 rows 0.73-1.01x (the more the
// machine was taken, the lower), 1 row 0.97-1.02x. The AVX-512 builds keep an even share each (their one-row tiles are
// 8 panels wide; not measured there).
template <int BITS, int PF>
void run(const Problem& p, int threads) {
    const int panels = (p.N + PANEL - 1) / PANEL;
#if QUANT_AVX512
#pragma omp parallel num_threads(threads)
    {
        const int workers = omp_get_num_threads(), id = omp_get_thread_num();
        share_rows<BITS, PF>(p, static_cast<int>(static_cast<int64_t>(panels) * id / workers),
                             static_cast<int>(static_cast<int64_t>(panels) * (id + 1) / workers));
    }
#else
    std::atomic<int> next{0};
#pragma omp parallel num_threads(threads)
    take_runs(next, panels, 4, [&](int begin, int end) { share_rows<BITS, PF>(p, begin, end); });
#endif
}

// Rows of x rounded to int16 per group (Problem's x, unit and xsum).
struct RoundedRows {
    std::vector<int16_t> xq;
    std::vector<float> unit, xsum;
};

// x [M, K] float32 or bfloat16 (read as x[:, perm] where perm is not null) rounded to int16 per group of G, with each
// group's sum where `sums`: as float32 rows of Kp first (zero past K; G a multiple of 8, so whole vectors of LANES
// where G allows, else one element at a time), then each group scaled by the power of two that puts its largest |x| in [2^14, 2^15).
RoundedRows round_rows(const void* x, int x_dtype, const int32_t* perm, bool sums, int G, int M, int K, int Kp,
                       int threads) {
    const int groups = Kp / G;
    RoundedRows r{std::vector<int16_t>(static_cast<size_t>(M) * Kp, 0),
                  std::vector<float>(static_cast<size_t>(M) * groups),
                  std::vector<float>(sums ? static_cast<size_t>(M) * groups : 0)};
    std::vector<float> x32(static_cast<size_t>(M) * Kp, 0.0f);
    for (int m = 0; m < M; ++m) {
        float* row = x32.data() + static_cast<size_t>(m) * Kp;
        const int64_t start = static_cast<int64_t>(m) * K;
        if (perm && x_dtype == BF16)
            for (int k = 0; k < K; ++k) row[k] = bf16_to_f32(static_cast<const uint16_t*>(x)[start + perm[k]]);
        else if (perm)
            for (int k = 0; k < K; ++k) row[k] = static_cast<const float*>(x)[start + perm[k]];
        else if (x_dtype == BF16)
            for (int k = 0; k < K; ++k) row[k] = bf16_to_f32(static_cast<const uint16_t*>(x)[start + k]);
        else
            memcpy(row, static_cast<const float*>(x) + start, sizeof(float) * K);
    }
    const bool whole = G % LANES == 0;
#pragma omp parallel for num_threads(threads) if (static_cast<int64_t>(M) * K >= 65536)
    for (int m = 0; m < M; ++m)
        for (int g = 0; g < groups; ++g) {
            const float* row = x32.data() + static_cast<size_t>(m) * Kp + g * G;
            float largest = 0.0f, total = 0.0f;
            if (whole) {
                VF high = fzero(), sum = fzero();
                for (int t = 0; t < G; t += LANES) {
                    const VF v = vload_f(row + t);
                    high = vmax(high, vabs(v));
                    sum = vadd(sum, v);
                }
                largest = reduce_max(high);
                total = reduce_add(sum);
            } else {
                for (int t = 0; t < G; ++t) {
                    largest = fmaxf(largest, fabsf(row[t]));
                    total += row[t];
                }
            }
            // 2^e with largest / 2^e in [2^14, 2^15): frexp gives largest = f * 2^E, f in [0.5, 1).
            int exponent = 0;
            frexpf(largest, &exponent);
            const float step = largest > 0.0f ? ldexpf(1.0f, exponent - 15) : 1.0f;
            const size_t at = static_cast<size_t>(m) * groups + g;
            r.unit[at] = step;
            if (sums) r.xsum[at] = total;
            int16_t* dst = r.xq.data() + static_cast<size_t>(m) * Kp + g * G;
            if (whole) {
                const VF inverse = fset1(1.0f / step);  // a power of two: exact
                for (int t = 0; t < G; t += LANES) store_rounded(dst + t, vload_f(row + t), inverse);
            } else {
                for (int t = 0; t < G; ++t) {
                    const float v = nearbyintf(row[t] / step);
                    dst[t] = static_cast<int16_t>(v > 32767.0f ? 32767.0f : (v < -32767.0f ? -32767.0f : v));
                }
            }
        }
    return r;
}

#if QUANT_AMX
// The AMX build (QUANT_AMX = 1, over AVX512_VNNI's): bfloat16 x only, taken as it is, since a bf16 x times a q is
// exact in float32. Each panel's q are widened once a call to bf16 pairs ([Kp / 2, 16, 2], the layout of
// cpu_gemm_amx.cpp's weights), then TDPBF16PS multiplies 16 rows of x by a chunk of C k of that (C = 32, or 16 or 8
// where G is not a multiple of 32), a group's chunks into one tile of float32 sums, which is stored and added to the
// row's accumulator times the group's scale (plus x's group sum times its offset), as tile() adds its integer sums.
// Tiles: 0-3 the sums of 4 consecutive groups, stored together; 4-5 x and 6-7 w, alternating between the groups.
namespace amx_path {

using amx::tile_dp;
using amx::tile_load;
using amx::tile_store;
using amx::tile_zero;
using amx::unroll;

constexpr int ROWS = 16, BATCH = 4;

// k per TDPBF16PS: a chunk of at most 32 that divides the group.
inline int chunk_k(int G) { return G % 32 == 0 ? 32 : (G % 16 == 0 ? 16 : 8); }

void configure_tiles(int C) {
    amx::configure({ROWS, ROWS, ROWS, ROWS, ROWS, ROWS, static_cast<uint8_t>(C / 2), static_cast<uint8_t>(C / 2)},
                   {64, 64, 64, 64, static_cast<uint16_t>(2 * C), static_cast<uint16_t>(2 * C), 64, 64});
}

// bf16 of the integers -32 .. 31 (int6's q) and 0 .. 31 (int4's), the tables of the widening below.
struct Tables {
    __m512i negative, positive;
    Tables() {
        alignas(64) uint16_t low[32], high[32];
        for (int i = 0; i < 32; ++i) low[i] = f32_to_bf16(i - 32.0f), high[i] = f32_to_bf16(static_cast<float>(i));
        negative = _mm512_load_si512(low), positive = _mm512_load_si512(high);
    }
};

// 32 int16 q (step_pairs' lanes) as bf16: int4's and int6's looked up in the tables, int8's through float32.
template <int BITS>
inline __m512i widened(__m512i q, const Tables& t) {
    if constexpr (BITS == INT4) {
        return _mm512_permutexvar_epi16(q, t.positive);
    } else if constexpr (BITS == INT6) {
        return _mm512_permutex2var_epi16(t.negative, _mm512_add_epi16(q, _mm512_set1_epi16(32)), t.positive);
    } else {
        const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(q)));
        const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(q, 1)));
        return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low));
    }
}

// A panel's q (`q`: its steps) as bf16 pairs: 32 values (16 columns x a k pair) a 64-byte row, Kp / 2 rows.
template <int BITS>
void widen_panel(const uint8_t* q, int Kp, const Tables& t, uint16_t* pairs) {
    constexpr int STEP_K = step_k(BITS), PAIRS = STEP_K / 2;
    for (int k = 0; k < Kp; k += STEP_K) {
        VI w[PAIRS];
        step_pairs<BITS>(q + static_cast<int64_t>(k / STEP_K) * step_bytes(BITS), w);
#pragma GCC unroll 4
        for (int i = 0; i < PAIRS; ++i) _mm512_storeu_si512(pairs + (k / 2 + i) * 32, widened<BITS>(w[i], t));
    }
}

// Rows m0 .. m0 + R of x (`xb`: bf16_rows' tiles; R <= 16, the tiles multiply 16) against the panel at
// `panel` (widened into `pairs`), out written for the rows below p.M; `sums`: 2 x 4 x 256 floats of scratch. A batch's
// products are issued and stored before the previous batch's sums are scaled, so that the vector work overlaps the
// tiles'.
template <int BITS, int R>
void rows(const Problem& p, const uint16_t* xb, const uint8_t* panel, const uint16_t* pairs, int n0, int m0,
          float* sums) {
    VF acc[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[r] = fzero();
    const int groups = p.Kp / p.G, C = chunk_k(p.G), chunks = p.G / C;
    const uint16_t* x = xb + static_cast<int64_t>(m0) * p.Kp;  // its row block: [Kp / C][16][C]
    const auto issue = [&](int g0, float* to) {
        unroll<BATCH>([&](auto b) {
            constexpr int B = decltype(b)::value, A = 4 + B % 2, W = 6 + B % 2;
            if (g0 + B >= groups) return;
            tile_zero<B>();
            for (int c = 0; c < chunks; ++c) {
                const int k = (g0 + B) * p.G + c * C;
                tile_load<A>(x + static_cast<int64_t>(k) * ROWS, 2 * C);
                tile_load<W>(pairs + k / 2 * 32, 64);
                tile_dp<B, A, W>();
            }
            tile_store<B>(to + B * 256, 64);
        });
    };
    issue(0, sums);
    for (int g0 = 0, turn = 0; g0 < groups; g0 += BATCH, turn ^= 1) {
        if (g0 + BATCH < groups) issue(g0 + BATCH, sums + (turn ^ 1) * BATCH * 256);
        const float* from = sums + turn * BATCH * 256;
        for (int b = 0; b < BATCH && g0 + b < groups; ++b) {
            const int g = g0 + b;
            VF s[L], offset[L];
            group_scales<BITS>(p, panel, g, s, offset);
#pragma GCC unroll 16
            for (int r = 0; r < R; ++r) {
                acc[r] = ffma(vload_f(from + b * 256 + r * 16), s[0], acc[r]);
                if (p.xsum) acc[r] = ffma(fset1(p.xsum[static_cast<int64_t>(m0 + r) * groups + g]), offset[0], acc[r]);
            }
        }
    }
    for (int r = 0; r < R && m0 + r < p.M; ++r) store_columns(p, m0 + r, n0, &acc[r]);
}

// Panels [begin, end) of p, every row (the tiles configured by the caller): blocks of 16 rows, the last of 1, 2, 4, 8
// or 16.
template <int BITS>
void share(const Problem& p, const uint16_t* xb, int begin, int end, const Tables& t, std::vector<uint16_t>& pairs,
           float* sums) {
    pairs.resize(static_cast<size_t>(p.Kp) * PANEL);
    for (int q = begin; q < end; ++q) {
        const uint8_t* panel = p.panels + q * p.layout.bytes;
        widen_panel<BITS>(panel + p.layout.q, p.Kp, t, pairs.data());
        for (int m0 = 0; m0 < p.M; m0 += ROWS) {
            const int left = p.M - m0;
            if (left > 8) rows<BITS, 16>(p, xb, panel, pairs.data(), q * PANEL, m0, sums);
            else if (left > 4) rows<BITS, 8>(p, xb, panel, pairs.data(), q * PANEL, m0, sums);
            else if (left > 2) rows<BITS, 4>(p, xb, panel, pairs.data(), q * PANEL, m0, sums);
            else if (left > 1) rows<BITS, 2>(p, xb, panel, pairs.data(), q * PANEL, m0, sums);
            else rows<BITS, 1>(p, xb, panel, pairs.data(), q * PANEL, m0, sums);
        }
    }
}

// x's rows in bf16, read as x[:, perm] where perm is not null, copied as the x tiles of each problem's rows
// (offsets[j] .. offsets[j + 1]): per block of 16 rows (the last padded with zeros), its chunks of C k one after the
// other, each 16 rows of C k (a tile's rows 2 C bytes apart), K padded with zeros to Kp; problem j's from
// x[starts[j]]. And each group's sum in float32 where `sums`, [M + 16, Kp / G] (a block's rows past M read zeros).
struct Rows {
    std::vector<uint16_t> x;
    std::vector<int64_t> starts;
    std::vector<float> xsum;
};

Rows bf16_rows(const uint16_t* x, const int32_t* perm, bool sums, int G, int K, int Kp, const int32_t* offsets,
               int count) {
    const int groups = Kp / G, C = chunk_k(G), M = offsets[count];
    Rows r{{}, std::vector<int64_t>(count), std::vector<float>(sums ? static_cast<size_t>(M + ROWS) * groups : 0, 0.0f)};
    int64_t size = 0;
    for (int j = 0; j < count; ++j) {
        r.starts[j] = size;
        size += static_cast<int64_t>((offsets[j + 1] - offsets[j] + ROWS - 1) / ROWS) * ROWS * Kp;
    }
    r.x.assign(size, 0);
    std::vector<uint16_t> row(Kp, 0);
    for (int j = 0; j < count; ++j)
        for (int m = offsets[j]; m < offsets[j + 1]; ++m) {
            const uint16_t* src = x + static_cast<int64_t>(m) * K;
            if (perm) for (int k = 0; k < K; ++k) row[k] = src[perm[k]];
            else memcpy(row.data(), src, sizeof(uint16_t) * K);
            const int i = m - offsets[j];
            uint16_t* block = r.x.data() + r.starts[j] + static_cast<int64_t>(i / ROWS) * ROWS * Kp;
            for (int k = 0; k < Kp; k += C) memcpy(block + static_cast<int64_t>(k) * ROWS + (i % ROWS) * C, &row[k], 2 * C);
            if (sums)
                for (int g = 0; g < groups; ++g) {
                    float total = 0.0f;
                    for (int k = g * G; k < (g + 1) * G; ++k) total += bf16_to_f32(row[k]);
                    r.xsum[static_cast<size_t>(m) * groups + g] = total;
                }
        }
    return r;
}

// Each thread an even share of the panels of every problem (problems[j]: rows offsets[j] ..; one for gemm_quant).
template <int BITS>
void run(const std::vector<Problem>& problems, const Rows& xr, int threads) {
    const Problem& first = problems[0];
    const int per = (first.N + PANEL - 1) / PANEL, count = static_cast<int>(problems.size());
    const int64_t total = static_cast<int64_t>(per) * count;
    const Tables t;
#pragma omp parallel num_threads(threads)
    {
        const int workers = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t begin = total * id / workers, end = total * (id + 1) / workers;
        if (begin < end) {
            configure_tiles(chunk_k(first.G));
            std::vector<uint16_t> pairs;
            alignas(64) float sums[2 * BATCH * 256];
            for (int64_t j = begin / per; j < count && j * per < end; ++j) {
                const Problem& p = problems[j];
                const int lo = static_cast<int>(begin > j * per ? begin - j * per : 0);
                const int hi = static_cast<int>(end < (j + 1) * per ? end - j * per : per);
                if (p.M > 0 && lo < hi) share<BITS>(p, xr.x.data() + xr.starts[j], lo, hi, t, pairs, sums);
            }
            _tile_release();
        }
    }
}

void run_bits(int bits, const std::vector<Problem>& problems, const Rows& xr, int threads) {
    if (bits == INT8) run<INT8>(problems, xr, threads);
    else if (bits == INT6) run<INT6>(problems, xr, threads);
    else run<INT4>(problems, xr, threads);
}

}  // namespace amx_path
#endif

// One-level (S = 0): float32 or bfloat16 scales, zero points for int4 only. Two-level (S > 0): float16 d (and dmin),
// mins optional for int8 and required for int4 (whose q carry no offset of 8 there).
bool refused(int bits, int G, int S, int zeros, int scale_dtype, std::initializer_list<int> dtypes) {
    if ((bits != INT8 && bits != INT4 && bits != INT6) || G < 8 || G % 8 || G > MAX_GROUP || S < 0 || S > 64)
        return true;
    if (S == 0 ? (scale_dtype != F32 && scale_dtype != BF16) || bits == INT6 || (bits == INT8 && zeros)
               : scale_dtype != F16 || (bits == INT4 && !zeros) || (bits == INT6 && zeros))
        return true;
    for (int dtype : dtypes)
        if (dtype != F32 && dtype != BF16) return true;
    return false;
}

// The AMX build multiplies bfloat16 x only (a float32 x would be rounded).
inline bool x_refused(int x_dtype) { return QUANT_AMX && x_dtype != BF16; }

}  // namespace

// x [M, K] float32 or bfloat16, read as x[:, perm] where perm (int32 [K], a permutation of 0..K-1: a GPTQ
// checkpoint's act-order columns) is not null; panels as above (zeros: whether they hold zero points, int4 only, or
// two-level mins); bits 8, 4 or 6 (two-level only); group G (a multiple of 8, at most 512); S groups per super-block of two-level scales
// (scale_dtype float16), or 0 (one level). Returns 0, or 1 (nothing written) where bits, G, S or the dtypes are out of
// range.
extern "C" int gemm_quant(const void* x, int x_dtype, const int32_t* perm, const void* panels, int zeros,
                          int scale_dtype, int bits, int G, int S, const void* bias, int bias_dtype, void* out,
                          int out_dtype, int M, int N, int K, int prefetch_mode, int threads) {
    if (refused(bits, G, S, zeros, scale_dtype, {x_dtype, out_dtype}) || x_refused(x_dtype) || M < 0 || N < 1 ||
        K < 1)
        return 1;
    if (M == 0) return 0;
    const int Kp = padded_k(K, G, S);
    const bool sums = bits == INT4 || zeros;
    const std::vector<float> bias32 = bias_as_f32(bias, bias_dtype, N);
#if QUANT_AMX
    const int32_t rows[2] = {0, M};
    const amx_path::Rows xr = amx_path::bf16_rows(static_cast<const uint16_t*>(x), perm, sums, G, K, Kp, rows, 1);
    const std::vector<Problem> problem{{nullptr, nullptr, sums ? xr.xsum.data() : nullptr,
                                        static_cast<const uint8_t*>(panels),
                                        panel_layout(bits, G, S, Kp, scale_dtype, zeros != 0),
                                        bias ? bias32.data() : nullptr, out, scale_dtype, out_dtype, M, N, Kp, G, S}};
    amx_path::run_bits(bits, problem, xr, threads);
    (void)prefetch_mode;  // the widening reads each panel once, in order: no software prefetch
#else
    const RoundedRows rows = round_rows(x, x_dtype, perm, sums, G, M, K, Kp, threads);
    const Problem p{rows.xq.data(), rows.unit.data(), sums ? rows.xsum.data() : nullptr,
                    static_cast<const uint8_t*>(panels), panel_layout(bits, G, S, Kp, scale_dtype, zeros != 0),
                    bias ? bias32.data() : nullptr, out, scale_dtype, out_dtype, M, N, Kp, G, S};
    const bool far = prefetch_mode == FAR;
    if (bits == INT8) far ? run<INT8, FAR>(p, threads) : run<INT8, NEAR>(p, threads);
    else if (bits == INT6) far ? run<INT6, FAR>(p, threads) : run<INT6, NEAR>(p, threads);
    else far ? run<INT4, FAR>(p, threads) : run<INT4, NEAR>(p, threads);
#endif
    return 0;
}

// Several weights of one shape and format, each on its own rows of x, in one call (a mixture of experts' experts,
// each on the tokens routed to it): weight j (panels[j]) multiplies rows offsets[j] .. offsets[j + 1] of x [M, K]
// into the same rows of out [M, N] (M = offsets[count]); x rounded once, and one parallel region in which the
// threads share out every weight's panels evenly (a weight's rows computed as gemm_quant computes them). No perm,
// no bias. Returns 0, or 1 (nothing written) where bits, G, S or the dtypes are out of range.
extern "C" int gemm_quant_grouped(const void* x, int x_dtype, const void* const* panels, int zeros, int scale_dtype,
                                  int bits, int G, int S, void* out, int out_dtype, const int32_t* offsets, int count,
                                  int N, int K, int prefetch_mode, int threads) {
    if (refused(bits, G, S, zeros, scale_dtype, {x_dtype, out_dtype}) || x_refused(x_dtype) || count < 0 || N < 1 ||
        K < 1)
        return 1;
    const int M = count > 0 ? offsets[count] : 0;
    if (M == 0) return 0;
    const int Kp = padded_k(K, G, S), groups = Kp / G, per = (N + PANEL - 1) / PANEL;
    const bool sums = bits == INT4 || zeros;
    const PanelLayout layout = panel_layout(bits, G, S, Kp, scale_dtype, zeros != 0);
    const int64_t out_row = static_cast<int64_t>(N) * (out_dtype == BF16 ? 2 : 4);
    std::vector<Problem> problems;
#if QUANT_AMX
    const amx_path::Rows xr = amx_path::bf16_rows(static_cast<const uint16_t*>(x), nullptr, sums, G, K, Kp, offsets,
                                                  count);
    for (int j = 0; j < count; ++j) {
        const int64_t first = offsets[j];
        problems.push_back({nullptr, nullptr, sums ? xr.xsum.data() + first * groups : nullptr,
                            static_cast<const uint8_t*>(panels[j]), layout, nullptr,
                            static_cast<uint8_t*>(out) + first * out_row, scale_dtype, out_dtype,
                            offsets[j + 1] - offsets[j], N, Kp, G, S});
    }
    amx_path::run_bits(bits, problems, xr, threads);
    (void)prefetch_mode;
#else
    const RoundedRows rows = round_rows(x, x_dtype, nullptr, sums, G, M, K, Kp, threads);
    for (int j = 0; j < count; ++j) {
        const int64_t first = offsets[j];
        problems.push_back({rows.xq.data() + first * Kp, rows.unit.data() + first * groups,
                            sums ? rows.xsum.data() + first * groups : nullptr,
                            static_cast<const uint8_t*>(panels[j]), layout, nullptr,
                            static_cast<uint8_t*>(out) + first * out_row, scale_dtype, out_dtype,
                            offsets[j + 1] - offsets[j], N, Kp, G, S});
    }
    const int64_t total = static_cast<int64_t>(per) * count;
    const bool far = prefetch_mode == FAR;
#pragma omp parallel num_threads(threads)
    {
        const int workers = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t begin = total * id / workers, end = total * (id + 1) / workers;
        for (int64_t j = begin / per; j < count && j * per < end; ++j) {
            const Problem& p = problems[j];
            const int lo = static_cast<int>(begin > j * per ? begin - j * per : 0);
            const int hi = static_cast<int>(end < (j + 1) * per ? end - j * per : per);
            if (p.M == 0 || lo >= hi) continue;
            if (bits == INT8) far ? share_rows<INT8, FAR>(p, lo, hi) : share_rows<INT8, NEAR>(p, lo, hi);
            else if (bits == INT6) far ? share_rows<INT6, FAR>(p, lo, hi) : share_rows<INT6, NEAR>(p, lo, hi);
            else far ? share_rows<INT4, FAR>(p, lo, hi) : share_rows<INT4, NEAR>(p, lo, hi);
        }
    }
#endif
    return 0;
}

#if QUANT_AMX
// The process's permission to use the AMX tile data (amx.h): 0 when granted, else the errno of the refusal.
extern "C" int amx_enable() { return amx::request_tile_data(); }
#endif
