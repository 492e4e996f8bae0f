// One rank's connections to its ring neighbours over shared memory: what the shm
// transports (shm_transports.h) need, and nothing of the communicator around them.
//
//        prev  --(prev's FIFO, prev.posted / my consumed)-->  me  --(my FIFO)-->  next
//
// A Link holds the control blocks of prev, me and next, the FIFOs of prev and me, prev's
// registered-memory arena, and this rank's local copies of its `posted` and `consumed`
// counters. Those counters are monotonic over the communicator's life (the Link lives as
// long as the ShmComm that made it), so both ends of a connection always agree on which
// slot the k-th slice uses. Every wait goes through a Watch owned by the communicator: it
// enforces the deadline and notices peers that aborted or died.
#pragma once
#include <cstddef>
#include <cstdint>

#include "layout.h"
#include "wait.h"

namespace ringdp {
namespace shm {

// Called by a waiter every few milliseconds while it sleeps; throws RingError when the
// wait must end (deadline passed, a peer aborted, a peer died). `peer` is the rank waited
// on, `what` says what for.
class Watch {
 public:
  virtual void check(int peer, const char* what) = 0;

 protected:
  ~Watch() = default;
};

// Where a rank's neighbours are, as mapped by its communicator.
struct Neighbours {
  int rank = 0, world = 1;
  int prev = 0, next = 0;
  char* mine = nullptr;  // segment bases (prev == next == mine at world 1)
  char* prev_base = nullptr;
  char* next_base = nullptr;
};

class Link {
 public:
  Link(const Neighbours& n, const Geometry& geo, const WaitPolicy& policy, Watch& watch);
  Link(const Link&) = delete;
  Link& operator=(const Link&) = delete;

  int rank() const { return rank_; }
  int world() const { return world_; }
  // How long a wait spins before sleeping (ShmComm::set_spin_ns).
  void set_spin_ns(int64_t ns) { policy_.spin_ns.store(ns, std::memory_order_relaxed); }
  int prev() const { return prev_; }
  int next() const { return next_; }

  // --- my connection to next -----------------------------------------------------------
  // Wait until my next FIFO slot is free (the successor consumed the slice that used it
  // `slots` slices ago) and return it.
  char* out_slot();
  // Publish one more slice to the successor (in my next slot).
  void post();

  // --- my connection from prev -----------------------------------------------------------
  // Wait until the predecessor posted my next slice.
  void wait_in();
  // wait_in(), then the predecessor's FIFO slot that holds the slice.
  const char* in_slot();
  // Release the slice taken from the predecessor (its slot may be reused).
  void consume();

 private:
  void wait(const Flag& flag, Control& owner, int owner_rank, uint32_t target, const char* what);

  int rank_, world_, prev_, next_;
  Control* me_;
  Control* prev_ctrl_;
  Control* next_ctrl_;
  char* my_fifo_;
  const char* prev_fifo_;
  size_t slots_, slot_bytes_;
  WaitPolicy policy_;
  SpinLearner learner_;  // every wait of a Link is inside a call (wait.h)
  Watch& watch_;
  uint32_t posted_ = 0;    // local copies of me_->posted / me_->consumed
  uint32_t consumed_ = 0;
};

}  // namespace shm
}  // namespace ringdp
