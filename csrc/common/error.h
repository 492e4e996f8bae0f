#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace ringdp {

// Every failure that crosses into Python is a RingError (ringdp.RingError there). Messages
// name the rank that reports the problem and, where known, the rank that caused it.
class RingError : public std::runtime_error {
 public:
  explicit RingError(const std::string& m) : std::runtime_error(m) {}
};

template <class... Args>
std::string cat(Args&&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

}  // namespace ringdp
