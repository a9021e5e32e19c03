// msrl host shim: compiles CUDA C kernels for the CPU.
//
// Each kernel runs as a loop over (block, thread) pairs spread over OpenMP threads, with
// blockIdx/threadIdx/blockDim/gridDim set per iteration. Kernels therefore must not use
// __syncthreads() (nor rely on the order of threads): a phase boundary is a separate kernel
// launch, which both builds honour. atomicAdd maps to GCC atomics, so reductions several
// threads write stay correct when they run in parallel.
#pragma once
#include <math.h>
#include <stdint.h>

#include <algorithm>
using std::max;  // CUDA's integer min/max built-ins
using std::min;

struct dim3 {
    unsigned int x, y, z;
};
// initial-exec: the built-ins are read in every kernel body; the default TLS model of a shared
// library would call __tls_get_addr for each read.
#define MSRL_TLS static thread_local __attribute__((tls_model("initial-exec")))
MSRL_TLS dim3 threadIdx = {0, 0, 0};
MSRL_TLS dim3 blockIdx = {0, 0, 0};
MSRL_TLS dim3 blockDim = {1, 1, 1};
MSRL_TLS dim3 gridDim = {1, 1, 1};

#define __global__ inline __attribute__((always_inline))
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __syncthreads() MSRL_HOST_BUILD_DOES_NOT_SUPPORT___syncthreads__SPLIT_THE_KERNEL()

template <class F>
static void msrl_host_launch(int grid, int block, F body) {
    // Every (block, thread) pair is independent (no __syncthreads), so both loops are spread over
    // the OpenMP threads together: a grid of one block still uses every core.
#pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < grid; ++b) {
        for (int t = 0; t < block; ++t) {
            blockIdx = {(unsigned)b, 0, 0};
            blockDim = {(unsigned)block, 1, 1};
            gridDim = {(unsigned)grid, 1, 1};
            threadIdx = {(unsigned)t, 0, 0};
            body();
        }
    }
}

static inline int atomicAdd(int* address, int value) {
    return __atomic_fetch_add(address, value, __ATOMIC_RELAXED);
}

static inline float atomicAdd(float* address, float value) {
    unsigned int* p = reinterpret_cast<unsigned int*>(address);
    unsigned int old = __atomic_load_n(p, __ATOMIC_RELAXED), desired;
    float result;
    do {
        __builtin_memcpy(&result, &old, sizeof(float));
        float updated = result + value;
        __builtin_memcpy(&desired, &updated, sizeof(float));
    } while (!__atomic_compare_exchange_n(p, &old, desired, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    return result;
}
