#include "convert.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "kernel.h"
#include "mlx/allocator.h"
#include "mlx/ops.h"
#include "mlx/types/half_types.h"
#include "qmm.h"

namespace mlxchat {

namespace {

// A ggml type as MLX's affine form holds it (gguf_tensors.py's table).
struct Format {
  const char* name;
  int block_values, block_bytes, bits, group_size;
  bool k_quant;    // parameters in the compact form (two levels, as the file has them)
  bool symmetric;  // each bias is -2^(bits - 1) times its scale: native.symmetric_biases' stand-in takes their place
};
constexpr std::array<Format, 8> kFormats{{{"Q4_0", 32, 18, 4, 32, false, true},
                                          {"Q4_1", 32, 20, 4, 32, false, false},
                                          {"Q5_0", 32, 22, 5, 32, false, true},
                                          {"Q5_1", 32, 24, 5, 32, false, false},
                                          {"Q8_0", 32, 34, 8, 32, false, true},
                                          {"Q4_K", 256, 144, 4, 32, true, false},
                                          {"Q5_K", 256, 176, 5, 32, true, false},
                                          {"Q6_K", 256, 210, 6, 16, true, false}}};

// One block: its values' codes (MLX's, unsigned) and, for a K-quant (one compact super-block), its parameters: D's
// f16 bits and the groups' multipliers, for the scales and for the biases. (A legacy block is one group, its f16
// scale and bias its first bytes.)
struct Block {
  uint8_t codes[256];
  uint16_t scale, bias;
  int8_t scale_q[16], bias_q[16];
};

uint16_t u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
float f16_value(uint16_t bits) {
  mx::float16_t h;
  std::memcpy(&h, &bits, 2);
  return static_cast<float>(h);
}
uint16_t f16_bits(float v) {
  const mx::float16_t h(v);
  uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
}
// d * m as an f16, as NumPy computes an f16 times an f16 constant (in float, rounded once).
uint16_t f16_times(uint16_t d, float m) { return f16_bits(f16_value(d) * m); }
// d * -2^k, the legacy types' bias: where d is a normal number whose product stays normal, a sign flip and k more in
// the exponent, which is what the float product rounds to; otherwise through float. (MLX's f16 conversions are
// software here: a 1.1B Q4_0 file's reading took 0.80 s of one core through float, 0.76 s so.)
uint16_t f16_times_minus_pow2(uint16_t d, int k) {
  const int e = (d >> 10) & 0x1F;
  if (e != 0 && e + k < 31) return uint16_t((d ^ 0x8000) + (k << 10));
  return f16_times(d, -float(1 << k));
}

// Four bytes at p as one little-endian word, and back.
uint32_t word_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
void put_word(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }

// The legacy blocks are decoded four codes at a time, one code a byte of a 32-bit word, as put_packed32 reads them:
// byte stores read back as words stall on store forwarding (Q5_0's fifth bits, set a byte at a time, made its
// reading ~8x slower per byte than Q4_0's).

// A 32-value ggml block's 4-bit halves: byte j holds value j (low nibble) and value j + 16 (high).
void nibbles32(const uint8_t* qs, uint8_t* codes) {
  for (int u = 0; u < 4; ++u) {
    const uint32_t w = word_at(qs + 4 * u);
    put_word(codes + 4 * u, w & 0x0F0F0F0Fu);
    put_word(codes + 16 + 4 * u, (w >> 4) & 0x0F0F0F0Fu);
  }
}
// Bit r of a 4-bit `nibble` on bit 0 of byte r, as nibble * (1 + 2^7 + 2^14 + 2^21): copy r of it starts at bit
// 7r, so its bit r lands on bit 8r, no copies overlapping.
uint32_t spread4(uint32_t nibble) { return (nibble * 0x00204081u) & 0x01010101u; }
// Q5_0/Q5_1's fifth bits: bit j of the little-endian uint32 belongs to value j.
void fifth_bits32(const uint8_t* qh, uint8_t* codes) {
  const uint32_t h = word_at(qh);
  for (int u = 0; u < 8; ++u) put_word(codes + 4 * u, word_at(codes + 4 * u) | (spread4((h >> (4 * u)) & 0xFu) << 4));
}
// Q4_K/Q5_K's 4 runs of 32 bytes: run c holds values 64c .. 64c + 31 (low nibbles) and the next 32 (high).
void k_nibbles(const uint8_t* qs, uint8_t* codes) {
  for (int c = 0; c < 4; ++c) {
    for (int l = 0; l < 32; ++l) {
      codes[64 * c + l] = qs[32 * c + l] & 0x0F;
      codes[64 * c + 32 + l] = qs[32 * c + l] >> 4;
    }
  }
}
// Q4_K/Q5_K's parameters: scale d * sc and bias -(dmin * m) per group, as compact's D = d, q = sc and D = -dmin,
// q = m: float(q) * D is that float32 value bit for bit (a sign flip commutes with IEEE multiplication, zeros too).
void k_params(const uint8_t* b, Block& out) {
  const uint8_t* s = b + 4;  // ggml's get_scale_min_k4: eight 6-bit scales and eight 6-bit mins in 12 bytes
  for (int g = 0; g < 8; ++g) {
    const int sc = g < 4 ? s[g] & 63 : (s[g + 4] & 0x0F) | ((s[g - 4] >> 6) << 4);
    const int m = g < 4 ? s[g + 4] & 63 : (s[g + 4] >> 4) | ((s[g] >> 6) << 4);
    out.scale_q[g] = int8_t(sc);
    out.bias_q[g] = int8_t(m);
  }
  out.scale = u16(b);
  out.bias = u16(b + 2) ^ 0x8000;
}

// Decodes block `b` of type kFormats[T]: its codes, and a K-quant's parameters (a legacy block's, its first bytes,
// convert_rows reads itself); false where they do not fit the compact form.
template <int T>
bool decode(const uint8_t* b, Block& out) {
  uint8_t* q = out.codes;
  switch (T) {
    case 0:  // Q4_0: d, 16 bytes of nibbles; w = d * (q - 8)
      nibbles32(b + 2, q);
      return true;
    case 1:  // Q4_1: d, m, nibbles; w = d * q + m
      nibbles32(b + 4, q);
      return true;
    case 2:  // Q5_0: d, qh, nibbles; w = d * (q - 16)
      nibbles32(b + 6, q);
      fifth_bits32(b + 2, q);
      return true;
    case 3:  // Q5_1: d, m, qh, nibbles
      nibbles32(b + 8, q);
      fifth_bits32(b + 4, q);
      return true;
    case 4:  // Q8_0: d, 32 int8; MLX's codes are unsigned: q + 128, bias -128 d
      for (int u = 0; u < 8; ++u) put_word(q + 4 * u, word_at(b + 2 + 4 * u) ^ 0x80808080u);  // q + 128
      return true;
    case 5:  // Q4_K: d, dmin, 12 bytes of scales and mins, 128 bytes of nibbles
      k_nibbles(b + 16, q);
      k_params(b, out);
      return true;
    case 6: {  // Q5_K: as Q4_K, then 32 bytes of fifth bits (value 32 i + l: bit i of qh[l]), then the nibbles
      k_nibbles(b + 48, q);
      const uint8_t* qh = b + 16;
      for (int i = 0; i < 8; ++i) {
        for (int l = 0; l < 32; ++l) q[32 * i + l] |= uint8_t(((qh[l] >> i) & 1) << 4);
      }
      k_params(b, out);
      return true;
    }
    case 7: {  // Q6_K: ql[128], qh[64], 16 int8 scales, d; w = d * sc * (q - 32) per 16 values
      for (int h = 0; h < 2; ++h) {
        const uint8_t* ql = b + 64 * h;
        const uint8_t* qh = b + 128 + 32 * h;
        for (int l = 0; l < 64; ++l) {
          q[128 * h + l] = ql[l] & 0x0F;
          q[128 * h + 64 + l] = ql[l] >> 4;
        }
        for (int t = 0; t < 4; ++t) {
          for (int l = 0; l < 32; ++l) q[128 * h + 32 * t + l] |= uint8_t(((qh[l] >> (2 * t)) & 3) << 4);
        }
      }
      // Scales d * sc: D = d, q = sc. Biases d * sc * -32 (gguf_tensors.py's order): D = -32 d, exact while it is
      // an f16 (a power-of-two multiple), and then float(sc) * D is the same product.
      for (int g = 0; g < 16; ++g) out.scale_q[g] = out.bias_q[g] = int8_t(b[192 + g]);
      out.scale = u16(b + 208);
      const float d32 = f16_value(out.scale) * -32.0f;
      out.bias = f16_bits(d32);
      return std::isfinite(d32) && f16_value(out.bias) == d32;
    }
  }
  return false;
}

// 32 codes of `bits` as MLX packs them: a little-endian bit stream (4 * bits bytes).
template <int bits>
void put_plain32(const uint8_t* codes, uint8_t* out) {
  if constexpr (bits == 8) {
    std::memcpy(out, codes, 32);
    return;
  }
  if constexpr (bits == 4) {
    for (int j = 0; j < 16; ++j) out[j] = uint8_t(codes[2 * j] | (codes[2 * j + 1] << 4));
    return;
  }
  for (int e = 0; e < 4; ++e) {  // 8 codes of b bits are b whole bytes
    uint64_t word = 0;
    for (int i = 0; i < 8; ++i) word |= uint64_t(codes[8 * e + i]) << (i * bits);
    std::memcpy(out + e * bits, &word, size_t(bits));  // little-endian: the low `bits` bytes
  }
}

// 32 codes of tile row j into their 16 x 32 block of pack_weights's layout (kernel.h's packed_place, written out:
// every byte of the block belongs to one row, so each is written whole, no zeroing and ORing). Code i is at k-step
// u = i / 4, place 4 j + i % 4 of a run of 64 bytes: 8 bits take a byte each in runs u; the rest share low-nibble
// bytes, code m (m < 16) with code m + 16 in its high nibble, in runs m / 4; 5 bits add a byte per place in run 4
// with code 4u + r's fifth bit at bit u; 6 bits two, runs 4 and 5, with code 4u + r's top two bits at 2 (u % 4).
// Four codes at a time as one 32-bit word, one code a byte: no code's bits reach its neighbour's byte under the masks
// and shifts below. (Built a byte at a time in a stack array and read back as a vector, the low-nibble bytes stalled
// on store forwarding: the reading of a 1.1B Q6_K embedding spent ~14% of its time on that one load.)
template <int bits>
void put_packed32(const uint8_t* c, int j, uint8_t* block) {
  if constexpr (bits == 8) {
    for (int u = 0; u < 8; ++u) std::memcpy(block + 64 * u + 4 * j, c + 4 * u, 4);
    return;
  }
  constexpr uint32_t low = 0x0F0F0F0Fu;
  for (int u = 0; u < 4; ++u) {
    put_word(block + 64 * u + 4 * j, (word_at(c + 4 * u) & low) | ((word_at(c + 16 + 4 * u) & low) << 4));
  }
  if constexpr (bits > 4) {
    constexpr int high_bits = bits - 4, per_byte = 8 / high_bits;  // 5 bits: 8 codes a byte; 6 bits: 4
    constexpr uint32_t mask = high_bits == 1 ? 0x01010101u : 0x03030303u;
    for (int h = 0; h < 8 / per_byte; ++h) {
      uint32_t high = 0;
      for (int t = 0; t < per_byte; ++t) high |= ((word_at(c + 4 * (per_byte * h + t)) >> 4) & mask) << (high_bits * t);
      put_word(block + 256 + 64 * h + 4 * j, high);
    }
  }
}

// Whether a legacy symmetric type's bias (d * -2^k, k = bits - 1, as f16_times_minus_pow2 makes it) is that
// product in float32 too, bit for bit (native.biases_symmetric's test): then the kernels compute it from the scale
// (native.symmetric_biases' stand-in) and it is never stored. From d's exponent e alone (a float conversion per
// block, software here, made reading Q8_0 and Q5_0 ~2x slower): a power-of-two multiple of a zero, a subnormal or
// a normal d is exact in f16 unless it overflows (e + k > 30); an infinite or NaN d (e = 31) keeps stored biases.
bool bias_is_symmetric(uint16_t scale, int k) {
  const int e = (scale >> 10) & 0x1F;
  return e == 0 || e + k < 31;
}

// A Q4_0, Q4_1, Q5_0 or Q5_1 block (kFormats[T], T < 4) straight into row j of its 16 x 32 block of pack_weights'
// layout, with no codes between: the packed layout pairs value m with value m + 16 in a byte's nibbles, as ggml's
// blocks do, so its four low-nibble words are the block's own bytes; a 5-bit block's fifth bits make one word more,
// whose byte r holds bits r, r + 4, ..., r + 28 of qh (put_packed32's places). Decoded to codes first, the
// embedded model's Q5_0 tensors took ~32 ms of a core to read.
template <int T>
void put_packed_legacy(const uint8_t* b, int j, uint8_t* block) {
  constexpr int qs = T == 0 ? 2 : T == 1 ? 4 : T == 2 ? 6 : 8;
  for (int u = 0; u < 4; ++u) put_word(block + 64 * u + 4 * j, word_at(b + qs + 4 * u));
  if constexpr (T == 2 || T == 3) {
    const uint32_t h = word_at(b + (T == 2 ? 2 : 4));
    uint32_t high = 0;
    for (int t = 0; t < 8; ++t) high |= spread4((h >> (4 * t)) & 0xFu) << t;
    put_word(block + 256 + 4 * j, high);
  }
}

// The tensor's output arrays, and what places a row's values in them. `biases` is null for a symmetric type
// (Q4_0, Q5_0, Q8_0): read_ggml makes them from the scales, after, where some block's bias is not symmetric.
struct Out {
  uint8_t *w, *scales, *biases;
  int K, group_size;
  size_t row_out;
  bool packed;
};

// Rows [n0, n1) of kFormats[T] from their file bytes `in` into `out`; false where a block's parameters do not fit
// the compact form. A symmetric type's biases are not written: `asymmetric` is set where a block's is not
// symmetric.
template <int T>
bool convert_rows(const uint8_t* in, int n0, int n1, const Out& out, std::atomic<bool>& asymmetric) {
  constexpr Format f = kFormats[T];
  constexpr int bits = f.bits, values = f.block_values;
  const int K = out.K, blocks = K / values, G = K / f.group_size;
  const size_t row_in = size_t(blocks) * f.block_bytes, tile_block = size_t(kPackedTile) * 32 * bits / 8;
  auto* s16 = reinterpret_cast<uint16_t*>(out.scales);
  auto* b16 = reinterpret_cast<uint16_t*>(out.biases);
  Block block;
  for (int n = n0; n < n1; ++n) {
    const uint8_t* row = in + size_t(n - n0) * row_in;
    for (int b = 0; b < blocks; ++b) {
      const uint8_t* src = row + size_t(b) * f.block_bytes;
      bool placed = false;  // Q4_0 .. Q5_1 in the packed layout: the block's own bytes, no codes between
      if constexpr (T < 4) {
        if (out.packed) {
          put_packed_legacy<T>(src, n % kPackedTile, out.w + (size_t(n / kPackedTile) * (K / 32) + b) * tile_block);
          placed = true;
        }
      }
      if (!placed) {
        if (!decode<T>(src, block)) return false;
        for (int c = 0; c < values / 32; ++c) {
          const int kb = b * (values / 32) + c;  // the 32-value block along K
          if (out.packed) {
            put_packed32<bits>(block.codes + 32 * c, n % kPackedTile,
                               out.w + (size_t(n / kPackedTile) * (K / 32) + kb) * tile_block);
          } else {
            put_plain32<bits>(block.codes + 32 * c, out.w + size_t(n) * out.row_out + size_t(kb) * 4 * bits);
          }
        }
      }
      if constexpr (!f.k_quant) {  // a legacy block starts with d, then (Q4_1, Q5_1) m
        const size_t at = out.packed ? packed_param(G, n, b) : size_t(n) * G + b;
        s16[at] = u16(src);
        if constexpr (f.symmetric) {
          if (!bias_is_symmetric(u16(src), bits - 1)) asymmetric.store(true, std::memory_order_relaxed);
        } else {
          b16[at] = u16(src + 2);
        }
      } else {
        for (int i = 0; i < 2; ++i) {
          const size_t at = compact_place(K, f.group_size, n, b, i, out.packed);
          out.scales[at] = uint8_t(block.scale >> (8 * i));
          out.biases[at] = uint8_t(block.bias >> (8 * i));
        }
        for (int g = 0; g < compact_groups(f.group_size); ++g) {
          const size_t at = compact_place(K, f.group_size, n, b, 2 + g, out.packed);
          out.scales[at] = uint8_t(block.scale_q[g]);
          out.biases[at] = uint8_t(block.bias_q[g]);
        }
      }
    }
  }
  return true;
}

bool convert(int type, const uint8_t* in, int n0, int n1, const Out& out, std::atomic<bool>& asymmetric) {
  switch (type) {
    case 0: return convert_rows<0>(in, n0, n1, out, asymmetric);
    case 1: return convert_rows<1>(in, n0, n1, out, asymmetric);
    case 2: return convert_rows<2>(in, n0, n1, out, asymmetric);
    case 3: return convert_rows<3>(in, n0, n1, out, asymmetric);
    case 4: return convert_rows<4>(in, n0, n1, out, asymmetric);
    case 5: return convert_rows<5>(in, n0, n1, out, asymmetric);
    case 6: return convert_rows<6>(in, n0, n1, out, asymmetric);
    case 7: return convert_rows<7>(in, n0, n1, out, asymmetric);
  }
  return false;
}

// pread until `n` bytes are in, or an error or the end of the file.
bool read_all(int fd, uint8_t* out, size_t n, int64_t offset) {
  while (n > 0) {
    const ssize_t got = ::pread(fd, out, n, offset);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    out += got;
    n -= size_t(got);
    offset += got;
  }
  return true;
}

struct File {
  int fd;
  explicit File(const std::string& path) : fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC)) {
    if (fd < 0) throw std::runtime_error("cannot open " + path + ": " + std::strerror(errno));
  }
  ~File() { ::close(fd); }
};

// One place of read_ggml_many (convert.h) from the open file.
std::optional<std::vector<mx::array>> read_tensor(const File& file, int64_t offset, const std::string& type, int N,
                                                  int K, bool packed) {
  const auto it = std::find_if(kFormats.begin(), kFormats.end(), [&](const Format& f) { return type == f.name; });
  if (it == kFormats.end()) throw std::invalid_argument("read_ggml cannot read tensor type " + type);
  const Format f = *it;
  const int type_index = int(it - kFormats.begin());
  if (N <= 0 || K <= 0 || K % f.block_values != 0 || (packed && N % kPackedTile != 0)) {
    throw std::invalid_argument("read_ggml: a " + type + " tensor of " + std::to_string(N) + " rows of " +
                                std::to_string(K) + " values does not fit its blocks" +
                                (packed ? " or tiles of 16 rows" : ""));
  }
  const int row_in = K / f.block_values * f.block_bytes;
  const size_t row_out = size_t(K) * f.bits / 8;
  const int param_cols = f.k_quant ? K / 256 * compact_bytes(f.group_size) : K / f.group_size;
  mx::array w(mx::allocator::malloc(size_t(N) * row_out), {N, int(row_out / 4)}, mx::uint32);
  const mx::Dtype param_type = f.k_quant ? mx::uint8 : mx::float16;
  const size_t param_bytes = size_t(N) * param_cols * mx::size_of(param_type);
  mx::array scales(mx::allocator::malloc(param_bytes), {N, param_cols}, param_type);
  // A symmetric type's biases are made only if some block's is not symmetric (then from the scales, after): the
  // stand-in takes their place, and storing them first cost the load's peak a ninth of a Q4_0 file's size.
  mx::array biases = f.symmetric ? mx::zeros({N, 0}, mx::float16)
                                 : mx::array(mx::allocator::malloc(param_bytes), {N, param_cols}, param_type);
  const Out out{w.data<uint8_t>(), scales.data<uint8_t>(), f.symmetric ? nullptr : biases.data<uint8_t>(), K,
                f.group_size, row_out, packed};
  std::atomic<bool> asymmetric{false};

  // Pieces of whole tiles of 16 rows, ~64 KB of the file each: a piece is read, decoded and written by one thread.
  // At 256 KB most of the embedded model's tensors (576 x 576 Q5_0: 228 KB) were one piece, read on one core.
  const int tiles = (N + kPackedTile - 1) / kPackedTile;
  const int tiles_per_piece = std::max(1, int((64 << 10) / (size_t(row_in) * kPackedTile)));
  const int pieces = (tiles + tiles_per_piece - 1) / tiles_per_piece;
  std::atomic<int> failure{0};  // 1: the read failed or ended early; 2: parameters the compact form cannot hold
  // No lingering after: the loader builds the tokenizer on another thread meanwhile, which a polling helper's core
  // would not run.
  parallel_pieces(pieces, [&](int piece) {
    if (failure.load(std::memory_order_relaxed)) return;
    const int n0 = piece * tiles_per_piece * kPackedTile, n1 = std::min(N, n0 + tiles_per_piece * kPackedTile);
    thread_local std::vector<uint8_t> in;
    in.resize(size_t(n1 - n0) * row_in);
    if (!read_all(file.fd, in.data(), in.size(), offset + int64_t(n0) * row_in)) {
      failure = 1;
      return;
    }
    if (!convert(type_index, in.data(), n0, n1, out, asymmetric)) failure = 2;
  }, /*linger=*/false);
  if (failure == 1) throw std::runtime_error("the tensor ends past the end of the file (it is truncated)");
  if (failure == 2) return std::nullopt;
  if (asymmetric) {  // each bias d * -2^(bits - 1) as an f16, in the scales' places (either layout)
    biases = mx::array(mx::allocator::malloc(param_bytes), {N, param_cols}, param_type);
    const auto* s16 = scales.data<uint16_t>();
    auto* b16 = biases.data<uint16_t>();
    for (size_t i = 0; i < size_t(N) * param_cols; ++i) b16[i] = f16_times_minus_pow2(s16[i], f.bits - 1);
  }
  return std::vector<mx::array>{std::move(w), std::move(scales), std::move(biases)};
}

}  // namespace

std::vector<std::optional<std::vector<mx::array>>> read_ggml_many(const std::string& path,
                                                                 const std::vector<GgmlPlace>& places) {
  const File file(path);
  std::vector<std::optional<std::vector<mx::array>>> out;
  out.reserve(places.size());
  for (const GgmlPlace& p : places) out.push_back(read_tensor(file, p.offset, p.type, p.N, p.K, p.packed));
  return out;
}

}  // namespace mlxchat
