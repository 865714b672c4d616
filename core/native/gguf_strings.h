// A GGUF header's string arrays (a vocabulary and its merges: ~100k strings) read in one native pass: in a Python
// loop they were ~40 ms of the embedded model's ~0.3 s load.
#pragma once

#include <cstdint>
#include <string>

#include <nanobind/nanobind.h>

namespace mlxchat {

namespace nb = nanobind;

// `count` GGUF strings (each a little-endian uint64 byte length and that many UTF-8 bytes) from byte `offset` of
// the file at `path`, as (list of str, the byte after the last, "") -- or, where the file ends inside one or one
// is not valid UTF-8, (the strings before it, the byte where the bad one starts, what was wrong: "ends" or
// "utf-8"). Throws std::runtime_error when the file cannot be opened or mapped.
nb::tuple gguf_strings(const std::string& path, int64_t offset, int64_t count);

}  // namespace mlxchat
