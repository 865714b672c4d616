// Helpers the ops share for building their graph nodes.
#pragma once

#include "mlx/ops.h"

namespace mlxchat {

namespace mx = mlx::core;

inline mx::Stream cpu_stream() {
  return mx::default_stream(mx::Device(mx::Device::cpu));
}

// The kernels read their inputs as dense rows. Evaluated dense arrays pass as they are (no extra graph node); anything
// else gets a contiguous() node, which costs nothing when its result is already dense.
inline mx::array dense(const mx::array& a, const mx::Stream& s) {
  if (a.is_available() && a.flags().row_contiguous) return a;
  return mx::contiguous(a, false, s);
}

}  // namespace mlxchat
