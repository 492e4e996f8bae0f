#pragma once
#include <string>
#include <vector>

#include "error.h"

namespace ringdp {

// An endpoint's ranks, and how its messages name them. An endpoint inside a larger group (the
// in-host and cross-host endpoints of a hierarchy) numbers its ranks 0..world-1, while the
// user knows them by their group ranks: `names` maps the one to the other
// (ShmConfig::rank_names, cuda::Options::rank_names). Every transport checks its ranks and
// names them through these two, so a rank has one name in every message of every transport.

// Rank r as messages name it: names[r], or r itself (no names, or a value out of range: a
// peer's garbled record, shown as it came).
inline int rank_name(const std::vector<int>& names, int r) {
  return r >= 0 && r < static_cast<int>(names.size()) ? names[static_cast<size_t>(r)] : r;
}

// An endpoint's rank, world and names, checked as every transport's constructor does first:
// a rank outside the world, or names that do not cover it (empty: no names, ranks as they are).
inline void check_ranks(const char* transport, int rank, int world, const std::vector<int>& names) {
  if (world < 1 || rank < 0 || rank >= world)
    throw RingError(cat("ringdp ", transport, ": invalid rank ", rank, " for world size ", world));
  if (!names.empty() && static_cast<int>(names.size()) != world)
    throw RingError(cat("ringdp ", transport, " rank ", rank, ": rank_names has ", names.size(),
                        " entries for world size ", world));
}

}  // namespace ringdp
