// Decode attention over a paged KV cache: one query token per request, read through its block table.
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
    for (int g = 0; g < G; ++g) {  // softmax numerators; each head's sum divides its output at the end
        float* p = s.scores.data() + static_cast<size_t>(g) * ctx;
        __m256 peaks = _mm256_set1_ps(p[0]);
        int t = 0;
        for (; t + 8 <= ctx; t += 8) peaks = _mm256_max_ps(peaks, _mm256_loadu_ps(p + t));
        float lanes[8];
        _mm256_storeu_ps(lanes, peaks);
        float peak = lanes[0];
        for (int l = 1; l < 8; ++l) peak = lanes[l] > peak ? lanes[l] : peak;
        for (; t < ctx; ++t) peak = p[t] > peak ? p[t] : peak;
        const __m256 peak8 = _mm256_set1_ps(peak);
        __m256 sum8 = _mm256_setzero_ps();
        for (t = 0; t + 8 <= ctx; t += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + t), peak8));
            _mm256_storeu_ps(p + t, e);
            sum8 = _mm256_add_ps(sum8, e);
        }
        float total = hsum(sum8);
        if (t < ctx) {  // the tail through a padded vector: the same exp
            float tail[8] = {};
            for (int i = t; i < ctx; ++i) tail[i - t] = p[i] - peak;
            _mm256_storeu_ps(tail, exp8(_mm256_loadu_ps(tail)));
            for (int i = t; i < ctx; ++i) total += (p[i] = tail[i - t]);
        }
        s.totals[g] = total;
    }
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
