#include "names.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <mutex>

#include "../../common/error.h"

namespace ringdp {
namespace shm {
namespace {

constexpr char kDir[] = "/dev/shm";
constexpr char kPrefix[] = "ringdp-";

// The pid namespace of this process, or 0 when /proc does not say (then no pid is judged).
unsigned long long pid_namespace() {
  struct stat st;
  if (::stat("/proc/self/ns/pid", &st) != 0) return 0;
  return static_cast<unsigned long long>(st.st_ino);
}

// 1 to `most` decimal digits (at most 19: the value fits, std::stoull cannot throw).
bool all_digits(const std::string& s, size_t most) {
  if (s.empty() || s.size() > most) return false;
  for (char c : s)
    if (c < '0' || c > '9') return false;
  return true;
}

bool job_ok(const std::string& s) {
  if (s.empty()) return false;
  for (char c : s)
    if (!std::isalnum(static_cast<unsigned char>(c))) return false;
  return true;
}

// "ringdp-<job>-r<rank>-p<pid>-n<ns>" (no leading '/') -> pid and ns; false for any other name.
bool parse_name(const std::string& n, long long* pid, unsigned long long* ns) {
  const size_t pre = sizeof(kPrefix) - 1;
  if (n.compare(0, pre, kPrefix) != 0) return false;
  const size_t at_n = n.rfind("-n"), at_p = n.rfind("-p", at_n), at_r = n.rfind("-r", at_p);
  if (at_n == std::string::npos || at_p == std::string::npos || at_r == std::string::npos || at_r < pre)
    return false;
  const std::string job = n.substr(pre, at_r - pre), rank = n.substr(at_r + 2, at_p - at_r - 2),
                    p = n.substr(at_p + 2, at_n - at_p - 2), s = n.substr(at_n + 2);
  if (!job_ok(job) || !all_digits(rank, 10) || !all_digits(p, 10) || !all_digits(s, 19)) return false;
  *pid = std::stoll(p);
  *ns = std::stoull(s);
  return true;
}

// The process `pid` of this namespace is gone, or a zombie (it will never unlink anything).
bool creator_dead(long long pid) {
  if (pid <= 1 || pid > INT_MAX) return false;
  if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) {
    char path[64];
    std::snprintf(path, sizeof(path), "/proc/%lld/stat", pid);
    FILE* f = std::fopen(path, "r");
    if (!f) return false;
    char buf[512];
    const size_t got = std::fread(buf, 1, sizeof(buf) - 1, f);
    std::fclose(f);
    buf[got] = '\0';
    const char* close = std::strrchr(buf, ')');  // "pid (comm) S ...": comm may hold ')'
    return close && close[1] == ' ' && (close[2] == 'Z' || close[2] == 'X');
  }
  return true;
}

// ---- the SIGTERM guard -----------------------------------------------------------------
// Slots the handler reads without a lock: a slot's path and owner are written while its
// state is kBusy and published by the release store of kArmed.
enum : int { kFree = 0, kBusy = 1, kArmed = 2 };
static_assert(std::atomic<int>::is_always_lock_free, "the SIGTERM handler reads atomics");

struct Slot {
  std::atomic<int> state{kFree};
  pid_t owner = 0;  // a forked child inherits the slots, never the names
  char path[sizeof(kDir) + NAME_MAX + 1] = {};
};

constexpr int kSlots = 64;
Slot g_slots[kSlots];
std::mutex g_mu;               // guard_name / unguard_name (never taken by the handler)
int g_guarded = 0;             // names guarded now; the handler is installed while > 0
bool g_installed = false;
struct sigaction g_prev;       // the disposition the handler replaced, for chaining

void on_sigterm(int sig, siginfo_t* info, void* ctx) {
  const int saved = errno;
  const pid_t me = ::getpid();
  for (Slot& s : g_slots)
    if (s.state.load(std::memory_order_acquire) == kArmed && s.owner == me) ::unlink(s.path);
  if (g_prev.sa_handler == SIG_DFL) {
    struct sigaction dfl;
    std::memset(&dfl, 0, sizeof(dfl));
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    ::sigaction(sig, &dfl, nullptr);
    ::raise(sig);  // blocked while this handler runs: delivered (and fatal) on return
  } else if (g_prev.sa_handler != SIG_IGN) {
    if (g_prev.sa_flags & SA_SIGINFO) {
      g_prev.sa_sigaction(sig, info, ctx);
    } else {
      g_prev.sa_handler(sig);
    }
  }
  errno = saved;
}

bool is_ours(const struct sigaction& sa) {
  return (sa.sa_flags & SA_SIGINFO) && sa.sa_sigaction == on_sigterm;
}

void install() {  // g_mu held
  struct sigaction cur;
  if (::sigaction(SIGTERM, nullptr, &cur) != 0 || cur.sa_handler == SIG_IGN || is_ours(cur)) return;
  g_prev = cur;  // before the handler can run
  struct sigaction sa;
  std::memset(&sa, 0, sizeof(sa));
  sa.sa_sigaction = on_sigterm;
  sa.sa_mask = cur.sa_mask;
  // As the previous disposition: a handler without SA_RESTART (Python's) wants EINTR.
  sa.sa_flags = SA_SIGINFO | (cur.sa_flags & (SA_RESTART | SA_ONSTACK));
  struct sigaction old;
  if (::sigaction(SIGTERM, &sa, &old) != 0) return;
  g_prev = old;  // the same unless another thread changed it in between
  g_installed = true;
}

void uninstall() {  // g_mu held
  if (!g_installed) return;
  g_installed = false;
  struct sigaction cur;
  if (::sigaction(SIGTERM, nullptr, &cur) == 0 && is_ours(cur)) ::sigaction(SIGTERM, &g_prev, nullptr);
}

}  // namespace

std::string segment_name(const std::string& job, int rank) {
  if (!job_ok(job) || rank < 0) throw RingError(cat("invalid segment job id '", job, "' or rank ", rank));
  return cat("/", kPrefix, job, "-r", rank, "-p", ::getpid(), "-n", pid_namespace());
}

std::vector<std::string> reap_stale() {
  std::vector<std::string> removed;
  const unsigned long long me = pid_namespace();
  if (me == 0) return removed;
  DIR* d = ::opendir(kDir);
  if (!d) return removed;
  const int fd = ::dirfd(d);
  const uid_t uid = ::geteuid();
  while (const struct dirent* e = ::readdir(d)) {
    long long pid = 0;
    unsigned long long ns = 0;
    if (!parse_name(e->d_name, &pid, &ns) || ns != me) continue;
    struct stat st;
    if (::fstatat(fd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode) || st.st_uid != uid)
      continue;
    if (creator_dead(pid) && ::unlinkat(fd, e->d_name, 0) == 0) removed.emplace_back(e->d_name);
  }
  ::closedir(d);
  return removed;
}

void guard_name(const std::string& name) {
  std::lock_guard<std::mutex> lock(g_mu);
  for (Slot& s : g_slots) {
    if (s.state.load(std::memory_order_relaxed) != kFree) continue;
    s.state.store(kBusy, std::memory_order_relaxed);
    if (std::snprintf(s.path, sizeof(s.path), "%s%s", kDir, name.c_str()) >= static_cast<int>(sizeof(s.path))) {
      s.state.store(kFree, std::memory_order_relaxed);
      return;  // longer than any /dev/shm name: shm_open will refuse it
    }
    s.owner = ::getpid();
    s.state.store(kArmed, std::memory_order_release);
    if (g_guarded++ == 0) install();
    return;
  }
}

void unguard_name(const std::string& name) {
  std::lock_guard<std::mutex> lock(g_mu);
  const pid_t me = ::getpid();
  for (Slot& s : g_slots) {
    if (s.state.load(std::memory_order_relaxed) != kArmed || s.owner != me) continue;
    if (std::strncmp(s.path, kDir, sizeof(kDir) - 1) != 0 || name != s.path + sizeof(kDir) - 1) continue;
    s.state.store(kFree, std::memory_order_release);
    if (--g_guarded == 0) uninstall();
    return;
  }
}

}  // namespace shm
}  // namespace ringdp
