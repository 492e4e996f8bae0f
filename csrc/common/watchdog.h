// A watchdog for work that finishes elsewhere, on its own (an NCCL step on a CUDA stream):
// the thread that enqueues a piece of work hands the watchdog a token for it and a timeout;
// the watchdog's thread polls the tokens until each is done, and when one is not done by
// its deadline, or the transport reports an asynchronous error while work is in flight, it
// calls `expire(reason)`, once. The owner's expire aborts what the work waits on (NCCL:
// ncclCommAbort, after which the kernels return), so a program that only joins streams and
// then synchronises the host itself (`loss.item()`) is not left waiting in CUDA forever
// for a dead peer; the owner raises the reason at its next call.
//
// Torch-free and CUDA-free (the hooks carry the CUDA part): tests/cpp/watchdog.cpp drives
// it with fake work on threads.
//
// Rules:
//   * tokens finish in the order they were watched (the work of one stream): only the
//     oldest is polled for done(); the deadlines of all are checked;
//   * a token is retired (handed back to its owner) exactly once: when done() said so, or
//     by stop();
//   * the thread starts at the first watch(): an owner that never enqueues has none;
//   * hooks run on the watchdog's thread without its lock held, and never after stop()
//     returned; they must not call the Watchdog back.
#pragma once
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "bounded.h"
#include "error.h"

namespace ringdp {

class Watchdog {
 public:
  using Clock = std::chrono::steady_clock;

  struct Hooks {
    std::function<bool(void*)> done;                  // the work behind the token finished (or failed)
    std::function<std::string()> error;               // "" or the transport's asynchronous error
    std::function<void(const std::string&)> expire;   // at most once
    std::function<void(void*)> retire;                // the token is no longer watched: reuse it
  };

  // `poll`: how often the oldest token is asked while work is in flight (torch polls every
  // 100 ms; the deadlines here are seconds, and a finished token goes back to its owner sooner)
  explicit Watchdog(Hooks hooks, std::chrono::microseconds poll = std::chrono::milliseconds(10))
      : h_(std::move(hooks)), poll_(poll) {}
  ~Watchdog() { stop(); }
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // After enqueueing the work behind `token`: it must be done within `timeout_s` seconds
  // from now (0, infinity: no limit; bounded.h limits()). `what` names it in the reason ("all_reduce of 4096 B").
  // After stop(), the token is retired at once.
  void watch(void* token, double timeout_s, std::string what) {
    std::unique_lock<std::mutex> lk(mu_);
    if (stopping_) {
      lk.unlock();
      h_.retire(token);
      return;
    }
    const Clock::time_point now = Clock::now();
    Clock::time_point deadline = Clock::time_point::max();
    if (limits(timeout_s))
      deadline = now + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
    items_.push_back(Item{token, now, deadline, timeout_s, std::move(what)});
    if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
    lk.unlock();
    cv_.notify_one();
  }

  // Join the thread and retire every token still watched (done or not). Idempotent.
  void stop() {
    std::deque<Item> left;
    {
      std::lock_guard<std::mutex> lk(mu_);
      stopping_ = true;
    }
    cv_.notify_one();
    if (thread_.joinable()) thread_.join();
    {
      std::lock_guard<std::mutex> lk(mu_);
      left.swap(items_);
    }
    for (const Item& it : left) h_.retire(it.token);
  }

  bool expired() const {
    std::lock_guard<std::mutex> lk(mu_);
    return expired_;
  }
  size_t watching() const {
    std::lock_guard<std::mutex> lk(mu_);
    return items_.size();
  }

 private:
  struct Item {
    void* token;
    Clock::time_point enqueued, deadline;
    double timeout_s;
    std::string what;
  };

  // The reason to expire now, or "": an asynchronous error, else the item past its deadline.
  std::string why(const Clock::time_point now, const Item* late) const {
    if (late == nullptr) return std::string();
    const double waited = std::chrono::duration<double>(now - late->enqueued).count();
    return cat(late->what, " not finished ", waited, " s after it was enqueued (timeout ", late->timeout_s,
               " s): a peer is stuck or dead, or the ranks made different collective calls");
  }

  void run() {
    std::unique_lock<std::mutex> lk(mu_);
    while (!stopping_) {
      if (items_.empty()) {
        cv_.wait(lk, [this] { return stopping_ || !items_.empty(); });
        continue;
      }
      void* oldest = items_.front().token;
      const bool fired = expired_;
      lk.unlock();
      const bool done = h_.done(oldest);
      std::string reason;
      if (!done && !fired) {
        std::string err = h_.error();
        if (!err.empty()) reason = std::move(err);
      }
      lk.lock();
      if (done) {  // (only this thread pops: the front is still `oldest`)
        items_.pop_front();
        lk.unlock();
        h_.retire(oldest);
        lk.lock();
        continue;
      }
      if (!fired && reason.empty()) {  // a deadline passed? (any item: timeouts may differ)
        const Clock::time_point now = Clock::now();
        const Item* late = nullptr;
        for (const Item& it : items_)
          if (it.deadline <= now && (late == nullptr || it.deadline < late->deadline)) late = &it;
        reason = why(now, late);
      }
      if (!reason.empty()) {
        expired_ = true;
        lk.unlock();
        h_.expire(reason);
        lk.lock();
        continue;  // keep retiring: after the owner's abort the work finishes
      }
      cv_.wait_for(lk, poll_, [this] { return stopping_; });
    }
  }

  Hooks h_;
  const std::chrono::microseconds poll_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> items_;
  bool stopping_ = false;
  bool expired_ = false;
  std::thread thread_;
};

}  // namespace ringdp
