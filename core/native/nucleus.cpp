#include "nucleus.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <utility>
#include <vector>

#include "graph.h"
#include "kernel.h"
#include "mlx/backend/cpu/encoder.h"

namespace mlxchat {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Candidate {
  double key;   // the rank: smaller is better
  double mass;  // exp(logit - max), unnormalised
  float logit;
  int32_t index;
};

// A row's working memory, kept across calls: a decode step runs the op once per token on vocabulary-sized rows.
struct RowScratch {
  std::vector<float> copy, e;
  std::vector<uint16_t> bucket;
  std::vector<Candidate> candidates;
};

// How a row's tokens are ranked, smallest key first: by logit, largest first (top-p: key = max - x), or by
// |surprisal - entropy| (typical-p). With s = x - max and Z = sum exp(s), surprisal = log Z - s and entropy =
// log Z - E[s], so the distance is |x - (max + E[s])|, which needs no logarithm and keeps the precision log Z would
// cancel. In double, as bucket_row_avx2 computes it, so that both agree to the bit.
struct Ranking {
  bool typical;
  double center;  // max, or max + E[s]

  double key(float x) const {
    const double d = double(x) - center;
    return typical ? std::abs(d) : -d;
  }
};

// Equal spans of the key range: enough that the cut's bucket holds under a hundred of a 49k vocabulary's tokens (unless
// one far outlier stretches the range; the selection in cut_key keeps that case exact, only slower).
constexpr int kBuckets = 2048;

// The bucket the cut falls in: the first that holds a token and whose mass, with that of the buckets before it,
// reaches `target`; and the mass of the buckets before it, all of whose tokens are kept (the mass ahead of each is
// below the target). `last` is the largest bucket that holds a token: the total can fall short of the target by
// rounding (p near 1), and then the cut is there, keeping everything.
std::pair<int, double> cut_bucket(const uint16_t* bucket, const float* e, size_t n, int last, double target) {
  struct Bin {
    double mass;
    size_t count;
  };
  thread_local std::vector<Bin> bins;
  bins.assign(kBuckets + 1, Bin{0.0, 0});  // the extra one gathers the -inf tokens
  for (size_t i = 0; i < n; ++i) {
    Bin& bin = bins[bucket[i]];
    bin.mass += e[i];
    ++bin.count;
  }
  double before = 0.0;
  int b = 0;
  for (; b < last && (bins[b].count == 0 || before + bins[b].mass < target); ++b) before += bins[b].mass;
  return {b, before};
}

// The largest key kept, among the candidates of the cut's bucket: in key order, a candidate is kept while the mass
// ahead of it (`before`, then the candidates ahead of it) is below `target`. Selection (nth_element) brings the
// kFirst, 4 kFirst, ... best to the front until they reach the target, and only that prefix is sorted. Candidates
// ranked equal may straddle the prefix's end: the caller keeps every token whose key is at most the cut, so all of
// them.
constexpr size_t kFirst = 64;

double cut_key(std::vector<Candidate>& c, double before, double target) {
  auto by_key = [](const Candidate& a, const Candidate& b) { return a.key < b.key; };
  size_t done = 0, k = std::min(c.size(), kFirst);
  double mass = before;
  for (;;) {
    if (k < c.size()) std::nth_element(c.begin() + done, c.begin() + k, c.end(), by_key);
    for (; done < k; ++done) mass += c[done].mass;
    if (mass >= target || k == c.size()) break;
    k = std::min(c.size(), k * 4);
  }
  std::sort(c.begin(), c.begin() + done, by_key);
  double cut = c[0].key;  // the cut's bucket holds a token ahead of which the mass is below the target
  for (size_t i = 0; i < done && before < target; ++i) {
    cut = c[i].key;
    before += c[i].mass;
  }
  return cut;
}

// A histogram of the mass over kBuckets equal spans of the key range locates the cut in one bucket, and only that
// bucket's tokens (usually a handful) are ranked exactly: no step sorts, or even selects over, the whole vocabulary,
// however many tokens it keeps. Tokens of earlier buckets are kept, of later ones dropped.
void nucleus_row(const float* x, float* out, size_t n, double p, bool typical, RowScratch& scratch) {
  std::vector<float>& e = scratch.e;
  std::vector<uint16_t>& bucket = scratch.bucket;
  std::vector<Candidate>& c = scratch.candidates;
  e.resize(n);
  bucket.resize(n);
  const ExpRow row = exp_row_avx2(x, e.data(), n, typical);
  if (!(row.max > kNegInf)) {  // nothing finite: nothing to keep
    std::fill(out, out + n, kNegInf);
    return;
  }
  const Ranking rank{typical, double(row.max) + (typical ? row.weighted / row.sum : 0.0)};
  const double hi = std::max(rank.key(row.max), rank.key(row.min));  // the largest key, a token's own
  const double scale = hi > 0 ? kBuckets / hi : 0.0;
  bucket_row_avx2(x, n, typical, rank.center, scale, kBuckets, bucket.data());
  const int last = int(std::min<int64_t>(kBuckets - 1, int64_t(hi * scale)));
  const double target = p * row.sum;
  const auto [b, before] = cut_bucket(bucket.data(), e.data(), n, last, target);
  c.clear();
  // In blocks, so that the scan (nearly always finding nothing) vectorises.
  constexpr size_t kBlock = 64;
  for (size_t i0 = 0; i0 < n; i0 += kBlock) {
    const size_t i1 = std::min(n, i0 + kBlock);
    bool any = false;
    for (size_t i = i0; i < i1; ++i) any |= bucket[i] == b;
    if (!any) continue;
    for (size_t i = i0; i < i1; ++i) {
      if (bucket[i] == b) c.push_back({rank.key(x[i]), e[i], x[i], int32_t(i)});
    }
  }
  const double cut = cut_key(c, before, target);
  keep_below_avx2(x, bucket.data(), b, out, n);  // then the cut's bucket (out may be x: the candidates hold its logits)
  for (const Candidate& t : c) out[t.index] = t.key <= cut ? t.logit : kNegInf;
}

class NativeNucleus : public CpuOp {
 public:
  NativeNucleus(mx::Stream stream, std::vector<double> p, bool typical)
      : CpuOp(stream), p_(std::move(p)), typical_(typical) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const auto& x = inputs[0];
    allocate_output(x, out);  // each row is read before its own entries are written
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_output_array(out);
    encoder.dispatch([x = mx::array::unsafe_weak_copy(x), out = mx::array::unsafe_weak_copy(out), p = p_,
                      typical = typical_]() mutable {
      thread_local RowScratch scratch;
      const float* in = rows_of(x, scratch.copy);
      const size_t V = x.shape(-1);
      for (size_t r = 0; r < x.size() / V; ++r) {
        nucleus_row(in + r * V, out.data<float>() + r * V, V, p.size() == 1 ? p[0] : p[r], typical, scratch);
      }
    });
  }

  const char* name() const override { return "MlxchatNucleus"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const NativeNucleus&>(other);
    return p_ == o.p_ && typical_ == o.typical_;
  }

 private:
  std::vector<double> p_;  // one for every row, or one per row
  bool typical_;
};

}  // namespace

mx::array nucleus(const mx::array& logits, const std::vector<double>& p, bool typical) {
  check_float32(logits, "logits");
  if (logits.ndim() < 1 || logits.shape(-1) < 1) throw std::invalid_argument("logits must have a non-empty last axis");
  const size_t rows = logits.size() / logits.shape(-1);
  if (p.size() != 1 && p.size() != rows) throw std::invalid_argument("p must be one number, or one per row");
  for (double q : p) {
    if (!(q >= 0.0)) throw std::invalid_argument("p must be a number >= 0");
  }
  return mx::array(logits.shape(), mx::float32, std::make_shared<NativeNucleus>(cpu_stream(), p, typical), {logits});
}

}  // namespace mlxchat
