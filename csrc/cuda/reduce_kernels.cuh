// ringdp's CUDA kernels: what the host side of the transports may see.
//
// This header holds plain structs and host launch functions only (no __global__ code), so
// both .cu and .cpp files include it. The kernels live in reduce_kernels.cu.
//
// One kernel family serves every transport. A *step* kernel carries out one ring primitive
// (transport.h) on one slice:
//
//   kind                 reads                         writes
//   kSend                in[T]                         dst[Acc]            (dst may be null)
//   kRecvReduceSend      src[Acc], in[T]               dst[Acc] and/or out[T]
//   kRecvReduceCopySend  src[Acc], in[T]               out[T] (final, AVG applied), dst[T]
//   kRecvCopySend        src[T]                        out[T], dst[T]
//   kRecv                src[T]                        out[T]
//   kCopySend            in[T]                         dst[T]              (dst may be null)
//   kRecvReduceCopy      src[Acc], in[T]               out[T] (final, AVG applied)
//
// The standalone halves: kCopySend starts an all-gather or a broadcast (final values, so
// in T); kRecvReduceCopy ends a reduce-scatter, where `in` is the input's slice and `out`
// the matching slice of the separate output.
//
// Acc is float32 for half types and T otherwise (types.h acc_size): partial sums travel in
// Acc during the reduce-scatter and are rounded once, by the chunk's owner.
//
// The slice is split evenly over `channels` thread blocks; every block handles one
// contiguous range whose start is a multiple of kPackElems elements (both ends of a
// connection compute the same split, so channel c of the consumer reads exactly what
// channel c of the producer wrote and each channel has its own flags). In a staged slot
// each channel has a fixed sub-buffer (protocol.h SlotGeometry).
//
// With `sig` set (the CUDA IPC transport) thread 0 of every block first waits on the
// peers' counters in device memory (system-scope acquire), checks the producer's slot
// descriptor, and after the block's work publishes its own counters (system-scope release).
// Waits are bounded: on timeout, a peer's abort flag, a host abort request or a mismatched
// descriptor the block records the failure in host-mapped memory, raises this rank's abort
// flag (so the neighbours stop too) and exits. Without `sig` (NCCL transport, local work)
// the kernel only computes.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "../common/types.h"
#include "protocol.h"

namespace ringdp {
namespace cuda {

// What a producer publishes with each slice, one per (slot, channel), written before the
// release of its `posted` counter. The consumer checks it against its own call before it
// reads a byte: a rank that called another collective (kind), or the same with another
// size, dtype, op or broadcast root (or that is a call ahead or behind) is reported instead
// of producing a silently wrong result.
struct alignas(64) SlotMeta {
  uint64_t call;     // 1-based collective number on the producer
  uint64_t count;    // total elements of the producer's collective
  uint64_t src_off;  // where the slice's bytes are: offset from the producer's region base
  uint64_t bytes;    // bytes of the slice (elements x element size of what travels)
  // 0: the slice is contiguous at src_off (a registered tensor's slice, read in place):
  // channel c's range starts at src_off + begin_c * elem. > 0: a staged slot whose channel
  // c starts at src_off + c * chan_stride (protocol.h SlotGeometry).
  uint64_t chan_stride;
  int32_t dtype;
  int32_t op;
  int32_t coll;  // the collective (types.h ringdp::Kind); count is per rank for the halves
  int32_t root;  // broadcast's source rank (0 otherwise)
  int32_t pad[2];
};
static_assert(sizeof(SlotMeta) == 64, "slot descriptor is one 64-byte record");

// Failure report, in host-mapped pinned memory so the host reads it without touching the
// stream. Written once per transport (the writer wins a device-side lock first); `code`
// is written last.
enum ErrorCode : int32_t {
  kErrNone = 0,
  kErrTimeout = 1,      // a flag did not reach its target within the timeout
  kErrPeerAborted = 2,  // the peer we waited on gave up first
  kErrHostAbort = 3,    // the host asked this rank to stop (Comm::abort)
  kErrMismatch = 4,     // the producer's descriptor disagrees with our call
  kErrBadDescriptor = 5,  // the producer's descriptor points outside its region
};
enum WaitWhat : int32_t {
  kWaitPosted = 0,    // waiting for the predecessor to publish a slice
  kWaitConsumed = 1,  // waiting for the successor to free a slot / stop reading our data
  kWaitOneShot = 2,   // waiting for a peer's one-shot buffer
};
// A rank that gives up for a reason its peers should see (Comm::reject) writes the reason,
// NUL-terminated, kAbortReasonOffset bytes after its abort flag (ipc_transport.h
// Ctrl::reason) before it raises the flag; a peer that sees the flag copies the text into
// its failure record.
constexpr size_t kReasonBytes = 256;
constexpr size_t kAbortReasonOffset = kLineBytes;

struct ErrorRecord {
  volatile int32_t code;
  int32_t peer;     // the rank we were waiting on / whose descriptor was wrong
  int32_t channel;
  int32_t what;     // WaitWhat
  uint64_t target;  // counter value we needed
  uint64_t seen;    // counter value we saw last
  uint64_t waited_ns;
  uint64_t call;    // the collective it struck (FailCtx::call); it and every later one failed
  SlotMeta mine;    // our own call (for mismatches)
  SlotMeta theirs;  // the peer's descriptor (for mismatches)
  char reason[kReasonBytes];  // kErrPeerAborted: the peer's reason, if it left one
};

// Where a block reports failure and what it polls while it waits. All pointers are device
// pointers (host-mapped ones through cudaHostGetDevicePointer).
struct FailCtx {
  ErrorRecord* record;              // host-mapped
  unsigned long long* lock;         // device word in our own region, 0 until the first failure
  uint64_t* my_abort;               // our abort flag (device, read by peers)
  const volatile int32_t* host_abort;  // host-mapped; nonzero: stop now
  // Hierarchical calls: host_abort when this endpoint follows another (Comm::follow: its steps
  // consume the cross-host step's results), checked at each kernel's start too, so that a step
  // queued behind an aborted one fails instead of passing on what the abort left; null otherwise.
  const volatile int32_t* gate;
  const volatile char* halt_reason;  // host-mapped, NUL-terminated; why the host stopped this rank ("" if unknown)
  uint64_t timeout_ns;
  uint64_t call;  // the collective this launch belongs to (the host's count: ErrorRecord::call)
  int32_t rank;
};

// Signalling of one ring step (IPC transport). Counter arrays have one 128-byte line per
// channel: counter of channel c at base + c * kLineWords.
struct StepSig {
  // Consume: wait pred_posted[c] >= consume_target, check pred_meta[c], read from
  // pred_base + meta.src_off, then publish my_consumed[c] = consume_target.
  const uint64_t* pred_posted;   // null: the step consumes nothing
  const SlotMeta* pred_meta;     // channel c at pred_meta[c]
  const char* pred_base;
  uint64_t pred_region_bytes;
  const uint64_t* pred_abort;
  uint64_t consume_target;
  uint64_t* my_consumed;
  int32_t pred_rank;
  // Guard: wait succ_consumed[c] >= consumed_target before writing (slot reuse, and our
  // own tensor while the successor may still read it in place). 0: no wait.
  const uint64_t* succ_consumed;
  const uint64_t* succ_abort;
  uint64_t consumed_target;
  int32_t succ_rank;
  // Produce: fill my_meta[c] (call, count, slice start, slice bytes) then publish
  // my_posted[c] = produce_value. null: the step produces nothing.
  uint64_t* my_posted;
  SlotMeta* my_meta;
  uint64_t produce_value;
  uint64_t produce_src_off;   // offset of the produced slice's start (slot or tensor) in my region
  uint64_t produce_chan_stride;  // SlotMeta::chan_stride of what I produce (0: read in place)
  uint32_t produce_elem_bytes;  // element size of what is produced (Acc or T)
  uint32_t consume_elem_bytes;  // element size of what is consumed
  // Identity of this call, for descriptors and mismatch checks.
  uint64_t call;
  uint64_t total_count;  // all_reduce, broadcast: the tensor's elements; the halves: per rank
  int32_t coll;          // ringdp::Kind
  int32_t root;          // broadcast's source rank
  FailCtx fail;
};

struct StepArgs {
  StepKind kind;
  DType dtype;
  RedOp op;
  const void* in;   // my tensor's slice (T)
  void* out;        // my tensor's slice (T), may equal `in`; kRecvReduceCopy: the output's slice
  const void* src;  // incoming slice (contiguous); with sig, from the producer's descriptor
  void* dst;        // outgoing slice (slot or staging buffer)
  size_t dst_chan_stride;  // 0: dst is contiguous; > 0: channel c writes at dst + c * this
  size_t count;     // elements in the slice (may be 0)
  int avg_div;      // > 0: divide the final value by this (AVG; kRecvReduceCopySend, kRecvReduceCopy)
  int channels;     // blocks; the slice split
  const StepSig* sig;  // host copy; launch copies it into the kernel parameters. null: local
};

// One-shot collectives for small messages: every rank copies what it contributes into its
// one-shot buffer (parity call % 2), publishes, waits for all peers, checks that they are
// at the same call, and reads what it needs from the peers' buffers (`coll`):
//   all_reduce      stages in[0, count); out[i] = the reduction over ranks of buf_r[i]
//   reduce_scatter  stages in[0, world x count); out[i] = the reduction of buf_r[rank x count + i]
//   all_gather      stages in[0, count); out[q x count + i] = buf_q[i]
//   broadcast       the root stages in[0, count); every other rank: out[i] = buf_root[i]
// Reductions run in rank order 0..n-1 (identical arithmetic on every rank -> bitwise
// identical results).
struct OneShotArgs {
  DType dtype;
  RedOp op;
  int32_t coll;  // ringdp::Kind
  int32_t root;  // broadcast's source rank (0 otherwise)
  const void* in;
  void* out;
  size_t count;  // all_reduce, broadcast: the tensor's elements; the halves: per rank
  int avg_div;
  int channels;
  int world;
  int rank;
  uint64_t seq;  // 1-based one-shot call number (same on every rank)
  const char* bufs[kMaxOneShotWorld];        // each rank's buffer of this parity (mine: own ptr)
  uint64_t* my_flag;                         // my one-shot counters (lines per channel)
  const uint64_t* flags[kMaxOneShotWorld];   // every rank's one-shot counters
  SlotMeta* my_meta;                         // my descriptors of this parity (per channel)
  const SlotMeta* metas[kMaxOneShotWorld];   // every rank's descriptors of this parity
  const uint64_t* aborts[kMaxOneShotWorld];  // every rank's abort flag
  uint64_t call;
  FailCtx fail;
};

// A kernel that only waits: every channel block waits succ_consumed[c] >= target (so the
// successor has finished reading our tensor in place before the caller may reuse it).
struct DrainArgs {
  const uint64_t* succ_consumed;
  const uint64_t* succ_abort;
  uint64_t target;
  int32_t succ_rank;
  int channels;
  FailCtx fail;
};

// Host launchers. They return the launch error (cudaSuccess or the error) and never
// synchronise.
cudaError_t launch_step(const StepArgs& a, cudaStream_t stream);
cudaError_t launch_oneshot(const OneShotArgs& a, cudaStream_t stream);
cudaError_t launch_drain(const DrainArgs& a, cudaStream_t stream);

}  // namespace cuda
}  // namespace ringdp
