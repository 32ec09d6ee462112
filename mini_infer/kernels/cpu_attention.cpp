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
        for (; d + 64 <= D; d += 64) weighted_sum<8>(s.value_rows.data(), p, ctx, acc + d);
        if (d < D) {  // the last columns: shifted row pointers, 8 at a time, then one by one
            s.shifted.resize(ctx);
            for (int t = 0; t < ctx; ++t) s.shifted[t] = s.value_rows[t] + d;
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
    for (int r = 0; r < R; ++r)
        if (context_lens[r] < 1 || context_lens[r] > static_cast<int64_t>(max_blocks) * block_size) return 1;
    for (int64_t i = 0; i < static_cast<int64_t>(R) * max_blocks; ++i)
        if (block_tables[i] < 0 || block_tables[i] >= num_blocks) return 1;
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
    if (Lq < 1 || Lq > ctx) return 1;
    for (int b = 0; b < (ctx + block_size - 1) / block_size; ++b)
        if (blocks[b] < 0 || blocks[b] >= num_blocks) return 1;
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
