// Kernels over MLX's affine quantization (as mx.quantize returns it), with no MLX types so that the one file built
// with -mavx2 -mfma -mf16c (kernel_avx2.cpp) never leaks those instructions into code that runs before the CPU check.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mlxchat {

// compact: the K-quants' two levels, at about the GGUF's size (float32 parameters cost Q4_K 6 bits a weight against
// the file's 4.5, Q6_K 10 against 6.56). Per super-block of 256 values along K (P = 256 / group_size groups, group
// sizes 16 and 32 only): an fp16 D, then P int8 multipliers q, each group's parameter float(D) * q, which is exact
// in fp32 (11 significant bits times 8): the same float32 values as the parameters it was made from
// (compact_from_f32). Layout, uint8: MLX's rows [N][K / 256][2 + P] (D little-endian, then the q's); packed
// (pack_weights) [N / 16][K / 256][16 D's, then for each of the P groups the 16 rows' q]. The packed kernels on
// AVX-512 (VNNI, AMX) read it as it lies; for the others each piece of rows has its parameters expanded to fp32 first
// (expand_compact_avx2), in cache.
// symmetric: ggml's Q4_0, Q5_0 and Q8_0, whose bias is always -2^(bits - 1) times the fp16 scale (-8 d for Q4_0):
// fp16 scales, and no biases stored (an empty array stands for them), each bias -2^(bits - 1) * float(scale), exact
// in fp32. Stored, they were a ninth of a Q4_0 model (5 bits a weight against the file's 4.5). Read like compact: in
// registers by the packed kernels on AVX-512, expanded per piece (expand_symmetric_avx2) for the others.
enum class ScaleType { f32, f16, bf16, compact, symmetric };
// The bias a symmetric format's scale is multiplied by.
inline float symmetric_bias_factor(int bits) { return -float(1 << (bits - 1)); }
// A compact super-block's bytes (one row) and groups.
inline int compact_groups(int group_size) { return 256 / group_size; }
inline int compact_bytes(int group_size) { return 2 + compact_groups(group_size); }

// y[M, N] = x[M, K] @ dequant(w[N, K])^T, where dequant(q) = scale * q + bias per group of `group_size` along K.
// Formats: 4, 5, 6 or 8 bits; groups of 16, 32, 64 or 128 (16: Q6_K's sub-blocks); K a multiple of 32.
struct QMatmulArgs {
  const float* xq;    // [M, K] fp32; for 4 bits each block of 32 is reordered (evens, then odds) to match nibbles,
                      // for 4 bits in groups of 16 each half block of 16 is (so a group's values stay together)
  const float* xsum;  // [M, K / group_size]: sum of x over each group (the bias term is bias * sum(x))
  const uint8_t* w;   // [N, K * bits / 8]: MLX's uint32 words, little-endian, lowest bits first
  const void* scales; // [N, K / group_size]
  const void* biases; // [N, K / group_size]
  ScaleType scale_type;
  float* y;           // [M, N]
  int M, N, K, group_size, bits;
};

struct DequantArgs {
  const uint8_t* w;
  const void* scales;
  const void* biases;
  ScaleType scale_type;
  float* out;  // [N, K] fp32
  int N, K, group_size, bits;
};

// Rows [n0, n1) of y (all M rows of x) / of the dequantized weight. Need AVX2, FMA and F16C.
void qmm_rows_avx2(const QMatmulArgs& a, int n0, int n1);
// The same with AVX-512F (kernel_avx512.cpp, built with -mavx512f): needs AVX512F besides the above.
void qmm_rows_avx512(const QMatmulArgs& a, int n0, int n1);
void dequant_rows_avx2(const DequantArgs& a, int n0, int n1);
// Compact parameters (ScaleType::compact) of units [u0, u1) as fp32, from unit u0 on: rows [u0, u1) of MLX's layout
// into out [u1 - u0][G], or with `packed` tiles [u0, u1) into out [u1 - u0][G][16] (packed_param's order).
void expand_compact_avx2(const uint8_t* c, int K, int group_size, bool packed, int u0, int u1, float* out);
// Whether each of `count` fp16 biases is -2^(bits - 1) times its fp16 scale exactly, as float32 bits (-0.0 too).
bool biases_symmetric_avx2(const uint16_t* scales, const uint16_t* biases, size_t count, int bits);
// Symmetric parameters: `count` fp16 scales as fp32 into scales_out, and their biases into biases_out.
void expand_symmetric_avx2(const uint16_t* scales, size_t count, int bits, float* scales_out, float* biases_out);

// The packed matmul: the weights repacked into tiles of kPackedTile output rows (`pack_weights`) so that one integer
// dot instruction (VPDPBUSD: 4 unsigned weight bytes times 4 signed bytes of x, into 16 int32 lanes) serves 16
// outputs, and x turned into integers per block of 32 (`quantize_rows`), one of two ways:
// - int8 (weights="native-int8", opt-in): round(x / d), d = max|x| / 127, as llama.cpp rounds activations;
// - fixed24 (the native path's default where VNNI runs): x / 2^e rounded to an integer of 24 bits with 2^e a power of
//   two chosen per block, held as three signed bytes (x = 2^e * (d0 + 256 d1 + 65536 d2)), so the block's largest
//   values keep fp32's precision (23-24 significant bits) and the integer dot products are exact;
// - fixed24_nibbles: the same m of each value in four signed bytes, m = e0 + 16 e1 + 4096 (e2 + 16 e3) with e0, e2
//   in [0, 15] and e1, e3 in [-128, 127], for AMX's products on 4-bit codes (kernel_vnni.cpp): a block's codes
//   beside the codes times 16 (at most 240, still a byte) make one product of 64 k that sums e0 + 16 e1, so two
//   products a block make m's sums where the three digits take three. Only AMX reads it (M >= 16, 4 bits).
// y[m, n] = sum over groups of scale * (sum over the group's blocks of xd * (q . xq)) + bias * xsum.
constexpr int kPackedTile = 16;
enum class XForm { int8, fixed24, fixed24_nibbles };
inline constexpr int digits_of(XForm f) { return f == XForm::int8 ? 1 : f == XForm::fixed24 ? 3 : 4; }
// Bytes from one row of x's integers to the next: K * digits, and for fixed24_nibbles a line more, so that the 16
// rows of an AMX tile (K * 4 bytes apart: a multiple of 4 KB at K = 2048) do not all fall in one set of L1.
inline constexpr size_t x_row_bytes(int K, XForm f) {
  return size_t(K) * digits_of(f) + (f == XForm::fixed24_nibbles ? 64 : 0);
}
struct PackedMatmulArgs {
  const int8_t* xq;   // [M, K / 32, digits, 32], rows x_row_bytes apart: a block's digits (int8: round(x / xd))
  const float* xd;    // [M, K / 32]: each block's scale (int8: max |x| / 127; fixed24: 2^e)
  const float* xsum;  // [M, K / group_size]: the sum of the rounded x over each group (the bias term)
  const uint8_t* w;   // [N / 16][K / 32][16 * 32 * bits / 8] (pack_weights)
  const void* scales; // [N / 16][K / group_size][16]
  const void* biases;
  ScaleType scale_type;
  XForm xform;
  float* y;  // [M, N]
  int M, N, K, group_size, bits;
};
// Tiles [t0, t1) (rows 16 * t0 .. 16 * t1 of y) for every row of x. Needs AVX-512F/BW and AVX512-VNNI; the AVX2
// one computes the same integer sums (and the same float steps per row, on 8 lanes) without them, for int8 only.
void qmm_packed_rows_vnni(const PackedMatmulArgs& a, int t0, int t1);
// Tiles [t0, t1) of a packed weight dequantized to fp32 rows (DequantArgs's w, scales and biases in pack_weights's
// layout), for long prompts where one BLAS GEMM beats the packed kernel. Needs AVX-512F.
void dequant_packed_vnni(const DequantArgs& a, int t0, int t1);
void qmm_packed_rows_avx2(const PackedMatmulArgs& a, int t0, int t1);
// The same results bit for bit on AMX's tiles (TDPBSUD: 16 rows of x by 16 output rows a block), for many rows of x:
// where amx_ready() (the CPU has AMX-INT8, the extension was built with it, and Linux granted the tile state).
bool amx_ready();
void qmm_packed_rows_amx(const PackedMatmulArgs& a, int t0, int t1);
// The same weight transposed: wt[k][16 (t - t0) + j] = row 16 t + j's value at k, ld floats apart, for the GEMM
// x @ wt of a long prompt (a contiguous 64-byte store per k). Needs AVX-512F.
void dequant_packed_t_vnni(const DequantArgs& a, int t0, int t1, float* wt, size_t ld);

// MLX's row-major w [N, K * bits / 8 bytes] and scales/biases [N, G] (`param_bytes` each) in the packed layout, N a
// multiple of 16. A block (16 rows by 32 k) is 16 * 32 * bits / 8 bytes: the same bytes as MLX's layout, reordered.
// 4 bits: 4 runs of 64 bytes for k-steps s = 0..3 (4 consecutive k of the 16 rows, row-major), k-step s + 4 in the
// high nibbles. 5 and 6 bits: the 4-bit layout of the codes' low nibbles, then a plane of their high bits (as ggml's
// qh): 5 bits, 64 bytes, bit u of byte i the high bit of k-step u's code at place i of its run; 6 bits, two runs of
// 64 bytes, k-step u's two high bits at bits 2 (u % 4) and 2 (u % 4) + 1 of run u / 4. The kernels then make a
// k-step's whole codes with a shift, a mask and an OR per 64 bytes. 8 bits: 8 runs of 64 bytes. Parameters:
// [N / 16][G][16].
// param_bytes 0: compact parameters (ScaleType::compact), repacked per super-block. biases and biases_out null:
// symmetric parameters (no biases stored).
void pack_weights(const uint8_t* w, const void* scales, const void* biases, size_t param_bytes, int N, int K,
                  int group_size, int bits, uint8_t* w_out, void* scales_out, void* biases_out);
// Code (n, k) of MLX's layout: bits [k * bits, (k + 1) * bits) of row n's little-endian bit stream.
inline uint32_t plain_code(const uint8_t* row, int k, int bits) {
  const size_t bit = size_t(k) * bits;
  const uint32_t pair = row[bit / 8] | (bit % 8 + bits > 8 ? uint32_t(row[bit / 8 + 1]) << 8 : 0u);
  return (pair >> (bit % 8)) & ((1u << bits) - 1);
}
// Where pack_weights puts the code of (row n, column k): its low part's byte in the packed array (all 8 bits of it
// for 8 bits, else its low nibble), with in `shift` its place in that byte (4: the high nibble, which holds k + 16
// of the low one's k-step); and for 5 and 6 bits the byte and shift of its high bits (`high`, `high_shift`).
struct PackedPlace {
  size_t byte, high;
  int shift, high_shift;
};
inline PackedPlace packed_place(int K, int bits, int n, int k) {
  const int block_bytes = kPackedTile * 32 * bits / 8, j = n % kPackedTile, in_block = k % 32;
  const size_t block = (size_t(n / kPackedTile) * (K / 32) + k / 32) * block_bytes;
  const int u = in_block / 4, at = 4 * j + in_block % 4;  // k-step, and place in its run of 64
  if (bits == 8) return PackedPlace{block + 64 * u + at, 0, 0, 0};
  const PackedPlace low{block + 64 * (u % 4) + at, 0, u >= 4 ? 4 : 0, 0};
  if (bits == 4) return low;
  return PackedPlace{low.byte, block + 256 + (bits == 6 ? 64 * (u / 4) : 0) + at, low.shift,
                     bits == 6 ? 2 * (u % 4) : u};
}
inline uint32_t packed_code(const uint8_t* w, int K, int bits, int n, int k) {
  const PackedPlace p = packed_place(K, bits, n, k);
  if (bits == 8) return w[p.byte];
  const uint32_t low = (w[p.byte] >> p.shift) & 0x0F;
  return bits == 4 ? low : low | (((w[p.high] >> p.high_shift) & ((1u << (bits - 4)) - 1)) << 4);
}
// And the place of row n's parameter (scale or bias) of group g, of G.
inline size_t packed_param(int G, int n, int g) {
  return (size_t(n / kPackedTile) * G + g) * kPackedTile + n % kPackedTile;
}
// Where byte i (0 and 1: D's; 2 + p: group p's multiplier) of row n's compact super-block s is, of K values in
// groups of `group_size`: in MLX's layout, or with `packed` in pack_weights's.
inline size_t compact_place(int K, int group_size, int n, int s, int i, bool packed) {
  const int S = K / 256, B = compact_bytes(group_size);
  if (!packed) return (size_t(n) * S + s) * B + i;
  const size_t tile = (size_t(n / kPackedTile) * S + s) * kPackedTile * B;
  const int j = n % kPackedTile;
  return i < 2 ? tile + 2 * j + i : tile + 2 * kPackedTile + size_t(i - 2) * kPackedTile + j;
}
// Its inverse: the packed layout back to MLX's.
void unpack_weights(const uint8_t* w, const void* scales, const void* biases, size_t param_bytes, int N, int K,
                    int group_size, int bits, uint8_t* w_out, void* scales_out, void* biases_out);
// Rows of x [M, K] for the packed matmul: xq, xd and xsum as PackedMatmulArgs describes them. fixed24 needs
// AVX512-VNNI (it runs only where the VNNI kernel does).
void quantize_rows(const float* x, int M, int K, int group_size, XForm form, int8_t* xq, float* xd, float* xsum);
// One block of 32 values as fixed24: x = 2^e m with m an integer, 2^e the smallest power of two that puts the
// block's max |x| within kFixed24Max (so that |m| of the largest value is 2^22 .. 2^23: fp32's 24 significant bits,
// 23 when the top digit would overflow). Scaling by a power of two is exact: rounding to an integer is the only step
// that loses bits, and only bits below 2^e. The digits of m go to q[0..31] (d0), q[32..63] (d1), q[64..95] (d2), the
// sums of m over each half block to half_sums; returns 2^e (0 for a block of zeros, NaN where a value is NaN or
// infinite, with digits and sums 0). AVX-512: a prompt's rows are quantized for every projection, and in scalar
// code (a serial max, products in double) that was 4.7 ms of a 512-row, K = 2048 matmul. `nibbles`: m as
// fixed24_nibbles's four bytes instead (q[0..127]: e0, e1, e2, e3), the same m, 2^e and sums.
float fixed24_block_vnni(const float* xb, int8_t* q, int64_t (&half_sums)[2], bool nibbles = false);
// out = softmax(scale * x) over rows of length S (out may be x). With `causal`, row r is query r % L of L queries
// whose keys are the last L of S (MLX's lower-right causal mask): it sees its first S - L + r % L + 1 entries, and the
// rest are 0.
void softmax_rows_avx2(const float* x, float* out, size_t rows, int S, int L, float scale, bool causal);

// Attention of a few queries, whole: out[b, h, i] = softmax(scale * q[b, h, i] . k[b, g, :]) @ v[b, g, :] for query
// head h of key/value head g = h / (H / KVH). Rows of D floats are contiguous; the strides (in floats) place them.
// With `causal`, query i sees keys 0 .. S - L + i.
struct AttentionArgs {
  const float* q;
  const float* k;
  const float* v;
  int64_t q_stride[3];  // b, h, i
  int64_t k_stride[3];  // b, g, j
  int64_t v_stride[3];
  float* out;  // [B, H, L, D], dense
  int B, H, KVH, L, S, D;
  float scale;
  bool causal;
};
void attention_avx2(const AttentionArgs& a);
// The same with AVX-512F where the head size is a multiple of 16 up to 128 (`attention_avx512_fits`): each query
// row's dot products and weighted sum of values stay in registers (~2x fewer instructions a key).
bool attention_avx512_fits(const AttentionArgs& a);
void attention_avx512(const AttentionArgs& a);

// out = silu(gate) * up = gate * up / (1 + exp(-gate)), elementwise (out may be gate or up).
void swiglu_avx2(const float* gate, const float* up, float* out, size_t n);

// The nucleus (top-p, typical-p) of a row of n logits, in two passes.
// e = exp(x - max(x)) (0 where x is -inf), with sums in double: over a 49k vocabulary they are exact to float32
// rounding (a sequential float32 sum moved the cut).
struct ExpRow {
  float max;        // the largest entry (-inf when none is finite)
  float min;        // the smallest finite entry
  double sum;       // sum of e
  double weighted;  // sum of e * (x - max) over the entries with e > 0, when asked for (else 0)
};
ExpRow exp_row_avx2(const float* x, float* e, size_t n, bool weighted);

// Each entry's bucket: min(buckets - 1, floor(key * scale)), where key = |x - center| (typical) or center - x, in
// double; `buckets` itself where x is -inf or NaN. Nondecreasing in the key, and the key is the one the scalar code
// computes ((x - center) rounded once), so both sides agree on which bucket a token is in.
void bucket_row_avx2(const float* x, size_t n, bool typical, double center, double scale, int buckets,
                     uint16_t* bucket);

// out[i] = x[i] where bucket[i] < b, else -inf (out may be x).
void keep_below_avx2(const float* x, const uint16_t* bucket, int b, float* out, size_t n);

}  // namespace mlxchat
