// Moving shared-memory segments (csrc/transport/shm/segment.h): a move assignment into a
// segment that holds one releases the old one (its name unlinked from /dev/shm, its mapping
// gone) and takes the other's name, mapping and ownership, leaving the source empty; a move
// construction does the same into a new one. Built with AddressSanitizer by
// tests/test_leftovers.py, so that touching a member after its lifetime ended (the assignment
// used to run the destructor on the live object, and a long name was then freed twice)
// fails; exit status 0 and "segment moves: N checks passed, 0 failed" when every check holds.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <utility>

#include "checks.h"
#include "transport/shm/segment.h"

using ringdp::shm::Segment;

namespace {

bool exists(const std::string& name) {
  struct stat st;
  return ::stat(("/dev/shm" + name).c_str(), &st) == 0;
}

// Names longer than a string's inline buffer, so that they live on the heap.
std::string name_of(const char* what) {
  return "/ringdp-test-segment-move-" + std::to_string(::getpid()) + "-" + what;
}
}  // namespace

int main() {
  const std::string a_name = name_of("first-of-the-two"), b_name = name_of("second-of-the-two");
  {
    Segment a = Segment::create(a_name, 1 << 16, 4096);
    Segment b = Segment::create(b_name, 1 << 16, 4096);
    std::memcpy(b.base(), "second", 7);
    char* b_base = b.base();
    CHECK(exists(a_name) && exists(b_name));

    a = std::move(b);  // a held a segment: it is released, then a takes b's
    CHECK(!exists(a_name));  // a's old name unlinked (a owned it)
    CHECK(exists(b_name));   // b's name now a's, still linked
    CHECK(a.name() == b_name);
    CHECK(a.base() == b_base && a.size() == (1u << 16));
    CHECK(std::strcmp(a.base(), "second") == 0);
    CHECK(b.base() == nullptr && b.size() == 0);

    Segment c(std::move(a));  // construction: into an empty one
    CHECK(c.name() == b_name && c.base() == b_base);
    CHECK(a.base() == nullptr && a.size() == 0);
    CHECK(std::strcmp(c.base(), "second") == 0);

    c = std::move(c);  // self-assignment keeps it
    CHECK(c.base() == b_base && exists(b_name));
  }
  CHECK(!exists(a_name) && !exists(b_name));  // nothing left behind, nothing freed twice
  return checks::report("segment moves");
}
