// CPU simulation of the CUDA IPC ring protocol: threads play the ranks, host arrays play
// device memory, std::atomic counters play the flags. It drives the real ring engine
// (csrc/ring/ring.cpp: all_reduce, reduce_scatter, all_gather, broadcast) and the real step
// planner (csrc/cuda/protocol.h), and emulates each step kernel channel by channel with the
// waits the kernel performs. Independently
// of the planner it checks every write against the readers that may still need the bytes:
//   * a slot is rewritten only after the successor consumed the slice it held;
//   * a range of a rank's registered tensor that the successor reads in place is rewritten
//     (by the ring or by the "user" between calls) only after the successor consumed it;
//   * a consumer finds the descriptor of exactly the slice it expects, before and after
//     reading (so no overwrite happened underneath it);
// and it checks the results against closed forms (all_reduce: bitwise identical on every
// rank; reduce_scatter: the input untouched too). A wait that exceeds a few seconds is
// reported as a deadlock. A broadcast whose ranks disagree on the root runs too: a consumer
// compares the descriptor's root with its own and stops, raising its abort flag, as the step
// kernel does; a rank waiting on an aborted peer stops as well. Every rank that believes it is
// the root must stop (the chain is closed: transport.h closes_chain), none may deadlock.
//
// Because every wait is on a monotonic counter, a schedule with *more* ordering than the GPU
// (here: channels one after another inside a step) can only deadlock more often: passing here
// means the wait graph of the GPU schedule is acyclic too.
//
// Build and run (tests/test_cuda.py does this when a C++ compiler is present):
//   g++ -std=c++17 -O1 -pthread -Icsrc csrc/cuda/sim/protocol_sim.cpp csrc/ring/ring.cpp -o /tmp/sim
//   /tmp/sim            # prints a summary, exits 1 on the first failure (naming its argv)
//   /tmp/sim world count slots channels slice halfish op regmask calls [coll root]   # one
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../../ring/ring.h"
#include "../protocol.h"
#include "../step_ring.h"

using namespace ringdp;
using namespace ringdp::cuda;

namespace {

std::atomic<bool> g_failed{false};
std::mutex g_print;

// Report and end the process. The lock is held to the end, so a thread that sees g_failed
// and waits for it (wait_geq) cannot end the process before the message is out.
[[noreturn]] void die(const std::string& m) {
  std::lock_guard<std::mutex> lk(g_print);
  g_failed = true;
  std::fprintf(stderr, "FAIL: %s\n", m.c_str());
  std::fflush(stderr);
  std::fflush(stdout);
  std::_Exit(1);
}

struct Meta {
  std::atomic<uint64_t> index{~0ull};  // production index of the slice described
  uint64_t call = 0;
  int root = 0;           // the producer's broadcast root (the kernel's SlotMeta compares it)
  bool in_place = false;  // a slice of the producer's registered tensor, read in place
  size_t offset = 0;      // element offset in the producer's tensor when in place
  size_t bytes = 0;
};

// One rank's "device memory".
struct RankMem {
  int channels = 1;
  size_t slots = 2, slot_bytes = 0;
  std::vector<unsigned char> slot;                 // slots x slot_bytes
  std::vector<unsigned char> tensor;               // the buffer the schedule indexes (reduce_scatter:
                                                   // the input; all_gather: the output)
  std::vector<unsigned char> result;               // reduce_scatter: the output (count elements)
  std::unique_ptr<std::atomic<uint64_t>[]> posted, consumed;
  std::unique_ptr<Meta[]> meta;                    // slots x channels
  std::atomic<int> abort{0};                       // the rank stopped (a mismatch, or a peer's abort)
  // Simulation bookkeeping (not part of the protocol): offset -> (production index of the
  // slice read in place there << 8) | 1, this call.
  std::mutex exp_mu;
  std::map<size_t, uint64_t> in_place;
  void init(int ch, size_t s, size_t sb) {
    channels = ch;
    slots = s;
    slot_bytes = sb;
    slot.assign(s * sb, 0xEE);
    posted.reset(new std::atomic<uint64_t>[ch]);
    consumed.reset(new std::atomic<uint64_t>[ch]);
    for (int c = 0; c < ch; ++c) posted[c] = consumed[c] = 0;
    meta.reset(new Meta[s * ch]);
  }
};

struct Config {
  int world;
  size_t count;
  int slots;
  int channels;
  size_t slice_elems;
  bool halfish;  // T = float, Acc = double (partials travel wider than T, like fp16/bf16)
  RedOp op;
  std::vector<bool> registered;  // per rank: the tensor is registered (read in place)
  int calls;
  unsigned seed;
  ringdp::Kind coll = ringdp::Kind::kAllReduce;
  int root = 0;  // broadcast
  std::vector<int> roots;  // non-empty: each rank's own idea of the root (a mismatch case)
  int root_of(int r) const { return roots.empty() ? root : roots[static_cast<size_t>(r)]; }
};

// How a rank's run ended in a mismatch case.
enum class Outcome { kDone, kMismatch, kPeerAborted };
struct Stop {
  Outcome why;
};
std::vector<Outcome> g_outcomes;

// One configuration of the sweeps in main(): `mode` bit 0 runs fp32 with fp64 partials,
// bit 1 a pattern of registered ranks; the slice size and op follow `seed`.
Config sweep_config(ringdp::Kind coll, int world, size_t count, int slots, int channels, int mode, unsigned seed,
                    int calls) {
  static const RedOp ops[] = {RedOp::kSum, RedOp::kMax, RedOp::kAvg, RedOp::kMin};
  Config c;
  c.coll = coll;
  c.world = world;
  c.count = count;
  c.slots = slots;
  c.channels = channels;
  c.slice_elems = (seed % 2) ? 16 : 40;
  c.halfish = mode & 1;
  c.op = ops[seed % 4];
  c.calls = calls;
  c.root = static_cast<int>(seed % static_cast<unsigned>(world));  // (broadcast)
  c.seed = seed;
  c.registered.resize(world);
  for (int r = 0; r < world; ++r) c.registered[r] = (mode & 2) ? ((r + seed + 1) % 3 != 0) : false;
  return c;
}

bool reduces(const Config& c) { return c.coll == ringdp::Kind::kAllReduce || c.coll == ringdp::Kind::kReduceScatter; }
// Elements of the buffer the schedule indexes.
size_t buffer_elems(const Config& c) {
  const bool blocks = c.coll == ringdp::Kind::kReduceScatter || c.coll == ringdp::Kind::kAllGather;
  return blocks ? c.count * static_cast<size_t>(c.world) : c.count;
}
constexpr double kGarbage = -7777.0;  // what a buffer holds where the collective must write

double load(const unsigned char* p, size_t eb) {
  if (eb == 8) {
    double v;
    std::memcpy(&v, p, 8);
    return v;
  }
  float f;
  std::memcpy(&f, p, 4);
  return f;
}
void store(unsigned char* p, size_t eb, double v) {
  if (eb == 8) {
    std::memcpy(p, &v, 8);
  } else {
    float f = static_cast<float>(v);
    std::memcpy(p, &f, 4);
  }
}
double apply(RedOp op, double a, double b) {
  switch (op) {
    case RedOp::kMin: return b < a ? b : a;
    case RedOp::kMax: return a < b ? b : a;
    default: return a + b;
  }
}

double input(int r, size_t i, int call) { return static_cast<double>((r + 1) * static_cast<int>(i % 7 + 1) + r + call); }

class SimRank;
std::vector<SimRank*> g_ranks;

class SimRank final {
 public:
  SimRank(const Config& cfg, int rank, RankMem* mem)
      : cfg_(cfg), rank_(rank), me_(mem), plan_(cfg.slots), rng_(cfg.seed * 131 + rank) {
    geo_.slot_bytes = mem->slot_bytes;
    geo_.channels = mem->channels;
  }

  void run() {
    const size_t T = cfg_.halfish ? 4 : 8;
    const size_t A = 8;
    const size_t n_buf = buffer_elems(cfg_);
    for (int call = 1; call <= cfg_.calls; ++call) {
      call_ = call;
      // The "user" writes new input: every in-place slice of the previous call must have
      // been consumed already (the drain guaranteed it).
      check_tensor_write(0, n_buf, "user input before call");
      switch (cfg_.coll) {
        case ringdp::Kind::kAllReduce:
        case ringdp::Kind::kReduceScatter:
          for (size_t i = 0; i < n_buf; ++i) store(&me_->tensor[i * T], T, input(rank_, i, call));
          for (size_t i = 0; i < me_->result.size() / T; ++i) store(&me_->result[i * T], T, kGarbage);
          break;
        case ringdp::Kind::kAllGather:  // garbage, then my input copied into my block (as the transport does)
          for (size_t i = 0; i < n_buf; ++i) store(&me_->tensor[i * T], T, kGarbage);
          for (size_t i = 0; i < cfg_.count; ++i)
            store(&me_->tensor[(static_cast<size_t>(rank_) * cfg_.count + i) * T], T, input(rank_, i, call));
          break;
        case ringdp::Kind::kBroadcast:
          for (size_t i = 0; i < n_buf; ++i)
            store(&me_->tensor[i * T], T, rank_ == cfg_.root_of(rank_) ? input(rank_, i, call) : kGarbage);
          break;
      }
      {
        std::lock_guard<std::mutex> lk(me_->exp_mu);
        me_->in_place.clear();
      }
      // reduce_scatter is never read in place (its partial sums would overwrite the input).
      const bool reg = cfg_.registered[rank_] && cfg_.coll != ringdp::Kind::kReduceScatter;
      plan_.begin_call(reg, T, A, reduces(cfg_) ? cfg_.op : RedOp::kSum, cfg_.world);
      RingPlan p;
      p.count = cfg_.count;
      p.world = cfg_.world;
      p.rank = rank_;
      p.slice_elems = geo_.slice_elems(reduces(cfg_) ? A : T);  // as the transport sizes it
      if (p.slice_elems == 0) die("slot geometry gives empty slices");
      p.align = kPackElems;
      result_base_ = static_cast<size_t>(rank_) * cfg_.count;
      ring_run(ring_, cfg_.coll, p, cfg_.root_of(rank_));
    }
  }

  // As IpcComm: the call check rides on the descriptors, so a broadcast closes its chain.
  static constexpr bool kClosesChain = true;

  // Driven by StepRing (csrc/cuda/step_ring.h), the forwarder the CUDA transports use.
  void finish_ring() {
    const uint64_t drain = plan_.end_call();
    RankMem* succ = mem(rank_ + 1);
    if (drain)
      for (int c = 0; c < me_->channels; ++c) wait_geq(succ->consumed[c], drain, "drain (succ consumed)", c, succ);
  }

 private:
  RankMem* mem(int r) const;

  // Wait for a peer's counter, as the kernel's wait_geq: stop when that peer aborted.
  void wait_geq(std::atomic<uint64_t>& a, uint64_t target, const char* what, int ch, const RankMem* peer) {
    const auto t0 = std::chrono::steady_clock::now();
    uint64_t v;
    while ((v = a.load(std::memory_order_acquire)) < target) {
      if (g_failed.load()) {
        std::lock_guard<std::mutex> lk(g_print);  // die() ends the process while holding it
        std::_Exit(1);
      }
      if (peer->abort.load(std::memory_order_acquire)) {
        me_->abort.store(1, std::memory_order_release);
        throw Stop{Outcome::kPeerAborted};
      }
      std::this_thread::yield();
      if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(5)) {
        die("rank " + std::to_string(rank_) + " deadlocked waiting " + what + " channel " + std::to_string(ch) +
            ": value " + std::to_string(v) + " < target " + std::to_string(target));
      }
    }
  }

  // Independent of the planner: may the "user" overwrite the tensor range [b, e) now?
  // Every channel part of every in-place slice that overlaps it must have been consumed.
  void check_tensor_write(size_t b, size_t e, const char* what) {
    if (b >= e) return;
    RankMem* succ = mem(rank_ + 1);
    std::lock_guard<std::mutex> lk(me_->exp_mu);
    for (auto& kv : me_->in_place) {
      const size_t off = kv.first;
      const uint64_t idx = kv.second >> 8;
      const size_t len = in_place_len_.at(off);
      for (int c = 0; c < me_->channels; ++c)
        if (channel_overlaps(off, len, c, b, e) && succ->consumed[c].load() < idx + 1)
          die("rank " + std::to_string(rank_) + ": " + what + " overwrites tensor elements read in place as slice " +
              std::to_string(idx) + " before the successor consumed it (channel " + std::to_string(c) + ")");
    }
  }
  bool channel_overlaps(size_t off, size_t len, int c, size_t b, size_t e) const {
    const size_t per = channel_span(len, me_->channels);
    const size_t cb = off + std::min(static_cast<size_t>(c) * per, len);
    const size_t ce = off + std::min(static_cast<size_t>(c) * per + per, len);
    return cb < ce && cb < e && b < ce;
  }

 public:
  void step(StepKind k, const Slice& s) {
    const StepPlan p = plan_.step(k, s);
    const int n = cfg_.world;
    RankMem* pred = mem(rank_ - 1 + n);
    RankMem* succ = mem(rank_ + 1);
    const size_t T = cfg_.halfish ? 4 : 8;
    const int C = me_->channels;
    const size_t per = channel_span(s.count, C);
    if (rng_() % 4 == 0) std::this_thread::sleep_for(std::chrono::microseconds(rng_() % 200));
    for (int ch = 0; ch < C; ++ch) {
      const size_t b = std::min(static_cast<size_t>(ch) * per, s.count);
      const size_t e = std::min(b + per, s.count);
      // --- waits, as in step_kernel
      const unsigned char* src = nullptr;
      Meta* m = nullptr;
      if (p.consumes) {
        wait_geq(pred->posted[ch], p.consume_target, "pred posted", ch, pred);
        m = &pred->meta[((p.consume_target - 1) % pred->slots) * C + ch];
        if (m->index.load(std::memory_order_acquire) != p.consume_target - 1 || m->call != static_cast<uint64_t>(call_))
          die("rank " + std::to_string(rank_) + ": descriptor of slice " + std::to_string(p.consume_target - 1) +
              " was overwritten or is stale (holds slice " + std::to_string(m->index.load()) + ")");
        if (m->root != my_root()) {  // the kernel's kErrMismatch: report, raise the abort flag
          me_->abort.store(1, std::memory_order_release);
          throw Stop{Outcome::kMismatch};
        }
        if (m->bytes != s.count * p.consume_elem_bytes) die("descriptor bytes mismatch");
        // Channel-local source, as step_kernel computes it: an in-place slice is contiguous,
        // a staged one has a fixed sub-buffer per channel.
        src = m->in_place ? &pred->tensor[(m->offset + b) * T]
                          : &pred->slot[((p.consume_target - 1) % pred->slots) * pred->slot_bytes + ch * geo_.sub_bytes()];
      }
      if (p.guard) wait_geq(succ->consumed[ch], p.guard, "succ consumed (guard)", ch, succ);
      // --- independent write checks
      if (p.writes_slot && p.produce_index + 1 > me_->slots &&
          succ->consumed[ch].load() < p.produce_index + 1 - me_->slots)
        die("rank " + std::to_string(rank_) + " rewrites slot of slice " + std::to_string(p.produce_index - me_->slots) +
            " before the successor consumed it");
      if (p.writes_out && e > b) {  // (an empty range writes nothing: the chain's closing slice)
        std::lock_guard<std::mutex> lk(me_->exp_mu);
        auto it = me_->in_place.find(s.offset);
        if (it != me_->in_place.end() && succ->consumed[ch].load() < (it->second >> 8) + 1)
          die("rank " + std::to_string(rank_) + " rewrites its tensor at " + std::to_string(s.offset) +
              " (read in place as slice " + std::to_string(it->second >> 8) + ") before the successor read it");
      }
      // --- the arithmetic, element by element (reads first, like the kernel's registers)
      std::vector<double> in(e - b), sv(e - b);
      for (size_t i = b; i < e; ++i) {
        if (p.reads_in) in[i - b] = load(&me_->tensor[(s.offset + i) * T], T);
        if (p.consumes) sv[i - b] = load(src + (i - b) * p.consume_elem_bytes, p.consume_elem_bytes);
      }
      if (p.consumes && m->index.load() != p.consume_target - 1)
        die("rank " + std::to_string(rank_) + ": slice " + std::to_string(p.consume_target - 1) +
            " was overwritten while being read");
      unsigned char* dst =
          p.writes_slot ? &me_->slot[(p.produce_index % me_->slots) * me_->slot_bytes + ch * geo_.sub_bytes()] : nullptr;
      if (dst && (e - b) * p.produce_elem_bytes > geo_.sub_bytes()) die("channel range exceeds its sub-buffer");
      for (size_t i = b; i < e; ++i) {
        double x = in[i - b], y = sv[i - b], o = 0, d = 0;
        switch (k) {
          case StepKind::kSend:
          case StepKind::kCopySend: d = x; break;
          case StepKind::kRecvReduceSend: d = o = apply(cfg_.op, y, x); break;
          case StepKind::kRecvReduceCopySend:
          case StepKind::kRecvReduceCopy: {
            double v = apply(cfg_.op, y, x);
            if (p.avg_div) v = v / p.avg_div;
            if (T == 4) v = static_cast<float>(v);  // round once, at the owner
            o = d = v;
            break;
          }
          default: o = d = y; break;
        }
        if (p.writes_out) store(&me_->tensor[(s.offset + i) * T], T, o);
        if (p.writes_result) {
          if (s.offset < result_base_ || s.offset + s.count > result_base_ + me_->result.size() / T)
            die("rank " + std::to_string(rank_) + ": recv_reduce_copy of elements " + std::to_string(s.offset) +
                ".. outside this rank's block of the result");
          store(&me_->result[(s.offset - result_base_ + i) * T], T, o);
        }
        if (dst) store(dst + (i - b) * p.produce_elem_bytes, p.produce_elem_bytes, d);
      }
      // --- descriptor and publication
      if (p.produces) {
        Meta& mm = me_->meta[(p.produce_index % me_->slots) * C + ch];
        mm.call = call_;
        mm.root = my_root();
        mm.in_place = p.in_place;
        mm.offset = s.offset;
        mm.bytes = s.count * p.produce_elem_bytes;
        mm.index.store(p.produce_index, std::memory_order_release);
      }
      if (p.consumes) me_->consumed[ch].store(p.consume_target, std::memory_order_release);
      if (p.produces) me_->posted[ch].store(p.produce_value, std::memory_order_release);
    }
    if (p.in_place) {  // bookkeeping for the checks of later writes (after all channels)
      std::lock_guard<std::mutex> lk(me_->exp_mu);
      me_->in_place[s.offset] = (p.produce_index << 8) | 1;
      in_place_len_[s.offset] = s.count;
    }
  }

 private:
  int my_root() const { return cfg_.coll == ringdp::Kind::kBroadcast ? cfg_.root_of(rank_) : 0; }

  const Config& cfg_;
  int rank_;
  RankMem* me_;
  Planner plan_;
  std::mt19937 rng_;
  int call_ = 0;
  size_t result_base_ = 0;  // reduce_scatter: the buffer element where the result starts
  std::map<size_t, size_t> in_place_len_;
  SlotGeometry geo_;
  StepRing<SimRank> ring_{this};
};

std::vector<RankMem*> g_mems;
RankMem* SimRank::mem(int r) const { return g_mems[r % cfg_.world]; }

// (kind_name lives in the CPU kernels, which the simulation does not link)
std::string coll_name(const Config& c) {
  switch (c.coll) {
    case ringdp::Kind::kAllReduce: return "all_reduce";
    case ringdp::Kind::kReduceScatter: return "reduce_scatter";
    case ringdp::Kind::kAllGather: return "all_gather";
    case ringdp::Kind::kBroadcast: return "broadcast";
  }
  return "?";
}

bool check_results(const Config& cfg) {
  const size_t T = cfg.halfish ? 4 : 8;
  const int n = cfg.world;
  const int call = cfg.calls;  // the last call's values
  auto fail = [&](int r, const char* what, size_t i, double got, double want) {
    std::fprintf(stderr, "FAIL: %s: wrong %s: rank %d element %zu: got %.17g want %.17g\n", coll_name(cfg).c_str(),
                 what, r, i, got, want);
    return false;
  };
  // The reduction of every rank's element i of the input, rounded once to T, as the owner does.
  auto reduced = [&](size_t i) {
    double acc = input(0, i, call);
    double mx = acc, mn = acc;
    for (int r = 1; r < n; ++r) {
      double v = input(r, i, call);
      acc += v;
      mx = std::max(mx, v);
      mn = std::min(mn, v);
    }
    double want = cfg.op == RedOp::kMax ? mx : cfg.op == RedOp::kMin ? mn : acc;
    if (cfg.op == RedOp::kAvg) want = acc / n;
    if (T == 4) want = static_cast<float>(want);
    return want;
  };
  switch (cfg.coll) {
    case ringdp::Kind::kAllReduce:
      // Closed form, identical bytes on every rank.
      for (size_t i = 0; i < cfg.count; ++i) {
        const double want = reduced(i);
        for (int r = 0; r < n; ++r) {
          const double got = load(&g_mems[r]->tensor[i * T], T);
          if (got != want) return fail(r, "result", i, got, want);
          if (std::memcmp(&g_mems[r]->tensor[i * T], &g_mems[0]->tensor[i * T], T) != 0) {
            std::fprintf(stderr, "FAIL: rank %d element %zu differs bitwise from rank 0\n", r, i);
            return false;
          }
        }
      }
      return true;
    case ringdp::Kind::kReduceScatter:
      // Rank r's output: the reduction of block r of every rank's input; the input untouched.
      for (int r = 0; r < n; ++r) {
        for (size_t i = 0; i < cfg.count; ++i) {
          const double want = reduced(static_cast<size_t>(r) * cfg.count + i);
          const double got = load(&g_mems[r]->result[i * T], T);
          if (got != want) return fail(r, "output", i, got, want);
        }
        for (size_t i = 0; i < cfg.count * static_cast<size_t>(n); ++i) {
          const double got = load(&g_mems[r]->tensor[i * T], T);
          if (got != input(r, i, call)) return fail(r, "input (modified)", i, got, input(r, i, call));
        }
      }
      return true;
    case ringdp::Kind::kAllGather:
      // Block q of every rank's output: rank q's input.
      for (int r = 0; r < n; ++r)
        for (int q = 0; q < n; ++q)
          for (size_t i = 0; i < cfg.count; ++i) {
            const size_t e = static_cast<size_t>(q) * cfg.count + i;
            const double got = load(&g_mems[r]->tensor[e * T], T);
            if (got != input(q, i, call)) return fail(r, "output", e, got, input(q, i, call));
          }
      return true;
    case ringdp::Kind::kBroadcast:
      for (int r = 0; r < n; ++r)
        for (size_t i = 0; i < cfg.count; ++i) {
          const double got = load(&g_mems[r]->tensor[i * T], T);
          if (got != input(cfg.root, i, call)) return fail(r, "tensor", i, got, input(cfg.root, i, call));
        }
      return true;
  }
  return false;
}

// A broadcast whose ranks disagree on the root: every rank that believes it is the root
// stops (none keeps its own values as if the call had run), and some rank names the mismatch.
bool check_mismatch(const Config& cfg) {
  bool named = false;
  for (int r = 0; r < cfg.world; ++r) {
    const Outcome o = g_outcomes[static_cast<size_t>(r)];
    named = named || o == Outcome::kMismatch;
    if (cfg.root_of(r) == r && o == Outcome::kDone) {
      std::fprintf(stderr, "FAIL: broadcast with disagreeing roots: rank %d (root in its own eyes) returned as if "
                   "the call had run\n", r);
      return false;
    }
  }
  if (!named) std::fprintf(stderr, "FAIL: broadcast with disagreeing roots: no rank reported the mismatch\n");
  return named;
}

bool run(const Config& cfg) {
  const size_t T = cfg.halfish ? 4 : 8;
  std::vector<std::unique_ptr<RankMem>> mems;
  g_mems.clear();
  for (int r = 0; r < cfg.world; ++r) {
    mems.emplace_back(new RankMem);
    // Slot bytes such that every channel's sub-buffer holds >= 8 Acc elements.
    const size_t per = (cfg.slice_elems / cfg.channels + 7) / 8 * 8;
    mems.back()->init(cfg.channels, cfg.slots, std::max<size_t>(per, 8) * 8 * cfg.channels);
    mems.back()->tensor.assign(std::max<size_t>(buffer_elems(cfg), 1) * T, 0);
    if (cfg.coll == ringdp::Kind::kReduceScatter) mems.back()->result.assign(cfg.count * T, 0);
    g_mems.push_back(mems.back().get());
  }
  std::vector<std::unique_ptr<SimRank>> ranks;
  for (int r = 0; r < cfg.world; ++r) ranks.emplace_back(new SimRank(cfg, r, g_mems[r]));
  std::vector<std::thread> th;
  g_outcomes.assign(static_cast<size_t>(cfg.world), Outcome::kDone);
  for (int r = 0; r < cfg.world; ++r)
    th.emplace_back([&, r] {
      try {
        ranks[r]->run();
      } catch (const Stop& s) {
        g_outcomes[static_cast<size_t>(r)] = s.why;
      }
    });
  for (auto& t : th) t.join();
  if (!cfg.roots.empty()) return check_mismatch(cfg);
  for (int r = 0; r < cfg.world; ++r)
    if (g_outcomes[static_cast<size_t>(r)] != Outcome::kDone) {
      std::fprintf(stderr, "FAIL: rank %d stopped in a matching call\n", r);
      return false;
    }
  return check_results(cfg);
}

// The channel arithmetic of the IPC transport (protocol.h choose_channels): every rank's
// blocks fit the SMs of its GPU, shared evenly by the ranks on it.
void check_channels() {
  struct Case {
    std::vector<int> sms, sharing;
    int requested;
    int want, share;
    bool clamped;
  };
  const Case cases[] = {
      {{132, 132}, {1, 1}, 0, 64, 132, false},          // two GPUs of their own: automatic, <= 64
      {{132, 132}, {2, 2}, 0, 64, 66, false},           // one H100 shared by 2
      {{108, 108}, {2, 2}, 100, 54, 54, true},          // explicit 100 > 54 SMs per rank (A100)
      {{132, 132}, {2, 2}, 8, 8, 66, false},            // explicit, fits
      {{108, 108, 108, 132}, {3, 3, 3, 1}, 40, 36, 36, true},  // the most shared GPU decides
      {{108, 108, 108, 132}, {3, 3, 3, 1}, 0, 36, 36, false},
      {{2, 2, 2}, {3, 3, 3}, 4, 1, 1, true},            // fewer SMs than ranks: at least 1
      {{132}, {1}, 200, 64, 132, true},                 // kMaxChannels
  };
  for (const Case& c : cases) {
    const int world = static_cast<int>(c.sms.size());
    const int share = smallest_sm_share(world, c.sms.data(), c.sharing.data());
    const ChannelChoice ch = choose_channels(c.requested, share);
    if (share != c.share || ch.channels != c.want || ch.clamped != c.clamped || ch.requested != c.requested)
      die("channel arithmetic: world " + std::to_string(world) + " requested " + std::to_string(c.requested) +
          ": got share " + std::to_string(share) + " channels " + std::to_string(ch.channels) + " clamped " +
          std::to_string(ch.clamped) + ", want share " + std::to_string(c.share) + " channels " +
          std::to_string(c.want) + " clamped " + std::to_string(c.clamped));
  }
  std::printf("protocol_sim: channel arithmetic ok (%zu cases)\n", sizeof(cases) / sizeof(cases[0]));
}

// A timeout in seconds as a device wait's limit (protocol.h timeout_ns): infinity and values
// past 64 bits of nanoseconds are no limit, never 0 (every wait timed out at once).
void check_timeouts() {
  const struct {
    double seconds;
    uint64_t want;
  } cases[] = {{300.0, 300000000000ull}, {0.5, 500000000ull}, {1e9, 1000000000000000000ull},
               {2e10, UINT64_MAX}, {1e300, UINT64_MAX}, {std::numeric_limits<double>::infinity(), UINT64_MAX}};
  for (const auto& c : cases)
    if (timeout_ns(c.seconds) != c.want)
      die("timeout_ns(" + std::to_string(c.seconds) + ") = " + std::to_string(timeout_ns(c.seconds)) + ", want " +
          std::to_string(c.want));
  std::printf("protocol_sim: timeouts ok (%zu cases)\n", sizeof(cases) / sizeof(cases[0]));
}

void print_config(const Config& c) {
  int mask = 0;
  for (int r = 0; r < c.world; ++r) mask |= c.registered[r] ? (1 << r) : 0;
  std::fprintf(stderr, "  config (argv): %d %zu %d %d %zu %d %d %d %d %d %d\n", c.world, c.count, c.slots, c.channels,
               c.slice_elems, c.halfish ? 1 : 0, static_cast<int>(c.op), mask, c.calls, static_cast<int>(c.coll),
               c.root);
  if (!c.roots.empty()) {
    std::fprintf(stderr, "  each rank's root (a disagreement case, not in argv):");
    for (int r : c.roots) std::fprintf(stderr, " %d", r);
    std::fprintf(stderr, "\n");
  }
}

}  // namespace

int main(int argc, char** argv) {
  // One configuration: world count slots channels slice halfish op registeredmask calls
  // [coll root] (coll: types.h ringdp::Kind, 0 all_reduce .. 3 broadcast).
  if (argc == 10 || argc == 12) {
    Config c;
    c.world = std::atoi(argv[1]);
    c.count = std::strtoull(argv[2], nullptr, 10);
    c.slots = std::atoi(argv[3]);
    c.channels = std::atoi(argv[4]);
    c.slice_elems = std::strtoull(argv[5], nullptr, 10);
    c.halfish = std::atoi(argv[6]) != 0;
    c.op = static_cast<RedOp>(std::atoi(argv[7]));
    const int mask = std::atoi(argv[8]);
    c.calls = std::atoi(argv[9]);
    if (argc == 12) {
      c.coll = static_cast<ringdp::Kind>(std::atoi(argv[10]));
      c.root = std::atoi(argv[11]);
    }
    c.seed = 7;
    for (int r = 0; r < c.world; ++r) c.registered.push_back((mask >> r) & 1);
    const bool ok = run(c);
    std::printf("%s\n", ok ? "ok" : "FAILED");
    return ok ? 0 : 1;
  }
  check_channels();
  check_timeouts();
  const bool quick = argc > 1 && std::string(argv[1]) == "--quick";
  int n_ok = 0;
  unsigned seed = 1;
  const size_t counts[] = {0, 1, 7, 8, 33, 100, 517, 2048, 4099};
  for (int world = 2; world <= 5; ++world) {
    for (size_t count : counts) {
      for (int slots : {2, 3, 5}) {
        for (int channels : {1, 3}) {
          for (int mode = 0; mode < 4; ++mode) {  // bit0: halfish, bit1: registered pattern
            if (quick && (slots == 3 || (count % 2 == 1 && count > 1))) continue;
            const Config c = sweep_config(ringdp::Kind::kAllReduce, world, count, slots, channels, mode, seed++, 3);
            if (!run(c)) {
              print_config(c);
              return 1;
            }
            ++n_ok;
          }
        }
      }
    }
  }
  std::printf("protocol_sim: %d all_reduce configurations passed (world 2-5, staged/registered/mixed, fp64 and "
              "fp32-with-fp64-partials)\n", n_ok);
  // The standalone halves and broadcast: per-rank counts 0, 1, primes and others not divisible
  // by the world size (each block has its own rounds), each collective twice in a row
  // (counters carry over), every root.
  int n_halves = 0;
  const size_t half_counts[] = {0, 1, 7, 13, 40, 101, 517};
  const ringdp::Kind colls[] = {ringdp::Kind::kReduceScatter, ringdp::Kind::kAllGather, ringdp::Kind::kBroadcast};
  for (ringdp::Kind coll : colls) {
    for (int world = 2; world <= 4; ++world) {
      for (size_t count : half_counts) {
        for (int slots : {2, 3}) {
          for (int channels : {1, 3}) {
            for (int mode = 0; mode < 4; ++mode) {  // bit0: halfish, bit1: registered pattern
              if (quick && slots == 3 && (mode & 1)) continue;
              const Config c = sweep_config(coll, world, count, slots, channels, mode, seed++, 2);
              if (!run(c)) {
                print_config(c);
                return 1;
              }
              ++n_halves;
            }
          }
        }
      }
    }
  }
  std::printf("protocol_sim: %d reduce_scatter/all_gather/broadcast configurations passed (world 2-4, every root)\n",
              n_halves);
  // Broadcasts whose ranks disagree on the root: one slice and several, staged and registered.
  int n_mismatch = 0;
  const std::vector<std::vector<int>> disagreements = {{0, 1}, {1, 0}, {0, 0, 1}, {2, 1, 2}, {0, 1, 2}, {1, 1, 1, 3}, {1, 1, 3, 3},
                                                      {0, 3, 0, 3}};
  for (const auto& roots : disagreements) {
    for (size_t count : {1, 100}) {
      for (int mode = 0; mode < 4; mode += 2) {
        Config c = sweep_config(ringdp::Kind::kBroadcast, static_cast<int>(roots.size()), count, 2, 2, mode, seed++, 1);
        c.roots = roots;
        if (!run(c)) {
          print_config(c);
          return 1;
        }
        ++n_mismatch;
      }
    }
  }
  std::printf("protocol_sim: %d broadcasts with disagreeing roots stopped every would-be root\n", n_mismatch);
  std::printf("protocol_sim: %d configurations passed\n", n_ok + n_halves + n_mismatch);
  return 0;
}
