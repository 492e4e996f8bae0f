#pragma once
#include <cstddef>

#include "../transport/transport.h"

namespace ringdp {

struct RingPlan {
  size_t count;        // elements in the buffer
  int world;           // n
  int rank;            // r
  size_t slice_elems;  // pipeline granularity: at most this many elements per chunk per round
  size_t align;        // chunk boundaries are multiples of this many elements
};

// Run one all-reduce over `t` (reduce-scatter then all-gather). Calls t.finish() at the end.
void ring_all_reduce(RingTransport& t, const RingPlan& plan);

// Number of slices each rank sends (and receives) for this plan; transports use it to
// size their bookkeeping and tests use it to check the schedule.
size_t ring_slices_per_rank(const RingPlan& plan);

}  // namespace ringdp
