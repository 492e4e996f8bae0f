// The transport interface the ring engine is written against.
//
// A transport moves one *slice* (a contiguous range of elements of the caller's buffer)
// to the next rank of the ring and receives the matching slice from the previous rank.
// The engine (csrc/ring/ring.cpp) decides which slice goes where at every step; a
// transport decides only how bytes travel and where the arithmetic runs:
//
//   shm staged      CPU, ordinary tensors: sender writes into a FIFO of slots in its own
//                   POSIX shared-memory segment, receiver reads from it. (Tensors from
//                   ringdp.empty() that every rank holds take no ring: the direct path
//                   reads and writes them where they lie, shm_comm.cpp run_direct.)
//   cuda ipc / nccl GPU transports (csrc/cuda/), the same primitives, enqueued on a stream
//                   (csrc/cuda/step_ring.h: one step kind per primitive).
//
// Each primitive names what the *calling* rank does with its slice `s` of the buffer:
//
//   send                  make my data[s] (input values) available to next
//   recv_reduce_send      x = data[s] (op) incoming;        make x available to next
//   recv_reduce_copy_send x = data[s] (op) incoming; data[s] = x (final, AVG applied);
//                                                            make x available to next
//   recv_copy_send        data[s] = incoming;               make it available to next
//   recv                  data[s] = incoming
//   copy_send             make my data[s] (final values, the tensor's dtype) available to
//                         next: the start of a standalone all-gather or broadcast
//   recv_reduce_copy      x = data[s] (op) incoming; result[s] = x (final, AVG applied):
//                         the end of a standalone reduce-scatter (nothing sent)
//
// Both ends of a connection agree on the sequence of slices (the schedule is a pure
// function of count, world size and rank), so the k-th slice a rank sends is the k-th
// slice its successor receives and has the same length. Transports keep their own
// counters of slices sent and received, monotonic across calls.
#pragma once
#include <cstddef>
#include <stdexcept>

namespace ringdp {

struct Slice {
  size_t offset;  // first element, relative to the start of the caller's buffer
  size_t count;   // number of elements (may be 0: empty slices are still exchanged)
};

class RingTransport {
 public:
  virtual ~RingTransport() = default;
  virtual void send(const Slice& s) = 0;
  virtual void recv_reduce_send(const Slice& s) = 0;
  virtual void recv_reduce_copy_send(const Slice& s) = 0;
  virtual void recv_copy_send(const Slice& s) = 0;
  virtual void recv(const Slice& s) = 0;
  // The primitives of the standalone halves (reduce_scatter, all_gather, broadcast). Every
  // transport of ringdp has them (shm staged and registered, CUDA IPC and NCCL); the
  // defaults are for a transport that runs all_reduce only.
  virtual void copy_send(const Slice&) { throw std::logic_error("this transport has no copy_send"); }
  virtual void recv_reduce_copy(const Slice&) { throw std::logic_error("this transport has no recv_reduce_copy"); }
  // Whether a broadcast closes its chain into a ring: the rank before the root sends the
  // root empty slices (ring.cpp ring_broadcast says when). For a transport whose call check
  // rides on the slices (cuda-ipc: each consumer compares its predecessor's descriptor with its
  // own call), so that the root, too, checks its predecessor's call and returns only after
  // the whole chain agreed with it: a rank that believes it is the root while another rank
  // disagrees fails instead of keeping its own values. A transport that checks every call
  // before any data moves (shm: headers) does not need it.
  virtual bool closes_chain() const { return false; }
  // Called once after the last primitive of a collective: returns when the caller's
  // buffer may be reused (no peer still reads it) and every result is in place.
  virtual void finish() = 0;
};

}  // namespace ringdp
