// Helpers the ops share: building their graph nodes, and reading their inputs.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "qmm.h"

namespace mlxchat {

namespace mx = mlx::core;

inline mx::Stream cpu_stream() {
  return mx::default_stream(mx::Device(mx::Device::cpu));
}

// The kernels read their inputs as dense rows. Evaluated dense arrays pass as they are (no extra graph node); anything
// else gets a contiguous() node, which costs nothing when its result is already dense.
inline mx::array dense(const mx::array& a, const mx::Stream& s) {
  if (a.is_available() && a.flags().row_contiguous) return a;
  return mx::contiguous(a, false, s);
}

// x [..., K] with any strides as dense fp32 rows [M, K] (M = the product of the leading dimensions).
template <typename T>
inline void gather_x(const mx::array& x, std::vector<float>& out) {
  const int nd = x.ndim(), K = x.shape(-1);
  const size_t M = x.size() / K;
  const auto& shape = x.shape();
  const auto& strides = x.strides();
  const int64_t sk = strides[nd - 1];
  const T* p = x.data<T>();
  std::vector<int> idx(nd > 1 ? nd - 1 : 0, 0);
  for (size_t m = 0; m < M; ++m) {
    int64_t base = 0;
    for (int d = 0; d + 1 < nd; ++d) base += int64_t(idx[d]) * strides[d];
    for (int k = 0; k < K; ++k) out[m * K + k] = static_cast<float>(p[base + k * sk]);
    for (int d = nd - 2; d >= 0; --d) {  // next row index, last leading dimension fastest
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
  }
}

// x's float32 elements in row-major order: x itself when it is dense, else a copy gathered through its strides.
inline const float* rows_of(const mx::array& x, std::vector<float>& copy) {
  if (x.flags().row_contiguous) return x.data<float>();
  copy.resize(x.size());
  gather_x<float>(x, copy);
  return copy.data();
}

// The output takes over a dense input's buffer when nothing else holds it (scores, gate and logits are temporaries).
inline void allocate_output(const mx::array& in, mx::array& out) {
  if (in.flags().row_contiguous && in.is_donatable() && in.nbytes() == out.nbytes()) {
    out.copy_shared_buffer(in);
  } else {
    out.set_data(mx::allocator::malloc(out.nbytes()));
  }
}

inline void check_float32(const mx::array& a, const char* name) {
  if (!cpu_supported()) throw std::runtime_error(cpu_unsupported_reason());
  if (a.dtype() != mx::float32) throw std::invalid_argument(std::string(name) + " must be float32");
}

// What the elementwise-shaped ops share (the blocks' three, nucleus): they run on the CPU only, and their output has
// the first input's shape.
class CpuOp : public mx::UnaryPrimitive {
 public:
  using mx::UnaryPrimitive::UnaryPrimitive;

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error(std::string(name()) + " runs on the CPU only");
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }
};

}  // namespace mlxchat
