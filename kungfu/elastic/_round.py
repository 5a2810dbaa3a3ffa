"""The decision round: policies' actions recorded, agreed and applied at the same step everywhere.

A trainer (kf.Hook, or a PyTorch loop) owns one `Round` and drives it at its step boundaries:

    round.run("after_step")   # opens the round if needed, runs the policies' hook
    round.agree(report)       # agrees on the decisions and applies the winners; opens the next

Inside a round, an action (kf.set_tree, kf.set_batch_size, kf.resize, ...;
kungfu/elastic/_actions.py) is checked at once (bad input raises ValueError in the caller, on
whichever worker called it) and recorded. `agree`:

1. lets the membership record what the protocol needs decided (rank 0: switch to or abandon a
   pending resize, a replacement after a recovery, a cluster asked for from outside);
2. gathers every worker's recorded decisions (JSON) and report in one allgather; what a
   report holds under "same" (the learning rate, say) must be the same in every worker's, or
   every worker fails at once naming the values (workers that drifted apart would go on
   training to different results, silently);
3. for each kind of action, the decision of the lowest rank that took one wins (so a decision
   taken on one worker only is applied everywhere, and two conflicting ones resolve the same way
   on every worker);
4. applies the winners in the order of ACTIONS, the registry below.

Applying is the runtime's (strategy), the membership's (resize, switch) or the trainer's
(batch size, learning rate: the framework binding knows its data and optimizer).
"""
from __future__ import annotations

import functools
import inspect
import json
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from kungfu import _collective, _env, _peer, _strategy
from kungfu.elastic._protocol import context
from kungfu.elastic._state import TrainingState

HOOKS = ("before_train", "before_epoch", "before_step", "after_step", "after_epoch",
         "after_train")


def _resize(r: "Round", decision) -> None:
    n, leave = (decision, []) if isinstance(decision, int) else (decision["size"],
                                                                  decision["leave"])
    r.trainer.check_resize(n, leave)
    r.membership.apply_resize(n, leave, None if isinstance(decision, int)
                              else decision.get("request"))


# The registry of actions: kind -> how the agreed winner is applied, in the order applied.
ACTIONS: Dict[str, Callable[["Round", object], None]] = {
    "strategy": lambda r, decision: _strategy.apply(decision),
    "batch_size": lambda r, b: r.trainer.set_batch_size(b),
    "batch_sizes": lambda r, sizes: r.trainer.set_batch_sizes(sizes),
    "learning_rate": lambda r, lr: r.trainer.set_learning_rate(lr),
    "resize": _resize,
    "elastic": lambda r, decision: r.membership.apply_elastic(decision),
}

_open: Optional["Round"] = None  # the round a policy hook may record into now


def current() -> Optional["Round"]:
    """The open round, or None outside the policy hooks a trainer runs."""
    return _open


def in_round() -> bool:
    return _open is not None


def record(kind: str, value) -> bool:
    """Records a decision in the open round; False when none is open."""
    if _open is None:
        return False
    _open.decisions[kind] = value
    return True


@functools.lru_cache(maxsize=None)
def _takes_state(cls: type, hook: str) -> bool:
    try:
        params = inspect.signature(getattr(cls, hook)).parameters.values()
    except (TypeError, ValueError):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD,
                                                    p.VAR_POSITIONAL)]
    return len(positional) > 1  # self, and the state


def call_hook(policy, hook: str, state: TrainingState) -> None:
    """policy.<hook>(state); or policy.<hook>() for a hook written without the state argument,
    as the KungFu talk writes them (`def after_step(self):`)."""
    fn = getattr(policy, hook)
    if _takes_state(type(policy), hook):
        fn(state)
    else:
        fn()


class Round:
    """The decision rounds of one trainer (see the module doc). `trainer` is a
    kungfu.elastic.Trainer; `membership` its Membership; `name` names the agreement's collectives
    (the k-th round of a worker meets the k-th of the others: the runtime numbers successive
    uses of a name, and a new cluster version starts over)."""

    def __init__(self, trainer, membership, name: str):
        self.trainer = trainer
        self.membership = membership
        self.name = name
        self.decisions: Dict[str, object] = {}

    def open(self) -> None:
        global _open
        if _open is not self:
            self.decisions = {}
            _open = self

    def close(self) -> Dict[str, object]:
        """Ends the open round; returns its decisions."""
        global _open
        decisions, self.decisions = self.decisions, {}
        if _open is self:
            _open = None
        return decisions

    def recorded(self, kind: str) -> bool:
        return kind in self.decisions

    def run(self, hook: str) -> None:
        """Runs `hook` of every policy, in the open round (opened if needed)."""
        assert hook in HOOKS
        self.open()
        state = self.trainer.state
        ctx = context()
        if ctx.enabled:
            state.min_size, state.max_size = _env.MIN_SIZE.get(), ctx.max_size()
        else:
            state.min_size = state.max_size = state.cluster_size
        state.resize_pending = ctx.pending is not None
        for p in self.trainer.policies:
            call_hook(p, hook, state)

    def agree(self, report: Optional[dict] = None) -> List[Optional[dict]]:
        """Agrees on the round's decisions, opens the next round and applies the winners there
        (an action taken while applying belongs to the next round). Returns every worker's
        `report` (what it measured, riding on the round's allgather), in rank order."""
        self.membership.before_agree(self.decisions)
        winners, reports = self._gather(self.close(), report)
        _check_same(reports)
        self.open()
        for kind, apply in ACTIONS.items():
            if kind in winners:
                apply(self, winners[kind])
        return reports

    def _gather(self, decisions: Dict[str, object], report: Optional[dict]
                ) -> Tuple[Dict[str, object], List[Optional[dict]]]:
        """(winners, reports): the winning decision of each kind (the lowest deciding rank's),
        and every worker's report in rank order, the same on every worker."""
        if _peer.identity().size == 1:
            return dict(decisions), [report]
        mine = json.dumps({"decisions": decisions, "report": report}, sort_keys=True).encode()
        mine = np.frombuffer(mine, dtype=np.uint8)
        lengths = _collective.allgather(np.array([mine.size], dtype=np.int64),
                                        name=f"{self.name}/agree/lengths")
        payload = _collective.allgather(mine, name=f"{self.name}/agree/decisions")
        winners: Dict[str, object] = {}
        reports = []
        offset = 0
        for length in lengths.tolist():
            theirs = json.loads(payload[offset:offset + length].tobytes().decode())
            offset += length
            reports.append(theirs["report"])
            for kind, value in theirs["decisions"].items():
                winners.setdefault(kind, value)
        return winners, reports


def _check_same(reports: List[Optional[dict]]) -> None:
    """Raises on every worker alike if the reports' "same" entries differ (see the doc)."""
    seen: Dict[str, Dict[str, List[int]]] = {}
    for rank, r in enumerate(reports):
        for key, value in ((r or {}).get("same") or {}).items():
            seen.setdefault(key, {}).setdefault(str(value), []).append(rank)
    for key, values in seen.items():
        if len(values) > 1:
            which = "; ".join(f"{v} on rank{'s' * (len(r) > 1)} {', '.join(map(str, r))}"
                              for v, r in values.items())
            raise RuntimeError(f"kungfu: the workers' {key} differ ({which}): they would train to "
                               f"different results. Something changed it on some workers only "
                               f"(a callback or policy that decides from a worker's own values?)")
