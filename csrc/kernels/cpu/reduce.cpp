#include "reduce.h"

#include <cstring>

namespace ringdp {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
  }
  return "unknown";
}

const char* redop_name(RedOp op) {
  switch (op) {
    case RedOp::kSum: return "SUM";
    case RedOp::kAvg: return "AVG";
    case RedOp::kMin: return "MIN";
    case RedOp::kMax: return "MAX";
  }
  return "unknown";
}

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kAllReduce: return "all_reduce";
    case Kind::kReduceScatter: return "reduce_scatter";
    case Kind::kAllGather: return "all_gather";
    case Kind::kBroadcast: return "broadcast";
  }
  return "unknown";
}

namespace cpu {
namespace {

inline uint32_t f2u(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float u2f(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

}  // namespace

float bf16_to_float(uint16_t h) { return u2f(static_cast<uint32_t>(h) << 16); }

uint16_t float_to_bf16(float f) {
  uint32_t u = f2u(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float half_to_float(uint16_t h) {
  // Scale the exponent through a float multiply: handles normals and subnormals alike.
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t rest = h & 0x7fffu;
  if (rest >= 0x7c00u) return u2f(sign | 0x7f800000u | (rest & 0x3ffu) << 13);  // inf/nan
  float mag = u2f(rest << 13) * u2f(0x77800000u);  // * 2^112
  return u2f(sign | f2u(mag));
}

uint16_t float_to_half(float f) {
  uint32_t u = f2u(f);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;                        // NaN
  if (a >= 0x477ff000u) return sign | 0x7c00u;                       // overflow -> inf
  if (a < 0x38800000u) {                                             // subnormal or zero
    float m = u2f(a) + 0.5f;                                         // round via float add
    return sign | static_cast<uint16_t>(f2u(m) - f2u(0.5f));
  }
  uint32_t mant_odd = (a >> 13) & 1u;
  a += 0xc8000fffu + mant_odd;  // re-bias exponent (-112 << 23) and round to nearest even
  return sign | static_cast<uint16_t>(a >> 13);
}

namespace {

struct F16 { uint16_t v; };
struct BF16 { uint16_t v; };

template <class T> struct Acc { using type = T; };
template <> struct Acc<F16> { using type = float; };
template <> struct Acc<BF16> { using type = float; };

template <class T> inline typename Acc<T>::type load(const T& x) { return x; }
inline float load(const F16& x) { return half_to_float(x.v); }
inline float load(const BF16& x) { return bf16_to_float(x.v); }
template <class T> inline T store(typename Acc<T>::type x) { return x; }
template <> inline F16 store<F16>(float x) { return F16{float_to_half(x)}; }
template <> inline BF16 store<BF16>(float x) { return BF16{float_to_bf16(x)}; }

struct OpSum { template <class A> static A f(A a, A b) { return a + b; } };
// MIN/MAX as IEEE fmin/fmax (and NCCL's): a NaN is ignored unless every operand is NaN, so
// the result does not depend on where in the ring the NaN's rank sits (a NaN kept only as
// the partial, as `b < a ? b : a` did, made it depend on it). Integers: a != a is false.
struct OpMin { template <class A> static A f(A a, A b) { return (b < a || a != a) ? b : a; } };
struct OpMax { template <class A> static A f(A a, A b) { return (a < b || a != a) ? b : a; } };

template <class A> inline A divide(A x, int d) { return d > 0 ? x / static_cast<A>(d) : x; }

template <class T, class Op>
struct K {
  using A = typename Acc<T>::type;
  static void to_acc(void* dst, const void* src, size_t n) {
    A* __restrict d = static_cast<A*>(dst);
    const T* __restrict s = static_cast<const T*>(src);
    for (size_t i = 0; i < n; ++i) d[i] = load(s[i]);
  }
  static void reduce_acc(void* dst, const void* a, const void* b, size_t n) {
    A* __restrict d = static_cast<A*>(dst);
    const A* __restrict x = static_cast<const A*>(a);
    const T* __restrict y = static_cast<const T*>(b);
    for (size_t i = 0; i < n; ++i) d[i] = Op::f(x[i], load(y[i]));
  }
  static void reduce_final(void* data, void* out2, const void* a, const void* b, size_t n,
                           int avg_div) {
    // data and b may be the same array (element-wise in place), so no __restrict on them.
    T* d = static_cast<T*>(data);
    const A* __restrict x = static_cast<const A*>(a);
    const T* y = static_cast<const T*>(b);
    if (out2) {
      T* __restrict o = static_cast<T*>(out2);
      if (avg_div > 0) {
        for (size_t i = 0; i < n; ++i) { T v = store<T>(divide(Op::f(x[i], load(y[i])), avg_div)); d[i] = v; o[i] = v; }
      } else {
        for (size_t i = 0; i < n; ++i) { T v = store<T>(Op::f(x[i], load(y[i]))); d[i] = v; o[i] = v; }
      }
    } else if (avg_div > 0) {
      for (size_t i = 0; i < n; ++i) d[i] = store<T>(divide(Op::f(x[i], load(y[i])), avg_div));
    } else {
      for (size_t i = 0; i < n; ++i) d[i] = store<T>(Op::f(x[i], load(y[i])));
    }
  }
  static void reduce_many(void* out, const void* const* srcs, int k, size_t n, int avg_div) {
    // Blocked so the float32 partials of a block stay in L1 while the k sources stream by.
    constexpr size_t B = 1024;
    A acc[B];
    T* o = static_cast<T*>(out);
    for (size_t b0 = 0; b0 < n; b0 += B) {
      size_t m = n - b0 < B ? n - b0 : B;
      const T* s0 = static_cast<const T*>(srcs[0]) + b0;
      for (size_t i = 0; i < m; ++i) acc[i] = load(s0[i]);
      for (int j = 1; j < k; ++j) {
        const T* sj = static_cast<const T*>(srcs[j]) + b0;
        for (size_t i = 0; i < m; ++i) acc[i] = Op::f(acc[i], load(sj[i]));
      }
      for (size_t i = 0; i < m; ++i) o[b0 + i] = store<T>(divide(acc[i], avg_div));
    }
  }
  static const Kernels& get() {
    static const Kernels k{to_acc, reduce_acc, reduce_final, reduce_many};
    return k;
  }
};

template <class T>
const Kernels& for_op(RedOp op) {
  switch (op) {
    case RedOp::kMin: return K<T, OpMin>::get();
    case RedOp::kMax: return K<T, OpMax>::get();
    case RedOp::kSum:
    case RedOp::kAvg: break;
  }
  return K<T, OpSum>::get();
}

}  // namespace

const Kernels& kernels_for(DType dtype, RedOp op) {
  switch (dtype) {
    case DType::kFloat64: return for_op<double>(op);
    case DType::kFloat16: return for_op<F16>(op);
    case DType::kBFloat16: return for_op<BF16>(op);
    case DType::kInt32: return for_op<int32_t>(op);
    case DType::kInt64: return for_op<int64_t>(op);
    case DType::kFloat32: break;
  }
  return for_op<float>(op);
}

}  // namespace cpu
}  // namespace ringdp
