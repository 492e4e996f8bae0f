// Chunk and step arithmetic of the ring (see ring.cpp for the algorithm). Header-only,
// torch-free, and exposed to Python for the unit tests in tests/test_schedule.py.
#pragma once
#include <cstddef>

namespace ringdp {
namespace ring {

// Non-negative a mod n.
inline int mod(long a, int n) {
  long r = a % n;
  return static_cast<int>(r < 0 ? r + n : r);
}

// Split `count` elements into n chunks. Every chunk but the trailing ones holds
// ceil(count / n) elements rounded up to a multiple of `align` (so chunk starts stay
// 16-byte aligned for vector loads); the last non-empty chunk takes what remains and the
// chunks after it are empty. Example: count 10, n 4, align 1 -> 3,3,3,1.
//                                     count 10, n 4, align 4 -> 4,4,2,0.
inline size_t chunk_stride(size_t count, int n, size_t align) {
  size_t per = (count + n - 1) / n;
  return (per + align - 1) / align * align;
}
inline size_t chunk_begin(size_t count, int n, size_t align, int c) {
  size_t b = chunk_stride(count, n, align) * static_cast<size_t>(c);
  return b < count ? b : count;
}
inline size_t chunk_end(size_t count, int n, size_t align, int c) {
  return chunk_begin(count, n, align, c + 1);
}

// Chunk arithmetic, given the chunk `o` a rank ends the reduce-scatter owning (o = r + c
// for a constant c, so ranks own distinct chunks and each receives what its predecessor
// sent). all_reduce uses o = r+1 (the historical choice, below); reduce_scatter and
// all_gather use o = r, so that rank r ends with chunk r (torch's semantics).
//   reduce-scatter step k (0 <= k < n-1): send chunk o-1-k, receive chunk o-2-k and add
//   my values; after n-1 steps the last received chunk is o.
//   all-gather step k (0 <= k < n-1): send chunk o-k, receive chunk o-1-k.
inline int rs_send_of(int n, int o, int k) { return mod(static_cast<long>(o) - 1 - k, n); }
inline int rs_recv_of(int n, int o, int k) { return mod(static_cast<long>(o) - 2 - k, n); }
inline int ag_send_of(int n, int o, int k) { return mod(static_cast<long>(o) - k, n); }
inline int ag_recv_of(int n, int o, int k) { return mod(static_cast<long>(o) - 1 - k, n); }

// all_reduce's ownership (o = r+1). Reduce-scatter step k: rank r sends chunk r-k,
// receives chunk r-k-1 and adds its own values. After n-1 steps rank r holds the final
// values of chunk r+1. All-gather step k: rank r sends chunk r+1-k, receives chunk r-k.
inline int owned_chunk(int n, int r) { return mod(r + 1, n); }
inline int rs_send_chunk(int n, int r, int k) { return rs_send_of(n, owned_chunk(n, r), k); }
inline int rs_recv_chunk(int n, int r, int k) { return rs_recv_of(n, owned_chunk(n, r), k); }
inline int ag_send_chunk(int n, int r, int k) { return ag_send_of(n, owned_chunk(n, r), k); }
inline int ag_recv_chunk(int n, int r, int k) { return ag_recv_of(n, owned_chunk(n, r), k); }

// Broadcast along the ring: rank r's position in the chain that starts at `root`
// (0: the root, n-1: the last rank, which only receives).
inline int chain_pos(int n, int r, int root) { return mod(static_cast<long>(r) - root, n); }

}  // namespace ring
}  // namespace ringdp
