#include "segment.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/statvfs.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

#include "../../common/error.h"
#include "names.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif

namespace ringdp {
namespace shm {
namespace {

std::string errstr(int e) { return std::strerror(e); }

void populate(char* p, size_t bytes, bool write) {
  if (bytes == 0) return;
  if (madvise(p, bytes, write ? MADV_POPULATE_WRITE : MADV_POPULATE_READ) == 0) return;
  // Older kernels: touch every page.
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  for (size_t o = 0; o < bytes; o += page) {
    if (write) {
      reinterpret_cast<volatile char*>(p)[o] = reinterpret_cast<volatile char*>(p)[o];
    } else {
      (void)reinterpret_cast<volatile char*>(p)[o];
    }
  }
}

}  // namespace

Segment& Segment::operator=(Segment&& o) noexcept {
  if (this != &o) {
    release();
    name_ = std::move(o.name_);
    base_ = o.base_;
    size_ = o.size_;
    fd_ = o.fd_;
    owner_ = o.owner_;
    linked_ = o.linked_;
    o.base_ = nullptr;
    o.size_ = 0;
    o.fd_ = -1;
    o.owner_ = false;
    o.linked_ = false;
  }
  return *this;
}

Segment::~Segment() { release(); }

void Segment::release() noexcept {
  unlink();
  if (base_) ::munmap(base_, size_);
  if (fd_ >= 0) ::close(fd_);
  base_ = nullptr;
  size_ = 0;
  fd_ = -1;
  owner_ = false;
  linked_ = false;
}

Segment Segment::create(const std::string& name, size_t bytes, size_t prefault) {
  Segment s;
  s.name_ = name;
  guard_name(name);  // before it exists: a SIGTERM from now on removes it (names.h)
  s.fd_ = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (s.fd_ < 0) {
    const int e = errno;
    unguard_name(name);
    throw RingError(cat("shm_open(", name, ") failed: ", errstr(e)));
  }
  s.owner_ = true;
  s.linked_ = true;  // from here on the destructor unlinks on every failure path
  if (::ftruncate(s.fd_, static_cast<off_t>(bytes)) != 0)
    throw RingError(cat("ftruncate(", name, ", ", bytes, ") failed: ", errstr(errno)));
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, s.fd_, 0);
  if (p == MAP_FAILED) throw RingError(cat("mmap(", name, ") failed: ", errstr(errno)));
  s.base_ = static_cast<char*>(p);
  s.size_ = bytes;
  s.commit(0, prefault);
  return s;
}

Segment Segment::open(const std::string& name, size_t prefault) {
  Segment s;
  s.name_ = name;
  s.fd_ = ::shm_open(name.c_str(), O_RDWR, 0);
  if (s.fd_ < 0) throw RingError(cat("shm_open(", name, ") of a peer failed: ", errstr(errno)));
  struct stat st;
  if (::fstat(s.fd_, &st) != 0) throw RingError(cat("fstat(", name, ") failed: ", errstr(errno)));
  size_t bytes = static_cast<size_t>(st.st_size);
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, s.fd_, 0);
  if (p == MAP_FAILED) throw RingError(cat("mmap(", name, ") of a peer failed: ", errstr(errno)));
  s.base_ = static_cast<char*>(p);
  s.size_ = bytes;
  // A peer's segment is only needed through this mapping: drop the descriptor now.
  ::close(s.fd_);
  s.fd_ = -1;
  populate(s.base_, prefault < bytes ? prefault : bytes, /*write=*/true);
  return s;
}

void Segment::unlink() {
  if (owner_ && linked_) {
    ::shm_unlink(name_.c_str());
    unguard_name(name_);
  }
  linked_ = false;
}

void Segment::commit(size_t offset, size_t bytes) {
  if (bytes == 0) return;
  int rc;
  do {  // (tmpfs gives up on a pending signal with EINTR on older kernels: not a lack of room)
    rc = ::posix_fallocate(fd_, static_cast<off_t>(offset), static_cast<off_t>(bytes));
  } while (rc == EINTR);
  if (rc != 0) {
    decommit(offset, bytes);  // (what the failed reservation took of it: given back)
    if (rc != ENOSPC) throw RingError(cat("cannot reserve ", bytes, " bytes of shared memory for ", name_, ": ", errstr(rc)));
    // how much the machine gives (a container's /dev/shm is often 64 MiB: docker --shm-size)
    struct statvfs fs;
    auto mib = [](double b) { return static_cast<double>(static_cast<int64_t>(b / 1048576.0 * 10.0 + 0.5)) / 10.0; };
    const std::string room = ::statvfs("/dev/shm", &fs) == 0
                                 ? cat("/dev/shm has ", mib(double(fs.f_bavail) * double(fs.f_frsize)), " MiB free of ",
                                       mib(double(fs.f_blocks) * double(fs.f_frsize)), " MiB")
                                 : std::string("/dev/shm may be full or too small");
    throw NoRoom(cat("cannot reserve ", bytes, " bytes of shared memory for ", name_, " (", errstr(rc), "): ", room,
                     " (a container's is often 64 MiB: docker run --shm-size)"));
  }
  populate(base_ + offset, bytes, /*write=*/true);
}

void Segment::decommit(size_t offset, size_t bytes) {
  if (bytes == 0 || fd_ < 0) return;
  ::fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(offset),
              static_cast<off_t>(bytes));
}

void unlink_name(const std::string& name) { ::shm_unlink(name.c_str()); }

}  // namespace shm
}  // namespace ringdp
