// ringdp's CUDA transports as a torch-free C++ API: what csrc/bindings.cpp calls.
//
// Lifecycle (every rank of the group, collectively where marked; the shape of endpoint.h,
// which the shared-memory communicator shares):
//
//   auto c = create_comm(opts);            // allocate, export: no peers needed yet
//   blob = c->local_blob();                // opaque bytes -> store.set("<prefix>/<rank>")
//   c->connect({blob_0, ..., blob_n-1});   // collective: open peers' memory / NCCL comm
//   c->all_reduce(ptr, count, dtype, op, stream, algo);  // any number of times, same order on all ranks
//   c->reduce_scatter(...), c->all_gather(...), c->broadcast(...)  // likewise (ring only)
//   c->quiesce();                          // collective: drain, drop peers' mappings
//   -- store barrier --                    // nobody reads my memory any more
//   c->destroy();                          // free my own memory
//
// No collective blocks the host on the GPU: it makes ringdp's stream wait for everything
// already queued on `stream` (an event), enqueues the ring on ringdp's stream, and makes
// `stream` wait for the result (another event). Failures detected on the device (a peer
// that never arrives, a peer that called a different collective, an abort) are recorded in
// host-mapped memory and raised as RingError by the next check(), synchronize() or
// collective call of this rank. Every message names this rank and, where known, the peer.
//
// No torch headers anywhere under csrc/cuda: CI compiles these files with plain nvcc.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "../common/endpoint.h"
#include "../common/types.h"

namespace ringdp {
namespace cuda {

enum class Kind : int32_t {
  kIpc = 0,   // CUDA IPC: ranks of one host (one or several GPUs with peer access)
  kNccl = 1,  // NCCL point-to-point (loaded with dlopen at run time): any ranks
};

// The algorithm of one all_reduce, chosen by the caller (same codes as ringdp/policy.py).
constexpr int kAlgoRing = 0;
constexpr int kAlgoOneShot = 1;

struct Options {
  Kind kind = Kind::kIpc;
  int rank = 0;
  int world = 1;
  int device = -1;            // CUDA device ordinal; -1: the calling thread's current device
  double timeout_s = 300.0;   // IPC: bound on every device-side wait
  size_t slot_bytes = 0;      // bytes per pipeline slot (0: IPC 16 MiB, NCCL 4 MiB); must agree
  int slots = 0;              // IPC slots per connection (0: 4, at least 2); must agree
  int channels = 0;           // IPC blocks per step (0: SMs / ranks sharing a GPU, <= 64);
                              // an explicit count is clamped to that share (describe() says so)
  size_t oneshot_bytes = 0;   // IPC: one-shot buffer = the largest one-shot message
                              // (0: 256 KiB; must agree)
  size_t arena_bytes = 0;     // IPC: registered memory (tensors from alloc()) for this rank
  bool registered = true;     // IPC: peers read registered tensors in place (no staging copy)
  std::vector<int> rank_names;  // how messages name ranks 0..world-1 of this endpoint (across
                                 // hosts: the group's ranks of a host or cross-host group); empty: as they are
  std::string nccl_library;   // NCCL: path of libnccl.so.2 (Python: $RINGDP_NCCL_LIBRARY, else
                              // the nvidia-nccl wheel's); empty: already loaded, then search
};

// Endpoint (endpoint.h):
//   local_blob()    bytes this rank publishes for its peers (IPC: memory handle and
//                   configuration; NCCL: the unique id on rank 0, configuration on the others)
//   connect(blobs)  every rank's blob, index = rank. Collective. Throws RingError on
//                   incompatible peers.
class Comm : public Endpoint {
 public:
  // In-place all-reduce of `count` elements of `dtype` at device pointer `data`, ordered on
  // the CUDA stream `stream` (cudaStream_t as an integer; 0 = legacy default stream).
  // algo: kAlgoRing or kAlgoOneShot, as the caller chose (ringdp/cuda_comm.py). A one-shot
  // request larger than oneshot_bytes() throws RingError naming the rank and the sizes
  // before anything is enqueued (never a silent fallback to the ring).
  // timeout_s <= 0: the creation timeout.
  virtual void all_reduce(uintptr_t data, size_t count, DType dtype, RedOp op, uintptr_t stream,
                          int algo, double timeout_s = 0.0) = 0;
  // The halves alone and broadcast (csrc/ring/ring.cpp, or one-shot), ordered on `stream` and
  // `algo` checked like all_reduce (one-shot stages: reduce_scatter its whole input, the
  // others `count` elements); count == 0 runs nothing.
  //   reduce_scatter  torch's reduce_scatter_tensor: `input` holds world blocks of `count`
  //                   elements (block q for rank q); `output` (count elements) gets the
  //                   reduction of every rank's block `rank`, AVG applied. The input is
  //                   not modified (IPC stages it: never read in place).
  //   all_gather      torch's all_gather_into_tensor: `output` holds world blocks of `count`;
  //                   block q becomes rank q's `input` (which may be block `rank` of
  //                   `output`; otherwise it is copied there first, on ringdp's stream).
  //   broadcast       `count` elements of rank `root`'s `data` into every rank's `data`.
  // IPC: all_gather and broadcast read registered buffers in place (as all_reduce does).
  virtual void reduce_scatter(uintptr_t input, uintptr_t output, size_t count, DType dtype, RedOp op,
                              uintptr_t stream, int algo, double timeout_s = 0.0) = 0;
  virtual void all_gather(uintptr_t input, uintptr_t output, size_t count, DType dtype, uintptr_t stream,
                          int algo, double timeout_s = 0.0) = 0;
  virtual void broadcast(uintptr_t data, size_t count, DType dtype, int root, uintptr_t stream, int algo,
                         double timeout_s = 0.0) = 0;
  // The most bytes a collective can stage one-shot; 0: this transport has no one-shot path
  // (NCCL; IPC above kMaxOneShotWorld ranks).
  virtual size_t oneshot_bytes() const = 0;
  // Raise the first failure the device reported, if any. Cheap: reads host memory.
  virtual void check() = 0;
  // Collectives started so far on this communicator: read right after a collective was
  // enqueued (on the thread that enqueued it), its number (every rank counts the same).
  virtual uint64_t calls() const = 0;
  // Why collective number `call` failed, or "" when no failure struck it as far as this
  // rank knows now. A failure strikes the collective it happened in and every later one;
  // a struck collective's end event may complete all the same (an aborted NCCL kernel
  // returns), so its Work asks here before it reports success (ringdp/work.py).
  //   IPC:  the device's failure record names the collective (a timeout, a peer that gave
  //         up, a mismatch, an abort met by a kernel in flight).
  //   NCCL: every collective not seen finished when the watchdog, an NCCL error, a failed
  //         call or an abort ended the communicator (csrc/common/failure.h). Seen finished:
  //         by the watchdog's polls (10 ms) or a bounded stream wait; collectives it does not
  //         watch (captured into a CUDA graph) only by the latter, so an abort may strike
  //         them late.
  // A call that enqueues nothing (0 elements, world 1) takes no number: its Work does not
  // ask (ringdp/cuda_comm.py Enqueued reads calls() before and after). Cheap; never throws.
  virtual std::string failure_of(uint64_t call) const = 0;
  // Wait for all work queued so far on ringdp's stream, then check().
  virtual void synchronize() = 0;
  // This rank rejected its input for the next collective (ringdp/comm.py's checks): make the
  // peers fail fast instead of waiting for data that will not come. On CUDA a rejection
  // POISONS the communicator (unlike the shared-memory transport, which stays usable): every
  // later call of this rank raises RingError, and the peers' calls fail too.
  //   IPC:  after the collectives already queued on ringdp's stream, the reason is written
  //         next to this rank's abort flag and the flag is raised; peers waiting on this rank
  //         fail with "rank r rejected its input: <why>; it gave up ...", their own
  //         neighbours with "rank q gave up ...".
  //   NCCL: waits (bounded) for the queued collectives, then aborts the NCCL communicator;
  //         peers see NCCL's error for the broken connection or time out (NCCL offers no
  //         channel for the reason).
  // Never throws.
  virtual void reject(const std::string& why) = 0;
  // Ask every pending and future device wait of this rank to give up (e.g. the host knows a
  // peer died). Later calls raise RingError carrying `reason`.
  virtual void abort(const std::string& reason) = 0;
  // Hierarchical calls (ringdp/cuda_comm.py): this endpoint's collectives consume `leader`'s
  // results (the in-host IPC steps after the cross-host NCCL step, on the same rank). When
  // `leader` is aborted (its watchdog, an NCCL error, a call failed half-way, abort()), it
  // halts this endpoint first, so that a step queued behind the aborted one fails, and this
  // host's ranks that read it fail with it, instead of passing on what the abort left as a
  // result. IPC only (each kernel then checks for a halt at its start: one read of
  // host-mapped memory per block); NCCL throws RingError. Before the first collective.
  virtual void follow(const std::shared_ptr<Comm>& leader) = 0;
  // (The leader's side of follow().) Halt `follower` when this endpoint is aborted, before its
  // kernels return. NCCL only; IPC throws RingError. Thread-safe.
  virtual void lead(std::weak_ptr<Comm> follower) = 0;
  // Stop this rank's device work from any thread (a leader's abort; Ctrl-C and the backend's
  // abort(), ringdp/cuda_comm.py CudaEndpoint.halt): every kernel that starts
  // after it (on a following endpoint) or waits (on any) fails, reporting `reason` as its own
  // and beside its abort flag, so peers that stop on it name it. The next check() (every
  // call's first step) raises it, after announcing it to the peers as reject() does if no
  // kernel of this rank met it. Unlike abort(), it leaves the failures of collectives no
  // kernel of which met it to their kernels. IPC: never throws; no CUDA call. NCCL: abort()
  // (up to 2 s behind a blocked NCCL call, then ncclCommAbort).
  virtual void halt(const std::string& reason) = 0;
  // Collective: wait for this rank's work, then release everything that refers to peers.
  virtual void quiesce() = 0;
  // Free this rank's own resources (after every rank quiesced). Registered memory still in
  // use keeps its region alive until the last free(). Idempotent.
  virtual void destroy() = 0;

  // Registered memory: a device buffer peers can read in place (IPC arena). Throws
  // RingError when the arena is exhausted. 512-byte aligned.
  virtual uintptr_t alloc(size_t bytes) = 0;
  virtual void free(uintptr_t ptr) = 0;
  virtual bool is_registered(uintptr_t ptr, size_t bytes) const = 0;

  virtual uintptr_t stream() const = 0;  // ringdp's own stream (cudaStream_t)
  virtual int device() const = 0;
  virtual std::string describe() const = 0;
};

// Create a (not yet connected) communicator. Throws RingError naming the rank on failure.
std::shared_ptr<Comm> create_comm(const Options& opts);

// Whether libnccl can be loaded (and its version); `why` receives the reason when not.
bool nccl_available(const std::string& library, int* version, std::string* why);

// Number of visible CUDA devices (0 when there is no driver or no device).
int device_count();

}  // namespace cuda
}  // namespace ringdp
