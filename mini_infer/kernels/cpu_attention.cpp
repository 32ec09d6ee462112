// Decode attention over a paged KV cache: one query token per request, read through its block table.
//
// q [R, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D]; block_tables [R, max_blocks] (int64);
// context_lens [R] (int64); out [R, H, D]. q, the caches and out are each float32 or bfloat16; arithmetic is
// float32. One work item is a (request, KV head) pair with its G = H / KVH query heads, so each K and V row is
// read once for the whole group. Two passes: scores and softmax, then the weighted sum of V.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "bf16.h"

namespace {

enum DType : int { F32 = 0, BF16 = 1 };

inline float load(const void* data, int dtype, int64_t i) {
    return dtype == BF16 ? bf16_to_f32(static_cast<const uint16_t*>(data)[i]) : static_cast<const float*>(data)[i];
}

// Row of D values as float32 into dst.
inline void load_row(const void* data, int dtype, int64_t offset, int D, float* dst) {
    if (dtype == F32) {
        memcpy(dst, static_cast<const float*>(data) + offset, sizeof(float) * D);
        return;
    }
    const uint16_t* src = static_cast<const uint16_t*>(data) + offset;
    int d = 0;
    for (; d + 8 <= D; d += 8) {
        __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d)));
        _mm256_storeu_ps(dst + d, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
    }
    for (; d < D; ++d) dst[d] = bf16_to_f32(src[d]);
}

inline float dot(const float* a, const float* b, int D) {
    __m256 acc = _mm256_setzero_ps();
    int d = 0;
    for (; d + 8 <= D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    float total = _mm_cvtss_f32(s);
    for (; d < D; ++d) total += a[d] * b[d];
    return total;
}

inline void axpy(float alpha, const float* x, float* y, int D) {  // y += alpha * x
    const __m256 a = _mm256_set1_ps(alpha);
    int d = 0;
    for (; d + 8 <= D; d += 8) _mm256_storeu_ps(y + d, _mm256_fmadd_ps(a, _mm256_loadu_ps(x + d), _mm256_loadu_ps(y + d)));
    for (; d < D; ++d) y[d] += alpha * x[d];
}

struct Args {
    const void* q; const void* k_cache; const void* v_cache; const int64_t* block_tables;
    const int64_t* context_lens; void* out;
    int io_dtype, cache_dtype, R, H, KVH, D, block_size, max_blocks;
    float scale;
};

void attend(const Args& a, int r, int kv_head) {
    const int G = a.H / a.KVH, D = a.D, ctx = static_cast<int>(a.context_lens[r]);
    std::vector<float> q(static_cast<size_t>(G) * D), row(D), scores(static_cast<size_t>(G) * ctx), acc(q.size(), 0.0f);
    for (int g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d) q[g * D + d] = load(a.q, a.io_dtype, (static_cast<int64_t>(r) * a.H + kv_head * G + g) * D + d) * a.scale;
    const int64_t* blocks = a.block_tables + static_cast<int64_t>(r) * a.max_blocks;
    auto slot_offset = [&](int t) {
        return ((blocks[t / a.block_size] * a.block_size + t % a.block_size) * a.KVH + kv_head) * static_cast<int64_t>(D);
    };
    for (int t = 0; t < ctx; ++t) {
        load_row(a.k_cache, a.cache_dtype, slot_offset(t), D, row.data());
        for (int g = 0; g < G; ++g) scores[static_cast<size_t>(g) * ctx + t] = dot(q.data() + g * D, row.data(), D);
    }
    for (int g = 0; g < G; ++g) {
        float* s = scores.data() + static_cast<size_t>(g) * ctx;
        float peak = s[0];
        for (int t = 1; t < ctx; ++t) peak = s[t] > peak ? s[t] : peak;
        float total = 0.0f;
        for (int t = 0; t < ctx; ++t) total += (s[t] = expf(s[t] - peak));
        for (int t = 0; t < ctx; ++t) s[t] /= total;
    }
    for (int t = 0; t < ctx; ++t) {
        load_row(a.v_cache, a.cache_dtype, slot_offset(t), D, row.data());
        for (int g = 0; g < G; ++g) axpy(scores[static_cast<size_t>(g) * ctx + t], row.data(), acc.data() + g * D, D);
    }
    for (int g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d) {
            const int64_t i = (static_cast<int64_t>(r) * a.H + kv_head * G + g) * D + d;
            if (a.io_dtype == BF16) static_cast<uint16_t*>(a.out)[i] = f32_to_bf16(acc[g * D + d]);
            else static_cast<float*>(a.out)[i] = acc[g * D + d];
        }
}

}  // namespace

extern "C" void paged_decode_attention(const void* q, const void* k_cache, const void* v_cache,
                                       const int64_t* block_tables, const int64_t* context_lens, void* out,
                                       int io_dtype, int cache_dtype, int R, int H, int KVH, int D, int block_size,
                                       int max_blocks, float scale, int threads) {
    const Args a{q, k_cache, v_cache, block_tables, context_lens, out, io_dtype, cache_dtype, R, H, KVH, D,
                 block_size, max_blocks, scale};
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int item = 0; item < R * KVH; ++item) attend(a, item / KVH, item % KVH);
}
