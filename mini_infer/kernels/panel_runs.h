// Threads taking runs of panels in turn (the AVX2 matmul kernels): each run half of what is left over the threads, at
// least `least` (and a multiple of it), so that a thread the machine holds back takes fewer instead of keeping the
// others waiting at the barrier, as an even share each did on 2-core VMs whose host takes a core now and then.
#pragma once

#include <omp.h>

#include <atomic>

// Inside an OpenMP parallel region, every thread of which calls it with the same `next` (starting at 0): f(begin, end)
// for runs of [0, count) until none is left.
template <typename F>
inline void take_runs(std::atomic<int>& next, int count, int least, F&& f) {
    const int workers = omp_get_num_threads();
    for (;;) {
        int begin = next.load(std::memory_order_relaxed), end;
        do {
            if (begin >= count) return;
            const int left = count - begin, size = left / (2 * workers);
            end = begin + (size > least ? size / least * least : (left < least ? left : least));
        } while (!next.compare_exchange_weak(begin, end, std::memory_order_relaxed));
        f(begin, end);
    }
}
