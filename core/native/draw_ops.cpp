#include "draw_ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
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
      // One pair of words per row of the output; ids of one row are shared by every row.
      const size_t rows = words.size() / 2, n = out.size() / rows;
      const bool shared = ids.size() == n;
      for (size_t r = 0; r < rows; ++r) {
        const uint32_t* id = ids.data<uint32_t>() + (shared ? 0 : r * n);
        const uint32_t w0 = words.data<uint32_t>()[2 * r], w1 = words.data<uint32_t>()[2 * r + 1];
        float* u = out.data<float>() + r * n;
        for (size_t i = 0; i < n; ++i) {
          const uint32_t h = fmix32(fmix32(id[i] ^ w0) ^ w1);
          u[i] = (float(h >> 9) + 0.5f) * (1.0f / float(1 << 23));
        }
      }
    });
  }

  const char* name() const override { return "MlxchatUniform"; }

  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

// core/sampling/draw.py's Gumbel-max draw, argmax(logit - log(-log(u))) along each row, in one pass: the noise of a masked
// (-inf) token is never made, since its score is -inf whatever the noise (after top-p, nearly the whole vocabulary).
// The ops are MLX's on this backend (its CPU log is std::log in float, glibc's logf, the same function this calls; an
// exact subtraction; MLX's argmax: the first maximum, a NaN before anything), so the position is MLX's to the bit
// (tests/test_native.py compares it with MLX's graph).
class NativeGumbel : public CpuOp {
 public:
  using CpuOp::CpuOp;

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const auto &x = inputs[0], &ids = inputs[1], &words = inputs[2];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    encoder.dispatch([x = mx::array::unsafe_weak_copy(x), ids = mx::array::unsafe_weak_copy(ids),
                      words = mx::array::unsafe_weak_copy(words), out = mx::array::unsafe_weak_copy(out)]() mutable {
      thread_local std::vector<float> copy;
      const float* in = rows_of(x, copy);
      const size_t n = x.shape(-1), rows = x.size() / n;
      const bool shared_ids = ids.size() == n, shared_words = words.size() == 2;
      for (size_t r = 0; r < rows; ++r) {
        const float* row = in + r * n;
        const uint32_t* id = ids.data<uint32_t>() + (shared_ids ? 0 : r * n);
        const uint32_t* w = words.data<uint32_t>() + (shared_words ? 0 : 2 * r);
        float best = -std::numeric_limits<float>::infinity();
        uint32_t at = 0;
        for (size_t i = 0; i < n; ++i) {
          if (row[i] == -std::numeric_limits<float>::infinity()) continue;
          const uint32_t h = fmix32(fmix32(id[i] ^ w[0]) ^ w[1]);
          const float u = (float(h >> 9) + 0.5f) * (1.0f / float(1 << 23));
          const float score = row[i] - std::log(-std::log(u));
          if (score > best || (std::isnan(score) && !std::isnan(best))) {
            best = score;
            at = uint32_t(i);
          }
        }
        out.data<uint32_t>()[r] = at;
      }
    });
  }

  const char* name() const override { return "MlxchatGumbel"; }

  bool is_equivalent(const mx::Primitive&) const override { return true; }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape shape = inputs[0].shape();
    shape.pop_back();
    return {shape};
  }
};

// The repeat length that emitting each token would extend (llama.cpp's llama_sampler_dry_apply, steps 1-3, on a
// plain vector: h[n - 1 - i] is its ring buffer's rat(i)). Tokens absent from `out` extend nothing.
void dry_repeats(const int32_t* h, int n, const DryBreakers::Map& breakers, int allowed,
                 std::unordered_map<int32_t, int>& out, std::vector<int>& count) {
  out.clear();
  if (n <= allowed) return;
  auto rat = [&](int i) { return h[n - 1 - i]; };
  // Step 1: the most recent complete sequence breaker limits how far back a repeat may reach.
  int rep_limit = n;
  for (int i = 0; i < n; ++i) {
    auto range = breakers.equal_range(rat(i));
    if (range.first == range.second) continue;
    int longest = -1;
    for (auto it = range.first; it != range.second; ++it) {
      const int len = int(it->second.size());
      if (len > longest && len <= i) {
        bool match = true;
        for (int o = 0; o < len && match; ++o) match = it->second[o] == rat(i - o - 1);
        if (match) longest = len;
      }
    }
    if (longest >= 0) {
      rep_limit = i - longest;
      break;
    }
  }
  if (rep_limit < allowed) return;
  // Step 2: the reversed Z-algorithm: count[n - 1 - k] = the length of the history's suffix that also ends k tokens
  // earlier, capped at rep_limit.
  count.assign(n, 0);
  const int last = n - 1;
  int rt = 0, lt = 0;
  for (int k = 1; k < n; ++k) {
    if (k > rt) {
      int len = 0;
      while (len + k < n && rat(len) == rat(len + k)) ++len;
      count[last - k] = std::min(len, rep_limit);
      if (len > 0) {
        lt = k;
        rt = k + len - 1;
      }
    } else {
      const int p = k - lt, right = rt - k + 1;
      if (count[last - p] < right) {
        count[last - k] = std::min(count[last - p], rep_limit);
      } else {
        int i = rt + 1;
        while (i < n && rat(i) == rat(i - k)) ++i;
        count[last - k] = std::min(i - k, rep_limit);
        lt = k;
        rt = i - 1;
      }
    }
  }
  // Step 3: the token after each long enough repeat would extend it; keep the longest per token.
  for (int i = 0; i < n - 1; ++i) {
    const int len = count[i];
    if (len >= allowed) {
      const int32_t token = rat(n - 2 - i);
      auto it = out.find(token);
      if (it == out.end() || it->second < len) out[token] = len;
    }
  }
}

class NativeDry : public CpuOp {
 public:
  NativeDry(mx::Stream stream, std::shared_ptr<const DryBreakers::Map> breakers, float multiplier, float base,
            int allowed)
      : CpuOp(stream), breakers_(std::move(breakers)), multiplier_(multiplier), base_(base), allowed_(allowed) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const auto &logits = inputs[0], &history = inputs[1];
    allocate_output(logits, out);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(logits);
    encoder.set_input_array(history);
    encoder.set_output_array(out);
    encoder.dispatch([logits = mx::array::unsafe_weak_copy(logits), history = mx::array::unsafe_weak_copy(history),
                      out = mx::array::unsafe_weak_copy(out), breakers = breakers_, multiplier = multiplier_,
                      base = base_, allowed = allowed_]() mutable {
      thread_local std::unordered_map<int32_t, int> repeats;
      thread_local std::vector<int> count;
      const size_t V = logits.size();
      float* y = out.data<float>();
      if (y != logits.data<float>()) std::copy(logits.data<float>(), logits.data<float>() + V, y);
      dry_repeats(history.data<int32_t>(), int(history.size()), *breakers, allowed, repeats, count);
      // llama.cpp's step 4: the exponent is clamped so that base^exponent stays below float's maximum.
      const float kFloatMaxLog = 88.7228391f;
      int max_exponent = 0;
      if (base > 1.000001f) max_exponent = int(kFloatMaxLog / std::log(base));
      for (const auto& [token, len] : repeats) {
        if (token < 0 || size_t(token) >= V) continue;
        auto range = breakers->equal_range(token);
        bool single_breaker = false;
        for (auto it = range.first; it != range.second && !single_breaker; ++it) single_breaker = it->second.empty();
        if (single_breaker) continue;
        int exponent = len - allowed;
        if (max_exponent > 0 && exponent > max_exponent) exponent = max_exponent;
        const float penalty = multiplier * std::pow(base, exponent);
        y[token] -= penalty;
      }
    });
  }

  const char* name() const override { return "MlxchatDry"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const NativeDry&>(other);
    return breakers_ == o.breakers_ && multiplier_ == o.multiplier_ && base_ == o.base_ && allowed_ == o.allowed_;
  }

 private:
  std::shared_ptr<const DryBreakers::Map> breakers_;
  float multiplier_, base_;
  int allowed_;
};

// The token penalties (repetition, frequency, presence, in llama.cpp's order) at the history's ids: each id's logit
// from its own count, the rest copied. MLX composed them as ~20 nodes (two gathers, the three shifts' selects and
// arithmetic, a scatter) in every sampled decode step. The arithmetic is core/sampling/chain.py's, operation for operation
// (no FMA: the file builds with -ffp-contract=off), so a logit is the same bits on either path.
class NativePenalties : public CpuOp {
 public:
  NativePenalties(mx::Stream stream, float repetition, float frequency, float presence)
      : CpuOp(stream), repetition_(repetition), frequency_(frequency), presence_(presence) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const auto &logits = inputs[0], &ids = inputs[1], &counts = inputs[2];
    out.set_data(mx::allocator::malloc(out.nbytes()));  // not the logits' buffer: an id repeats in the history
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(logits);
    encoder.set_input_array(ids);
    encoder.set_input_array(counts);
    encoder.set_output_array(out);
    encoder.dispatch([logits = mx::array::unsafe_weak_copy(logits), ids = mx::array::unsafe_weak_copy(ids),
                      counts = mx::array::unsafe_weak_copy(counts), out = mx::array::unsafe_weak_copy(out),
                      r = repetition_, f = frequency_, p = presence_]() mutable {
      const size_t V = logits.size();
      const float *x = logits.data<float>(), *c = counts.data<float>();
      float* y = out.data<float>();
      std::copy(x, x + V, y);
      const int32_t* id = ids.data<int32_t>();
      for (size_t i = 0; i < ids.size(); ++i) {
        const int32_t t = id[i];
        if (t < 0 || size_t(t) >= V) continue;
        const float n = c[t];
        float v = x[t];
        if (n > 0) v = v > 0 ? v / r : v * r;
        v = v - f * n;
        v = v - (n > 0 ? p : 0.0f);
        y[t] = v;
      }
    });
  }

  const char* name() const override { return "MlxchatPenalties"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const NativePenalties&>(other);
    return repetition_ == o.repetition_ && frequency_ == o.frequency_ && presence_ == o.presence_;
  }

 private:
  float repetition_, frequency_, presence_;
};

}  // namespace

DryBreakers::DryBreakers(const std::vector<int32_t>& heads, const std::vector<int32_t>& offsets,
                         const std::vector<int32_t>& tails) {
  if (offsets.size() != heads.size() + 1 || (!offsets.empty() && size_t(offsets.back()) != tails.size())) {
    throw std::invalid_argument("DryBreakers needs offsets of len(heads) + 1 ending at len(tails)");
  }
  auto built = std::make_shared<Map>();
  for (size_t i = 0; i < heads.size(); ++i) {
    built->emplace(heads[i], std::vector<int32_t>(tails.begin() + offsets[i], tails.begin() + offsets[i + 1]));
  }
  map = std::move(built);
}

mx::array dry_penalty(const mx::array& logits, const mx::array& history, const DryBreakers& breakers,
                      float multiplier, float base, int allowed_length) {
  check_float32(logits, "logits");
  if (logits.ndim() != 1 || history.ndim() != 1 || history.dtype() != mx::int32) {
    throw std::invalid_argument("dry_penalty needs float32 logits [V] and int32 history ids [n]");
  }
  auto s = cpu_stream();
  return mx::array(logits.shape(), mx::float32,
                   std::make_shared<NativeDry>(s, breakers.map, multiplier, base, allowed_length),
                   {dense(logits, s), dense(history, s)});
}

mx::array penalties(const mx::array& logits, const mx::array& ids, const mx::array& counts, float repetition,
                    float frequency, float presence) {
  check_float32(logits, "logits");
  check_float32(counts, "counts");
  if (logits.ndim() != 1 || counts.shape() != logits.shape() || ids.ndim() != 1 || ids.dtype() != mx::int32) {
    throw std::invalid_argument("penalties needs float32 logits [V], int32 ids [n] and float32 counts [V]");
  }
  auto s = cpu_stream();
  return mx::array(logits.shape(), mx::float32, std::make_shared<NativePenalties>(s, repetition, frequency, presence),
                   {dense(logits, s), dense(ids, s), dense(counts, s)});
}

mx::array uniform_at(const mx::array& ids, const mx::array& words) {
  if (ids.dtype() != mx::uint32 || words.dtype() != mx::uint32 || words.ndim() < 1 || words.ndim() > 2 ||
      words.shape(-1) != 2) {
    throw std::invalid_argument("uniform_at needs uint32 ids and two uint32 words (or [rows, 2])");
  }
  mx::Shape shape = ids.shape();
  if (words.ndim() == 2) {  // a batch's rows, each keyed by its own words
    const int rows = words.shape(0);
    if (ids.ndim() == 1) {
      shape = {rows, ids.shape(0)};
    } else if (ids.ndim() != 2 || ids.shape(0) != rows) {
      throw std::invalid_argument("uniform_at with words [rows, 2] needs ids [n] or [rows, n]");
    }
  }
  auto s = cpu_stream();
  return mx::array(shape, mx::float32, std::make_shared<NativeUniform>(s), {dense(ids, s), dense(words, s)});
}

mx::array gumbel_argmax(const mx::array& logits, const mx::array& ids, const mx::array& words) {
  check_float32(logits, "logits");
  if (logits.ndim() < 1 || logits.shape(-1) < 1) throw std::invalid_argument("logits must have a non-empty last axis");
  const size_t n = logits.shape(-1), rows = logits.size() / n;
  if (ids.dtype() != mx::uint32 || words.dtype() != mx::uint32 || (ids.size() != n && ids.size() != rows * n) ||
      (words.size() != 2 && words.size() != 2 * rows)) {
    throw std::invalid_argument("gumbel_argmax needs uint32 ids [n] or one row per logits row, and uint32 words [2] "
                                "or [rows, 2]");
  }
  mx::Shape shape = logits.shape();
  shape.pop_back();
  auto s = cpu_stream();
  return mx::array(shape, mx::uint32, std::make_shared<NativeGumbel>(s), {dense(logits, s), dense(ids, s),
                                                                          dense(words, s)});
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
