// A decode step's decoder layers in one call: for every layer, residual add + RMSNorm, the QKV matmul with its
// bias (and Qwen3's RMSNorm over each head of q and of k), RoPE with the K/V cache write, paged decode attention,
// o_proj, residual add + RMSNorm, gate/up, SiLU x up and down_proj, each by the native kernel the per-op path calls
// for it (kernels/decoder.py passes their addresses). The numbers are those of the per-op path, bit for bit: the same
// kernels on the same inputs in the same order. What goes is the Python between them, ~10 calls per layer, each with
// its own tensor allocations and checks (6 of a 33 ms batch-1 step of the 0.5B model on a Zen 4).
#include <stdint.h>
#include <string.h>

#include <memory>

#include "bf16.h"

namespace {

enum DType : int { F32 = 0, BF16 = 1 };
// How a matmul kernel takes its arguments (kernels/cpu.py's four kinds of gemm, and gemm_quant).
enum GemmKind : int { AVX2 = 0, AVX512 = 1, AVX512_BF16 = 2, AMX = 3, QUANT = 4 };

using Avx2Gemm = void (*)(const void*, int, const void*, int, const void*, int, void*, int, int, int, int, int);
using Avx512Gemm = void (*)(const void*, int, const void*, const void*, int, void*, int, int, int, int, int, int);
using Bf16Gemm = void (*)(const void*, const void*, const void*, int, void*, int, int, int, int, int, int);
using AmxGemm = void (*)(const void*, const void*, const void*, int, void*, int, int, int, int, int);
using QuantGemm = int (*)(const void*, int, const int32_t*, const void*, int, int, int, int, int, const void*, int,
                          void*, int, int, int, int, int, int);
using NormFn = void (*)(const void*, const void*, const void*, void*, void*, int, int, int, float, int, int);
using RopeFn = int (*)(const void*, const int64_t*, const void*, const void*, void*, void*, void*, const int64_t*,
                       int, int, int, int, int, int64_t, int64_t, int);
using AttentionFn = int (*)(const void*, const void*, const void*, const int64_t*, const int64_t*, void*, int, int,
                            int, int, int, int, int, int, int64_t, float, int);
using SiluFn = void (*)(const void*, void*, int, int, int, int);

}  // namespace

// One matmul of a layer: the kernel the autotuner chose for this step's batch-size bucket and the weight packed
// in the layout it reads.
struct Matmul {
    const void* kernel;
    const void* weight;
    int kind;      // GemmKind
    int w_dtype;   // the packed weight's dtype (the AVX2 kernel reads either)
    int prefetch;  // the AVX-512 kernels' weight prefetch
    // A quantised weight's (kernels/quant.py; `weight` holds its panels): the columns' input features (or null: in
    // order), whether the panels hold zero points (or mins), bits, group, groups per super-block (0: one level of
    // scales), the scales' dtype.
    const int32_t* perm;
    int zeros, bits, group, super_groups, scale_dtype;
};

constexpr int MAX_QKV_PARTS = 3;  // kernels/decoder.py's MAX_QKV_PARTS (q, k, v)

struct Layer {
    const void* input_norm;
    const void* post_norm;
    const void* qkv_bias;
    const void* q_norm;  // [head_dim] each, or null (no per-head norm)
    const void* k_norm;
    void* k_cache;
    void* v_cache;
    Matmul qkv, o, gate_up, down;
    // A QKV weight of differently quantised parts (a GGUF Q4_K_M file's Q4_K q and k beside a Q6_K v; or none:
    // num_qkv_parts 0, `qkv` is the weight): each part's matmul into its columns, then the bias added in the
    // activations' dtype, as the per-op path concatenates the parts' outputs and adds the bias (model/ops.py).
    Matmul qkv_parts[MAX_QKV_PARTS];
    int qkv_part_cols[MAX_QKV_PARTS];
    int num_qkv_parts;
};

struct Model {
    const void* add_rms_norm;
    const void* rope_kv_write;
    const void* attention;
    const void* silu_mul;
    const void* cos;
    const void* sin;
    int dtype, hidden, heads, kv_heads, head_dim, intermediate, block_size, sum_width;
    int64_t num_blocks, max_positions;
    float eps, scale;
};

namespace {

void matmul(const Matmul& m, const void* x, const void* bias, int dtype, void* out, int M, int N, int K,
            int threads) {
    switch (m.kind) {
        case AVX2:
            reinterpret_cast<Avx2Gemm>(m.kernel)(x, dtype, m.weight, m.w_dtype, bias, dtype, out, dtype, M, N, K,
                                                  threads);
            break;
        case AVX512:
            reinterpret_cast<Avx512Gemm>(m.kernel)(x, dtype, m.weight, bias, dtype, out, dtype, M, N, K, m.prefetch,
                                                    threads);
            break;
        case AVX512_BF16:
            reinterpret_cast<Bf16Gemm>(m.kernel)(x, m.weight, bias, dtype, out, dtype, M, N, K, m.prefetch, threads);
            break;
        case AMX:
            reinterpret_cast<AmxGemm>(m.kernel)(x, m.weight, bias, dtype, out, dtype, M, N, K, threads);
            break;
        default:  // the arguments were checked when the stack was built (kernels/decoder.py)
            reinterpret_cast<QuantGemm>(m.kernel)(x, dtype, m.perm, m.weight, m.zeros, m.scale_dtype, m.bits, m.group,
                                                   m.super_groups, bias, dtype, out, dtype, M, N, K, m.prefetch,
                                                   threads);
            break;
    }
}

// out[r, :] += bias for R rows of N, rounded to the dtype as torch's add of two tensors of that dtype.
void add_bias(void* out, const void* bias, int dtype, int R, int N) {
    for (int64_t i = 0; i < static_cast<int64_t>(R) * N; ++i) {
        const float sum = load_as_f32(out, dtype, i) + load_as_f32(bias, dtype, i % N);
        if (dtype == BF16)
            static_cast<uint16_t*>(out)[i] = f32_to_bf16(sum);
        else
            static_cast<float*>(out)[i] = sum;
    }
}

// The layer's QKV projection of h into qkv [R, qkv_size]: one matmul with its bias, or the parts'.
void project_qkv(const Layer& l, const void* h, int dtype, char* qkv, char* part, int R, int qkv_size, int hidden,
                 int threads) {
    if (l.num_qkv_parts == 0) {
        matmul(l.qkv, h, l.qkv_bias, dtype, qkv, R, qkv_size, hidden, threads);
        return;
    }
    const size_t elem = dtype == BF16 ? 2 : 4;
    for (int j = 0, column = 0; j < l.num_qkv_parts; column += l.qkv_part_cols[j], ++j) {
        const int cols = l.qkv_part_cols[j];
        matmul(l.qkv_parts[j], h, nullptr, dtype, part, R, cols, hidden, threads);
        for (int r = 0; r < R; ++r)
            memcpy(qkv + (static_cast<size_t>(r) * qkv_size + column) * elem, part + static_cast<size_t>(r) * cols * elem,
                   cols * elem);
    }
    add_bias(qkv, l.qkv_bias, dtype, R, qkv_size);
}

}  // namespace

// x [R, hidden]: the step's embeddings (or the previous pipeline stage's hidden states), one decode token per
// request, where the residual stream starts. Writes the last layer's MLP output to out and the residual stream
// before it to residual_out (both [R, hidden]); positions, slot_mapping, context_lens [R] and block_tables
// [R, max_blocks] are int64. Returns 0; or 1 where the first layer's RoPE/KV write found a slot or position out of
// range, 2 where its attention found a context length or block id out of range (the kernels check on entry, so the
// per-op path would have stopped at the same point, after the same writes).
extern "C" int decode_layers(const Model* model, const Layer* layers, int num_layers, const void* x, void* out,
                             void* residual_out, const int64_t* positions, const int64_t* slot_mapping,
                             const int64_t* block_tables, const int64_t* context_lens, int R, int max_blocks,
                             int threads) {
    const Model& c = *model;
    const size_t elem = c.dtype == BF16 ? 2 : 4;
    const int q_size = c.heads * c.head_dim, qkv_size = (c.heads + 2 * c.kv_heads) * c.head_dim;
    const size_t rows = static_cast<size_t>(R);
    // Scratch for one layer's intermediates, written before each is read: left uninitialised (a std::vector would
    // zero ~1 MB of it every step at 32 rows).
    auto scratch = [](size_t bytes) { return std::unique_ptr<char[]>(new char[bytes]); };
    const auto h = scratch(rows * c.hidden * elem), qkv = scratch(rows * qkv_size * elem),
               q = scratch(rows * q_size * elem), attended = scratch(rows * q_size * elem),
               gate_up = scratch(rows * 2 * c.intermediate * elem), act = scratch(rows * c.intermediate * elem);
    bool has_parts = false;  // (a QKV weight of parts needs a part's output before it goes into its columns)
    for (int i = 0; i < num_layers; ++i) has_parts |= layers[i].num_qkv_parts > 0;
    const auto part = scratch(has_parts ? rows * qkv_size * elem : 0);
    const auto norm = reinterpret_cast<NormFn>(c.add_rms_norm);
    const auto rope = reinterpret_cast<RopeFn>(c.rope_kv_write);
    const auto attention = reinterpret_cast<AttentionFn>(c.attention);
    const auto silu = reinterpret_cast<SiluFn>(c.silu_mul);
    // The stream: residual_out holds it after each norm (the kernel reads and writes it in place, element by
    // element); `out` holds each layer's MLP output, which the next layer's input norm adds to it.
    memcpy(residual_out, x, rows * c.hidden * elem);
    norm(x, nullptr, layers[0].input_norm, h.get(), nullptr, c.dtype, R, c.hidden, c.eps, c.sum_width, threads);
    for (int i = 0; i < num_layers; ++i) {
        const Layer& l = layers[i];
        if (i > 0)
            norm(out, residual_out, l.input_norm, h.get(), residual_out, c.dtype, R, c.hidden, c.eps, c.sum_width,
                 threads);
        project_qkv(l, h.get(), c.dtype, qkv.get(), part.get(), R, qkv_size, c.hidden, threads);
        if (l.q_norm != nullptr)  // each row's query heads, then its key heads, as rows of head_dim, in place
            for (size_t r = 0; r < rows; ++r) {
                char* row = qkv.get() + r * qkv_size * elem;
                norm(row, nullptr, l.q_norm, row, nullptr, c.dtype, c.heads, c.head_dim, c.eps, c.sum_width, threads);
                norm(row + q_size * elem, nullptr, l.k_norm, row + q_size * elem, nullptr, c.dtype, c.kv_heads,
                     c.head_dim, c.eps, c.sum_width, threads);
            }
        if (rope(qkv.get(), positions, c.cos, c.sin, q.get(), l.k_cache, l.v_cache, slot_mapping, c.dtype, R,
                 c.heads, c.kv_heads, c.head_dim, c.num_blocks * c.block_size, c.max_positions, threads))
            return 1;
        if (attention(q.get(), l.k_cache, l.v_cache, block_tables, context_lens, attended.get(), c.dtype, c.dtype,
                      R, c.heads, c.kv_heads, c.head_dim, c.block_size, max_blocks, c.num_blocks, c.scale, threads))
            return 2;
        matmul(l.o, attended.get(), nullptr, c.dtype, out, R, c.hidden, q_size, threads);
        norm(out, residual_out, l.post_norm, h.get(), residual_out, c.dtype, R, c.hidden, c.eps, c.sum_width,
             threads);
        matmul(l.gate_up, h.get(), nullptr, c.dtype, gate_up.get(), R, 2 * c.intermediate, c.hidden, threads);
        silu(gate_up.get(), act.get(), c.dtype, R, c.intermediate, threads);
        matmul(l.down, act.get(), nullptr, c.dtype, out, R, c.hidden, c.intermediate, threads);
    }
    return 0;
}
