// ringdp's ring all-reduce: the schedule, written once for every transport.
//
//        +-----> r0 ------> r1 -----+        every rank sends only to next = r+1 and
//        |                          |        receives only from prev = r-1 (mod n)
//        +------ r3 <------ r2 <----+
//
// The buffer of S bytes is cut into n chunks (C0..C{n-1}). Two phases of n-1 steps each:
//
//   reduce-scatter, step k = 0..n-2:  rank r sends chunk (r-k)   mod n
//                                     rank r receives chunk (r-k-1) mod n, adds its own
//                                     values, and passes the partial sum on at step k+1.
//      after n-1 steps rank r holds the complete reduction of chunk (r+1) mod n.
//   all-gather,     step k = 0..n-2:  rank r sends chunk (r+1-k) mod n (final values)
//                                     rank r receives chunk (r-k)   mod n and keeps it.
//
//   n = 3, reduce-scatter:       step 0          step 1          (owner after)
//                            r0: send C0 recv C2 send C2 recv C1   C1
//                            r1: send C1 recv C0 send C0 recv C2   C2
//                            r2: send C2 recv C1 send C1 recv C0   C0
//
// Bytes each rank sends (and receives): 2(n-1)/n * S -- (n-1) chunks in each phase. This is
// the "bus bandwidth" factor of nccl-tests: busbw = algbw * 2(n-1)/n.
//
// Pipelining. The buffer is processed in rounds of n * slice_elems elements; inside a
// round each chunk is one slice, so a transport with several slots per connection works
// on round i+1 while its successor still reduces round i (copy-in, reduce and copy-out of
// consecutive slices overlap across ranks).
//
// Remainders. In every round the round's elements are split by chunk_begin/chunk_end
// (schedule.h): chunks of ceil(R/n) rounded up to `align` elements, the last non-empty
// chunk takes the remainder, later chunks are empty. Empty slices are still exchanged so
// that both ends of a connection count the same slices. The last round is the only short
// one. Any count works, 0 and 1 included.
//
// Steps as primitives (transport.h) -- every slice of a round goes through 2n-1 of them:
//   RS step 0          send(C r)
//   RS steps 1..n-2    recv_reduce_send(C r-k)
//   RS step n-1        recv_reduce_copy_send(C r+1)      (the owner finalises its chunk)
//   AG steps 1..n-2    recv_copy_send(C r+1-k)
//   AG step n-1        recv(C r+2)
// Each chunk's final value is computed by exactly one rank, in one fixed order, and copied
// to the others, so results are bitwise identical on every rank.
#include "ring.h"

#include "schedule.h"

namespace ringdp {

namespace {
struct Round {
  size_t base;   // first element of the round
  size_t elems;  // elements in the round
  int n;
  size_t align;
  Slice chunk(int c) const {
    size_t b = ring::chunk_begin(elems, n, align, c);
    size_t e = ring::chunk_end(elems, n, align, c);
    return Slice{base + b, e - b};
  }
};
}  // namespace

size_t ring_slices_per_rank(const RingPlan& p) {
  if (p.world <= 1 || p.count == 0) return 0;
  size_t round = p.slice_elems * static_cast<size_t>(p.world);
  size_t rounds = (p.count + round - 1) / round;
  return rounds * static_cast<size_t>(2 * (p.world - 1));
}

void ring_all_reduce(RingTransport& t, const RingPlan& p) {
  const int n = p.world;
  const int r = p.rank;
  if (n > 1 && p.count > 0) {
    const size_t round_elems = p.slice_elems * static_cast<size_t>(n);
    for (size_t base = 0; base < p.count; base += round_elems) {
      const size_t left = p.count - base;
      const Round rd{base, left < round_elems ? left : round_elems, n, p.align};

      // Reduce-scatter, step 0: inject my values of chunk r.
      t.send(rd.chunk(ring::rs_send_chunk(n, r, 0)));
      // Reduce-scatter, steps 1..n-2: add my values to the partial sum and pass it on.
      for (int k = 1; k < n - 1; ++k) t.recv_reduce_send(rd.chunk(ring::rs_send_chunk(n, r, k)));
      // Reduce-scatter, last step: the partial sum of chunk r+1 now lacks only my values;
      // finish it, store it, and start the all-gather with it.
      t.recv_reduce_copy_send(rd.chunk(ring::owned_chunk(n, r)));
      // All-gather, steps 1..n-2: keep the final chunk and forward it.
      for (int k = 1; k < n - 1; ++k) t.recv_copy_send(rd.chunk(ring::ag_send_chunk(n, r, k)));
      // All-gather, last step: keep the final chunk that started at my successor.
      t.recv(rd.chunk(ring::ag_recv_chunk(n, r, n - 2)));
    }
  }
  t.finish();
}

}  // namespace ringdp
