// CuPy's device-side array and index types, as the kernels that CuPy generates
// around an ElementwiseKernel body or a ReductionKernel's expressions use them
// (cupy/_core/include/cupy/carray.cuh), for tests/test_cupy_kernels_on_cpu.py:
// such kernels run on the CPU through cuda_on_cpu.h.
//
// The number of dimensions is a run-time value here (a template argument in
// CuPy, which also specialises C-contiguous arrays): the same element is
// addressed.  An array argument arrives as two: its data pointer (a buffer
// that cuda_on_cpu::run copies between canaries) and a Layout (by value).
#pragma once

#include <cstddef>

#include "cuda_on_cpu.h"

namespace cupy_on_cpu {

constexpr int MAX_NDIM = 8;

// Shape and strides (in bytes) of an array argument, or the shape of an indexer.
struct Layout {
    ptrdiff_t ndim;
    ptrdiff_t shape[MAX_NDIM];
    ptrdiff_t strides[MAX_NDIM];
};

// What CIndexer::get() returns: one index per dimension.
struct Index {
    ptrdiff_t at[MAX_NDIM];
};

}  // namespace cupy_on_cpu

// The loop of CuPy's elementwise kernels: a grid-stride loop over [0, n).
#define CUPY_FOR(i, n)                                                         \
    for (ptrdiff_t i = static_cast<ptrdiff_t>(blockIdx.x) * blockDim.x + threadIdx.x; \
         i < (n); i += static_cast<ptrdiff_t>(blockDim.x) * gridDim.x)

template <typename T>
class CArray {
    T* data_;
    cupy_on_cpu::Layout layout_;
    ptrdiff_t size_;

    const T& at_offset(ptrdiff_t bytes) const {
        return *reinterpret_cast<const T*>(reinterpret_cast<const char*>(data_) + bytes);
    }

public:
    CArray(T* data, const cupy_on_cpu::Layout& layout) : data_(data), layout_(layout), size_(1) {
        for (int d = 0; d < layout.ndim; ++d) size_ *= layout.shape[d];
    }

    ptrdiff_t size() const { return size_; }
    const ptrdiff_t* shape() const { return layout_.shape; }
    const ptrdiff_t* strides() const { return layout_.strides; }

    // By an indexer's multi-index (a non-raw argument: _raw_x[_ind.get()]).
    const T& operator[](const cupy_on_cpu::Index& index) const {
        ptrdiff_t bytes = 0;
        for (int d = 0; d < layout_.ndim; ++d) bytes += layout_.strides[d] * index.at[d];
        return at_offset(bytes);
    }
    T& operator[](const cupy_on_cpu::Index& index) {
        return const_cast<T&>(static_cast<const CArray&>(*this)[index]);
    }

    // By a flat index (a raw argument: x[k]): element k in C order of the array's
    // own shape, found through its strides (a 0-d array: its one element).
    const T& operator[](ptrdiff_t i) const {
        if (layout_.ndim == 0) return *data_;
        ptrdiff_t bytes = 0;
        for (int d = layout_.ndim - 1; d > 0; --d) {
            bytes += layout_.strides[d] * (i % layout_.shape[d]);
            i /= layout_.shape[d];
        }
        return at_offset(bytes + layout_.strides[0] * i);
    }
    T& operator[](ptrdiff_t i) {
        return const_cast<T&>(static_cast<const CArray&>(*this)[i]);
    }
};

// The multi-index of a flat position in C order of a shape (CuPy's CIndexer).
class CIndexer {
    cupy_on_cpu::Layout layout_;
    ptrdiff_t size_;
    cupy_on_cpu::Index index_;

public:
    explicit CIndexer(const cupy_on_cpu::Layout& layout) : layout_(layout), size_(1), index_{} {
        for (int d = 0; d < layout.ndim; ++d) size_ *= layout.shape[d];
    }

    ptrdiff_t size() const { return size_; }

    void set(ptrdiff_t i) {
        for (int d = layout_.ndim - 1; d > 0; --d) {
            index_.at[d] = i % layout_.shape[d];
            i /= layout_.shape[d];
        }
        if (layout_.ndim > 0) index_.at[0] = i;
    }

    const cupy_on_cpu::Index& get() const { return index_; }
};

inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
