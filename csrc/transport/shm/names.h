// Segment names in /dev/shm, and what removes a name when its process cannot.
//
// A name is "/ringdp-<job>-r<rank>-p<pid>-n<pidns>": the job id (rank 0's, from the
// rendezvous), the rank, and the creator's pid and pid namespace (the inode number of
// /proc/self/ns/pid). It is formed here only (segment_name) and read here only (reap_stale).
//
// A segment's name exists from its creation until every peer has mapped it (the end of
// set-up); an exit, an exception or the end of set-up unlinks it (Segment). What remains:
//   - SIGTERM during set-up (torchrun SIGTERMs every rank when one fails): while a name is
//     guarded (guard_name, from Segment::create to Segment::unlink), a SIGTERM handler
//     unlinks it, then does what the previous disposition said (below);
//   - SIGKILL (or any death that runs no code) during set-up: the name stays until the next
//     set-up on the machine, whose reap_stale() removes names whose creator is dead.
#pragma once
#include <string>
#include <vector>

namespace ringdp {
namespace shm {

// The name of `rank`'s segment in job `job` (letters and digits), created by this process.
std::string segment_name(const std::string& job, int rank);

// Unlink every /dev/shm entry that is a segment name of this form, owned by this user,
// created in this pid namespace by a process that no longer exists (or is a zombie); returns
// the names removed (without the leading '/'). Never a name of a live process, of another
// pid namespace (the same pid means another process there) or of another user. Safe to run
// concurrently from several processes. Never throws.
std::vector<std::string> reap_stale();

// The SIGTERM guard. From the first guarded name to the last unguarded one, SIGTERM's
// disposition is a handler (async-signal-safe, on whichever thread the signal lands) that
// unlinks this process's guarded names, then chains to the disposition it replaced: the
// default (terminate: reset to the default and re-raise), or a handler (called; e.g.
// Python's, which raises in the main thread later). It is not installed when SIGTERM is
// ignored, and on removal the previous disposition comes back unless someone replaced the
// guard meanwhile (theirs stays). A name is guarded before it is created, so no instant of
// its existence is unguarded; at most 64 names at once (beyond that, reap_stale remains).
void guard_name(const std::string& name);
void unguard_name(const std::string& name);

}  // namespace shm
}  // namespace ringdp
