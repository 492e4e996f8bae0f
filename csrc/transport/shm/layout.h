// Layout of one rank's POSIX shared-memory segment. Every rank creates one segment and
// maps every peer's. Each word in here is written by its owner only; peers only read it
// (the one exception, `sleepers`, is a counter peers bump before sleeping on a futex).
//
//   [ Control (4 KiB) | FIFO: slots x slot_bytes | one-shot: 2 x oneshot_bytes | arena ]
//
// Counters are monotonic 32-bit and compared wrap-safely, so a fast rank can never
// overwrite a flag a slow rank has not read yet.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "../../common/error.h"
#include "../../common/types.h"

namespace ringdp {
namespace shm {

constexpr size_t kCacheLine = 64;
constexpr uint64_t kMagic = 0x31766470676e6972ull;  // "ringdpv1"
constexpr uint32_t kLayoutVersion = 7;  // 2: call fingerprint (kind, tag), Control::done
                                        // 3: kinds reduce_scatter/all_gather/broadcast, root
                                        // 4: Control::wrote (the direct all-reduce)
                                        // 5: reduce_scatter's reg_offset (its input; direct)
                                        // 6: registered broadcast direct (no in-place ring)
                                        // 7: CallHeader::outer (the collective across hosts)
constexpr size_t kMsgBytes = 256;

// One 32-bit flag alone on its cache line.
struct alignas(kCacheLine) Flag {
  std::atomic<uint32_t> v;
  char pad[kCacheLine - sizeof(std::atomic<uint32_t>)];
};
static_assert(sizeof(Flag) == kCacheLine, "a flag owns exactly one cache line");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "flags must be lock-free across processes");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "counters must be lock-free across processes");

// The collective across hosts that an in-host call is a step of (ringdp/hosts.py: every
// in-host step of one CrossHost call carries it). Compared with the shape, so that ranks of
// one host whose steps look alike but whose calls differ (counts that pad to the same
// blocks, AVG and SUM, an all_reduce and a reduce_scatter with the same in-host step, the
// dtype of an all_gather whose first in-host step carries no data) fail
// in the step instead of returning different results. kind -1: a call of its own.
struct Outer {
  int16_t kind;    // Kind, or -1
  int16_t dtype;   // DType
  int32_t arg;     // RedOp (all_reduce, reduce_scatter), root (broadcast), 0 (all_gather)
  uint64_t count;  // elements (reduce_scatter, all_gather: per rank)
  bool operator==(const Outer& o) const {
    return kind == o.kind && dtype == o.dtype && arg == o.arg && count == o.count;
  }
};
static_assert(sizeof(Outer) == 16, "Outer fills the header's last 16 bytes before the tag");

// What a rank announces at the start of each collective: its fingerprint (call number,
// kind, caller's tag) and shape (count, dtype, op, algorithm). Every rank compares every
// header before data moves. Two of these alternate by the parity of the call number, so a
// fast rank writes call s+1's header while a slow one may still read call s's.
struct alignas(kCacheLine) CallHeader {
  Flag seq;               // call number (1-based), published last, with release
  int32_t status;         // 0 ok, 1 this rank rejected its input (message in `msg`)
  int32_t kind;           // Kind
  int32_t dtype;          // DType
  int32_t op;             // RedOp
  int32_t algo;           // Algo
  int32_t root;           // broadcast: the source rank (0 for other kinds)
  uint64_t count;         // elements (reduce_scatter, all_gather: per rank)
  int64_t reg_offset;     // arena offset of the tensor (reduce_scatter: its input), -1 when not registered
  uint64_t slice_bytes;   // configuration that must agree across ranks
  Outer outer;            // the collective across hosts this call is a step of (ShmComm::set_outer)
  char tag[kTagBytes];    // the caller's tag, NUL-terminated
  char msg[kMsgBytes];
};
static_assert(sizeof(CallHeader) == 2 * kCacheLine + kTagBytes + kMsgBytes, "header layout changed");
static_assert(offsetof(CallHeader, seq) == 0, "the published word leads the header");
static_assert(offsetof(CallHeader, tag) % kCacheLine == 0, "the tag starts on its own line");
static_assert(offsetof(CallHeader, outer) + sizeof(Outer) == offsetof(CallHeader, tag), "outer fills the shape's line");

// Who a segment belongs to and how it is laid out: the head of the Control block, and what
// a rank publishes for its peers (Blob). Peers compare it field by field before use.
struct Identity {
  uint64_t magic;    // kMagic, written last into the Control block (with release)
  uint32_t version;  // kLayoutVersion
  int32_t rank;
  int32_t world;
  int32_t pid;
  uint64_t segment_bytes;
  uint64_t fifo_slots;
  uint64_t slot_bytes;
  uint64_t oneshot_bytes;
  uint64_t arena_bytes;
};
static_assert(sizeof(Identity) == kCacheLine, "the identity fills the Control block's first line");

struct Control {
  Identity id;  // written once at creation
  char host[64];
  char pad0[kCacheLine - 16];
  Flag posted;     // slices I have made available to my successor (total, wraps)
  Flag consumed;   // slices I have taken from my predecessor (total, wraps)
  Flag sleepers;   // peers sleeping on one of my flags: wake them after a store
  Flag aborted;    // nonzero once this rank gave up; reason in abort_msg
  Flag done;       // the last call number this rank finished (for the stall report)
  Flag wrote;      // the last call whose direct path finished with peers' tensors
  CallHeader hdr[2];
  char abort_msg[kMsgBytes];
};
static_assert(offsetof(Control, posted) % kCacheLine == 0, "flags start on a cache line");
static_assert(offsetof(Control, consumed) == offsetof(Control, posted) + kCacheLine, "one line per flag");
static_assert(offsetof(Control, wrote) == offsetof(Control, done) + kCacheLine, "one line per flag");
static_assert(offsetof(Control, hdr) % kCacheLine == 0, "headers start on a cache line");
static_assert(sizeof(Control) <= 4096, "control block fits its page");

constexpr size_t kControlBytes = 4096;

// What a rank publishes for its peers (ShmComm::local_blob): its identity and shared-memory
// configuration, followed by the `name_len` bytes of its segment's name (no terminator).
struct Blob {
  Identity id;
  uint32_t name_len;
  uint32_t pad;
};
static_assert(sizeof(Blob) == 72, "blob layout changed");
static_assert(std::is_trivially_copyable<Blob>::value, "a blob travels as raw bytes");

inline size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// The most a segment may span: ftruncate and fallocate take a signed 64-bit off_t. (The
// RINGDP_* limits keep it far below: ringdp/policy.py MAX_BUFFER_BYTES, MAX_ARENA_GB.)
constexpr uint64_t kMaxSegmentBytes = static_cast<uint64_t>(INT64_MAX);
// The arena starts on a 2 MiB boundary (a huge page).
constexpr size_t kFixedAlign = size_t(1) << 21;

struct Geometry {
  size_t fifo_slots;
  size_t slot_bytes;
  size_t oneshot_bytes;
  size_t arena_bytes;
  // The layout of `slots` FIFO slots of `slot_bytes`, two one-shot buffers of `oneshot_bytes`
  // (rounded up to a cache line) and an arena of `arena_bytes` (rounded up to `arena_align`),
  // every sum and product checked: a configuration whose segment does not fit in 64 bits
  // (8 slots x 2^61 bytes wrapped to 0) would be a small segment that the ring then writes
  // past. RingError, naming the sizes.
  static Geometry make(size_t slots, size_t slot_bytes, size_t oneshot_bytes, size_t arena_bytes,
                       size_t arena_align) {
    size_t fifo = 0, oneshot = 0, arena = 0, fixed = 0, total = 0;
    bool bad = __builtin_mul_overflow(slots, slot_bytes, &fifo);
    bad |= __builtin_add_overflow(oneshot_bytes, kCacheLine - 1, &oneshot);
    oneshot = oneshot / kCacheLine * kCacheLine;
    bad |= __builtin_add_overflow(arena_bytes, arena_align - 1, &arena);
    arena = arena / arena_align * arena_align;
    bad |= __builtin_mul_overflow(oneshot, size_t(2), &fixed);  // fixed_bytes(), step by step
    bad |= __builtin_add_overflow(fixed, fifo, &fixed);
    bad |= __builtin_add_overflow(fixed, kControlBytes + kFixedAlign - 1, &fixed);
    fixed = fixed / kFixedAlign * kFixedAlign;
    bad |= __builtin_add_overflow(fixed, arena, &total);
    if (bad || total > kMaxSegmentBytes)
      throw RingError(cat("the shared-memory layout does not fit in 64 bits: ", slots, " FIFO slots x ",
                          slot_bytes, " bytes (RINGDP_FIFO_SLOTS, RINGDP_SLOT_BYTES), 2 x ", oneshot_bytes,
                          " one-shot bytes (RINGDP_ONESHOT_BYTES), an arena of ", arena_bytes,
                          " bytes (RINGDP_ARENA_GB)"));
    return Geometry{slots, slot_bytes, oneshot, arena};
  }
  size_t fifo_offset() const { return kControlBytes; }
  size_t oneshot_offset(int parity) const {
    return fifo_offset() + fifo_slots * slot_bytes + static_cast<size_t>(parity) * oneshot_bytes;
  }
  size_t fixed_bytes() const { return align_up(oneshot_offset(2), kFixedAlign); }
  size_t arena_offset() const { return fixed_bytes(); }
  size_t total_bytes() const { return arena_offset() + arena_bytes; }
};

}  // namespace shm
}  // namespace ringdp
