#include "kungfu/buffer.h"

#include <cstdlib>
#include <map>
#include <mutex>
#include <new>
#include <vector>

namespace kungfu {

// ---------------------------------------------------------------------------------------------
// Buffer pool: power-of-two size classes from 4 KiB; at most kPoolLimit bytes kept idle.

namespace {
constexpr size_t kPoolLimit = size_t(512) << 20;
constexpr size_t kMinClass = 4096;

struct Pool {
  std::mutex mu;
  std::map<size_t, std::vector<char*>> free;
  size_t idle_bytes = 0;
};
Pool& GlobalPool() {
  static Pool* pool = new Pool();  // leaked: outlives every static Buffer
  return *pool;
}
size_t SizeClass(size_t n) {
  if (n > (size_t(1) << 62)) return n;  // no power of two above; the allocation fails anyway
  size_t c = kMinClass;
  while (c < n) c <<= 1;
  return c;
}
}  // namespace

Buffer::Buffer(size_t size) : size_(size) {
  if (size == 0) return;
  capacity_ = SizeClass(size);
  Pool& pool = GlobalPool();
  {
    std::lock_guard<std::mutex> lk(pool.mu);
    auto it = pool.free.find(capacity_);
    if (it != pool.free.end() && !it->second.empty()) {
      data_ = it->second.back();
      it->second.pop_back();
      pool.idle_bytes -= capacity_;
      return;
    }
  }
  // malloc, not new: a size a peer or a caller got wrong is a bad_alloc to report, and
  // sanitizer runtimes return null for it (allocator_may_return_null) where new would abort.
  data_ = static_cast<char*>(std::malloc(capacity_));
  if (data_ == nullptr) throw std::bad_alloc();
}

Buffer::Buffer(Buffer&& o) noexcept : data_(o.data_), size_(o.size_), capacity_(o.capacity_) {
  o.data_ = nullptr;
  o.size_ = o.capacity_ = 0;
}

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    Release();
    data_ = o.data_;
    size_ = o.size_;
    capacity_ = o.capacity_;
    o.data_ = nullptr;
    o.size_ = o.capacity_ = 0;
  }
  return *this;
}

Buffer::~Buffer() { Release(); }

void Buffer::Release() {
  if (data_ == nullptr) return;
  Pool& pool = GlobalPool();
  {
    std::lock_guard<std::mutex> lk(pool.mu);
    if (pool.idle_bytes + capacity_ <= kPoolLimit) {
      pool.free[capacity_].push_back(data_);
      pool.idle_bytes += capacity_;
      data_ = nullptr;
    }
  }
  std::free(data_);
  data_ = nullptr;
}

}  // namespace kungfu
