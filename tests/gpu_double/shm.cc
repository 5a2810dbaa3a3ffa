#include "shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

namespace kfdouble {

using namespace kungfu::cuda_abi;  // NOLINT: the ABI's C names

namespace {

// Maps the segment `name`, creating it if needed (step 1). nullptr on failure, with `*why`.
Layout* MapSegment(const std::string& name, std::string* why) {
  const int fd = shm_open(name.c_str(), O_CREAT | O_RDWR, 0600);
  if (fd < 0) {
    *why = "shm_open(" + name + "): " + std::strerror(errno);
    return nullptr;
  }
  if (ftruncate(fd, sizeof(Layout)) != 0) {
    *why = "ftruncate(" + name + "): " + std::strerror(errno);
    close(fd);
    return nullptr;
  }
  void* p = mmap(nullptr, sizeof(Layout), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);  // the mapping keeps the segment
  if (p == MAP_FAILED) {
    *why = "mmap(" + name + "): " + std::strerror(errno);
    return nullptr;
  }
  return static_cast<Layout*>(p);
}

}  // namespace

ncclResult_t Segment::Join(const std::string& name, int nranks, int rank, int64_t timeout_ms,
                           std::string* why) {
  layout_ = MapSegment(name, why);
  if (layout_ == nullptr) return ncclSystemError;
  nranks_ = nranks;
  rank_ = rank;
  int32_t expected = 0;
  if (!layout_->header.nranks.compare_exchange_strong(expected, nranks) && expected != nranks) {
    *why = "rank " + std::to_string(rank) + " joins with " + std::to_string(nranks) +
           " ranks, others with " + std::to_string(expected);
    return ncclInvalidUsage;
  }
  uint64_t was = 0;
  if (!area(rank).joined.compare_exchange_strong(was, 1)) {
    *why = "rank " + std::to_string(rank) + " joined twice";
    return ncclInvalidUsage;
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (int r = 0; r < nranks; ++r) {
    while (area(r).joined.load(std::memory_order_acquire) == 0) {
      if (std::chrono::steady_clock::now() >= deadline) {
        *why = "rank " + std::to_string(r) + " did not join within " +
               std::to_string(timeout_ms) + " ms";
        shm_unlink(name.c_str());  // a late rank then makes a fresh segment and times out too
        return ncclSystemError;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
  if (rank == 0) shm_unlink(name.c_str());  // step 3: everyone has it mapped
  return ncclSuccess;
}

Segment::~Segment() {
  if (layout_ != nullptr) munmap(layout_, sizeof(Layout));
}

void Segment::SetFailure(ncclResult_t code) {
  int32_t expected = 0;
  if (layout_->header.failure.compare_exchange_strong(expected, code)) {
    layout_->header.failed_rank.store(rank_);
  }
}

ncclResult_t Segment::failure() const {
  return static_cast<ncclResult_t>(layout_->header.failure.load(std::memory_order_acquire));
}

}  // namespace kfdouble
