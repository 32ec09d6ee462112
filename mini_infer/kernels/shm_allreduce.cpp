// All-reduce (sum) among the tensor-parallel ranks of one machine through a shared-memory segment.
//
// Layout: `world` flags, one per cache line, an abort word on the next line, then two buffers (alternating by
// round) of `world` slots of `slot_bytes` each. A watchdog sets the abort word when a rank's process has exited:
// the waiting ranks then return -1 instead of spinning forever. Round `seq` (counted alike on every rank): each rank copies its chunk into its slot, fences,
// publishes seq in its flag, waits until every flag has reached seq, then sums the slots in rank order (so every
// rank gets bit-identical results) into its tensor, accumulating float32/bfloat16 in float32 and float64 in
// float64. A rank can reuse a buffer two rounds later only after every other rank has published the round in
// between, which each does after it finished reading this one: two buffers need no second barrier.
#include <atomic>
#include <immintrin.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

namespace {

constexpr long kLine = 64;

struct Segment {
    char* base;
    int rank, world;
    long slot_bytes;

    std::atomic<int64_t>* flag(int r) const { return reinterpret_cast<std::atomic<int64_t>*>(base + r * kLine); }
    std::atomic<int64_t>* abort() const { return flag(world); }
    char* slot(int64_t seq, int r) const {
        return base + (world + 1) * kLine + ((seq & 1) * world + r) * slot_bytes;
    }
};

bool wait_all(const Segment& s, int64_t seq) {  // false when aborted
    for (int r = 0; r < s.world; ++r) {
        long spins = 0;
        while (s.flag(r)->load(std::memory_order_acquire) < seq) {
            if (s.abort()->load(std::memory_order_relaxed)) return false;
            _mm_pause();
            if (++spins > 2000) {  // more ranks than free cores: let the others run
                sched_yield();
                spins = 0;
            }
        }
    }
    return true;
}

template <typename T, typename Acc, typename Load, typename Store>
void sum_slots(const Segment& s, int64_t seq, T* out, long n, Load load, Store store) {
    const T* slots[64];
    for (int r = 0; r < s.world; ++r) slots[r] = reinterpret_cast<const T*>(s.slot(seq, r));
    for (long i = 0; i < n; ++i) {
        Acc acc = load(slots[0][i]);
        for (int r = 1; r < s.world; ++r) acc += load(slots[r][i]);
        out[i] = store(acc);
    }
}

}  // namespace

// dtype: 0 float32, 1 bfloat16, 2 float64. Returns the number of rounds used (one per slot-sized chunk), or -1
// if the segment was aborted while waiting.
extern "C" long shm_allreduce(void* segment, int rank, int world, long slot_bytes, int64_t first_seq, void* data,
                              int dtype, long numel) {
    Segment s{static_cast<char*>(segment), rank, world, slot_bytes};
    const long item = dtype == 1 ? 2 : dtype == 0 ? 4 : 8;
    const long per_chunk = slot_bytes / item;
    char* bytes = static_cast<char*>(data);
    int64_t seq = first_seq;
    for (long start = 0; start < numel; start += per_chunk, ++seq) {
        const long n = numel - start < per_chunk ? numel - start : per_chunk;
        char* chunk = bytes + start * item;
        memcpy(s.slot(seq, rank), chunk, n * item);
        std::atomic_thread_fence(std::memory_order_seq_cst);
        s.flag(rank)->store(seq, std::memory_order_release);
        if (!wait_all(s, seq)) return -1;
        if (dtype == 0) {
            sum_slots<float, float>(s, seq, reinterpret_cast<float*>(chunk), n, [](float v) { return v; },
                                    [](float v) { return v; });
        } else if (dtype == 1) {
            sum_slots<uint16_t, float>(s, seq, reinterpret_cast<uint16_t*>(chunk), n, bf16_to_f32, f32_to_bf16);
        } else {
            sum_slots<double, double>(s, seq, reinterpret_cast<double*>(chunk), n, [](double v) { return v; },
                                      [](double v) { return v; });
        }
    }
    return seq - first_seq;
}
