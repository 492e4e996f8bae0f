// The shared-memory communicator: one per (process group, process). Owns this rank's
// segment, maps the peers', runs the per-call header exchange (mismatch detection), the
// one-shot path, the direct path for registered tensors (run_direct), and drives the ring
// engine over the staged shm transport: all_reduce, reduce_scatter, all_gather and
// broadcast, each a Kind in the call's fingerprint.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../../common/endpoint.h"
#include "../../common/flight.h"
#include "../../common/rank_names.h"
#include "../../common/types.h"
#include "layout.h"
#include "link.h"
#include "segment.h"
#include "wait.h"

namespace ringdp {

enum class Algo : int32_t { kRing = 0, kOneShot = 1 };

struct ShmConfig {
  int rank = 0;
  int world = 1;
  std::string name;       // this rank's segment name, unique per job and rank
  std::string host;       // written into the segment for diagnostics
  size_t fifo_slots = 8;  // slots per connection (>= 2)
  size_t slot_bytes = 256 << 10;
  size_t oneshot_bytes = 256 << 10;     // one-shot buffer: the largest one-shot message
  size_t arena_bytes = size_t(16) << 30;  // virtual size of the registered-memory arena
  int64_t spin_ns = 50000;
  double stall_warn_s = 60;  // a call that waited this long reports the stall once (0: never)
  size_t flight_calls = 256;  // calls kept in the flight record
  // How messages name this endpoint's ranks: rank_names[r] for endpoint rank r (a host's
  // endpoint across hosts: the communicator's ranks of that host); empty: r itself.
  std::vector<int> rank_names;
};

// Lifecycle (endpoint.h): the constructor creates (and owns) this rank's segment;
// local_blob() describes it; connect() maps every peer's segment; unlink_own() once every
// peer has mapped it.
class ShmComm final : public Endpoint {
 public:
  explicit ShmComm(const ShmConfig& cfg);
  ~ShmComm() override;

  const std::string& name() const { return cfg_.name; }
  int rank() const { return cfg_.rank; }
  int world() const { return cfg_.world; }
  uint32_t calls() const { return seq_; }

  // This rank's segment name, identity and configuration (shm::Blob + name).
  std::string local_blob() override;
  // Map every peer's segment (blobs indexed by rank) and check identity and configuration.
  void connect(const std::vector<std::string>& blobs) override;
  // Remove this rank's name from /dev/shm once every peer has mapped it.
  void unlink_own();

  // In-place all-reduce of `count` elements at `data`. Collective: every rank of the group
  // calls it in the same order, with the same `tag` (the caller's name for the call, at
  // most kTagBytes - 1 bytes). Throws RingError on a mismatch (shape or fingerprint),
  // timeout, dead or failed peer.
  void all_reduce(void* data, size_t count, DType dtype, RedOp op, Algo algo, double timeout_s,
                  const std::string& tag = "");
  // torch's reduce_scatter_tensor: `input` holds world * count elements (block q = rank q's
  // share), `output` count elements; rank r gets the reduction of every rank's block r.
  // The input is never written (the output may be its block r). Direct when every rank's
  // input is registered (run_direct: each rank reduces its block from the peers' inputs
  // where they lie), else the ring (staged: in place, the partial sums would overwrite the
  // input) or one-shot (world * count elements must fit its buffer).
  void reduce_scatter(const void* input, void* output, size_t count, DType dtype, RedOp op, Algo algo,
                      double timeout_s, const std::string& tag = "");
  // torch's all_gather_into_tensor: `input` count elements, `output` world * count; block q
  // of the output is rank q's input. `input` may be block r of `output` itself. Direct
  // when every rank's output is registered (run_direct: each rank copies the peers' blocks
  // from their outputs), else the staged ring or one-shot. The input goes into block r
  // first, before the call's checks (so even a failed call leaves it there).
  void all_gather(const void* input, void* output, size_t count, DType dtype, Algo algo, double timeout_s,
                  const std::string& tag = "");
  // Copy `count` elements at `data` of rank `root` to every rank's `data` (a pipelined chain
  // along the ring; direct when every rank's tensor is registered: each copies the root's).
  void broadcast(void* data, size_t count, DType dtype, int root, Algo algo, double timeout_s,
                 const std::string& tag = "");
  // The collective across hosts that this rank's next calls are steps of (none at first),
  // in every header from now on and compared with the shape (shm::Outer): set by the
  // caller at the start of each such collective (ringdp/hosts.py CrossHost._announce).
  void set_outer(Kind kind, int32_t arg, uint64_t count, DType dtype) {
    outer_ = shm::Outer{static_cast<int16_t>(kind), static_cast<int16_t>(dtype), arg, count};
  }
  // Take part in the next collective without data because this rank rejected its input:
  // peers raise an error naming this rank and `why`. Does not throw for the local rank
  // unless the exchange itself fails.
  void reject(const std::string& why, double timeout_s, const std::string& tag = "");

  // Called once per call that has waited stall_warn_s for a peer, on the waiting thread,
  // with the stall report (stall_report()). Default: none (the report still goes into a
  // timeout's RingError).
  void set_stall_handler(std::function<void(const std::string&)> f) { on_stall_ = std::move(f); }
  // Every rank's position: which ranks have not entered the current call, and per rank its
  // last finished and current call (number, kind, size, tag). Reads the peers' headers.
  std::string stall_report(int waiting_on, const char* what) const;
  // This rank's last calls, oldest first.
  std::vector<CallRecord> flight_record() const { return flight_.snapshot(); }

  // Registered memory: an arena at the end of the segment that every peer has mapped.
  size_t arena_alloc(size_t bytes);  // returns an offset into the arena
  void arena_free(size_t offset);
  char* arena_base() const { return segs_[cfg_.rank].base() + geo_.arena_offset(); }
  size_t arena_bytes() const { return geo_.arena_bytes; }
  int64_t arena_offset_of(const void* p, size_t bytes) const;
  size_t arena_in_use() const;

  // Give up, from any thread (the backend's abort(), while a call may be in flight on
  // another): returns at once. The call in flight fails at its next health check (a few
  // milliseconds: every wait runs one), later calls at once, and peers blocked on this rank
  // fail fast naming it and `why`. Poisons the communicator.
  void request_abort(const std::string& why);
  bool is_aborted() const { return !poison_.empty() || abort_requested_.load(std::memory_order_acquire); }

  // Largest message the one-shot path takes (its buffer).
  size_t oneshot_bytes() const { return geo_.oneshot_bytes; }

  // How long every wait spins before sleeping on the futex (the caller picks it per call:
  // ringdp/policy.py spin_ns). Any thread may set it, during a call too: the call's later
  // waits spin as set (shm::WaitPolicy).
  void set_spin_ns(int64_t ns);
  int64_t spin_ns() const { return wait_policy_.spin_ns.load(std::memory_order_relaxed); }

 private:
  // The health check every wait of this communicator runs (deadline, aborted or dead peers).
  class Health final : public shm::Watch {
   public:
    explicit Health(ShmComm& c) : c_(c) {}
    void check(int peer, const char* what) override { c_.check_health(peer, what); }

   private:
    ShmComm& c_;
  };

  shm::Control& ctrl(int r) const { return *reinterpret_cast<shm::Control*>(segs_[r].base()); }
  char* oneshot_buf(int r, int parity) const { return segs_[r].base() + geo_.oneshot_offset(parity); }
  // Block until flag (owned by rank `owner`) reaches target; `what` describes the wait.
  void wait(const shm::Flag& flag, int owner, uint32_t target, const char* what);
  void publish(shm::Flag& flag, uint32_t value) { shm::publish(flag, ctrl(cfg_.rank).sleepers, value); }
  void check_health(int waiting_on, const char* what);
  void require_connected() const;
  // This rank's identity (what its segment's Control block and its blob say).
  shm::Identity identity() const;
  // Throw RingError unless `id` (of a peer's record or segment, `what`) is a ringdp of this
  // version, rank r of this world, with this configuration and `actual_bytes` of segment.
  void check_identity(int r, const shm::Identity& id, bool readable, uint64_t actual_bytes,
                      const std::string& what) const;
  // One collective as this communicator runs it.
  struct Call {
    Kind kind = Kind::kAllReduce;
    DType dtype = DType::kFloat32;
    RedOp op = RedOp::kSum;
    Algo algo = Algo::kRing;
    size_t count = 0;          // elements (reduce_scatter, all_gather: per rank)
    int root = 0;              // broadcast's source
    const char* in = nullptr;  // reduce_scatter, all_gather: the input
    char* data = nullptr;      // the tensor (all_reduce, broadcast) or the output
  };
  // Checks shared by every collective, then begin_call / run_call / end_call.
  void run(Call c, double timeout_s, const std::string& tag);
  // Start call s: number, deadline, stall clock, flight record (returns its slot).
  size_t begin_call(uint32_t s, double timeout_s, Kind kind, DType dtype, RedOp op, Algo algo, size_t count,
                    const std::string& tag);
  // Fill this rank's header for call s (parity s & 1): fingerprint and shape.
  shm::CallHeader& write_header(uint32_t s, Kind kind, DType dtype, RedOp op, Algo algo, size_t count,
                                const std::string& tag);
  // Call s is over (successfully or not): Control::done and the flight record.
  void end_call(uint32_t s, size_t slot, bool ok);
  void exchange_headers(uint32_t s);
  // A collective's body for call s: headers, checks, then one-shot or ring.
  void run_call(uint32_t s, const Call& c, const std::string& tag);
  // The data-moving part of run_call, once every header agrees.
  void run_oneshot(int parity, const Call& c);
  void run_direct(uint32_t s, int parity, const Call& c);
  void run_ring(const Call& c);
  // Whether every rank's header of `parity` names a tensor in its registered arena.
  bool all_registered(int parity) const;
  // Note in the current call's flight record what moved its data.
  void took(CallRecord::Path path) { flight_.set_path(flight_slot_, call_, path); }
  // Give up (on the thread of the call): peers blocked on this rank fail fast with `why`.
  // Poisons the communicator.
  void abort(const std::string& why);
  void fail(const std::string& why);  // abort() and throw
  void wake_all_mine();  // wake whoever sleeps on any of this rank's flags (they notice an abort promptly)
  // "all_reduce #s 1024 x float32 SUM ring tag '...'" of rank r's header of `parity`.
  std::string describe_header(int r, int parity) const;
  // Endpoint rank r as messages name it (ShmConfig::rank_names); a value out of range (a
  // peer's garbled header) as it is.
  int name_of(int r) const { return rank_name(cfg_.rank_names, r); }

  ShmConfig cfg_;
  shm::Geometry geo_;
  std::vector<shm::Segment> segs_;  // by rank; segs_[rank] is this rank's own
  std::vector<bool> pid_usable_;
  uint32_t seq_ = 0;
  bool connected_ = false;
  shm::WaitPolicy wait_policy_;
  shm::Clock::time_point deadline_;
  double timeout_s_ = 0;
  shm::Outer outer_{-1, 0, 0};  // set_outer
  uint32_t call_ = 0;  // call number being run, for messages
  size_t flight_slot_ = 0;  // its flight record
  Kind kind_ = Kind::kAllReduce;  // its kind
  shm::Clock::time_point call_start_;
  bool stall_reported_ = false;
  std::function<void(const std::string&)> on_stall_;
  FlightRecorder flight_;
  std::string poison_;  // (the thread of the calls only)
  // request_abort(), from another thread: the flag, and its reason under abort_mu_ (which
  // also orders the writes of this rank's Control::abort_msg).
  std::atomic<bool> abort_requested_{false};
  std::string requested_why_;
  mutable std::mutex abort_mu_;
  Health health_{*this};
  std::unique_ptr<shm::Link> link_;  // made by connect(); its counters live as long as this

  mutable std::mutex arena_mu_;
  std::map<size_t, size_t> free_;  // offset -> bytes
  std::map<size_t, size_t> used_;
};

}  // namespace ringdp
