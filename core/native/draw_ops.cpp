#include "draw_ops.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <utility>
#include <vector>

#include "graph.h"
#include "mlx/backend/cpu/encoder.h"

namespace mlxchat {

namespace {

// The k largest of a row as a min-heap of (value, -position): a value enters only when it beats the heap's least,
// which after the first few hundred of a vocabulary is rare, so the pass is one compare a value.
void top_k_row(const float* x, size_t n, int k, uint32_t* out, std::vector<std::pair<float, int64_t>>& heap) {
  heap.clear();
  // (value, -position): larger is better, so among equal values the lower position wins.
  const auto worse = std::greater<std::pair<float, int64_t>>();
  for (size_t i = 0; i < n; ++i) {
    const std::pair<float, int64_t> item{x[i], -int64_t(i)};
    if (heap.size() < size_t(k)) {
      heap.push_back(item);
      std::push_heap(heap.begin(), heap.end(), worse);
    } else if (worse(item, heap.front())) {
      std::pop_heap(heap.begin(), heap.end(), worse);
      heap.back() = item;
      std::push_heap(heap.begin(), heap.end(), worse);
    }
  }
  for (int j = 0; j < k; ++j) out[j] = uint32_t(-heap[j].second);
  std::sort(out, out + k);
}

class NativeTopK : public CpuOp {
 public:
  NativeTopK(mx::Stream stream, int k) : CpuOp(stream), k_(k) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const auto& x = inputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_output_array(out);
    encoder.dispatch([x = mx::array::unsafe_weak_copy(x), out = mx::array::unsafe_weak_copy(out), k = k_]() mutable {
      thread_local std::vector<float> copy;
      thread_local std::vector<std::pair<float, int64_t>> heap;
      const float* in = rows_of(x, copy);
      const size_t V = x.shape(-1);
      for (size_t r = 0; r < x.size() / V; ++r) top_k_row(in + r * V, V, k, out.data<uint32_t>() + r * k, heap);
    });
  }

  const char* name() const override { return "MlxchatTopK"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return k_ == static_cast<const NativeTopK&>(other).k_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape shape = inputs[0].shape();
    shape.back() = k_;
    return {shape};
  }

 private:
  int k_;
};

inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

class NativeUniform : public CpuOp {
 public:
  using CpuOp::CpuOp;

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const auto &ids = inputs[0], &words = inputs[1];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(ids);
    encoder.set_input_array(words);
    encoder.set_output_array(out);
    encoder.dispatch([ids = mx::array::unsafe_weak_copy(ids), words = mx::array::unsafe_weak_copy(words),
                      out = mx::array::unsafe_weak_copy(out)]() mutable {
      const uint32_t* id = ids.data<uint32_t>();
      const uint32_t w0 = words.data<uint32_t>()[0], w1 = words.data<uint32_t>()[1];
      float* u = out.data<float>();
      for (size_t i = 0; i < ids.size(); ++i) {
        const uint32_t h = fmix32(fmix32(id[i] ^ w0) ^ w1);
        u[i] = (float(h >> 9) + 0.5f) * (1.0f / float(1 << 23));
      }
    });
  }

  const char* name() const override { return "MlxchatUniform"; }

  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

}  // namespace

mx::array uniform_at(const mx::array& ids, const mx::array& words) {
  if (ids.dtype() != mx::uint32 || words.dtype() != mx::uint32 || words.shape() != mx::Shape{2}) {
    throw std::invalid_argument("uniform_at needs uint32 ids and two uint32 words");
  }
  auto s = cpu_stream();
  return mx::array(ids.shape(), mx::float32, std::make_shared<NativeUniform>(s), {dense(ids, s), dense(words, s)});
}

mx::array top_k_index(const mx::array& logits, int k) {
  check_float32(logits, "logits");
  if (logits.ndim() < 1 || k < 1 || logits.shape(-1) <= k) {
    throw std::invalid_argument("top_k_index needs 1 <= k < the last axis's length");
  }
  mx::Shape shape = logits.shape();
  shape.back() = k;
  return mx::array(shape, mx::uint32, std::make_shared<NativeTopK>(cpu_stream(), k), {logits});
}

}  // namespace mlxchat
