#pragma once
#include <cstdio>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

namespace ringdp {

// Every failure that crosses into Python is a RingError (ringdp.RingError there). Messages
// name the rank that reports the problem and, where known, the rank that caused it.
class RingError : public std::runtime_error {
 public:
  explicit RingError(const std::string& m) : std::runtime_error(m) {}
};

namespace detail {
// One piece of a message, formatted as std::ostream would by default (numbers, strings,
// characters, %g for floating point) but without iostreams: the extension may be built by
// a newer g++ than the libstdc++ it runs with, and inline ostream code compiled against the
// newer headers crashed in the older library's locale facets (seen on an H100 machine:
// g++ 13.3 from /opt/gcc, the system's libstdc++; SIGSEGV in the first message built).
template <class T>
void put(std::string& s, const T& v) {
  using U = std::decay_t<T>;
  if constexpr (std::is_array_v<T>) {
    s += static_cast<const char*>(v);  // string literals and char buffers
  } else if constexpr (std::is_same_v<U, bool>) {
    s += v ? '1' : '0';
  } else if constexpr (std::is_same_v<U, char>) {
    s += v;
  } else if constexpr (std::is_same_v<U, const char*> || std::is_same_v<U, char*>) {
    s += v ? static_cast<const char*>(v) : "(null)";
  } else if constexpr (std::is_integral_v<U>) {
    s += std::to_string(v);
  } else if constexpr (std::is_enum_v<U>) {
    s += std::to_string(static_cast<std::underlying_type_t<U>>(v));
  } else if constexpr (std::is_floating_point_v<U>) {
    char b[48];
    std::snprintf(b, sizeof(b), "%g", static_cast<double>(v));
    s += b;
  } else if constexpr (std::is_pointer_v<U>) {
    char b[32];
    std::snprintf(b, sizeof(b), "%p", static_cast<const void*>(v));
    s += b;
  } else {
    s += std::string_view(v);
  }
}
}  // namespace detail

template <class... Args>
std::string cat(Args&&... args) {
  std::string s;
  (detail::put(s, args), ...);
  return s;
}

// A broadcast's root must be a rank of the group: every transport checks it the same way
// (`who` names the reporting rank, e.g. "rank 3" or "ringdp nccl rank 3").
inline void check_broadcast_root(const std::string& who, int root, int world) {
  if (root < 0 || root >= world)
    throw RingError(cat(who, ": broadcast from rank ", root, ", which is not a rank of this group (world size ", world,
                        ")"));
}

}  // namespace ringdp
