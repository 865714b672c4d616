#include "layer.h"

#include <cmath>
#include <cstring>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <utility>

#include "graph.h"
#include "kernel.h"
#include "mlx/backend/cpu/encoder.h"

namespace mlxchat {

namespace {

constexpr int kProjections = 7;  // q, k, v, o, gate, up, down
constexpr int kFirstProjection = 6;  // inputs before the projections: h, keys, values, two norm weights, inv_freqs

// out = (x * rsqrt(mean(x^2) + eps)) * w per row, in the order of operations of mx.fast.rms_norm's CPU fallback
// (its sum of squares may round differently: logits move by ~1e-5).
void rms_norm_rows(const float* x, const float* w, float* out, int rows, int D, float eps) {
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + size_t(r) * D;
    float sum = 0.0f;
    for (int d = 0; d < D; ++d) sum += xr[d] * xr[d];
    const float inv = 1.0f / std::sqrt(sum * (1.0f / D) + eps);
    for (int d = 0; d < D; ++d) out[size_t(r) * D + d] = (xr[d] * inv) * w[d];
  }
}

// mx.fast.rope's CPU computation (its fallback) on rows [L, heads * head_dim] at positions offset .. offset + L - 1.
void rope_rows(float* x, int L, int heads, int head_dim, const LayerShape& s, const float* inv_freqs, int offset) {
  const int half = s.rope_dims / 2;
  for (int i = 0; i < L; ++i) {
    const float position = (float(i) + float(offset)) * s.rope_scale;
    for (int j = 0; j < half; ++j) {
      const float theta = position * inv_freqs[j];
      const float c = std::cos(theta), sn = std::sin(theta);
      for (int h = 0; h < heads; ++h) {
        float* row = x + (size_t(i) * heads + h) * head_dim;
        const int a = s.rope_traditional ? 2 * j : j, b = s.rope_traditional ? 2 * j + 1 : j + half;
        const float x1 = row[a], x2 = row[b];
        row[a] = x1 * c - x2 * sn;
        row[b] = x1 * sn + x2 * c;
      }
    }
  }
}

// A cache buffer as the output: the input's own memory when nothing else holds it (an in-place append, as MLX's
// SliceUpdate does; returns false), else fresh memory that the task fills with a copy of the input (returns true;
// the copy must wait for the task, as the input may be the result of a task queued before this one).
bool take_cache(const mx::array& in, mx::array& out) {
  if (in.flags().row_contiguous && in.is_donatable()) {
    out.copy_shared_buffer(in);
    return false;
  }
  out.set_data(mx::allocator::malloc(out.nbytes()));
  return true;
}

void copy_cache(const mx::array& in, mx::array& out) {
  std::vector<float> copy;
  std::memcpy(out.data<float>(), rows_of(in, copy), out.nbytes());
}

class NativeDecoderLayer : public mx::Primitive {
 public:
  NativeDecoderLayer(mx::Stream stream, std::shared_ptr<const LayerData> layer, int offset, bool causal)
      : mx::Primitive(stream), layer_(std::move(layer)), offset_(offset), causal_(causal) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    outputs[0].set_data(mx::allocator::malloc(outputs[0].nbytes()));
    // Each output holds a copy of the op's inputs until MLX detaches them after this eval; the siblings' copies
    // would count as holders of the cache buffers (is_donatable counts them) and force a copy every step. All inputs
    // are evaluated by now, so the siblings can let go early; `inputs` itself (the evaluated output's) is kept.
    for (auto& o : outputs) {
      if (&o.inputs() != &inputs) o.inputs().clear();
    }
    const bool copy_keys = take_cache(inputs[1], outputs[1]), copy_values = take_cache(inputs[2], outputs[2]);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) encoder.set_input_array(a);
    for (auto& a : outputs) encoder.set_output_array(a);
    std::vector<mx::array> in, out;
    for (auto& a : inputs) in.push_back(mx::array::unsafe_weak_copy(a));
    for (auto& a : outputs) out.push_back(mx::array::unsafe_weak_copy(a));
    encoder.dispatch([in = std::move(in), out = std::move(out), layer = layer_, offset = offset_, causal = causal_,
                      copy_keys, copy_values]() mutable {
      if (copy_keys) copy_cache(in[1], out[1]);
      if (copy_values) copy_cache(in[2], out[2]);
      run(in, out, *layer, offset, causal);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mlxchat's fused decoder layer runs on the CPU only");
  }

  const char* name() const override { return "MlxchatDecoderLayer"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const NativeDecoderLayer&>(other);
    return layer_ == o.layer_ && offset_ == o.offset_ && causal_ == o.causal_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape(), inputs[1].shape(), inputs[2].shape()};
  }

 private:
  // Inputs: h, keys, values, the two norm weights, inv_freqs, then the 7 projections' (w, scales, biases), the
  // optional q/k/v biases, the q/k norm weights when shape.qk_norm, and last the rows' left padding (int32 [B]).
  static void run(const std::vector<mx::array>& in, std::vector<mx::array>& out, const LayerData& layer,
                  int offset, bool causal) {
    const LayerShape& s = layer.shape;
    const std::vector<int>&gs = layer.group_sizes, &bits = layer.bits, &packed = layer.packed;
    const mx::array& h = in[0];
    const int B = h.shape(0), L = h.shape(1), D = h.shape(2), M = B * L;
    const int H = s.n_heads, KVH = s.n_kv_heads, hd = s.head_dim;
    const int C = out[1].shape(2), I = in[kFirstProjection + 3 * 4].shape(0);  // cache capacity, MLP width
    const int32_t* padding = in.back().data<int32_t>();
    // Projections that read the same rows (q/k/v, gate/up) run as one job.
    auto matmul = [&](std::initializer_list<std::pair<int, float*>> projections, const float* x, int M) {
      std::vector<RowsTarget> targets;
      for (auto [p, y] : projections) {
        const int i = kFirstProjection + 3 * p;
        targets.push_back(RowsTarget{&in[i], &in[i + 1], &in[i + 2], gs[p], bits[p], packed[p] != 0, layer.int8, y});
      }
      quantized_matmul_rows(x, M, targets);
    };
    std::vector<float> h_copy;
    const float* x = rows_of(h, h_copy);

    // Attention: norm, projections (all B * L rows at once: each weight is read once a step), RoPE, the cache append,
    // each row's attention over its own positions (from its left padding to offset + L), o_proj, residual.
    std::vector<float> xn(size_t(M) * D), q(size_t(M) * H * hd), k(size_t(M) * KVH * hd), v(k.size());
    rms_norm_rows(x, in[3].data<float>(), xn.data(), M, D, s.norm_eps);
    matmul({{0, q.data()}, {1, k.data()}, {2, v.data()}}, xn.data(), M);
    const size_t qk_norms = s.qk_norm ? 2 : 0;
    // q, k and v biases (qwen2), added as MLX adds them
    if (in.size() > kFirstProjection + 3 * kProjections + 1 + qk_norms) {
      float* rows[3] = {q.data(), k.data(), v.data()};
      for (int p = 0; p < 3; ++p) {
        const mx::array& bias = in[kFirstProjection + 3 * kProjections + p];
        const float* b = bias.data<float>();
        const int N = bias.shape(0);
        for (int i = 0; i < M; ++i) {
          for (int j = 0; j < N; ++j) rows[p][size_t(i) * N + j] += b[j];
        }
      }
    }
    if (s.qk_norm) {  // qwen3: each head's q and k normed (as mx.fast.rms_norm over head_dim), before RoPE
      const size_t first = in.size() - 3;
      rms_norm_rows(q.data(), in[first].data<float>(), q.data(), M * H, hd, s.norm_eps);
      rms_norm_rows(k.data(), in[first + 1].data<float>(), k.data(), M * KVH, hd, s.norm_eps);
    }
    float* keys = out[1].data<float>();
    float* values = out[2].data<float>();
    const float* inv_freqs = in[5].data<float>();
    for (int r = 0; r < B; ++r) {
      // Row r's positions count from its first real token (mlx-lm's BatchKVCache: offset - left padding).
      const int position = offset - padding[r];
      float* qr = q.data() + size_t(r) * L * H * hd;
      float* kr = k.data() + size_t(r) * L * KVH * hd;
      const float* vr = v.data() + size_t(r) * L * KVH * hd;
      rope_rows(qr, L, H, hd, s, inv_freqs, position);
      rope_rows(kr, L, KVH, hd, s, inv_freqs, position);
      float* row_keys = keys + size_t(r) * KVH * C * hd;
      float* row_values = values + size_t(r) * KVH * C * hd;
      for (int i = 0; i < L; ++i) {
        for (int g = 0; g < KVH; ++g) {
          const size_t to = (size_t(g) * C + offset + i) * hd, from = (size_t(i) * KVH + g) * hd;
          std::memcpy(row_keys + to, kr + from, hd * sizeof(float));
          std::memcpy(row_values + to, vr + from, hd * sizeof(float));
        }
      }
    }
    // Attention per (row, key/value head): independent pieces for the pool, as the matmuls are. Alone on the stream's
    // thread it was ~0.3 ms of each row's step (300 positions) while the second core polled.
    std::vector<float> heads(size_t(B) * H * L * hd);  // each row's [H, L, hd]
    const int rep = H / KVH;
    parallel_pieces(B * KVH, [&](int item) {
      const int r = item / KVH, g = item % KVH, first = padding[r];
      AttentionArgs a{};
      a.q = q.data() + size_t(r) * L * H * hd + size_t(g) * rep * hd;
      a.q_stride[0] = 0, a.q_stride[1] = hd, a.q_stride[2] = int64_t(H) * hd;
      const size_t kv = size_t(r) * KVH * C * hd + (size_t(g) * C + first) * hd;
      a.k = keys + kv, a.v = values + kv;
      a.k_stride[0] = a.v_stride[0] = int64_t(KVH) * C * hd;
      a.k_stride[1] = a.v_stride[1] = int64_t(C) * hd;
      a.k_stride[2] = a.v_stride[2] = hd;
      a.out = heads.data() + (size_t(r) * H + size_t(g) * rep) * L * hd;
      a.B = 1, a.H = rep, a.KVH = 1, a.L = L, a.S = offset + L - first, a.D = hd, a.scale = s.attention_scale;
      a.causal = causal;
      layer_attention(a);
    });
    for (int r = 0; r < B; ++r) {  // [H, L, hd] -> [L, H * hd], o_proj's input rows
      float* qr = q.data() + size_t(r) * L * H * hd;
      const float* hr = heads.data() + size_t(r) * H * L * hd;
      for (int i = 0; i < L; ++i) {
        for (int hh = 0; hh < H; ++hh) {
          std::memcpy(qr + (size_t(i) * H + hh) * hd, hr + (size_t(hh) * L + i) * hd, hd * sizeof(float));
        }
      }
    }
    std::vector<float> h1(size_t(M) * D);
    matmul({{3, h1.data()}}, q.data(), M);
    for (size_t j = 0; j < h1.size(); ++j) h1[j] = x[j] + h1[j];

    // MLP: norm, gate/up, SwiGLU, down, residual.
    rms_norm_rows(h1.data(), in[4].data<float>(), xn.data(), M, D, s.norm_eps);
    std::vector<float> gate(size_t(M) * I), up(gate.size());
    matmul({{4, gate.data()}, {5, up.data()}}, xn.data(), M);
    swiglu_avx2(gate.data(), up.data(), gate.data(), gate.size());
    float* y = out[0].data<float>();
    matmul({{6, y}}, gate.data(), M);
    for (size_t j = 0; j < h1.size(); ++j) y[j] = h1[j] + y[j];
  }

  std::shared_ptr<const LayerData> layer_;
  int offset_;
  bool causal_;
};

}  // namespace

mx::array rope_inv_freqs(int dims, float base) {
  const int half = dims / 2;
  auto s = cpu_stream();
  return mx::exp(mx::multiply(mx::arange(0, -half, -1, mx::float32, s), mx::array(std::log(base) / half, mx::float32),
                              s),
                 s);
}

LayerWeights layer_weights(const std::vector<mx::array>& weights, const std::vector<int>& group_sizes,
                           const std::vector<int>& bits, const std::vector<int>& packed, bool int8,
                           const LayerShape& shape) {
  const size_t plain = 3 + 3 * kProjections, qk_norms = shape.qk_norm ? 2 : 0;
  if ((weights.size() != plain + qk_norms && weights.size() != plain + 3 + qk_norms) ||
      group_sizes.size() != kProjections || bits.size() != kProjections || packed.size() != kProjections) {
    throw std::invalid_argument("decoder_layer needs 2 norm weights, inv_freqs, 7 (w, scales, biases) triples, "
                                "optionally the q, k and v biases, and the q and k norm weights when qk_norm");
  }
  if (shape.rope_dims > shape.head_dim || shape.rope_dims % 2) {
    throw std::invalid_argument("decoder_layer: rope_dims must be even and at most head_dim");
  }
  auto s = cpu_stream();
  auto layer = std::make_shared<LayerData>(LayerData{{}, group_sizes, bits, packed, int8, shape});
  for (int i = 0; i < 3; ++i) {
    check_float32(weights[i], "norm weights and inv_freqs");
    layer->arrays.push_back(dense(weights[i], s));
  }
  for (int p = 0; p < kProjections; ++p) {
    const auto& w = weights[3 + 3 * p];
    check_weights(w, weights[4 + 3 * p], weights[5 + 3 * p], group_sizes[p], bits[p], packed[p] != 0, int8);
    for (int j = 0; j < 3; ++j) layer->arrays.push_back(dense(weights[3 + 3 * p + j], s));
  }
  const int qkv_rows[3] = {shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim,
                           shape.n_kv_heads * shape.head_dim};
  const size_t biases = weights.size() - qk_norms;
  for (size_t p = 0; plain + p < biases; ++p) {
    const auto& bias = weights[plain + p];
    check_float32(bias, "q/k/v biases");
    if (bias.ndim() != 1 || bias.shape(0) != qkv_rows[p]) {
      throw std::invalid_argument("decoder_layer: the q, k and v biases must match their projections' outputs");
    }
    layer->arrays.push_back(dense(bias, s));
  }
  for (size_t i = biases; i < weights.size(); ++i) {
    check_float32(weights[i], "q/k norm weights");
    if (weights[i].ndim() != 1 || weights[i].shape(0) != shape.head_dim) {
      throw std::invalid_argument("decoder_layer: the q and k norm weights must be [head_dim]");
    }
    layer->arrays.push_back(dense(weights[i], s));
  }
  return LayerWeights{std::move(layer)};
}

std::vector<mx::array> decoder_layer(const mx::array& h, const mx::array& keys, const mx::array& values,
                                     const LayerWeights& layer, int offset, bool causal,
                                     const mx::array& left_padding) {
  check_float32(h, "h");
  check_float32(keys, "keys");
  check_float32(values, "values");
  const LayerShape& shape = layer.data->shape;
  const int B = h.ndim() == 3 ? h.shape(0) : 0, L = h.ndim() == 3 ? h.shape(1) : 0;
  const mx::Shape cache_shape{B, shape.n_kv_heads, keys.ndim() == 4 ? keys.shape(2) : 0, shape.head_dim};
  if (h.ndim() != 3 || keys.shape() != cache_shape || values.shape() != cache_shape || offset < 0 ||
      offset + L > cache_shape[2]) {
    throw std::invalid_argument("decoder_layer: h must be [B, L, D] and keys/values [B, H_kv, C, head_dim] with "
                                "room for L positions after offset");
  }
  if (left_padding.dtype() != mx::int32 || left_padding.shape() != mx::Shape{B}) {
    throw std::invalid_argument("decoder_layer: left_padding must be int32 [B], each row's first position");
  }
  auto s = cpu_stream();
  std::vector<mx::array> inputs{h, keys, values};
  inputs.insert(inputs.end(), layer.data->arrays.begin(), layer.data->arrays.end());
  inputs.push_back(dense(left_padding, s));
  auto shapes = std::vector<mx::Shape>{h.shape(), keys.shape(), values.shape()};
  auto op = std::make_shared<NativeDecoderLayer>(s, layer.data, offset, causal);
  return mx::array::make_arrays(std::move(shapes), {mx::float32, mx::float32, mx::float32}, std::move(op), inputs);
}

}  // namespace mlxchat
