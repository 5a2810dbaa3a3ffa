// Buffer: heap memory from a process-wide pool of power-of-two size classes, the unit in which
// messages arrive and operations keep their scratch space.
#pragma once
#include <cstddef>

namespace kungfu {

// A heap buffer from a process-wide pool (size classes are powers of two); returns itself to the
// pool when destroyed.
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(size_t size);
  Buffer(Buffer&& o) noexcept;
  Buffer& operator=(Buffer&& o) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer();
  char* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  void Release();
  char* data_ = nullptr;
  size_t size_ = 0;
  size_t capacity_ = 0;
};

}  // namespace kungfu
