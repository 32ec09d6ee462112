// The elementwise steps of a decoder layer fused into one pass each: residual add + RMSNorm, SiLU(gate) * up,
// RoPE on q and k with the K/V cache write, and a mixture of experts' weighted sum of its experts' outputs.
//
// Tensors are float32 or bfloat16 (dtype code 0 or 1), all of one call in one dtype. Each kernel rounds where
// torch's ops on that dtype round (after every op), so that the model gives the same numbers with these kernels
// as with torch's; the library is built with -ffp-contract=off so that no a * b + c becomes one rounding.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include <algorithm>
#include <vector>

#include "bf16.h"
#include "exp8.h"

namespace {

enum DType : int { F32 = 0, BF16 = 1 };
// Elements from which a call splits its work over the threads (~5 us of a norm or SiLU on one core: measured on a
// Zen 4 EPYC, one thread's SiLU of 8 x 4864 took 53 us), and the piece of a row's columns one thread takes in the
// column-split kernels (SiLU, the experts' weighted sum; a multiple of 8).
constexpr int64_t kParallelElements = 4096;
constexpr int kColumnPiece = 1024;

inline float load(const void* data, int dtype, int64_t i) {
    return dtype == BF16 ? bf16_to_f32(static_cast<const uint16_t*>(data)[i]) : static_cast<const float*>(data)[i];
}

inline void store(void* data, int dtype, int64_t i, float v) {
    if (dtype == BF16) static_cast<uint16_t*>(data)[i] = f32_to_bf16(v);
    else static_cast<float*>(data)[i] = v;
}

inline float round_to(int dtype, float v) { return dtype == BF16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

// Eight values at a time, rounded as the scalar versions above round.
inline __m256 load8(const void* data, int dtype, int64_t i) {
    if (dtype == F32) return _mm256_loadu_ps(static_cast<const float*>(data) + i);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(data) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline __m256i bf16_bits8(__m256 v) {  // the bfloat16 nearest v (ties to even) in the high halves; NaN stays NaN
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
    const __m256i quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x400000));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_and_si256(_mm256_blendv_epi8(rounded, quiet, nan), _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
}

inline __m256 round8(int dtype, __m256 v) { return dtype == BF16 ? _mm256_castsi256_ps(bf16_bits8(v)) : v; }

inline void store8(void* data, int dtype, int64_t i, __m256 v) {
    if (dtype == F32) {
        _mm256_storeu_ps(static_cast<float*>(data) + i, v);
        return;
    }
    const __m256i halves = _mm256_srli_epi32(bf16_bits8(v), 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(halves, halves), 0b1000);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(data) + i), _mm256_castsi256_si128(packed));
}

int ceil_log2(int64_t x) {
    int bits = 1;
    while ((int64_t{1} << bits) < x) ++bits;
    return bits;
}

// sum(x[i]^2) in the order torch's CPU sum takes over a contiguous row (aten/src/ATen/native/cpu/SumKernel.cpp):
// lanes of `width` floats (its vector width: 16 under AVX-512, 8 under AVX2), four interleaved vector accumulators
// summed in cascaded chunks of 16, the leftover vectors into the first accumulator, then the scalar tail and
// the lanes. Another order would move the mean by an ulp now and then, and a normalised value across a bfloat16
// rounding boundary with it.
constexpr int kIlp = 4, kLevels = 4;

template <int width>  // a constant, so that each lane loop below compiles to one vector operation
float sum_of_squares(const float* x, int64_t n) {
    const int64_t vectors = n / width, groups = vectors / kIlp;
    float acc[kLevels][kIlp][width] = {};
    auto add_vector = [&](float* into, int64_t v) {
        for (int l = 0; l < width; ++l) into[l] += x[v * width + l] * x[v * width + l];
    };
    const int level_power = std::max(4, ceil_log2(groups) / kLevels);
    const int64_t level_step = int64_t{1} << level_power, level_mask = level_step - 1;
    int64_t i = 0;
    while (i + level_step <= groups) {
        for (int64_t j = 0; j < level_step; ++j, ++i)
            for (int k = 0; k < kIlp; ++k) add_vector(acc[0][k], i * kIlp + k);
        for (int level = 1; level < kLevels; ++level) {
            for (int k = 0; k < kIlp; ++k)
                for (int l = 0; l < width; ++l) {
                    acc[level][k][l] += acc[level - 1][k][l];
                    acc[level - 1][k][l] = 0.0f;
                }
            if ((i & (level_mask << (level * level_power))) != 0) break;
        }
    }
    for (; i < groups; ++i)
        for (int k = 0; k < kIlp; ++k) add_vector(acc[0][k], i * kIlp + k);
    for (int level = 1; level < kLevels; ++level)
        for (int k = 0; k < kIlp; ++k)
            for (int l = 0; l < width; ++l) acc[0][k][l] += acc[level][k][l];
    for (int64_t v = groups * kIlp; v < vectors; ++v) add_vector(acc[0][0], v);
    for (int k = 1; k < kIlp; ++k)
        for (int l = 0; l < width; ++l) acc[0][0][l] += acc[0][k][l];
    float total = 0.0f;
    for (int64_t e = vectors * width; e < n; ++e) total += x[e] * x[e];
    for (int l = 0; l < width; ++l) total += acc[0][0][l];
    return total;
}

float sum_of_squares(const float* x, int64_t n, int width) {
    return width == 16 ? sum_of_squares<16>(x, n) : sum_of_squares<8>(x, n);
}

// One row of RMSNorm.forward: float32 normalisation, rounded to the dtype, then the weight multiply in the dtype.
// `row` holds the input as float32 (already rounded to the dtype).
void normalise_row(const float* row, int64_t H, const void* weight, void* out, int dtype, float eps, int width) {
    const float inv = 1.0f / sqrtf(sum_of_squares(row, H, width) / static_cast<float>(H) + eps);
    const __m256 inv8 = _mm256_set1_ps(inv);
    int64_t h = 0;
    for (; h + 8 <= H; h += 8)
        store8(out, dtype, h, _mm256_mul_ps(load8(weight, dtype, h), round8(dtype, _mm256_mul_ps(_mm256_loadu_ps(row + h), inv8))));
    for (; h < H; ++h) store(out, dtype, h, load(weight, dtype, h) * round_to(dtype, row[h] * inv));
}

inline __m256 silu8(__m256 g) {  // torch's formula: x / (1 + exp(-x))
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

// Rounds each product and the sum to the dtype, as torch's `q * cos + rotate_half(q) * sin` does.
inline float rotate(int dtype, float x, float x_partner_signed, float c, float s) {
    return round_to(dtype, round_to(dtype, x * c) + round_to(dtype, x_partner_signed * s));
}

inline __m256 rotate8(int dtype, __m256 x, __m256 x_partner_signed, __m256 c, __m256 s) {
    return round8(dtype, _mm256_add_ps(round8(dtype, _mm256_mul_ps(x, c)), round8(dtype, _mm256_mul_ps(x_partner_signed, s))));
}

}  // namespace

// x [T, H] -> out [T, H]; with a residual [T, H], residual_out <- x + residual first and out is its norm.
extern "C" void add_rms_norm(const void* x, const void* residual, const void* weight, void* out, void* residual_out,
                             int dtype, int T, int H, float eps, int width, int threads) {
    const size_t elem = dtype == BF16 ? 2 : 4;
#pragma omp parallel for num_threads(threads) if (T > 1 && static_cast<int64_t>(T) * H >= kParallelElements)
    for (int t = 0; t < T; ++t) {
        std::vector<float> buffer(H);
        float* row = buffer.data();
        const int64_t base = static_cast<int64_t>(t) * H;
        int64_t h = 0;
        for (; h + 8 <= H; h += 8) {
            __m256 v = load8(x, dtype, base + h);
            if (residual != nullptr) {
                v = round8(dtype, _mm256_add_ps(v, load8(residual, dtype, base + h)));
                store8(residual_out, dtype, base + h, v);
            }
            _mm256_storeu_ps(row + h, v);
        }
        for (; h < H; ++h) {
            float v = load(x, dtype, base + h);
            if (residual != nullptr) {
                v = round_to(dtype, v + load(residual, dtype, base + h));
                store(residual_out, dtype, base + h, v);
            }
            row[h] = v;
        }
        normalise_row(row, H, weight, static_cast<char*>(out) + base * elem, dtype, eps, width);
    }
}

// Qwen3's q/k norms in place: in each of the T rows of qkv [T, (H + 2 KVH) D], RMSNorm with q_weight over each of
// the H query heads and with k_weight over each of the KVH key heads (D values each), as add_rms_norm computes
// them on those heads as rows.
extern "C" void rms_norm_heads(void* qkv, const void* q_weight, const void* k_weight, int dtype, int T, int H,
                               int KVH, int D, float eps, int width, int threads) {
    const size_t elem = dtype == BF16 ? 2 : 4;
    const int heads = H + KVH;
#pragma omp parallel for num_threads(threads) if (static_cast<int64_t>(T) * heads * D >= kParallelElements)
    for (int64_t item = 0; item < static_cast<int64_t>(T) * heads; ++item) {
        const int t = static_cast<int>(item / heads), head = static_cast<int>(item % heads);
        const int64_t base = (static_cast<int64_t>(t) * (H + 2 * KVH) + head) * D;
        std::vector<float> row(D);
        for (int d = 0; d < D; ++d) row[d] = load(qkv, dtype, base + d);
        normalise_row(row.data(), D, head < H ? q_weight : k_weight, static_cast<char*>(qkv) + base * elem, dtype, eps,
                      width);
    }
}

// gate_up [T, 2I] (gate, then up) -> out [T, I] = silu(gate) * up, each rounded to the dtype. The threads split
// rows into pieces of kColumnPiece columns, so that one decode row of a 0.5B model (I = 4864) takes both cores.
extern "C" void silu_mul(const void* gate_up, void* out, int dtype, int T, int I, int threads) {
    const int pieces = (I + kColumnPiece - 1) / kColumnPiece;
#pragma omp parallel for num_threads(threads) if (static_cast<int64_t>(T) * I >= kParallelElements)
    for (int64_t piece = 0; piece < static_cast<int64_t>(T) * pieces; ++piece) {
        const int t = static_cast<int>(piece / pieces), begin = static_cast<int>(piece % pieces) * kColumnPiece;
        const int end = std::min(I, begin + kColumnPiece);
        const int64_t in = static_cast<int64_t>(t) * 2 * I, o = static_cast<int64_t>(t) * I;
        int i = begin;
        for (; i + 8 <= end; i += 8) {
            const __m256 g = load8(gate_up, dtype, in + i);
            store8(out, dtype, o + i, _mm256_mul_ps(round8(dtype, silu8(g)), load8(gate_up, dtype, in + I + i)));
        }
        if (i < end) {  // the row's tail through a padded vector, so that it takes the same exp
            float gate[8] = {}, silu[8];
            for (int j = i; j < end; ++j) gate[j - i] = load(gate_up, dtype, in + j);
            _mm256_storeu_ps(silu, silu8(_mm256_loadu_ps(gate)));
            for (int j = i; j < end; ++j) store(out, dtype, o + j, round_to(dtype, silu[j - i]) * load(gate_up, dtype, in + I + j));
        }
    }
}

// A mixture of experts' outputs summed per token: y [P, H] holds the (token, expert) pairs' rows in the order the
// experts ran them, pair p being entry order[p] of the [T, k] routing, so token order[p] / k with weight
// weights[order[p]]. out [T, H] = the sum over each token's pairs, p = 0 .. P - 1 in turn, of y[p] * weight, each
// product rounded to the dtype and the sums kept in float32, rounded once: what torch's
// `zeros.index_add_(0, tokens, y * weights[order, None])` computes (its bfloat16 index_add_ accumulates in float32,
// adding a row's sources in index order). The threads split the columns. Returns 0, or 1 (nothing written) where an
// order entry is outside [0, T k).
extern "C" int moe_combine(const void* y, const void* weights, const int64_t* order, void* out, int dtype, int P,
                           int T, int H, int k, int threads) {
    for (int p = 0; p < P; ++p)
        if (order[p] < 0 || order[p] >= static_cast<int64_t>(T) * k) return 1;
    std::vector<float> sums(static_cast<size_t>(T) * H, 0.0f);
    const int pieces = (H + kColumnPiece - 1) / kColumnPiece;
#pragma omp parallel for num_threads(threads) if (static_cast<int64_t>(P) * H >= kParallelElements)
    for (int piece = 0; piece < pieces; ++piece) {
        const int begin = piece * kColumnPiece, end = std::min(H, begin + kColumnPiece);
        for (int p = 0; p < P; ++p) {
            float* row = sums.data() + static_cast<int64_t>(order[p] / k) * H;
            const int64_t src = static_cast<int64_t>(p) * H;
            const float weight = load(weights, dtype, order[p]);
            const __m256 w8 = _mm256_set1_ps(weight);
            int i = begin;
            for (; i + 8 <= end; i += 8)
                _mm256_storeu_ps(row + i, _mm256_add_ps(_mm256_loadu_ps(row + i),
                                                        round8(dtype, _mm256_mul_ps(load8(y, dtype, src + i), w8))));
            for (; i < end; ++i) row[i] += round_to(dtype, load(y, dtype, src + i) * weight);
        }
        for (int t = 0; t < T; ++t)
            for (int i = begin; i < end; ++i)
                store(out, dtype, static_cast<int64_t>(t) * H + i, sums[static_cast<int64_t>(t) * H + i]);
    }
    return 0;
}

// A mixture's routing of T tokens: scores [T, E] (the router's output) -> each token's k experts of the highest
// probability (the softmax in float32; of equal scores the lower index first), in falling order, with their weights
// (the probabilities, over their sum where `norm`) rounded to the dtype: weights [T k], entry t k + j the token's
// j-th. The (token, expert) pairs grouped by expert: order [T k] lists the pair indices t k + j expert by expert,
// in token order within each, rows [T k] the token of each, counts [E] each expert's pairs. What
// `softmax(float32).topk(k)` (renormalised), `.to(dtype)` and a stable sort of the chosen experts give, up to the
// rounding of exp. Returns 0, or 1 (order, rows and counts unwritten) where a score is NaN.
extern "C" int moe_route(const void* scores, int dtype, int T, int E, int k, int norm, void* weights, int64_t* order,
                         int64_t* rows, int64_t* counts, int threads) {
    std::vector<int32_t> experts(static_cast<size_t>(T) * k);
    int failed = 0;
#pragma omp parallel for num_threads(threads) if (static_cast<int64_t>(T) * E >= kParallelElements) \
    reduction(| : failed)
    for (int t = 0; t < T; ++t) {
        const int64_t row = static_cast<int64_t>(t) * E;
        float top = -INFINITY;
        for (int e = 0; e < E; ++e) {
            const float v = load(scores, dtype, row + e);
            failed |= v != v;
            top = std::max(top, v);
        }
        float sum = 0.0f;
        for (int e = 0; e < E; ++e) sum += expf(load(scores, dtype, row + e) - top);
        int32_t* chosen = experts.data() + static_cast<int64_t>(t) * k;
        std::vector<float> kept(k);
        int n = 0;
        for (int e = 0; e < E; ++e) {  // insertion into the k best so far, falling; an equal score stays behind
            const float v = load(scores, dtype, row + e);
            if (n == k && !(v > kept[k - 1])) continue;
            int at = n < k ? n++ : k - 1;
            for (; at > 0 && v > kept[at - 1]; --at) {
                kept[at] = kept[at - 1];
                chosen[at] = chosen[at - 1];
            }
            kept[at] = v;
            chosen[at] = e;
        }
        float total = 0.0f;
        for (int j = 0; j < k; ++j) {
            kept[j] = expf(kept[j] - top) / sum;
            total += kept[j];
        }
        for (int j = 0; j < k; ++j)
            store(weights, dtype, static_cast<int64_t>(t) * k + j, norm ? kept[j] / total : kept[j]);
    }
    if (failed) return 1;
    std::vector<int64_t> next(E + 1, 0);
    for (int32_t e : experts) ++next[e + 1];
    for (int e = 0; e < E; ++e) {
        counts[e] = next[e + 1];
        next[e + 1] += next[e];
    }
    for (int64_t p = 0; p < static_cast<int64_t>(T) * k; ++p) {
        const int64_t at = next[experts[p]]++;
        order[at] = p;
        rows[at] = p / k;
    }
    return 0;
}

// qkv [T, (H + 2 KVH) D] -> q_out [T, H, D] with RoPE (rotate-half) at positions[t]; k (rotated) and v land in
// k_cache / v_cache [num_blocks, block_size, KVH, D] at slot_mapping[t]. cos, sin: [max_positions, D].
// Returns 0, or 1 without writing anything where a slot is outside [0, num_slots) or a position outside
// [0, max_positions): checked here, on the way in, rather than by tensor ops in every layer's call.
extern "C" int rope_kv_write(const void* qkv, const int64_t* positions, const void* cos, const void* sin,
                             void* q_out, void* k_cache, void* v_cache, const int64_t* slot_mapping,
                             int dtype, int T, int H, int KVH, int D, int64_t num_slots, int64_t max_positions,
                             int threads) {
    for (int t = 0; t < T; ++t)
        if (slot_mapping[t] < 0 || slot_mapping[t] >= num_slots || positions[t] < 0 || positions[t] >= max_positions)
            return 1;
    const int half = D / 2;
    const int64_t row = static_cast<int64_t>(H + 2 * KVH) * D;
#pragma omp parallel for num_threads(threads) if (T >= 16)
    for (int t = 0; t < T; ++t) {
        const int64_t table = positions[t] * D, in = t * row;
        const int64_t cache = slot_mapping[t] * KVH * D;
        for (int head = 0; head < H + KVH; ++head) {
            const int64_t src = in + static_cast<int64_t>(head) * D;
            void* dst = head < H ? q_out : k_cache;
            const int64_t at = head < H ? (static_cast<int64_t>(t) * H + head) * D : cache + (head - H) * D;
            int d = 0;
            for (; d + 8 <= half; d += 8) {
                const __m256 first = load8(qkv, dtype, src + d), second = load8(qkv, dtype, src + d + half);
                const __m256 negated = _mm256_sub_ps(_mm256_setzero_ps(), second);
                store8(dst, dtype, at + d, rotate8(dtype, first, negated, load8(cos, dtype, table + d),
                                                   load8(sin, dtype, table + d)));
                store8(dst, dtype, at + d + half, rotate8(dtype, second, first, load8(cos, dtype, table + d + half),
                                                          load8(sin, dtype, table + d + half)));
            }
            for (; d < half; ++d) {
                const float first = load(qkv, dtype, src + d), second = load(qkv, dtype, src + d + half);
                store(dst, dtype, at + d, rotate(dtype, first, -second, load(cos, dtype, table + d),
                                                 load(sin, dtype, table + d)));
                store(dst, dtype, at + d + half, rotate(dtype, second, first, load(cos, dtype, table + d + half),
                                                        load(sin, dtype, table + d + half)));
            }
        }
        const int64_t v = in + static_cast<int64_t>(H + KVH) * D;
        for (int64_t d = 0; d < static_cast<int64_t>(KVH) * D; ++d) store(v_cache, dtype, cache + d, load(qkv, dtype, v + d));
    }
    return 0;
}

// x [R, C] with rows `stride` elements apart -> out[r] = the index of row r's largest value, the first of equals,
// or of its first NaN where it has one: torch.argmax's answer. Two passes over a row: its maximum (NaN aside,
// noted), then the first index holding it.
extern "C" void argmax_rows(const void* x, int dtype, int R, int C, int64_t stride, int64_t* out, int threads) {
#pragma omp parallel for num_threads(threads) if (R > 1 && static_cast<int64_t>(R) * C >= 65536)
    for (int r = 0; r < R; ++r) {
        const int64_t base = static_cast<int64_t>(r) * stride;
        __m256 peak[4], unordered = _mm256_setzero_ps();
        for (auto& p : peak) p = _mm256_set1_ps(-INFINITY);
        int c = 0;
        for (; c + 32 <= C; c += 32)
            for (int j = 0; j < 4; ++j) {
                const __m256 v = load8(x, dtype, base + c + 8 * j);
                peak[j] = _mm256_max_ps(v, peak[j]);  // a NaN in v keeps peak[j]
                unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            }
        float lanes[8];
        _mm256_storeu_ps(lanes, _mm256_max_ps(_mm256_max_ps(peak[0], peak[1]), _mm256_max_ps(peak[2], peak[3])));
        float best = lanes[0];
        for (int l = 1; l < 8; ++l) best = lanes[l] > best ? lanes[l] : best;
        bool nan = _mm256_movemask_ps(unordered) != 0;
        for (; c < C; ++c) {
            const float v = load(x, dtype, base + c);
            nan |= v != v;
            best = v > best ? v : best;
        }
        int64_t found = 0;
        for (int64_t i = 0; i < C; ++i) {
            const float v = load(x, dtype, base + i);
            if (nan ? v != v : v == best) {
                found = i;
                break;
            }
        }
        out[r] = found;
    }
}

namespace {

struct Entry {
    float value;
    int64_t id;
};

// The order of candidates: a NaN above every number (as torch.argmax and torch.topk take it), then by value.
inline bool greater(float a, float b) { return (a != a && b == b) || a > b; }

// Heap order: the root is the worst kept entry, the lowest value and, among equals, the highest index.
inline bool heap_before(const Entry& a, const Entry& b) {
    return greater(a.value, b.value) || (!greater(b.value, a.value) && a.id < b.id);
}

// A row's best k entries, offered in index order (so a later entry beats an equal earlier one never).
class TopK {
  public:
    explicit TopK(int k) : k_(k) { heap_.reserve(k); }

    void offer(float value, int64_t id) {
        if (static_cast<int>(heap_.size()) < k_) {
            heap_.push_back({value, id});
            if (static_cast<int>(heap_.size()) == k_) std::make_heap(heap_.begin(), heap_.end(), heap_before);
        } else if (greater(value, bar())) {
            std::pop_heap(heap_.begin(), heap_.end(), heap_before);
            heap_.back() = {value, id};
            std::push_heap(heap_.begin(), heap_.end(), heap_before);
        }
    }

    bool full() const { return static_cast<int>(heap_.size()) == k_; }
    float bar() const { return heap_.front().value; }  // what an entry must beat once full

    // Offers x[from, to) (the row's raw values), eight at a time against the bar once the heap is full.
    void scan(const void* x, int dtype, int64_t base, int64_t from, int64_t to) {
        int64_t c = from;
        for (; c < to && !full(); ++c) offer(load(x, dtype, base + c), c);
        for (; c + 8 <= to; c += 8) {
            const __m256 v = load8(x, dtype, base + c);
            const __m256 least = _mm256_set1_ps(bar());
            const int hits = _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(v, least, _CMP_GT_OQ),
                                                             _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
            if (hits == 0) continue;
            for (int l = 0; l < 8; ++l)
                if (hits >> l & 1) offer(load(x, dtype, base + c + l), c + l);
        }
        for (; c < to; ++c) offer(load(x, dtype, base + c), c);
    }

    // The kept entries, best first, into k_out slots (the rest: -inf with the best entry's id).
    void write(float* values, int64_t* ids, int k_out) {
        std::sort(heap_.begin(), heap_.end(), heap_before);
        for (int i = 0; i < k_out; ++i) {
            const bool kept = i < static_cast<int>(heap_.size());
            values[i] = kept ? heap_[i].value : -INFINITY;
            ids[i] = kept ? heap_[i].id : heap_[0].id;
        }
    }

  private:
    int k_;
    std::vector<Entry> heap_;
};

}  // namespace

// x [R, C] with rows `stride` elements apart, where row r's entries at edit_ids[r, :W] read edit_values[r, :W]
// instead (an id past the row is padding; of one id listed twice, the lower value) -> the ks[r] largest entries of
// each row, best first (NaN above numbers; of equal values the lower index), as values (float32) and ids in
// out_*[r, :kmax]; a row keeping fewer than kmax pads with -inf and its best id. Returns 1, before writing, if a k
// is outside [1, min(C, kmax)] or an edit id is negative.
extern "C" int top_k_rows(const void* x, int dtype, int R, int C, int64_t stride, const int64_t* ks, int kmax,
                          const int64_t* edit_ids, const float* edit_values, int W, float* out_values,
                          int64_t* out_ids, int threads) {
    for (int r = 0; r < R; ++r)
        if (ks[r] < 1 || ks[r] > std::min(C, kmax)) return 1;
    for (int64_t i = 0; i < static_cast<int64_t>(R) * W; ++i)
        if (edit_ids[i] < 0) return 1;
#pragma omp parallel for num_threads(threads) if (R > 1 && static_cast<int64_t>(R) * C >= 65536)
    for (int r = 0; r < R; ++r) {
        std::vector<Entry> edits;
        for (int w = 0; w < W; ++w) {
            const int64_t id = edit_ids[static_cast<int64_t>(r) * W + w];
            if (id < C) edits.push_back({edit_values[static_cast<int64_t>(r) * W + w], id});
        }
        std::sort(edits.begin(), edits.end(), [](const Entry& a, const Entry& b) {
            return a.id < b.id || (a.id == b.id && a.value < b.value);
        });
        const int64_t base = static_cast<int64_t>(r) * stride;
        TopK top(static_cast<int>(ks[r]));
        int64_t from = 0;
        for (size_t e = 0; e < edits.size(); ++e) {
            if (e > 0 && edits[e].id == edits[e - 1].id) continue;  // the lower value came first
            top.scan(x, dtype, base, from, edits[e].id);
            top.offer(edits[e].value, edits[e].id);
            from = edits[e].id + 1;
        }
        top.scan(x, dtype, base, from, C);
        top.write(out_values + static_cast<int64_t>(r) * kmax, out_ids + static_cast<int64_t>(r) * kmax, kmax);
    }
    return 0;
}

// Structured outputs: x float32 [R, C], rows `stride` apart; for each of the n rows rows[i], the tokens whose bit is
// clear in bitmask row rows[i] (int32 words, `words` a row; bit j of word w is token 32 w + j) become -inf. A word of
// all ones (32 tokens allowed) is skipped; the others set 8 lanes at a time from a byte of the word.
extern "C" void mask_rows(float* x, int64_t stride, int C, const int64_t* rows, int n, const int32_t* bitmask,
                          int words, int threads) {
    const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256 forbidden = _mm256_set1_ps(-INFINITY);
#pragma omp parallel for num_threads(threads) if (n > 1)
    for (int i = 0; i < n; ++i) {
        float* row = x + rows[i] * stride;
        const uint32_t* mask = reinterpret_cast<const uint32_t*>(bitmask + rows[i] * words);
        const int full = C / 32;
        for (int w = 0; w < full; ++w) {
            const uint32_t m = mask[w];
            if (m == 0xFFFFFFFFu) continue;
            for (int j = 0; j < 4; ++j) {
                const __m256i byte = _mm256_set1_epi32(static_cast<int>((m >> (8 * j)) & 0xFF));
                const __m256 keep = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(byte, bits), bits));
                float* p = row + 32 * w + 8 * j;
                _mm256_storeu_ps(p, _mm256_blendv_ps(forbidden, _mm256_loadu_ps(p), keep));
            }
        }
        for (int c = 32 * full; c < C; ++c)
            if (!((mask[c / 32] >> (c % 32)) & 1u)) row[c] = -INFINITY;
    }
}
