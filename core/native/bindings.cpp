// Python bindings. NB_DOMAIN mlx (set in CMakeLists.txt) shares nanobind's type registry with mlx.core, so mx.array
// arguments and results pass through as MLX's own type.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "blocks.h"
#include "convert.h"
#include "gguf_strings.h"
#include "layer.h"
#include "nucleus.h"
#include "qmm.h"
#include "draw_ops.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_ext, m) {
  m.doc() = "mlxchat's native quantized matmul and attention/MLP/sampling ops for MLX's CPU backend";
  m.def("quantized_matmul", &mlxchat::quantized_matmul, "x"_a, "w"_a, "scales"_a, "biases"_a, nb::kw_only(),
        "group_size"_a, "bits"_a, "packed"_a = false, "int8"_a = false,
        "x @ dequantize(w, scales, biases).T (MLX affine format); packed: packed weights, x as int8 or fixed24.");
  m.def("pack_weights", &mlxchat::pack_weights, "w"_a, "scales"_a, "biases"_a, nb::kw_only(), "group_size"_a,
        "bits"_a, "[w, scales, biases] in the packed matmul's tiles of 16 rows.");
  m.def("unpack_weights", &mlxchat::unpack_weights, "w"_a, "scales"_a, "biases"_a, nb::kw_only(), "group_size"_a,
        "bits"_a, "pack_weights's [w, scales, biases] back in MLX's layout.");
  m.def("packed_lookup", &mlxchat::packed_lookup, "ids"_a, "w"_a, "scales"_a, "biases"_a, nb::kw_only(),
        "group_size"_a, "bits"_a, "Rows ids of a packed weight, dequantized as MLX's dequantize does.");
  m.def("compact_params", &mlxchat::compact_params, "scales"_a, "biases"_a, nb::kw_only(), "group_size"_a,
        "float32 K-quant scales and biases in the compact two-level form (uint8 arrays), or None if not exact.");
  m.def("expand_params", &mlxchat::expand_params, "scales"_a, "biases"_a, nb::kw_only(), "group_size"_a,
        "packed"_a = false, "compact_params's arrays back as float32 [N, G] in MLX's layout.");
  m.def("biases_symmetric", &mlxchat::biases_symmetric, "scales"_a, "biases"_a, nb::kw_only(), "bits"_a,
        "Whether every float16 bias is -2^(bits - 1) times its scale, exactly in float32.");
  nb::class_<mlxchat::GgmlPlace>(m, "GgmlPlace")
      .def(nb::init<int64_t, std::string, int, int, bool>(), "offset"_a, "type"_a, "N"_a, "K"_a, "packed"_a);
  // Without the GIL: the loader builds the tokenizer in Python while the tensors are read (core/model/loader.py).
  m.def("read_ggml_many", &mlxchat::read_ggml_many, "path"_a, "places"_a, nb::call_guard<nb::gil_scoped_release>(),
        "Each GgmlPlace's ggml-quantized tensor of one GGUF file as [w, scales, biases] or None, in one call.");
  m.def("gguf_strings", &mlxchat::gguf_strings, "path"_a, "offset"_a, "count"_a,
        "count GGUF metadata strings from byte offset: (list, end, '' or where it went wrong: 'ends', 'utf-8').");
  m.def("int8_kernel_name", &mlxchat::int8_kernel_name);
  m.def("packs_exact", &mlxchat::packs_exact);
  m.def("packs_on_amx", &mlxchat::packs_on_amx);
  m.def("dequantized_matmul", &mlxchat::dequantized_matmul, "x"_a, "w"_a, "scales"_a, "biases"_a, nb::kw_only(),
        "group_size"_a, "bits"_a, "packed"_a = false,
        "x @ dequantize(w).T by BLAS's GEMM on cache-sized pieces of the dequantized weight (long prompts).");
  m.def("dequantize", &mlxchat::dequantize, "w"_a, "scales"_a, "biases"_a, nb::kw_only(), "group_size"_a, "bits"_a,
        "packed"_a = false, "The fp32 weight [N, K] of an affine-quantized one (packed: pack_weights's layout).");
  m.def("softmax", &mlxchat::softmax, "x"_a, nb::kw_only(), "scale"_a = 1.0f, "causal"_a = false,
        "softmax(scale * x) along the last axis, float32; causal: MLX's lower-right mask over the last two axes.");
  m.def("attention", &mlxchat::attention, "q"_a, "k"_a, "v"_a, nb::kw_only(), "scale"_a, "causal"_a = false,
        "Attention of a few float32 queries [B, H, L, D] over k, v [B, H_kv, S, D], in one op.");
  m.def("nucleus", &mlxchat::nucleus, "logits"_a, "p"_a, nb::kw_only(), "typical"_a = false,
        "Top-p (or typical-p) along the last axis of float32 logits: the kept tokens' logits, -inf elsewhere.");
  m.def("top_k_index", &mlxchat::top_k_index, "logits"_a, "k"_a,
        "Positions (ascending) of the k largest float32 logits along the last axis; ties: the lowest positions.");
  m.def("uniform_at", &mlxchat::uniform_at, "ids"_a, "words"_a,
        "core/sampling/draw.py's uniform numbers for uint32 ids and two uint32 words, bit for bit, as one op.");
  m.def("gumbel_argmax", &mlxchat::gumbel_argmax, "logits"_a, "ids"_a, "words"_a,
        "core/sampling/draw.py's Gumbel-max draw along the last axis (positions), MLX's ops to the bit, as one op.");
  nb::class_<mlxchat::DryBreakers>(m, "DryBreakers")
      .def(nb::init<const std::vector<int32_t>&, const std::vector<int32_t>&, const std::vector<int32_t>&>(),
           "heads"_a, "offsets"_a, "tails"_a);
  m.def("dry_penalty", &mlxchat::dry_penalty, "logits"_a, "history"_a, "breakers"_a, nb::kw_only(), "multiplier"_a,
        "base"_a, "allowed_length"_a, "llama.cpp's DRY penalty on float32 logits [V] after int32 history ids, as one op.");
  m.def("penalties", &mlxchat::penalties, "logits"_a, "ids"_a, "counts"_a, nb::kw_only(), "repetition"_a = 1.0f,
        "frequency"_a = 0.0f, "presence"_a = 0.0f,
        "The repetition, frequency and presence penalties at the history's ids of float32 logits [V], as one op.");
  m.def("swiglu", &mlxchat::swiglu, "gate"_a, "up"_a, "silu(gate) * up, float32.");
  nb::class_<mlxchat::LayerShape>(m, "LayerShape")
      .def("__init__",
           [](mlxchat::LayerShape* t, int n_heads, int n_kv_heads, int head_dim, float norm_eps, int rope_dims,
              bool rope_traditional, float rope_scale, float attention_scale, bool qk_norm) {
             new (t) mlxchat::LayerShape{n_heads, n_kv_heads, head_dim, norm_eps, rope_dims, rope_traditional,
                                         rope_scale, attention_scale, qk_norm};
           },
           nb::kw_only(), "n_heads"_a, "n_kv_heads"_a, "head_dim"_a, "norm_eps"_a, "rope_dims"_a,
           "rope_traditional"_a, "rope_scale"_a, "attention_scale"_a, "qk_norm"_a = false)
      .def_ro("n_kv_heads", &mlxchat::LayerShape::n_kv_heads)
      .def_ro("head_dim", &mlxchat::LayerShape::head_dim);
  m.def("rope_inv_freqs", &mlxchat::rope_inv_freqs, "dims"_a, "base"_a);
  nb::class_<mlxchat::LayerWeights>(m, "LayerWeights");
  m.def("layer_weights", &mlxchat::layer_weights, "weights"_a, "group_sizes"_a, "bits"_a, "packed"_a, "int8"_a,
        "shape"_a, "A layer's parameters for decoder_layer, checked once.");
  m.def("decoder_layer", &mlxchat::decoder_layer, "h"_a, "keys"_a, "values"_a, "layer"_a, nb::kw_only(), "offset"_a,
        "causal"_a, "left_padding"_a, "A llama decoder layer for a few rows as one op: (h_out, keys_out, values_out).");
  m.def("cpu_supported", &mlxchat::cpu_supported);
  m.def("cpu_unsupported_reason", &mlxchat::cpu_unsupported_reason);
  m.def("set_threads", &mlxchat::set_threads, "n"_a);
  m.def("threads", &mlxchat::threads);
  m.def("kernel_seconds", &mlxchat::kernel_seconds);
  m.def("kernel_name", &mlxchat::kernel_name);
}
