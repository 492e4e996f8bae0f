// A long wait that a person can interrupt (Ctrl-C). The language binding installs one check
// (bindings.cpp: on Python's main thread, a SIGINT received runs the program's handler);
// every wait of the shared-memory transport runs it between sleeps (ShmComm::check_health),
// and whatever it throws ends the wait: the call is abandoned and the communicator aborts,
// so that its peers fail at once naming this rank. Torch- and Python-free: a function
// pointer, none installed by default (the C++ tests', the CUDA simulators').
#pragma once

#include <atomic>

namespace ringdp {

using InterruptCheck = void (*)();

inline std::atomic<InterruptCheck>& interrupt_check_slot() {
  static std::atomic<InterruptCheck> check{nullptr};
  return check;
}

inline void set_interrupt_check(InterruptCheck check) { interrupt_check_slot().store(check, std::memory_order_release); }

// Run the installed check (cheap when there is none, or not on the thread it watches).
inline void check_interrupt() {
  if (InterruptCheck check = interrupt_check_slot().load(std::memory_order_acquire)) check();
}

}  // namespace ringdp
