// The CUDA IPC transport: ranks of one host, on one GPU or on GPUs with peer access.
//
// Every rank owns ONE cudaMalloc'd region, exported with cudaIpcGetMemHandle and opened by
// every peer with cudaIpcOpenMemHandle(cudaIpcMemLazyEnablePeerAccess). A rank reaches its
// own region through its own pointer (opening one's own handle is an error).
//
//   [ Ctrl | ring descriptors | one-shot descriptors | FIFO slots | one-shot x2 | arena ]
//
//   Ctrl        one 128-byte line per counter: abort (followed by the reason of a
//               rejection, kAbortReasonOffset), the failure lock, and per channel posted
//               (slices I produced), consumed (slices I took from my predecessor), oneshot
//               (one-shot calls I published). Monotonic 64-bit, written only by the owner,
//               read by peers with ld.acquire.sys.
//   descriptors SlotMeta per (slot, channel): call, count, dtype, op, where the slice lives.
//   FIFO        `slots` slots of `slot_bytes`; the k-th slice I produce goes to slot k % slots
//               (partial sums in Acc during the reduce-scatter, final values in T after).
//   one-shot    two buffers, alternating by one-shot call parity.
//   arena       registered memory (alloc()): the successor reads a tensor here in place,
//               so no staging copy is made (when T == Acc or the values are final).
//
// Data flows by *pull*: a consumer reads its predecessor's slot (or tensor) and writes only
// its own memory. No rank ever writes another rank's memory, flags included.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>

#include "cuda_api.h"
#include "reduce_kernels.cuh"

namespace ringdp {
namespace cuda {
namespace ipc {

struct alignas(kLineBytes) Line {
  uint64_t v;
  uint64_t pad[kLineWords - 1];
};
static_assert(sizeof(Line) == kLineBytes, "one counter per line");

struct Ctrl {
  Line abort;  // nonzero once this rank gave up (peers poll it while they wait on us)
  alignas(kLineBytes) char reason[kReasonBytes];  // why, when the host gave up (reject); else empty
  Line lock;   // device-side lock of the failure record (first failure wins)
  Line posted[kMaxChannels];
  Line consumed[kMaxChannels];
  Line oneshot[kMaxChannels];
};
static_assert(offsetof(Ctrl, abort) == 0, "the abort flag leads the control block");
static_assert(offsetof(Ctrl, reason) - offsetof(Ctrl, abort) == kAbortReasonOffset,
              "kernels find the reason at a fixed offset from the abort flag");
static_assert(offsetof(Ctrl, lock) % kLineBytes == 0 && offsetof(Ctrl, posted) % kLineBytes == 0,
              "one counter per line");

constexpr uint64_t kMagic = 0x6370696470676e72ull;  // "rngdpipc"
constexpr uint32_t kVersion = 3;  // 2: Ctrl::reason; 3: SlotMeta::coll, root

struct Layout {
  size_t slots = 0;
  size_t slot_bytes = 0;
  size_t oneshot_bytes = 0;
  size_t arena_bytes = 0;

  static size_t align(size_t x, size_t a) { return (x + a - 1) / a * a; }
  size_t ctrl_off() const { return 0; }
  size_t ring_meta_off() const { return align(sizeof(Ctrl), 4096); }
  size_t oneshot_meta_off() const { return ring_meta_off() + slots * kMaxChannels * sizeof(SlotMeta); }
  // Everything before fifo_off() is zeroed at creation.
  size_t fifo_off() const { return align(oneshot_meta_off() + 2 * kMaxChannels * sizeof(SlotMeta), 4096); }
  size_t slot_off(uint64_t k) const { return fifo_off() + static_cast<size_t>(k % slots) * slot_bytes; }
  size_t oneshot_off(int parity) const {
    return fifo_off() + slots * slot_bytes + static_cast<size_t>(parity) * align(oneshot_bytes, 4096);
  }
  size_t arena_off() const { return align(oneshot_off(2), size_t(1) << 21); }
  size_t total() const { return arena_off() + align(arena_bytes, size_t(1) << 21); }
  size_t ring_meta(uint64_t k) const { return ring_meta_off() + static_cast<size_t>(k % slots) * kMaxChannels * sizeof(SlotMeta); }
  size_t oneshot_meta(int parity) const { return oneshot_meta_off() + static_cast<size_t>(parity) * kMaxChannels * sizeof(SlotMeta); }
};

// What a rank publishes (local_blob): POD, compared field by field at connect.
struct Blob {
  uint64_t magic;
  uint32_t version;
  int32_t rank;
  int32_t world;
  int32_t device;
  int32_t sm_count;
  int32_t pid;
  int32_t channels_req;  // Options::channels (0: auto)
  int32_t registered;  // Options::registered
  unsigned char uuid[16];  // the GPU's UUID: ranks that share a GPU split its SMs
  uint64_t slots;
  uint64_t slot_bytes;
  uint64_t oneshot_bytes;
  uint64_t arena_bytes;
  uint64_t region_bytes;
  unsigned char handle[64];  // cudaIpcMemHandle_t
};

std::shared_ptr<Comm> make_comm(const Options& opts);

}  // namespace ipc
}  // namespace cuda
}  // namespace ringdp
