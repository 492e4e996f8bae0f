// ringdp's CUDA kernels: ring steps, the one-shot small-message all-reduce and the drain
// wait. See reduce_kernels.cuh for what each computes; this file is torch-free and uses
// only explicit conversion intrinsics for half types (torch builds extensions with
// __CUDA_NO_HALF_CONVERSIONS__ and friends).
//
// Memory model. Cross-rank signalling uses 64-bit monotonic counters in device memory, each
// written by exactly one rank (a fast peer can never overwrite a slow peer's flag):
//   producer: all threads write data, __threadfence_system(), __syncthreads(), then thread 0
//             st.release.sys the counter (release is cumulative over the block's writes
//             ordered before it by the fence + barrier);
//   consumer: thread 0 ld.acquire.sys the counter until it reaches the target, then
//             __syncthreads(); peer data and descriptors are read with ld.global.cg (L2, never
//             a stale L1 line of an earlier use of the same slot).
// Waits sleep with __nanosleep and are bounded (timeout, peer abort flag, host abort), so
// a kernel never spins forever: without MPS the kernels of ranks that share one GPU are
// time-sliced, and a waiting kernel simply spins until the scheduler runs the peer.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "reduce_kernels.cuh"

namespace ringdp {
namespace cuda {
namespace {

// ---------------------------------------------------------------- memory-model helpers
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t ld_relaxed_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" : : "l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ SlotMeta load_meta_cg(const SlotMeta* m) {
  SlotMeta r;
  const uint4* s = reinterpret_cast<const uint4*>(m);
  uint4* d = reinterpret_cast<uint4*>(&r);
#pragma unroll
  for (int i = 0; i < 4; ++i) d[i] = __ldcg(s + i);
  return r;
}

// ---------------------------------------------------------------- failure reporting
__device__ void report(const FailCtx& f, int32_t code, int32_t peer, int32_t ch, int32_t what,
                       uint64_t target, uint64_t seen, uint64_t waited, const SlotMeta* mine,
                       const SlotMeta* theirs, const char* reason = nullptr) {
  if (atomicCAS(f.lock, 0ull, 1ull) != 0ull) return;  // another block of this rank reports (and raises the flag)
  {
    ErrorRecord* r = f.record;
    if (reason) {  // the peer's reason (written before its abort flag), from L2
      for (size_t i = 0; i + 1 < kReasonBytes; ++i) {
        const char c = __ldcg(reason + i);
        r->reason[i] = c;
        if (c == 0) break;
      }
      r->reason[kReasonBytes - 1] = 0;
    }
    r->peer = peer;
    r->channel = ch;
    r->what = what;
    r->target = target;
    r->seen = seen;
    r->waited_ns = waited;
    r->call = f.call;
    if (mine) r->mine = *mine;
    if (theirs) r->theirs = *theirs;
    __threadfence_system();
    r->code = code;
    __threadfence_system();
  }
  // The host stopped this rank: its reason goes beside the abort flag, where the peers that
  // see the flag read it (the host-side reject() writes the same place).
  __threadfence_system();  // (the reason was written before the flag that sent us here)
  if (code == kErrHostAbort && f.halt_reason != nullptr && f.halt_reason[0] != 0) {
    char* mine_reason = reinterpret_cast<char*>(f.my_abort) + kAbortReasonOffset;
    for (size_t i = 0; i + 1 < kReasonBytes; ++i) {
      const char c = f.halt_reason[i];
      mine_reason[i] = c;
      if (c == 0) break;
    }
    mine_reason[kReasonBytes - 1] = 0;
    __threadfence_system();
  }
  // Tell the neighbours (they poll this while they wait on us), after everything they read
  // with it. Only this rank writes it, and only its first report.
  st_release_sys(f.my_abort, 1);
}

// Thread 0 of a block at a kernel's start: whether this rank may go on (it has not failed,
// and, on an endpoint that follows another, its host has not stopped it: FailCtx::gate).
__device__ __noinline__ bool may_start(const FailCtx& f, int32_t ch) {
  if (ld_relaxed_sys(f.my_abort) != 0) return false;  // already failed and reported
  if (f.gate != nullptr && *f.gate != 0) {
    report(f, kErrHostAbort, f.rank, ch, kWaitPosted, 0, 0, 0, nullptr, nullptr);
    return false;
  }
  return true;
}

// Thread 0 of a block: wait until *flag >= target. Returns false (after reporting, unless
// another block of this rank already did) when the wait is given up.
__device__ __noinline__ bool wait_geq(const uint64_t* flag, uint64_t target, const uint64_t* peer_abort,
                                      int32_t peer, int32_t what, int32_t ch, const FailCtx& f) {
  uint64_t v = ld_acquire_sys(flag);
  if (v >= target) return true;
  const uint64_t t0 = now_ns();
  unsigned sleep = 32;
  for (uint32_t it = 1;; ++it) {
    __nanosleep(sleep);
    if (sleep < 256) sleep <<= 1;
    v = ld_acquire_sys(flag);
    if (v >= target) return true;
    if ((it & 31u) == 0) {
      if (ld_relaxed_sys(f.my_abort) != 0) return false;  // already failed and reported
      const uint64_t waited = now_ns() - t0;
      if (peer_abort && ld_acquire_sys(peer_abort) != 0) {
        report(f, kErrPeerAborted, peer, ch, what, target, v, waited, nullptr, nullptr,
               reinterpret_cast<const char*>(peer_abort) + kAbortReasonOffset);
        return false;
      }
      if (*f.host_abort != 0) {
        report(f, kErrHostAbort, peer, ch, what, target, v, waited, nullptr, nullptr);
        return false;
      }
      if (waited > f.timeout_ns) {
        report(f, kErrTimeout, peer, ch, what, target, v, waited, nullptr, nullptr);
        return false;
      }
    }
  }
}

// ---------------------------------------------------------------- element types
// Types that accumulate in themselves; half types specialise below.
template <class T> struct Num {
  using Acc = T;
  __device__ static T to(T x) { return x; }
  __device__ static T from(T x) { return x; }
};
template <> struct Num<__half> {
  using Acc = float;
  __device__ static float to(__half x) { return __half2float(x); }
  __device__ static __half from(float x) { return __float2half_rn(x); }
};
template <> struct Num<__nv_bfloat16> {
  using Acc = float;
  __device__ static float to(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ static __nv_bfloat16 from(float x) { return __float2bfloat16_rn(x); }
};

// Same operand order as the CPU kernels: f(partial, mine).
struct OpSum {
  template <class A> __device__ static A f(A a, A b) { return a + b; }
};
// MIN/MAX as IEEE fmin/fmax (NCCL's too): a NaN is ignored unless every operand is NaN (the
// CPU kernels' rule, csrc/kernels/cpu/reduce.cpp). Integers: a != a is false.
struct OpMin {
  template <class A> __device__ static A f(A a, A b) { return (b < a || a != a) ? b : a; }
};
struct OpMax {
  template <class A> __device__ static A f(A a, A b) { return (a < b || a != a) ? b : a; }
};

// IEEE division, whatever -use_fast_math says.
__device__ __forceinline__ float divide(float x, int d) { return __fdiv_rn(x, static_cast<float>(d)); }
__device__ __forceinline__ double divide(double x, int d) { return __ddiv_rn(x, static_cast<double>(d)); }
__device__ __forceinline__ int32_t divide(int32_t x, int d) { return x / d; }
__device__ __forceinline__ int64_t divide(int64_t x, int d) { return x / static_cast<int64_t>(d); }

// ---------------------------------------------------------------- 16-byte vectors
template <class X, int N> struct alignas(16) Arr {
  X v[N];
};
template <class X, int N, bool CG>
__device__ __forceinline__ void vload(Arr<X, N>& r, const X* p) {
  static_assert(sizeof(X) * N % 16 == 0, "vector of whole 16-byte words");
  const uint4* q = reinterpret_cast<const uint4*>(p);
  uint4* d = reinterpret_cast<uint4*>(&r);
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(X) * N / 16); ++i) d[i] = CG ? __ldcg(q + i) : q[i];
}
template <class X, int N>
__device__ __forceinline__ void vstore(X* p, const Arr<X, N>& r) {
  uint4* q = reinterpret_cast<uint4*>(p);
  const uint4* s = reinterpret_cast<const uint4*>(&r);
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(X) * N / 16); ++i) q[i] = s[i];
}

// An L2-only load of one element of any ringdp type (peer memory is never read through L1,
// where a line from an earlier use of the same slot could still sit).
template <class X> __device__ __forceinline__ X ldcg_any(const X* p) {
  X r;
  if constexpr (sizeof(X) == 2) {
    unsigned short u = __ldcg(reinterpret_cast<const unsigned short*>(p));
    memcpy(&r, &u, 2);
  } else if constexpr (sizeof(X) == 4) {
    unsigned int u = __ldcg(reinterpret_cast<const unsigned int*>(p));
    memcpy(&r, &u, 4);
  } else {
    static_assert(sizeof(X) == 8, "ringdp element types are 2, 4 or 8 bytes");
    unsigned long long u = __ldcg(reinterpret_cast<const unsigned long long*>(p));
    memcpy(&r, &u, 8);
  }
  return r;
}

template <class T, StepKind K> struct StepTypes {
  using A = typename Num<T>::Acc;
  static constexpr bool kReadsIn = K == StepKind::kSend || K == StepKind::kRecvReduceSend ||
                                   K == StepKind::kRecvReduceCopySend || K == StepKind::kCopySend ||
                                   K == StepKind::kRecvReduceCopy;
  static constexpr bool kReadsSrc = K != StepKind::kSend && K != StepKind::kCopySend;
  static constexpr bool kWritesOut = K != StepKind::kSend && K != StepKind::kCopySend;
  static constexpr bool kWritesDst = K != StepKind::kRecv && K != StepKind::kRecvReduceCopy;
  using Src = std::conditional_t<K == StepKind::kRecvReduceSend || K == StepKind::kRecvReduceCopySend ||
                                     K == StepKind::kRecvReduceCopy,
                                 A, T>;
  using Dst = std::conditional_t<K == StepKind::kSend || K == StepKind::kRecvReduceSend, A, T>;
};

// One element of a step: o goes to out[T], d to dst[Dst].
template <class T, class Op, StepKind K>
__device__ __forceinline__ void step_elem(T x, typename StepTypes<T, K>::Src y, int avg, T& o,
                                          typename StepTypes<T, K>::Dst& d) {
  using N = Num<T>;
  using A = typename N::Acc;
  if constexpr (K == StepKind::kSend) {
    d = N::to(x);
  } else if constexpr (K == StepKind::kCopySend) {
    d = x;
  } else if constexpr (K == StepKind::kRecvReduceSend) {
    A v = Op::f(y, N::to(x));
    d = v;
    o = N::from(v);
  } else if constexpr (K == StepKind::kRecvReduceCopySend || K == StepKind::kRecvReduceCopy) {
    A v = Op::f(y, N::to(x));
    if (avg > 0) v = divide(v, avg);
    T t = N::from(v);
    o = t;
    d = t;
  } else {  // kRecvCopySend, kRecv
    o = y;
    d = y;
  }
}

// The block's share of one step: n elements; every pointer already points at the block's
// first element (in/out/src/dst may be null where the kind does not use them). `vec`:
// every pointer is 16-byte aligned.
template <class T, class Op, StepKind K>
__device__ __forceinline__ void step_body(const T* in, T* out, const void* srcv, void* dstv, size_t n, int avg,
                                          bool vec) {
  using ST = StepTypes<T, K>;
  using Src = typename ST::Src;
  using Dst = typename ST::Dst;
  const Src* src = static_cast<const Src*>(srcv);
  Dst* dst = static_cast<Dst*>(dstv);
  const bool w_out = out != nullptr && ST::kWritesOut;
  const bool w_dst = dst != nullptr && ST::kWritesDst;
  if (!w_out && !w_dst) return;
  size_t b = 0;
  if (vec) {
    constexpr int P = 16 / static_cast<int>(sizeof(T));
    constexpr int U = 4;
    const size_t np = n / P;
    const size_t stride = blockDim.x;
    for (size_t p0 = threadIdx.x; p0 < np; p0 += U * stride) {
      Arr<T, P> xv[U];
      Arr<Src, P> yv[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const size_t p = p0 + u * stride;
        if (p < np) {
          const size_t i = p * P;
          if constexpr (ST::kReadsIn) vload<T, P, false>(xv[u], in + i);
          if constexpr (ST::kReadsSrc) vload<Src, P, true>(yv[u], src + i);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const size_t p = p0 + u * stride;
        if (p < np) {
          const size_t i = p * P;
          Arr<T, P> ov;
          Arr<Dst, P> dv;
#pragma unroll
          for (int j = 0; j < P; ++j) {
            T x{};
            Src y{};
            if constexpr (ST::kReadsIn) x = xv[u].v[j];
            if constexpr (ST::kReadsSrc) y = yv[u].v[j];
            step_elem<T, Op, K>(x, y, avg, ov.v[j], dv.v[j]);
          }
          if (w_out) vstore<T, P>(out + i, ov);
          if (w_dst) vstore<Dst, P>(dst + i, dv);
        }
      }
    }
    b = np * P;
  }
  for (size_t i = b + threadIdx.x; i < n; i += blockDim.x) {
    T x{};
    Src y{};
    if constexpr (ST::kReadsIn) x = in[i];
    if constexpr (ST::kReadsSrc) y = ldcg_any(src + i);
    T o{};
    Dst d{};
    step_elem<T, Op, K>(x, y, avg, o, d);
    if (w_out) out[i] = o;
    if (w_dst) dst[i] = d;
  }
}

// off + len <= region, without overflow.
__device__ __forceinline__ bool fits(uint64_t off, uint64_t len, uint64_t region) {
  return off <= region && len <= region - off;
}

// ---------------------------------------------------------------- the step kernel
template <class T, class Op, StepKind K>
__global__ void __launch_bounds__(kBlockThreads)
    step_kernel(StepArgs a, StepSig s, bool has_sig, bool vec_ok) {
  using ST = StepTypes<T, K>;
  const int ch = blockIdx.x;
  const size_t per = channel_span(a.count, a.channels);
  const size_t b = min(static_cast<size_t>(ch) * per, a.count);
  const size_t e = min(b + per, a.count);
  const size_t n = e - b;
  const T* in = a.in ? static_cast<const T*>(a.in) + b : nullptr;
  T* out = a.out ? static_cast<T*>(a.out) + b : nullptr;
  char* dst = nullptr;
  if (a.dst)
    dst = static_cast<char*>(a.dst) +
          (a.dst_chan_stride ? ch * a.dst_chan_stride : b * sizeof(typename ST::Dst));
  if (!has_sig) {
    const char* src = a.src ? static_cast<const char*>(a.src) + b * sizeof(typename ST::Src) : nullptr;
    step_body<T, Op, K>(in, out, src, dst, n, a.avg_div, vec_ok && aligned16(src));
    return;
  }
  __shared__ int s_ok;
  __shared__ const char* s_src;
  if (threadIdx.x == 0) {
    bool ok = may_start(s.fail, ch);
    const char* src = nullptr;
    if (ok && s.pred_posted)
      ok = wait_geq(s.pred_posted + ch * kLineWords, s.consume_target, s.pred_abort, s.pred_rank, kWaitPosted, ch,
                    s.fail);
    if (ok && s.succ_consumed && s.consumed_target > 0)
      ok = wait_geq(s.succ_consumed + ch * kLineWords, s.consumed_target, s.succ_abort, s.succ_rank, kWaitConsumed,
                    ch, s.fail);
    SlotMeta mine{};
    mine.call = s.call;
    mine.count = s.total_count;
    mine.dtype = static_cast<int32_t>(a.dtype);
    mine.op = static_cast<int32_t>(a.op);
    mine.coll = s.coll;
    mine.root = s.root;
    if (ok && s.pred_posted) {
      const SlotMeta m = load_meta_cg(s.pred_meta + ch);
      const uint64_t eb = s.consume_elem_bytes;
      const uint64_t bytes = static_cast<uint64_t>(a.count) * eb;
      mine.bytes = bytes;
      if (m.call != mine.call || m.count != mine.count || m.dtype != mine.dtype || m.op != mine.op ||
          m.coll != mine.coll || m.root != mine.root || m.bytes != bytes) {
        report(s.fail, kErrMismatch, s.pred_rank, ch, kWaitPosted, s.consume_target, s.consume_target, 0, &mine, &m);
        ok = false;
      } else {
        uint64_t off = 0;
        bool good;
        if (m.chan_stride) {  // staged: channel sub-buffers
          good = fits(m.src_off, 0, s.pred_region_bytes) && m.chan_stride <= s.pred_region_bytes;
          off = m.src_off + static_cast<uint64_t>(ch) * m.chan_stride;
          good = good && n * eb <= m.chan_stride && fits(off, n * eb, s.pred_region_bytes);
        } else {  // a registered tensor's slice, read in place: contiguous
          good = fits(m.src_off, bytes, s.pred_region_bytes);
          off = m.src_off + b * eb;
        }
        if (!good) {
          report(s.fail, kErrBadDescriptor, s.pred_rank, ch, kWaitPosted, s.consume_target, s.consume_target, 0,
                 &mine, &m);
          ok = false;
        } else {
          src = s.pred_base + off;
        }
      }
    }
    if (ok && s.my_posted) {
      SlotMeta o = mine;
      o.src_off = s.produce_src_off;
      o.bytes = static_cast<uint64_t>(a.count) * s.produce_elem_bytes;
      o.chan_stride = s.produce_chan_stride;
      s.my_meta[ch] = o;
    }
    s_ok = ok;
    s_src = src;
  }
  __syncthreads();
  if (!s_ok) return;
  step_body<T, Op, K>(in, out, s_src, dst, n, a.avg_div, vec_ok && aligned16(s_src));
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    if (s.pred_posted) st_release_sys(s.my_consumed + ch * kLineWords, s.consume_target);
    if (s.my_posted) st_release_sys(s.my_posted + ch * kLineWords, s.produce_value);
  }
}

// ---------------------------------------------------------------- the one-shot kernel
// Elements [b, e) of src to dst by this block's threads; peer memory (kPeer) through L2 only.
template <class T, bool kPeer>
__device__ __forceinline__ void copy_range(T* dst, const T* src, size_t b, size_t e, bool vec_ok) {
  constexpr int P = 16 / static_cast<int>(sizeof(T));
  size_t i0 = b;
  if (vec_ok) {
    const size_t np = (e - b) / P;
    for (size_t p = threadIdx.x; p < np; p += blockDim.x) {
      Arr<T, P> v;
      vload<T, P, kPeer>(v, src + b + p * P);
      vstore<T, P>(dst + b + p * P, v);
    }
    i0 = b + np * P;
  }
  for (size_t i = i0 + threadIdx.x; i < e; i += blockDim.x) dst[i] = kPeer ? ldcg_any(src + i) : src[i];
}

// out[i] = the reduction over ranks r (in rank order) of bufs[r][off + i], for i in [b, e).
template <class T, class Op>
__device__ __forceinline__ void reduce_range(T* out, const OneShotArgs& a, size_t off, size_t b, size_t e,
                                             bool vec_ok) {
  using N = Num<T>;
  using A = typename N::Acc;
  constexpr int P = 16 / static_cast<int>(sizeof(T));
  size_t i0 = b;
  if (vec_ok) {
    const size_t np = (e - b) / P;
    for (size_t p = threadIdx.x; p < np; p += blockDim.x) {
      const size_t i = b + p * P;
      Arr<T, P> v;
      A acc[P];
      vload<T, P, true>(v, reinterpret_cast<const T*>(a.bufs[0]) + off + i);
#pragma unroll
      for (int j = 0; j < P; ++j) acc[j] = N::to(v.v[j]);
      for (int r = 1; r < a.world; ++r) {
        vload<T, P, true>(v, reinterpret_cast<const T*>(a.bufs[r]) + off + i);
#pragma unroll
        for (int j = 0; j < P; ++j) acc[j] = Op::f(acc[j], N::to(v.v[j]));
      }
#pragma unroll
      for (int j = 0; j < P; ++j) v.v[j] = N::from(a.avg_div > 0 ? divide(acc[j], a.avg_div) : acc[j]);
      vstore<T, P>(out + i, v);
    }
    i0 = b + np * P;
  }
  for (size_t i = i0 + threadIdx.x; i < e; i += blockDim.x) {
    A acc = N::to(ldcg_any(reinterpret_cast<const T*>(a.bufs[0]) + off + i));
    for (int r = 1; r < a.world; ++r)
      acc = Op::f(acc, N::to(ldcg_any(reinterpret_cast<const T*>(a.bufs[r]) + off + i)));
    out[i] = N::from(a.avg_div > 0 ? divide(acc, a.avg_div) : acc);
  }
}

// (reduce_kernels.cuh OneShotArgs.) Channel ch takes elements [b, e) of `count` in every
// block, so its flag covers exactly what the peers' channel ch reads.
template <class T, class Op>
__global__ void __launch_bounds__(kBlockThreads) oneshot_kernel(OneShotArgs a, bool vec_ok) {
  const int ch = blockIdx.x;
  const size_t n = a.count;
  const size_t per = channel_span(n, a.channels);
  const size_t b = min(static_cast<size_t>(ch) * per, n);
  const size_t e = min(b + per, n);
  const auto coll = static_cast<ringdp::Kind>(a.coll);
  const size_t blocks = coll == ringdp::Kind::kReduceScatter ? static_cast<size_t>(a.world) : 1;
  __shared__ int s_ok;
  T* mine = reinterpret_cast<T*>(const_cast<char*>(a.bufs[a.rank]));
  const T* in = static_cast<const T*>(a.in);
  T* out = static_cast<T*>(a.out);

  // 1. The buffer of this parity was last used by call seq-2; every peer that has entered
  //    call seq-1 has finished reading it (its kernels run in order). Normally already true.
  if (threadIdx.x == 0) {
    bool ok = may_start(a.fail, ch);
    if (ok && a.seq > 1) {
      for (int p = 0; p < a.world && ok; ++p)
        if (p != a.rank)
          ok = wait_geq(a.flags[p] + ch * kLineWords, a.seq - 1, a.aborts[p], p, kWaitOneShot, ch, a.fail);
    }
    s_ok = ok;
  }
  __syncthreads();
  if (!s_ok) return;

  // 2. Copy what I contribute into my buffer (reduce_scatter: my range of every block; a
  //    broadcast's other ranks: nothing), describe it, publish.
  if (coll != ringdp::Kind::kBroadcast || a.rank == a.root)
    for (size_t q = 0; q < blocks; ++q) copy_range<T, false>(mine + q * n, in + q * n, b, e, vec_ok);
  SlotMeta me{};
  me.call = a.call;
  me.count = n;
  me.src_off = 0;
  me.bytes = static_cast<uint64_t>(blocks * n) * sizeof(T);
  me.dtype = static_cast<int32_t>(a.dtype);
  me.op = static_cast<int32_t>(a.op);
  me.coll = a.coll;
  me.root = a.root;
  if (threadIdx.x == 0) a.my_meta[ch] = me;
  __threadfence_system();
  __syncthreads();

  // 3. Wait for every peer's copy of this call and check that it is the same collective.
  if (threadIdx.x == 0) {
    st_release_sys(a.my_flag + ch * kLineWords, a.seq);
    bool ok = true;
    for (int p = 0; p < a.world && ok; ++p) {
      if (p == a.rank) continue;
      ok = wait_geq(a.flags[p] + ch * kLineWords, a.seq, a.aborts[p], p, kWaitOneShot, ch, a.fail);
      if (ok) {
        const SlotMeta m = load_meta_cg(a.metas[p] + ch);
        if (m.call != me.call || m.count != me.count || m.dtype != me.dtype || m.op != me.op ||
            m.bytes != me.bytes || m.coll != me.coll || m.root != me.root) {
          report(a.fail, kErrMismatch, p, ch, kWaitOneShot, a.seq, a.seq, 0, &me, &m);
          ok = false;
        }
      }
    }
    s_ok = ok;
  }
  __syncthreads();
  if (!s_ok) return;

  // 4. Read what this rank needs from every buffer (reductions in rank order: the same
  //    arithmetic on every rank).
  switch (coll) {
    case ringdp::Kind::kAllReduce:
      reduce_range<T, Op>(out, a, 0, b, e, vec_ok);
      break;
    case ringdp::Kind::kReduceScatter:
      reduce_range<T, Op>(out, a, static_cast<size_t>(a.rank) * n, b, e, vec_ok);
      break;
    case ringdp::Kind::kAllGather:
      for (int q = 0; q < a.world; ++q) {
        T* dst = out + static_cast<size_t>(q) * n;
        if (q != a.rank) copy_range<T, true>(dst, reinterpret_cast<const T*>(a.bufs[q]), b, e, vec_ok);
        else if (dst != in) copy_range<T, false>(dst, in, b, e, vec_ok);
      }
      break;
    case ringdp::Kind::kBroadcast:
      if (a.rank != a.root) copy_range<T, true>(out, reinterpret_cast<const T*>(a.bufs[a.root]), b, e, vec_ok);
      break;
  }
}

// ---------------------------------------------------------------- the drain kernel
__global__ void drain_kernel(DrainArgs a) {
  if (threadIdx.x != 0) return;
  const int ch = blockIdx.x;
  if (ld_relaxed_sys(a.fail.my_abort) != 0) return;
  wait_geq(a.succ_consumed + ch * kLineWords, a.target, a.succ_abort, a.succ_rank, kWaitConsumed, ch, a.fail);
}

// ---------------------------------------------------------------- dispatch
template <class T, class Op, StepKind K>
cudaError_t launch_step_t(const StepArgs& a, cudaStream_t st) {
  const bool has_sig = a.sig != nullptr;
  StepSig s{};
  if (has_sig) s = *a.sig;
  const bool vec_ok = aligned16(a.in) && aligned16(a.out) && aligned16(a.dst) && a.dst_chan_stride % 16 == 0;
  step_kernel<T, Op, K><<<a.channels, kBlockThreads, 0, st>>>(a, s, has_sig, vec_ok);
  return cudaGetLastError();
}

template <class T, class Op>
cudaError_t launch_step_op(const StepArgs& a, cudaStream_t st) {
  switch (a.kind) {
    case StepKind::kRecvReduceSend: return launch_step_t<T, Op, StepKind::kRecvReduceSend>(a, st);
    case StepKind::kRecvReduceCopySend: return launch_step_t<T, Op, StepKind::kRecvReduceCopySend>(a, st);
    case StepKind::kRecvReduceCopy: return launch_step_t<T, Op, StepKind::kRecvReduceCopy>(a, st);
    default: break;
  }
  return cudaErrorInvalidValue;
}

template <class T>
cudaError_t launch_step_dtype(const StepArgs& a, cudaStream_t st) {
  // Steps without arithmetic do not depend on the operator: one instantiation each.
  switch (a.kind) {
    case StepKind::kSend: return launch_step_t<T, OpSum, StepKind::kSend>(a, st);
    case StepKind::kRecvCopySend: return launch_step_t<T, OpSum, StepKind::kRecvCopySend>(a, st);
    case StepKind::kRecv: return launch_step_t<T, OpSum, StepKind::kRecv>(a, st);
    case StepKind::kCopySend: return launch_step_t<T, OpSum, StepKind::kCopySend>(a, st);
    default: break;
  }
  switch (a.op) {
    case RedOp::kMin: return launch_step_op<T, OpMin>(a, st);
    case RedOp::kMax: return launch_step_op<T, OpMax>(a, st);
    case RedOp::kSum:
    case RedOp::kAvg: break;
  }
  return launch_step_op<T, OpSum>(a, st);
}

template <class T, class Op>
cudaError_t launch_oneshot_t(const OneShotArgs& a, cudaStream_t st) {
  bool vec_ok = aligned16(a.in) && aligned16(a.out);
  for (int r = 0; r < a.world; ++r) vec_ok = vec_ok && aligned16(a.bufs[r]);
  // the halves address block q at q x count elements: vectors need whole 16-byte blocks
  const auto coll = static_cast<ringdp::Kind>(a.coll);
  if (coll == ringdp::Kind::kReduceScatter || coll == ringdp::Kind::kAllGather)
    vec_ok = vec_ok && (a.count * sizeof(T)) % 16 == 0;
  oneshot_kernel<T, Op><<<a.channels, kBlockThreads, 0, st>>>(a, vec_ok);
  return cudaGetLastError();
}

template <class T>
cudaError_t launch_oneshot_dtype(const OneShotArgs& a, cudaStream_t st) {
  switch (a.op) {
    case RedOp::kMin: return launch_oneshot_t<T, OpMin>(a, st);
    case RedOp::kMax: return launch_oneshot_t<T, OpMax>(a, st);
    case RedOp::kSum:
    case RedOp::kAvg: break;
  }
  return launch_oneshot_t<T, OpSum>(a, st);
}

}  // namespace

cudaError_t launch_step(const StepArgs& a, cudaStream_t st) {
  if (a.channels < 1 || a.channels > kMaxChannels) return cudaErrorInvalidValue;
  switch (a.dtype) {
    case DType::kFloat32: return launch_step_dtype<float>(a, st);
    case DType::kFloat64: return launch_step_dtype<double>(a, st);
    case DType::kFloat16: return launch_step_dtype<__half>(a, st);
    case DType::kBFloat16: return launch_step_dtype<__nv_bfloat16>(a, st);
    case DType::kInt32: return launch_step_dtype<int32_t>(a, st);
    case DType::kInt64: return launch_step_dtype<int64_t>(a, st);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_oneshot(const OneShotArgs& a, cudaStream_t st) {
  if (a.channels < 1 || a.channels > kMaxChannels || a.world < 1 || a.world > kMaxOneShotWorld)
    return cudaErrorInvalidValue;
  switch (a.dtype) {
    case DType::kFloat32: return launch_oneshot_dtype<float>(a, st);
    case DType::kFloat64: return launch_oneshot_dtype<double>(a, st);
    case DType::kFloat16: return launch_oneshot_dtype<__half>(a, st);
    case DType::kBFloat16: return launch_oneshot_dtype<__nv_bfloat16>(a, st);
    case DType::kInt32: return launch_oneshot_dtype<int32_t>(a, st);
    case DType::kInt64: return launch_oneshot_dtype<int64_t>(a, st);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_drain(const DrainArgs& a, cudaStream_t st) {
  if (a.channels < 1 || a.channels > kMaxChannels) return cudaErrorInvalidValue;
  drain_kernel<<<a.channels, 32, 0, st>>>(a);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace ringdp
