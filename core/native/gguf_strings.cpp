#include "gguf_strings.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace mlxchat {

namespace {

// The file mapped read-only for the length of one call.
struct Mapped {
  const uint8_t* data = nullptr;
  size_t size = 0;
  explicit Mapped(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw std::runtime_error("cannot open " + path + ": " + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      ::close(fd);
      throw std::runtime_error("cannot read " + path + ": " + std::strerror(errno));
    }
    size = size_t(st.st_size);
    void* p = size ? ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0) : nullptr;
    ::close(fd);
    if (p == MAP_FAILED) throw std::runtime_error("cannot map " + path + ": " + std::strerror(errno));
    data = static_cast<const uint8_t*>(p);
  }
  ~Mapped() {
    if (data) ::munmap(const_cast<uint8_t*>(data), size);
  }
  Mapped(const Mapped&) = delete;
  Mapped& operator=(const Mapped&) = delete;
};

}  // namespace

nb::tuple gguf_strings(const std::string& path, int64_t offset, int64_t count) {
  const Mapped file(path);
  nb::list out;
  size_t pos = offset < 0 ? file.size + 1 : size_t(offset);
  for (int64_t i = 0; i < count; ++i) {
    if (pos > file.size || file.size - pos < 8) return nb::make_tuple(out, pos, "ends");
    uint64_t n;
    std::memcpy(&n, file.data + pos, 8);  // little-endian, as every platform MLX runs on
    if (file.size - pos - 8 < n) return nb::make_tuple(out, pos, "ends");
    PyObject* s = PyUnicode_DecodeUTF8(reinterpret_cast<const char*>(file.data + pos + 8), Py_ssize_t(n), "strict");
    if (!s) {
      PyErr_Clear();
      return nb::make_tuple(out, pos, "utf-8");
    }
    out.append(nb::steal(s));
    pos += 8 + n;
  }
  return nb::make_tuple(out, pos, "");
}

}  // namespace mlxchat
