// MLX operations backed by the kernels in kernel_avx2.cpp and kernel_avx512.cpp. They are lazy graph nodes like any
// MLX op, so they work with mx.eval, mx.async_eval and mx.compile.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "mlx/array.h"

namespace mlxchat {

namespace mx = mlx::core;

// Whether this CPU has what the kernels need (AVX2, FMA, F16C), and a sentence saying what is missing if not.
bool cpu_supported();
std::string cpu_unsupported_reason();

// Which int8-activation kernel runs ("avx512-vnni" or "avx2"); it runs wherever the fp32 kernel does.
std::string int8_kernel_name();
// Whether the packed matmul takes exact x here (fixed24: AVX512-VNNI, and MLXCHAT_NATIVE_ISA is not avx2). Where it
// does, the native path packs its weights; elsewhere it keeps MLX's layout and the fp32 kernel.
bool packs_exact();
// Whether the packed matmul runs many rows of x (a prompt) on AMX's tiles (AMX-INT8, where packs_exact()), with the
// VNNI kernel's results bit for bit: then it beats dequantizing for BLAS's GEMM at every prompt length.
bool packs_on_amx();

// x @ dequantize(w, scales, biases).T for MLX's affine format (w as mx.quantize returns it), computed in fp32.
// x may have any shape [..., K], dtype and strides; the result has x's shape with K replaced by N, in x's float dtype.
// `packed`: w, scales and biases come from pack_weights, and x is taken as integers per block of 32: rounded to int8
// with `int8` (opt-in), else fixed24 (fp32's precision; needs packs_exact()).
mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                           int group_size, int bits, bool packed = false, bool int8 = false);

// (w, scales, biases) repacked for the packed matmul: the same shapes, dtypes and bytes, reordered into tiles of 16
// output rows (N must be a multiple of 16). Computed now.
std::vector<mx::array> pack_weights(const mx::array& w, const mx::array& scales, const mx::array& biases,
                                    int group_size, int bits);
// The inverse: pack_weights's arrays back in MLX's layout (for code that reads MLX's layout: mlx-lm's shard()).
std::vector<mx::array> unpack_weights(const mx::array& w, const mx::array& scales, const mx::array& biases,
                                      int group_size, int bits);
// Rows `ids` (any integer array) of a packed weight, dequantized as MLX's dequantize does (scale * q + bias in the
// parameters' type, which the result has): the tied embedding's lookup when its head is packed.
mx::array packed_lookup(const mx::array& ids, const mx::array& w, const mx::array& scales, const mx::array& biases,
                        int group_size, int bits);

// One matrix of a quantized_matmul_rows job: y[M, N] = x @ dequantize(w).T; w, scales and biases evaluated, dense.
struct RowsTarget {
  const mx::array* w;
  const mx::array* scales;
  const mx::array* biases;
  int group_size, bits;
  bool packed;  // pack_weights's layout: x is taken as integers
  bool int8;    // for packed weights: x rounded to int8 (else fixed24)
  float* y;
};
// Every target's rows for the same dense fp32 rows x [M, K], computed now on the calling thread and the pool, as one
// job: for ops that run several matmuls in one task (the fused decoder layer). The targets must share K; their
// formats (group size, bits) may differ. The time counts in kernel_seconds().
void quantized_matmul_rows(const float* x, int M, const std::vector<RowsTarget>& targets);
struct AttentionArgs;
// A fused layer's attention on the kernel family the matmul uses (AVX-512 where it runs and the head size fits).
void layer_attention(const AttentionArgs& a);

// fn(0) .. fn(pieces - 1) on the calling thread and the pool, for the other parts of a fused layer's task; the
// helpers linger between such jobs as between the layer's matmuls, unless `linger` is false (a job whose next one
// is far off, while another thread of the process has work for that core).
void parallel_pieces(int pieces, const std::function<void(int)>& fn, bool linger = true);
// Throws std::invalid_argument (or runtime_error where the CPU cannot) naming what does not fit.
void check_weights(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size, int bits,
                   bool packed = false, bool int8 = false);

// The fp32 weight [N, K], for prompts long enough that one BLAS GEMM beats the kernel; `packed`: from pack_weights's
// layout (needs packs_exact()).
mx::array dequantize(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size, int bits,
                     bool packed = false);

// The K-quants' float32 scales and biases [N, G] (groups of 16 or 32, K a multiple of 256) in the compact form
// (kernel.h's ScaleType::compact: per 256 values an fp16 D and int8 multipliers, ~the GGUF's size), or nothing where
// some super-block's values are not exactly float(D) * q. The two uint8 arrays take the float32 ones' place in every
// op (with MLX's layout of w, or pack_weights's); every op computes with the same float32 values. Computed now.
std::optional<std::vector<mx::array>> compact_params(const mx::array& scales, const mx::array& biases,
                                                     int group_size);
// Whether float16 scales and biases of one shape are a symmetric format's (kernel.h): every bias -2^(bits - 1) times
// its scale, exactly in float32. Evaluates its inputs; false for other dtypes or shapes.
bool biases_symmetric(const mx::array& scales, const mx::array& biases, int bits);
// The inverse: compact parameters (MLX's layout, or pack_weights's with `packed`) as float32 [N, G] in MLX's layout.
std::vector<mx::array> expand_params(const mx::array& scales, const mx::array& biases, int group_size, bool packed);

// x @ dequantize(w, scales, biases, packed).T by BLAS's GEMM, for prompts long enough that it beats the kernels:
// the weight is dequantized a cache-sized piece of rows at a time (never whole), each piece multiplied as it comes.
mx::array dequantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                             const mx::array& biases, int group_size, int bits, bool packed = false);

// Worker threads used by both ops (the calling thread counts as one).
void set_threads(int n);
// Total seconds spent running the ops' CPU tasks in this process (for per-token breakdowns).
double kernel_seconds();
// Which matmul kernel runs ("avx512" or "avx2"), for the weight-path line.
std::string kernel_name();
int threads();

}  // namespace mlxchat
