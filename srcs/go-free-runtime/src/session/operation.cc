#include "session/operation.h"

#include <atomic>
#include <utility>

namespace kungfu {

Status OpNameFor(OpKind kind, const std::string& given, std::string* name) {
  *name = given.empty() ? std::string("auto:") + OpKindName(kind) : given;
  if (name->find('\0') != std::string::npos) {
    return InvalidArgument("an operation name may not contain NUL");
  }
  return Status::OK();
}

int TrackId() {
  static std::atomic<int> next{1};
  thread_local int id = next.fetch_add(1);
  return id;
}

void EndOperation(Transport& t, const OpEnd& op, Status s,
                  const std::function<void(TimelineEvent)>& record,
                  const std::function<OpTiming(int64_t wait_us)>& timing, const Handle& h) {
  if (!s.ok()) {
    s = s.WithContext(std::string(OpKindName(op.kind)) + " '" + op.name + "'");
    // Whatever failed (bad input, disagreement, a deadline, a peer that died or left), peers may
    // be waiting on this peer's part of the op: tell them at once. Best effort: a peer that
    // cannot be reached learns of the failure itself.
    if (op.abort && s.code() != Code::kCancelled) t.AbortOp(op.name, op.seq, s);
  }
  int64_t wait_us = -1;
  t.EndOp(op.name, op.seq, &wait_us);
  if (record) {
    const OpTiming tm = timing(wait_us);
    TimelineEvent e;
    e.kind = OpKindName(op.kind);
    e.name = op.name;
    e.seq = op.seq;
    e.bytes = op.bytes;
    e.strategy = tm.strategy;
    e.start_us = tm.start_us;
    e.dur_us = tm.dur_us;
    e.queue_us = tm.queue_us;
    e.wait_us = tm.wait_us;
    e.status = s.ok() ? "OK" : CodeName(s.code());
    e.track = TrackId();
    record(std::move(e));
  }
  h.Complete(s);
}

}  // namespace kungfu
