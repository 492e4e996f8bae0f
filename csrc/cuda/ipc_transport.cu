// The CUDA IPC transport (layout and protocol: ipc_transport.h; kernels: reduce_kernels.cu).
//
// Host side of one collective (all_reduce, reduce_scatter, all_gather, broadcast):
//   1. event on the caller's stream -> ringdp's stream waits on it (no host sync); all_gather
//      then copies the input into its block of the output, on ringdp's stream;
//   2. the ring engine (csrc/ring/ring.cpp) calls one primitive per slice; each primitive
//      enqueues one step kernel on ringdp's stream, with the counter targets it must wait
//      for and the values it publishes (the host only does arithmetic on its own counters);
//   3. finish(): if the successor read our tensor in place, a drain kernel waits until it is
//      done; then an event on ringdp's stream -> the caller's stream waits on it.
// The host never waits for the device here. Device-side failures surface through
// check() (host-mapped failure record), which every collective calls first.
//
// Ranks sharing one GPU without MPS: kernels of different processes are time-sliced. A
// step kernel whose peer has not produced yet spins (sleeping) until the scheduler runs the
// peer's kernel; nothing requires the two to be resident at the same time, and every wait is
// bounded by the timeout. Performance on one GPU wants MPS (concurrent kernels), with
// `channels` blocks per rank small enough that all ranks' blocks fit at once (the default:
// SMs / ranks sharing the GPU).
#include "ipc_transport.h"

#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>

#include "../common/error.h"
#include "../common/failure.h"
#include "../ring/ring.h"
#include "../transport/transport.h"
#include "cuda_util.h"
#include "step_ring.h"

namespace ringdp {
namespace cuda {
namespace ipc {
namespace {

// Big slices: on one GPU a step kernel must run long against its launch gap (a few us).
constexpr size_t kDefaultSlotBytes = size_t(16) << 20;
constexpr int kDefaultSlots = 4;
constexpr size_t kDefaultOneShotBytes = size_t(256) << 10;
constexpr size_t kArenaAlign = 512;

// Host-mapped pinned memory shared with the kernels of this rank only.
struct HostShared {
  ErrorRecord rec;
  volatile int32_t host_abort;
  char halt_reason[kReasonBytes];  // halt()'s reason, written before host_abort; kernels copy it beside the abort flag
  // Sources of reject()'s copies into this rank's Ctrl (pinned, so the copies are async).
  char reason[kReasonBytes];
  uint64_t one;
};

const char* what_name(int32_t w) {
  switch (w) {
    case kWaitPosted: return "'posted' (slices it produced)";
    case kWaitConsumed: return "'consumed' (slices it took from this rank)";
    case kWaitOneShot: return "'one-shot' (small-message calls it published)";
  }
  return "?";
}

std::string meta_str(const SlotMeta& m) {
  const auto k = static_cast<ringdp::Kind>(m.coll);
  return cat("call #", m.call, " ", kind_name(k), " count=", m.count, " dtype=", dtype_name(static_cast<DType>(m.dtype)),
             k == ringdp::Kind::kAllReduce || k == ringdp::Kind::kReduceScatter
                 ? cat(" op=", redop_name(static_cast<RedOp>(m.op)))
                 : std::string(),
             k == ringdp::Kind::kBroadcast ? cat(" root=", m.root) : std::string());
}

class IpcComm final : public Comm, public std::enable_shared_from_this<IpcComm> {
 public:
  static constexpr const char* kName = "cuda-ipc";
  // Its call check rides on the slices' descriptors (step_kernel): a broadcast's root checks
  // the empty slice that closes the chain (transport.h closes_chain).
  static constexpr bool kClosesChain = true;

  explicit IpcComm(const Options& o) : opt_(o), rank_(o.rank), world_(o.world), ring_(this) {
    check_ranks(kName, rank_, world_, o.rank_names);
    me_ = name_of(rank_);
    if (o.device < 0) {
      RINGDP_CUDA_CHECK(cudaGetDevice(&device_), "cudaGetDevice");
    } else {
      device_ = o.device;
    }
    lay_.slots = o.slots > 0 ? static_cast<size_t>(o.slots) : kDefaultSlots;
    if (lay_.slots < 2)
      throw RingError(cat("ringdp cuda-ipc rank ", me_, ": at least 2 slots per connection are needed, got ",
                          lay_.slots));
    lay_.slot_bytes = round_up(std::max<size_t>(o.slot_bytes ? o.slot_bytes : kDefaultSlotBytes, 4096), 4096);
    lay_.oneshot_bytes = round_up(o.oneshot_bytes ? o.oneshot_bytes : kDefaultOneShotBytes, 4096);
    lay_.arena_bytes = round_up(o.arena_bytes, size_t(1) << 21);
    plan_ = Planner(lay_.slots);
    try {
      setup();
    } catch (...) {
      release(true);
      throw;
    }
  }

  ~IpcComm() override { release(true); }

  // ---- set-up --------------------------------------------------------------------------
  std::string local_blob() override {
    Blob b;
    std::memset(&b, 0, sizeof(b));
    b.magic = kMagic;
    b.version = kVersion;
    b.rank = rank_;
    b.world = world_;
    b.device = device_;
    b.sm_count = sm_count_;
    b.pid = static_cast<int32_t>(getpid());
    b.channels_req = opt_.channels;
    b.registered = opt_.registered ? 1 : 0;
    std::memcpy(b.uuid, uuid_, 16);
    b.slots = lay_.slots;
    b.slot_bytes = lay_.slot_bytes;
    b.oneshot_bytes = lay_.oneshot_bytes;
    b.arena_bytes = lay_.arena_bytes;
    b.region_bytes = lay_.total();
    static_assert(sizeof(cudaIpcMemHandle_t) == sizeof(b.handle), "cudaIpcMemHandle_t is 64 bytes");
    std::memcpy(b.handle, &handle_, sizeof(b.handle));
    return std::string(reinterpret_cast<const char*>(&b), sizeof(b));
  }

  void connect(const std::vector<std::string>& blobs) override {
    if (connected_) throw RingError(cat("ringdp cuda-ipc rank ", me_, ": connect() called twice"));
    if (static_cast<int>(blobs.size()) != world_)
      throw RingError(cat("ringdp cuda-ipc rank ", me_, ": connect() got ", blobs.size(), " peer records for world size ",
                          world_));
    std::vector<Blob> bs(world_);
    for (int p = 0; p < world_; ++p) {
      if (blobs[p].size() != sizeof(Blob))
        throw RingError(cat("ringdp cuda-ipc rank ", me_, ": rank ", name_of(p), "'s record has ", blobs[p].size(),
                            " bytes, expected ", sizeof(Blob), " (a different ringdp version, or a rank that chose "
                            "another transport; set RINGDP_TRANSPORT the same on every rank)"));
      std::memcpy(&bs[p], blobs[p].data(), sizeof(Blob));
      const Blob& b = bs[p];
      if (b.magic != kMagic || b.version != kVersion)
        throw RingError(cat("ringdp cuda-ipc rank ", me_, ": rank ", name_of(p), " runs an incompatible ringdp (record magic/version)"));
      if (b.rank != p || b.world != world_)
        throw RingError(cat("ringdp cuda-ipc rank ", me_, ": rank ", name_of(p), " says it is rank ", b.rank, " of ", b.world,
                            ", expected rank ", p, " of ", world_));
      if (b.slots != lay_.slots || b.slot_bytes != lay_.slot_bytes || b.oneshot_bytes != lay_.oneshot_bytes ||
          b.channels_req != opt_.channels)
        throw RingError(cat("ringdp cuda-ipc rank ", me_, ": rank ", name_of(p), "'s configuration differs (slots ", b.slots,
                            " vs ", lay_.slots, ", slot bytes ", b.slot_bytes, " vs ", lay_.slot_bytes,
                            ", one-shot bytes ", b.oneshot_bytes, " vs ", lay_.oneshot_bytes, ", channels ",
                            b.channels_req, " vs ", opt_.channels, "); set the RINGDP_CUDA_* variables alike on every rank"));
      if (p != rank_ && b.pid == static_cast<int32_t>(getpid()))
        throw RingError(cat("ringdp cuda-ipc rank ", me_, ": rank ", name_of(p), " lives in the same process; the IPC transport "
                            "needs one process per rank"));
    }
    // Channels: explicit or automatic, never more than the smallest share of SMs any rank
    // gets on its GPU (blocks that cannot all be resident would spin on peers that cannot be
    // scheduled); protocol.h choose_channels.
    std::vector<int> sms(world_), sharing(world_, 0);
    for (int p = 0; p < world_; ++p) {
      sms[p] = bs[p].sm_count;
      for (int q = 0; q < world_; ++q) sharing[p] += std::memcmp(bs[p].uuid, bs[q].uuid, 16) == 0 ? 1 : 0;
    }
    channel_choice_ = choose_channels(opt_.channels, smallest_sm_share(world_, sms.data(), sharing.data()));
    channels_ = channel_choice_.channels;
    DeviceGuard g(device_);
    bases_.assign(world_, nullptr);
    region_bytes_.assign(world_, 0);
    bases_[rank_] = base_;
    region_bytes_[rank_] = lay_.total();
    const int pred = (rank_ - 1 + world_) % world_, succ = (rank_ + 1) % world_;
    for (int p = 0; p < world_; ++p) {
      if (p == rank_) continue;
      if (world_ > kMaxOneShotWorld && p != pred && p != succ) continue;  // the ring needs neighbours only
      cudaIpcMemHandle_t h;
      std::memcpy(&h, bs[p].handle, sizeof(h));
      void* ptr = nullptr;
      cudaError_t e = cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess);
      if (e != cudaSuccess) {
        (void)cudaGetLastError();
        throw RingError(cat("ringdp cuda-ipc rank ", me_, " (device ", device_, "): cannot open rank ", p,
                            "'s memory (device ", bs[p].device, "): cudaIpcOpenMemHandle: ", cudaGetErrorName(e), " (",
                            cudaGetErrorString(e), "). Ranks on GPUs without peer access cannot use the IPC "
                            "transport; use RINGDP_TRANSPORT=nccl"));
      }
      bases_[p] = static_cast<char*>(ptr);
      region_bytes_[p] = bs[p].region_bytes;
    }
    connected_ = true;
  }

  // ---- the collectives -------------------------------------------------------------------
  void all_reduce(uintptr_t data, size_t count, DType dtype, RedOp op, uintptr_t stream, int algo,
                  double timeout_s) override {
    usable("all_reduce");
    if (algo != kAlgoRing && algo != kAlgoOneShot)
      throw RingError(cat("ringdp cuda-ipc rank ", me_, ": unknown algorithm code ", algo, " (0: ring, 1: one-shot)"));
    if (count == 0 || world_ == 1) return;  // nothing moves; AVG over one rank is the identity
    if (data == 0) throw RingError(cat("ringdp cuda-ipc rank ", me_, ": all_reduce of a null pointer"));
    const size_t esize = dtype_size(dtype);
    const size_t bytes = count * esize;
    const bool oneshot = is_oneshot(algo, "all_reduce", bytes, count, dtype);
    DeviceGuard g(device_);
    cudaStream_t caller = enter(stream, timeout_s);
    try {
      if (oneshot) {
        run_oneshot(ringdp::Kind::kAllReduce, reinterpret_cast<char*>(data), reinterpret_cast<char*>(data), count,
                    dtype, op, 0);
        finish_call(caller);
      } else {
        Call c = make_call(ringdp::Kind::kAllReduce, reinterpret_cast<char*>(data), count, dtype, op, caller);
        c.registered = read_in_place(data, bytes);
        run_ring(c, 0);
      }
    } catch (...) {
      // A half-enqueued collective leaves our counters out of step with the peers: stop
      // everything (pending kernels exit, peers see our abort flag) and keep failing.
      poison("a launch failed in the middle of a collective");
      throw;
    }
  }

  void reduce_scatter(uintptr_t input, uintptr_t output, size_t count, DType dtype, RedOp op, uintptr_t stream,
                      int algo, double timeout_s) override {
    usable("reduce_scatter");
    if (count == 0) return;
    if (input == 0 || output == 0)
      throw RingError(cat("ringdp cuda-ipc rank ", me_, ": reduce_scatter of a null pointer"));
    const size_t bytes = count * dtype_size(dtype);
    // one-shot stages the whole input (world blocks)
    const bool oneshot = is_oneshot(algo, "reduce_scatter", bytes * static_cast<size_t>(world_),
                                    count * static_cast<size_t>(world_), dtype);
    DeviceGuard g(device_);
    cudaStream_t caller = enter(stream, timeout_s);
    try {
      if (world_ == 1) {  // the output is the input (AVG over one rank: the identity)
        copy_block(reinterpret_cast<char*>(output), reinterpret_cast<const char*>(input), bytes);
        finish_call(caller);
        return;
      }
      if (oneshot) {
        run_oneshot(ringdp::Kind::kReduceScatter, reinterpret_cast<const char*>(input), reinterpret_cast<char*>(output),
                    count, dtype, op, 0);
        finish_call(caller);
        return;
      }
      // The ring reads the input (world blocks) and writes only the output; staged always
      // (Planner::begin_call): in place, the partial sums would overwrite the input.
      Call c = make_call(ringdp::Kind::kReduceScatter, reinterpret_cast<char*>(input), count, dtype, op, caller);
      c.result = reinterpret_cast<char*>(output);
      c.result_base = static_cast<size_t>(rank_) * count;
      run_ring(c, 0);
    } catch (...) {
      poison("a launch failed in the middle of a collective");
      throw;
    }
  }

  void all_gather(uintptr_t input, uintptr_t output, size_t count, DType dtype, uintptr_t stream, int algo,
                  double timeout_s) override {
    usable("all_gather");
    if (count == 0) return;
    if (input == 0 || output == 0) throw RingError(cat("ringdp cuda-ipc rank ", me_, ": all_gather of a null pointer"));
    const size_t bytes = count * dtype_size(dtype);
    const bool oneshot = is_oneshot(algo, "all_gather", bytes, count, dtype);  // stages this rank's input
    DeviceGuard g(device_);
    cudaStream_t caller = enter(stream, timeout_s);
    try {
      if (oneshot && world_ > 1) {  // (the kernel writes every block of the output, mine too)
        run_oneshot(ringdp::Kind::kAllGather, reinterpret_cast<const char*>(input), reinterpret_cast<char*>(output),
                    count, dtype, RedOp::kSum, 0);
        finish_call(caller);
        return;
      }
      // My block of the output first (unless the input is that block): the all-gather starts
      // from it, and in place the successor reads it there.
      char* mine = reinterpret_cast<char*>(output) + static_cast<size_t>(rank_) * bytes;
      copy_block(mine, reinterpret_cast<const char*>(input), bytes);
      if (world_ == 1) {
        finish_call(caller);
        return;
      }
      Call c = make_call(ringdp::Kind::kAllGather, reinterpret_cast<char*>(output), count, dtype, RedOp::kSum, caller);
      c.registered = read_in_place(output, bytes * static_cast<size_t>(world_));
      run_ring(c, 0);
    } catch (...) {
      poison("a launch failed in the middle of a collective");
      throw;
    }
  }

  void broadcast(uintptr_t data, size_t count, DType dtype, int root, uintptr_t stream, int algo,
                 double timeout_s) override {
    usable("broadcast");
    check_broadcast_root(cat("ringdp cuda-ipc rank ", me_), root, world_);
    if (count == 0 || world_ == 1) return;
    if (data == 0) throw RingError(cat("ringdp cuda-ipc rank ", me_, ": broadcast of a null pointer"));
    const bool oneshot = is_oneshot(algo, "broadcast", count * dtype_size(dtype), count, dtype);
    DeviceGuard g(device_);
    cudaStream_t caller = enter(stream, timeout_s);
    try {
      if (oneshot) {
        run_oneshot(ringdp::Kind::kBroadcast, reinterpret_cast<const char*>(data), reinterpret_cast<char*>(data), count,
                    dtype, RedOp::kSum, root);
        finish_call(caller);
        return;
      }
      Call c = make_call(ringdp::Kind::kBroadcast, reinterpret_cast<char*>(data), count, dtype, RedOp::kSum, caller);
      c.root = root;
      c.registered = read_in_place(data, count * c.esize);
      run_ring(c, root);
    } catch (...) {
      poison("a launch failed in the middle of a collective");
      throw;
    }
  }

  void check() override {
    std::string halted;
    {
      std::lock_guard<std::mutex> lk(rec_mu_);
      if (const ErrorRecord* r = record_locked()) throw RingError(failure_message(*r));
      if (halted_ && fatal_.empty()) halted = cat("ringdp cuda-ipc rank ", me_, ": aborted: ", abort_reason_);
    }
    if (!halted.empty()) {
      // Halted with no kernel of this rank left to meet it (nothing was queued behind the
      // leader's abort): the peers would wait on this rank until their timeout. Tell them.
      announce("");
      throw RingError(halted);
    }
    if (!fatal_.empty()) throw RingError(fatal_);
  }

  // The device's failure record names the collective it struck (FailCtx::call): that one
  // failed and every later one too (their kernels return at once behind it). An abort or a
  // rejection strikes only the collectives whose kernels meet it, which report it there.
  uint64_t calls() const override { return call_; }
  std::string failure_of(uint64_t call) const override {
    std::lock_guard<std::mutex> lk(rec_mu_);  // (a Work may ask while destroy() frees the record)
    if (const ErrorRecord* r = record_locked())
      return call != 0 && call >= r->call ? failure_message(*r) : std::string();
    return struck_.failure_of(call);  // (destroyed: what the record said then)
  }

  // The device's failure record once a kernel wrote one, else null (rec_mu_ held).
  const ErrorRecord* record_locked() const {
    if (!host_ || host_->rec.code == kErrNone) return nullptr;
    std::atomic_thread_fence(std::memory_order_acquire);
    return &host_->rec;
  }

  void synchronize() override {
    if (stream_) {
      DeviceGuard g(device_);
      RINGDP_CUDA_CHECK(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (ringdp stream)");
    }
    check();
  }

  void reject(const std::string& why) override {
    if (!fatal_.empty()) return;  // already unusable (aborted, failed, destroyed)
    fatal_ = cat("ringdp cuda-ipc rank ", me_, ": this rank rejected its input (", why,
                 "); a rejection poisons the CUDA communicator: call ringdp.destroy() and initialise again");
    announce(cat("rejected its input: ", why));
  }

  // Once, on a calling thread (reject, or check() of a halted endpoint): after the
  // collectives already queued on ringdp's stream (peers run them too), the reason beside
  // this rank's abort flag, then the flag. Peers waiting on this rank stop and report it.
  // The reason is told_, the first this rank gives (a halt's, which a kernel may be copying
  // to the same place, or `why`), so every writer of Ctrl::reason writes the same bytes.
  // No CUDA call under rec_mu_: with the launch queue full behind a stalled NCCL step, an
  // enqueue blocks until that step returns, which needs the halt (rec_mu_) and the abort.
  void announce(const std::string& why) {
    {
      std::lock_guard<std::mutex> lk(rec_mu_);
      if (announced_ || !host_ || !connected_ || quiesced_) return;
      announced_ = true;
      if (told_.empty()) told_ = why.substr(0, kReasonBytes - 1);
      std::memset(host_->reason, 0, kReasonBytes);
      std::memcpy(host_->reason, told_.data(), told_.size());
      host_->one = 1;
    }
    // (host_ stays: only release() frees it, on a calling thread too, as before)
    DeviceGuard g(device_);
    Ctrl* me = ctrl(rank_);
    cudaError_t e = cudaMemcpyAsync(me->reason, host_->reason, kReasonBytes, cudaMemcpyHostToDevice, stream_);
    if (e == cudaSuccess)
      e = cudaMemcpyAsync(&me->abort.v, &host_->one, sizeof(uint64_t), cudaMemcpyHostToDevice, stream_);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      host_->host_abort = 1;  // best effort: this rank's pending waits give up and raise the flag
    }
  }

  void abort(const std::string& reason) override {
    halt(reason.empty() ? std::string("abort requested") : reason);
    std::lock_guard<std::mutex> lk(rec_mu_);
    if (fatal_.empty()) fatal_ = cat("ringdp cuda-ipc rank ", me_, ": aborted: ", abort_reason_);
  }

  // (cuda_api.h) From any thread: only the host-mapped flag, its reason and halted_ change
  // (fatal_ stays the calling thread's), under rec_mu_, which keeps host_ alive.
  void halt(const std::string& reason) override {
    std::lock_guard<std::mutex> lk(rec_mu_);
    if (abort_reason_.empty()) abort_reason_ = reason.empty() ? std::string("halted") : reason;
    if (told_.empty()) told_ = cat("stopped: ", abort_reason_).substr(0, kReasonBytes - 1);
    halted_ = true;
    if (!host_ || host_->host_abort != 0) return;  // (a kernel may be reading the reason already)
    std::memset(host_->halt_reason, 0, kReasonBytes);
    std::memcpy(host_->halt_reason, told_.data(), told_.size());
    std::atomic_thread_fence(std::memory_order_seq_cst);  // the reason before the flag
    host_->host_abort = 1;
  }

  void follow(const std::shared_ptr<Comm>& leader) override {
    if (!leader || leader.get() == this)
      throw RingError(cat("ringdp cuda-ipc rank ", me_, ": follow() needs another endpoint to follow"));
    if (call_ != 0)
      throw RingError(cat("ringdp cuda-ipc rank ", me_, ": follow() after ", call_,
                          " collectives; kernels already queued would not check for a halt"));
    leader->lead(std::weak_ptr<Comm>(shared_from_this()));
    gated_ = true;
  }

  void lead(std::weak_ptr<Comm>) override {
    throw RingError(cat("ringdp cuda-ipc rank ", me_, ": a CUDA IPC endpoint leads no other (Comm::lead is NCCL's)"));
  }

  void quiesce() override {
    if (quiesced_) return;
    quiesced_ = true;
    DeviceGuard g(device_);
    if (stream_) (void)cudaStreamSynchronize(stream_);  // bounded: every device wait times out
    for (int p = 0; p < static_cast<int>(bases_.size()); ++p) {
      if (p != rank_ && bases_[p]) (void)cudaIpcCloseMemHandle(bases_[p]);
      if (p != rank_) bases_[p] = nullptr;
    }
    (void)cudaGetLastError();
  }

  void destroy() override { release(false); }

  // ---- registered memory ------------------------------------------------------------------
  uintptr_t alloc(size_t bytes) override {
    std::lock_guard<std::mutex> lk(mu_);
    if (!base_ || destroyed_)
      throw RingError(cat("ringdp cuda-ipc rank ", me_, ": alloc on a destroyed communicator"));
    const size_t want = round_up(std::max<size_t>(bytes, 1), kArenaAlign);
    for (int pass = 0; pass < 2; ++pass) {
      reclaim_locked(/*wait=*/pass == 1);  // blocks freed while ringdp's stream still used them
      for (auto it = free_.begin(); it != free_.end(); ++it) {
        if (it->second < want) continue;
        const size_t off = it->first, have = it->second;
        free_.erase(it);
        if (have > want) free_[off + want] = have - want;
        used_[off] = want;
        return reinterpret_cast<uintptr_t>(base_ + lay_.arena_off() + off);
      }
      if (deferred_.empty()) break;
    }
    size_t avail = 0;
    for (auto& f : free_) avail = std::max(avail, f.second);
    throw RingError(cat("ringdp cuda-ipc rank ", me_, ": registered CUDA memory exhausted: asked for ", bytes,
                        " bytes, the largest free block is ", avail, " of an arena of ", lay_.arena_bytes,
                        " bytes (raise RINGDP_CUDA_ARENA_MB)"));
  }

  void free(uintptr_t ptr) override {
    std::lock_guard<std::mutex> lk(mu_);
    if (!base_) return;
    const char* arena = base_ + lay_.arena_off();
    const size_t off = static_cast<size_t>(reinterpret_cast<const char*>(ptr) - arena);
    auto it = used_.find(off);
    if (it == used_.end()) return;  // not ours (or freed twice): ignore, never corrupt the list
    const size_t len = it->second;
    used_.erase(it);
    // A collective queued on ringdp's stream may still read or write the block (an async call
    // whose tensor was dropped before anything joined it; the caching allocator's
    // record_stream does not cover memory it did not allocate): it is reused only once an
    // event recorded there now has completed (reclaim_locked).
    cudaEvent_t done = nullptr;
    if (stream_ && !destroyed_) {
      DeviceGuard g(device_);
      if (cudaEventCreateWithFlags(&done, cudaEventDisableTiming) == cudaSuccess &&
          cudaEventRecord(done, stream_) == cudaSuccess) {
        deferred_.push_back({off, len, done});
        return;
      }
      if (done) (void)cudaEventDestroy(done);
      (void)cudaGetLastError();
    }
    give_back_locked(off, len);
    if (region_free_pending_ && used_.empty()) free_region_locked();
  }

  // Return the blocks freed (free) whose event on ringdp's stream has completed to the free
  // list; with `wait`, wait for those events first (alloc found no block otherwise).
  void reclaim_locked(bool wait) {
    if (deferred_.empty()) return;
    DeviceGuard g(device_);
    size_t kept = 0;
    for (Deferred& d : deferred_) {
      if (wait) (void)cudaEventSynchronize(d.done);
      if (cudaEventQuery(d.done) == cudaErrorNotReady) {
        deferred_[kept++] = d;
        continue;
      }
      (void)cudaEventDestroy(d.done);
      give_back_locked(d.off, d.len);
    }
    deferred_.resize(kept);
    (void)cudaGetLastError();
  }

  // Put [off, off+len) of the arena back on the free list, merged with its free neighbours.
  void give_back_locked(size_t off, size_t len) {
    size_t start = off;
    auto next = free_.lower_bound(start);
    if (next != free_.end() && next->first == start + len) {
      len += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == start) {
        start = prev->first;
        len += prev->second;
        free_.erase(prev);
      }
    }
    free_[start] = len;
  }

  bool is_registered(uintptr_t ptr, size_t bytes) const override {
    if (!base_ || lay_.arena_bytes == 0) return false;
    const uintptr_t a = reinterpret_cast<uintptr_t>(base_ + lay_.arena_off());
    return ptr >= a && bytes <= lay_.arena_bytes && ptr - a <= lay_.arena_bytes - bytes;
  }

  uintptr_t stream() const override { return reinterpret_cast<uintptr_t>(stream_); }
  int device() const override { return device_; }
  size_t oneshot_bytes() const override { return world_ > kMaxOneShotWorld ? 0 : lay_.oneshot_bytes; }

  std::string describe() const override {
    return cat("cuda-ipc rank ", rank_, "/", world_, " on device ", device_, " (", device_name_, ", ", sm_count_,
               " SMs): ", channels_, " channels", channels_note(), ", ", lay_.slots, " slots x ", lay_.slot_bytes,
               " B, one-shot <= ", oneshot_bytes(), " B, arena ", lay_.arena_bytes,
               " B, registered tensors read in place: ", opt_.registered ? "yes" : "no");
  }

  // ---- ring primitives (called by StepRing) -----------------------------------------------
  void step(StepKind k, const Slice& s);
  void finish_ring();

 private:
  struct Call {
    ringdp::Kind kind = ringdp::Kind::kAllReduce;
    char* data = nullptr;   // the buffer the schedule's slices index (reduce_scatter: the input)
    char* result = nullptr;  // reduce_scatter: the output, element result_base of the buffer
    size_t result_base = 0;
    int root = 0;           // broadcast's source
    size_t count = 0;       // all_reduce, broadcast: elements; the halves: per rank
    DType dtype = DType::kFloat32;
    RedOp op = RedOp::kSum;
    size_t esize = 4;
    size_t acc = 4;
    cudaStream_t caller = nullptr;
    bool registered = false;  // the successor reads this call's tensor in place
  };

  // The checks every collective starts with.
  void usable(const char* what) {
    check();
    if (!connected_ || quiesced_)
      throw RingError(cat("ringdp cuda-ipc rank ", me_, ": ", what, " on a communicator that is ",
                          connected_ ? "shut down" : "not connected"));
  }

  // Whether `algo` asks for one-shot (checked: a known code; what one-shot would stage, `bytes`
  // of `elems` elements, fits the one-shot buffer), before anything is enqueued: never a
  // silent fallback to the ring.
  bool is_oneshot(int algo, const char* what, size_t bytes, size_t elems, DType dtype) const {
    if (algo != kAlgoRing && algo != kAlgoOneShot)
      throw RingError(cat("ringdp cuda-ipc rank ", me_, ": unknown algorithm code ", algo, " (0: ring, 1: one-shot)"));
    if (algo == kAlgoOneShot && bytes > oneshot_bytes())
      throw RingError(cat("ringdp cuda-ipc rank ", me_, ": one-shot ", what, " of ", bytes, " bytes (", elems, " x ",
                          dtype_name(dtype), ") requested, but this transport runs one-shot only up to ",
                          oneshot_bytes(), " bytes",
                          world_ > kMaxOneShotWorld ? cat(" (none above ", kMaxOneShotWorld, " ranks)")
                                                    : std::string(" (its one-shot buffer, RINGDP_CUDA_ONESHOT_BYTES)"),
                          "; nothing was run"));
    return algo == kAlgoOneShot;
  }

  // Start a collective: ringdp's stream waits for the caller's, the call is counted (every
  // rank counts the same collectives). Returns the caller's stream.
  cudaStream_t enter(uintptr_t stream, double timeout_s) {
    cudaStream_t caller = reinterpret_cast<cudaStream_t>(stream);
    const double t = timeout_s > 0 ? timeout_s : opt_.timeout_s;
    timeout_ns_ = timeout_ns(t);
    RINGDP_CUDA_CHECK(cudaEventRecord(ev_in_, caller), "cudaEventRecord on the caller's stream");
    RINGDP_CUDA_CHECK(cudaStreamWaitEvent(stream_, ev_in_, 0), "cudaStreamWaitEvent (ringdp stream)");
    ++call_;
    return caller;
  }

  Call make_call(ringdp::Kind kind, char* data, size_t count, DType dtype, RedOp op, cudaStream_t caller) const {
    Call c;
    c.kind = kind;
    c.data = data;
    c.count = count;
    c.dtype = dtype;
    c.op = op;
    c.esize = dtype_size(dtype);
    c.acc = acc_size(dtype);
    c.caller = caller;
    return c;
  }

  // A device-to-device copy on ringdp's stream (nothing when dst == src).
  void copy_block(char* dst, const char* src, size_t bytes) {
    if (dst == src || bytes == 0) return;
    RINGDP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_),
                      "cudaMemcpyAsync (ringdp stream)");
  }

  // The ring of call `c` (csrc/ring/ring.cpp), one step kernel per primitive; ends with
  // finish_ring(). Partial sums travel in Acc (all_reduce, reduce_scatter), final values in T.
  void run_ring(const Call& c, int root) {
    cur_ = c;
    plan_.begin_call(cur_.registered, cur_.esize, cur_.acc, cur_.op, world_);
    const bool reduces = c.kind == ringdp::Kind::kAllReduce || c.kind == ringdp::Kind::kReduceScatter;
    RingPlan plan;
    plan.count = c.count;
    plan.world = world_;
    plan.rank = rank_;
    plan.slice_elems = geometry().slice_elems(reduces ? cur_.acc : cur_.esize);  // > 0: slot_bytes >= 4096, channels <= 64
    plan.align = kPackElems;
    ring_run(ring_, c.kind, plan, root);
  }

  void setup() {
    DeviceGuard g(device_);
    RINGDP_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device_),
                      "cudaDeviceGetAttribute(multiProcessorCount)");
    cudaDeviceProp prop;
    RINGDP_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_), "cudaGetDeviceProperties");
    std::memcpy(uuid_, &prop.uuid, 16);
    device_name_ = prop.name;
    void* p = nullptr;
    RINGDP_CUDA_CHECK(cudaMalloc(&p, lay_.total()), cat("cudaMalloc of the ", lay_.total(), "-byte IPC region"));
    base_ = static_cast<char*>(p);
    RINGDP_CUDA_CHECK(cudaMemset(base_, 0, lay_.fifo_off()), "cudaMemset of the counters");
    RINGDP_CUDA_CHECK(cudaDeviceSynchronize(), "cudaDeviceSynchronize after zeroing the counters");
    RINGDP_CUDA_CHECK(cudaIpcGetMemHandle(&handle_, base_), "cudaIpcGetMemHandle");
    void* h = nullptr;
    RINGDP_CUDA_CHECK(cudaHostAlloc(&h, sizeof(HostShared), cudaHostAllocMapped | cudaHostAllocPortable),
                      "cudaHostAlloc (mapped failure record)");
    host_ = static_cast<HostShared*>(h);
    std::memset(h, 0, sizeof(HostShared));
    void* hd = nullptr;
    RINGDP_CUDA_CHECK(cudaHostGetDevicePointer(&hd, h, 0), "cudaHostGetDevicePointer");
    host_dev_ = static_cast<HostShared*>(hd);
    // High priority: in RingDDP the ring overlaps backward compute and should not queue behind it.
    RINGDP_CUDA_CHECK(StreamPool::acquire(device_, &stream_), "creating ringdp's CUDA stream");
    RINGDP_CUDA_CHECK(cudaEventCreateWithFlags(&ev_in_, cudaEventDisableTiming), "cudaEventCreate");
    RINGDP_CUDA_CHECK(cudaEventCreateWithFlags(&ev_out_, cudaEventDisableTiming), "cudaEventCreate");
    if (lay_.arena_bytes > 0) free_[0] = lay_.arena_bytes;
  }

  // Best effort, never throws (also runs from the destructor, possibly after CUDA shut
  // down). The stream drain inside quiesce() is bounded: every device wait times out.
  void release(bool from_dtor) {
    if (destroyed_) return;
    quiesce();
    destroyed_ = true;
    DeviceGuard g(device_);
    if (ev_in_) (void)cudaEventDestroy(ev_in_);
    if (ev_out_) (void)cudaEventDestroy(ev_out_);
    ev_in_ = ev_out_ = nullptr;
    StreamPool::release(device_, stream_);  // idle (quiesce synchronised it); see StreamPool
    stream_ = nullptr;
    HostShared* gone = nullptr;
    {
      std::lock_guard<std::mutex> lk(rec_mu_);
      if (const ErrorRecord* r = record_locked())  // (failure_of after destroy())
        struck_.fail_from(failure_message(*r), r->call);
      gone = host_;
      host_ = nullptr;
      host_dev_ = nullptr;
    }
    if (gone) (void)cudaFreeHost(gone);  // (not under rec_mu_: a halt from another thread never waits on it)
    if (fatal_.empty()) fatal_ = cat("ringdp cuda-ipc rank ", me_, ": this communicator was destroyed");
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (used_.empty() || from_dtor) {
        free_region_locked();
      } else {
        region_free_pending_ = true;  // registered tensors still alive: the last free() frees it
      }
    }
    (void)cudaGetLastError();
  }

  void free_region_locked() {
    if (base_) {
      DeviceGuard g(device_);
      for (Deferred& d : deferred_) (void)cudaEventDestroy(d.done);  // (the stream was drained: quiesce)
      deferred_.clear();
      (void)cudaFree(base_);
      (void)cudaGetLastError();
    }
    base_ = nullptr;
    region_free_pending_ = false;
  }

  void poison(const std::string& why) {
    if (host_) host_->host_abort = 1;
    if (fatal_.empty())
      fatal_ = cat("ringdp cuda-ipc rank ", me_, ": ", why, "; this communicator is unusable now");
  }

  // Whether the successor may read this tensor in place: registered memory (our arena),
  // 16-byte aligned, and Options::registered on.
  bool read_in_place(uintptr_t data, size_t bytes) const {
    return opt_.registered && aligned16(reinterpret_cast<const void*>(data)) && is_registered(data, bytes);
  }

  // How the channel count came about, for describe().
  std::string channels_note() const {
    const ChannelChoice& c = channel_choice_;
    if (!c.clamped) return "";
    if (c.channels == c.share)
      return cat(" (clamped from the requested ", c.requested, ": the most shared GPU gives each rank ", c.share,
                 " SMs, and every block must be resident)");
    return cat(" (clamped from the requested ", c.requested, ": at most ", kMaxChannels, ")");
  }

  SlotGeometry geometry() const {
    SlotGeometry g;
    g.slot_bytes = lay_.slot_bytes;
    g.channels = channels_;
    return g;
  }

  Ctrl* ctrl(int p) const { return reinterpret_cast<Ctrl*>(bases_[p] + lay_.ctrl_off()); }
  SlotMeta* ring_meta(int p, uint64_t k) const { return reinterpret_cast<SlotMeta*>(bases_[p] + lay_.ring_meta(k)); }
  SlotMeta* oneshot_meta(int p, int parity) const {
    return reinterpret_cast<SlotMeta*>(bases_[p] + lay_.oneshot_meta(parity));
  }

  FailCtx fail_ctx() const {
    FailCtx f;
    f.record = &host_dev_->rec;
    f.lock = reinterpret_cast<unsigned long long*>(&ctrl(rank_)->lock.v);
    f.my_abort = &ctrl(rank_)->abort.v;
    f.host_abort = &host_dev_->host_abort;
    f.gate = gated_ ? &host_dev_->host_abort : nullptr;
    f.halt_reason = host_dev_->halt_reason;
    f.timeout_ns = timeout_ns_;
    f.call = call_;
    f.rank = rank_;
    return f;
  }

  // One one-shot collective (reduce_kernels.cuh OneShotArgs) on ringdp's stream: `count`
  // elements per rank (all_reduce, broadcast: the tensor), `in` and `out` as the kernel reads
  // and writes them. The staged bytes fit the buffer (is_oneshot).
  void run_oneshot(ringdp::Kind kind, const char* in, char* out, size_t count, DType dtype, RedOp op, int root) {
    ++oneshot_seq_;
    const int parity = static_cast<int>(oneshot_seq_ & 1);
    OneShotArgs a;
    std::memset(&a, 0, sizeof(a));
    a.dtype = dtype;
    a.op = op;
    a.coll = static_cast<int32_t>(kind);
    a.root = root;
    a.in = in;
    a.out = out;
    a.count = count;
    a.avg_div = op == RedOp::kAvg ? world_ : 0;
    a.channels = channels_;
    a.world = world_;
    a.rank = rank_;
    a.seq = oneshot_seq_;
    for (int p = 0; p < world_; ++p) {
      a.bufs[p] = bases_[p] + lay_.oneshot_off(parity);
      a.flags[p] = &ctrl(p)->oneshot[0].v;
      a.metas[p] = oneshot_meta(p, parity);
      a.aborts[p] = &ctrl(p)->abort.v;
    }
    a.my_flag = &ctrl(rank_)->oneshot[0].v;
    a.my_meta = oneshot_meta(rank_, parity);
    a.call = call_;
    a.fail = fail_ctx();
    RINGDP_CUDA_CHECK(launch_oneshot(a, stream_), "launching the one-shot all-reduce kernel");
  }

  void finish_call(cudaStream_t caller) {
    RINGDP_CUDA_CHECK(cudaEventRecord(ev_out_, stream_), "cudaEventRecord (ringdp stream)");
    RINGDP_CUDA_CHECK(cudaStreamWaitEvent(caller, ev_out_, 0), "cudaStreamWaitEvent (caller's stream)");
  }

  int name_of(int r) const { return rank_name(opt_.rank_names, r); }  // (as messages name rank r)

  std::string failure_message(const ErrorRecord& r) const {
    const std::string me = cat("ringdp cuda-ipc rank ", me_, ": ");
    switch (r.code) {
      case kErrTimeout:
        return cat(me, "timed out after ", static_cast<double>(r.waited_ns) / 1e9, " s waiting for rank ", name_of(r.peer),
                   " (channel ", r.channel, ": its counter ", what_name(r.what), " is ", r.seen, ", needed >= ",
                   r.target, "). Rank ", name_of(r.peer), " is stuck, dead, or did not make the same collective calls (every "
                   "rank must make the same collectives in the same order with the same size, dtype, op and root)");
      case kErrPeerAborted:
        if (r.reason[0] != 0)
          return cat(me, "rank ", name_of(r.peer), " ", std::string(r.reason, strnlen(r.reason, kReasonBytes)),
                     "; it gave up (raised its abort flag), so this rank stopped too");
        return cat(me, "rank ", name_of(r.peer), " gave up (it raised its abort flag), so this rank stopped too; rank ",
                   name_of(r.peer),
                   "'s own error says why");
      case kErrHostAbort:
        return cat(me, "aborted: ", abort_reason_.empty() ? std::string("abort requested") : abort_reason_);
      case kErrMismatch:
        return cat(me, "collective mismatch with rank ", name_of(r.peer), ": this rank is at ", meta_str(r.mine),
                   ", rank ", name_of(r.peer), " is at ", meta_str(r.theirs),
                   ". Every rank must make the same collectives in the same order with the same size, dtype, op "
                   "and root");
      case kErrBadDescriptor:
        return cat(me, "rank ", name_of(r.peer), " published a slice outside its buffer (offset ", r.theirs.src_off, ", ",
                   r.theirs.bytes, " bytes): memory corruption or mixed ringdp versions");
    }
    return cat(me, "device reported failure code ", r.code);
  }

  Options opt_;
  int rank_;
  int world_;
  int me_ = 0;  // rank_ as messages name it (Options::rank_names)
  int device_ = 0;
  int sm_count_ = 0;
  unsigned char uuid_[16] = {};
  std::string device_name_;
  Layout lay_;
  int channels_ = 1;
  ChannelChoice channel_choice_;

  char* base_ = nullptr;
  cudaIpcMemHandle_t handle_{};
  std::vector<char*> bases_;
  std::vector<uint64_t> region_bytes_;
  HostShared* host_ = nullptr;
  HostShared* host_dev_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ev_in_ = nullptr;
  cudaEvent_t ev_out_ = nullptr;

  bool connected_ = false;
  bool quiesced_ = false;
  bool destroyed_ = false;
  std::string fatal_;
  std::string abort_reason_;   // (rec_mu_) the first of abort()'s and halt()'s reasons
  mutable std::mutex rec_mu_;  // host_'s lifetime for the record's readers (check, failure_of) and halt(); abort_reason_
  std::atomic<bool> halted_{false};  // halt() ran (any thread): the next call raises
  std::string told_;                 // (rec_mu_) the reason this rank gives its peers beside its abort flag
  bool announced_ = false;           // (rec_mu_) announce() enqueued the reason and the flag
  bool gated_ = false;               // follow(): every kernel checks host_abort at its start (FailCtx::gate)

  uint64_t call_ = 0;         // collectives started (every rank counts the same)
  FailureLedger struck_;      // after destroy(): the collectives the device record said failed
  uint64_t oneshot_seq_ = 0;  // one-shot collectives started
  uint64_t timeout_ns_ = 0;
  Call cur_;
  StepRing<IpcComm> ring_;
  Planner plan_;  // counters and guards of the ring protocol (protocol.h)

  mutable std::mutex mu_;
  std::map<size_t, size_t> free_;  // arena offset -> bytes
  std::map<size_t, size_t> used_;
  struct Deferred {
    size_t off, len;
    cudaEvent_t done;  // recorded on ringdp's stream when the block was freed
  };
  std::vector<Deferred> deferred_;  // freed blocks not yet reusable (free, reclaim_locked)
  bool region_free_pending_ = false;
};

void IpcComm::step(StepKind k, const Slice& s) {
  const int pred = (rank_ - 1 + world_) % world_, succ = (rank_ + 1) % world_;
  const StepPlan p = plan_.step(k, s);
  char* d = cur_.data + s.offset * cur_.esize;

  StepArgs a;
  std::memset(&a, 0, sizeof(a));
  StepSig g;
  std::memset(&g, 0, sizeof(g));
  a.kind = k;
  a.dtype = cur_.dtype;
  a.op = cur_.op;
  a.count = s.count;
  a.channels = channels_;
  a.avg_div = p.avg_div;
  a.in = p.reads_in ? d : nullptr;
  a.out = p.writes_out ? d : nullptr;
  if (p.writes_result) a.out = cur_.result + (s.offset - cur_.result_base) * cur_.esize;
  a.src = nullptr;  // from the predecessor's descriptor
  a.dst = p.writes_slot ? base_ + lay_.slot_off(p.produce_index) : nullptr;
  a.dst_chan_stride = p.writes_slot ? geometry().sub_bytes() : 0;
  if (p.consumes) {
    const uint64_t c = p.consume_target - 1;
    g.pred_posted = &ctrl(pred)->posted[0].v;
    g.pred_meta = ring_meta(pred, c);
    g.pred_base = bases_[pred];
    g.pred_region_bytes = region_bytes_[pred];
    g.pred_abort = &ctrl(pred)->abort.v;
    g.consume_target = p.consume_target;
    g.my_consumed = &ctrl(rank_)->consumed[0].v;
    g.pred_rank = pred;
    g.consume_elem_bytes = p.consume_elem_bytes;
  }
  if (p.produces) {
    g.my_posted = &ctrl(rank_)->posted[0].v;
    g.my_meta = ring_meta(rank_, p.produce_index);
    g.produce_value = p.produce_value;
    g.produce_elem_bytes = p.produce_elem_bytes;
    g.produce_src_off = p.in_place ? static_cast<uint64_t>(d - base_) : lay_.slot_off(p.produce_index);
    g.produce_chan_stride = p.in_place ? 0 : geometry().sub_bytes();
  }
  g.succ_consumed = &ctrl(succ)->consumed[0].v;
  g.succ_abort = &ctrl(succ)->abort.v;
  g.consumed_target = p.guard;
  g.succ_rank = succ;
  g.call = call_;
  g.total_count = cur_.count;
  g.coll = static_cast<int32_t>(cur_.kind);
  g.root = cur_.root;
  g.fail = fail_ctx();
  a.sig = &g;
  RINGDP_CUDA_CHECK(launch_step(a, stream_), "launching a ring step kernel");
}

void IpcComm::finish_ring() {
  const uint64_t drain = plan_.end_call();
  if (drain > 0) {
    // The successor may still read our tensor in place: the caller gets it back only after.
    DrainArgs d;
    std::memset(&d, 0, sizeof(d));
    const int succ = (rank_ + 1) % world_;
    d.succ_consumed = &ctrl(succ)->consumed[0].v;
    d.succ_abort = &ctrl(succ)->abort.v;
    d.target = drain;
    d.succ_rank = succ;
    d.channels = channels_;
    d.fail = fail_ctx();
    RINGDP_CUDA_CHECK(launch_drain(d, stream_), "launching the drain kernel");
  }
  finish_call(cur_.caller);
}

}  // namespace

std::shared_ptr<Comm> make_comm(const Options& opts) { return std::make_shared<IpcComm>(opts); }

}  // namespace ipc
}  // namespace cuda
}  // namespace ringdp
