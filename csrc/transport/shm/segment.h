// A POSIX shared-memory segment: created owner-only (0600) with O_EXCL, pre-faulted, and
// unlinked as soon as every peer has mapped it. Unmapped (and closed) by the destructor.
// While an owned segment is linked, a SIGTERM unlinks its name (names.h, the SIGTERM guard).
#pragma once
#include <cstddef>
#include <string>

#include "../../common/error.h"

namespace ringdp {
namespace shm {

// commit() found no room in /dev/shm (ENOSPC): the RingError says how much there is.
class NoRoom : public RingError {
 public:
  using RingError::RingError;
};

class Segment {
 public:
  // Create `name` of `bytes` (sparse), pre-fault the first `prefault` bytes.
  static Segment create(const std::string& name, size_t bytes, size_t prefault);
  // Map an existing segment of a peer; populate the first `prefault` bytes.
  static Segment open(const std::string& name, size_t prefault);

  Segment() = default;
  Segment(Segment&& o) noexcept { *this = std::move(o); }
  Segment& operator=(Segment&& o) noexcept;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  ~Segment();

  char* base() const { return base_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }
  // Remove the name from /dev/shm (mappings stay valid). Idempotent.
  void unlink();
  // Reserve and fault in [offset, offset+bytes) of this (owned) segment. Throws NoRoom
  // when /dev/shm is full, instead of a SIGBUS on first touch (RingError on other errors).
  void commit(size_t offset, size_t bytes);
  // Give the pages of [offset, offset+bytes) back to the system.
  void decommit(size_t offset, size_t bytes);

 private:
  // Unlink (if linked), unmap and close; the members are left empty, alive (the move
  // assignment reuses them, so it never runs the destructor on a live object).
  void release() noexcept;

  std::string name_;
  char* base_ = nullptr;
  size_t size_ = 0;
  int fd_ = -1;
  bool owner_ = false;
  bool linked_ = false;
};

// Unlink a name if it exists (cleanup of a dead peer's segment); never throws.
void unlink_name(const std::string& name);

}  // namespace shm
}  // namespace ringdp
