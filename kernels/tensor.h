// Typed views of backend memory: what the ops of kernels/backend.h take and
// give. A Tensor is a pointer, an element type, a shape of up to four
// dimensions and a stride per dimension (in elements); it owns nothing.
//
// The layout every op accepts today: the dimensions after the first are
// packed (row-major, no gaps), the first may be strided. So a column range of
// a wider tensor is a view, not a copy: q, k and v are views of one packed
// q|k|v product, gate and up of one gate|up product. Ops check it with
// packed_inner() and state any further need (a packed output, say).
//
// Index arrays (token ids, positions, KV slots, block tables) are not
// Tensors: their element type is fixed by each op's contract.
//
// Plain C++17: CUDA sources include it, and RowLayout is usable on the device.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "common/dtype.h"

#if defined(__CUDACC__)
#define PDSERVE_HOST_DEVICE __host__ __device__
#else
#define PDSERVE_HOST_DEVICE
#endif

namespace pdserve::kernels {

inline constexpr int kMaxTensorDims = 4;

// Where the rows (runs of the last dimension) of a packed_inner() tensor
// start: row r is row r % rows_per_token of token r / rows_per_token, tokens
// token_stride elements apart. A plain value, passed to device kernels.
struct RowLayout {
  int64_t rows_per_token = 1;
  int64_t token_stride = 0;  // elements
  int64_t row_size = 0;      // elements of one row
  PDSERVE_HOST_DEVICE int64_t offset(int64_t row) const {
    return rows_per_token == 1
               ? row * token_stride
               : row / rows_per_token * token_stride + row % rows_per_token * row_size;
  }
};

struct Tensor {
  void* data = nullptr;
  DType dtype = DType::kF32;
  int rank = 0;
  int64_t shape[kMaxTensorDims] = {};
  int64_t stride[kMaxTensorDims] = {};

  // A packed row-major tensor of `shape` at `data`.
  static Tensor Of(const void* data, DType dtype, std::initializer_list<int64_t> shape) {
    Tensor t;
    t.data = const_cast<void*>(data);
    t.dtype = dtype;
    for (int64_t n : shape) t.shape[t.rank++] = n;
    int64_t s = 1;
    for (int d = t.rank - 1; d >= 0; --d) {
      t.stride[d] = s;
      s *= t.shape[d];
    }
    return t;
  }

  template <typename T>
  T* as() const {
    return static_cast<T*>(data);
  }
  int64_t numel() const {
    int64_t n = 1;
    for (int d = 0; d < rank; ++d) n *= shape[d];
    return n;
  }
  // Elements of one run of the last dimension, and how many runs there are.
  int64_t row_size() const { return rank == 0 ? 1 : shape[rank - 1]; }
  int64_t rows() const { return row_size() == 0 ? 0 : numel() / row_size(); }
  // Bytes of a packed tensor's elements.
  int64_t bytes() const { return numel() * DTypeBits(dtype) / 8; }

  // Every dimension after the first is packed.
  bool packed_inner() const {
    int64_t s = 1;
    for (int d = rank - 1; d >= 1; --d) {
      if (stride[d] != s) return false;
      s *= shape[d];
    }
    return rank == 0 || stride[0] >= s || shape[0] <= 1;
  }
  // Every dimension is packed: one contiguous range.
  bool packed() const {
    if (!packed_inner()) return false;
    return rank <= 1 ? (rank == 0 || stride[0] == 1 || shape[0] <= 1)
                     : (stride[0] == shape[1] * stride[1] || shape[0] <= 1);
  }
  // Rows of a packed_inner() tensor.
  RowLayout row_layout() const {
    RowLayout l;
    l.row_size = row_size();
    l.token_stride = rank <= 1 ? l.row_size : stride[0];
    for (int d = 1; d + 1 < rank; ++d) l.rows_per_token *= shape[d];
    return l;
  }
  // The first element of row r (packed_inner() tensors).
  void* row(int64_t r) const {
    return static_cast<char*>(data) + row_layout().offset(r) * (DTypeBits(dtype) / 8);
  }

  // Columns [begin, end) of the last dimension of a rank-2 tensor: a view
  // with the same row stride.
  Tensor Columns(int64_t begin, int64_t end) const {
    Tensor t = *this;
    t.data = static_cast<char*>(data) + begin * stride[rank - 1] * (DTypeBits(dtype) / 8);
    t.shape[rank - 1] = end - begin;
    return t;
  }
  // Rows [begin, end) of the first dimension.
  Tensor Rows(int64_t begin, int64_t end) const {
    Tensor t = *this;
    t.data = static_cast<char*>(data) + begin * stride[0] * (DTypeBits(dtype) / 8);
    t.shape[0] = end - begin;
    return t;
  }
  // The same first dimension (and its stride), the packed rest re-split
  // into `inner`: [tokens, heads * head_dim] as [tokens, heads, head_dim].
  Tensor Split(std::initializer_list<int64_t> inner) const {
    Tensor t;
    t.data = data;
    t.dtype = dtype;
    t.shape[0] = shape[0];
    t.rank = 1;
    for (int64_t n : inner) t.shape[t.rank++] = n;
    int64_t s = 1;
    for (int d = t.rank - 1; d >= 1; --d) {
      t.stride[d] = s;
      s *= t.shape[d];
    }
    t.stride[0] = stride[0];
    return t;
  }
};

}  // namespace pdserve::kernels
