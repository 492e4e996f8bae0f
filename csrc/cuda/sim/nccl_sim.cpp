// CPU simulation of the NCCL transport's steps: threads play the ranks, host arrays play
// device memory, and NCCL's point-to-point is emulated as a rendezvous (a group's send
// completes only once the successor's matching receive took it; sends and receives between
// two ranks match in order, as NCCL's do). It drives the real ring engine
// (csrc/ring/ring.cpp: all_reduce, reduce_scatter, all_gather, broadcast from every root)
// through the real step logic (csrc/cuda/nccl_steps.h: what NcclComm enqueues per primitive)
// and emulates ringdp's step kernels (reduce_kernels.cuh) element by element, with partial
// sums wider than the values (int16 values, int32 partials: the half-type case) or not.
// It checks:
//   * every group's send meets a receive of exactly its size, and nothing is left unmatched
//     at the end of a collective (NCCL would hang or fail on either);
//   * no deadlock: a wait longer than a few seconds is reported;
//   * a staging slice never exceeds its buffer, and a kernel touches only its buffers;
//   * the results against a reference computed rank by rank: all_reduce (SUM, MIN, MAX,
//     AVG) identical on every rank; reduce_scatter's block and its input left untouched;
//     all_gather's blocks; broadcast's copy of the root's values;
// each collective twice in a row on the same ranks.
// A rendezvous has more ordering than NCCL (a small send may complete before its receive is
// posted), so passing here means the real pairing cannot deadlock either.
//
// Build and run (tests/test_cuda.py does this when a C++ compiler is present):
//   g++ -std=c++17 -O1 -pthread -Icsrc csrc/cuda/sim/nccl_sim.cpp csrc/ring/ring.cpp -o /tmp/nccl_sim
//   /tmp/nccl_sim        # prints a summary, exits 1 on the first failure (naming its config)
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cuda/nccl_steps.h"
#include "cuda/step_ring.h"

using namespace ringdp;
using namespace ringdp::cuda;
using ringdp::cuda::nccl::StepCall;
using ringdp::cuda::nccl::Steps;

namespace {

constexpr double kDeadlockS = 5.0;

struct Config {
  Kind coll = Kind::kAllReduce;
  int world = 2;
  size_t count = 0;  // all_reduce, broadcast: elements; the halves: per rank
  size_t slot_bytes = 256;
  size_t esize = 4;  // 4: int32 values; 2: int16 values (partials int32 either way)
  RedOp op = RedOp::kSum;
  int root = 0;
  std::string name() const {
    static const char* colls[] = {"all_reduce", "reduce_scatter", "all_gather", "broadcast"};
    static const char* ops[] = {"sum", "avg", "min", "max"};  // RedOp codes
    char b[200];
    std::snprintf(b, sizeof(b), "%s world %d count %zu slot %zu esize %zu op %s root %d", colls[int(coll)], world,
                  count, slot_bytes, esize, ops[int(op) < 4 ? int(op) : 0], root);
    return b;
  }
};

std::string g_failure;
std::mutex g_fail_mu;
std::atomic<bool> g_failed{false};

struct Failed {};  // unwinds a rank's thread after fail()

[[noreturn]] void fail(const std::string& why) {
  {
    std::lock_guard<std::mutex> lk(g_fail_mu);
    if (g_failure.empty()) g_failure = why;
  }
  g_failed = true;
  throw Failed{};
}

// ---- NCCL point-to-point as a rendezvous -------------------------------------------------
struct Msg {
  const char* data;
  size_t bytes;
  bool taken = false;
};
struct Channel {  // the messages from one rank to another, in order
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Msg*> q;
};

template <class Pred>
void wait_on(Channel& ch, std::unique_lock<std::mutex>& lk, Pred pred, const std::string& what) {
  const auto t0 = std::chrono::steady_clock::now();
  while (!pred()) {
    if (g_failed) throw Failed{};  // another rank failed: stop waiting for it
    ch.cv.wait_for(lk, std::chrono::milliseconds(20));
    if (!pred() && std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > kDeadlockS) {
      lk.unlock();
      fail("deadlock: " + what);
    }
  }
}

// Values that depend on rank and index, small enough for int16 sums over 8 ranks.
int32_t value(int r, size_t i, int n) { return static_cast<int32_t>(i % 13) + 2 * static_cast<int32_t>((r + i) % n); }

int32_t apply(RedOp op, int32_t a, int32_t b) {
  switch (op) {
    case RedOp::kMin: return a < b ? a : b;
    case RedOp::kMax: return a > b ? a : b;
    default: return a + b;  // SUM, and AVG's partial sums
  }
}

struct Buffer {
  std::vector<char> bytes;
  const char* name;
  bool holds(const void* p, size_t n) const {
    const char* c = static_cast<const char*>(p);
    return c >= bytes.data() && c + n <= bytes.data() + bytes.size();
  }
};

class Rank {
 public:
  static constexpr bool kClosesChain = false;  // as NcclComm

  Rank(const Config& cfg, int rank, std::vector<std::vector<Channel>>& ch)
      : cfg_(cfg), rank_(rank), ch_(ch), ring_(this) {
    const size_t elems = (cfg.coll == Kind::kAllReduce || cfg.coll == Kind::kBroadcast)
                             ? cfg.count
                             : cfg.count * static_cast<size_t>(cfg.world);
    data_ = {std::vector<char>(elems * cfg.esize), "data"};
    result_ = {std::vector<char>(cfg.count * cfg.esize), "result"};
    sbuf_ = {std::vector<char>(cfg.slot_bytes), "sbuf"};
    rbuf_ = {std::vector<char>(cfg.slot_bytes), "rbuf"};
  }

  // ---- the operations nccl_steps.h calls (NcclComm: NCCL and the step kernel) ----------
  void group(const void* sptr, size_t sbytes, void* rptr, size_t rbytes) {
    if (sbytes == 0 && rbytes == 0) return;
    const int n = cfg_.world, succ = (rank_ + 1) % n, pred = (rank_ - 1 + n) % n;
    if (sbytes && !(data_.holds(sptr, sbytes) || sbuf_.holds(sptr, sbytes)))
      fail("rank " + std::to_string(rank_) + " sends " + std::to_string(sbytes) + " B from outside its buffers");
    if (rbytes && !(data_.holds(rptr, rbytes) || rbuf_.holds(rptr, rbytes)))
      fail("rank " + std::to_string(rank_) + " receives " + std::to_string(rbytes) + " B outside its buffers");
    Msg m{static_cast<const char*>(sptr), sbytes};
    if (sbytes) {
      Channel& out = ch_[rank_][succ];
      std::lock_guard<std::mutex> lk(out.mu);
      out.q.push_back(&m);
      out.cv.notify_all();
    }
    if (rbytes) {
      Channel& in = ch_[pred][rank_];
      std::unique_lock<std::mutex> lk(in.mu);
      wait_on(in, lk, [&] { return !in.q.empty(); },
              "rank " + std::to_string(rank_) + " waits for " + std::to_string(rbytes) + " B from rank " +
                  std::to_string(pred) + " (group " + std::to_string(groups_) + ")");
      Msg* got = in.q.front();
      in.q.pop_front();
      if (got->bytes != rbytes)
        fail("rank " + std::to_string(pred) + " sent " + std::to_string(got->bytes) + " B where rank " +
             std::to_string(rank_) + " receives " + std::to_string(rbytes) + " B (group " + std::to_string(groups_) +
             ")");
      std::memcpy(rptr, got->data, rbytes);
      got->taken = true;
      in.cv.notify_all();
    }
    if (sbytes) {
      Channel& out = ch_[rank_][succ];
      std::unique_lock<std::mutex> lk(out.mu);
      wait_on(out, lk, [&] { return m.taken; },
              "rank " + std::to_string(rank_) + "'s send of " + std::to_string(sbytes) + " B to rank " +
                  std::to_string(succ) + " is never received (group " + std::to_string(groups_) + ")");
    }
    ++groups_;
  }

  void launch(StepKind k, const void* in, void* out, const void* src, void* dst, size_t count, int avg_div) {
    const size_t e = cfg_.esize, a = 4;
    auto inside = [&](const void* p, size_t bytes, const char* what) {
      if (p == nullptr) return;
      if (!(data_.holds(p, bytes) || result_.holds(p, bytes) || sbuf_.holds(p, bytes) || rbuf_.holds(p, bytes)))
        fail("rank " + std::to_string(rank_) + ": a step kernel's " + what + " (" + std::to_string(bytes) +
             " B) is outside its buffers");
    };
    const bool wide_src = k == StepKind::kRecvReduceSend || k == StepKind::kRecvReduceCopySend ||
                          k == StepKind::kRecvReduceCopy;
    const bool wide_dst = k == StepKind::kSend || k == StepKind::kRecvReduceSend;
    inside(in, count * e, "input");
    inside(out, count * e, "output");
    inside(src, count * (wide_src ? a : e), "source");
    inside(dst, count * (wide_dst ? a : e), "destination");
    for (size_t i = 0; i < count; ++i) {
      const int32_t x = in ? load(in, i) : 0;
      switch (k) {
        case StepKind::kSend: store_acc(dst, i, x); break;
        case StepKind::kRecvReduceSend: {
          const int32_t v = apply(cfg_.op, load_acc(src, i), x);
          store_acc(dst, i, v);
          if (out) store(out, i, v);
          break;
        }
        case StepKind::kRecvReduceCopySend:
        case StepKind::kRecvReduceCopy: {
          int32_t v = apply(cfg_.op, load_acc(src, i), x);
          if (avg_div > 0) v /= avg_div;
          if (out) store(out, i, v);
          if (dst) store(dst, i, v);
          break;
        }
        default:
          fail("rank " + std::to_string(rank_) + ": the NCCL steps launched step kind " + std::to_string(int(k)) +
               ", which they receive in place");
      }
    }
  }

  // ---- what StepRing forwards ------------------------------------------------------------
  void step(StepKind k, const Slice& s) { steps_.step(*this, call_, k, s); }
  void finish_ring() { steps_.finish(*this); }

  // One collective, as NcclComm runs it (enter, then run_ring).
  void run() {
    const Config& c = cfg_;
    const int n = c.world;
    fill();
    call_ = StepCall();  // enter()
    call_.data = data_.bytes.data();
    call_.esize = c.esize;
    call_.acc = 4;
    call_.op = c.op;
    call_.world = n;
    call_.sbuf = sbuf_.bytes.data();
    call_.rbuf = rbuf_.bytes.data();
    if (c.coll == Kind::kReduceScatter) {
      call_.result = result_.bytes.data();
      call_.result_base = static_cast<size_t>(rank_) * c.count;
    }
    steps_.reset();  // enter(): nothing pending
    if (c.coll == Kind::kAllGather) {  // my block first (NcclComm: copy_block)
      for (size_t j = 0; j < c.count; ++j)
        store(data_.bytes.data(), rank_ * c.count + j, value(rank_, rank_ * c.count + j, n));
    }
    if (c.count == 0) return;  // (NcclComm returns before enter())
    if (n == 1) {  // NcclComm: all_reduce and broadcast return; the halves copy, then finish
      if (c.coll == Kind::kReduceScatter) std::memcpy(result_.bytes.data(), data_.bytes.data(), c.count * c.esize);
      if (c.coll == Kind::kReduceScatter || c.coll == Kind::kAllGather) finish_ring();
      return;
    }
    ring_run(ring_, c.coll, nccl::step_plan(c.coll, c.count, n, rank_, c.slot_bytes, c.esize, 4), c.root);
  }

  void verify() const {
    const Config& c = cfg_;
    const int n = c.world;
    auto expect = [&](size_t g) {  // the reduction over ranks of element g
      int32_t v = value(0, g, n);
      for (int q = 1; q < n; ++q) v = apply(c.op, v, value(q, g, n));
      if (c.op == RedOp::kAvg) v /= n;
      return v;
    };
    auto check = [&](const Buffer& b, size_t i, int32_t want, const char* what) {
      const int32_t got = load(b.bytes.data(), i);
      if (got != want)
        fail("rank " + std::to_string(rank_) + ": " + what + "[" + std::to_string(i) + "] = " + std::to_string(got) +
             ", expected " + std::to_string(want));
    };
    switch (c.coll) {
      case Kind::kAllReduce:
        for (size_t i = 0; i < c.count; ++i) check(data_, i, expect(i), "all_reduce");
        break;
      case Kind::kReduceScatter:
        for (size_t j = 0; j < c.count; ++j) check(result_, j, expect(rank_ * c.count + j), "reduce_scatter output");
        for (size_t g = 0; g < c.count * n; ++g) check(data_, g, value(rank_, g, n), "reduce_scatter input");
        break;
      case Kind::kAllGather:
        for (size_t g = 0; g < c.count * n; ++g) check(data_, g, value(static_cast<int>(g / c.count), g, n), "all_gather");
        break;
      case Kind::kBroadcast:
        for (size_t i = 0; i < c.count; ++i) check(data_, i, value(c.root, i, n), "broadcast");
        break;
    }
  }

 private:
  void fill() {
    const Config& c = cfg_;
    const int n = c.world;
    const size_t elems = data_.bytes.size() / c.esize;
    for (size_t g = 0; g < elems; ++g) {
      int32_t v = value(rank_, g, n);
      if (c.coll == Kind::kAllGather) v = -7;                         // filled by the ring
      if (c.coll == Kind::kBroadcast && rank_ != c.root) v = -7;      // idem
      store(data_.bytes.data(), g, v);
    }
    std::memset(result_.bytes.data(), 0xA5, result_.bytes.size());
    std::memset(sbuf_.bytes.data(), 0x5A, sbuf_.bytes.size());
    std::memset(rbuf_.bytes.data(), 0x5A, rbuf_.bytes.size());
  }
  int32_t load(const void* p, size_t i) const {
    if (cfg_.esize == 2) return static_cast<const int16_t*>(p)[i];
    return static_cast<const int32_t*>(p)[i];
  }
  void store(void* p, size_t i, int32_t v) const {
    if (cfg_.esize == 2)
      static_cast<int16_t*>(p)[i] = static_cast<int16_t>(v);
    else
      static_cast<int32_t*>(p)[i] = v;
  }
  static int32_t load_acc(const void* p, size_t i) { return static_cast<const int32_t*>(p)[i]; }
  static void store_acc(void* p, size_t i, int32_t v) { static_cast<int32_t*>(p)[i] = v; }

  const Config& cfg_;
  int rank_;
  std::vector<std::vector<Channel>>& ch_;
  StepRing<Rank> ring_;
  StepCall call_;  // the collective in flight
  Steps<Rank> steps_;
  Buffer data_, result_, sbuf_, rbuf_;
  size_t groups_ = 0;
};

// One configuration, twice in a row on the same ranks; false (g_failure says why) on a failure.
bool run_config(const Config& c) {
  std::vector<std::vector<Channel>> ch(c.world);
  for (auto& row : ch) row = std::vector<Channel>(c.world);
  std::vector<std::unique_ptr<Rank>> ranks;
  for (int r = 0; r < c.world; ++r) ranks.push_back(std::make_unique<Rank>(c, r, ch));
  for (int call = 0; call < 2 && !g_failed; ++call) {
    std::vector<std::thread> threads;
    for (int r = 0; r < c.world; ++r)
      threads.emplace_back([&, r] {
        try {
          ranks[r]->run();
        } catch (const Failed&) {
        } catch (const std::exception& e) {
          try {
            fail(std::string("rank ") + std::to_string(r) + " threw: " + e.what());
          } catch (const Failed&) {
          }
        }
      });
    for (auto& t : threads) t.join();
    if (g_failed) break;
    for (int p = 0; p < c.world; ++p)
      for (int q = 0; q < c.world; ++q)
        if (!ch[p][q].q.empty()) {
          g_failure = "rank " + std::to_string(p) + " sent a message that rank " + std::to_string(q) + " never received";
          g_failed = true;
        }
    if (g_failed) break;
    try {
      for (auto& r : ranks) r->verify();
    } catch (const Failed&) {
    }
  }
  if (g_failed) {
    std::printf("FAIL %s: %s\n", c.name().c_str(), g_failure.c_str());
    return false;
  }
  return true;
}

}  // namespace

int main() {
  const size_t counts[] = {0, 1, 7, 8, 9, 13, 64, 100, 257, 1031};
  const size_t slots[] = {32, 256, 4096};  // 8, 64 and 1024 partial sums a slice
  const RedOp ops[] = {RedOp::kSum, RedOp::kMin, RedOp::kMax, RedOp::kAvg};
  int passed = 0;
  for (int world = 1; world <= 6; ++world)
    for (size_t count : counts)
      for (size_t slot : slots)
        for (size_t esize : {size_t(4), size_t(2)}) {
          std::vector<Config> cs;
          for (RedOp op : ops)
            for (Kind k : {Kind::kAllReduce, Kind::kReduceScatter}) cs.push_back({k, world, count, slot, esize, op, 0});
          cs.push_back({Kind::kAllGather, world, count, slot, esize, RedOp::kSum, 0});
          for (int root = 0; root < world; ++root)
            cs.push_back({Kind::kBroadcast, world, count, slot, esize, RedOp::kSum, root});
          for (const Config& c : cs) {
            if (!run_config(c)) return 1;
            ++passed;
          }
        }
  std::printf("nccl_sim: %d configurations passed (each collective twice)\n", passed);
  return 0;
}
