// A transport that only records what the engine asks of it: lets tests check the real
// schedule (every slice sent is the slice its successor receives, chunks tile the buffer,
// a dataflow replay gives the right sums) without moving data.
#pragma once
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "../transport/transport.h"
#include "ring.h"

namespace ringdp {

using TraceEntry = std::tuple<std::string, size_t, size_t>;  // primitive, offset, count

class RecordingTransport final : public RingTransport {
 public:
  std::vector<TraceEntry> log;
  void send(const Slice& s) override { add("send", s); }
  void recv_reduce_send(const Slice& s) override { add("recv_reduce_send", s); }
  void recv_reduce_copy_send(const Slice& s) override { add("recv_reduce_copy_send", s); }
  void recv_copy_send(const Slice& s) override { add("recv_copy_send", s); }
  void recv(const Slice& s) override { add("recv", s); }
  void copy_send(const Slice& s) override { add("copy_send", s); }
  void recv_reduce_copy(const Slice& s) override { add("recv_reduce_copy", s); }
  void finish() override { log.emplace_back("finish", 0, 0); }

 private:
  void add(const char* p, const Slice& s) { log.emplace_back(p, s.offset, s.count); }
};

inline std::vector<TraceEntry> ring_trace(size_t count, int world, int rank, size_t slice_elems,
                                          size_t align) {
  RecordingTransport t;
  ring_all_reduce(t, RingPlan{count, world, rank, slice_elems, align});
  return t.log;
}

// The trace of any collective of the engine: "all_reduce", "reduce_scatter", "all_gather"
// (count per rank) or "broadcast" (from `root`).
inline std::vector<TraceEntry> collective_trace(const std::string& kind, size_t count, int world, int rank,
                                                size_t slice_elems, size_t align, int root) {
  RecordingTransport t;
  const RingPlan p{count, world, rank, slice_elems, align};
  Kind k;
  if (kind == "all_reduce") k = Kind::kAllReduce;
  else if (kind == "reduce_scatter") k = Kind::kReduceScatter;
  else if (kind == "all_gather") k = Kind::kAllGather;
  else if (kind == "broadcast") k = Kind::kBroadcast;
  else throw std::invalid_argument("unknown collective " + kind);
  ring_run(t, k, p, root);
  return t.log;
}

}  // namespace ringdp
