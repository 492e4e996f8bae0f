#include "shm_comm.h"

#include <errno.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

#include "../../common/error.h"
#include "../../common/interrupt.h"
#include "../../kernels/cpu/reduce.h"
#include "../../ring/ring.h"
#include "../../ring/schedule.h"
#include "shm_transports.h"

namespace ringdp {

using shm::Clock;
using shm::Control;

namespace {

constexpr size_t kArenaAlign = 4096;
// run_direct reduces and copies this many bytes at a time (a block stays in L1 between
// being reduced and copied to the peers; 4-64 KiB measured the same).
constexpr size_t kDirectBlockBytes = 32 << 10;

void copy_msg(char* dst, const std::string& s) {
  size_t n = s.size() < shm::kMsgBytes - 1 ? s.size() : shm::kMsgBytes - 1;
  std::memcpy(dst, s.data(), n);
  dst[n] = '\0';
}

std::string read_msg(const char* src) { return std::string(src, strnlen(src, shm::kMsgBytes)); }

// A peer is gone when its pid no longer exists or is a zombie (killed but not yet reaped
// by its parent, e.g. a launcher that polls its children every few seconds).
bool pid_dead(int pid) {
  if (::kill(pid, 0) != 0) return errno == ESRCH;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (!f) return false;
  char buf[512];
  size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* close = std::strrchr(buf, ')');
  return close && close[1] == ' ' && (close[2] == 'Z' || close[2] == 'X');
}

const char* algo_name(int32_t a) { return a == static_cast<int32_t>(Algo::kOneShot) ? "oneshot" : "ring"; }

// What a rank's header says of its call, copied while the rank may be rewriting it
// (diagnostics only).
struct HeaderView {
  uint32_t seq;
  int32_t kind, dtype, op, algo, root;
  uint64_t count;
  shm::Outer outer;
  char tag[kTagBytes];
};

HeaderView view(const shm::CallHeader& h) {
  HeaderView v;
  v.seq = h.seq.v.load(std::memory_order_acquire);
  v.kind = h.kind;
  v.dtype = h.dtype;
  v.op = h.op;
  v.algo = h.algo;
  v.root = h.root;
  v.count = h.count;
  v.outer = h.outer;
  std::memcpy(v.tag, h.tag, kTagBytes);
  v.tag[kTagBytes - 1] = '\0';
  return v;
}

// ", a step of all_reduce across hosts of 40001 x float32 AVG" (shm::Outer; "" for none).
// Its root is a rank of the caller's group already.
std::string describe_outer(const shm::Outer& o) {
  if (o.kind < 0) return "";
  const Kind k = static_cast<Kind>(o.kind);
  const std::string what = k == Kind::kBroadcast   ? cat(" from rank ", o.arg)
                           : k == Kind::kAllGather ? std::string("")
                                                   : cat(" ", redop_name(static_cast<RedOp>(o.arg)));
  return cat(", a step of ", kind_name(k), " across hosts of ", o.count, " x ",
             dtype_name(static_cast<DType>(o.dtype)), k == Kind::kReduceScatter || k == Kind::kAllGather ? " per rank" : "",
             what);
}

// `root`: the broadcast root as the messages name it (ShmComm::name_of).
std::string describe(const HeaderView& h, int root) {
  const Kind k = static_cast<Kind>(h.kind);
  const std::string what = k == Kind::kBroadcast   ? cat("from rank ", root)
                           : k == Kind::kAllGather ? std::string("")
                                                   : std::string(redop_name(static_cast<RedOp>(h.op)));
  return cat(kind_name(k), " #", h.seq, " (", h.count, " x ", dtype_name(static_cast<DType>(h.dtype)),
             k == Kind::kReduceScatter || k == Kind::kAllGather ? " per rank" : "", what.empty() ? "" : " ", what,
             " ", algo_name(h.algo), ", tag '", h.tag, "'", describe_outer(h.outer), ")");
}

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// A failure's first line: its own message, without the stall report that may follow.
std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

}  // namespace

ShmComm::ShmComm(const ShmConfig& cfg) : cfg_(cfg), flight_(cfg.flight_calls) {
  check_ranks("shm", cfg_.rank, cfg_.world, cfg_.rank_names);
  // A power of two: a link picks its slot as a 32-bit slice counter modulo the slots, which
  // stays in order across the counter's wrap only when the count divides 2^32.
  if (cfg_.fifo_slots < 2 || (cfg_.fifo_slots & (cfg_.fifo_slots - 1)) != 0)
    throw RingError("fifo_slots must be a power of two, at least 2");
  if (cfg_.slot_bytes < 4096 || cfg_.slot_bytes % 64 != 0)
    throw RingError(cat("rank ", name_of(cfg_.rank), ": slot_bytes ", cfg_.slot_bytes,
                        " (RINGDP_SLOT_BYTES) must be a multiple of 64 and at least 4096"));
  try {
    geo_ = shm::Geometry::make(cfg_.fifo_slots, cfg_.slot_bytes, cfg_.oneshot_bytes, cfg_.arena_bytes, kArenaAlign);
  } catch (const RingError& e) {
    throw RingError(cat("rank ", name_of(cfg_.rank), ": ", e.what()));
  }
  cfg_.oneshot_bytes = geo_.oneshot_bytes;  // (rounded up: a cache line, the arena's alignment)
  cfg_.arena_bytes = geo_.arena_bytes;
  wait_policy_.spin_ns.store(cfg_.spin_ns, std::memory_order_relaxed);

  segs_.resize(static_cast<size_t>(cfg_.world));
  pid_usable_.assign(static_cast<size_t>(cfg_.world), false);
  shm::Segment own;
  try {
    own = shm::Segment::create(cfg_.name, geo_.total_bytes(), geo_.fixed_bytes());
  } catch (const shm::NoRoom& e) {  // (/dev/shm too small: what takes the room, and what shrinks it)
    throw RingError(cat("rank ", name_of(cfg_.rank), ": ", e.what(), ". Each rank of this host reserves ",
                        geo_.fixed_bytes(), " bytes at set-up (", geo_.fifo_slots, " slots of ", geo_.slot_bytes,
                        " bytes: RINGDP_FIFO_SLOTS, RINGDP_SLOT_BYTES; two one-shot buffers of ", geo_.oneshot_bytes,
                        " bytes: RINGDP_ONESHOT_BYTES), and its registered tensors' arena (RINGDP_ARENA_GB) as "
                        "tensors are registered"));
  } catch (const RingError& e) {
    throw RingError(cat("rank ", name_of(cfg_.rank), ": ", e.what()));
  }
  Control* c = new (own.base()) Control();
  c->id = identity();
  c->id.magic = 0;
  copy_msg(c->host, cfg_.host.substr(0, sizeof(c->host) - 1));
  std::atomic_thread_fence(std::memory_order_release);
  c->id.magic = shm::kMagic;  // last: a peer that sees the magic sees the rest
  segs_[static_cast<size_t>(cfg_.rank)] = std::move(own);
  free_[0] = geo_.arena_bytes;
}

ShmComm::~ShmComm() = default;  // Segments unmap (and unlink, if still linked) themselves.

shm::Identity ShmComm::identity() const {
  shm::Identity id;
  std::memset(&id, 0, sizeof(id));
  id.magic = shm::kMagic;
  id.version = shm::kLayoutVersion;
  id.rank = cfg_.rank;
  id.world = cfg_.world;
  id.pid = static_cast<int32_t>(::getpid());
  id.segment_bytes = geo_.total_bytes();
  id.fifo_slots = geo_.fifo_slots;
  id.slot_bytes = geo_.slot_bytes;
  id.oneshot_bytes = geo_.oneshot_bytes;
  id.arena_bytes = geo_.arena_bytes;
  return id;
}

std::string ShmComm::local_blob() {
  shm::Blob b;
  std::memset(&b, 0, sizeof(b));
  b.id = identity();
  b.name_len = static_cast<uint32_t>(cfg_.name.size());
  return std::string(reinterpret_cast<const char*>(&b), sizeof(b)) + cfg_.name;
}

void ShmComm::check_identity(int r, const shm::Identity& id, bool readable, uint64_t actual_bytes,
                             const std::string& what) const {
  if (!readable || id.magic != shm::kMagic || id.version != shm::kLayoutVersion)
    throw RingError(cat("rank ", name_of(cfg_.rank), ": ", what, " of rank ", name_of(r),
                        " is not from a ringdp of this version (different ringdp builds?)"));
  if (id.rank != r || id.world != cfg_.world)
    throw RingError(cat("rank ", name_of(cfg_.rank), ": ", what, " of rank ", name_of(r), " says rank ", id.rank, " of world ",
                        id.world, ", expected rank ", r, " of world ", cfg_.world));
  if (id.segment_bytes != actual_bytes || id.fifo_slots != geo_.fifo_slots || id.slot_bytes != geo_.slot_bytes ||
      id.oneshot_bytes != geo_.oneshot_bytes || id.arena_bytes != geo_.arena_bytes)
    throw RingError(cat("rank ", name_of(cfg_.rank), ": rank ", name_of(r),
                        " uses a different shared-memory configuration (slots/slot bytes/"
                        "one-shot bytes/arena differ): set the same RINGDP_* variables on every rank"));
}

void ShmComm::connect(const std::vector<std::string>& blobs) {
  if (connected_) throw RingError(cat("rank ", name_of(cfg_.rank), ": connect() called twice"));
  if (static_cast<int>(blobs.size()) != cfg_.world)
    throw RingError(cat("rank ", name_of(cfg_.rank), ": expected ", cfg_.world, " shared-memory records, got ", blobs.size()));
  for (int r = 0; r < cfg_.world; ++r) {
    if (r == cfg_.rank) continue;
    // The record first: identity and configuration, before anything is opened.
    const std::string& blob = blobs[static_cast<size_t>(r)];
    shm::Blob b;
    std::memset(&b, 0, sizeof(b));
    if (blob.size() >= sizeof(b)) std::memcpy(&b, blob.data(), sizeof(b));
    check_identity(r, b.id, blob.size() >= sizeof(b) && blob.size() == sizeof(b) + b.name_len,
                   geo_.total_bytes(), "the shared-memory record");
    // Then the segment it names, which must say the same.
    shm::Segment s;
    try {
      s = shm::Segment::open(blob.substr(sizeof(b)), geo_.fixed_bytes());
    } catch (const RingError& e) {
      throw RingError(cat("rank ", name_of(cfg_.rank), ": cannot map the segment of rank ", name_of(r), ": ", e.what()));
    }
    const Control* c = reinterpret_cast<const Control*>(s.base());
    check_identity(r, c->id, s.size() >= shm::kControlBytes, s.size(), cat("segment ", s.name()));
    // Use the peer's pid for liveness checks only if it is visible from this process
    // (same pid namespace).
    pid_usable_[static_cast<size_t>(r)] = (::kill(c->id.pid, 0) == 0 || errno == EPERM);
    segs_[static_cast<size_t>(r)] = std::move(s);
  }
  shm::Neighbours nb;
  nb.rank = cfg_.rank;
  nb.world = cfg_.world;
  nb.prev = (cfg_.rank + cfg_.world - 1) % cfg_.world;
  nb.next = (cfg_.rank + 1) % cfg_.world;
  nb.mine = segs_[static_cast<size_t>(cfg_.rank)].base();
  nb.prev_base = segs_[static_cast<size_t>(nb.prev)].base();
  nb.next_base = segs_[static_cast<size_t>(nb.next)].base();
  link_.reset(new shm::Link(nb, geo_, wait_policy_, health_));
  connected_ = true;
}

void ShmComm::require_connected() const {
  if (!connected_)
    throw RingError(cat("rank ", name_of(cfg_.rank), ": the shared-memory transport is not connected"));
}

void ShmComm::unlink_own() { segs_[static_cast<size_t>(cfg_.rank)].unlink(); }

void ShmComm::check_health(int waiting_on, const char* what) {
  try {
    check_interrupt();  // (interrupt.h: Ctrl-C; what the program's handler raised ends the call)
  } catch (...) {
    abort(cat("rank ", name_of(cfg_.rank), ": ", kind_name(kind_), " #", call_,
              " was interrupted on this rank (Ctrl-C: SIGINT) while waiting for rank ",
              name_of(waiting_on), " (", what, ")"));
    throw;
  }
  if (abort_requested_.load(std::memory_order_acquire)) {
    std::string why;
    {
      std::lock_guard<std::mutex> lk(abort_mu_);
      why = requested_why_;
    }
    fail(cat("rank ", name_of(cfg_.rank), ": ", kind_name(kind_), " #", call_, " was aborted on this rank (", why,
             ") while waiting for rank ", name_of(waiting_on), " (", what, ")"));
  }
  for (int r = 0; r < cfg_.world; ++r) {
    if (r == cfg_.rank || !segs_[static_cast<size_t>(r)].base()) continue;
    const Control& c = ctrl(r);
    if (c.aborted.v.load(std::memory_order_acquire) != 0)
      fail(cat("rank ", name_of(cfg_.rank), ": ", kind_name(kind_), " #", call_, " failed because rank ", name_of(r),
               " aborted: ", read_msg(c.abort_msg), "\n", stall_report(waiting_on, what)));
    if (pid_usable_[static_cast<size_t>(r)] && pid_dead(c.id.pid))
      fail(cat("rank ", name_of(cfg_.rank), ": rank ", name_of(r), " (pid ", c.id.pid, ") died during ", kind_name(kind_), " #", call_,
               "\n",
               stall_report(waiting_on, what)));
  }
  const auto now = Clock::now();
  if (now >= deadline_)
    fail(cat("rank ", name_of(cfg_.rank), ": ", kind_name(kind_), " #", call_, " timed out after ", timeout_s_,
             " s waiting for rank ", name_of(waiting_on), " (", what,
             "); that rank is alive but did not make progress: is it running the same collectives "
             "in the same order? (set the timeout with RINGDP_TIMEOUT_S or timeout=)\n",
             stall_report(waiting_on, what)));
  if (!stall_reported_ && cfg_.stall_warn_s > 0 && seconds(now - call_start_) >= cfg_.stall_warn_s) {
    stall_reported_ = true;  // once per call
    if (on_stall_) on_stall_(stall_report(waiting_on, what));
  }
}

std::string ShmComm::stall_report(int waiting_on, const char* what) const {
  const uint32_t s = call_;
  std::string absent, lines;
  for (int r = 0; r < cfg_.world; ++r) {
    if (!segs_[static_cast<size_t>(r)].base()) continue;
    const Control& c = ctrl(r);
    const HeaderView h[2] = {view(c.hdr[0]), view(c.hdr[1])};
    const uint32_t q[2] = {h[0].seq, h[1].seq};
    const uint32_t latest = shm::reached(q[0], q[1]) ? q[0] : q[1];  // wrap-safe max
    const uint32_t done = c.done.v.load(std::memory_order_acquire);
    if (!shm::reached(latest, s)) absent += cat(absent.empty() ? "" : ", ", name_of(r));
    auto call = [&](uint32_t n) -> std::string {
      if (n == 0) return "none";
      for (int k = 0; k < 2; ++k)
        if (q[k] == n) return describe(h[k], name_of(h[k].root));
      return cat("#", n);
    };
    lines += cat("\n  rank ", name_of(r), r == cfg_.rank ? " (this rank)" : "", ": last finished ", call(done),
                 done == latest ? std::string("; in no collective") : cat("; in ", call(latest)));
  }
  return cat("ringdp stall report from rank ", name_of(cfg_.rank), ": ", kind_name(kind_), " #", s,
             " has waited ", seconds(Clock::now() - call_start_), " s, now for rank ", name_of(waiting_on), " (", what,
             "). ", absent.empty() ? std::string("Every rank has entered it.")
                                   : cat("Not entered by rank(s) ", absent, "."),
             lines);
}

void ShmComm::wait(const shm::Flag& flag, int owner, uint32_t target, const char* what) {
  shm::wait_reached(flag, ctrl(owner).sleepers, target, wait_policy_,
                    [&] { check_health(owner, what); });
}

void ShmComm::set_spin_ns(int64_t ns) {
  if (ns < 0) ns = 0;
  wait_policy_.spin_ns.store(ns, std::memory_order_relaxed);
  if (link_) link_->set_spin_ns(ns);
}

void ShmComm::abort(const std::string& why) {
  if (poison_.empty()) poison_ = why.empty() ? "aborted" : why;
  Control& me = ctrl(cfg_.rank);
  {
    std::lock_guard<std::mutex> lk(abort_mu_);  // (against request_abort's write of the message)
    copy_msg(me.abort_msg, first_line(poison_));  // peers add their own report
    me.aborted.v.store(1, std::memory_order_seq_cst);
  }
  wake_all_mine();
}

void ShmComm::wake_all_mine() {
  Control& me = ctrl(cfg_.rank);
  shm::wake_all(me.posted);
  shm::wake_all(me.consumed);
  shm::wake_all(me.hdr[0].seq);
  shm::wake_all(me.hdr[1].seq);
  shm::wake_all(me.wrote);
}

void ShmComm::request_abort(const std::string& why) {
  std::lock_guard<std::mutex> lk(abort_mu_);
  if (abort_requested_.load(std::memory_order_relaxed)) return;
  requested_why_ = why.empty() ? "abort requested" : why;
  abort_requested_.store(true, std::memory_order_release);
  if (!segs_[static_cast<size_t>(cfg_.rank)].base()) return;  // (not connected: no peer can wait on it)
  // Tell the peers now, whether or not a call of this rank is in flight (one that is also
  // fails, at its next health check, and writes its own message then).
  Control& me = ctrl(cfg_.rank);
  if (me.aborted.v.load(std::memory_order_acquire) == 0) {
    copy_msg(me.abort_msg, first_line(cat("rank ", name_of(cfg_.rank), ": ", requested_why_)));
    me.aborted.v.store(1, std::memory_order_seq_cst);
  }
  wake_all_mine();
}

void ShmComm::fail(const std::string& why) {
  abort(why);
  throw RingError(why);
}

std::string ShmComm::describe_header(int r, int parity) const {
  const HeaderView h = view(ctrl(r).hdr[parity]);
  return cat("rank ", name_of(r), ": ", describe(h, name_of(h.root)));
}

size_t ShmComm::begin_call(uint32_t s, double timeout_s, Kind kind, DType dtype, RedOp op, Algo algo,
                           size_t count, const std::string& tag) {
  call_ = s;
  kind_ = kind;
  timeout_s_ = timeout_s;
  call_start_ = Clock::now();
  stall_reported_ = false;
  // (a timeout past what the clock can add, infinity included, waits without a deadline: the
  // conversion of such a value would be undefined, in practice a deadline in the past)
  const double max_s = std::chrono::duration<double>(Clock::time_point::max() - call_start_).count() / 2;
  deadline_ = timeout_s >= max_s ? Clock::time_point::max()
                                 : call_start_ + std::chrono::duration_cast<Clock::duration>(
                                                     std::chrono::duration<double>(timeout_s));
  flight_slot_ = flight_.begin(s, kind, dtype, op, static_cast<int32_t>(algo), count, tag);
  return flight_slot_;
}

shm::CallHeader& ShmComm::write_header(uint32_t s, Kind kind, DType dtype, RedOp op, Algo algo, size_t count,
                                       const std::string& tag) {
  shm::CallHeader& h = ctrl(cfg_.rank).hdr[s & 1u];
  h.status = 0;
  h.kind = static_cast<int32_t>(kind);
  h.root = 0;
  h.dtype = static_cast<int32_t>(dtype);
  h.op = static_cast<int32_t>(op);
  h.algo = static_cast<int32_t>(algo);
  h.count = count;
  h.reg_offset = -1;
  h.slice_bytes = geo_.slot_bytes;
  h.outer = outer_;
  std::memset(h.tag, 0, sizeof(h.tag));
  std::memcpy(h.tag, tag.data(), tag.size());
  h.msg[0] = '\0';
  return h;
}

void ShmComm::end_call(uint32_t s, size_t slot, bool ok) {
  ctrl(cfg_.rank).done.v.store(s, std::memory_order_release);
  flight_.end(slot, s, ok ? CallRecord::kOk : CallRecord::kFailed);
}

void ShmComm::exchange_headers(uint32_t s) {
  const int par = static_cast<int>(s & 1u);
  publish(ctrl(cfg_.rank).hdr[par].seq, s);
  for (int r = 0; r < cfg_.world; ++r) {
    if (r == cfg_.rank) continue;
    wait(ctrl(r).hdr[par].seq, r, s, "the peer to enter this collective");
  }
}

void ShmComm::reject(const std::string& why, double timeout_s, const std::string& tag) {
  require_connected();
  if (!poison_.empty()) return;  // peers already know this communicator is dead
  const uint32_t s = ++seq_;
  const std::string t = tag.substr(0, kTagBytes - 1);
  const size_t slot = begin_call(s, timeout_s, Kind::kAllReduce, DType::kFloat32, RedOp::kSum, Algo::kRing, 0, t);
  shm::CallHeader& h = write_header(s, Kind::kAllReduce, DType::kFloat32, RedOp::kSum, Algo::kRing, 0, t);
  h.status = 1;
  copy_msg(h.msg, why);
  try {
    exchange_headers(s);
  } catch (...) {
    end_call(s, slot, false);
    throw;
  }
  end_call(s, slot, false);  // a rejected call failed, by definition
}

void ShmComm::all_reduce(void* data, size_t count, DType dtype, RedOp op, Algo algo, double timeout_s,
                         const std::string& tag) {
  Call c;
  c.kind = Kind::kAllReduce;
  c.dtype = dtype;
  c.op = op;
  c.algo = algo;
  c.count = count;
  c.data = static_cast<char*>(data);
  run(c, timeout_s, tag);
}

void ShmComm::reduce_scatter(const void* input, void* output, size_t count, DType dtype, RedOp op, Algo algo,
                             double timeout_s, const std::string& tag) {
  Call c;
  c.kind = Kind::kReduceScatter;
  c.dtype = dtype;
  c.op = op;
  c.algo = algo;
  c.count = count;
  c.in = static_cast<const char*>(input);
  c.data = static_cast<char*>(output);
  run(c, timeout_s, tag);
}

void ShmComm::all_gather(const void* input, void* output, size_t count, DType dtype, Algo algo, double timeout_s,
                         const std::string& tag) {
  Call c;
  c.kind = Kind::kAllGather;
  c.dtype = dtype;
  c.algo = algo;
  c.count = count;
  c.in = static_cast<const char*>(input);
  c.data = static_cast<char*>(output);
  run(c, timeout_s, tag);
}

void ShmComm::broadcast(void* data, size_t count, DType dtype, int root, Algo algo, double timeout_s,
                        const std::string& tag) {
  check_broadcast_root(cat("rank ", name_of(cfg_.rank)), root, cfg_.world);
  Call c;
  c.kind = Kind::kBroadcast;
  c.dtype = dtype;
  c.algo = algo;
  c.count = count;
  c.root = root;
  c.data = static_cast<char*>(data);
  run(c, timeout_s, tag);
}

void ShmComm::run(Call c, double timeout_s, const std::string& tag) {
  require_connected();
  if (poison_.empty() && abort_requested_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lk(abort_mu_);
    poison_ = cat("it was aborted on this rank: ", requested_why_);
  }
  if (!poison_.empty())
    throw RingError(cat("rank ", name_of(cfg_.rank), ": this ringdp communicator failed earlier (", first_line(poison_),
                        "); call ringdp.destroy() and initialise again"));
  if (tag.size() >= kTagBytes)
    throw RingError(cat("rank ", name_of(cfg_.rank), ": a collective's tag has at most ", kTagBytes - 1, " bytes, got ",
                        tag.size(), " ('", tag, "')"));
  const uint32_t s = ++seq_;
  const size_t slot = begin_call(s, timeout_s, c.kind, c.dtype, c.op, c.algo, c.count, tag);
  try {
    run_call(s, c, tag);
  } catch (...) {
    end_call(s, slot, false);
    throw;
  }
  end_call(s, slot, true);
}

void ShmComm::run_call(uint32_t s, const Call& c, const std::string& tag) {
  const int par = static_cast<int>(s & 1u);
  const int n = cfg_.world;
  const size_t esz = dtype_size(c.dtype);
  const size_t bytes = c.count * esz;  // all_reduce, broadcast: the tensor; others: one block
  // What the ring runs over (registered or not) and what one-shot stages in its buffer.
  const size_t ring_bytes = c.kind == Kind::kAllGather ? bytes * static_cast<size_t>(n) : bytes;
  const char* stage = c.kind == Kind::kReduceScatter || c.kind == Kind::kAllGather ? c.in : c.data;
  const size_t stage_bytes = c.kind == Kind::kReduceScatter ? bytes * static_cast<size_t>(n) : bytes;

  // 1. Announce what this rank is about to do (and, for one-shot, stage the data itself).
  shm::CallHeader& h = write_header(s, c.kind, c.dtype, c.op, c.algo, c.count, tag);
  h.root = c.root;
  // Registered: the tensor the peers would read in place (reduce_scatter: the input, read by
  // the direct path; the others: the data or output).
  h.reg_offset = c.kind == Kind::kReduceScatter ? arena_offset_of(c.in, stage_bytes) : arena_offset_of(c.data, ring_bytes);
  if (c.algo == Algo::kOneShot) {
    if (stage_bytes > geo_.oneshot_bytes) {
      const std::string why = cat("one-shot ", kind_name(c.kind), " of ", stage_bytes, " bytes exceeds its buffer of ",
                                  geo_.oneshot_bytes, " bytes (RINGDP_ONESHOT_MAX_BYTES too large?)");
      h.status = 1;
      copy_msg(h.msg, why);
      exchange_headers(s);
      throw RingError(cat("rank ", name_of(cfg_.rank), ": ", why));
    }
    if (c.kind != Kind::kBroadcast || c.root == cfg_.rank) std::memcpy(oneshot_buf(cfg_.rank, par), stage, stage_bytes);
  }
  // An all_gather starts from this rank's own block of its output, on every path: put the
  // input there now, so that it is in place before any peer passes the header exchange (the
  // direct path reads it then). The output is this rank's (no peer reads a tensor of mine once its call
  // returned), so this is safe even when the call then fails its checks (its output then
  // holds its own input in its block, as after a success).
  if (c.kind == Kind::kAllGather && bytes > 0) {
    char* mine = c.data + static_cast<size_t>(cfg_.rank) * bytes;
    if (mine != c.in) std::memmove(mine, c.in, bytes);
  }
  // Control::wrote trails this call by one until run_direct publishes s, whatever ran
  // before: a peer's direct wait for s sees s - 1 or s, never a value 2^31 calls old that
  // would compare as reached (the header's release publishes it).
  ctrl(cfg_.rank).wrote.v.store(s - 1, std::memory_order_relaxed);
  exchange_headers(s);

  // 2. Every rank checks every header, so a mismatch fails on all ranks alike, before any
  //    data moves (the communicator stays usable): rejections first, then the fingerprint
  //    (call number, kind, tag), then the shape.
  std::string problems;
  for (int r = 0; r < n; ++r) {
    const shm::CallHeader& p = ctrl(r).hdr[par];
    if (p.status != 0) problems += cat("; rank ", name_of(r), " rejected its input: ", read_msg(p.msg));
  }
  if (problems.empty()) {
    bool same_call = true, same_shape = true;
    for (int r = 0; r < n; ++r) {
      const shm::CallHeader& p = ctrl(r).hdr[par];
      same_call = same_call && p.seq.v.load(std::memory_order_acquire) == s && p.kind == h.kind &&
                  std::strncmp(p.tag, h.tag, kTagBytes) == 0;
      same_shape = same_shape && p.count == h.count && p.dtype == h.dtype && p.op == h.op && p.algo == h.algo &&
                   p.root == h.root && p.slice_bytes == h.slice_bytes && p.outer == h.outer;
    }
    if (!same_call)
      problems = "; ranks are at different collectives (a rank skipped or repeated a call, e.g. a step "
                 "whose backward raised on one rank only):";
    else if (!same_shape)
      problems = "; ranks disagree on the call:";
    if (!problems.empty())
      for (int r = 0; r < n; ++r) problems += cat(" [", describe_header(r, par), "]");
  }
  if (!problems.empty()) {
    // (a step of a collective across hosts names that collective first: the caller's call)
    const std::string what =
        outer_.kind < 0 ? cat(kind_name(c.kind), " #", s)
                        : cat(kind_name(static_cast<Kind>(outer_.kind)), " across hosts (its in-host step ",
                              kind_name(c.kind), " #", s, ")");
    throw RingError(cat("rank ", name_of(cfg_.rank), ": ", what, " cannot run", problems));
  }
  if (c.count == 0) return;

  // 3. A single rank has nothing to exchange: the output is its own input.
  if (n == 1) {
    if (c.kind == Kind::kReduceScatter) std::memmove(c.data, c.in, bytes);
    return;
  }
  try {
    if (c.algo == Algo::kOneShot) run_oneshot(par, c);
    else if (all_registered(par)) run_direct(s, par, c);
    else run_ring(c);
  } catch (const RingError&) {
    if (poison_.empty()) abort(cat("failed during ", kind_name(c.kind)));
    throw;
  }
}

void ShmComm::run_oneshot(int par, const Call& c) {
  // Every rank reads the peers' one-shot buffers (staged before the header exchange, so
  // they are complete); reductions run in rank order, so every rank computes the same bits.
  took(CallRecord::kOneShot);
  const int n = cfg_.world;
  const size_t esz = dtype_size(c.dtype);
  const size_t bytes = c.count * esz;
  const int avg_div = c.op == RedOp::kAvg ? n : 0;
  std::vector<const void*> srcs(static_cast<size_t>(n));
  switch (c.kind) {
    case Kind::kAllReduce:
      for (int r = 0; r < n; ++r) srcs[static_cast<size_t>(r)] = oneshot_buf(r, par);
      cpu::kernels_for(c.dtype, c.op).reduce_many(c.data, srcs.data(), n, c.count, avg_div);
      break;
    case Kind::kReduceScatter:  // block `rank` of every rank's input
      for (int r = 0; r < n; ++r)
        srcs[static_cast<size_t>(r)] = oneshot_buf(r, par) + static_cast<size_t>(cfg_.rank) * bytes;
      cpu::kernels_for(c.dtype, c.op).reduce_many(c.data, srcs.data(), n, c.count, avg_div);
      break;
    case Kind::kAllGather:  // block r of the output is rank r's input (mine is in place: run_call)
      for (int r = 0; r < n; ++r)
        if (r != cfg_.rank) std::memcpy(c.data + static_cast<size_t>(r) * bytes, oneshot_buf(r, par), bytes);
      break;
    case Kind::kBroadcast:
      if (cfg_.rank != c.root) std::memcpy(c.data, oneshot_buf(c.root, par), bytes);
      break;
  }
}

bool ShmComm::all_registered(int par) const {
  for (int r = 0; r < cfg_.world; ++r)
    if (ctrl(r).hdr[par].reg_offset < 0) return false;
  return true;
}

// The direct path, for tensors every rank has in its registered arena (ringdp.empty;
// reduce_scatter: the input; all_gather: the output): no FIFO, no staging copy, no chain of
// steps, and every collective's only path over registered memory. With chunk q = the q-th
// of n chunks of the tensor (all_reduce:
// ring::chunk_begin/chunk_end, 64-byte aligned; reduce_scatter, all_gather: block q), rank r
//   1. reduce (all_reduce, reduce_scatter): reduces chunk r of every rank's tensor, in rank
//      order 0..n-1 (in the accumulation type), reading the peers' tensors where they are,
//      into chunk r of its own tensor (reduce_scatter: into its output, which may be that
//      chunk of its input);
//   2. spread (all_reduce): writes the result into chunk r of every peer's tensor;
//      or gather (all_gather): copies chunk q of every peer q's output into its own (each
//      rank put its input there before the header exchange: run_call);
//      or copy (broadcast): copies the source's tensor into its own;
//   3. publishes Control::wrote = s and waits until every peer has published it too
//      (broadcast: the source alone waits; nobody reads the others' tensors).
// Steps 1 and 2 go block by block, so a block is read from every tensor before any tensor's
// copy of it is overwritten. Only rank r reads or writes chunk r of a peer's tensor (the
// gather reads chunk q of peer q's, which nobody writes in the call), and the header
// exchange before step 1 means every rank has entered call s (its tensor holds its input and
// is given to the collective); step 3 means no peer still reads or writes my tensor when I
// return. An all_reduce moves 2 x S bytes a rank (reads S, writes S) at any world size,
// against 5(n-1)/n x S for the in-place ring it replaced, and the ranks work at once rather
// than in a chain: on the 2-core box this is 1.5-2.2x faster than that ring at 256 KiB-64 MiB
// (bench/results/compare_direct_*). The in-place ring was slower than even the staged one
// there, because each rank overwrote lines its neighbour had just read: a store to a line
// another core holds costs ~4x a store to a private one (measured at 256 KiB). A
// reduce_scatter reads S and writes S/n a rank, where the staged ring also copies every
// partial through a FIFO; an all_gather reads and writes (n-1)/n x S, a broadcast S, as the
// in-place ring they ran before did, in two waits instead of one per slice and step.
// Results are bitwise identical on every rank: one rank computes each chunk, in rank order.
void ShmComm::run_direct(uint32_t s, int par, const Call& c) {
  took(CallRecord::kDirect);
  const int n = cfg_.world;
  const int me = cfg_.rank;
  const bool scatter = c.kind == Kind::kReduceScatter, gather = c.kind == Kind::kAllGather;
  const bool bcast = c.kind == Kind::kBroadcast;
  // What a failed check or wait names, by Kind: the peer's memory read, and what I wait for.
  static const char* const kWhat[][2] = {
      {"a peer's tensor (direct all_reduce)", "the peer to finish its chunk of my tensor (direct all_reduce)"},
      {"a peer's input (direct reduce_scatter)", "the peer to finish reading my input (direct reduce_scatter)"},
      {"a peer's output (direct all_gather)", "the peer to finish reading my output (direct all_gather)"},
      {"the source's tensor (direct broadcast)", "the peer to finish reading my tensor (direct broadcast)"}};
  const char* peer_what = kWhat[static_cast<int>(c.kind)][0];
  const char* wait_what = kWhat[static_cast<int>(c.kind)][1];
  const size_t esz = dtype_size(c.dtype);
  std::vector<char*> tensors(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r)
    tensors[static_cast<size_t>(r)] = segs_[static_cast<size_t>(r)].base() + geo_.arena_offset() +
                                      static_cast<size_t>(ctrl(r).hdr[par].reg_offset);
  char* mine = tensors[static_cast<size_t>(me)];
  // A peer that gave up (its wait failed) may be back in its caller's hands: stop reading or
  // writing its tensor within a block (check_health throws, naming it).
  auto check_peers = [&] {
    for (int r = 0; r < n; ++r)
      if (r != me && ctrl(r).aborted.v.load(std::memory_order_relaxed) != 0) check_health(r, peer_what);
  };
  // Copy bytes [from, to) of rank q's tensor into mine, block by block.
  auto copy_from = [&](size_t q, size_t from, size_t to) {
    for (size_t at = from; at < to; at += kDirectBlockBytes) {
      check_peers();
      std::memcpy(mine + at, tensors[q] + at, to - at < kDirectBlockBytes ? to - at : kDirectBlockBytes);
    }
  };
  const size_t bytes = c.count * esz;
  if (gather) {
    // 2. Gather: chunk q of peer q's output into mine, peers in ring order from my successor
    //    (the ranks do not all read one peer at once).
    for (int k = 1; k < n; ++k) {
      const size_t q = static_cast<size_t>((me + k) % n);
      copy_from(q, q * bytes, (q + 1) * bytes);
    }
  } else if (bcast) {
    // 2. Broadcast: the source's tensor into mine.
    if (me != c.root) copy_from(static_cast<size_t>(c.root), 0, bytes);
  } else {
    // Chunk r: elements [first, last) of every rank's tensor; reduce_scatter's is its block r.
    const size_t first = scatter ? static_cast<size_t>(me) * c.count : ring::chunk_begin(c.count, n, 64 / esz, me);
    const size_t last = scatter ? first + c.count : ring::chunk_end(c.count, n, 64 / esz, me);
    const cpu::Kernels& k = cpu::kernels_for(c.dtype, c.op);
    const int avg_div = c.op == RedOp::kAvg ? n : 0;
    const size_t block = kDirectBlockBytes / esz;
    // Where chunk r's result goes: in place (all_reduce), or the output (reduce_scatter),
    // whose element 0 is element `first` of the input.
    auto result = [&](size_t at) { return scatter ? c.data + (at - first * esz) : mine + at; };
    std::vector<const void*> srcs(static_cast<size_t>(n));
    for (size_t b = first; b < last; b += block) {
      check_peers();
      const size_t m = last - b < block ? last - b : block;
      const size_t at = b * esz;
      // 1. Reduce block b of chunk r from every rank's tensor ...
      for (int r = 0; r < n; ++r) srcs[static_cast<size_t>(r)] = tensors[static_cast<size_t>(r)] + at;
      k.reduce_many(result(at), srcs.data(), n, m, avg_div);
      // 2. ... and spread it into every peer's.
      if (!scatter)
        for (int r = 0; r < n; ++r)
          if (r != me) std::memcpy(tensors[static_cast<size_t>(r)] + at, mine + at, m * esz);
    }
  }
  // 3. Done with the peers' tensors; wait until they are done with mine (a broadcast: only
  //    the source's tensor is read by peers).
  publish(ctrl(me).wrote, s);
  if (!bcast || me == c.root)
    for (int r = 0; r < n; ++r)
      if (r != me) wait(ctrl(r).wrote, r, s, wait_what);
}

void ShmComm::run_ring(const Call& c) {
  // Staged through the FIFOs (tensors that every rank holds in registered memory run
  // direct instead: run_direct).
  const int n = cfg_.world;
  const size_t esz = dtype_size(c.dtype);
  const bool reduces = c.kind == Kind::kAllReduce || c.kind == Kind::kReduceScatter;
  took(CallRecord::kRingStaged);
  // Partial sums travel in the accumulation type; final values in the tensor's dtype. A
  // slice is a whole number of alignment units: a round's chunks are rounded up to them
  // (schedule.h chunk_stride), and a chunk must fit its slot (half types accumulate in 4
  // bytes against a 32-element unit: a slot of 64 mod 128 bytes would overflow by 64).
  const size_t align = 64 / esz;
  const size_t slice_elems = geo_.slot_bytes / (reduces ? acc_size(c.dtype) : esz) / align * align;
  const RingPlan plan{c.count, n, cfg_.rank, slice_elems, align};
  const RedOp op = reduces ? c.op : RedOp::kSum;  // (all_gather, broadcast: no arithmetic)
  // (an all_gather's own block is in place already: run_call)
  auto drive = [&](RingTransport& t) { ring_run(t, c.kind, plan, c.root); };
  if (c.kind == Kind::kReduceScatter) {
    // Reads the input, writes only block `rank` of the result, into the output.
    shm::StagedTransport t(*link_, const_cast<char*>(c.in), c.data, static_cast<size_t>(cfg_.rank) * c.count,
                           c.dtype, op);
    drive(t);
  } else {
    shm::StagedTransport t(*link_, c.data, c.dtype, op);
    drive(t);
  }
}

// ---- registered-memory arena ---------------------------------------------------------------

size_t ShmComm::arena_alloc(size_t bytes) {
  // (more than the arena: refused before rounding up, which would wrap near 2^64)
  const size_t need = bytes <= geo_.arena_bytes ? shm::align_up(bytes ? bytes : 1, kArenaAlign) : 0;
  std::lock_guard<std::mutex> g(arena_mu_);
  for (auto it = free_.begin(); need && it != free_.end(); ++it) {
    if (it->second < need) continue;
    const size_t off = it->first;
    const size_t left = it->second - need;
    free_.erase(it);
    if (left) free_[off + need] = left;
    try {
      segs_[static_cast<size_t>(cfg_.rank)].commit(geo_.arena_offset() + off, need);
    } catch (...) {
      free_[off] = need;  // (re-merged on the next free)
      throw;
    }
    used_[off] = need;
    return off;
  }
  throw RingError(cat("rank ", name_of(cfg_.rank), ": registered memory exhausted: ", bytes,
                      " bytes requested, arena of ", geo_.arena_bytes,
                      " bytes (raise RINGDP_ARENA_GB)"));
}

void ShmComm::arena_free(size_t offset) {
  std::lock_guard<std::mutex> g(arena_mu_);
  auto it = used_.find(offset);
  if (it == used_.end()) return;
  size_t off = it->first, len = it->second;
  used_.erase(it);
  segs_[static_cast<size_t>(cfg_.rank)].decommit(geo_.arena_offset() + off, len);
  auto nx = free_.lower_bound(off);
  if (nx != free_.end() && off + len == nx->first) {
    len += nx->second;
    free_.erase(nx);
  }
  auto pv = free_.lower_bound(off);
  if (pv != free_.begin()) {
    --pv;
    if (pv->first + pv->second == off) {
      off = pv->first;
      len += pv->second;
      free_.erase(pv);
    }
  }
  free_[off] = len;
}

size_t ShmComm::arena_in_use() const {
  std::lock_guard<std::mutex> g(arena_mu_);
  size_t n = 0;
  for (const auto& kv : used_) n += kv.second;
  return n;
}

int64_t ShmComm::arena_offset_of(const void* p, size_t bytes) const {
  const char* a = arena_base();
  const char* q = static_cast<const char*>(p);
  if (q < a || q + bytes > a + geo_.arena_bytes) return -1;
  return static_cast<int64_t>(q - a);
}

}  // namespace ringdp
