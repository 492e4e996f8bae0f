// ringdp's ring collectives: the schedule, written once for every transport. all_reduce is
// the composition of the two halves, reduce_scatter and all_gather, which also run alone;
// broadcast is a pipelined chain along the same ring.
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
//
// The halves alone (torch's reduce_scatter_tensor / all_gather_into_tensor). The buffer is
// n blocks of `count` elements, block c = chunk c, contiguous (not interleaved by rounds):
// round i takes slice i of every block. Ownership is o = r (rank r ends with chunk r, as
// torch wants), so the chunk numbers are those above shifted by one (schedule.h *_of):
//   reduce_scatter   RS step 0        send(C r-1)
//                    RS steps 1..n-2  recv_reduce_send(C r-1-k)
//                    RS step n-1      recv_reduce_copy(C r)  (final value to the result)
//   all_gather       AG step 0        copy_send(C r)         (my block, final values)
//                    AG steps 1..n-2  recv_copy_send(C r-k)
//                    AG step n-1      recv(C r+1)
//   broadcast        root: copy_send, middle of the chain: recv_copy_send, the rank
//                    before the root: recv -- slice by slice, so the n-1 hops overlap;
//                    where the transport closes the chain (transport.h closes_chain), the
//                    rank before the root starts and ends with send(empty), the root takes
//                    them with recv(empty) after its first copy_send and at the end.
// Bytes each rank sends: reduce_scatter and all_gather (n-1)/n of the n-block buffer each
// (nccl-tests busbw = algbw * (n-1)/n); broadcast the whole buffer once (busbw = algbw).
#include "ring.h"

#include <stdexcept>
#include <string>

#include "schedule.h"

namespace ringdp {

namespace {
// One round of all_reduce's interleaved layout: the round's elements split into n chunks.
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

// One round of the blocked layout (reduce_scatter, all_gather): slice `first..first+elems`
// of every block of `block` elements.
struct BlockRound {
  size_t block;  // elements per block (= per rank)
  size_t first;  // offset of the round inside each block
  size_t elems;  // elements of each block in this round
  Slice chunk(int c) const { return Slice{static_cast<size_t>(c) * block + first, elems}; }
};

enum class RsEnd { kStore, kStoreAndSend };

// Reduce-scatter over one round, for the rank that ends owning chunk o. The last step
// stores the final value (reduce_scatter) or stores and sends it on (all_reduce, where it
// doubles as all-gather step 0).
template <class R>
void reduce_scatter_round(RingTransport& t, const R& rd, int n, int o, RsEnd end) {
  // RS step 0: inject my values of the chunk my successor adds to next.
  t.send(rd.chunk(ring::rs_send_of(n, o, 0)));
  // RS steps 1..n-2: add my values to the partial sum received and pass it on.
  for (int k = 1; k < n - 1; ++k) t.recv_reduce_send(rd.chunk(ring::rs_send_of(n, o, k)));
  // RS last step: the partial sum of chunk o lacks only my values; finish it.
  if (end == RsEnd::kStoreAndSend) t.recv_reduce_copy_send(rd.chunk(o));
  else t.recv_reduce_copy(rd.chunk(o));
}

// All-gather over one round, for the rank that owns chunk o (final values in place).
// `started`: step 0 (send chunk o) was already done by the reduce-scatter's last step.
template <class R>
void all_gather_round(RingTransport& t, const R& rd, int n, int o, bool started) {
  // AG step 0: my final chunk goes out.
  if (!started) t.copy_send(rd.chunk(ring::ag_send_of(n, o, 0)));
  // AG steps 1..n-2: keep the final chunk received and forward it.
  for (int k = 1; k < n - 1; ++k) t.recv_copy_send(rd.chunk(ring::ag_send_of(n, o, k)));
  // AG last step: keep the final chunk that started at my successor.
  t.recv(rd.chunk(ring::ag_recv_of(n, o, n - 2)));
}

// Rounds of the blocked layout: slice_elems of every block per round (none for an empty block).
template <class F>
void for_each_block_round(const RingPlan& p, F&& f) {
  for (size_t first = 0; first < p.count; first += p.slice_elems) {
    const size_t left = p.count - first;
    f(BlockRound{p.count, first, left < p.slice_elems ? left : p.slice_elems});
  }
}
}  // namespace

size_t ring_slices_per_rank(const RingPlan& p) {
  if (p.world <= 1 || p.count == 0) return 0;
  size_t round = p.slice_elems * static_cast<size_t>(p.world);
  size_t rounds = (p.count + round - 1) / round;
  return rounds * static_cast<size_t>(2 * (p.world - 1));
}

void ring_all_reduce(RingTransport& t, const RingPlan& p) {
  const int n = p.world;
  const int o = ring::owned_chunk(n, p.rank);  // r+1
  if (n > 1 && p.count > 0) {
    const size_t round_elems = p.slice_elems * static_cast<size_t>(n);
    for (size_t base = 0; base < p.count; base += round_elems) {
      const size_t left = p.count - base;
      const Round rd{base, left < round_elems ? left : round_elems, n, p.align};
      // Reduce-scatter, whose last step also starts the all-gather with chunk r+1 ...
      reduce_scatter_round(t, rd, n, o, RsEnd::kStoreAndSend);
      // ... then the rest of the all-gather.
      all_gather_round(t, rd, n, o, /*started=*/true);
    }
  }
  t.finish();
}

void ring_reduce_scatter(RingTransport& t, const RingPlan& p) {
  const int n = p.world;
  if (n > 1) for_each_block_round(p, [&](const BlockRound& rd) { reduce_scatter_round(t, rd, n, p.rank, RsEnd::kStore); });
  t.finish();
}

void ring_all_gather(RingTransport& t, const RingPlan& p) {
  const int n = p.world;
  if (n > 1) for_each_block_round(p, [&](const BlockRound& rd) { all_gather_round(t, rd, n, p.rank, false); });
  t.finish();
}

void ring_broadcast(RingTransport& t, const RingPlan& p, int root) {
  const int n = p.world;
  const int pos = ring::chain_pos(n, p.rank, root);
  // Closing the chain (transport.h closes_chain): the rank before the root sends the root an
  // empty slice twice, first of all (it waits for nothing) and after its last slice arrived;
  // the root takes the first after its own first slice went out and the second at the end.
  // The first: two ranks that both believe they are the root each take the other's first
  // slice, and fail on it, before either waits for a slot the other would never free. The
  // second: the root returns only once the whole chain took its slices with descriptors
  // agreeing with its own (else a rank failed, and the root stops on its abort flag).
  const bool close = t.closes_chain() && p.count > 0;
  const Slice empty{0, 0};
  if (n > 1) {
    if (close && pos == n - 1) t.send(empty);
    for (size_t b = 0; b < p.count; b += p.slice_elems) {
      const Slice s{b, p.count - b < p.slice_elems ? p.count - b : p.slice_elems};
      if (pos == 0) {  // the root: its values go out
        t.copy_send(s);
        if (close && b == 0) t.recv(empty);
      } else if (pos < n - 1) {  // the middle: keep and forward
        t.recv_copy_send(s);
      } else {  // the rank before the root: keep
        t.recv(s);
      }
    }
    if (close && pos == n - 1) t.send(empty);
    if (close && pos == 0) t.recv(empty);
  }
  t.finish();
}

void ring_run(RingTransport& t, Kind kind, const RingPlan& plan, int root) {
  switch (kind) {
    case Kind::kAllReduce: ring_all_reduce(t, plan); return;
    case Kind::kReduceScatter: ring_reduce_scatter(t, plan); return;
    case Kind::kAllGather: ring_all_gather(t, plan); return;
    case Kind::kBroadcast: ring_broadcast(t, plan, root); return;
  }
  throw std::invalid_argument("ring_run: unknown collective kind " + std::to_string(static_cast<int>(kind)));
}

}  // namespace ringdp
