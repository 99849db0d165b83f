// Just enough of CUDA C to run the package's kernel sources on the CPU, for
// tests/test_cuda_kernels_on_cpu.py (g++ -std=c++20).  No STL containers: it
// is compiled at test time, under AddressSanitizer too, and must compile fast.
//
// A launch runs the grid's blocks one after another.  A block's threads are
// fibers (ucontext) on one OS thread: each runs to its next __syncthreads()
// or its end, then the next one runs, so a phase between two barriers is
// executed thread after thread.  (Real threads were tried: with 256 of them a
// barrier costs about a millisecond of context switches on a small machine,
// seconds for a grid of a few hundred blocks.)  A kernel whose result depends
// on the order of its threads within a phase, or of its blocks, has a race:
// run() launches twice, threads and blocks in ascending and then in
// descending order, and both must give the same bits.  __shared__ variables
// are statics in one section, filled with 0xff bytes (NaN, -1) before every
// block, so shared memory that a block reads before writing is garbage, as
// on a GPU.  Every thread that waits at a barrier must wait at the same
// __syncthreads(), and none of the block may have returned: a barrier in
// divergent code is reported.
#pragma once

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <math.h>
#include <ucontext.h>
#if __has_include(<sanitizer/asan_interface.h>)
#include <sanitizer/asan_interface.h>
#else
#define ASAN_POISON_MEMORY_REGION(addr, size) ((void)(addr), (void)(size))
#define ASAN_UNPOISON_MEMORY_REGION(addr, size) ((void)(addr), (void)(size))
#endif

struct dim3 { unsigned int x = 1, y = 1, z = 1; };

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ __attribute__((section("cuda_shared"))) static
#define __syncthreads() cuda_on_cpu::syncthreads(__LINE__)

namespace cuda_on_cpu {

inline dim3 thread_index, block_index, block_dim, grid_dim;

constexpr int MAX_THREADS = 1024;             // per block, as on a GPU
constexpr size_t STACK_BYTES = 64 * 1024;     // per thread: kernels keep little on the stack
constexpr int RUNNING = 0, RETURNED = -1;     // a thread's state, else its barrier's line

struct Thread {
    ucontext_t context;
    int state;
};

inline Thread threads[MAX_THREADS];
inline char* stacks;                          // MAX_THREADS stacks, allocated once
inline ucontext_t scheduler;
inline void (*kernel_call)(void** args);
inline void** kernel_args;
inline char error[256];
// the phase under way: its threads in the order they run, and which one runs
inline unsigned int phase_order[MAX_THREADS], phase_length, phase_position;

// The next thread of the phase, or the scheduler after the last one (a thread
// hands over to the next directly: half the switches of going through the scheduler).
inline ucontext_t* next_in_phase() {
    if (++phase_position == phase_length) return &scheduler;
    thread_index = dim3{phase_order[phase_position]};
    return &threads[thread_index.x].context;
}

inline void syncthreads(int line) {
    Thread& self = threads[thread_index.x];
    self.state = line;
    swapcontext(&self.context, next_in_phase());
    self.state = RUNNING;
}

inline void thread_main() {
    kernel_call(kernel_args);
    threads[thread_index.x].state = RETURNED;
    setcontext(next_in_phase());
}

extern "C" char __start_cuda_shared[], __stop_cuda_shared[];
__attribute__((section("cuda_shared"))) inline char shared_anchor;   // the section exists

// After a phase: every thread not returned waits at one barrier, or all returned.
inline bool phase_is_uniform(unsigned int count, bool* all_returned) {
    int line = RUNNING;
    unsigned int returned = 0;
    for (unsigned int t = 0; t < count; ++t) {
        const int state = threads[t].state;
        if (state == RETURNED) { ++returned; continue; }
        if (line != RUNNING && state != line) {
            snprintf(error, sizeof error, "__syncthreads() at lines %d and %d in one phase "
                     "(a barrier in divergent code)", line, state);
            return false;
        }
        line = state;
    }
    if (returned > 0 && returned < count) {
        snprintf(error, sizeof error, "__syncthreads() at line %d after another thread of "
                 "the block returned", line);
        return false;
    }
    *all_returned = returned == count;
    return true;
}

// Runs call(args) on grid blocks of count threads (1-D, as every kernel here is
// launched), in ascending or descending order; false with error set on a fault.
inline bool launch(unsigned int grid, unsigned int count, void (*call)(void**), void** args,
                   bool descending) {
    if (count == 0 || count > MAX_THREADS || grid == 0) {
        snprintf(error, sizeof error, "a launch of %u blocks of %u threads", grid, count);
        return false;
    }
    if (stacks == nullptr) stacks = new char[MAX_THREADS * STACK_BYTES];
    grid_dim = dim3{grid};
    block_dim = dim3{count};
    kernel_call = call;
    kernel_args = args;
    for (unsigned int b = 0; b < grid; ++b) {
        block_index = dim3{descending ? grid - 1 - b : b};
        memset(__start_cuda_shared, 0xff, __stop_cuda_shared - __start_cuda_shared);
        for (unsigned int t = 0; t < count; ++t) {
            Thread& thread = threads[t];
            thread.state = RUNNING;
            getcontext(&thread.context);
            thread.context.uc_stack.ss_sp = stacks + t * STACK_BYTES;
            thread.context.uc_stack.ss_size = STACK_BYTES;
            thread.context.uc_link = nullptr;      // (thread_main never returns)
            makecontext(&thread.context, thread_main, 0);
        }
        for (bool all_returned = false; !all_returned;) {
            // one phase: every thread not returned runs to its next barrier or its end
            phase_length = 0;
            for (unsigned int k = 0; k < count; ++k) {
                const unsigned int t = descending ? count - 1 - k : k;
                if (threads[t].state != RETURNED) phase_order[phase_length++] = t;
            }
            phase_position = 0;
            thread_index = dim3{phase_order[0]};
            swapcontext(&scheduler, &threads[thread_index.x].context);
            if (!phase_is_uniform(count, &all_returned)) return false;
        }
    }
    return true;
}

constexpr int MAX_ARGUMENTS = 32;
constexpr long long CANARY = 4096;              // bytes on each side of a buffer
constexpr unsigned char CANARY_BYTE = 0xa5;

// A kernel's own copy of a buffer argument, between canaries.
struct Copy {
    char* host;
    long long bytes;
    unsigned char* memory;                      // canary, data, canary
    unsigned char* input;                       // the data before the first launch
    int argument;
    unsigned char* data() const { return memory + CANARY; }
};

inline bool canaries_intact(const Copy& copy) {
    for (long long k = 0; k < CANARY; ++k)
        if (copy.memory[k] != CANARY_BYTE || copy.data()[copy.bytes + k] != CANARY_BYTE)
            return false;
    return true;
}

// One launch as cuLaunchKernel takes it: args[i] points at argument i.  An
// argument with bytes[i] >= 0 is a pointer to a buffer of that many bytes: the
// kernel gets a copy of it in an allocation of its own between canaries
// (poisoned under AddressSanitizer, so a read there fails too), copied back
// afterwards; a write past either end changes a canary.  Arguments that point
// at the same buffer share one copy.  The kernel runs twice from the same
// inputs, in ascending and in descending order, and must give the same bits.
// Returns "" or what went wrong.
inline const char* run(unsigned int grid, unsigned int block, void** args,
                       const long long* bytes, int count, void (*call)(void**)) {
    Copy copies[MAX_ARGUMENTS];
    void* pointers[MAX_ARGUMENTS];
    void* slots[MAX_ARGUMENTS];
    int copied = 0;
    error[0] = '\0';
    if (count > MAX_ARGUMENTS) return "too many arguments";
    for (int i = 0; i < count; ++i) {
        slots[i] = args[i];
        if (bytes[i] < 0) continue;
        char* host = *static_cast<char**>(args[i]);
        Copy* copy = nullptr;
        for (int c = 0; c < copied; ++c) {
            Copy& other = copies[c];
            if (other.host == host && other.bytes == bytes[i]) copy = &other;
            else if (host < other.host + other.bytes && other.host < host + bytes[i])
                snprintf(error, sizeof error, "arguments %d and %d overlap without being "
                         "the same buffer", other.argument, i);
        }
        if (copy == nullptr) {
            copy = &copies[copied++];
            *copy = Copy{host, bytes[i], new unsigned char[bytes[i] + 2 * CANARY],
                         new unsigned char[bytes[i]], i};
            memset(copy->memory, CANARY_BYTE, bytes[i] + 2 * CANARY);
            memcpy(copy->data(), host, bytes[i]);
            memcpy(copy->input, host, bytes[i]);
            ASAN_POISON_MEMORY_REGION(copy->memory, CANARY);
            ASAN_POISON_MEMORY_REGION(copy->data() + bytes[i], CANARY);
        }
        pointers[i] = copy->data();
        slots[i] = &pointers[i];
    }
    if (error[0] == '\0' && launch(grid, block, call, slots, false)) {
        // again from the same inputs, the other way round; its result is kept
        for (int c = 0; c < copied; ++c) {
            Copy& copy = copies[c];
            memcpy(copy.host, copy.data(), copy.bytes);
            memcpy(copy.data(), copy.input, copy.bytes);
        }
        if (launch(grid, block, call, slots, true))
            for (int c = 0; c < copied && error[0] == '\0'; ++c)
                if (memcmp(copies[c].host, copies[c].data(), copies[c].bytes))
                    snprintf(error, sizeof error, "argument %d differs when threads and "
                             "blocks run in the other order (a race)", copies[c].argument);
    }
    for (int c = 0; c < copied; ++c) {
        Copy& copy = copies[c];
        ASAN_UNPOISON_MEMORY_REGION(copy.memory, CANARY);
        ASAN_UNPOISON_MEMORY_REGION(copy.data() + copy.bytes, CANARY);
        if (!canaries_intact(copy) && error[0] == '\0')
            snprintf(error, sizeof error, "a write outside argument %d", copy.argument);
        memcpy(copy.host, copy.data(), copy.bytes);
        delete[] copy.memory;
        delete[] copy.input;
    }
    return error;
}

}  // namespace cuda_on_cpu

#define threadIdx (cuda_on_cpu::thread_index)
#define blockIdx (cuda_on_cpu::block_index)
#define blockDim (cuda_on_cpu::block_dim)
#define gridDim (cuda_on_cpu::grid_dim)

inline float __int_as_float(int i) { float f; memcpy(&f, &i, sizeof f); return f; }
inline unsigned int __float_as_uint(float f) { unsigned int u; memcpy(&u, &f, sizeof u); return u; }
inline float __expf(float x) { return expf(x); }

inline unsigned int atomicAdd(unsigned int* address, unsigned int value) {
    return std::atomic_ref<unsigned int>(*address).fetch_add(value);
}

inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
