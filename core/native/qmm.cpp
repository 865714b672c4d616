#include "qmm.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <thread>
#include <type_traits>
#include <vector>

#include "graph.h"
#include "kernel.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/transforms.h"
#include "mlx/primitives.h"
#include "pool.h"

namespace mlxchat {

namespace {

// ---- threads ------------------------------------------------------------------------------------------------

std::atomic<uint64_t> kernel_ns{0};  // time spent inside the ops' CPU tasks, for the bench's per-token breakdown

// Adds the lifetime of this object to kernel_ns.
struct KernelTimer {
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  ~KernelTimer() {
    kernel_ns.fetch_add(uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                     std::chrono::steady_clock::now() - start).count()),
                        std::memory_order_relaxed);
  }
};

std::mutex pool_mu;  // guards the pointer and serialises jobs: the pool runs one job at a time
std::unique_ptr<Pool> pool;

int default_threads() {
  if (const char* env = std::getenv("MLXCHAT_NATIVE_THREADS")) {
    int n = std::atoi(env);
    if (n >= 1) return n;
  }
  // Every core, up to 4. Once the fused layer made a decode step ~50 graph nodes, Python no longer needs the second
  // core while a step runs: on the 2-core machine 2 threads decode 82 tok/s against 67 with one (greedy; 77 vs 56
  // with the full sampler chain), and the MLX-op path (no fused layers) is no slower (36.6 vs 36.2). Above 2 is
  // not measured here; the claimable chunks keep a busy or extra thread from holding the others up.
  const unsigned cores = std::thread::hardware_concurrency();
  return int(std::clamp(cores, 1u, 4u));
}

// Runs fn over `chunks` chunks on the pool; when another stream holds the pool, on this thread alone. `linger`: see
// Pool::run.
void parallel_for(int chunks, const std::function<void(int)>& fn,
                  std::chrono::microseconds linger = std::chrono::microseconds(0)) {
  std::unique_lock<std::mutex> lock(pool_mu, std::try_to_lock);
  if (!lock.owns_lock()) {
    for (int c = 0; c < chunks; ++c) fn(c);
    return;
  }
  if (!pool) pool = std::make_unique<Pool>(default_threads() - 1);
  pool->run(chunks, fn, linger);
}

// Pieces of one matrix in a fused layer's job: ~64k weights each, rows split evenly.
constexpr int64_t kPieceWeights = 65536;
int piece_count(int N, int K) {
  return int(std::max<int64_t>(1, std::min<int64_t>(N / 16, (int64_t(N) * K + kPieceWeights / 2) / kPieceWeights)));
}

// ---- the matmul kernel --------------------------------------------------------------------------------------

using RowsKernel = void (*)(const QMatmulArgs&, int, int);

bool avx512_supported() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}

bool vnni_supported() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

// MLXCHAT_NATIVE_ISA=avx2: the AVX2 kernels even where wider ones would run (e.g. to compare them).
bool avx2_asked() {
  const char* isa = std::getenv("MLXCHAT_NATIVE_ISA");
  return isa != nullptr && std::string(isa) == "avx2";
}

// The AVX-512 kernel where the CPU has it: on this machine's Zen 4 it took 0.85-0.93x the AVX2 kernel's time for a
// token's GEMVs at M=1, 0.7-0.8x at M=5 and 0.84-0.96x at M=8 (interleaved A/B, fp16 parameters). Chosen once per
// process: every row of every pass must use the same kernel, or a verify pass's rows would not equal single steps
// bit for bit.
RowsKernel rows_kernel() {
  static const RowsKernel kernel = avx512_supported() && !avx2_asked() ? &qmm_rows_avx512 : &qmm_rows_avx2;
  return kernel;
}

using PackedKernel = void (*)(const PackedMatmulArgs&, int, int);

// The int8-activation kernel: VNNI where the CPU has it, else AVX2 (MLXCHAT_NATIVE_ISA=avx2 keeps AVX2, as for the
// fp32 kernel). Chosen once per process, for the same reason.
PackedKernel packed_kernel() {
  static const PackedKernel kernel = vnni_supported() && !avx2_asked() ? &qmm_packed_rows_vnni : &qmm_packed_rows_avx2;
  return kernel;
}

// Rows of x from which the packed matmul runs on AMX's tiles. Below, the tile products' fixed cost (16 rows of x
// each, however many are real, and the tile's codes made whole first) loses: one 5632 x 2048 matrix, one thread, CPU
// time, Q4_K / Q6_K: 4 rows 1.6 / 2.4 ms on AMX against 0.84 / 1.0 on VNNI, 8 rows 2.1 / 2.9 against 1.6 / 1.8,
// 16 rows 2.4 / 3.6 against 3.4 / 4.2, 64 rows 7.8 / 11.7 against 13.2 / 15.1.
constexpr int kAmxRows = 16;

// Whether the packed matmul takes AMX for many rows: where the VNNI kernel runs (AMX gives its results bit for bit),
// AMX-INT8 does, and MLXCHAT_NATIVE_AMX is not 0 (to compare the two).
bool amx_runs() {
  static const bool runs = [] {
    const char* env = std::getenv("MLXCHAT_NATIVE_AMX");
    return packed_kernel() == &qmm_packed_rows_vnni && amx_ready() && !(env && std::string(env) == "0");
  }();
  return runs;
}

// The packed kernel for M rows of x.
PackedKernel packed_kernel(int M) {
  return amx_runs() && M >= kAmxRows ? &qmm_packed_rows_amx : packed_kernel();
}

// x as fixed24 (three bytes a value) runs on the VNNI kernel only: on AVX2's VPMADDUBSW + VPMADDWD three digits
// cost about what the fp32 kernel does, so CPUs without VNNI keep MLX's layout and the fp32 kernel.
bool fixed24_runs() {
  return packed_kernel() == &qmm_packed_rows_vnni;
}

// Rows per chunk: ~256k weights, a multiple of 16. Smaller chunks (64k) made 2 threads slower than 1 on the 211
// GEMVs of a token (25 vs 15 ms): the small matrices were split into pieces too short to be worth a hand-off.
int chunk_rows(int K) {
  int rows = (262144 + K - 1) / K;
  return std::max(16, (rows + 15) / 16 * 16);
}

// fn(u0, u1) over a weight's N rows [N, K] in chunks of chunk_rows(K) on the pool, for M rows of x; for packed
// weights u counts tiles of 16 rows (chunk_rows is a multiple of 16). A chunk of a prompt's rows is up to 8 times
// shorter: with M rows each chunk is M times the work, and the embedded model's k/v projections (192 rows) were one
// chunk, its q (576) a chunk of 464 and one of 112, so a 512-token prefill ran mostly on one of the two threads.
// Bytes of whole codes (amx_rows: 512 a block) in one chunk of a prompt's tiles on AMX.
constexpr int kAmxChunkCodes = 512 * 1024;

void parallel_chunks(int N, int K, int M, bool packed, const std::function<void(int, int)>& fn) {
  const int unit = packed ? kPackedTile : 1, units = N / unit;
  const int shorter = std::clamp(M / 16, 1, 8);
  int per_chunk = std::max(1, (chunk_rows(K) / shorter + kPackedTile - 1) / kPackedTile * kPackedTile / unit);
  if (packed && packed_kernel(M) == &qmm_packed_rows_amx) {
    // AMX passes every row of x (16 at a time) over the chunk's tiles, so each chunk reads all of x once: at one
    // tile a chunk (the grain above at 512 rows) a 5632 x 2048 matmul read its 3 MB of x 352 times, from L3, and
    // the tile loads waited on it. Chunks of ~512 KB of codes (kept in L2 with a 16-row slice of x): one 5632 x 2048
    // Q4_K matmul at 512 rows, one thread, CPU time, 70 -> 50 ms (Q4_0 alike). At least 4 chunks, for the second
    // thread.
    // Guided: the last chunks shrink (a quarter of what is left over the threads, down to one tile), so a thread
    // that finds no chunk left waits on the other's last one for a short time: with equal chunks it spun in
    // Pool::run for ~half a chunk per matmul (8% of the prefill's samples on the main thread).
    const int most = std::clamp(kAmxChunkCodes / (K / 32 * 512), 1, units);
    const int helpers = std::max(1, threads());
    std::vector<int> starts{0};
    for (int u = 0; u < units;) {
      u += std::clamp((units - u) / (2 * helpers), 1, most);
      starts.push_back(std::min(u, units));
    }
    parallel_for(int(starts.size()) - 1, [&](int c) { fn(starts[c], starts[c + 1]); });
    return;
  }
  parallel_for((units + per_chunk - 1) / per_chunk,
               [&](int c) { fn(c * per_chunk, std::min(units, (c + 1) * per_chunk)); });
}

// ---- argument checks -----------------------------------------------------------------------------------------

// Whether `biases` stands for a symmetric format's (kernel.h): an empty array of the scales' rows.
bool symmetric(const mx::array& biases) {
  return biases.ndim() == 2 && biases.shape(1) == 0;
}

ScaleType scale_type(const mx::array& scales, const mx::array& biases) {
  const mx::Dtype t = scales.dtype();
  if (t == mx::float32) return ScaleType::f32;
  if (t == mx::float16) return symmetric(biases) ? ScaleType::symmetric : ScaleType::f16;
  if (t == mx::uint8) return ScaleType::compact;
  return ScaleType::bf16;
}

// The arguments for units (rows, or tiles of 16 rows where `packed`) [u0, u1) as a view whose units count from 0:
// weights, parameters and outputs moved to unit u0. Compact and symmetric parameters are expanded to fp32 for those
// units, into `params`, which the kernel then reads from cache.
template <typename Args>
Args units_view(const Args& a, int u0, int u1, bool packed, std::vector<float>& params) {
  const int G = a.K / a.group_size, rows = packed ? kPackedTile : 1;
  const size_t unit_bytes = size_t(rows) * a.K * a.bits / 8, first = size_t(u0) * rows * G;
  Args view = a;
  view.w = a.w + u0 * unit_bytes;
  if (a.scale_type == ScaleType::compact) {
    const size_t count = size_t(u1 - u0) * rows * G;
    params.resize(2 * count);
    expand_compact_avx2(static_cast<const uint8_t*>(a.scales), a.K, a.group_size, packed, u0, u1, params.data());
    expand_compact_avx2(static_cast<const uint8_t*>(a.biases), a.K, a.group_size, packed, u0, u1,
                        params.data() + count);
    view.scales = params.data();
    view.biases = params.data() + count;
    view.scale_type = ScaleType::f32;
  } else if (a.scale_type == ScaleType::symmetric) {
    const size_t count = size_t(u1 - u0) * rows * G;
    params.resize(2 * count);
    expand_symmetric_avx2(static_cast<const uint16_t*>(a.scales) + first, count, a.bits, params.data(),
                          params.data() + count);
    view.scales = params.data();
    view.biases = params.data() + count;
    view.scale_type = ScaleType::f32;
  } else {
    const size_t bytes = first * (a.scale_type == ScaleType::f32 ? 4 : 2);
    view.scales = static_cast<const char*>(a.scales) + bytes;
    view.biases = static_cast<const char*>(a.biases) + bytes;
  }
  if constexpr (std::is_same_v<Args, DequantArgs>) {
    view.out = a.out + size_t(u0) * rows * a.K;
  } else {
    view.y = a.y + size_t(u0) * rows;  // y [M, N] keeps its row stride N
  }
  return view;
}

// Whether a kernel reads compact and symmetric parameters as they lie (the packed ones on AVX-512: VNNI's and AMX's).
bool reads_params_in_place(PackedKernel kernel) {
  return kernel == &qmm_packed_rows_vnni || kernel == &qmm_packed_rows_amx;
}
template <typename Kernel>
bool reads_params_in_place(const Kernel&) {
  return false;
}

// kernel(args, u0, u1) over units [u0, u1); with compact or symmetric parameters that the kernel does not read
// itself, on units_view's view (their fp32 expansion).
template <typename Args, typename Kernel>
void run_units(const Args& a, int u0, int u1, bool packed, Kernel&& kernel) {
  if ((a.scale_type != ScaleType::compact && a.scale_type != ScaleType::symmetric) || reads_params_in_place(kernel)) {
    kernel(a, u0, u1);
    return;
  }
  thread_local std::vector<float> params;
  kernel(units_view(a, u0, u1, packed, params), 0, u1 - u0);
}

}  // namespace

void check_weights(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size, int bits,
                   bool packed, bool int8) {
  if (!cpu_supported()) throw std::runtime_error(cpu_unsupported_reason());
  if (bits != 4 && bits != 5 && bits != 6 && bits != 8) {
    throw std::invalid_argument("bits must be 4, 5, 6 or 8, got " + std::to_string(bits));
  }
  if (group_size != 16 && group_size != 32 && group_size != 64 && group_size != 128) {
    throw std::invalid_argument("group_size must be 16, 32, 64 or 128, got " + std::to_string(group_size));
  }
  if (w.ndim() != 2 || w.dtype() != mx::uint32) throw std::invalid_argument("w must be a 2-D uint32 array");
  // The kernels work in blocks of 32 values (4 * bits bytes of MLX's bit stream).
  if (w.shape(1) % bits != 0) {
    throw std::invalid_argument("w's rows must hold a multiple of 32 values (" + std::to_string(w.shape(1)) +
                                " words of " + std::to_string(bits) + "-bit codes do not)");
  }
  if (symmetric(biases)) {
    if (scales.dtype() != mx::float16 || biases.dtype() != mx::float16 || scales.ndim() != 2 ||
        biases.shape(0) != scales.shape(0)) {
      throw std::invalid_argument("symmetric parameters (empty biases) need float16 scales of the same rows");
    }
  } else if (scales.ndim() != 2 || scales.shape() != biases.shape() || scales.dtype() != biases.dtype()) {
    throw std::invalid_argument("scales and biases must be 2-D arrays of the same shape and dtype");
  }
  if (scales.dtype() != mx::float32 && scales.dtype() != mx::float16 && scales.dtype() != mx::bfloat16 &&
      scales.dtype() != mx::uint8) {
    throw std::invalid_argument("scales must be float32, float16, bfloat16 or uint8 (compact_params)");
  }
  const int K = w.shape(1) * 32 / bits;
  if (scales.dtype() == mx::uint8) {
    if ((group_size != 16 && group_size != 32) || K % 256 != 0) {
      throw std::invalid_argument("compact parameters need groups of 16 or 32 and rows of a multiple of 256 values");
    }
    if (scales.shape(0) != w.shape(0) || scales.shape(1) != K / 256 * compact_bytes(group_size)) {
      throw std::invalid_argument("compact parameters of shape (" + std::to_string(scales.shape(0)) + ", " +
                                  std::to_string(scales.shape(1)) + ") do not match w for group_size " +
                                  std::to_string(group_size) + " and bits " + std::to_string(bits));
    }
  } else if (scales.shape(0) != w.shape(0) || scales.shape(1) * group_size != K) {
    throw std::invalid_argument("scales of shape (" + std::to_string(scales.shape(0)) + ", " +
                                std::to_string(scales.shape(1)) + ") do not match w for group_size " +
                                std::to_string(group_size) + " and bits " + std::to_string(bits));
  }
  if (packed && w.shape(0) % kPackedTile != 0) {
    throw std::invalid_argument("packed weights need a multiple of 16 output rows, got " + std::to_string(w.shape(0)));
  }
  if (packed && !int8 && !fixed24_runs()) {
    throw std::runtime_error("packed weights with exact x need AVX512-VNNI (this CPU, or MLXCHAT_NATIVE_ISA=avx2, "
                             "has none): load with the weights unpacked");
  }
}

namespace {

// ---- x preparation -------------------------------------------------------------------------------------------

// x as dense fp32 rows, reordered for 4 bits per block of 32 (evens then odds, as the nibbles come out) or, for
// groups of 16, per half block (each group's values together), and the per-group sums of x for the bias term.
void prepare_rows(std::vector<float> plain, int M, int K, int group_size, int bits, std::vector<float>& xq,
                  std::vector<float>& xsum) {
  const int G = K / group_size;
  xsum.assign(size_t(M) * G, 0.0f);
  for (int m = 0; m < M; ++m) {
    for (int k = 0; k < K; ++k) xsum[size_t(m) * G + k / group_size] += plain[size_t(m) * K + k];
  }
  if (bits != 4) {  // 5, 6 and 8 bits expand in natural order
    xq = std::move(plain);
    return;
  }
  xq.resize(plain.size());
  const size_t span = group_size == 16 ? 16 : 32;
  for (size_t base = 0; base < plain.size(); base += span) {
    for (size_t j = 0; j < span / 2; ++j) {
      xq[base + j] = plain[base + 2 * j];
      xq[base + span / 2 + j] = plain[base + 2 * j + 1];
    }
  }
}

std::vector<float> plain_x(const mx::array& x) {
  const int K = x.shape(-1), M = int(x.size() / K);
  std::vector<float> plain(size_t(M) * K);
  if (x.dtype() == mx::float32) {
    gather_x<float>(x, plain);
  } else if (x.dtype() == mx::float16) {
    gather_x<mx::float16_t>(x, plain);
  } else {
    gather_x<mx::bfloat16_t>(x, plain);
  }
  return plain;
}

// Rows of x quantized a piece (a piece of a prompt's rows each thread claims).
constexpr int kQuantizeRows = 32;

// x's rows as dense fp32: x itself where it is so, else a copy in `copy`.
const float* float_rows(const mx::array& x, std::vector<float>& copy) {
  if (x.dtype() == mx::float32) return rows_of(x, copy);
  copy = plain_x(x);
  return copy.data();
}

// x as the packed matmul takes it (PackedMatmulArgs's xq, xd, xsum), int8 or fixed24.
struct PackedRows {
  XForm xform;
  // Left uninitialized (every byte is written): zeroing a prompt's 3 MB of digits cost as much as a tenth of making
  // them.
  std::unique_ptr<int8_t[]> xq;
  std::vector<float> xd, xsum;
  PackedRows(const float* x, int M, int K, int group_size, XForm form)
      : xform(form), xq(new int8_t[size_t(M) * x_row_bytes(K, form)]), xd(size_t(M) * (K / 32)),
        xsum(size_t(M) * (K / group_size)) {
    // Rows are independent: a prompt's are quantized on every thread (this runs before each projection's matmul,
    // and alone it was 4.7 ms of a 512-row, K = 2048 one on one thread).
    const int G = K / group_size, pieces = (M + kQuantizeRows - 1) / kQuantizeRows;
    auto piece = [&](int p) {
      const int m0 = p * kQuantizeRows, rows = std::min(M - m0, kQuantizeRows);
      quantize_rows(x + size_t(m0) * K, rows, K, group_size, form, xq.get() + size_t(m0) * x_row_bytes(K, form),
                    xd.data() + size_t(m0) * (K / 32), xsum.data() + size_t(m0) * G);
    };
    if (pieces == 1) {
      piece(0);
    } else {
      parallel_for(pieces, piece);
    }
  }
  PackedMatmulArgs args(const mx::array& w, const mx::array& scales, const mx::array& biases, float* y, int M, int N,
                        int K, int group_size, int bits) const {
    return PackedMatmulArgs{xq.get(), xd.data(), xsum.data(), w.data<uint8_t>(), scales.data<void>(),
                            biases.data<void>(), scale_type(scales, biases), xform, y, M, N, K, group_size, bits};
  }
};

// x's form for M rows on 4-bit codes or others (`bits`, `group_size`): fixed24_nibbles where AMX takes the rows
// (two tile products a block on 4-bit codes instead of three: kernel.h), else int8 or fixed24.
XForm xform_of(bool int8, int M = 1, int bits = 0, int group_size = 32) {
  if (int8) return XForm::int8;
  return bits == 4 && group_size != 16 && packed_kernel(M) == &qmm_packed_rows_amx ? XForm::fixed24_nibbles
                                                                                   : XForm::fixed24;
}

// ---- primitives ----------------------------------------------------------------------------------------------

// What the quantized ops share: their weights' format (group size, bits, packed or MLX's layout, int8 x), by which
// two nodes are equivalent, and running a kernel on the CPU's encoder: the output allocated, the inputs and output
// registered, then `fn(inputs, out)` dispatched on weak copies of them (the encoder keeps the arrays alive).
struct QuantFormat {
  int group_size, bits;
  bool packed = false, int8 = false;
  bool operator==(const QuantFormat&) const = default;
};

class QuantOp : public CpuOp {
 public:
  QuantOp(mx::Stream stream, QuantFormat format) : CpuOp(stream), format_(format) {}

  bool is_equivalent(const mx::Primitive& other) const override {
    return format_ == static_cast<const QuantOp&>(other).format_;
  }

 protected:
  template <typename F>
  void dispatch(const std::vector<mx::array>& inputs, mx::array& out, F fn) {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    std::vector<mx::array> weak;
    for (auto& a : inputs) {
      encoder.set_input_array(a);
      weak.push_back(mx::array::unsafe_weak_copy(a));
    }
    encoder.set_output_array(out);
    encoder.dispatch([in = std::move(weak), out = mx::array::unsafe_weak_copy(out), fn = std::move(fn)]() mutable {
      fn(in, out);
    });
  }

  QuantFormat format_;
};

class NativeQuantizedMatmul : public QuantOp {
 public:
  using QuantOp::QuantOp;

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch(inputs, out, [f = format_](std::vector<mx::array>& in, mx::array& out) {
      const mx::array &x = in[0], &w = in[1], &scales = in[2], &biases = in[3];
      const int group_size = f.group_size, bits = f.bits;
      const bool packed = f.packed, int8 = f.int8;
      KernelTimer timer;
      const int K = x.shape(-1), M = int(x.size() / K), N = w.shape(0);
      if (packed) {
        std::vector<float> copy;
        const PackedRows xr(float_rows(x, copy), M, K, group_size, xform_of(int8, M, bits, group_size));
        const PackedMatmulArgs a = xr.args(w, scales, biases, out.data<float>(), M, N, K, group_size, bits);
        const PackedKernel kernel = packed_kernel(M);  // VNNI's (or AMX's) for fixed24 (check_weights)
        parallel_chunks(N, K, M, true, [&](int t0, int t1) { run_units(a, t0, t1, true, kernel); });
        return;
      }
      std::vector<float> xq, xsum;
      prepare_rows(plain_x(x), M, K, group_size, bits, xq, xsum);
      QMatmulArgs a{xq.data(), xsum.data(), w.data<uint8_t>(), scales.data<void>(), biases.data<void>(),
                    scale_type(scales, biases), out.data<float>(), M, N, K, group_size, bits};
      const RowsKernel kernel = rows_kernel();
      parallel_chunks(N, K, M, false, [&](int n0, int n1) { run_units(a, n0, n1, false, kernel); });
    });
  }

  const char* name() const override { return "MlxchatQuantizedMatmul"; }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }
};

class NativeDequantize : public QuantOp {
 public:
  using QuantOp::QuantOp;

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch(inputs, out, [f = format_](std::vector<mx::array>& in, mx::array& out) {
      const mx::array &w = in[0], &scales = in[1], &biases = in[2];
      const int group_size = f.group_size, bits = f.bits;
      const bool packed = f.packed;
      KernelTimer timer;
      DequantArgs a{w.data<uint8_t>(), scales.data<void>(), biases.data<void>(), scale_type(scales, biases),
                    out.data<float>(), out.shape(0), out.shape(1), group_size, bits};
      parallel_chunks(a.N, a.K, 1, packed, [&](int u0, int u1) {
        run_units(a, u0, u1, packed, packed ? &dequant_packed_vnni : &dequant_rows_avx2);
      });
    });
  }

  const char* name() const override { return "MlxchatDequantize"; }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {{inputs[0].shape(0), inputs[0].shape(1) * 32 / format_.bits}};
  }
};

// Row n of a packed weight in float32: scale * q, then + bias, in float32 whatever the parameters' type (an f16
// scale times a code does not fit f16: Q8_0's d * q needs 15 bits), so the rows are the file's values as llama.cpp
// reads them. The parameters are read at packed_param(G, n, g), counted from `first_tile` (compact ones are expanded
// to fp32 first).
template <typename T>
void packed_row(const uint8_t* w, const T* scales, const T* biases, int first_tile, int K, int group_size, int bits,
                int n, float* out) {
  const int G = K / group_size;
  for (int k = 0; k < K; ++k) {
    const uint32_t q = packed_code(w, K, bits, n, k);
    const size_t p = packed_param(G, n - first_tile * kPackedTile, k / group_size);
    out[k] = static_cast<float>(scales[p]) * float(q) + static_cast<float>(biases[p]);
  }
}

class NativePackedLookup : public QuantOp {
 public:
  using QuantOp::QuantOp;

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch(inputs, out, [f = format_](std::vector<mx::array>& in, mx::array& out) {
      const mx::array &ids = in[0], &w = in[1], &scales = in[2], &biases = in[3];
      const int group_size = f.group_size, bits = f.bits;
      const int N = w.shape(0), K = w.shape(1) * 32 / bits;
      const uint32_t* id = ids.data<uint32_t>();
      auto rows = [&](auto type) {
        using T = decltype(type);
        for (size_t r = 0; r < ids.size(); ++r) {
          // Out of range reads no memory: the row is NaN, as a bad id gives no real embedding.
          if (id[r] >= uint32_t(N)) {
            std::fill_n(out.data<float>() + r * K, K, std::numeric_limits<float>::quiet_NaN());
            continue;
          }
          if constexpr (std::is_same_v<T, void*>) {  // compact or symmetric: the row's tile's parameters as fp32
            const int G = K / group_size, tile = int(id[r]) / kPackedTile;
            const size_t count = size_t(G) * kPackedTile;
            std::vector<float> params(2 * count);
            if (scales.dtype() == mx::uint8) {
              expand_compact_avx2(scales.data<uint8_t>(), K, group_size, true, tile, tile + 1, params.data());
              expand_compact_avx2(biases.data<uint8_t>(), K, group_size, true, tile, tile + 1,
                                  params.data() + count);
            } else {
              expand_symmetric_avx2(scales.data<uint16_t>() + tile * count, count, bits, params.data(),
                                    params.data() + count);
            }
            packed_row<float>(w.data<uint8_t>(), params.data(), params.data() + size_t(G) * kPackedTile, tile, K,
                              group_size, bits, int(id[r]), out.data<float>() + r * K);
          } else {
            packed_row<T>(w.data<uint8_t>(), scales.data<T>(), biases.data<T>(), 0, K, group_size, bits, int(id[r]),
                          out.data<float>() + r * K);
          }
        }
      };
      if (scales.dtype() == mx::uint8 || symmetric(biases)) {
        rows(static_cast<void*>(nullptr));
      } else if (scales.dtype() == mx::float32) {
        rows(float{});
      } else if (scales.dtype() == mx::float16) {
        rows(mx::float16_t{});
      } else {
        rows(mx::bfloat16_t{});
      }
    });
  }

  const char* name() const override { return "MlxchatPackedLookup"; }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape shape = inputs[0].shape();
    shape.push_back(inputs[1].shape(1) * 32 / format_.bits);
    return {shape};
  }
};

}  // namespace

bool cpu_supported() {
#if defined(__x86_64__) || defined(__i386__)
  // Asked by every op's argument checks (24 times a decode step's layer): the CPU is read once.
  static const bool supported = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }();
  return supported;
#else
  return false;
#endif
}

std::string cpu_unsupported_reason() {
#if defined(__x86_64__) || defined(__i386__)
  return cpu_supported() ? "" : "this CPU lacks AVX2, FMA or F16C, which the native kernel needs";
#else
  return "the native kernel is written for x86-64 (AVX2/FMA); this CPU is not one";
#endif
}

std::string int8_kernel_name() {
  return packed_kernel() == &qmm_packed_rows_vnni ? "avx512-vnni" : "avx2";
}

bool packs_exact() {
  return cpu_supported() && fixed24_runs();
}

bool packs_on_amx() {
  return cpu_supported() && amx_runs();
}

namespace {

// y = x @ w^T as `op`'s node (a QuantOp of the weight's format, whose checks the caller made): x of the weight's
// input size in any float type keeps its shape and strides (the kernels gather its rows: no reshape or copy nodes,
// each of which costs a decode step as much as a small matmul) and y comes back in that type.
mx::array matmul_node(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                      int bits, std::shared_ptr<mx::Primitive> op) {
  const int K = w.shape(1) * 32 / bits, N = w.shape(0);
  if (x.ndim() < 1 || x.shape(-1) != K) {
    throw std::invalid_argument("x's last dimension must be " + std::to_string(K) + " (the weight's input size)");
  }
  auto s = cpu_stream();
  const bool kept = x.dtype() == mx::float32 || x.dtype() == mx::float16 || x.dtype() == mx::bfloat16;
  mx::array x2 = kept ? x : mx::astype(x, mx::float32, s);
  mx::Shape shape = x.shape();
  shape.back() = N;
  mx::array y(shape, mx::float32, std::move(op), {x2, dense(w, s), dense(scales, s), dense(biases, s)});
  return kept && x.dtype() != mx::float32 ? mx::astype(y, x.dtype(), s) : y;
}

}  // namespace

mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                           int group_size, int bits, bool packed, bool int8) {
  check_weights(w, scales, biases, group_size, bits, packed, int8);
  return matmul_node(x, w, scales, biases, bits,
                     std::make_shared<NativeQuantizedMatmul>(cpu_stream(), QuantFormat{group_size, bits, packed, int8}));
}

namespace {

using Repack = void (*)(const uint8_t*, const void*, const void*, size_t, int, int, int, int, uint8_t*, void*, void*);

std::vector<mx::array> repacked(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size,
                                int bits, Repack repack) {
  check_weights(w, scales, biases, group_size, bits, true, true);
  auto s = cpu_stream();
  mx::array wd = dense(w, s), sd = dense(scales, s), bd = dense(biases, s);
  mx::eval({wd, sd, bd});
  auto fresh = [](const mx::array& like) {
    return mx::array(mx::allocator::malloc(like.nbytes()), like.shape(), like.dtype());
  };
  // Symmetric parameters' empty biases stay as they are (nothing to reorder).
  const bool sym = symmetric(bd);
  std::vector<mx::array> out{fresh(wd), fresh(sd), sym ? bd : fresh(bd)};
  const int N = w.shape(0), K = w.shape(1) * 32 / bits;
  const size_t param_bytes = sd.dtype() == mx::uint8 ? 0 : mx::size_of(sd.dtype());  // 0: compact (kernel.h)
  // Tiles of 16 rows are independent and each layout keeps a range of them contiguous (a row's bytes times the
  // rows before it), so ranges of tiles repack in parallel: an MLX folder's load is mostly this.
  const size_t row_bytes = size_t(K) * bits / 8, row_params = sd.nbytes() / size_t(N);
  const int tiles = N / kPackedTile, per_piece = std::max(1, int((1 << 20) / (row_bytes * kPackedTile)));
  const auto* w_in = wd.data<uint8_t>();
  const auto* s_in = sd.data<uint8_t>();
  const auto* b_in = bd.data<uint8_t>();
  parallel_pieces((tiles + per_piece - 1) / per_piece, [&](int piece) {
    const int n0 = piece * per_piece * kPackedTile, n1 = std::min(N, n0 + per_piece * kPackedTile);
    repack(w_in + n0 * row_bytes, s_in + n0 * row_params, sym ? nullptr : b_in + n0 * row_params, param_bytes,
           n1 - n0, K, group_size, bits, out[0].data<uint8_t>() + n0 * row_bytes,
           out[1].data<uint8_t>() + n0 * row_params, sym ? nullptr : out[2].data<uint8_t>() + n0 * row_params);
  });
  return out;
}

}  // namespace

std::vector<mx::array> pack_weights(const mx::array& w, const mx::array& scales, const mx::array& biases,
                                    int group_size, int bits) {
  return repacked(w, scales, biases, group_size, bits, &mlxchat::pack_weights);
}

std::vector<mx::array> unpack_weights(const mx::array& w, const mx::array& scales, const mx::array& biases,
                                      int group_size, int bits) {
  return repacked(w, scales, biases, group_size, bits, &mlxchat::unpack_weights);
}

mx::array packed_lookup(const mx::array& ids, const mx::array& w, const mx::array& scales, const mx::array& biases,
                        int group_size, int bits) {
  check_weights(w, scales, biases, group_size, bits, true, true);
  if (!mx::issubdtype(ids.dtype(), mx::integer)) throw std::invalid_argument("ids must be an integer array");
  auto s = cpu_stream();
  mx::Shape shape = ids.shape();
  shape.push_back(w.shape(1) * 32 / bits);  // the op's output_shapes, before the node exists
  return mx::array(shape, mx::float32, std::make_shared<NativePackedLookup>(s, QuantFormat{group_size, bits}),
                   {dense(mx::astype(ids, mx::uint32, s), s), dense(w, s), dense(scales, s), dense(biases, s)});
}

void quantized_matmul_rows(const float* x, int M, const std::vector<RowsTarget>& targets) {
  KernelTimer timer;
  if (targets.empty()) return;
  const int K = targets[0].w->shape(1) * 32 / targets[0].bits;
  // x as each format needs it (the reorder depends on the bits, the sums on the group size; packed weights take it
  // as integers, int8 or fixed24), once per format: a layer's q/k/v usually share one, but a GGUF may give v_proj
  // more bits.
  struct Prepared {
    int group_size, bits;
    bool packed;
    XForm form;
    std::vector<float> xq, xsum;
    std::unique_ptr<PackedRows> integers;
  };
  std::vector<Prepared> prepared;
  auto prepared_for = [&](const RowsTarget& t) -> const Prepared& {
    const XForm form = xform_of(t.int8, M, t.bits, t.group_size);
    for (const auto& p : prepared) {
      if (p.group_size == t.group_size && p.packed == t.packed && (t.packed ? p.form == form : p.bits == t.bits)) {
        return p;
      }
    }
    auto& p = prepared.emplace_back(Prepared{t.group_size, t.bits, t.packed, form, {}, {}, nullptr});
    if (t.packed) {
      p.integers = std::make_unique<PackedRows>(x, M, K, t.group_size, form);
    } else {
      prepare_rows(std::vector<float>(x, x + size_t(M) * K), M, K, t.group_size, t.bits, p.xq, p.xsum);
    }
    return p;
  };
  prepared.reserve(targets.size());  // references into it stay valid
  // One job over every target's rows in balanced pieces (~kPieceWeights weights each): a layer's q/k/v (or gate/up)
  // are one hand-off to the helper instead of three, and no piece is much longer than another, so two threads end
  // together (the fixed 256k-weight chunks split k_proj not at all and q_proj 464 + 112). Packed weights split in
  // whole tiles of 16 rows.
  struct Job {
    QMatmulArgs plain;
    PackedMatmulArgs packed;
    bool is_packed;
    int units, pieces;  // rows (or tiles) to split, and into how many pieces
  };
  std::vector<Job> jobs;
  std::vector<std::pair<int, int>> pieces;  // (job, piece)
  for (size_t i = 0; i < targets.size(); ++i) {
    const auto& t = targets[i];
    if (t.w->shape(1) * 32 / t.bits != K) {
      throw std::invalid_argument("quantized_matmul_rows: the targets must share K (they read the same rows)");
    }
    const Prepared& p = prepared_for(t);
    const int N = t.w->shape(0);
    Job job{};
    job.is_packed = t.packed;
    if (t.packed) {
      job.packed = p.integers->args(*t.w, *t.scales, *t.biases, t.y, M, N, K, t.group_size, t.bits);
      job.units = N / kPackedTile;
    } else {
      job.plain = QMatmulArgs{p.xq.data(), p.xsum.data(), t.w->data<uint8_t>(), t.scales->data<void>(),
                              t.biases->data<void>(), scale_type(*t.scales, *t.biases), t.y, M, N, K, t.group_size,
                              t.bits};
      job.units = N;
    }
    job.pieces = std::min(job.units, piece_count(N, K));
    for (int c = 0; c < job.pieces; ++c) pieces.emplace_back(int(i), c);
    jobs.push_back(job);
  }
  const RowsKernel kernel = rows_kernel();
  const PackedKernel packed = packed_kernel(M);
  parallel_pieces(int(pieces.size()), [&](int p) {
    const auto [i, c] = pieces[p];
    const Job& job = jobs[i];
    const int u0 = int(int64_t(job.units) * c / job.pieces), u1 = int(int64_t(job.units) * (c + 1) / job.pieces);
    if (job.is_packed) {
      run_units(job.packed, u0, u1, true, packed);
    } else {
      run_units(job.plain, u0, u1, false, kernel);
    }
  });
}

void layer_attention(const AttentionArgs& a) {
  if (rows_kernel() == &qmm_rows_avx512 && attention_avx512_fits(a)) {
    attention_avx512(a);
  } else {
    attention_avx2(a);
  }
}

void parallel_pieces(int pieces, const std::function<void(int)>& fn, bool linger) {
  // The helper lingers between jobs: a layer's jobs come ~0.1 ms apart, and waking a sleeping helper for each cost
  // more than the second thread saved (measured on the embedded model, 2 threads: 13.0 ms a token with no linger,
  // 10.6-12.0 with 100-300 us).
  parallel_for(pieces, fn, std::chrono::microseconds(linger ? 200 : 0));
}

namespace {

// BLAS's single-precision GEMM: the one MLX's own matmul calls (libmlx needs it: it resolves to the BLAS that
// core/model/blas.py preloads, else to the one the mlx wheel ships), declared here as its C interface defines it.
extern "C" void cblas_sgemm(int order, int trans_a, int trans_b, int M, int N, int K, float alpha, const float* A,
                            int lda, const float* B, int ldb, float beta, float* C, int ldc);
constexpr int kCblasRowMajor = 101, kCblasNoTrans = 111, kCblasTrans = 112;

// Weight rows dequantized at a time for the GEMM: ~1 MB of fp32, so each piece is written and read back in cache.
// The whole matrix at once (x @ dequantize(w).T) was 46 MB for a 1.1B model's 5632 x 2048 MLP matrix, written to
// fresh pages: ~30 ms of page faults and stores, as long as ~140 rows of the packed kernel, which made a 50-token
// prompt 3.3x slower than a 40-token one (the cliff).
int gemm_rows(int K) {
  return std::max(kPackedTile, (262144 / K + kPackedTile - 1) / kPackedTile * kPackedTile);
}

class NativeDequantizedMatmul : public QuantOp {
 public:
  using QuantOp::QuantOp;

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch(inputs, out, [f = format_](std::vector<mx::array>& in, mx::array& out) {
      const mx::array &x = in[0], &w = in[1], &scales = in[2], &biases = in[3];
      const int group_size = f.group_size, bits = f.bits;
      const bool packed = f.packed;
      KernelTimer timer;
      const int K = x.shape(-1), M = int(x.size() / K), N = w.shape(0), unit = packed ? kPackedTile : 1;
      const std::vector<float> xs = plain_x(x);
      const DequantArgs a{w.data<uint8_t>(), scales.data<void>(), biases.data<void>(), scale_type(scales, biases),
                          nullptr, N, K, group_size, bits};
      const int rows = gemm_rows(K);
      thread_local std::vector<float> weights, params;
      weights.resize(size_t(rows) * K);
      for (int n0 = 0; n0 < N; n0 += rows) {
        const int n1 = std::min(N, n0 + rows);
        DequantArgs view = units_view(a, n0 / unit, n1 / unit, packed, params);
        view.out = weights.data();
        float* y = out.data<float>() + n0;  // y[:, n0:n1], row stride N
        if (packed) {  // the piece transposed, [K][n1 - n0]: y = x @ piece
          dequant_packed_t_vnni(view, 0, (n1 - n0) / unit, weights.data(), size_t(n1 - n0));
          cblas_sgemm(kCblasRowMajor, kCblasNoTrans, kCblasNoTrans, M, n1 - n0, K, 1.0f, xs.data(), K,
                      weights.data(), n1 - n0, 0.0f, y, N);
        } else {  // the piece's rows, [n1 - n0][K]: y = x @ piece^T
          dequant_rows_avx2(view, 0, n1 - n0);
          cblas_sgemm(kCblasRowMajor, kCblasNoTrans, kCblasTrans, M, n1 - n0, K, 1.0f, xs.data(), K,
                      weights.data(), K, 0.0f, y, N);
        }
      }
    });
  }

  const char* name() const override { return "MlxchatDequantizedMatmul"; }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }
};

}  // namespace

mx::array dequantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                             const mx::array& biases, int group_size, int bits, bool packed) {
  check_weights(w, scales, biases, group_size, bits, packed);  // packed as for fixed24: on the VNNI kernel
  return matmul_node(x, w, scales, biases, bits,
                     std::make_shared<NativeDequantizedMatmul>(cpu_stream(), QuantFormat{group_size, bits, packed}));
}

mx::array dequantize(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size, int bits,
                     bool packed) {
  check_weights(w, scales, biases, group_size, bits, packed);  // packed as for fixed24: on the VNNI kernel
  auto s = cpu_stream();
  return mx::array(mx::Shape{w.shape(0), w.shape(1) * 32 / bits}, mx::float32,
                   std::make_shared<NativeDequantize>(s, QuantFormat{group_size, bits, packed}),
                   {dense(w, s), dense(scales, s), dense(biases, s)});
}

namespace {

// One super-block's P float32 parameters v as float(D) * q with D an fp16 and q int8 (exact: 11 by 8 significant
// bits), written as compact's bytes (D, then the q's); false where no such D and q give v bit for bit. D is found from
// the largest |v|, whose q is +-k for some k in 1..128: |D| = max|v| / k is then exact (a representable quotient),
// and the first k and sign whose D is an fp16 that gives every v exactly is taken (any such D reproduces v: the
// file's own d * sc is one of them). Both signs: Q4_K's biases -(dmin * m) are -0.0 where m is 0, which only a
// negative D gives back (0 * D).
bool compact_super(const float* v, int P, uint8_t* out) {
  float amax = 0.0f;
  for (int i = 0; i < P; ++i) {
    if (!std::isfinite(v[i])) return false;
    amax = std::max(amax, std::abs(v[i]));
  }
  for (int k = 1; k <= 128; ++k) {
    for (const float sign : {1.0f, -1.0f}) {
      const float d = sign * (amax == 0.0f ? 1.0f : amax / float(k));
      const mx::float16_t h(d);
      if (static_cast<float>(h) != d) continue;
      bool exact = true;
      for (int i = 0; i < P && exact; ++i) {
        const float r = std::nearbyint(v[i] / d);
        if (!(r >= -128.0f && r <= 127.0f)) {
          exact = false;
          break;
        }
        const int8_t q = int8_t(r);
        const float back = float(q) * d;  // as expand_compact computes it (q = 0 gives +0 or -0 by D's sign)
        exact = std::memcmp(&back, &v[i], sizeof(float)) == 0;
        out[2 + i] = uint8_t(q);
      }
      if (exact) {
        std::memcpy(out, &h, 2);
        return true;
      }
    }
  }
  return false;
}

}  // namespace

std::optional<std::vector<mx::array>> compact_params(const mx::array& scales, const mx::array& biases,
                                                     int group_size) {
  if (scales.ndim() != 2 || scales.shape() != biases.shape() || scales.dtype() != mx::float32 ||
      biases.dtype() != mx::float32) {
    throw std::invalid_argument("compact_params takes float32 scales and biases of one shape [N, G]");
  }
  const int N = scales.shape(0), G = scales.shape(1), K = G * group_size;
  if ((group_size != 16 && group_size != 32) || K % 256 != 0) return std::nullopt;
  auto s = cpu_stream();
  std::vector<mx::array> in{mx::contiguous(scales, false, s), mx::contiguous(biases, false, s)};
  mx::eval(in);
  const int S = K / 256, P = compact_groups(group_size), B = compact_bytes(group_size);
  std::vector<mx::array> out;
  for (const auto& a : in) {
    mx::array c(mx::allocator::malloc(size_t(N) * S * B), {N, S * B}, mx::uint8);
    const float* v = a.data<float>();
    uint8_t* o = c.data<uint8_t>();
    for (size_t sb = 0; sb < size_t(N) * S; ++sb) {
      if (!compact_super(v + sb * P, P, o + sb * B)) return std::nullopt;
    }
    out.push_back(std::move(c));
  }
  return out;
}

bool biases_symmetric(const mx::array& scales, const mx::array& biases, int bits) {
  if (scales.dtype() != mx::float16 || biases.dtype() != mx::float16 || scales.shape() != biases.shape() ||
      (bits != 4 && bits != 5 && bits != 6 && bits != 8)) {
    return false;
  }
  if (!cpu_supported()) throw std::runtime_error(cpu_unsupported_reason());
  auto s = cpu_stream();
  std::vector<mx::array> in{dense(scales, s), dense(biases, s)};
  mx::eval(in);
  return biases_symmetric_avx2(in[0].data<uint16_t>(), in[1].data<uint16_t>(), in[0].size(), bits);
}

std::vector<mx::array> expand_params(const mx::array& scales, const mx::array& biases, int group_size, bool packed) {
  if (scales.ndim() != 2 || scales.dtype() != mx::uint8 || biases.shape() != scales.shape() ||
      biases.dtype() != mx::uint8 || (group_size != 16 && group_size != 32) ||
      scales.shape(1) % compact_bytes(group_size) != 0 || (packed && scales.shape(0) % kPackedTile != 0)) {
    throw std::invalid_argument("expand_params takes compact_params's arrays");
  }
  if (!cpu_supported()) throw std::runtime_error(cpu_unsupported_reason());
  auto s = cpu_stream();
  std::vector<mx::array> in{dense(scales, s), dense(biases, s)};
  mx::eval(in);
  const int N = scales.shape(0), K = scales.shape(1) / compact_bytes(group_size) * 256, G = K / group_size;
  std::vector<mx::array> out;
  for (const auto& c : in) {
    mx::array v(mx::allocator::malloc(size_t(N) * G * sizeof(float)), {N, G}, mx::float32);
    // Packed: tiles of [G][16] into rows [16][G].
    std::vector<float> tiles(packed ? size_t(N) * G : 0);
    expand_compact_avx2(c.data<uint8_t>(), K, group_size, packed, 0, packed ? N / kPackedTile : N,
                        packed ? tiles.data() : v.data<float>());
    for (size_t n = 0; packed && n < size_t(N); ++n) {
      for (int g = 0; g < G; ++g) v.data<float>()[n * G + g] = tiles[packed_param(G, int(n), g)];
    }
    out.push_back(std::move(v));
  }
  return out;
}

void set_threads(int n) {
  if (n < 1) throw std::invalid_argument("threads must be at least 1");
  std::lock_guard<std::mutex> lock(pool_mu);
  pool = std::make_unique<Pool>(n - 1);
}

double kernel_seconds() {
  return double(kernel_ns.load(std::memory_order_relaxed)) * 1e-9;
}

std::string kernel_name() {
  return rows_kernel() == &qmm_rows_avx512 ? "avx512" : "avx2";
}

int threads() {
  std::lock_guard<std::mutex> lock(pool_mu);
  return pool ? pool->threads() : default_threads();
}

}  // namespace mlxchat
