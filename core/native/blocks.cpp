#include "blocks.h"

#include <algorithm>
#include <functional>
#include <stdexcept>
#include <vector>

#include "graph.h"
#include "kernel.h"
#include "mlx/backend/cpu/encoder.h"
#include "qmm.h"

namespace mlxchat {

namespace {

// Elements a piece of the elementwise ops below hands the pool: a prompt's softmax (a 512-token layer's scores are
// millions) and SwiGLU ran on one thread while the other core waited for the next matmul.
constexpr size_t kPieceElements = size_t(1) << 17;

// fn(0) .. fn(pieces - 1): on the pool where there are several (one alone is not worth a hand-off).
void in_pieces(size_t pieces, const std::function<void(int)>& fn) {
  if (pieces <= 1) {
    fn(0);
  } else {
    parallel_pieces(int(pieces), fn);
  }
}

class NativeSoftmax : public CpuOp {
 public:
  NativeSoftmax(mx::Stream stream, float scale, bool causal)
      : CpuOp(stream), scale_(scale), causal_(causal) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const auto& x = inputs[0];
    allocate_output(x, out);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_output_array(out);
    encoder.dispatch([x = mx::array::unsafe_weak_copy(x), out = mx::array::unsafe_weak_copy(out), scale = scale_,
                      causal = causal_]() mutable {
      std::vector<float> copy;
      const float* in = rows_of(x, copy);
      const int S = x.shape(-1), L = x.ndim() >= 2 ? x.shape(-2) : 1;
      // Pieces of whole [L, S] matrices: the causal mask counts rows within one.
      const size_t matrices = x.size() / (size_t(S) * L);
      const size_t per_piece = std::max<size_t>(1, kPieceElements / (size_t(S) * L));
      in_pieces((matrices + per_piece - 1) / per_piece, [&](int p) {
        const size_t m0 = p * per_piece, m1 = std::min(matrices, m0 + per_piece), at = m0 * L * S;
        softmax_rows_avx2(in + at, out.data<float>() + at, (m1 - m0) * L, S, L, scale, causal);
      });
    });
  }

  const char* name() const override { return "MlxchatSoftmax"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const NativeSoftmax&>(other);
    return scale_ == o.scale_ && causal_ == o.causal_;
  }

 private:
  float scale_;
  bool causal_;
};

class NativeSwiglu : public CpuOp {
 public:
  explicit NativeSwiglu(mx::Stream stream) : CpuOp(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const auto& gate = inputs[0];
    const auto& up = inputs[1];
    allocate_output(gate, out);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(gate);
    encoder.set_input_array(up);
    encoder.set_output_array(out);
    encoder.dispatch([gate = mx::array::unsafe_weak_copy(gate), up = mx::array::unsafe_weak_copy(up),
                      out = mx::array::unsafe_weak_copy(out)]() mutable {
      std::vector<float> gate_copy, up_copy;
      const float* g = rows_of(gate, gate_copy);
      const float* u = rows_of(up, up_copy);
      in_pieces((out.size() + kPieceElements - 1) / kPieceElements, [&](int p) {
        const size_t i0 = p * kPieceElements, n = std::min(out.size() - i0, kPieceElements);
        swiglu_avx2(g + i0, u + i0, out.data<float>() + i0, n);
      });
    });
  }

  const char* name() const override { return "MlxchatSwiglu"; }

  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

class NativeAttention : public CpuOp {
 public:
  NativeAttention(mx::Stream stream, float scale, bool causal)
      : CpuOp(stream), scale_(scale), causal_(causal) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    encoder.dispatch([q = mx::array::unsafe_weak_copy(inputs[0]), k = mx::array::unsafe_weak_copy(inputs[1]),
                      v = mx::array::unsafe_weak_copy(inputs[2]), out = mx::array::unsafe_weak_copy(out),
                      scale = scale_, causal = causal_]() mutable {
      std::vector<float> q_copy, k_copy, v_copy;
      AttentionArgs a{};
      a.q = rows_along_d(q, q_copy, a.q_stride);
      a.k = rows_along_d(k, k_copy, a.k_stride);
      a.v = rows_along_d(v, v_copy, a.v_stride);
      a.out = out.data<float>();
      a.B = q.shape(0), a.H = q.shape(1), a.KVH = k.shape(1), a.L = q.shape(2), a.S = k.shape(2), a.D = q.shape(3);
      a.scale = scale, a.causal = causal;
      attention_avx2(a);
    });
  }

  const char* name() const override { return "MlxchatAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const NativeAttention&>(other);
    return scale_ == o.scale_ && causal_ == o.causal_;
  }

 private:
  // A 4-D array's data with rows contiguous along the last axis, and the strides (in floats) of its first three axes:
  // the array itself when its last stride is 1, else a dense copy.
  static const float* rows_along_d(const mx::array& x, std::vector<float>& copy, int64_t* stride) {
    if (x.strides()[3] == 1) {
      for (int d = 0; d < 3; ++d) stride[d] = x.strides()[d];
      return x.data<float>();
    }
    const float* dense_rows = rows_of(x, copy);
    stride[2] = x.shape(3), stride[1] = stride[2] * x.shape(2), stride[0] = stride[1] * x.shape(1);
    return dense_rows;
  }

  float scale_;
  bool causal_;
};

}  // namespace

mx::array attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale, bool causal) {
  check_float32(q, "q");
  check_float32(k, "k");
  check_float32(v, "v");
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4) throw std::invalid_argument("q, k and v must be 4-D");
  if (k.shape() != v.shape() || q.shape(0) != k.shape(0) || q.shape(3) != k.shape(3)) {
    throw std::invalid_argument("k and v must have one shape [B, H_kv, S, D] matching q's B and D");
  }
  if (k.shape(1) < 1 || q.shape(1) % k.shape(1)) {
    throw std::invalid_argument("q's heads must be a multiple of k's heads");
  }
  if (causal && q.shape(2) > k.shape(2)) {
    throw std::invalid_argument("causal attention needs at least as many keys as queries");
  }
  return mx::array(q.shape(), mx::float32, std::make_shared<NativeAttention>(cpu_stream(), scale, causal), {q, k, v});
}

mx::array softmax(const mx::array& x, float scale, bool causal) {
  check_float32(x, "x");
  if (x.ndim() < 1 || x.shape(-1) < 1) throw std::invalid_argument("x must have a non-empty last axis");
  if (causal && x.ndim() >= 2 && x.shape(-2) > x.shape(-1)) {
    throw std::invalid_argument("a causal softmax needs at least as many keys (last axis) as queries (second-last)");
  }
  return mx::array(x.shape(), mx::float32, std::make_shared<NativeSoftmax>(cpu_stream(), scale, causal), {x});
}

mx::array swiglu(const mx::array& gate, const mx::array& up) {
  check_float32(gate, "gate");
  check_float32(up, "up");
  if (gate.shape() != up.shape()) throw std::invalid_argument("gate and up must have the same shape");
  return mx::array(gate.shape(), mx::float32, std::make_shared<NativeSwiglu>(cpu_stream()), {gate, up});
}

}  // namespace mlxchat
