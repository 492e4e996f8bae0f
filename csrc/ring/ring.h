#pragma once
#include <cstddef>

#include "../common/types.h"
#include "../transport/transport.h"

namespace ringdp {

struct RingPlan {
  size_t count;        // all_reduce, broadcast: elements in the buffer;
                       // reduce_scatter, all_gather: elements per rank (the buffer holds world * count)
  int world;           // n
  int rank;            // r
  size_t slice_elems;  // pipeline granularity: at most this many elements per chunk per round
  size_t align;        // chunk boundaries are multiples of this many elements
};

// Run one all-reduce over `t` (reduce-scatter then all-gather). Calls t.finish() at the end.
void ring_all_reduce(RingTransport& t, const RingPlan& plan);

// The halves alone, over a buffer of world blocks of plan.count elements (block c = chunk
// c); rank r ends owning block r. reduce_scatter reads the buffer (the input) and writes
// only the final block r, through t.recv_reduce_copy (the transport decides where: the
// shm transport writes it to a separate output). all_gather expects the caller's block r
// in place and fills the others. Both call t.finish() at the end.
void ring_reduce_scatter(RingTransport& t, const RingPlan& plan);
void ring_all_gather(RingTransport& t, const RingPlan& plan);
// Broadcast plan.count elements from `root` down the chain root, root+1, ..., root-1,
// slice by slice. Calls t.finish() at the end.
void ring_broadcast(RingTransport& t, const RingPlan& plan, int root);

// The collective `kind` over `t` (one of the four above; `root`: a broadcast's source, else
// ignored): the one dispatch every transport and simulation uses.
void ring_run(RingTransport& t, Kind kind, const RingPlan& plan, int root);

// Number of slices each rank sends (and receives) for this plan; transports use it to
// size their bookkeeping and tests use it to check the schedule.
size_t ring_slices_per_rank(const RingPlan& plan);

}  // namespace ringdp
