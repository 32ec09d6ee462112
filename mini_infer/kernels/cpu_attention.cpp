// Attention over a paged KV cache, read through block tables: decode (one query token per request, below) and
// prefill (one request's new tokens, further down).
//
// q [R, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D]; block_tables [R, max_blocks] (int64);
// context_lens [R] (int64); out [R, H, D]. q, the caches and out are each float32 or bfloat16; arithmetic is
// float32. One work item is a (request, KV head) pair with its G = H / KVH query heads, so each K and V row is
// read from the cache once for the whole group (bfloat16 rows widened once into a per-thread float32 copy).
// Two passes: the scores (four tokens at a time) and their softmax, then the weighted sum of V, a head's D outputs
// held in registers across the context 64 at a time.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "bf16.h"
#include "exp8.h"

namespace {

enum DType : int { F32 = 0, BF16 = 1 };

inline float load(const void* data, int dtype, int64_t i) {
    return dtype == BF16 ? bf16_to_f32(static_cast<const uint16_t*>(data)[i]) : static_cast<const float*>(data)[i];
}

// Row of D bfloat16 values as float32 into dst.
inline void widen_row(const uint16_t* src, int D, float* dst) {
    int d = 0;
    for (; d + 8 <= D; d += 8) {
        __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d)));
        _mm256_storeu_ps(dst + d, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
    }
    for (; d < D; ++d) dst[d] = bf16_to_f32(src[d]);
}

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

inline float dot(const float* a, const float* b, int D) {  // two accumulators: half the dependency chain
    __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
    int d = 0;
    for (; d + 16 <= D; d += 16) {
        even = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), even);
        odd = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), odd);
    }
    for (; d + 8 <= D; d += 8) even = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), even);
    float total = hsum(_mm256_add_ps(even, odd));
    for (; d < D; ++d) total += a[d] * b[d];
    return total;
}

// out[0:4] = q . rows[0..3] (D a multiple of 8): four dot products summed across their lanes together.
inline void scores4(const float* q, const float* const* rows, int D, float* out) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int i = 0; i < 4; ++i) acc[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows[i] + d), acc[i]);
    }
    // hadd pairs lanes within each 128-bit half: the low half ends with the four sums of lanes 0-3, the high
    // half with those of lanes 4-7.
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

// out[0:8 * CHUNKS] = sum over t of p[t] * rows[t][0:8 * CHUNKS], the sums held in registers.
template <int CHUNKS>
inline void weighted_sum(const float* const* rows, const float* p, int ctx, float* out) {
    __m256 acc[CHUNKS];
    for (int j = 0; j < CHUNKS; ++j) acc[j] = _mm256_setzero_ps();
    for (int t = 0; t < ctx; ++t) {
        const __m256 weight = _mm256_set1_ps(p[t]);
        for (int j = 0; j < CHUNKS; ++j) acc[j] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(rows[t] + 8 * j), acc[j]);
    }
    for (int j = 0; j < CHUNKS; ++j) _mm256_storeu_ps(out + 8 * j, acc[j]);
}

// p[0 .. n) -> exp(p - max), zero from n to `to`; returns the sum.
inline float softmax_numerators(float* p, int n, int to) {
    __m256 peaks = _mm256_set1_ps(p[0]);
    int t = 0;
    for (; t + 8 <= n; t += 8) peaks = _mm256_max_ps(peaks, _mm256_loadu_ps(p + t));
    float lanes[8];
    _mm256_storeu_ps(lanes, peaks);
    float peak = lanes[0];
    for (int l = 1; l < 8; ++l) peak = lanes[l] > peak ? lanes[l] : peak;
    for (; t < n; ++t) peak = p[t] > peak ? p[t] : peak;
    const __m256 peak8 = _mm256_set1_ps(peak);
    __m256 sum8 = _mm256_setzero_ps();
    for (t = 0; t + 8 <= n; t += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + t), peak8));
        _mm256_storeu_ps(p + t, e);
        sum8 = _mm256_add_ps(sum8, e);
    }
    float total = hsum(sum8);
    if (t < n) {
        float tail[8] = {};
        for (int i = t; i < n; ++i) tail[i - t] = p[i] - peak;
        _mm256_storeu_ps(tail, exp8(_mm256_loadu_ps(tail)));
        for (int i = t; i < n; ++i) total += (p[i] = tail[i - t]);
    }
    for (int i = n; i < to; ++i) p[i] = 0.0f;
    return total;
}

// Whether every context length is in [1, max_blocks * block_size] and every block id in [0, num_blocks): what the
// decode kernels check on the way in, before they read the caches.
inline bool decode_inputs_fit(const int64_t* block_tables, const int64_t* context_lens, int R, int block_size,
                              int max_blocks, int64_t num_blocks) {
    for (int r = 0; r < R; ++r)
        if (context_lens[r] < 1 || context_lens[r] > static_cast<int64_t>(max_blocks) * block_size) return false;
    for (int64_t i = 0; i < static_cast<int64_t>(R) * max_blocks; ++i)
        if (block_tables[i] < 0 || block_tables[i] >= num_blocks) return false;
    return true;
}

// Whether Lq is in [1, ctx] and the block ids the context needs are in [0, num_blocks): the prefill kernels' check.
inline bool prefill_inputs_fit(const int64_t* blocks, int Lq, int ctx, int block_size, int64_t num_blocks) {
    if (Lq < 1 || Lq > ctx) return false;
    for (int b = 0; b < (ctx + block_size - 1) / block_size; ++b)
        if (blocks[b] < 0 || blocks[b] >= num_blocks) return false;
    return true;
}

struct Args {
    const void* q; const void* k_cache; const void* v_cache; const int64_t* block_tables;
    const int64_t* context_lens; void* out;
    int io_dtype, cache_dtype, R, H, KVH, D, block_size, max_blocks;
    float scale;
};

struct Scratch {  // one per thread, grown as contexts grow
    std::vector<float> q, scores, keys, values, acc, totals;
    std::vector<const float*> key_rows, value_rows, shifted;
};

void attend(const Args& a, int r, int kv_head, Scratch& s) {
    const int G = a.H / a.KVH, D = a.D, ctx = static_cast<int>(a.context_lens[r]);
    s.q.resize(static_cast<size_t>(G) * D);
    s.scores.resize(static_cast<size_t>(G) * ctx);
    s.acc.resize(static_cast<size_t>(G) * D);
    s.totals.resize(G);
    s.key_rows.resize(ctx);
    s.value_rows.resize(ctx);
    const int64_t q_base = (static_cast<int64_t>(r) * a.H + static_cast<int64_t>(kv_head) * G) * D;
    for (int i = 0; i < G * D; ++i) s.q[i] = load(a.q, a.io_dtype, q_base + i) * a.scale;
    // Where each context token's K and V rows are: in the cache itself (float32) or widened into scratch.
    const int64_t* blocks = a.block_tables + static_cast<int64_t>(r) * a.max_blocks;
    if (a.cache_dtype == BF16) {
        s.keys.resize(static_cast<size_t>(ctx) * D);
        s.values.resize(static_cast<size_t>(ctx) * D);
    }
    for (int t = 0; t < ctx; ++t) {
        const int64_t at = ((blocks[t / a.block_size] * a.block_size + t % a.block_size) * a.KVH + kv_head) * D;
        if (a.cache_dtype == BF16) {
            widen_row(static_cast<const uint16_t*>(a.k_cache) + at, D, s.keys.data() + static_cast<size_t>(t) * D);
            widen_row(static_cast<const uint16_t*>(a.v_cache) + at, D, s.values.data() + static_cast<size_t>(t) * D);
            s.key_rows[t] = s.keys.data() + static_cast<size_t>(t) * D;
            s.value_rows[t] = s.values.data() + static_cast<size_t>(t) * D;
        } else {
            s.key_rows[t] = static_cast<const float*>(a.k_cache) + at;
            s.value_rows[t] = static_cast<const float*>(a.v_cache) + at;
        }
    }
    for (int g = 0; g < G; ++g) {
        const float* q = s.q.data() + g * D;
        float* scores = s.scores.data() + static_cast<size_t>(g) * ctx;
        int t = 0;
        if (D % 8 == 0)
            for (; t + 4 <= ctx; t += 4) scores4(q, s.key_rows.data() + t, D, scores + t);
        for (; t < ctx; ++t) scores[t] = dot(q, s.key_rows[t], D);
    }
    for (int g = 0; g < G; ++g)  // softmax numerators; each head's sum divides its output at the end
        s.totals[g] = softmax_numerators(s.scores.data() + static_cast<size_t>(g) * ctx, ctx, ctx);
    for (int g = 0; g < G; ++g) {
        const float* p = s.scores.data() + static_cast<size_t>(g) * ctx;
        float* acc = s.acc.data() + static_cast<size_t>(g) * D;
        int d = 0;
        s.shifted.assign(s.value_rows.begin(), s.value_rows.end());  // each row's columns d .. (advanced below)
        for (; d + 64 <= D; d += 64) {
            weighted_sum<8>(s.shifted.data(), p, ctx, acc + d);
            for (int t = 0; t < ctx; ++t) s.shifted[t] += 64;
        }
        for (; d + 8 <= D; d += 8) {
            weighted_sum<1>(s.shifted.data(), p, ctx, acc + d);
            for (int t = 0; t < ctx; ++t) s.shifted[t] += 8;
        }
        for (; d < D; ++d) {
            float sum = 0.0f;
            for (int t = 0; t < ctx; ++t) sum += p[t] * s.value_rows[t][d];
            acc[d] = sum;
        }
    }
    for (int g = 0; g < G; ++g) {
        const float inverse = 1.0f / s.totals[g];
        for (int d = 0; d < D; ++d) {
            const int64_t i = q_base + static_cast<int64_t>(g) * D + d;
            const float value = s.acc[static_cast<size_t>(g) * D + d] * inverse;
            if (a.io_dtype == BF16) static_cast<uint16_t*>(a.out)[i] = f32_to_bf16(value);
            else static_cast<float*>(a.out)[i] = value;
        }
    }
}

}  // namespace

// Returns 0, or 1 without reading the caches where a context length is outside [1, max_blocks * block_size] or a
// block id outside [0, num_blocks): checked here, on the way in, rather than by tensor ops in every layer's call.
extern "C" int paged_decode_attention(const void* q, const void* k_cache, const void* v_cache,
                                      const int64_t* block_tables, const int64_t* context_lens, void* out,
                                      int io_dtype, int cache_dtype, int R, int H, int KVH, int D, int block_size,
                                      int max_blocks, int64_t num_blocks, float scale, int threads) {
    if (!decode_inputs_fit(block_tables, context_lens, R, block_size, max_blocks, num_blocks)) return 1;
    const Args a{q, k_cache, v_cache, block_tables, context_lens, out, io_dtype, cache_dtype, R, H, KVH, D,
                 block_size, max_blocks, scale};
#pragma omp parallel num_threads(threads)
    {
        Scratch scratch;
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < R * KVH; ++item) attend(a, item / KVH, item % KVH, scratch);
    }
    return 0;
}

// Prefill attention of one request: its Lq new query tokens at positions ctx - Lq .. ctx - 1, each over the keys up
// to its own position, read through the request's block-table row. K and V of the context are widened once per
// call into float32 copies (K transposed, [KVH][D][keys], so that a vector holds one d of 8 consecutive keys), then
// work items of QT query tokens x one KV head's G query heads compute their scores as a small matrix product (4
// rows x 16 keys of accumulators, one broadcast of q per row and d), a softmax per row, and the weighted sum of V
// two rows x 32 columns at a time. Arithmetic is float32 throughout.
namespace {

constexpr int QT = 8;  // query tokens per work item
constexpr int KEYS = 16;  // keys per score block (two vectors)

struct Prefill {
    const void* q; void* out;
    int io_dtype, Lq, ctx, H, KVH, D;
    float scale;
    const float* keys_t;  // [KVH][D][ctx_pad] (zero past ctx)
    const float* values;  // [KVH][ctx][D]
    int ctx_pad;
};

struct PrefillScratch {
    std::vector<float> q, scores, acc, totals;
};

// S[r][j0 .. j0 + 16) = q_r . K[j] for four rows r (the q rows D apart, the S rows `ld` apart).
inline void scores_4x16(const float* q, int D, const float* keys_t, int ctx_pad, int j0, float* s, int ld) {
    __m256 acc[4][2];
    for (auto& row : acc) row[0] = row[1] = _mm256_setzero_ps();
    for (int d = 0; d < D; ++d) {
        const float* k = keys_t + static_cast<int64_t>(d) * ctx_pad + j0;
        const __m256 k0 = _mm256_loadu_ps(k), k1 = _mm256_loadu_ps(k + 8);
        for (int r = 0; r < 4; ++r) {
            const __m256 qv = _mm256_broadcast_ss(q + r * D + d);
            acc[r][0] = _mm256_fmadd_ps(qv, k0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(qv, k1, acc[r][1]);
        }
    }
    for (int r = 0; r < 4; ++r) {
        _mm256_storeu_ps(s + r * ld + j0, acc[r][0]);
        _mm256_storeu_ps(s + r * ld + j0 + 8, acc[r][1]);
    }
}

// acc[r][c0 .. c0 + 8 * C) = sum over j < n of p_r[j] * V[j][c0 ..] for R rows (R * C accumulators).
template <int R, int C>
inline void weighted_rows(const float* p, int ld, const float* values, int D, int n, int c0, float* acc) {
    __m256 sum[R][C];
    for (auto& row : sum)
        for (auto& v : row) v = _mm256_setzero_ps();
    for (int j = 0; j < n; ++j) {
        const float* v = values + static_cast<int64_t>(j) * D + c0;
        __m256 vv[C];
        for (int c = 0; c < C; ++c) vv[c] = _mm256_loadu_ps(v + 8 * c);
        for (int r = 0; r < R; ++r) {
            const __m256 w = _mm256_broadcast_ss(p + r * ld + j);
            for (int c = 0; c < C; ++c) sum[r][c] = _mm256_fmadd_ps(w, vv[c], sum[r][c]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc + r * D + c0 + 8 * c, sum[r][c]);
}

void prefill_item(const Prefill& a, int kv_head, int tile, PrefillScratch& s) {
    const int G = a.H / a.KVH, D = a.D;
    const int first = tile * QT, tokens = std::min(QT, a.Lq - first);
    const int rows = tokens * G, padded_rows = (rows + 3) / 4 * 4;
    const int offset = a.ctx - a.Lq;  // position of query token 0
    const int keys = offset + first + tokens;  // the last token's context
    const int span = (keys + KEYS - 1) / KEYS * KEYS;
    // Row r = token i * G + head g: q scaled, float32; rows past the last are zero (computed, never stored).
    s.q.assign(static_cast<size_t>(padded_rows) * D, 0.0f);
    for (int i = 0; i < tokens; ++i)
        for (int g = 0; g < G; ++g) {
            const int64_t src = (static_cast<int64_t>(first + i) * a.H + kv_head * G + g) * D;
            float* dst = s.q.data() + static_cast<size_t>(i * G + g) * D;
            for (int d = 0; d < D; ++d) dst[d] = load(a.q, a.io_dtype, src + d) * a.scale;
        }
    s.scores.resize(static_cast<size_t>(padded_rows) * span);
    const float* keys_t = a.keys_t + static_cast<int64_t>(kv_head) * D * a.ctx_pad;
    for (int r = 0; r < padded_rows; r += 4)
        for (int j0 = 0; j0 < span; j0 += KEYS)
            scores_4x16(s.q.data() + static_cast<size_t>(r) * D, D, keys_t, a.ctx_pad, j0,
                        s.scores.data() + static_cast<size_t>(r) * span, span);
    s.totals.assign(padded_rows, 1.0f);
    for (int r = 0; r < padded_rows; ++r) {
        float* p = s.scores.data() + static_cast<size_t>(r) * span;
        if (r < rows) s.totals[r] = softmax_numerators(p, offset + first + r / G + 1, span);
        else for (int j = 0; j < span; ++j) p[j] = 0.0f;
    }
    s.acc.resize(static_cast<size_t>(padded_rows) * D);
    const float* values = a.values + static_cast<int64_t>(kv_head) * a.ctx * D;
    for (int r = 0; r < padded_rows; r += 2) {
        const float* p = s.scores.data() + static_cast<size_t>(r) * span;
        float* acc = s.acc.data() + static_cast<size_t>(r) * D;
        int c0 = 0;
        for (; c0 + 32 <= D; c0 += 32) weighted_rows<2, 4>(p, span, values, D, keys, c0, acc);
        for (; c0 + 8 <= D; c0 += 8) weighted_rows<2, 1>(p, span, values, D, keys, c0, acc);
        for (; c0 < D; ++c0)
            for (int k = 0; k < 2; ++k) {
                float sum = 0.0f;
                for (int j = 0; j < keys; ++j) sum += p[k * span + j] * values[static_cast<int64_t>(j) * D + c0];
                acc[k * D + c0] = sum;
            }
    }
    for (int i = 0; i < tokens; ++i)
        for (int g = 0; g < G; ++g) {
            const int r = i * G + g;
            const float inverse = 1.0f / s.totals[r];
            const int64_t dst = (static_cast<int64_t>(first + i) * a.H + kv_head * G + g) * D;
            for (int d = 0; d < D; ++d) {
                const float value = s.acc[static_cast<size_t>(r) * D + d] * inverse;
                if (a.io_dtype == BF16) static_cast<uint16_t*>(a.out)[dst + d] = f32_to_bf16(value);
                else static_cast<float*>(a.out)[dst + d] = value;
            }
        }
}

}  // namespace

// q, out [Lq, H, D]; the caches [num_blocks, block_size, KVH, D]; blocks: the request's block-table row (at least
// ceil(ctx / block_size) ids). Returns 0, or 1 without reading the caches where Lq is outside [1, ctx] or a block
// id the context needs is outside [0, num_blocks).
extern "C" int paged_prefill_attention(const void* q, const void* k_cache, const void* v_cache, const int64_t* blocks,
                                       void* out, int io_dtype, int cache_dtype, int Lq, int ctx, int H, int KVH,
                                       int D, int block_size, int64_t num_blocks, float scale, int threads) {
    if (!prefill_inputs_fit(blocks, Lq, ctx, block_size, num_blocks)) return 1;
    const int ctx_pad = (ctx + KEYS - 1) / KEYS * KEYS;
    std::vector<float> keys_t(static_cast<size_t>(KVH) * D * ctx_pad, 0.0f);
    std::vector<float> values(static_cast<size_t>(KVH) * ctx * D);
#pragma omp parallel for num_threads(threads) if (static_cast<int64_t>(ctx) * KVH * D >= 65536)
    for (int t = 0; t < ctx; ++t) {
        const int64_t row = (blocks[t / block_size] * block_size + t % block_size) * KVH;
        for (int h = 0; h < KVH; ++h)
            for (int d = 0; d < D; ++d) {
                const int64_t at = (row + h) * D + d;
                keys_t[(static_cast<size_t>(h) * D + d) * ctx_pad + t] = load(k_cache, cache_dtype, at);
                values[(static_cast<size_t>(h) * ctx + t) * D + d] = load(v_cache, cache_dtype, at);
            }
    }
    const Prefill a{q, out, io_dtype, Lq, ctx, H, KVH, D, scale, keys_t.data(), values.data(), ctx_pad};
    const int tiles = (Lq + QT - 1) / QT, items = tiles * KVH;
#pragma omp parallel num_threads(threads)
    {
        PrefillScratch scratch;
        // The last tiles see the longest contexts: handed out first.
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < items; ++item) {
            const int tile = tiles - 1 - item / KVH;
            prefill_item(a, item % KVH, tile, scratch);
        }
    }
    return 0;
}

#ifdef __AVX512BF16__
// The same two kernels for bfloat16 q, caches and out where the CPU has AVX512_BF16 (built a second time with it),
// D a multiple of 32: products of bfloat16 pairs summed into float32 by vdpbf16ps, 32 per instruction against the
// float32 kernels' 8 per FMA. q and K enter as the model holds them (q is scaled after, in the float32 scores); the
// softmax weights are rounded to bfloat16 for the weighted sum of V, as GPU flash attention does; every sum is float32.
// Scores take 16 keys per vector (one key per lane, a (d, d + 1) pair of each per 32-bit element); the weighted sum
// takes 16 output columns per vector (one column per lane, the pair of two consecutive keys' values).
namespace {

inline __m512 dp(__m512 acc, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
}

inline uint32_t word(const uint16_t* pair) {  // two consecutive bfloat16 as one 32-bit element
    uint32_t w;
    memcpy(&w, pair, sizeof w);
    return w;
}

// n float32 -> bfloat16 (round to nearest even), zero-padded to `to` (even).
inline void round_row(const float* src, int n, int to, uint16_t* dst) {
    int t = 0;
    for (; t + 32 <= n; t += 32) {
        const __m512bh pair = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + t + 16), _mm512_loadu_ps(src + t));
        _mm512_storeu_si512(dst + t, reinterpret_cast<__m512i>(pair));
    }
    for (; t < n; ++t) dst[t] = f32_to_bf16(src[t]);
    for (; t < to; ++t) dst[t] = 0;
}

constexpr int MAX_G = 8;  // query heads per pass over a KV head's rows (accumulators held in registers)

struct DecodeScratch {
    std::vector<float> scores, out;
    std::vector<uint16_t> weights;
};

// One request and KV head, query heads g0 .. g0 + G (G <= MAX_G).
void attend_bf16(const Args& a, int r, int kv_head, int g0, int G, DecodeScratch& s) {
    const int D = a.D, P = D / 2, ctx = static_cast<int>(a.context_lens[r]);
    const int ctx_pad = (ctx + 31) / 32 * 32;
    const int64_t* blocks = a.block_tables + static_cast<int64_t>(r) * a.max_blocks;
    const auto* k_cache = static_cast<const uint16_t*>(a.k_cache);
    const auto* v_cache = static_cast<const uint16_t*>(a.v_cache);
    const auto* q = static_cast<const uint16_t*>(a.q) + (static_cast<int64_t>(r) * a.H + kv_head * (a.H / a.KVH) + g0) * D;
    auto row = [&](int t) { return ((blocks[t / a.block_size] * a.block_size + t % a.block_size) * a.KVH + kv_head) * D; };
    s.scores.resize(static_cast<size_t>(G) * ctx_pad);
    // Scores, 16 keys at a time: lane j holds key t0 + j's pair p, gathered from its cache row (keys past the
    // context are masked out of the gather: zero, never read).
    const int lines = (D * 2 + 63) / 64;  // cache lines per row
    for (int t0 = 0; t0 < ctx; t0 += 16) {
        alignas(64) int32_t index[16];
        const int n = std::min(16, ctx - t0);
        // The gathers' scattered rows train no hardware prefetcher: fetch the next 16 keys' K rows, and this 16's
        // V rows for the weighted sum below (a request's rows of one head fit in L2 at these context lengths).
        for (int j = 0; j < n; ++j) {
            const char* v = reinterpret_cast<const char*>(v_cache + row(t0 + j));
            const char* k = t0 + 16 + j < ctx ? reinterpret_cast<const char*>(k_cache + row(t0 + 16 + j)) : nullptr;
            for (int l = 0; l < lines; ++l) {
                _mm_prefetch(v + 64 * l, _MM_HINT_T0);
                if (k) _mm_prefetch(k + 64 * l, _MM_HINT_T0);
            }
        }
        for (int j = 0; j < 16; ++j) index[j] = j < n ? static_cast<int32_t>(row(t0 + j) / 2) : 0;
        const __m512i idx = _mm512_load_si512(index);
        const __mmask16 live = static_cast<__mmask16>((1u << n) - 1);
        __m512 acc[MAX_G];
        for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
        for (int p = 0; p < P; ++p) {
            const __m512i keys = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, idx,
                                                             reinterpret_cast<const int*>(k_cache) + p, 4);
            for (int g = 0; g < G; ++g)
                acc[g] = dp(acc[g], _mm512_set1_epi32(static_cast<int>(word(q + g * D + 2 * p))), keys);
        }
        for (int g = 0; g < G; ++g)
            _mm512_storeu_ps(s.scores.data() + static_cast<size_t>(g) * ctx_pad + t0,
                             _mm512_mul_ps(acc[g], _mm512_set1_ps(a.scale)));
    }
    float totals[MAX_G];
    s.weights.resize(static_cast<size_t>(G) * ctx_pad);
    for (int g = 0; g < G; ++g) {
        float* p = s.scores.data() + static_cast<size_t>(g) * ctx_pad;
        totals[g] = softmax_numerators(p, ctx, ctx);
        round_row(p, ctx, ctx_pad, s.weights.data() + static_cast<size_t>(g) * ctx_pad);
    }
    // The weighted sum, 32 columns at a time: two consecutive keys' rows interleaved into pairs (the 16-bit
    // unpacks work within 128-bit lanes, so the columns come out permuted: put right at the end).
    s.out.assign(static_cast<size_t>(G) * D, 0.0f);
    for (int c0 = 0; c0 < D; c0 += 32) {
        __m512 lo[MAX_G], hi[MAX_G];
        for (int g = 0; g < G; ++g) lo[g] = hi[g] = _mm512_setzero_ps();
        for (int t = 0; t < ctx; t += 2) {
            const __m512i first = _mm512_loadu_si512(v_cache + row(t) + c0);
            const __m512i second = t + 1 < ctx ? _mm512_loadu_si512(v_cache + row(t + 1) + c0) : _mm512_setzero_si512();
            const __m512i low = _mm512_unpacklo_epi16(first, second), high = _mm512_unpackhi_epi16(first, second);
            for (int g = 0; g < G; ++g) {
                const __m512i w = _mm512_set1_epi32(static_cast<int>(word(s.weights.data() + static_cast<size_t>(g) * ctx_pad + t)));
                lo[g] = dp(lo[g], w, low);
                hi[g] = dp(hi[g], w, high);
            }
        }
        for (int g = 0; g < G; ++g) {
            alignas(64) float l[16], h[16];
            _mm512_store_ps(l, lo[g]);
            _mm512_store_ps(h, hi[g]);
            float* out = s.out.data() + static_cast<size_t>(g) * D + c0;
            for (int k = 0; k < 16; ++k) {  // lane k of lo: column 8 (k / 4) + k % 4; of hi: 4 more
                out[8 * (k / 4) + k % 4] = l[k];
                out[8 * (k / 4) + 4 + k % 4] = h[k];
            }
        }
    }
    auto* dst = static_cast<uint16_t*>(a.out) + (static_cast<int64_t>(r) * a.H + kv_head * (a.H / a.KVH) + g0) * D;
    for (int g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d) dst[g * D + d] = f32_to_bf16(s.out[static_cast<size_t>(g) * D + d] / totals[g]);
}

}  // namespace

extern "C" int paged_decode_attention_bf16(const void* q, const void* k_cache, const void* v_cache,
                                           const int64_t* block_tables, const int64_t* context_lens, void* out,
                                           int io_dtype, int cache_dtype, int R, int H, int KVH, int D,
                                           int block_size, int max_blocks, int64_t num_blocks, float scale,
                                           int threads) {
    if (io_dtype != BF16 || cache_dtype != BF16 || D % 32 || num_blocks * block_size * KVH * D / 2 >= (1ll << 31))
        return 2;  // not this kernel's case (kernels/cpu.py chooses it only where it is)
    if (!decode_inputs_fit(block_tables, context_lens, R, block_size, max_blocks, num_blocks)) return 1;
    const Args a{q, k_cache, v_cache, block_tables, context_lens, out, io_dtype, cache_dtype, R, H, KVH, D,
                 block_size, max_blocks, scale};
    const int G = H / KVH, passes = (G + MAX_G - 1) / MAX_G;
#pragma omp parallel num_threads(threads)
    {
        DecodeScratch scratch;
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < R * KVH * passes; ++item) {
            const int pass = item % passes, pair = item / passes, g0 = pass * MAX_G;
            attend_bf16(a, pair / KVH, pair % KVH, g0, std::min(MAX_G, G - g0), scratch);
        }
    }
    return 0;
}

// Prefill for bfloat16 (AVX512_BF16): the context's K and V laid out once per call in pairs, K as [KVH][D / 2][keys]
// (a vector holds one (d, d + 1) pair of 16 consecutive keys), V as [KVH][keys / 2][D] (a vector holds 16 columns
// of two consecutive keys); work items of QT query tokens x one KV head's query heads, as the float32 kernel's.
namespace {

struct PrefillBf16 {
    const uint16_t* q; uint16_t* out;
    int Lq, ctx, H, KVH, D;
    float scale;
    const uint32_t* keys;  // [KVH][D / 2][ctx_pad] (zero past ctx)
    const uint32_t* values;  // [KVH][ctx_pad / 2][D] (zero past ctx)
    int ctx_pad;
};

struct PrefillBf16Scratch {
    std::vector<float> scores, acc, totals;
    std::vector<uint16_t> weights;
    std::vector<const uint16_t*> q_rows;
};

// Scores of four query rows against keys j0 .. j0 + 32.
inline void scores_bf16_4x32(const uint16_t* const* q, int P, const uint32_t* keys, int ctx_pad, int j0, float scale,
                             float* s, int ld) {
    __m512 acc[8];  // row r, keys 16 c .. 16 c + 16: acc[2 r + c]
    for (auto& a : acc) a = _mm512_setzero_ps();
    const uint32_t* k = keys + j0;
    for (int p = 0; p < P; ++p, k += ctx_pad) {
        const __m512i halves[2] = {_mm512_loadu_si512(k), _mm512_loadu_si512(k + 16)};
        for (int i = 0; i < 8; ++i)
            acc[i] = dp(acc[i], _mm512_set1_epi32(static_cast<int>(word(q[i / 2] + 2 * p))), halves[i % 2]);
    }
    for (int i = 0; i < 8; ++i)
        _mm512_storeu_ps(s + (i / 2) * ld + j0 + 16 * (i % 2), _mm512_mul_ps(acc[i], _mm512_set1_ps(scale)));
}

// acc[r][c0 .. c0 + 16 C) = sum over the first `pairs` key pairs of weight pair x value pair, four rows.
template <int C>
inline void weighted_bf16_4(const uint16_t* w, int ld, const uint32_t* values, int D, int pairs, int c0, float* acc) {
    __m512 sum[4 * C];  // row r, columns c0 + 16 c ..: sum[C r + c]
    for (auto& a : sum) a = _mm512_setzero_ps();
    const uint32_t* v = values + c0;
    for (int t2 = 0; t2 < pairs; ++t2, v += D) {
        __m512i columns[C];
        for (int c = 0; c < C; ++c) columns[c] = _mm512_loadu_si512(v + 16 * c);
        for (int i = 0; i < 4 * C; ++i)
            sum[i] = dp(sum[i], _mm512_set1_epi32(static_cast<int>(word(w + (i / C) * ld + 2 * t2))), columns[i % C]);
    }
    for (int i = 0; i < 4 * C; ++i) _mm512_storeu_ps(acc + (i / C) * D + c0 + 16 * (i % C), sum[i]);
}

void prefill_item_bf16(const PrefillBf16& a, int kv_head, int tile, PrefillBf16Scratch& s) {
    static const uint16_t zeros[512] = {};  // the padding rows' q (D <= 512)
    const int G = a.H / a.KVH, D = a.D, P = D / 2;
    const int first = tile * QT, tokens = std::min(QT, a.Lq - first);
    const int rows = tokens * G, padded_rows = (rows + 3) / 4 * 4;
    const int offset = a.ctx - a.Lq;
    const int keys = offset + first + tokens;
    const int span = (keys + 31) / 32 * 32;
    s.q_rows.resize(padded_rows);
    for (int r = 0; r < padded_rows; ++r)
        s.q_rows[r] = r < rows ? a.q + (static_cast<int64_t>(first + r / G) * a.H + kv_head * G + r % G) * D : zeros;
    s.scores.resize(static_cast<size_t>(padded_rows) * span);
    const uint32_t* k = a.keys + static_cast<int64_t>(kv_head) * P * a.ctx_pad;
    for (int r = 0; r < padded_rows; r += 4)
        for (int j0 = 0; j0 < span; j0 += 32)
            scores_bf16_4x32(s.q_rows.data() + r, P, k, a.ctx_pad, j0, a.scale,
                             s.scores.data() + static_cast<size_t>(r) * span, span);
    s.totals.assign(padded_rows, 1.0f);
    s.weights.resize(static_cast<size_t>(padded_rows) * span);
    for (int r = 0; r < padded_rows; ++r) {
        float* p = s.scores.data() + static_cast<size_t>(r) * span;
        uint16_t* w = s.weights.data() + static_cast<size_t>(r) * span;
        if (r < rows) {
            const int n = offset + first + r / G + 1;
            s.totals[r] = softmax_numerators(p, n, n);
            round_row(p, n, span, w);
        } else {
            memset(w, 0, sizeof(uint16_t) * span);
        }
    }
    s.acc.resize(static_cast<size_t>(padded_rows) * D);
    const uint32_t* v = a.values + static_cast<int64_t>(kv_head) * (a.ctx_pad / 2) * D;
    const int pairs = (keys + 1) / 2;
    for (int r = 0; r < padded_rows; r += 4) {
        const uint16_t* w = s.weights.data() + static_cast<size_t>(r) * span;
        float* acc = s.acc.data() + static_cast<size_t>(r) * D;
        int c0 = 0;
        for (; c0 + 64 <= D; c0 += 64) weighted_bf16_4<4>(w, span, v, D, pairs, c0, acc);
        if (c0 < D) weighted_bf16_4<2>(w, span, v, D, pairs, c0, acc);  // D is a multiple of 32
    }
    for (int r = 0; r < rows; ++r) {
        const float inverse = 1.0f / s.totals[r];
        uint16_t* dst = a.out + (static_cast<int64_t>(first + r / G) * a.H + kv_head * G + r % G) * D;
        for (int d = 0; d < D; ++d) dst[d] = f32_to_bf16(s.acc[static_cast<size_t>(r) * D + d] * inverse);
    }
}

}  // namespace

extern "C" int paged_prefill_attention_bf16(const void* q, const void* k_cache, const void* v_cache,
                                            const int64_t* blocks, void* out, int io_dtype, int cache_dtype, int Lq,
                                            int ctx, int H, int KVH, int D, int block_size, int64_t num_blocks,
                                            float scale, int threads) {
    if (io_dtype != BF16 || cache_dtype != BF16 || D % 32 || D > 512) return 2;  // not this kernel's case
    if (!prefill_inputs_fit(blocks, Lq, ctx, block_size, num_blocks)) return 1;
    const int P = D / 2, ctx_pad = (ctx + 31) / 32 * 32;
    std::vector<uint32_t> keys(static_cast<size_t>(KVH) * P * ctx_pad, 0u);
    std::vector<uint32_t> values(static_cast<size_t>(KVH) * (ctx_pad / 2) * D, 0u);
    const auto* kc = static_cast<const uint16_t*>(k_cache);
    const auto* vc = static_cast<const uint16_t*>(v_cache);
#pragma omp parallel for num_threads(threads) if (static_cast<int64_t>(ctx) * KVH * D >= 65536)
    for (int t = 0; t < ctx; ++t) {
        const int64_t row = (blocks[t / block_size] * block_size + t % block_size) * KVH;
        for (int h = 0; h < KVH; ++h) {
            const uint16_t* k = kc + (row + h) * D;
            const uint16_t* v = vc + (row + h) * D;
            uint32_t* kp = keys.data() + static_cast<size_t>(h) * P * ctx_pad + t;
            for (int p = 0; p < P; ++p) kp[static_cast<size_t>(p) * ctx_pad] = word(k + 2 * p);
            // key t's values are the low (t even) or high (t odd) halves of its pair's elements
            auto* vp = reinterpret_cast<uint16_t*>(values.data() + (static_cast<size_t>(h) * (ctx_pad / 2) + t / 2) * D);
            for (int d = 0; d < D; ++d) vp[2 * d + (t & 1)] = v[d];
        }
    }
    const PrefillBf16 a{static_cast<const uint16_t*>(q), static_cast<uint16_t*>(out), Lq, ctx, H, KVH, D, scale,
                        keys.data(), values.data(), ctx_pad};
    const int tiles = (Lq + QT - 1) / QT, items = tiles * KVH;
#pragma omp parallel num_threads(threads)
    {
        PrefillBf16Scratch scratch;
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < items; ++item) prefill_item_bf16(a, item % KVH, tiles - 1 - item / KVH, scratch);
    }
    return 0;
}
#endif  // __AVX512BF16__
