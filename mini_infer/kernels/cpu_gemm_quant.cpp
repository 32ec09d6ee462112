// out[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) with w quantised weight-only, group-wise along K; built three times
// (kernels/cpu.py): AVX2 (QUANT_AVX512 = 0: 8 int32 lanes, vpmaddwd + vpaddd), AVX-512BW (QUANT_AVX512 = 1, 16
// lanes, the same two instructions) and AVX512_VNNI (QUANT_VNNI = 1: vpdpwssd, the two in one).
//
// Formats (kernels/quant.py packs them), for each group of G consecutive k of a column n:
//  - int8: w[n, k] = q[n, k] * scale[n, g], q signed 8-bit (symmetric).
//  - int4: w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g], q an unsigned nibble (zero null: 0).
// Layouts, in panels of 16 output columns (columns past N are zero): int8 q [ceil(N / 16), Kp / 2, 16, 2] int8
// (k pairs, as vpmaddwd reads them once widened to int16); int4 q [ceil(N / 16), Kp / 4, 32] bytes where byte
// 2c + t of a k quad s holds q[c, 4s + t] in its low nibble and q[c, 4s + 2 + t] in its high one (so a mask gives
// the pair (4s, 4s + 1) of 16 columns and a shift the pair (4s + 2, 4s + 3)); scale and zero [ceil(N / 16), Kp / G,
// 16] float32 or bfloat16 (scale_dtype). Kp: K rounded up to a multiple of G (the weights past K are zero).
//
// The products are integer: each row of x is rounded to int16 per group of G, x[m, k] ~ xq[m, k] * 2^e[m, g], with
// the power of two that puts the group's largest |x| in [2^14, 2^15) (a bf16 x within 2^-7 of its group's largest
// is exact; the rounding error is at most 2^-16 of the group's largest). A group's sum of xq * q (at most
// G * 2^15 * 127 < 2^31 for G <= 512) is widened to float32 and added to the accumulator times scale * 2^e, and for
// int4 x's float32 group sum times (zero - 8 * scale). Tiles of MR rows by NP panels; threads split the panels.
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "bf16.h"

namespace {

enum DType : int { F32 = 0, BF16 = 1 };
enum Bits : int { INT4 = 4, INT8 = 8 };
enum Prefetch : int { NEAR = 0, FAR = 1 };  // as cpu_gemm_avx512.cpp's; the AVX2 build prefetches nothing
constexpr int PANEL = 16;
constexpr int MAX_GROUP = 512;

#if QUANT_AVX512
constexpr int LANES = 16;
using VI = __m512i;
using VF = __m512;
inline VI izero() { return _mm512_setzero_si512(); }
inline VF fzero() { return _mm512_setzero_ps(); }
inline VF fset1(float v) { return _mm512_set1_ps(v); }
inline VF ffma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
inline VF fmul(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline VF to_float(VI v) { return _mm512_cvtepi32_ps(v); }
inline VI pair_broadcast(const int16_t* x) {
    int32_t pair;
    memcpy(&pair, x, sizeof pair);
    return _mm512_set1_epi32(pair);
}
// acc += the int16 pair products of w and x, summed per 32-bit lane.
inline VI dot(VI acc, VI w, VI x) {
#if QUANT_VNNI
    return _mm512_dpwssd_epi32(acc, w, x);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}
// One k pair of a panel's int8 columns (32 bytes) as int16 pairs.
inline void int8_pairs(const int8_t* p, VI* w) {
    w[0] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// One k quad of a panel's int4 columns (32 bytes): the pairs (4s, 4s + 1) and (4s + 2, 4s + 3).
inline void int4_pairs(const uint8_t* p, VI* low, VI* high) {
    const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    low[0] = _mm512_and_si512(v, _mm512_set1_epi16(15));
    high[0] = _mm512_srli_epi16(v, 4);
}
inline void scale_columns(const void* p, int dtype, VF* s) {
    if (dtype == BF16) {
        const __m256i raw = _mm256_loadu_si256(static_cast<const __m256i*>(p));
        s[0] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    } else {
        s[0] = _mm512_loadu_ps(static_cast<const float*>(p));
    }
}
inline void store16(float* dst, const VF* v) { _mm512_storeu_ps(dst, v[0]); }
// The weight stream ahead of a step's 32 bytes, one cache line per two steps (`line`: the step's first half).
template <int PF>
inline void prefetch(const void* p, int64_t step_bytes, bool line) {
    if (!line) return;
    if constexpr (PF == NEAR) _mm_prefetch(static_cast<const char*>(p) + 64 * step_bytes, _MM_HINT_T0);
    else _mm_prefetch(static_cast<const char*>(p) + 512 * step_bytes, _MM_HINT_T1);
}
#else
constexpr int LANES = 8;
using VI = __m256i;
using VF = __m256;
inline VI izero() { return _mm256_setzero_si256(); }
inline VF fzero() { return _mm256_setzero_ps(); }
inline VF fset1(float v) { return _mm256_set1_ps(v); }
inline VF ffma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
inline VF fmul(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline VF to_float(VI v) { return _mm256_cvtepi32_ps(v); }
inline VI pair_broadcast(const int16_t* x) {
    int32_t pair;
    memcpy(&pair, x, sizeof pair);
    return _mm256_set1_epi32(pair);
}
inline VI dot(VI acc, VI w, VI x) { return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x)); }
inline void int8_pairs(const int8_t* p, VI* w) {
    w[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    w[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
}
inline void int4_pairs(const uint8_t* p, VI* low, VI* high) {
    for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * h)));
        low[h] = _mm256_and_si256(v, _mm256_set1_epi16(15));
        high[h] = _mm256_srli_epi16(v, 4);
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
inline void store16(float* dst, const VF* v) {
    _mm256_storeu_ps(dst, v[0]);
    _mm256_storeu_ps(dst + 8, v[1]);
}
template <int PF>
inline void prefetch(const void*, int64_t, bool) {}
#endif
constexpr int L = PANEL / LANES;  // vectors per panel

struct Problem {
    const int16_t* x;     // [M, Kp]: x rounded to int16 per group, zero past K
    const float* unit;    // [M, Kp / G]: 2^e of each row's group (x ~ xq * unit)
    const float* xsum;    // int4: float32 [M, Kp / G], each group's sum of x; else null
    const void* q;
    const void* scale;
    const void* zero;     // int4 only, or null
    const float* bias;    // float32 [N] or null
    void* out;
    int scale_dtype, out_dtype, M, N, Kp, G;
};

inline void store_columns(const Problem& p, int m, int n0, const VF* acc) {
    alignas(64) float values[PANEL];
    store16(values, acc);
    const int count = p.N - n0 < PANEL ? p.N - n0 : PANEL;
    const int64_t row = static_cast<int64_t>(m) * p.N + n0;
    for (int c = 0; c < count; ++c) {
        const float v = values[c] + (p.bias ? p.bias[n0 + c] : 0.0f);
        if (p.out_dtype == BF16) static_cast<uint16_t*>(p.out)[row + c] = f32_to_bf16(v);
        else static_cast<float*>(p.out)[row + c] = v;
    }
}

// Rows m0 .. m0 + MR of out against panels panel0 .. panel0 + NP.
template <int BITS, int MR, int NP, int PF>
inline void tile(const Problem& p, int m0, int panel0) {
    VF acc[MR][NP][L];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
        for (int j = 0; j < NP; ++j)
#pragma GCC unroll 2
            for (int h = 0; h < L; ++h) acc[i][j][h] = fzero();
    const int groups = p.Kp / p.G;
    constexpr int64_t STEP_BYTES = 32;  // a panel's bytes per k pair (int8) or k quad (int4)
    constexpr int STEP_K = BITS == INT8 ? 2 : 4;
    const int64_t panel_bytes = static_cast<int64_t>(p.Kp) * PANEL * BITS / 8;
    const uint8_t* q = static_cast<const uint8_t*>(p.q) + panel0 * panel_bytes;
    const int scale_size = p.scale_dtype == BF16 ? 2 : 4;
    const int64_t panel_scales = static_cast<int64_t>(groups) * PANEL;
    const int16_t* x = p.x + static_cast<int64_t>(m0) * p.Kp;
    for (int g = 0; g < groups; ++g) {
        VI sum[MR][NP][L];
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
            for (int j = 0; j < NP; ++j)
#pragma GCC unroll 2
                for (int h = 0; h < L; ++h) sum[i][j][h] = izero();
        for (int k = g * p.G; k < (g + 1) * p.G; k += STEP_K) {
            const int64_t offset = static_cast<int64_t>(k / STEP_K) * STEP_BYTES;
            const bool line = (k / STEP_K) % 2 == 0;
            if constexpr (BITS == INT8) {
                VI w[NP][L];
#pragma GCC unroll 8
                for (int j = 0; j < NP; ++j) {
                    prefetch<PF>(q + j * panel_bytes + offset, STEP_BYTES, line);
                    int8_pairs(reinterpret_cast<const int8_t*>(q + j * panel_bytes + offset), w[j]);
                }
#pragma GCC unroll 8
                for (int i = 0; i < MR; ++i) {
                    const VI xv = pair_broadcast(x + static_cast<int64_t>(i) * p.Kp + k);
#pragma GCC unroll 8
                    for (int j = 0; j < NP; ++j)
#pragma GCC unroll 2
                        for (int h = 0; h < L; ++h) sum[i][j][h] = dot(sum[i][j][h], w[j][h], xv);
                }
            } else {
                VI low[NP][L], high[NP][L];
#pragma GCC unroll 8
                for (int j = 0; j < NP; ++j) {
                    prefetch<PF>(q + j * panel_bytes + offset, STEP_BYTES, line);
                    int4_pairs(q + j * panel_bytes + offset, low[j], high[j]);
                }
#pragma GCC unroll 8
                for (int i = 0; i < MR; ++i) {
                    const VI x0 = pair_broadcast(x + static_cast<int64_t>(i) * p.Kp + k);
                    const VI x1 = pair_broadcast(x + static_cast<int64_t>(i) * p.Kp + k + 2);
#pragma GCC unroll 8
                    for (int j = 0; j < NP; ++j)
#pragma GCC unroll 2
                        for (int h = 0; h < L; ++h)
                            sum[i][j][h] = dot(dot(sum[i][j][h], low[j][h], x0), high[j][h], x1);
                }
            }
        }
#pragma GCC unroll 8
        for (int j = 0; j < NP; ++j) {
            const int64_t at = (panel0 + j) * panel_scales + static_cast<int64_t>(g) * PANEL;
            VF s[L], offset[L];
            scale_columns(static_cast<const char*>(p.scale) + at * scale_size, p.scale_dtype, s);
            if constexpr (BITS == INT4) {
                // sum holds x . q with q in 0..15: w = (q - 8) s + z adds (z - 8 s) times x's group sum.
                VF z[L];
                if (p.zero) scale_columns(static_cast<const char*>(p.zero) + at * scale_size, p.scale_dtype, z);
#pragma GCC unroll 2
                for (int h = 0; h < L; ++h) offset[h] = ffma(fset1(-8.0f), s[h], p.zero ? z[h] : fzero());
            }
#pragma GCC unroll 8
            for (int i = 0; i < MR; ++i) {
                const int64_t row_group = static_cast<int64_t>(m0 + i) * groups + g;
                const VF unit = fset1(p.unit[row_group]);
#pragma GCC unroll 2
                for (int h = 0; h < L; ++h) {
                    acc[i][j][h] = ffma(to_float(sum[i][j][h]), fmul(s[h], unit), acc[i][j][h]);
                    if constexpr (BITS == INT4) acc[i][j][h] = ffma(fset1(p.xsum[row_group]), offset[h], acc[i][j][h]);
                }
            }
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
        for (int j = 0; j < NP; ++j) store_columns(p, m0 + i, (panel0 + j) * PANEL, acc[i][j]);
}

template <int BITS, int MR, int NP, int PF>
inline void panel_group(const Problem& p, int panel0) {
    int m = 0;
    for (; m + MR <= p.M; m += MR) tile<BITS, MR, NP, PF>(p, m, panel0);
    switch (p.M - m) {
        case 3: if constexpr (MR > 3) tile<BITS, 3, NP, PF>(p, m, panel0); break;
        case 2: if constexpr (MR > 2) tile<BITS, 2, NP, PF>(p, m, panel0); break;
        case 1: if constexpr (MR > 1) tile<BITS, 1, NP, PF>(p, m, panel0); break;
        default: break;
    }
}

// The last panels of a thread's share, fewer than NP: one group as wide as they are.
template <int BITS, int MR, int NP, int PF>
inline void panel_rest(const Problem& p, int panel0, int count) {
    if constexpr (NP > 1) {
        if (count == NP - 1) panel_group<BITS, MR, NP - 1, PF>(p, panel0);
        else panel_rest<BITS, MR, NP - 1, PF>(p, panel0, count);
    }
}

// Each thread an even share of the panels: groups of NP, then one narrower group.
template <int BITS, int MR, int NP, int PF>
void run_groups(const Problem& p, int threads) {
    const int panels = (p.N + PANEL - 1) / PANEL;
#pragma omp parallel num_threads(threads)
    {
        const int workers = omp_get_num_threads(), id = omp_get_thread_num();
        const int begin = static_cast<int>(static_cast<int64_t>(panels) * id / workers);
        const int end = static_cast<int>(static_cast<int64_t>(panels) * (id + 1) / workers);
        int q = begin;
        for (; q + NP <= end; q += NP) panel_group<BITS, MR, NP, PF>(p, q);
        if (q < end) panel_rest<BITS, MR, NP, PF>(p, q, end - q);
    }
}

// One row: more panels per tile (independent chains, each weight vector used once); more rows: MR x NP tiles that
// keep MR * NP * L float accumulators and as many integer group sums in the vector registers.
template <int BITS, int PF>
void run(const Problem& p, int threads) {
#if QUANT_AVX512
    if (p.M == 1) run_groups<BITS, 1, 8, PF>(p, threads);
    else if (p.M == 2) run_groups<BITS, 2, 4, PF>(p, threads);
    else run_groups<BITS, 4, 2, PF>(p, threads);
#else
    if (p.M == 1) run_groups<BITS, 1, 2, PF>(p, threads);
    else run_groups<BITS, 2, 1, PF>(p, threads);
#endif
}

inline float load_scalar(const void* data, int dtype, int64_t i) {
    return dtype == BF16 ? bf16_to_f32(static_cast<const uint16_t*>(data)[i]) : static_cast<const float*>(data)[i];
}

}  // namespace

// x [M, K] float32 or bfloat16; q, scale, zero as above (zero: int4 only, or null); bits 8 or 4; group G (a multiple
// of 4, at most 512) divides Kp = K rounded up to a multiple of G. Returns 0, or 1 (nothing written) where bits, G or
// the dtypes are out of range.
extern "C" int gemm_quant(const void* x, int x_dtype, const void* q, const void* scale, const void* zero,
                          int scale_dtype, int bits, int G, const void* bias, int bias_dtype, void* out, int out_dtype,
                          int M, int N, int K, int prefetch_mode, int threads) {
    if ((bits != INT8 && bits != INT4) || G < 4 || G % 4 || G > MAX_GROUP || M < 0 || N < 1 || K < 1 ||
        (bits == INT8 && zero))
        return 1;
    for (int dtype : {x_dtype, scale_dtype, out_dtype})
        if (dtype != F32 && dtype != BF16) return 1;
    if (M == 0) return 0;
    const int Kp = (K + G - 1) / G * G, groups = Kp / G;
    std::vector<int16_t> xq(static_cast<size_t>(M) * Kp, 0);
    std::vector<float> unit(static_cast<size_t>(M) * groups), xsum(bits == INT4 ? unit.size() : 0);
    float row[MAX_GROUP];
#pragma omp parallel for num_threads(threads) private(row) if (static_cast<int64_t>(M) * K >= 65536)
    for (int m = 0; m < M; ++m)
        for (int g = 0; g < groups; ++g) {
            float largest = 0.0f, total = 0.0f;
            for (int t = 0; t < G; ++t) {
                const int k = g * G + t;
                row[t] = k < K ? load_scalar(x, x_dtype, static_cast<int64_t>(m) * K + k) : 0.0f;
                largest = fmaxf(largest, fabsf(row[t]));
                total += row[t];
            }
            // 2^e with largest / 2^e in [2^14, 2^15): frexp gives largest = f * 2^E, f in [0.5, 1).
            int exponent = 0;
            frexpf(largest, &exponent);
            const float step = largest > 0.0f ? ldexpf(1.0f, exponent - 15) : 1.0f;
            const size_t at = static_cast<size_t>(m) * groups + g;
            unit[at] = step;
            if (bits == INT4) xsum[at] = total;
            int16_t* dst = xq.data() + static_cast<size_t>(m) * Kp + g * G;
            for (int t = 0; t < G; ++t) {
                const float v = nearbyintf(row[t] / step);
                dst[t] = static_cast<int16_t>(v > 32767.0f ? 32767.0f : (v < -32767.0f ? -32767.0f : v));
            }
        }
    std::vector<float> bias32;
    if (bias) {
        bias32.resize(N);
        for (int n = 0; n < N; ++n) bias32[n] = load_scalar(bias, bias_dtype, n);
    }
    const Problem p{xq.data(), unit.data(), bits == INT4 ? xsum.data() : nullptr, q, scale, zero,
                    bias ? bias32.data() : nullptr, out, scale_dtype, out_dtype, M, N, Kp, G};
    const bool far = prefetch_mode == FAR;
    if (bits == INT8) far ? run<INT8, FAR>(p, threads) : run<INT8, NEAR>(p, threads);
    else far ? run<INT4, FAR>(p, threads) : run<INT4, NEAR>(p, threads);
    return 0;
}
