// The NCCL point-to-point transport (see nccl_transport.h).
//
// Each primitive of the ring (transport.h) becomes, on ringdp's stream:
//
//   send                   stage my slice (as Acc for half types)           -> pending send
//   copy_send              my slice as it is (final values)                 -> pending send
//   recv_reduce_send       group{ send pending -> next, recv -> rbuf }; sbuf = rbuf (op) mine
//   recv_reduce_copy_send  group{ send pending, recv -> rbuf }; mine = rbuf (op) mine [AVG]
//   recv_reduce_copy       group{ send pending, recv -> rbuf }; output = rbuf (op) mine [AVG]
//   recv_copy_send         group{ send pending, recv -> my slice }
//   recv                   group{ send pending, recv -> my slice }
//
// The slice a step produces is sent in the *next* step's group, together with that step's
// receive: every rank's k-th group sends what its successor's k-th group receives, so the
// groups of all ranks match one to one (no deadlock) and sends and receives of a step
// progress together. A broadcast is a chain, not a ring: its root only sends (a pending
// slice goes out alone before the next copy_send, the last one in finish), its last rank
// only receives; nothing waits in a cycle. all_gather first copies the input into its block
// of the output (ringdp's stream). Zero-byte slices are skipped on both ends (both know the
// size).
// Everything is stream-ordered: a kernel that writes sbuf starts after the NCCL kernel that
// sent sbuf's previous content has finished.
//
// Bounded waits. NCCL waits forever for a dead peer. A wait ringdp makes itself
// (synchronize, quiesce, reject) is bounded by the timeout; a program that only joins
// streams (Work.wait(), RingDDP's buckets) and then synchronises the host on its own
// (`loss.item()`) is bounded by the watchdog (csrc/common/watchdog.h): every collective's
// end event is watched from its enqueue; one not done within the timeout, or an error NCCL
// reports while work is in flight, aborts the communicator from the watchdog's thread (the
// NCCL kernels return, so the streams waiting for them go on), prints the reason once, and
// the next call on this rank raises it. Threads: `nccl_mu_` guards the communicator and
// every NCCL call on it; `failure_` (csrc/common/failure.h, its own lock) holds the reason
// this communicator is unusable and which collectives that struck: those not seen finished
// (the watchdog's polls and the bounded stream waits report what finished), so that the
// Work of a collective aborted under it says it failed (failure_of). An NCCL call
// may block with `nccl_mu_` held (ncclGroupEnd behind a stream stalled on a dead peer, once
// CUDA's launch queue is full; a first call's connection to a stuck peer): an abort waits
// for the lock at most kAbortGraceS, then aborts under it, as torch's NCCL watchdog does
// (NCCL's abort flag ends that call's waits). `comm_ended_` makes the abort or destroy
// happen once, and no NCCL call reaches the communicator after it. Collectives of a
// single rank, and those captured into a CUDA graph (they run at replay), are not watched.
#include "nccl_transport.h"

#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "../common/bounded.h"
#include "../common/error.h"
#include "../common/failure.h"
#include "../common/watchdog.h"
#include "../ring/ring.h"
#include "../transport/transport.h"
#include "cuda_util.h"
#include "nccl_steps.h"
#include "step_ring.h"
#include "reduce_kernels.cuh"

namespace ringdp {
namespace cuda {
namespace nccl {

namespace {

std::mutex g_load_mu;
Api g_api;
bool g_loaded = false;
// Set at exit: an abandoned ncclCommInitRank that returns during teardown leaks its
// communicator instead of calling into a library (and g_api) being torn down.
std::atomic<bool> g_exiting{false};

template <class F>
bool sym(void* h, const char* name, F& out) {
  out = reinterpret_cast<F>(dlsym(h, name));
  return out != nullptr;
}

bool try_open(const std::string& path, int flags, Api& api, std::string& tried) {
  void* h = dlopen(path.c_str(), flags);
  if (!h) {
    const char* e = dlerror();
    tried += cat("\n  ", path, (flags & RTLD_NOLOAD) ? " (already loaded?)" : "", ": ", e ? e : "not found");
    return false;
  }
  bool ok = sym(h, "ncclGetVersion", api.GetVersion) && sym(h, "ncclGetUniqueId", api.GetUniqueId) &&
            sym(h, "ncclCommInitRank", api.CommInitRank) && sym(h, "ncclCommDestroy", api.CommDestroy) &&
            sym(h, "ncclCommAbort", api.CommAbort) && sym(h, "ncclCommGetAsyncError", api.CommGetAsyncError) &&
            sym(h, "ncclGetErrorString", api.GetErrorString) && sym(h, "ncclGroupStart", api.GroupStart) &&
            sym(h, "ncclGroupEnd", api.GroupEnd) && sym(h, "ncclSend", api.Send) && sym(h, "ncclRecv", api.Recv);
  if (!ok) {
    tried += cat("\n  ", path, ": loaded, but lacks ncclSend/ncclRecv/... (NCCL older than 2.7?)");
    dlclose(h);
    return false;
  }
  sym(h, "ncclGetLastError", api.GetLastError);  // optional
  api.handle = h;
  api.path = path;
  if (api.GetVersion(&api.version) != ncclSuccess) api.version = 0;
  return true;
}

// Whether `library` names the NCCL this process has loaded (g_api): the loader resolves the
// name to the object it already holds (by file, so a symlink or the wheel's path of the
// libnccl.so.2 that torch loaded is the same one), RTLD_NOLOAD loads nothing new.
bool is_loaded(const std::string& library) {
  void* h = dlopen(library.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (!h) return false;
  bool same = h == g_api.handle;
  dlclose(h);
  return same;
}

}  // namespace

const Api& load(const std::string& library) {
  std::lock_guard<std::mutex> lk(g_load_mu);
  if (g_loaded) {
    if (!library.empty() && !is_loaded(library))
      throw RingError(cat("ringdp nccl: this process has loaded NCCL from ", g_api.path,
                          "; it cannot also use ", library,
                          ": one NCCL per process, chosen by ringdp's first CUDA call (set "
                          "RINGDP_NCCL_LIBRARY before it, the same in the whole process)"));
    return g_api;
  }
  Api api;
  std::string tried;
  // A library named (RINGDP_NCCL_LIBRARY, else the nvidia-nccl wheel's) is the one, or an
  // error: a silent fallback would run another NCCL than the one asked for.
  bool ok = library.empty() ? (try_open("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD, api, tried) ||
                               try_open("libnccl.so.2", RTLD_NOW | RTLD_LOCAL, api, tried) ||
                               try_open("libnccl.so", RTLD_NOW | RTLD_LOCAL, api, tried))
                            : try_open(library, RTLD_NOW | RTLD_LOCAL, api, tried);
  if (!ok)
    throw RingError(cat("ringdp nccl: cannot load NCCL. Tried:", tried,
                        library.empty() ? "\nInstall the nvidia-nccl wheel that CUDA builds of torch depend on, or "
                                          "point RINGDP_NCCL_LIBRARY at libnccl.so.2"
                                        : "\nPoint RINGDP_NCCL_LIBRARY at a libnccl.so.2 (>= 2.7), or unset it "
                                          "for the nvidia-nccl wheel's"));
  g_api = api;
  g_loaded = true;
  std::atexit([] { g_exiting = true; });
  return g_api;
}

namespace {

constexpr uint64_t kMagic = 0x6c63636e70647272ull;  // "rrdpnccl"
constexpr uint32_t kVersion = 1;
constexpr size_t kDefaultSlotBytes = size_t(4) << 20;

struct Blob {
  uint64_t magic;
  uint32_t version;
  int32_t rank;
  int32_t world;
  int32_t has_id;
  uint64_t slot_bytes;
  ncclUniqueId id;
};

class NcclComm final : public Comm {
 public:
  static constexpr const char* kName = "nccl";
  static constexpr bool kClosesChain = false;  // (no descriptors to check: the messages are bare)

  explicit NcclComm(const Options& o)
      : opt_(o), rank_(o.rank), world_(o.world), api_(load(o.nccl_library)), ring_(this) {
    check_ranks(kName, rank_, world_, o.rank_names);
    me_ = name_of(rank_);
    if (o.device < 0) {
      RINGDP_CUDA_CHECK(cudaGetDevice(&device_), "cudaGetDevice");
    } else {
      device_ = o.device;
    }
    slot_bytes_ = round_up(std::max<size_t>(o.slot_bytes ? o.slot_bytes : kDefaultSlotBytes, 4096), 4096);
    if (o.timeout_s > 0) timeout_s_ = o.timeout_s;
    try {
      DeviceGuard g(device_);
      int sms = 0;
      RINGDP_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_),
                        "cudaDeviceGetAttribute(multiProcessorCount)");
      channels_ = std::max(1, std::min(sms, kMaxChannels));
      void* p = nullptr;
      RINGDP_CUDA_CHECK(cudaMalloc(&p, 2 * slot_bytes_), "cudaMalloc of the NCCL staging buffers");
      sbuf_ = static_cast<char*>(p);
      rbuf_ = sbuf_ + slot_bytes_;
      RINGDP_CUDA_CHECK(StreamPool::acquire(device_, &stream_), "creating ringdp's CUDA stream");
      RINGDP_CUDA_CHECK(cudaEventCreateWithFlags(&ev_in_, cudaEventDisableTiming), "cudaEventCreate");
      if (rank_ == 0 && world_ > 1) nccl_check(api_.GetUniqueId(&id_), "ncclGetUniqueId");
    } catch (...) {
      release();
      throw;
    }
  }

  ~NcclComm() override { release(); }

  std::string local_blob() override {
    Blob b;
    std::memset(&b, 0, sizeof(b));
    b.magic = kMagic;
    b.version = kVersion;
    b.rank = rank_;
    b.world = world_;
    b.has_id = rank_ == 0 ? 1 : 0;
    b.slot_bytes = slot_bytes_;
    if (rank_ == 0) b.id = id_;
    return std::string(reinterpret_cast<const char*>(&b), sizeof(b));
  }

  void connect(const std::vector<std::string>& blobs) override {
    if (connected_) throw RingError(cat("ringdp nccl rank ", me_, ": connect() called twice"));
    if (static_cast<int>(blobs.size()) != world_)
      throw RingError(cat("ringdp nccl rank ", me_, ": connect() got ", blobs.size(), " records for world size ", world_));
    for (int p = 0; p < world_; ++p) {
      Blob b;
      if (blobs[p].size() != sizeof(Blob))
        throw RingError(cat("ringdp nccl rank ", me_, ": rank ", name_of(p), "'s record has ", blobs[p].size(),
                            " bytes, expected ", sizeof(Blob), " (another ringdp version, or another transport: set "
                            "RINGDP_TRANSPORT alike on every rank)"));
      std::memcpy(&b, blobs[p].data(), sizeof(b));
      if (b.magic != kMagic || b.version != kVersion || b.rank != p || b.world != world_)
        throw RingError(cat("ringdp nccl rank ", me_, ": rank ", name_of(p), "'s record does not match (rank ", b.rank, " of ",
                            b.world, ", expected ", p, " of ", world_, ")"));
      if (b.slot_bytes != slot_bytes_)
        throw RingError(cat("ringdp nccl rank ", me_, ": rank ", name_of(p), " uses slot bytes ", b.slot_bytes, ", this rank ",
                            slot_bytes_, "; set RINGDP_CUDA_SLOT_BYTES alike on every rank"));
      if (p == 0) {
        if (!b.has_id) throw RingError(cat("ringdp nccl rank ", me_, ": rank 0 published no NCCL unique id"));
        id_ = b.id;
      }
    }
    if (world_ > 1) {
      // ncclCommInitRank waits in NCCL's bootstrap for every rank: a peer that died after
      // the exchange above would hold this one there forever. Bounded by the timeout (on a
      // thread of its own; abandoned there if it never returns, aborted if it does later).
      const Api* api = &api_;  // (the loaded library's table lives as long as the process)
      const int device = device_, world = world_, rank = rank_, me = me_;
      const ncclUniqueId id = id_;
      ncclComm_t c = call_bounded<ncclComm_t>(
          [api, device, world, rank, me, id]() -> ncclComm_t {
            DeviceGuard g(device);
            ncclComm_t made = nullptr;
            const ncclResult_t r = api->CommInitRank(&made, world, id, rank);
            if (r != ncclSuccess)
              throw RingError(cat("ringdp nccl rank ", me, ": ncclCommInitRank failed: ", api->GetErrorString(r)));
            return made;
          },
          [api, device](ncclComm_t& late) {
            if (g_exiting) return;
            DeviceGuard g(device);
            (void)api->CommAbort(late);
          },
          timeout_s_, cat("ringdp nccl rank ", me_, ": ncclCommInitRank"),
          "a peer died or stopped after the ranks exchanged their records (the communicator is not usable: "
          "ringdp.destroy() and initialise again)");
      std::lock_guard<std::timed_mutex> lk(nccl_mu_);
      comm_ = c;
    }
    connected_ = true;
  }

  void all_reduce(uintptr_t data, size_t count, DType dtype, RedOp op, uintptr_t stream, int algo,
                  double timeout_s) override {
    usable("all_reduce");
    ring_only(algo, "all_reduce", count, dtype);
    if (count == 0 || world_ == 1) return;
    if (data == 0) throw RingError(cat("ringdp nccl rank ", me_, ": all_reduce of a null pointer"));
    DeviceGuard g(device_);
    enter("all_reduce", count, stream, timeout_s, reinterpret_cast<char*>(data), dtype, op);
    run_ring(ringdp::Kind::kAllReduce, count, 0);
  }

  void reduce_scatter(uintptr_t input, uintptr_t output, size_t count, DType dtype, RedOp op, uintptr_t stream,
                      int algo, double timeout_s) override {
    usable("reduce_scatter");
    ring_only(algo, "reduce_scatter", count * static_cast<size_t>(world_), dtype);
    if (count == 0) return;
    if (input == 0 || output == 0) throw RingError(cat("ringdp nccl rank ", me_, ": reduce_scatter of a null pointer"));
    DeviceGuard g(device_);
    enter("reduce_scatter", count, stream, timeout_s, reinterpret_cast<char*>(input), dtype, op);
    call_.result = reinterpret_cast<char*>(output);
    call_.result_base = static_cast<size_t>(rank_) * count;
    if (world_ == 1) {  // the output is the input (AVG over one rank: the identity)
      copy_block(call_.result, call_.data, count * call_.esize);
      finish_ring();
      return;
    }
    run_ring(ringdp::Kind::kReduceScatter, count, 0);
  }

  void all_gather(uintptr_t input, uintptr_t output, size_t count, DType dtype, uintptr_t stream, int algo,
                  double timeout_s) override {
    usable("all_gather");
    ring_only(algo, "all_gather", count, dtype);
    if (count == 0) return;
    if (input == 0 || output == 0) throw RingError(cat("ringdp nccl rank ", me_, ": all_gather of a null pointer"));
    DeviceGuard g(device_);
    enter("all_gather", count, stream, timeout_s, reinterpret_cast<char*>(output), dtype, RedOp::kSum);
    // My block of the output first (unless the input is that block): the all-gather starts from it.
    copy_block(call_.data + static_cast<size_t>(rank_) * count * call_.esize, reinterpret_cast<const char*>(input),
               count * call_.esize);
    if (world_ == 1) {
      finish_ring();
      return;
    }
    run_ring(ringdp::Kind::kAllGather, count, 0);
  }

  void broadcast(uintptr_t data, size_t count, DType dtype, int root, uintptr_t stream, int algo,
                 double timeout_s) override {
    usable("broadcast");
    ring_only(algo, "broadcast", count, dtype);
    check_broadcast_root(cat("ringdp nccl rank ", me_), root, world_);
    if (count == 0 || world_ == 1) return;
    if (data == 0) throw RingError(cat("ringdp nccl rank ", me_, ": broadcast of a null pointer"));
    DeviceGuard g(device_);
    enter("broadcast", count, stream, timeout_s, reinterpret_cast<char*>(data), dtype, RedOp::kSum);
    run_ring(ringdp::Kind::kBroadcast, count, root);
  }

  void check() override {
    std::string why = fatal();
    if (why.empty()) {
      // (an NCCL call in flight on another thread: never wait behind it here; its own
      // failure, a later check or the watchdog reports)
      std::unique_lock<std::timed_mutex> lk(nccl_mu_, std::try_to_lock);
      if (!lk.owns_lock()) return;
      why = async_error_locked();
      if (why.empty()) return;
      failure_.fail(why);
      abort_comm_locked();  // (NCCL: a communicator with an error is aborted; destroying it may hang)
    }
    throw RingError(fatal());
  }

  void synchronize() override {
    wait_stream("synchronize");
    check();
  }

  uint64_t calls() const override { return calls_; }
  std::string failure_of(uint64_t call) const override { return failure_.failure_of(call); }

  void reject(const std::string& why) override {
    if (!fatal().empty()) return;  // already unusable (aborted, failed, destroyed)
    try {
      wait_stream("rejecting an input");  // the collectives already queued finish first
    } catch (...) {
    }
    abort(cat("this rank rejected its input (", why, "); a rejection poisons the CUDA communicator: "
              "call ringdp.destroy() and initialise again"));
  }

  void abort(const std::string& reason) override {
    failure_.fail(cat("ringdp nccl rank ", me_, ": aborted: ", reason.empty() ? "abort requested" : reason));
    abort_comm();
  }

  void halt(const std::string& reason) override { abort(reason); }  // (an NCCL step cannot stop half-way)

  void follow(const std::shared_ptr<Comm>&) override {
    throw RingError(cat("ringdp nccl rank ", me_, ": an NCCL endpoint follows no other (Comm::follow is IPC's)"));
  }

  void lead(std::weak_ptr<Comm> follower) override {
    std::lock_guard<std::mutex> lk(followers_mu_);
    followers_.push_back(std::move(follower));
  }

  void quiesce() override {
    if (quiesced_) return;
    quiesced_ = true;
    bool drained = true;
    try {
      wait_stream("shutdown");
    } catch (...) {
      drained = false;
    }
    if (!drained || !fatal().empty()) {  // work may still wait on a peer: ncclCommDestroy would wait with it
      if (!drained)  // (a timeout already said why: abort(); a CUDA error did not)
        failure_.fail(cat("ringdp nccl rank ", me_, ": the shutdown could not drain ringdp's stream; the "
                          "collectives in flight were aborted"));
      abort_comm();
      return;
    }
    std::lock_guard<std::timed_mutex> lk(nccl_mu_);
    end_comm(/*destroy=*/true);
    comm_ = nullptr;
  }

  void destroy() override { release(); }

  uintptr_t alloc(size_t bytes) override {
    DeviceGuard g(device_);
    void* p = nullptr;
    RINGDP_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 1)), "cudaMalloc (registered memory)");
    std::lock_guard<std::mutex> lk(mu_);
    allocs_[reinterpret_cast<uintptr_t>(p)] = bytes;
    return reinterpret_cast<uintptr_t>(p);
  }

  void free(uintptr_t ptr) override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (allocs_.erase(ptr) == 0) return;
    }
    DeviceGuard g(device_);
    (void)cudaFree(reinterpret_cast<void*>(ptr));
    (void)cudaGetLastError();
  }

  bool is_registered(uintptr_t ptr, size_t bytes) const override {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = allocs_.upper_bound(ptr);
    if (it == allocs_.begin()) return false;
    --it;
    return ptr - it->first <= it->second && bytes <= it->second - (ptr - it->first);
  }

  uintptr_t stream() const override { return reinterpret_cast<uintptr_t>(stream_); }
  int device() const override { return device_; }
  size_t oneshot_bytes() const override { return 0; }  // the ring only
  std::string describe() const override {
    return cat("nccl rank ", rank_, "/", world_, " on device ", device_, ": NCCL ", api_.version, " from ", api_.path,
               ", slices of ", slot_bytes_, " B, ", channels_, " reduce blocks");
  }

  void step(StepKind k, const Slice& s);
  void finish_ring();

 private:
  friend class Steps<NcclComm>;  // its operations: group(), launch()

  // The NCCL transport runs the ring only: an unknown code, or one-shot, is refused before
  // anything is enqueued (oneshot_bytes() is 0, so ringdp's policy never asks for it).
  void ring_only(int algo, const char* what, size_t elems, DType dtype) const {
    if (algo != kAlgoRing && algo != kAlgoOneShot)
      throw RingError(cat("ringdp nccl rank ", me_, ": unknown algorithm code ", algo, " (0: ring, 1: one-shot)"));
    if (algo == kAlgoOneShot && elems > 0 && world_ > 1)
      throw RingError(cat("ringdp nccl rank ", me_, ": one-shot ", what, " of ", elems * dtype_size(dtype),
                          " bytes (", elems, " x ", dtype_name(dtype),
                          ") requested, but the NCCL transport has no one-shot path (oneshot_bytes 0); "
                          "nothing was run"));
  }

  void nccl_check(ncclResult_t r, const char* what) {
    if (r == ncclSuccess) return;
    throw RingError(cat("ringdp nccl rank ", me_, ": ", what, " failed: ", api_.GetErrorString(r), last_error()));
  }
  std::string last_error() const {  // (nccl_mu_ held)
    if (!api_.GetLastError || !comm_ || comm_ended_) return "";
    const char* m = api_.GetLastError(comm_);
    return (m && *m) ? cat(" (", m, ")") : std::string();
  }

  // Wait for ringdp's stream, bounded: NCCL waits forever for a dead peer.
  void wait_stream(const char* what) {
    if (!stream_) return;
    DeviceGuard g(device_);
    const uint64_t upto = queued_;  // (wholly on the stream before the query: finished once it says so)
    const auto t0 = std::chrono::steady_clock::now();
    for (;;) {
      cudaError_t e = cudaStreamQuery(stream_);
      if (e == cudaSuccess) {
        failure_.finished(upto);
        return;
      }
      if (e != cudaErrorNotReady) throw_cuda(kName, me_, cat("cudaStreamQuery (", what, ")"), e);
      check();
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (waited > timeout_s_) {
        const std::string msg = cat("ringdp nccl rank ", me_, ": ", what, " timed out after ", waited,
                                    " s: a peer is stuck or dead, or the ranks made different collective calls");
        abort(msg);
        throw RingError(msg);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  void group(const void* sptr, size_t sbytes, void* rptr, size_t rbytes) {
    if (sbytes == 0 && rbytes == 0) return;
    const int succ = (rank_ + 1) % world_, pred = (rank_ - 1 + world_) % world_;
    std::lock_guard<std::timed_mutex> lk(nccl_mu_);
    if (!comm_ || comm_ended_) {  // aborted under this collective (the watchdog, on an earlier call's timeout)
      const std::string why = fatal();
      throw RingError(why.empty() ? cat("ringdp nccl rank ", me_, ": the NCCL communicator is gone") : why);
    }
    nccl_check(api_.GroupStart(), "ncclGroupStart");
    ncclResult_t r1 = ncclSuccess, r2 = ncclSuccess;
    if (sbytes) r1 = api_.Send(sptr, sbytes, ncclInt8, succ, comm_, stream_);
    if (rbytes) r2 = api_.Recv(rptr, rbytes, ncclInt8, pred, comm_, stream_);
    ncclResult_t r3 = api_.GroupEnd();
    nccl_check(r1, "ncclSend");
    nccl_check(r2, "ncclRecv");
    nccl_check(r3, "ncclGroupEnd");
  }

  void usable(const char* what) {
    check();
    if (!connected_ || quiesced_)
      throw RingError(cat("ringdp nccl rank ", me_, ": ", what, " on a communicator that is ",
                          connected_ ? "shut down" : "not connected"));
  }

  // Start a collective on `data` (the buffer the schedule's slices index): ringdp's stream
  // waits for the caller's. The caller holds a DeviceGuard for the whole collective.
  void enter(const char* name, size_t count, uintptr_t stream, double timeout_s, char* data, DType dtype, RedOp op) {
    if (timeout_s > 0) timeout_s_ = timeout_s;
    what_ = cat(name, " of ", count * dtype_size(dtype), " B (call ", ++calls_, " on this communicator)");
    caller_ = reinterpret_cast<cudaStream_t>(stream);
    RINGDP_CUDA_CHECK(cudaEventRecord(ev_in_, caller_), "cudaEventRecord on the caller's stream");
    RINGDP_CUDA_CHECK(cudaStreamWaitEvent(stream_, ev_in_, 0), "cudaStreamWaitEvent (ringdp stream)");
    dtype_ = dtype;
    call_ = StepCall();
    call_.data = data;
    call_.esize = dtype_size(dtype);
    call_.acc = acc_size(dtype);
    call_.op = op;
    call_.world = world_;
    call_.sbuf = sbuf_;
    call_.rbuf = rbuf_;
    steps_.reset();  // (a world-1 call finishes without the ring)
  }

  // The ring (csrc/ring/ring.cpp) over call_.data, its steps from nccl_steps.h; ends with
  // finish_ring(). Partial sums travel in Acc (all_reduce, reduce_scatter: rbuf_ holds one
  // slice of them), final values in T.
  void run_ring(ringdp::Kind kind, size_t count, int root) {
    try {
      ring_run(ring_, kind, step_plan(kind, count, world_, rank_, slot_bytes_, call_.esize, call_.acc), root);
    } catch (...) {
      failure_.fail(cat("ringdp nccl rank ", me_, ": a collective failed half-way; this communicator is unusable now"));
      abort_comm();  // the steps already queued (and the peers' matching ones) return instead of waiting
      throw;
    }
  }

  // ncclCommAbort: NCCL kernels still in flight return; the communicator is gone (fatal() says
  // why). From any thread; behind an NCCL call that blocks with nccl_mu_ held, after
  // kAbortGraceS, under it (top of this file).
  void abort_comm() {
    std::unique_lock<std::timed_mutex> lk(nccl_mu_, std::defer_lock);
    if (lk.try_lock_for(std::chrono::duration<double>(kAbortGraceS))) {
      abort_comm_locked();
      return;
    }
    end_comm(/*destroy=*/false);  // (comm_ stays for the call in flight; comm_ended_ bars the rest)
  }
  void abort_comm_locked() {
    end_comm(/*destroy=*/false);
    comm_ = nullptr;
  }
  // The communicator's one end, ncclCommAbort or ncclCommDestroy: the first caller's.
  void end_comm(bool destroy) {
    ncclComm_t c = comm_.load();
    if (c == nullptr || comm_ended_.exchange(true)) return;
    if (!destroy) halt_followers();  // before the aborted kernels return and the steps behind them start
    DeviceGuard g(device_);
    (void)(destroy ? api_.CommDestroy(c) : api_.CommAbort(c));
  }

  // The endpoints that consume this one's results (Comm::lead): halted with this one's reason.
  void halt_followers() {
    std::vector<std::weak_ptr<Comm>> fs;
    {
      std::lock_guard<std::mutex> lk(followers_mu_);
      fs = followers_;
    }
    const std::string why = fatal();
    for (auto& w : fs)
      if (auto f = w.lock())
        f->halt(cat("its NCCL endpoint was aborted: ", why.empty() ? cat("ringdp nccl rank ", me_, ": aborted") : why));
  }

  // What NCCL reported asynchronously on the communicator, or "" (nccl_mu_ held).
  std::string async_error_locked() const {
    if (!comm_ || comm_ended_) return "";
    ncclResult_t r = ncclSuccess;
    if (api_.CommGetAsyncError(comm_, &r) != ncclSuccess || r == ncclSuccess || r == ncclInProgress) return "";
    return cat("ringdp nccl rank ", me_, ": NCCL reported an error: ", api_.GetErrorString(r), last_error());
  }

  int name_of(int r) const { return rank_name(opt_.rank_names, r); }  // (as messages name rank r)

  // Why this communicator is unusable ("" while it is usable); the first reason stays.
  std::string fatal() const { return failure_.reason(); }

  // ---- the watchdog's side (its thread; see the top of this file) ----------------------
  Watchdog::Hooks watchdog_hooks() {
    Watchdog::Hooks h;
    h.done = [this](void* ev) {
      // This thread's queries must not meet a graph that another thread captures in the
      // global mode (torch.cuda.graph's default): they would invalidate it, as they did
      // under torch's NCCL watchdog. Thread-local mode ignores other threads' captures.
      thread_local bool capture_mode_set = false;
      if (!capture_mode_set) {
        cudaStreamCaptureMode m = cudaStreamCaptureModeThreadLocal;
        (void)cudaThreadExchangeStreamCaptureMode(&m);
        capture_mode_set = true;
      }
      DeviceGuard g(device_);
      const cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(ev));
      if (e == cudaSuccess) {
        failure_.finished(call_of(static_cast<cudaEvent_t>(ev)));  // (and every one before it)
        return true;
      }
      if (e == cudaErrorNotReady) return false;
      (void)cudaGetLastError();
      // a capture's refusal: ask again
      if (e == cudaErrorStreamCaptureUnsupported || e == cudaErrorStreamCaptureInvalidated ||
          e == cudaErrorStreamCaptureImplicit || e == cudaErrorCapturedEvent ||
          e == cudaErrorStreamCaptureWrongThread)
        return false;
      // the device's own error (the next CUDA call on this rank meets it too): this
      // collective's result is not valid; nothing left to watch
      const uint64_t call = call_of(static_cast<cudaEvent_t>(ev));
      failure_.fail_from(cat("ringdp nccl rank ", me_, ": CUDA reported ", cudaGetErrorName(e), " (",
                             cudaGetErrorString(e), ") for collective ", call, " on this communicator"),
                         call);
      return true;
    };
    h.error = [this]() -> std::string {
      std::unique_lock<std::timed_mutex> lk(nccl_mu_, std::try_to_lock);  // busy enqueueing: next poll
      return lk.owns_lock() ? async_error_locked() : std::string();
    };
    h.expire = [this](const std::string& reason) {
      const std::string why =
          reason.rfind("ringdp nccl rank ", 0) == 0 ? reason : cat("ringdp nccl rank ", me_, ": ", reason);
      failure_.fail(cat(why, "; the watchdog aborted the NCCL communicator (results of this call and any after it are "
                         "not valid): call ringdp.destroy() and initialise again"));
      std::fprintf(stderr, "%s\n", fatal().c_str());
      abort_comm();
    };
    h.retire = [this](void* ev) { give_back(static_cast<cudaEvent_t>(ev)); };
    return h;
  }

  // An event for a collective's end: a retired one, else a new one (all destroyed in release()).
  cudaEvent_t take_event() {
    std::lock_guard<std::mutex> lk(ev_mu_);
    if (!free_events_.empty()) {
      cudaEvent_t ev = free_events_.back();
      free_events_.pop_back();
      return ev;
    }
    cudaEvent_t ev = nullptr;
    RINGDP_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate");
    all_events_.push_back(ev);
    return ev;
  }
  void give_back(cudaEvent_t ev) {
    std::lock_guard<std::mutex> lk(ev_mu_);
    call_of_.erase(ev);
    free_events_.push_back(ev);
  }
  // The collective whose end a watched event marks (0: none known).
  uint64_t call_of(cudaEvent_t ev) {
    std::lock_guard<std::mutex> lk(ev_mu_);
    auto it = call_of_.find(ev);
    return it == call_of_.end() ? 0 : it->second;
  }

  // A device-to-device copy on ringdp's stream (nothing when dst == src).
  void copy_block(char* dst, const char* src, size_t bytes) {
    if (dst == src || bytes == 0) return;
    RINGDP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_),
                      "cudaMemcpyAsync (ringdp stream)");
  }

  void launch(StepKind k, const void* in, void* out, const void* src, void* dst, size_t count, int avg_div) {
    StepArgs a;
    std::memset(&a, 0, sizeof(a));
    a.kind = k;
    a.dtype = dtype_;
    a.op = call_.op;
    a.in = in;
    a.out = out;
    a.src = src;
    a.dst = dst;
    a.count = count;
    a.avg_div = avg_div;
    a.channels = channels_;
    a.sig = nullptr;
    RINGDP_CUDA_CHECK(launch_step(a, stream_), "launching a reduce kernel");
  }

  void release() {
    if (released_) return;
    quiesce();
    released_ = true;
    watchdog_.stop();  // (its thread gone: every event is back, none is polled)
    DeviceGuard g(device_);
    if (ev_in_) (void)cudaEventDestroy(ev_in_);
    ev_in_ = nullptr;
    for (cudaEvent_t ev : all_events_) (void)cudaEventDestroy(ev);
    all_events_.clear();
    free_events_.clear();
    StreamPool::release(device_, stream_);  // idle (quiesce synchronised it); see StreamPool
    stream_ = nullptr;
    if (sbuf_) (void)cudaFree(sbuf_);
    sbuf_ = rbuf_ = nullptr;
    failure_.fail(cat("ringdp nccl rank ", me_, ": this communicator was destroyed"), /*strikes=*/false);
    (void)cudaGetLastError();
  }

  Options opt_;
  int rank_;
  int world_;
  int me_ = 0;  // rank_ as messages name it (Options::rank_names)
  const Api& api_;
  StepRing<NcclComm> ring_;
  int device_ = 0;
  int channels_ = 1;
  size_t slot_bytes_ = 0;
  double timeout_s_ = 300.0;
  ncclUniqueId id_{};
  static constexpr double kAbortGraceS = 2.0;  // an abort's wait behind a blocked NCCL call
  std::timed_mutex nccl_mu_;      // the communicator and every NCCL call on it
  std::atomic<ncclComm_t> comm_{nullptr};
  std::atomic<bool> comm_ended_{false};  // aborted or destroyed (end_comm): no NCCL call after it
  char* sbuf_ = nullptr;
  char* rbuf_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ev_in_ = nullptr;
  bool connected_ = false;
  bool quiesced_ = false;
  bool released_ = false;
  FailureLedger failure_;          // why it is unusable, and which collectives that struck
  std::mutex followers_mu_;        // followers_ (lead(): the thread that sets up; the abort's)
  std::vector<std::weak_ptr<Comm>> followers_;  // halted before this communicator's abort
  std::mutex ev_mu_;               // the end events: all_events_ (owned), free_events_ (not watched)
  std::vector<cudaEvent_t> all_events_, free_events_;
  std::atomic<uint64_t> calls_{0};  // collectives started (calls(); the watchdog names them by number)
  std::atomic<uint64_t> queued_{0};  // the last collective wholly enqueued (finish_ring)
  std::map<cudaEvent_t, uint64_t> call_of_;  // a watched end event's collective (under ev_mu_)
  std::string what_;               // the collective in flight, for the watchdog
  Watchdog watchdog_{watchdog_hooks()};  // after what its hooks use; its thread starts at the first watch

  // The collective in flight.
  cudaStream_t caller_ = nullptr;
  StepCall call_;            // its buffers, sizes and op (nccl_steps.h)
  DType dtype_ = DType::kFloat32;
  Steps<NcclComm> steps_;  // what each primitive enqueues (nccl_steps.h)

  mutable std::mutex mu_;
  std::map<uintptr_t, size_t> allocs_;
};

void NcclComm::step(StepKind k, const Slice& s) { steps_.step(*this, call_, k, s); }

void NcclComm::finish_ring() {
  steps_.finish(*this);
  cudaEvent_t end = take_event();
  cudaError_t e = cudaEventRecord(end, stream_);
  if (e == cudaSuccess) e = cudaStreamWaitEvent(caller_, end, 0);
  if (e != cudaSuccess) {
    give_back(end);
    throw_cuda(kName, me_, "cudaEventRecord / cudaStreamWaitEvent at the end of a collective", e);
  }
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(caller_, &capturing) != cudaSuccess) (void)cudaGetLastError();
  if (world_ > 1 && capturing == cudaStreamCaptureStatusNone) {
    {
      std::lock_guard<std::mutex> lk(ev_mu_);
      call_of_[end] = calls_;
    }
    watchdog_.watch(end, timeout_s_, what_);  // from here on, bounded without a host wait
  } else {  // no peer to wait for, or it runs at the graph's replay: nothing to watch now
    give_back(end);
  }
  queued_ = calls_.load();
}

}  // namespace

std::shared_ptr<Comm> make_comm(const Options& opts) { return std::make_shared<NcclComm>(opts); }

}  // namespace nccl
}  // namespace cuda
}  // namespace ringdp
