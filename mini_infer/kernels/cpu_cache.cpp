// Evicting a buffer from every cache level, for the autotuner: a decode step's matmul streams its weight from
// memory, so a timed call must find the weight there and not in the caches.
//
// Built twice: with CLFLUSHOPT (the flushes of one buffer overlap one another; on an AMX Xeon 272 MB took 13 ms)
// and with CLFLUSH, SSE2's, on every x86-64 CPU (each flush waits for the one before: 160 ms for the same 272 MB).
#include <immintrin.h>
#include <stdint.h>

extern "C" void flush_lines(const void* data, int64_t bytes) {
    constexpr int64_t kLine = 64;  // the smallest cache line of the x86-64 CPUs: flushing by it misses none
    const char* start = static_cast<const char*>(data);
    for (int64_t i = 0; i < bytes; i += kLine) {
#if CLFLUSHOPT
        _mm_clflushopt(const_cast<char*>(start + i));
#else
        _mm_clflush(start + i);
#endif
    }
    _mm_mfence();  // the flushes are done before the timed call's first load
}
