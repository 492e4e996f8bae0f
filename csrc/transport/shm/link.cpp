#include "link.h"

namespace ringdp {
namespace shm {

namespace {
Control& control_at(char* base) { return *reinterpret_cast<Control*>(base); }
}  // namespace

Link::Link(const Neighbours& n, const Geometry& geo, const WaitPolicy& policy, Watch& watch)
    : rank_(n.rank),
      world_(n.world),
      prev_(n.prev),
      next_(n.next),
      me_(&control_at(n.mine)),
      prev_ctrl_(&control_at(n.prev_base)),
      next_ctrl_(&control_at(n.next_base)),
      my_fifo_(n.mine + geo.fifo_offset()),
      prev_fifo_(n.prev_base + geo.fifo_offset()),
      slots_(geo.fifo_slots),
      slot_bytes_(geo.slot_bytes),
      policy_(policy),
      watch_(watch) {}

void Link::wait(const Flag& flag, Control& owner, int owner_rank, uint32_t target, const char* what) {
  wait_reached(flag, owner.sleepers, target, policy_, [&] { watch_.check(owner_rank, what); }, &learner_);
}

char* Link::out_slot() {
  // Slot posted % slots is free once the successor has consumed slice posted - slots.
  wait(next_ctrl_->consumed, *next_ctrl_, next_, posted_ + 1 - static_cast<uint32_t>(slots_),
       "a free slot (successor is behind)");
  return my_fifo_ + (posted_ % slots_) * slot_bytes_;
}

void Link::post() { publish(me_->posted, me_->sleepers, ++posted_); }

void Link::wait_in() { wait(prev_ctrl_->posted, *prev_ctrl_, prev_, consumed_ + 1, "data from predecessor"); }

const char* Link::in_slot() {
  wait_in();
  return prev_fifo_ + (consumed_ % slots_) * slot_bytes_;
}

void Link::consume() { publish(me_->consumed, me_->sleepers, ++consumed_); }

}  // namespace shm
}  // namespace ringdp
